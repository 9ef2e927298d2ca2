//! Online grow (`cetra grow`; format v5, `INCOMPAT_GROW`): the LUN grew, the volume takes the
//! new space as more allocation groups while every node keeps it mounted.
//!
//! # What a volume can grow to
//! Everything mkfs placed stays where it is; only the group area grows, by whole groups, and
//! the backup superblock moves to the device's new last block. Each group needs its lock
//! record (`1 + g`, `cluster/lock.rs`), and the lock area cannot move: mkfs of a v5 volume
//! sizes it for `--max-size` (default 16 times the device, at most 64 TiB), and
//! [`Superblock::group_capacity`] is the limit. The unused tail after the last whole group
//! (less than one group) stays unused, as after mkfs.
//!
//! # The grow ([`Volume::grow`]), under the global lock held exclusively
//! 1. Re-read the device's size (`BlockDevice::refresh_size`: READ CAPACITY on an `SG_IO` path,
//!    BLKGETSIZE64 of a rescanned block device, the length of a LUN file) and compute the new
//!    geometry: as many whole groups as fit before the new last block, at most the capacity.
//!    Refused (nothing written) when that adds no group.
//! 2. Write each new group's header and bitmap, empty (`mkfs::write_group`); flush
//!    (failpoint `grow::groups_written`). Until step 4 they lie in what the on-disk
//!    superblock calls the unused tail, so a crash here leaves the old volume, intact.
//! 3. Publish the new `seq` in the global lock record's value block (one CAW while holding the
//!    lock; failpoint `grow::published`). The seq is one more than both the superblock's and
//!    the value block's, so a grow repeated after a crash is still a change.
//! 4. Write the new superblock: the backup at the new last block, flush, then the primary at
//!    block 0, flush (`tune::write_superblock`; failpoint `tune::between_copies`).
//! 5. Adopt it here ([`Meta::adopt_geometry`]: the allocator reads the new group headers), and
//!    release the lock as usual.
//!
//! # Every node picks it up ([`Volume::follow_geometry`], [`newest`])
//! Nothing can reference a new group before its superblock is written, and only a holder of
//! the global lock allocates from a group it knows. Every later grant of the global lock (to
//! any node, shared or exclusive) returns the record; a node that finds a value-block seq it
//! has not looked at re-reads the primary superblock and, if it is a newer superblock of the
//! same volume, adopts it before the operation that took the lock reads any metadata. So no
//! node meets a pointer into a group it does not know. A mounting node reads the superblock
//! again after it claimed its slot (the journals it replays may use new groups) and once more
//! when it holds the global lock shared (no grow runs then). A path that does not show the new
//! size never falls back to the backup of before the grow (`Superblock::locate` refuses,
//! saying to rescan), which would lose the new groups. `df` (statfs takes the lock shared)
//! shows the new size on every node after its next metadata operation. A node whose path to
//! the LUN does not show the new size yet (a kernel block device not rescanned) refuses its
//! metadata operations with an error that says so, until it does; nothing is written by it
//! meanwhile.
//!
//! A crash before 4 ends leaves the old primary superblock, so the old size: the next mount
//! and every node use it, and a new `cetra grow` does the grow again. A crash between 3 and 4
//! also leaves a value block ahead of the superblock: nodes re-read the superblock once, find
//! nothing newer, and carry on. The old backup copy lies in what becomes the new groups (the
//! old unused tail), so a crash after 2 may leave the volume without a usable backup until the
//! next grow, or fsck's `backup-superblock` repair (preen), rewrites it.
//! `tests/tests/grow.rs` kills a daemon at each failpoint.
//! Recovery of a node that died holding the lock scrubs it as any other; the value block
//! stays. Recovery replays a dead node's journal against the newest superblock on disk
//! ([`Volume::current_superblock`]), since that node may have used groups the recovering node
//! has not adopted yet.

use super::txn::Meta;
use super::Volume;
use crate::cluster::lock::LockTable;
use crate::dev::BlockDevice;
use crate::error::{Error, ErrorKind, Result};
use crate::format::lock_record::{LockMode, LockRecord};
use crate::format::superblock::Superblock;
use crate::format::FS_BLOCK;

/// What a grow did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grown {
    pub old_groups: u64,
    pub new_groups: u64,
    /// Bytes of allocation groups before and after.
    pub old_bytes: u64,
    pub new_bytes: u64,
}

/// The geometry of `sb` grown onto a device of `dev_bytes`: Err when no whole group fits in
/// the new space or the lock area has no record for one more group.
pub fn grown(sb: &Superblock, dev_bytes: u64) -> Result<Superblock> {
    sb.require_growable("online grow")?;
    let total = dev_bytes / FS_BLOCK;
    let backup = total.saturating_sub(1);
    let fit = backup.saturating_sub(sb.group_start) / sb.group_blocks.max(1);
    let group_bytes = sb.group_blocks * FS_BLOCK;
    if fit <= sb.group_count {
        return Err(Error::new(
            ErrorKind::Range,
            format!(
                "the LUN is {} MiB as this node sees it: no room for another {} MiB allocation group after the volume's {} groups (grow the LUN by at least {} MiB, and rescan it on this host: iscsiadm -m session --rescan; multipathd resize map NAME)",
                dev_bytes >> 20,
                group_bytes >> 20,
                sb.group_count,
                group_bytes >> 20
            ),
        ));
    }
    let cap = sb.group_capacity();
    if cap <= sb.group_count {
        return Err(Error::new(
            ErrorKind::TooBig,
            format!(
                "the volume has {} groups, as many as its lock area has records for (mkfs.cetra --max-size sets that); it cannot grow further",
                sb.group_count
            ),
        ));
    }
    let mut new = sb.clone();
    new.group_count = fit.min(cap);
    new.total_blocks = total;
    new.backup_block = backup;
    new.seq = sb.seq.saturating_add(1);
    new.validate()?;
    Ok(new)
}

impl Volume {
    /// `cetra grow`: take the space the LUN gained as new allocation groups (module docs).
    pub fn grow(&self) -> Result<Grown> {
        if self.read_only {
            return Err(Error::new(ErrorKind::ReadOnly, "mounted read-only"));
        }
        let mut m = self.meta_ex()?;
        let size = self.dev.refresh_size()?;
        let old = m.sb().clone();
        let mut new = grown(&old, size)?;
        for g in old.group_count..new.group_count {
            crate::mkfs::write_group(&*self.dev, &new, g)?;
        }
        self.dev.flush()?;
        crate::failpoint::process("grow::groups_written");
        let me = self.cl.me;
        let published = self.cl.locks.update(LockTable::GLOBAL, |r| {
            if !LockTable::holds(r, me, LockMode::Exclusive) {
                return None;
            }
            new.seq = new.seq.max(r.geometry_seq().unwrap_or(0).saturating_add(1));
            let mut n = r.clone();
            n.set_geometry_seq(new.seq);
            Some(n)
        })?;
        if published.is_none() {
            return Err(Error::new(
                ErrorKind::Io,
                "lost the global lock while growing; nothing of the grow is in use (run cetra grow again)",
            ));
        }
        crate::failpoint::process("grow::published");
        crate::tune::write_superblock(&*self.dev, &new)?;
        self.adopt(&mut m, new.clone())?;
        tracing::warn!(
            "grew the volume from {} to {} groups ({} to {} MiB)",
            old.group_count,
            new.group_count,
            (old.group_count * old.group_blocks * FS_BLOCK) >> 20,
            (new.group_count * new.group_blocks * FS_BLOCK) >> 20
        );
        Ok(Grown {
            old_groups: old.group_count,
            new_groups: new.group_count,
            old_bytes: old.group_count * old.group_blocks * FS_BLOCK,
            new_bytes: new.group_count * new.group_blocks * FS_BLOCK,
        })
    }

    /// Just granted the global lock as `rec`: if its value block names a superblock seq newer
    /// than this node's, adopt the newer superblock on disk (module docs). Until that succeeds
    /// (a path not rescanned yet, an I/O error), every use of the lock tries again
    /// ([`Meta::geometry_behind`]), so no operation runs on the old geometry. After a grow that
    /// crashed between publishing its seq and writing the superblock, the value block stays
    /// ahead and each grant costs one superblock read, until the next grow.
    pub(super) fn follow_geometry(&self, m: &mut Meta, rec: &LockRecord) -> Result<()> {
        match rec.geometry_seq() {
            Some(seq) if m.sb().can_grow() && seq > m.sb().seq => {
                m.set_geometry_behind(Some(seq));
                self.catch_up_geometry(m)
            }
            _ => Ok(()),
        }
    }

    /// The rest of [`Volume::follow_geometry`], also called while the lock is held.
    pub(super) fn catch_up_geometry(&self, m: &mut Meta) -> Result<()> {
        if m.geometry_behind().is_none() {
            return Ok(());
        }
        if let Some(new) = newest(&*self.dev, m.sb())? {
            self.adopt(m, new)?;
        }
        m.set_geometry_behind(None);
        Ok(())
    }

    /// The newest superblock of this volume: what this node mounted with, or a newer one a
    /// grow wrote since (for recovery, which replays a journal that may use new groups). Reads
    /// the disk, not the metadata mutex: a recovery must never wait for an operation that
    /// waits for the recovered node's locks.
    pub(super) fn current_superblock(&self) -> Result<Superblock> {
        Ok(newest(&*self.dev, &self.sb)?.unwrap_or_else(|| self.sb.clone()))
    }

    /// Use `new` (a grown superblock of this volume) from now on.
    fn adopt(&self, m: &mut Meta, new: Superblock) -> Result<()> {
        let groups = new.group_count;
        m.adopt_geometry(new)?;
        self.cl.locks.set_group_count(groups);
        // Who owns the new groups (another node may have claimed some already). Nothing
        // goes back here: changes of this hold may not be home yet.
        self.read_group_records(m, super::cluster::GroupRecords::AllNow);
        Ok(())
    }
}

/// A superblock of the same volume as `known` with a higher seq (written by a grow since), once
/// this host's path to the LUN covers it: the primary, or, if the primary does not decode (a
/// grow that died while writing it, a bad read), the backup in the device's last block. None
/// when there is none. Err when there is one this path is too small for (not rescanned yet).
/// Used by mount (before and after it takes the global lock), by every grant of that lock
/// that names a newer seq, and by recovery.
pub(crate) fn newest(dev: &dyn BlockDevice, known: &Superblock) -> Result<Option<Superblock>> {
    let read = |b: u64| crate::dev::read_aligned(dev, b * FS_BLOCK, crate::format::FS_BLOCK_SIZE);
    let newer = |sb: &Superblock| sb.uuid == known.uuid && sb.seq > known.seq;
    let have = dev.refresh_size()?;
    let found = match Superblock::decode(&read(0)?) {
        Ok(sb) => Some(sb).filter(newer),
        Err(e) => {
            tracing::warn!(
                "re-reading the superblock: the primary is unusable ({e}); trying the backup"
            );
            let last = (have / FS_BLOCK).saturating_sub(1);
            read(last)
                .ok()
                .and_then(|raw| Superblock::decode(&raw).ok())
                .filter(|sb| sb.backup_block == last && newer(sb))
        }
    };
    let Some(sb) = found else {
        return Ok(None);
    };
    let need = sb.total_blocks.saturating_mul(FS_BLOCK);
    if have < need {
        return Err(Error::new(
            ErrorKind::Io,
            format!(
                "the volume grew to {} MiB, but this node sees the LUN as {} MiB: rescan it on this host (iscsiadm -m session --rescan; multipathd resize map NAME)",
                need >> 20,
                have >> 20
            ),
        ));
    }
    Ok(Some(sb))
}
