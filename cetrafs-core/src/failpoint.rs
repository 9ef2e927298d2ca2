//! Named failpoints (the raft-engine model), compiled in only with the `failpoints` feature.
//! A test arms a name; when execution reaches it the operation fails with an I/O error, which
//! is how a crash "inside" commit or replay is simulated without killing the process.
//!
//! Process failpoints ([`process`]) are compiled into every build, for the end-to-end tests of
//! real daemons: `CETRA_FAILPOINT=<name>=exit` makes the process exit with status 99 when it
//! reaches `<name>`, `CETRA_FAILPOINT=<name>=panic` makes the thread that reaches it panic
//! (which, under the panic policy, aborts the process). The variable is read once.

/// The environment variable naming the one armed process failpoint.
pub const PROCESS_ENV: &str = "CETRA_FAILPOINT";

/// Exit status of a process stopped by an `=exit` process failpoint.
pub const PROCESS_EXIT_CODE: i32 = 99;

/// Reached process failpoint `name`: exit or panic if `CETRA_FAILPOINT` asks for it, else
/// nothing (one comparison after the first call). A panic names the caller's location.
#[track_caller]
pub fn process(name: &str) {
    static ARMED: std::sync::OnceLock<Option<(String, String)>> = std::sync::OnceLock::new();
    let armed = ARMED.get_or_init(|| {
        let v = std::env::var(PROCESS_ENV).ok()?;
        let (point, action) = v.rsplit_once('=')?;
        Some((point.to_string(), action.to_string()))
    });
    let Some((point, action)) = armed else { return };
    if point != name {
        return;
    }
    match action.as_str() {
        "exit" => {
            tracing::error!("failpoint {name}: exiting as requested by {PROCESS_ENV}");
            std::process::exit(PROCESS_EXIT_CODE);
        }
        "panic" => panic!("failpoint {name}: panicking as requested by {PROCESS_ENV}"),
        other => tracing::warn!("{PROCESS_ENV}: unknown action {other:?} for {name}, ignored"),
    }
}

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
