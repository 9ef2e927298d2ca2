//! Block allocator over the allocation groups.
//!
//! The whole bitmap of every group this node allocates from is held in memory (1 bit per 4 KiB
//! block: 32 MiB per TiB). Changes mark their bitmap block and group header dirty; the
//! transaction that made them writes them out.
//!
//! Per-file *reservation windows* (as ext4's preallocation and GFS2's rgrp reservations): when a
//! file allocates, the free run after its allocation is reserved for that file in memory only,
//! and the window doubles each time the file consumes it (up to 256 MiB). Two files growing at
//! the same time therefore fill separate runs instead of interleaving block by block, and a
//! sequential writer gets one extent per group. Reservations are dropped when the file is closed
//! and are never on disk.
//!
//! *Blocks held for writes in flight* ([`Allocator::reserve`]): an allocating data write picks
//! its blocks under the metadata mutex but writes them outside it (fs/data.rs). Its runs are
//! taken as [`Allocator::alloc`] takes them and then kept only in the in-memory reservation
//! bitmap, so nothing else allocates them while the bitmap on disk (and every bitmap block a
//! transaction writes meanwhile) still shows them free. [`Allocator::commit_reserved`] marks
//! them used in the transaction that maps them, [`Allocator::unreserve`] gives them back when
//! the write failed. A crash in between leaves nothing on disk to undo.
//!
//! Several nodes: every change to a bitmap happens under the cluster's exclusive metadata lock,
//! so the in-memory copy is exact while this node holds it, and is reloaded (`refresh`) when
//! another node held it in between. *Where* a node allocates is a policy on top: each node owns
//! some groups (long-held group locks, see cluster/lock.rs) and looks there first, then in
//! groups nobody owns, and only then in other nodes' groups — so three nodes writing three
//! images fill three separate regions.

use crate::error::{Error, ErrorKind, Result};
use crate::format::group::{encode_bitmap, GroupHeader, BITS_PER_BITMAP_BLOCK};
use crate::format::superblock::Superblock;
use crate::format::FS_BLOCK;
use std::collections::{BTreeSet, HashMap};

const WORDS_PER_BITMAP_BLOCK: usize = (BITS_PER_BITMAP_BLOCK / 64) as usize;
const _: () = assert!(BITS_PER_BITMAP_BLOCK.is_multiple_of(64));
pub const MIN_WINDOW: u64 = 64;
pub const MAX_WINDOW: u64 = 1 << 16;

/// A group as read from disk: its header and (sequence, payload) of each bitmap block.
pub type LoadedGroup = (GroupHeader, Vec<(u64, Vec<u8>)>);

/// Who owns a group, as far as this node's allocation policy is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupClass {
    Mine = 0,
    Unowned = 1,
    Others = 2,
}

/// Read every group header and bitmap (the allocator's view of the whole volume).
pub fn read_groups(dev: &dyn crate::dev::BlockDevice, sb: &Superblock) -> Result<Vec<LoadedGroup>> {
    use crate::format::group::decode_bitmap;
    use crate::format::FS_BLOCK_SIZE;
    let mut groups = Vec::with_capacity(usize::try_from(sb.group_count).unwrap_or(0));
    let meta_blocks = 1 + usize::try_from(sb.bitmap_blocks).unwrap_or(0);
    let mut buf = crate::dev::AlignedBuf::new(meta_blocks * FS_BLOCK_SIZE);
    for g in 0..sb.group_count {
        let first = sb.group_first_block(g);
        dev.read_at(first * FS_BLOCK, &mut buf)?;
        let h = GroupHeader::decode(&buf[..FS_BLOCK_SIZE], first)
            .map_err(|e| e.wrap(format!("group {g}")))?;
        if h.index != g || h.block_count != sb.group_blocks || h.bitmap_blocks != sb.bitmap_blocks {
            bail!(
                Corrupted,
                "group {g}: header does not match the superblock; run fsck.cetra"
            );
        }
        let mut bms = Vec::new();
        for i in 0..meta_blocks - 1 {
            let at = first + 1 + i as u64;
            let (seq, payload) =
                decode_bitmap(&buf[(i + 1) * FS_BLOCK_SIZE..(i + 2) * FS_BLOCK_SIZE], at)?;
            bms.push((seq, payload.to_vec()));
        }
        groups.push((h, bms));
    }
    Ok(groups)
}

#[derive(Debug)]
struct Group {
    first: u64,
    class: GroupClass,
    used: Vec<u64>,
    resv: Vec<u64>,
    free: u64,
    header_seq: u64,
    bitmap_seq: Vec<u64>,
    dirty_bitmaps: BTreeSet<usize>,
    header_dirty: bool,
}

#[derive(Debug, Clone, Copy)]
struct Reservation {
    start: u64,
    len: u64,
    window: u64,
}

#[derive(Debug)]
pub struct Allocator {
    groups: Vec<Group>,
    group_start: u64,
    group_blocks: u64,
    resv: HashMap<u64, Reservation>,
    /// Blocks freed by the running transaction: free on disk once it commits, but not
    /// reusable before that (see fs/txn.rs, commit point step 4).
    quarantine: Vec<(u64, u64)>,
    /// Reservation window each writing file has earned (doubles as it keeps growing).
    windows: HashMap<u64, u64>,
    /// Blocks held for writes in flight (in `resv`, not in `used`): not free, not yet used.
    held: u64,
}

fn get(words: &[u64], bit: u64) -> bool {
    words[usize::try_from(bit / 64).unwrap_or(usize::MAX)] & (1 << (bit % 64)) != 0
}

fn set_range(words: &mut [u64], start: u64, len: u64, on: bool) {
    for b in start..start + len {
        let w = &mut words[usize::try_from(b / 64).unwrap_or(usize::MAX)];
        if on {
            *w |= 1 << (b % 64);
        } else {
            *w &= !(1 << (b % 64));
        }
    }
}

impl Group {
    fn busy(&self, bit: u64) -> bool {
        get(&self.used, bit) || get(&self.resv, bit)
    }

    /// First bit >= from that is neither used nor reserved, scanning whole words at a time.
    fn next_free(&self, from: u64, limit: u64) -> Option<u64> {
        let mut b = from;
        while b < limit {
            let wi = usize::try_from(b / 64).ok()?;
            let word = self.used[wi] | self.resv[wi];
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

    fn mark(&mut self, bit: u64, len: u64, used: bool) {
        set_range(&mut self.used, bit, len, used);
        if used {
            self.free -= len;
        } else {
            self.free += len;
        }
        let per = BITS_PER_BITMAP_BLOCK;
        for blk in bit / per..=(bit + len - 1) / per {
            self.dirty_bitmaps
                .insert(usize::try_from(blk).unwrap_or(usize::MAX));
        }
        self.header_dirty = true;
    }
}

impl Allocator {
    /// Build from group headers and bitmap payloads read from disk.
    pub fn new(sb: &Superblock, groups: Vec<LoadedGroup>) -> Result<Self> {
        let mut out = Vec::with_capacity(groups.len());
        for (h, bitmaps) in groups {
            let mut used = Vec::with_capacity(bitmaps.len() * WORDS_PER_BITMAP_BLOCK);
            let mut seqs = Vec::new();
            for (seq, payload) in &bitmaps {
                seqs.push(*seq);
                for c in payload.chunks_exact(8) {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(c);
                    used.push(u64::from_le_bytes(a));
                }
            }
            let zeros: u64 = (0..sb.group_blocks).filter(|&b| !get(&used, b)).count() as u64;
            if zeros != h.free_blocks {
                return Err(Error::corrupted(format!(
                    "group {}: header says {} free blocks, bitmap has {zeros}; run fsck.cetra",
                    h.index, h.free_blocks
                )));
            }
            let n = used.len();
            out.push(Group {
                class: GroupClass::Unowned,
                first: h.first_block,
                used,
                resv: vec![0; n],
                free: h.free_blocks,
                header_seq: h.seq,
                bitmap_seq: seqs,
                dirty_bitmaps: BTreeSet::new(),
                header_dirty: false,
            });
        }
        Ok(Self {
            groups: out,
            group_start: sb.group_start,
            group_blocks: sb.group_blocks,
            resv: HashMap::new(),
            quarantine: Vec::new(),
            windows: HashMap::new(),
            held: 0,
        })
    }

    fn locate(&self, block: u64) -> Option<(usize, u64)> {
        let rel = block.checked_sub(self.group_start)?;
        let g = usize::try_from(rel / self.group_blocks).ok()?;
        (g < self.groups.len()).then_some((g, rel % self.group_blocks))
    }

    /// Free blocks, not counting those held for writes in flight.
    pub fn free_blocks(&self) -> u64 {
        self.groups.iter().map(|g| g.free).sum::<u64>() - self.held
    }

    pub fn total_blocks(&self) -> u64 {
        self.groups.len() as u64 * self.group_blocks
    }

    /// Replace every group with what is on disk now (another node held the metadata lock in
    /// between). Reservations are hints and are dropped; earned windows and group classes stay.
    pub fn refresh(&mut self, sb: &Superblock, groups: Vec<LoadedGroup>) -> Result<()> {
        debug_assert!(self.quarantine.is_empty(), "refresh with uncommitted frees");
        debug_assert_eq!(
            self.held, 0,
            "refresh with blocks held for writes in flight"
        );
        let fresh = Self::new(sb, groups)?;
        let classes: Vec<GroupClass> = self.groups.iter().map(|g| g.class).collect();
        self.groups = fresh.groups;
        for (g, c) in self.groups.iter_mut().zip(classes) {
            g.class = c;
        }
        self.resv.clear();
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

    /// Free blocks of one group.
    pub fn group_free(&self, g: u64) -> Option<u64> {
        usize::try_from(g)
            .ok()
            .and_then(|i| self.groups.get(i))
            .map(|grp| grp.free)
    }

    /// Free blocks in the groups this node owns.
    pub fn free_in_mine(&self) -> u64 {
        self.groups
            .iter()
            .filter(|g| g.class == GroupClass::Mine)
            .map(|g| g.free)
            .sum()
    }

    pub fn is_used(&self, block: u64) -> bool {
        self.locate(block)
            .is_some_and(|(g, bit)| get(&self.groups[g].used, bit))
    }

    /// Allocate exactly `want` blocks for `owner` (0 = metadata, no reservation), as close to
    /// `goal` as possible, as few runs as possible. All or nothing.
    pub fn alloc(&mut self, goal: u64, want: u64, owner: u64) -> Result<Vec<(u64, u64)>> {
        if want == 0 {
            return Ok(Vec::new());
        }
        if self.free_blocks() < want {
            return Err(Error::new(
                ErrorKind::NoSpace,
                "no space left on the volume",
            ));
        }
        let mut runs = Vec::new();
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
            self.take_reserved(r.start, take);
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
                let Some((start, len)) = self.find_run(goal, need, min) else {
                    break;
                };
                let take = len.min(need);
                self.mark_used(start, take);
                runs.push((start, take));
                need -= take;
                goal = start + take;
            }
            if need == 0 {
                break;
            }
            if attempt == 1 {
                let owners: Vec<u64> = self.resv.keys().copied().collect();
                for o in owners {
                    self.drop_reservation(o);
                }
            }
        }
        if need > 0 {
            // Roll back: these were never committed, so no quarantine.
            for (s, l) in runs {
                if let Some((g, bit)) = self.locate(s) {
                    self.groups[g].mark(bit, l, false);
                }
            }
            return Err(Error::new(
                ErrorKind::NoSpace,
                "no space left on the volume",
            ));
        }
        // 3. Reserve the next window for the file: right after this allocation if free,
        //    else the next free run of that size.
        if owner != 0 && !self.resv.contains_key(&owner) {
            let next = (window * 2)
                .min(MAX_WINDOW)
                .max(want.next_power_of_two().min(MAX_WINDOW));
            self.windows.insert(owner, next);
            let here = self.locate(goal).map_or(0, |(g, bit)| {
                self.groups[g].run_len(bit, self.group_blocks, next)
            });
            let spot = if here > 0 {
                Some((goal, here))
            } else {
                self.find_run(goal, next, next.min(want.max(MIN_WINDOW)))
            };
            if let Some((start, len)) = spot {
                if let Some((g, bit)) = self.locate(start) {
                    let len = len.min(self.groups[g].run_len(bit, self.group_blocks, next));
                    if len > 0 {
                        set_range(&mut self.groups[g].resv, bit, len, true);
                        self.resv.insert(
                            owner,
                            Reservation {
                                start,
                                len,
                                window: next,
                            },
                        );
                    }
                }
            }
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
                let grp = &mut self.groups[g];
                // Back from used to reserved: the bitmap blocks `alloc` marked dirty are then
                // written unchanged, which is harmless.
                set_range(&mut grp.used, bit, len, false);
                grp.free += len;
                set_range(&mut grp.resv, bit, len, true);
            }
        }
        self.held += want;
        Ok(runs)
    }

    /// A run held by [`Allocator::reserve`] is mapped now: mark it used (its bitmap block and
    /// group header go into the transaction that maps it).
    pub fn commit_reserved(&mut self, start: u64, len: u64) {
        self.release_held(start, len);
        self.mark_used(start, len);
    }

    /// A run held by [`Allocator::reserve`] is not needed after all (the write failed).
    pub fn unreserve(&mut self, start: u64, len: u64) {
        self.release_held(start, len);
    }

    fn release_held(&mut self, start: u64, len: u64) {
        if let Some((g, bit)) = self.locate(start) {
            debug_assert!(
                (bit..bit + len)
                    .all(|b| get(&self.groups[g].resv, b) && !get(&self.groups[g].used, b)),
                "run {start}+{len} is not held"
            );
            set_range(&mut self.groups[g].resv, bit, len, false);
            self.held -= len;
        }
    }

    /// Blocks held for writes in flight.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// The first free run of at least `min` blocks (or the rest of its group... only whole
    /// runs count) starting at or after `goal`, wrapping around the groups once; at most
    /// `want` long.
    fn find_run(&self, goal: u64, want: u64, min: u64) -> Option<(u64, u64)> {
        [GroupClass::Mine, GroupClass::Unowned, GroupClass::Others]
            .into_iter()
            .find_map(|class| self.find_run_in(class, goal, want, min))
    }

    fn find_run_in(&self, class: GroupClass, goal: u64, want: u64, min: u64) -> Option<(u64, u64)> {
        let (g0, bit0) = self.locate(goal).unwrap_or((0, 0));
        let n = self.groups.len();
        for i in 0..=n {
            let g = (g0 + i) % n;
            let grp = &self.groups[g];
            if grp.free < min || grp.class != class {
                continue;
            }
            let mut from = if i == 0 { bit0 } else { 0 };
            let limit = self.group_blocks;
            while let Some(b) = grp.next_free(from, limit) {
                let len = grp.run_len(b, limit, want.max(min));
                if len >= min {
                    return Some((grp.first + b, len.min(want)));
                }
                from = b + len;
            }
        }
        None
    }

    fn take_reserved(&mut self, start: u64, len: u64) {
        if let Some((g, bit)) = self.locate(start) {
            set_range(&mut self.groups[g].resv, bit, len, false);
            self.groups[g].mark(bit, len, true);
        }
    }

    fn mark_used(&mut self, start: u64, len: u64) {
        if let Some((g, bit)) = self.locate(start) {
            self.groups[g].mark(bit, len, true);
        }
    }

    /// Free a run (it must lie in one group, as every extent and allocation does). The run
    /// shows as free in the bitmap at once but is quarantined until `release_quarantine`.
    pub fn free(&mut self, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        if let Some((g, bit)) = self.locate(start) {
            debug_assert!(
                (bit..bit + len).all(|b| get(&self.groups[g].used, b)),
                "double free at {start}+{len}"
            );
            self.groups[g].mark(bit, len, false);
            set_range(&mut self.groups[g].resv, bit, len, true);
            self.quarantine.push((start, len));
        }
    }

    /// The transaction that freed the quarantined runs is durable: they may be reused.
    pub fn release_quarantine(&mut self) {
        for (start, len) in std::mem::take(&mut self.quarantine) {
            if let Some((g, bit)) = self.locate(start) {
                set_range(&mut self.groups[g].resv, bit, len, false);
            }
        }
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
                set_range(&mut self.groups[g].resv, bit, r.len, false);
            }
        }
    }

    /// Encoded dirty bitmap blocks and group headers, with their sequence numbers bumped.
    pub fn take_dirty(&mut self) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        for (gi, g) in self.groups.iter_mut().enumerate() {
            for bi in std::mem::take(&mut g.dirty_bitmaps) {
                g.bitmap_seq[bi] += 1;
                let words = &g.used[bi * WORDS_PER_BITMAP_BLOCK..(bi + 1) * WORDS_PER_BITMAP_BLOCK];
                let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                let at = g.first + 1 + bi as u64;
                out.push((at, encode_bitmap(at, g.bitmap_seq[bi], &bytes)));
            }
            if std::mem::take(&mut g.header_dirty) {
                g.header_seq += 1;
                let h = GroupHeader {
                    seq: g.header_seq,
                    index: gi as u64,
                    first_block: g.first,
                    block_count: self.group_blocks,
                    free_blocks: g.free,
                    bitmap_blocks: u32::try_from(g.bitmap_seq.len()).unwrap_or(u32::MAX),
                };
                out.push((g.first, h.encode()));
            }
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dev::{mem::MemDevice, BlockDevice};

    use proptest::prelude::*;

    fn setup() -> (Superblock, Allocator) {
        let dev = MemDevice::new(512 << 20, 512);
        let opts = crate::mkfs::MkfsOptions {
            max_nodes: 2,
            journal_bytes: 1 << 20,
            ..Default::default()
        };
        let sb = crate::mkfs::format(&dev, &opts, &mut |_, _| {}).unwrap();
        let a = load(&dev, &sb);
        (sb, a)
    }

    pub(crate) fn load(dev: &dyn BlockDevice, sb: &Superblock) -> Allocator {
        Allocator::new(sb, read_groups(dev, sb).unwrap()).unwrap()
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

    proptest! {
        #[test]
        fn invariants(ops in proptest::collection::vec((0u64..5, 1u64..300, any::<bool>()), 1..60)) {
            let (sb, mut a) = setup();
            let start_free = a.free_blocks();
            let mut owned: Vec<(u64, u64)> = Vec::new();
            for (owner, n, free_one) in ops {
                if free_one && !owned.is_empty() {
                    let (s, l) = owned.swap_remove(0);
                    a.free(s, l);
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
                    prop_assert!(a.is_used(b));
                }
            }
            prop_assert_eq!(a.free_blocks() + seen.len() as u64, start_free);
            for o in 0..5 { a.drop_reservation(o); }
            a.release_quarantine();
            for g in &a.groups { prop_assert!(g.resv.iter().all(|&w| w == 0)); }
        }
    }
}
