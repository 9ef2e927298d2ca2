//! Crash harness for two nodes' journals with interleaved handoffs of one inode (issue 9,
//! "Done when": "replaying A's journal after B changed that inode never rolls B back";
//! docs/recovery.md, "The replay rule").
//!
//! Two `Volume`s (nodes `a` and `b`) mount one recording memory device. They take turns
//! changing the same inode X (its size: a distinct value per step, each step fsync'd, so
//! every step is one commit point in that node's own journal), so the metadata lock that
//! protects X is handed over between the two journals at every step: a, b, a, b, ... (both
//! orders of handoff, several times). Then the device is rebuilt as a power cut would leave it
//! at **every** point of the recorded write stream (all issued writes persisted), at every
//! flush point (nothing unflushed persisted), and at random points with a random subset of the
//! unflushed writes persisted (one possibly torn).
//!
//! For each crash image the journals are also **resurrected**: the last transaction each node
//! wrote to its journal before the cut is written back into that journal, as if the node had
//! died without ever emptying it. Today a handoff empties the journal before releasing the
//! lock, so this state does not arise by itself; with per-object locks a node's journal may
//! well still hold a transaction that logged X (plus blocks it still holds locks on) after it
//! wrote X home and handed X's lock on. The replay rule must make that harmless: a logged
//! block never replaces a newer home copy.
//!
//! X's size after recovery must be the value of some step between the newest step that was
//! durable at the cut (its fsync returned before the cut's last flush) and the newest step
//! that had started: never older (a roll-back), never invented. Checked for: no
//! resurrection, a's journal, b's journal, both; each replayed a-then-b and b-then-a with
//! `journal::replay` (what recovery and mount run), both orders giving the same X; and the
//! replayed view `fsck.cetra -n` uses. A sample of states is recovered by real mounts: as
//! `b` (b's own journal first, then a's journal by recovering dead a) and as `a` (the
//! opposite order), then unmounted and checked clean by fsck.

use cetrafs_core::check::check_volume;
use cetrafs_core::dev::mem::MemDevice;
use cetrafs_core::dev::record::{crash_writes, unflushed_writes, Op, RecordingDevice, Unflushed};
use cetrafs_core::dev::{BlockDevice, CawKind, CawOutcome, Geometry};
use cetrafs_core::format::inode::Inode;
use cetrafs_core::format::superblock::Superblock;
use cetrafs_core::format::{FS_BLOCK, FS_BLOCK_SIZE};
use cetrafs_core::fs::{read_superblock, Caller, Ino, MountOptions, SetAttr, Volume};
use cetrafs_core::journal::{self, JournalArea, ReplayedView};
use cetrafs_core::mkfs::{format, MkfsOptions};
use cetrafs_core::ErrorKind;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const DEV_SIZE: u64 = 64 << 20;
const LBS: u32 = 512;
const C: Caller = Caller::ROOT;
/// Handoffs of X: steps alternate a, b, a, b, ...
const STEPS: usize = 8;
/// Random crash states (subsets of unflushed writes) on top of every point and every flush.
const RANDOM_STATES: usize = 2000;
/// Crash states recovered by real mounts (each waits out the other node's dead time).
const MOUNTED_STATES: usize = 12;
/// The test timings of `fs/multinode_tests.rs` (dead time 1.1 s).
const HEARTBEAT_MS: u32 = 50;
const IO_TIMEOUT_MS: u32 = 100;

fn opts(host: &str) -> MountOptions {
    MountOptions {
        host: host.into(),
        // Commit points only at fsync, handoff and unmount: every step is one transaction.
        commit_interval: Duration::ZERO,
        ..MountOptions::default()
    }
}

fn base_image() -> Vec<u8> {
    let dev = MemDevice::new(DEV_SIZE, LBS);
    let mk = MkfsOptions {
        max_nodes: 2,
        journal_bytes: 1 << 20,
        heartbeat_interval_ms: HEARTBEAT_MS,
        io_timeout_ms: IO_TIMEOUT_MS,
        ..Default::default()
    };
    format(&dev, &mk, &mut |_, _| {}).unwrap();
    dev.snapshot()
}

/// X's size after step `k` (0: the size it was created with).
fn size_of_step(k: usize) -> u64 {
    1000 + 4096 * u64::try_from(k).unwrap()
}

/// One step of the workload, positions in the write log.
#[derive(Debug, Clone, Copy)]
struct Step {
    /// Log length before the step's setattr was issued.
    start: usize,
    /// Log length once its fsync returned.
    done: usize,
}

struct Recorded {
    log: Vec<Op>,
    steps: Vec<Step>,
    x: Ino,
    /// Journal areas of node a's and node b's slots.
    areas: [JournalArea; 2],
    sb: Superblock,
}

fn record(base: &[u8]) -> Recorded {
    let dev = Arc::new(RecordingDevice::new(MemDevice::from_image(
        base.to_vec(),
        LBS,
    )));
    let a = Volume::mount(dev.clone(), &opts("a")).unwrap();
    let b = Volume::mount(dev.clone(), &opts("b")).unwrap();
    let nodes = [&a, &b];
    let root = a.root_ino();
    let (x, fh) = a.create(root, b"x", 0o644, C, true).unwrap();
    a.release(&fh).unwrap();
    a.setattr(
        x.ino,
        &SetAttr {
            size: Some(size_of_step(0)),
            ..Default::default()
        },
        C,
    )
    .unwrap();
    a.fsync(x.ino, false).unwrap();
    let mut steps = vec![Step {
        start: 0,
        done: dev.position(),
    }];
    for k in 1..=STEPS {
        // Step 1 is b's: the first handoff goes a -> b, the next b -> a, and so on.
        let v = nodes[k % 2];
        let start = dev.position();
        let set = SetAttr {
            size: Some(size_of_step(k)),
            ..Default::default()
        };
        v.setattr(x.ino, &set, C).unwrap();
        v.fsync(x.ino, false).unwrap();
        steps.push(Step {
            start,
            done: dev.position(),
        });
        // The other node sees the change (it reloads X under the lock it takes for that).
        let seen = nodes[(k + 1) % 2].getattr(x.ino).unwrap();
        assert_eq!(
            seen.size,
            size_of_step(k),
            "step {k} not seen by the other node"
        );
    }
    let sb = read_superblock(&*dev).unwrap();
    let areas = [
        JournalArea::for_slot(&sb, a.slot()),
        JournalArea::for_slot(&sb, b.slot()),
    ];
    a.unmount().unwrap();
    b.unmount().unwrap();
    Recorded {
        log: dev.log(),
        steps,
        x: x.ino,
        areas,
        sb,
    }
}

/// The last transaction written to `area` before log position `at` (a journal write at the
/// area's first block that is not the one-block invalidation).
fn last_tx_write(log: &[Op], area: JournalArea, at: usize) -> Option<(u64, &[u8])> {
    let off = (area.start + 1) * FS_BLOCK;
    log[..at].iter().rev().find_map(|op| match op {
        Op::Write { offset, data } if *offset == off && data.len() > FS_BLOCK_SIZE => {
            Some((*offset, data.as_slice()))
        }
        _ => None,
    })
}

/// Which journals to resurrect in a crash image.
#[derive(Debug, Clone, Copy)]
enum Resurrect {
    None,
    A,
    B,
    Both,
}

impl Resurrect {
    const ALL: [Self; 4] = [Self::None, Self::A, Self::B, Self::Both];
    fn nodes(self) -> &'static [usize] {
        match self {
            Self::None => &[],
            Self::A => &[0],
            Self::B => &[1],
            Self::Both => &[0, 1],
        }
    }
}

/// A crash state without copying the whole device: the base image plus the sectors the
/// crash state (and later replay) wrote, kept in a map.
#[derive(Debug)]
struct Overlay<'a> {
    base: &'a [u8],
    sectors: Mutex<HashMap<u64, Vec<u8>>>,
    geo: Geometry,
}

impl<'a> Overlay<'a> {
    fn new(base: &'a [u8]) -> Self {
        Self {
            base,
            sectors: Mutex::new(HashMap::new()),
            geo: Geometry {
                logical_block_size: LBS,
                physical_block_size: LBS,
                size_bytes: u64::try_from(base.len()).unwrap(),
                identity: "crash-overlay".into(),
                caw: CawKind::InProcess,
            },
        }
    }

    fn crash_state(base: &'a [u8], log: &[Op], at: usize, unflushed: &Unflushed) -> Self {
        let o = Self::new(base);
        for (offset, data) in crash_writes(log, at, unflushed) {
            o.write_at(offset, data).unwrap();
        }
        o
    }

    fn sector(&self, s: u64) -> Vec<u8> {
        if let Some(v) = self.sectors.lock().unwrap().get(&s) {
            return v.clone();
        }
        let o = usize::try_from(s * u64::from(LBS)).unwrap();
        self.base[o..o + LBS as usize].to_vec()
    }

    fn image(&self) -> Vec<u8> {
        let mut img = self.base.to_vec();
        for (s, v) in self.sectors.lock().unwrap().iter() {
            let o = usize::try_from(s * u64::from(LBS)).unwrap();
            img[o..o + v.len()].copy_from_slice(v);
        }
        img
    }

    fn fork(&self) -> Self {
        let o = Self::new(self.base);
        o.sectors
            .lock()
            .unwrap()
            .clone_from(&self.sectors.lock().unwrap());
        o
    }
}

impl BlockDevice for Overlay<'_> {
    fn geometry(&self) -> &Geometry {
        &self.geo
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> cetrafs_core::Result<()> {
        let first = offset / u64::from(LBS);
        for (i, ch) in buf.chunks_mut(LBS as usize).enumerate() {
            ch.copy_from_slice(&self.sector(first + i as u64)[..ch.len()]);
        }
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> cetrafs_core::Result<()> {
        let first = offset / u64::from(LBS);
        let mut m = self.sectors.lock().unwrap();
        for (i, ch) in buf.chunks(LBS as usize).enumerate() {
            m.insert(first + i as u64, ch.to_vec());
        }
        Ok(())
    }
    fn compare_and_write(&self, _: u64, _: &[u8], _: &[u8]) -> cetrafs_core::Result<CawOutcome> {
        unreachable!("replay does not compare-and-write")
    }
    fn flush(&self) -> cetrafs_core::Result<()> {
        Ok(())
    }
    fn discard(&self, _: u64, _: u64) -> cetrafs_core::Result<()> {
        Ok(())
    }
    fn refresh_size(&self) -> cetrafs_core::Result<u64> {
        Ok(self.geo.size_bytes)
    }
}

fn resurrect(img: &dyn BlockDevice, r: &Recorded, at: usize, which: Resurrect) -> bool {
    let mut any = false;
    for &n in which.nodes() {
        if let Some((off, data)) = last_tx_write(&r.log, r.areas[n], at) {
            img.write_at(off, data).unwrap();
            any = true;
        }
    }
    any
}

fn size_on(dev: &dyn BlockDevice, x: Ino) -> Result<u64, String> {
    let mut buf = vec![0u8; FS_BLOCK_SIZE];
    dev.read_at(x * FS_BLOCK, &mut buf)
        .map_err(|e| format!("read inode {x}: {e}"))?;
    Inode::decode(&buf, x)
        .map(|i| i.size)
        .map_err(|e| format!("inode {x} does not decode: {e}"))
}

/// The steps X may show after a crash at `at` whose last flush is at `durable_at`:
/// from the newest step durable by then to the newest step started before `at`.
fn allowed(r: &Recorded, at: usize, durable_at: usize) -> (usize, usize) {
    let lo = r
        .steps
        .iter()
        .rposition(|s| s.done <= durable_at)
        .unwrap_or(0);
    let hi = r.steps.iter().rposition(|s| s.start < at).unwrap_or(0);
    (lo, hi)
}

fn step_of(size: u64) -> Option<usize> {
    (0..=STEPS).find(|&k| size_of_step(k) == size)
}

fn judge(size: u64, (lo, hi): (usize, usize), what: &str) -> Result<(), String> {
    match step_of(size) {
        Some(k) if (lo..=hi).contains(&k) => Ok(()),
        Some(k) if k < lo => Err(format!(
            "{what}: X rolled back to step {k} (size {size}); step {lo} was durable"
        )),
        k => Err(format!(
            "{what}: X has size {size} (step {k:?}); allowed steps {lo}..={hi}"
        )),
    }
}

/// Replay the journals of `order` with `journal::replay` on a copy of `img`; X's size.
fn replay_in_order(img: &Overlay<'_>, r: &Recorded, order: [usize; 2]) -> Result<u64, String> {
    let dev = img.fork();
    for n in order {
        journal::replay(&dev, &r.sb, r.areas[n])
            .map_err(|e| format!("replay of node {n}'s journal failed: {e}"))?;
    }
    size_on(&dev, r.x)
}

/// Every cheap check of one crash image (no mount).
fn check_image(img: &Overlay<'_>, r: &Recorded, bounds: (usize, usize), what: &str) -> Vec<String> {
    let mut errs = Vec::new();
    let ab = replay_in_order(img, r, [0, 1]);
    let ba = replay_in_order(img, r, [1, 0]);
    match (&ab, &ba) {
        (Ok(x), Ok(y)) => {
            if let Err(e) = judge(*x, bounds, &format!("{what}, replay a then b")) {
                errs.push(e);
            }
            if x != y {
                errs.push(format!(
                    "{what}: replay order matters: a then b gives size {x}, b then a {y}"
                ));
            }
        }
        _ => errs.push(format!("{what}: {ab:?} / {ba:?}")),
    }
    let view = journal::pending(img, &r.sb)
        .map_err(|e| e.to_string())
        .and_then(|txs| ReplayedView::new(img, &txs).map_err(|e| e.to_string()))
        .and_then(|v| size_on(&v, r.x));
    match view {
        Ok(s) => {
            if let Err(e) = judge(s, bounds, &format!("{what}, fsck's replayed view")) {
                errs.push(e);
            }
        }
        Err(e) => errs.push(format!("{what}: replayed view: {e}")),
    }
    errs
}

/// Why a recovery by mounting failed: `fenced` if the mounted node fenced itself (its
/// heartbeat thread starved past the 800 ms fail time on a loaded machine: by design, and
/// not what this test is about), so the state may be retried.
struct MountFailure {
    fenced: bool,
    msg: String,
}

/// Recover a crash image by mounting it as `host` (its own journal first, then the other
/// node's by recovering it after its dead time); X's size, then unmount and fsck.
fn mount_and_check(img: Vec<u8>, r: &Recorded, host: &str) -> Result<u64, MountFailure> {
    let fail = |what: &str, e: &cetrafs_core::Error| MountFailure {
        fenced: e.kind() == ErrorKind::Fenced || e.to_string().contains("fenced"),
        msg: format!("{what}: {e}"),
    };
    let dev = Arc::new(MemDevice::from_image(img, LBS));
    let v = Volume::mount(dev.clone(), &opts(host))
        .map_err(|e| fail(&format!("mount as {host}"), &e))?;
    let size = v
        .getattr(r.x)
        .map_err(|e| fail(&format!("getattr X after mount as {host}"), &e))?
        .size;
    v.unmount().map_err(|e| fail("unmount", &e))?;
    let report = check_volume(&*dev).map_err(|e| fail("fsck could not run", &e))?;
    if !report.is_clean() {
        let f: Vec<String> = report.errors().map(|f| f.message.clone()).collect();
        return Err(MountFailure {
            fenced: false,
            msg: format!("fsck after mount as {host}: {}", f.join("; ")),
        });
    }
    Ok(size)
}

fn last_flush(log: &[Op], at: usize) -> usize {
    log[..at]
        .iter()
        .rposition(|o| matches!(o, Op::Flush))
        .map_or(0, |i| i + 1)
}

#[test]
fn replaying_a_journal_never_rolls_back_a_later_handoff() {
    let t0 = Instant::now();
    let base = base_image();
    let r = record(&base);
    let log = &r.log;
    let seed: u64 = std::env::var("CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x4a0d_0ff5);
    let mut rng = StdRng::seed_from_u64(seed);
    // (at, unflushed, durable_at)
    let mut plan: Vec<(usize, Unflushed, usize)> = Vec::new();
    let from = r.steps[0].done;
    for at in from..=log.len() {
        // Everything issued persisted.
        let n = unflushed_writes(log, at);
        plan.push((
            at,
            Unflushed {
                persisted: vec![true; n],
                torn: None,
            },
            last_flush(log, at),
        ));
        // Only what was flushed persisted.
        if matches!(log[at - 1], Op::Flush) || n > 0 {
            plan.push((
                at,
                Unflushed {
                    persisted: vec![false; n],
                    torn: None,
                },
                last_flush(log, at),
            ));
        }
    }
    for _ in 0..RANDOM_STATES {
        let at = rng.gen_range(from..=log.len());
        let n = unflushed_writes(log, at);
        let persisted: Vec<bool> = (0..n).map(|_| rng.gen_bool(0.5)).collect();
        let torn = (n > 0 && rng.gen_bool(0.3)).then(|| (rng.gen_range(0..n), 512));
        plan.push((at, Unflushed { persisted, torn }, last_flush(log, at)));
    }
    let journal_writes = [0, 1].map(|n| {
        log.iter()
            .filter(|op| {
                matches!(op, Op::Write { offset, data }
                    if *offset == (r.areas[n].start + 1) * FS_BLOCK && data.len() > FS_BLOCK_SIZE)
            })
            .count()
    });
    assert!(
        journal_writes.iter().all(|&w| w >= STEPS / 2),
        "each node should have committed its steps to its own journal: {journal_writes:?}"
    );

    let threads = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
    let (failures, resurrected): (Vec<String>, usize) = std::thread::scope(|s| {
        let hs: Vec<_> = plan
            .chunks(plan.len().div_ceil(threads))
            .map(|chunk| {
                let (base, r) = (&base, &r);
                s.spawn(move || {
                    let mut f = Vec::new();
                    let mut res = 0;
                    for (at, unflushed, durable_at) in chunk {
                        let bounds = allowed(r, *at, *durable_at);
                        let img = Overlay::crash_state(base, &r.log, *at, unflushed);
                        for which in Resurrect::ALL {
                            let im = img.fork();
                            if !resurrect(&im, r, *at, which) && !which.nodes().is_empty() {
                                continue;
                            }
                            res += usize::from(!which.nodes().is_empty());
                            let what = format!(
                                "cut at {at}/{} (torn {:?}, {} unflushed persisted), \
                                 resurrected {which:?}",
                                r.log.len(),
                                unflushed.torn,
                                unflushed.persisted.iter().filter(|p| **p).count()
                            );
                            f.extend(check_image(&im, r, bounds, &what));
                        }
                    }
                    (f, res)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .fold((Vec::new(), 0), |(mut f, n), (g, m)| {
                f.extend(g);
                (f, n + m)
            })
    });
    eprintln!(
        "crash_handoff: {} log ops, {STEPS} handoffs of X, {} crash states x 4 journal \
         resurrections ({resurrected} with a journal resurrected), {} failures, {:.1}s",
        log.len(),
        plan.len(),
        failures.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} failures, first: {:#?}",
        failures.len(),
        &failures[..failures.len().min(8)]
    );

    // Real recoveries: at the end of each step from the first handoff on (a flush point, X's
    // newest change durable), plus a few cut points inside the steps; both journals
    // resurrected; alternately mounted as b (replays b, then recovers a) and as a.
    let mut points: Vec<usize> = r.steps[1..].iter().map(|s| s.done).collect();
    while points.len() < MOUNTED_STATES {
        let k = rng.gen_range(1..r.steps.len());
        points.push(rng.gen_range(r.steps[k].start + 1..=r.steps[k].done));
    }
    let t1 = Instant::now();
    let mounted: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = points
            .iter()
            .enumerate()
            .collect::<Vec<_>>()
            .chunks(points.len().div_ceil(threads))
            .map(|chunk| {
                let chunk = chunk.to_vec();
                let (base, r) = (&base, &r);
                s.spawn(move || {
                    let mut f = Vec::new();
                    for (i, &at) in chunk {
                        let n = unflushed_writes(&r.log, at);
                        let un = Unflushed {
                            persisted: vec![true; n],
                            torn: None,
                        };
                        let img = Overlay::crash_state(base, &r.log, at, &un);
                        resurrect(&img, r, at, Resurrect::Both);
                        let img = img.image();
                        let bounds = allowed(r, at, last_flush(&r.log, at));
                        let host = if i % 2 == 0 { "b" } else { "a" };
                        let what = format!("cut at {at}, both journals, mounted as {host}");
                        for attempt in 1..=3 {
                            match mount_and_check(img.clone(), r, host) {
                                Ok(size) => f.extend(judge(size, bounds, &what).err()),
                                Err(e) if e.fenced && attempt < 3 => {
                                    eprintln!("crash_handoff: {what}: {}; retrying", e.msg);
                                    continue;
                                }
                                Err(e) => f.push(format!("{what}: {}", e.msg)),
                            }
                            break;
                        }
                    }
                    f
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    eprintln!(
        "crash_handoff: {} crash states recovered by mounting (as a and as b), {} failures, {:.1}s",
        points.len(),
        mounted.len(),
        t1.elapsed().as_secs_f64()
    );
    assert!(mounted.is_empty(), "{mounted:#?}");
}
