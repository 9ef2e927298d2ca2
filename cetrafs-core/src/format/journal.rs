//! Journal records. Each node slot owns `journal_blocks` fs blocks. Block 0 of a slot's
//! journal is the slot header (`slot_header.rs`: the orphan list). From block 1 on, the slot holds at most one *compound transaction*, always written from the
//! same place (the previous one is fully checkpointed and flushed before it is overwritten):
//!
//! ```text
//! block 1 .. d        descriptor blocks: the home addresses of the n logged blocks
//! block d+1 .. d+n    the logged blocks, byte-for-byte images of their home blocks
//! block d+n+1         commit block: crc32c over descriptors and images
//! ```
//! Descriptor (after the 40-byte block header; type `JournalRecord`, owner = tx sequence):
//! ```text
//! 40 u32 kind (1 = descriptor)   44 u32 index of this descriptor   48 u32 descriptor count (d)
//! 52 u32 logged block count (n)  56 u32 entries in this descriptor 60 u32 reserved
//! 64 u64 home block numbers ...  (504 per descriptor)
//! ```
//! Commit (type `JournalRecord`, owner = tx sequence):
//! ```text
//! 40 u32 kind (2 = commit)  44 u32 d  48 u32 n  52 u32 crc32c(descriptors ++ images)
//! ```
//! A transaction counts only if every block decodes, the sequence numbers agree and the commit
//! crc matches: a torn or half-written transaction is simply absent.

use super::block::{BlockHeader, BlockType, HEADER_LEN};
use super::codec::{Reader, Writer};
use super::FS_BLOCK_SIZE;
use crate::error::{Error, Result};

pub const KIND_DESCRIPTOR: u32 = 1;
pub const KIND_COMMIT: u32 = 2;
pub const DESC_ENTRIES_OFF: usize = 64;
pub const ENTRIES_PER_DESCRIPTOR: usize = (FS_BLOCK_SIZE - DESC_ENTRIES_OFF) / 8;
const _: () = assert!(HEADER_LEN <= 40);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub seq: u64,
    pub index: u32,
    pub count: u32,
    pub logged: u32,
    pub homes: Vec<u64>,
}

impl Descriptor {
    pub fn encode(&self, at: u64) -> Vec<u8> {
        assert!(self.homes.len() <= ENTRIES_PER_DESCRIPTOR);
        let mut b = vec![0u8; FS_BLOCK_SIZE];
        let mut w = Writer::new(&mut b);
        w.u32(40, KIND_DESCRIPTOR);
        w.u32(44, self.index);
        w.u32(48, self.count);
        w.u32(52, self.logged);
        #[allow(clippy::cast_possible_truncation)] // <= 504
        w.u32(56, self.homes.len() as u32);
        for (i, h) in self.homes.iter().enumerate() {
            w.u64(DESC_ENTRIES_OFF + i * 8, *h);
        }
        BlockHeader {
            btype: BlockType::JournalRecord,
            blockno: at,
            seq: self.seq,
            owner: self.seq,
        }
        .seal(&mut b);
        b
    }

    pub fn decode(buf: &[u8], at: u64) -> Result<Self> {
        let h = BlockHeader::check(buf, BlockType::JournalRecord, at)?;
        let r = Reader::new(buf, "journal descriptor");
        if r.u32(40)? != KIND_DESCRIPTOR {
            return Err(Error::corrupted(format!(
                "journal block {at}: not a descriptor"
            )));
        }
        let n = r.u32(56)? as usize;
        if n > ENTRIES_PER_DESCRIPTOR {
            return Err(Error::corrupted(format!("journal block {at}: {n} entries")));
        }
        let homes = (0..n)
            .map(|i| r.u64(DESC_ENTRIES_OFF + i * 8))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            seq: h.seq,
            index: r.u32(44)?,
            count: r.u32(48)?,
            logged: r.u32(52)?,
            homes,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    pub seq: u64,
    pub descriptors: u32,
    pub logged: u32,
    pub crc: u32,
}

impl Commit {
    pub fn encode(&self, at: u64) -> Vec<u8> {
        let mut b = vec![0u8; FS_BLOCK_SIZE];
        let mut w = Writer::new(&mut b);
        w.u32(40, KIND_COMMIT);
        w.u32(44, self.descriptors);
        w.u32(48, self.logged);
        w.u32(52, self.crc);
        BlockHeader {
            btype: BlockType::JournalRecord,
            blockno: at,
            seq: self.seq,
            owner: self.seq,
        }
        .seal(&mut b);
        b
    }

    pub fn decode(buf: &[u8], at: u64) -> Result<Self> {
        let h = BlockHeader::check(buf, BlockType::JournalRecord, at)?;
        let r = Reader::new(buf, "journal commit");
        if r.u32(40)? != KIND_COMMIT {
            return Err(Error::corrupted(format!(
                "journal block {at}: not a commit record"
            )));
        }
        Ok(Self {
            seq: h.seq,
            descriptors: r.u32(44)?,
            logged: r.u32(48)?,
            crc: r.u32(52)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    proptest! {
        #[test]
        fn roundtrip(seq: u64, homes in proptest::collection::vec(any::<u64>(), 0..ENTRIES_PER_DESCRIPTOR), at in 1u64..1<<40, flip in 0usize..FS_BLOCK_SIZE*8) {
            let d = Descriptor { seq, index: 0, count: 1, logged: u32::try_from(homes.len()).unwrap(), homes };
            let mut b = d.encode(at);
            prop_assert_eq!(Descriptor::decode(&b, at).unwrap(), d.clone());
            b[flip / 8] ^= 1 << (flip % 8);
            prop_assert!(Descriptor::decode(&b, at).is_err());
            let c = Commit { seq, descriptors: 1, logged: 3, crc: 99 };
            prop_assert_eq!(Commit::decode(&c.encode(at), at).unwrap(), c);
            prop_assert!(Commit::decode(&d.encode(at), at).is_err());
        }
        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..5000), at: u64) {
            let _ = Descriptor::decode(&data, at);
            let _ = Commit::decode(&data, at);
        }
    }
}
