//! The checker against volumes written by the real filesystem layer: whatever [`Volume`]
//! leaves behind after unmount must check clean, through every kind of operation.

use super::{check_volume, Report};
use crate::dev::mem::MemDevice;
use crate::dev::BlockDevice;
use crate::fs::{Caller, FallocMode, MountOptions, RenameFlags, SetAttr, Volume};
use crate::mkfs::{format, MkfsOptions};
use std::sync::Arc;

const C: Caller = Caller::ROOT;

fn show(r: &Report) -> String {
    r.findings
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

fn mounted(size: u64) -> (Arc<MemDevice>, Arc<Volume>) {
    let dev = Arc::new(MemDevice::new(size, 512));
    let opts = MkfsOptions {
        max_nodes: 2,
        journal_bytes: 1 << 20,
        ..Default::default()
    };
    format(&*dev, &opts, &mut |_, _| {}).unwrap();
    let v = Volume::mount(dev.clone(), &MountOptions::default()).unwrap();
    (dev, v)
}

#[test]
fn volume_built_through_the_api_checks_clean() {
    let (dev, v) = mounted(256 << 20);
    let root = v.root_ino();
    let docs = v.mkdir(root, b"docs", 0o755, C).unwrap().ino;
    let deep = v.mkdir(docs, b"deep", 0o700, C).unwrap().ino;
    // Enough entries to split the root's entry tree.
    for i in 0..400 {
        let (_, fh) = v
            .create(
                root,
                format!("file-with-a-long-name-{i:04}").as_bytes(),
                0o644,
                C,
                true,
            )
            .unwrap();
        v.write(&fh, 0, format!("contents {i}").as_bytes()).unwrap();
        v.release(&fh).unwrap();
    }
    // A big file with holes and many extents (extent tree), and a preallocated tail.
    let (big, fh) = v.create(docs, b"big.img", 0o644, C, true).unwrap();
    for k in 0..300u64 {
        v.write(&fh, k * 3 * 4096, &[k.to_le_bytes()[0]; 4096])
            .unwrap();
    }
    v.fallocate(
        big.ino,
        300 * 3 * 4096,
        64 << 10,
        FallocMode::Allocate { keep_size: true },
    )
    .unwrap();
    v.fallocate(big.ino, 4096 * 30, 4096 * 30, FallocMode::PunchHole)
        .unwrap();
    v.release(&fh).unwrap();
    let (small, fh) = v.create(deep, b"small", 0o600, C, true).unwrap();
    v.write(&fh, 10, b"hello").unwrap();
    v.release(&fh).unwrap();
    v.link(small.ino, root, b"small-link").unwrap();
    v.symlink(deep, b"up", b"../big.img", C).unwrap();
    v.mknod(root, b"fifo", libc::S_IFIFO | 0o600, 0, C).unwrap();
    v.setxattr(big.ino, b"user.kind", b"disk image", true, false)
        .unwrap();
    v.setxattr(docs, b"user.note", &[1u8; 300], true, false)
        .unwrap();
    // Namespace churn: renames across directories, unlinks, rmdir, truncation.
    v.rename(
        root,
        b"file-with-a-long-name-0007",
        deep,
        b"moved",
        RenameFlags::default(),
    )
    .unwrap();
    v.mkdir(deep, b"gone", 0o755, C).unwrap();
    v.rmdir(deep, b"gone").unwrap();
    for i in (100..400).step_by(3) {
        v.unlink(root, format!("file-with-a-long-name-{i:04}").as_bytes())
            .unwrap();
    }
    v.setattr(
        big.ino,
        &SetAttr {
            size: Some(100 * 4096 + 17),
            ..Default::default()
        },
        C,
    )
    .unwrap();
    v.removexattr(docs, b"user.note").unwrap();
    v.unmount().unwrap();

    let r = check_volume(&*dev).unwrap();
    assert!(
        r.findings.is_empty(),
        "fsck findings after Volume operations:\n{}",
        show(&r)
    );
    assert_eq!(r.stats.directories, 3);
    assert_eq!(r.stats.symlinks, 1);
    assert_eq!(r.stats.special_files, 1);

    // And the checker is not just agreeing: damage one inode the API wrote.
    let mut b = vec![0u8; 4096];
    dev.read_at(small.ino * 4096, &mut b).unwrap();
    b[52] ^= 1; // nlink, without resealing: a checksum failure
    dev.write_at(small.ino * 4096, &b).unwrap();
    assert!(!check_volume(&*dev).unwrap().is_clean());
}

#[test]
fn removing_everything_leaves_no_leaks() {
    let (dev, v) = mounted(128 << 20);
    let root = v.root_ino();
    let d = v.mkdir(root, b"d", 0o755, C).unwrap().ino;
    for i in 0..50 {
        let (a, fh) = v
            .create(d, format!("f{i}").as_bytes(), 0o644, C, true)
            .unwrap();
        v.write(&fh, 0, &vec![7u8; 3 * 4096 + i]).unwrap();
        v.setxattr(a.ino, b"user.x", b"y", true, false).unwrap();
        v.release(&fh).unwrap();
    }
    for i in 0..50 {
        v.unlink(d, format!("f{i}").as_bytes()).unwrap();
    }
    v.rmdir(root, b"d").unwrap();
    v.unmount().unwrap();
    let r = check_volume(&*dev).unwrap();
    assert!(r.findings.is_empty(), "{}", show(&r));
    assert_eq!(r.stats.inodes, 1);
}
