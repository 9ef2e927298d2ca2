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
//! lock that finds another node's mark on a group it would allocate from waits
//! [`MARK_PATIENCE`], then looks elsewhere (and does not wait for that mark again). One that
//! must free there waits until the mark goes: the refill ends, or its node, dead, is
//! recovered — a recovery takes the dead node's marks off after its replay without the
//! global lock, so the wait ends at most a dead time later (bounded at three dead times and
//! 30 s, then `Busy`). An unlink or a rename over a last link marks every group the inode's
//! blocks lie in before it removes the name (`Volume::prepare_inode_free`), so it waits with
//! nothing changed — and, since it may start again, waits only a moment under the global
//! lock: then it gives the global lock and the metadata mutex up, waits outside
//! ([`Volume::wait_for_group_mark`]) and starts again (`Tx::prepare_free`), so a dead
//! node's mark stalls only the frees into its group. Looking up an inode in such a group
//! needs no mark (alloc.rs `is_used`), and a discard leaves such groups to their owners. A
//! refill that finds another node's mark tries its next group, and without one takes the
//! global path as before. A dead node's
//! marks are taken off by its recoverer after its journal is replayed, with its other locks
//! (`LockTable::scrub_slot`).
//! A refill whose commit point fails leaves its mark and fences this node: what reached the
//! disk is unknown, so the others must recover it before anyone uses the group again.

use super::cluster::GroupRecords;
use super::txn::{Meta, Tx};
use super::Volume;
use crate::alloc::{GroupClass, GroupGate};
use crate::cluster::lock::{GroupMark, LockTable, Me};
use crate::error::Result;
use crate::format::lock_record::{LockMode, NO_SLOT};
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

/// How long a node under the global lock waits for another node's mark on a group it would
/// only allocate from (it looks elsewhere then).
pub const MARK_PATIENCE: Duration = Duration::from_millis(200);

/// How many groups nobody owns a refill tries to claim without the global lock (format 8)
/// before the write takes the global path.
const CLAIM_TRIES: usize = 3;

/// How long a free waits for another node's mark on a group: until a node that died holding
/// it would have been found dead and recovered, with room to spare. Past that the free fails
/// (`Busy`) before it changes anything.
fn mark_patience(dead_time: Duration) -> Duration {
    dead_time * 3 + Duration::from_secs(30)
}

/// The allocator's [`GroupGate`] on a format-7 volume: this node's mark, through the lock
/// table.
#[derive(Debug)]
pub(super) struct MarkGate {
    locks: Arc<LockTable>,
    me: Me,
    /// How long a free waits for another node's mark ([`mark_patience`]).
    patience: Duration,
    /// Groups whose mark outlasted [`MARK_PATIENCE`], with that mark (slot, record version):
    /// while the same mark stays, an allocation does not wait for it again (a node that died
    /// during a refill keeps its mark until it is recovered).
    stuck: Mutex<HashMap<u64, (u32, u64)>>,
}

impl MarkGate {
    /// `dead_time`: the volume's (cluster/timing.rs).
    pub fn new(locks: Arc<LockTable>, me: Me, dead_time: Duration) -> Self {
        Self {
            locks,
            me,
            patience: mark_patience(dead_time),
            stuck: Mutex::new(HashMap::new()),
        }
    }
}

impl GroupGate for MarkGate {
    fn mark(&self, g: u64, patient: bool) -> Result<bool> {
        let start = Instant::now();
        let limit = if patient {
            self.patience
        } else {
            MARK_PATIENCE
        };
        let mut pause = Duration::from_millis(1);
        let mut warned = false;
        loop {
            crate::failpoint!("group::mark");
            match self.locks.mark_group(g, self.me, false)? {
                GroupMark::Marked => {
                    self.stuck.lock().or_panic().remove(&g);
                    return Ok(true);
                }
                GroupMark::NotMine => return Ok(false),
                GroupMark::Busy { slot, version } => {
                    let mut stuck = self.stuck.lock().or_panic();
                    if !patient && stuck.get(&g) == Some(&(slot, version)) {
                        return Ok(false);
                    }
                    let waited = start.elapsed();
                    if waited >= limit {
                        tracing::warn!(
                            "allocation group {g}: node slot {slot}'s mark stayed for {} ms; not using the group now",
                            waited.as_millis()
                        );
                        stuck.insert(g, (slot, version));
                        return Ok(false);
                    }
                    if patient && !warned && waited >= Duration::from_secs(1) {
                        tracing::warn!(
                            "allocation group {g}: waiting for node slot {slot}'s mark to go (a refill of a node that stopped?) before freeing blocks there"
                        );
                        warned = true;
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
    /// pool up from a group this node owns (module docs). If it cannot, the write takes the
    /// global path, as on older volumes, and the next try waits a moment
    /// (`Detached::may_refill_marked`).
    pub(super) fn refill_marked(&self, m: &mut Meta) {
        if !self.sb.has_group_marks()
            || self.read_only
            || m.gml() == LockMode::Exclusive
            || !m.pool_is_low()
            || m.inflight().holds_bitmap_blocks()
            || !self.detached.may_refill_marked()
        {
            return;
        }
        let ok = self.refill_from_mine(m);
        self.detached.marked_refill_done(ok);
    }

    /// After [`ErrorKind::WaitForLock`] for group `g`'s mark, holding no lock of this node:
    /// wait until the node whose mark is on `g` now takes it off — its refill ended, or, for
    /// a node that died in one, its recoverer took the mark off after the replay — for at
    /// most [`mark_patience`], then `Busy`. One lock record read every 5–100 ms meanwhile.
    /// The operation then starts again and takes its own mark under the global lock
    /// ([`Tx::prepare_free`]). The wait ends as well when another node's mark replaces the
    /// first: a node that freed into `g` under the global lock keeps its mark until it hands
    /// the global lock on, which only this node's asking for it brings about.
    ///
    /// [`ErrorKind::WaitForLock`]: crate::error::ErrorKind::WaitForLock
    pub(super) fn wait_for_group_mark(&self, g: u64) -> Result<()> {
        let start = Instant::now();
        let limit = mark_patience(self.cl.timing.dead_time());
        let mut pause = Duration::from_millis(5);
        let mut marker = None;
        loop {
            if let Some(e) = self.lock_abort() {
                return Err(e);
            }
            let (_, rec) = self.cl.locks.read(self.cl.locks.group_index(g))?;
            if rec.next == NO_SLOT
                || rec.next == self.cl.me.slot
                || marker.is_some_and(|m| m != rec.next)
            {
                return Ok(());
            }
            marker = Some(rec.next);
            if start.elapsed() >= limit {
                bail!(
                    Busy,
                    "allocation group {g}: node slot {}'s mark stayed for {} s; try again",
                    rec.next,
                    start.elapsed().as_secs()
                );
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    /// [`Volume::refill_marked`] once its conditions hold: the groups this node owns, the
    /// emptiest last; then (format 8) a group nobody owns, claimed. Goes on to the next group
    /// while the pool stays low (a nearly full group tops it up only in part). True if the
    /// pool got blocks.
    fn refill_from_mine(&self, m: &mut Meta) -> bool {
        let me = self.cl.me;
        if m.groups().has_marks_to_take_off() {
            self.unmark_groups(m);
        }
        let mut got = false;
        for (g, _) in m.groups().mine_by_free() {
            match self.cl.locks.mark_group(g, me, true) {
                Ok(GroupMark::Marked) => {}
                Ok(GroupMark::Busy { .. } | GroupMark::NotMine) => continue,
                Err(e) => {
                    // The CAW may have landed.
                    tracing::debug!("marking allocation group {g} failed: {e}");
                    m.groups().unmark_later(g);
                    return false;
                }
            }
            match self.refill_under_mark(m, g) {
                Some(false) => {}
                Some(true) if m.pool_may_refill() => got = true,
                Some(true) => return true,
                None => return got,
            }
        }
        if self.sb.has_group_claims() {
            got |= self.refill_from_claimed(m);
        }
        got
    }

    /// Format 8: this node's own groups could not top the pool up. Claim a group nobody owns
    /// (the one with the most free blocks as far as this node knows, up to [`CLAIM_TRIES`])
    /// without the global lock — owned and marked in one CAW, so nobody uses it meanwhile
    /// (alloc.rs "Group claims") — and refill from it. Without this a node's thin images
    /// stopped growing once its own groups were full while a dead node held the global lock
    /// (a new group was claimed only under it).
    fn refill_from_claimed(&self, m: &mut Meta) -> bool {
        let me = self.cl.me;
        let mut got = false;
        // Nothing to claim a group for: the volume is nearly full, or the pool needs the
        // global path's compaction first.
        if !m.pool_may_refill() {
            return false;
        }
        // Which groups are unowned now: a grant reads only this node's own records (every
        // record at most once per `GroupReads::all_every`, so this costs little even when
        // the volume is nearly full and no claim succeeds).
        self.read_group_records(m, GroupRecords::All);
        for (g, _) in self.claimable_groups(m).into_iter().take(CLAIM_TRIES) {
            match self.cl.locks.claim_group_marked(g, me) {
                Ok(true) => {
                    m.groups().set_class(g, GroupClass::Mine);
                    tracing::info!(
                        "took allocation group {g} without the global lock: this node's own groups are full"
                    );
                }
                // Owned, or marked by a node using it: not a group to claim now (until the
                // next read of the owners says otherwise; the gate marks it before any use).
                Ok(false) => {
                    m.groups().set_class(g, GroupClass::Others);
                    continue;
                }
                Err(e) => {
                    // The CAW may have landed: the mark goes with the others; the group is
                    // known as this node's at the next read of every group record if it is
                    // (the next grant's), and an unmount releases it either way
                    // (`Volume::leave_cluster` reads whose it is).
                    tracing::debug!("claiming allocation group {g} failed: {e}");
                    self.group_record_unknown();
                    m.groups().unmark_later(g);
                    return got;
                }
            }
            match self.refill_under_mark(m, g) {
                Some(true) if m.pool_may_refill() => got = true,
                Some(true) => return true,
                // A fresh group that gives nothing: something else stops refills (claim no
                // more groups for it).
                Some(false) | None => return got,
            }
        }
        got
    }

    /// With this node's mark on its group `g`: refill, make the commit point, take the mark
    /// off. Some(whether the pool got blocks), or None when the refill must stop (its
    /// transaction failed; a failed commit point fences the node and leaves the mark).
    fn refill_under_mark(&self, m: &mut Meta, g: u64) -> Option<bool> {
        match self.refill_from(m, g) {
            Ok(Refill::Home(taken)) => {
                let free = m.groups().group_free(g);
                match self.unmark(g, free) {
                    Ok(()) => {
                        if let Some(free) = free {
                            m.groups().note_published(g, free);
                        }
                    }
                    // Perhaps still ours: the next refill or handoff takes it off.
                    Err(e) => {
                        tracing::warn!("taking the mark off allocation group {g} failed: {e}");
                        m.groups().unmark_later(g);
                    }
                }
                if taken {
                    tracing::debug!(
                        "refilled the block pool from group {g} without the global lock"
                    );
                }
                Some(taken)
            }
            Ok(Refill::Undone(e)) => {
                // Nothing of it reached a transaction (the allocator undid its part).
                tracing::warn!("refilling the pool from allocation group {g} failed: {e}");
                if self.unmark(g, None).is_err() {
                    m.groups().unmark_later(g);
                }
                None
            }
            Err(e) => {
                // Committed in memory, perhaps journaled, perhaps partly home: unknown. The
                // mark stays until the others have recovered this node.
                self.member.fence(format!(
                    "metadata commit of a pool refill from allocation group {g} failed: {e}"
                ));
                None
            }
        }
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
    /// take this node's marks off the other nodes' groups it used under the lock, and off any
    /// group a take-off failed for before. One that fails again is tried at the next handoff
    /// or refill; the group is marked again before it is used.
    pub(super) fn unmark_groups(&self, m: &mut Meta) {
        for g in m.groups().take_marked() {
            if let Err(e) = self.unmark(g, None) {
                tracing::warn!("taking this node's mark off allocation group {g} failed: {e}");
                m.groups().unmark_later(g);
            }
        }
    }
}
