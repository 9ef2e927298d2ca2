//! Allocating writes without the global lock (issue 9 points 3–5; `docs/locking.md` §15,
//! "Allocating writes without the global lock").
//!
//! A node that holds a regular file's inode lock **exclusively** (taken, as every exclusive
//! inode hold is, under the global lock held exclusively: `fs/inode_lock.rs` rule 1) maps new
//! blocks into that file without the global lock, from its block pool (`fs/pool.rs`). Such a
//! *detached* change touches only objects nobody else may touch: the file's inode block and
//! extent-tree nodes (its lock), and the pool inode (this node's own, on its orphan list). No
//! bitmap is read or changed. The rules that keep the rest of the cluster right:
//!
//! 1. **Who may begin.** A detached write begins under the metadata mutex only while this node
//!    owns the inode's lock with a valid cache ([`InodeLocks::owns`]) and no handoff of it has
//!    begun ([`Detached::begin`]: the inode is not *closing*). Otherwise the write takes the
//!    metadata path under the global lock (which also refills the pool).
//! 2. **Home before handoff.** Before an exclusive hold of the inode goes to another node
//!    (a request in the mailbox, or the sweep's give-back), [`Volume::home_for_handoff`]
//!    closes the inode to new detached writes, lets those in flight be mapped (it asks again
//!    at the next tick until none is left), and, if
//!    the inode changed since the journal was last emptied, writes everything home and
//!    empties the journal ([`Meta::close`], as a global-lock handoff does). Its last check
//!    and the seal of the hold (after which [`InodeLocks::owns`] says no) are one critical
//!    section, in which no write can begin and no writer can reopen the inode
//!    ([`Detached::reopen`] asks `owns` there too). Only then is the lock released or
//!    downgraded. So a node that takes the lock next reads the current
//!    inode from disk, and a replay of this node's journal can never write an old image of
//!    the inode's blocks over what the next holder made of them — a newer image, or data in a
//!    block it freed and reused (which has no sequence number for the replay rule of
//!    `docs/recovery.md` to compare).
//! 3. **Reading an inode another node owns.** A node holding the global lock reads a regular
//!    file's inode from disk only if no other node holds its lock exclusively
//!    ([`Volume::before_load`]: one bucket read, at most once per bucket and epoch), else it
//!    first takes the lock shared, which
//!    makes the owner write it home (rule 2). A new exclusive hold needs the global lock
//!    exclusively, so what it found stays true until it gives the global lock up; every
//!    inode loaded under that hold is re-read after (the epoch, `docs/locking.md` §7).
//!    A **read** (`Volume::read_op`), or a change that loads everything before it changes
//!    anything (`Volume::restartable_op`), that waited
//!    [`INODE_LOCK_PATIENCE`] for that shared hold without changing anything stops
//!    waiting there ([`ErrorKind::WaitForLock`]): it gives the metadata mutex back (and
//!    with it the global lock, to whoever asks), waits for the hold with no lock of this
//!    node held ([`Volume::wait_for_inode_lock`]) and starts again, once per inode
//!    ([`Tx::may_restart`]: a live owner could take the lock back each time). Its copy of
//!    the inode's block is dropped from the cache before the mutex goes. An owner that died
//!    holds the lock until its recovery, a dead time (84 s by default), and a `stat` of its
//!    open image would otherwise keep this node's allocating writes and every node's
//!    metadata waiting that long with it. Such a change that waits to *own* an inode another
//!    node holds (`Volume::own_inode`; a dead node that had the file open for reading holds
//!    it shared until its recovery) stops waiting so too, and then waits outside until it
//!    could own it (`Volume::await_holders`: until the holders let go or show they are
//!    alive); so does a write's metadata path (`Volume::plan_slow`).
//! 4. **No wait holds what the owner needs.** The owner's handoff needs its metadata mutex (to
//!    map and commit). A thread waits for the global lock without that mutex
//!    (`Volume::meta_in`: one thread of the node at a time, on its acquiring turn), and does
//!    the owner's part itself when asked if the mutex is free then. A thread that waits for
//!    a shared hold in rule 3 holds the mutex, and therefore does the owner's part itself
//!    when asked ([`Volume::serve_duties`]): maps the detached writes whose data is written,
//!    and makes a commit point. The lock server never blocks on the mutex: it tries it for a
//!    moment, then asks the holder to serve and looks again at the next tick.

use super::inode_lock::{InodeLocks, Seal};
use super::txn::{Meta, Tx};
use super::{Ino, Volume};
use crate::error::{Error, ErrorKind, Result};
use crate::sync::LockPolicy;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// After a refill from a marked group could not top the pool up, the next try waits this long.
const MARKED_REFILL_RETRY: Duration = Duration::from_millis(200);

/// How long a read under the global lock waits for an inode's shared hold before it gives
/// its locks up and waits without them (rule 3). A live owner answers within its mailbox poll
/// (at most 40 ms) plus a write home; only a dead or stuck one takes longer.
pub(super) const INODE_LOCK_PATIENCE: Duration = Duration::from_millis(100);

/// How long the lock server tries the metadata mutex before it asks its holder to serve.
const TRY_META_FOR: Duration = Duration::from_millis(2);

/// Detached writes and changes per inode, read by the lock server without the metadata mutex.
#[derive(Debug)]
pub(crate) struct Detached {
    state: Mutex<State>,
    /// Journal emptyings (`Meta::emptied_counter`).
    emptied: Arc<AtomicU64>,
    /// The lock server could not get the metadata mutex: its holder should serve (rule 4).
    serve_wanted: AtomicBool,
    /// A write took the metadata path to top the pool up (the others go on without).
    refilling: AtomicBool,
    /// When a refill from a marked group last could not top the pool up (format 7).
    marked_refill_failed: Mutex<Option<Instant>>,
    /// Handles open for writing on this node: the pool is given back when none is left.
    writers: std::sync::atomic::AtomicUsize,
    /// When this node last changed the namespace without the global lock, or closed its last
    /// handle open for writing (ms since `base`).
    used: AtomicU64,
    /// The last handle open for writing was closed since the closer last looked at the
    /// pool: it gives it back once idle (`fs/closer.rs`).
    return_wanted: AtomicBool,
    base: Instant,
}

/// What [`Detached::close_and_seal`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Homing {
    /// Nothing in flight, everything home, and the hold is sealed.
    Sealed,
    /// Writes in flight, or changes not home yet.
    NotHome,
    /// Home, but the lock layer could not seal (another handoff of the lock is in progress).
    Refused,
}

#[derive(Debug, Default)]
struct State {
    /// Detached writes in flight, per inode.
    busy: HashMap<Ino, u32>,
    /// Inodes changed without the global lock, with the emptying count when they changed.
    dirty: HashMap<Ino, u64>,
    /// Inodes whose exclusive hold is being handed over: no detached write may begin.
    closing: HashSet<Ino>,
    /// Inodes made without the global lock in a directory this node owns, with that
    /// directory, until its hold is handed over (`fs/detached_ns.rs`, *fresh* inodes).
    fresh: HashMap<Ino, Ino>,
    /// Directories this node took to change without the global lock: when it took each
    /// and last changed it (the hold window, [`DIR_HOLD_MIN`]).
    windows: HashMap<Ino, (Instant, Instant)>,
    /// Directories such a hold of which went to another node, and when: shared by nodes
    /// that all change them, they are changed on the global path for [`CONTENDED_FOR`].
    contended: HashMap<Ino, Instant>,
    /// Contended directories this node holds exclusively after a change on the global path:
    /// given back with the global lock (`Volume::handoff`).
    global_dirs: HashSet<Ino>,
    /// Inodes freed into the pool while the kernel still references their numbers: their
    /// blocks stay pinned there until it forgets them (`fs/detached_ns.rs`).
    kernel_held: HashSet<Ino>,
    /// Fresh inodes unlinked while open here, whose blocks are the pool's on disk
    /// (`fs/detached_ns.rs`, parked).
    parked: HashSet<Ino>,
}

/// How long a directory whose hold another node took is changed on the global path only:
/// nodes changing one directory all the time are served best by the global lock's hold
/// window (each handoff of the directory's own lock would also empty the journal, and make
/// every inode made in it known, so that its next changes take the global path anyway).
pub(crate) const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// A directory this node took exclusively to change without the global lock is handed over
/// once it has held it for this long, or once it has not changed it for [`DIR_HOLD_IDLE`]
/// (the global lock's hold window, `fs/cluster.rs` `HOLD_MIN`, for one directory): nodes
/// creating in one shared directory otherwise paid a handoff, with its journal emptying,
/// for each create.
pub(crate) const DIR_HOLD_MIN: Duration = Duration::from_millis(100);
/// See [`DIR_HOLD_MIN`].
pub(crate) const DIR_HOLD_IDLE: Duration = Duration::from_millis(3);

impl State {
    /// Directory `dir` is contended from now on ([`CONTENDED_FOR`]); stale entries go.
    fn contend(&mut self, dir: Ino) {
        self.contended.retain(|_, t| t.elapsed() < CONTENDED_FOR);
        self.contended.insert(dir, Instant::now());
    }
}

/// Most fresh inodes remembered (then all are forgotten: their next changes take the global
/// path, which is always allowed).
const FRESH_MAX: usize = 65_536;

/// A node whose last namespace change without the global lock and whose last close of a file
/// open for writing are this old, and which has no file open for writing, gives its block
/// pool back: at its next handoff of the global lock, or from the background once its last
/// writer closed (`fs/closer.rs`). A writer closed and opened again at once
/// (a `dd` loop, a VM restarted) keeps the pool.
pub(crate) const POOL_IDLE: Duration = Duration::from_secs(2);

impl Detached {
    pub fn new(emptied: Arc<AtomicU64>) -> Self {
        Self {
            state: Mutex::new(State::default()),
            emptied,
            serve_wanted: AtomicBool::new(false),
            refilling: AtomicBool::new(false),
            marked_refill_failed: Mutex::new(None),
            writers: std::sync::atomic::AtomicUsize::new(0),
            used: AtomicU64::new(0),
            return_wanted: AtomicBool::new(false),
            base: Instant::now(),
        }
    }

    /// A namespace change was made without the global lock.
    pub fn note_ns_use(&self) {
        self.note_use();
    }

    fn note_use(&self) {
        let ms = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.used.store(ms.max(1), Ordering::Release);
    }

    /// May the block pool go back? No handle open for writing, and neither a namespace change
    /// without the global lock nor a close of the last writer for [`POOL_IDLE`].
    pub fn pool_idle(&self) -> bool {
        let used = self.used.load(Ordering::Acquire);
        let idle = used == 0
            || self
                .base
                .elapsed()
                .saturating_sub(Duration::from_millis(used))
                >= POOL_IDLE;
        let s = self.state.lock().or_panic();
        idle && self.writers.load(Ordering::Acquire) == 0
            && s.kernel_held.is_empty()
            && s.parked.is_empty()
    }

    /// Inode `ino` was freed into the pool while the kernel references its number.
    pub fn hold_for_kernel(&self, ino: Ino) {
        self.state.lock().or_panic().kernel_held.insert(ino);
    }

    /// Inode `ino`, unlinked while open here, was parked in the pool.
    pub fn park(&self, ino: Ino) {
        self.state.lock().or_panic().parked.insert(ino);
    }

    /// Is `ino` known to no other node: fresh, or parked (no name left: even once its
    /// directory's hold went, nobody else can reach it)? Its in-memory state is the truth.
    pub fn known_only_here(&self, ino: Ino) -> bool {
        let s = self.state.lock().or_panic();
        s.fresh.contains_key(&ino) || s.parked.contains(&ino)
    }

    /// Is `ino` parked?
    pub fn is_parked(&self, ino: Ino) -> bool {
        self.state.lock().or_panic().parked.contains(&ino)
    }

    /// Was `ino` parked (and is not any more)?
    pub fn take_parked(&self, ino: Ino) -> bool {
        self.state.lock().or_panic().parked.remove(&ino)
    }

    /// The kernel forgot `ino`: was it held for it ([`Detached::hold_for_kernel`])?
    pub fn take_kernel_hold(&self, ino: Ino) -> bool {
        self.state.lock().or_panic().kernel_held.remove(&ino)
    }

    /// `ino` was made without the global lock in directory `dir`, which this node owns.
    pub fn mark_fresh(&self, ino: Ino, dir: Ino) {
        let mut s = self.state.lock().or_panic();
        if s.fresh.len() >= FRESH_MAX {
            s.fresh.clear();
        }
        s.fresh.insert(ino, dir);
    }

    /// Is `ino` fresh: made without the global lock in a directory whose exclusive hold this
    /// node kept since? Then no other node can know it.
    pub fn is_fresh(&self, ino: Ino) -> bool {
        self.state.lock().or_panic().fresh.contains_key(&ino)
    }

    /// `ino` was freed: it is no longer fresh.
    pub fn forget_fresh(&self, ino: Ino) {
        self.state.lock().or_panic().fresh.remove(&ino);
    }

    /// The hold of directory `dir` goes: what was made in it may be seen by others now.
    fn expose(&self, dir: Ino) {
        let mut s = self.state.lock().or_panic();
        s.fresh.retain(|_, d| *d != dir);
        if s.windows.remove(&dir).is_some() {
            s.contend(dir);
        }
    }

    /// Another node changed directory `dir` since this node last held it.
    pub fn mark_contended(&self, dir: Ino) {
        self.state.lock().or_panic().contend(dir);
    }

    /// Contended directory `dir` was changed on the global path and is held exclusively.
    pub fn note_global_dir(&self, dir: Ino) {
        self.state.lock().or_panic().global_dirs.insert(dir);
    }

    /// The directories [`Detached::note_global_dir`] noted since the last call.
    pub fn take_global_dirs(&self) -> Vec<Ino> {
        self.state.lock().or_panic().global_dirs.drain().collect()
    }

    /// Did another node take directory `dir` from a hold of this node's lately
    /// ([`CONTENDED_FOR`])?
    pub fn is_contended(&self, dir: Ino) -> bool {
        self.state
            .lock()
            .or_panic()
            .contended
            .get(&dir)
            .is_some_and(|t| t.elapsed() < CONTENDED_FOR)
    }

    /// Directory `dir` was taken (or kept) exclusively by a change on the global path: its
    /// hold window starts, unless it runs already.
    pub fn dir_taken(&self, dir: Ino) {
        let now = Instant::now();
        self.state
            .lock()
            .or_panic()
            .windows
            .entry(dir)
            .or_insert((now, now));
    }

    /// Directory `dir` was changed without the global lock.
    pub fn dir_used(&self, dir: Ino) {
        if let Some(w) = self.state.lock().or_panic().windows.get_mut(&dir) {
            w.1 = Instant::now();
        }
    }

    /// Is directory `dir` inside its hold window (keep it a little longer)?
    fn in_window(&self, dir: Ino) -> bool {
        self.state
            .lock()
            .or_panic()
            .windows
            .get(&dir)
            .is_some_and(|&(taken, used)| {
                taken.elapsed() < DIR_HOLD_MIN && used.elapsed() < DIR_HOLD_IDLE
            })
    }

    /// A handle open for writing was made.
    pub fn writer_opened(&self) {
        self.writers.fetch_add(1, Ordering::AcqRel);
    }

    /// A handle open for writing was released. This node's last: the pool goes back once
    /// idle ([`Detached::take_return_due`]).
    pub fn writer_closed(&self) {
        if self.writers.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.note_use();
            self.return_wanted.store(true, Ordering::Release);
        }
    }

    /// Should the pool go back now? The last writer closed since this was last true, and
    /// the pool is idle ([`Detached::pool_idle`]): true once per such close.
    pub fn take_return_due(&self) -> bool {
        self.return_wanted.load(Ordering::Acquire)
            && self.pool_idle()
            && self.return_wanted.swap(false, Ordering::AcqRel)
    }

    /// The pool is `low`: should this write take the metadata path to top it up? True for
    /// one write at a time, until [`Detached::refilled`].
    pub fn should_refill(&self, low: bool) -> bool {
        low && !self.refilling.swap(true, Ordering::AcqRel)
    }

    /// The metadata path looked after the pool.
    pub fn refilled(&self) {
        self.refilling.store(false, Ordering::Release);
    }

    /// May a refill from a marked group (`fs/group_marks.rs`) be tried now? Not within
    /// [`MARKED_REFILL_RETRY`] of one that could not, so that writes do not each pay for the
    /// lock-record reads of a refill that cannot succeed.
    pub fn may_refill_marked(&self) -> bool {
        self.marked_refill_failed
            .lock()
            .or_panic()
            .is_none_or(|t| t.elapsed() >= MARKED_REFILL_RETRY)
    }

    /// A refill from a marked group could (true) or could not (false) top the pool up.
    pub fn marked_refill_done(&self, ok: bool) {
        *self.marked_refill_failed.lock().or_panic() = (!ok).then(Instant::now);
    }

    /// A detached write of `ino` begins (caller: the metadata mutex, after
    /// [`InodeLocks::owns`](super::inode_lock::InodeLocks::owns)); false if a handoff closed
    /// the inode.
    pub fn begin(&self, ino: Ino) -> bool {
        let mut s = self.state.lock().or_panic();
        if s.closing.contains(&ino) {
            return false;
        }
        *s.busy.entry(ino).or_default() += 1;
        true
    }

    /// A detached write of `ino` was mapped or failed.
    pub fn end(&self, ino: Ino) {
        let mut s = self.state.lock().or_panic();
        if let Some(n) = s.busy.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                s.busy.remove(&ino);
            }
        }
    }

    /// `ino` changed in a detached transaction (caller: the metadata mutex).
    pub fn changed(&self, ino: Ino) {
        let c = self.emptied.load(Ordering::Acquire);
        self.state.lock().or_panic().dirty.insert(ino, c);
    }

    /// The inode's lock is this node's exclusively again (granted under the global lock):
    /// detached writes may begin again, if `owned` still says so. It is asked in the same
    /// critical section as [`Detached::close_and_seal`]'s seal, so a writer that found the
    /// hold owned just before a handoff sealed it cannot reopen the inode after the seal.
    fn reopen(&self, ino: Ino, owned: impl FnOnce() -> bool) {
        let mut s = self.state.lock().or_panic();
        if owned() {
            s.closing.remove(&ino);
        }
    }

    /// Close `ino` to new detached writes; if nothing is in flight and everything is home,
    /// `seal` the hold (the lock layer: from then on it is not owned, rule 1) and answer
    /// whether that worked. Check and seal are one critical section with [`Detached::begin`]:
    /// a [`Detached::reopen`] by a writer that found the hold owned just before cannot let a
    /// write begin between them (it would be mapped after the lock went, or fail).
    fn close_and_seal(&self, ino: Ino, seal: Seal<'_>) -> Homing {
        let mut s = self.state.lock().or_panic();
        s.closing.insert(ino);
        let emptied = self.emptied.load(Ordering::Acquire);
        let dirty = s.dirty.get(&ino).is_some_and(|&c| emptied <= c);
        if !dirty {
            s.dirty.remove(&ino);
        }
        if dirty || s.busy.contains_key(&ino) {
            Homing::NotHome
        } else if seal() {
            Homing::Sealed
        } else {
            Homing::Refused
        }
    }

    fn busy(&self, ino: Ino) -> bool {
        self.state.lock().or_panic().busy.contains_key(&ino)
    }
}

impl Volume {
    /// Does this node own `st`'s lock with a valid cache (rule 1)?
    pub(super) fn owns_inode(&self, st: &super::InodeState) -> bool {
        // A parked inode (fs/detached_ns.rs) changes on the global path only, which first
        // gives its block back (a lock entry cached from an earlier inode with the same
        // number must not let detached writes grow it).
        !self.detached.is_parked(st.ino)
            && self
                .cl
                .ilocks
                .as_ref()
                .is_some_and(|il| il.owns(st.data_lock(il)))
    }

    /// A small change of an inode this node owns (rule 1), made without the global lock: `f`
    /// runs on a detached transaction under the metadata mutex and the inode's write lock.
    /// Ok(false) (nothing done) when the inode is not owned, a handoff of it has begun, or `f`
    /// refused with [`Volume::refused`] before it touched anything: then the caller takes the
    /// metadata path (as `meta_op` retries such a refusal under the global lock).
    pub(super) fn change_owned(
        &self,
        st: &super::InodeState,
        f: impl FnOnce(&mut Tx<'_>, &mut super::InodeInner) -> Result<()>,
    ) -> Result<bool> {
        if self.read_only || !self.owns_inode(st) {
            return Ok(false);
        }
        let mut meta = self.lock_meta();
        if !self.owns_inode(st) || !self.detached.begin(st.ino) {
            return Ok(false);
        }
        let mut tx = Tx::detached(&*self.dev, &mut meta);
        let mut inner = st.write();
        let r = f(&mut tx, &mut inner);
        drop(inner);
        // What was done is consistent: committed even on error (as meta_op does). A change
        // refused before it touched anything leaves nothing to write home at a handoff.
        let touched = tx.touched();
        let c = tx.commit();
        let r = r.and(c);
        if touched {
            self.detached.changed(st.ino);
        }
        self.detached.end(st.ino);
        drop(meta);
        self.inflight_done.notify_all();
        match r {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::NeedsGlobalLock && !touched => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The error a [`change_owned`](Self::change_owned) closure returns to refuse, before it
    /// changes anything, a change the metadata path must make (`what` names it).
    pub(super) fn refused(what: &str) -> Error {
        Error::new(
            ErrorKind::NeedsGlobalLock,
            format!("{what} on the metadata path"),
        )
    }

    /// Under the global lock, after a change that left `ino`'s lock this node's exclusively:
    /// detached changes of `ino` may begin again, unless a handoff sealed the hold meanwhile
    /// (asked in the detached state's critical section, rule 2).
    pub(super) fn reopen_owned(&self, il: &InodeLocks, ino: Ino) {
        let dl = il.lock_of(ino);
        self.detached.reopen(ino, || il.owns(&dl));
    }

    /// Rule 2: may this node's exclusive hold of `ino` go to another node now? Ok(false) =
    /// not yet (asked again at the next tick). A failed commit point fences the node.
    pub(super) fn home_for_handoff(&self, ino: Ino, seal: Seal<'_>) -> Result<bool> {
        if self.detached.in_window(ino) {
            // A directory in use: asked again at the next tick.
            return Ok(false);
        }
        let ready = self.home_inner(ino, seal)?;
        if ready {
            // Before the lock goes: what was made in the directory is known to others next.
            self.detached.expose(ino);
        }
        Ok(ready)
    }

    fn home_inner(&self, ino: Ino, seal: Seal<'_>) -> Result<bool> {
        match self.detached.close_and_seal(ino, seal) {
            Homing::Sealed => return Ok(true),
            // The other handoff decides; this request is looked at again at the next tick.
            Homing::Refused => return Ok(false),
            Homing::NotHome => {}
        }
        // A failure here changes nothing: the lock stays, the request waits for the next tick.
        crate::failpoint!("detached::before_home");
        let since = Instant::now();
        let mut m = loop {
            if let Some(m) = self.meta.try_lock().or_panic() {
                break m;
            }
            if since.elapsed() >= TRY_META_FOR {
                self.detached.serve_wanted.store(true, Ordering::Release);
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(100));
        };
        if self.detached.busy(ino) {
            // The thread mapping queued writes maps them (it needs only this mutex), or a
            // thread that waits holding it does (rule 4); none may begin (closing). The lock
            // server never waits for them: it serves other requests (perhaps the very one a
            // thread here waits for) and looks again at its next tick.
            drop(m);
            self.detached.serve_wanted.store(true, Ordering::Release);
            return Ok(false);
        }
        // Everything home and the journal emptied: after the lock goes, the next holder may
        // free and reuse the blocks the journal logged, and a replay of an older image over
        // them would corrupt what they then hold (a data block has no sequence number to
        // compare). A failure fences the node (`Meta::fail`) rather than give a lock away.
        m.close(&*self.dev)?;
        drop(m);
        Ok(self.detached.close_and_seal(ino, seal) == Homing::Sealed)
    }

    /// Rule 4: called by a thread that holds the metadata mutex while it waits for the
    /// cluster (or took it for a moment while it waits for the global lock). If the lock
    /// server asked, map the detached writes whose data is written and make a commit point.
    pub(super) fn serve_duties(&self, m: &mut Meta) {
        if !self.detached.serve_wanted.swap(false, Ordering::AcqRel) {
            return;
        }
        self.map_serving(m);
        // A failure fences the node (`Meta::fail`), which logs it.
        if let Err(e) = m.close(&*self.dev) {
            tracing::debug!("serving the lock server while waiting: {e}");
        }
    }

    /// Rule 3: before inode `ino` (a regular file or a directory) is read from disk under the
    /// global lock: if another node owns its lock, hold it shared first (that node writes it
    /// home). (Shared, never exclusive: an exclusive grant marks the cache valid, and it is
    /// not until the read after this succeeded.)
    /// Returns whether the inode was owned elsewhere (a copy read before is stale).
    pub(super) fn before_load(&self, tx: &mut Tx<'_>, ino: Ino) -> Result<bool> {
        let Some(il) = &self.cl.ilocks else {
            return Ok(false);
        };
        let epoch = self.cl.epoch.load(Ordering::Acquire);
        if il.holds_any(ino) || !il.foreign_exclusive(ino, epoch)? {
            return Ok(false);
        }
        let tx = std::cell::RefCell::new(tx);
        let since = Instant::now();
        il.hold_shared(ino, &|| {
            if let Ok(mut t) = tx.try_borrow_mut() {
                // A read its caller starts again waits for the holder (perhaps dead, until
                // its recovery) with no lock of this node held (`Volume::read_op`).
                if let Some(e) = t.stop_waiting(ino, since, false) {
                    return Some(e);
                }
                self.serve_duties(t.meta_mut());
            }
            self.lock_abort()
        })?;
        Ok(true)
    }

    /// After [`ErrorKind::WaitForLock`], with no lock of this node held: hold `ino`'s
    /// lock shared (the exclusive holder wrote it home, or its recoverer replayed it), and
    /// forget the copy of its block read before, so the read that starts again reads it
    /// anew, as [`Volume::before_load`]'s callers do.
    pub(super) fn wait_for_inode_lock(&self, ino: Ino, exclusive: bool) -> Result<()> {
        if let Some(il) = &self.cl.ilocks {
            if exclusive {
                self.await_holders(il, ino)?;
            } else {
                il.hold_shared(ino, &|| self.lock_abort())?;
            }
        }
        Tx::new(&*self.dev, &mut self.lock_meta()).drop_cached(ino);
        Ok(())
    }

    /// The exclusive wait of [`Volume::wait_for_inode_lock`] (a change that waited to own
    /// `ino`): taking nothing, wait until each other node that held `ino`'s lock then has
    /// let it go — a dead one's recoverer releases its holds after the replay — or shown it
    /// is alive: its heartbeat moved at the generation of its hold, the slot still live (a
    /// recoverer's claim of the slot is no sign of life), or it cannot be read. Once every
    /// one of them did either, the change starts again and waits for the live ones holding
    /// its locks, as every change did before: they answer its request within their mailbox
    /// poll. A holder that shows life is watched no more, so a live one does not end the wait
    /// while a dead one still holds the lock. Nothing of this node's holds changes here: its
    /// fast path on the inode, and other nodes' reasoning about exclusive holds (rule 3),
    /// stay as they were. Cost: one bucket read, and one heartbeat read per holder watched,
    /// every 5–100 ms while it waits; and since no request stands while it waits, a live
    /// holder slower than [`INODE_LOCK_PATIENCE`] to hand over costs the change up to one
    /// heartbeat interval more.
    fn await_holders(&self, il: &InodeLocks, ino: Ino) -> Result<()> {
        use crate::format::heartbeat::SlotState;
        // What slot `slot`'s heartbeat says of a hold made at generation `gen`: Some(Some(n)),
        // live at it with counter n; Some(None), not live at it (dead, being recovered, or
        // gone: only the recovery's release ends the hold); None, unreadable.
        let beat = |slot: u32, gen: u64| -> Option<Option<u64>> {
            let raw = crate::cluster::membership::read_slot(&*self.dev, &self.sb, slot).ok()?;
            let h = crate::cluster::membership::decode_slot(&raw, &self.sb, slot).ok()?;
            Some(
                h.filter(|h| h.state == SlotState::Live && h.generation == gen)
                    .map(|h| h.counter),
            )
        };
        // The holders not yet seen alive, each with its heartbeat at the start (an unreadable
        // one counts as alive: the change waits for it holding its locks, as before).
        let mut watched: Vec<_> = il
            .held_elsewhere(ino)?
            .into_iter()
            .filter_map(|m| beat(m.slot, m.gen).map(|b| (m, b)))
            .collect();
        let mut pause = Duration::from_millis(5);
        while !watched.is_empty() {
            if let Some(e) = self.lock_abort() {
                return Err(e);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(100));
            let now = il.held_elsewhere(ino)?;
            // Still held, and no sign of life since the start: still watched.
            watched.retain(|(m, first)| {
                now.contains(m) && beat(m.slot, m.gen).is_some_and(|b| b.is_none() || b == *first)
            });
        }
        Ok(())
    }
}
