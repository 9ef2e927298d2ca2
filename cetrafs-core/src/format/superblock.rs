//! The superblock: fs block 0, with a backup copy in the device's last fs block.
//! It fixes the geometry of every region for the life of the volume.
//!
//! ```text
//! off  size field                     why
//!   0     8 magic "CETRAFS\0"         identifies the volume (also what mkfs/blkid look for)
//!   8     4 format_version            the oldest version that knows the incompat bits: 1 without
//!                                     any, 2 with INCOMPAT_OVERFLOW, 3 with INCOMPAT_OBJECT_LOCKS,
//!                                     4 with INCOMPAT_SHARING_MODE, 5 with INCOMPAT_GROW,
//!                                     6 with INCOMPAT_EXTRA_JOURNALS, 7 with
//!                                     INCOMPAT_GROUP_MARKS, 8 with INCOMPAT_GROUP_CLAIMS
//!  12     4 compat features           unknown bits: ignore
//!  16     4 ro_compat features        unknown bits: mount read-only only
//!  20     4 incompat features         unknown bits: refuse to mount
//!  24    16 uuid
//!  40    64 label (UTF-8, NUL padded)
//! 104     4 logical_block_size        512 | 4096: unit of lock/heartbeat records and CAW
//! 108     4 fs_block_size (4096)
//! 112     8 total_blocks              fs blocks covered by the volume
//! 120     8 created (unix seconds)
//! 128     4 max_nodes                 journals (= mountable nodes at once)
//! 132     4 hb_slots                  heartbeat records (>= 64, >= max_nodes)
//! 136     8 probe_block               scratch block for the CAW probe
//! 144     8 hb_start    152 8 hb_blocks
//! 160     8 lock_start  168 8 lock_count (records)   176 8 lock_blocks
//! 184     8 journal_start             192 8 journal_blocks (per node)
//! 200     8 group_start 208 8 group_count  216 8 group_blocks (per group)
//! 224     8 root_ino
//! 232     4 heartbeat_interval_ms     236 4 io_timeout_ms
//! 240     8 backup_block (fs block of the backup copy)
//! 248     8 seq                       bumped on each rewrite
//! 256     4 bitmap_blocks per group   260 4 inode_lock_slots (hashed inode lock records)
//! 264     8 objlock_start             fs block of the first object-lock bucket   (v3, else 0)
//! 272     8 objlock_buckets           bucket records, one logical block each     (v3, else 0)
//! 280     8 mailbox_start             fs block of the first mailbox: hb_slots     (v3, else 0)
//!                                     mailboxes of one logical block each
//! 288     4 sharing_mode              1 single-host, 2 multi-node                 (v4, else 0)
//! 292     4 extra_journal_count       node slots added by `cetra tune -N`         (v6, else 0)
//! 296  8×n  extra_journals            fs block of each added slot's journal       (v6)
//! ..        zero
//! 4092    4 crc32c of bytes 0..4092
//! ```
//!
//! **Object-lock area and mailboxes (v3, [`INCOMPAT_OBJECT_LOCKS`]).** `objlock_buckets`
//! bucket records ([`super::object_lock`]) packed from byte `objlock_start × 4096`, then, from
//! byte `mailbox_start × 4096`, `hb_slots` mailbox records ([`super::mailbox`]), one per node
//! slot; both one logical block per record, so each region covers
//! `ceil(records × logical_block_size / 4096)` fs blocks ([`Superblock::objlock_blocks`],
//! [`Superblock::mailbox_blocks`]). mkfs places them right after the lock area, before the
//! journals, and the decoder requires that order (probe, heartbeat, lock area, buckets,
//! mailboxes, journals, groups), at least one bucket, and the regions inside the volume.
//! Without the bit the three fields are ignored (decoded as 0) and the volume has no
//! object-lock area ([`Superblock::object_lock_area`] is None).
//!
//! **Sharing mode (v4, [`INCOMPAT_SHARING_MODE`]).** What mkfs found the device to be
//! ([`SharingMode`]): multi-node when the target executed SCSI COMPARE AND WRITE correctly,
//! single-host otherwise (regular file, loop, virtio-blk, NVMe, NBD, RBD: COMPARE AND WRITE
//! emulated with locks of one machine). Mount enforces it (`fs/mount.rs`): a single-host
//! volume refuses a second machine, a multi-node volume refuses a path without SCSI COMPARE
//! AND WRITE. Any other value than 1 or 2 does not decode, nor does the bit without
//! [`INCOMPAT_OBJECT_LOCKS`] (format 4 is format 3 plus this field). Without the bit the field is
//! ignored and the mode is unknown ([`Superblock::sharing`] is None): volumes of format 1 to 3
//! mount as before.
//!
//! **Online grow (v5, [`INCOMPAT_GROW`]).** No new field: the lock area's group records
//! `1 ..= lock_count − inode_lock_slots − 1` ([`Superblock::group_capacity`]) bound how many
//! groups the volume can reach, and the decoder requires `group_count ≤ group_capacity`.
//! `cetra grow` rewrites `total_blocks`, `group_count`, `backup_block` and `seq` (backup
//! copy first, at the new last block); everything else stays where mkfs put it.
//!
//! **Node slots added after mkfs (v6, [`INCOMPAT_EXTRA_JOURNALS`]).** `cetra tune -N` raises
//! `max_nodes` (up to `hb_slots`: the heartbeat records and mailboxes are there already) and
//! gives each added slot a journal of `journal_blocks` taken from the free space of one
//! allocation group (marked used in its bitmap): slot `s` of the
//! [`Superblock::base_journals`] = `max_nodes − n` made by mkfs has its journal at
//! `journal_start + s × journal_blocks`, slot `base + i` at `extra_journals[i]`
//! ([`Superblock::journal_of`]). Each run lies in the data part of one group; the runs do
//! not overlap; blocks in them are journal blocks, not data (`format/layout.rs`).
//!
//! **Group marks (v7, [`INCOMPAT_GROUP_MARKS`]).** No new field: the rule for changing an
//! allocation group's bitmap changes (`docs/locking.md` §9, "Group marks"). The owner of a
//! group refills its block pool from it *without* the global lock, while the group's lock
//! record names it in `next` (the group's *mark*); any other node changes (or reads for a
//! decision) a group that another node owns only under the global lock *and* with the mark
//! naming it. A binary that does not know this would borrow from, free into or trim a group
//! while its owner refills from it, so it must refuse the volume. mkfs sets it together with
//! the bits of format 5.
//!
//! **Group claims (v8, [`INCOMPAT_GROUP_CLAIMS`]).** No new field either: a node may also
//! *claim* a group nobody owns without the global lock (one CAW of the group's record from
//! Free and unmarked to owned by it and marked by it, `docs/locking.md` §9), so that its pool
//! keeps being refilled once its own groups are full. In return every node, under the global
//! lock, marks a group nobody owns (as one another node owns) before it allocates from,
//! frees into or trims it. A binary of version 7 would use such a group unmarked while another
//! node claims and fills it, so it must refuse the volume. mkfs sets it with the format-7
//! bits.

use super::codec::{Reader, Writer};
use super::FS_BLOCK_SIZE;
use crate::error::{Error, ErrorKind, Result};

pub const SB_MAGIC: [u8; 8] = *b"CETRAFS\0";
/// The newest format version this release reads and writes. A volume's version follows from
/// its incompat features ([`Superblock::format_version`]): 1 without any, 2 with
/// [`INCOMPAT_OVERFLOW`], 3 with [`INCOMPAT_OBJECT_LOCKS`], 4 with [`INCOMPAT_SHARING_MODE`],
/// 5 with [`INCOMPAT_GROW`], 6 with [`INCOMPAT_EXTRA_JOURNALS`], 7 with
/// [`INCOMPAT_GROUP_MARKS`], 8 with [`INCOMPAT_GROUP_CLAIMS`]. Volumes of versions 1 to 7
/// keep working with their version's features and stay mountable
/// by the binaries of their version; those refuse a newer volume (by the version, and by the
/// incompat bit they do not know).
pub const FORMAT_VERSION: u32 = 8;
pub const LABEL_LEN: usize = 64;

/// Incompat (v2): overflow blocks (`format/overflow.rs`): symlink targets up to 4095 bytes and
/// xattr sets of up to 32 blocks with 64 KiB values. mkfs sets it on every new volume.
pub const INCOMPAT_OVERFLOW: u32 = 0x1;

/// Incompat (v3): the per-object lock area (hashed buckets, `cluster/object_lock.rs`) and one
/// lock-request mailbox per node slot (`cluster/mailbox.rs`), placed by `objlock_start`,
/// `objlock_buckets` and `mailbox_start`. Nodes of a v3 volume lock objects in those records;
/// a binary that does not know them would change metadata under the global lock alone,
/// unseen by nodes holding object locks, so it must refuse the volume. mkfs sets it together
/// with [`INCOMPAT_OVERFLOW`].
pub const INCOMPAT_OBJECT_LOCKS: u32 = 0x2;

/// Incompat (v4): the superblock records the volume's [`SharingMode`] (`sharing_mode`), and
/// every node mounting it enforces it; a binary that does not know it would mount a
/// single-host volume from a second machine, whose locks are not atomic with the first's, so
/// it must refuse the volume. mkfs sets it together with the two bits above.
pub const INCOMPAT_SHARING_MODE: u32 = 0x4;

/// Incompat (v5): the volume can grow while mounted (`cetra grow`, `fs/grow.rs`). The lock
/// area holds more group records than the volume has groups (room for the groups a grow
/// adds), `group_count`, `total_blocks` and `backup_block` may change while nodes have the
/// volume mounted, and the global lock record's value block carries the superblock's `seq`,
/// from which every node learns that it must re-read the superblock. A binary that does not
/// know this would keep the old geometry and refuse (EIO) every block of a new group, so it
/// must refuse the volume. mkfs sets it together with the three bits above.
pub const INCOMPAT_GROW: u32 = 0x8;

/// Incompat (v6): node slots added after mkfs (`cetra tune -N`), whose journals lie inside
/// allocation groups, listed from byte 292. A binary that does not know it would put those
/// slots' journals after the mkfs ones, in the group area, so it must refuse the volume.
/// Set by `cetra tune` only, on a volume of format 5.
pub const INCOMPAT_EXTRA_JOURNALS: u32 = 0x10;

/// Incompat (v7): group marks (`docs/locking.md` §9). A group's owner refills its block pool
/// from the group without the global lock while the group's lock record names it in `next`;
/// every other node changes or trims a group another node owns only under the global lock
/// with that mark naming it. A binary that does not know this would change such a group
/// while its owner does, so it must refuse the volume. mkfs sets it with the format-5 bits.
pub const INCOMPAT_GROUP_MARKS: u32 = 0x20;

/// Incompat (v8): group claims without the global lock (`docs/locking.md` §9). A node claims
/// a group nobody owns with one CAW of its record (Free and unmarked → owned and marked by
/// it) and refills its pool from it; so under the global lock every node marks a group
/// nobody owns too before it changes or trims it. A binary that does not know this would use
/// such a group unmarked while another node claims it, so it must refuse the volume. mkfs
/// sets it with the format-7 bits.
pub const INCOMPAT_GROUP_CLAIMS: u32 = 0x40;

/// The most node slots `cetra tune -N` can add (the superblock's room for their journals).
pub const MAX_EXTRA_JOURNALS: usize = (FS_BLOCK_SIZE - 4 - 296) / 8;

/// Feature bits known to this release.
pub const COMPAT_KNOWN: u32 = 0;
pub const RO_COMPAT_KNOWN: u32 = 0;
pub const INCOMPAT_KNOWN: u32 = INCOMPAT_OVERFLOW
    | INCOMPAT_OBJECT_LOCKS
    | INCOMPAT_SHARING_MODE
    | INCOMPAT_GROW
    | INCOMPAT_EXTRA_JOURNALS
    | INCOMPAT_GROUP_MARKS
    | INCOMPAT_GROUP_CLAIMS;

/// How a volume may be shared (format v4, [`INCOMPAT_SHARING_MODE`]): recorded by mkfs from
/// the probe of the device it formatted (`dev/open.rs`, `Lun::check_sharing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharingMode {
    /// Made on a device without SCSI COMPARE AND WRITE: its lock records are atomic only
    /// among the processes of one machine, so only one machine may mount it at a time.
    SingleHost = 1,
    /// Made on a SCSI LUN whose COMPARE AND WRITE the target executes: any number of
    /// machines, each through a path where COMPARE AND WRITE works.
    MultiNode = 2,
}

impl SharingMode {
    fn code(self) -> u32 {
        self as u32
    }

    fn from_code(code: u32) -> Option<Self> {
        match code {
            1 => Some(Self::SingleHost),
            2 => Some(Self::MultiNode),
            _ => None,
        }
    }
}

impl std::fmt::Display for SharingMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::SingleHost => "single-host",
            Self::MultiNode => "multi-node",
        })
    }
}

const MAGIC: usize = 0;
const VERSION: usize = MAGIC + 8;
const COMPAT: usize = VERSION + 4;
const RO_COMPAT: usize = COMPAT + 4;
const INCOMPAT: usize = RO_COMPAT + 4;
const UUID: usize = INCOMPAT + 4;
const LABEL: usize = UUID + 16;
const LBS: usize = LABEL + LABEL_LEN;
const FSBS: usize = LBS + 4;
const TOTAL: usize = FSBS + 4;
const CREATED: usize = TOTAL + 8;
const MAX_NODES: usize = CREATED + 8;
const HB_SLOTS: usize = MAX_NODES + 4;
const PROBE: usize = HB_SLOTS + 4;
const HB_START: usize = PROBE + 8;
const HB_BLOCKS: usize = HB_START + 8;
const LOCK_START: usize = HB_BLOCKS + 8;
const LOCK_COUNT: usize = LOCK_START + 8;
const LOCK_BLOCKS: usize = LOCK_COUNT + 8;
const JOURNAL_START: usize = LOCK_BLOCKS + 8;
const JOURNAL_BLOCKS: usize = JOURNAL_START + 8;
const GROUP_START: usize = JOURNAL_BLOCKS + 8;
const GROUP_COUNT: usize = GROUP_START + 8;
const GROUP_BLOCKS: usize = GROUP_COUNT + 8;
const ROOT_INO: usize = GROUP_BLOCKS + 8;
const HB_INTERVAL: usize = ROOT_INO + 8;
const IO_TIMEOUT: usize = HB_INTERVAL + 4;
const BACKUP: usize = IO_TIMEOUT + 4;
const SEQ: usize = BACKUP + 8;
const BITMAP_BLOCKS: usize = SEQ + 8;
const INODE_LOCKS: usize = BITMAP_BLOCKS + 4;
const OBJLOCK_START: usize = INODE_LOCKS + 4;
const OBJLOCK_BUCKETS: usize = OBJLOCK_START + 8;
const MAILBOX_START: usize = OBJLOCK_BUCKETS + 8;
const SHARING: usize = MAILBOX_START + 8;
const EXTRA_COUNT: usize = SHARING + 4;
const EXTRA_STARTS: usize = EXTRA_COUNT + 4;
const CRC: usize = FS_BLOCK_SIZE - 4;
const _: () = assert!(INODE_LOCKS + 4 == 264 && MAILBOX_START + 8 == 288 && SHARING == 288);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub compat: u32,
    pub ro_compat: u32,
    pub incompat: u32,
    pub uuid: [u8; 16],
    pub label: String,
    pub logical_block_size: u32,
    pub total_blocks: u64,
    pub created: u64,
    pub max_nodes: u32,
    pub hb_slots: u32,
    pub probe_block: u64,
    pub hb_start: u64,
    pub hb_blocks: u64,
    pub lock_start: u64,
    pub lock_count: u64,
    pub lock_blocks: u64,
    pub journal_start: u64,
    pub journal_blocks: u64,
    pub group_start: u64,
    pub group_count: u64,
    pub group_blocks: u64,
    pub root_ino: u64,
    pub heartbeat_interval_ms: u32,
    pub io_timeout_ms: u32,
    pub backup_block: u64,
    pub seq: u64,
    pub bitmap_blocks: u32,
    pub inode_lock_slots: u32,
    /// v3 ([`INCOMPAT_OBJECT_LOCKS`]): fs block of the first object-lock bucket; else 0.
    pub objlock_start: u64,
    /// v3: number of object-lock buckets (one logical block each); else 0.
    pub objlock_buckets: u64,
    /// v3: fs block of the first of `hb_slots` mailboxes (one logical block each); else 0.
    pub mailbox_start: u64,
    /// v4 ([`INCOMPAT_SHARING_MODE`]): how the volume may be shared; None without the bit
    /// (unknown: volumes of format 1 to 3). Some exactly when the bit is set.
    pub sharing: Option<SharingMode>,
    /// v6 ([`INCOMPAT_EXTRA_JOURNALS`]): the journals of the node slots `cetra tune -N` added,
    /// slot `base_journals() + i` at `extra_journals[i]`; empty without the bit.
    pub extra_journals: Vec<u64>,
}

/// The superblock [`Superblock::locate`] chose, and why.
#[derive(Debug)]
pub struct Located {
    pub sb: Superblock,
    /// The primary was unusable; `sb` is the backup from the device's last fs block.
    pub from_backup: bool,
    /// Why the primary was unusable (Some exactly when `from_backup`).
    pub primary_error: Option<Error>,
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; FS_BLOCK_SIZE];
        let mut w = Writer::new(&mut b);
        w.bytes(MAGIC, &SB_MAGIC);
        w.u32(VERSION, self.format_version());
        w.u32(COMPAT, self.compat);
        w.u32(RO_COMPAT, self.ro_compat);
        w.u32(INCOMPAT, self.incompat);
        w.bytes(UUID, &self.uuid);
        let l = self.label.as_bytes();
        w.bytes(LABEL, &l[..l.len().min(LABEL_LEN)]);
        w.u32(LBS, self.logical_block_size);
        w.u32(FSBS, u32::try_from(FS_BLOCK_SIZE).expect("4096"));
        w.u64(TOTAL, self.total_blocks);
        w.u64(CREATED, self.created);
        w.u32(MAX_NODES, self.max_nodes);
        w.u32(HB_SLOTS, self.hb_slots);
        w.u64(PROBE, self.probe_block);
        w.u64(HB_START, self.hb_start);
        w.u64(HB_BLOCKS, self.hb_blocks);
        w.u64(LOCK_START, self.lock_start);
        w.u64(LOCK_COUNT, self.lock_count);
        w.u64(LOCK_BLOCKS, self.lock_blocks);
        w.u64(JOURNAL_START, self.journal_start);
        w.u64(JOURNAL_BLOCKS, self.journal_blocks);
        w.u64(GROUP_START, self.group_start);
        w.u64(GROUP_COUNT, self.group_count);
        w.u64(GROUP_BLOCKS, self.group_blocks);
        w.u64(ROOT_INO, self.root_ino);
        w.u32(HB_INTERVAL, self.heartbeat_interval_ms);
        w.u32(IO_TIMEOUT, self.io_timeout_ms);
        w.u64(BACKUP, self.backup_block);
        w.u64(SEQ, self.seq);
        w.u32(BITMAP_BLOCKS, self.bitmap_blocks);
        w.u32(INODE_LOCKS, self.inode_lock_slots);
        // Without the feature the area stays zero, as older releases wrote it.
        if self.has_object_locks() {
            w.u64(OBJLOCK_START, self.objlock_start);
            w.u64(OBJLOCK_BUCKETS, self.objlock_buckets);
            w.u64(MAILBOX_START, self.mailbox_start);
        }
        if self.incompat & INCOMPAT_SHARING_MODE != 0 {
            w.u32(SHARING, self.sharing.map_or(0, SharingMode::code));
        }
        if self.incompat & INCOMPAT_EXTRA_JOURNALS != 0 {
            let n = self.extra_journals.len().min(MAX_EXTRA_JOURNALS);
            w.u32(EXTRA_COUNT, u32::try_from(n).unwrap_or(0));
            for (i, &b) in self.extra_journals.iter().take(n).enumerate() {
                w.u64(EXTRA_STARTS + 8 * i, b);
            }
        }
        let crc = crc32c::crc32c(&b[..CRC]);
        Writer::new(&mut b).u32(CRC, crc);
        b
    }

    /// True if the buffer starts with the CetraFS magic (whatever else is wrong with it).
    pub fn has_magic(buf: &[u8]) -> bool {
        buf.get(..8) == Some(&SB_MAGIC[..])
    }

    /// Decode and validate. Every check says what a sysadmin would need to know.
    pub fn decode(buf: &[u8]) -> Result<Self> {
        let r = Reader::new(buf, "superblock");
        if !Self::has_magic(buf) {
            return Err(Error::new(
                ErrorKind::Corrupted,
                "no CetraFS superblock (magic not found)",
            ));
        }
        if buf.len() < FS_BLOCK_SIZE {
            return Err(Error::corrupted("superblock is truncated"));
        }
        if r.u32(CRC)? != crc32c::crc32c(r.bytes(0, CRC)?) {
            return Err(Error::corrupted(
                "superblock checksum mismatch (damaged superblock)",
            ));
        }
        let version = r.u32(VERSION)?;
        if version == 0 || version > FORMAT_VERSION {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("format version {version} is not supported by this CetraFS (knows 1 to {FORMAT_VERSION}); upgrade it"),
            ));
        }
        let label_raw = r.bytes(LABEL, LABEL_LEN)?;
        let end = label_raw.iter().position(|&c| c == 0).unwrap_or(LABEL_LEN);
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(r.bytes(UUID, 16)?);
        let incompat = r.u32(INCOMPAT)?;
        // Without the feature the fields are not the volume's: ignored, as older binaries do.
        let v3 = |at: usize| -> Result<u64> {
            Ok(if incompat & INCOMPAT_OBJECT_LOCKS != 0 {
                r.u64(at)?
            } else {
                0
            })
        };
        let sharing = if incompat & INCOMPAT_SHARING_MODE == 0 {
            None
        } else {
            let code = r.u32(SHARING)?;
            Some(SharingMode::from_code(code).ok_or_else(|| {
                Error::corrupted(format!(
                    "superblock: unknown sharing mode {code} (1 single-host, 2 multi-node)"
                ))
            })?)
        };
        let sb = Self {
            compat: r.u32(COMPAT)?,
            ro_compat: r.u32(RO_COMPAT)?,
            incompat,
            uuid,
            // Strict, like the heartbeat host name: a lossy decode would re-encode differently.
            label: std::str::from_utf8(&label_raw[..end])
                .map_err(|_| Error::corrupted("superblock: label is not UTF-8"))?
                .to_string(),
            logical_block_size: r.u32(LBS)?,
            total_blocks: r.u64(TOTAL)?,
            created: r.u64(CREATED)?,
            max_nodes: r.u32(MAX_NODES)?,
            hb_slots: r.u32(HB_SLOTS)?,
            probe_block: r.u64(PROBE)?,
            hb_start: r.u64(HB_START)?,
            hb_blocks: r.u64(HB_BLOCKS)?,
            lock_start: r.u64(LOCK_START)?,
            lock_count: r.u64(LOCK_COUNT)?,
            lock_blocks: r.u64(LOCK_BLOCKS)?,
            journal_start: r.u64(JOURNAL_START)?,
            journal_blocks: r.u64(JOURNAL_BLOCKS)?,
            group_start: r.u64(GROUP_START)?,
            group_count: r.u64(GROUP_COUNT)?,
            group_blocks: r.u64(GROUP_BLOCKS)?,
            root_ino: r.u64(ROOT_INO)?,
            heartbeat_interval_ms: r.u32(HB_INTERVAL)?,
            io_timeout_ms: r.u32(IO_TIMEOUT)?,
            backup_block: r.u64(BACKUP)?,
            seq: r.u64(SEQ)?,
            bitmap_blocks: r.u32(BITMAP_BLOCKS)?,
            inode_lock_slots: r.u32(INODE_LOCKS)?,
            objlock_start: v3(OBJLOCK_START)?,
            objlock_buckets: v3(OBJLOCK_BUCKETS)?,
            mailbox_start: v3(MAILBOX_START)?,
            sharing,
            extra_journals: Vec::new(),
        };
        let mut sb = sb;
        if incompat & INCOMPAT_EXTRA_JOURNALS != 0 {
            let n = r.u32(EXTRA_COUNT)? as usize;
            if n == 0 || n > MAX_EXTRA_JOURNALS {
                return Err(Error::corrupted(format!(
                    "superblock: {n} added node slots (1 to {MAX_EXTRA_JOURNALS} with the feature)"
                )));
            }
            sb.extra_journals = (0..n)
                .map(|i| r.u64(EXTRA_STARTS + 8 * i))
                .collect::<Result<_>>()?;
        }
        if r.u32(FSBS)? as usize != FS_BLOCK_SIZE {
            return Err(Error::corrupted(format!(
                "superblock: fs block size {} is not 4096",
                r.u32(FSBS)?
            )));
        }
        if version != sb.format_version() {
            return Err(Error::corrupted(format!(
                "superblock: format version {version} does not match its incompat features {:#x}",
                sb.incompat
            )));
        }
        sb.validate()?;
        Ok(sb)
    }

    /// Check that the regions are ordered, inside the volume and non-overlapping. The superblock
    /// is checksummed, so this guards against encoder bugs and hand-edited images rather than
    /// bit rot; every later bounds check relies on it.
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::corrupted(format!("superblock: {what}")));
        if self.logical_block_size != 512 && self.logical_block_size != 4096 {
            return bad(&format!(
                "logical block size {} is not 512 or 4096",
                self.logical_block_size
            ));
        }
        if self.max_nodes == 0 || self.hb_slots < self.max_nodes {
            return bad("node slot counts are inconsistent");
        }
        let lpb = (FS_BLOCK_SIZE as u64) / u64::from(self.logical_block_size);
        if self.hb_blocks.saturating_mul(lpb) < u64::from(self.hb_slots)
            || self.lock_blocks.saturating_mul(lpb) < self.lock_count
        {
            return bad("heartbeat or lock area is too small for its records");
        }
        let objlocks = self.has_object_locks();
        if objlocks && self.objlock_buckets == 0 {
            return bad("object-lock area without buckets");
        }
        // Versions stay a line: format 4 is format 3 and the sharing mode.
        if self.incompat & INCOMPAT_SHARING_MODE != 0 && !objlocks {
            return bad("sharing mode (format 4) without the object-lock area (format 3)");
        }
        if self.incompat & INCOMPAT_GROW != 0 && self.incompat & INCOMPAT_SHARING_MODE == 0 {
            return bad("online grow (format 5) without the sharing mode (format 4)");
        }
        if self.incompat & INCOMPAT_GROW != 0 && self.group_count > self.group_capacity() {
            return bad("more groups than the lock area has group records for");
        }
        if self.incompat & INCOMPAT_GROUP_MARKS != 0 && self.incompat & INCOMPAT_GROW == 0 {
            return bad("group marks (format 7) without online grow (format 5)");
        }
        if self.incompat & INCOMPAT_GROUP_CLAIMS != 0 && self.incompat & INCOMPAT_GROUP_MARKS == 0 {
            return bad("group claims (format 8) without group marks (format 7)");
        }
        let extra = self.incompat & INCOMPAT_EXTRA_JOURNALS != 0;
        if extra && self.incompat & INCOMPAT_GROW == 0 {
            return bad("added node slots (format 6) without online grow (format 5)");
        }
        if extra == self.extra_journals.is_empty() || self.base_journals() == 0 {
            return bad("added node slots do not match the node count");
        }
        // Absent regions (v2: no object locks) are empty and sit where they would be.
        let (objlock_start, mailbox_start) = if objlocks {
            (self.objlock_start, self.mailbox_start)
        } else {
            let after_lock = self.lock_start.saturating_add(self.lock_blocks);
            (after_lock, after_lock)
        };
        let regions = [
            ("the probe block", self.probe_block, 1),
            ("the heartbeat area", self.hb_start, self.hb_blocks),
            ("the lock area", self.lock_start, self.lock_blocks),
            ("the object-lock area", objlock_start, self.objlock_blocks()),
            ("the mailbox area", mailbox_start, self.mailbox_blocks()),
            (
                "the journal area",
                self.journal_start,
                self.journal_blocks
                    .saturating_mul(u64::from(self.base_journals())),
            ),
            (
                "the group area",
                self.group_start,
                self.group_blocks.saturating_mul(self.group_count),
            ),
        ];
        let (mut prev, mut prev_end) = ("the superblock", 1u64);
        for (what, start, len) in regions {
            if start < prev_end {
                return bad(&format!(
                    "regions overlap: {what} starts at block {start}, before the end of {prev} (block {prev_end})"
                ));
            }
            prev_end = match start.checked_add(len) {
                Some(e) => e,
                None => return bad(&format!("{what}: region size overflows")),
            };
            prev = what;
        }
        if prev_end > self.backup_block || self.backup_block >= self.total_blocks {
            return bad("regions run past the end of the volume");
        }
        if self.group_count == 0 || self.group_blocks <= u64::from(self.bitmap_blocks) + 1 {
            return bad("no usable allocation group");
        }
        // Exactly as many bitmap blocks as the group needs: mount sizes buffers from this.
        if u64::from(self.bitmap_blocks)
            != self
                .group_blocks
                .div_ceil(super::group::BITS_PER_BITMAP_BLOCK)
        {
            return bad("group bitmap size does not match the group size");
        }
        if self.root_ino < self.group_start || self.root_ino >= prev_end {
            return bad("root inode outside the allocation groups");
        }
        if self.inode_lock_slots == 0 {
            return bad("no inode lock records");
        }
        self.check_extra_journals()?;
        if let Err(e) =
            super::heartbeat::check_timing(self.heartbeat_interval_ms, self.io_timeout_ms)
        {
            return bad(&e);
        }
        Ok(())
    }

    /// Check feature flags against what this build understands. Returns Ok(true) if the volume
    /// may only be mounted read-only.
    pub fn check_features(&self) -> Result<bool> {
        let unknown = self.incompat & !INCOMPAT_KNOWN;
        if unknown != 0 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("volume uses incompatible features {unknown:#x} unknown to this CetraFS; upgrade it"),
            ));
        }
        Ok(self.ro_compat & !RO_COMPAT_KNOWN != 0)
    }

    /// The format version this volume is: the oldest that knows its features.
    pub fn format_version(&self) -> u32 {
        if self.incompat & INCOMPAT_GROUP_CLAIMS != 0 {
            8
        } else if self.incompat & INCOMPAT_GROUP_MARKS != 0 {
            7
        } else if self.incompat & INCOMPAT_EXTRA_JOURNALS != 0 {
            6
        } else if self.incompat & INCOMPAT_GROW != 0 {
            5
        } else if self.incompat & INCOMPAT_SHARING_MODE != 0 {
            4
        } else if self.incompat & INCOMPAT_OBJECT_LOCKS != 0 {
            3
        } else if self.incompat & INCOMPAT_OVERFLOW != 0 {
            2
        } else {
            1
        }
    }

    /// Each added slot's journal lies in the data part of one group, apart from the others.
    fn check_extra_journals(&self) -> Result<()> {
        let mut runs: Vec<(u64, u64)> = Vec::with_capacity(self.extra_journals.len());
        for (i, &start) in self.extra_journals.iter().enumerate() {
            let group_data = |b: u64| match self.group_region_of(b) {
                super::layout::Region::GroupData { group } => Some(group),
                _ => None,
            };
            let last = start.saturating_add(self.journal_blocks.saturating_sub(1));
            if self.journal_blocks == 0
                || group_data(start).is_none()
                || group_data(start) != group_data(last)
            {
                return Err(Error::corrupted(format!(
                    "superblock: the journal of added node slot {} (block {start}) is not inside one allocation group's data",
                    self.base_journals() as usize + i
                )));
            }
            runs.push((start, start + self.journal_blocks));
        }
        runs.sort_unstable();
        if runs.windows(2).any(|w| w[1].0 < w[0].1) {
            return Err(Error::corrupted(
                "superblock: the journals of added node slots overlap",
            ));
        }
        Ok(())
    }

    /// The node slots whose journals mkfs placed (after the mailboxes): all but those
    /// `cetra tune -N` added.
    pub fn base_journals(&self) -> u32 {
        let extra = u32::try_from(self.extra_journals.len()).unwrap_or(u32::MAX);
        self.max_nodes.saturating_sub(extra)
    }

    /// First fs block of slot `slot`'s journal (`slot < max_nodes`; others as if mkfs had
    /// placed them, which the caller's bounds exclude).
    pub fn journal_of(&self, slot: u32) -> u64 {
        let base = self.base_journals();
        match slot
            .checked_sub(base)
            .and_then(|i| self.extra_journals.get(usize::try_from(i).ok()?))
        {
            Some(&b) => b,
            None => self
                .journal_start
                .saturating_add(u64::from(slot).saturating_mul(self.journal_blocks)),
        }
    }

    /// Can the volume grow while mounted (v5, [`INCOMPAT_GROW`])?
    pub fn can_grow(&self) -> bool {
        self.incompat & INCOMPAT_GROW != 0
    }

    /// Unsupported, naming `what` and this volume's format, unless it is format 5 or later
    /// (the grow and `tune -N` need the lock area's spare group records and the value block).
    pub fn require_growable(&self, what: &str) -> Result<()> {
        if self.can_grow() {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "{what} needs a format-5 volume, made by mkfs.cetra of this release (this one is format {})",
                self.format_version()
            ),
        ))
    }

    /// Groups the lock area has records for: the most `group_count` can become by growing
    /// (records `1 ..= group_capacity`; the open-file buckets follow them).
    pub fn group_capacity(&self) -> u64 {
        self.lock_count
            .saturating_sub(u64::from(self.inode_lock_slots))
            .saturating_sub(1)
    }

    /// May a node claim a group without the global lock (v8, [`INCOMPAT_GROUP_CLAIMS`])?
    pub fn has_group_claims(&self) -> bool {
        self.incompat & INCOMPAT_GROUP_CLAIMS != 0
    }

    /// Does the volume use group marks (v7, [`INCOMPAT_GROUP_MARKS`])?
    pub fn has_group_marks(&self) -> bool {
        self.incompat & INCOMPAT_GROUP_MARKS != 0
    }

    /// Does the volume have the per-object lock area and mailboxes (v3)?
    pub fn has_object_locks(&self) -> bool {
        self.incompat & INCOMPAT_OBJECT_LOCKS != 0
    }

    /// Logical blocks (records) per fs block.
    fn records_per_block(&self) -> u64 {
        super::FS_BLOCK / u64::from(self.logical_block_size.max(1))
    }

    /// Fs blocks of the object-lock bucket area (0 without the feature).
    pub fn objlock_blocks(&self) -> u64 {
        if self.has_object_locks() {
            self.objlock_buckets.div_ceil(self.records_per_block())
        } else {
            0
        }
    }

    /// Fs blocks of the mailbox area: `hb_slots` records (0 without the feature).
    pub fn mailbox_blocks(&self) -> u64 {
        if self.has_object_locks() {
            u64::from(self.hb_slots).div_ceil(self.records_per_block())
        } else {
            0
        }
    }

    /// Where `cluster::object_lock::ObjectLocks` finds its records, in bytes: the buckets and
    /// one mailbox per heartbeat slot. None on a volume without [`INCOMPAT_OBJECT_LOCKS`].
    pub fn object_lock_area(&self) -> Option<crate::cluster::object_lock::ObjectLockArea> {
        self.has_object_locks()
            .then(|| crate::cluster::object_lock::ObjectLockArea {
                bucket_offset: self.objlock_start.saturating_mul(super::FS_BLOCK),
                buckets: self.objlock_buckets,
                mailbox_offset: self.mailbox_start.saturating_mul(super::FS_BLOCK),
                mailboxes: self.hb_slots,
            })
    }

    /// The block after the last allocation group.
    pub fn group_area_end(&self) -> u64 {
        self.group_start
            .saturating_add(self.group_count.saturating_mul(self.group_blocks))
    }

    pub fn group_first_block(&self, group: u64) -> u64 {
        self.group_start + group * self.group_blocks
    }

    /// Number of the group holding fs block `b`, if `b` is inside the group area.
    pub fn group_of(&self, b: u64) -> Option<u64> {
        let g = b.checked_sub(self.group_start)? / self.group_blocks;
        (g < self.group_count).then_some(g)
    }

    /// Does the volume fit a device of `dev_blocks` fs blocks? A checksummed superblock whose
    /// regions run past the device is as unusable as a damaged one (wrong device, truncated
    /// LUN, or a hand-edited block count).
    pub fn check_device(&self, dev_blocks: u64) -> Result<()> {
        if self.total_blocks > dev_blocks {
            return Err(Error::corrupted(format!(
                "superblock says the volume has {} blocks but the device has only {dev_blocks}: wrong device, truncated LUN, or a damaged superblock",
                self.total_blocks
            )));
        }
        Ok(())
    }

    /// Find the superblock to use: the primary (fs block 0) if it decodes, validates and fits
    /// the device, else the backup in the device's last fs block (which must name itself as the
    /// backup and fit the device too). This is the one place that decides between them:
    /// mount, fsck, the device opener and the CLI tools call it. `read(b)` returns fs block `b`.
    /// No I/O happens here beyond what `read` does.
    pub fn locate(
        dev_blocks: u64,
        read: &mut dyn FnMut(u64) -> Result<Vec<u8>>,
    ) -> Result<Located> {
        if dev_blocks < 2 {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("device of {dev_blocks} fs blocks is too small to hold a CetraFS volume"),
            ));
        }
        let usable =
            |buf: &[u8]| Self::decode(buf).and_then(|sb| sb.check_device(dev_blocks).map(|()| sb));
        let primary_raw = read(0)?;
        let primary_error = match usable(&primary_raw) {
            Ok(sb) => {
                return Ok(Located {
                    sb,
                    from_backup: false,
                    primary_error: None,
                })
            }
            Err(e) => e,
        };
        let at = dev_blocks - 1;
        let backup_raw = read(at);
        let backup = match &backup_raw {
            Ok(raw) => usable(raw).and_then(|sb| {
                if sb.backup_block == at {
                    Ok(sb)
                } else {
                    Err(Error::corrupted(format!(
                        "it names block {} as the backup, not itself",
                        sb.backup_block
                    )))
                }
            }),
            Err(e) => Err(Error::new(e.kind(), e.to_string())),
        };
        // A primary that is whole but larger than the device is a volume grown (`cetra grow`)
        // on a path that has not seen the LUN grow: the last block of what this host sees is
        // the backup of before the grow, which must never stand in for the grown primary (a
        // mount would lose the new groups, fsck would write it over the primary).
        if let Ok(p) = Self::decode(&primary_raw) {
            if let Ok(b) = &backup {
                if b.uuid == p.uuid && b.seq < p.seq {
                    return Err(Error::new(
                        ErrorKind::Range,
                        format!(
                            "the volume is {} MiB but this device shows {} MiB: the LUN grew and this host has not seen it yet; rescan it (iscsiadm -m session --rescan; multipathd resize map NAME) and try again",
                            (p.total_blocks * FS_BLOCK_SIZE as u64) >> 20,
                            (dev_blocks * FS_BLOCK_SIZE as u64) >> 20
                        ),
                    ));
                }
            }
        }
        match backup {
            Ok(sb) => Ok(Located {
                sb,
                from_backup: true,
                primary_error: Some(primary_error),
            }),
            Err(be) => {
                let magic = Self::has_magic(&primary_raw)
                    || backup_raw.as_deref().is_ok_and(Self::has_magic);
                if magic {
                    Err(Error::corrupted(format!(
                        "damaged CetraFS superblock ({primary_error}) and no usable backup at block {at} ({be}); run fsck.cetra"
                    )))
                } else {
                    Err(Error::corrupted(format!(
                        "not a CetraFS volume: no superblock at block 0 or at block {at} (the last of the device)"
                    )))
                }
            }
        }
    }

    pub fn uuid_string(&self) -> String {
        let u = &self.uuid;
        format!(
            "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
            u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mkfs::{plan, MkfsOptions};

    const DEV_BLOCKS: u64 = 32_768; // 128 MiB

    fn planned() -> Superblock {
        let o = MkfsOptions {
            max_nodes: 2,
            journal_bytes: 1 << 20,
            inode_lock_slots: 64,
            ..Default::default()
        };
        plan(DEV_BLOCKS * FS_BLOCK_SIZE as u64, 512, &o).unwrap()
    }

    /// A device of `DEV_BLOCKS` blocks with `primary` at 0 and `backup` in the last block.
    fn locate_on(primary: &[u8], backup: &[u8]) -> Result<Located> {
        Superblock::locate(DEV_BLOCKS, &mut |b| {
            Ok(match b {
                0 => primary.to_vec(),
                b if b == DEV_BLOCKS - 1 => backup.to_vec(),
                _ => vec![0; FS_BLOCK_SIZE],
            })
        })
    }

    #[test]
    fn timing_is_range_checked() {
        for (i, t) in [
            (0, 8000),
            (2000, 1999),
            (2000, u32::MAX),
            (u32::MAX, u32::MAX),
        ] {
            let mut sb = planned();
            sb.heartbeat_interval_ms = i;
            sb.io_timeout_ms = t;
            let e = Superblock::decode(&sb.encode()).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupted, "{i}/{t}");
        }
        let sb = planned();
        assert_eq!(Superblock::decode(&sb.encode()).unwrap(), sb);
    }

    #[test]
    fn locate_prefers_a_usable_primary() {
        let sb = planned();
        let l = locate_on(&sb.encode(), &[0; FS_BLOCK_SIZE]).unwrap();
        assert!(!l.from_backup && l.primary_error.is_none());
        assert_eq!(l.sb, sb);
    }

    #[test]
    fn locate_uses_the_backup_when_the_primary_geometry_is_impossible() {
        let sb = planned();
        let backup = sb.encode();
        // Checksummed but impossible: past the device, and regions out of order.
        let mut past = sb.clone();
        past.total_blocks = DEV_BLOCKS * 1000;
        past.backup_block = past.total_blocks - 1;
        let mut overlap = sb.clone();
        overlap.lock_start = overlap.hb_start;
        let mut timing = sb.clone();
        timing.io_timeout_ms = u32::MAX;
        for bad in [past, overlap, timing] {
            let l = locate_on(&bad.encode(), &backup).unwrap();
            assert!(l.from_backup);
            assert_eq!(l.sb, sb);
            let why = l.primary_error.unwrap().to_string();
            assert!(why.contains("superblock"), "{why}");
        }
        // A damaged checksum too.
        let mut flipped = sb.encode();
        flipped[120] ^= 1;
        assert!(locate_on(&flipped, &backup).unwrap().from_backup);
    }

    /// Version 5: the grow bit, only on top of version 4, and never more groups than the lock
    /// area has records for; without it the volume is version 4 as before.
    #[test]
    fn grow_bit_is_version_5_and_bounded_by_the_lock_area() {
        let sb = planned();
        assert!(sb.can_grow());
        assert!(sb.group_capacity() > sb.group_count);
        let mut v4 = sb.clone();
        v4.incompat &= !(INCOMPAT_GROW | INCOMPAT_GROUP_MARKS | INCOMPAT_GROUP_CLAIMS);
        let back = Superblock::decode(&v4.encode()).unwrap();
        assert_eq!((back.format_version(), back.can_grow()), (4, false));
        // The bit without the sharing mode, and more groups than records.
        let mut bad = sb.clone();
        bad.incompat &= !INCOMPAT_SHARING_MODE;
        bad.sharing = None;
        let e = Superblock::decode(&bad.encode()).unwrap_err();
        assert!(e.to_string().contains("online grow"), "{e}");
        let mut bad = sb.clone();
        bad.group_count = sb.group_capacity() + 1;
        bad.total_blocks = u64::MAX / 2;
        bad.backup_block = bad.total_blocks - 1;
        let e = Superblock::decode(&bad.encode()).unwrap_err();
        assert!(e.to_string().contains("lock area"), "{e}");
    }

    /// Version 6: added node slots' journals round-trip at byte 292; each must lie in one
    /// group's data, apart from the others, and the count must leave mkfs's slots.
    /// Version 7: the group-marks bit, only on top of version 5; without it the volume is
    /// version 5 as before, and a binary of version 6 refuses it by the bit. Version 8: the
    /// group-claims bit, only on top of version 7.
    #[test]
    fn group_marks_are_version_7_and_group_claims_version_8() {
        let sb = planned();
        assert!(sb.has_group_marks() && sb.has_group_claims());
        assert_eq!(sb.format_version(), 8);
        let mut v7 = sb.clone();
        v7.incompat &= !INCOMPAT_GROUP_CLAIMS;
        let back = Superblock::decode(&v7.encode()).unwrap();
        assert_eq!(
            (
                back.format_version(),
                back.has_group_marks(),
                back.has_group_claims()
            ),
            (7, true, false)
        );
        let mut v5 = sb.clone();
        v5.incompat &= !(INCOMPAT_GROUP_MARKS | INCOMPAT_GROUP_CLAIMS);
        let back = Superblock::decode(&v5.encode()).unwrap();
        assert_eq!((back.format_version(), back.has_group_marks()), (5, false));
        let mut bad = v7.clone();
        bad.incompat &= !(INCOMPAT_GROW | INCOMPAT_SHARING_MODE);
        let e = Superblock::decode(&bad.encode()).unwrap_err();
        assert!(e.to_string().contains("group marks"), "{e}");
        let mut bad = sb.clone();
        bad.incompat &= !INCOMPAT_GROUP_MARKS;
        let e = Superblock::decode(&bad.encode()).unwrap_err();
        assert!(e.to_string().contains("group claims"), "{e}");
    }

    #[test]
    fn added_node_slots_are_version_6_and_their_journals_are_checked() {
        let sb = planned();
        let data = sb.group_first_block(1) + 1 + u64::from(sb.bitmap_blocks) + 10;
        let mut v6 = sb.clone();
        v6.incompat &= !(INCOMPAT_GROUP_MARKS | INCOMPAT_GROUP_CLAIMS);
        v6.incompat |= INCOMPAT_EXTRA_JOURNALS;
        v6.max_nodes += 2;
        v6.extra_journals = vec![data, data + sb.journal_blocks];
        let raw = v6.encode();
        assert_eq!(u32::from_le_bytes(raw[292..296].try_into().unwrap()), 2);
        let back = Superblock::decode(&raw).unwrap();
        assert_eq!(back, v6);
        assert_eq!(back.format_version(), 6);
        assert_eq!(back.base_journals(), sb.max_nodes);
        assert_eq!(back.journal_of(sb.max_nodes + 1), data + sb.journal_blocks);
        assert_eq!(back.journal_of(1), sb.journal_start + sb.journal_blocks);
        assert!(!back.is_data_block(data + 3));
        // An extent that runs into an added journal is refused where it reaches it.
        assert!(back.bad_data_range(data - 10, 10).is_none());
        let (at, region) = back.bad_data_range(data - 5, 10).unwrap();
        assert_eq!(at, data);
        assert!(matches!(
            region,
            crate::format::layout::Region::Journal { index: 0, .. }
        ));
        for (what, journals) in [
            ("overlap", vec![data, data + 1]),
            (
                "not inside",
                vec![sb.group_first_block(1), data + sb.journal_blocks],
            ),
            ("not inside", vec![data, sb.journal_start]),
        ] {
            let bad = Superblock {
                extra_journals: journals,
                ..v6.clone()
            };
            let e = Superblock::decode(&bad.encode()).unwrap_err();
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
        let mut bad = v6.clone();
        bad.max_nodes = sb.max_nodes;
        let e = Superblock::decode(&bad.encode()).unwrap_err();
        assert!(e.to_string().contains("node"), "{e}");
    }

    /// Version 3: the object-lock fields round-trip; impossible values are refused with a
    /// message naming the region, and `locate` then falls back to the backup.
    #[test]
    fn object_lock_geometry_is_checked() {
        let sb = planned();
        assert_eq!(sb.format_version(), 8);
        assert_eq!(FORMAT_VERSION, 8);
        assert_eq!(Superblock::decode(&sb.encode()).unwrap(), sb);
        let raw = sb.encode();
        assert_eq!(u32::from_le_bytes(raw[8..12].try_into().unwrap()), 8);
        assert_eq!(
            u64::from_le_bytes(raw[264..272].try_into().unwrap()),
            sb.objlock_start
        );
        assert_eq!(
            u64::from_le_bytes(raw[272..280].try_into().unwrap()),
            sb.objlock_buckets
        );
        assert_eq!(
            u64::from_le_bytes(raw[280..288].try_into().unwrap()),
            sb.mailbox_start
        );
        assert_eq!(u32::from_le_bytes(raw[288..292].try_into().unwrap()), 1);
        assert!(raw[292..CRC].iter().all(|&b| b == 0));

        let with = |f: &dyn Fn(&mut Superblock)| {
            let mut s = sb.clone();
            f(&mut s);
            s
        };
        let cases: Vec<(Superblock, &str)> = vec![
            (with(&|s| s.objlock_buckets = 0), "without buckets"),
            (
                with(&|s| s.objlock_start = s.lock_start),
                "the object-lock area starts",
            ),
            (with(&|s| s.objlock_buckets += 8), "the mailbox area starts"),
            (
                with(&|s| s.mailbox_start = s.objlock_start),
                "the mailbox area starts",
            ),
            (
                with(&|s| s.mailbox_start = s.journal_start - 1),
                "the journal area starts",
            ),
            (
                with(&|s| s.objlock_buckets = u64::MAX),
                "the mailbox area starts",
            ),
            (
                with(&|s| {
                    s.objlock_start = s.total_blocks;
                    s.mailbox_start = s.total_blocks + 100;
                }),
                "the journal area starts",
            ),
            (with(&|s| s.mailbox_start = u64::MAX), "overflows"),
        ];
        let backup = sb.encode();
        for (bad, why) in cases {
            let e = Superblock::decode(&bad.encode()).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupted, "{why}");
            assert!(e.to_string().contains(why), "{why}: {e}");
            let l = locate_on(&bad.encode(), &backup).unwrap();
            assert!(l.from_backup, "{why}");
            assert_eq!(l.sb, sb);
        }
        let area = sb.object_lock_area().unwrap();
        assert_eq!(area.buckets, sb.objlock_buckets);
        assert_eq!(area.mailboxes, sb.hb_slots);
        assert_eq!(area.bucket_offset, sb.objlock_start * 4096);
        assert_eq!(area.mailbox_offset, sb.mailbox_start * 4096);
    }

    /// Without the incompat bit the fields are ignored (as a version-2 binary ignores them),
    /// the version is 2, and a version that does not match the bits is refused.
    #[test]
    fn version_follows_the_object_lock_bit() {
        let sb = planned();
        let mut v2 = sb.clone();
        v2.incompat &= !(INCOMPAT_OBJECT_LOCKS
            | INCOMPAT_SHARING_MODE
            | INCOMPAT_GROW
            | INCOMPAT_GROUP_MARKS
            | INCOMPAT_GROUP_CLAIMS);
        v2.sharing = None;
        assert_eq!(v2.format_version(), 2);
        assert!(v2.object_lock_area().is_none());
        // Its fields still hold v3 values in memory: encoded as 0 without the bit...
        let raw = v2.encode();
        assert!(raw[264..CRC].iter().all(|&b| b == 0));
        let back = Superblock::decode(&raw).unwrap();
        assert_eq!(
            (back.objlock_start, back.objlock_buckets, back.mailbox_start),
            (0, 0, 0)
        );
        assert_eq!(back.objlock_blocks() + back.mailbox_blocks(), 0);
        // ...and ignored when a (hand-made) v2 superblock has them.
        let mut raw = v2.encode();
        raw[264..272].copy_from_slice(&7u64.to_le_bytes());
        raw[272..280].copy_from_slice(&u64::MAX.to_le_bytes());
        let crc = crc32c::crc32c(&raw[..CRC]);
        raw[CRC..].copy_from_slice(&crc.to_le_bytes());
        let back = Superblock::decode(&raw).unwrap();
        assert_eq!((back.objlock_start, back.objlock_buckets), (0, 0));
        // A v3 version field on a volume without the bit, and the other way round.
        for (s, version) in [(&v2, 3u32), (&sb, 2)] {
            let mut raw = s.encode();
            raw[8..12].copy_from_slice(&version.to_le_bytes());
            let crc = crc32c::crc32c(&raw[..CRC]);
            raw[CRC..].copy_from_slice(&crc.to_le_bytes());
            let e = Superblock::decode(&raw).unwrap_err();
            assert!(e.to_string().contains("does not match its incompat"), "{e}");
        }
        // A version this release does not know.
        let mut raw = sb.encode();
        raw[8..12].copy_from_slice(&9u32.to_le_bytes());
        let crc = crc32c::crc32c(&raw[..CRC]);
        raw[CRC..].copy_from_slice(&crc.to_le_bytes());
        let e = Superblock::decode(&raw).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("knows 1 to 8"), "{e}");
        assert!(sb.check_features().is_ok());
    }

    /// Re-seal a hand-edited superblock.
    fn reseal(raw: &mut [u8]) {
        let crc = crc32c::crc32c(&raw[..CRC]);
        raw[CRC..].copy_from_slice(&crc.to_le_bytes());
    }

    /// Version 4: the sharing mode round-trips at byte 288; without the bit (versions 1 to 3)
    /// it is unknown and the field is ignored; impossible values do not decode; an older
    /// binary refuses the volume by its version and by the bit.
    #[test]
    fn sharing_mode_is_recorded_in_version_4() {
        let sb = planned();
        assert_eq!(sb.sharing, Some(SharingMode::SingleHost));
        for (mode, code) in [(SharingMode::SingleHost, 1u32), (SharingMode::MultiNode, 2)] {
            let s = Superblock {
                sharing: Some(mode),
                ..sb.clone()
            };
            let raw = s.encode();
            assert_eq!(u32::from_le_bytes(raw[288..292].try_into().unwrap()), code);
            let back = Superblock::decode(&raw).unwrap();
            assert_eq!(back.sharing, Some(mode));
            assert_eq!(back.format_version(), 8);
        }
        assert_eq!(SharingMode::SingleHost.to_string(), "single-host");
        assert_eq!(SharingMode::MultiNode.to_string(), "multi-node");

        // A version-3 volume: no bit, the mode is unknown, and byte 288 is not read.
        let mut v3 = sb.clone();
        v3.incompat &=
            !(INCOMPAT_SHARING_MODE | INCOMPAT_GROW | INCOMPAT_GROUP_MARKS | INCOMPAT_GROUP_CLAIMS);
        v3.sharing = None;
        assert_eq!(v3.format_version(), 3);
        let mut raw = v3.encode();
        assert!(raw[288..CRC].iter().all(|&b| b == 0));
        raw[288..292].copy_from_slice(&7u32.to_le_bytes());
        reseal(&mut raw);
        let back = Superblock::decode(&raw).unwrap();
        assert_eq!((back.sharing, back.format_version()), (None, 3));
        assert!(back.check_features().is_ok());

        // Unknown codes, the bit without the object-lock area, a version that does not match.
        for code in [0u32, 3, u32::MAX] {
            let mut raw = sb.encode();
            raw[288..292].copy_from_slice(&code.to_le_bytes());
            reseal(&mut raw);
            let e = Superblock::decode(&raw).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupted);
            assert!(e.to_string().contains("unknown sharing mode"), "{e}");
        }
        let mut no_objlocks = sb.clone();
        no_objlocks.incompat &= !INCOMPAT_OBJECT_LOCKS;
        let e = Superblock::decode(&no_objlocks.encode()).unwrap_err();
        assert!(
            e.to_string().contains("without the object-lock area"),
            "{e}"
        );
        let mut raw = sb.encode();
        raw[8..12].copy_from_slice(&3u32.to_le_bytes());
        reseal(&mut raw);
        let e = Superblock::decode(&raw).unwrap_err();
        assert!(e.to_string().contains("does not match its incompat"), "{e}");

        // What a version-3 binary does with this volume: its decoder stops at the version
        // (FORMAT_VERSION 3 there), and its feature check at the bit it does not know.
        let old_known = INCOMPAT_OVERFLOW | INCOMPAT_OBJECT_LOCKS;
        assert_ne!(sb.incompat & !old_known, 0);
        assert!(sb.format_version() > 3);
    }

    #[test]
    fn locate_with_both_bad_is_a_clear_error() {
        let sb = planned();
        let mut past = sb.clone();
        past.total_blocks = DEV_BLOCKS + 1;
        // Backup that names another block as the backup (not the device's last block).
        let mut elsewhere = sb.clone();
        elsewhere.backup_block -= 1;
        for backup in [past.encode(), elsewhere.encode(), vec![0xa5; FS_BLOCK_SIZE]] {
            let e = locate_on(&past.encode(), &backup).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupted);
            let m = e.to_string();
            assert!(
                m.contains("damaged CetraFS superblock")
                    && m.contains("no usable backup")
                    && m.contains("device has only"),
                "{m}"
            );
        }
        let e = locate_on(&[0; FS_BLOCK_SIZE], &[0; FS_BLOCK_SIZE]).unwrap_err();
        assert!(e.to_string().contains("not a CetraFS volume"), "{e}");
        let e = Superblock::locate(1, &mut |_| Ok(sb.encode())).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        // A read error of the primary is an error, not a fallback to something unverified.
        let e = Superblock::locate(DEV_BLOCKS, &mut |_| Err(Error::new(ErrorKind::Io, "boom")))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io);
    }
}
