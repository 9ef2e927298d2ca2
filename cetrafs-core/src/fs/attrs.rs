//! The blocks an inode owns outside its tree: its xattr set (a head block and, on v2 volumes,
//! up to 31 overflow blocks; `format/xattr.rs`) and the overflow block of a symlink target
//! longer than the inline area (`format/overflow.rs`).
//!
//! Every pointer is checked before it is followed: the block must lie in the data area of an
//! allocation group (`Superblock::check_data_block`, the layout's one pointer rule) and must name the inode as its owner
//! ([`check_owner`], the rule tree nodes follow). A bad pointer is `Corrupted` (EIO) naming the
//! inode and the block, never another inode's attributes. Freeing releases only blocks that
//! pass both checks: a damaged set is left allocated (fsck reports it as leaked) rather than
//! risking a free of someone else's block.
//!
//! All these blocks are metadata: written through the transaction together with the inode
//! that points at them, so the journal makes the whole change atomic (`fs/txn.rs`); freed
//! blocks are quarantined until the free commits.
//!
//! Limits (one place): a set holds at most `Layout::capacity()` bytes of entries and at most
//! 64 KiB of names (`XATTR_LIST_MAX`, so listxattr always fits), else `NoSpace`; a value is
//! at most 64 KiB on v2 (`TooBig`, E2BIG), what one block holds on v1. Symlink targets are at
//! most 4095 bytes on v2 and 3840 on v1 (`NameTooLong`).

use super::txn::Tx;
use crate::error::{Error, ErrorKind, Result};
use crate::format::block::check_owner;
use crate::format::inode::{Inode, SymlinkLayout, INLINE_CAP, SYMLINK_MAX};
use crate::format::layout::PointerKind;
use crate::format::overflow::{Overflow, Role};
use crate::format::superblock::Superblock;
use crate::format::xattr::{self, Head, Layout, XattrMap};

/// Follow a pointer of `ino` to an overflow block: layout, decode, owner.
fn read_overflow(tx: &mut Tx<'_>, ino: u64, what: &str, b: u64) -> Result<Overflow> {
    tx.sb().check_data_block(b, PointerKind::Overflow, ino)?;
    let raw = tx.read(b)?;
    let o = Overflow::decode(&raw, b).map_err(|e| e.wrap(format!("inode {ino}")))?;
    check_owner(what, b, o.owner, ino).map_err(|e| e.wrap(format!("inode {ino}")))?;
    Ok(o)
}

/// An inode's xattr set as loaded: the attributes and the blocks holding them (with the seq
/// each carries, which the next write must exceed).
#[derive(Debug, Default)]
pub(super) struct XattrSet {
    pub map: XattrMap,
    head: Option<(u64, u64)>,
    more: Vec<(u64, u64)>,
}

impl XattrSet {
    /// Blocks the set occupies.
    fn blocks(&self) -> u64 {
        u64::from(self.head.is_some()) + self.more.len() as u64
    }
}

/// Load the xattr set of `inode`, every pointer checked.
pub(super) fn load_xattrs(tx: &mut Tx<'_>, sb: &Superblock, inode: &Inode) -> Result<XattrSet> {
    let (ino, hb) = (inode.ino, inode.xattr_block);
    if hb == 0 {
        return Ok(XattrSet::default());
    }
    let layout = Layout::of(sb);
    tx.sb().check_data_block(hb, PointerKind::Xattr, ino)?;
    let raw = tx.read(hb)?;
    let ctx = || format!("inode {ino}");
    let head = Head::decode(&raw, hb, layout).map_err(|e| e.wrap(ctx()))?;
    check_owner("xattr block", hb, head.owner, ino).map_err(|e| e.wrap(ctx()))?;
    let mut parts = Vec::with_capacity(head.more.len());
    for &b in &head.more {
        parts.push(read_overflow(tx, ino, "xattr overflow block", b)?);
    }
    let map = head.assemble(&parts, layout).map_err(|e| e.wrap(ctx()))?;
    Ok(XattrSet {
        map,
        head: Some((hb, head.seq)),
        more: parts.iter().map(|p| (p.blockno, p.seq)).collect(),
    })
}

/// Refuse a value the layout cannot hold (before the set is changed).
pub(super) fn check_value(sb: &Superblock, value: &[u8]) -> Result<()> {
    let max = Layout::of(sb).max_value();
    if value.len() > max {
        let kind = if Layout::of(sb) == Layout::V1 {
            ErrorKind::NoSpace
        } else {
            ErrorKind::TooBig
        };
        return Err(Error::new(
            kind,
            format!(
                "an xattr value of {} bytes is larger than this volume allows ({max} bytes{})",
                value.len(),
                if kind == ErrorKind::NoSpace {
                    "; volumes of format version 1 keep all xattrs in one block"
                } else {
                    ""
                }
            ),
        ));
    }
    Ok(())
}

fn alloc_blocks(tx: &mut Tx<'_>, goal: u64, n: usize) -> Result<Vec<(u64, u64)>> {
    let runs = tx.alloc_meta(goal, n as u64)?;
    let mut out = Vec::with_capacity(n);
    for (s, l) in runs {
        for b in s..s + l {
            out.push((b, tx.prior_seq(b)? + 1));
        }
    }
    Ok(out)
}

/// Xattr blocks a smaller set no longer uses ([`store_xattrs`]): freed by [`Released::free`]
/// once the inode that no longer names them is saved, in the same transaction. A failed
/// operation's transaction commits with what it did: freed before the save, they would be
/// free while the inode at home still named them.
#[must_use = "the blocks are freed by `free`, after the inode is saved"]
#[derive(Debug, Default)]
pub(super) struct Released(Vec<u64>);

impl Released {
    /// Free them (their bitmaps were loaded by [`store_xattrs`]). The inode no longer names
    /// them: one that still fails to be freed is leaked (fsck reports it), and the operation,
    /// done, does not fail for it (as [`Volume::save`](super::Volume) frees punched runs).
    pub(super) fn free(self, tx: &mut Tx<'_>) {
        for b in self.0 {
            if let Err(e) = tx.free_one(b) {
                tracing::warn!("xattr block {b} not freed (fsck.cetra will report it): {e}");
            }
        }
    }
}

/// Write `set.map` back as the inode's xattr set: reuse its blocks, allocate what a larger set
/// needs (near the inode); adjust `blocks` and `xattr_block`. The caller saves the inode in
/// the same transaction, then frees what a smaller set no longer uses (the result).
pub(super) fn store_xattrs(
    tx: &mut Tx<'_>,
    sb: &Superblock,
    inode: &mut Inode,
    set: &XattrSet,
) -> Result<Released> {
    let ino = inode.ino;
    let layout = Layout::of(sb);
    let used = xattr::encoded_len(&set.map, layout);
    if used > layout.capacity() {
        return Err(Error::new(
            ErrorKind::NoSpace,
            format!(
                "extended attributes of inode {ino} would take {used} bytes; at most {} fit{}",
                layout.capacity(),
                if layout == Layout::V1 {
                    " (a volume of format version 1 keeps them in one 4 KiB block)"
                } else {
                    ""
                }
            ),
        ));
    }
    if xattr::names_len(&set.map) > xattr::XATTR_LIST_MAX {
        return Err(Error::new(
            ErrorKind::NoSpace,
            format!(
                "the xattr names of inode {ino} would exceed {} bytes (listxattr's limit)",
                xattr::XATTR_LIST_MAX
            ),
        ));
    }
    let before = set.blocks();
    let need = xattr::overflow_count(used);
    let released: Vec<u64> = if set.map.is_empty() {
        set.head.iter().chain(&set.more).map(|&(b, _)| b).collect()
    } else {
        set.more.iter().skip(need).map(|&(b, _)| b).collect()
    };
    // Their bitmaps are loaded before anything changes, so the frees after the save find them.
    for &b in &released {
        tx.prepare_free(b)?;
    }
    if set.map.is_empty() {
        inode.xattr_block = 0;
        inode.blocks = inode.blocks.saturating_sub(before);
        return Ok(Released(released));
    }
    let head = match set.head {
        Some((b, seq)) => (b, seq + 1),
        None => alloc_blocks(tx, ino, 1)?[0],
    };
    let mut more: Vec<(u64, u64)> = set.more.iter().map(|&(b, s)| (b, s + 1)).collect();
    if more.len() > need {
        more.truncate(need);
    } else if more.len() < need {
        let extra = alloc_blocks(tx, head.0, need - more.len())?;
        more.extend(extra);
    }
    for (b, data) in xattr::encode_set(&set.map, layout, head, &more, ino) {
        tx.write(b, data);
    }
    inode.xattr_block = head.0;
    inode.blocks = inode.blocks.saturating_sub(before) + 1 + more.len() as u64;
    Ok(Released(released))
}

/// Longest symlink target this volume stores.
fn symlink_max(sb: &Superblock) -> usize {
    match Layout::of(sb) {
        Layout::V1 => INLINE_CAP,
        Layout::V2 => SYMLINK_MAX,
    }
}

/// Put `target` into a new symlink inode: the inline area, and an overflow block for what does
/// not fit (v2). Sets `size`, `inline_data`, `overflow_block`, `blocks`.
pub(super) fn store_symlink_target(
    tx: &mut Tx<'_>,
    sb: &Superblock,
    inode: &mut Inode,
    target: &[u8],
) -> Result<()> {
    let max = symlink_max(sb);
    if target.is_empty() || target.len() > max {
        return Err(Error::new(
            ErrorKind::NameTooLong,
            format!(
                "symlink target must be 1..={max} bytes{}",
                if max < SYMLINK_MAX {
                    " on a volume of format version 1"
                } else {
                    ""
                }
            ),
        ));
    }
    let (inline, rest) = target.split_at(target.len().min(INLINE_CAP));
    inode.size = target.len() as u64;
    inode.inline_data = inline.to_vec();
    if !rest.is_empty() {
        let (b, seq) = alloc_blocks(tx, inode.ino, 1)?[0];
        let o = Overflow {
            blockno: b,
            seq,
            owner: inode.ino,
            role: Role::SymlinkTarget,
            index: 1,
            payload: rest.to_vec(),
        };
        tx.write(b, o.encode());
        inode.overflow_block = b;
        inode.blocks += 1;
    }
    Ok(())
}

/// The whole target of a symlink inode, the overflow pointer checked. Without an overflow
/// block the inline bytes are the whole target and must be `size` of them: an inode whose
/// pointer was lost (zeroed) or whose size disagrees would otherwise serve a shorter or longer
/// target, which names another path.
pub(super) fn symlink_target(tx: &mut Tx<'_>, sb: &Superblock, inode: &Inode) -> Result<Vec<u8>> {
    let ino = inode.ino;
    let (b, rest) = match inode.symlink_layout(Layout::of(sb) == Layout::V2) {
        Ok(SymlinkLayout::Inline) => return Ok(inode.inline_data.clone()),
        Ok(SymlinkLayout::Overflow { block, rest }) => (block, rest),
        Err(why) => return Err(Error::corrupted(format!("inode {ino}: {why}"))),
    };
    let o = read_overflow(tx, ino, "symlink overflow block", b)?;
    o.expect(Role::SymlinkTarget, 1, rest)
        .map_err(|e| e.wrap(format!("inode {ino}")))?;
    let mut t = inode.inline_data.clone();
    t.extend_from_slice(&o.payload);
    Ok(t)
}

/// Free the xattr set and the symlink overflow block of an inode that is going away. Blocks
/// that fail the pointer or owner checks are not freed (and the failure is logged): leaking
/// them is safe, freeing a block that belongs to someone else is not.
pub(super) fn free_owned(tx: &mut Tx<'_>, sb: &Superblock, inode: &Inode) {
    let ino = inode.ino;
    if inode.xattr_block != 0 {
        match load_xattrs(tx, sb, inode) {
            Ok(set) => {
                for (b, _) in set.head.iter().chain(&set.more) {
                    if let Err(e) = tx.free_one(*b) {
                        tracing::warn!(
                            "inode {ino}: xattr block {b} not freed (fsck.cetra will report it): {e}"
                        );
                    }
                }
            }
            Err(e) => tracing::warn!(
                "inode {ino}: xattr block {} not freed (fsck.cetra will report it): {e}",
                inode.xattr_block
            ),
        }
    }
    if inode.overflow_block != 0 {
        let b = inode.overflow_block;
        match symlink_target(tx, sb, inode) {
            Ok(_) => {
                if let Err(e) = tx.free_one(b) {
                    tracing::warn!(
                        "inode {ino}: symlink overflow block {b} not freed (fsck.cetra will report it): {e}"
                    );
                }
            }
            Err(e) => tracing::warn!(
                "inode {ino}: symlink overflow block {b} not freed (fsck.cetra will report it): {e}"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{fresh, remount};
    use super::super::{Caller, MountOptions, Volume};
    use super::*;
    use crate::check::check_volume;
    use crate::dev::mem::MemDevice;
    use crate::dev::{AlignedBuf, BlockDevice};
    use crate::format::block::BlockHeader;
    use crate::format::FS_BLOCK;
    use std::sync::Arc;

    const C: Caller = Caller::ROOT;

    fn assert_fsck_clean(dev: &MemDevice) {
        let r = check_volume(dev).unwrap();
        assert!(r.findings.is_empty(), "{:?}", r.findings);
    }

    fn rd(dev: &MemDevice, b: u64) -> Vec<u8> {
        let mut buf = AlignedBuf::new(4096);
        dev.read_at(b * FS_BLOCK, &mut buf).unwrap();
        buf.to_vec()
    }

    fn wr(dev: &MemDevice, b: u64, data: &[u8]) {
        dev.write_at(b * FS_BLOCK, &AlignedBuf::from_slice(data))
            .unwrap();
    }

    fn inode_of(dev: &MemDevice, ino: u64) -> Inode {
        Inode::decode(&rd(dev, ino), ino).unwrap()
    }

    /// Unmount, let `damage` edit the image, mount it again.
    fn damaged(v: &Volume, dev: &MemDevice, damage: impl FnOnce(&MemDevice)) -> Arc<Volume> {
        v.unmount().unwrap();
        let d2 = Arc::new(MemDevice::from_image(dev.snapshot(), 512));
        damage(&d2);
        Volume::mount(d2, &MountOptions::default()).unwrap()
    }

    fn free(v: &Volume) -> u64 {
        v.sync().unwrap();
        v.statfs().unwrap().bfree
    }

    fn long_target(n: usize) -> Vec<u8> {
        (0..n).map(|i| b"abcdefgh/"[i % 9]).collect()
    }

    #[test]
    fn symlink_of_4095_bytes_survives_remount_and_is_freed() {
        let (dev, v) = fresh(64 << 20);
        let r = v.root_ino();
        v.mknod(r, b"first", libc::S_IFREG | 0o644, 0, C).unwrap(); // gives the root its entry tree
        let before = free(&v);
        let t = long_target(4095);
        let a = v.symlink(r, b"long", &t, C).unwrap();
        assert_eq!(a.size, 4095);
        assert_eq!(a.blocks, 8, "one overflow block beyond the inode");
        assert_eq!(v.readlink(a.ino).unwrap(), t);
        let short = v.symlink(r, b"short", &t[..INLINE_CAP], C).unwrap();
        assert_eq!(short.blocks, 0);
        assert_eq!(
            v.symlink(r, b"toolong", &long_target(4096), C)
                .unwrap_err()
                .kind(),
            ErrorKind::NameTooLong
        );
        assert_eq!(free(&v), before - 3, "two inodes and one overflow block");
        let (d2, v2) = remount(&dev, &v);
        assert_eq!(v2.readlink(a.ino).unwrap(), t);
        assert_eq!(v2.readlink(short.ino).unwrap(), &t[..INLINE_CAP]);
        let i = inode_of(&d2, a.ino);
        assert_eq!(i.inline_data.len(), INLINE_CAP);
        assert_ne!(i.overflow_block, 0);
        v2.unlink(r, b"long").unwrap();
        v2.unlink(r, b"short").unwrap();
        assert_eq!(free(&v2), before);
        v2.unmount().unwrap();
        assert_fsck_clean(&d2);
    }

    #[test]
    fn xattr_sets_span_blocks_and_give_them_back() {
        let (dev, v) = fresh(64 << 20);
        let r = v.root_ino();
        let (f, fh) = v.create(r, b"f", 0o644, C, true).unwrap();
        v.release(&fh).unwrap();
        let before = free(&v);
        // A 64 KiB value (XATTR_SIZE_MAX) and one byte more.
        let big: Vec<u8> = (0..65536u32).map(|i| (i % 253) as u8).collect();
        v.setxattr(f.ino, b"user.big", &big, true, false).unwrap();
        assert_eq!(v.getxattr(f.ino, b"user.big").unwrap(), big);
        let e = v
            .setxattr(f.ino, b"user.bigger", &vec![0; 65537], false, false)
            .unwrap_err();
        assert_eq!((e.kind(), e.errno()), (ErrorKind::TooBig, libc::E2BIG));
        // Several values that together exceed a block, and the common small ones.
        for k in 0..3u8 {
            v.setxattr(
                f.ino,
                &[b"user.v".as_slice(), &[b'0' + k]].concat(),
                &[k; 3000],
                false,
                false,
            )
            .unwrap();
        }
        // An access ACL that says more than the mode (a named user): 5 entries, 44 bytes.
        let mut acl = 2u32.to_le_bytes().to_vec();
        for (tag, perm, id) in [
            (1u16, 6u16, u32::MAX),
            (2, 4, 1000),
            (4, 4, u32::MAX),
            (0x10, 4, u32::MAX),
            (0x20, 0, u32::MAX),
        ] {
            acl.extend_from_slice(&tag.to_le_bytes());
            acl.extend_from_slice(&perm.to_le_bytes());
            acl.extend_from_slice(&id.to_le_bytes());
        }
        v.setxattr(f.ino, b"system.posix_acl_access", &acl, false, false)
            .unwrap();
        let used = free(&v);
        let want = 1 + xattr::overflow_count(65536 + 8 + 5 + 3 * (3000 + 6 + 5) + 44 + 23 + 5);
        assert_eq!(before - used, want as u64, "blocks of the set");
        assert_eq!(v.getattr(f.ino).unwrap().blocks, 8 * want as u64);
        let (d2, v2) = remount(&dev, &v);
        assert_eq!(v2.getxattr(f.ino, b"user.big").unwrap(), big);
        assert_eq!(v2.getxattr(f.ino, b"user.v1").unwrap(), vec![1; 3000]);
        assert_eq!(
            v2.listxattr(f.ino).unwrap(),
            [
                &b"system.posix_acl_access"[..],
                b"user.big",
                b"user.v0",
                b"user.v1",
                b"user.v2"
            ]
        );
        // Shrinking frees overflow blocks; removing the last attribute frees the head.
        v2.removexattr(f.ino, b"user.big").unwrap();
        assert_eq!(
            before - free(&v2),
            3,
            "9 KiB of entries: head + 2 overflow blocks"
        );
        for n in [
            &b"user.v0"[..],
            b"user.v1",
            b"user.v2",
            b"system.posix_acl_access",
        ] {
            v2.removexattr(f.ino, n).unwrap();
        }
        assert_eq!(free(&v2), before);
        assert_eq!(v2.getattr(f.ino).unwrap().blocks, 0);
        // A set again, then the file goes: free_inode releases every block of it.
        v2.setxattr(f.ino, b"user.big", &big, true, false).unwrap();
        v2.unlink(r, b"f").unwrap();
        assert_eq!(free(&v2), before + 1, "the inode too");
        v2.unmount().unwrap();
        assert_fsck_clean(&d2);
    }

    #[test]
    fn the_set_has_a_limit() {
        let (dev, v) = fresh(64 << 20);
        let r = v.root_ino();
        let mut n = 0;
        let e = loop {
            let name = format!("user.{n}");
            match v.setxattr(r, name.as_bytes(), &vec![7; 60_000], false, false) {
                Ok(()) => n += 1,
                Err(e) => break e,
            }
        };
        assert_eq!(n, 2, "129,288 bytes hold two 60 KB values");
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert_eq!(
            v.listxattr(r).unwrap().len(),
            2,
            "the failed set changed nothing"
        );
        // Names are limited to what one listxattr reply can carry.
        let (_d, v3) = fresh(64 << 20);
        let r3 = v3.root_ino();
        let mut k = 0u32;
        let e = loop {
            let name = format!("user.{k:0>250}");
            match v3.setxattr(r3, name.as_bytes(), b"", false, false) {
                Ok(()) => k += 1,
                Err(e) => break e,
            }
        };
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert_eq!(k as usize, xattr::XATTR_LIST_MAX / 256);
        v.unmount().unwrap();
        assert_fsck_clean(&dev);
    }

    #[test]
    fn bad_xattr_pointers_are_eio_never_someone_elses_attributes() {
        let (dev, v) = fresh(64 << 20);
        let r = v.root_ino();
        let a = v.mknod(r, b"a", libc::S_IFREG | 0o644, 0, C).unwrap().ino;
        let b = v.mknod(r, b"b", libc::S_IFREG | 0o644, 0, C).unwrap().ino;
        v.setxattr(a, b"user.mine", b"a's", false, false).unwrap();
        v.setxattr(b, b"user.secret", b"b's", false, false).unwrap();
        v.setxattr(b, b"user.big", &[5; 9000], false, false)
            .unwrap();
        v.sync().unwrap();
        let sb = v.superblock().clone();
        let expect_eio = |v: &Volume, ino: u64, block: u64| {
            let e = v.getxattr(ino, b"user.secret").unwrap_err();
            assert_eq!(e.errno(), libc::EIO, "{e}");
            let m = e.to_string();
            assert!(
                m.contains(&format!("inode {ino}")) && m.contains(&block.to_string()),
                "{m}"
            );
            assert_eq!(v.listxattr(ino).unwrap_err().errno(), libc::EIO);
        };
        // a's pointer at b's (valid, checksummed) head: the owner check refuses it.
        let bx = inode_of(&dev, b).xattr_block;
        let v1 = damaged(&v, &dev, |d| {
            let mut i = inode_of(d, a);
            i.xattr_block = bx;
            wr(d, a, &i.encode());
        });
        expect_eio(&v1, a, bx);
        // Removing the file must not free b's blocks.
        let before = free(&v1);
        v1.unlink(r, b"a").unwrap();
        assert_eq!(free(&v1), before + 1, "only a's inode is freed");
        assert_eq!(v1.getxattr(b, b"user.secret").unwrap(), b"b's");
        v1.unmount().unwrap();
        // Pointers outside the data area: block 0, a group header, a bitmap block.
        for bad in [0, sb.group_first_block(0), sb.group_first_block(1) + 1] {
            let (dev, v) = fresh(64 << 20);
            let f = v
                .mknod(v.root_ino(), b"f", libc::S_IFREG | 0o644, 0, C)
                .unwrap()
                .ino;
            v.setxattr(f, b"user.x", b"1", false, false).unwrap();
            let v2 = damaged(&v, &dev, |d| {
                let mut i = inode_of(d, f);
                i.xattr_block = bad;
                wr(d, f, &i.encode());
            });
            if bad == 0 {
                // 0 means "no attributes".
                assert!(v2.listxattr(f).unwrap().is_empty());
            } else {
                expect_eio(&v2, f, bad);
                assert_eq!(
                    v2.setxattr(f, b"user.y", b"2", false, false)
                        .unwrap_err()
                        .errno(),
                    libc::EIO,
                    "nothing is written through a bad pointer"
                );
            }
            v2.unmount().unwrap();
        }
        // A damaged chain: b's overflow block re-sealed with another owner, or its head's
        // two pointers swapped.
        let (dev, v) = fresh(64 << 20);
        let f = v
            .mknod(v.root_ino(), b"f", libc::S_IFREG | 0o644, 0, C)
            .unwrap()
            .ino;
        v.setxattr(f, b"user.secret", &[5; 9000], false, false)
            .unwrap();
        v.sync().unwrap();
        let hb = inode_of(&dev, f).xattr_block;
        let head = Head::decode(&rd(&dev, hb), hb, Layout::V2).unwrap();
        assert_eq!(head.more.len(), 2);
        let m0 = head.more[0];
        let v2 = damaged(&v, &dev, |d| {
            let mut blk = rd(d, m0);
            let mut h = BlockHeader::decode(&blk).unwrap();
            h.owner = f + 1;
            h.seal(&mut blk);
            wr(d, m0, &blk);
        });
        expect_eio(&v2, f, m0);
        let v3 = damaged(&v2, &dev, |d| {
            let mut blk = rd(d, hb);
            blk[48..56].copy_from_slice(&head.more[1].to_le_bytes());
            blk[56..64].copy_from_slice(&m0.to_le_bytes());
            BlockHeader::decode(&rd(d, hb)).unwrap().seal(&mut blk);
            wr(d, hb, &blk);
        });
        expect_eio(&v3, f, hb);
        v3.unmount().unwrap();
    }

    #[test]
    fn bad_symlink_overflow_is_eio() {
        let (dev, v) = fresh(64 << 20);
        let r = v.root_ino();
        let s = v.symlink(r, b"s", &long_target(4000), C).unwrap().ino;
        let f = v.mknod(r, b"f", libc::S_IFREG | 0o644, 0, C).unwrap().ino;
        v.setxattr(f, b"user.x", b"1", false, false).unwrap();
        v.sync().unwrap();
        let fx = inode_of(&dev, f).xattr_block;
        let v2 = damaged(&v, &dev, |d| {
            let mut i = inode_of(d, s);
            i.overflow_block = fx;
            wr(d, s, &i.encode());
        });
        let e = v2.readlink(s).unwrap_err();
        assert_eq!(e.errno(), libc::EIO);
        assert!(e.to_string().contains(&format!("inode {s}")), "{e}");
        v2.unmount().unwrap();
    }

    /// A symlink whose size disagrees with its inline bytes when there is no overflow block
    /// (the pointer of a long target lost, or a damaged size) is EIO, not a shorter or longer
    /// target.
    #[test]
    fn symlink_size_mismatch_is_eio() {
        let (dev, v) = fresh(64 << 20);
        let r = v.root_ino();
        let long = v.symlink(r, b"long", &long_target(4000), C).unwrap().ino;
        let short = v.symlink(r, b"short", b"abc", C).unwrap().ino;
        v.sync().unwrap();
        let v2 = damaged(&v, &dev, |d| {
            let mut i = inode_of(d, long);
            i.overflow_block = 0;
            wr(d, long, &i.encode());
            let mut i = inode_of(d, short);
            i.size = 2;
            wr(d, short, &i.encode());
        });
        for ino in [long, short] {
            let e = v2.readlink(ino).unwrap_err();
            assert_eq!(e.errno(), libc::EIO);
            assert!(e.to_string().contains(&format!("inode {ino}")), "{e}");
        }
        v2.unmount().unwrap();
    }

    /// A volume of format version 1 (no `INCOMPAT_OVERFLOW`) mounts and keeps v1 limits and
    /// encodings, so a v1 binary can still use it.
    #[test]
    fn version_1_volume_keeps_its_limits() {
        let (dev, v) = fresh(64 << 20);
        let mut sb = v.superblock().clone();
        assert_eq!(sb.format_version(), 8);
        v.unmount().unwrap();
        sb.incompat = 0;
        sb.sharing = None;
        let raw = sb.encode();
        assert_eq!(&raw[8..12], &1u32.to_le_bytes(), "written as version 1");
        let d = Arc::new(MemDevice::from_image(dev.snapshot(), 512));
        wr(&d, 0, &raw);
        wr(&d, sb.backup_block, &raw);
        let v = Volume::mount(d.clone(), &MountOptions::default()).unwrap();
        let r = v.root_ino();
        assert_eq!(
            v.symlink(r, b"l", &long_target(INLINE_CAP + 1), C)
                .unwrap_err()
                .kind(),
            ErrorKind::NameTooLong
        );
        let l = v.symlink(r, b"l", &long_target(INLINE_CAP), C).unwrap();
        assert_eq!(v.readlink(l.ino).unwrap().len(), INLINE_CAP);
        assert_eq!(
            v.setxattr(r, b"user.big", &[1; 5000], false, false)
                .unwrap_err()
                .kind(),
            ErrorKind::NoSpace
        );
        v.setxattr(r, b"user.a", &[1; 3000], false, false).unwrap();
        assert_eq!(
            v.setxattr(r, b"user.b", &[1; 1100], false, false)
                .unwrap_err()
                .kind(),
            ErrorKind::NoSpace,
            "one block in all"
        );
        v.unmount().unwrap();
        let xb = inode_of(&d, r).xattr_block;
        let raw = rd(&d, xb);
        assert_eq!(&raw[42..44], &[0, 0], "v1's reserved field");
        assert_eq!(
            &raw[49..51],
            &3000u16.to_le_bytes(),
            "v1's u16 value length"
        );
        assert!(Head::decode(&raw, xb, Layout::V1).is_ok());
        assert_fsck_clean(&d);
    }
}
