//! Metadata transactions and commit points.
//!
//! Every metadata change of one operation is collected in a [`Tx`] as whole encoded blocks.
//! `Tx::commit` folds them into the node's *running compound transaction* (`Meta::pending`),
//! which the cache serves reads from. A *commit point* (fsync, sync, unmount, the background
//! committer every second, or a full journal) makes it durable:
//!
//! 1. flush the device: every data block written so far — in particular the blocks the
//!    pending metadata newly maps — is durable before the metadata that maps it;
//! 2. write the compound transaction to this node's journal, flush;
//! 3. write the blocks home (made durable by the next commit point's first flush, which is what
//!    lets the next transaction overwrite this one in the journal);
//! 4. release blocks freed by the transaction for reuse: until the free is durable a freed
//!    block must not receive another file's data.
//!
//! A crash before step 2 completes loses the whole compound transaction (the volume stays at
//! the previous commit point); after it, replay at mount redoes step 3.

use crate::alloc::Allocator;
use crate::dev::{AlignedBuf, BlockDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::block::BlockHeader;
use crate::format::superblock::Superblock;
use crate::format::FS_BLOCK;
use crate::journal::{self, JournalArea};
use std::collections::{BTreeMap, HashMap};

/// Cached metadata blocks (clean copies only; pending blocks are kept separately).
const CACHE_LIMIT: usize = 1 << 16;

#[derive(Debug)]
pub(crate) struct Meta {
    pub alloc: Allocator,
    /// The volume's layout: every block pointer decoded from disk is checked against it
    /// (format/layout.rs) before it is followed.
    pub sb: Superblock,
    cache: HashMap<u64, Vec<u8>>,
    /// Latest image of every block changed since the last commit point.
    pending: BTreeMap<u64, Vec<u8>>,
    journal: JournalArea,
    next_seq: u64,
    /// A commit point failed: what is on disk is unknown, so no more metadata is written.
    failed: bool,
    /// This node's slot (whose journal and orphan list it uses).
    pub slot: u32,
    /// How this node holds the cluster's global metadata lock (fs/cluster.rs).
    pub gml: crate::format::lock_record::LockMode,
    /// The lock's version when this node last held it: if it moved, caches are stale.
    pub gml_version: u64,
    /// Free counts last published into the group locks' value blocks.
    pub published: HashMap<u64, u64>,
}

impl Meta {
    pub fn new(alloc: Allocator, journal: JournalArea, sb: Superblock) -> Self {
        Self {
            alloc,
            sb,
            cache: HashMap::new(),
            pending: BTreeMap::new(),
            journal,
            next_seq: 1,
            failed: false,
            slot: 0,
            gml: crate::format::lock_record::LockMode::Free,
            gml_version: 0,
            published: HashMap::new(),
        }
    }

    /// Forget every cached block (another node may have changed them). Only clean copies are
    /// cached; the running transaction is empty whenever this node did not hold the lock.
    pub fn drop_cache(&mut self) {
        debug_assert!(
            self.pending.is_empty(),
            "dropping the cache with pending metadata"
        );
        self.cache.clear();
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty() || self.alloc.has_quarantine()
    }

    /// Make the running compound transaction durable (see the module docs).
    pub fn commit_point(&mut self, dev: &dyn BlockDevice) -> Result<()> {
        if self.failed {
            return Err(Error::new(
                ErrorKind::Io,
                "an earlier metadata commit failed; remount the volume",
            ));
        }
        let r = self.commit_point_inner(dev);
        if r.is_err() {
            self.failed = true;
        }
        r
    }

    fn commit_point_inner(&mut self, dev: &dyn BlockDevice) -> Result<()> {
        dev.flush()?;
        if self.pending.is_empty() {
            self.alloc.release_quarantine();
            return Ok(());
        }
        crate::failpoint!("commit::before_journal");
        let blocks: Vec<(u64, &[u8])> = self
            .pending
            .iter()
            .map(|(b, d)| (*b, d.as_slice()))
            .collect();
        journal::write_tx(dev, self.journal, self.next_seq, &blocks)?;
        crate::failpoint!("commit::before_journal_flush");
        dev.flush()?;
        crate::failpoint!("commit::before_home");
        self.next_seq += 1;
        let pending = std::mem::take(&mut self.pending);
        let mut run: Vec<(u64, &Vec<u8>)> = Vec::new();
        for (b, data) in &pending {
            if run.last().is_some_and(|(pb, _)| pb + 1 != *b) || run.len() >= 256 {
                write_run(dev, &run)?;
                run.clear();
            }
            run.push((*b, data));
        }
        write_run(dev, &run)?;
        if self.cache.len() + pending.len() >= CACHE_LIMIT {
            self.cache.clear();
        }
        self.cache.extend(pending);
        self.alloc.release_quarantine();
        Ok(())
    }

    /// Everything durable and home: leave an empty journal behind (clean unmount).
    pub fn close(&mut self, dev: &dyn BlockDevice) -> Result<()> {
        self.commit_point(dev)?;
        dev.flush()?;
        journal::invalidate(dev, self.journal)
    }

    pub fn is_failed(&self) -> bool {
        self.failed
    }

    pub fn journal(&self) -> JournalArea {
        self.journal
    }
}

#[derive(Debug)]
pub(crate) struct Tx<'a> {
    pub dev: &'a dyn BlockDevice,
    pub meta: &'a mut Meta,
    dirty: BTreeMap<u64, Vec<u8>>,
}

impl<'a> Tx<'a> {
    pub fn new(dev: &'a dyn BlockDevice, meta: &'a mut Meta) -> Self {
        Self {
            dev,
            meta,
            dirty: BTreeMap::new(),
        }
    }

    /// Read a metadata block: this transaction's copy, the running compound transaction's,
    /// the cache, else the device.
    pub fn read(&mut self, block: u64) -> Result<Vec<u8>> {
        if let Some(b) = self
            .dirty
            .get(&block)
            .or_else(|| self.meta.pending.get(&block))
        {
            return Ok(b.clone());
        }
        if let Some(b) = self.meta.cache.get(&block) {
            return Ok(b.clone());
        }
        let mut buf = AlignedBuf::new(crate::format::FS_BLOCK_SIZE);
        self.dev.read_at(block * FS_BLOCK, &mut buf)?;
        let v = buf.to_vec();
        if self.meta.cache.len() >= CACHE_LIMIT {
            self.meta.cache.clear();
        }
        self.meta.cache.insert(block, v.clone());
        Ok(v)
    }

    /// The sequence number a new metadata object placed in `block` must start above: the one
    /// of whatever metadata the block held before, so journal replay (which only moves blocks
    /// forward in sequence) never prefers an old image over the new object.
    pub fn prior_seq(&mut self, block: u64) -> Result<u64> {
        let raw = self.read(block)?;
        Ok(BlockHeader::decode(&raw).map_or(0, |h| h.seq))
    }

    /// This node's slot header (orphan list).
    pub fn slot_header(&mut self) -> Result<crate::format::slot_header::SlotHeader> {
        self.slot_header_of(self.meta.slot)
    }

    pub fn put_slot_header(&mut self, h: crate::format::slot_header::SlotHeader) {
        self.put_slot_header_of(self.meta.slot, h);
    }

    fn slot_header_at(&self, slot: u32) -> u64 {
        // Every slot's journal has the same size; ours is at `journal().start`.
        let j = self.meta.journal();
        (j.start - u64::from(self.meta.slot) * j.blocks) + u64::from(slot) * j.blocks
    }

    /// Any slot's header (recovery of a dead node's orphans).
    pub fn slot_header_of(&mut self, slot: u32) -> Result<crate::format::slot_header::SlotHeader> {
        let at = self.slot_header_at(slot);
        let raw = self.read(at)?;
        crate::format::slot_header::SlotHeader::decode(&raw, at, slot)
    }

    pub fn put_slot_header_of(&mut self, slot: u32, mut h: crate::format::slot_header::SlotHeader) {
        h.seq += 1;
        let at = self.slot_header_at(slot);
        self.write(at, h.encode(at));
    }

    pub fn write(&mut self, block: u64, data: Vec<u8>) {
        self.dirty.insert(block, data);
    }

    /// A block that was freed must not be written later in this transaction.
    pub fn forget(&mut self, block: u64) {
        self.dirty.remove(&block);
        self.meta.pending.remove(&block);
        self.meta.cache.remove(&block);
    }

    /// Fold this operation's changes into the running compound transaction.
    pub fn commit(mut self) -> Result<()> {
        if self.meta.failed {
            return Err(Error::new(
                ErrorKind::Io,
                "an earlier metadata commit failed; remount the volume",
            ));
        }
        for (b, data) in self.meta.alloc.take_dirty() {
            self.dirty.insert(b, data);
        }
        let dirty = std::mem::take(&mut self.dirty);
        self.meta.pending.extend(dirty);
        // Keep one transaction well inside the journal so a single large operation still fits.
        if self.meta.pending.len() > self.meta.journal.capacity() / 2 {
            self.meta.commit_point(self.dev)?;
        }
        Ok(())
    }
}

fn write_run(dev: &dyn BlockDevice, run: &[(u64, &Vec<u8>)]) -> Result<()> {
    let Some((first, _)) = run.first() else {
        return Ok(());
    };
    let mut buf = AlignedBuf::new(run.len() * crate::format::FS_BLOCK_SIZE);
    for (i, (_, d)) in run.iter().enumerate() {
        buf[i * crate::format::FS_BLOCK_SIZE..(i + 1) * crate::format::FS_BLOCK_SIZE]
            .copy_from_slice(d);
    }
    dev.write_at(first * FS_BLOCK, &buf)
}
