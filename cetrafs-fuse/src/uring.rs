//! FUSE over `io_uring`: the request transport of Linux 6.14+ when the fuse module's
//! `enable_uring` parameter is set (`transport=auto`, the default, or `transport=uring`).
//!
//! **What the kernel does** (`fs/fuse/dev_uring.c`). INIT (adapter.rs) takes
//! `FUSE_OVER_IO_URING`. The daemon then registers *entries* with `IORING_OP_URING_CMD`
//! commands (128-byte SQEs) on a /dev/fuse descriptor of the connection: each entry names a
//! header buffer (`fuse_uring_req_header`: 128 bytes for `fuse_in_header`/`fuse_out_header`,
//! 128 for the operation's own header such as `fuse_read_in`, 32 for `fuse_uring_ent_in_out`)
//! and a payload buffer of at least the connection's largest request (`max_write`, 1 MiB), and
//! a queue id: one queue per possible CPU. Once every queue has an entry the connection
//! switches: a request goes to a free entry of the queue of the CPU its caller runs on, and
//! arrives as the completion of that entry's command; the answer goes back in the same buffers
//! with `COMMIT_AND_FETCH`, which also makes the entry wait for the next request. One
//! `io_uring_enter` per request, where /dev/fuse takes a `read` and a `writev`, and the
//! request stays on its CPU. FORGET and INTERRUPT still come through /dev/fuse, which the
//! fuser session keeps serving (as it does every request before the rings are complete).
//!
//! **Layout here** ([`Layout`]). For each queue of a CPU online at mount, [`WORKERS_PER_QUEUE`]
//! worker threads, each with its own ring and its share of the queue's entries: `threads`
//! (`CETRA_FUSE_THREADS`, 32 by default) plus [`WAITING_ROOM`] (96) for requests that wait
//! for the cluster. A caller's requests all go to the queue of its CPU, so one VM thread at
//! QD32 needs 32 entries on one queue, and a request holds its entry until it is answered:
//! without the room, 32 `chmod`s from one CPU waiting for a dead node's recovery stalled
//! that CPU's VM reads with them. The queues of possible but
//! offline CPUs share one spare worker, one entry each (they need one before the kernel uses
//! any queue; a CPU plugged in later is served, slowly). Each entry has its own buffers
//! (a worker's payloads are one mapping), allocated once, never per request; payloads are
//! resident only as far as requests touched them, and the kernel hands the most recently
//! answered entry out first. What grows with the online CPUs: a ring, an eventfd and a
//! device ring per worker (the descriptor limit is raised to its hard limit), and 1 MiB of
//! touched payload per request a queue had in progress at once. The workers are not pinned
//! to their queue's CPU: measured on 2 cores, pinning made a QD1 read wait 108 µs instead of 71 (the
//! worker then shares the CPU of the caller it answers).
//!
//! **A worker answers in batches.** It waits for completions, takes all that are there at
//! once, and answers them together: the READs and WRITEs that need no wait go to the volume
//! as one batch (`Volume::read_batch`, `Volume::write_batch`: the fast path's admission taken
//! without waiting, then every request's device I/O in flight at once, one system call for
//! the lot), and every answer goes back with the worker's next wait (`COMMIT_AND_FETCH`
//! for each, one `io_uring_enter`). Under a queue depth of 32 one wake-up of a worker thus
//! serves many requests, where one /dev/fuse worker serves one per wake-up (two context
//! switches per request were most of the daemon's CPU). Its rings are made with
//! `SINGLE_ISSUER | DEFER_TASKRUN`: the kernel hands over completions when the worker waits,
//! without interrupting it. A request that may wait — anything off the data path, a READ
//! or WRITE whose admission waits for the cluster (the inode's lock not held here, a handoff
//! or a change of it under way), an allocating, appending or `O_SYNC` write — goes to a
//! **helper** (a change thread of offload.rs, started as requests wait), which answers it as the one-entry
//! workers of the first version did and hands the entry back to its worker (an eventfd the
//! worker's ring has a read pending on), so a worker never stops taking fast requests while
//! one waits.
//!
//! **Which code answers.** READ and WRITE (the data path) are answered through the
//! adapter's own read and write code (the batches, [`Adapter::read_into`],
//! [`Adapter::write_waiting`]). The payload buffers are page-aligned, so an aligned READ (what
//! `O_DIRECT` guests send) is read from the LUN straight into it and an aligned WRITE goes to
//! the LUN from it: the kernel's copy is the only one. DESTROY is answered
//! here (the session's end runs the adapter's `destroy`). Every other request goes through the
//! **bridge**: a second fuser session over a `SOCK_SEQPACKET` socket pair, whose adapter is
//! the same volume's ([`Adapter::for_rings`]). The request is rebuilt in /dev/fuse form
//! (`fuse_in_header`, the operation's header, the payload), and fuser's answer is copied back
//! into the entry. So every operation keeps one implementation, fuser's decoding and
//! adapter.rs, whichever transport carried it; the extra socket round trip costs only the
//! operations off the data path.
//!
//! **End.** At unmount the kernel completes the entries' commands with an error (an entry
//! with a helper: its commit), and a worker ends once all of its entries have; the session's
//! `destroy` waits for the workers ([`Rings::stop`], bounded) before it unmounts the volume. The buffers are never freed (a process's worth: the kernel may still
//! hold their addresses until the rings are torn down).

use crate::adapter::{self, Adapter, WriteHow};
use crate::creds::RequestCreds;
use crate::offload::Offload;
use cetrafs_core::fs::{BatchRead, BatchWrite};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{debug, error, warn};

/// `fuse_uring_req_header`: `in_out` (128), `op_in` (128), `fuse_uring_ent_in_out` (32).
const OP_IN: usize = 128;
const ENT_IN_OUT: usize = 256;
const HEADER_LEN: usize = 288;
/// `fuse_uring_cmd` values (`cmd_op` of the SQE).
const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// Opcodes answered in the worker.
const FUSE_READ: u32 = 15;
const FUSE_WRITE: u32 = 16;
const FUSE_INIT: u32 = 26;
const FUSE_DESTROY: u32 = 38;
/// sizeof `fuse_in_header`, `fuse_out_header`, `fuse_read_in`/`fuse_write_in`, `fuse_init_in`.
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;
const RW_IN: usize = 40;
const INIT_IN: usize = 64;
/// The payload buffer: the connection's largest request or answer (`max_write` and
/// `max_pages` are both 1 MiB: adapter.rs).
const PAYLOAD_LEN: usize = 1 << 20;
/// Workers of the bridge session (operations off the data path). At most the adapter's
/// inline share (8) of requests waiting for the cluster run on them; the others wait on
/// change threads (offload.rs).
const BRIDGE_THREADS: usize = 16;
/// Socket buffers of the bridge: a whole answer (a READDIR, an xattr) is one message.
const BRIDGE_SOCKET_BUFFER: libc::c_int = 4 << 20;
/// Entries of a queue beyond `threads`, for requests that wait. A request holds its entry
/// until it is answered, and the kernel sends a request only to its caller's queue: a
/// metadata change waiting for the global lock (perhaps for a dead holder's recovery) holds
/// one entry of its CPU's queue for as long. With only `threads` entries, 32 such waits from
/// one CPU (processes of containers, a storm of `chmod`s) left that CPU's VM threads no
/// entry: their reads waited for the recovery too. The kernel hands the most recently
/// answered entry out first, so entries beyond what is in use at once cost no resident memory.
const WAITING_ROOM: usize = 96;
/// Workers per queue (each with its share of the queue's entries): two, so that one takes
/// requests while the other waits for its batch's device I/O.
const WORKERS_PER_QUEUE: usize = 2;
/// How long [`Rings::stop`] waits for the workers once the connection is gone.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// An entry's header buffer (the kernel reads and writes it in place).
#[repr(C, align(64))]
struct Header([u8; HEADER_LEN]);

/// The running transport.
#[derive(Debug)]
pub struct Rings {
    /// One message per worker that ended.
    ended: Mutex<mpsc::Receiver<()>>,
    workers: usize,
    /// The helpers' pool: closed by [`Rings::stop`] (nothing more is handed to it; its
    /// threads end once idle).
    jobs: Jobs,
}

impl Rings {
    /// Wait (at most a few seconds) until every worker has ended. Called once the connection
    /// is gone, when the kernel has completed every entry's command with an error.
    /// Then the helpers are told to end (a worker still serving answers EIO from then on
    /// what it would have handed to one).
    pub fn stop(&self) {
        self.wait_workers();
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.take();
        }
    }

    fn wait_workers(&self) {
        let deadline = Instant::now() + STOP_WAIT;
        let Ok(ended) = self.ended.lock() else {
            return;
        };
        let mut left = self.workers;
        while left > 0 {
            let wait = deadline.saturating_duration_since(Instant::now());
            match ended.recv_timeout(wait) {
                Ok(()) => left -= 1,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    warn!("{left} io_uring workers still serving after the session ended");
                    return;
                }
            }
        }
    }
}

/// Register the rings on `dev` (a /dev/fuse descriptor of the session) once INIT took
/// `FUSE_OVER_IO_URING`: `threads` workers in all, spread over the kernel's queues. `ring_fs`
/// answers the data path, `bridge_fs` the rest; `kernel` is what the kernel's INIT offered
/// (capabilities, ABI major and minor), repeated to the bridge session. Returns once every
/// worker's entry is registered (or the first failure); the description says what runs.
///
/// **Must run right after INIT**: from then on the kernel holds every request until the rings
/// are complete. On failure it therefore tells the kernel to give `io_uring` up (a refused
/// registration does: requests then flow through /dev/fuse); the error's flag says whether
/// that worked (if not, the mount cannot serve anything).
pub fn start(
    dev: OwnedFd,
    ring_fs: Adapter,
    bridge_fs: Adapter,
    kernel: (u64, u32, u32),
    threads: usize,
) -> (Option<Rings>, Result<String, (io::Error, bool)>) {
    let raw = dev.as_raw_fd();
    let (rings, r) = start_rings(dev, ring_fs, bridge_fs, kernel, threads);
    let r = r.map_err(|e| match abandon(raw) {
        Ok(()) => (e, true),
        Err(a) => (
            io::Error::other(format!(
                "{e}; and the kernel could not be told to use /dev/fuse instead ({a})"
            )),
            false,
        ),
    });
    (rings, r)
}

/// Can this process use `io_uring` with 128-byte entries at all (a seccomp profile or
/// `kernel.io_uring_disabled` may forbid it)? Asked before INIT takes `FUSE_OVER_IO_URING`,
/// since afterwards the kernel holds every request until the rings are registered.
pub fn usable() -> io::Result<()> {
    IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .build(2)
        .map(drop)
}

/// Make the kernel give `io_uring` up for this connection: a registration it refuses for
/// want of buffers (`EINVAL` from the register step, the one refusal that turns
/// `fc->io_uring` off) wakes the requests waiting for the rings. Any other answer (the
/// connection is gone, the parameter is off) is reported as a failure.
pub fn abandon(dev: RawFd) -> io::Result<()> {
    let mut ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(2)?;
    let e = command(dev, CMD_REGISTER, 0, 0, None);
    // SAFETY: the entry names no buffer.
    unsafe { ring.submission().push(&e) }.map_err(|_| io::Error::other("submission queue full"))?;
    ring.submit_and_wait(1)?;
    let r = ring.completion().next().map(|c| c.result());
    match r {
        Some(r) if r == -libc::EINVAL => Ok(()),
        Some(r) if r < 0 => Err(io::Error::from_raw_os_error(-r)),
        _ => Err(io::Error::other(
            "the kernel accepted an entry without buffers",
        )),
    }
}

/// Start the bridge and the workers; the workers that were started are in the returned
/// [`Rings`] whatever happened (a failed start may leave some registered, serving).
fn start_rings(
    dev: OwnedFd,
    ring_fs: Adapter,
    bridge_fs: Adapter,
    kernel: (u64, u32, u32),
    threads: usize,
) -> (Option<Rings>, io::Result<String>) {
    let layout = match Layout::of_this_machine(threads) {
        Ok(l) => l,
        Err(e) => return (None, Err(e)),
    };
    raise_fd_limit();
    let bridge = match Bridge::start(bridge_fs, kernel) {
        Ok(b) => b,
        Err(e) => return (None, Err(e)),
    };
    let jobs: Jobs = Arc::new(Mutex::new(Some(Offload::named("cetra-uring-h", 0))));
    let ctx = Arc::new(Ctx {
        dev,
        fs: ring_fs,
        bridge,
        helpers: Helpers {
            jobs: Arc::clone(&jobs),
        },
    });
    let (ended_tx, ended) = mpsc::channel();
    let (reg_tx, reg_rx) = mpsc::channel();
    let mut started = 0;
    let mut failed = None;
    for (name, plan) in layout.workers() {
        let (ctx, reg, ended) = (Arc::clone(&ctx), reg_tx.clone(), ended_tx.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("cetra-uring-{name}"))
            .spawn(move || {
                worker(&ctx, &plan, &reg);
                let _ = ended.send(());
            });
        if let Err(e) = spawned {
            failed = Some(e);
            break;
        }
        started += 1;
    }
    drop(reg_tx);
    for _ in 0..started {
        match reg_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                failed.get_or_insert(e);
            }
            Err(_) => {
                failed.get_or_insert(io::Error::other(
                    "an io_uring worker ended before registering",
                ));
            }
        }
    }
    let rings = Rings {
        ended: Mutex::new(ended),
        workers: started,
        jobs,
    };
    if let Some(e) = failed {
        return (Some(rings), Err(e));
    }
    let what = format!(
        "FUSE over io_uring: {layout}, {} KiB payload each, helpers started as requests wait; \
         FORGET/INTERRUPT and requests before registration on /dev/fuse",
        PAYLOAD_LEN >> 10
    );
    (Some(rings), Ok(what))
}

/// Which worker registers which entries on which queue. The kernel has one queue per
/// possible CPU and uses none before every queue has an entry; a request goes to the queue
/// of the CPU its caller runs on. So the queues of the CPUs online now get
/// [`WORKERS_PER_QUEUE`] workers and `threads` + [`WAITING_ROOM`] entries each (a VM's I/O
/// thread at queue depth 32 needs 32 entries on one queue, however many requests of other
/// processes on its CPU wait for the cluster), and the queues of CPUs that are not (possible but
/// offline: hot-pluggable, or a firmware table listing more than the machine has) share one
/// spare worker with one entry each, so that threads, descriptors and buffers grow with the
/// CPUs that run, not with the ones that might.
#[derive(Debug, PartialEq, Eq)]
struct Layout {
    /// Queue ids of online CPUs.
    busy: Vec<u16>,
    /// Queue ids of the other possible CPUs.
    spare: Vec<u16>,
    workers: usize,
    entries: usize,
}

impl Layout {
    fn of_this_machine(threads: usize) -> io::Result<Self> {
        let possible = read_cpus("possible")?;
        // If the online list cannot be read, every possible CPU counts as online.
        let online = read_cpus("online").unwrap_or_else(|_| possible.clone());
        Self::new(&possible, &online, threads.saturating_add(WAITING_ROOM))
    }

    /// `per_queue` entries on each queue of an online CPU.
    fn new(possible: &[usize], online: &[usize], per_queue: usize) -> io::Result<Self> {
        // The kernel's queue ids are 0..num_possible_cpus().
        let queues = possible.len();
        if queues == 0 {
            return Err(io::Error::other("no possible CPUs listed"));
        }
        let qid = |q: usize| u16::try_from(q).map_err(|_| io::Error::other("too many CPUs"));
        let (mut busy, mut spare) = (Vec::new(), Vec::new());
        for q in 0..queues {
            if online.contains(&q) {
                busy.push(qid(q)?);
            } else {
                spare.push(qid(q)?);
            }
        }
        if busy.is_empty() {
            // Not a list this kernel would give: serve every queue in full.
            busy = std::mem::take(&mut spare);
        }
        let per_queue = per_queue.max(1);
        let workers = WORKERS_PER_QUEUE.min(per_queue);
        Ok(Self {
            busy,
            spare,
            workers,
            entries: per_queue.div_ceil(workers),
        })
    }

    /// Each worker's name and the queue of each of its entries.
    fn workers(&self) -> Vec<(String, Vec<u16>)> {
        let mut out = Vec::new();
        for &q in &self.busy {
            for t in 0..self.workers {
                out.push((format!("{q}.{t}"), vec![q; self.entries]));
            }
        }
        if !self.spare.is_empty() {
            out.push(("spare".to_owned(), self.spare.clone()));
        }
        out
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} queues x {} workers x {} entries",
            self.busy.len(),
            self.workers,
            self.entries
        )?;
        if !self.spare.is_empty() {
            write!(
                f,
                " (+ {} queues of offline CPUs: one spare worker, one entry each)",
                self.spare.len()
            )?;
        }
        Ok(())
    }
}

/// A CPU list of /sys/devices/system/cpu (`possible`, `online`: "0-3", "0,2-5").
fn read_cpus(which: &str) -> io::Result<Vec<usize>> {
    let s = std::fs::read_to_string(format!("/sys/devices/system/cpu/{which}"))?;
    cpu_list(&s).ok_or_else(|| io::Error::other(format!("cannot read {which} CPUs from {s:?}")))
}

fn cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
        if b < a || b - a > 1 << 16 {
            return None;
        }
        out.extend(a..=b);
    }
    Some(out)
}

/// Every worker holds a ring and an eventfd, and each thread that batches device I/O a ring
/// of its own: on a machine with many CPUs that passes the usual soft limit of 1,024
/// descriptors. Take the hard limit (what the administrator allows).
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut lim) } != 0
        || lim.rlim_cur >= lim.rlim_max
    {
        return;
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: reads the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim) } != 0 {
        warn!(
            "could not raise the descriptor limit to {}: {}",
            lim.rlim_max,
            io::Error::last_os_error()
        );
    }
}

/// What every worker shares.
struct Ctx {
    dev: OwnedFd,
    fs: Adapter,
    bridge: Arc<Bridge>,
    helpers: Helpers,
}

/// A `FUSE_IO_URING_CMD_*` command: `fuse_uring_cmd_req` (flags, commit id, queue id) in the
/// SQE's command area; a registration also names the entry's two buffers (`iov`).
fn command(dev: RawFd, op: u32, commit_id: u64, qid: u16, iov: Option<u64>) -> squeue::Entry128 {
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_le_bytes());
    cmd[16..18].copy_from_slice(&qid.to_le_bytes());
    let mut b = opcode::UringCmd80::new(types::Fd(dev), op).cmd(cmd);
    if let Some(addr) = iov {
        b = b.addr(Some(addr));
    }
    let mut e = b.build();
    if iov.is_some() {
        // SAFETY: Entry128 is #[repr(C)] with the 64-byte `io_uring_sqe` first, whose `len`
        // (u32, the iovec count the kernel requires to be 2) is at byte 24; the crate has no
        // setter for it on this opcode. The write stays inside the entry.
        unsafe {
            std::ptr::from_mut(&mut e)
                .cast::<u8>()
                .add(24)
                .cast::<u32>()
                .write_unaligned(2);
        }
    }
    e
}

/// One entry's buffers, which the kernel reads and writes in place. Leaked: the kernel keeps
/// their addresses until the rings are torn down.
#[repr(C)]
struct Entry {
    header: Header,
    /// Page-aligned, so an aligned READ is read from the device straight into it.
    payload: &'static mut [u8],
    iov: [libc::iovec; 2],
    /// The queue it is registered on.
    qid: u16,
}

/// `n` payload buffers of `PAYLOAD_LEN` bytes each, from one anonymous mapping (one
/// mapping per worker, not per entry: a machine has a queue per CPU, each with
/// `threads` + [`WAITING_ROOM`] entries, and a process may have only so many mappings),
/// page-aligned (so an aligned READ is read from the device straight into one), resident
/// only as far as requests have touched them (a 4 KiB request touches 4 KiB). Never freed.
/// None if the memory cannot be mapped.
fn payloads(n: usize) -> Option<Vec<&'static mut [u8]>> {
    let len = n.checked_mul(PAYLOAD_LEN)?;
    if len == 0 {
        return Some(Vec::new());
    }
    // SAFETY: a new private anonymous mapping; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: the mapping is `len` bytes, zeroed, and never unmapped; this is its only
    // reference.
    let all = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) };
    Some(all.chunks_exact_mut(PAYLOAD_LEN).collect())
}

/// An entry handed from its worker to a helper and back. The entry is used by one thread
/// at a time: its worker, or the helper it gave the entry to until the helper hands it back
/// ([`Back::done`]); the kernel only between a commit and the request that completes it.
struct EntryPtr(*mut Entry);

// SAFETY: see the type's doc: one thread at a time, handed over through a channel or a mutex.
unsafe impl Send for EntryPtr {}

/// Where helpers hand answered entries back to their worker: the entry indexes, then a
/// count on the eventfd the worker's ring has a read pending on.
struct Back {
    done: Mutex<Vec<usize>>,
    efd: OwnedFd,
}

impl Back {
    fn new() -> io::Result<Self> {
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor owned by nothing else.
        let efd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self {
            done: Mutex::new(Vec::new()),
            efd,
        })
    }

    fn hand_back(&self, idx: usize) {
        match self.done.lock() {
            Ok(mut d) => d.push(idx),
            Err(_) => return,
        }
        let one = 1u64;
        // SAFETY: writes the 8 bytes of `one` to the eventfd.
        let _ = unsafe { libc::write(self.efd.as_raw_fd(), (&raw const one).cast(), 8) };
    }
}

/// A request the worker does not answer itself (one that may wait), for a helper.
struct Job {
    entry: EntryPtr,
    idx: usize,
    back: Arc<Back>,
}

/// The helpers' pool; `None` once closed (at the session's end: [`Rings::stop`]).
type Jobs = Arc<Mutex<Option<Offload>>>;

/// The helpers: threads that answer, each one request at a time as the old one-entry workers
/// did, the requests that may wait (everything off the data path, through the bridge; a READ
/// or WRITE whose admission must wait for the cluster, an allocating or appending write, a
/// sync write), so that a worker never stops taking fast requests while one waits. They are
/// change threads (offload.rs), started as requests wait: a fixed number of them (32, once)
/// was used up by as many changes waiting for a dead node's global lock, and then every
/// other request off the fast path waited for the recovery too.
struct Helpers {
    jobs: Jobs,
}

impl Helpers {
    /// Give the entry to a helper; false if none will take it (closed).
    fn take(&self, ctx: &Arc<Ctx>, job: Job) -> bool {
        // Out of the mutex before the hand-over: every worker passes here.
        let Some(pool) = self.jobs.lock().ok().and_then(|j| j.clone()) else {
            return false;
        };
        let ctx = Arc::clone(ctx);
        pool.hand_over(move || {
            // The whole job moves here (a closure would otherwise capture only the raw
            // pointer inside EntryPtr, which is not Send on its own).
            let job = job;
            // SAFETY: the worker handed this entry over (EntryPtr's rule).
            let e = unsafe { &mut *job.entry.0 };
            answer(&ctx, &mut e.header.0, e.payload);
            job.back.hand_back(job.idx);
        });
        true
    }
}

/// `user_data` of the eventfd read in a worker's ring (entries use their index).
const EVENT: u64 = u64::MAX;

/// One worker: register an entry on queue `plan[i]` for each `i`, report, then answer
/// requests until the connection ends. Requests are taken as they come, all that completed
/// at once: their READs and WRITEs that can be answered without waiting go to the volume as
/// one batch each (`Volume::read_batch`/`write_batch`: their device I/O in flight together,
/// one system call), the rest to the helpers; the READs' answers are committed before the
/// WRITEs' device I/O starts, the rest with the next wait.
fn worker(ctx: &Arc<Ctx>, plan: &[u16], registered: &mpsc::Sender<io::Result<()>>) {
    let entries = plan.len();
    let name = match (plan.first(), plan.last()) {
        (Some(a), Some(b)) if a == b => format!("io_uring queue {a}"),
        _ => format!("io_uring spare worker ({entries} queues)"),
    };
    let depth = u32::try_from((entries + 2).next_power_of_two()).unwrap_or(1024);
    // Only this thread submits, and it collects completions only when it waits: the kernel
    // then runs their task work at that wait, not by interrupting the thread (kernels before
    // 6.1 do not know this; then the plain ring).
    let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(depth)
        .or_else(|_| IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(depth));
    let back = Back::new().map(Arc::new);
    let (mut ring, back) = match (ring, back) {
        (Ok(r), Ok(b)) => (r, b),
        (Err(e), _) | (_, Err(e)) => {
            let _ = registered.send(Err(io::Error::other(format!(
                "io_uring with 128-byte entries: {e}"
            ))));
            return;
        }
    };
    let ents: Vec<EntryPtr> = payloads(entries)
        .unwrap_or_default()
        .into_iter()
        .zip(plan)
        .map(|(payload, &qid)| {
            let e: &'static mut Entry = Box::leak(Box::new(Entry {
                header: Header([0; HEADER_LEN]),
                payload,
                iov: [libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                }; 2],
                qid,
            }));
            e.iov = [
                libc::iovec {
                    iov_base: e.header.0.as_mut_ptr().cast(),
                    iov_len: HEADER_LEN,
                },
                libc::iovec {
                    iov_base: e.payload.as_mut_ptr().cast(),
                    iov_len: PAYLOAD_LEN,
                },
            ];
            EntryPtr(e)
        })
        .collect();
    if ents.len() != entries {
        let _ = registered.send(Err(io::Error::other(format!(
            "{name}: no memory for {entries} payload buffers: {}",
            io::Error::last_os_error()
        ))));
        return;
    }
    // Never freed: the kernel may write it after this worker ended (the pending read).
    let counter: &'static mut u64 = Box::leak(Box::new(0));
    let counter: *mut u64 = counter;
    let dev = ctx.dev.as_raw_fd();
    let arm = |ring: &mut IoUring<squeue::Entry128, cqueue::Entry>| {
        let e = opcode::Read::new(types::Fd(back.efd.as_raw_fd()), counter.cast(), 8)
            .build()
            .user_data(EVENT)
            .into();
        // SAFETY: `counter` is leaked, so it outlives the read.
        unsafe { ring.submission().push(&e) }.is_ok()
    };
    let mut pushed = arm(&mut ring);
    for (i, e) in ents.iter().enumerate() {
        // SAFETY: the entry is leaked; only this thread uses it now.
        let (iov, qid) = unsafe { ((*e.0).iov.as_ptr() as u64, (*e.0).qid) };
        let reg = command(dev, CMD_REGISTER, 0, qid, Some(iov)).user_data(i as u64);
        // SAFETY: the entry names `iov` and, through it, the entry's leaked buffers.
        pushed &= unsafe { ring.submission().push(&reg) }.is_ok();
    }
    let submitted = if pushed {
        ring.submit().map(|_| ())
    } else {
        Err(io::Error::other("submission queue full"))
    };
    if let Err(e) = submitted {
        // Nothing registered (or the ring cannot say what was): nothing to serve.
        let _ = registered.send(Err(io::Error::other(format!("{name}: {e}"))));
        return;
    }
    let mut serve = Serve {
        ctx,
        ents: &ents,
        back: &back,
        live: entries,
        away: 0,
        reads: Vec::with_capacity(entries),
        writes: Vec::with_capacity(entries),
        commits: Vec::with_capacity(entries),
    };
    // A refusal completes at once (so may a request, once the other queues are complete):
    // an entry the kernel refused is not live; the ones it took are served even so (they
    // may be handed requests), and the failure is reported.
    let mut ready: Vec<(u64, i32)> = ring
        .completion()
        .map(|c| (c.user_data(), c.result()))
        .collect();
    let refusal = ready
        .iter()
        .find(|(u, r)| *u != EVENT && *r < 0)
        .map(|(_, r)| -r);
    let before = ready.len();
    ready.retain(|(u, r)| *u == EVENT || *r >= 0);
    let refused = before - ready.len();
    serve.live -= refused;
    let _ = registered.send(match refusal {
        Some(e) => Err(io::Error::other(format!(
            "{name}: {refused} of {entries} entries refused: {}",
            io::Error::from_raw_os_error(e)
        ))),
        None => Ok(()),
    });
    if serve.live == 0 {
        return;
    }
    let commit = |ring: &mut IoUring<squeue::Entry128, cqueue::Entry>, serve: &mut Serve| {
        for (idx, commit) in serve.commits.drain(..) {
            // SAFETY: answered: this worker's until the commit below.
            let qid = unsafe { (*ents[idx].0).qid };
            let next = command(dev, CMD_COMMIT_AND_FETCH, commit, qid, None).user_data(idx as u64);
            // SAFETY: the entry's buffers were registered with the leaked ones above.
            if unsafe { ring.submission().push(&next) }.is_err() {
                return false;
            }
        }
        true
    };
    let stopped = loop {
        if ready.is_empty() {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if transient(&e) => continue,
                Err(e) => break e,
            }
            ready.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        }
        let rearm = serve.take(&mut ready);
        if rearm && !arm(&mut ring) {
            break io::Error::other("submission queue full");
        }
        serve.batch_reads();
        if !serve.writes.is_empty() && !serve.commits.is_empty() {
            // The READs' answers go now, not after the WRITEs' device I/O.
            if !commit(&mut ring, &mut serve) {
                break io::Error::other("submission queue full");
            }
            match ring.submit() {
                Err(e) if !transient(&e) => break e,
                _ => {}
            }
        }
        serve.batch_writes();
        if !commit(&mut ring, &mut serve) {
            break io::Error::other("submission queue full");
        }
        if serve.live == 0 && serve.away == 0 {
            debug!("{name}: connection ended");
            return;
        }
    };
    error!("{name}: {stopped}; this worker stops");
    serve.wait_helpers();
}

/// An `io_uring_enter` failure to try again (a signal, short of memory for a moment):
/// entries are in flight, so stopping on it would strand them.
fn transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
    )
}

/// A worker's state between waits.
struct Serve<'a> {
    ctx: &'a Arc<Ctx>,
    ents: &'a [EntryPtr],
    back: &'a Arc<Back>,
    /// Entries whose command the kernel has not ended.
    live: usize,
    /// Entries with a helper.
    away: usize,
    reads: Vec<usize>,
    writes: Vec<usize>,
    /// Answered entries to commit: (index, commit id).
    commits: Vec<(usize, u64)>,
}

impl Serve<'_> {
    /// The entry at `idx`. SAFETY (callers): the entry is this worker's now (not with a
    /// helper, not committed), and no other reference to it lives.
    #[expect(
        clippy::mut_from_ref,
        reason = "the entries are the kernel's and ours by turns"
    )]
    unsafe fn entry(&self, idx: usize) -> &mut Entry {
        // SAFETY: the caller's contract; the pointer is a leaked entry.
        unsafe { &mut *self.ents[idx].0 }
    }

    /// Take the completions in `ready` (emptied): queue the commits of what helpers handed
    /// back, sort READs and WRITEs out for the batches, hand the rest to helpers. Returns
    /// whether the eventfd read completed (to be armed again).
    fn take(&mut self, ready: &mut Vec<(u64, i32)>) -> bool {
        let mut rearm = false;
        for (ud, r) in ready.drain(..) {
            if ud == EVENT {
                rearm = true;
                self.handed_back();
                continue;
            }
            let Some(idx) = usize::try_from(ud).ok().filter(|i| *i < self.ents.len()) else {
                continue;
            };
            if r < 0 {
                match -r {
                    libc::ENOTCONN | libc::ECANCELED | libc::ENODEV | libc::ECONNABORTED => {}
                    e => warn!(
                        "io_uring queue {}: {}; one entry stops",
                        // SAFETY: its command ended: this worker's.
                        unsafe { self.entry(idx) }.qid,
                        io::Error::from_raw_os_error(e)
                    ),
                }
                self.live -= 1;
                continue;
            }
            // SAFETY: the kernel completed the entry's command: it is this worker's.
            let h = &unsafe { self.entry(idx) }.header.0;
            match u32_at(h, 4) {
                FUSE_READ => self.reads.push(idx),
                FUSE_WRITE => self.writes.push(idx),
                FUSE_DESTROY => self.answered(idx, Ok(0)),
                _ => self.away(idx),
            }
        }
        rearm
    }

    /// Queue the commits of the entries helpers handed back.
    fn handed_back(&mut self) {
        let done = self
            .back
            .done
            .lock()
            .map(|mut d| std::mem::take(&mut *d))
            .unwrap_or_default();
        for idx in done {
            self.away -= 1;
            // SAFETY: the helper handed it back.
            let commit = commit_id(&unsafe { self.entry(idx) }.header.0);
            self.commits.push((idx, commit));
        }
    }

    /// A worker whose ring failed waits until the helpers are done with its entries (their
    /// buffers are then no one's; the kernel ends their commands with the connection).
    fn wait_helpers(&mut self) {
        while self.away > 0 {
            std::thread::sleep(Duration::from_millis(10));
            self.handed_back();
            self.commits.clear();
        }
    }

    /// Entry `idx` (this worker's) is answered with `r`: write the answer's header and queue
    /// its commit.
    fn answered(&mut self, idx: usize, r: Result<usize, i32>) {
        // SAFETY: this worker's; no other reference to it lives (callers' borrows ended).
        let h = &mut unsafe { self.entry(idx) }.header.0;
        let commit = commit_id(h);
        reply(h, r);
        self.commits.push((idx, commit));
    }

    /// Hand entry `idx` to a helper (answered EIO if none is left).
    fn away(&mut self, idx: usize) {
        let job = Job {
            entry: EntryPtr(self.ents[idx].0),
            idx,
            back: Arc::clone(self.back),
        };
        if self.ctx.helpers.take(self.ctx, job) {
            self.away += 1;
        } else {
            self.answered(idx, Err(libc::EIO));
        }
    }

    fn batch_reads(&mut self) {
        if self.reads.is_empty() {
            return;
        }
        let idxs = std::mem::take(&mut self.reads);
        let mut batch = Vec::with_capacity(idxs.len());
        for &idx in &idxs {
            // SAFETY: this worker's; each index once, so the references do not alias.
            let e = unsafe { self.entry(idx) };
            let op = &e.header.0[OP_IN..OP_IN + RW_IN];
            let size = (u32_at(op, 16) as usize).min(e.payload.len());
            batch.push(BatchRead {
                // SAFETY: the kernel sends READ only with an fh from our open/create that is
                // not yet released (adapter::open_file's contract).
                fh: unsafe { adapter::open_file(u64_at(op, 0)) },
                offset: u64_at(op, 8),
                dst: &mut e.payload[..size],
                done: None,
            });
        }
        self.ctx.fs.read_batch(&mut batch);
        let done: Vec<Option<Result<usize, i32>>> = batch
            .into_iter()
            .map(|b| b.done.map(|r| r.map_err(|e| adapter::errno(&e).code())))
            .collect();
        for (idx, d) in idxs.into_iter().zip(done) {
            match d {
                Some(r) => self.answered(idx, r),
                None => self.away(idx),
            }
        }
    }

    fn batch_writes(&mut self) {
        if self.writes.is_empty() {
            return;
        }
        let idxs = std::mem::take(&mut self.writes);
        let mut creds = Vec::with_capacity(idxs.len());
        let mut mine = Vec::with_capacity(idxs.len());
        for &idx in &idxs {
            // SAFETY: this worker's.
            let h = &unsafe { self.entry(idx) }.header.0;
            let op = &h[OP_IN..OP_IN + RW_IN];
            // The open file's flags, as an int (`fuse_write_in.flags`).
            let flags = i32::from_le_bytes(u32_at(op, 32).to_le_bytes());
            let how = WriteHow::new(flags, u32_at(op, 20));
            if how.batchable() {
                creds.push(creds_of(h).with_fsetid(!how.kill_suid()));
                mine.push(idx);
            } else {
                self.away(idx);
            }
        }
        let mut batch = Vec::with_capacity(mine.len());
        for (&idx, who) in mine.iter().zip(&creds) {
            // SAFETY: this worker's; each index once.
            let e = unsafe { self.entry(idx) };
            let op = &e.header.0[OP_IN..OP_IN + RW_IN];
            let in_payload = (u32_at(&e.header.0, ENT_IN_OUT + 16) as usize).min(e.payload.len());
            let size = (u32_at(op, 16) as usize).min(in_payload);
            batch.push(BatchWrite {
                // SAFETY: as for READ.
                fh: unsafe { adapter::open_file(u64_at(op, 0)) },
                offset: u64_at(op, 8),
                data: &e.payload[..size],
                who,
                done: None,
            });
        }
        self.ctx.fs.write_batch(&mut batch);
        let done: Vec<Option<Result<u32, i32>>> = batch
            .into_iter()
            .map(|b| b.done.map(|r| r.map_err(|e| adapter::errno(&e).code())))
            .collect();
        for (idx, d) in mine.into_iter().zip(done) {
            match d {
                Some(r) => {
                    // SAFETY: this worker's; the batch's references are gone.
                    let r = r.map(|n| write_out(unsafe { self.entry(idx) }.payload, n));
                    self.answered(idx, r);
                }
                None => self.away(idx),
            }
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

fn put(b: &mut [u8], at: usize, v: &[u8]) {
    if let Some(d) = b.get_mut(at..at + v.len()) {
        d.copy_from_slice(v);
    }
}

/// The commit id of the request in an entry's header.
fn commit_id(h: &[u8; HEADER_LEN]) -> u64 {
    u64_at(h, ENT_IN_OUT + 8)
}

/// The caller of the request in an entry's header (`fuse_in_header`: uid, gid, pid).
fn creds_of(h: &[u8; HEADER_LEN]) -> RequestCreds {
    RequestCreds::new(u32_at(h, 32), u32_at(h, 24), u32_at(h, 28))
}

/// `fuse_write_out {size, padding}` into the payload; its length.
fn write_out(payload: &mut [u8], n: u32) -> usize {
    put(payload, 0, &n.to_le_bytes());
    put(payload, 4, &[0; 4]);
    8
}

/// Write the answer into the entry's header: `fuse_out_header` (length, error; the request's
/// `unique` is already in place: in and out headers share its offset) and the payload size.
fn reply(h: &mut [u8; HEADER_LEN], r: Result<usize, i32>) {
    let (error, body) = match r {
        Ok(n) => (0, n),
        Err(e) => (-e, 0),
    };
    let out_len = u32::try_from(OUT_HEADER + body).unwrap_or(u32::MAX);
    put(h, 0, &out_len.to_le_bytes());
    put(h, 4, &error.to_le_bytes());
    put(
        h,
        ENT_IN_OUT + 16,
        &u32::try_from(body).unwrap_or(0).to_le_bytes(),
    );
}

/// Answer the request in the entry's buffers, waiting as long as it takes (a helper): the
/// answer's payload into `payload`, its `fuse_out_header` and payload size into `h`.
fn answer(ctx: &Ctx, h: &mut [u8; HEADER_LEN], payload: &mut [u8]) {
    let len = u32_at(h, 0) as usize;
    let opcode = u32_at(h, 4);
    let in_payload = (u32_at(h, ENT_IN_OUT + 16) as usize).min(payload.len());
    let op = &h[OP_IN..OP_IN + RW_IN];
    let r = match opcode {
        FUSE_READ => {
            let size = u32_at(op, 16).min(u32::try_from(payload.len()).unwrap_or(u32::MAX));
            // SAFETY: the kernel sends READ only with an fh from our open/create that is not
            // yet released (adapter::open_file's contract).
            let of = unsafe { adapter::open_file(u64_at(op, 0)) };
            ctx.fs
                .read_into(of, u64_at(op, 8), &mut payload[..size as usize])
                .map_err(fuser::Errno::code)
        }
        FUSE_WRITE => {
            let size = (u32_at(op, 16) as usize).min(in_payload);
            // The open file's flags, as an int (`fuse_write_in.flags`).
            let flags = i32::from_le_bytes(u32_at(op, 32).to_le_bytes());
            let how = WriteHow::new(flags, u32_at(op, 20));
            let creds = creds_of(h).with_fsetid(!how.kill_suid());
            // SAFETY: as for READ.
            let of = unsafe { adapter::open_file(u64_at(op, 0)) };
            ctx.fs
                .write_waiting(&creds, of, u64_at(op, 8), &payload[..size], how)
                .map(|n| write_out(payload, n))
                .map_err(fuser::Errno::code)
        }
        FUSE_DESTROY => Ok(0),
        _ => {
            if let Some(op_len) = len
                .checked_sub(IN_HEADER + in_payload)
                .filter(|n| *n <= OP_IN)
            {
                ctx.bridge.forward(h, op_len, payload, in_payload)
            } else {
                error!("io_uring request {opcode}: length {len} does not add up; answered EIO");
                Err(libc::EIO)
            }
        }
    };
    reply(h, r);
}

/// The fuser session that answers the rings' requests off the data path.
struct Bridge {
    sock: OwnedFd,
    waiting: Mutex<HashMap<u64, mpsc::SyncSender<Vec<u8>>>>,
    /// The answer reader has stopped: nothing forwarded would be answered.
    closed: AtomicBool,
}

impl Bridge {
    fn start(fs: Adapter, kernel: (u64, u32, u32)) -> io::Result<Arc<Self>> {
        let mut fds = [0; 2];
        // SAFETY: socketpair writes two descriptors into `fds`, which are owned below.
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both are fresh descriptors from socketpair, owned by nothing else.
        let (ours, theirs) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        for fd in [&ours, &theirs] {
            for (force, plain) in [
                (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
                (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
            ] {
                // Without CAP_NET_ADMIN only up to the system's maximum (an answer bigger
                // than the buffer fails in the bridge session and its request gets EIO).
                if set_int(fd, force, BRIDGE_SOCKET_BUFFER).is_err() {
                    if let Err(e) = set_int(fd, plain, BRIDGE_SOCKET_BUFFER) {
                        warn!("io_uring bridge: socket buffer: {e}");
                    }
                }
            }
        }
        // The bridge session's INIT: what the kernel offered the real one, so the adapter
        // settles the same (ACLs); its answer is dropped by the reader.
        let (caps, major, minor) = kernel;
        let mut init = Vec::with_capacity(IN_HEADER + INIT_IN);
        init.extend_from_slice(
            &u32::try_from(IN_HEADER + INIT_IN)
                .unwrap_or(0)
                .to_le_bytes(),
        );
        init.extend_from_slice(&FUSE_INIT.to_le_bytes());
        init.extend_from_slice(&1u64.to_le_bytes()); // unique (odd: never a kernel request's)
        init.resize(IN_HEADER, 0);
        init.extend_from_slice(&major.to_le_bytes());
        init.extend_from_slice(&minor.to_le_bytes());
        init.extend_from_slice(&(128u32 << 10).to_le_bytes()); // max_readahead
        let ext = 1u64 << 30; // FUSE_INIT_EXT: flags2 holds the high half
        let flags = caps | ext;
        init.extend_from_slice(
            &u32::try_from(flags & 0xffff_ffff)
                .unwrap_or(0)
                .to_le_bytes(),
        );
        init.extend_from_slice(&u32::try_from(flags >> 32).unwrap_or(0).to_le_bytes());
        init.resize(IN_HEADER + INIT_IN, 0);
        send(&ours, &init)?;
        let mut cfg = fuser::Config::default();
        cfg.n_threads = Some(BRIDGE_THREADS);
        cfg.clone_fd = false;
        cfg.acl = fuser::SessionACL::All;
        let session = fuser::Session::from_fd(fs, theirs, fuser::SessionACL::All, cfg)?;
        std::thread::Builder::new()
            .name("cetra-bridge".into())
            .spawn(move || {
                if let Err(e) = session.run() {
                    debug!("io_uring bridge session ended: {e}");
                }
            })?;
        let bridge = Arc::new(Self {
            sock: ours,
            waiting: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
        });
        let reader = Arc::clone(&bridge);
        std::thread::Builder::new()
            .name("cetra-bridge-rd".into())
            .spawn(move || reader.read_answers())?;
        Ok(bridge)
    }

    /// Hand answers to the workers waiting for them, by request id.
    fn read_answers(&self) {
        let mut buf = vec![0u8; PAYLOAD_LEN + 4096];
        loop {
            // SAFETY: recv writes at most buf.len() bytes into buf.
            let n =
                unsafe { libc::recv(self.sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            let Ok(n) = usize::try_from(n) else {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                error!("io_uring bridge: {e}; requests off the data path will fail");
                break;
            };
            if n == 0 {
                break;
            }
            let unique = u64_at(&buf, 8);
            let waiter = self.waiting.lock().ok().and_then(|mut w| w.remove(&unique));
            if let Some(w) = waiter {
                let _ = w.send(buf[..n].to_vec());
            }
        }
        // Wake every worker still waiting (they answer EIO), and refuse later requests.
        self.closed.store(true, Ordering::Release);
        if let Ok(mut w) = self.waiting.lock() {
            w.clear();
        }
    }

    /// Have the bridge session answer the request in the entry (header `h` with `op_len`
    /// bytes of operation header, `in_payload` bytes of payload); its answer's payload goes
    /// into `payload`. Returns the payload's length or the errno.
    fn forward(
        &self,
        h: &[u8; HEADER_LEN],
        op_len: usize,
        payload: &mut [u8],
        in_payload: usize,
    ) -> Result<usize, i32> {
        let unique = u64_at(h, 8);
        let mut msg = Vec::with_capacity(IN_HEADER + op_len + in_payload);
        msg.extend_from_slice(&h[..IN_HEADER]);
        msg.extend_from_slice(&h[OP_IN..OP_IN + op_len]);
        msg.extend_from_slice(&payload[..in_payload]);
        let (tx, rx) = mpsc::sync_channel(1);
        self.waiting
            .lock()
            .map_err(|_| libc::EIO)?
            .insert(unique, tx);
        // After the insert: a reader that stopped since has dropped `tx` or set `closed`.
        if self.closed.load(Ordering::Acquire) {
            if let Ok(mut w) = self.waiting.lock() {
                w.remove(&unique);
            }
            return Err(libc::EIO);
        }
        if let Err(e) = send(&self.sock, &msg) {
            error!("io_uring bridge: {e}");
            if let Ok(mut w) = self.waiting.lock() {
                w.remove(&unique);
            }
            return Err(libc::EIO);
        }
        let answer = rx.recv().map_err(|_| libc::EIO)?;
        let error = i32::from_le_bytes(u32_at(&answer, 4).to_le_bytes());
        if error != 0 {
            return Err(-error);
        }
        let body = answer.get(OUT_HEADER..).unwrap_or(&[]);
        let n = body.len().min(payload.len());
        payload[..n].copy_from_slice(&body[..n]);
        Ok(n)
    }
}

/// `setsockopt(SOL_SOCKET, opt, v)`.
fn set_int(fd: &OwnedFd, opt: libc::c_int, v: libc::c_int) -> io::Result<()> {
    // SAFETY: setsockopt reads one c_int from `v`.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&raw const v).cast(),
            libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).unwrap_or(4),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// One message on the bridge socket.
fn send(sock: &OwnedFd, msg: &[u8]) -> io::Result<()> {
    loop {
        // SAFETY: send reads msg.len() bytes from msg.
        let n = unsafe { libc::send(sock.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_command_names_two_buffers_and_the_queue() {
        let e = command(7, CMD_REGISTER, 0, 3, Some(0x1000));
        // SAFETY: Entry128 is 128 plain bytes (#[repr(C)]).
        let raw: [u8; 128] = unsafe { std::mem::transmute(e) };
        assert_eq!(raw[0], 46, "IORING_OP_URING_CMD");
        assert_eq!(u32_at(&raw, 4), 7, "fd");
        assert_eq!(u32_at(&raw, 8), CMD_REGISTER, "cmd_op");
        assert_eq!(u64_at(&raw, 16), 0x1000, "addr: the iovecs");
        assert_eq!(u32_at(&raw, 24), 2, "len: two iovecs");
        assert_eq!(u64_at(&raw, 48 + 8), 0, "commit_id");
        assert_eq!(u32_at(&raw, 48 + 16) & 0xffff, 3, "qid");
        let c = command(7, CMD_COMMIT_AND_FETCH, 0xabc0, 1, None);
        // SAFETY: as above.
        let raw: [u8; 128] = unsafe { std::mem::transmute(c) };
        assert_eq!(u32_at(&raw, 24), 0);
        assert_eq!(u64_at(&raw, 56), 0xabc0);
    }

    #[test]
    fn cpu_lists_read_like_the_kernel_writes_them() {
        assert_eq!(cpu_list("0-3\n"), Some(vec![0, 1, 2, 3]));
        assert_eq!(cpu_list("0,2-4"), Some(vec![0, 2, 3, 4]));
        assert_eq!(cpu_list("5"), Some(vec![5]));
        assert_eq!(cpu_list("\n"), Some(vec![]));
        for bad in ["3-1", "a", "0-", "-2", "0-99999999"] {
            assert_eq!(cpu_list(bad), None, "{bad}");
        }
        assert!(!read_cpus("possible").unwrap().is_empty());
    }

    #[test]
    fn offline_cpus_share_one_spare_worker() {
        let l = Layout::new(&[0, 1, 2, 3, 4, 5], &[0, 1], 32).unwrap();
        let w = l.workers();
        assert_eq!(w.len(), 2 * WORKERS_PER_QUEUE + 1);
        let on_queue = |q: u16| w.iter().flat_map(|(_, p)| p).filter(|x| **x == q).count();
        assert_eq!(on_queue(0), 32);
        assert_eq!(on_queue(1), 32);
        for q in 2..6 {
            assert_eq!(on_queue(q), 1, "queue {q}");
        }
        assert_eq!(w.last().unwrap(), &("spare".to_owned(), vec![2, 3, 4, 5]));
        // All online: no spare worker; one thread: one worker, one entry per queue.
        let l = Layout::new(&[0, 1], &[0, 1], 1).unwrap();
        assert_eq!(
            l.workers(),
            vec![("0.0".into(), vec![0]), ("1.0".into(), vec![1])]
        );
        // No online list that makes sense: every queue in full.
        let l = Layout::new(&[0, 1], &[7], 4).unwrap();
        assert_eq!(l.spare, Vec::<u16>::new());
        assert_eq!(l.busy, vec![0, 1]);
        assert!(Layout::new(&[], &[], 4).is_err());
    }
}
