//! Fuzz target `superblock`: see `cetrafs_fuzz::targets::superblock` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::superblock(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "superblock",
        cetrafs_fuzz::targets::superblock,
        cetrafs_fuzz::seeds::superblock,
    );
}
