//! Group marks (format 7, `fs/group_marks.rs`), with two nodes on one memory device.

use super::detached_tests::{gml, node, thin_image};
use super::multinode_tests::{assert_fsck_clean, test_mkfs, volume, volume_with};
use super::*;
use crate::dev::mem::MemDevice;
use crate::format::lock_record::LockMode;
use crate::mkfs::{GroupRules, MkfsOptions};
use std::time::{Duration, Instant};

const C: Caller = Caller::ROOT;
const MIB: u64 = 1 << 20;

/// The test pattern's MiB at byte `off` (a multiple of a MiB).
fn pattern(off: u64) -> Vec<u8> {
    (0..MIB)
        .map(|i| ((off / MIB + i / 4096) % 251) as u8)
        .collect()
}

/// Group records whose mark names `v`.
fn marked_by(v: &Volume) -> Vec<u64> {
    let recs = v.cl.locks.group_records().unwrap();
    (0u64..)
        .zip(recs)
        .filter(|(_, r)| r.next == v.cl.me.slot)
        .map(|(g, _)| g)
        .collect()
}

/// The end of a growth test: b reads the first `total` bytes of a's image `ino` (a writes its
/// inode home when b asks for its lock) and finds the test pattern; both unmount; fsck is
/// clean.
fn b_reads_back_and_both_unmount(
    dev: &Arc<MemDevice>,
    a: &Volume,
    b: &Volume,
    ino: Ino,
    fh: &Arc<OpenFile>,
    total: u64,
) {
    let bfh = b.open(ino, false, false).unwrap();
    for off in (0..total).step_by(usize::try_from(MIB).unwrap()) {
        let mut got = Vec::new();
        b.read(&bfh, off, 1 << 20, &mut |d| got.extend_from_slice(d))
            .unwrap();
        assert!(got == pattern(off), "b read other bytes at {off}");
    }
    b.release(&bfh).unwrap();
    a.release(fh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(dev);
}

/// The point of marks: a thin image grows through several pool refills while another node
/// holds the global lock exclusively (as a node that died holding it would, until it is
/// recovered). Before format 7 the first refill waited for the global lock.
#[test]
fn a_thin_image_outgrows_its_pool_while_another_node_holds_the_global_lock() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    assert!(a.sb.has_group_marks());
    let (f, fh) = thin_image(&a, b"img");
    a.write(&fh, 0, &pattern(0)).unwrap();
    let pool = a.lock_meta().pool_available() * FS_BLOCK;
    assert!(pool > 0, "no pool after the first write");
    b.mkdir(b.root_ino(), b"d", 0o755, C).unwrap();
    assert_eq!(gml(&b), LockMode::Exclusive);
    // Four pools' worth: at least three refills, each from one of a's own groups.
    let total = (4 * pool).div_ceil(MIB) * MIB + MIB;
    let t = Instant::now();
    for off in (MIB..total).step_by(usize::try_from(MIB).unwrap()) {
        a.write(&fh, off, &pattern(off)).unwrap();
    }
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "the growth took {:?}",
        t.elapsed()
    );
    assert_eq!(gml(&a), LockMode::Free, "a refill took the global lock");
    assert_eq!(gml(&b), LockMode::Exclusive);
    assert!(marked_by(&a).is_empty(), "a refill left its mark");
    b_reads_back_and_both_unmount(&dev, &a, &b, f.ino, &fh, total);
}

/// b's unlink on a thread of its own.
type Unlinker = std::thread::JoinHandle<Result<()>>;

/// Two nodes: a wrote an 8 MiB file `old` into the groups it owns and put its mark on each
/// of them (a refill in progress, or a node that died in one); b unlinks `old` on a thread,
/// and 600 ms later still waits for a's marks. Returns the device, a, b, a's groups and the
/// unlink's thread.
fn unlink_in_marked_groups() -> (Arc<MemDevice>, Arc<Volume>, Arc<Volume>, Vec<u64>, Unlinker) {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let (old, fh) = a.create(a.root_ino(), b"old", 0o644, C, true).unwrap();
    for off in (0..8 * MIB).step_by(usize::try_from(MIB).unwrap()) {
        a.write(&fh, off, &pattern(off)).unwrap();
    }
    a.release(&fh).unwrap();
    a.fsync(old.ino, false).unwrap();
    let mine: Vec<u64> = a
        .lock_meta()
        .groups()
        .mine_by_free()
        .into_iter()
        .map(|(g, _)| g)
        .collect();
    assert!(!mine.is_empty(), "a owns no group");
    for &g in &mine {
        let m = a.cl.locks.mark_group(g, a.cl.me, true).unwrap();
        assert_eq!(m, crate::cluster::lock::GroupMark::Marked);
    }
    let unlinker = {
        let b = b.clone();
        std::thread::spawn(move || b.unlink(b.root_ino(), b"old"))
    };
    std::thread::sleep(Duration::from_millis(600));
    assert!(
        !unlinker.is_finished(),
        "the unlink did not wait for a's mark"
    );
    (dev, a, b, mine, unlinker)
}

/// A free into a group another node owns needs the group's mark: while the owner's mark is
/// on it (a refill in progress) the free waits (before it removes the name); once the mark
/// is gone it goes through, under this node's mark, which the global lock's handoff takes off
/// again. The owner's next refill from that group sees the free.
#[test]
fn a_free_into_another_nodes_group_waits_for_its_mark() {
    let (dev, a, b, mine, unlinker) = unlink_in_marked_groups();
    for &g in &mine {
        a.cl.locks.unmark_group(g, a.cl.me, None).unwrap();
    }
    unlinker.join().unwrap().unwrap();
    assert_eq!(
        b.lookup(b.root_ino(), b"old").unwrap_err().kind(),
        ErrorKind::NotFound
    );
    let borrowed = marked_by(&b);
    assert!(
        !borrowed.is_empty(),
        "b freed into a's groups without a mark"
    );
    assert!(borrowed.iter().all(|g| mine.contains(g)));
    // a takes the global lock: b's handoff takes its marks off.
    let (_, fh) = thin_image(&a, b"img");
    a.write(&fh, 0, &pattern(0)).unwrap();
    assert!(marked_by(&b).is_empty(), "the handoff left b's marks");
    assert!(a.lock_meta().pool_available() > 0, "no pool after a write");
    // b takes it back and keeps it (a move between directories needs it); a's refills
    // reuse what b freed (re-reading the groups).
    b.mkdir(b.root_ino(), b"d", 0o755, C).unwrap();
    let e = b.mkdir(b.root_ino(), b"e", 0o755, C).unwrap();
    b.rename(b.root_ino(), b"d", e.ino, b"d", RenameFlags::default())
        .unwrap();
    assert_eq!(gml(&b), LockMode::Exclusive);
    let free_before = a.lock_meta().free_blocks();
    for off in (MIB..24 * MIB).step_by(usize::try_from(MIB).unwrap()) {
        a.write(&fh, off, &pattern(off)).unwrap();
    }
    assert_eq!(gml(&a), LockMode::Free);
    assert!(a.lock_meta().free_blocks() < free_before);
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

/// A free that waits for another node's mark holds no lock meanwhile: the owner may have died
/// in a refill, and then its mark stays until its recovery, a dead time (84 s by default).
/// The unlink waits a moment under the global lock, then gives it up with the metadata mutex
/// and waits outside (`Volume::wait_for_group_mark`); the other node's namespace changes, a
/// move between directories among them, and its own node's go on. Before, the unlink waited
/// holding both, and every node's metadata waited with it.
#[test]
fn a_free_waiting_for_a_mark_holds_no_global_lock() {
    let (dev, a, b, mine, unlinker) = unlink_in_marked_groups();
    let others = {
        let (a, b) = (a.clone(), b.clone());
        std::thread::spawn(move || {
            let t = Instant::now();
            let d = a.mkdir(a.root_ino(), b"d", 0o755, C)?;
            let e = a.mkdir(a.root_ino(), b"e", 0o755, C)?;
            a.rename(a.root_ino(), b"d", e.ino, b"d", RenameFlags::default())?;
            b.mkdir(b.root_ino(), b"f", 0o755, C)?;
            Ok::<_, Error>((d.ino, t.elapsed()))
        })
    };
    let t = Instant::now();
    // Three handoffs of the global lock and a few of inode locks: milliseconds, but a loaded
    // 2-core machine may stretch them; the mark itself would stay 33 s.
    while !others.is_finished() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let in_time = others.is_finished();
    let still_waiting = !unlinker.is_finished();
    for &g in &mine {
        a.cl.locks.unmark_group(g, a.cl.me, None).unwrap();
    }
    let (_, took) = others.join().unwrap().unwrap();
    unlinker.join().unwrap().unwrap();
    assert!(
        in_time && still_waiting,
        "the others' changes took {took:?} while b's unlink waited for a's mark"
    );
    assert_eq!(
        b.lookup(b.root_ino(), b"old").unwrap_err().kind(),
        ErrorKind::NotFound
    );
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

/// Group records that name `v` as their owner.
fn owned_by(v: &Volume) -> Vec<u64> {
    let recs = v.cl.locks.group_records().unwrap();
    (0u64..)
        .zip(recs)
        .filter(|(_, r)| r.mode == LockMode::Exclusive && r.owner == v.cl.me.slot)
        .map(|(g, _)| g)
        .collect()
}

/// Grow a thin image on a by three times its groups' worth while b holds the global lock
/// exclusively, on a volume of 16 MiB groups made with or without group claims. Returns
/// whether a took the global lock meanwhile, and the groups a owned before and after.
fn outgrow_own_groups(claims: bool) -> (bool, Vec<u64>, Vec<u64>) {
    let dev = volume_with(&MkfsOptions {
        group_bytes: Some(16 << 20),
        group_rules: if claims {
            GroupRules::Claims
        } else {
            GroupRules::Marks
        },
        ..test_mkfs(4)
    });
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    assert_eq!(a.sb.has_group_claims(), claims);
    let (f, fh) = thin_image(&a, b"img");
    a.write(&fh, 0, &pattern(0)).unwrap();
    let before = owned_by(&a);
    b.mkdir(b.root_ino(), b"d", 0o755, C).unwrap();
    assert_eq!(gml(&b), LockMode::Exclusive);
    let total = 3 * u64::try_from(before.len()).unwrap() * (16 << 20) + MIB;
    let mut took_global = false;
    for off in (MIB..total).step_by(usize::try_from(MIB).unwrap()) {
        a.write(&fh, off, &pattern(off)).unwrap();
        took_global |= gml(&a) != LockMode::Free;
    }
    let after = owned_by(&a);
    assert!(
        marked_by(&a).is_empty(),
        "a refill left its mark on {:?} (owned {before:?} -> {after:?}, took the global lock: {took_global})",
        marked_by(&a)
    );
    b_reads_back_and_both_unmount(&dev, &a, &b, f.ino, &fh, total);
    (took_global, before, after)
}

/// Format 8: once a node's own groups are full, its refills claim groups nobody owns without
/// the global lock (one CAW each), so a thin image keeps growing while another node holds
/// the global lock (or lies dead holding it). On format 7 the same growth takes the global
/// lock once the node's groups are full (from a live holder, as here; a dead one's recovery
/// would be waited for).
#[test]
fn a_thin_image_outgrows_its_nodes_groups_while_another_node_holds_the_global_lock() {
    let (took_global, before, after) = outgrow_own_groups(true);
    assert!(!took_global, "format 8: a refill took the global lock");
    assert!(
        after.len() >= before.len() + 2,
        "a claimed no groups of its own: {before:?} -> {after:?}"
    );
    let (took_global, _, _) = outgrow_own_groups(false);
    assert!(
        took_global,
        "format 7 grew past a's groups without the global lock"
    );
}
