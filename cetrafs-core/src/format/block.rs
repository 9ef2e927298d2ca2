//! The 40-byte header every 4 KiB metadata block starts with (inodes, tree nodes, group
//! headers, bitmaps, xattr and overflow blocks). It names the block's type and its own address, so a block
//! written to the wrong place or read from a stale mapping is detected; `seq` grows on every
//! rewrite of the block, which the journal's replay guard compares (a journal copy is applied
//! only if it is newer than the home block); `owner` ties tree, xattr and overflow blocks to
//! their inode: [`check_owner`] is the one rule the filesystem and fsck apply to it.
//!
//! ```text
//!  0      4      6      8              16             24     28     32             40
//!  +------+------+------+--------------+--------------+------+------+--------------+
//!  |magic |type  |ver   | self blockno | seq          | crc  | rsvd | owner        |
//!  +------+------+------+--------------+--------------+------+------+--------------+
//! ```
//! crc32c covers the whole 4096-byte block with the crc field taken as zero.

use super::codec::{crc_with_hole, Reader, Writer};
use super::FS_BLOCK_SIZE;
use crate::error::{Error, Result};

pub const BLOCK_MAGIC: u32 = u32::from_le_bytes(*b"CTRB");
pub const BLOCK_HEADER_VERSION: u16 = 1;
pub const HEADER_LEN: usize = 40;

const MAGIC_OFF: usize = 0;
const TYPE_OFF: usize = 4;
const VERSION_OFF: usize = 6;
const SELF_OFF: usize = 8;
const SEQ_OFF: usize = 16;
const CRC_OFF: usize = 24;
const OWNER_OFF: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum BlockType {
    Inode = 1,
    TreeNode = 2,
    GroupHeader = 3,
    Bitmap = 4,
    Xattr = 5,
    JournalHeader = 6,
    JournalRecord = 7,
    /// Format v2 (`INCOMPAT_OVERFLOW`): a payload block owned by an inode (`format/overflow.rs`).
    Overflow = 8,
}

impl BlockType {
    pub fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            1 => Self::Inode,
            2 => Self::TreeNode,
            3 => Self::GroupHeader,
            4 => Self::Bitmap,
            5 => Self::Xattr,
            6 => Self::JournalHeader,
            7 => Self::JournalRecord,
            8 => Self::Overflow,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub btype: BlockType,
    pub blockno: u64,
    pub seq: u64,
    pub owner: u64,
}

impl BlockHeader {
    /// Write the header fields and seal the block with its crc. Call after the body is encoded.
    pub fn seal(&self, block: &mut [u8]) {
        debug_assert_eq!(block.len(), FS_BLOCK_SIZE);
        let mut w = Writer::new(block);
        w.u32(MAGIC_OFF, BLOCK_MAGIC);
        w.u16(TYPE_OFF, self.btype as u16);
        w.u16(VERSION_OFF, BLOCK_HEADER_VERSION);
        w.u64(SELF_OFF, self.blockno);
        w.u64(SEQ_OFF, self.seq);
        w.u32(CRC_OFF + 4, 0);
        w.u64(OWNER_OFF, self.owner);
        let crc = crc_with_hole(block, CRC_OFF);
        Writer::new(block).u32(CRC_OFF, crc);
    }

    /// Validate magic, crc, type and address. `expect_at` is where the block was read from.
    pub fn check(block: &[u8], expect: BlockType, expect_at: u64) -> Result<Self> {
        let h = Self::decode(block)?;
        if h.btype != expect {
            return Err(Error::corrupted(format!(
                "block {expect_at}: expected a {expect:?} block, found {:?}",
                h.btype
            )));
        }
        if h.blockno != expect_at {
            return Err(Error::corrupted(format!(
                "block {expect_at}: header says it belongs at block {} (misdirected write?)",
                h.blockno
            )));
        }
        Ok(h)
    }

    /// Decode and verify magic, version and crc, without expectations about type or place.
    pub fn decode(block: &[u8]) -> Result<Self> {
        let r = Reader::new(block, "metadata block");
        if block.len() != FS_BLOCK_SIZE {
            return Err(Error::corrupted(format!(
                "metadata block of {} bytes",
                block.len()
            )));
        }
        if r.u32(MAGIC_OFF)? != BLOCK_MAGIC {
            return Err(Error::corrupted("metadata block: bad magic".to_string()));
        }
        let ver = r.u16(VERSION_OFF)?;
        if ver != BLOCK_HEADER_VERSION {
            return Err(Error::corrupted(format!(
                "metadata block: unknown header version {ver}"
            )));
        }
        let stored = r.u32(CRC_OFF)?;
        if stored != crc_with_hole(block, CRC_OFF) {
            return Err(Error::corrupted(format!(
                "metadata block {}: checksum mismatch",
                r.u64(SELF_OFF)?
            )));
        }
        let t = r.u16(TYPE_OFF)?;
        let btype = BlockType::from_u16(t)
            .ok_or_else(|| Error::corrupted(format!("metadata block: unknown type {t}")))?;
        Ok(Self {
            btype,
            blockno: r.u64(SELF_OFF)?,
            seq: r.u64(SEQ_OFF)?,
            owner: r.u64(OWNER_OFF)?,
        })
    }
}

/// The owner rule for blocks that belong to one inode (tree nodes, xattr blocks, overflow
/// blocks): the header's `owner` must be the inode whose pointer led here. A valid block that
/// names another inode is reached through a stale or damaged pointer and must not be used
/// (it would serve or change someone else's metadata). `what` and `at` name the block.
pub fn check_owner(what: &str, at: u64, found: u64, ino: u64) -> Result<()> {
    if found == ino {
        return Ok(());
    }
    Err(Error::corrupted(format!(
        "{what} {at} belongs to inode {found}, not {ino}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip_and_bitflip(blockno: u64, seq: u64, owner: u64, bit in 0usize..FS_BLOCK_SIZE * 8) {
            let mut b = vec![0u8; FS_BLOCK_SIZE];
            let h = BlockHeader { btype: BlockType::Xattr, blockno, seq, owner };
            h.seal(&mut b);
            prop_assert_eq!(BlockHeader::check(&b, BlockType::Xattr, blockno).unwrap(), h);
            b[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(BlockHeader::decode(&b).is_err());
        }
    }
}
