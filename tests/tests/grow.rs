//! `cetra grow` (issue 11 §1, `fs/grow.rs`) on real daemons: three nodes on one LUN file; the
//! LUN file grows; `cetra grow` on node1 adds the space as allocation groups; every node's
//! `df` shows the new size; node2 writes more than the old volume could hold (so it must
//! allocate in the new groups), node3 reads every byte back; fsck is clean, and a fresh mount
//! sees the new size. Before the LUN grew, and on a format-4 volume, `cetra grow` refuses
//! with a message that says why.

use cetrafs_tests::{bin, poll_until, require_fuse, run, statvfs, Lun, Mount};
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// What `df` shows: the volume's size in bytes.
fn df_bytes(m: &Mount) -> u64 {
    let s = statvfs(m.path());
    s.f_blocks * s.f_frsize
}

fn cetra_grow(mountpoint: &Path) -> cetrafs_tests::CmdResult {
    run(Command::new(bin("cetra"))
        .arg("grow")
        .arg("--json")
        .arg(mountpoint))
}

fn grow_lun_file(lun: &Lun, size: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(lun.path())
        .and_then(|f| f.set_len(size))
        .expect("grow the LUN file");
}

/// MiB `i` of the big file: its index in every 8 bytes.
fn pattern(i: u64) -> Vec<u8> {
    (0..MIB / 8).flat_map(|_| i.to_le_bytes()).collect()
}

#[test]
fn cetra_grow_adds_the_space_the_lun_gained_and_every_node_uses_it() {
    require_fuse!();
    let lun = Lun::new(512 * MIB);
    let out = lun.mkfs(&["-N", "4", "--journal-size", "16M"]);
    assert!(out.stdout.contains("can grow to:"), "{out}");
    let nodes = [
        Mount::new(&lun, "node1"),
        Mount::new(&lun, "node2"),
        Mount::new(&lun, "node3"),
    ];
    let before = df_bytes(&nodes[0]);

    // The LUN has not grown: refused, and the message says what to do.
    let r = cetra_grow(nodes[0].path());
    assert_eq!(r.code, 1, "{r}");
    assert!(r.output().contains("grow the LUN first"), "{r}");

    grow_lun_file(&lun, 1024 * MIB);
    let r = cetra_grow(nodes[0].path());
    assert_eq!(r.code, 0, "{r}");
    let j: serde_json::Value = serde_json::from_str(&r.stdout).expect("cetra grow --json");
    let (old_groups, new_groups) = (
        j["groups_before"].as_u64().unwrap(),
        j["groups_after"].as_u64().unwrap(),
    );
    let new_bytes = j["bytes_after"].as_u64().unwrap();
    assert_eq!(j["bytes_before"].as_u64(), Some(before), "{r}");
    assert!(new_groups >= 2 * old_groups - 1, "{r}");
    eprintln!(
        "grew from {} to {} MiB ({old_groups} to {new_groups} groups)",
        before >> 20,
        new_bytes >> 20
    );
    for m in &nodes {
        let took =
            poll_until(Duration::from_secs(10), || df_bytes(m) == new_bytes).unwrap_or_else(|| {
                panic!(
                    "{}: df shows {} MiB, not {} MiB",
                    m.path().display(),
                    df_bytes(m) >> 20,
                    new_bytes >> 20
                )
            });
        eprintln!(
            "{}: df shows the new size after {took:?}",
            m.path().display()
        );
    }

    // More than the old volume held: node2 must allocate in the new groups.
    let mibs = before / MIB + 64;
    {
        let mut f = std::fs::File::create(nodes[1].p("big")).expect("create big");
        for i in 0..mibs {
            f.write_all(&pattern(i)).expect("write big");
        }
        f.sync_all().expect("fsync big");
    }
    {
        let mut f = std::fs::File::open(nodes[2].p("big")).expect("node3 opens big");
        let mut buf = vec![0u8; usize::try_from(MIB).unwrap()];
        for i in 0..mibs {
            f.seek(SeekFrom::Start(i * MIB)).expect("seek");
            f.read_exact(&mut buf).expect("node3 reads big");
            assert!(buf == pattern(i), "MiB {i} of big differs on node3");
        }
    }
    for m in nodes {
        m.unmount();
    }
    lun.assert_fsck_clean();
    let again = Mount::new(&lun, "node4");
    assert_eq!(df_bytes(&again), new_bytes);
    again.unmount();
}

#[test]
fn cetra_grow_refuses_a_format_4_volume() {
    require_fuse!();
    let lun = Lun::new(512 * MIB);
    lun.mkfs(&["-N", "2", "--journal-size", "16M", "--format-version", "4"]);
    let m = Mount::new(&lun, "node1");
    grow_lun_file(&lun, 1024 * MIB);
    let r = cetra_grow(m.path());
    assert_eq!(r.code, 1, "{r}");
    assert!(r.output().contains("needs a format-5 volume"), "{r}");
    let r = run(Command::new(bin("cetra")).arg("grow").arg(lun.dir()));
    assert!(r.output().contains("is not a CetraFS mountpoint"), "{r}");
    m.unmount();
    lun.assert_fsck_clean();
}

/// A daemon killed at each step of a grow (`fs/grow.rs`: new groups written; the new seq
/// published in the global lock; the backup superblock written, not the primary) leaves the
/// old size, which the next mount uses; `cetra grow` again finishes the grow; fsck is clean.
#[test]
fn a_daemon_killed_during_a_grow_leaves_the_old_size_and_a_second_grow_finishes_it() {
    require_fuse!();
    for failpoint in [
        "grow::groups_written=exit",
        "grow::published=exit",
        "tune::between_copies=exit",
    ] {
        let lun = Lun::new(512 * MIB);
        lun.mkfs(&["-N", "2", "--journal-size", "16M"]);
        let before = {
            let m = Mount::new(&lun, "node1");
            std::fs::write(m.p("kept"), b"written before the grow").expect("write kept");
            let b = df_bytes(&m);
            m.unmount();
            b
        };
        grow_lun_file(&lun, 1024 * MIB);
        let mut m = Mount::with_opts_env(&lun, "node1", &[], &[("CETRA_FAILPOINT", failpoint)]);
        m.allow_error("failpoint");
        let r = cetra_grow(m.path());
        assert_ne!(r.code, 0, "{failpoint}: the grow went through: {r}");
        m.abandon(None).expect("the daemon exited at the failpoint");

        let m = Mount::new(&lun, "node1");
        assert_eq!(df_bytes(&m), before, "{failpoint}: not the old size");
        let r = cetra_grow(m.path());
        assert_eq!(r.code, 0, "{failpoint}: the second grow: {r}");
        let j: serde_json::Value = serde_json::from_str(&r.stdout).expect("cetra grow --json");
        let after = j["bytes_after"].as_u64().unwrap();
        assert!(after > before, "{failpoint}: {r}");
        assert_eq!(df_bytes(&m), after);
        assert_eq!(
            std::fs::read(m.p("kept")).expect("read kept"),
            b"written before the grow"
        );
        m.unmount();
        lun.assert_fsck_clean();
        eprintln!("{failpoint}: old size after the crash, grown by the second grow, fsck clean");
    }
}
