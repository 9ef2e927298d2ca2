//! A regular file or a block device opened with `O_DIRECT`: the embedded default LUN.
//!
//! `compare_and_write` is emulated by taking an OFD write lock (`F_OFD_SETLKW`) on the block's
//! byte range around read-compare-write. OFD locks exclude other *open file descriptions*, i.e.
//! other processes (and other opens) **on this host only**; two machines sharing a LUN through
//! this backend get no atomicity at all. An in-process stripe of mutexes covers threads that
//! share our one descriptor, which OFD locks do not separate.

use super::{
    check_caw, check_io, AlignedBuf, BlockDevice, CawKind, CawOutcome, Geometry, LiveSize, IO_ALIGN,
};
use crate::error::{Error, ErrorKind, Result};
use crate::sync::LockPolicy;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

nix::ioctl_read!(blk_getsize64, 0x12, 114, u64);
nix::ioctl_read_bad!(blk_sszget, 0x1268, libc::c_int);
nix::ioctl_read_bad!(blk_pbszget, 0x127b, libc::c_uint);
nix::ioctl_write_ptr_bad!(blk_discard, 0x1277, [u64; 2]);
nix::ioctl_write_ptr_bad!(blk_zeroout, 0x127f, [u64; 2]);

const CAW_STRIPES: usize = 64;

#[derive(Debug, Clone)]
pub struct FileDeviceOptions {
    pub read_only: bool,
    /// Logical block size to present for a regular file (block devices report their own).
    pub file_logical_block_size: u32,
    /// Open with `O_DIRECT` (true in production; tests on tmpfs may need false).
    pub direct: bool,
}

impl Default for FileDeviceOptions {
    fn default() -> Self {
        Self {
            read_only: false,
            file_logical_block_size: 512,
            direct: true,
        }
    }
}

#[derive(Debug)]
pub struct FileDevice {
    file: File,
    path: PathBuf,
    geo: Geometry,
    size: LiveSize,
    is_block: bool,
    caw_stripes: Vec<Mutex<()>>,
    /// `write_zeroes` of a block device asks the kernel (`BLKZEROOUT`): the LUN can zero
    /// (`zeroes_offloaded`) and the kernel has not answered that it cannot (else the zeros
    /// are written).
    zero_offload: AtomicBool,
}

/// Does the kernel zero ranges of this block device without writing the zeros itself (its
/// queue's `write_zeroes_max_bytes`: WRITE SAME or WRITE ZEROES on the LUN)? Unknown is no.
fn zeroes_offloaded(meta: &std::fs::Metadata) -> bool {
    let rdev = meta.rdev();
    std::fs::read_to_string(format!(
        "/sys/dev/block/{}:{}/queue/write_zeroes_max_bytes",
        libc::major(rdev),
        libc::minor(rdev)
    ))
    .ok()
    .and_then(|s| s.trim().parse::<u64>().ok())
    .is_some_and(|n| n > 0)
}

impl FileDevice {
    pub fn open(path: &Path, opts: &FileDeviceOptions) -> Result<Self> {
        let ctx = || format!("cannot open {}", path.display());
        let mut oo = OpenOptions::new();
        oo.read(true).write(!opts.read_only);
        if opts.direct {
            oo.custom_flags(libc::O_DIRECT);
        }
        let file = match oo.open(path) {
            Ok(f) => f,
            Err(e) if opts.direct && e.raw_os_error() == Some(libc::EINVAL) => {
                return Err(Error::with_source(
                    ErrorKind::Unsupported,
                    format!(
                        "{}: the filesystem holding it does not support O_DIRECT",
                        ctx()
                    ),
                    e,
                ))
            }
            Err(e) => return Err(Error::io(ctx(), e)),
        };
        let meta = file.metadata().map_err(|e| Error::io(ctx(), e))?;
        let is_block = meta.file_type().is_block_device();
        let (size, lbs, pbs, identity) = if is_block {
            let fd = file.as_raw_fd();
            let mut size = 0u64;
            let mut lbs: libc::c_int = 0;
            let mut pbs: libc::c_uint = 0;
            // SAFETY: fd is an open block device and the out-pointers are valid for the ioctl.
            unsafe {
                blk_getsize64(fd, &raw mut size).map_err(|e| Error::io(ctx(), e.into()))?;
                blk_sszget(fd, &raw mut lbs).map_err(|e| Error::io(ctx(), e.into()))?;
                blk_pbszget(fd, &raw mut pbs).map_err(|e| Error::io(ctx(), e.into()))?;
            }
            let rdev = meta.rdev();
            let lbs = u32::try_from(lbs).unwrap_or(512);
            (
                size,
                lbs,
                pbs.max(lbs),
                format!("blockdev:{}:{}", libc::major(rdev), libc::minor(rdev)),
            )
        } else {
            let lbs = opts.file_logical_block_size;
            (
                meta.len(),
                lbs,
                lbs,
                format!("file:{}:{}", meta.dev(), meta.ino()),
            )
        };
        if lbs != 512 && lbs != 4096 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{}: logical block size {lbs} is not supported (512 or 4096)",
                    path.display()
                ),
            ));
        }
        let size = size - size % u64::from(lbs);
        Ok(Self {
            file,
            path: path.to_path_buf(),
            geo: Geometry {
                logical_block_size: lbs,
                physical_block_size: pbs,
                size_bytes: size,
                identity,
                caw: CawKind::HostLocal,
            },
            size: LiveSize::new(size),
            is_block,
            caw_stripes: (0..CAW_STRIPES).map(|_| Mutex::new(())).collect(),
            zero_offload: AtomicBool::new(is_block && zeroes_offloaded(&meta)),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn is_block_device(&self) -> bool {
        self.is_block
    }

    fn ofd_lock(&self, start: u64, len: u64, lock: bool) -> Result<()> {
        // SAFETY: flock is plain old data; all-zero is a valid starting value.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = libc::c_short::try_from(if lock { libc::F_WRLCK } else { libc::F_UNLCK })
            .expect("F_WRLCK and F_UNLCK fit a short");
        fl.l_whence = libc::c_short::try_from(libc::SEEK_SET).expect("SEEK_SET fits a short");
        fl.l_start =
            i64::try_from(start).map_err(|_| Error::new(ErrorKind::Range, "lock offset"))?;
        fl.l_len = i64::try_from(len).map_err(|_| Error::new(ErrorKind::Range, "lock length"))?;
        loop {
            // SAFETY: valid fd and a pointer to an initialized flock.
            let r = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_OFD_SETLKW, &fl) };
            if r == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(Error::io(format!("OFD lock on {}", self.path.display()), e));
            }
        }
    }
}

impl FileDevice {
    /// Run `ops` (checked, aligned) in flight together on this thread's ring; one that the
    /// ring cannot take (none on this kernel or under this seccomp profile) or that comes
    /// back short is finished with a plain `pread`/`pwrite`.
    fn batch(&self, ops: &[batch::Op], what: &str) -> Result<()> {
        let fd = self.file.as_raw_fd();
        let done = batch::run(fd, ops);
        for (op, r) in ops.iter().zip(done) {
            let e = match r {
                Ok(n) if n == op.len => continue,
                // Short (a signal, the end of a regular file): the rest the plain way.
                Ok(n) => match op.finish(&self.file, n) {
                    Ok(()) => continue,
                    Err(e) => e,
                },
                Err(e) => e,
            };
            return Err(Error::io(
                format!(
                    "{what} of {} bytes at {} on {}",
                    op.len,
                    op.offset,
                    self.path.display()
                ),
                e,
            ));
        }
        Ok(())
    }
}

/// Several reads or writes in flight from one thread: a ring per thread (`io_uring`), made
/// on first use and kept; a thread whose ring could not be made does them one by one.
mod batch {
    use io_uring::{opcode, types, IoUring};
    use std::cell::RefCell;
    use std::fs::File;
    use std::io;
    use std::os::unix::fs::FileExt;
    use std::os::unix::io::RawFd;

    /// Ring size: at most this many in flight per submission.
    const DEPTH: u32 = 64;

    /// One read (into `ptr`) or write (from `ptr`) of `len` bytes at `offset`.
    pub(super) struct Op {
        pub offset: u64,
        pub len: usize,
        ptr: *mut u8,
        write: bool,
    }

    impl Op {
        pub fn read(offset: u64, buf: &mut [u8]) -> Self {
            Self {
                offset,
                len: buf.len(),
                ptr: buf.as_mut_ptr(),
                write: false,
            }
        }
        pub fn write(offset: u64, buf: &[u8]) -> Self {
            Self {
                offset,
                len: buf.len(),
                ptr: buf.as_ptr().cast_mut(),
                write: true,
            }
        }

        /// The part after the first `done` bytes, synchronously.
        pub fn finish(&self, file: &File, done: usize) -> io::Result<()> {
            let rest = self.len.saturating_sub(done);
            let at = self.offset + done as u64;
            if self.write {
                // SAFETY: `ptr..ptr+len` is the caller's slice, borrowed for the whole batch
                // (run's callers hold the borrow until it returns).
                let b = unsafe { std::slice::from_raw_parts(self.ptr.add(done), rest) };
                file.write_all_at(b, at)
            } else {
                // SAFETY: as above; a read's slice is borrowed mutably.
                let b = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(done), rest) };
                file.read_exact_at(b, at)
            }
        }
    }

    thread_local! {
        /// This thread's ring; `Err` once making one failed (never tried again).
        static RING: RefCell<Option<io::Result<IoUring>>> = const { RefCell::new(None) };
    }

    /// Run every op; each one's bytes done or its error.
    pub(super) fn run(fd: RawFd, ops: &[Op]) -> Vec<io::Result<usize>> {
        RING.with(|cell| {
            let mut cell = cell.borrow_mut();
            // Only this thread submits, and it reaps only while it waits (task work then,
            // not by interrupting it); kernels before 6.1 get the plain ring.
            let ring = cell.get_or_insert_with(|| {
                IoUring::builder()
                    .setup_single_issuer()
                    .setup_defer_taskrun()
                    .build(DEPTH)
                    .or_else(|_| IoUring::new(DEPTH))
            });
            match ring {
                Ok(ring) => ops
                    .chunks(DEPTH as usize)
                    .flat_map(|chunk| on_ring(ring, fd, chunk))
                    .collect(),
                // Done one by one by the caller's fallback (`finish` from 0).
                Err(_) => ops.iter().map(|_| Ok(0)).collect(),
            }
        })
    }

    /// One chunk (at most `DEPTH` ops) on `ring`.
    fn on_ring(ring: &mut IoUring, fd: RawFd, ops: &[Op]) -> Vec<io::Result<usize>> {
        let mut out: Vec<io::Result<usize>> = ops.iter().map(|_| Ok(0)).collect();
        let mut queued = 0usize;
        for (i, op) in ops.iter().enumerate() {
            let len = u32::try_from(op.len).unwrap_or(u32::MAX);
            let e = if op.write {
                opcode::Write::new(types::Fd(fd), op.ptr.cast_const(), len)
                    .offset(op.offset)
                    .build()
            } else {
                opcode::Read::new(types::Fd(fd), op.ptr, len)
                    .offset(op.offset)
                    .build()
            }
            .user_data(i as u64);
            // SAFETY: the buffer (`ptr`, `len`) is the caller's slice, borrowed until `run`
            // returns, and this function does not return before every queued entry completed.
            if unsafe { ring.submission().push(&e) }.is_ok() {
                queued += 1;
            }
        }
        let mut left = queued;
        while left > 0 {
            match ring.submit_and_wait(left) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                    ) =>
                {
                    continue
                }
                Err(e) => {
                    // Cannot wait for the ones in flight: their buffers may still be written
                    // by the kernel, which no caller could survive. A ring that fails here
                    // is broken; nothing else is safe.
                    panic!("io_uring wait with {left} I/Os in flight failed: {e}");
                }
            }
            for c in ring.completion() {
                left -= 1;
                let Some(slot) = usize::try_from(c.user_data())
                    .ok()
                    .and_then(|i| out.get_mut(i))
                else {
                    continue;
                };
                *slot = match c.result() {
                    // Done again the plain way by the caller (`finish` from 0).
                    r if r == -libc::EAGAIN || r == -libc::EINTR => Ok(0),
                    r => usize::try_from(r).map_err(|_| io::Error::from_raw_os_error(-r)),
                };
            }
        }
        out
    }
}

/// `O_DIRECT` needs the buffer address aligned to the logical block size; our callers pass
/// `AlignedBuf` (4096-aligned) sub-slices at logical-block offsets, which qualify without a copy.
fn aligned(buf: &[u8], lbs: u32) -> bool {
    (buf.as_ptr() as usize).is_multiple_of((lbs as usize).min(IO_ALIGN))
}

impl BlockDevice for FileDevice {
    fn geometry(&self) -> &Geometry {
        &self.geo
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        check_io(&self.geo, self.size.get(), offset, buf.len(), "read")?;
        let res = if aligned(buf, self.geo.logical_block_size) {
            self.file.read_exact_at(buf, offset)
        } else {
            let mut b = AlignedBuf::new(buf.len());
            let r = self.file.read_exact_at(&mut b, offset);
            buf.copy_from_slice(&b);
            r
        };
        res.map_err(|e| {
            Error::io(
                format!(
                    "read of {} bytes at {offset} from {}",
                    buf.len(),
                    self.path.display()
                ),
                e,
            )
        })
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        check_io(&self.geo, self.size.get(), offset, buf.len(), "write")?;
        let res = if aligned(buf, self.geo.logical_block_size) {
            self.file.write_all_at(buf, offset)
        } else {
            self.file.write_all_at(&AlignedBuf::from_slice(buf), offset)
        };
        res.map_err(|e| {
            Error::io(
                format!(
                    "write of {} bytes at {offset} to {}",
                    buf.len(),
                    self.path.display()
                ),
                e,
            )
        })
    }

    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        let lbs = self.geo.logical_block_size;
        if reads.len() < 2 || !reads.iter().all(|(_, b)| aligned(b, lbs)) {
            return reads.iter_mut().try_for_each(|(o, b)| self.read_at(*o, b));
        }
        for (o, b) in reads.iter() {
            check_io(&self.geo, self.size.get(), *o, b.len(), "read")?;
        }
        let ops: Vec<batch::Op> = reads
            .iter_mut()
            .map(|(o, b)| batch::Op::read(*o, b))
            .collect();
        self.batch(&ops, "read")
    }

    fn write_many(&self, writes: &[(u64, &[u8])]) -> Result<()> {
        let lbs = self.geo.logical_block_size;
        if writes.len() < 2 || !writes.iter().all(|(_, b)| aligned(b, lbs)) {
            return writes.iter().try_for_each(|(o, b)| self.write_at(*o, b));
        }
        for (o, b) in writes {
            check_io(&self.geo, self.size.get(), *o, b.len(), "write")?;
        }
        let ops: Vec<batch::Op> = writes
            .iter()
            .map(|(o, b)| batch::Op::write(*o, b))
            .collect();
        self.batch(&ops, "write")
    }

    fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
        check_caw(&self.geo, self.size.get(), lba, expected, new)?;
        let lbs = self.geo.lbs();
        let off = lba * lbs;
        #[allow(clippy::cast_possible_truncation)] // modulo a small constant
        let _g = self.caw_stripes[(lba % CAW_STRIPES as u64) as usize]
            .lock()
            .or_panic();
        self.ofd_lock(off, lbs, true)?;
        let result = (|| {
            let mut cur = AlignedBuf::new(expected.len());
            self.read_at(off, &mut cur)?;
            if cur[..] != *expected {
                return Ok(CawOutcome::Miscompare);
            }
            self.write_at(off, new)?;
            // A CAW on a SCSI target is on the medium's ordering path like any write; the
            // lock layer flushes when it needs durability, so no extra fdatasync here.
            Ok(CawOutcome::Written)
        })();
        let unlock = self.ofd_lock(off, lbs, false);
        let r = result?;
        unlock?;
        Ok(r)
    }

    fn flush(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| Error::io(format!("flush of {}", self.path.display()), e))
    }

    /// BLKGETSIZE64 of a block device (after a rescan), the length of a regular file.
    fn refresh_size(&self) -> Result<u64> {
        let ctx = || format!("reading the size of {}", self.path.display());
        let now = if self.is_block {
            let mut size = 0u64;
            // SAFETY: the fd is an open block device and the out-pointer is valid for the ioctl.
            unsafe { blk_getsize64(self.file.as_raw_fd(), &raw mut size) }
                .map_err(|e| Error::io(ctx(), e.into()))?;
            size
        } else {
            self.file.metadata().map_err(|e| Error::io(ctx(), e))?.len()
        };
        Ok(self.size.grow_to(now, self.geo.lbs()))
    }

    /// `BLKZEROOUT` on a block device whose queue says the LUN can zero (WRITE SAME or WRITE
    /// ZEROES: the zeros never cross the SAN). The kernel holds the device's page-cache
    /// invalidation lock for each call, so the zeroings (and discards) of one host run one
    /// at a time; direct I/O does not wait for them. If the kernel refuses, the zeros are
    /// written here (from then on at once; for a busy page cache, this once). A regular file
    /// gets its zeros written: `FALLOC_FL_ZERO_RANGE` on an ext4 LUN file cost more than it
    /// saved (docs/performance.md §6p: each call waits for all direct I/O in flight on the
    /// file, and the host file's extents fragment, so writes to a prefilled image ran at
    /// 0.55x afterwards).
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        check_io(
            &self.geo,
            self.size.get(),
            offset,
            usize::try_from(len).unwrap_or(usize::MAX),
            "write_zeroes",
        )?;
        if len > 0 && self.is_block && self.zero_offload.load(Ordering::Relaxed) {
            let range = [offset, len];
            // SAFETY: valid fd, pointer to a [u64; 2] as BLKZEROOUT expects.
            match unsafe { blk_zeroout(self.file.as_raw_fd(), &raw const range) }.map(drop) {
                Ok(()) => return Ok(()),
                Err(
                    e @ (nix::errno::Errno::EOPNOTSUPP
                    | nix::errno::Errno::EINVAL
                    | nix::errno::Errno::ENOTTY
                    | nix::errno::Errno::ENOSYS
                    | nix::errno::Errno::EPERM
                    | nix::errno::Errno::EACCES),
                ) => {
                    self.zero_offload.store(false, Ordering::Relaxed);
                    tracing::info!(
                        "{}: BLKZEROOUT refused ({e}); zeros are written instead",
                        self.path.display()
                    );
                }
                // A page of the range could not be dropped from the page cache: write.
                Err(nix::errno::Errno::EBUSY) => {}
                Err(e) => {
                    return Err(Error::io(
                        format!("zeroing {len} bytes at {offset} of {}", self.path.display()),
                        e.into(),
                    ))
                }
            }
        }
        super::write_zeroes_by_writing(self, offset, len)
    }

    fn offloads_zeroes(&self) -> bool {
        self.is_block && self.zero_offload.load(Ordering::Relaxed)
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_io(
            &self.geo,
            self.size.get(),
            offset,
            usize::try_from(len).unwrap_or(usize::MAX),
            "discard",
        )?;
        if self.is_block {
            let range = [offset, len];
            // SAFETY: valid fd, pointer to a [u64; 2] as BLKDISCARD expects.
            let r = unsafe { blk_discard(self.file.as_raw_fd(), &raw const range) };
            // Devices without discard support simply keep the data: discard is a hint.
            if let Err(e) = r {
                tracing::debug!("BLKDISCARD on {} failed: {e}", self.path.display());
            }
            Ok(())
        } else {
            let r = nix::fcntl::fallocate(
                &self.file,
                nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                    | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
                i64::try_from(offset).unwrap_or(i64::MAX),
                i64::try_from(len).unwrap_or(i64::MAX),
            );
            if let Err(e) = r {
                tracing::debug!("punch hole on {} failed: {e}", self.path.display());
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(name: &str) -> (FileDevice, PathBuf) {
        let p = std::env::temp_dir().join(format!("cetrafs-file-{name}-{}", std::process::id()));
        File::create(&p).unwrap().set_len(1 << 20).unwrap();
        let opts = FileDeviceOptions {
            // tmpfs has no O_DIRECT; the ring does not care.
            direct: false,
            ..FileDeviceOptions::default()
        };
        (FileDevice::open(&p, &opts).unwrap(), p)
    }

    fn pattern(seed: u8, len: usize) -> AlignedBuf {
        let v: Vec<u8> = (0..len)
            .map(|i| u8::try_from(i % 251).unwrap() ^ seed)
            .collect();
        AlignedBuf::from_slice(&v)
    }

    #[test]
    fn many_reads_and_writes_in_flight_land_like_one_at_a_time() {
        let (d, p) = device("many");
        // Aligned buffers (the ring) and a lot bigger than one ring's depth.
        let bufs: Vec<AlignedBuf> = (0..70u8).map(|i| pattern(i, 4096)).collect();
        let writes: Vec<(u64, &[u8])> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| (i as u64 * 8192, &b[..]))
            .collect();
        d.write_many(&writes).unwrap();
        let mut back: Vec<AlignedBuf> = (0..70).map(|_| AlignedBuf::new(4096)).collect();
        let mut reads: Vec<(u64, &mut [u8])> = back
            .iter_mut()
            .enumerate()
            .map(|(i, b)| (i as u64 * 8192, &mut b[..]))
            .collect();
        d.read_many(&mut reads).unwrap();
        for (i, b) in back.iter().enumerate() {
            assert_eq!(&b[..], &bufs[i][..], "block {i}");
            let mut one = AlignedBuf::new(4096);
            d.read_at(i as u64 * 8192 + 4096, &mut one).unwrap();
            assert!(one.iter().all(|&x| x == 0), "gap after block {i}");
        }
        // Not aligned (one byte into a buffer): one at a time, the same bytes.
        let mut raw = vec![0u8; 4097];
        let mut raw2 = vec![0u8; 513];
        let mut reads: Vec<(u64, &mut [u8])> = vec![(0, &mut raw[1..]), (8192, &mut raw2[1..])];
        d.read_many(&mut reads).unwrap();
        assert_eq!(&raw[1..], &bufs[0][..]);
        assert_eq!(&raw2[1..], &bufs[1][..512]);
        // Out of range: refused before anything is submitted.
        let mut tail = AlignedBuf::new(4096);
        let mut head = AlignedBuf::new(4096);
        let mut reads: Vec<(u64, &mut [u8])> = vec![(0, &mut head[..]), (1 << 20, &mut tail[..])];
        assert_eq!(
            d.read_many(&mut reads).unwrap_err().kind(),
            ErrorKind::Range
        );
        std::fs::remove_file(p).unwrap();
    }

    /// `write_zeroes` of a regular file (the zeros written), and the fallback called
    /// directly, leave zeros where data was and nothing else changed; a range past the end
    /// is refused. (`BLKZEROOUT` of a block device: lio-check, on a SCSI disk of LIO.)
    #[test]
    fn write_zeroes_zeroes_the_range_and_only_it() {
        let (d, p) = device("zeroes");
        let data = pattern(9, 1 << 20);
        for zero in [
            |d: &FileDevice, o, l| d.write_zeroes(o, l),
            |d: &FileDevice, o, l| crate::dev::write_zeroes_by_writing(d, o, l),
        ] {
            d.write_at(0, &data).unwrap();
            zero(&d, 3 * 4096, 70 * 4096).unwrap();
            zero(&d, 512 * 1024 + 512, 1024).unwrap();
            let mut back = AlignedBuf::new(1 << 20);
            d.read_at(0, &mut back).unwrap();
            for (i, (&b, &w)) in back.iter().zip(data.iter()).enumerate() {
                let zeroed = (3 * 4096..73 * 4096).contains(&i)
                    || (512 * 1024 + 512..512 * 1024 + 1536).contains(&i);
                assert_eq!(b, if zeroed { 0 } else { w }, "byte {i}");
            }
        }
        assert_eq!(
            d.write_zeroes((1 << 20) - 4096, 8192).unwrap_err().kind(),
            ErrorKind::Range
        );
        std::fs::remove_file(p).unwrap();
    }
}
