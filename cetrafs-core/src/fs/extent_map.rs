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
use std::collections::BTreeMap;

#[derive(Debug, Default, Clone)]
pub(crate) struct ExtentMap {
    map: BTreeMap<u64, Extent>,
    /// Keys changed since the last [`ExtentMap::persist`], each with whether it was a key of
    /// the map then (so at home: a key the tree has, which a change replaces in place).
    changed: BTreeMap<u64, bool>,
    /// Tree nodes a failed persist added to the tree (splits its undo left), for the next
    /// persist to count in the inode's blocks.
    delta_pending: i64,
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
            changed: BTreeMap::new(),
            delta_pending: 0,
        })
    }

    /// Put `old` back in place of this map (a change undone in memory after a failed save),
    /// keeping the count of tree nodes this map's failed persist left in the tree.
    pub fn restore(&mut self, old: Self) {
        let pending = self.delta_pending;
        *self = old;
        self.delta_pending += pending;
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
            + super::heap::btree::<u64, bool>(self.changed.len())
    }

    /// The physical block right after the mapping that precedes file block `b` (allocation goal).
    pub fn goal_for(&self, b: u64) -> Option<u64> {
        self.map
            .range(..b)
            .next_back()
            .map(|(_, e)| e.physical + (b - e.logical).min(u64::from(e.len)))
    }

    fn put(&mut self, e: Extent) {
        self.note_change(e.logical);
        self.map.insert(e.logical, e);
    }

    fn del(&mut self, logical: u64) {
        self.note_change(logical);
        self.map.remove(&logical);
    }

    /// Before key `k` changes: remember whether it was at home (its first change since the
    /// last persist decides).
    fn note_change(&mut self, k: u64) {
        let at_home = self.map.contains_key(&k);
        self.changed.entry(k).or_insert(at_home);
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
    /// tree-node blocks held by the inode. An error leaves the tree at home mapping what it
    /// mapped (at worst new tree blocks leaked), or has failed the node (`Tx::fail_node`).
    /// The inode is changed in memory only, for its caller to write.
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
            // Keys new to the tree first: only they can split a node. Their inserts are all
            // or nothing: one that finds no space for its split changes nothing, and the new
            // keys inserted before it are removed again. Then the keys replaced in place (same
            // size: no split) and the removals. So a full volume fails the save with the tree
            // as it was — a punch in the middle of an extent used to shorten its head first,
            // and a failed insert of its tail left the tail unmapped at home; a write into the
            // middle of an unwritten extent adds two keys, and the first alone would map its
            // blocks twice. (`changed` stays, and the next save applies every key again.)
            let mut t = Tree::new(tx, inode.tree_root, inode.ino);
            let (mut added, mut replaced, mut removed) = (Vec::new(), Vec::new(), Vec::new());
            for (&k, &at_home) in &self.changed {
                match self.map.get(&k) {
                    Some(e) if at_home => replaced.push((k, e.encode_value())),
                    Some(e) => added.push((k, e.encode_value())),
                    None if at_home => removed.push(k),
                    // Made and dropped again since the last persist (a merge): not at home.
                    None => {}
                }
            }
            for (i, (k, v)) in added.iter().enumerate() {
                if let Err(e) = t.insert(*k, v) {
                    for (k, _) in &added[..i] {
                        if let Err(undo) = t.remove(*k) {
                            // The node read a moment ago cannot be read again: the tree maps
                            // some blocks twice in this transaction. Nothing more may reach
                            // the LUN.
                            t.tx.fail_node(&undo, "undoing an extent tree's new keys");
                            return Err(undo);
                        }
                    }
                    // Nodes the inserts split stay in the tree: counted at the next persist.
                    self.delta_pending += t.delta;
                    return Err(e);
                }
            }
            // These change keys the tree has and allocate nothing: only a node that cannot be
            // read fails them, half-way through the change. Nothing more may reach the LUN.
            let rest = replaced
                .into_iter()
                .try_for_each(|(k, v)| t.insert(k, &v))
                .and_then(|()| removed.into_iter().try_for_each(|k| t.remove(k).map(drop)));
            if let Err(e) = rest {
                t.tx.fail_node(&e, "an extent tree's save");
                return Err(e);
            }
            if self.map.is_empty() {
                // The keys are gone already: a node that cannot be freed is leaked (fsck
                // reports it), rather than failing a change that is half made.
                if let Err(e) = t.destroy() {
                    tracing::warn!(
                        "inode {}: nodes of its emptied extent tree not freed (fsck.cetra will report them): {e}",
                        inode.ino
                    );
                }
                inode.tree_root = 0;
                inode.flags |= flags::INLINE_EXTENTS;
                inode.inline_extents.clear();
            }
            delta += t.delta;
        }
        self.changed.clear();
        Ok(delta + std::mem::take(&mut self.delta_pending))
    }
}
