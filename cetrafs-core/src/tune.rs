//! Offline changes of a volume's superblock, for `cetra tune`: the label and the heartbeat
//! timing. The caller holds the offline claim (`cluster/fsck_claim.rs`, as `cetra-tune:HOST`)
//! and has made sure no node has the volume mounted: every node reads these at mount and keeps
//! them while mounted. Both superblock copies are rewritten, the backup first and the primary
//! last (as mkfs writes them), each flushed, so a crash leaves the old or the new superblock as
//! the primary and fsck's `backup-superblock` repair brings the other in line.

use crate::dev::{AlignedBuf, BlockDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::heartbeat::check_timing;
use crate::format::superblock::{Superblock, LABEL_LEN};
use crate::format::FS_BLOCK;

/// What to change (None: keep).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tune {
    pub label: Option<String>,
    pub heartbeat_interval_ms: Option<u32>,
    pub io_timeout_ms: Option<u32>,
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
    new.seq = sb.seq.saturating_add(1);
    Ok(new)
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
