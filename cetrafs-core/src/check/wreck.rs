//! The corruption injector (a test tool, as OCFS2's fswreck and GFS2's nukerg): one named
//! corruption per repair of `check/repair.rs`, applied to a populated, unmounted volume, so
//! the tests can prove that `fsck.cetra` finds each one, repairs it, and leaves every file
//! the corruption did not touch as it was.
//!
//! Each [`Case`] says which finding the check must report, whether preen (`-p`) repairs it,
//! and what the repaired volume holds of the files it touched ([`Effect`]). Cases that change
//! an inode take the target file's inode number (its block number: a `stat` on a mount gives
//! it); that file must be a small regular file in the root directory (inline extents, at least
//! one block written, at most two blocks per extent), and the root must hold a subdirectory,
//! a symlink, another regular file whose first extent is at least as long as the target's,
//! and exactly one regular file with an extent tree of more than one level (more than 160
//! extents: every other 4 KiB block of 1.6 MB written); the root's subdirectory must hold a
//! directory with a two-level entry tree (150 entries with long names). The cases that unlink something do it through the
//! filesystem (a mount of the volume), the others write blocks.

use super::FindingKind;
use crate::cluster::lock::LockLayout;
use crate::dev::{read_aligned, AlignedBuf, BlockDevice, SharedDevice};
use crate::error::{Error, Result};
use crate::format::dirent::DirEntry;
use crate::format::extent::Extent;
use crate::format::group::{decode_bitmap, encode_bitmap, GroupHeader, BITS_PER_BITMAP_BLOCK};
use crate::format::inode::Inode;
use crate::format::lock_record::LockMode;
use crate::format::superblock::Superblock;
use crate::format::tree_node::{NodeEntries, TreeNode};
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};

/// One corruption.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub name: &'static str,
    pub what: &'static str,
    /// The finding the check reports for it.
    pub finding: FindingKind,
    /// `fsck.cetra -p` repairs it (else only `-y`).
    pub preen: bool,
    /// What the repaired volume holds of what the case touched.
    pub effect: Effect,
}

/// What `fsck.cetra -y` leaves of what a case touched (every other file is unchanged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Every file is where it was, unchanged.
    Nothing,
    /// The target file is gone (its inode was destroyed).
    TargetGone,
    /// The target file is `/lost+found/#INO`, unchanged.
    TargetInLostFound,
    /// The root's first subdirectory is `/lost+found/#INO`, its files unchanged.
    DirInLostFound,
    /// The target file keeps its length; its bytes are another file's (its blocks were given
    /// to that file, it reads a copy of them), so they are not compared.
    TargetChanged,
    /// The target file keeps its length; each 4 KiB block of it reads as before or as zeros
    /// (a hole where a pointer was dropped).
    TargetHoles,
    /// The file with an extent tree keeps its length; its last written 4 KiB block reads as
    /// its first (the block it was pointed at; it now holds a copy of it).
    TreeFileLastIsFirst,
    /// The entries of the first leaf of the one directory with a two-level entry tree are
    /// gone from it; the files they named are in `/lost+found` as `#INO`, unchanged.
    DirPartInLostFound,
    /// The root's symlink is gone (cleared); every file is unchanged.
    SymlinkGone,
    /// The file with an extent tree keeps its length; each 4 KiB block of it reads as before or
    /// as zeros (the ranges a damaged tree node mapped are holes).
    TreeFileHoles,
}

/// Which file of the populated volume a test compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileRole {
    Target,
    /// The one file with an extent tree.
    TreeFile,
    Other,
}

impl Effect {
    /// Does `got` (a file's contents after the repair) agree with `want` (before the
    /// corruption) for a file of `role`?
    pub fn contents_ok(self, role: FileRole, got: &[u8], want: &[u8]) -> bool {
        match (self, role) {
            (Self::TargetChanged, FileRole::Target) => got.len() == want.len(),
            (Self::TargetHoles, FileRole::Target) | (Self::TreeFileHoles, FileRole::TreeFile) => {
                got.len() == want.len()
                    && got
                        .chunks(FS_BLOCK_SIZE)
                        .zip(want.chunks(FS_BLOCK_SIZE))
                        .all(|(g, w)| g == w || g.iter().all(|&b| b == 0))
            }
            (Self::TreeFileLastIsFirst, FileRole::TreeFile) => {
                let mut expected = want.to_vec();
                let blocks = expected.chunks(FS_BLOCK_SIZE).count();
                let last = (0..blocks).rev().find(|&k| {
                    expected
                        .chunks(FS_BLOCK_SIZE)
                        .nth(k)
                        .is_some_and(|b| b.iter().any(|&x| x != 0))
                });
                if let (Some(k), Some(first)) = (last, want.get(..FS_BLOCK_SIZE)) {
                    let at = k * FS_BLOCK_SIZE;
                    let end = (at + FS_BLOCK_SIZE).min(expected.len());
                    expected[at..end].copy_from_slice(&first[..end - at]);
                }
                got == expected
            }
            _ => got == want,
        }
    }
}

pub const CASES: &[Case] = &[
    Case {
        name: "primary-superblock",
        what: "garbage over the primary superblock",
        finding: FindingKind::PrimarySuperblock,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "backup-superblock",
        what: "garbage over the backup superblock",
        finding: FindingKind::BackupSuperblock,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "group-header",
        what: "garbage over the header of the target file's group",
        finding: FindingKind::GroupHeader,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "free-count",
        what: "the free count of the target file's group off by 7",
        finding: FindingKind::FreeCount,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "bitmap-block",
        what: "garbage over the first bitmap block of the target file's group",
        finding: FindingKind::Bitmap,
        // Preen marks every block it covered used: the free ones are leaks for -y.
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "used-marked-free",
        what: "the bitmap bit of the target file's first data block cleared",
        finding: FindingKind::BlockFree,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "group-metadata-free",
        what: "the bitmap bit of the group's own bitmap block cleared",
        finding: FindingKind::GroupMetadataFree,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "bits-past-end",
        what: "a bitmap bit past the end of the last group cleared",
        finding: FindingKind::BitsPastEnd,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "leaked-blocks",
        what: "8 free blocks of the last group marked used",
        finding: FindingKind::BlockLeaked,
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "link-count",
        what: "the target file's link count raised by 2",
        finding: FindingKind::LinkCount,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "block-count",
        what: "the target file's block count raised by 5",
        finding: FindingKind::BlockCount,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "heartbeat-slot",
        what: "garbage over the heartbeat slot of the last node slot",
        finding: FindingKind::Heartbeat,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "lock-record",
        what: "garbage over the global lock record",
        finding: FindingKind::LockRecord,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "stale-lock-owner",
        what: "the global lock record held exclusively by a slot that holds nothing",
        finding: FindingKind::LockRecord,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "object-lock-bucket",
        what: "garbage over object-lock bucket 0 (format 3 and later)",
        finding: FindingKind::ObjectLock,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "mailbox",
        what: "garbage over the lock-request mailbox of slot 1 (format 3 and later)",
        finding: FindingKind::Mailbox,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "dir-parent",
        what: "the parent field of the root's first subdirectory pointed at itself",
        finding: FindingKind::DirParent,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "orphan-linked",
        what: "the target file (which has a link) put on node slot 0's orphan list",
        finding: FindingKind::Orphan,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "slot-header",
        what: "garbage over the header (orphan list) of node slot 1",
        finding: FindingKind::SlotHeader,
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "bad-xattr",
        what: "garbage over the target file's xattr block (it must have one)",
        finding: FindingKind::BadXattr,
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "entry-type",
        what: "the target file's entry in the root says directory",
        finding: FindingKind::EntryType,
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "bad-inode",
        what: "garbage over the target file's inode block",
        finding: FindingKind::BadInode,
        preen: false,
        effect: Effect::TargetGone,
    },
    Case {
        name: "unreachable-file",
        what: "the target file's directory entry removed, its inode left",
        finding: FindingKind::BlockLeaked,
        preen: false,
        effect: Effect::TargetInLostFound,
    },
    Case {
        name: "unreachable-dir",
        what: "the entry of the root's first subdirectory removed, the directory left",
        finding: FindingKind::BlockLeaked,
        preen: false,
        effect: Effect::DirInLostFound,
    },
    Case {
        name: "shared-blocks",
        what: "the target file's first extent pointed at the first blocks of another file",
        finding: FindingKind::BlockShared,
        preen: false,
        effect: Effect::TargetChanged,
    },
    Case {
        name: "extent-over-inode",
        what: "the target file's first extent pointed (1 block long) at the inode block of the first file of the root's first subdirectory",
        finding: FindingKind::BlockShared,
        preen: false,
        effect: Effect::TargetChanged,
    },
    Case {
        name: "overlapping-extent",
        what: "an extent over the target file's block 1 added, naming a free block (marked used)",
        finding: FindingKind::BadExtent,
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "extent-past-eof",
        what: "a written extent at the target file's end-of-file block added, naming a free block (marked used)",
        finding: FindingKind::BadExtent,
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "extent-outside-groups",
        what: "the target file's first extent pointed at the journal area",
        finding: FindingKind::BlockOutsideGroups,
        preen: false,
        effect: Effect::TargetHoles,
    },
    Case {
        name: "xattr-outside-groups",
        what: "the target file's xattr block pointer pointed at the journal area",
        finding: FindingKind::BlockOutsideGroups,
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "orphan-outside-groups",
        what: "a block of the journal area put on node slot 0's orphan list",
        finding: FindingKind::BlockOutsideGroups,
        preen: true,
        effect: Effect::Nothing,
    },
    Case {
        name: "bad-tree",
        what: "garbage over the first leaf of the extent tree of the root's file that has one",
        finding: FindingKind::BadTree,
        preen: false,
        effect: Effect::TreeFileHoles,
    },
    Case {
        name: "tree-self-shared",
        what: "the last extent in the extent tree of the root's file that has one pointed at the block of its first",
        finding: FindingKind::BlockShared,
        preen: false,
        effect: Effect::TreeFileLastIsFirst,
    },
    Case {
        name: "bad-dir-tree",
        what: "garbage over the first leaf of the entry tree of the directory that has two levels",
        finding: FindingKind::BadTree,
        preen: false,
        effect: Effect::DirPartInLostFound,
    },
    Case {
        name: "wrong-hash",
        what: "the target file's entry in the root moved to the record of another hash",
        finding: FindingKind::BadEntry,
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "duplicate-name",
        what: "a second copy of the target file's entry added to its record",
        finding: FindingKind::BadEntry,
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "dir-linked-twice",
        what: "an entry `again` naming the root's first subdirectory added inside it",
        finding: FindingKind::DirLinkedTwice,
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "bad-journal",
        what: "a committed transaction logging the primary superblock written into the journal of the last node slot",
        finding: FindingKind::BadJournal,
        preen: false,
        effect: Effect::Nothing,
    },
    Case {
        name: "bad-symlink",
        what: "the size of the root's symlink raised by 5 (it no longer matches its target)",
        finding: FindingKind::Symlink,
        preen: false,
        effect: Effect::SymlinkGone,
    },
];

/// The case called `name`.
pub fn case(name: &str) -> Option<&'static Case> {
    CASES.iter().find(|c| c.name == name)
}

fn garbage(len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    for (i, x) in b.iter_mut().enumerate() {
        *x = u8::try_from(i.wrapping_mul(31) % 251).unwrap_or(0) ^ 0xA5;
    }
    b
}

fn write_block(dev: &dyn BlockDevice, b: u64, data: &[u8]) -> Result<()> {
    dev.write_at(b * FS_BLOCK, &AlignedBuf::from_slice(data))
}

fn read_block(dev: &dyn BlockDevice, b: u64) -> Result<AlignedBuf> {
    read_aligned(dev, b * FS_BLOCK, FS_BLOCK_SIZE)
}

/// Flip bit `bit` of group `g`'s bitmap to `on`.
fn set_bit(dev: &dyn BlockDevice, sb: &Superblock, g: u64, bit: u64, on: bool) -> Result<()> {
    let at = sb.group_first_block(g) + 1 + bit / BITS_PER_BITMAP_BLOCK;
    let raw = read_block(dev, at)?;
    let (seq, payload) = decode_bitmap(&raw, at)?;
    let mut bits = payload.to_vec();
    let i = usize::try_from((bit % BITS_PER_BITMAP_BLOCK) / 8).unwrap_or(usize::MAX);
    let mask = 1u8 << (bit % 8);
    let byte = bits
        .get_mut(i)
        .ok_or_else(|| Error::corrupted("bit beyond the bitmap"))?;
    if on {
        *byte |= mask;
    } else {
        *byte &= !mask;
    }
    write_block(dev, at, &encode_bitmap(at, seq, &bits))
}

fn bit_of(dev: &dyn BlockDevice, sb: &Superblock, g: u64, bit: u64) -> Result<bool> {
    let at = sb.group_first_block(g) + 1 + bit / BITS_PER_BITMAP_BLOCK;
    let raw = read_block(dev, at)?;
    let (_, payload) = decode_bitmap(&raw, at)?;
    let i = usize::try_from((bit % BITS_PER_BITMAP_BLOCK) / 8).unwrap_or(usize::MAX);
    Ok(payload.get(i).is_some_and(|b| b & (1 << (bit % 8)) != 0))
}

fn target_inode(dev: &dyn BlockDevice, target: u64) -> Result<Inode> {
    Inode::decode(&read_block(dev, target)?, target)
        .map_err(|e| e.wrap(format!("target inode {target}")))
}

/// Apply case `name` to the unmounted volume on `dev`; `target` is the inode number of a small
/// regular file. Returns what was done.
pub fn apply(shared: &SharedDevice, name: &str, target: u64) -> Result<String> {
    let dev: &dyn BlockDevice = &**shared;
    let c = case(name).ok_or_else(|| {
        Error::new(
            crate::error::ErrorKind::InvalidInput,
            format!(
                "no corruption case {name:?}; the cases are {}",
                CASES.iter().map(|c| c.name).collect::<Vec<_>>().join(", ")
            ),
        )
    })?;
    let sb = crate::fs::read_superblock(dev)?;
    let lbs = sb.logical_block_size as usize;
    let target_group = sb
        .group_of(target)
        .ok_or_else(|| Error::corrupted(format!("inode {target} is outside the group area")))?;
    let last_group = sb.group_count.saturating_sub(1);
    let done = match c.name {
        "primary-superblock" => {
            dev.write_at(0, &garbage(FS_BLOCK_SIZE))?;
            "block 0".to_string()
        }
        "backup-superblock" => {
            dev.write_at(sb.backup_block * FS_BLOCK, &garbage(FS_BLOCK_SIZE))?;
            format!("block {}", sb.backup_block)
        }
        "group-header" => {
            let at = sb.group_first_block(target_group);
            dev.write_at(at * FS_BLOCK, &garbage(FS_BLOCK_SIZE))?;
            format!("group {target_group} header (block {at})")
        }
        "free-count" => {
            let at = sb.group_first_block(target_group);
            let mut h = GroupHeader::decode(&read_block(dev, at)?, at)?;
            h.free_blocks = h.free_blocks.saturating_sub(7);
            write_block(dev, at, &h.encode())?;
            format!("group {target_group} free count -> {}", h.free_blocks)
        }
        "bitmap-block" => {
            let at = sb.group_first_block(target_group) + 1;
            dev.write_at(at * FS_BLOCK, &garbage(FS_BLOCK_SIZE))?;
            format!("group {target_group} bitmap block {at}")
        }
        "used-marked-free" => {
            let inode = target_inode(dev, target)?;
            let e = inode
                .inline_extents
                .iter()
                .find(|e| e.len > 0)
                .ok_or_else(|| Error::corrupted(format!("inode {target} maps no block")))?;
            let g = sb
                .group_of(e.physical)
                .ok_or_else(|| Error::corrupted("extent outside the groups"))?;
            set_bit(dev, &sb, g, e.physical - sb.group_first_block(g), false)?;
            format!("block {} of inode {target} marked free", e.physical)
        }
        "group-metadata-free" => {
            set_bit(dev, &sb, target_group, 1, false)?;
            format!("group {target_group} bitmap block marked free")
        }
        "bits-past-end" => {
            let past = u64::from(sb.bitmap_blocks) * BITS_PER_BITMAP_BLOCK;
            if past <= sb.group_blocks {
                return Err(Error::corrupted(
                    "the bitmap has no bits past the end of a group on this volume",
                ));
            }
            set_bit(dev, &sb, last_group, past - 1, false)?;
            format!("group {last_group} bit {} cleared", past - 1)
        }
        "leaked-blocks" => {
            let mut marked = Vec::new();
            let mut bit = sb.group_blocks;
            while marked.len() < 8 && bit > 0 {
                bit -= 1;
                if !bit_of(dev, &sb, last_group, bit)? {
                    set_bit(dev, &sb, last_group, bit, true)?;
                    marked.push(sb.group_first_block(last_group) + bit);
                }
            }
            format!("blocks {marked:?} marked used")
        }
        "link-count" | "block-count" => {
            let mut inode = target_inode(dev, target)?;
            if c.name == "link-count" {
                inode.nlink += 2;
            } else {
                inode.blocks += 5;
            }
            write_block(dev, target, &inode.encode())?;
            format!(
                "inode {target}: nlink {}, blocks {}",
                inode.nlink, inode.blocks
            )
        }
        "heartbeat-slot" => {
            let slot = sb.max_nodes.saturating_sub(1);
            dev.write_at(
                sb.hb_start * FS_BLOCK + u64::from(slot) * lbs as u64,
                &garbage(lbs),
            )?;
            format!("heartbeat slot {slot}")
        }
        "lock-record" => {
            dev.write_at(sb.lock_start * FS_BLOCK, &garbage(lbs))?;
            "lock record 0".to_string()
        }
        "stale-lock-owner" => {
            let layout = LockLayout::new(&sb);
            let raw = read_aligned(dev, sb.lock_start * FS_BLOCK, lbs)?;
            let mut rec = layout.decode_at(&raw, 0)?;
            rec.mode = LockMode::Exclusive;
            rec.owner = sb.max_nodes.saturating_sub(1);
            rec.owner_gen = 99;
            rec.version += 1;
            dev.write_at(
                sb.lock_start * FS_BLOCK,
                &AlignedBuf::from_slice(&rec.encode(lbs)),
            )?;
            format!("lock record 0 held by slot {} generation 99", rec.owner)
        }
        "object-lock-bucket" | "mailbox" => {
            let area = sb.object_lock_area().ok_or_else(|| {
                Error::corrupted(format!(
                    "format {} has no object locks",
                    sb.format_version()
                ))
            })?;
            let (offset, what) = if c.name == "mailbox" {
                (area.mailbox_offset + lbs as u64, "the mailbox of slot 1")
            } else {
                (area.bucket_offset, "object-lock bucket 0")
            };
            dev.write_at(offset, &garbage(lbs))?;
            what.to_string()
        }
        "bad-inode" => {
            dev.write_at(target * FS_BLOCK, &garbage(FS_BLOCK_SIZE))?;
            format!("inode block {target}")
        }
        "unreachable-file" | "unreachable-dir" => {
            root_entry(shared, c.name == "unreachable-dir", target, &|vol, e| {
                let hash = crate::format::dirent::name_hash(&e.name);
                vol.fsck_drop_entry(vol.root_ino(), hash, Some(&e.name))?;
                Ok(("removed from the root", e.ino))
            })?
            .0
        }
        "entry-type" => {
            root_entry(shared, false, target, &|vol, e| {
                let hash = crate::format::dirent::name_hash(&e.name);
                vol.fsck_set_entry_type(vol.root_ino(), hash, &e.name, 4)?;
                Ok(("now says directory", e.ino))
            })?
            .0
        }
        "wrong-hash" | "duplicate-name" => {
            root_entry(shared, false, target, &|vol, e| {
                let hash = crate::format::dirent::name_hash(&e.name);
                let entry = DirEntry {
                    name: e.name.clone(),
                    ino: e.ino,
                    dtype: e.kind.dtype(),
                };
                if c.name == "duplicate-name" {
                    vol.fsck_put_entry(vol.root_ino(), hash, entry)?;
                    return Ok(("stored twice", e.ino));
                }
                let other = crate::format::dirent::name_hash(b"wreck: another name");
                vol.fsck_drop_entry(vol.root_ino(), hash, Some(&e.name))?;
                vol.fsck_put_entry(vol.root_ino(), other, entry)?;
                Ok(("stored under another name's hash", e.ino))
            })?
            .0
        }
        "dir-linked-twice" => {
            root_entry(shared, true, target, &|vol, e| {
                let name = b"again".to_vec();
                let hash = crate::format::dirent::name_hash(&name);
                let entry = DirEntry {
                    name,
                    ino: e.ino,
                    dtype: e.kind.dtype(),
                };
                vol.fsck_put_entry(e.ino, hash, entry)?;
                Ok(("also named by its own entry `again`", e.ino))
            })?
            .0
        }
        "bad-symlink" => {
            let ino = mounted(shared, &mut |vol| {
                root_listing(vol)?
                    .into_iter()
                    .find(|e| e.kind == crate::fs::FileKind::Symlink)
                    .map(|e| e.ino)
                    .ok_or_else(|| Error::corrupted("no symlink in the root directory"))
            })?;
            let mut inode = target_inode(dev, ino)?;
            inode.size += 5;
            write_block(dev, ino, &inode.encode())?;
            format!("symlink {ino}: size {}", inode.size)
        }
        "bad-journal" => {
            use crate::journal::{write_tx, JournalArea};
            let slot = sb.max_nodes.saturating_sub(1);
            let image = read_block(dev, 0)?;
            write_tx(dev, JournalArea::for_slot(&sb, slot), 99, &[(0, &image)])?;
            format!("node slot {slot}: transaction 99 logs block 0")
        }
        "dir-parent" => {
            let (_, ino) = root_entry(shared, true, target, &|_, e| Ok(("found", e.ino)))?;
            let mut inode = Inode::decode(&read_block(dev, ino)?, ino)?;
            inode.parent = ino;
            write_block(dev, ino, &inode.encode())?;
            format!("directory {ino}: parent field {ino}")
        }
        "orphan-linked" => {
            use crate::format::slot_header::SlotHeader;
            let at = sb.journal_start;
            let mut h = SlotHeader::decode(&read_block(dev, at)?, at, 0)?;
            h.orphans.push(target);
            write_block(dev, at, &h.encode(at))?;
            format!("inode {target} on node slot 0's orphan list")
        }
        "slot-header" => {
            let at = sb.journal_start + sb.journal_blocks;
            dev.write_at(at * FS_BLOCK, &garbage(FS_BLOCK_SIZE))?;
            format!("block {at}")
        }
        "bad-xattr" => {
            let inode = target_inode(dev, target)?;
            if inode.xattr_block == 0 {
                return Err(Error::corrupted(format!(
                    "inode {target} has no xattr block to damage"
                )));
            }
            dev.write_at(inode.xattr_block * FS_BLOCK, &garbage(FS_BLOCK_SIZE))?;
            format!("xattr block {}", inode.xattr_block)
        }
        "shared-blocks" => {
            let mut inode = target_inode(dev, target)?;
            let want = first_extent(&inode)?.len;
            let other = root_files(shared)?
                .into_iter()
                .filter(|&ino| ino != target)
                .filter_map(|ino| Some((ino, target_inode(dev, ino).ok()?)))
                .find_map(|(ino, i)| {
                    let e = i.inline_extents.first()?;
                    (e.len >= want).then_some((ino, e.physical))
                })
                .ok_or_else(|| Error::corrupted("no other file with a long enough extent"))?;
            if let Some(e) = inode.inline_extents.first_mut() {
                e.physical = other.1;
            }
            write_block(dev, target, &inode.encode())?;
            format!(
                "inode {target}'s blocks {} are inode {}'s",
                other.1, other.0
            )
        }
        "extent-over-inode" => {
            // Breadth-first, the target (in the root) claims the block before its inode does.
            let (_, dir) = root_entry(shared, true, target, &|_, e| Ok(("found", e.ino)))?;
            let inner = mounted(shared, &mut |vol| {
                let mut first = None;
                vol.readdir(dir, 0, &mut |e| {
                    if e.kind == crate::fs::FileKind::Regular {
                        first = Some(e.ino);
                        return false;
                    }
                    true
                })?;
                first.ok_or_else(|| Error::corrupted("the subdirectory holds no file"))
            })?;
            let mut inode = target_inode(dev, target)?;
            first_extent(&inode)?;
            if let Some(e) = inode.inline_extents.first_mut() {
                e.physical = inner;
                e.len = 1;
            }
            write_block(dev, target, &inode.encode())?;
            format!("inode {target}: file block 0 -> inode block {inner}")
        }
        "overlapping-extent" | "extent-past-eof" => {
            let mut inode = target_inode(dev, target)?;
            let logical = if c.name == "overlapping-extent" {
                1
            } else {
                inode.size.div_ceil(FS_BLOCK)
            };
            let physical = take_free_block(dev, &sb)?;
            inode.inline_extents.push(Extent {
                logical,
                physical,
                len: 1,
                flags: 0,
            });
            inode.inline_extents.sort_by_key(|e| e.logical);
            inode.blocks += 1;
            write_block(dev, target, &inode.encode())?;
            format!("inode {target}: file block {logical} -> block {physical}")
        }
        "xattr-outside-groups" => {
            let mut inode = target_inode(dev, target)?;
            inode.xattr_block = sb.journal_start;
            write_block(dev, target, &inode.encode())?;
            format!("inode {target}: xattr block -> {}", sb.journal_start)
        }
        "orphan-outside-groups" => {
            use crate::format::slot_header::SlotHeader;
            let at = sb.journal_start;
            let mut h = SlotHeader::decode(&read_block(dev, at)?, at, 0)?;
            h.orphans.push(at);
            write_block(dev, at, &h.encode(at))?;
            format!("block {at} on node slot 0's orphan list")
        }
        "extent-outside-groups" => {
            let mut inode = target_inode(dev, target)?;
            first_extent(&inode)?;
            if let Some(e) = inode.inline_extents.first_mut() {
                e.physical = sb.journal_start;
            }
            write_block(dev, target, &inode.encode())?;
            format!("inode {target}: first extent -> block {}", sb.journal_start)
        }
        "tree-self-shared" => {
            let (ino, root) = tree_file(shared)?;
            let first = edge_leaf(dev, root, false)?;
            let last = edge_leaf(dev, root, true)?;
            let physical = match &first.entries {
                NodeEntries::Leaf(v) => v.first().map(|(k, val)| Extent::decode_value(*k, val)),
                NodeEntries::Internal(_) => None,
            }
            .ok_or_else(|| Error::corrupted("an empty leaf"))??
            .physical;
            let mut node = last;
            if let NodeEntries::Leaf(v) = &mut node.entries {
                let (k, val) = v
                    .last_mut()
                    .ok_or_else(|| Error::corrupted("an empty leaf"))?;
                let mut e = Extent::decode_value(*k, val)?;
                e.physical = physical;
                *val = e.encode_value().to_vec();
            }
            node.seq += 1;
            write_block(dev, node.blockno, &node.encode())?;
            format!(
                "inode {ino}: its last extent (in tree node {}) -> block {physical}",
                node.blockno
            )
        }
        "bad-dir-tree" => {
            let dir = big_dir(shared)?;
            let root = target_inode(dev, dir)?.tree_root;
            let leaf = edge_leaf(dev, root, false)?.blockno;
            dev.write_at(leaf * FS_BLOCK, &garbage(FS_BLOCK_SIZE))?;
            format!("directory {dir}: tree node {leaf}")
        }
        "bad-tree" => {
            let (ino, root) = tree_file(shared)?;
            let node = TreeNode::decode(&read_block(dev, root)?, root)?;
            let NodeEntries::Internal(children) = node.entries else {
                return Err(Error::corrupted(format!(
                    "inode {ino}'s extent tree is a single leaf"
                )));
            };
            let (_, leaf) = children
                .first()
                .copied()
                .ok_or_else(|| Error::corrupted("an empty internal node"))?;
            dev.write_at(leaf * FS_BLOCK, &garbage(FS_BLOCK_SIZE))?;
            format!("inode {ino}: tree node {leaf}")
        }
        other => return Err(Error::corrupted(format!("case {other} has no injector"))),
    };
    dev.flush()?;
    Ok(format!("{}: {} ({done})", c.name, c.what))
}

/// The inode's first extent (it must have one).
fn first_extent(inode: &Inode) -> Result<crate::format::extent::Extent> {
    inode
        .inline_extents
        .first()
        .copied()
        .ok_or_else(|| Error::corrupted(format!("inode {} maps no block inline", inode.ino)))
}

/// A block free in the last group's bitmap, now marked used (and counted in its group's
/// header), so only the pointer the case adds is wrong.
fn take_free_block(dev: &dyn BlockDevice, sb: &Superblock) -> Result<u64> {
    let g = sb.group_count.saturating_sub(1);
    let mut bit = sb.group_blocks;
    while bit > 0 {
        bit -= 1;
        if !bit_of(dev, sb, g, bit)? {
            set_bit(dev, sb, g, bit, true)?;
            let at = sb.group_first_block(g);
            let mut h = GroupHeader::decode(&read_block(dev, at)?, at)?;
            h.free_blocks = h.free_blocks.saturating_sub(1);
            write_block(dev, at, &h.encode())?;
            return Ok(at + bit);
        }
    }
    Err(Error::corrupted(format!("group {g} has no free block")))
}

/// The root's regular file with an extent tree, and the tree's root.
fn tree_file(shared: &SharedDevice) -> Result<(u64, u64)> {
    let dev: &dyn BlockDevice = &**shared;
    root_files(shared)?
        .into_iter()
        .filter_map(|ino| Some((ino, target_inode(dev, ino).ok()?.tree_root)))
        .find(|&(_, root)| root != 0)
        .ok_or_else(|| Error::corrupted("no file in the root has an extent tree"))
}

/// The first directory, breadth-first from the root, whose entry tree has more than one
/// level.
fn big_dir(shared: &SharedDevice) -> Result<u64> {
    let dev: &dyn BlockDevice = &**shared;
    let two_levels = |ino: u64| -> bool {
        target_inode(dev, ino)
            .ok()
            .and_then(|i| {
                let raw = read_block(dev, i.tree_root).ok()?;
                TreeNode::decode(&raw, i.tree_root).ok()
            })
            .is_some_and(|n| matches!(n.entries, NodeEntries::Internal(_)))
    };
    mounted(shared, &mut |vol| {
        let mut queue = std::collections::VecDeque::from([vol.root_ino()]);
        while let Some(dir) = queue.pop_front() {
            if two_levels(dir) {
                return Ok(dir);
            }
            let mut subdirs = Vec::new();
            vol.readdir(dir, 0, &mut |e| {
                if e.kind == crate::fs::FileKind::Directory && e.name != b"." && e.name != b".." {
                    subdirs.push(e.ino);
                }
                true
            })?;
            queue.extend(subdirs);
        }
        Err(Error::corrupted("no directory has a two-level entry tree"))
    })
}

/// The first (or `last`) leaf of the tree rooted at `root`.
fn edge_leaf(dev: &dyn BlockDevice, root: u64, last: bool) -> Result<TreeNode> {
    let mut b = root;
    for _ in 0..=crate::format::tree_node::MAX_LEVEL {
        let node = TreeNode::decode(&read_block(dev, b)?, b)?;
        let NodeEntries::Internal(children) = &node.entries else {
            return Ok(node);
        };
        let child = if last {
            children.last()
        } else {
            children.first()
        };
        b = child
            .ok_or_else(|| Error::corrupted("an empty internal node"))?
            .1;
    }
    Err(Error::corrupted("a tree deeper than its levels allow"))
}

/// The inode numbers of the regular files in the root directory, through a mount.
fn root_files(dev: &SharedDevice) -> Result<Vec<u64>> {
    mounted(dev, &mut |vol| {
        Ok(root_listing(vol)?
            .into_iter()
            .filter(|e| e.kind == crate::fs::FileKind::Regular)
            .map(|e| e.ino)
            .collect())
    })
}

/// Run `f` on a mount of the volume, and unmount.
fn mounted<T>(dev: &SharedDevice, f: &mut dyn FnMut(&crate::fs::Volume) -> Result<T>) -> Result<T> {
    use crate::fs::{MountOptions, Volume};
    let vol = Volume::mount(
        dev.clone(),
        &MountOptions {
            host: "wreck".into(),
            discard_rate: None,
            ..MountOptions::default()
        },
    )?;
    let r = f(&vol);
    let unmounted = vol.unmount();
    let done = r?;
    unmounted?;
    Ok(done)
}

fn root_listing(vol: &crate::fs::Volume) -> Result<Vec<crate::fs::DirListEntry>> {
    let mut entries = Vec::new();
    vol.readdir(vol.root_ino(), 0, &mut |e| {
        entries.push(e.clone());
        true
    })?;
    Ok(entries)
}

/// What [`root_entry`] does to the entry it found: a word for the report, and a number.
type EntryAction =
    dyn Fn(&crate::fs::Volume, &crate::fs::DirListEntry) -> Result<(&'static str, u64)>;

/// Through the filesystem (a mount), apply `action` to the root's entry of the target file (or
/// of the root's first subdirectory). Returns "entry NAME (inode N) " + what `action` says,
/// and the number it returns.
fn root_entry(
    dev: &SharedDevice,
    dir: bool,
    target: u64,
    action: &EntryAction,
) -> Result<(String, u64)> {
    use crate::fs::FileKind;
    mounted(dev, &mut |vol| {
        let e = root_listing(vol)?
            .into_iter()
            .find(|e| {
                if dir {
                    e.kind == FileKind::Directory && e.name != b"." && e.name != b".."
                } else {
                    e.ino == target
                }
            })
            .ok_or_else(|| Error::corrupted("no such entry in the root directory"))?;
        let (did, n) = action(vol, &e)?;
        Ok((
            format!(
                "entry {:?} (inode {}) {did}",
                String::from_utf8_lossy(&e.name),
                e.ino
            ),
            n,
        ))
    })
}
