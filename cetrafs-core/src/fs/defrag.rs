//! Online defragmentation of one file (`cetra defrag`, issue 11): its blocks are copied into
//! at most [`MAX_RUNS`] contiguous runs and its map switched to them in one transaction.
//!
//! # The steps
//! 1. **Plan** (one transaction, global lock): the file's extents as they are (at most
//!    [`MAX_RUNS`]: nothing to do), and new runs for all its blocks (as few as the free space
//!    allows; more than [`MAX_RUNS`] and nothing is done). The new runs go into a *temporary inode* on
//!    this node's orphan list, as unwritten extents: until step 3 they belong to it, so a crash
//!    meanwhile frees them with it (the recovery of this slot, or its next mount, frees its
//!    orphans) and leaves the file as it was.
//! 2. **Copy**, without the global lock: every written block from its old place to its new one,
//!    1 MiB at a time (unwritten extents stay unwritten, nothing to copy). Progress is
//!    published for the caller ([`Volume::defrag_progress`]).
//! 3. **Switch** (one transaction, global lock): if the file's map is still the one planned,
//!    the file maps the new runs, its old blocks are freed, and the temporary inode leaves the
//!    orphan list and is freed (its runs now belong to the file). A crash leaves the old map or
//!    the new one, never a mix: the transaction is journaled whole.
//!
//! # What keeps the copy right
//! * On this node the file is *quiesced* for the whole run (as truncate and fallocate do):
//!   its writes wait, so a VM writing the file pauses for the copy. That covers the writes
//!   that take the metadata path; fast-path overwrites (which go straight to the blocks the
//!   map names) are turned off for the file before the copy (`InodeState::no_fast_writes`,
//!   after which a write lock on its state waits out those already admitted), so they take
//!   the metadata path and wait too. Reads go on, from the old blocks until the switch.
//! * On other nodes nobody writes it: the caller holds the file open for writing (the
//!   daemon's ioctl needs a writable handle), so with the cross-node open locks a writer
//!   elsewhere was refused (EBUSY) before it started and is refused while it runs. A volume
//!   mounted `nofilelock` has no such guarantee: defrag refuses there.
//! * Step 3 compares the map with the plan: a change (which nothing above allows) aborts the
//!   switch and frees the temporary inode.

use super::extent_map::ExtentMap;
use super::txn::Tx;
use super::{Ino, Volume};
use crate::dev::AlignedBuf;
use crate::error::{Error, Result};
use crate::format::extent::Extent;
use crate::format::inode::flags;
use crate::format::slot_header::SlotHeader;
use crate::format::FS_BLOCK;
use std::sync::atomic::{AtomicU64, Ordering};

/// Most runs a defragmented file may end up in.
pub const MAX_RUNS: usize = 4;
/// The extended attribute that reads as `INO DONE TOTAL` (blocks copied, blocks to copy)
/// while a defrag of that file runs on this node: what `cetra defrag` draws its progress bar
/// from. Not stored, not listed.
pub const PROGRESS_XATTR: &[u8] = b"user.cetra.defrag_progress";
/// Blocks copied per I/O (1 MiB).
const COPY_CHUNK: u64 = 256;

/// What a defrag did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Defragged {
    pub extents_before: u64,
    pub extents_after: u64,
    /// Written blocks copied.
    pub blocks_copied: u64,
}

/// Progress of the defrag running on a file: blocks copied, blocks to copy.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    pub ino: AtomicU64,
    pub done: AtomicU64,
    pub total: AtomicU64,
}

struct Plan {
    /// The file's state: its fast-path writes are off until the plan is dropped.
    st: std::sync::Arc<super::InodeState>,
    old: Vec<Extent>,
    /// The new runs, in file order.
    runs: Vec<(u64, u64)>,
    /// The temporary inode holding them.
    tmp: Ino,
}

/// Where the `k`-th block of the file (in file order) goes: (physical, blocks left in its run).
fn new_place(runs: &[(u64, u64)], mut k: u64) -> Option<(u64, u64)> {
    for &(p, l) in runs {
        if k < l {
            return Some((p + k, l - k));
        }
        k -= l;
    }
    None
}

impl Volume {
    /// Defragment regular file `ino` (see the module docs). `writable_handle`: the caller holds
    /// it open for writing (the cross-node write lock).
    pub fn defrag(&self, ino: Ino, writable_handle: bool) -> Result<Defragged> {
        self.check_writable()?;
        if !self.cl.file_locks {
            bail!(
                Unsupported,
                "the volume is mounted nofilelock: nothing keeps other nodes from writing the file during the copy, so defrag refuses"
            );
        }
        if !writable_handle {
            bail!(
                PermissionDenied,
                "defrag needs the file open for writing (that keeps other nodes from writing it)"
            );
        }
        let _quiet = self.quiesce(ino);
        let plan = match self.defrag_plan(ino)? {
            Ok(p) => p,
            Err(n) => {
                return Ok(Defragged {
                    extents_before: n,
                    extents_after: n,
                    blocks_copied: 0,
                })
            }
        };
        // Fast-path writes off from now (they do not change the map planned, only blocks it
        // names); the write lock waits out those already under way.
        plan.st.no_fast_writes.fetch_add(1, Ordering::AcqRel);
        drop(plan.st.write());
        let copied = self.defrag_copy(ino, &plan);
        let switched = copied.and_then(|n| self.defrag_switch(ino, &plan).map(|after| (n, after)));
        self.defrag_progress.ino.store(0, Ordering::Release);
        plan.st.no_fast_writes.fetch_sub(1, Ordering::AcqRel);
        match switched {
            Ok((n, after)) => Ok(Defragged {
                extents_before: plan.old.len() as u64,
                extents_after: after,
                blocks_copied: n,
            }),
            // A switch that failed half-way fenced the node or failed it (`defrag_switch`):
            // the temporary's runs may be the file's, and nothing more is written.
            Err(e) if self.member.is_fenced() || self.lock_meta().has_failed() => Err(e),
            Err(e) => {
                if let Err(f) = self.meta_op(|tx| Self::drop_tmp(tx, &plan)) {
                    tracing::warn!(
                        "freeing defrag's temporary inode {} failed ({f}); it is freed with this node's orphans",
                        plan.tmp
                    );
                }
                Err(e)
            }
        }
    }

    /// The defrag running now, if any: (inode, blocks copied, blocks to copy).
    pub fn defrag_progress(&self) -> Option<(Ino, u64, u64)> {
        let p = &self.defrag_progress;
        let ino = p.ino.load(Ordering::Acquire);
        (ino != 0).then(|| {
            (
                ino,
                p.done.load(Ordering::Relaxed),
                p.total.load(Ordering::Relaxed),
            )
        })
    }

    /// Step 1. `Err(n)`: nothing to gain (the file has `n` extents, at most [`MAX_RUNS`]).
    fn defrag_plan(&self, ino: Ino) -> Result<std::result::Result<Plan, u64>> {
        let plan = self.meta_op(|tx| {
            let st = self.state(tx, ino)?;
            let inner = st.read();
            if !inner.inode.is_reg() {
                bail!(InvalidInput, "inode {ino} is not a regular file");
            }
            if inner.inode.flags & flags::IMMUTABLE != 0 {
                bail!(PermissionDenied, "inode {ino} is immutable");
            }
            let old: Vec<Extent> = inner.extents.iter().copied().collect();
            drop(inner);
            if old.len() <= MAX_RUNS {
                return Ok(Err(old.len() as u64));
            }
            let total: u64 = old.iter().map(|e| u64::from(e.len)).sum();
            let tmp = tx.alloc_one(ino)?;
            let runs = match tx.alloc_data(old[0].physical, total, tmp) {
                Ok(r) => r,
                Err(e) => {
                    tx.free_one(tmp)?;
                    return Err(e.wrap(format!(
                        "no free space for a copy of inode {ino}'s {total} blocks"
                    )));
                }
            };
            if runs.len() > MAX_RUNS || runs.len() >= old.len() {
                for &(p, l) in &runs {
                    tx.free(p, l)?;
                }
                tx.free_one(tmp)?;
                bail!(
                    NoSpace,
                    "the free space gives inode {ino}'s {total} blocks in {} runs, not at most {MAX_RUNS} (it has {} extents now)",
                    runs.len(),
                    old.len()
                );
            }
            let mut inode = super::pool::holder_inode(tx, tmp)?;
            inode.blocks = 1 + total;
            let mut map = ExtentMap::default();
            let mut at = 0;
            for &(p, l) in &runs {
                map.insert(at, p, l, true);
                at += l;
            }
            map.persist(tx, &mut inode)?;
            inode.seq += 1;
            tx.write(tmp, inode.encode());
            tx.add_orphan(tmp)?;
            Ok(Ok(Plan { st, old, runs, tmp }))
        })?;
        let Ok(p) = plan else {
            return Ok(plan);
        };
        // The temporary inode is on disk before its blocks are written: after a crash they
        // are freed with it (and the crash test sees that path).
        self.lock_meta().commit_point(&*self.dev)?;
        let written: u64 = p
            .old
            .iter()
            .filter(|e| !e.unwritten())
            .map(|e| u64::from(e.len))
            .sum();
        let g = &self.defrag_progress;
        g.done.store(0, Ordering::Relaxed);
        g.total.store(written, Ordering::Relaxed);
        g.ino.store(ino, Ordering::Release);
        Ok(Ok(p))
    }

    /// Step 2: returns the blocks copied.
    fn defrag_copy(&self, ino: Ino, plan: &Plan) -> Result<u64> {
        let mut buf = AlignedBuf::new(usize::try_from(COPY_CHUNK * FS_BLOCK).unwrap_or(1 << 20));
        let mut k = 0; // file-order block index
        let mut copied = 0;
        for e in &plan.old {
            let len = u64::from(e.len);
            if e.unwritten() {
                k += len;
                continue;
            }
            let mut i = 0;
            while i < len {
                let (dst, room) = new_place(&plan.runs, k + i)
                    .ok_or_else(|| Error::corrupted("defrag: the new runs are too short"))?;
                let n = (len - i).min(room).min(COPY_CHUNK);
                let bytes = usize::try_from(n * FS_BLOCK).unwrap_or(usize::MAX);
                let chunk = &mut buf[..bytes];
                self.dev
                    .read_at((e.physical + i) * FS_BLOCK, chunk)
                    .map_err(|err| err.wrap(format!("defrag of inode {ino}: reading")))?;
                self.dev
                    .write_at(dst * FS_BLOCK, chunk)
                    .map_err(|err| err.wrap(format!("defrag of inode {ino}: writing")))?;
                i += n;
                copied += n;
                self.defrag_progress.done.store(copied, Ordering::Relaxed);
            }
            k += len;
        }
        crate::failpoint::process("defrag::copied");
        Ok(copied)
    }

    /// Step 3: returns the file's extent count after.
    ///
    /// Everything that can fail before the map changes is done first (bitmaps loaded, the
    /// slot header read, the new places computed), and a save that fails (a full volume: the
    /// new tree keys find no space) puts the old map back in memory: the file is as it was,
    /// and [`Volume::defrag`] frees the temporary inode with its runs. Once the file is saved
    /// with the temporary's runs, a failure (freeing the temporary inode) would leave half a
    /// switch in the running transaction, which commits even on error — and those runs, now
    /// the file's, freed by that cleanup: the node fences instead, so that none of it reaches
    /// the LUN, and its recovery frees the temporary inode (on the orphan list).
    fn defrag_switch(&self, ino: Ino, plan: &Plan) -> Result<u64> {
        let after = self.meta_op(|tx| {
            let st = self.state(tx, ino)?;
            let mut inner = st.write();
            self.own_inode(tx, ino)?;
            let now: Vec<Extent> = inner.extents.iter().copied().collect();
            if now != plan.old {
                bail!(
                    Busy,
                    "inode {ino} changed during the defrag; its map was left as it was"
                );
            }
            Self::prepare_free(tx, &inner, 0, u64::MAX)?;
            tx.prepare_free(plan.tmp)?;
            let header = tx.slot_header()?;
            let mut places = Vec::new();
            let mut k = 0;
            for e in &plan.old {
                let len = u64::from(e.len);
                let mut i = 0;
                while i < len {
                    let (p, room) = new_place(&plan.runs, k + i)
                        .ok_or_else(|| Error::corrupted("defrag: the new runs are too short"))?;
                    let n = (len - i).min(room);
                    places.push((e.logical + i, p, n, e.unwritten()));
                    i += n;
                }
                k += len;
            }
            // What the map was, to put back if the save fails: the file then maps its old
            // runs again, in memory as at home, and the cleanup frees the temporary's.
            let (old_map, old_inode, old_unfreed) = (
                inner.extents.clone(),
                inner.inode.clone(),
                inner.unfreed.len(),
            );
            let freed = inner.extents.punch(0, u64::MAX);
            inner.free_at_save(freed);
            for (logical, p, n, unwritten) in places {
                inner.extents.insert(logical, p, n, unwritten);
                inner.inode.blocks += n;
            }
            inner.inode.ctime = super::now();
            if let Err(e) = self.save(tx, &mut inner) {
                // The save wrote nothing of the inode and left its tree at home as it was
                // (a tree that finds no space for its new keys), unless the node stopped.
                inner.extents.restore(old_map);
                inner.inode = old_inode;
                inner.unfreed.truncate(old_unfreed);
                return Err(e);
            }
            // The file maps the temporary's runs now: a failure here would leave them to the
            // cleanup, which frees them. Fence instead, so that none of it reaches the LUN;
            // the recovery frees the temporary inode from the orphan list.
            if let Err(e) = Self::forget_tmp(tx, plan.tmp, header) {
                tx.fail_node(&e, &format!("the switch of inode {ino}'s defrag"));
                return Err(e);
            }
            Ok(inner.extents.iter().count() as u64)
        })?;
        // The switch is durable before anyone is told it is done.
        self.lock_meta().commit_point(&*self.dev)?;
        crate::failpoint::process("defrag::switched");
        Ok(after)
    }

    /// The temporary inode leaves the orphan list (`header`, this node's slot header read
    /// before) and is freed; its runs are not (the file maps them now).
    fn forget_tmp(tx: &mut Tx<'_>, tmp: Ino, mut header: SlotHeader) -> Result<()> {
        crate::failpoint!("defrag::forget_tmp");
        header.orphans.retain(|&o| o != tmp);
        tx.put_slot_header(header);
        tx.free_one(tmp)
    }

    /// After a failed copy or switch: the temporary inode and its runs are freed.
    fn drop_tmp(tx: &mut Tx<'_>, plan: &Plan) -> Result<()> {
        for &(p, _) in &plan.runs {
            tx.prepare_free(p)?;
        }
        let header = tx.slot_header()?;
        for &(p, l) in &plan.runs {
            tx.free(p, l)?;
        }
        Self::forget_tmp(tx, plan.tmp, header)
    }
}

#[cfg(test)]
mod tests {
    use super::new_place;

    #[test]
    fn blocks_go_to_the_runs_in_order() {
        let runs = [(100, 3), (500, 2)];
        assert_eq!(new_place(&runs, 0), Some((100, 3)));
        assert_eq!(new_place(&runs, 2), Some((102, 1)));
        assert_eq!(new_place(&runs, 3), Some((500, 2)));
        assert_eq!(new_place(&runs, 4), Some((501, 1)));
        assert_eq!(new_place(&runs, 5), None);
    }
}

#[cfg(test)]
mod volume_tests {
    use super::super::tests::fresh;
    use super::super::{Caller, MountOptions, Volume};
    use super::MAX_RUNS;
    use crate::format::FS_BLOCK;

    /// A file of `blocks` blocks written even blocks first, then odd ones: one extent per
    /// block. Returns its inode and contents.
    fn fragmented(v: &Volume, name: &[u8], blocks: u64) -> (u64, Vec<u8>) {
        let (a, fh) = v
            .create(v.root_ino(), name, 0o644, Caller::ROOT, true)
            .unwrap();
        let mut want = vec![0u8; usize::try_from(blocks * FS_BLOCK).unwrap()];
        for pass in [0, 1] {
            for b in (pass..blocks).step_by(2) {
                let data = vec![u8::try_from(b % 251).unwrap(); 4096];
                v.write(&fh, b * FS_BLOCK, &data).unwrap();
                let at = usize::try_from(b * FS_BLOCK).unwrap();
                want[at..at + 4096].copy_from_slice(&data);
            }
        }
        v.release(&fh).unwrap();
        (a.ino, want)
    }

    fn contents(v: &Volume, ino: u64, len: usize) -> Vec<u8> {
        let fh = v.open(ino, false, false).unwrap();
        let mut out = Vec::new();
        v.read(&fh, 0, u32::try_from(len).unwrap(), &mut |d| {
            out.extend_from_slice(d);
        })
        .unwrap();
        v.release(&fh).unwrap();
        out
    }

    #[test]
    fn a_fragmented_file_ends_in_few_runs_with_the_same_contents() {
        let (dev, v0) = fresh(128 << 20);
        v0.unmount().unwrap();
        let exact = MountOptions {
            alloc_granule: FS_BLOCK,
            ..MountOptions::default()
        };
        let v = Volume::mount(dev.clone(), &exact).unwrap();
        let (ino, want) = fragmented(&v, b"frag", 600);
        assert!(v.extents(ino).unwrap().len() >= 300);
        let fh = v.open(ino, true, false).unwrap();
        let done = v.defrag(ino, true).unwrap();
        v.release(&fh).unwrap();
        assert!(done.extents_after <= MAX_RUNS as u64, "{done:?}");
        assert_eq!(done.blocks_copied, 600);
        assert!(v.extents(ino).unwrap().len() <= MAX_RUNS);
        assert_eq!(contents(&v, ino, want.len()), want);
        assert!(v.defrag_progress().is_none());
        // Without a writable handle, or on a file in one piece: nothing to do / refused.
        assert!(v.defrag(ino, false).is_err());
        let again = v.defrag(ino, true).unwrap();
        assert_eq!(again.blocks_copied, 0);
        v.unmount().unwrap();
        let report = crate::check::check_volume(&*dev).unwrap();
        assert!(report.is_clean(), "{:?}", report.findings);
        let v = Volume::mount(dev.clone(), &exact).unwrap();
        assert_eq!(contents(&v, ino, want.len()), want);
        v.unmount().unwrap();
    }
}
