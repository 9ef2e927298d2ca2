//! The filesystem API: [`Volume`] is one mounted CetraFS on one node. The FUSE adapter is a
//! thin translation onto these methods; tests call them directly on a memory device.
//!
//! Concurrency: metadata operations serialize on one per-volume mutex (`meta`, which also owns
//! the allocator and the metadata block cache) and, across nodes, on the cluster's global
//! metadata lock (`cluster.rs`; a thread waits for it on the node's acquiring turn, without the
//! metadata mutex); each inode has its own `RwLock`. Lock order is acquiring turn → global lock →
//! meta → inode table → inode. The data path (read/write inside already-written extents) takes
//! only the inode's lock in shared mode and does one device I/O per contiguous run.

pub mod acl;
pub mod types;

mod attrs;
mod block_cache;
pub(crate) mod btree;
mod closer;
mod cluster;
mod data;
mod defrag;
mod detached;
mod detached_ns;
mod dir;
pub mod discard;
pub(crate) mod extent_map;
mod fsck;
mod group_marks;
pub mod grow;
pub(crate) mod heap;
mod inflight;
mod inode_lock;
mod inode_table;
mod mount;
mod own_lock_reads;
mod pool;
mod suid;
pub(crate) mod txn;

pub use crate::alloc::{BitmapCacheStats, DEFAULT_BITMAP_CACHE};
pub use block_cache::{BlockCacheStats, DEFAULT_BUDGET as DEFAULT_META_CACHE};
pub use data::{
    BatchRead, BatchWrite, WriteDone, WriteStarted, ALLOC_GRANULE, DEFAULT_ALLOC_GRANULE,
    MAX_ALLOC_GRANULE,
};
pub use defrag::{Defragged, MAX_RUNS as DEFRAG_MAX_RUNS, PROGRESS_XATTR as DEFRAG_PROGRESS_XATTR};
pub use inode_lock::MAX_CACHED as MAX_CACHED_INODE_LOCKS;
pub use inode_table::{InodeTableStats, DEFAULT_BUDGET as DEFAULT_INODE_CACHE};
pub use suid::Credentials;
pub use types::*;

use crate::cluster::Membership;
use crate::dev::{AlignedBuf, SharedDevice};
use crate::error::{Error, ErrorKind, LockWait, Result};
use crate::format::inode::{flags, Inode, Timespec};
use crate::format::superblock::Superblock;
use crate::format::{xattr, FS_BLOCK, FS_BLOCK_SIZE};
use crate::sync::LockPolicy;
use extent_map::ExtentMap;
use inode_table::InodeTable;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use txn::{Meta, Tx};

pub(crate) fn now() -> Timespec {
    crate::mkfs::now()
}

fn ts_to_nanos(t: Timespec) -> i64 {
    t.sec
        .saturating_mul(1_000_000_000)
        .saturating_add(i64::from(t.nsec))
}

fn nanos_to_ts(n: i64) -> Timespec {
    Timespec {
        sec: n.div_euclid(1_000_000_000),
        nsec: u32::try_from(n.rem_euclid(1_000_000_000)).unwrap_or(0),
    }
}

/// In-memory state of one inode.
/// Which holders [`Volume::can_free`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FreeScope {
    /// Every holder: this node's opens and kernel references, and other nodes' opens.
    Now,
    /// At unmount: only other nodes' opens (this node's end with the mount).
    Unmount,
}

#[derive(Debug)]
pub(crate) struct InodeState {
    pub ino: Ino,
    inner: RwLock<InodeInner>,
    /// Open file handles (an unlinked inode lives until the last one closes).
    opens: AtomicU32,
    /// Writable open handles (reservations are dropped when the last closes).
    writers: AtomicU32,
    /// Set by fast-path writes, which cannot update mtime under a shared lock: the time of the
    /// latest such write, folded into the inode on the next metadata touch.
    pending_mtime: AtomicI64,
    has_pending: AtomicBool,
    /// The cluster epoch (fs/cluster.rs) this state was loaded at: older means reload.
    epoch: AtomicU64,
    /// This inode's cluster lock as this node holds it (v3 volumes, `fs/inode_lock.rs`).
    dl: std::sync::OnceLock<Arc<inode_lock::DataLock>>,
    /// Above zero while a defrag copies the file (`fs/defrag.rs`): writes take the metadata
    /// path, where they wait for the defrag, instead of the fast path.
    no_fast_writes: AtomicU32,
}

#[derive(Debug)]
pub(crate) struct InodeInner {
    pub inode: Inode,
    pub extents: ExtentMap,
    /// The inode has been freed (unlinked and closed); the state is a tombstone.
    pub freed: bool,
    /// Runs a truncate, a punched hole or a defrag took out of `extents` that the inode at
    /// home still maps: [`Volume::save`] frees them in the transaction that writes the inode
    /// without them, never before. A change that fails between the punch and the save (a tree
    /// node that finds no space, a failed write of zeros) so leaves its frees out of the
    /// running transaction, which commits even on error: freed blocks still mapped by the
    /// inode at home would be given to another file while a crash (or a reload) brings the
    /// old map back. A reload from home forgets them: home maps them, and they are allocated
    /// — or, should a save have written the inode without freeing them (their bitmap could
    /// not be loaded then), they are leaked, which fsck reports; never free and mapped.
    unfreed: Vec<(u64, u64)>,
}

impl InodeInner {
    /// `runs`, just punched out of `extents`, are freed at the next save
    /// ([`Volume::save`]); the block count drops now, with the map.
    fn free_at_save(&mut self, runs: Vec<(u64, u64)>) {
        for &(_, l) in &runs {
            self.inode.blocks -= l;
        }
        self.unfreed.extend(runs);
    }

    /// Runs unmapped and not yet freed: (count, blocks).
    fn unfreed_count(&self) -> (usize, u64) {
        (
            self.unfreed.len(),
            self.unfreed.iter().map(|&(_, l)| l).sum(),
        )
    }

    /// The inode was read again from home, which still maps the runs not yet freed.
    fn forget_unfreed(&mut self) {
        self.unfreed.clear();
    }
}

impl InodeState {
    /// The state of an inode just loaded (or created) at cluster epoch `epoch`.
    fn new(inode: Inode, extents: ExtentMap, epoch: u64) -> Self {
        Self {
            ino: inode.ino,
            inner: RwLock::new(InodeInner {
                inode,
                extents,
                freed: false,
                unfreed: Vec::new(),
            }),
            opens: AtomicU32::new(0),
            writers: AtomicU32::new(0),
            pending_mtime: AtomicI64::new(0),
            has_pending: AtomicBool::new(false),
            no_fast_writes: AtomicU32::new(0),
            epoch: AtomicU64::new(epoch),
            dl: std::sync::OnceLock::new(),
        }
    }
    /// The local state of this inode's cluster lock.
    fn data_lock(&self, il: &inode_lock::InodeLocks) -> &inode_lock::DataLock {
        self.dl.get_or_init(|| il.lock_of(self.ino))
    }
    fn read(&self) -> RwLockReadGuard<'_, InodeInner> {
        self.inner.read().or_panic()
    }
    /// The read lock if it can be had without waiting (a writer holds or waits for it: no).
    fn try_read(&self) -> Option<RwLockReadGuard<'_, InodeInner>> {
        match self.inner.try_read() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::WouldBlock) => None,
            Err(std::sync::TryLockError::Poisoned(e)) => {
                panic!("inode lock poisoned: {e}")
            }
        }
    }
    fn write(&self) -> RwLockWriteGuard<'_, InodeInner> {
        self.inner.write().or_panic()
    }
    /// The write lock if nobody holds the inode now (a wait that serves this node's duties
    /// must not block on a lock its own thread may hold: fs/detached.rs).
    fn try_write(&self) -> Option<RwLockWriteGuard<'_, InodeInner>> {
        match self.inner.try_write() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::WouldBlock) => None,
            Err(std::sync::TryLockError::Poisoned(e)) => {
                panic!("inode lock poisoned: {e}")
            }
        }
    }
    fn note_write(&self) {
        self.pending_mtime
            .store(ts_to_nanos(now()), Ordering::Relaxed);
        self.has_pending.store(true, Ordering::Release);
    }
}

/// An open file. Handed to the kernel as a raw pointer inside the FUSE file handle so the data
/// path needs no volume-wide table lookup.
#[derive(Debug)]
pub struct OpenFile {
    pub ino: Ino,
    pub writable: bool,
    state: Arc<InodeState>,
}

#[derive(Debug)]
pub struct Volume {
    dev: SharedDevice,
    sb: Superblock,
    read_only: bool,
    member: Arc<Membership>,
    cl: cluster::Cluster,
    meta: Mutex<Meta>,
    /// Notified (with `meta`) when an allocating write in flight or a drain ends
    /// (fs/inflight.rs).
    inflight_done: Condvar,
    /// Allocating writes whose data is written, waiting to be mapped (fs/data.rs).
    to_map: Mutex<data::MapQueue>,
    /// Loaded inode states and the kernel's references to inode numbers (`fs/inode_table.rs`).
    inodes: InodeTable,
    unmounted: AtomicBool,
    /// The allocation granule of image-sized sparse files, in fs blocks (fs/data.rs).
    granule_blocks: u64,
    /// The host watchdog this node pets while its lease is valid (`cluster/watchdog.rs`).
    watchdog: std::sync::OnceLock<Arc<crate::cluster::watchdog::Watchdog>>,
    /// SCSI-3 persistent reservation fencing (`cluster/reservation.rs`), when `fence=pr`.
    pr: Option<Arc<crate::cluster::reservation::Reservations>>,
    /// Writes and changes made without the global lock (`fs/detached.rs`).
    detached: detached::Detached,
    /// What closes leave to the background (`fs/closer.rs`).
    closer: closer::Closer,
    /// Mounted in a slot the caller holds (`MountOptions::claimed`): unmount keeps it.
    keep_slot: bool,
    /// The defrag running on this node, if any (`fs/defrag.rs`).
    defrag_progress: defrag::Progress,
}

/// [`Superblock::locate`] on a device: the primary superblock, else the backup in the
/// device's last fs block, each validated and checked against the device size.
pub fn locate_superblock(
    dev: &dyn crate::dev::BlockDevice,
) -> Result<crate::format::superblock::Located> {
    // The size now: a grown LUN's superblock names blocks past the size at open.
    let dev_blocks = dev.refresh_size().unwrap_or(dev.geometry().size_bytes) / FS_BLOCK;
    Superblock::locate(dev_blocks, &mut |b| {
        let mut buf = AlignedBuf::new(FS_BLOCK_SIZE);
        dev.read_at(b * FS_BLOCK, &mut buf)?;
        Ok(buf.to_vec())
    })
}

/// The superblock to use ([`locate_superblock`]), with a warning when it is the backup.
pub fn read_superblock(dev: &dyn crate::dev::BlockDevice) -> Result<Superblock> {
    let l = locate_superblock(dev)?;
    if let Some(e) = &l.primary_error {
        tracing::warn!(
            "primary superblock unusable ({e}); using the backup at block {}",
            l.sb.backup_block
        );
    }
    Ok(l.sb)
}

impl Volume {
    /// Bound the window of un-fsync'd metadata a crash can lose (ext4's commit=N).
    fn spawn_committer(vol: &Arc<Volume>, every: std::time::Duration) {
        let weak = Arc::downgrade(vol);
        let spawned = std::thread::Builder::new()
            .name("cetra-commit".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                let Some(v) = weak.upgrade() else { break };
                if v.unmounted.load(Ordering::Relaxed) {
                    break;
                }
                if let Err(e) = v.commit_if_pending() {
                    if v.member.is_fenced() {
                        // The fence was the error, logged as such: this follows from it.
                        tracing::warn!("metadata commit refused on a fenced node: {e}");
                        break;
                    }
                    tracing::error!("metadata commit failed, the volume now refuses changes: {e}");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(
                "no background committer ({e}); metadata is committed on fsync/sync/unmount only"
            );
        }
    }

    /// Every [`TRIM_EVERY`](inode_table::TRIM_EVERY) (1 s), hand the heap memory freed since
    /// back to the OS if the daemon was busy (`InodeTable::trim`); every 5 s, log the inode
    /// table's stats, and the metadata block cache's with the allocator's bitmap cache's in
    /// one line, and what glibc's malloc holds (fs/heap.rs), at debug level when they changed.
    /// The block cache and the bitmaps are looked at only when the metadata mutex is free (the
    /// reporter never waits behind a commit).
    fn spawn_reporter(vol: &Arc<Volume>) {
        const LOG_EVERY: u32 = 5;
        let weak = Arc::downgrade(vol);
        let spawned = std::thread::Builder::new()
            .name("cetra-inodes".into())
            .spawn(move || {
                let mut last = InodeTableStats::default();
                let mut last_cache = (BlockCacheStats::default(), BitmapCacheStats::default());
                let mut last_heap = heap::MallocTotals::default();
                let mut activity = 0;
                for tick in 1u32.. {
                    std::thread::sleep(inode_table::TRIM_EVERY);
                    let Some(v) = weak.upgrade() else { break };
                    if v.unmounted.load(Ordering::Relaxed) {
                        break;
                    }
                    let cache = v
                        .meta
                        .try_lock()
                        .or_panic()
                        .map(|mut m| ((m.cache_stats(), m.bitmap_stats()), m.take_released()));
                    if let Some((_, freed)) = cache {
                        v.inodes.note_released(freed);
                    }
                    v.inodes.trim(&mut activity);
                    if tick % LOG_EVERY != 0 {
                        continue;
                    }
                    v.inodes.report(&mut last);
                    if let Some((s, _)) = cache {
                        if s != last_cache {
                            s.0.log(&s.1);
                            last_cache = s;
                        }
                    }
                    let h = heap::MallocTotals::now();
                    if h != last_heap {
                        h.log();
                        last_heap = h;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("no inode table reporter ({e}): its stats are not logged");
        }
    }

    /// What the inode table holds and has done (`fs/inode_table.rs`).
    pub fn inode_table_stats(&self) -> InodeTableStats {
        self.inodes.stats()
    }

    /// What the metadata block cache holds and has done (`fs/block_cache.rs`).
    pub fn block_cache_stats(&self) -> BlockCacheStats {
        self.lock_meta().cache_stats()
    }

    /// What the allocator's bitmap cache holds and has done (alloc.rs).
    pub fn bitmap_cache_stats(&self) -> BitmapCacheStats {
        self.lock_meta().bitmap_stats()
    }

    /// Free the inodes this slot's orphan list names (open-unlinked when the node stopped).
    /// One still open here or on another live node stays listed: its last closer frees it.
    /// An entry that is not an inode's block (format/layout.rs) or whose inode cannot be read
    /// is left listed, untouched, with a warning: fsck reports it, and the mount goes on.
    fn free_orphans(&self, slot: u32) -> Result<()> {
        let orphans = {
            let mut meta = self.meta_sh()?;
            Tx::new(&*self.dev, &mut meta).slot_header_of(slot)?.orphans
        };
        if orphans.is_empty() {
            return Ok(());
        }
        let mut freed = 0;
        self.meta_op(|tx| {
            let mut kept = Vec::new();
            for &ino in &orphans {
                if tx
                    .sb()
                    .check_data_block(ino, crate::format::layout::PointerKind::Orphan, ino)
                    .is_err()
                {
                    kept.push(ino);
                    continue;
                }
                let st = match self.state(tx, ino) {
                    Ok(st) => st,
                    Err(e) if e.kind() == ErrorKind::NotFound => continue,
                    Err(e) => {
                        tracing::warn!("node slot {slot}: orphan inode {ino} is not freed: {e}");
                        kept.push(ino);
                        continue;
                    }
                };
                let mut inner = st.write();
                if inner.freed || inner.inode.nlink != 0 {
                    continue; // not an orphan any more
                }
                if !self.can_free(&st, &inner, FreeScope::Now) {
                    kept.push(ino);
                    continue;
                }
                self.free_inode(tx, &mut inner)?;
                freed += 1;
            }
            let mut h = tx.slot_header_of(slot)?;
            let before = h.orphans.len();
            h.orphans.retain(|o| kept.contains(o));
            if h.orphans.len() != before {
                tx.put_slot_header_of(slot, h);
            }
            Ok(())
        })?;
        if freed > 0 {
            tracing::info!("freed {freed} inodes left open-unlinked by a crash");
        }
        self.lock_meta().commit_point(&*self.dev)
    }

    /// The node slot this mount holds.
    pub fn slot(&self) -> u32 {
        self.member.slot
    }

    /// Why this node fenced itself, if it did.
    pub fn fence_reason(&self) -> Option<String> {
        self.member.fence_reason()
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    /// Last step of an unmount, once the slot is free: unregister the reservation key.
    fn leave_reservation(&self) {
        if let Some(pr) = &self.pr {
            pr.leave();
        }
    }

    /// Flush everything, give back the cluster locks and the node slot; the volume must not
    /// be used afterwards.
    pub fn unmount(&self) -> Result<()> {
        if self.unmounted.load(Ordering::SeqCst) {
            return Ok(());
        }
        if !self.read_only && !self.member.is_fenced() {
            self.finish_deferred_closes();
        }
        let r = self.sync();
        // Open-unlinked files still open at unmount are freed now (unless open elsewhere).
        let states = self.inodes.matching(|_| true);
        let open_here: Vec<Ino> = states
            .iter()
            .filter(|st| st.opens.load(Ordering::Acquire) > 0)
            .map(|st| st.ino)
            .collect();
        if self.read_only || self.member.is_fenced() {
            self.unmounted.store(true, Ordering::SeqCst);
            if !self.member.is_fenced() {
                self.unregister_all_opens(&open_here);
                let mut meta = self.lock_meta();
                // Locks that could not be given back stay with the slot, which the others
                // recover once its heartbeat stops: it is not released as if clean.
                self.leave_cluster(&mut meta)?;
            }
            if !self.keep_slot {
                self.member.release()?;
            }
            self.leave_reservation();
            return r;
        }
        let unlinked: Vec<Arc<InodeState>> = states
            .into_iter()
            .filter(|st| self.can_free(st, &st.read(), FreeScope::Unmount))
            .collect();
        // Allocating writes still in flight are mapped before the lock is given up. Waiting
        // for them lets go of the metadata mutex, and meanwhile the lock may have been handed
        // to another node: then take it again, until it is held exclusively with nothing in
        // flight (what follows writes metadata home).
        let mut meta = loop {
            let m = self.meta_ex()?;
            if m.inflight().is_empty() {
                break m;
            }
            let m = self.drained(m);
            if m.gml() == crate::format::lock_record::LockMode::Exclusive && m.inflight().is_empty()
            {
                break m;
            }
        };
        self.unmounted.store(true, Ordering::SeqCst);
        let mut tx = Tx::new(&*self.dev, &mut meta);
        for st in unlinked {
            if self.refresh(&mut tx, &st).is_err() {
                continue;
            }
            let mut inner = st.write();
            if self.can_free(&st, &inner, FreeScope::Unmount) {
                self.free_inode(&mut tx, &mut inner)?;
            }
        }
        tx.return_pool(true)?;
        tx.commit()?;
        meta.close(&*self.dev)?;
        self.unregister_all_opens(&open_here);
        self.leave_cluster(&mut meta)?;
        drop(meta);
        if !self.keep_slot {
            self.member.release()?;
        }
        self.leave_reservation();
        if let Some(wd) = self.watchdog.get() {
            wd.close_clean();
        }
        r
    }

    pub fn root_ino(&self) -> Ino {
        self.sb.root_ino
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn lock_meta(&self) -> MutexGuard<'_, Meta> {
        self.meta.lock().or_panic()
    }

    fn check_writable(&self) -> Result<()> {
        if self.read_only {
            bail!(ReadOnly, "volume is mounted read-only");
        }
        if !self.member.lease_valid() {
            bail!(
                Fenced,
                "this node is fenced ({}); unmount and mount again",
                self.member
                    .fence_reason()
                    .unwrap_or_else(|| "heartbeat lease expired".into())
            );
        }
        if self.unmounted.load(Ordering::Relaxed) {
            bail!(Io, "volume is unmounted");
        }
        Ok(())
    }

    /// The in-memory state of an inode, loading it if needed.
    fn state(&self, tx: &mut Tx<'_>, ino: Ino) -> Result<Arc<InodeState>> {
        self.state_noting(tx, ino, ino == self.sb.root_ino)
    }

    /// [`Volume::state`] of the inode a name read in this same transaction leads to: the
    /// number is that live inode's, so a copy loaded from home may be noted current at its
    /// lock's version ([`Volume::note_loaded`]). A number reached otherwise (the kernel's
    /// node id) may be a freed inode's whose block another node's pool took, its old image
    /// still at home: that copy must never be noted. The root is never freed.
    pub(super) fn state_of_name(&self, tx: &mut Tx<'_>, ino: Ino) -> Result<Arc<InodeState>> {
        self.state_noting(tx, ino, true)
    }

    fn state_noting(&self, tx: &mut Tx<'_>, ino: Ino, note: bool) -> Result<Arc<InodeState>> {
        let cached = self.inodes.get(ino);
        if let Some(s) = cached {
            if !s.read().freed {
                match self.refresh_noting(tx, &s, note) {
                    Ok(()) => return Ok(s),
                    // Removed by another node, and the number perhaps reused: load whatever
                    // the block holds now (below).
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
        if !tx.sb().is_data_block(ino) || !tx.is_used(ino)? {
            bail!(NotFound, "inode {ino} does not exist");
        }
        let epoch = self.cl.epoch.load(Ordering::Acquire);
        // Whether another node owns it, asked before the read (one bucket read an epoch):
        // if none does, none can before this node lets the global lock go, and the read is
        // current.
        let unowned_before_read = self.unowned_elsewhere(ino, epoch);
        let raw = tx.read(ino)?;
        // A regular file or a directory may be changed by the node that owns its lock
        // without the global lock (fs/detached.rs rule 3, fs/detached_ns.rs): what was read
        // may be stale, or torn by that node's home write; then read it again once that node
        // has written it home. So also when the owner the bucket showed before the read let
        // go before `before_load` asked: a copy read before that must not stay in the block
        // cache, where a later load would take it for current. (The type is only known from
        // a good read: a torn one is checked the same way before it counts as damage.)
        let inode = match Inode::decode(&raw, ino) {
            Ok(i) if !i.is_reg() && !i.is_dir() => i,
            first => {
                let waited = self
                    .before_load(tx, ino)
                    .inspect_err(|_| tx.drop_cached(ino))?;
                if waited || !unowned_before_read {
                    tx.drop_cached(ino);
                    Inode::decode(&tx.read(ino)?, ino)?
                } else {
                    first?
                }
            }
        };
        let extents = if inode.is_reg() {
            ExtentMap::load(tx, &inode)?
        } else {
            ExtentMap::default()
        };
        let changes_detached = inode.is_reg() || inode.is_dir();
        let st = Arc::new(InodeState::new(inode, extents, epoch));
        if note && changes_detached {
            self.note_loaded(&st, epoch);
        }
        self.inodes.insert(st.clone());
        Ok(st)
    }

    /// The state of an inode for read-mostly calls (getattr, open, lseek): from the table
    /// without touching the metadata lock when it is loaded, so such calls do not wait behind
    /// a commit point's device flushes; loaded under the lock otherwise.
    fn loaded_state(&self, ino: Ino) -> Result<Arc<InodeState>> {
        match self.loaded_state_unless_stalled(ino)? {
            Some(s) => Ok(s),
            None => self.read_op(|tx| self.state(tx, ino)),
        }
    }

    /// [`Volume::loaded_state`], or None while every holder of the global lock is silent and
    /// this node's copy of `ino` (if it has one) is not validated by `ino`'s own lock
    /// (`fs/own_lock_reads.rs`).
    fn loaded_state_unless_stalled(&self, ino: Ino) -> Result<Option<Arc<InodeState>>> {
        // Release the table before taking the inode lock: free_inode holds the inode lock
        // while it removes the entry from the table, and this path holds no metadata lock.
        let cached = self.inodes.get(ino);
        if let Some(s) = &cached {
            if !s.read().freed && self.is_current_unlocked(s) {
                return Ok(Some(Arc::clone(s)));
            }
        }
        if let Some(s) = self.read_op_unless_stalled(|tx| self.state(tx, ino))? {
            return Ok(Some(s));
        }
        Ok(cached.filter(|s| self.validated_by_own_lock(s)))
    }

    /// Write an inode (and its changed extents) into the transaction. An error means the
    /// inode was not written and its tree at home maps what it mapped (the caller may undo
    /// its change in memory), unless the node fenced itself or failed (`Meta::has_failed`).
    fn save(&self, tx: &mut Tx<'_>, inner: &mut InodeInner) -> Result<()> {
        // Other nodes' fast paths stop trusting their cached copy first (v3). Operations that
        // free, allocate or rewrite blocks took it already, before doing so; for the rest this
        // is the first time. A failure here leaves a half-made change in the running
        // transaction (which commits even on error): fence, so that it never reaches the LUN
        // and the others recover this node from its last commit.
        // Without the global lock (fs/detached_ns.rs) the inode must be fresh or owned: a
        // refusal before anything changed only sends the operation to the global path.
        if let Err(e) = self.before_change(tx, inner.inode.ino) {
            if e.kind() == ErrorKind::NeedsGlobalLock && !tx.touched() {
                return Err(e);
            }
            tx.fail_node(
                &e,
                &format!(
                    "a change of inode {} (its cluster lock could not be taken)",
                    inner.inode.ino
                ),
            );
            return Err(e);
        }
        // The bitmaps the frees below need are loaded (and, format 7, marked) before anything
        // is written. The frees are not this save's purpose: runs whose bitmap cannot be
        // loaded now wait for a later save rather than failing this one (a link, a chmod) for
        // a change another operation began. Without the global lock they go into this node's
        // pool, if it has room for them all (as the punch that unmapped them checked,
        // `Volume::frees_fit`); else a later save frees them.
        let ino = inner.inode.ino;
        let ready: Vec<bool> = if !inner.unfreed.is_empty() && tx.frees_fit(&inner.unfreed) {
            inner
                .unfreed
                .iter()
                .map(|&(p, _)| {
                    tx.prepare_free(p)
                        .inspect_err(|e| {
                            tracing::warn!("inode {ino}: blocks at {p} it no longer maps stay allocated until a later save: {e}");
                        })
                        .is_ok()
                })
                .collect()
        } else {
            Vec::new()
        };
        crate::failpoint!("save::before_map");
        if inner.inode.is_reg() {
            let d = inner.extents.persist(tx, &mut inner.inode)?;
            inner.inode.blocks = inner.inode.blocks.saturating_add_signed(d);
        }
        inner.inode.seq += 1;
        tx.write(inner.inode.ino, inner.inode.encode());
        // Only now, in the transaction that unmaps them. The inode is written: a free that
        // still fails keeps its run for the next save (leaked until then, which is safe) and
        // fails nothing, so that an error from this function always means the inode was not
        // written (or the node fenced).
        if !ready.is_empty() {
            let runs = std::mem::take(&mut inner.unfreed);
            for ((p, l), ready) in runs.into_iter().zip(ready) {
                let freed = ready
                    && tx.free(p, l).map_or_else(
                        |e| {
                            tracing::warn!("inode {ino}: blocks {p}+{l} it no longer maps stay allocated until a later save: {e}");
                            false
                        },
                        |()| true,
                    );
                if !freed {
                    inner.unfreed.push((p, l));
                }
            }
        }
        Ok(())
    }

    /// Fold a pending fast-path mtime into the inode (caller holds the write lock).
    fn fold_pending(st: &InodeState, inner: &mut InodeInner) -> bool {
        if st.has_pending.swap(false, Ordering::AcqRel) {
            let t = nanos_to_ts(st.pending_mtime.load(Ordering::Relaxed));
            inner.inode.mtime = t;
            inner.inode.ctime = t;
            return true;
        }
        false
    }

    /// **The one rule for "may this inode be freed now"**: it has no link left and is not freed
    /// yet, nothing on this node holds it (no open handle, no kernel reference — unless
    /// `scope` is [`FreeScope::Unmount`], where those end with the mount), and no other live
    /// node has it registered open (a bucket that cannot be read counts as open: a free is
    /// deferred, never done early). Cheap tests first; the last one may read a lock record.
    /// An inode this refuses stays on an orphan list and the last holder frees it.
    fn can_free(&self, st: &InodeState, inner: &InodeInner, scope: FreeScope) -> bool {
        if inner.freed || inner.inode.nlink != 0 {
            return false;
        }
        let local = scope == FreeScope::Unmount
            || (st.opens.load(Ordering::Acquire) == 0 && !self.inodes.referenced(st.ino));
        // A fresh inode (fs/detached_ns.rs) is known to no other node: no bucket to read.
        local && (self.detached.is_fresh(st.ino) || !self.open_elsewhere(st.ino))
    }

    /// Load every bitmap a free of this inode frees into (its block, data, tree nodes), and on
    /// format 7 put this node's mark on each that another node owns (`fs/group_marks.rs`). Its
    /// xattr and overflow blocks are not: a failure there only leaks them (fsck reports it).
    /// Callers that change names first call it before they do, so that an error changes
    /// nothing.
    fn prepare_inode_free(tx: &mut Tx<'_>, inner: &InodeInner) -> Result<()> {
        tx.prepare_free(inner.inode.ino)?;
        if inner.inode.is_reg() {
            Self::prepare_free(tx, inner, 0, u64::MAX)?;
        }
        for &(p, _) in &inner.unfreed {
            tx.prepare_free(p)?;
        }
        if inner.inode.tree_root != 0 && !tx.is_detached() && tx.sb().has_group_marks() {
            let nodes =
                btree::Tree::new(tx, inner.inode.tree_root, inner.inode.ino).node_blocks()?;
            for b in nodes {
                tx.prepare_free(b)?;
            }
        }
        Ok(())
    }

    /// Release every block an inode holds and the inode itself.
    fn free_inode(&self, tx: &mut Tx<'_>, inner: &mut InodeInner) -> Result<()> {
        let ino = inner.inode.ino;
        // Nodes whose copy of the inode is still marked valid must drop it before its blocks
        // and its number can be reused (v3); without the global lock it is fresh and small
        // (checked by the caller before anything changed).
        self.check_fresh(tx, ino)?;
        self.before_change(tx, ino)?;
        // Every bitmap this frees into is loaded first (format 7: and marked, if another
        // node owns its group): a read that fails, or a mark that does not come, leaves the
        // inode (and its orphan entry) as it was, instead of freeing half its blocks.
        Self::prepare_inode_free(tx, inner)?;
        // The orphan entry to remove, read before anything changes.
        let mut orphan_entry = None;
        if inner.inode.nlink == 0 && tx.is_detached() {
            // A fresh inode is on no other node's list. On this node's only if its unlink
            // took the global path; then so does its free: slot headers are changed under
            // the global lock only (another node may remove an entry from this one).
            if tx.slot_header()?.orphans.contains(&ino) {
                bail!(NeedsGlobalLock, "inode {ino} is on the orphan list");
            }
        } else if inner.inode.nlink == 0 {
            // Usually on this node's orphan list; on another's when that node unlinked it
            // while this one had it open (the last node to close frees it).
            let own = tx.slot();
            for slot in std::iter::once(own).chain((0..self.sb.max_nodes).filter(|&s| s != own)) {
                let mut h = tx.slot_header_of(slot)?;
                if let Some(i) = h.orphans.iter().position(|&o| o == ino) {
                    h.orphans.swap_remove(i);
                    orphan_entry = Some((slot, h));
                    break;
                }
            }
        }
        // A write in flight holds an open handle, so the file cannot be freed under it.
        debug_assert!(
            !tx.inflight().busy(ino),
            "freeing inode {ino} with a write in flight"
        );
        // From the first free on, a failure (a tree node that cannot be read) would leave a
        // half-freed inode in the running transaction, which commits even on error — off the
        // orphan list or not, mapping blocks already free. Fence instead: none of it reaches
        // the LUN, and the recovery frees the inode from the orphan list it is still on.
        let freed = (|| {
            if inner.inode.is_reg() {
                let runs = inner.extents.punch(0, u64::MAX);
                for (p, l) in runs.into_iter().chain(std::mem::take(&mut inner.unfreed)) {
                    tx.free(p, l)?;
                }
            }
            if inner.inode.tree_root != 0 {
                btree::Tree::new(tx, inner.inode.tree_root, ino).destroy()?;
            }
            attrs::free_owned(tx, &self.sb, &inner.inode);
            tx.forget_owner(ino);
            if tx.is_detached() && self.detached.take_parked(ino) {
                // Its block is the pool's on disk already (fs/detached_ns.rs).
                tx.free_parked(ino);
            } else {
                tx.free_one(ino)?;
            }
            if let Some((slot, h)) = orphan_entry {
                tx.put_slot_header_of(slot, h);
            }
            Ok(())
        })();
        if let Err(e) = freed {
            tx.fail_node(&e, &format!("freeing inode {ino}"));
            return Err(e);
        }
        inner.freed = true;
        self.inodes.remove(ino);
        self.detached.forget_fresh(ino);
        Ok(())
    }

    fn attr_of(inode: &Inode) -> Attr {
        Attr {
            ino: inode.ino,
            kind: FileKind::from_mode(inode.mode).unwrap_or(FileKind::Regular),
            perm: u16::try_from(inode.mode & 0o7777).unwrap_or(0),
            nlink: inode.nlink,
            uid: inode.uid,
            gid: inode.gid,
            rdev: inode.rdev,
            size: inode.size,
            blocks: inode.blocks.saturating_sub(1) * (FS_BLOCK / 512),
            atime: inode.atime,
            mtime: inode.mtime,
            ctime: inode.ctime,
            crtime: inode.crtime,
            flags: inode.flags & flags::USER_VISIBLE,
            generation: inode.generation,
        }
    }

    /// Run a metadata operation: lock, transaction, commit.
    fn meta_op<T>(&self, f: impl FnOnce(&mut Tx<'_>) -> Result<T>) -> Result<T> {
        self.meta_op_as(None, f)
    }

    /// [`Volume::meta_op`] for a change that loads every inode it needs before it changes
    /// anything, in the transaction or in memory: like a read ([`Volume::read_op`]), it is
    /// started again when a load met an inode lock held elsewhere for longer than a moment,
    /// so that it waits for that lock without the global lock and the metadata mutex.
    fn restartable_op<T>(&self, f: impl Fn(&mut Tx<'_>) -> Result<T>) -> Result<T> {
        self.restarting(|waited| self.meta_op_as(Some(waited), &f))
    }

    /// `restart`: for a restartable change, the inodes its earlier attempts waited for.
    fn meta_op_as<T>(
        &self,
        restart: Option<&[LockWait]>,
        f: impl FnOnce(&mut Tx<'_>) -> Result<T>,
    ) -> Result<T> {
        self.meta_op_in(self.meta_ex()?, restart, f)
    }

    /// [`Volume::meta_op`], or None (nothing done) instead of waiting on once every holder of
    /// the global lock is silent (`fs/closer.rs`).
    fn meta_op_unless_stalled<T>(
        &self,
        f: impl FnOnce(&mut Tx<'_>) -> Result<T>,
    ) -> Result<Option<T>> {
        match self.meta_unless_stalled(crate::format::lock_record::LockMode::Exclusive)? {
            Some(meta) => self.meta_op_in(meta, None, f).map(Some),
            None => Ok(None),
        }
    }

    fn meta_op_in<T>(
        &self,
        mut meta: MutexGuard<'_, Meta>,
        restart: Option<&[LockWait]>,
        f: impl FnOnce(&mut Tx<'_>) -> Result<T>,
    ) -> Result<T> {
        let mut tx = match restart {
            Some(waited) => Tx::restartable(&*self.dev, &mut meta, waited),
            None => Tx::new(&*self.dev, &mut meta),
        };
        let r = f(&mut tx);
        // Commit what was done even on error: every step leaves metadata consistent, and
        // blocks allocated before the failure are referenced by what is committed.
        let c = tx.commit();
        let v = r?;
        c?;
        Ok(v)
    }

    /// A read under the global lock (held at least shared), started again when it met an
    /// inode lock held elsewhere for longer than a moment before it changed anything: then
    /// the lock is waited for with no lock of this node held (`fs/detached.rs` rule 3).
    fn read_op<T>(&self, f: impl Fn(&mut Tx<'_>) -> Result<T>) -> Result<T> {
        self.restarting(|waited| {
            let mut meta = self.meta_sh()?;
            f(&mut Tx::restartable(&*self.dev, &mut meta, waited))
        })
    }

    /// Run `attempt` (which holds the metadata mutex only while it runs) until it ends other
    /// than with [`ErrorKind::WaitForLock`]; after that error, wait for the lock it names
    /// (an inode's lock, or another node's mark on a group to free into) with no lock of
    /// this node held. `attempt` gets the locks waited for so far (each once:
    /// [`Tx::may_restart`], [`Tx::prepare_free`]). An attempt that found no space while
    /// freed blocks waited for a commit point runs once more after it
    /// ([`Meta::commit_for_space`]): an attempt that fails leaves the changes it made in the
    /// running transaction (as [`Volume::meta_op_as`] commits what was done even on error),
    /// so trying again is what its caller would do after `ENOSPC`.
    fn restarting<T>(&self, mut attempt: impl FnMut(&[LockWait]) -> Result<T>) -> Result<T> {
        let mut waited = Vec::new();
        let mut space_tried = false;
        loop {
            match attempt(&waited) {
                Err(e) if e.kind() == ErrorKind::WaitForLock => {
                    let wait = e.lock_wait().ok_or(e)?;
                    match wait {
                        LockWait::Inode { ino, exclusive } => {
                            self.wait_for_inode_lock(ino, exclusive)?;
                        }
                        LockWait::GroupMark { group } => self.wait_for_group_mark(group)?,
                    }
                    waited.push(wait);
                }
                Err(e) => match e.frees_wait() {
                    Some(since) if !space_tried && !self.read_only => {
                        space_tried = true;
                        if !self.lock_meta().commit_for_space(&*self.dev, since)? {
                            return Err(e);
                        }
                    }
                    _ => return Err(e),
                },
                r => return r,
            }
        }
    }

    pub fn getattr(&self, ino: Ino) -> Result<Attr> {
        let st = self.loaded_state(ino)?;
        Ok(Self::attr_with_pending(&st))
    }

    /// Attributes including an mtime that fast-path writes have not folded in yet (it stays
    /// pending, so the next metadata commit still persists it).
    fn attr_with_pending(st: &InodeState) -> Attr {
        let inner = st.read();
        let mut a = Self::attr_of(&inner.inode);
        if st.has_pending.load(Ordering::Acquire) {
            let t = nanos_to_ts(st.pending_mtime.load(Ordering::Relaxed));
            a.mtime = t;
            a.ctime = t;
        }
        a
    }

    /// The kernel now holds one more reference (lookup count) to `ino`: an entry reply
    /// (lookup, create, mknod, mkdir, symlink, link, readdirplus) reached it. Until the
    /// matching `forget`, the inode number must not be reused, even once it has no links.
    pub fn note_lookup(&self, ino: Ino) {
        self.inodes.note_lookup(ino);
    }

    /// [`Volume::note_lookup`] for an entry a listing gave with placeholder attributes only
    /// ([`EntryAttr::Unreadable`]).
    pub fn note_listed(&self, ino: Ino) {
        self.inodes.note_listed(ino);
    }

    /// The kernel dropped `nlookup` references to `ino`. An inode without links, opens or
    /// kernel references is freed now; otherwise the in-memory state is dropped if idle.
    pub fn forget(&self, ino: Ino, nlookup: u64) {
        // Some only when no references are left and the state is loaded.
        let st = self.inodes.forget(ino, nlookup);
        // Freed into the pool at its unlink (fs/detached_ns.rs): its number may go. The unlink
        // takes the hold before it looks at the references again, and this looks for the hold
        // after the references went: one of the two finds the other's step (the metadata
        // mutex only when there is a hold to drop, not at every forget).
        if !self.inodes.referenced(ino) && self.detached.take_kernel_hold(ino) {
            self.lock_meta().unpin_pooled(ino);
            return;
        }
        let Some(st) = st else {
            return;
        };
        if !self.read_only
            && !self.unmounted.load(Ordering::Relaxed)
            && self.can_free(&st, &st.read(), FreeScope::Now)
        {
            // A fresh inode goes back into the pool without the global lock; another is freed
            // as at a last close: never waiting on a worker for silent holders of the global
            // lock (a FORGET is not answered either: fs/closer.rs).
            let r = self
                .free_fresh(&st)
                .unwrap_or_else(|| self.finish_close_or_defer(&st));
            if let Err(e) = r {
                tracing::warn!("freeing inode {ino} after its last reference failed (it stays on the orphan list): {e}");
            }
            return;
        }
        drop(st);
        self.inodes.evict_idle(ino);
    }

    /// [`Volume::setattr_by`] with a plain caller (root keeps setuid/setgid on truncate).
    pub fn setattr(&self, ino: Ino, set: &SetAttr, caller: Caller) -> Result<Attr> {
        self.setattr_by(ino, set, &caller)
    }

    /// Change attributes on behalf of `who`. A size change or a change of owner or group also
    /// removes the setuid/setgid bits the rules in [`suid`] name, in the same transaction.
    pub fn setattr_by(&self, ino: Ino, set: &SetAttr, who: &dyn Credentials) -> Result<Attr> {
        self.check_writable()?;
        // A size change waits for the file's allocating writes in flight (fs/inflight.rs).
        let _drained = set.size.map(|_| self.quiesce(ino));
        if let Some(attr) = self.setattr_owned(ino, set, who)? {
            return Ok(attr);
        }
        self.restartable_op(|tx| {
            let st = self.state(tx, ino)?;
            let mut inner = st.write();
            // A truncate frees blocks and zeroes a partial one: own the inode before either.
            self.own_inode(tx, ino)?;
            self.setattr_change(tx, &st, &mut inner, set, who)
        })
    }

    /// What `setattr` does to the inode, on the global path and without it alike (the caller
    /// holds the inode's locks and drained its writes): the one home of its rules.
    fn setattr_change(
        &self,
        tx: &mut Tx<'_>,
        st: &InodeState,
        inner: &mut InodeInner,
        set: &SetAttr,
        who: &dyn Credentials,
    ) -> Result<Attr> {
        let ino = inner.inode.ino;
        Self::fold_pending(st, inner);
        let fl = inner.inode.flags;
        let changes_content = set.size.is_some();
        let changes_meta = set.mode.is_some()
            || set.uid.is_some()
            || set.gid.is_some()
            || set.atime.is_some()
            || set.mtime.is_some();
        if fl & flags::IMMUTABLE != 0 && (changes_content || changes_meta) {
            bail!(PermissionDenied, "inode {ino} is immutable");
        }
        if fl & flags::APPEND != 0 && set.size.is_some_and(|s| s < inner.inode.size) {
            bail!(PermissionDenied, "inode {ino} is append-only");
        }
        let t = now();
        // Decided on the mode and group before this change, as the kernel does.
        let (old_mode, old_gid) = (inner.inode.mode, inner.inode.gid);
        let mut drop = 0;
        if set.size.is_some() {
            drop |= suid::on_write(old_mode, old_gid, who);
        }
        if set.uid.is_some() || set.gid.is_some() {
            drop |= suid::on_chown(old_mode, old_gid, who);
        }
        if let Some(size) = set.size {
            if !inner.inode.is_reg() {
                bail!(InvalidInput, "cannot change the size of a non-regular file");
            }
            self.truncate_locked(tx, inner, size)?;
            // The map is punched in memory: a wait further on must not start this again.
            tx.no_restart();
            inner.inode.mtime = t;
        }
        let mut released = attrs::Released::default();
        if let Some(m) = set.mode {
            inner.inode.mode = (inner.inode.mode & libc::S_IFMT) | (m & 0o7777);
            released = self.chmod_acl(tx, &mut inner.inode, m)?;
        }
        if let Some(u) = set.uid {
            inner.inode.uid = u;
        }
        if let Some(g) = set.gid {
            inner.inode.gid = g;
        }
        inner.inode.mode &= !drop;
        let pick = |s: SetTime| match s {
            SetTime::Now => t,
            SetTime::At(x) => x,
        };
        if let Some(a) = set.atime {
            inner.inode.atime = pick(a);
        }
        if let Some(m) = set.mtime {
            inner.inode.mtime = pick(m);
        }
        inner.inode.ctime = set.ctime.unwrap_or(t);
        self.save(tx, inner)?;
        released.free(tx);
        Ok(Self::attr_of(&inner.inode))
    }

    pub fn statfs(&self) -> Result<StatFs> {
        // Other nodes' published free counts (a grant reads only this node's own groups'),
        // read without the metadata mutex.
        self.refresh_group_counts()?;
        let meta = self.meta_sh()?;
        let free = meta.free_blocks();
        Ok(StatFs {
            blocks: meta.total_blocks(),
            bfree: free,
            bavail: free,
            files: meta.total_blocks(),
            ffree: free,
            bsize: u32::try_from(FS_BLOCK).unwrap_or(4096),
            namelen: u32::try_from(crate::format::dirent::MAX_NAME).unwrap_or(255),
        })
    }

    fn check_xattr_name(name: &[u8]) -> Result<()> {
        const PREFIXES: [&[u8]; 4] = [b"user.", b"trusted.", b"security.", b"system.posix_acl_"];
        if name.is_empty() || name.len() > 255 {
            bail!(Range, "xattr name length {} out of range", name.len());
        }
        if !PREFIXES.iter().any(|p| name.starts_with(p)) {
            bail!(
                Unsupported,
                "xattr namespace of {:?} is not supported",
                String::from_utf8_lossy(name)
            );
        }
        Ok(())
    }

    pub fn getxattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>> {
        if name == defrag::PROGRESS_XATTR {
            return match self.defrag_progress() {
                Some((i, done, total)) if i == ino => {
                    Ok(format!("{i} {done} {total}").into_bytes())
                }
                _ => Err(Error::new(ErrorKind::NoData, "no defrag runs on this file")),
            };
        }
        let no_such = || Error::new(ErrorKind::NoData, "no such attribute");
        if self.has_no_xattrs_here(ino) {
            return Err(no_such());
        }
        self.read_op(|tx| {
            let st = self.state(tx, ino)?;
            let inner = st.read();
            let mut set = attrs::load_xattrs(tx, &self.sb, &inner.inode)?;
            set.map.remove(name).ok_or_else(no_such)
        })
    }

    /// Does this node know, without the global lock, that `ino` has no extended attributes?
    /// Its loaded copy is current under the inode's own lock (the test `getattr` uses) and
    /// names no xattr block. The kernel asks for `security.capability` before a write or a
    /// punched hole that may have to remove privileges, whenever it does not know the file
    /// has none: a VM's image must answer that without the global lock, which a dead node
    /// may hold for its whole dead time.
    fn has_no_xattrs_here(&self, ino: Ino) -> bool {
        self.inodes.get(ino).is_some_and(|st| {
            let inner = st.read();
            !inner.freed && inner.inode.xattr_block == 0 && self.is_current_unlocked(&st)
        })
    }

    pub fn listxattr(&self, ino: Ino) -> Result<Vec<Vec<u8>>> {
        if self.has_no_xattrs_here(ino) {
            return Ok(Vec::new());
        }
        self.read_op(|tx| {
            let st = self.state(tx, ino)?;
            let inner = st.read();
            Ok(attrs::load_xattrs(tx, &self.sb, &inner.inode)?
                .map
                .into_keys()
                .collect())
        })
    }

    /// flags: `XATTR_CREATE` / `XATTR_REPLACE` semantics.
    pub fn setxattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        create: bool,
        replace: bool,
    ) -> Result<()> {
        self.check_writable()?;
        Self::check_xattr_name(name)?;
        attrs::check_value(&self.sb, value)?;
        if name == acl::ACCESS {
            return self.set_access_acl(ino, value, create, replace);
        }
        self.update_xattrs(ino, |map, _| {
            let exists = map.contains_key(name);
            if create && exists {
                bail!(Exists, "attribute exists");
            }
            if replace && !exists {
                bail!(NoData, "no such attribute");
            }
            map.insert(name.to_vec(), value.to_vec());
            Ok(())
        })
    }

    pub fn removexattr(&self, ino: Ino, name: &[u8]) -> Result<()> {
        self.check_writable()?;
        self.update_xattrs(ino, |map, _| {
            map.remove(name)
                .map(|_| ())
                .ok_or_else(|| Error::new(ErrorKind::NoData, "no such attribute"))
        })
    }

    /// setfacl on the access ACL (the kernel validated it and checked ownership): the mode's
    /// permission bits follow the ACL, in the same transaction; an ACL that says no more than
    /// the mode is not stored at all, as ext4 does.
    fn set_access_acl(&self, ino: Ino, value: &[u8], create: bool, replace: bool) -> Result<()> {
        let Some(a) = acl::Acl::decode(value) else {
            bail!(InvalidInput, "invalid POSIX ACL");
        };
        self.update_xattrs(ino, |map, inode| {
            let exists = map.contains_key(acl::ACCESS);
            if create && exists {
                bail!(Exists, "attribute exists");
            }
            if replace && !exists {
                bail!(NoData, "no such attribute");
            }
            if a.is_equivalent_to_mode() {
                map.remove(acl::ACCESS);
            } else {
                map.insert(acl::ACCESS.to_vec(), value.to_vec());
            }
            inode.mode = (inode.mode & !0o777) | a.mode_bits();
            Ok(())
        })
    }

    /// After chmod (in its transaction): the owner, mask and other entries of the inode's
    /// access ACL follow the new mode. Symlinks have no ACLs; an unparsable ACL is left alone.
    fn chmod_acl(&self, tx: &mut Tx<'_>, inode: &mut Inode, mode: u32) -> Result<attrs::Released> {
        if inode.xattr_block == 0 || inode.mode & libc::S_IFMT == libc::S_IFLNK {
            return Ok(attrs::Released::default());
        }
        let mut set = attrs::load_xattrs(tx, &self.sb, inode)?;
        let Some(v) = set.map.get(acl::ACCESS) else {
            return Ok(attrs::Released::default());
        };
        let Some(mut a) = acl::Acl::decode(v) else {
            tracing::warn!(
                "inode {}: ignoring an unparsable {} on chmod",
                inode.ino,
                String::from_utf8_lossy(acl::ACCESS)
            );
            return Ok(attrs::Released::default());
        };
        a.chmod(mode);
        set.map.insert(acl::ACCESS.to_vec(), a.encode());
        attrs::store_xattrs(tx, &self.sb, inode, &set)
    }

    /// Change an inode's xattr set (and, through `f`'s second argument, its mode) in one
    /// transaction.
    fn update_xattrs(
        &self,
        ino: Ino,
        f: impl Fn(&mut xattr::XattrMap, &mut Inode) -> Result<()>,
    ) -> Result<()> {
        self.restartable_op(|tx| {
            let st = self.state(tx, ino)?;
            let mut inner = st.write();
            if inner.inode.flags & (flags::IMMUTABLE | flags::APPEND) != 0 {
                bail!(PermissionDenied, "inode {ino} is immutable or append-only");
            }
            let mut set = attrs::load_xattrs(tx, &self.sb, &inner.inode)?;
            // Put back while nothing of the new set is written (the change failed, or the set
            // is empty now, which writes no block), so that a retry after a commit point
            // starts from the inode at home. Once the set's blocks are rewritten, memory
            // keeps the new set, as they hold it: the next save writes the inode.
            let before = inner.inode.clone();
            let stored = f(&mut set.map, &mut inner.inode)
                .and_then(|()| attrs::store_xattrs(tx, &self.sb, &mut inner.inode, &set));
            let released = match stored {
                Ok(r) => r,
                Err(e) => {
                    inner.inode = before;
                    return Err(e);
                }
            };
            inner.inode.ctime = now();
            if let Err(e) = self.save(tx, &mut inner) {
                if set.map.is_empty() {
                    inner.inode = before;
                }
                return Err(e);
            }
            released.free(tx);
            Ok(())
        })
    }

    /// `FS_IOC_GETFLAGS`.
    pub fn get_flags(&self, ino: Ino) -> Result<u32> {
        Ok(self.getattr(ino)?.flags)
    }

    /// `FS_IOC_SETFLAGS` (immutable, append-only, noatime).
    pub fn set_flags(&self, ino: Ino, new_flags: u32) -> Result<()> {
        self.check_writable()?;
        if new_flags & !flags::USER_VISIBLE != 0 {
            bail!(
                Unsupported,
                "inode flags {:#x} are not supported",
                new_flags & !flags::USER_VISIBLE
            );
        }
        self.restartable_op(|tx| {
            let st = self.state(tx, ino)?;
            let mut inner = st.write();
            // Owned before the change in memory, while the transaction may start again.
            self.own_inode(tx, ino)?;
            inner.inode.flags = (inner.inode.flags & !flags::USER_VISIBLE) | new_flags;
            inner.inode.ctime = now();
            self.save(tx, &mut inner)
        })
    }

    /// Flush all dirty state (syncfs).
    pub fn sync(&self) -> Result<()> {
        let pending = self
            .inodes
            .matching(|s| s.has_pending.load(Ordering::Acquire));
        if !pending.is_empty() && !self.read_only {
            self.meta_op(|tx| {
                for st in pending {
                    if self.refresh(tx, &st).is_err() {
                        continue;
                    }
                    let mut inner = st.write();
                    if !inner.freed && Self::fold_pending(&st, &mut inner) {
                        self.save(tx, &mut inner)?;
                    }
                }
                Ok(())
            })?;
        }
        if self.read_only {
            return self.dev.flush();
        }
        self.lock_meta().commit_point(&*self.dev)
    }

    /// Commit point if anything is pending (the background committer's tick).
    pub fn commit_if_pending(&self) -> Result<()> {
        let mut meta = self.lock_meta();
        if meta.has_pending() && !meta.has_failed() {
            meta.commit_point(&*self.dev)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod detached_ns_tests;
#[cfg(test)]
mod detached_tests;
#[cfg(test)]
mod group_marks_tests;
#[cfg(test)]
mod grow_tests;
#[cfg(test)]
mod inflight_tests;
#[cfg(test)]
mod inode_lock_tests;
#[cfg(test)]
mod multinode_tests;
#[cfg(test)]
mod pointer_tests;
#[cfg(test)]
mod sharing_tests;
#[cfg(test)]
mod tests;
