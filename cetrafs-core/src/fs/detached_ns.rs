//! Namespace changes without the global lock (issue 9 points 1 and 3; `docs/locking.md` §15,
//! "Namespace changes without the global lock").
//!
//! A node that owns a directory's inode lock **exclusively** (taken, as every exclusive inode
//! hold is, under the global lock held exclusively: the first change of the directory on the
//! global path takes it) creates, renames within it, and removes entries of that directory
//! without the global lock, the way `fs/detached.rs` maps a file's new blocks: a *detached*
//! transaction under the metadata mutex alone, with blocks from this node's pool
//! (`fs/pool.rs`). So three nodes that each work in their own directory no longer take turns
//! on the global lock. What such a change may touch, and why nobody else can see it half-way:
//!
//! 1. **The directory**: its inode block and its entry tree, protected by its lock (owned,
//!    valid cache, no handoff begun: [`Detached::begin`](super::detached::Detached::begin)).
//! 2. **Fresh inodes**: an inode made by such a change (its block taken from the pool) is
//!    *fresh* until the directory's exclusive hold goes to another node. Nobody else can know
//!    its number meanwhile: its only name is in the directory, which nobody else can read
//!    until this node writes it home and gives the lock up (`Volume::home_for_handoff`, which
//!    then ends the freshness: `Detached::expose`). So a fresh inode needs no lock of its own
//!    (no lock I/O per create), and it may be renamed within the directory, unlinked and freed
//!    (into the pool) without the global lock. Any change of it on the global path ends its
//!    freshness (`Volume::own_inode`: it may be moved or linked elsewhere then).
//! 3. **This node's pool inode.** Not its slot header: another node may remove an entry
//!    from it (the last close of an inode this node unlinked), under the global lock, so it
//!    changes under the global lock only. A fresh inode unlinked while the kernel still
//!    references its number is therefore not put on the orphan list: it is freed into the
//!    pool at once, its block *pinned* there (not reused) until the kernel forgets the number
//!    (`Volume::forget`); a crash leaves the block in the pool, which its recovery frees. One
//!    still open here is *parked*: its block becomes the pool's on disk, pinned, while the
//!    inode lives on in memory until its last close frees it, or a change on the global path
//!    gives the block back and puts it on the orphan list (`Volume::own_inode`).
//!
//! No bitmap is read or changed, no slot header, no inode but the directory and fresh ones.
//! Anything else — another directory (a rename across directories), an inode that is not
//! fresh (an owned one is not enough: its own handoff could run meanwhile, only the
//! directory is closed to handoffs while the change runs), the free of a fresh inode that
//! holds more than its own block (its other blocks would be left unowned if it were parked,
//! below), a default ACL to inherit (an xattr set allocates runs),
//! symlinks, whiteouts and exchanges, an inode not loaded (finding whether its block is
//! allocated reads a bitmap) — takes the global path: the operation is refused with
//! `NeedsGlobalLock` **before it changes anything** and runs again under the global lock. A
//! refusal after a change (a bug) fences the node instead of letting half a change reach the
//! LUN.
//!
//! Other nodes read such a directory only after its owner wrote it home: a node reading a
//! directory's inode under the global lock first checks whether another node holds it
//! exclusively (`Volume::before_load`, rule 3 of `fs/detached.rs`, which covers directories
//! as well as regular files) and then takes it shared, which makes the owner write everything
//! home, empty its journal and downgrade.

use super::txn::Tx;
use super::{Attr, Ino, Volume};
use crate::error::{Error, ErrorKind, Result};

/// Most blocks an inode freed without the global lock may hold: its own block only. Then
/// whether it is freed or parked (still open here: `opens` may change under the check, an
/// open takes no lock) only that block goes to the pool, and a file with data, an xattr
/// set or a tree is freed on the global path, into the bitmaps.
const FREE_BLOCKS_MAX: u64 = 1;

impl Volume {
    /// May a detached transaction change inode `ino`? Fresh (rule 2) or owned (rule 3).
    fn may_change_detached(&self, ino: Ino) -> bool {
        if self.detached.is_fresh(ino) {
            return true;
        }
        self.cl
            .ilocks
            .as_ref()
            .is_some_and(|il| il.owns(&il.lock_of(ino)))
    }

    /// Before inode `ino`'s block changes in `tx`: under the global lock, hold its inode lock
    /// exclusively (`fs/inode_lock.rs` rule 1); without it, the inode must be fresh or owned
    /// (else `NeedsGlobalLock`), and an owned one is marked changed so that its handoff
    /// writes it home first.
    pub(super) fn before_change(&self, tx: &mut Tx<'_>, ino: Ino) -> Result<()> {
        if !tx.is_detached() {
            // The caller may have changed the inode in memory already (a save): an attempt
            // that started again would find that change made, so this wait never ends it.
            tx.no_restart();
            return self.own_inode(tx, ino);
        }
        Self::needs_global_unless(self.may_change_detached(ino), ino)?;
        if !self.detached.is_fresh(ino) {
            self.detached.changed(ino);
        }
        Ok(())
    }

    /// In a detached transaction, refuse (before any change) an operation that would change
    /// inode `ino` (a rename's source or victim, an unlink's target) unless it is fresh. An
    /// owned inode is not enough: its own handoff may run meanwhile (only the directory is
    /// closed to handoffs while the change runs, `Detached::begin`).
    pub(super) fn check_fresh(&self, tx: &Tx<'_>, ino: Ino) -> Result<()> {
        if tx.is_detached() {
            Self::needs_global_unless(self.detached.is_fresh(ino), ino)?;
        }
        Ok(())
    }

    /// The same for an inode the operation may free (an unlink's target, a rename's victim):
    /// fresh, and holding at most [`FREE_BLOCKS_MAX`] blocks. An inode freed into the pool
    /// leaves its last image at home and its block marked used, which only this node knows to
    /// be free; and one still open here is parked instead (its block the pool's on disk), which
    /// leaves any other block it held unowned.
    pub(super) fn check_detached_free(
        &self,
        tx: &Tx<'_>,
        st: &super::InodeState,
        inner: &super::InodeInner,
    ) -> Result<()> {
        if tx.is_detached() {
            // Runs a failed change left for a save count: the inode still holds them.
            let ok = self.detached.is_fresh(st.ino)
                && inner.inode.blocks + inner.unfreed_count().1 <= FREE_BLOCKS_MAX;
            Self::needs_global_unless(ok, st.ino)?;
        }
        Ok(())
    }

    fn needs_global_unless(ok: bool, ino: Ino) -> Result<()> {
        if ok {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::NeedsGlobalLock,
            format!("inode {ino} cannot be changed without the global lock here"),
        ))
    }

    /// A namespace change of directory `dir`: without the global lock when this node owns the
    /// directory ([`Volume::in_owned_dir`]), else on the global path, which takes the
    /// directory's lock exclusively (`Volume::save`) and keeps a pool for the next changes.
    pub(super) fn names_op<T>(&self, dir: Ino, f: impl Fn(&mut Tx<'_>) -> Result<T>) -> Result<T> {
        if let Some(r) = self.in_owned_dir(dir, &f) {
            return r;
        }
        // Every namespace change loads what it needs before it changes anything.
        self.restartable_op(|tx| {
            let v = f(tx)?;
            self.keep_names_pool(tx, dir);
            Ok(v)
        })
    }

    /// Under the global lock, after a change of directory `dir` that left it owned by this
    /// node: the next changes may go without the global lock (a pool to take blocks from).
    /// Only costs those changes the global lock if it fails, so a failure is logged.
    fn keep_names_pool(&self, tx: &mut Tx<'_>, dir: Ino) {
        let Some(il) = &self.cl.ilocks else {
            return;
        };
        if self.read_only || !il.owns(&il.lock_of(dir)) {
            return;
        }
        if il.take_moved(dir) {
            self.detached.mark_contended(dir);
        }
        if self.detached.is_contended(dir) {
            // Shared with other nodes: changed on the global path, and its hold goes with the
            // global lock's next handoff, so the next node reads and takes it without a
            // request to this one.
            self.detached.note_global_dir(dir);
            return;
        }
        self.reopen_owned(il, dir);
        self.detached.dir_taken(dir);
        if let Err(e) = tx.ensure_pool(dir) {
            tracing::debug!("the block pool could not be refilled: {e}");
        }
    }

    /// Run namespace change `f` of directory `dir` without the global lock if this node owns
    /// the directory and its pool has room; else (or if `f` refused before changing
    /// anything) None: the caller runs it on the global path.
    pub(super) fn in_owned_dir<T>(
        &self,
        dir: Ino,
        f: impl FnOnce(&mut Tx<'_>) -> Result<T>,
    ) -> Option<Result<T>> {
        let dst = self.owned_dir(dir)?;
        let mut meta = self.lock_meta();
        if !meta.pool_has_room_for_names() || !self.owns_inode(&dst) {
            return None;
        }
        if !self.detached.begin(dir) {
            return None;
        }
        let mut tx = Tx::detached(&*self.dev, &mut meta);
        let r = f(&mut tx);
        let out = self.settle_detached(tx, r);
        if out.is_some() {
            self.detached.dir_used(dir);
        }
        self.detached.end(dir);
        drop(meta);
        self.inflight_done.notify_all();
        out
    }

    /// Commit a detached transaction's outcome, or (None) drop a refusal made before any
    /// change.
    fn settle_detached<T>(&self, mut tx: Tx<'_>, r: Result<T>) -> Option<Result<T>> {
        match r {
            Err(e) if e.kind() == ErrorKind::NeedsGlobalLock => {
                if !tx.touched() {
                    return None;
                }
                // Half a change is in the running transaction: it must never be written.
                tx.fail_node(&e, "a change without the global lock");
                Some(Err(Error::new(
                    ErrorKind::Fenced,
                    format!("a change without the global lock was refused half-way: {e}"),
                )))
            }
            r => {
                self.detached.note_ns_use();
                let c = tx.commit();
                Some(r.and_then(|v| c.map(|()| v)))
            }
        }
    }

    /// Directory `dir`'s loaded state, if this node owns its lock with a valid cache.
    fn owned_dir(&self, dir: Ino) -> Option<std::sync::Arc<super::InodeState>> {
        if self.read_only || self.cl.ilocks.is_none() || self.detached.is_contended(dir) {
            return None;
        }
        let st = self.inodes.get(dir)?;
        {
            let i = st.read();
            if i.freed || !i.inode.is_dir() {
                return None;
            }
        }
        self.owns_inode(&st).then_some(st)
    }

    /// Look `name` up in directory `parent` without the global lock: if this node owns the
    /// directory, and the name is absent or names a fresh or owned inode that is loaded.
    /// None: take the global path.
    pub(super) fn lookup_owned(&self, parent: Ino, name: &[u8]) -> Option<Result<Attr>> {
        if name == b"." || name == b".." {
            return None;
        }
        let dst = self.owned_dir(parent)?;
        let mut meta = self.lock_meta();
        if !self.owns_inode(&dst) {
            return None;
        }
        let mut tx = Tx::detached(&*self.dev, &mut meta);
        let found = {
            let d = dst.read();
            super::dir::dir_lookup(&mut tx, &d.inode, name)
        };
        let e = match found {
            Ok(Some(e)) => e,
            Ok(None) => {
                return Some(Err(Error::new(
                    ErrorKind::NotFound,
                    format!("no entry {:?}", String::from_utf8_lossy(name)),
                )))
            }
            Err(e) => return Some(Err(e)),
        };
        if !self.may_change_detached(e.ino) {
            return None;
        }
        let st = self.inodes.get(e.ino)?;
        if st.read().freed {
            return None;
        }
        Some(Ok(Self::attr_with_pending(&st)))
    }

    /// Free fresh inode `st` (no links, nothing holds it) without the global lock, into the
    /// pool. None: not fresh any more, or refused: take the global path.
    pub(super) fn free_fresh(&self, st: &super::InodeState) -> Option<Result<()>> {
        if self.read_only || !self.detached.is_fresh(st.ino) {
            return None;
        }
        let mut meta = self.lock_meta();
        // Checked again under the mutex: a handoff of its directory ends the freshness.
        if !self.detached.is_fresh(st.ino) || !meta.pool_has_room_for_names() {
            return None;
        }
        let mut tx = Tx::detached(&*self.dev, &mut meta);
        let r = (|| {
            // Nothing on this node opens it any more: its allocation window goes (memory).
            tx.forget_owner(st.ino);
            let mut inner = st.write();
            if !self.can_free(st, &inner, super::FreeScope::Now) {
                return Ok(());
            }
            self.free_inode(&mut tx, &mut inner)
        })();
        let out = self.settle_detached(tx, r);
        drop(meta);
        out
    }
}
