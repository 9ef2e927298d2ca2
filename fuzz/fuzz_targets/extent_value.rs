//! Fuzz target `extent_value`: see `cetrafs_fuzz::targets::extent_value` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::extent_value(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "extent_value",
        cetrafs_fuzz::targets::extent_value,
        cetrafs_fuzz::seeds::extent_value,
    );
}
