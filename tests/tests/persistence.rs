//! Everything written must come back identical after umount + mount: file contents of awkward
//! sizes, directories, hard links, symlinks, fifos, device nodes, xattrs, modes, owners,
//! nanosecond timestamps, the immutable flag; ctime/mtime rules; and a 100,000-entry directory.

use cetrafs_tests::{
    cstr, have_command, list_xattrs, lstat, require_fuse, run, secs, seed, set_xattr, Lun, Mount,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

/// What we compare for each path.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Snap {
    mode: u32,
    uid: u32,
    gid: u32,
    nlink: u64,
    size: i64,
    rdev: u64,
    ino: u64,
    atime: (i64, i64),
    mtime: (i64, i64),
    ctime: (i64, i64),
    content: Option<Vec<u8>>,
    target: Option<PathBuf>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

fn snap_tree(root: &Path) -> BTreeMap<PathBuf, Snap> {
    let mut out = BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let abs = root.join(&rel);
        let st = lstat(&abs).unwrap_or_else(|e| panic!("lstat {}: {e}", abs.display()));
        let fmt = st.st_mode & libc::S_IFMT;
        let content = (fmt == libc::S_IFREG)
            .then(|| std::fs::read(&abs).unwrap_or_else(|e| panic!("read {}: {e}", abs.display())));
        let target = (fmt == libc::S_IFLNK).then(|| std::fs::read_link(&abs).expect("readlink"));
        let xattrs =
            list_xattrs(&abs).unwrap_or_else(|e| panic!("listxattr {}: {e}", abs.display()));
        if fmt == libc::S_IFDIR {
            for e in std::fs::read_dir(&abs).expect("readdir") {
                stack.push(rel.join(e.expect("entry").file_name()));
            }
        }
        out.insert(
            rel,
            Snap {
                mode: st.st_mode,
                uid: st.st_uid,
                gid: st.st_gid,
                nlink: st.st_nlink,
                size: st.st_size,
                rdev: st.st_rdev,
                ino: st.st_ino,
                atime: (st.st_atime, st.st_atime_nsec),
                mtime: (st.st_mtime, st.st_mtime_nsec),
                ctime: (st.st_ctime, st.st_ctime_nsec),
                content,
                target,
                xattrs,
            },
        );
    }
    out
}

fn c(p: &Path) -> std::ffi::CString {
    cstr(p)
}

fn check(r: libc::c_int, what: &str) {
    assert!(r == 0, "{what}: {}", std::io::Error::last_os_error());
}

fn set_times(p: &Path, atime: (i64, i64), mtime: (i64, i64)) {
    let ts = [
        libc::timespec {
            tv_sec: atime.0,
            tv_nsec: atime.1,
        },
        libc::timespec {
            tv_sec: mtime.0,
            tv_nsec: mtime.1,
        },
    ];
    // SAFETY: valid C string and a two-element timespec array.
    check(
        unsafe {
            libc::utimensat(
                libc::AT_FDCWD,
                c(p).as_ptr(),
                ts.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        },
        &format!("utimensat {}", p.display()),
    );
}

/// Wait until the wall clock is past `t` plus a margin, so the next change gets a later time.
fn clock_past(t: (i64, i64)) {
    let target = Duration::new(t.0.cast_unsigned(), u32::try_from(t.1).unwrap_or(0))
        + Duration::from_millis(5);
    while SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("clock")
        <= target
    {
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn times(p: &Path) -> ((i64, i64), (i64, i64)) {
    let st = lstat(p).expect("lstat");
    (
        (st.st_mtime, st.st_mtime_nsec),
        (st.st_ctime, st.st_ctime_nsec),
    )
}

/// Try `chattr +i`; Ok(true) if the flag took effect, Ok(false) if unsupported here.
fn try_immutable(p: &Path) -> bool {
    if !have_command("chattr") {
        eprintln!("persistence: chattr not installed; immutable flag not tested");
        return false;
    }
    let r = run(Command::new("chattr").arg("+i").arg(p));
    if r.code != 0 {
        eprintln!(
            "persistence: NOTE chattr +i not supported through this mount: {}",
            r.output().trim()
        );
        return false;
    }
    true
}

fn has_immutable(p: &Path) -> bool {
    let r = run(Command::new("lsattr").arg("-d").arg(p));
    assert_eq!(r.code, 0, "lsattr: {r}");
    r.stdout
        .split_whitespace()
        .next()
        .is_some_and(|f| f.contains('i'))
}

#[test]
fn everything_survives_remount() {
    require_fuse!();
    let seed = seed("persistence");
    let mut rng = StdRng::seed_from_u64(seed);
    let lun = Lun::new(4 << 30);
    lun.mkfs(&["-q"]);
    let m = Mount::new(&lun, "persist");

    // Files of awkward sizes with random contents.
    std::fs::create_dir(m.p("files")).expect("mkdir");
    for size in [
        0usize,
        1,
        511,
        4095,
        4096,
        4097,
        65536,
        (1 << 20) + 3,
        20 << 20,
    ] {
        let mut data = vec![0u8; size];
        rng.fill(&mut data[..]);
        std::fs::write(m.p(format!("files/f{size}")), &data).expect("write file");
    }
    // Nested directories, hard links, symlinks.
    std::fs::create_dir_all(m.p("d1/d2/d3/d4")).expect("mkdir -p");
    std::fs::write(m.p("d1/d2/linked"), b"hard linked content").expect("write");
    std::fs::hard_link(m.p("d1/d2/linked"), m.p("d1/link2")).expect("link");
    std::fs::hard_link(m.p("d1/d2/linked"), m.p("d1/d2/d3/d4/link3")).expect("link");
    std::os::unix::fs::symlink("d2/linked", m.p("d1/rel-symlink")).expect("symlink");
    std::os::unix::fs::symlink("/absolute/dangling/target", m.p("dangling")).expect("symlink");
    let long_target: String = "t/".repeat(1000) + "end";
    std::os::unix::fs::symlink(&long_target, m.p("long-symlink")).expect("long symlink");
    // fifo, device nodes, socket node.
    // SAFETY: valid C strings.
    unsafe {
        check(libc::mkfifo(c(&m.p("fifo")).as_ptr(), 0o640), "mkfifo");
        check(
            libc::mknod(
                c(&m.p("null-chr")).as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(1, 3),
            ),
            "mknod chr",
        );
        check(
            libc::mknod(
                c(&m.p("loop-blk")).as_ptr(),
                libc::S_IFBLK | 0o660,
                libc::makedev(7, 200),
            ),
            "mknod blk",
        );
        check(
            libc::mknod(c(&m.p("sock")).as_ptr(), libc::S_IFSOCK | 0o600, 0),
            "mknod sock",
        );
    }
    // xattrs: user.* and trusted.*, small and large, empty value.
    let big: Vec<u8> = (0..3000).map(|_| rng.gen()).collect();
    set_xattr(&m.p("files/f4096"), b"user.small", b"v", 0).expect("setxattr");
    set_xattr(&m.p("files/f4096"), b"user.empty", b"", 0).expect("setxattr empty");
    set_xattr(&m.p("files/f4096"), b"trusted.big", &big, 0).expect("setxattr trusted");
    set_xattr(&m.p("d1"), b"user.dir", b"on a directory", 0).expect("setxattr dir");
    set_xattr(&m.p("d1/d2/linked"), b"trusted.overlay.x", b"y", 0).expect("setxattr");
    // Modes (incl. setuid/setgid/sticky), owners, nanosecond times.
    let modes = [
        ("files/f1", 0o4755),
        ("files/f511", 0o2711),
        ("d1/d2", 0o1777),
        ("files/f0", 0o000),
        ("fifo", 0o604),
    ];
    for (p, mode) in modes {
        // SAFETY: valid C string.
        check(unsafe { libc::chmod(c(&m.p(p)).as_ptr(), mode) }, "chmod");
    }
    // SAFETY: valid C strings.
    unsafe {
        check(
            libc::lchown(c(&m.p("files/f4095")).as_ptr(), 1234, 5678),
            "chown",
        );
        check(
            libc::lchown(c(&m.p("d1/rel-symlink")).as_ptr(), 4321, 8765),
            "lchown symlink",
        );
        check(
            libc::lchown(c(&m.p("d1/d2/d3")).as_ptr(), 65534, 65534),
            "chown dir",
        );
    }
    // Times: atime in the future (relatime will not touch it), mtime in the past, odd nanos.
    let t_atime = (2_000_000_000, 123_456_789);
    let t_mtime = (1_000_000_000, 987_654_321);
    set_times(&m.p("files/f4097"), t_atime, t_mtime);
    set_times(
        &m.p("d1/d2/d3/d4"),
        (2_000_000_001, 1),
        (1_500_000_000, 999_999_999),
    );
    set_times(&m.p("dangling"), (2_000_000_002, 5), (1_200_000_000, 42));
    let st = lstat(&m.p("files/f4097")).expect("lstat");
    assert_eq!((st.st_atime, st.st_atime_nsec), t_atime, "atime as set");
    assert_eq!((st.st_mtime, st.st_mtime_nsec), t_mtime, "mtime as set");

    // Immutable flag if the mount supports it.
    std::fs::write(m.p("immutable"), b"frozen").expect("write");
    let immutable = try_immutable(&m.p("immutable"));
    if immutable {
        assert!(
            has_immutable(&m.p("immutable")),
            "lsattr shows no 'i' after chattr +i"
        );
        let e = std::fs::OpenOptions::new()
            .write(true)
            .open(m.p("immutable"))
            .expect_err("write to immutable file");
        assert_eq!(
            e.raw_os_error(),
            Some(libc::EPERM),
            "open for write of an immutable file: {e}"
        );
        let e = std::fs::remove_file(m.p("immutable")).expect_err("unlink immutable file");
        assert_eq!(
            e.raw_os_error(),
            Some(libc::EPERM),
            "unlink of an immutable file: {e}"
        );
    }

    // ctime rules (checked before the snapshot, on a scratch file).
    let f = m.p("ctime-rules");
    std::fs::write(&f, b"x").expect("write");
    let (mt0, ct0) = times(&f);
    clock_past(ct0);
    // SAFETY: valid C string.
    check(unsafe { libc::chmod(c(&f).as_ptr(), 0o600) }, "chmod");
    let (mt1, ct1) = times(&f);
    assert_eq!(mt1, mt0, "chmod must not change mtime");
    assert!(ct1 > ct0, "chmod must bump ctime: {ct0:?} -> {ct1:?}");
    clock_past(ct1);
    {
        use std::io::Write;
        let mut h = std::fs::OpenOptions::new()
            .append(true)
            .open(&f)
            .expect("open");
        h.write_all(b"more").expect("append");
    }
    let (mt2, ct2) = times(&f);
    assert!(
        mt2 > mt1 && ct2 > ct1,
        "write must bump mtime and ctime: m {mt1:?}->{mt2:?} c {ct1:?}->{ct2:?}"
    );
    clock_past(ct2);
    // SAFETY: valid C string.
    check(unsafe { libc::chown(c(&f).as_ptr(), 7, 7) }, "chown");
    let (mt3, ct3) = times(&f);
    assert!(
        mt3 == mt2 && ct3 > ct2,
        "chown bumps ctime only: m {mt2:?}->{mt3:?} c {ct2:?}->{ct3:?}"
    );
    clock_past(ct3);
    set_xattr(&f, b"user.k", b"v", 0).expect("setxattr");
    let (mt4, ct4) = times(&f);
    assert!(
        mt4 == mt3 && ct4 > ct3,
        "setxattr bumps ctime only: m {mt3:?}->{mt4:?} c {ct3:?}->{ct4:?}"
    );
    clock_past(ct4);
    std::fs::hard_link(&f, m.p("ctime-rules-link")).expect("link");
    let (mt5, ct5) = times(&f);
    assert!(
        mt5 == mt4 && ct5 > ct4,
        "link bumps ctime only: m {mt4:?}->{mt5:?} c {ct4:?}->{ct5:?}"
    );
    clock_past(ct5);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .expect("open")
        .set_len(1)
        .expect("truncate");
    let (mt6, ct6) = times(&f);
    assert!(
        mt6 > mt5 && ct6 > ct5,
        "truncate bumps mtime and ctime: m {mt5:?}->{mt6:?} c {ct5:?}->{ct6:?}"
    );
    // Directory mtime/ctime change on entry creation.
    let (dm0, dc0) = times(&m.p("d1"));
    clock_past(dc0.max(dm0));
    std::fs::write(m.p("d1/new-entry"), b"").expect("create");
    let (dm1, dc1) = times(&m.p("d1"));
    assert!(
        dm1 > dm0 && dc1 > dc0,
        "creating an entry bumps the directory's mtime and ctime"
    );

    // Read everything once (relatime may update atimes on first read), then snapshot.
    let _ = snap_tree(m.path());
    let before = snap_tree(m.path());
    assert!(before.len() > 25, "snapshot too small: {}", before.len());
    let root_ino = before[Path::new("")].ino;
    m.unmount();
    lun.assert_fsck_clean();

    let m = Mount::new(&lun, "persist");
    let after = snap_tree(m.path());
    let keys_b: BTreeSet<_> = before.keys().collect();
    let keys_a: BTreeSet<_> = after.keys().collect();
    assert_eq!(keys_a, keys_b, "set of paths after remount");
    for (p, b) in &before {
        let a = &after[p];
        assert!(
            a == b,
            "/{} differs after remount:\nbefore {b:?}\nafter  {a:?}",
            p.display()
        );
    }
    assert_eq!(after[Path::new("")].ino, root_ino);
    let st = lstat(&m.p("files/f4097")).expect("lstat");
    assert_eq!(
        (
            (st.st_atime, st.st_atime_nsec),
            (st.st_mtime, st.st_mtime_nsec)
        ),
        (t_atime, t_mtime)
    );
    let st = lstat(&m.p("null-chr")).expect("lstat");
    assert_eq!(
        (libc::major(st.st_rdev), libc::minor(st.st_rdev)),
        (1, 3),
        "char device numbers"
    );
    let st = lstat(&m.p("loop-blk")).expect("lstat");
    assert_eq!(
        (libc::major(st.st_rdev), libc::minor(st.st_rdev)),
        (7, 200),
        "block device numbers"
    );
    assert_eq!(
        std::fs::read_link(m.p("long-symlink")).expect("readlink"),
        Path::new(&long_target)
    );
    assert_eq!(
        std::fs::read(m.p("d1/d2/d3/d4/link3")).expect("read via link"),
        b"hard linked content"
    );
    if immutable {
        assert!(
            has_immutable(&m.p("immutable")),
            "immutable flag lost on remount"
        );
        let e = std::fs::OpenOptions::new()
            .write(true)
            .open(m.p("immutable"))
            .expect_err("write to immutable file");
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        assert_eq!(
            run(Command::new("chattr").arg("-i").arg(m.p("immutable"))).code,
            0,
            "chattr -i"
        );
        std::fs::remove_file(m.p("immutable")).expect("unlink after chattr -i");
    }
    m.unmount();
    lun.assert_fsck_clean();
}

/// 100,000 entries in one directory: create, random lookups, readdir count, unlink half,
/// readdir again, remount, readdir again. Reports timings.
#[test]
fn large_directory() {
    const N: usize = 100_000;
    require_fuse!();
    let seed = seed("large_directory");
    let mut rng = StdRng::seed_from_u64(seed);
    let lun = Lun::new(4 << 30);
    lun.mkfs(&["-q"]);
    let m = Mount::new(&lun, "bigdir");
    let dir = m.p("big");
    std::fs::create_dir(&dir).expect("mkdir");
    let name = |i: usize| format!("entry-{i:06}-{}", i.wrapping_mul(2_654_435_761) % 9973);

    let t_all = Instant::now();
    let t = Instant::now();
    for i in 0..N {
        let p = c(&dir.join(name(i)));
        // SAFETY: valid C string.
        let r = unsafe { libc::mknod(p.as_ptr(), libc::S_IFREG | 0o644, 0) };
        assert!(
            r == 0,
            "mknod entry {i}: {}",
            std::io::Error::last_os_error()
        );
    }
    let t_create = t.elapsed();

    let t = Instant::now();
    for _ in 0..10_000 {
        let i = rng.gen_range(0..N);
        lstat(&dir.join(name(i))).unwrap_or_else(|e| panic!("lookup of entry {i}: {e}"));
        let missing = dir.join(format!("missing-{i}"));
        assert_eq!(
            lstat(&missing).map(|_| ()).map_err(|e| e.raw_os_error()),
            Err(Some(libc::ENOENT))
        );
    }
    let t_lookup = t.elapsed();

    let count_names = |d: &Path| -> HashSet<String> {
        std::fs::read_dir(d)
            .expect("readdir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect()
    };
    let t = Instant::now();
    let names = count_names(&dir);
    let t_readdir = t.elapsed();
    assert_eq!(names.len(), N, "readdir count after creating {N}");
    assert!(
        (0..N).all(|i| names.contains(&name(i))),
        "readdir lost names"
    );
    assert_eq!(lstat(&dir).expect("stat").st_nlink, 2);

    let t = Instant::now();
    for i in (0..N).step_by(2) {
        std::fs::remove_file(dir.join(name(i))).unwrap_or_else(|e| panic!("unlink entry {i}: {e}"));
    }
    let t_unlink = t.elapsed();
    let names = count_names(&dir);
    assert_eq!(names.len(), N / 2, "readdir count after unlinking half");
    assert!(
        (1..N).step_by(2).all(|i| names.contains(&name(i))),
        "survivors missing"
    );
    for _ in 0..2_000 {
        let i = rng.gen_range(0..N / 2) * 2;
        assert!(
            lstat(&dir.join(name(i))).is_err(),
            "unlinked entry {i} still found"
        );
    }
    m.unmount();
    let m = Mount::new(&lun, "bigdir");
    let names = count_names(&m.p("big"));
    assert_eq!(names.len(), N / 2, "readdir count after remount");
    m.unmount();
    lun.assert_fsck_clean();
    eprintln!(
        "large_directory: {N} creates {}, 10k+10k lookups {}, readdir {}, {} unlinks {}, total {}",
        secs(t_create),
        secs(t_lookup),
        secs(t_readdir),
        N / 2,
        secs(t_unlink),
        secs(t_all.elapsed())
    );
}
