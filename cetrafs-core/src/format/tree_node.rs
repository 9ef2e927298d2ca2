//! B+tree node: the one tree block format used by extent trees (key = file block, value = an
//! extent) and directories (key = name hash, value = the entries with that hash).
//!
//! ```text
//!  0  40 block header (type TreeNode, owner = inode)
//! 40   2 level (0 = leaf)     42 2 entry count     44 4 bytes used by entries
//! 48 ... entries, sorted by key, strictly increasing:
//!        leaf:     u64 key | u16 value length | value
//!        internal: u64 key | u64 child block   (key = smallest key in the child's subtree,
//!                                               except entry 0 which covers everything below)
//! ```

use super::block::{BlockHeader, BlockType};
use super::codec::{Reader, Writer};
use super::FS_BLOCK_SIZE;
use crate::error::{Error, Result};

pub const NODE_HDR: usize = 48;
pub const NODE_CAP: usize = FS_BLOCK_SIZE - NODE_HDR;
pub const LEAF_ENTRY_OVERHEAD: usize = 10;
pub const INTERNAL_ENTRY: usize = 16;
/// Largest value a leaf accepts: four values must fit in a node so splits always succeed.
pub const MAX_VALUE: usize = NODE_CAP / 4 - LEAF_ENTRY_OVERHEAD;
pub const MAX_LEVEL: u16 = 16;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeEntries {
    Leaf(Vec<(u64, Vec<u8>)>),
    Internal(Vec<(u64, u64)>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeNode {
    pub blockno: u64,
    pub seq: u64,
    pub owner: u64,
    pub level: u16,
    pub entries: NodeEntries,
}

impl TreeNode {
    pub fn used_bytes(&self) -> usize {
        match &self.entries {
            NodeEntries::Leaf(v) => v
                .iter()
                .map(|(_, val)| LEAF_ENTRY_OVERHEAD + val.len())
                .sum(),
            NodeEntries::Internal(v) => v.len() * INTERNAL_ENTRY,
        }
    }

    pub fn len(&self) -> usize {
        match &self.entries {
            NodeEntries::Leaf(v) => v.len(),
            NodeEntries::Internal(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn encode(&self) -> Vec<u8> {
        let used = self.used_bytes();
        assert!(used <= NODE_CAP, "tree node overfull");
        let mut b = vec![0u8; FS_BLOCK_SIZE];
        let mut w = Writer::new(&mut b);
        w.u16(40, self.level);
        #[allow(clippy::cast_possible_truncation)] // bounded by NODE_CAP
        {
            w.u16(42, self.len() as u16);
            w.u32(44, used as u32);
        }
        let mut o = NODE_HDR;
        match &self.entries {
            NodeEntries::Leaf(v) => {
                for (k, val) in v {
                    w.u64(o, *k);
                    #[allow(clippy::cast_possible_truncation)] // <= MAX_VALUE
                    w.u16(o + 8, val.len() as u16);
                    w.bytes(o + 10, val);
                    o += LEAF_ENTRY_OVERHEAD + val.len();
                }
            }
            NodeEntries::Internal(v) => {
                for (k, c) in v {
                    w.u64(o, *k);
                    w.u64(o + 8, *c);
                    o += INTERNAL_ENTRY;
                }
            }
        }
        BlockHeader {
            btype: BlockType::TreeNode,
            blockno: self.blockno,
            seq: self.seq,
            owner: self.owner,
        }
        .seal(&mut b);
        b
    }

    pub fn decode(buf: &[u8], at: u64) -> Result<Self> {
        let h = BlockHeader::check(buf, BlockType::TreeNode, at)?;
        let r = Reader::new(buf, "tree node");
        let level = r.u16(40)?;
        let count = r.u16(42)? as usize;
        let used = r.u32(44)? as usize;
        let bad = |m: &str| Error::corrupted(format!("tree node {at}: {m}"));
        if level > MAX_LEVEL || used > NODE_CAP {
            return Err(bad("level or size out of range"));
        }
        let mut o = NODE_HDR;
        let mut last: Option<u64> = None;
        let mut check_key = |k: u64| {
            if last.is_some_and(|l| l >= k) {
                return Err(bad("keys out of order"));
            }
            last = Some(k);
            Ok(())
        };
        let entries = if level == 0 {
            let mut v = Vec::with_capacity(count);
            for _ in 0..count {
                let k = r.u64(o)?;
                check_key(k)?;
                let len = r.u16(o + 8)? as usize;
                if len > MAX_VALUE {
                    return Err(bad("value too long"));
                }
                v.push((k, r.bytes(o + 10, len)?.to_vec()));
                o += LEAF_ENTRY_OVERHEAD + len;
            }
            NodeEntries::Leaf(v)
        } else {
            let mut v = Vec::with_capacity(count);
            for _ in 0..count {
                let k = r.u64(o)?;
                check_key(k)?;
                let c = r.u64(o + 8)?;
                if c == 0 || c == at {
                    return Err(bad("bad child pointer"));
                }
                v.push((k, c));
                o += INTERNAL_ENTRY;
            }
            NodeEntries::Internal(v)
        };
        if o - NODE_HDR != used {
            return Err(bad("entry bytes do not add up"));
        }
        Ok(Self {
            blockno: at,
            seq: h.seq,
            owner: h.owner,
            level,
            entries,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn leaf_roundtrip(keys in proptest::collection::btree_set(any::<u64>(), 0..50), at in 1u64..1<<40, flip in 0usize..FS_BLOCK_SIZE*8) {
            let entries: Vec<(u64, Vec<u8>)> = keys.into_iter().map(|k| (k, vec![(k & 0xff) as u8; (k % 40) as usize])).collect();
            let n = TreeNode { blockno: at, seq: 7, owner: 3, level: 0, entries: NodeEntries::Leaf(entries) };
            let mut b = n.encode();
            prop_assert_eq!(TreeNode::decode(&b, at).unwrap(), n);
            b[flip / 8] ^= 1 << (flip % 8);
            prop_assert!(TreeNode::decode(&b, at).is_err());
        }

        #[test]
        fn internal_roundtrip(keys in proptest::collection::btree_set(any::<u64>(), 1..200), at in 1u64..1<<40) {
            let entries: Vec<(u64, u64)> = keys.into_iter().map(|k| (k, (k | 1).max(2) ^ at.max(1) | 1 << 50)).collect();
            let n = TreeNode { blockno: at, seq: 1, owner: 3, level: 2, entries: NodeEntries::Internal(entries) };
            prop_assert_eq!(TreeNode::decode(&n.encode(), at).unwrap(), n);
        }

        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), FS_BLOCK_SIZE..=FS_BLOCK_SIZE), at: u64) {
            let _ = TreeNode::decode(&data, at);
        }
    }
}
