//! Mounting a volume: the sequence of `docs/locking.md` §10, one named step per function.
//!
//! 1. [`check_device`]: superblock (primary, else backup), logical block size, features, and
//!    the sharing mode against the path: a multi-node volume needs SCSI COMPARE AND WRITE.
//! 2. [`Others::find`]: who else holds the volume — live nodes are welcome, a live node of our
//!    own identity is refused, slots silent for their dead time are dead; a read-only mount
//!    refuses dead journals that need replay. A single-host volume refuses while a slot of
//!    another machine is alive ([`Others::refuse_other_machines`]). Nothing is written before
//!    this step has passed.
//! 3. [`Others::claim_slot`]: claim a heartbeat slot (our own dead incarnation first, any dead
//!    slot when none is free). From here every failure gives the slot back.
//! 4. [`replay_own_journal`], before any lock naming the slot is released (lesson 6).
//! 5. [`repair_locks`]: scrub our slot from every lock record; reset corrupted records only
//!    when no other node can hold a lock.
//!    On a v3 volume, [`open_object_locks`] opens the per-object lock area and mailboxes.
//! 6. [`recover_dead`]: claim, replay and release every dead slot (its object locks too), and
//!    take over recoveries whose recoverer is gone; then drop object-lock mentions of slots
//!    that hold nothing (free, never used, another generation).
//! 7. [`take_global_shared`] and load the allocator at a known lock version.
//! 8. [`Volume::start`]: background threads, root check, finish recoveries, free our orphans.

use super::inode_lock::InodeLocks;
use super::{cluster, read_superblock, InodeTable, Meta, MountOptions, Tx, Volume};
use crate::alloc::Allocator;
use crate::cluster::lock::{LockTable, Me, Repaired};
use crate::cluster::machine::MachineId;
use crate::cluster::membership::{self, SlotView};
use crate::cluster::object_lock::ObjectLocks;
use crate::cluster::recovery::{self, Claimed};
use crate::cluster::reservation::{self, Reservations};
use crate::cluster::{LeaseGuard, Membership, Timing};
use crate::dev::{BlockDevice, CawKind, SharedDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::heartbeat::SlotState;
use crate::format::lock_record::{LockMode, LockRecord};
use crate::format::superblock::{SharingMode, Superblock};
use crate::format::FS_BLOCK;
use crate::journal::{self, JournalArea};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

#[allow(clippy::missing_errors_doc)]
impl Volume {
    /// Mount: read and validate the superblock (falling back to the backup), join the
    /// cluster, recover what the dead left, load allocation state. Errors are one line a
    /// sysadmin can act on.
    pub fn mount(dev: SharedDevice, opts: &MountOptions) -> Result<Arc<Volume>> {
        let result = Self::mount_unfenced(dev, opts);
        if result.is_err() {
            if let Some(pr) = &opts.reservations {
                pr.leave();
            }
        }
        result
    }

    /// [`Self::mount`] before a failure gives back the reservation key.
    fn mount_unfenced(dev: SharedDevice, opts: &MountOptions) -> Result<Arc<Volume>> {
        let (sb, read_only) = check_device(&*dev, opts)?;
        if opts.host.contains(':') {
            // `TOOL:HOST` names the claims of offline tools (cluster/fsck_claim.rs).
            if opts.claimed.is_none() {
                bail!(
                    InvalidInput,
                    "node name {:?} contains ':', which only offline tools' claims use; mount with host=NAME",
                    opts.host
                );
            }
        }
        if let Some(c) = &opts.claimed {
            // fsck's own mount: the slot is its claim.
            return Self::mount_as(dev, sb, opts, read_only, &c.dead, c.member.clone());
        }
        let machine = match opts.machine {
            Some(m) => m,
            None => MachineId::local()?,
        };
        let others = Others::find(&*dev, &sb, opts, machine, read_only)?;
        let member = others.claim_slot(&dev, &sb, opts, machine)?;
        let claimed = member.clone();
        let result = Self::mount_as(dev, sb, opts, read_only, &others.dead, member);
        if result.is_err() {
            let _ = claimed.release();
        }
        result
    }

    /// Everything after the claim (the caller gives the slot back if this fails).
    fn mount_as(
        dev: SharedDevice,
        sb: Superblock,
        opts: &MountOptions,
        read_only: bool,
        dead: &[SlotView],
        member: Arc<Membership>,
    ) -> Result<Arc<Volume>> {
        // A grow since the superblock was read (finding the other nodes can take seconds):
        // the journals replayed below may use its groups (fs/grow.rs).
        let sb = super::grow::newest(&*dev, &sb)?.unwrap_or(sb);
        // fence=pr: the slot key replaces the joining key before anything else is written.
        if let Some(pr) = &opts.reservations {
            let live = reservation::live_slots(&membership::scan(&*dev, &sb)?);
            pr.join(member.slot, member.generation(), &live)?;
            // A slot taken back from a dead incarnation (or any dead node) still has that
            // node's key: cut it off before its journal is replayed below.
            if !read_only {
                pr.preempt_slot(member.slot, &|| Ok(member.lease_valid()))
                    .map_err(|e| e.wrap("fencing the previous holder of this node's slot"))?;
            }
        }
        membership::settle_same_host(&*dev, &sb, &member)?;
        let dev: SharedDevice = Arc::new(LeaseGuard::new(dev, member.clone()));
        let me = Me {
            slot: member.slot,
            gen: member.generation(),
        };
        let locks = LockTable::new(dev.clone(), &sb);
        // v3: holders learn of a waiter from their mailbox within a poll, so the waiter's
        // re-reads are worth making often (only while it waits).
        let locks = if sb.has_object_locks() {
            locks.with_backoff(WAIT_POLL_FIRST, WAIT_POLL_MAX)
        } else {
            locks
        };
        // Dead nodes first: their journals hold the newest metadata if one died holding the
        // global lock, and their locks would block ours.
        let journal = JournalArea::for_slot(&sb, member.slot);
        replay_own_journal(&*dev, &sb, journal, read_only)?;
        let (reset, _) = repair_locks(&*dev, &sb, &locks, &member, dead)?;
        let objects = open_object_locks(&dev, &sb)?;
        let recovered = if read_only {
            Vec::new()
        } else {
            let pr = opts.reservations.as_deref();
            recover_dead(&*dev, &sb, &locks, objects.as_ref(), pr, me, dead)?
        };
        if reset.contains(&LockTable::GLOBAL) {
            // Held exclusively since the reset, so that nobody used it before the dead were
            // recovered.
            locks.release_global(me)?;
        }
        // Locks still naming a slot that holds nothing (free, never used, another generation)
        // would make every mount wait for a node that does not exist.
        for line in locks.scrub_stale(&|| membership::lives(&*dev, &sb))? {
            tracing::warn!("{line} (not held by any mounted node)");
        }
        // Read-only mounts too: they take inode locks, and their slot's older generations may
        // have left mentions (a slot that is dead but not recovered is not stale: it is kept).
        if let Some(o) = &objects {
            for line in o.drop_stale(&|| membership::lives(&*dev, &sb))? {
                tracing::warn!("{line} (not held by any mounted node)");
            }
        }
        let timing = Timing::from_ms(sb.heartbeat_interval_ms, sb.io_timeout_ms);
        let ilocks = objects.map(|o| match opts.inode_locks {
            Some(n) => InodeLocks::with_limit(o, me, n),
            None => InodeLocks::new(o, me, sb.max_nodes),
        });
        if let Some(il) = &ilocks {
            tracing::info!(
                "per-inode locks: this node keeps at most {} cached (the lock area holds {} for all nodes)",
                il.limit(),
                il.object_locks().capacity()
            );
        }
        let mut cl = cluster::Cluster::new(locks, me, timing, opts.file_locks, ilocks);
        cl.keep_idle = opts.idle_locks == super::IdleLocks::Keep;
        let granted = take_global_shared(&cl, me, &member, timing)?;
        // Once more under the lock, which a grow holds exclusively: none runs from here on
        // until this node follows it like every other (fs/grow.rs).
        let sb = match super::grow::newest(&*dev, &sb) {
            Ok(Some(grown)) => {
                cl.locks.set_group_count(grown.group_count);
                grown
            }
            Ok(None) => sb,
            Err(e) => {
                let _ = cl.locks.release_global(me);
                return Err(e);
            }
        };
        let loaded = Allocator::new(dev.clone(), &sb, opts.bitmap_cache_bytes);
        let alloc = match loaded {
            Ok(a) => a,
            Err(e) => {
                let _ = cl.locks.release_global(me);
                return Err(e);
            }
        };
        let mut meta = Meta::new(alloc, journal, sb.clone(), opts.meta_cache_bytes);
        meta.joined(member.slot, granted.version);
        // A failed metadata path fences the node at once (`Meta::fail`).
        let fencer = member.clone();
        meta.on_failure(Box::new(move |why| fencer.fence(why.to_owned())));
        if sb.has_group_marks() {
            // Format 7: another node's group is used under its mark only (fs/group_marks.rs).
            let gate = super::group_marks::MarkGate::new(cl.locks.clone(), me, timing.dead_time());
            // Format 8: groups nobody owns too (a node may claim one without the global lock).
            meta.groups()
                .set_gate(Arc::new(gate), sb.has_group_claims());
        }
        let emptied = meta.emptied_counter();
        let vol = Arc::new(Volume {
            dev,
            sb,
            read_only,
            member,
            cl,
            meta: Mutex::new(meta),
            inflight_done: Condvar::new(),
            to_map: Mutex::new(super::data::MapQueue::default()),
            inodes: InodeTable::new(opts.inode_cache_bytes),
            unmounted: AtomicBool::new(false),
            granule_blocks: (opts.alloc_granule / FS_BLOCK)
                .clamp(1, crate::fs::MAX_ALLOC_GRANULE / FS_BLOCK),
            watchdog: std::sync::OnceLock::new(),
            pr: opts.reservations.clone(),
            detached: super::detached::Detached::new(emptied),
            closer: super::closer::Closer::default(),
            keep_slot: opts.claimed.is_some(),
            defrag_progress: super::defrag::Progress::default(),
        });
        if let Err(e) = vol.start(opts, &recovered) {
            vol.unmounted.store(true, Ordering::SeqCst);
            let mut meta = vol.lock_meta();
            let _ = vol.leave_cluster(&mut meta);
            return Err(e);
        }
        tracing::info!(
            "mounted CetraFS {} label {:?} as node slot {}: {} groups of {} MiB, {} MiB free{}",
            vol.sb.uuid_string(),
            vol.sb.label,
            vol.member.slot,
            vol.sb.group_count,
            (vol.sb.group_blocks * FS_BLOCK) >> 20,
            (vol.lock_meta().free_blocks() * FS_BLOCK) >> 20,
            if read_only { ", read-only" } else { "" }
        );
        Ok(vol)
    }

    /// Step 8: the background threads, the root check, the recoveries' last steps and the
    /// orphans of our own slot.
    fn start(self: &Arc<Self>, opts: &MountOptions, recovered: &[Claimed]) -> Result<()> {
        self.note_mounted(&mut self.lock_meta());
        Self::spawn_keeper(self);
        if !self.read_only {
            Self::spawn_closer(self);
        }
        if !self.read_only && !opts.commit_interval.is_zero() {
            Self::spawn_committer(self, opts.commit_interval);
        }
        if let Some(rate) = opts.discard_rate.filter(|_| !self.read_only) {
            self.lock_meta().enable_discard();
            if rate > 0 {
                Self::spawn_discarder(self, rate);
            }
        }
        // Make sure the root is readable now rather than on the first lookup.
        let root = self.sb.root_ino;
        {
            let mut meta = self.meta_sh()?;
            let mut tx = Tx::new(&*self.dev, &mut meta);
            let st = self
                .state(&mut tx, root)
                .map_err(|e| e.wrap("root directory"))?;
            if !st.read().inode.is_dir() {
                return Err(Error::new(
                    ErrorKind::Corrupted,
                    format!("root inode {root} is not a directory; run fsck.cetra"),
                ));
            }
        }
        if !self.read_only {
            for c in recovered {
                self.finish_recovery(c, std::time::Duration::ZERO)?;
            }
            self.free_orphans(self.member.slot)
                .map_err(|e| e.wrap("freeing inodes left open-unlinked by a crash"))?;
        }
        Self::spawn_watcher(self);
        Self::spawn_mailbox(self);
        Self::spawn_reporter(self);
        self.start_watchdog(opts)
    }

    /// Step 9, last (nothing may fail after it: a watchdog left without its magic close resets
    /// the host): open the watchdog `watchdog=` names and start petting it while the lease is
    /// valid (`cluster/watchdog.rs`). Read-only mounts write nothing and take none.
    fn start_watchdog(&self, opts: &MountOptions) -> Result<()> {
        use crate::cluster::watchdog::{self, Watchdog};
        if self.read_only {
            return Ok(());
        }
        // `auto` only where a host reset protects anyone: a volume other machines share
        // through SCSI COMPARE AND WRITE. On a single-host volume every node is on this host
        // (a reset would take them all down, and nobody else takes over), and a test or demo
        // on a file LUN never arms the host's watchdog-mux.
        let shared = self.dev.geometry().caw == crate::dev::CawKind::Scsi;
        let Some(wd) = Watchdog::open(&opts.watchdog.for_volume(shared))? else {
            tracing::info!(
                "no host watchdog (watchdog=none, or auto on a single-host volume or without \
                 watchdog-mux at {}): a node that loses its lease fences itself in software only",
                watchdog::MUX_SOCKET
            );
            return Ok(());
        };
        // The others wait for the reset before they recover this node (Heartbeat::dead_time),
        // on a format-4 volume, whose every node knows the field. On an older one a node of an
        // older release would not wait.
        if self.sb.format_version() >= 4 {
            self.member.advertise_watchdog(wd.fires_within());
        } else {
            tracing::warn!(
                "{}: this format-{} volume's heartbeats do not advertise the watchdog, so the \
                 others may recover this node before its host is reset when the volume's dead \
                 time is shorter than the fail time + {} s",
                wd.describe(),
                self.sb.format_version(),
                wd.fires_within().as_secs()
            );
        }
        let member = self.member.clone();
        if let Err(e) = wd.spawn(
            Box::new(move || member.lease_valid()),
            opts.mountpoint.clone(),
        ) {
            wd.close_clean();
            return Err(e);
        }
        tracing::info!(
            "host watchdog: {}, petted while this node's lease is valid; once it is not, the \
             processes using {} are stopped, then the watchdog; the heartbeat advertises the \
             reset {} s after the lease, so the others wait for it before recovering this node",
            wd.describe(),
            opts.mountpoint
                .as_deref()
                .map_or_else(|| "the mount".to_string(), |p| p.display().to_string()),
            wd.fires_within().as_secs()
        );
        let _ = self.watchdog.set(wd);
        Ok(())
    }
}

/// Step 1: the superblock, the logical block size it was made for, and whether its features
/// allow writing. Returns the superblock and whether the mount is read-only.
fn check_device(dev: &dyn BlockDevice, opts: &MountOptions) -> Result<(Superblock, bool)> {
    let sb = read_superblock(dev)?;
    let lbs = dev.geometry().logical_block_size;
    if sb.logical_block_size != lbs {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "the volume was created for {}-byte logical blocks but the device has {lbs}-byte blocks",
                sb.logical_block_size
            ),
        ));
    }
    let ro_only = sb.check_features()?;
    check_path_sharing(&sb, dev.geometry().caw)?;
    Ok((sb, opts.read_only || ro_only))
}

/// Step 1b: the sharing mode mkfs recorded (format 4) against what this path can do. A
/// multi-node volume is refused through a path whose COMPARE AND WRITE is not executed by a
/// SCSI target (`dev/open.rs` decides that per path: a regular file, loop, NBD, a copy of the
/// LUN...): its locks would not be atomic with the other nodes'. A volume of format 1 to 3
/// does not record its mode and mounts as before, with a warning.
fn check_path_sharing(sb: &Superblock, caw: CawKind) -> Result<()> {
    match sb.sharing {
        None => tracing::warn!(
            "format version {} volume: it does not record its sharing mode (format 4 does), so a mount from a second machine is not refused; if it lives on a device without SCSI COMPARE AND WRITE (regular file, NBD, RBD, NVMe...), mount it from one machine at a time",
            sb.format_version()
        ),
        Some(SharingMode::MultiNode) if caw != CawKind::Scsi => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "this is a multi-node volume (made on a SCSI LUN with COMPARE AND WRITE), but this path has no SCSI COMPARE AND WRITE (a regular file, a loop, NBD or NVMe device, or a copy of the LUN): its heartbeats and locks would not be atomic with the other nodes'; mount it through the LUN itself, /dev/sdX or its dm-multipath map (docs/san.md)",
            ));
        }
        Some(mode) => tracing::info!("sharing mode recorded by mkfs.cetra: {mode}"),
    }
    Ok(())
}

/// Step 2's findings: the slots silent for their dead time.
struct Others {
    dead: Vec<SlotView>,
}

impl Others {
    /// Who else holds the volume? Live nodes are welcome (the disk locks coordinate); a second
    /// daemon of this node is not; slots silent for their dead time are recovered later.
    fn find(
        dev: &dyn BlockDevice,
        sb: &Superblock,
        opts: &MountOptions,
        machine: MachineId,
        read_only: bool,
    ) -> Result<Others> {
        let (alive, mut dead) =
            membership::find_holders(dev, sb, &opts.host, membership::Patience::Dead)?;
        if sb.sharing == Some(SharingMode::SingleHost) {
            Self::refuse_other_machines(dev, sb, machine, &alive, &mut dead)?;
        }
        if let Some(a) = alive
            .iter()
            .find(|a| a.record.as_ref().is_some_and(|h| h.host == opts.host))
        {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("{} already has this volume mounted: a second daemon with the same node identity is refused", membership::describe(a)),
            ));
        }
        if read_only {
            for d in &dead {
                if journal::find_tx(dev, JournalArea::for_slot(sb, d.slot))?.is_some() {
                    return Err(Error::new(
                        ErrorKind::ReadOnly,
                        format!("{} died with a journal that needs replay, which writes to the volume; mount read-write once", membership::describe(d)),
                    ));
                }
            }
        }
        Ok(Others { dead })
    }

    /// Step 2b, single-host volumes: their COMPARE AND WRITE is emulated with locks of one
    /// machine, so a node of another machine must not be mounted at the same time. Every
    /// live-state slot of another machine (or of no recorded machine) that `find_holders` did
    /// not find dead is watched for its dead time: alive, the mount is refused, naming who
    /// holds the volume; silent for its dead time, it is dead and recovered by this mount like
    /// any dead slot. Runs before the claim: a refused mount writes nothing.
    fn refuse_other_machines(
        dev: &dyn BlockDevice,
        sb: &Superblock,
        machine: MachineId,
        alive: &[SlotView],
        dead: &mut Vec<SlotView>,
    ) -> Result<()> {
        let foreign = |v: &SlotView| {
            v.slot < sb.max_nodes
                && v.record
                    .as_ref()
                    .is_some_and(|h| h.state == SlotState::Live && h.machine != machine)
        };
        let views = membership::scan(dev, sb)?;
        let unsettled: Vec<SlotView> = views
            .iter()
            .filter(|v| foreign(v) && !dead.iter().any(|d| d.slot == v.slot && d.raw == v.raw))
            .cloned()
            .collect();
        if unsettled.is_empty() {
            return Ok(());
        }
        let proven_alive = alive.iter().any(foreign)
            || {
                tracing::info!(
                "single-host volume: watching {} node slot(s) of other machines to tell whether they are alive",
                unsettled.len()
            );
                // Stops at the first that changes; one that turns Free was unmounted meanwhile.
                let (now_alive, now_dead) = membership::observe(dev, sb, &unsettled, None)?;
                dead.extend(now_dead);
                !now_alive.is_empty()
            };
        if !proven_alive {
            return Ok(());
        }
        let holders: Vec<String> = unsettled
            .iter()
            .filter(|v| !dead.iter().any(|d| d.slot == v.slot))
            .map(|v| {
                let m = v.record.as_ref().map_or(MachineId::UNKNOWN, |h| h.machine);
                format!("{} on machine {m}", membership::describe(v))
            })
            .collect();
        Err(Error::new(
            ErrorKind::Busy,
            format!(
                "this single-host volume is mounted on another machine: {} (this machine is {machine}). It was made on a device without SCSI COMPARE AND WRITE, so its heartbeats and locks are atomic only within one machine, and two machines mounting it at once would corrupt it. Unmount it there first; to share a volume between machines, make it with mkfs.cetra on a SCSI LUN that supports COMPARE AND WRITE (docs/san.md)",
                holders.join(", ")
            ),
        ))
    }

    /// Step 3: claim a slot. A dead slot of this node's own identity is taken back, and so
    /// is any dead slot when no slot is free; recovering it (journal, locks, orphans) is then
    /// this mount's job.
    fn claim_slot(
        &self,
        dev: &SharedDevice,
        sb: &Superblock,
        opts: &MountOptions,
        machine: MachineId,
    ) -> Result<Arc<Membership>> {
        let free_slot = membership::scan(&**dev, sb)?
            .iter()
            .any(|v| v.slot < sb.max_nodes && v.is_free());
        let prefer = self
            .dead
            .iter()
            .filter(|d| {
                d.record
                    .as_ref()
                    .is_some_and(|h| h.state == SlotState::Live)
            })
            .find(|d| d.record.as_ref().is_some_and(|h| h.host == opts.host))
            .or_else(|| self.dead.first().filter(|_| !free_slot))
            .map(|d| d.slot);
        let member = Membership::claim(dev.clone(), sb, &opts.host, machine, prefer)?;
        // fsck.cetra repairing the volume holds a slot of its own: checked after our claim,
        // as fsck checks for us after its claim (`cluster/fsck_claim.rs`).
        let fsck = membership::scan(&**dev, sb)
            .map(|views| crate::cluster::fsck_claim::running(&views, member.slot, &self.dead));
        match fsck {
            Ok(None) => {}
            Ok(Some(tool)) => {
                let _ = member.release();
                return Err(crate::cluster::fsck_claim::refusal(&tool));
            }
            Err(e) => {
                let _ = member.release();
                return Err(e);
            }
        }
        member.set_caw_renewal(opts.caw_renewal);
        Ok(member)
    }
}

/// Step 4: replay our slot's journal — for a slot taken back, the dead incarnation's — before
/// any lock naming the slot is released. Read-only: refuse if it needs replay.
fn replay_own_journal(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    area: JournalArea,
    read_only: bool,
) -> Result<()> {
    if read_only {
        if journal::find_tx(dev, area)?.is_some() {
            return Err(Error::new(ErrorKind::ReadOnly, "the journal needs replay, which writes to the volume; mount read-write once (or run fsck.cetra)"));
        }
        return Ok(());
    }
    journal::replay(dev, sb, area).map_err(|e| e.wrap("journal replay"))?;
    Ok(())
}

/// Step 5: nothing of ours is held yet, so every lock naming this slot is stale (our own
/// previous incarnation taken back, or a leftover of an earlier owner). Corrupted lock records
/// are reset only if no other node can hold a lock: every other slot is free, beyond
/// `max_nodes`, or one of the dead found in step 2, unchanged. A corrupted record 0 fails the
/// mount when not alone; others stay unusable with a warning.
fn repair_locks(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    locks: &LockTable,
    member: &Membership,
    dead: &[SlotView],
) -> Result<Repaired> {
    let me = Me {
        slot: member.slot,
        gen: member.generation(),
    };
    locks.scrub_slot(member.slot)?;
    let alone = || -> Result<bool> {
        Ok(membership::scan(dev, sb)?.iter().all(|v| {
            v.slot == member.slot
                || v.slot >= sb.max_nodes
                || v.is_free()
                || dead.iter().any(|d| d.slot == v.slot && d.raw == v.raw)
        }))
    };
    let (reset, left) = locks.repair_corrupt(me, &alone)?;
    if let Some((_, why)) = left.iter().find(|(i, _)| *i == LockTable::GLOBAL) {
        return Err(Error::new(
            ErrorKind::Corrupted,
            format!("lock record 0 (the cluster's metadata lock) is corrupted ({why}) while other nodes may be mounted; it is reset by the first mount that finds no other node alive (unmount the others); run fsck.cetra"),
        ));
    }
    for (i, why) in &left {
        tracing::warn!("lock record {i} is corrupted ({why}) and other nodes are mounted: it stays unusable until a mount finds no other node alive; run fsck.cetra");
    }
    Ok((reset, left))
}

/// Step 6: claim (Recovering), replay and release every dead slot found in step 2 (skipped if
/// another node claimed it first), then take over recoveries left half-done by a recoverer
/// that is gone (perhaps one of the dead just recovered). Their last steps run in
/// [`Volume::start`].
fn recover_dead(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    locks: &LockTable,
    objects: Option<&ObjectLocks>,
    pr: Option<&Reservations>,
    me: Me,
    dead: &[SlotView],
) -> Result<Vec<Claimed>> {
    let mut recovered = Vec::new();
    for d in dead.iter().filter(|d| d.slot != me.slot) {
        if let Some(c) = recovery::claim_and_release(dev, sb, locks, objects, pr, d, me)? {
            recovered.push(c);
        }
    }
    let views = membership::scan(dev, sb)?;
    for v in views
        .iter()
        .filter(|v| recovery::claim_is_stale(v, &views, me))
    {
        if let Some(c) = recovery::claim_and_release(dev, sb, locks, objects, pr, v, me)? {
            recovered.push(c);
        }
    }
    Ok(recovered)
}

/// Step 7: the global lock shared, at a known version, to load the allocator under. Bounded:
/// a holder that neither releases nor dies (or a dead one that only a read-write node can
/// recover) must not hang the mount.
fn take_global_shared(
    cl: &cluster::Cluster,
    me: Me,
    member: &Membership,
    timing: Timing,
) -> Result<LockRecord> {
    let waited = std::time::Instant::now();
    let patience = timing.dead_time() * 3;
    cl.locks
        .acquire_global(me, LockMode::Shared, timing.io_timeout * 2, &|| {
            if !member.lease_valid() {
                return Some(Error::new(
                    ErrorKind::Fenced,
                    "the heartbeat lease expired while mounting",
                ));
            }
            (waited.elapsed() > patience).then(|| {
                Error::new(
                    ErrorKind::Busy,
                    format!(
                        "waited {} s for the cluster's metadata lock; the node holding it does not give it up (a dead holder is released once a read-write node recovers it); retry",
                        patience.as_secs()
                    ),
                )
            })
        })
}

/// How often a waiter for a lock re-reads its record on a v3 volume: from 1 ms, doubling to 2.
const WAIT_POLL_FIRST: std::time::Duration = std::time::Duration::from_millis(1);
const WAIT_POLL_MAX: std::time::Duration = std::time::Duration::from_millis(2);

/// Step 5b (v3 volumes): the per-object lock area and the mailboxes, as the superblock places
/// them; None on a v2 volume (whose data path depends on the global lock).
fn open_object_locks(dev: &SharedDevice, sb: &Superblock) -> Result<Option<ObjectLocks>> {
    let Some(area) = sb.object_lock_area() else {
        tracing::warn!(
            "format version {} volume: no per-object locks, so every node's VM I/O pauses while another node changes metadata, and stops while a node that died holding the metadata lock is recovered; per-inode locks need format 3 (a volume made by this mkfs.cetra; there is no in-place upgrade yet: make a new volume and move the images to it)",
            sb.format_version()
        );
        return Ok(None);
    };
    let timing = Timing::from_ms(sb.heartbeat_interval_ms, sb.io_timeout_ms);
    // A waiter re-reads the bucket at most every 2 ms: a handoff (the holder's next mailbox
    // poll, then its release CAW) is noticed within 2 ms instead of up to 8.
    Ok(Some(
        ObjectLocks::new(dev.clone(), area, timing.io_timeout * 2)?
            .with_backoff(WAIT_POLL_FIRST, WAIT_POLL_MAX)
            .with_io_patience(timing.fail_time()),
    ))
}
