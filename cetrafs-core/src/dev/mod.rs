//! The shared-LUN seam. Everything above this module sees a [`BlockDevice`]: whole logical
//! blocks read and written at byte offsets, a one-block COMPARE AND WRITE, a flush barrier,
//! discard, zeroing, and geometry. Backends: [`file::FileDevice`] (regular file or block device, `O_DIRECT`,
//! host-local CAW emulation) and [`mem::MemDevice`] (unit tests, fault injection). The `SG_IO`
//! backend plugs in here too; its CAW is one logical block, which is all this trait asks for.

pub mod aligned;
pub mod file;
pub mod mem;
pub mod multipath;
pub mod open;
pub mod record;
pub mod sg;
pub mod write_log;

use crate::error::{Error, ErrorKind, Result};
pub use aligned::{AlignedBuf, IO_ALIGN};
use std::fmt::Debug;
use std::sync::Arc;

/// How COMPARE AND WRITE is made atomic on this device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CawKind {
    /// The target executes SCSI COMPARE AND WRITE: atomic across every initiator.
    Scsi,
    /// Emulated with OFD byte-range locks: atomic only among processes on this host.
    HostLocal,
    /// In-process emulation (memory device).
    InProcess,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Geometry {
    /// Unit of addressing and of `compare_and_write`: 512 or 4096.
    pub logical_block_size: u32,
    /// Preferred alignment of I/O (the physical block), >= `logical_block_size`.
    pub physical_block_size: u32,
    /// Usable size in bytes (a multiple of `logical_block_size`).
    pub size_bytes: u64,
    /// A stable identity of the LUN (path-independent where the backend can tell).
    pub identity: String,
    pub caw: CawKind,
}

impl Geometry {
    pub fn lbs(&self) -> u64 {
        u64::from(self.logical_block_size)
    }
}

/// Result of a `compare_and_write` that reached the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CawOutcome {
    /// The block matched `expected` and now holds `new`.
    Written,
    /// The block did not match; nothing was written.
    Miscompare,
}

/// A shared LUN. Offsets and lengths are bytes and must be multiples of the logical block size.
/// Buffers need not be aligned: backends that require alignment bounce through an
/// [`AlignedBuf`], so hot paths should pass aligned buffers to avoid the copy.
pub trait BlockDevice: Send + Sync + Debug {
    fn geometry(&self) -> &Geometry;
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()>;
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()>;
    /// Several reads (offset, buffer: as for [`BlockDevice::read_at`]) in flight at once, all
    /// finished when it returns; on an error, which of them landed is unspecified. Devices
    /// that can keep several in flight from one thread (a file or block node: `io_uring`)
    /// submit them together, one system call for the lot; the default reads one after another.
    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        reads.iter_mut().try_for_each(|(o, b)| self.read_at(*o, b))
    }
    /// Several writes at once, as [`BlockDevice::read_many`]; all finished (not flushed) when
    /// it returns. Overlapping ones land in no particular order (as concurrent writes do).
    fn write_many(&self, writes: &[(u64, &[u8])]) -> Result<()> {
        writes.iter().try_for_each(|(o, b)| self.write_at(*o, b))
    }
    /// Atomically: if logical block `lba` equals `expected`, replace it with `new`.
    /// Both slices are exactly one logical block.
    fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome>;
    /// Durability barrier: every write that completed before this call is on stable media after it.
    fn flush(&self) -> Result<()>;
    /// Hint that a byte range no longer holds data. Reads of it afterwards are unspecified.
    fn discard(&self, offset: u64, len: u64) -> Result<()>;
    /// Make a byte range (offset and length as for [`BlockDevice::write_at`]) read as zeros:
    /// not a hint, and durable as a write is once a later [`BlockDevice::flush`] returns.
    /// Devices that can do it without sending the zeros override it — VMware's "block
    /// zeroing" primitive: `BLKZEROOUT` on a block device (WRITE SAME or WRITE ZEROES on the
    /// LUN, the kernel writing zeros where the LUN has neither). The default writes the
    /// zeros through [`BlockDevice::write_at`], so a decorator that does not override it
    /// still sees every byte as a write.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        write_zeroes_by_writing(self, offset, len)
    }
    /// Does [`BlockDevice::write_zeroes`] zero without sending the zeros? Then a write into
    /// new blocks (a granule) zeroes its padding that way; else the zeros go in its buffer.
    fn offloads_zeroes(&self) -> bool {
        false
    }
    /// The device's size in bytes now, re-read from its backend: a LUN grown on the array, a
    /// LUN file extended (`cetra grow`). A kernel block device (`/dev/sdX`, a multipath map)
    /// reports a new size only after the host rescanned it. I/O up to the returned size is
    /// accepted from then on. `geometry().size_bytes` stays the size at open, and the size
    /// never shrinks below it (a LUN does not shrink under a mounted volume).
    fn refresh_size(&self) -> Result<u64>;
}

/// A device's size as last read from its backend, which [`check_io`] bounds I/O by: the size
/// at open, raised by [`BlockDevice::refresh_size`], never lowered.
#[derive(Debug)]
pub(crate) struct LiveSize(std::sync::atomic::AtomicU64);

impl LiveSize {
    pub(crate) fn new(bytes: u64) -> Self {
        Self(std::sync::atomic::AtomicU64::new(bytes))
    }

    pub(crate) fn get(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Raise the size to `bytes` rounded down to `lbs` (a smaller size is ignored); returns
    /// the size now.
    pub(crate) fn grow_to(&self, bytes: u64, lbs: u64) -> u64 {
        let b = bytes - bytes % lbs.max(1);
        self.0
            .fetch_max(b, std::sync::atomic::Ordering::AcqRel)
            .max(b)
    }
}

pub type SharedDevice = Arc<dyn BlockDevice>;

/// Most bytes of zeros one write of [`write_zeroes_by_writing`] sends.
const ZERO_WRITE_MAX: u64 = 1 << 20;

/// [`BlockDevice::write_zeroes`] the slow way: zeros written through `write_at`, at most
/// 1 MiB per write.
pub fn write_zeroes_by_writing<D: BlockDevice + ?Sized>(
    dev: &D,
    offset: u64,
    len: u64,
) -> Result<()> {
    let zeros = AlignedBuf::new(usize::try_from(len.min(ZERO_WRITE_MAX)).unwrap_or(1 << 20));
    let mut done = 0;
    while done < len {
        let n = (len - done).min(zeros.len() as u64);
        dev.write_at(
            offset + done,
            &zeros[..usize::try_from(n).unwrap_or(zeros.len())],
        )?;
        done += n;
    }
    Ok(())
}

/// Read `len` bytes at byte `offset` (both multiples of the logical block size) into an
/// aligned buffer.
pub fn read_aligned(dev: &dyn BlockDevice, offset: u64, len: usize) -> Result<AlignedBuf> {
    let mut buf = AlignedBuf::new(len);
    dev.read_at(offset, &mut buf)?;
    Ok(buf)
}

/// One-block records read per device read by [`for_each_record`].
const RECORDS_PER_READ: u64 = 256;

/// Read `count` consecutive records of `lbs` bytes from byte `offset`, 256 per device read,
/// calling `each(index, raw)` for each (fsck's checks and `cetra status` over the object-lock
/// and mailbox areas).
pub fn for_each_record(
    dev: &dyn BlockDevice,
    offset: u64,
    count: u64,
    lbs: usize,
    each: &mut dyn FnMut(u64, &[u8]),
) -> Result<()> {
    let step = u64::try_from(lbs).unwrap_or(u64::MAX);
    let mut first = 0;
    while first < count {
        let n = RECORDS_PER_READ.min(count - first);
        let area = read_aligned(
            dev,
            offset + first * step,
            usize::try_from(n).unwrap_or(0) * lbs,
        )?;
        for (i, raw) in (first..).zip(area.chunks(lbs)) {
            each(i, raw);
        }
        first += n;
    }
    Ok(())
}

/// Validate that an I/O request is block-aligned and inside the device.
/// `size`: the device's [`LiveSize`].
pub(crate) fn check_io(
    geo: &Geometry,
    size: u64,
    offset: u64,
    len: usize,
    what: &str,
) -> Result<()> {
    let lbs = geo.lbs();
    let len64 = len as u64;
    if !offset.is_multiple_of(lbs) || !len64.is_multiple_of(lbs) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("{what} at {offset} len {len} is not aligned to the {lbs}-byte logical block"),
        ));
    }
    if offset.checked_add(len64).is_none_or(|end| end > size) {
        return Err(Error::new(
            ErrorKind::Range,
            format!("{what} at {offset} len {len} is beyond the end of the device ({size} bytes)"),
        ));
    }
    Ok(())
}

pub(crate) fn check_caw(
    geo: &Geometry,
    size: u64,
    lba: u64,
    expected: &[u8],
    new: &[u8],
) -> Result<()> {
    let lbs = geo.logical_block_size as usize;
    if expected.len() != lbs || new.len() != lbs {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "compare_and_write covers exactly one {lbs}-byte block, got {}/{}",
                expected.len(),
                new.len()
            ),
        ));
    }
    check_io(geo, size, lba * geo.lbs(), lbs, "compare_and_write")
}
