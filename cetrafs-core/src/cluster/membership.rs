//! Claiming a node slot, renewing it, watching the others, and fencing ourselves.
//!
//! Claim: read the slot, COMPARE AND WRITE it from exactly what was read to a live record with
//! generation + 1 and a fresh nonce; on a miscompare re-read (our image there means the CAW did
//! land — the ATS false-miscompare lesson); then wait 2 × `io_timeout` and re-read to catch a
//! concurrent claimer. Renewal: read our slot (a foreign image means someone took it: fence at
//! once), then write the next counter. Every write this node makes goes through [`LeaseGuard`],
//! which refuses it once the last successful renewal is older than the fail time — checked at
//! the write itself, so a node resuming from SIGSTOP fences before any worker thread can write.

use super::lock::SlotLife;
use super::machine::MachineId;
use super::Timing;
use crate::dev::{AlignedBuf, BlockDevice, CawOutcome, Geometry, SharedDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::heartbeat::{Heartbeat, SlotState};
use crate::format::superblock::Superblock;
use crate::format::FS_BLOCK;
use crate::sync::LockPolicy;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Slots held by live memberships of this process: (volume uuid, slot, generation).
static HELD: Mutex<Vec<([u8; 16], u32, u64)>> = Mutex::new(Vec::new());

fn held_here(uuid: &[u8; 16], slot: u32, generation: u64) -> bool {
    HELD.lock()
        .or_panic()
        .iter()
        .any(|h| h == &(*uuid, slot, generation))
}

fn set_held(uuid: [u8; 16], slot: u32, generation: u64, held: bool) {
    let mut v = HELD.lock().or_panic();
    v.retain(|h| h != &(uuid, slot, generation));
    if held {
        v.push((uuid, slot, generation));
    }
}

/// What one slot looked like when scanned.
#[derive(Debug, Clone)]
pub struct SlotView {
    pub slot: u32,
    pub raw: Vec<u8>,
    pub record: Option<Heartbeat>,
}

impl SlotView {
    /// Neither a valid record of this volume and slot nor the all-zero never-used block: a
    /// damaged slot. Nobody claims it (it may be a live node's record whose owner fences at
    /// its next renewal, or a dead node's whose journal and locks still need recovering); it is
    /// watched like a live-looking record, with the superblock's timing, and recovered once it
    /// has not changed for that dead time.
    pub fn is_damaged(&self) -> bool {
        self.record.is_none() && self.raw.iter().any(|&b| b != 0)
    }

    /// Never used, or released: a claim may take it.
    pub fn is_free(&self) -> bool {
        match &self.record {
            Some(h) => h.state == SlotState::Free,
            None => !self.is_damaged(),
        }
    }
}

/// What a slot's block says, as the heartbeat area is read: Ok(None) for a never-used
/// (all-zero) block; Err (with the reason) for a block that does not decode or holds another
/// volume's or another slot's record.
pub fn decode_slot(raw: &[u8], sb: &Superblock, slot: u32) -> Result<Option<Heartbeat>> {
    let Some(h) = Heartbeat::decode(raw)? else {
        return Ok(None);
    };
    if h.uuid != sb.uuid {
        bail!(
            Corrupted,
            "heartbeat record of another volume ({:02x?}..)",
            &h.uuid[..4]
        );
    }
    if h.slot != slot {
        bail!(
            Corrupted,
            "heartbeat record of slot {} in slot {slot}",
            h.slot
        );
    }
    Ok(Some(h))
}

/// What the heartbeat area says about who may hold locks as slot `v.slot` (see
/// [`crate::cluster::lock::SlotLife`]). Only slots below `max_nodes` are ever claimed.
pub fn life_of(v: &SlotView, sb: &Superblock) -> SlotLife {
    if v.slot >= sb.max_nodes {
        return SlotLife::Gone;
    }
    match &v.record {
        Some(h) if h.state == SlotState::Live => SlotLife::Live(h.generation),
        Some(h) if h.state == SlotState::Recovering => SlotLife::Unknown,
        None if v.is_damaged() => SlotLife::Unknown,
        Some(_) | None => SlotLife::Gone,
    }
}

/// [`life_of`] every slot, from a fresh scan.
pub fn lives(dev: &dyn BlockDevice, sb: &Superblock) -> Result<Vec<SlotLife>> {
    Ok(scan(dev, sb)?.iter().map(|v| life_of(v, sb)).collect())
}

/// Called once when this node fences itself, with the reason: where a hardware watchdog
/// (Proxmox's watchdog-mux) or SCSI-3 persistent-reservation fencing plugs in later. A hook
/// must not block for long: it runs on the thread that noticed.
pub type FenceHook = Box<dyn Fn(&str) + Send + Sync>;

#[derive(Default)]
struct FenceHooks(Mutex<Vec<FenceHook>>);

impl std::fmt::Debug for FenceHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().or_panic().len();
        write!(f, "{n} fence hook(s)")
    }
}

#[derive(Debug)]
pub struct Membership {
    dev: SharedDevice,
    sb: Superblock,
    pub slot: u32,
    pub host: String,
    timing: Timing,
    /// `CLOCK_BOOTTIME` milliseconds at the *start* of the last successful renewal (boot time,
    /// unlike `CLOCK_MONOTONIC`, keeps counting while the host is suspended).
    last_ok_ms: AtomicU64,
    image: Mutex<Vec<u8>>,
    fenced: AtomicBool,
    reason: Mutex<Option<String>>,
    stop: AtomicBool,
    generation: AtomicU64,
    /// Renew with COMPARE AND WRITE instead of read + compare + write (mount option
    /// `renew=caw`): one command, and a takeover is detected by the array itself.
    caw_renewal: AtomicBool,
    /// The host watchdog's bound this node advertises in its heartbeat (ms, 0: none).
    watchdog_ms: std::sync::atomic::AtomicU32,
    fence_hooks: FenceHooks,
}

impl Drop for Membership {
    fn drop(&mut self) {
        set_held(
            self.sb.uuid,
            self.slot,
            self.generation.load(Ordering::Acquire),
            false,
        );
    }
}

/// Milliseconds of `CLOCK_BOOTTIME`: monotonic, and advancing across suspend.
fn boottime_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to a valid pointer.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &raw mut ts) };
    if r != 0 {
        return u64::MAX; // makes every lease look expired: fail safe
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1000
        + u64::try_from(ts.tv_nsec).unwrap_or(0) / 1_000_000
}

pub fn lba_of(sb: &Superblock, slot: u32) -> u64 {
    sb.hb_start * (FS_BLOCK / u64::from(sb.logical_block_size)) + u64::from(slot)
}

pub fn read_slot(dev: &dyn BlockDevice, sb: &Superblock, slot: u32) -> Result<Vec<u8>> {
    let lbs = dev.geometry().logical_block_size as usize;
    let mut buf = AlignedBuf::new(lbs);
    dev.read_at(lba_of(sb, slot) * lbs as u64, &mut buf)?;
    Ok(buf.to_vec())
}

/// Compare-and-write `new` over `expected` in `slot`; true if our image is there now. After
/// a miscompare or an error of unknown outcome the block tells whether our write landed.
pub fn swap_slot(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: u32,
    expected: &[u8],
    new: &[u8],
) -> Result<bool> {
    match dev.compare_and_write(lba_of(sb, slot), expected, new) {
        Ok(CawOutcome::Written) => Ok(true),
        Ok(CawOutcome::Miscompare) | Err(_) => Ok(read_slot(dev, sb, slot)? == new),
    }
}

/// How often a slot that does not decode is re-read before the scan calls it damaged: a
/// target may return a torn block while its owner's write is in flight.
const TORN_READ_RETRIES: u32 = 3;

/// Read every slot of the heartbeat area ([`decode_slot`]); a slot that does not decode is
/// re-read a few times, then reported with `record: None` ([`SlotView::is_damaged`]).
pub fn scan(dev: &dyn BlockDevice, sb: &Superblock) -> Result<Vec<SlotView>> {
    (0..sb.hb_slots)
        .map(|slot| {
            let mut attempt = 0;
            loop {
                let raw = read_slot(dev, sb, slot)?;
                match decode_slot(&raw, sb, slot) {
                    Ok(record) => return Ok(SlotView { slot, raw, record }),
                    Err(_) if attempt < TORN_READ_RETRIES => {
                        attempt += 1;
                        std::thread::sleep(Duration::from_micros(500 << attempt));
                    }
                    Err(_) => {
                        return Ok(SlotView {
                            slot,
                            raw,
                            record: None,
                        })
                    }
                }
            }
        })
        .collect()
}

/// Watch live slots for their dead time (each by its own published timing); returns the
/// slots whose heartbeat changed (alive) and those that did not (dead). Stops at the first
/// live node (the others' fate is then left to the running nodes' watchers); a slot that
/// turns Free was unmounted cleanly and is in neither list.
pub fn observe(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    live: &[SlotView],
    limit: Option<Duration>,
) -> Result<(Vec<SlotView>, Vec<SlotView>)> {
    let start = Instant::now();
    let mut pending: Vec<(SlotView, Duration)> = live
        .iter()
        .map(|v| {
            let dead = v.record.as_ref().map_or_else(
                || Timing::from_ms(sb.heartbeat_interval_ms, sb.io_timeout_ms).dead_time(),
                Heartbeat::dead_time,
            );
            (v.clone(), limit.unwrap_or(dead))
        })
        .collect();
    let mut alive = Vec::new();
    let mut dead = Vec::new();
    let poll = Duration::from_millis(u64::from(sb.heartbeat_interval_ms).clamp(10, 500));
    while !pending.is_empty() {
        std::thread::sleep(poll);
        let mut still = Vec::new();
        for (v, wait) in pending {
            let now = read_slot(dev, sb, v.slot)?;
            if now != v.raw {
                let record = Heartbeat::decode(&now).ok().flatten();
                if record.as_ref().is_some_and(|h| h.state == SlotState::Free) {
                    continue;
                }
                alive.push(SlotView {
                    record,
                    raw: now,
                    slot: v.slot,
                });
                return Ok((alive, dead));
            } else if start.elapsed() >= wait {
                dead.push(v);
            } else {
                still.push((v, wait));
            }
        }
        pending = still;
    }
    Ok((alive, dead))
}

impl Membership {
    /// Claim a slot for `host` on `machine` (recorded in the record: `cluster/machine.rs`);
    /// `prefer` is a dead slot of this host's that the caller has recovered and wants reused.
    pub fn claim(
        dev: SharedDevice,
        sb: &Superblock,
        host: &str,
        machine: MachineId,
        prefer: Option<u32>,
    ) -> Result<Arc<Self>> {
        let lbs = dev.geometry().logical_block_size as usize;
        let timing = Timing::from_ms(sb.heartbeat_interval_ms, sb.io_timeout_ms);
        let mut tried = std::collections::HashSet::new();
        loop {
            let views = scan(&*dev, sb)?;
            let usable = |v: &SlotView| v.is_free() && v.slot < sb.max_nodes;
            let pick = prefer
                .filter(|p| *p < sb.max_nodes && !tried.contains(p))
                .and_then(|p| views.iter().find(|v| v.slot == p))
                // Not once a survivor has claimed its recovery (state Recovering). A damaged
                // slot only when the caller found it dead (it recovers it as its own).
                .filter(|v| {
                    usable(v)
                        || v.is_damaged()
                        || v.record
                            .as_ref()
                            .is_some_and(|h| h.state == SlotState::Live)
                })
                .or_else(|| {
                    views
                        .iter()
                        .filter(|v| !tried.contains(&v.slot))
                        .find(|v| usable(v))
                })
                .cloned();
            let Some(v) = pick else {
                bail!(Busy, "no free node slot: all {} slots are in use (mkfs.cetra -N sets the number of nodes)", sb.max_nodes);
            };
            tried.insert(v.slot);
            let generation = v.record.as_ref().map_or(0, |h| h.generation) + 1;
            let mine = Heartbeat {
                state: SlotState::Live,
                generation,
                counter: 1,
                nonce: rand::random(),
                uuid: sb.uuid,
                interval_ms: sb.heartbeat_interval_ms,
                io_timeout_ms: sb.io_timeout_ms,
                slot: v.slot,
                host: host.to_string(),
                pid: u64::from(std::process::id()),
                recoverer: u32::MAX,
                recoverer_gen: 0,
                machine,
                watchdog_ms: 0,
            };
            let image = mine.encode(lbs);
            // The lease runs from the moment the claim was issued, not from when we learn it
            // succeeded: others time us from the last change they saw.
            let issued = boottime_ms();
            if !swap_slot(&*dev, sb, v.slot, &v.raw, &image)? {
                continue;
            }
            // A concurrent claimer that read the same old image would have miscompared; one
            // whose CAW was delayed in flight (SCSI only: the host-local emulation completes
            // a CAW before returning) shows up within 2 × io_timeout.
            if dev.geometry().caw == crate::dev::CawKind::Scsi {
                std::thread::sleep(timing.io_timeout * 2);
            }
            if read_slot(&*dev, sb, v.slot)? != image {
                bail!(Busy, "lost node slot {} to another node claiming it at the same moment; retry the mount", v.slot);
            }
            let m = Arc::new(Self {
                dev,
                sb: sb.clone(),
                slot: v.slot,
                host: host.to_string(),
                timing,
                last_ok_ms: AtomicU64::new(issued),
                image: Mutex::new(image),
                fenced: AtomicBool::new(false),
                reason: Mutex::new(None),
                stop: AtomicBool::new(false),
                generation: AtomicU64::new(0),
                caw_renewal: AtomicBool::new(false),
                watchdog_ms: std::sync::atomic::AtomicU32::new(0),
                fence_hooks: FenceHooks::default(),
            });
            set_held(sb.uuid, v.slot, generation, true);
            m.generation.store(generation, Ordering::Release);
            Self::spawn_renewer(&m)?;
            tracing::info!(
                "node {host} holds slot {} (generation {generation})",
                v.slot
            );
            return Ok(m);
        }
    }

    fn spawn_renewer(m: &Arc<Self>) -> Result<()> {
        let weak = Arc::downgrade(m);
        let interval = m.timing.interval;
        std::thread::Builder::new()
            .name("cetra-heartbeat".into())
            .spawn(move || loop {
                std::thread::sleep(interval);
                let Some(m) = weak.upgrade() else { break };
                if m.stop.load(Ordering::Acquire) || m.fenced.load(Ordering::Acquire) {
                    break;
                }
                m.renew_once();
            })
            .map(|_| ())
            .map_err(|e| Error::io("cannot start the heartbeat thread", e))
    }

    /// One renewal; fences on a foreign image or when the lease ran out.
    fn renew_once(&self) {
        let started = boottime_ms();
        if !self.lease_valid() {
            self.fence(format!(
                "could not renew the heartbeat for {} ms (fail time {} ms)",
                started.saturating_sub(self.last_ok_ms.load(Ordering::Acquire)),
                self.timing.fail_time().as_millis()
            ));
            return;
        }
        let lbs = self.dev.geometry().logical_block_size as usize;
        let mut image = self.image.lock().or_panic();
        let caw = self.caw_renewal.load(Ordering::Acquire);
        if !caw {
            match read_slot(&*self.dev, &self.sb, self.slot) {
                Ok(cur) if cur != *image => {
                    drop(image);
                    self.fence_taken_over();
                    return;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!("heartbeat read failed: {e}");
                    return;
                }
            }
        }
        let Ok(Some(mut h)) = Heartbeat::decode(&image) else {
            return;
        };
        h.counter += 1;
        h.nonce = rand::random();
        h.watchdog_ms = self.watchdog_ms.load(Ordering::Acquire);
        let next = h.encode(lbs);
        let lba = lba_of(&self.sb, self.slot);
        // The check above and the re-read took time (an I/O): a node paused in between (SIGSTOP,
        // a VM freeze) may resume after survivors declared it dead and cleared its slot, and a
        // plain write would then put our image back over theirs. Look at the lease again at
        // the last moment; what remains is the instant between this check and the write
        // itself (docs/locking.md §14).
        if !self.lease_valid() {
            drop(image);
            self.fence(format!(
                "the heartbeat lease ran out while renewing it ({} ms since the last renewal, \
                 fail time {} ms)",
                boottime_ms().saturating_sub(self.last_ok_ms.load(Ordering::Acquire)),
                self.timing.fail_time().as_millis()
            ));
            return;
        }
        let written = if caw {
            match self.dev.compare_and_write(lba, &image, &next) {
                Ok(CawOutcome::Written) => Ok(()),
                // Miscompare or unknown outcome: the block tells whether ours landed, and
                // whether somebody else's did.
                other => match read_slot(&*self.dev, &self.sb, self.slot) {
                    Ok(cur) if cur == next => Ok(()),
                    Ok(cur) if cur != *image => {
                        drop(image);
                        self.fence_taken_over();
                        return;
                    }
                    Ok(_) => Err(other.err().unwrap_or_else(|| {
                        Error::new(ErrorKind::Io, "heartbeat COMPARE AND WRITE did not land")
                    })),
                    Err(e) => Err(e),
                },
            }
        } else {
            self.dev
                .write_at(lba * lbs as u64, &AlignedBuf::from_slice(&next))
        };
        match written {
            Ok(()) => {
                *image = next;
                self.last_ok_ms.store(started, Ordering::Release);
            }
            Err(e) => tracing::warn!("heartbeat write failed: {e}"),
        }
    }

    /// From the next renewal on, the heartbeat says that this node's host is certainly reset
    /// `bound` after its lease ran out (`cluster/watchdog.rs`): the others wait that much
    /// longer before they recover it ([`Heartbeat::dead_time`]). Capped at the record's limit.
    pub fn advertise_watchdog(&self, bound: Duration) {
        let ms = u32::try_from(bound.as_millis())
            .unwrap_or(u32::MAX)
            .min(crate::format::heartbeat::MAX_WATCHDOG_MS);
        self.watchdog_ms.store(ms, Ordering::Release);
    }

    /// Renew the heartbeat with COMPARE AND WRITE from now on (mount option `renew=caw`).
    pub fn set_caw_renewal(&self, on: bool) {
        self.caw_renewal.store(on, Ordering::Release);
    }

    /// The generation of the slot this node holds (its identity in lock records).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// May this node still write? False once fenced or once the lease has run out.
    pub fn lease_valid(&self) -> bool {
        if self.fenced.load(Ordering::Acquire) {
            return false;
        }
        let age = boottime_ms().saturating_sub(self.last_ok_ms.load(Ordering::Acquire));
        u128::from(age) < self.timing.fail_time().as_millis()
    }

    pub fn fence(&self, why: String) {
        if !self.fenced.swap(true, Ordering::AcqRel) {
            tracing::error!("FENCED: {why}; this node writes nothing more to the volume until it is unmounted and mounted again");
            for hook in self.fence_hooks.0.lock().or_panic().iter() {
                hook(&why);
            }
            *self.reason.lock().or_panic() = Some(why);
        }
    }

    fn fence_taken_over(&self) {
        self.fence(format!(
            "node slot {} was taken over by another node",
            self.slot
        ));
    }

    /// Run `hook` when this node fences itself (see [`FenceHook`]).
    pub fn on_fence(&self, hook: FenceHook) {
        self.fence_hooks.0.lock().or_panic().push(hook);
    }

    pub fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::Acquire)
    }

    pub fn fence_reason(&self) -> Option<String> {
        self.reason.lock().or_panic().clone()
    }

    /// Clean release: mark the slot free (only if it is still ours and we are not fenced).
    pub fn release(&self) -> Result<()> {
        self.stop.store(true, Ordering::Release);
        set_held(
            self.sb.uuid,
            self.slot,
            self.generation.load(Ordering::Acquire),
            false,
        );
        if !self.lease_valid() {
            return Ok(());
        }
        let image = self.image.lock().or_panic().clone();
        let Ok(Some(mut h)) = Heartbeat::decode(&image) else {
            return Ok(());
        };
        h.state = SlotState::Free;
        h.nonce = rand::random();
        let lbs = self.dev.geometry().logical_block_size as usize;
        let free = h.encode(lbs);
        if swap_slot(&*self.dev, &self.sb, self.slot, &image, &free)? {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::Fenced,
                format!("node slot {} changed under us before release", self.slot),
            ))
        }
    }
}

/// The device as the filesystem sees it: every write requires a valid lease.
#[derive(Debug)]
pub struct LeaseGuard {
    inner: SharedDevice,
    member: Arc<Membership>,
}

impl LeaseGuard {
    pub fn new(inner: SharedDevice, member: Arc<Membership>) -> Self {
        Self { inner, member }
    }

    fn check(&self) -> Result<()> {
        if self.member.lease_valid() {
            return Ok(());
        }
        if !self.member.is_fenced() {
            self.member
                .fence("the heartbeat lease expired (node paused or storage unreachable)".into());
        }
        Err(Error::new(
            ErrorKind::Fenced,
            format!(
                "node is fenced: {}",
                self.member.fence_reason().unwrap_or_default()
            ),
        ))
    }

    /// An error of the device below: RESERVATION CONFLICT means a survivor preempted this
    /// node's reservation key (it was given up for dead and recovered, `fence=pr`), so the
    /// node fences itself at once instead of waiting for its lease to show it.
    fn seen<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|e| {
            if !crate::scsi::reservation_conflict(&e) {
                return e;
            }
            if self.member.is_fenced() {
                // Its lease ran out first (a paused node that resumed): the target refusing
                // what it still had in flight is the proof that fence=pr worked.
                tracing::warn!(
                    "RESERVATION CONFLICT: the LUN refused an I/O of this fenced node ({e})"
                );
            }
            self.member.fence(format!(
                "RESERVATION CONFLICT: the LUN refused this node's I/O ({e}): another node preempted its reservation key after giving it up for dead"
            ));
            Error::with_source(ErrorKind::Fenced, "node is fenced: RESERVATION CONFLICT", e)
        })
    }
}

/// Writes of a `write_many` sent after one lease check (a file device's ring depth).
const LEASE_CHECKED_WRITES: usize = 64;

impl BlockDevice for LeaseGuard {
    fn geometry(&self) -> &Geometry {
        self.inner.geometry()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        // A fenced node reads nothing either: its block maps may point at blocks that the
        // survivors have reused since they recovered it.
        self.check()?;
        self.seen(self.inner.read_at(offset, buf))
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.check()?;
        // Between the lease check and the write: where a node that is paused (SIGSTOP, a VM
        // migration, a long GC) resumes with a write its lease no longer covers. The LIO
        // fencing scenario stops a daemon here (`=stop`, armed for one byte offset).
        crate::failpoint::process_at(
            "lease::write_checked",
            offset,
            u64::try_from(buf.len()).unwrap_or(u64::MAX),
        );
        self.seen(self.inner.write_at(offset, buf))
    }
    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.check()?;
        self.seen(self.inner.read_many(reads))
    }
    fn write_many(&self, writes: &[(u64, &[u8])]) -> Result<()> {
        // The lease is checked again before each group that goes out together (the device
        // below submits at most this many at once), not once for a long list.
        for group in writes.chunks(LEASE_CHECKED_WRITES) {
            self.check()?;
            for (offset, buf) in group {
                // As in write_at, for each write of the lot.
                crate::failpoint::process_at(
                    "lease::write_checked",
                    *offset,
                    u64::try_from(buf.len()).unwrap_or(u64::MAX),
                );
            }
            self.seen(self.inner.write_many(group))?;
        }
        Ok(())
    }
    fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
        self.check()?;
        self.seen(self.inner.compare_and_write(lba, expected, new))
    }
    fn flush(&self) -> Result<()> {
        self.check()?;
        self.seen(self.inner.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check()?;
        self.seen(self.inner.discard(offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.check()?;
        // As in write_at: zeros are a write.
        crate::failpoint::process_at("lease::write_checked", offset, len);
        self.seen(self.inner.write_zeroes(offset, len))
    }
    fn offloads_zeroes(&self) -> bool {
        self.inner.offloads_zeroes()
    }
    fn refresh_size(&self) -> Result<u64> {
        self.inner.refresh_size()
    }
}

/// Is the process that wrote this record gone? Only answerable for records of this host: a
/// daemon on this host that no longer exists cannot have I/O in flight, so its slot is dead
/// without waiting out the dead time (the common case of a crashed or killed local daemon).
pub fn local_writer_gone(h: &Heartbeat, local_host: &str) -> bool {
    // An offline tool's claim on this host counts as this host's (`cluster/fsck_claim.rs`),
    // whichever of the two names asks.
    let bare = |n: &str| n.split_once(':').map_or(n, |(_, host)| host).to_string();
    if bare(&h.host) != bare(local_host) {
        return false;
    }
    // Two machines given the same node name: a pid of that other machine says nothing here.
    if !h.machine.is_unknown() && MachineId::local().ok() != Some(h.machine) {
        return false;
    }
    let Ok(pid) = i32::try_from(h.pid) else {
        return false;
    };
    if u64::from(std::process::id()) == h.pid {
        // Written by this very process: gone unless one of our live memberships holds it.
        return !held_here(&h.uuid, h.slot, h.generation);
    }
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks for existence; it sends nothing.
    let r = unsafe { libc::kill(pid, 0) };
    if r != 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    // A zombie (killed, not yet reaped: daemons are reparented) has no I/O in flight either.
    crate::cluster::procs::state(pid) == Some('Z')
}

/// How long to watch a live-looking slot before calling it dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Patience {
    /// The node's full dead time: required before anyone writes on its behalf.
    Dead,
    /// A few heartbeat intervals: enough to see a healthy node's heartbeat move (read-only
    /// checks).
    Brief,
}

/// Find nodes that hold live slots. Returns (alive, dead): alive nodes changed their heartbeat
/// while we watched; dead ones did not for the chosen patience (or are local processes that
/// no longer exist).
pub fn find_holders(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    local_host: &str,
    patience: Patience,
) -> Result<(Vec<SlotView>, Vec<SlotView>)> {
    let views = scan(dev, sb)?;
    for v in views.iter().filter(|v| v.is_damaged()) {
        tracing::warn!(
            "heartbeat slot {} is damaged (its record does not decode){}; run fsck.cetra",
            v.slot,
            if v.slot < sb.max_nodes {
                ": watching it for the dead time before recovering it"
            } else {
                "; no node can hold it (beyond max nodes), ignored"
            }
        );
    }
    // Only slots below max_nodes are ever claimed; a damaged one is watched like a live one.
    let live: Vec<SlotView> = views
        .into_iter()
        .filter(|v| {
            v.slot < sb.max_nodes
                && (v.is_damaged()
                    || v.record
                        .as_ref()
                        .is_some_and(|h| h.state == SlotState::Live))
        })
        .collect();
    let (gone, watch): (Vec<SlotView>, Vec<SlotView>) = live.into_iter().partition(|v| {
        v.record
            .as_ref()
            .is_some_and(|h| local_writer_gone(h, local_host))
    });
    if watch.is_empty() {
        return Ok((Vec::new(), gone));
    }
    let limit = match patience {
        Patience::Dead => None,
        Patience::Brief => {
            Some(Timing::from_ms(sb.heartbeat_interval_ms, sb.io_timeout_ms).interval * 4)
        }
    };
    tracing::info!(
        "watching {} live-looking node slot(s) to tell whether their nodes are alive",
        watch.len()
    );
    let (alive, mut dead) = observe(dev, sb, &watch, limit)?;
    dead.extend(gone);
    Ok((alive, dead))
}

/// One line describing who holds a slot, for error messages.
pub fn describe(v: &SlotView) -> String {
    match &v.record {
        Some(h) => format!("node {:?} (slot {}, pid {})", h.host, v.slot, h.pid),
        None => format!("slot {}", v.slot),
    }
}

/// After claiming: two daemons with the same node identity that mounted at the same moment
/// both hold slots now. The one with the higher slot backs off; the lower one stays.
pub fn settle_same_host(dev: &dyn BlockDevice, sb: &Superblock, me: &Membership) -> Result<()> {
    let twin = scan(dev, sb)?.into_iter().find(|v| {
        v.slot < me.slot
            && v.record.as_ref().is_some_and(|h| {
                h.state == SlotState::Live && h.host == me.host && !local_writer_gone(h, &me.host)
            })
    });
    if let Some(t) = twin {
        bail!(
            Busy,
            "{} already has this volume mounted: a second daemon with the same node identity is refused",
            describe(&t)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::mem::MemDevice;
    use crate::mkfs::{format, MkfsOptions};

    fn volume(interval_ms: u32, io_ms: u32) -> (Arc<MemDevice>, Superblock) {
        let dev = Arc::new(MemDevice::new(128 << 20, 512));
        let o = MkfsOptions {
            max_nodes: 4,
            journal_bytes: 1 << 20,
            heartbeat_interval_ms: interval_ms,
            io_timeout_ms: io_ms,
            ..Default::default()
        };
        let sb = format(&*dev, &o, &mut |_, _| {}).unwrap();
        (dev, sb)
    }

    #[test]
    fn claim_renew_release_and_reclaim() {
        let (dev, sb) = volume(10, 200);
        let m = Membership::claim(dev.clone(), &sb, "n1", MachineId::UNKNOWN, None).unwrap();
        let first = read_slot(&*dev, &sb, m.slot).unwrap();
        let deadline = Instant::now() + Duration::from_secs(1);
        while read_slot(&*dev, &sb, m.slot).unwrap() == first && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_ne!(
            read_slot(&*dev, &sb, m.slot).unwrap(),
            first,
            "heartbeat renews"
        );
        assert!(m.lease_valid());
        // A second node takes another slot.
        let m2 = Membership::claim(dev.clone(), &sb, "n2", MachineId::UNKNOWN, None).unwrap();
        assert_ne!(m.slot, m2.slot);
        m.release().unwrap();
        let v = scan(&*dev, &sb).unwrap();
        assert_eq!(
            v[m.slot as usize].record.as_ref().unwrap().state,
            SlotState::Free
        );
        m2.release().unwrap();
    }

    #[test]
    fn a_paused_node_is_fenced_at_its_next_write() {
        let (dev, sb) = volume(10, 20); // fail time 160 ms
        let m = Membership::claim(dev.clone(), &sb, "n1", MachineId::UNKNOWN, None).unwrap();
        let guard = LeaseGuard::new(dev.clone(), m.clone());
        let hooked = Arc::new(Mutex::new(None::<String>));
        let h2 = hooked.clone();
        m.on_fence(Box::new(move |why| {
            *h2.lock().unwrap() = Some(why.to_string());
        }));
        guard.write_at(0, &[0u8; 512]).unwrap();
        // Simulate SIGSTOP: the renewer stops; time passes beyond the fail time.
        m.stop.store(true, Ordering::Release);
        std::thread::sleep(Duration::from_millis(250));
        let e = guard.write_at(0, &[0u8; 512]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Fenced);
        assert!(m.is_fenced());
        assert!(
            hooked
                .lock()
                .unwrap()
                .as_deref()
                .is_some_and(|w| w.contains("lease")),
            "the fence hook ran with the reason: {:?}",
            hooked.lock().unwrap()
        );
        // Nothing more, reads included: its cached block maps may point at reused blocks.
        let mut b = [0u8; 512];
        assert_eq!(
            guard.read_at(0, &mut b).unwrap_err().kind(),
            ErrorKind::Fenced
        );
        assert!(guard.flush().is_err());
    }

    /// A device whose writes come back RESERVATION CONFLICT (as EBADE, what the block layer
    /// reports) once `refuse` is set: the LUN after a survivor preempted this node's key.
    #[derive(Debug)]
    struct Preempted {
        inner: Arc<MemDevice>,
        refuse: AtomicBool,
    }

    impl BlockDevice for Preempted {
        fn geometry(&self) -> &Geometry {
            self.inner.geometry()
        }
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
            self.inner.read_at(offset, buf)
        }
        fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
            if self.refuse.load(Ordering::Acquire) {
                return Err(Error::io(
                    "write",
                    std::io::Error::from_raw_os_error(libc::EBADE),
                ));
            }
            self.inner.write_at(offset, buf)
        }
        fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
            self.inner.compare_and_write(lba, expected, new)
        }
        fn flush(&self) -> Result<()> {
            self.inner.flush()
        }
        fn discard(&self, offset: u64, len: u64) -> Result<()> {
            self.inner.discard(offset, len)
        }
        fn refresh_size(&self) -> Result<u64> {
            self.inner.refresh_size()
        }
    }

    /// fence=pr: a write the LUN refuses with RESERVATION CONFLICT fences the node at once,
    /// with its lease still valid, and nothing more is issued; other errors do not fence.
    #[test]
    fn a_reservation_conflict_fences_at_once() {
        let (mem, sb) = volume(10, 200);
        let m = Membership::claim(mem.clone(), &sb, "n1", MachineId::UNKNOWN, None).unwrap();
        let dev = Arc::new(Preempted {
            inner: mem.clone(),
            refuse: AtomicBool::new(false),
        });
        let guard = LeaseGuard::new(dev.clone(), m.clone());
        guard.write_at(0, &[0u8; 512]).unwrap();
        mem.faults.fail_reads.store(true, Ordering::SeqCst);
        let mut b = [0u8; 512];
        assert!(guard.read_at(0, &mut b).is_err());
        mem.faults.fail_reads.store(false, Ordering::SeqCst);
        assert!(!m.is_fenced(), "a plain EIO does not fence");
        dev.refuse.store(true, Ordering::Release);
        let e = guard.write_at(0, &[1u8; 512]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Fenced);
        assert!(m.is_fenced());
        assert!(
            m.fence_reason()
                .is_some_and(|r| r.contains("RESERVATION CONFLICT")),
            "{:?}",
            m.fence_reason()
        );
        dev.refuse.store(false, Ordering::Release);
        assert_eq!(
            guard.write_at(0, &[2u8; 512]).unwrap_err().kind(),
            ErrorKind::Fenced,
            "nothing more reaches the LUN"
        );
        let _ = m.release();
    }

    /// A node paused while its renewal re-reads the slot (SIGSTOP between the lease check and
    /// the write) must not write its heartbeat when it resumes with an expired lease: a
    /// survivor may have cleared that slot meanwhile. Fails if the lease is only looked at
    /// before the re-read.
    #[test]
    fn a_renewal_that_outlasts_the_lease_fences_instead_of_writing() {
        let (dev, sb) = volume(10, 20); // fail time 160 ms
        let m = Membership::claim(dev.clone(), &sb, "n1", MachineId::UNKNOWN, None).unwrap();
        m.stop.store(true, Ordering::Release);
        std::thread::sleep(Duration::from_millis(40)); // the renewer thread has ended
        let before = read_slot(&*dev, &sb, m.slot).unwrap();
        let writes = dev.writes.load(Ordering::SeqCst);
        // Refresh the lease, then let the re-read take longer than the whole fail time.
        m.last_ok_ms.store(boottime_ms(), Ordering::Release);
        dev.faults.latency_us.store(250_000, Ordering::SeqCst);
        m.renew_once();
        dev.faults.latency_us.store(0, Ordering::SeqCst);
        assert!(m.is_fenced(), "the renewal fenced the node");
        assert!(m.fence_reason().unwrap().contains("ran out while renewing"));
        assert_eq!(
            dev.writes.load(Ordering::SeqCst),
            writes,
            "nothing was written"
        );
        assert_eq!(read_slot(&*dev, &sb, m.slot).unwrap(), before);
    }

    /// Another node (wrongly, or after declaring us dead) overwrites our slot; wait (up to
    /// 2 s) for the renewal to notice.
    fn overwrite_and_wait_for_fence(dev: &MemDevice, sb: &Superblock, m: &Membership) {
        let mut h = Heartbeat::decode(&read_slot(dev, sb, m.slot).unwrap())
            .unwrap()
            .unwrap();
        h.host = "intruder".into();
        h.generation += 1;
        dev.write_at(lba_of(sb, m.slot) * 512, &h.encode(512))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        while !m.is_fenced() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_foreign_image_in_our_slot_fences_us() {
        let (dev, sb) = volume(10, 50);
        let m = Membership::claim(dev.clone(), &sb, "n1", MachineId::UNKNOWN, None).unwrap();
        overwrite_and_wait_for_fence(&dev, &sb, &m);
        assert!(m.is_fenced(), "renewal must notice the foreign image");
        assert!(m.fence_reason().unwrap().contains("taken over"));
    }

    #[test]
    fn caw_renewal_advances_and_detects_a_takeover() {
        let (dev, sb) = volume(10, 50);
        let m = Membership::claim(dev.clone(), &sb, "n1", MachineId::UNKNOWN, None).unwrap();
        m.set_caw_renewal(true);
        let counter = || {
            Heartbeat::decode(&read_slot(&*dev, &sb, m.slot).unwrap())
                .unwrap()
                .unwrap()
                .counter
        };
        let c0 = counter();
        std::thread::sleep(Duration::from_millis(100));
        assert!(counter() > c0 + 3, "renewal by CAW advances the counter");
        assert!(m.lease_valid());
        overwrite_and_wait_for_fence(&dev, &sb, &m);
        assert!(
            m.is_fenced(),
            "a miscompare on renewal with a foreign image fences"
        );
    }

    #[test]
    fn liveness_is_judged_by_change() {
        let (dev, sb) = volume(10, 60); // dead time 480 + 120 + 20 ms
        let alive = Membership::claim(dev.clone(), &sb, "alive", MachineId::UNKNOWN, None).unwrap();
        let dead = Membership::claim(dev.clone(), &sb, "dead", MachineId::UNKNOWN, None).unwrap();
        dead.stop.store(true, Ordering::Release); // stops renewing, like a crashed node
        std::thread::sleep(Duration::from_millis(30));
        let live: Vec<SlotView> = scan(&*dev, &sb)
            .unwrap()
            .into_iter()
            .filter(|v| v.slot == dead.slot)
            .collect();
        let (a, d) = observe(&*dev, &sb, &live, None).unwrap();
        assert!(
            a.is_empty() && d.len() == 1,
            "a silent slot is dead after its dead time"
        );
        let live: Vec<SlotView> = scan(&*dev, &sb)
            .unwrap()
            .into_iter()
            .filter(|v| v.slot == alive.slot)
            .collect();
        let (a, d) = observe(&*dev, &sb, &live, None).unwrap();
        assert!(a.len() == 1 && d.is_empty(), "a renewing slot is alive");
    }
}
