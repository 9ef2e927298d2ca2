//! Fuzz target `block_header`: see `cetrafs_fuzz::targets::block_header` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::block_header(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "block_header",
        cetrafs_fuzz::targets::block_header,
        cetrafs_fuzz::seeds::block_header,
    );
}
