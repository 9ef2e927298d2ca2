//! B+tree over 4 KiB [`TreeNode`] blocks, keyed by u64 with variable-length values: extent
//! trees (key = file block) and directories (key = name hash) share it.
//!
//! The root block never moves (the inode points at it): when the root splits, its contents
//! move into two new children and it becomes their parent. Internal entry keys are lower
//! bounds of their subtree (entry 0 covers everything below entry 1). Deletion frees empty
//! nodes but does not rebalance; lookups stay O(height) and height only grows on inserts.

use super::txn::Tx;
use crate::error::{Error, Result};
use crate::format::block::check_owner;
use crate::format::layout::PointerKind;
use crate::format::tree_node::{NodeEntries, TreeNode, MAX_VALUE, NODE_CAP};

#[derive(Debug)]
pub(crate) struct Tree<'t, 'a> {
    pub tx: &'t mut Tx<'a>,
    pub root: u64,
    pub owner: u64,
    /// Nodes allocated minus nodes freed by this handle (for the inode's block count).
    pub delta: i64,
}

/// Which child of an internal node covers `key`.
fn child_index(entries: &[(u64, u64)], key: u64) -> usize {
    entries
        .partition_point(|(k, _)| *k <= key)
        .saturating_sub(1)
}

impl<'t, 'a> Tree<'t, 'a> {
    pub fn new(tx: &'t mut Tx<'a>, root: u64, owner: u64) -> Self {
        Self {
            tx,
            root,
            owner,
            delta: 0,
        }
    }

    /// Create an empty tree: one empty leaf, returned as the new root block.
    pub fn create(tx: &mut Tx<'_>, owner: u64) -> Result<u64> {
        let b = tx.alloc_one(owner)?;
        let n = TreeNode {
            blockno: b,
            seq: tx.prior_seq(b)? + 1,
            owner,
            level: 0,
            entries: NodeEntries::Leaf(Vec::new()),
        };
        tx.write(b, n.encode());
        Ok(b)
    }

    /// Every node is reached through a pointer from disk (the inode's root, a parent's child
    /// entry): it must name a data block (format/layout.rs) and the node must be this tree's.
    fn read(&mut self, b: u64) -> Result<TreeNode> {
        self.tx
            .sb()
            .check_data_block(b, PointerKind::TreeNode, self.owner)?;
        let raw = self.tx.read(b)?;
        let n = TreeNode::decode(&raw, b)?;
        check_owner("tree node", b, n.owner, self.owner)?;
        Ok(n)
    }

    fn write(&mut self, mut n: TreeNode) {
        n.seq += 1;
        self.tx.write(n.blockno, n.encode());
    }

    fn alloc_node(&mut self, level: u16, entries: NodeEntries) -> Result<TreeNode> {
        let b = self.tx.alloc_one(self.root)?;
        self.delta += 1;
        let seq = self.tx.prior_seq(b)?;
        Ok(TreeNode {
            blockno: b,
            seq,
            owner: self.owner,
            level,
            entries,
        })
    }

    fn free_node(&mut self, b: u64) -> Result<()> {
        self.tx.free_one(b)?;
        self.delta -= 1;
        Ok(())
    }

    pub fn get(&mut self, key: u64) -> Result<Option<Vec<u8>>> {
        let mut b = self.root;
        for _ in 0..=crate::format::tree_node::MAX_LEVEL {
            let n = self.read(b)?;
            match n.entries {
                NodeEntries::Leaf(v) => {
                    return Ok(v
                        .binary_search_by_key(&key, |(k, _)| *k)
                        .ok()
                        .map(|i| v[i].1.clone()));
                }
                NodeEntries::Internal(v) if !v.is_empty() => b = v[child_index(&v, key)].1,
                NodeEntries::Internal(_) => return Ok(None),
            }
        }
        Err(Error::corrupted(format!(
            "tree of inode {} is deeper than possible",
            self.owner
        )))
    }

    /// The entry with the greatest key <= `key`.
    #[allow(dead_code)] // exercised by the tree tests; the fsck and defrag tools will use it
    pub fn seek_le(&mut self, key: u64) -> Result<Option<(u64, Vec<u8>)>> {
        self.seek_le_in(self.root, key, 0)
    }

    #[allow(dead_code)]
    fn seek_le_in(&mut self, b: u64, key: u64, depth: u16) -> Result<Option<(u64, Vec<u8>)>> {
        if depth > crate::format::tree_node::MAX_LEVEL {
            return Err(Error::corrupted(format!(
                "tree of inode {} is deeper than possible",
                self.owner
            )));
        }
        let n = self.read(b)?;
        match n.entries {
            NodeEntries::Leaf(v) => {
                let i = v.partition_point(|(k, _)| *k <= key);
                Ok(i.checked_sub(1).map(|i| v[i].clone()))
            }
            NodeEntries::Internal(v) => {
                if v.is_empty() {
                    return Ok(None);
                }
                // Entry keys are lower bounds, so the answer may sit in an earlier subtree.
                let mut i = child_index(&v, key);
                loop {
                    if let Some(found) = self.seek_le_in(v[i].1, key, depth + 1)? {
                        return Ok(Some(found));
                    }
                    if i == 0 {
                        return Ok(None);
                    }
                    i -= 1;
                }
            }
        }
    }

    /// Visit entries with key >= `start` in order until `f` returns false.
    pub fn scan_from(
        &mut self,
        start: u64,
        f: &mut dyn FnMut(u64, &[u8]) -> Result<bool>,
    ) -> Result<()> {
        self.scan_in(self.root, start, f, 0).map(|_| ())
    }

    fn scan_in(
        &mut self,
        b: u64,
        start: u64,
        f: &mut dyn FnMut(u64, &[u8]) -> Result<bool>,
        depth: u16,
    ) -> Result<bool> {
        if depth > crate::format::tree_node::MAX_LEVEL {
            return Err(Error::corrupted(format!(
                "tree of inode {} is deeper than possible",
                self.owner
            )));
        }
        let n = self.read(b)?;
        match n.entries {
            NodeEntries::Leaf(v) => {
                for (k, val) in v.iter().filter(|(k, _)| *k >= start) {
                    if !f(*k, val)? {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
            NodeEntries::Internal(v) => {
                let first = if v.is_empty() {
                    0
                } else {
                    child_index(&v, start)
                };
                for (_, child) in v.iter().skip(first) {
                    if !self.scan_in(*child, start, f, depth + 1)? {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
        }
    }

    /// Insert or replace.
    pub fn insert(&mut self, key: u64, value: &[u8]) -> Result<()> {
        if value.len() > MAX_VALUE {
            return Err(Error::new(
                crate::ErrorKind::NoSpace,
                "tree value too large",
            ));
        }
        if let Some((sep, right)) = self.insert_in(self.root, key, value, 0)? {
            // Root split: move the root's (left) contents into a new child, keep the block.
            let mut root = self.read(self.root)?;
            let left = self.alloc_node(
                root.level,
                std::mem::replace(&mut root.entries, NodeEntries::Internal(Vec::new())),
            )?;
            let left_key = first_key(&left).unwrap_or(0);
            root.entries =
                NodeEntries::Internal(vec![(left_key.min(sep), left.blockno), (sep, right)]);
            root.level = left.level + 1;
            let lb = left.blockno;
            self.write(left);
            self.write(root);
            debug_assert_ne!(lb, right);
        }
        Ok(())
    }

    /// Returns Some((first key of new right sibling, its block)) if the node split.
    fn insert_in(
        &mut self,
        b: u64,
        key: u64,
        value: &[u8],
        depth: u16,
    ) -> Result<Option<(u64, u64)>> {
        if depth > crate::format::tree_node::MAX_LEVEL {
            return Err(Error::corrupted(format!(
                "tree of inode {} is deeper than possible",
                self.owner
            )));
        }
        let mut n = self.read(b)?;
        match &mut n.entries {
            NodeEntries::Leaf(v) => match v.binary_search_by_key(&key, |(k, _)| *k) {
                Ok(i) => v[i].1 = value.to_vec(),
                Err(i) => v.insert(i, (key, value.to_vec())),
            },
            NodeEntries::Internal(v) => {
                if v.is_empty() {
                    return Err(Error::corrupted(format!("empty internal tree node {b}")));
                }
                let i = child_index(v, key);
                if key < v[0].0 {
                    v[0].0 = key;
                }
                let child = v[i].1;
                if let Some((sep, right)) = self.insert_in(child, key, value, depth + 1)? {
                    let NodeEntries::Internal(v) = &mut n.entries else {
                        unreachable!()
                    };
                    v.insert(i + 1, (sep, right));
                }
            }
        }
        if n.used_bytes() <= NODE_CAP {
            self.write(n);
            return Ok(None);
        }
        let right_entries = split_off_half(&mut n.entries);
        let right = self.alloc_node(n.level, right_entries)?;
        let sep = first_key(&right).unwrap_or(0);
        let rb = right.blockno;
        self.write(right);
        self.write(n);
        Ok(Some((sep, rb)))
    }

    /// Remove a key; returns its value if it was present.
    pub fn remove(&mut self, key: u64) -> Result<Option<Vec<u8>>> {
        let (old, _empty) = self.remove_in(self.root, key, true, 0)?;
        Ok(old)
    }

    fn remove_in(
        &mut self,
        b: u64,
        key: u64,
        is_root: bool,
        depth: u16,
    ) -> Result<(Option<Vec<u8>>, bool)> {
        if depth > crate::format::tree_node::MAX_LEVEL {
            return Err(Error::corrupted(format!(
                "tree of inode {} is deeper than possible",
                self.owner
            )));
        }
        let mut n = self.read(b)?;
        let old = match &mut n.entries {
            NodeEntries::Leaf(v) => match v.binary_search_by_key(&key, |(k, _)| *k) {
                Ok(i) => Some(v.remove(i).1),
                Err(_) => return Ok((None, false)),
            },
            NodeEntries::Internal(v) => {
                if v.is_empty() {
                    return Ok((None, false));
                }
                let i = child_index(v, key);
                let child = v[i].1;
                let (old, child_empty) = self.remove_in(child, key, false, depth + 1)?;
                if !child_empty {
                    return Ok((old, false));
                }
                let NodeEntries::Internal(v) = &mut n.entries else {
                    unreachable!()
                };
                v.remove(i);
                old
            }
        };
        if n.is_empty() && !is_root {
            self.free_node(b)?;
            return Ok((old, true));
        }
        if n.is_empty() && is_root {
            n.level = 0;
            n.entries = NodeEntries::Leaf(Vec::new());
        }
        self.write(n);
        Ok((old, false))
    }

    /// Free every node including the root (the owner is going away).
    pub fn destroy(&mut self) -> Result<()> {
        self.destroy_in(self.root, 0)
    }

    fn destroy_in(&mut self, b: u64, depth: u16) -> Result<()> {
        if depth > crate::format::tree_node::MAX_LEVEL {
            return Err(Error::corrupted(format!(
                "tree of inode {} is deeper than possible",
                self.owner
            )));
        }
        let n = self.read(b)?;
        if let NodeEntries::Internal(v) = n.entries {
            for (_, c) in v {
                self.destroy_in(c, depth + 1)?;
            }
        }
        self.free_node(b)?;
        Ok(())
    }

    pub fn is_empty(&mut self) -> Result<bool> {
        Ok(self.read(self.root)?.is_empty())
    }
}

fn first_key(n: &TreeNode) -> Option<u64> {
    match &n.entries {
        NodeEntries::Leaf(v) => v.first().map(|e| e.0),
        NodeEntries::Internal(v) => v.first().map(|e| e.0),
    }
}

/// Split by bytes so both halves fit; the node keeps the left half.
fn split_off_half(entries: &mut NodeEntries) -> NodeEntries {
    match entries {
        NodeEntries::Leaf(v) => {
            let total: usize = v.iter().map(|(_, x)| x.len() + 10).sum();
            let mut acc = 0;
            let mut at = v.len() - 1;
            for (i, (_, x)) in v.iter().enumerate() {
                acc += x.len() + 10;
                if acc >= total / 2 {
                    at = (i + 1).min(v.len() - 1).max(1);
                    break;
                }
            }
            NodeEntries::Leaf(v.split_off(at))
        }
        NodeEntries::Internal(v) => {
            let at = v.len() / 2;
            NodeEntries::Internal(v.split_off(at))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::txn::Meta;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn with_tree(f: impl FnOnce(&mut Tx<'_>)) {
        let dev = std::sync::Arc::new(crate::dev::mem::MemDevice::new(256 << 20, 512));
        let opts = crate::mkfs::MkfsOptions {
            max_nodes: 2,
            journal_bytes: 1 << 20,
            ..Default::default()
        };
        let sb = crate::mkfs::format(&*dev, &opts, &mut |_, _| {}).unwrap();
        let mut meta = Meta::new(
            crate::alloc::tests::load(&(dev.clone() as crate::dev::SharedDevice), &sb),
            crate::journal::JournalArea::for_slot(&sb, 0),
            sb.clone(),
            crate::fs::DEFAULT_META_CACHE,
        );
        let mut tx = Tx::new(&*dev, &mut meta);
        f(&mut tx);
        tx.commit().unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn matches_btreemap(ops in proptest::collection::vec((0u64..3000, 0usize..120, 0u8..4), 1..1500)) {
            with_tree(|tx| {
                let root = Tree::create(tx, 77).unwrap();
                let mut t = Tree::new(tx, root, 77);
                let mut model = BTreeMap::new();
                for (k, len, op) in ops {
                    if op == 0 {
                        assert_eq!(t.remove(k).unwrap(), model.remove(&k));
                    } else {
                        let v = vec![(k % 251) as u8; len];
                        t.insert(k, &v).unwrap();
                        model.insert(k, v);
                    }
                }
                for k in (0..3000).step_by(7) {
                    assert_eq!(t.get(k).unwrap(), model.get(&k).cloned());
                    assert_eq!(t.seek_le(k).unwrap(), model.range(..=k).next_back().map(|(a, b)| (*a, b.clone())));
                }
                let mut seen = Vec::new();
                t.scan_from(1000, &mut |k, v| { seen.push((k, v.to_vec())); Ok(true) }).unwrap();
                let expect: Vec<_> = model.range(1000..).map(|(a, b)| (*a, b.clone())).collect();
                assert_eq!(seen, expect);
                let before = t.delta;
                t.destroy().unwrap();
                assert_eq!(t.delta, before - before - 1);
            });
        }
    }
}
