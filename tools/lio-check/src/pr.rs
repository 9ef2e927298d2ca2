//! `pr`: SCSI-3 persistent reservations on one LUN through three nexuses (three `tcm_loop`
//! initiators, nexus A/B/C = `--paths` in order), with the `SgDevice` PR primitives
//! (`cetrafs_core::scsi::pr`). The fencing sequence issue 10 builds on:
//!
//! 1. REPORT CAPABILITIES (logged) must list Write Exclusive – Registrants Only (type 5);
//! 2. each nexus registers its own key (REGISTER AND IGNORE EXISTING KEY); READ KEYS lists 3;
//! 3. A reserves WE-RO; READ RESERVATION through C shows A's key and type 5;
//! 4. registered B writes a block: GOOD, and A reads B's image back;
//! 5. C unregisters: its WRITE fails with RESERVATION CONFLICT (`scsi::reservation_conflict`),
//!    an `O_DIRECT` pwrite through C's sd node fails too (the errno is logged: the block layer's
//!    view of the same status), C can still READ, the block still holds B's image;
//! 6. C registers again and writes; A PREEMPTs B's key: READ KEYS no longer lists B, B's
//!    WRITE fails with RESERVATION CONFLICT, the block holds C's image, and B cannot preempt
//!    back (unregistered: RESERVATION CONFLICT); READ RESERVATION: A, type 5;
//!    6b. only with `--pr-abort 1`: B registers a new key and writes, A does PREEMPT AND ABORT
//!    of it, B's key is gone and its next WRITE conflicts. Off by default: Debian's LIO (6.1
//!    and 6.12) deadlocks there (`tcm_loop` runs the PR OUT in the LUN's submission work, and
//!    `core_tmr_lun_reset` flushes that same work); PREEMPT and PREEMPT AND ABORT run with a
//!    20 s deadline, after which the blocked tasks (sysrq w) are printed and the LUN is left
//!    alone;
//! 7. cleanup, whatever failed before: A registers (ignoring any key) and CLEARs; READ KEYS
//!    and READ RESERVATION are empty and B writes again, so later checks see a free LUN.

use crate::{open, CheckResult, Report};
use cetrafs_core::dev::sg::SgDevice;
use cetrafs_core::dev::{AlignedBuf, BlockDevice};
use cetrafs_core::scsi::pr::{pr_key, PrType};
use cetrafs_core::scsi::{self, reservation_conflict};
use cetrafs_core::ErrorKind;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// LBA the writes of this check go to (outside the conformance and contention blocks).
const PR_LBA: u64 = 5000;
/// Key prefix of this check ("LIOC"), in place of a volume uuid.
const PREFIX: u32 = 0x4C49_4F43;
const WERO: PrType = PrType::WriteExclusiveRegistrantsOnly;
const TAG: &str = "pr";

struct Nexus {
    name: &'static str,
    dev: SgDevice,
    key: u64,
}

fn image(lbs: usize, who: u8) -> AlignedBuf {
    let mut b = AlignedBuf::new(lbs);
    for (i, x) in b.iter_mut().enumerate() {
        // `i % 251` < 251, so the cast never truncates
        #[allow(clippy::cast_possible_truncation)]
        let low = (i % 251) as u8;
        *x = who ^ low;
    }
    b
}

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// The sd node behind an sg node (`/sys/class/scsi_generic/sgN/device/block/sdX`).
fn sd_of(sg: &str) -> Option<PathBuf> {
    let name = std::path::Path::new(sg).file_name()?.to_str()?.to_string();
    let dir = format!("/sys/class/scsi_generic/{name}/device/block");
    let e = std::fs::read_dir(dir).ok()?.flatten().next()?;
    Some(PathBuf::from("/dev").join(e.file_name()))
}

/// How long one PR command may take before the check calls the target hung.
const DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

/// Run `f` on its own thread; `None` if it has not returned after [`DEADLINE`]. Then the
/// kernel's blocked tasks are dumped (sysrq w) and the tail of the kernel log is printed as
/// `OUT pr dmesg:` lines, since a hung target leaves no other trace in the results.
fn with_deadline<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    if let Ok(v) = rx.recv_timeout(DEADLINE) {
        return Some(v);
    }
    let _ = std::fs::write("/proc/sysrq-trigger", "w");
    std::thread::sleep(std::time::Duration::from_secs(2));
    if let Ok(o) = std::process::Command::new("dmesg").output() {
        let text = String::from_utf8_lossy(&o.stdout);
        let lines: Vec<&str> = text.lines().collect();
        for l in &lines[lines.len().saturating_sub(80)..] {
            println!("OUT pr dmesg: {l}");
        }
    }
    None
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

fn keys_of(n: &Nexus) -> Result<(u32, Vec<u64>), String> {
    let k = n.dev.pr_read_keys().map_err(s)?;
    if k.truncated {
        return Err(format!("READ KEYS truncated: {k:?}"));
    }
    Ok((k.generation, sorted(k.keys)))
}

/// A write from `n` that must be refused with RESERVATION CONFLICT.
fn write_conflicts(n: &Nexus, lbs: usize, who: u8) -> CheckResult {
    match n.dev.write_at(PR_LBA * lbs as u64, &image(lbs, who)) {
        Ok(()) => Err(format!("WRITE from nexus {} succeeded", n.name)),
        Err(e)
            if reservation_conflict(&e)
                && e.kind() == ErrorKind::Io
                && !scsi::outcome_unknown(&e) =>
        {
            Ok(format!(
                "errno {} (EIO), reservation_conflict() true: {e}",
                e.errno()
            ))
        }
        Err(e) => Err(format!(
            "wrong error ({:?}, conflict={}): {e}",
            e.kind(),
            reservation_conflict(&e)
        )),
    }
}

fn holds(reader: &Nexus, lbs: usize, who: u8, whose: &str) -> Result<(), String> {
    let mut back = AlignedBuf::new(lbs);
    reader
        .dev
        .read_at(PR_LBA * lbs as u64, &mut back)
        .map_err(s)?;
    if back[..] == image(lbs, who)[..] {
        Ok(())
    } else {
        Err(format!(
            "LBA {PR_LBA} (read through nexus {}) does not hold {whose} image",
            reader.name
        ))
    }
}

/// The whole check; `abort`: also PREEMPT AND ABORT (step 6b), which hangs Debian's LIO
/// (6.1 and 6.12) over `tcm_loop`.
pub fn pr(rep: &mut Report, paths: &[String], abort: bool) {
    let nexuses: Result<Vec<Nexus>, String> = paths
        .iter()
        .zip(["A", "B", "C"])
        .enumerate()
        .map(|(i, (p, name))| {
            let slot = u32::try_from(i).unwrap_or(0);
            Ok(Nexus {
                name,
                dev: open(p)?,
                key: pr_key(PREFIX, slot, 1),
            })
        })
        .collect();
    let nx = match nexuses {
        Ok(v) if v.len() == 3 => v,
        Ok(v) => {
            return rep.check(
                TAG,
                "open 3 nexuses",
                Err(format!("{} paths given", v.len())),
            )
        }
        Err(e) => return rep.check(TAG, "open 3 nexuses", Err(e)),
    };
    let lbs = nx[0].dev.geometry().logical_block_size as usize;
    let sd_c = sd_of(&paths[2]);
    let t = std::time::Instant::now();
    let mut wedged = false;
    let ok = sequence(rep, &nx, lbs, sd_c.as_deref(), abort, &mut wedged);
    if !abort {
        println!("SKIP pr PREEMPT AND ABORT: deadlocks Debian's LIO (6.1 and 6.12) over tcm_loop (tests/lio/README.md); PR_ABORT=1 runs it");
    }
    if wedged {
        // every further command to this LUN would hang the same way
        rep.check(
            TAG,
            "CLEAR (cleanup)",
            Err("skipped: the target hangs".into()),
        );
    } else {
        cleanup(rep, &nx, lbs);
    }
    println!(
        "INFO pr sequence {} in {:.2}s",
        if ok {
            "completed"
        } else {
            "stopped at the first FAIL"
        },
        t.elapsed().as_secs_f64()
    );
}

/// Steps 1-6; stops at the first failing step (later steps depend on it). True if all passed.
fn sequence(
    rep: &mut Report,
    nx: &[Nexus],
    lbs: usize,
    sd_c: Option<&Path>,
    abort: bool,
    wedged: &mut bool,
) -> bool {
    let (a, b, c) = (&nx[0], &nx[1], &nx[2]);
    let mut step = |name: &str, r: CheckResult| {
        let ok = r.is_ok();
        rep.check(TAG, name, r);
        ok
    };
    let all = sorted(nx.iter().map(|n| n.key).collect());

    step(
        "REPORT CAPABILITIES",
        (|| {
            let caps = a.dev.pr_capabilities().map_err(s)?;
            let line = format!("{caps}");
            match caps.supports(WERO) {
                Some(true) => Ok(line),
                _ => Err(format!("{WERO} not reported as supported: {line}")),
            }
        })(),
    ) && step(
        "REGISTER AND IGNORE EXISTING KEY x3",
        (|| {
            for n in nx {
                n.dev
                    .pr_register_and_ignore(n.key, false)
                    .map_err(|e| format!("nexus {}: {e}", n.name))?;
            }
            let (generation, keys) = keys_of(b)?;
            if keys != all {
                return Err(format!("READ KEYS through B: {keys:x?}, expected {all:x?}"));
            }
            Ok(format!(
                "READ KEYS: 3 keys {keys:x?}, PRgeneration {generation}"
            ))
        })(),
    ) && step(
        "RESERVE Write Exclusive - Registrants Only",
        (|| {
            a.dev.pr_reserve(a.key, WERO).map_err(s)?;
            let r = c.dev.pr_read_reservation().map_err(s)?;
            match r.holder {
                Some(h) if h.key == a.key && h.pr_type() == Some(WERO) && h.scope == 0 => {
                    Ok(format!(
                        "A holds it: READ RESERVATION through C: key {:#x}, type {}",
                        h.key, h.type_code
                    ))
                }
                other => Err(format!("READ RESERVATION through C: {other:?}")),
            }
        })(),
    ) && step(
        "registered nexus B writes",
        (|| {
            b.dev
                .write_at(PR_LBA * lbs as u64, &image(lbs, 0xB0))
                .map_err(s)?;
            holds(a, lbs, 0xB0, "B's")?;
            Ok(format!("WRITE(16) at LBA {PR_LBA} GOOD, A reads B's image"))
        })(),
    ) && step(
        "unregistered nexus C: WRITE refused",
        (|| {
            c.dev.pr_register_and_ignore(0, false).map_err(s)?;
            let (_, keys) = keys_of(a)?;
            if keys.contains(&c.key) || keys.len() != 2 {
                return Err(format!("C unregistered but READ KEYS shows {keys:x?}"));
            }
            let r = write_conflicts(c, lbs, 0xC0)?;
            holds(c, lbs, 0xB0, "B's")
                .map_err(|e| format!("{e} (the refused write changed it, or C cannot read)"))?;
            Ok(format!("{r}; C still reads, the block holds B's image"))
        })(),
    ) && step(
        "unregistered nexus C: O_DIRECT pwrite on the sd node refused",
        (|| {
            let sd = sd_c.ok_or("no sd node found for nexus C")?;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(sd)
                .map_err(|e| format!("open {}: {e}", sd.display()))?;
            let r = f.write_at(&image(lbs, 0xC1), PR_LBA * lbs as u64);
            let detail = match r {
                Ok(n) => return Err(format!("pwrite through {} wrote {n} bytes", sd.display())),
                Err(e) => {
                    let errno = e.raw_os_error();
                    let err =
                        cetrafs_core::Error::io(format!("pwrite through {}", sd.display()), e);
                    if !reservation_conflict(&err) {
                        return Err(format!(
                            "{err} (errno {errno:?}): reservation_conflict() false"
                        ));
                    }
                    format!("{err} (errno {errno:?}), reservation_conflict() true")
                }
            };
            holds(a, lbs, 0xB0, "B's")?;
            Ok(format!("{detail}; block unchanged"))
        })(),
    ) && step(
        "re-registered nexus C writes",
        (|| {
            c.dev.pr_register_and_ignore(c.key, false).map_err(s)?;
            c.dev
                .write_at(PR_LBA * lbs as u64, &image(lbs, 0xC2))
                .map_err(s)?;
            holds(a, lbs, 0xC2, "C's")?;
            Ok("REGISTER AND IGNORE EXISTING KEY again, WRITE GOOD".into())
        })(),
    ) && step(
        "PREEMPT of B's key by A",
        (|| {
            preempt(a, b.key, false, wedged)?;
            let (generation, keys) = keys_of(a)?;
            let want = sorted(vec![a.key, c.key]);
            if keys != want {
                return Err(format!(
                    "READ KEYS after the preempt: {keys:x?}, expected {want:x?}"
                ));
            }
            Ok(format!(
                "GOOD; READ KEYS lists {keys:x?} (B gone), PRgeneration {generation}"
            ))
        })(),
    ) && step(
        "preempted nexus B: WRITE refused",
        (|| {
            let r = write_conflicts(b, lbs, 0xB1)?;
            holds(a, lbs, 0xC2, "C's (the survivor's)")?;
            let ua = b
                .dev
                .stats()
                .unit_attention_retries
                .load(std::sync::atomic::Ordering::Relaxed);
            Ok(format!(
                "{r}; block holds C's image; B's unit-attention retries so far {ua}"
            ))
        })(),
    ) && step(
        "preempted nexus B cannot preempt back",
        match b.dev.pr_preempt(b.key, a.key, WERO) {
            Ok(()) => Err("PREEMPT from the preempted nexus succeeded".into()),
            Err(e) if reservation_conflict(&e) => Ok(e.to_string()),
            Err(e) => Err(format!("wrong error ({:?}): {e}", e.kind())),
        },
    ) && step(
        "READ RESERVATION after the preempt",
        (|| {
            let r = b.dev.pr_read_reservation().map_err(s)?;
            match r.holder {
                Some(h) if h.key == a.key && h.pr_type() == Some(WERO) => Ok(format!(
                    "through B: holder key {:#x} (A), type {}, PRgeneration {}",
                    h.key, h.type_code, r.generation
                )),
                other => Err(format!("{other:?}")),
            }
        })(),
    ) && (!abort
        || step(
            "PREEMPT AND ABORT of B's new key by A",
            (|| {
                let key2 = pr_key(PREFIX, 1, 2);
                b.dev.pr_register_and_ignore(key2, false).map_err(s)?;
                b.dev
                    .write_at(PR_LBA * lbs as u64, &image(lbs, 0xB3))
                    .map_err(|e| format!("B re-registered, its WRITE: {e}"))?;
                preempt(a, key2, true, wedged)?;
                let (_, keys) = keys_of(a)?;
                if keys.contains(&key2) || keys.len() != 2 {
                    return Err(format!("READ KEYS after PREEMPT AND ABORT: {keys:x?}"));
                }
                let r = write_conflicts(b, lbs, 0xB4)?;
                holds(a, lbs, 0xB3, "B's last accepted")?;
                Ok(format!("GOOD; B's key gone; B's next WRITE: {r}"))
            })(),
        ))
}

/// A (nexus `by`) preempts `victim` (PREEMPT, or PREEMPT AND ABORT), on its own thread with
/// a deadline: Debian's LIO (6.1 and 6.12) deadlocks in PREEMPT AND ABORT over `tcm_loop` (see
/// tests/lio/README.md), and the blocked tasks are then in the results.
fn preempt(by: &Nexus, victim: u64, abort: bool, wedged: &mut bool) -> Result<(), String> {
    let (path, my) = (by.dev.path().to_path_buf(), by.key);
    let r = with_deadline(move || {
        let d = open(&path.to_string_lossy())?;
        if abort {
            d.pr_preempt_and_abort(my, victim, WERO).map_err(s)
        } else {
            d.pr_preempt(my, victim, WERO).map_err(s)
        }
    });
    if let Some(r) = r {
        r
    } else {
        *wedged = true;
        Err(format!(
            "no completion within {DEADLINE:?}: the target hangs (blocked tasks above)"
        ))
    }
}

/// Step 7: leave the LUN without registrations or reservation, whatever happened before.
fn cleanup(rep: &mut Report, nx: &[Nexus], lbs: usize) {
    let (a, b) = (&nx[0], &nx[1]);
    rep.check(
        TAG,
        "CLEAR (cleanup)",
        (|| {
            a.dev.pr_register_and_ignore(a.key, false).map_err(s)?;
            a.dev.pr_clear(a.key).map_err(s)?;
            let (_, keys) = keys_of(b)?;
            let r = b.dev.pr_read_reservation().map_err(s)?;
            if !keys.is_empty() || r.holder.is_some() {
                return Err(format!("after CLEAR: keys {keys:x?}, reservation {r:?}"));
            }
            b.dev
                .write_at(PR_LBA * lbs as u64, &image(lbs, 0xB2))
                .map_err(|e| format!("B's WRITE after CLEAR: {e}"))?;
            Ok("no keys, no reservation, B writes again".into())
        })(),
    );
}
