//! Per-inode cluster locks for the data path (format v3, `INCOMPAT_OBJECT_LOCKS`; issue 9
//! point 4). The protocol on disk is `cluster/object_lock.rs`; this module is the
//! filesystem's side of it: the per-inode local state, the rules for using a cached block map
//! without the global lock, and the handoff that a request in this node's mailbox triggers.
//!
//! # What an inode lock protects, in this design
//! The **global lock** (record 0) still serializes every metadata change but one (below) and
//! protects metadata reads (docs/locking.md §4–§5). On a v3 volume, **inode lock *i***
//! additionally protects *inode i's block as cached by a node that does not hold the global
//! lock*: its extent map, size, flags and mode, which is all the data path reads; and, held
//! exclusively, the mapping of new blocks into a regular file without the global lock
//! (`fs/detached.rs`). The rules:
//!
//! 1. **Writers**: every change of inode *i*'s block is made under inode lock *i* held
//!    exclusively ([`InodeLocks::own`]), which is only ever *taken* under the global lock held
//!    exclusively; the change itself is made under that global hold too, except the mapping of
//!    allocating writes of a regular file, which the owner makes without it from its block
//!    pool (`fs/detached.rs`, `fs/pool.rs`), and namespace changes in a directory it owns
//!    (`fs/detached_ns.rs`). An inode made by such a change (*fresh*) is changed without a
//!    lock of its own until its directory's hold goes: no other node can know it. Operations that
//!    free, allocate or rewrite *i*'s blocks (write's metadata path, truncate, fallocate and
//!    punch, the free of an unlinked inode) take it as soon as they hold the inode's write
//!    lock, before any of that; every other change takes it where the inode is written
//!    (`Volume::save`, which fences the node if it cannot: the running transaction would
//!    otherwise commit half a change). Taking it exclusively makes every other node drain its
//!    fast-path I/O on *i* and forget that its cache is valid.
//! 2. **The fast path** (reads, and writes inside written extents) on node N uses its cached
//!    state of *i* only while N holds inode lock *i* (shared is enough) **and** that cache was
//!    validated under the hold ([`InodeLocks::share`]): either the lock's version did not move
//!    since N last held it (nobody changed *i*: a version moves only on an exclusive grant), or
//!    N reloaded *i* under the global lock after the grant. It does **not** need the global
//!    lock: another node's metadata work on other files, including a global-lock handoff or
//!    the death of the node holding the global lock, never pauses it.
//!    The metadata path trusts such a copy too (`Volume::refresh`): while `ready`, no other
//!    node can have changed *i* (rule 1 would have cleared it), so taking the global lock back
//!    does not make this node re-read *i* and its extent map.
//! 3. **Handoff** ([`Server`], run by the `cetra-mailbox` thread on a request): stop new
//!    fast-path I/O on *i* (`ready` cleared), wait for the fast-path I/O in flight (the
//!    `gate`), then release or downgrade. A change journaled under the global lock needs
//!    nothing written here: the global lock's own handoff writes everything home and empties
//!    the journal before another node can take it (§5), and a node whose cache of *i* is stale
//!    reloads *i* under the global lock. A change made **without** the global lock (an
//!    allocating write of a file this node owns, `fs/detached.rs`) is written home, and the
//!    journal emptied, before an exclusive hold is released or downgraded: the homing hook
//!    ([`InodeLocks::set_homing`]) runs first and seals the hold (`handing` set) in the same
//!    critical section as its last check, so nothing can begin in between; a "not yet"
//!    leaves the request for the next tick. The drain follows. The sweep's give-back runs the
//!    same hook.
//! 4. **Order**: global lock → metadata mutex → the inode's write/read lock → its gate; and
//!    the volume's detached state (`fs/detached.rs`) → the lock table → an inode's local lock
//!    state (the homing hook's seal, and its `owns` check before a reopen). A
//!    fast-path acquire ([`InodeLocks::share`]) holds no lock while it waits; the fast path
//!    then takes the inode's read lock *before* the gate, so a thread that holds a gate never
//!    waits for an inode's write lock. The handoff takes only the inode's local lock state and
//!    its gate (waiting for fast-path I/O already admitted, which waits for nothing but the
//!    device), so a metadata operation that holds the inode's write lock and waits in `own`
//!    for a handoff in progress on this node cannot close a cycle.
//!
//! # Local state per inode ([`DataLock`])
//! `held`/`version` mirror what the bucket shows for this node; `validator` is the version at
//! which this node's cached state of the inode was last known current; `ready` says the fast
//! path may use the cache now; `gate` is held shared by each fast-path I/O and exclusively by
//! a handoff to drain them; `handing` is set by a handoff before its drain and cleared after
//! its CAW, a window in which no local acquire may trust the bucket (which still shows this
//! node);
//! `handoffs` counts completed handoffs, so an acquire that raced one starts again;
//! `acquiring` serializes this node's own acquires of one inode (two concurrent acquires
//! would rewrite each other's mention); `used` is when this node last used the lock (for the
//! sweep below).
//!
//! # The bound: giving cached locks back ([`InodeLocks::sweep`])
//! A lock nobody asks for stays cached (so a node's next use costs no I/O), but not without
//! bound: held entries fill the buckets (the area holds [`ObjectLocks::capacity`] entries for
//! all nodes together, e.g. 229,376 for 16,384 buckets of 512 bytes), and once a bucket has no
//! idle entry to evict every acquire there waits for a room request's round trip. The
//! `cetra-mailbox` thread therefore sweeps at every tick, like GFS2's glock shrinker:
//! * **count**: while this node holds more than its limit (the area's capacity shared by
//!   twice the volume's `max_nodes`, at least [`MIN_CACHED`] and at most [`MAX_CACHED`]), it
//!   gives back the least recently used locks not used in the last [`IDLE_AFTER`], down to
//!   7/8 of the limit;
//! * **forgotten inodes**: once per [`IDLE_AFTER`], every lock whose local entry only the
//!   table refers to (no loaded inode state uses it: the inode table evicted the state, or
//!   the state never used its lock for the data path) and that was not used for
//!   [`IDLE_AFTER`] is given back, and its entry dropped. The memory of an entry a state
//!   refers to is charged to that state in the inode table's budget (`fs/inode_table.rs`);
//!   the rest live at most about two sweeps;
//! * **idle holds**: in the same pass, every hold not used for [`IDLE_AFTER`], of loaded
//!   inodes too, unless the volume's keeping hook ([`InodeLocks::set_keeping`]) keeps it: a
//!   file open for writing on this node (a VM's image) keeps its hold in either mode, a file
//!   open for reading its shared hold. A dead node's hold blocks the others until it is
//!   recovered (an exclusive one every use, a shared one every change, and a change waits for
//!   it holding the global lock); the volume's root, whose lookups every path crosses, was
//!   the worst case. A grant counts as a use, and a lock used after the sweep chose it is left
//!   alone. More than [`SWEEP_BATCH`] such holds are given back over the next ticks.
//!
//! "Not used for [`IDLE_AFTER`]" is judged against the clock of the sweep's previous tick, so
//! a lock used while the thread was late (slow CAWs, a long drain) is not taken for idle.
//!
//! A give-back is a handoff nobody asked for: the same drain (`ready` cleared, `handing` set,
//! the gate taken exclusively), then the release CAW, then the same bookkeeping, so a local
//! acquire that races it starts again exactly as after a requested handoff, and what changes
//! without the global lock left under an exclusive hold is written home first (the homing
//! hook, rule 3). **A give-back in the middle of a metadata change**
//! (an operation that called [`InodeLocks::own`] and runs on for more than [`IDLE_AFTER`]
//! under the global lock) is safe for the same reason a room request at that moment is: the
//! exclusive grant moved the version past every other node's validator, so any other node
//! must reload the inode under the global lock, which this node holds until the change is
//! home; the change's `save` takes the lock again (one more CAW and version). At most
//! [`SWEEP_BATCH`] locks and [`SWEEP_BUDGET`] of work per tick, so the thread serves other
//! nodes' requests in between (with work left over its next round starts at once, after it
//! has read its mailbox); when too few locks are idle to reach the limit, the count pass
//! waits 100 ms before scanning the table again; a give-back that fails is skipped (warned
//! about at most once a minute) and met again at the next pass.
//!
//! A v2 volume has no lock area: the data path keeps using the global lock (fs/cluster.rs).

use crate::cluster::lock::Me;
use crate::cluster::object_lock::{Class, Grant, Handoff, ObjectId, ObjectLocks, Served};
use crate::error::{Error, Result};
use crate::format::lock_record::LockMode;
use crate::format::mailbox::Request;
use crate::format::object_lock::{Mention, Role};
use crate::sync::LockPolicy;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

/// The fewest inode locks a node may keep cached, whatever the area's size.
pub const MIN_CACHED: usize = 256;
/// The most inode locks a node keeps cached.
pub const MAX_CACHED: usize = 65_536;
/// A lock not used for this long may be given back (module doc, the bound).
pub const IDLE_AFTER: Duration = Duration::from_secs(1);
/// Most locks one sweep gives back.
pub const SWEEP_BATCH: usize = 256;
/// Most time one sweep spends giving locks back before the thread serves its mailbox again.
pub const SWEEP_BUDGET: Duration = Duration::from_millis(5);
/// When too few locks are idle to come down to the limit, the count pass waits this long
/// (ms) before it scans the table again.
const COUNT_RETRY_MS: u64 = 100;
/// Most buckets [`InodeLocks::foreign_exclusive`] keeps (then it reads them again).
const SEEN_BUCKETS_MAX: usize = 4096;
/// A failing give-back is warned about at most this often.
const FAILURE_WARN_EVERY: Duration = Duration::from_mins(1);

/// One inode's lock as this node sees it (module doc).
#[derive(Debug, Default)]
pub(crate) struct DataLock {
    state: Mutex<DlState>,
    changed: Condvar,
    acquiring: Mutex<()>,
    gate: RwLock<()>,
    ready: AtomicBool,
    /// [`InodeLocks`]'s clock when this node last used the lock.
    used: AtomicU64,
}

#[derive(Debug, Default)]
struct DlState {
    held: Held,
    version: u64,
    validator: Option<u64>,
    handing: bool,
    handoffs: u64,
    /// The last exclusive grant found that another node had changed the inode since this
    /// node's grant before (its version moved past the validator).
    moved: bool,
}

/// The version an object that has no entry in bucket `b` is at, for a validator: what a
/// shared grant would create its entry at (`floor + 1`, `cluster/object_lock.rs`). No entry
/// means nobody holds the object, so nothing of it is unwritten at home; a change needs an
/// exclusive grant, which creates the entry one higher, and an entry evicted later raises
/// the floor past it: so the bucket shows this version again (absent at the same floor, or
/// an entry at it) only if nobody changed the object meanwhile.
fn first_version(b: &crate::format::object_lock::Bucket) -> u64 {
    b.floor.wrapping_add(1)
}

/// What this node holds of one inode lock.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum Held {
    #[default]
    Nothing,
    Shared,
    Exclusive,
}

impl Held {
    fn of(m: LockMode) -> Self {
        match m {
            LockMode::Free => Self::Nothing,
            LockMode::Shared => Self::Shared,
            LockMode::Exclusive => Self::Exclusive,
        }
    }

    fn mode(self) -> LockMode {
        match self {
            Self::Nothing => LockMode::Free,
            Self::Shared => LockMode::Shared,
            Self::Exclusive => LockMode::Exclusive,
        }
    }
}

impl DataLock {
    /// The state, once no handoff is between its drain and its CAW.
    fn settled(&self) -> MutexGuard<'_, DlState> {
        let mut s = self.state.lock().or_panic();
        while s.handing {
            s = self.changed.wait(s).or_panic();
        }
        s
    }
}

/// Counters (debug log and tests).
#[derive(Debug, Default)]
pub(crate) struct InodeLockStats {
    /// Grants taken from the bucket (first use, or after a handoff).
    pub acquires: AtomicU64,
    /// Of the shared acquires, how many found the cache stale and reloaded the inode.
    pub reloads: AtomicU64,
    /// Locks this node handed to another (released or downgraded).
    pub handed: AtomicU64,
    /// Locks the sweep gave back (module doc, the bound).
    pub given_back: AtomicU64,
}

impl InodeLockStats {
    /// (acquires, reloads, handed, given back) now.
    pub fn snapshot(&self) -> (u64, u64, u64, u64) {
        (
            self.acquires.load(Ordering::Relaxed),
            self.reloads.load(Ordering::Relaxed),
            self.handed.load(Ordering::Relaxed),
            self.given_back.load(Ordering::Relaxed),
        )
    }
}

/// This node's inode locks.
#[derive(Debug)]
pub(crate) struct InodeLocks {
    locks: ObjectLocks,
    me: Me,
    table: Mutex<HashMap<u64, Arc<DataLock>>>,
    /// When this node last took part in a lock exchange (the mailbox poll speeds up after).
    exchange: Mutex<Option<Instant>>,
    /// Set by [`release_all`](Self::release_all): no lock may be taken afterwards.
    closed: AtomicBool,
    /// How many entries of the table hold their lock (shared or exclusive).
    holding: AtomicUsize,
    /// Most locks held before the sweep gives the least recently used back.
    limit: usize,
    /// Milliseconds since `started`, advanced by the sweep: the `used` stamps' clock.
    clock: AtomicU64,
    started: Instant,
    /// When the sweep last looked for the locks of forgotten inodes.
    last_sweep: Mutex<Instant>,
    /// The clock before which the count pass does not scan again.
    count_retry: AtomicU64,
    /// When a failed give-back was last warned about.
    last_warn: Mutex<Option<Instant>>,
    /// Before an exclusive hold goes to another node: is what it protects home? (The
    /// volume's `home_for_handoff`, fs/detached.rs; Ok(false) = not yet, ask again next tick.)
    homing: std::sync::OnceLock<HomingHook>,
    /// Which holds the sweep keeps however idle (the volume's: those of files open on this
    /// node). Unset: none.
    keeping: std::sync::OnceLock<KeepingHook>,
    /// Buckets read by [`InodeLocks::foreign_exclusive`] in the epoch they were read in.
    seen_buckets: Mutex<(u64, HashMap<u64, crate::format::object_lock::Bucket>)>,
    pub stats: InodeLockStats,
}

/// See [`InodeLocks::set_homing`]: the inode, and the seal to call when it answers yes.
pub(crate) type Homing = Box<dyn Fn(u64, Seal<'_>) -> Result<bool> + Send + Sync>;

/// Closes an exclusive hold to every new local use (see [`InodeLocks::set_homing`]); false if
/// it could not (another handoff of the lock is in progress): then the hook answers "not yet".
pub(crate) type Seal<'a> = &'a mut dyn FnMut() -> bool;

struct HomingHook(Homing);

/// See [`InodeLocks::set_keeping`]: what the volume keeps of inode `ino`'s lock however
/// idle (`Exclusive`: any hold, `Shared`: a shared one, `Nothing`: none).
pub(super) type Keeping = Box<dyn Fn(u64) -> Held + Send + Sync>;

struct KeepingHook(Keeping);

impl std::fmt::Debug for KeepingHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeepingHook")
    }
}

impl std::fmt::Debug for HomingHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HomingHook")
    }
}

/// What to do when a fenced or unmounting node should stop waiting for a lock.
pub(crate) type Abort<'a> = &'a dyn Fn() -> Option<Error>;

impl InodeLocks {
    /// This node's inode locks; `max_nodes` (the superblock's) shares the area's capacity
    /// out into the limit of the sweep (module doc, the bound).
    pub fn new(locks: ObjectLocks, me: Me, max_nodes: u32) -> Self {
        let share = locks.capacity() / (2 * u64::from(max_nodes.max(1)));
        let limit = usize::try_from(share)
            .unwrap_or(MAX_CACHED)
            .clamp(MIN_CACHED, MAX_CACHED);
        Self::with_limit(locks, me, limit)
    }

    /// Like [`new`](Self::new) with the limit given (tests).
    pub fn with_limit(locks: ObjectLocks, me: Me, limit: usize) -> Self {
        let started = Instant::now();
        Self {
            locks,
            me,
            table: Mutex::new(HashMap::new()),
            exchange: Mutex::new(None),
            closed: AtomicBool::new(false),
            holding: AtomicUsize::new(0),
            limit: limit.max(1),
            clock: AtomicU64::new(0),
            started,
            last_sweep: Mutex::new(started),
            count_retry: AtomicU64::new(0),
            last_warn: Mutex::new(None),
            homing: std::sync::OnceLock::new(),
            keeping: std::sync::OnceLock::new(),
            seen_buckets: Mutex::new((u64::MAX, HashMap::new())),
            stats: InodeLockStats::default(),
        }
    }

    /// What must happen before an exclusive hold of an inode goes to another node (a
    /// release, a downgrade, a give-back): changes made under it without the global lock are
    /// written home first (fs/detached.rs). Set once, at mount.
    ///
    /// The hook answers yes only after calling its seal, in the same critical section as its
    /// last check (module doc, rule 3): from the seal on, this node's own checks
    /// ([`InodeLocks::owns`]) say no, so no change without the global lock can begin between
    /// the hook's "everything is home" and the handoff. Answering yes without sealing is
    /// allowed (the volume is gone): the handoff seals then.
    pub fn set_homing(&self, f: Homing) {
        let _ = self.homing.set(HomingHook(f));
    }

    /// Which holds the sweep keeps however long they are idle (module doc, "idle holds"):
    /// called by the sweep, with none of this module's locks held, for each candidate. Set
    /// once, at mount; unset, every idle hold is given back.
    pub(super) fn set_keeping(&self, f: Keeping) {
        let _ = self.keeping.set(KeepingHook(f));
    }

    /// A handoff's first step (module doc, rule 3): if what the hold protects is home, seal
    /// it ([`InodeLocks::seal`]) and return what this node held; None = not yet (or another
    /// handoff of the lock is in progress), the request waits for the next tick.
    pub(super) fn homed_and_sealed(&self, ino: u64, dl: &DataLock) -> Result<Option<Held>> {
        let held = dl.state.lock().or_panic().held;
        let mut sealed = None;
        let mut seal = || {
            if sealed.is_none() {
                sealed = self.seal(dl, held);
            }
            sealed.is_some()
        };
        let homed = match (held, self.homing.get()) {
            (Held::Exclusive, Some(f)) => (f.0)(ino, &mut seal),
            _ => Ok(true),
        };
        if let Ok(true) = homed {
            return Ok(sealed.or_else(|| self.seal(dl, held)));
        }
        if let Some(h) = sealed {
            // A hook must not seal and then say no (or fail); should one, nothing was handed
            // over, and `handing` must not stay set (every acquire would wait).
            self.handed_to(dl, h.mode(), h.mode(), &Ok(()));
        }
        homed.map(|_| None)
    }

    /// The most locks this node keeps cached.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// How many locks this node holds now (shared or exclusive).
    pub fn holding(&self) -> usize {
        self.holding.load(Ordering::Relaxed)
    }

    /// How many inodes the table knows now.
    pub fn known(&self) -> usize {
        self.table.lock().or_panic().len()
    }

    /// The memory one entry of the table costs (its `Arc`'s allocation and its map slot at
    /// the map's typical load), charged to the inode state that refers to it.
    pub fn entry_charge() -> usize {
        super::heap::alloc(2 * std::mem::size_of::<usize>() + std::mem::size_of::<DataLock>())
            + 2 * std::mem::size_of::<(u64, Arc<DataLock>)>()
    }

    pub fn object_locks(&self) -> &ObjectLocks {
        &self.locks
    }

    /// Log the counters at debug level if they moved since `last`.
    pub fn report(&self, last: &mut (u64, u64, u64, u64)) {
        let now = self.stats.snapshot();
        if now != *last {
            tracing::debug!(
                "inode locks: {} held of at most {}, {} known, {} acquires, {} reloads after another node's change, {} handed to other nodes, {} given back idle",
                self.holding(),
                self.limit,
                self.known(),
                now.0,
                now.1,
                now.2,
                now.3
            );
            *last = now;
        }
    }

    /// The local state of inode `ino`'s lock (created on first use).
    pub fn lock_of(&self, ino: u64) -> Arc<DataLock> {
        let dl = self.table.lock().or_panic().entry(ino).or_default().clone();
        self.stamp(&dl);
        dl
    }

    /// Note that `dl` is being used now.
    fn stamp(&self, dl: &DataLock) {
        let now = self.clock.load(Ordering::Relaxed);
        if dl.used.load(Ordering::Relaxed) != now {
            dl.used.store(now, Ordering::Relaxed);
        }
    }

    /// Record what this node holds of `dl`'s lock (keeps `holding` in step).
    fn set_held(&self, s: &mut DlState, h: Held) {
        match (s.held == Held::Nothing, h == Held::Nothing) {
            (true, false) => {
                self.holding.fetch_add(1, Ordering::Relaxed);
            }
            (false, true) => {
                self.holding.fetch_sub(1, Ordering::Relaxed);
            }
            _ => {}
        }
        s.held = h;
    }

    fn existing(&self, ino: u64) -> Option<Arc<DataLock>> {
        self.table.lock().or_panic().get(&ino).cloned()
    }

    /// May the fast path use the cache now (a hint: [`fast`](Self::fast) decides)?
    #[expect(
        clippy::unused_self,
        reason = "a verb of the lock table, like the others callers use on a DataLock"
    )]
    pub fn is_ready(&self, dl: &DataLock) -> bool {
        dl.ready.load(Ordering::Acquire)
    }

    /// Is this node's cached state of the inode valid now: it holds the lock (either mode), no
    /// handoff is in progress, and the cache was validated under this hold? (Then no other
    /// node can have changed the inode: that takes the lock exclusively.)
    pub fn is_valid(&self, dl: &DataLock) -> bool {
        self.valid_since(dl).is_some()
    }

    /// While this node's cached state of `dl`'s inode is valid ([`is_valid`](Self::is_valid)):
    /// a token for [`still_valid`](Self::still_valid), which a read of the inode's blocks made
    /// without the global lock checks afterwards.
    #[expect(
        clippy::unused_self,
        reason = "a verb of the lock table, like the others callers use on a DataLock"
    )]
    pub fn valid_since(&self, dl: &DataLock) -> Option<(u64, u64)> {
        let s = dl.state.lock().or_panic();
        (s.held != Held::Nothing && !s.handing && s.validator == Some(s.version))
            .then_some((s.handoffs, s.version))
    }

    /// Was the cached state valid throughout since `token` was taken? No handoff began or
    /// ended (a handoff marks itself before its CAW), and no new grant came: so no other node
    /// can have changed the inode's blocks meanwhile (that takes the lock exclusively).
    pub fn still_valid(&self, dl: &DataLock, token: (u64, u64)) -> bool {
        self.valid_since(dl) == Some(token)
    }

    /// Does this node hold `ino`'s lock exclusively, with its cache valid, and no handoff in
    /// progress? (A change without the global lock may be made: fs/detached.rs.)
    pub fn owns(&self, dl: &DataLock) -> bool {
        let s = dl.state.lock().or_panic();
        self.stamp(dl);
        s.held == Held::Exclusive && !s.handing && s.validator == Some(s.version)
    }

    /// Did this node's last exclusive grant of `ino` find it changed by another node since
    /// the grant before (a directory that nodes share: `fs/detached_ns.rs`)? Answered once
    /// per grant (the flag is cleared).
    pub fn take_moved(&self, ino: u64) -> bool {
        self.existing(ino)
            .is_some_and(|dl| std::mem::take(&mut dl.state.lock().or_panic().moved))
    }

    /// Give back this node's exclusive hold of `ino` now, if it has one (a directory changed
    /// on the global path, at the global lock's handoff: `fs/detached_ns.rs`).
    pub fn give_back_exclusive(&self, ino: u64) -> Result<()> {
        let Some(dl) = self.existing(ino) else {
            return Ok(());
        };
        if dl.state.lock().or_panic().held != Held::Exclusive {
            return Ok(());
        }
        self.give_back(ino, &dl)
    }

    /// Does this node hold `ino`'s lock in either mode?
    pub fn holds_any(&self, ino: u64) -> bool {
        self.existing(ino)
            .is_some_and(|dl| dl.state.lock().or_panic().held != Held::Nothing)
    }

    /// Does another node hold `ino`'s lock exclusively now (one bucket read)? Only exclusive
    /// holders change an inode, and a new exclusive hold is only taken under the global lock
    /// held exclusively (rule 1), so a node holding the global lock that finds none may read
    /// the inode from disk until it gives the global lock up.
    ///
    /// `epoch` is the node's epoch (it moves whenever the node gives the global lock up or
    /// finds that another node took it exclusively): within one epoch a bucket is read once.
    pub fn foreign_exclusive(&self, ino: u64, epoch: u64) -> Result<bool> {
        let obj = ObjectId::inode(ino)?;
        let index = self.locks.bucket_of(obj);
        let mine = |b: &crate::format::object_lock::Bucket| {
            b.entry(obj.raw())
                .and_then(|e| e.owner())
                .is_some_and(|m| m.slot != self.me.slot)
        };
        {
            let seen = self.seen_buckets.lock().or_panic();
            if seen.0 == epoch {
                if let Some(b) = seen.1.get(&index) {
                    return Ok(mine(b));
                }
            }
        }
        let (_, bucket) = self.locks.read_bucket(index)?;
        let owned = mine(&bucket);
        let mut seen = self.seen_buckets.lock().or_panic();
        if seen.0 != epoch || seen.1.len() >= SEEN_BUCKETS_MAX {
            *seen = (epoch, HashMap::new());
        }
        seen.1.insert(index, bucket);
        Ok(owned)
    }

    /// After this node loaded `ino` from home under the global lock (its caller holds it),
    /// having found in this `epoch`, *before* the read, that no other node owns `ino`'s lock
    /// ([`foreign_exclusive`](Self::foreign_exclusive)), or having waited for the owner to
    /// write it home: the state it loaded is current at the lock's version, so note that
    /// version as the validator. Another node's exclusive grant, which any change of a
    /// known inode needs, moves the version, and is taken only under the global lock held
    /// exclusively, so not before the caller lets the global lock go; an owner's changes
    /// made without the global lock were written home before its hold went; the others'
    /// changes under the global lock were written home at its handoff. The caller also
    /// knows that the number is the live inode's (a name read in the same transaction led
    /// to it, or it is the root): a freed inode's block taken into another node's pool
    /// keeps its old image at home, and the fresh inode made there later takes no lock.
    ///
    /// Without this, a node validated its copy only at its own grants: once another node
    /// changed a directory, every lookup in it waited for the global lock while that lock's
    /// holder was silent (`fs/own_lock_reads.rs` step 2), however often this node had read
    /// the directory since. The version comes from the bucket read in this epoch (no I/O);
    /// none read (this node holds the lock), or an entry with an owner, notes the hold's own
    /// version, or nothing. A version noted is never above the entry's: at worst, too low,
    /// and then the check fails and the read waits, as before.
    pub fn note_reloaded(&self, dl: &DataLock, ino: u64, epoch: u64) {
        let Ok(obj) = ObjectId::inode(ino) else {
            return;
        };
        let seen = {
            let seen = self.seen_buckets.lock().or_panic();
            seen.1
                .get(&self.locks.bucket_of(obj))
                .filter(|_| seen.0 == epoch)
                .and_then(|b| match b.entry(obj.raw()) {
                    Some(e) => e.owner().is_none().then_some(e.version),
                    None => Some(first_version(b)),
                })
        };
        // Not `settled`: a handoff's homing may wait for the metadata mutex the caller holds.
        let mut s = dl.state.lock().or_panic();
        if s.handing {
            return;
        }
        let current = match s.held {
            // Held here: nobody else holds it exclusively.
            Held::Shared => Some(s.version),
            // This node's own changes are in its copy; its grant set the validator.
            Held::Exclusive => None,
            Held::Nothing => seen,
        };
        if let Some(v) = current {
            s.validator = Some(s.validator.map_or(v, |old| old.max(v)));
        }
    }

    /// Hold `ino`'s lock at least shared, without validating any cache (the caller is about
    /// to load the inode from disk: fs/detached.rs, "Reading an inode another node owns").
    pub fn hold_shared(&self, ino: u64, abort: Abort<'_>) -> Result<()> {
        let dl = self.lock_of(ino);
        let obj = ObjectId::inode(ino)?;
        loop {
            let seen = {
                let s = dl.settled();
                if s.held != Held::Nothing {
                    return Ok(());
                }
                s.handoffs
            };
            if self
                .grant(&dl, obj, LockMode::Shared, seen, abort)?
                .is_some()
            {
                return Ok(());
            }
        }
    }

    /// The fast path's admission: a shared hold on the gate if the cache may be used now, None
    /// if [`share`](Self::share) must run first. Take it after the inode's read lock.
    pub fn fast<'a>(&self, dl: &'a DataLock) -> Option<RwLockReadGuard<'a, ()>> {
        let g = dl.gate.read().or_panic();
        self.stamp(dl);
        dl.ready.load(Ordering::Acquire).then_some(g)
    }

    /// [`fast`](Self::fast) without waiting: None also when a handoff holds or waits for the
    /// gate. (A thread that already holds the gate, for another request of a batch, must not
    /// wait for it: a handoff waiting in between would wait for that thread.)
    pub fn try_fast<'a>(&self, dl: &'a DataLock) -> Option<RwLockReadGuard<'a, ()>> {
        let g = match dl.gate.try_read() {
            Ok(g) => g,
            Err(std::sync::TryLockError::WouldBlock) => return None,
            Err(std::sync::TryLockError::Poisoned(e)) => panic!("inode gate poisoned: {e}"),
        };
        self.stamp(dl);
        dl.ready.load(Ordering::Acquire).then_some(g)
    }

    /// Make `ino`'s cache usable by the fast path: hold its lock at least shared and validate
    /// the cache under that hold, calling `reload` (which reloads the inode under the global
    /// lock) when the version moved since this node's last grant.
    pub fn share(&self, ino: u64, abort: Abort<'_>, reload: &dyn Fn() -> Result<()>) -> Result<()> {
        self.share_or_reload(ino, abort, Some(reload)).map(|_| ())
    }

    /// [`share`](Self::share) for a reader that cannot reload (it does not hold the global
    /// lock: `fs/own_lock_reads.rs`): hold `ino`'s lock at least shared, and tell whether this
    /// node's cached state of the inode is valid under that hold. False: the version moved
    /// since the state was last validated (another node changed the inode, or may have);
    /// then nothing is asked of anyone (the bucket is read first).
    pub fn share_cached(&self, ino: u64, abort: Abort<'_>) -> Result<bool> {
        self.share_or_reload(ino, abort, None)
    }

    fn share_or_reload(
        &self,
        ino: u64,
        abort: Abort<'_>,
        reload: Option<&dyn Fn() -> Result<()>>,
    ) -> Result<bool> {
        let dl = self.lock_of(ino);
        let obj = ObjectId::inode(ino)?;
        loop {
            let (seen, validator) = {
                let s = dl.settled();
                if s.held != Held::Nothing && s.validator == Some(s.version) {
                    dl.ready.store(true, Ordering::Release);
                    return Ok(true);
                }
                (s.handoffs, s.validator)
            };
            if reload.is_none() && !self.version_is(obj, validator)? {
                return Ok(false);
            }
            let Some((grant, mut s)) = self.grant(&dl, obj, LockMode::Shared, seen, abort)? else {
                continue;
            };
            if grant.cache_valid(s.validator) {
                s.validator = Some(grant.version);
                dl.ready.store(true, Ordering::Release);
                return Ok(true);
            }
            drop(s);
            let Some(reload) = reload else {
                return Ok(false);
            };
            self.stats.reloads.fetch_add(1, Ordering::Relaxed);
            reload()?;
            let mut s = dl.settled();
            if s.handoffs == seen && s.version == grant.version {
                s.validator = Some(grant.version);
                dl.ready.store(true, Ordering::Release);
                return Ok(true);
            }
        }
    }

    /// Does `obj`'s entry show version `validator` now (one bucket read)? If not, a shared
    /// grant could not validate the cache ([`share_cached`](Self::share_cached)), and asking
    /// for one would only make an exclusive holder write home and give up its hold, which it
    /// takes back only under the global lock (perhaps the one a silent node keeps). An entry
    /// that is not there counts as the version a shared grant would create it at
    /// ([`first_version`]).
    fn version_is(&self, obj: ObjectId, validator: Option<u64>) -> Result<bool> {
        let Some(v) = validator else {
            return Ok(false);
        };
        let (_, bucket) = self.locks.read_bucket(self.locks.bucket_of(obj))?;
        Ok(bucket
            .entry(obj.raw())
            .map_or_else(|| first_version(&bucket), |e| e.version)
            == v)
    }

    /// Hold `ino`'s lock exclusively before changing its block. The caller holds the global
    /// lock exclusively and the inode's write lock, and its state of the inode is current
    /// (loaded or refreshed under this global hold), so the cache is valid at the new version.
    pub fn own(&self, ino: u64, abort: Abort<'_>) -> Result<()> {
        let dl = self.lock_of(ino);
        let obj = ObjectId::inode(ino)?;
        loop {
            let seen = {
                let mut s = dl.settled();
                if s.held == Held::Exclusive {
                    s.validator = Some(s.version);
                    return Ok(());
                }
                // The cache is not to be used until a grant (no local fast path runs now: the
                // caller holds the inode's write lock). An upgrade gives the shared hold up
                // once it acquires (`grant`).
                dl.ready.store(false, Ordering::Release);
                s.handoffs
            };
            let Some((grant, mut s)) = self.grant(&dl, obj, LockMode::Exclusive, seen, abort)?
            else {
                continue;
            };
            s.moved = s.validator.is_some() && !grant.cache_valid(s.validator);
            s.validator = Some(grant.version);
            return Ok(());
        }
    }

    /// The other nodes' holds of `ino`'s lock now, either mode (one bucket read): what an
    /// exclusive hold of it waits for.
    pub fn held_elsewhere(&self, ino: u64) -> Result<Vec<Mention>> {
        let obj = ObjectId::inode(ino)?;
        let (_, bucket) = self.locks.read_bucket(self.locks.bucket_of(obj))?;
        Ok(bucket
            .entry(obj.raw())
            .map(|e| {
                e.holders()
                    .filter(|m| m.slot != self.me.slot)
                    .copied()
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Acquire `obj` in `mode` (one local acquire at a time) and record the grant, unless a
    /// handoff completed since `seen` (then None: it may have given up what was just granted,
    /// start again). Returns the settled state, locked.
    fn grant<'d>(
        &self,
        dl: &'d DataLock,
        obj: ObjectId,
        mode: LockMode,
        seen: u64,
        abort: Abort<'_>,
    ) -> Result<Option<(Grant, MutexGuard<'d, DlState>)>> {
        self.check_open()?;
        let grant = {
            let _one = Self::acquiring_turn(dl, abort)?;
            if mode == LockMode::Exclusive {
                // An upgrade gives the shared hold up on disk while it waits (and if it then
                // fails, nothing may be held): so does the local state, from here, where the
                // acquire begins, and the fast path stops trusting the cache in the same
                // step (a fast-path thread may have set `ready` again since the caller
                // cleared it: it asks `share` before it takes the inode's read lock). Not
                // before the turn: an abort there changes nothing on disk, and the hold the
                // bucket still shows must stay known here (the sweep gives back only what
                // it knows).
                let mut s = dl.settled();
                if s.handoffs != seen {
                    return Ok(None);
                }
                dl.ready.store(false, Ordering::Release);
                self.set_held(&mut s, Held::Nothing);
            }
            match self.timed(|| self.locks.acquire(self.me, obj, mode, abort)) {
                Ok(g) => g,
                Err(e) => {
                    if mode == LockMode::Exclusive {
                        self.known_again(dl, obj, seen);
                    }
                    return Err(e);
                }
            }
        };
        self.stats.acquires.fetch_add(1, Ordering::Relaxed);
        let mut s = dl.settled();
        if s.handoffs != seen {
            return Ok(None);
        }
        self.set_held(&mut s, Held::of(grant.mode));
        s.version = grant.version;
        // A hold is in use from its grant: one that took a second to come is not idle yet.
        self.stamp(dl);
        Ok(Some((grant, s)))
    }

    /// After a failed upgrade (under the acquiring turn): the acquire may have ended before
    /// it changed the bucket (an abort at its first look, a failed read), which then still
    /// shows this node's shared hold. Know it again, so that the sweep can give it back. The
    /// cache is not trusted again without a reload (no validator): the caller may have
    /// changed the inode in memory before it failed to own it. A failed read leaves the hold
    /// unknown (a request from another node still releases it: the server reads the
    /// bucket).
    fn known_again(&self, dl: &DataLock, obj: ObjectId, seen: u64) {
        let Ok((_, bucket)) = self.locks.read_bucket(self.locks.bucket_of(obj)) else {
            return;
        };
        let mine = bucket
            .entry(obj.raw())
            .and_then(|e| e.mention(self.me.slot))
            .is_some_and(|m| m.gen == self.me.gen && m.role == Role::Holder);
        let mut s = dl.settled();
        if mine && s.handoffs == seen && s.held == Held::Nothing {
            self.set_held(&mut s, Held::Shared);
            s.validator = None;
        }
    }

    /// This node's turn to acquire `dl`'s lock (one local acquire at a time), waiting as
    /// [`ObjectLocks::acquire`] waits: `abort` is asked while another thread of this node
    /// acquires it, so a wait behind that thread (perhaps for a dead holder's recovery) ends
    /// as a wait for the holder itself would — a read under the global lock gives its locks
    /// up after a moment (`fs/detached.rs` rule 3), a fenced node stops.
    fn acquiring_turn<'d>(dl: &'d DataLock, abort: Abort<'_>) -> Result<MutexGuard<'d, ()>> {
        let mut pause = std::time::Duration::from_micros(200);
        loop {
            match dl.acquiring.try_lock() {
                Ok(g) => return Ok(g),
                Err(std::sync::TryLockError::WouldBlock) => {}
                Err(std::sync::TryLockError::Poisoned(e)) => {
                    panic!("inode lock acquire poisoned: {e}")
                }
            }
            if let Some(e) = abort() {
                return Err(e);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(5));
        }
    }

    /// Run `f` (an acquire); note a lock exchange if it had to wait.
    fn timed<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let r = f();
        if t.elapsed() >= std::time::Duration::from_millis(1) {
            self.note_exchange();
        }
        r
    }

    pub fn note_exchange(&self) {
        *self.exchange.lock().or_panic() = Some(Instant::now());
    }

    /// When this node last took part in a lock exchange (for the mailbox poll's pace).
    pub fn last_exchange(&self) -> Option<Instant> {
        *self.exchange.lock().or_panic()
    }

    /// Hand over what these requests (read from this node's mailbox) ask for.
    pub fn serve(&self, reqs: Vec<Request>) -> Result<Served> {
        self.locks.serve_requests(
            self.me,
            reqs,
            &mut Server {
                locks: self,
                to: LockMode::Free,
            },
        )
    }

    /// At unmount, after the last metadata is home: give back every inode lock of this node.
    /// No lock is taken afterwards, and fast-path I/O admitted before is waited for first.
    pub fn release_all(&self) -> Result<()> {
        self.closed.store(true, Ordering::Release);
        let all: Vec<Arc<DataLock>> = self.table.lock().or_panic().values().cloned().collect();
        for dl in &all {
            dl.ready.store(false, Ordering::Release);
            drop(dl.gate.write().or_panic());
            self.set_held(&mut dl.state.lock().or_panic(), Held::Nothing);
        }
        self.locks.scrub_slot(self.me.slot, Some(self.me.gen))?;
        Ok(())
    }

    /// A handoff's first half, with [`drain`](Self::drain): no new fast-path I/O on `dl`, no
    /// local acquire trusts the bucket and [`owns`](Self::owns) says no until
    /// [`handed_to`](Self::handed_to). None (nothing changed) if this node no longer holds
    /// `held`, or another handoff of the lock is in progress: never waits, as the homing hook
    /// calls it holding the volume's own state.
    #[expect(
        clippy::unused_self,
        reason = "one step of the table's handoff, next to handed_to, which uses self"
    )]
    fn seal(&self, dl: &DataLock, held: Held) -> Option<Held> {
        let mut s = dl.state.lock().or_panic();
        if s.handing || s.held != held {
            return None;
        }
        dl.ready.store(false, Ordering::Release);
        s.handing = true;
        Some(held)
    }

    /// After [`seal`](Self::seal): the fast-path I/O admitted before has finished.
    #[expect(
        clippy::unused_self,
        reason = "one step of the table's handoff, next to handed_to, which uses self"
    )]
    fn drain(&self, dl: &DataLock) {
        drop(dl.gate.write().or_panic());
    }

    /// A handoff's second half, after the CAW that was to leave this node holding `to`: it
    /// holds `to` if the CAW's `result` is Ok and it wrote (`now == to`); otherwise it is not
    /// sure what it holds (the bucket showed another hold, or the CAW failed), and the next
    /// acquire reads the bucket. Local acquires that raced the handoff start again. False if
    /// no handoff was in progress.
    pub(super) fn handed_to(
        &self,
        dl: &DataLock,
        to: LockMode,
        now: LockMode,
        result: &Result<()>,
    ) -> bool {
        let mut s = dl.state.lock().or_panic();
        let was = s.handing;
        if was {
            s.handing = false;
            s.handoffs += 1;
            let h = if result.is_ok() && now == to {
                Held::of(to)
            } else {
                Held::Nothing
            };
            self.set_held(&mut s, h);
        }
        dl.changed.notify_all();
        was
    }

    /// Give back this node's hold of `ino` (a handoff nobody asked for: module doc, the
    /// bound), counted in `stats.given_back`.
    fn give_back(&self, ino: u64, dl: &DataLock) -> Result<()> {
        let obj = ObjectId::inode(ino)?;
        crate::failpoint!("inode_lock::before_give_back");
        let Some(seen) = self.homed_and_sealed(ino, dl)? else {
            // Changes not home yet: the next pass looks again.
            return Ok(());
        };
        self.drain(dl);
        let r = if seen == Held::Nothing {
            Ok(LockMode::Free)
        } else {
            self.locks
                .hand_over(self.me, obj, seen.mode(), LockMode::Free)
        };
        let (now, r) = match r {
            Ok(now) => (now, Ok(())),
            Err(e) => (LockMode::Free, Err(e)),
        };
        self.handed_to(dl, LockMode::Free, now, &r);
        r?;
        if seen != Held::Nothing && now == LockMode::Free {
            self.stats.given_back.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Keep the locks this node caches within the bound (module doc): called at every tick
    /// of the `cetra-mailbox` thread. Gives back at most [`SWEEP_BATCH`] locks and works at
    /// most [`SWEEP_BUDGET`] (then the thread serves its mailbox again); a give-back that
    /// fails is skipped (its lock stays, or is known again at its next acquire). True if work
    /// is left for the next round.
    pub fn sweep(&self) -> bool {
        // Work left for the next round (the budget or the batch ran out).
        let mut more = false;
        if self.closed.load(Ordering::Acquire) {
            return more;
        }
        let began = Instant::now();
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        // Idle means unused since before the previous tick's clock: a lock used while this
        // thread was late (slow CAWs, a long drain) carries that clock, so it is not idle.
        let prev = self.clock.swap(now, Ordering::Relaxed);
        let idle_ms = u64::try_from(IDLE_AFTER.as_millis()).unwrap_or(u64::MAX);
        let idle = |dl: &DataLock| dl.used.load(Ordering::Relaxed).saturating_add(idle_ms) <= prev;
        let holding = self.holding();
        let over = holding > self.limit && now >= self.count_retry.load(Ordering::Relaxed);
        let due = self.last_sweep.lock().or_panic().elapsed() >= IDLE_AFTER;
        if !over && !due {
            return more;
        }
        let mut victims: Vec<(u64, Arc<DataLock>)> = Vec::new();
        let mut idle_held: Vec<(u64, Held)> = Vec::new();
        {
            let t = self.table.lock().or_panic();
            if over {
                let excess = holding - self.limit * 7 / 8;
                let mut held: Vec<(u64, u64, &Arc<DataLock>)> = t
                    .iter()
                    .filter(|(_, dl)| idle(dl))
                    .filter(|(_, dl)| {
                        dl.state
                            .try_lock()
                            .is_ok_and(|s| s.held != Held::Nothing && !s.handing)
                    })
                    .map(|(ino, dl)| (dl.used.load(Ordering::Relaxed), *ino, dl))
                    .collect();
                if held.len() < excess {
                    // Too few idle now (more than the limit in use): look again in a while
                    // rather than scanning the whole table at every tick.
                    self.count_retry
                        .store(now + COUNT_RETRY_MS, Ordering::Relaxed);
                }
                let n = excess.min(SWEEP_BATCH).min(held.len());
                more |= n == SWEEP_BATCH;
                if n < held.len() {
                    held.select_nth_unstable_by_key(n, |x| (x.0, x.1));
                }
                victims.extend(held[..n].iter().map(|x| (x.1, Arc::clone(x.2))));
            }
            if due {
                // Only the table refers to these: no loaded inode state uses them (it was
                // evicted, or never used its lock for the data path), and nobody is between
                // `lock_of` and the end of its use.
                let chosen: std::collections::HashSet<u64> = victims.iter().map(|v| v.0).collect();
                let room = SWEEP_BATCH.saturating_sub(victims.len());
                let forgotten: Vec<(u64, Arc<DataLock>)> = t
                    .iter()
                    .filter(|(ino, dl)| {
                        Arc::strong_count(dl) == 1 && idle(dl) && !chosen.contains(ino)
                    })
                    .take(room + 1)
                    .map(|(ino, dl)| (*ino, Arc::clone(dl)))
                    .collect();
                if forgotten.len() <= room {
                    // All found: the next look is due after IDLE_AFTER.
                    *self.last_sweep.lock().or_panic() = Instant::now();
                } else {
                    more = true;
                }
                victims.extend(forgotten.into_iter().take(room));
                // Idle holds of inodes still loaded: sorted out below, outside the table's lock
                // (the keeping hook looks into the inode table).
                let chosen: std::collections::HashSet<u64> = victims.iter().map(|v| v.0).collect();
                idle_held = t
                    .iter()
                    .filter(|(ino, dl)| idle(dl) && !chosen.contains(ino))
                    .filter_map(|(ino, dl)| {
                        let s = dl.state.try_lock().ok()?;
                        (s.held != Held::Nothing && !s.handing).then_some((*ino, s.held))
                    })
                    .collect();
            }
        }
        if !idle_held.is_empty() {
            let room = SWEEP_BATCH.saturating_sub(victims.len());
            let kept = |ino: u64, held: Held| {
                let keep = self.keeping.get().map_or(Held::Nothing, |k| (k.0)(ino));
                keep == Held::Exclusive || keep == held
            };
            let mut back = idle_held
                .into_iter()
                .filter(|&(ino, held)| !kept(ino, held))
                .filter_map(|(ino, _)| self.existing(ino).map(|dl| (ino, dl)));
            victims.extend(back.by_ref().take(room));
            if back.next().is_some() {
                // The rest at the next tick (due again then), not after another second.
                let mut last = self.last_sweep.lock().or_panic();
                *last = Instant::now().checked_sub(IDLE_AFTER).unwrap_or(*last);
            }
        }
        let mut looked = Vec::with_capacity(victims.len());
        for (ino, dl) in victims {
            if began.elapsed() >= SWEEP_BUDGET {
                // More to do: the mailbox thread comes back at once, after its mailbox.
                more = true;
                break;
            }
            if !idle(&dl) {
                // Used since it was chosen: not idle any more.
                continue;
            }
            let held = dl.state.lock().or_panic().held;
            if held != Held::Nothing {
                match self.give_back(ino, &dl) {
                    Ok(()) => {}
                    Err(e) => {
                        self.note_failure(ino, &e);
                        continue;
                    }
                }
            }
            looked.push(ino);
        }
        let mut t = self.table.lock().or_panic();
        for ino in looked {
            let gone = t.get(&ino).is_some_and(|dl| {
                Arc::strong_count(dl) == 1
                    && dl
                        .state
                        .try_lock()
                        .is_ok_and(|s| s.held == Held::Nothing && !s.handing)
            });
            if gone {
                t.remove(&ino);
            }
        }
        if t.capacity() > 1024 && t.capacity() > 4 * t.len() {
            t.shrink_to_fit();
        }
        more
    }

    /// A give-back failed: warn, at most once per [`FAILURE_WARN_EVERY`] (the sweep meets the
    /// same lock again at its next pass).
    fn note_failure(&self, ino: u64, e: &Error) {
        let mut last = self.last_warn.lock().or_panic();
        if last.is_none_or(|t| t.elapsed() >= FAILURE_WARN_EVERY) {
            *last = Some(Instant::now());
            tracing::warn!("giving the idle lock of inode {ino} back failed (retried later): {e}");
        } else {
            tracing::debug!("giving the idle lock of inode {ino} back failed: {e}");
        }
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            crate::bail!(Io, "volume is unmounted: its inode locks were given back");
        }
        Ok(())
    }
}

/// The handoff side, called by [`ObjectLocks::serve_mailbox`] (module doc, rule 3).
struct Server<'a> {
    locks: &'a InodeLocks,
    /// What the last flush was for.
    to: LockMode,
}

impl Handoff for Server<'_> {
    fn flush(&mut self, obj: ObjectId, to: LockMode) -> Result<bool> {
        self.to = to;
        if obj.class() != Class::Inode {
            // Nothing else is taken on this volume yet: nothing cached under it.
            return Ok(true);
        }
        let Some(dl) = self.locks.existing(obj.number()) else {
            return Ok(true);
        };
        // A failure here changes nothing: the request stays for the next tick.
        crate::failpoint!("inode_lock::before_drain");
        if self.locks.homed_and_sealed(obj.number(), &dl)?.is_none() {
            return Ok(false);
        }
        self.locks.drain(&dl);
        Ok(true)
    }

    fn handed(&mut self, obj: ObjectId, now: LockMode, result: &Result<()>) {
        let Some(dl) = self.locks.existing(obj.number()) else {
            return;
        };
        if self.locks.handed_to(&dl, self.to, now, result) && result.is_ok() && now == self.to {
            self.locks.stats.handed.fetch_add(1, Ordering::Relaxed);
        }
    }
}
