//! Fuzz target `dirent`: see `cetrafs_fuzz::targets::dirent` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::dirent(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "dirent",
        cetrafs_fuzz::targets::dirent,
        cetrafs_fuzz::seeds::dirent,
    );
}
