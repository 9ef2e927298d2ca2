//! A failed step of an inode-lock handoff (the `failpoints` feature; run with
//! `cargo test -p cetrafs-core --features failpoints --test inode_lock_failpoints`; its own
//! test binary, whose tests take turns, so no other test disarms a point while it is armed). Two nodes on one v3
//! volume: node b reads a file through its cached map (inode lock shared); node a extends the
//! file, which takes the lock exclusively. While b's handoff fails, b keeps its lock and keeps
//! reading the old contents, a waits; once the step works again, the next mailbox tick hands
//! the lock over, a's write completes and b reads the new contents. A failed give-back of an
//! idle lock (the sweep beyond the node's limit) keeps the lock held, and the next sweep gives
//! it back. A failed write-home of a file grown without the global lock (`fs/detached.rs`)
//! keeps its owner's lock the same way: the reader waits, then sees every block.
#![cfg(feature = "failpoints")]

use cetrafs_core::cluster::object_lock::{ObjectId, ObjectLocks};
use cetrafs_core::dev::mem::MemDevice;
use cetrafs_core::failpoint;
use cetrafs_core::fs::{Caller, MountOptions, OpenFile, Volume};
use cetrafs_core::mkfs::{format, MkfsOptions};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The failpoints are process-wide: the tests of this binary take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// This test's turn with the failpoints.
fn take_turn() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A v3 volume for up to four nodes, with short timings.
fn volume() -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(256 << 20, 512));
    let mk = MkfsOptions {
        max_nodes: 4,
        journal_bytes: 1 << 20,
        heartbeat_interval_ms: 50,
        io_timeout_ms: 100,
        ..Default::default()
    };
    format(&*dev, &mk, &mut |_, _| {}).unwrap();
    dev
}

/// Node `host` on `dev`, with the default options.
fn mount(dev: &Arc<MemDevice>, host: &str) -> Arc<Volume> {
    Volume::mount(
        dev.clone(),
        &MountOptions {
            host: host.into(),
            ..MountOptions::default()
        },
    )
    .unwrap()
}

/// With a failpoint armed: `waiting` must not finish for 500 ms (`check` runs meanwhile); then
/// every point is disarmed and it must finish within 5 s (the step is retried).
fn held_back_then_retried<T>(
    waiting: &std::thread::JoinHandle<T>,
    check: &mut dyn FnMut(),
    held: &str,
    not_retried: &str,
) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(500) {
        assert!(!waiting.is_finished(), "{held}");
        check();
        std::thread::sleep(Duration::from_millis(20));
    }
    failpoint::disarm_all();
    let t = Instant::now();
    while !waiting.is_finished() {
        assert!(t.elapsed() < Duration::from_secs(5), "{not_retried}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn read(v: &Volume, fh: &OpenFile, len: u32) -> Vec<u8> {
    let mut out = Vec::new();
    v.read(fh, 0, len, &mut |d| out.extend_from_slice(d))
        .unwrap();
    out
}

#[test]
fn a_failed_inode_lock_handoff_is_retried_at_the_next_tick() {
    let _turn = take_turn();
    let dev = volume();
    let (a, b) = (mount(&dev, "a"), mount(&dev, "b"));
    assert_eq!(a.superblock().format_version(), 8);
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"f", 0o644, Caller::ROOT, true).unwrap();
    a.write(&fh, 0, &[1u8; 4096]).unwrap();
    a.fsync(f.ino, false).unwrap();
    let bfh = b.open(f.ino, false, false).unwrap();
    assert_eq!(read(&b, &bfh, 8192), vec![1u8; 4096]);

    failpoint::arm("inode_lock::before_drain");
    let (a2, fh2) = (a.clone(), fh.clone());
    let writer = std::thread::spawn(move || a2.write(&fh2, 4096, &[2u8; 4096]));
    held_back_then_retried(
        &writer,
        &mut || {
            // b still holds its lock and reads through its (still valid) map.
            assert_eq!(read(&b, &bfh, 8192), vec![1u8; 4096]);
        },
        "a changed the inode while b held its lock",
        "the handoff was not retried",
    );
    assert_eq!(writer.join().unwrap().unwrap(), 4096);
    a.fsync(f.ino, false).unwrap();
    let mut want = vec![1u8; 4096];
    want.extend_from_slice(&[2u8; 4096]);
    assert_eq!(read(&b, &bfh, 8192), want);
    b.release(&bfh).unwrap();
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    let report = cetrafs_core::check::check_volume(&*dev).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
}

#[test]
fn a_failed_give_back_keeps_the_lock_and_the_next_sweep_gives_it_back() {
    let _turn = take_turn();
    let dev = volume();
    let a = Volume::mount(
        dev.clone(),
        &MountOptions {
            host: "a".into(),
            inode_locks: Some(1),
            ..MountOptions::default()
        },
    )
    .unwrap();
    let area = a.superblock().object_lock_area().unwrap();
    let locks = ObjectLocks::new(dev.clone(), area, Duration::from_secs(1)).unwrap();
    // Does any node hold inode `ino`'s lock, by the bucket on the device?
    let held = |ino: u64| {
        let obj = ObjectId::inode(ino).unwrap();
        let (_, b) = locks.read_bucket(locks.bucket_of(obj)).unwrap();
        b.entry(obj.raw())
            .is_some_and(|e| e.holders().next().is_some())
    };
    let r = a.root_ino();
    let mut files = Vec::new();
    for name in [b"f1", b"f2"] {
        let (f, fh) = a.create(r, name, 0o644, Caller::ROOT, true).unwrap();
        a.write(&fh, 0, &[3u8; 4096]).unwrap();
        files.push((f.ino, fh));
    }
    failpoint::arm("inode_lock::before_give_back");
    for (_, fh) in &files {
        assert_eq!(read(&a, fh, 4096), vec![3u8; 4096]);
    }
    // Two locks held, the limit is one: the sweep tries, its give-back fails, nothing changes.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        files.iter().all(|(i, _)| held(*i)),
        "a failed give-back released a lock"
    );
    for (_, fh) in &files {
        assert_eq!(read(&a, fh, 4096), vec![3u8; 4096]);
    }
    failpoint::disarm_all();
    let t = Instant::now();
    while files.iter().all(|(i, _)| held(*i)) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the give-back was not retried"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The lock given back is taken again on the next read.
    for (_, fh) in &files {
        assert_eq!(read(&a, fh, 4096), vec![3u8; 4096]);
    }
    for (_, fh) in &files {
        a.release(fh).unwrap();
    }
    a.unmount().unwrap();
    let report = cetrafs_core::check::check_volume(&*dev).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
}

#[test]
fn a_failed_write_home_keeps_the_owners_lock_until_it_works() {
    let _turn = take_turn();
    let dev = volume();
    let (a, b) = (mount(&dev, "a"), mount(&dev, "b"));
    let r = a.root_ino();
    // A thin image on a; its first write makes the inode lock a's, the later ones go without
    // the global lock while b holds it.
    let (f, fh) = a.create(r, b"img", 0o644, Caller::ROOT, true).unwrap();
    let thin = cetrafs_core::fs::SetAttr {
        size: Some(1 << 30),
        ..Default::default()
    };
    a.setattr(f.ino, &thin, Caller::ROOT).unwrap();
    a.write(&fh, 0, &[1u8; 4096]).unwrap();
    b.mkdir(r, b"d", 0o755, Caller::ROOT).unwrap();
    for i in 1..8u64 {
        a.write(&fh, i << 18, &[7u8; 4096]).unwrap();
    }
    failpoint::arm("detached::before_home");
    let b2 = b.clone();
    let ino = f.ino;
    let reader = std::thread::spawn(move || b2.getattr(ino).map(|at| at.blocks));
    held_back_then_retried(
        &reader,
        &mut || {},
        "b read the inode while a had not written it home",
        "the write-home was not retried",
    );
    let blocks = reader.join().unwrap().unwrap();
    assert!(blocks * 512 >= 8 * 4096, "b sees {} bytes", blocks * 512);
    let bfh = b.open(f.ino, false, false).unwrap();
    let mut got = Vec::new();
    b.read(&bfh, 7 << 18, 4096, &mut |d| got.extend_from_slice(d))
        .unwrap();
    assert_eq!(got, vec![7u8; 4096]);
    b.release(&bfh).unwrap();
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    let report = cetrafs_core::check::check_volume(&*dev).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
}
