//! `impl fuser::Filesystem` as a thin translation onto [`cetrafs_core::fs::Volume`] (with
//! uring.rs, the only file that names fuser types). Policy lives in the core; what stays here
//! is what FUSE itself asks of a filesystem (file handles, reply shapes, xattr size probes,
//! ACL upkeep under `FUSE_POSIX_ACL`, the kernel's root nodeid).

use crate::creds::RequestCreds;
use crate::offload::{Offload, INLINE_CHANGES};
use crate::options::Options;
use crate::options::Transport;
use crate::uring;
use cetrafs_core::fs::{
    Attr, BatchRead, BatchWrite, Caller, DirListEntry, EntryAttr, FallocMode, FileKind, Ino,
    OpenFile, RenameFlags, SetAttr, SetTime, Volume, Whence, WriteAt, WriteDone, WriteStarted,
    Written,
};
use cetrafs_core::sync::LockPolicy;
use cetrafs_core::{Error, ErrorKind};
use fuser::{
    AccessFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, MountOption, Notifier, OpenAccMode,
    OpenFlags, PollEvents, PollFlags, PollNotifier, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen,
    ReplyPoll, ReplyStatfs, ReplyWrite, ReplyXattr, Request, SessionACL, TimeOrNow, WriteFlags,
};
use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tracing::{debug, error, info, warn};

/// The kernel always calls the root directory nodeid 1 (`FUSE_ROOT_ID`). CetraFS inode numbers
/// are fs block numbers, and block 1 is never an inode, so 1 <-> `root_ino` is a bijection.
const FUSE_ROOT_ID: u64 = 1;
/// What stat(2) reports as `st_blksize`: the fs block, the unit in which writes avoid read-modify-write.
const BLKSIZE: u32 = 4096;
/// `max_write`: one 1 MiB `O_DIRECT` write arrives as one `FUSE_WRITE` (measured, facts §1.3 #4).
const MAX_WRITE: u32 = 1 << 20;
/// Async DIO requests count as background requests; several VMs share one mount (facts §1.3 #2).
const MAX_BACKGROUND: u16 = 512;
const CONGESTION_THRESHOLD: u16 = 384;
/// ioctl numbers of `FS_IOC_{GET,SET}FLAGS` (`_IOR('f', 1, long)` / `_IOW('f', 2, long)`) and
/// their 32-bit compat variants. The kernel's FUSE fileattr code sends the native ones.
const FS_IOC_GETFLAGS: u32 = 0x8008_6601;
const FS_IOC_SETFLAGS: u32 = 0x4008_6602;
const FS_IOC32_GETFLAGS: u32 = 0x8004_6601;
const FS_IOC32_SETFLAGS: u32 = 0x4004_6602;
/// `_IOR/_IOW('X', 31/32, struct fsxattr)`: the kernel asks with FSGETXATTR when it needs the
/// old attributes before a SETFLAGS (`vfs_fileattr_set`), and `xfs_io` uses both.
const FS_IOC_FSGETXATTR: u32 = 0x801C_581F;
const FS_IOC_FSSETXATTR: u32 = 0x401C_5820;
/// sizeof(struct fsxattr): xflags, extsize, nextents, projid, cowextsize, 8 pad bytes.
const FSXATTR_SIZE: usize = 28;
/// `_IOWR('X', 121, struct fstrim_range)`: `fstrim` and `cetra trim` on the mountpoint.
const FITRIM: u32 = 0xC018_5879;
/// `sizeof(struct fstrim_range)`: start, len, minlen (u64 each, bytes).
const FSTRIM_RANGE_SIZE: usize = 24;
/// `_IOR('C', 0xD0, u64[3])`: defragment the file (`cetra defrag`); returns extents before,
/// extents after, blocks copied.
const CETRA_IOC_DEFRAG: u32 = 0x8018_43D0;
/// `_IOR('C', 0xD1, u64[4])`: grow the volume onto the space the LUN gained (`cetra grow`, on
/// the mountpoint); returns groups before, groups after, group bytes before, after.
const CETRA_IOC_GROW: u32 = 0x8020_43D1;
/// `FS_*_FL` inode flag <-> `FS_XFLAG_*` pairs for the flags CetraFS stores.
const FL_XFLAG: [(u32, u32); 3] = [(0x10, 0x08), (0x20, 0x10), (0x80, 0x40)];

/// Result of `Volume::unmount` from `destroy`, for the daemon's exit status.
pub type UnmountOutcome = Arc<Mutex<Option<Result<(), String>>>>;

/// How long `destroy` waits for changes still running on change threads (offload.rs).
const CHANGES_DRAIN: Duration = Duration::from_secs(10);
/// FUSE worker threads unless `CETRA_FUSE_THREADS` says otherwise.
const DEFAULT_THREADS: usize = 32;

/// Session configuration (threads, `clone_fd`, mount options) for this device and options.
pub fn session_config(fsname: &Path, opts: &Options) -> fuser::Config {
    let mut mount_options = vec![
        // The device shows as the source in /proc/mounts and `findmnt`, like any block fs.
        MountOption::FSName(fsname.to_string_lossy().into_owned()),
        // A kernel option: /proc/mounts then says "fuse.cetra", which is what umount(8) and
        // Proxmox's storage checks match on. (fuser's Subtype only reaches fusermount.)
        MountOption::CUSTOM("subtype=cetra".into()),
        MountOption::DefaultPermissions,
        if opts.nodev {
            MountOption::NoDev
        } else {
            MountOption::Dev
        },
        if opts.nosuid {
            MountOption::NoSuid
        } else {
            MountOption::Suid
        },
        if opts.noexec {
            MountOption::NoExec
        } else {
            MountOption::Exec
        },
    ];
    if opts.read_only {
        mount_options.push(MountOption::RO);
    }
    if opts.noatime {
        mount_options.push(MountOption::NoAtime);
    }
    let mut cfg = fuser::Config::default();
    cfg.mount_options = mount_options;
    // allow_other: VMs run as root but containers' processes run as many uids;
    // default_permissions above makes the kernel check modes and ACLs for them.
    cfg.acl = SessionACL::All;
    // 32 workers with their own /dev/fuse clone: QD32 direct I/O gets 32 requests in flight.
    // FUSE workers do synchronous O_DIRECT I/O, so they are also the device queue depth.
    cfg.n_threads = Some(fuse_threads());
    cfg.clone_fd = true;
    cfg
}

/// A request that took this long is logged when answered: what waited, and how long (the
/// kernel's hung-task report, for one request; it says which operation a stalled
/// application was in).
const SLOW_REQUEST: Duration = Duration::from_secs(5);

/// Logs its request at its end (drop) if it took [`SLOW_REQUEST`] or longer.
struct Timed {
    op: &'static str,
    ino: Ino,
    start: Instant,
}

impl Timed {
    fn new(op: &'static str, ino: Ino) -> Self {
        Self {
            op,
            ino,
            start: Instant::now(),
        }
    }
}

/// At most this many slow requests are logged a minute (a dead node's recovery can end
/// hundreds of waits at once); the count of the rest is logged with the next one shown.
const SLOW_LOGGED_PER_MINUTE: u32 = 20;

/// The minute's start, requests logged in it, and requests not logged since the last one.
static SLOW_LOG: Mutex<Option<(Instant, u32, u64)>> = Mutex::new(None);

impl Drop for Timed {
    fn drop(&mut self) {
        let took = self.start.elapsed();
        if took < SLOW_REQUEST {
            return;
        }
        let now = Instant::now();
        let mut g = SLOW_LOG.lock().or_panic();
        let (since, shown, hidden) = g.get_or_insert((now, 0, 0));
        if now.duration_since(*since) >= Duration::from_mins(1) {
            (*since, *shown) = (now, 0);
        }
        if *shown >= SLOW_LOGGED_PER_MINUTE {
            *hidden += 1;
            return;
        }
        *shown += 1;
        let more = std::mem::take(hidden);
        drop(g);
        let more = if more > 0 {
            format!(" ({more} more slow requests not shown before this one)")
        } else {
            String::new()
        };
        info!(
            "slow request: {} of inode {} took {:.1} s{more}",
            self.op,
            self.ino,
            took.as_secs_f64()
        );
    }
}

/// The FUSE worker threads: `CETRA_FUSE_THREADS` (1 to 1024), else [`DEFAULT_THREADS`].
fn fuse_threads() -> usize {
    std::env::var("CETRA_FUSE_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| (1..=1024).contains(n))
        .unwrap_or(DEFAULT_THREADS)
}

/// Which of the daemon's adapters this is. All share one volume; only the session's adapter
/// negotiates with the kernel and unmounts the volume at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The adapter of the /dev/fuse session: INIT, then every request the kernel sends there.
    Session,
    /// The `io_uring` transport's (uring.rs): requests that arrive on the rings.
    Ring,
}

/// What INIT settled, shared by the session's adapter with the `io_uring` transport.
#[derive(Debug, Default)]
pub struct Negotiated {
    /// The kernel's INIT capabilities (`FUSE_INIT_EXT` left out) and ABI version.
    kernel: OnceLock<(u64, u32, u32)>,
    /// `FUSE_OVER_IO_URING` was offered and taken: the rings may be registered.
    uring: AtomicBool,
}

impl Negotiated {
    /// The kernel's capabilities and ABI (major, minor), once INIT was answered.
    pub fn kernel(&self) -> Option<(u64, u32, u32)> {
        self.kernel.get().copied()
    }

    /// Whether INIT took `FUSE_OVER_IO_URING`.
    pub fn uring(&self) -> bool {
        self.uring.load(Ordering::Acquire)
    }
}

#[derive(Debug)]
pub struct Adapter {
    vol: Arc<Volume>,
    root: Ino,
    attr_ttl: Duration,
    entry_ttl: Duration,
    /// Negotiated in init: the kernel enforces ACLs and leaves the umask to us.
    posix_acl: bool,
    outcome: UnmountOutcome,
    /// The session's channel for notifications, set once the session exists.
    notifier: Arc<OnceLock<Notifier>>,
    role: Role,
    transport: Transport,
    negotiated: Arc<Negotiated>,
    /// The `io_uring` transport once it runs: stopped before the volume is unmounted.
    rings: Arc<OnceLock<uring::Rings>>,
    /// The change threads (offload.rs): metadata changes never wait on a FUSE worker.
    changes: Offload,
}

/// Start the FUSE session for `fs` on `mountpoint` (mount(2) and the INIT handshake), and
/// give the adapter the session's notification channel.
pub fn start_session(
    fs: Adapter,
    mountpoint: &Path,
    cfg: &fuser::Config,
) -> io::Result<fuser::Session<Adapter>> {
    let slot = Arc::clone(&fs.notifier);
    let session = fuser::Session::new(fs, mountpoint, cfg)?;
    let _ = slot.set(session.notifier());
    Ok(session)
}

impl Adapter {
    pub fn new(vol: Arc<Volume>, opts: &Options, outcome: UnmountOutcome) -> Self {
        let root = vol.root_ino();
        Self {
            vol,
            root,
            attr_ttl: opts.attr_timeout,
            entry_ttl: opts.entry_timeout,
            posix_acl: false,
            outcome,
            notifier: Arc::new(OnceLock::new()),
            role: Role::Session,
            transport: opts.transport,
            negotiated: Arc::new(Negotiated::default()),
            rings: Arc::new(OnceLock::new()),
            // A quarter of the workers at most may wait on the cluster at once.
            changes: Offload::named("cetra-change", (fuse_threads() / 4).min(INLINE_CHANGES)),
        }
    }

    /// An adapter for the `io_uring` transport over the same volume, notifier and INIT outcome.
    /// Its `init` only repeats the session's choices (for the bridge session that serves the
    /// rings' other requests) and its `destroy` does nothing.
    pub fn for_rings(&self) -> Self {
        Self {
            role: Role::Ring,
            ..self.handle()
        }
    }

    /// Another adapter for the same session and volume (what a change thread answers with).
    fn handle(&self) -> Self {
        Self {
            vol: Arc::clone(&self.vol),
            root: self.root,
            attr_ttl: self.attr_ttl,
            entry_ttl: self.entry_ttl,
            posix_acl: self.posix_acl,
            outcome: Arc::clone(&self.outcome),
            notifier: Arc::clone(&self.notifier),
            role: self.role,
            transport: self.transport,
            negotiated: Arc::clone(&self.negotiated),
            rings: Arc::clone(&self.rings),
            changes: self.changes.clone(),
        }
    }

    /// Answer a request that may wait for the cluster (the global lock, perhaps for a dead
    /// holder's recovery): on this worker while the change threads' inline share allows,
    /// else on a change thread (offload.rs), so that such waits never hold more than that
    /// share of the workers. `op` on inode `ino` names it in the log if it is slow
    /// ([`Timed`]).
    fn may_wait(&self, op: &'static str, ino: Ino, f: impl FnOnce(&Self) + Send + 'static) {
        self.may_wait_with(op, ino, &[], move |me, _| f(me));
    }

    /// [`Adapter::may_wait`] for a request that carries bytes (a WRITE's): `f` gets them,
    /// borrowed from the request on this worker, or copied for a change thread.
    fn may_wait_with(
        &self,
        op: &'static str,
        ino: Ino,
        bytes: &[u8],
        f: impl FnOnce(&Self, &[u8]) + Send + 'static,
    ) {
        let timed = Timed::new(op, ino);
        if let Some(_slot) = self.changes.inline_slot() {
            f(self, bytes);
            drop(timed);
        } else {
            let a = self.handle();
            let bytes = bytes.to_vec();
            self.changes.hand_over(move || {
                f(&a, &bytes);
                drop(timed);
            });
        }
    }

    /// What INIT settled (shared with every adapter made by [`Adapter::for_rings`]).
    pub fn negotiated(&self) -> Arc<Negotiated> {
        Arc::clone(&self.negotiated)
    }

    /// Hand the running `io_uring` transport over, so the session stops it before unmounting.
    pub fn set_rings(&self, rings: uring::Rings) {
        if let Err(r) = self.rings.set(rings) {
            warn!("a second io_uring transport was started; stopping it");
            r.stop();
        }
    }

    /// READ: `sink` gets the bytes once (short at EOF, nothing at or past it).
    pub(crate) fn read_to(
        &self,
        of: &OpenFile,
        offset: u64,
        size: u32,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<(), Errno> {
        // Volume::read hands the bytes to its callback once; the sink replies from there so
        // the data is not copied again.
        let mut called = false;
        let r = self.vol.read(of, offset, size, &mut |bytes| {
            if called {
                error!(
                    "read of inode {}: the volume delivered data twice; extra data dropped",
                    of.ino
                );
            } else {
                called = true;
                sink(bytes);
            }
        });
        match r {
            Ok(()) if !called => {
                sink(&[]);
                Ok(())
            }
            Ok(()) => Ok(()),
            Err(e) if called => {
                error!("read of inode {}: failed after replying: {e}", of.ino);
                Ok(())
            }
            Err(e) => Err(Self::fail("read", &e)),
        }
    }

    /// READ into the transport's reply buffer (straight from the device when it is aligned);
    /// the count read.
    pub(crate) fn read_into(
        &self,
        of: &OpenFile,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<usize, Errno> {
        self.vol
            .read_into(of, offset, dst)
            .map_err(|e| Self::fail("read", &e))
    }

    /// The READs of a batch that need no wait, their device reads in flight together
    /// (`Volume::read_batch`); the others are left for [`Adapter::read_into`].
    pub(crate) fn read_batch(&self, batch: &mut [BatchRead<'_>]) {
        self.vol.read_batch(batch);
    }

    /// The WRITEs of a batch that are fast-path overwrites needing no wait
    /// (`Volume::write_batch`); the others are left for [`Adapter::write_waiting`]. Only for
    /// writes `how` allows ([`WriteHow::batchable`]).
    pub(crate) fn write_batch(&self, batch: &mut [BatchWrite<'_>]) {
        self.vol.write_batch(batch);
    }

    /// WRITE, waiting for the write to be mapped (and made durable for `O_SYNC`/`O_DSYNC`).
    pub(crate) fn write_waiting(
        &self,
        who: &RequestCreds,
        of: &OpenFile,
        offset: u64,
        data: &[u8],
        how: WriteHow,
    ) -> Result<u32, Errno> {
        let w = self
            .vol
            .write_by(of, how.at(offset), data, who)
            .map_err(|e| Self::fail("write", &e))?;
        self.written_at(of.ino, offset, &w);
        if let Some(data_only) = how.sync {
            self.vol
                .fsync(of.ino, data_only)
                .map_err(|e| Self::fail("write (O_SYNC)", &e))?;
        }
        Ok(w.bytes)
    }

    /// Kernel nodeid -> volume inode.
    fn ino(&self, n: INodeNo) -> Ino {
        if n.0 == FUSE_ROOT_ID {
            self.root
        } else {
            n.0
        }
    }

    /// Volume inode -> kernel nodeid.
    fn nodeid(&self, ino: Ino) -> u64 {
        if ino == self.root {
            FUSE_ROOT_ID
        } else {
            ino
        }
    }

    fn file_attr(&self, a: &Attr) -> FileAttr {
        FileAttr {
            ino: INodeNo(self.nodeid(a.ino)),
            size: a.size,
            blocks: a.blocks,
            atime: system_time(a.atime),
            mtime: system_time(a.mtime),
            ctime: system_time(a.ctime),
            crtime: system_time(a.crtime),
            kind: file_type(a.kind),
            perm: a.perm,
            nlink: a.nlink,
            uid: a.uid,
            gid: a.gid,
            // FUSE carries the kernel's 32-bit new_encode_dev() form, which is the low half of
            // glibc's 64-bit makedev() for majors below 4096; mknod stores what it was given.
            #[allow(clippy::cast_possible_truncation)]
            rdev: a.rdev as u32,
            blksize: BLKSIZE,
            // macOS chflags only; Linux inode flags travel through FS_IOC_GETFLAGS.
            flags: 0,
        }
    }

    fn entry(&self, reply: ReplyEntry, a: &Attr) {
        // Counted before the reply so a racing FORGET can never see the count too low.
        self.vol.note_lookup(a.ino);
        reply.entry_with_ttls(
            &self.attr_ttl,
            &self.entry_ttl,
            &self.file_attr(a),
            Generation(a.generation.into()),
        );
    }

    /// The kernel caches attributes for `attr_timeout` and learns of a change only from a
    /// reply that carries attributes. After a change made inside a request whose reply does
    /// not (setuid/setgid bits removed by a write or an `O_TRUNC` open), drop its cached copy,
    /// or it would still exec the file setuid until the cache expires.
    fn invalidate_attrs(&self, ino: Ino) {
        let Some(n) = self.notifier.get() else {
            return;
        };
        // ENOENT: the kernel has no inode for it any more, so nothing is cached.
        if let Err(e) = n.inval_inode(INodeNo(self.nodeid(ino)), -1, 0) {
            if e.raw_os_error() != Some(libc::ENOENT) {
                warn!("inode {ino}: cannot invalidate the kernel's cached attributes: {e}");
            }
        }
    }

    /// After a write the kernel asked at `offset`: it takes offset + bytes as the size, wrong
    /// if the write went elsewhere (an append placed at the file's real size), so its cached
    /// attributes go, as they do when the write removed setuid/setgid bits.
    fn written_at(&self, ino: Ino, offset: u64, w: &Written) {
        if w.dropped != 0 || w.offset != offset {
            self.invalidate_attrs(ino);
        }
    }

    /// The errno for a failed operation; unexpected failures are logged where the sysadmin looks.
    /// A fenced node's requests all fail with EIO; the fencing itself was logged once (ERROR
    /// "FENCED: ..."), so each request's failure is not repeated there.
    fn fail(op: &str, e: &Error) -> Errno {
        match e.kind() {
            ErrorKind::Io | ErrorKind::Corrupted => error!("{op}: {e}"),
            _ => debug!("{op}: {e}"),
        }
        errno(e)
    }

    /// `O_CREAT`. The volume is always asked for an exclusive create, so that inherited ACLs are
    /// applied to new files only; if the name exists (created by another node since the
    /// kernel's lookup) and `O_EXCL` was not given, the existing file is opened instead, with
    /// `O_TRUNC` honoured.
    #[allow(clippy::too_many_arguments)]
    fn create_or_open(
        &self,
        who: Caller,
        creds: &RequestCreds,
        parent: Ino,
        name: &[u8],
        mode: u32,
        flags: i32,
        writable: bool,
    ) -> Result<(Attr, Arc<OpenFile>), Errno> {
        let fail = |e: Error| Self::fail("create", &e);
        let mut last = None;
        // Another node may remove the name between our attempts; a few rounds settle it.
        for _ in 0..3 {
            match self.vol.create(parent, name, mode, who, true) {
                Ok((a, of)) => return Ok((a, of)),
                Err(e) if e.kind() == ErrorKind::Exists && flags & libc::O_EXCL == 0 => {
                    let a = match self.vol.lookup(parent, name) {
                        Ok(a) => a,
                        Err(e) if e.kind() == ErrorKind::NotFound => {
                            last = Some(e);
                            continue;
                        }
                        Err(e) => return Err(fail(e)),
                    };
                    if a.kind == FileKind::Directory {
                        return Err(Errno::EISDIR);
                    }
                    // The kernel believed it was creating, so it checked only the directory's
                    // permissions (FUSE marks create-opens FMODE_CREATED): check the file's mode
                    // bits here. Supplementary groups and ACLs are not visible at this point, so
                    // this can only be stricter than the kernel, never looser.
                    if !mode_permits(&a, Caller { umask: 0, ..who }, flags) {
                        return Err(Errno::EACCES);
                    }
                    let truncate = flags & libc::O_TRUNC != 0;
                    let of = self
                        .vol
                        .open_by(a.ino, writable, truncate, creds)
                        .map_err(fail)?;
                    let a = if truncate {
                        self.vol.getattr(a.ino).map_err(fail)?
                    } else {
                        a
                    };
                    return Ok((a, of));
                }
                Err(e) => return Err(fail(e)),
            }
        }
        Err(last.map_or(Errno::ENOENT, fail))
    }

    fn create_reply_flags(kind: FileKind) -> FopenFlags {
        if kind == FileKind::Regular {
            // No page cache for file data: another node may change the blocks at any time.
            // Parallel direct writes: no per-inode write serialization in the kernel (§1.3 #3).
            // No FLUSH at close(2): `flush` has nothing to do (writes reach the device before
            // they are acknowledged; the kernel writes shared mappings back at munmap),
            // so a close saves a round trip, and it cannot wait on this daemon: an exec closes
            // its close-on-exec files, and an exec stuck on a stopped daemon blocks most of its
            // /proc entries for every reader on the host (`cetrafs-core` cluster/procs.rs).
            FopenFlags::FOPEN_DIRECT_IO
                | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES
                | FopenFlags::FOPEN_NOFLUSH
        } else {
            FopenFlags::empty()
        }
    }
}

/// How a WRITE request is to be carried out, from the open file's flags and the request's
/// write flags (the same for either transport).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteHow {
    /// Placed at the file's size, not at the offset the kernel computed.
    append: bool,
    /// Durable before the answer: `O_DSYNC` (`Some(true)`: data only) or `O_SYNC`.
    sync: Option<bool>,
    /// The caller lacks `CAP_FSETID`: setuid/setgid bits go.
    kill_suid: bool,
}

/// `FUSE_WRITE_CACHE` and `FUSE_WRITE_KILL_SUIDGID` (`write_flags` of `fuse_write_in`).
const WRITE_CACHE: u32 = 1 << 0;
const WRITE_KILL_SUIDGID: u32 = 1 << 2;

impl WriteHow {
    pub(crate) fn new(open_flags: i32, write_flags: u32) -> Self {
        Self {
            // The kernel sends the open file's flags (f_flags) with every write. It computed an
            // O_APPEND write's offset from its cached size, which another node's appends make
            // stale: the core places the write at the file's size instead (pwritev2's
            // RWF_APPEND is not in these flags, so such a write goes where the kernel said). A
            // write-back of mmap'ed pages (FUSE_WRITE_CACHE) goes where its pages are.
            append: open_flags & libc::O_APPEND != 0 && write_flags & WRITE_CACHE == 0,
            // With FOPEN_DIRECT_IO the kernel does not turn O_SYNC/O_DSYNC writes into an
            // fsync (it only does for page-cache writes): such a write must be durable before
            // we answer. O_SYNC includes the O_DSYNC bit.
            sync: (open_flags & libc::O_DSYNC != 0)
                .then_some(open_flags & libc::O_SYNC != libc::O_SYNC),
            // The kernel flags a write whose caller lacks CAP_FSETID (it does so for direct
            // I/O whatever the INIT flags); the core removes what that caller's write must.
            kill_suid: write_flags & WRITE_KILL_SUIDGID != 0,
        }
    }

    fn at(self, offset: u64) -> WriteAt {
        if self.append {
            WriteAt::End
        } else {
            WriteAt::Offset(offset)
        }
    }

    pub(crate) fn kill_suid(self) -> bool {
        self.kill_suid
    }

    /// May it go in a batch (`Volume::write_batch`: written at its offset, no flush)?
    pub(crate) fn batchable(self) -> bool {
        !self.append && self.sync.is_none()
    }
}

/// Map a core error to the errno the caller sees. The one place this mapping lives.
pub fn errno(e: &Error) -> Errno {
    Errno::from_i32(e.errno())
}

/// Classic owner/group/other check of an open's access mode against an inode's mode bits
/// (root passes). Used only where the kernel skipped its own check.
fn mode_permits(a: &Attr, who: Caller, flags: i32) -> bool {
    if who.uid == 0 {
        return true;
    }
    let class_shift = if who.uid == a.uid {
        6
    } else if who.gid == a.gid {
        3
    } else {
        0
    };
    let bits = (u32::from(a.perm) >> class_shift) & 0o7;
    let need = match flags & libc::O_ACCMODE {
        libc::O_WRONLY => 0o2,
        libc::O_RDWR => 0o6,
        _ => 0o4,
    } | if flags & libc::O_TRUNC != 0 { 0o2 } else { 0 };
    bits & need == need
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
        umask: 0,
    }
}

/// The caller of a create, mkdir or mknod with the umask the kernel passed along. With
/// `FUSE_DONT_MASK` (negotiated with POSIX ACLs) the kernel leaves the umask to us; without it, it
/// has applied it already and applying it again changes nothing.
fn caller_masked(req: &Request, umask: u32) -> Caller {
    Caller {
        umask,
        ..caller(req)
    }
}

/// The caller's credentials for the setuid/setgid rules (read lazily; see creds.rs).
fn creds(req: &Request) -> RequestCreds {
    RequestCreds::new(req.pid(), req.uid(), req.gid())
}

fn file_type(k: FileKind) -> FileType {
    match k {
        FileKind::Regular => FileType::RegularFile,
        FileKind::Directory => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
        FileKind::Socket => FileType::Socket,
    }
}

fn system_time(t: cetrafs_core::format::inode::Timespec) -> SystemTime {
    let nsec = Duration::from_nanos(u64::from(t.nsec.min(999_999_999)));
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::from_secs(t.sec.unsigned_abs()) + nsec
    } else {
        UNIX_EPOCH - Duration::from_secs(t.sec.unsigned_abs()) + nsec
    }
}

fn timespec(t: SystemTime) -> cetrafs_core::format::inode::Timespec {
    use cetrafs_core::format::inode::Timespec;
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timespec {
            sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            nsec: d.subsec_nanos(),
        },
        Err(before) => {
            // Before 1970: sec is negative and nsec counts forward from it.
            let d = before.duration();
            let sec = -i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            match d.subsec_nanos() {
                0 => Timespec { sec, nsec: 0 },
                n => Timespec {
                    sec: sec - 1,
                    nsec: 1_000_000_000 - n,
                },
            }
        }
    }
}

fn set_time(t: TimeOrNow) -> SetTime {
    match t {
        TimeOrNow::Now => SetTime::Now,
        TimeOrNow::SpecificTime(st) => SetTime::At(timespec(st)),
    }
}

/// Borrow the open file behind a FUSE file handle.
///
/// # Safety
/// `fh` must be a value produced by `fh_from_open` that has not yet been passed to
/// `fh_release`. The kernel guarantees this for the handle it sends with READ, WRITE, FSYNC,
/// FLUSH, FALLOCATE, LSEEK and RELEASE: it keeps the `fuse_file` (and so the fh) alive until
/// its last reference is dropped, and only then sends the single RELEASE.
unsafe fn fh_borrow<'a>(fh: FileHandle) -> &'a OpenFile {
    // SAFETY: per the contract above, fh.0 is the pointer from Arc::into_raw and the Arc's
    // strong count it represents has not been released yet, so the OpenFile is alive.
    unsafe { &*(fh.0 as *const OpenFile) }
}

/// [`fh_borrow`] for a handle as the kernel's request carries it (the `io_uring` transport).
///
/// # Safety
/// As for [`fh_borrow`].
pub(crate) unsafe fn open_file<'a>(fh: u64) -> &'a OpenFile {
    // SAFETY: the caller's contract is fh_borrow's.
    unsafe { fh_borrow(FileHandle(fh)) }
}

/// Answer an ioctl with `vals` in native byte order, cut to the `out_size` the caller gave.
fn reply_u64s(reply: ReplyIoctl, out_size: u32, vals: &[u64]) {
    let out: Vec<u8> = vals.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let n = usize::try_from(out_size)
        .unwrap_or(usize::MAX)
        .min(out.len());
    reply.ioctl(0, &out[..n]);
}

fn fh_from_open(of: Arc<OpenFile>) -> FileHandle {
    FileHandle(Arc::into_raw(of) as u64)
}

/// Take back ownership of the open file at RELEASE.
///
/// # Safety
/// As for [`fh_borrow`], and it must be called exactly once per handle.
unsafe fn fh_release(fh: FileHandle) -> Arc<OpenFile> {
    // SAFETY: fh.0 came from Arc::into_raw in fh_from_open; RELEASE is sent once per open, so
    // this reclaims that one strong count exactly once.
    unsafe { Arc::from_raw(fh.0 as *const OpenFile) }
}

impl Filesystem for Adapter {
    fn init(&mut self, _req: &Request, k: &mut KernelConfig) -> io::Result<()> {
        k.set_max_write(MAX_WRITE)
            .map_err(|max| io::Error::other(format!("kernel max_write is {max}")))?;
        let _ = k.set_max_background(MAX_BACKGROUND);
        let _ = k.set_congestion_threshold(CONGESTION_THRESHOLD);
        let caps = k.capabilities();
        // Required: without ASYNC_DIO an io_uring/libaio guest is held to one request in flight
        // (§1.3 #1); ATOMIC_O_TRUNC makes open(O_TRUNC) one request that carries O_TRUNC to us.
        let required = InitFlags::FUSE_ASYNC_DIO
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_ATOMIC_O_TRUNC;
        k.add_capabilities(required).map_err(|missing| {
            io::Error::other(format!(
                "the kernel's FUSE lacks required features {missing:?}"
            ))
        })?;
        // POSIX ACLs: the kernel enforces them; DONT_MASK hands the umask to us, because it must
        // not be applied when the parent has a default ACL (cetrafs-core fs/acl.rs). Only both together.
        let acl_caps = InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK;
        if caps.contains(acl_caps) {
            let _ = k.add_capabilities(acl_caps);
            self.posix_acl = true;
        } else {
            warn!(
                "the kernel's FUSE does not offer POSIX ACLs; ACLs will be stored but not enforced"
            );
        }
        // FOPEN_DIRECT_IO would otherwise make mmap fail, and containers' binaries need mmap.
        // Shared writable mappings then go through this node's page cache: not coherent across
        // nodes, which is acceptable for executables and libraries, not for shared databases.
        if k.add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP)
            .is_err()
        {
            warn!("the kernel's FUSE lacks DIRECT_IO_ALLOW_MMAP (Linux 6.6+): mmap of files on this mount will fail");
        }
        // ls -l in a big directory: attributes come with the entries instead of one LOOKUP each.
        let _ =
            k.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO);
        // FUSE over io_uring (Linux 6.14+, when `fuse.enable_uring=1`): requests then arrive
        // on per-CPU rings once uring.rs has registered them; until then, and for FORGET and
        // INTERRUPT always, they come through /dev/fuse as before.
        if self.role == Role::Session {
            let abi = k.kernel_abi();
            let _ = self.negotiated.kernel.set((caps.bits(), abi.0, abi.1));
            let offered = caps.contains(InitFlags::FUSE_OVER_IO_URING);
            match self.transport {
                // Only if this process can make rings: once INIT takes it, the kernel holds
                // every request until they are registered.
                Transport::Auto | Transport::Uring if offered => match uring::usable() {
                    Ok(()) => {
                        let _ = k.add_capabilities(InitFlags::FUSE_OVER_IO_URING);
                        self.negotiated.uring.store(true, Ordering::Release);
                    }
                    Err(e) if self.transport == Transport::Uring => {
                        return Err(io::Error::other(format!(
                            "transport=uring, but this process cannot use io_uring ({e}): \
                             a seccomp profile or the sysctl kernel.io_uring_disabled may forbid it"
                        )));
                    }
                    Err(e) => {
                        warn!("FUSE over io_uring is offered but io_uring is unusable here ({e}): classic transport");
                    }
                },
                Transport::Classic | Transport::Auto => {}
                Transport::Uring => {
                    return Err(io::Error::other(
                        "transport=uring, but the kernel's FUSE does not offer io_uring: \
                         set the fuse module parameter enable_uring=1 (Linux 6.14+; \
                         echo 1 > /sys/module/fuse/parameters/enable_uring) or mount with \
                         transport=auto",
                    ));
                }
            }
        }
        // Deliberately NOT FUSE_WRITEBACK_CACHE: a node-local dirty page cache has no
        // cross-node coherence.
        // Setuid/setgid removal: neither FUSE_HANDLE_KILLPRIV nor _V2 is requested, because
        // fuser does not pass their request flags (FATTR_KILL_SUIDGID, FUSE_OPEN_KILL_SUIDGID)
        // on. The kernel then sends the new mode itself with a truncate or chown (the classic
        // rule), and flags direct writes with FUSE_WRITE_KILL_SUIDGID when the writer lacks
        // CAP_FSETID. What it leaves to us (the write flag; setgid without group-exec when the
        // caller is not in the group; open with O_TRUNC, which it never flags) the core's
        // rules (fs/suid.rs) complete with the caller's credentials (creds.rs).
        if self.role == Role::Session {
            info!(
                "FUSE session ready (kernel ABI {:?}, POSIX ACLs {}, io_uring {})",
                k.kernel_abi(),
                if self.posix_acl { "on" } else { "off" },
                if self.negotiated.uring() {
                    "negotiated"
                } else {
                    "off"
                }
            );
        }
        Ok(())
    }

    fn destroy(&mut self) {
        if self.role != Role::Session {
            return;
        }
        // No ring thread may still be serving a request while the volume goes, nor a change
        // thread (every request was answered before DESTROY: this only bounds a surprise).
        if let Some(rings) = self.rings.get() {
            rings.stop();
        }
        if !self.changes.drain(CHANGES_DRAIN) {
            warn!("a metadata change still runs at unmount; unmounting regardless");
        }
        let r = self.vol.unmount();
        match &r {
            Ok(()) => info!("volume flushed and unmounted"),
            // A fenced node's unmount cannot flush: the one FENCED error already said so and
            // what to do; this is its consequence, not a new fault.
            Err(e) if e.kind() == ErrorKind::Fenced => warn!("unmount (nothing flushed): {e}"),
            Err(e) => error!("unmount: {e}"),
        }
        *self.outcome.lock().or_panic() = Some(r.map_err(|e| e.to_string()));
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = name.to_owned();
        self.may_wait("lookup", self.ino(parent), move |me| {
            match me.vol.lookup(me.ino(parent), name.as_bytes()) {
                Ok(a) => me.entry(reply, &a),
                // No negative entry caching: another node may create the name at any moment.
                Err(e) => reply.error(Self::fail("lookup", &e)),
            }
        });
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        // The kernel sends FORGET when it evicts the inode, with all its lookups at once; an
        // unlinked inode is freed only then (its number must not be reused before).
        self.vol.forget(self.ino(ino), nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.may_wait("getattr", self.ino(ino), move |me| {
            match me.vol.getattr(me.ino(ino)) {
                Ok(a) => reply.attr(&me.attr_ttl, &me.file_attr(&a)),
                Err(e) => reply.error(Self::fail("getattr", &e)),
            }
        });
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let ino = self.ino(ino);
        // Truncation through an open handle (ftruncate) and through a path are the same
        // operation on the volume; the handle adds nothing.
        let set = SetAttr {
            mode: mode.map(|m| m & 0o7777),
            uid,
            gid,
            size,
            atime: atime.map(set_time),
            mtime: mtime.map(set_time),
            ctime: ctime.map(timespec),
        };
        let who = creds(req);
        self.may_wait("setattr", ino, move |me| {
            match me.vol.setattr_by(ino, &set, &who) {
                Ok(a) => reply.attr(&me.attr_ttl, &me.file_attr(&a)),
                Err(e) => reply.error(Self::fail("setattr", &e)),
            }
        });
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        self.may_wait("readlink", self.ino(ino), move |me| {
            match me.vol.readlink(me.ino(ino)) {
                Ok(t) => reply.data(&t),
                Err(e) => reply.error(Self::fail("readlink", &e)),
            }
        });
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let (parent, name, who) = (self.ino(parent), name.to_owned(), caller_masked(req, umask));
        self.may_wait("mknod", parent, move |me| {
            match me
                .vol
                .mknod(parent, name.as_bytes(), mode, u64::from(rdev), who)
            {
                Ok(a) => me.entry(reply, &a),
                Err(e) => reply.error(Self::fail("mknod", &e)),
            }
        });
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let (parent, name, who) = (self.ino(parent), name.to_owned(), caller_masked(req, umask));
        self.may_wait("mkdir", parent, move |me| {
            match me.vol.mkdir(parent, name.as_bytes(), mode, who) {
                Ok(a) => me.entry(reply, &a),
                Err(e) => reply.error(Self::fail("mkdir", &e)),
            }
        });
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (parent, name) = (self.ino(parent), name.to_owned());
        self.may_wait("unlink", parent, move |me| {
            match me.vol.unlink(parent, name.as_bytes()) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(Self::fail("unlink", &e)),
            }
        });
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (parent, name) = (self.ino(parent), name.to_owned());
        self.may_wait("rmdir", parent, move |me| {
            match me.vol.rmdir(parent, name.as_bytes()) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(Self::fail("rmdir", &e)),
            }
        });
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let (parent, name, target, who) = (
            self.ino(parent),
            link_name.to_owned(),
            target.to_owned(),
            caller(req),
        );
        self.may_wait("symlink", parent, move |me| {
            match me
                .vol
                .symlink(parent, name.as_bytes(), target.as_os_str().as_bytes(), who)
            {
                Ok(a) => me.entry(reply, &a),
                Err(e) => reply.error(Self::fail("symlink", &e)),
            }
        });
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        use fuser::RenameFlags as F;
        let known = F::RENAME_NOREPLACE | F::RENAME_EXCHANGE | F::RENAME_WHITEOUT;
        if !known.contains(flags) {
            reply.error(Errno::EINVAL);
            return;
        }
        let f = RenameFlags {
            noreplace: flags.contains(F::RENAME_NOREPLACE),
            exchange: flags.contains(F::RENAME_EXCHANGE),
            // overlayfs upper layers: the whiteout is owned by the caller, as the kernel's is.
            whiteout: flags.contains(F::RENAME_WHITEOUT).then(|| caller(req)),
        };
        let (parent, name, newparent, newname) = (
            self.ino(parent),
            name.to_owned(),
            self.ino(newparent),
            newname.to_owned(),
        );
        self.may_wait("rename", parent, move |me| {
            match me
                .vol
                .rename(parent, name.as_bytes(), newparent, newname.as_bytes(), f)
            {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(Self::fail("rename", &e)),
            }
        });
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let (ino, newparent, newname) = (self.ino(ino), self.ino(newparent), newname.to_owned());
        self.may_wait("link", ino, move |me| {
            match me.vol.link(ino, newparent, newname.as_bytes()) {
                Ok(a) => me.entry(reply, &a),
                Err(e) => reply.error(Self::fail("link", &e)),
            }
        });
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let writable = flags.acc_mode() != OpenAccMode::O_RDONLY;
        // With FUSE_ATOMIC_O_TRUNC the kernel passes O_TRUNC here instead of a separate setattr
        // (and so never computes the setuid/setgid removal for it: the core does).
        let truncate = flags.0 & libc::O_TRUNC != 0;
        let ino = self.ino(ino);
        let who = creds(req);
        let open = move |me: &Self| match me.vol.open_by(ino, writable, truncate, &who) {
            Ok(of) => {
                if truncate && writable {
                    me.invalidate_attrs(ino);
                }
                reply.opened(
                    fh_from_open(of),
                    Self::create_reply_flags(FileKind::Regular),
                );
            }
            Err(e) => reply.error(Self::fail("open", &e)),
        };
        // A truncating open is a change (it frees the file's blocks); any open may wait for a
        // silent holder's lock to load the inode.
        self.may_wait("open", ino, open);
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        // SAFETY: the kernel sends READ only with an fh from our open/create that is not yet released.
        let of = unsafe { fh_borrow(fh) };
        let _timed = Timed::new("read", of.ino);
        let mut reply = Some(reply);
        let r = self.read_to(of, offset, size, &mut |bytes| {
            if let Some(rp) = reply.take() {
                rp.data(bytes);
            }
        });
        if let (Some(rp), Err(e)) = (reply, r) {
            rp.error(e);
        }
    }

    fn write(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        // SAFETY: the kernel sends WRITE only with an fh from our open/create that is not yet released.
        let of = unsafe { fh_borrow(fh) };
        let how = WriteHow::new(flags.0, write_flags.bits());
        let who = creds(req).with_fsetid(!how.kill_suid);
        if how.sync.is_none() && !how.append {
            // An allocating write does not wait here to be mapped: the thread that maps it
            // answers, and this worker goes on to the next request. A queued write went where
            // the kernel said and removed no bits (a write that must remove them takes the
            // locked path), so the kernel's cached attributes stay right; the caller keeps
            // `of` open until then, as the kernel sends RELEASE only after every answer.
            let done: WriteDone = Box::new(move |r: cetrafs_core::Result<Written>| match r {
                Ok(w) => reply.written(w.bytes),
                Err(e) => reply.error(Self::fail("write", &e)),
            });
            let at = how.at(offset);
            if let WriteStarted::Done(r, done) = self.vol.write_then(of, at, data, &who, done) {
                if let Ok(w) = &r {
                    self.written_at(of.ino, offset, w);
                }
                done(r);
            }
            return;
        }
        // An O_SYNC/O_DSYNC or appending write is answered once mapped (and durable): of a
        // file this node does not own, that needs the global lock, so it waits where changes
        // wait. The handle stays valid until the answer: the kernel sends RELEASE only after
        // every answer.
        self.may_wait_with("write", of.ino, data, move |me, data| {
            // SAFETY: as above; this request is not answered yet.
            let of = unsafe { fh_borrow(fh) };
            match me.write_waiting(&who, of, offset, data, how) {
                Ok(n) => reply.written(n),
                Err(e) => reply.error(e),
            }
        });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Writes go to the device before they are acknowledged; close(2) has nothing to flush.
        // (Durability is fsync's job.)
        reply.ok();
    }

    fn poll(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _ph: PollNotifier,
        _events: PollEvents,
        _flags: PollFlags,
        reply: ReplyPoll,
    ) {
        // Files and directories here are always ready. ENOSYS tells the kernel exactly that:
        // it stops sending POLL for this mount and answers every poll with the default mask
        // (readable and writable), as for a local filesystem.
        reply.error(Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // SAFETY: RELEASE comes exactly once per handle from our open/create, after its last use.
        let of = unsafe { fh_release(fh) };
        let _timed = Timed::new("release", of.ino);
        match self.vol.release(&of) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Self::fail("release", &e)),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let ino = self.ino(ino);
        self.may_wait("fsync", ino, move |me| match me.vol.fsync(ino, datasync) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Self::fail("fsync", &e)),
        });
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.may_wait("opendir", self.ino(ino), move |me| {
            // Directory streams are stateless: the cookies from Volume::readdir carry the position.
            // Still check that it is a directory the volume knows, so opendir fails early.
            match me.vol.getattr(me.ino(ino)) {
                Ok(a) if a.kind == FileKind::Directory => {
                    reply.opened(FileHandle(0), FopenFlags::empty());
                }
                Ok(_) => reply.error(Errno::ENOTDIR),
                Err(e) => reply.error(Self::fail("opendir", &e)),
            }
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        self.may_wait("readdir", self.ino(ino), move |me| {
            let r = me
                .vol
                .readdir(me.ino(ino), offset, &mut |e: &DirListEntry| {
                    // add() returns true when the buffer is full and the entry was not added.
                    !reply.add(
                        INodeNo(me.nodeid(e.ino)),
                        e.next,
                        file_type(e.kind),
                        OsStr::from_bytes(&e.name),
                    )
                });
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(Self::fail("readdir", &e)),
            }
        });
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        self.may_wait("readdirplus", self.ino(ino), move |me| {
            let dir = me.ino(ino);
            // Volume::readdir calls emit with its metadata lock released, so calling back is safe.
            let r = me.vol.readdir(dir, offset, &mut |e: &DirListEntry| {
                // The entry names its inode; dot entries are not instantiated by the kernel.
                let (a, ttl, with_attributes) = match me.vol.entry_attr(dir, e) {
                    EntryAttr::Loaded(a) => (a, me.entry_ttl, true),
                    // Removed (here or on another node) since the directory block was read: skip
                    // it; the next entry's cookie still resumes correctly.
                    EntryAttr::Gone => return true,
                    // In the directory but its inode cannot be read (the core logged it), or not
                    // now (every holder of the global lock is silent: the core's
                    // `fs/own_lock_reads.rs`, which then gives the inode's generation and never
                    // lists so an inode the kernel was given attributes of): listed so that
                    // nothing looks missing, with zero timeouts so the kernel caches nothing and a
                    // stat of it asks again.
                    EntryAttr::Unreadable(a) => (a, Duration::ZERO, false),
                };
                // fuser sends the attributes' inode number as the node id: the kernel takes a
                // reference to every entry but "." and "..", placeholders too, and until its
                // forget the number is not reused (the inode may be a live one another node
                // unlinks meanwhile).
                let counted = e.name != b"." && e.name != b"..";
                if counted {
                    if with_attributes {
                        me.vol.note_lookup(a.ino);
                    } else {
                        me.vol.note_listed(a.ino);
                    }
                }
                let full = reply.add(
                    INodeNo(me.nodeid(a.ino)),
                    e.next,
                    OsStr::from_bytes(&e.name),
                    &ttl,
                    &me.file_attr(&a),
                    Generation(a.generation.into()),
                );
                if full && counted {
                    // Not sent after all: give the reference back.
                    me.vol.forget(a.ino, 1);
                }
                !full
            });
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(Self::fail("readdirplus", &e)),
            }
        });
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let ino = self.ino(ino);
        self.may_wait("fsyncdir", ino, move |me| {
            match me.vol.fsync(ino, datasync) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(Self::fail("fsyncdir", &e)),
            }
        });
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.may_wait("statfs", self.root, move |me| match me.vol.statfs() {
            Ok(s) => reply.statfs(
                s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.bsize,
            ),
            Err(e) => reply.error(Self::fail("statfs", &e)),
        });
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        position: u32,
        reply: ReplyEmpty,
    ) {
        if position != 0 {
            reply.error(Errno::EINVAL);
            return;
        }
        let (ino, name, value) = (self.ino(ino), name.to_owned(), value.to_vec());
        let create = flags & libc::XATTR_CREATE != 0;
        let replace = flags & libc::XATTR_REPLACE != 0;
        self.may_wait("setxattr", ino, move |me| {
            match me
                .vol
                .setxattr(ino, name.as_bytes(), &value, create, replace)
            {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(Self::fail("setxattr", &e)),
            }
        });
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let name = name.to_owned();
        self.may_wait("getxattr", self.ino(ino), move |me| {
            match me.vol.getxattr(me.ino(ino), name.as_bytes()) {
                Ok(v) => xattr_reply(reply, size, &v),
                Err(e) => reply.error(Self::fail("getxattr", &e)),
            }
        });
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        self.may_wait("listxattr", self.ino(ino), move |me| {
            match me.vol.listxattr(me.ino(ino)) {
                Ok(names) => {
                    let mut buf = Vec::with_capacity(names.iter().map(|n| n.len() + 1).sum());
                    for n in names {
                        buf.extend_from_slice(&n);
                        buf.push(0);
                    }
                    xattr_reply(reply, size, &buf);
                }
                Err(e) => reply.error(Self::fail("listxattr", &e)),
            }
        });
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (ino, name) = (self.ino(ino), name.to_owned());
        self.may_wait("removexattr", ino, move |me| {
            match me.vol.removexattr(ino, name.as_bytes()) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(Self::fail("removexattr", &e)),
            }
        });
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        // Mounted with default_permissions: the kernel checks modes and ACLs itself and does
        // not send ACCESS; if it ever does, the inode exists, which is all left to say.
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let (parent, name) = (self.ino(parent), name.to_owned());
        let (who, creds) = (caller_masked(req, umask), creds(req));
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        self.may_wait("create", parent, move |me| {
            match me.create_or_open(who, &creds, parent, name.as_bytes(), mode, flags, writable) {
                Ok((a, of)) => {
                    let fa = me.file_attr(&a);
                    let fh = fh_from_open(of);
                    let gen = Generation(a.generation.into());
                    me.vol.note_lookup(a.ino);
                    reply.created(
                        &me.entry_ttl,
                        &fa,
                        gen,
                        fh,
                        Self::create_reply_flags(a.kind),
                    );
                }
                Err(e) => reply.error(e),
            }
        });
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        const KEEP: i32 = libc::FALLOC_FL_KEEP_SIZE;
        const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE;
        const ZERO: i32 = libc::FALLOC_FL_ZERO_RANGE;
        let m = match mode {
            0 => FallocMode::Allocate { keep_size: false },
            KEEP => FallocMode::Allocate { keep_size: true },
            m if m == PUNCH | KEEP => FallocMode::PunchHole,
            ZERO => FallocMode::ZeroRange { keep_size: false },
            m if m == ZERO | KEEP => FallocMode::ZeroRange { keep_size: true },
            _ => {
                reply.error(Errno::EOPNOTSUPP);
                return;
            }
        };
        let ino = self.ino(ino);
        self.may_wait("fallocate", ino, move |me| {
            match me.vol.fallocate(ino, offset, length, m) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(Self::fail("fallocate", &e)),
            }
        });
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        // The kernel handles SEEK_SET/CUR/END itself and forwards only SEEK_DATA/SEEK_HOLE.
        let w = match whence {
            libc::SEEK_DATA => Whence::Data,
            libc::SEEK_HOLE => Whence::Hole,
            libc::SEEK_SET => {
                reply.offset(offset);
                return;
            }
            _ => {
                reply.error(Errno::EINVAL);
                return;
            }
        };
        let Ok(off) = u64::try_from(offset) else {
            reply.error(Errno::ENXIO);
            return;
        };
        // It may load the inode (perhaps waiting for a silent holder).
        let ino = self.ino(ino);
        self.may_wait("lseek", ino, move |me| match me.vol.lseek(ino, off, w) {
            Ok(pos) => match i64::try_from(pos) {
                Ok(p) => reply.offset(p),
                Err(_) => reply.error(Errno::EOVERFLOW),
            },
            Err(e) => reply.error(Self::fail("lseek", &e)),
        });
    }

    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: ReplyIoctl,
    ) {
        let (uid, in_data) = (req.uid(), in_data.to_vec());
        // chattr and defrag change metadata; FITRIM and grow take the global lock too.
        self.may_wait("ioctl", self.ino(ino), move |me| {
            // lsattr/chattr reach us through the kernel's fileattr code, which opens the inode
            // privately (so fh may be a directory's 0) and sends FS_IOC_[GS]ETFLAGS with a 4-byte
            // int in and out. The kernel has already checked ownership and CAP_LINUX_IMMUTABLE.
            let ino = me.ino(ino);
            let out_len = usize::try_from(out_size).unwrap_or(usize::MAX).min(4);
            match cmd {
                FS_IOC_GETFLAGS | FS_IOC32_GETFLAGS => match me.vol.get_flags(ino) {
                    Ok(f) => reply.ioctl(0, &f.to_ne_bytes()[..out_len]),
                    Err(e) => reply.error(Self::fail("ioctl(FS_IOC_GETFLAGS)", &e)),
                },
                FS_IOC_SETFLAGS | FS_IOC32_SETFLAGS => {
                    let Some(raw) = in_data.first_chunk::<4>() else {
                        reply.error(Errno::EINVAL);
                        return;
                    };
                    let f = u32::from_ne_bytes(*raw);
                    match me.vol.set_flags(ino, f) {
                        Ok(()) => reply.ioctl(0, &raw[..out_len]),
                        Err(e) => reply.error(Self::fail("ioctl(FS_IOC_SETFLAGS)", &e)),
                    }
                }
                FS_IOC_FSGETXATTR => match me.vol.get_flags(ino) {
                    Ok(f) => {
                        let x = FL_XFLAG
                            .iter()
                            .filter(|(fl, _)| f & fl != 0)
                            .fold(0, |x, (_, xf)| x | xf);
                        let mut fsx = [0u8; FSXATTR_SIZE];
                        fsx[..4].copy_from_slice(&u32::to_ne_bytes(x));
                        let n = usize::try_from(out_size)
                            .unwrap_or(usize::MAX)
                            .min(FSXATTR_SIZE);
                        reply.ioctl(0, &fsx[..n]);
                    }
                    Err(e) => reply.error(Self::fail("ioctl(FS_IOC_FSGETXATTR)", &e)),
                },
                FS_IOC_FSSETXATTR => {
                    let Some(fsx) = in_data.first_chunk::<FSXATTR_SIZE>() else {
                        reply.error(Errno::EINVAL);
                        return;
                    };
                    let word =
                        |i: usize| u32::from_ne_bytes([fsx[i], fsx[i + 1], fsx[i + 2], fsx[i + 3]]);
                    let x = word(0);
                    let known = FL_XFLAG.iter().fold(0, |k, (_, xf)| k | xf);
                    // extent size hints and project ids are not stored: only accept "none".
                    if x & !known != 0 || word(4) != 0 || word(12) != 0 || word(16) != 0 {
                        reply.error(Errno::EOPNOTSUPP);
                        return;
                    }
                    let f = FL_XFLAG
                        .iter()
                        .filter(|(_, xf)| x & xf != 0)
                        .fold(0, |f, (fl, _)| f | fl);
                    match me.vol.set_flags(ino, f) {
                        Ok(()) => reply.ioctl(0, &[]),
                        Err(e) => reply.error(Self::fail("ioctl(FS_IOC_FSSETXATTR)", &e)),
                    }
                }
                CETRA_IOC_DEFRAG => {
                    // Only a regular file's handle is an OpenFile of ours (its open made it).
                    match me.vol.getattr(ino) {
                        Ok(a) if a.kind == FileKind::Regular && fh.0 != 0 => {}
                        Ok(_) => {
                            reply.error(Errno::EINVAL);
                            return;
                        }
                        Err(e) => {
                            reply.error(Self::fail("ioctl(CETRA_IOC_DEFRAG)", &e));
                            return;
                        }
                    }
                    // SAFETY: the kernel sends the handle of the open regular file the ioctl was
                    // made on, alive for the duration of the request (as for READ and WRITE).
                    let writable = unsafe { fh_borrow(fh) }.writable;
                    match me.vol.defrag(ino, writable) {
                        Ok(d) => reply_u64s(
                            reply,
                            out_size,
                            &[d.extents_before, d.extents_after, d.blocks_copied],
                        ),
                        Err(e) => reply.error(Self::fail("ioctl(CETRA_IOC_DEFRAG)", &e)),
                    }
                }
                CETRA_IOC_GROW => {
                    // As FITRIM: the whole volume is the business of who administers it.
                    if uid != 0 {
                        reply.error(Errno::EPERM);
                        return;
                    }
                    match me.vol.grow() {
                        Ok(g) => reply_u64s(
                            reply,
                            out_size,
                            &[g.old_groups, g.new_groups, g.old_bytes, g.new_bytes],
                        ),
                        Err(e) => reply.error(Self::fail("ioctl(CETRA_IOC_GROW)", &e)),
                    }
                }
                FITRIM => {
                    // As ext4: the whole volume's free space is the caller's business only if it
                    // may administer the filesystem.
                    if uid != 0 {
                        reply.error(Errno::EPERM);
                        return;
                    }
                    let Some(range) = in_data.first_chunk::<FSTRIM_RANGE_SIZE>() else {
                        reply.error(Errno::EINVAL);
                        return;
                    };
                    let word = |i: usize| {
                        let mut w = [0u8; 8];
                        w.copy_from_slice(&range[i..i + 8]);
                        u64::from_ne_bytes(w)
                    };
                    match me.vol.trim(word(0), word(8), word(16)) {
                        Ok(bytes) => {
                            // The kernel copies the range back: len is what was trimmed.
                            let mut out = *range;
                            out[8..16].copy_from_slice(&bytes.to_ne_bytes());
                            let n = usize::try_from(out_size)
                                .unwrap_or(usize::MAX)
                                .min(FSTRIM_RANGE_SIZE);
                            reply.ioctl(0, &out[..n]);
                        }
                        Err(e) => reply.error(Self::fail("ioctl(FITRIM)", &e)),
                    }
                }
                _ => reply.error(Errno::ENOTTY),
            }
        });
    }
}

/// getxattr/listxattr size-probe protocol: size 0 asks for the length; a buffer too small is ERANGE.
fn xattr_reply(reply: ReplyXattr, size: u32, value: &[u8]) {
    let Ok(len) = u32::try_from(value.len()) else {
        reply.error(Errno::E2BIG);
        return;
    };
    if size == 0 {
        reply.size(len);
    } else if len > size {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cetrafs_core::format::inode::Timespec;

    #[test]
    fn errno_mapping_uses_core_kinds() {
        assert_eq!(errno(&Error::new(ErrorKind::NotFound, "x")), Errno::ENOENT);
        assert_eq!(errno(&Error::new(ErrorKind::NoData, "x")), Errno::NO_XATTR);
        assert_eq!(errno(&Error::new(ErrorKind::Fenced, "x")), Errno::EIO);
        assert_eq!(errno(&Error::new(ErrorKind::ReadOnly, "x")), Errno::EROFS);
    }

    #[test]
    fn time_conversion_roundtrips_including_before_1970() {
        for t in [
            Timespec { sec: 0, nsec: 0 },
            Timespec {
                sec: 1_700_000_000,
                nsec: 123_456_789,
            },
            Timespec {
                sec: -1,
                nsec: 500_000_000,
            },
            Timespec {
                sec: -86_400,
                nsec: 0,
            },
        ] {
            assert_eq!(timespec(system_time(t)), t, "{t:?}");
        }
    }

    #[test]
    fn session_config_defaults() {
        let cfg = session_config(Path::new("/dev/sdb"), &Options::default());
        assert_eq!(cfg.n_threads, Some(DEFAULT_THREADS));
        assert!(cfg.clone_fd);
        assert_eq!(cfg.acl, SessionACL::All);
        assert!(cfg
            .mount_options
            .contains(&MountOption::FSName("/dev/sdb".into())));
        assert!(cfg.mount_options.contains(&MountOption::DefaultPermissions));
        assert!(cfg.mount_options.contains(&MountOption::Suid));
        assert!(!cfg.mount_options.contains(&MountOption::RO));
        let ro = Options {
            read_only: true,
            nosuid: true,
            noatime: true,
            ..Options::default()
        };
        let cfg = session_config(Path::new("/dev/sdb"), &ro);
        assert!(cfg.mount_options.contains(&MountOption::RO));
        assert!(cfg.mount_options.contains(&MountOption::NoSuid));
        assert!(cfg.mount_options.contains(&MountOption::NoAtime));
    }
}
