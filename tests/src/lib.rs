//! Shared harness for the end-to-end tests: real daemons (`mount-cetra`) on real FUSE mounts of
//! sparse file-backed LUNs, plus the mkfs and fsck binaries.
//!
//! * [`Lun`]: a sparse file in a temporary directory on a filesystem that supports `O_DIRECT`.
//! * [`Mount`]: the daemon started in daemon mode; `Drop` unmounts, waits for the daemon and
//!   insists that it exits 0 (the test process is a child subreaper so it can reap the daemon),
//!   and that its log has no ERROR line other than those the test allowed
//!   ([`Mount::allow_error`]): an admin reading the journal takes every ERROR for a fault.
//! * [`require_fuse!`]: skip loudly when /dev/fuse is missing, unless `CETRA_REQUIRE_E2E=1`
//!   (set by `scripts/test`), in which case a missing FUSE is a failure.
//!
//! * A hang is diagnosed, not waited out: with `CETRA_TEST_DEADLINE_SECS` set (scripts/test
//!   sets it below the test runner's own timeout), a test process still running that long
//!   after its first mount prints where each of its daemons' threads and its own threads wait
//!   (kernel stacks), kills its daemons, detaches its mounts and aborts, so that the next test
//!   does not inherit a stopped daemon's mount.
//!
//! Binaries are taken from `$CETRA_BIN_DIR`, else from the `target/{release,debug}` directory
//! that has all three and the newest `mount-cetra`. Build them first: `cargo build --release --bins`.

use std::ffi::{CString, OsStr};
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub use rand;

/// How long a daemon gets to mount or to exit after umount.
const DAEMON_TIMEOUT: Duration = Duration::from_mins(2);

// ---------------------------------------------------------------------------------------------
// Locating things

/// The workspace root (parent of this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests crate has a parent")
        .to_path_buf()
}

fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => {
            let p = PathBuf::from(d);
            if p.is_absolute() {
                p
            } else {
                workspace_root().join(p)
            }
        }
        None => workspace_root().join("target"),
    }
}

pub const BINARIES: [&str; 4] = ["mkfs-cetra", "mount-cetra", "fsck-cetra", "cetra"];

/// Directory holding the CetraFS binaries.
pub fn bin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os("CETRA_BIN_DIR") {
            return PathBuf::from(d);
        }
        let t = target_dir();
        let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
        for profile in ["release", "debug"] {
            let d = t.join(profile);
            if !BINARIES.iter().all(|b| d.join(b).is_file()) {
                continue;
            }
            let m = fs::metadata(d.join("mount-cetra")).and_then(|m| m.modified()).ok();
            if let Some(m) = m {
                if best.as_ref().is_none_or(|(bm, _)| m > *bm) {
                    best = Some((m, d));
                }
            }
        }
        match best {
            Some((_, d)) => d,
            None => panic!(
                "CetraFS binaries ({}) not found in {}/{{release,debug}}; run `cargo build --release --bins` \
                 or set CETRA_BIN_DIR",
                BINARIES.join(", "),
                t.display()
            ),
        }
    })
    .clone()
}

pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(p.is_file(), "binary {} missing", p.display());
    p
}

/// True if FUSE mounts can be made here (device node present and we can open it).
pub fn fuse_available() -> bool {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .is_ok()
}

/// Return early from a test (with a loud message) if FUSE is unavailable. With
/// `CETRA_REQUIRE_E2E=1` a missing FUSE fails the test instead.
#[macro_export]
macro_rules! require_fuse {
    () => {
        if !$crate::fuse_available() {
            if std::env::var("CETRA_REQUIRE_E2E").as_deref() == Ok("1") {
                panic!("/dev/fuse is not usable and CETRA_REQUIRE_E2E=1: end-to-end tests cannot run");
            }
            eprintln!("\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!");
            eprintln!("!!! SKIPPED {}: /dev/fuse is missing or not openable (need root + fuse)", module_path!());
            eprintln!("!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n");
            return;
        }
    };
}

fn probe_o_direct(dir: &Path) -> bool {
    if fs::create_dir_all(dir).is_err() {
        return false;
    }
    let p = dir.join(format!(".odirect-probe-{}", std::process::id()));
    let ok = (|| -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&p)?;
        let buf = AlignedBuf::new(4096);
        f.write_all_at(&buf, 0)?;
        Ok(())
    })()
    .is_ok();
    let _ = fs::remove_file(&p);
    ok
}

/// Base directory for LUN files: `$CETRA_TEST_TMP`, `<workspace>/.cache/tmp`, or the system temp
/// dir, whichever first supports `O_DIRECT` (tmpfs does not).
pub fn scratch_base() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let mut cands = Vec::new();
        if let Some(d) = std::env::var_os("CETRA_TEST_TMP") {
            cands.push(PathBuf::from(d));
        }
        cands.push(workspace_root().join(".cache").join("tmp"));
        cands.push(std::env::temp_dir());
        for c in &cands {
            if probe_o_direct(c) {
                return c.clone();
            }
        }
        panic!("no scratch directory supporting O_DIRECT among {cands:?}");
    })
    .clone()
}

// ---------------------------------------------------------------------------------------------
// Commands

/// Exit code and output of a command.
#[derive(Debug, Clone)]
pub struct CmdResult {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl CmdResult {
    fn from_output(o: &Output) -> Self {
        use std::os::unix::process::ExitStatusExt;
        let code = o
            .status
            .code()
            .unwrap_or_else(|| 128 + o.status.signal().unwrap_or(0));
        Self {
            code,
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
    /// A failed mount's own stderr, without the daemon log that `Mount::try_new*` appends
    /// after a `--- daemon log` marker.
    pub fn own_stderr(&self) -> String {
        self.stderr
            .split("--- daemon log")
            .next()
            .unwrap_or("")
            .trim()
            .to_string()
    }

    /// stdout and stderr together.
    pub fn output(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

impl std::fmt::Display for CmdResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}\n--- stdout ---\n{}--- stderr ---\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// Run a command to completion, capturing output.
pub fn run(cmd: &mut Command) -> CmdResult {
    let o = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    CmdResult::from_output(&o)
}

/// Run a command for at most `timeout`; on timeout it is killed (SIGKILL) and None returned.
/// Output is collected by reader threads, so a chatty child cannot block on a full pipe.
pub fn run_timeout(cmd: &mut Command, timeout: Duration) -> Option<CmdResult> {
    use std::io::Read;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("piped stdout")));
    let err = drain(Box::new(child.stderr.take().expect("piped stderr")));
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break Some(st);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // A timed-out child may have left a grandchild holding the pipes: do not wait for EOF then.
    let status = status?;
    let o = Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    };
    Some(CmdResult::from_output(&o))
}

/// Run a command that must succeed; returns stdout.
pub fn run_ok(cmd: &mut Command) -> String {
    let r = run(cmd);
    assert_eq!(r.code, 0, "{cmd:?} failed: {r}");
    r.stdout
}

// ---------------------------------------------------------------------------------------------
// LUN

/// A sparse file-backed LUN in its own temporary directory (removed on drop).
#[derive(Debug)]
pub struct Lun {
    dir: tempfile::TempDir,
    path: PathBuf,
    size: u64,
}

impl Lun {
    /// A sparse LUN of `size` bytes.
    pub fn new(size: u64) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("cetra-e2e-")
            .tempdir_in(scratch_base())
            .expect("tempdir for LUN");
        let path = dir.path().join("lun.img");
        let f = fs::File::create(&path).expect("create LUN file");
        f.set_len(size).expect("size LUN file");
        Self { dir, path, size }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn size(&self) -> u64 {
        self.size
    }
    /// The LUN's private temporary directory (mountpoints and logs live here too).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Run mkfs with `args` (before the device) and return its result.
    pub fn try_mkfs(&self, args: &[&str]) -> CmdResult {
        run(Command::new(bin("mkfs-cetra")).args(args).arg(&self.path))
    }

    /// mkfs that must succeed.
    pub fn mkfs(&self, args: &[&str]) -> CmdResult {
        let r = self.try_mkfs(args);
        assert_eq!(
            r.code,
            0,
            "mkfs-cetra {args:?} {} failed: {r}",
            self.path.display()
        );
        r
    }

    /// `fsck-cetra -n`: exit code and output.
    pub fn fsck(&self) -> CmdResult {
        run(Command::new(bin("fsck-cetra")).arg("-n").arg(&self.path))
    }

    /// fsck -n must report a clean volume (exit 0).
    pub fn assert_fsck_clean(&self) {
        let r = self.fsck();
        assert_eq!(
            r.code,
            0,
            "fsck-cetra -n {} is not clean: {r}",
            self.path.display()
        );
    }

    /// Overwrite `data.len()` bytes at `offset` of the backing file (corruption tests).
    pub fn poke(&self, offset: u64, data: &[u8]) {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new()
            .write(true)
            .open(&self.path)
            .expect("open LUN for poke");
        f.write_all_at(data, offset).expect("poke LUN");
        f.sync_all().expect("sync LUN");
    }

    /// Read bytes of the backing file.
    pub fn peek(&self, offset: u64, len: usize) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let f = fs::File::open(&self.path).expect("open LUN for peek");
        let mut b = vec![0u8; len];
        f.read_exact_at(&mut b, offset).expect("peek LUN");
        b
    }
}

// ---------------------------------------------------------------------------------------------
// Mount

/// Every mount this process made: (mountpoint, daemon log), for [`watch_deadline`].
static MOUNTED: std::sync::Mutex<Vec<(PathBuf, PathBuf)>> = std::sync::Mutex::new(Vec::new());

/// With `CETRA_TEST_DEADLINE_SECS` set, a thread that, that long from now, describes where
/// this process and its daemons wait, kills the daemons, detaches the mounts and aborts.
fn watch_deadline() {
    let Some(secs) = std::env::var("CETRA_TEST_DEADLINE_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name("deadline".into())
        .spawn(move || {
            std::thread::sleep(Duration::from_secs(secs));
            let mut out = format!(
                "\n=== test deadline: still running {secs} s after its first mount ===\n{}",
                threads_of("self")
            );
            // Commands this test runs (a `cetra status`, an fsck) that wait too.
            let me = std::process::id().to_string();
            for pid in children_of(&me) {
                let cmd = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                if cmd.contains("mount-cetra") {
                    continue; // below, with its mount
                }
                let _ = write!(out, "--- child {pid}: {cmd}\n{}", threads_of_bounded(&pid));
            }
            let mounted = MOUNTED.lock().map(|m| m.clone()).unwrap_or_default();
            let mut pids = Vec::new();
            for (mp, log) in &mounted {
                for pid in daemon_pids(mp) {
                    let text = read_lossy(log);
                    let tail: Vec<&str> = text.lines().rev().take(30).collect();
                    let _ = write!(
                        out,
                        "--- daemon {pid} of {}\n{}--- last lines of {}:\n",
                        mp.display(),
                        threads_of_bounded(&pid.to_string()),
                        log.display()
                    );
                    for l in tail.iter().rev() {
                        let _ = writeln!(out, "  {l}");
                    }
                    pids.push(pid);
                }
            }
            // Past the test harness's output capture, which an abort would discard.
            let _ = io::stderr().write_all(out.as_bytes());
            for &pid in &pids {
                // SAFETY: signals to daemons this process started (found by their mountpoints).
                unsafe {
                    libc::kill(pid, libc::SIGCONT);
                    libc::kill(pid, libc::SIGKILL);
                }
            }
            for pid in pids {
                let _ = wait_pid(pid, Duration::from_secs(5));
            }
            for (mp, _) in &mounted {
                let _ = lazy_unmount(mp);
            }
            std::process::abort();
        });
    if let Err(e) = spawned {
        eprintln!("no deadline thread: {e}");
    }
}

/// Field `key` of `/proc/<pid>/status` (`pid` may be "self" or "123/task/124"), trimmed.
/// `status`, not `stat`: most of a process's /proc entries block while it is stuck in an exec
/// (`cetrafs-core` cluster/procs.rs), `status` answers.
pub fn proc_status(pid: &str, key: &str) -> Option<String> {
    let text = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}

/// A child process killed and reaped when this goes out of scope, panics included.
#[derive(Debug)]
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Pids of the processes whose parent is `pid`.
fn children_of(pid: &str) -> Vec<String> {
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (proc_status(&name, "PPid")? == pid).then_some(name)
        })
        .collect()
}

/// `f()` on a thread of its own, given up on after `within` (None then; the thread is left).
pub fn bounded<T: Send + 'static>(
    within: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .spawn(move || {
            let _ = tx.send(f());
        })
        .ok()?;
    rx.recv_timeout(within).ok()
}

/// [`threads_of`], or a note that its /proc entries do not answer (a process stuck in an
/// exec: `cetrafs-core` cluster/procs.rs).
fn threads_of_bounded(pid: &str) -> String {
    let p = pid.to_owned();
    bounded(Duration::from_secs(2), move || threads_of(&p)).unwrap_or_else(|| {
        format!(
            "  (its /proc entries do not answer: stuck in an exec? state {:?})\n",
            proc_status(pid, "State")
        )
    })
}

/// The threads of process `pid` ("self" for this one), those waiting alike in one line:
/// names, state, wait channel and kernel stack.
fn threads_of(pid: &str) -> String {
    let mut alike: Vec<(String, Vec<String>)> = Vec::new();
    if let Ok(rd) = fs::read_dir(format!("/proc/{pid}/task")) {
        for t in rd.flatten() {
            let p = t.path();
            let get = |f: &str| fs::read_to_string(p.join(f)).unwrap_or_default();
            let task = format!("{pid}/task/{}", t.file_name().to_string_lossy());
            let state = proc_status(&task, "State").unwrap_or_else(|| "?".to_owned());
            let stack: Vec<String> = get("stack")
                .lines()
                .take(8)
                .map(|l| l.split_whitespace().nth(1).unwrap_or(l).to_owned())
                .collect();
            let how = format!(
                "{state} wchan={} stack: {}",
                get("wchan"),
                stack.join(" < ")
            );
            let name = get("comm").trim().to_owned();
            match alike.iter_mut().find(|(h, _)| *h == how) {
                Some((_, names)) => names.push(name),
                None => alike.push((how, vec![name])),
            }
        }
    }
    let mut out = String::new();
    for (how, names) in alike {
        let more = names.len().saturating_sub(3);
        let shown = names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        let more = if more > 0 {
            format!(" +{more}")
        } else {
            String::new()
        };
        let _ = writeln!(out, "  [{shown}{more}] {how}");
    }
    out
}

fn become_subreaper() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        watch_deadline();
        // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) takes no pointers and affects only this process.
        let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        assert_eq!(
            r,
            0,
            "prctl(PR_SET_CHILD_SUBREAPER): {}",
            io::Error::last_os_error()
        );
    });
}

/// Is `path` a mountpoint right now (per /proc/self/mountinfo)? Returns its fstype.
pub fn mount_fstype(path: &Path) -> Option<String> {
    let canon = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = canon.to_string_lossy().replace(' ', "\\040");
    let mut found = None;
    for line in info.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        if f.len() < 5 || f[4] != want {
            continue;
        }
        let sep = f.iter().position(|x| *x == "-")?;
        found = f.get(sep + 1).map(|s| (*s).to_string());
    }
    found
}

/// Pids of `mount-cetra` processes whose command line names `mountpoint`.
fn daemon_pids(mountpoint: &Path) -> Vec<i32> {
    let mp = mountpoint.as_os_str().as_bytes();
    let mut pids = Vec::new();
    let Ok(rd) = fs::read_dir("/proc") else {
        return pids;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        // `comm` first (a daemon's is `exe` once it re-executed itself): it always answers,
        // and only daemons' command lines are read then.
        let comm = fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if !matches!(comm.trim(), "exe" | "mount-cetra" | "mount.cetra") {
            continue;
        }
        let Ok(cmdline) = fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|&c| c == 0).collect();
        let is_daemon = args.first().is_some_and(|a0| {
            let n = Path::new(OsStr::from_bytes(a0))
                .file_name()
                .map(|n| n.as_bytes().to_vec())
                .unwrap_or_default();
            n.starts_with(b"mount-cetra") || n.starts_with(b"mount.cetra")
        });
        if is_daemon && args.iter().skip(1).any(|a| *a == mp) {
            pids.push(pid);
        }
    }
    pids
}

/// Outcome of waiting for a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
    /// Gone, but not our child (could not collect a status).
    Unknown,
}

/// Poll until `pid` exits or `timeout` passes. Returns None on timeout.
fn wait_pid(pid: i32, timeout: Duration) -> Option<Exit> {
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid out-pointer to a local.
        let r = unsafe { libc::waitpid(pid, &raw mut status, libc::WNOHANG) };
        if r == pid {
            if libc::WIFEXITED(status) {
                return Some(Exit::Code(libc::WEXITSTATUS(status)));
            }
            if libc::WIFSIGNALED(status) {
                return Some(Exit::Signal(libc::WTERMSIG(status)));
            }
        } else if r < 0 {
            // Not our child (ECHILD): fall back to polling its existence.
            // SAFETY: kill with signal 0 only checks existence.
            if unsafe { libc::kill(pid, 0) } != 0 {
                return Some(Exit::Unknown);
            }
        }
        if start.elapsed() > timeout {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A mounted CetraFS served by a `mount-cetra` daemon.
#[derive(Debug)]
pub struct Mount {
    mountpoint: PathBuf,
    device: PathBuf,
    log: PathBuf,
    /// Where this daemon's part of the (appended) log file begins.
    log_start: u64,
    /// Substrings of ERROR lines this test provokes on purpose.
    allowed_errors: Vec<String>,
    pid: i32,
    mounted: bool,
}

/// ERROR lines of a daemon log (the daemon writes `ERROR target: message`), and panics.
fn error_lines(log: &str) -> impl Iterator<Item = &str> {
    log.lines().filter(|l| {
        let t = l.trim_start();
        t.starts_with("ERROR ") || t.contains("panicked at")
    })
}

impl Mount {
    /// Mount `lun` as node `host`; panics (with the daemon log) if the mount fails.
    pub fn new(lun: &Lun, host: &str) -> Self {
        Self::with_opts(lun, host, &[])
    }

    /// Mount with extra `-o` options (e.g. `["ro"]`).
    pub fn with_opts(lun: &Lun, host: &str, opts: &[&str]) -> Self {
        match Self::try_new(
            lun.path(),
            &lun.dir().join(format!("mnt-{host}")),
            host,
            opts,
        ) {
            Ok(m) => m,
            Err(r) => panic!("mounting {} as {host} failed: {r}", lun.path().display()),
        }
    }

    /// [`Mount::with_opts`] with extra environment variables for the daemon (e.g.
    /// `CETRA_WRITE_LOG`, `CETRA_FAILPOINT`).
    pub fn with_opts_env(lun: &Lun, host: &str, opts: &[&str], env: &[(&str, &str)]) -> Self {
        match Self::try_new_env(
            lun.path(),
            &lun.dir().join(format!("mnt-{host}")),
            host,
            opts,
            env,
        ) {
            Ok(m) => m,
            Err(r) => panic!(
                "mounting {} as {host} (env {env:?}) failed: {r}",
                lun.path().display()
            ),
        }
    }

    /// Start the daemon on `device` at `mountpoint` (created if needed). On failure returns the
    /// daemon's exit status and output (with its log file appended to stderr).
    pub fn try_new(
        device: &Path,
        mountpoint: &Path,
        host: &str,
        opts: &[&str],
    ) -> Result<Self, CmdResult> {
        Self::try_new_env(device, mountpoint, host, opts, &[])
    }

    /// [`Mount::try_new`] with extra environment variables for the daemon.
    pub fn try_new_env(
        device: &Path,
        mountpoint: &Path,
        host: &str,
        opts: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self, CmdResult> {
        Self::try_new_within(device, mountpoint, host, opts, env, None)
    }

    /// [`Mount::try_new_env`] that gives up after `timeout` (None: wait as long as it takes).
    /// A mount that does not come up in time is killed, daemon included, and reported as
    /// exit code -1 with "timed out" in stderr (the daemon log appended as for any failure).
    pub fn try_new_within(
        device: &Path,
        mountpoint: &Path,
        host: &str,
        opts: &[&str],
        env: &[(&str, &str)],
        timeout: Option<Duration>,
    ) -> Result<Self, CmdResult> {
        become_subreaper();
        fs::create_dir_all(mountpoint).expect("create mountpoint");
        let mountpoint = fs::canonicalize(mountpoint).expect("canonical mountpoint");
        let log = mountpoint.with_file_name(format!(
            "{}.log",
            mountpoint
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        let mut o = vec![format!("host={host}")];
        o.extend(opts.iter().map(|s| (*s).to_string()));
        let log_start = fs::metadata(&log).map_or(0, |m| m.len());
        let mut cmd = Command::new(bin("mount-cetra"));
        cmd.arg(device)
            .arg(&mountpoint)
            .arg("-o")
            .arg(o.join(","))
            .env("CETRA_LOG_FILE", &log)
            .envs(env.iter().copied());
        let started = Instant::now();
        let mut r = match timeout {
            None => run(&mut cmd),
            Some(t) => run_timeout(&mut cmd, t).unwrap_or_else(|| CmdResult {
                code: -1,
                stdout: String::new(),
                stderr: format!("mount-cetra timed out: not mounted after {t:?}\n"),
            }),
        };
        if r.code != 0 {
            let _ = write!(
                r.stderr,
                "--- daemon log {} ---\n{}",
                log.display(),
                read_lossy(&log)
            );
            // A failed mount must not leave a daemon behind.
            for pid in daemon_pids(&mountpoint) {
                // SAFETY: signalling a pid we found serving our private mountpoint.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                let _ = wait_pid(pid, Duration::from_secs(5));
            }
            // A daemon killed after it mounted (a timed-out mount) leaves a dead mount point.
            if let Err(e) = lazy_unmount(&mountpoint) {
                let _ = writeln!(r.stderr, "--- cleanup: {e}");
            }
            return Err(r);
        }
        // The contract: exit 0 only once the mount is ready. Check it.
        let fstype = mount_fstype(&mountpoint);
        assert!(
            fstype.as_deref().is_some_and(|t| t.starts_with("fuse")),
            "mount-cetra exited 0 but {} is not a FUSE mount (fstype {fstype:?}); log:\n{}",
            mountpoint.display(),
            read_lossy(&log)
        );
        let pids = daemon_pids(&mountpoint);
        assert_eq!(
            pids.len(),
            1,
            "expected exactly one mount-cetra daemon for {}, found {pids:?} (after {:?})",
            mountpoint.display(),
            started.elapsed()
        );
        check_transport(&log, log_start);
        if let Ok(mut m) = MOUNTED.lock() {
            m.push((mountpoint.clone(), log.clone()));
        }
        Ok(Self {
            mountpoint,
            device: device.to_path_buf(),
            log,
            log_start,
            allowed_errors: Vec::new(),
            pid: pids[0],
            mounted: true,
        })
    }

    /// Accept ERROR lines containing `pattern` in this daemon's log: for a test that provokes
    /// that error on purpose. Keep patterns specific to the one message expected.
    pub fn allow_error(&mut self, pattern: &str) -> &mut Self {
        self.allowed_errors.push(pattern.to_string());
        self
    }

    /// This daemon's part of its log file.
    pub fn own_log(&self) -> String {
        let all = fs::read(&self.log).unwrap_or_default();
        let start = usize::try_from(self.log_start)
            .unwrap_or(usize::MAX)
            .min(all.len());
        String::from_utf8_lossy(&all[start..]).into_owned()
    }

    /// ERROR lines (and panics) in this daemon's log that no [`Mount::allow_error`] pattern
    /// matches.
    pub fn unexpected_errors(&self) -> Vec<String> {
        error_lines(&self.own_log())
            .filter(|l| !self.allowed_errors.iter().any(|a| l.contains(a.as_str())))
            .map(str::to_string)
            .collect()
    }

    /// Err listing the unexpected ERROR lines of the log, if any.
    pub fn check_log(&self) -> Result<(), String> {
        let bad = self.unexpected_errors();
        if bad.is_empty() {
            return Ok(());
        }
        Err(format!(
            "daemon log {} has {} unexpected ERROR line(s) (allowed: {:?}):\n{}\n--- log ---\n{}",
            self.log.display(),
            bad.len(),
            self.allowed_errors,
            bad.join("\n"),
            self.own_log()
        ))
    }

    pub fn path(&self) -> &Path {
        &self.mountpoint
    }
    /// `path` joined under the mountpoint.
    pub fn p(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.mountpoint.join(rel)
    }
    pub fn device(&self) -> &Path {
        &self.device
    }
    pub fn pid(&self) -> i32 {
        self.pid
    }
    pub fn log_path(&self) -> &Path {
        &self.log
    }
    pub fn log(&self) -> String {
        read_lossy(&self.log)
    }

    /// Unmount and wait for the daemon to exit; Err describes what went wrong (with the log).
    pub fn try_unmount(&mut self) -> Result<(), String> {
        if !self.mounted {
            return Ok(());
        }
        self.mounted = false;
        let r = umount_path(&self.mountpoint);
        if let Err(e) = r {
            // Keep the daemon from lingering: lazy unmount, then wait.
            let _ = nix::mount::umount2(&self.mountpoint, nix::mount::MntFlags::MNT_DETACH);
            let st = wait_pid(self.pid, Duration::from_secs(10));
            return Err(format!(
                "umount {} failed: {e}; daemon {st:?}\nlog:\n{}",
                self.mountpoint.display(),
                self.log()
            ));
        }
        match wait_pid(self.pid, DAEMON_TIMEOUT) {
            Some(Exit::Code(0) | Exit::Unknown) => self.check_log(),
            Some(st) => Err(format!(
                "daemon {} for {} exited with {st:?} after umount\nlog:\n{}",
                self.pid,
                self.mountpoint.display(),
                self.log()
            )),
            None => {
                // SAFETY: killing the daemon we started, found by its private mountpoint.
                unsafe { libc::kill(self.pid, libc::SIGKILL) };
                let _ = wait_pid(self.pid, Duration::from_secs(5));
                Err(format!(
                    "daemon {} did not exit within {DAEMON_TIMEOUT:?} of umount {}\nlog:\n{}",
                    self.pid,
                    self.mountpoint.display(),
                    self.log()
                ))
            }
        }
    }

    /// Unmount; panics if the daemon does not exit 0.
    pub fn unmount(mut self) {
        if let Err(e) = self.try_unmount() {
            panic!("{e}");
        }
    }

    /// Send `sig` to the daemon (SIGSTOP, SIGCONT, SIGKILL...).
    pub fn signal(&self, sig: libc::c_int) -> io::Result<()> {
        // SAFETY: signalling the daemon we started (found by its private mountpoint).
        cvt(unsafe { libc::kill(self.pid, sig) }).map(|_| ())
    }

    /// Wait (without unmounting) for the daemon to exit on its own; None if it is still running
    /// after `timeout`.
    pub fn wait_exit(&self, timeout: Duration) -> Option<Exit> {
        wait_pid(self.pid, timeout)
    }

    /// Give up on this mount: send `sig` (if any) to the daemon, wait for it to exit, then
    /// detach the mount point lazily (`umount -l`, else `fusermount3 -uz`) — how a dead FUSE
    /// mount is cleaned up. Returns the daemon's exit (Unknown if it was already reaped).
    pub fn abandon(mut self, sig: Option<libc::c_int>) -> Result<Exit, String> {
        self.mounted = false;
        if let Some(sig) = sig {
            if let Err(e) = self.signal(sig) {
                // ESRCH: already gone, which is fine.
                if errno_of(&e) != libc::ESRCH {
                    return Err(format!("kill({}, {sig}): {e}", self.pid));
                }
            }
        }
        let st = wait_pid(self.pid, Duration::from_secs(30))
            .ok_or_else(|| format!("daemon {} still alive 30 s after signal {sig:?}", self.pid))?;
        lazy_unmount(&self.mountpoint)?;
        self.check_log()?;
        Ok(st)
    }

    /// Unmount without insisting on exit 0 (a fenced node may report that it could not flush):
    /// the daemon must exit and the mount point must be gone. Returns the daemon's exit.
    pub fn unmount_any_status(mut self) -> Result<Exit, String> {
        self.mounted = false;
        if let Err(e) = umount_path(&self.mountpoint) {
            eprintln!(
                "umount {} failed ({e}); detaching lazily",
                self.mountpoint.display()
            );
            lazy_unmount(&self.mountpoint)?;
        }
        let st = wait_pid(self.pid, DAEMON_TIMEOUT).ok_or_else(|| {
            // SAFETY: killing the daemon we started, found by its private mountpoint.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
            let _ = wait_pid(self.pid, Duration::from_secs(5));
            format!(
                "daemon {} did not exit within {DAEMON_TIMEOUT:?} of umount {}\nlog:\n{}",
                self.pid,
                self.mountpoint.display(),
                self.log()
            )
        })?;
        if let Some(t) = mount_fstype(&self.mountpoint) {
            return Err(format!(
                "{} still mounted ({t}) after unmount",
                self.mountpoint.display()
            ));
        }
        self.check_log()?;
        Ok(st)
    }
}

/// Detach a (possibly dead) FUSE mount lazily: `umount2(MNT_DETACH)`, else `fusermount3 -uz`.
/// Ok if nothing is mounted there afterwards.
pub fn lazy_unmount(p: &Path) -> Result<(), String> {
    if mount_fstype(p).is_none() {
        return Ok(());
    }
    if let Err(e) = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH) {
        let o = Command::new("fusermount3")
            .arg("-uz")
            .arg(p)
            .stdin(Stdio::null())
            .output();
        if !o.as_ref().is_ok_and(|o| o.status.success()) {
            return Err(format!(
                "lazy unmount of {}: {e}; fusermount3 -uz: {o:?}",
                p.display()
            ));
        }
    }
    match mount_fstype(p) {
        Some(t) => Err(format!(
            "{} still mounted ({t}) after lazy unmount",
            p.display()
        )),
        None => Ok(()),
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = self.try_unmount() {
            if std::thread::panicking() {
                eprintln!("(while unwinding) {e}");
            } else {
                panic!("{e}");
            }
        }
    }
}

/// Unmount a FUSE mountpoint: fusermount3 -u if present, else umount(2). Retries EBUSY briefly
/// (a just-closed file may still be releasing).
pub fn umount_path(p: &Path) -> Result<(), String> {
    let start = Instant::now();
    loop {
        let err = match nix::mount::umount(p) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if err == nix::errno::Errno::EBUSY && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        // Not root or no permission: try fusermount3.
        let r = Command::new("fusermount3")
            .arg("-u")
            .arg(p)
            .stdin(Stdio::null())
            .output();
        return match r {
            Ok(o) if o.status.success() => Ok(()),
            Ok(o) => Err(format!(
                "umount: {err}; fusermount3 -u: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(_) => Err(format!("umount: {err}")),
        };
    }
}

pub fn read_lossy(p: &Path) -> String {
    fs::read(p).map_or_else(
        |e| format!("<{}: {e}>", p.display()),
        |b| String::from_utf8_lossy(&b).into_owned(),
    )
}

// ---------------------------------------------------------------------------------------------
// Small utilities

/// A heap buffer aligned for `O_DIRECT`.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub const ALIGN: usize = 4096;
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(1), Self::ALIGN).expect("layout")
    }
    /// A zeroed buffer of `len` bytes aligned to 4096.
    pub fn new(len: usize) -> Self {
        // SAFETY: the layout has non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(Self::layout(len)) };
        let ptr = std::ptr::NonNull::new(p)
            .unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout(len)));
        Self { ptr, len }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes and uniquely borrowed through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// errno of an `io::Error` (0 if it has none).
pub fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// Human name of an errno value.
pub fn errno_name(e: i32) -> String {
    format!("{:?}", nix::errno::Errno::from_raw(e))
}

/// Result of a libc call returning -1 on error, as `io::Result`.
pub fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path without NUL")
}

/// statvfs of a path.
pub fn statvfs(p: &Path) -> libc::statvfs {
    let c = cstr(p);
    // SAFETY: zeroed statvfs is a valid out-buffer.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-pointer.
    cvt(unsafe { libc::statvfs(c.as_ptr(), &raw mut s) })
        .unwrap_or_else(|e| panic!("statvfs {}: {e}", p.display()));
    s
}

/// lstat with nanosecond times.
pub fn lstat(p: &Path) -> io::Result<libc::stat> {
    let c = cstr(p);
    // SAFETY: zeroed stat is a valid out-buffer.
    let mut s: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-pointer.
    cvt(unsafe { libc::lstat(c.as_ptr(), &raw mut s) })?;
    Ok(s)
}

/// `CETRA_EXPECT_TRANSPORT=uring|classic` (scripts/test runs the end-to-end tests once with
/// each): the daemon that just mounted must say it serves FUSE requests that way, so a pass
/// meant for FUSE over `io_uring` cannot quietly run on /dev/fuse.
fn check_transport(log: &Path, log_start: u64) {
    let Ok(want) = std::env::var("CETRA_EXPECT_TRANSPORT") else {
        return;
    };
    let line = match want.as_str() {
        "uring" => "FUSE transport: FUSE over io_uring",
        "classic" => "FUSE transport: classic /dev/fuse",
        other => panic!("CETRA_EXPECT_TRANSPORT={other}: expected uring or classic"),
    };
    let text = read_lossy(log);
    let own = text
        .get(usize::try_from(log_start).unwrap_or(0)..)
        .unwrap_or(&text);
    assert!(
        own.contains(line),
        "CETRA_EXPECT_TRANSPORT={want}, but the daemon's log ({}) does not say {line:?}:\n{own}",
        log.display()
    );
}

/// Seed for a randomized test: `$CETRA_SEED` if set, else random. Printed so failures can be replayed.
pub fn seed(test: &str) -> u64 {
    let s = std::env::var("CETRA_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{test}: seed {s} (replay with CETRA_SEED={s})");
    let _ = io::stderr().flush();
    s
}

/// Extended attributes of `p` (not following symlinks), sorted by name.
pub fn list_xattrs(p: &Path) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let c = cstr(p);
    // SAFETY: size query with a null buffer.
    let n = unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut names = vec![0u8; usize::try_from(n).unwrap_or(0) + 256];
    // SAFETY: buffer of the given length.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    names.truncate(usize::try_from(n).unwrap_or(0));
    let mut out = Vec::new();
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let v = get_xattr(p, name)?;
        out.push((name.to_vec(), v));
    }
    out.sort();
    Ok(out)
}

pub fn get_xattr(p: &Path, name: &[u8]) -> io::Result<Vec<u8>> {
    let c = cstr(p);
    let cn = CString::new(name).expect("xattr name without NUL");
    let mut v = vec![0u8; 65536];
    // SAFETY: valid C strings and buffer of the given length.
    let n = unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    v.truncate(usize::try_from(n).unwrap_or(0));
    Ok(v)
}

pub fn set_xattr(p: &Path, name: &[u8], value: &[u8], flags: libc::c_int) -> io::Result<()> {
    let c = cstr(p);
    let cn = CString::new(name).expect("xattr name without NUL");
    // SAFETY: valid C strings and value buffer.
    cvt(unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            cn.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            flags,
        )
    })
    .map(|_| ())
}

pub fn remove_xattr(p: &Path, name: &[u8]) -> io::Result<()> {
    let c = cstr(p);
    let cn = CString::new(name).expect("xattr name without NUL");
    // SAFETY: valid C strings.
    cvt(unsafe { libc::lremovexattr(c.as_ptr(), cn.as_ptr()) }).map(|_| ())
}

/// Is `cmd` on PATH?
pub fn have_command(cmd: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {cmd} >/dev/null 2>&1"))
        .status()
        .is_ok_and(|s| s.success())
}

/// Read every extent of inode `ino` from an (unmounted) volume image: inline extents or the
/// extent tree. Used by tests that check allocation quality from outside.
pub fn read_extents(
    device: &Path,
    ino: u64,
) -> anyhow::Result<Vec<cetrafs_core::format::extent::Extent>> {
    use cetrafs_core::format::extent::Extent;
    use cetrafs_core::format::inode::{flags, Inode};
    use cetrafs_core::format::tree_node::{NodeEntries, TreeNode};
    use cetrafs_core::format::FS_BLOCK;
    use std::os::unix::fs::FileExt;
    let f = fs::File::open(device)?;
    let block = |b: u64| -> anyhow::Result<Vec<u8>> {
        let mut buf = vec![0u8; cetrafs_core::format::FS_BLOCK_SIZE];
        f.read_exact_at(&mut buf, b * FS_BLOCK)?;
        Ok(buf)
    };
    let inode = Inode::decode(&block(ino)?, ino)?;
    anyhow::ensure!(
        inode.is_reg(),
        "inode {ino} is not a regular file (mode {:o})",
        inode.mode
    );
    if inode.flags & flags::INLINE_EXTENTS != 0 {
        return Ok(inode.inline_extents);
    }
    let mut out: Vec<Extent> = Vec::new();
    if inode.tree_root == 0 {
        return Ok(out);
    }
    let mut stack = vec![inode.tree_root];
    let mut visited = 0usize;
    while let Some(b) = stack.pop() {
        visited += 1;
        anyhow::ensure!(
            visited < 1_000_000,
            "extent tree of inode {ino} too large or cyclic"
        );
        let node = TreeNode::decode(&block(b)?, b)?;
        match node.entries {
            NodeEntries::Leaf(v) => {
                for (k, val) in v {
                    out.push(Extent::decode_value(k, &val)?);
                }
            }
            NodeEntries::Internal(v) => stack.extend(v.iter().rev().map(|(_, c)| *c)),
        }
    }
    out.sort_by_key(|e| e.logical);
    Ok(out)
}

/// Number of physically discontiguous runs in a sorted extent list (adjacent extents that
/// continue both logically and physically count as one run).
pub fn physical_runs(ext: &[cetrafs_core::format::extent::Extent]) -> usize {
    let mut runs = 0;
    let mut prev: Option<&cetrafs_core::format::extent::Extent> = None;
    for e in ext {
        let contiguous = prev
            .is_some_and(|p| p.end() == e.logical && p.physical + u64::from(p.len) == e.physical);
        if !contiguous {
            runs += 1;
        }
        prev = Some(e);
    }
    runs
}

/// Poll `cond` every 20 ms until it is true; returns the time it took, or None once `timeout`
/// has passed (the condition is evaluated one last time at the deadline).
pub fn poll_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    loop {
        let before = start.elapsed();
        if cond() {
            return Some(before);
        }
        if before >= timeout {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// [`poll_until`] that panics with `what` on timeout; returns the elapsed time.
pub fn wait_until(timeout: Duration, what: &str, cond: impl FnMut() -> bool) -> Duration {
    poll_until(timeout, cond)
        .unwrap_or_else(|| panic!("timed out after {timeout:?} waiting until {what}"))
}

/// `CLOCK_REALTIME` in nanoseconds (the clock of device write logs, `CETRA_WRITE_LOG`).
pub use cetrafs_core::dev::write_log::realtime_ns;

/// Format a duration compactly for test reports.
pub fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::error_lines;

    #[test]
    fn error_lines_are_found_in_daemon_logs() {
        let log = " INFO mount_cetra::daemon: mounted\n\
                   ERROR fuser::reply: Failed to send FUSE reply: Invalid argument\n\
                   \u{20}WARN cetrafs_core: an ERROR in a message is not an ERROR line\n\
                   thread 'x' panicked at src/lib.rs:1:1:\n";
        let v: Vec<&str> = error_lines(log).collect();
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(v[0].starts_with("ERROR fuser::reply"));
    }
}
