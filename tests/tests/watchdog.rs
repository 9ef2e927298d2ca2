//! The host watchdog's graded sequence through a real daemon (issue 10 point 2;
//! `cetrafs-core/src/cluster/watchdog.rs`): a fake watchdog-mux socket stands in for Proxmox's.
//!
//! 1. `a_paused_node_stops_its_users_then_its_watchdog`: the daemon, mounted with
//!    `watchdog=<socket>`, pets while its lease is valid. SIGSTOPped past its fail time and
//!    resumed, it stops the process that uses the mount (SIGTERM; the process ignores it, so
//!    SIGKILL after the grace) and only then closes the watchdog connection, without the magic
//!    `V`: watchdog-mux would reset the host.
//!    Node 2 (no watchdog) watches: node 1's heartbeat advertises the watchdog, so node 2
//!    does not recover it after the plain dead time (5.2 s with these timings) but only after
//!    fail time + the watchdog's bound + two intervals (4 + 16 + 0.2 s).
//! 2. `a_clean_unmount_is_a_magic_close`: unmounting ends the connection with `V`.

use cetrafs_tests::{require_fuse, Lun, Mount};
use std::io::Read;
use std::os::unix::net::UnixListener;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const HEARTBEAT_MS: &str = "100";
/// Fail time 8 × 500 ms = 4 s.
const IO_TIMEOUT_MS: &str = "500";

/// What the fake watchdog-mux saw on its one connection: every byte with its arrival time,
/// until EOF.
fn serve_one(listener: UnixListener) -> mpsc::Receiver<(Instant, u8)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        let mut b = [0u8; 64];
        while let Ok(n) = conn.read(&mut b) {
            if n == 0 {
                break;
            }
            let t = Instant::now();
            for &x in &b[..n] {
                let _ = tx.send((t, x));
            }
        }
    });
    rx
}

fn formatted() -> Lun {
    let lun = Lun::new(1 << 30);
    lun.mkfs(&[
        "--heartbeat-interval",
        HEARTBEAT_MS,
        "--io-timeout",
        IO_TIMEOUT_MS,
        "-N",
        "4",
    ]);
    lun
}

/// A fresh volume, a fake watchdog-mux next to it, and node1 mounted with `watchdog=` that
/// socket; what the mux receives comes through the returned channel.
fn node1_with_fake_mux() -> (Lun, Mount, mpsc::Receiver<(Instant, u8)>) {
    let lun = formatted();
    let sock = lun.dir().join("watchdog-mux.sock");
    let pets = serve_one(UnixListener::bind(&sock).expect("bind the fake watchdog-mux"));
    let opt = format!("watchdog={}", sock.display());
    let m = Mount::with_opts(&lun, "node1", &[opt.as_str()]);
    (lun, m, pets)
}

#[test]
fn a_paused_node_stops_its_users_then_its_watchdog() {
    require_fuse!();
    let (lun, m, pets) = node1_with_fake_mux();
    let watcher = Mount::new(&lun, "node2");
    assert!(
        std::fs::read_to_string(m.log_path())
            .unwrap_or_default()
            .contains("host watchdog: watchdog-mux"),
        "the mount logs its watchdog"
    );
    // Pets arrive (one per second).
    let first = pets
        .recv_timeout(Duration::from_secs(5))
        .expect("the daemon pets its watchdog");
    assert_eq!(first.1, b'p');
    // A user of the mount that ignores SIGTERM, with its working directory in it.
    let mut user = std::process::Command::new("sh")
        .arg("-c")
        .arg("trap '' TERM; exec 3<.; while :; do sleep 0.1; done")
        .current_dir(m.path())
        .spawn()
        .expect("start a user of the mount");
    std::thread::sleep(Duration::from_millis(300));
    assert!(user.try_wait().expect("user").is_none());

    // Paused past the fail time (4 s) and the plain dead time (5.2 s), then resumed: its
    // lease is gone, but node 2 waits for its watchdog.
    let recovered = || {
        std::fs::read_to_string(watcher.log_path())
            .unwrap_or_default()
            .lines()
            .any(|l| l.contains("recovered") && l.contains("node1"))
    };
    m.signal(libc::SIGSTOP).expect("SIGSTOP");
    let stopped = Instant::now();
    std::thread::sleep(Duration::from_secs(7));
    assert!(
        !recovered(),
        "node 2 recovered node 1 after the plain dead time although its heartbeat advertises a \
         watchdog"
    );
    let resumed = Instant::now();
    m.signal(libc::SIGCONT).expect("SIGCONT");

    // The connection ends; note when, and that no `V` came.
    let mut last = first;
    let mut saw_v = false;
    let closed = loop {
        match pets.recv_timeout(Duration::from_secs(20)) {
            Ok(b) => {
                saw_v |= b.1 == b'V';
                last = b;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break Instant::now(),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("the watchdog connection stayed open 20 s after the lease was gone")
            }
        }
    };
    assert!(!saw_v, "a fenced node must not magic-close its watchdog");
    // The user was stopped before: SIGTERM ignored, SIGKILL after the 5 s grace.
    // (The daemon saw it gone from /proc; its parent, this test, reaps it.)
    let mut status = None;
    for _ in 0..100 {
        status = user.try_wait().expect("user");
        if status.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = status.unwrap_or_else(|| {
        let _ = user.kill();
        panic!("the user of the mount was still running when the watchdog closed")
    });
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "SIGTERM ignored, so SIGKILL: {status:?}"
    );
    let took = closed.duration_since(resumed);
    eprintln!(
        "watchdog: last pet {:?} before the resume, connection closed {:?} after it",
        resumed.saturating_duration_since(last.0),
        took
    );
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(10),
        "closed {took:?} after the resume: the user's 5 s grace first, then at once"
    );
    // Node 2 recovers node 1 once fail time + bound + two intervals have passed since its
    // last heartbeat (just before the SIGSTOP).
    let deadline = stopped + Duration::from_secs(40);
    while !recovered() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let after = stopped.elapsed();
    assert!(recovered(), "node 2 never recovered node 1");
    eprintln!("watchdog: node 2 recovered node 1 {after:?} after the SIGSTOP");
    assert!(
        after >= Duration::from_secs(20),
        "recovered {after:?} after the SIGSTOP: before the advertised bound ran out"
    );
    let log = std::fs::read_to_string(m.log_path()).unwrap_or_default();
    assert!(log.contains("FENCED") || log.contains("lease"), "{log}");
    // The shell and whichever `sleep` it runs: both have their working directory there.
    assert!(log.contains("fenced: stopping "), "{log}");
    assert!(log.contains("did not exit after SIGTERM; SIGKILL"), "{log}");
    assert!(log.contains("this host resets"), "{log}");
    let _ = m.unmount_any_status();
    watcher.unmount();
}

#[test]
fn a_clean_unmount_is_a_magic_close() {
    require_fuse!();
    let (_lun, m, pets) = node1_with_fake_mux();
    std::fs::write(m.p("f"), b"x").expect("write through the mount");
    m.unmount();
    let bytes: Vec<u8> = pets.iter().map(|(_, b)| b).collect();
    assert_eq!(
        bytes.last(),
        Some(&b'V'),
        "ends with the magic close: {bytes:?}"
    );
    assert!(bytes[..bytes.len() - 1].iter().all(|&b| b == b'p'));
}
