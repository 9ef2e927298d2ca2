//! Allocating writes in flight (fs/inflight.rs, fs/data.rs): a device that parks chosen data
//! writes shows what runs while a write's data is on its way, and what waits for it.

use super::*;
use crate::dev::mem::MemDevice;
use crate::dev::{BlockDevice, CawOutcome, Geometry};
use crate::mkfs::{format, MkfsOptions};
use std::sync::mpsc;
use std::time::Duration;

const C: Caller = Caller::ROOT;

/// How long a write that must wait is given to show that it does.
const STILL: Duration = Duration::from_millis(200);

#[derive(Debug, Default)]
struct Gate {
    /// Writes whose first byte is this are parked (or failed) while the gate is shut.
    marker: Option<u8>,
    /// Reads of exactly (offset, length) are parked, once read, while the gate is shut.
    read: Option<(u64, usize)>,
    parked: usize,
    open: bool,
    fail: bool,
}

/// A memory device whose data writes starting with a marker byte, or reads of one range,
/// wait for the test.
#[derive(Debug)]
pub(super) struct Gated {
    dev: Arc<MemDevice>,
    gate: Mutex<Gate>,
    cv: Condvar,
}

impl Gated {
    pub(super) fn new(dev: Arc<MemDevice>) -> Arc<Self> {
        Arc::new(Self {
            dev,
            gate: Mutex::new(Gate::default()),
            cv: Condvar::new(),
        })
    }

    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap()
    }

    /// Park writes starting with `marker` (or, with `fail`, fail them) until `open`.
    fn shut(&self, marker: u8, fail: bool) {
        *self.gate() = Gate {
            marker: Some(marker),
            fail,
            ..Gate::default()
        };
    }

    /// Park reads of exactly `offset`, `len` (after they read: they return what the device
    /// held then) until `open`.
    pub(super) fn shut_read(&self, offset: u64, len: usize) {
        *self.gate() = Gate {
            read: Some((offset, len)),
            ..Gate::default()
        };
    }

    /// Wait, counted as parked, until the test opens the gate.
    fn park(&self, mut g: MutexGuard<'_, Gate>) {
        g.parked += 1;
        self.cv.notify_all();
        g = self.cv.wait_while(g, |g| !g.open).unwrap();
        g.parked -= 1;
    }

    pub(super) fn open(&self) {
        self.gate().open = true;
        self.cv.notify_all();
    }

    pub(super) fn wait_parked(&self, n: usize) {
        let g = self.gate();
        let (g, t) = self
            .cv
            .wait_timeout_while(g, Duration::from_secs(10), |g| g.parked < n)
            .unwrap();
        assert!(!t.timed_out(), "{} writes parked, expected {n}", g.parked);
    }
}

impl BlockDevice for Gated {
    fn geometry(&self) -> &Geometry {
        self.dev.geometry()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.dev.read_at(offset, buf)?;
        let g = self.gate();
        if g.read == Some((offset, buf.len())) && !g.open {
            self.park(g);
        }
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let g = self.gate();
        if g.marker.is_some() && buf.first().copied() == g.marker && !g.open {
            if g.fail {
                bail!(Io, "gated write failed");
            }
            self.park(g);
        }
        self.dev.write_at(offset, buf)
    }
    fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
        self.dev.compare_and_write(lba, expected, new)
    }
    fn flush(&self) -> Result<()> {
        self.dev.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.dev.discard(offset, len)
    }
    fn refresh_size(&self) -> Result<u64> {
        self.dev.refresh_size()
    }
}

fn formatted(nodes: u32) -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(256 << 20, 512));
    let opts = MkfsOptions {
        max_nodes: nodes,
        journal_bytes: 1 << 20,
        heartbeat_interval_ms: 50,
        io_timeout_ms: 100,
        ..Default::default()
    };
    format(&*dev, &opts, &mut |_, _| {}).unwrap();
    dev
}

fn mount(dev: Arc<dyn BlockDevice>, host: &str) -> Arc<Volume> {
    Volume::mount(
        dev,
        &MountOptions {
            host: host.into(),
            ..MountOptions::default()
        },
    )
    .unwrap()
}

fn gated() -> (Arc<MemDevice>, Arc<Gated>, Arc<Volume>) {
    let mem = formatted(2);
    let g = Gated::new(mem.clone());
    let v = mount(g.clone(), "a");
    (mem, g, v)
}

fn read(v: &Volume, fh: &OpenFile, off: u64, len: u32) -> Vec<u8> {
    let mut out = Vec::new();
    v.read(fh, off, len, &mut |d| out.extend_from_slice(d))
        .unwrap();
    out
}

/// Run `f` on a thread; the receiver gets its result when it is done.
fn spawn<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> mpsc::Receiver<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx
}

/// Every device I/O of `mem` takes `us` microseconds (0: none).
fn latency(mem: &MemDevice, us: u64) {
    mem.faults
        .latency_us
        .store(us, std::sync::atomic::Ordering::Relaxed);
}

fn held(v: &Volume) -> u64 {
    v.lock_meta().held_blocks()
}

fn check_clean(v: &Volume, mem: &MemDevice) {
    v.unmount().unwrap();
    let report = crate::check::check_volume(mem).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
}

#[test]
fn an_allocating_write_in_flight_holds_no_metadata_mutex() {
    let (mem, g, v) = gated();
    let root = v.root_ino();
    let (f, fh) = v.create(root, b"f", 0o644, C, true).unwrap();
    g.shut(0xA1, false);
    let (v2, fh2) = (v.clone(), fh.clone());
    let a = spawn(move || v2.write(&fh2, 1 << 20, &[0xA1; 4096]));
    g.wait_parked(1);
    assert_eq!(held(&v), 1, "the block is held, in memory only");
    // Metadata operations and other allocating writes into the same file go on meanwhile.
    let (_, gfh) = v.create(root, b"g", 0o644, C, true).unwrap();
    v.write(&gfh, 0, &[0x11; 5000]).unwrap();
    v.write(&fh, 0, &[0x12; 8192]).unwrap();
    // Not mapped yet: the file ends before it, and its block reads as a hole.
    assert_eq!(v.getattr(f.ino).unwrap().size, 8192);
    v.fsync(f.ino, false).unwrap();
    assert!(a.try_recv().is_err(), "the parked write finished");
    g.open();
    assert_eq!(a.recv().unwrap().unwrap(), 4096);
    assert_eq!(held(&v), 0);
    assert_eq!(v.getattr(f.ino).unwrap().size, (1 << 20) + 4096);
    assert_eq!(read(&v, &fh, 0, 8192), vec![0x12; 8192]);
    assert_eq!(read(&v, &fh, 8192, 4096), vec![0; 4096]);
    assert_eq!(read(&v, &fh, 1 << 20, 4096), vec![0xA1; 4096]);
    v.release(&fh).unwrap();
    v.release(&gfh).unwrap();
    check_clean(&v, &mem);
}

#[test]
fn writers_into_one_unmapped_block_allocate_it_once() {
    let (mem, g, v) = gated();
    let root = v.root_ino();
    let (f, fh) = v.create(root, b"f", 0o644, C, true).unwrap();
    let free0 = v.statfs().unwrap().bfree;
    g.shut(0xA2, false);
    let (va, fha) = (v.clone(), fh.clone());
    let a = spawn(move || va.write(&fha, 0, &[0xA2; 4096]));
    g.wait_parked(1);
    // The same block, unaligned: waits for the first write to be mapped.
    let (vb, fhb) = (v.clone(), fh.clone());
    let b = spawn(move || vb.write(&fhb, 100, &[0x22; 10]));
    // Another block of the same file: goes on.
    v.write(&fh, 8192, &[0x33; 4096]).unwrap();
    std::thread::sleep(STILL);
    assert!(
        b.try_recv().is_err(),
        "a second writer went into a block in flight"
    );
    g.open();
    assert_eq!(a.recv().unwrap().unwrap(), 4096);
    assert_eq!(b.recv().unwrap().unwrap(), 10);
    let mut want = vec![0xA2; 4096];
    want[100..110].fill(0x22);
    assert_eq!(read(&v, &fh, 0, 4096), want);
    assert_eq!(read(&v, &fh, 8192, 4096), vec![0x33; 4096]);
    // Exactly two data blocks: block 0 was allocated once.
    let mapped: u64 = v
        .extents(f.ino)
        .unwrap()
        .iter()
        .map(|e| u64::from(e.len))
        .sum();
    assert_eq!(mapped, 2);
    assert_eq!(free0 - v.statfs().unwrap().bfree, 2);
    v.release(&fh).unwrap();
    check_clean(&v, &mem);
}

#[test]
fn truncate_and_punch_wait_for_a_write_in_flight() {
    let (mem, g, v) = gated();
    let root = v.root_ino();
    let (f, fh) = v.create(root, b"f", 0o644, C, true).unwrap();
    let free0 = v.statfs().unwrap().bfree;
    for (marker, punch) in [(0xA3u8, false), (0xA4, true)] {
        g.shut(marker, false);
        let (va, fha) = (v.clone(), fh.clone());
        let a = spawn(move || va.write(&fha, 1 << 20, &[marker; 8192]));
        g.wait_parked(1);
        let vt = v.clone();
        let ino = f.ino;
        let t = spawn(move || {
            if punch {
                vt.fallocate(ino, 0, 4 << 20, FallocMode::PunchHole)
            } else {
                vt.setattr(
                    ino,
                    &SetAttr {
                        size: Some(0),
                        ..Default::default()
                    },
                    C,
                )
                .map(|_| ())
            }
        });
        std::thread::sleep(STILL);
        assert!(
            t.try_recv().is_err(),
            "truncate/punch ran under a write in flight"
        );
        // Writes into the file wait behind the draining operation too.
        let (vw, fhw) = (v.clone(), fh.clone());
        let w = spawn(move || vw.write(&fhw, 3 << 20, &[0x44; 4096]));
        std::thread::sleep(STILL);
        assert!(
            w.try_recv().is_err(),
            "a write overtook a draining truncate/punch"
        );
        g.open();
        assert_eq!(a.recv().unwrap().unwrap(), 8192);
        t.recv().unwrap().unwrap();
        assert_eq!(w.recv().unwrap().unwrap(), 4096);
        // The parked write was mapped, then truncated or punched away; only the last remains.
        let ext = v.extents(f.ino).unwrap();
        assert_eq!(ext.len(), 1, "{ext:?}");
        assert_eq!(ext[0].logical, (3 << 20) / FS_BLOCK);
        assert_eq!(read(&v, &fh, 1 << 20, 8192), vec![0; 8192]);
        assert_eq!(free0 - v.statfs().unwrap().bfree, 1);
        v.setattr(
            f.ino,
            &SetAttr {
                size: Some(0),
                ..Default::default()
            },
            C,
        )
        .unwrap();
        v.fsync(f.ino, false).unwrap();
        assert_eq!(free0, v.statfs().unwrap().bfree);
    }
    v.release(&fh).unwrap();
    check_clean(&v, &mem);
}

#[test]
fn a_failed_allocating_write_gives_its_blocks_back() {
    let (mem, g, v) = gated();
    let root = v.root_ino();
    let (f, fh) = v.create(root, b"f", 0o644, C, true).unwrap();
    v.write(&fh, 0, &[0x55; 100]).unwrap();
    let free0 = v.statfs().unwrap().bfree;
    g.shut(0xA6, true);
    let e = v.write(&fh, 1 << 20, &vec![0xA6; 65536]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io);
    assert_eq!(held(&v), 0);
    assert_eq!(free0, v.statfs().unwrap().bfree);
    assert_eq!(v.getattr(f.ino).unwrap().size, 100);
    assert_eq!(v.extents(f.ino).unwrap().len(), 1);
    // The space is usable again, and the volume is consistent.
    g.open();
    v.write(&fh, 1 << 20, &vec![0xA6; 65536]).unwrap();
    assert_eq!(read(&v, &fh, 1 << 20, 65536), vec![0xA6; 65536]);
    v.release(&fh).unwrap();
    check_clean(&v, &mem);
}

#[test]
fn many_concurrent_writers_into_a_sparse_file() {
    const SPAN: u64 = 2 << 20;
    let (mem, _g, v) = gated();
    let root = v.root_ino();
    let (f, fh) = v.create(root, b"f", 0o644, C, true).unwrap();
    latency(&mem, 300);
    // 8 threads, interleaved 4 KiB and odd-sized writes over one 2 MiB region, each byte
    // written exactly once; several writers land in the same blocks.
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (v, fh) = (v.clone(), fh.clone());
            std::thread::spawn(move || {
                let mut off = t * 3000;
                while off < SPAN {
                    let len = 3000.min(SPAN - off);
                    let data: Vec<u8> = (off..off + len).map(|i| (i % 251) as u8).collect();
                    v.write(&fh, off, &data).unwrap();
                    off += 8 * 3000;
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    latency(&mem, 0);
    assert_eq!(v.getattr(f.ino).unwrap().size, SPAN);
    let back = read(&v, &fh, 0, u32::try_from(SPAN).unwrap());
    let want: Vec<u8> = (0..SPAN).map(|i| (i % 251) as u8).collect();
    assert!(back == want, "file content differs");
    let mapped: u64 = v
        .extents(f.ino)
        .unwrap()
        .iter()
        .map(|e| u64::from(e.len))
        .sum();
    assert_eq!(mapped, SPAN / FS_BLOCK);
    v.release(&fh).unwrap();
    check_clean(&v, &mem);
}

#[test]
fn a_handoff_waits_for_writes_in_flight_to_be_mapped() {
    let mem = formatted(4);
    let g = Gated::new(mem.clone());
    let a = mount(g.clone(), "a");
    let b = mount(mem.clone(), "b");
    let root = a.root_ino();
    let (f, fh) = a.create(root, b"f", 0o644, C, true).unwrap();
    g.shut(0xA5, false);
    let (va, fha) = (a.clone(), fh.clone());
    let w = spawn(move || va.write(&fha, 0, &[0xA5; 16384]));
    g.wait_parked(1);
    // b needs the global lock, which a holds exclusively with blocks only it knows of.
    let vb = b.clone();
    let l = spawn(move || vb.lookup(root, b"f"));
    std::thread::sleep(STILL * 2);
    assert!(
        l.try_recv().is_err(),
        "the lock was handed over with a write in flight"
    );
    g.open();
    assert_eq!(w.recv().unwrap().unwrap(), 16384);
    let seen = l.recv().unwrap().unwrap();
    assert_eq!(seen.size, 16384);
    let bfh = b.open(f.ino, false, false).unwrap();
    assert_eq!(read(&b, &bfh, 0, 16384), vec![0xA5; 16384]);
    b.release(&bfh).unwrap();
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    let report = crate::check::check_volume(&*mem).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
}

#[test]
fn a_queued_write_answers_through_its_completion_and_its_writer_goes_on() {
    let (mem, g, v) = gated();
    let root = v.root_ino();
    let (f, fh) = v.create(root, b"f", 0o644, C, true).unwrap();
    g.shut(0xB1, false);
    let (done_tx, done_rx) = mpsc::channel();
    let writers: Vec<_> = [0u64, 1 << 20]
        .into_iter()
        .map(|off| {
            let (v, fh, done_tx) = (v.clone(), fh.clone(), done_tx.clone());
            spawn(move || {
                let done: WriteDone = Box::new(move |r| {
                    let _ = done_tx.send((off, r));
                });
                matches!(
                    v.write_then(&fh, WriteAt::Offset(off), &[0xB1; 4096], &C, done),
                    WriteStarted::Queued
                )
            })
        })
        .collect();
    g.wait_parked(2);
    // Both data writes done while the mutex is taken: one writer becomes the mapper and waits
    // for the mutex, the other queues its write and goes on without an answer.
    let m = v.lock_meta();
    g.open();
    let went_on = std::time::Instant::now();
    let first = loop {
        if let Some(i) = writers.iter().position(|w| w.try_recv().is_ok()) {
            break i;
        }
        assert!(went_on.elapsed() < STILL * 10, "no writer went on");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert!(
        done_rx.recv_timeout(STILL).is_err(),
        "answered before mapped"
    );
    drop(m);
    assert!(
        writers[1 - first].recv().unwrap(),
        "the mapper's write was queued too"
    );
    let mut answers: Vec<_> = (0..2).map(|_| done_rx.recv().unwrap()).collect();
    answers.sort_by_key(|a| a.0);
    for (off, r) in answers {
        let w = r.unwrap();
        assert_eq!((w.offset, w.bytes, w.dropped), (off, 4096, 0));
    }
    assert!(done_rx.try_recv().is_err(), "a completion was called twice");
    assert_eq!(v.getattr(f.ino).unwrap().size, (1 << 20) + 4096);
    assert_eq!(read(&v, &fh, 0, 4096), vec![0xB1; 4096]);
    assert_eq!(read(&v, &fh, 1 << 20, 4096), vec![0xB1; 4096]);
    assert_eq!(held(&v), 0);
    v.release(&fh).unwrap();
    check_clean(&v, &mem);
}

#[test]
fn waiting_and_answered_writers_mixed_all_finish_once() {
    const SPAN: u64 = 4 << 20;
    let (mem, _g, v) = gated();
    let root = v.root_ino();
    let (f, fh) = v.create(root, b"f", 0o644, C, true).unwrap();
    latency(&mem, 200);
    // 8 threads over one sparse 4 MiB file, 4 KiB each, every block once: the even threads
    // wait for each write (a waiting writer may be the mapper and must hand over), the odd
    // ones go on and count their answers.
    let answers = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (v, fh, answers) = (v.clone(), fh.clone(), answers.clone());
            std::thread::spawn(move || {
                let mut sent = 0u64;
                for b in (t..SPAN / FS_BLOCK).step_by(8) {
                    let data = vec![u8::try_from(b % 251).unwrap(); 4096];
                    if t % 2 == 0 {
                        assert_eq!(v.write(&fh, b * FS_BLOCK, &data).unwrap(), 4096);
                        continue;
                    }
                    let a = answers.clone();
                    let done: WriteDone = Box::new(move |r| {
                        assert_eq!(r.unwrap().bytes, 4096);
                        a.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    });
                    sent += 1;
                    if let WriteStarted::Done(r, done) =
                        v.write_then(&fh, WriteAt::Offset(b * FS_BLOCK), &data, &C, done)
                    {
                        done(r);
                    }
                }
                sent
            })
        })
        .collect();
    let sent: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let t0 = std::time::Instant::now();
    while answers.load(std::sync::atomic::Ordering::SeqCst) < sent {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "a queued write was never answered"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(STILL);
    assert_eq!(answers.load(std::sync::atomic::Ordering::SeqCst), sent);
    latency(&mem, 0);
    assert_eq!(v.getattr(f.ino).unwrap().size, SPAN);
    let back = read(&v, &fh, 0, u32::try_from(SPAN).unwrap());
    for (b, chunk) in back.chunks(4096).enumerate() {
        let want = u8::try_from(b % 251).unwrap();
        assert!(chunk.iter().all(|&x| x == want), "block {b} differs");
    }
    assert_eq!(held(&v), 0);
    v.release(&fh).unwrap();
    check_clean(&v, &mem);
}

/// A guest's random writes into a fresh thin image: a write into a granule that another
/// write in flight allocates waits for it without the global lock, on a node that owns the
/// image (fs/data.rs `try_detached`). It used to take the metadata path, which waited the
/// same way but first took the global lock from the other nodes: with three nodes growing
/// images, a handoff and its four device flushes each time (docs/performance.md §6o).
#[test]
fn a_write_into_a_granule_in_flight_takes_no_global_lock() {
    use super::detached_tests::gml;
    use crate::format::lock_record::LockMode;
    let mem = formatted(4);
    let g = Gated::new(mem.clone());
    let a = mount(g.clone(), "a");
    let b = mount(mem.clone(), "b");
    let (f, fh) = a.create(a.root_ino(), b"img", 0o644, C, true).unwrap();
    let size = SetAttr {
        size: Some(1 << 30),
        ..Default::default()
    };
    a.setattr(f.ino, &size, C).unwrap();
    // The first allocating write owns the image's lock and fills a's pool.
    a.write(&fh, 0, &[1; 4096]).unwrap();
    // b takes the global lock exclusively and keeps it (nobody asks for it back).
    b.mkdir(b.root_ino(), b"d", 0o755, C).unwrap();
    assert_eq!(gml(&b), LockMode::Exclusive);
    assert_eq!(gml(&a), LockMode::Free);
    let granule = 4 << 20;
    g.shut(0xAB, false);
    let (va, fha) = (a.clone(), fh.clone());
    let first = spawn(move || va.write(&fha, granule, &[0xAB; 4096]));
    g.wait_parked(1);
    // The same granule, another block: waits for the first write to be mapped.
    let (va, fha) = (a.clone(), fh.clone());
    let second = spawn(move || va.write(&fha, granule + 8192, &[0xCD; 4096]));
    std::thread::sleep(STILL);
    assert!(
        second.try_recv().is_err(),
        "a write went into a granule in flight"
    );
    g.open();
    assert_eq!(first.recv().unwrap().unwrap(), 4096);
    assert_eq!(second.recv().unwrap().unwrap(), 4096);
    assert_eq!(
        gml(&a),
        LockMode::Free,
        "a write into a granule in flight took the global lock"
    );
    assert_eq!(gml(&b), LockMode::Exclusive);
    let mut want = vec![0xAB; 4096];
    want.extend([0; 4096]);
    want.extend([0xCD; 4096]);
    assert_eq!(read(&a, &fh, granule, 3 * 4096), want);
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    let report = crate::check::check_volume(&*mem).unwrap();
    assert!(report.findings.is_empty(), "{:?}", report.findings);
}
