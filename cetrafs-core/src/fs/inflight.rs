//! Allocating writes in flight on this node, and who waits for them.
//!
//! An allocating write (fs/data.rs) runs in three steps: under the metadata mutex it plans the
//! write and holds the new blocks in the allocator ([`crate::alloc::Allocator::reserve`]);
//! without the mutex it writes the data; under the mutex again it maps the blocks. Between the
//! first and the last step the write is *in flight* here, as the file blocks `[b0, b1)` it
//! covers. This table, which lives in `Meta` and so is read and changed only under the
//! metadata mutex, states the rules that keep that window correct:
//!
//! * **One writer per block range.** A write whose blocks overlap a write in flight on the same
//!   file waits until that one is mapped, then plans again (it then sees the first write's
//!   extents instead of a hole, so a block is never allocated twice).
//! * **Truncate, punch, zero-range and fallocate wait.** An operation that changes a file's
//!   block map other than by writing first *drains* the file ([`InFlight::drain_start`]): new
//!   writes into it wait, and it waits until the writes already in flight are mapped. Freeing a
//!   file needs no wait: a write in flight holds an open file handle, so the file is not freed
//!   (a caller that does not wait for the mapping keeps the handle open until it is answered:
//!   `Volume::write_then`).
//! * **The global lock is given up only with no bitmap blocks in flight.** A handoff waits
//!   until no write in flight holds blocks of the bitmaps: another node reloading the bitmaps
//!   would not see them. While such a write is in flight this node therefore holds the lock
//!   exclusively. Writes whose blocks come from this node's pool (fs/pool.rs) hold nothing of
//!   the bitmaps and are mapped without the global lock, so a handoff does not wait for them;
//!   unmount waits until the table is empty.
//!
//! Waiting is on `Volume::inflight_done`, a condition variable of the metadata mutex, notified
//! whenever an entry or a drain ends; the entries are a few (at most one per write the kernel
//! has in flight), so every check is a scan.

use super::Ino;
use std::collections::HashMap;

#[derive(Debug, Default)]
pub(crate) struct InFlight {
    /// id -> (inode, first file block, end file block).
    writes: HashMap<u64, (Ino, u64, u64)>,
    next_id: u64,
    /// Operations draining a file (count per inode).
    drains: HashMap<Ino, u32>,
    /// The ids of writes whose blocks come from this node's pool (fs/pool.rs): they need no
    /// global lock, so a handoff does not wait for them.
    pooled: std::collections::HashSet<u64>,
}

impl InFlight {
    /// Must a new write of file blocks `[b0, b1)` of `ino` wait?
    pub fn must_wait(&self, ino: Ino, b0: u64, b1: u64) -> bool {
        self.drains.contains_key(&ino)
            || self
                .writes
                .values()
                .any(|&(i, s, e)| i == ino && s < b1 && b0 < e)
    }

    /// Record a write in flight; the id ends it.
    pub fn begin(&mut self, ino: Ino, b0: u64, b1: u64) -> u64 {
        debug_assert!(!self.must_wait(ino, b0, b1));
        self.next_id += 1;
        self.writes.insert(self.next_id, (ino, b0, b1));
        self.next_id
    }

    /// As [`InFlight::begin`], for a write whose blocks come from the pool.
    pub fn begin_pooled(&mut self, ino: Ino, b0: u64, b1: u64) -> u64 {
        let id = self.begin(ino, b0, b1);
        self.pooled.insert(id);
        id
    }

    /// The write is mapped (or failed and gave its blocks back).
    pub fn end(&mut self, id: u64) {
        self.writes.remove(&id);
        self.pooled.remove(&id);
    }

    /// Writes in flight from the pool.
    pub fn pooled(&self) -> usize {
        self.pooled.len()
    }

    /// Does a write in flight hold blocks of the bitmaps (not of the pool)? Then the global
    /// lock is not given up (module doc).
    pub fn holds_bitmap_blocks(&self) -> bool {
        self.writes.len() > self.pooled.len()
    }

    /// Has `ino` a write in flight?
    pub fn busy(&self, ino: Ino) -> bool {
        self.writes.values().any(|&(i, _, _)| i == ino)
    }

    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// New writes into `ino` wait until the matching [`InFlight::drain_end`].
    pub fn drain_start(&mut self, ino: Ino) {
        *self.drains.entry(ino).or_default() += 1;
    }

    pub fn drain_end(&mut self, ino: Ino) {
        if let Some(n) = self.drains.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                self.drains.remove(&ino);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_ranges_of_one_file_wait_others_do_not() {
        let mut t = InFlight::default();
        let a = t.begin(7, 10, 20);
        assert!(t.must_wait(7, 19, 21));
        assert!(t.must_wait(7, 0, 11));
        assert!(!t.must_wait(7, 20, 30));
        assert!(!t.must_wait(7, 0, 10));
        assert!(!t.must_wait(8, 10, 20));
        assert!(t.busy(7) && !t.busy(8));
        t.drain_start(8);
        t.drain_start(8);
        assert!(t.must_wait(8, 100, 101));
        t.drain_end(8);
        assert!(t.must_wait(8, 100, 101));
        t.drain_end(8);
        assert!(!t.must_wait(8, 100, 101));
        t.end(a);
        assert!(t.is_empty() && !t.must_wait(7, 10, 20));
        let p = t.begin_pooled(9, 0, 1);
        assert!(!t.is_empty() && !t.holds_bitmap_blocks() && t.busy(9));
        let b = t.begin(9, 1, 2);
        assert!(t.holds_bitmap_blocks());
        t.end(b);
        t.end(p);
        assert!(t.is_empty() && !t.holds_bitmap_blocks());
    }
}
