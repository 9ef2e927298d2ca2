//! Inode block: one 4 KiB block per inode; the inode number *is* its block number, so there
//! is no inode table to size at mkfs and inodes are allocated from the groups like data.
//!
//! ```text
//!   0  40 block header (type Inode, owner = own number)
//!  40   4 mode        44 4 uid        48 4 gid        52 4 nlink
//!  56   4 flags       60 4 generation (random per new inode, so a reused number is distinguishable)
//!  64   8 size        72 8 rdev
//!  80  12 atime (i64 sec, u32 nsec)   92 12 mtime   104 12 ctime   116 12 crtime
//! 128   8 blocks (fs blocks held: this inode block, xattr block, tree nodes, data)
//! 136   8 xattr block (0 = none)
//! 144   8 tree root (extent tree for files, entry tree for directories; 0 = none)
//! 152   4 inline length (bytes of the inline area in use)
//! 156   4 inline extent count
//! 160   8 parent (directories: the parent directory, for "..")
//! 168   8 orphan link (reserved for the open-unlinked list)
//! 176   8 overflow block (v2, symlinks: the target past the inline area; 0 = none)
//! 184  72 reserved (zero)
//! 256 3840 inline area: symlink target (its first 3840 bytes), or up to 160 extents of 24 bytes
//!          (u64 logical block, u64 physical block, u32 length, u32 flags)
//! ```

use super::block::{BlockHeader, BlockType};
use super::codec::{Reader, Writer};
use super::extent::{Extent, EXTENT_FLAGS_KNOWN};
use super::FS_BLOCK_SIZE;
use crate::error::{Error, Result};

pub const INLINE_OFF: usize = 256;
pub const INLINE_CAP: usize = FS_BLOCK_SIZE - INLINE_OFF;
pub const INLINE_EXTENT_SIZE: usize = 24;
pub const INLINE_EXTENTS_MAX: usize = INLINE_CAP / INLINE_EXTENT_SIZE;
/// Longest symlink target on a v2 volume: Linux's `PATH_MAX` - 1 (inline part + overflow block).
pub const SYMLINK_MAX: usize = 4095;

/// Inode flags. The low bits mirror Linux FS_*_FL where a counterpart exists, so
/// `FS_IOC_GETFLAGS`/`SETFLAGS` can pass them through.
pub mod flags {
    pub const IMMUTABLE: u32 = 0x10; // FS_IMMUTABLE_FL
    pub const APPEND: u32 = 0x20; // FS_APPEND_FL
    pub const NOATIME: u32 = 0x80; // FS_NOATIME_FL
    /// The inline area holds extents (files) rather than a tree root.
    pub const INLINE_EXTENTS: u32 = 1 << 24;
    pub const USER_VISIBLE: u32 = IMMUTABLE | APPEND | NOATIME;
    pub const KNOWN: u32 = USER_VISIBLE | INLINE_EXTENTS;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timespec {
    pub sec: i64,
    pub nsec: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Inode {
    pub ino: u64,
    pub seq: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub flags: u32,
    pub generation: u32,
    pub size: u64,
    pub rdev: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub crtime: Timespec,
    pub blocks: u64,
    pub xattr_block: u64,
    pub tree_root: u64,
    pub parent: u64,
    pub orphan_next: u64,
    /// Symlinks with a target longer than the inline area: the overflow block holding the
    /// rest (`format/overflow.rs`); 0 = none.
    pub overflow_block: u64,
    /// Symlink target, or its first `INLINE_CAP` bytes when `overflow_block` holds the rest.
    pub inline_data: Vec<u8>,
    /// Extents stored inline (files with `INLINE_EXTENTS`).
    pub inline_extents: Vec<Extent>,
}

fn put_time(w: &mut Writer<'_>, off: usize, t: Timespec) {
    w.i64(off, t.sec);
    w.u32(off + 8, t.nsec);
}

fn get_time(r: &Reader<'_>, off: usize) -> Result<Timespec> {
    let t = Timespec {
        sec: r.i64(off)?,
        nsec: r.u32(off + 8)?,
    };
    if t.nsec >= 1_000_000_000 {
        return Err(Error::corrupted(format!(
            "inode: nanoseconds {} out of range",
            t.nsec
        )));
    }
    Ok(t)
}

impl Inode {
    pub fn encode(&self) -> Vec<u8> {
        assert!(
            self.inline_data.len() <= INLINE_CAP && self.inline_extents.len() <= INLINE_EXTENTS_MAX
        );
        let mut b = vec![0u8; FS_BLOCK_SIZE];
        let mut w = Writer::new(&mut b);
        w.u32(40, self.mode);
        w.u32(44, self.uid);
        w.u32(48, self.gid);
        w.u32(52, self.nlink);
        w.u32(56, self.flags);
        w.u32(60, self.generation);
        w.u64(64, self.size);
        w.u64(72, self.rdev);
        put_time(&mut w, 80, self.atime);
        put_time(&mut w, 92, self.mtime);
        put_time(&mut w, 104, self.ctime);
        put_time(&mut w, 116, self.crtime);
        w.u64(128, self.blocks);
        w.u64(136, self.xattr_block);
        w.u64(144, self.tree_root);
        w.u64(160, self.parent);
        w.u64(168, self.orphan_next);
        w.u64(176, self.overflow_block);
        if self.flags & flags::INLINE_EXTENTS != 0 {
            #[allow(clippy::cast_possible_truncation)] // <= 160, asserted above
            w.u32(156, self.inline_extents.len() as u32);
            for (i, e) in self.inline_extents.iter().enumerate() {
                let o = INLINE_OFF + i * INLINE_EXTENT_SIZE;
                w.u64(o, e.logical);
                w.u64(o + 8, e.physical);
                w.u32(o + 16, e.len);
                w.u32(o + 20, e.flags);
            }
        } else {
            #[allow(clippy::cast_possible_truncation)] // <= 3840, asserted above
            w.u32(152, self.inline_data.len() as u32);
            w.bytes(INLINE_OFF, &self.inline_data);
        }
        BlockHeader {
            btype: BlockType::Inode,
            blockno: self.ino,
            seq: self.seq,
            owner: self.ino,
        }
        .seal(&mut b);
        b
    }

    pub fn decode(buf: &[u8], ino: u64) -> Result<Self> {
        let h = BlockHeader::check(buf, BlockType::Inode, ino)?;
        let r = Reader::new(buf, "inode");
        let flags = r.u32(56)?;
        if flags & !flags::KNOWN != 0 {
            return Err(Error::corrupted(format!(
                "inode {ino}: unknown flags {flags:#x}"
            )));
        }
        let mut ino_rec = Self {
            ino,
            seq: h.seq,
            mode: r.u32(40)?,
            uid: r.u32(44)?,
            gid: r.u32(48)?,
            nlink: r.u32(52)?,
            flags,
            generation: r.u32(60)?,
            size: r.u64(64)?,
            rdev: r.u64(72)?,
            atime: get_time(&r, 80)?,
            mtime: get_time(&r, 92)?,
            ctime: get_time(&r, 104)?,
            crtime: get_time(&r, 116)?,
            blocks: r.u64(128)?,
            xattr_block: r.u64(136)?,
            tree_root: r.u64(144)?,
            parent: r.u64(160)?,
            orphan_next: r.u64(168)?,
            overflow_block: r.u64(176)?,
            inline_data: Vec::new(),
            inline_extents: Vec::new(),
        };
        if flags & flags::INLINE_EXTENTS != 0 {
            let n = r.u32(156)? as usize;
            if n > INLINE_EXTENTS_MAX {
                return Err(Error::corrupted(format!("inode {ino}: {n} inline extents")));
            }
            for i in 0..n {
                let o = INLINE_OFF + i * INLINE_EXTENT_SIZE;
                let e = Extent {
                    logical: r.u64(o)?,
                    physical: r.u64(o + 8)?,
                    len: r.u32(o + 16)?,
                    flags: r.u32(o + 20)?,
                };
                if e.len == 0 || e.flags & !EXTENT_FLAGS_KNOWN != 0 {
                    return Err(Error::corrupted(format!(
                        "inode {ino}: bad inline extent {i}"
                    )));
                }
                ino_rec.inline_extents.push(e);
            }
        } else {
            let n = r.u32(152)? as usize;
            ino_rec.inline_data = r.bytes(INLINE_OFF, n)?.to_vec();
        }
        Ok(ino_rec)
    }

    pub fn file_type(&self) -> u32 {
        self.mode & libc::S_IFMT
    }
    pub fn is_dir(&self) -> bool {
        self.file_type() == libc::S_IFDIR
    }
    pub fn is_reg(&self) -> bool {
        self.file_type() == libc::S_IFREG
    }
    pub fn is_symlink(&self) -> bool {
        self.file_type() == libc::S_IFLNK
    }
}

/// Where a symlink's target lives, as its inode says (`Inode::symlink_layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SymlinkLayout {
    /// All `size` bytes inline.
    Inline,
    /// `INLINE_CAP` bytes inline, the last `rest` bytes (1 ..= 255) in overflow block `block`.
    Overflow { block: u64, rest: usize },
}

impl Inode {
    /// The one rule for a symlink's shape: size, inline bytes and overflow pointer must agree
    /// (`v2`: the volume has format version 2's overflow blocks). An `Err` is the
    /// inconsistency, in words, for the runtime's EIO and fsck's finding alike; the overflow
    /// block's own contents are checked by whoever reads it.
    pub fn symlink_layout(&self, v2: bool) -> std::result::Result<SymlinkLayout, String> {
        let (size, inline, block) = (self.size, self.inline_data.len(), self.overflow_block);
        if block == 0 {
            if inline == 0 || size != inline as u64 {
                return Err(format!(
                    "symlink of {size} bytes has {inline} inline bytes and no overflow block"
                ));
            }
            return Ok(SymlinkLayout::Inline);
        }
        if !v2 {
            return Err(format!(
                "symlink has an overflow block {block} on a volume of format version 1"
            ));
        }
        let rest = size
            .checked_sub(INLINE_CAP as u64)
            .and_then(|r| usize::try_from(r).ok())
            .filter(|&r| r > 0 && size <= SYMLINK_MAX as u64);
        match rest {
            Some(rest) if inline == INLINE_CAP => Ok(SymlinkLayout::Overflow { block, rest }),
            _ => Err(format!(
                "symlink of {size} bytes ({inline} inline) cannot have an overflow block {block}"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip(ino in 1u64..1<<40, mode: u32, size: u64, sec: i64, nsec in 0u32..1_000_000_000,
                     nex in 0usize..INLINE_EXTENTS_MAX, flip in 0usize..FS_BLOCK_SIZE*8, overflow_block: u64) {
            let mut i = Inode { ino, mode, size, nlink: 1, flags: flags::INLINE_EXTENTS, overflow_block, ..Default::default() };
            i.mtime = Timespec { sec, nsec };
            i.inline_extents = (0..nex as u64).map(|k| Extent { logical: k * 10, physical: 1000 + k * 10, len: 5, flags: 0 }).collect();
            let mut b = i.encode();
            prop_assert_eq!(Inode::decode(&b, ino).unwrap(), i.clone());
            prop_assert!(Inode::decode(&b, ino + 1).is_err());
            b[flip / 8] ^= 1 << (flip % 8);
            prop_assert!(Inode::decode(&b, ino).is_err());
        }

        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..5000), ino: u64) {
            let _ = Inode::decode(&data, ino);
        }
    }
}
