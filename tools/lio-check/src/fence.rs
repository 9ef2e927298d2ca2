//! `fence`: issue 10's proof that `fence=pr` stops the late write of a node the survivors gave
//! up on, and that without it the write lands. Three `mount.cetra` daemons on three `tcm_loop`
//! nexuses of one LUN (`--devs`), run twice on a fresh volume: `fence=pr` then `fence=none`.
//!
//! 1. mkfs once; the three nodes mount with `fence=MODE,pr_preempt=P`; node2 carries the
//!    process failpoint `lease::write_checked=stop`, armed for one LUN byte offset through
//!    `CETRA_FAILPOINT_AT` (a file this check writes later). With `pr`: every daemon logs the
//!    chosen fencing, and the LUN becomes reserved Write Exclusive – Registrants Only with three
//!    keys (READ RESERVATION / READ KEYS through node3's nexus). A fourth `mount.cetra` through
//!    node1's nexus is refused ("once per host") and leaves the keys as they were: the target
//!    keeps one registration per initiator port.
//! 2. node2 writes one 4 KiB block of a new file with `O_DIRECT` and fsyncs; the check finds the
//!    LUN byte offset X of that block by reading the LUN through node3's nexus.
//! 3. X goes into the failpoint's file and node2 overwrites the block (`O_DIRECT` pwrite, on a
//!    thread): its daemon passes the lease check for the write covering X and stops itself
//!    (SIGSTOP) right before the device write, the paused-node hazard of docs/locking.md §14.
//! 4. A survivor recovers node2 after the dead time: with `pr` its log shows the PREEMPT (or
//!    PREEMPT AND ABORT) of node2's key *before* the `recovered … journal blocks replayed` line,
//!    and READ KEYS has two keys left.
//! 5. node1 overwrites the same block with its own data and fsyncs; X holds node1's data.
//! 6. node2 is resumed (SIGCONT): its stopped write goes to the LUN. With `pr` it must fail
//!    (the target answers RESERVATION CONFLICT; node2's log shows `FENCED` and `RESERVATION
//!    CONFLICT`, its pwrite returns an error) and X, read through node3's nexus, still holds
//!    node1's data. With `none` the stale write lands: X holds node2's data. That second run is
//!    what shows the first one could fail.
//! 7. node2 is killed and detached; nodes 1 and 3 unmount cleanly (their keys unregistered);
//!    `fsck.cetra -n` is clean (`pr`); any reservation left is removed with CLEAR; every log
//!    holds no ERROR line but node2's `FENCED` line.

use crate::fsmulti::{
    line_with, mkfs_once, poll, reap, secs, spawn_merged, timed, umount, unmount_and_fsck,
    wait_child, wait_exit, Node, Scenario, DAEMON_LIMIT, RECOVERY_SLACK, STEP_LIMIT,
};
use crate::{get, num, open, Report};
use cetrafs_core::dev::{AlignedBuf, BlockDevice};
use cetrafs_core::scsi::pr::PrType;
use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BLOCK: usize = 4096;
/// The key this check registers to CLEAR the LUN afterwards ("LIOF").
const CLEANUP_KEY: u64 = 0x4C49_4F46_0000_0001;
/// node2's `FENCED` line is provoked on purpose.
const PROVOKED_ERRORS: &[&str] = &["FENCED: "];

/// A block whose first line names who wrote it.
fn pattern(who: &str) -> AlignedBuf {
    let mut b = AlignedBuf::new(BLOCK);
    let line = format!("fence check: block written by {who}\n");
    for (i, x) in b.iter_mut().enumerate() {
        *x = line.as_bytes()[i % line.len()];
    }
    b
}

/// `fence --tag d512 --devs SD,SD,SD --interval MS --io-timeout MS [--preempt plain|abort]
/// [--modes pr,none]`.
pub fn fence(m: &HashMap<String, String>) -> Result<bool, String> {
    let lun = get(m, "tag")?.to_string();
    let devs: Vec<String> = get(m, "devs")?.split(',').map(str::to_string).collect();
    let interval = num(m, "interval")?;
    let io_timeout = num(m, "io-timeout")?;
    let preempt = m.get("preempt").map_or("plain", String::as_str).to_string();
    if devs.len() < 3 {
        return Err(format!("need 3 devices, got {devs:?}"));
    }
    // SAFETY: prctl with integer arguments (the daemons fork away from mount.cetra; as their
    // subreaper we reap them and see their exit status).
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let mut rep = Report { pass: 0, fail: 0 };
    let dead_time = cetrafs_core::cluster::Timing::from_ms(
        u32::try_from(interval).map_err(|e| e.to_string())?,
        u32::try_from(io_timeout).map_err(|e| e.to_string())?,
    )
    .dead_time();
    // `--modes pr` skips the fence=none contrast (the iSCSI run: it shows nothing new there).
    let modes: Vec<String> = m
        .get("modes")
        .map_or("pr,none", String::as_str)
        .split(',')
        .map(str::to_string)
        .collect();
    if let Some(bad) = modes.iter().find(|m| !matches!(m.as_str(), "pr" | "none")) {
        return Err(format!("--modes takes pr and/or none, not {bad:?}"));
    }
    for mode in modes.iter().map(String::as_str) {
        let tag = format!("fence-{mode}-{lun}");
        let at_file = PathBuf::from(format!("/tmp/{tag}-at"));
        let _ = fs::remove_file(&at_file);
        let mut nodes = Node::three(&devs, &tag, &format!(",fence={mode},pr_preempt={preempt}"));
        nodes[1].env = vec![
            (
                cetrafs_core::failpoint::PROCESS_ENV.into(),
                "lease::write_checked=stop".into(),
            ),
            (
                cetrafs_core::failpoint::PROCESS_AT_ENV.into(),
                at_file.to_string_lossy().into_owned(),
            ),
        ];
        let mut s = Scenario::new(&tag, nodes, &mut rep);
        let t = Instant::now();
        clear(&mut s, &devs[2], "CLEAR before");
        run(
            &mut s, &devs, mode, &preempt, &at_file, interval, io_timeout, dead_time,
        );
        s.teardown();
        clear(&mut s, &devs[2], "CLEAR after");
        // node2 only: a FENCED line on a survivor fails the run.
        s.check_logs(PROVOKED_ERRORS, &[1]);
        if s.failed {
            s.dump_logs();
        }
        for l in std::mem::take(&mut s.summary) {
            println!("SUMMARY {tag} {l}");
        }
        println!("SUMMARY {tag}: {}", secs(t.elapsed()));
    }
    Ok(rep.fail == 0 && rep.pass > 0)
}

/// Register a key of this check through `dev` and CLEAR: no key, no reservation left.
fn clear(s: &mut Scenario, dev: &str, name: &str) {
    let r = (|| {
        let d = open(dev)?;
        d.pr_register_and_ignore(CLEANUP_KEY, false)
            .map_err(|e| e.to_string())?;
        d.pr_clear(CLEANUP_KEY).map_err(|e| e.to_string())?;
        let keys = d.pr_read_keys().map_err(|e| e.to_string())?;
        let res = d.pr_read_reservation().map_err(|e| e.to_string())?;
        if keys.keys.is_empty() && res.holder.is_none() {
            Ok(format!("{dev}: no key, no reservation"))
        } else {
            Err(format!("{dev}: keys {:x?}, reservation {res:?}", keys.keys))
        }
    })();
    s.check(name, r);
}

/// The LUN byte offset of the 4 KiB-aligned block equal to `want`, read through `dev`.
fn find_block(dev: &str, want: &[u8]) -> Result<u64, String> {
    const CHUNK: usize = 1 << 20;
    let d = open(dev)?;
    let size = d.geometry().size_bytes;
    let mut buf = AlignedBuf::new(CHUNK);
    let mut off = 0u64;
    while off < size {
        let n = usize::try_from((size - off).min(CHUNK as u64)).map_err(|e| e.to_string())?;
        d.read_at(off, &mut buf[..n]).map_err(|e| e.to_string())?;
        if let Some(i) = buf[..n].chunks_exact(BLOCK).position(|b| b == want) {
            return Ok(off + (i * BLOCK) as u64);
        }
        off += n as u64;
    }
    Err(format!("no block of {dev} holds the image"))
}

/// Who wrote the block at LUN byte `at`, read through `dev`: the first line of [`pattern`].
fn block_owner(dev: &str, at: u64) -> Result<String, String> {
    let d = open(dev)?;
    let mut b = AlignedBuf::new(BLOCK);
    d.read_at(at, &mut b).map_err(|e| e.to_string())?;
    for who in ["node1", "node2 (stale)", "node2"] {
        if b[..] == pattern(who)[..] {
            return Ok(who.to_string());
        }
    }
    Ok(format!("unknown ({:?})", String::from_utf8_lossy(&b[..40])))
}

/// `State:` of /proc/PID/status, e.g. `T (stopped)`.
fn proc_state(pid: i32) -> String {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("State:").map(|v| v.trim().to_string()))
        .unwrap_or_default()
}

fn write_block(path: &Path, data: &[u8], create: bool) -> Result<(), String> {
    let f = fs::OpenOptions::new()
        .write(true)
        .create(create)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| format!("open {} O_DIRECT: {e}", path.display()))?;
    f.write_all_at(data, 0)
        .map_err(|e| format!("O_DIRECT pwrite {}: {e}", path.display()))?;
    f.sync_all()
        .map_err(|e| format!("fsync {}: {e}", path.display()))
}

#[allow(clippy::too_many_arguments, clippy::too_many_lines)]
fn run(
    s: &mut Scenario,
    devs: &[String],
    mode: &str,
    preempt: &str,
    at_file: &Path,
    interval: u64,
    io_timeout: u64,
    dead_time: Duration,
) {
    let pr = mode == "pr";
    let reader = devs[2].clone();
    if !mkfs_once(s, &devs[0], interval, io_timeout, dead_time) {
        return;
    }
    // ---- 1. mount, the fencing each node chose, the reservation
    let res = s.mount(&[0, 1, 2]);
    let mut all = true;
    for (i, r) in res.into_iter().enumerate() {
        let host = s.nodes[i].host.clone();
        all &= s.check(&format!("mount {host} (fence={mode})"), r);
    }
    if !all {
        return;
    }
    let want = if pr {
        "fence=pr: SCSI-3 persistent reservations"
    } else {
        "fence=none: software fencing only"
    };
    let r = (0..3)
        .map(|i| {
            line_with(&s.log_of(i), 0, &[want])
                .map(|(_, l)| l.split("daemon: ").last().unwrap_or(&l).trim().to_string())
                .ok_or_else(|| format!("node{} logs no '{want}' line", i + 1))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|v| v[0].clone());
    s.check("every node logs its fencing", r);
    if pr {
        // a node reserves when every live slot has its key: at the latest on the 10 s recheck
        let dev = reader.clone();
        let r = poll(Duration::from_secs(25), || {
            let d = open(&dev)?;
            let res = d.pr_read_reservation().map_err(|e| e.to_string())?;
            let keys = d.pr_read_keys().map_err(|e| e.to_string())?;
            Ok(res
                .holder
                .is_some_and(|h| h.pr_type() == Some(PrType::WriteExclusiveRegistrantsOnly))
                && keys.keys.len() == 3)
        })
        .map(|d| {
            format!(
                "reserved {} with 3 keys after {}",
                PrType::WriteExclusiveRegistrantsOnly,
                secs(d)
            )
        });
        if !s.check("LUN reserved, 3 keys", r) {
            return;
        }
    }

    if pr {
        // A second mount through node1's nexus would share (and at its end remove) node1's
        // registration: refused before any PERSISTENT RESERVE OUT, node1's key untouched.
        let mp = PathBuf::from(format!("/mnt/{}-twin", s.tag));
        let _ = fs::create_dir_all(&mp);
        let opt = format!("host=node4,fence=pr,pr_preempt={preempt}");
        let keys = || -> Result<Vec<u64>, String> {
            let mut k = open(&reader)?
                .pr_read_keys()
                .map_err(|e| e.to_string())?
                .keys;
            k.sort_unstable();
            Ok(k)
        };
        let before = keys();
        let r = spawn_merged(
            "mount.cetra",
            &[&devs[0], &mp.to_string_lossy(), "-o", &opt],
            &[("CETRA_LOG_FILE", &format!("/tmp/{}-twin.log", s.tag))],
        )
        .and_then(|c| wait_child(c, DAEMON_LIMIT))
        .and_then(|(st, out)| {
            let after = keys()?;
            if !st.success() && out.contains("once per host") && Ok(&after) == before.as_ref() {
                Ok(format!("refused ({}); keys unchanged", out.trim()))
            } else {
                Err(format!(
                    "{st}: {}; keys {before:x?} -> {after:x?}",
                    out.trim()
                ))
            }
        });
        if !s.check("a second mount through node1's nexus is refused", r) {
            return;
        }
    }

    // ---- 2. node2's block and where it lives on the LUN
    let (m1, m2) = (s.mp(0), s.mp(1));
    let r = {
        let (m2, reader) = (m2.clone(), reader.clone());
        timed("node2 writes its block", STEP_LIMIT, move || {
            write_block(&m2.join("victim"), &pattern("node2"), true)?;
            find_block(&reader, &pattern("node2"))
        })
    };
    let at = match r {
        Ok(at) => {
            s.check(
                "node2's block on the LUN",
                Ok(format!("LUN byte {at} (fs block {})", at / BLOCK as u64)),
            );
            at
        }
        Err(e) => {
            s.check("node2's block on the LUN", Err(e));
            return;
        }
    };

    // ---- 3. node2 overwrites it and stops between its lease check and the device write
    let Some(pid2) = s.nodes[1].pid else { return };
    if let Err(e) = fs::write(at_file, at.to_string()) {
        s.check("arm node2's failpoint", Err(e.to_string()));
        return;
    }
    let skip: Vec<usize> = (0..3).map(|i| s.log_of(i).lines().count()).collect();
    let (wtx, wrx) = mpsc::channel();
    {
        let p = m2.join("victim");
        std::thread::spawn(move || {
            let _ = wtx.send(write_block(&p, &pattern("node2 (stale)"), false));
        });
    }
    let t_stop = Instant::now();
    let r = poll(Duration::from_secs(10), || Ok(proc_state(pid2).starts_with('T')))
        .map(|d| format!("pid {pid2} stopped itself {} after the pwrite began (failpoint lease::write_checked, LUN byte {at})", secs(d)));
    if !s.check("node2 stops between lease check and write", r) {
        return;
    }

    // ---- 4. a survivor fences (pr) and recovers node2
    let limit = dead_time + RECOVERY_SLACK;
    let found = s.wait_log_line(&[0, 2], &skip, &["recovered", "node2"], limit);
    let r = match &found {
        Some((i, idx, l)) => {
            let log = s.log_of(*i);
            let fenced = line_with(&log, skip[*i], &["fence=pr: PREEMPT", "node slot"]);
            let command = if preempt == "abort" {
                "PREEMPT AND ABORT"
            } else {
                "PREEMPT of"
            };
            match (pr, fenced) {
                (true, Some((p, pl))) if p < *idx && pl.contains(command) => Ok(format!(
                    "node{} {} after the stop (dead time {}): {} THEN {}",
                    i + 1,
                    secs(t_stop.elapsed()),
                    secs(dead_time),
                    pl.split("WARN").last().unwrap_or(&pl).trim(),
                    l.split("WARN").last().unwrap_or(l).trim()
                )),
                (true, other) => Err(format!(
                    "node{} recovered node2 ({l}) without a '{command}' line before it: {other:?}",
                    i + 1
                )),
                (false, Some((_, pl))) => {
                    Err(format!("fence=none, yet a survivor preempted: {pl}"))
                }
                (false, None) => Ok(format!(
                    "node{} after {} (no reservation to preempt): {}",
                    i + 1,
                    secs(t_stop.elapsed()),
                    l.split("WARN").last().unwrap_or(l).trim()
                )),
            }
        }
        _ => Err(format!(
            "no survivor logged 'recovered ... node2' within {}",
            secs(limit)
        )),
    };
    s.summary.push(format!(
        "recovery of the stopped node2: {}",
        secs(t_stop.elapsed())
    ));
    if !s.check(
        if pr {
            "survivor preempts node2, then replays"
        } else {
            "survivor recovers node2"
        },
        r,
    ) {
        return;
    }
    if pr {
        let dev = reader.clone();
        let r = (|| {
            let k = open(&dev)?.pr_read_keys().map_err(|e| e.to_string())?;
            if k.keys.len() == 2 {
                Ok(format!("READ KEYS: {:x?}", k.keys))
            } else {
                Err(format!(
                    "READ KEYS: {:x?} (want node1's and node3's)",
                    k.keys
                ))
            }
        })();
        s.check("node2's key is gone", r);
    }

    // ---- 5. node1 writes the same block
    let r = {
        let (m1, reader) = (m1.clone(), reader.clone());
        timed("node1 overwrites", STEP_LIMIT, move || {
            write_block(&m1.join("victim"), &pattern("node1"), false)?;
            match block_owner(&reader, at)? {
                w if w == "node1" => Ok(format!("LUN byte {at} holds node1's data")),
                w => Err(format!(
                    "LUN byte {at} holds {w}'s data after node1's fsync"
                )),
            }
        })
    };
    if !s.check("node1 overwrites node2's block", r) {
        return;
    }

    // ---- 6. node2 resumes with its stale write
    // SAFETY: node2's daemon, started by this program.
    unsafe { libc::kill(pid2, libc::SIGCONT) };
    let t_cont = Instant::now();
    let wrote = wrx.recv_timeout(Duration::from_secs(15));
    let fenced = poll(Duration::from_secs(10), || {
        Ok(line_with(&s.log_of(1), skip[1], &["FENCED"]).is_some())
    });
    let log2 = s.log_of(1);
    let fence_line = line_with(&log2, skip[1], &["FENCED"]).map(|(_, l)| l);
    let conflict = line_with(&log2, skip[1], &["RESERVATION CONFLICT"]).is_some();
    let owner = block_owner(&reader, at);
    let r = match (pr, &wrote, &owner) {
        (true, Ok(Err(e)), Ok(w)) if w == "node1" && fenced.is_ok() && conflict => Ok(format!(
            "its pwrite failed ({e}); node2 logged {:?}; LUN byte {at} (read through {reader}) still holds node1's data",
            fence_line.unwrap_or_default()
        )),
        (false, _, Ok(w)) if w == "node2 (stale)" => Ok(format!(
            "the stale write LANDED: LUN byte {at} holds node2's data over node1's (its pwrite: {wrote:?}; {}): the hazard fence=pr removes",
            fence_line.as_deref().unwrap_or("no FENCED line")
        )),
        _ => Err(format!(
            "pwrite {wrote:?}, FENCED {fenced:?} ({fence_line:?}), RESERVATION CONFLICT logged {conflict}, LUN byte {at} holds {owner:?}"
        )),
    };
    s.summary.push(format!(
        "node2 resumed: {} to its verdict",
        secs(t_cont.elapsed())
    ));
    s.check(
        if pr {
            "node2's late write refused: RESERVATION CONFLICT, FENCED"
        } else {
            "node2's late write lands (fence=none)"
        },
        r,
    );

    // ---- 7. node2 goes; the survivors unmount; fsck
    // SAFETY: as above.
    unsafe { libc::kill(pid2, libc::SIGKILL) };
    let _ = wait_exit(pid2, Duration::from_secs(10));
    let _ = reap(pid2);
    let _ = umount(&m2, true);
    s.nodes[1].pid = None;
    // the stale write of fence=none hit file data only: the metadata is intact either way
    unmount_and_fsck(s, &[0, 2], &reader);
}
