//! The closer: what a close (FUSE `RELEASE`, [`Volume::release`]) leaves to the background,
//! so that **no FUSE worker waits at a close for a global lock whose holders are silent**.
//!
//! The kernel does not wait for a `RELEASE`: a process closes a file and goes on. So a close
//! that waits for the global lock holds a FUSE worker while its process opens the next file,
//! and while a dead node holds that lock, a loop that reopens a file (a `dd` loop, a VM
//! restarted) fills every worker with waiting closes within a few dozen passes; from then on
//! the node's opens, reads and lookups wait for the recovery too, whatever they touch
//! (reproduced through FUSE with a `dd` loop, every worker found in a release). Two things a
//! close did under the global lock:
//!
//! 1. **The block pool's return** (`fs/pool.rs`) once the node's last file open for writing
//!    closed. It is the closer thread's now, always: 2 s after that close
//!    (`detached::POOL_IDLE`; a writer opened again meanwhile, as a `dd` loop or a restarted
//!    VM does, keeps the pool, which also spares a refill; so do namespace changes without
//!    the global lock), it takes the global lock on its own thread and gives an idle pool
//!    back ([`Volume::give_idle_pool`], which every handoff of the global lock runs as
//!    well). Once per such close: a pool that stays (a group of it being refilled by a node
//!    that may be dead) goes back at a later handoff, close or unmount. The closer's use of
//!    the global lock does not count as use (`Volume::chore_done`): a lock taken for it alone
//!    goes back at the next idle release (v3), not held idle for a second, when a node that
//!    died would hold up every other node's changes.
//! 2. **The end of an inode's last open**: learning whether another node unlinked it (a
//!    refresh), freeing it if it has no links left, folding a pending mtime the node could
//!    not fold as the inode's owner ([`Volume::finish_close`]). Under the global lock as
//!    before, from the close itself, unless every holder of that lock is silent
//!    (`fs/own_lock_reads.rs` step 1): then the inode is queued, and the closer finishes it
//!    once it has the lock. Meanwhile the inode is only what it was before the close: open
//!    nowhere here, unfreed. A reopen in between is harmless: the free checks the opens
//!    again under the lock. An unmount finishes what is queued first, after the batch the
//!    closer may be finishing. The same on a v2 volume (the stall is judged the same way).
//!
//! What a close still waits for: the global lock while its holders are judged alive (a
//! handoff, milliseconds), and until they are judged silent (three of their heartbeat
//! intervals, 6 s with the defaults; from then on at once, `fs/own_lock_reads.rs` step 1).
//!
//! The kernel's last reference to an inode without links going (a `FORGET`, which is not
//! answered either) frees it the same way, through [`Volume::finish_close_or_defer`].
//!
//! A close of a file this node owns needs neither: its pending mtime goes in without the
//! global lock (`Volume::fold_pending_owned`), and its allocation window is memory.

use super::txn::{Meta, Tx};
use super::{FreeScope, InodeState, Volume};
use crate::error::{ErrorKind, Result};
use crate::sync::LockPolicy;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the closer looks for work (atomics and a short queue, unless there is some).
const POLL: Duration = Duration::from_millis(200);

/// The inodes whose last close waits for the global lock in the background.
#[derive(Debug, Default)]
pub(super) struct Closer {
    deferred: Mutex<Vec<Arc<InodeState>>>,
    /// Held while a batch taken from `deferred` is finished: an unmount waits for the
    /// closer's batch before it goes on.
    finishing: Mutex<()>,
    /// How many closes were deferred since the mount (tests, logs).
    total: std::sync::atomic::AtomicU64,
}

impl Closer {
    fn defer(&self, st: &Arc<InodeState>) {
        let mut q = self.deferred.lock().or_panic();
        if !q.iter().any(|s| Arc::ptr_eq(s, st)) {
            q.push(Arc::clone(st));
            self.total.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn take(&self) -> Vec<Arc<InodeState>> {
        std::mem::take(&mut *self.deferred.lock().or_panic())
    }

    /// How many closes wait for the global lock (not counting a batch being finished).
    pub(super) fn deferred(&self) -> usize {
        self.deferred.lock().or_panic().len()
    }

    /// How many closes were deferred since the mount.
    #[cfg(test)]
    pub(super) fn deferred_total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

impl Volume {
    /// The end of `st`'s last open (or kernel reference) on the global path: from the close
    /// itself, or, queued for the closer, once every holder of the global lock is silent.
    pub(super) fn finish_close_or_defer(&self, st: &Arc<InodeState>) -> Result<()> {
        if self
            .meta_op_unless_stalled(|tx| self.finish_close(tx, st))?
            .is_none()
        {
            tracing::debug!(
                "the close of inode {} waits for the global lock in the background",
                st.ino
            );
            self.closer.defer(st);
        }
        Ok(())
    }

    /// Under the global lock: learn whether another node unlinked `st`, free it if nothing
    /// holds it any more, else fold the mtime of its fast-path writes in.
    fn finish_close(&self, tx: &mut Tx<'_>, st: &InodeState) -> Result<()> {
        match self.refresh(tx, st) {
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            r => r?,
        }
        let mut inner = st.write();
        if inner.freed {
            return Ok(());
        }
        if self.can_free(st, &inner, FreeScope::Now) {
            return self.free_inode(tx, &mut inner);
        }
        if Self::fold_pending(st, &mut inner) {
            self.save(tx, &mut inner)?;
        }
        Ok(())
    }

    /// The queued closes, each in its own transaction under the global lock (waited for).
    /// Unmount: before anything else; the closer: whenever some are queued.
    /// A failure is logged (as a failed close's error went to the kernel, which ignores it).
    pub(super) fn finish_deferred_closes(&self) {
        let _finishing = self.closer.finishing.lock().or_panic();
        let prior = self.lock_use_stamp();
        for st in self.closer.take() {
            if let Err(e) = self.meta_op(|tx| self.finish_close(tx, &st)) {
                tracing::warn!("finishing the close of inode {} failed: {e}", st.ino);
            }
        }
        let m = self.lock_meta();
        self.chore_done(prior);
        drop(m);
    }

    /// Under the global lock (exclusive): a pool that neither writers nor namespace changes
    /// used for a while goes back to the bitmaps (`detached::POOL_IDLE`), so its space is
    /// free on every node again. At every handoff, and from the closer. The pool stays
    /// (logged) if a group of it is being refilled by its owner (format 7) or the return
    /// fails.
    pub(super) fn give_idle_pool(&self, m: &mut Meta) {
        // A namespace change may have parked or pinned a block in the pool since the caller
        // looked: checked under the mutex.
        if !m.has_pool() || !self.detached.pool_idle() || m.inflight().pooled() != 0 {
            return;
        }
        let mut tx = Tx::new(&*self.dev, m);
        let r = tx.return_pool(false);
        let c = tx.commit();
        match r.and(c) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Busy => {
                tracing::debug!("the block pool stays for now: {e}");
            }
            Err(e) => tracing::warn!("giving the idle block pool back failed: {e}"),
        }
    }

    /// The pool's return, once due, under the global lock this thread waits for. Tried once
    /// per close of the node's last writer: a pool that stays (a group of it being refilled
    /// by a node that may be dead, an error) goes back at a later handoff, unmount or close,
    /// not by taking the global lock again and again.
    fn return_pool_when_due(&self) {
        if !self.detached.take_return_due() || !self.lock_meta().has_pool() {
            return;
        }
        let prior = self.lock_use_stamp();
        match self.meta_ex() {
            Ok(mut m) => {
                self.give_idle_pool(&mut m);
                self.chore_done(prior);
                drop(m);
            }
            Err(e) => tracing::debug!("the block pool stays for now: {e}"),
        }
    }

    /// The closer thread (read-write mounts): every [`POLL`], the queued closes and the
    /// pool's return when due.
    pub(super) fn spawn_closer(vol: &Arc<Volume>) {
        let weak = Arc::downgrade(vol);
        let spawned = std::thread::Builder::new()
            .name("cetra-closer".into())
            .spawn(move || loop {
                std::thread::sleep(POLL);
                let Some(v) = weak.upgrade() else { break };
                if v.unmounted.load(Ordering::Acquire) || v.member.is_fenced() {
                    break;
                }
                if v.closer.deferred() > 0 {
                    v.finish_deferred_closes();
                }
                v.return_pool_when_due();
            });
        if let Err(e) = spawned {
            tracing::warn!(
                "no closer thread ({e}): the block pool goes back at the global lock's handoffs and at unmount only, and so do closes that found the global lock's holders silent"
            );
        }
    }
}
