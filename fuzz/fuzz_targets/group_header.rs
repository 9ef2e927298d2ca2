//! Fuzz target `group_header`: see `cetrafs_fuzz::targets::group_header` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::group_header(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "group_header",
        cetrafs_fuzz::targets::group_header,
        cetrafs_fuzz::seeds::group_header,
    );
}
