//! B+tree over 4 KiB [`TreeNode`] blocks, keyed by u64 with variable-length values: extent
//! trees (key = file block) and directories (key = name hash) share it.
//!
//! The root block never moves (the inode points at it): when the root splits, its contents
//! move into two new children and it becomes their parent. Internal entry keys are lower
//! bounds of their subtree (entry 0 covers everything below entry 1). Deletion frees empty
//! nodes but does not rebalance; lookups stay O(height) and height only grows on inserts.
//!
//! Changed nodes stay decoded in the running transaction until its commit point
//! ([`Tx::put_node`]): a change takes the node out of it ([`Tx::take_node`]), or decodes its
//! block if it is not there, and always puts it back, on error paths too (a node taken and not
//! put back would be missing from the transaction). So a leaf that a VM's first writes or a
//! directory's creates change a thousand times between two commit points is decoded once and
//! encoded once, not a thousand times (that was most of the CPU of an allocating write).
//! A block is allocated before any node's entries are moved into it, so a failed allocation
//! leaves every node as it was.

use super::txn::Tx;
use crate::error::{Error, Result};
use crate::format::block::check_owner;
use crate::format::layout::PointerKind;
use crate::format::tree_node::{
    NodeEntries, TreeNode, INTERNAL_ENTRY, LEAF_ENTRY_OVERHEAD, MAX_VALUE, NODE_CAP,
};

#[derive(Debug)]
pub(crate) struct Tree<'t, 'a> {
    pub tx: &'t mut Tx<'a>,
    pub root: u64,
    pub owner: u64,
    /// Nodes allocated minus nodes freed by this handle (for the inode's block count).
    pub delta: i64,
    /// Blocks allocated for the splits of the insert in progress ([`Tree::insert`]).
    spare: Vec<TreeNode>,
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
            spare: Vec::new(),
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
        tx.put_node(n);
        Ok(b)
    }

    /// A copy of node `b`, to read. Every node is reached through a pointer from disk (the
    /// inode's root, a parent's child entry): it must name a data block (format/layout.rs) and
    /// the node must be this tree's.
    fn read(&mut self, b: u64) -> Result<TreeNode> {
        self.tx
            .sb()
            .check_data_block(b, PointerKind::TreeNode, self.owner)?;
        let n = match self.tx.node_copy(b) {
            Some(n) => n,
            None => TreeNode::decode(&self.tx.read(b)?, b)?,
        };
        check_owner("tree node", b, n.owner, self.owner)?;
        Ok(n)
    }

    /// Node `b`, to change (checked as [`Tree::read`] does), and whether it was taken out of
    /// the transaction's decoded nodes: then the caller must give it back ([`Tree::write`] if
    /// changed, [`Tree::untouched`] if not) on every path, errors included.
    fn take(&mut self, b: u64) -> Result<(TreeNode, bool)> {
        self.tx
            .sb()
            .check_data_block(b, PointerKind::TreeNode, self.owner)?;
        let (n, moved) = match self.tx.take_node(b) {
            Some(n) => (n, true),
            None => (TreeNode::decode(&self.tx.read(b)?, b)?, false),
        };
        if let Err(e) = check_owner("tree node", b, n.owner, self.owner) {
            self.untouched(n, moved);
            return Err(e);
        }
        Ok((n, moved))
    }

    /// Give back a node [`Tree::take`] returned without changing it: only a node taken out of
    /// the transaction goes back (one decoded from its encoded image leaves that image as it
    /// was).
    fn untouched(&mut self, n: TreeNode, moved: bool) {
        if moved {
            self.tx.put_node(n);
        }
    }

    fn write(&mut self, mut n: TreeNode) {
        n.seq += 1;
        self.tx.put_node(n);
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
        // Every block a split needs is allocated before anything changes, so a failed
        // allocation (a full volume) leaves the tree as it was.
        let need = self.splits_needed(key, value.len())?;
        debug_assert!(self.spare.is_empty());
        for _ in 0..need {
            match self.alloc_node(0, NodeEntries::Leaf(Vec::new())) {
                Ok(n) => self.spare.push(n),
                Err(e) => {
                    for n in std::mem::take(&mut self.spare) {
                        self.free_node(n.blockno)?;
                    }
                    return Err(e);
                }
            }
        }
        let r = self.insert_in(self.root, key, value, 0).map(|_| ());
        debug_assert!(
            r.is_err() || self.spare.is_empty(),
            "split blocks left over"
        );
        for n in std::mem::take(&mut self.spare) {
            self.free_node(n.blockno)?;
        }
        r
    }

    /// How many new nodes inserting `key` with a value of `len` bytes takes: one per node on
    /// the path that splits (the leaf if it overflows, then each full parent up the path),
    /// plus one when the root splits (both its halves move into new children). Every node on
    /// the path is written by the insert anyway, so looking at them here costs no I/O more.
    fn splits_needed(&mut self, key: u64, len: usize) -> Result<usize> {
        let mut full_above: Vec<bool> = Vec::new();
        let mut b = self.root;
        for _ in 0..=crate::format::tree_node::MAX_LEVEL {
            // Put back decoded: the insert that follows writes every node of the path anyway.
            let (n, _) = self.take(b)?;
            let used = n.used_bytes();
            let next = match &n.entries {
                NodeEntries::Leaf(v) => {
                    let after = match v.binary_search_by_key(&key, |(k, _)| *k) {
                        Ok(i) => used - v[i].1.len() + len,
                        Err(_) => used + LEAF_ENTRY_OVERHEAD + len,
                    };
                    self.tx.put_node(n);
                    if after <= NODE_CAP {
                        return Ok(0);
                    }
                    let splits = 1 + full_above.iter().rev().take_while(|f| **f).count();
                    let root_splits = splits > full_above.len();
                    return Ok(splits + usize::from(root_splits));
                }
                NodeEntries::Internal(v) if !v.is_empty() => v[child_index(v, key)].1,
                NodeEntries::Internal(_) => {
                    self.tx.put_node(n);
                    return Err(Error::corrupted(format!("empty internal tree node {b}")));
                }
            };
            full_above.push(used + INTERNAL_ENTRY > NODE_CAP);
            self.tx.put_node(n);
            b = next;
        }
        Err(Error::corrupted(format!(
            "tree of inode {} is deeper than possible",
            self.owner
        )))
    }

    /// Returns Some((first key of new right sibling, its block)) if the node split. The root
    /// never does: its contents move into two new children and it becomes their parent.
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
        let (mut n, _) = self.take(b)?;
        // Written even on error: the insert changes nothing before its allocations are done,
        // so a node is changed or as it was, and writing it costs a block image at most.
        let r = self.insert_into(&mut n, key, value, depth);
        self.write(n);
        r
    }

    /// [`Tree::insert_in`] on the taken node `n` (its caller gives it back whatever happens).
    fn insert_into(
        &mut self,
        n: &mut TreeNode,
        key: u64,
        value: &[u8],
        depth: u16,
    ) -> Result<Option<(u64, u64)>> {
        let b = n.blockno;
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
            return Ok(None);
        }
        let mut right = self.split_node(n.level)?;
        right.entries = split_off_half(&mut n.entries);
        let sep = first_key(&right).unwrap_or(0);
        if b != self.root {
            let rb = right.blockno;
            self.write(right);
            return Ok(Some((sep, rb)));
        }
        let mut left = self.split_node(n.level)?;
        left.entries = std::mem::replace(&mut n.entries, NodeEntries::Internal(Vec::new()));
        let left_key = first_key(&left).unwrap_or(0);
        n.entries = NodeEntries::Internal(vec![
            (left_key.min(sep), left.blockno),
            (sep, right.blockno),
        ]);
        n.level += 1;
        self.write(left);
        self.write(right);
        Ok(None)
    }

    /// A node for a split, from the blocks [`Tree::insert`] allocated beforehand.
    fn split_node(&mut self, level: u16) -> Result<TreeNode> {
        let mut n = if let Some(n) = self.spare.pop() {
            n
        } else {
            debug_assert!(false, "a split that splits_needed did not count");
            self.alloc_node(level, NodeEntries::Leaf(Vec::new()))?
        };
        n.level = level;
        Ok(n)
    }

    /// Remove a key; returns its value if it was present.
    pub fn remove(&mut self, key: u64) -> Result<Option<Vec<u8>>> {
        let (old, _empty) = self.remove_in(self.root, key, true, 0)?;
        Ok(old)
    }

    /// Returns the removed value and whether the (non-root) node became empty and was freed.
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
        let (mut n, moved) = self.take(b)?;
        let (old, changed) = match self.remove_from(&mut n, key, depth) {
            Ok(r) => r,
            Err(e) => {
                self.untouched(n, moved);
                return Err(e);
            }
        };
        if !changed {
            self.untouched(n, moved);
            return Ok((old, false));
        }
        if n.is_empty() && !is_root {
            // Its image left the transaction with the take; freeing it drops any other copy.
            // A free that fails (its bitmap cannot be loaded, or a group another node marked
            // stays marked) leaks the node instead: the key is gone either way, and a remove
            // that failed after it would leave its caller half a change (a rename: the file
            // under two names). fsck reports the leaked block.
            if let Err(e) = self.free_node(b) {
                tracing::warn!(
                    "tree of inode {}: emptied node {b} not freed (fsck.cetra will report it): {e}",
                    self.owner
                );
            }
            return Ok((old, true));
        }
        if n.is_empty() && is_root {
            n.level = 0;
            n.entries = NodeEntries::Leaf(Vec::new());
        }
        self.write(n);
        Ok((old, false))
    }

    /// [`Tree::remove_in`] on the taken node `n`: the removed value, and whether `n` changed.
    fn remove_from(
        &mut self,
        n: &mut TreeNode,
        key: u64,
        depth: u16,
    ) -> Result<(Option<Vec<u8>>, bool)> {
        match &mut n.entries {
            NodeEntries::Leaf(v) => match v.binary_search_by_key(&key, |(k, _)| *k) {
                Ok(i) => Ok((Some(v.remove(i).1), true)),
                Err(_) => Ok((None, false)),
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
                Ok((old, true))
            }
        }
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

    /// Every node of the tree (what [`Tree::destroy`] frees), read as `destroy` reads them.
    pub fn node_blocks(&mut self) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        self.node_blocks_in(self.root, 0, &mut out)?;
        Ok(out)
    }

    fn node_blocks_in(&mut self, b: u64, depth: u16, out: &mut Vec<u64>) -> Result<()> {
        if depth > crate::format::tree_node::MAX_LEVEL {
            return Err(Error::corrupted(format!(
                "tree of inode {} is deeper than possible",
                self.owner
            )));
        }
        if let NodeEntries::Internal(v) = self.read(b)?.entries {
            for (_, c) in v {
                self.node_blocks_in(c, depth + 1, out)?;
            }
        }
        out.push(b);
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

    fn volume() -> (std::sync::Arc<crate::dev::mem::MemDevice>, Meta) {
        let dev = std::sync::Arc::new(crate::dev::mem::MemDevice::new(256 << 20, 512));
        let opts = crate::mkfs::MkfsOptions {
            max_nodes: 2,
            journal_bytes: 1 << 20,
            ..Default::default()
        };
        let sb = crate::mkfs::format(&*dev, &opts, &mut |_, _| {}).unwrap();
        let meta = meta_on(&dev, sb);
        (dev, meta)
    }

    /// Slot 0's metadata context on `dev`: nothing cached, nothing pending.
    fn meta_on(
        dev: &std::sync::Arc<crate::dev::mem::MemDevice>,
        sb: crate::format::superblock::Superblock,
    ) -> Meta {
        Meta::new(
            crate::alloc::tests::load(&(dev.clone() as crate::dev::SharedDevice), &sb),
            crate::journal::JournalArea::for_slot(&sb, 0),
            sb,
            crate::fs::DEFAULT_META_CACHE,
        )
    }

    fn with_tree(f: impl FnOnce(&mut Tx<'_>)) {
        let (dev, mut meta) = volume();
        let mut tx = Tx::new(&*dev, &mut meta);
        f(&mut tx);
        tx.commit().unwrap();
    }

    /// Every entry of the tree rooted at `root`, read from the device alone (a fresh Meta
    /// without cache or transaction): what the commit points wrote home.
    fn on_disk(
        dev: &std::sync::Arc<crate::dev::mem::MemDevice>,
        root: u64,
        owner: u64,
    ) -> Vec<(u64, Vec<u8>)> {
        let mut fresh = meta_on(dev, crate::fs::read_superblock(&**dev).unwrap());
        let mut tx = Tx::new(&**dev, &mut fresh);
        let mut out = Vec::new();
        Tree::new(&mut tx, root, owner)
            .scan_from(0, &mut |k, v| {
                out.push((k, v.to_vec()));
                Ok(true)
            })
            .unwrap();
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]
        /// Nodes kept decoded across operations and commit points (the running transaction's
        /// `nodes`): after every few operations a commit point encodes them and writes them
        /// home, and what is home is the model.
        #[test]
        fn decoded_nodes_survive_commit_points(ops in proptest::collection::vec((0u64..4000, 0usize..200, 0u8..5), 1..1200), every in 1usize..300) {
            let (dev, mut meta) = volume();
            let root = {
                let mut tx = Tx::new(&*dev, &mut meta);
                let r = Tree::create(&mut tx, 77).unwrap();
                tx.commit().unwrap();
                r
            };
            let mut model = BTreeMap::new();
            for chunk in ops.chunks(every) {
                let mut tx = Tx::new(&*dev, &mut meta);
                let mut t = Tree::new(&mut tx, root, 77);
                for &(k, len, op) in chunk {
                    if op == 0 {
                        prop_assert_eq!(t.remove(k).unwrap(), model.remove(&k));
                    } else {
                        let v = vec![u8::try_from(k % 251).unwrap(); len];
                        t.insert(k, &v).unwrap();
                        model.insert(k, v);
                    }
                }
                tx.commit().unwrap();
                if chunk.len() % 2 == 0 {
                    meta.commit_point(&*dev).unwrap();
                }
            }
            meta.commit_point(&*dev).unwrap();
            let expect: Vec<_> = model.into_iter().collect();
            prop_assert_eq!(on_disk(&dev, root, 77), expect);
        }
    }

    /// A split on a full volume fails before it changes anything: the tree keeps every entry
    /// (none half-moved into a node that no parent points at), and the same insert succeeds
    /// once there is room.
    #[test]
    fn a_split_without_space_changes_nothing() {
        let (dev, mut meta) = volume();
        let big = |k: u64| vec![u8::try_from(k).unwrap(); MAX_VALUE];
        let mut tx = Tx::new(&*dev, &mut meta);
        let root = Tree::create(&mut tx, 9).unwrap();
        let mut t = Tree::new(&mut tx, root, 9);
        for k in 1..=4 {
            t.insert(k, &big(k)).unwrap();
        }
        // Take every free block, then give one back: a root split needs two.
        let mut taken = Vec::new();
        while let Ok(b) = tx.alloc_one(0) {
            taken.push(b);
        }
        let spare = taken.pop().unwrap();
        tx.free_one(spare).unwrap();
        tx.commit().unwrap();
        meta.commit_point(&*dev).unwrap();

        let mut tx = Tx::new(&*dev, &mut meta);
        let mut t = Tree::new(&mut tx, root, 9);
        let e = t.insert(5, &big(5)).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::NoSpace, "{e}");
        for k in 1..=4 {
            assert_eq!(t.get(k).unwrap(), Some(big(k)));
        }
        assert_eq!(t.get(5).unwrap(), None);
        let freed = taken.pop().unwrap();
        tx.free_one(freed).unwrap();
        tx.commit().unwrap();
        meta.commit_point(&*dev).unwrap();
        // Both blocks free again (the one the failed insert took and gave back included).
        let mut tx = Tx::new(&*dev, &mut meta);
        let mut t = Tree::new(&mut tx, root, 9);
        t.insert(5, &big(5)).unwrap();
        tx.commit().unwrap();
        meta.commit_point(&*dev).unwrap();
        let expect: Vec<_> = (1..=5).map(|k| (k, big(k))).collect();
        assert_eq!(on_disk(&dev, root, 9), expect);
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
