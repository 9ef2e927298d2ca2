//! Per-inode locks on a v3 volume (`fs/inode_lock.rs`), several `Volume`s on one memory device:
//! the data path of one node does not depend on the global lock, changes by another node
//! drain it and are seen, and a dead node blocks only what it held.

use super::multinode_tests::{assert_fsck_clean, node, read_all, read_only_node, volume};
use super::*;
use std::time::{Duration, Instant};

const C: Caller = Caller::ROOT;

/// `f` on another thread; panics if it has not finished within `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("still blocked after {limit:?}"))
}

#[test]
fn the_volume_has_object_locks() {
    let dev = volume(4);
    let a = node(&dev, "a");
    assert!(a.sb.object_lock_area().is_some(), "mkfs made a v3 volume");
    assert!(a.cl.ilocks.is_some());
    a.unmount().unwrap();
}

#[test]
fn reads_and_overwrites_go_on_while_another_node_holds_the_global_lock() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"image", 0o644, C, true).unwrap();
    a.write(&fh, 0, &vec![7u8; 65536]).unwrap();
    a.fsync(f.ino, false).unwrap();
    assert_eq!(read_all(&a, &fh, 65536), vec![7u8; 65536]);
    // b takes the global lock exclusively and keeps it (a metadata operation that lasts).
    let held = b.meta_ex().unwrap();
    let (a2, fh) = (a.clone(), Arc::new(fh));
    let fh2 = fh.clone();
    within(Duration::from_secs(5), move || {
        for i in 0..200u64 {
            let off = (i % 16) * 4096;
            a2.write(&fh2, off, &[9u8; 4096]).unwrap();
            let mut got = Vec::new();
            a2.read(&fh2, off, 4096, &mut |d| got.extend_from_slice(d))
                .unwrap();
            assert_eq!(got, vec![9u8; 4096]);
        }
    });
    drop(held);
    let Ok(fh) = Arc::try_unwrap(fh) else {
        panic!("handle still shared")
    };
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

#[test]
fn a_change_by_another_node_drains_the_fast_path_and_is_seen() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"f", 0o644, C, true).unwrap();
    a.write(&fh, 0, &[1u8; 8192]).unwrap();
    a.fsync(f.ino, false).unwrap();
    let bfh = b.open(f.ino, false, false).unwrap();
    // b reads through its cached map (its inode lock shared).
    assert_eq!(read_all(&b, &bfh, 8192), vec![1u8; 8192]);
    let handed_before =
        b.cl.ilocks
            .as_ref()
            .unwrap()
            .stats
            .handed
            .load(Ordering::Relaxed);
    // a truncates and rewrites: the blocks b's map pointed at are freed and reused.
    a.setattr(
        f.ino,
        &SetAttr {
            size: Some(0),
            ..SetAttr::default()
        },
        C,
    )
    .unwrap();
    a.write(&fh, 0, &[2u8; 4096]).unwrap();
    a.fsync(f.ino, false).unwrap();
    let handed =
        b.cl.ilocks
            .as_ref()
            .unwrap()
            .stats
            .handed
            .load(Ordering::Relaxed);
    assert!(handed > handed_before, "b gave its inode lock up");
    assert_eq!(read_all(&b, &bfh, 8192), vec![2u8; 4096]);
    assert_eq!(b.getattr(f.ino).unwrap().size, 4096);
    b.release(&bfh).unwrap();
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

#[test]
fn a_dead_node_blocks_only_what_it_held() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (f, fh) = b.create(r, b"mine", 0o644, C, true).unwrap();
    b.write(&fh, 0, &[5u8; 16384]).unwrap();
    b.fsync(f.ino, false).unwrap();
    assert_eq!(read_all(&b, &fh, 16384), vec![5u8; 16384]);
    // a takes the global lock exclusively (a create), then dies holding it.
    let (g, gfh) = a.create(r, b"growing", 0o644, C, true).unwrap();
    a.write(&gfh, 0, &[6u8; 4096]).unwrap();
    a.member.fence("test: simulated crash".into());
    // b's data path on its own file does not wait for a's recovery.
    let dead = crate::cluster::Timing::from_ms(50, 100).dead_time();
    let t = Instant::now();
    for i in 0..50u64 {
        let off = (i % 4) * 4096;
        b.write(&fh, off, &[8u8; 4096]).unwrap();
        let mut got = Vec::new();
        b.read(&fh, off, 4096, &mut |d| got.extend_from_slice(d))
            .unwrap();
        assert_eq!(got, vec![8u8; 4096]);
    }
    assert!(
        t.elapsed() < dead / 2,
        "b's I/O took {:?} (dead time {dead:?})",
        t.elapsed()
    );
    // b's metadata waits for a's recovery (a died holding the global lock).
    assert!(b.lookup(r, b"mine").is_ok());
    assert!(
        t.elapsed() >= dead / 2,
        "b's lookup did not wait for the recovery: {:?}",
        t.elapsed()
    );
    let _ = g;
    drop(gfh);
    b.release(&fh).unwrap();
    b.unmount().unwrap();
    std::thread::sleep(Duration::from_millis(10));
    assert_fsck_clean(&dev);
}

/// Does `v` see its own slot holding the global lock exclusively on disk?
fn holds_global_exclusively(v: &Volume, slot: u32) -> bool {
    let (_, rec) =
        v.cl.locks
            .read(crate::cluster::lock::LockTable::GLOBAL)
            .unwrap();
    rec.mode == crate::format::lock_record::LockMode::Exclusive && rec.owner == slot
}

/// `fs/own_lock_reads.rs`: while a dead node holds the global lock, a survivor's lookups,
/// getattrs and listings of what it has loaded and nobody changed since go on, validated by
/// the objects' own locks (its holds of them went back while idle, so each is taken again);
/// what the dead node changed since, and every change, waits for its recovery.
#[test]
fn reads_of_what_nobody_changed_go_on_while_a_dead_node_holds_the_global_lock() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let theirs_attr = a.mkdir(r, b"theirs", 0o755, C).unwrap();
    let theirs = theirs_attr.ino;
    // Never loaded on b.
    let other = a.mkdir(r, b"other", 0o755, C).unwrap();
    let mine = b.mkdir(r, b"mine", 0o755, C).unwrap().ino;
    let (f, fh) = b.create(mine, b"f", 0o644, C, true).unwrap();
    b.write(&fh, 0, &[3u8; 4096]).unwrap();
    b.release(&fh).unwrap();
    // b reads what it will read again below, then lets every hold of it go (idle).
    assert_eq!(b.lookup(r, b"mine").unwrap().ino, mine);
    assert_eq!(b.lookup(mine, b"f").unwrap().size, 4096);
    assert_eq!(b.lookup(r, b"theirs").unwrap().ino, theirs);
    let il = b.cl.ilocks.as_ref().unwrap();
    eventually("b's idle holds go back", || {
        [r, mine, f.ino, theirs].iter().all(|&i| !il.holds_any(i))
    });
    // a changes a directory b has loaded (durably), and dies holding the global lock
    // exclusively.
    a.mkdir(theirs, b"sub", 0o755, C).unwrap();
    a.fsync(theirs, false).unwrap();
    let held = a.meta_ex().unwrap();
    assert!(holds_global_exclusively(&b, a.cl.me.slot));
    let (dead, _) = crash(&a);
    let t = Instant::now();
    let b2 = b.clone();
    let reads = within(dead * 3, move || {
        let looked = b2.lookup(r, b"mine").unwrap().ino;
        let size = b2.lookup(mine, b"f").unwrap().size;
        let absent = b2.lookup(mine, b"nothing").map(|a| a.ino);
        let got = b2.getattr(f.ino).unwrap().size;
        let mut names = Vec::new();
        b2.readdir(mine, 0, &mut |e| {
            names.push(e.name.clone());
            true
        })
        .unwrap();
        // A listing (readdirplus) of the root: what b cannot validate and its kernel does not
        // know comes with placeholders and the inode's own generation.
        let mut listed = Vec::new();
        b2.readdir(r, 0, &mut |e| {
            listed.push(e.clone());
            true
        })
        .unwrap();
        let attrs: Vec<_> = listed
            .iter()
            .filter(|e| e.name != b"." && e.name != b"..")
            .map(|e| (e.name.clone(), b2.entry_attr(r, e)))
            .collect();
        (looked, size, absent, got, names, attrs, listed)
    });
    let read_in = t.elapsed();
    let dead_still_holds = holds_global_exclusively(&b, a.cl.me.slot);
    assert_eq!(reads.0, mine);
    assert_eq!((reads.1, reads.3), (4096, 4096));
    assert_eq!(reads.2.unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(reads.4, vec![b".".to_vec(), b"..".to_vec(), b"f".to_vec()]);
    for (name, attr) in &reads.5 {
        match (name.as_slice(), attr) {
            (b"mine", EntryAttr::Loaded(x)) => assert_eq!(x.ino, mine),
            (b"theirs", EntryAttr::Unreadable(x)) => {
                assert_eq!((x.ino, x.generation), (theirs, theirs_attr.generation));
            }
            (b"other", EntryAttr::Unreadable(x)) => {
                assert_eq!((x.ino, x.generation), (other.ino, other.generation));
            }
            (n, x) => panic!("{:?}: {x:?}", String::from_utf8_lossy(n)),
        }
    }
    assert_eq!(reads.5.len(), 3);
    assert!(
        dead_still_holds,
        "b's reads took {read_in:?}: they waited for a's recovery (dead time {dead:?})"
    );
    // An inode b's kernel knows is not listed with placeholders (the kernel would apply
    // them to it): that waits for the recovery.
    b.note_listed(theirs);
    let entry = reads.6.iter().find(|e| e.name == b"theirs").unwrap();
    assert!(
        matches!(b.entry_attr(r, entry), EntryAttr::Unreadable(_)),
        "known to the kernel from placeholders only: listed so again"
    );
    b.forget(theirs, 1);
    b.note_lookup(theirs);
    match b.entry_attr(r, entry) {
        EntryAttr::Loaded(x) => assert_eq!(x.generation, theirs_attr.generation),
        x => panic!("theirs, known to the kernel: {x:?}"),
    }
    assert!(!holds_global_exclusively(&b, a.cl.me.slot));
    b.forget(theirs, 1);
    // What a changed since b loaded it is not read from b's copy: the listing waits for the
    // recovery and shows a's change.
    let mut names = Vec::new();
    b.readdir(theirs, 0, &mut |e| {
        names.push(e.name.clone());
        true
    })
    .unwrap();
    assert_eq!(names, vec![b".".to_vec(), b"..".to_vec(), b"sub".to_vec()]);
    // So does a change.
    b.mkdir(mine, b"new", 0o755, C).unwrap();
    assert!(
        !holds_global_exclusively(&b, a.cl.me.slot),
        "b's mkdir did not wait for a's recovery: the test proves nothing"
    );
    drop(held);
    unmount_and_check(&dev, &[&b]);
}

/// `fs/own_lock_reads.rs` step 2 after another node changed a directory: once this node read
/// it again under the global lock, its copy is current at the directory's lock version
/// (`InodeLocks::note_reloaded`), and a lookup in it goes on while a dead node holds the
/// global lock. Before, a copy was validated only at this node's own grants: in the SAN
/// harness, every node's path walk through the root (which every node had changed at set-up)
/// waited for the isolated node's recovery.
#[test]
fn a_directory_read_again_since_another_nodes_change_is_looked_up_while_the_holder_is_dead() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let c = node(&dev, "c");
    let r = a.root_ino();
    // b changes the root (its own grant), then a and c do: b's grant is out of date.
    let mine = b.mkdir(r, b"mine", 0o755, C).unwrap().ino;
    let (f, fh) = b.create(mine, b"img", 0o644, C, true).unwrap();
    b.write(&fh, 0, &[3u8; 4096]).unwrap();
    b.release(&fh).unwrap();
    let theirs = a.mkdir(r, b"theirs", 0o755, C).unwrap().ino;
    c.mkdir(r, b"cs", 0o755, C).unwrap();
    // b reads the root again under the global lock (nobody is silent), and lets every hold
    // go (idle).
    assert_eq!(b.lookup(r, b"theirs").unwrap().ino, theirs);
    assert_eq!(b.lookup(r, b"mine").unwrap().ino, mine);
    assert_eq!(b.lookup(mine, b"img").unwrap().ino, f.ino);
    let il = b.cl.ilocks.as_ref().unwrap();
    eventually("b's idle holds go back", || {
        [r, mine, f.ino, theirs].iter().all(|&i| !il.holds_any(i))
    });
    lookups_go_on_while_c_is_dead(
        &dev,
        [&a, &b, &c],
        vec![
            (r, b"mine", mine),
            (r, b"theirs", theirs),
            (mine, b"img", f.ino),
        ],
    );
}

/// c dies holding the global lock exclusively; b's `lookups` (directory, name, the inode
/// expected) are answered before its recovery. Then a and b unmount and the volume checks
/// clean.
fn lookups_go_on_while_c_is_dead(
    dev: &Arc<crate::dev::mem::MemDevice>,
    [a, b, c]: [&Arc<Volume>; 3],
    lookups: Vec<(Ino, &'static [u8], Ino)>,
) {
    let held = c.meta_ex().unwrap();
    let (dead, _) = crash(c);
    let t = Instant::now();
    let b2 = Arc::clone(b);
    let want: Vec<_> = lookups.iter().map(|l| l.2).collect();
    let found = within(dead * 3, move || {
        lookups
            .iter()
            .map(|&(dir, name, _)| b2.lookup(dir, name).map(|x| x.ino))
            .collect::<Vec<_>>()
    });
    let took = t.elapsed();
    assert!(
        holds_global_exclusively(b, c.cl.me.slot),
        "b's lookups took {took:?}: they waited for c's recovery (dead time {dead:?})"
    );
    let found: Vec<_> = found.into_iter().map(Result::unwrap).collect();
    assert_eq!(found, want);
    drop(held);
    unmount_and_check(dev, &[&**a, &**b]);
}

/// The same for an object whose lock nobody ever took (no entry in its bucket: a file made
/// and never written): a load under the global lock notes the version a shared grant would
/// create the entry at, and the lookups go on while a dead node holds the global lock.
#[test]
fn objects_without_a_lock_entry_are_looked_up_while_the_holder_is_dead() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let c = node(&dev, "c");
    let r = a.root_ino();
    let d = a.mkdir(r, b"d", 0o755, C).unwrap().ino;
    let (f, fh) = a.create(d, b"f", 0o644, C, true).unwrap();
    a.release(&fh).unwrap();
    c.mkdir(r, b"cs", 0o755, C).unwrap();
    let il = a.cl.ilocks.as_ref().unwrap();
    eventually("a's idle holds go back", || {
        [r, d, f.ino].iter().all(|&i| !il.holds_any(i))
    });
    assert_eq!(b.lookup(r, b"d").unwrap().ino, d);
    assert_eq!(b.lookup(d, b"f").unwrap().ino, f.ino);
    let il = b.cl.ilocks.as_ref().unwrap();
    eventually("b's idle holds go back", || {
        [r, d, f.ino].iter().all(|&i| !il.holds_any(i))
    });
    lookups_go_on_while_c_is_dead(&dev, [&a, &b, &c], vec![(r, b"d", d), (d, b"f", f.ino)]);
}

/// `fs/own_lock_reads.rs` step 2: while the global lock's holder is silent, a read of an
/// object that another node changed since this node's copy (and holds exclusively) asks that
/// node for nothing. Asked, the owner would write home and give its hold up, and could take
/// it back only under the global lock, which the dead node keeps: its VM's allocating writes
/// would stop for nothing until the recovery.
#[test]
fn a_stale_read_while_the_global_holder_is_silent_leaves_the_owner_its_hold() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let c = node(&dev, "c");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"img", 0o644, C, true).unwrap();
    a.write(&fh, 0, &[1u8; 4096]).unwrap();
    a.fsync(f.ino, false).unwrap();
    // b loads the file (a writes it home and shares), then a's allocating write owns it
    // again: b's copy is stale, a holds the file exclusively.
    assert_eq!(b.getattr(f.ino).unwrap().size, 4096);
    a.write(&fh, 1 << 20, &[2u8; 4096]).unwrap();
    // c dies holding the global lock exclusively.
    let held = c.meta_ex().unwrap();
    let (dead, _) = crash(&c);
    let (b2, ino) = (b.clone(), f.ino);
    let stat = std::thread::spawn(move || b2.getattr(ino).map(|x| x.size));
    // b finds the holders silent and looks at the file's own lock meanwhile.
    std::thread::sleep(Duration::from_millis(400));
    let (a2, fh) = (a.clone(), Arc::new(fh));
    let fh2 = fh.clone();
    within(dead, move || {
        for i in 2..10u64 {
            a2.write(&fh2, i << 20, &[3u8; 4096]).unwrap();
        }
    });
    assert!(
        holds_global_exclusively(&a, c.cl.me.slot),
        "a's writes waited for c's recovery: b's read took a's hold"
    );
    assert_eq!(stat.join().unwrap().unwrap(), (9 << 20) + 4096);
    drop(held);
    let Ok(fh) = Arc::try_unwrap(fh) else {
        panic!("handle still shared")
    };
    a.release(&fh).unwrap();
    unmount_and_check(&dev, &[&a, &b]);
}

/// A VM's image reopened, written and closed again and again (a `dd` loop, a restart) on a
/// node that owns it, while another node lies dead holding the global lock: no close waits
/// for that lock. The last writer's close gave the block pool back under the global lock,
/// and folded a pending mtime on the metadata path: with FUSE, each such close took a worker
/// until the recovery, and once every worker waited, the node's opens and reads did too.
#[test]
fn closing_an_owned_file_never_waits_for_a_dead_global_holder() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"img", 0o644, C, true).unwrap();
    // A thin image's writes fill a pool.
    for i in 0..8u64 {
        a.write(&fh, i << 20, &[1u8; 4096]).unwrap();
    }
    a.fsync(f.ino, false).unwrap();
    assert!(
        a.lock_meta().pool_available() > 0,
        "no pool: the test proves nothing"
    );
    // The pool has been idle for POOL_IDLE but for the open writer, which keeps it at b's
    // handoff; b dies holding the global lock.
    std::thread::sleep(super::detached::POOL_IDLE + Duration::from_millis(100));
    let held = b.meta_ex().unwrap();
    let (dead, _) = crash(&b);
    let a2 = a.clone();
    within(dead / 2, move || {
        a2.release(&fh).unwrap();
        for i in 0..20u8 {
            let fh = a2.open(f.ino, true, false).unwrap();
            a2.write(&fh, 0, &[i; 4096]).unwrap();
            // Every other pass leaves the mtime pending for the close to fold in.
            if i % 2 == 0 {
                a2.fsync(f.ino, false).unwrap();
            }
            a2.release(&fh).unwrap();
        }
    });
    assert!(
        holds_global_exclusively(&a, b.cl.me.slot),
        "the closes took the dead node's recovery time: they waited for it"
    );
    assert!(!a
        .inodes
        .get(f.ino)
        .unwrap()
        .has_pending
        .load(Ordering::Acquire));
    drop(held);
    // Once b is recovered, the idle pool goes back from the background.
    super::detached_tests::await_pool_back_within(&a, dead * 3 + super::detached::POOL_IDLE);
    unmount_and_check(&dev, &[&a]);
}

/// `fs/closer.rs` point 1: the global lock the closer takes to give the pool back does not
/// stay with the node, idle, for a second (`GLOBAL_IDLE_RELEASE`): a node that died then
/// would hold up every other node's changes. It goes back at the next idle release.
#[test]
fn the_closers_pool_return_leaves_the_global_lock_at_once() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let (_, fh) = a.create(a.root_ino(), b"img", 0o644, C, true).unwrap();
    for i in 0..8u64 {
        a.write(&fh, i << 20, &[1u8; 4096]).unwrap();
    }
    a.release(&fh).unwrap();
    // b takes the global lock meanwhile (a's pool stays: its last writer just closed).
    b.mkdir(b.root_ino(), b"d", 0o755, C).unwrap();
    assert!(
        a.lock_meta().pool_available() > 0,
        "no pool: the test proves nothing"
    );
    super::detached_tests::await_pool_back(&a);
    let t = Instant::now();
    eventually("a gives the global lock back", || {
        a.lock_meta().gml() == crate::format::lock_record::LockMode::Free
    });
    assert!(
        t.elapsed() < Duration::from_millis(700),
        "a kept the global lock {:?} after its closer gave the pool back",
        t.elapsed()
    );
    unmount_and_check(&dev, &[&a, &b]);
}

/// `fs/closer.rs` point 2: the last close of a file unlinked while open, and the kernel's
/// last reference to one unlinked while it had it, whose frees need the global lock, do not
/// wait for it while its holder is silent: the closer frees the files once the dead holder
/// is recovered.
#[test]
fn a_close_that_needs_a_silent_holders_global_lock_is_finished_in_the_background() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"f", 0o644, C, true).unwrap();
    a.write(&fh, 0, &vec![1u8; 64 << 10]).unwrap();
    a.fsync(f.ino, false).unwrap();
    let (g, gh) = a.create(r, b"g", 0o644, C, true).unwrap();
    a.release(&gh).unwrap();
    a.note_lookup(g.ino);
    // b reads the root: f and g are no longer fresh (their frees need the global lock).
    assert_eq!(b.lookup(r, b"f").unwrap().ino, f.ino);
    a.unlink(r, b"f").unwrap();
    a.unlink(r, b"g").unwrap();
    let held = b.meta_ex().unwrap();
    let (dead, _) = crash(&b);
    let a2 = a.clone();
    within(dead / 2, move || {
        a2.release(&fh).unwrap();
        a2.forget(g.ino, 1);
    });
    assert!(
        holds_global_exclusively(&a, b.cl.me.slot),
        "the close or the forget waited for b's recovery"
    );
    assert_eq!(
        a.closer.deferred_total(),
        2,
        "the frees were not left to the closer"
    );
    let gone = |v: &Volume, ino| v.inodes.get(ino).is_none_or(|s| s.read().freed);
    assert!(
        !gone(&a, f.ino) && !gone(&a, g.ino),
        "freed without the global lock"
    );
    drop(held);
    eventually("the closer frees the files after b's recovery", || {
        gone(&a, f.ino) && gone(&a, g.ino)
    });
    assert_eq!(a.closer.deferred(), 0);
    unmount_and_check(&dev, &[&a]);
}

#[test]
fn a_read_only_node_reads_through_its_inode_lock_and_hands_it_over() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"f", 0o644, C, true).unwrap();
    a.write(&fh, 0, &[3u8; 4096]).unwrap();
    a.fsync(f.ino, false).unwrap();
    let ro = read_only_node(&dev, "ro");
    let rfh = ro.open(f.ino, false, false).unwrap();
    assert_eq!(read_all(&ro, &rfh, 8192), vec![3u8; 4096]);
    // a extends the file: the read-only node's mailbox thread gives its shared hold up.
    within(Duration::from_secs(5), {
        let (a, fh) = (a.clone(), fh.clone());
        move || a.write(&fh, 4096, &[4u8; 4096]).unwrap()
    });
    a.fsync(f.ino, false).unwrap();
    let mut want = vec![3u8; 4096];
    want.extend_from_slice(&[4u8; 4096]);
    assert_eq!(read_all(&ro, &rfh, 8192), want);
    ro.release(&rfh).unwrap();
    ro.unmount().unwrap();
    a.release(&fh).unwrap();
    a.unmount().unwrap();
    assert_fsck_clean(&dev);
}

/// Poll `cond` every 10 ms; panics with `what` if it does not hold within 10 s.
fn eventually(what: &str, cond: impl Fn() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{what}: not within 10 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn idle_locks_are_given_back_beyond_the_limit_and_once_their_inode_is_forgotten() {
    const LIMIT: usize = 16;
    let dev = volume(4);
    let a = Volume::mount(
        dev.clone(),
        &MountOptions {
            host: "a".into(),
            inode_locks: Some(LIMIT),
            ..MountOptions::default()
        },
    )
    .unwrap();
    let b = node(&dev, "b");
    let r = a.root_ino();
    let mut inos = Vec::new();
    for i in 0..48u8 {
        let (f, fh) = a
            .create(r, format!("f{i}").as_bytes(), 0o644, C, true)
            .unwrap();
        a.write(&fh, 0, &[i; 4096]).unwrap();
        a.release(&fh).unwrap();
        inos.push(f.ino);
    }
    a.sync().unwrap();
    // Reading through the data path ties each file's lock to its (cached) inode state.
    let il = a.cl.ilocks.as_ref().unwrap();
    let handles: Vec<_> = inos
        .iter()
        .map(|&i| a.open(i, false, false).unwrap())
        .collect();
    for (i, fh) in (0u8..).zip(&handles) {
        assert_eq!(read_all(&a, fh, 4096), vec![i; 4096]);
    }
    eventually("the held locks come down to the limit", || {
        il.holding() <= LIMIT
    });
    assert!(il.stats.given_back.load(Ordering::Relaxed) >= 48 - 16);
    // What the buckets say, not only the local count.
    let on_disk = |v: &Volume| {
        let ol = v.cl.ilocks.as_ref().unwrap().object_locks();
        inos.iter()
            .filter(|&&i| {
                let obj = crate::cluster::object_lock::ObjectId::inode(i).unwrap();
                let (_, bucket) = ol.read_bucket(ol.bucket_of(obj)).unwrap();
                bucket
                    .entry(obj.raw())
                    .and_then(|e| e.mention(v.cl.me.slot))
                    .is_some_and(|m| m.role.holds())
            })
            .count()
    };
    assert!(on_disk(&a) <= LIMIT, "{} held on disk", on_disk(&a));
    // A file whose lock a gave back: b changes it without asking a, and a sees the change.
    let handed = il.stats.handed.load(Ordering::Relaxed);
    let bfh = b.open(inos[0], true, false).unwrap();
    b.write(&bfh, 0, &[0xEE; 4096]).unwrap();
    b.fsync(inos[0], false).unwrap();
    b.release(&bfh).unwrap();
    assert_eq!(read_all(&a, &handles[0], 4096), vec![0xEE; 4096]);
    for (i, fh) in (0u8..).zip(&handles).skip(1) {
        assert_eq!(read_all(&a, fh, 4096), vec![i; 4096], "file {i}");
    }
    // If a still held file 0's lock: once shared for b's load of the inode, once for b's
    // write.
    assert!(
        il.stats.handed.load(Ordering::Relaxed) <= handed + 2,
        "at most file 0's lock (if a still held it) was asked for"
    );
    // Closed and evicted from the inode table: their locks go back and the entries go.
    for fh in &handles {
        a.release(fh).unwrap();
    }
    drop(handles);
    for &i in &inos {
        a.inodes.evict_idle(i);
    }
    eventually("the locks of forgotten inodes are given back", || {
        il.holding() <= 2
    });
    eventually("their entries are dropped", || il.known() <= 4);
    eventually("none of the files' locks is held on disk", || {
        on_disk(&a) == 0
    });
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

/// Does `v` hold inode `ino`'s lock exclusively, as its bucket on disk says?
fn owns_on_disk(v: &Volume, ino: u64) -> bool {
    role_on_disk(v, ino) == Some(crate::format::object_lock::Role::Owner)
}

/// What `v` holds of inode `ino`'s lock (or waits for), as its bucket on disk says.
fn role_on_disk(v: &Volume, ino: u64) -> Option<crate::format::object_lock::Role> {
    role_of_slot(v, v.cl.me.slot, ino)
}

/// What `slot` has of `ino`'s lock on disk, read through `v`.
fn role_of_slot(v: &Volume, slot: u32, ino: u64) -> Option<crate::format::object_lock::Role> {
    let ol = v.cl.ilocks.as_ref().unwrap().object_locks();
    let obj = crate::cluster::object_lock::ObjectId::inode(ino).unwrap();
    let (_, bucket) = ol.read_bucket(ol.bucket_of(obj)).unwrap();
    bucket
        .entry(obj.raw())
        .and_then(|e| e.mention(slot))
        .map(|m| m.role)
}

/// A node that stops using what it changed gives back its holds (and the global lock) after
/// about a second, so that its death would block nobody; the exclusive hold of a file it has
/// open for writing stays (a VM's image: its next allocating write needs no global lock), and
/// so does the shared hold of a file open for reading. Another node then changes the
/// directory without asking the first.
#[test]
fn idle_holds_go_back_unless_their_file_is_open() {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let d = a.mkdir(r, b"d", 0o755, C).unwrap().ino;
    let (img, img_fh) = a.create(d, b"img", 0o644, C, true).unwrap();
    a.write(&img_fh, 0, &[1; 8192]).unwrap();
    let (log, log_fh) = a.create(d, b"log", 0o644, C, true).unwrap();
    a.write(&log_fh, 0, &[2; 4096]).unwrap();
    a.release(&log_fh).unwrap();
    let done = Instant::now();
    let owned = (owns_on_disk(&a, d), owns_on_disk(&a, log.ino));
    if done.elapsed() < Duration::from_millis(500) {
        // (On a machine slow enough to take a second here they may be back already.)
        assert_eq!(
            owned,
            (true, true),
            "creating in d and writing log made a own both"
        );
    }
    a.sync().unwrap();
    assert!(owns_on_disk(&a, img.ino), "writing img made a own it");
    eventually(
        "the idle directory's and closed file's locks go back",
        || !owns_on_disk(&a, d) && !owns_on_disk(&a, log.ino),
    );
    eventually("the unused global lock goes back", || {
        use crate::format::lock_record::LockMode;
        let (_, rec) =
            a.cl.locks
                .read(crate::cluster::lock::LockTable::GLOBAL)
                .unwrap();
        let me = a.cl.me.slot;
        let holds = match rec.mode {
            LockMode::Exclusive => rec.owner == me,
            LockMode::Shared => rec.holders.iter().any(|s| s == me),
            LockMode::Free => false,
        };
        !holds
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        owns_on_disk(&a, img.ino),
        "the file open for writing kept its exclusive hold"
    );
    // b changes d and log without a's help: nothing of theirs is held by a any more.
    let handed =
        a.cl.ilocks
            .as_ref()
            .unwrap()
            .stats
            .handed
            .load(Ordering::Relaxed);
    let b2 = b.clone();
    within(Duration::from_secs(10), move || {
        let (_, fh) = b2.create(d, b"other", 0o644, C, false).unwrap();
        b2.release(&fh).unwrap();
        b2.unlink(d, b"log").unwrap();
    });
    assert_eq!(
        a.cl.ilocks
            .as_ref()
            .unwrap()
            .stats
            .handed
            .load(Ordering::Relaxed),
        handed,
        "b asked a for a lock it had given back"
    );
    // a's image still takes writes, and a sees b's changes.
    a.write(&img_fh, 8192, &[3; 4096]).unwrap();
    assert!(a.lookup(d, b"log").is_err(), "a sees b's unlink");
    assert!(a.lookup(d, b"other").is_ok(), "a sees b's create");
    // b's shared holds go back too once unused (d's, after b read it), but not that of a
    // file b has open for reading.
    let (other, ofh) = b.create(d, b"ro", 0o644, C, true).unwrap();
    b.write(&ofh, 0, &[4; 4096]).unwrap();
    b.release(&ofh).unwrap();
    b.fsync(other.ino, false).unwrap();
    let rfh = b.open(other.ino, false, false).unwrap();
    assert_eq!(read_all(&b, &rfh, 4096), vec![4; 4096]);
    assert!(b.lookup(d, b"other").is_ok());
    // (The exclusive hold of the file b wrote goes back: open for reading keeps only a shared
    // one.)
    eventually("b's unused holds go back", || {
        role_on_disk(&b, d).is_none() && !owns_on_disk(&b, other.ino)
    });
    assert_eq!(read_all(&b, &rfh, 4096), vec![4; 4096]);
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(
        role_on_disk(&b, other.ino),
        Some(crate::format::object_lock::Role::Holder),
        "the shared hold of a file open for reading stays however idle"
    );
    b.release(&rfh).unwrap();
    a.release(&img_fh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

/// Node `a` crashes (fences itself, as a SIGKILL would leave its records): the dead time
/// of these tests' timings, and when it crashed.
fn crash(a: &Volume) -> (Duration, Instant) {
    a.member.fence("test: simulated crash".into());
    (
        crate::cluster::Timing::from_ms(50, 100).dead_time(),
        Instant::now(),
    )
}

/// The survivors unmount, and the volume checks clean.
fn unmount_and_check(dev: &Arc<crate::dev::mem::MemDevice>, survivors: &[&Volume]) {
    for v in survivors {
        v.unmount().unwrap();
    }
    std::thread::sleep(Duration::from_millis(10));
    assert_fsck_clean(dev);
}

/// What must go on while one of b's operations waits for a dead node's lock: b's allocating
/// writes into its own thin image (they need b's metadata mutex) and c's move between
/// directories (it needs the global lock, which b may have taken for the waiting operation).
struct Bystanders {
    c1: Ino,
    c2: Ino,
    x: Ino,
    thin: Arc<OpenFile>,
}

impl Bystanders {
    fn new(b: &Volume, c: &Volume) -> Self {
        let r = c.root_ino();
        let c1 = c.mkdir(r, b"c1", 0o755, C).unwrap().ino;
        let c2 = c.mkdir(r, b"c2", 0o755, C).unwrap().ino;
        let (x, xfh) = c.create(c1, b"x", 0o644, C, true).unwrap();
        c.release(&xfh).unwrap();
        let (_, thin) = super::detached_tests::thin_image(b, b"thin");
        b.write(&thin, 0, &[7u8; 4096]).unwrap();
        Self {
            c1,
            c2,
            x: x.ino,
            thin,
        }
    }

    /// 50 allocating writes on b and a move on c, each within a quarter of the dead time
    /// while `waiting` (what of b's waits for the dead node).
    fn go_on(&self, b: &Volume, c: &Volume, waiting: &str) {
        let dead = crate::cluster::Timing::from_ms(50, 100).dead_time();
        let t = Instant::now();
        for i in 1..=50u64 {
            b.write(&self.thin, i << 20, &[7u8; 4096]).unwrap();
        }
        let wrote = t.elapsed();
        let t = Instant::now();
        c.rename(self.c1, b"x", self.c2, b"x", RenameFlags::default())
            .unwrap();
        let moved = t.elapsed();
        assert!(
            wrote < dead / 4 && moved < dead / 4,
            "b's 50 allocating writes took {wrote:?} and c's move {moved:?} while {waiting} \
             (dead time {dead:?})"
        );
    }

    /// c sees its move; b closes its image.
    fn end(self, b: &Volume, c: &Volume) {
        assert_eq!(c.lookup(self.c2, b"x").unwrap().ino, self.x);
        b.release(&self.thin).unwrap();
    }
}

/// A read that meets a dead node's inode lock waits for it holding nothing else
/// (`fs/detached.rs` rule 3): a `stat` on b of a's open file, a dead, waits for a's recovery
/// (and so does a lookup of it, behind the stat's acquire), and meanwhile b's allocating
/// writes into its own thin image (they need b's metadata mutex) and c's move between
/// directories (it needs the global lock, which b took for the stat) go on. Before, the stat
/// held both while it waited, and they waited the dead time with it.
#[test]
fn a_read_waiting_for_a_dead_nodes_inode_lock_holds_no_other_lock() {
    use super::detached_tests::node;
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let c = node(&dev, "c");
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"vm", 0o644, C, true).unwrap();
    a.write(&fh, 0, &[5u8; 8192]).unwrap();
    a.fsync(f.ino, false).unwrap();
    let by = Bystanders::new(&b, &c);
    // a dies holding vm's lock exclusively (its writer keeps it).
    let (dead, killed) = crash(&a);
    let stat = {
        let b = b.clone();
        std::thread::spawn(move || (b.getattr(f.ino), Instant::now()))
    };
    // A second reader of the same inode on b: it waits behind the first one's acquire, and
    // must give its locks up all the same.
    std::thread::sleep(Duration::from_millis(150));
    let second = {
        let b = b.clone();
        std::thread::spawn(move || b.lookup(r, b"vm").map(|a| a.size))
    };
    std::thread::sleep(Duration::from_millis(300));
    by.go_on(&b, &c, "b's stat waited for a's inode lock");
    assert!(
        !stat.is_finished(),
        "b's stat of a's file did not wait for a's recovery ({:?} after the crash, dead time \
         {dead:?}): the test proves nothing",
        killed.elapsed()
    );
    let (st, at) = stat.join().unwrap();
    assert_eq!(st.unwrap().size, 8192, "a's fsync'd file");
    assert_eq!(second.join().unwrap().unwrap(), 8192, "the second reader");
    assert!(at - killed >= dead / 2, "the stat waited {:?}", at - killed);
    by.end(&b, &c);
    drop(fh);
    unmount_and_check(&dev, &[&b, &c]);
}

/// A change that must own an inode a dead node held shared waits for it holding nothing
/// else (`Volume::own_inode`): a, dead, had four of b's files open for reading; b's
/// truncate of one, its extending write into another, a hole punched in the third and a
/// `chattr` of the fourth wait for a's recovery (and b is not fenced) — c, alive, holds them
/// shared too, and its heartbeat must not end the wait while a still holds them — and
/// meanwhile b's
/// allocating writes into its own thin image (they need b's metadata mutex) and c's move
/// between directories (it needs the global lock) go on. Before, the upgrade waited holding
/// both, and they waited the dead time with it.
#[test]
fn a_change_waiting_for_a_dead_nodes_shared_hold_holds_no_other_lock() {
    use super::detached_tests::node;
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let c = node(&dev, "c");
    let r = a.root_ino();
    let (cut, cut_fh) = b.create(r, b"cut", 0o644, C, true).unwrap();
    let (grow, grow_fh) = b.create(r, b"grow", 0o644, C, true).unwrap();
    let (punch, punch_fh) = b.create(r, b"punch", 0o644, C, true).unwrap();
    let (flag, flag_fh) = b.create(r, b"flag", 0o644, C, true).unwrap();
    for (f, fh) in [
        (&cut, &cut_fh),
        (&grow, &grow_fh),
        (&punch, &punch_fh),
        (&flag, &flag_fh),
    ] {
        b.write(fh, 0, &[5u8; 8192]).unwrap();
        b.fsync(f.ino, false).unwrap();
    }
    // a reads them: it holds their locks shared, and keeps them while they are open there.
    let read_by = |v: &Volume| -> Vec<_> {
        [cut.ino, grow.ino, punch.ino, flag.ino]
            .iter()
            .map(|&i| {
                let fh = v.open(i, false, false).unwrap();
                assert_eq!(read_all(v, &fh, 4096), vec![5u8; 4096]);
                fh
            })
            .collect()
    };
    let reading = read_by(&a);
    let c_reading = read_by(&c);
    for i in [cut.ino, grow.ino, punch.ino, flag.ino] {
        for v in [&a, &c] {
            assert_eq!(
                role_on_disk(v, i),
                Some(crate::format::object_lock::Role::Holder),
                "a and c hold inode {i}'s lock shared"
            );
        }
    }
    let by = Bystanders::new(&b, &c);
    // c keeps reading them, so it takes its shared holds again whenever it gave them up.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let c_reader = {
        let (c, stop) = (c.clone(), stop.clone());
        let fhs: Vec<_> = c_reading.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for fh in &fhs {
                    let _ = c.read(fh, 0, 4096, &mut |_| {});
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let (dead, killed) = crash(&a);
    let truncate = {
        let b = b.clone();
        std::thread::spawn(move || {
            let set = SetAttr {
                size: Some(4096),
                ..Default::default()
            };
            (b.setattr(cut.ino, &set, C), Instant::now())
        })
    };
    let extend = {
        let (b, fh) = (b.clone(), grow_fh.clone());
        std::thread::spawn(move || (b.write(&fh, 8192, &[6u8; 4096]), Instant::now()))
    };
    let hole = {
        let b = b.clone();
        std::thread::spawn(move || {
            let r = b.fallocate(punch.ino, 0, 4096, FallocMode::PunchHole);
            (r, Instant::now())
        })
    };
    let chattr = {
        let b = b.clone();
        std::thread::spawn(move || {
            let r = b.set_flags(flag.ino, crate::format::inode::flags::NOATIME);
            (r, Instant::now())
        })
    };
    std::thread::sleep(Duration::from_millis(400));
    by.go_on(&b, &c, "b's changes waited for a's shared holds");
    assert!(
        !truncate.is_finished()
            && !extend.is_finished()
            && !hole.is_finished()
            && !chattr.is_finished(),
        "b's changes did not wait for a's recovery ({:?} after the crash, dead time {dead:?}): \
         the test proves nothing",
        killed.elapsed()
    );
    let (set, cut_at) = truncate.join().unwrap();
    assert_eq!(set.unwrap().size, 4096, "the truncate");
    let (wrote, grew_at) = extend.join().unwrap();
    wrote.unwrap();
    let (punched, punched_at) = hole.join().unwrap();
    punched.unwrap();
    let (flagged, flagged_at) = chattr.join().unwrap();
    flagged.unwrap();
    assert!(
        !b.member.is_fenced(),
        "b fenced itself: {:?}",
        b.member.fence_reason()
    );
    for at in [cut_at, grew_at, punched_at, flagged_at] {
        assert!(
            at - killed >= dead / 2,
            "a change waited only {:?}",
            at - killed
        );
    }
    assert_eq!(b.getattr(grow.ino).unwrap().size, 12288);
    by.end(&b, &c);
    assert_eq!(
        c.getattr(cut.ino).unwrap().size,
        4096,
        "c sees the truncate"
    );
    let pfh = c.open(punch.ino, false, false).unwrap();
    let mut want = vec![0u8; 4096];
    want.extend_from_slice(&[5u8; 4096]);
    assert_eq!(read_all(&c, &pfh, 8192), want, "c sees the hole");
    c.release(&pfh).unwrap();
    assert_eq!(
        c.get_flags(flag.ino).unwrap(),
        crate::format::inode::flags::NOATIME
    );
    stop.store(true, Ordering::Relaxed);
    c_reader.join().unwrap();
    drop(reading);
    for fh in c_reading {
        c.release(&fh).unwrap();
    }
    for fh in [cut_fh, grow_fh, punch_fh, flag_fh] {
        b.release(&fh).unwrap();
    }
    unmount_and_check(&dev, &[&b, &c]);
}

/// `f(v)` on another thread; joins to its result and when it ended.
fn timed_on(
    v: &Arc<Volume>,
    f: impl FnOnce(&Volume) -> Result<()> + Send + 'static,
) -> std::thread::JoinHandle<(Result<()>, Instant)> {
    let v = v.clone();
    std::thread::spawn(move || (f(&v), Instant::now()))
}

/// Namespace changes on the global path own the inodes they change before they change
/// anything (`Volume::own_first`), so a dead node's hold of a directory stalls only that
/// directory: a, dead, had looked a name up in b's directory d (it holds d shared, as every
/// node that walks `images/` does for a second); b's create, unlink, link, rename in d and
/// move into d wait for a's recovery, and meanwhile b's allocating writes into its own thin image and c's move
/// between directories go on. Before, each owned d only when it saved it, after its first
/// change, and waited holding the global lock and b's metadata mutex.
#[test]
fn namespace_changes_waiting_for_a_dead_nodes_directory_hold_no_other_lock() {
    use super::detached_tests::node;
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let c = node(&dev, "c");
    let r = a.root_ino();
    let d = b.mkdir(r, b"d", 0o755, C).unwrap().ino;
    for (dir, name) in [(d, &b"old"[..]), (d, b"r1"), (r, b"m")] {
        let (_, fh) = b.create(dir, name, 0o644, C, true).unwrap();
        b.release(&fh).unwrap();
    }
    let (t, tfh) = b.create(r, b"t", 0o644, C, true).unwrap();
    b.release(&tfh).unwrap();
    b.fsync(d, false).unwrap();
    assert!(a.lookup(d, b"old").is_ok(), "a looks a name up in d");
    assert_eq!(
        role_on_disk(&a, d),
        Some(crate::format::object_lock::Role::Holder),
        "a holds d's lock shared"
    );
    let by = Bystanders::new(&b, &c);
    let (dead, killed) = crash(&a);
    let changes = [
        timed_on(&b, move |b| {
            let (_, fh) = b.create(d, b"new", 0o644, C, true)?;
            b.release(&fh)
        }),
        timed_on(&b, move |b| b.unlink(d, b"old")),
        timed_on(&b, move |b| b.link(t.ino, d, b"t2").map(|_| ())),
        timed_on(&b, move |b| {
            b.rename(d, b"r1", d, b"r2", RenameFlags::default())
        }),
        timed_on(&b, move |b| {
            b.rename(r, b"m", d, b"m", RenameFlags::default())
        }),
    ];
    std::thread::sleep(Duration::from_millis(400));
    by.go_on(&b, &c, "b's changes in d waited for a's shared hold");
    assert!(
        changes.iter().all(|h| !h.is_finished()),
        "b's changes in d did not wait for a's recovery ({:?} after the crash, dead time \
         {dead:?}): the test proves nothing",
        killed.elapsed()
    );
    for h in changes {
        let (r, at) = h.join().unwrap();
        r.unwrap();
        assert!(
            at - killed >= dead / 2,
            "a change waited only {:?}",
            at - killed
        );
    }
    assert!(
        !b.member.is_fenced(),
        "b fenced itself: {:?}",
        b.member.fence_reason()
    );
    assert!(c.lookup(d, b"new").is_ok(), "c sees b's create");
    assert!(c.lookup(d, b"old").is_err(), "c sees b's unlink");
    assert_eq!(c.lookup(d, b"t2").unwrap().ino, t.ino, "c sees b's link");
    assert!(
        c.lookup(d, b"r1").is_err() && c.lookup(d, b"r2").is_ok(),
        "c sees the rename"
    );
    assert!(c.lookup(d, b"m").is_ok(), "c sees the move into d");
    by.end(&b, &c);
    unmount_and_check(&dev, &[&b, &c]);
}

/// The outside wait of a change that waited to own an inode (`Volume::await_holders`) ends
/// when the dead holder lets go, not at a live co-holder's heartbeat: a (dead) and c (alive)
/// hold b's file shared; b's wait returns only after a's recovery released a's hold, and
/// asks c for nothing (c still holds it). With c alone holding it, the wait ends at c's
/// next heartbeat: a live holder is waited for by the change itself, holding its locks.
#[test]
fn the_outside_wait_ends_when_the_dead_holder_lets_go() {
    use super::detached_tests::node;
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let c = node(&dev, "c");
    let r = a.root_ino();
    let (f, fh) = b.create(r, b"f", 0o644, C, true).unwrap();
    b.write(&fh, 0, &[5u8; 4096]).unwrap();
    b.fsync(f.ino, false).unwrap();
    let held: Vec<_> = [&a, &c]
        .iter()
        .map(|v| {
            let h = v.open(f.ino, false, false).unwrap();
            assert_eq!(read_all(v, &h, 4096), vec![5u8; 4096]);
            h
        })
        .collect();
    let holder = Some(crate::format::object_lock::Role::Holder);
    assert_eq!(role_on_disk(&a, f.ino), holder);
    assert_eq!(role_on_disk(&c, f.ino), holder);
    let (dead, killed) = crash(&a);
    b.wait_for_inode_lock(f.ino, true).unwrap();
    let waited = killed.elapsed();
    assert!(
        waited >= dead / 2,
        "b's outside wait ended {waited:?} after a's crash, before a's recovery (dead time \
         {dead:?}): c's heartbeat ended it"
    );
    assert_eq!(
        role_of_slot(&b, a.cl.me.slot, f.ino),
        None,
        "a's hold went with its recovery"
    );
    assert_eq!(role_on_disk(&c, f.ino), holder, "c was asked for nothing");
    // Only c, alive, holds it now: the wait ends at its next heartbeat (every 50 ms here).
    let t = Instant::now();
    b.wait_for_inode_lock(f.ino, true).unwrap();
    assert!(
        t.elapsed() < dead / 4,
        "b waited {:?} outside for a live holder",
        t.elapsed()
    );
    drop(held);
    b.release(&fh).unwrap();
    unmount_and_check(&dev, &[&b, &c]);
}
