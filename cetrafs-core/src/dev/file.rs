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
use std::sync::Mutex;

nix::ioctl_read!(blk_getsize64, 0x12, 114, u64);
nix::ioctl_read_bad!(blk_sszget, 0x1268, libc::c_int);
nix::ioctl_read_bad!(blk_pbszget, 0x127b, libc::c_uint);
nix::ioctl_write_ptr_bad!(blk_discard, 0x1277, [u64; 2]);

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
