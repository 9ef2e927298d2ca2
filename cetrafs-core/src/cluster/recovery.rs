//! Recovery of a dead node by a survivor, in idempotent steps (docs/recovery.md):
//!
//! 1. **claim**: compare-and-write the dead slot's record from the image observed dead to
//!    `Recovering {recoverer: me}`. Only one survivor wins; the write also fences the dead node
//!    should it resume (its renewal sees a foreign image). A claim whose recoverer is no longer
//!    that live node is taken over the same way, and the steps are redone.
//!
//!    Then, with `fence=pr`, **preempt**: PREEMPT AND ABORT of the dead slot's reservation
//!    keys (`reservation.rs`): from here the target refuses whatever the dead node still sends.
//! 2. **replay** its journal (sequence-guarded, so replaying twice changes nothing). Safe while
//!    others run: a node's journal is non-empty only while it holds the global metadata lock
//!    exclusively — nobody else can have changed those blocks since.
//! 3. **release its locks**: global lock (version bumped if it held it exclusively, so every
//!    cache is revalidated), allocation groups, open registrations, and on a v3 volume its
//!    per-object (inode) locks and mailbox (`ObjectLocks::scrub_slot`: an exclusive entry's
//!    version is bumped, so caches validated under the dead node's hold are reloaded). Locks
//!    are never broken before step 2.
//! 4. free its open-unlinked inodes (needs the filesystem: `fs/cluster.rs`);
//! 5. **clear** the slot: Free, generation + 1 — the dead owner's (slot, generation) never
//!    matches again.

use super::lock::{LockTable, Me};
use super::membership::{self, SlotView};
use super::object_lock::ObjectLocks;
use super::reservation::Reservations;
use crate::dev::BlockDevice;
use crate::error::Result;
use crate::format::heartbeat::{Heartbeat, SlotState};
use crate::format::superblock::Superblock;
use crate::journal::JournalArea;

/// A recovery this node has claimed (steps 1–3 done).
#[derive(Debug, Clone)]
pub struct Claimed {
    /// The slot as we wrote it (state Recovering), for the final compare-and-write.
    pub view: SlotView,
    /// Journal blocks written home by the replay.
    pub replayed: usize,
}

/// A slot in recovery whose recoverer no longer holds its slot at the claimed generation (it
/// died and was recovered itself, or unmounted): the claim is void and may be taken over.
/// Whether a recoverer that still looks live is really alive is the watcher's call, by time.
pub fn claim_is_stale(v: &SlotView, views: &[SlotView], me: Me) -> bool {
    let Some(h) = v
        .record
        .as_ref()
        .filter(|h| h.state == SlotState::Recovering)
    else {
        return false;
    };
    if h.recoverer == me.slot {
        return h.recoverer_gen != me.gen;
    }
    !views.iter().any(|r| {
        r.slot == h.recoverer
            && r.record
                .as_ref()
                .is_some_and(|rh| rh.state == SlotState::Live && rh.generation == h.recoverer_gen)
    })
}

/// Steps 1–3. Ok(None): someone else holds the claim, or the slot is no longer dead.
pub fn claim_and_release(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    locks: &LockTable,
    objects: Option<&ObjectLocks>,
    pr: Option<&Reservations>,
    dead: &SlotView,
    me: Me,
) -> Result<Option<Claimed>> {
    let h = match dead.record.clone() {
        Some(h) if h.state == SlotState::Free => return Ok(None),
        Some(h) => h,
        // A damaged record, silent for the superblock's dead time: whoever held the slot has
        // fenced (its renewal found a foreign image) and its I/O has settled. Its generation
        // is unknown; the claim writes 0 (the clear then 1), and every lock naming the slot is
        // scrubbed whatever its generation, so nothing of the old owner can match later.
        None if dead.is_damaged() && dead.slot < sb.max_nodes => Heartbeat {
            state: SlotState::Live, // a stand-in: the claim below writes Recovering
            generation: 0,
            counter: 0,
            nonce: 0,
            uuid: sb.uuid,
            interval_ms: sb.heartbeat_interval_ms,
            io_timeout_ms: sb.io_timeout_ms,
            slot: dead.slot,
            host: String::new(),
            pid: 0,
            recoverer: u32::MAX,
            recoverer_gen: 0,
            machine: crate::cluster::machine::MachineId::UNKNOWN,
            watchdog_ms: 0,
        },
        None => return Ok(None),
    };
    let claimed = if h.state == SlotState::Recovering
        && h.recoverer == me.slot
        && h.recoverer_gen == me.gen
    {
        dead.clone()
    } else {
        let mine = Heartbeat {
            state: SlotState::Recovering,
            recoverer: me.slot,
            recoverer_gen: me.gen,
            counter: h.counter + 1,
            nonce: rand::random(),
            ..h.clone()
        };
        let lbs = dev.geometry().logical_block_size as usize;
        let image = mine.encode(lbs);
        if !membership::swap_slot(dev, sb, dead.slot, &dead.raw, &image)? {
            return Ok(None);
        }
        tracing::warn!(
            "recovering {}: claimed its slot (generation {}{})",
            membership::describe(dead),
            h.generation,
            if dead.is_damaged() {
                ", its damaged record replaced"
            } else {
                ""
            }
        );
        SlotView {
            slot: dead.slot,
            raw: image,
            record: Some(mine),
        }
    };
    // fence=pr: the target aborts the dead node's queued writes and refuses its later ones
    // before anything it may still write is overwritten by the replay (step 1b).
    if let Some(pr) = pr {
        // PREEMPT only fences on a reserved LUN: reserve first if nobody does (the dead slot,
        // Recovering now, is not among the live ones whose keys must be registered).
        let live = super::reservation::live_slots(&membership::scan(dev, sb)?);
        if let Err(e) = pr.ensure_reserved(&live) {
            tracing::warn!(
                "fence=pr: checking the LUN's reservation before preempting {} failed: {e}",
                membership::describe(dead)
            );
        }
        // Our claim, still in the slot: read through the lease-checked device.
        let still_mine = || Ok(membership::read_slot(dev, sb, dead.slot)? == claimed.raw);
        let done = pr.preempt_slot(dead.slot, &still_mine).map_err(|e| {
            e.wrap(format!(
                "fencing {} by persistent reservation",
                membership::describe(dead)
            ))
        })?;
        if done.is_empty() {
            tracing::info!(
                "fence=pr: {} has no reservation key registered: nothing to preempt",
                membership::describe(dead)
            );
        }
    }
    let replayed = crate::journal::replay(dev, sb, JournalArea::for_slot(sb, dead.slot))
        .map_err(|e| e.wrap(format!("journal replay of {}", membership::describe(dead))))?;
    // The multi-node suite's `CETRA_FAILPOINT=recovery::after_replay=exit` stops the process
    // right after step 2, so that another node must finish the recovery.
    crate::failpoint::process("recovery::after_replay");
    locks.scrub_slot(dead.slot).map_err(|e| {
        e.wrap(format!(
            "releasing the locks of {}",
            membership::describe(dead)
        ))
    })?;
    // Its per-object locks too (v3), whatever their generation: the slot is dead and replayed.
    crate::failpoint!("recovery::before_object_scrub");
    if let Some(o) = objects {
        o.scrub_slot(dead.slot, None).map_err(|e| {
            e.wrap(format!(
                "releasing the object locks of {}",
                membership::describe(dead)
            ))
        })?;
    }
    Ok(Some(Claimed {
        view: claimed,
        replayed,
    }))
}

/// Step 5: the slot becomes free with generation + 1.
pub fn clear(dev: &dyn BlockDevice, sb: &Superblock, c: &Claimed) -> Result<()> {
    let Some(h) = c.view.record.clone() else {
        return Ok(());
    };
    let free = Heartbeat {
        state: SlotState::Free,
        generation: h.generation + 1,
        recoverer: u32::MAX,
        recoverer_gen: 0,
        nonce: rand::random(),
        ..h
    };
    let lbs = dev.geometry().logical_block_size as usize;
    if membership::swap_slot(dev, sb, c.view.slot, &c.view.raw, &free.encode(lbs))? {
        Ok(())
    } else {
        crate::bail!(
            Busy,
            "node slot {} changed while this node was recovering it",
            c.view.slot
        )
    }
}
