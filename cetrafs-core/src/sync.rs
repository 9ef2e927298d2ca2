//! The one rule for a poisoned lock: it is a panic, never a guard (ARCHITECTURE.md, "Panic
//! policy").
//!
//! A std lock is poisoned when a thread panicked while holding it, so the state it guards may
//! be half-updated: an inode with its size changed but not its extent map, a transaction with
//! half its blocks staged. Taking the guard anyway (`PoisonError::into_inner`) would let the
//! next thread commit that state to the shared LUN, where every node reads it.
//!
//! * The binaries are built with `panic = "abort"` (root Cargo.toml): the panicking thread takes
//!   the process down without unwinding, its guards are never released, and no other thread can
//!   reach the state it was changing. Poisoning cannot be observed there; the node is, to the
//!   cluster, a node that crashed, and recovery replays its journal.
//! * Test targets always unwind (cargo ignores `panic` for them). There a poisoned lock panics
//!   the thread that meets it too, so a test fails instead of carrying on over broken state.
//!
//! Every `Mutex::lock`, `RwLock::read`/`write` and `RwLock::try_read` outside test code ends in
//! [`LockPolicy::or_panic`], so this rule has one home.

use std::sync::{LockResult, TryLockError, TryLockResult};

/// Turns a lock result into its guard, panicking on poison (see the module documentation).
pub trait LockPolicy {
    /// What a successful acquisition yields.
    type Guard;
    /// The guard; a poisoned lock panics.
    fn or_panic(self) -> Self::Guard;
}

impl<G> LockPolicy for LockResult<G> {
    type Guard = G;
    #[track_caller]
    fn or_panic(self) -> G {
        match self {
            Ok(g) => g,
            Err(_) => poisoned(),
        }
    }
}

/// `try_lock`/`try_read`/`try_write`: `None` if the lock is taken, the guard if it was free.
impl<G> LockPolicy for TryLockResult<G> {
    type Guard = Option<G>;
    #[track_caller]
    fn or_panic(self) -> Option<G> {
        match self {
            Ok(g) => Some(g),
            Err(TryLockError::WouldBlock) => None,
            Err(TryLockError::Poisoned(_)) => poisoned(),
        }
    }
}

#[cold]
#[track_caller]
fn poisoned() -> ! {
    panic!(
        "lock poisoned: a thread panicked while holding it, so the state it guards may be \
         half-updated; refusing to use it (ARCHITECTURE.md, Panic policy)"
    )
}

#[cfg(test)]
mod tests {
    use super::LockPolicy;
    use std::sync::{Arc, Mutex, RwLock};

    fn poison<T: Send + Sync + 'static>(m: &Arc<RwLock<T>>) {
        let m2 = Arc::clone(m);
        let r = std::thread::spawn(move || {
            let _g = m2.write().or_panic();
            panic!("deliberate panic while holding the lock");
        })
        .join();
        assert!(r.is_err());
        assert!(m.is_poisoned());
    }

    #[test]
    fn healthy_locks_yield_guards() {
        let m = Mutex::new(1);
        *m.lock().or_panic() += 1;
        assert_eq!(*m.lock().or_panic(), 2);
        let l = RwLock::new(5);
        assert_eq!(*l.read().or_panic(), 5);
        *l.write().or_panic() = 6;
        let r = l.read().or_panic();
        assert_eq!(l.try_read().or_panic().map(|g| *g), Some(6));
        assert!(
            l.try_write().or_panic().is_none(),
            "held for reading: would block"
        );
        drop(r);
    }

    #[test]
    fn a_poisoned_lock_is_a_panic_not_a_guard() {
        let l = Arc::new(RwLock::new(0u32));
        poison(&l);
        for what in ["read", "write", "try_read"] {
            let l2 = Arc::clone(&l);
            let r = std::thread::spawn(move || match what {
                "read" => drop(l2.read().or_panic()),
                "write" => drop(l2.write().or_panic()),
                _ => drop(l2.try_read().or_panic()),
            })
            .join();
            let msg = r.expect_err(what);
            let msg = msg
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| msg.downcast_ref::<&str>().copied())
                .unwrap_or_default()
                .to_string();
            assert!(msg.starts_with("lock poisoned"), "{what}: {msg}");
        }
    }
}
