//! Bodies of the fuzz targets, their seed inputs, and a stable-toolchain driver.
//!
//! Every decoder must return an error rather than panic on any bytes, and whatever it accepts
//! must survive encode → decode unchanged. Checksums would stop almost every random input at
//! the first check, so block decoders are fed twice: the raw bytes, and the bytes resealed with
//! a valid header and crc of the expected type, which lets mutations reach the field checks.

pub mod stable;

use cetrafs_core::format::block::{BlockHeader, BlockType};
use cetrafs_core::format::FS_BLOCK_SIZE;

fn u64_at(data: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(b) = data.get(off..off + 8) {
        a.copy_from_slice(b);
    }
    u64::from_le_bytes(a)
}

/// `data` as a 4 KiB block sealed as `btype`, keeping the address, seq and owner it carries.
/// Returns (block, address).
fn resealed(data: &[u8], btype: BlockType) -> (Vec<u8>, u64) {
    let mut b = data.to_vec();
    b.resize(FS_BLOCK_SIZE, 0);
    let at = u64_at(&b, 8);
    BlockHeader {
        btype,
        blockno: at,
        seq: u64_at(&b, 16),
        owner: u64_at(&b, 32),
    }
    .seal(&mut b);
    (b, at)
}

pub mod targets {
    use super::*;
    use cetrafs_core::check;
    use cetrafs_core::dev::mem::MemDevice;
    use cetrafs_core::format::overflow::Overflow;
    use cetrafs_core::format::superblock::Superblock;
    use cetrafs_core::format::tree_node::TreeNode;
    use cetrafs_core::format::{dirent, extent::Extent, group, inode::Inode, xattr};
    use cetrafs_core::probe::{probe_sample, Sample, TAIL_BYTES};

    pub fn superblock(data: &[u8]) {
        for buf in [data.to_vec(), reseal_superblock(data)] {
            if let Ok(sb) = Superblock::decode(&buf) {
                let _ = sb.check_features();
                let _ = sb.group_of(u64_at(data, 0));
                let back = Superblock::decode(&sb.encode())
                    .expect("an accepted superblock re-encodes validly");
                // Labels with invalid UTF-8 are decoded lossily; everything else is exact.
                assert_eq!(
                    Superblock {
                        label: sb.label.clone(),
                        ..back
                    },
                    sb
                );
            }
        }
    }

    /// The superblock has its own crc (of everything before it) in its last 4 bytes.
    fn reseal_superblock(data: &[u8]) -> Vec<u8> {
        let mut b = data.to_vec();
        b.resize(FS_BLOCK_SIZE, 0);
        b[..8].copy_from_slice(b"CETRAFS\0");
        let crc = crc32c::crc32c(&b[..FS_BLOCK_SIZE - 4]);
        b[FS_BLOCK_SIZE - 4..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn block_header(data: &[u8]) {
        if let Ok(h) = BlockHeader::decode(data) {
            assert_eq!(
                BlockHeader::check(data, h.btype, h.blockno)
                    .expect("decoded header checks at its own address"),
                h
            );
        }
        let (b, at) = resealed(data, BlockType::Inode);
        let h =
            BlockHeader::check(&b, BlockType::Inode, at).expect("a freshly sealed header decodes");
        assert_eq!((h.btype, h.blockno), (BlockType::Inode, at));
    }

    pub fn group_header(data: &[u8]) {
        let (b, at) = resealed(data, BlockType::GroupHeader);
        for (buf, at) in [(data, u64_at(data, 8)), (&b[..], at)] {
            if let Ok(g) = group::GroupHeader::decode(buf, at) {
                assert_eq!(
                    group::GroupHeader::decode(&g.encode(), at)
                        .expect("re-encoded group header decodes"),
                    g
                );
            }
        }
    }

    pub fn bitmap(data: &[u8]) {
        let (b, at) = resealed(data, BlockType::Bitmap);
        for (buf, at) in [(data, u64_at(data, 8)), (&b[..], at)] {
            if let Ok((seq, bits)) = group::decode_bitmap(buf, at) {
                let again = group::encode_bitmap(at, seq, bits);
                assert_eq!(
                    group::decode_bitmap(&again, at).expect("re-encoded bitmap decodes"),
                    (seq, bits)
                );
            }
        }
    }

    pub fn inode(data: &[u8]) {
        let (b, at) = resealed(data, BlockType::Inode);
        for (buf, at) in [(data, u64_at(data, 8)), (&b[..], at)] {
            if let Ok(i) = Inode::decode(buf, at) {
                let _ = (i.is_dir(), i.is_reg(), i.is_symlink(), i.file_type());
                assert_eq!(
                    Inode::decode(&i.encode(), at).expect("re-encoded inode decodes"),
                    i
                );
            }
        }
    }

    /// Input: 8-byte key (file block), then the value.
    pub fn extent_value(data: &[u8]) {
        let key = u64_at(data, 0);
        let v = data.get(8..).unwrap_or(&[]);
        if let Ok(e) = Extent::decode_value(key, v) {
            assert_eq!(&e.encode_value()[..], v);
            assert!(e.end() > e.logical);
        }
    }

    pub fn tree_node(data: &[u8]) {
        let (b, at) = resealed(data, BlockType::TreeNode);
        for (buf, at) in [(data, u64_at(data, 8)), (&b[..], at)] {
            if let Ok(n) = TreeNode::decode(buf, at) {
                assert_eq!(
                    TreeNode::decode(&n.encode(), at).expect("re-encoded tree node decodes"),
                    n
                );
            }
        }
    }

    pub fn dirent(data: &[u8]) {
        if let Ok(es) = dirent::decode_entries(data) {
            assert_eq!(
                dirent::encode_entries(&es),
                data,
                "entry records have one encoding"
            );
            for e in &es {
                assert!(dirent::name_hash(&e.name) >= dirent::FIRST_HASH_KEY);
            }
        }
    }

    /// Input: the head block, then (v2) one 4 KiB chunk per overflow block it lists; each
    /// chunk is resealed as an Overflow block at the address the head gives it, so mutations
    /// reach the set's assembly. Whatever assembles re-encodes to the same set.
    pub fn xattr(data: &[u8]) {
        use xattr::{Head, Layout};
        let (b, at) = resealed(&data[..data.len().min(FS_BLOCK_SIZE)], BlockType::Xattr);
        for layout in [Layout::V1, Layout::V2] {
            for (buf, at) in [(data, u64_at(data, 8)), (&b[..], at)] {
                let Ok(h) = Head::decode(buf, at, layout) else {
                    continue;
                };
                let mut parts = Vec::new();
                for (i, &m) in h.more.iter().enumerate() {
                    let chunk = data.get((i + 1) * FS_BLOCK_SIZE..).unwrap_or(&[]);
                    let mut c = chunk[..chunk.len().min(FS_BLOCK_SIZE)].to_vec();
                    c.resize(FS_BLOCK_SIZE, 0);
                    BlockHeader {
                        btype: BlockType::Overflow,
                        blockno: m,
                        seq: u64_at(&c, 16),
                        owner: h.owner,
                    }
                    .seal(&mut c);
                    if let Ok(o) = Overflow::decode(&c, m) {
                        parts.push(o);
                    }
                }
                let Ok(map) = h.assemble(&parts, layout) else {
                    continue;
                };
                let more: Vec<(u64, u64)> = parts.iter().map(|p| (p.blockno, p.seq)).collect();
                let blocks = xattr::encode_set(&map, layout, (at, h.seq), &more, h.owner);
                let h2 = Head::decode(&blocks[0].1, at, layout).expect("re-encoded head decodes");
                let parts2: Vec<Overflow> = blocks[1..]
                    .iter()
                    .map(|(m, raw)| {
                        Overflow::decode(raw, *m).expect("re-encoded overflow block decodes")
                    })
                    .collect();
                assert_eq!(
                    h2.assemble(&parts2, layout)
                        .expect("re-encoded set assembles"),
                    map
                );
            }
        }
    }

    pub fn overflow(data: &[u8]) {
        let (b, at) = resealed(data, BlockType::Overflow);
        for (buf, at) in [(data, u64_at(data, 8)), (&b[..], at)] {
            if let Ok(o) = Overflow::decode(buf, at) {
                o.expect(o.role, o.index, o.payload.len())
                    .expect("a block meets its own description");
                assert_eq!(
                    Overflow::decode(&o.encode(), at).expect("re-encoded overflow block decodes"),
                    o
                );
            }
        }
    }

    pub fn journal_record(data: &[u8]) {
        use cetrafs_core::format::journal::{Commit, Descriptor};
        let (b, at) = resealed(data, BlockType::JournalRecord);
        for (buf, at) in [(data, u64_at(data, 8)), (&b[..], at)] {
            if let Ok(d) = Descriptor::decode(buf, at) {
                assert_eq!(
                    Descriptor::decode(&d.encode(at), at).expect("re-encoded descriptor decodes"),
                    d
                );
            }
            if let Ok(c) = Commit::decode(buf, at) {
                assert_eq!(
                    Commit::decode(&c.encode(at), at).expect("re-encoded commit decodes"),
                    c
                );
            }
        }
    }

    pub fn heartbeat(data: &[u8]) {
        use cetrafs_core::format::heartbeat::Heartbeat;
        for lbs in [512usize, 4096] {
            // Raw, and with a valid crc so mutations reach the field checks.
            let mut b = data.to_vec();
            b.resize(lbs, 0);
            let crc = crc32c::crc32c(&b[..lbs - 4]);
            let mut sealed = b.clone();
            sealed[lbs - 4..].copy_from_slice(&crc.to_le_bytes());
            for buf in [&b[..], &sealed[..]] {
                if let Ok(Some(h)) = Heartbeat::decode(buf) {
                    assert_eq!(
                        Heartbeat::decode(&h.encode(lbs)).expect("re-encoded heartbeat decodes"),
                        Some(h)
                    );
                }
            }
        }
    }

    pub fn slot_header(data: &[u8]) {
        use cetrafs_core::format::slot_header::SlotHeader;
        let (b, at) = resealed(data, BlockType::JournalHeader);
        let slot = u32::try_from(u64_at(data, 40) & 0xffff_ffff).unwrap_or(0);
        for (buf, at) in [(data, u64_at(data, 8)), (&b[..], at)] {
            if let Ok(h) = SlotHeader::decode(buf, at, slot) {
                if h.seq != 0 || !h.orphans.is_empty() {
                    assert_eq!(
                        SlotHeader::decode(&h.encode(at), at, slot)
                            .expect("re-encoded slot header decodes"),
                        h
                    );
                }
            }
        }
    }

    /// Fed as a 512- and a 4096-byte block, raw and resealed with magic, version and a
    /// valid crc (so mutations reach the entry checks); the bucket index is taken from the
    /// block. Whatever decodes re-encodes to the same bytes.
    pub fn object_lock(data: &[u8]) {
        use cetrafs_core::format::object_lock::{Bucket, BUCKET_MAGIC};
        for (raw, sealed) in one_block_variants(data, &BUCKET_MAGIC) {
            for buf in [&raw[..], &sealed[..]] {
                if let Ok(b) = Bucket::decode(buf, u64_at(buf, 16)) {
                    if buf.iter().any(|&x| x != 0) {
                        assert_eq!(b.encode(buf.len()).expect("a decoded bucket encodes"), buf);
                    }
                }
            }
        }
    }

    /// Like `object_lock`, for the lock-request mailbox.
    pub fn mailbox(data: &[u8]) {
        use cetrafs_core::format::mailbox::{Mailbox, MAILBOX_MAGIC};
        for (raw, sealed) in one_block_variants(data, &MAILBOX_MAGIC) {
            for buf in [&raw[..], &sealed[..]] {
                let slot = (u64_at(buf, 16) & 0xffff_ffff) as u32;
                if let Ok(m) = Mailbox::decode(buf, slot) {
                    if buf.iter().any(|&x| x != 0) {
                        assert_eq!(m.encode(buf.len()).expect("a decoded mailbox encodes"), buf);
                    }
                }
            }
        }
    }

    /// `data` padded or cut to 512 and 4096 bytes: (as is, with `magic`, version 1 and the
    /// crc of a one-logical-block cluster record in its last 4 bytes).
    fn one_block_variants(data: &[u8], magic: &[u8; 8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        [512usize, 4096]
            .iter()
            .map(|&lbs| {
                let mut b = data.to_vec();
                b.resize(lbs, 0);
                let mut s = b.clone();
                s[..8].copy_from_slice(magic);
                s[8..10].copy_from_slice(&1u16.to_le_bytes());
                let crc = crc32c::crc32c(&s[..lbs - 4]);
                s[lbs - 4..].copy_from_slice(&crc.to_le_bytes());
                (b, s)
            })
            .collect()
    }

    pub fn probe(data: &[u8]) {
        let tail = data.len().checked_sub(TAIL_BYTES).map(|o| &data[o..]);
        let backup = data.len().checked_sub(FS_BLOCK_SIZE).map(|o| &data[o..]);
        let _ = probe_sample(&Sample {
            head: data,
            backup_block: backup,
            tail,
            size: data.len() as u64,
        });
    }

    /// Input: patches applied to a populated synthetic volume, then a full check. Each patch
    /// is `selector u8 | offset u16 | len u8 | bytes`: the selector picks one of the
    /// metadata blocks (superblocks, group headers and bitmaps, everything the sample
    /// allocated); its top bit asks to reseal the block's crc after XORing the bytes in, so
    /// the damage gets past the checksums into the structural checks.
    pub fn check_volume(data: &[u8]) {
        let base = crate::seeds::base_image();
        let mut img = base.image.clone();
        let mut o = 0;
        let mut patched = false;
        while o + 4 <= data.len() {
            let sel = data[o];
            let off = usize::from(u16::from_le_bytes([data[o + 1], data[o + 2]])) % FS_BLOCK_SIZE;
            let len = usize::from(data[o + 3]);
            let bytes = &data[(o + 4).min(data.len())..(o + 4 + len).min(data.len())];
            o += 4 + len;
            let block = base.blocks[usize::from(sel & 0x7f) % base.blocks.len()];
            let start = usize::try_from(block).unwrap_or(usize::MAX) * FS_BLOCK_SIZE;
            let Some(blk) = img.get_mut(start..start + FS_BLOCK_SIZE) else {
                continue;
            };
            for (i, x) in bytes.iter().enumerate() {
                blk[(off + i) % FS_BLOCK_SIZE] ^= x;
                patched |= *x != 0;
            }
            if sel & 0x80 != 0 {
                if block == 0 || block == base.backup_block {
                    let crc = crc32c::crc32c(&blk[..FS_BLOCK_SIZE - 4]);
                    blk[FS_BLOCK_SIZE - 4..].copy_from_slice(&crc.to_le_bytes());
                } else {
                    let crc = cetrafs_core::format::codec::crc_with_hole(blk, 24);
                    blk[24..28].copy_from_slice(&crc.to_le_bytes());
                }
            }
        }
        let dev = MemDevice::from_image(img, 512);
        match check::check_volume(&dev) {
            Ok(r) => {
                if !patched {
                    assert!(
                        r.findings.is_empty(),
                        "the untouched sample must check clean: {:?}",
                        r.findings
                    );
                }
                for f in &r.findings {
                    let _ = f.to_string();
                }
            }
            Err(e) => assert!(patched, "the untouched sample must be checkable: {e}"),
        }
    }
}

/// Valid encodings to start mutating from, and the base image of `check_volume`.
pub mod seeds {
    use super::*;
    use cetrafs_core::check::synth::SynthVolume;
    use cetrafs_core::format::dirent::{encode_entries, DirEntry};
    use cetrafs_core::format::extent::Extent;
    use cetrafs_core::format::group::{decode_bitmap, encode_bitmap, GroupHeader};
    use cetrafs_core::format::inode::{flags, Inode};
    use cetrafs_core::format::tree_node::{NodeEntries, TreeNode};
    use cetrafs_core::format::xattr;
    use cetrafs_core::mkfs::{plan, MkfsOptions};
    use std::sync::OnceLock;

    pub struct BaseImage {
        pub image: Vec<u8>,
        /// Blocks worth mutating: superblocks, group metadata, and what the sample allocated.
        pub blocks: Vec<u64>,
        pub backup_block: u64,
    }

    pub fn base_image() -> &'static BaseImage {
        static IMG: OnceLock<BaseImage> = OnceLock::new();
        IMG.get_or_init(|| {
            let dev = SynthVolume::sample().expect("the synthetic sample volume builds");
            let r = cetrafs_core::check::check_volume(&dev).expect("the sample checks");
            let sb = r.superblock.expect("the sample has a superblock");
            let mut blocks = vec![0, sb.backup_block];
            for g in 0..sb.group_count {
                let first = sb.group_first_block(g);
                blocks.extend(first..=first + u64::from(sb.bitmap_blocks));
            }
            // The sample allocates sequentially after the root inode: take every block up to
            // the first one group 0's bitmap shows free.
            let image = dev.snapshot();
            let bm = sb.group_first_block(0) + 1;
            let raw = &image[bm as usize * FS_BLOCK_SIZE..][..FS_BLOCK_SIZE];
            let (_, bits) = decode_bitmap(raw, bm).expect("sample bitmap decodes");
            let used = |b: u64| {
                let rel = b - sb.group_first_block(0);
                bits.get(rel as usize / 8)
                    .is_some_and(|x| x & (1 << (rel % 8)) != 0)
            };
            blocks.extend((sb.root_ino..).take_while(|&b| used(b)));
            BaseImage {
                image,
                blocks,
                backup_block: sb.backup_block,
            }
        })
    }

    pub fn superblock() -> Vec<Vec<u8>> {
        let opts = MkfsOptions {
            label: "seed".into(),
            ..Default::default()
        };
        vec![
            plan(8 << 30, 512, &opts).expect("plan for 8 GiB").encode(),
            plan(100 << 30, 4096, &opts)
                .expect("plan for 100 GiB")
                .encode(),
        ]
    }

    fn sample_inode() -> Inode {
        Inode {
            ino: 4242,
            seq: 3,
            mode: 0o100644,
            nlink: 2,
            flags: flags::INLINE_EXTENTS,
            size: 40960,
            blocks: 11,
            inline_extents: vec![
                Extent {
                    logical: 0,
                    physical: 5000,
                    len: 4,
                    flags: 0,
                },
                Extent {
                    logical: 6,
                    physical: 6000,
                    len: 4,
                    flags: 1,
                },
            ],
            ..Default::default()
        }
    }

    pub fn block_header() -> Vec<Vec<u8>> {
        vec![sample_inode().encode()]
    }

    pub fn group_header() -> Vec<Vec<u8>> {
        vec![GroupHeader {
            seq: 2,
            index: 3,
            first_block: 90000,
            block_count: 32768,
            free_blocks: 1000,
            bitmap_blocks: 2,
        }
        .encode()]
    }

    pub fn bitmap() -> Vec<Vec<u8>> {
        vec![encode_bitmap(777, 9, &[0xA5; 100])]
    }

    pub fn inode() -> Vec<Vec<u8>> {
        let mut link = Inode {
            ino: 99,
            mode: 0o120777,
            nlink: 1,
            size: 7,
            blocks: 1,
            inline_data: b"/target".to_vec(),
            ..Default::default()
        };
        let a = link.encode();
        let mut long = link.clone();
        long.size = 4095;
        long.blocks = 2;
        long.inline_data = vec![b'x'; 3840];
        long.overflow_block = 100;
        let l = long.encode();
        link.mode = 0o040755;
        link.inline_data.clear();
        link.tree_root = 100;
        vec![sample_inode().encode(), a, link.encode(), l]
    }

    pub fn extent_value() -> Vec<Vec<u8>> {
        let mut v = 12u64.to_le_bytes().to_vec();
        v.extend_from_slice(
            &Extent {
                logical: 12,
                physical: 777,
                len: 3,
                flags: 1,
            }
            .encode_value(),
        );
        vec![v]
    }

    pub fn tree_node() -> Vec<Vec<u8>> {
        let leaf = TreeNode {
            blockno: 500,
            seq: 1,
            owner: 400,
            level: 0,
            entries: NodeEntries::Leaf(
                (0..20u64)
                    .map(|k| (k * 7 + 3, vec![k as u8; (k % 5) as usize * 4]))
                    .collect(),
            ),
        };
        let internal = TreeNode {
            blockno: 501,
            seq: 1,
            owner: 400,
            level: 1,
            entries: NodeEntries::Internal(vec![(3, 500), (90, 502), (200, 503)]),
        };
        vec![leaf.encode(), internal.encode()]
    }

    pub fn dirent() -> Vec<Vec<u8>> {
        let es = [
            DirEntry {
                name: b"hello.txt".to_vec(),
                ino: 300,
                dtype: 8,
            },
            DirEntry {
                name: b"sub".to_vec(),
                ino: 301,
                dtype: 4,
            },
        ];
        vec![encode_entries(&es)]
    }

    /// A one-block set in each layout, and a v2 set of a head and two overflow blocks
    /// (concatenated, as the `xattr` target reads its input).
    pub fn xattr() -> Vec<Vec<u8>> {
        use xattr::Layout;
        let mut m = xattr::XattrMap::new();
        m.insert(b"user.a".to_vec(), b"1".to_vec());
        m.insert(b"security.selinux".to_vec(), vec![7; 40]);
        let one = |l| xattr::encode_set(&m, l, (321, 4), &[], 320).remove(0).1;
        let mut out = vec![one(Layout::V1), one(Layout::V2)];
        m.insert(b"user.big".to_vec(), vec![9; 9000]);
        let blocks = xattr::encode_set(&m, Layout::V2, (321, 4), &[(400, 2), (401, 2)], 320);
        out.push(blocks.into_iter().flat_map(|(_, b)| b).collect());
        out
    }

    pub fn overflow() -> Vec<Vec<u8>> {
        use cetrafs_core::format::overflow::{Overflow, Role};
        let o = |role, index, payload: Vec<u8>| {
            Overflow {
                blockno: 555,
                seq: 3,
                owner: 554,
                role,
                index,
                payload,
            }
            .encode()
        };
        vec![
            o(Role::SymlinkTarget, 1, vec![b'a'; 255]),
            o(Role::XattrSet, 2, vec![1; 4048]),
        ]
    }

    pub fn journal_record() -> Vec<Vec<u8>> {
        use cetrafs_core::format::journal::{Commit, Descriptor};
        let d = Descriptor {
            seq: 9,
            index: 0,
            count: 1,
            logged: 3,
            homes: vec![100, 101, 5000],
        };
        let c = Commit {
            seq: 9,
            descriptors: 1,
            logged: 3,
            crc: 0xdead_beef,
        };
        vec![d.encode(77), c.encode(81)]
    }

    pub fn heartbeat() -> Vec<Vec<u8>> {
        use cetrafs_core::format::heartbeat::{Heartbeat, SlotState};
        let h = Heartbeat {
            state: SlotState::Live,
            generation: 3,
            counter: 17,
            nonce: 0x1234,
            uuid: [9; 16],
            interval_ms: 2000,
            io_timeout_ms: 8000,
            slot: 2,
            host: "pve1".into(),
            pid: 4242,
            recoverer: u32::MAX,
            recoverer_gen: 0,
            machine: cetrafs_core::cluster::machine::MachineId([0x3d; 16]),
            watchdog_ms: 0,
        };
        vec![h.encode(512), h.encode(4096)]
    }

    pub fn slot_header() -> Vec<Vec<u8>> {
        use cetrafs_core::format::slot_header::SlotHeader;
        vec![SlotHeader {
            seq: 2,
            slot: 0,
            orphans: vec![1234, 99_999],
        }
        .encode(40)]
    }

    pub fn object_lock() -> Vec<Vec<u8>> {
        use cetrafs_core::format::object_lock::{Bucket, Entry, Mention, Role, NO_NEXT};
        let m = |slot, role, gen| Mention { slot, role, gen };
        let b = Bucket {
            index: 3,
            nonce: 0x55,
            floor: 17,
            entries: vec![
                Entry {
                    object: 42,
                    version: 20,
                    next: 2,
                    mentions: vec![m(1, Role::Owner, 4), m(2, Role::WaitShared, 7)],
                },
                Entry {
                    object: 1 << 62,
                    version: 5,
                    next: NO_NEXT,
                    mentions: vec![m(0, Role::Holder, 1)],
                },
                Entry::new(99, 18),
            ],
        };
        vec![
            b.encode(512).expect("seed fits"),
            b.encode(4096).expect("seed fits"),
        ]
    }

    pub fn mailbox() -> Vec<Vec<u8>> {
        use cetrafs_core::format::mailbox::{Mailbox, Request, Want};
        let r = |object, slot, gen, want| Request {
            object,
            slot,
            gen,
            want,
        };
        let m = Mailbox {
            slot: 2,
            nonce: 9,
            requests: vec![
                r(42, 1, 4, Want::Exclusive),
                r(42, 3, 8, Want::Shared),
                r(77, 0, 1, Want::Room),
            ],
        };
        vec![
            m.encode(512).expect("seed fits"),
            m.encode(4096).expect("seed fits"),
        ]
    }

    pub fn probe() -> Vec<Vec<u8>> {
        let mut ext = vec![0u8; 70 << 10];
        ext[1080] = 0x53;
        ext[1081] = 0xEF;
        ext[65600..65608].copy_from_slice(b"_BHRfS_M");
        ext[510] = 0x55;
        ext[511] = 0xAA;
        ext[512..520].copy_from_slice(b"EFI PART");
        vec![ext]
    }

    pub fn check_volume() -> Vec<Vec<u8>> {
        // No patch (must be clean), a resealed inode tweak and a raw group header flip.
        vec![
            Vec::new(),
            vec![0x80 | 20, 52, 0, 1, 1],
            vec![2, 64, 0, 1, 0x10],
        ]
    }
}
