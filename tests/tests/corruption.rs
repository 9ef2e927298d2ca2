//! Corruption campaign (issue 8): damage a populated volume one area at a time and hold the
//! whole stack to the rules a hostile disk must not break.
//!
//! A small volume is populated through a real mount (directories, one big enough for a
//! multi-node B+tree, small inline-extent files, a file with an extent tree, a sparse file,
//! symlinks, xattrs and an ACL, a hard link, a fifo; and the format-v2 structures: two symlinks
//! whose targets continue in an overflow block and two files whose xattr sets span a head and
//! several overflow blocks) and cleanly unmounted. That image is the
//! *pristine* copy. Decoding it with cetrafs-core gives the *model*: every path with its type and
//! expected content, and every block the volume uses with the inode that owns it (inode block,
//! xattr head and overflow blocks, tree nodes, data blocks) or the area it belongs to.
//!
//! Every case copies the pristine image, applies its own injection (a bit flip, a zeroed block or
//! logical-block record, or a field change re-encoded with a valid checksum through
//! cetrafs-core's encoders), keeps a copy of the injected image, and then:
//!
//! 1. `fsck.cetra -n` must finish (60 s) with exit 0, 4 or 8;
//! 2. the mount must come up within 30 s or refuse with an error message (cases whose damage the
//!    runtime can route around, such as a primary superblock with an intact backup, must mount);
//! 3. a walk of the mount must never serve a byte that is not the file's own (every 4 KiB chunk
//!    of file data carries its path and index, so a chunk from another file, the superblock or a
//!    metadata block is recognised; a symlink target or xattr value is the model's or an error,
//!    never another inode's or garbage), must never hide a directory entry (a readable directory
//!    lists every name of the model; an entry whose inode is damaged may stat EIO), and a
//!    refusal must be EIO;
//! 4. a few writes (overwrite, append, fill a hole, and a write at the damaged place of the
//!    damaged file, or a setxattr on a file whose xattr set is damaged) with fsync, then unmount; the LUN is compared with the injected copy block by
//!    block and every change must be one a mount legitimately makes (see [`check_writes`]);
//! 5. the daemon never panics and exits after unmount;
//! 6. whenever the runtime refused something (mount refused or hung, an error during the walk
//!    or the writes, a hidden entry, foreign bytes), fsck must not call the volume clean.
//!
//! Failures of all cases are collected and reported together, each naming the case, the area,
//! the injected change and what went wrong.
//!
//! Knobs: `CETRA_CORRUPT_ONLY=substr[,substr]` runs the cases whose name contains one of them;
//! `CETRA_CORRUPT_RANDOM=N` adds N random flips/zeroes of used blocks (seed from `CETRA_SEED`,
//! printed); `CETRA_CORRUPT_KEEP=1` keeps the scratch directory with the images of failed cases.

use cetrafs_core::format::block::BlockHeader;
use cetrafs_core::format::dirent::{decode_entries, encode_entries};
use cetrafs_core::format::extent::Extent;
use cetrafs_core::format::group::{decode_bitmap, encode_bitmap, GroupHeader};
use cetrafs_core::format::heartbeat::{Heartbeat, SlotState};
use cetrafs_core::format::inode::{flags as iflags, Inode};
use cetrafs_core::format::lock_record::{LockKind, LockMode, LockRecord, OpenEntry};
use cetrafs_core::format::mailbox::Mailbox;
use cetrafs_core::format::object_lock::{Bucket, Entry, Mention, Role as LockRole};
use cetrafs_core::format::slot_header::SlotHeader;
use cetrafs_core::format::superblock::Superblock;
use cetrafs_core::format::tree_node::{NodeEntries, TreeNode};
use cetrafs_core::format::xattr::{Head, Layout};
use cetrafs_core::format::{FS_BLOCK, FS_BLOCK_SIZE};
use cetrafs_tests::rand::rngs::StdRng;
use cetrafs_tests::rand::{Rng, SeedableRng};
use cetrafs_tests::{
    bin, errno_name, errno_of, get_xattr, list_xattrs, run_timeout, set_xattr, Exit, Lun, Mount,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const LUN_SIZE: u64 = 256 << 20;
/// Same host name for populating and for every case: the case mount claims the same slot (0).
const HOST: &str = "corrupt";
const MOUNT_BOUND: Duration = Duration::from_secs(30);
const FSCK_BOUND: Duration = Duration::from_mins(1);
/// Walk + writes + fsync of one case.
const OPS_BOUND: Duration = Duration::from_secs(30);
const LBS: u64 = 512;
/// Cases that repeat a cause another default case already covers: run with
/// `CETRA_CORRUPT_ALL=1` (they keep the default run to a few minutes).
const EXTENDED: &[&str] = &[
    "sb.primary.zero",
    "sb.both.zero",
    "sb.primary.hb_interval",
    "hb.rec0.zero",
    "hb.rec1.io_timeout_max",
    "lock.rec0.waiter_unused_slot",
    "lock.bucket.zero",
    "journal.slot0.block1.flip",
    "group0.header.index",
    "group0.bitmap.zero",
    "inode.fifo.flip",
    "inode.dir.zero",
    "inode.extent.bitmap",
    "inode.extent.backupsb",
    "inode.xattr.grouphdr",
    "inode.tree.probe",
    "inode.dirtree.journal",
    "tree.dir.leaf.zero",
    "tree.dir.child.grouphdr",
    "tree.extent.leaf.zero",
    "tree.extent.child.otherinode",
    "tree.extent.leaf.heartbeat",
    "tree.extent.leaf.lock",
    "tree.extent.leaf.journal",
    "tree.extent.leaf.bitmap",
    "tree.extent.leaf.otherinode",
    "tree.extent.leaf.backupsb",
    "dirent.ino.grouphdr",
    "dirent.ino.treenode",
    "xattr.zero",
    "overflow.symlink.zero",
    "overflow.xattr.flip",
    "overflow.symlink.owner",
    "overflow.symlink.index",
    "overflow.symlink.len",
    "overflow.symlink.role",
    "symlink.overflow.xattr_overflow",
    "symlink.overflow.short_target",
    "xattr.more.grouphdr",
    "xattr.more.symlink_overflow",
    "xattr.more.inode",
    "xattr.more.pastdev",
    "xattr.more.swapped",
    "xattr.head.more_minus",
    "xattr.head.used",
    "xattr.head.owner",
];
const BS: usize = FS_BLOCK_SIZE;

// ---------------------------------------------------------------------------------------------
// Raw image access

fn read_block(f: &File, b: u64) -> Vec<u8> {
    let mut v = vec![0u8; BS];
    f.read_exact_at(&mut v, b * FS_BLOCK)
        .expect("read image block");
    v
}

fn read_bytes(f: &File, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    f.read_exact_at(&mut v, off).expect("read image");
    v
}

/// Copy a sparse file keeping its holes (`SEEK_DATA` / `SEEK_HOLE`): the 256 MiB LUN holds a few MiB.
fn sparse_copy(from: &Path, to: &Path) {
    use std::os::fd::AsRawFd;
    let src = File::open(from).expect("open source image");
    let len = src.metadata().expect("stat image").len();
    let dst = File::create(to).expect("create image copy");
    dst.set_len(len).expect("size image copy");
    let fd = src.as_raw_fd();
    let mut pos: i64 = 0;
    let end = i64::try_from(len).expect("image size");
    let mut buf = vec![0u8; 1 << 20];
    while pos < end {
        // SAFETY: lseek on a descriptor we own; no pointers.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: no data after pos
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let hole = if hole < 0 { end } else { hole };
        let mut o = data;
        while o < hole {
            let n = usize::try_from((hole - o).min(1 << 20)).expect("chunk");
            let off = u64::try_from(o).expect("offset");
            src.read_exact_at(&mut buf[..n], off).expect("read image");
            dst.write_all_at(&buf[..n], off).expect("write image copy");
            o += i64::try_from(n).expect("chunk");
        }
        pos = hole;
    }
    dst.sync_all().expect("sync image copy");
}

/// Edit a metadata block's bytes and seal it again with its own header (valid crc).
fn reseal(block: &[u8], edit: impl FnOnce(&mut [u8])) -> Vec<u8> {
    let h = BlockHeader::decode(block).expect("pristine metadata block decodes");
    let mut b = block.to_vec();
    edit(&mut b);
    h.seal(&mut b);
    b
}

fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

// ---------------------------------------------------------------------------------------------
// Content: every 4 KiB chunk of file data names its file and chunk index

fn chunk_pattern(tag: &str, k: u64) -> Vec<u8> {
    let stamp = format!("[{tag}#{k}]");
    stamp.bytes().cycle().take(BS).collect()
}

/// Where a 4 KiB chunk seen through the mount came from, as far as its bytes tell.
fn describe_chunk(c: &[u8]) -> String {
    if c.iter().all(|&b| b == 0) {
        return "zeros".into();
    }
    if c.starts_with(b"CETRAFS\0") {
        return "the SUPERBLOCK".into();
    }
    if c.starts_with(b"CTRB") {
        if let Ok(h) = BlockHeader::decode(c) {
            return format!("metadata block {:?} of block {}", h.btype, h.blockno);
        }
        return "a (damaged) metadata block".into();
    }
    if c.starts_with(b"CTHB") {
        return "a HEARTBEAT record".into();
    }
    if c.starts_with(b"CETRALK\0") {
        return "a LOCK record".into();
    }
    if c.first() == Some(&b'[') {
        if let Some(end) = c.iter().position(|&b| b == b']') {
            let s = String::from_utf8_lossy(&c[1..end]);
            if let Some((tag, k)) = s.rsplit_once('#') {
                return format!("data of '{tag}' chunk {k}");
            }
        }
    }
    let head = c.iter().take(12).fold(String::new(), |mut h, b| {
        let _ = write!(h, "{b:02x}");
        h
    });
    format!("unknown bytes ({head}..)")
}

// ---------------------------------------------------------------------------------------------
// The model

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Dir,
    Reg,
    Symlink,
    Fifo,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Inode,
    Xattr,
    Tree {
        level: u16,
    },
    /// Format v2: part `index` (1-based) of a symlink target or of an xattr set.
    Overflow {
        index: u16,
    },
    Data {
        logical: u64,
    },
}

#[derive(Debug, Clone)]
struct Node {
    ino: u64,
    kind: Kind,
    paths: Vec<String>,
    /// Regular files: full expected content. Symlinks: the target.
    content: Vec<u8>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// Directories: name -> ino.
    children: BTreeMap<String, u64>,
    own: Vec<(u64, Role)>,
    inode: Inode,
}

#[derive(Debug)]
struct Model {
    sb: Superblock,
    nodes: BTreeMap<u64, Node>,
    by_path: BTreeMap<String, u64>,
    owner: HashMap<u64, (u64, Role)>,
}

impl Model {
    fn ino(&self, path: &str) -> u64 {
        *self
            .by_path
            .get(path)
            .unwrap_or_else(|| panic!("no {path} in the model"))
    }
    fn node(&self, path: &str) -> &Node {
        &self.nodes[&self.ino(path)]
    }
    fn own_of(&self, path: &str, pred: impl Fn(Role) -> bool) -> Vec<u64> {
        self.node(path)
            .own
            .iter()
            .filter(|(_, r)| pred(*r))
            .map(|(b, _)| *b)
            .collect()
    }
    fn data_block(&self, path: &str, logical: u64) -> u64 {
        self.node(path)
            .own
            .iter()
            .find(|(_, r)| *r == Role::Data { logical })
            .map_or_else(|| panic!("{path} has no data block {logical}"), |(b, _)| *b)
    }
    /// Human name of a block: its area, or the inode that owns it.
    fn describe_block(&self, b: u64) -> String {
        let sb = &self.sb;
        if let Some((ino, role)) = self.owner.get(&b) {
            let n = &self.nodes[ino];
            return format!("{role:?} block of '{}' (inode {ino})", n.paths[0]);
        }
        if b == 0 {
            return "primary superblock".into();
        }
        if b == sb.backup_block {
            return "backup superblock".into();
        }
        if b == sb.probe_block {
            return "probe block".into();
        }
        if b >= sb.hb_start && b < sb.hb_start + sb.hb_blocks {
            return format!("heartbeat area block {}", b - sb.hb_start);
        }
        if b >= sb.lock_start && b < sb.lock_start + sb.lock_blocks {
            return format!("lock area block {}", b - sb.lock_start);
        }
        if b >= sb.objlock_start && b < sb.objlock_start + sb.objlock_blocks() {
            return format!("object-lock area block {}", b - sb.objlock_start);
        }
        if b >= sb.mailbox_start && b < sb.mailbox_start + sb.mailbox_blocks() {
            return format!("mailbox area block {}", b - sb.mailbox_start);
        }
        let jend = sb.journal_start + sb.journal_blocks * u64::from(sb.max_nodes);
        if b >= sb.journal_start && b < jend {
            let o = b - sb.journal_start;
            return format!(
                "journal of slot {} block {}",
                o / sb.journal_blocks,
                o % sb.journal_blocks
            );
        }
        let gend = sb.group_start + sb.group_count * sb.group_blocks;
        if b >= sb.group_start && b < gend {
            let g = (b - sb.group_start) / sb.group_blocks;
            let o = (b - sb.group_start) % sb.group_blocks;
            return match o {
                0 => format!("group {g} header"),
                o if o <= u64::from(sb.bitmap_blocks) => format!("group {g} bitmap"),
                _ => format!("free block {b} of group {g}"),
            };
        }
        if b < sb.total_blocks {
            return format!("unused tail block {b}");
        }
        format!("block {b} past the volume")
    }
}

/// Walk the pristine image from the root with cetrafs-core's decoders.
fn decode_model(img: &Path, mounted: &Seen) -> Model {
    let f = File::open(img).expect("open pristine");
    let sb = Superblock::decode(&read_block(&f, 0)).expect("pristine superblock");
    let mut nodes: BTreeMap<u64, Node> = BTreeMap::new();
    let mut by_path = BTreeMap::new();
    let mut queue = vec![(String::new(), sb.root_ino)];
    while let Some((path, ino)) = queue.pop() {
        by_path.insert(path.clone(), ino);
        if let Some(n) = nodes.get_mut(&ino) {
            n.paths.push(path); // a hard link
            continue;
        }
        let inode = Inode::decode(&read_block(&f, ino), ino).expect("pristine inode");
        let kind = match inode.file_type() {
            x if x == libc::S_IFDIR => Kind::Dir,
            x if x == libc::S_IFREG => Kind::Reg,
            x if x == libc::S_IFLNK => Kind::Symlink,
            x if x == libc::S_IFIFO => Kind::Fifo,
            x => panic!("unexpected file type {x:o} in the model"),
        };
        let mut own = vec![(ino, Role::Inode)];
        if inode.xattr_block != 0 {
            let xb = inode.xattr_block;
            own.push((xb, Role::Xattr));
            let head = Head::decode(&read_block(&f, xb), xb, Layout::of(&sb))
                .expect("pristine xattr head");
            for (i, b) in head.more.iter().enumerate() {
                let index = u16::try_from(i + 1).expect("index");
                own.push((*b, Role::Overflow { index }));
            }
        }
        if inode.overflow_block != 0 {
            own.push((inode.overflow_block, Role::Overflow { index: 1 }));
        }
        let mut leaves: Vec<(u64, Vec<u8>)> = Vec::new();
        if inode.tree_root != 0 {
            let mut stack = vec![inode.tree_root];
            while let Some(b) = stack.pop() {
                let node = TreeNode::decode(&read_block(&f, b), b).expect("pristine tree node");
                assert_eq!(node.owner, ino, "tree node {b} owner");
                own.push((b, Role::Tree { level: node.level }));
                match node.entries {
                    NodeEntries::Leaf(v) => leaves.extend(v),
                    NodeEntries::Internal(v) => stack.extend(v.iter().map(|(_, c)| *c)),
                }
            }
        }
        let mut children = BTreeMap::new();
        match kind {
            Kind::Dir => {
                for (_, v) in &leaves {
                    for e in decode_entries(v).expect("pristine dirents") {
                        let name = String::from_utf8(e.name).expect("utf8 name");
                        let p = if path.is_empty() {
                            name.clone()
                        } else {
                            format!("{path}/{name}")
                        };
                        children.insert(name, e.ino);
                        queue.push((p, e.ino));
                    }
                }
            }
            Kind::Reg => {
                let exts: Vec<Extent> = if inode.flags & iflags::INLINE_EXTENTS != 0 {
                    inode.inline_extents.clone()
                } else {
                    leaves
                        .iter()
                        .map(|(k, v)| Extent::decode_value(*k, v).expect("pristine extent"))
                        .collect()
                };
                for e in exts {
                    for i in 0..u64::from(e.len) {
                        own.push((
                            e.physical + i,
                            Role::Data {
                                logical: e.logical + i,
                            },
                        ));
                    }
                }
            }
            Kind::Symlink | Kind::Fifo => {}
        }
        nodes.insert(
            ino,
            Node {
                ino,
                kind,
                paths: vec![path],
                content: Vec::new(),
                xattrs: Vec::new(),
                children,
                own,
                inode,
            },
        );
    }
    for n in nodes.values_mut() {
        n.paths.sort();
        let (k, content, xattrs) = mounted
            .get(&n.paths[0])
            .unwrap_or_else(|| panic!("{} decoded but not seen through the mount", n.paths[0]));
        assert_eq!(
            *k, n.kind,
            "{}: type through the mount vs on disk",
            n.paths[0]
        );
        n.content.clone_from(content);
        n.xattrs.clone_from(xattrs);
    }
    assert_eq!(
        by_path.len(),
        mounted.len(),
        "paths on disk vs through the mount"
    );
    let mut owner = HashMap::new();
    for n in nodes.values() {
        for (b, r) in &n.own {
            assert!(
                owner.insert(*b, (n.ino, *r)).is_none(),
                "block {b} owned twice"
            );
        }
    }
    Model {
        sb,
        nodes,
        by_path,
        owner,
    }
}

// ---------------------------------------------------------------------------------------------
// Populating the volume

fn wr(p: &Path, data: &[u8]) {
    fs::write(p, data).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
}

fn write_chunks(p: &Path, chunks: &[u64], tag: &str, size: u64) -> Vec<u8> {
    let f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(p)
        .expect("create");
    let mut content = vec![0u8; usize::try_from(size).expect("size")];
    for &k in chunks {
        let c = chunk_pattern(tag, k);
        f.write_all_at(&c, k * FS_BLOCK).expect("write chunk");
        let o = usize::try_from(k * FS_BLOCK).expect("offset");
        let end = (o + BS).min(content.len());
        content[o..end].copy_from_slice(&c[..end - o]);
    }
    f.set_len(size).expect("set_len");
    f.sync_all().expect("fsync");
    content
}

/// A small file: its bytes are chunk 0's pattern cut to `len` (and chunk 1.. if longer).
fn small_content(tag: &str, len: usize) -> Vec<u8> {
    let mut v = Vec::new();
    let mut k = 0;
    while v.len() < len {
        v.extend(chunk_pattern(tag, k));
        k += 1;
    }
    v.truncate(len);
    v
}

fn acl_value() -> Vec<u8> {
    // POSIX ACL xattr (version 2): user::rw- user:1000:r-- group::r-- mask::r-- other::r--
    let mut v = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in [
        (1u16, 6u16, u32::MAX),
        (2, 4, 1000),
        (4, 4, u32::MAX),
        (0x10, 4, u32::MAX),
        (0x20, 4, u32::MAX),
    ] {
        v.extend(tag.to_le_bytes());
        v.extend(perm.to_le_bytes());
        v.extend(id.to_le_bytes());
    }
    v
}

type Seen = BTreeMap<String, (Kind, Vec<u8>, Vec<(Vec<u8>, Vec<u8>)>)>;

fn populate(m: &Mount) {
    let p = |r: &str| m.p(r);
    for d in ["d1", "d1/sub", "d1/sub/deep", "d2", "many"] {
        fs::create_dir(p(d)).expect("mkdir");
    }
    wr(&p("d1/small"), &small_content("d1/small", 1500));
    wr(&p("d1/small2"), &small_content("d1/small2", 6000));
    wr(
        &p("d1/sub/deep/leaf"),
        &small_content("d1/sub/deep/leaf", 300),
    );
    fs::hard_link(p("d1/small"), p("d2/hard")).expect("link");
    nix::unistd::mkfifo(
        &p("d2/fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .expect("mkfifo");
    wr(&p("d2/xfile"), &small_content("d2/xfile", 200));
    set_xattr(&p("d2/xfile"), b"user.tag", b"owner=d2/xfile", 0).expect("setxattr");
    set_xattr(&p("d2/xfile"), b"user.blob", &[b'x'; 900], 0).expect("setxattr");
    set_xattr(&p("d2/xfile"), b"system.posix_acl_access", &acl_value(), 0).expect("set ACL");
    wr(&p("d2/xfile2"), &small_content("d2/xfile2", 100));
    set_xattr(&p("d2/xfile2"), b"user.tag", b"owner=d2/xfile2", 0).expect("setxattr");
    for i in 0..300 {
        let name = format!("many/entry-with-a-longer-name-{i:03}");
        let data = if i % 25 == 0 {
            small_content(&name, 64)
        } else {
            Vec::new()
        };
        wr(&p(&name), &data);
    }
    // 200 one-block extents separated by holes: more than 160, so an extent tree.
    let even: Vec<u64> = (0..200).map(|i| i * 2).collect();
    write_chunks(&p("big"), &even, "big", 399 * FS_BLOCK);
    write_chunks(&p("sparse"), &[0, 128], "sparse", 1 << 20);
    std::os::unix::fs::symlink("d1/small", p("link")).expect("symlink");
    let long: String = "abcdefghi/".repeat(200);
    std::os::unix::fs::symlink(&long, p("d2/longlink")).expect("symlink");
    // Format v2. Two 4,050-byte targets (inline area + an overflow block) of the same length
    // and different tails: pointed at the other's overflow block, only the owner rule stands
    // between a readlink and the other link's bytes.
    std::os::unix::fs::symlink("abcdefghi/".repeat(405), p("d2/vlonglink")).expect("symlink");
    std::os::unix::fs::symlink("ABCDEFGHI/".repeat(405), p("d1/vlonglink2")).expect("symlink");
    // Two xattr sets of the same shape spanning a head and several overflow blocks (a 20 KiB
    // value and two small ones): likewise for a head pointing at the other set's blocks.
    for path in ["d2/bigx", "d1/bigx"] {
        wr(&p(path), &small_content(path, 100));
        for (name, len) in [
            (&b"user.big"[..], 20_000),
            (b"user.a", 30),
            (b"user.b", 300),
        ] {
            let value = small_content(
                &format!("xattr {path} {}", String::from_utf8_lossy(name)),
                len,
            );
            set_xattr(&p(path), name, &value, 0).expect("setxattr");
        }
    }
}

/// What the mount shows after populating: the model's expected values.
fn capture(root: &Path) -> Seen {
    let mut seen = Seen::new();
    let mut stack = vec![String::new()];
    while let Some(rel) = stack.pop() {
        let full = if rel.is_empty() {
            root.to_path_buf()
        } else {
            root.join(&rel)
        };
        let md = fs::symlink_metadata(&full).expect("lstat");
        let ft = md.file_type();
        let xa = list_xattrs(&full).expect("list xattrs");
        let (kind, content) = if ft.is_dir() {
            for e in fs::read_dir(&full).expect("readdir") {
                let n = e.expect("entry").file_name().into_string().expect("utf8");
                stack.push(if rel.is_empty() {
                    n
                } else {
                    format!("{rel}/{n}")
                });
            }
            (Kind::Dir, Vec::new())
        } else if ft.is_file() {
            (Kind::Reg, fs::read(&full).expect("read"))
        } else if ft.is_symlink() {
            use std::os::unix::ffi::OsStrExt;
            (
                Kind::Symlink,
                fs::read_link(&full)
                    .expect("readlink")
                    .as_os_str()
                    .as_bytes()
                    .to_vec(),
            )
        } else if ft.is_fifo() {
            (Kind::Fifo, Vec::new())
        } else {
            panic!("unexpected type at {rel}");
        };
        seen.insert(rel, (kind, content, xa));
    }
    seen
}

// ---------------------------------------------------------------------------------------------
// Cases

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Mount may refuse (then fsck must report the damage) or come up.
    Any,
    /// The runtime has what it needs to work around the damage: the mount must come up.
    MustMount,
}

#[derive(Debug, Clone)]
enum Inject {
    Bytes {
        off: u64,
        bytes: Vec<u8>,
    },
    /// A committed transaction in slot `slot`'s journal logging `image` for home `home`.
    Tx {
        slot: u32,
        home: u64,
        image: Vec<u8>,
    },
}

#[derive(Debug, Clone)]
struct Case {
    name: String,
    area: String,
    change: String,
    expect: Expect,
    injects: Vec<Inject>,
    /// Inode whose own blocks are damaged: its content may read back as zeros or as its own
    /// other chunks, never as anything else.
    damaged: Option<u64>,
    /// Expected content changes from the injection itself (damaged data blocks): (ino, offset, bytes).
    data_override: Vec<(u64, u64, Vec<u8>)>,
    /// Extra write at the damaged place: (path, offset).
    extra_write: Option<(String, u64)>,
    /// A file whose xattr set is damaged: a setxattr on it (which rewrites the set) joins the
    /// writes.
    extra_xattr: Option<String>,
    /// A valid-looking pointer into another file's blocks, inside the data area (a
    /// cross-link): without a reverse map the runtime cannot tell it from the file's own block
    /// (nor can ext4 or XFS at run time), so reading and writing it is not a failure; fsck
    /// must report the block as held twice, and nothing outside that block may change.
    cross_link: Option<u64>,
}

struct Builder<'a> {
    m: &'a Model,
    img: File,
    rng: StdRng,
    cases: Vec<Case>,
}

impl Builder<'_> {
    fn block(&self, b: u64) -> Vec<u8> {
        read_block(&self.img, b)
    }
    fn add(
        &mut self,
        name: &str,
        area: &str,
        change: impl Into<String>,
        injects: Vec<Inject>,
    ) -> &mut Case {
        self.cases.push(Case {
            name: name.into(),
            area: area.into(),
            change: change.into(),
            expect: Expect::Any,
            injects,
            damaged: None,
            data_override: Vec::new(),
            extra_write: None,
            extra_xattr: None,
            cross_link: None,
        });
        self.cases.last_mut().expect("just pushed")
    }
    /// Flip one random bit of fs block `b` (or of the `len` bytes at byte `off`).
    fn flip(&mut self, off: u64, len: usize) -> (Inject, String) {
        let i = self.rng.gen_range(0..len);
        let bit = self.rng.gen_range(0..8u8);
        let mut v = read_bytes(&self.img, off + i as u64, 1);
        v[0] ^= 1 << bit;
        (
            Inject::Bytes {
                off: off + i as u64,
                bytes: v,
            },
            format!("bit {bit} of byte {i} flipped"),
        )
    }
    fn flip_block(&mut self, name: &str, area: &str, b: u64) -> &mut Case {
        let (inj, what) = self.flip(b * FS_BLOCK, BS);
        self.add(name, area, format!("block {b}: {what}"), vec![inj])
    }
    fn zero_block(&mut self, name: &str, area: &str, b: u64) -> &mut Case {
        self.add(
            name,
            area,
            format!("block {b} zeroed"),
            vec![Inject::Bytes {
                off: b * FS_BLOCK,
                bytes: vec![0; BS],
            }],
        )
    }
    fn put_block(
        &mut self,
        name: &str,
        area: &str,
        b: u64,
        change: impl Into<String>,
        bytes: Vec<u8>,
    ) -> &mut Case {
        self.add(
            name,
            area,
            change,
            vec![Inject::Bytes {
                off: b * FS_BLOCK,
                bytes,
            }],
        )
    }
    fn hb_off(&self, slot: u64) -> u64 {
        self.m.sb.hb_start * FS_BLOCK + slot * LBS
    }
    fn lock_off(&self, idx: u64) -> u64 {
        self.m.sb.lock_start * FS_BLOCK + idx * LBS
    }
    fn lock_rec(&self, idx: u64, kind: LockKind, object: u64) -> LockRecord {
        let raw = read_bytes(&self.img, self.lock_off(idx), usize::try_from(LBS).unwrap());
        LockRecord::decode(&raw, idx)
            .expect("pristine lock record decodes")
            .unwrap_or_else(|| LockRecord::free(kind, idx, object))
    }
    fn put_lock(&mut self, name: &str, change: &str, rec: &LockRecord) -> &mut Case {
        let off = self.lock_off(rec.index);
        let mut r = rec.clone();
        r.nonce = 0x5eed_0000_0000_0001 ^ rec.nonce;
        self.add(
            name,
            "lock area",
            format!("record {}: {change} (re-encoded)", rec.index),
            vec![Inject::Bytes {
                off,
                bytes: r.encode(usize::try_from(LBS).unwrap()),
            }],
        )
    }
    fn bucket_of(&self, ino: u64) -> u64 {
        let sb = &self.m.sb;
        let ils = u64::from(sb.inode_lock_slots);
        sb.lock_count - ils + (ino.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % ils
    }
    fn heartbeat(&self, slot: u64, host: &str, live: bool, interval: u32, io: u32) -> Heartbeat {
        Heartbeat {
            state: if live {
                SlotState::Live
            } else {
                SlotState::Free
            },
            generation: 7,
            counter: 42,
            nonce: 0x1234_5678 + slot,
            uuid: self.m.sb.uuid,
            interval_ms: interval,
            io_timeout_ms: io,
            slot: u32::try_from(slot).expect("slot"),
            host: host.into(),
            pid: 999_999,
            recoverer: u32::MAX,
            recoverer_gen: 0,
            machine: cetrafs_core::cluster::machine::MachineId::UNKNOWN,
            watchdog_ms: 0,
        }
    }
    fn put_hb(&mut self, name: &str, change: &str, hb: &Heartbeat) -> &mut Case {
        let off = self.hb_off(u64::from(hb.slot));
        self.add(
            name,
            "heartbeat area",
            format!("record {}: {change} (re-encoded)", hb.slot),
            vec![Inject::Bytes {
                off,
                bytes: hb.encode(usize::try_from(LBS).unwrap()),
            }],
        )
    }
    fn inode(&self, path: &str) -> Inode {
        let ino = self.m.ino(path);
        Inode::decode(&self.block(ino), ino).expect("pristine inode")
    }
    fn put_inode(
        &mut self,
        name: &str,
        path: &str,
        change: &str,
        edit: impl FnOnce(&mut Inode),
    ) -> &mut Case {
        let mut i = self.inode(path);
        edit(&mut i);
        let ino = i.ino;
        let c = self.put_block(
            name,
            "inode",
            ino,
            format!("inode of {path}: {change} (re-encoded)"),
            i.encode(),
        );
        c.damaged = Some(ino);
        c
    }
    fn tree(&self, b: u64) -> TreeNode {
        TreeNode::decode(&self.block(b), b).expect("pristine tree node")
    }
    fn put_tree(
        &mut self,
        name: &str,
        area: &str,
        t: &TreeNode,
        change: String,
        owner_ino: u64,
    ) -> &mut Case {
        let c = self.put_block(name, area, t.blockno, change, t.encode());
        c.damaged = Some(owner_ino);
        c
    }
}

/// Targets of [`wild_targets`] that are another file's blocks in the data area (cross-links).
const CROSS_LINK_TARGETS: [&str; 2] = ["otherdata", "otherinode"];

/// The block targets a damaged pointer is pointed at, all outside the file's own blocks.
fn wild_targets(m: &Model) -> Vec<(&'static str, u64)> {
    let sb = &m.sb;
    vec![
        ("superblock", 0),
        ("heartbeat", sb.hb_start),
        ("lock", sb.lock_start),
        ("journal", sb.journal_start),
        ("grouphdr", sb.group_first_block(1)),
        ("bitmap", sb.group_first_block(0) + 1),
        ("otherdata", m.data_block("d1/small2", 0)),
        ("otherinode", m.ino("d2/xfile")),
        ("backupsb", sb.backup_block),
        ("pastdev", sb.total_blocks + 100),
    ]
    .into_iter()
    .chain(
        // Format v3: the object-lock buckets and the mailboxes are never data either.
        sb.object_lock_area()
            .map(|_| [("objlock", sb.objlock_start), ("mailbox", sb.mailbox_start)])
            .into_iter()
            .flatten(),
    )
    .collect()
}

fn build_cases(m: &Model, pristine: &Path, seed: u64, random: usize) -> Vec<Case> {
    let mut b = Builder {
        m,
        img: File::open(pristine).expect("open pristine"),
        rng: StdRng::seed_from_u64(0x00C0_FFEE),
        cases: Vec::new(),
    };
    let sb = m.sb.clone();
    b.add("baseline", "none", "no damage (control)", vec![])
        .expect = Expect::MustMount;

    // --- superblock
    let backup = sb.backup_block;
    b.flip_block("sb.primary.flip", "superblock", 0).expect = Expect::MustMount;
    b.zero_block("sb.primary.zero", "superblock", 0).expect = Expect::MustMount;
    b.flip_block("sb.backup.flip", "superblock", backup).expect = Expect::MustMount;
    {
        let (i1, w1) = b.flip(0, BS);
        let (i2, w2) = b.flip(backup * FS_BLOCK, BS);
        b.add(
            "sb.both.flip",
            "superblock",
            format!("primary: {w1}; backup: {w2}"),
            vec![i1, i2],
        );
        let z = |o| Inject::Bytes {
            off: o,
            bytes: vec![0; BS],
        };
        b.add(
            "sb.both.zero",
            "superblock",
            "primary and backup zeroed",
            vec![z(0), z(backup * FS_BLOCK)],
        );
    }
    for (name, change, edit) in [
        (
            "sb.primary.total_blocks",
            "total_blocks x 64 (far past the device)",
            Box::new(|s: &mut Superblock| {
                s.total_blocks *= 64;
                s.backup_block = s.total_blocks - 1;
            }) as Box<dyn Fn(&mut Superblock)>,
        ),
        (
            "sb.primary.group_count",
            "group_count + 1 (past the backup)",
            Box::new(|s: &mut Superblock| s.group_count += 1),
        ),
        (
            "sb.primary.io_timeout",
            "io_timeout_ms = u32::MAX",
            Box::new(|s: &mut Superblock| s.io_timeout_ms = u32::MAX),
        ),
        (
            "sb.primary.hb_interval",
            "heartbeat_interval_ms = u32::MAX",
            Box::new(|s: &mut Superblock| s.heartbeat_interval_ms = u32::MAX),
        ),
        (
            "sb.primary.lock_count",
            "lock_count = 2 (no bucket records)",
            Box::new(|s: &mut Superblock| s.lock_count = 2),
        ),
    ] {
        let mut s = sb.clone();
        edit(&mut s);
        b.put_block(
            name,
            "superblock",
            0,
            format!("primary {change} (re-encoded)"),
            s.encode(),
        )
        .expect = Expect::MustMount;
    }

    // --- heartbeat area (records are 512-byte logical blocks)
    {
        let (i, w) = b.flip(b.hb_off(0), usize::try_from(LBS).unwrap());
        b.add(
            "hb.rec0.flip",
            "heartbeat area",
            format!("record 0 (this node's, Free): {w}"),
            vec![i],
        )
        .expect = Expect::MustMount;
        let off = b.hb_off(0);
        b.add(
            "hb.rec0.zero",
            "heartbeat area",
            "record 0 zeroed",
            vec![Inject::Bytes {
                off,
                bytes: vec![0; usize::try_from(LBS).unwrap()],
            }],
        )
        .expect = Expect::MustMount;
        let hb = b.heartbeat(1, "ghost", true, u32::MAX, u32::MAX);
        b.put_hb(
            "hb.rec1.live_absurd",
            "Live, host ghost, interval and io_timeout u32::MAX",
            &hb,
        )
        .expect = Expect::MustMount;
        let hb = b.heartbeat(1, "ghost", true, 100, u32::MAX);
        b.put_hb(
            "hb.rec1.io_timeout_max",
            "Live, host ghost, io_timeout_ms u32::MAX",
            &hb,
        )
        .expect = Expect::MustMount;
        let hb = b.heartbeat(0, HOST, true, u32::MAX, u32::MAX);
        b.put_hb(
            "hb.rec0.live_absurd",
            "Live, this host, absurd timings",
            &hb,
        )
        .expect = Expect::MustMount;
        let hb = b.heartbeat(40, "ghost", true, u32::MAX, u32::MAX);
        b.put_hb(
            "hb.rec40.live_absurd",
            "Live, host ghost, absurd timings, slot >= max_nodes",
            &hb,
        )
        .expect = Expect::MustMount;
        let hb = b.heartbeat(1, "ghost", true, 100, 500);
        b.put_hb(
            "hb.rec1.dead_node",
            "Live, host ghost, normal timings, not renewing (a dead node)",
            &hb,
        )
        .expect = Expect::MustMount;
        let mut hb = b.heartbeat(1, "ghost", true, 100, 500);
        hb.state = SlotState::Recovering;
        hb.recoverer = 1;
        hb.recoverer_gen = 77;
        b.put_hb(
            "hb.rec1.recovering_stale",
            "Recovering, recoverer slot 1 gen 77 (itself, not alive)",
            &hb,
        )
        .expect = Expect::MustMount;
        let mut hb = b.heartbeat(1, "ghost", true, 100, 500);
        hb.uuid = [0xaa; 16];
        b.put_hb(
            "hb.rec1.foreign_uuid",
            "Live record of another volume (foreign uuid)",
            &hb,
        )
        .expect = Expect::MustMount;
    }

    // --- lock area
    {
        let (i, w) = b.flip(b.lock_off(0), usize::try_from(LBS).unwrap());
        b.add(
            "lock.rec0.flip",
            "lock area",
            format!("record 0 (global lock): {w}"),
            vec![i],
        );
        let off = b.lock_off(0);
        b.add(
            "lock.rec0.zero",
            "lock area",
            "record 0 zeroed",
            vec![Inject::Bytes {
                off,
                bytes: vec![0; usize::try_from(LBS).unwrap()],
            }],
        )
        .expect = Expect::MustMount;
        let mut r = b.lock_rec(0, LockKind::Global, 0);
        r.mode = LockMode::Exclusive;
        r.owner = 1;
        r.owner_gen = 1;
        b.put_lock(
            "lock.rec0.excl_unused_slot",
            "Exclusive, owner slot 1 (never used) gen 1",
            &r,
        )
        .expect = Expect::MustMount;
        let mut r = b.lock_rec(0, LockKind::Global, 0);
        r.mode = LockMode::Exclusive;
        r.owner = 0;
        r.owner_gen = 999;
        b.put_lock(
            "lock.rec0.excl_stale_gen",
            "Exclusive, owner slot 0 with generation 999 (not live)",
            &r,
        )
        .expect = Expect::MustMount;
        let mut r = b.lock_rec(0, LockKind::Global, 0);
        r.mode = LockMode::Shared;
        r.holders.insert(1);
        b.put_lock(
            "lock.rec0.shared_unused_slot",
            "Shared, holder slot 1 (never used)",
            &r,
        )
        .expect = Expect::MustMount;
        let mut r = b.lock_rec(0, LockKind::Global, 0);
        r.waiters.insert(1);
        b.put_lock(
            "lock.rec0.waiter_unused_slot",
            "waiter slot 1 (never used)",
            &r,
        )
        .expect = Expect::MustMount;
        let (i, w) = b.flip(b.lock_off(1), usize::try_from(LBS).unwrap());
        b.add(
            "lock.group0.flip",
            "lock area",
            format!("record 1 (group 0): {w}"),
            vec![i],
        );
        let mut r = b.lock_rec(1, LockKind::Group, 0);
        r.mode = LockMode::Exclusive;
        r.owner = 1;
        r.owner_gen = 1;
        b.put_lock(
            "lock.group0.excl_unused_slot",
            "group 0 Exclusive by slot 1 (never used)",
            &r,
        )
        .expect = Expect::MustMount;
        let small = m.ino("d1/small");
        let bk = b.bucket_of(small);
        let (i, w) = b.flip(b.lock_off(bk), usize::try_from(LBS).unwrap());
        b.add(
            "lock.bucket.flip",
            "lock area",
            format!("record {bk} (open bucket of d1/small): {w}"),
            vec![i],
        );
        let mut r = b.lock_rec(
            bk,
            LockKind::OpenBucket,
            bk - (sb.lock_count - u64::from(sb.inode_lock_slots)),
        );
        r.entries = vec![OpenEntry {
            ino: small,
            slot: 1,
            writer: true,
            slot_gen: 3,
        }];
        b.put_lock(
            "lock.bucket.stale_writer",
            "open bucket of d1/small: writer slot 1 gen 3 (never used)",
            &r,
        )
        .expect = Expect::MustMount;
        let off = b.lock_off(bk);
        b.add(
            "lock.bucket.zero",
            "lock area",
            format!("record {bk} (bucket of d1/small) zeroed"),
            vec![Inject::Bytes {
                off,
                bytes: vec![0; usize::try_from(LBS).unwrap()],
            }],
        )
        .expect = Expect::MustMount;
    }

    // --- object-lock area and mailboxes (format v3)
    if let Some(area) = sb.object_lock_area() {
        let small = m.ino("d1/small");
        let obj = cetrafs_core::cluster::object_lock::ObjectId::inode(small).expect("inode id");
        let bk = area.bucket_of(obj);
        let off = area.bucket_offset + bk * LBS;
        let (i, w) = b.flip(off, usize::try_from(LBS).unwrap());
        b.add(
            "objlock.bucket.flip",
            "object-lock area",
            format!("bucket {bk} (of d1/small's inode): {w}"),
            vec![i],
        );
        let mut bucket = Bucket::empty(bk);
        let mut e = Entry::new(obj.raw(), 9);
        e.mentions.push(Mention {
            slot: 1,
            role: LockRole::Owner,
            gen: 3,
        });
        bucket.entries.push(e);
        b.add(
            "objlock.bucket.stale_owner",
            "object-lock area",
            format!("bucket {bk}: d1/small's inode owned by slot 1 gen 3 (never used)"),
            vec![Inject::Bytes {
                off,
                bytes: bucket
                    .encode(usize::try_from(LBS).unwrap())
                    .expect("bucket"),
            }],
        );
        let (i, w) = b.flip(area.mailbox_offset, usize::try_from(LBS).unwrap());
        b.add(
            "mailbox.slot0.flip",
            "mailbox area",
            format!("mailbox of slot 0: {w}"),
            vec![i],
        );
    }

    // --- journals: slot headers (orphan lists) and transactions
    {
        let j0 = sb.journal_start;
        let j1 = sb.journal_start + sb.journal_blocks;
        b.flip_block("journal.slot0.header.flip", "slot header", j0);
        let orphan = |o: u64| SlotHeader {
            seq: 5,
            slot: 0,
            orphans: vec![o],
        };
        for (tag, blk) in [
            ("livefile", m.ino("d1/small")),
            ("superblock", 0),
            ("grouphdr", sb.group_first_block(1)),
            ("otherdata", m.data_block("big", 0)),
            ("pastdev", sb.total_blocks + 100),
        ] {
            let c = b.put_block(
                &format!("journal.slot0.orphan.{tag}"),
                "slot header",
                j0,
                format!("slot 0 orphan list = [{blk}] ({})", m.describe_block(blk)),
                orphan(blk).encode(j0),
            );
            c.expect = Expect::MustMount;
        }
        let h1 = SlotHeader {
            seq: 5,
            slot: 1,
            orphans: vec![m.ino("d1/small2")],
        };
        b.put_block(
            "journal.slot1.orphan.livefile",
            "slot header",
            j1,
            "slot 1 (unused) orphan list = [d1/small2]",
            h1.encode(j1),
        )
        .expect = Expect::MustMount;
        b.flip_block("journal.slot0.block1.flip", "journal", j0 + 1)
            .expect = Expect::MustMount;
        let xino = m.ino("d2/xfile");
        let ximg = b.block(xino);
        b.add(
            "journal.slot0.tx.home_superblock",
            "journal",
            format!(
                "committed transaction in slot 0 logging inode {xino}'s image for home block 0"
            ),
            vec![Inject::Tx {
                slot: 0,
                home: 0,
                image: ximg.clone(),
            }],
        );
        let d = m.data_block("d1/small2", 0);
        b.add(
            "journal.slot0.tx.home_otherdata",
            "journal",
            format!("committed transaction in slot 0 logging inode {xino}'s image for home {d} (data of d1/small2)"),
            vec![Inject::Tx {
                slot: 0,
                home: d,
                image: ximg,
            }],
        );
    }

    // --- group header and bitmap
    {
        let g0 = sb.group_first_block(0);
        let g1 = sb.group_first_block(1);
        b.flip_block("group0.header.flip", "group header", g0);
        b.zero_block("group1.header.zero", "group header", g1);
        let h = GroupHeader::decode(&b.block(g0), g0).expect("pristine group header");
        let mut h2 = h.clone();
        h2.free_blocks += 1;
        b.put_block(
            "group0.header.free_count",
            "group header",
            g0,
            "free_blocks + 1 (re-encoded)",
            h2.encode(),
        );
        let mut h2 = h.clone();
        h2.index = 5;
        b.put_block(
            "group0.header.index",
            "group header",
            g0,
            "index 0 -> 5 (re-encoded)",
            h2.encode(),
        );
        b.flip_block("group0.bitmap.flip", "bitmap", g0 + 1);
        b.zero_block("group0.bitmap.zero", "bitmap", g0 + 1);
        // A consistent lie: clear d1/small2's data bit and count it free. The allocator may
        // hand it out again; that is not the runtime's fault (it is what fsck finds).
        let d = m.data_block("d1/small2", 0);
        let gd = sb.group_of(d).expect("data in a group");
        let gdb = sb.group_first_block(gd);
        let raw = b.block(gdb + 1);
        let (seq, bits) = decode_bitmap(&raw, gdb + 1).expect("pristine bitmap");
        let mut bits = bits.to_vec();
        let bit = usize::try_from(d - gdb).expect("bit");
        bits[bit / 8] &= !(1 << (bit % 8));
        let mut h2 = GroupHeader::decode(&b.block(gdb), gdb).expect("pristine group header");
        h2.free_blocks += 1;
        b.add(
            "group.bitmap.lie_free",
            "bitmap",
            format!("group {gd}: bit of block {d} (d1/small2 data) cleared and free count + 1 (re-encoded)"),
            vec![
                Inject::Bytes {
                    off: (gdb + 1) * FS_BLOCK,
                    bytes: encode_bitmap(gdb + 1, seq, &bits),
                },
                Inject::Bytes {
                    off: gdb * FS_BLOCK,
                    bytes: h2.encode(),
                },
            ],
        )
        .expect = Expect::MustMount;
    }

    // --- inodes
    for (name, path) in [
        ("inode.file.flip", "d1/small2"),
        ("inode.bigfile.flip", "big"),
        ("inode.dir.flip", "d1"),
        ("inode.symlink.flip", "link"),
        ("inode.fifo.flip", "d2/fifo"),
        ("inode.root.flip", ""),
    ] {
        let ino = m.ino(path);
        b.flip_block(name, "inode", ino).damaged = Some(ino);
    }
    for (name, path) in [("inode.file.zero", "d2/xfile2"), ("inode.dir.zero", "many")] {
        let ino = m.ino(path);
        b.zero_block(name, "inode", ino).damaged = Some(ino);
    }
    for (tag, target) in wild_targets(m) {
        let c = b.put_inode(
            &format!("inode.extent.{tag}"),
            "d1/small",
            &format!("inline extent 0 physical -> {target} ({tag})"),
            |i| {
                i.inline_extents[0].physical = target;
            },
        );
        c.extra_write = Some(("d1/small".into(), 0));
        if CROSS_LINK_TARGETS.contains(&tag) {
            c.cross_link = Some(target);
        }
    }
    {
        let c = b.put_inode(
            "inode.extent.len_past_group",
            "d1/small2",
            "inline extent 0 len -> 5000 (past its group)",
            |i| {
                i.inline_extents[0].len = 5000;
            },
        );
        c.extra_write = Some(("d1/small2".into(), 8192));
        let other_x = m.node("d2/xfile2").inode.xattr_block;
        b.put_inode(
            "inode.xattr.other_inode",
            "d2/xfile",
            &format!("xattr_block -> {other_x} (d2/xfile2's xattr block)"),
            |i| {
                i.xattr_block = other_x;
            },
        );
        b.put_inode(
            "inode.xattr.probe",
            "d2/xfile",
            "xattr_block -> 1 (the probe block)",
            |i| i.xattr_block = 1,
        );
        b.put_inode(
            "inode.xattr.grouphdr",
            "d2/xfile",
            "xattr_block -> group 1 header",
            |i| {
                i.xattr_block = sb.group_first_block(1);
            },
        );
        let many_root = m.node("many").inode.tree_root;
        let c = b.put_inode(
            "inode.tree.other_dir_root",
            "big",
            &format!("tree_root -> {many_root} (dir 'many' root)"),
            |i| {
                i.tree_root = many_root;
            },
        );
        c.extra_write = Some(("big".into(), 0));
        let c = b.put_inode(
            "inode.tree.probe",
            "big",
            "tree_root -> block 1 (the probe block)",
            |i| i.tree_root = 1,
        );
        c.extra_write = Some(("big".into(), 0));
        let big_root = m.node("big").inode.tree_root;
        b.put_inode(
            "inode.dirtree.other_file_root",
            "d1",
            &format!("tree_root -> {big_root} (big's extent tree)"),
            |i| {
                i.tree_root = big_root;
            },
        );
        b.put_inode(
            "inode.dirtree.journal",
            "d2",
            "tree_root -> journal block",
            |i| i.tree_root = sb.journal_start + 3,
        );
        let c = b.put_inode("inode.size.huge", "d1/small2", "size -> 2^40", |i| {
            i.size = 1 << 40;
        });
        c.extra_write = Some(("d1/small2".into(), 1 << 30));
        b.put_inode(
            "inode.symlink.inline_len",
            "d2/longlink",
            "inline_len -> 3840 (padded with z) while size stays 2000",
            |i| {
                i.inline_data.resize(3840, b'z');
            },
        );
    }
    {
        // Raw field edits re-sealed (fields the encoder cannot produce).
        let ino = m.ino("link");
        let raw = b.block(ino);
        let bad = reseal(&raw, |x| put_u32(x, 152, 4000));
        b.put_block(
            "inode.symlink.inline_len_past_block",
            "inode",
            ino,
            "symlink inline_len = 4000 (past the block), re-sealed",
            bad,
        )
        .damaged = Some(ino);
        let ino = m.ino("d1/small2");
        let raw = b.block(ino);
        let bad = reseal(&raw, |x| put_u32(x, 156, 161));
        b.put_block(
            "inode.inline_count",
            "inode",
            ino,
            "inline_extent_count = 161, re-sealed",
            bad,
        )
        .damaged = Some(ino);
    }

    // --- tree nodes: directory 'many' and big's extent tree
    {
        let many = m.ino("many");
        let root = m.node("many").inode.tree_root;
        let leaves = m.own_of("many", |r| r == Role::Tree { level: 0 });
        assert!(leaves.len() >= 2, "'many' must have a multi-node tree");
        b.flip_block("tree.dir.root.flip", "dir tree", root).damaged = Some(many);
        b.flip_block("tree.dir.leaf.flip", "dir tree", leaves[0])
            .damaged = Some(many);
        b.zero_block("tree.dir.leaf.zero", "dir tree", leaves[1])
            .damaged = Some(many);
        for (tag, target) in [
            ("superblock", 0),
            ("grouphdr", sb.group_first_block(1)),
            ("other_tree", m.node("big").inode.tree_root),
            ("pastdev", sb.total_blocks + 100),
        ] {
            let mut t = b.tree(root);
            if let NodeEntries::Internal(v) = &mut t.entries {
                v[1].1 = target;
            } else {
                panic!("'many' root is not internal");
            }
            b.put_tree(
                &format!("tree.dir.child.{tag}"),
                "dir tree",
                &t,
                format!("root child 1 -> {target} ({tag}), re-encoded"),
                many,
            );
        }
        let big = m.ino("big");
        let broot = m.node("big").inode.tree_root;
        let bleaves = m.own_of("big", |r| r == Role::Tree { level: 0 });
        assert!(
            bleaves.len() >= 2,
            "'big' must have a multi-node extent tree"
        );
        b.flip_block("tree.extent.root.flip", "extent tree", broot)
            .damaged = Some(big);
        b.flip_block("tree.extent.leaf.flip", "extent tree", bleaves[0])
            .damaged = Some(big);
        b.zero_block("tree.extent.leaf.zero", "extent tree", bleaves[1])
            .damaged = Some(big);
        for (tag, target) in [
            ("superblock", 0),
            ("otherinode", m.ino("d1/small")),
            ("pastdev", sb.total_blocks + 100),
        ] {
            let mut t = b.tree(broot);
            if let NodeEntries::Internal(v) = &mut t.entries {
                v[1].1 = target;
            }
            let c = b.put_tree(
                &format!("tree.extent.child.{tag}"),
                "extent tree",
                &t,
                format!("root child 1 -> {target} ({tag}), re-encoded"),
                big,
            );
            c.extra_write = Some(("big".into(), 390 * FS_BLOCK));
        }
        for (tag, target) in wild_targets(m) {
            let mut t = b.tree(bleaves[0]);
            let mut logical = 0;
            if let NodeEntries::Leaf(v) = &mut t.entries {
                let (k, val) = &mut v[3];
                let mut e = Extent::decode_value(*k, val).expect("extent");
                e.physical = target;
                *val = e.encode_value().to_vec();
                logical = *k;
            }
            let c = b.put_tree(
                &format!("tree.extent.leaf.{tag}"),
                "extent tree",
                &t,
                format!(
                    "leaf extent at file block {logical} physical -> {target} ({tag}), re-encoded"
                ),
                big,
            );
            c.extra_write = Some(("big".into(), logical * FS_BLOCK));
            if CROSS_LINK_TARGETS.contains(&tag) {
                c.cross_link = Some(target);
            }
        }
    }

    // --- directory entries (inside dir tree leaves)
    {
        let many = m.ino("many");
        let leaf = m.own_of("many", |r| r == Role::Tree { level: 0 })[0];
        let t0 = b.tree(leaf);
        for (tag, target) in [
            ("superblock", 0u64),
            ("grouphdr", sb.group_first_block(1)),
            ("datablock", m.data_block("d1/small2", 0)),
            ("treenode", m.node("big").inode.tree_root),
            ("pastdev", sb.total_blocks + 100),
        ] {
            let mut t = t0.clone();
            let mut which = String::new();
            if let NodeEntries::Leaf(v) = &mut t.entries {
                let mut es = decode_entries(&v[2].1).expect("dirents");
                es[0].ino = target;
                which = String::from_utf8_lossy(&es[0].name).into_owned();
                v[2].1 = encode_entries(&es);
            }
            b.put_tree(
                &format!("dirent.ino.{tag}"),
                "dirent",
                &t,
                format!("entry many/{which}: ino -> {target} ({tag}), re-encoded"),
                many,
            );
        }
        let mut t = t0.clone();
        if let NodeEntries::Leaf(v) = &mut t.entries {
            let mut es = decode_entries(&v[4].1).expect("dirents");
            es[0].dtype = 4; // DT_DIR for a regular file
            v[4].1 = encode_entries(&es);
        }
        b.put_tree(
            "dirent.dtype",
            "dirent",
            &t,
            "a regular file's entry says DT_DIR, re-encoded".to_string(),
            many,
        );
    }

    // --- xattr block
    {
        let x = m.ino("d2/xfile");
        let xb = m.node("d2/xfile").inode.xattr_block;
        b.flip_block("xattr.flip", "xattr block", xb).damaged = Some(x);
        b.zero_block("xattr.zero", "xattr block", xb).damaged = Some(x);
        let mut img = b.block(xb);
        let h = BlockHeader::decode(&img).expect("pristine xattr block header");
        let other = m.ino("d2/xfile2");
        BlockHeader { owner: other, ..h }.seal(&mut img);
        b.put_block(
            "xattr.owner",
            "xattr block",
            xb,
            format!("owner -> {other} (d2/xfile2), re-sealed"),
            img,
        )
        .damaged = Some(x);
    }

    overflow_cases(&mut b);

    // --- data blocks (no checksums: the bytes the disk returns are the file's bytes)
    {
        let ino = m.ino("d1/small2");
        let d = m.data_block("d1/small2", 1);
        let (inj, what) = b.flip(d * FS_BLOCK, 6000 - BS);
        let mut content = read_block(&b.img, d);
        if let Inject::Bytes { off, bytes } = &inj {
            content[usize::try_from(off - d * FS_BLOCK).expect("o")] = bytes[0];
        }
        let c = b.add(
            "data.flip",
            "data",
            format!("d1/small2 block 1 ({d}): {what}"),
            vec![inj],
        );
        c.expect = Expect::MustMount;
        c.data_override.push((ino, FS_BLOCK, content));
        let ino = m.ino("big");
        let d = m.data_block("big", 10);
        let c = b.zero_block("data.zero", "data", d);
        c.expect = Expect::MustMount;
        c.data_override.push((ino, 10 * FS_BLOCK, vec![0; BS]));
    }

    // --- random extra cases
    if random > 0 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut pool: Vec<u64> = m.owner.keys().copied().collect();
        pool.sort_unstable();
        pool.extend([
            0,
            backup,
            sb.journal_start,
            sb.group_first_block(0),
            sb.group_first_block(0) + 1,
        ]);
        for i in 0..random {
            let blk = pool[rng.gen_range(0..pool.len())];
            let area = m.describe_block(blk);
            let damaged = m.owner.get(&blk).map(|(o, _)| *o);
            let is_data = matches!(m.owner.get(&blk), Some((_, Role::Data { .. })));
            if is_data {
                continue; // data damage needs an expected-content override; covered above
            }
            let c = if rng.gen_bool(0.5) {
                b.flip_block(&format!("random.{i}.flip"), &area, blk)
            } else {
                b.zero_block(&format!("random.{i}.zero"), &area, blk)
            };
            c.damaged = damaged;
        }
    }
    b.cases
}

/// Format v2 structures (docs/format.md §9.1): a symlink target's overflow block (inode field
/// `overflow_block`) and an xattr set's overflow blocks (listed by its head).
fn overflow_cases(b: &mut Builder<'_>) {
    let m = b.m;
    let sb = m.sb.clone();
    let overflows = |path: &str| m.own_of(path, |r| matches!(r, Role::Overflow { .. }));
    let (link, link2) = (m.ino("d2/vlonglink"), m.ino("d1/vlonglink2"));
    let lo = m.node("d2/vlonglink").inode.overflow_block;
    let lo2 = m.node("d1/vlonglink2").inode.overflow_block;
    assert!(
        lo != 0 && lo2 != 0,
        "the 4,050-byte symlinks must have overflow blocks"
    );
    let (x, x2) = (m.ino("d2/bigx"), m.ino("d1/bigx"));
    let xhead = m.node("d2/bigx").inode.xattr_block;
    let more = overflows("d2/bigx");
    let more2 = overflows("d1/bigx");
    assert!(
        more.len() >= 3 && more.len() == more2.len(),
        "both 20 KiB xattr sets must span the same number (>= 3) of overflow blocks"
    );
    let xcase = |c: &mut Case| {
        c.damaged = Some(x);
        c.extra_xattr = Some("d2/bigx".into());
    };

    // The overflow blocks themselves: bit rot, zeroes, re-sealed field changes.
    b.flip_block("overflow.symlink.flip", "overflow block", lo)
        .damaged = Some(link);
    b.zero_block("overflow.symlink.zero", "overflow block", lo)
        .damaged = Some(link);
    xcase(b.flip_block("overflow.xattr.flip", "overflow block", more[1]));
    xcase(b.zero_block("overflow.xattr.zero", "overflow block", more[1]));
    for (tag, blk, ino, other, other_path) in [
        ("xattr", more[0], x, x2, "d1/bigx"),
        ("symlink", lo, link, link2, "d1/vlonglink2"),
    ] {
        let mut img = b.block(blk);
        let h = BlockHeader::decode(&img).expect("pristine overflow header");
        BlockHeader { owner: other, ..h }.seal(&mut img);
        let c = b.put_block(
            &format!("overflow.{tag}.owner"),
            "overflow block",
            blk,
            format!("owner -> {other} ({other_path}), re-sealed"),
            img,
        );
        c.damaged = Some(ino);
        if tag == "xattr" {
            xcase(c);
        }
    }
    let raw0 = b.block(more[0]);
    let len0 = u32::from_le_bytes(raw0[44..48].try_into().expect("len"));
    for (name, blk, ino, change, edit) in [
        (
            "overflow.xattr.index",
            more[0],
            x,
            "index 1 -> 2, re-sealed".to_string(),
            Box::new(|v: &mut [u8]| v[42..44].copy_from_slice(&2u16.to_le_bytes()))
                as Box<dyn Fn(&mut [u8])>,
        ),
        (
            "overflow.xattr.len",
            more[0],
            x,
            format!("len {len0} -> {}, re-sealed", len0 - 1),
            Box::new(move |v: &mut [u8]| put_u32(v, 44, len0 - 1)),
        ),
        (
            "overflow.symlink.index",
            lo,
            link,
            "index 1 -> 2, re-sealed".to_string(),
            Box::new(|v: &mut [u8]| v[42..44].copy_from_slice(&2u16.to_le_bytes())),
        ),
        (
            "overflow.symlink.len",
            lo,
            link,
            "len 210 -> 209, re-sealed".to_string(),
            Box::new(|v: &mut [u8]| put_u32(v, 44, 209)),
        ),
        (
            "overflow.symlink.role",
            lo,
            link,
            "role symlink target -> xattr set, re-sealed".to_string(),
            Box::new(|v: &mut [u8]| v[40] = 2),
        ),
    ] {
        let raw = b.block(blk);
        let c = b.put_block(name, "overflow block", blk, change, reseal(&raw, edit));
        c.damaged = Some(ino);
        if ino == x {
            xcase(c);
        }
    }

    // The symlink's pointer (inode field overflow_block), re-encoded.
    for (tag, target) in [
        ("superblock", 0),
        ("grouphdr", sb.group_first_block(1)),
        ("other_symlink", lo2),
        ("xattr_overflow", more[0]),
        ("pastdev", sb.total_blocks + 100),
    ] {
        b.put_inode(
            &format!("symlink.overflow.{tag}"),
            "d2/vlonglink",
            &format!("overflow_block -> {target} ({})", m.describe_block(target)),
            |i| i.overflow_block = target,
        );
    }
    b.put_inode(
        "symlink.overflow.short_target",
        "link",
        &format!("a 8-byte target given overflow_block -> {lo2} (d1/vlonglink2's)"),
        |i| i.overflow_block = lo2,
    );

    // The xattr head's overflow list, re-sealed.
    let head_raw = b.block(xhead);
    let ptr = |i: usize| 48 + 8 * i;
    for (tag, target) in [
        ("superblock", 0),
        ("grouphdr", sb.group_first_block(1)),
        ("other_set", more2[1]),
        ("symlink_overflow", lo2),
        ("datablock", m.data_block("d1/small2", 0)),
        ("inode", m.ino("d1/small")),
        ("pastdev", sb.total_blocks + 100),
    ] {
        let img = reseal(&head_raw, |v| {
            v[ptr(1)..ptr(1) + 8].copy_from_slice(&target.to_le_bytes());
        });
        xcase(b.put_block(
            &format!("xattr.more.{tag}"),
            "xattr head",
            xhead,
            format!(
                "overflow pointer 1 -> {target} ({}), re-sealed",
                m.describe_block(target)
            ),
            img,
        ));
    }
    let img = reseal(&head_raw, |v| {
        v[ptr(0)..ptr(0) + 8].copy_from_slice(&more[1].to_le_bytes());
        v[ptr(1)..ptr(1) + 8].copy_from_slice(&more[0].to_le_bytes());
    });
    xcase(b.put_block(
        "xattr.more.swapped",
        "xattr head",
        xhead,
        "overflow pointers 0 and 1 swapped, re-sealed",
        img,
    ));
    let n = u16::try_from(more.len()).expect("count");
    for (tag, to) in [("more_plus", n + 1), ("more_minus", n - 1)] {
        let img = reseal(&head_raw, |v| v[42..44].copy_from_slice(&to.to_le_bytes()));
        xcase(b.put_block(
            &format!("xattr.head.{tag}"),
            "xattr head",
            xhead,
            format!("more {n} -> {to}, re-sealed"),
            img,
        ));
    }
    let used = u32::from_le_bytes(head_raw[44..48].try_into().expect("used"));
    let img = reseal(&head_raw, |v| put_u32(v, 44, used - 8));
    xcase(b.put_block(
        "xattr.head.used",
        "xattr head",
        xhead,
        format!("used {used} -> {}, re-sealed", used - 8),
        img,
    ));
    let mut img = head_raw.clone();
    let h = BlockHeader::decode(&img).expect("pristine xattr head");
    BlockHeader { owner: x2, ..h }.seal(&mut img);
    xcase(b.put_block(
        "xattr.head.owner",
        "xattr head",
        xhead,
        format!("owner -> {x2} (d1/bigx), re-sealed"),
        img,
    ));
    let other_head = m.node("d1/bigx").inode.xattr_block;
    let c = b.put_inode(
        "inode.xattr.other_set",
        "d2/bigx",
        &format!("xattr_block -> {other_head} (d1/bigx's head)"),
        |i| i.xattr_block = other_head,
    );
    c.extra_xattr = Some("d2/bigx".into());
}

// ---------------------------------------------------------------------------------------------
// Running one case

#[derive(Default, Debug)]
struct Outcome {
    /// Entries the walk verified (type, content or target, xattrs).
    checked: usize,
    /// Things the runtime refused (EIO, mount refused...): fsck must report damage then.
    refusals: Vec<String>,
    failures: Vec<String>,
    notes: Vec<String>,
}

fn apply(case: &Case, img: &Path, sb: &Superblock) {
    let f = fs::OpenOptions::new()
        .write(true)
        .open(img)
        .expect("open case image");
    for inj in &case.injects {
        match inj {
            Inject::Bytes { off, bytes } => f.write_all_at(bytes, *off).expect("inject"),
            Inject::Tx { slot, home, image } => {
                use cetrafs_core::dev::open::{open_lun, LunOptions};
                use cetrafs_core::journal::{write_tx, JournalArea};
                let lun = open_lun(
                    img,
                    &LunOptions {
                        read_only: false,
                        file_logical_block_size: Some(u32::try_from(LBS).expect("lbs")),
                        buffered_file_fallback: true,
                        ..LunOptions::default()
                    },
                )
                .expect("open case image as a LUN");
                write_tx(
                    &*lun.dev,
                    JournalArea::for_slot(sb, *slot),
                    77,
                    &[(*home, image.as_slice())],
                )
                .expect("write crafted transaction");
                lun.dev.flush().expect("flush");
            }
        }
    }
    f.sync_all().expect("sync");
}

fn classify_err(what: &str, e: &io::Error, out: &mut Outcome) {
    let n = errno_of(e);
    if n == libc::EIO {
        out.refusals.push(format!("{what}: EIO"));
    } else {
        out.refusals.push(format!("{what}: {}", errno_name(n)));
        out.failures.push(format!(
            "{what}: {} ({e}); a damaged structure must give EIO",
            errno_name(n)
        ));
    }
}

struct Expected<'a> {
    m: &'a Model,
    damaged: Option<u64>,
    content: HashMap<u64, Vec<u8>>,
}

impl Expected<'_> {
    fn check_content(&self, path: &str, ino: u64, got: &[u8], out: &mut Outcome) {
        let want = &self.content[&ino];
        if got == want.as_slice() {
            return;
        }
        let relaxed = self.damaged == Some(ino);
        if !relaxed && got.len() != want.len() {
            out.failures.push(format!(
                "read {path}: {} bytes, expected {}",
                got.len(),
                want.len()
            ));
        }
        let own: Vec<&[u8]> = want.chunks(BS).collect();
        let mut bad = 0;
        for (i, g) in got.chunks(BS).enumerate() {
            let w = want
                .get(i * BS..((i + 1) * BS).min(want.len()))
                .unwrap_or(&[]);
            if g == w {
                continue;
            }
            // A damaged inode may lose its blocks (zeros, holes) or map its own chunks
            // elsewhere, never show anything else.
            if relaxed
                && (g.iter().all(|&b| b == 0)
                    || own.iter().any(|o| o.starts_with(g) || g.starts_with(o)))
            {
                continue;
            }
            bad += 1;
            if bad <= 3 {
                out.refusals.push(format!("read {path}: wrong bytes"));
                out.failures.push(format!(
                    "read {path}: file block {i} holds {} (expected {}) - bytes of a block that is not the file's own",
                    describe_chunk(g),
                    describe_chunk(w)
                ));
            }
        }
        if bad > 3 {
            out.failures
                .push(format!("read {path}: {} more wrong blocks", bad - 3));
        }
    }
}

/// Walk the mount like `ls -lR`, `cat`, `readlink` and `getfattr` would, comparing with the model.
fn walk(root: &Path, exp: &Expected<'_>, out: &mut Outcome) {
    let m = exp.m;
    let mut stack = vec![String::new()];
    while let Some(dir) = stack.pop() {
        let dnode = m.node(&dir);
        let full = if dir.is_empty() {
            root.to_path_buf()
        } else {
            root.join(&dir)
        };
        let shown = if dir.is_empty() {
            "/".to_string()
        } else {
            dir.clone()
        };
        let mut listed = BTreeSet::new();
        let mut complete = true;
        match fs::read_dir(&full) {
            Err(e) => {
                classify_err(&format!("readdir {shown}"), &e, out);
                continue;
            }
            Ok(rd) => {
                for e in rd {
                    match e {
                        Ok(e) => {
                            listed.insert(e.file_name().to_string_lossy().into_owned());
                        }
                        Err(e) => {
                            classify_err(&format!("readdir {shown} (mid-listing)"), &e, out);
                            complete = false;
                            break;
                        }
                    }
                }
            }
        }
        if complete {
            let missing: Vec<&String> = dnode
                .children
                .keys()
                .filter(|n| !listed.contains(*n))
                .collect();
            if !missing.is_empty() {
                out.refusals
                    .push(format!("readdir {shown}: entries missing"));
                out.failures.push(format!(
                    "readdir {shown} succeeded without {} of its {} entries (e.g. {:?}): a damaged entry was silently hidden",
                    missing.len(),
                    dnode.children.len(),
                    missing.iter().take(3).collect::<Vec<_>>()
                ));
            }
        }
        let unknown: Vec<&String> = listed
            .iter()
            .filter(|n| !dnode.children.contains_key(*n))
            .collect();
        if !unknown.is_empty() {
            out.failures.push(format!(
                "readdir {shown} lists names that are not its own: {:?}",
                unknown.iter().take(3).collect::<Vec<_>>()
            ));
        }
        for (name, ino) in &dnode.children {
            if !listed.contains(name) {
                continue;
            }
            let rel = if dir.is_empty() {
                name.clone()
            } else {
                format!("{dir}/{name}")
            };
            let p = root.join(&rel);
            let node = &m.nodes[ino];
            let md = match fs::symlink_metadata(&p) {
                Ok(md) => md,
                Err(e) => {
                    classify_err(&format!("lstat {rel}"), &e, out);
                    continue;
                }
            };
            let ft = md.file_type();
            let kind_ok = match node.kind {
                Kind::Dir => ft.is_dir(),
                Kind::Reg => ft.is_file(),
                Kind::Symlink => ft.is_symlink(),
                Kind::Fifo => ft.is_fifo(),
            };
            if !kind_ok {
                if exp.damaged == Some(*ino) {
                    out.notes
                        .push(format!("lstat {rel}: type changed with its damaged inode"));
                    continue;
                }
                out.failures.push(format!(
                    "lstat {rel}: type {ft:?}, expected {:?}",
                    node.kind
                ));
                continue;
            }
            match node.kind {
                Kind::Dir => stack.push(rel.clone()),
                Kind::Reg => {
                    // Bounded: a damaged size may claim a terabyte.
                    let limit = exp.content[ino].len() as u64 + 2 * FS_BLOCK;
                    let r = File::open(&p).and_then(|f| {
                        let mut v = Vec::new();
                        f.take(limit).read_to_end(&mut v).map(|_| v)
                    });
                    match r {
                        Ok(v) => exp.check_content(&rel, *ino, &v, out),
                        Err(e) => classify_err(&format!("read {rel}"), &e, out),
                    }
                }
                Kind::Symlink => match fs::read_link(&p) {
                    Ok(t) => {
                        use std::os::unix::ffi::OsStrExt;
                        let t = t.as_os_str().as_bytes();
                        let want = node.content.as_slice();
                        // The target or an error, even for a damaged inode: a target cut
                        // short, padded, or continued with another link's overflow block
                        // names another path.
                        if t != want {
                            let n = t.len().min(want.len());
                            let at = t.iter().zip(want).position(|(a, b)| a != b).unwrap_or(n);
                            out.refusals.push(format!("readlink {rel}: wrong target"));
                            out.failures.push(format!(
                                "readlink {rel}: {} bytes, expected the model's {}; they differ from byte {at} ({:?}..): not the link's own target",
                                t.len(),
                                want.len(),
                                String::from_utf8_lossy(&t[at..t.len().min(at + 20)])
                            ));
                        }
                    }
                    Err(e) => classify_err(&format!("readlink {rel}"), &e, out),
                },
                Kind::Fifo => {}
            }
            out.checked += 1;
            check_xattrs(m, &p, &rel, node, out);
        }
    }
}

/// An inode's xattrs through the mount: the model's set, or an error (EIO); never another
/// inode's attributes, never garbage. When listing fails, each of the model's names is asked
/// for on its own too: getxattr must not serve what listxattr refused.
fn check_xattrs(m: &Model, p: &Path, rel: &str, node: &Node, out: &mut Outcome) {
    let whose = |name: &[u8], v: &[u8]| -> String {
        for o in m.nodes.values() {
            if o.ino != node.ino && o.xattrs.iter().any(|(_, ov)| ov.as_slice() == v) {
                return format!("the value of an attribute of '{}'", o.paths[0]);
            }
        }
        let want = node.xattrs.iter().find(|(n, _)| n.as_slice() == name);
        match want {
            Some((_, w)) if w.starts_with(v) || v.starts_with(w) => {
                format!("{} bytes of its own value, {} expected", v.len(), w.len())
            }
            Some(_) => format!("{} bytes of garbage", v.len()),
            None => "a name the model does not have".into(),
        }
    };
    match list_xattrs(p) {
        Ok(x) if x == node.xattrs => {}
        Ok(x) => {
            let mut diffs = Vec::new();
            for (n, v) in &x {
                if !node.xattrs.iter().any(|(wn, wv)| wn == n && wv == v) {
                    diffs.push(format!("{}: {}", String::from_utf8_lossy(n), whose(n, v)));
                }
            }
            for (n, _) in &node.xattrs {
                if !x.iter().any(|(gn, _)| gn == n) {
                    diffs.push(format!("{}: missing", String::from_utf8_lossy(n)));
                }
            }
            out.refusals
                .push(format!("getxattr {rel}: wrong attributes"));
            out.failures.push(format!(
                "getxattr {rel}: not the model's {} attributes: {}",
                node.xattrs.len(),
                diffs.join("; ")
            ));
        }
        Err(e) => {
            classify_err(&format!("listxattr/getxattr {rel}"), &e, out);
            for (n, w) in &node.xattrs {
                let name = String::from_utf8_lossy(n);
                match get_xattr(p, n) {
                    Ok(v) if v == *w => {}
                    Ok(v) => out.failures.push(format!(
                        "getxattr {rel} {name}: {} after listxattr failed",
                        whose(n, &v)
                    )),
                    Err(e) => classify_err(&format!("getxattr {rel} {name}"), &e, out),
                }
            }
        }
    }
}

struct Write {
    path: String,
    offset: u64,
    data: Vec<u8>,
    /// Some: a setxattr of `data` under this name instead of a data write.
    xattr: Option<&'static [u8]>,
}

fn writes_for(case: &Case) -> Vec<Write> {
    let mut w = vec![
        // overwrite inside a written extent (data path, no allocation)
        Write {
            path: "big".into(),
            offset: 2 * FS_BLOCK,
            data: chunk_pattern("W:big", 2),
            xattr: None,
        },
        // append (allocating)
        Write {
            path: "d1/small".into(),
            offset: 1500,
            data: small_content("W:d1/small", 5000),
            xattr: None,
        },
        // fill a hole (allocating)
        Write {
            path: "sparse".into(),
            offset: 64 * FS_BLOCK,
            data: chunk_pattern("W:sparse", 64),
            xattr: None,
        },
    ];
    if let Some((p, o)) = &case.extra_write {
        w.push(Write {
            path: p.clone(),
            offset: *o,
            data: chunk_pattern(&format!("W:{p}"), o / FS_BLOCK),
            xattr: None,
        });
    }
    if let Some(p) = &case.extra_xattr {
        w.push(Write {
            path: p.clone(),
            offset: 0,
            data: small_content(&format!("W:xattr {p}"), 100),
            xattr: Some(b"user.new"),
        });
    }
    w
}

fn do_writes(root: &Path, writes: &[Write], out: &mut Outcome) {
    for w in writes {
        let p = root.join(&w.path);
        if let Some(name) = w.xattr {
            let what = format!(
                "setxattr {} ({} bytes) on {}",
                String::from_utf8_lossy(name),
                w.data.len(),
                w.path
            );
            match set_xattr(&p, name, &w.data, 0) {
                Err(e) => classify_write_err(&what, &e, out),
                Ok(()) => match get_xattr(&p, name) {
                    Ok(v) if v == w.data => {}
                    Ok(v) => out.failures.push(format!(
                        "{what}: reads back as {} bytes that are not the value set",
                        v.len()
                    )),
                    Err(e) => classify_err(&format!("getxattr after {what}"), &e, out),
                },
            }
            continue;
        }
        let what = format!("write {} bytes at {} of {}", w.data.len(), w.offset, w.path);
        let f = match fs::OpenOptions::new().read(true).write(true).open(&p) {
            Ok(f) => f,
            Err(e) => {
                classify_write_err(&format!("open {} for writing", w.path), &e, out);
                continue;
            }
        };
        if let Err(e) = f.write_all_at(&w.data, w.offset) {
            classify_write_err(&what, &e, out);
            continue;
        }
        if let Err(e) = f.sync_all() {
            classify_write_err(&format!("fsync {}", w.path), &e, out);
            continue;
        }
        let mut back = vec![0u8; w.data.len()];
        match f.read_exact_at(&mut back, w.offset) {
            Ok(()) if back == w.data => {}
            Ok(()) => out.failures.push(format!(
                "{what}: fsync'd data reads back as {}",
                describe_chunk(&back[..back.len().min(BS)])
            )),
            Err(e) => classify_err(&format!("read back {}", w.path), &e, out),
        }
    }
}

fn classify_write_err(what: &str, e: &io::Error, out: &mut Outcome) {
    let n = errno_of(e);
    // Refusals a damaged volume may give: EIO, a stale open lock (EBUSY), no space.
    if [libc::EIO, libc::EBUSY, libc::ENOSPC, libc::EROFS].contains(&n) {
        out.refusals.push(format!("{what}: {}", errno_name(n)));
    } else {
        classify_err(what, e, out);
    }
}

/// Blocks legitimately changed by a mount that wrote `written` files: see the module docs and
/// docs/format.md §1 ("What the mount path reads and writes in each region") and §11.
fn check_writes(
    m: &Model,
    injected: &Path,
    fin: &Path,
    written: &BTreeSet<u64>,
    out: &mut Outcome,
) {
    let sb = &m.sb;
    let a = File::open(injected).expect("open injected copy");
    let z = File::open(fin).expect("open final image");
    let total = sb.total_blocks;
    let lbs = usize::try_from(LBS).unwrap();
    let per = BS / lbs;
    let hb_rec = |f: &File, s: u64| read_bytes(f, sb.hb_start * FS_BLOCK + s * LBS, lbs);
    let claimed: BTreeSet<u64> = (0..u64::from(sb.max_nodes))
        .filter(|&s| hb_rec(&a, s) != hb_rec(&z, s))
        .collect();
    let jend = sb.journal_start + sb.journal_blocks * u64::from(sb.max_nodes);
    let gend = sb.group_start + sb.group_count * sb.group_blocks;
    let bucket0 = sb.lock_count - u64::from(sb.inode_lock_slots);
    let is_written_own = |b: u64| m.owner.get(&b).is_some_and(|(o, _)| written.contains(o));
    // Free in the injected bitmap = the runtime may allocate it.
    let mut free_at_mount: HashMap<u64, Option<Vec<u8>>> = HashMap::new();
    let mut bitmap_of = |g: u64| -> Option<Vec<u8>> {
        free_at_mount
            .entry(g)
            .or_insert_with(|| {
                let mut v = Vec::new();
                for i in 0..u64::from(sb.bitmap_blocks) {
                    let b = sb.group_first_block(g) + 1 + i;
                    let raw = read_block(&a, b);
                    v.extend_from_slice(decode_bitmap(&raw, b).ok()?.1);
                }
                Some(v)
            })
            .clone()
    };
    let mut bad: Vec<String> = Vec::new();
    let chunk = 256u64; // blocks per comparison read
    let mut b0 = 0;
    while b0 < total {
        let n = chunk.min(total - b0);
        let len = usize::try_from(n).expect("n") * BS;
        let ra = read_bytes(&a, b0 * FS_BLOCK, len);
        let rz = read_bytes(&z, b0 * FS_BLOCK, len);
        if ra != rz {
            for i in 0..usize::try_from(n).expect("n") {
                let (ba, bz) = (&ra[i * BS..(i + 1) * BS], &rz[i * BS..(i + 1) * BS]);
                if ba == bz {
                    continue;
                }
                let b = b0 + i as u64;
                let changed_records = |area_start: u64| {
                    (0..per)
                        .filter(|&r| ba[r * lbs..(r + 1) * lbs] != bz[r * lbs..(r + 1) * lbs])
                        .map(move |r| ((b - area_start) * per as u64 + r as u64, r))
                };
                let verdict: Option<String> = if b >= sb.hb_start && b < sb.hb_start + sb.hb_blocks
                {
                    // Only records 0..max_nodes are ever claimed, and a claim writes a record.
                    changed_records(sb.hb_start).find_map(|(s, r)| {
                        if s >= u64::from(sb.max_nodes) {
                            Some(format!(
                                "heartbeat record {s} (no node can claim it) changed"
                            ))
                        } else {
                            Heartbeat::decode(&bz[r * lbs..(r + 1) * lbs])
                                .err()
                                .map(|_| {
                                    format!(
                                        "heartbeat record {s} overwritten with {}",
                                        describe_chunk(bz)
                                    )
                                })
                        }
                    })
                } else if b >= sb.lock_start && b < sb.lock_start + sb.lock_blocks {
                    // Record 0, the group records and the buckets change by CAW, always to a
                    // valid record; the unused records between groups and buckets never.
                    changed_records(sb.lock_start).find_map(|(i, r)| {
                        if i <= sb.group_count || (i >= bucket0 && i < sb.lock_count) {
                            LockRecord::decode(&bz[r * lbs..(r + 1) * lbs], i)
                                .err()
                                .map(|_| {
                                    format!(
                                        "lock record {i} overwritten with {}",
                                        describe_chunk(bz)
                                    )
                                })
                        } else {
                            Some(format!("lock record {i} (unused) changed"))
                        }
                    })
                } else if b >= sb.objlock_start && b < sb.objlock_start + sb.objlock_blocks() {
                    // Format v3: buckets change by CAW, always to a valid bucket of their index.
                    changed_records(sb.objlock_start).find_map(|(i, r)| {
                        let raw = &bz[r * lbs..(r + 1) * lbs];
                        if i >= sb.objlock_buckets {
                            Some(format!("object-lock area past bucket {i} changed"))
                        } else {
                            Bucket::decode(raw, i).err().map(|_| {
                                format!(
                                    "object-lock bucket {i} overwritten with {}",
                                    describe_chunk(bz)
                                )
                            })
                        }
                    })
                } else if b >= sb.mailbox_start && b < sb.mailbox_start + sb.mailbox_blocks() {
                    // Mailboxes too, each a valid mailbox of its slot.
                    changed_records(sb.mailbox_start).find_map(|(s, r)| {
                        let raw = &bz[r * lbs..(r + 1) * lbs];
                        match u32::try_from(s) {
                            Ok(slot) if slot < sb.hb_slots => {
                                Mailbox::decode(raw, slot).err().map(|_| {
                                    format!(
                                        "mailbox of slot {s} overwritten with {}",
                                        describe_chunk(bz)
                                    )
                                })
                            }
                            _ => Some(format!("mailbox area past mailbox {s} changed")),
                        }
                    })
                } else if b >= sb.journal_start && b < jend {
                    // A claimed (or recovered) slot's journal: slot header, descriptors, logged
                    // metadata images, commit blocks, or zeros (invalidation). Never file data.
                    let s = (b - sb.journal_start) / sb.journal_blocks;
                    if !claimed.contains(&s) {
                        Some(format!("journal of slot {s}, whose heartbeat did not change, changed (block {b})"))
                    } else if !bz.iter().all(|&x| x == 0) && BlockHeader::decode(bz).is_err() {
                        Some(format!(
                            "journal block {b} of slot {s} overwritten with {}",
                            describe_chunk(bz)
                        ))
                    } else {
                        None
                    }
                } else if b >= sb.group_start && b < gend {
                    let g = (b - sb.group_start) / sb.group_blocks;
                    let o = (b - sb.group_start) % sb.group_blocks;
                    if o == 0 {
                        match GroupHeader::decode(bz, b) {
                            Ok(h) if h.index == g => None,
                            _ => Some(format!(
                                "group {g} header overwritten with {}",
                                describe_chunk(bz)
                            )),
                        }
                    } else if o <= u64::from(sb.bitmap_blocks) {
                        decode_bitmap(bz, b).err().map(|_| {
                            format!("group {g} bitmap overwritten with {}", describe_chunk(bz))
                        })
                    } else if is_written_own(b) {
                        None
                    } else if let Some((ino, Role::Inode)) = m.owner.get(&b) {
                        // atime and the like: an inode may be rewritten as itself.
                        match (Inode::decode(ba, *ino), Inode::decode(bz, *ino)) {
                            (Ok(mut x), Ok(y)) => {
                                x.atime = y.atime;
                                x.ctime = y.ctime;
                                x.seq = y.seq;
                                (x != y).then(|| format!("inode {ino} ('{}'), not written to, changed beyond its times", m.nodes[ino].paths[0]))
                            }
                            (Err(_), _) => Some(format!(
                                "damaged inode block {b} ('{}') rewritten",
                                m.nodes[ino].paths[0]
                            )),
                            (_, Err(_)) => Some(format!(
                                "inode block {b} ('{}') overwritten with {}",
                                m.nodes[ino].paths[0],
                                describe_chunk(bz)
                            )),
                        }
                    } else if m.owner.contains_key(&b) {
                        Some(format!(
                            "{} overwritten with {}",
                            m.describe_block(b),
                            describe_chunk(bz)
                        ))
                    } else {
                        let off = usize::try_from(o).expect("bit");
                        match bitmap_of(g) {
                            Some(bits) if bits[off / 8] & (1 << (off % 8)) == 0 => None,
                            _ => Some(format!("block {b}, used in the bitmap at mount but not the written files' own, overwritten with {}", describe_chunk(bz))),
                        }
                    }
                } else {
                    Some(format!(
                        "{} overwritten with {}",
                        m.describe_block(b),
                        describe_chunk(bz)
                    ))
                };
                if let Some(v) = verdict {
                    bad.push(v);
                }
            }
        }
        b0 += n;
    }
    // No block may be freed but the written files' own.
    for g in 0..sb.group_count {
        let Some(before) = bitmap_of(g) else { continue };
        let mut after = Vec::new();
        for i in 0..u64::from(sb.bitmap_blocks) {
            let b = sb.group_first_block(g) + 1 + i;
            match decode_bitmap(&read_block(&z, b), b) {
                Ok((_, bits)) => after.extend_from_slice(bits),
                Err(_) => after.clear(),
            }
        }
        if after.len() != before.len() {
            continue;
        }
        for bit in 0..usize::try_from(sb.group_blocks).expect("group") {
            let used = |v: &[u8]| v[bit / 8] & (1 << (bit % 8)) != 0;
            let blk = sb.group_first_block(g) + bit as u64;
            if used(&before) && !used(&after) && !is_written_own(blk) {
                bad.push(format!("{} freed", m.describe_block(blk)));
            }
        }
    }
    if !bad.is_empty() {
        let n = bad.len();
        bad.truncate(5);
        out.failures.push(format!(
            "after the writes and unmount, {n} change(s) of the LUN outside what the mount may change: {}",
            bad.join("; ")
        ));
    }
}

struct Ctx<'a> {
    m: &'a Model,
    pristine: &'a Path,
    dir: &'a Path,
}

fn run_case(ctx: &Ctx<'_>, case: &Case) -> (Outcome, Duration) {
    let started = Instant::now();
    let m = ctx.m;
    let mut out = Outcome::default();
    let img = ctx.dir.join(format!("{}.img", case.name));
    let injected = ctx.dir.join(format!("{}.injected.img", case.name));
    sparse_copy(ctx.pristine, &img);
    apply(case, &img, &m.sb);
    sparse_copy(&img, &injected);

    // 1. fsck -n
    let fsck = run_timeout(
        Command::new(bin("fsck-cetra")).arg("-n").arg(&img),
        FSCK_BOUND,
    );
    let fsck_out = fsck
        .as_ref()
        .map(cetrafs_tests::CmdResult::output)
        .unwrap_or_default();
    let fsck_code = match &fsck {
        None => {
            out.failures.push(format!(
                "fsck.cetra -n did not finish within {FSCK_BOUND:?}"
            ));
            None
        }
        Some(r) => {
            if ![0, 4, 8].contains(&r.code) {
                out.failures.push(format!(
                    "fsck.cetra -n exited {} (not 0, 4 or 8): {}",
                    r.code,
                    r.output().trim()
                ));
            }
            if r.output().contains("panicked") {
                out.failures
                    .push(format!("fsck.cetra panicked: {}", r.output().trim()));
            }
            Some(r.code)
        }
    };

    // 2. mount
    let mp = ctx.dir.join(format!("mnt-{}", case.name));
    let t0 = Instant::now();
    let mounted = Mount::try_new_within(&img, &mp, HOST, &[], &[], Some(MOUNT_BOUND));
    let mount_time = t0.elapsed();
    match mounted {
        Err(r) => {
            let own = r.own_stderr();
            if r.code == -1 {
                out.refusals.push(format!("mount hung (> {MOUNT_BOUND:?})"));
                out.failures.push(format!(
                    "mount did not come up nor fail within {MOUNT_BOUND:?}"
                ));
            } else {
                out.refusals
                    .push(format!("mount refused (exit {}): {own}", r.code));
                if own.is_empty() {
                    out.failures.push(format!(
                        "mount refused with exit {} and no error message",
                        r.code
                    ));
                }
                if case.expect == Expect::MustMount {
                    out.failures.push(format!("mount refused after {:.1}s ({own}), but the volume has what it needs to mount", mount_time.as_secs_f64()));
                }
            }
            if r.output().contains("panicked") {
                out.failures.push("mount-cetra panicked".into());
            }
            // A refused mount may still have replayed or scrubbed something: same rules.
            check_writes(m, &injected, &img, &BTreeSet::new(), &mut out);
        }
        Ok(mut mnt) => {
            // The damage is reported at ERROR level on purpose (an admin must run fsck); the
            // no-ERROR rule is for undamaged volumes. Panics are still failures (below).
            mnt.allow_error("ERROR ");
            if case.expect == Expect::MustMount && mount_time > Duration::from_secs(10) {
                out.notes
                    .push(format!("mount took {:.1}s", mount_time.as_secs_f64()));
            }
            // 3 + 4: walk and writes in a thread, bounded: a daemon stuck on a lock must not
            // hang the test.
            let root = mnt.path().to_path_buf();
            let mut content: HashMap<u64, Vec<u8>> = m
                .nodes
                .iter()
                .filter(|(_, n)| n.kind == Kind::Reg)
                .map(|(i, n)| (*i, n.content.clone()))
                .collect();
            for (ino, off, bytes) in &case.data_override {
                let c = content.get_mut(ino).expect("override of a file");
                let o = usize::try_from(*off).expect("off");
                let end = (o + bytes.len()).min(c.len());
                c[o..end].copy_from_slice(&bytes[..end - o]);
            }
            let writes = writes_for(case);
            let written: BTreeSet<u64> = writes.iter().map(|w| m.ino(&w.path)).collect();
            let (tx, rx) = mpsc::channel();
            std::thread::scope(|s| {
                let root = &root;
                let content = content;
                let writes = &writes;
                s.spawn(move || {
                    let exp = Expected {
                        m,
                        damaged: case.damaged,
                        content,
                    };
                    let mut o = Outcome::default();
                    walk(root, &exp, &mut o);
                    do_writes(root, writes, &mut o);
                    let _ = tx.send(o);
                });
                if let Ok(o) = rx.recv_timeout(OPS_BOUND) {
                    out.checked = o.checked;
                    out.refusals.extend(o.refusals);
                    out.failures.extend(o.failures);
                    out.notes.extend(o.notes);
                } else {
                    out.refusals.push("operations hung".into());
                    out.failures.push(format!(
                        "walk + writes did not finish within {OPS_BOUND:?} (daemon killed)"
                    ));
                    let _ = mnt.signal(libc::SIGKILL);
                }
            });
            // the scope joined the worker: after a SIGKILL its calls failed with ENOTCONN.
            let log = mnt.log();
            if log.contains("panicked") {
                let line = log
                    .lines()
                    .find(|l| l.contains("panicked"))
                    .unwrap_or("")
                    .to_string();
                out.failures.push(format!("daemon panicked: {line}"));
            }
            match mnt.unmount_any_status() {
                Ok(Exit::Code(0) | Exit::Unknown) => {}
                Ok(Exit::Code(c)) => out.refusals.push(format!("daemon exited {c} at unmount")),
                Ok(Exit::Signal(sig)) => {
                    if !out.refusals.iter().any(|r| r == "operations hung") {
                        out.failures.push(format!("daemon died of signal {sig}"));
                    }
                }
                Err(e) => out
                    .failures
                    .push(format!("unmount: {}", e.lines().next().unwrap_or(""))),
            }
            check_writes(m, &injected, &img, &written, &mut out);
        }
    }
    // A cross-link: reads and writes through it are the one thing the runtime cannot refuse;
    // fsck must name the block as held twice, and nothing else may have gone wrong.
    if let Some(target) = case.cross_link {
        let through = |f: &String| {
            f.contains("not the file's own")
                || (f.contains("outside what the mount may change")
                    && f.starts_with("after the writes and unmount, 1 change"))
        };
        let (tolerated, other): (Vec<String>, Vec<String>) =
            out.failures.drain(..).partition(|f| through(f));
        out.failures = other;
        out.notes.extend(
            tolerated
                .into_iter()
                .map(|f| format!("cross-link (fsck's to report): {f}")),
        );
        let named = fsck_out.contains("already held by") && fsck_out.contains(&target.to_string());
        if fsck_code != Some(4) || !named {
            out.failures.push(format!(
                "fsck.cetra -n (exit {fsck_code:?}) does not report block {target} as held twice"
            ));
        }
    }
    // 6. every refusal must be something fsck reports
    if fsck_code == Some(0) && !out.refusals.is_empty() {
        out.failures.push(format!(
            "fsck.cetra -n calls the volume clean (exit 0) but the runtime refused: {}",
            out.refusals
                .iter()
                .take(3)
                .cloned()
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    if out.failures.is_empty() || std::env::var_os("CETRA_CORRUPT_KEEP").is_none() {
        let _ = fs::remove_file(&img);
        let _ = fs::remove_file(&injected);
    }
    let _ = fs::remove_dir(&mp);
    (out, started.elapsed())
}

fn shorten(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let t: String = s.chars().take(n).collect();
        format!("{t}…")
    }
}

#[test]
fn corruption_campaign() {
    cetrafs_tests::require_fuse!();
    let t_all = Instant::now();
    let lun = Lun::new(LUN_SIZE);
    lun.mkfs(&[
        "-q",
        "-N",
        "2",
        "--journal-size",
        "1M",
        "--group-size",
        "16M",
        "--heartbeat-interval",
        "100",
        "--io-timeout",
        "500",
        "-L",
        "corrupt",
    ]);
    let m = Mount::new(&lun, HOST);
    populate(&m);
    let seen = capture(m.path());
    m.unmount();
    lun.assert_fsck_clean();
    let pristine = lun.dir().join("pristine.img");
    sparse_copy(lun.path(), &pristine);
    let model = decode_model(&pristine, &seen);
    eprintln!(
        "corruption: populated {} paths, {} inodes, {} owned blocks; groups of {} blocks from {}; journal {} blocks",
        model.by_path.len(),
        model.nodes.len(),
        model.owner.len(),
        model.sb.group_blocks,
        model.sb.group_start,
        model.sb.journal_blocks
    );
    let random = std::env::var("CETRA_CORRUPT_RANDOM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0usize);
    let seed = if random > 0 {
        cetrafs_tests::seed("corruption")
    } else {
        0
    };
    let mut cases = build_cases(&model, &pristine, seed, random);
    let all = std::env::var("CETRA_CORRUPT_ALL").is_ok_and(|v| v == "1");
    for e in EXTENDED {
        assert!(
            cases.iter().any(|c| c.name == *e),
            "EXTENDED names unknown case {e}"
        );
    }
    let only = std::env::var("CETRA_CORRUPT_ONLY").ok();
    if !all && only.is_none() {
        cases.retain(|c| !EXTENDED.contains(&c.name.as_str()));
    }
    if let Some(only) = only {
        let pats: Vec<&str> = only.split(',').filter(|s| !s.is_empty()).collect();
        cases.retain(|c| c.name == "baseline" || pats.iter().any(|p| c.name.contains(p)));
    }
    let ctx = Ctx {
        m: &model,
        pristine: &pristine,
        dir: lun.dir(),
    };
    let mut table = String::new();
    let mut failed: Vec<(Case, Outcome)> = Vec::new();
    let mut baseline_checked = 0;
    let _ = writeln!(table, "{:<36} {:<15} {:>6}  result", "case", "area", "secs");
    for case in &cases {
        let (out, took) = run_case(&ctx, case);
        if case.name == "baseline" {
            baseline_checked = out.checked;
        }
        let verdict = if out.failures.is_empty() {
            if out.refusals.is_empty() {
                "ok".to_string()
            } else {
                format!("ok (refused: {})", shorten(&out.refusals[0], 60))
            }
        } else {
            format!("FAIL ({})", out.failures.len())
        };
        let line = format!(
            "{:<36} {:<15} {:>6.1}  {verdict}",
            case.name,
            shorten(&case.area, 15),
            took.as_secs_f64()
        );
        eprintln!("{line}");
        let _ = writeln!(table, "{line}");
        if !out.failures.is_empty() {
            failed.push((case.clone(), out));
        }
    }
    eprintln!(
        "corruption: {} cases in {:.0}s",
        cases.len(),
        t_all.elapsed().as_secs_f64()
    );
    assert_eq!(
        baseline_checked,
        model.by_path.len() - 1,
        "the control case must verify every path of the model"
    );
    if let Some((_, base)) = failed.iter().find(|(c, _)| c.name == "baseline") {
        panic!(
            "the undamaged control case fails, so the checks themselves are wrong: {:#?}",
            base.failures
        );
    }
    if !failed.is_empty() {
        let mut msg = format!(
            "\n{table}\n{} of {} corruption cases failed:\n",
            failed.len(),
            cases.len()
        );
        for (c, o) in &failed {
            let _ = writeln!(msg, "\n* {} [{}] {}", c.name, c.area, c.change);
            for f in &o.failures {
                let _ = writeln!(msg, "    - {f}");
            }
        }
        panic!("{msg}");
    }
}
