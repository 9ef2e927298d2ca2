//! `cetra grow` on memory devices: the node that grows and the nodes that follow
//! (`fs/grow.rs`), the refusals, and a volume that fsck finds clean afterwards.

use super::multinode_tests::{assert_fsck_clean, read_all};
use super::*;
use crate::dev::mem::MemDevice;
use crate::dev::BlockDevice as _;
use crate::mkfs::{format, MkfsOptions};

const C: Caller = Caller::ROOT;
const MIB: u64 = 1 << 20;

fn small(size: u64, opts: &MkfsOptions) -> (Arc<MemDevice>, crate::format::superblock::Superblock) {
    let dev = Arc::new(MemDevice::new(size, 512));
    let sb = format(&*dev, opts, &mut |_, _| {}).unwrap();
    (dev, sb)
}

fn two_nodes() -> MkfsOptions {
    MkfsOptions {
        max_nodes: 2,
        journal_bytes: MIB,
        ..Default::default()
    }
}

fn mount(dev: &Arc<MemDevice>, host: &str) -> Arc<Volume> {
    super::multinode_tests::node(dev, host)
}

#[test]
fn a_grow_is_seen_by_every_node_and_its_groups_are_used() {
    let (dev, sb) = small(128 * MIB, &two_nodes());
    assert!(sb.can_grow());
    assert!(sb.group_capacity() >= 16 * sb.group_count);
    let a = mount(&dev, "a");
    let b = mount(&dev, "b");
    let before = b.statfs().unwrap().blocks;
    // The LUN has not grown: refused, nothing changes.
    assert_eq!(a.grow().unwrap_err().kind(), ErrorKind::Range);
    dev.extend(256 * MIB);
    let g = a.grow().unwrap();
    assert_eq!(g.old_groups, sb.group_count);
    assert!(g.new_groups >= 2 * sb.group_count - 1, "{g:?}");
    assert_eq!(a.statfs().unwrap().blocks, g.new_bytes / FS_BLOCK);
    // The other node learns it at its next grant of the global lock.
    let after = b.statfs().unwrap().blocks;
    assert_eq!(after, g.new_bytes / FS_BLOCK);
    assert!(after > before);
    // More than the old volume held: b must allocate in the new groups; a reads it back.
    let r = b.root_ino();
    let (f, fh) = b.create(r, b"big", 0o644, C, true).unwrap();
    let chunk: Vec<u8> = (0..MIB).map(|i| u8::try_from(i % 251).unwrap()).collect();
    let n = g.old_bytes / MIB + 8;
    for i in 0..n {
        b.write(&fh, i * MIB, &chunk).unwrap();
    }
    b.release(&fh).unwrap();
    b.fsync(f.ino, false).unwrap();
    let afh = a.open(f.ino, false, false).unwrap();
    let mut last = Vec::new();
    a.read(&afh, (n - 1) * MIB, u32::try_from(MIB).unwrap(), &mut |d| {
        last.extend_from_slice(d);
    })
    .unwrap();
    assert!(last == chunk);
    a.release(&afh).unwrap();
    a.unmount().unwrap();
    b.unmount().unwrap();
    assert_fsck_clean(&dev);
    // A fresh mount finds the new size, the backup superblock at the new end.
    let c = mount(&dev, "c");
    assert_eq!(c.statfs().unwrap().blocks, g.new_bytes / FS_BLOCK);
    assert_eq!(
        read_all(&c, &c.open(f.ino, false, false).unwrap(), 16),
        &chunk[..16]
    );
    c.unmount().unwrap();
}

#[test]
fn a_grow_stops_at_the_lock_area_and_older_formats_refuse() {
    let opts = MkfsOptions {
        max_bytes: Some(160 * MIB),
        ..two_nodes()
    };
    let (dev, sb) = small(128 * MIB, &opts);
    let cap = sb.group_capacity();
    assert!(cap > sb.group_count);
    let a = mount(&dev, "a");
    dev.extend(512 * MIB);
    let g = a.grow().unwrap();
    assert_eq!(g.new_groups, cap, "{g:?}");
    assert_eq!(a.grow().unwrap_err().kind(), ErrorKind::TooBig);
    a.unmount().unwrap();
    assert_fsck_clean(&dev);

    let v4 = MkfsOptions {
        growable: false,
        ..two_nodes()
    };
    let (dev, sb) = small(128 * MIB, &v4);
    assert_eq!(sb.format_version(), 4);
    let a = mount(&dev, "a");
    dev.extend(256 * MIB);
    assert_eq!(a.grow().unwrap_err().kind(), ErrorKind::Unsupported);
    a.unmount().unwrap();
}

/// `cetra tune -N` (`tune::apply`): two node slots become four; the added slots' journals are
/// runs inside groups, marked used; four nodes mount at once, the two new ones commit through
/// their new journals, and fsck is clean (the runs are claimed by their slots, not leaked).
#[test]
fn node_slots_added_offline_get_journals_in_the_groups() {
    let (dev, sb) = small(128 * MIB, &two_nodes());
    let free_before = {
        let v = mount(&dev, "a");
        let f = v.statfs().unwrap().bfree;
        v.unmount().unwrap();
        f
    };
    let t = crate::tune::Tune {
        max_nodes: Some(4),
        ..Default::default()
    };
    // Only more slots, at most the heartbeat area's, and only on format 5.
    for bad in [2, sb.hb_slots + 1] {
        let t = crate::tune::Tune {
            max_nodes: Some(bad),
            ..Default::default()
        };
        assert_eq!(
            crate::tune::apply(&*dev, &sb, &t).unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
    }
    let new = crate::tune::apply(&*dev, &sb, &t).unwrap();
    crate::tune::write_superblock(&*dev, &new).unwrap();
    assert_eq!((new.max_nodes, new.base_journals()), (4, 2));
    assert_eq!(
        new.format_version(),
        8,
        "group claims (8) and added slots (6)"
    );
    assert_eq!(new.extra_journals.len(), 2);
    for (i, &j) in new.extra_journals.iter().enumerate() {
        let slot = 2 + u32::try_from(i).unwrap();
        assert_eq!(crate::journal::JournalArea::for_slot(&new, slot).start, j);
        assert!(matches!(
            new.group_region_of(j),
            crate::format::layout::Region::GroupData { .. }
        ));
        assert!(!new.is_data_block(j), "an added journal is not file data");
    }
    assert_fsck_clean(&dev);

    let nodes: Vec<_> = ["a", "b", "c", "d"]
        .iter()
        .map(|h| mount(&dev, h))
        .collect();
    let journal_bytes = 2 * new.journal_blocks * FS_BLOCK;
    assert_eq!(
        nodes[0].statfs().unwrap().bfree,
        free_before - journal_bytes / FS_BLOCK
    );
    let r = nodes[0].root_ino();
    for v in &nodes {
        let name = format!("from-slot-{}", v.slot());
        let (f, fh) = v.create(r, name.as_bytes(), 0o644, C, true).unwrap();
        v.write(&fh, 0, name.as_bytes()).unwrap();
        v.release(&fh).unwrap();
        v.fsync(f.ino, false).unwrap();
    }
    // Slot 3 committed through its journal in the group area: a transaction header there.
    let j3 = new.journal_of(3);
    let mut raw = vec![0u8; 4096];
    dev.read_at((j3 + 1) * FS_BLOCK, &mut raw).unwrap();
    assert!(
        raw.iter().any(|&b| b != 0),
        "nothing was journaled in slot 3's journal"
    );
    for v in nodes {
        v.unmount().unwrap();
    }
    assert_fsck_clean(&dev);
    let v = mount(&dev, "e");
    for s in 0..4 {
        assert!(v.lookup(r, format!("from-slot-{s}").as_bytes()).is_ok());
    }
    v.unmount().unwrap();
}

/// After a grow, a host whose path still shows the old size must not fall back to the backup
/// of before the grow (it would lose the new groups, and fsck would write it over the primary):
/// `locate` refuses and says to rescan. A node that re-reads the superblock with the primary
/// torn finds the grown one in the backup at the new end.
#[test]
fn a_path_not_rescanned_is_refused_and_a_torn_primary_falls_back_to_the_new_backup() {
    let (dev, sb) = small(128 * MIB, &two_nodes());
    let a = mount(&dev, "a");
    dev.extend(256 * MIB);
    a.grow().unwrap();
    a.unmount().unwrap();
    let old_blocks = sb.total_blocks;
    let mut read = |b: u64| -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 4096];
        dev.read_at(b * FS_BLOCK, &mut buf)?;
        Ok(buf)
    };
    let e = crate::format::superblock::Superblock::locate(old_blocks, &mut read).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Range, "{e}");
    assert!(e.to_string().contains("rescan"), "{e}");
    let grown = crate::format::superblock::Superblock::locate(256 * MIB / FS_BLOCK, &mut read)
        .unwrap()
        .sb;
    assert!(grown.group_count > sb.group_count);
    // The primary torn: the newer superblock is found in the backup at the new end.
    dev.write_at(0, &vec![0xA5u8; 4096]).unwrap();
    let found = super::grow::newest(&*dev, &sb).unwrap().unwrap();
    assert_eq!(found, grown);
    // Nothing newer than itself.
    assert!(super::grow::newest(&*dev, &grown).unwrap().is_none());
}
