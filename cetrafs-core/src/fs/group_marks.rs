//! Group marks (format 7, `INCOMPAT_GROUP_MARKS`; `docs/locking.md` §9 "Group marks"): a
//! node refills its block pool from a group it owns **without the global lock**, so a thin
//! image keeps growing while another node holds the global lock — or died holding it.
//!
//! # The rule
//! A group's bitmap and header change only
//! * under the global lock held exclusively, in a group nobody owns or this node owns, as
//!   before;
//! * under the global lock held exclusively, in a group **another** node owns, only while the
//!   group's lock record carries this node's *mark* (its `next` field names this node). The
//!   allocator asks for the mark before it loads such a group ([`MarkGate`], alloc.rs), and
//!   the marks go at the global lock's handoff, after everything is home and the journal
//!   emptied ([`Volume::unmark_groups`]);
//! * **without** the global lock, by the group's owner, while the owner's mark is on it:
//!   [`Volume::refill_marked`] marks one of its groups, reads the group's header again
//!   (another node may have changed it under its own mark), takes a refill's worth of blocks
//!   into the pool in one transaction, makes a commit point (journal, then every block home)
//!   and only then takes the mark off, publishing the group's free count.
//!
//! So at most one node changes a group at any time, and whoever changes it next reads what the
//! last one wrote home (the header's sequence number tells a stale cached bitmap). A replay of
//! a dead node's journal cannot roll a group back either: each logged bitmap block and header
//! carries its sequence number, and replay writes a block only over an older one
//! (`docs/recovery.md`, "The replay rule").
//!
//! # Waiting, dying
//! A refill holds its mark for one commit point (a few milliseconds). A node under the global
//! lock that finds another node's mark waits for it at most [`MARK_PATIENCE`] (it holds the
//! global lock meanwhile, and a dead marker is recovered only by a node that takes the global
//! lock), and not again while the same mark stays: then an allocation skips the group, a
//! discard leaves it alone, and a free fails with `Busy` before it changes anything (an
//! unlink or a rename over a last link marks every group the inode's blocks lie in before
//! it removes the name: `Volume::prepare_inode_free`). Looking up an inode in such a group
//! needs no mark (alloc.rs `is_used`). A refill that finds another node's mark tries its next group, and
//! without one takes the global path as before. A dead node's marks are taken off by its
//! recoverer after its journal is replayed, with its other locks (`LockTable::scrub_slot`).
//! A refill whose commit point fails leaves its mark and fences this node: what reached the
//! disk is unknown, so the others must recover it before anyone uses the group again.

use super::txn::{Meta, Tx};
use super::Volume;
use crate::alloc::GroupGate;
use crate::cluster::lock::{GroupMark, LockTable, Me};
use crate::error::Result;
use crate::format::lock_record::LockMode;
use crate::sync::LockPolicy;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What [`Volume::refill_from`] did.
enum Refill {
    /// Committed and home; whether the pool got blocks.
    Home(bool),
    /// Failed before its transaction took anything.
    Undone(crate::error::Error),
}

/// How long a node under the global lock waits for another node's mark on a group.
pub const MARK_PATIENCE: Duration = Duration::from_secs(1);

/// The allocator's [`GroupGate`] on a format-7 volume: this node's mark, through the lock
/// table.
#[derive(Debug)]
pub(super) struct MarkGate {
    locks: Arc<LockTable>,
    me: Me,
    /// Groups whose mark outlasted [`MARK_PATIENCE`], with the slot whose mark it was: while
    /// that mark stays, the next use of the group does not wait again (a node that died
    /// during a refill keeps its mark until it is recovered).
    stuck: Mutex<HashMap<u64, u32>>,
}

impl MarkGate {
    pub fn new(locks: Arc<LockTable>, me: Me) -> Self {
        Self {
            locks,
            me,
            stuck: Mutex::new(HashMap::new()),
        }
    }
}

impl GroupGate for MarkGate {
    fn mark(&self, g: u64) -> Result<bool> {
        let start = Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            crate::failpoint!("group::mark");
            match self.locks.mark_group(g, self.me, false)? {
                GroupMark::Marked => {
                    self.stuck.lock().or_panic().remove(&g);
                    return Ok(true);
                }
                GroupMark::NotMine => return Ok(false),
                GroupMark::Busy(slot) => {
                    let mut stuck = self.stuck.lock().or_panic();
                    if stuck.get(&g) == Some(&slot) {
                        return Ok(false);
                    }
                    if start.elapsed() >= MARK_PATIENCE {
                        tracing::warn!(
                            "allocation group {g}: node slot {slot}'s mark stayed for {} ms; not using the group while it stays",
                            MARK_PATIENCE.as_millis()
                        );
                        stuck.insert(g, slot);
                        return Ok(false);
                    }
                }
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
}

impl Volume {
    /// Format 7, under the metadata mutex, without the global lock held exclusively: top the
    /// pool up from a group this node owns (module docs). True if the pool got blocks; false
    /// if it could not (the caller takes the global path, as on older volumes).
    pub(super) fn refill_marked(&self, m: &mut Meta) -> bool {
        if !self.sb.has_group_marks()
            || self.read_only
            || m.gml() == LockMode::Exclusive
            || !m.pool_is_low()
            || m.inflight().holds_bitmap_blocks()
        {
            return false;
        }
        let me = self.cl.me;
        for (g, _) in m.groups().mine_by_free() {
            match self.cl.locks.mark_group(g, me, true) {
                Ok(GroupMark::Marked) => {}
                Ok(GroupMark::Busy(_) | GroupMark::NotMine) => continue,
                Err(e) => {
                    tracing::debug!("marking allocation group {g} failed: {e}");
                    return false;
                }
            }
            match self.refill_from(m, g) {
                Ok(Refill::Home(taken)) => {
                    let free = m.groups().group_free(g);
                    match self.unmark(g, free) {
                        Ok(()) => {
                            if let Some(free) = free {
                                m.groups().note_published(g, free);
                            }
                        }
                        // Still ours: the next refill of this group takes it off.
                        Err(e) => {
                            tracing::warn!("taking the mark off allocation group {g} failed: {e}");
                        }
                    }
                    if taken {
                        tracing::debug!(
                            "refilled the block pool from group {g} without the global lock"
                        );
                        return true;
                    }
                }
                Ok(Refill::Undone(e)) => {
                    // Nothing of it reached a transaction (the allocator undid its part).
                    tracing::warn!("refilling the pool from allocation group {g} failed: {e}");
                    let _ = self.unmark(g, None);
                    return false;
                }
                Err(e) => {
                    // Committed in memory, perhaps journaled, perhaps partly home: unknown. The
                    // mark stays until the others have recovered this node.
                    self.member.fence(format!(
                        "metadata commit of a pool refill from allocation group {g} failed: {e}"
                    ));
                    return false;
                }
            }
        }
        false
    }

    /// Step 2 of [`Volume::refill_marked`], with `g` marked: the transaction and its commit
    /// point. An error here is one after the transaction took the blocks.
    fn refill_from(&self, m: &mut Meta, g: u64) -> Result<Refill> {
        let mut tx = Tx::detached(&*self.dev, m);
        let taken = match tx.refill_pool_marked(g) {
            Ok(t) => t,
            Err(e) => return Ok(Refill::Undone(e)),
        };
        crate::failpoint!("group::before_commit");
        tx.commit()?;
        crate::failpoint!("group::before_home");
        m.commit_point(&*self.dev)?;
        Ok(Refill::Home(taken))
    }

    /// This node's mark off group `g`, publishing `free` if given.
    fn unmark(&self, g: u64, free: Option<u64>) -> Result<()> {
        crate::failpoint!("group::before_unmark");
        self.cl.locks.unmark_group(g, self.cl.me, free)
    }

    /// At the global lock's handoff (or unmount), everything home and the journal emptied:
    /// take this node's marks off the other nodes' groups it used under the lock.
    pub(super) fn unmark_groups(&self, m: &mut Meta) {
        for g in m.groups().take_marked() {
            if let Err(e) = self.unmark(g, None) {
                tracing::warn!("taking this node's mark off allocation group {g} failed: {e}");
                m.groups().keep_marked(g);
            }
        }
    }
}
