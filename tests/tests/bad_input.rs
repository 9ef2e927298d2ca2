//! Hostile and mistaken inputs: mkfs over another filesystem, mounting garbage, damaged
//! superblocks (fallback to the backup), and fsck of a damaged volume.

use cetrafs_core::format::superblock::Superblock;
use cetrafs_core::format::FS_BLOCK;
use cetrafs_tests::{bin, lstat, mount_fstype, require_fuse, run, Lun, Mount};
use std::process::Command;

const LUN_SIZE: u64 = 2 << 30;

fn superblock(lun: &Lun, at: u64) -> Result<Superblock, String> {
    Superblock::decode(&lun.peek(at, 4096)).map_err(|e| e.to_string())
}

fn backup_offset(lun: &Lun) -> u64 {
    (lun.size() / FS_BLOCK - 1) * FS_BLOCK
}

/// The mount must fail with a one-line, non-empty error, and leave nothing mounted.
fn assert_mount_fails(lun: &Lun, expect_words: &[&str]) -> String {
    let mp = lun.dir().join("mnt-bad");
    let r = match Mount::try_new(lun.path(), &mp, "bad", &[]) {
        Ok(m) => {
            drop(m);
            panic!(
                "mounting {} succeeded but should have failed",
                lun.path().display()
            );
        }
        Err(r) => r,
    };
    assert_ne!(r.code, 0);
    assert!(
        mount_fstype(&mp).is_none(),
        "a failed mount left {} mounted",
        mp.display()
    );
    // The daemon's own stderr: exactly one line (the log file is appended after a marker).
    let own = r.own_stderr();
    let lines: Vec<&str> = own.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected a one-line error, got:\n{own}");
    let lower = own.to_lowercase();
    assert!(
        expect_words.iter().any(|w| lower.contains(w)),
        "error '{own}' should mention one of {expect_words:?}"
    );
    own
}

#[test]
fn mkfs_refuses_ext4_without_force() {
    require_fuse!();
    let lun = Lun::new(LUN_SIZE);
    let r = run(Command::new("mkfs.ext4").args(["-F", "-q"]).arg(lun.path()));
    assert_eq!(r.code, 0, "mkfs.ext4: {r}");
    let ext4_sb = lun.peek(1024, 1024);
    let r = lun.try_mkfs(&["-q"]);
    assert_eq!(r.code, 1, "mkfs over ext4 without --force must exit 1: {r}");
    assert!(
        r.output().to_lowercase().contains("ext4"),
        "message should name ext4: {r}"
    );
    assert_eq!(
        lun.peek(1024, 1024),
        ext4_sb,
        "a refused mkfs must not touch the device"
    );
    let r = lun.try_mkfs(&["-q", "--force"]);
    assert_eq!(r.code, 0, "mkfs --force over ext4: {r}");
    // And the result is a working, clean volume.
    let m = Mount::new(&lun, "after-ext4");
    std::fs::write(m.p("hello"), b"world").expect("write");
    m.unmount();
    lun.assert_fsck_clean();
    // A CetraFS is an existing signature too.
    let r = lun.try_mkfs(&["-q"]);
    assert_eq!(
        r.code, 1,
        "mkfs over an existing CetraFS without --force must exit 1: {r}"
    );
    assert!(
        superblock(&lun, 0).is_ok(),
        "the refused mkfs damaged the volume"
    );
}

#[test]
fn mount_of_zeroed_file_fails_cleanly() {
    require_fuse!();
    let lun = Lun::new(LUN_SIZE);
    let msg = assert_mount_fails(&lun, &["superblock", "cetrafs", "magic"]);
    eprintln!("zeroed device: {msg}");
    // A missing device too.
    let missing = lun.dir().join("does-not-exist.img");
    let r = Mount::try_new(&missing, &lun.dir().join("mnt-missing"), "bad", &[])
        .expect_err("mount of a missing file");
    let own = r.own_stderr();
    assert_eq!(
        own.lines().count(),
        1,
        "one-line error for a missing device: {own}"
    );
    // fsck of a zeroed device is not a clean filesystem.
    let f = lun.fsck();
    assert!(
        f.code == 4 || f.code == 8,
        "fsck -n of a zeroed device must fail (4 or 8): {f}"
    );
}

#[test]
fn damaged_primary_superblock_falls_back_to_backup() {
    require_fuse!();
    let lun = Lun::new(LUN_SIZE);
    lun.mkfs(&["-q", "-L", "fallback"]);
    let m = Mount::new(&lun, "n1");
    std::fs::write(m.p("before"), b"written before the damage").expect("write");
    m.unmount();
    lun.assert_fsck_clean();

    // Flip bytes inside the primary (keep the magic, so it is "a damaged CetraFS").
    let mut sb = lun.peek(0, 4096);
    sb[200] ^= 0xff;
    sb[1000] ^= 0x55;
    lun.poke(0, &sb);
    assert!(
        superblock(&lun, 0).is_err(),
        "the primary should now be invalid"
    );
    assert!(
        superblock(&lun, backup_offset(&lun)).is_ok(),
        "the backup must still be valid"
    );

    let m = Mount::new(&lun, "n1");
    assert_eq!(
        std::fs::read(m.p("before")).expect("read after fallback"),
        b"written before the damage"
    );
    std::fs::write(m.p("after"), b"written on the backup").expect("write");
    m.unmount();
    // fsck -n agrees with the on-disk state: clean if the mount repaired the primary,
    // errors (4) if the primary is still damaged.
    let f = lun.fsck();
    match superblock(&lun, 0) {
        Ok(_) => assert_eq!(f.code, 0, "primary repaired but fsck is not clean: {f}"),
        Err(e) => {
            eprintln!("NOTE: mount did not repair the primary superblock ({e})");
            assert_eq!(
                f.code, 4,
                "damaged primary superblock: fsck -n must report errors (4): {f}"
            );
        }
    }
    // Remount still works and sees both files.
    let m = Mount::new(&lun, "n1");
    assert!(lstat(&m.p("before")).is_ok() && lstat(&m.p("after")).is_ok());
    m.unmount();

    // Both copies damaged: the mount fails with a clear message.
    let mut b = lun.peek(backup_offset(&lun), 4096);
    b[300] ^= 0xff;
    lun.poke(backup_offset(&lun), &b);
    let mut p = lun.peek(0, 4096);
    p[300] ^= 0xff;
    lun.poke(0, &p);
    let msg = assert_mount_fails(&lun, &["superblock"]);
    eprintln!("both superblocks damaged: {msg}");
    let f = lun.fsck();
    assert!(
        f.code == 4 || f.code == 8,
        "fsck -n with both superblocks damaged must fail: {f}"
    );
}

#[test]
fn fsck_detects_corruption() {
    require_fuse!();
    let lun = Lun::new(LUN_SIZE);
    lun.mkfs(&["-q"]);
    let m = Mount::new(&lun, "n1");
    std::fs::create_dir(m.p("dir")).expect("mkdir");
    for i in 0..20u8 {
        std::fs::write(m.p(format!("dir/f{i}")), vec![i; 10_000]).expect("write");
    }
    let ino = lstat(&m.p("dir/f7")).expect("stat").st_ino;
    m.unmount();
    lun.assert_fsck_clean();
    // Damage one file's inode block (the inode number is its block number): fsck must say 4.
    let off = ino * FS_BLOCK + 64; // inside the inode body (the size field)
    let mut b = lun.peek(off, 8);
    b[0] ^= 0x5a;
    lun.poke(off, &b);
    let f = lun.fsck();
    assert_eq!(
        f.code, 4,
        "fsck -n of a volume with a damaged inode must exit 4: {f}"
    );
    // And fsck -n did not modify anything (read-only mode).
    assert_eq!(lun.peek(off, 8), b, "fsck -n wrote to the device");
    let out = run(Command::new(bin("fsck-cetra")).arg("-n").arg(lun.path()));
    assert_eq!(out.code, 4, "fsck -n is repeatable: {out}");
}

/// A damaged inode never hides its directory entry: `readdir` (readdirplus through the
/// kernel), `ls` and `find` list it, `stat` of it is EIO, and the daemon log names it. A file
/// whose extent was re-checksummed to point at the superblock is EIO, and the superblock is
/// neither served nor overwritten.
#[test]
fn damaged_inodes_stay_listed_and_bad_extents_are_eio() {
    use cetrafs_core::format::inode::Inode;
    require_fuse!();
    let lun = Lun::new(LUN_SIZE);
    lun.mkfs(&["-q"]);
    let m = Mount::new(&lun, "n1");
    std::fs::create_dir_all(m.p("dir/sub")).expect("mkdir");
    for i in 0..20u8 {
        std::fs::write(m.p(format!("dir/f{i}")), vec![i; 10_000]).expect("write");
    }
    std::fs::write(m.p("dir/sub/inner"), b"x").expect("write");
    let broken = lstat(&m.p("dir/f7")).expect("stat").st_ino;
    let subdir = lstat(&m.p("dir/sub")).expect("stat").st_ino;
    let redirected = lstat(&m.p("dir/f3")).expect("stat").st_ino;
    m.unmount();
    // f7 and sub: checksum broken. f3: a valid inode whose extent names block 0.
    for ino in [broken, subdir] {
        let off = ino * FS_BLOCK + 64;
        let mut b = lun.peek(off, 8);
        b[0] ^= 0x5a;
        lun.poke(off, &b);
    }
    let mut i = Inode::decode(&lun.peek(redirected * FS_BLOCK, 4096), redirected).expect("inode");
    i.inline_extents[0].physical = 0;
    lun.poke(redirected * FS_BLOCK, &i.encode());
    let sb_before = lun.peek(0, 4096);

    let mut m = Mount::new(&lun, "n1");
    // The damage this test makes is reported as ERROR (an admin must run fsck).
    m.allow_error("checksum mismatch")
        .allow_error("refusing to use it (run fsck.cetra)");
    let mut names: Vec<String> = std::fs::read_dir(m.p("dir"))
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut want: Vec<String> = (0..20).map(|i| format!("f{i}")).collect();
    want.push("sub".into());
    want.sort();
    assert_eq!(names, want, "readdir must list every entry");
    let ls = run(Command::new("ls").arg("-1").arg(m.p("dir")));
    for n in ["f7", "sub", "f3"] {
        assert!(
            ls.stdout.lines().any(|l| l == n),
            "ls does not list {n}: {ls}"
        );
    }
    let find = run(Command::new("find").arg(m.p("dir")));
    assert!(find.stdout.contains("/dir/f7"), "find: {find}");
    for n in ["dir/f7", "dir/sub", "dir/f3"] {
        let e = lstat(&m.p(n)).expect_err(n);
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "stat {n}: {e}");
    }
    let e = std::fs::read(m.p("dir/f3")).expect_err("read of a redirected extent");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "read f3: {e}");
    let e = std::fs::OpenOptions::new()
        .write(true)
        .open(m.p("dir/f3"))
        .expect_err("write open of a redirected extent");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "open f3: {e}");
    // The healthy neighbours still work.
    assert_eq!(
        std::fs::read(m.p("dir/f8")).expect("read f8"),
        vec![8u8; 10_000]
    );
    let log = m.log();
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("\"f7\"") && l.contains("cannot be read")),
        "no warning names f7:\n{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains(&format!("inode {redirected}")) && l.contains("block 0")),
        "no message names the bad extent:\n{log}"
    );
    m.unmount();
    assert_eq!(lun.peek(0, 4096), sb_before, "the superblock was written");
    let f = lun.fsck();
    assert_eq!(f.code, 4, "fsck must report the damage: {f}");
    assert!(f.output().contains("superblock"), "{f}");
}

/// Format version 5 (3's object-lock buckets and mailboxes, 4's sharing mode, online grow):
/// mkfs places them (and says so), fsck of the fresh volume is clean, a damaged bucket and a
/// stale lock are errors (exit 4), `--format-version 4` makes a volume that cannot grow, `3`
/// one that records no sharing mode, and `2` still a version-2 volume without object locks.
#[test]
fn fsck_checks_the_object_lock_area() {
    use cetrafs_core::format::object_lock::{Bucket, Entry, Mention, Role};
    let lun = Lun::new(LUN_SIZE);
    let out = lun.mkfs(&[]);
    assert!(out.stdout.contains("format version:     8"), "{out}");
    assert!(out.stdout.contains("can grow to:"), "{out}");
    assert!(
        out.stdout.contains("object locks:       8192 buckets"),
        "{out}"
    );
    assert!(out.stdout.contains("recorded: single-host"), "{out}");
    let sb = superblock(&lun, 0).expect("superblock");
    assert_eq!(sb.format_version(), 8);
    assert!(sb.has_group_marks() && sb.has_group_claims());
    assert_eq!(
        sb.sharing,
        Some(cetrafs_core::format::superblock::SharingMode::SingleHost)
    );
    assert!(
        lun.fsck()
            .stdout
            .contains("format version 8, sharing mode single-host"),
        "fsck prints the recorded mode"
    );
    let area = sb.object_lock_area().expect("v3 has an object-lock area");
    assert_eq!(area.buckets, 8192, "2 GiB / 256 KiB");
    lun.assert_fsck_clean();

    // One flipped byte in bucket 17 (512-byte logical blocks).
    let at = area.bucket_offset + 17 * 512;
    let good = lun.peek(at, 512);
    let mut bad = good.clone();
    bad[44] ^= 0x01;
    lun.poke(at, &bad);
    let f = lun.fsck();
    assert_eq!(f.code, 4, "a damaged bucket is an error: {f}");
    assert!(f.stdout.contains("object-lock bucket 17 is damaged"), "{f}");
    lun.poke(at, &good);
    lun.assert_fsck_clean();

    // Bucket 17 holding an exclusive lock of slot 3, which never mounted: a stale lock.
    let mut b = Bucket::empty(17);
    #[expect(
        clippy::maybe_infinite_iter,
        reason = "the hash spreads consecutive numbers over every bucket: found within a few bucket counts"
    )]
    let obj = (1u64..)
        .map(|ino| cetrafs_core::cluster::object_lock::ObjectId::inode(ino).expect("ino"))
        .find(|&o| area.bucket_of(o) == 17)
        .expect("an inode hashing to bucket 17");
    let mut e = Entry::new(obj.raw(), 5);
    e.mentions.push(Mention {
        slot: 3,
        role: Role::Owner,
        gen: 2,
    });
    b.entries.push(e);
    lun.poke(at, &b.encode(512).expect("encode"));
    let f = lun.fsck();
    assert_eq!(f.code, 4, "a stale exclusive lock is an error: {f}");
    assert!(
        f.stdout.contains("stale owner slot 3 (generation 2)"),
        "{f}"
    );
    lun.poke(at, &good);
    lun.assert_fsck_clean();

    // Version 7 on request: group marks, no group claims; still clean.
    let out = lun.mkfs(&["-f", "--format-version", "7"]);
    assert!(out.stdout.contains("format version:     7"), "{out}");
    let sb = superblock(&lun, 0).expect("superblock");
    assert_eq!(
        (
            sb.format_version(),
            sb.has_group_marks(),
            sb.has_group_claims()
        ),
        (7, true, false)
    );
    lun.assert_fsck_clean();

    // Version 5 on request: online grow, no group marks; still clean.
    let out = lun.mkfs(&["-f", "--format-version", "5"]);
    assert!(out.stdout.contains("format version:     5"), "{out}");
    let sb = superblock(&lun, 0).expect("superblock");
    assert_eq!((sb.format_version(), sb.can_grow()), (5, true));
    assert!(!sb.has_group_marks());
    lun.assert_fsck_clean();

    // Version 4 on request: the sharing mode, no online grow; still clean.
    let out = lun.mkfs(&["-f", "--format-version", "4"]);
    assert!(out.stdout.contains("format version:     4"), "{out}");
    assert!(!out.stdout.contains("can grow to:"), "{out}");
    let sb = superblock(&lun, 0).expect("superblock");
    assert_eq!((sb.format_version(), sb.can_grow()), (4, false));
    lun.assert_fsck_clean();

    // Version 3 on request: the object-lock area, no sharing mode; still clean.
    let out = lun.mkfs(&["-f", "--format-version", "3"]);
    assert!(out.stdout.contains("format version:     3"), "{out}");
    assert!(out.stdout.contains("not recorded (format 3"), "{out}");
    let sb = superblock(&lun, 0).expect("superblock");
    assert_eq!((sb.format_version(), sb.sharing), (3, None));
    assert!(sb.object_lock_area().is_some());
    lun.assert_fsck_clean();
    let f = lun.fsck();
    assert!(
        f.stdout
            .contains("format version 3, sharing mode not recorded"),
        "{f}"
    );

    // Version 2 on request: no object-lock area, and still clean.
    let out = lun.mkfs(&["-f", "--format-version", "2"]);
    assert!(out.stdout.contains("format version:     2"), "{out}");
    assert!(!out.stdout.contains("object locks"), "{out}");
    let sb = superblock(&lun, 0).expect("superblock");
    assert_eq!(sb.format_version(), 2);
    assert!(sb.object_lock_area().is_none());
    lun.assert_fsck_clean();
    let bad = lun.try_mkfs(&["-f", "--format-version", "6"]);
    assert_ne!(bad.code, 0, "{bad}");
}
