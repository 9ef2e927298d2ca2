//! The inode table: the in-memory [`InodeState`] of the inodes this node has loaded, and the
//! kernel's references to inode numbers (FUSE lookup counts). Two maps, because the two live
//! by different rules:
//!
//! * **References** ([`note_lookup`](InodeTable::note_lookup),
//!   [`forget`](InodeTable::forget), [`referenced`](InodeTable::referenced)): how many entry
//!   replies naming an inode number the kernel holds and has not forgotten. Until the matching
//!   FORGETs the number must not be reused (an unlinked inode is freed only then), so the count
//!   is kept for every number the kernel holds, whether or not the inode's state is loaded. It
//!   costs one small map entry per number (about 32 bytes); the kernel bounds how many there
//!   are (it forgets under memory pressure and on `drop_caches`), nothing here evicts them,
//!   but their map's memory counts against the budget (below), so states make room for it.
//! * **States** ([`get`](InodeTable::get), [`insert`](InodeTable::insert),
//!   [`remove`](InodeTable::remove)): the decoded inode with its whole extent map. A state is a
//!   cache entry that can be dropped and loaded again from the volume whenever it is *idle*.
//!   It is *in use* while any of these holds: someone else holds its `Arc` (an open file, an
//!   operation in flight), it has an mtime not yet written back (`has_pending`), or it is an
//!   inode without links that is not freed yet (an orphan: its freeing is decided from this
//!   state on its last close or forget, and unmount frees the ones it finds here).
//!
//! **Budget.** Each state is charged the memory it holds as the allocator sees it (fs/heap.rs:
//! chunk headers and rounding included): its shared allocation (the struct and the `Arc`'s
//! counts), the symlink target, the inline extents and the extent map's B-tree nodes (a file
//! with a big extent map costs accordingly; an empty file or directory is 352 bytes). The
//! table's own structures are charged by what they have allocated, not by how many entries
//! they hold: the states' map and the ring at their capacity, and the references' map at
//! its. The total, [`InodeTableStats::total`], is what the table really holds, and it is kept
//! within the budget (mount option `inode_cache=MiB`, default [`DEFAULT_BUDGET`]) by evicting
//! idle states with CLOCK (second chance): every state sits
//! once in a ring in load order, and a hit marks it; on each insert, while the charges exceed
//! the budget, the hand takes the state at the front: a marked one loses its mark and goes to
//! the back, an in-use one goes to the back (its charge is re-estimated, an open file's extent
//! map may have grown), an idle unmarked one is evicted. The hand looks at no more than
//! [`HAND_LIMIT`] states per insert, so a load costs O(1) however many states are loaded or
//! referenced; states in use beyond the budget are simply kept (the table is then over budget
//! until some become idle, and the next inserts evict them). Ring slots of removed states are
//! skipped when the hand reaches them, and the ring is compacted when they outnumber the live
//! ones; the maps shrink when they are mostly empty (both amortised O(1)).
//!
//! A state whose inode the kernel has just forgotten entirely is cold: `Volume::forget` drops
//! it at once if it is idle ([`evict_idle`](InodeTable::evict_idle)).
//!
//! Lock order: an inode's lock may be held while the table's mutex is taken (freeing an inode
//! removes its state), so under the mutex inode locks are only ever tried, never waited for.
//!
//! [`stats`](InodeTable::stats) reports the size, budget, references, hits, misses and
//! evictions; [`report`](InodeTable::report) logs them at debug level when they changed;
//! [`trim`](InodeTable::trim), called every second, hands the memory freed meanwhile (evicted
//! states, requests' transient buffers) back to the operating system. Memory the table's
//! own maps and ring free when they are reallocated (they double as the table fills, and
//! shrink as it empties) is handed back at once.

use super::{heap, Ino, InodeInner, InodeState};
use crate::format::extent::Extent;
use crate::sync::LockPolicy;
use std::collections::{HashMap, VecDeque};
use std::mem::size_of;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, RwLockReadGuard};

/// Memory budget of the table when the mount does not say (`inode_cache=`): 32 MiB, about
/// 70,000 small files or directories (about 450 bytes each with their share of the table's
/// map and ring) when the kernel references few others.
pub const DEFAULT_BUDGET: usize = 32 << 20;

/// States the CLOCK hand examines per insert at most.
pub const HAND_LIMIT: usize = 64;

/// Maps are shrunk when their capacity exceeds this many times their length (and this floor).
const SHRINK_FACTOR: usize = 4;
const SHRINK_FLOOR: usize = 1024;

/// What the table holds and has done since mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InodeTableStats {
    /// Loaded inode states.
    pub entries: usize,
    /// Their memory, bytes.
    pub bytes: usize,
    /// Memory of the states' map and the ring, bytes (charged to the budget too).
    pub index_bytes: usize,
    /// Memory of the map of the kernel's references, bytes (charged to the budget too).
    pub ref_bytes: usize,
    /// The budget for it, bytes.
    pub budget: usize,
    /// Inode numbers the kernel holds references to.
    pub referenced: usize,
    /// Lookups of a loaded state / of one that had to be loaded.
    pub hits: u64,
    pub misses: u64,
    /// Idle states dropped to stay within the budget.
    pub evictions: u64,
    /// Idle states dropped because the kernel forgot their inode.
    pub forgotten: u64,
}

#[derive(Debug)]
pub(crate) struct InodeTable {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Entry {
    state: Arc<InodeState>,
    /// The estimate charged for it (`footprint`).
    cost: usize,
    /// Tells this entry's ring slot from slots of earlier states of the same number.
    stamp: u64,
    /// Hit since the hand last passed (second chance).
    hot: bool,
}

/// The kernel's references to one inode number (FUSE lookup counts).
#[derive(Debug, Default, Clone, Copy)]
struct Refs {
    count: u64,
    /// Some reply since the count was last zero gave the kernel the inode's attributes (not
    /// only a listing's placeholders: `Volume::entry_attr`).
    attributes: bool,
}

#[derive(Debug, Default)]
struct Inner {
    states: HashMap<Ino, Entry>,
    /// (number, stamp) of every state in load order, plus stale slots of removed ones.
    ring: VecDeque<(Ino, u64)>,
    refs: HashMap<Ino, Refs>,
    bytes: usize,
    budget: usize,
    next_stamp: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
    forgotten: u64,
    /// Charges of states dropped since the last trim.
    released: usize,
}

/// The inode's data, if nobody holds its lock for writing.
fn try_inner(st: &InodeState) -> Option<RwLockReadGuard<'_, InodeInner>> {
    st.inner.try_read().or_panic()
}

/// The memory one state holds (its slots in the table's map and ring are charged with
/// those, by capacity); `None` while its lock is held for writing.
fn footprint(st: &InodeState) -> Option<usize> {
    // The Arc's allocation: its two counts and the state.
    let fixed = heap::alloc(2 * size_of::<usize>() + size_of::<InodeState>());
    // Its inode lock's local state, once the data path has used it (fs/inode_lock.rs).
    let lock = st
        .dl
        .get()
        .map_or(0, |_| super::inode_lock::InodeLocks::entry_charge());
    let fixed = fixed + lock;
    let i = try_inner(st)?;
    Some(
        fixed
            + heap::array::<u8>(i.inode.inline_data.capacity())
            + heap::array::<Extent>(i.inode.inline_extents.capacity())
            + i.extents.heap_bytes(),
    )
}

/// Can this state be dropped now? (The caller holds the table's mutex and no clone of it.)
fn idle(st: &Arc<InodeState>) -> bool {
    Arc::strong_count(st) == 1
        && st.opens.load(Ordering::Acquire) == 0
        && !st.has_pending.load(Ordering::Acquire)
        && try_inner(st).is_some_and(|i| i.freed || i.inode.nlink > 0)
}

fn shrink<K, V>(m: &mut HashMap<K, V>)
where
    K: std::hash::Hash + Eq,
{
    if m.capacity() > SHRINK_FLOOR && m.capacity() > SHRINK_FACTOR * m.len() {
        // Capacity lands in [1.5, 3) x len: below the trigger, so the next shrink waits for
        // a quarter of the entries to go (amortised O(1)).
        m.shrink_to(m.len() + m.len() / 2);
    }
}

impl Inner {
    fn drop_entry(&mut self, e: &Entry) {
        self.bytes = self.bytes.saturating_sub(e.cost);
        self.released = self.released.saturating_add(e.cost);
    }

    /// Run the CLOCK hand until the charges are within the budget or it has looked at
    /// `HAND_LIMIT` states.
    fn sweep(&mut self) {
        let mut examined = 0;
        while self.total() > self.budget && examined < HAND_LIMIT {
            let Some((ino, stamp)) = self.ring.pop_front() else {
                break;
            };
            let Some(e) = self.states.get_mut(&ino).filter(|e| e.stamp == stamp) else {
                continue; // the slot of a removed or replaced state
            };
            examined += 1;
            if e.hot || !idle(&e.state) {
                e.hot = false;
                if let Some(c) = footprint(&e.state) {
                    self.bytes = self.bytes.saturating_sub(e.cost).saturating_add(c);
                    e.cost = c;
                }
                self.ring.push_back((ino, stamp));
                continue;
            }
            if let Some(e) = self.states.remove(&ino) {
                self.drop_entry(&e);
                self.evictions += 1;
            }
        }
        self.tidy();
    }

    /// The states' map and the ring, as allocated.
    fn index_bytes(&self) -> usize {
        let [states, ring, _] = self.allocations();
        states + ring
    }

    /// The references' map, as allocated.
    fn ref_bytes(&self) -> usize {
        self.allocations()[2]
    }

    /// Everything charged to the budget.
    fn total(&self) -> usize {
        self.bytes + self.index_bytes() + self.ref_bytes()
    }

    /// Add a state (replacing any of the same number), then sweep.
    fn insert(&mut self, st: Arc<InodeState>, cost: usize) {
        self.next_stamp += 1;
        let (ino, stamp) = (st.ino, self.next_stamp);
        let entry = Entry {
            state: st,
            cost,
            stamp,
            hot: false,
        };
        if let Some(old) = self.states.insert(ino, entry) {
            self.drop_entry(&old);
        }
        self.bytes = self.bytes.saturating_add(cost);
        self.ring.push_back((ino, stamp));
        self.sweep();
    }

    /// The sizes of the table's own allocations: the states' map, the ring, the references'
    /// map.
    fn allocations(&self) -> [usize; 3] {
        [
            heap::hash_map(&self.states),
            heap::vec_deque(&self.ring),
            heap::hash_map(&self.refs),
        ]
    }

    /// Compact the ring when stale slots outnumber live ones; shrink mostly empty maps.
    fn tidy(&mut self) {
        if self.ring.len() > 2 * self.states.len() + SHRINK_FLOOR {
            let states = &self.states;
            self.ring
                .retain(|(i, s)| states.get(i).is_some_and(|e| e.stamp == *s));
            self.ring.shrink_to(self.ring.len() + self.ring.len() / 2);
        }
        shrink(&mut self.states);
        shrink(&mut self.refs);
    }
}

impl InodeTableStats {
    /// The memory charged to the budget: states, their map and ring, the references' map.
    pub fn total(&self) -> usize {
        self.bytes + self.index_bytes + self.ref_bytes
    }
}

impl InodeTable {
    pub fn new(budget: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                budget,
                ..Inner::default()
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().or_panic()
    }

    /// The loaded state of `ino`, if any, without counting or marking it as used (for
    /// background threads that only look).
    pub fn peek(&self, ino: Ino) -> Option<Arc<InodeState>> {
        self.lock().states.get(&ino).map(|e| e.state.clone())
    }

    /// The loaded state of `ino`, if any (a hit marks it recently used).
    pub fn get(&self, ino: Ino) -> Option<Arc<InodeState>> {
        let mut t = self.lock();
        if let Some(e) = t.states.get_mut(&ino) {
            e.hot = true;
            let s = e.state.clone();
            t.hits += 1;
            Some(s)
        } else {
            t.misses += 1;
            None
        }
    }

    /// Add a freshly loaded or created state (replacing any state of the same number), then
    /// evict idle states while over the budget.
    pub fn insert(&self, st: Arc<InodeState>) {
        let cost = footprint(&st).unwrap_or(0);
        self.change(|t| t.insert(st, cost));
    }

    /// Run `f` on the table, then hand free memory back to the OS at once if `f` made one of
    /// the table's own large allocations move (a map or the ring grew or shrank): the old one
    /// was freed in one piece, all of it touched, and glibc keeps such memory resident until
    /// trimmed. That happens a few times per doubling or halving of the table, so the trims
    /// are rare.
    fn change<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut t = self.lock();
        let before = t.allocations();
        let r = f(&mut t);
        let after = t.allocations();
        drop(t);
        if before
            .iter()
            .zip(after)
            .any(|(&b, a)| b != a && b >= heap::LARGE)
        {
            trim_heap();
        }
        r
    }

    /// Drop the state of `ino` (freed, or gone from the volume). Its kernel references stay.
    pub fn remove(&self, ino: Ino) {
        self.change(|t| {
            if let Some(e) = t.states.remove(&ino) {
                t.drop_entry(&e);
                t.tidy();
            }
        });
    }

    /// The kernel took one more reference to `ino`, with its attributes.
    pub fn note_lookup(&self, ino: Ino) {
        self.note_reference(ino, true);
    }

    /// The kernel took one more reference to `ino` from a listing that gave it placeholder
    /// attributes only.
    pub fn note_listed(&self, ino: Ino) {
        self.note_reference(ino, false);
    }

    fn note_reference(&self, ino: Ino, attributes: bool) {
        self.change(|t| {
            let r = t.refs.entry(ino).or_default();
            r.count = r.count.saturating_add(1);
            r.attributes |= attributes;
        });
    }

    /// The kernel dropped `nlookup` references to `ino` (never below zero). Returns the loaded
    /// state when none are left, for the caller to decide its fate.
    pub fn forget(&self, ino: Ino, nlookup: u64) -> Option<Arc<InodeState>> {
        self.change(|t| {
            if let Some(r) = t.refs.get_mut(&ino) {
                r.count = r.count.saturating_sub(nlookup);
                if r.count > 0 {
                    return None;
                }
                t.refs.remove(&ino);
                t.tidy();
            }
            t.states.get(&ino).map(|e| e.state.clone())
        })
    }

    /// Does the kernel hold a reference to `ino`?
    pub fn referenced(&self, ino: Ino) -> bool {
        self.lock().refs.contains_key(&ino)
    }

    /// Does the kernel hold a reference to `ino` that came with its attributes?
    pub fn given_attributes(&self, ino: Ino) -> bool {
        self.lock().refs.get(&ino).is_some_and(|r| r.attributes)
    }

    /// Drop the state of `ino` if it is idle (the caller holds no clone of it).
    pub fn evict_idle(&self, ino: Ino) {
        self.change(|t| {
            if t.states.get(&ino).is_some_and(|e| idle(&e.state)) {
                if let Some(e) = t.states.remove(&ino) {
                    t.drop_entry(&e);
                    t.forgotten += 1;
                    t.tidy();
                }
            }
        });
    }

    /// The loaded states for which `pred` holds. `pred` runs under the table's mutex and must
    /// not wait for the inode's lock.
    pub fn matching(&self, pred: impl Fn(&InodeState) -> bool) -> Vec<Arc<InodeState>> {
        self.lock()
            .states
            .values()
            .filter(|e| pred(&e.state))
            .map(|e| e.state.clone())
            .collect()
    }

    pub fn stats(&self) -> InodeTableStats {
        let t = self.lock();
        InodeTableStats {
            entries: t.states.len(),
            bytes: t.bytes,
            index_bytes: t.index_bytes(),
            ref_bytes: t.ref_bytes(),
            budget: t.budget,
            referenced: t.refs.len(),
            hits: t.hits,
            misses: t.misses,
            evictions: t.evictions,
            forgotten: t.forgotten,
        }
    }

    /// Memory freed elsewhere (a committed transaction's block images) that should be handed
    /// back to the OS like the states' (see [`trim`](Self::trim)).
    pub fn note_released(&self, bytes: usize) {
        let mut t = self.lock();
        t.released = t.released.saturating_add(bytes);
    }

    /// Log the stats at debug level if they differ from `last` (updated).
    pub fn report(&self, last: &mut InodeTableStats) {
        let s = self.stats();
        if s != *last {
            tracing::debug!(
                "inode table: {} states, {} KiB + {} KiB of map and ring + {} KiB of references = {} KiB of {} KiB budget, {} numbers referenced by the kernel; {} hits, {} misses, {} evicted, {} dropped after forget",
                s.entries,
                s.bytes >> 10,
                s.index_bytes >> 10,
                s.ref_bytes >> 10,
                s.total() >> 10,
                s.budget >> 10,
                s.referenced,
                s.hits,
                s.misses,
                s.evictions,
                s.forgotten
            );
            *last = s;
        }
    }

    /// Return free heap memory to the operating system if the daemon did metadata work since
    /// the last call (`last` holds the table's activity count then; updated): a state was
    /// looked up, loaded, evicted or dropped, or [`note_released`](Self::note_released) was
    /// told of freed memory. Called every second ([`TRIM_EVERY`]). Returns whether it trimmed.
    ///
    /// glibc keeps freed memory resident until trimmed, outside every budget, and the daemon's
    /// requests free a lot of it: states the hand evicts, and the transient buffers every
    /// request allocates and frees (directory blocks, reply buffers). Those are not reused in
    /// place: glibc serves small requests by splitting its last free chunk, so they march
    /// through a large free region (the hole a big transaction's block images left in the
    /// heap) and each page they touch stays resident after they are freed. Measured with
    /// `bench/stat-tree.sh` (60,000 files, both caches at 16 MiB): with a trim only after 8 MiB
    /// (and later 1 MiB) of evicted states, every 5 s, the heap held 1.2 MiB of free memory
    /// resident at the end of a pass, which alone put the daemon over its budget; trimmed every
    /// second, 0.2 MiB. A trim walks glibc's free chunks (a few hundred in those runs) and
    /// releases their whole pages, once a second while the daemon is busy, never when idle.
    pub fn trim(&self, last: &mut u64) -> bool {
        let (activity, released) = {
            let mut t = self.lock();
            let released = std::mem::take(&mut t.released);
            (t.hits + t.misses + t.evictions + t.forgotten, released)
        };
        if activity == *last && released == 0 {
            return false;
        }
        *last = activity;
        trim_heap();
        true
    }
}

/// How often the volume's reporter thread calls [`InodeTable::trim`].
pub const TRIM_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_heap() {
    // SAFETY: malloc_trim takes no pointers and only rearranges glibc's own free lists under
    // glibc's arena locks; it is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_heap() {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::inode::Inode;
    use crate::fs::extent_map::ExtentMap;

    #[test]
    fn trims_only_after_activity() {
        let t = InodeTable::new(1 << 20);
        let mut last = 0;
        assert!(!t.trim(&mut last), "nothing happened yet");
        assert!(t.get(7).is_none());
        assert!(t.trim(&mut last), "a miss is activity");
        assert!(!t.trim(&mut last), "and was seen");
        t.note_released(4096);
        assert!(t.trim(&mut last), "released memory is trimmed");
        assert!(!t.trim(&mut last));
    }

    fn state(ino: Ino, nlink: u32) -> Arc<InodeState> {
        Arc::new(InodeState::new(
            Inode {
                ino,
                nlink,
                mode: libc::S_IFREG | 0o644,
                ..Inode::default()
            },
            ExtentMap::default(),
            0,
        ))
    }

    fn one_cost() -> usize {
        footprint(&state(1, 1)).unwrap()
    }

    /// The charge of a table of `n` small states (with their map and ring).
    fn budget_for(n: u64) -> usize {
        let t = InodeTable::new(usize::MAX);
        for ino in 1..=n {
            t.insert(state(ino, 1));
        }
        t.stats().total()
    }

    #[test]
    fn the_kernels_references_count_against_the_budget() {
        let budget = budget_for(1000);
        let t = InodeTable::new(budget);
        for ino in 1..=1000 {
            t.insert(state(ino, 1));
        }
        let before = t.stats();
        assert!(before.entries > 900, "{before:?}");
        // The kernel now references many numbers: loading more states makes room for them.
        for ino in 1..=5000 {
            t.note_lookup(ino);
        }
        for ino in 2000..2100 {
            t.insert(state(ino, 1));
        }
        let s = t.stats();
        assert!(s.ref_bytes > 5000 * 17 && s.ref_bytes < budget / 2, "{s:?}");
        assert!(s.total() <= budget, "{s:?}");
        assert!(s.entries + s.ref_bytes / one_cost() <= 1000, "{s:?}");
    }

    #[test]
    fn a_small_inode_is_charged_its_allocation_and_extents_add_to_it() {
        let small = one_cost();
        // The module's documented 352 bytes, the default budget's "about 70,000 small files".
        assert_eq!(
            small,
            heap::alloc(2 * size_of::<usize>() + size_of::<InodeState>())
        );
        assert!((300..=400).contains(&small), "{small} bytes");
        let st = state(1, 1);
        st.write().extents.insert(0, 1000, 1, false);
        let mut big = st.write();
        for i in 1..1000 {
            big.extents.insert(2 * i, 1000 + 2 * i, 1, false);
        }
        drop(big);
        let cost = footprint(&st).unwrap();
        assert!(cost > small + 1000 * size_of::<(u64, Extent)>(), "{cost}");
    }

    #[test]
    fn loads_beyond_the_budget_stay_bounded_and_keep_states_in_use() {
        let budget = 1000 * one_cost();
        let t = InodeTable::new(budget);
        // Every 10th state stays in use (held, like an open file); every 7th is referenced
        // by the kernel only, which does not keep its state.
        let mut held = Vec::new();
        for ino in 1..=3000 {
            let st = state(ino, 1);
            t.insert(st.clone());
            if ino % 10 == 0 {
                held.push(st);
            }
            if ino % 7 == 0 {
                t.note_lookup(ino);
            }
        }
        let s = t.stats();
        assert!(
            s.total() <= budget + one_cost(),
            "{} bytes over a {budget} budget",
            s.total()
        );
        assert!(s.entries <= 1001, "{} entries", s.entries);
        assert_eq!(s.evictions, 3000 - s.entries as u64);
        for st in &held {
            assert!(
                t.get(st.ino).is_some_and(|g| Arc::ptr_eq(&g, st)),
                "state {} in use was evicted",
                st.ino
            );
        }
        for ino in (7..=3000).step_by(7) {
            assert!(t.referenced(ino), "reference to {ino} lost with its state");
        }
        assert_eq!(s.referenced, 3000 / 7);
    }

    /// What the budget bounds is what the table really allocates: counted by the test
    /// binary's allocator (fs/heap.rs), on this thread, while the table fills far past its
    /// budget with small inodes, inodes with extents and the kernel's references.
    #[test]
    fn the_charge_covers_what_the_table_really_holds() {
        let base = heap::tests::allocated_here();
        let budget = 4 << 20;
        let t = InodeTable::new(budget);
        for ino in 1..=40_000 {
            let st = state(ino, 1);
            let extents = match ino % 10 {
                0 => 1,
                1 => 40,
                _ => 0,
            };
            for i in 0..extents {
                st.write().extents.insert(2 * i, 1000 + 2 * i, 1, false);
            }
            if ino % 10 == 2 {
                st.write().inode.inline_data = vec![b'x'; 200];
            }
            t.insert(st);
            if ino % 3 == 0 {
                t.note_lookup(ino);
            }
        }
        let real = heap::tests::allocated_here() - base;
        let s = t.stats();
        assert!(s.evictions > 20_000, "{s:?}");
        assert!(
            s.total() <= budget && real <= s.total().cast_signed(),
            "{real} bytes allocated, {} charged of {budget}: {s:?}",
            s.total()
        );
        // Not wildly pessimistic either: the budget is meant to be used.
        assert!(real >= s.total().cast_signed() * 8 / 10, "{real}: {s:?}");
    }

    #[test]
    fn in_use_states_are_kept_over_budget_and_each_insert_does_bounded_work() {
        let t = InodeTable::new(0);
        let held: Vec<_> = (1..=5000).map(|i| state(i, 1)).collect();
        for st in &held {
            t.insert(st.clone());
        }
        assert_eq!(t.stats().entries, 5000, "nothing idle, nothing evicted");
        assert_eq!(t.stats().evictions, 0);
        // Once idle, one insert evicts no more than the hand looks at.
        drop(held);
        t.insert(state(9999, 1));
        let s = t.stats();
        assert!(
            s.evictions >= HAND_LIMIT as u64 - 1 && s.evictions <= HAND_LIMIT as u64,
            "one insert evicted {}",
            s.evictions
        );
        // Later inserts continue where the hand stopped, until the table is within budget.
        for i in 10_000..10_200 {
            t.insert(state(i, 1));
        }
        assert!(t.stats().entries <= 1, "{:?}", t.stats());
    }

    #[test]
    fn hits_get_a_second_chance() {
        let budget = budget_for(100);
        let t = InodeTable::new(budget);
        for ino in 1..=100 {
            t.insert(state(ino, 1));
        }
        assert!(t.get(1).is_some());
        for _ in 0..3 {
            for ino in 101..=150 {
                t.insert(state(ino, 1));
                assert!(t.get(1).is_some(), "the hot state 1 was evicted");
            }
        }
        let s = t.stats();
        assert!(s.hits >= 150 && s.evictions >= 50, "{s:?}");
    }

    #[test]
    fn orphans_and_pending_mtimes_are_in_use() {
        let t = InodeTable::new(0);
        let orphan = state(1, 0);
        let pending = state(2, 1);
        pending.note_write();
        let freed = state(3, 0);
        freed.write().freed = true;
        for st in [orphan, pending, freed] {
            t.insert(st);
        }
        t.insert(state(4, 1)); // runs the hand
        assert!(t.get(1).is_some(), "an unfreed orphan must stay loaded");
        assert!(t.get(2).is_some(), "a pending mtime must not be lost");
        assert!(t.get(3).is_none(), "a freed tombstone is idle");
    }

    #[test]
    fn forget_counts_down_and_returns_the_state_at_zero() {
        let t = InodeTable::new(DEFAULT_BUDGET);
        t.insert(state(5, 1));
        t.note_lookup(5);
        t.note_lookup(5);
        assert!(t.forget(5, 1).is_none(), "one reference left");
        assert!(t.referenced(5));
        let st = t.forget(5, 1).expect("loaded");
        assert!(!t.referenced(5));
        t.evict_idle(5);
        assert!(t.get(5).is_some(), "held by the caller: not idle");
        drop(st);
        t.evict_idle(5);
        assert!(t.get(5).is_none());
        assert_eq!(t.stats().forgotten, 1);
        // More forgotten than looked up (a number never noted): no underflow.
        t.note_lookup(6);
        assert!(t.forget(6, 10).is_none(), "not loaded");
        assert!(!t.referenced(6));
    }

    #[test]
    fn ring_and_maps_shrink_after_churn() {
        let t = InodeTable::new(DEFAULT_BUDGET);
        for round in 0..5u64 {
            for i in 0..10_000 {
                t.insert(state(round * 10_000 + i, 1));
                t.note_lookup(round * 10_000 + i);
            }
            for i in 0..10_000 {
                t.forget(round * 10_000 + i, 1);
                t.remove(round * 10_000 + i);
            }
        }
        let g = t.lock();
        assert!(g.states.is_empty() && g.refs.is_empty() && g.bytes == 0);
        assert!(
            g.ring.len() <= 2 * SHRINK_FLOOR + 1,
            "ring {}",
            g.ring.len()
        );
        assert!(g.states.capacity() <= 4 * SHRINK_FLOOR);
        assert!(g.refs.capacity() <= 4 * SHRINK_FLOOR);
    }

    /// Through a mounted volume on the memory device.
    mod volume {
        use crate::dev::mem::MemDevice;
        use crate::error::ErrorKind;
        use crate::fs::{Caller, MountOptions, Volume};
        use crate::mkfs::{format, MkfsOptions};
        use std::sync::Arc;

        const C: Caller = Caller::ROOT;

        fn mounted(budget: usize) -> (Arc<MemDevice>, Arc<Volume>) {
            let dev = Arc::new(MemDevice::new(256 << 20, 512));
            let opts = MkfsOptions {
                max_nodes: 2,
                journal_bytes: 1 << 20,
                ..Default::default()
            };
            format(&*dev, &opts, &mut |_, _| {}).unwrap();
            let v = Volume::mount(
                dev.clone(),
                &MountOptions {
                    inode_cache_bytes: budget,
                    ..MountOptions::default()
                },
            )
            .unwrap();
            (dev, v)
        }

        fn check_clean(dev: &MemDevice, v: &Volume) {
            v.unmount().unwrap();
            let report = crate::check::check_volume(dev).unwrap();
            assert!(report.is_clean(), "{:?}", report.findings);
        }

        #[test]
        fn three_budgets_of_inodes_keep_the_table_bounded_and_referenced_ones_counted() {
            // A budget of about 300 small inodes; 900 files, every 3rd referenced by the
            // kernel, every 50th open.
            let probe = super::state(1, 1);
            let budget = 300 * super::footprint(&probe).unwrap();
            let (dev, v) = mounted(budget);
            let r = v.root_ino();
            let d = v.mkdir(r, b"d", 0o755, C).unwrap();
            let mut files = Vec::new();
            let mut open = Vec::new();
            for i in 0..900 {
                let a = v
                    .mknod(
                        d.ino,
                        format!("f{i}").as_bytes(),
                        libc::S_IFREG | 0o644,
                        0,
                        C,
                    )
                    .unwrap();
                if i % 3 == 0 {
                    v.note_lookup(a.ino);
                }
                if i % 50 == 0 {
                    open.push(v.open(a.ino, true, false).unwrap());
                }
                files.push(a.ino);
            }
            let s = v.inode_table_stats();
            assert!(
                s.bytes <= budget && s.entries <= 302,
                "table not bounded: {s:?}"
            );
            assert!(s.evictions >= 600, "{s:?}");
            assert_eq!(s.referenced, 300);
            // Every state is answerable again; the open ones were never dropped.
            for (i, &ino) in files.iter().enumerate() {
                assert_eq!(v.getattr(ino).unwrap().ino, ino);
                assert_eq!(
                    v.lookup(d.ino, format!("f{i}").as_bytes()).unwrap().ino,
                    ino
                );
            }
            for fh in &open {
                let held = v.inodes.get(fh.ino).expect("open file's state evicted");
                assert!(Arc::ptr_eq(&held, &fh.state));
            }
            let s = v.inode_table_stats();
            assert!(s.bytes <= budget && s.misses > 900, "{s:?}");
            // A referenced inode whose state was evicted is still not freed by unlink, nor
            // its number reused, until the kernel forgets it.
            v.unlink(d.ino, b"f3").unwrap();
            assert_eq!(v.getattr(files[3]).unwrap().nlink, 0, "kept for the kernel");
            v.sync().unwrap();
            for i in 0..50 {
                let x = v
                    .mknod(r, format!("n{i}").as_bytes(), libc::S_IFREG | 0o644, 0, C)
                    .unwrap();
                assert_ne!(x.ino, files[3], "number reused while referenced");
            }
            assert!(v.inodes.get(files[3]).is_some(), "an orphan stays loaded");
            v.forget(files[3], 1);
            assert_eq!(v.getattr(files[3]).unwrap_err().kind(), ErrorKind::NotFound);
            for fh in &open {
                v.release(fh).unwrap();
            }
            check_clean(&dev, &v);
        }

        #[test]
        fn forget_drops_the_state_and_a_reload_sees_the_inode() {
            let (dev, v) = mounted(super::DEFAULT_BUDGET);
            let r = v.root_ino();
            let (a, fh) = v.create(r, b"f", 0o644, C, true).unwrap();
            v.note_lookup(a.ino);
            v.write(&fh, 0, &[7u8; 5000]).unwrap();
            v.release(&fh).unwrap();
            drop(fh);
            v.note_lookup(a.ino);
            v.forget(a.ino, 1);
            assert!(v.inodes.get(a.ino).is_some(), "one reference left");
            let before = v.inode_table_stats().forgotten;
            v.forget(a.ino, 1);
            assert!(v.inodes.get(a.ino).is_none(), "forgotten and idle: dropped");
            assert_eq!(v.inode_table_stats().forgotten, before + 1);
            let b = v.lookup(r, b"f").unwrap();
            assert_eq!((b.ino, b.size), (a.ino, 5000));
            let fh = v.open(a.ino, false, false).unwrap();
            let mut out = Vec::new();
            v.read(&fh, 0, 6000, &mut |d| out.extend_from_slice(d))
                .unwrap();
            assert_eq!(out, vec![7u8; 5000]);
            v.release(&fh).unwrap();
            check_clean(&dev, &v);
        }

        #[test]
        fn with_no_budget_every_idle_state_goes_and_freed_inodes_stay_freed() {
            let (dev, v) = mounted(0);
            let r = v.root_ino();
            let d = v.mkdir(r, b"d", 0o755, C).unwrap();
            let f = v.mknod(d.ino, b"f", libc::S_IFREG | 0o644, 0, C).unwrap();
            let g = v.mknod(d.ino, b"g", libc::S_IFREG | 0o644, 0, C).unwrap();
            v.mknod(r, b"other", libc::S_IFREG | 0o644, 0, C).unwrap();
            // Only what the last insert found in use (the parent and the new inode) is left.
            assert!(
                v.inode_table_stats().entries <= 2,
                "{:?}",
                v.inode_table_stats()
            );
            // An unreferenced, closed file is freed at unlink, and its (evicted) state does not
            // come back.
            v.unlink(d.ino, b"f").unwrap();
            assert_eq!(v.getattr(f.ino).unwrap_err().kind(), ErrorKind::NotFound);
            // An open one is freed at its last close, referenced or not.
            let fh = v.open(g.ino, true, false).unwrap();
            v.note_lookup(g.ino);
            v.unlink(d.ino, b"g").unwrap();
            v.mknod(r, b"churn", libc::S_IFREG | 0o644, 0, C).unwrap();
            assert_eq!(v.getattr(g.ino).unwrap().nlink, 0);
            v.release(&fh).unwrap();
            assert_eq!(v.getattr(g.ino).unwrap().nlink, 0, "still referenced");
            v.forget(g.ino, 1);
            assert_eq!(v.getattr(g.ino).unwrap_err().kind(), ErrorKind::NotFound);
            v.rmdir(r, b"d").unwrap();
            check_clean(&dev, &v);
        }
    }
}
