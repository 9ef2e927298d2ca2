//! Allocating writes without the global lock (fs/detached.rs, fs/pool.rs), with several
//! nodes on one memory device.

use super::cluster::GroupRecords;
use super::multinode_tests::{assert_fsck_clean, volume};
use super::*;
use crate::dev::mem::MemDevice;
use crate::format::lock_record::LockMode;
use std::time::{Duration, Instant};

const C: Caller = Caller::ROOT;
/// Far apart: each write is a new allocation (a hole between), not an overwrite.
const STRIDE: u64 = 256 << 10;
const IMAGE: u64 = 1 << 30;

/// A node that allocates exactly the blocks written (`granule=4`): these tests count separate
/// allocations, which 1 MiB granules would turn into overwrites (the granule has its own test,
/// fs/tests.rs); on this 512 MiB device the pool is 8 MiB, so granules would also refill it,
/// under the global lock, every few writes.
///
/// It keeps idle locks (`IdleLocks::Keep`): these tests show what one node does while another
/// holds the global lock, or while it owns a file's lock, however slowly they run.
pub(super) fn node(dev: &Arc<MemDevice>, host: &str) -> Arc<Volume> {
    let opts = MountOptions {
        host: host.into(),
        alloc_granule: crate::format::FS_BLOCK,
        idle_locks: IdleLocks::Keep,
        ..MountOptions::default()
    };
    Volume::mount(dev.clone(), &opts).unwrap()
}

fn read_at(v: &Volume, fh: &OpenFile, offset: u64, len: u32) -> Vec<u8> {
    let mut out = Vec::new();
    v.read(fh, offset, len, &mut |d| out.extend_from_slice(d))
        .unwrap();
    out
}

/// The end of a two-node test: `a` closes `fh`, both unmount, and the volume checks clean.
fn close_both(dev: &Arc<MemDevice>, a: &Volume, b: &Volume, fh: &Arc<OpenFile>) {
    a.release(fh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(dev);
}

pub(super) fn gml(v: &Volume) -> LockMode {
    v.lock_meta().gml()
}

/// `a` worked without the global lock (`what` took it otherwise), which `b` still holds
/// exclusively.
fn assert_still_detached(a: &Volume, b: &Volume, what: &str) {
    assert_eq!(gml(a), LockMode::Free, "{what}");
    assert_eq!(gml(b), LockMode::Exclusive);
}

/// A thin VM image: created, then made 1 GiB sparse (as `qemu-img create` does).
pub(super) fn thin_image(v: &Volume, name: &[u8]) -> (Attr, Arc<OpenFile>) {
    let (f, fh) = v.create(v.root_ino(), name, 0o644, C, true).unwrap();
    let set = SetAttr {
        size: Some(IMAGE),
        ..Default::default()
    };
    v.setattr(f.ino, &set, C).unwrap();
    (f, fh)
}

/// Two nodes; `a` grows a thin image (blocks 0, STRIDE, … (n−1)·STRIDE, block i holding i, or
/// `first` for block 0) while `b` holds the global lock exclusively: every write after the
/// first is made without the global lock.
fn grown_elsewhere(
    n: u8,
    first: u8,
) -> (
    Arc<MemDevice>,
    Arc<Volume>,
    Arc<Volume>,
    Attr,
    Arc<OpenFile>,
) {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let (f, fh) = thin_image(&a, b"img");
    // The first allocating write takes the metadata path: the inode lock becomes a's, and a
    // block pool is filled.
    a.write(&fh, 0, &[first; 4096]).unwrap();
    assert!(a.lock_meta().pool_available() > 0, "no pool after a write");
    // b takes the global lock exclusively and keeps it (nobody asks for it back).
    b.mkdir(b.root_ino(), b"d", 0o755, C).unwrap();
    assert_eq!(gml(&b), LockMode::Exclusive);
    for i in 1..n {
        a.write(&fh, u64::from(i) * STRIDE, &[i; 4096]).unwrap();
    }
    assert_still_detached(
        &a,
        &b,
        "an allocating write of an owned file took the global lock",
    );
    (dev, a, b, f, fh)
}

#[test]
fn an_owned_file_grows_while_another_node_holds_the_global_lock() {
    let (dev, a, b, f, fh) = grown_elsewhere(40, 0xEE);
    // b sees what a wrote: reading the inode makes a write it home first (rule 3).
    let mapped = b.getattr(f.ino).unwrap().blocks * 512;
    assert!(mapped >= 40 * 4096, "b sees {mapped} bytes allocated");
    let bfh = b.open(f.ino, false, false).unwrap();
    for i in [1u8, 17, 39] {
        assert_eq!(
            read_at(&b, &bfh, u64::from(i) * STRIDE, 4096),
            vec![i; 4096]
        );
    }
    assert_eq!(read_at(&b, &bfh, 0, 4096), vec![0xEE; 4096]);
    // a writes on: its hold is shared now, so the next allocation goes through the global
    // lock again (and takes the inode back).
    a.write(&fh, 40 * STRIDE, &[40; 4096]).unwrap();
    assert_eq!(read_at(&b, &bfh, 40 * STRIDE, 4096), vec![40; 4096]);
    b.release(&bfh).unwrap();
    close_both(&dev, &a, &b, &fh);
}

/// A handoff's "everything is home" and the seal that stops new detached writes are one step
/// (fs/detached.rs rule 2). A writer that found the hold owned just before the seal reopens
/// the inode next (`keep_pool`); that must not let a detached write begin after the lock
/// server decided to hand the lock over (the write would be mapped after the lock went, or
/// fail).
#[test]
fn no_detached_write_begins_once_a_handoff_found_the_inode_home() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let (f, fh) = thin_image(&a, b"img");
    a.write(&fh, 0, &[1; 4096]).unwrap();
    let il = a.cl.ilocks.as_ref().unwrap();
    let dl = il.lock_of(f.ino);
    assert!(a.owns_inode(&fh.state), "a owns the image after its write");
    // The lock server's first step of a handoff of the image's lock.
    assert!(il.homed_and_sealed(f.ino, &dl).unwrap().is_some());
    assert!(
        !a.owns_inode(&fh.state),
        "still owned after the handoff found everything home"
    );
    // What the writer that passed `own` just before the seal does next (keep_pool).
    a.reopen_owned(il, f.ino);
    assert!(
        !a.detached.begin(f.ino),
        "a detached write began during the handoff"
    );
    // The handoff ends with the lock still a's (as when the other node's request went away).
    il.handed_to(&dl, LockMode::Exclusive, LockMode::Exclusive, &Ok(()));
    for i in 2..6u8 {
        a.write(&fh, u64::from(i) * STRIDE, &[i; 4096]).unwrap();
    }
    assert!(a.owns_inode(&fh.state));
    for i in 2..6u8 {
        assert_eq!(read_at(&a, &fh, u64::from(i) * STRIDE, 4096), vec![i; 4096]);
    }
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    assert_fsck_clean(&dev);
}

#[test]
fn another_node_truncates_a_file_grown_without_the_global_lock() {
    let (dev, a, b, f, fh) = grown_elsewhere(20, 0);
    // b's view of the groups is current: a took its pool from them since b last read the
    // group records (a grant reads only b's own, fs/cluster.rs `GroupReads`). Under a hold
    // of the global lock: a read without it takes owners only, not the published counts.
    b.read_group_records(&mut b.meta_sh().unwrap(), GroupRecords::AllNow);
    let free_before = b.statfs().unwrap().bfree;
    // b changes the inode: it takes the lock exclusively, a writes home and lets go.
    let shrink = SetAttr {
        size: Some(5 * STRIDE),
        ..Default::default()
    };
    b.setattr(f.ino, &shrink, C).unwrap();
    assert!(
        b.statfs().unwrap().bfree > free_before,
        "truncate freed nothing"
    );
    assert_eq!(a.getattr(f.ino).unwrap().size, 5 * STRIDE);
    assert_eq!(read_at(&a, &fh, 4 * STRIDE, 4096), vec![4; 4096]);
    assert!(read_at(&a, &fh, 6 * STRIDE, 4096).is_empty());
    close_both(&dev, &a, &b, &fh);
}

#[test]
fn a_node_that_dies_after_writes_without_the_global_lock_is_recovered() {
    let (dev, a, b, f, fh) = grown_elsewhere(30, 1);
    // Made durable (journal and home) without the global lock, then a dies.
    a.fsync(f.ino, false).unwrap();
    a.write(&fh, 30 * STRIDE, &[30; 4096]).unwrap();
    a.member.fence("test: simulated crash".into());
    // b waits for a's recovery (its inode lock), then sees everything a fsync'd.
    let attr = b.getattr(f.ino).unwrap();
    assert!(
        attr.blocks * 512 >= 30 * 4096,
        "allocated {}",
        attr.blocks * 512
    );
    let bfh = b.open(f.ino, false, false).unwrap();
    for i in [1u8, 15, 29] {
        assert_eq!(
            read_at(&b, &bfh, u64::from(i) * STRIDE, 4096),
            vec![i; 4096]
        );
    }
    b.release(&bfh).unwrap();
    // The recovery freed a's pool (an orphan of its slot): the volume checks clean.
    let t0 = std::time::Instant::now();
    loop {
        let views = crate::cluster::membership::scan(&*dev, &a.sb).unwrap();
        let st = views[a.slot() as usize].record.as_ref().unwrap().state;
        if st == crate::format::heartbeat::SlotState::Free {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "a not recovered");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(fh);
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

/// The closer gives `v`'s pool back, once idle (`POOL_IDLE` and a few of its polls).
pub(super) fn await_pool_back(v: &Volume) {
    await_pool_back_within(v, super::detached::POOL_IDLE * 2);
}

/// [`await_pool_back`], with a limit.
pub(super) fn await_pool_back_within(v: &Volume, limit: Duration) {
    let t = Instant::now();
    while v.lock_meta().pool_available() > 0 {
        assert!(t.elapsed() < limit, "the idle pool stayed");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_pool_goes_back_when_the_last_writer_closes_and_at_unmount() {
    let dev = volume(2);
    let a = node(&dev, "a");
    let r = a.root_ino();
    // Gives the root its entry tree (a block of its own).
    a.mknod(r, b"first", libc::S_IFREG | 0o644, 0, C).unwrap();
    let free0 = a.statfs().unwrap().bfree;
    let total = |v: &Volume| v.lock_meta().pool_available();
    let (_, fh) = thin_image(&a, b"img");
    let (_, fh2) = thin_image(&a, b"img2");
    for i in 0..10u8 {
        a.write(&fh, u64::from(i) * STRIDE, &[i; 4096]).unwrap();
    }
    a.write(&fh2, 0, &[1; 4096]).unwrap();
    assert!(total(&a) > 0);
    a.release(&fh).unwrap();
    assert!(total(&a) > 0, "given back while a writer is still open");
    a.release(&fh2).unwrap();
    // The creates above went without the global lock (fs/detached_ns.rs), from the pool:
    // it stays until neither namespace changes nor the last writer's close have used it for
    // POOL_IDLE. A writer opened again meanwhile (a `dd` loop) keeps it.
    assert!(total(&a) > 0, "given back while namespace changes use it");
    std::thread::sleep(super::detached::POOL_IDLE / 2);
    let img2 = a.lookup(r, b"img2").unwrap();
    let fh2 = a.open(img2.ino, true, false).unwrap();
    std::thread::sleep(super::detached::POOL_IDLE);
    assert!(total(&a) > 0, "given back while a writer was open");
    a.release(&fh2).unwrap();
    std::thread::sleep(super::detached::POOL_IDLE / 2);
    assert!(total(&a) > 0, "given back before it was idle");
    // Then the closer gives it back, with no call of the file system's.
    await_pool_back(&a);
    a.unlink(r, b"img").unwrap();
    a.unlink(r, b"img2").unwrap();
    // (The root's entry tree may have grown a block meanwhile; fsck below finds any leak.)
    let free = a.statfs().unwrap().bfree;
    assert!(
        free + 2 >= free0,
        "{free} free, {free0} before: blocks leaked"
    );
    // A pool made again goes back at unmount.
    let (_, fh) = thin_image(&a, b"img3");
    a.write(&fh, 0, &[1; 4096]).unwrap();
    a.write(&fh, STRIDE, &[1; 4096]).unwrap();
    drop(fh);
    a.unmount().unwrap();
    assert_fsck_clean(&dev);
    let a = node(&dev, "a");
    let img3 = a.lookup(r, b"img3").unwrap();
    let free = a.statfs().unwrap().bfree;
    let used = img3.blocks * 512 / 4096;
    assert!(
        free + used + 2 >= free0,
        "{free} free, {free0} before: blocks leaked"
    );
    a.unmount().unwrap();
}

#[test]
fn a_crash_image_with_a_pool_checks_clean_and_the_next_mount_frees_the_pool() {
    // Default timings: the next mount of the image must not fence under a loaded test run.
    let (dev, a) = super::tests::fresh(512 << 20);
    let r = a.root_ino();
    a.mknod(r, b"first", libc::S_IFREG | 0o644, 0, C).unwrap();
    let (f, fh) = thin_image(&a, b"img");
    for i in 0..20u8 {
        a.write(&fh, u64::from(i) * STRIDE, &[i + 1; 4096]).unwrap();
    }
    a.fsync(f.ino, false).unwrap();
    assert!(a.lock_meta().pool_available() > 0);
    // Crash with the pool on the orphan list (the writer is still open).
    let image = dev.snapshot();
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    super::tests::crashed_image_recovers(image, |v2| {
        let fh = v2.open(f.ino, false, false).unwrap();
        for i in [0u8, 7, 19] {
            assert_eq!(
                read_at(v2, &fh, u64::from(i) * STRIDE, 4096),
                vec![i + 1; 4096]
            );
        }
        v2.release(&fh).unwrap();
    });
}

/// A hole punched in an owned file (a VM's TRIM of its image) is made without the global
/// lock: the freed blocks go into the pool (usable once the free is durable), the file reads
/// zeros there, another node sees the hole, and a punch of a file this node no longer owns
/// takes the global path.
#[test]
fn a_hole_punched_in_an_owned_file_frees_into_the_pool_without_the_global_lock() {
    let (dev, a, b, f, fh) = grown_elsewhere(40, 0xEE);
    a.fsync(f.ino, false).unwrap();
    let pool0 = a.lock_meta().pool_available();
    let blocks0 = a.getattr(f.ino).unwrap().blocks;
    // What the kernel asks before it sends a punch (or a write that may remove privileges):
    // answered without the global lock too.
    let e = a.getxattr(f.ino, b"security.capability").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoData);
    assert!(a.listxattr(f.ino).unwrap().is_empty());
    for i in [3u64, 7, 11] {
        a.fallocate(f.ino, i * STRIDE, 4096, FallocMode::PunchHole)
            .unwrap();
    }
    // Inside one block: nothing freed, the bytes zeroed.
    a.fallocate(f.ino, 20 * STRIDE + 100, 200, FallocMode::PunchHole)
        .unwrap();
    assert_still_detached(&a, &b, "a punch of an owned file took the global lock");
    assert_eq!(
        a.lock_meta().pool_available(),
        pool0,
        "freed blocks usable before their free is durable"
    );
    a.fsync(f.ino, false).unwrap();
    assert_eq!(a.lock_meta().pool_available(), pool0 + 3);
    assert_eq!(a.getattr(f.ino).unwrap().blocks, blocks0 - 3 * 8);
    let mut partial = vec![20u8; 4096];
    partial[100..300].fill(0);
    for v in [&a, &b] {
        let h = v.open(f.ino, false, false).unwrap();
        for i in [3u64, 7, 11] {
            assert_eq!(read_at(v, &h, i * STRIDE, 4096), vec![0; 4096]);
        }
        assert_eq!(read_at(v, &h, 4 * STRIDE, 4096), vec![4; 4096]);
        assert_eq!(read_at(v, &h, 20 * STRIDE, 4096), partial);
        v.release(&h).unwrap();
    }
    // b read the inode: a's hold is shared now, so its next punch takes the global lock.
    assert_eq!(b.getattr(f.ino).unwrap().blocks, blocks0 - 3 * 8);
    a.fallocate(f.ino, 5 * STRIDE, 4096, FallocMode::PunchHole)
        .unwrap();
    assert_eq!(gml(&a), LockMode::Exclusive);
    assert_eq!(a.lock_meta().pool_available(), pool0 + 3);
    let h = b.open(f.ino, false, false).unwrap();
    assert_eq!(read_at(&b, &h, 5 * STRIDE, 4096), vec![0; 4096]);
    b.release(&h).unwrap();
    close_both(&dev, &a, &b, &fh);
}

/// A crash after holes were punched, and a tail truncated, into the pool: the file keeps its
/// holes, the pool (with the freed blocks) is freed by the next mount, and the volume checks
/// clean.
#[test]
fn a_crash_after_holes_punched_and_a_truncate_into_the_pool_loses_no_block() {
    let (dev, a) = super::tests::fresh(512 << 20);
    let r = a.root_ino();
    a.mknod(r, b"first", libc::S_IFREG | 0o644, 0, C).unwrap();
    let (f, fh) = thin_image(&a, b"img");
    for i in 0..20u8 {
        a.write(&fh, u64::from(i) * STRIDE, &[i + 1; 4096]).unwrap();
    }
    let pool0 = {
        a.fsync(f.ino, false).unwrap();
        a.lock_meta().pool_available()
    };
    for i in [2u64, 9, 15] {
        a.fallocate(f.ino, i * STRIDE, 4096, FallocMode::PunchHole)
            .unwrap();
    }
    // And a truncate of the last two written blocks, grown back: into the pool too.
    for size in [18 * STRIDE, IMAGE] {
        let set = SetAttr {
            size: Some(size),
            ..Default::default()
        };
        a.setattr(f.ino, &set, C).unwrap();
    }
    a.fsync(f.ino, false).unwrap();
    // This node allocates by 1 MiB granule: the cut frees every block from 18 strides to
    // the end of the last granule (20 strides).
    assert_eq!(
        a.lock_meta().pool_available(),
        pool0 + 3 + 2 * STRIDE / 4096,
        "not punched or truncated into the pool"
    );
    let image = dev.snapshot();
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    super::tests::crashed_image_recovers(image, |v2| {
        let fh = v2.open(f.ino, false, false).unwrap();
        for i in [2u64, 9, 15, 18, 19] {
            assert_eq!(read_at(v2, &fh, i * STRIDE, 4096), vec![0; 4096]);
        }
        assert_eq!(read_at(v2, &fh, 3 * STRIDE, 4096), vec![4; 4096]);
        assert_eq!(read_at(v2, &fh, 17 * STRIDE, 4096), vec![18; 4096]);
        v2.release(&fh).unwrap();
    });
}

/// Zeroing a range of an owned file (QEMU's write-zeroes, `detect-zeroes`) and preallocating
/// in it go without the global lock too: written blocks become unwritten (read as zeros,
/// keep their place), holes get unwritten extents from the pool, and the file may grow.
#[test]
fn zeroing_and_preallocating_an_owned_file_take_no_global_lock() {
    let (dev, a, b, f, fh) = grown_elsewhere(40, 0xEE);
    a.fsync(f.ino, false).unwrap();
    let pool0 = a.lock_meta().pool_available();
    let blocks0 = a.getattr(f.ino).unwrap().blocks;
    let zero = FallocMode::ZeroRange { keep_size: true };
    // A written block.
    a.fallocate(f.ino, 3 * STRIDE, 4096, zero).unwrap();
    // A hole of 4 blocks, and 2 blocks preallocated in another.
    a.fallocate(f.ino, STRIDE + 4096, 4 * 4096, zero).unwrap();
    a.fallocate(
        f.ino,
        2 * STRIDE + 4096,
        2 * 4096,
        FallocMode::Allocate { keep_size: true },
    )
    .unwrap();
    // Bytes inside one written block.
    a.fallocate(f.ino, 4 * STRIDE + 100, 200, zero).unwrap();
    // Past the end, growing the file.
    a.fallocate(
        f.ino,
        IMAGE,
        2 * 4096,
        FallocMode::ZeroRange { keep_size: false },
    )
    .unwrap();
    assert_still_detached(&a, &b, "fallocate of an owned file took the global lock");
    a.fsync(f.ino, false).unwrap();
    assert_eq!(a.lock_meta().pool_available(), pool0 - 8);
    assert_eq!(a.getattr(f.ino).unwrap().blocks, blocks0 + 8 * 8);
    let mut partial = vec![4u8; 4096];
    partial[100..300].fill(0);
    for v in [&a, &b] {
        assert_eq!(v.getattr(f.ino).unwrap().size, IMAGE + 2 * 4096);
        let h = v.open(f.ino, false, false).unwrap();
        assert_eq!(read_at(v, &h, 3 * STRIDE, 4096), vec![0; 4096]);
        assert_eq!(read_at(v, &h, STRIDE, 6 * 4096)[..4096], [1; 4096]);
        assert_eq!(read_at(v, &h, STRIDE + 4096, 4 * 4096), vec![0; 4 * 4096]);
        assert_eq!(read_at(v, &h, 4 * STRIDE, 4096), partial);
        assert_eq!(read_at(v, &h, 5 * STRIDE, 4096), vec![5; 4096]);
        assert_eq!(read_at(v, &h, IMAGE, 2 * 4096), vec![0; 2 * 4096]);
        v.release(&h).unwrap();
    }
    // The zeroed block kept its place: written again, it is an overwrite.
    a.write(&fh, 3 * STRIDE, &[7; 4096]).unwrap();
    let h = b.open(f.ino, false, false).unwrap();
    assert_eq!(read_at(&b, &h, 3 * STRIDE, 4096), vec![7; 4096]);
    b.release(&h).unwrap();
    close_both(&dev, &a, &b, &fh);
}

/// A truncate of an owned file, and its growth back, go without the global lock: the
/// truncated blocks go into the pool (usable once the free is durable), the partial last
/// block reads as zeros past the cut, and the other node sees the same afterwards.
#[test]
fn truncating_an_owned_file_frees_into_the_pool_without_the_global_lock() {
    let (dev, a, b, f, fh) = grown_elsewhere(20, 0xEE);
    a.fsync(f.ino, false).unwrap();
    let pool0 = a.lock_meta().pool_available();
    let blocks0 = a.getattr(f.ino).unwrap().blocks;
    let resize = |size: u64| {
        let set = SetAttr {
            size: Some(size),
            ..Default::default()
        };
        a.setattr(f.ino, &set, C).unwrap()
    };
    let cut = 10 * STRIDE + 100;
    assert_eq!(resize(cut).size, cut);
    assert_eq!(
        a.lock_meta().pool_available(),
        pool0,
        "truncated blocks usable before their free is durable"
    );
    // The image grows back (a VM disk resized): the size alone.
    assert_eq!(resize(IMAGE).size, IMAGE);
    let touch = SetAttr {
        mtime: Some(SetTime::At(Timespec {
            sec: 1_000,
            nsec: 7,
        })),
        ..Default::default()
    };
    a.setattr(f.ino, &touch, C).unwrap();
    assert_still_detached(&a, &b, "a truncate of an owned file took the global lock");
    a.fsync(f.ino, false).unwrap();
    // Blocks 11..19 were freed, block 10 kept (100 bytes of it).
    assert_eq!(a.lock_meta().pool_available(), pool0 + 9);
    assert_eq!(a.getattr(f.ino).unwrap().blocks, blocks0 - 9 * 8);
    let mut tail = vec![0u8; 4096];
    tail[..100].fill(10);
    for v in [&a, &b] {
        let attr = v.getattr(f.ino).unwrap();
        assert_eq!(
            (attr.size, attr.mtime.sec, attr.mtime.nsec),
            (IMAGE, 1_000, 7)
        );
        let h = v.open(f.ino, false, false).unwrap();
        assert_eq!(read_at(v, &h, 9 * STRIDE, 4096), vec![9; 4096]);
        assert_eq!(read_at(v, &h, 10 * STRIDE, 4096), tail);
        assert_eq!(read_at(v, &h, 15 * STRIDE, 4096), vec![0; 4096]);
        v.release(&h).unwrap();
    }
    close_both(&dev, &a, &b, &fh);
}

/// Random aligned writes, punched holes, zeroed and preallocated ranges (unaligned ends
/// included), and truncates into an owned image while another node holds the global lock: the file always
/// reads as a byte model says, none of it takes the global lock, the other node reads the
/// same bytes afterwards, and the volume checks clean.
#[test]
fn random_writes_and_fallocates_of_an_owned_file_match_a_model() {
    const SPAN: u64 = 2 << 20;
    let (dev, a, b, f, fh) = grown_elsewhere(2, 0x11);
    let mut model = vec![0u8; usize::try_from(2 * STRIDE).unwrap()];
    model[..4096].fill(0x11);
    model[usize::try_from(STRIDE).unwrap()..][..4096].fill(1);
    model.resize(usize::try_from(SPAN).unwrap(), 0);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let us = |v: u64| usize::try_from(v).unwrap();
    for op in 0..400u32 {
        match rnd(6) {
            0 | 1 => {
                let (b0, n) = (rnd(SPAN / 4096 - 8), 1 + rnd(8));
                let fill = u8::try_from(1 + rnd(250)).unwrap();
                a.write(&fh, b0 * 4096, &vec![fill; us(n * 4096)]).unwrap();
                model[us(b0 * 4096)..us((b0 + n) * 4096)].fill(fill);
            }
            5 => {
                // A truncate into the span, and back to the image's size.
                let size = SPAN / 2 + rnd(SPAN / 2);
                for s in [size, IMAGE] {
                    let set = SetAttr {
                        size: Some(s),
                        ..Default::default()
                    };
                    a.setattr(f.ino, &set, C).unwrap();
                }
                model[us(size)..].fill(0);
            }
            k => {
                let off = rnd(SPAN - (64 << 10));
                let len = 1 + rnd(48 << 10);
                let mode = match k {
                    2 => FallocMode::PunchHole,
                    3 => FallocMode::ZeroRange { keep_size: true },
                    _ => FallocMode::Allocate { keep_size: true },
                };
                a.fallocate(f.ino, off, len, mode).unwrap();
                if k != 4 {
                    model[us(off)..us(off + len)].fill(0);
                }
            }
        }
        if op % 50 == 49 {
            a.fsync(f.ino, false).unwrap();
            assert_eq!(
                read_at(&a, &fh, 0, u32::try_from(SPAN).unwrap()),
                model,
                "after op {op}"
            );
        }
    }
    assert_still_detached(&a, &b, "an operation took the global lock");
    let h = b.open(f.ino, false, false).unwrap();
    assert_eq!(read_at(&b, &h, 0, u32::try_from(SPAN).unwrap()), model);
    b.release(&h).unwrap();
    close_both(&dev, &a, &b, &fh);
}

/// A log file on a node that owns it: appends (offsets from the owned copy) and small writes
/// into written blocks (read, modified and written under the inode's locks) go without the
/// global lock, new blocks from the pool that appends to a log keep filled; another node
/// reads every byte afterwards.
#[test]
fn appends_and_partial_writes_of_an_owned_file_take_no_global_lock() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    // The log's first write makes its lock a's; an append to it once it is 64 KiB fills
    // a's pool (as a write to an image does).
    let (log, fh) = a.create(a.root_ino(), b"log", 0o644, C, true).unwrap();
    let mut model = vec![b'-'; 70 << 10];
    a.write(&fh, 0, &model).unwrap();
    a.release(&fh).unwrap();
    // The create filled a pool; it goes back once idle after the last writer's close.
    await_pool_back(&a);
    let fh = a.open(log.ino, true, false).unwrap();
    // An append that needs a new block: on the metadata path (no pool), which fills one.
    a.write_by(&fh, WriteAt::End, &[b'+'; 4096], &C).unwrap();
    model.extend_from_slice(&[b'+'; 4096]);
    assert!(a.lock_meta().pool_available() > 0, "no pool for a log");
    b.mkdir(b.root_ino(), b"d", 0o755, C).unwrap();
    assert_eq!(gml(&b), LockMode::Exclusive);
    for i in 0..300u32 {
        let line = format!(
            "line {i} {}\n",
            "x".repeat(usize::try_from(i % 97).unwrap())
        );
        let w = a.write_by(&fh, WriteAt::End, line.as_bytes(), &C).unwrap();
        assert_eq!(w.offset, model.len() as u64, "append {i}");
        model.extend_from_slice(line.as_bytes());
        if i % 10 == 9 {
            // A small rewrite inside what is written (a read-modify-write of its block).
            let at = (u64::from(i) * 7919) % (model.len() as u64 - 8);
            a.write(&fh, at, b"REWRITE!").unwrap();
            let at = usize::try_from(at).unwrap();
            model[at..at + 8].copy_from_slice(b"REWRITE!");
        }
    }
    assert_still_detached(&a, &b, "a write of an owned file took the global lock");
    let n = u32::try_from(model.len()).unwrap();
    assert_eq!(read_at(&a, &fh, 0, n + 100), model);
    let h = b.open(log.ino, false, false).unwrap();
    assert_eq!(b.getattr(log.ino).unwrap().size, model.len() as u64);
    assert_eq!(read_at(&b, &h, 0, n + 100), model);
    b.release(&h).unwrap();
    close_both(&dev, &a, &b, &fh);
}
