//! Fuzz target `bitmap`: see `cetrafs_fuzz::targets::bitmap` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::bitmap(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "bitmap",
        cetrafs_fuzz::targets::bitmap,
        cetrafs_fuzz::seeds::bitmap,
    );
}
