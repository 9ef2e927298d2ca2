//! `fsck.cetra -p` / `-y` on real volumes (issue 11 §3, §4), with the corruption injector
//! (`cetrafs_core::check::wreck`).
//!
//! A volume populated through a real mount; for every injector case, on a sparse copy of it:
//! `fsck.cetra -n` exits 4, `fsck.cetra -y` exits 1, a second `fsck.cetra -n` exits 0, the
//! volume mounts, and every file the corruption did not touch reads back byte-identical (one
//! it unlinked is in `/lost+found`, byte-identical too; one whose blocks it gave away or
//! dropped is compared as its `Effect` says); `-p` exits 1 on a case marked preen
//! and 4 on one that is not (the unit test covers preen for every case).
//! Then fsck's claim: a mount started while `fsck.cetra -y` runs is refused, naming the fsck
//! host, and succeeds once fsck is done.

use cetrafs_core::check::wreck::{Effect, FileRole, CASES};
use cetrafs_core::dev::open::open_for_repair;
use cetrafs_tests::{bin, require_fuse, run, wait_until, Lun, Mount};
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The file with an extent tree (the bad-tree case damages a leaf of it): every other 4 KiB
/// block of 1.6 MB written, 200 extents (more than the 160 an inode holds).
const TREE_FILE: &str = "sparse";

/// Files written into the volume: name -> contents.
fn contents() -> BTreeMap<&'static str, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut sparse = vec![0u8; 399 * 4096];
    for (k, block) in sparse.chunks_mut(4096).enumerate().step_by(2) {
        block.fill(u8::try_from(k % 251).unwrap_or(0) + 1);
    }
    files.insert(TREE_FILE, sparse);
    for (name, len) in [
        ("small", 5000usize),
        ("medium", 70_000),
        ("one-mib", 1 << 20),
        ("three-mib", 3 << 20),
        ("dir/inner", 12),
    ] {
        let seed = name.len();
        files.insert(
            name,
            (0..len)
                .map(|j| u8::try_from((j * 7 + seed) % 253).unwrap_or(0))
                .collect(),
        );
    }
    files
}

/// The files of `dir/many` (a directory with a two-level entry tree; the bad-dir-tree case
/// damages a leaf of it): name, inode.
type Many = Vec<(String, u64)>;

/// Populate `lun` through a real mount; returns the inode numbers of `small` (the target)
/// and of `dir`, and the files of `dir/many`.
fn populate(lun: &Lun, files: &BTreeMap<&'static str, Vec<u8>>) -> (u64, u64, Many) {
    let m = Mount::new(lun, "node1");
    std::fs::create_dir(m.p("dir")).expect("mkdir dir");
    std::fs::create_dir(m.p("dir/many")).expect("mkdir dir/many");
    let many: Many = (0..150)
        .map(|i| {
            let name = format!("a-rather-long-name-that-fills-directory-tree-leaves-{i:03}");
            let path = m.p(format!("dir/many/{name}"));
            std::fs::write(&path, b"").expect("create a file in dir/many");
            (name, std::fs::metadata(&path).expect("stat").ino())
        })
        .collect();
    for (name, data) in files {
        if *name == TREE_FILE {
            write_sparse(&m.p(name), data);
        } else {
            std::fs::write(m.p(name), data).unwrap_or_else(|e| panic!("write {name}: {e}"));
        }
    }
    // The bad-symlink case damages it.
    std::os::unix::fs::symlink("small", m.p("link")).expect("symlink");
    // The bad-xattr case damages the target's xattr block.
    let small = std::ffi::CString::new(m.p("small").as_os_str().as_encoded_bytes()).expect("path");
    let value = [7u8; 300];
    // SAFETY: NUL-terminated path and name, a buffer of the length passed.
    let r = unsafe {
        libc::setxattr(
            small.as_ptr(),
            c"user.note".as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(r, 0, "setxattr: {}", std::io::Error::last_os_error());
    let ino = |p: &str| std::fs::metadata(m.p(p)).expect("stat").ino();
    let inos = (ino("small"), ino("dir"), many);
    m.unmount();
    inos
}

/// Every file of `dir/many` is in it, or (`DirPartInLostFound`) in `lost+found` as `#INO`.
fn many_intact(m: &Mount, what: &str, effect: Effect, dir: u64, many: &Many) {
    let base = if effect == Effect::DirInLostFound {
        format!("lost+found/#{dir}/many")
    } else {
        "dir/many".to_string()
    };
    let mut moved = 0;
    for (name, ino) in many {
        let at = m.p(format!("{base}/{name}"));
        let found = match std::fs::metadata(&at) {
            Ok(md) => md.ino(),
            Err(_) if effect == Effect::DirPartInLostFound => {
                moved += 1;
                let lf = m.p(format!("lost+found/#{ino}"));
                std::fs::metadata(&lf)
                    .unwrap_or_else(|e| panic!("{what}: #{ino} is not in lost+found: {e}"))
                    .ino()
            }
            Err(e) => panic!("{what}: {base}/{name}: {e}"),
        };
        assert_eq!(found, *ino, "{what}: {base}/{name}");
    }
    if effect == Effect::DirPartInLostFound {
        assert!(moved > 0 && moved < many.len(), "{what}: {moved} moved");
    }
}

/// Write the 4 KiB blocks of `data` that are not all zeros, one write each, leaving holes.
fn write_sparse(path: &Path, data: &[u8]) {
    use std::os::unix::fs::FileExt as _;
    let f =
        std::fs::File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    for (k, block) in (0u64..).zip(data.chunks(4096)) {
        if block.iter().any(|&b| b != 0) {
            f.write_all_at(block, k * 4096)
                .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        }
    }
    f.set_len(data.len() as u64).expect("set_len");
}

/// Where file `name` is after a repair of a case with `effect` (None: gone).
fn path_after(name: &str, effect: Effect, target: u64, dir: u64) -> Option<String> {
    match (effect, name) {
        (Effect::TargetGone, "small") => None,
        (Effect::TargetInLostFound, "small") => Some(format!("lost+found/#{target}")),
        (Effect::DirInLostFound, "dir/inner") => Some(format!("lost+found/#{dir}/inner")),
        _ => Some(name.to_string()),
    }
}

fn fsck(lun: &Path, flag: &str) -> (i32, String) {
    let r = run(Command::new(bin("fsck-cetra")).arg(flag).arg(lun));
    (r.code, r.output())
}

/// A sparse copy of the LUN file.
fn copy_of(lun: &Lun, name: &str) -> PathBuf {
    let to = lun.dir().join(name);
    let r = run(Command::new("cp")
        .arg("--sparse=always")
        .arg(lun.path())
        .arg(&to));
    assert_eq!(r.code, 0, "cp: {}", r.output());
    to
}

fn wreck(path: &Path, case: &str, target: u64) -> String {
    let dev = open_for_repair(path).expect("open the LUN copy for writing");
    cetrafs_core::check::wreck::apply(&dev, case, target)
        .unwrap_or_else(|e| panic!("injecting {case}: {e}"))
}

#[test]
fn fsck_repairs_every_injected_corruption_and_no_file_changes() {
    require_fuse!();
    let lun = Lun::new(1 << 30);
    lun.mkfs(&["-N", "4"]);
    let files = contents();
    let (target, dir, many) = populate(&lun, &files);
    let mut cases = 0;
    for case in CASES {
        let copy = copy_of(&lun, &format!("{}.img", case.name));
        let what = wreck(&copy, case.name, target);
        let (code, out) = fsck(&copy, "-n");
        assert_eq!(code, 4, "{what}: fsck -n before repair: {out}");
        if matches!(case.name, "used-marked-free" | "leaked-blocks") {
            let preen = copy_of(&lun, &format!("{}-preen.img", case.name));
            wreck(&preen, case.name, target);
            let (code, out) = fsck(&preen, "-p");
            let want = if case.preen { 1 } else { 4 };
            assert_eq!(code, want, "{what}: fsck -p: {out}");
            std::fs::remove_file(&preen).expect("remove the preen copy");
        }
        let (code, out) = fsck(&copy, "-y");
        assert_eq!(code, 1, "{what}: fsck -y: {out}");
        assert!(out.contains("repaired:"), "{what}: {out}");
        let (code, out) = fsck(&copy, "-n");
        assert_eq!(code, 0, "{what}: fsck -n after repair: {out}");
        let mnt = lun.dir().join(format!("mnt-{}", case.name));
        let m = Mount::try_new(&copy, &mnt, "node2", &[])
            .unwrap_or_else(|r| panic!("{what}: the repaired volume does not mount: {r}"));
        for (name, want) in &files {
            let Some(path) = path_after(name, case.effect, target, dir) else {
                assert!(!m.p(name).exists(), "{what}: {name} is still there");
                continue;
            };
            let got = std::fs::read(m.p(&path)).unwrap_or_else(|e| panic!("{what}: {path}: {e}"));
            let role = match *name {
                "small" => FileRole::Target,
                TREE_FILE => FileRole::TreeFile,
                _ => FileRole::Other,
            };
            assert!(
                case.effect.contents_ok(role, &got, want),
                "{what}: {path} changed"
            );
        }
        many_intact(&m, &what, case.effect, dir, &many);
        let link = std::fs::read_link(m.p("link"));
        if case.effect == Effect::SymlinkGone {
            assert!(link.is_err(), "{what}: the cleared symlink is still there");
        } else {
            let got = link.unwrap_or_else(|e| panic!("{what}: link: {e}"));
            assert_eq!(got, Path::new("small"), "{what}: link changed");
        }
        m.unmount();
        std::fs::remove_file(&copy).expect("remove the case copy");
        eprintln!("{what}: found, repaired (-y exit 1), clean, files intact");
        cases += 1;
    }
    assert_eq!(cases, CASES.len());
    eprintln!("{cases} corruption cases");
}

#[test]
fn a_mount_while_fsck_repairs_is_refused_naming_the_fsck_host() {
    require_fuse!();
    let lun = Lun::new(1 << 30);
    lun.mkfs(&["-N", "4"]);
    let files = contents();
    populate(&lun, &files);
    let host = cetrafs_core::cluster::machine::kernel_host_name();
    let fsck = Command::new(bin("fsck-cetra"))
        .arg("-y")
        .arg(lun.path())
        .env("CETRA_FAILPOINT", "fsck::claimed=sleep20000")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start fsck.cetra -y");
    // fsck holds its claim once `cetra status` shows its slot.
    wait_until(Duration::from_secs(5), "fsck's slot shows", || {
        let r = run(Command::new(bin("cetra"))
            .args(["status", "--json", "--watch-ms", "1"])
            .arg(lun.path()));
        r.stdout.contains("fsck.cetra:")
    });
    let mnt = lun.dir().join("mnt-during");
    let Err(refused) = Mount::try_new(lun.path(), &mnt, "node2", &[]) else {
        panic!("a mount while fsck -y runs must be refused");
    };
    let said = refused.output();
    assert!(
        said.contains(&format!("fsck.cetra is running on {host}")),
        "the refusal does not name the fsck host: {said}"
    );
    let out = fsck.wait_with_output().expect("fsck.cetra -y");
    assert_eq!(
        out.status.code(),
        Some(0),
        "fsck -y on a clean volume: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let m = Mount::try_new(lun.path(), &mnt, "node2", &[])
        .unwrap_or_else(|r| panic!("mount after fsck: {r}"));
    for (name, want) in &files {
        assert!(std::fs::read(m.p(name)).expect("read") == *want, "{name}");
    }
    m.unmount();
    lun.assert_fsck_clean();
}
