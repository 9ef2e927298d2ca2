//! Named failpoints (the raft-engine model), compiled in only with the `failpoints` feature.
//! A test arms a name; when execution reaches it the operation fails with an I/O error, which
//! is how a crash "inside" commit or replay is simulated without killing the process.
//!
//! Process failpoints ([`process`]) are compiled into every build, for the end-to-end tests of
//! real daemons: `CETRA_FAILPOINT=<name>=exit` makes the process exit with status 99 when it
//! reaches `<name>`, `CETRA_FAILPOINT=<name>=panic` makes the thread that reaches it panic
//! (which, under the panic policy, aborts the process), `CETRA_FAILPOINT=<name>=stop` makes it
//! stop the whole process with SIGSTOP (a paused node, resumed by SIGCONT),
//! `CETRA_FAILPOINT=<name>=sleep<MS>` makes the thread that reaches it sleep MS milliseconds
//! while the rest of the process goes on (heartbeats included). The variable is
//! read once. A failpoint reached through [`process_at`] (a write of a byte range) fires only
//! once and only for the write covering the offset written in the file `CETRA_FAILPOINT_AT`
//! names, once that file exists (a test writes it when the moment has come).

/// The environment variable naming the one armed process failpoint.
pub const PROCESS_ENV: &str = "CETRA_FAILPOINT";

/// The environment variable naming the file that holds the byte offset a [`process_at`]
/// failpoint waits for.
pub const PROCESS_AT_ENV: &str = "CETRA_FAILPOINT_AT";

/// Exit status of a process stopped by an `=exit` process failpoint.
pub const PROCESS_EXIT_CODE: i32 = 99;

/// Reached process failpoint `name`: exit or panic if `CETRA_FAILPOINT` asks for it, else
/// nothing (one comparison after the first call). A panic names the caller's location.
#[track_caller]
pub fn process(name: &str) {
    let Some(action) = armed_action(name) else {
        return;
    };
    match action {
        "exit" => {
            tracing::error!("failpoint {name}: exiting as requested by {PROCESS_ENV}");
            std::process::exit(PROCESS_EXIT_CODE);
        }
        "panic" => panic!("failpoint {name}: panicking as requested by {PROCESS_ENV}"),
        "stop" => {
            tracing::warn!(
                "failpoint {name}: stopping this process (SIGSTOP) as requested by {PROCESS_ENV}"
            );
            // SAFETY: raise only sends a signal to this process; SIGSTOP stops every thread
            // until a SIGCONT, and no memory is touched.
            unsafe {
                libc::raise(libc::SIGSTOP);
            }
            tracing::warn!("failpoint {name}: continued (SIGCONT)");
        }
        sleep if sleep.starts_with("sleep") => {
            // `sleepMS`: only this thread waits (a process that keeps heartbeating meanwhile).
            let ms: u64 = sleep["sleep".len()..].parse().unwrap_or(0);
            tracing::warn!("failpoint {name}: sleeping {ms} ms as requested by {PROCESS_ENV}");
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        other => tracing::warn!("{PROCESS_ENV}: unknown action {other:?} for {name}, ignored"),
    }
}

/// The action `CETRA_FAILPOINT` names for `name`, if it names `name`.
fn armed_action(name: &str) -> Option<&'static str> {
    static ARMED: std::sync::OnceLock<Option<(String, String)>> = std::sync::OnceLock::new();
    let armed = ARMED.get_or_init(|| {
        let v = std::env::var(PROCESS_ENV).ok()?;
        let (point, action) = v.rsplit_once('=')?;
        Some((point.to_string(), action.to_string()))
    });
    armed
        .as_ref()
        .filter(|(point, _)| point == name)
        .map(|(_, action)| action.as_str())
}

/// Reached process failpoint `name` with a write of `len` bytes at byte `offset`: like
/// [`process`], but when `CETRA_FAILPOINT_AT` is set it fires once, for the first write that
/// covers the offset the file it names holds (read only while `name` is armed).
#[track_caller]
pub fn process_at(name: &str, offset: u64, len: u64) {
    use std::sync::atomic::{AtomicBool, Ordering};
    static FIRED: AtomicBool = AtomicBool::new(false);
    if armed_action(name).is_none() || FIRED.load(Ordering::Acquire) {
        return;
    }
    let Some(file) = std::env::var_os(PROCESS_AT_ENV) else {
        return process(name);
    };
    let Some(at) = std::fs::read_to_string(file)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
    else {
        return;
    };
    if at >= offset && at - offset < len && !FIRED.swap(true, Ordering::AcqRel) {
        process(name);
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
