//! Fuzz target `object_lock`: see `cetrafs_fuzz::targets::object_lock` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::object_lock(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "object_lock",
        cetrafs_fuzz::targets::object_lock,
        cetrafs_fuzz::seeds::object_lock,
    );
}
