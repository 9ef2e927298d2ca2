//! Metadata transactions and commit points.
//!
//! Every metadata change of one operation is collected in a [`Tx`] as whole encoded blocks.
//! `Tx::commit` folds them into the node's *running compound transaction* (`Meta::pending`),
//! which the cache serves reads from. A *commit point* (fsync, sync, unmount, the background
//! committer every second, or a full journal) makes it durable:
//!
//! 1. flush the device: every data block written so far — in particular the blocks the
//!    pending metadata newly maps — is durable before the metadata that maps it;
//! 2. write the compound transaction to this node's journal, flush;
//! 3. write the blocks home (made durable by the next commit point's first flush, which is what
//!    lets the next transaction overwrite this one in the journal);
//! 4. release blocks freed by the transaction for reuse: until the free is durable a freed
//!    block must not receive another file's data.
//!
//! A crash before step 2 completes loses the whole compound transaction (the volume stays at
//! the previous commit point); after it, replay at mount redoes step 3.
//!
//! **The metadata context.** [`Meta`] is everything behind the node's metadata mutex: the
//! allocator, the block cache and running transaction, the journal, the in-flight table, and
//! how this node holds the global lock. Its fields are private; an operation changes them only
//! through the verbs below, which say what it means, so the allocator's rules (what owner a
//! block is allocated for, that a freed metadata block leaves the transaction, that held blocks
//! are committed or given back) each live in one place.
//!
//! On a [`Tx`] (one operation, under the mutex):
//!
//! | verb | meaning |
//! |---|---|
//! | `alloc_one(near)` | one metadata block (an inode, a tree node, a whiteout) near `near`; no reservation window |
//! | `alloc_meta(near, n)` | `n` metadata blocks (an xattr set), all or nothing, as few runs as possible |
//! | `alloc_data(goal, n, ino)` | `n` data blocks for file `ino`, mapped in this transaction; grows the file's reservation window |
//! | `reserve_data(goal, n, ino)` | as `alloc_data`, but held in memory only for a write in flight (fs/inflight.rs) |
//! | `commit_reserved(start, len)` / `unreserve(start, len)` | a held run is mapped now (marked used in this transaction) / not needed (the write failed) |
//! | `prepare_free(start)` | load the bitmap a later `free` of `start` needs, so a multi-run free fails before it begins |
//! | `free(start, len)` | free a run of data blocks (reusable after the next commit point) |
//! | `free_one(block)` | free one metadata block: its images leave this transaction first, then it is freed |
//! | `is_used(block)` | is the block allocated (does an inode live there)? |
//! | `forget_owner(ino)` | the file was closed or freed: drop its reservation and earned window |
//! | `sb()`, `slot()`, `inflight()` | the volume's layout, this node's slot, the writes in flight (read only) |
//!
//! On [`Meta`] (the guard held by the cluster and data paths): `free_blocks`/`total_blocks`
//! (statfs), `inflight()`/`inflight_mut()` (the in-flight table, itself a small type of
//! verbs), `gml()`/`set_gml`/`gml_version()`/`set_gml_version` and `joined` (the global lock
//! as this node holds it), and [`Meta::groups`]: the allocator's per-group bookkeeping
//! ([`Groups`]: classes, free counts, LVB counts, invalidation) that fs/cluster.rs keeps in
//! step with the group locks. `Groups` allocates and frees nothing.

use super::block_cache::{BlockCache, BlockCacheStats};
use crate::alloc::{Allocator, GroupClass};
use crate::dev::{AlignedBuf, BlockDevice};
use crate::error::{Error, ErrorKind, LockWait, Result};
use crate::format::block::BlockHeader;
use crate::format::lock_record::LockMode;
use crate::format::superblock::Superblock;
use crate::format::tree_node::TreeNode;
use crate::format::FS_BLOCK;
use crate::journal::{self, JournalArea};
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// Pool inode extents a hole punched without the global lock leaves free beyond its own runs
/// (tree nodes of the file it frees: [`Meta::pool_fits`]).
const FREES_ROOM_SPARE: usize = 16;

/// Where a freed run went, for its discard (fs/discard.rs): into the bitmaps, or into this
/// node's pool (a hole punched without the global lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FreedTo {
    Bitmaps,
    Pool,
}

impl FreedTo {
    fn queue(self) -> usize {
        match self {
            Self::Bitmaps => 0,
            Self::Pool => 1,
        }
    }
}

/// [`Meta::on_failure`]'s hook.
struct FailHook(Option<crate::cluster::membership::FenceHook>);

impl std::fmt::Debug for FailHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "FailHook(set)"
        } else {
            "FailHook(none)"
        })
    }
}

#[derive(Debug)]
pub(crate) struct Meta {
    alloc: Allocator,
    /// The volume's layout: every block pointer decoded from disk is checked against it
    /// (format/layout.rs) before it is followed.
    sb: Superblock,
    /// Clean copies of metadata blocks as they are at home (`fs/block_cache.rs`).
    cache: BlockCache,
    /// Latest image of every block changed since the last commit point.
    pending: BTreeMap<u64, Vec<u8>>,
    /// Tree-node blocks changed since the last commit point, kept decoded (fs/btree.rs): a
    /// node an operation changes again before the commit point (an extent tree's leaf under a
    /// VM's first writes, a directory's leaf under creates) is neither decoded nor encoded
    /// again. Part of the running transaction as much as `pending` (a block is in one of the
    /// two, never both); encoded into `pending` when a commit point begins.
    nodes: HashMap<u64, TreeNode>,
    journal: JournalArea,
    next_seq: u64,
    /// A commit point failed, or a change half-way (with this kind): what is on disk is
    /// unknown, so no more metadata is written ([`Meta::fail`]).
    failed: Option<ErrorKind>,
    /// Told once, when `failed` is first set: the mount fences the node there, so the others
    /// recover it now rather than when one of them next asks for a lock it holds.
    on_fail: FailHook,
    /// This node's slot (whose journal and orphan list it uses).
    slot: u32,
    /// How this node holds the cluster's global metadata lock (fs/cluster.rs).
    gml: LockMode,
    /// The lock's version when this node last held it: if it moved, caches are stale.
    gml_version: u64,
    /// Bytes of block images freed by commit points since [`take_released`](Self::take_released).
    released: usize,
    /// Allocating writes between their planning and their mapping (fs/inflight.rs).
    inflight: super::inflight::InFlight,
    /// This node's block pool (fs/pool.rs), once it has one.
    pool: Option<super::pool::Pool>,
    /// How many times the journal was emptied with everything home ([`Meta::close`]), shared
    /// with the node's lock server (fs/detached.rs), which reads it without the mutex: a
    /// change made while it read `c` is home, and out of the journal, once it is past `c`.
    emptied: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Runs whose free is durable, waiting for their discard (fs/discard.rs), freed to the
    /// bitmaps and to this node's pool; None: `nodiscard`.
    discards: Option<[super::discard::DiscardQueue; 2]>,
    /// A value-block seq newer than this node's superblock that it could not adopt yet
    /// (`fs/grow.rs`).
    geometry_behind: Option<u64>,
}

impl Meta {
    /// `cache_budget`: bytes for the metadata block cache (`meta_cache=MiB`).
    pub fn new(
        alloc: Allocator,
        journal: JournalArea,
        sb: Superblock,
        cache_budget: usize,
    ) -> Self {
        Self {
            alloc,
            sb,
            cache: BlockCache::new(cache_budget),
            pending: BTreeMap::new(),
            nodes: HashMap::new(),
            journal,
            next_seq: 1,
            failed: None,
            on_fail: FailHook(None),
            slot: 0,
            gml: LockMode::Free,
            gml_version: 0,
            released: 0,
            inflight: super::inflight::InFlight::default(),
            pool: None,
            emptied: std::sync::Arc::default(),
            discards: None,
            geometry_behind: None,
        }
    }

    pub fn geometry_behind(&self) -> Option<u64> {
        self.geometry_behind
    }

    pub fn set_geometry_behind(&mut self, seq: Option<u64>) {
        self.geometry_behind = seq;
    }

    /// The volume's layout as this node knows it now (it grows with `cetra grow`).
    pub fn sb(&self) -> &Superblock {
        &self.sb
    }

    /// The volume grew (`fs/grow.rs`): `new` is the same volume with more groups; the
    /// allocator learns the added groups (their headers are read) before any pointer into
    /// them is accepted.
    pub fn adopt_geometry(&mut self, new: Superblock) -> Result<()> {
        if new.group_count > self.sb.group_count {
            self.alloc.add_groups(new.group_count)?;
        }
        self.sb = new;
        Ok(())
    }

    /// Queue durable frees for discard from now on (fs/discard.rs).
    pub fn enable_discard(&mut self) {
        self.discards.get_or_insert_with(Default::default);
    }

    /// Blocks queued for discard, of runs freed `to` the bitmaps or the pool.
    pub fn discards_queued(&self, to: FreedTo) -> u64 {
        self.discards.as_ref().map_or(0, |q| q[to.queue()].blocks())
    }

    /// Take at most `budget` blocks of queued runs freed `to` the bitmaps or the pool, and
    /// how many runs a full queue dropped since the last call.
    pub fn take_discards(&mut self, to: FreedTo, budget: u64) -> (Vec<(u64, u64)>, u64) {
        self.discards.as_mut().map_or((Vec::new(), 0), |q| {
            let q = &mut q[to.queue()];
            (q.take(budget), q.take_dropped())
        })
    }

    /// Under the metadata mutex (a reservation needs it): the parts of a run that are in
    /// this node's pool and that nothing holds, which a discard may cover (`Pool::unclaimed`).
    pub fn pool_unclaimed(&self, start: u64, len: u64) -> Vec<(u64, u64)> {
        self.pool
            .as_ref()
            .map_or_else(Vec::new, |p| p.unclaimed(start, len))
    }

    /// Under the global lock (exclusive): the parts of a run nothing claims, which a discard
    /// may cover (`Allocator::unclaimed`).
    pub fn unclaimed(&mut self, start: u64, len: u64) -> Result<Vec<(u64, u64)>> {
        if self.gml != LockMode::Exclusive {
            bail!(
                InvalidInput,
                "free space is looked up for a discard only under the exclusive global lock"
            );
        }
        self.alloc.unclaimed(start, len)
    }

    /// The count of journal emptyings (shared; see the field).
    pub fn emptied_counter(&self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        std::sync::Arc::clone(&self.emptied)
    }

    /// Has this node a block pool?
    pub fn has_pool(&self) -> bool {
        self.pool.is_some()
    }

    /// Blocks of this node's pool that a write may hold now (0 without a pool).
    pub fn pool_available(&self) -> u64 {
        self.pool.as_ref().map_or(0, super::pool::Pool::available)
    }

    /// Has the pool room for a namespace change without the global lock (`fs/detached_ns.rs`):
    /// blocks for an inode and a directory split, and extents to spare?
    pub fn pool_has_room_for_names(&self) -> bool {
        // What writes in flight keep back for their tree nodes stays theirs.
        let writes = u64::try_from(self.inflight.pooled()).unwrap_or(u64::MAX);
        let margin = super::pool::TREE_MARGIN.saturating_mul(writes);
        self.pool.as_ref().is_some_and(|p| {
            p.available() >= super::pool::NAMES_MIN.saturating_add(margin) && !p.needs_compaction()
        })
    }

    /// Block `b` (an inode freed into the pool that the kernel still references) may be used
    /// again (`fs/detached_ns.rs`).
    pub fn unpin_pooled(&mut self, b: u64) {
        if let Some(p) = &mut self.pool {
            p.unpin(b);
        }
    }

    /// May a change without the global lock (fs/data.rs: a hole punched in, a range zeroed
    /// or preallocated in, or a locked write to a file this node owns) add up to `runs`
    /// extents to the pool inode, give the pool `freed` blocks and take `taken` of its
    /// blocks? There must be a pool with room in its inode for those extents and for the
    /// tree nodes the change may free (each may be a fragment of its own) beyond what writes
    /// in flight may add; the blocks taken beyond what those writes keep back for their tree
    /// nodes and this change's; and, when it frees, the pool must stay within
    /// [`pool::FREES_MAX`] blocks.
    ///
    /// [`pool::FREES_MAX`]: super::pool::FREES_MAX
    pub fn pool_fits(&self, runs: usize, freed: u64, taken: u64) -> bool {
        use super::pool::{FREES_MAX, TREE_MARGIN};
        let writes = self.inflight.pooled();
        let margin = TREE_MARGIN.saturating_mul(u64::try_from(writes + 2).unwrap_or(u64::MAX));
        self.pool.as_ref().is_some_and(|p| {
            let room = crate::format::inode::INLINE_EXTENTS_MAX.saturating_sub(p.fragments());
            room >= 2 * (writes + 1) + 2 * runs + FREES_ROOM_SPARE
                && p.available() >= taken.saturating_add(margin)
                && (freed == 0 || p.blocks().saturating_add(freed) <= FREES_MAX)
        })
    }

    /// Is the pool below a quarter of its last refill (time to top it up)?
    pub fn pool_is_low(&self) -> bool {
        self.pool.as_ref().is_some_and(super::pool::Pool::is_low)
    }

    /// May a refill without the global lock (`fs/group_marks.rs`) add to the pool now? It is
    /// low, the volume has a refill's worth free (`Pool` chunk, as [`Tx::refill_pool_marked`]
    /// takes it), and the pool inode is not so fragmented that the global path must compact
    /// it first (each refill adds runs).
    pub fn pool_may_refill(&self) -> bool {
        use super::pool::{CHUNK, MIN_CHUNK};
        self.pool
            .as_ref()
            .is_some_and(|p| p.is_low() && !p.needs_compaction())
            && CHUNK.min(self.alloc.free_blocks() / 64) >= MIN_CHUNK
    }

    /// How many more extents the pool inode can take (0 without a pool): each write in flight
    /// from the pool may add two (a run taken out of the middle of one, a tree node given
    /// back), and the inode must stay inline.
    pub fn pool_room(&self) -> usize {
        self.pool.as_ref().map_or(0, |p| {
            crate::format::inode::INLINE_EXTENTS_MAX.saturating_sub(p.fragments())
        })
    }

    /// Mount: this node is `slot` and holds the global lock shared at `version`.
    pub fn joined(&mut self, slot: u32, version: u64) {
        self.slot = slot;
        self.gml = LockMode::Shared;
        self.gml_version = version;
    }

    /// How this node holds the global metadata lock now.
    pub fn gml(&self) -> LockMode {
        self.gml
    }

    pub fn set_gml(&mut self, mode: LockMode) {
        self.gml = mode;
    }

    /// The global lock's version when this node last held it (caches are valid as of it).
    pub fn gml_version(&self) -> u64 {
        self.gml_version
    }

    pub fn set_gml_version(&mut self, version: u64) {
        self.gml_version = version;
    }

    /// Allocating writes in flight on this node (fs/inflight.rs).
    pub fn inflight(&self) -> &super::inflight::InFlight {
        &self.inflight
    }

    pub fn inflight_mut(&mut self) -> &mut super::inflight::InFlight {
        &mut self.inflight
    }

    /// Free blocks of the volume (statfs; as exact as alloc.rs says). This node's pool
    /// (fs/pool.rs) counts as free, with its inode block: no file uses those blocks. Other
    /// nodes count them as used until the pool is given back.
    pub fn free_blocks(&self) -> u64 {
        self.alloc.free_blocks() + self.pool.as_ref().map_or(0, |p| p.blocks() + 1)
    }

    pub fn total_blocks(&self) -> u64 {
        self.alloc.total_blocks()
    }

    /// Blocks held for allocating writes in flight (from the bitmaps or the pool).
    #[cfg(test)]
    pub fn held_blocks(&self) -> u64 {
        self.alloc.held()
            + self
                .pool
                .as_ref()
                .map_or(0, super::pool::Pool::held_for_writes)
    }

    /// Do blocks freed into this node's pool wait for the commit point?
    #[cfg(test)]
    pub fn pool_has_quarantine(&self) -> bool {
        self.pool
            .as_ref()
            .is_some_and(super::pool::Pool::has_quarantine)
    }

    /// The allocator's per-group bookkeeping, for fs/cluster.rs (see [`Groups`]).
    pub fn groups(&mut self) -> Groups<'_> {
        Groups(&mut self.alloc)
    }

    /// Forget every cached block (another node may have changed them). Only clean copies are
    /// cached; the running transaction, which reads see first, holds only changes this node
    /// made under the global lock before it gave the lock up (then it is empty: the handoff
    /// wrote it home) or without it, to objects whose own locks it holds (fs/pool.rs).
    pub fn drop_cache(&mut self) {
        self.cache.clear();
    }

    /// What the metadata block cache holds and has done.
    pub fn cache_stats(&self) -> BlockCacheStats {
        self.cache.stats()
    }

    /// What the allocator's bitmap cache holds and has done.
    pub fn bitmap_stats(&self) -> crate::alloc::BitmapCacheStats {
        self.alloc.bitmap_stats()
    }

    /// Bytes of transaction images freed by commit points and of bitmaps the allocator
    /// dropped since the last call (the reporter hands such memory back to the OS).
    pub fn take_released(&mut self) -> usize {
        std::mem::take(&mut self.released).saturating_add(self.alloc.take_released())
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty() || !self.nodes.is_empty() || self.alloc.has_quarantine()
    }

    /// An allocation found no space while blocks freed after commit point number `since`
    /// waited for the next one (step 4 of the module docs; [`Error::frees_wait`]): make them
    /// usable, running that commit point unless one ran meanwhile (the committer, a handoff),
    /// so that the caller tries once more and `ENOSPC` means a full volume, not frees not yet
    /// durable (a deleted image's space must be usable by the next write; ext4 forces its
    /// journal's commit the same way before it answers `ENOSPC`). Between operations only:
    /// the running transaction must hold every change made so far. False if it cannot help
    /// (the metadata path failed).
    pub fn commit_for_space(&mut self, dev: &dyn BlockDevice, since: u64) -> Result<bool> {
        if self.failed.is_some() {
            return Ok(false);
        }
        if self.alloc.commit_points() == since {
            tracing::debug!("no space: a commit point makes the blocks freed since usable");
            self.commit_point(dev)?;
        }
        Ok(true)
    }

    /// A write's blocks held from the bitmaps found no space while blocks freed into this
    /// node's pool (a hole punched without the global lock) wait for the commit point: typed
    /// as the allocator's own waiting frees are ([`Error::frees_wait`]), since the write's next
    /// attempt plans from the pool first (fs/data.rs `plan_held`). Only there: other
    /// allocations take from the bitmaps alone, which that commit point does not help.
    fn space_error<T>(&self, r: Result<T>) -> Result<T> {
        match r {
            Err(e)
                if e.kind() == ErrorKind::NoSpace
                    && e.frees_wait().is_none()
                    && self
                        .pool
                        .as_ref()
                        .is_some_and(super::pool::Pool::has_quarantine) =>
            {
                Err(Error::no_space_until_commit(
                    format!("{e}; blocks freed into this node's pool wait for the commit point"),
                    self.alloc.commit_points(),
                ))
            }
            r => r,
        }
    }

    /// Pool run `start`+`len` went back to the bitmaps (a compaction): its parts still
    /// waiting for a discard as the pool's (a hole a guest punched, fs/discard.rs) wait as
    /// the bitmaps' now, where the discarder finds them (checked as unclaimed there).
    fn requeue_discards(&mut self, start: u64, len: u64) {
        if let Some(q) = &mut self.discards {
            for (s, l) in q[FreedTo::Pool.queue()].take_within(start, len) {
                q[FreedTo::Bitmaps.queue()].push(s, l);
            }
        }
    }

    /// Blocks in the running transaction.
    fn pending_blocks(&self) -> usize {
        self.pending.len() + self.nodes.len()
    }

    /// Make the running compound transaction durable (see the module docs).
    pub fn commit_point(&mut self, dev: &dyn BlockDevice) -> Result<()> {
        self.check_not_failed()?;
        self.commit_point_inner(dev)
            .inspect_err(|e| self.fail(e.kind(), &format!("a metadata commit point failed: {e}")))
    }

    /// Run `hook` once when this node's metadata path fails ([`Meta::fail`]); the mount
    /// fences the node there.
    pub fn on_failure(&mut self, hook: crate::cluster::membership::FenceHook) {
        self.on_fail = FailHook(Some(hook));
    }

    /// The one home of "this node's metadata path failed": a commit point that did not
    /// complete, a journal not emptied before a lock goes, or a change that failed half-way
    /// ([`Tx::fail_node`]). What is on disk is unknown, or the running transaction holds half
    /// a change: nothing more of this node's metadata is written, and the node fences itself
    /// at once (GFS2's *withdraw*) — it stops renewing its lease, so the others replay its
    /// journal and take its locks after the dead time, instead of finding a node that still
    /// holds its locks but can change nothing when they next ask for one.
    fn fail(&mut self, kind: ErrorKind, why: &str) {
        if self.failed.is_none() {
            // Later calls fail with this kind: never one that callers act on (a refusal
            // that sends an operation to the global path, a wait that starts it again).
            self.failed = Some(match kind {
                ErrorKind::NeedsGlobalLock | ErrorKind::WaitForLock => ErrorKind::Io,
                k => k,
            });
            if kind == ErrorKind::Fenced {
                // Fenced first (the lease, a reservation conflict): logged once, as FENCED.
                tracing::debug!("{why}");
            } else {
                tracing::error!("{why}: this node writes no more metadata; remount the volume");
            }
            if let Some(hook) = &self.on_fail.0 {
                hook(why);
            }
        }
    }

    fn commit_point_inner(&mut self, dev: &dyn BlockDevice) -> Result<()> {
        // Taken, not drained: a drained map keeps the table a write storm grew.
        for (b, n) in std::mem::take(&mut self.nodes) {
            self.pending.insert(b, n.encode());
        }
        dev.flush()?;
        if self.pending.is_empty() {
            self.committed();
            return Ok(());
        }
        crate::failpoint!("commit::before_journal");
        let blocks: Vec<(u64, &[u8])> = self
            .pending
            .iter()
            .map(|(b, d)| (*b, d.as_slice()))
            .collect();
        journal::write_tx(dev, self.journal, self.next_seq, &blocks)?;
        crate::failpoint!("commit::before_journal_flush");
        dev.flush()?;
        crate::failpoint!("commit::before_home");
        // The panic-policy test panics here: journal durable, home blocks not yet written.
        crate::failpoint::process("commit::before_home");
        self.next_seq += 1;
        let pending = std::mem::take(&mut self.pending);
        let mut run: Vec<(u64, &Vec<u8>)> = Vec::new();
        for (b, data) in &pending {
            if run.last().is_some_and(|(pb, _)| pb + 1 != *b) || run.len() >= 256 {
                write_run(dev, &run)?;
                run.clear();
            }
            run.push((*b, data));
        }
        write_run(dev, &run)?;
        // Home now: these images are the clean copies.
        for (b, data) in &pending {
            self.cache.insert(*b, data);
        }
        self.released = self
            .released
            .saturating_add(pending.len() * crate::format::FS_BLOCK_SIZE);
        self.committed();
        Ok(())
    }

    /// A commit point completed: frees are durable, and everything changed before is home.
    fn committed(&mut self) {
        let released = self.alloc.committed();
        let pooled = self.pool.as_mut().map(super::pool::Pool::committed);
        if let Some(q) = &mut self.discards {
            for (start, len) in released {
                q[FreedTo::Bitmaps.queue()].push(start, len);
            }
            for (start, len) in pooled.into_iter().flatten() {
                q[FreedTo::Pool.queue()].push(start, len);
            }
        }
    }

    /// Everything durable and home: leave an empty journal behind (clean unmount).
    pub fn close(&mut self, dev: &dyn BlockDevice) -> Result<()> {
        self.commit_point(dev)?;
        dev.flush()
            .and_then(|()| journal::invalidate(dev, self.journal))
            .inspect_err(|e| self.fail(e.kind(), &format!("emptying the journal failed: {e}")))?;
        self.emptied
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok(())
    }

    /// Did a commit point fail, or a change half-way ([`Meta::fail`])? Nothing more of this
    /// node's metadata reaches the LUN then.
    pub fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// The sticky error of an earlier failure of the metadata path ([`Meta::fail`]). It
    /// keeps that failure's kind, so a fenced node's later calls are `Fenced` (logged once,
    /// as FENCED), not new I/O errors.
    fn check_not_failed(&self) -> Result<()> {
        match self.failed {
            None => Ok(()),
            Some(kind) => Err(Error::new(
                kind,
                "this node's metadata path failed earlier (a commit point, or a change half-way) and the node fenced itself; remount the volume",
            )),
        }
    }

    pub fn journal(&self) -> JournalArea {
        self.journal
    }
}

/// The allocator's per-group state as fs/cluster.rs keeps it in step with the group locks:
/// which groups this node owns, their free counts, the counts published in the locks' value
/// blocks, and invalidation when another node may have changed groups. Nothing here allocates
/// or frees a block (that is [`Tx`]'s verbs).
pub(crate) struct Groups<'m>(&'m mut Allocator);

impl Groups<'_> {
    /// Another node may have changed groups: every group is unchecked (alloc.rs).
    pub fn invalidate(&mut self) {
        self.0.invalidate();
    }

    pub fn class(&self, g: u64) -> Option<GroupClass> {
        self.0.class(g)
    }

    pub fn set_class(&mut self, g: u64, class: GroupClass) {
        self.0.set_class(g, class);
    }

    /// Free blocks of group `g` as known (for choosing groups).
    pub fn group_free(&self, g: u64) -> Option<u64> {
        self.0.group_free(g)
    }

    /// Free blocks of group `g`, exact (reads its header if unchecked): what is published
    /// when the group is given back.
    pub fn exact_free(&mut self, g: u64) -> Result<u64> {
        self.0.exact_free(g)
    }

    /// Free blocks in the groups this node owns.
    pub fn free_in_mine(&self) -> u64 {
        self.0.free_in_mine()
    }

    /// Group `g`'s LVB count as just read from its lock record.
    pub fn note_lvb(&mut self, g: u64, lvb: Option<u64>) {
        self.0.note_lvb(g, lvb);
    }

    /// This node wrote `free` into group `g`'s LVB.
    pub fn note_published(&mut self, g: u64, free: u64) {
        self.0.note_published(g, free);
    }

    /// Every group's published count as this node last saw it (`Allocator::lvbs_seen`).
    pub fn lvbs_seen(&self) -> Vec<Option<u64>> {
        self.0.lvbs_seen()
    }

    /// `note_lvb`, unless the count seen for `g` is no longer `before`
    /// (`Allocator::note_lvb_unless_seen`).
    pub fn note_lvb_unless_seen(&mut self, g: u64, before: Option<u64>, lvb: Option<u64>) {
        self.0.note_lvb_unless_seen(g, before, lvb);
    }

    /// Groups whose free count changed since the last call, with their counts (to publish).
    pub fn take_changed(&mut self) -> Vec<(u64, u64)> {
        self.0.take_changed()
    }

    /// Format 7: mark other nodes' groups through `gate` before using them (alloc.rs); with
    /// `unowned_too` (format 8) also groups nobody owns.
    pub fn set_gate(
        &mut self,
        gate: std::sync::Arc<dyn crate::alloc::GroupGate>,
        unowned_too: bool,
    ) {
        self.0.set_gate(gate, unowned_too);
    }

    /// The other nodes' groups this node's mark is on (to take the marks off).
    pub fn take_marked(&mut self) -> Vec<u64> {
        self.0.take_marked()
    }

    /// This node's mark may still be on group `g`: take it off with the next ones.
    pub fn unmark_later(&mut self, g: u64) {
        self.0.unmark_later(g);
    }

    /// Is a take-off of this node's marks pending?
    pub fn has_marks_to_take_off(&self) -> bool {
        self.0.has_marks_to_take_off()
    }

    /// Groups this node owns.
    pub fn mine(&self) -> Vec<u64> {
        self.0.of_class(crate::alloc::GroupClass::Mine)
    }

    /// Groups this node owns, with the most free blocks first (where a refill looks).
    pub fn mine_by_free(&self) -> Vec<(u64, u64)> {
        self.0.by_free(crate::alloc::GroupClass::Mine)
    }

    /// Groups nobody owns as far as this node knows, with the most free blocks first (where
    /// a refill claims one, format 8).
    pub fn unowned_by_free(&self) -> Vec<(u64, u64)> {
        self.0.by_free(crate::alloc::GroupClass::Unowned)
    }
}

#[derive(Debug)]
pub(crate) struct Tx<'a> {
    dev: &'a dyn BlockDevice,
    meta: &'a mut Meta,
    dirty: BTreeMap<u64, Vec<u8>>,
    /// Made without the global lock (fs/pool.rs): blocks come from and go back to this
    /// node's pool; no bitmap is read or changed.
    detached: bool,
    /// Something was written, allocated or freed (a refusal after that would leave half a
    /// change: `fs/detached_ns.rs`).
    touched: bool,
    /// A read its caller may start again (`Volume::read_op`): a long wait for an inode lock
    /// gives the global lock and the metadata mutex up instead, while nothing was changed.
    restartable: bool,
    /// Locks (inode locks, group marks) an earlier attempt of the same operation already
    /// waited for outside: not again (a live owner could otherwise take the lock back each
    /// time).
    waited: Vec<LockWait>,
}

impl<'a> Tx<'a> {
    pub fn new(dev: &'a dyn BlockDevice, meta: &'a mut Meta) -> Self {
        Self {
            dev,
            meta,
            dirty: BTreeMap::new(),
            detached: false,
            touched: false,
            restartable: false,
            waited: Vec::new(),
        }
    }

    /// A read that its caller starts again after [`ErrorKind::WaitForLock`]
    /// (`Volume::read_op`); `waited`: the locks earlier attempts waited for.
    pub fn restartable(dev: &'a dyn BlockDevice, meta: &'a mut Meta, waited: &[LockWait]) -> Self {
        let mut tx = Self::new(dev, meta);
        tx.restartable = true;
        tx.waited = waited.to_vec();
        tx
    }

    /// May a long wait for inode `ino`'s lock end this transaction with
    /// [`ErrorKind::WaitForLock`]? Only a restartable one that changed nothing yet, and
    /// once per inode and operation: the next attempt waits holding its locks (an owner
    /// that gave the lock once is alive, and cannot take it back from under a global hold).
    pub fn may_restart(&self, ino: u64) -> bool {
        self.restartable
            && !self.touched
            && !self
                .waited
                .iter()
                .any(|w| matches!(w, LockWait::Inode { ino: i, .. } if *i == ino))
    }

    /// From here on no wait ends this transaction with [`ErrorKind::WaitForLock`]:
    /// its caller changed state in memory that a new attempt would not undo.
    pub fn no_restart(&mut self) {
        self.restartable = false;
    }

    /// The abort test of a wait for inode `ino`'s lock that began at `since`, under the
    /// global lock: once the wait took [`INODE_LOCK_PATIENCE`] and this transaction may start
    /// again, it ends with [`ErrorKind::WaitForLock`] (to hold the lock shared, or, if
    /// `exclusive`, until it could be owned). The copy of the inode's block read before may
    /// be stale then: nobody is to use it while the metadata mutex is free.
    ///
    /// [`INODE_LOCK_PATIENCE`]: super::detached::INODE_LOCK_PATIENCE
    pub fn stop_waiting(&mut self, ino: u64, since: Instant, exclusive: bool) -> Option<Error> {
        if !self.may_restart(ino) || since.elapsed() < super::detached::INODE_LOCK_PATIENCE {
            return None;
        }
        self.drop_cached(ino);
        Some(Error::wait_for_inode_lock(ino, exclusive))
    }

    /// A transaction made without the global lock (fs/pool.rs): only for changes of objects
    /// whose own locks this node holds exclusively; allocation from the pool only.
    pub fn detached(dev: &'a dyn BlockDevice, meta: &'a mut Meta) -> Self {
        let mut tx = Self::new(dev, meta);
        tx.detached = true;
        tx
    }

    /// The metadata context this transaction works in (a wait that serves the node's
    /// duties while an operation holds the mutex: fs/detached.rs).
    pub fn meta_mut(&mut self) -> &mut Meta {
        self.meta
    }

    fn pool_mut(&mut self) -> Result<&mut super::pool::Pool> {
        match &mut self.meta.pool {
            Some(p) => Ok(p),
            None => Err(Error::new(
                ErrorKind::Io,
                "no block pool: a change without the global lock cannot allocate",
            )),
        }
    }

    /// May `runs` be freed in this transaction now? Always under the global lock; without
    /// it they go into this node's pool, which must have room for them ([`Meta::pool_fits`]).
    pub fn frees_fit(&self, runs: &[(u64, u64)]) -> bool {
        !self.detached
            || self
                .meta
                .pool_fits(runs.len(), runs.iter().map(|&(_, l)| l).sum(), 0)
    }

    /// This transaction holds half a change that cannot be undone (a bug, or a read that
    /// failed in the middle of an undo), which `what` describes: no more metadata of this
    /// node reaches the LUN, as after a failed commit point, and the node fences itself; the
    /// others recover it from its last commit point ([`Meta::fail`]).
    pub fn fail_node(&mut self, e: &Error, what: &str) {
        self.meta
            .fail(e.kind(), &format!("{what} failed half-way: {e}"));
    }

    /// Made without the global lock?
    pub fn is_detached(&self) -> bool {
        self.detached
    }

    /// Did this transaction change anything yet (a block written, allocated or freed)?
    pub fn touched(&self) -> bool {
        self.touched
    }

    fn refuse_detached(&self, what: &str) -> Result<()> {
        if self.detached {
            return Err(Error::new(
                ErrorKind::NeedsGlobalLock,
                format!("{what} needs the global lock (a change without it allocates from the pool only)"),
            ));
        }
        Ok(())
    }

    /// The volume's layout: every block pointer decoded from disk is checked against it
    /// (format/layout.rs) before it is followed.
    pub fn sb(&self) -> &Superblock {
        &self.meta.sb
    }

    /// This node's slot.
    pub fn slot(&self) -> u32 {
        self.meta.slot
    }

    /// Allocating writes in flight on this node.
    pub fn inflight(&self) -> &super::inflight::InFlight {
        &self.meta.inflight
    }

    /// One metadata block (an inode, a tree node, a whiteout) as near `near` as possible.
    pub fn alloc_one(&mut self, near: u64) -> Result<u64> {
        self.touched = true;
        if self.detached {
            return self
                .pool_mut()?
                .take_one(near)
                .ok_or_else(|| Error::new(ErrorKind::NoSpace, "this node's block pool is empty"));
        }
        Ok(self.meta.alloc.alloc(near, 1, 0)?[0].0)
    }

    /// `n` metadata blocks (no reservation window), all or nothing, as few runs as possible.
    pub fn alloc_meta(&mut self, near: u64, n: u64) -> Result<Vec<(u64, u64)>> {
        self.refuse_detached("allocating metadata blocks")?;
        self.touched = true;
        self.meta.alloc.alloc(near, n, 0)
    }

    /// `n` data blocks for file `ino`, near `goal`, all or nothing, mapped by this
    /// transaction (the file's reservation window grows: alloc.rs).
    pub fn alloc_data(&mut self, goal: u64, n: u64, ino: u64) -> Result<Vec<(u64, u64)>> {
        self.refuse_detached("allocating data blocks")?;
        self.touched = true;
        self.meta.alloc.alloc(goal, n, ino)
    }

    /// As [`Tx::alloc_data`], but held in memory only, for an allocating write in flight:
    /// [`Tx::commit_reserved`] or [`Tx::unreserve`] ends each run's hold.
    pub fn reserve_data(&mut self, goal: u64, n: u64, ino: u64) -> Result<Vec<(u64, u64)>> {
        self.refuse_detached("allocating data blocks")?;
        let runs = self.meta.alloc.reserve(goal, n, ino);
        self.meta.space_error(runs)
    }

    /// Hold `n` blocks of this node's pool for a write in flight (fs/pool.rs), keeping
    /// `margin` blocks back for tree nodes; None if the pool has not that many.
    pub fn reserve_pooled(
        &mut self,
        goal: u64,
        n: u64,
        ino: u64,
        margin: u64,
    ) -> Option<Vec<(u64, u64)>> {
        let p = self.meta.pool.as_mut()?;
        if p.available() < n + margin {
            return None;
        }
        p.reserve(n, goal, ino)
    }

    /// A held pool run is mapped by a file in this transaction.
    pub fn commit_pooled(&mut self, start: u64, len: u64) {
        self.touched = true;
        if let Some(p) = &mut self.meta.pool {
            p.commit(start, len);
        }
    }

    /// Inode block `b` (unlinked, still open here) becomes the pool's on disk, pinned
    /// ([`Pool::adopt`](super::pool::Pool::adopt)).
    pub fn park_in_pool(&mut self, b: u64) {
        self.touched = true;
        if let Some(p) = &mut self.meta.pool {
            p.adopt(b);
        }
    }

    /// A parked inode is changed on the global path: its block is its own again.
    pub fn unpark_from_pool(&mut self, b: u64) {
        self.touched = true;
        if let Some(p) = &mut self.meta.pool {
            p.unadopt(b);
        }
    }

    /// A parked inode is freed: its images leave the transaction, its block stays the pool's.
    pub fn free_parked(&mut self, b: u64) {
        self.touched = true;
        self.forget(b);
        if let Some(p) = &mut self.meta.pool {
            p.release_adopted(b);
        }
    }

    /// Keep block `b`, just freed into the pool, out of use until
    /// [`Meta::unpin_pooled`] (the kernel still references it as an inode number).
    pub fn pin_pooled(&mut self, b: u64) {
        if let Some(p) = &mut self.meta.pool {
            p.pin(b);
        }
    }

    /// A held pool run is not needed (its write failed).
    pub fn unreserve_pooled(&mut self, start: u64) {
        if let Some(p) = &mut self.meta.pool {
            p.unreserve(start);
        }
    }

    /// Under the global lock (exclusive): keep this node's pool usable for allocating writes
    /// without the lock. Creates the pool inode (on the orphan list) the first time and tops
    /// it up by up to
    /// [`pool::CHUNK`](super::pool::CHUNK) blocks (at most a 64th of the free space) near
    /// `goal` when fewer than a quarter of that are available. Failure to
    /// grow it only means allocating under the global lock.
    pub fn ensure_pool(&mut self, goal: u64) -> Result<()> {
        use super::pool::{Pool, CHUNK, FRAGMENTS_MAX, LOW_FRACTION, MIN_CHUNK};
        debug_assert!(!self.detached);
        let chunk = CHUNK.min(self.meta.alloc.free_blocks() / 64);
        if self.meta.pool.is_none() {
            if chunk < MIN_CHUNK {
                return Ok(());
            }
            let mut h = self.slot_header()?;
            if h.orphans.len() >= crate::format::slot_header::MAX_ORPHANS {
                return Ok(());
            }
            let ino = self.alloc_one(goal)?;
            let pool = Pool::create(self, ino)?;
            h.orphans.push(ino);
            self.put_slot_header(h);
            self.meta.pool = Some(pool);
        }
        // (Too many fragments are freed back at this transaction's commit: Tx::commit.)
        let (available, fragments) = self
            .meta
            .pool
            .as_ref()
            .map_or((0, 0), |p| (p.available(), p.fragments()));
        if available < chunk / LOW_FRACTION && chunk >= MIN_CHUNK {
            let mut runs = match self.meta.alloc.alloc(goal, chunk, 0) {
                Ok(r) => r,
                Err(e) if e.kind() == ErrorKind::NoSpace => return Ok(()),
                Err(e) => return Err(e),
            };
            // A fragmented volume gives many short runs: keep the longest that fit the
            // inode's inline extents, and free the rest again.
            let room = FRAGMENTS_MAX.saturating_sub(fragments).max(1);
            if runs.len() > room {
                runs.sort_by_key(|r| std::cmp::Reverse(r.1));
                for (s, l) in runs.split_off(room) {
                    self.meta.alloc.free_unused(s, l)?;
                }
            }
            if let Some(p) = &mut self.meta.pool {
                p.refill(&runs, chunk);
            }
        }
        Ok(())
    }

    /// Format 7, without the global lock (`fs/group_marks.rs`): top the pool up from group `g`
    /// alone, which this node owns and has marked. Up to a refill's worth, as
    /// [`Tx::ensure_pool`] takes; false if the pool is not low or the group had nothing.
    /// Only this transaction's commit and a commit point may follow (the bitmap blocks must
    /// be home before the mark goes).
    pub fn refill_pool_marked(&mut self, g: u64) -> Result<bool> {
        use super::pool::{CHUNK, MIN_CHUNK};
        debug_assert!(self.detached);
        let chunk = CHUNK.min(self.meta.alloc.free_blocks() / 64);
        let Some((low, fragments)) = self.meta.pool.as_ref().map(|p| (p.is_low(), p.fragments()))
        else {
            return Ok(false);
        };
        // Low as the write path judged it (`Pool::is_low`, against the last refill's size):
        // a size computed again here shrinks as the volume fills, and a pool the write path
        // found low would not be topped up, the write then taking the global path.
        if chunk < MIN_CHUNK || !low {
            return Ok(false);
        }
        // At most as many runs as the inode has room for: nothing to free again (a free
        // could fail half-way, and this transaction must not).
        let room = super::pool::FRAGMENTS_MAX.saturating_sub(fragments).max(1);
        let runs = self.meta.alloc.alloc_in(g, chunk, MIN_CHUNK, room)?;
        if runs.is_empty() {
            return Ok(false);
        }
        self.touched = true;
        if let Some(p) = &mut self.meta.pool {
            p.refill(&runs, chunk);
        }
        Ok(true)
    }

    /// Under the global lock (exclusive), nothing in flight: give every pool block back to
    /// the bitmaps, free the pool inode and take it off the orphan list (clean unmount).
    pub fn return_pool(&mut self, wait: bool) -> Result<()> {
        debug_assert!(!self.detached);
        let Some(runs) = self.meta.pool.as_ref().map(super::pool::Pool::runs) else {
            return Ok(());
        };
        // Every bitmap the frees need is loaded first: a read that fails leaves the pool as
        // it was, rather than its runs freed in the bitmaps and still listed by its inode.
        // (`wait` false: a group another node is refilling from fails it at once, format 7.)
        // So are the pool inode's own and the slot header: a read failing after the frees
        // would leave the pool inode on the orphan list, mapping runs already free, for the
        // recovery to free again.
        let ino = self.meta.pool.as_ref().map(super::pool::Pool::ino);
        for s in runs.iter().map(|&(s, _)| s).chain(ino) {
            if wait {
                self.prepare_free(s)?;
            } else {
                self.meta.alloc.prepare_free_now(s)?;
            }
        }
        let mut h = self.slot_header()?;
        let Some(mut p) = self.meta.pool.take() else {
            return Ok(());
        };
        for (s, l) in p.drain_to() {
            self.meta.alloc.free(s, l)?;
        }
        let ino = p.ino();
        self.free_one(ino)?;
        h.orphans.retain(|&o| o != ino);
        self.put_slot_header(h);
        Ok(())
    }

    /// A held run is mapped now: mark it used in this transaction.
    pub fn commit_reserved(&mut self, start: u64, len: u64) {
        self.touched = true;
        self.meta.alloc.commit_reserved(start, len);
    }

    /// A held run is not needed after all (its write failed).
    pub fn unreserve(&mut self, start: u64, len: u64) {
        self.meta.alloc.unreserve(start, len);
    }

    /// Load what a later [`Tx::free`] of a run starting at `start` needs, so that freeing
    /// several runs fails before the first is freed rather than half-way.
    ///
    /// Format 7: the group must carry this node's mark if another node owns it, so this
    /// waits while another node's mark is on it (a refill: milliseconds; a node that died in
    /// one keeps it until its recovery). A transaction that may start again and changed
    /// nothing waits only a moment ([`MARK_PATIENCE`]) and then ends with
    /// [`ErrorKind::WaitForLock`], once per group: its caller waits for the mark to go
    /// holding no lock (`Volume::wait_for_group_mark`), so a dead node's mark keeps only this
    /// operation waiting, not the global lock and this node's metadata mutex with it.
    ///
    /// [`MARK_PATIENCE`]: super::group_marks::MARK_PATIENCE
    pub fn prepare_free(&mut self, start: u64) -> Result<()> {
        if self.detached {
            return Ok(());
        }
        if self.restartable && !self.touched {
            if let Some(group) = self.meta.alloc.prepare_free_briefly(start)? {
                let wait = LockWait::GroupMark { group };
                if !self.waited.contains(&wait) {
                    return Err(Error::wait_for_group_mark(group));
                }
                return self.meta.alloc.prepare_free(start);
            }
            return Ok(());
        }
        self.meta.alloc.prepare_free(start)
    }

    /// Free a run of data blocks (reusable once a commit point made the free durable).
    /// Without the global lock the run goes back into this node's pool.
    pub fn free(&mut self, start: u64, len: u64) -> Result<()> {
        self.touched = true;
        if self.detached {
            self.pool_mut()?.give(start, len);
            return Ok(());
        }
        self.meta.alloc.free(start, len)
    }

    /// Free one metadata block: its image leaves this transaction (and the running one, and
    /// the cache) first, so it is never written after it was freed.
    pub fn free_one(&mut self, block: u64) -> Result<()> {
        self.forget(block);
        self.free(block, 1)
    }

    /// Is `block` allocated to something other than this node's pool? (Loads its group's
    /// bitmap: never without the global lock.) A block in the pool is free space this node
    /// took, not an inode: an inode freed without the global lock goes there
    /// (`fs/detached_ns.rs`), and its old image stays at home until the block is reused.
    pub fn is_used(&mut self, block: u64) -> Result<bool> {
        self.refuse_detached("reading an allocation bitmap")?;
        if self.meta.pool.as_ref().is_some_and(|p| p.contains(block)) {
            return Ok(false);
        }
        self.meta.alloc.is_used(block)
    }

    /// File `ino` was closed or freed: drop its reservation and earned window.
    pub fn forget_owner(&mut self, ino: u64) {
        self.meta.alloc.forget_owner(ino);
    }

    /// Read a metadata block: this transaction's copy, the running compound transaction's,
    /// the cache, else the device.
    pub fn read(&mut self, block: u64) -> Result<Vec<u8>> {
        if let Some(b) = self.dirty.get(&block) {
            return Ok(b.clone());
        }
        if let Some(n) = self.meta.nodes.get(&block) {
            return Ok(n.encode());
        }
        if let Some(b) = self.meta.pending.get(&block) {
            return Ok(b.clone());
        }
        if let Some(b) = self.meta.cache.get(block) {
            return Ok(b.to_vec());
        }
        let mut buf = AlignedBuf::new(crate::format::FS_BLOCK_SIZE);
        self.dev.read_at(block * FS_BLOCK, &mut buf)?;
        self.meta.cache.insert(block, &buf);
        Ok(buf.to_vec())
    }

    /// The sequence number a new metadata object placed in `block` must start above: the one
    /// of whatever metadata the block held before, so journal replay (which only moves blocks
    /// forward in sequence) never prefers an old image over the new object.
    pub fn prior_seq(&mut self, block: u64) -> Result<u64> {
        let raw = self.read(block)?;
        Ok(BlockHeader::decode(&raw).map_or(0, |h| h.seq))
    }

    /// Forget the cached clean copy of `block` (it may be stale: read it from disk again).
    pub fn drop_cached(&mut self, block: u64) {
        self.meta.cache.invalidate(block);
    }

    /// This node's slot header (orphan list).
    pub fn slot_header(&mut self) -> Result<crate::format::slot_header::SlotHeader> {
        self.slot_header_of(self.meta.slot)
    }

    /// Put `ino` (no links, still open) on this node's orphan list, so that a crash does not
    /// leak it (under the global lock: another node may change the list too).
    pub fn add_orphan(&mut self, ino: u64) -> Result<()> {
        let mut h = self.slot_header()?;
        if h.orphans.len() < crate::format::slot_header::MAX_ORPHANS {
            h.orphans.push(ino);
            self.put_slot_header(h);
        } else {
            tracing::warn!(
                "orphan list full: inode {ino} leaks if this node crashes before closing it"
            );
        }
        Ok(())
    }

    pub fn put_slot_header(&mut self, h: crate::format::slot_header::SlotHeader) {
        self.put_slot_header_of(self.meta.slot, h);
    }

    fn slot_header_at(&self, slot: u32) -> u64 {
        // Every slot's journal has the same size; ours is at `journal().start`.
        let j = self.meta.journal();
        (j.start - u64::from(self.meta.slot) * j.blocks) + u64::from(slot) * j.blocks
    }

    /// Any slot's header (recovery of a dead node's orphans).
    pub fn slot_header_of(&mut self, slot: u32) -> Result<crate::format::slot_header::SlotHeader> {
        let at = self.slot_header_at(slot);
        let raw = self.read(at)?;
        crate::format::slot_header::SlotHeader::decode(&raw, at, slot)
    }

    pub fn put_slot_header_of(&mut self, slot: u32, mut h: crate::format::slot_header::SlotHeader) {
        h.seq += 1;
        let at = self.slot_header_at(slot);
        self.write(at, h.encode(at));
    }

    pub fn write(&mut self, block: u64, data: Vec<u8>) {
        self.touched = true;
        self.meta.nodes.remove(&block);
        self.dirty.insert(block, data);
    }

    /// The running transaction's decoded image of tree-node block `block`, taken out of it:
    /// the caller changes it and gives it back with [`Tx::put_node`] (on every path, errors
    /// included: until then the transaction lacks the block). `None` when the block's latest
    /// image is encoded (read it with [`Tx::read`]).
    pub fn take_node(&mut self, block: u64) -> Option<TreeNode> {
        if self.dirty.contains_key(&block) {
            return None;
        }
        self.meta.nodes.remove(&block)
    }

    /// A copy of the running transaction's decoded image of `block`, if it has one.
    pub fn node_copy(&self, block: u64) -> Option<TreeNode> {
        if self.dirty.contains_key(&block) {
            return None;
        }
        self.meta.nodes.get(&block).cloned()
    }

    /// Write a tree node, kept decoded until the commit point. Unlike [`Tx::write`] this goes
    /// straight into the running transaction: an operation that changes a tree commits (as
    /// every metadata operation does, even on error).
    pub fn put_node(&mut self, n: TreeNode) {
        self.touched = true;
        self.dirty.remove(&n.blockno);
        self.meta.pending.remove(&n.blockno);
        self.meta.nodes.insert(n.blockno, n);
    }

    /// A block that was freed must not be written later in this transaction.
    fn forget(&mut self, block: u64) {
        self.dirty.remove(&block);
        self.meta.pending.remove(&block);
        self.meta.nodes.remove(&block);
        self.meta.cache.invalidate(block);
    }

    /// Fold this operation's changes into the running compound transaction.
    pub fn commit(mut self) -> Result<()> {
        self.meta.check_not_failed()?;
        if let Some(mut p) = self.meta.pool.take() {
            if !self.detached && p.needs_compaction() {
                // Under the global lock: give the extra runs back rather than fail to save.
                // Their bitmaps are loaded (format 7: and marked) first; if one cannot be,
                // the runs stay in the pool (it is under the inode's limit still).
                let runs = p.compact(super::pool::FRAGMENTS_MAX / 2);
                match runs
                    .iter()
                    .try_for_each(|&(s, _)| self.meta.alloc.prepare_free_now(s))
                {
                    Ok(()) => {
                        // Never an early return here: this operation's blocks must reach the
                        // running transaction with the bitmap changes it made.
                        for (i, &(s, l)) in runs.iter().enumerate() {
                            if let Err(e) = self.meta.alloc.free_unused(s, l) {
                                tracing::warn!("the pool keeps {} short runs: {e}", runs.len() - i);
                                p.uncompact(&runs[i..]);
                                break;
                            }
                            self.meta.requeue_discards(s, l);
                        }
                    }
                    Err(e) => {
                        tracing::debug!("the pool keeps its short runs for now: {e}");
                        p.uncompact(&runs);
                    }
                }
            }
            let r = p.save(&mut self);
            self.meta.pool = Some(p);
            if let Err(e) = r {
                // The pool inode at home would still list runs this operation mapped into a
                // file (the recovery frees a pool's runs): nothing more may reach the LUN.
                // Only a bug gets here (`Meta::pool_fits` keeps the pool within its inode).
                self.fail_node(&e, "saving the block pool's inode");
                return Err(e);
            }
        }
        for (b, data) in self.meta.alloc.take_dirty() {
            self.dirty.insert(b, data);
        }
        let dirty = std::mem::take(&mut self.dirty);
        self.meta.pending.extend(dirty);
        // Keep one transaction well inside the journal so a single large operation still fits.
        if self.meta.pending_blocks() > self.meta.journal.capacity() / 2 {
            self.meta.commit_point(self.dev)?;
        }
        Ok(())
    }
}

fn write_run(dev: &dyn BlockDevice, run: &[(u64, &Vec<u8>)]) -> Result<()> {
    let Some((first, _)) = run.first() else {
        return Ok(());
    };
    let mut buf = AlignedBuf::new(run.len() * crate::format::FS_BLOCK_SIZE);
    for (i, (_, d)) in run.iter().enumerate() {
        buf[i * crate::format::FS_BLOCK_SIZE..(i + 1) * crate::format::FS_BLOCK_SIZE]
            .copy_from_slice(d);
    }
    dev.write_at(first * FS_BLOCK, &buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::mem::MemDevice;
    use crate::format::FS_BLOCK_SIZE;

    /// A formatted memory volume and its slot-0 metadata with a cache of `cache_blocks` blocks.
    fn meta(cache_blocks: usize) -> (std::sync::Arc<MemDevice>, Meta) {
        let dev = std::sync::Arc::new(MemDevice::new(256 << 20, 512));
        let opts = crate::mkfs::MkfsOptions {
            max_nodes: 2,
            journal_bytes: 1 << 20,
            ..Default::default()
        };
        let sb = crate::mkfs::format(&*dev, &opts, &mut |_, _| {}).unwrap();
        let m = Meta::new(
            crate::alloc::tests::load(&(dev.clone() as crate::dev::SharedDevice), &sb),
            JournalArea::for_slot(&sb, 0),
            sb.clone(),
            cache_blocks * (FS_BLOCK_SIZE + super::super::block_cache::SLOT_OVERHEAD),
        );
        (dev, m)
    }

    fn img(tag: u64) -> Vec<u8> {
        let mut v = vec![0xa5u8; FS_BLOCK_SIZE];
        v[..8].copy_from_slice(&tag.to_le_bytes());
        v
    }

    fn tag(tx: &mut Tx<'_>, b: u64) -> u64 {
        u64::from_le_bytes(tx.read(b).unwrap()[..8].try_into().unwrap())
    }

    /// Write `block` at home behind the cache's back (as another node would).
    fn put(dev: &MemDevice, block: u64, t: u64) {
        let mut buf = AlignedBuf::new(FS_BLOCK_SIZE);
        buf.copy_from_slice(&img(t));
        dev.write_at(block * FS_BLOCK, &buf).unwrap();
    }

    /// Free metadata blocks to play with.
    fn blocks(m: &mut Meta, n: u64) -> Vec<u64> {
        let runs = m.alloc.alloc(0, n, 0).unwrap();
        let _ = m.alloc.take_dirty();
        runs.iter().flat_map(|&(p, l)| p..p + l).collect()
    }

    #[test]
    fn transaction_blocks_are_never_served_stale() {
        // A cache of 4 blocks against 40 blocks changed in one transaction.
        let (dev, mut m) = meta(4);
        let bs = blocks(&mut m, 40);
        let mut tx = Tx::new(&*dev, &mut m);
        // Old images cached (and evicted in turn) first.
        for &b in &bs {
            tx.write(b, img(b));
        }
        tx.commit().unwrap();
        m.commit_point(&*dev).unwrap();
        let mut tx = Tx::new(&*dev, &mut m);
        for &b in &bs {
            assert_eq!(tag(&mut tx, b), b);
        }
        for &b in &bs {
            tx.write(b, img(b + 1000));
        }
        // This transaction's copies win over the cache...
        for &b in &bs {
            assert_eq!(tag(&mut tx, b), b + 1000);
        }
        tx.commit().unwrap();
        // ...then the running compound transaction's, in the next operation...
        let mut tx = Tx::new(&*dev, &mut m);
        for &b in bs.iter().rev() {
            assert_eq!(tag(&mut tx, b), b + 1000);
        }
        tx.commit().unwrap();
        let s = m.cache_stats();
        assert!(s.blocks <= 4 && s.capacity == 4, "{s:?}");
        // ...and after the commit point, the cache's and the device's copies are the new ones.
        m.commit_point(&*dev).unwrap();
        let mut tx = Tx::new(&*dev, &mut m);
        for &b in bs.iter().chain(bs.iter()) {
            assert_eq!(tag(&mut tx, b), b + 1000);
        }
        let mut raw = AlignedBuf::new(FS_BLOCK_SIZE);
        for &b in &bs {
            dev.read_at(b * FS_BLOCK, &mut raw).unwrap();
            assert_eq!(raw[..], img(b + 1000)[..]);
        }
    }

    #[test]
    fn cache_hits_and_invalidation() {
        let (dev, mut m) = meta(64);
        let bs = blocks(&mut m, 8);
        let mut tx = Tx::new(&*dev, &mut m);
        for &b in &bs {
            tx.write(b, img(b));
        }
        tx.commit().unwrap();
        m.commit_point(&*dev).unwrap();
        // Committed blocks are cached: reading them again does not touch the device.
        let before = m.cache_stats();
        let mut tx = Tx::new(&*dev, &mut m);
        for &b in &bs {
            assert_eq!(tag(&mut tx, b), b);
        }
        let after = m.cache_stats();
        assert_eq!(after.hits - before.hits, 8);
        assert_eq!(after.misses, before.misses);
        // Another node changes a block at home: the cache still serves the old copy until it
        // is dropped (the global lock moved), then the new one.
        put(&dev, bs[0], 77);
        let mut tx = Tx::new(&*dev, &mut m);
        assert_eq!(tag(&mut tx, bs[0]), bs[0]);
        m.drop_cache();
        assert_eq!(m.cache_stats().blocks, 0);
        let mut tx = Tx::new(&*dev, &mut m);
        assert_eq!(tag(&mut tx, bs[0]), 77);
        // A forgotten (freed) block is dropped from the cache too.
        assert_eq!(tag(&mut tx, bs[1]), bs[1]);
        put(&dev, bs[1], 88);
        assert_eq!(tag(&mut tx, bs[1]), bs[1]);
        tx.forget(bs[1]);
        assert_eq!(tag(&mut tx, bs[1]), 88);
    }
}
