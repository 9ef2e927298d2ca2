//! Space given back to the SAN: freed blocks are discarded in the background (issue 11 §2).
//!
//! A thin-provisioned LUN only shrinks when the filesystem tells it which blocks hold nothing:
//! UNMAP through `SG_IO` on a SCSI LUN, `BLKDISCARD` on a block device, a punched hole on a file
//! LUN (`dev/`). This module decides *which* blocks and *when*.
//!
//! # The rules
//! * **Only frees that are durable.** A run freed by a transaction (unlink, truncate, punch
//!   hole — a guest's TRIM with `discard=on` arrives as one — a pool given back) is queued
//!   when the commit point that made the free durable releases it (fs/txn.rs step 4,
//!   `Allocator::committed`). Before that a crash could bring back the file that maps it.
//! * **Only blocks nobody claims, checked when the discard runs.** Between the queueing and the
//!   discard the block may have been allocated again, on this node or another. So the
//!   discarder takes the global lock exclusively and the metadata mutex, asks the allocator
//!   for the parts of each run that are free in the bitmap and not reserved
//!   (`Allocator::unclaimed`), and discards those, still holding both. Under the exclusive
//!   global lock no other node holds bitmap blocks (it gave the lock up only with none in
//!   flight, fs/inflight.rs) and every block in a pool is marked used (fs/pool.rs), so a block
//!   reallocated before its discard ran is never discarded.
//! * **Runs a hole punched into the pool: the metadata mutex only.** A hole punched without
//!   the global lock in a file this node owns (a VM's TRIM: fs/data.rs) frees its runs into
//!   this node's pool, which stays marked used in the bitmaps. Those are queued apart (when
//!   the pool's commit point releases them, `Pool::committed`) and discarded every tick under
//!   the metadata mutex alone: only the parts still in the pool that no write, spare or pin
//!   holds (`Pool::unclaimed`), and a reservation of pool blocks needs that mutex, so a block
//!   is never handed to a write before its discard is done. No other node allocates a pool's
//!   blocks. A guest's TRIM therefore reaches the LUN without any cluster lock. A run the
//!   pool gives back to the bitmaps before its discard ran (the pool's compaction, which
//!   frees its runs without waiting for a commit point: `Allocator::free_unused`) moves to
//!   the bitmaps' queue, where the rule above applies.
//! * **At a limited rate** (mount option `discard=MiB/s`, default [`DEFAULT_RATE`], in
//!   VMFS's 25–100 MB/s range; `nodiscard` turns it off): every [`TICK`] the discarder takes at
//!   most a tick's worth of the queue, lowest blocks first. A tick with an empty queue costs a
//!   look at it under the metadata mutex and nothing else: no lock, no I/O. A node that does
//!   not hold the global lock exclusively takes it for discards only every [`LOCK_EVERY`]
//!   ticks, with that many ticks' worth (one tick's worth per hold of the metadata mutex, so
//!   the node's own metadata work waits for at most a tick's discards): a large delete costs
//!   a busy cluster one handoff per five seconds, not one per second.
//! * **Runs of at least [`MIN_RUN`] blocks.** A lone freed block (an inode, a tree node) is
//!   not worth an UNMAP, and an inode number the kernel still holds keeps reading its old
//!   image (`fs/detached_ns.rs`). `cetra trim` / `fstrim` sweeps all free space instead.
//! * **A hint, kept in memory.** A crash or an unmount loses the queue; nothing is wrong on
//!   disk, only space the SAN keeps until a trim. A queue longer than [`MAX_RUNS`] runs drops
//!   new runs (counted in the log).

use super::txn::FreedTo;
use super::Volume;
use crate::error::Result;
use crate::format::FS_BLOCK;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default discard rate, bytes per second (64 MiB/s).
pub const DEFAULT_RATE: u64 = 64 << 20;
/// How often the discarder looks at the queue.
pub const TICK: Duration = Duration::from_secs(1);
/// Without the global lock held exclusively, discards wait this many ticks (and take their
/// budget together).
pub const LOCK_EVERY: u64 = 5;
/// Shortest run queued, in filesystem blocks (64 KiB).
pub const MIN_RUN: u64 = 16;
/// Most runs kept queued.
pub const MAX_RUNS: usize = 1 << 16;
/// Blocks a trim ([`Volume::trim`]) looks at per hold of the global lock (64 MiB).
pub const TRIM_STEP: u64 = 16_384;

/// Runs whose free is durable, waiting for their discard.
#[derive(Debug, Default)]
pub(crate) struct DiscardQueue {
    /// start -> len, never adjacent or overlapping (merged on push).
    runs: BTreeMap<u64, u64>,
    blocks: u64,
    /// Runs dropped because the queue was full, since the last [`take_dropped`](Self::take_dropped).
    dropped: u64,
}

impl DiscardQueue {
    /// Queue a run whose free is durable (shorter runs than [`MIN_RUN`] are left alone).
    pub fn push(&mut self, start: u64, len: u64) {
        if len < MIN_RUN {
            return;
        }
        let (mut s, mut l) = (start, len);
        // A run freed twice (freed, reallocated, freed again before its discard) overlaps
        // itself: take the union.
        while let Some((&ps, &pl)) = self.runs.range(..=s + l).next_back() {
            if ps + pl < s {
                break;
            }
            self.runs.remove(&ps);
            self.blocks -= pl;
            let end = (ps + pl).max(s + l);
            s = s.min(ps);
            l = end - s;
        }
        if self.runs.len() >= MAX_RUNS {
            self.dropped += 1;
            return;
        }
        self.runs.insert(s, l);
        self.blocks += l;
    }

    /// Take at most `budget` blocks of runs, lowest first (the last one split if it is longer).
    pub fn take(&mut self, budget: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut left = budget;
        while left > 0 {
            let Some((s, l)) = self.runs.pop_first() else {
                break;
            };
            let n = l.min(left);
            if n < l {
                self.runs.insert(s + n, l - n);
            }
            self.blocks -= n;
            left -= n;
            out.push((s, n));
        }
        out
    }

    /// Take the queued parts of blocks `[start, start + len)` out of the queue (the parts
    /// of runs outside it stay).
    pub fn take_within(&mut self, start: u64, len: u64) -> Vec<(u64, u64)> {
        let end = start + len;
        let mut out = Vec::new();
        let first = self
            .runs
            .range(..start)
            .next_back()
            .filter(|(&s, &l)| s + l > start)
            .map(|(&s, _)| s);
        let keys: Vec<u64> = first
            .into_iter()
            .chain(self.runs.range(start..end).map(|(&s, _)| s))
            .collect();
        for s in keys {
            let Some(l) = self.runs.remove(&s) else {
                continue;
            };
            self.blocks -= l;
            let (a, b) = (s.max(start), (s + l).min(end));
            out.push((a, b - a));
            for (rs, rl) in [(s, a - s), (b, s + l - b)] {
                if rl > 0 {
                    self.runs.insert(rs, rl);
                    self.blocks += rl;
                }
            }
        }
        out
    }

    /// Blocks queued.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Runs dropped since the last call.
    pub fn take_dropped(&mut self) -> u64 {
        std::mem::take(&mut self.dropped)
    }
}

impl Volume {
    /// Discard at most `budget` blocks of the queues, lowest first, only the parts nothing
    /// claims (see the module docs): runs freed into this node's pool first, under the
    /// metadata mutex alone ([`Volume::discard_pooled`]), then runs freed into the bitmaps,
    /// under the global lock (exclusive) and the metadata mutex. Returns the blocks
    /// discarded. With empty queues this takes no cluster lock.
    pub fn discard_queued(&self, budget: u64) -> Result<u64> {
        let mut done = self.discard_pooled(budget)?;
        if done >= budget || self.lock_meta().discards_queued(FreedTo::Bitmaps) == 0 {
            return Ok(done);
        }
        let mut m = self.meta_ex()?;
        let (runs, dropped) = m.take_discards(FreedTo::Bitmaps, budget - done);
        if dropped > 0 {
            tracing::info!("discard queue full: {dropped} freed runs left for a trim");
        }
        for (start, len) in runs {
            let unclaimed = m.unclaimed(start, len)?;
            done += self.discard_runs(&unclaimed, 1)?;
        }
        Ok(done)
    }

    /// Discard at most `budget` blocks of the runs a hole punched without the global lock
    /// freed into this node's pool (fs/data.rs): the parts still in the pool that nothing
    /// holds, under the metadata mutex, which a reservation of pool blocks needs, so none
    /// can be handed to a write before its discard is done. No cluster lock: the pool's
    /// blocks are marked used in the bitmaps, so no other node allocates them.
    pub fn discard_pooled(&self, budget: u64) -> Result<u64> {
        let mut m = self.lock_meta();
        if m.discards_queued(FreedTo::Pool) == 0 {
            return Ok(0);
        }
        let (runs, dropped) = m.take_discards(FreedTo::Pool, budget);
        if dropped > 0 {
            tracing::info!("discard queue full: {dropped} punched runs left for a trim");
        }
        let mut done = 0;
        for (start, len) in runs {
            done += self.discard_runs(&m.pool_unclaimed(start, len), 1)?;
        }
        Ok(done)
    }

    /// The one place a discard is issued: `runs` that the caller found unclaimed and keeps
    /// so (it holds the locks that say so), those of at least `min_blocks`. Returns the
    /// blocks discarded.
    fn discard_runs(&self, runs: &[(u64, u64)], min_blocks: u64) -> Result<u64> {
        let mut done = 0;
        for &(s, l) in runs {
            if l < min_blocks {
                continue;
            }
            crate::failpoint!("discard::before_discard");
            self.dev
                .discard(s * FS_BLOCK, l * FS_BLOCK)
                .map_err(|e| e.wrap(format!("discarding blocks {s}+{l}")))?;
            done += l;
        }
        Ok(done)
    }

    /// Discard the free space of the byte range `[start, start + len)` of the volume, in
    /// free runs of at least `min_len` bytes (`FITRIM`: `fstrim`, `cetra trim`): every block
    /// that no file, pool or write in flight claims, [`TRIM_STEP`] blocks per hold of the
    /// global lock (exclusive) and the metadata mutex, so other work goes on in between.
    /// Commits first. Returns the bytes discarded. Not rate-limited: a trim is asked for.
    pub fn trim(&self, start: u64, len: u64, min_len: u64) -> Result<u64> {
        self.check_writable()?;
        // Frees not yet committed are still quarantined (not free to discard): commit first,
        // so that what `rm` just freed is trimmed too.
        self.sync()?;
        // The group area as this node knows it now (it grows with `cetra grow`).
        let area_end = self.meta_sh()?.sb().group_area_end();
        let first = (start / FS_BLOCK).max(self.sb.group_start);
        let end = start.saturating_add(len).div_ceil(FS_BLOCK).min(area_end);
        let min_blocks = min_len.div_ceil(FS_BLOCK).max(1);
        let mut done = 0;
        let mut at = first;
        while at < end {
            let n = TRIM_STEP.min(end - at);
            let mut m = self.meta_ex()?;
            let unclaimed = m.unclaimed(at, n)?;
            done += self.discard_runs(&unclaimed, min_blocks)?;
            drop(m);
            at += n;
        }
        Ok(done * FS_BLOCK)
    }

    /// Blocks waiting for their discard.
    pub fn discards_queued(&self) -> u64 {
        let m = self.lock_meta();
        m.discards_queued(FreedTo::Bitmaps) + m.discards_queued(FreedTo::Pool)
    }

    /// The background discarder: every [`TICK`], at most `rate` bytes per second of the
    /// queue (a tick that finds it empty saves nothing up).
    pub(super) fn spawn_discarder(vol: &Arc<Volume>, rate: u64) {
        let weak = Arc::downgrade(vol);
        let per_tick = (rate / FS_BLOCK).max(1);
        let spawned = std::thread::Builder::new()
            .name("cetra-discard".into())
            .spawn(move || {
                let mut total = 0u64;
                let mut logged = Instant::now();
                let mut waited = 0u64;
                loop {
                    std::thread::sleep(TICK);
                    let Some(v) = weak.upgrade() else { break };
                    if v.unmounted.load(Ordering::Relaxed) || v.member.is_fenced() {
                        break;
                    }
                    // Runs punched into the pool need no cluster lock: every tick, first.
                    let mut spent = v.discard_pooled(per_tick).unwrap_or_else(|e| {
                        tracing::warn!("background discard failed: {e}");
                        0
                    });
                    total += spent;
                    if v.lock_meta().discards_queued(FreedTo::Bitmaps) == 0 {
                        waited = 0;
                        continue;
                    }
                    waited += 1;
                    if !v.holds_global_exclusive() && waited < LOCK_EVERY {
                        continue;
                    }
                    // The ticks saved up, one tick's worth per hold of the metadata mutex (the
                    // node keeps the global lock in between): the mutex is never held across
                    // more than a tick's discards.
                    for _ in 0..std::mem::take(&mut waited) {
                        let budget = per_tick.saturating_sub(std::mem::take(&mut spent));
                        match v.discard_queued(budget.max(1)) {
                            Ok(0) => break,
                            Ok(n) => total += n,
                            // A hint: the blocks stay allocated on the SAN until a trim.
                            Err(e) => {
                                tracing::warn!("background discard failed: {e}");
                                break;
                            }
                        }
                    }
                    if total > 0 && logged.elapsed() >= Duration::from_secs(10) {
                        tracing::debug!(
                            "discarded {} MiB in the background; {} MiB queued",
                            (total * FS_BLOCK) >> 20,
                            (v.discards_queued() * FS_BLOCK) >> 20
                        );
                        total = 0;
                        logged = Instant::now();
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("no background discard ({e}); freed space stays on the LUN");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn short_runs_are_not_queued_and_neighbours_merge() {
        let mut q = DiscardQueue::default();
        q.push(10, MIN_RUN - 1);
        assert_eq!(q.blocks(), 0);
        q.push(100, 20);
        q.push(120, 20);
        q.push(90, 16);
        assert_eq!(q.runs.len(), 1);
        assert_eq!(q.blocks(), 50);
        assert_eq!(q.take(10), vec![(90, 10)]);
        assert_eq!(q.take(100), vec![(100, 40)]);
        assert_eq!(q.blocks(), 0);
        assert!(q.take(5).is_empty());
    }

    #[test]
    fn take_within_takes_the_parts_inside_and_keeps_the_rest() {
        let mut q = DiscardQueue::default();
        q.push(100, 40);
        q.push(200, 20);
        q.push(300, 16);
        assert_eq!(q.take_within(120, 110), vec![(120, 20), (200, 20)]);
        assert_eq!(q.blocks(), 36);
        assert_eq!(q.take_within(0, 50), vec![]);
        assert_eq!(q.take_within(305, 2), vec![(305, 2)]);
        assert_eq!(q.take(1000), vec![(100, 20), (300, 5), (307, 9)]);
    }

    proptest! {
        /// Whatever is pushed, the queue holds exactly the union of the runs (of at least
        /// MIN_RUN blocks), and taking it all gives every block once.
        #[test]
        fn the_queue_is_the_union_of_its_runs(
            runs in proptest::collection::vec((0u64..2000, 0u64..80), 0..40),
            budget in 1u64..500,
        ) {
            let mut q = DiscardQueue::default();
            let mut want = std::collections::BTreeSet::new();
            for &(s, l) in &runs {
                q.push(s, l);
                if l >= MIN_RUN {
                    want.extend(s..s + l);
                }
            }
            prop_assert_eq!(q.blocks(), want.len() as u64);
            let mut got = std::collections::BTreeSet::new();
            loop {
                let t = q.take(budget);
                if t.is_empty() {
                    break;
                }
                prop_assert!(t.iter().map(|r| r.1).sum::<u64>() <= budget);
                for (s, l) in t {
                    for b in s..s + l {
                        prop_assert!(got.insert(b), "block {} taken twice", b);
                    }
                }
            }
            prop_assert_eq!(got, want);
            prop_assert_eq!(q.blocks(), 0);
        }
    }
}

#[cfg(test)]
mod volume_tests {
    use super::super::tests::fresh;
    use super::super::{Caller, MountOptions, Volume};
    use crate::dev::mem::{MemDevice, DISCARDED};
    use crate::dev::BlockDevice;
    use crate::format::FS_BLOCK;
    use std::collections::BTreeSet;
    use std::sync::Arc;

    const C: Caller = Caller::ROOT;

    fn blocks_of(v: &Volume, ino: u64) -> BTreeSet<u64> {
        v.extents(ino)
            .unwrap()
            .iter()
            .flat_map(|e| e.physical..e.physical + u64::from(e.len))
            .collect()
    }

    fn block(dev: &MemDevice, b: u64) -> Vec<u8> {
        let mut buf = vec![0u8; 4096];
        dev.read_at(b * FS_BLOCK, &mut buf).unwrap();
        buf
    }

    /// Write `len` bytes of `fill` into a new file `name` and make it durable.
    fn file(v: &Volume, name: &[u8], len: usize, fill: u8) -> u64 {
        let (a, fh) = v.create(v.root_ino(), name, 0o644, C, true).unwrap();
        for off in (0..len).step_by(1 << 20) {
            let n = (len - off).min(1 << 20);
            v.write(&fh, off as u64, &vec![fill; n]).unwrap();
        }
        v.release(&fh).unwrap();
        v.sync().unwrap();
        a.ino
    }

    /// A fresh volume of `bytes` mounted with discards queued but left to the test
    /// (`discard_rate` 0: no background discarder).
    fn queued_discards(bytes: u64) -> (Arc<MemDevice>, Arc<Volume>) {
        let (dev0, v0) = fresh(bytes);
        v0.unmount().unwrap();
        let dev = Arc::new(MemDevice::from_image(dev0.snapshot(), 512));
        let opts = MountOptions {
            discard_rate: Some(0),
            ..MountOptions::default()
        };
        let v = Volume::mount(dev.clone(), &opts).unwrap();
        (dev, v)
    }

    #[test]
    fn durable_frees_are_discarded_and_reused_blocks_never() {
        let (dev, v) = queued_discards(64 << 20);
        // A freed file: queued only once the free is durable, then every block discarded.
        let a = file(&v, b"a", 8 << 20, 0xA1);
        let a_blocks = blocks_of(&v, a);
        // (What writing it freed: a pool's spare runs given back.)
        v.discard_queued(u64::MAX).unwrap();
        v.unlink(v.root_ino(), b"a").unwrap();
        assert_eq!(v.discards_queued(), 0, "queued before the free was durable");
        v.sync().unwrap();
        assert_eq!(v.discards_queued(), a_blocks.len() as u64);
        assert_eq!(v.discard_queued(100).unwrap(), 100, "the budget is kept");
        let rest = v.discard_queued(u64::MAX).unwrap();
        assert_eq!(rest + 100, a_blocks.len() as u64);
        for &b in &a_blocks {
            assert!(block(&dev, b).iter().all(|&x| x == DISCARDED), "block {b}");
        }
        // A freed file whose blocks another file takes before the discard runs: those blocks
        // keep the new file's data.
        let c = file(&v, b"c", 8 << 20, 0xC3);
        let c_blocks = blocks_of(&v, c);
        v.discard_queued(u64::MAX).unwrap();
        v.unlink(v.root_ino(), b"c").unwrap();
        v.sync().unwrap();
        assert_eq!(v.discards_queued(), c_blocks.len() as u64);
        let free = v.statfs().unwrap().bfree * FS_BLOCK;
        let big = usize::try_from(free - (4 << 20)).unwrap();
        let b = file(&v, b"b", big, 0xB2);
        let b_blocks = blocks_of(&v, b);
        assert!(
            c_blocks.intersection(&b_blocks).count() > 0,
            "the test needs the new file to reuse freed blocks"
        );
        v.discard_queued(u64::MAX).unwrap();
        for &blk in &b_blocks {
            assert!(block(&dev, blk).iter().all(|&x| x == 0xB2), "block {blk}");
        }
        v.unmount().unwrap();
        let report = crate::check::check_volume(&*dev).unwrap();
        assert!(report.is_clean(), "{:?}", report.findings);
    }

    /// A hole punched in a file this node owns frees into its pool (no global lock, fs/data.rs):
    /// the runs are discarded once the free is durable, under the metadata mutex, and blocks
    /// the pool hands to a later write keep that write's data.
    #[test]
    fn holes_punched_into_the_pool_are_discarded_and_reused_blocks_never() {
        let (dev, v) = queued_discards(512 << 20);
        let (f, fh) = v.create(v.root_ino(), b"img", 0o644, C, true).unwrap();
        let size = super::super::SetAttr {
            size: Some(64 << 20),
            ..Default::default()
        };
        v.setattr(f.ino, &size, C).unwrap();
        for mib in 0..4u64 {
            v.write(&fh, mib << 20, &vec![0xD1; 1 << 20]).unwrap();
        }
        v.sync().unwrap();
        v.discard_queued(u64::MAX).unwrap();
        let before = blocks_of(&v, f.ino);
        let pool0 = v.lock_meta().pool_available();
        v.fallocate(f.ino, 1 << 20, 1 << 20, super::super::FallocMode::PunchHole)
            .unwrap();
        let punched: BTreeSet<u64> = before.difference(&blocks_of(&v, f.ino)).copied().collect();
        assert_eq!(punched.len(), 256);
        assert_eq!(v.discards_queued(), 0, "queued before the free was durable");
        v.sync().unwrap();
        assert_eq!(
            v.lock_meta().pool_available(),
            pool0 + 256,
            "the hole was not punched into the pool"
        );
        assert_eq!(v.discards_queued(), 256);
        assert_eq!(v.discard_queued(u64::MAX).unwrap(), 256);
        for &b in &punched {
            assert!(block(&dev, b).iter().all(|&x| x == DISCARDED), "block {b}");
        }
        // Punched again and refilled by a write before the discard runs: the write's blocks
        // keep its data.
        v.fallocate(f.ino, 2 << 20, 1 << 20, super::super::FallocMode::PunchHole)
            .unwrap();
        v.sync().unwrap();
        assert_eq!(v.discards_queued(), 256);
        for mib in 1..3u64 {
            v.write(&fh, mib << 20, &vec![0xE2; 1 << 20]).unwrap();
        }
        let after = blocks_of(&v, f.ino);
        v.discard_queued(u64::MAX).unwrap();
        assert_eq!(v.discards_queued(), 0);
        let mut back = Vec::new();
        v.read(&fh, 0, 4 << 20, &mut |d| back.extend_from_slice(d))
            .unwrap();
        assert!(back[..1 << 20].iter().all(|&x| x == 0xD1));
        assert!(back[1 << 20..3 << 20].iter().all(|&x| x == 0xE2));
        assert!(back[3 << 20..].iter().all(|&x| x == 0xD1));
        for &b in &after {
            assert!(
                block(&dev, b).iter().all(|&x| x != DISCARDED),
                "block {b} discarded"
            );
        }
        v.release(&fh).unwrap();
        v.unmount().unwrap();
        let report = crate::check::check_volume(&*dev).unwrap();
        assert!(report.is_clean(), "{:?}", report.findings);
    }

    #[test]
    fn a_trim_discards_all_free_space_and_nothing_else() {
        let (dev0, v0) = fresh(64 << 20);
        v0.unmount().unwrap();
        let dev = Arc::new(MemDevice::from_image(dev0.snapshot(), 512));
        let opts = MountOptions {
            discard_rate: None,
            ..MountOptions::default()
        };
        let v = Volume::mount(dev.clone(), &opts).unwrap();
        let kept = file(&v, b"kept", 6 << 20, 0x4B);
        let gone = file(&v, b"gone", 6 << 20, 0x6F);
        let gone_blocks = blocks_of(&v, gone);
        v.unlink(v.root_ino(), b"gone").unwrap();
        v.sync().unwrap();
        // nodiscard: nothing was discarded at the free.
        assert!(gone_blocks
            .iter()
            .all(|&b| block(&dev, b).iter().all(|&x| x == 0x6F)));
        // A trim that leaves runs shorter than 1 GiB alone: nothing on this volume.
        let sb = v.superblock().clone();
        assert_eq!(v.trim(0, u64::MAX, 1 << 30).unwrap(), 0);
        let trimmed = v.trim(0, u64::MAX, 0).unwrap();
        let free = v.statfs().unwrap().bfree;
        assert!(
            trimmed >= gone_blocks.len() as u64 * FS_BLOCK && trimmed <= free * FS_BLOCK,
            "trimmed {trimmed} bytes, {} freed, {free} blocks free",
            gone_blocks.len()
        );
        for &b in &gone_blocks {
            assert!(block(&dev, b).iter().all(|&x| x == DISCARDED), "block {b}");
        }
        let fh = v.open(kept, false, false).unwrap();
        let mut back = Vec::new();
        v.read(&fh, 0, 6 << 20, &mut |d| back.extend_from_slice(d))
            .unwrap();
        v.release(&fh).unwrap();
        assert!(back.len() == 6 << 20 && back.iter().all(|&x| x == 0x4B));
        // Everything outside the group area is left alone.
        assert!(
            block(&dev, 0).iter().any(|&x| x != DISCARDED),
            "superblock discarded"
        );
        assert!(sb.group_start > 0);
        v.unmount().unwrap();
        let report = crate::check::check_volume(&*dev).unwrap();
        assert!(report.is_clean(), "{:?}", report.findings);
    }
}
