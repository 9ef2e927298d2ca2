//! Reads while the global lock's holder is silent: answered from objects this node's own
//! inode locks validate (format v3 and later; docs/locking.md §15 "Reads while the global
//! lock's holder is silent").
//!
//! A lookup or a `getattr` that needs the global lock (a shared hold: the inode or directory
//! is not validated under a hold of its own lock now) normally waits for it. A node that died
//! holding it exclusively keeps it until its recovery, a dead time (84 s by default), and
//! every other node's `open`, `stat` and path walk waited that long with it, although most
//! of what they read was never touched by the dead node. So:
//!
//! 1. the thread of this node that waits for the global lock notes, at every round, whether
//!    every holder is **silent** (`Cluster::note_global_holders`: its heartbeat has not moved
//!    for three of its intervals, or it is being recovered); a lookup, `getattr` or `readdir`
//!    then stops waiting (`Volume::meta_unless_stalled`), also one that waits for this
//!    node's acquiring turn meanwhile, and for 100 ms one that begins a wait of its own
//!    (then the record is read again);
//! 2. if the object's bucket shows the version this node's loaded state of it was last
//!    validated at (at a grant of this node, or when it last loaded the object from home
//!    under the global lock: `InodeLocks::note_reloaded`), it takes the object's own lock shared ([`InodeLocks::share_cached`]: one
//!    CAW, or a request to a holder, which writes it home first; a holder that does not
//!    answer within [`INODE_LOCK_PATIENCE`] is not waited for) and uses that state; a
//!    version that moved asks nothing of anyone (an exclusive holder asked would give up a
//!    hold it takes back only under the global lock). Every change of an inode another node
//!    can know takes its lock exclusively first, and that grant happens under the global
//!    lock (rule 1 of §15; the owner's later changes without the global lock are under that
//!    same exclusive hold, and a fresh inode is known only to its maker): an unmoved version
//!    means nobody changed the inode, or a directory's entries, since this node last read
//!    them under the global lock (when every change before was home) or under a hold of
//!    their own;
//! 3. a lookup reads the directory's entries under the metadata mutex (through the block
//!    cache, which the last grant of the global lock after another node's changes emptied)
//!    and checks afterwards that the directory's hold was valid throughout
//!    ([`InodeLocks::still_valid`]: a handoff marks itself before its CAW, so another node's
//!    write of those blocks cannot have begun); the inode the name leads to must be loaded
//!    here and pass step 2 as well;
//! 4. anything else — an object not loaded, one whose version moved, a read that raced a
//!    handoff — waits for the global lock as before, except a listing's names: one whose
//!    inode is not validated is listed without attributes unless the kernel was given that
//!    inode's attributes ([`Volume::listed_without_attributes`]).
//!
//! This node does not hold the global lock here (or another of its threads has just taken
//! it), so nothing of its own global-path changes is left unwritten at home (its handoff of
//! the global lock wrote them all), and a read through a detached transaction sees its own
//! detached changes (the running transaction's blocks come before the cache and the
//! device). A fenced node validates nothing this way. Only reads take this path: a change
//! still needs the global lock, or the object owned (`fs/detached.rs`,
//! `fs/detached_ns.rs`). A dead node therefore blocks only what it held and what changed
//! since this node last read it. The cost: a bucket read per object, a shared hold of each
//! object validated (another node's next change of it asks this node for it through its
//! mailbox), only while the global lock's holders are silent.

use super::detached::INODE_LOCK_PATIENCE;
use super::txn::Tx;
use super::{InodeState, Volume};
use crate::dev::aligned::AlignedBuf;
use crate::error::{Error, ErrorKind, Result};
use crate::format::inode::Inode;
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};
use crate::fs::types::{Attr, DirListEntry};
use std::sync::Arc;
use std::time::Instant;

impl Volume {
    /// A read under the global lock (`global`), or, once every holder of the global lock is
    /// silent, `by_own_locks` (steps 2 and 3 of the module doc); when that cannot answer
    /// (None), the global lock is waited for after all (step 4).
    pub(super) fn read_or_by_own_locks<T>(
        &self,
        global: impl Fn(&mut Tx<'_>) -> Result<T>,
        by_own_locks: impl FnOnce() -> Option<Result<T>>,
    ) -> Result<T> {
        if let Some(v) = self.read_op_unless_stalled(&global)? {
            return Ok(v);
        }
        if let Some(r) = by_own_locks() {
            return r;
        }
        self.read_op(global)
    }

    /// [`Volume::read_op`] that gives up (None) instead of waiting on once every holder of
    /// the global lock is silent (step 1 of the module doc). A v2 volume has no inode locks
    /// to validate anything by: it waits.
    pub(super) fn read_op_unless_stalled<T>(
        &self,
        f: impl Fn(&mut Tx<'_>) -> Result<T>,
    ) -> Result<Option<T>> {
        self.read_op_or_stop(self.cl.ilocks.is_some(), f)
    }

    /// [`Volume::read_op`], or with `may_stop` None once every holder of the global lock is
    /// silent (also the last close's refresh, `fs/closer.rs`).
    pub(super) fn read_op_or_stop<T>(
        &self,
        may_stop: bool,
        f: impl Fn(&mut Tx<'_>) -> Result<T>,
    ) -> Result<Option<T>> {
        self.restarting(|waited| {
            let meta = if may_stop {
                self.meta_unless_stalled(crate::format::lock_record::LockMode::Shared)?
            } else {
                Some(self.meta_sh()?)
            };
            let Some(mut meta) = meta else {
                return Ok(None);
            };
            f(&mut Tx::restartable(&*self.dev, &mut meta, waited)).map(Some)
        })
    }

    /// Is this node's loaded state `st` valid under a hold of its own lock, taken now if need
    /// be (step 2)? False also on a v2 volume, for a freed inode, and when the lock cannot be
    /// taken: a hold another node keeps (perhaps the silent one, until its recovery) is
    /// waited for [`INODE_LOCK_PATIENCE`], then the answer is no.
    pub(super) fn validated_by_own_lock(&self, st: &InodeState) -> bool {
        // A fenced node answers nothing from its caches.
        if self.lock_abort().is_some() || st.read().freed {
            return false;
        }
        if self.is_current_unlocked(st) {
            return true;
        }
        let Some(il) = &self.cl.ilocks else {
            return false;
        };
        let since = Instant::now();
        let abort = || {
            self.lock_abort().or_else(|| {
                (since.elapsed() >= INODE_LOCK_PATIENCE).then(|| {
                    Error::new(
                        ErrorKind::Busy,
                        "another node keeps its lock: not waited for",
                    )
                })
            })
        };
        match il.share_cached(st.ino, &abort) {
            Ok(valid) => valid && il.is_valid(st.data_lock(il)) && !st.read().freed,
            Err(e) => {
                tracing::debug!("inode {}: its own lock was not had: {e}", st.ino);
                false
            }
        }
    }

    /// The loaded state of `ino` if [`Volume::validated_by_own_lock`] says it is valid.
    pub(super) fn state_by_own_lock(&self, ino: u64) -> Option<Arc<InodeState>> {
        let st = self.inodes.get(ino)?;
        self.validated_by_own_lock(&st).then_some(st)
    }

    /// Read directory `dir`'s blocks with `f` without the global lock (step 3). None: not
    /// validated by its own lock, the hold did not stay valid throughout (a handoff began
    /// meanwhile), or `f` failed: the global path must answer (and says what is wrong, if
    /// something is).
    pub(super) fn read_dir_by_own_lock<T>(
        &self,
        dir: u64,
        f: impl FnOnce(&mut Tx<'_>, &Inode) -> Result<T>,
    ) -> Option<T> {
        let il = self.cl.ilocks.as_ref()?;
        let dst = self.inodes.get(dir)?;
        if !dst.read().inode.is_dir() || !self.validated_by_own_lock(&dst) {
            return None;
        }
        let dl = dst.data_lock(il);
        let token = il.valid_since(dl)?;
        let r = {
            let mut meta = self.lock_meta();
            let mut tx = Tx::detached(&*self.dev, &mut meta);
            let d = dst.read();
            f(&mut tx, &d.inode)
        };
        if !il.still_valid(dl, token) {
            return None;
        }
        r.ok()
    }

    /// Entry `e` of a directory read by [`Volume::read_dir_by_own_lock`], whose inode is not
    /// validated: listed without attributes (placeholders the kernel does not cache, a
    /// `stat` asks again), or None — wait for the global lock — if the kernel was given the
    /// inode's attributes (it would apply the placeholders to the inode it has; one it knows
    /// only from placeholders is listed so again), if the inode is fresh, or if its
    /// generation cannot be read. The generation is the inode's own, from its home copy (the
    /// kernel takes a different one for a reused number and fails the open files of the
    /// inode it has): the name was in the validated directory, so the number was not reused
    /// when the directory was read, and the generation at home is current even if the rest
    /// of the inode is not.
    pub(super) fn listed_without_attributes(&self, e: &DirListEntry) -> Option<Attr> {
        if e.name == b"." || e.name == b".." {
            // The kernel makes nothing of a dot entry's attributes.
            return Some(Attr::placeholder(e.ino, e.kind));
        }
        // A fresh inode's block at home may still hold an earlier inode's image (its
        // state is this node's only copy: fs/detached_ns.rs).
        if self.inodes.given_attributes(e.ino)
            || self.detached.known_only_here(e.ino)
            || self.lock_abort().is_some()
        {
            return None;
        }
        let mut buf = AlignedBuf::new(FS_BLOCK_SIZE);
        self.dev
            .read_at(e.ino.checked_mul(FS_BLOCK)?, &mut buf)
            .ok()?;
        let generation = Inode::decode(&buf, e.ino).ok()?.generation;
        Some(Attr {
            generation,
            ..Attr::placeholder(e.ino, e.kind)
        })
    }

    /// Look `name` up in directory `parent` without the global lock (step 3). None: the
    /// global path must answer.
    pub(super) fn lookup_by_own_locks(&self, parent: u64, name: &[u8]) -> Option<Result<Attr>> {
        if name == b"." || name == b".." {
            return None;
        }
        let found =
            self.read_dir_by_own_lock(parent, |tx, d| super::dir::dir_lookup(tx, d, name))?;
        let Some(e) = found else {
            return Some(Err(Error::new(
                ErrorKind::NotFound,
                format!("no entry {:?}", String::from_utf8_lossy(name)),
            )));
        };
        let st = self.state_by_own_lock(e.ino)?;
        Some(Ok(Self::attr_with_pending(&st)))
    }
}
