//! POSIX semantics through the mount: open-unlinked files, truncate, `O_APPEND`, rename rules,
//! link counts, statfs, and POSIX ACL enforcement for a non-root user.

use cetrafs_tests::{cstr, have_command, lstat, require_fuse, run, statvfs, Lun, Mount};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn errno<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("operation should have failed")
        .raw_os_error()
        .unwrap_or(0)
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| i.to_le_bytes()[0].wrapping_mul(31).wrapping_add(salt))
        .collect()
}

/// Free blocks (in `f_frsize` units) of a mount.
fn free_blocks(p: &Path) -> u64 {
    statvfs(p).f_bfree
}

/// Poll until `cond` is true or `timeout` passes; returns whether it became true.
fn poll(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

fn mounted(tag: &str) -> (Lun, Mount) {
    let lun = Lun::new(2 << 30);
    lun.mkfs(&["-q"]);
    let m = Mount::new(&lun, tag);
    (lun, m)
}

#[test]
fn open_unlinked_file_lives_until_close() {
    require_fuse!();
    let (lun, m) = mounted("unlinked");
    let bsize = statvfs(m.path()).f_frsize;
    let free0 = free_blocks(m.path());
    let p = m.p("victim");
    let data = pattern(8 << 20, 7);
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .expect("create");
    f.write_all(&data).expect("write");
    f.sync_all().expect("fsync");
    let free1 = free_blocks(m.path());
    assert!(
        free0 - free1 >= (8 << 20) / bsize,
        "8 MiB written but free blocks only went {free0} -> {free1}"
    );

    std::fs::remove_file(&p).expect("unlink while open");
    assert_eq!(errno(lstat(&p)), libc::ENOENT, "name must be gone");
    assert_eq!(
        f.metadata().expect("fstat").nlink(),
        0,
        "nlink of an open-unlinked file"
    );
    // Still readable and writable.
    let mut back = vec![0u8; data.len()];
    f.read_exact_at(&mut back, 0).expect("read after unlink");
    assert!(back == data, "content changed after unlink");
    f.write_all_at(b"still writable", 4 << 20)
        .expect("write after unlink");
    let mut small = [0u8; 14];
    f.read_exact_at(&mut small, 4 << 20).expect("read back");
    assert_eq!(&small, b"still writable");
    f.set_len(12 << 20).expect("extend after unlink");
    assert_eq!(f.metadata().expect("fstat").len(), 12 << 20);
    // A second name must not appear, and the blocks are still held.
    assert!(std::fs::read_dir(m.path())
        .expect("readdir")
        .all(|e| e.expect("e").file_name() != "victim"));
    assert!(
        free_blocks(m.path()) < free0 - (4 << 20) / bsize,
        "blocks of an open-unlinked file were freed early"
    );

    drop(f);
    // Release is asynchronous in FUSE: poll until the blocks come back (allow a few blocks of
    // metadata slack).
    let slack = 16;
    let ok = poll(Duration::from_secs(20), || {
        free_blocks(m.path()) + slack >= free0
    });
    assert!(
        ok,
        "free blocks did not come back after close: before {free0}, now {}",
        free_blocks(m.path())
    );
    m.unmount();
    lun.assert_fsck_clean();
}

#[test]
fn truncate_semantics() {
    require_fuse!();
    let (lun, m) = mounted("truncate");
    let p = m.p("t");
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .expect("create");
    let data = pattern(10_000, 3);
    f.write_all(&data).expect("write");
    // Shrink into the middle of a block, extend again: the old bytes must not reappear.
    f.set_len(5_001).expect("shrink");
    assert_eq!(f.metadata().expect("stat").len(), 5_001);
    f.set_len(20_000).expect("extend");
    let mut back = vec![0xffu8; 20_000];
    f.read_exact_at(&mut back, 0).expect("read");
    assert_eq!(&back[..5_001], &data[..5_001], "kept part");
    assert!(
        back[5_001..].iter().all(|&b| b == 0),
        "bytes past the old size must read as zeros after extension"
    );
    // Truncate to zero and write far out: a hole before it.
    f.set_len(0).expect("truncate to 0");
    f.write_all_at(b"tail", 1 << 20).expect("write past EOF");
    assert_eq!(f.metadata().expect("stat").len(), (1 << 20) + 4);
    let mut hole = vec![0xffu8; 1 << 20];
    f.read_exact_at(&mut hole, 0).expect("read hole");
    assert!(hole.iter().all(|&b| b == 0), "hole must read as zeros");
    // truncate(2) by path, and O_TRUNC.
    std::fs::write(&p, b"0123456789").expect("write");
    // SAFETY: valid C string.
    let r = unsafe { libc::truncate(cstr(&p).as_ptr(), 3) };
    assert_eq!(r, 0, "truncate(2)");
    assert_eq!(std::fs::read(&p).expect("read"), b"012");
    drop(
        OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&p)
            .expect("O_TRUNC"),
    );
    assert_eq!(std::fs::metadata(&p).expect("stat").len(), 0);
    // Truncate of a directory fails.
    std::fs::create_dir(m.p("dir")).expect("mkdir");
    // SAFETY: valid C string.
    let r = unsafe { libc::truncate(cstr(&m.p("dir")).as_ptr(), 0) };
    assert_eq!(r, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EISDIR)
    );
    // Shrinking frees blocks.
    let before = free_blocks(m.path());
    let mut g = File::create(m.p("big")).expect("create");
    g.write_all(&pattern(16 << 20, 1)).expect("write");
    g.sync_all().expect("fsync");
    let mid = free_blocks(m.path());
    g.set_len(4096).expect("shrink");
    g.sync_all().expect("fsync");
    let after = free_blocks(m.path());
    assert!(
        after > mid && before.saturating_sub(after) < 64,
        "shrink must free blocks: {before} -> {mid} -> {after}"
    );
    drop((f, g));
    m.unmount();
    lun.assert_fsck_clean();
}

#[test]
fn o_append() {
    require_fuse!();
    let (lun, m) = mounted("append");
    let p = m.p("log");
    std::fs::write(&p, b"start\n").expect("write");
    let mut a1 = OpenOptions::new()
        .append(true)
        .open(&p)
        .expect("open append 1");
    let mut a2 = OpenOptions::new()
        .append(true)
        .open(&p)
        .expect("open append 2");
    let mut plain = OpenOptions::new().write(true).open(&p).expect("open plain");
    let mut expect = b"start\n".to_vec();
    for i in 0..200 {
        let line = format!("line {i} from {}\n", if i % 2 == 0 { "a1" } else { "a2" });
        if i % 2 == 0 { &mut a1 } else { &mut a2 }
            .write_all(line.as_bytes())
            .expect("append");
        expect.extend_from_slice(line.as_bytes());
        if i % 50 == 49 {
            // Another descriptor extends the file; appends must land after it.
            let end = plain.seek(SeekFrom::End(0)).expect("seek");
            plain.write_all(b"[plain]\n").expect("plain write");
            assert_eq!(usize::try_from(end).unwrap(), expect.len());
            expect.extend_from_slice(b"[plain]\n");
        }
    }
    // pwrite on an O_APPEND descriptor appends on Linux (the offset is ignored).
    a1.write_at(b"pwrite-appended\n", 0).expect("pwrite append");
    expect.extend_from_slice(b"pwrite-appended\n");
    let mut got = Vec::new();
    File::open(&p)
        .expect("open")
        .read_to_end(&mut got)
        .expect("read");
    assert!(
        got == expect,
        "O_APPEND content:\n{}\nexpected\n{}",
        String::from_utf8_lossy(&got),
        String::from_utf8_lossy(&expect)
    );
    drop((a1, a2, plain));
    m.unmount();
    lun.assert_fsck_clean();
}

#[test]
fn rename_and_link_rules() {
    require_fuse!();
    let (lun, m) = mounted("rename");
    let d = |s: &str| m.p(s);
    std::fs::create_dir_all(d("src/sub")).expect("mkdir");
    std::fs::create_dir(d("empty")).expect("mkdir");
    std::fs::create_dir_all(d("full/x")).expect("mkdir");
    std::fs::write(d("file"), b"f").expect("write");
    std::fs::write(d("file2"), b"g").expect("write");

    assert_eq!(
        errno(std::fs::rename(d("src"), d("full"))),
        libc::ENOTEMPTY,
        "dir over non-empty dir"
    );
    assert_eq!(
        errno(std::fs::rename(d("src"), d("file"))),
        libc::ENOTDIR,
        "dir over file"
    );
    assert_eq!(
        errno(std::fs::rename(d("file"), d("empty"))),
        libc::EISDIR,
        "file over dir"
    );
    assert_eq!(
        errno(std::fs::rename(d("src"), d("src/sub/inside"))),
        libc::EINVAL,
        "dir into itself"
    );
    assert_eq!(
        errno(std::fs::rename(d("nope"), d("x"))),
        libc::ENOENT,
        "missing source"
    );
    // Directory over an empty directory replaces it; link counts of the parents follow.
    let root_links = lstat(m.path()).expect("stat").st_nlink;
    std::fs::rename(d("src"), d("empty")).expect("dir over empty dir");
    assert_eq!(
        lstat(m.path()).expect("stat").st_nlink,
        root_links - 1,
        "root lost one subdirectory"
    );
    assert!(d("empty/sub").is_dir());
    assert_eq!(errno(lstat(&d("src"))), libc::ENOENT);
    // Move a directory to another parent: '..' and link counts.
    std::fs::rename(d("empty/sub"), d("full/sub")).expect("move dir");
    assert_eq!(lstat(&d("empty")).expect("stat").st_nlink, 2);
    assert_eq!(lstat(&d("full")).expect("stat").st_nlink, 4);
    assert_eq!(
        lstat(&d("full/sub/..")).expect("stat").st_ino,
        lstat(&d("full")).expect("stat").st_ino,
        "'..' follows the move"
    );
    // File over file replaces; the replaced inode is gone.
    let ino2 = lstat(&d("file2")).expect("stat").st_ino;
    std::fs::rename(d("file"), d("file2")).expect("file over file");
    assert_eq!(std::fs::read(d("file2")).expect("read"), b"f");
    assert_ne!(lstat(&d("file2")).expect("stat").st_ino, ino2);

    // Hard link counts.
    std::fs::write(d("h"), b"h").expect("write");
    for i in 0..5 {
        std::fs::hard_link(d("h"), d(&format!("h{i}"))).expect("link");
    }
    assert_eq!(lstat(&d("h")).expect("stat").st_nlink, 6);
    assert_eq!(errno(std::fs::hard_link(d("h"), d("h0"))), libc::EEXIST);
    assert_eq!(
        errno(std::fs::hard_link(d("full"), d("dirlink"))),
        libc::EPERM,
        "link to a directory"
    );
    let f = File::open(d("h")).expect("open");
    for i in 0..5 {
        std::fs::remove_file(d(&format!("h{i}"))).expect("unlink");
    }
    assert_eq!(f.metadata().expect("fstat").nlink(), 1);
    std::fs::remove_file(d("h")).expect("unlink last");
    assert_eq!(f.metadata().expect("fstat").nlink(), 0);
    drop(f);
    // Rename of one hard link onto another of the same inode is a no-op that keeps both.
    std::fs::write(d("same"), b"s").expect("write");
    std::fs::hard_link(d("same"), d("same2")).expect("link");
    std::fs::rename(d("same"), d("same2")).expect("rename onto own hard link");
    assert!(
        d("same").exists() && d("same2").exists(),
        "POSIX: rename between links of one file does nothing"
    );
    assert_eq!(lstat(&d("same")).expect("stat").st_nlink, 2);
    // rmdir rules.
    assert_eq!(errno(std::fs::remove_dir(d("full"))), libc::ENOTEMPTY);
    assert_eq!(errno(std::fs::remove_dir(d("same"))), libc::ENOTDIR);
    assert_eq!(errno(std::fs::remove_file(d("full"))), libc::EISDIR);
    m.unmount();
    lun.assert_fsck_clean();
}

#[test]
fn statfs_is_sane() {
    require_fuse!();
    let (lun, m) = mounted("statfs");
    let s = statvfs(m.path());
    let bsize = s.f_frsize;
    assert!(
        bsize == 4096 || s.f_bsize == 4096,
        "block size {} / {}",
        s.f_bsize,
        s.f_frsize
    );
    let total = s.f_blocks * bsize;
    assert!(
        total <= lun.size(),
        "filesystem ({total}) larger than the LUN ({})",
        lun.size()
    );
    // Journals (16 x 64 MiB by default) and group metadata may be excluded: at least a third remains.
    assert!(
        total >= lun.size() / 3,
        "filesystem size {total} implausibly small for a {} LUN",
        lun.size()
    );
    assert!(
        s.f_bfree <= s.f_blocks && s.f_bavail <= s.f_bfree,
        "bfree/bavail: {} {} {}",
        s.f_blocks,
        s.f_bfree,
        s.f_bavail
    );
    assert!(
        s.f_bfree > s.f_blocks / 2,
        "a fresh filesystem is mostly free"
    );
    assert!(s.f_namemax >= 255, "namemax {}", s.f_namemax);
    assert!(
        s.f_files > 0 && s.f_ffree <= s.f_files,
        "files {} ffree {}",
        s.f_files,
        s.f_ffree
    );
    let free0 = s.f_bfree;
    let mut f = File::create(m.p("x")).expect("create");
    f.write_all(&pattern(32 << 20, 9)).expect("write");
    f.sync_all().expect("fsync");
    drop(f);
    let free1 = free_blocks(m.path());
    assert!(
        free0 - free1 >= (32 << 20) / bsize,
        "32 MiB written, free went {free0} -> {free1}"
    );
    assert!(
        free0 - free1 <= (33 << 20) / bsize,
        "32 MiB written cost more than 33 MiB: {free0} -> {free1}"
    );
    std::fs::remove_file(m.p("x")).expect("unlink");
    assert!(
        poll(Duration::from_secs(20), || free_blocks(m.path()) + 16
            >= free0),
        "space not returned after unlink"
    );
    m.unmount();
    lun.assert_fsck_clean();
}

/// Run `argv` as uid/gid 65534 (nobody) via setpriv; true if it exited 0.
fn as_nobody(argv: &[&str]) -> (bool, String) {
    let r = run(Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(argv));
    (r.code == 0, r.output())
}

#[test]
fn posix_acl_enforced_for_non_root() {
    require_fuse!();
    for tool in ["setfacl", "getfacl", "setpriv"] {
        if !have_command(tool) {
            // Loud, and a failure when the suite demands everything (scripts/test installs acl).
            let msg =
                format!("posix_acl: '{tool}' is not installed (Debian packages acl / util-linux)");
            assert!(
                std::env::var("CETRA_REQUIRE_E2E").as_deref() != Ok("1"),
                "{msg}"
            );
            eprintln!("!!! SKIPPED {msg}");
            return;
        }
    }
    let (lun, m) = mounted("acl");
    // The mountpoint lives in a private 0700 temp dir: let others traverse to it.
    std::fs::set_permissions(lun.dir(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod lun dir");
    std::fs::set_permissions(m.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod root");
    let open = m.p("open-file");
    std::fs::write(&open, b"readable\n").expect("write");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let open_s = open.to_str().expect("utf8 path");
    let (ok, out) = as_nobody(&["cat", open_s]);
    assert!(
        ok,
        "a non-root user cannot read a 0644 file on the mount at all ({out}); ACLs cannot be tested. \
         Is the mount missing allow_other / default_permissions?"
    );

    // 1. A user ACL entry grants access that the mode bits deny.
    let granted = m.p("granted");
    std::fs::write(&granted, b"secret\n").expect("write");
    std::fs::set_permissions(&granted, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let g = granted.to_str().expect("utf8");
    assert!(
        !as_nobody(&["cat", g]).0,
        "nobody can read a 0600 root file without an ACL"
    );
    let r = run(Command::new("setfacl").args(["-m", "u:nobody:r", g]));
    assert_eq!(r.code, 0, "setfacl -m u:nobody:r failed: {r}");
    let acl = run(Command::new("getfacl").args(["-c", g]));
    assert!(
        acl.stdout.contains("user:nobody:r--"),
        "getfacl does not show the entry: {acl}"
    );
    let (ok, out) = as_nobody(&["cat", g]);
    assert!(ok, "ACL user:nobody:r is not enforced (read denied): {out}");
    assert!(
        !as_nobody(&["sh", "-c", &format!("echo x >> {g}")]).0,
        "ACL grants read only, but write was allowed"
    );

    // 2. A user ACL entry denies access that the mode bits (other::r) would allow.
    let denied = m.p("denied");
    std::fs::write(&denied, b"public?\n").expect("write");
    std::fs::set_permissions(&denied, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let dn = denied.to_str().expect("utf8");
    let r = run(Command::new("setfacl").args(["-m", "u:nobody:---", dn]));
    assert_eq!(r.code, 0, "setfacl -m u:nobody:--- failed: {r}");
    assert!(
        !as_nobody(&["cat", dn]).0,
        "ACL user:nobody:--- is not enforced: nobody could read"
    );
    let other = run(Command::new("setpriv").args([
        "--reuid=65533",
        "--regid=65533",
        "--clear-groups",
        "--",
        "cat",
        dn,
    ]));
    assert_eq!(other.code, 0, "other users keep other::r access: {other}");

    // 3. Default ACL on a directory is inherited by new files.
    let dir = m.p("inherit");
    std::fs::create_dir(&dir).expect("mkdir");
    let ds = dir.to_str().expect("utf8");
    let r = run(Command::new("setfacl").args(["-d", "-m", "u:nobody:rw", ds]));
    assert_eq!(r.code, 0, "setfacl -d failed: {r}");
    std::fs::write(dir.join("child"), b"c").expect("write child");
    let acl = run(Command::new("getfacl").args(["-c"]).arg(dir.join("child")));
    assert!(
        acl.stdout.contains("user:nobody:rw-"),
        "default ACL not inherited: {acl}"
    );

    m.unmount();
    // ACLs persist.
    let m = Mount::new(&lun, "acl");
    let acl = run(Command::new("getfacl").args(["-c", g]));
    assert!(
        acl.stdout.contains("user:nobody:r--"),
        "ACL lost on remount: {acl}"
    );
    assert!(as_nobody(&["cat", g]).0, "ACL not enforced after remount");
    m.unmount();
    lun.assert_fsck_clean();
}
