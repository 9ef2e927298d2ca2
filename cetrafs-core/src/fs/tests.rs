//! Namespace and data operations on the memory device, without FUSE.

use super::*;
use crate::dev::mem::MemDevice;
use crate::dev::BlockDevice;
use crate::mkfs::{format, MkfsOptions};
use std::collections::BTreeMap;

const C: Caller = Caller::ROOT;

pub(super) fn fresh(size: u64) -> (Arc<MemDevice>, Arc<Volume>) {
    fresh_with(size, &MountOptions::default())
}

/// [`fresh`], mounted with `opts`.
pub(super) fn fresh_with(size: u64, opts: &MountOptions) -> (Arc<MemDevice>, Arc<Volume>) {
    let dev = Arc::new(MemDevice::new(size, 512));
    let mk = MkfsOptions {
        max_nodes: 2,
        journal_bytes: 1 << 20,
        ..Default::default()
    };
    format(&*dev, &mk, &mut |_, _| {}).unwrap();
    let v = Volume::mount(dev.clone(), opts).unwrap();
    (dev, v)
}

pub(super) fn remount(dev: &MemDevice, v: &Volume) -> (Arc<MemDevice>, Arc<Volume>) {
    v.unmount().unwrap();
    let d2 = Arc::new(MemDevice::from_image(dev.snapshot(), 512));
    let v2 = Volume::mount(d2.clone(), &MountOptions::default()).unwrap();
    (d2, v2)
}

fn read_all(v: &Volume, fh: &OpenFile, off: u64, len: u32) -> Vec<u8> {
    let mut out = Vec::new();
    v.read(fh, off, len, &mut |d| out.extend_from_slice(d))
        .unwrap();
    out
}

pub(super) fn names(v: &Volume, dir: Ino) -> Vec<String> {
    let mut out = Vec::new();
    v.readdir(dir, 0, &mut |e| {
        out.push(String::from_utf8_lossy(&e.name).into_owned());
        true
    })
    .unwrap();
    out.sort();
    out
}

#[test]
fn file_data_roundtrip_and_persistence() {
    let (dev, v) = fresh(256 << 20);
    let root = v.root_ino();
    let (a, fh) = v.create(root, b"f", 0o644, C, true).unwrap();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    v.write(&fh, 5, &data).unwrap();
    assert_eq!(v.getattr(a.ino).unwrap().size, 300_005);
    let back = read_all(&v, &fh, 0, 400_000);
    assert_eq!(back.len(), 300_005);
    assert_eq!(&back[..5], &[0; 5]);
    assert_eq!(&back[5..], &data[..]);
    // Overwrite aligned (fast path) and unaligned (slow path).
    v.write(&fh, 4096, &[7u8; 8192]).unwrap();
    v.write(&fh, 3, &[9u8; 3]).unwrap();
    let back = read_all(&v, &fh, 0, 20_000);
    assert_eq!(&back[3..6], &[9, 9, 9]);
    assert!(back[4096..12288].iter().all(|&b| b == 7));
    v.release(&fh).unwrap();
    let (_d2, v2) = remount(&dev, &v);
    let a2 = v2.lookup(v2.root_ino(), b"f").unwrap();
    assert_eq!(a2.size, 300_005);
    let fh2 = v2.open(a2.ino, false, false).unwrap();
    let back2 = read_all(&v2, &fh2, 0, 400_000);
    assert_eq!(&back2[3..6], &[9, 9, 9]);
    assert_eq!(
        &back2[20_000..],
        &back[..0]
            .iter()
            .chain(&data[19_995..])
            .copied()
            .collect::<Vec<_>>()[..]
    );
}

#[test]
fn holes_unwritten_punch_truncate() {
    let (_dev, v) = fresh(256 << 20);
    let (a, fh) = v.create(v.root_ino(), b"img", 0o600, C, true).unwrap();
    v.fallocate(a.ino, 0, 1 << 20, FallocMode::Allocate { keep_size: false })
        .unwrap();
    assert_eq!(v.getattr(a.ino).unwrap().size, 1 << 20);
    assert!(read_all(&v, &fh, 0, 1 << 20).iter().all(|&b| b == 0));
    assert_eq!(
        v.lseek(a.ino, 0, Whence::Data).unwrap_err().kind(),
        ErrorKind::NoSuchOffset
    );
    v.write(&fh, 10_000, b"hello").unwrap();
    let r = read_all(&v, &fh, 8192, 8192);
    assert_eq!(&r[1808..1813], b"hello");
    assert!(r[..1808].iter().all(|&b| b == 0) && r[1813..].iter().all(|&b| b == 0));
    assert_eq!(v.lseek(a.ino, 0, Whence::Data).unwrap(), 8192);
    assert_eq!(v.lseek(a.ino, 8192, Whence::Hole).unwrap(), 12288);
    v.fallocate(a.ino, 8192, 4096, FallocMode::PunchHole)
        .unwrap();
    assert!(read_all(&v, &fh, 8192, 4096).iter().all(|&b| b == 0));
    v.write(&fh, 0, &[1u8; 10_000]).unwrap();
    v.setattr(
        a.ino,
        &SetAttr {
            size: Some(5000),
            ..Default::default()
        },
        C,
    )
    .unwrap();
    v.setattr(
        a.ino,
        &SetAttr {
            size: Some(9000),
            ..Default::default()
        },
        C,
    )
    .unwrap();
    let r = read_all(&v, &fh, 0, 9000);
    assert!(r[..5000].iter().all(|&b| b == 1));
    assert!(
        r[5000..].iter().all(|&b| b == 0),
        "bytes past a truncation must read as zeros"
    );
    v.fallocate(a.ino, 1000, 2000, FallocMode::ZeroRange { keep_size: true })
        .unwrap();
    let r = read_all(&v, &fh, 0, 5000);
    assert!(r[1000..3000].iter().all(|&b| b == 0) && r[..1000].iter().all(|&b| b == 1));
    v.release(&fh).unwrap();
}

/// A file of written data, a hole, an unwritten extent and a short tail: its handle and size.
fn mixed_file(v: &Volume) -> (Arc<OpenFile>, u64) {
    let (a, fh) = v.create(v.root_ino(), b"img", 0o600, C, true).unwrap();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8 + 1).collect();
    v.write(&fh, 0, &data[..100_000]).unwrap();
    v.fallocate(
        a.ino,
        131_072,
        65_536,
        FallocMode::Allocate { keep_size: false },
    )
    .unwrap();
    v.write(&fh, 262_144, &data[100_000..103_001]).unwrap();
    let size = v.getattr(a.ino).unwrap().size;
    (fh, size)
}

#[test]
fn read_into_a_callers_buffer_reads_what_read_does() {
    let (_dev, v) = fresh(256 << 20);
    let (fh, size) = mixed_file(&v);
    let mut buf = crate::dev::AlignedBuf::new((1 << 20) + 4096);
    for (off, len) in [
        (0u64, 4096usize),
        (4096, 65_536),
        (98_304, 8192),
        (126_976, 12_288),
        (258_048, 8192),
        (262_144, 1 << 20),
        (size, 4096),
        // Not aligned (offset, length): read through the bounce buffer.
        (5, 100),
        (99_999, 3),
        (262_145, 4095),
    ] {
        let want = read_all(&v, &fh, off, u32::try_from(len).unwrap());
        // An aligned window, and a window one byte into the buffer (not aligned).
        for shift in [0usize, 1] {
            let dst = &mut buf[shift..shift + len];
            dst.fill(0xEE);
            let n = v.read_into(&fh, off, dst).unwrap();
            assert_eq!(n, want.len(), "offset {off} length {len} shift {shift}");
            assert_eq!(
                &buf[shift..shift + n],
                &want[..],
                "offset {off} length {len}"
            );
        }
    }
    v.release(&fh).unwrap();
}

#[test]
fn an_aligned_overwrite_goes_from_the_callers_buffer() {
    let (_dev, v) = fresh(256 << 20);
    let (_a, fh) = v.create(v.root_ino(), b"img", 0o600, C, true).unwrap();
    v.write(&fh, 0, &vec![7u8; 1 << 20]).unwrap();
    // Page-aligned data into written extents: the fast path writes it without a copy.
    let mut buf = crate::dev::AlignedBuf::new(3 * 4096);
    for (i, b) in buf.iter_mut().enumerate() {
        *b = u8::try_from(i % 249).unwrap();
    }
    v.write(&fh, 40_960, &buf[..12_288]).unwrap();
    let back = read_all(&v, &fh, 36_864, 20_480);
    assert!(back[..4096].iter().all(|&b| b == 7));
    assert_eq!(&back[4096..16_384], &buf[..12_288]);
    assert!(back[16_384..].iter().all(|&b| b == 7));
    v.release(&fh).unwrap();
}

#[test]
fn a_batch_of_reads_answers_what_read_does() {
    let (_dev, v) = fresh(256 << 20);
    let (fh, size) = mixed_file(&v);
    // A first read admits the inode to the data path (takes its lock shared): a batch only
    // takes reads that need no wait.
    read_all(&v, &fh, 0, 4096);
    let reqs = [
        (0u64, 4096usize),
        (4096, 65_536),
        (98_304, 8192),
        (126_976, 12_288),
        (258_048, 8192),
        (262_144, 1 << 20),
        (size.next_multiple_of(4096), 4096),
        (size.next_multiple_of(4096) + (1 << 20), 4096),
        (0, 4096),
    ];
    let mut bufs: Vec<crate::dev::AlignedBuf> = reqs
        .iter()
        .map(|&(_, len)| crate::dev::AlignedBuf::new(len + 4096))
        .collect();
    let mut batch: Vec<BatchRead<'_>> = reqs
        .iter()
        .zip(bufs.iter_mut())
        .enumerate()
        .map(|(i, (&(offset, len), b))| {
            b.fill(0xEE);
            // The last one is one byte into its buffer: not for the device, left alone.
            let shift = usize::from(i == reqs.len() - 1);
            BatchRead {
                fh: &fh,
                offset,
                dst: &mut b[shift..shift + len],
                done: None,
            }
        })
        .collect();
    v.read_batch(&mut batch);
    let done: Vec<Option<usize>> = batch
        .into_iter()
        .map(|b| b.done.map(Result::unwrap))
        .collect();
    assert_eq!(
        done[reqs.len() - 1],
        None,
        "a misaligned buffer is left alone"
    );
    for (i, &(off, len)) in reqs.iter().enumerate().take(reqs.len() - 1) {
        let want = read_all(&v, &fh, off, u32::try_from(len).unwrap());
        assert_eq!(done[i], Some(want.len()), "offset {off} length {len}");
        assert_eq!(
            &bufs[i][..want.len()],
            &want[..],
            "offset {off} length {len}"
        );
    }
    v.release(&fh).unwrap();
}

#[test]
fn a_batch_of_writes_takes_only_fast_path_overwrites() {
    let (_dev, v) = fresh(256 << 20);
    let (a, fh) = v.create(v.root_ino(), b"img", 0o600, C, true).unwrap();
    v.write(&fh, 0, &vec![7u8; 1 << 20]).unwrap();
    // A hole from 1 MiB to 2 MiB, then written data to 2 MiB + 64 KiB.
    v.write(&fh, 2 << 20, &vec![7u8; 65_536]).unwrap();
    read_all(&v, &fh, 0, 4096);
    let size = v.getattr(a.ino).unwrap().size;
    let mut bufs: Vec<crate::dev::AlignedBuf> = (0..6u8)
        .map(|i| {
            let mut b = crate::dev::AlignedBuf::new(2 * 8192);
            b.fill(0x30 + i);
            b
        })
        .collect();
    let reqs: [(u64, usize); 6] = [
        (40_960, 8192),           // overwrite: taken
        (1 << 20, 8192),          // into the hole: allocates, left alone
        (size - 4096, 8192),      // past EOF: left alone
        ((2 << 20) + 4096, 4096), // overwrite after the hole: taken
        (81_920, 4096),           // misaligned data: left alone
        (40_960 + 8192, 4096),    // next to the first: taken
    ];
    let mut batch: Vec<BatchWrite<'_>> = reqs
        .iter()
        .zip(bufs.iter_mut())
        .enumerate()
        .map(|(i, (&(offset, len), b))| {
            let shift = usize::from(i == 4);
            BatchWrite {
                fh: &fh,
                offset,
                data: &b[shift..shift + len],
                who: &C,
                done: None,
            }
        })
        .collect();
    v.write_batch(&mut batch);
    let done: Vec<Option<u32>> = batch
        .into_iter()
        .map(|b| b.done.map(Result::unwrap))
        .collect();
    assert_eq!(done, [Some(8192), None, None, Some(4096), None, Some(4096)]);
    for (i, &(off, len)) in reqs.iter().enumerate() {
        let got = read_all(&v, &fh, off, u32::try_from(len).unwrap());
        let mark = 0x30 + u8::try_from(i).unwrap();
        if done[i].is_some() {
            assert!(got.iter().all(|&x| x == mark), "write {i} landed");
        } else {
            assert!(!got.contains(&mark), "write {i} left alone");
        }
    }
    v.release(&fh).unwrap();
}

#[test]
fn namespace_operations() {
    let (dev, v) = fresh(256 << 20);
    let r = v.root_ino();
    let d = v.mkdir(r, b"d", 0o755, C).unwrap();
    let e = v.mkdir(d.ino, b"e", 0o755, C).unwrap();
    assert_eq!(v.getattr(d.ino).unwrap().nlink, 3);
    let f = v.mknod(d.ino, b"f", libc::S_IFREG | 0o644, 0, C).unwrap();
    v.link(f.ino, r, b"hard").unwrap();
    assert_eq!(v.getattr(f.ino).unwrap().nlink, 2);
    v.symlink(r, b"s", b"d/f", C).unwrap();
    assert_eq!(v.readlink(v.lookup(r, b"s").unwrap().ino).unwrap(), b"d/f");
    assert_eq!(v.rmdir(r, b"d").unwrap_err().kind(), ErrorKind::NotEmpty);
    assert_eq!(
        v.rename(r, b"d", e.ino, b"x", RenameFlags::default())
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidInput
    );
    v.rename(d.ino, b"f", r, b"hard", RenameFlags::default())
        .unwrap(); // same inode: no-op
    v.rename(d.ino, b"f", r, b"g", RenameFlags::default())
        .unwrap();
    assert_eq!(names(&v, d.ino), [".", "..", "e"]);
    assert_eq!(
        v.rename(
            r,
            b"g",
            r,
            b"hard",
            RenameFlags {
                noreplace: true,
                ..RenameFlags::default()
            }
        )
        .unwrap_err()
        .kind(),
        ErrorKind::Exists
    );
    v.rename(r, b"s", d.ino, b"e2", RenameFlags::default())
        .unwrap();
    v.rename(
        r,
        b"g",
        d.ino,
        b"e",
        RenameFlags {
            exchange: true,
            ..RenameFlags::default()
        },
    )
    .unwrap();
    assert_eq!(v.lookup(r, b"g").unwrap().ino, e.ino);
    assert_eq!(v.getattr(e.ino).unwrap().nlink, 2);
    assert_eq!(
        v.getattr(d.ino).unwrap().nlink,
        2,
        "d lost subdir e to the root"
    );
    assert_eq!(v.getattr(r).unwrap().nlink, 4);
    assert_eq!(v.lookup(e.ino, b"..").unwrap().ino, r);
    v.unlink(r, b"hard").unwrap();
    v.unlink(d.ino, b"e").unwrap();
    assert_eq!(v.getattr(f.ino).unwrap_err().kind(), ErrorKind::NotFound);
    v.setxattr(r, b"user.a", b"1", true, false).unwrap();
    assert_eq!(
        v.setxattr(r, b"user.a", b"1", true, false)
            .unwrap_err()
            .kind(),
        ErrorKind::Exists
    );
    assert_eq!(
        v.setxattr(r, b"bogus.a", b"1", false, false)
            .unwrap_err()
            .kind(),
        ErrorKind::Unsupported
    );
    assert_eq!(v.getxattr(r, b"user.a").unwrap(), b"1");
    let (_d2, v2) = remount(&dev, &v);
    assert_eq!(names(&v2, r), [".", "..", "d", "g"]);
    assert_eq!(v2.getxattr(r, b"user.a").unwrap(), b"1");
    v2.removexattr(r, b"user.a").unwrap();
    assert!(v2.listxattr(r).unwrap().is_empty());
}

#[test]
fn open_unlinked_file_lives_until_close() {
    let (_dev, v) = fresh(256 << 20);
    let r = v.root_ino();
    v.mknod(r, b"first", libc::S_IFREG | 0o644, 0, C).unwrap(); // gives the root its entry tree
    let free0 = v.statfs().unwrap().bfree;
    let (a, fh) = v.create(r, b"tmp", 0o644, C, true).unwrap();
    v.write(&fh, 0, &vec![5u8; 1 << 20]).unwrap();
    v.unlink(r, b"tmp").unwrap();
    assert_eq!(v.lookup(r, b"tmp").unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(read_all(&v, &fh, 0, 10), vec![5u8; 10]);
    v.write(&fh, 0, b"x").unwrap();
    assert_eq!(v.getattr(a.ino).unwrap().nlink, 0);
    v.release(&fh).unwrap();
    assert_eq!(v.statfs().unwrap().bfree, free0);
}

#[test]
fn big_directory_and_many_extents() {
    let (dev, v) = fresh(512 << 20);
    let r = v.root_ino();
    let d = v.mkdir(r, b"big", 0o755, C).unwrap();
    let mut model = BTreeMap::new();
    for i in 0..5000u32 {
        let n = format!("file-{i:06}");
        let a = v
            .mknod(d.ino, n.as_bytes(), libc::S_IFREG | 0o644, 0, C)
            .unwrap();
        model.insert(n, a.ino);
    }
    for i in (0..5000u32).step_by(3) {
        let n = format!("file-{i:06}");
        v.unlink(d.ino, n.as_bytes()).unwrap();
        model.remove(&n);
    }
    let got: Vec<String> = names(&v, d.ino)
        .into_iter()
        .filter(|n| n != "." && n != "..")
        .collect();
    assert_eq!(got, model.keys().cloned().collect::<Vec<_>>());
    // Fragmented file: every other block written -> > 160 extents -> extent tree.
    let (f, fh) = v.create(r, b"frag", 0o644, C, true).unwrap();
    for i in 0..600u64 {
        v.write(&fh, i * 8192, &[i.to_le_bytes()[0]; 4096]).unwrap();
        // Interleave another allocation so blocks are not contiguous.
        v.mknod(r, format!("x{i}").as_bytes(), libc::S_IFREG, 0, C)
            .unwrap();
    }
    assert!(v.extents(f.ino).unwrap().len() > 160);
    v.release(&fh).unwrap();
    let (_d2, v2) = remount(&dev, &v);
    let fh2 = v2.open(f.ino, true, false).unwrap();
    for i in (0..600u64).step_by(37) {
        assert_eq!(
            read_all(&v2, &fh2, i * 8192, 8192),
            [vec![i.to_le_bytes()[0]; 4096], vec![0; 4096]].concat()
        );
    }
    v2.setattr(
        f.ino,
        &SetAttr {
            size: Some(0),
            ..Default::default()
        },
        C,
    )
    .unwrap();
    assert!(v2.extents(f.ino).unwrap().is_empty());
    v2.release(&fh2).unwrap();
    let got: Vec<String> = names(&v2, d.ino)
        .into_iter()
        .filter(|n| n != "." && n != "..")
        .collect();
    assert_eq!(got.len(), model.len());
}

#[test]
fn immutable_flag() {
    let (_dev, v) = fresh(256 << 20);
    let r = v.root_ino();
    let (a, fh) = v.create(r, b"t", 0o644, C, true).unwrap();
    v.set_flags(a.ino, crate::format::inode::flags::IMMUTABLE)
        .unwrap();
    assert_eq!(
        v.write(&fh, 0, b"x").unwrap_err().kind(),
        ErrorKind::PermissionDenied
    );
    assert_eq!(
        v.unlink(r, b"t").unwrap_err().kind(),
        ErrorKind::PermissionDenied
    );
    assert_eq!(
        v.open(a.ino, true, false).unwrap_err().kind(),
        ErrorKind::PermissionDenied
    );
    v.set_flags(a.ino, 0).unwrap();
    v.unlink(r, b"t").unwrap();
    v.release(&fh).unwrap();
}

#[test]
fn corrupt_superblock_falls_back_to_backup_then_fails_clearly() {
    let (dev, v) = fresh(256 << 20);
    v.unmount().unwrap();
    dev.write_at(512, &[0xffu8; 512]).unwrap();
    let v2 = Volume::mount(dev.clone(), &MountOptions::default()).unwrap();
    v2.unmount().unwrap();
    let sb = v2.superblock().clone();
    dev.write_at(sb.backup_block * 4096, &[0u8; 4096]).unwrap();
    let e = Volume::mount(dev.clone(), &MountOptions::default()).unwrap_err();
    assert!(e.to_string().contains("damaged CetraFS superblock"), "{e}");
    let zero = Arc::new(MemDevice::new(64 << 20, 512));
    let e = Volume::mount(zero, &MountOptions::default()).unwrap_err();
    assert!(e.to_string().contains("not a CetraFS volume"), "{e}");
}

/// A crash image must check clean with its orphans reported; `between` runs on the next
/// mount of it; afterwards it must check clean with no orphan left.
pub(super) fn crashed_image_recovers(image: Vec<u8>, between: impl FnOnce(&Volume)) {
    let crashed = Arc::new(MemDevice::from_image(image, 512));
    let report = crate::check::check_volume(&*crashed).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
    assert!(report.has(crate::check::FindingKind::Orphan));
    let v2 = Volume::mount(crashed.clone(), &MountOptions::default()).unwrap();
    between(&v2);
    v2.unmount().unwrap();
    let report = crate::check::check_volume(&*crashed).unwrap();
    assert!(
        report.is_clean() && !report.has(crate::check::FindingKind::Orphan),
        "{:?}",
        report.findings
    );
}

#[test]
fn orphans_survive_a_crash_and_are_freed_by_the_next_mount() {
    let (dev, v) = fresh(256 << 20);
    let r = v.root_ino();
    v.mknod(r, b"keep", libc::S_IFREG | 0o644, 0, C).unwrap();
    v.sync().unwrap();
    let free0 = v.statfs().unwrap().bfree;
    let (a, fh) = v.create(r, b"tmp", 0o644, C, true).unwrap();
    v.write(&fh, 0, &vec![3u8; 300_000]).unwrap();
    v.unlink(r, b"tmp").unwrap();
    v.fsync(a.ino, false).unwrap();
    // Crash: the file is still open, nameless, and holds blocks. (The original volume is
    // then shut down on its own device; the snapshot is the crashed one.)
    let image = dev.snapshot();
    v.release(&fh).unwrap();
    v.unmount().unwrap();
    crashed_image_recovers(image, |v2| {
        assert_eq!(
            v2.statfs().unwrap().bfree,
            free0,
            "the orphan's blocks come back"
        );
    });
}

#[test]
fn rmdir_of_a_referenced_directory_at_a_crash_checks_clean() {
    // Found by the SIGKILL storm in CI: the kernel still held a lookup on an rmdir'd
    // directory when the daemon died, so the directory sat on the orphan list with nlink
    // 0, and fsck wanted 2 (the count of a live directory).
    let (dev, v) = fresh(256 << 20);
    let r = v.root_ino();
    let d = v.mkdir(r, b"gone", 0o755, C).unwrap();
    v.note_lookup(d.ino);
    v.rmdir(r, b"gone").unwrap();
    v.sync().unwrap();
    let image = dev.snapshot();
    v.forget(d.ino, 1);
    v.unmount().unwrap();
    crashed_image_recovers(image, |_| {});
}

#[test]
fn inode_numbers_are_not_reused_while_the_kernel_holds_them() {
    let (dev, v) = fresh(256 << 20);
    let r = v.root_ino();
    let d = v.mkdir(r, b"a", 0o755, C).unwrap();
    v.note_lookup(d.ino); // the kernel got an entry for it
    v.rmdir(r, b"a").unwrap();
    v.sync().unwrap(); // commit point: quarantine released
    for i in 0..50 {
        let x = v.mkdir(r, format!("n{i}").as_bytes(), 0o755, C).unwrap();
        assert_ne!(
            x.ino, d.ino,
            "inode number reused while the kernel still references it"
        );
    }
    assert_eq!(
        v.getattr(d.ino).unwrap().nlink,
        0,
        "still answerable, with no links"
    );
    v.forget(d.ino, 1);
    assert_eq!(v.getattr(d.ino).unwrap_err().kind(), ErrorKind::NotFound);
    let report = {
        v.unmount().unwrap();
        crate::check::check_volume(&*dev).unwrap()
    };
    assert!(report.is_clean(), "{:?}", report.findings);
}

#[test]
fn rename_whiteout_leaves_a_char_device_0_0_at_the_source() {
    let (dev, v) = fresh(256 << 20);
    let r = v.root_ino();
    let d = v.mkdir(r, b"d", 0o2775, C).unwrap();
    v.setattr(
        d.ino,
        &SetAttr {
            gid: Some(42),
            ..SetAttr::default()
        },
        C,
    )
    .unwrap();
    let f = v.mknod(d.ino, b"f", libc::S_IFREG | 0o644, 0, C).unwrap();
    let who = Caller {
        uid: 7,
        gid: 8,
        umask: 0,
    };
    let wflags = RenameFlags {
        whiteout: Some(who),
        ..RenameFlags::default()
    };
    v.rename(d.ino, b"f", r, b"g", wflags).unwrap();
    assert_eq!(v.lookup(r, b"g").unwrap().ino, f.ino);
    let w = v.lookup(d.ino, b"f").unwrap();
    assert_eq!(w.kind, FileKind::CharDevice);
    assert_eq!((w.rdev, w.perm, w.nlink), (0, 0, 1));
    // Owned by the caller; the setgid directory passes its group on, as for any new inode.
    assert_eq!((w.uid, w.gid), (7, 42));
    assert_ne!(w.ino, f.ino);
    // Over an existing target, with NOREPLACE refused, with EXCHANGE invalid.
    v.mknod(r, b"h", libc::S_IFREG | 0o644, 0, C).unwrap();
    let nr = RenameFlags {
        noreplace: true,
        ..wflags
    };
    assert_eq!(
        v.rename(r, b"g", r, b"h", nr).unwrap_err().kind(),
        ErrorKind::Exists
    );
    let ex = RenameFlags {
        exchange: true,
        ..wflags
    };
    assert_eq!(
        v.rename(r, b"g", r, b"h", ex).unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
    v.rename(r, b"g", r, b"h", wflags).unwrap();
    assert_eq!(v.lookup(r, b"h").unwrap().ino, f.ino);
    assert_eq!(v.lookup(r, b"g").unwrap().kind, FileKind::CharDevice);
    assert_eq!(names(&v, r), [".", "..", "d", "g", "h"]);
    let (d2, v2) = remount(&dev, &v);
    assert_eq!(v2.lookup(d.ino, b"f").unwrap().kind, FileKind::CharDevice);
    v2.unmount().unwrap();
    let report = crate::check::check_volume(&*d2).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
}

/// A caller without `CAP_FSETID`, in group 100 only.
struct Unprivileged;
impl Credentials for Unprivileged {
    fn has_fsetid(&self) -> bool {
        false
    }
    fn in_group(&self, gid: u32) -> bool {
        gid == 100
    }
}

#[test]
fn unprivileged_write_truncate_and_chown_drop_setuid_in_the_same_update() {
    let (dev, v) = fresh(256 << 20);
    let r = v.root_ino();
    let mode_of = |v: &Volume, ino| u32::from(v.getattr(ino).unwrap().perm);
    let setup = |name: &[u8], mode: u32, gid: u32| {
        let (a, fh) = v.create(r, name, 0o644, C, true).unwrap();
        v.write(&fh, 0, &[1u8; 8192]).unwrap();
        let set = SetAttr {
            mode: Some(mode),
            gid: Some(gid),
            ..SetAttr::default()
        };
        v.setattr(a.ino, &set, C).unwrap();
        (a.ino, fh)
    };
    // Aligned overwrite inside written blocks: the fast path unless bits must go.
    let (a, fh) = setup(b"suid", 0o6777, 0);
    let w = v
        .write_by(&fh, WriteAt::Offset(0), &[2u8; 4096], &Unprivileged)
        .unwrap();
    assert_eq!((w.bytes, w.dropped), (4096, 0o6000));
    assert_eq!(mode_of(&v, a), 0o777);
    let w = v
        .write_by(&fh, WriteAt::Offset(0), &[3u8; 4096], &Unprivileged)
        .unwrap();
    assert_eq!(w.dropped, 0);
    // Setgid without group-exec, writer in the file's group: kept (mandatory-lock marker).
    let (b, fhb) = setup(b"mand", 0o2767, 100);
    assert_eq!(
        v.write_by(&fhb, WriteAt::Offset(0), &[2u8; 4096], &Unprivileged)
            .unwrap()
            .dropped,
        0
    );
    assert_eq!(mode_of(&v, b), 0o2767);
    // ... and by root: kept.
    let (c, fhc) = setup(b"root", 0o6777, 0);
    v.write(&fhc, 0, &[2u8; 4096]).unwrap();
    assert_eq!(mode_of(&v, c), 0o6777);
    // Truncate and open(O_TRUNC) as a truncate by the caller.
    let trunc = SetAttr {
        size: Some(1),
        ..SetAttr::default()
    };
    v.setattr_by(c, &trunc, &Unprivileged).unwrap();
    assert_eq!(mode_of(&v, c), 0o777);
    let (d, fhd) = setup(b"otrunc", 0o2777, 100);
    let o = v.open_by(d, true, true, &Unprivileged).unwrap();
    assert_eq!((mode_of(&v, d), v.getattr(d).unwrap().size), (0o777, 0));
    // Chown: setuid goes even for root; setgid without group-exec stays for root.
    let (e, fhe) = setup(b"chown", 0o6767, 0);
    let chown = SetAttr {
        uid: Some(5),
        ..SetAttr::default()
    };
    v.setattr(e, &chown, C).unwrap();
    assert_eq!(mode_of(&v, e), 0o2767);
    v.setattr_by(e, &chown, &Unprivileged).unwrap();
    assert_eq!(mode_of(&v, e), 0o767, "not in group 0");
    for h in [fh, fhb, fhc, fhd, fhe, o] {
        v.release(&h).unwrap();
    }
    // The dropped bits are on the device (same transaction as the write's update).
    let (_d2, v2) = remount(&dev, &v);
    assert_eq!(mode_of(&v2, a), 0o777);
    assert_eq!(mode_of(&v2, b), 0o2767);
    v2.unmount().unwrap();
}

/// The kernel's `posix_acl_xattr` bytes of `entries` (tag, perm, id).
fn acl_bytes(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

#[test]
fn acls_are_kept_in_step_inside_the_changes_own_transaction() {
    const U: u32 = u32::MAX;
    let (dev, v) = fresh(256 << 20);
    let root = v.root_ino();
    let masked = Caller { umask: 0o022, ..C };
    // No default ACL: the umask applies (and not to symlinks).
    let plain = v.mkdir(root, b"plain", 0o777, masked).unwrap();
    assert_eq!(plain.perm & 0o777, 0o755);
    let l = v.symlink(root, b"l", b"plain", masked).unwrap();
    assert_eq!(l.perm & 0o777, 0o777);
    // A default ACL: the umask is ignored, a file gets it as its access ACL (masked by the
    // mode), a directory also inherits the default ACL itself.
    let d = v.mkdir(root, b"d", 0o755, C).unwrap();
    let default = acl_bytes(&[
        (0x01, 7, U),
        (0x02, 6, 1000),
        (0x04, 5, U),
        (0x10, 7, U),
        (0x20, 0, U),
    ]);
    v.setxattr(d.ino, acl::DEFAULT, &default, false, false)
        .unwrap();
    let (f, fh) = v.create(d.ino, b"f", 0o664, masked, true).unwrap();
    v.release(&fh).unwrap();
    assert_eq!(
        f.perm & 0o777,
        0o660,
        "mode = mode & ACL (owner 7, mask 7 & 6, other 0)"
    );
    let access = v.getxattr(f.ino, acl::ACCESS).unwrap();
    let a = acl::Acl::decode(&access).unwrap();
    assert_eq!(a.mode_bits(), 0o660);
    assert!(
        v.getxattr(f.ino, acl::DEFAULT).is_err(),
        "files get no default ACL"
    );
    let sub = v.mkdir(d.ino, b"sub", 0o777, masked).unwrap();
    assert_eq!(v.getxattr(sub.ino, acl::DEFAULT).unwrap(), default);
    assert_eq!(sub.perm & 0o777, 0o770);
    // chmod: the ACL's owner/mask/other follow the mode, in the chmod's transaction.
    let set = SetAttr {
        mode: Some(0o640),
        ..SetAttr::default()
    };
    v.setattr(f.ino, &set, C).unwrap();
    let a = acl::Acl::decode(&v.getxattr(f.ino, acl::ACCESS).unwrap()).unwrap();
    assert_eq!(a.mode_bits(), 0o640);
    // setfacl: the mode follows the ACL; one that says no more than the mode is not stored.
    let minimal = acl_bytes(&[(0x01, 6, U), (0x04, 4, U), (0x20, 4, U)]);
    v.setxattr(f.ino, acl::ACCESS, &minimal, false, false)
        .unwrap();
    assert_eq!(v.getattr(f.ino).unwrap().perm & 0o777, 0o644);
    assert!(v.getxattr(f.ino, acl::ACCESS).is_err());
    assert_eq!(
        v.setxattr(f.ino, acl::ACCESS, b"junk", false, false)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidInput
    );
    // Everything above survives a remount (it was committed with the changes).
    let (_d2, v2) = remount(&dev, &v);
    assert_eq!(v2.getattr(f.ino).unwrap().perm & 0o777, 0o644);
    assert_eq!(v2.getxattr(sub.ino, acl::DEFAULT).unwrap(), default);
}

/// A truncate whose frees reach a group bitmap that cannot be read fails with nothing freed:
/// before, the runs in groups already loaded were freed (and committed) while the inode on
/// disk still mapped them, so they could be handed out twice.
#[test]
fn a_truncate_that_cannot_read_a_bitmap_frees_nothing() {
    use std::sync::atomic::Ordering;
    let (dev, v) = fresh(512 << 20);
    let root = v.root_ino();
    let (big, fh) = v.create(root, b"big", 0o644, C, true).unwrap();
    let chunk = vec![0x5au8; 1 << 20];
    for i in 0..200u64 {
        v.write(&fh, i << 20, &chunk).unwrap();
    }
    v.release(&fh).unwrap();
    let groups: std::collections::BTreeSet<u64> = v
        .extents(big.ino)
        .unwrap()
        .iter()
        .map(|e| (e.physical - v.sb.group_start) / v.sb.group_blocks)
        .collect();
    assert!(
        groups.len() >= 2,
        "the file spans one group only: {groups:?}"
    );
    let (dev, v) = remount(&dev, &v);
    // Load the inode and its extents, and one group's bitmap (a small allocating write
    // lands in the first group the big file uses, or another loaded one).
    let fh = v.open(big.ino, true, false).unwrap();
    let (_, small) = v.create(root, b"small", 0o644, C, true).unwrap();
    v.write(&small, 0, &[1u8; 4096]).unwrap();
    v.release(&small).unwrap();
    let free_before = v.statfs().unwrap().bfree;
    dev.faults.fail_reads.store(true, Ordering::SeqCst);
    let set = SetAttr {
        size: Some(0),
        ..SetAttr::default()
    };
    assert!(v.setattr(big.ino, &set, C).is_err());
    dev.faults.fail_reads.store(false, Ordering::SeqCst);
    assert_eq!(v.statfs().unwrap().bfree, free_before, "nothing was freed");
    v.release(&fh).unwrap();
    let (d2, v2) = remount(&dev, &v);
    assert_eq!(v2.getattr(big.ino).unwrap().size, 200 << 20);
    let fh = v2.open(big.ino, false, false).unwrap();
    assert_eq!(read_all(&v2, &fh, (199 << 20) + 17, 5), vec![0x5a; 5]);
    v2.release(&fh).unwrap();
    v2.unmount().unwrap();
    let r = crate::check::check_volume(&*d2).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
}

/// A granule's zeros reach the device, offloaded (`BlockDevice::write_zeroes` for the whole
/// blocks around the data: `MemDevice` offloads) or in the write's buffer (a device that does
/// not: `RecordingDevice`): blocks that held something before read as zeros in a new image.
#[test]
fn a_new_granule_reads_zeros_where_old_contents_were() {
    use super::data::{GRANULE_MIN_SIZE, MAX_ALLOC_GRANULE as ALLOC_GRANULE};
    use crate::dev::record::RecordingDevice;
    let size = 256u64 << 20;
    for offloaded in [true, false] {
        let stale = || MemDevice::from_image(vec![0xEE; usize::try_from(size).unwrap()], 512);
        let dev: crate::dev::SharedDevice = if offloaded {
            Arc::new(stale())
        } else {
            Arc::new(RecordingDevice::new(stale()))
        };
        assert_eq!(dev.offloads_zeroes(), offloaded);
        let mk = MkfsOptions {
            max_nodes: 2,
            journal_bytes: 1 << 20,
            ..Default::default()
        };
        format(&*dev, &mk, &mut |_, _| {}).unwrap();
        let opts = MountOptions {
            alloc_granule: ALLOC_GRANULE,
            ..MountOptions::default()
        };
        let v = Volume::mount(dev.clone(), &opts).unwrap();
        let (img, fh) = v.create(v.root_ino(), b"disk.raw", 0o644, C, true).unwrap();
        let truncate = SetAttr {
            size: Some(GRANULE_MIN_SIZE),
            ..SetAttr::default()
        };
        v.setattr(img.ino, &truncate, C).unwrap();
        let granule = usize::try_from(ALLOC_GRANULE).unwrap();
        // A first write at a granule's start, one unaligned in its middle, one at its end.
        for (n, (k, at)) in [(0, 0), (3, granule / 2 + 512), (7, granule - 4096)]
            .into_iter()
            .enumerate()
        {
            let n = n as u64;
            let g = k * ALLOC_GRANULE;
            v.write(&fh, g + at as u64, &[7u8; 4096]).unwrap();
            let mut want = vec![0u8; granule];
            want[at..at + 4096].fill(7);
            let got = read_all(&v, &fh, g, u32::try_from(granule).unwrap());
            assert_eq!(
                v.getattr(img.ino).unwrap().blocks,
                (n + 1) * ALLOC_GRANULE / 512
            );
            assert!(
                got == want,
                "granule {k} (offloaded: {offloaded}): not zeros around the write"
            );
        }
        v.release(&fh).unwrap();
        v.unmount().unwrap();
    }
}

#[test]
fn an_image_sized_sparse_file_allocates_by_granule() {
    use super::data::{ALLOC_GRANULE, GRANULE_MIN_SIZE};
    let (dev, v0) = fresh(256 << 20);
    v0.unmount().unwrap();
    let granule = MountOptions {
        alloc_granule: ALLOC_GRANULE,
        ..MountOptions::default()
    };
    let v = Volume::mount(dev.clone(), &granule).unwrap();
    let root = v.root_ino();
    let sectors = |ino: Ino| v.getattr(ino).unwrap().blocks;
    let sectors2 = |v: &Volume, ino: Ino| v.getattr(ino).unwrap().blocks;
    let granule_sectors = ALLOC_GRANULE / 512;
    let (img, fh) = v.create(root, b"disk.raw", 0o644, C, true).unwrap();
    let size = GRANULE_MIN_SIZE + 8192;
    let truncate = SetAttr {
        size: Some(size),
        ..SetAttr::default()
    };
    v.setattr(img.ino, &truncate, C).unwrap();
    // First write into an untouched granule: the whole granule is allocated, zero-filled.
    let g = 5 * ALLOC_GRANULE;
    v.write(&fh, g + 8192, &[7u8; 4096]).unwrap();
    assert_eq!(sectors(img.ino), granule_sectors);
    let mut want = vec![0u8; usize::try_from(ALLOC_GRANULE).unwrap()];
    want[8192..12288].fill(7);
    let granule_len = u32::try_from(ALLOC_GRANULE).unwrap();
    assert_eq!(read_all(&v, &fh, g, granule_len), want);
    // Writes into it, aligned or not, allocate nothing more.
    v.write(&fh, g, &[8u8; 4096]).unwrap();
    v.write(&fh, g + 20_000, &[9u8; 100]).unwrap();
    assert_eq!(sectors(img.ino), granule_sectors);
    want[..4096].fill(8);
    want[20_000..20_100].fill(9);
    assert_eq!(read_all(&v, &fh, g, granule_len), want);
    // An unaligned first write: its head and tail are zeros, the rest of the granule too.
    let g2 = 9 * ALLOC_GRANULE;
    v.write(&fh, g2 + 5000, &[3u8; 3000]).unwrap();
    assert_eq!(sectors(img.ino), 2 * granule_sectors);
    let mut want2 = vec![0u8; usize::try_from(ALLOC_GRANULE).unwrap()];
    want2[5000..8000].fill(3);
    assert_eq!(read_all(&v, &fh, g2, granule_len), want2);
    // The granule at EOF is clipped to the file's size.
    let last = size - 4096;
    v.write(&fh, last, &[4u8; 4096]).unwrap();
    let tail_blocks = (size - GRANULE_MIN_SIZE) / 4096;
    assert_eq!(sectors(img.ino), 2 * granule_sectors + tail_blocks * 8);
    // A granule partly allocated by a write before the file was image-sized (or a punch)
    // allocates only the blocks written.
    let (small, sfh) = v.create(root, b"small", 0o644, C, true).unwrap();
    v.write(&sfh, 0, &[1u8; 4096]).unwrap();
    assert_eq!(
        sectors(small.ino),
        8,
        "a small file allocates exactly what is written"
    );
    v.setattr(small.ino, &truncate, C).unwrap();
    v.write(&sfh, 4096 * 3, &[2u8; 4096]).unwrap();
    assert_eq!(
        sectors(small.ino),
        16,
        "a granule partly allocated is not widened"
    );
    v.release(&fh).unwrap();
    v.release(&sfh).unwrap();
    // All of it survives a remount, and fsck finds the blocks accounted for.
    v.unmount().unwrap();
    let dev2 = Arc::new(MemDevice::from_image(dev.snapshot(), 512));
    let exact = MountOptions {
        alloc_granule: FS_BLOCK,
        ..MountOptions::default()
    };
    let v2 = Volume::mount(dev2.clone(), &exact).unwrap();
    // granule=4 allocates exactly what is written.
    let (plain, pfh) = v2.create(root, b"plain.raw", 0o644, C, true).unwrap();
    v2.setattr(plain.ino, &truncate, C).unwrap();
    v2.write(&pfh, g, &[5u8; 4096]).unwrap();
    assert_eq!(sectors2(&v2, plain.ino), 8);
    v2.release(&pfh).unwrap();
    let fh = v2.open(img.ino, false, false).unwrap();
    assert_eq!(read_all(&v2, &fh, g, granule_len), want);
    assert_eq!(read_all(&v2, &fh, g2, granule_len), want2);
    v2.release(&fh).unwrap();
    v2.unmount().unwrap();
    let report = crate::check::check_volume(&*dev2).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
}

/// A deleted file's space is there for the next write at once, not only after the commit
/// point that makes the free durable (`Meta::commit_for_space`): deleting an old image to
/// make room for a new one must not answer `ENOSPC` for the next second.
#[test]
fn space_freed_by_a_delete_is_written_at_once() {
    let (_dev, v) = fresh(64 << 20);
    let root = v.root_ino();
    let chunk = vec![0x5au8; 1 << 20];
    let fill = |name: &[u8], limit: Option<u64>| {
        let (_, fh) = v.create(root, name, 0o644, C, true).unwrap();
        let mut off = 0;
        let r = loop {
            if limit.is_some_and(|l| off >= l) {
                break Ok(());
            }
            match v.write(&fh, off, &chunk) {
                Ok(_) => off += chunk.len() as u64,
                Err(e) => break Err(e),
            }
        };
        v.release(&fh).unwrap();
        (off, r)
    };
    let (full, r) = fill(b"old", None);
    let e = r.unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::NoSpace, "{e}");
    assert!(full >= 16 << 20, "only {full} bytes fit");
    v.unlink(root, b"old").unwrap();
    let t = std::time::Instant::now();
    let (written, r) = fill(b"new", Some(full));
    r.unwrap_or_else(|e| {
        panic!(
            "{e} after {written} of {full} bytes, {:?} after the delete",
            t.elapsed()
        )
    });
}

/// The same for a hole a guest punches in its image (a TRIM): without the global lock the
/// blocks go into this node's pool, where they wait for the commit point; a write that finds
/// neither the pool nor the bitmaps with space meanwhile waits for that commit point too
/// (`Meta::space_error`) instead of answering `ENOSPC`.
#[test]
fn space_punched_into_the_pool_is_written_at_once() {
    // No committer: only a commit point the write asks for makes the punched blocks reusable.
    let opts = MountOptions {
        commit_interval: std::time::Duration::ZERO,
        ..MountOptions::default()
    };
    let (dev, v) = fresh_with(64 << 20, &opts);
    let (img, fh) = v.create(v.root_ino(), b"img", 0o644, C, true).unwrap();
    let mib = vec![7u8; 1 << 20];
    let mut off = 0u64;
    while v.write(&fh, off, &mib).is_ok() {
        off += 1 << 20;
    }
    let e = loop {
        match v.write(&fh, off, &mib[..4096]) {
            Ok(_) => off += 4096,
            Err(e) => break e,
        }
    };
    assert_eq!(e.kind(), crate::ErrorKind::NoSpace, "{e}");
    assert!(off >= 16 << 20, "only {off} bytes fit");
    v.fallocate(img.ino, 0, 4 << 20, FallocMode::PunchHole)
        .unwrap();
    assert!(
        v.lock_meta().pool_has_quarantine(),
        "the punch went into this node's pool (the image is owned and open for writing)"
    );
    let t = std::time::Instant::now();
    for i in 0..4u64 {
        v.write(&fh, i << 20, &mib).unwrap_or_else(|e| {
            panic!(
                "{e}: MiB {i} of the punched 4, {:?} after the punch",
                t.elapsed()
            )
        });
    }
    v.release(&fh).unwrap();
    v.unmount().unwrap();
    assert!(crate::check::check_volume(&*dev).unwrap().is_clean());
}

/// A hole punched in the middle of an extent of a file mapped by a tree, on a full volume:
/// the extent's tail is a new key, whose insert may split a leaf and find no block. The
/// save fails then (`ENOSPC`) — and the failed operation's transaction, which commits even on
/// error, must not hold the extent's head already shortened (`ExtentMap::persist` inserts
/// new keys first): else the tail is unmapped at home, and lost after a crash.
#[test]
fn a_punch_that_finds_no_space_for_its_tree_leaves_the_map_at_home_whole() {
    let opts = MountOptions {
        commit_interval: std::time::Duration::ZERO,
        alloc_granule: FS_BLOCK,
        ..MountOptions::default()
    };
    let (dev, v) = fresh_with(48 << 20, &opts);
    let root = v.root_ino();
    // The image: 600 extents of 8 blocks (even runs written first, then odd ones).
    let (img, fh) = v.create(root, b"img", 0o644, C, true).unwrap();
    let run = 8u64;
    let runs = 600u64;
    let byte = |b: u64| u8::try_from(b % 251).unwrap() + 1;
    for pass in [0, 1] {
        for r in (pass..runs).step_by(2) {
            for b in r * run..(r + 1) * run {
                v.write(&fh, b * FS_BLOCK, &[byte(b); 4096]).unwrap();
            }
        }
    }
    v.release(&fh).unwrap();
    assert!(v.extents(img.ino).unwrap().len() >= usize::try_from(runs).unwrap());
    // The block pool goes back (else punches free into it, and take tree blocks from it).
    super::detached_tests::await_pool_back(&v);
    // Fill the volume; then punch one block inside run after run, taking back what each
    // punch freed, until one finds no space.
    let (_, fill) = v.create(root, b"fill", 0o644, C, true).unwrap();
    let mut fill_at = 0u64;
    let mut top_up = |v: &Volume| {
        while v.write(&fill, fill_at, &[9u8; 4096]).is_ok() {
            fill_at += FS_BLOCK;
        }
    };
    v.sync().unwrap();
    top_up(&v);
    let mut failed = None;
    for r in 0..runs {
        let b = r * run + 3;
        match v.fallocate(img.ino, b * FS_BLOCK, FS_BLOCK, FallocMode::PunchHole) {
            Ok(()) => {
                v.sync().unwrap();
                top_up(&v);
            }
            Err(e) => {
                assert_eq!(e.kind(), crate::ErrorKind::NoSpace, "{e}");
                failed = Some(r);
                break;
            }
        }
    }
    let failed = failed.expect("some punch needed a tree block on the full volume");
    // The failed operation's transaction reaches home; then the node dies.
    v.sync().unwrap();
    let dev = Arc::new(MemDevice::from_image(dev.snapshot(), 512));
    drop(v);
    let v = Volume::mount(dev.clone(), &opts).unwrap();
    let fh = v.open(img.ino, false, false).unwrap();
    let mut data = Vec::new();
    let len = runs * run * FS_BLOCK;
    while (data.len() as u64) < len {
        let at = data.len() as u64;
        v.read(
            &fh,
            at,
            u32::try_from(len - at).unwrap_or(1 << 20),
            &mut |d| {
                data.extend_from_slice(d);
            },
        )
        .unwrap();
    }
    for b in 0..runs * run {
        let at = usize::try_from(b * FS_BLOCK).unwrap();
        let got = &data[at..at + 4096];
        let punched = b % run == 3 && b / run < failed;
        let maybe = b % run == 3 && b / run == failed;
        let ok = if punched {
            got.iter().all(|&x| x == 0)
        } else if maybe {
            got.iter().all(|&x| x == 0) || got.iter().all(|&x| x == byte(b))
        } else {
            got.iter().all(|&x| x == byte(b))
        };
        assert!(
            ok,
            "block {b} of the image (punch {failed} failed): {:?}",
            &got[..8]
        );
    }
    v.release(&fh).unwrap();
    v.unmount().unwrap();
    let report = crate::check::check_volume(&*dev).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
}

#[test]
fn a_granule_the_volume_cannot_give_allocates_the_blocks_written() {
    use super::data::{GRANULE_MIN_SIZE, MAX_ALLOC_GRANULE};
    let (dev, v0) = fresh(64 << 20);
    v0.unmount().unwrap();
    let opts = MountOptions {
        alloc_granule: MAX_ALLOC_GRANULE,
        ..MountOptions::default()
    };
    let v = Volume::mount(dev.clone(), &opts).unwrap();
    let root = v.root_ino();
    let (img, fh) = v.create(root, b"disk.raw", 0o644, C, true).unwrap();
    let image_size = SetAttr {
        size: Some(4 * GRANULE_MIN_SIZE),
        ..SetAttr::default()
    };
    v.setattr(img.ino, &image_size, C).unwrap();
    // Fill the volume, then free 64 KiB: less than a granule is left.
    let (fill, ffh) = v.create(root, b"fill", 0o644, C, true).unwrap();
    let mib = vec![1u8; 1 << 20];
    let mut off = 0u64;
    while v.write(&ffh, off, &mib).is_ok() {
        off += 1 << 20;
    }
    let e = loop {
        match v.write(&ffh, off, &mib[..4096]) {
            Ok(_) => off += 4096,
            Err(e) => break e,
        }
    };
    assert_eq!(e.kind(), crate::ErrorKind::NoSpace, "{e}");
    v.fallocate(fill.ino, 0, 64 << 10, FallocMode::PunchHole)
        .unwrap();
    v.sync().unwrap();
    let free = v.statfs().unwrap().bfree;
    assert!((1..256).contains(&free), "{free} blocks free");
    // A first write into an untouched granule of the image: its own block, not an error.
    let at = 2 * MAX_ALLOC_GRANULE + 8192;
    v.write(&fh, at, &[7u8; 4096]).unwrap();
    assert_eq!(v.getattr(img.ino).unwrap().blocks, 8);
    assert_eq!(read_all(&v, &fh, at - 4096, 12288)[4096..8192], [7u8; 4096]);
    v.release(&fh).unwrap();
    v.release(&ffh).unwrap();
    v.unmount().unwrap();
    let r = crate::check::check_volume(&*dev).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
}
