//! A recovery that fails part-way is retried, and one that waits for a second dead node does
//! not stop the watcher (the `failpoints` feature; run with
//! `cargo test -p cetrafs-core --features failpoints --test recovery_failpoints`). Two nodes on
//! one volume; node a goes silent (its device drops every write from then on, as if its host
//! lost the LUN or was reset); node b's watcher claims a's slot after the dead time and
//! replays its journal, but releasing a's object locks fails (`recovery::before_object_scrub`).
//! a's slot then stays Recovering with b as its recoverer: a claim nobody else takes over,
//! since b is alive. Once the step works again, b's next watcher tick finishes the recovery
//! and frees the slot.
#![cfg(feature = "failpoints")]

use cetrafs_core::cluster::membership;
use cetrafs_core::dev::mem::MemDevice;
use cetrafs_core::dev::{BlockDevice, CawOutcome, Geometry};
use cetrafs_core::failpoint;
use cetrafs_core::format::heartbeat::SlotState;
use cetrafs_core::fs::{MountOptions, Volume};
use cetrafs_core::mkfs::{format, MkfsOptions};
use cetrafs_core::Result;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One node's view of the shared device: once `silent`, its writes are dropped (reported
/// done), so the others see its heartbeat stop.
#[derive(Debug)]
struct Node {
    dev: Arc<MemDevice>,
    silent: AtomicBool,
}

impl BlockDevice for Node {
    fn geometry(&self) -> &Geometry {
        self.dev.geometry()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.dev.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        if self.silent.load(Ordering::Acquire) {
            return Ok(());
        }
        self.dev.write_at(offset, buf)
    }
    fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
        if self.silent.load(Ordering::Acquire) {
            return Ok(CawOutcome::Miscompare);
        }
        self.dev.compare_and_write(lba, expected, new)
    }
    fn flush(&self) -> Result<()> {
        self.dev.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        if self.silent.load(Ordering::Acquire) {
            return Ok(());
        }
        self.dev.discard(offset, len)
    }
    fn refresh_size(&self) -> Result<u64> {
        self.dev.refresh_size()
    }
}

impl Node {
    /// A node's view of `dev`, not silent yet.
    fn on(dev: &Arc<MemDevice>) -> Arc<Self> {
        Arc::new(Self {
            dev: dev.clone(),
            silent: AtomicBool::new(false),
        })
    }
}

/// A volume for up to four nodes with short timings (dead time 1.2 s).
fn volume() -> (Arc<MemDevice>, cetrafs_core::format::superblock::Superblock) {
    let dev = Arc::new(MemDevice::new(256 << 20, 512));
    let mk = MkfsOptions {
        max_nodes: 4,
        journal_bytes: 1 << 20,
        heartbeat_interval_ms: 50,
        io_timeout_ms: 100,
        ..Default::default()
    };
    let sb = format(&*dev, &mk, &mut |_, _| {}).unwrap();
    (dev, sb)
}

/// The failpoints are process-wide: the tests of this binary take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn take_turn() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn a_recovery_that_failed_part_way_is_retried() {
    let _turn = take_turn();
    let (dev, _) = volume();
    let node_a = Node::on(&dev);
    let opts = |host: &str| MountOptions {
        host: host.into(),
        ..MountOptions::default()
    };
    let a = Volume::mount(node_a.clone(), &opts("a")).unwrap();
    let b = Volume::mount(dev.clone(), &opts("b")).unwrap();
    let sb = b.superblock().clone();
    let slot_a = a.slot();
    let state_of_a = || {
        membership::scan(&*dev, &sb).unwrap()[slot_a as usize]
            .record
            .as_ref()
            .map(|h| (h.state, h.recoverer))
    };

    failpoint::arm("recovery::before_object_scrub");
    node_a.silent.store(true, Ordering::Release);
    // Dead time 1.2 s (50 ms interval, 100 ms I/O timeout); b claims, replays, then fails.
    let t0 = Instant::now();
    while state_of_a().map(|s| s.0) != Some(SlotState::Recovering) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "a's slot never claimed: {:?}",
            state_of_a()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Several watcher ticks with the step failing: the claim stays, b's.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        state_of_a(),
        Some((SlotState::Recovering, b.slot())),
        "the failed recovery must leave b's claim"
    );
    failpoint::disarm_all();
    let t1 = Instant::now();
    while state_of_a().map(|s| s.0) != Some(SlotState::Free) {
        assert!(
            t1.elapsed() < Duration::from_secs(5),
            "b never retried its failed recovery of a: {:?}",
            state_of_a()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "a's slot freed {:?} after the step worked again",
        t1.elapsed()
    );
    b.unmount().unwrap();
    drop(a);
}

/// Two nodes die a moment apart, the second holding the global lock. The survivor's watcher
/// claims the first, whose last steps (its orphans, under the global lock) wait for the
/// second's recovery: they run on a thread of their own, so the watcher goes on, recovers the
/// second (which frees the global lock) and then both finish. Run by the watcher itself, the
/// first recovery's last steps waited for ever and the second was never started.
#[test]
fn a_recovery_waiting_for_a_second_dead_node_does_not_stop_the_watcher() {
    let _turn = take_turn();
    let (dev, sb) = volume();
    let (node_b, node_c) = (Node::on(&dev), Node::on(&dev));
    let opts = |host: &str| MountOptions {
        host: host.into(),
        ..MountOptions::default()
    };
    let a = Volume::mount(dev.clone(), &opts("a")).unwrap();
    let b = Volume::mount(node_b.clone(), &opts("b")).unwrap();
    let c = Volume::mount(node_c.clone(), &opts("c")).unwrap();
    let caller = cetrafs_core::fs::Caller::ROOT;
    // c takes the global lock exclusively (a move between directories needs it) and keeps it.
    let d = c.mkdir(c.root_ino(), b"d", 0o755, caller).unwrap();
    c.mkdir(c.root_ino(), b"e", 0o755, caller).unwrap();
    c.rename(
        c.root_ino(),
        b"e",
        d.ino,
        b"e",
        cetrafs_core::fs::RenameFlags::default(),
    )
    .unwrap();
    // b first, then c a few heartbeats later: a finds b dead one scan before c.
    node_b.silent.store(true, Ordering::Release);
    std::thread::sleep(Duration::from_millis(300));
    node_c.silent.store(true, Ordering::Release);
    let free = |slot: u32| {
        membership::scan(&*dev, &sb).unwrap()[slot as usize]
            .record
            .as_ref()
            .is_none_or(|h| h.state == SlotState::Free)
    };
    let t0 = Instant::now();
    while !(free(b.slot()) && free(c.slot())) {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "a did not recover both b and c"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("b and c recovered {:?} after c went silent", t0.elapsed());
    // The global lock is free again for a.
    a.mkdir(a.root_ino(), b"after", 0o755, caller).unwrap();
    a.unmount().unwrap();
    drop((b, c));
}
