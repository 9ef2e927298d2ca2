//! Named failpoints (the raft-engine model), compiled in only with the `failpoints` feature.
//! A test arms a name; when execution reaches it the operation fails with an I/O error, which
//! is how a crash "inside" commit or replay is simulated without killing the process.

#[cfg(feature = "failpoints")]
mod imp {
    use crate::sync::LockPolicy;
    use std::collections::HashSet;
    use std::sync::Mutex;

    static ARMED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

    pub fn arm(name: &str) {
        ARMED
            .lock()
            .or_panic()
            .get_or_insert_with(HashSet::new)
            .insert(name.to_string());
    }

    pub fn disarm_all() {
        *ARMED.lock().or_panic() = None;
    }

    pub fn hit(name: &str) -> bool {
        ARMED
            .lock()
            .or_panic()
            .as_ref()
            .is_some_and(|s| s.contains(name))
    }
}

#[cfg(feature = "failpoints")]
pub use imp::{arm, disarm_all, hit};

/// `failpoint!("name")` returns an injected I/O error from the enclosing function when armed.
#[macro_export]
macro_rules! failpoint {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        {
            if $crate::failpoint::hit($name) {
                return Err($crate::Error::new(
                    $crate::ErrorKind::Io,
                    concat!("failpoint ", $name),
                ));
            }
        }
    };
}
