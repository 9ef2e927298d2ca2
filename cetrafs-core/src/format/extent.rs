//! An extent maps `len` file blocks starting at `logical` to device blocks starting at
//! `physical`. In a tree leaf its key is `logical` and its 16-byte value is
//! `u64 physical | u32 len | u32 flags`.

use super::codec::{Reader, Writer};
use crate::error::{Error, Result};

/// Allocated but never written: reads return zeros until the first write converts it.
pub const EXTENT_UNWRITTEN: u32 = 1;
pub const EXTENT_FLAGS_KNOWN: u32 = EXTENT_UNWRITTEN;
pub const EXTENT_VALUE_LEN: usize = 16;
/// Longest extent we create: keeps `len` in u32 and bounds a single conversion.
pub const MAX_EXTENT_BLOCKS: u32 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Extent {
    pub logical: u64,
    pub physical: u64,
    pub len: u32,
    pub flags: u32,
}

impl Extent {
    pub fn end(&self) -> u64 {
        self.logical + u64::from(self.len)
    }
    pub fn unwritten(&self) -> bool {
        self.flags & EXTENT_UNWRITTEN != 0
    }

    pub fn encode_value(&self) -> [u8; EXTENT_VALUE_LEN] {
        let mut v = [0u8; EXTENT_VALUE_LEN];
        let mut w = Writer::new(&mut v);
        w.u64(0, self.physical);
        w.u32(8, self.len);
        w.u32(12, self.flags);
        v
    }

    pub fn decode_value(logical: u64, v: &[u8]) -> Result<Self> {
        let r = Reader::new(v, "extent");
        if v.len() != EXTENT_VALUE_LEN {
            return Err(Error::corrupted(format!(
                "extent value of {} bytes",
                v.len()
            )));
        }
        let e = Self {
            logical,
            physical: r.u64(0)?,
            len: r.u32(8)?,
            flags: r.u32(12)?,
        };
        if e.len == 0
            || e.flags & !EXTENT_FLAGS_KNOWN != 0
            || logical.checked_add(u64::from(e.len)).is_none()
        {
            return Err(Error::corrupted(format!(
                "extent at file block {logical}: bad length or flags"
            )));
        }
        Ok(e)
    }
}
