//! The host watchdog's graded sequence through a real daemon (issue 10 point 2;
//! `cetrafs-core/src/cluster/watchdog.rs`): a fake watchdog-mux socket stands in for Proxmox's.
//!
//! 1. `a_paused_node_stops_its_users_then_its_watchdog`: the daemon, mounted with
//!    `watchdog=<socket>`, pets while its lease is valid. SIGSTOPped past its fail time and
//!    resumed, it stops the process that uses the mount (SIGTERM; the process ignores it, so
//!    SIGKILL 4 s later, 1 s before its 5 s bound) and only then closes the watchdog
//!    connection, without the magic `V`: watchdog-mux would reset the host.
//!    Node 2 (no watchdog) watches: node 1's heartbeat advertises the watchdog, so node 2
//!    does not recover it after the plain dead time (5.2 s with these timings) but only after
//!    fail time + the watchdog's bound + two intervals (4 + 16 + 0.2 s).
//! 2. `a_clean_unmount_is_a_magic_close`: unmounting ends the connection with `V`.

use cetrafs_tests::{require_fuse, KillOnDrop, Lun, Mount};
use std::io::Read;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
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

/// A user of the mount that ignores SIGTERM, with its working directory and a descriptor in
/// it.
fn start_user(m: &Mount) -> KillOnDrop {
    KillOnDrop(
        std::process::Command::new("sh")
            .arg("-c")
            .arg("trap '' TERM; exec 3<.; while :; do sleep 0.1; done")
            .current_dir(m.path())
            .spawn()
            .expect("start a user of the mount"),
    )
}

/// `user`, a process using the mount that ignores SIGTERM, was ended by the fenced daemon with
/// SIGKILL before its watchdog closed (the daemon saw it gone from /proc; its parent, this
/// test, reaps it).
fn assert_sigkilled(user: &mut KillOnDrop, m: &Mount) {
    let mut status = None;
    cetrafs_tests::poll_until(Duration::from_secs(2), || {
        status = user.0.try_wait().ok().flatten();
        status.is_some()
    });
    let status = status.unwrap_or_else(|| {
        panic!(
            "the user of the mount was still running when the watchdog closed; log:\n{}",
            m.own_log()
        )
    });
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "SIGTERM ignored, so SIGKILL: {status:?}"
    );
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
    let mut user = start_user(&m);
    std::thread::sleep(Duration::from_millis(300));
    assert!(user.0.try_wait().expect("user").is_none());

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
    // The user was stopped before: SIGTERM ignored, SIGKILL 4 s later.
    assert_sigkilled(&mut user, &m);
    let took = closed.duration_since(resumed);
    eprintln!(
        "watchdog: last pet {:?} before the resume, connection closed {:?} after it",
        resumed.saturating_duration_since(last.0),
        took
    );
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(10),
        "closed {took:?} after the resume: the user's 4 s between SIGTERM and SIGKILL first, \
         then at once"
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

/// A FUSE filesystem of one file, `f`, whose server stops reading requests once it has
/// answered an OPEN, until its [`Gate`] opens: a process that execs while it holds `f` open
/// stays inside its exec (closing its copy of `f` sends a FLUSH nobody reads), as a process
/// holding a file of a stopped daemon does, and most of its /proc entries then block every
/// reader on the host (`cetrafs-core/src/cluster/procs.rs`).
struct StallsAfterOpen {
    gate: Gate,
}

/// Closed until dropped (panics included): then the stalled server goes on.
#[derive(Clone)]
struct Gate(std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>);

impl Gate {
    fn new() -> Self {
        Self(std::sync::Arc::new((
            std::sync::Mutex::new(false),
            std::sync::Condvar::new(),
        )))
    }

    fn wait(&self) {
        let (open, cv) = &*self.0;
        let mut g = open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while !*g {
            g = cv
                .wait(g)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    fn open(&self) {
        let (open, cv) = &*self.0;
        *open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        cv.notify_all();
    }
}

/// Opens the gate when dropped.
struct OpenOnDrop(Gate);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

impl StallsAfterOpen {
    fn attr(ino: fuser::INodeNo) -> fuser::FileAttr {
        let dir = ino == fuser::INodeNo::ROOT;
        fuser::FileAttr {
            ino,
            size: 0,
            blocks: 0,
            atime: std::time::UNIX_EPOCH,
            mtime: std::time::UNIX_EPOCH,
            ctime: std::time::UNIX_EPOCH,
            crtime: std::time::UNIX_EPOCH,
            kind: if dir {
                fuser::FileType::Directory
            } else {
                fuser::FileType::RegularFile
            },
            perm: if dir { 0o755 } else { 0o644 },
            nlink: if dir { 2 } else { 1 },
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

impl fuser::Filesystem for StallsAfterOpen {
    fn lookup(
        &self,
        _req: &fuser::Request,
        parent: fuser::INodeNo,
        name: &std::ffi::OsStr,
        reply: fuser::ReplyEntry,
    ) {
        if parent == fuser::INodeNo::ROOT && name == "f" {
            reply.entry(
                &Duration::from_mins(1),
                &Self::attr(fuser::INodeNo(2)),
                fuser::Generation(0),
            );
        } else {
            reply.error(fuser::Errno::ENOENT);
        }
    }

    fn getattr(
        &self,
        _req: &fuser::Request,
        ino: fuser::INodeNo,
        _fh: Option<fuser::FileHandle>,
        reply: fuser::ReplyAttr,
    ) {
        reply.attr(&Duration::from_mins(1), &Self::attr(ino));
    }

    fn open(
        &self,
        _req: &fuser::Request,
        _ino: fuser::INodeNo,
        _flags: fuser::OpenFlags,
        reply: fuser::ReplyOpen,
    ) {
        reply.opened(fuser::FileHandle(0), fuser::FopenFlags::empty());
        // The one session thread stops here: nothing more is read until the gate opens.
        self.gate.wait();
    }
}

/// A process somewhere on the host stuck in its exec (its /proc entries block readers) must
/// not hold up the fence: the daemon passes it over after a bound, stops the mount's user and
/// closes the watchdog in the same time as without it. (Before `cluster/procs.rs`, the scan
/// for users waited on that process for as long as it was stuck: neither the user nor the
/// watchdog was ever stopped, the failure seen in CI beside a test that stopped a daemon.)
#[test]
fn a_process_stuck_in_its_exec_does_not_hold_up_the_fence() {
    require_fuse!();
    let (lun, m, pets) = node1_with_fake_mux();
    pets.recv_timeout(Duration::from_secs(5))
        .expect("the daemon pets its watchdog");

    // The mount's user, started first: a process this test starts while it holds `f` would
    // be stuck in its exec too.
    let mut user = start_user(&m);
    // The stuck process: this test holds `f` of a FUSE mount that stops reading requests and
    // spawns `true`, whose exec then waits to close its inherited copy of `f` (until the
    // gate opens).
    let hang = lun.dir().join("never-flushes");
    std::fs::create_dir_all(&hang).expect("mountpoint");
    let gate = Gate::new();
    let session = fuser::spawn_mount(
        StallsAfterOpen { gate: gate.clone() },
        &hang,
        &fuser::Config::default(),
    )
    .expect("mount the stalling FUSE filesystem");
    let f = std::fs::File::open(hang.join("f")).expect("open f");
    // Dropped before `f` (a panic included): `f`'s own close needs the server going.
    let opened = OpenOnDrop(gate);
    let spawner = std::thread::Builder::new()
        .name("stuck-exec".into())
        .spawn(|| std::process::Command::new("true").status())
        .expect("spawner thread");
    let me = std::process::id().to_string();
    let find_stuck = || {
        let rd = std::fs::read_dir("/proc").ok()?;
        rd.flatten().find_map(|e| {
            let pid = e.file_name().to_string_lossy().into_owned();
            let parent = cetrafs_tests::proc_status(&pid, "PPid")?;
            let name = cetrafs_tests::proc_status(&pid, "Name")?;
            (parent == me && (name == "stuck-exec" || name == "true")).then_some(pid)
        })
    };
    // Really stuck: reads of some of its /proc entries do not return.
    let blocks = |pid: &str, entry: &str| {
        let path = format!("/proc/{pid}/{entry}");
        cetrafs_tests::bounded(Duration::from_secs(1), move || {
            std::fs::read_link(&path).or_else(|_| std::fs::read_to_string(&path).map(PathBuf::from))
        })
        .is_none()
    };
    let mut stuck = None;
    cetrafs_tests::poll_until(Duration::from_secs(10), || {
        stuck = find_stuck().and_then(|pid| {
            // What the daemon reads: links and maps (not `stat`).
            let blocked: Vec<&str> = ["exe", "cwd", "maps"]
                .into_iter()
                .filter(|e| blocks(&pid, e))
                .collect();
            (!blocked.is_empty()).then_some((pid, blocked))
        });
        stuck.is_some()
    });
    let (stuck, blocked) = stuck.expect("no child of this test stuck in its exec within 10 s");
    eprintln!("stuck exec: /proc/{stuck}/ entries that block: {blocked:?}");

    // The pause past the fail time.
    m.signal(libc::SIGSTOP).expect("SIGSTOP");
    std::thread::sleep(Duration::from_secs(5));
    let resumed = Instant::now();
    m.signal(libc::SIGCONT).expect("SIGCONT");
    let closed = loop {
        match pets.recv_timeout(Duration::from_secs(12)) {
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break resumed.elapsed(),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!(
                    "the watchdog connection stayed open 12 s after the resume; log:\n{}",
                    m.own_log()
                )
            }
        }
    };
    assert_sigkilled(&mut user, &m);
    let log = m.own_log();
    // Let the stuck exec finish (the server reads its FLUSH), then unmount.
    drop(opened);
    let _ = spawner.join();
    drop(f);
    drop(session);
    assert!(
        closed < Duration::from_secs(10),
        "closed {closed:?} after the resume"
    );
    let named = log
        .lines()
        .filter(|l| l.contains("could not be looked at in time"))
        .filter_map(|l| {
            l.rsplit_once('[')
                .map(|(_, list)| list.trim_end_matches(']'))
        })
        .any(|list| list.split(", ").any(|p| p == stuck));
    assert!(
        named,
        "the daemon did not name the stuck process {stuck}:\n{log}"
    );
    assert!(log.contains("fenced: stopping "), "{log}");
    let _ = m.unmount_any_status();
}
