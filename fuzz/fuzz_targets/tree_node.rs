//! Fuzz target `tree_node`: see `cetrafs_fuzz::targets::tree_node` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::tree_node(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "tree_node",
        cetrafs_fuzz::targets::tree_node,
        cetrafs_fuzz::seeds::tree_node,
    );
}
