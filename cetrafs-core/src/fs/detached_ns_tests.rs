//! Namespace changes without the global lock (`fs/detached_ns.rs`), with several nodes on one
//! memory device.

use super::multinode_tests::{assert_fsck_clean, node_keeping as node, volume};
use super::*;
use crate::format::lock_record::LockMode;

const C: Caller = Caller::ROOT;

fn gml(v: &Volume) -> LockMode {
    v.lock_meta().gml()
}

/// The names in `dir`, sorted, without "." and "..".
fn names(v: &Volume, dir: Ino) -> Vec<String> {
    let mut out = super::tests::names(v, dir);
    out.retain(|n| n != "." && n != "..");
    out
}

/// One node (default timings: nothing may fence under a loaded test run) that owns directory
/// `d` after a first create in it on the global path.
fn one_node_dir() -> (
    std::sync::Arc<crate::dev::mem::MemDevice>,
    std::sync::Arc<Volume>,
    Ino,
) {
    let (dev, a) = super::tests::fresh(512 << 20);
    let d = a.mkdir(a.root_ino(), b"d", 0o755, C).unwrap().ino;
    let (_, fh) = a.create(d, b"first", 0o644, C, true).unwrap();
    a.release(&fh).unwrap();
    (dev, a, d)
}

/// Create, rename (same directory) and unlink, as bench/cluster.py's driver does, `n` times
/// from `i0`, keeping every `keep`-th file (renamed) and unlinking the rest.
fn churn(v: &Volume, dir: Ino, i0: u32, n: u32, keep: u32) {
    for i in i0..i0 + n {
        let name = format!("f{i}");
        let (_, fh) = v.create(dir, name.as_bytes(), 0o644, C, true).unwrap();
        v.release(&fh).unwrap();
        let renamed = format!("{name}.r");
        v.rename(
            dir,
            name.as_bytes(),
            dir,
            renamed.as_bytes(),
            RenameFlags::default(),
        )
        .unwrap();
        if i % keep != 0 {
            v.unlink(dir, renamed.as_bytes()).unwrap();
        }
    }
}

/// Two nodes, each with a directory it made (so it owns the directory's lock); b then holds
/// the global lock exclusively.
fn two_dirs() -> (
    std::sync::Arc<crate::dev::mem::MemDevice>,
    std::sync::Arc<Volume>,
    std::sync::Arc<Volume>,
    Ino,
    Ino,
) {
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let da = a.mkdir(a.root_ino(), b"a", 0o755, C).unwrap().ino;
    // The first change of the directory takes the global path: its lock becomes a's, and a
    // pool is filled.
    let (_, fh) = a.create(da, b"first", 0o644, C, true).unwrap();
    a.release(&fh).unwrap();
    let db = b.mkdir(b.root_ino(), b"b", 0o755, C).unwrap().ino;
    assert_eq!(gml(&b), LockMode::Exclusive);
    (dev, a, b, da, db)
}

#[test]
fn names_change_in_an_owned_directory_while_another_node_holds_the_global_lock() {
    let (dev, a, b, da, _) = two_dirs();
    churn(&a, da, 0, 60, 10);
    assert_eq!(
        gml(&a),
        LockMode::Free,
        "a namespace change in an owned directory took the global lock"
    );
    assert_eq!(gml(&b), LockMode::Exclusive);
    // What a sees, and what b sees once it reads the directory (a writes it home first).
    let mut want: Vec<String> = (0..60)
        .filter(|i| i % 10 == 0)
        .map(|i| format!("f{i}.r"))
        .collect();
    want.push("first".into());
    want.sort();
    assert_eq!(names(&a, da), want);
    assert_eq!(names(&b, da), want);
    let f0 = b.lookup(da, b"f0.r").unwrap();
    assert_eq!(f0.kind, FileKind::Regular);
    assert_eq!(
        b.lookup(da, b"f1.r").unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // a's creates were fresh inodes: once b has read the directory they are not, and a's
    // next changes of them take the global path.
    a.unlink(da, b"f0.r").unwrap();
    assert_eq!(
        b.lookup(da, b"f0.r").unwrap_err().kind(),
        ErrorKind::NotFound
    );
    assert_eq!(b.getattr(f0.ino).map_or(0, |x| x.nlink), 0);
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

#[test]
fn another_node_changes_a_directory_changed_without_the_global_lock() {
    let (dev, a, b, da, db) = two_dirs();
    churn(&a, da, 0, 20, 4);
    // b creates in a's directory: it takes the directory's lock from a (which writes it home
    // and empties its journal), then a's next change takes it back on the global path and
    // goes on without the lock after that.
    let (_, fh) = b.create(da, b"from-b", 0o644, C, true).unwrap();
    b.release(&fh).unwrap();
    b.rename(da, b"f4.r", db, b"moved", RenameFlags::default())
        .unwrap();
    churn(&a, da, 20, 20, 4);
    let mut want: Vec<String> = (0..40)
        .filter(|i| i % 4 == 0 && *i != 4)
        .map(|i| format!("f{i}.r"))
        .collect();
    want.extend(["first".to_string(), "from-b".to_string()]);
    want.sort();
    assert_eq!(names(&b, da), want);
    assert_eq!(names(&a, da), want);
    assert_eq!(names(&a, db), vec!["moved".to_string()]);
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

#[test]
fn a_node_killed_after_namespace_changes_without_the_global_lock_is_recovered() {
    let (dev, a, b, da, _) = two_dirs();
    churn(&a, da, 0, 30, 3);
    a.sync().unwrap();
    // Unlinked while still referenced by the kernel: an orphan when a dies.
    let (o, fh) = a.create(da, b"orphan", 0o644, C, true).unwrap();
    a.release(&fh).unwrap();
    a.note_lookup(o.ino);
    a.unlink(da, b"orphan").unwrap();
    a.sync().unwrap();
    assert_eq!(gml(&a), LockMode::Free);
    a.member.fence("test: simulated crash".into());
    // b waits for a's recovery (the directory's lock: its journal replayed, its pool and
    // orphan freed, its locks released) and finds every name a's last sync covered.
    let mut want: Vec<String> = (0..30)
        .filter(|i| i % 3 == 0)
        .map(|i| format!("f{i}.r"))
        .collect();
    want.push("first".into());
    want.sort();
    let got = names(&b, da);
    assert_eq!(got, want);
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

#[test]
fn two_nodes_changing_one_directory_in_turns_see_every_name() {
    let (dev, a, b, da, _) = two_dirs();
    // Turns of a few operations each: the directory's hold goes back and forth, inodes made
    // without the global lock become known to the other node, and the directory turns
    // contended (changed on the global path, its hold given back with the global lock).
    for turn in 0..12u32 {
        let (v, tag) = if turn % 2 == 0 { (&a, "a") } else { (&b, "b") };
        for i in 0..6 {
            let name = format!("{tag}{turn}-{i}");
            let (_, fh) = v.create(da, name.as_bytes(), 0o644, C, true).unwrap();
            v.release(&fh).unwrap();
            if i % 2 == 1 {
                v.unlink(da, name.as_bytes()).unwrap();
            }
        }
        // Rename and unlink a name the other node made in its last turn.
        if turn > 0 {
            let other = if turn % 2 == 0 { "b" } else { "a" };
            let old = format!("{other}{}-0", turn - 1);
            let new = format!("{old}.moved");
            v.rename(
                da,
                old.as_bytes(),
                da,
                new.as_bytes(),
                RenameFlags::default(),
            )
            .unwrap();
            v.unlink(da, format!("{other}{}-2", turn - 1).as_bytes())
                .unwrap();
        }
    }
    let mut want = vec!["first".to_string()];
    for turn in 0..12u32 {
        let tag = if turn % 2 == 0 { "a" } else { "b" };
        let moved = turn < 11;
        want.push(if moved {
            format!("{tag}{turn}-0.moved")
        } else {
            format!("{tag}{turn}-0")
        });
        if turn == 11 {
            want.push(format!("{tag}{turn}-2"));
        }
        want.push(format!("{tag}{turn}-4"));
    }
    want.sort();
    assert_eq!(names(&a, da), want);
    assert_eq!(names(&b, da), want);
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

#[test]
fn a_crash_image_after_namespace_changes_without_the_global_lock_checks_clean() {
    // Default timings: the next mount of the image must not fence under a loaded test run.
    let (dev, a, d) = one_node_dir();
    // Fresh inodes made and freed into the pool (their old images stay in pool blocks), and
    // some kept, all without the global lock (a is alone: it would hold it, but the
    // directory is owned, so the changes go detached all the same).
    churn(&a, d, 0, 40, 5);
    assert!(
        !a.detached.pool_idle(),
        "no namespace change went without the global lock"
    );
    a.sync().unwrap();
    let image = dev.snapshot();
    a.unmount().unwrap();
    super::tests::crashed_image_recovers(image, |v2| {
        let mut want: Vec<String> = (0..40)
            .filter(|i| i % 5 == 0)
            .map(|i| format!("f{i}.r"))
            .collect();
        want.push("first".into());
        want.sort();
        assert_eq!(names(v2, d), want);
        // The names made before the crash can be changed again after it.
        v2.unlink(d, b"f0.r").unwrap();
        churn(v2, d, 100, 10, 1);
    });
}

#[test]
fn an_unlinked_fresh_inode_keeps_its_number_until_the_kernel_forgets_it() {
    let (dev, a, b, da, _) = two_dirs();
    let (x, fh) = a.create(da, b"x", 0o644, C, true).unwrap();
    a.release(&fh).unwrap();
    a.note_lookup(x.ino);
    // Freed into the pool at once (no orphan entry: the slot header is changed under the
    // global lock only), its number pinned while the kernel references it.
    a.unlink(da, b"x").unwrap();
    assert_eq!(gml(&a), LockMode::Free, "the unlink took the global lock");
    assert_eq!(a.getattr(x.ino).unwrap_err().kind(), ErrorKind::NotFound);
    assert!(
        !a.detached.pool_idle(),
        "the pool may not go while it pins a number"
    );
    for i in 0..64 {
        let (n, fh) = a
            .create(da, format!("n{i}").as_bytes(), 0o644, C, true)
            .unwrap();
        a.release(&fh).unwrap();
        assert_ne!(n.ino, x.ino, "number reused while the kernel references it");
        a.unlink(da, format!("n{i}").as_bytes()).unwrap();
    }
    a.forget(x.ino, 1);
    assert!(
        !a.detached.take_kernel_hold(x.ino),
        "still held after the forget"
    );
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

#[test]
fn another_node_freeing_an_orphan_of_this_node_loses_no_orphan_entry() {
    // The slot header is changed by its node and, under the global lock, by a node that
    // frees an inode on its orphan list: never without the global lock.
    let dev = volume(4);
    let a = node(&dev, "a");
    let b = node(&dev, "b");
    let r = a.root_ino();
    let (y, fh) = a.create(r, b"y", 0o644, C, true).unwrap();
    a.release(&fh).unwrap();
    let bfh = b.open(y.ino, false, false).unwrap();
    // a unlinks y while b has it open: y goes on a's orphan list.
    a.unlink(r, b"y").unwrap();
    let da = a.mkdir(r, b"d", 0o755, C).unwrap().ino;
    let (_, fh) = a.create(da, b"first", 0o644, C, true).unwrap();
    a.release(&fh).unwrap();
    for i in 0..20u32 {
        let name = format!("k{i}");
        let (k, fh) = a.create(da, name.as_bytes(), 0o644, C, true).unwrap();
        a.release(&fh).unwrap();
        a.note_lookup(k.ino);
        a.unlink(da, name.as_bytes()).unwrap();
        if i == 10 {
            // b's last close frees y, and takes it off a's list (under the global lock).
            b.release(&bfh).unwrap();
        }
    }
    b.sync().unwrap();
    a.sync().unwrap();
    // What a's slot header holds at home (b's removal of y, a's own entries).
    let at = a.lock_meta().journal().start;
    let mut raw = crate::dev::AlignedBuf::new(crate::format::FS_BLOCK_SIZE);
    crate::dev::BlockDevice::read_at(&*dev, at * FS_BLOCK, &mut raw).unwrap();
    let h = crate::format::slot_header::SlotHeader::decode(&raw, at, a.slot()).unwrap();
    assert!(
        !h.orphans.contains(&y.ino),
        "y is back on a's list: {:?}",
        h.orphans
    );
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}

#[test]
fn a_fresh_inode_unlinked_while_open_is_parked_in_the_pool() {
    // Default timings, one node: nothing here may fence under a loaded test run.
    let (dev, a, d) = one_node_dir();
    // Unlinked while open (through FUSE: the unlink overtook the close's release): parked,
    // its one block the pool's, no orphan entry.
    let (p, pfh) = a.create(d, b"parked", 0o644, C, true).unwrap();
    a.unlink(d, b"parked").unwrap();
    assert!(a.detached.take_parked(p.ino), "not parked");
    a.detached.park(p.ino);
    assert_eq!(a.getattr(p.ino).unwrap().nlink, 0);
    // Another one written after its unlink: the write takes the global path, which puts it
    // on the orphan list; its data reads back through the handle.
    let (w, wfh) = a.create(d, b"written", 0o644, C, true).unwrap();
    a.unlink(d, b"written").unwrap();
    a.write(&wfh, 0, &[7; 4096]).unwrap();
    assert!(
        !a.detached.take_parked(w.ino),
        "still parked after a change"
    );
    let mut back = Vec::new();
    a.read(&wfh, 0, 4096, &mut |x| back.extend_from_slice(x))
        .unwrap();
    assert_eq!(back, vec![7; 4096]);
    a.sync().unwrap();
    // A crash now finds both accounted for (one a pool block, one an orphan).
    let image = dev.snapshot();
    // Their last closes free them.
    a.release(&pfh).unwrap();
    a.release(&wfh).unwrap();
    assert_eq!(a.getattr(p.ino).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(a.getattr(w.ino).unwrap_err().kind(), ErrorKind::NotFound);
    a.unmount().unwrap();
    assert_fsck_clean(&dev);
    super::tests::crashed_image_recovers(image, |_| {});
}

#[test]
fn a_parked_inode_outlives_its_directorys_handoff() {
    let (dev, a, b, da, db) = two_dirs();
    let (p, pfh) = a.create(da, b"p", 0o644, C, true).unwrap();
    a.unlink(da, b"p").unwrap();
    // b reads the directory (a hands it over: p's directory no longer hides it) and changes
    // metadata (the global lock moves: a's next global hold is a new epoch).
    assert_eq!(names(&b, da), vec!["first".to_string()]);
    let (_, fh) = b.create(db, b"x", 0o644, C, true).unwrap();
    b.release(&fh).unwrap();
    // a's open handle still works: fstat, then a write (which puts p on the orphan list).
    assert_eq!(a.getattr(p.ino).unwrap().nlink, 0);
    a.write(&pfh, 0, &[3; 4096]).unwrap();
    let mut back = Vec::new();
    a.read(&pfh, 0, 4096, &mut |x| back.extend_from_slice(x))
        .unwrap();
    assert_eq!(back, vec![3; 4096]);
    a.release(&pfh).unwrap();
    assert_eq!(a.getattr(p.ino).unwrap_err().kind(), ErrorKind::NotFound);
    assert!(a.detached.pool_idle() || !a.detached.is_parked(p.ino));
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
}
