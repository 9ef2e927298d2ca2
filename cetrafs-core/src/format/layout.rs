//! The volume's layout as the superblock fixes it, and the one rule for block pointers read
//! from disk.
//!
//! Every fs block of a volume belongs to exactly one [`Region`]: the superblock (block 0), the
//! CAW probe block, the heartbeat slots, the lock records, the object-lock buckets and the
//! lock-request mailboxes (format v3), the per-slot journals (whose first
//! block is the slot header), the allocation groups (each: header, bitmap blocks, then data), the
//! unused blocks between or after those regions, and the backup superblock. Blocks at or past
//! `total_blocks` lie outside the volume.
//!
//! **Pointer rule.** A block number that a decoded structure names — an extent's physical run,
//! a tree's root or child, an xattr block, an orphan list entry, a directory entry's inode — is
//! only ever followed if it lies in the *data part* of an allocation group (after the group's
//! header and bitmap blocks); an extent's whole run must lie in the data part of one group (a
//! run crossing into the next group would cover that group's header). Anything else is
//! corruption: [`Superblock::check_data_block`] / [`Superblock::check_data_range`] return
//! [`ErrorKind::Corrupted`] (EIO) naming the inode, the block and the region it hit, and log a
//! warning. Nothing is then read from or written to that block. The runtime checks once, where
//! the pointer is decoded into memory (the extent map at inode load, every tree node read, the
//! orphan list at mount); fsck reports the same violations through
//! [`Superblock::bad_data_range`], so both apply one rule.
//!
//! Allowed homes of a logged journal block are wider — any block of an allocation group, or a
//! slot header — see [`Superblock::check_journal_home`].

use super::superblock::Superblock;
use crate::error::{Error, Result};
use std::fmt;

/// Where an fs block lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    Superblock,
    Probe,
    Heartbeat,
    Lock,
    /// The object-lock buckets (format v3).
    ObjectLock,
    /// The lock-request mailboxes (format v3).
    Mailbox,
    /// Block `index` of slot `slot`'s journal; index 0 is the slot header.
    Journal {
        slot: u64,
        index: u64,
    },
    GroupHeader {
        group: u64,
    },
    GroupBitmap {
        group: u64,
    },
    /// Inodes, tree nodes, xattr blocks and file data: the only blocks pointers may name.
    GroupData {
        group: u64,
    },
    /// Inside the volume but in no region (alignment gaps, the tail before the backup).
    Unused,
    BackupSuperblock,
    /// At or past `total_blocks`.
    OutsideVolume,
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Superblock => f.write_str("the superblock"),
            Self::Probe => f.write_str("the CAW probe block"),
            Self::Heartbeat => f.write_str("the heartbeat area"),
            Self::Lock => f.write_str("the lock area"),
            Self::ObjectLock => f.write_str("the object-lock area"),
            Self::Mailbox => f.write_str("the lock-request mailboxes"),
            Self::Journal { slot, index: 0 } => write!(f, "the slot header of node slot {slot}"),
            Self::Journal { slot, .. } => write!(f, "the journal of node slot {slot}"),
            Self::GroupHeader { group } => write!(f, "the header of group {group}"),
            Self::GroupBitmap { group } => write!(f, "the bitmap of group {group}"),
            Self::GroupData { group } => write!(f, "the data area of group {group}"),
            Self::Unused => f.write_str("an unused area"),
            Self::BackupSuperblock => f.write_str("the backup superblock"),
            Self::OutsideVolume => f.write_str("outside the volume"),
        }
    }
}

/// What kind of on-disk pointer is being checked (for the message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointerKind {
    /// An extent's physical run.
    Extent,
    /// A B+tree root or child (directory or extent tree).
    TreeNode,
    /// An inode's xattr block.
    Xattr,
    /// An overflow block (format v2): of an xattr set, or a long symlink target.
    Overflow,
    /// An entry of a slot header's orphan list.
    Orphan,
    /// A directory entry's (or a parent field's) inode number.
    Inode,
}

impl fmt::Display for PointerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Extent => "extent",
            Self::TreeNode => "tree node pointer",
            Self::Xattr => "xattr block pointer",
            Self::Overflow => "overflow block pointer",
            Self::Orphan => "orphan list entry",
            Self::Inode => "inode number",
        })
    }
}

fn within(b: u64, start: u64, len: u64) -> Option<u64> {
    b.checked_sub(start).filter(|&off| off < len)
}

impl Superblock {
    /// The region holding fs block `b`. Relies on the region order and sizes that
    /// `Superblock::decode` validated.
    pub fn region_of(&self, b: u64) -> Region {
        if b >= self.total_blocks {
            return Region::OutsideVolume;
        }
        if b == 0 {
            return Region::Superblock;
        }
        if b == self.backup_block {
            return Region::BackupSuperblock;
        }
        if b == self.probe_block {
            return Region::Probe;
        }
        if within(b, self.hb_start, self.hb_blocks).is_some() {
            return Region::Heartbeat;
        }
        if within(b, self.lock_start, self.lock_blocks).is_some() {
            return Region::Lock;
        }
        if within(b, self.objlock_start, self.objlock_blocks()).is_some() {
            return Region::ObjectLock;
        }
        if within(b, self.mailbox_start, self.mailbox_blocks()).is_some() {
            return Region::Mailbox;
        }
        let journals = self
            .journal_blocks
            .saturating_mul(u64::from(self.base_journals()));
        if let Some(off) = within(b, self.journal_start, journals) {
            // journal_blocks > 0 here, since the area is not empty.
            return Region::Journal {
                slot: off / self.journal_blocks,
                index: off % self.journal_blocks,
            };
        }
        // v6: the journals of slots added after mkfs, inside groups.
        let base = u64::from(self.base_journals());
        for (i, &start) in (0u64..).zip(&self.extra_journals) {
            if let Some(index) = within(b, start, self.journal_blocks) {
                return Region::Journal {
                    slot: base + i,
                    index,
                };
            }
        }
        self.group_region_of(b)
    }

    /// [`Superblock::region_of`] for a block of the group area, as mkfs laid it out (an added
    /// slot's journal counts as the group data it was taken from).
    pub(crate) fn group_region_of(&self, b: u64) -> Region {
        let groups = self.group_blocks.saturating_mul(self.group_count);
        if let Some(off) = within(b, self.group_start, groups) {
            let (group, at) = (off / self.group_blocks, off % self.group_blocks);
            return match at {
                0 => Region::GroupHeader { group },
                a if a <= u64::from(self.bitmap_blocks) => Region::GroupBitmap { group },
                _ => Region::GroupData { group },
            };
        }
        Region::Unused
    }

    /// True if `b` is in the data part of an allocation group.
    pub fn is_data_block(&self, b: u64) -> bool {
        matches!(self.region_of(b), Region::GroupData { .. })
    }

    /// The pointer rule as a pure function: `None` if `[start, start+len)` (len >= 1) lies in
    /// the data part of one allocation group, else the region of its first block that does not
    /// (the block itself is `start` unless the region is a following group's header, or
    /// `OutsideVolume` for a run whose end overflows).
    pub fn bad_data_range(&self, start: u64, len: u64) -> Option<(u64, Region)> {
        let Region::GroupData { group } = self.region_of(start) else {
            return Some((start, self.region_of(start)));
        };
        let data_end = self.group_first_block(group) + self.group_blocks;
        let end = match start.checked_add(len.max(1)) {
            None => return Some((start, Region::OutsideVolume)),
            Some(end) if end > data_end => return Some((data_end, self.region_of(data_end))),
            Some(end) => end,
        };
        // A run that starts in data but reaches an added slot's journal (v6).
        self.extra_journals
            .iter()
            .filter(|&&j| j > start && j < end)
            .min()
            .map(|&j| (j, self.region_of(j)))
    }

    /// Check one block pointer (`what` of inode `ino`) against the pointer rule; a violation is
    /// `Corrupted` (EIO) and a warning in the log.
    pub fn check_data_block(&self, b: u64, what: PointerKind, ino: u64) -> Result<()> {
        self.check_data_range(b, 1, what, ino)
    }

    /// Check a run `[start, start+len)` (an extent) against the pointer rule.
    pub fn check_data_range(
        &self,
        start: u64,
        len: u64,
        what: PointerKind,
        ino: u64,
    ) -> Result<()> {
        let Some((at, region)) = self.bad_data_range(start, len) else {
            return Ok(());
        };
        let run = if len > 1 {
            format!("blocks {start}+{len}")
        } else {
            format!("block {start}")
        };
        let e = Error::corrupted(format!(
            "inode {ino}: {what} names {run}, but block {at} is {region}, not file-system data; refusing to use it (run fsck.cetra)"
        ));
        tracing::warn!("{e}");
        Err(e)
    }

    /// May a journal transaction log block `b`? Logged blocks are metadata homes: any block of
    /// an allocation group (headers and bitmaps included) or a slot header. Anything else —
    /// the superblocks, heartbeat, lock records, object-lock buckets, mailboxes, journal
    /// bodies — is never journaled, so a
    /// transaction naming it is corrupt and must not be replayed.
    pub fn check_journal_home(&self, b: u64, seq: u64) -> Result<()> {
        match self.region_of(b) {
            Region::GroupHeader { .. }
            | Region::GroupBitmap { .. }
            | Region::GroupData { .. }
            | Region::Journal { index: 0, .. } => Ok(()),
            region => Err(Error::corrupted(format!(
                "journal transaction {seq} logs block {b}, which is {region}; refusing to replay it (run fsck.cetra)"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    /// A small hand-made layout with gaps, so every boundary is distinct.
    fn sb() -> Superblock {
        Superblock {
            compat: 0,
            ro_compat: 0,
            incompat: 0,
            uuid: [0; 16],
            label: String::new(),
            logical_block_size: 4096,
            created: 0,
            hb_slots: 4,
            lock_count: 2,
            root_ino: 22,
            heartbeat_interval_ms: 1000,
            io_timeout_ms: 1000,
            seq: 1,
            inode_lock_slots: 1,
            objlock_start: 0,
            objlock_buckets: 0,
            mailbox_start: 0,
            sharing: None,
            extra_journals: Vec::new(),
            probe_block: 2, // block 1 unused
            hb_start: 3,
            hb_blocks: 4, // 3..7, 7 unused
            lock_start: 8,
            lock_blocks: 2, // 8..10
            journal_start: 10,
            journal_blocks: 5,
            max_nodes: 2, // 10..20
            group_start: 20,
            group_blocks: 10,
            group_count: 3, // 20..50
            bitmap_blocks: 1,
            backup_block: 55, // 50..55 unused
            total_blocks: 57, // 56 unused
        }
    }

    #[test]
    fn every_boundary() {
        let s = sb();
        let want = [
            (0, Region::Superblock),
            (1, Region::Unused),
            (2, Region::Probe),
            (3, Region::Heartbeat),
            (6, Region::Heartbeat),
            (7, Region::Unused),
            (8, Region::Lock),
            (9, Region::Lock),
            (10, Region::Journal { slot: 0, index: 0 }),
            (11, Region::Journal { slot: 0, index: 1 }),
            (14, Region::Journal { slot: 0, index: 4 }),
            (15, Region::Journal { slot: 1, index: 0 }),
            (19, Region::Journal { slot: 1, index: 4 }),
            (20, Region::GroupHeader { group: 0 }),
            (21, Region::GroupBitmap { group: 0 }),
            (22, Region::GroupData { group: 0 }),
            (29, Region::GroupData { group: 0 }),
            (30, Region::GroupHeader { group: 1 }),
            (31, Region::GroupBitmap { group: 1 }),
            (32, Region::GroupData { group: 1 }),
            (49, Region::GroupData { group: 2 }),
            (50, Region::Unused),
            (54, Region::Unused),
            (55, Region::BackupSuperblock),
            (56, Region::Unused),
            (57, Region::OutsideVolume),
            (u64::MAX, Region::OutsideVolume),
        ];
        for (b, r) in want {
            assert_eq!(s.region_of(b), r, "block {b}");
            assert_eq!(s.is_data_block(b), matches!(r, Region::GroupData { .. }));
        }
    }

    /// `sb()` made v3 (512-byte logical blocks): buckets and mailboxes between the lock area
    /// and the journals, which move up.
    fn sb3() -> Superblock {
        Superblock {
            incompat: crate::format::superblock::INCOMPAT_OBJECT_LOCKS,
            logical_block_size: 512,
            objlock_start: 11,  // 10 unused
            objlock_buckets: 9, // 11..13 (8 + 1 records)
            mailbox_start: 13,  // 4 slots: 13..14, 14 and 15 unused
            journal_start: 16,  // 16..26
            group_start: 26,
            root_ino: 28,
            backup_block: 61, // groups 26..56, 56..61 unused
            total_blocks: 62,
            ..sb()
        }
    }

    #[test]
    fn object_lock_regions_are_never_data() {
        let s = sb3();
        let want = [
            (9, Region::Lock),
            (10, Region::Unused),
            (11, Region::ObjectLock),
            (12, Region::ObjectLock),
            (13, Region::Mailbox),
            (14, Region::Unused),
            (16, Region::Journal { slot: 0, index: 0 }),
            (26, Region::GroupHeader { group: 0 }),
        ];
        for (b, r) in want {
            assert_eq!(s.region_of(b), r, "block {b}");
        }
        for b in 11..14 {
            let e = s.check_data_block(b, PointerKind::Extent, 28).unwrap_err();
            assert!(
                e.context().contains("the object-lock area") || e.context().contains("mailboxes"),
                "{e}"
            );
            assert!(s.check_journal_home(b, 1).is_err());
        }
        assert_eq!(s.bad_data_range(12, 1), Some((12, Region::ObjectLock)));
        // Without the feature the fields are not regions.
        let v2 = Superblock {
            incompat: 0,
            ..sb3()
        };
        assert_eq!(v2.region_of(11), Region::Unused);
        assert_eq!(v2.region_of(13), Region::Unused);
    }

    #[test]
    fn bitmap_of_several_blocks() {
        let mut s = sb();
        s.bitmap_blocks = 3;
        assert_eq!(s.region_of(23), Region::GroupBitmap { group: 0 });
        assert_eq!(s.region_of(24), Region::GroupData { group: 0 });
    }

    #[test]
    fn ranges_stay_in_one_group_data_area() {
        let s = sb();
        assert_eq!(s.bad_data_range(22, 8), None);
        assert_eq!(s.bad_data_range(29, 1), None);
        // Into the next group's header.
        assert_eq!(
            s.bad_data_range(28, 3),
            Some((30, Region::GroupHeader { group: 1 }))
        );
        // Past the last group.
        assert_eq!(s.bad_data_range(45, 10), Some((50, Region::Unused)));
        assert_eq!(
            s.bad_data_range(45, u64::MAX),
            Some((45, Region::OutsideVolume))
        );
        assert_eq!(
            s.bad_data_range(21, 2),
            Some((21, Region::GroupBitmap { group: 0 }))
        );
        assert_eq!(s.bad_data_range(0, 1), Some((0, Region::Superblock)));
    }

    #[test]
    fn violations_are_eio_naming_inode_and_block() {
        let s = sb();
        assert!(s.check_data_block(25, PointerKind::Extent, 22).is_ok());
        for (b, what) in [
            (0, PointerKind::Extent),
            (20, PointerKind::TreeNode),
            (21, PointerKind::Xattr),
            (12, PointerKind::Orphan),
            (99, PointerKind::Inode),
        ] {
            let e = s.check_data_block(b, what, 22).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupted);
            assert_eq!(e.errno(), libc::EIO);
            assert!(e.context().contains("inode 22"), "{e}");
            assert!(e.context().contains(&format!("block {b}")), "{e}");
        }
    }

    #[test]
    fn journal_homes() {
        let s = sb();
        for ok in [10, 15, 20, 21, 22, 49] {
            assert!(s.check_journal_home(ok, 1).is_ok(), "{ok}");
        }
        for bad in [0, 2, 3, 8, 11, 19, 50, 55, 57] {
            assert!(s.check_journal_home(bad, 1).is_err(), "{bad}");
        }
    }
}
