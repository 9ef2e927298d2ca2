//! Fuzz target `mailbox`: see `cetrafs_fuzz::targets::mailbox` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::mailbox(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "mailbox",
        cetrafs_fuzz::targets::mailbox,
        cetrafs_fuzz::seeds::mailbox,
    );
}
