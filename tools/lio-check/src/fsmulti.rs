//! `lio-check fs-multi`: the multi-node filesystem scenarios of issue 5 on real SCSI
//! initiators. One LUN exported through several `tcm_loop` nexuses (= several independent
//! initiators, `/dev/sdX` each) is formatted once and mounted by one `mount.cetra` daemon per
//! nexus (`-o host=node1..3`), then:
//!
//! 1. every daemon must log that it drives COMPARE AND WRITE through `SG_IO` (multi-node);
//! 2. cross-node visibility: write+fsync on node1 read on node2/node3, rename on node2 seen on
//!    node1, unlink on node3 seen on node1 and node2 (each poll reports how long it took);
//! 3. concurrent writers: every node creates files in one shared directory at once and writes
//!    a small image into each with `O_DIRECT`; every node lists the same set afterwards and each
//!    image verifies from another node;
//! 4. SIGKILL node2's daemon and detach its mount: a survivor must log "recovered ... node2"
//!    within the dead time plus slack; the survivors keep working; node2 mounts again;
//! 5. unmount everything: every daemon exits 0, `fsck.cetra -n` is clean;
//! 6. however far 1-5 got: every node's daemon log has no ERROR line and no panic
//!    (`daemonlog.rs`; no scenario provokes one on purpose, see [`PROVOKED_ERRORS`]).
//!
//! Every step prints one `PASS`/`FAIL fs-TAG ...` line. All file system calls run on helper
//! threads with deadlines, so a hanging daemon becomes a FAIL line (and the daemons are killed
//! so the stuck calls return) instead of a wedged guest. Any failure prints the daemon logs.

use crate::{daemonlog, get, num, Report};
use cetrafs_core::dev::{AlignedBuf, BlockDevice};
use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub(crate) type CheckResult = Result<String, String>;

const IMAGE_BLOCK: usize = 4096;
/// One image per file: two 4 KiB blocks written with one `O_DIRECT` write.
const IMAGE_LEN: usize = 2 * IMAGE_BLOCK;
/// How long a visibility poll keeps looking (to report how late a change was).
const VISIBILITY_GIVE_UP: Duration = Duration::from_secs(15);
/// Deadline of one ordinary file system step (a few FUSE calls).
pub(crate) const STEP_LIMIT: Duration = Duration::from_secs(30);
/// Beyond the dead time, recovery (journal replay, lock release) may take this long.
pub(crate) const RECOVERY_SLACK: Duration = Duration::from_secs(20);
/// How long a mount or a daemon's exit after umount may take (mount waits 2 × `io_timeout`).
pub(crate) const DAEMON_LIMIT: Duration = Duration::from_secs(40);
/// ERROR lines the scenarios provoke on purpose (fixed substrings, `daemonlog.rs`): none.
/// SIGKILL gives node2's daemon no chance to log (its log just ends, perhaps mid-line), and
/// the survivor reports the dead node and its recovery at WARN; every other step is normal
/// operation, so any ERROR line in any node's log fails the run.
const PROVOKED_ERRORS: &[&str] = &[];

pub(crate) fn secs(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

/// Run `f` on its own thread; give up after `limit` (the thread is left behind: a FUSE call
/// that hangs returns once its daemon is killed at cleanup).
pub(crate) fn timed<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(_) => Err(format!(
            "{what}: no answer within {} (a file system call hangs)",
            secs(limit)
        )),
    }
}

/// Poll `f` until it returns Ok(true) (or an error), at most `limit`; the elapsed time.
pub(crate) fn poll(
    limit: Duration,
    mut f: impl FnMut() -> Result<bool, String>,
) -> Result<Duration, String> {
    let t = Instant::now();
    loop {
        if f()? {
            return Ok(t.elapsed());
        }
        if t.elapsed() >= limit {
            return Err(format!("not seen within {}", secs(limit)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Deterministic content of one block of one image: header + xorshift stream.
fn fill_image(buf: &mut [u8], node: usize, idx: usize) {
    for (b, blk) in buf.chunks_mut(IMAGE_BLOCK).enumerate() {
        let mut s: u64 =
            0x9E37_79B9_7F4A_7C15 ^ ((node as u64) << 40 | (idx as u64) << 16 | b as u64);
        for w in blk.chunks_mut(8) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let n = w.len();
            w.copy_from_slice(&s.to_le_bytes()[..n]);
        }
        let hdr = format!("node{} file {idx} block {b}\n", node + 1);
        blk[..hdr.len()].copy_from_slice(hdr.as_bytes());
    }
}

fn busy_image(k: usize) -> Vec<u8> {
    format!("node2 busy file {k}\n")
        .repeat(20 + k % 50)
        .into_bytes()
}

fn write_direct(path: &Path, data: &[u8]) -> Result<(), String> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| format!("create {} O_DIRECT: {e}", path.display()))?;
    f.write_all(data)
        .map_err(|e| format!("O_DIRECT write {}: {e}", path.display()))?;
    f.sync_all()
        .map_err(|e| format!("fsync {}: {e}", path.display()))
}

fn write_fsync(path: &Path, data: &[u8]) -> Result<(), String> {
    let mut f = fs::File::create(path).map_err(|e| format!("create {}: {e}", path.display()))?;
    f.write_all(data)
        .map_err(|e| format!("write {}: {e}", path.display()))?;
    f.sync_all()
        .map_err(|e| format!("fsync {}: {e}", path.display()))
}

/// Ok(Some(bytes)), Ok(None) for ENOENT, Err otherwise.
fn read_opt(path: &Path) -> Result<Option<Vec<u8>>, String> {
    match fs::File::open(path) {
        Ok(mut f) => {
            let mut v = Vec::new();
            f.read_to_end(&mut v)
                .map_err(|e| format!("read {}: {e}", path.display()))?;
            Ok(Some(v))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("open {}: {e}", path.display())),
    }
}

fn exists(path: &Path) -> Result<bool, String> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(format!("stat {}: {e}", path.display())),
    }
}

fn list(dir: &Path) -> Result<BTreeSet<String>, String> {
    fs::read_dir(dir)
        .map_err(|e| format!("readdir {}: {e}", dir.display()))?
        .map(|e| {
            e.map(|e| e.file_name().to_string_lossy().into_owned())
                .map_err(|e| format!("readdir {}: {e}", dir.display()))
        })
        .collect()
}

/// Wait for a child process with a deadline; kill it when the deadline passes.
pub(crate) fn wait_child(
    mut c: Child,
    limit: Duration,
) -> Result<(std::process::ExitStatus, String), String> {
    let t = Instant::now();
    loop {
        match c.try_wait().map_err(|e| e.to_string())? {
            Some(st) => {
                let mut out = String::new();
                if let Some(mut o) = c.stdout.take() {
                    let _ = o.read_to_string(&mut out);
                }
                return Ok((st, out));
            }
            None if t.elapsed() > limit => {
                let _ = c.kill();
                let _ = c.wait();
                return Err(format!("did not finish within {}", secs(limit)));
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// stdout and stderr of a command together (through one pipe, so their order is kept).
pub(crate) fn spawn_merged(
    prog: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<Child, String> {
    let (rd, wr) = std::io::pipe().map_err(|e| e.to_string())?;
    let wr2 = wr.try_clone().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(prog);
    cmd.args(args).stdin(Stdio::null()).stdout(wr).stderr(wr2);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut c = cmd.spawn().map_err(|e| format!("{prog}: {e}"))?;
    drop(cmd);
    // the Child's stdout is our read end
    c.stdout = Some(std::process::ChildStdout::from(std::os::fd::OwnedFd::from(
        rd,
    )));
    Ok(c)
}

fn daemon_pid(mp: &Path) -> Option<i32> {
    let want = mp.as_os_str().as_encoded_bytes();
    for e in fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let argv: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        if argv.first().is_some_and(|a| a.ends_with(b"mount.cetra")) && argv.contains(&want) {
            return Some(pid);
        }
    }
    None
}

/// Reap `pid` (we are its subreaper); Some(status text) once it has exited.
pub(crate) fn reap(pid: i32) -> Option<String> {
    let mut st = 0;
    // SAFETY: waitpid on a child (or orphaned descendant reparented to us) with WNOHANG.
    let r = unsafe { libc::waitpid(pid, &raw mut st, libc::WNOHANG) };
    if r == pid {
        return Some(if libc::WIFEXITED(st) {
            format!("exit {}", libc::WEXITSTATUS(st))
        } else if libc::WIFSIGNALED(st) {
            format!("signal {}", libc::WTERMSIG(st))
        } else {
            format!("status {st:#x}")
        });
    }
    if r < 0 && !Path::new(&format!("/proc/{pid}")).exists() {
        return Some("gone (not our child)".into());
    }
    None
}

pub(crate) fn wait_exit(pid: i32, limit: Duration) -> Result<(String, Duration), String> {
    let t = Instant::now();
    loop {
        if let Some(s) = reap(pid) {
            return Ok((s, t.elapsed()));
        }
        if t.elapsed() > limit {
            return Err(format!("daemon {pid} still running after {}", secs(limit)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) fn umount(mp: &Path, lazy: bool) -> Result<(), String> {
    let c = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    for _ in 0..50 {
        // SAFETY: a valid NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(format!("umount {}: {e}", mp.display()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!("umount {}: still busy after 5 s", mp.display()))
}

pub(crate) struct Node {
    pub(crate) host: String,
    pub(crate) dev: String,
    pub(crate) mp: PathBuf,
    pub(crate) log: PathBuf,
    pub(crate) pid: Option<i32>,
    /// Mount options beyond `host=` (`,fence=pr`), with the leading comma.
    pub(crate) opts: String,
    /// Environment of the daemon beyond `CETRA_LOG_FILE` (failpoints).
    pub(crate) env: Vec<(String, String)>,
}

pub(crate) struct Scenario<'a> {
    pub(crate) tag: String,
    pub(crate) nodes: Vec<Node>,
    pub(crate) rep: &'a mut Report,
    pub(crate) failed: bool,
    pub(crate) summary: Vec<String>,
}

impl Node {
    /// node1..node3 on the first three of `devs`, mounted at `/mnt/TAG-nN`, logging to
    /// `/tmp/TAG-nodeN.log`, with mount options `opts` (leading comma) and no extra environment.
    pub(crate) fn three(devs: &[String], tag: &str, opts: &str) -> Vec<Node> {
        devs.iter()
            .take(3)
            .enumerate()
            .map(|(i, d)| Node {
                host: format!("node{}", i + 1),
                dev: d.clone(),
                mp: PathBuf::from(format!("/mnt/{tag}-n{}", i + 1)),
                log: PathBuf::from(format!("/tmp/{tag}-node{}.log", i + 1)),
                pid: None,
                opts: opts.to_string(),
                env: Vec::new(),
            })
            .collect()
    }
}

/// The first line of `log` after line `skip` containing every one of `what`, and its index.
pub(crate) fn line_with(log: &str, skip: usize, what: &[&str]) -> Option<(usize, String)> {
    log.lines()
        .enumerate()
        .skip(skip)
        .find(|(_, l)| what.iter().all(|w| l.contains(w)))
        .map(|(i, l)| (i, l.to_string()))
}

impl<'a> Scenario<'a> {
    pub(crate) fn new(tag: &str, nodes: Vec<Node>, rep: &'a mut Report) -> Self {
        Scenario {
            tag: tag.to_string(),
            nodes,
            rep,
            failed: false,
            summary: Vec::new(),
        }
    }

    /// Poll the logs of the nodes `which` (past line `skip[i]` of node i's) until one holds a
    /// line with every word of `what`, at most `limit`: (node, line index, line).
    pub(crate) fn wait_log_line(
        &self,
        which: &[usize],
        skip: &[usize],
        what: &[&str],
        limit: Duration,
    ) -> Option<(usize, usize, String)> {
        let mut found = None;
        let _ = poll(limit, || {
            found = which.iter().find_map(|&i| {
                line_with(&self.log_of(i), skip[i], what).map(|(idx, l)| (i, idx, l))
            });
            Ok(found.is_some())
        });
        found
    }

    /// Every daemon's whole log: no panic, and no ERROR line but those `allowed` (substrings)
    /// in the logs of the nodes `allowed_on`.
    pub(crate) fn check_logs(&mut self, allowed: &[&str], allowed_on: &[usize]) {
        for i in 0..self.nodes.len() {
            let (host, log) = (self.nodes[i].host.clone(), self.nodes[i].log.clone());
            let allowed = if allowed_on.contains(&i) {
                allowed
            } else {
                &[]
            };
            let r = daemonlog::verdict_file(&self.tag, &host, &log, allowed);
            let name = if allowed.is_empty() {
                format!("{host} log has no ERROR line")
            } else {
                format!("{host} log has no ERROR line but {allowed:?}")
            };
            self.check(&name, r);
        }
    }

    pub(crate) fn check(&mut self, name: &str, r: CheckResult) -> bool {
        let ok = r.is_ok();
        if !ok {
            self.failed = true;
        }
        self.rep.check(&self.tag, name, r);
        ok
    }

    pub(crate) fn mp(&self, i: usize) -> PathBuf {
        self.nodes[i].mp.clone()
    }

    /// One /proc/PID/status field (`VmRSS:`, `VmHWM:`) of every running daemon.
    fn rss(&self, field: &str) -> String {
        let v: Vec<String> = self
            .nodes
            .iter()
            .filter_map(|n| {
                let st = fs::read_to_string(format!("/proc/{}/status", n.pid?)).ok()?;
                let l = st.lines().find(|l| l.starts_with(field))?;
                Some(format!("{} {}", n.host, l.trim_start_matches(field).trim()))
            })
            .collect();
        v.join(", ")
    }

    pub(crate) fn log_of(&self, i: usize) -> String {
        fs::read_to_string(&self.nodes[i].log).unwrap_or_default()
    }

    pub(crate) fn dump_logs(&self) {
        for n in &self.nodes {
            let log = fs::read_to_string(&n.log).unwrap_or_else(|e| format!("(no log: {e})"));
            let lines: Vec<&str> = log.lines().collect();
            let from = lines.len().saturating_sub(150);
            println!(
                "OUT {} {}.log ({} lines{}):",
                self.tag,
                n.host,
                lines.len(),
                if from > 0 { ", last 150" } else { "" }
            );
            for l in &lines[from..] {
                println!("OUT {} {}: {l}", self.tag, n.host);
            }
        }
    }

    /// Mount the given nodes at once; returns the per-node results.
    pub(crate) fn mount(&mut self, which: &[usize]) -> Vec<Result<String, String>> {
        let t = Instant::now();
        let children: Vec<_> = which
            .iter()
            .map(|&i| {
                let n = &self.nodes[i];
                let _ = fs::create_dir_all(&n.mp);
                let opt = format!("host={}{}", n.host, n.opts);
                let log = n.log.to_string_lossy();
                let mut env: Vec<(&str, &str)> = vec![("CETRA_LOG_FILE", &log)];
                env.extend(n.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
                spawn_merged(
                    "mount.cetra",
                    &[&n.dev, &n.mp.to_string_lossy(), "-o", &opt],
                    &env,
                )
            })
            .collect();
        let mut out = Vec::new();
        for (c, &i) in children.into_iter().zip(which) {
            let r = c.and_then(|c| wait_child(c, DAEMON_LIMIT)).and_then(|(st, o)| {
                if !st.success() {
                    return Err(format!("mount.cetra {}: {st}: {}", self.nodes[i].dev, o.trim()));
                }
                let pid = daemon_pid(&self.nodes[i].mp)
                    .ok_or_else(|| format!("no mount.cetra process for {}", self.nodes[i].mp.display()))?;
                self.nodes[i].pid = Some(pid);
                let log = self.log_of(i);
                let line = log
                    .lines()
                    .rev()
                    .find(|l| l.contains("COMPARE AND WRITE via SG_IO"))
                    .unwrap_or("");
                if !line.contains("multi-node (SCSI COMPARE AND WRITE verified)") {
                    return Err(format!(
                        "{} mounted (pid {pid}) but its log has no 'COMPARE AND WRITE via SG_IO ... multi-node (SCSI COMPARE AND WRITE verified)' line",
                        self.nodes[i].host
                    ));
                }
                let line = line.split("daemon: ").last().unwrap_or(line).trim();
                Ok(format!("pid {pid} after {}: {line}", secs(t.elapsed())))
            });
            out.push(r);
        }
        out
    }

    /// Kill whatever daemon is still running and detach every mount point (cleanup).
    pub(crate) fn teardown(&mut self) {
        for n in &mut self.nodes {
            if let Some(pid) = n.pid.take() {
                if reap(pid).is_none() {
                    // SAFETY: a daemon we started (its pid found by its private mount point).
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    let _ = wait_exit(pid, Duration::from_secs(5));
                }
            }
            let _ = umount(&n.mp, true);
        }
    }
}

/// `fs-multi --tag d512 --devs /dev/sda,/dev/sdb,/dev/sdc --interval MS --io-timeout MS
/// [--files N]`. Exit status 0 only if every check passed.
pub fn fs_multi(m: &HashMap<String, String>) -> Result<bool, String> {
    let tag = format!("fs-{}", get(m, "tag")?);
    let devs: Vec<String> = get(m, "devs")?.split(',').map(str::to_string).collect();
    let interval = num(m, "interval")?;
    let io_timeout = num(m, "io-timeout")?;
    let files = usize::try_from(m.get("files").map_or(Ok(50), |_| num(m, "files"))?)
        .map_err(|e| e.to_string())?;
    if devs.len() < 3 {
        return Err(format!("need 3 devices, got {devs:?}"));
    }
    // fence=auto takes persistent reservations on these LUNs; a dead node's key is removed
    // by PREEMPT unless `--preempt abort` (PREEMPT AND ABORT deadlocks LIO over tcm_loop).
    let preempt = m.get("preempt").map_or("plain", String::as_str).to_string();
    // The LUN's backstore file (fileio on tmpfs): its allocated size shows UNMAP working.
    let backing = m.get("backing").map(PathBuf::from);
    // The daemons fork away from mount.cetra; as their subreaper we can reap them and see
    // their exit status.
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let mut rep = Report { pass: 0, fail: 0 };
    let t_all = Instant::now();
    let nodes = Node::three(&devs, &tag, &format!(",pr_preempt={preempt}"));
    let mut s = Scenario::new(&tag, nodes, &mut rep);
    let dead_time = cetrafs_core::cluster::Timing::from_ms(
        u32::try_from(interval).map_err(|e| e.to_string())?,
        u32::try_from(io_timeout).map_err(|e| e.to_string())?,
    )
    .dead_time();
    let lun = Lun {
        devs: &devs,
        backing: backing.as_deref(),
    };
    run(&mut s, &lun, interval, io_timeout, files, dead_time);
    s.teardown();
    // ---- 6. every daemon log, however far the scenarios got: no ERROR line, no panic
    s.check_logs(PROVOKED_ERRORS, &[]);
    if s.failed {
        s.dump_logs();
    }
    let summary = std::mem::take(&mut s.summary);
    drop(s);
    for l in &summary {
        println!("SUMMARY {tag} {l}");
    }
    let ok = rep.fail == 0 && rep.pass > 0;
    println!(
        "SUMMARY {tag}: {} passed, {} failed, {:.1}s",
        rep.pass,
        rep.fail,
        t_all.elapsed().as_secs_f64()
    );
    Ok(ok)
}

/// Bytes a file holds on its filesystem (`du`).
fn allocated(p: &Path) -> Result<u64, String> {
    use std::os::unix::fs::MetadataExt as _;
    fs::metadata(p)
        .map(|m| m.blocks() * 512)
        .map_err(|e| format!("stat {}: {e}", p.display()))
}

/// Space freed on the volume goes back to the LUN (`fs/discard.rs`): a file of 8 MiB written
/// on node1 and deleted; the backstore file shrinks by about as much within 15 s (UNMAP
/// through `SG_IO`, which LIO's fileio backend turns into a punched hole).
fn discard_reaches_the_backstore(s: &mut Scenario, backing: &Path) {
    const LEN: usize = 8 << 20;
    let (m1, backing) = (s.mp(0), backing.to_path_buf());
    let r = timed("discard reaches the backstore", STEP_LIMIT, move || {
        let data: Vec<u8> = (0..=250u8).cycle().take(LEN).collect();
        let p = m1.join("discard-me");
        write_fsync(&p, &data)?;
        let full = allocated(&backing)?;
        fs::remove_file(&p).map_err(|e| format!("delete {}: {e}", p.display()))?;
        let t = Instant::now();
        let want = full - (LEN as u64 - (1 << 20));
        poll(Duration::from_secs(15), || Ok(allocated(&backing)? <= want)).map_err(|e| {
            format!(
                "{}: {} KiB allocated before the delete, {:?} KiB 15 s after it: {e}",
                backing.display(),
                full >> 10,
                allocated(&backing).map(|b| b >> 10)
            )
        })?;
        Ok(format!(
            "{} KiB allocated in {} before the delete of 8 MiB on node1, {} KiB {} after",
            full >> 10,
            backing.display(),
            allocated(&backing)? >> 10,
            secs(t.elapsed())
        ))
    });
    s.check("discard: a deleted file's space leaves the backstore", r);
}

/// The LUN under test: its nexuses, and its backstore file when the caller named it.
struct Lun<'a> {
    devs: &'a [String],
    backing: Option<&'a Path>,
}

fn run(
    s: &mut Scenario,
    lun: &Lun<'_>,
    interval: u64,
    io_timeout: u64,
    files: usize,
    dead_time: Duration,
) {
    let devs = lun.devs;
    // ---- 0. the nexuses are one LUN (VPD 0x83), and mkfs once
    let ok = s.check(
        "3 nexuses, one LUN",
        (|| {
            let ids: Vec<String> = devs
                .iter()
                .map(|d| {
                    crate::open(d).map(|x| {
                        format!(
                            "{} ({} B blocks)",
                            x.geometry().identity,
                            x.geometry().logical_block_size
                        )
                    })
                })
                .collect::<Result<_, _>>()?;
            if ids.iter().any(|i| *i != ids[0]) {
                return Err(format!("{devs:?} -> {ids:?}"));
            }
            Ok(format!("{devs:?}: identity {}", ids[0]))
        })(),
    );
    if !ok {
        return;
    }
    if !mkfs_once(s, &devs[0], interval, io_timeout, dead_time) {
        return;
    }

    // ---- 1. three daemons, one per nexus, mounted at once
    let t = Instant::now();
    let res = s.mount(&[0, 1, 2]);
    let took = t.elapsed();
    let mut all = true;
    for (i, r) in res.into_iter().enumerate() {
        let host = s.nodes[i].host.clone();
        let dev = s.nodes[i].dev.clone();
        all &= s.check(&format!("mount {host} on {dev}"), r);
    }
    s.summary.push(format!("3 parallel mounts: {}", secs(took)));
    let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let avail = meminfo
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .unwrap_or("MemAvailable: ?");
    println!(
        "INFO {} after mounting: {}; daemon RSS {}",
        s.tag,
        avail.split_whitespace().collect::<Vec<_>>().join(" "),
        s.rss("VmRSS:")
    );
    if !all {
        return;
    }

    // ---- 2. cross-node visibility
    let (m1, m2, m3) = (s.mp(0), s.mp(1), s.mp(2));
    let mut payload = vec![0u8; 6000];
    fill_image(&mut payload[..4096], 0, 999_999);
    payload[4096..].fill(0x5A);
    let r = {
        let (m1, m2, m3, p) = (m1.clone(), m2.clone(), m3.clone(), payload.clone());
        timed(
            "write on node1, read on node2/node3",
            STEP_LIMIT + VISIBILITY_GIVE_UP * 2,
            move || {
                write_fsync(&m1.join("vis"), &p)?;
                let t = Instant::now();
                let mut out = Vec::new();
                for (host, mp) in [("node2", &m2), ("node3", &m3)] {
                    let seen = poll(VISIBILITY_GIVE_UP, || {
                        Ok(read_opt(&mp.join("vis"))?.is_some_and(|b| b == p))
                    })
                    .map_err(|e| format!("{host}: the {} bytes written on node1: {e}", p.len()))?;
                    let _ = seen;
                    out.push(format!("{host} after {}", secs(t.elapsed())));
                }
                Ok(format!(
                    "{} bytes fsync'd on node1; identical on {}",
                    p.len(),
                    out.join(", ")
                ))
            },
        )
    };
    s.check("visibility: write on node1 read on node2+node3", r);
    let r = {
        let (m1, m2) = (m1.clone(), m2.clone());
        let p = payload.clone();
        timed(
            "rename on node2",
            STEP_LIMIT + VISIBILITY_GIVE_UP,
            move || {
                fs::rename(m2.join("vis"), m2.join("vis-renamed"))
                    .map_err(|e| format!("rename on node2: {e}"))?;
                let seen = poll(VISIBILITY_GIVE_UP, || {
                    Ok(!exists(&m1.join("vis"))?
                        && read_opt(&m1.join("vis-renamed"))?.is_some_and(|b| b == p))
                })
                .map_err(|e| format!("node1: vis gone and vis-renamed with the data: {e}"))?;
                Ok(format!(
                    "node1 sees the new name (same bytes) and not the old after {}",
                    secs(seen)
                ))
            },
        )
    };
    s.check("visibility: rename on node2 seen on node1", r);
    let r = {
        let (m1, m2, m3) = (m1.clone(), m2.clone(), m3.clone());
        timed(
            "unlink on node3",
            STEP_LIMIT + VISIBILITY_GIVE_UP * 2,
            move || {
                fs::remove_file(m3.join("vis-renamed"))
                    .map_err(|e| format!("unlink on node3: {e}"))?;
                let t = Instant::now();
                let mut out = Vec::new();
                for (host, mp) in [("node1", &m1), ("node2", &m2)] {
                    poll(VISIBILITY_GIVE_UP, || Ok(!exists(&mp.join("vis-renamed"))?))
                        .map_err(|e| format!("{host}: vis-renamed gone: {e}"))?;
                    out.push(format!("{host} after {}", secs(t.elapsed())));
                }
                Ok(format!("gone on {}", out.join(", ")))
            },
        )
    };
    s.check("visibility: unlink on node3 seen on node1+node2", r);

    // ---- 3. concurrent writers in one shared directory
    let r = {
        let (m1, m2, m3) = (m1.clone(), m2.clone(), m3.clone());
        timed("mkdir shared", STEP_LIMIT + VISIBILITY_GIVE_UP, move || {
            fs::create_dir(m1.join("shared")).map_err(|e| format!("mkdir on node1: {e}"))?;
            let d = poll(VISIBILITY_GIVE_UP, || {
                Ok(exists(&m2.join("shared"))? && exists(&m3.join("shared"))?)
            })?;
            Ok(format!(
                "made on node1, seen on node2+node3 after {}",
                secs(d)
            ))
        })
    };
    if s.check("shared directory", r) {
        let (tx, rx) = mpsc::channel();
        let t0 = Instant::now();
        for i in 0..3 {
            let (tx, dir) = (tx.clone(), s.mp(i).join("shared"));
            std::thread::spawn(move || {
                let r = (|| {
                    let mut buf = AlignedBuf::new(IMAGE_LEN);
                    let t = Instant::now();
                    for k in 0..files {
                        fill_image(&mut buf, i, k);
                        write_direct(&dir.join(format!("node{}-{k:03}", i + 1)), &buf)?;
                    }
                    Ok(t.elapsed())
                })();
                let _ = tx.send((i, r));
            });
        }
        drop(tx);
        let limit = Duration::from_mins(2);
        let mut res: Vec<Option<Result<Duration, String>>> = vec![None, None, None];
        while let Ok((i, r)) = rx.recv_timeout(limit.saturating_sub(t0.elapsed())) {
            res[i] = Some(r);
        }
        let all_took = t0.elapsed();
        let mut errs = Vec::new();
        let mut per = Vec::new();
        for (i, r) in res.into_iter().enumerate() {
            match r {
                Some(Ok(d)) => per.push(format!("node{} {}", i + 1, secs(d))),
                Some(Err(e)) => errs.push(format!("node{}: {e}", i + 1)),
                None => errs.push(format!("node{}: not done within {}", i + 1, secs(limit))),
            }
        }
        let r = if errs.is_empty() {
            Ok(format!(
                "3 x {files} files of {IMAGE_LEN} B (create, O_DIRECT write, fsync) at once in {} ({})",
                secs(all_took),
                per.join(", ")
            ))
        } else {
            Err(errs.join("; "))
        };
        s.summary.push(format!(
            "concurrent writers 3 x {files}: {}",
            secs(all_took)
        ));
        println!(
            "INFO {} after the writers: daemon peak RSS {}",
            s.tag,
            s.rss("VmHWM:")
        );
        if s.check("concurrent writers", r) {
            let mps: Vec<PathBuf> = (0..3).map(|i| s.mp(i)).collect();
            let r = timed("list shared on every node", STEP_LIMIT * 2, move || {
                let want: BTreeSet<String> = (0..3)
                    .flat_map(|i| (0..files).map(move |k| format!("node{}-{k:03}", i + 1)))
                    .collect();
                let t = Instant::now();
                for (i, mp) in mps.iter().enumerate() {
                    let got = list(&mp.join("shared"))?;
                    if got != want {
                        let missing: Vec<_> = want.difference(&got).take(10).collect();
                        let extra: Vec<_> = got.difference(&want).take(10).collect();
                        return Err(format!(
                            "node{} lists {} names, want {}; missing {missing:?}, unexpected {extra:?}",
                            i + 1,
                            got.len(),
                            want.len()
                        ));
                    }
                }
                Ok(format!(
                    "all 3 nodes list the same {} names ({})",
                    want.len(),
                    secs(t.elapsed())
                ))
            });
            s.check("every node lists the same set", r);
            let mps: Vec<PathBuf> = (0..3).map(|i| s.mp(i)).collect();
            let r = timed(
                "verify images from another node",
                STEP_LIMIT * 2,
                move || {
                    let mut want = vec![0u8; IMAGE_LEN];
                    let t = Instant::now();
                    for writer in 0..3 {
                        let reader = (writer + 1) % 3;
                        for k in 0..files {
                            fill_image(&mut want, writer, k);
                            let p = mps[reader]
                                .join("shared")
                                .join(format!("node{}-{k:03}", writer + 1));
                            match read_opt(&p)? {
                            Some(b) if b == want => {}
                            Some(b) => {
                                return Err(format!(
                                    "{} read on node{}: {} bytes, differs from node{}'s image at byte {:?}",
                                    p.display(),
                                    reader + 1,
                                    b.len(),
                                    writer + 1,
                                    b.iter().zip(&want).position(|(a, c)| a != c)
                                ))
                            }
                            None => return Err(format!("{} missing", p.display())),
                        }
                        }
                    }
                    Ok(format!(
                        "{} images read on the next node (node1's on node2, ...) match ({})",
                        3 * files,
                        secs(t.elapsed())
                    ))
                },
            );
            s.check("images verify from another node", r);
        }
    }

    if let Some(b) = lun.backing {
        discard_reaches_the_backstore(s, b);
    }

    // ---- 4. SIGKILL node2, detach its mount, a survivor recovers it
    let Some(pid2) = s.nodes[1].pid else { return };
    // node2 dies busy: it keeps creating and fsync'ing files in its own directory until the
    // kill, so it holds locks and may leave journal work behind. Every file whose fsync
    // returned must survive its recovery.
    let (durable_tx, durable_rx) = mpsc::channel::<usize>();
    let busy_dir = m2.join("busy");
    let busy = std::thread::spawn(move || -> String {
        if let Err(e) = fs::create_dir(&busy_dir) {
            return format!("mkdir busy on node2: {e}");
        }
        for k in 0.. {
            if let Err(e) = write_fsync(&busy_dir.join(format!("busy-{k:04}")), &busy_image(k)) {
                return e;
            }
            if durable_tx.send(k).is_err() {
                break;
            }
        }
        String::new()
    });
    std::thread::sleep(Duration::from_millis(1500));
    // only log lines written after the kill count as the recovery
    let skip: Vec<usize> = (0..3).map(|i| s.log_of(i).lines().count()).collect();
    let t_kill = Instant::now();
    // SAFETY: node2's daemon, started by this program (pid found by its mount point).
    unsafe { libc::kill(pid2, libc::SIGKILL) };
    let st = wait_exit(pid2, Duration::from_secs(10));
    let det = umount(&m2, true);
    s.nodes[1].pid = None;
    // the busy writer's current call fails once the daemon is gone
    let busy_end = timed("node2's busy writer", Duration::from_secs(10), move || {
        busy.join().map_err(|_| "busy writer panicked".to_string())
    });
    let durable: Vec<usize> = durable_rx.try_iter().collect();
    let r = match (st, det, busy_end) {
        (Ok((st, _)), Ok(()), Ok(why)) if !durable.is_empty() => Ok(format!(
            "pid {pid2}: {st} while writing (it had fsync'd {} files; its next call: {why}); {} detached (umount -l)",
            durable.len(),
            m2.display()
        )),
        (st, det, b) => Err(format!(
            "{st:?} / {det:?} / busy writer {b:?} after {} fsync'd files",
            durable.len()
        )),
    };
    if !s.check("SIGKILL node2 + lazy unmount", r) {
        return;
    }
    let limit = dead_time + RECOVERY_SLACK;
    let found = s.wait_log_line(&[0, 2], &skip, &["recovered", "node2"], limit);
    let took = t_kill.elapsed();
    let r = match found {
        Some((i, _, l)) => {
            let l = l.split("WARN").last().unwrap_or(&l).trim().to_string();
            s.summary.push(format!(
                "recovery of node2: {} after SIGKILL (dead time {})",
                secs(took),
                secs(dead_time)
            ));
            Ok(format!(
                "node{} after {} (dead time {}): {l}",
                i + 1,
                secs(took),
                secs(dead_time)
            ))
        }
        None => Err(format!(
            "neither node1 nor node3 logged 'recovered ... node2' within {} of the kill (dead time {})",
            secs(limit),
            secs(dead_time)
        )),
    };
    let recovered = s.check("survivor recovers node2", r);
    let r = {
        let (m1, m3) = (m1.clone(), m3.clone());
        timed(
            "survivors work",
            STEP_LIMIT + VISIBILITY_GIVE_UP * 2,
            move || {
                let a = b"after node2 died, written on node1\n".repeat(40);
                let b = b"after node2 died, written on node3\n".repeat(50);
                write_fsync(&m1.join("after-kill-1"), &a)?;
                write_fsync(&m3.join("after-kill-3"), &b)?;
                let d1 = poll(VISIBILITY_GIVE_UP, || {
                    Ok(read_opt(&m3.join("after-kill-1"))?.is_some_and(|x| x == a))
                })
                .map_err(|e| format!("node1's file on node3: {e}"))?;
                let d3 = poll(VISIBILITY_GIVE_UP, || {
                    Ok(read_opt(&m1.join("after-kill-3"))?.is_some_and(|x| x == b))
                })
                .map_err(|e| format!("node3's file on node1: {e}"))?;
                // node2's fsync'd images are intact after its recovery
                let mut want = vec![0u8; IMAGE_LEN];
                let mut n = 0;
                for k in 0..files {
                    fill_image(&mut want, 1, k);
                    let p = m1.join("shared").join(format!("node2-{k:03}"));
                    if read_opt(&p)?.is_some_and(|x| x == want) {
                        n += 1;
                    } else {
                        return Err(format!(
                            "{} (fsync'd by node2 before its death) lost or changed",
                            p.display()
                        ));
                    }
                }
                // ... and so are the files it fsync'd while it was killed; its directory
                // lock was released: node1 creates and unlinks there
                let busy = m1.join("busy");
                for &k in &durable {
                    let p = busy.join(format!("busy-{k:04}"));
                    if read_opt(&p)? != Some(busy_image(k)) {
                        return Err(format!(
                            "{} (fsync'd by node2 just before the kill) lost or changed on node1",
                            p.display()
                        ));
                    }
                }
                write_fsync(&busy.join("by-node1"), b"node1 in node2's directory\n")?;
                if let Some(&k) = durable.first() {
                    fs::remove_file(busy.join(format!("busy-{k:04}")))
                        .map_err(|e| format!("unlink node2's busy-{k:04} on node1: {e}"))?;
                }
                Ok(format!(
                "write+fsync on node1 and node3, each read on the other ({} / {}); node2's {n} images and its {} last fsync'd files intact; node1 writes in node2's directory",
                secs(d1),
                secs(d3),
                durable.len()
            ))
            },
        )
    };
    s.check("survivors still work", r);
    if !recovered {
        return;
    }
    let res = s
        .mount(&[1])
        .pop()
        .unwrap_or_else(|| Err("no result".into()));
    if !s.check("node2 mounts again", res) {
        return;
    }
    let r = {
        let (m1, m2, m3) = (m1.clone(), m2.clone(), m3.clone());
        timed(
            "node2 works again",
            STEP_LIMIT + VISIBILITY_GIVE_UP * 2,
            move || {
                let a =
                    read_opt(&m2.join("after-kill-1"))?.ok_or("node2 does not see after-kill-1")?;
                if !a.starts_with(b"after node2 died, written on node1") {
                    return Err("after-kill-1 differs on node2".into());
                }
                let c = b"node2 is back\n".repeat(100);
                write_fsync(&m2.join("node2-back"), &c)?;
                let d = poll(VISIBILITY_GIVE_UP, || {
                    Ok(read_opt(&m1.join("node2-back"))?.is_some_and(|x| x == c)
                        && read_opt(&m3.join("node2-back"))?.is_some_and(|x| x == c))
                })
                .map_err(|e| format!("node2-back on node1+node3: {e}"))?;
                Ok(format!(
                    "node2 reads node1's file; its new file seen on node1+node3 after {}",
                    secs(d)
                ))
            },
        )
    };
    s.check("node2 works again", r);

    // ---- 5. unmount everything, fsck clean
    unmount_and_fsck(s, &[0, 1, 2], &devs[2]);
}

/// mkfs once on `dev` (`--heartbeat-interval`/`--io-timeout` as given, 4 slots, 4 MiB
/// journals); it must report a multi-node volume. The `mkfs once` check.
pub(crate) fn mkfs_once(
    s: &mut Scenario,
    dev: &str,
    interval: u64,
    io_timeout: u64,
    dead_time: Duration,
) -> bool {
    let label = s.tag.clone();
    let (iv, it) = (interval.to_string(), io_timeout.to_string());
    let r = spawn_merged(
        "mkfs.cetra",
        &[
            "-f",
            "-N",
            "4",
            "--journal-size",
            "4M",
            "--heartbeat-interval",
            &iv,
            "--io-timeout",
            &it,
            "-L",
            &label,
            dev,
        ],
        &[],
    )
    .and_then(|c| wait_child(c, Duration::from_mins(1)))
    .and_then(|(st, out)| {
        for l in out.lines() {
            println!("OUT {} mkfs: {l}", s.tag);
        }
        if st.success() && out.contains("multi-node (SCSI COMPARE AND WRITE verified)") {
            Ok(format!(
                "{}: heartbeat interval {interval} ms, io_timeout {io_timeout} ms, dead time {}",
                dev,
                secs(dead_time)
            ))
        } else {
            Err(format!("{st}, multi-node line missing"))
        }
    });
    s.check("mkfs once", r)
}

/// Unmount the nodes `which` (each daemon must exit 0), then `fsck.cetra -n` through
/// `fsck_dev` must be clean: the `unmount all` and `fsck -n clean` checks.
pub(crate) fn unmount_and_fsck(s: &mut Scenario, which: &[usize], fsck_dev: &str) {
    let mut errs = Vec::new();
    let mut done = Vec::new();
    for &i in which {
        let (mp, host) = (s.mp(i), s.nodes[i].host.clone());
        let Some(pid) = s.nodes[i].pid else {
            errs.push(format!("{host}: not mounted"));
            continue;
        };
        match umount(&mp, false).and_then(|()| wait_exit(pid, DAEMON_LIMIT)) {
            Ok((st, d)) if st == "exit 0" => {
                s.nodes[i].pid = None;
                done.push(format!("{host} exit 0 after {}", secs(d)));
            }
            Ok((st, _)) => {
                s.nodes[i].pid = None;
                errs.push(format!("{host}: daemon {st}"));
            }
            Err(e) => errs.push(format!("{host}: {e}")),
        }
    }
    let r = if errs.is_empty() {
        Ok(done.join(", "))
    } else {
        Err(errs.join("; "))
    };
    if !s.check("unmount all", r) {
        return;
    }
    let dev = fsck_dev.to_string();
    let r = spawn_merged("fsck.cetra", &["-n", &dev], &[])
        .and_then(|c| wait_child(c, Duration::from_mins(2)))
        .and_then(|(st, out)| {
            for l in out.lines() {
                println!("OUT {} fsck: {l}", s.tag);
            }
            let clean = out
                .lines()
                .find(|l| l.contains(": clean"))
                .unwrap_or("")
                .trim()
                .to_string();
            if st.success() && !clean.is_empty() {
                Ok(format!("{dev}: exit 0, {clean}"))
            } else {
                Err(format!("{dev}: {st}"))
            }
        });
    s.check("fsck -n clean", r);
}
