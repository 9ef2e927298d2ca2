//! Behaviour compared with tmpfs, mounted by the test on the same machine (so the same kernel
//! decides): setuid/setgid removal by unprivileged and root writes, truncates and chowns;
//! `RENAME_WHITEOUT`; poll. Runs as root; the unprivileged side uses `setpriv` (util-linux).

use cetrafs_tests::{cstr, have_command, lstat, require_fuse, run, Lun, Mount};
use std::fs::Permissions;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

const NOBODY: u32 = 65534;

/// A tmpfs mounted for the duration of a test.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn new(at: &Path) -> Self {
        std::fs::create_dir_all(at).expect("tmpfs mountpoint");
        nix::mount::mount(
            Some("tmpfs"),
            at,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=64m"),
        )
        .expect("mount tmpfs");
        Self(at.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

fn mode_of(p: &Path) -> u32 {
    lstat(p)
        .unwrap_or_else(|e| panic!("stat {}: {e}", p.display()))
        .st_mode
        & 0o7777
}

/// Run a shell command, as root or as nobody (uid/gid 65534, no supplementary groups).
fn sh(as_nobody: bool, script: &str) {
    let mut c = if as_nobody {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
            "sh",
            "-c",
        ]);
        c
    } else {
        let mut c = Command::new("sh");
        c.arg("-c");
        c
    };
    let r = run(c.arg(script));
    assert_eq!(r.code, 0, "{script} (as nobody: {as_nobody}): {r}");
}

/// One case: an operation by a user on a file of a mode, owner and group.
#[derive(Debug, Clone, Copy)]
struct Case {
    op: &'static str,
    nobody: bool,
    mode: u32,
    uid: u32,
    gid: u32,
}

impl Case {
    fn name(&self) -> String {
        format!(
            "{}-{}-{:o}-{}-{}",
            self.op,
            if self.nobody { "nobody" } else { "root" },
            self.mode,
            self.uid,
            self.gid
        )
    }

    /// Create the file (4 KiB of data) on `root` and apply the operation.
    fn run_on(&self, root: &Path) {
        let f = root.join(self.name());
        std::fs::write(&f, vec![b'a'; 4096]).expect("write file");
        std::os::unix::fs::chown(&f, Some(self.uid), Some(self.gid)).expect("chown");
        std::fs::set_permissions(&f, Permissions::from_mode(self.mode)).expect("chmod");
        let q = f.display();
        let script = match self.op {
            // One byte: a partial-block write through the metadata path.
            "write1" => format!("printf x | dd of='{q}' conv=notrunc status=none"),
            // A whole aligned block inside written data: the candidate for the data fast path.
            "write4k" => {
                format!("dd if=/dev/zero of='{q}' bs=4096 count=1 conv=notrunc status=none")
            }
            "append" => format!("printf x >> '{q}'"),
            // ftruncate(2) (coreutils truncate opens the file and truncates the descriptor).
            "ftruncate" => format!("truncate -s 1 '{q}'"),
            // open(O_TRUNC), which the kernel's FUSE sends as one OPEN.
            "otrunc" => format!(": > '{q}'"),
            // chown to the owner it already has: still a chown to the kernel.
            "chown" => format!("chown {}:{} '{q}'", self.uid, NOBODY),
            other => unreachable!("{other}"),
        };
        sh(self.nobody, &script);
    }
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for op in [
        "write1",
        "write4k",
        "append",
        "ftruncate",
        "otrunc",
        "chown",
    ] {
        for nobody in [true, false] {
            for mode in [0o4777, 0o2777, 0o6777, 0o2767] {
                // Group 0: nobody is not in it; group 65534: nobody is.
                for gid in [0, NOBODY] {
                    // A non-root user may only chown its own files.
                    let uid = if op == "chown" && nobody { NOBODY } else { 0 };
                    v.push(Case {
                        op,
                        nobody,
                        mode,
                        uid,
                        gid,
                    });
                }
            }
        }
    }
    v
}

fn need_tools() -> bool {
    if have_command("setpriv") {
        return true;
    }
    let msg = "kernel_parity: 'setpriv' is not installed (Debian package util-linux)";
    assert!(
        std::env::var("CETRA_REQUIRE_E2E").as_deref() != Ok("1"),
        "{msg}"
    );
    eprintln!("!!! SKIPPED {msg}");
    false
}

/// Mount a fresh volume and a tmpfs side by side, both world-writable and reachable by nobody.
fn cetra_and_tmpfs(tag: &str) -> (Lun, Mount, Tmpfs) {
    let lun = Lun::new(2 << 30);
    lun.mkfs(&["-q"]);
    let m = Mount::new(&lun, tag);
    let t = Tmpfs::new(&lun.dir().join("tmpfs"));
    // The LUN's private temp dir is 0700: let nobody traverse to both roots.
    std::fs::set_permissions(lun.dir(), Permissions::from_mode(0o755)).expect("chmod lun dir");
    for root in [m.path(), t.0.as_path()] {
        std::fs::set_permissions(root, Permissions::from_mode(0o777)).expect("chmod root");
    }
    (lun, m, t)
}

#[test]
fn setuid_setgid_removal_matches_tmpfs() {
    require_fuse!();
    if !need_tools() {
        return;
    }
    let (lun, m, t) = cetra_and_tmpfs("suid");
    let cases = cases();
    for c in &cases {
        c.run_on(m.path());
        c.run_on(&t.0);
    }
    let mut diffs = Vec::new();
    let mut seen = Vec::new();
    for c in &cases {
        let (ours, theirs) = (mode_of(&m.p(c.name())), mode_of(&t.0.join(c.name())));
        seen.push((c.name(), ours));
        if ours != theirs {
            diffs.push(format!("{}: cetrafs {ours:o}, tmpfs {theirs:o}", c.name()));
        }
    }
    assert!(
        diffs.is_empty(),
        "{} of {} cases differ from tmpfs:\n{}",
        diffs.len(),
        cases.len(),
        diffs.join("\n")
    );
    // The test must exercise both outcomes, or it could pass by never removing anything.
    assert!(
        seen.iter()
            .any(|(n, m)| n.starts_with("write4k-nobody") && *m == 0o777),
        "no unprivileged write removed setuid: {seen:?}"
    );
    assert!(
        seen.iter()
            .any(|(n, m)| n.starts_with("write4k-root") && *m & 0o6000 != 0),
        "no root write kept its bits: {seen:?}"
    );
    // The removed bits were committed with the writes: they survive a remount.
    drop(m);
    let m = Mount::new(&lun, "suid");
    for (name, mode) in &seen {
        assert_eq!(mode_of(&m.p(name)), *mode, "{name} after remount");
    }
    m.unmount();
    lun.assert_fsck_clean();
}

/// renameat2(2) with flags (glibc's wrapper is not in every libc crate version).
fn renameat2(from: &Path, to: &Path, flags: libc::c_uint) -> std::io::Result<()> {
    let (a, b) = (cstr(from), cstr(to));
    // SAFETY: two valid NUL-terminated paths; the syscall only reads them.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            flags,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[test]
fn rename_whiteout_matches_tmpfs() {
    require_fuse!();
    let (lun, m, t) = cetra_and_tmpfs("whiteout");
    let mut seen = Vec::new();
    for root in [m.path(), t.0.as_path()] {
        let d = root.join("upper");
        std::fs::create_dir(&d).expect("mkdir");
        std::fs::write(d.join("a"), b"payload").expect("write a");
        std::fs::write(d.join("b"), b"old").expect("write b");
        renameat2(&d.join("a"), &d.join("moved"), libc::RENAME_WHITEOUT).expect("whiteout rename");
        // Over an existing name as well.
        renameat2(&d.join("b"), &d.join("moved"), libc::RENAME_WHITEOUT)
            .expect("whiteout rename over an existing file");
        assert_eq!(std::fs::read(d.join("moved")).expect("read"), b"old");
        let exch = renameat2(
            &d.join("moved"),
            &d.join("a"),
            libc::RENAME_WHITEOUT | libc::RENAME_EXCHANGE,
        );
        assert_eq!(
            exch.expect_err("WHITEOUT|EXCHANGE").raw_os_error(),
            Some(libc::EINVAL)
        );
        let mut names: Vec<String> = std::fs::read_dir(&d)
            .expect("readdir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let ws: Vec<(u32, u64, u32, u32, u64)> = ["a", "b"]
            .iter()
            .map(|n| {
                let s = lstat(&d.join(n)).expect("stat whiteout");
                (s.st_mode, s.st_rdev, s.st_uid, s.st_gid, s.st_nlink)
            })
            .collect();
        seen.push((names, ws));
    }
    assert_eq!(seen[0], seen[1], "cetrafs vs tmpfs");
    let (_, ws) = &seen[0];
    assert_eq!(
        ws[0].0,
        libc::S_IFCHR,
        "a whiteout is a char device with mode 0"
    );
    assert_eq!(ws[0].1, 0, "device 0/0");
    // It is on disk, not a cache artefact.
    drop(t);
    m.unmount();
    lun.assert_fsck_clean();
    let m = Mount::new(&lun, "whiteout");
    let s = lstat(&m.p("upper/a")).expect("whiteout after remount");
    assert_eq!((s.st_mode, s.st_rdev), (libc::S_IFCHR, 0));
    m.unmount();
}

#[test]
fn poll_reports_ready_and_logs_nothing() {
    require_fuse!();
    let lun = Lun::new(2 << 30);
    lun.mkfs(&["-q"]);
    let m = Mount::new(&lun, "poll");
    std::fs::write(m.p("f"), b"x").expect("write");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.p("f"))
        .expect("open");
    for _ in 0..3 {
        let mut pfd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&f),
            events: libc::POLLIN | libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one valid pollfd, count 1.
        let n = unsafe { libc::poll(&raw mut pfd, 1, 1000) };
        assert_eq!(n, 1, "poll: {}", std::io::Error::last_os_error());
        assert_eq!(pfd.revents, libc::POLLIN | libc::POLLOUT);
    }
    drop(f);
    let log = m.own_log();
    assert!(!log.contains("Not Implemented"), "{log}");
    m.unmount();
}
