//! Metadata transactions: every metadata change of one operation is collected here as whole
//! encoded blocks, then written out together on commit. This is the seam the per-node journal
//! plugs into (commit to the journal, flush, then write home); today commit writes home
//! directly. Data blocks are always written *before* the transaction that makes them
//! reachable commits, so a reader never sees stale bytes through new metadata.

use crate::alloc::Allocator;
use crate::dev::{AlignedBuf, BlockDevice};
use crate::error::Result;
use crate::format::FS_BLOCK;
use std::collections::{BTreeMap, HashMap};

/// Cached metadata blocks. Unbounded growth is prevented by clearing when full; the cache is
/// an optimisation only (every entry equals what is on disk).
const CACHE_LIMIT: usize = 1 << 16;

#[derive(Debug)]
pub(crate) struct Meta {
    pub alloc: Allocator,
    cache: HashMap<u64, Vec<u8>>,
}

impl Meta {
    pub fn new(alloc: Allocator) -> Self {
        Self { alloc, cache: HashMap::new() }
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
        Self { dev, meta, dirty: BTreeMap::new() }
    }

    /// Read a metadata block: this transaction's copy, else the cache, else the device.
    pub fn read(&mut self, block: u64) -> Result<Vec<u8>> {
        if let Some(b) = self.dirty.get(&block) {
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

    pub fn write(&mut self, block: u64, data: Vec<u8>) {
        self.dirty.insert(block, data);
    }

    /// A block that was freed must not be written later in this transaction.
    pub fn forget(&mut self, block: u64) {
        self.dirty.remove(&block);
        self.meta.cache.remove(&block);
    }

    /// Write every changed block home, adjacent blocks in one I/O.
    pub fn commit(mut self) -> Result<()> {
        for (b, data) in self.meta.alloc.take_dirty() {
            self.dirty.insert(b, data);
        }
        let dirty = std::mem::take(&mut self.dirty);
        let mut run: Vec<(u64, &Vec<u8>)> = Vec::new();
        let mut result = Ok(());
        for (b, data) in &dirty {
            if run.last().is_some_and(|(pb, _)| pb + 1 != *b) || run.len() >= 256 {
                result = result.and(write_run(self.dev, &run));
                run.clear();
            }
            run.push((*b, data));
        }
        result = result.and(write_run(self.dev, &run));
        if self.meta.cache.len() + dirty.len() >= CACHE_LIMIT {
            self.meta.cache.clear();
        }
        match &result {
            Ok(()) => self.meta.cache.extend(dirty),
            // What reached the disk is unknown: drop the cached copies so they are re-read.
            Err(_) => dirty.keys().for_each(|b| {
                self.meta.cache.remove(b);
            }),
        }
        result
    }
}

fn write_run(dev: &dyn BlockDevice, run: &[(u64, &Vec<u8>)]) -> Result<()> {
    let Some((first, _)) = run.first() else { return Ok(()) };
    let mut buf = AlignedBuf::new(run.len() * crate::format::FS_BLOCK_SIZE);
    for (i, (_, d)) in run.iter().enumerate() {
        buf[i * crate::format::FS_BLOCK_SIZE..(i + 1) * crate::format::FS_BLOCK_SIZE].copy_from_slice(d);
    }
    dev.write_at(first * FS_BLOCK, &buf)
}
