//! Per-inode cluster locks for the data path (format v3, `INCOMPAT_OBJECT_LOCKS`; issue 9
//! point 4). The protocol on disk is `cluster/object_lock.rs`; this module is the
//! filesystem's side of it: the per-inode local state, the rules for using a cached block map
//! without the global lock, and the handoff that a request in this node's mailbox triggers.
//!
//! # What an inode lock protects, in this design
//! The **global lock** (record 0) still serializes every metadata change and protects every
//! metadata read (docs/locking.md §4–§5). On a v3 volume, **inode lock *i*** additionally
//! protects *inode i's block as cached by a node that does not hold the global lock*: its
//! extent map, size, flags and mode, which is all the data path reads. The rules:
//!
//! 1. **Writers**: every change of inode *i*'s block is made under the global lock held
//!    exclusively *and* inode lock *i* held exclusively ([`InodeLocks::own`]). Operations that
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
//! 3. **Handoff** ([`Server`], run by the `cetra-mailbox` thread on a request): stop new
//!    fast-path I/O on *i* (`ready` cleared), wait for the fast-path I/O in flight (the
//!    `gate`), then release or downgrade. Nothing needs writing home here: the change that
//!    moved *i*'s version is journaled under the global lock, whose own handoff writes
//!    everything home before another node can take it (§5), and a node whose cache of *i* is
//!    stale can only reload *i* under the global lock. Journal replay safety is therefore the
//!    global lock's rule, unchanged.
//! 4. **Order**: global lock → metadata mutex → the inode's write/read lock → its gate. A
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
//! would rewrite each other's mention). Entries live in [`InodeLocks`]'s table for the life of
//! the mount (one per inode this node ever locked: a few dozen bytes each).
//!
//! A v2 volume has no lock area: the data path keeps using the global lock (fs/cluster.rs).

use crate::cluster::lock::Me;
use crate::cluster::object_lock::{Class, Grant, Handoff, ObjectId, ObjectLocks, Served};
use crate::error::{Error, Result};
use crate::format::lock_record::LockMode;
use crate::format::mailbox::Request;
use crate::sync::LockPolicy;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard};
use std::time::Instant;

/// One inode's lock as this node sees it (module doc).
#[derive(Debug, Default)]
pub(crate) struct DataLock {
    state: Mutex<DlState>,
    changed: Condvar,
    acquiring: Mutex<()>,
    gate: RwLock<()>,
    ready: AtomicBool,
}

#[derive(Debug, Default)]
struct DlState {
    held: Held,
    version: u64,
    validator: Option<u64>,
    handing: bool,
    handoffs: u64,
}

/// What this node holds of one inode lock.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Held {
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
}

impl InodeLockStats {
    /// (acquires, reloads, handed) now.
    pub fn snapshot(&self) -> (u64, u64, u64) {
        (
            self.acquires.load(Ordering::Relaxed),
            self.reloads.load(Ordering::Relaxed),
            self.handed.load(Ordering::Relaxed),
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
    pub stats: InodeLockStats,
}

/// What to do when a fenced or unmounting node should stop waiting for a lock.
pub(crate) type Abort<'a> = &'a dyn Fn() -> Option<Error>;

impl InodeLocks {
    pub fn new(locks: ObjectLocks, me: Me) -> Self {
        Self {
            locks,
            me,
            table: Mutex::new(HashMap::new()),
            exchange: Mutex::new(None),
            closed: AtomicBool::new(false),
            stats: InodeLockStats::default(),
        }
    }

    pub fn object_locks(&self) -> &ObjectLocks {
        &self.locks
    }

    /// Log the counters at debug level if they moved since `last`.
    pub fn report(&self, last: &mut (u64, u64, u64)) {
        let now = self.stats.snapshot();
        if now != *last {
            let held = self.table.lock().or_panic().len();
            tracing::debug!(
                "inode locks: {} known, {} acquires, {} reloads after another node's change, {} handed to other nodes",
                held,
                now.0,
                now.1,
                now.2
            );
            *last = now;
        }
    }

    /// The local state of inode `ino`'s lock (created on first use).
    pub fn lock_of(&self, ino: u64) -> Arc<DataLock> {
        self.table.lock().or_panic().entry(ino).or_default().clone()
    }

    fn existing(&self, ino: u64) -> Option<Arc<DataLock>> {
        self.table.lock().or_panic().get(&ino).cloned()
    }

    /// May the fast path use the cache now (a hint: [`fast`](Self::fast) decides)?
    pub fn is_ready(&self, dl: &DataLock) -> bool {
        dl.ready.load(Ordering::Acquire)
    }

    /// The fast path's admission: a shared hold on the gate if the cache may be used now, None
    /// if [`share`](Self::share) must run first. Take it after the inode's read lock.
    pub fn fast<'a>(&self, dl: &'a DataLock) -> Option<RwLockReadGuard<'a, ()>> {
        let g = dl.gate.read().or_panic();
        dl.ready.load(Ordering::Acquire).then_some(g)
    }

    /// Make `ino`'s cache usable by the fast path: hold its lock at least shared and validate
    /// the cache under that hold, calling `reload` (which reloads the inode under the global
    /// lock) when the version moved since this node's last grant.
    pub fn share(&self, ino: u64, abort: Abort<'_>, reload: &dyn Fn() -> Result<()>) -> Result<()> {
        let dl = self.lock_of(ino);
        let obj = ObjectId::inode(ino)?;
        loop {
            let seen = {
                let s = dl.settled();
                if s.held != Held::Nothing && s.validator == Some(s.version) {
                    dl.ready.store(true, Ordering::Release);
                    return Ok(());
                }
                s.handoffs
            };
            let Some((grant, mut s)) = self.grant(&dl, obj, LockMode::Shared, seen, abort)? else {
                continue;
            };
            if grant.cache_valid(s.validator) {
                s.validator = Some(grant.version);
                dl.ready.store(true, Ordering::Release);
                return Ok(());
            }
            drop(s);
            self.stats.reloads.fetch_add(1, Ordering::Relaxed);
            reload()?;
            let mut s = dl.settled();
            if s.handoffs == seen && s.version == grant.version {
                s.validator = Some(grant.version);
                dl.ready.store(true, Ordering::Release);
                return Ok(());
            }
        }
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
                // An upgrade may give the shared hold up while it waits (and if it then fails,
                // nothing is held): the cache is not to be used until a grant (no local fast
                // path runs now: the caller holds the inode's write lock).
                dl.ready.store(false, Ordering::Release);
                s.held = Held::Nothing;
                s.handoffs
            };
            let Some((grant, mut s)) = self.grant(&dl, obj, LockMode::Exclusive, seen, abort)?
            else {
                continue;
            };
            s.validator = Some(grant.version);
            return Ok(());
        }
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
            let _one = dl.acquiring.lock().or_panic();
            self.timed(|| self.locks.acquire(self.me, obj, mode, abort))?
        };
        self.stats.acquires.fetch_add(1, Ordering::Relaxed);
        let mut s = dl.settled();
        if s.handoffs != seen {
            return Ok(None);
        }
        s.held = Held::of(grant.mode);
        s.version = grant.version;
        Ok(Some((grant, s)))
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
        self.locks
            .serve_requests(self.me, reqs, &mut Server { locks: self })
    }

    /// At unmount, after the last metadata is home: give back every inode lock of this node.
    /// No lock is taken afterwards, and fast-path I/O admitted before is waited for first.
    pub fn release_all(&self) -> Result<()> {
        self.closed.store(true, Ordering::Release);
        let all: Vec<Arc<DataLock>> = self.table.lock().or_panic().values().cloned().collect();
        for dl in &all {
            dl.ready.store(false, Ordering::Release);
            drop(dl.gate.write().or_panic());
            dl.state.lock().or_panic().held = Held::Nothing;
        }
        self.locks.scrub_slot(self.me.slot, Some(self.me.gen))?;
        Ok(())
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
}

impl Handoff for Server<'_> {
    fn flush(&mut self, obj: ObjectId, _to: LockMode) -> Result<bool> {
        if obj.class() != Class::Inode {
            // Nothing else is taken on this volume yet: nothing cached under it.
            return Ok(true);
        }
        let Some(dl) = self.locks.existing(obj.number()) else {
            return Ok(true);
        };
        // A failure here changes nothing: the request stays for the next tick.
        crate::failpoint!("inode_lock::before_drain");
        {
            let mut s = dl.settled();
            dl.ready.store(false, Ordering::Release);
            s.handing = true;
        }
        // Wait out the fast-path I/O that was admitted before `ready` was cleared.
        drop(dl.gate.write().or_panic());
        Ok(true)
    }

    fn handed(&mut self, obj: ObjectId, to: LockMode, result: &Result<()>) {
        let Some(dl) = self.locks.existing(obj.number()) else {
            return;
        };
        let mut s = dl.state.lock().or_panic();
        if s.handing {
            s.handing = false;
            s.handoffs += 1;
            s.held = if result.is_ok() {
                Held::of(to)
            } else {
                // Unknown: the next acquire reads the bucket.
                Held::Nothing
            };
            if result.is_ok() {
                self.locks.stats.handed.fetch_add(1, Ordering::Relaxed);
            }
        }
        dl.changed.notify_all();
    }
}
