//! Block allocator over the allocation groups.
//!
//! **What is in memory.** For every group a small summary (its class, its free count, when it
//! was last checked against the disk: ~64 bytes, allocated once at mount), and the bitmaps (1
//! bit per 4 KiB block: 32 MiB per TiB) only of the groups this node is using, loaded on demand
//! into the *bitmap cache*, kept under a byte budget (mount option `bitmap_cache=MiB`, default
//! [`DEFAULT_BITMAP_CACHE`]). A loaded bitmap that is clean, home and holds no reservation or
//! quarantined run may be evicted, least recently used first; one that is dirty, not yet
//! written home by a commit point, or reserved is *pinned* and stays whatever the budget, and
//! so does the one just loaded for the operation in progress (until the next load or commit
//! point). So a node's memory follows the groups it allocates in and frees into, not the size
//! of the volume.
//!
//! **What the budget is charged** is what the bitmaps hold in the heap, as glibc sizes it
//! (fs/heap.rs): per loaded group its boxed record, its used-bits, reserved-bits and block
//! sequence vectors by their capacity (the reserved bits are allocated on the first
//! reservation and freed when the last one goes), and the B-tree of its changed bitmap blocks;
//! plus the index of loaded groups by its capacity. The charge is computed from the bitmaps
//! themselves whenever it is needed (at each load, commit point and stats call: a sum over the
//! loaded groups), so no running count can drift from what is held. Memory freed by evictions
//! is reported ([`Allocator::take_released`]) so the daemon hands it back to the OS.
//! [`Allocator::bitmap_stats`] reports groups, charge, pinned charge, loads and evictions.
//!
//! **Validity** (the per-group version). Every change to a group's bitmap rewrites its header
//! in the same transaction with the header's sequence number + 1 (`take_dirty`), so the
//! header's sequence is the group's change counter, on disk, without a format change. The
//! allocator keeps a generation `gen`, bumped by [`Allocator::invalidate`] whenever another node
//! may have changed metadata (the global lock's version moved). A group is *checked* at `gen`
//! once its header was read at that generation: a loaded bitmap whose header sequence still
//! matches is kept, any other is dropped and re-read. Nothing is read at invalidation; a group
//! is checked on its next use (allocation, free, `is_used`) under the lock, one header read
//! per group used. While this node holds the lock nobody else changes a group, so a group
//! checked at the current generation is exact.
//!
//! **Free counts.** Exact for groups checked at the current generation. For the others: the
//! count in the group's lock record value block (LVB) when that changed since this node last
//! saw it (another node published it at an exclusive handoff, `note_lvb`), else this node's own
//! last count (from the header read at mount or at the group's last check, or from its own
//! changes). `free_blocks` (statfs) sums them. An allocation that finds no space checks every
//! unchecked group's header and tries once more before it fails; runs freed since the last
//! commit point are not usable before it ([`Allocator::free`]), so the operation then runs one
//! and tries again (fs/txn.rs `Meta::commit_for_space`): `ENOSPC` is exact.
//!
//! Per-file *reservation windows* (as ext4's preallocation and GFS2's rgrp reservations): when a
//! file allocates, the free run after its allocation is reserved for that file in memory only,
//! and the window doubles each time the file consumes it (up to 256 MiB). Two files growing at
//! the same time therefore fill separate runs instead of interleaving block by block, and a
//! sequential writer gets one extent per group. Reservations are dropped when the file is closed
//! and when another node held the lock, and are never on disk.
//!
//! *Blocks held for writes in flight* ([`Allocator::reserve`]): an allocating data write picks
//! its blocks under the metadata mutex but writes them outside it (fs/data.rs). Its runs are
//! taken as [`Allocator::alloc`] takes them and then kept only in the in-memory reservation
//! bitmap, so nothing else allocates them while the bitmap on disk (and every bitmap block a
//! transaction writes meanwhile) still shows them free. [`Allocator::commit_reserved`] marks
//! them used in the transaction that maps them, [`Allocator::unreserve`] gives them back when
//! the write failed. A crash in between leaves nothing on disk to undo. Held runs pin their
//! group's bitmap (reserved bits are never evicted).
//!
//! Several nodes: every change to a bitmap happens under the cluster's exclusive metadata lock.
//! *Where* a node allocates is a policy on top: each node owns some groups (long-held group
//! locks, see cluster/lock.rs) and looks there first, then in groups nobody owns, and only then
//! in other nodes' groups — so three nodes writing three images fill three separate regions.
//!
//! **Group marks (format 7, docs/locking.md §9).** On such a volume the owner of a group also
//! changes it *without* the global lock: it refills its block pool from it
//! ([`Allocator::alloc_in`]) while the group's lock record carries its *mark*. So under the
//! global lock a group another node owns is no longer safe to use as it is: before this
//! allocator loads such a group's bitmap to allocate from it or free into it, it asks its
//! [`GroupGate`] for the mark — an allocation waits a moment for the owner's refill to end and
//! else looks elsewhere, a free waits until the mark goes (a refill takes milliseconds; a
//! dead owner's mark goes when it is recovered) — and then re-reads the group's header (the
//! owner may have changed it since this node last looked). The marks stay until the caller
//! has written everything home and takes them back ([`Allocator::take_marked`], at the global
//! lock's handoff); reservation windows in those groups are dropped then, since the owner may
//! fill them next. `is_used` takes no mark (it also runs under a shared hold), and a discard
//! leaves such groups to their owners ([`Allocator::unclaimed`]).
//!
//! **Group claims (format 8, docs/locking.md §9).** A node whose own groups cannot top its
//! pool up claims a group nobody owns *without* the global lock: one CAW of the group's
//! record from Free and unmarked to owned and marked by it (`LockTable::claim_group_marked`).
//! So on such a volume a group nobody owns is not safe to use unmarked either: the gate marks
//! it like another node's group before this allocator allocates from, frees into or trims
//! it (an unmarked group is one nobody changes, and whoever marked it last wrote its changes
//! home before taking the mark off), and `is_used` looks it up without a mark as above.

use crate::dev::{AlignedBuf, SharedDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::group::{decode_bitmap, encode_bitmap, GroupHeader, BITS_PER_BITMAP_BLOCK};
use crate::format::superblock::Superblock;
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};
use crate::fs::heap;
use std::collections::{BTreeSet, HashMap};
use std::fmt;

const WORDS_PER_BITMAP_BLOCK: usize = (BITS_PER_BITMAP_BLOCK / 64) as usize;
const _: () = assert!(BITS_PER_BITMAP_BLOCK.is_multiple_of(64));
pub const MIN_WINDOW: u64 = 64;
pub const MAX_WINDOW: u64 = 1 << 16;
/// Budget of the bitmap cache when the mount does not say (`bitmap_cache=`): 32 MiB, about
/// 880 groups of 1 GiB (37 KiB of bits each; twice that while blocks in it are reserved).
pub const DEFAULT_BITMAP_CACHE: usize = 32 << 20;

/// What the bitmap cache holds and has done since mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BitmapCacheStats {
    /// Groups whose bitmap is loaded.
    pub groups: usize,
    /// Heap the loaded bitmaps and the cache's index hold (see the module docs), bytes.
    pub bytes: usize,
    /// Of `bytes`, what bitmaps that may not be evicted now hold (changed and not yet home,
    /// or reserved).
    pub pinned: usize,
    /// The budget, bytes.
    pub budget: usize,
    /// Bitmaps read from the device.
    pub loads: u64,
    /// Bitmaps dropped to fit the budget.
    pub evictions: u64,
}

impl fmt::Display for BitmapCacheStats {
    /// `allocation bitmaps: G groups = N KiB of B KiB budget (P KiB pinned); L loaded, E
    /// evicted` (bench/stat-tree.sh reads N).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "allocation bitmaps: {} groups = {} KiB of {} KiB budget ({} KiB pinned); {} loaded, {} evicted",
            self.groups,
            self.bytes >> 10,
            self.budget >> 10,
            self.pinned >> 10,
            self.loads,
            self.evictions
        )
    }
}

/// Who owns a group, as far as this node's allocation policy is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupClass {
    Mine = 0,
    Unowned = 1,
    Others = 2,
}

/// Format 7: how an allocator under the global lock gets the right to use a group another
/// node owns (module docs, "Group marks").
pub trait GroupGate: Send + Sync + fmt::Debug {
    /// Put this node's mark on group `g`, waiting while another node's mark is on it: a
    /// moment unless `patient`, else until that mark goes (its owner's refill ends, or its
    /// dead owner is recovered). Ok(false): it did not go in that time. An error may leave
    /// the mark on (the caller takes it off later).
    fn mark(&self, g: u64, patient: bool) -> Result<bool>;
}

/// What this node knows of one group, loaded or not.
#[derive(Debug)]
struct Group {
    class: GroupClass,
    /// Exact when `checked` is the allocator's generation; else the best count known.
    free: u64,
    /// Generation at which the header was last read (and a loaded bitmap confirmed).
    checked: u64,
    /// The LVB count last seen in the group's lock record, or last published by this node.
    lvb_seen: Option<u64>,
    bits: Option<Box<Bitmap>>,
}

/// A loaded group bitmap and its bookkeeping.
#[derive(Debug)]
struct Bitmap {
    /// Sequence of the header this bitmap belongs to (the group's change counter).
    header_seq: u64,
    used: Vec<u64>,
    /// Reserved bits (reservation windows, quarantined frees); empty when none ever was.
    resv: Vec<u64>,
    /// Sequence of each bitmap block (its change counter).
    block_seq: Vec<u64>,
    dirty_bitmaps: BTreeSet<usize>,
    header_dirty: bool,
    /// Handed to a transaction since the last commit point: the disk may not have it yet.
    unsaved: bool,
    last_use: u64,
}

#[derive(Debug, Clone, Copy)]
struct Reservation {
    start: u64,
    len: u64,
    window: u64,
}

#[derive(Debug)]
pub struct Allocator {
    dev: SharedDevice,
    group_start: u64,
    group_blocks: u64,
    bitmap_blocks: usize,
    groups: Vec<Group>,
    /// Bumped whenever another node may have changed groups ([`Self::invalidate`]).
    gen: u64,
    /// Sum of every group's `free`.
    total_free: u64,
    /// Indices of groups whose bitmap is loaded (the bitmap cache's index).
    loaded: Vec<usize>,
    /// The bitmap cache's budget, bytes.
    budget: usize,
    clock: u64,
    /// Bitmaps read from the device / evicted, since mount.
    loads: u64,
    evictions: u64,
    /// Bytes of bitmaps dropped since [`Self::take_released`].
    released: usize,
    /// Groups with changes not yet handed to a transaction (`take_dirty`).
    dirty: BTreeSet<usize>,
    /// Groups whose free count changed since the last [`Self::take_changed`].
    changed: BTreeSet<usize>,
    resv: HashMap<u64, Reservation>,
    /// Blocks freed by the running transaction: free on disk once it commits, but not
    /// reusable before that (see fs/txn.rs, commit point step 4).
    quarantine: Vec<(u64, u64)>,
    /// Commit points seen ([`Self::committed`]): each releases the quarantine.
    commit_points: u64,
    /// Reservation window each writing file has earned (doubles as it keeps growing).
    windows: HashMap<u64, u64>,
    /// Blocks held for writes in flight (in `resv`, not in `used`): not free, not yet used.
    held: u64,
    /// Format 7: marks groups of other nodes before using them (module docs); None before.
    gate: Option<std::sync::Arc<dyn GroupGate>>,
    /// Format 8: groups nobody owns are marked too (another node may claim one without the
    /// global lock: module docs, "Group claims").
    mark_unowned: bool,
    /// Groups of other nodes this node's mark is on (taken back by [`Self::take_marked`]).
    marked: BTreeSet<usize>,
    /// Groups this node's mark may still be on, though it does not use them under it (a
    /// mark whose CAW ended in doubt, one that could not be taken off): taken off with the
    /// others, never used without marking them again.
    unmark_later: BTreeSet<usize>,
}

fn get(words: &[u64], bit: u64) -> bool {
    words
        .get(usize::try_from(bit / 64).unwrap_or(usize::MAX))
        .is_some_and(|w| w & (1 << (bit % 64)) != 0)
}

fn set_range(words: &mut Vec<u64>, n_words: usize, start: u64, len: u64, on: bool) {
    if words.is_empty() {
        if !on {
            return;
        }
        words.resize(n_words, 0);
    }
    for b in start..start + len {
        let w = &mut words[usize::try_from(b / 64).unwrap_or(usize::MAX)];
        if on {
            *w |= 1 << (b % 64);
        } else {
            *w &= !(1 << (b % 64));
        }
    }
}

impl Bitmap {
    fn resv_word(&self, wi: usize) -> u64 {
        self.resv.get(wi).copied().unwrap_or(0)
    }

    fn busy(&self, bit: u64) -> bool {
        get(&self.used, bit) || get(&self.resv, bit)
    }

    fn has_reserved(&self) -> bool {
        self.resv.iter().any(|&w| w != 0)
    }

    /// The heap it holds, at most, as the allocator sizes it (fs/heap.rs): its box, its three
    /// word vectors by capacity, the B-tree of its changed blocks.
    fn charge(&self) -> usize {
        let words = |v: &Vec<u64>| heap::at_most(v.capacity() * 8);
        heap::at_most(std::mem::size_of::<Self>())
            + words(&self.used)
            + words(&self.resv)
            + words(&self.block_seq)
            + heap::btree::<usize, ()>(self.dirty_bitmaps.len())
    }

    /// First bit >= from that is neither used nor reserved, scanning whole words at a time.
    fn next_free(&self, from: u64, limit: u64) -> Option<u64> {
        let mut b = from;
        while b < limit {
            let wi = usize::try_from(b / 64).ok()?;
            let word = self.used[wi] | self.resv_word(wi);
            let masked = word | ((1u64 << (b % 64)) - 1);
            if masked == u64::MAX {
                b = (b / 64 + 1) * 64;
                continue;
            }
            let cand = (b / 64) * 64 + u64::from((!masked).trailing_zeros());
            return (cand < limit).then_some(cand);
        }
        None
    }

    fn run_len(&self, from: u64, limit: u64, max: u64) -> u64 {
        let mut n = 0;
        while from + n < limit && n < max && !self.busy(from + n) {
            n += 1;
        }
        n
    }

    /// Reserve or unreserve bits; the reserved bits' vector is freed when the last goes.
    fn set_resv(&mut self, bit: u64, len: u64, on: bool) {
        let n = self.used.len();
        set_range(&mut self.resv, n, bit, len, on);
        if !on && !self.resv.is_empty() && !self.has_reserved() {
            self.resv = Vec::new();
        }
    }
}

impl Allocator {
    /// The allocator of a mounted volume: every group header is read (one block each, for the
    /// free counts), no bitmap. `budget`: the bitmap cache's (`bitmap_cache=`, in bytes).
    pub fn new(dev: SharedDevice, sb: &Superblock, budget: usize) -> Result<Self> {
        let mut a = Self {
            dev,
            group_start: sb.group_start,
            group_blocks: sb.group_blocks,
            bitmap_blocks: usize::try_from(sb.bitmap_blocks).unwrap_or(usize::MAX),
            groups: Vec::with_capacity(usize::try_from(sb.group_count).unwrap_or(0)),
            gen: 0,
            total_free: 0,
            loaded: Vec::new(),
            budget,
            clock: 0,
            loads: 0,
            evictions: 0,
            released: 0,
            dirty: BTreeSet::new(),
            changed: BTreeSet::new(),
            resv: HashMap::new(),
            quarantine: Vec::new(),
            commit_points: 0,
            windows: HashMap::new(),
            held: 0,
            gate: None,
            mark_unowned: false,
            marked: BTreeSet::new(),
            unmark_later: BTreeSet::new(),
        };
        a.add_groups(sb.group_count)?;
        Ok(a)
    }

    /// Groups from the current count up to `count` are added, unowned, their free counts
    /// read from their headers: every group at mount, the new ones when the volume grew
    /// (`fs/grow.rs`). Fewer than now: nothing changes.
    pub fn add_groups(&mut self, count: u64) -> Result<()> {
        let have = self.groups.len() as u64;
        for free in self.read_free(have, count)? {
            self.total_free += free;
            self.groups.push(Group {
                class: GroupClass::Unowned,
                free,
                checked: 0,
                lvb_seen: None,
                bits: None,
            });
        }
        Ok(())
    }

    /// The free counts in the headers of groups `first .. end`, read by `HEADER_READERS`
    /// threads at once (one block per group, 1 GiB apart: the reads cannot be merged, but
    /// they can overlap).
    fn read_free(&self, first: u64, end: u64) -> Result<Vec<u64>> {
        const HEADER_READERS: u64 = 8;
        let count = end.saturating_sub(first);
        let threads = if count < 256 { 1 } else { HEADER_READERS };
        let per = count.div_ceil(threads);
        let chunk = |from: u64| -> Result<Vec<u64>> {
            let mut buf = AlignedBuf::new(FS_BLOCK_SIZE);
            (from..(from + per).min(end))
                .map(|g| self.read_header(g, &mut buf).map(|h| h.free_blocks))
                .collect()
        };
        let parts: Vec<Result<Vec<u64>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| s.spawn(move || chunk(first + t * per)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::new(ErrorKind::Io, "a group header reader panicked"))
                    })
                })
                .collect()
        });
        let mut out = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
        for p in parts {
            out.extend(p?);
        }
        Ok(out)
    }

    fn first_block(&self, g: u64) -> u64 {
        self.group_start + g * self.group_blocks
    }

    fn check_header(&self, g: u64, raw: &[u8]) -> Result<GroupHeader> {
        let first = self.first_block(g);
        let h = GroupHeader::decode(raw, first).map_err(|e| e.wrap(format!("group {g}")))?;
        if h.index != g
            || h.block_count != self.group_blocks
            || usize::try_from(h.bitmap_blocks).ok() != Some(self.bitmap_blocks)
        {
            bail!(
                Corrupted,
                "group {g}: header does not match the superblock; run fsck.cetra"
            );
        }
        Ok(h)
    }

    fn read_header(&self, g: u64, buf: &mut AlignedBuf) -> Result<GroupHeader> {
        self.dev.read_at(self.first_block(g) * FS_BLOCK, buf)?;
        self.check_header(g, &buf[..FS_BLOCK_SIZE])
    }

    /// Header and bitmap of group `g` in one read; the bitmap's zeros must match the header.
    fn read_group(&self, g: u64) -> Result<(GroupHeader, Bitmap)> {
        let first = self.first_block(g);
        let mut buf = AlignedBuf::new((1 + self.bitmap_blocks) * FS_BLOCK_SIZE);
        self.dev.read_at(first * FS_BLOCK, &mut buf)?;
        let h = self.check_header(g, &buf[..FS_BLOCK_SIZE])?;
        let mut used = Vec::with_capacity(self.bitmap_blocks * WORDS_PER_BITMAP_BLOCK);
        let mut seqs = Vec::with_capacity(self.bitmap_blocks);
        for i in 0..self.bitmap_blocks {
            let at = first + 1 + i as u64;
            let (seq, payload) =
                decode_bitmap(&buf[(i + 1) * FS_BLOCK_SIZE..(i + 2) * FS_BLOCK_SIZE], at)
                    .map_err(|e| e.wrap(format!("group {g}")))?;
            seqs.push(seq);
            for c in payload.chunks_exact(8) {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                used.push(u64::from_le_bytes(a));
            }
        }
        let zeros: u64 = (0..self.group_blocks).filter(|&b| !get(&used, b)).count() as u64;
        if zeros != h.free_blocks {
            return Err(Error::corrupted(format!(
                "group {g}: header says {} free blocks, bitmap has {zeros}; run fsck.cetra",
                h.free_blocks
            )));
        }
        let bm = Bitmap {
            header_seq: h.seq,
            used,
            resv: Vec::new(),
            block_seq: seqs,
            dirty_bitmaps: BTreeSet::new(),
            header_dirty: false,
            unsaved: false,
            last_use: 0,
        };
        Ok((h, bm))
    }

    fn set_free(&mut self, g: usize, free: u64) {
        let grp = &mut self.groups[g];
        self.total_free = self.total_free - grp.free + free;
        grp.free = free;
    }

    /// Drop group `g`'s bitmap; returns what it was charged.
    fn unload(&mut self, g: usize) -> usize {
        let Some(bm) = self.groups[g].bits.take() else {
            return 0;
        };
        if let Some(i) = self.loaded.iter().position(|&l| l == g) {
            self.loaded.swap_remove(i);
        }
        let bytes = bm.charge();
        self.released = self.released.saturating_add(bytes);
        bytes
    }

    /// The bitmap cache's charge now: every loaded bitmap and the index (module docs).
    fn charge(&self) -> usize {
        heap::at_most(self.loaded.capacity() * std::mem::size_of::<usize>())
            + self
                .loaded
                .iter()
                .filter_map(|&g| self.groups[g].bits.as_deref())
                .map(Bitmap::charge)
                .sum::<usize>()
    }

    /// Whether group `g`'s loaded bitmap must stay (module docs: pinned).
    fn pinned(&self, g: usize, bm: &Bitmap) -> bool {
        self.dirty.contains(&g) || bm.unsaved || bm.has_reserved()
    }

    /// Make group `g`'s free count exact (read its header if it was not checked since the
    /// lock's version last moved); a loaded bitmap that no longer matches is dropped.
    fn check(&mut self, g: usize) -> Result<()> {
        if self.groups[g].checked == self.gen {
            return Ok(());
        }
        let mut buf = AlignedBuf::new(FS_BLOCK_SIZE);
        let h = self.read_header(g as u64, &mut buf)?;
        if self.groups[g]
            .bits
            .as_ref()
            .is_some_and(|bm| bm.header_seq != h.seq)
        {
            self.unload(g);
        }
        self.set_header_free(g, h.free_blocks);
        self.groups[g].checked = self.gen;
        Ok(())
    }

    /// Group `g`'s free count as its header says now. If that is not the published count
    /// last seen, the value block moved since (or will: the changes are not published yet),
    /// so the next published count is taken whatever it is ([`Self::note_lvb`]): comparing
    /// it with the last one seen would miss a count that moved and came back between two
    /// reads of the records (an 8-block file made and removed by its owner), and statfs
    /// would keep the header's passing count until the group is used again.
    fn set_header_free(&mut self, g: usize, free: u64) {
        if self.groups[g].lvb_seen != Some(free) {
            self.groups[g].lvb_seen = None;
        }
        self.set_free(g, free);
    }

    /// Group `g`'s bitmap, current: checked at this generation and loaded. `Busy` if it is
    /// another node's group whose mark could not be had (module docs, "Group marks").
    fn load(&mut self, g: usize) -> Result<&mut Bitmap> {
        if !self.gated(g, true)? {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "allocation group {g} is being changed by the node that owns it; try again"
                ),
            ));
        }
        self.load_current(g)
    }

    /// [`Self::load`] without asking for a mark.
    fn load_current(&mut self, g: usize) -> Result<&mut Bitmap> {
        if self.groups[g].checked != self.gen && self.groups[g].bits.is_some() {
            self.check(g)?;
        }
        if self.groups[g].bits.is_none() {
            // Unchecked, or checked and evicted since: the disk holds what this node last
            // wrote (only clean, home bitmaps are evicted) or what another node wrote.
            let (h, bm) = self.read_group(g as u64)?;
            self.set_header_free(g, h.free_blocks);
            self.groups[g].checked = self.gen;
            self.loaded.push(g);
            self.loads += 1;
            self.groups[g].bits = Some(Box::new(bm));
            self.evict(Some(g));
        }
        self.clock += 1;
        let clock = self.clock;
        let bm = self.groups[g]
            .bits
            .as_deref_mut()
            .ok_or_else(|| Error::new(ErrorKind::Io, format!("group {g}: bitmap not loaded")))?;
        bm.last_use = clock;
        Ok(bm)
    }

    /// Drop least recently used bitmaps that can go until the cache's charge fits the budget.
    fn evict(&mut self, keep: Option<usize>) {
        let mut charge = self.charge();
        while charge > self.budget {
            let victim = self
                .loaded
                .iter()
                .copied()
                .filter(|&g| Some(g) != keep)
                .filter_map(|g| self.groups[g].bits.as_deref().map(|bm| (g, bm)))
                .filter(|&(g, bm)| !self.pinned(g, bm))
                .min_by_key(|(_, bm)| bm.last_use)
                .map(|(g, _)| g);
            let Some(g) = victim else { break };
            charge -= self.unload(g);
            self.evictions += 1;
        }
    }

    fn locate(&self, block: u64) -> Option<(usize, u64)> {
        let rel = block.checked_sub(self.group_start)?;
        let g = usize::try_from(rel / self.group_blocks).ok()?;
        (g < self.groups.len()).then_some((g, rel % self.group_blocks))
    }

    /// Free blocks of the volume, as exact as the module docs say, not counting those held
    /// for writes in flight.
    pub fn free_blocks(&self) -> u64 {
        self.total_free.saturating_sub(self.held)
    }

    pub fn total_blocks(&self) -> u64 {
        self.groups.len() as u64 * self.group_blocks
    }

    /// The bitmap cache's charge now (bytes), and how many groups are loaded.
    pub fn loaded(&self) -> (usize, usize) {
        (self.charge(), self.loaded.len())
    }

    /// What the bitmap cache holds and has done (module docs).
    pub fn bitmap_stats(&self) -> BitmapCacheStats {
        let pinned = self
            .loaded
            .iter()
            .filter_map(|&g| self.groups[g].bits.as_deref().map(|bm| (g, bm)))
            .filter(|&(g, bm)| self.pinned(g, bm))
            .map(|(_, bm)| bm.charge())
            .sum();
        BitmapCacheStats {
            groups: self.loaded.len(),
            bytes: self.charge(),
            pinned,
            budget: self.budget,
            loads: self.loads,
            evictions: self.evictions,
        }
    }

    /// Bytes of bitmaps dropped since the last call (the daemon hands such memory back to
    /// the OS).
    pub fn take_released(&mut self) -> usize {
        std::mem::take(&mut self.released)
    }

    /// Another node may have changed groups since this node last held the lock: every group is
    /// unchecked from now on (nothing is read here). Reservations are hints and are dropped;
    /// earned windows and group classes stay. A bitmap with changes no transaction took is
    /// dropped (the disk never got them).
    pub fn invalidate(&mut self) {
        debug_assert!(
            self.quarantine.is_empty(),
            "invalidate with uncommitted frees"
        );
        debug_assert_eq!(
            self.held, 0,
            "invalidate with blocks held for writes in flight"
        );
        let owners: Vec<u64> = self.resv.keys().copied().collect();
        for o in owners {
            self.drop_reservation(o);
        }
        self.gen += 1;
        for g in std::mem::take(&mut self.dirty) {
            self.unload(g);
        }
        let unsaved: Vec<usize> = self
            .loaded
            .iter()
            .copied()
            .filter(|&g| self.groups[g].bits.as_ref().is_some_and(|bm| bm.unsaved))
            .collect();
        for g in unsaved {
            self.unload(g);
        }
        self.changed.clear();
    }

    /// The group's LVB count as read from its lock record now: taken as its free count when it
    /// changed since this node last saw it (another node published a newer one) and the group
    /// was not checked at this generation.
    pub fn note_lvb(&mut self, g: u64, lvb: Option<u64>) {
        let Some(i) = usize::try_from(g).ok().filter(|&i| i < self.groups.len()) else {
            return;
        };
        if self.groups[i].lvb_seen == lvb {
            return;
        }
        self.groups[i].lvb_seen = lvb;
        if let Some(free) = lvb.filter(|&f| f <= self.group_blocks) {
            if self.groups[i].checked != self.gen {
                self.set_free(i, free);
            }
        }
    }

    /// Every group's LVB count as this node last saw it: what a read of the records made
    /// without the metadata mutex compares against (`note_lvb_unless_seen`).
    pub fn lvbs_seen(&self) -> Vec<Option<u64>> {
        self.groups.iter().map(|g| g.lvb_seen).collect()
    }

    /// [`Self::note_lvb`] for a count read while this node went on: unless the count it has
    /// seen for `g` is no longer `before` (the one when the read began). Then it saw a count
    /// at least as new since (another read, its own publishing, a header that disagreed),
    /// and the record read is not taken back over it.
    pub fn note_lvb_unless_seen(&mut self, g: u64, before: Option<u64>, lvb: Option<u64>) {
        let unchanged = usize::try_from(g)
            .ok()
            .and_then(|i| self.groups.get(i))
            .is_some_and(|grp| grp.lvb_seen == before);
        if unchanged {
            self.note_lvb(g, lvb);
        }
    }

    /// This node wrote `free` into group `g`'s LVB.
    pub fn note_published(&mut self, g: u64, free: u64) {
        if let Some(grp) = usize::try_from(g).ok().and_then(|i| self.groups.get_mut(i)) {
            grp.lvb_seen = Some(free);
        }
    }

    /// Groups whose free count this node changed since the last call, with their (exact)
    /// counts: what to publish in the LVBs at a handoff.
    pub fn take_changed(&mut self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.changed)
            .into_iter()
            .map(|g| (g as u64, self.groups[g].free))
            .collect()
    }

    /// Format 7: use `gate` for every group of another node (module docs, "Group marks");
    /// with `unowned_too` (format 8, "Group claims"), also for every group nobody owns.
    pub fn set_gate(&mut self, gate: std::sync::Arc<dyn GroupGate>, unowned_too: bool) {
        self.gate = Some(gate);
        self.mark_unowned = unowned_too;
    }

    /// May group `g` be used now? Yes unless it is another node's group on a volume with
    /// group marks and its mark could not be had. A new mark makes the group unchecked, so
    /// its header is read again before anything of it is used.
    fn gated(&mut self, g: usize, patient: bool) -> Result<bool> {
        if !self.needs_mark(g) {
            return Ok(true);
        }
        let Some(gate) = &self.gate else {
            return Ok(true);
        };
        match gate.mark(g as u64, patient) {
            Ok(true) => {}
            Ok(false) => return Ok(false),
            Err(e) => {
                // The CAW may have landed: take it off at the handoff.
                self.unmark_later.insert(g);
                return Err(e);
            }
        }
        self.marked.insert(g);
        self.forget_checked(g);
        Ok(true)
    }

    /// Must this node put its mark on group `g` before it uses it (format 7: another node's
    /// group, not marked yet)?
    fn needs_mark(&self, g: usize) -> bool {
        let class = self.groups[g].class;
        self.gate.is_some()
            && (class == GroupClass::Others || (self.mark_unowned && class == GroupClass::Unowned))
            && !self.marked.contains(&g)
    }

    /// Group `g` may have changed on disk without this node knowing: its next use reads its
    /// header, and a bitmap that no longer matches is dropped with the reservation windows
    /// in it (they may be taken meanwhile).
    fn forget_checked(&mut self, g: usize) {
        self.groups[g].checked = self.gen.wrapping_sub(1);
        let owners: Vec<u64> = self
            .resv
            .iter()
            .filter(|(_, r)| self.locate(r.start).is_some_and(|(rg, _)| rg == g))
            .map(|(&o, _)| o)
            .collect();
        for o in owners {
            self.drop_reservation(o);
        }
    }

    /// The groups of other nodes this node's mark is on, forgotten here (the caller takes the
    /// marks off once everything it changed there is home: the global lock's handoff). Their
    /// reservation windows go: their owners may fill them next.
    pub fn take_marked(&mut self) -> Vec<u64> {
        let mut marked = std::mem::take(&mut self.marked);
        for &g in &marked {
            self.forget_checked(g);
        }
        marked.append(&mut self.unmark_later);
        marked.into_iter().map(|g| g as u64).collect()
    }

    /// This node's mark may be on group `g` without this node using the group under it (a
    /// take-off that failed, perhaps after its CAW landed; a mark whose CAW ended in doubt):
    /// taken off by the next [`Self::take_marked`]. The group is marked again before any use.
    pub fn unmark_later(&mut self, g: u64) {
        if let Some(i) = usize::try_from(g).ok().filter(|&i| i < self.groups.len()) {
            self.unmark_later.insert(i);
        }
    }

    /// Is a take-off of this node's marks pending ([`Self::unmark_later`])?
    pub fn has_marks_to_take_off(&self) -> bool {
        !self.unmark_later.is_empty()
    }

    /// Format 7, without the global lock: take up to `want` blocks from group `g` alone, which
    /// this node owns and has marked (fs/txn.rs `refill_pool_marked`), in at most `max_runs`
    /// runs of at least `min` blocks where it can. The group's header is read first (another
    /// node may have changed the group under the global lock since). Nothing of this node may
    /// be held for writes in flight there. Returns the runs (marked used in the bitmap, dirty).
    pub fn alloc_in(
        &mut self,
        g: u64,
        want: u64,
        min: u64,
        max_runs: usize,
    ) -> Result<Vec<(u64, u64)>> {
        let gi = usize::try_from(g)
            .ok()
            .filter(|&i| i < self.groups.len())
            .ok_or_else(|| Error::new(ErrorKind::Range, format!("no allocation group {g}")))?;
        self.forget_checked(gi);
        self.check(gi)?;
        let mut runs = Vec::new();
        let r = self.alloc_in_runs(gi, want, min, max_runs, &mut runs);
        if let Err(e) = r {
            // Nothing of it was handed to a transaction: undo it (the bitmap is loaded).
            for (s, l) in runs {
                if let Some((g, bit)) = self.locate(s) {
                    let _ = self.mark(g, bit, l, false);
                }
            }
            return Err(e);
        }
        Ok(runs)
    }

    fn alloc_in_runs(
        &mut self,
        gi: usize,
        want: u64,
        min: u64,
        max_runs: usize,
        runs: &mut Vec<(u64, u64)>,
    ) -> Result<()> {
        let first = self.first_block(gi as u64);
        let limit = self.group_blocks;
        let mut need = want;
        for min in [min.max(1), 1] {
            let mut from = 0;
            while need > 0 && runs.len() < max_runs {
                let bm = self.load(gi)?;
                let Some(b) = bm.next_free(from, limit) else {
                    break;
                };
                let len = bm.run_len(b, limit, need);
                from = b + len;
                if len < min {
                    continue;
                }
                self.mark(gi, b, len, true)?;
                runs.push((first + b, len));
                need -= len;
            }
            if need == 0 {
                break;
            }
        }
        Ok(())
    }

    pub fn set_class(&mut self, g: u64, class: GroupClass) {
        if let Some(grp) = usize::try_from(g).ok().and_then(|i| self.groups.get_mut(i)) {
            grp.class = class;
        }
    }

    pub fn class(&self, g: u64) -> Option<GroupClass> {
        usize::try_from(g)
            .ok()
            .and_then(|i| self.groups.get(i))
            .map(|grp| grp.class)
    }

    /// Free blocks of one group, as known (for choosing groups; see the module docs).
    pub fn group_free(&self, g: u64) -> Option<u64> {
        usize::try_from(g)
            .ok()
            .and_then(|i| self.groups.get(i))
            .map(|grp| grp.free)
    }

    /// Free blocks of one group, exact (its header is read if it was not checked since the
    /// lock's version moved): what a node publishes when it gives a group back.
    pub fn exact_free(&mut self, g: u64) -> Result<u64> {
        let i = usize::try_from(g)
            .ok()
            .filter(|&i| i < self.groups.len())
            .ok_or_else(|| Error::new(ErrorKind::Range, format!("no allocation group {g}")))?;
        self.check(i)?;
        Ok(self.groups[i].free)
    }

    /// The groups of `class` (as this node knows them).
    pub fn of_class(&self, class: GroupClass) -> Vec<u64> {
        (0u64..)
            .zip(&self.groups)
            .filter(|(_, g)| g.class == class)
            .map(|(i, _)| i)
            .collect()
    }

    /// The groups of `class` (as this node knows them) with free blocks, the most free first.
    pub fn by_free(&self, class: GroupClass) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = (0u64..)
            .zip(&self.groups)
            .filter(|(_, g)| g.class == class && g.free > 0)
            .map(|(i, g)| (i, g.free))
            .collect();
        v.sort_by_key(|&(_, free)| std::cmp::Reverse(free));
        v
    }

    /// Free blocks in the groups this node owns.
    pub fn free_in_mine(&self) -> u64 {
        self.groups
            .iter()
            .filter(|g| g.class == GroupClass::Mine)
            .map(|g| g.free)
            .sum()
    }

    /// Is `block` allocated? (Loads its group's bitmap.) A block outside the group area is not.
    ///
    /// Format 7, another node's group: never under a mark (this runs under a shared hold of
    /// the global lock too, which takes no marks). A used bit is believed (its owner's refills
    /// only ever set bits, and every free there needs the global lock, whose moves make this
    /// node check the group again), so looking up an inode there costs no I/O; a clear bit is
    /// read again from the disk (a refill may have set it since; a torn read is retried).
    pub fn is_used(&mut self, block: u64) -> Result<bool> {
        let Some((g, bit)) = self.locate(block) else {
            return Ok(false);
        };
        if !self.needs_mark(g) {
            return Ok(get(&self.load(g)?.used, bit));
        }
        match self.load_current(g) {
            Ok(bm) if get(&bm.used, bit) => return Ok(true),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::Corrupted => {}
            Err(e) => return Err(e),
        }
        // Clear, or torn: read the group again (a torn read is retried: the owner's home
        // writes of a refill take a moment).
        let mut tries = 0;
        loop {
            self.forget_checked(g);
            match self.load_current(g) {
                Ok(bm) => return Ok(get(&bm.used, bit)),
                Err(e) if e.kind() == ErrorKind::Corrupted && tries < 40 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn all_checked(&self) -> bool {
        self.groups.iter().all(|g| g.checked == self.gen)
    }

    /// Make every free count exact (one header read per unchecked group).
    fn check_all(&mut self) -> Result<()> {
        for g in 0..self.groups.len() {
            self.check(g)?;
        }
        Ok(())
    }

    fn mark(&mut self, g: usize, bit: u64, len: u64, used: bool) -> Result<()> {
        let bm = self.load(g)?;
        set_range(&mut bm.used, 0, bit, len, used);
        let per = BITS_PER_BITMAP_BLOCK;
        for blk in bit / per..=(bit + len - 1) / per {
            bm.dirty_bitmaps
                .insert(usize::try_from(blk).unwrap_or(usize::MAX));
        }
        bm.header_dirty = true;
        let free = self.groups[g].free;
        self.set_free(g, if used { free - len } else { free + len });
        self.dirty.insert(g);
        self.changed.insert(g);
        Ok(())
    }

    /// Allocate exactly `want` blocks for `owner` (0 = metadata, no reservation), as close to
    /// `goal` as possible, as few runs as possible. All or nothing. Before answering
    /// `NoSpace`, every group not checked since the lock's version moved is checked and the
    /// allocation tried once more.
    pub fn alloc(&mut self, goal: u64, want: u64, owner: u64) -> Result<Vec<(u64, u64)>> {
        match self.alloc_once(goal, want, owner) {
            Err(e) if e.kind() == ErrorKind::NoSpace && !self.all_checked() => {
                self.check_all()?;
                self.alloc_once(goal, want, owner)
            }
            r => r,
        }
    }

    fn alloc_once(&mut self, goal: u64, want: u64, owner: u64) -> Result<Vec<(u64, u64)>> {
        if want == 0 {
            return Ok(Vec::new());
        }
        if self.free_blocks() < want {
            return Err(self.no_space(want));
        }
        let mut runs = Vec::new();
        let r = self.alloc_runs(goal, want, owner, &mut runs);
        if let Err(e) = r {
            // Roll back: these were never committed, so no quarantine. Their groups are
            // loaded and dirty, so this reads nothing.
            for (s, l) in runs {
                if let Some((g, bit)) = self.locate(s) {
                    let _ = self.mark(g, bit, l, false);
                }
            }
            return Err(e);
        }
        // 3. Reserve the next window for the file (a hint: a failure to read only costs it).
        let goal = runs.last().map_or(goal, |(s, l)| s + l);
        if owner != 0 && !self.resv.contains_key(&owner) {
            let window = self.windows.get(&owner).copied().unwrap_or(MIN_WINDOW);
            let next = (window * 2)
                .min(MAX_WINDOW)
                .max(want.next_power_of_two().min(MAX_WINDOW));
            self.windows.insert(owner, next);
            let _ = self.reserve_next(owner, goal, want, next);
        }
        Ok(runs)
    }

    /// Allocate as [`Allocator::alloc`] does, but hold the runs in memory only, for a write in
    /// flight: they stay free in every bitmap image a transaction writes (and on disk) until
    /// [`Allocator::commit_reserved`], and nothing else allocates them meanwhile.
    pub fn reserve(&mut self, goal: u64, want: u64, owner: u64) -> Result<Vec<(u64, u64)>> {
        let runs = self.alloc(goal, want, owner)?;
        for &(start, len) in &runs {
            if let Some((g, bit)) = self.locate(start) {
                // Back from used to reserved: the bitmap blocks `alloc` marked dirty are then
                // written unchanged, which is harmless. The group was just loaded and is dirty.
                if let Some(bm) = self.groups[g].bits.as_deref_mut() {
                    set_range(&mut bm.used, 0, bit, len, false);
                    bm.set_resv(bit, len, true);
                }
                let free = self.groups[g].free;
                self.set_free(g, free + len);
            }
        }
        self.held += want;
        Ok(runs)
    }

    /// A run held by [`Allocator::reserve`] is mapped now: mark it used (its bitmap block and
    /// group header go into the transaction that maps it). The held run pins its group's
    /// bitmap, so this reads nothing.
    pub fn commit_reserved(&mut self, start: u64, len: u64) {
        self.release_held(start, len);
        if let Some((g, bit)) = self.locate(start) {
            debug_assert!(self.groups[g].bits.is_some() && self.groups[g].checked == self.gen);
            if let Err(e) = self.mark(g, bit, len, true) {
                tracing::error!("marking held run {start}+{len} used failed: {e}");
            }
        }
    }

    /// A run held by [`Allocator::reserve`] is not needed after all (the write failed).
    pub fn unreserve(&mut self, start: u64, len: u64) {
        self.release_held(start, len);
    }

    fn release_held(&mut self, start: u64, len: u64) {
        if let Some((g, bit)) = self.locate(start) {
            if let Some(bm) = self.groups[g].bits.as_deref_mut() {
                debug_assert!(
                    (bit..bit + len).all(|b| get(&bm.resv, b) && !get(&bm.used, b)),
                    "run {start}+{len} is not held"
                );
                bm.set_resv(bit, len, false);
            }
            self.held -= len;
        }
    }

    /// Blocks held for writes in flight.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// Steps 1 and 2 of an allocation, pushing each run taken onto `runs`.
    fn alloc_runs(
        &mut self,
        goal: u64,
        want: u64,
        owner: u64,
        runs: &mut Vec<(u64, u64)>,
    ) -> Result<()> {
        let mut need = want;
        let mut goal = goal;
        // The window the file has earned so far; it outlives each reservation.
        let window = if owner == 0 {
            0
        } else {
            self.windows.get(&owner).copied().unwrap_or(MIN_WINDOW)
        };
        // 1. The owner's reservation: where the file's data should continue, even if the
        //    block right after its last extent is taken.
        if let Some(r) = self.resv.get(&owner).copied() {
            let take = need.min(r.len);
            self.take_reserved(r.start, take)?;
            runs.push((r.start, take));
            need -= take;
            goal = r.start + take;
            if r.len == take {
                self.resv.remove(&owner);
            } else {
                self.resv.insert(
                    owner,
                    Reservation {
                        start: r.start + take,
                        len: r.len - take,
                        window: r.window,
                    },
                );
            }
        }
        // 2. Free runs from the goal on. A growing file skips gaps smaller than what it asks
        //    for (up to its window), so it does not shred itself over fragmented space; if
        //    only other files' reservations stand in the way, they are dropped and we retry.
        let min_run = need.min(window).max(1);
        for attempt in 0..3 {
            while need > 0 {
                let min = if attempt == 0 { min_run.min(need) } else { 1 };
                let Some((start, len)) = self.find_run(goal, need, min)? else {
                    break;
                };
                let take = len.min(need);
                self.mark_used(start, take)?;
                runs.push((start, take));
                need -= take;
                goal = start + take;
            }
            if need == 0 {
                return Ok(());
            }
            if attempt == 1 {
                let owners: Vec<u64> = self.resv.keys().copied().collect();
                for o in owners {
                    self.drop_reservation(o);
                }
            }
        }
        Err(self.no_space(want))
    }

    /// `ENOSPC` for an allocation of `want` blocks; typed ([`Error::frees_wait`]) when blocks
    /// freed since the last commit point wait for the next, which would make them usable.
    fn no_space(&self, want: u64) -> Error {
        let waiting: u64 = self.quarantine.iter().map(|r| r.1).sum();
        let context = format!(
            "no space left on the volume: {want} blocks asked, {} free, {waiting} of them \
             freed since the last commit point",
            self.free_blocks()
        );
        if waiting == 0 {
            Error::new(ErrorKind::NoSpace, context)
        } else {
            Error::no_space_until_commit(context, self.commit_points)
        }
    }

    /// Commit points seen ([`Self::committed`]) since mount.
    pub fn commit_points(&self) -> u64 {
        self.commit_points
    }

    /// Reserve `next` blocks for `owner`: right after its allocation (`goal`) if free, else
    /// the next free run of that size.
    fn reserve_next(&mut self, owner: u64, goal: u64, want: u64, next: u64) -> Result<()> {
        let limit = self.group_blocks;
        // A hint: another node's group is used only if its mark comes at once.
        let here = match self.locate(goal) {
            Some((g, bit)) if self.gated(g, false)? => self.load(g)?.run_len(bit, limit, next),
            _ => 0,
        };
        let spot = if here > 0 {
            Some((goal, here))
        } else {
            self.find_run(goal, next, next.min(want.max(MIN_WINDOW)))?
        };
        let Some((start, len)) = spot else {
            return Ok(());
        };
        let Some((g, bit)) = self.locate(start) else {
            return Ok(());
        };
        let bm = self.load(g)?;
        let len = len.min(bm.run_len(bit, limit, next));
        if len > 0 {
            bm.set_resv(bit, len, true);
            self.resv.insert(
                owner,
                Reservation {
                    start,
                    len,
                    window: next,
                },
            );
        }
        Ok(())
    }

    /// The first free run of at least `min` blocks starting at or after `goal`, wrapping
    /// around the groups once; at most `want` long. Mine first, then unowned, then others.
    fn find_run(&mut self, goal: u64, want: u64, min: u64) -> Result<Option<(u64, u64)>> {
        for class in [GroupClass::Mine, GroupClass::Unowned, GroupClass::Others] {
            if let Some(r) = self.find_run_in(class, goal, want, min)? {
                return Ok(Some(r));
            }
        }
        Ok(None)
    }

    fn find_run_in(
        &mut self,
        class: GroupClass,
        goal: u64,
        want: u64,
        min: u64,
    ) -> Result<Option<(u64, u64)>> {
        let (g0, bit0) = self.locate(goal).unwrap_or((0, 0));
        let n = self.groups.len();
        let limit = self.group_blocks;
        for i in 0..=n {
            let g = (g0 + i) % n;
            if self.groups[g].free < min
                || self.groups[g].class != class
                || !self.gated(g, false)?
            {
                continue;
            }
            let first = self.first_block(g as u64);
            let bm = self.load(g)?;
            let mut from = if i == 0 { bit0 } else { 0 };
            while let Some(b) = bm.next_free(from, limit) {
                let len = bm.run_len(b, limit, want.max(min));
                if len >= min {
                    return Ok(Some((first + b, len.min(want))));
                }
                from = b + len;
            }
        }
        Ok(None)
    }

    fn take_reserved(&mut self, start: u64, len: u64) -> Result<()> {
        if let Some((g, bit)) = self.locate(start) {
            self.load(g)?.set_resv(bit, len, false);
            self.mark(g, bit, len, true)?;
        }
        Ok(())
    }

    fn mark_used(&mut self, start: u64, len: u64) -> Result<()> {
        if let Some((g, bit)) = self.locate(start) {
            self.mark(g, bit, len, true)?;
        }
        Ok(())
    }

    /// Free a run (it must lie in one group, as every extent and allocation does; its bitmap
    /// is loaded if it is not). The run shows as free in the bitmap at once but is quarantined
    /// until [`Self::committed`]. An error (reading the group) changes nothing.
    /// Load the bitmap of the group holding `start` (a run never spans groups), so that a
    /// following [`free`](Self::free) of blocks there does not read. Callers that free several
    /// runs call this for all of them first: a read that fails then fails the operation
    /// before anything is freed, instead of half-way (the blocks freed so far would be
    /// committed while the inode on disk still maps them).
    pub fn prepare_free(&mut self, start: u64) -> Result<()> {
        if let Some((g, _)) = self.locate(start) {
            self.load(g)?;
        }
        Ok(())
    }

    /// [`Self::prepare_free`] that waits for another node's mark a moment only: Some(group)
    /// if the mark stayed (nothing loaded; the caller waits for it elsewhere), None once the
    /// bitmap is loaded.
    pub fn prepare_free_briefly(&mut self, start: u64) -> Result<Option<u64>> {
        if let Some((g, _)) = self.locate(start) {
            if !self.gated(g, false)? {
                return Ok(Some(g as u64));
            }
            self.load(g)?;
        }
        Ok(None)
    }

    /// [`Self::prepare_free`] for a free that may as well wait (giving back spare pool runs):
    /// on format 7, `Busy` at once if another node's mark is on the group, instead of waiting
    /// for it.
    pub fn prepare_free_now(&mut self, start: u64) -> Result<()> {
        if let Some((g, _)) = self.locate(start) {
            if !self.gated(g, false)? {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!("allocation group {g} is being changed by the node that owns it"),
                ));
            }
            self.load(g)?;
        }
        Ok(())
    }

    pub fn free(&mut self, start: u64, len: u64) -> Result<()> {
        self.free_run(start, len, true)
    }

    /// Free a run whose contents nothing durable needs, for reuse at once: a run of this
    /// node's block pool (fs/pool.rs: pool runs are unwritten extents of an orphan, and a run
    /// a file gave back reaches the pool's free runs only once that free is durable), or a
    /// run taken in the running transaction. No quarantine: a crash before the next commit
    /// point leaves the run where it was on disk (in the pool, or free), and whatever was
    /// written into it meanwhile belongs to nothing durable. Quarantining these would make
    /// every pool compaction hold its runs back until the commit point, and a node whose
    /// pool is compacted and refilled often could run out of space that is free (measured:
    /// `ENOSPC` with 3.2 GiB of 3.5 free, all waiting for the commit point).
    pub fn free_unused(&mut self, start: u64, len: u64) -> Result<()> {
        self.free_run(start, len, false)
    }

    fn free_run(&mut self, start: u64, len: u64, quarantine: bool) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if let Some((g, bit)) = self.locate(start) {
            let bm = self.load(g)?;
            debug_assert!(
                (bit..bit + len).all(|b| get(&bm.used, b)),
                "double free at {start}+{len}"
            );
            if quarantine {
                bm.set_resv(bit, len, true);
            }
            self.mark(g, bit, len, false)?;
            if quarantine {
                self.quarantine.push((start, len));
            }
        }
        Ok(())
    }

    /// A commit point made the running transaction durable and wrote it home: quarantined
    /// runs may be reused, and every bitmap it carried is home (evictable again). Returns the
    /// runs released: their frees are durable now (what fs/discard.rs queues).
    pub fn committed(&mut self) -> Vec<(u64, u64)> {
        self.commit_points += 1;
        let released = std::mem::take(&mut self.quarantine);
        for &(start, len) in &released {
            if let Some((g, bit)) = self.locate(start) {
                if let Some(bm) = self.groups[g].bits.as_deref_mut() {
                    bm.set_resv(bit, len, false);
                }
            }
        }
        for &g in &self.loaded {
            if let Some(bm) = self.groups[g].bits.as_deref_mut() {
                bm.unsaved = false;
            }
        }
        self.evict(None);
        released
    }

    /// The parts of the run `start`+`len` that nothing claims: free in the
    /// bitmap and not reserved (no write in flight, reservation window or quarantined free of
    /// this node holds them). Under the global lock, exclusive, no other node holds bitmap
    /// blocks either (fs/inflight.rs), so these blocks hold no data anyone can read: what
    /// fs/discard.rs may discard. Loads the group's bitmap.
    pub fn unclaimed(&mut self, start: u64, len: u64) -> Result<Vec<(u64, u64)>> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        let end = start.saturating_add(len);
        let mut at = start;
        // A run may cross from one group into the next (the discard queue merges neighbours).
        while at < end {
            let Some((g, bit)) = self.locate(at) else {
                break;
            };
            let n = (end - at).min(self.group_blocks - bit);
            if self.needs_mark(g)
                && (self.groups[g].class == GroupClass::Others || !self.gated(g, false)?)
            {
                // Format 7, another node's group: left to its owner's discards and trims (a
                // mark held for a discard would keep the owner from refilling from it).
                // Format 8, a group nobody owns: trimmed under this node's mark only, so
                // that nobody claims it and fills it meanwhile.
                at += n;
                continue;
            }
            let bm = self.load(g)?;
            for b in bit..bit + n {
                if get(&bm.used, b) || get(&bm.resv, b) {
                    continue;
                }
                let block = at + (b - bit);
                match out.last_mut() {
                    Some((s, l)) if *s + *l == block => *l += 1,
                    _ => out.push((block, 1)),
                }
            }
            at += n;
        }
        Ok(out)
    }

    pub fn has_quarantine(&self) -> bool {
        !self.quarantine.is_empty()
    }

    /// The file was closed: forget its reservation and its earned window.
    pub fn forget_owner(&mut self, owner: u64) {
        self.drop_reservation(owner);
        self.windows.remove(&owner);
    }

    pub fn drop_reservation(&mut self, owner: u64) {
        if let Some(r) = self.resv.remove(&owner) {
            if let Some((g, bit)) = self.locate(r.start) {
                if let Some(bm) = self.groups[g].bits.as_deref_mut() {
                    bm.set_resv(bit, r.len, false);
                }
            }
        }
    }

    /// Encoded dirty bitmap blocks and group headers, with their sequence numbers bumped (the
    /// header's on every change: it is the group's change counter).
    pub fn take_dirty(&mut self) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        for gi in std::mem::take(&mut self.dirty) {
            let first = self.first_block(gi as u64);
            let free = self.groups[gi].free;
            let Some(bm) = self.groups[gi].bits.as_deref_mut() else {
                continue;
            };
            for bi in std::mem::take(&mut bm.dirty_bitmaps) {
                bm.block_seq[bi] += 1;
                let words =
                    &bm.used[bi * WORDS_PER_BITMAP_BLOCK..(bi + 1) * WORDS_PER_BITMAP_BLOCK];
                let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                let at = first + 1 + bi as u64;
                out.push((at, encode_bitmap(at, bm.block_seq[bi], &bytes)));
            }
            if std::mem::take(&mut bm.header_dirty) {
                bm.header_seq += 1;
                let h = GroupHeader {
                    seq: bm.header_seq,
                    index: gi as u64,
                    first_block: first,
                    block_count: self.group_blocks,
                    free_blocks: free,
                    bitmap_blocks: u32::try_from(bm.block_seq.len()).unwrap_or(u32::MAX),
                };
                out.push((first, h.encode()));
            }
            bm.unsaved = true;
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dev::{mem::MemDevice, BlockDevice};
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use proptest::prelude::*;

    /// Bytes read from the memory LUN so far (to see what the allocator loads).
    trait Reads {
        fn reads(&self) -> u64;
    }

    impl Reads for MemDevice {
        fn reads(&self) -> u64 {
            self.read_bytes.load(Ordering::Relaxed)
        }
    }

    /// A formatted memory volume of `mib` MiB in groups of `group_mib` MiB.
    fn volume(mib: u64, group_mib: Option<u64>) -> (Arc<MemDevice>, Superblock) {
        let dev = Arc::new(MemDevice::new(mib << 20, 512));
        let opts = crate::mkfs::MkfsOptions {
            max_nodes: 2,
            journal_bytes: 1 << 20,
            group_bytes: group_mib.map(|m| m << 20),
            ..Default::default()
        };
        let sb = crate::mkfs::format(&*dev, &opts, &mut |_, _| {}).unwrap();
        (dev, sb)
    }

    fn setup() -> (Superblock, Allocator) {
        let (dev, sb) = volume(512, None);
        let a = load(&(dev as SharedDevice), &sb);
        (sb, a)
    }

    pub(crate) fn load(dev: &SharedDevice, sb: &Superblock) -> Allocator {
        Allocator::new(dev.clone(), sb, DEFAULT_BITMAP_CACHE).unwrap()
    }

    /// What a commit point does with the allocator's blocks: write them home.
    fn commit(dev: &dyn BlockDevice, a: &mut Allocator) {
        for (b, data) in a.take_dirty() {
            dev.write_at(b * FS_BLOCK, &data).unwrap();
        }
        a.committed();
    }

    fn group_of(sb: &Superblock, block: u64) -> usize {
        usize::try_from((block - sb.group_start) / sb.group_blocks).unwrap()
    }

    #[test]
    fn a_free_waits_for_the_commit_point_and_a_free_of_unused_blocks_does_not() {
        let (dev, sb) = volume(64, Some(16));
        let shared: SharedDevice = dev.clone();
        let mut a = load(&shared, &sb);
        let all = a.free_blocks();
        let mut runs = a.alloc(sb.group_start, all, 0).unwrap();
        commit(&*dev, &mut a);
        let (s, l) = runs.pop().unwrap();
        // A file's blocks: its free is not durable before the commit point.
        a.free(s, l).unwrap();
        let e = a.alloc(sb.group_start, 1, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert!(
            e.to_string().contains(&format!("{l} of them freed since")),
            "{e}"
        );
        commit(&*dev, &mut a);
        assert_eq!(a.alloc(s, l, 0).unwrap(), vec![(s, l)]);
        // Blocks nothing durable needs (a pool's unwritten run): reusable at once.
        a.free_unused(s, l).unwrap();
        assert_eq!(a.alloc(s, l, 0).unwrap(), vec![(s, l)]);
    }

    #[test]
    fn sequential_file_is_contiguous() {
        let (sb, mut a) = setup();
        let mut goal = sb.group_start;
        let mut runs = Vec::new();
        for _ in 0..100 {
            let r = a.alloc(goal, 256, 42).unwrap();
            goal = r.last().map(|(s, l)| s + l).unwrap();
            runs.extend(r);
        }
        // Merge adjacent runs as the extent map would.
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for (s, l) in runs {
            match merged.last_mut() {
                Some((ps, pl)) if *ps + *pl == s => *pl += l,
                _ => merged.push((s, l)),
            }
        }
        // One run per group crossed: only group headers/bitmaps split the file.
        let groups_spanned = 25_600 / (sb.group_blocks - 1 - u64::from(sb.bitmap_blocks)) + 2;
        assert!(merged.len() as u64 <= groups_spanned, "{merged:?}");
    }

    #[test]
    fn two_growing_files_do_not_interleave() {
        let (sb, mut a) = setup();
        // Two files written 1 MiB at a time, alternating, 64 MiB each.
        let mut goals = [sb.group_start, sb.group_start];
        let mut runs: [Vec<(u64, u64)>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..64 {
            for f in 0..2 {
                let r = a.alloc(goals[f], 256, 10 + f as u64).unwrap();
                goals[f] = r.last().map(|(s, l)| s + l).unwrap();
                runs[f].extend(r);
            }
        }
        for (f, r) in runs.iter().enumerate() {
            let extents = 1 + r.windows(2).filter(|w| w[0].0 + w[0].1 != w[1].0).count();
            // Windows double (1, 2, 4, ... MiB) and groups are 32 MiB here.
            assert!(extents <= 12, "file {f}: {extents} extents: {r:?}");
        }
    }

    #[test]
    fn mount_reads_headers_only_and_bitmaps_load_on_demand() {
        let (dev, sb) = volume(1024, Some(16));
        let shared: SharedDevice = dev.clone();
        let before = dev.reads();
        let mut a = load(&shared, &sb);
        // One header block per group, no bitmap.
        assert_eq!(dev.reads() - before, sb.group_count * FS_BLOCK);
        assert_eq!(a.loaded().1, 0);
        let full = a.free_blocks();
        // One allocation loads one group.
        let r = a.alloc(sb.group_start, 8, 0).unwrap();
        assert_eq!(a.loaded().1, 1);
        assert_eq!(a.free_blocks(), full - 8);
        // is_used of a block in another group loads that group (and only it).
        let far = sb.group_first_block(sb.group_count - 1) + 100;
        assert!(!a.is_used(far).unwrap());
        assert_eq!(a.loaded().1, 2);
        assert!(a.is_used(r[0].0).unwrap());
        // Using a loaded, current group reads nothing.
        let reads = dev.reads();
        assert!(a.is_used(r[0].0 + 7).unwrap());
        a.free(r[0].0, 8).unwrap();
        assert_eq!(dev.reads(), reads);
    }

    #[test]
    fn loaded_bitmaps_stay_within_the_budget_once_home() {
        let (dev, sb) = volume(1024, Some(16));
        let shared: SharedDevice = dev.clone();
        let mut a = Allocator::new(shared, &sb, 0).unwrap();
        // One block in every group: every group is loaded and dirty, so none can go.
        let mut got = Vec::new();
        for g in 0..sb.group_count {
            got.extend(a.alloc(sb.group_first_block(g) + 50, 1, 0).unwrap());
        }
        assert_eq!(a.loaded().1 as u64, sb.group_count);
        // Taken by a transaction but not home yet: still none can go.
        let blocks = a.take_dirty();
        assert_eq!(a.loaded().1 as u64, sb.group_count);
        for (b, data) in blocks {
            dev.write_at(b * FS_BLOCK, &data).unwrap();
        }
        a.committed();
        assert_eq!(a.loaded().1, 0, "budget 0: every home bitmap goes");
        assert_eq!(a.loaded().0, a.bitmap_stats().bytes);
        assert!(
            a.loaded().0
                <= heap::at_most(usize::try_from(sb.group_count).unwrap().next_power_of_two() * 8),
            "only the index is left"
        );
        // Evicted groups come back from disk with what this node wrote.
        for (b, _) in &got {
            assert!(a.is_used(*b).unwrap());
        }
        assert_eq!(
            a.free_blocks(),
            (0..sb.group_count)
                .map(|g| a.group_free(g).unwrap())
                .sum::<u64>()
        );
        // A reservation pins its group.
        let r = a.alloc(sb.group_first_block(3) + 200, 4, 77).unwrap();
        commit(&*dev, &mut a);
        assert_eq!(a.loaded().1, 1);
        a.forget_owner(77);
        a.committed();
        assert_eq!(a.loaded().1, 0);
        assert!(a.is_used(r[0].0).unwrap());
    }

    /// Bytes this thread holds allocated now (the core test binary's counting allocator).
    fn held_here() -> usize {
        usize::try_from(crate::fs::heap::tests::allocated_here()).unwrap_or(0)
    }

    /// Within 10 % below the charge, never above it.
    fn assert_covered(real: usize, charged: usize, what: &str) {
        assert!(
            real <= charged && real >= charged * 9 / 10,
            "{what}: {real} bytes allocated, {charged} charged"
        );
    }

    /// The bitmap cache is charged what its bitmaps and index really hold in the heap (small
    /// groups, where per-allocation overhead matters, and default-sized ones), with reserved
    /// bits and with changes taken by a transaction; the reserved bits are freed once unheld.
    #[test]
    fn the_bitmap_cache_is_charged_what_it_holds() {
        for group_mib in [Some(16), None] {
            let (dev, sb) = volume(1024, group_mib);
            let shared: SharedDevice = dev.clone();
            let mut a = load(&shared, &sb);
            let base = held_here();
            for g in 0..sb.group_count {
                assert!(!a.is_used(sb.group_first_block(g) + 50).unwrap());
            }
            let (charged, n) = a.loaded();
            assert_eq!(n as u64, sb.group_count);
            assert_covered(held_here() - base, charged, "loaded");
            // Blocks held for a write in flight (reserved bits), and changes written home.
            let held = a.reserve(sb.group_first_block(2) + 100, 8, 0).unwrap()[0];
            a.alloc(sb.group_first_block(3) + 100, 8, 0).unwrap();
            commit(&*dev, &mut a);
            a.take_changed();
            let (charged_resv, _) = a.loaded();
            assert!(charged_resv > charged, "the reserved bits are charged");
            assert_covered(held_here() - base, charged_resv, "reserved");
            let s = a.bitmap_stats();
            assert!(s.pinned > 0 && s.pinned < s.bytes, "{s:?}");
            a.unreserve(held.0, held.1);
            assert_eq!(
                a.loaded().0,
                charged,
                "the reserved bits are freed with the last"
            );
            assert_covered(held_here() - base, charged, "unreserved");
            assert_eq!(a.bitmap_stats().pinned, 0);
        }
    }

    /// With a budget of a few bitmaps, loading every group keeps the charge under it (evicting
    /// the least recently used), the memory really goes, and evicted groups come back intact.
    #[test]
    fn the_bitmap_cache_stays_within_its_budget() {
        let (dev, sb) = volume(1024, Some(16));
        let shared: SharedDevice = dev.clone();
        let one = {
            let mut a = load(&shared, &sb);
            a.is_used(sb.group_first_block(0) + 50).unwrap();
            a.loaded().0
        };
        let budget = 3 * one + one / 2;
        let mut a = Allocator::new(shared.clone(), &sb, budget).unwrap();
        let used = a.alloc(sb.group_first_block(5) + 10, 4, 0).unwrap();
        commit(&*dev, &mut a);
        let base = held_here();
        for round in 0..2 {
            for g in 0..sb.group_count {
                assert!(!a.is_used(sb.group_first_block(g) + 50).unwrap());
                let (charge, n) = a.loaded();
                assert!(charge <= budget, "group {g}: {charge} charged of {budget}");
                assert!(n <= 3, "group {g}: {n} loaded");
                // What the cache holds in the heap stays within it: evicting frees.
                let real = held_here().saturating_sub(base);
                assert!(
                    real <= budget,
                    "round {round}, group {g}: {real} bytes held"
                );
            }
        }
        let s = a.bitmap_stats();
        assert_eq!(s.loads, 1 + 2 * sb.group_count, "{s:?}");
        assert_eq!(s.evictions, s.loads - s.groups as u64, "{s:?}");
        assert_eq!(s.budget, budget);
        assert!(a.take_released() >= usize::try_from(s.evictions).unwrap() * one / 2);
        // The least recently used went: the last three groups are loaded, and an evicted group
        // comes back from the disk with what this node wrote.
        let reads = dev.reads();
        assert!(!a
            .is_used(sb.group_first_block(sb.group_count - 1) + 50)
            .unwrap());
        assert_eq!(dev.reads(), reads, "the most recent group is still loaded");
        assert!(a.is_used(used[0].0).unwrap());
        assert!(dev.reads() > reads, "group 5 was evicted");
    }

    /// What bench/stat-tree.sh reads from the periodic log line.
    #[test]
    fn the_bitmap_stats_line() {
        let s = BitmapCacheStats {
            groups: 3,
            bytes: 52 << 10,
            pinned: 17 << 10,
            budget: 2 << 20,
            loads: 5,
            evictions: 2,
        };
        assert_eq!(
            s.to_string(),
            "allocation bitmaps: 3 groups = 52 KiB of 2048 KiB budget (17 KiB pinned); 5 loaded, 2 evicted"
        );
    }

    /// Two nodes on one LUN: another node's change to a group is seen at the next use after
    /// the lock's version moved, and unchanged groups are not re-read.
    #[test]
    fn another_nodes_change_is_seen_at_next_use() {
        let (dev, sb) = volume(1024, Some(16));
        let shared: SharedDevice = dev.clone();
        let mut a = load(&shared, &sb);
        let mut b = load(&shared, &sb);
        let g3 = sb.group_first_block(3);
        let g5 = sb.group_first_block(5);
        // B uses groups 3 and 5 (its bitmaps are loaded).
        assert!(!b.is_used(g3 + 100).unwrap());
        assert!(!b.is_used(g5 + 100).unwrap());
        let free5 = b.group_free(5).unwrap();
        // A (holding the lock) allocates in group 3 and frees nothing, then hands over.
        let mine = a.alloc(g3 + 100, 40, 0).unwrap();
        assert_eq!(group_of(&sb, mine[0].0), 3);
        commit(&*dev, &mut a);
        // B gets the lock: the version moved.
        b.invalidate();
        let reads = dev.reads();
        // Group 5 did not change: one header read, bitmap kept.
        assert!(!b.is_used(g5 + 100).unwrap());
        assert_eq!(dev.reads() - reads, FS_BLOCK);
        assert_eq!(b.group_free(5), Some(free5));
        // Group 3 did: header + bitmap re-read, A's blocks are used, B never hands them out.
        for (s, l) in &mine {
            for blk in *s..s + l {
                assert!(b.is_used(blk).unwrap(), "block {blk} A allocated");
            }
        }
        let theirs = b.alloc(g3 + 100, 40, 0).unwrap();
        for (s, l) in &theirs {
            assert!(mine.iter().all(|(ms, ml)| s + l <= *ms || ms + ml <= *s));
        }
        commit(&*dev, &mut b);
        // And back: A sees B's allocation and B's free, with exact counts.
        b.free(mine[0].0, 10).unwrap();
        commit(&*dev, &mut b);
        a.invalidate();
        assert!(!a.is_used(mine[0].0).unwrap());
        assert!(a.is_used(theirs[0].0).unwrap());
        let fresh = load(&shared, &sb);
        assert_eq!(a.group_free(3), fresh.group_free(3));
        assert_eq!(a.free_blocks(), fresh.free_blocks());
    }

    #[test]
    fn counts_of_unchecked_groups_follow_the_lvb_and_enospc_is_exact() {
        let (dev, sb) = volume(256, Some(16));
        let shared: SharedDevice = dev.clone();
        let mut a = load(&shared, &sb);
        // A fills the volume.
        let mut all = Vec::new();
        while let Ok(r) = a.alloc(sb.group_start, 1024, 0) {
            all.extend(r);
        }
        while let Ok(r) = a.alloc(sb.group_start, 1, 0) {
            all.extend(r);
        }
        commit(&*dev, &mut a);
        assert_eq!(a.free_blocks(), 0);
        // B mounts now (knows it is full), then A frees group 2 entirely and hands over
        // without publishing anything.
        let mut b = load(&shared, &sb);
        assert_eq!(b.free_blocks(), 0);
        let mut freed = 0;
        for (s, l) in all.iter().filter(|(s, _)| group_of(&sb, *s) == 2) {
            a.free(*s, *l).unwrap();
            freed += l;
        }
        commit(&*dev, &mut a);
        b.invalidate();
        // An LVB B has seen before is not taken over its own count...
        b.note_lvb(2, None);
        assert_eq!(b.free_blocks(), 0);
        // ...but the allocation checks every unchecked group before it says ENOSPC.
        let r = b.alloc(sb.group_start, freed, 0).unwrap();
        assert_eq!(r.iter().map(|x| x.1).sum::<u64>(), freed);
        assert!(r.iter().all(|(s, _)| group_of(&sb, *s) == 2));
        assert!(b.alloc(sb.group_start, 1, 0).is_err(), "the volume is full");
        commit(&*dev, &mut b);
        // A count that another node published (the LVB changed) is taken for an unchecked
        // group; once the group is checked, its header wins.
        a.invalidate();
        a.note_lvb(2, Some(0));
        assert_eq!(a.group_free(2), Some(0));
        a.invalidate();
        a.note_lvb(2, Some(7));
        assert_eq!(a.group_free(2), Some(7));
        assert_eq!(a.exact_free(2).unwrap(), 0);
        a.note_lvb(2, Some(9));
        assert_eq!(
            a.group_free(2),
            Some(0),
            "checked at this generation: exact"
        );
    }

    /// A count published, then published back to what it was between two reads of the
    /// records, with a header read of the group in between: the count that came back is
    /// taken, not the header's passing one (before, it matched the last count seen and
    /// was ignored, so statfs stayed 8 blocks short until the group was used again).
    #[test]
    fn a_published_count_that_moved_and_came_back_is_taken() {
        let (dev, sb) = volume(256, Some(16));
        let shared: SharedDevice = dev.clone();
        let mut a = load(&shared, &sb);
        let mut b = load(&shared, &sb);
        let full = b.group_free(2).unwrap();
        // B reads the records: group 2's published count is `full`.
        b.note_lvb(2, Some(full));
        // A takes 8 blocks there (and publishes full - 8, which B does not read).
        let r = a.alloc(sb.group_first_block(2) + 10, 8, 0).unwrap();
        assert!(r.iter().all(|(s, _)| group_of(&sb, *s) == 2));
        commit(&*dev, &mut a);
        // B uses the group: its header says full - 8.
        b.invalidate();
        assert_eq!(b.exact_free(2).unwrap(), full - 8);
        // A frees them and publishes `full` again; B's next read of the records sees it.
        for (s, l) in &r {
            a.free(*s, *l).unwrap();
        }
        commit(&*dev, &mut a);
        b.invalidate();
        b.note_lvb(2, Some(full));
        assert_eq!(
            b.group_free(2),
            Some(full),
            "the published count that came back"
        );
    }

    #[test]
    fn invalidate_drops_changes_no_transaction_took() {
        let (dev, sb) = volume(256, Some(16));
        let shared: SharedDevice = dev.clone();
        let mut a = load(&shared, &sb);
        let r = a.alloc(sb.group_start, 5, 0).unwrap();
        // Never taken by a transaction (an operation that failed before its commit).
        a.invalidate();
        assert!(!a.is_used(r[0].0).unwrap());
        assert_eq!(a.free_blocks(), load(&shared, &sb).free_blocks());
    }

    proptest! {
        #[test]
        fn invariants(ops in proptest::collection::vec((0u64..5, 1u64..300, any::<bool>()), 1..60)) {
            let (sb, mut a) = setup();
            let start_free = a.free_blocks();
            let mut owned: Vec<(u64, u64)> = Vec::new();
            for (owner, n, free_one) in ops {
                if free_one && !owned.is_empty() {
                    let (s, l) = owned.swap_remove(0);
                    a.free(s, l).unwrap();
                } else if let Ok(r) = a.alloc(sb.group_start, n, owner) {
                    prop_assert_eq!(r.iter().map(|x| x.1).sum::<u64>(), n);
                    owned.extend(r);
                }
            }
            // No block handed out twice, every handed-out block marked used.
            let mut seen = std::collections::HashSet::new();
            for (s, l) in &owned {
                for b in *s..s + l {
                    prop_assert!(seen.insert(b), "block {} allocated twice", b);
                    prop_assert!(a.is_used(b).unwrap());
                }
            }
            prop_assert_eq!(a.free_blocks() + seen.len() as u64, start_free);
            prop_assert_eq!(a.free_blocks(), a.groups.iter().map(|g| g.free).sum::<u64>());
            for o in 0..5 { a.drop_reservation(o); }
            a.committed();
            for g in &a.groups {
                if let Some(bm) = &g.bits {
                    prop_assert!(!bm.has_reserved());
                }
            }
        }
    }
}
