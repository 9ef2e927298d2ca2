//! Fuzz target `journal_record`: see `cetrafs_fuzz::targets::journal_record` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::journal_record(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "journal_record",
        cetrafs_fuzz::targets::journal_record,
        cetrafs_fuzz::seeds::journal_record,
    );
}
