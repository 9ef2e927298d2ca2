//! This host's processes, read through `/proc` without ever waiting on one of them.
//!
//! **Why a module for it.** Most of a process's `/proc` entries wait for the process while it
//! is inside `execve(2)`, and an exec can stall for ever: it closes the process's
//! close-on-exec descriptors, and closing a file on a FUSE (or NFS) mount whose server does
//! not answer waits for that server. Measured on 6.18 with a child exec'ing while it held a
//! file of a SIGSTOPped FUSE daemon: reads of its `stat`, `wchan`, `io`, `environ`, `maps`,
//! `stack`, `ns/*` and the links `exe`, `cwd`, `fd/*` blocked until the daemon resumed;
//! `status`, `comm`, `cmdline`, `statm` and `limits` answered at once. One such process
//! anywhere on the host used to stall the fence path's scan for the users of a mount
//! ([`crate::cluster::watchdog::stop_users`]) and with it the watchdog's stop: the host was
//! then reset by watchdog-mux's client timeout, long after the bound the node advertised.
//!
//! So:
//! * [`state`] reads a process's state from `status`, never `stat`;
//! * [`scan`] looks at every process through a worker thread, at most [`PER_PROCESS`] each
//!   and all of them by a deadline: a process that does not answer in time is reported as
//!   unreadable, and the scan goes on with a fresh worker (the stuck one is left to finish
//!   whenever that process does, and its late answer is ignored).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long [`scan`] waits for one process before it calls it unreadable. A normal look
/// takes well under a millisecond; this leaves room for a loaded 2-core machine.
pub const PER_PROCESS: Duration = Duration::from_secs(1);

/// What a [`scan`] found.
#[derive(Debug)]
pub struct Scan<T> {
    /// Processes whose look returned something, with what it returned.
    pub found: Vec<(i32, T)>,
    /// Processes that did not answer within [`PER_PROCESS`], or were not reached before the
    /// deadline.
    pub unreadable: Vec<i32>,
}

/// The state letter of process `pid` (`R`, `S`, `D`, `T`, `Z`, ...), from `/proc/<pid>/status`
/// (module doc: never `stat`). None: no such process.
#[must_use]
pub fn state(pid: i32) -> Option<char> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("State:"))
        .and_then(|s| s.trim_start().chars().next())
}

/// Does process `pid` exist and is not a zombie (killed, not yet reaped)?
#[must_use]
pub fn alive(pid: i32) -> bool {
    state(pid).is_some_and(|s| s != 'Z' && s != 'X')
}

/// Pids of every process but this one.
fn others() -> Vec<i32> {
    let me = i32::try_from(std::process::id()).unwrap_or(0);
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                .filter(|&p| p != me)
                .collect()
        })
        .unwrap_or_default()
}

enum Msg<T> {
    Start(u32, i32),
    Done(u32, i32, Option<T>),
    End(u32),
}

/// The pids left to look at, and which worker may take them (a replaced worker that comes
/// back finds another id here and ends: it takes nothing it would report to nobody).
struct Work {
    worker: u32,
    pids: VecDeque<i32>,
}

/// No worker takes anything more.
const STOPPED: u32 = u32::MAX;

/// Run `look(pid, /proc/<pid>)` on every other process (module doc): at most `per_process`
/// each, nothing started after `until`. Every pid ends in `found` (if its look returned
/// something), in `unreadable`, or was looked at and returned nothing.
pub fn scan<T, F>(look: F, per_process: Duration, until: Instant) -> Scan<T>
where
    T: Send + 'static,
    F: Fn(i32, &Path) -> Option<T> + Send + Sync + 'static,
{
    let work = Arc::new(Mutex::new(Work {
        worker: 0,
        pids: VecDeque::from(others()),
    }));
    let look = Arc::new(look);
    let (tx, rx) = mpsc::channel::<Msg<T>>();
    let start_worker = |id: u32| {
        let (work, look, tx) = (work.clone(), look.clone(), tx.clone());
        std::thread::Builder::new()
            .name("cetra-procscan".into())
            .spawn(move || loop {
                // Start is sent under the lock: once the scan holds it to stop the workers,
                // every pid taken is in the channel (so none is lost between take and Start).
                let next = work.lock().ok().and_then(|mut w| {
                    let pid = (w.worker == id).then(|| w.pids.pop_front()).flatten()?;
                    tx.send(Msg::Start(id, pid)).ok().map(|()| pid)
                });
                let Some(pid) = next else {
                    let _ = tx.send(Msg::End(id));
                    return;
                };
                let got = look(pid, &PathBuf::from(format!("/proc/{pid}")));
                if tx.send(Msg::Done(id, pid, got)).is_err() {
                    return;
                }
            })
            .is_ok()
    };
    let mut out = Scan {
        found: Vec::new(),
        unreadable: Vec::new(),
    };
    let mut worker = 0u32;
    let mut in_flight: Option<i32> = None;
    // Takes one message; false once the current worker has ended.
    let take = |m: Msg<T>, worker: u32, in_flight: &mut Option<i32>, out: &mut Scan<T>| {
        match m {
            Msg::Start(id, pid) if id == worker => *in_flight = Some(pid),
            Msg::Done(id, pid, got) if id == worker => {
                *in_flight = None;
                if let Some(t) = got {
                    out.found.push((pid, t));
                }
            }
            Msg::End(id) if id == worker => return false,
            // A replaced worker's late answer: its pid is already unreadable.
            _ => {}
        }
        true
    };
    let mut running = start_worker(worker);
    while running {
        let now = Instant::now();
        if now >= until {
            break;
        }
        match rx.recv_timeout(per_process.min(until - now)) {
            Ok(m) => running = take(m, worker, &mut in_flight, &mut out),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if Instant::now() >= until {
                    break;
                }
                if let Some(pid) = in_flight.take() {
                    out.unreadable.push(pid);
                    worker += 1;
                    if let Ok(mut w) = work.lock() {
                        w.worker = worker;
                    }
                    running = start_worker(worker);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => running = false,
        }
    }
    // Stop every worker, then keep what the current one said before it saw that; whatever is
    // in flight or left was not looked at in time (or for want of a thread).
    let left: Vec<i32> = work
        .lock()
        .map(|mut w| {
            w.worker = STOPPED;
            w.pids.drain(..).collect()
        })
        .unwrap_or_default();
    while let Ok(m) = rx.try_recv() {
        take(m, worker, &mut in_flight, &mut out);
    }
    out.unreadable.extend(in_flight);
    out.unreadable.extend(left);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn child() -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap()
    }

    #[test]
    fn state_of_a_live_process_and_of_none() {
        let mut c = child();
        let pid = i32::try_from(c.id()).unwrap();
        // Running, sleeping, or still in its exec: alive in every case.
        assert!(state(pid).is_some_and(|s| s != 'Z'), "{:?}", state(pid));
        assert!(alive(pid));
        c.kill().unwrap();
        // Killed, not reaped: a zombie.
        let t = Instant::now();
        while state(pid) != Some('Z') && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(state(pid), Some('Z'));
        assert!(!alive(pid));
        c.wait().unwrap();
        assert_eq!(state(pid), None);
        assert!(!alive(pid));
    }

    /// A process whose look never returns is reported unreadable after the bound, and the
    /// scan still reaches every other process.
    #[test]
    fn a_process_that_does_not_answer_is_skipped_not_waited_for() {
        let (mut stuck, mut other) = (child(), child());
        let (s, o) = (
            i32::try_from(stuck.id()).unwrap(),
            i32::try_from(other.id()).unwrap(),
        );
        let t = Instant::now();
        let got = scan(
            move |pid, dir| {
                if pid == s {
                    std::thread::sleep(Duration::from_hours(1));
                }
                (pid == o || pid == s).then(|| dir.to_path_buf())
            },
            Duration::from_millis(200),
            Instant::now() + Duration::from_secs(20),
        );
        let took = t.elapsed();
        assert_eq!(got.unreadable, vec![s]);
        assert_eq!(got.found, vec![(o, PathBuf::from(format!("/proc/{o}")))]);
        assert!(took < Duration::from_secs(5), "took {took:?}");
        let _ = (stuck.kill(), other.kill(), stuck.wait(), other.wait());
    }

    /// A look that takes longer than the bound and then returns: that process is unreadable,
    /// and every other one is still looked at once, by the worker that replaced it.
    #[test]
    fn a_slow_look_loses_no_other_process() {
        let mut slow = child();
        let s = i32::try_from(slow.id()).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        let got = scan(
            move |pid, _| {
                if pid == s {
                    std::thread::sleep(Duration::from_millis(500));
                }
                seen2.lock().unwrap().push(pid);
                Some(())
            },
            Duration::from_millis(100),
            Instant::now() + Duration::from_secs(20),
        );
        let _ = (slow.kill(), slow.wait());
        assert_eq!(got.unreadable, vec![s]);
        // Every process but the slow one found exactly once; none lost, none twice.
        let mut found: Vec<i32> = got.found.iter().map(|&(p, ())| p).collect();
        found.sort_unstable();
        let n = found.len();
        found.dedup();
        assert_eq!(found.len(), n, "a pid found twice");
        assert!(!found.contains(&s));
        let seen = seen.lock().unwrap().clone();
        for p in seen.iter().filter(|&&p| p != s) {
            assert!(
                found.contains(p),
                "{p} was looked at but is in neither list"
            );
        }
    }

    /// Nothing starts after the deadline: what is left is unreadable, and the scan returns.
    #[test]
    fn the_deadline_bounds_the_whole_scan() {
        let t = Instant::now();
        let got = scan(
            |_, _| -> Option<()> {
                std::thread::sleep(Duration::from_millis(100));
                None
            },
            Duration::from_secs(1),
            Instant::now() + Duration::from_millis(300),
        );
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(!got.unreadable.is_empty());
    }
}
