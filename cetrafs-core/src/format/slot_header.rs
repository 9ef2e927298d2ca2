//! Slot header: block 0 of each node slot's journal area. It holds the slot's *orphan list*:
//! inodes that were unlinked while still open on that node. They must outlive their last name
//! until the last close; if the node crashes first, whoever mounts (or recovers) the slot
//! next frees them, so a crash never leaks their blocks.
//!
//! ```text
//!  0  40 block header (type JournalHeader, owner = slot number)
//! 40   4 slot    44 4 orphan count    48 8 reserved
//! 56 ... orphan inode numbers (u64), at most 505
//! ```
//! It changes through the journal like every metadata block. An all-zero block (as mkfs
//! leaves it) means an empty list.

use super::block::{BlockHeader, BlockType};
use super::codec::{Reader, Writer};
use super::FS_BLOCK_SIZE;
use crate::error::{Error, Result};

pub const ORPHANS_OFF: usize = 56;
pub const MAX_ORPHANS: usize = (FS_BLOCK_SIZE - ORPHANS_OFF) / 8;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SlotHeader {
    pub seq: u64,
    pub slot: u32,
    pub orphans: Vec<u64>,
}

impl SlotHeader {
    pub fn encode(&self, at: u64) -> Vec<u8> {
        assert!(self.orphans.len() <= MAX_ORPHANS);
        let mut b = vec![0u8; FS_BLOCK_SIZE];
        let mut w = Writer::new(&mut b);
        w.u32(40, self.slot);
        #[allow(clippy::cast_possible_truncation)] // <= 505
        w.u32(44, self.orphans.len() as u32);
        for (i, o) in self.orphans.iter().enumerate() {
            w.u64(ORPHANS_OFF + i * 8, *o);
        }
        BlockHeader {
            btype: BlockType::JournalHeader,
            blockno: at,
            seq: self.seq,
            owner: u64::from(self.slot),
        }
        .seal(&mut b);
        b
    }

    /// Decode; an all-zero block is the empty header mkfs leaves.
    pub fn decode(buf: &[u8], at: u64, slot: u32) -> Result<Self> {
        if buf.iter().all(|&b| b == 0) {
            return Ok(Self {
                seq: 0,
                slot,
                orphans: Vec::new(),
            });
        }
        let h = BlockHeader::check(buf, BlockType::JournalHeader, at)?;
        let r = Reader::new(buf, "slot header");
        let n = r.u32(44)? as usize;
        if n > MAX_ORPHANS || r.u32(40)? != slot {
            return Err(Error::corrupted(format!(
                "slot header at block {at}: bad slot or orphan count"
            )));
        }
        let orphans = (0..n)
            .map(|i| r.u64(ORPHANS_OFF + i * 8))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            seq: h.seq,
            slot,
            orphans,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    proptest! {
        #[test]
        fn roundtrip(orphans in proptest::collection::vec(any::<u64>(), 0..MAX_ORPHANS), seq: u64, slot in 0u32..64, flip in 0usize..FS_BLOCK_SIZE*8) {
            let h = SlotHeader { seq, slot, orphans };
            let mut b = h.encode(9);
            prop_assert_eq!(SlotHeader::decode(&b, 9, slot).unwrap(), h);
            b[flip / 8] ^= 1 << (flip % 8);
            prop_assert!(SlotHeader::decode(&b, 9, slot).is_err());
        }
        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..5000), slot: u32) {
            let _ = SlotHeader::decode(&data, 3, slot);
        }
    }
}
