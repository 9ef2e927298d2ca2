//! Process life cycle: daemonize, open the device, mount the volume, run the FUSE session,
//! report readiness to whoever ran mount(8), and unmount cleanly on umount or SIGTERM/SIGINT.
//!
//! Daemon mode forks *before* anything starts a thread (threads do not survive fork). The
//! child does all the work and reports through a pipe: "OK" once the mount is visible, or
//! "ERR <line>" — so `mount` returns only when the filesystem can be used, and its failure
//! message is the child's one line.

use crate::adapter::{self, Adapter, UnmountOutcome};
use crate::options::Args;
use cetrafs_core::cluster::reservation::Fencing;
use cetrafs_core::cluster::watchdog::WatchdogSpec;
use cetrafs_core::dev::open::{open_lun, LunOptions, Sharing};
use cetrafs_core::dev::SharedDevice;
use cetrafs_core::fs::{MountOptions, Volume};
use cetrafs_core::sync::LockPolicy;
use nix::sys::signal::{SigSet, Signal};
use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{error, info, warn};

pub const EXIT_OK: i32 = 0;
/// mount(8): "incorrect invocation or permissions".
pub const EXIT_USAGE: i32 = 1;
/// mount(8): "mount failure".
pub const EXIT_MOUNT_FAILURE: i32 = 32;
/// Exit status when the volume could not be flushed at unmount.
const EXIT_UNMOUNT_FAILURE: i32 = 1;
/// How long the new mount may take to become visible at the mountpoint.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Tests set this to a file that collects the daemon's log.
const LOG_FILE_ENV: &str = "CETRA_LOG_FILE";

/// Entry point after argument parsing.
pub fn run(args: &Args) -> i32 {
    tune_allocator();
    // The daemon changes directory to "/", so relative paths must be resolved first.
    let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let args = Args {
        device: abs(&args.device),
        mountpoint: abs(&args.mountpoint),
        ..args.clone()
    };
    if args.foreground {
        init_logging(&args, false);
        serve(&args, Notifier::Foreground)
    } else {
        daemonize(&args)
    }
}

/// Allocation above this size is mapped on its own (`M_MMAP_THRESHOLD`) and returned to the
/// OS when freed.
const MMAP_THRESHOLD: libc::c_int = 256 << 10;
/// Free memory at the top of a malloc arena beyond this is returned to the OS when freed
/// (`M_TRIM_THRESHOLD`): no more than one mmap-sized allocation's worth stays resident there.
const TRIM_THRESHOLD: libc::c_int = MMAP_THRESHOLD;
/// malloc arenas at most (`M_ARENA_MAX`): one, shared by every thread.
const ARENA_MAX: libc::c_int = 1;

/// Make the daemon's memory follow what its caches hold (their budgets are the point of
/// the `*_cache=` mount options). glibc's defaults do not: after the first big buffer is
/// freed (a journal write of a large transaction), it raises its mmap threshold to that size
/// and its top-trim threshold to twice that (up to 32 and 64 MiB), so from then on up to
/// 64 MiB of free memory stays resident at the top of *each* arena, and it makes one arena
/// per busy thread (up to 8 per CPU), whose tops `malloc_trim` never returns. Fixed thresholds
/// (setting them turns the adjustment off) and one arena bound that: buffers of 256 KiB and
/// more (journal writes, the metadata block cache's slab chunks, the inode table's maps, the
/// data path's per-thread I/O buffers) are mapped on their own and unmapped when freed, the
/// arena keeps at most 256 KiB free at its top, and `malloc_trim` (`fs/inode_table.rs`) reaches
/// all of it. One arena costs little: metadata work is serialized by the volume's mutex
/// anyway, the data path does its I/O in per-thread buffers, and glibc's
/// per-thread caches serve small allocations without the arena's lock. Measured with
/// `bench/stat-tree.sh`-like runs (60,000 files, both caches at 16 MiB): RSS after the
/// kernel forgot every inode 72 MiB with glibc's defaults, 48 MiB with 4 arenas, 45 MiB with
/// one. Called before any thread starts.
///
/// glibc's per-thread caches (tcache: up to 7 freed chunks of each small size per thread, and
/// the daemon has about 40 threads) are turned off too, by [`without_tcache`]: the chunks they
/// hold stay allocated as far as the arena is concerned, scattered over the heap, so they keep
/// their neighbours from coalescing and their pages from being trimmed. Measured (60,000
/// files, both caches at 16 MiB): heap RSS after the kernel forgot every inode 24 MiB with
/// tcache, under 1 MiB without.
///
/// `CETRA_MALLOC_DEFAULTS=1` in the environment leaves glibc's defaults alone (no re-exec, no
/// mallopt), to measure what this tuning costs or saves (docs/performance.md §6a).
fn tune_allocator() {
    if std::env::var_os(MALLOC_DEFAULTS_ENV).is_some_and(|v| v == "1") {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    without_tcache();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    for (param, value) in [
        (libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (libc::M_ARENA_MAX, ARENA_MAX),
    ] {
        // SAFETY: mallopt only changes glibc's allocator parameters under its own lock; it
        // takes no pointers, and these values are within the documented ranges.
        if unsafe { libc::mallopt(param, value) } != 1 {
            warn!("mallopt({param}, {value}) refused: memory may stay above the cache budgets");
        }
    }
}

/// Set to 1: keep glibc's allocator defaults ([`tune_allocator`]).
const MALLOC_DEFAULTS_ENV: &str = "CETRA_MALLOC_DEFAULTS";

/// The tunable that turns glibc's per-thread malloc caches off.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const NO_TCACHE: &str = "glibc.malloc.tcache_count=0";

/// glibc reads its tunables only from `GLIBC_TUNABLES` at process start (mallopt has no
/// tcache parameter), so when it is not set the daemon re-executes itself, once, with it
/// added to whatever tunables the caller set. After the exec the variable names it, so there
/// is no second exec; if the exec fails the daemon goes on with the caches (more memory, same
/// behaviour). Runs before any thread, file or lock exists.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn without_tcache() {
    use std::os::unix::process::CommandExt;
    let current = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
    if current.split(':').any(|t| t == NO_TCACHE) {
        return;
    }
    let tunables = if current.is_empty() {
        NO_TCACHE.to_string()
    } else {
        format!("{current}:{NO_TCACHE}")
    };
    let mut argv = std::env::args_os();
    let arg0 = argv.next().unwrap_or_default();
    let err = std::process::Command::new("/proc/self/exe")
        .arg0(arg0)
        .args(argv)
        .env("GLIBC_TUNABLES", tunables)
        .exec();
    warn!("cannot re-execute without glibc's malloc thread caches ({err}): memory may stay above the cache budgets");
}

/// Where "mounted" / "failed" goes: the waiting parent's pipe, or our own stderr with -f.
#[derive(Debug)]
enum Notifier {
    Foreground,
    Pipe(File),
    Done,
}

impl Notifier {
    fn ready(&mut self) {
        if let Notifier::Pipe(f) = self {
            if let Err(e) = f.write_all(b"OK\n") {
                warn!("cannot tell the mount command that the mount is ready: {e}");
            }
        }
        *self = Notifier::Done;
    }

    fn failed(&mut self, line: &str) {
        match self {
            Notifier::Foreground => eprintln!("mount.cetra: {line}"),
            Notifier::Pipe(f) => {
                error!("{line}");
                let _ = f.write_all(format!("ERR {line}\n").as_bytes());
            }
            Notifier::Done => error!("{line}"),
        }
        *self = Notifier::Done;
    }
}

fn daemonize(args: &Args) -> i32 {
    let cannot = |what: String| {
        eprintln!(
            "mount.cetra: cannot mount {}: {what}",
            args.device.display()
        );
        EXIT_MOUNT_FAILURE
    };
    let (rd, wr) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
        Ok(p) => p,
        Err(e) => return cannot(format!("pipe: {e}")),
    };
    // SAFETY: nothing has started a thread yet (argument parsing only), so the child is a
    // complete copy of a single-threaded process and may do anything afterwards.
    match unsafe { nix::unistd::fork() } {
        Err(e) => cannot(format!("fork: {e}")),
        Ok(nix::unistd::ForkResult::Parent { child }) => {
            drop(wr);
            wait_for_child(args, child, File::from(rd))
        }
        Ok(nix::unistd::ForkResult::Child) => {
            drop(rd);
            let code = child_main(args, File::from(wr));
            std::process::exit(code);
        }
    }
}

/// Parent: relay the child's verdict. EOF without a verdict means the child died.
fn wait_for_child(args: &Args, child: nix::unistd::Pid, mut rd: File) -> i32 {
    let mut msg = String::new();
    let _ = rd.read_to_string(&mut msg);
    let line = msg.lines().next().unwrap_or("");
    if line == "OK" {
        return EXIT_OK;
    }
    if let Some(err) = line.strip_prefix("ERR ") {
        eprintln!("mount.cetra: {err}");
    } else {
        let status = nix::sys::wait::waitpid(child, None)
            .map_or_else(|e| e.to_string(), |s| format!("{s:?}"));
        eprintln!(
            "mount.cetra: cannot mount {}: the mount daemon exited before the mount was ready ({status}); \
             run with -f to see why",
            args.device.display()
        );
    }
    EXIT_MOUNT_FAILURE
}

fn child_main(args: &Args, pipe: File) -> i32 {
    let mut notifier = Notifier::Pipe(pipe);
    let fail = |n: &mut Notifier, what: String| {
        n.failed(&format!("cannot mount {}: {what}", args.device.display()));
        EXIT_MOUNT_FAILURE
    };
    // A new session: no controlling terminal, not killed with mount(8)'s process group.
    let _ = nix::unistd::setsid();
    // Do not keep the caller's working directory busy.
    let _ = nix::unistd::chdir("/");
    if let Err(e) = redirect_stdio() {
        return fail(&mut notifier, e);
    }
    init_logging(args, true);
    serve(args, notifier)
}

/// stdin from /dev/null; stdout and stderr to $`CETRA_LOG_FILE`, else left alone when they are
/// the systemd journal (mount units run helpers with stderr on the journal), else /dev/null.
fn redirect_stdio() -> Result<(), String> {
    let devnull = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| format!("/dev/null: {e}"))?;
    nix::unistd::dup2_stdin(devnull.as_fd()).map_err(|e| format!("redirecting stdin: {e}"))?;
    let out: Option<File> = match std::env::var_os(LOG_FILE_ENV) {
        Some(path) => Some(
            OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o640)
                .open(&path)
                .map_err(|e| {
                    format!(
                        "cannot open log file {} (${LOG_FILE_ENV}): {e}",
                        Path::new(&path).display()
                    )
                })?,
        ),
        None if stderr_is_journal() => None,
        None => Some(devnull),
    };
    if let Some(f) = out {
        nix::unistd::dup2_stdout(f.as_fd()).map_err(|e| format!("redirecting stdout: {e}"))?;
        nix::unistd::dup2_stderr(f.as_fd()).map_err(|e| format!("redirecting stderr: {e}"))?;
    }
    Ok(())
}

/// systemd sets `JOURNAL_STREAM`=<dev>:<ino> of the journal socket it connected stderr to.
fn stderr_is_journal() -> bool {
    let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = v.to_str().and_then(|s| s.split_once(':')) else {
        return false;
    };
    let Ok(st) = nix::sys::stat::fstat(std::io::stderr().as_fd()) else {
        return false;
    };
    dev.parse() == Ok(st.st_dev) && ino.parse() == Ok(st.st_ino)
}

fn init_logging(args: &Args, daemon: bool) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::EnvFilter;
    // fuser's session logs a spurious "Failed to umount filesystem: Invalid argument" after
    // every normal unmount (it retries the umount the kernel already did); keep that noise
    // out of the sysadmin's journal unless RUST_LOG asks for it.
    let default = if args.verbose {
        "debug"
    } else {
        "info,fuser::session=error"
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let quiet = AbandonedReplies {
        shown: args.verbose,
    };
    // try_init() also routes the `log` records of fuser into tracing.
    let r = if daemon {
        // journald (or the test's log file reader) adds its own timestamps; no colour codes.
        builder
            .with_ansi(false)
            .without_time()
            .finish()
            .with(quiet)
            .try_init()
    } else {
        builder
            .with_ansi(std::io::stderr().is_terminal())
            .finish()
            .with(quiet)
            .try_init()
    };
    if let Err(e) = r {
        eprintln!("mount.cetra: logging not set up: {e}");
    }
    install_panic_hook();
}

/// The daemon's end of the panic policy (ARCHITECTURE.md, "Panic policy"): a panic in any
/// thread ends the process. The binary is built with `panic = "abort"`, so nothing unwinds and
/// the panicking thread's lock guards are never released: no other thread can reach, let alone
/// commit, the state it was changing. To the cluster the node is one that crashed (its journal
/// is replayed by a survivor or its next mount). This hook first logs the panic at ERROR with
/// the thread, the location and a backtrace (the default hook's text would not reach the log's
/// reader as an error), then aborts itself, so the policy holds even in a build that unwinds.
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>");
        let location = info
            .location()
            .map_or_else(|| "<unknown location>".to_string(), ToString::to_string);
        let message = info
            .payload_as_str()
            .unwrap_or("<non-string panic payload>");
        let backtrace = std::backtrace::Backtrace::force_capture();
        error!(
            "panic in thread '{name}' ({:?}) at {location}: {message}; aborting the process \
             (panic policy: its journal is replayed by a survivor or by the next mount)\n\
             {backtrace}",
            thread.id()
        );
        std::process::abort();
    }));
}

/// fuser logs `Failed to send FUSE reply: No such file or directory` at ERROR whenever the
/// kernel no longer waits for an answer: the caller was interrupted (`FUSE_INTERRUPT`; QEMU and
/// other AIO users cancel requests routinely) or the connection was aborted. That is normal
/// operation, not a storage fault, so those lines are dropped (shown with `-v`). Every other
/// reply failure is still logged as fuser logs it.
#[derive(Debug)]
struct AbandonedReplies {
    shown: bool,
}

/// The target and message of one event, as far as [`AbandonedReplies`] looks at them.
#[derive(Default)]
struct TargetAndMessage {
    log_target: Option<String>,
    message: String,
}

impl tracing::field::Visit for TargetAndMessage {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "log.target" => self.log_target = Some(value.to_owned()),
            "message" => value.clone_into(&mut self.message),
            _ => {}
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        }
    }
}

/// fuser's reply module (its `log` target) and the message of an abandoned reply.
const FUSER_REPLY: &str = "fuser::reply";
const ABANDONED_REPLY: &str = "Failed to send FUSE reply: No such file or directory";

impl AbandonedReplies {
    fn is_abandoned_reply(event: &tracing::Event<'_>) -> bool {
        if *event.metadata().level() != tracing::Level::ERROR {
            return false;
        }
        let mut v = TargetAndMessage::default();
        event.record(&mut v);
        // `log` records arrive with target "log" and the real one in a field.
        let target = v.log_target.as_deref().unwrap_or(event.metadata().target());
        target == FUSER_REPLY && v.message.starts_with(ABANDONED_REPLY)
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for AbandonedReplies {
    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        _cx: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        self.shown || !Self::is_abandoned_reply(event)
    }
}

fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Open the device through the backend it needs (`cetrafs_core::dev::open`): `SG_IO` for a
/// whole SCSI LUN, `O_DIRECT` file backend otherwise (a regular file gets the logical block size
/// its superblock records). A SCSI LUN must pass the COMPARE AND WRITE probe on the
/// superblock's probe block at every read-write mount; anything else is a single-host volume.
///
/// Fencing is chosen here too (`fence=`, [`Fencing::decide`]), before the probe writes:
/// with persistent reservations the node registers a joining key on every path first, so its
/// probe and slot claim may write to a LUN the other nodes have reserved.
fn open_device(
    path: &Path,
    read_only: bool,
    opts: &crate::options::Options,
) -> cetrafs_core::Result<(SharedDevice, Option<Fencing>)> {
    let mut lo = LunOptions {
        read_only,
        ..LunOptions::default()
    };
    let mut lun = open_lun(path, &lo)?;
    let shown = path.display();
    // An unreadable superblock is left to Volume::mount, the one source of "why this is not
    // mountable".
    let sb = cetrafs_core::fs::read_superblock(&*lun.dev);
    // The SG_IO timeout of COMPARE AND WRITE is the volume's I/O deadline.
    if let (Ok(sb), true) = (&sb, lun.kind.is_scsi()) {
        let t = std::time::Duration::from_millis(u64::from(sb.io_timeout_ms.max(1)));
        if t != lo.sg.io_timeout {
            lo.sg.io_timeout = t;
            drop(lun);
            lun = open_lun(path, &lo)?;
        }
    }
    // A read-only mount joins too: it writes its heartbeat slot, which a LUN reserved by the
    // other nodes refuses to an unregistered initiator.
    let fencing = match &sb {
        Ok(sb) => {
            let f = Fencing::decide(opts.fence, &lun, &sb.uuid, opts.pr_preempt, &opts.watchdog)?;
            info!("{shown}: {}", f.describe());
            Some(f)
        }
        Err(_) => None,
    };
    match (sb, read_only) {
        (Ok(sb), false) => match lun.check_sharing(sb.probe_block).inspect_err(|_| {
            if let Some(f) = &fencing {
                f.abandon();
            }
        })? {
            s @ Sharing::MultiNode { .. } => info!("{shown}: {}; {s}", lun.kind),
            s => info!("{shown}: single-host volume: {}; {s}", lun.kind),
        },
        (_, true) if lun.kind.is_scsi() => info!(
            "{shown}: {}; read-only mount, COMPARE AND WRITE not probed",
            lun.kind
        ),
        (_, _) if !lun.kind.is_scsi() => info!("{shown}: single-host volume ({})", lun.kind),
        _ => {}
    }
    Ok((lun.dev, fencing))
}

/// Mount and serve until unmounted. Returns the exit status.
fn serve(args: &Args, mut notifier: Notifier) -> i32 {
    let dev_name = args.device.display().to_string();
    let fail = |n: &mut Notifier, why: String| {
        n.failed(&format!("cannot mount {dev_name}: {why}"));
        EXIT_MOUNT_FAILURE
    };

    // SIGTERM/SIGINT/SIGHUP are taken by one thread with sigwait; blocking them here, before
    // any thread exists, makes every later thread (fuser's workers, the core's) inherit the
    // mask, so no worker is interrupted in the middle of a request.
    let mut sigs = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        sigs.add(s);
    }
    if let Err(e) = sigs.thread_block() {
        return fail(&mut notifier, format!("blocking signals: {e}"));
    }

    let mp_dev = match std::fs::metadata(&args.mountpoint) {
        Ok(m) if m.is_dir() => m.dev(),
        Ok(_) => {
            return fail(
                &mut notifier,
                format!(
                    "mountpoint {} is not a directory",
                    args.mountpoint.display()
                ),
            )
        }
        Err(e) => {
            return fail(
                &mut notifier,
                format!("mountpoint {}: {e}", args.mountpoint.display()),
            )
        }
    };

    let ro = args.opts.read_only;
    let (dev, fencing) = match open_device(&args.device, ro, &args.opts) {
        Ok(d) => d,
        Err(e) => return fail(&mut notifier, e.to_string()),
    };
    let host = args.opts.host.clone().unwrap_or_else(hostname);
    // Test hook: log every device write of this process, timestamped (dev/write_log.rs).
    let shared: SharedDevice = match std::env::var_os(cetrafs_core::dev::write_log::WRITE_LOG_ENV) {
        Some(p) if !p.is_empty() => {
            match cetrafs_core::dev::write_log::WriteLog::open(dev, Path::new(&p)) {
                Ok(w) => {
                    info!(
                        "{dev_name}: logging device writes to {}",
                        Path::new(&p).display()
                    );
                    Arc::new(w)
                }
                Err(e) => {
                    if let Some(f) = &fencing {
                        f.abandon();
                    }
                    return fail(&mut notifier, e.to_string());
                }
            }
        }
        _ => dev,
    };
    let vol = match Volume::mount(
        shared,
        &MountOptions {
            read_only: ro,
            host: host.clone(),
            file_locks: args.opts.file_locks,
            caw_renewal: args.opts.caw_renewal,
            inode_cache_bytes: args.opts.inode_cache_bytes,
            meta_cache_bytes: args.opts.meta_cache_bytes,
            bitmap_cache_bytes: args.opts.bitmap_cache_bytes,
            inode_locks: args.opts.inode_locks,
            alloc_granule: args.opts.alloc_granule,
            discard_rate: args.opts.discard_rate,
            // fence=none: software fencing only, so no watchdog either (Fencing::decide).
            watchdog: fencing
                .as_ref()
                .map_or(WatchdogSpec::Off, |f| f.watchdog.clone()),
            reservations: fencing.and_then(|f| f.reservations),
            // As /proc shows the paths of open files (before the FUSE mount covers it).
            mountpoint: Some(
                std::fs::canonicalize(&args.mountpoint).unwrap_or_else(|_| args.mountpoint.clone()),
            ),
            ..MountOptions::default()
        },
    ) {
        Ok(v) => v,
        Err(e) => return fail(&mut notifier, e.to_string()),
    };
    info!(
        "{dev_name}: volume mounted as node {host}{}",
        if ro { " (read-only)" } else { "" }
    );
    if !args.opts.file_locks && !ro {
        warn!(
            "{dev_name}: mounted with nofilelock: nothing stops a second writer on another node \
             (a VM started on two nodes on one image corrupts it); live migration does not need \
             nofilelock"
        );
    }

    let outcome: UnmountOutcome = Arc::new(Mutex::new(None));
    let fs = Adapter::new(Arc::clone(&vol), &args.opts, Arc::clone(&outcome));
    let cfg = adapter::session_config(&args.device, &args.opts);
    // The io_uring transport's adapters, made before the session owns `fs`.
    let rings = (fs.for_rings(), fs.for_rings(), fs.negotiated());
    // Session::new performs the mount(2) and the FUSE INIT handshake. If it fails, dropping
    // the adapter runs destroy, which unmounts the volume.
    let session = match adapter::start_session(fs, &args.mountpoint, &cfg) {
        Ok(s) => s,
        Err(e) => {
            return fail(
                &mut notifier,
                format!("FUSE mount on {}: {e}", args.mountpoint.display()),
            )
        }
    };
    drop(vol);
    // The rings' own /dev/fuse descriptor (the session keeps its own).
    let dev = match session.as_fd().try_clone_to_owned() {
        Ok(dev) => Some(dev),
        Err(e) if rings.2.uring() => {
            // INIT took io_uring: the kernel holds every request until told otherwise.
            if let Err(a) = crate::uring::abandon(session.as_fd().as_raw_fd()) {
                return fail(
                    &mut notifier,
                    format!(
                        "FUSE over io_uring: no descriptor ({e}), and could not turn it off ({a})"
                    ),
                );
            }
            warn!("no second /dev/fuse descriptor for io_uring ({e}): classic transport");
            None
        }
        Err(_) => None,
    };
    let transport = Transport {
        dev,
        ring_fs: rings.0,
        bridge_fs: rings.1,
        negotiated: rings.2,
        threads: cfg.n_threads.unwrap_or(1),
        required: args.opts.transport == crate::options::Transport::Uring,
    };

    // Right away: once INIT took io_uring, the kernel holds every request until the rings
    // are registered.
    if let Err(e) = transport.start() {
        return fail(
            &mut notifier,
            format!("FUSE mount on {}: {e}", args.mountpoint.display()),
        );
    }

    spawn_signal_thread(sigs, args.mountpoint.clone());
    spawn_ready_thread(args.mountpoint.clone(), mp_dev, notifier);

    let run = connection_ended(session.run());
    if let Err(e) = &run {
        error!("FUSE session ended with an error: {e}");
    }
    let unmounted = outcome.lock().or_panic().take();
    match unmounted {
        Some(Ok(())) if run.is_ok() => {
            info!("{dev_name}: unmounted from {}", args.mountpoint.display());
            EXIT_OK
        }
        Some(Ok(()) | Err(_)) => EXIT_UNMOUNT_FAILURE,
        None => {
            error!("{dev_name}: the session ended without unmounting the volume");
            EXIT_UNMOUNT_FAILURE
        }
    }
}

/// How the session's end reads. fuser ends a worker cleanly on ENODEV ("the connection is
/// gone"); Linux 6.18 sometimes answers a worker's read with ECONNABORTED instead when the
/// connection is torn down after an ordinary umount (about 1 in 60 unmounts of a 32-thread
/// session here, after DESTROY was answered and the volume flushed). Mainline returns
/// ECONNABORTED only after a fusectl abort on a connection that negotiated `FUSE_ABORT_ERROR`,
/// which this daemon never does, so it means what ENODEV means: the kernel ended the
/// connection. Whether the volume was flushed is judged separately, from destroy's outcome.
fn connection_ended(run: std::io::Result<()>) -> std::io::Result<()> {
    match run {
        Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => {
            info!("the kernel ended the FUSE connection (ECONNABORTED, read as ENODEV)");
            Ok(())
        }
        other => other,
    }
}

/// The request transport, started once the session's INIT is answered (the kernel refuses
/// rings before): FUSE over `io_uring` if INIT took it (uring.rs), else /dev/fuse alone. The
/// log says which.
struct Transport {
    dev: Option<std::os::fd::OwnedFd>,
    ring_fs: Adapter,
    bridge_fs: Adapter,
    negotiated: Arc<adapter::Negotiated>,
    threads: usize,
    /// `transport=uring`: no rings, no mount.
    required: bool,
}

impl Transport {
    fn start(self) -> Result<(), String> {
        let kernel = self.negotiated.kernel();
        let (Some(dev), Some(kernel), true) = (self.dev, kernel, self.negotiated.uring()) else {
            info!("FUSE transport: classic /dev/fuse");
            return Ok(());
        };
        let keep = self.ring_fs.for_rings();
        let (rings, r) =
            crate::uring::start(dev, self.ring_fs, self.bridge_fs, kernel, self.threads);
        // Workers that registered may serve requests even after a failure: the session's
        // end waits for them all the same.
        if let Some(rings) = rings {
            keep.set_rings(rings);
        }
        match r {
            Ok(what) => {
                info!("FUSE transport: {what}");
                Ok(())
            }
            Err((e, _)) if self.required => {
                Err(format!("FUSE over io_uring (transport=uring): {e}"))
            }
            Err((e, true)) => {
                warn!("FUSE over io_uring: {e}; FUSE transport: classic /dev/fuse");
                Ok(())
            }
            Err((e, false)) => Err(format!("FUSE over io_uring: {e}")),
        }
    }
}

/// On SIGTERM/SIGINT/SIGHUP: unmount like `umount MOUNTPOINT` would. The kernel then ends the
/// session, fuser calls destroy, and the volume is flushed. If the mount is busy it stays
/// mounted (a daemon that vanished would leave every user with ENOTCONN); say so and wait.
fn spawn_signal_thread(sigs: SigSet, mountpoint: PathBuf) {
    let r = std::thread::Builder::new()
        .name("cetra-signals".into())
        .spawn(move || loop {
            let Ok(sig) = sigs.wait() else { continue };
            info!("received {sig:?}: unmounting {}", mountpoint.display());
            match nix::mount::umount2(&mountpoint, nix::mount::MntFlags::empty()) {
                // Unmounted, or not mounted any more.
                Ok(()) | Err(nix::errno::Errno::EINVAL) => return,
                Err(e) => warn!(
                    "cannot unmount {}: {e}; still serving it (close its users, or `umount -l` it)",
                    mountpoint.display()
                ),
            }
        });
    if let Err(e) = r {
        warn!("no signal handling thread ({e}); unmount with `umount`");
    }
}

/// Report readiness once a stat of the mountpoint shows the new filesystem. That stat goes
/// through our own FUSE workers (GETATTR of the root), so it proves the whole path works.
fn spawn_ready_thread(mountpoint: PathBuf, old_dev: u64, mut notifier: Notifier) {
    let r = std::thread::Builder::new()
        .name("cetra-ready".into())
        .spawn(move || {
            let start = Instant::now();
            loop {
                match std::fs::metadata(&mountpoint) {
                    Ok(m) if m.dev() != old_dev => {
                        info!("mounted on {}", mountpoint.display());
                        notifier.ready();
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        notifier.failed(&format!(
                            "cannot mount on {}: the new mount does not answer: {e}",
                            mountpoint.display()
                        ));
                        let _ = nix::mount::umount2(&mountpoint, nix::mount::MntFlags::MNT_DETACH);
                        return;
                    }
                }
                if start.elapsed() > READY_TIMEOUT {
                    notifier.failed(&format!(
                        "cannot mount on {}: the mount did not appear within {}s",
                        mountpoint.display(),
                        READY_TIMEOUT.as_secs()
                    ));
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
    if let Err(e) = r {
        error!("cannot start the readiness check: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn econnaborted_ends_the_session_like_enodev_and_other_errors_stay() {
        let aborted = std::io::Error::from_raw_os_error(libc::ECONNABORTED);
        assert!(connection_ended(Err(aborted)).is_ok());
        assert!(connection_ended(Ok(())).is_ok());
        let eio = std::io::Error::from_raw_os_error(libc::EIO);
        assert_eq!(
            connection_ended(Err(eio)).unwrap_err().raw_os_error(),
            Some(libc::EIO)
        );
    }
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt;

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);
    impl Write for Capture {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn abandoned_replies_are_dropped_and_other_reply_errors_kept() {
        let out = Capture::default();
        let w = out.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .finish()
            .with(AbandonedReplies { shown: false });
        tracing::subscriber::with_default(sub, || {
            tracing::error!(target: "fuser::reply", "Failed to send FUSE reply: No such file or directory (os error 2)");
            tracing::error!(target: "fuser::reply", "Failed to send FUSE reply: Invalid argument (os error 22)");
            tracing::error!(target: "cetrafs", "Failed to send FUSE reply: No such file or directory");
            tracing::warn!(target: "fuser::reply", "Failed to send FUSE reply: No such file or directory");
            // As fuser's `log` records arrive through tracing-log.
            tracing::error!(target: "log", { log.target = "fuser::reply" }, "Failed to send FUSE reply: No such file or directory (os error 2)");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].contains("Invalid argument"), "{text}");
        assert!(!text.contains("(os error 2)"), "{text}");
    }
}
