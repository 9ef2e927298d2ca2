//! Crash consistency, proven by replaying recorded block-level write logs (CrashMonkey /
//! dm-log-writes style): a mixed workload runs on a recording device; then the device is
//! rebuilt as it could be after a power cut at every flush and at random points between
//! flushes (any subset of the unflushed writes persisted, one possibly torn at a sector
//! boundary). Every crash state must mount (replaying the journal), check clean with fsck,
//! keep every fsync'd byte, and never expose stale data: free space is pre-filled with a
//! marker, and every file byte must be zero or the writer's own pattern for that offset.

use cetrafs_core::check::check_volume;
use cetrafs_core::dev::mem::MemDevice;
use cetrafs_core::dev::record::{crash_image, unflushed_writes, Op, RecordingDevice, Unflushed};
use cetrafs_core::fs::{
    Caller, FallocMode, FileKind, Ino, MountOptions, OpenFile, RenameFlags, SetAttr, Volume,
};
use cetrafs_core::mkfs::{format, MkfsOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const DEV_SIZE: u64 = 96 << 20;
const LBS: u32 = 512;
const C: Caller = Caller::ROOT;
const IMG_BLOCKS: u64 = 2048;

fn opts() -> MountOptions {
    MountOptions {
        commit_interval: Duration::ZERO,
        ..MountOptions::default()
    }
}

/// The byte a writer puts at `offset` of inode `ino`: recognisable and position-dependent.
fn pattern_byte(ino: Ino, offset: u64) -> u8 {
    let w = 0xC0DE_0000_0000_0000u64 | ((ino & 0xFF_FFFF) << 24) | ((offset / 8) & 0xFF_FFFF);
    w.to_le_bytes()[(offset % 8) as usize]
}

fn pattern(ino: Ino, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| pattern_byte(ino, offset + i))
        .collect()
}

fn base_image() -> Vec<u8> {
    // Free space holds a marker, so any exposure of never-written blocks is visible.
    let marker = b"STALE!!\x01";
    let img: Vec<u8> = marker
        .iter()
        .copied()
        .cycle()
        .take(usize::try_from(DEV_SIZE).unwrap())
        .collect();
    let dev = MemDevice::from_image(img, LBS);
    let mk = MkfsOptions {
        max_nodes: 2,
        journal_bytes: 2 << 20,
        ..Default::default()
    };
    format(&dev, &mk, &mut |_, _| {}).unwrap();
    dev.snapshot()
}

#[derive(Debug, Clone)]
struct Durable {
    name: String,
    ino: Ino,
    size: u64,
    at: usize,
}

struct Workload {
    durable: Vec<Durable>,
    /// Image blocks made durable by an fsync at log position.
    img_durable: Vec<(u64, usize)>,
    img_ino: Ino,
    /// Log position from which the image's creation is durable.
    img_at: usize,
}

fn run_workload(vol: &Arc<Volume>, dev: &RecordingDevice<MemDevice>, seed: u64) -> Workload {
    let mut rng = StdRng::seed_from_u64(seed);
    let root = vol.root_ino();
    let (img, img_fh) = vol.create(root, b"img", 0o600, C, true).unwrap();
    vol.fallocate(
        img.ino,
        0,
        IMG_BLOCKS * 4096,
        FallocMode::Allocate { keep_size: false },
    )
    .unwrap();
    vol.fsync(img.ino, false).unwrap();
    let mut w = Workload {
        durable: Vec::new(),
        img_durable: Vec::new(),
        img_ino: img.ino,
        img_at: dev.position(),
    };
    let mut img_pending: Vec<u64> = Vec::new();
    // Scratch namespace model: directory inode -> names.
    let mut dirs: Vec<Ino> = vec![root];
    let mut files: Vec<(Ino, String)> = Vec::new();
    let mut n = 0u32;
    for step in 0..500 {
        n += 1;
        let d = dirs[rng.gen_range(0..dirs.len())];
        match rng.gen_range(0..20) {
            0 | 1 => {
                // A durable file: write, fsync, never touch again.
                let name = format!("durable-{n}");
                let (a, fh) = vol.create(root, name.as_bytes(), 0o644, C, true).unwrap();
                let size = rng.gen_range(0..300_000u64);
                let mut off = 0;
                while off < size {
                    let len = rng.gen_range(1..70_000u64).min(size - off);
                    vol.write(
                        &fh,
                        off,
                        &pattern(a.ino, off, usize::try_from(len).unwrap()),
                    )
                    .unwrap();
                    off += len;
                }
                vol.fsync(a.ino, false).unwrap();
                vol.release(&fh).unwrap();
                w.durable.push(Durable {
                    name,
                    ino: a.ino,
                    size,
                    at: dev.position(),
                });
            }
            2 | 3 => {
                let name = format!("f{n}");
                if let Ok((a, fh)) = vol.create(d, name.as_bytes(), 0o644, C, true) {
                    let off = rng.gen_range(0..100_000u64);
                    let len = rng.gen_range(1..50_000usize);
                    vol.write(&fh, off, &pattern(a.ino, off, len)).unwrap();
                    vol.release(&fh).unwrap();
                    files.push((d, name));
                }
            }
            4 => {
                let name = format!("d{n}");
                if let Ok(a) = vol.mkdir(d, name.as_bytes(), 0o755, C) {
                    dirs.push(a.ino);
                }
            }
            5 if !files.is_empty() => {
                let (pd, name) = files.swap_remove(rng.gen_range(0..files.len()));
                let _ = vol.unlink(pd, name.as_bytes());
            }
            6 if !files.is_empty() => {
                let i = rng.gen_range(0..files.len());
                let new = format!("r{n}");
                if vol
                    .rename(
                        files[i].0,
                        files[i].1.as_bytes(),
                        d,
                        new.as_bytes(),
                        RenameFlags::default(),
                    )
                    .is_ok()
                {
                    files[i] = (d, new);
                }
            }
            7 if !files.is_empty() => {
                let (pd, name) = files[rng.gen_range(0..files.len())].clone();
                if let Ok(a) = vol.lookup(pd, name.as_bytes()) {
                    let new = format!("l{n}");
                    if vol.link(a.ino, d, new.as_bytes()).is_ok() {
                        files.push((d, new));
                    }
                }
            }
            8 => {
                // Every other one longer than the inode's inline area (an overflow block).
                let target = if n.is_multiple_of(2) {
                    b"some/target".to_vec()
                } else {
                    pattern(d, u64::from(n), 3841 + (n as usize % 255))
                        .iter()
                        .map(|b| b'a' + b % 26)
                        .collect()
                };
                let _ = vol.symlink(d, format!("s{n}").as_bytes(), &target, C);
            }
            9 | 10 if !files.is_empty() => {
                let (pd, name) = files[rng.gen_range(0..files.len())].clone();
                if let Ok(a) = vol.lookup(pd, name.as_bytes()) {
                    let off = rng.gen_range(0..200_000u64);
                    let len = rng.gen_range(1..40_000u64);
                    let r = match rng.gen_range(0..5) {
                        0 => vol
                            .setattr(
                                a.ino,
                                &SetAttr {
                                    size: Some(off),
                                    ..Default::default()
                                },
                                C,
                            )
                            .map(|_| ()),
                        1 => vol.fallocate(
                            a.ino,
                            off,
                            len,
                            FallocMode::Allocate {
                                keep_size: rng.gen(),
                            },
                        ),
                        2 => vol.fallocate(a.ino, off, len, FallocMode::PunchHole),
                        3 => vol.fallocate(
                            a.ino,
                            off,
                            len,
                            FallocMode::ZeroRange { keep_size: true },
                        ),
                        _ => vol.open(a.ino, true, false).and_then(|fh| {
                            vol.write(
                                &fh,
                                off,
                                &pattern(a.ino, off, usize::try_from(len).unwrap()),
                            )?;
                            vol.release(&fh)
                        }),
                    };
                    r.unwrap();
                }
            }
            11 if dirs.len() > 1 => {
                let i = rng.gen_range(1..dirs.len());
                // Only empty directories go; find its parent by scanning (small trees).
                for &p in &dirs.clone() {
                    let _ = vol.readdir(p, 0, &mut |e| {
                        if e.ino == dirs[i] && e.kind == FileKind::Directory {
                            let _ = vol.rmdir(p, &e.name);
                        }
                        true
                    });
                }
                if vol.getattr(dirs[i]).is_err() {
                    dirs.swap_remove(i);
                }
            }
            12 => {
                let _ = vol.setxattr(
                    d,
                    format!("user.k{}", n % 7).as_bytes(),
                    // Mostly small; sometimes a value that makes the set span blocks.
                    &pattern(
                        d,
                        0,
                        if n.is_multiple_of(3) {
                            rng.gen_range(4000..20_000)
                        } else {
                            rng.gen_range(0..300)
                        },
                    ),
                    false,
                    false,
                );
            }
            13..=16 => {
                // O_DIRECT-style 4 KiB writes into the preallocated image.
                let b = rng.gen_range(0..IMG_BLOCKS);
                vol.write(&img_fh, b * 4096, &pattern(img.ino, b * 4096, 4096))
                    .unwrap();
                img_pending.push(b);
            }
            17 => {
                vol.fsync(img.ino, true).unwrap();
                let at = dev.position();
                w.img_durable.extend(img_pending.drain(..).map(|b| (b, at)));
            }
            18 if step % 3 == 0 => vol.sync().unwrap(),
            _ => {}
        }
    }
    vol.release(&img_fh).unwrap();
    w
}

fn check_file_bytes(ino: Ino, off: u64, data: &[u8], what: &str) -> Result<(), String> {
    for (i, &b) in data.iter().enumerate() {
        let o = off + i as u64;
        if b != 0 && b != pattern_byte(ino, o) {
            return Err(format!(
                "{what}: inode {ino} byte {o} = {b:#x}: stale or foreign data"
            ));
        }
    }
    Ok(())
}

fn read(vol: &Volume, fh: &OpenFile, off: u64, len: u32) -> Vec<u8> {
    let mut v = Vec::new();
    vol.read(fh, off, len, &mut |d| v.extend_from_slice(d))
        .unwrap();
    v
}

/// Mount a crash image and verify everything; returns a description of the first violation.
fn verify_state(img: Vec<u8>, w: &Workload, at: usize) -> Result<(), String> {
    let dev = Arc::new(MemDevice::from_image(img, LBS));
    let vol = Volume::mount(dev.clone(), &opts()).map_err(|e| format!("mount failed: {e}"))?;
    // Every file: only zeros or its own pattern.
    let mut stack = vec![vol.root_ino()];
    while let Some(d) = stack.pop() {
        // Its xattrs (the workload sets them on directories): readable, each its own pattern.
        for name in vol
            .listxattr(d)
            .map_err(|e| format!("listxattr {d}: {e}"))?
        {
            let v = vol
                .getxattr(d, &name)
                .map_err(|e| format!("getxattr {d}: {e}"))?;
            if v != pattern(d, 0, v.len()) {
                return Err(format!(
                    "xattr {:?} of {d} is not its own",
                    String::from_utf8_lossy(&name)
                ));
            }
        }
        let mut entries = Vec::new();
        vol.readdir(d, 0, &mut |e| {
            entries.push(e.clone());
            true
        })
        .map_err(|e| format!("readdir {d}: {e}"))?;
        for e in entries.iter().filter(|e| e.name != b"." && e.name != b"..") {
            match e.kind {
                FileKind::Directory => stack.push(e.ino),
                FileKind::Regular => {
                    let a = vol.getattr(e.ino).map_err(|x| format!("getattr: {x}"))?;
                    let fh = vol
                        .open(e.ino, false, false)
                        .map_err(|x| format!("open: {x}"))?;
                    let mut off = 0;
                    while off < a.size {
                        let data = read(&vol, &fh, off, 1 << 20);
                        check_file_bytes(e.ino, off, &data, &String::from_utf8_lossy(&e.name))?;
                        off += data.len() as u64;
                        if data.is_empty() {
                            return Err(format!("short read at {off} of {}", a.size));
                        }
                    }
                    vol.release(&fh).map_err(|x| x.to_string())?;
                }
                FileKind::Symlink => {
                    let t = vol.readlink(e.ino).map_err(|x| format!("readlink: {x}"))?;
                    let a = vol.getattr(e.ino).map_err(|x| format!("getattr: {x}"))?;
                    if t.is_empty() || a.size != t.len() as u64 {
                        return Err(format!(
                            "symlink {}: {} bytes, size {}",
                            e.ino,
                            t.len(),
                            a.size
                        ));
                    }
                }
                _ => {}
            }
        }
    }
    // fsync'd files.
    for d in w.durable.iter().filter(|d| d.at <= at) {
        let a = vol
            .lookup(vol.root_ino(), d.name.as_bytes())
            .map_err(|e| format!("fsync'd {} lost: {e}", d.name))?;
        if a.ino != d.ino || a.size != d.size {
            return Err(format!(
                "fsync'd {}: size {} (want {})",
                d.name, a.size, d.size
            ));
        }
        let fh = vol.open(a.ino, false, false).map_err(|e| e.to_string())?;
        let mut off = 0;
        while off < d.size {
            let data = read(&vol, &fh, off, 1 << 20);
            if data != pattern(d.ino, off, data.len()) {
                return Err(format!(
                    "fsync'd {}: content differs near byte {off}",
                    d.name
                ));
            }
            off += data.len() as u64;
        }
        vol.release(&fh).map_err(|e| e.to_string())?;
    }
    // fsync'd image blocks.
    if w.img_at <= at {
        let fh = vol
            .open(w.img_ino, false, false)
            .map_err(|e| format!("image lost: {e}"))?;
        for &(b, when) in &w.img_durable {
            if when <= at && read(&vol, &fh, b * 4096, 4096) != pattern(w.img_ino, b * 4096, 4096) {
                return Err(format!("fsync'd image block {b} lost"));
            }
        }
        vol.release(&fh).map_err(|e| e.to_string())?;
    }
    vol.unmount().map_err(|e| format!("unmount: {e}"))?;
    let report = check_volume(&*dev).map_err(|e| format!("fsck could not run: {e}"))?;
    if !report.is_clean() {
        let f: Vec<String> = report.errors().map(|f| f.message.clone()).collect();
        return Err(format!("fsck: {}", f.join("; ")));
    }
    Ok(())
}

#[test]
fn crash_states_are_consistent_and_keep_fsynced_data() {
    let states: usize = std::env::var("CRASH_STATES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1200);
    let seed: u64 = std::env::var("CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    let base = base_image();
    let dev = Arc::new(RecordingDevice::new(MemDevice::from_image(
        base.clone(),
        LBS,
    )));
    let vol = Volume::mount(dev.clone(), &opts()).unwrap();
    let w = run_workload(&vol, &dev, seed);
    vol.unmount().unwrap();
    let log = dev.log();
    let flushes: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, o)| matches!(o, Op::Flush))
        .map(|(i, _)| i + 1)
        .collect();
    assert!(
        w.durable.len() > 10 && w.img_durable.len() > 10,
        "workload too small to prove anything"
    );
    let mut rng = StdRng::seed_from_u64(seed ^ 0x00ab_cdef);
    // (a) every flush point, everything before it persisted;
    // (b) random points between flushes, random subsets, sometimes a torn write.
    let mut plan: Vec<(usize, Unflushed, usize)> = flushes
        .iter()
        .map(|&at| {
            (
                at,
                Unflushed {
                    persisted: vec![],
                    torn: None,
                },
                at,
            )
        })
        .collect();
    while plan.len() < states {
        let at = rng.gen_range(1..=log.len());
        let n = unflushed_writes(&log, at);
        let persisted: Vec<bool> = (0..n).map(|_| rng.gen_bool(0.5)).collect();
        let torn = if n > 0 && rng.gen_bool(0.3) {
            let i = rng.gen_range(0..n);
            let len = log[..at]
                .iter()
                .filter_map(|o| {
                    if let Op::Write { data, .. } = o {
                        Some(data.len())
                    } else {
                        None
                    }
                })
                .rev()
                .nth(n - 1 - i)
                .unwrap_or(512);
            Some((i, rng.gen_range(1..(len / 512).max(2)) * 512))
        } else {
            None
        };
        // A crash state only vouches for fsyncs that completed before its last flush.
        let durable_at = log[..at]
            .iter()
            .rposition(|o| matches!(o, Op::Flush))
            .map_or(0, |i| i + 1);
        plan.push((at, Unflushed { persisted, torn }, durable_at));
    }
    let tested = plan.len();
    let threads = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = plan
            .chunks(tested.div_ceil(threads))
            .map(|chunk| {
                let (base, log, w) = (&base, &log, &w);
                s.spawn(move || {
                    let mut f = Vec::new();
                    for (at, unflushed, durable_at) in chunk {
                        let img = crash_image(base, log, *at, unflushed);
                        if let Err(e) = verify_state(img, w, *durable_at) {
                            f.push(format!("point {at} (torn {:?}): {e}", unflushed.torn));
                        }
                    }
                    f
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    eprintln!(
        "crash harness: seed {seed}, {} log ops, {} flushes, {tested} crash states, {} durable files, {} durable image blocks, {} failures",
        log.len(),
        flushes.len(),
        w.durable.len(),
        w.img_durable.len(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} inconsistent crash states, first: {:#?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
}

/// A crash while replaying the journal, then replaying again, converges to the same volume.
#[test]
fn crash_during_replay_converges() {
    let base = base_image();
    let dev = Arc::new(RecordingDevice::new(MemDevice::from_image(
        base.clone(),
        LBS,
    )));
    let vol = Volume::mount(dev.clone(), &opts()).unwrap();
    let w = run_workload(&vol, &dev, 7);
    vol.unmount().unwrap();
    let log = dev.log();
    // Crash points right after a journal commit (the flush after the journal write), before
    // the home writes are flushed: replay has real work to do.
    let mut tried = 0;
    for (i, _) in log
        .iter()
        .enumerate()
        .filter(|(_, o)| matches!(o, Op::Flush))
        .skip(1)
        .step_by(3)
    {
        let at = i + 1;
        let img = crash_image(
            &base,
            &log,
            at,
            &Unflushed {
                persisted: vec![],
                torn: None,
            },
        );
        let clean = {
            let d = Arc::new(MemDevice::from_image(img.clone(), LBS));
            let v = Volume::mount(d.clone(), &opts()).unwrap();
            v.unmount().unwrap();
            d.snapshot()
        };
        for cut_after in [1u64, 2, 5] {
            let d = Arc::new(MemDevice::from_image(img.clone(), LBS));
            d.faults
                .fail_write_countdown
                .store(cut_after, std::sync::atomic::Ordering::Relaxed);
            if Volume::mount(d.clone(), &opts()).is_ok() {
                continue; // nothing (or too little) to replay at this point
            }
            tried += 1;
            let half = d.snapshot();
            verify_state(half, &w, at).unwrap_or_else(|e| {
                panic!("after a crash inside replay at {at} (cut after {cut_after}): {e}")
            });
            // And the converged volume's metadata equals a clean replay's, file by file.
            let d2 = Arc::new(MemDevice::from_image(d.snapshot(), LBS));
            let v2 = Volume::mount(d2.clone(), &opts()).unwrap();
            let v1 = Volume::mount(Arc::new(MemDevice::from_image(clean.clone(), LBS)), &opts())
                .unwrap();
            let list = |v: &Volume| {
                let mut m = BTreeMap::new();
                v.readdir(v.root_ino(), 0, &mut |e| {
                    m.insert(
                        e.name.clone(),
                        v.getattr(e.ino).map_or(u64::MAX, |a| a.size),
                    );
                    true
                })
                .unwrap();
                m
            };
            assert_eq!(
                list(&v1),
                list(&v2),
                "replay after a crash in replay diverged at {at}"
            );
        }
    }
    assert!(tried >= 5, "only {tried} interrupted replays exercised");
}
