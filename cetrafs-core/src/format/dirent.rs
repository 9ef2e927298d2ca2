//! Directory entries. A directory is a B+tree keyed by a 64-bit hash of the name; the value
//! holds every entry whose name has that hash (almost always one), so lookups are O(log n)
//! and collisions cost nothing extra in the tree. The key doubles as the stable readdir cookie.
//!
//! Value = repeated `u64 ino | u8 file type (DT_*) | u8 name length | name bytes`.

use super::codec::Reader;
use crate::error::{Error, Result};

pub const MAX_NAME: usize = 255;
/// Cookies 0..=2 are readdir positions for the start, "." and ".."; real keys start above.
pub const FIRST_HASH_KEY: u64 = 3;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub name: Vec<u8>,
    pub ino: u64,
    pub dtype: u8,
}

/// The tree key of a name: crc32c-based 63-bit hash (positive as an i64 readdir offset),
/// kept away from the reserved cookies. Stable forever: it is part of the format.
pub fn name_hash(name: &[u8]) -> u64 {
    let lo = u64::from(crc32c::crc32c(name));
    let hi = u64::from(crc32c::crc32c_append(0x9e37_79b9, name));
    let h = ((hi << 32) | lo) & (i64::MAX as u64);
    h.max(FIRST_HASH_KEY)
}

pub fn encode_entries(entries: &[DirEntry]) -> Vec<u8> {
    let mut v = Vec::new();
    for e in entries {
        v.extend_from_slice(&e.ino.to_le_bytes());
        v.push(e.dtype);
        #[allow(clippy::cast_possible_truncation)] // names are <= 255 bytes, checked by callers
        v.push(e.name.len() as u8);
        v.extend_from_slice(&e.name);
    }
    v
}

pub fn decode_entries(v: &[u8]) -> Result<Vec<DirEntry>> {
    let r = Reader::new(v, "directory entry");
    let mut out = Vec::new();
    let mut o = 0;
    while o < v.len() {
        let ino = r.u64(o)?;
        let dtype = r.u8(o + 8)?;
        let n = r.u8(o + 9)? as usize;
        let name = r.bytes(o + 10, n)?.to_vec();
        if n == 0 || ino == 0 || name.contains(&b'/') || name.contains(&0) {
            return Err(Error::corrupted(
                "directory entry with an invalid name or inode",
            ));
        }
        out.push(DirEntry { name, ino, dtype });
        o += 10 + n;
    }
    if out.is_empty() {
        return Err(Error::corrupted("empty directory entry record"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    proptest! {
        #[test]
        fn roundtrip(names in proptest::collection::vec("[a-z0-9._-]{1,255}", 1..4)) {
            let es: Vec<DirEntry> = names.iter().enumerate().map(|(i, n)| DirEntry { name: n.as_bytes().to_vec(), ino: 100 + i as u64, dtype: 8 }).collect();
            prop_assert_eq!(decode_entries(&encode_entries(&es)).unwrap(), es);
        }
        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = decode_entries(&data);
        }
        #[test]
        fn hash_range(name in proptest::collection::vec(any::<u8>(), 1..255)) {
            let h = name_hash(&name);
            prop_assert!(h >= FIRST_HASH_KEY && i64::try_from(h).is_ok());
        }
    }
}
