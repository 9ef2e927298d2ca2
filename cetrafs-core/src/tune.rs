//! Offline changes of a volume's superblock, for `cetra tune`: the label, the heartbeat
//! timing, and more node slots (`-N`, format 5 and later: [`add_node_slots`]). The caller holds the offline claim (`cluster/fsck_claim.rs`, as `cetra-tune:HOST`)
//! and has made sure no node has the volume mounted: every node reads these at mount and keeps
//! them while mounted. Both superblock copies are rewritten, the backup first and the primary
//! last (as mkfs writes them), each flushed, so a crash leaves the old or the new superblock as
//! the primary and fsck's `backup-superblock` repair brings the other in line.

use crate::dev::{AlignedBuf, BlockDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::group::{decode_bitmap, encode_bitmap, GroupHeader, BITS_PER_BITMAP_BLOCK};
use crate::format::heartbeat::check_timing;
use crate::format::superblock::{
    Superblock, INCOMPAT_EXTRA_JOURNALS, LABEL_LEN, MAX_EXTRA_JOURNALS,
};
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};

/// What to change (None: keep).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tune {
    pub label: Option<String>,
    pub heartbeat_interval_ms: Option<u32>,
    pub io_timeout_ms: Option<u32>,
    /// Node slots to have (more than now, at most the heartbeat slots).
    pub max_nodes: Option<u32>,
}

impl Tune {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// `sb` with `t` applied, or why not (InvalidInput): the same limits as mkfs.
pub fn tuned(sb: &Superblock, t: &Tune) -> Result<Superblock> {
    let mut new = sb.clone();
    if let Some(l) = &t.label {
        if l.len() > LABEL_LEN || l.contains('\0') {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("the label must be at most {LABEL_LEN} bytes, without NUL"),
            ));
        }
        new.label.clone_from(l);
    }
    if let Some(i) = t.heartbeat_interval_ms {
        new.heartbeat_interval_ms = i;
    }
    if let Some(i) = t.io_timeout_ms {
        new.io_timeout_ms = i;
    }
    check_timing(new.heartbeat_interval_ms, new.io_timeout_ms)
        .map_err(|e| Error::new(ErrorKind::InvalidInput, e))?;
    if let Some(n) = t.max_nodes {
        check_node_slots(sb, n)?;
    }
    new.seq = sb.seq.saturating_add(1);
    Ok(new)
}

/// Can `sb` have `nodes` node slots by adding some?
fn check_node_slots(sb: &Superblock, nodes: u32) -> Result<()> {
    let inval = |m: String| Err(Error::new(ErrorKind::InvalidInput, m));
    sb.require_growable("adding node slots")?;
    if nodes <= sb.max_nodes {
        return inval(format!(
            "the volume has {} node slots; cetra tune can only add slots",
            sb.max_nodes
        ));
    }
    if nodes > sb.hb_slots {
        return inval(format!(
            "at most {} node slots: the volume's heartbeat area and mailboxes have room for {} nodes",
            sb.hb_slots, sb.hb_slots
        ));
    }
    let extra = (nodes - sb.base_journals()) as usize;
    if extra > MAX_EXTRA_JOURNALS {
        return inval(format!(
            "at most {MAX_EXTRA_JOURNALS} node slots can be added after mkfs"
        ));
    }
    if sb.journal_blocks > sb.group_blocks - 1 - u64::from(sb.bitmap_blocks) {
        return inval(format!(
            "a journal of {} MiB does not fit in an allocation group of {} MiB",
            (sb.journal_blocks * FS_BLOCK) >> 20,
            (sb.group_blocks * FS_BLOCK) >> 20
        ));
    }
    Ok(())
}

/// `t` applied to `sb` on `dev` (held offline: the caller's claim, no node mounted): the new
/// superblock, not yet written ([`write_superblock`] does that, last). For more node slots,
/// each added slot gets a journal of `journal_blocks` contiguous blocks taken from the free
/// data of one allocation group (the last groups first, away from where files start): marked
/// used in the group's bitmap and header, and its first MiB zeroed (an empty slot header, no
/// transaction), before the superblock names it. A crash before the superblock is written
/// leaves those blocks marked used with nothing claiming them: `fsck.cetra -y` frees them
/// (`free-leaked`). Refused (Busy) while any slot's journal holds a committed transaction:
/// the bitmaps are only right once it is replayed (mount the volume once, or run fsck).
pub fn apply(dev: &dyn BlockDevice, sb: &Superblock, t: &Tune) -> Result<Superblock> {
    let mut new = tuned(sb, t)?;
    let Some(nodes) = t.max_nodes else {
        return Ok(new);
    };
    if let Some((slot, _)) = crate::journal::pending(dev, sb)?.first() {
        return Err(Error::new(
            ErrorKind::Busy,
            format!(
                "node slot {slot} has a committed journal transaction not yet replayed; mount the volume once (or run fsck.cetra) first"
            ),
        ));
    }
    let want = nodes - sb.max_nodes;
    let runs = take_runs(dev, sb, want)?;
    let zero = AlignedBuf::new(usize::try_from(FS_BLOCK).unwrap_or(4096) * 256);
    for &start in &runs {
        let n = sb.journal_blocks.min(256);
        dev.write_at(
            start * FS_BLOCK,
            &zero[..usize::try_from(n * FS_BLOCK).unwrap_or(0)],
        )?;
    }
    dev.flush()?;
    new.extra_journals.extend(runs);
    new.max_nodes = nodes;
    new.incompat |= INCOMPAT_EXTRA_JOURNALS;
    new.validate()?;
    Ok(new)
}

/// A group's free count published in its lock record's value block (which mount trusts over
/// the header) follows the header: rewritten if one was published. Offline, under the claim,
/// so a plain write; a record that does not decode is left to fsck.
fn republish_free(dev: &dyn BlockDevice, sb: &Superblock, g: u64, free: u64) -> Result<()> {
    let layout = crate::cluster::lock::LockLayout::new(sb);
    let lbs = sb.logical_block_size as usize;
    let index = 1 + g;
    let at = sb.lock_start * FS_BLOCK + index * lbs as u64;
    let raw = crate::dev::read_aligned(dev, at, lbs)?;
    let Ok(mut rec) = layout.decode_at(&raw, index) else {
        return Ok(());
    };
    if rec.group_free().is_none() {
        return Ok(());
    }
    rec.set_group_free(free);
    dev.write_at(at, &AlignedBuf::from_slice(&rec.encode(lbs)))
}

/// Take `count` free runs of `journal_blocks` from the groups' data (last group first) and
/// mark them used; returns their first blocks. Nothing is written unless all are found.
fn take_runs(dev: &dyn BlockDevice, sb: &Superblock, count: u32) -> Result<Vec<u64>> {
    let len = sb.journal_blocks;
    let meta = 1 + u64::from(sb.bitmap_blocks);
    let mut out = Vec::new();
    // (group, its bitmap with the runs marked, the bitmap blocks' seqs, blocks taken)
    let mut changed: Vec<(u64, Vec<u8>, Vec<u64>, u64)> = Vec::new();
    for g in (0..sb.group_count).rev() {
        if out.len() >= count as usize {
            break;
        }
        let first = sb.group_first_block(g);
        let mut seqs = Vec::new();
        let mut bits = Vec::new();
        for i in 0..u64::from(sb.bitmap_blocks) {
            let at = first + 1 + i;
            let raw = crate::dev::read_aligned(dev, at * FS_BLOCK, FS_BLOCK_SIZE)?;
            let (seq, payload) = decode_bitmap(&raw, at)?;
            seqs.push(seq);
            bits.extend_from_slice(payload);
        }
        let used = |bits: &[u8], b: u64| {
            usize::try_from(b / 8)
                .ok()
                .and_then(|i| bits.get(i))
                .is_none_or(|byte| byte & (1 << (b % 8)) != 0)
        };
        let mut taken = 0u64;
        let mut b = meta;
        while b + len <= sb.group_blocks && out.len() < count as usize {
            if let Some(x) = (b..b + len).rev().find(|&x| used(&bits, x)) {
                b = x + 1;
                continue;
            }
            for x in b..b + len {
                if let Some(byte) = usize::try_from(x / 8).ok().and_then(|i| bits.get_mut(i)) {
                    *byte |= 1 << (x % 8);
                }
            }
            out.push(first + b);
            taken += len;
            b += len;
        }
        if taken > 0 {
            changed.push((g, bits, seqs, taken));
        }
    }
    if out.len() < count as usize {
        return Err(Error::new(
            ErrorKind::NoSpace,
            format!(
                "no room for {count} journals of {} MiB in free space (each must be contiguous inside one allocation group)",
                (len * FS_BLOCK) >> 20
            ),
        ));
    }
    for (g, bits, seqs, taken) in changed {
        let first = sb.group_first_block(g);
        let raw = crate::dev::read_aligned(dev, first * FS_BLOCK, FS_BLOCK_SIZE)?;
        let mut header = GroupHeader::decode(&raw, first)?;
        header.free_blocks = header.free_blocks.checked_sub(taken).ok_or_else(|| {
            Error::corrupted(format!(
                "group {g}: its header counts fewer free blocks than its bitmap has; run fsck.cetra"
            ))
        })?;
        header.seq = header.seq.saturating_add(1);
        let per = usize::try_from(BITS_PER_BITMAP_BLOCK / 8).unwrap_or(usize::MAX);
        for ((i, chunk), seq) in (0u64..).zip(bits.chunks(per)).zip(&seqs) {
            let at = first + 1 + i;
            dev.write_at(
                at * FS_BLOCK,
                &AlignedBuf::from_slice(&encode_bitmap(at, seq.saturating_add(1), chunk)),
            )?;
        }
        dev.write_at(first * FS_BLOCK, &AlignedBuf::from_slice(&header.encode()))?;
        republish_free(dev, sb, g, header.free_blocks)?;
    }
    dev.flush()?;
    Ok(out)
}

/// Write `new` as the volume's superblock: backup, flush, primary, flush.
pub fn write_superblock(dev: &dyn BlockDevice, new: &Superblock) -> Result<()> {
    let image = AlignedBuf::from_slice(&new.encode());
    dev.write_at(new.backup_block * FS_BLOCK, &image)?;
    dev.flush()?;
    crate::failpoint::process("tune::between_copies");
    dev.write_at(0, &image)?;
    dev.flush()
}
