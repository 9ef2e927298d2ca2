//! Choosing the backend for a path: the one place `mkfs.cetra`, `mount.cetra` and `fsck.cetra`
//! turn a device name into a [`SharedDevice`].
//!
//! * A SCSI LUN — `/dev/sdX`, a whole-device dm-multipath map, `/dev/disk/by-id/…` links to
//!   either, or `/dev/sgN` — is driven through `SG_IO` ([`SgDevice`]): its COMPARE AND WRITE is
//!   executed by the target and therefore atomic across hosts ([`CawKind::Scsi`]). Before
//!   that, [`is_whole_lun`] must accept the path: SCSI commands carry absolute LUN addresses, so
//!   a partition, an LVM LV or any other device-mapper device is refused.
//! * Anything else (regular file, loop, virtio-blk, NVMe, nbd, …) is opened as a
//!   [`FileDevice`] whose COMPARE AND WRITE is emulated with host-local locks: such a volume is
//!   **single-host**.
//!
//! Data path of a SCSI LUN. [`SgDevice`] issues every READ/WRITE as one synchronous `SG_IO`
//! ioctl per chunk of at most the path's transfer limit: functionally fine, but it bypasses
//! the block layer, so on a dm-multipath map each command goes to whichever path dm picked
//! for the ioctl and is not retried on another path by dm-multipath, and the block layer's
//! request merging and queueing are lost. So for a *block* node (`/dev/sdX`, multipath map)
//! the data path (read, write, flush, discard) goes through a plain `O_DIRECT` descriptor of the
//! same node ([`FileDevice`]), and only COMPARE AND WRITE (heartbeats, locks, the probe) goes
//! through `SG_IO`; geometry and identity come from the SCSI side (READ CAPACITY(16), VPD 0x83).
//! Both descriptors address the same LUN, and callers wait for a write to complete before
//! they issue a COMPARE AND WRITE that depends on it, so no ordering is lost between them.
//! A `/dev/sgN` node has no block interface: everything goes through `SG_IO` there.

use super::file::{FileDevice, FileDeviceOptions};
use super::sg::{is_whole_lun, CawProbe, SgDevice, SgDeviceOptions, WholeLun};
use super::{AlignedBuf, BlockDevice, CawOutcome, Geometry, SharedDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::superblock::{SharingMode, Superblock};
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How [`open_lun`] opens a path.
#[derive(Debug, Clone, Default)]
pub struct LunOptions {
    pub read_only: bool,
    /// Logical block size of a regular file. `None`: the one its superblock (primary, or the
    /// backup in the last fs block) records, 512 when neither decodes. Ignored for devices,
    /// which report their own.
    pub file_logical_block_size: Option<u32>,
    /// A regular file on a filesystem without `O_DIRECT` (tmpfs) is opened buffered instead of
    /// failing. Callers that flush at every ordering point (mkfs, fsck) may allow this.
    pub buffered_file_fallback: bool,
    /// `SG_IO` options for SCSI LUNs (`read_only` is taken from above).
    pub sg: SgDeviceOptions,
}

/// Where the data I/O of a SCSI LUN goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPath {
    /// `O_DIRECT` on the block node; `SG_IO` only for COMPARE AND WRITE.
    BlockDirect,
    /// Everything through `SG_IO` (`/dev/sgN`).
    SgIo,
}

/// What [`open_lun`] found at the path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LunKind {
    /// A whole SCSI LUN driven through `SG_IO`: multi-node capable once
    /// [`Lun::check_sharing`] has verified COMPARE AND WRITE.
    Scsi {
        node: WholeLun,
        data: DataPath,
        vendor: String,
        product: String,
    },
    /// A regular file: single-host.
    File,
    /// A whole block device without SCSI (loop, virtio-blk, NVMe, nbd): single-host.
    Block { name: String },
}

impl LunKind {
    pub fn is_scsi(&self) -> bool {
        matches!(self, Self::Scsi { .. })
    }
}

impl fmt::Display for LunKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Scsi {
                node,
                data,
                vendor,
                product,
            } => {
                let what = match node {
                    WholeLun::ScsiDisk { name } => format!("SCSI disk {name}"),
                    WholeLun::ScsiGeneric { name } => format!("SCSI generic node {name}"),
                    WholeLun::Multipath { dm_name, paths, .. } => {
                        format!("multipath map {dm_name} ({} paths)", paths.len())
                    }
                    WholeLun::OtherDisk { name } => name.clone(),
                    WholeLun::RegularFile => "file".into(),
                };
                let data = match data {
                    DataPath::BlockDirect => "data O_DIRECT, COMPARE AND WRITE via SG_IO",
                    DataPath::SgIo => "all I/O via SG_IO",
                };
                write!(f, "{what}, {} {}; {data}", vendor.trim(), product.trim())
            }
            Self::File => f.write_str("regular file"),
            Self::Block { name } => write!(f, "non-SCSI block device {name}"),
        }
    }
}

/// How a volume on this LUN may be shared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sharing {
    /// COMPARE AND WRITE was executed by the target and behaved correctly.
    MultiNode { probe: CawProbe },
    /// Host-local COMPARE AND WRITE only; the reason says why.
    SingleHost { reason: String },
}

impl Sharing {
    /// What mkfs records in the superblock (format 4) for a volume made on this LUN.
    pub fn mode(&self) -> SharingMode {
        match self {
            Self::MultiNode { .. } => SharingMode::MultiNode,
            Self::SingleHost { .. } => SharingMode::SingleHost,
        }
    }
}

impl fmt::Display for Sharing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MultiNode { .. } => f.write_str("multi-node (SCSI COMPARE AND WRITE verified)"),
            Self::SingleHost { reason } => write!(f, "single-host ({reason})"),
        }
    }
}

/// An opened LUN.
#[derive(Debug, Clone)]
pub struct Lun {
    pub dev: SharedDevice,
    pub kind: LunKind,
    path: PathBuf,
    scsi: Option<Arc<SgDevice>>,
}

impl Lun {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `SG_IO` handle of a SCSI LUN.
    pub fn scsi(&self) -> Option<&SgDevice> {
        self.scsi.as_deref()
    }

    /// The `SG_IO` handle of a SCSI LUN, shared (persistent reservations keep it).
    pub fn scsi_arc(&self) -> Option<Arc<SgDevice>> {
        self.scsi.clone()
    }

    /// Decide how the volume may be shared. For a SCSI LUN this runs
    /// [`SgDevice::probe_caw`] on fs block `probe_fs_block` (the superblock's `probe_block`,
    /// reserved for this; its content is restored) and fails with `Unsupported` and a message
    /// that says multi-node use is refused when the LUN has no working COMPARE AND WRITE.
    /// There is deliberately no fallback to host-local locking for a SCSI LUN: another host
    /// could mount the same LUN and nothing would keep the two apart.
    pub fn check_sharing(&self, probe_fs_block: u64) -> Result<Sharing> {
        let Some(sg) = &self.scsi else {
            let reason = match &self.kind {
                LunKind::File => "regular file: COMPARE AND WRITE is emulated with locks of this host only".to_string(),
                LunKind::Block { name } => format!("{name} is not a SCSI LUN: COMPARE AND WRITE is emulated with locks of this host only"),
                LunKind::Scsi { .. } => "no SG_IO handle".to_string(),
            };
            return Ok(Sharing::SingleHost { reason });
        };
        let lbs = u64::from(sg.geometry().logical_block_size);
        let lba = probe_fs_block
            .checked_mul(FS_BLOCK)
            .map(|b| b / lbs)
            .ok_or_else(|| Error::new(ErrorKind::Range, "probe block out of range"))?;
        match sg.probe_caw(lba) {
            Ok(probe) => Ok(Sharing::MultiNode { probe }),
            Err(e) if e.kind() == ErrorKind::Unsupported => Err(Error::with_source(
                ErrorKind::Unsupported,
                format!(
                    "{}: refused for multi-node use: this LUN has no working SCSI COMPARE AND WRITE, which CetraFS needs for its heartbeats and locks (docs/san.md says what the array must support)",
                    self.path.display()
                ),
                e,
            )),
            Err(e) => Err(e.wrap(format!(
                "{}: COMPARE AND WRITE probe",
                self.path.display()
            ))),
        }
    }
}

/// Open a volume only to read it (fsck.cetra's check, `cetra status`): through the backend
/// the device needs, `SG_IO` for a whole SCSI LUN, `O_DIRECT` otherwise; a file on a
/// filesystem without `O_DIRECT` (tmpfs) is read buffered. No COMPARE AND WRITE probe.
pub fn open_for_reading(path: &Path) -> Result<SharedDevice> {
    let opts = LunOptions {
        read_only: true,
        buffered_file_fallback: true,
        ..LunOptions::default()
    };
    open_lun(path, &opts).map(|l| l.dev)
}

/// Open a volume to change it while no node has it mounted (fsck's replay and repairs,
/// `cetra tune`, the corruption injector): read-write, through the backend the device needs; a
/// regular file with the logical block size its superblock records (a file has none of its
/// own), read buffered where `O_DIRECT` is missing.
pub fn open_for_repair(path: &Path) -> Result<SharedDevice> {
    let lbs = open_for_reading(path)?.geometry().logical_block_size;
    let is_file = std::fs::metadata(path).is_ok_and(|m| m.is_file());
    let opts = LunOptions {
        read_only: false,
        file_logical_block_size: is_file.then_some(lbs),
        buffered_file_fallback: true,
        ..LunOptions::default()
    };
    open_lun(path, &opts).map(|l| l.dev)
}

/// Open `path` with the backend it needs; see the module docs.
pub fn open_lun(path: &Path, opts: &LunOptions) -> Result<Lun> {
    let node = is_whole_lun(path)?;
    match node {
        WholeLun::RegularFile => {
            let dev = open_file(path, opts)?;
            Ok(Lun {
                dev: Arc::new(dev),
                kind: LunKind::File,
                path: path.to_path_buf(),
                scsi: None,
            })
        }
        WholeLun::OtherDisk { name } => {
            let dev = FileDevice::open(path, &file_opts(opts, 512, true))?;
            Ok(Lun {
                dev: Arc::new(dev),
                kind: LunKind::Block { name },
                path: path.to_path_buf(),
                scsi: None,
            })
        }
        WholeLun::ScsiGeneric { .. } | WholeLun::ScsiDisk { .. } | WholeLun::Multipath { .. } => {
            let sg_opts = SgDeviceOptions {
                read_only: opts.read_only,
                ..opts.sg.clone()
            };
            let sg = Arc::new(SgDevice::open(path, &sg_opts).map_err(|e| {
                e.wrap(format!(
                    "{} is a SCSI LUN ({node:?}) but SG_IO on it failed",
                    path.display()
                ))
            })?);
            let inq = &sg.info().inquiry;
            let (vendor, product) = (inq.vendor.clone(), inq.product.clone());
            if matches!(node, WholeLun::ScsiGeneric { .. }) {
                let dev: SharedDevice = sg.clone();
                return Ok(Lun {
                    dev,
                    kind: LunKind::Scsi {
                        node,
                        data: DataPath::SgIo,
                        vendor,
                        product,
                    },
                    path: path.to_path_buf(),
                    scsi: Some(sg),
                });
            }
            let data = FileDevice::open(path, &file_opts(opts, 512, true))?;
            let dev = ScsiLun::new(path, sg.clone(), data)?;
            Ok(Lun {
                dev: Arc::new(dev),
                kind: LunKind::Scsi {
                    node,
                    data: DataPath::BlockDirect,
                    vendor,
                    product,
                },
                path: path.to_path_buf(),
                scsi: Some(sg),
            })
        }
    }
}

fn file_opts(opts: &LunOptions, lbs: u32, direct: bool) -> FileDeviceOptions {
    FileDeviceOptions {
        read_only: opts.read_only,
        file_logical_block_size: lbs,
        direct,
    }
}

/// A regular file: `O_DIRECT` (buffered if allowed and needed), logical block size as asked or
/// as the superblock records.
fn open_file(path: &Path, opts: &LunOptions) -> Result<FileDevice> {
    let first_lbs = opts.file_logical_block_size.unwrap_or(512);
    let mut direct = true;
    let dev = match FileDevice::open(path, &file_opts(opts, first_lbs, true)) {
        Err(e) if opts.buffered_file_fallback && e.kind() == ErrorKind::Unsupported => {
            direct = false;
            FileDevice::open(path, &file_opts(opts, first_lbs, false))?
        }
        r => r?,
    };
    if opts.file_logical_block_size.is_some() {
        return Ok(dev);
    }
    match superblock_lbs(&dev) {
        Some(lbs) if lbs != first_lbs => {
            drop(dev);
            FileDevice::open(path, &file_opts(opts, lbs, direct))
        }
        _ => Ok(dev),
    }
}

/// The logical block size the superblock (or its backup in the last fs block) records.
fn superblock_lbs(dev: &dyn BlockDevice) -> Option<u32> {
    let dev_blocks = dev.geometry().size_bytes / FS_BLOCK;
    Superblock::locate(dev_blocks, &mut |b| {
        let mut buf = AlignedBuf::new(FS_BLOCK_SIZE);
        dev.read_at(b * FS_BLOCK, &mut buf)?;
        Ok(buf.to_vec())
    })
    .ok()
    .map(|l| l.sb.logical_block_size)
}

/// A SCSI block node: data through `O_DIRECT`, COMPARE AND WRITE through `SG_IO` (module docs).
#[derive(Debug)]
struct ScsiLun {
    sg: Arc<SgDevice>,
    data: FileDevice,
    geo: Geometry,
}

impl ScsiLun {
    fn new(path: &Path, sg: Arc<SgDevice>, data: FileDevice) -> Result<Self> {
        let (s, d) = (sg.geometry(), data.geometry());
        if s.logical_block_size != d.logical_block_size {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{}: the LUN reports {}-byte logical blocks but the kernel's block device uses {}",
                    path.display(),
                    s.logical_block_size,
                    d.logical_block_size
                ),
            ));
        }
        let geo = Geometry {
            size_bytes: s.size_bytes.min(d.size_bytes),
            ..s.clone()
        };
        Ok(Self { sg, data, geo })
    }
}

impl BlockDevice for ScsiLun {
    fn geometry(&self) -> &Geometry {
        &self.geo
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.data.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.data.write_at(offset, buf)
    }
    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.data.read_many(reads)
    }
    fn write_many(&self, writes: &[(u64, &[u8])]) -> Result<()> {
        self.data.write_many(writes)
    }
    fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
        self.sg.compare_and_write(lba, expected, new)
    }
    /// fdatasync of the block node: the block layer sends SYNCHRONIZE CACHE when the LUN
    /// reports a volatile write cache (and a multipath map forwards it to a live path).
    fn flush(&self) -> Result<()> {
        self.data.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.data.discard(offset, len)
    }
    /// Through the kernel's block device: `BLKZEROOUT` sends WRITE SAME to the LUN.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.data.write_zeroes(offset, len)
    }
    fn offloads_zeroes(&self) -> bool {
        self.data.offloads_zeroes()
    }
    /// The smaller of what the target reports and what the kernel's block device (after a
    /// rescan) covers: data goes through the latter.
    fn refresh_size(&self) -> Result<u64> {
        Ok(self.sg.refresh_size()?.min(self.data.refresh_size()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::CawKind;

    fn tmp(name: &str, len: u64) -> PathBuf {
        let p = std::env::temp_dir().join(format!("cetrafs-open-{name}-{}", std::process::id()));
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(len).unwrap();
        p
    }

    fn opts() -> LunOptions {
        LunOptions {
            buffered_file_fallback: true,
            ..LunOptions::default()
        }
    }

    #[test]
    fn regular_file_is_single_host() {
        let p = tmp("single", 1 << 20);
        let lun = open_lun(&p, &opts()).unwrap();
        assert_eq!(lun.kind, LunKind::File);
        assert_eq!(lun.dev.geometry().caw, CawKind::HostLocal);
        assert_eq!(lun.dev.geometry().logical_block_size, 512);
        let s = lun.check_sharing(1).unwrap();
        assert!(matches!(s, Sharing::SingleHost { .. }));
        assert_eq!(s.mode(), SharingMode::SingleHost);
        assert!(
            s.to_string().starts_with("single-host (regular file"),
            "{s}"
        );
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn file_block_size_from_superblock() {
        let p = tmp("lbs", 64 << 20);
        let mut o = opts();
        o.file_logical_block_size = Some(4096);
        let lun = open_lun(&p, &o).unwrap();
        assert_eq!(lun.dev.geometry().logical_block_size, 4096);
        let mo = crate::mkfs::MkfsOptions {
            max_nodes: 2,
            journal_bytes: 1 << 20,
            ..crate::mkfs::MkfsOptions::default()
        };
        crate::mkfs::format(&*lun.dev, &mo, &mut |_, _| {}).unwrap();
        drop(lun);
        // Reopened without a size: the superblock's 4096 wins over the 512 default.
        let lun = open_lun(&p, &opts()).unwrap();
        assert_eq!(lun.dev.geometry().logical_block_size, 4096);
        // Asked explicitly, the caller's size wins (mkfs re-formatting with another size).
        let mut o = opts();
        o.file_logical_block_size = Some(512);
        assert_eq!(
            open_lun(&p, &o).unwrap().dev.geometry().logical_block_size,
            512
        );
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn missing_and_odd_paths_fail() {
        let e = open_lun(Path::new("/nonexistent/cetrafs-lun"), &opts()).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cetrafs-lun"), "{e}");
        // /dev/null is a character device but not a SCSI generic node.
        let e = open_lun(Path::new("/dev/null"), &opts()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    }
}
