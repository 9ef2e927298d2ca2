//! Fuzz target `xattr`: see `cetrafs_fuzz::targets::xattr` for what it asserts.
#![cfg_attr(feature = "libfuzzer", no_main)]

#[cfg(feature = "libfuzzer")]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cetrafs_fuzz::targets::xattr(data));

#[cfg(not(feature = "libfuzzer"))]
fn main() {
    cetrafs_fuzz::stable::main(
        "xattr",
        cetrafs_fuzz::targets::xattr,
        cetrafs_fuzz::seeds::xattr,
    );
}
