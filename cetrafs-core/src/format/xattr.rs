//! Extended attributes: all of an inode's xattrs live in one 4 KiB block (as ext4 limits
//! them to one block), so a getxattr is one read and a setxattr one write.
//!
//! ```text
//!  0  40 block header (type Xattr, owner = inode)
//! 40   2 count   42 2 reserved   44 4 bytes used
//! 48 ... entries: u8 name length | u16 value length | name | value   (sorted by name)
//! ```

use super::block::{BlockHeader, BlockType};
use super::codec::{Reader, Writer};
use super::FS_BLOCK_SIZE;
use crate::error::{Error, Result};

pub const XATTR_HDR: usize = 48;
pub const XATTR_CAP: usize = FS_BLOCK_SIZE - XATTR_HDR;

pub type XattrMap = std::collections::BTreeMap<Vec<u8>, Vec<u8>>;

pub fn encoded_len(map: &XattrMap) -> usize {
    map.iter().map(|(k, v)| 3 + k.len() + v.len()).sum()
}

pub fn encode(map: &XattrMap, blockno: u64, seq: u64, owner: u64) -> Vec<u8> {
    let used = encoded_len(map);
    assert!(used <= XATTR_CAP);
    let mut b = vec![0u8; FS_BLOCK_SIZE];
    let mut w = Writer::new(&mut b);
    #[allow(clippy::cast_possible_truncation)] // bounded by XATTR_CAP
    {
        w.u16(40, map.len() as u16);
        w.u32(44, used as u32);
    }
    let mut o = XATTR_HDR;
    for (k, v) in map {
        #[allow(clippy::cast_possible_truncation)] // names <= 255, values < 4 KiB
        {
            w.u8(o, k.len() as u8);
            w.u16(o + 1, v.len() as u16);
        }
        w.bytes(o + 3, k);
        w.bytes(o + 3 + k.len(), v);
        o += 3 + k.len() + v.len();
    }
    BlockHeader {
        btype: BlockType::Xattr,
        blockno,
        seq,
        owner,
    }
    .seal(&mut b);
    b
}

pub fn decode(buf: &[u8], at: u64) -> Result<(u64, XattrMap)> {
    let h = BlockHeader::check(buf, BlockType::Xattr, at)?;
    let r = Reader::new(buf, "xattr block");
    let n = r.u16(40)? as usize;
    let mut map = XattrMap::new();
    let mut o = XATTR_HDR;
    for _ in 0..n {
        let kl = r.u8(o)? as usize;
        let vl = r.u16(o + 1)? as usize;
        let k = r.bytes(o + 3, kl)?.to_vec();
        let v = r.bytes(o + 3 + kl, vl)?.to_vec();
        if kl == 0 || map.insert(k, v).is_some() {
            return Err(Error::corrupted(format!(
                "xattr block {at}: empty or duplicate name"
            )));
        }
        o += 3 + kl + vl;
    }
    if o - XATTR_HDR != r.u32(44)? as usize {
        return Err(Error::corrupted(format!(
            "xattr block {at}: sizes do not add up"
        )));
    }
    Ok((h.seq, map))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    proptest! {
        #[test]
        fn roundtrip(m in proptest::collection::btree_map(proptest::collection::vec(1u8..255, 1..40), proptest::collection::vec(any::<u8>(), 0..100), 0..20), flip in 0usize..FS_BLOCK_SIZE*8) {
            let mut b = encode(&m, 77, 3, 5);
            prop_assert_eq!(decode(&b, 77).unwrap(), (3, m));
            b[flip / 8] ^= 1 << (flip % 8);
            prop_assert!(decode(&b, 77).is_err());
        }
    }
}
