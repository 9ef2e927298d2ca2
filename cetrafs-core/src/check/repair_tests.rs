//! Every corruption of `check/wreck.rs` on a populated volume: the check finds it, the repairs
//! of its mode fix it (a second check is clean), the volume mounts and every file reads back as
//! it was. Preen repairs exactly the cases marked `preen`.

use super::repair::{rounds, Mode};
use super::wreck::{Effect, FileRole, CASES};
use super::{check_volume, Report};
use crate::dev::mem::MemDevice;
use crate::dev::SharedDevice;
use crate::fs::{Caller, MountOptions, Volume};
use crate::mkfs::{format, MkfsOptions};
use std::collections::BTreeMap;
use std::sync::Arc;

const C: Caller = Caller::ROOT;
/// The populated file with an extent tree.
const TREE_FILE: &[u8] = b"sparse";

/// What [`populated`] made.
struct Populated {
    image: Vec<u8>,
    files: BTreeMap<Vec<u8>, Vec<u8>>,
    /// The target inode (a small file).
    target: u64,
    /// `/dir`.
    dir: u64,
    /// The files of `/dir/many` (a directory with a two-level tree): name, inode.
    many: Vec<(Vec<u8>, u64)>,
}

/// A volume with a few files.
fn populated() -> Populated {
    let dev = Arc::new(MemDevice::new(40 << 20, 512));
    let opts = MkfsOptions {
        max_nodes: 4,
        journal_bytes: 1 << 20,
        ..Default::default()
    };
    format(&*dev, &opts, &mut |_, _| {}).unwrap();
    let v = Volume::mount(dev.clone(), &MountOptions::default()).unwrap();
    let root = v.root_ino();
    let mut files = BTreeMap::new();
    let mut target = 0;
    for (i, len) in [5000usize, 70_000, 1 << 20, 3 << 20, 12]
        .into_iter()
        .enumerate()
    {
        let name = format!("f{i}").into_bytes();
        let data: Vec<u8> = (0..len)
            .map(|j| u8::try_from((j * 7 + i) % 253).unwrap())
            .collect();
        let (a, fh) = v.create(root, &name, 0o644, C, true).unwrap();
        v.write(&fh, 0, &data).unwrap();
        v.release(&fh).unwrap();
        if i == 0 {
            target = a.ino;
            // The bad-xattr case damages the target's xattr block.
            v.setxattr(a.ino, b"user.note", &[7u8; 300], true, false)
                .unwrap();
        }
        files.insert(name, data);
    }
    // The bad-tree case damages a leaf of the one file with an extent tree: every other 4 KiB
    // block of 1.6 MB written, 200 extents (more than the 160 an inode holds).
    let (_, fh) = v.create(root, TREE_FILE, 0o644, C, true).unwrap();
    let mut sparse = vec![0u8; 399 * 4096];
    for (k, block) in sparse.chunks_mut(4096).enumerate().step_by(2) {
        block.fill(u8::try_from(k % 251).unwrap() + 1);
        v.write(&fh, u64::try_from(k * 4096).unwrap(), block)
            .unwrap();
    }
    v.release(&fh).unwrap();
    files.insert(TREE_FILE.to_vec(), sparse);
    // The bad-symlink case damages it.
    v.symlink(root, b"link", b"f0", C).unwrap();
    let d = v.mkdir(root, b"dir", 0o755, C).unwrap();
    let (_, fh) = v.create(d.ino, b"inner", 0o600, C, true).unwrap();
    v.write(&fh, 0, b"inner data").unwrap();
    v.release(&fh).unwrap();
    // The bad-dir-tree case damages a leaf of its tree.
    let m = v.mkdir(d.ino, b"many", 0o755, C).unwrap();
    let mut many = Vec::new();
    for i in 0..150 {
        let name = format!("a-rather-long-name-that-fills-directory-tree-leaves-{i:03}");
        let (a, fh) = v.create(m.ino, name.as_bytes(), 0o644, C, true).unwrap();
        v.release(&fh).unwrap();
        many.push((name.into_bytes(), a.ino));
    }
    v.unmount().unwrap();
    Populated {
        image: dev.snapshot(),
        files,
        target,
        dir: d.ino,
        many,
    }
}

/// Every file of `/dir/many` is in it, or (`DirPartInLostFound`) in `/lost+found` as `#INO`.
fn many_intact(dev: Arc<MemDevice>, p: &Populated, case: &str, effect: Effect) {
    let v = Volume::mount(dev, &MountOptions::default()).unwrap();
    let root = v.root_ino();
    let lf = v.lookup(root, b"lost+found").map(|a| a.ino).ok();
    let dir = if effect == Effect::DirInLostFound {
        v.lookup(lf.expect("lost+found"), format!("#{}", p.dir).as_bytes())
    } else {
        v.lookup(root, b"dir")
    }
    .unwrap_or_else(|e| panic!("{case}: dir: {e}"));
    let many = v.lookup(dir.ino, b"many").unwrap().ino;
    let mut moved = 0;
    for (name, ino) in &p.many {
        match v.lookup(many, name) {
            Ok(a) => assert_eq!(a.ino, *ino, "{case}"),
            Err(_) if effect == Effect::DirPartInLostFound => {
                let lf = lf.unwrap_or_else(|| panic!("{case}: no lost+found"));
                let a = v
                    .lookup(lf, format!("#{ino}").as_bytes())
                    .unwrap_or_else(|e| panic!("{case}: #{ino} not in lost+found: {e}"));
                assert_eq!(a.ino, *ino, "{case}");
                moved += 1;
            }
            Err(e) => panic!("{case}: many/{}: {e}", String::from_utf8_lossy(name)),
        }
    }
    if effect == Effect::DirPartInLostFound {
        assert!(moved > 0 && moved < p.many.len(), "{case}: {moved} moved");
    }
    v.unmount().unwrap();
}

/// Repair rounds as fsck runs them.
fn run_repairs(dev: &Arc<MemDevice>, mode: Mode) -> (Report, usize) {
    let shared: SharedDevice = dev.clone();
    let mount = || {
        Volume::mount(
            shared.clone(),
            &MountOptions {
                discard_rate: None,
                ..MountOptions::default()
            },
        )
    };
    let out = rounds(
        &**dev,
        mode,
        &mut |_| check_volume(&**dev),
        &mount,
        &mut |_, _, done| {
            for line in done {
                eprintln!("  {mode:?}: repaired: {line}");
            }
        },
    )
    .unwrap();
    (out.last, out.fixed)
}

/// Every file is where `effect` says, unchanged (`target` is the target file's inode).
fn files_intact(
    dev: Arc<MemDevice>,
    files: &BTreeMap<Vec<u8>, Vec<u8>>,
    case: &str,
    effect: Effect,
    target: u64,
) {
    let v = Volume::mount(dev, &MountOptions::default())
        .unwrap_or_else(|e| panic!("{case}: the repaired volume does not mount: {e}"));
    let root = v.root_ino();
    for (name, want) in files {
        let found = v.lookup(root, name);
        let a = match (effect, found) {
            (Effect::TargetGone, Err(_)) if name == b"f0" => continue,
            (Effect::TargetGone, Ok(_)) if name == b"f0" => {
                panic!("{case}: the destroyed file is still there")
            }
            (Effect::TargetInLostFound, Err(_)) if name == b"f0" => {
                let lf = v.lookup(root, b"lost+found").unwrap();
                v.lookup(lf.ino, format!("#{target}").as_bytes())
                    .unwrap_or_else(|e| panic!("{case}: not in lost+found: {e}"))
            }
            (_, Ok(a)) => a,
            (_, Err(e)) => panic!("{case}: {}: {e}", String::from_utf8_lossy(name)),
        };
        let fh = v.open(a.ino, false, false).unwrap();
        let mut got = Vec::new();
        v.read(&fh, 0, u32::try_from(want.len() + 10).unwrap(), &mut |d| {
            got.extend_from_slice(d);
        })
        .unwrap();
        v.release(&fh).unwrap();
        let role = match name.as_slice() {
            b"f0" => FileRole::Target,
            TREE_FILE => FileRole::TreeFile,
            _ => FileRole::Other,
        };
        assert!(
            effect.contents_ok(role, &got, want),
            "{case}: {} changed",
            String::from_utf8_lossy(name)
        );
    }
    let link = v.lookup(root, b"link");
    if effect == Effect::SymlinkGone {
        assert!(link.is_err(), "{case}: the cleared symlink is still there");
    } else {
        let a = link.unwrap_or_else(|e| panic!("{case}: link: {e}"));
        assert_eq!(v.readlink(a.ino).unwrap(), b"f0", "{case}: link changed");
    }
    v.unmount().unwrap();
}

#[test]
fn every_corruption_is_found_and_repaired_and_no_file_changes() {
    let p = populated();
    let (image, files, target) = (p.image.clone(), &p.files, p.target);
    assert!(check_volume(&MemDevice::from_image(image.clone(), 512))
        .unwrap()
        .is_clean());
    for case in CASES {
        let dev = Arc::new(MemDevice::from_image(image.clone(), 512));
        let what = super::wreck::apply(&(dev.clone() as SharedDevice), case.name, target).unwrap();
        let found = check_volume(&*dev).unwrap();
        assert!(
            found.has(case.finding) && !found.is_clean(),
            "{what}: the check did not report {:?} as an error: {:?}",
            case.finding,
            found.findings
        );
        // Preen first: it repairs exactly the preen cases.
        let preen_dev = Arc::new(MemDevice::from_image(dev.snapshot(), 512));
        let (after_preen, _) = run_repairs(&preen_dev, Mode::Preen);
        assert_eq!(
            after_preen.is_clean(),
            case.preen,
            "{what}: after preen: {:?}",
            after_preen.findings
        );
        let (after, fixed) = run_repairs(&dev, Mode::All);
        assert!(fixed > 0, "{what}: nothing repaired");
        assert!(
            after.is_clean(),
            "{what}: still wrong after repair: {:?}",
            after.findings
        );
        files_intact(dev.clone(), files, case.name, case.effect, target);
        many_intact(dev.clone(), &p, case.name, case.effect);
        if case.effect == Effect::TreeFileHoles {
            // Only the damaged leaf's ranges are holes: the other leaf's extents are kept.
            let v = Volume::mount(dev.clone(), &MountOptions::default()).unwrap();
            let a = v.lookup(v.root_ino(), TREE_FILE).unwrap();
            let fh = v.open(a.ino, false, false).unwrap();
            let mut got = Vec::new();
            v.read(&fh, 0, 399 * 4096, &mut |b| got.extend_from_slice(b))
                .unwrap();
            v.release(&fh).unwrap();
            v.unmount().unwrap();
            let want = &files[TREE_FILE];
            let kept = got
                .chunks(4096)
                .zip(want.chunks(4096))
                .filter(|(g, w)| g == w && w.iter().any(|&b| b != 0))
                .count();
            assert!(
                kept > 0 && got != *want,
                "{what}: {kept} written blocks of the tree file kept"
            );
        }
        if case.effect == Effect::DirInLostFound {
            let v = Volume::mount(dev.clone(), &MountOptions::default()).unwrap();
            let lf = v.lookup(v.root_ino(), b"lost+found").unwrap();
            let mut names = Vec::new();
            v.readdir(lf.ino, 0, &mut |e| {
                names.push(e.name.clone());
                true
            })
            .unwrap();
            let dir = names
                .iter()
                .find(|n| n.starts_with(b"#"))
                .unwrap_or_else(|| panic!("{case:?}: lost+found holds {names:?}"));
            let d = v.lookup(lf.ino, dir).unwrap();
            let inner = v.lookup(d.ino, b"inner").unwrap();
            let fh = v.open(inner.ino, false, false).unwrap();
            let mut got = Vec::new();
            v.read(&fh, 0, 100, &mut |b| got.extend_from_slice(b))
                .unwrap();
            v.release(&fh).unwrap();
            assert_eq!(got, b"inner data", "{}", case.name);
            v.unmount().unwrap();
        }
        assert!(
            check_volume(&*dev).unwrap().is_clean(),
            "{what}: not clean after a mount of the repaired volume"
        );
        eprintln!("{what}: found, repaired ({fixed} repairs), clean, files as expected");
    }
}
