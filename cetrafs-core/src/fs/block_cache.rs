//! The metadata block cache: clean copies of metadata blocks exactly as they are on the
//! volume, under a byte budget.
//!
//! **What it holds.** Only images that equal what the volume holds at home: blocks read from
//! the device, and blocks of a compound transaction once they have been written home
//! (`Meta::commit_point`). Changed blocks not yet home live in the transaction (`Tx::dirty`,
//! `Meta::pending`, both in fs/txn.rs), which reads consult first; so the cache never holds the
//! only copy of anything, and evicting any entry at any time loses nothing (the next read goes
//! to the device). A block freed in a transaction is [`invalidate`](BlockCache::invalidate)d;
//! when another node may have changed blocks (the cluster's metadata lock moved), everything
//! is [`clear`](BlockCache::clear)ed.
//!
//! **Memory.** The budget (mount option `meta_cache=MiB`, default [`DEFAULT_BUDGET`]) fixes a
//! number of slots, [`capacity`](BlockCache::capacity): the budget divided by a slot's cost
//! (the 4 KiB image plus [`SLOT_OVERHEAD`] for its index entry, its bookkeeping and its share
//! of its chunk's allocation header, which costs a page; fs/heap.rs). Images live in
//! a slab of fixed chunks of [`CHUNK_BLOCKS`] slots, allocated as the cache first fills and
//! then reused in place, never freed while mounted: evicting or clearing puts a slot back in
//! use for the next block, so the heap does not fragment around cached blocks and the
//! footprint never exceeds the budget, whatever the workload. A budget of 0 caches nothing.
//!
//! **Eviction.** CLOCK (second chance) over the slots: a hit marks its slot; when a block must
//! be added and no slot is free, the hand walks the slots in order, unmarking marked ones and
//! taking the first unmarked one. Each step either evicts or clears a mark some earlier hit
//! set, so an insert costs O(1) amortised. Blocks are added unmarked, so a scan that touches
//! each block once (a `find` over a big tree) does not push out blocks that are used again.
//!
//! [`stats`](BlockCache::stats) reports size, capacity, hits, misses and evictions.

use super::heap;
use crate::format::FS_BLOCK_SIZE;
use std::collections::HashMap;
use std::mem::size_of;

/// Budget of the metadata block cache when the mount does not say (`meta_cache=`): 32 MiB,
/// about 8,100 blocks.
pub const DEFAULT_BUDGET: usize = 32 << 20;

/// Slots per slab chunk (256 KiB of images).
pub const CHUNK_BLOCKS: usize = 64;

/// Memory charged per slot on top of its image: the slot record, its place in the free list,
/// its share of the index, and its share of what its chunk's allocation costs beyond the
/// images (a chunk is allocated on its own pages, plus one for the allocator's header). The
/// index is a hash map whose removed keys leave tombstones; when they fill it, it is rehashed
/// in place only if at most half its capacity is in use, else it doubles, so at `n` entries it
/// may hold up to 32n/7 buckets of (key, value, control byte).
pub const SLOT_OVERHEAD: usize = size_of::<Slot>()
    + size_of::<u32>()
    + ((size_of::<(u64, u32)>() + 1) * 32).div_ceil(7)
    + (heap::alloc(CHUNK_BLOCKS * FS_BLOCK_SIZE) - CHUNK_BLOCKS * FS_BLOCK_SIZE)
        .div_ceil(CHUNK_BLOCKS);

/// Marks a slot that holds no block.
const EMPTY: u64 = u64::MAX;

/// What the cache holds and has done since mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockCacheStats {
    /// Blocks cached now.
    pub blocks: usize,
    /// Slots the budget allows.
    pub capacity: usize,
    /// Memory allocated for the cache (slab chunks, slots, index, as the allocator sizes
    /// them), bytes.
    pub bytes: usize,
    /// The budget, bytes.
    pub budget: usize,
    /// Reads served from the cache / that had to go to the device.
    pub hits: u64,
    pub misses: u64,
    /// Blocks dropped to make room for others.
    pub evictions: u64,
}

impl BlockCacheStats {
    /// One debug line (target `cetrafs_core::fs::block_cache`), followed by the allocator's
    /// bitmap cache (alloc.rs), the other cache under the metadata mutex, so that one line
    /// has every cache of metadata blocks.
    pub(crate) fn log(&self, bitmaps: &crate::alloc::BitmapCacheStats) {
        tracing::debug!(
            "metadata block cache: {} blocks of {} ({} KiB allocated of {} KiB budget); {} hits, {} misses, {} evicted; {bitmaps}",
            self.blocks,
            self.capacity,
            self.bytes >> 10,
            self.budget >> 10,
            self.hits,
            self.misses,
            self.evictions
        );
    }
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    /// The block whose image the slot holds, or [`EMPTY`].
    block: u64,
    /// Hit since the hand last passed (second chance).
    hot: bool,
}

#[derive(Debug)]
pub(crate) struct BlockCache {
    budget: usize,
    capacity: usize,
    /// Block number → slot.
    index: HashMap<u64, u32>,
    /// One record per slot in use or emptied; `slots.len() <= capacity`.
    slots: Vec<Slot>,
    /// The images: slot `i` is `chunks[i / CHUNK_BLOCKS][(i % CHUNK_BLOCKS) * FS_BLOCK_SIZE..]`.
    chunks: Vec<Box<[u8]>>,
    /// Slots emptied by invalidation or clearing, reused before the hand runs.
    free: Vec<u32>,
    hand: usize,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl BlockCache {
    pub fn new(budget: usize) -> Self {
        // Slot numbers are u32; a budget that large (16 TiB) is refused by the options anyway.
        let capacity = (budget / (FS_BLOCK_SIZE + SLOT_OVERHEAD)).min(u32::MAX as usize);
        Self {
            budget,
            capacity,
            index: HashMap::new(),
            slots: Vec::new(),
            chunks: Vec::new(),
            free: Vec::new(),
            hand: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
        }
    }

    /// The cached image of `block` (a hit marks it recently used).
    pub fn get(&mut self, block: u64) -> Option<&[u8]> {
        let Some(&s) = self.index.get(&block) else {
            self.misses += 1;
            return None;
        };
        self.hits += 1;
        self.slots[s as usize].hot = true;
        Some(self.image(s))
    }

    /// Cache `data` as the image `block` has at home now (replacing any older copy). An image
    /// of the wrong size is not cached (and any older copy is dropped).
    pub fn insert(&mut self, block: u64, data: &[u8]) {
        if data.len() != FS_BLOCK_SIZE {
            debug_assert!(false, "caching a {}-byte metadata block", data.len());
            self.invalidate(block);
            return;
        }
        let s = if let Some(&s) = self.index.get(&block) {
            s
        } else {
            let Some(s) = self.take_slot() else {
                return; // a budget of zero
            };
            self.slots[s as usize] = Slot { block, hot: false };
            self.index.insert(block, s);
            s
        };
        self.image_mut(s).copy_from_slice(data);
    }

    /// Forget `block` (it was freed, or its cached image may be wrong).
    pub fn invalidate(&mut self, block: u64) {
        if let Some(s) = self.index.remove(&block) {
            self.slots[s as usize] = Slot {
                block: EMPTY,
                hot: false,
            };
            self.free.push(s);
        }
    }

    /// Forget every block (another node may have changed them). The slab is kept for reuse.
    pub fn clear(&mut self) {
        self.index.clear();
        self.free.clear();
        for (i, slot) in self.slots.iter_mut().enumerate().rev() {
            *slot = Slot {
                block: EMPTY,
                hot: false,
            };
            self.free.push(slot_no(i));
        }
    }

    pub fn stats(&self) -> BlockCacheStats {
        BlockCacheStats {
            blocks: self.index.len(),
            capacity: self.capacity,
            bytes: self
                .chunks
                .iter()
                .map(|c| heap::alloc(c.len()))
                .sum::<usize>()
                + heap::array::<Box<[u8]>>(self.chunks.capacity())
                + heap::array::<Slot>(self.slots.capacity())
                + heap::array::<u32>(self.free.capacity())
                + heap::hash_map(&self.index),
            budget: self.budget,
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
        }
    }

    /// A slot for a new block: a free one, a new one while under capacity, else the CLOCK
    /// hand's victim (evicted). `None` only when the capacity is zero.
    fn take_slot(&mut self) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        if self.slots.len() < self.capacity {
            let s = self.slots.len();
            if s / CHUNK_BLOCKS == self.chunks.len() {
                let n = CHUNK_BLOCKS.min(self.capacity - s);
                self.chunks
                    .push(vec![0u8; n * FS_BLOCK_SIZE].into_boxed_slice());
                self.slots.reserve_exact(n);
            }
            self.slots.push(Slot {
                block: EMPTY,
                hot: false,
            });
            return Some(slot_no(s));
        }
        if self.slots.is_empty() {
            return None;
        }
        // No free slot: every slot holds a block. At most one full turn unmarks them all.
        loop {
            let s = self.hand;
            self.hand = (self.hand + 1) % self.slots.len();
            let slot = &mut self.slots[s];
            if slot.hot {
                slot.hot = false;
                continue;
            }
            self.index.remove(&slot.block);
            self.evictions += 1;
            return Some(slot_no(s));
        }
    }

    fn image(&self, s: u32) -> &[u8] {
        let (c, o) = Self::place(s);
        &self.chunks[c][o..o + FS_BLOCK_SIZE]
    }

    fn image_mut(&mut self, s: u32) -> &mut [u8] {
        let (c, o) = Self::place(s);
        &mut self.chunks[c][o..o + FS_BLOCK_SIZE]
    }

    fn place(s: u32) -> (usize, usize) {
        let s = s as usize;
        (s / CHUNK_BLOCKS, (s % CHUNK_BLOCKS) * FS_BLOCK_SIZE)
    }
}

/// A slot index as stored in the free list and the map (the cache's slots are far fewer than
/// `u32::MAX`: its budget is bytes of 4 KiB images).
fn slot_no(i: usize) -> u32 {
    u32::try_from(i).expect("block cache slot index fits u32")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn img(tag: u64) -> Vec<u8> {
        let mut v = vec![0u8; FS_BLOCK_SIZE];
        v[..8].copy_from_slice(&tag.to_le_bytes());
        v[FS_BLOCK_SIZE - 8..].copy_from_slice(&tag.to_le_bytes());
        v
    }

    fn tag(c: &mut BlockCache, b: u64) -> Option<u64> {
        c.get(b)
            .map(|d| u64::from_le_bytes(d[..8].try_into().unwrap()))
    }

    fn budget_for(blocks: usize) -> usize {
        blocks * (FS_BLOCK_SIZE + SLOT_OVERHEAD)
    }

    #[test]
    fn bounded_by_the_budget() {
        let mut c = BlockCache::new(budget_for(100));
        assert_eq!(c.stats().capacity, 100);
        for b in 0..10_000 {
            c.insert(b, &img(b));
            assert!(c.stats().blocks <= 100);
        }
        let s = c.stats();
        assert_eq!(s.blocks, 100);
        assert_eq!(s.evictions, 10_000 - 100);
        assert!(
            s.bytes <= s.budget,
            "{} bytes over a {} budget",
            s.bytes,
            s.budget
        );
        // Every block still cached carries its own image.
        for b in 0..10_000 {
            if let Some(t) = tag(&mut c, b) {
                assert_eq!(t, b);
            }
        }
        // The slab: exactly the capacity's images, in chunks.
        assert_eq!(c.chunks.len(), 100usize.div_ceil(CHUNK_BLOCKS));
        assert_eq!(
            c.chunks.iter().map(|ch| ch.len()).sum::<usize>(),
            100 * FS_BLOCK_SIZE
        );
    }

    /// The charge covers what the cache really allocates (counted by the test binary's
    /// allocator, fs/heap.rs), and that stays within the budget.
    #[test]
    fn the_charge_covers_what_the_cache_really_holds() {
        let base = heap::tests::allocated_here();
        let mut c = BlockCache::new(budget_for(1000));
        for b in 0..5000u64 {
            c.insert(b * 7, &img(b));
            if b % 5 == 0 {
                c.invalidate(b.saturating_sub(2) * 7);
            }
        }
        let real = heap::tests::allocated_here() - base;
        let s = c.stats();
        assert!(
            real <= s.bytes.cast_signed() && s.bytes <= s.budget,
            "{real} bytes allocated, {} charged, {} budget",
            s.bytes,
            s.budget
        );
    }

    #[test]
    fn hits_are_kept() {
        let mut c = BlockCache::new(budget_for(64));
        for b in 0..8 {
            c.insert(b, &img(b));
        }
        // A scan of one-off blocks far bigger than the cache, while blocks 0..8 keep being used.
        for b in 1000..20_000 {
            if b % 16 == 0 {
                for h in 0..8 {
                    assert_eq!(tag(&mut c, h), Some(h), "hot block {h} evicted at {b}");
                }
            }
            c.insert(b, &img(b));
        }
        let s = c.stats();
        assert!(s.hits >= 8 * (19_000 / 16));
        assert_eq!(s.blocks, 64);
    }

    #[test]
    fn replace_invalidate_and_clear() {
        let mut c = BlockCache::new(budget_for(4));
        c.insert(7, &img(1));
        c.insert(7, &img(2));
        assert_eq!(tag(&mut c, 7), Some(2));
        assert_eq!(c.stats().blocks, 1);
        c.invalidate(7);
        assert_eq!(tag(&mut c, 7), None);
        c.invalidate(7); // twice is harmless
        for b in 0..4 {
            c.insert(b, &img(b));
        }
        // The invalidated slot was reused: no eviction was needed for four blocks.
        assert_eq!(c.stats().evictions, 0);
        c.clear();
        assert_eq!(c.stats().blocks, 0);
        for b in 0..4 {
            assert_eq!(tag(&mut c, b), None);
        }
        // After clearing, the slab is reused in place.
        for b in 10..14 {
            c.insert(b, &img(b));
        }
        assert_eq!(c.stats().evictions, 0);
        assert_eq!(c.chunks.len(), 1);
        for b in 10..14 {
            assert_eq!(tag(&mut c, b), Some(b));
        }
        c.insert(20, &img(20));
        assert_eq!(c.stats().evictions, 1);
        assert_eq!(c.stats().blocks, 4);
    }

    #[test]
    fn zero_budget_caches_nothing() {
        let mut c = BlockCache::new(0);
        c.insert(1, &img(1));
        assert_eq!(tag(&mut c, 1), None);
        let s = c.stats();
        assert_eq!((s.blocks, s.bytes), (0, 0));
    }
}
