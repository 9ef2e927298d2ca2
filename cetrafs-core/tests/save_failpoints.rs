//! A change that unmaps blocks and then fails before it saves the inode (the `failpoints`
//! feature; run with `cargo test -p cetrafs-core --features failpoints --test
//! save_failpoints`). The running transaction commits even after an error, so the blocks a
//! punched hole took out of the map must not be freed in it before the inode that no longer
//! maps them is written: else a commit point makes them free while the inode at home still
//! maps them, and the next file to get them shares them with this one after a crash (or a
//! reload). `save::before_map` fails the save of the punched file; the blocks are freed by
//! the next save of it instead. `defrag::forget_tmp` fails a defrag's switch to its new runs
//! after the file was saved with its new runs: the node fences, and what reaches the LUN is
//! the file as it was; a defrag whose save fails puts the old map back and goes on. The blocks of
//! an xattr set a failed change made smaller are freed only with the inode saved too, and a
//! link that fails counts no link. A commit point that fails (`commit::before_home`) fences
//! the node at once, as a change that fails half-way does: it stops renewing its lease, so
//! the others recover it without waiting to ask it for a lock.
#![cfg(feature = "failpoints")]

use cetrafs_core::check::check_volume;
use cetrafs_core::dev::mem::MemDevice;
use cetrafs_core::failpoint;
use cetrafs_core::format::FS_BLOCK;
use cetrafs_core::fs::{Caller, FallocMode, MountOptions, SetAttr, Volume};
use cetrafs_core::mkfs::{format, MkfsOptions};
use std::sync::Arc;
use std::time::Duration;

const KIB: u64 = 1 << 10;

fn opts() -> MountOptions {
    MountOptions {
        commit_interval: Duration::ZERO,
        ..MountOptions::default()
    }
}

fn assert_clean(img: Vec<u8>, what: &str) {
    let dev = Arc::new(MemDevice::from_image(img, 512));
    // The mount replays the journal, as after a crash.
    let v = Volume::mount(dev.clone(), &opts()).unwrap();
    v.unmount().unwrap();
    let report = check_volume(&*dev).unwrap();
    assert!(report.is_clean(), "{what}: {:?}", report.findings);
}

/// One test, so the process-wide failpoint table is never shared between threads.
#[test]
fn changes_that_fail_half_way_leave_no_block_both_free_and_mapped() {
    blocks_punched_by_a_change_that_failed_are_freed_only_with_the_inode_saved();
    a_defrag_that_fails_in_its_switch_fences_and_leaves_the_file_as_it_was();
    a_defrag_whose_save_fails_puts_the_old_map_back();
    xattr_blocks_a_failed_removal_released_stay_allocated();
    a_link_whose_save_fails_counts_nothing();
    a_failed_commit_point_fences_the_node_at_once();
}

/// Run `op` with failpoint `point` armed: it must fail there.
fn fails_at<T: std::fmt::Debug>(point: &str, op: impl FnOnce() -> cetrafs_core::Result<T>) {
    failpoint::arm(point);
    let r = op();
    failpoint::disarm_all();
    let e = r.unwrap_err();
    assert!(e.to_string().contains(point), "{e}");
}

fn volume() -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(96 << 20, 512));
    let mk = MkfsOptions {
        max_nodes: 2,
        journal_bytes: 2 << 20,
        // The copies below find this node's slot taken: it is declared dead in 1.1 s.
        heartbeat_interval_ms: 50,
        io_timeout_ms: 100,
        ..Default::default()
    };
    format(&*dev, &mk, &mut |_, _| {}).unwrap();
    dev
}

fn read_all(v: &Volume, fh: &cetrafs_core::fs::OpenFile, len: usize) -> Vec<u8> {
    let mut buf = Vec::new();
    while buf.len() < len {
        let before = buf.len();
        let at = u64::try_from(before).unwrap();
        let size = u32::try_from(len - before).unwrap_or(u32::MAX);
        v.read(fh, at, size, &mut |d| buf.extend_from_slice(d))
            .unwrap();
        assert!(buf.len() > before, "a short read at {before}");
    }
    buf
}

fn blocks_punched_by_a_change_that_failed_are_freed_only_with_the_inode_saved() {
    let dev = volume();
    let v = Volume::mount(dev.clone(), &opts()).unwrap();
    let (a, fh) = v
        .create(v.root_ino(), b"image", 0o644, Caller::ROOT, true)
        .unwrap();
    v.write(&fh, 0, &vec![0xab; 1 << 20]).unwrap();
    v.sync().unwrap();
    let free_before = v.statfs().unwrap().bfree;

    fails_at("save::before_map", || {
        v.fallocate(a.ino, 256 * KIB, 256 * KIB, FallocMode::PunchHole)
    });
    // The failed change's transaction reaches the journal and home; then the node dies.
    v.sync().unwrap();
    assert_clean(
        dev.snapshot(),
        "a crash after the punch failed to save its inode",
    );

    // The node lives on: the next save of the file frees the punched blocks with it.
    v.setattr(
        a.ino,
        &SetAttr {
            mode: Some(0o600),
            ..Default::default()
        },
        Caller::ROOT,
    )
    .unwrap();
    v.sync().unwrap();
    assert_eq!(
        v.statfs().unwrap().bfree,
        free_before + 64,
        "the 64 punched blocks are free once the inode is saved"
    );
    let buf = read_all(&v, &fh, 1 << 20);
    let hole = 256 * 1024..512 * 1024;
    assert!(buf[hole.clone()].iter().all(|&b| b == 0));
    assert!(buf[..hole.start].iter().all(|&b| b == 0xab));
    assert!(buf[hole.end..].iter().all(|&b| b == 0xab));
    v.release(&fh).unwrap();
    assert_clean(dev.snapshot(), "after the next save");
    v.unmount().unwrap();
    assert!(check_volume(&*dev).unwrap().is_clean());
}

/// One block per allocation, so that a file written out of order is in many pieces.
fn exact() -> MountOptions {
    MountOptions {
        alloc_granule: FS_BLOCK,
        ..opts()
    }
}

/// A file of 200 blocks in 200 extents (even blocks written first), open for writing, synced.
fn fragmented(
    v: &Volume,
) -> (
    cetrafs_core::fs::Attr,
    Arc<cetrafs_core::fs::OpenFile>,
    Vec<u8>,
) {
    let blocks = 200u64;
    let (a, fh) = v
        .create(v.root_ino(), b"frag", 0o644, Caller::ROOT, true)
        .unwrap();
    let block = usize::try_from(FS_BLOCK).unwrap();
    let mut want = vec![0u8; usize::try_from(blocks).unwrap() * block];
    for pass in [0, 1] {
        for b in (pass..blocks).step_by(2) {
            let data = vec![u8::try_from(b % 251).unwrap() + 1; block];
            v.write(&fh, b * FS_BLOCK, &data).unwrap();
            let at = usize::try_from(b).unwrap() * block;
            want[at..at + data.len()].copy_from_slice(&data);
        }
    }
    v.sync().unwrap();
    assert!(v.extents(a.ino).unwrap().len() >= 100);
    (a, fh, want)
}

fn a_defrag_whose_save_fails_puts_the_old_map_back() {
    let dev = volume();
    let v = Volume::mount(dev.clone(), &exact()).unwrap();
    let (a, fh, want) = fragmented(&v);
    let extents = v.extents(a.ino).unwrap();
    let free = v.statfs().unwrap().bfree;
    fails_at("save::before_map", || v.defrag(a.ino, true));
    // Not fenced: the file maps its old runs, in memory as at home, and the temporary's
    // runs are free again.
    assert_eq!(v.extents(a.ino).unwrap(), extents);
    assert!(read_all(&v, &fh, want.len()) == want, "the file's contents");
    v.sync().unwrap();
    assert_eq!(v.statfs().unwrap().bfree, free);
    assert_clean(dev.snapshot(), "after the defrag whose save failed");
    let done = v.defrag(a.ino, true).unwrap();
    assert!(done.extents_after < 10, "{done:?}");
    assert!(read_all(&v, &fh, want.len()) == want, "the file's contents");
    v.release(&fh).unwrap();
    v.unmount().unwrap();
    assert!(check_volume(&*dev).unwrap().is_clean());
}

fn a_defrag_that_fails_in_its_switch_fences_and_leaves_the_file_as_it_was() {
    let dev = volume();
    let v = Volume::mount(dev.clone(), &exact()).unwrap();
    let (a, fh, want) = fragmented(&v);

    fails_at("defrag::forget_tmp", || v.defrag(a.ino, true));
    let why = v.fence_reason().expect("fenced at once");
    assert!(why.contains("half-way"), "{why}");
    // The file's next save (in memory its map may name the temporary's runs, which the
    // failed defrag's cleanup freed) and a commit point: refused, the node fenced.
    let chmod = SetAttr {
        mode: Some(0o600),
        ..Default::default()
    };
    let saved = v.setattr(a.ino, &chmod, Caller::ROOT).is_ok();
    let synced = v.sync().is_ok();
    let img = dev.snapshot();
    drop(fh);
    drop(v);
    // What the LUN holds: the file as it was, the temporary inode freed by the recovery.
    let dev = Arc::new(MemDevice::from_image(img, 512));
    let v = Volume::mount(dev.clone(), &exact()).unwrap();
    let fh = v.open(a.ino, false, false).unwrap();
    assert!(read_all(&v, &fh, want.len()) == want, "the file's contents");
    v.release(&fh).unwrap();
    v.unmount().unwrap();
    let report = check_volume(&*dev).unwrap();
    assert!(
        report.is_clean(),
        "after the failed defrag: {:?}",
        report.findings
    );
    assert!(
        !saved && !synced,
        "the node fenced: nothing more reaches the LUN"
    );
}

fn xattr_blocks_a_failed_removal_released_stay_allocated() {
    let dev = volume();
    let v = Volume::mount(dev.clone(), &opts()).unwrap();
    let (a, fh) = v
        .create(v.root_ino(), b"tagged", 0o644, Caller::ROOT, true)
        .unwrap();
    v.release(&fh).unwrap();
    // Big enough for overflow blocks besides the head block.
    v.setxattr(a.ino, b"user.big", &vec![7u8; 20_000], false, false)
        .unwrap();
    v.sync().unwrap();
    fails_at("save::before_map", || v.removexattr(a.ino, b"user.big"));
    v.sync().unwrap();
    assert_clean(
        dev.snapshot(),
        "a crash after an xattr removal failed to save its inode",
    );
    // The failed removal changed nothing, in memory either: it can be done again.
    v.removexattr(a.ino, b"user.big").unwrap();
    v.unmount().unwrap();
    assert!(check_volume(&*dev).unwrap().is_clean());
}

fn a_link_whose_save_fails_counts_nothing() {
    let dev = volume();
    let v = Volume::mount(dev.clone(), &opts()).unwrap();
    let root = v.root_ino();
    let (a, fh) = v.create(root, b"one", 0o644, Caller::ROOT, true).unwrap();
    v.release(&fh).unwrap();
    fails_at("save::before_map", || v.link(a.ino, root, b"two"));
    assert_eq!(v.getattr(a.ino).unwrap().nlink, 1);
    v.link(a.ino, root, b"two").unwrap();
    assert_eq!(v.getattr(a.ino).unwrap().nlink, 2);
    // Both names gone: the file is freed (a count one too high would keep it, leaked).
    v.unlink(root, b"one").unwrap();
    v.unlink(root, b"two").unwrap();
    v.unmount().unwrap();
    let report = check_volume(&*dev).unwrap();
    assert!(
        report.is_clean(),
        "after a failed link: {:?}",
        report.findings
    );
}

fn a_failed_commit_point_fences_the_node_at_once() {
    let dev = volume();
    let v = Volume::mount(dev.clone(), &opts()).unwrap();
    let (_, fh) = v
        .create(v.root_ino(), b"late", 0o644, Caller::ROOT, true)
        .unwrap();
    v.write(&fh, 0, &vec![0x5a; 64 << 10]).unwrap();
    // The journal holds the transaction; its blocks never went home.
    fails_at("commit::before_home", || v.sync());
    let why = v
        .fence_reason()
        .expect("fenced at once, not when another node next asks for a lock");
    assert!(why.contains("commit point"), "{why}");
    // Nothing more of the node's metadata is written.
    assert!(v.mkdir(v.root_ino(), b"d", 0o755, Caller::ROOT).is_err());
    let img = dev.snapshot();
    drop(fh);
    drop(v);
    // The journal replayed as after a crash: the file as it was committed.
    assert_clean(img, "after the failed commit point");
}
