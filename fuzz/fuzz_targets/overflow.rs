//! Fuzz target `overflow`: see `cetrafs_fuzz::targets::overflow` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::overflow(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "overflow",
        cetrafs_fuzz::targets::overflow,
        cetrafs_fuzz::seeds::overflow,
    );
}
