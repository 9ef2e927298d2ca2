//! `cetra` (the admin tool) against real daemons on one file LUN (issue 11).
//!
//! `cetra status`: with three nodes mounted, asked through node3's mountpoint, it lists all
//! three slots alive with heartbeat ages below the dead time; after node1 is SIGKILLed it shows
//! node1's slot going dead → recovering (by a survivor) → free. The survivors are started with
//! the process failpoint `recovery::after_replay=stop`, so the one that recovers node1 stops
//! itself (SIGSTOP) with node1's slot in the Recovering state: the test sees that state, then
//! resumes the recoverer (SIGCONT) and sees the slot freed.

use cetrafs_tests::{
    bin, poll_until, proc_status, require_fuse, run, secs, KillOnDrop, Lun, Mount,
};
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// mkfs timings of the multi-node tests: dead time 5.2 s.
const MKFS: [&str; 6] = [
    "--heartbeat-interval",
    "100",
    "--io-timeout",
    "500",
    "-N",
    "8",
];
const DEAD_TIME: Duration = Duration::from_millis(5200);
const RECOVERY_WITHIN: Duration = Duration::from_secs(20);
const STOP_AFTER_REPLAY: (&str, &str) = ("CETRA_FAILPOINT", "recovery::after_replay=stop");

fn status(target: &Path) -> Value {
    let r = run(Command::new(bin("cetra"))
        .args(["status", "--json", "--watch-ms", "600"])
        .arg(target));
    assert_eq!(
        r.code,
        0,
        "cetra status {}: {}",
        target.display(),
        r.output()
    );
    serde_json::from_str(&r.stdout)
        .unwrap_or_else(|e| panic!("cetra status --json printed no JSON ({e}): {}", r.stdout))
}

/// The slot entry of `host` in a status.
fn slot_of<'a>(st: &'a Value, host: &str) -> Option<&'a Value> {
    st["slots"]
        .as_array()?
        .iter()
        .find(|s| s["host"].as_str() == Some(host))
}

/// Is process `pid` stopped (state T in /proc/PID/status)?
fn stopped(pid: i32) -> bool {
    proc_status(&pid.to_string(), "State").is_some_and(|s| s.starts_with('T'))
}

/// SIGCONT to each pid when dropped (also when the test panics).
struct ResumeOnDrop(Vec<i32>);

impl Drop for ResumeOnDrop {
    fn drop(&mut self) {
        for &pid in &self.0 {
            // SAFETY: kill only sends a signal; a pid that is gone is ESRCH, ignored.
            unsafe {
                libc::kill(pid, libc::SIGCONT);
            }
        }
    }
}

#[test]
fn status_shows_three_nodes_and_a_killed_one_dead_recovering_free() {
    require_fuse!();
    let lun = Lun::new(2 << 30);
    lun.mkfs(&MKFS);
    let node1 = Mount::new(&lun, "node1");
    let node2 = Mount::with_opts_env(&lun, "node2", &[], &[STOP_AFTER_REPLAY]);
    let node3 = Mount::with_opts_env(&lun, "node3", &[], &[STOP_AFTER_REPLAY]);
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(node1.p("hello")).expect("create through node1");
        f.write_all(b"hi").expect("write through node1");
        f.sync_all().expect("fsync through node1");
    }

    // node2 keeps a file open for writing: its open registration shows. A child process holds
    // it, not this one: every command this test runs would otherwise inherit the descriptor
    // until its exec closes it, and that close must not depend on node2, which this test
    // stops at a failpoint.
    let held = {
        let f = std::fs::File::create(node2.p("held")).expect("create through node2");
        f.sync_all().expect("fsync through node2");
        KillOnDrop(
            Command::new("sleep")
                .arg("600")
                .stdout(f)
                .spawn()
                .expect("a process holding node2's file"),
        )
    };
    // Three nodes, asked from node3 (its mountpoint resolves to the LUN).
    let st = status(node3.path());
    for host in ["node1", "node2", "node3"] {
        let s = slot_of(&st, host).unwrap_or_else(|| panic!("{host} missing from {st:#}"));
        assert_eq!(s["condition"], "alive", "{host}: {s:#}");
        let age = s["heartbeat_age_ms"]
            .as_u64()
            .unwrap_or_else(|| panic!("{host}: no heartbeat change seen: {s:#}"));
        assert!(
            u128::from(age) < DEAD_TIME.as_millis(),
            "{host}: age {age} ms"
        );
        assert_eq!(s["dead_time_ms"], 5200, "{host}: {s:#}");
        // A file LUN has no persistent reservations: the lease is the fence.
        assert_eq!(s["fence"], "lease", "{host}: {s:#}");
    }
    assert!(st["persistent_reservations"].is_null(), "{st:#}");
    assert_eq!(st["max_nodes"], 8);
    let writing = &slot_of(&st, "node2").expect("node2")["locks"]["files_open_writing"];
    assert!(writing.as_u64() >= Some(1), "node2's open file: {st:#}");
    let slot = |host: &str| slot_of(&st, host).and_then(|s| s["slot"].as_u64());
    let survivors = [(slot("node2"), &node2), (slot("node3"), &node3)];
    assert!(st["free_blocks"].as_u64().unwrap_or(0) > 0, "{st:#}");

    // node1 dies; follow its slot through the LUN itself (a stopped recoverer's mountpoint
    // would hang a stat).
    let pid1 = node1.pid();
    // Both survivors stop at the failpoint when they recover a node. On a loaded machine the
    // second can find the stopped first silent for its dead time and recover it too: whatever
    // happens, neither is left stopped when the test ends (a stopped daemon's mount would hang
    // the unmount, and every mount after it).
    let _resume = ResumeOnDrop(vec![node2.pid(), node3.pid()]);
    node1.abandon(Some(libc::SIGKILL)).expect("SIGKILL node1");
    let t = Instant::now();
    let mut seen: Vec<String> = Vec::new();
    let mut resumed = None;
    let done = poll_until(DEAD_TIME + RECOVERY_WITHIN, || {
        let st = status(lun.path());
        let s = slot_of(&st, "node1").unwrap_or_else(|| panic!("node1's slot missing: {st:#}"));
        let cond = s["condition"].as_str().unwrap_or("?").to_string();
        if seen.last() != Some(&cond) {
            eprintln!("status: node1 {cond} after {} ({s})", secs(t.elapsed()));
            seen.push(cond.clone());
        }
        if cond == "recovering" && resumed.is_none() {
            let by = s["recoverer"]["slot"].as_u64();
            let (_, m) = survivors
                .iter()
                .find(|(slot, _)| by.is_some() && *slot == by)
                .unwrap_or_else(|| panic!("recovering by an unknown slot: {s:#}"));
            // The recoverer stops at the failpoint (the state was written before the replay);
            // resume it before the other survivor finds it silent.
            let waited = poll_until(Duration::from_secs(2), || stopped(m.pid()));
            assert!(
                waited.is_some(),
                "the recoverer (pid {}) did not stop at recovery::after_replay",
                m.pid()
            );
            assert!(m.signal(libc::SIGCONT).is_ok(), "SIGCONT {}", m.pid());
            resumed = Some(m.pid());
        }
        let l = &s["locks"];
        let holds = [
            "inodes_exclusive",
            "inodes_shared",
            "groups_owned",
            "files_open",
        ]
        .iter()
        .map(|k| l[k].as_u64().unwrap_or(0))
        .sum::<u64>()
            + u64::from(!l["global"].is_null());
        match cond.as_str() {
            // It created and fsynced a file: it holds that inode's lock until recovered.
            "dead" => assert!(holds > 0, "a dead node1 shows no locks: {s:#}"),
            "free" => assert_eq!(holds, 0, "a recovered node1 still holds locks: {s:#}"),
            _ => {}
        }
        cond == "free"
    });
    assert!(
        done.is_some(),
        "node1 (pid {pid1}) not free within {}: seen {seen:?}",
        secs(DEAD_TIME + RECOVERY_WITHIN)
    );
    assert_eq!(
        seen,
        ["dead", "recovering", "free"],
        "node1's slot went {seen:?}"
    );
    assert!(
        resumed.is_some(),
        "no survivor stopped at recovery::after_replay"
    );
    // The survivors carry on.
    let st = status(node2.path());
    for host in ["node2", "node3"] {
        let s = slot_of(&st, host).unwrap_or_else(|| panic!("{host} missing: {st:#}"));
        assert_eq!(s["condition"], "alive", "{host} after the recovery: {s:#}");
    }
    assert_eq!(
        std::fs::read(node3.p("hello")).expect("read through node3"),
        b"hi"
    );
    drop(held);
    node2.unmount();
    node3.unmount();
    let st = status(lun.path());
    for host in ["node1", "node2", "node3"] {
        let s = slot_of(&st, host).unwrap_or_else(|| panic!("{host} missing: {st:#}"));
        assert_eq!(s["condition"], "free", "{host} after unmount: {s:#}");
    }
    lun.assert_fsck_clean();
}

/// `cetra extents`: a file written at three separate 4 KiB blocks has three extents at those
/// file blocks, a sequential 5 MiB file maps all its 1280 blocks, and the physical blocks it
/// names hold the file's bytes on the LUN.
#[test]
fn extents_maps_each_file_block_to_the_lun_block_holding_it() {
    use std::os::unix::fs::FileExt as _;
    require_fuse!();
    let lun = Lun::new(2 << 30);
    lun.mkfs(&MKFS);
    let node = Mount::new(&lun, "node1");
    let sparse = std::fs::File::create(node.p("sparse")).expect("create sparse");
    for (i, blk) in [0u64, 2, 9].into_iter().enumerate() {
        let fill = u8::try_from(0x30 + i).unwrap_or(0);
        sparse
            .write_all_at(&[fill; 4096], blk * 4096)
            .expect("write sparse");
    }
    drop(sparse);
    let big: Vec<u8> = (0..5u32 << 20).map(|i| (i % 251) as u8).collect();
    std::fs::write(node.p("big"), &big).expect("write big");

    let extents = |name: &str| -> Value {
        let r = run(Command::new(bin("cetra"))
            .args(["extents", "--json"])
            .arg(node.p(name)));
        assert_eq!(r.code, 0, "cetra extents {name}: {}", r.output());
        serde_json::from_str(&r.stdout).expect("cetra extents --json")
    };
    let s = extents("sparse");
    assert_eq!(s["extent_count"], 3, "{s:#}");
    let logical: Vec<u64> = s["extents"]
        .as_array()
        .expect("extents")
        .iter()
        .map(|e| e["logical"].as_u64().expect("logical"))
        .collect();
    assert_eq!(logical, [0, 2, 9], "{s:#}");
    for (i, e) in s["extents"].as_array().expect("extents").iter().enumerate() {
        let at = e["physical"].as_u64().expect("physical") * 4096;
        let fill = u8::try_from(0x30 + i).unwrap_or(0);
        assert!(
            lun.peek(at, 4096).iter().all(|&b| b == fill),
            "extent {i} of sparse: the LUN block does not hold the file's bytes"
        );
    }
    let b = extents("big");
    let mut covered = 0;
    for e in b["extents"].as_array().expect("extents") {
        let (l, p, n) = (
            e["logical"].as_u64().expect("logical"),
            e["physical"].as_u64().expect("physical"),
            e["blocks"].as_u64().expect("blocks"),
        );
        let want = &big[usize::try_from(l * 4096).unwrap_or(0)..]
            [..usize::try_from(n * 4096).unwrap_or(0)];
        assert!(
            lun.peek(p * 4096, want.len()) == want,
            "big: extent at {l} differs on the LUN"
        );
        covered += n;
    }
    assert_eq!(covered, 1280, "{b:#}");
    let r = run(Command::new(bin("cetra")).arg("extents").arg(node.path()));
    assert_eq!(r.code, 1, "a directory: {}", r.output());
    node.unmount();
}

/// `cetra tune`: refused while a node has the volume mounted; unmounted, it changes the label
/// and the heartbeat timing (status shows them, fsck is clean, the volume mounts); a mount
/// while it holds its claim is refused, naming the tool and host.
#[test]
fn tune_changes_label_and_timing_only_while_unmounted() {
    require_fuse!();
    let lun = Lun::new(2 << 30);
    lun.mkfs(&MKFS);
    let node = Mount::new(&lun, "node1");
    let tune = |args: &[&str]| {
        run(Command::new(bin("cetra"))
            .arg("tune")
            .args(args)
            .arg(lun.path()))
    };
    let r = tune(&["-L", "vmstore"]);
    assert_eq!(r.code, 1, "tune while mounted: {}", r.output());
    assert!(r.stderr.contains("is mounted by"), "{}", r.output());
    node.unmount();

    let r = tune(&[
        "-L",
        "vmstore",
        "--heartbeat-interval",
        "200",
        "--io-timeout",
        "900",
    ]);
    assert_eq!(r.code, 0, "tune: {}", r.output());
    let r = tune(&["--io-timeout", "100"]);
    assert_eq!(
        r.code,
        1,
        "an io timeout below the interval: {}",
        r.output()
    );
    let st = status(lun.path());
    assert_eq!(st["label"], "vmstore", "{st:#}");
    assert_eq!(st["heartbeat_interval_ms"], 200, "{st:#}");
    assert_eq!(st["io_timeout_ms"], 900, "{st:#}");
    let r = lun.fsck();
    assert_eq!(r.code, 0, "fsck after tune: {}", r.output());
    assert!(!r.stdout.contains("warning"), "{}", r.output());

    // While tune holds its claim (held between its two superblock writes), no mount.
    let host = cetrafs_core::cluster::machine::kernel_host_name();
    let held = Command::new(bin("cetra"))
        .args(["tune", "-L", "again"])
        .arg(lun.path())
        .env("CETRA_FAILPOINT", "tune::between_copies=sleep4000")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start cetra tune");
    let mnt = lun.dir().join("mnt-during-tune");
    assert!(
        poll_until(Duration::from_secs(3), || status(lun.path())
            .to_string()
            .contains("cetra-tune:"))
        .is_some(),
        "cetra tune's claim does not show"
    );
    let Err(refused) = Mount::try_new(lun.path(), &mnt, "node2", &[]) else {
        panic!("a mount while cetra tune runs must be refused");
    };
    assert!(
        refused
            .output()
            .contains(&format!("cetra tune is running on {host}")),
        "{refused}"
    );
    let out = held.wait_with_output().expect("cetra tune");
    assert_eq!(out.status.code(), Some(0));
    let m = Mount::try_new(lun.path(), &mnt, "node2", &[])
        .unwrap_or_else(|r| panic!("mount after tune: {r}"));
    m.unmount();
    assert_eq!(status(lun.path())["label"], "again");
}

/// `cetra tune -N` adds node slots to an unmounted volume (issue 11 §1): made for 2 nodes, the
/// volume then mounts on 4 at once; each writes a file the others read; fsck is clean. More
/// slots than the heartbeat area has, or fewer than now, are refused before anything changes.
#[test]
fn tune_adds_node_slots_that_four_nodes_then_use() {
    require_fuse!();
    let lun = Lun::new(1 << 30);
    lun.mkfs(&["-N", "2", "--journal-size", "16M"]);
    let tune = |args: &[&str]| {
        run(Command::new(bin("cetra"))
            .arg("tune")
            .args(args)
            .arg(lun.path()))
    };
    for bad in ["1", "65"] {
        let r = tune(&["-N", bad]);
        assert_eq!(r.code, 1, "-N {bad}: {}", r.output());
    }
    let r = tune(&["-N", "4"]);
    assert_eq!(r.code, 0, "tune -N 4: {}", r.output());
    assert!(r.stdout.contains("4 node slots"), "{}", r.output());
    lun.assert_fsck_clean();
    let nodes: Vec<Mount> = (1..=4)
        .map(|i| Mount::new(&lun, &format!("node{i}")))
        .collect();
    for (i, m) in nodes.iter().enumerate() {
        std::fs::write(m.p(format!("from-{i}")), format!("node {i}")).expect("write");
    }
    for m in &nodes {
        for i in 0..4 {
            let got = std::fs::read_to_string(m.p(format!("from-{i}"))).expect("read");
            assert_eq!(got, format!("node {i}"));
        }
    }
    let st = status(lun.path());
    assert_eq!(st["max_nodes"], 4, "{st:#}");
    for m in nodes {
        m.unmount();
    }
    lun.assert_fsck_clean();
}
