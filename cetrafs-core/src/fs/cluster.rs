//! The filesystem's side of the cluster: several nodes, one volume, no network.
//!
//! * **One global metadata lock** (lock record 0, see `cluster/lock.rs`), held *lazily*: a node
//!   that took it keeps it until another node registers as a waiter, so a node working alone
//!   pays no cluster I/O per operation. Metadata changes need it exclusive; metadata reads need
//!   it shared. Its version (bumped on every exclusive grant) validates every cache: if it moved
//!   since this node last held the lock, someone else changed metadata: the block cache is
//!   dropped, every loaded inode is reloaded before use, and each allocation group is checked
//!   against its header's change counter at its next use (alloc.rs).
//! * **Handoff**: before giving the lock up, the node commits its running transaction, writes
//!   it home, flushes, and empties its journal (so a later recovery never replays an image
//!   older than what the next holder writes — GFS2's journal-replay hazard).
//! * **Data path**: reads and writes inside written extents use the inode's cached map with no
//!   cluster I/O, but only while this node holds the global lock (shared is enough — with
//!   three nodes each busy with its own image, all three hold it shared at once). Giving the
//!   lock up bumps a local epoch and waits for in-flight data I/O (`data_gate`); an inode loaded
//!   at an older epoch takes the metadata path once, re-taking the lock and reloading. So no
//!   node ever writes through a block map another node has changed since.
//! * **Deletes** of a file another node has open are deferred: it stays on an orphan list and
//!   the last node to close it frees it.
//! * **Open registrations** (bucket records): every node registers the files it has open;
//!   writers exclude writers on other nodes unless the volume is mounted `nofilelock`.
//! * **Recovery**: a watcher thread judges other slots by the *change* of their heartbeat on
//!   this node's monotonic clock; a slot silent for its dead time is recovered (see
//!   `cluster/recovery.rs` and `docs/recovery.md`).

use super::inode_lock::{Held, InodeLocks};
use super::txn::{Meta, Tx};
use super::{InodeState, Volume};
use crate::alloc::GroupClass;
use crate::cluster::lock::{LockTable, Me};
use crate::cluster::mailbox::PollPacer;
use crate::cluster::membership::{self, SlotView};
use crate::cluster::object_lock::{ObjectId, VolumeLock};
use crate::cluster::recovery;
use crate::cluster::timing::Timing;
use crate::error::{Error, ErrorKind, Result};
use crate::format::heartbeat::SlotState;
use crate::format::lock_record::{LockMode, LockRecord, OpenEntry, NO_SLOT};
use crate::format::mailbox::{Request, Want};
use crate::sync::LockPolicy;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLockReadGuard};
use std::time::{Duration, Instant};

/// A live-looking node whose heartbeat has not changed for this many of its renewal intervals
/// is passed over when the global lock is handed on (`Cluster::silent`). Only the order of
/// the handoff follows it, never who may hold the lock: a node that is merely slow is passed
/// over while others wait until its heartbeat changes again (the next scan), and gets the
/// lock meanwhile when nobody else waits or the handoff grace runs out.
const SILENT_RENEWALS: u32 = 3;

/// How often the keeper looks at the global lock record (waiters, version) on a v2 volume.
const KEEPER_POLL: Duration = Duration::from_millis(10);
/// The same on a v3 volume, where waiters also post a request into the holder's mailbox
/// (polled at the mailbox's pace): the keeper's read is only a safety net for a lost request.
const KEEPER_POLL_V3: Duration = Duration::from_millis(500);
/// The mailbox poll during a lock exchange (for 1 s after a request sent or received): 5 ms,
/// 200 reads/s, 4 % of LUN time at 0.2 ms per read, only while nodes trade locks; idle the
/// poll is 40 ms (`PollPacer`'s default, 0.5 %).
const MAILBOX_BUSY_POLL: Duration = Duration::from_millis(5);
/// A waiter for the global lock re-posts its request to a holder at most this often.
const GLOBAL_ASK_EVERY: Duration = Duration::from_millis(50);
/// After handing the global lock over, the mailbox is read this often for [`FOLLOW_UP_SPAN`]:
/// the new holder's next step is mostly a request for an inode lock this node caches (the
/// inode it is about to change), which otherwise waited up to a whole [`MAILBOX_BUSY_POLL`].
/// Ten reads per global handoff.
const FOLLOW_UP_POLL: Duration = Duration::from_millis(1);
/// See [`FOLLOW_UP_POLL`].
const FOLLOW_UP_SPAN: Duration = Duration::from_millis(10);
/// What a mailbox tick did with requests for the global lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GlobalAsk {
    /// There were none.
    None,
    /// Not settled yet (the hold window runs, or the lock is in use): look again then.
    Pending(Duration),
    /// Handed over, or nothing to hand over: the requests were cleared.
    Settled,
}

/// A global-lock request that found the lock in use (an operation running, allocating writes
/// being mapped) is looked at again this soon.
const KEEPER_RETRY: Duration = Duration::from_millis(1);

/// The global lock's hold window: a node that waiters ask for the lock hands it over once it
/// has not used it for [`HOLD_IDLE`], or once it has held it for [`HOLD_COST_FACTOR`] times
/// what its last handoff cost (the commit point, emptied journal and release on its side),
/// but at least [`HOLD_MIN`] and at most [`HOLD_MAX`] — GFS2's glock minimum hold time, made
/// to follow the handoff's cost so that a busy node spends at most about a fifth of its time
/// handing the lock over. Without it, nodes that all change metadata all the time (thin
/// images growing on each, creates in one directory) paid a handoff per operation: three
/// nodes creating in one directory got 124 ops/s together, a twentieth of one node alone. A
/// waiter waits at most the window plus the handoff itself; a node that used the lock once
/// and went idle (one `touch`) hands it over after `HOLD_IDLE`, which the mailbox's 5 ms
/// poll mostly hides.
const HOLD_IDLE: Duration = Duration::from_millis(3);
/// See [`HOLD_IDLE`].
const HOLD_MIN: Duration = Duration::from_millis(100);
/// See [`HOLD_IDLE`].
const HOLD_MAX: Duration = Duration::from_secs(1);
/// See [`HOLD_IDLE`].
const HOLD_COST_FACTOR: u32 = 4;
/// On a v3 volume a node gives the global lock back once it has not used it for this long,
/// even if nobody asks: unlike an inode lock (which blocks only its own object while a dead
/// holder waits for recovery), a global hold left with a node that dies stalls every metadata
/// change that still needs it, on every node, for the whole dead time (84 s by default). A node
/// mostly idle on the global lock (its images written through inode locks and the pool) then
/// holds it only around its operations. Cost: one acquire (a read and a CAW) for its next
/// operation after a second's pause, and the release's commit point, at most once a second.
const GLOBAL_IDLE_RELEASE: Duration = Duration::from_secs(1);

/// When this node took the global lock and last used it (nanoseconds since `base`), and
/// what its last handoff cost, for the hold window ([`HOLD_IDLE`]).
#[derive(Debug)]
struct HoldWindow {
    base: Instant,
    since: AtomicU64,
    used: AtomicU64,
    cost: AtomicU64,
}

impl HoldWindow {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            since: AtomicU64::new(0),
            used: AtomicU64::new(0),
            cost: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The lock was just taken.
    fn taken(&self) {
        self.taken_at(self.now());
    }

    fn taken_at(&self, t: u64) {
        self.since.store(t, Ordering::Release);
        self.used.store(t, Ordering::Release);
    }

    /// The last use's stamp ([`HoldWindow::unuse`]).
    fn stamp(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// The uses since `prior` (the last of which left stamp `own`) do not count: unless
    /// another use came after them.
    fn unuse(&self, own: u64, prior: u64) {
        let _ = self
            .used
            .compare_exchange(own, prior, Ordering::AcqRel, Ordering::Acquire);
    }

    /// A metadata operation is about to use the lock.
    fn used(&self) {
        self.used.store(self.now(), Ordering::Release);
    }

    /// How long since the lock was last used (or taken).
    fn idle(&self) -> Duration {
        self.idle_at(self.now())
    }

    /// [`HoldWindow::idle`] at time `t` (nanoseconds since `base`).
    fn idle_at(&self, t: u64) -> Duration {
        Duration::from_nanos(t.saturating_sub(self.used.load(Ordering::Acquire)))
    }

    /// How long the lock has been held since it was taken.
    fn held(&self) -> Duration {
        Duration::from_nanos(
            self.now()
                .saturating_sub(self.since.load(Ordering::Acquire)),
        )
    }

    /// A handoff took `cost`.
    fn handed_over(&self, cost: Duration) {
        let ns = u64::try_from(cost.as_nanos()).unwrap_or(u64::MAX);
        self.cost.store(ns, Ordering::Release);
    }

    /// How long a busy node keeps the lock while others wait.
    fn window(&self) -> Duration {
        (Duration::from_nanos(self.cost.load(Ordering::Acquire)) * HOLD_COST_FACTOR)
            .clamp(HOLD_MIN, HOLD_MAX)
    }

    /// May the lock be handed over now? `in_flight`: allocating writes are between their plan
    /// and map steps (their device I/O may well take longer than [`HOLD_IDLE`]): the node is
    /// busy, not idle.
    fn over(&self, in_flight: bool) -> bool {
        self.over_at(self.now(), in_flight)
    }

    /// [`HoldWindow::over`] at time `t` (nanoseconds since `base`).
    fn over_at(&self, t: u64, in_flight: bool) -> bool {
        self.left_at(t, in_flight).is_zero()
    }

    /// How long until [`HoldWindow::over`] becomes true if the lock is not used meanwhile
    /// (zero: it is over now). A request that arrives 1 ms after the last use is served 2 ms
    /// later, not at the next mailbox poll.
    fn left(&self, in_flight: bool) -> Duration {
        self.left_at(self.now(), in_flight)
    }

    /// [`HoldWindow::left`] at time `t` (nanoseconds since `base`).
    fn left_at(&self, t: u64, in_flight: bool) -> Duration {
        let held = Duration::from_nanos(t.saturating_sub(self.since.load(Ordering::Acquire)));
        let idle = self.idle_at(t);
        let busy_left = self.window().saturating_sub(held);
        if in_flight {
            busy_left
        } else {
            busy_left.min(HOLD_IDLE.saturating_sub(idle))
        }
    }
}

/// One fast-path I/O's admission ([`Volume::admit`]): the inode's read lock and the gate
/// that a lock handoff drains (the global data gate on v2, the inode's own on v3).
pub(super) struct Admitted<'a> {
    pub inner: RwLockReadGuard<'a, super::InodeInner>,
    _gate: RwLockReadGuard<'a, ()>,
}

/// This node's cluster state, shared by the filesystem threads.
#[derive(Debug)]
pub(crate) struct Cluster {
    pub locks: Arc<LockTable>,
    pub me: Me,
    pub timing: Timing,
    pub file_locks: bool,
    /// Mirror of `Meta::gml` for threads that do not hold the metadata mutex.
    held: AtomicU8,
    /// Latest version of the global lock seen by this node.
    seen_version: AtomicU64,
    /// Bumped whenever another node may have changed metadata: inodes loaded at an older
    /// epoch are reloaded before use.
    pub epoch: AtomicU64,
    /// Another node waits for the global lock: the next metadata operation hands it over
    /// (once the hold window is over).
    handoff_wanted: AtomicBool,
    /// The global lock's hold window ([`HOLD_IDLE`], [`HOLD_MAX`]).
    hold: HoldWindow,
    /// When this node last asked each slot for the global lock (v3, `ask_global_holders`).
    global_asked: Mutex<HashMap<u32, Instant>>,
    /// One thread of this node at a time waits for the global lock, without the metadata
    /// mutex (`Volume::meta_in`).
    acquiring: Mutex<()>,
    /// Slots whose recovery's last steps run on a thread of their own (`Volume::watch_tick`).
    finishing: Mutex<std::collections::HashSet<u32>>,
    /// Fast-path data I/O holds this shared; giving up the global lock takes it exclusively
    /// (after bumping the epoch) so that no I/O through a soon-stale block map is in flight.
    pub data_gate: std::sync::RwLock<()>,
    /// Every slot's state and generation at the last heartbeat scan: an open registration
    /// whose (slot, generation) is no longer in use is stale.
    live: Mutex<HashMap<u32, (SlotState, u64)>>,
    /// Live-looking slots whose heartbeat has not changed for [`SILENT_RENEWALS`] of their
    /// intervals, as of the watcher's last scan: a handoff of the global lock passes over
    /// them (a node that died waiting for it would make the others wait out the handoff
    /// grace at every release until its dead time is up and it is recovered).
    silent: Mutex<std::collections::HashSet<u32>>,
    /// When a thread of this node waiting for the global lock last found it held only by
    /// silent slots (perhaps dead, until their recovery): for [`STALL_VERDICT_FOR`] after,
    /// reads that can be answered from objects this node's own inode locks validate stop
    /// waiting (`fs/own_lock_reads.rs`). None once a round found a holder that is not silent,
    /// and at every grant.
    global_stalled: Mutex<Option<Instant>>,
    /// Per-inode locks for the data path (format v3 volumes; None on v2: the data path then
    /// depends on the global lock). See `fs/inode_lock.rs`.
    pub ilocks: Option<InodeLocks>,
    /// `MountOptions::idle_locks` is `Keep`: no lock goes back only because it is idle.
    pub keep_idle: bool,
    /// When this node last read which group records, and whether the next grant must read
    /// them all (`GroupReads`).
    group_reads: Mutex<GroupReads>,
}

/// How long a wait's finding that every holder of the global lock is silent stands without
/// another look at the lock's record: reads that arrive meanwhile (a listing's entries, one
/// by one) stop waiting at once, and the first after it reads the record again.
const STALL_VERDICT_FOR: Duration = Duration::from_millis(100);

/// How old this node's copy of its own groups' records (requests for them, a give-back by
/// its recoverer) may grow before a grant of the global lock after another node's changes
/// reads them again (`Volume::invalidate`). A directory that nodes share changes hands many
/// times a second.
const OWN_GROUP_RECORDS_EVERY: Duration = Duration::from_secs(1);

/// What a read of every group record (`group_count` logical blocks: 4 MiB for 8 TiB at
/// 512-byte blocks, 32 MiB on a 4Kn LUN) may cost on average: such a read comes at most
/// once per `max(1 s, its size / this rate)` (2 s for 8 TiB at 512-byte blocks, 16 s on a
/// 4Kn LUN), and only when statfs or a node short of space needs other nodes' groups.
const ALL_GROUP_RECORDS_BYTES_PER_SEC: u64 = 2 << 20;

/// Which group records `Volume::read_group_records` reads.
#[derive(Debug, Clone, Copy)]
pub(super) enum GroupRecords {
    /// At a grant of the global lock after another node's changes: this node's own
    /// groups', if due (every record on format 7, or after a group CAW failed).
    AtGrant,
    /// Every record, if due (statfs, a node short of space); nothing goes back (only a
    /// grant that dropped this node's reservation windows may give a group back).
    All,
    /// Every record now (mount, a grow, tests); nothing goes back.
    AllNow,
}

/// Which group records this node read when (owners, published free counts, requests for its
/// groups). A grant of the global lock reads only this node's own groups' records, at most
/// once per [`OWN_GROUP_RECORDS_EVERY`] for each of the two kinds of grant (an exclusive one
/// may give a group back, so shared grants do not postpone it). Every record is read at
/// mount and a grow, by statfs and by a node short of space at most once per
/// [`GroupReads::all_every`], and after a CAW on a group record failed (it may have landed:
/// whose the group is is then unknown here) by the next of those reads or of the grants
/// after another node's changes, whatever the time. A read without the global lock (a
/// format-8 refill short of groups) takes the owners only, and does not count as a read of
/// the counts: statfs still reads them when due. A group this node gave back is not
/// claimed by it again for [`GroupReads::given_back_for`], so that the node that asked for
/// it gets it.
#[derive(Debug, Default)]
struct GroupReads {
    own: [Option<Instant>; 2],
    all: Option<Instant>,
    /// The last read of every record without the global lock: owners only, no counts.
    lockless: Option<Instant>,
    all_wanted: bool,
    given_back: HashMap<u64, Instant>,
    /// The last read of every record's count without the metadata mutex (statfs,
    /// `Volume::refresh_group_counts`): counts only, no owners.
    counts: Option<Instant>,
    /// Such a read is under way.
    reading: bool,
}

/// The least time a group this node gave back stays out of its own claims
/// ([`GroupReads::given_back_for`]).
const GIVEN_BACK_FOR: Duration = Duration::from_secs(30);

impl GroupReads {
    /// How often every record may be read, for records of `bytes` in all.
    fn all_every(bytes: u64) -> Duration {
        Duration::from_secs((bytes / ALL_GROUP_RECORDS_BYTES_PER_SEC).max(1))
    }

    fn own_due(&self, exclusive: bool) -> bool {
        self.all_wanted
            || self.own[usize::from(exclusive)]
                .is_none_or(|t| t.elapsed() >= OWN_GROUP_RECORDS_EVERY)
    }

    /// Is a read of every record due? `counts`: one that takes the published counts (under
    /// the global lock), which a read without it does not stand in for.
    fn all_due(&self, bytes: u64, counts: bool) -> bool {
        let last = if counts {
            self.all
        } else {
            self.all.max(self.lockless)
        };
        self.all_wanted || last.is_none_or(|t| t.elapsed() >= Self::all_every(bytes))
    }

    /// Is a read of every record's count due for statfs? Reads under the mutex that took
    /// the counts stand in for one.
    fn counts_due(&self, bytes: u64) -> bool {
        self.all
            .max(self.counts)
            .is_none_or(|t| t.elapsed() >= Self::all_every(bytes))
    }

    /// How long a group this node gave back stays out of its own claims: the node that
    /// asked claims it at its next exclusive grant once it read every record, up to
    /// [`Self::all_every`] later, so twice that and at least [`GIVEN_BACK_FOR`]. Before, an
    /// owner short of space itself gave the group back and claimed it again at once (the
    /// emptiest unowned group), for as long as the other node asked.
    fn given_back_for(bytes: u64) -> Duration {
        GIVEN_BACK_FOR.max(2 * Self::all_every(bytes))
    }

    /// Group `g` went back to the node that asked for it.
    fn gave_back(&mut self, g: u64, bytes: u64) {
        let keep = Self::given_back_for(bytes);
        self.given_back.retain(|_, t| t.elapsed() < keep);
        self.given_back.insert(g, Instant::now());
    }

    /// Was group `g` given back by this node lately?
    fn gave_back_lately(&self, g: u64, bytes: u64) -> bool {
        self.given_back
            .get(&g)
            .is_some_and(|t| t.elapsed() < Self::given_back_for(bytes))
    }

    /// Own records were read at a grant (`exclusive`: one that may give groups back); `all`:
    /// every record was; without `counts` (no global lock) only the owners were taken, which
    /// stands in for no read under the lock.
    fn read(&mut self, exclusive: bool, all: bool, counts: bool) {
        let now = Some(Instant::now());
        if !counts {
            self.lockless = now;
            self.all_wanted = false;
            return;
        }
        self.own[0] = now;
        if exclusive {
            self.own[1] = now;
        }
        if all {
            self.all = now;
            self.all_wanted = false;
        }
    }
}

fn mode_code(m: LockMode) -> u8 {
    match m {
        LockMode::Free => 0,
        LockMode::Shared => 1,
        LockMode::Exclusive => 2,
    }
}

fn covers(held: LockMode, want: LockMode) -> bool {
    mode_code(held) >= mode_code(want)
}

impl Cluster {
    pub fn new(
        locks: LockTable,
        me: Me,
        timing: Timing,
        file_locks: bool,
        ilocks: Option<InodeLocks>,
    ) -> Self {
        Self {
            ilocks,
            locks: Arc::new(locks),
            me,
            timing,
            file_locks,
            held: AtomicU8::new(0),
            seen_version: AtomicU64::new(0),
            epoch: AtomicU64::new(1),
            handoff_wanted: AtomicBool::new(false),
            hold: HoldWindow::new(),
            global_asked: Mutex::new(HashMap::new()),
            acquiring: Mutex::new(()),
            finishing: Mutex::new(std::collections::HashSet::new()),
            data_gate: std::sync::RwLock::new(()),
            live: Mutex::new(HashMap::new()),
            silent: Mutex::new(std::collections::HashSet::new()),
            global_stalled: Mutex::new(None),
            keep_idle: false,
            group_reads: Mutex::new(GroupReads::default()),
        }
    }

    /// How long a handoff target may sit on the lock record before others ignore it.
    fn handoff_grace(&self) -> Duration {
        self.timing.io_timeout * 2
    }

    pub fn set_live(&self, views: &[SlotView]) {
        let live = views
            .iter()
            .filter_map(|v| v.record.as_ref().map(|h| (v.slot, (h.state, h.generation))))
            .collect();
        *self.live.lock().or_panic() = live;
    }

    /// Is `slot`'s heartbeat silent (see `silent`), as of the watcher's last scan?
    fn slot_silent(&self, slot: u32) -> bool {
        self.silent.lock().or_panic().contains(&slot)
    }

    /// Give up the global lock, handing it to the next waiter that is not silent.
    fn release_global(&self) -> Result<()> {
        self.locks
            .release_global_passing(self.me, &|s| self.slot_silent(s))
    }

    /// Note whether the global lock as `rec` shows it is held only by silent slots (see
    /// `global_stalled`).
    fn note_global_holders(&self, rec: &LockRecord) {
        let holders = self.holders_but_me(rec);
        let stalled = !holders.is_empty() && holders.iter().all(|&s| self.slot_silent(s));
        *self.global_stalled.lock().or_panic() = stalled.then(Instant::now);
    }

    /// The slots other than this node's that hold the global lock as `rec` shows it: what a
    /// wait for it waits for.
    fn holders_but_me(&self, rec: &LockRecord) -> Vec<u32> {
        let mut holders = match rec.mode {
            LockMode::Exclusive => vec![rec.owner],
            LockMode::Shared => rec.holders.iter().collect(),
            LockMode::Free => Vec::new(),
        };
        holders.retain(|&s| s != self.me.slot);
        holders
    }

    /// Did a wait for the global lock find it held only by silent slots less than
    /// [`STALL_VERDICT_FOR`] ago?
    fn global_stalled(&self) -> bool {
        self.global_stalled
            .lock()
            .or_panic()
            .is_some_and(|t| t.elapsed() < STALL_VERDICT_FOR)
    }

    /// Does a node other than this one, and not silent, wait for the global lock in `rec`?
    /// (A silent waiter is no reason to hand over: the lock would go round through Free, a
    /// commit point each time, until its recovery.)
    fn others_waiting(&self, rec: &LockRecord) -> bool {
        rec.waiters
            .iter()
            .any(|s| s != self.me.slot && !self.slot_silent(s))
    }

    /// Is `slot` held by a live node, as of the last heartbeat scan?
    fn slot_live(&self, slot: u32) -> bool {
        self.live
            .lock()
            .or_panic()
            .get(&slot)
            .is_some_and(|&(state, _)| state == SlotState::Live)
    }

    /// Is this registration held by a node that is still (or not yet recovered as) alive?
    /// A slot this node has not seen yet counts as alive: refusing is the safe mistake.
    fn entry_live(&self, e: &OpenEntry) -> bool {
        self.live
            .lock()
            .or_panic()
            .get(&e.slot)
            .is_none_or(|&(state, g)| state != SlotState::Free && g == e.slot_gen)
    }
}

impl Volume {
    /// This node used the global lock (for its hold window) without going through
    /// [`Volume::meta_in`]: the map step of an allocating write.
    pub(super) fn note_lock_use(&self) {
        self.cl.hold.used();
    }

    /// Does this node hold the global lock exclusively now (without asking the mutex)?
    pub(super) fn holds_global_exclusive(&self) -> bool {
        self.cl.held.load(Ordering::Acquire) == mode_code(LockMode::Exclusive)
    }

    /// The metadata mutex with the global lock held exclusively (metadata changes).
    pub(super) fn meta_ex(&self) -> Result<MutexGuard<'_, Meta>> {
        self.meta_in(LockMode::Exclusive)
    }

    /// The metadata mutex with the global lock held at least shared (metadata reads).
    pub(super) fn meta_sh(&self) -> Result<MutexGuard<'_, Meta>> {
        self.meta_in(LockMode::Shared)
    }

    /// Stop waiting for an inode lock: fenced, or unmounted (nobody would release it).
    pub(super) fn lock_abort(&self) -> Option<Error> {
        if self.unmounted.load(Ordering::Acquire) {
            return Some(Error::new(ErrorKind::Io, "volume is unmounted"));
        }
        self.abort_if_fenced()
    }

    fn abort_if_fenced(&self) -> Option<Error> {
        if self.member.lease_valid() {
            return None;
        }
        Some(Error::new(
            ErrorKind::Fenced,
            format!(
                "this node is fenced ({}); unmount and mount again",
                self.member
                    .fence_reason()
                    .unwrap_or_else(|| "heartbeat lease expired".into())
            ),
        ))
    }

    fn meta_in(&self, mode: LockMode) -> Result<MutexGuard<'_, Meta>> {
        self.meta_in_unless_stalled(mode, false)?.ok_or_else(|| {
            Error::new(
                ErrorKind::Io,
                "a wait for the global lock that may not stop stopped",
            )
        })
    }

    /// The metadata mutex with the global lock held in `mode` (at least), or None instead of
    /// waiting on once every holder of the global lock is silent: for work that can be done
    /// otherwise meanwhile (`fs/own_lock_reads.rs`, `fs/closer.rs`).
    pub(super) fn meta_unless_stalled(
        &self,
        mode: LockMode,
    ) -> Result<Option<MutexGuard<'_, Meta>>> {
        self.meta_in_unless_stalled(mode, true)
    }

    fn meta_in_unless_stalled(
        &self,
        mode: LockMode,
        may_stop: bool,
    ) -> Result<Option<MutexGuard<'_, Meta>>> {
        let (m, held) = self.meta_held(self.lock_meta(), mode)?;
        if held {
            return Ok(Some(m));
        }
        drop(m);
        // Wait for the global lock **without the metadata mutex**, one thread of this node at
        // a time: what needs no global lock (allocating writes of files this node owns, pool
        // refills from its marked groups, changes in directories it owns, inode lock handoffs
        // asked by other nodes) goes on meanwhile, also while the node waits for a dead
        // node's recovery. A thread that finds the lock taken by another thread of this node
        // while it waited for its turn uses that grant.
        let Some(turn) = self.acquiring_turn(may_stop) else {
            return Ok(None);
        };
        let (mut m, held) = self.meta_held(self.lock_meta(), mode)?;
        if held {
            return Ok(Some(m));
        }
        if let Some(e) = self.abort_if_fenced() {
            return Err(e);
        }
        // A recent finding stands (a listing's reads, one per entry, would each join the
        // waiters and leave them again).
        if may_stop && self.cl.global_stalled() {
            return Ok(None);
        }
        if m.gml() == LockMode::Shared {
            // Never wait for an upgrade while holding shared: two upgraders would wait for
            // each other. Shared holders have nothing to write back.
            self.cl.release_global()?;
            m.set_gml(LockMode::Free);
            self.cl.held.store(0, Ordering::Release);
        }
        drop(m);
        let Some(rec) = self.wait_for_global(mode, may_stop)? else {
            return Ok(None);
        };
        let mut m = self.lock_meta();
        if self.unmounted.load(Ordering::Acquire) {
            // The unmount gave the locks back while this thread waited: nobody would release
            // this grant.
            let _ = self.cl.release_global();
            bail!(Io, "volume is unmounted");
        }
        self.install_grant(&mut m, mode, &rec)?;
        drop(turn);
        Ok(Some(m))
    }

    /// This node's acquiring turn (one thread at a time waits for the global lock). With
    /// `may_stop`, None once the thread waiting meanwhile found the lock held only by silent
    /// slots (`global_stalled`).
    fn acquiring_turn(&self, may_stop: bool) -> Option<MutexGuard<'_, ()>> {
        if !may_stop {
            return Some(self.cl.acquiring.lock().or_panic());
        }
        loop {
            if self.cl.global_stalled() {
                return None;
            }
            match self.cl.acquiring.try_lock() {
                Ok(turn) => return Some(turn),
                Err(std::sync::TryLockError::WouldBlock) => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(std::sync::TryLockError::Poisoned(e)) => {
                    panic!("the global lock's acquiring turn is poisoned: {e}")
                }
            }
        }
    }

    /// The first part of [`Volume::meta_in`], under the metadata mutex: hand the lock over if
    /// another node waits and the hold window is over; true if this node holds the global
    /// lock in (at least) `mode` now.
    fn meta_held<'a>(
        &'a self,
        mut m: MutexGuard<'a, Meta>,
        mode: LockMode,
    ) -> Result<(MutexGuard<'a, Meta>, bool)> {
        // A background thread (a recovery's last steps, the committer) that reaches here after
        // unmount gave the locks back must not take them again: nobody would release them.
        if self.unmounted.load(Ordering::Acquire) {
            bail!(Io, "volume is unmounted");
        }
        let cl = &self.cl;
        if cl.handoff_wanted.load(Ordering::Acquire)
            && m.gml() != LockMode::Free
            && cl.hold.over(m.inflight().holds_bitmap_blocks())
        {
            // Allocating writes in flight hold blocks only this node knows of: they are mapped
            // first (fs/inflight.rs). Meanwhile another thread may have handed over already.
            m = self.drained_of_bitmap_blocks(m);
            if cl.handoff_wanted.load(Ordering::Acquire) && m.gml() != LockMode::Free {
                self.handoff(&mut m)?;
            }
        }
        if covers(m.gml(), mode) {
            cl.hold.used();
            self.catch_up_geometry(&mut m)?;
            return Ok((m, true));
        }
        Ok((m, false))
    }

    /// Wait until this node holds the global lock in `mode` (the caller has this node's
    /// acquiring turn and not the metadata mutex). Returns the record as granted.
    /// With `may_stop`, None once every holder is silent (`global_stalled`): the wait is
    /// given up (this node leaves the waiters).
    fn wait_for_global(&self, mode: LockMode, may_stop: bool) -> Result<Option<LockRecord>> {
        let cl = &self.cl;
        // Each acquire asks the holders at once; only its own re-posts are rate-limited. (A
        // limit across acquires held back every other request of two nodes trading the lock
        // every 25 ms until the 50 ms were up: handoffs of 20-40 ms instead of 5.)
        cl.global_asked.lock().or_panic().clear();
        let stopped = std::cell::Cell::new(false);
        let r = cl.locks.acquire_global_notify(
            cl.me,
            mode,
            cl.handoff_grace(),
            &|s| cl.slot_silent(s),
            &|| {
                // The lock server asks whoever holds the metadata mutex to do this node's part
                // of an inode handoff (fs/detached.rs rule 4); if nobody does, do it here.
                if let Some(mut m) = self.meta.try_lock().or_panic() {
                    self.serve_duties(&mut m);
                }
                if may_stop && cl.global_stalled() {
                    stopped.set(true);
                    return Some(Error::new(
                        ErrorKind::Busy,
                        "the global lock's holders are silent",
                    ));
                }
                self.lock_abort()
            },
            &|rec| {
                cl.note_global_holders(rec);
                self.ask_global_holders(rec, mode);
            },
        );
        match r {
            Err(_) if stopped.get() => Ok(None),
            Err(e) => Err(e),
            Ok(rec) => {
                *cl.global_stalled.lock().or_panic() = None;
                Ok(Some(rec))
            }
        }
    }

    /// The global lock was granted in `mode` (`rec`): the metadata state follows it.
    fn install_grant(&self, m: &mut Meta, mode: LockMode, rec: &LockRecord) -> Result<()> {
        let cl = &self.cl;
        let expected = if mode == LockMode::Exclusive {
            m.gml_version() + 1
        } else {
            m.gml_version()
        };
        m.set_gml(mode);
        cl.held.store(mode_code(mode), Ordering::Release);
        cl.hold.taken();
        if rec.version != expected {
            self.invalidate(m);
        }
        m.set_gml_version(rec.version);
        cl.seen_version.store(rec.version, Ordering::Release);
        // A grow (fs/grow.rs) is adopted before anything is read under this grant.
        self.follow_geometry(m, rec)?;
        if mode == LockMode::Exclusive && !self.read_only {
            self.ensure_groups(m);
        }
        Ok(())
    }

    /// Waiting for the global lock on a v3 volume: post a request into the mailbox of each
    /// node that holds it (at most every [`GLOBAL_ASK_EVERY`] per holder, while it still
    /// blocks us), so that it hands over at its next mailbox poll instead of its keeper's.
    fn ask_global_holders(&self, rec: &LockRecord, mode: LockMode) {
        let Some(il) = &self.cl.ilocks else { return };
        let me = self.cl.me;
        let holders = self.cl.holders_but_me(rec);
        let req = Request {
            object: ObjectId::volume(VolumeLock::Global).raw(),
            slot: me.slot,
            gen: me.gen,
            want: if mode == LockMode::Exclusive {
                Want::Exclusive
            } else {
                Want::Shared
            },
        };
        let mut asked = self.cl.global_asked.lock().or_panic();
        for slot in holders {
            if asked
                .get(&slot)
                .is_some_and(|t| t.elapsed() < GLOBAL_ASK_EVERY)
            {
                continue;
            }
            asked.insert(slot, Instant::now());
            if let Err(e) = il.object_locks().mailboxes().post(slot, req) {
                tracing::debug!("could not ask slot {slot} for the global lock: {e}");
            }
        }
    }

    /// Mount: the global lock is held shared at `m.gml_version()`; learn the group owners.
    pub(super) fn note_mounted(&self, m: &mut Meta) {
        self.cl.held.store(mode_code(m.gml()), Ordering::Release);
        self.cl
            .seen_version
            .store(m.gml_version(), Ordering::Release);
        self.read_group_records(m, GroupRecords::AllNow);
        match membership::scan(&*self.dev, &self.sb) {
            Ok(views) => self.cl.set_live(&views),
            Err(e) => tracing::warn!("reading the heartbeat area failed: {e}"),
        }
    }

    /// Another node changed metadata since this node last held the lock: drop every cached
    /// block, mark every allocation group unchecked (each is revalidated by its header's
    /// change counter at its next use, alloc.rs), re-read this node's own groups' records
    /// if that is due (`GroupReads`), and make loaded inodes stale.
    fn invalidate(&self, m: &mut Meta) {
        m.drop_cache();
        m.groups().invalidate();
        // At a grant: everything this node changed before is home (its last handoff emptied
        // the journal), so a group asked for may go back.
        self.read_group_records(m, GroupRecords::AtGrant);
        self.cl.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Read the group records `which` asks for, if they are due. What a grant reads: only
    /// this node's own groups', since a class or count of another node's group that is old
    /// only steers placement — every group this node does not own is used under its mark
    /// (format 8: an unowned one too, so one that another node claimed meanwhile is never
    /// changed under the other's refill) or, without marks, only under the global lock, and
    /// an allocation that finds no space checks every group's header before it fails
    /// (alloc.rs). Format 7 marks only other nodes' groups, and a group claimed by another
    /// node's global hold since would be taken for an unowned one: a grant there reads every
    /// record. A request for one of this node's groups waits up to
    /// [`OWN_GROUP_RECORDS_EVERY`] longer for its give-back, and statfs shows other nodes'
    /// published counts as this node last read them ([`GroupReads::all_every`] at most).
    pub(super) fn read_group_records(&self, m: &mut Meta, which: GroupRecords) {
        let exclusive = m.gml() == LockMode::Exclusive;
        // Without the global lock (a format-8 refill) this node's check of its groups dates
        // from its last hold, and others may have changed them since: a published count
        // taken as seen now, but not applied (the group counts as checked), would be
        // ignored at the next grant, which makes it unchecked. Counts wait for a read under
        // the lock; the classes are enough to claim.
        let counts = m.gml() != LockMode::Free;
        let bytes = self.cl.locks.group_record_bytes();
        let (all, give_back) = {
            let reads = self.cl.group_reads.lock().or_panic();
            match which {
                GroupRecords::AtGrant
                    if self.sb.has_group_marks() && !self.sb.has_group_claims() =>
                {
                    (true, true)
                }
                GroupRecords::AtGrant if reads.all_wanted => (true, true),
                GroupRecords::AtGrant if reads.own_due(exclusive) => (false, true),
                GroupRecords::All if reads.all_due(bytes, counts) => (true, false),
                GroupRecords::AllNow => (true, false),
                _ => return,
            }
        };
        let read = if all {
            self.cl
                .locks
                .group_records()
                .map(|r| (0..).zip(r).collect())
        } else {
            self.cl.locks.group_records_of(&m.groups().mine())
        };
        let records: Vec<(u64, LockRecord)> = match read {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("reading allocation group records failed: {e}");
                if all && self.sb.has_group_marks() {
                    // Another node may own a group this node thinks nobody owns (claimed
                    // since): every group not this node's needs a mark until the next read.
                    for g in 0..self.cl.locks.group_count() {
                        if m.groups().class(g) == Some(GroupClass::Unowned) {
                            m.groups().set_class(g, GroupClass::Others);
                        }
                    }
                }
                return;
            }
        };
        self.cl
            .group_reads
            .lock()
            .or_panic()
            .read(give_back && exclusive, all, counts);
        for (g, rec) in records {
            self.take_group_record(m, g, &rec, give_back, counts);
        }
    }

    /// statfs: every group's published free count, read **without the metadata mutex** when
    /// due ([`GroupReads::counts_due`]), so that neither this node's allocating writes nor
    /// the other nodes' requests for the global lock (which this node hands over under its
    /// mutex) wait for the read: 4 MiB at 8 TiB, 256 MiB for 64 TiB on a 4Kn LUN. Only the
    /// counts are taken, under the mutex again: whose a group is stays as this node knows it
    /// (a format-8 refill may claim one while the read runs, which a record read before
    /// would undo). A count is taken only for a group whose published count this node has
    /// not seen change since the read began (a read under the mutex meanwhile, or its own
    /// publishing): what the read found is then the newest this node has. A CAW on a group
    /// record that failed (`all_wanted`) makes it a read of everything under the mutex, as
    /// before, since only that settles whose the group is. One such read per node at a time:
    /// a statfs meanwhile answers from what the node knows.
    pub(super) fn refresh_group_counts(&self) -> Result<()> {
        let bytes = self.cl.locks.group_record_bytes();
        let due =
            |reads: &GroupReads| reads.all_wanted || (!reads.reading && reads.counts_due(bytes));
        // Mostly not due: statfs then takes the metadata mutex once, not twice.
        if !due(&self.cl.group_reads.lock().or_panic()) {
            return Ok(());
        }
        let seen = {
            let mut m = self.meta_sh()?;
            let mut reads = self.cl.group_reads.lock().or_panic();
            if reads.all_wanted {
                drop(reads);
                self.read_group_records(&mut m, GroupRecords::All);
                return Ok(());
            }
            // Asked again under the mutex: another statfs may have read meanwhile.
            if !due(&reads) {
                return Ok(());
            }
            reads.reading = true;
            m.groups().lvbs_seen()
        };
        let read = self.cl.locks.group_records();
        let m = self.meta_sh();
        let mut reads = self.cl.group_reads.lock().or_panic();
        reads.reading = false;
        let mut m = m?;
        // A failed read waits for the next one due, as a read of the counts.
        reads.counts = Some(Instant::now());
        drop(reads);
        match read {
            Ok(records) => {
                for ((g, rec), before) in (0..).zip(records).zip(seen) {
                    m.groups().note_lvb_unless_seen(g, before, rec.group_free());
                }
            }
            Err(e) => tracing::warn!("reading allocation group records failed: {e}"),
        }
        Ok(())
    }

    /// Learn from group `g`'s record who owns it and the free count published for it; with
    /// `give_back` (only at a grant of the global lock, exclusive: nothing of this node's is
    /// pending then, and no reservation is left), give the group back if it is ours and a
    /// node short of space asked for it (its free count goes into the value block on the
    /// way). Mid-hold a group given back could be claimed by another node (format 8) while
    /// this node's changes there are not home yet. `counts`: take the published count too.
    fn take_group_record(
        &self,
        m: &mut Meta,
        g: u64,
        rec: &LockRecord,
        give_back: bool,
        counts: bool,
    ) {
        let me = self.cl.me;
        if counts {
            m.groups().note_lvb(g, rec.group_free());
        }
        let mut class = if rec.mode == LockMode::Free || rec.owner == NO_SLOT {
            GroupClass::Unowned
        } else if rec.owner == me.slot {
            GroupClass::Mine
        } else {
            GroupClass::Others
        };
        // Only a node that is still mounted counts (a waiter bit outlives a clean unmount).
        let asked = rec
            .waiters
            .iter()
            .any(|s| s != me.slot && self.cl.slot_live(s));
        if class == GroupClass::Mine
            && give_back
            && asked
            && !self.read_only
            && m.gml() == LockMode::Exclusive
        {
            let released = m
                .groups()
                .exact_free(g)
                .and_then(|free| self.cl.locks.release_group(g, me, free).map(|()| free));
            match released {
                Ok(free) => {
                    m.groups().note_published(g, free);
                    tracing::info!(
                        "gave allocation group {g} back: another node is short of space"
                    );
                    let bytes = self.cl.locks.group_record_bytes();
                    self.cl.group_reads.lock().or_panic().gave_back(g, bytes);
                    class = GroupClass::Unowned;
                }
                Err(e) => {
                    // The CAW may have landed: then the group is Free on disk, and
                    // another node may claim it (format 8). Used again only under a
                    // mark until the next read of every record says whose it is.
                    tracing::warn!("giving allocation group {g} back failed: {e}");
                    self.group_record_unknown();
                    class = GroupClass::Unowned;
                }
            }
        }
        m.groups().set_class(g, class);
    }

    /// Groups this node may claim, the most free blocks first: unowned as far as it knows,
    /// with free blocks, and not given back by it lately (`GroupReads::given_back_for`).
    pub(super) fn claimable_groups(&self, m: &mut Meta) -> Vec<(u64, u64)> {
        let reads = self.cl.group_reads.lock().or_panic();
        let mut v = m.groups().unowned_by_free();
        let bytes = self.cl.locks.group_record_bytes();
        v.retain(|&(g, _)| !reads.gave_back_lately(g, bytes));
        v
    }

    /// A CAW on a group record failed and may have landed: whose the group is is unknown
    /// here until the next read of every record, which the next grant after another node's
    /// changes, statfs or a refill short of groups makes whatever the time.
    pub(super) fn group_record_unknown(&self) {
        self.cl.group_reads.lock().or_panic().all_wanted = true;
    }

    /// Keep a group's worth of free space in groups this node owns: claim the emptiest
    /// unowned group when short. Failure only costs locality (allocation falls back to
    /// unowned and then other nodes' groups, which the global lock still makes safe).
    fn ensure_groups(&self, m: &mut Meta) {
        if m.groups().free_in_mine() >= self.sb.group_blocks / 4 {
            return;
        }
        // Which groups are free now: a grant reads only this node's own records. Nothing
        // goes back here: a grant whose version did not move kept this node's reservation
        // windows, which a group given back must not hold.
        self.read_group_records(m, GroupRecords::All);
        for _ in 0..3 {
            // The emptiest; of equals, the last (away from the metadata at the start).
            let claimable = self.claimable_groups(m);
            let best = claimable
                .iter()
                .max_by_key(|&&(_, free)| free)
                .map(|&(g, _)| g);
            let mut groups = m.groups();
            let Some(g) = best else {
                // None left: ask the owner of the emptiest other group to give it back; until
                // then allocation borrows from other nodes' groups (safe under this lock).
                let wanted = (0..self.cl.locks.group_count())
                    .filter(|&g| groups.class(g) == Some(GroupClass::Others))
                    .max_by_key(|&g| groups.group_free(g).unwrap_or(0));
                if let Some(g) = wanted {
                    if let Err(e) = self.cl.locks.want_group(g, self.cl.me) {
                        tracing::warn!("asking for allocation group {g} failed: {e}");
                    }
                }
                return;
            };
            match self.cl.locks.claim_group(g, self.cl.me) {
                Ok(true) => {
                    groups.set_class(g, GroupClass::Mine);
                    tracing::debug!("took allocation group {g}");
                    return;
                }
                Ok(false) => groups.set_class(g, GroupClass::Others),
                Err(e) => {
                    tracing::warn!("claiming allocation group {g} failed: {e}");
                    self.group_record_unknown();
                    return;
                }
            }
        }
    }

    /// Publish the free counts of the groups this node changed during its hold into the group
    /// locks' value blocks: the next holders take them for groups they have not checked yet
    /// (statfs), and an admin tool can read every group's state without the global lock.
    fn publish_groups(&self, m: &mut Meta) {
        for (g, free) in m.groups().take_changed() {
            match self.cl.locks.publish_group_free(g, free) {
                Ok(()) => m.groups().note_published(g, free),
                Err(e) => tracing::warn!("publishing the free count of group {g} failed: {e}"),
            }
        }
    }

    /// Give the global lock to whoever waits: everything this node changed is made durable
    /// and home, and its journal emptied, first.
    pub(super) fn handoff(&self, m: &mut Meta) -> Result<()> {
        let start = Instant::now();
        if m.gml() == LockMode::Exclusive {
            self.give_idle_pool(m);
            // A failure fences the node (`Meta::fail`): what is on disk is unknown, so the
            // others recover it (replaying its journal) instead of waiting for a lock it
            // cannot give.
            m.close(&*self.dev)?;
            self.publish_groups(m);
            self.unmark_groups(m);
            self.give_back_global_dirs();
        }
        let held = self.cl.hold.held();
        self.release_gml(m)?;
        let cost = start.elapsed();
        self.cl.hold.handed_over(cost);
        tracing::debug!(
            "global lock handed over after holding it {} ms (handoff {} ms; next window {} ms)",
            held.as_millis(),
            cost.as_millis(),
            self.cl.hold.window().as_millis()
        );
        Ok(())
    }

    /// At a handoff of the global lock, everything home: give back the exclusive holds of
    /// contended directories changed under it (`fs/detached_ns.rs`), so that the next holder
    /// reads and takes them with no request to this node. A failure only leaves one held (the
    /// next node asks for it as usual).
    fn give_back_global_dirs(&self) {
        let Some(il) = &self.cl.ilocks else { return };
        for d in self.detached.take_global_dirs() {
            if let Err(e) = il.give_back_exclusive(d) {
                tracing::debug!("giving back the lock of directory {d} failed: {e}");
            }
        }
    }

    fn release_gml(&self, m: &mut Meta) -> Result<()> {
        debug_assert!(
            !m.inflight().holds_bitmap_blocks(),
            "giving up the global lock with bitmap blocks held by writes in flight"
        );
        // Everything loaded under this hold is stale from now on; wait out fast-path I/O that
        // started before (v2: the data path depends on this lock; v3: on each inode's own).
        self.cl.epoch.fetch_add(1, Ordering::AcqRel);
        if self.cl.ilocks.is_none() {
            drop(self.cl.data_gate.write().or_panic());
        }
        self.cl.release_global()?;
        m.set_gml(LockMode::Free);
        self.cl.held.store(0, Ordering::Release);
        self.cl.handoff_wanted.store(false, Ordering::Release);
        Ok(())
    }

    /// At unmount: give back the global lock and the allocation groups.
    pub(super) fn leave_cluster(&self, m: &mut Meta) -> Result<()> {
        if !self.read_only {
            // Everything is home: this node's marks go (whatever its hold). If one cannot be
            // taken off, the slot must not be freed: its recoverer takes it off instead (a
            // free slot is never recovered).
            self.unmark_groups(m);
            if m.groups().has_marks_to_take_off() {
                bail!(
                    Io,
                    "taking this node's marks off allocation groups failed (see the warnings above); its slot is left for another node to recover, which takes them off"
                );
            }
        }
        if !self.read_only && m.gml() == LockMode::Exclusive {
            self.publish_groups(m);
            // Every group whose record names this node, whatever its class says: a claim
            // whose CAW landed but reported an error left it Unowned here, and other groups'
            // records are read only now and then (`GroupReads`).
            let mut owned: Vec<u64> = (0..self.cl.locks.group_count())
                .filter(|&g| m.groups().class(g) == Some(GroupClass::Mine))
                .collect();
            match self.cl.locks.group_records() {
                Ok(recs) => {
                    for (g, r) in (0u64..).zip(recs) {
                        let names_me = r.mode == LockMode::Exclusive
                            && r.owner == self.cl.me.slot
                            && r.owner_gen == self.cl.me.gen;
                        if names_me && !owned.contains(&g) {
                            owned.push(g);
                        }
                    }
                }
                Err(e) => tracing::warn!("reading allocation group owners failed: {e}"),
            }
            for g in owned {
                let released = m
                    .groups()
                    .exact_free(g)
                    .and_then(|free| self.cl.locks.release_group(g, self.cl.me, free));
                if let Err(e) = released {
                    tracing::warn!("releasing allocation group {g} failed: {e}");
                }
            }
        }
        if let Some(il) = &self.cl.ilocks {
            // Everything they protect is home (the commit above). If they cannot be given
            // back, the caller must not free the slot: the others recover it instead.
            il.release_all()
                .map_err(|e| e.wrap("giving back this node's inode locks"))?;
        }
        if m.gml() != LockMode::Free {
            self.release_gml(m)?;
        }
        Ok(())
    }

    /// Admission of one fast-path I/O on `st`: while the returned guards live, its cached
    /// block map may be used without the metadata mutex. On a v2 volume that needs the global
    /// lock (the data gate, with the inode current at this node's epoch): a stale inode is
    /// reloaded under the lock when `wait`, else None ("take the metadata path"). On a v3
    /// volume it needs the inode's own lock (`fs/inode_lock.rs`), taken and validated here with
    /// no lock held; then the inode's read lock is taken **before** its gate, so a fast path
    /// that holds a gate never waits for the inode's write lock (a metadata operation holding
    /// it may be waiting for the handoff that drains that gate).
    pub(super) fn admit<'a>(
        &'a self,
        st: &'a InodeState,
        wait: bool,
    ) -> Result<Option<Admitted<'a>>> {
        if let Some(il) = &self.cl.ilocks {
            let dl = st.data_lock(il);
            loop {
                if !il.is_ready(dl) {
                    il.share(st.ino, &|| self.lock_abort(), &|| self.reload(st))?;
                }
                let inner = st.read();
                if let Some(gate) = il.fast(dl) {
                    return Ok(Some(Admitted { inner, _gate: gate }));
                }
            }
        }
        loop {
            let gate = self.cl.data_gate.read().or_panic();
            if self.is_current(st) {
                return Ok(Some(Admitted {
                    inner: st.read(),
                    _gate: gate,
                }));
            }
            drop(gate);
            if !wait {
                return Ok(None);
            }
            let mut meta = self.meta_sh()?;
            self.refresh(&mut Tx::new(&*self.dev, &mut meta), st)?;
        }
    }

    /// [`Volume::admit`] without waiting for anything: None when the inode's lock must first
    /// be taken or its cache validated, a handoff or a metadata change of the inode is under
    /// way (its gate or its write lock is held or wanted), or (v2) the inode is not current.
    /// A thread may hold several of these at once (a batch of requests: `read_batch`), which
    /// a waiting admission must not do.
    pub(super) fn admit_now<'a>(&'a self, st: &'a InodeState) -> Option<Admitted<'a>> {
        if let Some(il) = &self.cl.ilocks {
            let dl = st.data_lock(il);
            if !il.is_ready(dl) {
                return None;
            }
            let inner = st.try_read()?;
            let gate = il.try_fast(dl)?;
            return Some(Admitted { inner, _gate: gate });
        }
        let gate = self.cl.data_gate.try_read().ok()?;
        if !self.is_current(st) {
            return None;
        }
        Some(Admitted {
            inner: st.try_read()?,
            _gate: gate,
        })
    }

    /// Reload `st` from disk under the global lock (shared), whatever its epoch.
    fn reload(&self, st: &InodeState) -> Result<()> {
        let mut meta = self.meta_sh()?;
        st.epoch.store(0, Ordering::Release);
        self.refresh(&mut Tx::new(&*self.dev, &mut meta), st)
    }

    /// Before inode `ino`'s block changes (caller: the global lock exclusive, the inode's
    /// write lock): on a v3 volume, hold its inode lock exclusively (`fs/inode_lock.rs` rule 1).
    /// A fresh inode (`fs/detached_ns.rs`) changed so is fresh no more: from now on it may be
    /// renamed or linked elsewhere, and its lock is taken like any other's.
    /// A parked one (unlinked while open, its block the pool's on disk) goes on the orphan list
    /// in `tx` instead, under the global lock.
    ///
    /// A change its caller can start again (`Volume::restartable_op`) that has changed
    /// nothing yet stops waiting after a moment, as a read does (`fs/detached.rs` rule 3):
    /// another node's hold — perhaps a dead node's shared one, until its recovery — then
    /// keeps only this inode waiting, not the global lock and this node's metadata mutex.
    pub(super) fn own_inode(&self, tx: &mut Tx<'_>, ino: u64) -> Result<()> {
        self.detached.forget_fresh(ino);
        if self.detached.take_parked(ino) {
            tx.unpark_from_pool(ino);
            tx.add_orphan(ino)?;
        }
        let Some(il) = &self.cl.ilocks else {
            return Ok(());
        };
        let since = std::time::Instant::now();
        let tx = std::cell::RefCell::new(tx);
        il.own(ino, &|| {
            // (Not the node's duties, as a load's wait serves them: the caller holds this
            // inode's write lock, which mapping its detached writes would take.)
            tx.try_borrow_mut()
                .ok()
                .and_then(|mut t| t.stop_waiting(ino, since, true))
                .or_else(|| self.lock_abort())
        })
    }

    /// A change on the global path, before it changes anything: own the directories `dirs`
    /// and the other inodes `files` that it will change ([`Volume::own_inode`], rule 1; the
    /// caller holds their write locks), in the lock order of docs/locking.md §15 (directories
    /// by ascending number, then the others), so that a wait for another node's hold — a dead
    /// node that listed the directory a moment before it died holds it until its recovery —
    /// may still end the transaction and wait holding nothing. Their saves later find them
    /// owned. Without the global lock (`fs/detached_ns.rs`) nothing is taken here: the save
    /// checks ownership.
    pub(super) fn own_first(&self, tx: &mut Tx<'_>, dirs: &[u64], files: &[u64]) -> Result<()> {
        if tx.is_detached() {
            return Ok(());
        }
        let kinds = dirs.iter().map(|&d| (true, d, ()));
        in_lock_order(kinds.chain(files.iter().map(|&f| (false, f, ()))).collect())
            .into_iter()
            .try_for_each(|(_, ino, ())| self.own_inode(tx, ino))
    }

    /// [`Volume::own_first`] for inodes whose write locks the caller does not hold (a
    /// rename, which takes them one role at a time): each is taken for its own.
    pub(super) fn own_first_locking(
        &self,
        tx: &mut Tx<'_>,
        states: &[&Arc<InodeState>],
    ) -> Result<()> {
        if tx.is_detached() {
            return Ok(());
        }
        let kinds = states
            .iter()
            .map(|st| (st.read().inode.is_dir(), st.ino, *st));
        in_lock_order(kinds.collect())
            .into_iter()
            .try_for_each(|(_, ino, st)| {
                let _w = st.write();
                self.own_inode(tx, ino)
            })
    }

    /// Is `st`'s cached state current without the global lock? (v3: this node holds its inode
    /// lock and validated the cache under it; v2: loaded at this node's current epoch.)
    pub(super) fn is_current_unlocked(&self, st: &InodeState) -> bool {
        // A fresh or parked inode (fs/detached_ns.rs) is known to no other node.
        if self.detached.known_only_here(st.ino) {
            return true;
        }
        // Held (either mode) with the cache validated under the hold: nobody else can have
        // changed it. (Not `fast`: an exclusive hold taken by a change is valid without the
        // fast path's `ready`.)
        match &self.cl.ilocks {
            Some(il) => il.is_valid(st.data_lock(il)),
            None => self.is_current(st),
        }
    }

    /// Is this inode's in-memory state current?
    pub(super) fn is_current(&self, st: &InodeState) -> bool {
        st.epoch.load(Ordering::Acquire) == self.cl.epoch.load(Ordering::Acquire)
    }

    /// Reload a loaded inode that another node may have changed (caller holds the global lock
    /// through `tx`). An inode that is gone, or whose block now holds another inode, becomes a
    /// tombstone and `NotFound`.
    pub(super) fn refresh(&self, tx: &mut Tx<'_>, st: &InodeState) -> Result<()> {
        self.refresh_noting(tx, st, st.ino == self.sb.root_ino)
    }

    /// [`Volume::refresh`]; `note`: the inode's number is known to be that live inode's
    /// ([`Volume::state_of_name`]), so a copy loaded from home is noted current.
    pub(super) fn refresh_noting(
        &self,
        tx: &mut Tx<'_>,
        st: &InodeState,
        note: bool,
    ) -> Result<()> {
        let epoch = self.cl.epoch.load(Ordering::Acquire);
        if st.epoch.load(Ordering::Acquire) == epoch {
            return Ok(());
        }
        // v3: a state validated under this node's hold of the inode's own lock is current
        // whatever the global lock did meanwhile. Every change of the inode's block takes that
        // lock exclusively (fs/inode_lock.rs rule 1), which clears `ready` here first, and it
        // is made under the global lock, which the caller holds now. Without this, every
        // return of the global lock reloaded each inode touched, a thin image's whole extent
        // tree included, from a block cache the version change had just dropped.
        if let (Some(il), Some(dl)) = (&self.cl.ilocks, st.dl.get()) {
            if il.is_valid(dl) && !st.read().freed {
                st.epoch.store(epoch, Ordering::Release);
                return Ok(());
            }
        }
        // So is a fresh or parked inode (fs/detached_ns.rs): no other node can know it (and
        // a parked one's block is the pool's: the test below would take it for freed).
        if self.detached.known_only_here(st.ino) && !st.read().freed {
            st.epoch.store(epoch, Ordering::Release);
            return Ok(());
        }
        let changes_detached = {
            let i = &st.read().inode;
            i.is_reg() || i.is_dir()
        };
        if changes_detached && self.before_load(tx, st.ino)? {
            // Its owner wrote it home just now (fs/detached.rs rule 3).
            tx.drop_cached(st.ino);
        }
        let mut inner = st.write();
        if inner.freed {
            bail!(NotFound, "inode {} was removed", st.ino);
        }
        let fresh = if tx.is_used(st.ino)? {
            tx.read(st.ino)
                .and_then(|raw| crate::format::inode::Inode::decode(&raw, st.ino))
                .ok()
                .filter(|i| i.generation == inner.inode.generation)
        } else {
            None
        };
        let Some(inode) = fresh else {
            inner.freed = true;
            drop(inner);
            self.inodes.remove(st.ino);
            bail!(NotFound, "inode {} was removed by another node", st.ino);
        };
        inner.extents = if inode.is_reg() {
            super::extent_map::ExtentMap::load(tx, &inode)?
        } else {
            super::extent_map::ExtentMap::default()
        };
        inner.inode = inode;
        inner.forget_unfreed();
        drop(inner);
        st.epoch.store(epoch, Ordering::Release);
        // Read after `before_load` asked the bucket: current, if the number is the live
        // inode's.
        if changes_detached && note {
            self.note_loaded(st, epoch);
        }
        Ok(())
    }

    /// A regular file or directory whose number is a live inode's, just read from home
    /// under the global lock after this node found that no other node owned it (or after
    /// waiting for the owner to write it home): current at its lock's version
    /// (`InodeLocks::note_reloaded`).
    pub(super) fn note_loaded(&self, st: &InodeState, epoch: u64) {
        if let Some(il) = &self.cl.ilocks {
            il.note_reloaded(st.data_lock(il), st.ino, epoch);
        }
    }

    /// Does this node know, in this `epoch`, that no other node owns `ino`'s lock (one
    /// bucket read an epoch, `InodeLocks::foreign_exclusive`)? False when the bucket cannot
    /// be read; true on a v2 volume, where nothing is owned.
    pub(super) fn unowned_elsewhere(&self, ino: u64, epoch: u64) -> bool {
        self.cl.ilocks.as_ref().is_none_or(|il| {
            il.holds_any(ino) || il.foreign_exclusive(ino, epoch).is_ok_and(|owned| !owned)
        })
    }

    /// Register this node's opening of `ino` (first open, or first writable open). A writer
    /// is refused while another live node has the file open for writing, unless `nofilelock`.
    pub(super) fn register_open(&self, st: &InodeState, writable: bool) -> Result<()> {
        let first = st.opens.load(Ordering::Acquire) == 0;
        let first_writer = writable && st.writers.load(Ordering::Acquire) == 0;
        if !(first || first_writer) {
            return Ok(());
        }
        let me = self.cl.me;
        let ino = st.ino;
        let writer = writable || st.writers.load(Ordering::Acquire) > 0;
        let mut conflict: Option<OpenEntry> = None;
        let check = writable && self.cl.file_locks;
        self.cl
            .locks
            .update(self.cl.locks.bucket_of(ino), |rec| {
                conflict = None;
                if check {
                    conflict = rec
                        .entries
                        .iter()
                        .find(|e| {
                            e.ino == ino && e.slot != me.slot && e.writer && self.cl.entry_live(e)
                        })
                        .copied();
                    if conflict.is_some() {
                        return None;
                    }
                }
                let mut n = rec.clone();
                // Stale registrations of dead or departed nodes are dropped on the way.
                n.entries
                    .retain(|e| !(e.ino == ino && e.slot == me.slot) && self.cl.entry_live(e));
                if n.entries.len() >= crate::format::lock_record::BUCKET_ENTRIES {
                    return None;
                }
                n.entries.push(OpenEntry {
                    ino,
                    slot: me.slot,
                    writer,
                    slot_gen: me.gen,
                });
                Some(n)
            })
            .and_then(|written| match (written, conflict) {
                (Some(_), _) => Ok(()),
                (None, Some(e)) => {
                    let host = self.host_of(e.slot);
                    tracing::warn!(
                        "refused to open inode {ino} for writing: node {host} (slot {}) has it open for writing (a second writer on another node would corrupt it; live migration does not need one)",
                        e.slot
                    );
                    Err(Error::new(
                        ErrorKind::Busy,
                        format!("inode {ino} is open for writing on node {host}"),
                    ))
                }
                (None, None) => Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "cannot open inode {ino}: its open-lock bucket already records {} open files across the nodes (a limit fixed at mkfs); close some files and retry",
                        crate::format::lock_record::BUCKET_ENTRIES
                    ),
                )),
            })
    }

    /// This node's last open of `ino` closed (or its last writer did).
    pub(super) fn unregister_open(&self, st: &InodeState) {
        let r = if st.opens.load(Ordering::Acquire) == 0 {
            self.cl.locks.open_clear(st.ino, self.cl.me)
        } else if st.writers.load(Ordering::Acquire) == 0 {
            self.cl.locks.open_set(st.ino, self.cl.me, false)
        } else {
            Ok(())
        };
        if let Err(e) = r {
            tracing::warn!(
                "updating the open registration of inode {} failed: {e}",
                st.ino
            );
        }
    }

    /// Unmount: the registrations of `open_here` (the inodes open on this node when the
    /// unmount began) go. The kernel's last releases can come after FUSE's destroy (which
    /// unmounts) and are not served then, and an open-unlinked file freed at the unmount
    /// leaves the inode table first: a clean unmount left their entries behind, for fsck to
    /// warn about ("stale open entry") and the node's next mount to remove. A release served
    /// meanwhile cleared its own; clearing an entry that is not there changes nothing.
    pub(super) fn unregister_all_opens(&self, open_here: &[u64]) {
        for &ino in open_here {
            if let Err(e) = self.cl.locks.open_clear(ino, self.cl.me) {
                tracing::warn!(
                    "removing the open registration of inode {ino} at unmount failed: {e}"
                );
            }
        }
    }

    /// Does another live node have `ino` open? (On a read error: assume yes, which only
    /// defers a free or refuses a truncate.)
    pub(super) fn open_elsewhere(&self, ino: u64) -> bool {
        match self.cl.locks.open_others(ino, self.cl.me) {
            Ok(v) => v.iter().any(|e| self.cl.entry_live(e)),
            Err(e) => {
                tracing::warn!("reading open registrations of inode {ino} failed: {e}");
                true
            }
        }
    }

    fn host_of(&self, slot: u32) -> String {
        membership::scan(&*self.dev, &self.sb)
            .ok()
            .and_then(|v| {
                v.into_iter()
                    .find(|s| s.slot == slot)
                    .and_then(|s| s.record.map(|h| h.host))
            })
            .unwrap_or_else(|| format!("in slot {slot}"))
    }

    /// The keeper: hands the global lock over when others wait, and notices when another node
    /// was granted it (so the data path revalidates its cached maps).
    pub(super) fn spawn_keeper(vol: &Arc<Volume>) {
        let weak = Arc::downgrade(vol);
        let poll = if vol.cl.ilocks.is_some() {
            KEEPER_POLL_V3
        } else {
            KEEPER_POLL
        };
        let spawned = std::thread::Builder::new()
            .name("cetra-lockkeeper".into())
            .spawn(move || loop {
                std::thread::sleep(poll);
                let Some(v) = weak.upgrade() else { break };
                if v.unmounted.load(Ordering::Acquire) || v.member.is_fenced() {
                    break;
                }
                let _ = v.keeper_tick();
            });
        if let Err(e) = spawned {
            tracing::error!(
                "no lock keeper thread ({e}): other nodes wait until this one unmounts"
            );
        }
    }

    /// Read record 0: note a version move; hand the lock over if others wait and the
    /// metadata mutex is free. Returns None when nothing is left to do (this node does not
    /// hold the lock, nobody else waits, or it was just handed over), else how soon to look
    /// again: when the hold window ends, or [`KEEPER_RETRY`] while an operation or allocating
    /// writes still use the lock.
    fn keeper_tick(&self) -> Option<Duration> {
        let cl = &self.cl;
        let rec = match cl.locks.read(LockTable::GLOBAL) {
            Ok((_, rec)) => rec,
            Err(e) => {
                tracing::warn!("reading the global lock failed: {e}");
                return Some(MAILBOX_BUSY_POLL);
            }
        };
        if rec.version != cl.seen_version.swap(rec.version, Ordering::AcqRel) {
            cl.epoch.fetch_add(1, Ordering::AcqRel);
        }
        if cl.held.load(Ordering::Acquire) == 0 || !cl.others_waiting(&rec) {
            return None;
        }
        cl.handoff_wanted.store(true, Ordering::Release);
        let Some(mut m) = self.meta.try_lock().or_panic() else {
            // An operation runs (it just marked the lock used); the next one hands over
            // itself once the window is over, else this is asked again when it ends.
            return Some(cl.hold.left(false).max(KEEPER_RETRY));
        };
        let left = cl.hold.left(m.inflight().holds_bitmap_blocks());
        if !left.is_zero() {
            // Asked again then (the request stays in the mailbox until settled).
            return Some(left.max(KEEPER_RETRY));
        }
        if m.gml() == LockMode::Free {
            return None;
        }
        if m.inflight().holds_bitmap_blocks() {
            // Handed over once the allocating writes in flight are mapped.
            return Some(KEEPER_RETRY);
        }
        match self.handoff(&mut m) {
            // Fenced between the loop's check and here: the FENCED line said it all, and the
            // others recover this node instead.
            Ok(()) => None,
            Err(e) if e.kind() == ErrorKind::Fenced => None,
            Err(e) => {
                tracing::error!("handing the metadata lock over failed: {e}");
                Some(MAILBOX_BUSY_POLL)
            }
        }
    }

    /// Give the global lock back when this node has not used it for [`GLOBAL_IDLE_RELEASE`]
    /// (v3 volumes; called by the mailbox thread at every tick): the same handoff as for a
    /// waiter (everything home, the journal emptied), with nobody waiting. Skipped while an
    /// operation runs (the metadata mutex is taken) or allocating writes still hold bitmap
    /// blocks; a failure is logged and tried again at a later tick (a fence ends the thread).
    fn release_idle_global(&self) {
        let cl = &self.cl;
        if cl.keep_idle
            || cl.held.load(Ordering::Acquire) == 0
            || cl.hold.idle() < GLOBAL_IDLE_RELEASE
        {
            return;
        }
        let Some(mut m) = self.meta.try_lock().or_panic() else {
            return;
        };
        if m.gml() != LockMode::Exclusive && m.groups().has_marks_to_take_off() {
            // Format 7: marks a take-off failed for before, retried here too (an idle node
            // may not refill or hand the lock over for a long time).
            self.unmark_groups(&mut m);
        }
        // Re-checked under the mutex: an operation may have taken, used or given it meanwhile.
        if m.gml() == LockMode::Free
            || cl.hold.idle() < GLOBAL_IDLE_RELEASE
            || m.inflight().holds_bitmap_blocks()
        {
            return;
        }
        let mode = m.gml();
        match self.handoff(&mut m) {
            Ok(()) => tracing::debug!(
                "gave the global lock ({mode:?}) back after {} ms unused",
                GLOBAL_IDLE_RELEASE.as_millis()
            ),
            Err(e) if e.kind() == ErrorKind::Fenced => {}
            Err(e) => {
                // Tried again a second from now, not at every tick.
                cl.hold.used();
                tracing::warn!("giving the unused global lock back failed: {e}");
            }
        }
    }

    /// The stamp of this node's last use of the global lock, before a background chore
    /// ([`Volume::chore_done`]).
    pub(super) fn lock_use_stamp(&self) -> u64 {
        self.cl.hold.stamp()
    }

    /// A background chore (`fs/closer.rs`) that used the global lock since `prior`
    /// ([`Volume::lock_use_stamp`]) is done: its use does not count, so a lock taken for it
    /// alone goes back at the next idle release (a mailbox tick, v3), not a second later (a
    /// node that died in that second would keep every other node's changes waiting for its
    /// recovery). A use by another thread after the chore's still counts. The caller holds
    /// the metadata mutex, so that no operation ran between the chore's last use and this.
    pub(super) fn chore_done(&self, prior: u64) {
        let hold = &self.cl.hold;
        hold.unuse(hold.stamp(), prior);
    }

    /// One mailbox tick (v3): requests for the global lock are handled as the keeper does
    /// (and cleared once settled); the rest are inode-lock requests (`fs/inode_lock.rs`).
    fn mailbox_tick(&self, il: &InodeLocks) -> Result<GlobalAsk> {
        let me = self.cl.me;
        let reqs = il.object_locks().poll_mailbox(me)?;
        if reqs.is_empty() {
            return Ok(GlobalAsk::None);
        }
        il.note_exchange();
        let global = ObjectId::volume(VolumeLock::Global).raw();
        let (g, rest): (Vec<Request>, Vec<Request>) =
            reqs.into_iter().partition(|r| r.object == global);
        let mut ask = GlobalAsk::None;
        if !g.is_empty() {
            ask = if let Some(again) = self.keeper_tick() {
                GlobalAsk::Pending(again)
            } else {
                il.object_locks().clear_requests(me, &g)?;
                GlobalAsk::Settled
            };
        }
        if !rest.is_empty() {
            il.serve(rest)?;
        }
        Ok(ask)
    }

    /// The mailbox server (v3 volumes): reads this node's mailbox at the pace of
    /// [`PollPacer`] ([`MAILBOX_BUSY_POLL`] during a lock exchange, 40 ms otherwise) and hands over the inode
    /// locks other nodes ask for (`fs/inode_lock.rs`).
    pub(super) fn spawn_mailbox(vol: &Arc<Volume>) {
        let Some(il) = &vol.cl.ilocks else {
            return;
        };
        let homing = Arc::downgrade(vol);
        il.set_homing(Box::new(move |ino, seal| {
            homing
                .upgrade()
                .map_or(Ok(true), |v| v.home_for_handoff(ino, seal))
        }));
        // A file open for writing here keeps its exclusive hold however idle (a VM's image:
        // its next allocating write must not need the global lock to own it again), a file
        // open here keeps a shared one; every other hold goes back after `IDLE_AFTER` unused
        // (fs/inode_lock.rs, "idle holds").
        let keeping = Arc::downgrade(vol);
        il.set_keeping(Box::new(move |ino| {
            let Some(v) = keeping.upgrade() else {
                return Held::Nothing;
            };
            if v.cl.keep_idle {
                return Held::Exclusive;
            }
            match v.inodes.peek(ino) {
                Some(st) if st.writers.load(Ordering::Acquire) > 0 => Held::Exclusive,
                Some(st) if st.opens.load(Ordering::Acquire) > 0 => Held::Shared,
                _ => Held::Nothing,
            }
        }));
        let weak = Arc::downgrade(vol);
        let spawned = std::thread::Builder::new()
            .name("cetra-mailbox".into())
            .spawn(move || {
                let mut pacer = PollPacer::default();
                pacer.busy = MAILBOX_BUSY_POLL;
                let (mut reported, mut last) = (Instant::now(), (0, 0, 0, 0));
                let (mut more, mut again) = (false, None::<Duration>);
                let mut quick_until = None::<Instant>;
                loop {
                    // With give-backs left over, the next round starts at once (the mailbox is
                    // still read first): the sweep keeps up with a create storm. A global
                    // lock request waiting for the hold window is looked at when it ends;
                    // after a global handoff the mailbox is read every FOLLOW_UP_POLL for
                    // FOLLOW_UP_SPAN.
                    if !more {
                        let now = Instant::now();
                        let mut pace = pacer.interval(now);
                        if quick_until.is_some_and(|t| now < t) {
                            pace = pace.min(FOLLOW_UP_POLL);
                        }
                        std::thread::sleep(again.map_or(pace, |d| d.min(pace)));
                    }
                    let Some(v) = weak.upgrade() else { break };
                    if v.unmounted.load(Ordering::Acquire) || v.member.is_fenced() {
                        break;
                    }
                    let Some(il) = &v.cl.ilocks else { break };
                    again = match v.mailbox_tick(il) {
                        Ok(GlobalAsk::Pending(d)) => Some(d),
                        Ok(GlobalAsk::Settled) => {
                            // The new holder's next request is mostly for an inode lock
                            // this node caches: look for it at once.
                            quick_until = Some(Instant::now() + FOLLOW_UP_SPAN);
                            None
                        }
                        Ok(GlobalAsk::None) => None,
                        Err(e) => {
                            tracing::warn!("serving lock requests of other nodes failed: {e}");
                            None
                        }
                    };
                    if again.is_none() {
                        v.release_idle_global();
                    }
                    more = il.sweep();
                    if let Some(at) = il.last_exchange() {
                        pacer.activity(at);
                    }
                    if reported.elapsed() >= Duration::from_secs(5) {
                        il.report(&mut last);
                        reported = Instant::now();
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(
                "no mailbox thread ({e}): other nodes wait for this node's inode locks until it unmounts"
            );
        }
    }

    /// The watcher: judges other nodes by the change of their heartbeat and recovers the dead.
    pub(super) fn spawn_watcher(vol: &Arc<Volume>) {
        let weak = Arc::downgrade(vol);
        let interval = vol.cl.timing.interval;
        let spawned = std::thread::Builder::new()
            .name("cetra-watcher".into())
            .spawn(move || {
                let mut seen: HashMap<u32, (Vec<u8>, Instant)> = HashMap::new();
                loop {
                    std::thread::sleep(interval);
                    let Some(v) = weak.upgrade() else { break };
                    if v.unmounted.load(Ordering::Acquire) || v.member.is_fenced() {
                        break;
                    }
                    if let Err(e) = v.watch_tick(&mut seen) {
                        tracing::warn!("watching other nodes failed: {e}");
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!("no watcher thread ({e}): dead nodes are recovered only at mount");
        }
    }

    fn watch_tick(self: &Arc<Self>, seen: &mut HashMap<u32, (Vec<u8>, Instant)>) -> Result<()> {
        let views = membership::scan(&*self.dev, &self.sb)?;
        self.cl.set_live(&views);
        if let Some(pr) = self.pr.as_deref().filter(|_| !self.read_only) {
            if let Err(e) = pr.recheck(|| crate::cluster::reservation::live_slots(&views)) {
                tracing::warn!("fence=pr: checking the LUN's reservation failed: {e}");
            }
        }
        let now = Instant::now();
        let mut due = Vec::new();
        let mut silent_slots = std::collections::HashSet::new();
        for v in &views {
            let changed_at = match seen.get(&v.slot) {
                Some((raw, at)) if *raw == v.raw => *at,
                _ => {
                    if v.is_damaged() {
                        tracing::warn!(
                            "heartbeat slot {} is damaged (its record does not decode); run fsck.cetra",
                            v.slot
                        );
                    }
                    seen.insert(v.slot, (v.raw.clone(), now));
                    now
                }
            };
            // A slot being recovered is silent at once: its node is dead, only its waiter bit
            // is left until the recovery scrubs it.
            match v.record.as_ref().map(|h| (h.state, h.interval_ms)) {
                Some((SlotState::Live, interval_ms)) => {
                    let renewals = Duration::from_millis(u64::from(interval_ms)) * SILENT_RENEWALS;
                    if now.duration_since(changed_at) >= renewals {
                        silent_slots.insert(v.slot);
                    }
                }
                Some((SlotState::Recovering, _)) => {
                    silent_slots.insert(v.slot);
                }
                _ => {}
            }
            if v.slot == self.cl.me.slot || self.read_only {
                continue;
            }
            // A damaged slot is judged by the change of its bytes, with the superblock's
            // timing (its own cannot be read); recovered once silent for that dead time.
            if v.is_damaged() && v.slot < self.sb.max_nodes {
                let silent = now.duration_since(changed_at);
                if silent >= self.cl.timing.dead_time() {
                    due.push((v.clone(), silent));
                }
                continue;
            }
            let Some(h) = &v.record else { continue };
            let silent = now.duration_since(changed_at);
            let dead_time = h.dead_time();
            let is_due = match h.state {
                SlotState::Free => false,
                SlotState::Live => {
                    silent >= dead_time || membership::local_writer_gone(h, &self.member.host)
                }
                // A recovery whose recoverer is no longer that live node is taken over: the
                // recoverer is judged by its own record's change and its own timing. Our own
                // claim still standing means our attempt failed part-way (a finished recovery
                // frees the slot): every step is idempotent, so it is retried.
                SlotState::Recovering => {
                    let ours = h.recoverer == self.cl.me.slot && h.recoverer_gen == self.cl.me.gen;
                    let recoverer_silent_too_long = views
                        .iter()
                        .find(|r| r.slot == h.recoverer)
                        .and_then(|r| r.record.as_ref().zip(seen.get(&r.slot)))
                        .is_some_and(|(rh, (_, at))| now.duration_since(*at) >= rh.dead_time());
                    ours || recovery::claim_is_stale(v, &views, self.cl.me)
                        || recoverer_silent_too_long
                }
            };
            if is_due {
                due.push((v.clone(), silent));
            }
        }
        *self.cl.silent.lock().or_panic() = silent_slots;
        // Every due node's locks are released here, its last steps on a thread of their own:
        // a last step takes the global lock, which another dead node may hold (found dead in
        // this scan or a later one: the watcher must go on to recover it), and a free may wait
        // for a dead node's group mark, which its claim takes off.
        let mut claimed = Vec::new();
        for (v, silent) in due {
            if self.cl.finishing.lock().or_panic().contains(&v.slot) {
                continue;
            }
            match self.claim_slot(&v) {
                Ok(Some(c)) => claimed.push((v, c, silent)),
                Ok(None) => {}
                Err(e) => tracing::warn!(
                    "recovery of {} failed (will retry): {e}",
                    membership::describe(&v)
                ),
            }
        }
        for (v, c, silent) in claimed {
            self.cl.finishing.lock().or_panic().insert(v.slot);
            let vol = Arc::clone(self);
            let slot = v.slot;
            let spawned = std::thread::Builder::new()
                .name("cetra-recover".into())
                .spawn(move || {
                    if let Err(e) = vol.finish_recovery(&c, silent) {
                        tracing::warn!(
                            "recovery of {} failed (will retry): {e}",
                            membership::describe(&v)
                        );
                    }
                    vol.cl.finishing.lock().or_panic().remove(&slot);
                });
            if let Err(e) = spawned {
                tracing::warn!("no thread for the last steps of a recovery ({e}); retried");
                self.cl.finishing.lock().or_panic().remove(&slot);
            }
        }
        Ok(())
    }

    /// Recover a dead node, first part: claim its slot, replay its journal, release its locks
    /// (its group marks too). None if another node claimed it. Every step is idempotent; see
    /// docs/recovery.md. [`Volume::finish_recovery`] does the rest.
    pub(super) fn claim_slot(&self, v: &SlotView) -> Result<Option<recovery::Claimed>> {
        // The dead node may have used groups a grow added that this node has not adopted yet.
        let sb = self.current_superblock()?;
        // ... and may own such a group: its record is scrubbed with the others.
        self.cl.locks.set_group_count(sb.group_count);
        recovery::claim_and_release(
            &*self.dev,
            &sb,
            &self.cl.locks,
            self.cl.ilocks.as_ref().map(InodeLocks::object_locks),
            self.pr.as_deref(),
            v,
            self.cl.me,
        )
    }

    /// The part of a recovery that needs the filesystem: free the dead node's open-unlinked
    /// inodes (under the global lock), then mark its slot free with a new generation.
    pub(super) fn finish_recovery(
        &self,
        claimed: &recovery::Claimed,
        silent: Duration,
    ) -> Result<()> {
        self.free_orphans(claimed.view.slot)?;
        recovery::clear(&*self.dev, &self.sb, claimed)?;
        let when = if silent.is_zero() {
            "found dead at mount".to_string()
        } else {
            format!("after {} ms without a heartbeat change", silent.as_millis())
        };
        tracing::warn!(
            "recovered {} ({when}): {} journal blocks replayed, its locks released, its slot free again",
            membership::describe(&claimed.view),
            claimed.replayed
        );
        Ok(())
    }
}

/// Inodes `(is a directory, number, what goes with it)` in the lock order of
/// docs/locking.md §15: directories by ascending number, then the others; each once.
fn in_lock_order<T>(mut inodes: Vec<(bool, u64, T)>) -> Vec<(bool, u64, T)> {
    inodes.sort_by_key(|&(dir, ino, _)| (!dir, ino));
    inodes.dedup_by_key(|&mut (_, ino, _)| ino);
    inodes
}

#[cfg(test)]
mod tests {
    #[test]
    fn inodes_are_owned_directories_first_each_once() {
        let order = super::in_lock_order(vec![
            (false, 5, ()),
            (true, 9, ()),
            (true, 3, ()),
            (false, 2, ()),
            (true, 3, ()),
        ]);
        let inos: Vec<u64> = order.iter().map(|&(_, ino, ())| ino).collect();
        assert_eq!(inos, [3, 9, 2, 5]);
    }

    use super::{HoldWindow, HOLD_IDLE, HOLD_MAX, HOLD_MIN};
    use std::time::Duration;

    fn ns(d: Duration) -> u64 {
        u64::try_from(d.as_nanos()).unwrap()
    }

    /// A busy node keeps the lock for its window, an idle one gives it up after `HOLD_IDLE`;
    /// the window follows the last handoff's cost within its bounds.
    #[test]
    fn hold_window_follows_use_and_handoff_cost() {
        let w = HoldWindow::new();
        assert_eq!(w.window(), HOLD_MIN, "no handoff measured yet");
        let t0 = ns(Duration::from_secs(10));
        w.taken_at(t0);
        assert!(!w.over_at(t0 + ns(HOLD_IDLE) / 2, false), "just taken");
        assert_eq!(
            w.left_at(t0 + ns(HOLD_IDLE) / 2, false),
            HOLD_IDLE / 2,
            "idle: over when the idle time is reached"
        );
        assert_eq!(
            w.left_at(t0 + ns(HOLD_IDLE) / 2, true),
            HOLD_MIN.saturating_sub(HOLD_IDLE / 2),
            "busy: over when the window ends"
        );
        assert!(w.over_at(t0 + ns(HOLD_IDLE), false), "idle for HOLD_IDLE");
        assert!(
            !w.over_at(t0 + ns(HOLD_IDLE), true),
            "writes in flight: busy, not idle"
        );
        // Used every millisecond: kept until the window, then given up although busy.
        let mut t = t0;
        while t < t0 + ns(HOLD_MIN) - ns(Duration::from_millis(1)) {
            t += ns(Duration::from_millis(1));
            w.used.store(t, std::sync::atomic::Ordering::Release);
            assert!(!w.over_at(t, false), "busy inside the window");
        }
        w.used
            .store(t0 + ns(HOLD_MIN), std::sync::atomic::Ordering::Release);
        assert!(w.over_at(t0 + ns(HOLD_MIN), true), "busy past the window");
        assert_eq!(w.left_at(t0 + ns(HOLD_MIN), true), Duration::ZERO);
        w.handed_over(Duration::from_millis(60));
        assert_eq!(w.window(), Duration::from_millis(240));
        w.handed_over(Duration::from_millis(5));
        assert_eq!(w.window(), HOLD_MIN);
        w.handed_over(Duration::from_secs(3));
        assert_eq!(w.window(), HOLD_MAX);
    }
}
