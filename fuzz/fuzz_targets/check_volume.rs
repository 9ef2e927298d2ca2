//! Fuzz target `check_volume`: see `cetrafs_fuzz::targets::check_volume` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::check_volume(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "check_volume",
        cetrafs_fuzz::targets::check_volume,
        cetrafs_fuzz::seeds::check_volume,
    );
}
