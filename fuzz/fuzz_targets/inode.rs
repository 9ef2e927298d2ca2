//! Fuzz target `inode`: see `cetrafs_fuzz::targets::inode` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::inode(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "inode",
        cetrafs_fuzz::targets::inode,
        cetrafs_fuzz::seeds::inode,
    );
}
