//! The data path: open/read/write/truncate/fallocate/lseek/fsync.
//!
//! Fast path: a read, or an aligned write inside already-written extents below EOF, holds the
//! inode lock shared, copies through a per-thread aligned buffer and issues one device I/O per
//! physically contiguous run: no volume lock, no allocation, no metadata I/O.
//! Everything else (holes, unwritten extents, growth, unaligned writes) takes the metadata
//! path under the inode's exclusive lock. There, an *allocating* write (holes, unwritten
//! extents, growth) plans and holds its blocks under the metadata mutex, writes its data
//! without any lock, and is mapped under the mutex again, in groups by one mapper thread at
//! a time (`map_written`; the waiting rules are in fs/inflight.rs); a caller with a
//! completion ([`Volume::write_then`]) does not wait for the mapping. Only a write that must
//! read-modify-write a partial block of a written extent, or remove setuid/setgid bits, does
//! its I/O under the locks. Newly allocated or converted blocks are always written in whole
//! 4 KiB blocks (zero-padded) *before* the metadata that maps them commits, so no stale
//! device bytes can ever be read through a file.
//!
//! **Allocation granule** (mount option `granule=KiB`, 1 MiB by default, as VMFS's file
//! block). With a granule of G, in a sparse file of [`GRANULE_MIN_SIZE`] or more (a VM disk
//! image made with `truncate` or `qemu-img create`), the first write into an aligned G that
//! holds no allocated block allocates and writes (zero-padded) the whole granule, clipped to
//! the file's size (`Volume::granule`); smaller files, granules already partly allocated, and
//! a granule that neither the pool nor the bitmaps can give allocate exactly the blocks
//! written. The trade (docs/performance.md §6c): a fresh image's random 4 KiB writes soon
//! land in allocated granules and take the fast path (no metadata, no mapper, no lock), and a
//! thin image has at most one extent per granule instead of up to one per 4 KiB written; the
//! cost is the zeros written with each first touch (a guest's first pass over new space moves
//! up to G per touch through the LUN's bandwidth) and up to G of space per touched granule of
//! an image written sparsely. `granule=4` allocates exactly what is written.

use super::suid::{self, Credentials};
use super::txn::{Meta, Tx};
use super::{
    Caller, FallocMode, Ino, InodeInner, InodeState, OpenFile, Volume, Whence, WriteAt, Written,
};
use crate::dev::AlignedBuf;
use crate::error::Result;
use crate::format::inode::flags;
use crate::format::lock_record::LockMode;
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};
use crate::sync::LockPolicy;
use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

/// The allocation granule of image-sized sparse files by default, bytes: 1 MiB, VMFS's file
/// block (module doc; mount option `granule=KiB`, 4 = allocate exactly what is written).
pub const DEFAULT_ALLOC_GRANULE: u64 = MAX_ALLOC_GRANULE;
/// The granule measured in docs/performance.md (`granule=64`): qcow2's cluster size.
pub const ALLOC_GRANULE: u64 = 64 << 10;
/// The largest granule a mount accepts.
pub const MAX_ALLOC_GRANULE: u64 = 1 << 20;
/// Sparse files at least this large allocate by granule (module doc).
pub const GRANULE_MIN_SIZE: u64 = 16 << 20;
/// Appends to a file at least this large keep this node's pool filled (as writes to an
/// image do), so that the next appends go without the global lock ([`Volume::write_owned`]):
/// a log, not a file that `echo >>` touches once.
const APPEND_POOL_MIN: u64 = 64 << 10;
/// Pool blocks a write without the global lock leaves for the tree nodes its mapping (and
/// the mappings of the other writes in flight) may need (fs/pool.rs).
const POOL_MARGIN: u64 = super::pool::TREE_MARGIN * 8;
/// Pool inode extents left free beyond what the writes in flight may add (fs/pool.rs).
const POOL_ROOM_SPARE: usize = 8;

thread_local! {
    /// One reusable aligned I/O buffer per FUSE worker thread.
    static IOBUF: RefCell<AlignedBuf> = RefCell::new(AlignedBuf::new((1 << 20) + 2 * FS_BLOCK_SIZE));
}

fn with_buf<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    IOBUF.with(|b| {
        let mut b = b.borrow_mut();
        b.resize(len);
        f(&mut b[..len])
    })
}

/// One READ of a [`Volume::read_batch`]: `dst.len()` bytes at `offset`.
#[derive(Debug)]
pub struct BatchRead<'a> {
    pub fh: &'a OpenFile,
    pub offset: u64,
    pub dst: &'a mut [u8],
    /// Set when the batch answered it: the count read (short at EOF). None: answer it alone.
    pub done: Option<Result<usize>>,
}

/// One WRITE of a [`Volume::write_batch`]: `data` at `offset` on behalf of `who`.
pub struct BatchWrite<'a> {
    pub fh: &'a OpenFile,
    pub offset: u64,
    pub data: &'a [u8],
    pub who: &'a dyn Credentials,
    /// Set when the batch wrote it: the count written. None: answer it alone.
    pub done: Option<Result<u32>>,
}

impl std::fmt::Debug for BatchWrite<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchWrite")
            .field("ino", &self.fh.ino)
            .field("offset", &self.offset)
            .field("len", &self.data.len())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

fn us(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// What backs one segment of an allocating write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SegKind {
    /// A hole: new blocks, held in the allocator until mapped.
    New,
    /// An unwritten extent: converted to written when mapped.
    Unwritten,
    /// A written extent, whole blocks only (partial ones take the locked path).
    Written,
}

/// File blocks [b0, b1) of an allocating write, backed from device block `phys` on.
#[derive(Debug, Clone, Copy)]
struct Seg {
    b0: u64,
    b1: u64,
    phys: u64,
    kind: SegKind,
}

/// An allocating write whose data is on the device (or failed), queued to be mapped.
#[derive(Debug)]
pub(super) struct ToMap {
    st: Arc<InodeState>,
    plan: Vec<Seg>,
    id: u64,
    written: Result<()>,
    end: u64,
    done: Done,
    /// Its new blocks come from this node's pool (fs/pool.rs, fs/detached.rs).
    pooled: bool,
}

/// An allocating write's blocks, held while its data is written.
struct Planned {
    plan: Vec<Seg>,
    /// Its entry in the in-flight table (fs/inflight.rs).
    id: u64,
    /// Its new blocks come from this node's pool.
    pooled: bool,
}

/// What the metadata step of a write that the fast path did not take did
/// ([`Volume::write_slow`]): the whole write (a read-modify-write: offset written at and
/// setuid/setgid bits removed), or the plan of an allocating write (and its offset) whose data
/// is written next, without the metadata mutex.
enum Slow {
    Written(u64, u32),
    Planned(Planned, u64),
}

/// Called once with the result of a write that was queued to be mapped
/// ([`Volume::write_then`]), on whichever thread mapped it.
pub type WriteDone = Box<dyn FnOnce(Result<Written>) + Send>;

/// What [`Volume::write_then`] did.
pub enum WriteStarted {
    /// The write finished on the caller's thread: its result, and the completion unused.
    Done(Result<Written>, WriteDone),
    /// The write's data is on the device and it is queued to be mapped: the completion will
    /// be called once with its result.
    Queued,
}

impl std::fmt::Debug for WriteStarted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteStarted::Done(r, _) => f.debug_tuple("Done").field(r).finish(),
            WriteStarted::Queued => f.write_str("Queued"),
        }
    }
}

/// Who learns a queued write's result.
enum Done {
    /// Its writer, waiting on this.
    Wait(Arc<Waiter>),
    /// A completion: the writer went on.
    Call(Box<dyn FnOnce(Result<()>) + Send>),
}

impl std::fmt::Debug for Done {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Done::Wait(_) => "Wait",
            Done::Call(_) => "Call",
        })
    }
}

impl Done {
    fn deliver(self, r: Result<()>) {
        match self {
            Done::Wait(w) => {
                *w.result.lock().or_panic() = Some(r);
                w.cv.notify_one();
            }
            Done::Call(f) => f(r),
        }
    }
}

/// Where the mapper leaves a waiting writer's result.
#[derive(Default)]
struct Waiter {
    result: std::sync::Mutex<Option<Result<()>>>,
    cv: std::sync::Condvar,
}

/// Allocating writes waiting to be mapped, and the threads mapping them. A mapper maps until
/// the queue is empty, so a write queued while one does needs no mapper of its own: queued
/// writes always have one (`mappers > 0`), who looks at the queue again before it stops.
#[derive(Debug, Default)]
pub(super) struct MapQueue {
    items: Vec<ToMap>,
    /// Threads in `run_mapper`: one, or two while one hands over.
    mappers: usize,
    /// A mapper whose writer waits for its own result (which it has) asks the next writer
    /// that queues to take over, so that it can return.
    successor_wanted: bool,
}

/// One error reported to each write of a group.
fn again(e: &crate::Error) -> crate::Error {
    crate::Error::new(e.kind(), e.to_string())
}

/// An operation that drains a file ([`Volume::quiesce`]); dropping it lets writes in again.
pub(super) struct Quiesced<'a> {
    vol: &'a Volume,
    ino: Ino,
}

impl Drop for Quiesced<'_> {
    fn drop(&mut self) {
        self.vol.lock_meta().inflight_mut().drain_end(self.ino);
        self.vol.inflight_done.notify_all();
    }
}

/// Fewest bytes of zeros around a write into new blocks (a granule's) that go to
/// [`BlockDevice::write_zeroes`](crate::dev::BlockDevice::write_zeroes) rather than into the
/// write's buffer: below this one write of the zeros costs less than a second request.
const ZERO_OFFLOAD_MIN: u64 = 64 * 1024;

/// How the parts of a block range that the write does not cover are filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fill {
    /// Keep what the blocks hold (written extents): read-modify-write partial blocks.
    Existing,
    /// Zeros (new or unwritten blocks, which read as zeros).
    Zero,
}

impl Volume {
    pub(super) fn open_state(st: Arc<InodeState>, writable: bool) -> Arc<OpenFile> {
        st.opens.fetch_add(1, Ordering::AcqRel);
        if writable {
            st.writers.fetch_add(1, Ordering::AcqRel);
        }
        Arc::new(OpenFile {
            ino: st.ino,
            writable,
            state: st,
        })
    }

    /// Open as a privileged caller (`O_TRUNC` keeps setuid/setgid bits); see [`Volume::open_by`].
    pub fn open(&self, ino: Ino, writable: bool, truncate: bool) -> Result<Arc<OpenFile>> {
        self.open_by(ino, writable, truncate, &Caller::ROOT)
    }

    /// Open `ino`; with `truncate` (`O_TRUNC` on a writable open) the file is emptied and, as
    /// any truncate by `who`, loses the setuid/setgid bits [`suid`] says (even when already
    /// empty, as on a local filesystem).
    pub fn open_by(
        &self,
        ino: Ino,
        writable: bool,
        truncate: bool,
        who: &dyn Credentials,
    ) -> Result<Arc<OpenFile>> {
        let st = self.loaded_state(ino)?;
        {
            let inner = st.read();
            if inner.inode.is_dir() && writable {
                bail!(IsDir, "inode {ino} is a directory");
            }
            if writable {
                self.check_writable()?;
                if inner.inode.flags & flags::IMMUTABLE != 0 {
                    bail!(PermissionDenied, "inode {ino} is immutable");
                }
            }
        }
        self.register_open(&st, writable)?;
        if truncate && writable {
            let set = super::SetAttr {
                size: Some(0),
                ..Default::default()
            };
            let needed = {
                let i = &st.read().inode;
                i.size != 0 || suid::may_drop(i.mode)
            };
            if needed {
                if let Err(e) = self.setattr_by(ino, &set, who) {
                    if st.opens.load(Ordering::Acquire) == 0 {
                        self.unregister_open(&st);
                    }
                    return Err(e);
                }
            }
        }
        if writable {
            self.detached.writer_opened();
        }
        Ok(Self::open_state(st, writable))
    }

    /// Close `fh`. Never waits for a global lock whose holders are silent: what needs it is
    /// then finished in the background (`fs/closer.rs`).
    pub fn release(&self, fh: &Arc<OpenFile>) -> Result<()> {
        let st = &fh.state;
        let last_writer = fh.writable && st.writers.fetch_sub(1, Ordering::AcqRel) == 1;
        let last = st.opens.fetch_sub(1, Ordering::AcqRel) == 1;
        // This node's last file open for writing: its block pool goes back once idle, from
        // the closer (fs/closer.rs), never from here.
        if fh.writable {
            self.detached.writer_closed();
        }
        if self.unmounted.load(Ordering::Relaxed) {
            return Ok(());
        }
        // A read-only mount registers its opens too (other nodes must not free a file it
        // reads), so it clears them as well.
        if last || last_writer {
            self.unregister_open(st);
        }
        if self.read_only {
            return Ok(());
        }
        if last_writer {
            // The file's allocation window (memory).
            Tx::new(&*self.dev, &mut self.lock_meta()).forget_owner(st.ino);
        }
        if st.read().freed {
            // Freed already (an unlink that overtook this release freed it into the pool:
            // fs/detached_ns.rs).
            return Ok(());
        }
        // The mtime of writes this node made into a file it owns goes in without the global
        // lock, as at an fsync.
        self.fold_pending_owned(st)?;
        // Another node may have unlinked it: its link count is known after a refresh.
        if last && !self.is_current_unlocked(st) {
            match self.read_op_or_stop(true, |tx| self.refresh(tx, st)) {
                Ok(Some(())) => {}
                Ok(None) => return self.finish_close_or_defer(st),
                Err(e) if e.kind() == crate::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        let pending = st.has_pending.load(Ordering::Acquire);
        let unlinked = last && st.read().inode.nlink == 0;
        if !(pending || unlinked) {
            return Ok(());
        }
        if unlinked && !pending {
            // A fresh inode goes back into the pool without the global lock.
            if let Some(r) = self.free_fresh(st) {
                return r;
            }
        }
        self.finish_close_or_defer(st)
    }

    /// Read up to `size` bytes at `offset`; `reply` receives the bytes (short at EOF).
    pub fn read(
        &self,
        fh: &OpenFile,
        offset: u64,
        size: u32,
        reply: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        let (admitted, end) = self.read_span(fh, offset, u64::from(size))?;
        let Some(end) = end else {
            reply(&[]);
            return Ok(());
        };
        let lbs = self.dev.geometry().lbs();
        let a0 = offset - offset % lbs;
        let a1 = end.div_ceil(lbs) * lbs;
        with_buf(us(a1 - a0), |buf| {
            self.fill(&admitted.inner, a0, buf)?;
            reply(&buf[us(offset - a0)..us(end - a0)]);
            Ok(())
        })
    }

    /// [`Volume::read`] into the caller's buffer: up to `dst.len()` bytes at `offset`, and the
    /// count read (short at EOF). When `offset` is a multiple of the device's logical block
    /// and `dst` is aligned for it (an [`crate::dev::AlignedBuf`]), the device reads straight
    /// into `dst` (a FUSE transport's reply buffer: no copy in the daemon); otherwise through
    /// [`Volume::read`]'s buffer and one copy.
    pub fn read_into(&self, fh: &OpenFile, offset: u64, dst: &mut [u8]) -> Result<usize> {
        let lbs = self.dev.geometry().lbs();
        let size = u32::try_from(dst.len()).unwrap_or(u32::MAX);
        let direct = offset.is_multiple_of(lbs)
            && (dst.as_ptr() as usize).is_multiple_of(crate::dev::IO_ALIGN)
            && (dst.len() as u64).is_multiple_of(lbs);
        if !direct {
            let mut n = 0;
            self.read(fh, offset, size, &mut |b| {
                n = b.len().min(dst.len());
                dst[..n].copy_from_slice(&b[..n]);
            })?;
            return Ok(n);
        }
        let (admitted, end) = self.read_span(fh, offset, u64::from(size))?;
        let Some(end) = end else {
            return Ok(0);
        };
        let a1 = end.div_ceil(lbs) * lbs;
        self.fill(&admitted.inner, offset, &mut dst[..us(a1 - offset)])?;
        Ok(us(end - offset))
    }

    /// Admission to the data path for a read of `len` bytes at `offset` (the block map is
    /// used only while current: fs/cluster.rs), and where the read ends: `None` when there is
    /// nothing to read (at or past EOF, or `len` 0).
    fn read_span<'a>(
        &'a self,
        fh: &'a OpenFile,
        offset: u64,
        len: u64,
    ) -> Result<(super::cluster::Admitted<'a>, Option<u64>)> {
        let Some(admitted) = self.admit(&fh.state, true)? else {
            bail!(Io, "inode {}: no admission to the data path", fh.ino);
        };
        let fsize = admitted.inner.inode.size;
        let end = (offset < fsize && len > 0).then(|| fsize.min(offset + len));
        Ok((admitted, end))
    }

    /// Fill `buf` with the file's bytes from `a0` on (both multiples of the logical block):
    /// written extents from the device, holes and unwritten extents as zeros.
    fn fill(&self, inner: &super::InodeInner, a0: u64, buf: &mut [u8]) -> Result<()> {
        let mut reads = Vec::new();
        Self::plan_fill(inner, a0, buf, &mut reads);
        self.dev.read_many(&mut reads)
    }

    /// [`Volume::fill`]'s plan: holes and unwritten extents are zeroed here, and the device
    /// reads that fill the rest are added to `reads`.
    fn plan_fill<'b>(
        inner: &super::InodeInner,
        a0: u64,
        mut buf: &'b mut [u8],
        reads: &mut Vec<(u64, &'b mut [u8])>,
    ) {
        let a1 = a0 + buf.len() as u64;
        let mut pos = a0;
        while pos < a1 {
            let fb = pos / FS_BLOCK;
            let (stop, phys) = match inner.extents.find(fb) {
                Some(e) if !e.unwritten() => (
                    a1.min(e.end() * FS_BLOCK),
                    Some((e.physical + (fb - e.logical)) * FS_BLOCK + pos % FS_BLOCK),
                ),
                Some(e) => (a1.min(e.end() * FS_BLOCK), None),
                None => (
                    a1.min(
                        inner
                            .extents
                            .next_from(fb)
                            .map_or(u64::MAX, |e| e.logical * FS_BLOCK),
                    ),
                    None,
                ),
            };
            let (part, rest) = std::mem::take(&mut buf).split_at_mut(us(stop - pos));
            buf = rest;
            match phys {
                Some(p) => reads.push((p, part)),
                None => part.fill(0),
            }
            pos = stop;
        }
    }

    /// Write as a privileged caller (setuid/setgid bits are kept); see [`Volume::write_by`].
    pub fn write(&self, fh: &OpenFile, offset: u64, data: &[u8]) -> Result<u32> {
        self.write_by(fh, WriteAt::Offset(offset), data, &Caller::ROOT)
            .map(|w| w.bytes)
    }

    /// Write `data` where `at` says on behalf of `who`. A write that must remove setuid/setgid
    /// bits ([`suid::on_write`]) takes the metadata path, and the bits go in the same
    /// transaction as the write's size and mtime update. An append ([`WriteAt::End`]) never
    /// takes the fast path: its offset is chosen under the metadata mutex with the file's
    /// size known to be current ([`Volume::write_owned`] for a file this node owns, else the
    /// metadata path, [`Volume::write_slow`]); an empty one reports the size this node knows.
    pub fn write_by(
        &self,
        fh: &OpenFile,
        at: WriteAt,
        data: &[u8],
        who: &dyn Credentials,
    ) -> Result<Written> {
        self.write_with(fh, at, data, who, &mut None)
    }

    /// [`Volume::write_by`], except that an allocating write whose data is on the device does
    /// not wait to be mapped: it is queued and `done` is called with its result by the thread
    /// that maps it ([`WriteStarted::Queued`]), so the caller can go on to other requests.
    /// Any other write finishes here and `done` is handed back unused. The caller keeps `fh`
    /// open until `done` has run (a write in flight keeps its file from being freed:
    /// fs/inflight.rs); the kernel sends FUSE RELEASE only after every answer.
    pub fn write_then(
        &self,
        fh: &OpenFile,
        at: WriteAt,
        data: &[u8],
        who: &dyn Credentials,
        done: WriteDone,
    ) -> WriteStarted {
        let mut done = Some(done);
        let r = self.write_with(fh, at, data, who, &mut done);
        match done {
            Some(d) => WriteStarted::Done(r, d),
            None => WriteStarted::Queued,
        }
    }

    /// A write; an allocating one takes `done` when it is queued (`map_written`).
    fn write_with(
        &self,
        fh: &OpenFile,
        at: WriteAt,
        data: &[u8],
        who: &dyn Credentials,
        done: &mut Option<WriteDone>,
    ) -> Result<Written> {
        if !fh.writable {
            bail!(InvalidInput, "file handle is not open for writing");
        }
        let len = u32::try_from(data.len())
            .map_err(|_| crate::Error::new(crate::ErrorKind::InvalidInput, "write too large"))?;
        if data.is_empty() {
            let offset = match at {
                WriteAt::Offset(o) => o,
                WriteAt::End => fh.state.read().inode.size,
            };
            return Ok(Written {
                offset,
                bytes: 0,
                dropped: 0,
            });
        }
        if let WriteAt::Offset(offset) = at {
            if self.try_fast_write(&fh.state, offset, data, who)? {
                return Ok(Written {
                    offset,
                    bytes: len,
                    dropped: 0,
                });
            }
        }
        self.check_writable()?;
        let (offset, dropped) = self.write_slow(&fh.state, at, data, who, done)?;
        Ok(Written {
            offset,
            bytes: len,
            dropped,
        })
    }

    /// The metadata path of a write. Under the metadata mutex (global lock exclusive) and the
    /// inode's write lock: wait while the blocks overlap a write in flight ([`inflight`]),
    /// then either (a) plan the write and hold its new blocks, write the data *without* the
    /// mutex and map it under the mutex again (an allocating write, at full queue depth), or
    /// (b) when a partial block of a written extent must be read, modified and written (which
    /// must not race a fast-path write into the rest of that block), do it all under the locks.
    ///
    /// **An append's offset is chosen here** (or, for a file this node owns, by
    /// [`Volume::write_owned`] under the same rule with the inode's lock in place of the
    /// global lock): it is the file's size read under the metadata mutex with the global lock
    /// exclusive (no other node can change the file until this write is mapped: the lock is
    /// not given up while it is in flight) and after every write in flight into the file is
    /// mapped (one of them may extend it). Returns the offset written at and the
    /// setuid/setgid bits removed.
    ///
    /// [`inflight`]: super::inflight
    fn write_slow(
        &self,
        st: &Arc<InodeState>,
        at: WriteAt,
        data: &[u8],
        who: &dyn Credentials,
        done: &mut Option<WriteDone>,
    ) -> Result<(u64, u32)> {
        if let WriteAt::Offset(offset) = at {
            if let Some(dropped) = self.try_detached(st, offset, data, who, done)? {
                return Ok((offset, dropped));
            }
        }
        if let Some(offset) = self.write_owned(st, at, data, who)? {
            return Ok((offset, 0));
        }
        // Until it changed anything, the metadata path starts again rather than wait for
        // another node's hold of the inode holding the global lock (`Volume::restarting`).
        let (planned, offset) =
            match self.restarting(|waited| self.plan_slow(st, at, data, who, waited))? {
                Slow::Written(offset, dropped) => return Ok((offset, dropped)),
                Slow::Planned(planned, offset) => (planned, offset),
            };
        let written = self.write_plan(&planned.plan, offset, data);
        let at = Self::queued_at(offset, data);
        self.map_written(st, planned, written, at, done)
            .map(|dropped| (offset, dropped))
    }

    /// [`Volume::write_slow`]'s metadata step under the locks, one attempt
    /// (`waited`: [`Tx::restartable`]): a whole read-modify-write, or a planned allocating
    /// write whose blocks are held and in flight.
    fn plan_slow(
        &self,
        st: &Arc<InodeState>,
        at: WriteAt,
        data: &[u8],
        who: &dyn Credentials,
        waited: &[crate::error::LockWait],
    ) -> Result<Slow> {
        let len = data.len() as u64;
        loop {
            let mut meta = self.meta_ex()?;
            let (w0, w1) = match at {
                WriteAt::Offset(o) => (o / FS_BLOCK, (o + len).div_ceil(FS_BLOCK)),
                WriteAt::End => (0, u64::MAX),
            };
            if meta.inflight().must_wait(st.ino, w0, w1) {
                drop(self.wait_inflight(meta));
                continue;
            }
            let mut tx = Tx::restartable(&*self.dev, &mut meta, waited);
            self.refresh(&mut tx, st)?;
            let inner = st.write();
            // Before planning blocks or reading any for a read-modify-write: other nodes'
            // fast paths must have stopped using their copy of this inode (fs/inode_lock.rs).
            self.own_inode(&mut tx, st.ino)?;
            // Held exclusively now: the next writes may go without the global lock, from a
            // pool this hold keeps filled (fs/detached.rs).
            self.keep_pool(&mut tx, &inner, st.ino, at == WriteAt::End);
            let offset = match at {
                WriteAt::Offset(o) => o,
                WriteAt::End => inner.inode.size,
            };
            let end = offset + len;
            let (b0, b1) = (offset / FS_BLOCK, end.div_ceil(FS_BLOCK));
            if let Err(e) = Self::check_write(st.ino, &inner, offset) {
                drop(inner);
                // Only the pool may have changed (keep_pool): into the running transaction.
                tx.commit()?;
                return Err(e);
            }
            // The rare write that removes setuid/setgid bits is one locked operation too.
            if Self::needs_rmw(&inner, offset, end)
                || (suid::may_drop(inner.inode.mode) && !who.has_fsetid())
            {
                drop(inner);
                return self
                    .write_under_lock(tx, st, offset, data, who)
                    .map(|dropped| Slow::Written(offset, dropped));
            }
            // A granule must not take blocks of another write in flight (its blocks are not
            // mapped yet, so they look like a hole): then only the write's own blocks.
            let wide = match self.granule(&inner, b0, b1) {
                (p0, p1) if tx.inflight().must_wait(st.ino, p0, p1) => (b0, b1),
                wide => wide,
            };
            // A granule the volume cannot give (nearly full) is no error: then only the
            // write's own blocks, as without a granule.
            let planned = match self.plan_held(&mut tx, &inner, wide) {
                Ok(planned) => Ok((planned, wide)),
                Err(e) if wide == (b0, b1) => Err(e),
                Err(_) => self
                    .plan_held(&mut tx, &inner, (b0, b1))
                    .map(|planned| (planned, (b0, b1))),
            };
            drop(inner);
            // Only the pool may have changed (keep_pool): the held blocks are in memory only.
            // Committed when no plan was made too: a commit point for space
            // (`Volume::restarting`) must find every change in the running transaction.
            let committed = tx.commit();
            let ((plan, pooled), (p0, p1)) = match planned {
                Ok(planned) => planned,
                Err(e) => {
                    committed?;
                    return Err(e);
                }
            };
            if let Err(e) = committed {
                if pooled {
                    self.detached.end(st.ino);
                }
                return Err(e);
            }
            let id = if pooled {
                meta.inflight_mut().begin_pooled(st.ino, p0, p1)
            } else {
                meta.inflight_mut().begin(st.ino, p0, p1)
            };
            return Ok(Slow::Planned(Planned { plan, id, pooled }, offset));
        }
    }

    /// Plan file blocks `[p0, p1)` of a write under the global lock: from the pool when it has
    /// the blocks (the same placement as the writes without the global lock that follow), else
    /// from the bitmaps. Returns the plan and whether it is pooled. A pool write may be mapped
    /// after the global lock went (it holds no bitmap blocks): it counts as a detached write
    /// of the inode, so the inode's lock is not handed over before it is mapped.
    fn plan_held(
        &self,
        tx: &mut Tx<'_>,
        inner: &InodeInner,
        (p0, p1): (u64, u64),
    ) -> Result<(Vec<Seg>, bool)> {
        match Self::plan_write(tx, inner, p0, p1, true) {
            Ok(plan) if self.detached.begin(inner.inode.ino) => return Ok((plan, true)),
            Ok(plan) => Self::unreserve(tx, &plan, true),
            Err(_) => {}
        }
        Ok((Self::plan_write(tx, inner, p0, p1, false)?, false))
    }

    /// The data of an allocating write, segment by segment (new and unwritten blocks get
    /// zeros around the data).
    fn write_plan(&self, plan: &[Seg], offset: u64, data: &[u8]) -> Result<()> {
        plan.iter().try_for_each(|s| {
            let fill = if s.kind == SegKind::Written {
                Fill::Existing
            } else {
                Fill::Zero
            };
            self.write_segment(s.phys, s.b0, s.b1, offset, data, fill)
        })
    }

    /// Under the global lock, with `ino`'s lock held exclusively: keep this node's pool
    /// usable for the file's next writes (fs/pool.rs). Only costs the detached path if it
    /// fails, so a failure is logged, not returned.
    fn keep_pool(&self, tx: &mut Tx<'_>, inner: &InodeInner, ino: Ino, append: bool) {
        let Some(il) = &self.cl.ilocks else {
            return;
        };
        if self.read_only {
            return;
        }
        self.reopen_owned(il, ino);
        if inner.inode.size < GRANULE_MIN_SIZE && !(append && inner.inode.size >= APPEND_POOL_MIN) {
            // Not a VM image, nor a log being appended to: small files are written under
            // the global lock, and a pool would be made and given back around each of them.
            self.detached.refilled();
            return;
        }
        let goal = inner.extents.goal_for(u64::MAX).unwrap_or(ino + 1);
        if let Err(e) = tx.ensure_pool(goal) {
            tracing::debug!("the block pool could not be refilled: {e}");
        }
        self.detached.refilled();
    }

    /// A write that neither the fast path nor [`Volume::try_detached`] takes — a
    /// read-modify-write of a written block (a small write into a log file's last block), an
    /// append — into a file this node owns, made whole under the metadata mutex and the
    /// inode's write lock **without the global lock**, as the metadata path makes it with it
    /// ([`Volume::write_locked`]); its new blocks come from this node's pool. An append's
    /// offset is the size this node's copy shows: the copy is current (the lock is this
    /// node's alone) and no write into the file is in flight (else refused). Returns the
    /// offset written at; None, with nothing changed, when it cannot: the file is not owned
    /// or a handoff of it has begun, a write into the range is in flight, a setuid/setgid bit
    /// would have to go, a write at an offset needs no read-modify-write (it is an
    /// allocating write that [`Volume::try_detached`] left to the metadata path to refill the
    /// pool), or the pool lacks the blocks or the room ([`Meta::pool_fits`]). Errors of the
    /// file itself (removed, immutable, append-only) are answered as on the metadata path.
    fn write_owned(
        &self,
        st: &Arc<InodeState>,
        at: WriteAt,
        data: &[u8],
        who: &dyn Credentials,
    ) -> Result<Option<u64>> {
        let len = data.len() as u64;
        if let WriteAt::Offset(o) = at {
            // The usual case (an allocating write left to the metadata path) without the
            // metadata mutex; asked again under it below.
            if !Self::needs_rmw(&st.read(), o, o + len) {
                return Ok(None);
            }
        }
        let refused = || Self::refused("a locked write");
        let mut written_at = None;
        let r = self.change_owned(st, |tx, inner| {
            let (offset, (w0, w1)) = match at {
                WriteAt::Offset(o) => (o, (o / FS_BLOCK, (o + len).div_ceil(FS_BLOCK))),
                WriteAt::End => (inner.inode.size, (0, u64::MAX)),
            };
            let end = offset + len;
            if tx.inflight().must_wait(st.ino, w0, w1)
                || (matches!(at, WriteAt::Offset(_)) && !Self::needs_rmw(inner, offset, end))
                || (suid::may_drop(inner.inode.mode) && !who.has_fsetid())
            {
                return Err(refused());
            }
            Self::check_write(st.ino, inner, offset)?;
            let (b0, b1) = (offset / FS_BLOCK, end.div_ceil(FS_BLOCK));
            let holes = Self::holes(inner, b0, b1);
            let mut unwritten = false;
            let mut b = b0;
            while let Some(e) = inner.extents.next_from(b).filter(|e| e.logical < b1) {
                unwritten |= e.unwritten();
                b = e.end();
            }
            // Holes take blocks; a write into an unwritten extent splits it (a tree node).
            if (!holes.is_empty() || unwritten)
                && (holes.len() > crate::format::inode::INLINE_EXTENTS_MAX
                    || !tx.meta_mut().pool_fits(
                        holes.len() + 2,
                        0,
                        holes.iter().map(|h| h.1).sum(),
                    ))
            {
                return Err(refused());
            }
            let r = self.write_locked(tx, inner, offset, data);
            // Whatever was written and mapped before an error is kept consistent.
            Self::note_written(st, inner, if r.is_ok() { end } else { 0 });
            self.save(tx, inner)?;
            r?;
            written_at = Some(offset);
            Ok(())
        });
        r.map(|_| written_at)
    }

    /// An allocating write without the global lock (fs/detached.rs), if it can be one: this
    /// node owns the inode's lock with a valid cache, the pool has the blocks, and the write
    /// needs neither a read-modify-write nor a setuid/setgid change. None = take the metadata
    /// path. Returns the setuid/setgid bits removed (none).
    fn try_detached(
        &self,
        st: &Arc<InodeState>,
        offset: u64,
        data: &[u8],
        who: &dyn Credentials,
        done: &mut Option<WriteDone>,
    ) -> Result<Option<u32>> {
        let Some(il) = &self.cl.ilocks else {
            return Ok(None);
        };
        if self.read_only {
            return Ok(None);
        }
        let end = offset + data.len() as u64;
        let (b0, b1) = (offset / FS_BLOCK, end.div_ceil(FS_BLOCK));
        let (plan, id) = {
            let mut meta = self.lock_meta();
            // A write into blocks that an allocating write in flight maps (its granule, under a
            // guest's random writes into a fresh image), or into a file being drained
            // (truncate, punch, fallocate, defrag), waits for that here, without the global
            // lock, and then goes through the checks below (usually on as a write into what
            // the other write mapped). The metadata path would wait the same way, but holding
            // the global lock, which it takes from another node first if one holds it: a
            // handoff, and four device flushes (docs/performance.md §6o).
            while meta.inflight().must_wait(st.ino, b0, b1) && il.owns(st.data_lock(il)) {
                meta = self.wait_inflight(meta);
            }
            // Format 7: a low pool is topped up here from this node's own groups, without
            // the global lock (fs/group_marks.rs); else the metadata path does it below.
            if meta.pool_is_low() && il.owns(st.data_lock(il)) {
                self.refill_marked(&mut meta);
            }
            if meta.pool_available() == 0
                || meta.pool_room() < 2 * (meta.inflight().pooled() + 1) + POOL_ROOM_SPARE
                || self.detached.should_refill(meta.pool_is_low())
                || meta.inflight().must_wait(st.ino, b0, b1)
                || !il.owns(st.data_lock(il))
            {
                return Ok(None);
            }
            let inner = st.write();
            if inner.freed
                || Self::check_write(st.ino, &inner, offset).is_err()
                || Self::needs_rmw(&inner, offset, end)
                || (suid::may_drop(inner.inode.mode) && !who.has_fsetid())
            {
                return Ok(None);
            }
            let (p0, p1) = match self.granule(&inner, b0, b1) {
                (p0, p1) if meta.inflight().must_wait(st.ino, p0, p1) => (b0, b1),
                wide => wide,
            };
            let mut tx = Tx::detached(&*self.dev, &mut meta);
            // A pool short of a granule sends the write to the locked path, which refills the
            // pool or takes the granule from the bitmaps (and only when neither can, the
            // write's own blocks): allocating just the write's blocks here would leave the
            // granule partly allocated, so never widened again.
            let Ok(plan) = Self::plan_write(&mut tx, &inner, p0, p1, true) else {
                return Ok(None);
            };
            drop(inner);
            if !self.detached.begin(st.ino) {
                Self::unreserve(&mut tx, &plan, true);
                return Ok(None);
            }
            drop(tx);
            (plan, meta.inflight_mut().begin_pooled(st.ino, p0, p1))
        };
        let written = self.write_plan(&plan, offset, data);
        let at = Self::queued_at(offset, data);
        let planned = Planned {
            plan,
            id,
            pooled: true,
        };
        self.map_written(st, planned, written, at, done).map(Some)
    }

    /// What an allocating write of `data` at `offset` reports when it is mapped (it removed
    /// no bits: a write that must remove them takes the locked path).
    fn queued_at(offset: u64, data: &[u8]) -> Written {
        Written {
            offset,
            bytes: u32::try_from(data.len()).unwrap_or(u32::MAX),
            dropped: 0,
        }
    }

    /// The file blocks a write of blocks [b0, b1) allocates: the whole aligned granule
    /// (`granule=KiB`) around it when the file is an image-sized sparse file
    /// ([`GRANULE_MIN_SIZE`] or more) and nothing in that granule is allocated yet, clipped to
    /// the file's size (the write's own blocks always); otherwise just [b0, b1). The blocks the
    /// write does not cover are written with zeros before the granule is mapped, so the file's
    /// contents are what a 4 KiB allocation gives; later writes into the granule are
    /// overwrites of written blocks, which take the fast path (no metadata, no global lock).
    /// This is VMFS's thin-provisioning unit (1 MiB file blocks zeroed on first write) and
    /// qcow2's 64 KiB cluster, at qcow2's size: a guest's random 4 KiB writes into a fresh
    /// image otherwise each allocate a block and change the extent tree under the metadata
    /// mutex, at about a fifth of the speed of the same writes into a written image.
    fn granule(&self, inner: &InodeInner, b0: u64, b1: u64) -> (u64, u64) {
        let n = self.granule_blocks;
        let size_blocks = inner.inode.size.div_ceil(FS_BLOCK);
        if n <= 1 || inner.inode.size < GRANULE_MIN_SIZE || b1 - b0 >= n {
            return (b0, b1);
        }
        let g0 = b0 - b0 % n;
        let g1 = (g0 + n).min(size_blocks).max(b1);
        if g1 > g0 + n {
            return (b0, b1);
        }
        let hole = inner.extents.next_from(g0).is_none_or(|e| e.logical >= g1);
        if hole {
            (g0, g1)
        } else {
            (b0, b1)
        }
    }

    /// Write preconditions checked under the inode's write lock.
    fn check_write(ino: Ino, inner: &InodeInner, offset: u64) -> Result<()> {
        if inner.freed {
            bail!(NotFound, "inode {ino} was removed");
        }
        if inner.inode.flags & flags::IMMUTABLE != 0 {
            bail!(PermissionDenied, "inode {ino} is immutable");
        }
        if inner.inode.flags & flags::APPEND != 0 && offset != inner.inode.size {
            bail!(PermissionDenied, "inode {ino} is append-only");
        }
        Ok(())
    }

    /// Does writing bytes [offset, end) read-modify-write a partial block of a written extent?
    fn needs_rmw(inner: &InodeInner, offset: u64, end: u64) -> bool {
        let written = |b: u64| inner.extents.find(b).is_some_and(|e| !e.unwritten());
        (!offset.is_multiple_of(FS_BLOCK) && written(offset / FS_BLOCK))
            || (!end.is_multiple_of(FS_BLOCK) && written(end / FS_BLOCK))
    }

    /// Split file blocks [b0, b1) into segments by what backs them; holes get new blocks, held
    /// in the allocator until [`Volume::map_written`]. All or nothing.
    fn plan_write(
        tx: &mut Tx<'_>,
        inner: &InodeInner,
        b0: u64,
        b1: u64,
        pooled: bool,
    ) -> Result<Vec<Seg>> {
        let mut plan = Vec::new();
        let mut b = b0;
        while b < b1 {
            if let Some(e) = inner.extents.find(b) {
                let seg_end = b1.min(e.end());
                let kind = if e.unwritten() {
                    SegKind::Unwritten
                } else {
                    SegKind::Written
                };
                plan.push(Seg {
                    b0: b,
                    b1: seg_end,
                    phys: e.physical + (b - e.logical),
                    kind,
                });
                b = seg_end;
                continue;
            }
            let next = inner.extents.next_from(b).map_or(u64::MAX, |e| e.logical);
            let seg_end = b1.min(next);
            let goal = inner.extents.goal_for(b).unwrap_or(inner.inode.ino + 1);
            let reserved = if pooled {
                let margin = POOL_MARGIN
                    + super::pool::TREE_MARGIN
                        * u64::try_from(tx.inflight().pooled()).unwrap_or(u64::MAX / 8);
                tx.reserve_pooled(goal, seg_end - b, inner.inode.ino, margin)
                    .ok_or_else(|| {
                        crate::Error::new(crate::ErrorKind::NoSpace, "the block pool is short")
                    })
            } else {
                tx.reserve_data(goal, seg_end - b, inner.inode.ino)
            };
            let runs = match reserved {
                Ok(r) => r,
                Err(e) => {
                    Self::unreserve(tx, &plan, pooled);
                    return Err(e);
                }
            };
            for (p, l) in runs {
                plan.push(Seg {
                    b0: b,
                    b1: b + l,
                    phys: p,
                    kind: SegKind::New,
                });
                b += l;
            }
        }
        Ok(plan)
    }

    fn unreserve(tx: &mut Tx<'_>, plan: &[Seg], pooled: bool) {
        for s in plan.iter().filter(|s| s.kind == SegKind::New) {
            if pooled {
                tx.unreserve_pooled(s.phys);
            } else {
                tx.unreserve(s.phys, s.b1 - s.b0);
            }
        }
    }

    /// The last step of an allocating write: map it, or, if the data write failed (or the file
    /// went away), give its held blocks back; either way it leaves the in-flight table.
    ///
    /// Mapping is done in groups, by one thread at a time: the write queues itself and, if no
    /// thread is mapping, maps (under the metadata mutex, one transaction per group: one inode
    /// update per file, one bitmap image per changed bitmap block) until the queue is empty.
    /// A write queued while another thread maps is mapped by that thread: with a completion
    /// (`done`, [`Volume::write_then`]) its writer goes on at once and the mapper calls the
    /// completion; without one the writer waits for its result. Under a deep queue that keeps
    /// the mutex from being the bottleneck and no writer sleeps on it in turn.
    ///
    /// Returns what the write removed (nothing here); when `done` was taken, the completion
    /// has or will have the result and the return value means nothing.
    fn map_written(
        &self,
        st: &Arc<InodeState>,
        planned: Planned,
        written: Result<()>,
        at: Written,
        done: &mut Option<WriteDone>,
    ) -> Result<u32> {
        let Planned { plan, id, pooled } = planned;
        let (done, waiter) = if let Some(d) = done.take() {
            let call = move |r: Result<()>| d(r.map(|()| at));
            (Done::Call(Box::new(call)), None)
        } else {
            let w = Arc::new(Waiter::default());
            (Done::Wait(w.clone()), Some(w))
        };
        if !pooled {
            // A use of the global lock for its hold window: a writer whose data I/O takes
            // longer than the window's idle time is still busy.
            self.note_lock_use();
        }
        let mapper = {
            let mut q = self.to_map.lock().or_panic();
            q.items.push(ToMap {
                st: st.clone(),
                plan,
                id,
                written,
                end: at.offset + u64::from(at.bytes),
                done,
                pooled,
            });
            let start = q.mappers == 0 || std::mem::take(&mut q.successor_wanted);
            if start {
                q.mappers += 1;
            }
            start
        };
        if mapper {
            self.run_mapper(waiter.as_deref());
        }
        let Some(w) = waiter else {
            return Ok(0);
        };
        let mut r = w.result.lock().or_panic();
        loop {
            if let Some(r) = r.take() {
                return r.map(|()| 0);
            }
            r = w.cv.wait(r).or_panic();
        }
    }

    /// Map queued writes until the queue is empty (this thread counted itself in `mappers`).
    /// Not `meta_ex`: a handoff waits for these very writes, and the lock is held exclusively
    /// for as long as anything holding bitmap blocks is in flight (fs/inflight.rs); writes
    /// from the pool need no global lock (fs/detached.rs).
    ///
    /// `own`: this thread's writer waits for its result there. Once it has it, the thread
    /// stops as soon as another mapper is there (it asks the next writer that queues to be
    /// one), so a waiting writer is not kept mapping for others under a steady stream.
    fn run_mapper(&self, own: Option<&Waiter>) {
        loop {
            let mut meta = self.lock_meta();
            let batch = std::mem::take(&mut self.to_map.lock().or_panic().items);
            let results = if batch.is_empty() {
                Vec::new()
            } else {
                self.map_batch(&mut meta, batch)
            };
            drop(meta);
            for (d, r) in results {
                d.deliver(r);
            }
            let answered = own.is_some_and(|w| w.result.lock().or_panic().is_some());
            let mut q = self.to_map.lock().or_panic();
            if q.items.is_empty() || (answered && q.mappers > 1) {
                q.mappers -= 1;
                if q.mappers == 0 {
                    q.successor_wanted = false;
                }
                return;
            }
            if answered {
                q.successor_wanted = true;
            }
        }
    }

    /// Rule 4 of fs/detached.rs: a thread that holds the metadata mutex while it waits for
    /// the cluster maps the queued writes of inodes nobody has locked (a mapper waiting for
    /// the mutex finds the rest).
    /// Those of locked inodes stay queued, where their mapper looks before it stops. The
    /// writes mapped here are answered with the mutex held (a FUSE reply does not block).
    pub(super) fn map_serving(&self, m: &mut Meta) {
        let batch: Vec<ToMap> = {
            let mut q = self.to_map.lock().or_panic();
            let (now, later) = std::mem::take(&mut q.items)
                .into_iter()
                .partition(|w| w.st.try_write().is_some());
            q.items = later;
            now
        };
        if !batch.is_empty() {
            for (d, r) in self.map_batch(m, batch) {
                d.deliver(r);
            }
        }
    }

    /// Map a group of allocating writes in one transaction (metadata mutex held). Without the
    /// global lock held exclusively, every write in the batch is from the pool, of an inode
    /// this node owns (fs/detached.rs): the transaction is a detached one. Returns who to
    /// tell what, one per write, in the batch's order (sorted by inode).
    fn map_batch(&self, meta: &mut Meta, mut batch: Vec<ToMap>) -> Vec<(Done, Result<()>)> {
        let detached = meta.gml() != LockMode::Exclusive;
        debug_assert!(
            !detached || batch.iter().all(|w| w.pooled),
            "bitmap blocks in flight without the global lock"
        );
        batch.sort_by_key(|w| w.st.ino);
        let mut results: Vec<Result<()>> = Vec::with_capacity(batch.len());
        let mut tx = if detached {
            Tx::detached(&*self.dev, meta)
        } else {
            Tx::new(&*self.dev, meta)
        };
        let mut changed = Vec::new();
        for group in batch.chunk_by_mut(|a, b| a.st.ino == b.st.ino) {
            let st = group[0].st.clone();
            let owned = !detached || self.owns_inode(&st);
            let loaded = if owned {
                self.refresh(&mut tx, &st)
            } else {
                Err(crate::Error::new(
                    crate::ErrorKind::Io,
                    format!("inode {} lost its lock with a write in flight", st.ino),
                ))
            }
            .and_then(|()| {
                let inner = st.write();
                if inner.freed {
                    bail!(NotFound, "inode {} was removed", st.ino);
                }
                Ok(inner)
            });
            let mut inner = match loaded {
                Ok(inner) => inner,
                Err(e) => {
                    for w in group.iter_mut() {
                        Self::unreserve(&mut tx, &w.plan, w.pooled);
                        let own = std::mem::replace(&mut w.written, Ok(()));
                        results.push(own.and(Err(again(&e))));
                    }
                    continue;
                }
            };
            let first = results.len();
            let mut end = None;
            for w in group.iter_mut() {
                if let Err(e) = std::mem::replace(&mut w.written, Ok(())) {
                    Self::unreserve(&mut tx, &w.plan, w.pooled);
                    results.push(Err(e));
                    continue;
                }
                for s in &w.plan {
                    match s.kind {
                        SegKind::New if w.pooled => {
                            tx.commit_pooled(s.phys, s.b1 - s.b0);
                            inner.extents.insert(s.b0, s.phys, s.b1 - s.b0, false);
                            inner.inode.blocks += s.b1 - s.b0;
                        }
                        SegKind::New => {
                            tx.commit_reserved(s.phys, s.b1 - s.b0);
                            inner.extents.insert(s.b0, s.phys, s.b1 - s.b0, false);
                            inner.inode.blocks += s.b1 - s.b0;
                        }
                        SegKind::Unwritten => inner.extents.set_unwritten(s.b0, s.b1, false),
                        SegKind::Written => {}
                    }
                }
                end = end.max(Some(w.end));
                results.push(Ok(()));
            }
            if let Some(end) = end {
                Self::note_written(&st, &mut inner, end);
                if let Err(e) = self.save(&mut tx, &mut inner) {
                    for r in &mut results[first..] {
                        if r.is_ok() {
                            *r = Err(again(&e));
                        }
                    }
                }
                if detached {
                    changed.push(st.ino);
                }
            }
        }
        // As in meta_op: what was done is consistent, so it is committed even on error.
        if let Err(e) = tx.commit() {
            for r in &mut results {
                if r.is_ok() {
                    *r = Err(again(&e));
                }
            }
        }
        for ino in changed {
            self.detached.changed(ino);
        }
        for w in &batch {
            meta.inflight_mut().end(w.id);
            if w.pooled {
                self.detached.end(w.st.ino);
            }
        }
        self.inflight_done.notify_all();
        debug_assert_eq!(batch.len(), results.len());
        batch.into_iter().map(|w| w.done).zip(results).collect()
    }

    /// Size and times after a write ending at `end` (write lock held).
    fn note_written(st: &InodeState, inner: &mut InodeInner, end: u64) {
        Self::fold_pending(st, inner);
        if end > inner.inode.size {
            inner.inode.size = end;
        }
        let t = super::now();
        inner.inode.mtime = t;
        inner.inode.ctime = t;
    }

    /// A write that must read-modify-write a written block: all of it under the metadata mutex
    /// and the inode's write lock, as one metadata operation.
    fn write_under_lock(
        &self,
        mut tx: Tx<'_>,
        st: &InodeState,
        offset: u64,
        data: &[u8],
        who: &dyn Credentials,
    ) -> Result<u32> {
        let r = (|| {
            let mut inner = st.write();
            self.own_inode(&mut tx, st.ino)?;
            let r = self.write_locked(&mut tx, &mut inner, offset, data);
            // Whatever was written and mapped before an error is kept consistent.
            let end = if r.is_ok() {
                offset + data.len() as u64
            } else {
                0
            };
            Self::note_written(st, &mut inner, end);
            let dropped = suid::on_write(inner.inode.mode, inner.inode.gid, who);
            inner.inode.mode &= !dropped;
            self.save(&mut tx, &mut inner)?;
            r.map(|()| dropped)
        })();
        let c = tx.commit();
        let v = r?;
        c?;
        Ok(v)
    }

    /// Wait (releasing the metadata mutex) until an allocating write in flight or a drain ends.
    pub(super) fn wait_inflight<'a>(&self, m: MutexGuard<'a, Meta>) -> MutexGuard<'a, Meta> {
        self.inflight_done.wait(m).or_panic()
    }

    /// Wait (releasing the metadata mutex meanwhile) until no allocating write is in flight.
    pub(super) fn drained<'a>(&self, mut m: MutexGuard<'a, Meta>) -> MutexGuard<'a, Meta> {
        while !m.inflight().is_empty() {
            m = self.wait_inflight(m);
        }
        m
    }

    /// Wait (releasing the metadata mutex meanwhile) until no write in flight holds blocks of
    /// the bitmaps (a global handoff; writes from the pool map without the lock).
    pub(super) fn drained_of_bitmap_blocks<'a>(
        &self,
        mut m: MutexGuard<'a, Meta>,
    ) -> MutexGuard<'a, Meta> {
        while m.inflight().holds_bitmap_blocks() {
            m = self.wait_inflight(m);
        }
        m
    }

    /// Drain `ino` for an operation that changes its block map other than by writing
    /// (truncate, punch, zero-range, fallocate): new writes into it wait until the guard is
    /// dropped, and the writes already in flight are mapped before this returns.
    pub(super) fn quiesce(&self, ino: Ino) -> Quiesced<'_> {
        let mut m = self.lock_meta();
        m.inflight_mut().drain_start(ino);
        while m.inflight().busy(ino) {
            m = self.wait_inflight(m);
        }
        Quiesced { vol: self, ino }
    }

    /// The fast path; Ok(false) means "take the metadata path".
    fn try_fast_write(
        &self,
        st: &InodeState,
        offset: u64,
        data: &[u8],
        who: &dyn Credentials,
    ) -> Result<bool> {
        if !self.fast_write_aligned(offset, data) {
            return Ok(false);
        }
        let Some(admitted) = self.admit(st, false)? else {
            return Ok(false);
        };
        let Some(spans) = self.fast_write_spans(st, &admitted.inner, offset, data.len(), who)
        else {
            return Ok(false);
        };
        let put = |buf: &[u8]| {
            let writes: Vec<(u64, &[u8])> =
                spans.iter().map(|(p, r)| (*p, &buf[r.clone()])).collect();
            self.dev.write_many(&writes)
        };
        // Data already aligned for the device (a FUSE transport's page-aligned buffer) goes
        // as it is; anything else through the aligned buffer.
        if (data.as_ptr() as usize).is_multiple_of(crate::dev::IO_ALIGN) {
            put(data)?;
        } else {
            with_buf(data.len(), |buf| {
                buf.copy_from_slice(data);
                put(buf)
            })?;
        }
        st.note_write();
        Ok(true)
    }

    /// The first test of the fast path for a write of `data` at `offset`: whole logical blocks.
    fn fast_write_aligned(&self, offset: u64, data: &[u8]) -> bool {
        let lbs = self.dev.geometry().lbs();
        offset.is_multiple_of(lbs) && (data.len() as u64).is_multiple_of(lbs)
    }

    /// May a write of `len` bytes at `offset` take the fast path under `inner` (admitted), and
    /// if so, where its parts go: (device offset, range of the data) per written extent it
    /// covers. It may if it lies inside written extents below EOF, the file takes fast-path
    /// writes now (no defrag), is neither immutable nor append-only, the volume is writable,
    /// and the write removes no setuid/setgid bit. The one home of that rule.
    fn fast_write_spans(
        &self,
        st: &InodeState,
        inner: &super::InodeInner,
        offset: u64,
        len: usize,
        who: &dyn Credentials,
    ) -> Option<Vec<(u64, std::ops::Range<usize>)>> {
        let end = offset + len as u64;
        if st.no_fast_writes.load(Ordering::Acquire) > 0
            || inner.freed
            || end > inner.inode.size
            || inner.inode.flags & (flags::IMMUTABLE | flags::APPEND) != 0
            || self.read_only
            // Rare: bits to remove need a metadata update (who is asked only then).
            || (suid::may_drop(inner.inode.mode) && !who.has_fsetid())
        {
            return None;
        }
        let mut spans = Vec::new();
        let mut pos = offset;
        while pos < end {
            let fb = pos / FS_BLOCK;
            match inner.extents.find(fb) {
                Some(e) if !e.unwritten() => {
                    let stop = end.min(e.end() * FS_BLOCK);
                    let phys = (e.physical + (fb - e.logical)) * FS_BLOCK + pos % FS_BLOCK;
                    spans.push((phys, us(pos - offset)..us(stop - offset)));
                    pos = stop;
                }
                _ => return None,
            }
        }
        Some(spans)
    }

    /// Answer the reads of `batch` that can be answered now without waiting, their device
    /// reads all in flight at once ([`BlockDevice::read_many`]: one system call for the lot
    /// on a file or block node). A read is taken when it is aligned as
    /// [`Volume::read_into`]'s direct case and its admission to the data path needs no wait
    /// (the inode's lock held and its cache valid, no handoff or metadata change of it under
    /// way: [`Volume::admit_now`]); its `done` is then set. The others (`done` stays None),
    /// and all of them if the device fails, are for the caller to answer one by one
    /// ([`Volume::read_into`]), where any error is reported for its own request.
    ///
    /// [`BlockDevice::read_many`]: crate::dev::BlockDevice::read_many
    pub fn read_batch(&self, batch: &mut [BatchRead<'_>]) {
        let lbs = self.dev.geometry().lbs();
        let mut held = Vec::with_capacity(batch.len());
        let mut reads = Vec::with_capacity(batch.len());
        let mut counts = Vec::with_capacity(batch.len());
        for (i, r) in batch.iter_mut().enumerate() {
            let direct = r.offset.is_multiple_of(lbs)
                && (r.dst.as_ptr() as usize).is_multiple_of(crate::dev::IO_ALIGN)
                && (r.dst.len() as u64).is_multiple_of(lbs);
            if !direct {
                continue;
            }
            let fh: &OpenFile = r.fh;
            let Some(admitted) = self.admit_now(&fh.state) else {
                continue;
            };
            let fsize = admitted.inner.inode.size;
            let len = r.dst.len() as u64;
            let n = if r.offset < fsize && len > 0 {
                let end = fsize.min(r.offset + len);
                let a1 = end.div_ceil(lbs) * lbs;
                Self::plan_fill(
                    &admitted.inner,
                    r.offset,
                    &mut r.dst[..us(a1 - r.offset)],
                    &mut reads,
                );
                end - r.offset
            } else {
                0
            };
            held.push(admitted);
            counts.push((i, us(n)));
        }
        let ok = self
            .dev
            .read_many(&mut reads)
            .inspect_err(|e| {
                tracing::warn!(
                    "a batch of {} reads failed ({e}); each is made again",
                    reads.len()
                );
            })
            .is_ok();
        drop(reads);
        drop(held);
        if ok {
            for (i, n) in counts {
                batch[i].done = Some(Ok(n));
            }
        }
    }

    /// The writes of `batch` that can go now without waiting, their device writes all in
    /// flight at once, as [`Volume::read_batch`]: a write is taken when it may take the fast
    /// path ([`Volume::fast_write_spans`]: an overwrite of written blocks below EOF), its data
    /// is aligned for the device, and its admission needs no wait. The others (`done` stays
    /// None; all of them if the device fails, whose writes are then made again) are for the
    /// caller to answer one by one ([`Volume::write_by`]).
    pub fn write_batch(&self, batch: &mut [BatchWrite<'_>]) {
        let mut held = Vec::with_capacity(batch.len());
        let mut writes: Vec<(u64, &[u8])> = Vec::with_capacity(batch.len());
        let mut taken = Vec::with_capacity(batch.len());
        for (i, w) in batch.iter().enumerate() {
            if !w.fh.writable
                || w.data.is_empty()
                || !self.fast_write_aligned(w.offset, w.data)
                || !(w.data.as_ptr() as usize).is_multiple_of(crate::dev::IO_ALIGN)
            {
                continue;
            }
            let st = &w.fh.state;
            let Some(admitted) = self.admit_now(st) else {
                continue;
            };
            let Some(spans) =
                self.fast_write_spans(st, &admitted.inner, w.offset, w.data.len(), w.who)
            else {
                continue;
            };
            writes.extend(spans.into_iter().map(|(p, r)| (p, &w.data[r])));
            held.push(admitted);
            taken.push(i);
        }
        let ok = self
            .dev
            .write_many(&writes)
            .inspect_err(|e| {
                tracing::warn!(
                    "a batch of {} writes failed ({e}); each is made again",
                    writes.len()
                );
            })
            .is_ok();
        drop(writes);
        if ok {
            // Under the admissions, as try_fast_write does: a metadata change of the inode
            // that follows sees this write's mtime.
            for &i in &taken {
                batch[i].fh.state.note_write();
            }
        }
        drop(held);
        if ok {
            for i in taken {
                let w = &mut batch[i];
                w.done = Some(Ok(u32::try_from(w.data.len()).unwrap_or(u32::MAX)));
            }
        }
    }

    /// Write `data` at `offset`, allocating and converting as needed (exclusive inode lock held).
    fn write_locked(
        &self,
        tx: &mut Tx<'_>,
        inner: &mut InodeInner,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        let end = offset + data.len() as u64;
        let fb1 = end.div_ceil(FS_BLOCK);
        let mut b = offset / FS_BLOCK;
        while b < fb1 {
            if let Some(e) = inner.extents.find(b) {
                let seg_end = fb1.min(e.end());
                let phys = e.physical + (b - e.logical);
                if e.unwritten() {
                    self.write_segment(phys, b, seg_end, offset, data, Fill::Zero)?;
                    inner.extents.set_unwritten(b, seg_end, false);
                } else {
                    self.write_segment(phys, b, seg_end, offset, data, Fill::Existing)?;
                }
                b = seg_end;
            } else {
                let next = inner.extents.next_from(b).map_or(u64::MAX, |e| e.logical);
                let seg_end = fb1.min(next);
                let goal = inner.extents.goal_for(b).unwrap_or(inner.inode.ino + 1);
                let runs = Self::alloc_blocks(tx, goal, seg_end - b, inner.inode.ino)?;
                let mut lb = b;
                for (p, l) in runs {
                    inner.inode.blocks += l;
                    // Map only after the data is on the device.
                    let w = self.write_segment(p, lb, lb + l, offset, data, Fill::Zero);
                    if let Err(e) = w {
                        // Just allocated: its group is loaded, so this reads nothing.
                        let _ = tx.free(p, l);
                        inner.inode.blocks -= l;
                        return Err(e);
                    }
                    inner.extents.insert(lb, p, l, false);
                    lb += l;
                }
                b = seg_end;
            }
        }
        Ok(())
    }

    /// Write file blocks [b0, b1) (device blocks from `phys`) with the part of `data` (which
    /// starts at file byte `offset`) that falls inside them.
    fn write_segment(
        &self,
        phys: u64,
        b0: u64,
        b1: u64,
        offset: u64,
        data: &[u8],
        fill: Fill,
    ) -> Result<()> {
        let seg_start = b0 * FS_BLOCK;
        let seg_end = b1 * FS_BLOCK;
        // A segment of an allocation granule may lie wholly before or after the data.
        let d0 = offset.clamp(seg_start, seg_end);
        let d1 = (offset + data.len() as u64).clamp(d0, seg_end);
        if fill == Fill::Zero && self.dev.offloads_zeroes() {
            // The zeros of a granule around the data go to the device's zeroing (the LUN's
            // WRITE SAME), not through the wire: the blocks that hold data are written with
            // any side of zeros shorter than ZERO_OFFLOAD_MIN, the whole blocks of a longer
            // side zeroed.
            let (mut w0, mut w1) = if d1 > d0 {
                (d0 / FS_BLOCK, d1.div_ceil(FS_BLOCK))
            } else {
                (b1, b1)
            };
            if (w0 - b0) * FS_BLOCK < ZERO_OFFLOAD_MIN {
                w0 = b0;
            }
            if (b1 - w1) * FS_BLOCK < ZERO_OFFLOAD_MIN {
                w1 = b1;
            }
            if w0 > b0 || w1 < b1 {
                if w0 > b0 {
                    self.dev
                        .write_zeroes(phys * FS_BLOCK, (w0 - b0) * FS_BLOCK)?;
                }
                if w1 > w0 {
                    self.write_segment(phys + (w0 - b0), w0, w1, offset, data, fill)?;
                }
                if b1 > w1 {
                    self.dev
                        .write_zeroes((phys + (w1 - b0)) * FS_BLOCK, (b1 - w1) * FS_BLOCK)?;
                }
                return Ok(());
            }
        }
        let len = seg_end - seg_start;
        with_buf(us(len), |buf| {
            let head = us(d0 - seg_start);
            let tail = us(d1 - seg_start);
            match fill {
                Fill::Zero => {
                    buf[..head].fill(0);
                    buf[tail..].fill(0);
                }
                Fill::Existing => {
                    if head > 0 {
                        self.dev
                            .read_at(phys * FS_BLOCK, &mut buf[..FS_BLOCK_SIZE])?;
                    }
                    if tail < us(len) && !(head > 0 && len == FS_BLOCK) {
                        let last = us(len) - FS_BLOCK_SIZE;
                        self.dev
                            .read_at(phys * FS_BLOCK + last as u64, &mut buf[last..])?;
                    }
                }
            }
            if tail > head {
                buf[head..tail].copy_from_slice(&data[us(d0 - offset)..us(d1 - offset)]);
            }
            self.dev.write_at(phys * FS_BLOCK, buf)
        })
    }

    /// Zero bytes [from, to) of the file where they are backed by written blocks.
    fn zero_written(&self, inner: &InodeInner, from: u64, to: u64) -> Result<()> {
        let mut pos = from;
        while pos < to {
            let fb = pos / FS_BLOCK;
            let stop = to.min((fb + 1) * FS_BLOCK);
            if let Some(e) = inner.extents.find(fb) {
                if !e.unwritten() {
                    let zeros = vec![0u8; us(stop - pos)];
                    self.write_segment(
                        e.physical + (fb - e.logical),
                        fb,
                        fb + 1,
                        pos,
                        &zeros,
                        Fill::Existing,
                    )?;
                }
            }
            pos = stop;
        }
        Ok(())
    }

    /// Load the bitmaps of every group holding blocks of file blocks [`start`, `end`), before
    /// anything is punched: a bitmap that cannot be read then fails the operation with the
    /// inode and the bitmaps unchanged (see [`crate::alloc::Allocator::prepare_free`]).
    pub(super) fn prepare_free(
        tx: &mut Tx<'_>,
        inner: &InodeInner,
        start: u64,
        end: u64,
    ) -> Result<()> {
        for e in inner
            .extents
            .iter()
            .filter(|e| e.end() > start && e.logical < end)
        {
            tx.prepare_free(e.physical)?;
        }
        Ok(())
    }

    pub(super) fn truncate_locked(
        &self,
        tx: &mut Tx<'_>,
        inner: &mut InodeInner,
        size: u64,
    ) -> Result<()> {
        if size < inner.inode.size {
            let keep = size.div_ceil(FS_BLOCK);
            Self::prepare_free(tx, inner, keep, u64::MAX)?;
            // Bytes past EOF in the last block must read as zeros if the file grows again.
            // Written before the map changes in memory, so that a failed write leaves it whole.
            if !size.is_multiple_of(FS_BLOCK) {
                self.zero_written(inner, size, keep * FS_BLOCK)?;
            }
            let freed = inner.extents.punch(keep, u64::MAX);
            inner.free_at_save(freed);
        }
        inner.inode.size = size;
        Ok(())
    }

    /// Map every hole in file blocks [b0, b1) with unwritten extents: from the bitmaps, or,
    /// without the global lock, from this node's pool (which [`Volume::falloc_owned`] made
    /// sure holds enough before anything changed).
    fn allocate_unwritten(tx: &mut Tx<'_>, inner: &mut InodeInner, b0: u64, b1: u64) -> Result<()> {
        let ino = inner.inode.ino;
        for (b, n) in Self::holes(inner, b0, b1) {
            let goal = inner.extents.goal_for(b).unwrap_or(ino + 1);
            let runs = Self::alloc_blocks(tx, goal, n, ino)?;
            let mut lb = b;
            for (p, l) in runs {
                inner.inode.blocks += l;
                inner.extents.insert(lb, p, l, true);
                lb += l;
            }
        }
        Ok(())
    }

    /// `n` blocks for file `ino` near `goal`, mapped by this transaction: from the bitmaps,
    /// or, without the global lock, from this node's pool (whose caller made sure before
    /// changing anything that it holds them: [`Meta::pool_fits`]).
    fn alloc_blocks(tx: &mut Tx<'_>, goal: u64, n: u64, ino: Ino) -> Result<Vec<(u64, u64)>> {
        if !tx.is_detached() {
            return tx.alloc_data(goal, n, ino);
        }
        let runs = tx.reserve_pooled(goal, n, ino, 0).ok_or_else(|| {
            crate::Error::new(crate::ErrorKind::NoSpace, "this node's block pool is short")
        })?;
        for &(p, l) in &runs {
            tx.commit_pooled(p, l);
        }
        Ok(runs)
    }

    /// The holes of file blocks [b0, b1): (first block, length), in order.
    fn holes(inner: &InodeInner, b0: u64, b1: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut b = b0;
        while b < b1 {
            match inner.extents.next_from(b) {
                Some(e) if e.logical <= b => b = e.end(),
                next => {
                    let stop = next.map_or(b1, |e| e.logical.min(b1));
                    out.push((b, stop - b));
                    b = stop;
                }
            }
        }
        out
    }

    /// The extents of file blocks [b0, b1), at most `max`: (count, blocks inside the range);
    /// None if there are more.
    fn mapped(inner: &InodeInner, b0: u64, b1: u64, max: usize) -> Option<(usize, u64)> {
        let (mut n, mut blocks, mut b) = (0, 0, b0);
        while let Some(e) = inner.extents.next_from(b).filter(|e| e.logical < b1) {
            n += 1;
            if n > max {
                return None;
            }
            blocks += e.end().min(b1) - e.logical.max(b0);
            b = e.end();
        }
        Some((n, blocks))
    }

    /// Would freeing what `inner` maps in file blocks [`b0`, `b1`) fit into this node's pool
    /// ([`Meta::pool_fits`])? The test of a hole punched, and of a truncate, without the
    /// global lock. Runs an earlier change unmapped and left for a save count too.
    fn frees_fit(m: &Meta, inner: &InodeInner, b0: u64, b1: u64) -> bool {
        let (left, left_blocks) = inner.unfreed_count();
        Self::mapped(inner, b0, b1, crate::format::inode::INLINE_EXTENTS_MAX)
            .is_some_and(|(runs, blocks)| m.pool_fits(runs + left, blocks + left_blocks, 0))
    }

    pub fn fallocate(&self, ino: Ino, offset: u64, len: u64, mode: FallocMode) -> Result<()> {
        self.check_writable()?;
        if len == 0 {
            bail!(InvalidInput, "fallocate length 0");
        }
        let end = offset
            .checked_add(len)
            .ok_or_else(|| crate::Error::new(crate::ErrorKind::InvalidInput, "range overflows"))?;
        // Every mode changes the block map: the file's allocating writes in flight go first.
        let _drained = self.quiesce(ino);
        if self.falloc_owned(ino, offset, end, mode)? {
            return Ok(());
        }
        self.restartable_op(|tx| {
            let st = self.state(tx, ino)?;
            let mut inner = st.write();
            self.own_inode(tx, ino)?;
            self.falloc_change(tx, &st, &mut inner, offset, end, mode)
        })
    }

    /// What `fallocate` of bytes [offset, end) in `mode` does to the file, on the global path
    /// and without it alike (the caller holds the inode's locks and drained its writes): the
    /// one home of each mode's rule. Without the global lock ([`Volume::falloc_owned`]) a
    /// punched hole frees into this node's pool and new unwritten extents come from it.
    fn falloc_change(
        &self,
        tx: &mut Tx<'_>,
        st: &InodeState,
        inner: &mut InodeInner,
        offset: u64,
        end: u64,
        mode: FallocMode,
    ) -> Result<()> {
        let ino = inner.inode.ino;
        if !inner.inode.is_reg() {
            bail!(InvalidInput, "fallocate on a non-regular file");
        }
        if inner.inode.flags & flags::IMMUTABLE != 0 {
            bail!(PermissionDenied, "inode {ino} is immutable");
        }
        if !matches!(mode, FallocMode::Allocate { .. }) && inner.inode.flags & flags::APPEND != 0 {
            bail!(PermissionDenied, "inode {ino} is append-only");
        }
        Self::fold_pending(st, inner);
        let t = super::now();
        let (b0, b1) = (offset / FS_BLOCK, end.div_ceil(FS_BLOCK));
        // Whole blocks strictly inside the range.
        let (f0, f1) = (offset.div_ceil(FS_BLOCK), end / FS_BLOCK);
        let mut grows = None;
        match mode {
            FallocMode::Allocate { keep_size } => {
                Self::allocate_unwritten(tx, inner, b0, b1)?;
                if !keep_size && end > inner.inode.size {
                    grows = Some(end);
                }
            }
            FallocMode::PunchHole => {
                if f0 < f1 {
                    Self::prepare_free(tx, inner, f0, f1)?;
                    // The partial blocks at the ends first: a failed write leaves the map
                    // whole in memory (they are not punched).
                    self.zero_written(inner, offset, f0 * FS_BLOCK)?;
                    self.zero_written(inner, f1 * FS_BLOCK, end)?;
                    let freed = inner.extents.punch(f0, f1);
                    inner.free_at_save(freed);
                } else {
                    self.zero_written(inner, offset, end)?;
                }
                inner.inode.mtime = t;
            }
            FallocMode::ZeroRange { keep_size } => {
                if f0 < f1 {
                    self.zero_written(inner, offset, f0 * FS_BLOCK)?;
                    self.zero_written(inner, f1 * FS_BLOCK, end)?;
                    // Holes first: an allocation that finds no space leaves the map as it was.
                    Self::allocate_unwritten(tx, inner, f0, f1)?;
                    inner.extents.set_unwritten(f0, f1, true);
                } else {
                    self.zero_written(inner, offset, end)?;
                }
                if !keep_size && end > inner.inode.size {
                    grows = Some(end);
                }
                inner.inode.mtime = t;
            }
        }
        if let Some(s) = grows {
            inner.inode.size = s;
            inner.inode.mtime = t;
        }
        inner.inode.ctime = t;
        self.save(tx, inner)
    }

    /// `fallocate` of a file whose lock this node owns (a VM's image, open for writing here),
    /// made without the global lock: a guest's TRIM arrives as a punched hole, and its
    /// write-zeroes (QEMU's `detect-zeroes`) as a zeroed range. Freed runs go into this node's
    /// pool in the same transaction (the pool inode is their deferred-free record: still
    /// marked used in the bitmaps, given back to them with the pool, under the global lock;
    /// a crash leaves them to the pool's free by the recovery), and new unwritten extents
    /// come from it. Ok(false), with nothing changed, when it cannot: the inode is not
    /// loaded or not owned, a handoff of it has begun, or the pool has not the room or the
    /// blocks ([`Meta::pool_fits`]: too many runs, more than
    /// [`pool::FREES_MAX`] blocks freed into it, fewer blocks than the holes need); then the
    /// caller takes the metadata path. The caller drained the file's writes in flight.
    ///
    /// [`pool::FREES_MAX`]: super::pool::FREES_MAX
    fn falloc_owned(&self, ino: Ino, offset: u64, end: u64, mode: FallocMode) -> Result<bool> {
        let Some(st) = self.inodes.get(ino) else {
            return Ok(false);
        };
        let max = crate::format::inode::INLINE_EXTENTS_MAX;
        let refused = || Self::refused("fallocate");
        self.change_owned(&st, |tx, inner| {
            let (b0, b1) = (offset / FS_BLOCK, end.div_ceil(FS_BLOCK));
            let (f0, f1) = (offset.div_ceil(FS_BLOCK), end / FS_BLOCK);
            let holes = |a: u64, b: u64| {
                let h = Self::holes(inner, a, b);
                (h.len() <= max).then(|| (h.len(), h.iter().map(|r| r.1).sum::<u64>()))
            };
            let m = tx.meta_mut();
            let fits = match mode {
                FallocMode::PunchHole => Self::frees_fit(m, inner, f0, f1),
                // Zeroing splits the extents at both ends of the range, and fills its holes.
                FallocMode::ZeroRange { .. } => {
                    holes(f0, f1.max(f0)).is_some_and(|(n, blocks)| m.pool_fits(n + 2, 0, blocks))
                }
                FallocMode::Allocate { .. } => {
                    holes(b0, b1).is_some_and(|(n, blocks)| m.pool_fits(n, 0, blocks))
                }
            };
            if !fits {
                return Err(refused());
            }
            self.falloc_change(tx, &st, inner, offset, end, mode)
        })
    }

    /// `setattr` of a file whose lock this node owns (a VM's image, a container's log or
    /// database, open for writing here), made without the global lock: a size change and
    /// times. A truncate frees into this node's pool in the same transaction, as a punched
    /// hole does ([`Volume::falloc_owned`]); growth changes the size alone. Ok(None), with
    /// nothing changed, when it cannot: not a regular file, a change of mode, owner or group
    /// (ACL xattrs and the setuid rules stay on the metadata path), a size change that would remove setuid or
    /// setgid bits, the inode not loaded or not owned, a handoff of it begun, or a pool without
    /// the room for the truncated runs ([`Meta::pool_fits`]); then the caller takes the
    /// metadata path. The caller drained the file's writes in flight.
    pub(super) fn setattr_owned(
        &self,
        ino: Ino,
        set: &super::SetAttr,
        who: &dyn super::suid::Credentials,
    ) -> Result<Option<super::Attr>> {
        if set.mode.is_some() || set.uid.is_some() || set.gid.is_some() {
            return Ok(None);
        }
        let Some(st) = self.inodes.get(ino) else {
            return Ok(None);
        };
        let refused = || Self::refused("setattr");
        let mut attr = None;
        let r = self.change_owned(&st, |tx, inner| {
            // Directories and symlinks keep the metadata path.
            if !inner.inode.is_reg() {
                return Err(refused());
            }
            if let Some(size) = set.size {
                if super::suid::on_write(inner.inode.mode, inner.inode.gid, who) != 0 {
                    return Err(refused());
                }
                let keep = size.div_ceil(FS_BLOCK);
                if size < inner.inode.size && !Self::frees_fit(tx.meta_mut(), inner, keep, u64::MAX)
                {
                    return Err(refused());
                }
            }
            attr = Some(self.setattr_change(tx, &st, inner, set, who)?);
            Ok(())
        });
        Ok(if r? { attr } else { None })
    }

    /// The file's extent map (for tools and tests: extent counts, fragmentation).
    pub fn extents(&self, ino: Ino) -> Result<Vec<crate::format::extent::Extent>> {
        let st = self.loaded_state(ino)?;
        let inner = st.read();
        Ok(inner.extents.iter().copied().collect())
    }

    pub fn lseek(&self, ino: Ino, offset: u64, whence: Whence) -> Result<u64> {
        let st = self.loaded_state(ino)?;
        let inner = st.read();
        let size = inner.inode.size;
        if offset >= size {
            bail!(
                NoSuchOffset,
                "offset {offset} is at or past the end of the file"
            );
        }
        match whence {
            Whence::Data => {
                let mut b = offset / FS_BLOCK;
                loop {
                    match inner.extents.next_from(b) {
                        Some(e) if !e.unwritten() => {
                            let pos = offset.max(e.logical * FS_BLOCK);
                            if pos >= size {
                                bail!(NoSuchOffset, "no data after offset {offset}");
                            }
                            return Ok(pos);
                        }
                        Some(e) => b = e.end(),
                        None => bail!(NoSuchOffset, "no data after offset {offset}"),
                    }
                }
            }
            Whence::Hole => {
                let mut pos = offset;
                while let Some(e) = inner
                    .extents
                    .find(pos / FS_BLOCK)
                    .filter(|e| !e.unwritten())
                {
                    pos = e.end() * FS_BLOCK;
                }
                Ok(pos.min(size))
            }
        }
    }

    /// Fold `st`'s pending mtime into its inode without the global lock if this node owns
    /// the inode (the image of a VM on this node: `fs/detached.rs`). False if nothing was
    /// pending or the metadata path must fold it.
    fn fold_pending_owned(&self, st: &InodeState) -> Result<bool> {
        if !st.has_pending.load(Ordering::Acquire) {
            return Ok(false);
        }
        self.change_owned(st, |tx, inner| {
            if !inner.freed && Self::fold_pending(st, inner) {
                self.save(tx, inner)?;
            }
            Ok(())
        })
    }

    /// Make the file's data (and with !datasync its metadata) durable.
    ///
    /// Data written on the fast path is already on the device (`O_DIRECT`); metadata is
    /// written at the end of every operation. What remains is the pending mtime (and ctime)
    /// of fast-path writes, and the device's volatile cache. The pending times go in without
    /// the global lock when this node owns the file; otherwise a full fsync takes the global
    /// lock for them, and an **fdatasync leaves them pending** (POSIX does not make it write
    /// timestamps, and ext4 does not): they go in at the close or the next change. That is
    /// what keeps a VM's flushes (QEMU's are fdatasync) from waiting for a dead holder of the
    /// global lock when its image's exclusive hold lapsed (closed and idle for a second, then
    /// reopened: only shared is taken again on the fast path).
    pub fn fsync(&self, ino: Ino, datasync: bool) -> Result<()> {
        let st = self.inodes.get(ino);
        if let Some(st) = st {
            let owned = self.fold_pending_owned(&st)?;
            if !owned && !datasync && st.has_pending.load(Ordering::Acquire) && !self.read_only {
                self.meta_op(|tx| {
                    self.refresh(tx, &st)?;
                    let mut inner = st.write();
                    if !inner.freed && Self::fold_pending(&st, &mut inner) {
                        self.save(tx, &mut inner)?;
                    }
                    Ok(())
                })?;
            }
        }
        if self.read_only {
            return self.dev.flush();
        }
        self.lock_meta().commit_point(&*self.dev)
    }
}
