//! A pool refill from a marked group that fails between its journal write and its home
//! writes (the `failpoints` feature; run with `cargo test -p cetrafs-core --features
//! failpoints --test group_marks_failpoints`). Two nodes on one format-7 volume; node b holds
//! the global lock; node a grows a thin image, so its pool runs low and it refills from its
//! own group under the group's mark, without the global lock (`fs/group_marks.rs`). The
//! refill's commit point fails after the journal (`commit::before_home`): a fences itself and
//! leaves its mark, so nobody uses the group. b recovers a: it replays a's journal (the refill
//! reaches home), then takes a's mark off with a's other locks. b can then free into that
//! group, and the volume checks clean.
#![cfg(feature = "failpoints")]

use cetrafs_core::cluster::lock::LockTable;
use cetrafs_core::dev::mem::MemDevice;
use cetrafs_core::failpoint;
use cetrafs_core::format::lock_record::{LockMode, NO_SLOT};
use cetrafs_core::fs::{Caller, MountOptions, RenameFlags, SetAttr, Volume};
use cetrafs_core::mkfs::{format, MkfsOptions};
use cetrafs_core::ErrorKind;
use std::sync::Arc;
use std::time::{Duration, Instant};

const C: Caller = Caller::ROOT;
const MIB: u64 = 1 << 20;

/// The slots whose mark is on a group, by group.
fn marks(locks: &LockTable) -> Vec<(u64, u32)> {
    (0u64..)
        .zip(locks.group_records().unwrap())
        .filter(|(_, r)| r.next != NO_SLOT)
        .map(|(g, r)| (g, r.next))
        .collect()
}

#[test]
fn a_refill_that_failed_after_its_journal_is_replayed_and_its_mark_cleared() {
    let dev = Arc::new(MemDevice::new(512 << 20, 512));
    let mk = MkfsOptions {
        max_nodes: 4,
        journal_bytes: 1 << 20,
        heartbeat_interval_ms: 50,
        io_timeout_ms: 100,
        ..Default::default()
    };
    let sb = format(&*dev, &mk, &mut |_, _| {}).unwrap();
    assert!(sb.has_group_marks());
    let locks = LockTable::new(dev.clone(), &sb);
    let opts = |host: &str| MountOptions {
        host: host.into(),
        // No committer: the refill's is the only commit point of a's writes below.
        commit_interval: Duration::ZERO,
        alloc_granule: 4096,
        ..MountOptions::default()
    };
    let a = Volume::mount(dev.clone(), &opts("a")).unwrap();
    let b = Volume::mount(dev.clone(), &opts("b")).unwrap();
    let (img, fh) = a.create(a.root_ino(), b"img", 0o644, C, true).unwrap();
    let grow = SetAttr {
        size: Some(1 << 30),
        ..Default::default()
    };
    a.setattr(img.ino, &grow, C).unwrap();
    let data = vec![0x3C_u8; 1 << 20];
    a.write(&fh, 0, &data).unwrap();
    a.fsync(img.ino, false).unwrap();
    // b takes the global lock and keeps it (a move between directories needs it).
    let d = b.mkdir(b.root_ino(), b"d", 0o755, C).unwrap();
    b.mkdir(b.root_ino(), b"e", 0o755, C).unwrap();
    b.rename(b.root_ino(), b"e", d.ino, b"e", RenameFlags::default())
        .unwrap();
    assert!(marks(&locks).is_empty());

    failpoint::arm("commit::before_home");
    let mut off = MIB;
    let err = loop {
        match a.write(&fh, off, &data) {
            Ok(_) => off += MIB,
            Err(e) => break e,
        }
        assert!(off < 256 * MIB, "no refill within 256 MiB");
    };
    failpoint::disarm_all();
    eprintln!("a's write at {} MiB failed: {err}", off / MIB);
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    let left = marks(&locks);
    assert_eq!(left.len(), 1, "a's refill left its mark: {left:?}");
    let (g, slot) = left[0];
    assert_eq!(slot, a.slot());

    // b recovers a (dead time 1.2 s): the replay, then the mark goes with a's locks.
    let t0 = Instant::now();
    while !marks(&locks).is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "a's mark on group {g} stayed: {:?}",
            marks(&locks)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let rec = &locks.group_records().unwrap()[usize::try_from(g).unwrap()];
    assert_eq!(
        rec.mode,
        LockMode::Free,
        "a's group is free after its recovery"
    );
    // b reads what a wrote and made durable, then deletes the image: its blocks, in a's
    // former group, go back to the bitmaps.
    let mut got = Vec::new();
    let bfh = b.open(img.ino, false, false).unwrap();
    b.read(&bfh, 0, 1 << 20, &mut |d| got.extend_from_slice(d))
        .unwrap();
    assert!(got == data, "the fsynced first MiB");
    b.release(&bfh).unwrap();
    b.unlink(b.root_ino(), b"img").unwrap();
    b.unmount().unwrap();
    drop(a);
    let report = cetrafs_core::check::check_volume(&*dev).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
}
