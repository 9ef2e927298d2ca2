//! Size limits as Linux has them, through a real mount: symlink targets up to `PATH_MAX` - 1
//! (4095 bytes), xattr values up to `XATTR_SIZE_MAX` (64 KiB), several values that together span
//! more than one block; blocks come back when they go, and fsck is clean after unmount.

use cetrafs_tests::{
    cstr, get_xattr, list_xattrs, remove_xattr, require_fuse, run, set_xattr, statvfs, Lun, Mount,
};
use std::ffi::CString;
use std::path::Path;
use std::process::Command;

fn mounted(tag: &str) -> (Lun, Mount) {
    let lun = Lun::new(1 << 30);
    lun.mkfs(&["-q", "-N", "2"]);
    let m = Mount::new(&lun, tag);
    (lun, m)
}

fn free_blocks(p: &Path) -> u64 {
    statvfs(p).f_bfree
}

/// Free blocks once freed ones are released (they wait for the next commit point, ≤ 1 s):
/// polls until `want(free)` holds or 10 s pass; returns the last count.
fn free_blocks_when(p: &Path, want: impl Fn(u64) -> bool) -> u64 {
    let start = std::time::Instant::now();
    loop {
        let f = free_blocks(p);
        if want(f) || start.elapsed() > std::time::Duration::from_secs(10) {
            return f;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn target(n: usize) -> String {
    (0..n).map(|i| ['a', 'b', 'c', '/'][i % 4]).collect()
}

fn assert_no_error_lines(m: &Mount) {
    let log = m.log();
    assert!(
        !log.lines().any(|l| l.contains("ERROR")),
        "daemon log has ERROR lines:\n{log}"
    );
}

/// getxattr's size probe (size 0) and a too-small buffer, straight through libc.
fn getxattr_raw(p: &Path, name: &str, size: usize) -> Result<usize, i32> {
    let c = cstr(p);
    let n = CString::new(name).expect("name");
    let mut buf = vec![0u8; size];
    let ptr = if size == 0 {
        std::ptr::null_mut()
    } else {
        buf.as_mut_ptr().cast()
    };
    // SAFETY: valid C strings; `ptr` is null with size 0 or a buffer of `size` bytes.
    let r = unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), ptr, size) };
    usize::try_from(r).map_err(|_| std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
}

#[test]
fn symlink_of_path_max_minus_one() {
    require_fuse!();
    let (lun, m) = mounted("longlink");
    let free0 = free_blocks(m.path());
    let t = target(4095);
    let r = run(Command::new("ln").arg("-s").arg(&t).arg(m.p("long")));
    assert_eq!(r.code, 0, "ln -s of a 4095-byte target: {r}");
    assert_eq!(
        std::fs::read_link(m.p("long"))
            .expect("readlink")
            .as_os_str(),
        t.as_str()
    );
    let out = run(Command::new("readlink").arg(m.p("long")));
    assert_eq!(out.stdout.trim_end_matches('\n'), t);
    assert_eq!(
        std::fs::symlink_metadata(m.p("long")).expect("lstat").len(),
        4095
    );
    // 4096 bytes is past PATH_MAX (with its NUL): the kernel refuses it before we see it.
    let e = std::os::unix::fs::symlink(target(4096), m.p("toolong")).expect_err("4096 bytes");
    assert_eq!(e.raw_os_error(), Some(libc::ENAMETOOLONG));
    assert_no_error_lines(&m);
    m.unmount();
    lun.assert_fsck_clean();
    // It survives a remount, and removing it gives its blocks back.
    let m = Mount::new(&lun, "longlink2");
    assert_eq!(
        std::fs::read_link(m.p("long"))
            .expect("readlink")
            .as_os_str(),
        t.as_str()
    );
    std::fs::remove_file(m.p("long")).expect("unlink");
    let f = free_blocks_when(m.path(), |f| f + 1 >= free0);
    assert_eq!(
        f + 1,
        free0,
        "the symlink's inode and overflow block come back (the root's entry tree stays)"
    );
    assert_no_error_lines(&m);
    m.unmount();
    lun.assert_fsck_clean();
}

#[test]
fn xattr_value_of_64_kib() {
    require_fuse!();
    let (lun, m) = mounted("bigxattr");
    let f = m.p("f");
    std::fs::write(&f, b"x").expect("create");
    let free0 = free_blocks(m.path());
    let big: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    set_xattr(&f, b"user.big", &big, 0).expect("setxattr of 64 KiB");
    assert_eq!(get_xattr(&f, b"user.big").expect("getxattr"), big);
    assert_eq!(getxattr_raw(&f, "user.big", 0), Ok(65536), "size probe");
    assert_eq!(getxattr_raw(&f, "user.big", 1000), Err(libc::ERANGE));
    let e = set_xattr(&f, b"user.bigger", &vec![0; 65537], 0).expect_err("past XATTR_SIZE_MAX");
    assert_eq!(e.raw_os_error(), Some(libc::E2BIG));
    // More values: together far more than one block.
    for k in 0..4u8 {
        let name = format!("user.v{k}");
        set_xattr(&f, name.as_bytes(), &vec![k; 5000], 0).expect("setxattr");
    }
    let all = list_xattrs(&f).expect("listxattr");
    let names: Vec<&[u8]> = all.iter().map(|(n, _)| n.as_slice()).collect();
    assert_eq!(
        names,
        [
            &b"user.big"[..],
            b"user.v0",
            b"user.v1",
            b"user.v2",
            b"user.v3"
        ]
    );
    assert_eq!(all[2].1, vec![1; 5000]);
    assert!(
        free_blocks(m.path()) < free0 - 16,
        "the set spans many blocks"
    );
    m.unmount();
    lun.assert_fsck_clean();
    let m = Mount::new(&lun, "bigxattr2");
    let f = m.p("f");
    assert_eq!(
        get_xattr(&f, b"user.big").expect("getxattr after remount"),
        big
    );
    for name in ["user.big", "user.v0", "user.v1", "user.v2", "user.v3"] {
        remove_xattr(&f, name.as_bytes()).expect("removexattr");
    }
    assert!(list_xattrs(&f).expect("listxattr").is_empty());
    assert_eq!(
        free_blocks_when(m.path(), |f| f >= free0),
        free0,
        "every block of the set is free again"
    );
    assert_no_error_lines(&m);
    m.unmount();
    lun.assert_fsck_clean();
}
