//! Read-only views of one file straight from the LUN, for `cetra extents`: what the volume
//! says as of its last commit point (the caller fsyncs the file first to make that now), on a
//! mounted or unmounted volume, without the filesystem. Every block is checked as the mount
//! checks it (the inode's own number, a tree node's owner, a bounded depth), so a damaged file
//! gives an error, never a panic or a loop.

use crate::dev::{read_aligned, BlockDevice};
use crate::error::{Error, Result};
use crate::format::extent::Extent;
use crate::format::inode::{flags, Inode};
use crate::format::superblock::Superblock;
use crate::format::tree_node::{NodeEntries, TreeNode, MAX_LEVEL};
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};

/// A file's inode and its extents in file order.
#[derive(Debug, Clone)]
pub struct FileMap {
    pub inode: Inode,
    pub extents: Vec<Extent>,
    /// Tree nodes holding the map (0 when the extents are inline in the inode).
    pub tree_nodes: u64,
}

fn read_block(dev: &dyn BlockDevice, b: u64) -> Result<Vec<u8>> {
    Ok(read_aligned(dev, b * FS_BLOCK, FS_BLOCK_SIZE)?.to_vec())
}

/// The extent map of inode `ino` (a regular file).
pub fn file_map(dev: &dyn BlockDevice, sb: &Superblock, ino: u64) -> Result<FileMap> {
    if !sb.is_data_block(ino) {
        return Err(Error::corrupted(format!(
            "{ino} is not an inode number of this volume"
        )));
    }
    let inode = Inode::decode(&read_block(dev, ino)?, ino)?;
    if !inode.is_reg() {
        return Err(Error::new(
            crate::error::ErrorKind::InvalidInput,
            format!("inode {ino} is not a regular file"),
        ));
    }
    let mut extents = Vec::new();
    let mut tree_nodes = 0;
    if inode.flags & flags::INLINE_EXTENTS != 0 {
        extents.clone_from(&inode.inline_extents);
    } else if inode.tree_root != 0 {
        let (nodes, leaves) = tree(dev, sb, ino, inode.tree_root)?;
        tree_nodes = nodes.len() as u64;
        for (k, val) in leaves {
            extents.push(Extent::decode_value(k, &val)?);
        }
    }
    extents.sort_by_key(|e| e.logical);
    Ok(FileMap {
        inode,
        extents,
        tree_nodes,
    })
}

/// A tree leaf entry: key, value.
pub type Leaf = (u64, Vec<u8>);

/// The nodes and the leaf entries of inode `ino`'s tree rooted at `root` (an extent map or a
/// directory), each node checked to be a block of the volume, owned by `ino`, at its level,
/// and linked once.
pub fn tree(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    ino: u64,
    root: u64,
) -> Result<(Vec<u64>, Vec<Leaf>)> {
    let mut nodes = Vec::new();
    let mut leaves = Vec::new();
    let mut stack = vec![(root, None::<u16>)];
    let mut seen = std::collections::HashSet::new();
    while let Some((b, level)) = stack.pop() {
        if !sb.is_data_block(b) || !seen.insert(b) {
            return Err(Error::corrupted(format!(
                "inode {ino}: tree node {b} is not a block of this volume, or linked twice"
            )));
        }
        nodes.push(b);
        let node = TreeNode::decode(&read_block(dev, b)?, b)?;
        if node.owner != ino || level.is_some_and(|l| l != node.level) || node.level > MAX_LEVEL {
            return Err(Error::corrupted(format!(
                "inode {ino}: tree node {b} does not belong where it is linked"
            )));
        }
        match node.entries {
            NodeEntries::Leaf(v) => leaves.extend(v),
            NodeEntries::Internal(v) => {
                let below = node.level.checked_sub(1);
                for (_, child) in v.into_iter().rev() {
                    stack.push((child, below));
                }
            }
        }
    }
    Ok((nodes, leaves))
}
