//! What in-memory structures really cost, for the caches' byte budgets (`fs/inode_table.rs`,
//! `fs/block_cache.rs)`: the allocator's rounding and headers, and the allocated capacity of
//! hash maps and vectors rather than their length. A budget is only honest if what it charges
//! is what the process holds; these are upper estimates of glibc's malloc, which the daemon
//! uses:
//!
//! * a small allocation of `n` bytes takes a chunk of `n` plus an 8-byte header, rounded up
//!   to 16, at least 32 bytes;
//! * a large one ([`LARGE`] and more; the daemon maps allocations of 256 KiB and more on their
//!   own, see cetrafs-fuse/src/daemon.rs) takes whole pages: `n` plus a 16-byte header,
//!   rounded up to 4 KiB;
//! * a `HashMap` holds `buckets` slots of (key, value) and one control byte each, plus one
//!   group of 16 control bytes, where `buckets` is the next power of two at 7/8 load (std's
//!   hashbrown); a `Vec` or `VecDeque` holds its capacity.

use std::collections::{HashMap, VecDeque};
use std::mem::size_of;

/// Allocations from this size on are charged whole pages.
pub const LARGE: usize = 128 << 10;
const PAGE: usize = 4096;

/// The memory an allocation of `n` bytes takes (0 for none).
pub const fn alloc(n: usize) -> usize {
    match n {
        0 => 0,
        n if n >= LARGE => (n + 16).next_multiple_of(PAGE),
        n if n <= 24 => 32,
        n => (n + 8).next_multiple_of(16),
    }
}

/// The most an allocation of `n` bytes may take: [`alloc`], plus, for one served from the
/// heap, the [`SPLIT_SLACK`] glibc adds when it hands out a free chunk whose rest is too small
/// to split off. Measured with the test binary's counting allocator: 16 or 32 bytes more than
/// [`alloc`] for some of the allocation group bitmaps' 4 KiB vectors (alloc.rs).
pub const fn at_most(n: usize) -> usize {
    match n {
        0 => 0,
        n if n >= LARGE => alloc(n),
        n => alloc(n) + SPLIT_SLACK,
    }
}

/// A free chunk is split only if the rest makes a chunk of its own (32 bytes at least), so a
/// chunk handed out may be up to 16 bytes bigger than asked for (chunks are multiples of 16).
pub const SPLIT_SLACK: usize = 16;

/// The memory of a vector's buffer of `capacity` elements of `T`.
pub fn array<T>(capacity: usize) -> usize {
    alloc(capacity * size_of::<T>())
}

/// The memory of a hash map's table (its entries' own heap data not included).
pub fn hash_map<K, V>(m: &HashMap<K, V>) -> usize {
    let cap = m.capacity();
    if cap == 0 {
        return 0;
    }
    // hashbrown: capacity is buckets - 1 below 8 buckets, 7/8 of them from 8 on.
    let buckets = if cap < 7 {
        (cap + 1).next_power_of_two()
    } else {
        (cap * 8).div_ceil(7).next_power_of_two()
    };
    alloc(buckets * (size_of::<(K, V)>() + 1) + 16)
}

/// The memory of a ring buffer's allocation.
pub fn vec_deque<T>(d: &VecDeque<T>) -> usize {
    array::<T>(d.capacity())
}

/// The estimated memory of a `BTreeMap<K, V>` (or `BTreeSet<K>` with `V = ()`) of `len`
/// entries. std's nodes hold up to 11 entries; a map of up to 11 is one leaf. A map built in
/// key order (as extent maps are, when loaded) splits its full nodes 6 + 5 and leaves them
/// with 6 entries, so a leaf is charged for every 6 entries, and an internal node (the leaf
/// plus 12 child pointers) for every 6 nodes below it.
pub fn btree<K, V>(len: usize) -> usize {
    const CAP: usize = 11;
    const FILL: usize = 6;
    if len == 0 {
        return 0;
    }
    let entries = CAP * (size_of::<K>() + size_of::<V>());
    let leaf = alloc(16 + entries);
    if len <= CAP {
        return leaf;
    }
    let internal = alloc(16 + entries + (CAP + 1) * size_of::<usize>());
    let mut level = len.div_ceil(FILL);
    let mut bytes = level * leaf;
    while level > 1 {
        level = level.div_ceil(FILL);
        bytes += level * internal;
    }
    bytes
}

/// What glibc's malloc holds (`mallinfo2`), for the debug log: what the caches' charges are
/// to be compared with. Free bytes count whether resident or not (a trim hands whole free
/// pages back to the OS, but their chunks stay free in the arena).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MallocTotals {
    /// Bytes of chunks allocated and not freed, headers included, in the arena and mapped on
    /// their own.
    pub in_use: usize,
    /// Of `in_use`, the chunks mapped on their own.
    pub mapped: usize,
    /// Bytes of free chunks in the arena.
    pub free: usize,
}

impl MallocTotals {
    /// Now.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    pub fn now() -> Self {
        // SAFETY: mallinfo2 takes no pointers; it reads glibc's own arena statistics under
        // the arenas' locks and may be called from any thread.
        let m = unsafe { libc::mallinfo2() };
        Self {
            in_use: m.uordblks.saturating_add(m.hblkhd),
            mapped: m.hblkhd,
            free: m.fordblks,
        }
    }

    /// Not known off glibc.
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    pub fn now() -> Self {
        Self::default()
    }

    /// One debug line (target `cetrafs_core::fs::heap`; bench/stat-tree.sh reads it).
    pub fn log(&self) {
        tracing::debug!(
            "malloc: {} KiB in use ({} KiB of it mapped on its own), {} KiB free in the arena",
            self.in_use >> 10,
            self.mapped >> 10,
            self.free >> 10
        );
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    /// The test binary's allocator: glibc's, counting per thread the chunks each thread has
    /// allocated and not freed, as glibc sizes them (usable size plus the 8-byte header), so
    /// a test can compare what a structure really holds with what it is charged.
    struct Counted;

    thread_local! {
        static HERE: Cell<isize> = const { Cell::new(0) };
    }

    fn count(p: *mut u8, sign: isize) {
        if !p.is_null() {
            // SAFETY: `p` is a live allocation of the system allocator (glibc's malloc).
            let n = unsafe { libc::malloc_usable_size(p.cast()) }.cast_signed() + 8;
            let _ = HERE.try_with(|c| c.set(c.get() + sign * n));
        }
    }

    // SAFETY: every call is passed to `System` unchanged, with the caller's guarantees; the
    // counting only reads the sizes of live allocations and touches a thread-local `Cell`
    // (const-initialised, no destructor, no allocation).
    unsafe impl GlobalAlloc for Counted {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            // SAFETY: forwarded as is (the caller's layout has a non-zero size).
            let p = unsafe { System.alloc(l) };
            count(p, 1);
            p
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            // SAFETY: as for `alloc`.
            let p = unsafe { System.alloc_zeroed(l) };
            count(p, 1);
            p
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            count(p, -1);
            // SAFETY: `p` was allocated by `System` with `l` (every allocation goes there).
            unsafe { System.dealloc(p, l) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
            count(p, -1);
            // SAFETY: as for `dealloc`; `n` is the caller's valid new size.
            let q = unsafe { System.realloc(p, l, n) };
            // A failed realloc leaves the old block allocated.
            count(if q.is_null() { p } else { q }, 1);
            q
        }
    }

    #[global_allocator]
    static COUNTED: Counted = Counted;

    /// Bytes this thread holds allocated now (see [`Counted`]).
    pub(crate) fn allocated_here() -> isize {
        HERE.with(Cell::get)
    }

    #[test]
    fn the_charges_cover_real_allocations() {
        let base = allocated_here();
        let mut m: HashMap<u64, [u64; 3]> = HashMap::new();
        m.extend((0..10_000).map(|i| (i, [i; 3])));
        let mut ring: VecDeque<(u64, u64)> = VecDeque::new();
        ring.extend((0..10_000).map(|i| (i, i)));
        let mut tree = std::collections::BTreeMap::new();
        tree.extend((0..10_000u64).map(|i| (i, [i; 3])));
        let one: std::collections::BTreeMap<u64, [u64; 3]> = [(1, [1; 3])].into();
        let real = allocated_here() - base;
        let charged = hash_map(&m)
            + vec_deque(&ring)
            + btree::<u64, [u64; 3]>(tree.len())
            + btree::<u64, [u64; 3]>(one.len());
        assert!(
            real <= charged.cast_signed() && real >= charged.cast_signed() * 9 / 10,
            "{real} bytes allocated, {charged} charged"
        );
    }

    #[test]
    fn allocations_round_like_glibc() {
        assert_eq!(alloc(0), 0);
        assert_eq!(alloc(1), 32);
        assert_eq!(alloc(24), 32);
        assert_eq!(alloc(25), 48);
        assert_eq!(alloc(336), 352);
        assert_eq!(alloc(256 << 10), (256 << 10) + 4096);
    }

    #[test]
    fn hash_maps_are_charged_their_buckets() {
        let mut m: HashMap<u64, u64> = HashMap::new();
        assert_eq!(hash_map(&m), 0);
        m.extend((0..1000).map(|i| (i, i)));
        // 1000 entries at 7/8 load: 2048 buckets of 17 bytes.
        assert_eq!(m.capacity(), 1792);
        assert_eq!(hash_map(&m), alloc(2048 * 17 + 16));
        m.insert(5000, 0);
        m.shrink_to_fit();
        assert!(hash_map(&m) >= 1001 * 17);
    }

    #[test]
    fn a_small_btree_is_a_whole_leaf() {
        assert_eq!(btree::<u64, u64>(0), 0);
        assert_eq!(btree::<u64, u64>(1), alloc(16 + 11 * 16));
        assert_eq!(btree::<u64, u64>(11), btree::<u64, u64>(1));
        assert!(btree::<u64, u64>(1000) > 1000 * 16 * 3 / 2);
    }
}
