//! Crashes at the object-lock handoff steps (the `failpoints` feature; run with
//! `cargo test -p cetrafs-core --features failpoints --test objlock_failpoints`). Its own test
//! binary, so no other test disarms these points while they are armed. A failed step must
//! leave the lock held (nothing released before the flush, nothing lost after it) and the
//! request in the mailbox, so that the next tick finishes the handoff.
#![cfg(feature = "failpoints")]

use cetrafs_core::cluster::lock::Me;
use cetrafs_core::cluster::object_lock::{
    Handoff, LockMode, ObjectId, ObjectLockArea, ObjectLocks,
};
use cetrafs_core::dev::mem::MemDevice;
use cetrafs_core::dev::SharedDevice;
use cetrafs_core::{failpoint, Error, Result};
use std::sync::Arc;
use std::time::Duration;

struct Count(u32, u32);

impl Handoff for Count {
    fn flush(&mut self, _: ObjectId, _: LockMode) -> Result<bool> {
        self.0 += 1;
        Ok(true)
    }
    fn handed(&mut self, _: ObjectId, _: LockMode, r: &Result<()>) {
        if r.is_ok() {
            self.1 += 1;
        }
    }
}

fn never() -> Option<Error> {
    None
}

#[test]
fn objlock_handoff_failpoints_leave_the_request_for_the_next_tick() {
    let dev: SharedDevice = Arc::new(MemDevice::new(1 << 20, 512));
    let area = ObjectLockArea {
        bucket_offset: 8 * 512,
        buckets: 4,
        mailbox_offset: 16 * 512,
        mailboxes: 4,
    };
    let t = Arc::new(
        ObjectLocks::new(dev, area, Duration::from_secs(5))
            .unwrap()
            .with_backoff(Duration::from_micros(20), Duration::from_micros(500))
            .with_refresh(Duration::from_millis(2)),
    );
    let (a, b) = (Me { slot: 1, gen: 3 }, Me { slot: 2, gen: 4 });
    let x = ObjectId::inode(77).unwrap();
    t.acquire(a, x, LockMode::Exclusive, &never).unwrap();
    let tw = t.clone();
    let waiter = std::thread::spawn(move || tw.acquire(b, x, LockMode::Exclusive, &never));
    while t.poll_mailbox(a).unwrap().is_empty() {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut h = Count(0, 0);
    for point in [
        "objlock::handoff_after_flush",
        "objlock::handoff_before_clear",
    ] {
        failpoint::arm(point);
        let e = t.serve_mailbox(a, &mut h).unwrap_err();
        failpoint::disarm_all();
        assert!(e.to_string().contains(point), "{e}");
        assert!(
            !t.poll_mailbox(a).unwrap().is_empty(),
            "request kept after {point}"
        );
    }
    // after_flush: flushed, not released (handed saw the error); before_clear: released.
    assert_eq!((h.0, h.1), (2, 1));
    let g = waiter.join().unwrap().unwrap();
    assert_eq!(g.mode, LockMode::Exclusive);
    // The next tick finds it no longer holds x and only clears the request.
    let s = t.serve_mailbox(a, &mut h).unwrap();
    assert_eq!(s.handed, 0);
    assert!(t.poll_mailbox(a).unwrap().is_empty());
    // A failed post is retried at the next refresh: the waiter still gets the lock.
    let tw = t.clone();
    failpoint::arm("objlock::post_request");
    let waiter = std::thread::spawn(move || tw.acquire(a, x, LockMode::Shared, &never));
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        t.poll_mailbox(b).unwrap().is_empty(),
        "posting fails while armed"
    );
    failpoint::disarm_all();
    let start = std::time::Instant::now();
    while !waiter.is_finished() {
        t.serve_mailbox(b, &mut h).unwrap();
        assert!(start.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(waiter.join().unwrap().unwrap().mode, LockMode::Shared);
}
