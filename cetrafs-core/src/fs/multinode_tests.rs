//! Several nodes (several `Volume`s) on one memory device: coherence through the global
//! metadata lock, open registrations, deferred frees and recovery of a dead node. The same
//! scenarios run through FUSE with separate daemon processes in tests/tests/multinode.rs.

use super::inflight_tests::Gated;
use super::*;
use crate::cluster::lock::LockTable;
use crate::dev::mem::MemDevice;
use crate::mkfs::{format, MkfsOptions};
use std::time::Duration;

const C: Caller = Caller::ROOT;

pub(super) fn volume(nodes: u32) -> Arc<MemDevice> {
    volume_with(&test_mkfs(nodes))
}

/// The mkfs options of [`volume`]: `nodes` slots, 1 MiB journals, test timings.
pub(super) fn test_mkfs(nodes: u32) -> MkfsOptions {
    MkfsOptions {
        max_nodes: nodes,
        journal_bytes: 1 << 20,
        heartbeat_interval_ms: 50,
        io_timeout_ms: 100,
        ..Default::default()
    }
}

/// A 512 MiB memory volume made with `opts`.
pub(super) fn volume_with(opts: &MkfsOptions) -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(512 << 20, 512));
    format(&*dev, opts, &mut |_, _| {}).unwrap();
    dev
}

/// A node that keeps idle locks until asked (`IdleLocks::Keep`): for tests that show what one
/// node does while another holds a lock, however slowly they run.
pub(super) fn node_keeping(dev: &Arc<MemDevice>, host: &str) -> Arc<Volume> {
    Volume::mount(
        dev.clone(),
        &MountOptions {
            host: host.into(),
            idle_locks: IdleLocks::Keep,
            ..MountOptions::default()
        },
    )
    .unwrap()
}

pub(super) fn node(dev: &Arc<MemDevice>, host: &str) -> Arc<Volume> {
    Volume::mount(
        dev.clone(),
        &MountOptions {
            host: host.into(),
            ..MountOptions::default()
        },
    )
    .unwrap()
}

/// A node mounted read-only.
pub(super) fn read_only_node(dev: &Arc<MemDevice>, host: &str) -> Arc<Volume> {
    Volume::mount(
        dev.clone(),
        &MountOptions {
            host: host.into(),
            read_only: true,
            ..MountOptions::default()
        },
    )
    .unwrap()
}

/// fsck of the shared device finds nothing (every node unmounted or dead).
pub(super) fn assert_fsck_clean(dev: &MemDevice) {
    let report = crate::check::check_volume(dev).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
}

pub(super) fn read_all(v: &Volume, fh: &OpenFile, len: u32) -> Vec<u8> {
    let mut out = Vec::new();
    v.read(fh, 0, len, &mut |d| out.extend_from_slice(d))
        .unwrap();
    out
}

#[test]
fn changes_on_one_node_are_seen_by_the_other() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"f", 0o644, C, true).unwrap();
    a.write(&fh, 0, b"hello from a").unwrap();
    a.fsync(f.ino, false).unwrap();
    let seen = b.lookup(r, b"f").unwrap();
    assert_eq!(seen.ino, f.ino);
    assert_eq!(seen.size, 12);
    let bfh = b.open(f.ino, false, false).unwrap();
    assert_eq!(read_all(&b, &bfh, 100), b"hello from a");
    // a extends the file; b (holding it open) reads the new bytes.
    a.write(&fh, 12, b", and more").unwrap();
    a.fsync(f.ino, false).unwrap();
    assert_eq!(read_all(&b, &bfh, 100), b"hello from a, and more");
    b.rename(r, b"f", r, b"g", RenameFlags::default()).unwrap();
    assert_eq!(a.lookup(r, b"f").unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(a.lookup(r, b"g").unwrap().ino, f.ino);
    a.setxattr(f.ino, b"user.k", b"v", false, false).unwrap();
    assert_eq!(b.getxattr(f.ino, b"user.k").unwrap(), b"v");
    let d = b.mkdir(r, b"dir", 0o755, C).unwrap();
    assert_eq!(a.lookup(r, b"dir").unwrap().ino, d.ino);
    b.release(&bfh).unwrap();
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

#[test]
fn writers_on_two_nodes_are_refused_unless_nofilelock() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"img", 0o644, C, true).unwrap();
    let e = b.open(f.ino, true, false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    assert!(
        e.to_string().contains("\"a\"") || e.to_string().contains(" a"),
        "{e}"
    );
    let ro = b.open(f.ino, false, false).unwrap();
    // b's cached block map is revalidated after a shrinks the file under it.
    a.write(&fh, 0, &[1u8; 8192]).unwrap();
    assert_eq!(read_all(&b, &ro, 10_000), vec![1u8; 8192]);
    let shrink = SetAttr {
        size: Some(4096),
        ..Default::default()
    };
    a.setattr(f.ino, &shrink, C).unwrap();
    assert_eq!(read_all(&b, &ro, 10_000), vec![1u8; 4096]);
    b.release(&ro).unwrap();
    a.release(&fh).unwrap();
    let w = b.open(f.ino, true, false).unwrap();
    b.release(&w).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    let opts = |h: &str| MountOptions {
        host: h.into(),
        file_locks: false,
        ..MountOptions::default()
    };
    let a = Volume::mount(dev.clone(), &opts("a")).unwrap();
    let b = Volume::mount(dev.clone(), &opts("b")).unwrap();
    let w1 = a.open(f.ino, true, false).unwrap();
    let w2 = b.open(f.ino, true, false).unwrap();
    a.release(&w1).unwrap();
    b.release(&w2).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
}

/// One appended record of [`append_record`]: writer, sequence, length, then a pattern.
fn append_record(writer: u8, seq: u32, len: usize) -> Vec<u8> {
    let mut r = vec![0u8; len];
    r[0] = b'R';
    r[1] = writer;
    r[2..6].copy_from_slice(&seq.to_le_bytes());
    r[6..10].copy_from_slice(&u32::try_from(len).unwrap().to_le_bytes());
    for (i, b) in r.iter_mut().enumerate().skip(10) {
        *b = i.to_le_bytes()[0] ^ writer.wrapping_mul(37) ^ seq.to_le_bytes()[0];
    }
    r
}

/// Appends from two `nofilelock` nodes at once, each node's cache of the file stale whenever
/// the other appended: every record lands once, whole, at the size under the lock (never at
/// the size the appending node last knew), and a third node reads them all back. Record
/// lengths mix partial-block appends (read-modify-write of the written tail block) with
/// whole-block ones (allocating writes).
#[test]
fn appends_from_two_nofilelock_nodes_never_overlap() {
    const PER_NODE: u32 = 150;
    let dev = volume(4);
    let opts = |h: &str| MountOptions {
        host: h.into(),
        file_locks: false,
        ..MountOptions::default()
    };
    let a = Volume::mount(dev.clone(), &opts("a")).unwrap();
    let b = Volume::mount(dev.clone(), &opts("b")).unwrap();
    let r = a.root_ino();
    let (f, fa) = a.create(r, b"log", 0o644, C, true).unwrap();
    let fb = b.open(f.ino, true, false).unwrap();
    // b learns the size (4096) and a written extent at [0, 4096); a then appends, so b's
    // cached size is stale: an aligned write at b's idea of the end would take the fast path
    // and overwrite a's record.
    let w = a.write_by(&fa, WriteAt::End, &[1u8; 4096], &C).unwrap();
    assert_eq!((w.offset, w.bytes), (0, 4096));
    assert_eq!(read_all(&b, &fb, 8192), vec![1u8; 4096]);
    let w = a.write_by(&fa, WriteAt::End, &[2u8; 4096], &C).unwrap();
    assert_eq!(w.offset, 4096);
    let w = b.write_by(&fb, WriteAt::End, &[3u8; 4096], &C).unwrap();
    assert_eq!(w.offset, 8192, "b appended at its stale size");
    let head = 3 * 4096;
    let lens = [100usize, 4096, 1000, 8192, 3000];
    std::thread::scope(|s| {
        for (k, (v, fh)) in [(&a, &fa), (&b, &fb)].into_iter().enumerate() {
            s.spawn(move || {
                let w = u8::try_from(k + 1).unwrap();
                for seq in 0..PER_NODE {
                    let rec = append_record(w, seq, lens[seq as usize % lens.len()]);
                    let got = v.write_by(fh, WriteAt::End, &rec, &C).unwrap();
                    assert_eq!(got.bytes as usize, rec.len());
                }
            });
        }
    });
    let total: usize = head
        + 2 * (0..PER_NODE as usize)
            .map(|i| lens[i % lens.len()])
            .sum::<usize>();
    a.release(&fa).unwrap();
    b.release(&fb).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    let c = node(&dev, "c");
    let fc = c.open(f.ino, false, false).unwrap();
    assert_eq!(c.getattr(f.ino).unwrap().size, total as u64);
    let data = read_all(&c, &fc, u32::try_from(total + 4096).unwrap());
    assert_eq!(data.len(), total);
    let mut want = vec![1u8; 4096];
    want.extend([2u8; 4096]);
    want.extend([3u8; 4096]);
    assert_eq!(data[..head], want[..]);
    let mut next = [0u32; 2];
    let mut pos = head;
    while pos < total {
        let rec = &data[pos..];
        assert_eq!(rec[0], b'R', "no record at byte {pos}");
        let (w, seq) = (rec[1], u32::from_le_bytes(rec[2..6].try_into().unwrap()));
        let len = u32::from_le_bytes(rec[6..10].try_into().unwrap()) as usize;
        assert!((1..=2).contains(&w), "writer {w} at byte {pos}");
        // Each node's appends are in its own order: its next one starts after its last.
        assert_eq!(seq, next[usize::from(w - 1)], "writer {w} at byte {pos}");
        assert_eq!(
            &rec[..len],
            &append_record(w, seq, len)[..],
            "record at byte {pos}"
        );
        next[usize::from(w - 1)] += 1;
        pos += len;
    }
    assert_eq!(next, [PER_NODE; 2]);
    c.release(&fc).unwrap();
    c.unmount().unwrap();
    assert_fsck_clean(&dev);
}

#[test]
fn a_file_unlinked_on_one_node_lives_while_open_on_another() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"tmp", 0o644, C, true).unwrap();
    a.write(&fh, 0, &vec![7u8; 20000]).unwrap();
    a.release(&fh).unwrap();
    let bfh = b.open(f.ino, false, false).unwrap();
    a.unlink(r, b"tmp").unwrap();
    // Reuse pressure on a: new files must not take the open file's blocks.
    for i in 0..20 {
        let (_, h) = a
            .create(r, format!("n{i}").as_bytes(), 0o644, C, true)
            .unwrap();
        a.write(&h, 0, &vec![9u8; 20000]).unwrap();
        a.release(&h).unwrap();
    }
    assert_eq!(read_all(&b, &bfh, 20000), vec![7u8; 20000]);
    b.release(&bfh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    let report = crate::check::check_volume(&*dev).unwrap();
    assert!(
        report.is_clean() && !report.has(crate::check::FindingKind::Orphan),
        "{:?}",
        report.findings
    );
}

#[test]
fn a_dead_node_is_recovered_by_a_survivor() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"durable", 0o644, C, true).unwrap();
    a.write(&fh, 0, b"fsynced").unwrap();
    a.fsync(f.ino, false).unwrap();
    // a dies holding the global lock with a committed journal: its heartbeat stops.
    let (t, _) = a.create(r, b"t", 0o644, C, true).unwrap();
    a.fsync(t.ino, false).unwrap();
    a.member.fence("test: simulated crash".into());
    let started = std::time::Instant::now();
    // b's next metadata operation waits for the recovery of a.
    let seen = b.lookup(r, b"durable").unwrap();
    assert_eq!(seen.size, 7);
    assert!(b.lookup(r, b"t").is_ok());
    let waited = started.elapsed();
    let dead = crate::cluster::Timing::from_ms(50, 100).dead_time();
    assert!(
        waited >= dead / 2 && waited < dead * 4,
        "recovered after {waited:?} (dead time {dead:?})"
    );
    // The watcher finishes the recovery (orphans, slot) after the locks are released.
    let state_of_a = || {
        let views = crate::cluster::membership::scan(&*dev, &a.sb).unwrap();
        views[a.slot() as usize].record.as_ref().unwrap().state
    };
    let t0 = std::time::Instant::now();
    while state_of_a() != crate::format::heartbeat::SlotState::Free {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "slot of a not freed: {:?}",
            state_of_a()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    b.mkdir(r, b"after", 0o755, C).unwrap();
    drop(fh);
    b.unmount().unwrap();
    std::thread::sleep(Duration::from_millis(10));
    assert_fsck_clean(&dev);
}

#[test]
fn a_node_short_of_groups_gets_one_back_from_their_owner() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    a.mkdir(r, b"a0", 0o755, C).unwrap();
    // a takes every group nobody owns (and learns that it did, as its own claims would).
    for g in 0..a.sb.group_count {
        let _ = a.cl.locks.claim_group(g, a.cl.me).unwrap();
    }
    a.read_group_records(&mut a.lock_meta(), super::cluster::GroupRecords::AllNow);
    let owner_of = |g: u64| a.cl.locks.group_records().unwrap()[usize::try_from(g).unwrap()].owner;
    assert!((0..a.sb.group_count).all(|g| owner_of(g) == a.slot()));
    a.mkdir(r, b"a1", 0o755, C).unwrap();
    // b works: it finds no free group and asks for one; a gives it back at its next grant
    // that reads its own groups' records (at most once a second, fs/cluster.rs); b takes it
    // at its next exclusive grant once it reads every record again (a second later).
    let mut got = None;
    for i in 0..40 {
        std::thread::sleep(Duration::from_millis(100));
        b.mkdir(r, format!("b{i}").as_bytes(), 0o755, C).unwrap();
        a.mkdir(r, format!("a{}", i + 2).as_bytes(), 0o755, C)
            .unwrap();
        got = (0..a.sb.group_count).find(|&g| owner_of(g) == b.slot());
        if got.is_some() {
            break;
        }
    }
    assert!(got.is_some(), "b never got a group back from a");
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

/// A group an owner gave back to a node short of space stays out of the owner's own claims
/// (`GroupReads::given_back_for`): an owner short of space itself used to claim it again at
/// its next grant (the emptiest unowned group), before the asker could, for as long as the
/// asker asked.
#[test]
fn an_owner_does_not_claim_the_group_it_gave_back() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    a.mkdir(r, b"a0", 0o755, C).unwrap();
    for g in 0..a.sb.group_count {
        let _ = a.cl.locks.claim_group(g, a.cl.me).unwrap();
    }
    a.read_group_records(&mut a.lock_meta(), super::cluster::GroupRecords::AllNow);
    let unowned_here = |v: &Volume| {
        let mut m = v.lock_meta();
        (0..v.sb.group_count)
            .find(|&g| m.groups().class(g) == Some(crate::alloc::GroupClass::Unowned))
    };
    let mut given = None;
    for i in 0..40 {
        std::thread::sleep(Duration::from_millis(100));
        b.mkdir(r, format!("b{i}").as_bytes(), 0o755, C).unwrap();
        a.mkdir(r, format!("a{}", i + 1).as_bytes(), 0o755, C)
            .unwrap();
        given = unowned_here(&a);
        if given.is_some() {
            break;
        }
    }
    let g = given.expect("a never gave a group back to b");
    let claimable = a.claimable_groups(&mut a.lock_meta());
    assert!(
        claimable.iter().all(|&(c, _)| c != g),
        "a would claim group {g} it just gave back: {claimable:?}"
    );
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

/// A grant of the global lock after another node's changes reads only this node's own
/// groups' records (at most once a second), not every group record (one read of
/// `group_count` logical blocks: 4 MiB for 8 TiB at 512-byte blocks, 32 MiB on a 4Kn LUN).
/// (The test can tell only while the loop takes under 7 s: it takes 0.2–0.4 s.)
/// Two nodes moving directories between two directories they share take the global lock
/// from each other at every move: that read used to come with each grant (measured on an
/// 8 TiB sparse file LUN through FUSE, 200 moves and mkdirs: 204 MiB read per node, 5.7 s),
/// then once a second (15 MiB, 2.7 s).
#[test]
fn grants_read_only_this_nodes_own_group_records() {
    let dev = volume_with(&MkfsOptions {
        group_bytes: Some(16 << 20),
        ..test_mkfs(4)
    });
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let x = a.mkdir(r, b"x", 0o755, C).unwrap().ino;
    let y = a.mkdir(r, b"y", 0o755, C).unwrap().ino;
    b.mkdir(r, b"z", 0o755, C).unwrap();
    let groups = a.cl.locks.group_count();
    let read = || a.cl.locks.group_records_read() + b.cl.locks.group_records_read();
    let (before, versions) = (read(), a.lock_meta().gml_version());
    let t = std::time::Instant::now();
    for i in 0..20 {
        for (v, who) in [(&a, "a"), (&b, "b")] {
            let name = format!("{who}{i}");
            v.mkdir(x, name.as_bytes(), 0o755, C).unwrap();
            v.rename(
                x,
                name.as_bytes(),
                y,
                name.as_bytes(),
                RenameFlags::default(),
            )
            .unwrap();
        }
    }
    let took = t.elapsed();
    let handoffs = a.lock_meta().gml_version() - versions;
    let read = read() - before;
    let own = [&a, &b].map(|v| v.lock_meta().groups().mine().len() as u64);
    assert!(
        handoffs >= 30,
        "only {handoffs} grants: the nodes did not alternate"
    );
    assert!(own.iter().all(|&n| n > 0), "a node owns no group: {own:?}");
    // Each node's own records, at most once a second for each kind of grant.
    let bound = own.iter().sum::<u64>() * 2 * (took.as_secs() + 1);
    assert!(
        bound < groups,
        "the bound ({bound}) must be below one read of every record ({groups})"
    );
    assert!(
        read <= bound,
        "{read} group records read in {took:?} ({handoffs} grants; {groups} groups, own {own:?}; at most {bound})"
    );
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

/// statfs on one node counts the blocks another node took since, once the records it read
/// last are `GroupReads::all_every` old (a second on a small volume): a grant reads only
/// the node's own groups' records, so statfs reads every record itself.
#[test]
fn statfs_sees_another_nodes_allocations_a_second_later() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    // b claims its group now: later grants of b, not short of space, read only its own.
    b.mkdir(r, b"b", 0o755, C).unwrap();
    assert!(!b.lock_meta().groups().mine().is_empty());
    let free0 = b.statfs().unwrap().bfree;
    let (f, fh) = a.create(r, b"f", 0o644, C, true).unwrap();
    let data = vec![7u8; 32 << 20];
    a.write(&fh, 0, &data).unwrap();
    a.fsync(f.ino, false).unwrap();
    a.release(&fh).unwrap();
    // b takes the global lock (a hands over and publishes its groups' counts).
    b.mkdir(r, b"d", 0o755, C).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    let free1 = b.statfs().unwrap().bfree;
    let taken = (32 << 20) / FS_BLOCK;
    assert!(
        free0 >= free1 + taken,
        "b's statfs: {free0} free blocks before a wrote 32 MiB, {free1} after ({taken} expected gone)"
    );
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

/// Node `host` on a [`Gated`] device over `mem`, and where its read of every group record
/// lies (offset, length).
fn parked_node(mem: &Arc<MemDevice>, host: &str) -> (Arc<Gated>, Arc<Volume>, u64, usize) {
    let sb = read_superblock(&**mem).unwrap();
    let dev = Gated::new(mem.clone());
    let shared: SharedDevice = dev.clone();
    let v = Volume::mount(
        shared,
        &MountOptions {
            host: host.into(),
            ..MountOptions::default()
        },
    )
    .unwrap();
    let lbs = u64::from(sb.logical_block_size);
    let len = usize::try_from(v.cl.locks.group_count() * lbs).unwrap();
    (dev, v, sb.lock_start * FS_BLOCK + lbs, len)
}

/// statfs reads every group record's count (256 MiB for 64 TiB on a 4Kn LUN) without this
/// node's metadata mutex: another node that wants the global lock, which this node hands
/// over only under its mutex, does not wait for that read; and the counts read are taken
/// although the lock went to the other node and came back meanwhile.
#[test]
fn statfs_reads_the_group_records_without_the_metadata_mutex() {
    let mem = volume(4);
    let (dev, a, at, len) = parked_node(&mem, "a");
    let b = node(&mem, "b");
    let r = a.root_ino();
    a.mkdir(r, b"a0", 0o755, C).unwrap();
    // The grant read every record to claim a group: the next read is due a second later.
    std::thread::sleep(Duration::from_millis(1100));
    let free0 = a.statfs().unwrap().bfree;
    // b allocates 8 MiB in its own groups and publishes their counts when a takes the lock
    // back; a's grant reads only a's own groups' records.
    let (f, fh) = b.create(r, b"f", 0o644, C, true).unwrap();
    b.write(&fh, 0, &vec![7u8; 8 << 20]).unwrap();
    b.fsync(f.ino, false).unwrap();
    b.release(&fh).unwrap();
    a.mkdir(r, b"a1", 0o755, C).unwrap();
    let taken = (8 << 20) / FS_BLOCK;
    // Only statfs's read below can tell a (a grant reads a's own groups' records, and a is
    // not short of space).
    let known = a.lock_meta().free_blocks();
    assert!(
        known + taken > free0,
        "a learned of b's blocks before statfs: {known}"
    );
    std::thread::sleep(Duration::from_millis(1100));
    dev.shut_read(at, len);
    let st = std::thread::spawn({
        let a = a.clone();
        move || a.statfs()
    });
    dev.wait_parked(1);
    let (tx, rx) = std::sync::mpsc::channel();
    let mk = std::thread::spawn({
        let b = b.clone();
        move || {
            let t = std::time::Instant::now();
            b.mkdir(r, b"b1", 0o755, C).unwrap();
            tx.send(t.elapsed()).unwrap();
        }
    });
    let waited = rx.recv_timeout(Duration::from_millis(700));
    dev.open();
    let free1 = st.join().unwrap().unwrap().bfree;
    mk.join().unwrap();
    let took = waited.expect("b's mkdir waited for a's read of the group records");
    assert!(took < Duration::from_millis(700), "{took:?}");
    assert!(
        free0 >= free1 + taken,
        "a's statfs: {free0} free blocks before b wrote 8 MiB, {free1} after ({taken} expected gone)"
    );
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&mem);
}

/// What statfs read without the metadata mutex never undoes a claim made after the read: a
/// format-8 refill claims a group without the global lock, so a record read before it says
/// the group is nobody's. Taken as read, the group would stop being this node's here while
/// its record names it. Nor does it take back a count this node saw change meanwhile.
#[test]
fn a_late_read_of_the_group_records_keeps_what_changed_meanwhile() {
    let mem = volume(4);
    let (dev, a, at, len) = parked_node(&mem, "a");
    let r = a.root_ino();
    a.mkdir(r, b"d", 0o755, C).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    dev.shut_read(at, len);
    let st = std::thread::spawn({
        let a = a.clone();
        move || a.statfs()
    });
    dev.wait_parked(1);
    // What `refill_from_claimed` does while the read waits, and what a refill publishes
    // when it takes its mark off one of this node's groups.
    let (tx, rx) = std::sync::mpsc::channel();
    let changer = std::thread::spawn({
        let a = a.clone();
        move || {
            let mut m = a.lock_meta();
            let (g, _) = m.groups().unowned_by_free()[0];
            assert!(a.cl.locks.claim_group(g, a.cl.me).unwrap());
            m.groups().set_class(g, crate::alloc::GroupClass::Mine);
            let own = *m.groups().mine().first().unwrap();
            m.groups().note_published(own, 12_345);
            tx.send((g, own)).unwrap();
        }
    });
    let changed = rx.recv_timeout(Duration::from_secs(5));
    dev.open();
    st.join().unwrap().unwrap();
    changer.join().unwrap();
    let (g, own) = changed.expect("statfs held the metadata mutex during its read");
    let mut m = a.lock_meta();
    assert_eq!(
        m.groups().class(g),
        Some(crate::alloc::GroupClass::Mine),
        "statfs's read from before the claim of group {g} took it away"
    );
    assert_eq!(
        m.groups().lvbs_seen()[usize::try_from(own).unwrap()],
        Some(12_345),
        "statfs's read took back the count published for group {own} meanwhile"
    );
    drop(m);
    a.unmount().unwrap();
    assert_fsck_clean(&mem);
}

/// A read of every group record without the global lock (a format-8 refill that claims a
/// group) takes no published count: this node's check of its own groups dates from its
/// last hold, so a count another node published since would be marked seen but not
/// applied, and then ignored at the next grant. Here b frees a file in a's group and
/// publishes the count when it gives the idle global lock back; a reads every record
/// without the lock, then takes it: a's statfs must count the freed blocks.
#[test]
fn a_read_of_the_group_records_without_the_lock_loses_no_published_count() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"f", 0o644, C, true).unwrap();
    a.write(&fh, 0, &vec![7u8; 8 << 20]).unwrap();
    a.fsync(f.ino, false).unwrap();
    a.release(&fh).unwrap();
    // a's closer gives the pool back (taking the global lock) before the test begins.
    super::detached_tests::await_pool_back(&a);
    b.unlink(r, b"f").unwrap();
    // b gives the idle global lock back after a second, publishing the count.
    std::thread::sleep(Duration::from_millis(1600));
    {
        let mut m = a.lock_meta();
        assert_eq!(
            m.gml(),
            crate::format::lock_record::LockMode::Free,
            "a still holds the global lock"
        );
        a.read_group_records(&mut m, super::cluster::GroupRecords::All);
    }
    // a's next grant reads its own groups' records (a second after its last such read).
    std::thread::sleep(Duration::from_millis(1100));
    let seen = a.statfs().unwrap().bfree;
    a.unmount().unwrap();
    b.unmount().unwrap();
    let c = node(&dev, "c");
    let truth = c.statfs().unwrap().bfree;
    c.unmount().unwrap();
    let freed = (8 << 20) / FS_BLOCK;
    assert!(
        seen + freed / 2 > truth,
        "a's statfs shows {seen} free blocks where a fresh mount finds {truth}: the {freed} blocks b freed are missing"
    );
    assert_fsck_clean(&dev);
}

#[test]
fn an_inode_number_reused_by_another_node_is_found_under_its_new_name() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (old, fh) = a.create(r, b"old", 0o644, C, true).unwrap();
    a.release(&fh).unwrap();
    // b loads it, then a deletes it; a's next inode will likely take the same block.
    assert_eq!(b.lookup(r, b"old").unwrap().ino, old.ino);
    a.unlink(r, b"old").unwrap();
    a.sync().unwrap();
    let mut reused = None;
    for i in 0..50 {
        // b reads the root each time: a's next create takes the global path (a create in a
        // directory a owns would take its inode from a's pool, not the freed block).
        assert!(b.lookup(r, b"none").is_err());
        let (n, fh) = a
            .create(r, format!("new{i}").as_bytes(), 0o644, C, true)
            .unwrap();
        a.release(&fh).unwrap();
        if n.ino == old.ino {
            reused = Some(format!("new{i}"));
            break;
        }
    }
    let name = reused.expect("the freed inode block is reused by the next creates");
    let seen = b.lookup(r, name.as_bytes()).unwrap();
    assert_eq!(seen.ino, old.ino);
    assert_eq!(b.lookup(r, b"old").unwrap_err().kind(), ErrorKind::NotFound);
    a.unmount().unwrap();
    b.unmount().unwrap();
}

mod control_damage {
    //! Issue 8, items 5 and 6: heartbeat and lock records that no live node stands behind must
    //! not keep the volume from mounting.
    use super::*;
    use crate::cluster::membership::{lba_of, read_slot};
    use crate::dev::BlockDevice;
    use crate::format::heartbeat::{Heartbeat, SlotState};
    use crate::format::lock_record::{LockMode, LockRecord, OpenEntry};
    use std::time::Instant;

    /// Mount time on this memory volume when nothing has to be waited for is milliseconds;
    /// the dead time of its timing (50 ms / 100 ms) is 1.1 s and the old failure came after
    /// the lock wait's patience (3 × dead time).
    const QUICK: Duration = Duration::from_secs(1);

    fn put_lock(dev: &MemDevice, sb: &Superblock, rec: &LockRecord) {
        dev.write_at(sb.lock_start * FS_BLOCK + rec.index * 512, &rec.encode(512))
            .unwrap();
    }

    /// A Live heartbeat of node "ghost" in `slot`, renewed once and never again, with its
    /// own (interval, io timeout) in ms.
    fn put_stopped_heartbeat(
        dev: &MemDevice,
        sb: &Superblock,
        slot: u32,
        (interval_ms, io_timeout_ms): (u32, u32),
        machine: crate::cluster::machine::MachineId,
    ) {
        let h = Heartbeat {
            state: SlotState::Live,
            generation: 1,
            counter: 1,
            nonce: 1,
            uuid: sb.uuid,
            interval_ms,
            io_timeout_ms,
            slot,
            host: "ghost".into(),
            pid: 1,
            recoverer: u32::MAX,
            recoverer_gen: 0,
            machine,
            watchdog_ms: 0,
        };
        dev.write_at(lba_of(sb, slot) * 512, &h.encode(512))
            .unwrap();
    }

    fn get_lock(dev: &Arc<MemDevice>, sb: &Superblock, index: u64) -> LockRecord {
        let d: SharedDevice = dev.clone();
        LockTable::new(d, sb).read(index).unwrap().1
    }

    fn layout(sb: &Superblock) -> crate::cluster::lock::LockLayout {
        crate::cluster::lock::LockLayout::new(sb)
    }

    fn record(sb: &Superblock, index: u64) -> LockRecord {
        let (kind, object) = layout(sb).kind_of(index);
        LockRecord::free(kind, index, object)
    }

    fn timed_mount(dev: &Arc<MemDevice>, host: &str) -> (Arc<Volume>, Duration) {
        let t = Instant::now();
        let v = node(dev, host);
        (v, t.elapsed())
    }

    #[test]
    fn locks_of_slots_that_hold_nothing_are_scrubbed_at_mount() {
        let dev = volume(4);
        let sb = read_superblock(&*dev).unwrap();
        // Record 0 held exclusively by slot 3, which was never used (the case).
        let mut g = record(&sb, 0);
        g.mode = LockMode::Exclusive;
        g.owner = 3;
        g.owner_gen = 1;
        g.version = 41;
        g.waiters.insert(2);
        put_lock(&dev, &sb, &g);
        // Group 0 owned by never-used slot 2; a writer registration of never-used slot 1.
        let mut grp = record(&sb, 1);
        grp.mode = LockMode::Exclusive;
        grp.owner = 2;
        grp.owner_gen = 5;
        put_lock(&dev, &sb, &grp);
        let ino = sb.root_ino + 1;
        let mut b = record(&sb, layout(&sb).bucket_of(ino));
        b.entries.push(OpenEntry {
            ino,
            slot: 1,
            writer: true,
            slot_gen: 9,
        });
        put_lock(&dev, &sb, &b);
        let before = crate::check::check_volume(&*dev).unwrap();
        assert!(!before.is_clean(), "fsck reports the stale owners");
        let (a, took) = timed_mount(&dev, "a");
        assert!(took < QUICK, "mount took {took:?}");
        let g = get_lock(&dev, &sb, 0);
        assert!(g.owner != 3 && !g.waiters.contains(2), "{g:?}");
        assert!(
            g.version > 41,
            "caches revalidate after a stale exclusive owner goes"
        );
        assert_ne!(get_lock(&dev, &sb, 1).owner, 2);
        assert!(get_lock(&dev, &sb, b.index)
            .entries
            .iter()
            .all(|e| e.slot != 1));
        let r = a.root_ino();
        let (f, fh) = a.create(r, b"f", 0o644, C, true).unwrap();
        a.write(&fh, 0, b"x").unwrap();
        a.release(&fh).unwrap();
        // A second node mounts while the first lives: the first's own locks are not stale.
        let (b2, took) = timed_mount(&dev, "b");
        assert!(took < QUICK, "second mount took {took:?}");
        assert_eq!(b2.lookup(r, b"f").unwrap().ino, f.ino);
        b2.unmount().unwrap();
        a.unmount().unwrap();
        let after = crate::check::check_volume(&*dev).unwrap();
        assert!(after.is_clean(), "{:?}", after.findings);
    }

    /// A node that died waiting for the global lock (its heartbeat stopped; its waiter bit
    /// stays until its dead time is up and it is recovered) holds up nobody: the holder's
    /// release passes over it, and a live waiter gets the lock at once, not after the
    /// handoff grace (2 × `io_timeout`: 16 s with the default timing, at every release).
    #[test]
    fn a_node_that_died_waiting_for_the_global_lock_holds_up_nobody() {
        let opts = MkfsOptions {
            io_timeout_ms: 2000,
            ..test_mkfs(4)
        };
        let grace = Duration::from_secs(2 * 2);
        let dev = volume_with(&opts);
        let sb = read_superblock(&*dev).unwrap();
        let a = node_keeping(&dev, "a");
        // Slot 1: another node that renewed once and stopped (its own timing puts its dead
        // time ten minutes away).
        // This machine's (a volume of one host refuses the nodes of others).
        let machine = crate::cluster::machine::MachineId::local().unwrap();
        put_stopped_heartbeat(&dev, &sb, 1, (50, 60_000), machine);
        let b = node_keeping(&dev, "b");
        assert_eq!((a.slot(), b.slot()), (0, 2));
        let r = a.root_ino();
        // a holds the global lock, and the ghost is the first waiter after a's slot.
        a.mkdir(r, b"x", 0o755, C).unwrap();
        let mut g = get_lock(&dev, &sb, 0);
        assert_eq!((g.mode, g.owner), (LockMode::Exclusive, 0));
        g.waiters.insert(1);
        put_lock(&dev, &sb, &g);
        // Both watchers find the ghost silent (3 of its 50 ms intervals).
        std::thread::sleep(Duration::from_millis(500));
        let t = Instant::now();
        b.mkdir(r, b"y", 0o755, C).unwrap();
        let took = t.elapsed();
        assert!(
            took < grace / 2,
            "b's mkdir took {took:?}: the handoff waited for the dead waiter (grace {grace:?})"
        );
        assert!(
            get_lock(&dev, &sb, 0).waiters.contains(1),
            "the ghost still waits"
        );
        b.unmount().unwrap();
        a.unmount().unwrap();
    }

    #[test]
    fn a_damaged_heartbeat_is_waited_for_its_dead_time_then_recovered() {
        let dev = volume(4);
        let sb = read_superblock(&*dev).unwrap();
        // A Live record with absurd timing and a valid checksum: every mount waited forever.
        let unknown = crate::cluster::machine::MachineId::UNKNOWN;
        put_stopped_heartbeat(&dev, &sb, 2, (1000, u32::MAX), unknown);
        let mut g = record(&sb, 0);
        g.mode = LockMode::Exclusive;
        g.owner = 2;
        g.owner_gen = 1;
        put_lock(&dev, &sb, &g);
        let dead_time = crate::cluster::Timing::from_ms(50, 100).dead_time();
        let (a, took) = timed_mount(&dev, "a");
        assert!(
            took >= dead_time,
            "a damaged slot is watched for the dead time ({took:?})"
        );
        assert!(
            took < dead_time * 3,
            "and then recovered, not waited on forever ({took:?})"
        );
        assert_ne!(a.slot(), 2, "a damaged slot is never claimed");
        let now = Heartbeat::decode(&read_slot(&*dev, &sb, 2).unwrap())
            .unwrap()
            .unwrap();
        assert_eq!((now.state, now.generation), (SlotState::Free, 1));
        assert_ne!(get_lock(&dev, &sb, 0).owner, 2);
        let (b, took) = timed_mount(&dev, "b");
        assert!(took < QUICK, "the next mount is quick again ({took:?})");
        b.unmount().unwrap();
        a.unmount().unwrap();
        let r = crate::check::check_volume(&*dev).unwrap();
        assert!(r.is_clean(), "{:?}", r.findings);
    }

    #[test]
    fn corrupted_lock_records_are_reset_only_when_no_other_node_is_alive() {
        let dev = volume(4);
        let sb = read_superblock(&*dev).unwrap();
        let a = node(&dev, "a");
        let r = a.root_ino();
        let (f, fh) = a.create(r, b"f", 0o644, C, true).unwrap();
        a.write(&fh, 0, b"kept").unwrap();
        a.release(&fh).unwrap();
        a.sync().unwrap();
        // Record 0 and f's open bucket are corrupted while a is mounted.
        let bucket = layout(&sb).bucket_of(f.ino);
        for index in [0, bucket] {
            let mut raw = record(&sb, index).encode(512);
            raw[100] ^= 0x10;
            dev.write_at(sb.lock_start * FS_BLOCK + index * 512, &raw)
                .unwrap();
        }
        let e = Volume::mount(
            dev.clone(),
            &MountOptions {
                host: "b".into(),
                ..MountOptions::default()
            },
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{e}");
        assert!(e.to_string().contains("lock record 0"), "{e}");
        assert!(e.to_string().contains("other nodes may be mounted"), "{e}");
        let fsck = crate::check::check_volume(&*dev).unwrap();
        assert!(!fsck.is_clean());
        // a cannot release what it cannot read, so its unmount fails and its slot stays Live.
        // Node a's next mount finds its old daemon gone (same host), is alone, resets both.
        let _ = a.unmount();
        drop(a);
        // Its lock keeper may be inside a (slow, re-reading) tick holding the volume: give it
        // time to end, so that the slot reads as a local daemon that is gone, not one to watch.
        std::thread::sleep(Duration::from_millis(100));
        let (b, took) = timed_mount(&dev, "a");
        assert!(took < QUICK, "mount took {took:?}");
        let fh = b.open(f.ino, true, false).unwrap();
        assert_eq!(read_all(&b, &fh, 10), b"kept");
        b.release(&fh).unwrap();
        b.unmount().unwrap();
        let r = crate::check::check_volume(&*dev).unwrap();
        assert!(r.is_clean(), "{:?}", r.findings);
    }
}

/// Files still open at unmount (the kernel's last releases can come after FUSE's destroy)
/// leave no open registration behind, nor does an open-unlinked file freed at the unmount,
/// nor a read-only node's reads: fsck after clean unmounts has nothing to warn about.
#[test]
fn an_unmount_with_files_still_open_leaves_no_open_registration() {
    let dev = volume(2);
    let a = node(&dev, "a");
    let r = a.root_ino();
    let open: Vec<_> = (0..5)
        .map(|i| {
            a.create(r, format!("f{i}").as_bytes(), 0o644, C, true)
                .unwrap()
                .1
        })
        .collect();
    let f0 = a.lookup(r, b"f0").unwrap().ino;
    let (_, tmp) = a.create(r, b"tmp", 0o644, C, true).unwrap();
    a.write(&tmp, 0, &[1u8; 8192]).unwrap();
    a.unlink(r, b"tmp").unwrap();
    let ro = read_only_node(&dev, "ro");
    let closed = ro.open(f0, false, false).unwrap();
    ro.release(&closed).unwrap();
    let still = ro.open(f0, false, false).unwrap();
    ro.unmount().unwrap();
    let fh = a.open(f0, false, false).unwrap();
    a.unmount().unwrap();
    // The late releases the kernel may still send: not served, nothing left behind.
    a.release(&fh).unwrap();
    let report = crate::check::check_volume(&*dev).unwrap();
    assert!(report.findings.is_empty(), "{:?}", report.findings);
    drop((open, tmp, still));
}
