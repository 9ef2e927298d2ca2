//! Freed space goes back to the LUN (issue 11 §2, `fs/discard.rs`), on real daemons.
//!
//! Two nodes on one sparse file LUN. node1 writes a 1 GiB file and deletes it; at the default
//! rate (64 MiB/s) the LUN file's allocated size drops by about 1 GiB within a minute, not at
//! once. Meanwhile node2 writes a file of its own into the space just freed (so some of its
//! blocks were queued for discard when it took them): every byte of it reads back, and fsck is
//! clean. Mounted `nodiscard`, a delete leaves the LUN file as it was, and `cetra trim` (the
//! `FITRIM` ioctl, as `fstrim`) gives the space back at once. A VM's TRIM (a hole punched in
//! its image, open for writing on its node) and its write-zeroes need no cluster lock: they go
//! on, and the space reaches the LUN, while another node that died holding the global lock is
//! not recovered yet.

use cetrafs_tests::{bin, poll_until, require_fuse, run, Lun, Mount};
use std::io::{Read as _, Write as _};
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{FileExt as _, MetadataExt as _};
use std::process::Command;
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;
const MIB: usize = 1 << 20;

/// Bytes the LUN file holds on the host (`du`).
fn allocated(lun: &Lun) -> u64 {
    std::fs::metadata(lun.path())
        .expect("stat the LUN file")
        .blocks()
        * 512
}

/// Block `i` of node2's file: its index in every 8 bytes.
fn pattern(i: u64) -> Vec<u8> {
    (0..MIB / 8).flat_map(|_| i.to_le_bytes()).collect()
}

#[test]
fn a_deleted_file_gives_its_space_back_to_the_lun_at_the_discard_rate() {
    require_fuse!();
    let lun = Lun::new(3 * GIB);
    lun.mkfs(&["-N", "4"]);
    let node1 = Mount::new(&lun, "node1");
    let node2 = Mount::new(&lun, "node2");
    {
        let mut f = std::fs::File::create(node1.p("big")).expect("create big");
        let chunk = vec![0x5Au8; 4 * MIB];
        for _ in 0..GIB / chunk.len() as u64 {
            f.write_all(&chunk).expect("write big");
        }
        f.sync_all().expect("fsync big");
    }
    let full = allocated(&lun);
    assert!(
        full >= GIB,
        "the LUN holds {full} bytes after a 1 GiB write"
    );
    std::fs::remove_file(node1.p("big")).expect("delete big");
    let deleted = Instant::now();

    // node2 writes 128 MiB into the space node1 just freed, while its discard runs.
    let blocks = 128u64;
    {
        let mut f = std::fs::File::create(node2.p("mine")).expect("create mine");
        for i in 0..blocks {
            f.write_all(&pattern(i)).expect("write mine");
        }
        f.sync_all().expect("fsync mine");
    }

    let target = full - (GIB - 64 * MIB as u64) + 128 * MIB as u64;
    let took =
        poll_until(Duration::from_mins(1), || allocated(&lun) <= target).unwrap_or_else(|| {
            panic!(
                "the LUN file still holds {} MiB a minute after the delete (was {} MiB)",
                allocated(&lun) >> 20,
                full >> 20
            )
        });
    let elapsed = deleted.elapsed().max(took);
    eprintln!(
        "LUN file: {} MiB allocated before the delete, {} MiB {:.1} s after it",
        full >> 20,
        allocated(&lun) >> 20,
        elapsed.as_secs_f64()
    );
    // 1 GiB at 64 MiB/s takes about 16 s: much sooner means no rate limit.
    assert!(
        elapsed >= Duration::from_secs(8),
        "1 GiB discarded in {elapsed:?}: faster than the default rate allows"
    );

    let mut back = Vec::new();
    std::fs::File::open(node1.p("mine"))
        .and_then(|mut f| f.read_to_end(&mut back))
        .expect("read mine through node1");
    assert_eq!(back.len() as u64, blocks * MIB as u64);
    for (i, chunk) in (0..).zip(back.chunks(MIB)) {
        assert!(chunk == pattern(i), "MiB {i} of node2's file changed");
    }
    node1.unmount();
    node2.unmount();
    lun.assert_fsck_clean();
}

#[test]
fn cetra_trim_gives_back_what_nodiscard_kept() {
    require_fuse!();
    let lun = Lun::new(2 * GIB);
    lun.mkfs(&["-N", "4"]);
    let node = Mount::with_opts(&lun, "node1", &["nodiscard"]);
    {
        let mut f = std::fs::File::create(node.p("f")).expect("create f");
        let chunk = vec![0xA5u8; 4 * MIB];
        for _ in 0..64 {
            f.write_all(&chunk).expect("write f");
        }
        f.sync_all().expect("fsync f");
    }
    std::fs::write(node.p("kept"), b"kept").expect("write kept");
    let full = allocated(&lun);
    std::fs::remove_file(node.p("f")).expect("delete f");
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        allocated(&lun) + 16 * MIB as u64 >= full,
        "nodiscard: the LUN file went from {full} to {} bytes",
        allocated(&lun)
    );
    // Right after the delete, with its free perhaps not committed yet.
    let r = run(Command::new(bin("cetra"))
        .args(["trim", "--json"])
        .arg(node.path()));
    assert_eq!(r.code, 0, "cetra trim: {}", r.output());
    let out: serde_json::Value = serde_json::from_str(&r.stdout).expect("cetra trim --json");
    let trimmed = out["trimmed_bytes"].as_u64().expect("trimmed_bytes");
    assert!(trimmed >= 256 << 20, "trimmed {trimmed} bytes: {out}");
    let after = allocated(&lun);
    assert!(
        after + (240 << 20) <= full,
        "the LUN file holds {after} bytes after cetra trim, {full} before"
    );
    assert_eq!(std::fs::read(node.p("kept")).expect("read kept"), b"kept");
    // Anything but a CetraFS mountpoint is refused (FITRIM there would trim its filesystem).
    let r = run(Command::new(bin("cetra")).args(["trim"]).arg(lun.dir()));
    assert_eq!(r.code, 1, "{}", r.output());
    assert!(
        r.stderr.contains("not a CetraFS mountpoint"),
        "{}",
        r.output()
    );
    node.unmount();
    lun.assert_fsck_clean();
}

/// What a guest's TRIM arrives as through QEMU (`discard=unmap` on a raw image).
const PUNCH: libc::c_int = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
/// What its write-zeroes arrive as (`detect-zeroes=on`).
const ZERO: libc::c_int = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;

fn fallocate(f: &std::fs::File, mode: libc::c_int, offset: u64, len: u64) {
    let (off, n) = (
        libc::off_t::try_from(offset).expect("offset"),
        libc::off_t::try_from(len).expect("length"),
    );
    // SAFETY: fallocate on a descriptor this test owns; no memory is passed.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, off, n) };
    assert_eq!(
        r,
        0,
        "fallocate mode {mode:#x} of {len} bytes at {offset}: {}",
        std::io::Error::last_os_error()
    );
}

#[test]
fn a_vms_trim_goes_on_while_a_dead_node_holds_the_global_lock() {
    require_fuse!();
    let lun = Lun::new(GIB);
    // Test timings: dead time 5.2 s.
    lun.mkfs(&[
        "--heartbeat-interval",
        "100",
        "--io-timeout",
        "500",
        "-N",
        "4",
    ]);
    let node1 = Mount::new(&lun, "node1");
    let node2 = Mount::new(&lun, "node2");
    // node1's VM image: 64 MiB thin, 32 MiB written, open for writing as the VM keeps it.
    let img = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(node1.p("img"))
        .expect("create img");
    img.set_len(64 * MIB as u64).expect("size img");
    for i in 0..32u64 {
        img.write_all_at(&vec![0xA5; MIB], i * MIB as u64)
            .expect("write img");
    }
    img.sync_all().expect("fsync img");
    for d in ["x", "y"] {
        std::fs::create_dir(node1.p(d)).expect("mkdir on node1");
    }
    std::fs::write(node1.p("x/g"), b"g").expect("write x/g");
    let full = allocated(&lun);
    // node2 takes the global lock exclusively (a move between directories always does,
    // docs/locking.md §15) and dies holding it.
    for d in ["a", "b"] {
        std::fs::create_dir(node2.p(d)).expect("mkdir on node2");
    }
    std::fs::write(node2.p("a/f"), b"f").expect("write a/f");
    std::fs::rename(node2.p("a/f"), node2.p("b/f")).expect("rename on node2");
    node2
        .abandon(Some(libc::SIGKILL))
        .expect("kill node2's daemon");
    let killed = Instant::now();
    // The guest trims every other MiB of what it wrote and flushes.
    for i in (0..32u64).step_by(2) {
        fallocate(&img, PUNCH, i * MIB as u64, MIB as u64);
    }
    // And its write-zeroes (QEMU's `detect-zeroes`) of MiB 1.
    fallocate(&img, ZERO, MIB as u64, MIB as u64);
    img.sync_all().expect("fsync img after the trim");
    let trimmed = killed.elapsed();
    // The trim reaches the LUN (default discard rate: 64 MiB/s) before node2 is recovered.
    let discarded = poll_until(Duration::from_secs(3), || {
        allocated(&lun) + 12 * MIB as u64 <= full
    });
    let discarded_at = killed.elapsed();
    // What needs the global lock waits for node2's recovery: it really held it.
    std::fs::rename(node1.p("x/g"), node1.p("y/g")).expect("rename on node1");
    let waited = killed.elapsed();
    eprintln!(
        "16 MiB trimmed and 1 MiB zeroed {:.2} s after node2's death, on the LUN at {:.2} s ({} -> {} MiB); \
         a move between directories waited {:.2} s",
        trimmed.as_secs_f64(),
        discarded_at.as_secs_f64(),
        full >> 20,
        allocated(&lun) >> 20,
        waited.as_secs_f64()
    );
    assert!(
        waited >= Duration::from_secs(4),
        "node1's move needed node2's global lock only {waited:?} after node2 died: the test \
         did not leave the lock with the dead node"
    );
    assert!(
        trimmed < Duration::from_secs(3),
        "the trim took {trimmed:?}: it waited for the dead node's global lock"
    );
    assert!(
        discarded.is_some(),
        "the trimmed space was not given back to the LUN within 3 s ({} -> {} MiB)",
        full >> 20,
        allocated(&lun) >> 20
    );
    let mut back = vec![0u8; 32 * MIB];
    img.read_exact_at(&mut back, 0).expect("read img");
    for (i, chunk) in (0u64..).zip(back.chunks(MIB)) {
        let want = if i % 2 == 0 || i == 1 { 0 } else { 0xA5 };
        assert!(chunk.iter().all(|&x| x == want), "MiB {i} of the image");
    }
    drop(img);
    node1.unmount();
    lun.assert_fsck_clean();
}
