//! A SCSI LUN driven through the `SG_IO` ioctl: `/dev/sdX`, `/dev/sgN`, or a whole-device
//! dm-multipath map (dm passes `SG_IO` to the current path when the map covers the whole LUN).
//!
//! This is the backend whose COMPARE AND WRITE is atomic across hosts ([`CawKind::Scsi`]): the
//! target executes compare-then-write as one command. Data goes through READ(16)/WRITE(16)
//! chunked by the path's transfer limit, durability through SYNCHRONIZE CACHE, discard
//! through UNMAP when the LUN is thin-provisioned. Buffers are handed to the kernel as they
//! are: sg copies through its own buffers and the block layer bounces misaligned user memory,
//! so unaligned callers cost a copy but never fail.
//!
//! Retry policy (and only here, the [`crate::scsi`] module stays pure): UNIT ATTENTION and
//! "becoming ready" are retried a few times (the target did not execute the command), BUSY /
//! TASK SET FULL with a short back-off, transport failures only for idempotent commands. A
//! COMPARE AND WRITE whose outcome is unknown (timeout, transport failure, aborted) is **never**
//! resent here: the error says so ([`crate::scsi::outcome_unknown`]) and the lock layer
//! decides by re-reading the block, since a blind resend can miscompare against our own write.

use super::{check_caw, check_io, AlignedBuf, BlockDevice, CawKind, CawOutcome, Geometry};
use crate::error::{Error, ErrorKind, Result};
use crate::scsi::cdb::{self, vpd_page};
use crate::scsi::pr::{self, InAction, OutAction, OutParams, PrType};
use crate::scsi::vpd::{self, BlockLimits, Capacity, Provisioning, StandardInquiry};
use crate::scsi::{
    classify, sgio, CommandKind, Completion, Direction, FailureKind, Outcome, ScsiFailure, SgIoHdr,
};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Bytes of sense buffer handed to the kernel (SPC-4 allows up to 252; 96 covers descriptor
/// sense with an information and a sense-key-specific descriptor).
const SENSE_LEN: usize = 96;

#[derive(Debug, Clone)]
pub struct SgDeviceOptions {
    pub read_only: bool,
    /// Timeout of READ/WRITE/SYNCHRONIZE CACHE/UNMAP/INQUIRY.
    pub data_timeout: Duration,
    /// Timeout of COMPARE AND WRITE: the lock layer's I/O deadline (`T_io`), much shorter than
    /// the data timeout so a stalled path is noticed before leases expire.
    pub io_timeout: Duration,
    /// Upper bound of one READ/WRITE command; further limited by the path's
    /// `queue/max_sectors_kb` and the target's MAXIMUM TRANSFER LENGTH.
    pub max_transfer_bytes: u32,
    /// How often a command that got UNIT ATTENTION (or "becoming ready") is resent.
    pub unit_attention_retries: u32,
    /// How often a command that got BUSY or TASK SET FULL is resent, with doubling back-off
    /// from 10 ms.
    pub busy_retries: u32,
}

impl Default for SgDeviceOptions {
    fn default() -> Self {
        Self {
            read_only: false,
            data_timeout: Duration::from_secs(30),
            io_timeout: Duration::from_secs(8),
            max_transfer_bytes: 1 << 20,
            unit_attention_retries: 5,
            busy_retries: 6,
        }
    }
}

/// What the LUN told us about itself at open.
#[derive(Debug, Clone)]
pub struct LunInfo {
    pub inquiry: StandardInquiry,
    pub capacity: Capacity,
    pub block_limits: Option<BlockLimits>,
    pub provisioning: Option<Provisioning>,
    /// Bytes per READ/WRITE command actually used.
    pub max_transfer_bytes: u32,
}

/// Data buffer of one raw command.
#[derive(Debug)]
pub enum DataBuf<'a> {
    None,
    /// Data-in: the device fills it.
    In(&'a mut [u8]),
    /// Data-out: the device reads it.
    Out(&'a [u8]),
}

impl DataBuf<'_> {
    fn raw(&mut self) -> (Direction, *mut u8, usize) {
        match self {
            DataBuf::None => (Direction::None, std::ptr::null_mut(), 0),
            DataBuf::In(b) => (Direction::FromDevice, b.as_mut_ptr(), b.len()),
            // The kernel only reads a TO_DEV buffer; the header type just has one pointer field.
            DataBuf::Out(b) => (Direction::ToDevice, b.as_ptr().cast_mut(), b.len()),
        }
    }
}

/// The raw result of one `SG_IO` call.
#[derive(Debug, Clone)]
pub struct CommandResult {
    pub completion: Completion,
    /// Bytes not transferred.
    pub resid: i32,
    /// Milliseconds the kernel measured.
    pub duration_ms: u32,
}

/// Successful end of a command after retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Done {
    Good { resid: i32 },
    Miscompare,
}

/// Counters for tests and diagnostics.
#[derive(Debug, Default)]
pub struct SgStats {
    pub unit_attention_retries: AtomicU64,
    pub busy_retries: AtomicU64,
    pub transport_retries: AtomicU64,
}

/// Result of [`SgDevice::probe_caw`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CawProbe {
    /// Byte 5 of the Block Limits VPD page, if the target has that page.
    pub vpd_max_compare_and_write: Option<u8>,
    /// Duration of the first (successful) COMPARE AND WRITE.
    pub latency: Duration,
}

#[derive(Debug)]
pub struct SgDevice {
    file: File,
    path: PathBuf,
    opts: SgDeviceOptions,
    geo: Geometry,
    size: super::LiveSize,
    info: LunInfo,
    unmap_supported: AtomicBool,
    sync16_supported: AtomicBool,
    stats: SgStats,
}

fn ms(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)
}

impl SgDevice {
    /// READ CAPACITY(16): the LUN's size and block sizes as the target reports them now.
    fn read_capacity(&self) -> Result<Capacity> {
        let p = self.path.display();
        let mut rc = vec![0u8; cdb::READ_CAPACITY_16_LEN as usize];
        self.submit(
            CommandKind::Query,
            &cdb::read_capacity16(),
            DataBuf::In(&mut rc),
            self.opts.data_timeout,
        )
        .map_err(|f| f.into_error(format!("READ CAPACITY(16) on {p}")))?;
        Capacity::parse(&rc).ok_or_else(|| {
            Error::new(
                ErrorKind::Io,
                format!("READ CAPACITY(16) on {p} returned unusable data"),
            )
        })
    }

    /// Open a SCSI LUN. Fails with `Unsupported` (and the ioctl's errno as source, ENOTTY or
    /// EINVAL) when `path` does not accept `SG_IO`, so callers can fall back to
    /// [`super::file::FileDevice`].
    pub fn open(path: &Path, opts: &SgDeviceOptions) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(!opts.read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| Error::io(format!("cannot open {}", path.display()), e))?;
        let placeholder = Geometry {
            logical_block_size: 512,
            physical_block_size: 512,
            size_bytes: 0,
            identity: String::new(),
            caw: CawKind::Scsi,
        };
        let mut dev = Self {
            file,
            path: path.to_path_buf(),
            opts: opts.clone(),
            geo: placeholder,
            size: super::LiveSize::new(0),
            info: LunInfo {
                inquiry: StandardInquiry {
                    qualifier: 0,
                    device_type: 0,
                    vendor: String::new(),
                    product: String::new(),
                    revision: String::new(),
                },
                capacity: Capacity {
                    blocks: 0,
                    logical_block_size: 512,
                    physical_exponent: 0,
                    lbpme: false,
                    lbprz: false,
                    lowest_aligned_lba: 0,
                    protection_enabled: false,
                },
                block_limits: None,
                provisioning: None,
                max_transfer_bytes: 0,
            },
            unmap_supported: AtomicBool::new(true),
            sync16_supported: AtomicBool::new(true),
            stats: SgStats::default(),
        };
        dev.identify()?;
        Ok(dev)
    }

    fn identify(&mut self) -> Result<()> {
        let p = self.path.display().to_string();
        // TEST UNIT READY first: it also soaks up the UNIT ATTENTION (power on / reset) a
        // freshly attached LUN reports once per initiator.
        if let Err(f) = self.submit(
            CommandKind::Query,
            &cdb::test_unit_ready(),
            DataBuf::None,
            self.opts.data_timeout,
        ) {
            if let Some(errno @ (libc::ENOTTY | libc::EINVAL)) = f.errno {
                return Err(Error::with_source(
                    ErrorKind::Unsupported,
                    format!(
                        "{p} is not a SCSI device (SG_IO refused); use it through the file backend"
                    ),
                    std::io::Error::from_raw_os_error(errno),
                ));
            }
            return Err(f.into_error(format!("TEST UNIT READY on {p}")));
        }

        let mut inq = vec![0u8; 96];
        let done = self
            .submit(
                CommandKind::Query,
                &cdb::inquiry(96),
                DataBuf::In(&mut inq),
                self.opts.data_timeout,
            )
            .map_err(|f| f.into_error(format!("INQUIRY on {p}")))?;
        inq.truncate(received(96, done));
        let inquiry = StandardInquiry::parse(&inq)
            .ok_or_else(|| Error::new(ErrorKind::Io, format!("INQUIRY on {p} returned no data")))?;
        if inquiry.qualifier != 0 || inquiry.device_type != 0 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{p} ({} {}) is SCSI peripheral type 0x{:02x} qualifier {}, not a connected block device (disk)",
                    inquiry.vendor, inquiry.product, inquiry.device_type, inquiry.qualifier
                ),
            ));
        }

        let capacity = self.read_capacity()?;
        let lbs = capacity.logical_block_size;
        if lbs != 512 && lbs != 4096 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("{p}: logical block size {lbs} is not supported (512 or 4096)"),
            ));
        }
        let size_bytes = capacity.blocks.checked_mul(u64::from(lbs)).ok_or_else(|| {
            Error::new(
                ErrorKind::Unsupported,
                format!("{p}: capacity of {} blocks overflows", capacity.blocks),
            )
        })?;

        let supported = self
            .vpd(vpd_page::SUPPORTED_PAGES)?
            .and_then(|d| vpd::vpd_payload(&d, 0).map(<[u8]>::to_vec));
        let has = |page: u8| supported.as_ref().is_none_or(|s| s.contains(&page));
        let page = |dev: &Self, code: u8| if has(code) { dev.vpd(code) } else { Ok(None) };
        let block_limits = page(self, vpd_page::BLOCK_LIMITS)?.and_then(|d| BlockLimits::parse(&d));
        let provisioning =
            page(self, vpd_page::LOGICAL_BLOCK_PROVISIONING)?.and_then(|d| Provisioning::parse(&d));
        let mut identity =
            page(self, vpd_page::DEVICE_IDENTIFICATION)?.and_then(|d| vpd::lun_identity(&d));
        if identity.is_none() {
            // No usable designator: vendor + product + unit serial is still path-independent.
            if let Some(serial) = page(self, vpd_page::UNIT_SERIAL)?
                .and_then(|d| {
                    vpd::vpd_payload(&d, vpd_page::UNIT_SERIAL)
                        .map(|s| String::from_utf8_lossy(s).trim().to_string())
                })
                .filter(|s| !s.is_empty())
            {
                identity = Some(
                    format!("serial.{}_{}_{}", inquiry.vendor, inquiry.product, serial)
                        .replace(' ', "_"),
                );
            }
        }
        let identity = identity.ok_or_else(|| {
            Error::new(
                ErrorKind::Unsupported,
                format!("{p} ({} {}) reports no device identifier (VPD 0x83/0x80); cannot tell its paths apart from other LUNs", inquiry.vendor, inquiry.product),
            )
        })?;

        let mut max = u64::from(self.opts.max_transfer_bytes);
        if let Some(kb) = sysfs_max_sectors_kb(&self.file) {
            max = max.min(kb.saturating_mul(1024));
        }
        if let Some(n) = block_limits
            .as_ref()
            .and_then(|b| b.max_transfer_length)
            .filter(|&n| n > 0)
        {
            max = max.min(u64::from(n).saturating_mul(u64::from(lbs)));
        }
        let max = (max - max % u64::from(lbs)).max(u64::from(lbs));
        let max_transfer_bytes = u32::try_from(max).unwrap_or(u32::MAX - (u32::MAX % lbs));

        self.size = super::LiveSize::new(size_bytes);
        self.geo = Geometry {
            logical_block_size: lbs,
            physical_block_size: capacity.physical_block_size().unwrap_or(lbs).max(lbs),
            size_bytes,
            identity,
            caw: CawKind::Scsi,
        };
        self.info = LunInfo {
            inquiry,
            capacity,
            block_limits,
            provisioning,
            max_transfer_bytes,
        };
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn info(&self) -> &LunInfo {
        &self.info
    }

    pub fn stats(&self) -> &SgStats {
        &self.stats
    }

    /// One `SG_IO` call, no retries, no classification: for diagnostics and conformance tests.
    /// `Err` only when the ioctl itself failed.
    pub fn execute(
        &self,
        cdb: &[u8],
        data: DataBuf<'_>,
        timeout: Duration,
    ) -> Result<CommandResult> {
        self.execute_raw(CommandKind::Query, cdb, data, timeout)
            .map_err(|f| f.into_error(format!("SG_IO on {}", self.path.display())))
    }

    fn execute_raw(
        &self,
        cmd: CommandKind,
        cdb: &[u8],
        mut data: DataBuf<'_>,
        timeout: Duration,
    ) -> std::result::Result<CommandResult, ScsiFailure> {
        let (dir, ptr, len) = data.raw();
        let len = u32::try_from(len).map_err(|_| {
            ScsiFailure::new(
                FailureKind::InvalidRequest,
                cmd,
                false,
                None,
                format!("transfer of {len} bytes is too large"),
            )
        })?;
        let mut sense = [0u8; SENSE_LEN];
        let mut hdr = SgIoHdr::new(cdb, dir, ptr, len, &mut sense, ms(timeout));
        // SAFETY: the header points at `cdb`, at `data` (valid for `len` bytes, writable when the
        // direction is FROM_DEV because it came from a `&mut [u8]`) and at `sense`; all three
        // outlive this synchronous ioctl, which returns only when the command has completed.
        let r = unsafe { sgio::sg_io(self.file.as_raw_fd(), &raw mut hdr) };
        if let Err(errno) = r {
            return Err(ScsiFailure::from_errno(cmd, errno as i32));
        }
        let sb_len = usize::from(hdr.sb_len_wr).min(SENSE_LEN);
        Ok(CommandResult {
            completion: Completion {
                status: hdr.status,
                host_status: hdr.host_status,
                driver_status: hdr.driver_status,
                sense: sense[..sb_len].to_vec(),
            },
            resid: hdr.resid,
            duration_ms: hdr.duration,
        })
    }

    /// Send a command, applying the retry policy described in the module docs.
    fn submit(
        &self,
        cmd: CommandKind,
        cdb: &[u8],
        mut data: DataBuf<'_>,
        timeout: Duration,
    ) -> std::result::Result<Done, ScsiFailure> {
        let (mut ua, mut busy, mut transport) = (0u32, 0u32, 0u32);
        loop {
            let reborrow = match &mut data {
                DataBuf::None => DataBuf::None,
                DataBuf::In(b) => DataBuf::In(b),
                DataBuf::Out(b) => DataBuf::Out(b),
            };
            let (outcome, resid) = match self.execute_raw(cmd, cdb, reborrow, timeout) {
                Ok(r) => (classify(cmd, &r.completion), r.resid),
                Err(f) => (Outcome::Failed(f), 0),
            };
            match outcome {
                Outcome::Good => return Ok(Done::Good { resid }),
                Outcome::Miscompare { .. } => return Ok(Done::Miscompare),
                Outcome::Retry { reason } => {
                    if ua >= self.opts.unit_attention_retries {
                        return Err(ScsiFailure::new(
                            FailureKind::UnitAttention,
                            cmd,
                            false,
                            None,
                            format!(
                                "{}: still not accepted after {ua} retries ({reason})",
                                cmd.name()
                            ),
                        ));
                    }
                    ua += 1;
                    self.stats
                        .unit_attention_retries
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        "{} on {}: retrying after {reason}",
                        cmd.name(),
                        self.path.display()
                    );
                }
                Outcome::Failed(f)
                    if f.kind == FailureKind::Busy && busy < self.opts.busy_retries =>
                {
                    self.stats.busy_retries.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(10u64 << busy.min(6)));
                    busy += 1;
                }
                // Transport trouble on an idempotent command: resending is harmless and gives
                // dm-multipath the chance to move to another path. Never for CAW (see docs),
                // nor PERSISTENT RESERVE OUT (a resent PREEMPT conflicts with its own success).
                Outcome::Failed(f)
                    if !matches!(
                        cmd,
                        CommandKind::CompareAndWrite | CommandKind::PersistentReserveOut
                    ) && matches!(f.kind, FailureKind::Transport | FailureKind::Aborted)
                        && transport < 2 =>
                {
                    transport += 1;
                    self.stats.transport_retries.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("{} on {}: {f}; retrying", cmd.name(), self.path.display());
                }
                Outcome::Failed(f) => return Err(f),
            }
        }
    }

    /// Fetch a VPD page; `None` when the target rejects the page.
    pub fn vpd(&self, page: u8) -> Result<Option<Vec<u8>>> {
        let mut alloc: usize = 256;
        loop {
            let mut buf = vec![0u8; alloc];
            let alloc16 = u16::try_from(alloc).unwrap_or(u16::MAX);
            match self.submit(
                CommandKind::Query,
                &cdb::inquiry_vpd(page, alloc16),
                DataBuf::In(&mut buf),
                self.opts.data_timeout,
            ) {
                Ok(done) => {
                    buf.truncate(received(alloc, done));
                    match vpd::vpd_claimed_len(&buf) {
                        Some(claimed) if claimed > alloc && alloc < usize::from(u16::MAX) => {
                            alloc = claimed.min(usize::from(u16::MAX));
                        }
                        Some(_) => return Ok(Some(buf)),
                        None => return Ok(None),
                    }
                }
                Err(f)
                    if matches!(
                        f.kind,
                        FailureKind::InvalidRequest | FailureKind::NotSupported
                    ) =>
                {
                    return Ok(None)
                }
                Err(f) => {
                    return Err(f.into_error(format!(
                        "INQUIRY VPD page 0x{page:02x} on {}",
                        self.path.display()
                    )))
                }
            }
        }
    }

    fn rw_context(&self, cmd: CommandKind, lba: u64, blocks: u32) -> String {
        format!(
            "{} of {blocks} blocks at LBA {lba} on {}",
            cmd.name(),
            self.path.display()
        )
    }

    fn check_writable(&self, what: &str) -> Result<()> {
        if self.opts.read_only {
            return Err(Error::new(
                ErrorKind::ReadOnly,
                format!("{what} on {}: opened read-only", self.path.display()),
            ));
        }
        Ok(())
    }

    /// Checks that the LUN executes COMPARE AND WRITE correctly, on a block reserved for it
    /// (its content is restored unless another node changes it meanwhile):
    /// CAW(current → current with a random nonce) must write, a CAW with the now stale verify
    /// image must miscompare and change nothing, and a CAW back must restore the block.
    /// Rejection by the target gives `Unsupported` "LUN ... does not support COMPARE AND
    /// WRITE (...)", whatever VPD 0xB0 advertises (targets exist that advertise it and reject it).
    pub fn probe_caw(&self, scratch_lba: u64) -> Result<CawProbe> {
        /// Whole-probe attempts when other nodes probe the same block (the retry loop below).
        const ATTEMPTS: u32 = 6;
        self.check_writable("COMPARE AND WRITE probe")?;
        let lbs = self.geo.logical_block_size as usize;
        let vpd_max = self
            .info
            .block_limits
            .as_ref()
            .and_then(|b| b.max_compare_and_write_len);
        let vpd_txt = vpd_max.map_or("no Block Limits VPD page".to_string(), |n| {
            format!("VPD 0xB0 maximum compare and write length {n}")
        });
        let who = format!("LUN {} ({})", self.path.display(), self.geo.identity);
        let unsupported = |f: ScsiFailure| -> Error {
            Error::with_source(
                ErrorKind::Unsupported,
                format!("{who} does not support COMPARE AND WRITE ({vpd_txt}; CetraFS needs it for its cluster locks; on LIO set attrib/emulate_caw=1)"),
                f,
            )
        };
        let broken = |what: &str| -> Error {
            Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{who} executes COMPARE AND WRITE incorrectly: {what}; CetraFS cannot use it for cluster locks"
                ),
            )
        };
        let off = scratch_lba.checked_mul(lbs as u64).ok_or_else(|| {
            Error::new(
                ErrorKind::Range,
                format!("scratch LBA {scratch_lba} out of range"),
            )
        })?;
        // Several nodes mounting at once probe the same block: an image that is neither ours
        // nor our garbage image is another prober's, and the whole probe is retried after a
        // random pause. A target that is really broken fails every attempt the same way.
        let mut last = String::new();
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                std::thread::sleep(Duration::from_millis(20 + rand::random::<u64>() % 180));
            }
            match self.probe_caw_once(scratch_lba, off, &who, &unsupported, &broken)? {
                Ok(latency) => {
                    return Ok(CawProbe {
                        vpd_max_compare_and_write: vpd_max,
                        latency,
                    })
                }
                Err(what) => {
                    tracing::info!("{who}: COMPARE AND WRITE probe disturbed ({what}); retrying");
                    last = what;
                }
            }
        }
        Err(broken(&format!(
            "{last}, on each of {ATTEMPTS} attempts (if other nodes were mounting at the same moment, retry)"
        )))
    }

    /// One probe round. Ok(Err(what)): the block changed in a way another prober explains.
    fn probe_caw_once(
        &self,
        scratch_lba: u64,
        off: u64,
        who: &str,
        unsupported: &dyn Fn(ScsiFailure) -> Error,
        broken: &dyn Fn(&str) -> Error,
    ) -> Result<std::result::Result<Duration, String>> {
        let lbs = self.geo.logical_block_size as usize;
        let mut orig = AlignedBuf::new(lbs);
        let mut marked = AlignedBuf::new(lbs);
        let mut check = AlignedBuf::new(lbs);
        let mut attempts = 0;
        let latency = loop {
            self.read_at(off, &mut orig)?;
            marked.copy_from_slice(&orig);
            loop {
                let nonce: [u8; 16] = rand::random();
                for (m, n) in marked[..16].iter_mut().zip(nonce) {
                    *m ^= n;
                }
                if marked[..] != orig[..] {
                    break;
                }
            }
            let t0 = Instant::now();
            match self.caw_once(scratch_lba, &orig, &marked) {
                Ok(CawOutcome::Written) => break t0.elapsed(),
                // Another node touched the scratch block between our read and CAW: read again.
                Ok(CawOutcome::Miscompare) if attempts < 3 => attempts += 1,
                Ok(CawOutcome::Miscompare) => {
                    return Ok(Err(format!(
                        "kept miscomparing on scratch LBA {scratch_lba}"
                    )))
                }
                Err(Ok(f)) if f.kind == FailureKind::NotSupported => return Err(unsupported(f)),
                Err(Ok(f)) => {
                    return Err(f.into_error(format!(
                        "{who}: COMPARE AND WRITE probe at LBA {scratch_lba}"
                    )))
                }
                Err(Err(e)) => return Err(e),
            }
        };
        self.read_at(off, &mut check)?;
        if check[..] != marked[..] {
            return Ok(Err(
                "reported GOOD but the block does not hold the written image".to_string(),
            ));
        }
        // The verify image `orig` is stale now: this must miscompare and write nothing.
        let mut garbage = AlignedBuf::new(lbs);
        garbage.fill(0xA5);
        match self.caw_once(scratch_lba, &orig, &garbage) {
            Ok(CawOutcome::Miscompare) => {}
            Ok(CawOutcome::Written) => {
                // Put the block back before failing; best effort.
                let _ = self.caw_once(scratch_lba, &garbage, &orig);
                return Err(broken("wrote although the verify image did not match"));
            }
            Err(Ok(f)) => {
                return Err(f.into_error(format!(
                    "{who}: COMPARE AND WRITE probe (miscompare) at LBA {scratch_lba}"
                )))
            }
            Err(Err(e)) => return Err(e),
        }
        self.read_at(off, &mut check)?;
        if check[..] == garbage[..] {
            return Err(broken("a miscompare wrote the new image"));
        }
        if check[..] != marked[..] {
            return Ok(Err("a miscompare changed the block".to_string()));
        }
        match self.caw_once(scratch_lba, &marked, &orig) {
            Ok(CawOutcome::Written) => {}
            Ok(CawOutcome::Miscompare) => {
                tracing::warn!("{who}: scratch LBA {scratch_lba} changed during the CAW probe");
            }
            Err(Ok(f)) => {
                return Err(f.into_error(format!(
                    "{who}: COMPARE AND WRITE probe (restore) at LBA {scratch_lba}"
                )))
            }
            Err(Err(e)) => return Err(e),
        }
        Ok(Ok(latency))
    }

    /// COMPARE AND WRITE keeping the SCSI failure unwrapped for the probe's messages.
    fn caw_once(
        &self,
        lba: u64,
        expected: &[u8],
        new: &[u8],
    ) -> std::result::Result<CawOutcome, std::result::Result<ScsiFailure, Error>> {
        check_caw(&self.geo, self.size.get(), lba, expected, new).map_err(Err)?;
        let lbs = expected.len();
        let mut data = AlignedBuf::new(2 * lbs);
        cdb::compare_and_write_data(expected, new, &mut data);
        match self.submit(
            CommandKind::CompareAndWrite,
            &cdb::compare_and_write(lba, 1),
            DataBuf::Out(&data),
            self.opts.io_timeout,
        ) {
            Ok(Done::Good { .. }) => Ok(CawOutcome::Written),
            Ok(Done::Miscompare) => Ok(CawOutcome::Miscompare),
            Err(f) => Err(Ok(f)),
        }
    }
}

/// SCSI-3 persistent reservations on this I_T nexus (SPC-4; see [`crate::scsi::pr`]). Each
/// method is one PERSISTENT RESERVE IN/OUT command, retried only where the target did not
/// execute it (UNIT ATTENTION, BUSY): a PR OUT whose outcome is unknown is never resent. A
/// target without persistent reservations fails with `Unsupported`; a refused PR OUT (wrong
/// key, unregistered path) with `Io` and [`crate::scsi::reservation_conflict`] true.
/// Registrations are per path: a host registers its key on every path of a multipath map.
/// Nothing in mount or recovery calls these yet.
impl SgDevice {
    fn pr_in(&self, action: InAction, what: &str) -> Result<Vec<u8>> {
        let mut alloc: usize = match action {
            InAction::ReportCapabilities => usize::from(pr::REPORT_CAPABILITIES_LEN),
            _ => 8 + 8 * 32,
        };
        loop {
            let mut buf = vec![0u8; alloc];
            let alloc16 = u16::try_from(alloc).unwrap_or(u16::MAX);
            let done = self
                .submit(
                    CommandKind::PersistentReserveIn,
                    &pr::pr_in(action, alloc16),
                    DataBuf::In(&mut buf),
                    self.opts.data_timeout,
                )
                .map_err(|f| self.pr_error(f, what))?;
            buf.truncate(received(alloc, done));
            if action == InAction::ReportCapabilities {
                return Ok(buf);
            }
            match pr::pr_in_claimed_len(&buf) {
                Some(claimed) if claimed > alloc && alloc < usize::from(u16::MAX) => {
                    alloc = claimed.min(usize::from(u16::MAX));
                }
                _ => return Ok(buf),
            }
        }
    }

    fn pr_error(&self, f: ScsiFailure, what: &str) -> Error {
        let ctx = format!("{what} on {}", self.path.display());
        if f.kind == FailureKind::NotSupported {
            return Error::with_source(
                ErrorKind::Unsupported,
                format!("{ctx}: the LUN does not support SCSI-3 persistent reservations"),
                f,
            );
        }
        f.into_error(ctx)
    }

    fn pr_out(&self, action: OutAction, ty: Option<PrType>, params: &OutParams) -> Result<()> {
        let list = params.encode();
        let what = match ty.filter(|_| action.uses_type()) {
            Some(t) => format!("PERSISTENT RESERVE OUT {} ({t})", action.name()),
            None => format!("PERSISTENT RESERVE OUT {}", action.name()),
        };
        self.submit(
            CommandKind::PersistentReserveOut,
            &pr::pr_out(action, ty),
            DataBuf::Out(&list),
            self.opts.data_timeout,
        )
        .map(|_| ())
        .map_err(|f| self.pr_error(f, &what))
    }

    /// A PR IN reply parsed by `parse`; `unusable` says what is wrong with a reply it refuses.
    fn pr_in_parsed<T>(
        &self,
        action: InAction,
        what: &str,
        unusable: &str,
        parse: fn(&[u8]) -> Option<T>,
    ) -> Result<T> {
        let d = self.pr_in(action, what)?;
        parse(&d).ok_or_else(|| {
            Error::new(
                ErrorKind::Io,
                format!(
                    "{what} on {}: {unusable} ({} bytes)",
                    self.path.display(),
                    d.len()
                ),
            )
        })
    }

    /// REPORT CAPABILITIES: which reservation types and options the LUN supports.
    pub fn pr_capabilities(&self) -> Result<pr::Capabilities> {
        self.pr_in_parsed(
            InAction::ReportCapabilities,
            "PERSISTENT RESERVE IN REPORT CAPABILITIES",
            "unusable reply",
            pr::Capabilities::parse,
        )
    }

    /// READ KEYS: the PR generation and every registered key (one entry per registered path).
    pub fn pr_read_keys(&self) -> Result<pr::Keys> {
        self.pr_in_parsed(
            InAction::ReadKeys,
            "PERSISTENT RESERVE IN READ KEYS",
            "reply shorter than its header",
            pr::Keys::parse,
        )
    }

    /// READ RESERVATION: the holder's key and the type, if the LUN is reserved.
    pub fn pr_read_reservation(&self) -> Result<pr::Reservation> {
        self.pr_in_parsed(
            InAction::ReadReservation,
            "PERSISTENT RESERVE IN READ RESERVATION",
            "unusable reply",
            pr::Reservation::parse,
        )
    }

    /// REGISTER: replace this path's key `old_key` (0 when unregistered) by `new_key`
    /// (0 unregisters). RESERVATION CONFLICT when `old_key` is not this path's key.
    pub fn pr_register(&self, old_key: u64, new_key: u64, aptpl: bool) -> Result<()> {
        self.pr_out(
            OutAction::Register,
            None,
            &OutParams {
                key: old_key,
                service_action_key: new_key,
                aptpl,
                ..OutParams::default()
            },
        )
    }

    /// REGISTER AND IGNORE EXISTING KEY: register `new_key` on this path whatever it had
    /// (0 unregisters). What a node does at mount on each path.
    pub fn pr_register_and_ignore(&self, new_key: u64, aptpl: bool) -> Result<()> {
        self.pr_out(
            OutAction::RegisterAndIgnoreExistingKey,
            None,
            &OutParams {
                service_action_key: new_key,
                aptpl,
                ..OutParams::default()
            },
        )
    }

    /// RESERVE with type `ty`; this path must be registered with `key`. Reserving again with
    /// the same key and type is GOOD; any other reservation present is a RESERVATION CONFLICT.
    pub fn pr_reserve(&self, key: u64, ty: PrType) -> Result<()> {
        self.pr_out(
            OutAction::Reserve,
            Some(ty),
            &OutParams {
                key,
                ..OutParams::default()
            },
        )
    }

    /// RELEASE the reservation of type `ty` this path holds with `key`.
    pub fn pr_release(&self, key: u64, ty: PrType) -> Result<()> {
        self.pr_out(
            OutAction::Release,
            Some(ty),
            &OutParams {
                key,
                ..OutParams::default()
            },
        )
    }

    /// CLEAR: drop the reservation and every registration of every path (this path must be
    /// registered with `key`).
    pub fn pr_clear(&self, key: u64) -> Result<()> {
        self.pr_out(
            OutAction::Clear,
            None,
            &OutParams {
                key,
                ..OutParams::default()
            },
        )
    }

    /// PREEMPT: remove every registration of `victim_key` (taking the reservation, with type
    /// `ty`, if the victim held it); this path must be registered with `my_key`.
    pub fn pr_preempt(&self, my_key: u64, victim_key: u64, ty: PrType) -> Result<()> {
        self.pr_out(
            OutAction::Preempt,
            Some(ty),
            &OutParams {
                key: my_key,
                service_action_key: victim_key,
                ..OutParams::default()
            },
        )
    }

    /// PREEMPT AND ABORT: [`Self::pr_preempt`], and the target aborts every command the
    /// victim's paths still have queued: after GOOD, no write of the victim lands any more.
    pub fn pr_preempt_and_abort(&self, my_key: u64, victim_key: u64, ty: PrType) -> Result<()> {
        self.pr_out(
            OutAction::PreemptAndAbort,
            Some(ty),
            &OutParams {
                key: my_key,
                service_action_key: victim_key,
                ..OutParams::default()
            },
        )
    }
}

/// Bytes a data-in command actually delivered.
fn received(alloc: usize, done: Done) -> usize {
    match done {
        Done::Good { resid } => alloc.saturating_sub(usize::try_from(resid).unwrap_or(0)),
        Done::Miscompare => 0,
    }
}

impl BlockDevice for SgDevice {
    fn geometry(&self) -> &Geometry {
        &self.geo
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        check_io(&self.geo, self.size.get(), offset, buf.len(), "read")?;
        let lbs = self.geo.lbs();
        let chunk = self.info.max_transfer_bytes as usize;
        let mut lba = offset / lbs;
        for piece in buf.chunks_mut(chunk) {
            let len = piece.len();
            // chunk <= max_transfer_bytes (a u32), so the block count fits
            let blocks = u32::try_from(len as u64 / lbs).unwrap_or(u32::MAX);
            let ctx = || self.rw_context(CommandKind::Read, lba, blocks);
            let done = self
                .submit(
                    CommandKind::Read,
                    &cdb::read16(lba, blocks),
                    DataBuf::In(piece),
                    self.opts.data_timeout,
                )
                .map_err(|f| f.into_error(ctx()))?;
            if received(len, done) != len {
                return Err(Error::new(
                    ErrorKind::Io,
                    format!(
                        "{}: short transfer ({} of {len} bytes)",
                        ctx(),
                        received(len, done)
                    ),
                ));
            }
            lba += u64::from(blocks);
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        check_io(&self.geo, self.size.get(), offset, buf.len(), "write")?;
        self.check_writable("write")?;
        let lbs = self.geo.lbs();
        let chunk = self.info.max_transfer_bytes as usize;
        let mut lba = offset / lbs;
        for piece in buf.chunks(chunk) {
            let blocks = u32::try_from(piece.len() as u64 / lbs).unwrap_or(u32::MAX);
            let done = self
                .submit(
                    CommandKind::Write,
                    &cdb::write16(lba, blocks, false),
                    DataBuf::Out(piece),
                    self.opts.data_timeout,
                )
                .map_err(|f| f.into_error(self.rw_context(CommandKind::Write, lba, blocks)))?;
            if let Done::Good { resid } = done {
                if resid != 0 {
                    return Err(Error::new(
                        ErrorKind::Io,
                        format!(
                            "{}: target left {resid} bytes untransferred",
                            self.rw_context(CommandKind::Write, lba, blocks)
                        ),
                    ));
                }
            }
            lba += u64::from(blocks);
        }
        Ok(())
    }

    fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
        check_caw(&self.geo, self.size.get(), lba, expected, new)?;
        self.check_writable("COMPARE AND WRITE")?;
        self.caw_once(lba, expected, new).map_err(|e| match e {
            Ok(f) => f.into_error(format!(
                "COMPARE AND WRITE of LBA {lba} on {}",
                self.path.display()
            )),
            Err(e) => e,
        })
    }

    fn flush(&self) -> Result<()> {
        let p = || format!("SYNCHRONIZE CACHE on {}", self.path.display());
        if self.sync16_supported.load(Ordering::Relaxed) {
            match self.submit(
                CommandKind::SynchronizeCache,
                &cdb::synchronize_cache16(),
                DataBuf::None,
                self.opts.data_timeout,
            ) {
                Ok(_) => return Ok(()),
                Err(f)
                    if matches!(
                        f.kind,
                        FailureKind::NotSupported | FailureKind::InvalidRequest
                    ) =>
                {
                    self.sync16_supported.store(false, Ordering::Relaxed);
                }
                Err(f) => return Err(f.into_error(p())),
            }
        }
        match self.submit(
            CommandKind::SynchronizeCache,
            &cdb::synchronize_cache10(),
            DataBuf::None,
            self.opts.data_timeout,
        ) {
            Ok(_) => Ok(()),
            // A target without SYNCHRONIZE CACHE has no volatile write cache to flush.
            Err(f) if f.kind == FailureKind::NotSupported => {
                tracing::debug!("{}: {f}; assuming no volatile cache", p());
                Ok(())
            }
            Err(f) => Err(f.into_error(p())),
        }
    }

    /// READ CAPACITY(16) again (a target reports a grown LUN at once; the first command after
    /// the change may return CAPACITY DATA HAS CHANGED, which `submit` retries).
    fn refresh_size(&self) -> Result<u64> {
        let c = self.read_capacity()?;
        if c.logical_block_size != self.geo.logical_block_size {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{}: the logical block size changed from {} to {}",
                    self.path.display(),
                    self.geo.logical_block_size,
                    c.logical_block_size
                ),
            ));
        }
        let now = c.blocks.saturating_mul(u64::from(c.logical_block_size));
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
        self.check_writable("discard")?;
        let thin = self.info.provisioning.is_some_and(|p| p.unmap) || self.info.capacity.lbpme;
        let max_lbas = self
            .info
            .block_limits
            .as_ref()
            .and_then(|b| b.max_unmap_lba_count)
            .unwrap_or(u32::MAX);
        if len == 0 || !thin || max_lbas == 0 || !self.unmap_supported.load(Ordering::Relaxed) {
            return Ok(());
        }
        let max_desc = self
            .info
            .block_limits
            .as_ref()
            .and_then(|b| b.max_unmap_block_descriptor_count)
            .filter(|&n| n > 0)
            .unwrap_or(1)
            .min(64) as usize;
        let lbs = self.geo.lbs();
        let (mut lba, end) = (offset / lbs, (offset + len) / lbs);
        while lba < end {
            let mut ranges = Vec::with_capacity(max_desc);
            while lba < end && ranges.len() < max_desc {
                let n = u32::try_from((end - lba).min(u64::from(max_lbas))).unwrap_or(u32::MAX);
                ranges.push((lba, n));
                lba += u64::from(n);
            }
            let list = cdb::unmap_parameter_list(&ranges);
            let plen = u16::try_from(list.len()).unwrap_or(u16::MAX);
            match self.submit(
                CommandKind::Unmap,
                &cdb::unmap(plen),
                DataBuf::Out(&list),
                self.opts.data_timeout,
            ) {
                Ok(_) => {}
                // Discard is a hint: a target that turns UNMAP down keeps the data, which is fine.
                Err(f)
                    if matches!(
                        f.kind,
                        FailureKind::NotSupported | FailureKind::InvalidRequest
                    ) =>
                {
                    tracing::debug!("UNMAP on {}: {f}; discard disabled", self.path.display());
                    self.unmap_supported.store(false, Ordering::Relaxed);
                    return Ok(());
                }
                Err(f) => {
                    return Err(f.into_error(format!(
                        "UNMAP of {} ranges from LBA {} on {}",
                        ranges.len(),
                        ranges[0].0,
                        self.path.display()
                    )))
                }
            }
        }
        Ok(())
    }
}

/// `queue/max_sectors_kb` of the block queue behind the descriptor: for a block node its own
/// queue, for an sg node the queue of the disk it belongs to.
fn sysfs_max_sectors_kb(file: &File) -> Option<u64> {
    let meta = file.metadata().ok()?;
    let rdev = meta.rdev();
    let (maj, min) = (libc::major(rdev), libc::minor(rdev));
    let ft = meta.file_type();
    let queue = if ft.is_block_device() {
        PathBuf::from(format!("/sys/dev/block/{maj}:{min}/queue"))
    } else if ft.is_char_device() {
        let blk = PathBuf::from(format!("/sys/dev/char/{maj}:{min}/device/block"));
        let first = std::fs::read_dir(&blk).ok()?.flatten().next()?;
        first.path().join("queue")
    } else {
        return None;
    };
    std::fs::read_to_string(queue.join("max_sectors_kb"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// What kind of whole-LUN node a path is (see [`is_whole_lun`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WholeLun {
    /// A SCSI disk, `/dev/sdX`.
    ScsiDisk { name: String },
    /// A SCSI generic node, `/dev/sgN`.
    ScsiGeneric { name: String },
    /// A dm-multipath map (`dm-N`, uuid `mpath-…`) over whole SCSI disks.
    Multipath {
        name: String,
        dm_name: String,
        dm_uuid: String,
        paths: Vec<String>,
    },
    /// A whole block device that is not SCSI (loop, NVMe, virtio-blk): no `SG_IO`, use the file
    /// backend (which gives only host-local CAW).
    OtherDisk { name: String },
    /// A regular file: the file backend.
    RegularFile,
}

/// The kind of device-mapper device, from its uuid and/or table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DmKind {
    Multipath,
    /// A kpartx partition of a multipath map (`partN-mpath-…`).
    MultipathPartition,
    Lvm,
    Crypt,
    /// Anything else (the uuid prefix or first target type, for the message).
    Other(String),
}

/// Classify a dm device. The uuid (`/sys/block/dm-N/dm/uuid`) is decisive when it has a known
/// prefix: `mpath-` (multipathd), `partN-` (kpartx), `LVM-`, `CRYPT-`. Otherwise the table
/// (`dmsetup table` text) must be exactly one `multipath` target.
pub fn classify_dm(uuid: &str, table: Option<&str>) -> DmKind {
    let uuid = uuid.trim();
    if uuid.starts_with("mpath-") {
        return DmKind::Multipath;
    }
    if let Some(rest) = uuid.strip_prefix("part") {
        let after = rest.trim_start_matches(|c: char| c.is_ascii_digit());
        if after.len() < rest.len() && after.starts_with("-mpath-") {
            return DmKind::MultipathPartition;
        }
    }
    if uuid.starts_with("LVM-") {
        return DmKind::Lvm;
    }
    if uuid.starts_with("CRYPT-") {
        return DmKind::Crypt;
    }
    match table.map(parse_dm_table) {
        Some(t) if t.len() == 1 && t[0] == "multipath" => DmKind::Multipath,
        Some(t) if !t.is_empty() => DmKind::Other(t.join("+")),
        _ => DmKind::Other(uuid.split('-').next().unwrap_or("").to_string()),
    }
}

/// Target types of a `dmsetup table` listing (`<start> <length> <type> <args...>` per line).
pub fn parse_dm_table(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (start, len, ty) = (f.next()?, f.next()?, f.next()?);
            (start.parse::<u64>().is_ok() && len.parse::<u64>().is_ok()).then(|| ty.to_string())
        })
        .collect()
}

/// Decide whether `path` addresses a whole LUN that CetraFS may put its on-disk format on.
/// SCSI commands carry absolute LUN addresses, so a partition or an LVM LV would make locks
/// and data land outside the intended range: both are refused, as are device-mapper devices
/// other than a multipath map. Non-SCSI whole devices and files are reported, not refused.
pub fn is_whole_lun(path: &Path) -> Result<WholeLun> {
    is_whole_lun_in(Path::new("/sys"), path)
}

/// [`is_whole_lun`] against a sysfs tree at `sys` (tests use a fake one).
pub fn is_whole_lun_in(sys: &Path, path: &Path) -> Result<WholeLun> {
    let meta = std::fs::metadata(path)
        .map_err(|e| Error::io(format!("cannot stat {}", path.display()), e))?;
    let ft = meta.file_type();
    if ft.is_file() {
        return Ok(WholeLun::RegularFile);
    }
    let rdev = meta.rdev();
    let (maj, min) = (libc::major(rdev), libc::minor(rdev));
    if ft.is_char_device() {
        let dir = sys.join(format!("dev/char/{maj}:{min}"));
        let real = std::fs::canonicalize(&dir).unwrap_or(dir);
        let name = file_name(&real);
        if real.components().any(|c| c.as_os_str() == "scsi_generic") {
            return Ok(WholeLun::ScsiGeneric { name });
        }
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "{} is a character device ({name}) but not a SCSI generic node",
                path.display()
            ),
        ));
    }
    if !ft.is_block_device() {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("{} is neither a block device nor a file", path.display()),
        ));
    }
    let dir = sys.join(format!("dev/block/{maj}:{min}"));
    classify_block(sys, path, &std::fs::canonicalize(&dir).unwrap_or(dir))
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

fn classify_block(sys: &Path, path: &Path, dir: &Path) -> Result<WholeLun> {
    let name = file_name(dir);
    let shown = path.display();
    if dir.join("partition").exists() {
        let parent = dir.parent().map(file_name).unwrap_or_default();
        let num = read_trim(&dir.join("partition")).unwrap_or_default();
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{shown} ({name}) is partition {num} of {parent}: CetraFS needs the whole LUN because SCSI commands address the whole LUN; use /dev/{parent} or its multipath map"
            ),
        ));
    }
    if dir.join("dm").is_dir() {
        let uuid = read_trim(&dir.join("dm/uuid")).unwrap_or_default();
        let dm_name = read_trim(&dir.join("dm/name")).unwrap_or_default();
        let kind = classify_dm(&uuid, dm_table(&dm_name).as_deref());
        let refuse = |what: String| {
            Err(Error::new(
                ErrorKind::InvalidInput,
                format!("{shown} ({name}, dm name {dm_name:?}) is {what}: CetraFS needs a whole LUN (/dev/sdX) or a dm-multipath map of one, because SCSI commands address the whole LUN"),
            ))
        };
        return match kind {
            DmKind::Multipath => {
                let mut paths: Vec<String> = std::fs::read_dir(dir.join("slaves"))
                    .map(|rd| {
                        rd.flatten()
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .collect()
                    })
                    .unwrap_or_default();
                paths.sort();
                if let Some(p) = paths
                    .iter()
                    .find(|p| sys.join("class/block").join(p).join("partition").exists())
                {
                    return refuse(format!("a multipath map over a partition ({p})"));
                }
                Ok(WholeLun::Multipath {
                    name,
                    dm_name,
                    dm_uuid: uuid,
                    paths,
                })
            }
            DmKind::MultipathPartition => refuse("a partition of a multipath map (kpartx)".into()),
            DmKind::Lvm => refuse("an LVM logical volume".into()),
            DmKind::Crypt => refuse("a dm-crypt mapping".into()),
            DmKind::Other(t) => refuse(format!(
                "a device-mapper device that is not a multipath map ({t})"
            )),
        };
    }
    if dir.join("device/scsi_disk").exists()
        || dir.join("device/scsi_device").exists()
        || dir.join("device/scsi_generic").exists()
    {
        return Ok(WholeLun::ScsiDisk { name });
    }
    Ok(WholeLun::OtherDisk { name })
}

/// `dmsetup table <name>` when dmsetup is installed; only consulted for dm devices whose uuid
/// does not say what they are.
fn dm_table(dm_name: &str) -> Option<String> {
    if dm_name.is_empty() {
        return None;
    }
    let out = std::process::Command::new("dmsetup")
        .arg("table")
        .arg("--")
        .arg(dm_name)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn dm_uuid_classification() {
        assert_eq!(classify_dm("mpath-36001405abcdef", None), DmKind::Multipath);
        assert_eq!(
            classify_dm("part1-mpath-36001405abcdef", None),
            DmKind::MultipathPartition
        );
        assert_eq!(classify_dm("LVM-abcDEF123456", None), DmKind::Lvm);
        assert_eq!(classify_dm("CRYPT-LUKS2-0123-x", None), DmKind::Crypt);
        assert_eq!(classify_dm("", None), DmKind::Other(String::new()));
        assert_eq!(
            classify_dm("partX-mpath-1", None),
            DmKind::Other("partX".into())
        );
        // the uuid decides even when a table is given
        assert_eq!(
            classify_dm(
                "LVM-x",
                Some("0 100 multipath 0 0 1 1 round-robin 0 1 1 8:16 1")
            ),
            DmKind::Lvm
        );
    }

    #[test]
    fn dm_table_classification() {
        let mp =
            "0 2097152 multipath 1 queue_if_no_path 1 alua 1 1 service-time 0 2 1 8:16 1 8:32 1\n";
        assert_eq!(parse_dm_table(mp), vec!["multipath"]);
        assert_eq!(classify_dm("", Some(mp)), DmKind::Multipath);
        let lv = "0 204800 linear 8:16 2048\n204800 100 linear 8:32 0\n";
        assert_eq!(parse_dm_table(lv), vec!["linear", "linear"]);
        assert_eq!(
            classify_dm("", Some(lv)),
            DmKind::Other("linear+linear".into())
        );
        assert_eq!(
            classify_dm("", Some("0 8 striped 2 128 8:16 0 8:32 0")),
            DmKind::Other("striped".into())
        );
        // two multipath lines is not a whole-device map either
        assert_eq!(
            classify_dm("", Some(&format!("{mp}{mp}"))),
            DmKind::Other("multipath+multipath".into())
        );
        assert!(parse_dm_table("garbage\nx y z\n").is_empty());
    }

    /// A fake sysfs: dev/block/MAJ:MIN symlinks into devices/... like the real one.
    struct FakeSys {
        dir: tempfile::TempDir,
    }

    impl FakeSys {
        fn new() -> Self {
            Self {
                dir: tempfile::tempdir().unwrap(),
            }
        }
        fn root(&self) -> &Path {
            self.dir.path()
        }
        fn add(&self, kind: &str, majmin: &str, rel: &str) -> PathBuf {
            let real = self.root().join("devices").join(rel);
            std::fs::create_dir_all(&real).unwrap();
            std::fs::create_dir_all(self.root().join("dev").join(kind)).unwrap();
            symlink(&real, self.root().join("dev").join(kind).join(majmin)).unwrap();
            real
        }
        fn write(p: &Path, s: &str) {
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, s).unwrap();
        }
    }

    fn classify_fake(sys: &FakeSys, real: &Path) -> Result<WholeLun> {
        classify_block(
            sys.root(),
            Path::new("/dev/x"),
            &std::fs::canonicalize(real).unwrap(),
        )
    }

    #[test]
    fn sysfs_partition_is_refused() {
        let sys = FakeSys::new();
        let disk = sys.add("block", "8:16", "pci0/host3/target3:0:0/3:0:0:0/block/sdb");
        std::fs::create_dir_all(disk.join("device/scsi_disk")).unwrap();
        let part = disk.join("sdb1");
        std::fs::create_dir_all(&part).unwrap();
        FakeSys::write(&part.join("partition"), "1\n");
        assert_eq!(
            classify_fake(&sys, &disk).unwrap(),
            WholeLun::ScsiDisk { name: "sdb".into() }
        );
        let e = classify_fake(&sys, &part).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(e.to_string().contains("partition 1 of sdb"), "{e}");
        assert!(e.to_string().contains("/dev/sdb"), "{e}");
    }

    #[test]
    fn sysfs_dm_devices() {
        let sys = FakeSys::new();
        let sdb = sys.add("block", "8:16", "h/block/sdb");
        let sdc = sys.add("block", "8:32", "h2/block/sdc");
        std::fs::create_dir_all(sys.root().join("class/block")).unwrap();
        symlink(&sdb, sys.root().join("class/block/sdb")).unwrap();
        symlink(&sdc, sys.root().join("class/block/sdc")).unwrap();
        let dm = sys.add("block", "253:0", "virtual/block/dm-0");
        FakeSys::write(&dm.join("dm/uuid"), "mpath-36001405aaaa\n");
        FakeSys::write(&dm.join("dm/name"), "mpatha\n");
        std::fs::create_dir_all(dm.join("slaves/sdc")).unwrap();
        std::fs::create_dir_all(dm.join("slaves/sdb")).unwrap();
        match classify_fake(&sys, &dm).unwrap() {
            WholeLun::Multipath {
                name,
                dm_name,
                dm_uuid,
                paths,
            } => {
                assert_eq!((name.as_str(), dm_name.as_str()), ("dm-0", "mpatha"));
                assert_eq!(dm_uuid, "mpath-36001405aaaa");
                assert_eq!(paths, vec!["sdb", "sdc"]);
            }
            other => panic!("{other:?}"),
        }
        // the same map over a partition is refused
        FakeSys::write(&sdc.join("partition"), "2\n");
        let e = classify_fake(&sys, &dm).unwrap_err();
        assert!(e.to_string().contains("over a partition (sdc)"), "{e}");

        let lv = sys.add("block", "253:1", "virtual/block/dm-1");
        FakeSys::write(&lv.join("dm/uuid"), "LVM-Xyz\n");
        FakeSys::write(&lv.join("dm/name"), "pve-data\n");
        let e = classify_fake(&sys, &lv).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(e.to_string().contains("LVM logical volume"), "{e}");

        let kp = sys.add("block", "253:2", "virtual/block/dm-2");
        FakeSys::write(&kp.join("dm/uuid"), "part1-mpath-36001405aaaa\n");
        assert!(classify_fake(&sys, &kp)
            .unwrap_err()
            .to_string()
            .contains("kpartx"));
    }

    #[test]
    fn sysfs_other_disks_and_files() {
        let sys = FakeSys::new();
        let nvme = sys.add("block", "259:0", "pci/nvme/nvme0/nvme0n1");
        assert_eq!(
            classify_fake(&sys, &nvme).unwrap(),
            WholeLun::OtherDisk {
                name: "nvme0n1".into()
            }
        );
        let f = tempfile::NamedTempFile::new().unwrap();
        assert_eq!(is_whole_lun(f.path()).unwrap(), WholeLun::RegularFile);
        // /dev/null is a character device that is not a SCSI generic node
        let e = is_whole_lun(Path::new("/dev/null")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        let sg = sys.add(
            "char",
            "21:0",
            "pci/host0/target0:0:0/0:0:0:0/scsi_generic/sg0",
        );
        let real = std::fs::canonicalize(sg).unwrap();
        assert!(real.components().any(|c| c.as_os_str() == "scsi_generic"));
    }

    /// `SG_IO` on something that is not a SCSI device must fail cleanly with Unsupported and the
    /// errno (ENOTTY, or EINVAL from some drivers), so callers can fall back to `FileDevice`.
    fn assert_not_scsi(path: &Path) {
        let e = SgDevice::open(path, &SgDeviceOptions::default()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert!(
            matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)),
            "{e} / {:?}",
            e.raw_os_error()
        );
        assert!(e.to_string().contains("not a SCSI device"), "{e}");
    }

    #[test]
    fn sg_io_on_regular_file_and_char_device_fails_cleanly() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        assert_not_scsi(f.path());
        assert_not_scsi(Path::new("/dev/null"));
    }

    /// Same on a loop device, when the host lets us attach one (root, losetup present).
    #[test]
    fn sg_io_on_loop_device_fails_cleanly() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let out = std::process::Command::new("losetup")
            .arg("--find")
            .arg("--show")
            .arg(f.path())
            .output();
        let Some(out) = out.ok().filter(|o| o.status.success()) else {
            eprintln!("skipping: cannot attach a loop device here");
            return;
        };
        let loopdev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let r = std::panic::catch_unwind(|| {
            assert_not_scsi(Path::new(&loopdev));
            match is_whole_lun(Path::new(&loopdev)) {
                Ok(WholeLun::OtherDisk { name }) => assert!(name.starts_with("loop"), "{name}"),
                other => panic!("{other:?}"),
            }
        });
        let _ = std::process::Command::new("losetup")
            .arg("-d")
            .arg(&loopdev)
            .status();
        if let Err(p) = r {
            std::panic::resume_unwind(p);
        }
    }

    #[test]
    fn options_defaults() {
        let o = SgDeviceOptions::default();
        assert_eq!(o.data_timeout, Duration::from_secs(30));
        assert!(o.io_timeout < o.data_timeout);
        assert_eq!(
            ms(Duration::from_micros(10)),
            1,
            "a zero timeout would mean the driver default"
        );
        assert_eq!(ms(Duration::from_secs(u64::MAX)), u32::MAX);
        assert_eq!(received(512, Done::Good { resid: 12 }), 500);
        assert_eq!(received(512, Done::Good { resid: -5 }), 512);
    }
}
