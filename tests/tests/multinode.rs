//! Several nodes on one volume (issue 4, "Done when"): three `mount-cetra` daemons with host
//! names node1..node3 mount ONE file-backed LUN, each at its own mount point, and the tests check
//! cross-node visibility, concurrent namespace and data work, dead-node recovery (SIGKILL, a
//! recoverer that dies half-way), self-fencing of a SIGSTOPped node, identity/slot refusal and
//! per-file open locks.
//!
//! Every failure message is followed by the daemon logs of all nodes (printed by
//! [`Cluster`]'s `Drop` while unwinding).
//!
//! Contracts with the daemon that these tests assume:
//! * `CETRA_WRITE_LOG=<file>`: the daemon appends one line per device write that reached the
//!   device, `<CLOCK_REALTIME ns at issue> <pid> <write|caw> <byte offset> <len>`
//!   (cetrafs-core/src/dev/write_log.rs).
//! * `CETRA_FAILPOINT=recovery::after_replay=exit`: the daemon exits with code 99 right after it
//!   replayed a dead node's journal, before it finished that node's recovery.
//! * A survivor that finished recovering a node logs a line containing "recovered" and the dead
//!   node's host name; a node that fences itself logs a line containing "fenced"; an EBUSY
//!   refusal of a cross-node open logs a line naming the holder's host name.
//!
//! Knobs: `CETRA_STORM_SECS` (default 60: the issue asks for ≥ 60 s), `CETRA_SEED`.

// A node is its index: it selects the host name, the mount, the model and the log at once.
#![allow(clippy::needless_range_loop)]

use cetrafs_core::dev::write_log::{WriteKind, WriteLogLine};
use cetrafs_tests::{
    errno_name, errno_of, get_xattr, poll_until, read_lossy, realtime_ns, require_fuse, secs, seed,
    set_xattr, AlignedBuf, Exit, Lun, Mount,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Timing and sizes (the one place)

/// mkfs --heartbeat-interval (ms).
const HEARTBEAT_MS: u64 = 100;
/// mkfs --io-timeout (ms).
const IO_TIMEOUT_MS: u64 = 500;
/// A node that could not renew for this long fences itself (cluster/timing.rs: 8 × `io_timeout`).
const FAIL_TIME: Duration = Duration::from_millis(8 * IO_TIMEOUT_MS);
/// Others call a node dead after its slot did not change for this long
/// (fail + 2 × `io_timeout` + 2 × interval = 5.2 s).
const DEAD_TIME: Duration =
    Duration::from_millis(8 * IO_TIMEOUT_MS + 2 * IO_TIMEOUT_MS + 2 * HEARTBEAT_MS);
/// Recovery may take this long beyond the dead time (journal replay, lock release).
const RECOVERY_SLACK: Duration = Duration::from_secs(10);
/// Cross-node visibility bound from the issue (kernel entry/attr cache ≤ 1 s).
const VISIBLE_WITHIN: Duration = Duration::from_secs(1);
/// How long a visibility check keeps looking (to report how late a change was).
const VISIBILITY_GIVE_UP: Duration = Duration::from_secs(10);
/// A close on one node reaches the daemon asynchronously (FUSE RELEASE): allow this long.
const RELEASE_WITHIN: Duration = Duration::from_secs(5);
/// Default storm duration; the issue asks for at least 60 s.
const DEFAULT_STORM_SECS: u64 = 60;
/// Failpoint env contract for the recoverer test.
/// The scenarios run one at a time (each starts three daemons): in parallel on a 2-core CI
/// machine, 24 daemons and their storms would turn the 1 s visibility bound into a test of
/// the scheduler.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

const FAILPOINT_ENV: (&str, &str) = ("CETRA_FAILPOINT", "recovery::after_replay=exit");
const FAILPOINT_EXIT_CODE: i32 = 99;

/// Sparse LUN: 8 journals of the default 64 MiB plus three 64 MiB images fit easily.
const LUN_SIZE: u64 = 4 << 30;
const NODES: [&str; 3] = ["node1", "node2", "node3"];
const BLK: usize = 4096;
const IMAGE_SIZE: u64 = 64 << 20;
#[allow(clippy::cast_possible_truncation)] // a constant: 64 MiB / 4 KiB
const IMAGE_BLOCKS: usize = (IMAGE_SIZE / BLK as u64) as usize;
const IMAGE_CHUNK: usize = 1 << 20;
const IMAGE_OVERWRITES: u32 = 2000;
/// Names per directory and node in the storm (bounds directory size).
const STORM_NAMES: usize = 40;

fn mkfs_args(max_nodes: &str) -> Vec<String> {
    vec![
        "--heartbeat-interval".into(),
        HEARTBEAT_MS.to_string(),
        "--io-timeout".into(),
        IO_TIMEOUT_MS.to_string(),
        "-N".into(),
        max_nodes.into(),
    ]
}

fn storm_duration() -> Duration {
    Duration::from_secs(
        std::env::var("CETRA_STORM_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_STORM_SECS),
    )
}

// ---------------------------------------------------------------------------------------------
// Patterns

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fill `buf` with the pattern of `key`.
fn fill(key: u64, buf: &mut [u8]) {
    let k = mix(key);
    for (i, ch) in buf.chunks_mut(8).enumerate() {
        let w = mix(k ^ (i as u64)).to_le_bytes();
        ch.copy_from_slice(&w[..ch.len()]);
    }
}

fn pattern(key: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(key, &mut v);
    v
}

/// Key of image block `b` of node `node` after write `iteration` (0 = the sequential pass).
fn image_key(node: usize, b: usize, iteration: u32) -> u64 {
    ((node as u64 + 1) << 56) | ((b as u64) << 24) | u64::from(iteration)
}

// ---------------------------------------------------------------------------------------------
// The cluster: three nodes on one LUN, logs of all nodes on failure

struct Cluster {
    test: &'static str,
    /// Index i is NODES[i]. Declared before `lun` so mounts go before the LUN's directory.
    nodes: Vec<Option<Mount>>,
    lun: Lun,
}

impl Cluster {
    /// A fresh LUN formatted with the fast test timings and `max_nodes` slots; nothing mounted.
    fn formatted(test: &'static str, max_nodes: &str) -> Self {
        let lun = Lun::new(LUN_SIZE);
        let args = mkfs_args(max_nodes);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        lun.mkfs(&args);
        Self {
            test,
            nodes: NODES.iter().map(|_| None).collect(),
            lun,
        }
    }

    /// Formatted (8 slots) with node1..node3 mounted, in order.
    fn start(test: &'static str) -> Self {
        let mut c = Self::formatted(test, "8");
        for i in 0..NODES.len() {
            c.mount(i, &[], &[]);
        }
        c
    }

    fn mountpoint(&self, i: usize) -> PathBuf {
        self.lun.dir().join(format!("mnt-{}", NODES[i]))
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.lun.dir().join(format!("mnt-{}.log", NODES[i]))
    }

    fn log_of(&self, i: usize) -> String {
        read_lossy(&self.log_path(i))
    }

    fn try_mount(&mut self, i: usize, opts: &[&str], env: &[(&str, &str)]) -> Result<(), String> {
        assert!(
            self.nodes[i].is_none(),
            "{}: {} is already mounted",
            self.test,
            NODES[i]
        );
        let mp = self.mountpoint(i);
        let t = Instant::now();
        match Mount::try_new_env(self.lun.path(), &mp, NODES[i], opts, env) {
            Ok(m) => {
                eprintln!(
                    "{}: {} mounted (pid {}, {})",
                    self.test,
                    NODES[i],
                    m.pid(),
                    secs(t.elapsed())
                );
                self.nodes[i] = Some(m);
                Ok(())
            }
            Err(r) => Err(format!(
                "mounting {} as {} (opts {opts:?}, env {env:?}) failed after {}: {r}",
                self.lun.path().display(),
                NODES[i],
                secs(t.elapsed())
            )),
        }
    }

    fn mount(&mut self, i: usize, opts: &[&str], env: &[(&str, &str)]) {
        if let Err(e) = self.try_mount(i, opts, env) {
            panic!("{}: {e}", self.test);
        }
    }

    fn n(&self, i: usize) -> &Mount {
        self.nodes[i]
            .as_ref()
            .unwrap_or_else(|| panic!("{}: {} is not mounted", self.test, NODES[i]))
    }

    fn take(&mut self, i: usize) -> Mount {
        self.nodes[i]
            .take()
            .unwrap_or_else(|| panic!("{}: {} is not mounted", self.test, NODES[i]))
    }

    /// Last lines of every log file in the LUN's directory (daemon logs of all nodes and of
    /// refused daemons).
    fn logs(&self) -> String {
        const LINES: usize = 150;
        let mut names: Vec<PathBuf> = fs::read_dir(self.lun.dir())
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "log"))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        let mut out = String::new();
        for p in names {
            let text = read_lossy(&p);
            let lines: Vec<&str> = text.lines().collect();
            let _ = writeln!(
                out,
                "----- {} ({} lines, last {}) -----\n{}",
                p.display(),
                lines.len(),
                LINES.min(lines.len()),
                lines[lines.len().saturating_sub(LINES)..].join("\n")
            );
        }
        out
    }

    /// The first line of one of `observers`' logs saying it recovered `dead`.
    fn recovered_line(&self, observers: &[usize], dead: &str) -> Option<(usize, String)> {
        observers.iter().find_map(|&i| {
            self.log_of(i)
                .lines()
                .find(|l| l.contains("recovered") && l.contains(dead))
                .map(|l| (i, l.to_string()))
        })
    }

    /// Unmount every mounted node (each daemon must exit 0); panics listing every failure.
    fn unmount_all(&mut self) {
        let mut errs = Vec::new();
        for i in 0..NODES.len() {
            if let Some(mut m) = self.nodes[i].take() {
                if let Err(e) = m.try_unmount() {
                    errs.push(format!("{}: {e}", NODES[i]));
                }
            }
        }
        assert!(
            errs.is_empty(),
            "{}: unmounting all nodes failed:\n{}",
            self.test,
            errs.join("\n")
        );
    }

    fn unmount_all_and_fsck(&mut self) {
        self.unmount_all();
        let r = self.lun.fsck();
        assert_eq!(
            r.code, 0,
            "{}: fsck -n is not clean after unmounting all nodes: {r}",
            self.test
        );
        eprintln!("{}: all nodes unmounted, fsck -n clean", self.test);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // A stopped daemon would hang its unmount: let every daemon run again.
        for m in self.nodes.iter().flatten() {
            let _ = m.signal(libc::SIGCONT);
        }
        if std::thread::panicking() {
            eprintln!(
                "\n===== {}: daemon logs of all nodes =====\n{}===== end of logs =====",
                self.test,
                self.logs()
            );
        }
        for m in &mut self.nodes {
            drop(m.take());
        }
    }
}

/// Set on drop (also while unwinding): stops worker threads and SIGCONTs a stopped daemon, so
/// a failing test never waits forever on a thread blocked in a stopped FUSE daemon.
struct StopGuard<'a> {
    stop: &'a AtomicBool,
    cont_pid: Option<i32>,
}

impl Drop for StopGuard<'_> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(pid) = self.cont_pid {
            // SAFETY: signalling a daemon this test started.
            unsafe { libc::kill(pid, libc::SIGCONT) };
        }
    }
}

fn io_err(what: &str, e: &io::Error) -> String {
    format!("{what}: {e} ({})", errno_name(errno_of(e)))
}

fn fsync_dir(p: &Path) -> io::Result<()> {
    fs::File::open(p)?.sync_all()
}

fn open_direct(p: &Path, write: bool, create: bool) -> io::Result<fs::File> {
    fs::OpenOptions::new()
        .read(true)
        .write(write)
        .create_new(create)
        .custom_flags(libc::O_DIRECT)
        .open(p)
}

/// Wait until every node sees `rel` under its mount point.
fn wait_visible_everywhere(c: &Cluster, rel: &str) {
    for i in 0..NODES.len() {
        if c.nodes[i].is_none() {
            continue;
        }
        let p = c.n(i).p(rel);
        assert!(
            poll_until(VISIBILITY_GIVE_UP, || fs::symlink_metadata(&p).is_ok()).is_some(),
            "{}: {rel} is not visible on {} after {VISIBILITY_GIVE_UP:?}",
            c.test,
            NODES[i]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Cross-node visibility

/// Poll `observers` until `check` passes on each; returns the slowest node's delay. Panics if a
/// node never sees the change within `VISIBILITY_GIVE_UP`.
fn observe(
    c: &Cluster,
    step: &str,
    observers: &[usize],
    check: impl Fn(&Mount) -> Result<(), String>,
) -> Vec<(usize, Duration)> {
    let start = Instant::now();
    let mut pending: Vec<usize> = observers.to_vec();
    let mut last_err: BTreeMap<usize, String> = BTreeMap::new();
    let mut seen = Vec::new();
    loop {
        let now = start.elapsed();
        pending.retain(|&i| match check(c.n(i)) {
            Ok(()) => {
                seen.push((i, now));
                false
            }
            Err(e) => {
                last_err.insert(i, e);
                true
            }
        });
        if pending.is_empty() {
            return seen;
        }
        if now > VISIBILITY_GIVE_UP {
            let why: Vec<String> = pending
                .iter()
                .map(|i| format!("{}: {}", NODES[*i], last_err[i]))
                .collect();
            panic!(
                "{}: step {step:?}: not visible after {VISIBILITY_GIVE_UP:?}:\n  {}",
                c.test,
                why.join("\n  ")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Write `data` at `off` into an existing file and fsync it.
fn write_fsync(p: &Path, off: u64, data: &[u8]) {
    let f = fs::OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap_or_else(|e| panic!("open {} for writing: {e}", p.display()));
    f.write_all_at(data, off)
        .unwrap_or_else(|e| panic!("write {} at {off}: {e}", p.display()));
    f.sync_all()
        .unwrap_or_else(|e| panic!("fsync {}: {e}", p.display()));
}

fn expect_content(p: &Path, want: &[u8]) -> Result<(), String> {
    // A fresh open and a plain (page-cache) read: what an application on that node sees.
    match fs::read(p) {
        Ok(got) if got == want => Ok(()),
        Ok(got) => Err(format!(
            "{} has {} bytes, expected {} (first difference at {:?})",
            p.display(),
            got.len(),
            want.len(),
            got.iter().zip(want).position(|(a, b)| a != b)
        )),
        Err(e) => Err(io_err(&format!("read {}", p.display()), &e)),
    }
}

fn expect_absent(p: &Path) -> Result<(), String> {
    match fs::symlink_metadata(p) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(&format!("stat {}", p.display()), &e)),
        Ok(m) => Err(format!("{} still exists (inode {})", p.display(), m.ino())),
    }
}

#[test]
fn cross_node_visibility() {
    require_fuse!();
    let _serial = serial();
    let c = Cluster::start("cross_node_visibility");
    let a = c.n(0);
    let others = [1, 2];
    let mut steps: Vec<(String, Vec<(usize, Duration)>)> = Vec::new();

    // create + write + fsync
    let x1 = pattern(1, 10_000);
    {
        let mut f = fs::File::create_new(a.p("vis-a")).expect("create vis-a on node1");
        f.write_all(&x1).expect("write vis-a");
        f.sync_all().expect("fsync vis-a");
    }
    steps.push((
        "create+write+fsync".into(),
        observe(&c, "create+write+fsync", &others, |m| {
            expect_content(&m.p("vis-a"), &x1)
        }),
    ));

    // rename
    fs::rename(a.p("vis-a"), a.p("vis-b")).expect("rename vis-a -> vis-b on node1");
    steps.push((
        "rename".into(),
        observe(&c, "rename", &others, |m| {
            expect_absent(&m.p("vis-a"))?;
            expect_content(&m.p("vis-b"), &x1)
        }),
    ));

    // write more + fsync (extends the file; the others have its old pages cached)
    let x2 = pattern(2, 5_000);
    write_fsync(&a.p("vis-b"), x1.len() as u64, &x2);
    let mut x12 = x1.clone();
    x12.extend_from_slice(&x2);
    steps.push((
        "write+fsync (extend)".into(),
        observe(&c, "write+fsync (extend)", &others, |m| {
            expect_content(&m.p("vis-b"), &x12)
        }),
    ));

    // overwrite in place + fsync (same size: only the bytes change)
    let x3 = pattern(3, 4096);
    write_fsync(&a.p("vis-b"), 4096, &x3);
    x12[4096..8192].copy_from_slice(&x3);
    steps.push((
        "overwrite+fsync".into(),
        observe(&c, "overwrite+fsync", &others, |m| {
            expect_content(&m.p("vis-b"), &x12)
        }),
    ));

    // truncate
    fs::OpenOptions::new()
        .write(true)
        .open(a.p("vis-b"))
        .and_then(|f| f.set_len(3000))
        .expect("truncate vis-b to 3000 on node1");
    let x_tr = x12[..3000].to_vec();
    steps.push((
        "truncate".into(),
        observe(&c, "truncate", &others, |m| {
            let len = fs::symlink_metadata(m.p("vis-b"))
                .map_err(|e| io_err("stat vis-b", &e))?
                .len();
            if len != 3000 {
                return Err(format!("vis-b is {len} bytes, expected 3000"));
            }
            expect_content(&m.p("vis-b"), &x_tr)
        }),
    ));

    // setxattr
    set_xattr(&a.p("vis-b"), b"user.x", b"value-from-node1", 0).expect("setxattr on node1");
    steps.push((
        "setxattr".into(),
        observe(&c, "setxattr", &others, |m| {
            match get_xattr(&m.p("vis-b"), b"user.x") {
                Ok(v) if v == b"value-from-node1" => Ok(()),
                Ok(v) => Err(format!("user.x = {:?}", String::from_utf8_lossy(&v))),
                Err(e) => Err(io_err("getxattr user.x", &e)),
            }
        }),
    ));

    // unlink
    fs::remove_file(a.p("vis-b")).expect("unlink vis-b on node1");
    steps.push((
        "unlink".into(),
        observe(&c, "unlink", &others, |m| expect_absent(&m.p("vis-b"))),
    ));

    // mkdir
    fs::create_dir(a.p("vis-dir")).expect("mkdir vis-dir on node1");
    steps.push((
        "mkdir".into(),
        observe(&c, "mkdir", &others, |m| {
            match fs::symlink_metadata(m.p("vis-dir")) {
                Ok(md) if md.is_dir() => Ok(()),
                Ok(_) => Err("vis-dir is not a directory".into()),
                Err(e) => Err(io_err("stat vis-dir", &e)),
            }
        }),
    ));

    // The reverse direction: node3 -> node1.
    let x4 = pattern(4, 7_777);
    {
        let mut f = fs::File::create_new(c.n(2).p("vis-dir/from-node3")).expect("create on node3");
        f.write_all(&x4).expect("write on node3");
        f.sync_all().expect("fsync on node3");
    }
    steps.push((
        "node3 -> node1 create+write+fsync".into(),
        observe(&c, "node3 -> node1", &[0], |m| {
            expect_content(&m.p("vis-dir/from-node3"), &x4)
        }),
    ));

    let mut late = Vec::new();
    let mut max = Duration::ZERO;
    for (step, seen) in &steps {
        let desc: Vec<String> = seen
            .iter()
            .map(|(i, d)| format!("{} {} ms", NODES[*i], d.as_millis()))
            .collect();
        eprintln!("cross_node_visibility: {step:<36} {}", desc.join(", "));
        for (i, d) in seen {
            max = max.max(*d);
            if *d > VISIBLE_WITHIN {
                late.push(format!("{step} on {}: {} ms", NODES[*i], d.as_millis()));
            }
        }
    }
    eprintln!(
        "cross_node_visibility: slowest change became visible after {} ms (bound {} ms)",
        max.as_millis(),
        VISIBLE_WITHIN.as_millis()
    );
    assert!(
        late.is_empty(),
        "changes visible later than {VISIBLE_WITHIN:?}:\n  {}",
        late.join("\n  ")
    );
    let mut c = c;
    c.unmount_all_and_fsck();
}

// ---------------------------------------------------------------------------------------------
// 2. Concurrent namespace storm (also used by 4.)

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Obj {
    /// A regular file; the id is shared by its hard links.
    File(u64),
    Dir,
}

/// (directory relative to the mount point, name) → object, for one node's own names.
type Model = BTreeMap<(String, String), Obj>;

#[derive(Debug, Default)]
struct StormOut {
    model: Model,
    ops: u64,
    /// Errors while it mattered (fatal for the test).
    errors: Vec<String>,
    /// Errors after the node was killed on purpose (expected).
    errors_after_kill: u64,
}

fn private_dir(node: usize) -> String {
    format!("p-{}", NODES[node])
}
const SHARED_DIR: &str = "shared";

/// One node's storm: random create/rename/unlink/link/mkdir/rmdir among its own names in its
/// private directory and in the shared directory. Every op's outcome is predictable from the
/// model, so any error is a failure (unless `killed` is set: the node was killed on purpose).
/// Stops at `deadline`, when `stop` is set, or at the first error.
fn storm(
    node: usize,
    mp: &Path,
    seed: u64,
    deadline: Instant,
    stop: &AtomicBool,
    killed: &AtomicBool,
) -> StormOut {
    let mut rng = StdRng::seed_from_u64(seed);
    let dirs = [private_dir(node), SHARED_DIR.to_string()];
    let mut out = StormOut::default();
    let mut next_id = 1u64;
    let slot = |rng: &mut StdRng| {
        (
            dirs[rng.gen_range(0..2)].clone(),
            format!("{}-{}", NODES[node], rng.gen_range(0..STORM_NAMES)),
        )
    };
    let path = |k: &(String, String)| mp.join(&k.0).join(&k.1);
    while Instant::now() < deadline && !stop.load(Ordering::SeqCst) {
        let k = slot(&mut rng);
        let cur = out.model.get(&k).copied();
        let r: (String, io::Result<()>) = match cur {
            None => match rng.gen_range(0..100) {
                0..=49 => {
                    let r = fs::File::create_new(path(&k)).map(|_| ());
                    if r.is_ok() {
                        out.model.insert(k.clone(), Obj::File(next_id));
                        next_id += 1;
                    }
                    (format!("create {}", path(&k).display()), r)
                }
                50..=64 => {
                    let r = fs::create_dir(path(&k));
                    if r.is_ok() {
                        out.model.insert(k.clone(), Obj::Dir);
                    }
                    (format!("mkdir {}", path(&k).display()), r)
                }
                65..=82 => {
                    // link an existing own file here
                    let files: Vec<_> = out
                        .model
                        .iter()
                        .filter(|(_, o)| matches!(o, Obj::File(_)))
                        .map(|(k, o)| (k.clone(), *o))
                        .collect();
                    if files.is_empty() {
                        continue;
                    }
                    let (src, o) = files[rng.gen_range(0..files.len())].clone();
                    let r = fs::hard_link(path(&src), path(&k));
                    if r.is_ok() {
                        out.model.insert(k.clone(), o);
                    }
                    (
                        format!("link {} {}", path(&src).display(), path(&k).display()),
                        r,
                    )
                }
                _ => {
                    // rename an existing own entry here
                    let keys: Vec<_> = out.model.keys().cloned().collect();
                    if keys.is_empty() {
                        continue;
                    }
                    let src = keys[rng.gen_range(0..keys.len())].clone();
                    let r = fs::rename(path(&src), path(&k));
                    if r.is_ok() {
                        let o = out.model.remove(&src).expect("source in model");
                        out.model.insert(k.clone(), o);
                    }
                    (
                        format!("rename {} {}", path(&src).display(), path(&k).display()),
                        r,
                    )
                }
            },
            Some(Obj::File(id)) => match rng.gen_range(0..100) {
                0..=39 => {
                    let r = fs::remove_file(path(&k));
                    if r.is_ok() {
                        out.model.remove(&k);
                    }
                    (format!("unlink {}", path(&k).display()), r)
                }
                40..=79 => {
                    // rename onto a free own slot or over another own file
                    let dst = slot(&mut rng);
                    let r = match out.model.get(&dst).copied() {
                        Some(Obj::Dir) => continue,
                        _ if dst == k => continue,
                        // Both names are links of one file: rename(2) does nothing.
                        Some(Obj::File(d)) if d == id => fs::rename(path(&k), path(&dst)),
                        _ => {
                            let r = fs::rename(path(&k), path(&dst));
                            if r.is_ok() {
                                out.model.remove(&k);
                                out.model.insert(dst.clone(), Obj::File(id));
                            }
                            r
                        }
                    };
                    (
                        format!("rename {} {}", path(&k).display(), path(&dst).display()),
                        r,
                    )
                }
                _ => {
                    let dst = slot(&mut rng);
                    if out.model.contains_key(&dst) {
                        continue;
                    }
                    let r = fs::hard_link(path(&k), path(&dst));
                    if r.is_ok() {
                        out.model.insert(dst.clone(), Obj::File(id));
                    }
                    (
                        format!("link {} {}", path(&k).display(), path(&dst).display()),
                        r,
                    )
                }
            },
            Some(Obj::Dir) => {
                if rng.gen_bool(0.6) {
                    let r = fs::remove_dir(path(&k));
                    if r.is_ok() {
                        out.model.remove(&k);
                    }
                    (format!("rmdir {}", path(&k).display()), r)
                } else {
                    let dst = slot(&mut rng);
                    if out.model.contains_key(&dst) {
                        continue;
                    }
                    let r = fs::rename(path(&k), path(&dst));
                    if r.is_ok() {
                        out.model.remove(&k);
                        out.model.insert(dst.clone(), Obj::Dir);
                    }
                    (
                        format!("rename dir {} {}", path(&k).display(), path(&dst).display()),
                        r,
                    )
                }
            }
        };
        out.ops += 1;
        if let (what, Err(e)) = r {
            if killed.load(Ordering::SeqCst) {
                out.errors_after_kill += 1;
            } else {
                out.errors.push(format!(
                    "{} op {}: {}",
                    NODES[node],
                    out.ops,
                    io_err(&what, &e)
                ));
            }
            break;
        }
    }
    out
}

/// What one node lists: (dir, name) → (`is_dir`, inode, nlink).
type Listing = BTreeMap<(String, String), (bool, u64, u64)>;

fn list_storm_dirs(mp: &Path) -> Result<Listing, String> {
    let mut out = Listing::new();
    let mut dirs: Vec<String> = (0..NODES.len()).map(private_dir).collect();
    dirs.push(SHARED_DIR.into());
    for d in dirs {
        let rd = fs::read_dir(mp.join(&d)).map_err(|e| io_err(&format!("readdir {d}"), &e))?;
        for e in rd {
            let e = e.map_err(|e| io_err(&format!("readdir {d}"), &e))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let md = fs::symlink_metadata(e.path())
                .map_err(|err| io_err(&format!("stat {d}/{name}"), &err))?;
            out.insert((d.clone(), name), (md.is_dir(), md.ino(), md.nlink()));
        }
    }
    Ok(out)
}

/// Compare a node's listing with the models: same names, same types, links of one model file
/// share one inode (and its link count), different files have different inodes. `ignore` is a
/// name prefix whose entries are not checked (a killed node's unsynced work).
fn compare_listing(
    who: &str,
    got: &Listing,
    models: &[&Model],
    ignore: Option<&str>,
) -> Vec<String> {
    let mut v = Vec::new();
    let mut want: BTreeMap<(String, String), (usize, Obj)> = BTreeMap::new();
    for (n, m) in models.iter().enumerate() {
        for (k, o) in *m {
            want.insert(k.clone(), (n, *o));
        }
    }
    let ignored = |k: &(String, String)| ignore.is_some_and(|p| k.1.starts_with(p));
    for k in want.keys() {
        if !got.contains_key(k) {
            v.push(format!("{who}: missing {}/{}", k.0, k.1));
        }
    }
    let mut ino_of: BTreeMap<(usize, u64), u64> = BTreeMap::new();
    let mut links: BTreeMap<(usize, u64), u64> = BTreeMap::new();
    let mut owner_of_ino: BTreeMap<u64, (usize, u64)> = BTreeMap::new();
    for (k, &(is_dir, ino, _)) in got {
        if ignored(k) && !want.contains_key(k) {
            continue;
        }
        let Some(&(n, o)) = want.get(k) else {
            v.push(format!("{who}: unexpected {}/{} (inode {ino})", k.0, k.1));
            continue;
        };
        match o {
            Obj::Dir if !is_dir => v.push(format!("{who}: {}/{} is not a directory", k.0, k.1)),
            Obj::File(_) if is_dir => v.push(format!("{who}: {}/{} is a directory", k.0, k.1)),
            Obj::File(id) => {
                *links.entry((n, id)).or_default() += 1;
                if let Some(prev) = ino_of.insert((n, id), ino) {
                    if prev != ino {
                        v.push(format!(
                            "{who}: links of one file have inodes {prev} and {ino} ({}/{})",
                            k.0, k.1
                        ));
                    }
                }
                if let Some(prev) = owner_of_ino.insert(ino, (n, id)) {
                    if prev != (n, id) {
                        v.push(format!(
                            "{who}: inode {ino} is two different files ({}/{})",
                            k.0, k.1
                        ));
                    }
                }
            }
            Obj::Dir => {}
        }
    }
    for (k, &(is_dir, _, nlink)) in got {
        if let Some(&(n, Obj::File(id))) = want.get(k) {
            let want_links = links.get(&(n, id)).copied().unwrap_or(0);
            if !is_dir && nlink != want_links {
                v.push(format!(
                    "{who}: {}/{} has link count {nlink}, {want_links} names expected",
                    k.0, k.1
                ));
            }
        }
    }
    v
}

fn setup_storm_dirs(c: &Cluster) {
    fs::create_dir(c.n(0).p(SHARED_DIR)).expect("mkdir shared on node1");
    for i in 0..NODES.len() {
        fs::create_dir(c.n(i).p(private_dir(i)))
            .unwrap_or_else(|e| panic!("mkdir {} on {}: {e}", private_dir(i), NODES[i]));
    }
    wait_visible_everywhere(c, SHARED_DIR);
    for i in 0..NODES.len() {
        wait_visible_everywhere(c, &private_dir(i));
    }
}

/// Every listed node must list exactly the models (polled for the visibility bound first).
fn check_listings(c: &Cluster, observers: &[usize], models: &[&Model], ignore: Option<&str>) {
    let mut listings = Vec::new();
    for &i in observers {
        let mp = c.n(i).path().to_path_buf();
        let mut last = Vec::new();
        let mut got = Listing::new();
        let ok = poll_until(VISIBLE_WITHIN * 2, || {
            match list_storm_dirs(&mp) {
                Ok(l) => {
                    last = compare_listing(NODES[i], &l, models, ignore);
                    got = l;
                }
                Err(e) => last = vec![format!("{}: {e}", NODES[i])],
            }
            last.is_empty()
        });
        if ok.is_none() {
            let n = last.len();
            last.truncate(40);
            panic!(
                "{}: {} does not list the expected names ({n} differences):\n  {}",
                c.test,
                NODES[i],
                last.join("\n  ")
            );
        }
        listings.push((i, got));
    }
    // And all observers agree with each other, entry for entry (also ignored ones, inodes).
    for w in listings.windows(2) {
        let ((a, la), (b, lb)) = (&w[0], &w[1]);
        if la != lb {
            let diff: Vec<String> = la
                .iter()
                .filter(|(k, v)| lb.get(*k) != Some(*v))
                .map(|(k, v)| {
                    format!(
                        "{}/{}: {} {v:?}, {} {:?}",
                        k.0,
                        k.1,
                        NODES[*a],
                        NODES[*b],
                        lb.get(k)
                    )
                })
                .chain(
                    lb.keys()
                        .filter(|k| !la.contains_key(*k))
                        .map(|k| format!("{}/{}: only on {}", k.0, k.1, NODES[*b])),
                )
                .take(40)
                .collect();
            panic!(
                "{}: {} and {} list different entries:\n  {}",
                c.test,
                NODES[*a],
                NODES[*b],
                diff.join("\n  ")
            );
        }
    }
}

#[test]
fn concurrent_namespace_storm() {
    require_fuse!();
    let _serial = serial();
    let seed = seed("concurrent_namespace_storm");
    let mut c = Cluster::start("concurrent_namespace_storm");
    setup_storm_dirs(&c);
    let dur = storm_duration();
    let stop = AtomicBool::new(false);
    let killed = AtomicBool::new(false);
    let deadline = Instant::now() + dur;
    let t0 = Instant::now();
    let outs: Vec<StormOut> = std::thread::scope(|s| {
        let _guard = StopGuard {
            stop: &stop,
            cont_pid: None,
        };
        let hs: Vec<_> = (0..NODES.len())
            .map(|i| {
                let mp = c.n(i).path().to_path_buf();
                let (stop, killed) = (&stop, &killed);
                s.spawn(move || storm(i, &mp, seed ^ mix(i as u64), deadline, stop, killed))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("storm thread panicked"))
            .collect()
    });
    let took = t0.elapsed();
    for (i, o) in outs.iter().enumerate() {
        #[expect(clippy::cast_precision_loss, reason = "a rate for the log")]
        let rate = o.ops as f64 / took.as_secs_f64();
        eprintln!(
            "concurrent_namespace_storm: {}: {} ops in {} ({rate:.0}/s), {} names at the end",
            NODES[i],
            o.ops,
            secs(took),
            o.model.len()
        );
    }
    let errors: Vec<&String> = outs.iter().flat_map(|o| &o.errors).collect();
    assert!(
        errors.is_empty(),
        "seed {seed}: storm operations failed:\n  {}",
        errors
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n  ")
    );
    for (i, o) in outs.iter().enumerate() {
        assert!(o.ops > 0, "{} did no operation at all", NODES[i]);
    }
    let models: Vec<&Model> = outs.iter().map(|o| &o.model).collect();
    check_listings(&c, &[0, 1, 2], &models, None);
    c.unmount_all_and_fsck();
}

// ---------------------------------------------------------------------------------------------
// 3. Concurrent images

#[derive(Debug, Default)]
struct ImageOut {
    /// Iteration of the last write of every block (0 = the sequential pass).
    last: Vec<u32>,
    /// `CLOCK_REALTIME` window of the overwrite phase.
    overwrite_ns: (u128, u128),
    alloc_time: Duration,
    overwrite_time: Duration,
}

fn image_name(node: usize) -> String {
    format!("img-{}", NODES[node])
}

fn write_image(node: usize, mp: &Path, seed: u64) -> Result<ImageOut, String> {
    let p = mp.join(image_name(node));
    let f = open_direct(&p, true, true).map_err(|e| io_err("create image O_DIRECT", &e))?;
    let t = Instant::now();
    let mut buf = AlignedBuf::new(IMAGE_CHUNK);
    let per_chunk = IMAGE_CHUNK / BLK;
    for chunk in 0..IMAGE_BLOCKS / per_chunk {
        for i in 0..per_chunk {
            fill(
                image_key(node, chunk * per_chunk + i, 0),
                &mut buf[i * BLK..(i + 1) * BLK],
            );
        }
        f.write_all_at(&buf, (chunk * IMAGE_CHUNK) as u64)
            .map_err(|e| io_err(&format!("allocating write of MiB {chunk}"), &e))?;
    }
    f.sync_all()
        .map_err(|e| io_err("fsync after allocation", &e))?;
    let alloc_time = t.elapsed();

    let mut rng = StdRng::seed_from_u64(seed);
    let mut last = vec![0u32; IMAGE_BLOCKS];
    let mut one = AlignedBuf::new(BLK);
    let t = Instant::now();
    let start_ns = realtime_ns();
    for it in 1..=IMAGE_OVERWRITES {
        let b = rng.gen_range(0..IMAGE_BLOCKS);
        fill(image_key(node, b, it), &mut one);
        f.write_all_at(&one, (b * BLK) as u64)
            .map_err(|e| io_err(&format!("overwrite {it} of block {b}"), &e))?;
        last[b] = it;
    }
    f.sync_all()
        .map_err(|e| io_err("fsync after overwrites", &e))?;
    let end_ns = realtime_ns();
    Ok(ImageOut {
        last,
        overwrite_ns: (start_ns, end_ns),
        alloc_time,
        overwrite_time: t.elapsed(),
    })
}

/// Read image `owner` through `mp` and check every block against its last write.
fn verify_image(mp: &Path, owner: usize, last: &[u32]) -> Vec<String> {
    let mut v = Vec::new();
    let p = mp.join(image_name(owner));
    let f = match open_direct(&p, false, false) {
        Ok(f) => f,
        Err(e) => return vec![io_err(&format!("open {}", p.display()), &e)],
    };
    match f.metadata() {
        Ok(m) if m.len() == IMAGE_SIZE => {}
        Ok(m) => v.push(format!(
            "{} is {} bytes, expected {IMAGE_SIZE}",
            p.display(),
            m.len()
        )),
        Err(e) => return vec![io_err("stat image", &e)],
    }
    let mut buf = AlignedBuf::new(IMAGE_CHUNK);
    let mut exp = vec![0u8; BLK];
    let per_chunk = IMAGE_CHUNK / BLK;
    let mut bad = 0usize;
    for chunk in 0..IMAGE_BLOCKS / per_chunk {
        if let Err(e) = f.read_exact_at(&mut buf, (chunk * IMAGE_CHUNK) as u64) {
            v.push(io_err(&format!("read MiB {chunk} of {}", p.display()), &e));
            return v;
        }
        for i in 0..per_chunk {
            let b = chunk * per_chunk + i;
            fill(image_key(owner, b, last[b]), &mut exp);
            let got = &buf[i * BLK..(i + 1) * BLK];
            if got != &exp[..] {
                bad += 1;
                if bad <= 8 {
                    // Which write does it hold, if any of this block's?
                    let held = (0..=IMAGE_OVERWRITES).find(|&it| {
                        fill(image_key(owner, b, it), &mut exp);
                        got == &exp[..]
                    });
                    v.push(format!(
                        "{} block {b}: expected write #{}, holds {}",
                        p.display(),
                        last[b],
                        match held {
                            Some(it) => format!("write #{it} (stale)"),
                            None if got.iter().all(|x| *x == 0) => "zeros".into(),
                            None => format!("unknown bytes {:02x?}", &got[..16]),
                        }
                    ));
                }
            }
        }
    }
    if bad > 8 {
        v.push(format!("{}: {bad} bad blocks in all", p.display()));
    }
    v
}

fn write_log_path(c: &Cluster, i: usize) -> PathBuf {
    // Not *.log: Cluster::logs must not dump it.
    c.lun.dir().join(format!("writes-{}.txt", NODES[i]))
}

fn read_write_log(p: &Path) -> Vec<WriteLogLine> {
    read_lossy(p)
        .lines()
        .map(|l| {
            WriteLogLine::parse(l)
                .unwrap_or_else(|| panic!("malformed line in write log {}: {l:?}", p.display()))
        })
        .collect()
}

#[test]
fn concurrent_images() {
    require_fuse!();
    let _serial = serial();
    let seed = seed("concurrent_images");
    let mut c = Cluster::formatted("concurrent_images", "8");
    // Each node logs its device writes: the overwrite phase must need no per-write cluster I/O.
    for i in 0..NODES.len() {
        let wl = write_log_path(&c, i).to_string_lossy().into_owned();
        c.mount(i, &[], &[("CETRA_WRITE_LOG", wl.as_str())]);
    }
    let outs: Vec<Result<ImageOut, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..NODES.len())
            .map(|i| {
                let mp = c.n(i).path().to_path_buf();
                s.spawn(move || write_image(i, &mp, seed ^ mix(i as u64)))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("image thread panicked"))
            .collect()
    });
    let mut errs = Vec::new();
    let mut images = Vec::new();
    for (i, o) in outs.into_iter().enumerate() {
        match o {
            Ok(o) => images.push(o),
            Err(e) => errs.push(format!("{}: {e}", NODES[i])),
        }
    }
    assert!(
        errs.is_empty(),
        "seed {seed}: image writers failed:\n  {}",
        errs.join("\n  ")
    );

    let mut caw_report = Vec::new();
    for (i, o) in images.iter().enumerate() {
        let lines = read_write_log(&write_log_path(&c, i));
        let (a, b) = o.overwrite_ns;
        let in_phase: Vec<&WriteLogLine> = lines
            .iter()
            .filter(|l| l.time_ns >= a && l.time_ns <= b)
            .collect();
        let caws = in_phase.iter().filter(|l| l.kind == WriteKind::Caw).count();
        eprintln!(
            "concurrent_images: {}: allocating 64 MiB {} ({:.0} MiB/s), {IMAGE_OVERWRITES} \
             overwrites {} ({:.0}/s); device writes in the overwrite phase: {} ({caws} CAW)",
            NODES[i],
            secs(o.alloc_time),
            64.0 / o.alloc_time.as_secs_f64(),
            secs(o.overwrite_time),
            f64::from(IMAGE_OVERWRITES) / o.overwrite_time.as_secs_f64(),
            in_phase.len()
        );
        assert!(
            !lines.is_empty(),
            "{}: its device write log {} is empty: CETRA_WRITE_LOG is not honoured",
            NODES[i],
            write_log_path(&c, i).display()
        );
        if caws >= IMAGE_OVERWRITES as usize {
            caw_report.push(format!(
                "{}: {caws} COMPARE AND WRITEs during {IMAGE_OVERWRITES} overwrites of an \
                 allocated image (per-write cluster I/O)",
                NODES[i]
            ));
        }
    }

    let mut v = Vec::new();
    for reader in 0..NODES.len() {
        for (owner, o) in images.iter().enumerate() {
            for e in verify_image(c.n(reader).path(), owner, &o.last) {
                v.push(format!("read on {}: {e}", NODES[reader]));
            }
        }
    }
    assert!(
        v.is_empty(),
        "seed {seed}: image data does not verify:\n  {}",
        v.join("\n  ")
    );
    assert!(caw_report.is_empty(), "{}", caw_report.join("\n"));
    eprintln!("concurrent_images: all three images verify from all three nodes");
    c.unmount_all_and_fsck();
}

// ---------------------------------------------------------------------------------------------
// 4. SIGKILL mid-storm, survivors recover

#[derive(Debug, Clone)]
struct Durable {
    name: String,
    key: u64,
    len: usize,
}

const DURABLE_DIR: &str = "durable-node2";

/// Create files with fsync (file and directory) until stopped or the first error; a file is
/// recorded only once both fsyncs returned.
fn durable_writer(
    mp: &Path,
    seed: u64,
    stop: &AtomicBool,
    killed: &AtomicBool,
    done: &Mutex<Vec<Durable>>,
    errors: &Mutex<Vec<String>>,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = mp.join(DURABLE_DIR);
    for n in 0u64.. {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let d = Durable {
            name: format!("d{n}"),
            key: mix(seed ^ n),
            len: rng.gen_range(1..=40_000),
        };
        let r = (|| -> io::Result<()> {
            let mut f = fs::File::create_new(dir.join(&d.name))?;
            f.write_all(&pattern(d.key, d.len))?;
            f.sync_all()?;
            fsync_dir(&dir)
        })();
        match r {
            Ok(()) => done.lock().expect("durable list").push(d),
            Err(e) => {
                if !killed.load(Ordering::SeqCst) {
                    errors
                        .lock()
                        .expect("errors")
                        .push(io_err(&format!("node2 durable {}", d.name), &e));
                }
                return;
            }
        }
    }
}

fn check_durables(c: &Cluster, reader: usize, files: &[Durable]) -> Vec<String> {
    let dir = c.n(reader).p(DURABLE_DIR);
    files
        .iter()
        .filter_map(|d| {
            expect_content(&dir.join(&d.name), &pattern(d.key, d.len))
                .err()
                .map(|e| format!("fsync'd {} read on {}: {e}", d.name, NODES[reader]))
        })
        .collect()
}

#[test]
fn sigkill_recovery() {
    require_fuse!();
    let _serial = serial();
    let seed = seed("sigkill_recovery");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut c = Cluster::start("sigkill_recovery");
    setup_storm_dirs(&c);
    fs::create_dir(c.n(1).p(DURABLE_DIR)).expect("mkdir durable dir on node2");
    fsync_dir(c.n(1).path()).expect("fsync root on node2");
    wait_visible_everywhere(&c, DURABLE_DIR);

    let kill_after = Duration::from_millis(rng.gen_range(3000..=6000));
    let stop = AtomicBool::new(false);
    let killed = AtomicBool::new(false);
    let durables = Mutex::new(Vec::new());
    let dur_errors = Mutex::new(Vec::new());
    let node2_pid = c.n(1).pid();
    let far = Instant::now() + Duration::from_hours(1);
    let mut recovery: Option<(Duration, usize, String)> = None;
    let mut node2 = Some(c.take(1));
    let node2_mp = node2.as_ref().expect("node2").path().to_path_buf();

    let outs: Vec<StormOut> = std::thread::scope(|s| {
        let _guard = StopGuard {
            stop: &stop,
            cont_pid: None,
        };
        let hs: Vec<_> = (0..NODES.len())
            .map(|i| {
                let mp = if i == 1 {
                    node2_mp.clone()
                } else {
                    c.n(i).path().to_path_buf()
                };
                let (stop, killed) = (&stop, &killed);
                s.spawn(move || storm(i, &mp, seed ^ mix(i as u64), far, stop, killed))
            })
            .collect();
        {
            let (mp, stop, killed, d, e) = (&node2_mp, &stop, &killed, &durables, &dur_errors);
            s.spawn(move || durable_writer(mp, seed ^ 0xD0, stop, killed, d, e));
        }
        std::thread::sleep(kill_after);
        killed.store(true, Ordering::SeqCst);
        let t_kill = Instant::now();
        let st = node2
            .take()
            .expect("node2")
            .abandon(Some(libc::SIGKILL))
            .unwrap_or_else(|e| panic!("killing node2: {e}"));
        eprintln!(
            "sigkill_recovery: node2 (pid {node2_pid}) SIGKILLed after {} of storm: {st:?}; \
             {} fsync'd files so far",
            secs(kill_after),
            durables.lock().expect("durables").len()
        );
        // The survivors keep storming while one of them recovers node2.
        let limit = DEAD_TIME + RECOVERY_SLACK;
        let mut found = None;
        let waited = poll_until(limit + Duration::from_secs(20), || {
            found = c.recovered_line(&[0, 2], "node2");
            found.is_some()
        });
        if let (Some(_), Some((i, line))) = (waited, found) {
            recovery = Some((t_kill.elapsed(), i, line));
        }
        // A little more survivor work after the recovery.
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::SeqCst);
        hs.into_iter()
            .map(|h| h.join().expect("storm thread panicked"))
            .collect()
    });

    let limit = DEAD_TIME + RECOVERY_SLACK;
    let (took, by, line) = recovery.unwrap_or_else(|| {
        panic!(
            "seed {seed}: neither node1 nor node3 logged that it recovered node2 within {} of \
             the kill (bound: dead time {} + {})",
            secs(limit + Duration::from_secs(20)),
            secs(DEAD_TIME),
            secs(RECOVERY_SLACK)
        )
    });
    eprintln!(
        "sigkill_recovery: {} recovered node2 {} after the kill (dead time {}, so replay etc. \
         took ~{}): {line}",
        NODES[by],
        secs(took),
        secs(DEAD_TIME),
        secs(took.saturating_sub(DEAD_TIME))
    );
    assert!(
        took <= limit,
        "recovery of node2 took {} > dead time {} + {}",
        secs(took),
        secs(DEAD_TIME),
        secs(RECOVERY_SLACK)
    );

    let mut errors: Vec<String> = outs.iter().flat_map(|o| o.errors.clone()).collect();
    errors.extend(dur_errors.lock().expect("errors").iter().cloned());
    assert!(
        errors.is_empty(),
        "seed {seed}: operations failed (survivors at any time, node2 before its kill):\n  {}",
        errors.join("\n  ")
    );
    for (i, o) in outs.iter().enumerate() {
        eprintln!(
            "sigkill_recovery: {}: {} ops{}",
            NODES[i],
            o.ops,
            if i == 1 {
                format!(
                    " ({} failed after the kill, as expected)",
                    o.errors_after_kill
                )
            } else {
                String::new()
            }
        );
    }
    let files = durables.lock().expect("durables").clone();
    assert!(
        !files.is_empty(),
        "node2 completed no fsync'd file in {} before the kill: nothing to check",
        secs(kill_after)
    );

    // Survivors: their own names exactly, node2's names (unsynced) only consistently.
    let survivors: Vec<&Model> = vec![&outs[0].model, &outs[2].model];
    check_listings(&c, &[0, 2], &survivors, Some("node2-"));
    let v = check_durables(&c, 0, &files);
    assert!(
        v.is_empty(),
        "fsync'd files of node2 lost:\n  {}",
        v.join("\n  ")
    );
    eprintln!(
        "sigkill_recovery: all {} fsync'd files of node2 intact on node1",
        files.len()
    );

    // The killed node mounts again under its own name and sees the same.
    c.mount(1, &[], &[]);
    let v = check_durables(&c, 1, &files);
    assert!(
        v.is_empty(),
        "after remounting node2:\n  {}",
        v.join("\n  ")
    );
    check_listings(&c, &[0, 1, 2], &survivors, Some("node2-"));
    c.unmount_all_and_fsck();
}

// ---------------------------------------------------------------------------------------------
// 4b. A thin image grown without the global lock (fs/detached.rs), its node SIGKILLed

const THIN_SIZE: u64 = 1 << 30;
const THIN_STRIDE: u64 = 256 << 10;

/// node2 grows a sparse image by scattered `O_DIRECT` writes (each a new allocation, most of
/// them from its block pool without the global lock) and fsyncs every 16, while node1 keeps
/// the global lock busy with creates; node2 is SIGKILLed. Every fsync'd block must read back
/// on node1 after the recovery, and the volume must check clean once node2 mounted again
/// (its pool, an orphan of its slot, freed).
#[test]
fn thin_image_grown_without_the_global_lock_survives_sigkill() {
    require_fuse!();
    let _serial = serial();
    let seed = seed("thin_image_sigkill");
    let mut c = Cluster::start("thin_image_sigkill");
    let img = "thin.img";
    fs::File::create(c.n(1).p(img))
        .and_then(|f| f.set_len(THIN_SIZE))
        .expect("create the thin image on node2");
    wait_visible_everywhere(&c, img);
    let stop = AtomicBool::new(false);
    let killed = AtomicBool::new(false);
    // Every write node2 issued, in order, and how many of them an fsync covered.
    let attempted: Mutex<(Vec<(u64, u64)>, usize)> = Mutex::new((Vec::new(), 0));
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut node2 = Some(c.take(1));
    let node2_img = node2.as_ref().expect("node2").path().join(img);
    let node1_mp = c.n(0).path().to_path_buf();
    let t_kill = std::thread::scope(|s| {
        let (stop_r, errors_r) = (&stop, &errors);
        s.spawn(move || {
            for n in 0u64.. {
                if stop_r.load(Ordering::SeqCst) {
                    return;
                }
                if let Err(e) = fs::write(node1_mp.join(format!("busy-{n}")), b"x") {
                    errors_r
                        .lock()
                        .expect("errors")
                        .push(io_err("node1 create", &e));
                    return;
                }
            }
        });
        let (stop_w, killed_w, attempted_w, errors_w, path) =
            (&stop, &killed, &attempted, &errors, node2_img.clone());
        s.spawn(move || {
            let mut rng = StdRng::seed_from_u64(seed);
            let f = match open_direct(&path, true, false) {
                Ok(f) => f,
                Err(e) => {
                    errors_w.lock().expect("errors").push(io_err("open", &e));
                    return;
                }
            };
            let mut buf = AlignedBuf::new(BLK);
            for i in 0u64.. {
                if stop_w.load(Ordering::SeqCst) {
                    return;
                }
                let off = rng.gen_range(0..THIN_SIZE / THIN_STRIDE) * THIN_STRIDE;
                let key = mix(seed ^ i);
                fill(key, &mut buf);
                let n = {
                    let mut a = attempted_w.lock().expect("attempted");
                    a.0.push((off, key));
                    a.0.len()
                };
                let r = f.write_all_at(&buf, off).and_then(|()| {
                    if n % 16 == 0 {
                        f.sync_all()?;
                        attempted_w.lock().expect("attempted").1 = n;
                    }
                    Ok(())
                });
                if let Err(e) = r {
                    if !killed_w.load(Ordering::SeqCst) {
                        errors_w
                            .lock()
                            .expect("errors")
                            .push(io_err(&format!("node2 write at {off}"), &e));
                    }
                    return;
                }
            }
        });
        std::thread::sleep(Duration::from_secs(3));
        killed.store(true, Ordering::SeqCst);
        let t = Instant::now();
        let st = node2
            .take()
            .expect("node2")
            .abandon(Some(libc::SIGKILL))
            .unwrap_or_else(|e| panic!("killing node2: {e}"));
        eprintln!("thin_image_sigkill: node2 SIGKILLed: {st:?}");
        stop.store(true, Ordering::SeqCst);
        t
    });
    let errs = errors.lock().expect("errors").clone();
    assert!(errs.is_empty(), "seed {seed}:\n  {}", errs.join("\n  "));
    let limit = DEAD_TIME + RECOVERY_SLACK;
    let waited = poll_until(limit + Duration::from_secs(20), || {
        c.recovered_line(&[0, 2], "node2").is_some()
    });
    assert!(
        waited.is_some(),
        "nobody recovered node2 within {}",
        secs(t_kill.elapsed())
    );
    let (all, synced) = attempted.into_inner().expect("attempted");
    assert!(
        synced >= 16,
        "node2 fsync'd only {synced} writes in 3 s: nothing to check"
    );
    // A block holds its last fsync'd write, or a later write to it (not fsync'd, or in
    // flight at the kill: it may have reached the disk).
    let mut last = BTreeMap::new();
    for (i, (off, _)) in all[..synced].iter().enumerate() {
        last.insert(*off, i);
    }
    let f = open_direct(&c.n(0).p(img), false, false).expect("open the image on node1");
    let mut buf = AlignedBuf::new(BLK);
    let mut bad = Vec::new();
    for (off, &i) in &last {
        let ok: Vec<u64> = all[i..]
            .iter()
            .filter(|w| w.0 == *off)
            .map(|w| w.1)
            .collect();
        match f.read_exact_at(&mut buf, *off) {
            Ok(()) if ok.iter().any(|&k| buf[..] == pattern(k, BLK)[..]) => {}
            Ok(()) => bad.push(format!("block at {off}: other contents")),
            Err(e) => bad.push(io_err(&format!("read at {off}"), &e)),
        }
    }
    assert!(
        bad.is_empty(),
        "seed {seed}: fsync'd blocks of node2 lost ({} of {}):\n  {}",
        bad.len(),
        last.len(),
        bad.join("\n  ")
    );
    eprintln!(
        "thin_image_sigkill: {synced} fsync'd writes ({} blocks) of node2 intact on node1",
        last.len()
    );
    drop(f);
    c.mount(1, &[], &[]);
    c.unmount_all_and_fsck();
}

// ---------------------------------------------------------------------------------------------
// 5. SIGSTOP past the dead time: the resumed node fences before writing

#[derive(Debug, Clone)]
struct WriteAttempt {
    start_ns: u128,
    end_ns: u128,
    block: usize,
    result: Result<(), i32>,
}

const FENCE_IMAGE_BLOCKS: usize = 2048;

#[test]
fn sigstop_fencing() {
    require_fuse!();
    let _serial = serial();
    let seed = seed("sigstop_fencing");
    let mut c = Cluster::formatted("sigstop_fencing", "8");
    c.mount(0, &[], &[]);
    let wl = write_log_path(&c, 1);
    let wl_s = wl.to_string_lossy().into_owned();
    c.mount(1, &[], &[("CETRA_WRITE_LOG", wl_s.as_str())]);
    c.mount(2, &[], &[]);
    let node2_pid = c.n(1).pid();
    for i in [0, 2] {
        fs::create_dir(c.n(i).p(format!("work-{}", NODES[i]))).expect("mkdir work dir");
    }

    // node2's image, fully written (allocated) before the test starts.
    let img = c.n(1).p("img-node2");
    {
        let f = open_direct(&img, true, true).expect("create node2 image");
        let mut buf = AlignedBuf::new(FENCE_IMAGE_BLOCKS * BLK);
        fill(7, &mut buf);
        f.write_all_at(&buf, 0).expect("write node2 image");
        f.sync_all().expect("fsync node2 image");
    }
    let f_img = open_direct(&img, true, false).expect("open node2 image");

    let stop = AtomicBool::new(false);
    let attempts: Mutex<Vec<WriteAttempt>> = Mutex::new(Vec::new());
    let survivor_files: Mutex<Vec<(usize, Durable)>> = Mutex::new(Vec::new());
    let survivor_errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let survivor_ops = AtomicU64::new(0);
    let mut t_stop = 0u128;
    let mut t_resume = 0u128;
    let mut recovered: Option<(Duration, usize, String)> = None;

    std::thread::scope(|s| {
        let _guard = StopGuard {
            stop: &stop,
            cont_pid: Some(node2_pid),
        };
        // node2's writer: O_DIRECT 4 KiB writes in a loop; errors are expected once fenced.
        {
            let (f, stop, attempts) = (&f_img, &stop, &attempts);
            s.spawn(move || {
                let mut rng = StdRng::seed_from_u64(seed);
                let mut one = AlignedBuf::new(BLK);
                let mut it = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    it += 1;
                    let b = rng.gen_range(0..FENCE_IMAGE_BLOCKS);
                    fill(mix(it), &mut one);
                    let start_ns = realtime_ns();
                    let r = f.write_all_at(&one, (b * BLK) as u64);
                    let end_ns = realtime_ns();
                    let failed = r.is_err();
                    attempts.lock().expect("attempts").push(WriteAttempt {
                        start_ns,
                        end_ns,
                        block: b,
                        result: r.map_err(|e| errno_of(&e)),
                    });
                    if failed {
                        std::thread::sleep(Duration::from_millis(50));
                    } else if it.is_multiple_of(64) {
                        let _ = f.sync_data();
                    }
                }
            });
        }
        // Survivors keep working: fsync'd files in their own directories.
        for i in [0, 2] {
            let mp = c.n(i).path().to_path_buf();
            let (stop, files, errors, ops) =
                (&stop, &survivor_files, &survivor_errors, &survivor_ops);
            s.spawn(move || {
                let dir = mp.join(format!("work-{}", NODES[i]));
                let mut rng = StdRng::seed_from_u64(seed ^ mix(i as u64));
                for n in 0u64.. {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let d = Durable {
                        name: format!("f{n}"),
                        key: mix((i as u64) << 32 | n),
                        len: rng.gen_range(1..=20_000),
                    };
                    let r = (|| -> io::Result<()> {
                        let mut f = fs::File::create_new(dir.join(&d.name))?;
                        f.write_all(&pattern(d.key, d.len))?;
                        f.sync_all()
                    })();
                    ops.fetch_add(1, Ordering::Relaxed);
                    match r {
                        Ok(()) => files.lock().expect("files").push((i, d)),
                        Err(e) => {
                            errors
                                .lock()
                                .expect("errors")
                                .push(io_err(&format!("{} creating {}", NODES[i], d.name), &e));
                            return;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            });
        }
        std::thread::sleep(Duration::from_secs(2));
        t_stop = realtime_ns();
        c.n(1).signal(libc::SIGSTOP).expect("SIGSTOP node2");
        let stopped = Instant::now();
        let ops_at_stop = survivor_ops.load(Ordering::Relaxed);
        std::thread::sleep(DEAD_TIME + Duration::from_secs(3));
        let mut found = None;
        let waited = poll_until(RECOVERY_SLACK, || {
            found = c.recovered_line(&[0, 2], "node2");
            found.is_some()
        });
        if let (Some(_), Some((i, line))) = (waited, found) {
            recovered = Some((stopped.elapsed(), i, line));
        }
        eprintln!(
            "sigstop_fencing: survivors did {} ops while node2 was stopped",
            survivor_ops.load(Ordering::Relaxed) - ops_at_stop
        );
        t_resume = realtime_ns();
        c.n(1).signal(libc::SIGCONT).expect("SIGCONT node2");
        // Let the writer run into the fence.
        let fenced_seen = poll_until(Duration::from_secs(10), || {
            c.log_of(1).to_lowercase().contains("fenced")
                && attempts
                    .lock()
                    .expect("attempts")
                    .iter()
                    .any(|a| a.start_ns > t_resume && a.result.is_err())
        });
        if fenced_seen.is_none() {
            eprintln!(
                "sigstop_fencing: node2 did not log a fence / fail a write within 10 s of SIGCONT"
            );
        }
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::SeqCst);
    });

    let (took, by, line) = recovered.unwrap_or_else(|| {
        panic!(
            "seed {seed}: no survivor logged that it recovered node2 within {} of SIGSTOP",
            secs(DEAD_TIME + Duration::from_secs(3) + RECOVERY_SLACK)
        )
    });
    eprintln!(
        "sigstop_fencing: {} recovered node2 (≤ {} after SIGSTOP): {line}",
        NODES[by],
        secs(took)
    );

    // 1. The device write log: node2 wrote before the stop, and nothing it issued after SIGCONT.
    let lines = read_write_log(&wl);
    let own: Vec<&WriteLogLine> = lines
        .iter()
        .filter(|l| l.pid == u32::try_from(node2_pid).expect("pid"))
        .collect();
    let before = own.iter().filter(|l| l.time_ns < t_stop).count();
    assert!(
        before > 0,
        "the write log {} holds no write of node2 (pid {node2_pid}) before SIGSTOP ({} lines in \
         all): CETRA_WRITE_LOG is not honoured, the check below would prove nothing",
        wl.display(),
        lines.len()
    );
    let after: Vec<String> = own
        .iter()
        .filter(|l| l.time_ns > t_resume)
        .map(|l| {
            format!(
                "{:?} at byte {} len {}, {} ms after SIGCONT",
                l.kind,
                l.offset,
                l.len,
                (l.time_ns - t_resume) / 1_000_000
            )
        })
        .collect();
    eprintln!(
        "sigstop_fencing: node2's write log: {} writes before SIGSTOP, {} issued after SIGCONT",
        before,
        after.len()
    );
    assert!(
        after.is_empty(),
        "node2 issued {} device writes after it was resumed (its slot had been recovered; it \
         must fence before writing):\n  {}",
        after.len(),
        after
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n  ")
    );

    // 2. It says it fenced.
    let log2 = c.log_of(1);
    let fence_line = log2
        .lines()
        .find(|l| l.to_lowercase().contains("fenced"))
        .unwrap_or_else(|| panic!("node2's log does not say that it fenced itself"));
    eprintln!("sigstop_fencing: node2: {fence_line}");

    // 3. Its writes fail: none issued after the resume succeeded, and a new one fails with EIO.
    let attempts = attempts.into_inner().expect("attempts");
    let ok_after: Vec<&WriteAttempt> = attempts
        .iter()
        .filter(|a| a.start_ns > t_resume && a.result.is_ok())
        .collect();
    let failed_after = attempts
        .iter()
        .filter(|a| a.start_ns > t_resume && a.result.is_err())
        .count();
    let in_flight = attempts
        .iter()
        .filter(|a| a.start_ns <= t_stop && a.end_ns > t_resume)
        .map(|a| format!("block {} -> {:?}", a.block, a.result.map_err(errno_name)))
        .collect::<Vec<_>>();
    eprintln!(
        "sigstop_fencing: node2 writer: {} writes, {failed_after} failed after SIGCONT, in flight \
         across the stop: {in_flight:?}",
        attempts.len()
    );
    assert!(
        ok_after.is_empty(),
        "{} O_DIRECT writes on node2 issued after SIGCONT succeeded (first: block {})",
        ok_after.len(),
        ok_after[0].block
    );
    let mut one = AlignedBuf::new(BLK);
    fill(99, &mut one);
    match f_img.write_all_at(&one, 0) {
        Ok(()) => panic!("a write on fenced node2 succeeded"),
        Err(e) => assert_eq!(
            errno_of(&e),
            libc::EIO,
            "a write on fenced node2 failed with {e}, expected EIO"
        ),
    }
    let create = fs::File::create_new(c.n(1).p("after-fence"))
        .and_then(|mut f| f.write_all(b"x").and_then(|()| f.sync_all()));
    match create {
        Ok(()) => panic!("creating and fsyncing a file on fenced node2 succeeded"),
        Err(e) => eprintln!("sigstop_fencing: create on fenced node2: {e} (as expected)"),
    }
    drop(f_img);

    // 4. Survivors' work is intact, read from both survivors.
    let errs = survivor_errors.into_inner().expect("errors");
    assert!(
        errs.is_empty(),
        "survivors failed:\n  {}",
        errs.join("\n  ")
    );
    let files = survivor_files.into_inner().expect("files");
    let mut v = Vec::new();
    for reader in [0, 2] {
        for (owner, d) in &files {
            let p = c.n(reader).p(format!("work-{}/{}", NODES[*owner], d.name));
            if let Err(e) = expect_content(&p, &pattern(d.key, d.len)) {
                v.push(format!("on {}: {e}", NODES[reader]));
            }
        }
    }
    assert!(
        v.is_empty(),
        "survivors' data does not verify:\n  {}",
        v.join("\n  ")
    );
    eprintln!(
        "sigstop_fencing: {} survivor files verify on node1 and node3",
        files.len()
    );

    // 5. Unmount the fenced node (its exit status is its business), then the rest; fsck.
    // Its log says FENCED once (intended here); everything that follows from it, such as the
    // unmount that cannot flush, is logged below ERROR.
    let mut fenced = c.take(1);
    fenced.allow_error("FENCED: ");
    let st = fenced
        .unmount_any_status()
        .unwrap_or_else(|e| panic!("unmounting fenced node2: {e}"));
    eprintln!("sigstop_fencing: fenced node2 unmounted, daemon {st:?}");
    c.unmount_all_and_fsck();
}

// ---------------------------------------------------------------------------------------------
// 6. The recoverer dies between recovery steps; another node finishes

#[test]
fn recoverer_killed_mid_recovery() {
    require_fuse!();
    let _serial = serial();
    let seed = seed("recoverer_killed_mid_recovery");
    let mut c = Cluster::formatted("recoverer_killed_mid_recovery", "8");
    c.mount(0, &[], &[FAILPOINT_ENV]);
    c.mount(1, &[], &[]);
    c.mount(2, &[], &[]);
    // Everyone works a little; node3's work is fsync'd.
    for i in 0..NODES.len() {
        fs::create_dir(c.n(i).p(format!("w-{}", NODES[i]))).expect("mkdir");
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut files = Vec::new();
    for n in 0..40u64 {
        let d = Durable {
            name: format!("f{n}"),
            key: mix(seed ^ n),
            len: rng.gen_range(1..=30_000),
        };
        for i in 0..NODES.len() {
            let p = c.n(i).p(format!("w-{}/{}", NODES[i], d.name));
            let mut f = fs::File::create_new(&p).expect("create");
            f.write_all(&pattern(d.key ^ i as u64, d.len))
                .expect("write");
            if i == 2 {
                f.sync_all().expect("fsync on node3");
            }
        }
        if n % 7 == 3 {
            let from = c.n(2).p(format!("w-node3/{}", d.name));
            let to = c.n(2).p(format!("w-node3/r{n}"));
            fs::rename(&from, &to).expect("rename on node3");
            files.push(Durable {
                name: format!("r{n}"),
                key: d.key ^ 2,
                len: d.len,
            });
        } else {
            files.push(Durable {
                name: d.name.clone(),
                key: d.key ^ 2,
                len: d.len,
            });
        }
    }
    fsync_dir(&c.n(2).p("w-node3")).expect("fsync w-node3 on node3");
    // Unsynced metadata work in node3's journal too.
    for n in 0..20 {
        let _ = fs::File::create_new(c.n(2).p(format!("w-node3/unsynced{n}")));
    }
    // node2 steps aside (clean unmount) so that node1, the node with the failpoint, is the only
    // survivor and certainly the one that starts node3's recovery; it comes back to finish it.
    c.take(1).unmount();

    let t_kill = Instant::now();
    let st = c
        .take(2)
        .abandon(Some(libc::SIGKILL))
        .unwrap_or_else(|e| panic!("killing node3: {e}"));
    eprintln!("recoverer_killed_mid_recovery: node3 SIGKILLed ({st:?})");

    // node1 starts recovering node3 and dies at the failpoint.
    let limit1 = DEAD_TIME + RECOVERY_SLACK;
    let ex = c.n(0).wait_exit(limit1);
    let t_node1_exit = Instant::now();
    match ex {
        Some(Exit::Code(FAILPOINT_EXIT_CODE)) => eprintln!(
            "recoverer_killed_mid_recovery: node1 exited at the failpoint {} after the kill",
            secs(t_kill.elapsed())
        ),
        other => panic!(
            "node1 (env {}={}) did not exit with code {FAILPOINT_EXIT_CODE} at the recovery \
             failpoint within {} of node3's kill: {other:?} (None = still running){}",
            FAILPOINT_ENV.0,
            FAILPOINT_ENV.1,
            secs(limit1),
            if c.recovered_line(&[0], "node3").is_some() {
                "; node1 logged a completed recovery of node3: the failpoint is not implemented"
            } else {
                ""
            }
        ),
    }
    let mut node1 = c.take(0);
    node1.allow_error("failpoint recovery::after_replay: exiting as requested by CETRA_FAILPOINT");
    node1
        .abandon(None)
        .unwrap_or_else(|e| panic!("detaching node1's dead mount: {e}"));

    // node2 comes back and must finish node3's recovery (and recover node1).
    c.mount(1, &[], &[]);
    let limit2 = DEAD_TIME * 2 + RECOVERY_SLACK;
    let mut found = None;
    let waited = poll_until(limit2, || {
        found = c.recovered_line(&[1], "node3");
        found.is_some()
    });
    let (_, line) = found.unwrap_or_else(|| {
        panic!(
            "node2 did not log that it recovered node3 within {} of node1's death",
            secs(limit2)
        )
    });
    let waited = waited.expect("found");
    eprintln!(
        "recoverer_killed_mid_recovery: node2 finished node3's recovery {} after node1 died \
         ({} after its mount): {line}",
        secs(t_node1_exit.elapsed()),
        secs(waited)
    );
    let t = poll_until(limit2, || c.recovered_line(&[1], "node1").is_some());
    assert!(
        t.is_some(),
        "node2 did not log that it recovered node1 (the recoverer that died) within {}",
        secs(limit2)
    );

    let check = |c: &Cluster, reader: usize| -> Vec<String> {
        files
            .iter()
            .filter_map(|d| {
                let p = c.n(reader).p(format!("w-node3/{}", d.name));
                expect_content(&p, &pattern(d.key, d.len))
                    .err()
                    .map(|e| format!("on {}: {e}", NODES[reader]))
            })
            .collect()
    };
    let v = check(&c, 1);
    assert!(
        v.is_empty(),
        "node3's fsync'd work lost:\n  {}",
        v.join("\n  ")
    );
    c.unmount_all_and_fsck();

    // The dead nodes can mount again.
    c.mount(2, &[], &[]);
    c.mount(0, &[], &[]);
    c.mount(1, &[], &[]);
    for reader in 0..NODES.len() {
        let v = check(&c, reader);
        assert!(v.is_empty(), "after remounting:\n  {}", v.join("\n  "));
    }
    c.unmount_all_and_fsck();
}

// ---------------------------------------------------------------------------------------------
// 7. Duplicate identity and full slots

#[test]
fn duplicate_identity_refused() {
    require_fuse!();
    let _serial = serial();
    let c = Cluster::start("duplicate_identity_refused");
    for (i, host) in NODES.iter().enumerate().take(2) {
        let mp = c.lun.dir().join(format!("mnt-{host}-dup"));
        match Mount::try_new(c.lun.path(), &mp, host, &[]) {
            Ok(m) => {
                drop(m);
                panic!("a second daemon with host={host} mounted while {host} is mounted");
            }
            Err(r) => {
                let out = r.output();
                eprintln!(
                    "duplicate_identity_refused: second {host}: exit {}: {}",
                    r.code,
                    out.lines().next().unwrap_or("")
                );
                assert!(
                    out.contains("already"),
                    "refusal of a second {host} does not say \"already\": {r}"
                );
            }
        }
        // The original is unharmed.
        fs::write(c.n(i).p(format!("still-{host}")), b"ok").expect("original node still works");
    }
    let mut c = c;
    c.unmount_all_and_fsck();

    // All slots taken: mkfs -N 2, two nodes mounted, the third refused.
    let mut c = Cluster::formatted("duplicate_identity_refused (slots)", "2");
    c.mount(0, &[], &[]);
    c.mount(1, &[], &[]);
    match c.try_mount(2, &[], &[]) {
        Ok(()) => panic!("a third node mounted a volume made with -N 2 while two are mounted"),
        Err(e) => {
            eprintln!("duplicate_identity_refused: third node on -N 2: {e}");
            let first = e.to_lowercase();
            assert!(
                first.contains("slot"),
                "the refusal of a third node on a 2-slot volume does not mention slots: {e}"
            );
        }
    }
    c.unmount_all_and_fsck();
}

/// Machine identities for `CETRA_MACHINE_ID` (cetrafs-core/src/cluster/machine.rs).
const MACHINE_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const MACHINE_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

/// The heartbeat slots of `lun`, raw, as the superblock places them.
fn heartbeat_slots(lun: &Lun) -> Vec<Vec<u8>> {
    use cetrafs_core::format::superblock::Superblock;
    let sb = Superblock::decode(&lun.peek(0, BLK)).expect("superblock");
    let lbs = usize::try_from(sb.logical_block_size).expect("lbs");
    let area = lun.peek(
        sb.hb_start * BLK as u64,
        usize::try_from(sb.hb_blocks).expect("hb blocks") * BLK,
    );
    area.chunks(lbs)
        .take(usize::try_from(sb.hb_slots).expect("slots"))
        .map(<[u8]>::to_vec)
        .collect()
}

/// Who holds each decodable slot: (slot, host, state, machine id).
fn slot_holders(
    lun: &Lun,
) -> Vec<(
    usize,
    String,
    cetrafs_core::format::heartbeat::SlotState,
    String,
)> {
    use cetrafs_core::format::heartbeat::Heartbeat;
    heartbeat_slots(lun)
        .iter()
        .enumerate()
        .filter_map(|(i, raw)| {
            Heartbeat::decode(raw)
                .ok()
                .flatten()
                .map(|h| (i, h.host, h.state, h.machine.to_string()))
        })
        .collect()
}

/// A single-host volume (made on a file: no SCSI COMPARE AND WRITE) is mounted from one
/// machine at a time (issue 10 item 3): with node1 mounted as machine A, node2 as machine B is
/// refused with a message naming node1 and machine A and saying why and what to do, and writes
/// nothing; node2 as machine A mounts; once both unmount cleanly, node3 as machine B mounts.
#[test]
fn single_host_volume_refuses_a_second_machine() {
    require_fuse!();
    let _serial = serial();
    let mut c = Cluster::formatted("single_host_volume_refuses_a_second_machine", "8");
    {
        use cetrafs_core::format::superblock::{SharingMode, Superblock};
        let sb = Superblock::decode(&c.lun.peek(0, BLK)).expect("superblock");
        assert_eq!(sb.format_version(), 8);
        assert_eq!(sb.sharing, Some(SharingMode::SingleHost), "mkfs on a file");
    }
    let on = |m: &'static str| [("CETRA_MACHINE_ID", m)];
    c.mount(0, &[], &on(MACHINE_A));
    assert!(
        slot_holders(&c.lun)
            .iter()
            .any(|(_, h, _, m)| h == "node1" && m == MACHINE_A),
        "node1's slot carries machine A: {:?}",
        slot_holders(&c.lun)
    );

    let refuse = |c: &mut Cluster, i: usize, holders: &[&str]| {
        let before = heartbeat_slots(&c.lun);
        let t = Instant::now();
        let e = match c.try_mount(i, &[], &on(MACHINE_B)) {
            Ok(()) => panic!(
                "{} mounted as machine B while {holders:?} (machine A) hold the single-host volume",
                NODES[i]
            ),
            Err(e) => e,
        };
        eprintln!(
            "single_host_volume_refuses_a_second_machine: {} as machine B refused after {}",
            NODES[i],
            secs(t.elapsed())
        );
        for want in [
            "single-host volume is mounted on another machine",
            MACHINE_A,
            MACHINE_B,
            "without SCSI COMPARE AND WRITE",
            "Unmount it there",
            "docs/san.md",
        ] {
            assert!(e.contains(want), "the refusal does not say {want:?}: {e}");
        }
        for h in holders {
            assert!(
                e.contains(&format!("node \"{h}\"")),
                "the refusal does not name {h}: {e}"
            );
        }
        // Nothing written: every slot but the holders' (which renew) is byte-identical, and
        // no slot names the refused node or machine B.
        let after = heartbeat_slots(&c.lun);
        let holding: Vec<usize> = slot_holders(&c.lun)
            .into_iter()
            .filter(|(_, h, _, _)| holders.contains(&h.as_str()))
            .map(|(s, ..)| s)
            .collect();
        for (s, (b, a)) in before.iter().zip(&after).enumerate() {
            assert!(
                holding.contains(&s) || b == a,
                "heartbeat slot {s} changed during the refused mount"
            );
        }
        assert!(
            !slot_holders(&c.lun)
                .iter()
                .any(|(_, h, _, m)| h == NODES[i] || m == MACHINE_B),
            "the refused mount left a slot: {:?}",
            slot_holders(&c.lun)
        );
    };
    refuse(&mut c, 1, &["node1"]);
    // The same machine: welcome.
    c.mount(1, &[], &on(MACHINE_A));
    fs::write(c.n(1).p("from-node2"), b"same machine").expect("node2 writes");
    refuse(&mut c, 2, &["node1", "node2"]);

    // Both unmount cleanly: machine B may have the volume now.
    c.unmount_all();
    c.mount(2, &[], &on(MACHINE_B));
    assert_eq!(
        fs::read(c.n(2).p("from-node2")).expect("read on machine B"),
        b"same machine"
    );
    assert!(slot_holders(&c.lun).iter().any(|(_, h, st, m)| h == "node3"
        && *st == cetrafs_core::format::heartbeat::SlotState::Live
        && m == MACHINE_B));
    // And now machine A is the second machine.
    let e = c
        .try_mount(0, &[], &on(MACHINE_A))
        .expect_err("node1 as machine A mounted while node3 (machine B) holds the volume");
    assert!(e.contains("\"node3\"") && e.contains(MACHINE_B), "{e}");
    c.unmount_all_and_fsck();
}

/// `fence=`: on a LUN without SCSI-3 persistent reservations (a file) `fence=pr` is refused
/// before anything is written, with a message that says what to use instead; a bad value is a
/// usage error; `auto` (the default) and `none` mount and log the fencing they chose.
#[test]
fn fence_pr_needs_persistent_reservations() {
    require_fuse!();
    let _serial = serial();
    let mut c = Cluster::formatted("fence_pr_needs_persistent_reservations", "8");
    let before = heartbeat_slots(&c.lun);
    let e = c
        .try_mount(0, &["fence=pr"], &[])
        .expect_err("fence=pr mounted a file LUN");
    for want in [
        "fence=pr",
        "persistent reservations",
        "not a SCSI LUN",
        "fence=auto",
    ] {
        assert!(e.contains(want), "the refusal does not say {want:?}: {e}");
    }
    assert_eq!(
        heartbeat_slots(&c.lun),
        before,
        "the refused mount wrote a heartbeat slot"
    );
    let e = c
        .try_mount(0, &["fence=scsi"], &[])
        .expect_err("fence=scsi accepted");
    assert!(
        e.contains("fence=\"scsi\"") && e.contains("auto, pr"),
        "{e}"
    );
    c.mount(0, &[], &[]);
    c.mount(1, &["fence=none"], &[]);
    assert!(
        c.log_of(0)
            .contains("fence=auto: no persistent reservations and no watchdog"),
        "node1's log does not name its fencing:\n{}",
        c.log_of(0)
    );
    assert!(
        c.log_of(1).contains("fence=none: software fencing only"),
        "node2's log does not name its fencing:\n{}",
        c.log_of(1)
    );
    c.unmount_all_and_fsck();
}

/// With persistent reservations a second mount daemon on one host through the device another
/// one uses is refused before any PERSISTENT RESERVE OUT (one registration per initiator
/// port). The finder behind it, `other_daemon_on`, on a real daemon: a loop device over the
/// LUN file stands in for the SCSI node (device numbers are compared, and daemons re-execute
/// themselves, so their `comm` is `exe`); the LIO scenario runs the refusal itself.
#[test]
fn a_second_daemon_on_the_same_device_is_found() {
    use cetrafs_core::cluster::reservation::other_daemon_on;
    require_fuse!();
    let _serial = serial();
    let c = Cluster::formatted("a_second_daemon_on_the_same_device_is_found", "8");
    let losetup = |args: &[&str]| {
        let r = cetrafs_tests::run(std::process::Command::new("losetup").args(args));
        assert_eq!(r.code, 0, "losetup {args:?}: {r}");
        r.stdout.trim().to_string()
    };
    let lun = c.lun.path().to_string_lossy().into_owned();
    let other_file = c.lun.dir().join("other.img");
    fs::write(&other_file, vec![0u8; 1 << 20]).expect("other.img");
    let loop_lun = PathBuf::from(losetup(&["-f", "--show", &lun]));
    let loop_other = PathBuf::from(losetup(&["-f", "--show", &other_file.to_string_lossy()]));
    assert_eq!(
        other_daemon_on(std::slice::from_ref(&loop_lun)),
        None,
        "nothing mounted yet"
    );
    let m = Mount::try_new_env(&loop_lun, &c.mountpoint(0), NODES[0], &[], &[])
        .unwrap_or_else(|e| panic!("mount through {}: {e}", loop_lun.display()));
    let found = other_daemon_on(&[loop_other.clone(), loop_lun.clone()]);
    let missed = other_daemon_on(std::slice::from_ref(&loop_other));
    m.unmount();
    losetup(&["-d", &loop_lun.to_string_lossy()]);
    losetup(&["-d", &loop_other.to_string_lossy()]);
    assert_eq!(
        found.as_ref().map(|(_, d)| d),
        Some(&loop_lun),
        "the daemon using {} was not found: {found:?}",
        loop_lun.display()
    );
    assert!(found.is_some_and(|(pid, _)| pid > 0));
    assert_eq!(missed, None, "a device no daemon uses");
}

// ---------------------------------------------------------------------------------------------
// 8. Per-file open locks

fn open_w(p: &Path) -> io::Result<fs::File> {
    fs::OpenOptions::new().write(true).open(p)
}

#[test]
fn open_locks() {
    require_fuse!();
    let _serial = serial();
    let mut c = Cluster::start("open_locks");
    let f1 = fs::File::create_new(c.n(0).p("f")).expect("create f on node1");
    f1.sync_all().expect("fsync f");
    wait_visible_everywhere(&c, "f");

    let log_before = c.log_of(1).len();
    match open_w(&c.n(1).p("f")) {
        Ok(_) => panic!("node2 opened f for writing while node1 has it open for writing"),
        Err(e) => assert_eq!(
            errno_of(&e),
            libc::EBUSY,
            "node2's write open of f failed with {e}, expected EBUSY (16)"
        ),
    }
    // The refusal is logged with the holder's host name.
    let mut line = None;
    poll_until(Duration::from_secs(2), || {
        let log = c.log_of(1);
        line = log
            .get(log_before..)
            .and_then(|s| s.lines().find(|l| l.contains("node1")).map(str::to_string));
        line.is_some()
    });
    let line = line.unwrap_or_else(|| {
        panic!("node2's log has no line naming the holder node1 after the EBUSY open")
    });
    eprintln!("open_locks: node2 logged: {line}");
    let r = fs::File::open(c.n(1).p("f")).expect("node2 read-only open while node1 writes");
    drop(r);
    fs::File::open(c.n(2).p("f")).expect("node3 read-only open while node1 writes");

    drop(f1);
    let mut last = None;
    let t = poll_until(RELEASE_WITHIN, || match open_w(&c.n(1).p("f")) {
        Ok(f) => {
            drop(f);
            true
        }
        Err(e) => {
            last = Some(e);
            false
        }
    });
    assert!(
        t.is_some(),
        "node2 still cannot open f for writing {RELEASE_WITHIN:?} after node1 closed it: {last:?}"
    );
    eprintln!(
        "open_locks: node2 could write-open f {} ms after node1 closed it",
        t.expect("t").as_millis()
    );
    c.unmount_all();

    // nofilelock on all nodes: a second writer on another node is allowed.
    for i in 0..NODES.len() {
        c.mount(i, &["nofilelock"], &[]);
    }
    // ... and each such mount says, in its log, what that risks.
    for i in 0..NODES.len() {
        let log = c.n(i).own_log();
        assert!(
            log.lines().any(|l| l.starts_with(" WARN")
                && l.contains("nofilelock: nothing stops a second writer on another node")),
            "node {i} mounted with nofilelock without the warning:\n{log}"
        );
    }
    let w1 = open_w(&c.n(0).p("f")).expect("node1 write open with nofilelock");
    let w2 = open_w(&c.n(1).p("f")).unwrap_or_else(|e| {
        panic!("node2 write open of f while node1 has it open, with nofilelock: {e}")
    });
    w1.write_all_at(b"one", 0).expect("write on node1");
    w1.sync_all().expect("fsync on node1");
    drop(w1);
    drop(w2);
    c.unmount_all_and_fsck();
}

// Keep the fail time in the one place of timing constants even though only DEAD_TIME is used
// in assertions: it documents the margin the sigstop test relies on.
const _: () = assert!(FAIL_TIME.as_millis() < DEAD_TIME.as_millis());

// ---------------------------------------------------------------------------------------------
// 4d. A node that stopped using the global lock gives it back (docs/locking.md §5, "A hold
//     nobody uses"), so its death blocks no other node's metadata change.
// ---------------------------------------------------------------------------------------------

/// A new sparse 512 MiB file at `path` (a thin VM image), open for reading and writing.
fn thin_image(path: &std::path::Path) -> fs::File {
    let img = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    img.set_len(512 << 20)
        .unwrap_or_else(|e| panic!("size {}: {e}", path.display()));
    img
}

/// A 1 GiB LUN with the test timings and 256 MiB groups: the group a node claims holds a
/// whole 64 MiB growth, so no refill of its pool needs a new group (claiming one takes the
/// global lock).
fn lun_with_big_groups() -> Lun {
    lun_with_groups("256M", "8")
}

/// A 1 GiB LUN of format `format` with the test timings, four node slots and groups of
/// `size`.
fn lun_with_groups(size: &str, format: &str) -> Lun {
    let lun = Lun::new(1 << 30);
    let (hb, io) = (HEARTBEAT_MS.to_string(), IO_TIMEOUT_MS.to_string());
    lun.mkfs(&[
        "--heartbeat-interval",
        &hb,
        "--io-timeout",
        &io,
        "-N",
        "4",
        "--group-size",
        size,
        "--format-version",
        format,
    ]);
    lun
}

/// Write every MiB in `mibs` of `img` full of `byte`, then fsync it.
fn grow_mib(img: &fs::File, byte: u8, mibs: std::ops::Range<usize>) {
    let chunk = vec![byte; 1 << 20];
    for i in mibs {
        img.write_all_at(&chunk, (i as u64) << 20)
            .expect("grow the thin image");
    }
    img.sync_all().expect("fsync the thin image");
}

/// Every MiB in `mibs` of `img` is full of `byte`.
fn assert_mib(img: &fs::File, byte: u8, mibs: std::ops::Range<usize>) {
    let mut back = vec![0u8; 1 << 20];
    for i in mibs {
        img.read_exact_at(&mut back, (i as u64) << 20)
            .expect("read the thin image back");
        assert!(back.iter().all(|&b| b == byte), "MiB {i} of the thin image");
    }
}

/// Two nodes on a LUN with big groups, node2 with its durable files to move
/// ([`make_node2_files_to_move`]): the start of a test in which node2 dies holding the global
/// lock.
fn node1_and_a_node2_to_kill() -> (Lun, Mount, Mount) {
    let lun = lun_with_big_groups();
    let node1 = Mount::new(&lun, "node1");
    let node2 = Mount::new(&lun, "node2");
    make_node2_files_to_move(&node2, true);
    (lun, node1, node2)
}

/// node2's directories `a/` and `b/` and the file `a/f` that [`kill_holding_the_global_lock`]
/// moves between them. With `durable`, fsync'd (an fsync commits the node's whole
/// transaction, the directories too): the moves may be lost with node2, but the file is in
/// `a/` or `b/` after its recovery.
fn make_node2_files_to_move(node2: &Mount, durable: bool) {
    for d in ["a", "b"] {
        fs::create_dir(node2.p(d)).expect("mkdir on node2");
    }
    fs::write(node2.p("a/f"), b"f").expect("write a/f on node2");
    if durable {
        fs::File::open(node2.p("a/f"))
            .and_then(|f| f.sync_all())
            .expect("fsync a/f on node2");
    }
}

/// node2 moves `a/f` between `a/` and `b/` `moves` times (each move takes the global lock
/// exclusively) and is SIGKILLed right after the last, still holding the lock: nobody asked
/// for it, and an idle hold goes back only a second after its last use. Returns when.
fn kill_holding_the_global_lock(node2: Mount, moves: usize) -> Instant {
    for i in 0..moves {
        let (from, to) = if i % 2 == 0 {
            ("a/f", "b/f")
        } else {
            ("b/f", "a/f")
        };
        fs::rename(node2.p(from), node2.p(to)).expect("move on node2");
    }
    node2
        .abandon(Some(libc::SIGKILL))
        .expect("kill node2's daemon");
    Instant::now()
}

/// What node1 did (`what`) was done `took` after node2 died holding the global lock: before
/// node2's recovery (printed, and asserted: else it waited for the recovery).
fn assert_done_before_recovery(node1: &Mount, what: &str, took: Duration) {
    let recovered_by_then = has_recovered(node1, "node2");
    eprintln!(
        "{what} done {:.3} s after node2 died holding the global lock (dead time {:.1} s)",
        took.as_secs_f64(),
        DEAD_TIME.as_secs_f64()
    );
    assert!(
        !recovered_by_then,
        "node2 was recovered before {what} were done ({took:?}): they waited for it\n{}",
        node1.log()
    );
}

/// A change on node1 (a mkdir of `rel`) waits for node2's recovery: else node2 did not die
/// holding the global lock (killed at `killed`), and the test proves nothing.
fn assert_a_change_waits(node1: &Mount, rel: &str, killed: Instant) {
    fs::create_dir(node1.p(rel)).unwrap_or_else(|e| panic!("mkdir {rel} on node1: {e}"));
    let changed = killed.elapsed();
    assert!(
        changed >= DEAD_TIME / 2,
        "node1's mkdir took only {changed:?} after the kill: node2 did not die holding the \
         global lock, and the test proves nothing"
    );
}

/// Has `node` logged that it recovered `dead`?
fn has_recovered(node: &Mount, dead: &str) -> bool {
    node.log()
        .lines()
        .any(|l| l.contains("recovered") && l.contains(dead))
}

/// `node` recovers `dead` within the dead time and the recovery slack (panics otherwise).
fn await_recovery(node: &Mount, dead: &str) {
    let recovered = poll_until(DEAD_TIME + RECOVERY_SLACK, || has_recovered(node, dead));
    assert!(
        recovered.is_some(),
        "the node did not recover {dead} within {:?}\n{}",
        DEAD_TIME + RECOVERY_SLACK,
        node.log()
    );
}

/// A VM image reopened, written with `O_DIRECT`, fsync'd and closed again and again on the
/// node that owns it (a `dd` loop, as the SAN harness's writers run; a VM restarted) while
/// another node lies dead holding the global lock: every pass ends long before the
/// recovery. Before, the close of the node's last writer gave its block pool back under the
/// global lock: the kernel does not wait for a release, so closes piled up, each holding a
/// FUSE worker until the recovery, and once every worker waited, the next open did too.
#[test]
fn an_image_reopened_in_a_loop_goes_on_while_a_dead_node_holds_the_global_lock() {
    require_fuse!();
    let _serial = serial();
    let (lun, node1, node2) = node1_and_a_node2_to_kill();
    let img = node1.p("img");
    let mut buf = AlignedBuf::new(1 << 20);
    buf.fill(7);
    {
        let mut f = open_direct(&img, true, true).expect("create img on node1");
        for _ in 0..4 {
            f.write_all(&buf).expect("write img");
        }
        f.sync_all().expect("fsync img");
    }
    // Files made in a directory of node1's: without the global lock, from a block pool that
    // they make node1 take.
    fs::create_dir(node1.p("own")).expect("mkdir own on node1");
    for i in 0..8 {
        fs::write(node1.p(format!("own/{i}")), b"x").expect("create in own on node1");
    }
    // A VM keeps the image open for writing while node2 takes the global lock (node1's pool
    // stays), and the pool is idle otherwise.
    let vm = open_direct(&img, true, false).expect("open img for writing");
    std::thread::sleep(Duration::from_secs(3));
    let killed = kill_holding_the_global_lock(node2, 10);
    drop(vm);
    // More passes than the daemon has FUSE workers.
    let passes = 100;
    for pass in 0..passes {
        let mut f =
            open_direct(&img, true, false).unwrap_or_else(|e| panic!("pass {pass}: open img: {e}"));
        f.write_all(&buf)
            .unwrap_or_else(|e| panic!("pass {pass}: write img: {e}"));
        f.sync_all()
            .unwrap_or_else(|e| panic!("pass {pass}: fsync img: {e}"));
    }
    assert_done_before_recovery(&node1, &format!("{passes} passes"), killed.elapsed());
    assert_a_change_waits(&node1, "after", killed);
    await_recovery(&node1, "node2");
    node1.unmount();
    lun.assert_fsck_clean();
}

/// A VM's flush (QEMU's is an fdatasync) never waits for a dead node's global lock, even when
/// its node's exclusive hold of the image lapsed (the image closed and idle for a second, then
/// reopened: the fast path takes the hold back only shared). Before, an fdatasync folded the
/// writes' pending mtime in under the global lock, and waited for the recovery: in the SAN
/// harness, whose passes take seconds under TCG, every pass after the kill did.
#[test]
fn an_image_flushed_after_its_hold_lapsed_goes_on_while_a_dead_node_holds_the_global_lock() {
    require_fuse!();
    let _serial = serial();
    let (lun, node1, node2) = node1_and_a_node2_to_kill();
    let img = node1.p("img");
    let mut buf = AlignedBuf::new(1 << 20);
    buf.fill(7);
    let pass = |what: &str| {
        let mut f = open_direct(&img, true, false).unwrap_or_else(|e| panic!("{what}: open: {e}"));
        f.write_all(&buf)
            .unwrap_or_else(|e| panic!("{what}: write: {e}"));
        f.sync_data()
            .unwrap_or_else(|e| panic!("{what}: fdatasync: {e}"));
    };
    {
        let mut f = open_direct(&img, true, true).expect("create img on node1");
        f.write_all(&buf).expect("write img");
        f.sync_all().expect("fsync img");
    }
    // Idle holds go back within two seconds (a sweep a second, of holds idle for a second).
    let lapse = Duration::from_millis(2500);
    std::thread::sleep(lapse);
    let killed = kill_holding_the_global_lock(node2, 10);
    pass("the first pass after the kill");
    std::thread::sleep(lapse);
    let written = std::time::SystemTime::now();
    pass("a pass after another lapse");
    assert_done_before_recovery(&node1, "two passes", killed.elapsed());
    assert_a_change_waits(&node1, "after", killed);
    await_recovery(&node1, "node2");
    // The mtime left pending went in at the close (once the global lock came back).
    node1.unmount();
    let node3 = Mount::new(&lun, "node3");
    let mtime = fs::metadata(node3.p("img"))
        .and_then(|m| m.modified())
        .expect("stat img on node3");
    assert!(
        mtime >= written,
        "the last pass's mtime was lost: {mtime:?} < {written:?}"
    );
    node3.unmount();
    lun.assert_fsck_clean();
}

/// A survivor's VM I/O goes on while more of its processes than the daemon has FUSE workers
/// wait for a dead node's global lock (64 processes, each `chmod`s its own file: no
/// directory lock in common, so the kernel sends them all at once). Before, each waiting change held a FUSE
/// worker, and once all 32 did, a read of node1's own image waited for the recovery too.
/// Past 8 at once, requests that may wait now wait on change threads
/// (cetrafs-fuse/src/offload.rs). Over `io_uring` the limit was the 32 entries of a CPU's
/// queue: the requests all come from one CPU here, and a queue now has room for waiting ones
/// (cetrafs-fuse/src/uring.rs, `WAITING_ROOM`).
#[test]
fn a_vm_reads_on_while_more_changes_than_fuse_workers_wait_for_a_dead_holder() {
    use std::os::unix::fs::PermissionsExt;
    require_fuse!();
    let _serial = serial();
    vm_io_goes_on_while_many_wait_for_a_dead_holder(
        |_| None,
        |p, _| fs::set_permissions(p, fs::Permissions::from_mode(0o600)),
    );
}

/// The same with `O_SYNC` writes of files node1 opened before the death, which node2 changed
/// since (so node1 does not hold them): each waits for node2's recovery, for the file's lock
/// or the global lock. Such a write ran on its FUSE
/// worker whatever the number waiting; it now waits where changes wait.
#[test]
fn a_vm_reads_on_while_more_sync_writes_than_fuse_workers_wait_for_a_dead_holder() {
    require_fuse!();
    let _serial = serial();
    vm_io_goes_on_while_many_wait_for_a_dead_holder(
        |p| {
            Some(
                fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_SYNC)
                    .open(p)
                    .expect("open a file O_SYNC on node1"),
            )
        },
        |_, f| f.expect("opened").write_all_at(b"x", 0),
    );
}

/// node1 has an image and 64 files (its holds of them gone back); node2 dies holding the
/// global lock; 64 threads on one CPU each run `wait` on their file (given what `prepare`
/// opened before the death), which waits for the recovery; node1's read and write of its
/// image must not.
fn vm_io_goes_on_while_many_wait_for_a_dead_holder(
    prepare: fn(&Path) -> Option<fs::File>,
    wait: fn(PathBuf, Option<fs::File>) -> io::Result<()>,
) {
    const WAITERS: usize = 64;
    let (lun, node1, node2) = node1_and_a_node2_to_kill();
    let mut buf = AlignedBuf::new(1 << 20);
    buf.fill(7);
    let vm = open_direct(&node1.p("img"), true, true).expect("create img on node1");
    vm.write_all_at(&buf, 0).expect("write img");
    vm.sync_all().expect("fsync img");
    for i in 0..WAITERS {
        fs::write(node1.p(format!("w{i}")), b"w").expect("create a file on node1");
    }
    // node1's holds of the files go back (idle for a second): a chmod needs the global lock,
    // and so does an O_SYNC write's mtime.
    std::thread::sleep(Duration::from_millis(2500));
    let opened: Vec<_> = (0..WAITERS)
        .map(|i| prepare(&node1.p(format!("w{i}"))))
        .collect();
    // A file node1 opened for writing keeps node1's hold of its lock, exclusive if node1 held
    // the global lock at the open: node2 changes each such file, which takes its lock away.
    for (i, _) in opened.iter().enumerate().filter(|(_, f)| f.is_some()) {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(node2.p(format!("w{i}")), fs::Permissions::from_mode(0o640))
            .expect("chmod on node2");
    }
    let killed = kill_holding_the_global_lock(node2, 10);
    // Every request from one CPU: over io_uring, the kernel sends a request to its caller's
    // CPU's queue, where it holds an entry until answered (cetrafs-fuse/src/uring.rs).
    let cpus = pin_to_one_cpu();
    let waiters: Vec<_> = opened
        .into_iter()
        .enumerate()
        .map(|(i, f)| {
            let p = node1.p(format!("w{i}"));
            std::thread::spawn(move || wait(p, f))
        })
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let io = Instant::now();
    vm.read_exact_at(&mut buf, 0).expect("read img on node1");
    vm.write_all_at(&buf, 0).expect("write img on node1");
    let took = io.elapsed();
    unpin(&cpus);
    assert!(
        took < DEAD_TIME / 4,
        "node1's read and write of its image took {took:?}: they waited for FUSE workers (or io_uring entries)"
    );
    assert_done_before_recovery(&node1, "a read and a write", killed.elapsed());
    // 32 waiting would take every classic worker, or every entry a CPU's queue had before
    // its room for waiting requests.
    let waited = waiters.iter().filter(|w| !w.is_finished()).count();
    assert!(
        waited >= 32,
        "only {waited} still waited for the global lock: the test proves nothing"
    );
    for w in waiters {
        w.join()
            .expect("waiter thread")
            .expect("the wait on node1 after the recovery");
    }
    await_recovery(&node1, "node2");
    drop(vm);
    node1.unmount();
    lun.assert_fsck_clean();
}

/// Pin the calling thread (and the threads it starts from now on) to the first CPU it may
/// run on; returns the set it had, for [`unpin`].
fn pin_to_one_cpu() -> libc::cpu_set_t {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity fills it (pid 0: this
    // thread) and sched_setaffinity reads the one it is given.
    unsafe {
        let mut had: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &raw mut had),
            0,
            "sched_getaffinity"
        );
        let first = (0..libc::CPU_SETSIZE as usize)
            .find(|&c| libc::CPU_ISSET(c, &had))
            .expect("a CPU to run on");
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(first, &mut one);
        assert_eq!(
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const one),
            0,
            "sched_setaffinity"
        );
        had
    }
}

/// Give the calling thread back the CPUs [`pin_to_one_cpu`] took from it.
fn unpin(had: &libc::cpu_set_t) {
    // SAFETY: reads the set it is given.
    let r = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), had) };
    assert_eq!(r, 0, "sched_setaffinity");
}

/// Format 7 (group marks): a thin image keeps growing past several refills of its node's
/// block pool while another node lies dead holding the global lock — each refill takes blocks
/// from a group its node owns, under the group's mark, without the global lock — and while
/// another process on the same node waits for that lock (a node waits for it without its
/// metadata mutex). Before, the first refill after the pool ran out waited for the dead
/// node's recovery, and so did every allocating write once any process of the node waited
/// for the global lock (the issue's "a node SIGKILLed while its VM grows a thin image"
/// freeze).
#[test]
fn a_thin_image_grows_while_a_dead_node_holds_the_global_lock() {
    const GROW_MIB: usize = 64;
    require_fuse!();
    let _serial = serial();
    let lun = lun_with_big_groups();
    let node1 = Mount::new(&lun, "node1");
    let node2 = Mount::new(&lun, "node2");
    for d in ["y", "z"] {
        fs::create_dir(node1.p(d)).expect("mkdir on node1");
    }
    fs::write(node1.p("y/m"), b"m").expect("write y/m on node1");
    let img = thin_image(&node1.p("y/thin.img"));
    let chunk = vec![0x6B_u8; 1 << 20];
    // The first write takes the global lock: node1 owns the image and has a pool.
    img.write_all_at(&chunk, 0).expect("first write on node1");
    make_node2_files_to_move(&node2, true);
    let killed = kill_holding_the_global_lock(node2, 10);
    // Meanwhile another process on node1 moves a file between directories: it waits for the
    // global lock until node2 is recovered, and the image's writes must not wait with it.
    let (from, to) = (node1.p("y/m"), node1.p("z/m"));
    let mover = std::thread::spawn(move || {
        let r = fs::rename(&from, &to);
        (r, Instant::now())
    });
    std::thread::sleep(Duration::from_millis(200));
    grow_mib(&img, 0x6B, 1..GROW_MIB + 1);
    let grown = killed.elapsed();
    assert!(
        !mover.is_finished(),
        "node1's move between directories did not wait for node2's global lock: the test \
         proves nothing"
    );
    let recovered_by_then = has_recovered(&node1, "node2");
    eprintln!(
        "node1 wrote {GROW_MIB} MiB into a thin image {:.3} s after node2 died holding the global lock (dead time {:.1} s; recovered by then: {recovered_by_then})",
        grown.as_secs_f64(),
        DEAD_TIME.as_secs_f64()
    );
    assert!(
        !recovered_by_then,
        "node2 was recovered before node1's image had grown ({grown:?}): node1 waited for the \
         global lock, or this machine is too slow for the test\n{}",
        node1.log()
    );
    await_recovery(&node1, "node2");
    let (moved, at) = mover.join().expect("the mover thread");
    moved.expect("move y/m to z/m on node1");
    eprintln!(
        "node1's move waited {:.3} s (until node2's recovery)",
        (at - killed).as_secs_f64()
    );
    assert_eq!(fs::read(node1.p("z/m")).expect("read z/m"), b"m");
    let f = fs::read(node1.p("a/f")).or_else(|_| fs::read(node1.p("b/f")));
    assert_eq!(f.expect("node2's moved file"), b"f");
    assert_mib(&img, 0x6B, 0..GROW_MIB + 1);
    drop(img);
    node1.unmount();
    lun.assert_fsck_clean();
}

/// What must go on in the dead-holder tests while one of node1's operations waits for
/// node2's recovery: node3 moves `p/m` to `q/m` (it needs the global lock, which node1 took
/// for the waiting operation) and node1 grows its thin image `y/thin.img` by 64 MiB (its
/// allocating writes need node1's metadata mutex). Both must be done before node2 is
/// recovered.
struct Bystanders {
    img: fs::File,
    byte: u8,
}

impl Bystanders {
    const GROW_MIB: usize = 64;

    /// node1's thin image `y/thin.img` (the caller made `y`) with its first MiB, and node3's
    /// `p/m`.
    fn new(node1: &Mount, node3: &Mount, byte: u8) -> Self {
        let img = thin_image(&node1.p("y/thin.img"));
        img.write_all_at(&vec![byte; 1 << 20], 0)
            .expect("first write on node1");
        for d in ["p", "q"] {
            fs::create_dir(node3.p(d)).expect("mkdir on node3");
        }
        fs::write(node3.p("p/m"), b"m").expect("write p/m on node3");
        Self { img, byte }
    }

    /// Half a second after node2's kill at `killed`, while `waiting` (what of node1's waits
    /// for node2, `finished` tells whether it ended): the move and the growth, both before
    /// node2's recovery; then wait for that recovery.
    fn go_on(
        &self,
        node1: &Mount,
        node3: &Mount,
        killed: Instant,
        waiting: &str,
        finished: impl Fn() -> bool,
    ) {
        std::thread::sleep(Duration::from_millis(500));
        let t = Instant::now();
        fs::rename(node3.p("p/m"), node3.p("q/m")).expect("move p/m to q/m on node3");
        let moved = t.elapsed();
        grow_mib(&self.img, self.byte, 1..Self::GROW_MIB + 1);
        let grown = killed.elapsed();
        let recovered = || has_recovered(node1, "node2") || has_recovered(node3, "node2");
        let recovered_by_then = recovered();
        eprintln!(
            "while {waiting}: node3's move took {:.3} s; node1 had written {} MiB into its \
             thin image {:.3} s after the kill (dead time {:.1} s; recovered by then: \
             {recovered_by_then})",
            moved.as_secs_f64(),
            Self::GROW_MIB,
            grown.as_secs_f64(),
            DEAD_TIME.as_secs_f64()
        );
        assert!(
            !recovered_by_then,
            "node2 was recovered before node3's move and node1's growth were done ({grown:?}): \
             they waited for {waiting}\nnode1:\n{}\nnode3:\n{}",
            node1.log(),
            node3.log()
        );
        assert!(
            !finished(),
            "{waiting} did not wait for node2: the test proves nothing"
        );
        assert!(
            poll_until(DEAD_TIME + RECOVERY_SLACK, recovered).is_some(),
            "node2 was not recovered"
        );
    }

    /// node1 sees node3's move and reads its whole thin image back; both unmount, and the
    /// volume checks clean.
    fn end(self, lun: &Lun, node1: Mount, node3: Mount) {
        assert_eq!(fs::read(node1.p("q/m")).expect("read q/m on node1"), b"m");
        assert_mib(&self.img, self.byte, 0..Self::GROW_MIB + 1);
        drop(self.img);
        node3.unmount();
        node1.unmount();
        lun.assert_fsck_clean();
    }
}

/// A dead node's open image blocks only itself. node2 writes an image and keeps it open (its
/// inode lock stays exclusive there while it is open for writing), idles 3 s (its other
/// holds go back) and is SIGKILLed. On node1 an `ls -l` of the image's directory then stats
/// that image (and asks for its xattrs): it waits for node2's recovery, as it must.
/// Meanwhile node3 moves a file between directories (it needs the global lock, which node1
/// took for the stat) and node1's thin image grows by 64 MiB (its allocating writes need
/// node1's metadata mutex). Both must go on before node2 is recovered: the stat gives the
/// global lock and the mutex up while it waits for the inode lock, and starts again once it
/// holds that. Before, it waited holding both, and node3's move and node1's image waited the
/// whole dead time with it.
#[test]
fn a_stat_of_a_dead_nodes_open_image_stalls_nobody() {
    require_fuse!();
    let _serial = serial();
    let lun = lun_with_big_groups();
    let node1 = Mount::new(&lun, "node1");
    let node2 = Mount::new(&lun, "node2");
    let node3 = Mount::new(&lun, "node3");
    fs::create_dir(node1.p("y")).expect("mkdir y on node1");
    let chunk = vec![0x3C_u8; 1 << 20];
    let by = Bystanders::new(&node1, &node3, 0x3C);
    fs::create_dir(node2.p("b")).expect("mkdir b on node2");
    let vm = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(node2.p("b/vm.img"))
        .expect("create b/vm.img on node2");
    vm.write_all_at(&chunk, 0).expect("write b/vm.img on node2");
    vm.sync_all().expect("fsync b/vm.img on node2");
    // Idle holds go back between 1 and about 2 s after their last use; the open image's stays.
    std::thread::sleep(Duration::from_secs(3));
    node2
        .abandon(Some(libc::SIGKILL))
        .expect("kill node2's daemon");
    let killed = Instant::now();
    // `ls -l` as an admin would run it: readdir, then lstat and the xattr calls of each name.
    let dir = node1.p("b");
    let stat = std::thread::spawn(move || {
        let r = std::process::Command::new("ls")
            .arg("-ln")
            .arg(&dir)
            .output();
        (r, Instant::now())
    });
    by.go_on(&node1, &node3, killed, "the stat of node2's image", || {
        stat.is_finished()
    });
    let (ls, at) = stat.join().expect("the ls thread");
    let ls = ls.expect("run ls");
    let out = String::from_utf8_lossy(&ls.stdout);
    eprintln!(
        "node1's `ls -l b` waited {:.3} s (until node2's recovery):\n{out}",
        (at - killed).as_secs_f64()
    );
    assert!(
        ls.status.success(),
        "ls -l b on node1: {}",
        String::from_utf8_lossy(&ls.stderr)
    );
    assert!(
        out.lines()
            .any(|l| l.ends_with(" vm.img") && l.contains(" 1048576 ")),
        "ls -l b does not show node2's fsync'd 1 MiB image"
    );
    assert_eq!(
        fs::metadata(node1.p("b/vm.img"))
            .expect("stat b/vm.img")
            .len(),
        1 << 20
    );
    drop(vm);
    by.end(&lun, node1, node3);
}

/// A dead reader of an image blocks only that image. node1 writes `y/vm.img` and keeps it
/// open for writing (a VM); node2 opens it for reading and reads it (as a backup or
/// `qemu-img info` would), keeps it open — so it holds the image's inode lock shared, and
/// node1 none — and is SIGKILLed. node1's next allocating write into the image must own
/// that lock, and waits for node2's recovery, as it must (node2 may still be reading until
/// its lease is over). Meanwhile node3 moves a file between directories (it needs the global
/// lock, which node1 took for the write) and node1's thin image grows by 64 MiB (its
/// allocating writes need node1's metadata mutex): both must go on before node2 is
/// recovered. The write gives both up while it waits to own the inode, and starts again
/// after. Before, it waited holding both, and they waited the whole dead time with it.
#[test]
fn a_dead_readers_hold_on_an_image_stalls_nobody_else() {
    require_fuse!();
    let _serial = serial();
    let lun = lun_with_big_groups();
    let node1 = Mount::new(&lun, "node1");
    let node2 = Mount::new(&lun, "node2");
    let node3 = Mount::new(&lun, "node3");
    fs::create_dir(node1.p("y")).expect("mkdir y on node1");
    let chunk = vec![0x5A_u8; 1 << 20];
    let by = Bystanders::new(&node1, &node3, 0x5A);
    let vm = thin_image(&node1.p("y/vm.img"));
    vm.write_all_at(&chunk, 0).expect("write y/vm.img on node1");
    vm.sync_all().expect("fsync y/vm.img on node1");
    let reader = fs::File::open(node2.p("y/vm.img")).expect("open y/vm.img on node2");
    let mut first = vec![0u8; 4096];
    reader
        .read_exact_at(&mut first, 0)
        .expect("read y/vm.img on node2");
    assert!(
        first.iter().all(|&b| b == 0x5A),
        "node2 reads node1's image"
    );
    // Idle holds go back between 1 and about 2 s after their last use; node2's hold of the
    // image it has open for reading stays.
    std::thread::sleep(Duration::from_secs(3));
    node2
        .abandon(Some(libc::SIGKILL))
        .expect("kill node2's daemon");
    let killed = Instant::now();
    let vm = std::sync::Arc::new(vm);
    let writer = {
        let (vm, chunk) = (vm.clone(), chunk.clone());
        std::thread::spawn(move || {
            let r = vm
                .write_all_at(&chunk, 1 << 20)
                .and_then(|()| vm.sync_all());
            (r, Instant::now())
        })
    };
    by.go_on(
        &node1,
        &node3,
        killed,
        "node1's write into the image node2 held",
        || writer.is_finished(),
    );
    let (wrote, at) = writer.join().expect("the writer thread");
    wrote.expect("node1's write into y/vm.img");
    eprintln!(
        "node1's write into y/vm.img waited {:.3} s (until node2's recovery)",
        (at - killed).as_secs_f64()
    );
    assert_mib(&vm, 0x5A, 0..2);
    drop(vm);
    by.end(&lun, node1, node3);
}

/// A dead node's shared hold of a directory blocks only changes in that directory. node1
/// makes `images/` with a file in it, and a thin image in `y/`; node2 lists `images/` (it
/// holds the directory's lock shared for about a second after); node3 makes a directory,
/// which takes the global lock from node2 (node2 keeps its hold of `images/`, as a node
/// does in a busy cluster); node2 is SIGKILLed. node1's create of a file in `images/` must
/// own the directory, and waits for node2's recovery. Meanwhile node3 moves a file between
/// its directories and node1's thin image grows by 64 MiB: both must go on before node2 is
/// recovered. Before, the create owned the directory only after its first change, and
/// waited holding the global lock and node1's metadata mutex.
#[test]
fn a_dead_nodes_directory_listing_stalls_nobody_else() {
    require_fuse!();
    let _serial = serial();
    let lun = lun_with_big_groups();
    let node1 = Mount::new(&lun, "node1");
    let node2 = Mount::new(&lun, "node2");
    let node3 = Mount::new(&lun, "node3");
    for d in ["images", "y"] {
        fs::create_dir(node1.p(d)).expect("mkdir on node1");
    }
    fs::write(node1.p("images/a.img"), b"a").expect("write images/a.img on node1");
    let by = Bystanders::new(&node1, &node3, 0x4B);
    let listed: Vec<_> = fs::read_dir(node2.p("images"))
        .expect("list images on node2")
        .map(|e| e.expect("an entry of images").file_name())
        .collect();
    assert_eq!(listed, ["a.img"], "node2 lists images/");
    fs::create_dir(node3.p("r")).expect("mkdir r on node3");
    node2
        .abandon(Some(libc::SIGKILL))
        .expect("kill node2's daemon");
    let killed = Instant::now();
    let creator = {
        let path = node1.p("images/new.img");
        std::thread::spawn(move || (fs::write(path, b"new"), Instant::now()))
    };
    by.go_on(&node1, &node3, killed, "node1's create in images/", || {
        creator.is_finished()
    });
    let (made, at) = creator.join().expect("the creator thread");
    made.expect("node1's create of images/new.img");
    eprintln!(
        "node1's create in images/ waited {:.3} s (until node2's recovery)",
        (at - killed).as_secs_f64()
    );
    assert_eq!(
        fs::read(node3.p("images/new.img")).expect("read images/new.img on node3"),
        b"new"
    );
    by.end(&lun, node1, node3);
}

/// node1 grows a thin image by 96 MiB, six times the 16 MiB groups of this volume, right
/// after node2 died holding the global lock. Returns how long after the kill the growth was
/// done, and whether node2 had been recovered by then.
fn outgrow_groups_while_a_dead_node_holds_the_global_lock(format: &str) -> (Duration, bool) {
    const GROW_MIB: usize = 96;
    let lun = lun_with_groups("16M", format);
    let node1 = Mount::new(&lun, "node1");
    let node2 = Mount::new(&lun, "node2");
    let img = thin_image(&node1.p("thin.img"));
    grow_mib(&img, 0x2D, 0..1);
    make_node2_files_to_move(&node2, false);
    let killed = kill_holding_the_global_lock(node2, 4);
    grow_mib(&img, 0x2D, 1..GROW_MIB + 1);
    let grown = killed.elapsed();
    let recovered_by_then = has_recovered(&node1, "node2");
    eprintln!(
        "format {format}: node1 grew its thin image by {GROW_MIB} MiB over 16 MiB groups {:.3} s after node2 died holding the global lock (recovered by then: {recovered_by_then})",
        grown.as_secs_f64()
    );
    await_recovery(&node1, "node2");
    assert_mib(&img, 0x2D, 0..GROW_MIB + 1);
    drop(img);
    node1.unmount();
    lun.assert_fsck_clean();
    (grown, recovered_by_then)
}

/// Format 8 (group claims): once node1's own allocation groups are full, its pool refills
/// claim free groups without the global lock, so its thin image keeps growing while a dead
/// node2 holds that lock. On format 7 the same growth waits for node2's recovery (a new group
/// is claimed only under the global lock there), which shows the test can fail.
#[test]
fn a_thin_image_outgrows_its_groups_while_a_dead_node_holds_the_global_lock() {
    require_fuse!();
    let _serial = serial();
    let (grown, recovered) = outgrow_groups_while_a_dead_node_holds_the_global_lock("8");
    assert!(
        !recovered,
        "format 8: node1's growth took {grown:?}, until node2's recovery: a new group needed the global lock"
    );
    let (grown, recovered) = outgrow_groups_while_a_dead_node_holds_the_global_lock("7");
    assert!(
        recovered,
        "format 7: node1 outgrew its groups in {grown:?}, before node2's recovery: the test cannot tell format 8 from 7"
    );
}

/// node2 moves a file between two directories (which takes the global lock exclusively), then
/// does nothing for 3 s and is SIGKILLed. node1's own move between directories right after the
/// kill must not wait for node2's recovery (dead time 5.2 s here): node2 gave the lock back
/// after a second unused. Before that rule node2 kept the lock until someone asked for it, and
/// node1's move waited the whole dead time. The converse, a node killed right after such a move
/// (still holding the lock, so the move waits), is checked by discard.rs
/// `a_vms_trim_goes_on_while_a_dead_node_holds_the_global_lock`. Then a thin image on node1
/// grows by 96 MiB, through several refills of its block pool (each needs the global lock),
/// before node2 is recovered. node1 then recovers node2, and fsck is clean.
#[test]
fn a_node_that_dies_idle_holds_no_global_lock() {
    const GROW_MIB: usize = 96;
    require_fuse!();
    let _serial = serial();
    let lun = Lun::new(1 << 30);
    let (hb, io) = (HEARTBEAT_MS.to_string(), IO_TIMEOUT_MS.to_string());
    lun.mkfs(&["--heartbeat-interval", &hb, "--io-timeout", &io, "-N", "4"]);
    let node1 = Mount::new(&lun, "node1");
    let node2 = Mount::new(&lun, "node2");
    for d in ["x", "y"] {
        fs::create_dir(node1.p(d)).expect("mkdir on node1");
    }
    fs::write(node1.p("x/g"), b"g").expect("write x/g on node1");
    make_node2_files_to_move(&node2, false);
    fs::rename(node2.p("a/f"), node2.p("b/f")).expect("move a/f to b/f on node2");
    // Idle holds go back between 1 and about 2 s after their last use (the sweep looks once a
    // second); 3 s leaves room for a slow machine.
    std::thread::sleep(Duration::from_secs(3));
    node2
        .abandon(Some(libc::SIGKILL))
        .expect("kill node2's daemon");
    let killed = Instant::now();
    fs::rename(node1.p("x/g"), node1.p("y/g")).expect("move x/g to y/g on node1");
    let waited = killed.elapsed();
    eprintln!(
        "node1's move between directories took {:.3} s after node2 died idle (dead time {:.1} s)",
        waited.as_secs_f64(),
        DEAD_TIME.as_secs_f64()
    );
    assert!(
        waited < Duration::from_secs(2),
        "node1's move waited {waited:?} after node2's death: node2 still held the global lock \
         or the root's lock 3 s after it last used them\n{}",
        node1.log()
    );
    // A thin image grows on node1 past several refills of its block pool (each takes the
    // global lock; on this 1 GiB LUN a refill is about 11 MiB), all before node2's recovery.
    let img = thin_image(&node1.p("y/thin.img"));
    grow_mib(&img, 0x5A, 0..GROW_MIB);
    let grown = killed.elapsed();
    let recovered_by_then = has_recovered(&node1, "node2");
    eprintln!(
        "node1 wrote {GROW_MIB} MiB into a thin image {:.3} s after node2's death (recovered by then: {recovered_by_then})",
        grown.as_secs_f64()
    );
    assert!(
        !recovered_by_then,
        "node2 was recovered before node1's image had grown ({grown:?}): the test proves nothing \
         on a machine this slow\n{}",
        node1.log()
    );
    await_recovery(&node1, "node2");
    assert_eq!(
        fs::read(node1.p("y/g")).expect("read y/g on node1"),
        b"g",
        "the moved file"
    );
    assert_eq!(
        fs::read(node1.p("b/f")).expect("read node2's b/f on node1"),
        b"f",
        "node2's moved file"
    );
    assert_mib(&img, 0x5A, 0..GROW_MIB);
    drop(img);
    node1.unmount();
    lun.assert_fsck_clean();
}

/// `fs/own_lock_reads.rs` through FUSE: node2 dies holding the global lock. On node1, a stat,
/// a read, an open for writing and listings of what node1 made and node2 did not touch since
/// go on before node2's recovery, validated by those objects' own locks (node1's holds of
/// them went back while idle); a change waits for the recovery. Before, every path walk on
/// node1 that the kernel had not cached waited the whole dead time.
#[test]
fn survivors_read_what_a_dead_global_holder_did_not_touch() {
    require_fuse!();
    let _serial = serial();
    let (lun, node1, node2) = node1_and_a_node2_to_kill();
    // After node2's changes of the root: node1's copy of it is current.
    fs::create_dir(node1.p("own")).expect("mkdir own on node1");
    fs::write(node1.p("own/old"), b"old").expect("write own/old on node1");
    fs::write(node1.p("top"), b"top").expect("write top on node1");
    // node1's holds go back (idle for a second) and its kernel forgets the names (0.5 s).
    std::thread::sleep(Duration::from_secs(3));
    let killed = kill_holding_the_global_lock(node2, 10);
    let t = Instant::now();
    assert_eq!(
        fs::metadata(node1.p("own/old"))
            .expect("stat own/old")
            .len(),
        3
    );
    assert_eq!(fs::read(node1.p("own/old")).expect("read own/old"), b"old");
    assert_eq!(fs::read(node1.p("top")).expect("read top"), b"top");
    fs::OpenOptions::new()
        .write(true)
        .open(node1.p("own/old"))
        .expect("open own/old for writing");
    let list = |d: &str| -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(node1.p(d))
            .unwrap_or_else(|e| panic!("list {d}: {e}"))
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    assert_eq!(list("own"), ["old"]);
    // Names node1 never loaded are listed too (their attributes wait).
    assert_eq!(list("."), ["a", "b", "own", "top"]);
    assert_done_before_recovery(&node1, "node1's reads", t.elapsed());
    assert_a_change_waits(&node1, "own/new", killed);
    await_recovery(&node1, "node2");
    node1.unmount();
    lun.assert_fsck_clean();
}
