//! Crashes at named points inside a commit (the `failpoints` feature; run with
//! `cargo test -p cetrafs-core --features failpoints --test failpoints`). A failpoint makes the
//! commit stop with an I/O error right there; the device image at that moment is what a power
//! cut would leave, and it must mount (replaying the journal) to a consistent volume that
//! holds exactly the transactions that reached the journal.
#![cfg(feature = "failpoints")]

use cetrafs_core::check::check_volume;
use cetrafs_core::dev::mem::MemDevice;
use cetrafs_core::failpoint;
use cetrafs_core::fs::{Caller, MountOptions, Volume};
use cetrafs_core::mkfs::{format, MkfsOptions};
use std::sync::Arc;
use std::time::Duration;

fn opts() -> MountOptions {
    MountOptions {
        commit_interval: Duration::ZERO,
        ..MountOptions::default()
    }
}

/// Make a few files, arm `point`, sync (which fails there), and return the crashed image.
fn crash_at(point: &str) -> Vec<u8> {
    let dev = Arc::new(MemDevice::new(96 << 20, 512));
    let mk = MkfsOptions {
        max_nodes: 2,
        journal_bytes: 2 << 20,
        ..Default::default()
    };
    format(&*dev, &mk, &mut |_, _| {}).unwrap();
    let v = Volume::mount(dev.clone(), &opts()).unwrap();
    let r = v.root_ino();
    v.mknod(r, b"before", libc::S_IFREG | 0o644, 0, Caller::ROOT)
        .unwrap();
    v.sync().unwrap();
    for i in 0..20 {
        v.mkdir(r, format!("d{i}").as_bytes(), 0o755, Caller::ROOT)
            .unwrap();
    }
    failpoint::arm(point);
    let e = v.sync().unwrap_err();
    failpoint::disarm_all();
    assert!(e.to_string().contains(point), "{e}");
    // After a failed commit the node refuses further changes rather than guess.
    assert!(v.mkdir(r, b"late", 0o755, Caller::ROOT).is_err());
    let img = dev.snapshot();
    drop(v);
    img
}

fn names(img: Vec<u8>) -> Vec<Vec<u8>> {
    let dev = Arc::new(MemDevice::from_image(img, 512));
    let v = Volume::mount(dev.clone(), &opts()).unwrap();
    let mut out = Vec::new();
    v.readdir(v.root_ino(), 2, &mut |e| {
        out.push(e.name.clone());
        true
    })
    .unwrap();
    v.unmount().unwrap();
    let report = check_volume(&*dev).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
    out.sort();
    out
}

/// One test, so the process-wide failpoint table is never shared between threads.
#[test]
fn crashes_inside_a_commit() {
    // Journal written and flushed, nothing home yet: replay must redo the whole transaction.
    let after = names(crash_at("commit::before_home"));
    assert_eq!(
        after.len(),
        21,
        "the logged transaction is replayed: {after:?}"
    );
    // Journal written, not yet flushed: on this device the write landed, so it replays too.
    assert_eq!(names(crash_at("commit::before_journal_flush")).len(), 21);
    // Nothing logged: the volume is at the previous commit point.
    assert_eq!(
        names(crash_at("commit::before_journal")),
        vec![b"before".to_vec()]
    );
}
