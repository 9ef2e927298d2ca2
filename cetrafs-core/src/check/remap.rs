//! `rebuild-map` and `rebuild-dir` (`fsck.cetra -y`).
//!
//! `rebuild-dir`: a directory whose entry tree has a node that does not decode, belongs to
//! someone else, breaks the B+tree rules, is not group data or is somebody else's block gets a
//! new tree of the records the check could read (sorted by hash, the first of a hash kept).
//! The entries under the damaged node are lost: the inodes they named are then unreachable and
//! `reconnect` links them into `/lost+found`, as e2fsck's pass 3 does.
//!
//! `rebuild-map`: a regular file's extent map rewritten as the check could read it
//! ([`MapFix`]):
//!
//! * the extents of a tree node that does not decode, belongs to someone else, breaks the
//!   B+tree rules or is somebody else's block are not in it: their ranges become holes;
//! * an extent that overlaps an earlier one in file space, or that does not name the data area
//!   of a group, is left out (a hole; the blocks it named, if any are group data, are then
//!   leaked and freed by `free-leaked`);
//! * a written extent at or past EOF is kept as an unwritten one. Size and map change in one
//!   transaction, so such an extent was never a write the file's size lost; its bytes were
//!   never visible. e2fsck raises `i_size` over initialised blocks past EOF because ext4 has no
//!   other state for them; here the extent keeps its blocks in the state `fallocate
//!   (KEEP_SIZE)` leaves, and the file reads as it did;
//! * an extent over blocks another owner claimed first (or an earlier extent of the same file),
//!   or over an inode block that the inode claimed after it (an inode cannot move), gets a
//!   copy, as e2fsck's pass 1B clones: new blocks are taken from the bitmaps (fsck holds
//!   the volume, so nothing else allocates), the data is copied, the extent is repointed. Both
//!   files keep readable contents; the shared blocks' contents are the first owner's data or
//!   the second's, whichever was written last, for both.
//!
//! The new map is written inline when it has at most [`INLINE_EXTENTS_MAX`] extents, else as a
//! new tree (nodes taken from the bitmaps like the copies). The old tree's nodes are then
//! claimed by nothing: leaked, and freed by `free-leaked` in a later round; the inode's block
//! count is set by `block-count` in the next round.
//!
//! New blocks are blocks clear in their group's bitmap that the check saw nobody claim (a
//! block marked free but in use is never handed out), in groups whose header and bitmap
//! decode; the bitmap bits are set and the header's free count lowered before the map naming
//! them is written. A file whose copies or tree do not fit in the free space is left as it is
//! (its findings stay, fsck exits 4); the blocks taken for it are leaked, and freed later.

use super::repair::Repaired;
use super::{LeafEntry, MapFix, Report};
use crate::dev::{read_aligned, AlignedBuf, BlockDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::extent::{Extent, MAX_EXTENT_BLOCKS};
use crate::format::group::{decode_bitmap, encode_bitmap, GroupHeader, BITS_PER_BITMAP_BLOCK};
use crate::format::inode::{flags, Inode, INLINE_EXTENTS_MAX};
use crate::format::superblock::Superblock;
use crate::format::tree_node::{
    NodeEntries, TreeNode, INTERNAL_ENTRY, LEAF_ENTRY_OVERHEAD, NODE_CAP,
};
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};
use std::collections::BTreeMap;

/// Children per internal node of a rebuilt tree (leaves are packed by bytes).
const INTERNAL_FANOUT: usize = NODE_CAP / INTERNAL_ENTRY;
/// Blocks copied at once.
const COPY_CHUNK: u64 = 256;

/// `rebuild-map` for every file of `report.plan.maps`.
pub(super) fn rebuild_maps(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    report: &Report,
    out: &mut Repaired,
) -> Result<()> {
    let mut spare = Spare::new(dev, sb, &report.plan.claims);
    // One repair's outcome: a line, or nothing to do, or not enough free space for its copies
    // or tree (the file or directory is left as it is: its findings stay, what was taken for
    // it is leaked and freed later). Any other error ends the run.
    let mut note = |r: Result<Option<String>>| match r {
        Ok(line) => {
            out.fixed.extend(line);
            Ok(())
        }
        Err(e) if e.kind() == ErrorKind::NoSpace => Ok(()),
        Err(e) => Err(e),
    };
    let result = with_give_backs(dev, sb, report)
        .iter()
        .try_for_each(|(&ino, fix)| note(rebuild_map(dev, &mut spare, ino, fix)))
        .and_then(|()| {
            report
                .plan
                .dir_trees
                .iter()
                .try_for_each(|(&ino, records)| note(rebuild_dir(dev, &mut spare, ino, records)))
        });
    // The bits of what was taken go down even if a later file failed: its map is written.
    spare.finish()?;
    result
}

/// The map fixes of the check, plus copies of the extents over an inode block that a file's
/// data claimed before the inode did (an inode cannot move: the data gets the copy).
fn with_give_backs(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    report: &Report,
) -> BTreeMap<u64, MapFix> {
    let mut maps = report.plan.maps.clone();
    for &(owner, block) in &report.plan.give_back {
        let fix = match maps.entry(owner) {
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                let Ok(map) = crate::inspect::file_map(dev, sb, owner) else {
                    continue;
                };
                v.insert(MapFix {
                    extents: map.extents,
                    ..MapFix::default()
                })
            }
        };
        let over: Vec<u64> = fix
            .extents
            .iter()
            .filter(|e| e.physical <= block && block - e.physical < u64::from(e.len))
            .map(|e| e.logical)
            .collect();
        fix.copy.extend(over);
    }
    maps
}

fn rebuild_map(
    dev: &dyn BlockDevice,
    spare: &mut Spare<'_>,
    ino: u64,
    fix: &MapFix,
) -> Result<Option<String>> {
    let Ok(mut inode) = Inode::decode(&read_aligned(dev, ino * FS_BLOCK, FS_BLOCK_SIZE)?, ino)
    else {
        return Ok(None);
    };
    if !inode.is_reg() {
        return Ok(None);
    }
    let mut extents = Vec::with_capacity(fix.extents.len());
    let mut copied = 0u64;
    for e in &fix.extents {
        if fix.copy.contains(&e.logical) {
            let copies = copy_extent(dev, spare, ino, e)?;
            copied += u64::from(e.len);
            extents.extend(copies);
        } else {
            extents.push(*e);
        }
    }
    let (old_root, n) = (inode.tree_root, extents.len());
    if n <= INLINE_EXTENTS_MAX {
        inode.flags |= flags::INLINE_EXTENTS;
        inode.inline_extents = extents;
        inode.tree_root = 0;
    } else {
        let entries = extents
            .iter()
            .map(|e| (e.logical, e.encode_value().to_vec()))
            .collect();
        inode.tree_root = build_tree(dev, spare, ino, entries)?;
        inode.flags &= !flags::INLINE_EXTENTS;
        inode.inline_extents.clear();
    }
    inode.seq = inode.seq.saturating_add(1);
    // The blocks the new map names are marked used before the map is written.
    spare.finish()?;
    dev.write_at(ino * FS_BLOCK, &AlignedBuf::from_slice(&inode.encode()))?;
    let shape = if inode.tree_root == 0 {
        "inline".to_string()
    } else {
        format!("in a new tree rooted at block {}", inode.tree_root)
    };
    let was = if old_root == 0 {
        String::new()
    } else {
        format!(" (its tree at block {old_root} released)")
    };
    Ok(Some(format!(
        "rebuild-map: inode {ino}: extent map rewritten from its {} readable extents, {n} {shape}{was}; {copied} blocks of shared extents copied",
        fix.extents.len()
    )))
}

/// `rebuild-dir`: directory `ino`'s entry tree rewritten as a new tree of `records`.
fn rebuild_dir(
    dev: &dyn BlockDevice,
    spare: &mut Spare<'_>,
    ino: u64,
    records: &[LeafEntry],
) -> Result<Option<String>> {
    let Ok(mut inode) = Inode::decode(&read_aligned(dev, ino * FS_BLOCK, FS_BLOCK_SIZE)?, ino)
    else {
        return Ok(None);
    };
    if !inode.is_dir() {
        return Ok(None);
    }
    let old_root = inode.tree_root;
    inode.tree_root = build_tree(dev, spare, ino, records.to_vec())?;
    inode.seq = inode.seq.saturating_add(1);
    spare.finish()?;
    dev.write_at(ino * FS_BLOCK, &AlignedBuf::from_slice(&inode.encode()))?;
    Ok(Some(format!(
        "rebuild-dir: directory {ino}: entry tree rewritten from its {} readable records, rooted at block {} (its tree at block {old_root} released)",
        records.len(),
        inode.tree_root
    )))
}

/// Copy the data of `e` to new blocks; returns the extents naming the copies.
fn copy_extent(
    dev: &dyn BlockDevice,
    spare: &mut Spare<'_>,
    ino: u64,
    e: &Extent,
) -> Result<Vec<Extent>> {
    let runs = spare.take(ino, u64::from(e.len))?;
    let mut out = Vec::with_capacity(runs.len());
    let (mut logical, mut from) = (e.logical, e.physical);
    for (start, len) in runs {
        let mut done = 0;
        while done < len {
            let n = COPY_CHUNK.min(len - done);
            let bytes = usize::try_from(n * FS_BLOCK).unwrap_or(usize::MAX);
            let data = read_aligned(dev, (from + done) * FS_BLOCK, bytes)?;
            dev.write_at((start + done) * FS_BLOCK, &data)?;
            done += n;
        }
        out.push(Extent {
            logical,
            physical: start,
            len: u32::try_from(len).unwrap_or(MAX_EXTENT_BLOCKS),
            flags: e.flags,
        });
        logical += len;
        from += len;
    }
    Ok(out)
}

/// Write `entries` (sorted by key, keys distinct) as a new tree owned by `ino`, leaves packed
/// by bytes; no entries make one empty root leaf. Returns its root.
fn build_tree(
    dev: &dyn BlockDevice,
    spare: &mut Spare<'_>,
    ino: u64,
    entries: Vec<LeafEntry>,
) -> Result<u64> {
    let mut level = 0u16;
    let mut children: Vec<(u64, u64)> = Vec::new();
    let mut leaf: Vec<LeafEntry> = Vec::new();
    let mut used = 0;
    for entry in entries {
        let size = LEAF_ENTRY_OVERHEAD + entry.1.len();
        if used + size > NODE_CAP {
            let key = leaf.first().map_or(0, |e| e.0);
            let b = write_node(
                dev,
                spare,
                ino,
                level,
                NodeEntries::Leaf(std::mem::take(&mut leaf)),
            )?;
            children.push((key, b));
            used = 0;
        }
        used += size;
        leaf.push(entry);
    }
    if !leaf.is_empty() || children.is_empty() {
        let key = leaf.first().map_or(0, |e| e.0);
        let b = write_node(dev, spare, ino, level, NodeEntries::Leaf(leaf))?;
        children.push((key, b));
    }
    while children.len() > 1 {
        level += 1;
        let mut up = Vec::new();
        for chunk in children.chunks(INTERNAL_FANOUT) {
            let b = write_node(
                dev,
                spare,
                ino,
                level,
                NodeEntries::Internal(chunk.to_vec()),
            )?;
            up.push((chunk[0].0, b));
        }
        children = up;
    }
    children
        .first()
        .map(|&(_, b)| b)
        .ok_or_else(|| Error::corrupted("a tree with no root"))
}

fn write_node(
    dev: &dyn BlockDevice,
    spare: &mut Spare<'_>,
    ino: u64,
    level: u16,
    entries: NodeEntries,
) -> Result<u64> {
    let (b, _) = spare
        .take(ino, 1)?
        .first()
        .copied()
        .ok_or_else(|| Error::new(ErrorKind::NoSpace, "no free block for a tree node"))?;
    let node = TreeNode {
        blockno: b,
        seq: 1,
        owner: ino,
        level,
        entries,
    };
    dev.write_at(b * FS_BLOCK, &AlignedBuf::from_slice(&node.encode()))?;
    Ok(b)
}

/// Free blocks for the repairs, taken from the bitmaps offline.
struct Spare<'a> {
    dev: &'a dyn BlockDevice,
    sb: &'a Superblock,
    /// What the check saw claimed (sorted, disjoint): never handed out.
    claims: &'a [(u64, u64)],
    /// Groups loaded: their bitmap payload and how many blocks were taken since the last
    /// [`Spare::finish`]; None for a group whose header or bitmap does not decode.
    groups: BTreeMap<u64, Option<(Vec<u8>, u64)>>,
}

impl<'a> Spare<'a> {
    fn new(dev: &'a dyn BlockDevice, sb: &'a Superblock, claims: &'a [(u64, u64)]) -> Self {
        Self {
            dev,
            sb,
            claims,
            groups: BTreeMap::new(),
        }
    }

    /// `want` blocks (in runs `(start, len)`, each inside one group and at most
    /// `MAX_EXTENT_BLOCKS` long), from the group of `goal` on.
    fn take(&mut self, goal: u64, want: u64) -> Result<Vec<(u64, u64)>> {
        let count = self.sb.group_count;
        let first = self.sb.group_of(goal).unwrap_or(0);
        let mut runs = Vec::new();
        let mut left = want;
        for g in (0..count).map(|i| (first + i) % count) {
            if left == 0 {
                break;
            }
            left -= self.take_in(g, left, &mut runs)?;
        }
        if left > 0 {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("not enough free blocks for the repair ({want} wanted)"),
            ));
        }
        Ok(runs)
    }

    /// Up to `want` blocks of group `g` appended to `runs`; returns how many.
    fn take_in(&mut self, g: u64, want: u64, runs: &mut Vec<(u64, u64)>) -> Result<u64> {
        if !self.groups.contains_key(&g) {
            let bits = self.load(g)?;
            self.groups.insert(g, bits.map(|b| (b, 0)));
        }
        let base = self.sb.group_first_block(g);
        let meta = 1 + u64::from(self.sb.bitmap_blocks);
        let claims = self.claims;
        let Some(Some((bits, taken))) = self.groups.get_mut(&g) else {
            return Ok(0);
        };
        let mut got = 0;
        for bit in meta..self.sb.group_blocks {
            if got == want {
                break;
            }
            let Some(byte) = usize::try_from(bit / 8).ok().and_then(|i| bits.get_mut(i)) else {
                break;
            };
            let mask = 1u8 << (bit % 8);
            let b = base + bit;
            if *byte & mask != 0 || claimed(claims, b) {
                continue;
            }
            *byte |= mask;
            *taken += 1;
            got += 1;
            match runs.last_mut() {
                Some((s, l)) if *s + *l == b && *l < u64::from(MAX_EXTENT_BLOCKS) => *l += 1,
                _ => runs.push((b, 1)),
            }
        }
        Ok(got)
    }

    /// Group `g`'s bitmap payload, if its header and every bitmap block decode.
    fn load(&self, g: u64) -> Result<Option<Vec<u8>>> {
        let first = self.sb.group_first_block(g);
        if GroupHeader::decode(&self.read(first)?, first).is_err() {
            return Ok(None);
        }
        let mut bits = Vec::new();
        for i in 0..u64::from(self.sb.bitmap_blocks) {
            let at = first + 1 + i;
            match decode_bitmap(&self.read(at)?, at) {
                Ok((_, payload)) => bits.extend_from_slice(payload),
                Err(_) => return Ok(None),
            }
        }
        Ok(Some(bits))
    }

    fn read(&self, b: u64) -> Result<AlignedBuf> {
        read_aligned(self.dev, b * FS_BLOCK, FS_BLOCK_SIZE)
    }

    /// Write the bitmaps and headers of the groups blocks were taken from, and flush.
    fn finish(&mut self) -> Result<()> {
        let per = usize::try_from(BITS_PER_BITMAP_BLOCK / 8).unwrap_or(usize::MAX);
        for (&g, loaded) in &mut self.groups {
            let Some((bits, taken)) = loaded else {
                continue;
            };
            if *taken == 0 {
                continue;
            }
            let first = self.sb.group_first_block(g);
            for (i, chunk) in (0u64..).zip(bits.chunks(per)) {
                let at = first + 1 + i;
                let raw = read_aligned(self.dev, at * FS_BLOCK, FS_BLOCK_SIZE)?;
                let seq = decode_bitmap(&raw, at).map_or(0, |(s, _)| s);
                let image = encode_bitmap(at, seq.saturating_add(1), chunk);
                self.dev
                    .write_at(at * FS_BLOCK, &AlignedBuf::from_slice(&image))?;
            }
            let raw = read_aligned(self.dev, first * FS_BLOCK, FS_BLOCK_SIZE)?;
            let mut h = GroupHeader::decode(&raw, first)?;
            h.free_blocks = h.free_blocks.saturating_sub(*taken);
            h.seq = h.seq.saturating_add(1);
            self.dev
                .write_at(first * FS_BLOCK, &AlignedBuf::from_slice(&h.encode()))?;
            *taken = 0;
        }
        self.dev.flush()
    }
}

/// Is `b` inside one of the sorted, disjoint ranges of `claims`?
fn claimed(claims: &[(u64, u64)], b: u64) -> bool {
    let i = claims.partition_point(|&(s, _)| s <= b);
    i > 0 && claims[i - 1].1 > b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::mem::MemDevice;
    use crate::mkfs::{format, MkfsOptions};

    #[test]
    fn spare_blocks_are_free_unclaimed_and_counted_and_running_out_is_no_space() {
        let dev = MemDevice::new(40 << 20, 512);
        let opts = MkfsOptions {
            max_nodes: 2,
            journal_bytes: 1 << 20,
            ..Default::default()
        };
        format(&dev, &opts, &mut |_, _| {}).unwrap();
        let report = super::super::check_volume(&dev).unwrap();
        let sb = report.superblock.clone().unwrap();
        let claims = report.plan.claims.clone();
        let free_before = report.stats.group_area_blocks - report.stats.used_blocks;
        let mut spare = Spare::new(&dev, &sb, &claims);
        let runs = spare.take(sb.root_ino, 40).unwrap();
        assert_eq!(runs.iter().map(|r| r.1).sum::<u64>(), 40);
        for &(s, l) in &runs {
            assert!((s..s + l).all(|b| sb.is_data_block(b) && !claimed(&claims, b)));
        }
        let err = spare.take(sb.root_ino, free_before).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NoSpace);
        spare.finish().unwrap();
        // The bitmaps and free counts now say the blocks taken are used: only they are leaked.
        let after = super::super::check_volume(&dev).unwrap();
        let leaked: u64 = after.plan.leaked.iter().map(|(s, e)| e - s).sum();
        assert_eq!(leaked, free_before);
        assert!(after
            .findings
            .iter()
            .all(|f| f.kind == super::super::FindingKind::BlockLeaked));
    }
}
