//! Allocation group ("resource group") header and bitmap blocks.
//!
//! A group is `group_blocks` consecutive fs blocks: block 0 is the header, blocks
//! `1..=bitmap_blocks` hold the free-space bitmap (bit set = block in use) covering every block of
//! the group (its own header and bitmap blocks are marked used at mkfs), the rest hold inodes,
//! tree nodes and file data. Groups are the unit a node takes ownership of for allocation in
//! multi-node operation, so each has its own free count.
//!
//! Header block (after the 40-byte block header):
//! ```text
//!  40 u64 group index   48 u64 first block   56 u64 block count
//!  64 u64 free blocks   72 u32 bitmap blocks 76 u32 flags (0)
//! ```
//! Bitmap block: 40-byte block header, then 4056 bytes = 32448 bits, LSB-first.

use super::block::{BlockHeader, BlockType, HEADER_LEN};
use super::codec::{Reader, Writer};
use super::FS_BLOCK_SIZE;
use crate::error::{Error, Result};

pub const BITMAP_BYTES_PER_BLOCK: usize = FS_BLOCK_SIZE - HEADER_LEN;
pub const BITS_PER_BITMAP_BLOCK: u64 = (BITMAP_BYTES_PER_BLOCK * 8) as u64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupHeader {
    pub seq: u64,
    pub index: u64,
    pub first_block: u64,
    pub block_count: u64,
    pub free_blocks: u64,
    pub bitmap_blocks: u32,
}

impl GroupHeader {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; FS_BLOCK_SIZE];
        let mut w = Writer::new(&mut b);
        w.u64(40, self.index);
        w.u64(48, self.first_block);
        w.u64(56, self.block_count);
        w.u64(64, self.free_blocks);
        w.u32(72, self.bitmap_blocks);
        BlockHeader {
            btype: BlockType::GroupHeader,
            blockno: self.first_block,
            seq: self.seq,
            owner: 0,
        }
        .seal(&mut b);
        b
    }

    pub fn decode(buf: &[u8], at: u64) -> Result<Self> {
        let h = BlockHeader::check(buf, BlockType::GroupHeader, at)?;
        let r = Reader::new(buf, "group header");
        let g = Self {
            seq: h.seq,
            index: r.u64(40)?,
            first_block: r.u64(48)?,
            block_count: r.u64(56)?,
            free_blocks: r.u64(64)?,
            bitmap_blocks: r.u32(72)?,
        };
        if g.free_blocks > g.block_count || g.first_block != at {
            return Err(Error::corrupted(format!(
                "group header at block {at}: inconsistent counts"
            )));
        }
        Ok(g)
    }
}

/// Seal a bitmap block; `bits` is the 4056-byte payload.
pub fn encode_bitmap(blockno: u64, seq: u64, bits: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8; FS_BLOCK_SIZE];
    b[HEADER_LEN..HEADER_LEN + bits.len()].copy_from_slice(bits);
    BlockHeader {
        btype: BlockType::Bitmap,
        blockno,
        seq,
        owner: 0,
    }
    .seal(&mut b);
    b
}

/// Verify a bitmap block and return (seq, payload).
pub fn decode_bitmap(buf: &[u8], at: u64) -> Result<(u64, &[u8])> {
    let h = BlockHeader::check(buf, BlockType::Bitmap, at)?;
    Ok((h.seq, &buf[HEADER_LEN..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    proptest! {
        #[test]
        fn roundtrip(seq: u64, index in 0u64..1000, first in 1u64..1<<40, count in 10u64..1<<20, bm in 1u32..40, flip in 0usize..FS_BLOCK_SIZE*8) {
            let g = GroupHeader { seq, index, first_block: first, block_count: count, free_blocks: count / 2, bitmap_blocks: bm };
            let mut b = g.encode();
            prop_assert_eq!(GroupHeader::decode(&b, first).unwrap(), g);
            b[flip / 8] ^= 1 << (flip % 8);
            prop_assert!(GroupHeader::decode(&b, first).is_err());
        }
    }
}
