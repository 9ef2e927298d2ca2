//! The node's block pool: blocks this node took from the allocator under the global lock so
//! that it can allocate **without** the global lock (issue 9 point 3; `docs/locking.md` §15,
//! "Allocating writes without the global lock").
//!
//! # What it is on disk
//! An ordinary regular-file inode with no links, on this node's orphan list (the slot
//! header), whose extents are the pool's blocks: unwritten, mapped at their own block number
//! (file block *b* is device block *b*, so a run is found and removed by its physical range).
//! Nothing new in the format: the bitmaps mark the blocks used, fsck sees an orphan that owns
//! them, and if the node dies its recoverer (or its own next mount) frees the orphan — the
//! rest of the pool — exactly as it frees an open-unlinked file.
//!
//! # The rules
//! * **Taken and given back under the global lock** (exclusive): [`refill`](Pool::refill)
//!   allocates a run from the bitmaps into the pool; [`compact`](Pool::compact) and
//!   [`drain_to`](Pool::drain_to) (unmount) free unused runs back. No bitmap is ever read or
//!   changed without that lock.
//! * **Used under the metadata mutex alone**: an allocating write of a file whose inode lock
//!   this node holds exclusively *holds* pool runs for its data ([`reserve`](Pool::reserve),
//!   in memory only), and its mapping step moves them from the pool into the file
//!   ([`commit`](Pool::commit)) **in the same transaction** that maps them, so after any crash
//!   every block is either in the pool or in the file, never both or neither. Tree nodes the
//!   mapping needs come from the pool ([`take_one`](Pool::take_one)), and tree nodes it frees
//!   go back into it ([`give`](Pool::give)), held until the next commit point (a freed block
//!   must not receive new contents before its free is durable).
//! * **The deferred-free record of frees without the global lock**: a hole punched in a file
//!   this node owns (a VM's TRIM, fs/data.rs `falloc_owned`) gives the freed runs to the pool
//!   in its transaction, within [`FREES_MAX`]; they stay marked used in the bitmaps and go back
//!   to them with the pool. Their discard runs under the metadata mutex only, on the parts
//!   nothing holds ([`unclaimed`](Pool::unclaimed), fs/discard.rs).
//! * The pool inode is written inline only: it never has a tree (a tree would allocate). The
//!   callers keep its extent count low ([`Pool::fragments`]; the global path compacts).

use super::extent_map::ExtentMap;
use super::txn::Tx;
use crate::error::Result;
use crate::format::inode::{flags, Inode, INLINE_EXTENTS_MAX};
use std::collections::BTreeMap;

/// A fresh inode that only holds blocks for this node (the pool's, a defrag's new runs:
/// `fs/defrag.rs`): a regular file with no links and inline extents, meant for this node's
/// orphan list, so a crash frees what it holds.
pub(super) fn holder_inode(tx: &mut Tx<'_>, ino: u64) -> Result<Inode> {
    let t = super::now();
    Ok(Inode {
        ino,
        seq: tx.prior_seq(ino)?,
        mode: libc::S_IFREG,
        nlink: 0,
        flags: flags::INLINE_EXTENTS,
        generation: rand::random(),
        atime: t,
        mtime: t,
        ctime: t,
        crtime: t,
        blocks: 1,
        ..Default::default()
    })
}

/// Blocks taken from the allocator at a refill (64 MiB at 4 KiB), at most a 64th of the free
/// space.
pub const CHUNK: u64 = 16_384;
/// Below a quarter of its last refill the pool is topped up: one write takes the global path
/// to do it while the others go on with what is left.
pub const LOW_FRACTION: u64 = 4;
/// The fewest blocks worth a pool (smaller volumes allocate under the global lock only).
pub const MIN_CHUNK: u64 = 64;
/// Above this many extents the global path compacts (a mapping batch of 32 writes adds at most
/// about 64 fragments, and the inode holds [`INLINE_EXTENTS_MAX`]).
pub const FRAGMENTS_MAX: usize = 48;
/// Blocks kept back per write in flight for the tree nodes its mapping may need.
pub const TREE_MARGIN: u64 = 4;
/// Fewest available blocks for a namespace change without the global lock (an inode, a
/// directory split, an xattr-free create: a handful; the rest is margin).
pub const NAMES_MIN: u64 = 32;
/// Extents a namespace change may add to the pool at most (a freed inode and a tree node or
/// two, each perhaps a fragment of its own).
pub const NAMES_FRAGMENTS: usize = 8;
/// Blocks set aside for tree nodes at every refill ([`Pool::take_one`] uses them first).
pub const SPARE: usize = 64;
/// Most blocks the pool may hold after a hole punched without the global lock gave it the
/// freed runs (fs/data.rs): larger frees go to the bitmaps under the global lock, so that a
/// guest's TRIM does not keep space from the other nodes until its image is closed.
pub const FREES_MAX: u64 = 2 * CHUNK;

#[derive(Debug)]
pub(crate) struct Pool {
    inode: Inode,
    /// Identity-mapped runs (logical == physical), all unwritten.
    map: ExtentMap,
    /// start -> len: runs held by writes in flight, or given back and not committed yet.
    held: BTreeMap<u64, u64>,
    /// Runs given back since the last commit point (also in `held`).
    quarantine: Vec<(u64, u64)>,
    /// The inode must be written in this transaction.
    dirty: bool,
    /// Below this many available blocks, top up (a quarter of the last refill's size).
    low: u64,
    /// Blocks set aside (and held) for tree nodes: a mapping without the global lock never
    /// finds the pool empty for one, whatever the data writes took.
    spare: Vec<u64>,
    /// Per file: the block after its last reservation (where its stream goes on).
    cursors: std::collections::HashMap<u64, u64>,
    /// The file each run held for a write in flight is for (start -> inode).
    held_by: std::collections::HashMap<u64, u64>,
    /// Blocks of inodes freed into the pool whose numbers the kernel still references: held
    /// (not reused) until it forgets them (`fs/detached_ns.rs`).
    pinned: std::collections::BTreeSet<u64>,
}

/// Most files whose stream position the pool remembers (then it forgets them all).
const CURSORS_MAX: usize = 1024;

impl Pool {
    /// A new, empty pool inode in block `ino` (already allocated); the caller puts it on the
    /// orphan list in the same transaction.
    pub fn create(tx: &mut Tx<'_>, ino: u64) -> Result<Self> {
        let inode = holder_inode(tx, ino)?;
        Ok(Self {
            inode,
            map: ExtentMap::default(),
            held: BTreeMap::new(),
            quarantine: Vec::new(),
            dirty: true,
            low: 0,
            spare: Vec::new(),
            cursors: std::collections::HashMap::new(),
            held_by: std::collections::HashMap::new(),
            pinned: std::collections::BTreeSet::new(),
        })
    }

    /// Should the pool be topped up?
    pub fn is_low(&self) -> bool {
        self.available() < self.low
    }

    pub fn ino(&self) -> u64 {
        self.inode.ino
    }

    /// Is `block` in the pool (held or not)? Then it holds no inode, whatever its old
    /// contents say (an inode freed into the pool leaves its last image at home).
    pub fn contains(&self, block: u64) -> bool {
        self.map.find(block).is_some()
    }

    /// Blocks held for writes in flight (not the spares, not the quarantine).
    #[cfg(test)]
    pub fn held_for_writes(&self) -> u64 {
        self.held_by.keys().filter_map(|s| self.held.get(s)).sum()
    }

    /// Blocks in the pool (held ones included).
    pub fn blocks(&self) -> u64 {
        self.map.iter().map(|e| u64::from(e.len)).sum()
    }

    /// Blocks a write may hold now.
    pub fn available(&self) -> u64 {
        self.blocks() - self.held.values().sum::<u64>()
    }

    /// Should the global path give short runs back ([`Pool::compact`])? Above
    /// [`FRAGMENTS_MAX`] less the room a namespace change needs, so that one can always
    /// run without the global lock right after a compaction.
    pub fn needs_compaction(&self) -> bool {
        self.fragments() + NAMES_FRAGMENTS > FRAGMENTS_MAX
    }

    /// Extents of the pool inode.
    pub fn fragments(&self) -> usize {
        self.map.iter().count()
    }

    /// Runs of the pool not held, in block order.
    fn free_runs(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for e in self.map.iter() {
            let (mut s, end) = (e.physical, e.physical + u64::from(e.len));
            for (&hs, &hl) in self.held.range(..end) {
                let he = hs + hl;
                if he <= s {
                    continue;
                }
                if hs > s {
                    out.push((s, hs.min(end) - s));
                }
                s = s.max(he);
                if s >= end {
                    break;
                }
            }
            if s < end {
                out.push((s, end - s));
            }
        }
        out
    }

    /// Hold `n` blocks for a write in flight of file `ino`, in as few runs as the pool
    /// allows; all or nothing. Placement keeps each file's writes together, in this order:
    /// * from `goal` (the block after the file's preceding extent) when the pool has it free,
    ///   or from the end of the held runs that start there (the file's own writes in flight);
    /// * else where the file's last reservation ended (its *stream*: random writes into a
    ///   thin image land one after the other instead of splitting the pool);
    /// * else a new stream: in the middle of the largest free run while runs are large, so
    ///   that two files growing at once from one pool each have room to grow into instead of
    ///   taking turns in one run (ext4's stream allocation does the same); in its first block
    ///   once they are small.
    pub fn reserve(&mut self, n: u64, goal: u64, ino: u64) -> Option<Vec<(u64, u64)>> {
        if n == 0 || self.available() < n {
            return None;
        }
        let free = self.free_runs();
        let from = |b: u64| {
            free.iter()
                .find(|&&(s, l)| s <= b && b < s + l)
                .map(|&(s, l)| (b, s + l - b))
        };
        // Writes of one file in flight at once each hold the run before the next one's goal:
        // skip what they hold (not what other files hold or took) to stay in sequence.
        let mut goal = goal;
        while let Some((&hs, &hl)) = self.held.range(..=goal).next_back() {
            if goal >= hs + hl || self.held_by.get(&hs) != Some(&ino) {
                break;
            }
            goal = hs + hl;
        }
        let first = from(goal)
            .or_else(|| self.cursors.get(&ino).and_then(|&c| from(c)))
            .or_else(|| {
                free.iter().max_by_key(|r| r.1).map(|&(s, l)| {
                    if l >= 4 * n && l >= 4 * MIN_CHUNK {
                        let mid = s + l / 2;
                        (mid, s + l - mid)
                    } else {
                        (s, l)
                    }
                })
            });
        let mut left = n;
        let mut runs = Vec::new();
        for (s, l) in first.into_iter().chain(free.iter().copied()) {
            // Skip what an earlier run of this reservation took.
            if runs
                .iter()
                .any(|&(rs, rl): &(u64, u64)| rs < s + l && s < rs + rl)
            {
                continue;
            }
            let take = l.min(left);
            runs.push((s, take));
            left -= take;
            if left == 0 {
                break;
            }
        }
        if left != 0 {
            return None;
        }
        for &(s, l) in &runs {
            self.held.insert(s, l);
            self.held_by.insert(s, ino);
        }
        if self.cursors.len() >= CURSORS_MAX {
            self.cursors.clear();
        }
        if let Some(&(s, l)) = runs.last() {
            self.cursors.insert(ino, s + l);
        }
        Some(runs)
    }

    /// A held run is not needed (its write failed).
    pub fn unreserve(&mut self, start: u64) {
        self.held.remove(&start);
        self.held_by.remove(&start);
    }

    /// A held run is mapped by a file in this transaction: it leaves the pool.
    pub fn commit(&mut self, start: u64, len: u64) {
        self.held.remove(&start);
        self.held_by.remove(&start);
        self.map.punch(start, start + len);
        self.dirty = true;
    }

    /// One block for a tree node of a file mapped in this transaction.
    pub fn take_one(&mut self, goal: u64) -> Option<u64> {
        let s = match self.spare.pop() {
            Some(s) => s,
            None => self.reserve(1, goal, 0)?.first()?.0,
        };
        self.commit(s, 1);
        Some(s)
    }

    /// A run freed in this transaction joins the pool, usable after the next commit point.
    pub fn give(&mut self, start: u64, len: u64) {
        self.map.insert(start, start, len, true);
        self.held.insert(start, len);
        self.quarantine.push((start, len));
        self.dirty = true;
    }

    /// Fresh runs from the allocator (under the global lock, in this transaction), of a
    /// refill of `chunk` blocks.
    pub fn refill(&mut self, runs: &[(u64, u64)], chunk: u64) {
        for &(s, l) in runs {
            self.map.insert(s, s, l, true);
        }
        self.low = chunk / LOW_FRACTION;
        self.dirty = true;
        while self.spare.len() < SPARE {
            // From the end of the pool's last run: out of the way of data streams.
            let Some((s, l)) = self.free_runs().last().copied() else {
                break;
            };
            let b = s + l - 1;
            self.held.insert(b, 1);
            self.spare.push(b);
        }
    }

    /// Runs neither held nor in quarantine, taken out of the pool for the caller to free
    /// into the bitmaps in this transaction (under the global lock): the shortest first, until
    /// the pool has at most `fragments` extents (the longest run always stays).
    pub fn compact(&mut self, fragments: usize) -> Vec<(u64, u64)> {
        let mut runs = self.free_runs();
        runs.sort_by_key(|r| r.1);
        runs.pop();
        let mut out = Vec::new();
        for (s, l) in runs {
            if self.fragments() <= fragments {
                break;
            }
            self.map.punch(s, s + l);
            out.push((s, l));
        }
        if !out.is_empty() {
            self.dirty = true;
        }
        out
    }

    /// Runs [`Pool::compact`] took out go back in (their frees could not be prepared).
    pub fn uncompact(&mut self, runs: &[(u64, u64)]) {
        for &(s, l) in runs {
            self.map.insert(s, s, l, true);
        }
    }

    /// Unmount: every run leaves the pool (nothing is in flight), for the caller to free.
    pub fn drain_to(&mut self) -> Vec<(u64, u64)> {
        self.pinned.clear();
        self.held.clear();
        self.held_by.clear();
        self.spare.clear();
        self.quarantine.clear();
        self.map.punch(0, u64::MAX)
    }

    /// Runs given back wait for the next commit point.
    pub fn has_quarantine(&self) -> bool {
        !self.quarantine.is_empty()
    }

    /// A commit point made this transaction's frees durable: their runs may be used (not a
    /// pinned one). Returns the runs released (what fs/discard.rs may discard).
    pub fn committed(&mut self) -> Vec<(u64, u64)> {
        let mut released = Vec::new();
        for (s, l) in std::mem::take(&mut self.quarantine) {
            if !self.pinned.contains(&s) {
                self.held.remove(&s);
                released.push((s, l));
            }
        }
        released
    }

    /// The parts of blocks `[start, start + len)` that are in the pool and that nothing
    /// holds (no write in flight, no spare, no quarantine, no pin): what a discard may hit
    /// while the metadata mutex is held (a reservation needs it).
    pub fn unclaimed(&self, start: u64, len: u64) -> Vec<(u64, u64)> {
        let end = start.saturating_add(len);
        self.free_runs()
            .into_iter()
            .filter_map(|(s, l)| {
                let (a, b) = (s.max(start), (s + l).min(end));
                (a < b).then(|| (a, b - a))
            })
            .collect()
    }

    /// Keep block `b`, just given back ([`Pool::give`]), out of use until [`Pool::unpin`].
    pub fn pin(&mut self, b: u64) {
        self.pinned.insert(b);
    }

    /// Block `b` may be used again (once its free is durable).
    pub fn unpin(&mut self, b: u64) {
        if self.pinned.remove(&b) && !self.quarantine.iter().any(|&(s, _)| s == b) {
            self.held.remove(&b);
        }
    }

    /// Block `b`, the inode block of an inode that is unlinked but still open on this node,
    /// becomes a pool block on disk (so a crash leaves it to the pool's free, with no orphan
    /// entry), pinned: the inode lives on in memory until it is freed
    /// ([`Pool::release_adopted`]) or changed on the global path ([`Pool::unadopt`]).
    pub fn adopt(&mut self, b: u64) {
        self.map.insert(b, b, 1, true);
        self.held.insert(b, 1);
        self.pinned.insert(b);
        self.dirty = true;
    }

    /// An adopted block is an inode's own again (it goes on the orphan list instead).
    pub fn unadopt(&mut self, b: u64) {
        self.pinned.remove(&b);
        self.held.remove(&b);
        self.map.punch(b, b + 1);
        self.dirty = true;
    }

    /// The inode of an adopted block was freed: the block is the pool's, usable after the
    /// next commit point (as a block given back).
    pub fn release_adopted(&mut self, b: u64) {
        self.pinned.remove(&b);
        self.quarantine.push((b, 1));
    }

    /// The pool's runs (to prepare their free before [`Pool::drain_to`]).
    pub fn runs(&self) -> Vec<(u64, u64)> {
        self.map
            .iter()
            .map(|e| (e.physical, u64::from(e.len)))
            .collect()
    }

    /// Write the pool inode into `tx` if it changed (inline extents only).
    pub fn save(&mut self, tx: &mut Tx<'_>) -> Result<()> {
        if !self.dirty {
            return Ok(());
        }
        if self.fragments() > INLINE_EXTENTS_MAX {
            crate::bail!(
                Io,
                "the block pool of this node has {} extents, more than its inode holds",
                self.fragments()
            );
        }
        self.map.persist(tx, &mut self.inode)?;
        self.inode.blocks = 1 + self.blocks();
        self.inode.seq += 1;
        tx.write(self.inode.ino, self.inode.encode());
        self.dirty = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(runs: &[(u64, u64)]) -> Pool {
        let mut p = bare();
        p.refill(runs, 0);
        for b in std::mem::take(&mut p.spare) {
            p.held.remove(&b);
        }
        p
    }

    fn bare() -> Pool {
        Pool {
            inode: Inode::default(),
            map: ExtentMap::default(),
            held: BTreeMap::new(),
            quarantine: Vec::new(),
            dirty: false,
            low: 0,
            spare: Vec::new(),
            cursors: std::collections::HashMap::new(),
            held_by: std::collections::HashMap::new(),
            pinned: std::collections::BTreeSet::new(),
        }
    }

    #[test]
    fn reserve_skips_held_runs_and_commit_removes_only_its_own() {
        let mut p = pool(&[(100, 10), (200, 10)]);
        assert_eq!(p.available(), 20);
        let a = p.reserve(4, 100, 1).unwrap();
        assert_eq!(a, vec![(100, 4)]);
        let b = p.reserve(8, 104, 1).unwrap();
        assert_eq!(b, vec![(104, 6), (200, 2)]);
        assert_eq!(p.available(), 8);
        assert!(p.reserve(9, 0, 1).is_none(), "all or nothing");
        p.unreserve(100);
        assert_eq!(p.available(), 12);
        p.commit(104, 6);
        p.commit(200, 2);
        assert_eq!(p.available(), 12);
        assert_eq!(p.free_runs(), vec![(100, 4), (202, 8)]);
    }

    #[test]
    fn a_file_grows_from_its_goal_and_a_new_stream_starts_mid_run() {
        let mut p = pool(&[(1000, 1000)]);
        let a = p.reserve(16, 0, 1).unwrap();
        assert_eq!(
            a,
            vec![(1500, 16)],
            "a new stream starts in the middle of the largest run"
        );
        let b = p.reserve(16, 0, 2).unwrap();
        assert_eq!(
            b,
            vec![(1250, 16)],
            "the next new stream: mid the largest run left"
        );
        let a2 = p.reserve(16, 1516, 1).unwrap();
        assert_eq!(a2, vec![(1516, 16)], "contiguous with its goal");
        let b2 = p.reserve(16, 1266, 2).unwrap();
        assert_eq!(b2, vec![(1266, 16)]);
        // Concurrent writes of one file: the goal is held by the one before.
        let a3 = p.reserve(16, 1516, 1).unwrap();
        assert_eq!(a3, vec![(1532, 16)], "after its own writes in flight");
        // A random write (its goal taken by another file): on in the file's stream.
        for s in [1500, 1516, 1532] {
            p.commit(s, 16);
        }
        let b3 = p.reserve(16, 1500, 2).unwrap();
        assert_eq!(
            b3,
            vec![(1282, 16)],
            "where file 2's last reservation ended"
        );
    }

    #[test]
    fn a_refill_sets_spare_tree_blocks_aside() {
        let mut p = bare();
        p.refill(&[(1000, 1000)], 1000);
        assert_eq!(p.available(), 1000 - SPARE as u64);
        assert!(
            p.reserve(1000 - SPARE as u64, 0, 1).is_some(),
            "data takes all but the spare"
        );
        assert!(p.reserve(1, 0, 1).is_none());
        // The spare blocks are the pool's last ones, handed out lowest first.
        assert_eq!(p.take_one(0), Some(2000 - SPARE as u64));
    }

    #[test]
    fn given_back_blocks_wait_for_the_commit_point() {
        let mut p = pool(&[(100, 2)]);
        p.give(50, 1);
        assert_eq!(
            p.available(),
            2,
            "a freed block is not reusable before its free commits"
        );
        assert_eq!(p.take_one(100), Some(100));
        p.committed();
        assert_eq!(p.available(), 2);
        assert_eq!(p.free_runs(), vec![(50, 1), (101, 1)]);
    }

    #[test]
    fn compact_frees_the_shortest_runs_and_keeps_held_blocks() {
        let mut p = pool(&[(10, 1), (20, 5), (40, 2)]);
        let h = p.reserve(1, 10, 1).unwrap();
        assert_eq!(h, vec![(10, 1)]);
        let freed = p.compact(2);
        assert_eq!(freed, vec![(40, 2)], "the shortest free run goes first");
        assert_eq!(p.available(), 5);
        assert_eq!(p.fragments(), 2);
        assert!(
            p.compact(0).is_empty(),
            "the longest run and held blocks stay"
        );
        assert_eq!(p.drain_to(), vec![(10, 1), (20, 5)]);
    }
}
