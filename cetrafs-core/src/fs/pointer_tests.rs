//! Hostile pointers on disk (format/layout.rs): a re-checksummed extent, tree child, orphan
//! entry or journal home naming a block outside the data area is refused with EIO, and the
//! block it names is neither served nor written. And every name in a directory is listed,
//! even one whose inode cannot be loaded.

use super::*;
use crate::check::{check_volume, FindingKind};
use crate::dev::mem::MemDevice;
use crate::dev::BlockDevice;
use crate::format::dirent::{decode_entries, encode_entries, name_hash};
use crate::format::inode::Inode;
use crate::format::layout::Region;
use crate::format::tree_node::{NodeEntries, TreeNode};
use std::time::Duration;

const C: Caller = Caller::ROOT;

use super::multinode_tests::{node as mount, volume as formatted};

fn rd(dev: &dyn BlockDevice, b: u64) -> Vec<u8> {
    let mut buf = AlignedBuf::new(FS_BLOCK_SIZE);
    dev.read_at(b * FS_BLOCK, &mut buf).unwrap();
    buf.to_vec()
}

fn wr(dev: &dyn BlockDevice, b: u64, data: &[u8]) {
    dev.write_at(b * FS_BLOCK, &AlignedBuf::from_slice(data))
        .unwrap();
}

fn edit_inode(dev: &dyn BlockDevice, ino: u64, f: impl FnOnce(&mut Inode)) {
    let mut i = Inode::decode(&rd(dev, ino), ino).unwrap();
    f(&mut i);
    wr(dev, ino, &i.encode());
}

fn assert_eio(r: Result<impl std::fmt::Debug>, what: &str) -> Error {
    let e = r.expect_err(what);
    assert_eq!(e.errno(), libc::EIO, "{what}: {e}");
    e
}

/// Targets a damaged pointer may name: (block, region it must be classified as).
fn targets(sb: &Superblock) -> Vec<(u64, &'static str)> {
    assert!(sb.group_count >= 2, "the test volume needs two groups");
    vec![
        (0, "superblock"),
        (sb.group_first_block(1), "group header"),
        (sb.group_first_block(1) + 1, "bitmap"),
        // The last block of slot 0's journal: small transactions never reach it.
        (sb.journal_start + sb.journal_blocks - 1, "journal"),
    ]
}

#[test]
fn damaged_extent_is_eio_and_its_target_is_never_read_or_written() {
    let dev = formatted(3);
    let sb = crate::fs::read_superblock(&*dev).unwrap();
    for (target, what) in targets(&sb) {
        let img = Arc::new(MemDevice::from_image(dev.snapshot(), 512));
        let a = mount(&img, "a");
        let b = mount(&img, "b");
        let r = a.root_ino();
        let (f, fh) = a.create(r, what.as_bytes(), 0o644, C, true).unwrap();
        a.write(&fh, 0, &[0x5a; 8192]).unwrap();
        a.fsync(f.ino, false).unwrap();
        // b takes the metadata lock: a's metadata goes home and a's caches become stale.
        b.mkdir(r, b"d", 0o755, C).unwrap();
        b.sync().unwrap();
        // A third node changes the file's inode and leaves: a's copy of it is no longer valid
        // (v3: a gave its inode lock up; its next I/O reloads), and b has never loaded it.
        let c = mount(&img, "c");
        let chmod = SetAttr {
            mode: Some(0o600),
            ..Default::default()
        };
        c.setattr(f.ino, &chmod, C).unwrap();
        c.unmount().unwrap();
        edit_inode(&*img, f.ino, |i| i.inline_extents[0].physical = target);
        std::thread::sleep(Duration::from_millis(100));
        // (Group and journal blocks change legitimately when the nodes allocate or commit;
        // nothing between here and the comparison below may write any of them.)
        let before = rd(&*img, target);
        let sb_before = rd(&*img, 0);
        // a still has the file open: its next read and write see the damaged map.
        let e = assert_eio(
            a.read(&fh, 0, 8192, &mut |d| {
                assert!(
                    d.iter().all(|&x| x == 0x5a),
                    "served bytes of another block"
                );
            }),
            what,
        );
        assert!(e.context().contains(&format!("inode {}", f.ino)), "{e}");
        assert!(e.context().contains(&format!("block {target}")), "{e}");
        assert_eio(a.write(&fh, 0, &[0xa5; 4096]), what);
        assert_eio(a.write(&fh, 100, b"unaligned"), what);
        // b has never seen the file: stat, open, truncate and unlink all refuse.
        assert_eio(b.lookup(r, what.as_bytes()), what);
        assert_eio(b.open(f.ino, true, false), what);
        let trunc = SetAttr {
            size: Some(0),
            ..Default::default()
        };
        assert_eio(b.setattr(f.ino, &trunc, C), what);
        assert_eio(b.unlink(r, what.as_bytes()), what);
        // The last close cannot fold anything into the damaged inode either.
        assert_eio(a.release(&fh), what);
        assert_eq!(rd(&*img, target), before, "{what} block changed");
        a.unmount().unwrap();
        b.unmount().unwrap();
        assert_eq!(rd(&*img, 0), sb_before, "superblock changed");
        let report = check_volume(&*img).unwrap();
        assert!(
            report.has(FindingKind::BlockOutsideGroups),
            "{what}: {:?}",
            report.findings
        );
    }
}

#[test]
fn extent_running_into_the_next_group_header_is_refused() {
    let dev = formatted(1);
    let v = mount(&dev, "a");
    let r = v.root_ino();
    let (f, fh) = v.create(r, b"f", 0o644, C, true).unwrap();
    v.write(&fh, 0, &[1; 8192]).unwrap();
    v.release(&fh).unwrap();
    v.unmount().unwrap();
    let sb = v.superblock().clone();
    let header = sb.group_first_block(1);
    edit_inode(&*dev, f.ino, |i| i.inline_extents[0].physical = header - 1);
    assert_eq!(
        sb.bad_data_range(header - 1, 2),
        Some((header, Region::GroupHeader { group: 1 }))
    );
    let before = rd(&*dev, header);
    let v = mount(&dev, "a");
    let e = assert_eio(v.lookup(r, b"f"), "lookup");
    assert!(e.context().contains("header of group 1"), "{e}");
    v.unmount().unwrap();
    assert_eq!(rd(&*dev, header), before);
}

#[test]
fn tree_child_outside_the_data_area_is_eio() {
    let dev = formatted(1);
    let v = mount(&dev, "a");
    let r = v.root_ino();
    let d = v.mkdir(r, b"big", 0o755, C).unwrap();
    for i in 0..400 {
        v.mknod(
            d.ino,
            format!("entry-with-a-long-name-{i:05}").as_bytes(),
            libc::S_IFIFO | 0o644,
            0,
            C,
        )
        .unwrap();
    }
    v.unmount().unwrap();
    let sb = v.superblock().clone();
    let root = Inode::decode(&rd(&*dev, d.ino), d.ino).unwrap().tree_root;
    let mut top = TreeNode::decode(&rd(&*dev, root), root).unwrap();
    let NodeEntries::Internal(children) = &mut top.entries else {
        panic!("400 entries need more than one leaf")
    };
    let lock = sb.lock_start;
    children[0].1 = lock;
    wr(&*dev, root, &top.encode());
    let v = mount(&dev, "a");
    let e = assert_eio(v.readdir(d.ino, 0, &mut |_| true), "readdir");
    assert!(e.context().contains(&format!("inode {}", d.ino)), "{e}");
    assert!(e.context().contains(&format!("block {lock}")), "{e}");
    assert!(e.context().contains("lock area"), "{e}");
    v.unmount().unwrap();
    let report = check_volume(&*dev).unwrap();
    assert!(
        report.has(FindingKind::BlockOutsideGroups),
        "{:?}",
        report.findings
    );
}

#[test]
fn orphan_entry_naming_the_superblock_is_kept_and_not_followed() {
    let dev = formatted(1);
    let v = mount(&dev, "a");
    v.unmount().unwrap();
    let sb = v.superblock().clone();
    let at = sb.journal_start;
    let h = crate::format::slot_header::SlotHeader {
        seq: 5,
        slot: 0,
        orphans: vec![0, sb.group_first_block(1)],
    };
    wr(&*dev, at, &h.encode(at));
    let sb_before = rd(&*dev, 0);
    let header_before = rd(&*dev, sb.group_first_block(1));
    let v = mount(&dev, "a");
    let (_f, fh) = v.create(v.root_ino(), b"f", 0o644, C, true).unwrap();
    v.write(&fh, 0, &[7; 4096]).unwrap();
    v.release(&fh).unwrap();
    v.unmount().unwrap();
    assert_eq!(rd(&*dev, 0), sb_before);
    assert_eq!(rd(&*dev, sb.group_first_block(1)), header_before);
    let kept = crate::format::slot_header::SlotHeader::decode(&rd(&*dev, at), at, 0).unwrap();
    assert_eq!(kept.orphans, h.orphans, "damaged entries are left for fsck");
    let report = check_volume(&*dev).unwrap();
    let bad = report
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::BlockOutsideGroups)
        .count();
    assert_eq!(bad, 2, "{:?}", report.findings);
}

#[test]
fn journal_logging_the_superblock_is_not_replayed() {
    let dev = formatted(1);
    let v = mount(&dev, "a");
    v.unmount().unwrap();
    let sb = v.superblock().clone();
    // A well-formed transaction whose home is block 0, carrying a valid metadata image.
    let img = rd(&*dev, sb.root_ino);
    let area = crate::journal::JournalArea::for_slot(&sb, 0);
    crate::journal::write_tx(&*dev, area, 9, &[(0, &img)]).unwrap();
    let before = rd(&*dev, 0);
    let report = check_volume(&*dev).unwrap();
    assert!(report.has(FindingKind::BadJournal), "{:?}", report.findings);
    let e = Volume::mount(dev.clone(), &MountOptions::default()).unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert!(e.to_string().contains("logs block 0"), "{e}");
    assert_eq!(rd(&*dev, 0), before);
}

/// A directory entry whose inode is damaged (or names a free block) is still listed; a
/// lookup of it is EIO; a name removed in between is left out.
#[test]
fn unreadable_entries_are_listed_and_removed_ones_are_not() {
    let dev = formatted(1);
    let v = mount(&dev, "a");
    let r = v.root_ino();
    let bad = v.mknod(r, b"bad", libc::S_IFREG | 0o644, 0, C).unwrap();
    let dangling = v.mkdir(r, b"dangling", 0o755, C).unwrap();
    v.mknod(r, b"good", libc::S_IFREG | 0o644, 0, C).unwrap();
    let gone = v.mknod(r, b"gone", libc::S_IFREG | 0o644, 0, C).unwrap();
    v.unmount().unwrap();
    // "bad": checksum broken. "dangling": the entry names a free data block.
    let mut raw = rd(&*dev, bad.ino);
    raw[100] ^= 0xff;
    wr(&*dev, bad.ino, &raw);
    let free = {
        let sb = v.superblock();
        let g = sb.group_first_block(sb.group_count - 1);
        g + sb.group_blocks - 1
    };
    let root = Inode::decode(&rd(&*dev, r), r).unwrap();
    let mut leaf = TreeNode::decode(&rd(&*dev, root.tree_root), root.tree_root).unwrap();
    let NodeEntries::Leaf(entries) = &mut leaf.entries else {
        panic!("a small root directory is one leaf")
    };
    let key = name_hash(b"dangling");
    let slot = entries.iter_mut().find(|(k, _)| *k == key).unwrap();
    let mut list = decode_entries(&slot.1).unwrap();
    assert_eq!(list[0].ino, dangling.ino);
    list[0].ino = free;
    slot.1 = encode_entries(&list);
    wr(&*dev, root.tree_root, &leaf.encode());

    let v = mount(&dev, "a");
    let mut listed = Vec::new();
    v.readdir(r, 0, &mut |e| {
        listed.push(e.clone());
        true
    })
    .unwrap();
    let name_of = |e: &DirListEntry| String::from_utf8_lossy(&e.name).into_owned();
    let mut names: Vec<String> = listed.iter().map(name_of).collect();
    names.sort();
    assert_eq!(names, [".", "..", "bad", "dangling", "gone", "good"]);
    v.unlink(r, b"gone").unwrap();
    for e in &listed {
        let got = v.entry_attr(r, e);
        match name_of(e).as_str() {
            "bad" => assert_eq!(
                got,
                EntryAttr::Unreadable(Attr::placeholder(bad.ino, FileKind::Regular))
            ),
            "dangling" => assert_eq!(
                got,
                EntryAttr::Unreadable(Attr::placeholder(free, FileKind::Directory))
            ),
            "gone" => assert_eq!(got, EntryAttr::Gone, "{:?} was {}", e, gone.ino),
            _ => assert!(
                matches!(got, EntryAttr::Loaded(a) if a.ino == e.ino),
                "{e:?}"
            ),
        }
    }
    assert_eio(v.lookup(r, b"bad"), "lookup bad");
    let e = assert_eio(v.lookup(r, b"dangling"), "lookup dangling");
    assert!(e.context().contains("does not exist"), "{e}");
    v.unmount().unwrap();
}
