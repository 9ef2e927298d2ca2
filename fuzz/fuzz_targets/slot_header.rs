//! Fuzz target `slot_header`: see `cetrafs_fuzz::targets::slot_header` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::slot_header(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "slot_header",
        cetrafs_fuzz::targets::slot_header,
        cetrafs_fuzz::seeds::slot_header,
    );
}
