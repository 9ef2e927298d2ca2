//! `cetra defrag` on real daemons (issue 11): a 2,000-extent file ends in at most 4 extents
//! with the same contents and fsck clean; refused while another node has the file open for
//! writing and on a `nofilelock` mount; and a daemon killed in the middle (process failpoints
//! after the copy, before the switch; after the switch) leaves the old map or the new one,
//! never a mix, the contents unchanged and fsck clean.

use cetrafs_tests::{bin, poll_until, require_fuse, run, Lun, Mount};
use serde_json::Value;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::process::Command;

const BLOCKS: u64 = 2000;

/// A file written even blocks first, then odd ones (exact allocation: `granule=4`): one
/// extent per block. Returns its contents.
fn fragmented(path: &Path) -> Vec<u8> {
    let f = std::fs::File::create(path).expect("create the file");
    let mut want = vec![0u8; usize::try_from(BLOCKS * 4096).unwrap_or(0)];
    for pass in [0, 1] {
        for b in (pass..BLOCKS).step_by(2) {
            let data = [u8::try_from(b % 251).unwrap_or(0); 4096];
            f.write_all_at(&data, b * 4096).expect("write");
            let at = usize::try_from(b * 4096).unwrap_or(0);
            want[at..at + 4096].copy_from_slice(&data);
        }
    }
    f.sync_all().expect("fsync");
    want
}

fn extent_count(path: &Path) -> u64 {
    let r = run(Command::new(bin("cetra"))
        .args(["extents", "--json"])
        .arg(path));
    assert_eq!(r.code, 0, "cetra extents: {}", r.output());
    let v: Value = serde_json::from_str(&r.stdout).expect("cetra extents --json");
    v["extent_count"].as_u64().expect("extent_count")
}

fn defrag(path: &Path) -> cetrafs_tests::CmdResult {
    run(Command::new(bin("cetra"))
        .args(["defrag", "--json"])
        .arg(path))
}

#[test]
fn defrag_turns_2000_extents_into_at_most_4_online() {
    require_fuse!();
    let lun = Lun::new(2 << 30);
    lun.mkfs(&["-N", "4"]);
    let node1 = Mount::with_opts(&lun, "node1", &["granule=4"]);
    let node2 = Mount::new(&lun, "node2");
    let want = fragmented(&node1.p("frag"));
    assert_eq!(extent_count(&node1.p("frag")), BLOCKS);

    // Open for writing on node2: refused, nothing changes.
    let held = std::fs::OpenOptions::new()
        .write(true)
        .open(node2.p("frag"))
        .expect("open for writing on node2");
    let r = defrag(&node1.p("frag"));
    assert_eq!(r.code, 1, "{}", r.output());
    assert!(
        r.stderr.contains("open for writing on another node"),
        "{}",
        r.output()
    );
    drop(held);
    // close() returns before node2's daemon has handled the RELEASE that ends its write
    // registration: wait until node1 may open the file for writing, as defrag will.
    let writable = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open(node1.p("frag"))
            .is_ok()
    };
    assert!(
        poll_until(std::time::Duration::from_secs(10), writable).is_some(),
        "node2's write registration outlived its close by 10 s"
    );

    let r = defrag(&node1.p("frag"));
    assert_eq!(r.code, 0, "cetra defrag: {}", r.output());
    let v: Value = serde_json::from_str(&r.stdout).expect("cetra defrag --json");
    assert_eq!(v["extents_before"], BLOCKS, "{v:#}");
    assert!(v["extents_after"].as_u64() <= Some(4), "{v:#}");
    assert!(extent_count(&node1.p("frag")) <= 4);
    assert!(
        std::fs::read(node1.p("frag")).expect("read") == want,
        "contents changed"
    );
    assert!(
        std::fs::read(node2.p("frag")).expect("read on node2") == want,
        "contents changed as node2 reads them"
    );
    node1.unmount();
    node2.unmount();
    lun.assert_fsck_clean();

    // nofilelock: refused.
    let loose = Mount::with_opts(&lun, "node3", &["nofilelock"]);
    let r = defrag(&loose.p("frag"));
    assert_eq!(r.code, 1, "{}", r.output());
    assert!(r.stderr.contains("nofilelock"), "{}", r.output());
    loose.unmount();
}

/// The daemon exits at `failpoint` during a defrag; after a remount the file has `old` extents
/// (true) or at most 4 (false), the same contents, and fsck is clean.
fn killed_at(failpoint: &str, old_map: bool) {
    let lun = Lun::new(2 << 30);
    lun.mkfs(&[
        "-N",
        "4",
        "--heartbeat-interval",
        "100",
        "--io-timeout",
        "500",
    ]);
    let want = {
        let m = Mount::with_opts(&lun, "node1", &["granule=4"]);
        let w = fragmented(&m.p("frag"));
        m.unmount();
        w
    };
    let mut m = Mount::with_opts_env(&lun, "node1", &[], &[("CETRA_FAILPOINT", failpoint)]);
    m.allow_error("failpoint");
    let r = defrag(&m.p("frag"));
    assert_ne!(
        r.code,
        0,
        "{failpoint}: the defrag went through: {}",
        r.output()
    );
    m.abandon(None).expect("the daemon exited at the failpoint");
    if old_map {
        // Killed between copy and switch: the new blocks are held by the temporary inode on
        // the dead node's orphan list, which the next mount frees.
        let r = lun.fsck();
        assert!(
            r.stdout.contains("was open but unlinked"),
            "{failpoint}: no temporary inode on the orphan list: {r}"
        );
    }
    let m = Mount::new(&lun, "node1");
    let n = extent_count(&m.p("frag"));
    if old_map {
        assert_eq!(n, BLOCKS, "{failpoint}: not the old map");
    } else {
        assert!(n <= 4, "{failpoint}: not the new map ({n} extents)");
    }
    assert!(
        std::fs::read(m.p("frag")).expect("read") == want,
        "{failpoint}: contents changed"
    );
    m.unmount();
    lun.assert_fsck_clean();
}

#[test]
fn a_daemon_killed_during_defrag_leaves_the_old_map_or_the_new_one() {
    require_fuse!();
    killed_at("defrag::copied=exit", true);
    killed_at("defrag::switched=exit", false);
}

/// Writes into the file while it is defragmented (same node, 4 KiB overwrites that would take
/// the fast path) are never lost: each block reads back as its last write.
#[test]
fn writes_during_a_defrag_are_kept() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    require_fuse!();
    let lun = Lun::new(2 << 30);
    lun.mkfs(&["-N", "4"]);
    let node = Mount::with_opts(&lun, "node1", &["granule=4"]);
    let path = node.p("frag");
    let blocks = 8192u64;
    {
        let f = std::fs::File::create(&path).expect("create");
        for pass in [0, 1] {
            for b in (pass..blocks).step_by(2) {
                f.write_all_at(&[0u8; 4096], b * 4096).expect("write");
            }
        }
        f.sync_all().expect("fsync");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (path, stop) = (path.clone(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .expect("open for the writer");
            let mut last = std::collections::HashMap::new();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) || n < 200 {
                n += 1;
                let b = (n * 7919) % blocks;
                let mut data = [0u8; 4096];
                data[..8].copy_from_slice(&n.to_le_bytes());
                f.write_all_at(&data, b * 4096)
                    .expect("write during defrag");
                last.insert(b, n);
            }
            f.sync_all().expect("fsync");
            last
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(50));
    let r = defrag(&path);
    stop.store(true, Ordering::Relaxed);
    assert_eq!(r.code, 0, "cetra defrag: {}", r.output());
    let last = writer.join().expect("writer");
    assert!(extent_count(&path) <= 4);
    let f = std::fs::File::open(&path).expect("open");
    for (b, n) in last {
        let mut got = [0u8; 8];
        f.read_exact_at(&mut got, b * 4096).expect("read");
        assert_eq!(u64::from_le_bytes(got), n, "block {b} lost its last write");
    }
    drop(f);
    node.unmount();
    lun.assert_fsck_clean();
}
