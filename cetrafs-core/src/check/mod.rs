//! The offline consistency checker behind `fsck.cetra` (and the test suites): read-only, it
//! walks every structure from the superblock down and returns a [`Report`] listing each
//! problem with the block or inode it concerns. Nothing is repaired here.
//!
//! Passes:
//! 1. superblocks: the one chosen by `Superblock::locate` (the primary if it decodes and fits
//!    the device, else the backup; using the backup is a finding), features understood,
//!    logical block size matches the device, backup equal to the primary except `seq`;
//! 2. groups: every header and bitmap block decodes, free counts agree with the bitmaps, the
//!    group's own metadata is marked used, bits past the end of the group are set;
//! 3. namespace: from the root, every inode, xattr block, tree node, extent and directory entry
//!    (see the conventions in `docs/format.md` and [`crate::format`]);
//! 4. link counts and directory structure;
//! 5. space: every block claimed by something is marked used, every block marked used is
//!    claimed, no block is claimed twice;
//! 6. control areas: heartbeat slots and lock records (`check/control.rs`).
//!
//! Every decode error is a finding; the checker never panics on what it reads, and never
//! follows a block twice, so hostile images terminate.

mod control;
mod remap;
pub mod repair;
mod space;
pub mod synth;
pub mod wreck;

use crate::dev::{AlignedBuf, BlockDevice};
use crate::error::Result;
use crate::format::block::{check_owner, BlockHeader};
use crate::format::dirent::{decode_entries, name_hash};
use crate::format::extent::Extent;
use crate::format::group::{decode_bitmap, GroupHeader, BITS_PER_BITMAP_BLOCK};
use crate::format::inode::{flags, Inode, SymlinkLayout};
use crate::format::overflow::{Overflow, Role};
use crate::format::superblock::{Superblock, COMPAT_KNOWN};
use crate::format::tree_node::{NodeEntries, TreeNode, MAX_LEVEL};
use crate::format::xattr::{Head, Layout};
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};
use crate::fs::FileKind;
use space::{BlockBits, Claims, Owner};
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;

/// What a finding is about, for callers (tests) that match on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FindingKind {
    /// The primary superblock is damaged; the check used the backup.
    PrimarySuperblock,
    /// The backup superblock is missing, damaged or differs from the primary.
    BackupSuperblock,
    /// Feature bits this version does not know.
    Features,
    /// The superblock does not match the device (logical block size).
    Geometry,
    GroupHeader,
    Bitmap,
    /// A group header's free count disagrees with its bitmap.
    FreeCount,
    /// A group's own header or bitmap block is not marked used.
    GroupMetadataFree,
    /// Bits past the end of a group are clear (would let the allocator escape the group).
    BitsPastEnd,
    /// An inode block that does not decode or whose fields contradict its type.
    BadInode,
    BadXattr,
    /// A tree node that does not decode, belongs to someone else or breaks the B+tree rules.
    BadTree,
    /// Extents overlapping in file space, or written data past end of file.
    BadExtent,
    /// A directory entry record that does not decode, hashes wrongly, or names a bad inode.
    BadEntry,
    /// An entry's file type differs from the inode's mode.
    EntryType,
    /// A directory reachable through more than one entry.
    DirLinkedTwice,
    /// A directory's parent field is not the directory containing it.
    DirParent,
    LinkCount,
    /// The inode's block count differs from the blocks it holds.
    BlockCount,
    Symlink,
    /// A block pointer (extent, tree node, xattr block, inode number, orphan) that does not
    /// name the data area of an allocation group (the rule of `format/layout.rs`, which the
    /// runtime refuses with EIO).
    BlockOutsideGroups,
    /// A block in use that the bitmap says is free.
    BlockFree,
    /// A block marked used that nothing references.
    BlockLeaked,
    /// A block referenced by two owners (or twice by one).
    BlockShared,
    /// A slot header (orphan list) that does not decode.
    SlotHeader,
    /// An inode unlinked while open when its node stopped; the next mount of that slot frees it.
    Orphan,
    /// A committed journal transaction that logs a block which is not a metadata home (mount
    /// refuses to replay it).
    BadJournal,
    /// A heartbeat slot that is damaged, or left Live/Recovering by a node that stopped.
    Heartbeat,
    /// A lock record that is corrupted, contradicts itself, or names slots that hold nothing.
    LockRecord,
    /// An object-lock bucket (format v3) that is corrupted, holds an entry of an object that
    /// hashes elsewhere, or names slots that hold nothing.
    ObjectLock,
    /// A lock-request mailbox (format v3) that is corrupted or holds requests of slots that
    /// hold nothing.
    Mailbox,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Worth knowing; the volume is still consistent.
    Warning,
    /// The volume is inconsistent.
    Error,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub kind: FindingKind,
    pub severity: Severity,
    /// The block concerned (for inode findings: the inode number, which is its block).
    pub block: Option<u64>,
    pub ino: Option<u64>,
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.severity == Severity::Warning {
            f.write_str("warning: ")?;
        }
        match (self.ino, self.block) {
            (Some(i), _) => write!(f, "inode {i}: {}", self.message),
            (None, Some(b)) => write!(f, "block {b}: {}", self.message),
            (None, None) => f.write_str(&self.message),
        }
    }
}

/// Counts of what the check saw, for the summary line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub inodes: u64,
    pub directories: u64,
    pub regular_files: u64,
    pub symlinks: u64,
    pub special_files: u64,
    /// Blocks of the allocation groups, and how many the bitmaps mark used.
    pub group_area_blocks: u64,
    pub used_blocks: u64,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The superblock the check ran against (the backup if the primary was unusable).
    pub superblock: Option<Superblock>,
    pub findings: Vec<Finding>,
    pub stats: Stats,
    /// What the repairs need beyond the findings (`check/repair.rs`).
    pub(crate) plan: RepairPlan,
}

/// What a repair (`check/repair.rs`) needs that a finding's text does not carry, gathered by
/// the check as it goes.
#[derive(Debug, Clone, Default)]
pub(crate) struct RepairPlan {
    /// Claimed ranges `[start, end)` of the group area: every group's header and bitmap, and
    /// every block an inode reached from the root or an orphan list holds. What the bitmaps
    /// must say is used.
    pub claims: Vec<(u64, u64)>,
    /// Inodes whose link count is wrong, and the count they should have.
    pub link_counts: std::collections::BTreeMap<u64, u32>,
    /// Inodes whose block count is wrong, and the blocks they hold.
    pub block_counts: std::collections::BTreeMap<u64, u64>,
    /// Byte offsets of one-logical-block control records (heartbeat slots, lock records,
    /// object-lock buckets, mailboxes) with an error: rewritten empty, which no node mounted
    /// (fsck's precondition) can miss.
    pub reset_records: std::collections::BTreeSet<u64>,
    /// Directory entries to remove: (directory, name hash, name), the name None for a whole
    /// record that does not decode. Entries naming an inode that is not one, or the root.
    pub drop_entries: Vec<(u64, u64, Option<Vec<u8>>)>,
    /// Runs `[start, end)` marked used that nothing claims: where unreachable inodes are
    /// looked for.
    pub leaked: Vec<(u64, u64)>,
    /// Directories whose parent field is wrong, and the directory that holds them.
    pub dir_parents: std::collections::BTreeMap<u64, u64>,
    /// Inodes on a slot's orphan list that still have links: (slot, inode).
    pub unorphan: Vec<(u32, u64)>,
    /// Slots whose header (orphan list) does not decode.
    pub bad_slot_headers: Vec<u32>,
    /// Inodes whose xattr set is unusable.
    pub drop_xattrs: std::collections::BTreeSet<u64>,
    /// Entries whose file type differs from their inode's: (directory, hash, name, type).
    pub entry_types: Vec<(u64, u64, Vec<u8>, u8)>,
    /// Entries stored under a hash that is not their name's: (directory, hash, name).
    pub rehash_entries: Vec<(u64, u64, Vec<u8>)>,
    /// Records that hold a name twice: (directory, hash).
    pub dup_records: Vec<(u64, u64)>,
    /// Slots whose journal holds a committed transaction a mount refuses to replay.
    pub bad_journals: Vec<u32>,
    /// Symlinks whose size, inline target and overflow block disagree, or whose overflow
    /// block is unusable, not group data or somebody else's.
    pub clear_inodes: std::collections::BTreeSet<u64>,
    /// Directories whose entry tree `rebuild-dir` rewrites, and the records it keeps (those
    /// the check could read, by hash, the first of a hash).
    pub dir_trees: std::collections::BTreeMap<u64, Vec<LeafEntry>>,
    /// Inode blocks an earlier claim held: (the inode whose data or other blocks claimed it
    /// first, the inode block). `rebuild-map` gives the first holder's data extent a copy.
    pub give_back: std::collections::BTreeSet<(u64, u64)>,
    /// Regular files whose extent map `rebuild-map` rewrites (a bad tree, a bad, overlapping,
    /// out-of-groups or shared extent, written data past EOF), and the map to write.
    pub maps: std::collections::BTreeMap<u64, MapFix>,
}

/// The extent map a regular file keeps (`check/remap.rs` writes it): what the check could
/// read of it, in file order, minus the extents that overlap an earlier one or do not name
/// group data; written extents past EOF marked unwritten.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct MapFix {
    pub extents: Vec<Extent>,
    /// The file blocks where the extents start whose blocks (some of them) another owner, or
    /// an earlier extent of its own, held first: they get copies.
    pub copy: std::collections::BTreeSet<u64>,
}

impl Report {
    pub fn errors(&self) -> impl Iterator<Item = &Finding> {
        self.findings
            .iter()
            .filter(|f| f.severity == Severity::Error)
    }

    /// No errors (warnings allowed).
    pub fn is_clean(&self) -> bool {
        self.errors().next().is_none()
    }

    pub fn has(&self, kind: FindingKind) -> bool {
        self.findings.iter().any(|f| f.kind == kind)
    }
}

/// The passes, announced through the progress callback before each starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Superblocks,
    Groups,
    Namespace,
    LinkCounts,
    Space,
    ControlAreas,
}

impl fmt::Display for Pass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Superblocks => "Pass 1: checking superblocks",
            Self::Groups => "Pass 2: checking allocation groups and bitmaps",
            Self::Namespace => "Pass 3: checking inodes, trees and directories",
            Self::LinkCounts => "Pass 4: checking link counts",
            Self::Space => "Pass 5: checking block allocation",
            Self::ControlAreas => "Pass 6: checking heartbeat slots and lock records",
        })
    }
}

/// Check the volume on `dev` read-only. `Err` means the check could not run (no usable
/// superblock, unsupported features, I/O error); inconsistencies are findings in the report.
pub fn check_volume(dev: &dyn BlockDevice) -> Result<Report> {
    check_volume_with(dev, &mut |_| {})
}

/// [`check_volume`] with a callback announcing each pass.
pub fn check_volume_with(dev: &dyn BlockDevice, progress: &mut dyn FnMut(Pass)) -> Result<Report> {
    progress(Pass::Superblocks);
    let mut report = Report::default();
    let sb = check_superblocks(dev, &mut report)?;
    let area = sb.group_count * sb.group_blocks;
    let mut c = Checker {
        dev,
        sb,
        report,
        bits: BlockBits::new(area),
        bitmap_ok: Vec::new(),
        claims: Claims::default(),
        inodes: HashMap::new(),
    };
    c.report.stats.group_area_blocks = area;
    progress(Pass::Groups);
    c.check_groups()?;
    progress(Pass::Namespace);
    c.check_namespace()?;
    progress(Pass::LinkCounts);
    c.check_link_counts();
    progress(Pass::Space);
    c.check_space();
    progress(Pass::ControlAreas);
    control::check_control_areas(c.dev, &c.sb, &mut c.report)?;
    c.report.plan.claims = c.claims.ranges().map(|(s, e, _)| (s, e)).collect();
    c.report.superblock = Some(c.sb);
    Ok(c.report)
}

fn finding(kind: FindingKind, block: Option<u64>, ino: Option<u64>, message: String) -> Finding {
    Finding {
        kind,
        severity: Severity::Error,
        block,
        ino,
        message,
    }
}

fn read_block(dev: &dyn BlockDevice, b: u64) -> Result<AlignedBuf> {
    let mut buf = AlignedBuf::new(FS_BLOCK_SIZE);
    dev.read_at(b * FS_BLOCK, &mut buf)?;
    Ok(buf)
}

/// Pass 1. Returns the superblock to check against.
fn check_superblocks(dev: &dyn BlockDevice, report: &mut Report) -> Result<Superblock> {
    let geo = dev.geometry();
    let located = crate::fs::locate_superblock(dev)?;
    let sb = located.sb;
    if let Some(pe) = located.primary_error {
        report.findings.push(finding(
            FindingKind::PrimarySuperblock,
            Some(0),
            None,
            format!(
                "primary superblock is unusable ({pe}); checking with the backup at block {}",
                sb.backup_block
            ),
        ));
    }
    // Refuses unknown incompat features: the checker would misread the volume.
    let ro_unknown = sb.check_features()?;
    if ro_unknown {
        report.findings.push(Finding {
            kind: FindingKind::Features,
            severity: Severity::Warning,
            block: Some(0),
            ino: None,
            message: format!("read-only-compatible features {:#x} are unknown to this fsck; structures they add are not checked", sb.ro_compat),
        });
    }
    if sb.compat & !COMPAT_KNOWN != 0 {
        report.findings.push(Finding {
            kind: FindingKind::Features,
            severity: Severity::Warning,
            block: Some(0),
            ino: None,
            message: format!(
                "compatible features {:#x} are unknown to this fsck",
                sb.compat & !COMPAT_KNOWN
            ),
        });
    }
    if sb.logical_block_size != geo.logical_block_size {
        report.findings.push(finding(
            FindingKind::Geometry,
            Some(0),
            None,
            format!(
                "volume was made for {}-byte logical blocks but the device has {}-byte blocks; heartbeat and lock records would be misaligned",
                sb.logical_block_size, geo.logical_block_size
            ),
        ));
    }
    // The backup must exist and equal the primary (only seq may differ).
    if report
        .findings
        .iter()
        .all(|f| f.kind != FindingKind::PrimarySuperblock)
    {
        match Superblock::decode(&read_block(dev, sb.backup_block)?) {
            Ok(mut b) => {
                b.seq = sb.seq;
                if b != sb {
                    report.findings.push(finding(
                        FindingKind::BackupSuperblock,
                        Some(sb.backup_block),
                        None,
                        "backup superblock differs from the primary".into(),
                    ));
                }
            }
            Err(e) => report.findings.push(finding(
                FindingKind::BackupSuperblock,
                Some(sb.backup_block),
                None,
                format!("backup superblock is unusable: {e}"),
            )),
        }
    }
    Ok(sb)
}

/// What pass 3 learned about one inode, for pass 4.
#[derive(Debug)]
struct InodeState {
    /// None when the inode block could not be decoded.
    kind: Option<FileKind>,
    nlink: u32,
    /// Directory entries naming this inode.
    refs: u32,
    /// Entries in this directory naming directories.
    subdirs: u32,
    /// On a node's orphan list: unlinked (or rmdir'd) while still open, so its
    /// expected link count is 0 whatever its kind.
    orphan: bool,
    /// Where it was first reached.
    path: String,
    /// The entry it was first reached through: (directory, hash, name).
    entry: Option<(u64, u64, Vec<u8>)>,
}

struct Checker<'a> {
    dev: &'a dyn BlockDevice,
    sb: Superblock,
    report: Report,
    bits: BlockBits,
    /// Per group: whether its bitmap decoded (otherwise its blocks are not cross-checked).
    bitmap_ok: Vec<bool>,
    claims: Claims,
    inodes: HashMap<u64, InodeState>,
}

/// What [`Checker::claim`] made of a pointer.
#[derive(Debug)]
enum Claimed {
    /// It does not name group data (reported, not claimed).
    Outside,
    /// Claimed; `shared`: who held some of it first (reported).
    Held { shared: Vec<Owner> },
}

/// A (key, value) pair of a tree leaf.
pub(crate) type LeafEntry = (u64, Vec<u8>);

/// A directory waiting for its entries to be checked.
struct PendingDir {
    ino: u64,
    path: String,
    leaves: Vec<LeafEntry>,
}

fn show_name(name: &[u8]) -> String {
    String::from_utf8_lossy(name).escape_debug().to_string()
}

fn join(dir: &str, name: &[u8]) -> String {
    if dir == "/" {
        format!("/{}", show_name(name))
    } else {
        format!("{dir}/{}", show_name(name))
    }
}

impl Checker<'_> {
    fn push(&mut self, kind: FindingKind, block: Option<u64>, ino: Option<u64>, message: String) {
        self.report
            .findings
            .push(finding(kind, block, ino, message));
    }

    fn group_area_end(&self) -> u64 {
        self.sb.group_area_end()
    }

    fn in_groups(&self, b: u64) -> bool {
        b >= self.sb.group_start && b < self.group_area_end()
    }

    fn owner_desc(&self, o: Owner) -> String {
        match o {
            Owner::Inode(i) => match self.inodes.get(&i) {
                Some(s) => format!("inode {i} ({})", s.path),
                None => format!("inode {i}"),
            },
            Owner::Group(_) | Owner::Journal(_) => o.to_string(),
        }
    }

    /// Record that `owner` holds `[start, start+len)`; report blocks outside the groups and
    /// blocks somebody else already holds. An inode's pointer must name the data area of one
    /// group (`Superblock::bad_data_range`, the rule the runtime applies); one that does not
    /// is reported and not claimed.
    fn claim(&mut self, start: u64, len: u64, owner: Owner, what: &str) -> Claimed {
        if let Owner::Inode(ino) = owner {
            if let Some((at, region)) = self.sb.bad_data_range(start, len) {
                let run = if len == 1 {
                    format!("block {start}")
                } else {
                    format!("blocks {start}+{len}")
                };
                self.push(
                    FindingKind::BlockOutsideGroups,
                    Some(start),
                    Some(ino),
                    format!("{what} at {run}: block {at} is {region}, not file-system data"),
                );
                return Claimed::Outside;
            }
        }
        let Some(end) = start.checked_add(len) else {
            let ino = if let Owner::Inode(i) = owner {
                Some(i)
            } else {
                None
            };
            self.push(
                FindingKind::BlockOutsideGroups,
                Some(start),
                ino,
                format!("{what} at block {start} runs past the end of the block address space"),
            );
            return Claimed::Outside;
        };
        let (lo, hi) = (self.sb.group_start, self.group_area_end());
        if start < lo || end > hi {
            let ino = if let Owner::Inode(i) = owner {
                Some(i)
            } else {
                None
            };
            self.push(
                FindingKind::BlockOutsideGroups,
                Some(start),
                ino,
                format!(
                    "{what} at {} lies outside the allocation groups ({})",
                    blocks(start, end),
                    blocks(lo, hi)
                ),
            );
        }
        let (s, e) = (start.max(lo), end.min(hi));
        if s >= e {
            return Claimed::Outside;
        }
        let held_before = self.claims.claim(s, e, owner);
        let shared = held_before.iter().map(|h| h.2).collect();
        for (os, oe, prev) in held_before {
            let ino = if let Owner::Inode(i) = owner {
                Some(i)
            } else {
                None
            };
            let msg = format!(
                "{what}: {} already held by {}",
                blocks(os, oe),
                self.owner_desc(prev)
            );
            self.push(FindingKind::BlockShared, Some(os), ino, msg);
        }
        Claimed::Held { shared }
    }

    /// Pass 2.
    fn check_groups(&mut self) -> Result<()> {
        let sb = self.sb.clone();
        // v6: the journals of node slots added after mkfs hold their runs of group data.
        for slot in sb.base_journals()..sb.max_nodes {
            self.claim(
                sb.journal_of(slot),
                sb.journal_blocks,
                Owner::Journal(slot),
                &format!("journal of node slot {slot}"),
            );
        }
        let meta = 1 + u64::from(sb.bitmap_blocks);
        for g in 0..sb.group_count {
            let first = sb.group_first_block(g);
            self.claim(
                first,
                meta,
                Owner::Group(g),
                &format!("group {g} header and bitmap"),
            );
            let mut buf = AlignedBuf::new(usize::try_from(meta * FS_BLOCK).unwrap_or(usize::MAX));
            self.dev.read_at(first * FS_BLOCK, &mut buf)?;
            let header = match GroupHeader::decode(&buf[..FS_BLOCK_SIZE], first) {
                Ok(h) => {
                    if h.index != g
                        || h.block_count != sb.group_blocks
                        || h.bitmap_blocks != sb.bitmap_blocks
                    {
                        self.push(
                            FindingKind::GroupHeader,
                            Some(first),
                            None,
                            format!(
                                "group {g} header says index {}, {} blocks, {} bitmap blocks; the superblock says index {g}, {} blocks, {} bitmap blocks",
                                h.index, h.block_count, h.bitmap_blocks, sb.group_blocks, sb.bitmap_blocks
                            ),
                        );
                    }
                    Some(h)
                }
                Err(e) => {
                    self.push(
                        FindingKind::GroupHeader,
                        Some(first),
                        None,
                        format!("group {g} header is unusable: {e}"),
                    );
                    None
                }
            };
            let mut ok = true;
            let mut payload = Vec::with_capacity(
                usize::try_from(u64::from(sb.bitmap_blocks) * BITS_PER_BITMAP_BLOCK / 8)
                    .unwrap_or(0),
            );
            for i in 0..u64::from(sb.bitmap_blocks) {
                let at = first + 1 + i;
                let o = usize::try_from((1 + i) * FS_BLOCK).unwrap_or(usize::MAX);
                match decode_bitmap(&buf[o..o + FS_BLOCK_SIZE], at) {
                    Ok((_, p)) => payload.extend_from_slice(p),
                    Err(e) => {
                        self.push(
                            FindingKind::Bitmap,
                            Some(at),
                            None,
                            format!("bitmap block {i} of group {g} is unusable: {e}"),
                        );
                        ok = false;
                    }
                }
            }
            self.bitmap_ok.push(ok);
            if !ok {
                continue;
            }
            let bit = |b: u64| {
                payload[usize::try_from(b / 8).unwrap_or(usize::MAX)] & (1 << (b % 8)) != 0
            };
            let base = g * sb.group_blocks;
            let mut used = 0;
            for b in 0..sb.group_blocks {
                if bit(b) {
                    self.bits.set(base + b);
                    used += 1;
                }
            }
            self.report.stats.used_blocks += used;
            for b in 0..meta {
                if !bit(b) {
                    self.push(
                        FindingKind::GroupMetadataFree,
                        Some(first + b),
                        None,
                        format!(
                            "group {g} {} is marked free in its own bitmap",
                            if b == 0 { "header" } else { "bitmap block" }
                        ),
                    );
                }
            }
            let past: u64 = (sb.group_blocks..u64::from(sb.bitmap_blocks) * BITS_PER_BITMAP_BLOCK)
                .filter(|&b| !bit(b))
                .count() as u64;
            if past > 0 {
                self.push(
                    FindingKind::BitsPastEnd,
                    Some(first + 1),
                    None,
                    format!("group {g} bitmap has {past} clear bits past the end of the group (they must be set so nothing is allocated there)"),
                );
            }
            if let Some(h) = header {
                let free = sb.group_blocks - used;
                if h.free_blocks != free {
                    self.push(
                        FindingKind::FreeCount,
                        Some(first),
                        None,
                        format!(
                            "group {g} header says {} free blocks, its bitmap has {free}",
                            h.free_blocks
                        ),
                    );
                }
            }
        }
        Ok(())
    }

    /// Walk the tree rooted at `root` owned by `ino`; returns the number of nodes it holds and
    /// the leaf entries in key order.
    fn walk_tree(&mut self, ino: u64, root: u64) -> Result<(u64, Vec<LeafEntry>)> {
        let mut nodes = 0;
        let mut leaves = Vec::new();
        self.walk_node(ino, root, None, None, None, &mut nodes, &mut leaves)?;
        Ok((nodes, leaves))
    }

    #[allow(clippy::too_many_arguments)]
    fn walk_node(
        &mut self,
        ino: u64,
        b: u64,
        level: Option<u16>,
        lo: Option<u64>,
        hi: Option<u64>,
        nodes: &mut u64,
        leaves: &mut Vec<LeafEntry>,
    ) -> Result<()> {
        *nodes += 1;
        let before = self.report.findings.len();
        self.claim(b, 1, Owner::Inode(ino), "tree node");
        // A node somebody already holds is not followed: that would loop on cyclic trees and
        // multiply work on trees sharing subtrees. The claim reported it.
        if self.report.findings.len() != before {
            return Ok(());
        }
        let buf = read_block(self.dev, b)?;
        let node = match TreeNode::decode(&buf, b) {
            Ok(n) => n,
            Err(e) => {
                self.push(
                    FindingKind::BadTree,
                    Some(b),
                    Some(ino),
                    format!("tree node {b} is unusable: {e}"),
                );
                return Ok(());
            }
        };
        let bad = |m: String| {
            finding(
                FindingKind::BadTree,
                Some(b),
                Some(ino),
                format!("tree node {b}: {m}"),
            )
        };
        if node.owner != ino {
            self.report
                .findings
                .push(bad(format!("belongs to inode {}", node.owner)));
            return Ok(());
        }
        if let Some(l) = level {
            if node.level != l {
                self.report.findings.push(bad(format!(
                    "is at level {} but its parent expects level {l} (leaves at different depths)",
                    node.level
                )));
                return Ok(());
            }
        }
        if node.is_empty() && (level.is_some() || node.level > 0) {
            self.report
                .findings
                .push(bad("is empty (only an empty root leaf is allowed)".into()));
            return Ok(());
        }
        let keys: Vec<u64> = match &node.entries {
            NodeEntries::Leaf(v) => v.iter().map(|e| e.0).collect(),
            NodeEntries::Internal(v) => v.iter().map(|e| e.0).collect(),
        };
        if let (Some(&first), Some(lo)) = (keys.first(), lo) {
            if first < lo {
                self.report.findings.push(bad(format!(
                    "first key {first:#x} is below its parent's key {lo:#x}"
                )));
            }
        }
        if let (Some(&last), Some(hi)) = (keys.last(), hi) {
            if last >= hi {
                self.report.findings.push(bad(format!(
                    "last key {last:#x} is not below the next key in its parent {hi:#x}"
                )));
            }
        }
        match node.entries {
            NodeEntries::Leaf(v) => leaves.extend(v),
            NodeEntries::Internal(v) => {
                debug_assert!(node.level > 0 && node.level <= MAX_LEVEL);
                for (i, &(k, child)) in v.iter().enumerate() {
                    let next = v.get(i + 1).map(|e| e.0).or(hi);
                    self.walk_node(
                        ino,
                        child,
                        Some(node.level - 1),
                        Some(k),
                        next,
                        nodes,
                        leaves,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Check one inode the first time an entry (or the superblock) reaches it. Directories
    /// come back with their entry records for the namespace walk.
    fn visit_inode(&mut self, ino: u64, path: &str) -> Result<Option<PendingDir>> {
        if self.inodes.contains_key(&ino) {
            return Ok(None);
        }
        let mut state = InodeState {
            kind: None,
            nlink: 0,
            refs: 0,
            subdirs: 0,
            orphan: false,
            path: path.to_string(),
            entry: None,
        };
        if !self.sb.is_data_block(ino) {
            self.push(
                FindingKind::BadInode,
                Some(ino),
                Some(ino),
                format!(
                    "{path}: inode number {ino} is {}, not a block in the data part of an allocation group",
                    self.sb.region_of(ino)
                ),
            );
            self.inodes.insert(ino, state);
            return Ok(None);
        }
        if let Claimed::Held { shared } = self.claim(ino, 1, Owner::Inode(ino), "inode block") {
            // An inode cannot move: a file whose data claimed its block first gets the copy.
            for o in shared {
                if let Owner::Inode(x) = o {
                    if x != ino {
                        self.report.plan.give_back.insert((x, ino));
                    }
                }
            }
        }
        let buf = read_block(self.dev, ino)?;
        let inode = match Inode::decode(&buf, ino) {
            Ok(i) => i,
            Err(e) => {
                self.push(
                    FindingKind::BadInode,
                    Some(ino),
                    Some(ino),
                    format!("{path}: inode block is unusable: {e}"),
                );
                self.inodes.insert(ino, state);
                return Ok(None);
            }
        };
        // Decode succeeded, so the header is valid.
        if let Ok(h) = BlockHeader::decode(&buf) {
            if h.owner != ino {
                self.push(
                    FindingKind::BadInode,
                    Some(ino),
                    Some(ino),
                    format!("{path}: block header names owner {}", h.owner),
                );
            }
        }
        state.nlink = inode.nlink;
        state.kind = FileKind::from_mode(inode.mode);
        self.inodes.insert(ino, state);
        let bad = |m: String| {
            finding(
                FindingKind::BadInode,
                Some(ino),
                Some(ino),
                format!("{path}: {m}"),
            )
        };
        let Some(kind) = FileKind::from_mode(inode.mode) else {
            self.report
                .findings
                .push(bad(format!("unknown file type in mode {:o}", inode.mode)));
            return Ok(None);
        };
        let mut held = 1u64;
        if inode.xattr_block != 0 {
            held += self.check_xattr(ino, path, inode.xattr_block)?;
        }
        if inode.overflow_block != 0 && kind != FileKind::Symlink {
            self.report.findings.push(bad(format!(
                "overflow block {} on something that is not a symlink",
                inode.overflow_block
            )));
        }
        let inline_ext = inode.flags & flags::INLINE_EXTENTS != 0;
        if inline_ext && kind != FileKind::Regular {
            self.report.findings.push(bad(
                "inline extents on something that is not a regular file".into(),
            ));
        }
        if !inode.inline_data.is_empty() && kind != FileKind::Symlink {
            self.report.findings.push(bad(format!(
                "{} bytes of inline data on something that is not a symlink",
                inode.inline_data.len()
            )));
        }
        let mut pending = None;
        match kind {
            FileKind::Directory => {
                let before = self.report.findings.len();
                let leaves = if inode.tree_root != 0 {
                    let (n, leaves) = self.walk_tree(ino, inode.tree_root)?;
                    held += n;
                    leaves
                } else {
                    Vec::new()
                };
                if self.report.findings[before..].iter().any(|f| {
                    f.ino == Some(ino)
                        && matches!(
                            f.kind,
                            FindingKind::BadTree
                                | FindingKind::BlockOutsideGroups
                                | FindingKind::BlockShared
                        )
                }) {
                    let mut records = leaves.clone();
                    records.sort_by_key(|r| r.0);
                    records.dedup_by_key(|r| r.0);
                    self.report.plan.dir_trees.insert(ino, records);
                }
                pending = Some(PendingDir {
                    ino,
                    path: path.to_string(),
                    leaves,
                });
            }
            FileKind::Regular => {
                let before = self.report.findings.len();
                let mut extents = Vec::new();
                if inline_ext {
                    if inode.tree_root != 0 {
                        self.report
                            .findings
                            .push(bad("has both inline extents and an extent tree".into()));
                    }
                    extents.clone_from(&inode.inline_extents);
                } else if inode.tree_root != 0 {
                    let (n, leaves) = self.walk_tree(ino, inode.tree_root)?;
                    held += n;
                    for (k, v) in leaves {
                        match Extent::decode_value(k, &v) {
                            Ok(e) => extents.push(e),
                            Err(e) => self.push(
                                FindingKind::BadExtent,
                                Some(inode.tree_root),
                                Some(ino),
                                format!("{path}: extent at file block {k}: {e}"),
                            ),
                        }
                    }
                }
                let (n, fix) = self.check_extents(ino, path, inode.size, &mut extents);
                held += n;
                if self.report.findings[before..].iter().any(|f| {
                    f.ino == Some(ino)
                        && matches!(
                            f.kind,
                            FindingKind::BadTree
                                | FindingKind::BadExtent
                                | FindingKind::BlockOutsideGroups
                                | FindingKind::BlockShared
                        )
                }) {
                    self.report.plan.maps.insert(ino, fix);
                }
            }
            FileKind::Symlink => {
                if inode.tree_root != 0 {
                    self.report.findings.push(bad("symlink has a tree".into()));
                }
                held += self.check_symlink(ino, path, &inode)?;
            }
            _ => {
                if inode.tree_root != 0 {
                    self.report
                        .findings
                        .push(bad("special file has a tree".into()));
                }
            }
        }
        if inode.blocks != held {
            self.report.plan.block_counts.insert(ino, held);
            self.push(
                FindingKind::BlockCount,
                Some(ino),
                Some(ino),
                format!(
                    "{path}: block count is {} but it holds {held} blocks",
                    inode.blocks
                ),
            );
        }
        let stats = &mut self.report.stats;
        stats.inodes += 1;
        match kind {
            FileKind::Directory => stats.directories += 1,
            FileKind::Regular => stats.regular_files += 1,
            FileKind::Symlink => stats.symlinks += 1,
            _ => stats.special_files += 1,
        }
        Ok(pending)
    }

    /// The xattr set headed by `xb`: head and overflow blocks claimed, decoded, owned by `ino`,
    /// and assembled into a valid set. Returns the blocks it holds. A set with a block that is
    /// unusable, not group data, or somebody else's is dropped by `drop-xattr`.
    fn check_xattr(&mut self, ino: u64, path: &str, xb: u64) -> Result<u64> {
        let before = self.report.findings.len();
        let held = self.check_xattr_set(ino, path, xb)?;
        if self.report.findings[before..].iter().any(|f| {
            matches!(
                f.kind,
                FindingKind::BadXattr | FindingKind::BlockOutsideGroups | FindingKind::BlockShared
            )
        }) {
            self.report.plan.drop_xattrs.insert(ino);
        }
        Ok(held)
    }

    fn check_xattr_set(&mut self, ino: u64, path: &str, xb: u64) -> Result<u64> {
        let bad = |m: String| {
            finding(
                FindingKind::BadXattr,
                Some(xb),
                Some(ino),
                format!("{path}: {m}"),
            )
        };
        let before = self.report.findings.len();
        self.claim(xb, 1, Owner::Inode(ino), "xattr block");
        if self.report.findings.len() != before || !self.in_groups(xb) {
            return Ok(1);
        }
        let layout = Layout::of(&self.sb);
        let buf = read_block(self.dev, xb)?;
        let head = match Head::decode(&buf, xb, layout)
            .and_then(|h| check_owner("xattr block", xb, h.owner, ino).map(|()| h))
        {
            Ok(h) => h,
            Err(e) => {
                self.report
                    .findings
                    .push(bad(format!("xattr block {xb} is unusable: {e}")));
                return Ok(1);
            }
        };
        let mut parts = Vec::new();
        for &b in &head.more {
            if let Some(p) =
                self.overflow_block(ino, path, b, "xattr overflow block", FindingKind::BadXattr)?
            {
                parts.push(p);
            }
        }
        if parts.len() == head.more.len() {
            if let Err(e) = head.assemble(&parts, layout) {
                self.report
                    .findings
                    .push(bad(format!("xattr set of block {xb} is unusable: {e}")));
            }
        }
        Ok(1 + head.more.len() as u64)
    }

    /// Claim, read, decode and owner-check the overflow block `b` of `ino`; `None` (with a
    /// finding of `kind`) if it is unusable.
    fn overflow_block(
        &mut self,
        ino: u64,
        path: &str,
        b: u64,
        what: &str,
        kind: FindingKind,
    ) -> Result<Option<Overflow>> {
        let before = self.report.findings.len();
        self.claim(b, 1, Owner::Inode(ino), what);
        if self.report.findings.len() != before || !self.in_groups(b) {
            return Ok(None);
        }
        let buf = read_block(self.dev, b)?;
        match Overflow::decode(&buf, b).and_then(|o| check_owner(what, b, o.owner, ino).map(|()| o))
        {
            Ok(o) => Ok(Some(o)),
            Err(e) => {
                self.push(
                    kind,
                    Some(b),
                    Some(ino),
                    format!("{path}: {what} {b} is unusable: {e}"),
                );
                Ok(None)
            }
        }
    }

    /// A symlink's target: inline, or the inline area full and the rest in its overflow block
    /// (v2 volumes only). Returns the blocks it holds beyond the inode.
    fn check_symlink(&mut self, ino: u64, path: &str, inode: &Inode) -> Result<u64> {
        let before = self.report.findings.len();
        let held = self.check_symlink_target(ino, path, inode)?;
        if self.report.findings[before..].iter().any(|f| {
            matches!(
                f.kind,
                FindingKind::Symlink | FindingKind::BlockOutsideGroups | FindingKind::BlockShared
            )
        }) {
            self.report.plan.clear_inodes.insert(ino);
        }
        Ok(held)
    }

    fn check_symlink_target(&mut self, ino: u64, path: &str, inode: &Inode) -> Result<u64> {
        let b = inode.overflow_block;
        let held = u64::from(b != 0);
        let mut msg = None;
        let layout = inode.symlink_layout(Layout::of(&self.sb) == Layout::V2);
        if let Err(why) = &layout {
            msg = Some(format!("{path}: {why}"));
        }
        if b != 0 {
            let what = "symlink overflow block";
            if let Some(o) = self.overflow_block(ino, path, b, what, FindingKind::Symlink)? {
                if let Ok(SymlinkLayout::Overflow { rest, .. }) = layout {
                    if let Err(e) = o.expect(Role::SymlinkTarget, 1, rest) {
                        msg = msg.or(Some(format!("{path}: {e}")));
                    }
                }
            }
        }
        if let Some(m) = msg {
            self.push(FindingKind::Symlink, Some(ino), Some(ino), m);
        }
        Ok(held)
    }

    /// Extents in file order must not overlap; written ones must lie below EOF; each must name
    /// group data nobody else holds. Returns the number of data blocks they hold, and the map
    /// `rebuild-map` would write: an extent that overlaps an earlier one or does not name group
    /// data is left out (a hole), a written one past EOF is kept unwritten (it was never
    /// visible), one over blocks somebody held first is kept and marked for a copy.
    fn check_extents(
        &mut self,
        ino: u64,
        path: &str,
        size: u64,
        extents: &mut [Extent],
    ) -> (u64, MapFix) {
        extents.sort_by_key(|e| e.logical);
        let eof_block = size.div_ceil(FS_BLOCK);
        let mut held = 0u64;
        let mut prev_end = 0u64;
        let mut fix = MapFix::default();
        for (i, e) in extents.iter().enumerate() {
            let mut kept = *e;
            let Some(end) = e.logical.checked_add(u64::from(e.len)) else {
                self.push(
                    FindingKind::BadExtent,
                    None,
                    Some(ino),
                    format!("{path}: extent at file block {} overflows", e.logical),
                );
                continue;
            };
            let overlaps = i > 0 && e.logical < prev_end;
            if overlaps {
                self.push(
                    FindingKind::BadExtent,
                    Some(e.physical),
                    Some(ino),
                    format!("{path}: extent at file block {} overlaps the previous one (ending at {prev_end})", e.logical),
                );
            }
            prev_end = prev_end.max(end);
            if !e.unwritten() && e.logical >= eof_block {
                kept.flags |= crate::format::extent::EXTENT_UNWRITTEN;
                self.push(
                    FindingKind::BadExtent,
                    Some(e.physical),
                    Some(ino),
                    format!("{path}: written extent at file block {} starts at or past end of file (size {size})", e.logical),
                );
            }
            held += u64::from(e.len);
            let claimed = self.claim(
                e.physical,
                u64::from(e.len),
                Owner::Inode(ino),
                &format!("{path}: data of file blocks {}-{}", e.logical, end - 1),
            );
            if let Claimed::Held { shared } = claimed {
                if !overlaps {
                    if !shared.is_empty() {
                        fix.copy.insert(kept.logical);
                    }
                    fix.extents.push(kept);
                }
            }
        }
        (held, fix)
    }

    /// Pass 3: breadth-first from the root.
    fn check_namespace(&mut self) -> Result<()> {
        let root = self.sb.root_ino;
        let mut queue = VecDeque::new();
        if let Some(p) = self.visit_inode(root, "/")? {
            queue.push_back(p);
            if let Ok(i) = Inode::decode(&read_block(self.dev, root)?, root) {
                if i.parent != root {
                    self.report.plan.dir_parents.insert(root, root);
                    self.push(
                        FindingKind::DirParent,
                        Some(root),
                        Some(root),
                        format!("/: root's parent field is {}, not itself", i.parent),
                    );
                }
            }
        } else {
            if self.inodes.get(&root).is_some_and(|s| s.kind.is_some()) {
                self.push(
                    FindingKind::BadInode,
                    Some(root),
                    Some(root),
                    "/: the root inode is not a directory".into(),
                );
            }
            self.push(
                FindingKind::BadInode,
                Some(root),
                Some(root),
                "/: no usable root directory; the namespace was not checked".into(),
            );
            return Ok(());
        }
        while let Some(dir) = queue.pop_front() {
            for (key, value) in &dir.leaves {
                let entries = match decode_entries(value) {
                    Ok(v) => v,
                    Err(e) => {
                        self.report.plan.drop_entries.push((dir.ino, *key, None));
                        self.push(
                            FindingKind::BadEntry,
                            None,
                            Some(dir.ino),
                            format!("{}: entry record with hash {key:#x}: {e}", dir.path),
                        );
                        continue;
                    }
                };
                let mut seen = HashSet::new();
                for e in entries {
                    let path = join(&dir.path, &e.name);
                    if name_hash(&e.name) != *key {
                        self.report
                            .plan
                            .rehash_entries
                            .push((dir.ino, *key, e.name.clone()));
                        self.push(
                            FindingKind::BadEntry,
                            None,
                            Some(dir.ino),
                            format!(
                                "{path}: stored under hash {key:#x} but the name hashes to {:#x}",
                                name_hash(&e.name)
                            ),
                        );
                    }
                    if !seen.insert(e.name.clone()) {
                        if !self.report.plan.dup_records.contains(&(dir.ino, *key)) {
                            self.report.plan.dup_records.push((dir.ino, *key));
                        }
                        self.push(
                            FindingKind::BadEntry,
                            None,
                            Some(dir.ino),
                            format!("{path}: name appears twice in the directory"),
                        );
                        continue;
                    }
                    if e.ino == root {
                        self.report
                            .plan
                            .drop_entries
                            .push((dir.ino, *key, Some(e.name.clone())));
                        self.push(
                            FindingKind::BadEntry,
                            None,
                            Some(dir.ino),
                            format!("{path}: entry names the root directory"),
                        );
                        continue;
                    }
                    if let Some(p) = self.visit_inode(e.ino, &path)? {
                        queue.push_back(p);
                    }
                    let Some(st) = self.inodes.get_mut(&e.ino) else {
                        continue;
                    };
                    st.refs += 1;
                    if st.refs == 1 {
                        st.entry = Some((dir.ino, *key, e.name.clone()));
                    }
                    let Some(kind) = st.kind else {
                        // Names an inode that is not one: the entry goes (with -y).
                        self.report
                            .plan
                            .drop_entries
                            .push((dir.ino, *key, Some(e.name.clone())));
                        continue;
                    };
                    let (refs, first_path) = (st.refs, st.path.clone());
                    if kind.dtype() != e.dtype {
                        self.report.plan.entry_types.push((
                            dir.ino,
                            *key,
                            e.name.clone(),
                            kind.dtype(),
                        ));
                        self.push(
                            FindingKind::EntryType,
                            None,
                            Some(dir.ino),
                            format!(
                                "{path}: entry says file type {} but inode {} is a {kind:?}",
                                e.dtype, e.ino
                            ),
                        );
                    }
                    if kind == FileKind::Directory {
                        if let Some(d) = self.inodes.get_mut(&dir.ino) {
                            d.subdirs += 1;
                        }
                        if refs > 1 {
                            self.link_twice(e.ino, (dir.ino, *key, &e.name))?;
                            self.push(
                                FindingKind::DirLinkedTwice,
                                Some(e.ino),
                                Some(e.ino),
                                format!("directory {first_path} is also reachable as {path}"),
                            );
                        } else if let Ok(child) =
                            Inode::decode(&read_block(self.dev, e.ino)?, e.ino)
                        {
                            if child.parent != dir.ino {
                                self.report.plan.dir_parents.insert(e.ino, dir.ino);
                                self.push(
                                    FindingKind::DirParent,
                                    Some(e.ino),
                                    Some(e.ino),
                                    format!(
                                        "{path}: parent field is {} but it lives in directory {}",
                                        child.parent, dir.ino
                                    ),
                                );
                            }
                        }
                    }
                }
            }
        }
        self.check_orphans()
    }

    /// Directory `child`, first reached through another entry, is also named by `entry`
    /// (directory, hash, name): the entry that `drop-entry` removes is the one that is not in
    /// the directory its parent field names; if both are (or neither), the later one. The
    /// first one's parent fix is then moot.
    fn link_twice(&mut self, child: u64, entry: (u64, u64, &[u8])) -> Result<()> {
        let (dir, key, name) = entry;
        let parent = Inode::decode(&read_block(self.dev, child)?, child).map(|c| c.parent);
        let first = self.inodes.get(&child).and_then(|s| s.entry.clone());
        let drop = match first {
            Some(f) if parent.as_ref().is_ok_and(|&p| p == dir && f.0 != dir) => {
                self.report.plan.dir_parents.remove(&child);
                f
            }
            _ => (dir, key, name.to_vec()),
        };
        let (d, k, n) = drop;
        self.report.plan.drop_entries.push((d, k, Some(n)));
        Ok(())
    }

    /// Orphan lists: their inodes are legitimately nameless and still hold blocks.
    fn check_orphans(&mut self) -> Result<()> {
        use crate::format::slot_header::SlotHeader;
        for slot in 0..self.sb.max_nodes {
            let at = self.sb.journal_of(slot);
            let header = match SlotHeader::decode(&read_block(self.dev, at)?, at, slot) {
                Ok(h) => h,
                Err(e) => {
                    self.report.plan.bad_slot_headers.push(slot);
                    self.push(
                        FindingKind::SlotHeader,
                        Some(at),
                        None,
                        format!("node slot {slot} header is unusable: {e}"),
                    );
                    continue;
                }
            };
            let area = crate::journal::JournalArea::for_slot(&self.sb, slot);
            if let Some(tx) = crate::journal::find_tx(self.dev, area)? {
                if let Err(e) = crate::journal::check_homes(&self.sb, &tx) {
                    self.report.plan.bad_journals.push(slot);
                    self.push(
                        FindingKind::BadJournal,
                        Some(area.start + 1),
                        None,
                        format!("node slot {slot}: {e}"),
                    );
                }
            }
            for ino in header.orphans {
                if !self.sb.is_data_block(ino) {
                    self.report.plan.unorphan.push((slot, ino));
                    self.push(
                        FindingKind::BlockOutsideGroups,
                        Some(at),
                        Some(ino),
                        format!(
                            "node slot {slot}: orphan list entry {ino} is {}, not an inode block",
                            self.sb.region_of(ino)
                        ),
                    );
                    continue;
                }
                let path = format!("<orphan of node slot {slot}>");
                self.visit_inode(ino, &path)?;
                if let Some(s) = self.inodes.get_mut(&ino) {
                    s.orphan = true;
                }
                if self.inodes.get(&ino).is_some_and(|s| s.nlink != 0) {
                    self.report.plan.unorphan.push((slot, ino));
                    self.push(FindingKind::Orphan, Some(ino), Some(ino), format!("inode {ino} is on the orphan list of node slot {slot} but still has links"));
                } else {
                    self.report.findings.push(Finding {
                        kind: FindingKind::Orphan,
                        severity: Severity::Warning,
                        block: Some(ino),
                        ino: Some(ino),
                        message: format!("inode {ino} was open but unlinked when node slot {slot} stopped; the next mount frees it"),
                    });
                }
            }
        }
        Ok(())
    }

    /// Pass 4.
    fn check_link_counts(&mut self) {
        let mut found = Vec::new();
        for (&ino, s) in &self.inodes {
            let Some(kind) = s.kind else { continue };
            let want = if s.orphan && s.refs == 0 {
                // An rmdir'd directory still open somewhere has nlink 0, like a file.
                0
            } else if kind == FileKind::Directory {
                2 + s.subdirs
            } else {
                s.refs
            };
            if s.nlink != want {
                self.report.plan.link_counts.insert(ino, want);
                let why = if kind == FileKind::Directory {
                    format!(
                        "{} subdirector{}",
                        s.subdirs,
                        if s.subdirs == 1 { "y" } else { "ies" }
                    )
                } else {
                    format!(
                        "{} entr{} reference it",
                        s.refs,
                        if s.refs == 1 { "y" } else { "ies" }
                    )
                };
                found.push(finding(
                    FindingKind::LinkCount,
                    Some(ino),
                    Some(ino),
                    format!(
                        "{}: link count is {}, should be {want} ({why})",
                        s.path, s.nlink
                    ),
                ));
            }
        }
        found.sort_by_key(|f| f.ino);
        self.report.findings.extend(found);
    }

    /// Pass 5: claims against bitmaps, for groups whose bitmap could be read.
    fn check_space(&mut self) {
        let mut found = Vec::new();
        let mut cursor = self.sb.group_start;
        let claims: Vec<_> = self.claims.ranges().collect();
        for (s, e, owner) in claims {
            let runs = self.bitmap_runs(cursor, s, true);
            self.report.plan.leaked.extend(&runs);
            found.extend(runs.into_iter().map(leaked));
            cursor = e;
            for (fs, fe) in self.bitmap_runs(s, e, false) {
                let ino = if let Owner::Inode(i) = owner {
                    Some(i)
                } else {
                    None
                };
                let msg = format!(
                    "{} held by {} marked free in the bitmap",
                    blocks(fs, fe),
                    self.owner_desc(owner)
                );
                found.push(finding(FindingKind::BlockFree, Some(fs), ino, msg));
            }
        }
        let runs = self.bitmap_runs(cursor, self.group_area_end(), true);
        self.report.plan.leaked.extend(&runs);
        found.extend(runs.into_iter().map(leaked));
        self.report.findings.extend(found);
    }

    /// Runs of blocks in `[from, to)` whose bitmap bit equals `value`, split at group
    /// boundaries and restricted to groups whose bitmap decoded.
    fn bitmap_runs(&self, from: u64, to: u64, value: bool) -> Vec<(u64, u64)> {
        let (gs, gb) = (self.sb.group_start, self.sb.group_blocks);
        let mut out = Vec::new();
        let mut b = from.max(gs);
        let to = to.min(self.group_area_end());
        while b < to {
            let g = (b - gs) / gb;
            let gend = (gs + (g + 1) * gb).min(to);
            if self
                .bitmap_ok
                .get(usize::try_from(g).unwrap_or(usize::MAX))
                .copied()
                .unwrap_or(false)
            {
                out.extend(
                    self.bits
                        .runs(b - gs, gend - gs, value)
                        .into_iter()
                        .map(|(s, e)| (s + gs, e + gs)),
                );
            }
            b = gend;
        }
        out
    }
}

/// "blocks 10-19" for the half-open range 10..20.
/// A run of blocks marked used in a bitmap that nothing references.
fn leaked((ls, le): (u64, u64)) -> Finding {
    let what = if le - ls == 1 {
        format!("block {ls} is")
    } else {
        format!("{} ({} blocks) are", blocks(ls, le), le - ls)
    };
    finding(
        FindingKind::BlockLeaked,
        Some(ls),
        None,
        format!("{what} marked used but nothing references them (leaked)"),
    )
}

fn blocks(s: u64, e: u64) -> String {
    if e - s == 1 {
        format!("block {s}")
    } else {
        format!("blocks {s}-{}", e - 1)
    }
}

#[cfg(test)]
mod repair_tests;
#[cfg(test)]
mod tests;

#[cfg(test)]
mod volume_tests;
