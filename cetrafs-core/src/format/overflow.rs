//! Overflow block (format v2, `INCOMPAT_OVERFLOW`): one checksummed metadata block of payload
//! bytes owned by an inode, for what does not fit where it normally lives: the end of a
//! symlink target longer than the inode's inline area, and the continuation of an xattr set
//! larger than its first block (`format/xattr.rs`). Like every metadata block it is written
//! through the journal together with the block that points at it, so a crash never exposes
//! one without the other.
//!
//! ```text
//!  0  40 block header (type Overflow, owner = the inode)
//! 40   1 role (1 = symlink target, 2 = xattr set)
//! 41   1 reserved (zero)
//! 42   2 index: position after the block that points here (1 = first overflow block)
//! 44   4 len: payload bytes (1 ..= 4048)
//! 48 ... payload; the rest of the block is zero
//! ```
//! The decoder checks the header, the role, the reserved byte and the length; who points at
//! the block checks owner, role, index and the length it expects.

use super::block::{BlockHeader, BlockType};
use super::codec::{Reader, Writer};
use super::FS_BLOCK_SIZE;
use crate::error::{Error, Result};

pub const OVERFLOW_HDR: usize = 48;
/// Payload bytes one overflow block holds.
pub const OVERFLOW_CAP: usize = FS_BLOCK_SIZE - OVERFLOW_HDR;

/// What an overflow block continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    SymlinkTarget = 1,
    XattrSet = 2,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overflow {
    pub blockno: u64,
    pub seq: u64,
    pub owner: u64,
    pub role: Role,
    pub index: u16,
    pub payload: Vec<u8>,
}

impl Overflow {
    pub fn encode(&self) -> Vec<u8> {
        assert!(!self.payload.is_empty() && self.payload.len() <= OVERFLOW_CAP);
        let mut b = vec![0u8; FS_BLOCK_SIZE];
        let mut w = Writer::new(&mut b);
        w.u8(40, self.role as u8);
        w.u16(42, self.index);
        #[allow(clippy::cast_possible_truncation)] // <= OVERFLOW_CAP, asserted above
        w.u32(44, self.payload.len() as u32);
        w.bytes(OVERFLOW_HDR, &self.payload);
        BlockHeader {
            btype: BlockType::Overflow,
            blockno: self.blockno,
            seq: self.seq,
            owner: self.owner,
        }
        .seal(&mut b);
        b
    }

    pub fn decode(buf: &[u8], at: u64) -> Result<Self> {
        let h = BlockHeader::check(buf, BlockType::Overflow, at)?;
        let r = Reader::new(buf, "overflow block");
        let bad = |m: &str| Error::corrupted(format!("overflow block {at}: {m}"));
        let role = match r.u8(40)? {
            1 => Role::SymlinkTarget,
            2 => Role::XattrSet,
            x => return Err(bad(&format!("unknown role {x}"))),
        };
        if r.u8(41)? != 0 {
            return Err(bad("reserved byte is not zero"));
        }
        let index = r.u16(42)?;
        let len = r.u32(44)? as usize;
        if index == 0 || len == 0 || len > OVERFLOW_CAP {
            return Err(bad(&format!("index {index} or length {len} out of range")));
        }
        Ok(Self {
            blockno: at,
            seq: h.seq,
            owner: h.owner,
            role,
            index,
            payload: r.bytes(OVERFLOW_HDR, len)?.to_vec(),
        })
    }

    /// The checks of whoever followed a pointer here: `role` and position `index`, `len`
    /// payload bytes expected. (Ownership is [`super::block::check_owner`]'s.)
    pub fn expect(&self, role: Role, index: u16, len: usize) -> Result<()> {
        if self.role != role || self.index != index || self.payload.len() != len {
            return Err(Error::corrupted(format!(
                "overflow block {}: holds {:?} part {} of {} bytes where {role:?} part {index} of {len} bytes was expected",
                self.blockno,
                self.role,
                self.index,
                self.payload.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip_and_bitflip(at in 1u64..1 << 40, seq: u64, owner: u64, xattr: bool, index in 1u16..64,
                                 payload in proptest::collection::vec(any::<u8>(), 1..OVERFLOW_CAP),
                                 flip in 0usize..FS_BLOCK_SIZE * 8) {
            let role = if xattr { Role::XattrSet } else { Role::SymlinkTarget };
            let o = Overflow { blockno: at, seq, owner, role, index, payload };
            let mut b = o.encode();
            prop_assert_eq!(&Overflow::decode(&b, at).unwrap(), &o);
            prop_assert!(Overflow::decode(&b, at + 1).is_err());
            prop_assert!(o.expect(role, index, o.payload.len()).is_ok());
            prop_assert!(o.expect(role, index + 1, o.payload.len()).is_err());
            b[flip / 8] ^= 1 << (flip % 8);
            prop_assert!(Overflow::decode(&b, at).is_err());
        }

        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..5000), at: u64) {
            let _ = Overflow::decode(&data, at);
        }
    }

    #[test]
    fn field_checks() {
        let o = Overflow {
            blockno: 9,
            seq: 1,
            owner: 5,
            role: Role::XattrSet,
            index: 1,
            payload: vec![1; 10],
        };
        let reseal = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = o.encode();
            f(&mut b);
            let h = BlockHeader::decode(&o.encode()).unwrap();
            h.seal(&mut b);
            Overflow::decode(&b, 9)
        };
        assert!(reseal(&|_| {}).is_ok());
        assert!(reseal(&|b| b[40] = 3).is_err());
        assert!(reseal(&|b| b[41] = 1).is_err());
        assert!(reseal(&|b| b[42..44].copy_from_slice(&0u16.to_le_bytes())).is_err());
        assert!(reseal(&|b| b[44..48].copy_from_slice(&0u32.to_le_bytes())).is_err());
        assert!(reseal(&|b| b[44..48].copy_from_slice(&4049u32.to_le_bytes())).is_err());
    }
}
