//! A read-only snapshot of a volume's cluster state, for `cetra status` (issue 11): who is
//! mounted, how fresh each heartbeat is, who holds which lock, who owns which allocation
//! group, which journals hold a transaction, which recoveries run.
//!
//! Nothing here writes. It reads what any node could read of the shared LUN — the
//! superblock, the heartbeat slots, the lock area, the object-lock buckets, the group
//! headers, the journals' slot headers and transactions — so it works on an unmounted LUN and
//! from any node while others have it mounted (the records are read once each, so on a live
//! volume the snapshot is as consistent as one pass over them can be: a lock may change hands
//! between two reads).
//!
//! **Heartbeat age on this machine's clock.** A heartbeat record carries a counter, not a time
//! (node clocks are never compared). [`gather`] therefore watches the slots for `watch`
//! (by default twice the longest renewal interval of the live slots): a slot whose record
//! changed has an age of the time since the last change this process saw; one that did not
//! change is *stalled* for at least the whole watch. A live slot stalled for the watch is
//! reported `dead` (it is not renewing, or a renewal is late by more than the watch: the watch
//! is never shorter than the default, and a longer one tells the two apart); the other nodes
//! recover it once it has been stalled for its dead time, and the slot then shows
//! `recovering` (with the recovering slot), then `free`. A block that does not decode during
//! the watch is taken for a read torn by a renewal in flight and skipped (the first read, by
//! `membership::scan`, re-reads it before calling the slot damaged).

use crate::alloc::Allocator;
use crate::cluster::lock::LockTable;
use crate::cluster::membership::{self, SlotView};
use crate::dev::{for_each_record, read_aligned, BlockDevice, SharedDevice};
use crate::error::Result;
use crate::format::heartbeat::SlotState;
use crate::format::lock_record::{LockMode, LockRecord, NO_SLOT};
use crate::format::object_lock::{Bucket, Role};
use crate::format::slot_header::SlotHeader;
use crate::format::superblock::Superblock;
use crate::journal::{self, JournalArea};
use std::time::{Duration, Instant};

/// What a slot is doing, as read and watched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    /// Never used, or released by an unmount.
    Free,
    /// Its heartbeat advanced during the watch.
    Alive,
    /// Its record says Live, but it did not change during the whole watch: the node is not
    /// renewing (stopped, hung, cut off from the LUN).
    Dead,
    /// A survivor is replaying its journal and releasing its locks.
    Recovering,
    /// The block does not decode as this volume's record for this slot.
    Damaged,
}

impl Condition {
    pub fn name(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Alive => "alive",
            Self::Dead => "dead",
            Self::Recovering => "recovering",
            Self::Damaged => "damaged",
        }
    }
}

/// Locks a slot holds or waits for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotLocks {
    /// The global lock: "exclusive", "shared", or None.
    pub global: Option<&'static str>,
    /// Waits for the global lock.
    pub global_waiting: bool,
    /// Object (inode) locks held exclusively / shared, and waited for.
    pub objects_exclusive: u64,
    pub objects_shared: u64,
    pub objects_waiting: u64,
    /// Allocation groups owned, and the free blocks in them (as their headers on the LUN say:
    /// an owner's changes since its last commit point are not counted).
    pub groups_owned: u64,
    pub groups_owned_free: u64,
    /// Files open (registered in the open buckets), and of those open for writing.
    pub files_open: u64,
    pub files_open_writing: u64,
}

/// One heartbeat slot.
#[derive(Clone, Debug)]
pub struct SlotStatus {
    pub slot: u32,
    pub condition: Condition,
    pub host: String,
    pub pid: u64,
    pub generation: u64,
    /// Time since this process saw the record change; None if it did not change during the
    /// watch (then it is at least [`VolumeStatus::watched`] old).
    pub heartbeat_age: Option<Duration>,
    pub interval_ms: u32,
    pub io_timeout_ms: u32,
    /// How long without a renewal before the others recover it.
    pub dead_time: Duration,
    /// How long after its lease ran out its host watchdog has certainly reset it (0: none).
    pub watchdog_ms: u32,
    /// For a recovering slot: the slot and generation doing the recovery.
    pub recoverer: Option<(u32, u64)>,
    /// Its journal holds a committed transaction not yet written home (normal for a live node
    /// holding the global lock exclusively; for a dead one, what its recovery replays).
    pub journal_pending: bool,
    /// Inodes on its orphan list (unlinked while open, freed at its last close or recovery).
    pub orphans: usize,
    pub locks: SlotLocks,
}

/// One allocation group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupStatus {
    pub group: u64,
    pub owner: Option<u32>,
    pub free_blocks: u64,
}

/// The whole snapshot.
#[derive(Clone, Debug)]
pub struct VolumeStatus {
    pub uuid: String,
    pub label: String,
    pub format_version: u32,
    pub sharing: Option<String>,
    pub total_blocks: u64,
    pub free_blocks: u64,
    pub max_nodes: u32,
    pub heartbeat_interval_ms: u32,
    pub io_timeout_ms: u32,
    /// How long the heartbeats were watched.
    pub watched: Duration,
    /// Every slot below `max_nodes` that was ever claimed (a released one is `free`, with the
    /// host that last had it), and any damaged slot.
    pub slots: Vec<SlotStatus>,
    pub groups: Vec<GroupStatus>,
    /// The global lock's mode and version.
    pub global_mode: &'static str,
    pub global_version: u64,
}

fn mode_name(m: LockMode) -> &'static str {
    match m {
        LockMode::Free => "free",
        LockMode::Shared => "shared",
        LockMode::Exclusive => "exclusive",
    }
}

/// The default watch: twice the longest renewal interval of the slots that look live (the
/// volume's own interval when none does), at least 200 ms.
pub fn default_watch(sb: &Superblock, views: &[SlotView]) -> Duration {
    let longest = views
        .iter()
        .filter_map(|v| v.record.as_ref())
        .filter(|h| h.state == SlotState::Live)
        .map(|h| h.interval_ms)
        .max()
        .unwrap_or(sb.heartbeat_interval_ms);
    Duration::from_millis(2 * u64::from(longest)).max(Duration::from_millis(200))
}

/// A slot as last read, and when this process last saw its record change (None: not during
/// the watch).
type Watched = (SlotView, Option<Instant>);

/// Read the heartbeat area and watch it for `watch` (None: [`default_watch`]); returns each
/// slot's view at the end and the instant its record last changed during the watch.
fn watch_slots(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    watch: Option<Duration>,
) -> Result<(Vec<Watched>, Duration)> {
    let first = membership::scan(dev, sb)?;
    // Never shorter than the default: a shorter watch would call live nodes dead.
    let watch = watch.map_or_else(
        || default_watch(sb, &first),
        |w| w.max(default_watch(sb, &first)),
    );
    let poll = Duration::from_millis(u64::from(sb.heartbeat_interval_ms / 4).clamp(5, 100));
    let start = Instant::now();
    let mut seen: Vec<Watched> = first.into_iter().map(|v| (v, None)).collect();
    while start.elapsed() < watch {
        std::thread::sleep(poll.min(watch.saturating_sub(start.elapsed())));
        for (v, changed) in &mut seen {
            let raw = membership::read_slot(dev, sb, v.slot)?;
            if raw == v.raw {
                continue;
            }
            // A block that does not decode may be torn by a renewal in flight: kept for the
            // next poll, as `membership::scan` re-reads it (only its first read decides).
            let Ok(record) = membership::decode_slot(&raw, sb, v.slot) else {
                continue;
            };
            *changed = Some(Instant::now());
            v.record = record;
            v.raw = raw;
        }
    }
    Ok((seen, start.elapsed()))
}

fn condition(v: &SlotView, changed: bool) -> Condition {
    match &v.record {
        None if v.is_damaged() => Condition::Damaged,
        None => Condition::Free,
        Some(h) => match h.state {
            SlotState::Free => Condition::Free,
            SlotState::Recovering => Condition::Recovering,
            SlotState::Live if changed => Condition::Alive,
            SlotState::Live => Condition::Dead,
        },
    }
}

/// Take the snapshot. `watch`: how long to watch the heartbeats (None, or anything shorter:
/// [`default_watch`]).
pub fn gather(dev: &SharedDevice, watch: Option<Duration>) -> Result<VolumeStatus> {
    let sb = crate::fs::read_superblock(&**dev)?;
    let (seen, watched) = watch_slots(&**dev, &sb, watch)?;
    let now = Instant::now();
    let lbs = dev.geometry().logical_block_size as usize;
    let slot_count = usize::try_from(sb.hb_slots).unwrap_or(0);
    let mut locks = vec![SlotLocks::default(); slot_count];
    let mut at = |s: u32| usize::try_from(s).ok().filter(|&s| s < slot_count);

    // The lock area: the global lock, the group records, the open buckets.
    let table = LockTable::new(dev.clone(), &sb);
    // A damaged record counts as unheld here (fsck.cetra -n names it).
    let records: Vec<Option<LockRecord>> = table
        .read_range_each(0, table.lock_count())?
        .into_iter()
        .map(std::result::Result::ok)
        .collect();
    let global = records.first().and_then(Option::as_ref);
    let mut global_mode = "free";
    let mut global_version = 0;
    if let Some(g) = global {
        global_mode = mode_name(g.mode);
        global_version = g.version;
        holders_of(g, &mut |s, mode| {
            if let Some(i) = at(s) {
                locks[i].global = Some(mode);
            }
        });
        for s in g.waiters.iter() {
            if let Some(i) = at(s) {
                locks[i].global_waiting = true;
            }
        }
    }
    // Free counts: every group header (what a mount reads), owners from the group records.
    let alloc = Allocator::new(dev.clone(), &sb, 1 << 20)?;
    let mut groups = Vec::new();
    for g in 0..sb.group_count {
        let rec = records
            .get(usize::try_from(table.group_index(g)).unwrap_or(usize::MAX))
            .and_then(Option::as_ref);
        let owner = rec.filter(|r| r.owner != NO_SLOT).map(|r| r.owner);
        let free_blocks = alloc.group_free(g).unwrap_or(0);
        if let Some(i) = owner.and_then(&mut at) {
            locks[i].groups_owned += 1;
            locks[i].groups_owned_free += free_blocks;
        }
        groups.push(GroupStatus {
            group: g,
            owner,
            free_blocks,
        });
    }
    let (first_bucket, buckets) = table.bucket_range();
    for r in records
        .iter()
        .skip(usize::try_from(first_bucket).unwrap_or(usize::MAX))
        .take(usize::try_from(buckets).unwrap_or(0))
        .flatten()
    {
        for e in &r.entries {
            if let Some(i) = at(e.slot) {
                locks[i].files_open += 1;
                locks[i].files_open_writing += u64::from(e.writer);
            }
        }
    }
    // Object locks (format v3).
    if let Some(area) = sb.object_lock_area() {
        for_each_record(
            &**dev,
            area.bucket_offset,
            area.buckets,
            lbs,
            &mut |index, block| {
                let Ok(bucket) = Bucket::decode(block, index) else {
                    return; // fsck reports it
                };
                for m in bucket.entries.iter().flat_map(|e| &e.mentions) {
                    if let Some(i) = at(m.slot) {
                        match m.role {
                            Role::Owner => locks[i].objects_exclusive += 1,
                            Role::Holder => locks[i].objects_shared += 1,
                            Role::WaitShared | Role::WaitExclusive => locks[i].objects_waiting += 1,
                        }
                    }
                }
            },
        )?;
    }

    let mut slots = Vec::new();
    for (v, changed) in seen {
        let cond = condition(&v, changed.is_some());
        // Never-used slots are left out; a released one shows the host that last had it.
        let listed = v.slot < sb.max_nodes || cond == Condition::Damaged;
        if (v.record.is_none() && cond == Condition::Free) || !listed {
            continue;
        }
        let area = JournalArea::for_slot(&sb, v.slot);
        let (journal_pending, orphans) = if v.slot < sb.max_nodes {
            let pending = journal::find_tx(&**dev, area)?.is_some();
            let header = read_aligned(
                &**dev,
                area.start * crate::format::FS_BLOCK,
                crate::format::FS_BLOCK_SIZE,
            )?;
            let orphans =
                SlotHeader::decode(&header, area.start, v.slot).map_or(0, |h| h.orphans.len());
            (pending, orphans)
        } else {
            (false, 0)
        };
        let h = v.record.as_ref();
        slots.push(SlotStatus {
            slot: v.slot,
            condition: cond,
            host: h.map(|h| h.host.clone()).unwrap_or_default(),
            pid: h.map_or(0, |h| h.pid),
            generation: h.map_or(0, |h| h.generation),
            heartbeat_age: changed.map(|t| now.saturating_duration_since(t)),
            interval_ms: h.map_or(sb.heartbeat_interval_ms, |h| h.interval_ms),
            io_timeout_ms: h.map_or(sb.io_timeout_ms, |h| h.io_timeout_ms),
            dead_time: h.map_or_else(
                || {
                    crate::cluster::timing::Timing::from_ms(
                        sb.heartbeat_interval_ms,
                        sb.io_timeout_ms,
                    )
                    .dead_time()
                },
                crate::format::heartbeat::Heartbeat::dead_time,
            ),
            watchdog_ms: h.map_or(0, |h| h.watchdog_ms),
            recoverer: h
                .filter(|h| h.state == SlotState::Recovering)
                .map(|h| (h.recoverer, h.recoverer_gen)),
            journal_pending,
            orphans,
            locks: at(v.slot).map(|i| locks[i].clone()).unwrap_or_default(),
        });
    }
    Ok(VolumeStatus {
        uuid: sb.uuid_string(),
        label: sb.label.clone(),
        format_version: sb.format_version(),
        sharing: sb.sharing.map(|m| m.to_string()),
        total_blocks: sb.total_blocks,
        free_blocks: alloc.free_blocks(),
        max_nodes: sb.max_nodes,
        heartbeat_interval_ms: sb.heartbeat_interval_ms,
        io_timeout_ms: sb.io_timeout_ms,
        watched,
        slots,
        groups,
        global_mode,
        global_version,
    })
}

/// Call `each(slot, mode)` for every holder of a global or group record.
fn holders_of(r: &LockRecord, each: &mut dyn FnMut(u32, &'static str)) {
    match r.mode {
        LockMode::Exclusive if r.owner != NO_SLOT => each(r.owner, "exclusive"),
        LockMode::Shared => {
            for s in r.holders.iter() {
                each(s, "shared");
            }
        }
        _ => {}
    }
}
