//! A file's extent map in memory (loaded whole when the inode is loaded: lookups on the data
//! path are a `BTreeMap` search, O(log n), with no I/O) plus the list of changed keys, which
//! [`ExtentMap::persist`] applies to the on-disk form: inline in the inode while it fits
//! (up to 160 extents), an extent B+tree beyond that.

use super::btree::Tree;
use super::txn::Tx;
use crate::error::Result;
use crate::format::extent::{Extent, EXTENT_UNWRITTEN, MAX_EXTENT_BLOCKS};
use crate::format::inode::{flags, Inode, INLINE_EXTENTS_MAX};
use crate::format::layout::PointerKind;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Default, Clone)]
pub(crate) struct ExtentMap {
    map: BTreeMap<u64, Extent>,
    changed: BTreeSet<u64>,
}

impl ExtentMap {
    /// Load the map of `inode`. Every extent's physical run is checked against the volume's
    /// layout here (format/layout.rs), once: the data path, truncate and free then use only
    /// runs inside the data area, without checking again.
    pub fn load(tx: &mut Tx<'_>, inode: &Inode) -> Result<Self> {
        let mut map = BTreeMap::new();
        if inode.flags & flags::INLINE_EXTENTS != 0 {
            for e in &inode.inline_extents {
                map.insert(e.logical, *e);
            }
        } else if inode.tree_root != 0 {
            let mut t = Tree::new(tx, inode.tree_root, inode.ino);
            t.scan_from(0, &mut |k, v| {
                map.insert(k, Extent::decode_value(k, v)?);
                Ok(true)
            })?;
        }
        for e in map.values() {
            tx.sb().check_data_range(
                e.physical,
                u64::from(e.len),
                PointerKind::Extent,
                inode.ino,
            )?;
        }
        Ok(Self {
            map,
            changed: BTreeSet::new(),
        })
    }

    /// The extent covering file block `b`.
    pub fn find(&self, b: u64) -> Option<Extent> {
        self.map
            .range(..=b)
            .next_back()
            .map(|(_, e)| *e)
            .filter(|e| e.end() > b)
    }

    /// The first extent ending after `b` (covering it or after it).
    pub fn next_from(&self, b: u64) -> Option<Extent> {
        self.find(b)
            .or_else(|| self.map.range(b..).next().map(|(_, e)| *e))
    }

    pub fn iter(&self) -> impl Iterator<Item = &Extent> {
        self.map.values()
    }

    /// Estimated heap memory of the map (for the inode table's budget; fs/heap.rs): whole
    /// B-tree nodes, even for one extent.
    pub fn heap_bytes(&self) -> usize {
        super::heap::btree::<u64, Extent>(self.map.len())
            + super::heap::btree::<u64, ()>(self.changed.len())
    }

    /// The physical block right after the mapping that precedes file block `b` (allocation goal).
    pub fn goal_for(&self, b: u64) -> Option<u64> {
        self.map
            .range(..b)
            .next_back()
            .map(|(_, e)| e.physical + (b - e.logical).min(u64::from(e.len)))
    }

    fn put(&mut self, e: Extent) {
        self.map.insert(e.logical, e);
        self.changed.insert(e.logical);
    }

    fn del(&mut self, logical: u64) {
        self.map.remove(&logical);
        self.changed.insert(logical);
    }

    /// Make `b` an extent boundary.
    fn split_at(&mut self, b: u64) {
        if let Some(e) = self.find(b) {
            if e.logical < b {
                let head = u32::try_from(b - e.logical).unwrap_or(u32::MAX);
                self.put(Extent { len: head, ..e });
                self.put(Extent {
                    logical: b,
                    physical: e.physical + u64::from(head),
                    len: e.len - head,
                    flags: e.flags,
                });
            }
        }
    }

    /// Remove the mapping of [start, end); returns the freed physical runs.
    pub fn punch(&mut self, start: u64, end: u64) -> Vec<(u64, u64)> {
        if start >= end {
            return Vec::new();
        }
        self.split_at(start);
        self.split_at(end);
        let keys: Vec<u64> = self.map.range(start..end).map(|(k, _)| *k).collect();
        let mut freed = Vec::new();
        for k in keys {
            let e = self.map[&k];
            freed.push((e.physical, u64::from(e.len)));
            self.del(k);
        }
        freed
    }

    /// Set or clear the unwritten flag over [start, end) where mapped.
    pub fn set_unwritten(&mut self, start: u64, end: u64, unwritten: bool) {
        self.split_at(start);
        self.split_at(end);
        let keys: Vec<u64> = self.map.range(start..end).map(|(k, _)| *k).collect();
        for k in &keys {
            let mut e = self.map[k];
            e.flags = if unwritten {
                e.flags | EXTENT_UNWRITTEN
            } else {
                e.flags & !EXTENT_UNWRITTEN
            };
            self.put(e);
        }
        self.merge_around(start, end);
    }

    /// Map [logical, logical+len) (must be unmapped) to physical.
    pub fn insert(&mut self, logical: u64, physical: u64, len: u64, unwritten: bool) {
        let mut l = logical;
        let mut p = physical;
        let mut left = len;
        while left > 0 {
            let n = left.min(u64::from(MAX_EXTENT_BLOCKS));
            let f = if unwritten { EXTENT_UNWRITTEN } else { 0 };
            self.put(Extent {
                logical: l,
                physical: p,
                len: u32::try_from(n).unwrap_or(MAX_EXTENT_BLOCKS),
                flags: f,
            });
            l += n;
            p += n;
            left -= n;
        }
        self.merge_around(logical, logical + len);
    }

    /// Merge neighbours that are contiguous in file and device space with equal flags.
    fn merge_around(&mut self, start: u64, end: u64) {
        let from = self
            .map
            .range(..start)
            .next_back()
            .map_or(start, |(k, _)| *k);
        let keys: Vec<u64> = self.map.range(from..=end).map(|(k, _)| *k).collect();
        let mut prev: Option<Extent> = None;
        for k in keys {
            let Some(e) = self.map.get(&k).copied() else {
                continue;
            };
            if let Some(p) = prev {
                if p.end() == e.logical
                    && p.physical + u64::from(p.len) == e.physical
                    && p.flags == e.flags
                    && u64::from(p.len) + u64::from(e.len) <= u64::from(MAX_EXTENT_BLOCKS)
                {
                    let m = Extent {
                        len: p.len + e.len,
                        ..p
                    };
                    self.del(e.logical);
                    self.put(m);
                    prev = Some(m);
                    continue;
                }
            }
            prev = Some(e);
        }
    }

    /// Write changes into the inode (inline) or its extent tree. Returns the change in
    /// tree-node blocks held by the inode.
    pub fn persist(&mut self, tx: &mut Tx<'_>, inode: &mut Inode) -> Result<i64> {
        let mut delta = 0;
        let inline = inode.flags & flags::INLINE_EXTENTS != 0 || inode.tree_root == 0;
        if inline && self.map.len() <= INLINE_EXTENTS_MAX {
            inode.flags |= flags::INLINE_EXTENTS;
            inode.inline_extents = self.map.values().copied().collect();
        } else if inline {
            // Outgrew the inode: build a tree from the whole map.
            let root = Tree::create(tx, inode.ino)?;
            delta += 1;
            let mut t = Tree::new(tx, root, inode.ino);
            for e in self.map.values() {
                t.insert(e.logical, &e.encode_value())?;
            }
            delta += t.delta;
            inode.flags &= !flags::INLINE_EXTENTS;
            inode.inline_extents.clear();
            inode.tree_root = root;
        } else {
            // Keys new to the tree first: only they can split a node, and an insert that
            // finds no space for its split changes nothing. Then the keys replaced in place
            // (same size: no split) and the removals. So a full volume fails the save before
            // any extent the tree maps was shortened or removed — a punch in the middle of an
            // extent used to shorten its head first, and a failed insert of its tail left the
            // tail unmapped at home. (`changed` stays, and the next save writes every key
            // again: an insert of a key already there replaces it.)
            let mut t = Tree::new(tx, inode.tree_root, inode.ino);
            let (mut replaced, mut removed) = (Vec::new(), Vec::new());
            for &k in &self.changed {
                match self.map.get(&k) {
                    Some(e) if t.get(k)?.is_none() => t.insert(k, &e.encode_value())?,
                    Some(e) => replaced.push((k, e.encode_value())),
                    None => removed.push(k),
                }
            }
            for (k, v) in replaced {
                t.insert(k, &v)?;
            }
            for k in removed {
                t.remove(k)?;
            }
            if self.map.is_empty() {
                t.destroy()?;
                inode.tree_root = 0;
                inode.flags |= flags::INLINE_EXTENTS;
                inode.inline_extents.clear();
            }
            delta += t.delta;
        }
        self.changed.clear();
        Ok(delta)
    }
}
