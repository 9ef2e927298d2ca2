//! Repairs behind `fsck.cetra -p` and `-y`: each finding of a [`Report`] that has a named
//! repair here is fixed by writing the structure the check found wrong; the caller checks
//! again afterwards (a repair can uncover the next problem) and stops when a round fixes
//! nothing.
//!
//! **Preconditions** (the caller's, `fsck.cetra`): no node has the volume mounted, the
//! committed journals are replayed, and fsck holds its claim (`cluster::fsck_claim`), so
//! nothing else writes while a repair runs. Writes go straight home, not through a journal: a
//! repair interrupted half-way leaves some fixes done and the rest found again by the next
//! run.
//!
//! | repair | fixes | mode |
//! |---|---|---|
//! | `primary-superblock` | the primary rewritten from the backup | preen |
//! | `backup-superblock` | the backup rewritten from the primary | preen |
//! | `rebuild-group` | a group's bitmap and header (free count, its own metadata, bits past its end) rebuilt from what the inodes claim: blocks in use but marked free are marked used | preen |
//! | `free-leaked` | blocks marked used that nothing claims are freed (with `rebuild-group`) | yes |
//! | `link-count` | an inode's link count set to the entries naming it | preen (to 0: yes) |
//! | `block-count` | an inode's block count set to the blocks it holds | preen |
//! | `reset-record` | a damaged or contradictory heartbeat slot, lock record, object-lock bucket or mailbox rewritten empty | preen |
//! | `dir-parent` | a directory's parent field set to the directory that holds it | preen |
//! | `unorphan` | an inode that still has links, or an entry that is not an inode block, taken off an orphan list (the next mount would free it, or refuse it) | preen |
//! | `slot-header` | a slot header (orphan list) that does not decode rewritten empty (its orphans are then found unreachable) | yes |
//! | `drop-xattr` | an unusable xattr set, or one with a block that is not group data or that another owner holds first, dropped from its inode (its blocks are then leaked, and freed) | yes |
//! | `rebuild-map` | a regular file's extent map rewritten from what the check could read (`check/remap.rs`): a bad tree node's ranges, an extent overlapping an earlier one and an extent that is not group data become holes; a written extent past EOF becomes unwritten; an extent over blocks another owner holds first, or over an inode block, gets a copy of them (both files stay readable) | yes |
//! | `entry-type` | a directory entry's file type set to its inode's | yes |
//! | `drop-entry` | a directory entry that does not decode, or names an inode that is not one (or the root), removed; of two entries naming one directory, the one not in the directory its parent field names (or the later) | yes |
//! | `drop-duplicate` | the second and later entries of a name in one directory record removed | yes |
//! | `rehash-entry` | an entry stored under a hash that is not its name's moved to its name's hash (dropped if the name is there already) | yes |
//! | `rebuild-dir` | a directory's entry tree with a damaged node (one that does not decode, is someone else's, breaks the B+tree rules, or is not group data) rewritten from the records the check could read (`check/remap.rs`); the entries under the damaged node are lost, and `reconnect` links the inodes they named into `/lost+found` | yes |
//! | `discard-journal` | a committed journal transaction that logs a block which is not a metadata home (mount and fsck's replay refuse it) discarded: the journal marked empty, the transaction's changes lost | yes |
//! | `clear-inode` | a symlink whose size, inline target and overflow block disagree (or whose overflow block is unusable) cleared, as e2fsck does: its inode zeroed, then the entries naming it dropped (`drop-entry`) and its blocks freed | yes |
//! | `reconnect` | an unreachable inode (found among the blocks marked used that nothing claims) linked into `/lost+found` as `#INO` | yes |
//!
//! Not repaired, by design:
//!
//! | finding | why |
//! |---|---|
//! | `Features` | unknown compatible or read-only-compatible feature bits are a newer volume, not damage: a warning (exit 0); unknown incompatible bits make fsck refuse the volume (exit 8), since it would misread it |
//! | `Geometry` | a logical block size other than the device's is the wrong device (or a copy onto one with other sectors), not damage: heartbeat and lock records would have to be laid out anew, which is mkfs's business |
//! | `Orphan` (warning) | an open-unlinked inode of a stopped node: the next mount of that slot frees it |
//!
//! Not repaired yet (reported, exit 4): an inode block that another inode's tree node, xattr
//! block or symlink overflow block (not its data) names and claimed first.
//!
//! Preen (`-p`) makes only the repairs that cannot lose data; `-y` makes them all. The
//! repairs that change directories (`entry-type`, `drop-entry`, `drop-duplicate`,
//! `rehash-entry`, `reconnect`) change directory trees, so fsck makes them through the
//! filesystem ([`plan_namespace`] says which; `fs/fsck.rs` makes them); while unreachable inodes are to be reconnected, leaked
//! blocks are kept (they may be theirs), and freed in a later round. A directory is
//! reconnected before the inodes in it (they are reachable once it is). A finding with no
//! repair here is left, and fsck exits 4.

use super::{FindingKind, Report};
use crate::dev::{AlignedBuf, BlockDevice};
use crate::error::{Error, Result};
use crate::format::group::{decode_bitmap, encode_bitmap, GroupHeader, BITS_PER_BITMAP_BLOCK};
use crate::format::inode::Inode;
use crate::format::superblock::Superblock;
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};
use std::collections::BTreeSet;

/// How much fsck may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `-p`: only repairs that cannot lose data.
    Preen,
    /// `-y`: every repair.
    All,
}

/// What one round of repairs did.
#[derive(Debug, Default, Clone)]
pub struct Repaired {
    /// One line per repair made ("rebuild-group: group 3 ...").
    pub fixed: Vec<String>,
}

fn read_block(dev: &dyn BlockDevice, b: u64) -> Result<AlignedBuf> {
    crate::dev::read_aligned(dev, b * FS_BLOCK, FS_BLOCK_SIZE)
}

fn write_block(dev: &dyn BlockDevice, b: u64, data: &[u8]) -> Result<()> {
    dev.write_at(b * FS_BLOCK, &AlignedBuf::from_slice(data))
}

/// Make the repairs `mode` allows for the findings of `report` (a report of this device's
/// current state), except those of [`plan_namespace`]; `keep_leaked`: unreachable inodes are
/// about to be reconnected, so blocks marked used that nothing claims stay used this round.
/// Flushes before it returns.
pub fn repair(
    dev: &dyn BlockDevice,
    report: &Report,
    mode: Mode,
    keep_leaked: bool,
) -> Result<Repaired> {
    let Some(sb) = &report.superblock else {
        return Err(Error::corrupted(
            "no usable superblock (primary and backup both damaged): nothing can be repaired",
        ));
    };
    let mut out = Repaired::default();
    // Blocks that nothing claims are freed only when the check could see every claim: not
    // while an inode, tree, extent list, xattr set, directory record or orphan list it could
    // not read may hold them (its repair, in this round, lets the next round see them).
    let complete = complete_claims(report);
    superblocks(dev, sb, report, &mut out)?;
    groups(dev, sb, report, mode, keep_leaked || !complete, &mut out)?;
    inodes(dev, report, mode, complete, &mut out)?;
    if mode == Mode::All {
        super::remap::rebuild_maps(dev, sb, report, &mut out)?;
    }
    slot_headers(dev, sb, report, mode, &mut out)?;
    if mode == Mode::All {
        journals(dev, sb, report, &mut out)?;
        clear_symlinks(dev, report, &mut out)?;
    }
    records(dev, sb, report, &mut out)?;
    dev.flush()?;
    Ok(out)
}

fn superblocks(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    report: &Report,
    out: &mut Repaired,
) -> Result<()> {
    let image = sb.encode();
    if report.has(FindingKind::PrimarySuperblock) {
        write_block(dev, 0, &image)?;
        out.fixed.push(format!(
            "primary-superblock: rewrote the primary superblock from the backup at block {}",
            sb.backup_block
        ));
    } else if report.has(FindingKind::BackupSuperblock) {
        write_block(dev, sb.backup_block, &image)?;
        out.fixed.push(format!(
            "backup-superblock: rewrote the backup superblock at block {} from the primary",
            sb.backup_block
        ));
    }
    Ok(())
}

/// Did the check see every block's claim (no finding of something it could not read)?
fn complete_claims(report: &Report) -> bool {
    !report.errors().any(|f| {
        matches!(
            f.kind,
            FindingKind::BadInode
                | FindingKind::BadTree
                | FindingKind::BadExtent
                | FindingKind::BadXattr
                | FindingKind::BadEntry
                | FindingKind::SlotHeader
                | FindingKind::BlockOutsideGroups
        )
    })
}

/// The groups whose bitmap or header a finding concerns.
fn groups_to_rebuild(sb: &Superblock, report: &Report, free_leaked: bool) -> BTreeSet<u64> {
    report
        .errors()
        .filter(|f| match f.kind {
            FindingKind::GroupHeader
            | FindingKind::Bitmap
            | FindingKind::FreeCount
            | FindingKind::GroupMetadataFree
            | FindingKind::BitsPastEnd
            | FindingKind::BlockFree => true,
            FindingKind::BlockLeaked => free_leaked,
            _ => false,
        })
        .filter_map(|f| f.block.and_then(|b| sb.group_of(b)))
        .collect()
}

/// `rebuild-group` (and `free-leaked`): the bitmap is what the inodes claim, plus the group's
/// own header and bitmap blocks and the bits past its end; in preen mode, plus every block the
/// old bitmap marked used (a leak is kept: freeing it could lose an unreachable file).
fn groups(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    report: &Report,
    mode: Mode,
    keep_leaked: bool,
    out: &mut Repaired,
) -> Result<()> {
    let free_leaked = mode == Mode::All && !keep_leaked;
    let bitmap_blocks = u64::from(sb.bitmap_blocks);
    let bits_len = usize::try_from(bitmap_blocks * BITS_PER_BITMAP_BLOCK / 8).unwrap_or(0);
    for g in groups_to_rebuild(sb, report, free_leaked) {
        let first = sb.group_first_block(g);
        let end = first + sb.group_blocks;
        let mut bits = vec![0u8; bits_len];
        let mut set = |b: u64| {
            if let Some(byte) = usize::try_from(b / 8).ok().and_then(|i| bits.get_mut(i)) {
                *byte |= 1 << (b % 8);
            }
        };
        for b in 0..=bitmap_blocks {
            set(b);
        }
        for b in sb.group_blocks..bitmap_blocks * BITS_PER_BITMAP_BLOCK {
            set(b);
        }
        for &(s, e) in &report.plan.claims {
            for b in s.max(first)..e.min(end) {
                set(b - first);
            }
        }
        // The old images: their sequence numbers go on, and in preen mode their used bits stay.
        let mut seqs = vec![0u64; usize::try_from(bitmap_blocks).unwrap_or(0)];
        for (i, seq) in (0u64..).zip(seqs.iter_mut()) {
            let at = first + 1 + i;
            let raw = read_block(dev, at)?;
            let o = usize::try_from(i * BITS_PER_BITMAP_BLOCK / 8).unwrap_or(usize::MAX);
            match decode_bitmap(&raw, at) {
                Ok((old_seq, payload)) => {
                    *seq = old_seq;
                    if !free_leaked {
                        for (j, &byte) in payload.iter().enumerate() {
                            if let Some(dst) = bits.get_mut(o + j) {
                                *dst |= byte;
                            }
                        }
                    }
                }
                // Unreadable: without freeing leaks, every block it covered counts as used
                // (a leak for -y later, rather than a block something unseen holds reused).
                Err(_) if !free_leaked => {
                    let per = usize::try_from(BITS_PER_BITMAP_BLOCK / 8).unwrap_or(0);
                    for dst in bits.iter_mut().skip(o).take(per) {
                        *dst = 0xFF;
                    }
                }
                Err(_) => {}
            }
        }
        let per = usize::try_from(BITS_PER_BITMAP_BLOCK / 8).unwrap_or(usize::MAX);
        for (i, chunk) in (0u64..).zip(bits.chunks(per)) {
            let at = first + 1 + i;
            let seq = seqs.get(usize::try_from(i).unwrap_or(usize::MAX)).copied();
            write_block(
                dev,
                at,
                &encode_bitmap(at, seq.unwrap_or(0).saturating_add(1), chunk),
            )?;
        }
        let used: u64 = (0..sb.group_blocks)
            .filter(|&b| {
                usize::try_from(b / 8)
                    .ok()
                    .and_then(|i| bits.get(i))
                    .is_some_and(|byte| byte & (1 << (b % 8)) != 0)
            })
            .count() as u64;
        let old_seq = GroupHeader::decode(&read_block(dev, first)?, first).map_or(0, |h| h.seq);
        let header = GroupHeader {
            seq: old_seq.saturating_add(1),
            index: g,
            first_block: first,
            block_count: sb.group_blocks,
            free_blocks: sb.group_blocks - used,
            bitmap_blocks: sb.bitmap_blocks,
        };
        write_block(dev, first, &header.encode())?;
        out.fixed.push(format!(
            "rebuild-group: group {g}: bitmap and header rewritten from what the inodes hold ({used} blocks used, {} free{})",
            sb.group_blocks - used,
            if free_leaked {
                ""
            } else {
                "; blocks marked used that nothing holds are kept"
            }
        ));
    }
    Ok(())
}

/// `link-count` and `block-count`.
/// `complete`: the check saw every directory entry, so a link count it found too high is
/// (without that, preen only raises link counts: lowering one below the names a record it
/// could not read holds would free a file that is still named).
fn inodes(
    dev: &dyn BlockDevice,
    report: &Report,
    mode: Mode,
    complete: bool,
    out: &mut Repaired,
) -> Result<()> {
    let plan = &report.plan;
    let drop_xattrs = if mode == Mode::All {
        plan.drop_xattrs.clone()
    } else {
        BTreeSet::new()
    };
    let inos: BTreeSet<u64> = plan
        .link_counts
        .keys()
        .chain(plan.block_counts.keys())
        .chain(plan.dir_parents.keys())
        .chain(drop_xattrs.iter())
        .copied()
        .collect();
    for ino in inos {
        let Ok(mut inode) = Inode::decode(&read_block(dev, ino)?, ino) else {
            continue;
        };
        let mut what = Vec::new();
        if let Some(&want) = plan.link_counts.get(&ino) {
            let lower_ok = want > 0 && complete;
            if mode == Mode::All || want > inode.nlink || lower_ok {
                what.push(format!(
                    "link-count: inode {ino}: link count {} -> {want}",
                    inode.nlink
                ));
                inode.nlink = want;
            }
        }
        if let Some(&held) = plan.block_counts.get(&ino) {
            what.push(format!(
                "block-count: inode {ino}: block count {} -> {held}",
                inode.blocks
            ));
            inode.blocks = held;
        }
        if let Some(&parent) = plan.dir_parents.get(&ino) {
            what.push(format!(
                "dir-parent: directory {ino}: parent {} -> {parent}",
                inode.parent
            ));
            inode.parent = parent;
        }
        if drop_xattrs.contains(&ino) && inode.xattr_block != 0 {
            what.push(format!(
                "drop-xattr: inode {ino}: its unusable xattr set (block {}) dropped",
                inode.xattr_block
            ));
            inode.xattr_block = 0;
        }
        if !what.is_empty() {
            inode.seq = inode.seq.saturating_add(1);
            write_block(dev, ino, &inode.encode())?;
            out.fixed.extend(what);
        }
    }
    Ok(())
}

/// `unorphan` and `slot-header`.
fn slot_headers(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    report: &Report,
    mode: Mode,
    out: &mut Repaired,
) -> Result<()> {
    use crate::format::slot_header::SlotHeader;
    let at = |slot: u32| sb.journal_of(slot);
    let plan = &report.plan;
    let slots: BTreeSet<u32> = plan.unorphan.iter().map(|&(s, _)| s).collect();
    for slot in slots {
        let Ok(mut h) = SlotHeader::decode(&read_block(dev, at(slot))?, at(slot), slot) else {
            continue;
        };
        let linked: Vec<u64> = plan
            .unorphan
            .iter()
            .filter(|&&(s, _)| s == slot)
            .map(|&(_, i)| i)
            .collect();
        h.orphans.retain(|o| !linked.contains(o));
        h.seq = h.seq.saturating_add(1);
        write_block(dev, at(slot), &h.encode(at(slot)))?;
        out.fixed.push(format!(
            "unorphan: node slot {slot}: inodes {linked:?} (which still have links, or are not inode blocks) taken off its orphan list"
        ));
    }
    if mode == Mode::All {
        for &slot in &plan.bad_slot_headers {
            let h = SlotHeader {
                seq: 1,
                slot,
                orphans: Vec::new(),
            };
            write_block(dev, at(slot), &h.encode(at(slot)))?;
            out.fixed.push(format!(
                "slot-header: node slot {slot}: its unusable header rewritten with an empty orphan list"
            ));
        }
    }
    Ok(())
}

/// `discard-journal`: a committed transaction that logs a block which is not a metadata home
/// (`journal::check_homes`) is refused whole by mount, and by fsck's replay; it is never
/// applied, so the volume stays as its home blocks are and the transaction's changes are lost.
/// The journal is marked empty as a replay leaves it.
fn journals(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    report: &Report,
    out: &mut Repaired,
) -> Result<()> {
    use crate::journal::{find_tx, invalidate, JournalArea};
    for &slot in &report.plan.bad_journals {
        let area = JournalArea::for_slot(sb, slot);
        let Some(tx) = find_tx(dev, area)? else {
            continue;
        };
        invalidate(dev, area)?;
        out.fixed.push(format!(
            "discard-journal: node slot {slot}: committed transaction {} ({} blocks), which a mount refuses to replay, discarded; its changes are lost",
            tx.seq,
            tx.blocks.len()
        ));
    }
    Ok(())
}

/// `clear-inode`: a symlink whose target cannot be read as it was written (size, inline
/// bytes and overflow block disagree, or the overflow block is unusable) is cleared, as
/// e2fsck clears an invalid symlink: which of its fields is wrong cannot be told, and a
/// symlink served with a guessed target could point anywhere. Its inode block is zeroed; the
/// next round finds the entries naming it naming no inode (`drop-entry`), and the round after
/// frees its blocks (`free-leaked`).
fn clear_symlinks(dev: &dyn BlockDevice, report: &Report, out: &mut Repaired) -> Result<()> {
    for &ino in &report.plan.clear_inodes {
        let Ok(inode) = Inode::decode(&read_block(dev, ino)?, ino) else {
            continue;
        };
        if !inode.is_symlink() {
            continue;
        }
        write_block(dev, ino, &[0u8; FS_BLOCK_SIZE])?;
        out.fixed.push(format!(
            "clear-inode: symlink {ino} ({} bytes, {} inline, overflow block {}) cleared",
            inode.size,
            inode.inline_data.len(),
            inode.overflow_block
        ));
    }
    Ok(())
}

/// `reset-record`: one logical block of zeros is the empty state of every control record.
fn records(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    report: &Report,
    out: &mut Repaired,
) -> Result<()> {
    let lbs = sb.logical_block_size as usize;
    if dev.geometry().logical_block_size != sb.logical_block_size {
        return Ok(());
    }
    let zero = AlignedBuf::new(lbs);
    for &offset in &report.plan.reset_records {
        dev.write_at(offset, &zero)?;
        out.fixed.push(format!(
            "reset-record: {} rewritten empty",
            describe_record(sb, offset)
        ));
    }
    Ok(())
}

fn describe_record(sb: &Superblock, offset: u64) -> String {
    let lbs = u64::from(sb.logical_block_size);
    let hb = sb.hb_start * FS_BLOCK;
    let locks = sb.lock_start * FS_BLOCK;
    if (hb..hb + u64::from(sb.hb_slots) * lbs).contains(&offset) {
        return format!("heartbeat slot {}", (offset - hb) / lbs);
    }
    if let Some(area) = sb.object_lock_area() {
        if (area.bucket_offset..area.bucket_offset + area.buckets * lbs).contains(&offset) {
            return format!("object-lock bucket {}", (offset - area.bucket_offset) / lbs);
        }
        if offset >= area.mailbox_offset {
            return format!(
                "the mailbox of slot {}",
                (offset - area.mailbox_offset) / lbs
            );
        }
    }
    if offset >= locks {
        return format!("lock record {}", (offset - locks) / lbs);
    }
    format!("the record at byte {offset}")
}

/// The repairs that change directories (`-y` only), which fsck makes through the filesystem
/// mounted in its own slot (`fs/fsck.rs`).
#[derive(Debug, Default, Clone)]
pub struct Namespace {
    /// `drop-entry`: (directory, name hash, name; None for a record that does not decode).
    pub drop_entries: Vec<(u64, u64, Option<Vec<u8>>)>,
    /// `reconnect`: unreachable inodes to link into `/lost+found`.
    pub reconnect: Vec<u64>,
    /// `entry-type`: (directory, name hash, name, file type).
    pub entry_types: Vec<(u64, u64, Vec<u8>, u8)>,
    /// `rehash-entry`: (directory, the hash it is stored under, name).
    pub rehash: Vec<(u64, u64, Vec<u8>)>,
    /// `drop-duplicate`: (directory, hash) of records holding a name twice.
    pub dedup: Vec<(u64, u64)>,
}

impl Namespace {
    pub fn is_empty(&self) -> bool {
        self.drop_entries.is_empty()
            && self.reconnect.is_empty()
            && self.entry_types.is_empty()
            && self.rehash.is_empty()
            && self.dedup.is_empty()
    }
}

/// Most leaked blocks read when looking for unreachable inodes (4 GiB): beyond that they are
/// freed without a look.
const RECONNECT_SCAN_MAX: u64 = 1 << 20;
/// Blocks read at once while looking.
const SCAN_CHUNK: u64 = 256;

/// The namespace repairs for `report` (none but with [`Mode::All`]): its entries to drop, and
/// the unreachable inodes among its leaked blocks (every block that decodes as the inode of
/// its own number). Directories first: if there are any, only those whose parent is not
/// itself unreachable; the files are reconnected in a later round if they are still
/// unreachable then.
pub fn plan_namespace(dev: &dyn BlockDevice, report: &Report, mode: Mode) -> Result<Namespace> {
    let mut ns = Namespace::default();
    if mode != Mode::All {
        return Ok(ns);
    }
    ns.drop_entries.clone_from(&report.plan.drop_entries);
    ns.entry_types.clone_from(&report.plan.entry_types);
    ns.rehash.clone_from(&report.plan.rehash_entries);
    ns.dedup.clone_from(&report.plan.dup_records);
    let mut found: Vec<(u64, bool, u64)> = Vec::new();
    let mut budget = RECONNECT_SCAN_MAX;
    for &(s, e) in &report.plan.leaked {
        let mut at = s;
        while at < e && budget > 0 {
            let n = SCAN_CHUNK.min(e - at).min(budget);
            let len = usize::try_from(n * FS_BLOCK).unwrap_or(usize::MAX);
            let buf = crate::dev::read_aligned(dev, at * FS_BLOCK, len)?;
            for (b, raw) in (at..).zip(buf.chunks(FS_BLOCK_SIZE)) {
                if let Ok(i) = Inode::decode(raw, b) {
                    found.push((b, i.is_dir(), i.parent));
                }
            }
            at += n;
            budget -= n;
        }
    }
    // Only candidates that hold nothing but leaked blocks, none another candidate holds, and
    // (directories) name only unreachable inodes: a stale inode image left in a block that
    // was freed would otherwise come back holding blocks of live files, or naming them.
    let sb = report
        .superblock
        .as_ref()
        .ok_or_else(|| Error::corrupted("no superblock"))?;
    let mut taken: Vec<(u64, u64)> = Vec::new();
    found.retain(
        |&(ino, _, _)| match held_if_unclaimed(dev, sb, ino, &report.plan.leaked) {
            Some(held) if !held.iter().any(|&(s, e)| overlaps(&taken, s, e)) => {
                taken.extend(held);
                true
            }
            _ => false,
        },
    );
    let dirs: BTreeSet<u64> = found.iter().filter(|f| f.1).map(|f| f.0).collect();
    ns.reconnect = if dirs.is_empty() {
        found.iter().map(|f| f.0).collect()
    } else {
        found
            .iter()
            .filter(|f| f.1 && !dirs.contains(&f.2))
            .map(|f| f.0)
            .collect()
    };
    Ok(ns)
}

/// Does any of the ranges `[s, e)` in `set` overlap `[s0, e0)`?
fn overlaps(set: &[(u64, u64)], s0: u64, e0: u64) -> bool {
    set.iter().any(|&(s, e)| s < e0 && s0 < e)
}

/// Is `[s, s + len)` inside one of the sorted, disjoint ranges of `leaked`?
fn inside(leaked: &[(u64, u64)], s: u64, len: u64) -> bool {
    let i = leaked.partition_point(|&(ls, _)| ls <= s);
    i > 0 && leaked[i - 1].1 >= s.saturating_add(len)
}

/// The blocks unreachable inode `ino` holds, if every one of them is leaked and, for a
/// directory, every inode it names is unreachable too (its block is leaked); None otherwise.
fn held_if_unclaimed(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    ino: u64,
    leaked: &[(u64, u64)],
) -> Option<Vec<(u64, u64)>> {
    let inode = Inode::decode(&read_block(dev, ino).ok()?, ino).ok()?;
    let mut held = vec![(ino, ino + 1)];
    for b in [inode.xattr_block, inode.overflow_block] {
        if b != 0 {
            held.push((b, b + 1));
        }
    }
    if inode.is_reg() {
        let map = crate::inspect::file_map(dev, sb, ino).ok()?;
        held.extend(
            map.extents
                .iter()
                .map(|e| (e.physical, e.physical + u64::from(e.len))),
        );
        if inode.tree_root != 0 {
            let (nodes, _) = crate::inspect::tree(dev, sb, ino, inode.tree_root).ok()?;
            held.extend(nodes.into_iter().map(|b| (b, b + 1)));
        }
    } else if inode.is_dir() && inode.tree_root != 0 {
        let (nodes, leaves) = crate::inspect::tree(dev, sb, ino, inode.tree_root).ok()?;
        held.extend(nodes.into_iter().map(|b| (b, b + 1)));
        for (_, v) in leaves {
            let entries = crate::format::dirent::decode_entries(&v).ok()?;
            if entries.iter().any(|e| !inside(leaked, e.ino, 1)) {
                return None;
            }
        }
    }
    held.iter()
        .all(|&(s, e)| inside(leaked, s, e - s))
        .then_some(held)
}

/// The namespace repairs of `ns` on the volume `mount` mounts (and this unmounts). Returns a
/// line per repair made.
fn namespace(
    ns: &Namespace,
    mount: &dyn Fn() -> Result<std::sync::Arc<crate::fs::Volume>>,
) -> Result<Vec<String>> {
    let vol = mount().map_err(|e| e.wrap("mounting the volume for the directory repairs"))?;
    let mut out = Vec::new();
    let result = (|| {
        for (dir, hash, name) in &ns.drop_entries {
            if vol.fsck_drop_entry(*dir, *hash, name.as_deref())? {
                out.push(match name {
                    Some(n) => format!(
                        "drop-entry: directory {dir}: entry {:?} removed",
                        String::from_utf8_lossy(n)
                    ),
                    None => format!(
                        "drop-entry: directory {dir}: the record under hash {hash:#x} removed"
                    ),
                });
            }
        }
        for (dir, hash, name, dtype) in &ns.entry_types {
            if vol.fsck_set_entry_type(*dir, *hash, name, *dtype)? {
                out.push(format!(
                    "entry-type: directory {dir}: entry {:?} now of type {dtype}",
                    String::from_utf8_lossy(name)
                ));
            }
        }
        for &(dir, hash) in &ns.dedup {
            if vol.fsck_dedup_record(dir, hash)? {
                out.push(format!(
                    "drop-duplicate: directory {dir}: the second entries of a name under hash {hash:#x} removed"
                ));
            }
        }
        for (dir, hash, name) in &ns.rehash {
            if vol.fsck_rehash_entry(*dir, *hash, name)? {
                out.push(format!(
                    "rehash-entry: directory {dir}: entry {:?}, stored under hash {hash:#x}, moved to its name's hash",
                    String::from_utf8_lossy(name)
                ));
            }
        }
        for &ino in &ns.reconnect {
            let path = vol.fsck_reconnect(ino)?;
            out.push(format!("reconnect: inode {ino} linked as {path}"));
        }
        Ok(())
    })();
    let unmounted = vol.unmount();
    result.and(unmounted).map(|()| out)
}

/// What [`rounds`] did.
#[derive(Debug)]
pub struct Outcome {
    /// The check before any repair.
    pub first: Report,
    /// The check after the last round.
    pub last: Report,
    /// Repairs made.
    pub fixed: usize,
}

/// Rounds of repairs before giving up on a volume that keeps showing new problems.
pub const MAX_ROUNDS: usize = 6;

/// Check and repair in rounds until a check is clean or a round repairs nothing (at most
/// [`MAX_ROUNDS`]): each round plans the namespace repairs, makes the block-level repairs,
/// then (with `-y`) the namespace ones on the volume `mount` mounts, and checks again.
/// `check` runs one check; `each` hears every round's report and repairs.
pub fn rounds(
    dev: &dyn BlockDevice,
    mode: Mode,
    check: &mut dyn FnMut(bool) -> Result<Report>,
    mount: &dyn Fn() -> Result<std::sync::Arc<crate::fs::Volume>>,
    each: &mut dyn FnMut(usize, &Report, &[String]),
) -> Result<Outcome> {
    let first = check(true)?;
    let mut report = first.clone();
    let mut fixed = 0;
    for round in 0..MAX_ROUNDS {
        if report.is_clean() {
            break;
        }
        let ns = plan_namespace(dev, &report, mode)?;
        let mut done = repair(dev, &report, mode, !ns.reconnect.is_empty())?.fixed;
        if !ns.is_empty() {
            done.extend(namespace(&ns, mount)?);
        }
        each(round, &report, &done);
        fixed += done.len();
        report = check(false)?;
        if done.is_empty() {
            break;
        }
    }
    Ok(Outcome {
        first,
        last: report,
        fixed,
    })
}
