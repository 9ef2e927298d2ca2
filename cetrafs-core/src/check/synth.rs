//! Synthetic populated volumes, written directly with the format codecs: directories (with
//! multi-level entry trees when asked), files with inline extents or extent trees, symlinks,
//! special files, hard links and xattr blocks. The checker's tests corrupt them, and the fuzz
//! target mutates them; neither needs the filesystem layer to exist or be correct.
//!
//! Everything is allocated sequentially in group 0 after the root inode.

use crate::dev::mem::MemDevice;
use crate::dev::{AlignedBuf, BlockDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::dirent::{encode_entries, name_hash, DirEntry};
use crate::format::extent::Extent;
use crate::format::group::{decode_bitmap, encode_bitmap, GroupHeader, BITS_PER_BITMAP_BLOCK};
use crate::format::inode::{flags, Inode, INLINE_CAP, INLINE_EXTENTS_MAX};
use crate::format::overflow::{Overflow, Role};
use crate::format::superblock::Superblock;
use crate::format::tree_node::{NodeEntries, TreeNode, NODE_CAP};
use crate::format::xattr::{self, Layout, XattrMap};
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};
use crate::fs::FileKind;
use crate::mkfs::{format, MkfsOptions};
use std::collections::{BTreeMap, BTreeSet};

/// Smallest device that holds one allocation group with the options used here.
pub const MIN_SYNTH_BYTES: u64 = 18 << 20;

#[derive(Debug)]
pub struct SynthVolume {
    dev: MemDevice,
    pub sb: Superblock,
    next: u64,
    inodes: BTreeMap<u64, Inode>,
    dirs: BTreeMap<u64, Vec<DirEntry>>,
    xattrs: BTreeMap<u64, XattrMap>,
    extent_trees: BTreeSet<u64>,
    /// Most entries per tree node; small values force multi-level trees.
    pub fanout: usize,
}

impl SynthVolume {
    /// Format a memory device of `size_bytes` (512-byte blocks) with one journal.
    pub fn new(size_bytes: u64) -> Result<Self> {
        let dev = MemDevice::new(size_bytes, 512);
        let opts = MkfsOptions {
            label: "synth".into(),
            max_nodes: 1,
            journal_bytes: 1 << 20,
            inode_lock_slots: 64,
            ..Default::default()
        };
        let sb = format(&dev, &opts, &mut |_, _| {})?;
        let root = Inode::decode(&read(&dev, sb.root_ino)?, sb.root_ino)?;
        let mut inodes = BTreeMap::new();
        let next = sb.root_ino + 1;
        inodes.insert(sb.root_ino, root);
        let mut dirs = BTreeMap::new();
        dirs.insert(sb.root_ino, Vec::new());
        Ok(Self {
            dev,
            sb,
            next,
            inodes,
            dirs,
            xattrs: BTreeMap::new(),
            extent_trees: BTreeSet::new(),
            fanout: usize::MAX,
        })
    }

    pub fn root(&self) -> u64 {
        self.sb.root_ino
    }

    fn alloc(&mut self, n: u64) -> Result<u64> {
        let b = self.next;
        if b + n > self.sb.group_first_block(0) + self.sb.group_blocks {
            return Err(Error::new(
                ErrorKind::NoSpace,
                "synthetic volume: group 0 is full",
            ));
        }
        self.next += n;
        Ok(b)
    }

    fn new_inode(&mut self, parent: u64, name: &str, mode: u32) -> Result<u64> {
        let ino = self.alloc(1)?;
        let t = crate::mkfs::now();
        let inode = Inode {
            ino,
            seq: 1,
            mode,
            generation: 1,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            ..Default::default()
        };
        self.inodes.insert(ino, inode);
        self.link(parent, name, ino)?;
        Ok(ino)
    }

    /// Add an entry `name` in `parent` for the existing inode `ino` (a hard link).
    pub fn link(&mut self, parent: u64, name: &str, ino: u64) -> Result<()> {
        let mode = self
            .inodes
            .get(&ino)
            .map(|i| i.mode)
            .ok_or_else(|| Error::new(ErrorKind::NotFound, "no such inode"))?;
        let dtype = FileKind::from_mode(mode).map_or(0, FileKind::dtype);
        let d = self
            .dirs
            .get_mut(&parent)
            .ok_or_else(|| Error::new(ErrorKind::NotDir, "parent is not a directory"))?;
        d.push(DirEntry {
            name: name.as_bytes().to_vec(),
            ino,
            dtype,
        });
        Ok(())
    }

    pub fn mkdir(&mut self, parent: u64, name: &str) -> Result<u64> {
        let ino = self.new_inode(parent, name, libc::S_IFDIR | 0o755)?;
        self.dirs.insert(ino, Vec::new());
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.parent = parent;
        }
        Ok(ino)
    }

    /// A regular file of `size` bytes whose data lives in `extents` = (file block, length,
    /// unwritten); data blocks are allocated here. With `tree`, extents go into an extent
    /// tree instead of the inode.
    pub fn file(
        &mut self,
        parent: u64,
        name: &str,
        size: u64,
        extents: &[(u64, u32, bool)],
        tree: bool,
    ) -> Result<u64> {
        let ino = self.new_inode(parent, name, libc::S_IFREG | 0o644)?;
        let mut ex = Vec::new();
        for &(logical, len, unwritten) in extents {
            let physical = self.alloc(u64::from(len))?;
            ex.push(Extent {
                logical,
                physical,
                len,
                flags: if unwritten {
                    crate::format::extent::EXTENT_UNWRITTEN
                } else {
                    0
                },
            });
        }
        if !tree && ex.len() > INLINE_EXTENTS_MAX {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "too many extents for the inode",
            ));
        }
        let i = self
            .inodes
            .get_mut(&ino)
            .ok_or_else(|| Error::new(ErrorKind::NotFound, "no such inode"))?;
        i.size = size;
        i.inline_extents = ex;
        if tree {
            self.extent_trees.insert(ino);
        } else {
            i.flags |= flags::INLINE_EXTENTS;
        }
        Ok(ino)
    }

    /// A symlink; a target longer than the inline area continues in an overflow block (as the
    /// filesystem stores it on v2 volumes).
    pub fn symlink(&mut self, parent: u64, name: &str, target: &str) -> Result<u64> {
        let ino = self.new_inode(parent, name, libc::S_IFLNK | 0o777)?;
        let (inline, rest) = target.as_bytes().split_at(target.len().min(INLINE_CAP));
        let overflow = if rest.is_empty() {
            0
        } else {
            let b = self.alloc(1)?;
            let o = Overflow {
                blockno: b,
                seq: 1,
                owner: ino,
                role: Role::SymlinkTarget,
                index: 1,
                payload: rest.to_vec(),
            };
            self.dev
                .write_at(b * FS_BLOCK, &AlignedBuf::from_slice(&o.encode()))?;
            b
        };
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.inline_data = inline.to_vec();
            i.size = target.len() as u64;
            i.overflow_block = overflow;
        }
        Ok(ino)
    }

    /// A fifo, socket or device node (`mode` includes the `S_IF*` type).
    pub fn mknod(&mut self, parent: u64, name: &str, mode: u32, rdev: u64) -> Result<u64> {
        let ino = self.new_inode(parent, name, mode)?;
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.rdev = rdev;
        }
        Ok(ino)
    }

    pub fn set_xattr(&mut self, ino: u64, name: &str, value: &[u8]) {
        self.xattrs
            .entry(ino)
            .or_default()
            .insert(name.as_bytes().to_vec(), value.to_vec());
    }

    /// Build a B+tree over sorted `items` owned by `owner`; returns (root, node count).
    fn build_tree(&mut self, owner: u64, items: Vec<(u64, Vec<u8>)>) -> Result<(u64, u64)> {
        let fanout = self.fanout.max(2);
        let mut nodes = 0u64;
        // Leaves: split by entry count and bytes.
        let mut level_nodes: Vec<TreeNode> = Vec::new();
        let mut cur: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut bytes = 0;
        for (k, v) in items {
            let need = 10 + v.len();
            if !cur.is_empty() && (cur.len() >= fanout || bytes + need > NODE_CAP) {
                level_nodes.push(TreeNode {
                    blockno: 0,
                    seq: 1,
                    owner,
                    level: 0,
                    entries: NodeEntries::Leaf(std::mem::take(&mut cur)),
                });
                bytes = 0;
            }
            bytes += need;
            cur.push((k, v));
        }
        level_nodes.push(TreeNode {
            blockno: 0,
            seq: 1,
            owner,
            level: 0,
            entries: NodeEntries::Leaf(cur),
        });
        let mut level = 0u16;
        loop {
            for n in &mut level_nodes {
                n.blockno = self.alloc(1)?;
                nodes += 1;
                self.dev
                    .write_at(n.blockno * FS_BLOCK, &AlignedBuf::from_slice(&n.encode()))?;
            }
            if level_nodes.len() == 1 {
                return Ok((level_nodes[0].blockno, nodes));
            }
            level += 1;
            let children: Vec<(u64, u64)> = level_nodes
                .iter()
                .map(|n| {
                    let first = match &n.entries {
                        NodeEntries::Leaf(v) => v.first().map_or(0, |e| e.0),
                        NodeEntries::Internal(v) => v.first().map_or(0, |e| e.0),
                    };
                    (first, n.blockno)
                })
                .collect();
            level_nodes = children
                .chunks(fanout.min(NODE_CAP / 16))
                .map(|c| TreeNode {
                    blockno: 0,
                    seq: 1,
                    owner,
                    level,
                    entries: NodeEntries::Internal(c.to_vec()),
                })
                .collect();
        }
    }

    /// Write trees, xattr blocks, inodes and the group 0 bitmap; returns the device.
    pub fn finish(mut self) -> Result<MemDevice> {
        let dirs = std::mem::take(&mut self.dirs);
        let mut subdirs: BTreeMap<u64, u32> = BTreeMap::new();
        let mut refs: BTreeMap<u64, u32> = BTreeMap::new();
        let mut held: BTreeMap<u64, u64> = BTreeMap::new();
        for (&dir, entries) in &dirs {
            let mut by_hash: BTreeMap<u64, Vec<DirEntry>> = BTreeMap::new();
            for e in entries {
                by_hash
                    .entry(name_hash(&e.name))
                    .or_default()
                    .push(e.clone());
                *refs.entry(e.ino).or_default() += 1;
                if self.inodes.get(&e.ino).is_some_and(Inode::is_dir) {
                    *subdirs.entry(dir).or_default() += 1;
                }
            }
            if !by_hash.is_empty() {
                let items = by_hash
                    .into_iter()
                    .map(|(k, v)| (k, encode_entries(&v)))
                    .collect();
                let (root, n) = self.build_tree(dir, items)?;
                *held.entry(dir).or_default() += n;
                if let Some(i) = self.inodes.get_mut(&dir) {
                    i.tree_root = root;
                }
            }
        }
        for ino in std::mem::take(&mut self.extent_trees) {
            let ex = self
                .inodes
                .get_mut(&ino)
                .map(|i| std::mem::take(&mut i.inline_extents))
                .unwrap_or_default();
            let data: u64 = ex.iter().map(|e| u64::from(e.len)).sum();
            *held.entry(ino).or_default() += data;
            if !ex.is_empty() {
                let items = ex
                    .iter()
                    .map(|e| (e.logical, e.encode_value().to_vec()))
                    .collect();
                let (root, n) = self.build_tree(ino, items)?;
                *held.entry(ino).or_default() += n;
                if let Some(i) = self.inodes.get_mut(&ino) {
                    i.tree_root = root;
                }
            }
        }
        let layout = Layout::of(&self.sb);
        for (ino, map) in std::mem::take(&mut self.xattrs) {
            let n = xattr::overflow_count(xattr::encoded_len(&map, layout));
            let b = self.alloc(1 + n as u64)?;
            let more: Vec<(u64, u64)> = (b + 1..=b + n as u64).map(|m| (m, 1)).collect();
            for (at, data) in xattr::encode_set(&map, layout, (b, 1), &more, ino) {
                self.dev
                    .write_at(at * FS_BLOCK, &AlignedBuf::from_slice(&data))?;
            }
            *held.entry(ino).or_default() += 1 + n as u64;
            if let Some(i) = self.inodes.get_mut(&ino) {
                i.xattr_block = b;
            }
        }
        for (&ino, inode) in &mut self.inodes {
            let data: u64 = inode.inline_extents.iter().map(|e| u64::from(e.len)).sum();
            inode.blocks = 1
                + data
                + u64::from(inode.overflow_block != 0)
                + held.get(&ino).copied().unwrap_or(0);
            inode.nlink = if inode.is_dir() {
                2 + subdirs.get(&ino).copied().unwrap_or(0)
            } else {
                refs.get(&ino).copied().unwrap_or(0)
            };
            self.dev
                .write_at(ino * FS_BLOCK, &AlignedBuf::from_slice(&inode.encode()))?;
        }
        // Mark everything allocated here used in group 0.
        let first = self.sb.group_first_block(0);
        let mut newly = 0;
        for i in 0..u64::from(self.sb.bitmap_blocks) {
            let at = first + 1 + i;
            let raw = read(&self.dev, at)?;
            let (seq, payload) = decode_bitmap(&raw, at)?;
            let mut bits = payload.to_vec();
            for b in self.sb.root_ino + 1..self.next {
                let rel = b - first;
                if rel / BITS_PER_BITMAP_BLOCK == i {
                    let o = rel % BITS_PER_BITMAP_BLOCK;
                    bits[usize::try_from(o / 8).unwrap_or(0)] |= 1 << (o % 8);
                    newly += 1;
                }
            }
            self.dev.write_at(
                at * FS_BLOCK,
                &AlignedBuf::from_slice(&encode_bitmap(at, seq + 1, &bits)),
            )?;
        }
        let mut h = GroupHeader::decode(&read(&self.dev, first)?, first)?;
        h.free_blocks -= newly;
        h.seq += 1;
        self.dev
            .write_at(first * FS_BLOCK, &AlignedBuf::from_slice(&h.encode()))?;
        Ok(self.dev)
    }

    /// A small populated volume touching every structure the checker knows: nested
    /// directories with a two-level entry tree, inline and tree extents (with a hole and an
    /// unwritten preallocation past EOF), symlinks (one of 4095 bytes), a fifo, a hard link
    /// and xattrs (one set of three blocks).
    pub fn sample() -> Result<MemDevice> {
        let mut v = Self::new(MIN_SYNTH_BYTES)?;
        v.fanout = 4;
        let root = v.root();
        let docs = v.mkdir(root, "docs")?;
        let deep = v.mkdir(docs, "deep")?;
        for i in 0..12 {
            v.file(
                docs,
                &format!("note{i}.txt"),
                100 + i,
                &[(0, 1, false)],
                false,
            )?;
        }
        let big = v.file(
            root,
            "big.img",
            9 * FS_BLOCK,
            &[(0, 3, false), (5, 4, false), (9, 2, true)],
            true,
        )?;
        let many: Vec<(u64, u32, bool)> = (0..10).map(|k| (k * 2, 1, false)).collect();
        v.file(deep, "sparse", 20 * FS_BLOCK, &many, true)?;
        v.link(deep, "big-link", big)?;
        v.symlink(root, "latest", "docs/note0.txt")?;
        // A target of PATH_MAX - 1 bytes: inline area plus an overflow block.
        let long = format!("{}/note1.txt", "./docs/deep/..".repeat(292));
        v.symlink(deep, "long", &long[..4095])?;
        v.mknod(deep, "pipe", libc::S_IFIFO | 0o600, 0)?;
        v.set_xattr(big, "user.origin", b"synth");
        // Two overflow blocks after the head.
        v.set_xattr(big, "user.blob", &[0xb1; 10_000]);
        v.set_xattr(
            docs,
            "security.selinux",
            b"unconfined_u:object_r:user_home_t:s0",
        );
        v.finish()
    }
}

fn read(dev: &dyn BlockDevice, b: u64) -> Result<AlignedBuf> {
    let mut buf = AlignedBuf::new(FS_BLOCK_SIZE);
    dev.read_at(b * FS_BLOCK, &mut buf)?;
    Ok(buf)
}
