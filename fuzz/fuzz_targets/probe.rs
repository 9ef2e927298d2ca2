//! Fuzz target `probe`: see `cetrafs_fuzz::targets::probe` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::probe(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "probe",
        cetrafs_fuzz::targets::probe,
        cetrafs_fuzz::seeds::probe,
    );
}
