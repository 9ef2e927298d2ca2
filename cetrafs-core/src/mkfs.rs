//! Creating a volume: compute the region layout for a device and write the initial metadata.

use crate::dev::{AlignedBuf, BlockDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::group::{
    encode_bitmap, GroupHeader, BITMAP_BYTES_PER_BLOCK, BITS_PER_BITMAP_BLOCK,
};
use crate::format::inode::{Inode, Timespec};
use crate::format::mailbox::Mailbox;
use crate::format::object_lock::Bucket;
use crate::format::superblock::{
    SharingMode, Superblock, INCOMPAT_GROUP_CLAIMS, INCOMPAT_GROUP_MARKS, INCOMPAT_GROW,
    INCOMPAT_OBJECT_LOCKS, INCOMPAT_OVERFLOW, INCOMPAT_SHARING_MODE,
};
use crate::format::FS_BLOCK;

pub const DEFAULT_MAX_NODES: u32 = 16;
pub const MIN_HB_SLOTS: u32 = 64;
pub const DEFAULT_JOURNAL_BYTES: u64 = 64 << 20;
pub const DEFAULT_INODE_LOCK_SLOTS: u32 = 4096;
/// Production heartbeat timing (design lessons §8.3): renew every 2 s, 8 s I/O deadline.
pub const DEFAULT_HEARTBEAT_INTERVAL_MS: u32 = 2000;
pub const DEFAULT_IO_TIMEOUT_MS: u32 = 8000;
/// Target group size: 1 GiB, so an 8 GiB image needs only ~9 extents.
pub const MAX_GROUP_BLOCKS: u64 = 1 << 18;
pub const MIN_GROUP_BLOCKS: u64 = 1 << 12;
/// Groups are shrunk (down to `MIN_GROUP_BLOCKS`) until there are at least this many.
pub const MIN_GROUPS: u64 = 8;
/// Object-lock buckets (format v3): one per 64 fs blocks (256 KiB) of volume, at least
/// `MIN_OBJLOCK_BUCKETS` and at most `MAX_OBJLOCK_BUCKETS` (8 MiB of 512-byte records; room
/// for ~229,000 cached locks: `cluster/object_lock.rs`).
pub const OBJLOCK_BLOCKS_PER_BUCKET: u64 = 64;
pub const MIN_OBJLOCK_BUCKETS: u64 = 256;
pub const MAX_OBJLOCK_BUCKETS: u64 = 16_384;
/// Format v5: without `--max-size`, the lock area has group records for a volume this many
/// times the device's size ...
pub const DEFAULT_GROW_FACTOR: u64 = 16;
/// ... but for at most this many bytes (64 TiB) ...
pub const DEFAULT_MAX_GROW_BYTES: u64 = 64 << 40;
/// ... and `--max-size` may ask for at most this many group records (4 GiB of lock area at
/// 4096-byte logical blocks): a larger volume needs larger groups (`--group-size`).
pub const MAX_GROUP_RECORDS: u64 = 1 << 20;
/// How much of each journal mkfs zeroes (the journal code treats zeros as "empty").
const JOURNAL_ZERO_BYTES: u64 = 1 << 20;

/// The rules for changing an allocation group's bitmap (`MkfsOptions::group_rules`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupRules {
    /// Format 5: only under the global lock.
    GlobalLock,
    /// Format 7, group marks (`INCOMPAT_GROUP_MARKS`): a node also refills its block pool
    /// from its own groups without the global lock, under the group's mark.
    Marks,
    /// Format 8 (the default), group claims (`INCOMPAT_GROUP_CLAIMS`): and a node whose own
    /// groups are full claims a group nobody owns without the global lock.
    Claims,
}

#[derive(Debug, Clone)]
pub struct MkfsOptions {
    pub label: String,
    pub max_nodes: u32,
    pub journal_bytes: u64,
    pub group_bytes: Option<u64>,
    pub heartbeat_interval_ms: u32,
    pub io_timeout_ms: u32,
    pub inode_lock_slots: u32,
    /// Format version 3 (the default): place the per-object lock area and the lock-request
    /// mailboxes (`INCOMPAT_OBJECT_LOCKS`). false makes a version-2 volume (global lock only),
    /// mountable by version-2 binaries.
    pub object_locks: bool,
    /// Format version 4 (the default): record how the volume may be shared
    /// (`INCOMPAT_SHARING_MODE`); `mkfs.cetra` passes what its probe of the device found
    /// (`dev/open.rs`). None records nothing (format 3). Format 4 builds on format 3, so this is
    /// ignored without `object_locks` (format 2). The default, single-host, is the mode that
    /// refuses a second machine.
    pub sharing: Option<SharingMode>,
    /// Format version 5 (the default): the volume can grow online (`INCOMPAT_GROW`, `cetra
    /// grow`); ignored without `sharing` (format 5 builds on format 4).
    pub growable: bool,
    /// Who may change an allocation group's bitmap outside the global lock (docs/locking.md
    /// §9); ignored without `growable` (formats 7 and 8 build on format 5).
    pub group_rules: GroupRules,
    /// v5: the largest size (bytes) the volume can grow to, which sizes the lock area's group
    /// records (one logical block per group); None: [`DEFAULT_GROW_FACTOR`] times the device,
    /// at most [`DEFAULT_MAX_GROW_BYTES`] (never less than the device).
    pub max_bytes: Option<u64>,
}

impl Default for MkfsOptions {
    fn default() -> Self {
        Self {
            label: String::new(),
            max_nodes: DEFAULT_MAX_NODES,
            journal_bytes: DEFAULT_JOURNAL_BYTES,
            group_bytes: None,
            heartbeat_interval_ms: DEFAULT_HEARTBEAT_INTERVAL_MS,
            io_timeout_ms: DEFAULT_IO_TIMEOUT_MS,
            inode_lock_slots: DEFAULT_INODE_LOCK_SLOTS,
            object_locks: true,
            sharing: Some(SharingMode::SingleHost),
            growable: true,
            group_rules: GroupRules::Claims,
            max_bytes: None,
        }
    }
}

/// Compute the superblock (layout) for a device of `size_bytes` with `lbs`-byte logical blocks.
pub fn plan(size_bytes: u64, lbs: u32, opts: &MkfsOptions) -> Result<Superblock> {
    let inval = |m: String| Err(Error::new(ErrorKind::InvalidInput, m));
    if opts.label.len() > crate::format::superblock::LABEL_LEN {
        return inval(format!(
            "label is longer than {} bytes",
            crate::format::superblock::LABEL_LEN
        ));
    }
    if opts.max_nodes == 0 || opts.max_nodes > 1024 {
        return inval(format!(
            "max nodes {} must be between 1 and 1024",
            opts.max_nodes
        ));
    }
    if let Err(e) =
        crate::format::heartbeat::check_timing(opts.heartbeat_interval_ms, opts.io_timeout_ms)
    {
        return inval(e);
    }
    let total = size_bytes / FS_BLOCK;
    let per_fs = FS_BLOCK / u64::from(lbs);
    let hb_slots = opts.max_nodes.max(MIN_HB_SLOTS);
    let hb_blocks = u64::from(hb_slots).div_ceil(per_fs);
    let journal_blocks = (opts.journal_bytes / FS_BLOCK).max(256);
    let hb_start = 2;
    let after_hb = hb_start + hb_blocks;
    let (objlock_buckets, mailboxes) = if opts.object_locks {
        (
            (total / OBJLOCK_BLOCKS_PER_BUCKET).clamp(MIN_OBJLOCK_BUCKETS, MAX_OBJLOCK_BUCKETS),
            u64::from(hb_slots),
        )
    } else {
        (0, 0)
    };
    let objlock_blocks = objlock_buckets.div_ceil(per_fs);
    let mailbox_blocks = mailboxes.div_ceil(per_fs);
    // First guess of the group area to size the lock area (one record per group).
    let rough_avail = total.saturating_sub(
        after_hb + objlock_blocks + mailbox_blocks + journal_blocks * u64::from(opts.max_nodes) + 1,
    );
    let group_blocks = if let Some(b) = opts.group_bytes {
        (b / FS_BLOCK).max(MIN_GROUP_BLOCKS)
    } else {
        let mut g = MAX_GROUP_BLOCKS;
        while g > MIN_GROUP_BLOCKS && rough_avail / g < MIN_GROUPS {
            g /= 2;
        }
        g
    };
    let rough_groups = rough_avail / group_blocks;
    let growable = opts.growable && opts.object_locks && opts.sharing.is_some();
    let group_records = if growable {
        let max = opts.max_bytes.unwrap_or_else(|| {
            size_bytes
                .saturating_mul(DEFAULT_GROW_FACTOR)
                .min(DEFAULT_MAX_GROW_BYTES)
                .max(size_bytes)
        });
        let records = (max / FS_BLOCK).div_ceil(group_blocks);
        if records > MAX_GROUP_RECORDS {
            return inval(format!(
                "a maximum size of {} GiB needs {records} group lock records (at most {MAX_GROUP_RECORDS}); use a larger --group-size or a smaller --max-size",
                max >> 30
            ));
        }
        records.max(rough_groups)
    } else {
        rough_groups
    };
    let lock_count = 1 + group_records + u64::from(opts.inode_lock_slots);
    let lock_blocks = lock_count.div_ceil(per_fs);
    let lock_start = after_hb;
    // v3: buckets, then mailboxes, right after the lock area.
    let objlock_start = lock_start + lock_blocks;
    let mailbox_start = objlock_start + objlock_blocks;
    let journal_start = mailbox_start + mailbox_blocks;
    let group_start = journal_start + journal_blocks * u64::from(opts.max_nodes);
    let backup_block = total.saturating_sub(1);
    let group_count = backup_block.saturating_sub(group_start) / group_blocks;
    if group_count == 0 {
        let need = (group_start + MIN_GROUP_BLOCKS + 1) * FS_BLOCK;
        return Err(Error::new(
            ErrorKind::NoSpace,
            format!(
                "device of {} MiB is too small for {} node journals of {} MiB; need at least {} MiB (use -N or --journal-size)",
                size_bytes >> 20,
                opts.max_nodes,
                (journal_blocks * FS_BLOCK) >> 20,
                need.div_ceil(1 << 20)
            ),
        ));
    }
    let bitmap_blocks =
        u32::try_from(group_blocks.div_ceil(BITS_PER_BITMAP_BLOCK)).unwrap_or(u32::MAX);
    let mut uuid = [0u8; 16];
    rand::Rng::fill(&mut rand::thread_rng(), &mut uuid);
    uuid[6] = (uuid[6] & 0x0f) | 0x40;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    let (incompat, objlock_start, mailbox_start) = if opts.object_locks {
        (
            INCOMPAT_OVERFLOW | INCOMPAT_OBJECT_LOCKS,
            objlock_start,
            mailbox_start,
        )
    } else {
        (INCOMPAT_OVERFLOW, 0, 0)
    };
    let sharing = opts.sharing.filter(|_| opts.object_locks);
    let incompat = if sharing.is_some() {
        incompat | INCOMPAT_SHARING_MODE
    } else {
        incompat
    };
    let incompat = if growable {
        incompat | INCOMPAT_GROW
    } else {
        incompat
    };
    let incompat = match opts.group_rules {
        _ if !growable => incompat,
        GroupRules::GlobalLock => incompat,
        GroupRules::Marks => incompat | INCOMPAT_GROUP_MARKS,
        GroupRules::Claims => incompat | INCOMPAT_GROUP_MARKS | INCOMPAT_GROUP_CLAIMS,
    };
    Ok(Superblock {
        compat: 0,
        ro_compat: 0,
        incompat,
        uuid,
        label: opts.label.clone(),
        logical_block_size: lbs,
        total_blocks: total,
        created: now().sec.max(0).cast_unsigned(),
        max_nodes: opts.max_nodes,
        hb_slots,
        probe_block: 1,
        hb_start,
        hb_blocks,
        lock_start,
        lock_count,
        lock_blocks,
        journal_start,
        journal_blocks,
        group_start,
        group_count,
        group_blocks,
        root_ino: group_start + 1 + u64::from(bitmap_blocks),
        heartbeat_interval_ms: opts.heartbeat_interval_ms,
        io_timeout_ms: opts.io_timeout_ms,
        backup_block,
        seq: 1,
        bitmap_blocks,
        inode_lock_slots: opts.inode_lock_slots,
        objlock_start,
        objlock_buckets,
        mailbox_start,
        sharing,
        extra_journals: Vec::new(),
    })
}

pub fn now() -> Timespec {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    Timespec {
        sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nsec: d.subsec_nanos(),
    }
}

/// Write a fresh volume. `progress(done, total)` is called as regions are written.
pub fn format(
    dev: &dyn BlockDevice,
    opts: &MkfsOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Superblock> {
    let geo = dev.geometry().clone();
    let sb = plan(geo.size_bytes, geo.logical_block_size, opts)?;
    let total_steps = sb.group_count + u64::from(sb.max_nodes) + 4;
    let mut step = 0;
    let mut tick = |p: &mut dyn FnMut(u64, u64)| {
        step += 1;
        p(step, total_steps);
    };

    // Invalidate any old superblock first, so an interrupted mkfs is not mistaken for a volume.
    let zero_block = AlignedBuf::new(crate::format::FS_BLOCK_SIZE);
    dev.write_at(0, &zero_block)?;
    dev.write_at(sb.backup_block * FS_BLOCK, &zero_block)?;

    // Probe, heartbeat and lock areas: all zero = free slots and unheld locks.
    zero_range(dev, sb.probe_block, sb.journal_start - sb.probe_block)?;
    tick(progress);
    // v3: every bucket and mailbox as its encoded empty record (what fsck expects to find).
    write_object_lock_area(dev, &sb)?;
    tick(progress);
    for n in 0..u64::from(sb.max_nodes) {
        let start = sb.journal_start + n * sb.journal_blocks;
        zero_range(
            dev,
            start,
            (JOURNAL_ZERO_BYTES / FS_BLOCK).min(sb.journal_blocks),
        )?;
        tick(progress);
    }

    // Groups: header + bitmap, with the group's own metadata blocks marked in use.
    for g in 0..sb.group_count {
        write_group(dev, &sb, g)?;
        tick(progress);
    }

    // Root directory: empty (no entry tree until the first entry), owned by root, 0755.
    let t = now();
    let root = Inode {
        ino: sb.root_ino,
        seq: 1,
        mode: libc::S_IFDIR | 0o755,
        nlink: 2,
        generation: 1,
        blocks: 1,
        parent: sb.root_ino,
        atime: t,
        mtime: t,
        ctime: t,
        crtime: t,
        ..Default::default()
    };
    dev.write_at(
        sb.root_ino * FS_BLOCK,
        &AlignedBuf::from_slice(&root.encode()),
    )?;
    dev.flush()?;
    // Backup first, primary last: the volume exists only once the primary is written.
    let sbb = AlignedBuf::from_slice(&sb.encode());
    dev.write_at(sb.backup_block * FS_BLOCK, &sbb)?;
    dev.flush()?;
    dev.write_at(0, &sbb)?;
    dev.flush()?;
    tick(progress);
    Ok(sb)
}

/// Write group `g` of `sb` empty: its header and bitmap, with the group's own metadata blocks
/// (and in group 0 the root inode) marked in use and the bits past its end set, so they are
/// never allocated. Used by mkfs for every group and by `cetra grow` for the groups it adds.
pub(crate) fn write_group(dev: &dyn BlockDevice, sb: &Superblock, g: u64) -> Result<()> {
    let first = sb.group_first_block(g);
    let meta = 1 + u64::from(sb.bitmap_blocks);
    let mut used = meta;
    if g == 0 {
        used += 1; // root inode
    }
    let mut bits = vec![0u8; BITMAP_BYTES_PER_BLOCK * sb.bitmap_blocks as usize];
    for b in 0..used {
        bits[usize::try_from(b / 8).unwrap_or(0)] |= 1 << (b % 8);
    }
    for b in sb.group_blocks..u64::from(sb.bitmap_blocks) * BITS_PER_BITMAP_BLOCK {
        bits[usize::try_from(b / 8).unwrap_or(0)] |= 1 << (b % 8);
    }
    let hdr = GroupHeader {
        seq: 1,
        index: g,
        first_block: first,
        block_count: sb.group_blocks,
        free_blocks: sb.group_blocks - used,
        bitmap_blocks: sb.bitmap_blocks,
    };
    let mut buf = AlignedBuf::new(usize::try_from(meta * FS_BLOCK).unwrap_or(0));
    buf[..crate::format::FS_BLOCK_SIZE].copy_from_slice(&hdr.encode());
    for (i, chunk) in bits.chunks(BITMAP_BYTES_PER_BLOCK).enumerate() {
        let at = first + 1 + i as u64;
        let o = (i + 1) * crate::format::FS_BLOCK_SIZE;
        buf[o..o + crate::format::FS_BLOCK_SIZE].copy_from_slice(&encode_bitmap(at, 1, chunk));
    }
    dev.write_at(first * FS_BLOCK, &buf)
}

/// Write every object-lock bucket and every mailbox of `sb` empty (nothing on a v2 volume).
fn write_object_lock_area(dev: &dyn BlockDevice, sb: &Superblock) -> Result<()> {
    let Some(area) = sb.object_lock_area() else {
        return Ok(());
    };
    let lbs = usize::try_from(sb.logical_block_size)
        .map_err(|_| Error::new(ErrorKind::Range, "logical block size"))?;
    write_records(dev, area.bucket_offset, area.buckets, lbs, &mut |i| {
        Bucket::empty(i).encode(lbs)
    })?;
    write_records(
        dev,
        area.mailbox_offset,
        u64::from(area.mailboxes),
        lbs,
        &mut |i| {
            let slot = u32::try_from(i).map_err(|_| Error::new(ErrorKind::Range, "slot"))?;
            Mailbox::empty(slot).encode(lbs)
        },
    )
}

/// Write `count` records of `lbs` bytes packed from byte `offset` (fs-block aligned), in
/// chunks of whole fs blocks; the tail of the last fs block is zero.
fn write_records(
    dev: &dyn BlockDevice,
    offset: u64,
    count: u64,
    lbs: usize,
    record: &mut dyn FnMut(u64) -> Result<Vec<u8>>,
) -> Result<()> {
    const CHUNK_BYTES: usize = 1 << 20;
    let per_chunk = u64::try_from(CHUNK_BYTES / lbs).unwrap_or(1);
    let mut i = 0;
    while i < count {
        let n = per_chunk.min(count - i);
        let bytes = usize::try_from(n).unwrap_or(0) * lbs;
        let mut buf = AlignedBuf::new(bytes.next_multiple_of(crate::format::FS_BLOCK_SIZE));
        for k in 0..n {
            let o = usize::try_from(k).unwrap_or(0) * lbs;
            buf[o..o + lbs].copy_from_slice(&record(i + k)?);
        }
        dev.write_at(offset + i * u64::try_from(lbs).unwrap_or(0), &buf)?;
        i += n;
    }
    Ok(())
}

fn zero_range(dev: &dyn BlockDevice, start: u64, blocks: u64) -> Result<()> {
    const CHUNK: u64 = 256;
    let buf = AlignedBuf::new(usize::try_from(CHUNK * FS_BLOCK).unwrap_or(0));
    let mut b = start;
    while b < start + blocks {
        let n = CHUNK.min(start + blocks - b);
        dev.write_at(
            b * FS_BLOCK,
            &buf[..usize::try_from(n * FS_BLOCK).unwrap_or(0)],
        )?;
        b += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::mem::MemDevice;

    #[test]
    fn plan_and_format_small() {
        let dev = MemDevice::new(256 << 20, 512);
        let opts = MkfsOptions {
            max_nodes: 4,
            journal_bytes: 4 << 20,
            ..Default::default()
        };
        let sb = format(&dev, &opts, &mut |_, _| {}).unwrap();
        let mut b = vec![0u8; 4096];
        dev.read_at(0, &mut b).unwrap();
        let back = Superblock::decode(&b).unwrap();
        assert_eq!(back, sb);
        assert!(sb.group_count >= MIN_GROUPS);
        assert!(sb.hb_slots >= 64);
    }

    /// v3 (the default): buckets and mailboxes right after the lock area, before the journals,
    /// every record written as its encoded empty self, and none of their blocks is data.
    #[test]
    fn v3_places_and_writes_the_object_lock_area() {
        for lbs in [512u32, 4096] {
            let dev = MemDevice::new(256 << 20, lbs);
            let opts = MkfsOptions {
                max_nodes: 4,
                journal_bytes: 4 << 20,
                ..Default::default()
            };
            let sb = format(&dev, &opts, &mut |_, _| {}).unwrap();
            assert_eq!(sb.format_version(), 8);
            assert_eq!(
                sb.sharing,
                Some(crate::format::superblock::SharingMode::SingleHost)
            );
            assert!(sb.has_object_locks());
            // 65,536 fs blocks / 64.
            assert_eq!(sb.objlock_buckets, 1024);
            assert_eq!(sb.objlock_start, sb.lock_start + sb.lock_blocks);
            assert_eq!(sb.mailbox_start, sb.objlock_start + sb.objlock_blocks());
            assert_eq!(sb.journal_start, sb.mailbox_start + sb.mailbox_blocks());
            let per_fs = FS_BLOCK / u64::from(lbs);
            assert_eq!(sb.objlock_blocks(), 1024u64.div_ceil(per_fs));
            assert_eq!(sb.mailbox_blocks(), u64::from(sb.hb_slots).div_ceil(per_fs));
            let area = sb.object_lock_area().unwrap();
            assert_eq!(area.bucket_offset, sb.objlock_start * FS_BLOCK);
            assert_eq!(area.mailbox_offset, sb.mailbox_start * FS_BLOCK);
            assert_eq!(area.mailboxes, sb.hb_slots);
            let n = lbs as usize;
            let mut rec = vec![0u8; n];
            for i in 0..area.buckets {
                dev.read_at(area.bucket_offset + i * u64::from(lbs), &mut rec)
                    .unwrap();
                assert_eq!(rec, Bucket::empty(i).encode(n).unwrap(), "bucket {i}");
                assert_eq!(Bucket::decode(&rec, i).unwrap(), Bucket::empty(i));
            }
            for slot in 0..area.mailboxes {
                dev.read_at(
                    area.mailbox_offset + u64::from(slot) * u64::from(lbs),
                    &mut rec,
                )
                .unwrap();
                assert_eq!(
                    rec,
                    Mailbox::empty(slot).encode(n).unwrap(),
                    "mailbox {slot}"
                );
            }
            for b in sb.objlock_start..sb.journal_start {
                let r = sb.region_of(b);
                assert!(
                    matches!(
                        r,
                        crate::format::layout::Region::ObjectLock
                            | crate::format::layout::Region::Mailbox
                    ),
                    "block {b}: {r}"
                );
                assert!(sb
                    .check_data_block(b, crate::format::layout::PointerKind::Extent, 1)
                    .is_err());
            }
            // The object-lock code accepts the area as placed.
            let shared: crate::dev::SharedDevice = std::sync::Arc::new(dev);
            crate::cluster::object_lock::ObjectLocks::new(
                shared,
                area,
                std::time::Duration::from_secs(1),
            )
            .unwrap();
        }
    }

    #[test]
    fn v2_on_request_has_no_object_lock_area() {
        let dev = MemDevice::new(256 << 20, 512);
        let opts = MkfsOptions {
            max_nodes: 4,
            journal_bytes: 4 << 20,
            object_locks: false,
            ..Default::default()
        };
        let sb = format(&dev, &opts, &mut |_, _| {}).unwrap();
        assert_eq!(sb.format_version(), 2);
        assert_eq!(sb.incompat, INCOMPAT_OVERFLOW);
        assert_eq!(
            (sb.objlock_start, sb.objlock_buckets, sb.mailbox_start),
            (0, 0, 0)
        );
        assert!(sb.object_lock_area().is_none());
        assert_eq!(sb.journal_start, sb.lock_start + sb.lock_blocks);
        let mut b = vec![0u8; 4096];
        dev.read_at(0, &mut b).unwrap();
        assert_eq!(Superblock::decode(&b).unwrap(), sb);
        // Bytes 264..288 are zero, as a version-2 binary wrote them.
        assert!(b[264..288].iter().all(|&x| x == 0));
    }

    #[test]
    fn bucket_count_scales_with_the_volume() {
        let small = MkfsOptions {
            max_nodes: 1,
            journal_bytes: 1 << 20,
            ..Default::default()
        };
        for (size, want) in [
            // 12,288 fs blocks: 192 by the ratio, clamped up.
            (48u64 << 20, MIN_OBJLOCK_BUCKETS),
            (256 << 20, 1024),
            (1 << 30, 4096),
            (4 << 30, MAX_OBJLOCK_BUCKETS),
            (1 << 40, MAX_OBJLOCK_BUCKETS),
        ] {
            for lbs in [512, 4096] {
                let sb = plan(size, lbs, &small).unwrap();
                assert_eq!(sb.objlock_buckets, want, "{size}");
            }
        }
    }

    proptest::proptest! {
        /// Whatever mkfs plans decodes back to itself and passes the geometry checks.
        #[test]
        fn planned_layouts_decode(
            mib in 48u64..(1 << 21),
            lbs in proptest::sample::select(vec![512u32, 4096]),
            nodes in 1u32..40,
            object_locks: bool,
            record_sharing: bool,
            growable: bool,
            rules in proptest::sample::select(vec![
                GroupRules::GlobalLock,
                GroupRules::Marks,
                GroupRules::Claims,
            ]),
        ) {
            let opts = MkfsOptions {
                max_nodes: nodes,
                journal_bytes: 1 << 20,
                object_locks,
                sharing: record_sharing.then_some(SharingMode::MultiNode),
                growable,
                group_rules: rules,
                ..Default::default()
            };
            if let Ok(sb) = plan(mib << 20, lbs, &opts) {
                let back = Superblock::decode(&sb.encode()).unwrap();
                proptest::prop_assert_eq!(&back, &sb);
                let want = match (object_locks, record_sharing, growable, rules) {
                    (false, ..) => 2,
                    (true, false, ..) => 3,
                    (true, true, false, _) => 4,
                    (true, true, true, GroupRules::GlobalLock) => 5,
                    (true, true, true, GroupRules::Marks) => 7,
                    (true, true, true, GroupRules::Claims) => 8,
                };
                proptest::prop_assert_eq!(back.format_version(), want);
                proptest::prop_assert_eq!(back.sharing.is_some(), want >= 4);
                proptest::prop_assert_eq!(back.can_grow(), want >= 5);
                proptest::prop_assert_eq!(back.has_group_marks(), want >= 7);
                proptest::prop_assert_eq!(back.has_group_claims(), want == 8);
                // Room for 16 times the device (at most 64 TiB), never less than it has.
                proptest::prop_assert!(back.group_capacity() >= back.group_count);
                if want >= 5 {
                    let wanted = ((mib << 20) * DEFAULT_GROW_FACTOR).min(DEFAULT_MAX_GROW_BYTES)
                        / (back.group_blocks * FS_BLOCK);
                    proptest::prop_assert!(back.group_capacity() >= wanted);
                }
                proptest::prop_assert!(back.object_lock_area().is_some() == object_locks);
            }
        }
    }

    #[test]
    fn too_small_is_refused_with_a_size() {
        let e = plan(64 << 20, 512, &MkfsOptions::default()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert!(e.to_string().contains("too small"), "{e}");
    }

    #[test]
    fn big_device_gets_1g_groups() {
        let sb = plan(64 << 30, 4096, &MkfsOptions::default()).unwrap();
        assert_eq!(sb.group_blocks, MAX_GROUP_BLOCKS);
        assert_eq!(sb.logical_block_size, 4096);
    }
}
