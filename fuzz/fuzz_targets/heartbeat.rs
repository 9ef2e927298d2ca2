//! Fuzz target `heartbeat`: see `cetrafs_fuzz::targets::heartbeat` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::heartbeat(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "heartbeat",
        cetrafs_fuzz::targets::heartbeat,
        cetrafs_fuzz::seeds::heartbeat,
    );
}
