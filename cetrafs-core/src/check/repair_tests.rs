//! Every corruption of `check/wreck.rs` on a populated volume: the check finds it, the repairs
//! of its mode fix it (a second check is clean), the volume mounts and every file reads back as
//! it was. Preen repairs exactly the cases marked `preen`.

use super::repair::{repair, Mode};
use super::wreck::CASES;
use super::{check_volume, Report};
use crate::dev::mem::MemDevice;
use crate::fs::{Caller, MountOptions, Volume};
use crate::mkfs::{format, MkfsOptions};
use std::collections::BTreeMap;
use std::sync::Arc;

const C: Caller = Caller::ROOT;

/// A volume with a few files; returns its image, the files' contents and the target inode (a
/// small file).
fn populated() -> (Vec<u8>, BTreeMap<Vec<u8>, Vec<u8>>, u64) {
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
        }
        files.insert(name, data);
    }
    let d = v.mkdir(root, b"dir", 0o755, C).unwrap();
    let (_, fh) = v.create(d.ino, b"inner", 0o600, C, true).unwrap();
    v.write(&fh, 0, b"inner data").unwrap();
    v.release(&fh).unwrap();
    v.unmount().unwrap();
    (dev.snapshot(), files, target)
}

/// Repair rounds as fsck runs them: until clean or a round fixes nothing (at most 4).
fn run_repairs(dev: &MemDevice, mode: Mode) -> (Report, usize) {
    let mut fixed = 0;
    for _ in 0..4 {
        let r = check_volume(dev).unwrap();
        if r.is_clean() {
            return (r, fixed);
        }
        let done = repair(dev, &r, mode).unwrap();
        if done.fixed.is_empty() {
            return (r, fixed);
        }
        fixed += done.fixed.len();
    }
    (check_volume(dev).unwrap(), fixed)
}

fn files_intact(dev: Arc<MemDevice>, files: &BTreeMap<Vec<u8>, Vec<u8>>, case: &str) {
    let v = Volume::mount(dev, &MountOptions::default())
        .unwrap_or_else(|e| panic!("{case}: the repaired volume does not mount: {e}"));
    let root = v.root_ino();
    for (name, want) in files {
        let a = v.lookup(root, name).unwrap();
        let fh = v.open(a.ino, false, false).unwrap();
        let mut got = Vec::new();
        v.read(&fh, 0, u32::try_from(want.len() + 10).unwrap(), &mut |d| {
            got.extend_from_slice(d);
        })
        .unwrap();
        v.release(&fh).unwrap();
        assert!(
            got == *want,
            "{case}: {} changed",
            String::from_utf8_lossy(name)
        );
    }
    v.unmount().unwrap();
}

#[test]
fn every_corruption_is_found_and_repaired_and_no_file_changes() {
    let (image, files, target) = populated();
    assert!(check_volume(&MemDevice::from_image(image.clone(), 512))
        .unwrap()
        .is_clean());
    for case in CASES {
        let dev = Arc::new(MemDevice::from_image(image.clone(), 512));
        let what = super::wreck::apply(&*dev, case.name, target).unwrap();
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
        files_intact(dev.clone(), &files, case.name);
        assert!(
            check_volume(&*dev).unwrap().is_clean(),
            "{what}: not clean after a mount of the repaired volume"
        );
    }
}
