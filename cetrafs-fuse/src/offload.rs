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
//! **What runs here.** The adapter hands every request that changes metadata (creates,
//! removals, renames, links, `setattr`, xattr changes, `fallocate`, an open that truncates,
//! `fsync` and `fsyncdir`) to [`Offload::run`], together with what it needs (owned copies of
//! its names, its reply) and returns: the worker goes back to /dev/fuse at once. A change
//! thread answers the request. Lookups, attributes, listings, opens, closes and the data path
//! stay on the workers: the core answers them without the global lock when its holders are
//! silent (`fs/own_lock_reads.rs`, `fs/closer.rs`), and a `READ`/`WRITE` needs only its file's
//! own lock.
//!
//! The `io_uring` transport (uring.rs) answers its requests that may wait on a pool of its
//! own (`cetra-uring-h` threads) for the same reason: it had 32 helpers, and as many waiting
//! changes used them up.
//!
//! **The pool.** A thread is started when a request comes and no thread is idle, up to
//! [`MAX_THREADS`]; past that the request runs on the worker (as before: never refused, and
//! the bound keeps a runaway from exhausting the process). A thread idle for [`IDLE_EXIT`]
//! ends, down to none. Order between requests is the kernel's business: it already holds the
//! VFS locks (a directory's for changes in it, an inode's for its `setattr`) until each answer,
//! so two requests that must not overlap are never both here. **Cost**: one hand-over (a
//! queue push and a wake-up) per change, a few microseconds against the hundreds a change
//! costs (its journal commit); measured by `bench/metadata.sh`.
//!
//! **End.** The session's `destroy` calls [`Offload::drain`] before it unmounts the volume:
//! the kernel sends DESTROY only once every request was answered, so it finds the queue empty
//! in practice; it waits (bounded) for any change still running.

use cetrafs_core::sync::LockPolicy;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tracing::warn;

/// Most change threads at once (then a request runs on its FUSE worker).
pub const MAX_THREADS: usize = 1024;
/// A change thread idle this long ends.
pub const IDLE_EXIT: Duration = Duration::from_secs(10);

type Job = Box<dyn FnOnce() + Send + 'static>;

/// The change threads (module doc). Cloning shares the pool.
#[derive(Debug, Clone)]
pub struct Offload {
    shared: Arc<Shared>,
}

impl Default for Offload {
    fn default() -> Self {
        Self::named("cetra-change")
    }
}

#[derive(Debug, Default)]
struct Shared {
    /// The threads' name.
    name: &'static str,
    state: Mutex<State>,
    /// Jobs queued, or the pool draining.
    work: Condvar,
    /// A job ended (for [`Offload::drain`]).
    done: Condvar,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    threads: usize,
    idle: usize,
    running: usize,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("jobs", &self.jobs.len())
            .field("threads", &self.threads)
            .field("idle", &self.idle)
            .field("running", &self.running)
            .finish()
    }
}

impl Offload {
    /// A pool whose threads are called `name`.
    pub fn named(name: &'static str) -> Self {
        Self {
            shared: Arc::new(Shared {
                name,
                ..Shared::default()
            }),
        }
    }

    /// Run `job` on a change thread, starting one if none is idle; on the caller's thread
    /// when [`MAX_THREADS`] are busy or a thread cannot be started.
    pub fn run(&self, job: impl FnOnce() + Send + 'static) {
        let mut s = self.shared.state.lock().or_panic();
        // Idle threads not yet claimed by a queued job.
        let free = s.idle.saturating_sub(s.jobs.len());
        if free == 0 {
            if s.threads >= MAX_THREADS {
                drop(s);
                job();
                return;
            }
            let shared = Arc::clone(&self.shared);
            let started = std::thread::Builder::new()
                .name(self.shared.name.into())
                .spawn(move || serve(&shared));
            if let Err(e) = started {
                drop(s);
                warn!("cannot start a change thread ({e}); the FUSE worker runs the change");
                job();
                return;
            }
            s.threads += 1;
            s.idle += 1;
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
        self.shared.state.lock().or_panic().threads
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
            s.idle += 1;
            shared.done.notify_all();
            continue;
        }
        let (next, timeout) = shared.work.wait_timeout(s, IDLE_EXIT).or_panic();
        s = next;
        if timeout.timed_out() && s.jobs.is_empty() {
            s.idle -= 1;
            s.threads -= 1;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;

    #[test]
    fn a_waiting_job_does_not_hold_up_the_next() {
        let pool = Offload::default();
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
    fn idle_threads_are_reused() {
        let pool = Offload::default();
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
