//! An in-memory LUN for unit tests, with fault hooks: I/O errors, latency, torn writes and a
//! "cut" after which writes are silently dropped (what a power cut looks like to the writer).
//! The crash recorder of the journal work extends this with a full write/flush log.

use super::{check_caw, check_io, BlockDevice, CawKind, CawOutcome, Geometry, LiveSize};
use crate::error::{Error, ErrorKind, Result};
use crate::sync::LockPolicy;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::Duration;

/// Faults to inject. All default to "none".
#[derive(Debug, Default)]
pub struct Faults {
    /// Fail every read with EIO while set.
    pub fail_reads: AtomicBool,
    /// Fail every write (and CAW) with EIO while set.
    pub fail_writes: AtomicBool,
    /// Fail the write after this many more writes succeed (0 = disabled, 1 = the next one).
    pub fail_write_countdown: AtomicU64,
    /// After the cut, writes report success but are dropped.
    pub cut: AtomicBool,
    /// Next write keeps only this many leading bytes, then the flag resets (0 = disabled).
    pub tear_next_write_at: AtomicU64,
    /// Latency added to every I/O, in microseconds.
    pub latency_us: AtomicU64,
    /// The next this many reads return their bytes with one bit flipped (bit 6 of byte 100):
    /// what a torn or damaged image looks like to a decoder.
    pub torn_reads: AtomicU32,
}

#[derive(Debug)]
pub struct MemDevice {
    geo: Geometry,
    size: LiveSize,
    data: RwLock<Vec<u8>>,
    caw_lock: Mutex<()>,
    pub faults: Faults,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    /// Bytes read so far (to see what a component loads).
    pub read_bytes: AtomicU64,
}

impl MemDevice {
    pub fn new(size_bytes: u64, logical_block_size: u32) -> Self {
        let size = size_bytes - size_bytes % u64::from(logical_block_size);
        Self {
            geo: Geometry {
                logical_block_size,
                physical_block_size: logical_block_size,
                size_bytes: size,
                identity: format!("mem:{:x}", rand::random::<u64>()),
                caw: CawKind::InProcess,
            },
            size: LiveSize::new(size),
            data: RwLock::new(vec![
                0;
                usize::try_from(size).expect("memory device too large")
            ]),
            caw_lock: Mutex::new(()),
            faults: Faults::default(),
            writes: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
        }
    }

    /// A copy of the whole device, e.g. to reopen it as another "node" or after a crash.
    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().or_panic().clone()
    }

    /// The LUN grew on the "array": `bytes` long from now on (zeros appended), seen by
    /// `refresh_size` (a smaller size is ignored).
    pub fn extend(&self, bytes: u64) {
        let mut d = self.data.write().or_panic();
        let n = usize::try_from(bytes).expect("memory device too large");
        if n > d.len() {
            d.resize(n, 0);
        }
    }

    pub fn from_image(image: Vec<u8>, logical_block_size: u32) -> Self {
        let d = Self::new(image.len() as u64, logical_block_size);
        *d.data.write().or_panic() = image;
        d
    }

    fn delay(&self) {
        let us = self.faults.latency_us.load(Ordering::Relaxed);
        if us > 0 {
            std::thread::sleep(Duration::from_micros(us));
        }
    }

    fn write_fault(&self) -> Result<bool> {
        if self.faults.fail_writes.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Io, "injected write error"));
        }
        let c = self.faults.fail_write_countdown.load(Ordering::Relaxed);
        if c > 0 {
            self.faults
                .fail_write_countdown
                .store(c - 1, Ordering::Relaxed);
            if c == 1 {
                self.faults.fail_writes.store(true, Ordering::Relaxed);
                return Err(Error::new(
                    ErrorKind::Io,
                    "injected write error (countdown)",
                ));
            }
        }
        Ok(!self.faults.cut.load(Ordering::Relaxed))
    }

    fn range(offset: u64, len: usize) -> std::ops::Range<usize> {
        // check_io already bounded offset+len by the device size, which fits usize.
        let o = usize::try_from(offset).unwrap_or(usize::MAX);
        o..o + len
    }
}

impl BlockDevice for MemDevice {
    fn geometry(&self) -> &Geometry {
        &self.geo
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        check_io(&self.geo, self.size.get(), offset, buf.len(), "read")?;
        self.delay();
        if self.faults.fail_reads.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Io, "injected read error"));
        }
        let d = self.data.read().or_panic();
        buf.copy_from_slice(&d[Self::range(offset, buf.len())]);
        self.read_bytes.fetch_add(
            u64::try_from(buf.len()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        let torn = self
            .faults
            .torn_reads
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if torn.is_ok() {
            if let Some(b) = buf.get_mut(100) {
                *b ^= 0x40;
            }
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        check_io(&self.geo, self.size.get(), offset, buf.len(), "write")?;
        self.delay();
        if !self.write_fault()? {
            return Ok(());
        }
        self.writes.fetch_add(1, Ordering::Relaxed);
        let tear = self.faults.tear_next_write_at.swap(0, Ordering::Relaxed);
        let keep = if tear > 0 {
            buf.len().min(usize::try_from(tear).unwrap_or(usize::MAX))
        } else {
            buf.len()
        };
        let mut d = self.data.write().or_panic();
        d[Self::range(offset, keep)].copy_from_slice(&buf[..keep]);
        Ok(())
    }

    fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
        check_caw(&self.geo, self.size.get(), lba, expected, new)?;
        let _g = self.caw_lock.lock().or_panic();
        let off = lba * self.geo.lbs();
        let mut cur = vec![0; expected.len()];
        self.read_at(off, &mut cur)?;
        if cur != expected {
            return Ok(CawOutcome::Miscompare);
        }
        self.write_at(off, new)?;
        Ok(CawOutcome::Written)
    }

    fn flush(&self) -> Result<()> {
        self.delay();
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// What [`MemDevice::extend`] made it.
    fn refresh_size(&self) -> Result<u64> {
        let len = self.data.read().or_panic().len() as u64;
        Ok(self.size.grow_to(len, self.geo.lbs()))
    }

    /// Says yes so that the data path takes its offloaded way on this device and unit
    /// tests cover it; the zeros themselves go through `write_at` (the trait's default), with
    /// its faults, tears and write count.
    fn offloads_zeroes(&self) -> bool {
        true
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_io(
            &self.geo,
            self.size.get(),
            offset,
            usize::try_from(len).unwrap_or(usize::MAX),
            "discard",
        )?;
        if self.faults.cut.load(Ordering::Relaxed) {
            return Ok(());
        }
        // Reads of a discarded range are unspecified: give them something no decoder accepts
        // and no test wrote, so that a discard of a block still in use shows.
        let (start, end) = (
            usize::try_from(offset).unwrap_or(usize::MAX),
            usize::try_from(offset + len).unwrap_or(usize::MAX),
        );
        if let Some(range) = self.data.write().or_panic().get_mut(start..end) {
            range.fill(DISCARDED);
        }
        Ok(())
    }
}

/// What [`MemDevice`] reads back from a discarded range.
pub const DISCARDED: u8 = 0xDB;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caw_and_faults() {
        let d = MemDevice::new(1 << 20, 512);
        let zero = vec![0u8; 512];
        let one = vec![1u8; 512];
        assert_eq!(
            d.compare_and_write(3, &zero, &one).unwrap(),
            CawOutcome::Written
        );
        assert_eq!(
            d.compare_and_write(3, &zero, &one).unwrap(),
            CawOutcome::Miscompare
        );
        let mut b = vec![0u8; 512];
        d.read_at(3 * 512, &mut b).unwrap();
        assert_eq!(b, one);
        assert!(d.read_at(1, &mut b).is_err());
        assert!(d.compare_and_write(3, &one[..100], &one).is_err());
        d.faults.cut.store(true, Ordering::Relaxed);
        d.write_at(0, &one).unwrap();
        d.read_at(0, &mut b).unwrap();
        assert_eq!(b, zero, "writes after the cut are dropped");
        d.faults.cut.store(false, Ordering::Relaxed);
        d.faults.tear_next_write_at.store(100, Ordering::Relaxed);
        d.write_at(0, &one).unwrap();
        d.read_at(0, &mut b).unwrap();
        assert_eq!(&b[..100], &one[..100]);
        assert_eq!(&b[100..], &zero[100..]);
        d.faults.fail_write_countdown.store(2, Ordering::Relaxed);
        d.write_at(0, &one).unwrap();
        assert!(d.write_at(0, &one).is_err());
    }
}
