//! The panic policy end to end (ARCHITECTURE.md, "Panic policy"): a daemon thread that panics
//! in the middle of a commit (journal written and flushed, no home block written yet, the
//! metadata mutex held) ends the whole process at once, by SIGABRT, after logging the panic at
//! ERROR with its thread and location. Nothing unwinds, so no other thread of that daemon goes
//! on with the half-done commit; the next mount replays the journal, so the change is there in
//! full, what was durable before is intact, and fsck is clean.
//!
//! Contract with the daemon: `CETRA_FAILPOINT=commit::before_home=panic` panics the thread
//! that reaches that point of a commit (cetrafs-core/src/failpoint.rs).

use cetrafs_tests::{errno_name, errno_of, require_fuse, secs, Exit, Lun, Mount};
use std::fs;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

const HOST: &str = "panicnode";
const FAILPOINT: (&str, &str) = ("CETRA_FAILPOINT", "commit::before_home=panic");
/// The daemon's panic message, from `failpoint::process`.
const PANIC_MESSAGE: &str = "failpoint commit::before_home: panicking as requested";

#[test]
fn a_panic_mid_commit_aborts_the_daemon_and_the_journal_restores_the_change() {
    require_fuse!();
    let lun = Lun::new(2 << 30);
    lun.mkfs(&[]);

    // Durable state before the panic.
    let before = b"written and fsync'd before the panic\n".repeat(100);
    {
        let m = Mount::new(&lun, HOST);
        fs::create_dir(m.p("before")).expect("mkdir before");
        let mut f = fs::File::create(m.p("before/file")).expect("create before/file");
        f.write_all(&before).expect("write before/file");
        f.sync_all().expect("fsync before/file");
        drop(f);
        fs::File::open(m.p("before"))
            .and_then(|d| d.sync_all())
            .expect("fsync before/");
        m.unmount();
    }

    // The mount itself must not commit (else it would panic before it is up): the first commit
    // is the one the fsync below asks for.
    let mut m = Mount::with_opts_env(&lun, HOST, &[], &[FAILPOINT]);
    fs::create_dir(m.p("during")).expect("mkdir during (before any commit)");
    let t0 = Instant::now();
    let r = fs::File::open(m.p("during")).and_then(|d| d.sync_all());
    let e = r.expect_err("fsync of during/ succeeded although its commit panicked");
    eprintln!(
        "fsync during/ failed after {} with {} ({e})",
        secs(t0.elapsed()),
        errno_name(errno_of(&e))
    );

    let exit = m.wait_exit(Duration::from_secs(10));
    assert_eq!(
        exit,
        Some(Exit::Signal(libc::SIGABRT)),
        "the daemon did not abort on the panic within 10 s (None = still running)\nlog:\n{}",
        m.own_log()
    );
    let log = m.own_log();
    let panic_line = log
        .lines()
        .find(|l| l.trim_start().starts_with("ERROR ") && l.contains(PANIC_MESSAGE))
        .unwrap_or_else(|| panic!("no ERROR line with {PANIC_MESSAGE:?} in the log:\n{log}"));
    eprintln!("the daemon logged: {panic_line}");
    assert!(
        panic_line.contains("panic in thread '")
            && panic_line.contains("cetrafs-core/src/fs/txn.rs:"),
        "the panic line names no thread or no source location: {panic_line}"
    );
    assert!(
        !log.contains("panicked at"),
        "the default panic hook ran instead of (or besides) the daemon's:\n{log}"
    );
    m.allow_error(PANIC_MESSAGE);
    m.abandon(None)
        .unwrap_or_else(|e| panic!("detaching the dead mount: {e}"));

    // The journal of the panicked commit was durable: the next mount replays it.
    let m = Mount::new(&lun, HOST);
    let mut got = Vec::new();
    fs::File::open(m.p("before/file"))
        .and_then(|mut f| f.read_to_end(&mut got))
        .expect("read before/file after the panic");
    assert!(got == before, "before/file changed across the panic");
    assert!(
        m.p("during").is_dir(),
        "during/ is missing after replay: its transaction was journaled and flushed before the \
         panic"
    );
    m.unmount();
    lun.assert_fsck_clean();
}
