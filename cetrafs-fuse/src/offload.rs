//! The **change threads**: where the adapter runs the requests that may wait for the cluster,
//! so that the FUSE workers never do.
//!
//! **Why.** The classic transport serves /dev/fuse with a fixed set of workers (32 by
//! default, `CETRA_FUSE_THREADS`), and they are also the node's data path: every `READ` and
//! `WRITE` of its VMs is answered by one of them. A metadata change waits for the global lock
//! (docs/locking.md §5), and while a dead node holds that lock it waits until the node is
//! recovered (the dead time: 42–85 s on a SAN). The kernel does not bound how many such
//! requests a node sends at once: one per process, with no directory lock in common when they
//! touch different files (a `chmod` or a `touch` of each of a container's files, processes
//! renaming or removing files in their own directories). Measured before this module, through
//! FUSE with a 5.2 s dead time: 40 processes on node1 each `chmod`ing its own file after node2
//! died holding the global lock took all 32 workers, and a 1 MiB `O_DIRECT` read of node1's
//! own image, which needs only its inode's lock, waited 3.9 s, until the recovery. A VM on a
//! survivor then freezes with the dead node's, which is what issue 9 forbids.
//!
//! **What runs here.** The adapter (`Adapter::may_wait`) passes every request that may wait
//! for the cluster — every change (creates, removals, renames, links, `setattr`, xattr
//! changes, `fallocate`, opens, `fsync`, `fsyncdir`, the ioctls) and every read of metadata
//! (lookups, attributes, `readlink`, listings, `statfs`, xattr reads, `SEEK_DATA`,
//! `SEEK_HOLE`): a read waits for a silent holder too when the core cannot check what it
//! needs against the object's own lock (`fs/own_lock_reads.rs`) — with what it needs (owned copies of its names, its reply). The
//! first [`INLINE_CHANGES`] (8; a quarter of the workers when there are fewer than 32) in
//! progress at once run on their own workers, as before: a hand-over to another thread cost
//! 10–20 % of the create/rename/unlink rate of `bench/cluster.sh` §3 on this 2-core machine,
//! and a node rarely has more such requests in progress at once when nothing stalls. Past
//! those, a change thread answers the request and the worker goes back to /dev/fuse at
//! once: a stall can hold 8 workers, never the 24 others. What stays on the workers whatever
//! happens is the data path (`READ`, `WRITE`: a fast-path request needs only its file's own
//! lock, and an allocating write is answered by the core's mapping thread), `RELEASE` (the
//! core never waits there for a silent holder: `fs/closer.rs`), `FORGET` and `FLUSH`. Left: an `O_SYNC`/`O_DSYNC` or appending write of a file this node does not own
//! waits for the global lock on its worker.
//!
//! The `io_uring` transport (uring.rs) answers its requests that may wait on a pool of its
//! own (`cetra-uring-h` threads, none inline: its workers must never wait) for the same
//! reason: it had 32 helpers, and as many waiting changes used them up. Such a pool never
//! runs a job on its caller, also when it is at [`MAX_THREADS`]: it queues it.
//!
//! **The pool.** A thread is started when a job comes and no thread is idle, up to
//! [`MAX_THREADS`]; past that the adapter's request runs on its worker (never refused, and
//! the bound keeps a runaway from exhausting the process). A thread that ends a job while
//! [`KEEP_IDLE`] others are idle ends too, and one idle for [`IDLE_EXIT`] ends, down to
//! none. Order between requests is the kernel's business: it already holds the VFS locks (a
//! directory's for changes in it, an inode's for its `setattr`) until each answer, so two
//! requests that must not overlap are never both here. **Cost**: none while at most 8 such
//! requests are in progress (`bench/cluster.sh` §3, create+rename+unlink, two runs each of
//! the old and the new daemon alternated: one node 7,289 vs 7,865 ops/s, three nodes in
//! private directories 10,507 vs 10,656, in one shared directory 6,475 vs 6,064: within this
//! machine's run-to-run noise); beyond, a hand-over (a queue push and a wake-up) per request.
//!
//! **End.** The session's `destroy` calls [`Offload::drain`] (bounded) before it unmounts the
//! volume. fuser calls `destroy` once its workers see the connection end, which after an
//! abort (`umount -f`, a killed connection) can be while changes still run; one that runs
//! past the bound meets an unmounted volume, which refuses it.

use cetrafs_core::sync::LockPolicy;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tracing::warn;

/// Most change threads at once (then a request runs on its FUSE worker).
pub const MAX_THREADS: usize = 1024;
/// A change thread idle this long ends.
pub const IDLE_EXIT: Duration = Duration::from_secs(10);
/// Idle threads kept past a job's end (the others end then).
const KEEP_IDLE: usize = 4;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Jobs the adapter's pool runs on the caller's thread (a FUSE worker) at once before it
/// hands them to its threads (module doc).
pub const INLINE_CHANGES: usize = 8;

/// The change threads (module doc). Cloning shares the pool.
#[derive(Debug, Clone)]
pub struct Offload {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    /// The threads' name.
    name: &'static str,
    /// Most jobs run on callers' threads at once.
    inline: usize,
    /// Jobs running on callers' threads now.
    inline_now: AtomicUsize,
    state: Mutex<State>,
    /// Jobs queued, or the pool draining.
    work: Condvar,
    /// A job ended (for [`Offload::drain`]).
    done: Condvar,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    /// Threads waiting for a job, and threads running one: every thread is one of the two.
    idle: usize,
    running: usize,
}

impl State {
    fn threads(&self) -> usize {
        self.idle + self.running
    }
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("jobs", &self.jobs.len())
            .field("idle", &self.idle)
            .field("running", &self.running)
            .finish()
    }
}

impl Offload {
    /// A pool whose threads are called `name`, running up to `inline` jobs at once on the
    /// callers' threads.
    pub fn named(name: &'static str, inline: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                name,
                inline,
                ..Shared::default()
            }),
        }
    }

    /// Run `job`: on the caller's thread if [`inline_slot`](Self::inline_slot) gives a
    /// slot, else on a pool thread ([`hand_over`](Self::hand_over)).
    #[cfg(test)]
    pub fn run(&self, job: impl FnOnce() + Send + 'static) {
        if let Some(_slot) = self.inline_slot() {
            job();
        } else {
            self.hand_over(job);
        }
    }

    /// A slot to run one job on the caller's thread, while fewer than the pool's `inline`
    /// jobs run on callers' threads; given back when dropped.
    pub fn inline_slot(&self) -> Option<InlineSlot<'_>> {
        let inline = &self.shared.inline_now;
        inline
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.shared.inline).then_some(n + 1)
            })
            .ok()
            .map(|_| InlineSlot(inline))
    }

    /// Run `job` on a pool thread, starting one if none is idle. When [`MAX_THREADS`] are
    /// busy, or a thread cannot be started: a pool whose callers may run jobs (`inline` >
    /// 0, the FUSE workers) runs it on the caller's thread; one whose callers must never
    /// wait (the `io_uring` workers) queues it for the threads it has (and runs it on the
    /// caller only if it has none).
    pub fn hand_over(&self, job: impl FnOnce() + Send + 'static) {
        let mut s = self.shared.state.lock().or_panic();
        // Idle threads not yet claimed by a queued job.
        let free = s.idle.saturating_sub(s.jobs.len());
        if free == 0 {
            let started = if s.threads() >= MAX_THREADS {
                Err(None)
            } else {
                let shared = Arc::clone(&self.shared);
                std::thread::Builder::new()
                    .name(self.shared.name.into())
                    .spawn(move || serve(&shared))
                    .map_err(Some)
            };
            match started {
                Ok(_) => s.idle += 1,
                Err(e) if self.shared.inline > 0 || s.threads() == 0 => {
                    drop(s);
                    if let Some(e) = e {
                        warn!(
                            "cannot start a {} thread ({e}); its caller runs the job",
                            self.shared.name
                        );
                    }
                    job();
                    return;
                }
                Err(_) => {} // queued for the threads there are
            }
        }
        s.jobs.push_back(Box::new(job));
        drop(s);
        self.shared.work.notify_one();
    }

    /// Wait until no change is queued or running, at most `limit`; false if one still is.
    pub fn drain(&self, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        let mut s = self.shared.state.lock().or_panic();
        while !s.jobs.is_empty() || s.running > 0 {
            let Some(left) = until.checked_duration_since(Instant::now()) else {
                return false;
            };
            s = self.shared.done.wait_timeout(s, left).or_panic().0;
        }
        true
    }

    /// Change threads now (started and not ended).
    #[cfg(test)]
    pub fn threads(&self) -> usize {
        self.shared.state.lock().or_panic().threads()
    }
}

/// One job running on a caller's thread (released at its end).
#[derive(Debug)]
pub struct InlineSlot<'a>(&'a AtomicUsize);

impl Drop for InlineSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A change thread: take jobs until idle for [`IDLE_EXIT`].
fn serve(shared: &Shared) {
    let mut s = shared.state.lock().or_panic();
    loop {
        if let Some(job) = s.jobs.pop_front() {
            s.idle -= 1;
            s.running += 1;
            drop(s);
            job();
            s = shared.state.lock().or_panic();
            s.running -= 1;
            shared.done.notify_all();
            // More idle threads than that end at once: which waiting thread a wake-up takes
            // is the kernel's choice, so a steady trickle of jobs could otherwise keep every
            // thread of a burst alive, each woken before its idle time runs out.
            if s.idle >= KEEP_IDLE && s.jobs.is_empty() {
                return;
            }
            s.idle += 1;
            continue;
        }
        let (next, timeout) = shared.work.wait_timeout(s, IDLE_EXIT).or_panic();
        s = next;
        if timeout.timed_out() && s.jobs.is_empty() {
            s.idle -= 1;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_waiting_job_does_not_hold_up_the_next() {
        let pool = Offload::named("test", 0);
        let (release, gate) = mpsc::channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        // Three jobs wait; a fourth must still run at once.
        for _ in 0..3 {
            let g = Arc::clone(&gate);
            pool.run(move || {
                let _ = g.lock().unwrap().recv();
            });
        }
        let (tx, rx) = mpsc::channel();
        pool.run(move || tx.send(()).unwrap());
        rx.recv_timeout(Duration::from_secs(5))
            .expect("the fourth job waited for the three blocked ones");
        assert!(pool.threads() >= 2, "{} threads", pool.threads());
        assert!(
            !pool.drain(Duration::from_millis(50)),
            "drain ignored blocked jobs"
        );
        for _ in 0..3 {
            release.send(()).unwrap();
        }
        assert!(pool.drain(Duration::from_secs(5)), "jobs still running");
    }

    #[test]
    fn jobs_beyond_the_inline_share_go_to_threads() {
        let pool = Offload::named("test", 2);
        let (release, gate) = mpsc::channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let here = std::thread::current().id();
        let (tx, rx) = mpsc::channel();
        // Two jobs run on callers' threads (each its own, as FUSE workers would call), and
        // wait there; the next ones go to pool threads.
        let callers: Vec<_> = (0..2)
            .map(|_| {
                let (pool, g, tx) = (pool.clone(), Arc::clone(&gate), tx.clone());
                std::thread::spawn(move || {
                    let caller = std::thread::current().id();
                    pool.run(move || {
                        tx.send(std::thread::current().id() == caller).unwrap();
                        let _ = g.lock().unwrap().recv();
                    });
                })
            })
            .collect();
        for _ in 0..2 {
            assert!(
                rx.recv_timeout(Duration::from_secs(5)).unwrap(),
                "not inline"
            );
        }
        for _ in 0..3 {
            let tx = tx.clone();
            pool.run(move || tx.send(std::thread::current().id() == here).unwrap());
            assert!(
                !rx.recv_timeout(Duration::from_secs(5)).unwrap(),
                "ran inline past the share"
            );
        }
        for _ in 0..2 {
            release.send(()).unwrap();
        }
        for c in callers {
            c.join().unwrap();
        }
        // The share is free again.
        pool.run(move || tx.send(std::thread::current().id() == here).unwrap());
        assert!(
            rx.recv_timeout(Duration::from_secs(5)).unwrap(),
            "share not given back"
        );
    }

    #[test]
    fn idle_threads_are_reused() {
        let pool = Offload::named("test", 0);
        let n = Arc::new(AtomicUsize::new(0));
        for _ in 0..100 {
            let n = Arc::clone(&n);
            pool.run(move || {
                n.fetch_add(1, Ordering::SeqCst);
            });
            assert!(pool.drain(Duration::from_secs(5)));
        }
        assert_eq!(n.load(Ordering::SeqCst), 100);
        assert_eq!(pool.threads(), 1, "one job at a time needs one thread");
    }
}
