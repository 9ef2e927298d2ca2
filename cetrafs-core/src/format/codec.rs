//! Little-endian field access with bounds checks that return errors instead of panicking:
//! every decoder of on-disk bytes goes through [`Reader`], so a short or hostile buffer is a
//! `Corrupted` error, never an index panic.

use crate::error::{Error, Result};

/// Bounds-checked little-endian reads at explicit offsets.
#[derive(Debug, Clone, Copy)]
pub struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Self { buf, what }
    }

    pub fn bytes(&self, off: usize, len: usize) -> Result<&'a [u8]> {
        off.checked_add(len)
            .and_then(|end| self.buf.get(off..end))
            .ok_or_else(|| {
                Error::corrupted(format!(
                    "{}: field at {off}+{len} runs past the record",
                    self.what
                ))
            })
    }

    pub fn u8(&self, off: usize) -> Result<u8> {
        Ok(self.bytes(off, 1)?[0])
    }

    pub fn u16(&self, off: usize) -> Result<u16> {
        let b = self.bytes(off, 2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    pub fn u32(&self, off: usize) -> Result<u32> {
        let b = self.bytes(off, 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn u64(&self, off: usize) -> Result<u64> {
        let b = self.bytes(off, 8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    pub fn i64(&self, off: usize) -> Result<i64> {
        Ok(self.u64(off)?.cast_signed())
    }
}

/// Little-endian writes at explicit offsets into a buffer the encoder sized itself.
/// Encoders own their layout, so an out-of-range offset is a programming error (panic).
#[derive(Debug)]
pub struct Writer<'a> {
    buf: &'a mut [u8],
}

impl<'a> Writer<'a> {
    pub fn new(buf: &'a mut [u8]) -> Self {
        Self { buf }
    }
    pub fn bytes(&mut self, off: usize, v: &[u8]) {
        self.buf[off..off + v.len()].copy_from_slice(v);
    }
    pub fn u8(&mut self, off: usize, v: u8) {
        self.buf[off] = v;
    }
    pub fn u16(&mut self, off: usize, v: u16) {
        self.bytes(off, &v.to_le_bytes());
    }
    pub fn u32(&mut self, off: usize, v: u32) {
        self.bytes(off, &v.to_le_bytes());
    }
    pub fn u64(&mut self, off: usize, v: u64) {
        self.bytes(off, &v.to_le_bytes());
    }
    pub fn i64(&mut self, off: usize, v: i64) {
        self.bytes(off, &v.to_le_bytes());
    }
}

/// crc32c of `buf` computed as if the 4 bytes at `crc_off` were zero.
pub fn crc_with_hole(buf: &[u8], crc_off: usize) -> u32 {
    let c = crc32c::crc32c(&buf[..crc_off]);
    let c = crc32c::crc32c_append(c, &[0; 4]);
    crc32c::crc32c_append(c, &buf[crc_off + 4..])
}
