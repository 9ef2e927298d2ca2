use super::synth::{SynthVolume, MIN_SYNTH_BYTES};
use super::*;
use crate::dev::mem::MemDevice;
use crate::error::ErrorKind;
use crate::format::block::BlockType;
use crate::format::dirent::DirEntry;
use crate::format::xattr::{Head, Layout};
use crate::mkfs::{format, MkfsOptions};

fn fresh(size: u64, lbs: u32) -> (MemDevice, Superblock) {
    let dev = MemDevice::new(size, lbs);
    let opts = MkfsOptions {
        max_nodes: 2,
        journal_bytes: 1 << 20,
        inode_lock_slots: 64,
        ..Default::default()
    };
    let sb = format(&dev, &opts, &mut |_, _| {}).unwrap();
    (dev, sb)
}

fn rd(dev: &dyn BlockDevice, b: u64) -> Vec<u8> {
    read_block(dev, b).unwrap().to_vec()
}

fn wr(dev: &dyn BlockDevice, b: u64, data: &[u8]) {
    dev.write_at(b * FS_BLOCK, &AlignedBuf::from_slice(data))
        .unwrap();
}

fn kinds(r: &Report) -> Vec<FindingKind> {
    r.findings.iter().map(|f| f.kind).collect()
}

fn assert_clean(r: &Report) {
    assert!(
        r.findings.is_empty(),
        "unexpected findings:\n{}",
        r.findings
            .iter()
            .map(std::string::ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Find the inode reached as `name` in the root of a volume (single-leaf root tree).
fn lookup(dev: &dyn BlockDevice, dir: u64, name: &str) -> u64 {
    let d = Inode::decode(&rd(dev, dir), dir).unwrap();
    let mut stack = vec![d.tree_root];
    while let Some(b) = stack.pop() {
        match TreeNode::decode(&rd(dev, b), b).unwrap().entries {
            NodeEntries::Internal(v) => stack.extend(v.iter().map(|e| e.1)),
            NodeEntries::Leaf(v) => {
                for (_, val) in v {
                    if let Some(e) = decode_entries(&val)
                        .unwrap()
                        .into_iter()
                        .find(|e| e.name == name.as_bytes())
                    {
                        return e.ino;
                    }
                }
            }
        }
    }
    panic!("{name} not found");
}

#[test]
fn fresh_volumes_are_clean() {
    for (size, lbs) in [(64u64 << 20, 512u32), (80 << 20, 4096)] {
        let (dev, sb) = fresh(size, lbs);
        let mut passes = Vec::new();
        let r = check_volume_with(&dev, &mut |p| passes.push(p)).unwrap();
        assert_clean(&r);
        assert_eq!(passes.len(), 6);
        assert_eq!(r.stats.inodes, 1);
        assert_eq!(r.stats.directories, 1);
        assert_eq!(r.superblock.as_ref(), Some(&sb));
        assert_eq!(r.stats.group_area_blocks, sb.group_count * sb.group_blocks);
    }
}

#[test]
fn populated_synthetic_volume_is_clean() {
    let dev = SynthVolume::sample().unwrap();
    let r = check_volume(&dev).unwrap();
    assert_clean(&r);
    assert_eq!(r.stats.directories, 3);
    assert_eq!(r.stats.regular_files, 14);
    assert_eq!(r.stats.symlinks, 2);
    assert_eq!(r.stats.special_files, 1);
    // The sample must really exercise multi-level trees.
    let root = r.superblock.unwrap().root_ino;
    let docs = lookup(&dev, root, "docs");
    let d = Inode::decode(&rd(&dev, docs), docs).unwrap();
    assert!(
        TreeNode::decode(&rd(&dev, d.tree_root), d.tree_root)
            .unwrap()
            .level
            > 0
    );
}

#[test]
fn not_cetrafs_is_an_error_not_a_report() {
    let dev = MemDevice::new(32 << 20, 512);
    let e = check_volume(&dev).unwrap_err();
    assert!(e.to_string().contains("not a CetraFS volume"), "{e}");
}

#[test]
fn damaged_primary_falls_back_to_backup() {
    let (dev, sb) = fresh(64 << 20, 512);
    let mut b = rd(&dev, 0);
    b[200] ^= 1;
    wr(&dev, 0, &b);
    let r = check_volume(&dev).unwrap();
    assert_eq!(kinds(&r), [FindingKind::PrimarySuperblock]);
    assert!(
        r.findings[0].to_string().contains("checksum"),
        "{}",
        r.findings[0]
    );
    assert_eq!(r.superblock.unwrap().uuid, sb.uuid);
}

#[test]
fn backup_differences_are_found_but_seq_is_ignored() {
    let (dev, sb) = fresh(64 << 20, 512);
    let mut other = sb.clone();
    other.seq += 5;
    wr(&dev, sb.backup_block, &other.encode());
    assert_clean(&check_volume(&dev).unwrap());
    other.label = "changed".into();
    wr(&dev, sb.backup_block, &other.encode());
    let r = check_volume(&dev).unwrap();
    assert_eq!(kinds(&r), [FindingKind::BackupSuperblock]);
    wr(&dev, sb.backup_block, &[0u8; FS_BLOCK_SIZE]);
    let r = check_volume(&dev).unwrap();
    assert_eq!(kinds(&r), [FindingKind::BackupSuperblock]);
    assert_eq!(r.findings[0].block, Some(sb.backup_block));
}

#[test]
fn unknown_incompat_feature_refuses_ro_compat_warns() {
    let (dev, mut sb) = fresh(64 << 20, 512);
    sb.ro_compat = 0x4;
    wr(&dev, 0, &sb.encode());
    wr(&dev, sb.backup_block, &sb.encode());
    let r = check_volume(&dev).unwrap();
    assert_eq!(kinds(&r), [FindingKind::Features]);
    assert!(r.is_clean(), "a warning is not an error");
    // A bit this release does not know (what an older binary sees in INCOMPAT_OVERFLOW).
    sb.incompat |= 0x8000;
    wr(&dev, 0, &sb.encode());
    assert_eq!(
        check_volume(&dev).unwrap_err().kind(),
        ErrorKind::Unsupported
    );
}

#[test]
fn bit_flip_in_group_header() {
    let (dev, sb) = fresh(64 << 20, 512);
    let g1 = sb.group_first_block(1);
    let mut b = rd(&dev, g1);
    b[70] ^= 0x10;
    wr(&dev, g1, &b);
    let r = check_volume(&dev).unwrap();
    assert_eq!(kinds(&r), [FindingKind::GroupHeader]);
    assert_eq!(r.findings[0].block, Some(g1));
    assert!(
        r.findings[0]
            .to_string()
            .starts_with(&format!("block {g1}: group 1 header is unusable")),
        "{}",
        r.findings[0]
    );
}

#[test]
fn wrong_free_count_and_bitmap_damage() {
    let (dev, sb) = fresh(64 << 20, 512);
    assert!(sb.group_count >= 3);
    let g = sb.group_first_block(2);
    let mut h = GroupHeader::decode(&rd(&dev, g), g).unwrap();
    h.free_blocks -= 1;
    wr(&dev, g, &h.encode());
    let r = check_volume(&dev).unwrap();
    assert_eq!(kinds(&r), [FindingKind::FreeCount]);
    // A bitmap block of another type: reported, and that group's space is not cross-checked.
    let bm = sb.group_first_block(sb.group_count - 1) + 1;
    let mut raw = rd(&dev, bm);
    BlockHeader {
        btype: BlockType::Xattr,
        blockno: bm,
        seq: 1,
        owner: 0,
    }
    .seal(&mut raw);
    wr(&dev, bm, &raw);
    let r = check_volume(&dev).unwrap();
    assert!(
        r.findings
            .iter()
            .any(|f| f.kind == FindingKind::Bitmap && f.block == Some(bm)),
        "{:?}",
        r.findings
    );
}

/// Rewrite one bit of a group bitmap.
fn set_bit(dev: &dyn BlockDevice, sb: &Superblock, block: u64, on: bool, fix_count: bool) {
    let g = sb.group_of(block).unwrap();
    set_group_bit(dev, sb, g, block - sb.group_first_block(g), on, fix_count);
}

/// Rewrite bit `rel` of group `g`'s bitmap (may lie past the end of the group).
fn set_group_bit(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    g: u64,
    rel: u64,
    on: bool,
    fix_count: bool,
) {
    let first = sb.group_first_block(g);
    let at = first + 1 + rel / BITS_PER_BITMAP_BLOCK;
    let raw = rd(dev, at);
    let (seq, p) = decode_bitmap(&raw, at).unwrap();
    let mut bits = p.to_vec();
    let o = rel % BITS_PER_BITMAP_BLOCK;
    if on {
        bits[(o / 8) as usize] |= 1 << (o % 8);
    } else {
        bits[(o / 8) as usize] &= !(1 << (o % 8));
    }
    wr(dev, at, &encode_bitmap(at, seq + 1, &bits));
    if fix_count {
        let mut h = GroupHeader::decode(&rd(dev, first), first).unwrap();
        h.free_blocks = if on {
            h.free_blocks - 1
        } else {
            h.free_blocks + 1
        };
        wr(dev, first, &h.encode());
    }
}

use crate::format::group::encode_bitmap;

#[test]
fn used_block_marked_free() {
    let (dev, sb) = fresh(64 << 20, 512);
    set_bit(&dev, &sb, sb.root_ino, false, true);
    let r = check_volume(&dev).unwrap();
    assert_eq!(kinds(&r), [FindingKind::BlockFree]);
    assert_eq!(r.findings[0].block, Some(sb.root_ino));
    assert!(r.findings[0].message.contains("inode"), "{}", r.findings[0]);
}

#[test]
fn leaked_block_and_group_metadata_free() {
    let (dev, sb) = fresh(64 << 20, 512);
    let leak = sb.root_ino + 100;
    set_bit(&dev, &sb, leak, true, true);
    let r = check_volume(&dev).unwrap();
    assert_eq!(kinds(&r), [FindingKind::BlockLeaked]);
    assert_eq!(
        r.findings[0].to_string(),
        format!("block {leak}: block {leak} is marked used but nothing references them (leaked)")
    );
    let (dev, sb) = fresh(64 << 20, 512);
    let hdr = sb.group_first_block(1);
    set_bit(&dev, &sb, hdr, false, true);
    let r = check_volume(&dev).unwrap();
    assert!(
        r.has(FindingKind::GroupMetadataFree) && r.has(FindingKind::BlockFree),
        "{:?}",
        r.findings
    );
}

#[test]
fn bits_past_group_end_must_be_set() {
    let (dev, sb) = fresh(64 << 20, 512);
    assert!(u64::from(sb.bitmap_blocks) * BITS_PER_BITMAP_BLOCK > sb.group_blocks);
    set_group_bit(&dev, &sb, 0, sb.group_blocks, false, false);
    let r = check_volume(&dev).unwrap();
    assert_eq!(kinds(&r), [FindingKind::BitsPastEnd]);
}

#[test]
fn zeroed_root_inode() {
    let (dev, sb) = fresh(64 << 20, 512);
    wr(&dev, sb.root_ino, &[0u8; FS_BLOCK_SIZE]);
    let r = check_volume(&dev).unwrap();
    assert!(
        r.findings.iter().any(|f| f.kind == FindingKind::BadInode
            && f.ino == Some(sb.root_ino)
            && f.message.contains("unusable")),
        "{:?}",
        r.findings
    );
    assert!(r
        .findings
        .iter()
        .any(|f| f.message.contains("no usable root directory")));
}

#[test]
fn corrupted_synthetic_structures() {
    // Each case damages one thing on a fresh sample and names the finding it must produce.
    type Damage = fn(&MemDevice, &Superblock) -> ();
    let cases: Vec<(&str, Damage, FindingKind)> = vec![
        (
            "wrong nlink on a file",
            |d, sb| {
                let ino = lookup(d, sb.root_ino, "latest");
                let mut i = Inode::decode(&rd(d, ino), ino).unwrap();
                i.nlink = 2;
                wr(d, ino, &i.encode());
            },
            FindingKind::LinkCount,
        ),
        (
            "wrong nlink on a directory",
            |d, sb| {
                let mut i = Inode::decode(&rd(d, sb.root_ino), sb.root_ino).unwrap();
                i.nlink = 2;
                wr(d, sb.root_ino, &i.encode());
            },
            FindingKind::LinkCount,
        ),
        (
            "wrong block count",
            |d, sb| {
                let ino = lookup(d, sb.root_ino, "big.img");
                let mut i = Inode::decode(&rd(d, ino), ino).unwrap();
                i.blocks += 1;
                wr(d, ino, &i.encode());
            },
            FindingKind::BlockCount,
        ),
        (
            "symlink size",
            |d, sb| {
                let ino = lookup(d, sb.root_ino, "latest");
                let mut i = Inode::decode(&rd(d, ino), ino).unwrap();
                i.size += 1;
                wr(d, ino, &i.encode());
            },
            FindingKind::Symlink,
        ),
        (
            "written data past EOF",
            |d, sb| {
                let ino = lookup(d, sb.root_ino, "big.img");
                let mut i = Inode::decode(&rd(d, ino), ino).unwrap();
                i.size = 4 * FS_BLOCK;
                wr(d, ino, &i.encode());
            },
            FindingKind::BadExtent,
        ),
        (
            "directory parent",
            |d, sb| {
                let ino = lookup(d, sb.root_ino, "docs");
                let mut i = Inode::decode(&rd(d, ino), ino).unwrap();
                i.parent = ino;
                wr(d, ino, &i.encode());
            },
            FindingKind::DirParent,
        ),
        (
            "tree node checksum",
            |d, sb| {
                let ino = lookup(d, sb.root_ino, "big.img");
                let i = Inode::decode(&rd(d, ino), ino).unwrap();
                let mut b = rd(d, i.tree_root);
                b[100] ^= 4;
                wr(d, i.tree_root, &b);
            },
            FindingKind::BadTree,
        ),
        (
            "xattr block of another inode",
            |d, sb| {
                let ino = lookup(d, sb.root_ino, "big.img");
                let i = Inode::decode(&rd(d, ino), ino).unwrap();
                // Re-sealed with another owner: valid on its own, but not this inode's.
                let mut b = rd(d, i.xattr_block);
                let mut h = BlockHeader::decode(&b).unwrap();
                h.owner = ino + 1;
                h.seal(&mut b);
                wr(d, i.xattr_block, &b);
            },
            FindingKind::BadXattr,
        ),
        (
            "xattr overflow block of another inode",
            |d, sb| {
                let ino = lookup(d, sb.root_ino, "big.img");
                let i = Inode::decode(&rd(d, ino), ino).unwrap();
                let h = Head::decode(&rd(d, i.xattr_block), i.xattr_block, Layout::V2).unwrap();
                let mut b = rd(d, h.more[0]);
                let mut hd = BlockHeader::decode(&b).unwrap();
                hd.owner = ino + 1;
                hd.seal(&mut b);
                wr(d, h.more[0], &b);
            },
            FindingKind::BadXattr,
        ),
        (
            "xattr overflow blocks swapped",
            |d, sb| {
                let ino = lookup(d, sb.root_ino, "big.img");
                let i = Inode::decode(&rd(d, ino), ino).unwrap();
                let xb = i.xattr_block;
                let mut b = rd(d, xb);
                let h = Head::decode(&b, xb, Layout::V2).unwrap();
                assert_eq!(h.more.len(), 2, "the sample's set has two overflow blocks");
                b[48..56].copy_from_slice(&h.more[1].to_le_bytes());
                b[56..64].copy_from_slice(&h.more[0].to_le_bytes());
                BlockHeader::decode(&rd(d, xb)).unwrap().seal(&mut b);
                wr(d, xb, &b);
            },
            FindingKind::BadXattr,
        ),
        (
            "symlink overflow block damaged",
            |d, sb| {
                let docs = lookup(d, sb.root_ino, "docs");
                let ino = lookup(d, lookup(d, docs, "deep"), "long");
                let i = Inode::decode(&rd(d, ino), ino).unwrap();
                let mut b = rd(d, i.overflow_block);
                b[60] ^= 1;
                wr(d, i.overflow_block, &b);
            },
            FindingKind::Symlink,
        ),
        (
            "symlink overflow pointing at another inode's block",
            |d, sb| {
                let docs = lookup(d, sb.root_ino, "docs");
                let ino = lookup(d, lookup(d, docs, "deep"), "long");
                let big = lookup(d, sb.root_ino, "big.img");
                let bi = Inode::decode(&rd(d, big), big).unwrap();
                let h = Head::decode(&rd(d, bi.xattr_block), bi.xattr_block, Layout::V2).unwrap();
                let mut i = Inode::decode(&rd(d, ino), ino).unwrap();
                i.overflow_block = h.more[1];
                wr(d, ino, &i.encode());
            },
            FindingKind::BlockShared,
        ),
        (
            "symlink size does not match its overflow block",
            |d, sb| {
                let docs = lookup(d, sb.root_ino, "docs");
                let ino = lookup(d, lookup(d, docs, "deep"), "long");
                let mut i = Inode::decode(&rd(d, ino), ino).unwrap();
                i.size -= 1;
                wr(d, ino, &i.encode());
            },
            FindingKind::Symlink,
        ),
        (
            "two files share a data block",
            |d, sb| {
                let a = lookup(d, sb.root_ino, "big.img");
                let docs = lookup(d, sb.root_ino, "docs");
                let n = lookup(d, docs, "note3.txt");
                let big = Inode::decode(&rd(d, a), a).unwrap();
                let leaf = TreeNode::decode(&rd(d, big.tree_root), big.tree_root).unwrap();
                let NodeEntries::Leaf(v) = leaf.entries else {
                    panic!("big.img tree is one leaf")
                };
                let phys = Extent::decode_value(v[0].0, &v[0].1).unwrap().physical;
                let mut i = Inode::decode(&rd(d, n), n).unwrap();
                i.inline_extents[0].physical = phys;
                wr(d, n, &i.encode());
            },
            FindingKind::BlockShared,
        ),
        (
            "entry under the wrong hash",
            |d, sb| {
                let root = Inode::decode(&rd(d, sb.root_ino), sb.root_ino).unwrap();
                let mut leaf = TreeNode::decode(&rd(d, root.tree_root), root.tree_root).unwrap();
                if let NodeEntries::Leaf(v) = &mut leaf.entries {
                    // Keep keys ordered: bump the last key by one.
                    let last = v.last_mut().unwrap();
                    last.0 += 1;
                }
                wr(d, root.tree_root, &leaf.encode());
            },
            FindingKind::BadEntry,
        ),
        (
            "entry type differs from mode",
            |d, sb| {
                let root = Inode::decode(&rd(d, sb.root_ino), sb.root_ino).unwrap();
                let mut leaf = TreeNode::decode(&rd(d, root.tree_root), root.tree_root).unwrap();
                if let NodeEntries::Leaf(v) = &mut leaf.entries {
                    for (_, val) in v.iter_mut() {
                        let mut es: Vec<DirEntry> = decode_entries(val).unwrap();
                        for e in &mut es {
                            if e.name == b"latest" {
                                e.dtype = libc::DT_REG;
                            }
                        }
                        *val = crate::format::dirent::encode_entries(&es);
                    }
                }
                wr(d, root.tree_root, &leaf.encode());
            },
            FindingKind::EntryType,
        ),
        (
            "directory hard link",
            |d, sb| {
                // Add a second entry for "docs" inside docs/deep.
                let docs = lookup(d, sb.root_ino, "docs");
                let deep = lookup(d, docs, "deep");
                let di = Inode::decode(&rd(d, deep), deep).unwrap();
                let mut leaf = TreeNode::decode(&rd(d, di.tree_root), di.tree_root).unwrap();
                let name = b"again".to_vec();
                let e = DirEntry {
                    name: name.clone(),
                    ino: docs,
                    dtype: libc::DT_DIR,
                };
                let NodeEntries::Leaf(v) = &mut leaf.entries else {
                    panic!("deep/ is one leaf")
                };
                let k = name_hash(&name);
                let pos = v.partition_point(|x| x.0 < k);
                v.insert(pos, (k, crate::format::dirent::encode_entries(&[e])));
                wr(d, di.tree_root, &leaf.encode());
            },
            FindingKind::DirLinkedTwice,
        ),
    ];
    for (what, damage, want) in cases {
        let dev = SynthVolume::sample().unwrap();
        let sb = check_volume(&dev).unwrap().superblock.unwrap();
        damage(&dev, &sb);
        let r = check_volume(&dev).unwrap();
        assert!(
            r.has(want),
            "{what}: expected {want:?}, got:\n{}",
            r.findings
                .iter()
                .map(std::string::ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert!(!r.is_clean(), "{what}");
    }
}

#[test]
fn cyclic_tree_terminates() {
    let mut v = SynthVolume::new(MIN_SYNTH_BYTES).unwrap();
    v.fanout = 2;
    let root = v.root();
    for i in 0..8 {
        v.mknod(root, &format!("f{i}"), libc::S_IFIFO | 0o644, 0)
            .unwrap();
    }
    let dev = v.finish().unwrap();
    let i = Inode::decode(&rd(&dev, root), root).unwrap();
    let mut top = TreeNode::decode(&rd(&dev, i.tree_root), i.tree_root).unwrap();
    // Point the second child back at the first: shared subtree, reported once, not re-walked.
    if let NodeEntries::Internal(v) = &mut top.entries {
        v[1].1 = v[0].1;
    }
    wr(&dev, i.tree_root, &top.encode());
    let r = check_volume(&dev).unwrap();
    assert!(r.has(FindingKind::BlockShared), "{:?}", r.findings);
}

mod control_areas {
    use super::*;
    use crate::cluster::lock::LockLayout;
    use crate::cluster::membership::lba_of;
    use crate::format::heartbeat::{Heartbeat, SlotState};
    use crate::format::lock_record::{LockKind, LockMode, LockRecord, OpenEntry};
    use crate::format::mailbox::Mailbox;
    use crate::format::object_lock::{Bucket, Role, NO_NEXT};

    fn hb(sb: &Superblock, slot: u32, state: SlotState, generation: u64) -> Heartbeat {
        Heartbeat {
            state,
            generation,
            counter: 1,
            nonce: 1,
            uuid: sb.uuid,
            interval_ms: sb.heartbeat_interval_ms,
            io_timeout_ms: sb.io_timeout_ms,
            slot,
            host: "n".into(),
            pid: 1,
            recoverer: u32::MAX,
            recoverer_gen: 0,
            machine: crate::cluster::machine::MachineId::UNKNOWN,
            watchdog_ms: 0,
        }
    }

    fn put_hb(dev: &MemDevice, sb: &Superblock, h: &Heartbeat) {
        let lbs = sb.logical_block_size as usize;
        dev.write_at(lba_of(sb, h.slot) * lbs as u64, &h.encode(lbs))
            .unwrap();
    }

    fn put_lock(dev: &MemDevice, sb: &Superblock, index: u64, raw: &[u8]) {
        let lbs = u64::from(sb.logical_block_size);
        dev.write_at(sb.lock_start * FS_BLOCK + index * lbs, raw)
            .unwrap();
    }

    fn lock(sb: &Superblock, index: u64) -> LockRecord {
        let (kind, object) = LockLayout::new(sb).kind_of(index);
        LockRecord::free(kind, index, object)
    }

    fn lock_findings(r: &Report) -> Vec<(Severity, String)> {
        r.findings
            .iter()
            .filter(|f| {
                matches!(
                    f.kind,
                    FindingKind::LockRecord
                        | FindingKind::Heartbeat
                        | FindingKind::ObjectLock
                        | FindingKind::Mailbox
                )
            })
            .map(|f| (f.severity, f.message.clone()))
            .collect()
    }

    fn has(r: &Report, sev: Severity, words: &[&str]) -> bool {
        lock_findings(r)
            .iter()
            .any(|(s, m)| *s == sev && words.iter().all(|w| m.contains(w)))
    }

    #[test]
    fn a_stopped_node_and_its_own_locks_are_only_warnings() {
        let (dev, sb) = fresh(64 << 20, 512);
        put_hb(&dev, &sb, &hb(&sb, 0, SlotState::Live, 4));
        let mut g = lock(&sb, 0);
        g.mode = LockMode::Exclusive;
        g.owner = 0;
        g.owner_gen = 4;
        put_lock(&dev, &sb, 0, &g.encode(512));
        let r = check_volume(&dev).unwrap();
        assert!(r.is_clean(), "{:?}", r.findings);
        assert!(has(
            &r,
            Severity::Warning,
            &["slot 0 is Live", "stopped without unmounting"]
        ));
        assert_eq!(lock_findings(&r).len(), 1, "{:?}", lock_findings(&r));
    }

    #[test]
    fn damaged_heartbeats_are_errors() {
        let (dev, sb) = fresh(64 << 20, 512);
        // Absurd timing with a valid checksum (issue 8: every mount waited forever).
        let mut h = hb(&sb, 1, SlotState::Live, 2);
        h.io_timeout_ms = u32::MAX;
        put_hb(&dev, &sb, &h);
        // A valid Live record beyond max_nodes (2), and another volume's record.
        put_hb(&dev, &sb, &hb(&sb, 5, SlotState::Live, 1));
        let mut other = hb(&sb, 6, SlotState::Free, 1);
        other.uuid[0] ^= 1;
        put_hb(&dev, &sb, &other);
        let r = check_volume(&dev).unwrap();
        assert!(!r.is_clean());
        assert!(
            has(&r, Severity::Error, &["slot 1 is damaged", "io timeout"]),
            "{:?}",
            lock_findings(&r)
        );
        assert!(has(&r, Severity::Error, &["slot 5 is Live", "max nodes"]));
        assert!(has(
            &r,
            Severity::Error,
            &["slot 6 is damaged", "another volume"]
        ));
    }

    #[test]
    fn stale_inconsistent_and_corrupted_lock_records_are_reported() {
        let (dev, sb) = fresh(64 << 20, 512);
        let layout = LockLayout::new(&sb);
        put_hb(&dev, &sb, &hb(&sb, 0, SlotState::Free, 3));
        // Record 0 held exclusively by slot 1, which was never used.
        let mut g = lock(&sb, 0);
        g.mode = LockMode::Exclusive;
        g.owner = 1;
        g.owner_gen = 1;
        put_lock(&dev, &sb, 0, &g.encode(512));
        // Group 0 owned by the free slot 0's generation, a waiter that left; group 1 shared
        // without holders; group 2 waited on by slot 40 (beyond max nodes).
        let mut grp = lock(&sb, 1);
        grp.mode = LockMode::Exclusive;
        grp.owner = 0;
        grp.owner_gen = 3;
        grp.waiters.insert(1);
        put_lock(&dev, &sb, 1, &grp.encode(512));
        let mut sh = lock(&sb, 2);
        sh.mode = LockMode::Shared;
        put_lock(&dev, &sb, 2, &sh.encode(512));
        let mut far = lock(&sb, 3);
        far.mode = LockMode::Exclusive;
        far.owner = 40;
        far.owner_gen = 1;
        put_lock(&dev, &sb, 3, &far.encode(512));
        // A bucket with a stale entry and one in the wrong bucket; another bucket corrupted.
        let ino = sb.root_ino;
        let bi = layout.bucket_of(ino);
        let mut b = lock(&sb, bi);
        b.entries.push(OpenEntry {
            ino,
            slot: 1,
            writer: true,
            slot_gen: 9,
        });
        #[expect(
            clippy::maybe_infinite_iter,
            reason = "the hash spreads consecutive numbers over every bucket: found within a few bucket counts"
        )]
        let wrong = (1..).find(|i| layout.bucket_of(ino + i) != bi).unwrap() + ino;
        b.entries.push(OpenEntry {
            ino: wrong,
            slot: 0,
            writer: false,
            slot_gen: 3,
        });
        put_lock(&dev, &sb, bi, &b.encode(512));
        let corrupt = if bi == layout.bucket_base {
            bi + 1
        } else {
            layout.bucket_base
        };
        let mut c = lock(&sb, corrupt).encode(512);
        c[80] ^= 0x40;
        put_lock(&dev, &sb, corrupt, &c);
        let r = check_volume(&dev).unwrap();
        let f = lock_findings(&r);
        assert!(!r.is_clean());
        assert!(
            has(
                &r,
                Severity::Error,
                &["lock record 0", "stale owner slot 1 (generation 1)"]
            ),
            "{f:?}"
        );
        assert!(
            has(
                &r,
                Severity::Error,
                &["lock record 1", "stale owner slot 0 (generation 3)"]
            ),
            "{f:?}"
        );
        assert!(
            has(
                &r,
                Severity::Warning,
                &["lock record 1", "stale waiter slot 1"]
            ),
            "{f:?}"
        );
        assert!(
            has(
                &r,
                Severity::Error,
                &["lock record 2", "shared without holders"]
            ),
            "{f:?}"
        );
        assert!(
            has(&r, Severity::Error, &["lock record 3", "beyond max nodes"]),
            "{f:?}"
        );
        assert!(
            has(
                &r,
                Severity::Warning,
                &[&format!(
                    "stale open entry slot 1 (generation 9) for inode {ino}"
                )]
            ),
            "{f:?}"
        );
        assert!(
            has(
                &r,
                Severity::Error,
                &[&format!("open entry for inode {wrong} belongs in")]
            ),
            "{f:?}"
        );
        assert!(
            has(
                &r,
                Severity::Error,
                &[&format!("lock record {corrupt}: checksum")]
            ),
            "{f:?}"
        );
        // Record 0 itself corrupted.
        put_lock(&dev, &sb, 0, &[0x5a; 512]);
        let r = check_volume(&dev).unwrap();
        assert!(
            has(&r, Severity::Error, &["lock record 0: bad magic"]),
            "{:?}",
            lock_findings(&r)
        );
        // A group record where a bucket should be.
        put_lock(
            &dev,
            &sb,
            bi,
            &LockRecord::free(LockKind::Group, bi, 7).encode(512),
        );
        let r = check_volume(&dev).unwrap();
        assert!(has(
            &r,
            Severity::Error,
            &[&format!("lock record {bi}: is a Group record")]
        ));
    }

    #[test]
    fn a_primary_superblock_with_impossible_geometry_gives_way_to_the_backup() {
        let (dev, sb) = fresh(64 << 20, 512);
        let mut bad = sb.clone();
        bad.total_blocks *= 100;
        bad.backup_block = bad.total_blocks - 1;
        dev.write_at(0, &bad.encode()).unwrap();
        let r = check_volume(&dev).unwrap();
        assert_eq!(r.superblock.as_ref(), Some(&sb));
        let p = r
            .findings
            .iter()
            .find(|f| f.kind == FindingKind::PrimarySuperblock)
            .unwrap();
        assert!(p.message.contains("device has only"), "{}", p.message);
        assert!(!r.is_clean());
    }

    /// Format v3: a clean volume has clean buckets and mailboxes at both logical block sizes
    /// (and a v2 volume has none to check).
    #[test]
    fn a_fresh_v3_volume_has_clean_object_locks() {
        for lbs in [512, 4096] {
            let (dev, sb) = fresh(64 << 20, lbs);
            assert!(sb.object_lock_area().is_some());
            assert_clean(&check_volume(&dev).unwrap());
        }
        let dev = MemDevice::new(64 << 20, 512);
        let opts = MkfsOptions {
            max_nodes: 2,
            journal_bytes: 1 << 20,
            inode_lock_slots: 64,
            object_locks: false,
            ..Default::default()
        };
        format(&dev, &opts, &mut |_, _| {}).unwrap();
        assert_clean(&check_volume(&dev).unwrap());
    }

    fn put_record(dev: &MemDevice, offset: u64, index: u64, raw: &[u8]) {
        dev.write_at(offset + index * raw.len() as u64, raw)
            .unwrap();
    }

    fn obj_findings(r: &Report) -> Vec<(FindingKind, Severity, String)> {
        r.findings
            .iter()
            .filter(|f| matches!(f.kind, FindingKind::ObjectLock | FindingKind::Mailbox))
            .map(|f| (f.kind, f.severity, f.message.clone()))
            .collect()
    }

    #[test]
    fn damaged_buckets_and_mailboxes_are_errors() {
        let (dev, sb) = fresh(64 << 20, 512);
        let area = sb.object_lock_area().unwrap();
        // A flipped bit in bucket 3, bucket 5 written as bucket 6, a garbage mailbox 1.
        let mut raw = vec![0u8; 512];
        dev.read_at(area.bucket_offset + 3 * 512, &mut raw).unwrap();
        raw[100] ^= 0x10;
        put_record(&dev, area.bucket_offset, 3, &raw);
        put_record(
            &dev,
            area.bucket_offset,
            5,
            &Bucket::empty(6).encode(512).unwrap(),
        );
        put_record(&dev, area.mailbox_offset, 1, &[0xa5; 512]);
        let r = check_volume(&dev).unwrap();
        assert!(!r.is_clean());
        let f = obj_findings(&r);
        assert_eq!(f.len(), 3, "{f:?}");
        let has = |k: FindingKind, words: &[&str]| {
            f.iter().any(|(fk, sev, m)| {
                *fk == k && *sev == Severity::Error && words.iter().all(|w| m.contains(w))
            })
        };
        assert!(
            has(
                FindingKind::ObjectLock,
                &["bucket 3 is damaged", "checksum"]
            ),
            "{f:?}"
        );
        assert!(has(FindingKind::ObjectLock, &["bucket 5", "6"]), "{f:?}");
        assert!(
            has(FindingKind::Mailbox, &["mailbox of slot 1 is damaged"]),
            "{f:?}"
        );
    }

    #[test]
    fn stale_and_misplaced_object_lock_entries_are_reported() {
        use crate::cluster::object_lock::{ObjectId, ObjectLockArea};
        use crate::format::mailbox::{Request, Want};
        use crate::format::object_lock::{Entry, Mention};
        use FindingKind::{Mailbox as Mb, ObjectLock as Ol};
        let (dev, sb) = fresh(64 << 20, 512);
        let area: ObjectLockArea = sb.object_lock_area().unwrap();
        put_hb(&dev, &sb, &hb(&sb, 0, SlotState::Live, 4));
        let mention = |slot, role, gen| Mention { slot, role, gen };
        let bucket_with = |obj: ObjectId, mentions: Vec<Mention>, next: u16| {
            let i = area.bucket_of(obj);
            let mut b = Bucket::empty(i);
            let mut e = Entry::new(obj.raw(), 7);
            e.mentions = mentions;
            e.next = next;
            b.entries.push(e);
            (i, b)
        };
        // Inode 100: owned by live slot 0 at its generation (fine) and waited for by slot 1,
        // never used (stale waiter: a warning).
        let (i1, b1) = bucket_with(
            ObjectId::inode(100).unwrap(),
            vec![
                mention(0, Role::Owner, 4),
                mention(1, Role::WaitExclusive, 2),
            ],
            NO_NEXT,
        );
        // Group 3: shared by slot 0 at an old generation (stale holder: an error), next = 1.
        let (i2, b2) = bucket_with(
            ObjectId::group(3).unwrap(),
            vec![mention(0, Role::Holder, 3)],
            1,
        );
        assert_ne!(i1, i2, "pick objects in different buckets");
        put_record(&dev, area.bucket_offset, i1, &b1.encode(512).unwrap());
        put_record(&dev, area.bucket_offset, i2, &b2.encode(512).unwrap());
        // Inode 200's entry in a bucket it does not hash to, naming slot 9 (beyond max nodes).
        let obj = ObjectId::inode(200).unwrap();
        let wrong = (area.bucket_of(obj) + 1) % area.buckets;
        assert!(wrong != i1 && wrong != i2);
        let mut b3 = Bucket::empty(wrong);
        let mut e = Entry::new(obj.raw(), 1);
        e.mentions = vec![mention(9, Role::Holder, 1)];
        b3.entries.push(e);
        put_record(&dev, area.bucket_offset, wrong, &b3.encode(512).unwrap());
        // Slot 0's mailbox: a request of its own live generation (fine) and one of slot 1
        // (never used: a warning).
        let mut mb = Mailbox::empty(0);
        for (slot, gen) in [(0, 4), (1, 5)] {
            mb.requests.push(Request {
                object: ObjectId::inode(100).unwrap().raw(),
                slot,
                gen,
                want: Want::Exclusive,
            });
        }
        put_record(&dev, area.mailbox_offset, 0, &mb.encode(512).unwrap());

        let r = check_volume(&dev).unwrap();
        let f = obj_findings(&r);
        let has = |k: FindingKind, sev: Severity, words: &[&str]| {
            f.iter()
                .any(|(fk, s, m)| *fk == k && *s == sev && words.iter().all(|w| m.contains(w)))
        };
        assert!(
            has(
                Ol,
                Severity::Warning,
                &["object 0x64", "stale waiter (exclusive) slot 1"]
            ),
            "{f:?}"
        );
        assert!(
            has(Ol, Severity::Error, &["stale holder slot 0 (generation 3)"]),
            "{f:?}"
        );
        assert!(has(Ol, Severity::Warning, &["stale next slot 1"]), "{f:?}");
        assert!(
            has(
                Ol,
                Severity::Error,
                &[
                    "object 0xc8",
                    &format!("belongs in bucket {}", area.bucket_of(obj))
                ]
            ),
            "{f:?}"
        );
        assert!(
            has(Ol, Severity::Error, &["names slots [9], beyond max nodes"]),
            "{f:?}"
        );
        assert!(
            has(
                Mb,
                Severity::Warning,
                &[
                    "mailbox of slot 0",
                    "request of slot 1 (generation 5)",
                    "stale"
                ]
            ),
            "{f:?}"
        );
        // Exactly those: nothing about the live owner or the live request.
        assert_eq!(f.len(), 6, "{f:?}");
        assert!(!r.is_clean());

        // Only the warnings left (the holder and the misplaced entry gone): clean.
        put_record(
            &dev,
            area.bucket_offset,
            i2,
            &Bucket::empty(i2).encode(512).unwrap(),
        );
        put_record(
            &dev,
            area.bucket_offset,
            wrong,
            &Bucket::empty(wrong).encode(512).unwrap(),
        );
        let r = check_volume(&dev).unwrap();
        assert!(r.is_clean(), "{:?}", obj_findings(&r));
        assert_eq!(obj_findings(&r).len(), 2, "{:?}", obj_findings(&r));
    }
}
