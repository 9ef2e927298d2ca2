//! Extended attributes: an inode's xattrs are one *set*, encoded as a stream of entries sorted
//! by name and stored from the inode's xattr block (the *head*) on. Which layout a volume uses
//! is fixed by its superblock ([`Layout::of`]):
//!
//! * **v1** (format version 1): the whole set lives in the head block (as ext4 limits it to
//!   one block): at most 4048 bytes of entries, value lengths are u16.
//! * **v2** (`INCOMPAT_OVERFLOW`): values up to 64 KiB (`XATTR_SIZE_MAX`, u32 lengths), and a
//!   set larger than the head continues in up to [`MAX_MORE`] overflow blocks
//!   (`format/overflow.rs`, role `XattrSet`) whose numbers the head lists. A set that fits one
//!   block (ACLs, a few small attributes: the common case) is still one block, one read.
//!
//! ```text
//! head:
//!  0  40 block header (type Xattr, owner = inode)
//! 40   2 count (attributes in the whole set)
//! 42   2 v1: reserved (zero) | v2: more = overflow blocks of the set (0 ..= 31)
//! 44   4 used: bytes of the entry stream (whole set)
//! 48   8 × more: the overflow blocks, in stream order (v2)
//! 48 + 8 × more ... the start of the stream, up to the end of the block
//! overflow block i (1 ..= more): index i, the next min(rest, 4048) bytes of the stream
//! entry: u8 name length | v1: u16, v2: u32 value length | name | value
//! ```
//! `more` is always the smallest count that holds `used` bytes, so a set has one encoding.

use super::block::{BlockHeader, BlockType};
use super::codec::{Reader, Writer};
use super::overflow::{Overflow, Role, OVERFLOW_CAP};
use super::superblock::{Superblock, INCOMPAT_OVERFLOW};
use super::FS_BLOCK_SIZE;
use crate::error::{Error, Result};

pub const XATTR_HDR: usize = 48;
/// Stream bytes a head without overflow pointers holds.
pub const XATTR_CAP: usize = FS_BLOCK_SIZE - XATTR_HDR;
/// Most overflow blocks one set may have (v2): 32 blocks in all.
pub const MAX_MORE: usize = 31;
/// Linux's `XATTR_SIZE_MAX`: the largest value (v2).
pub const XATTR_SIZE_MAX: usize = 65536;
/// Linux's `XATTR_LIST_MAX`: the largest listxattr reply (names, each NUL-terminated).
pub const XATTR_LIST_MAX: usize = 65536;
const PTR: usize = 8;

pub type XattrMap = std::collections::BTreeMap<Vec<u8>, Vec<u8>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    V1,
    V2,
}

impl Layout {
    pub fn of(sb: &Superblock) -> Self {
        if sb.incompat & INCOMPAT_OVERFLOW != 0 {
            Self::V2
        } else {
            Self::V1
        }
    }

    fn value_len_bytes(self) -> usize {
        match self {
            Self::V1 => 2,
            Self::V2 => 4,
        }
    }

    /// Most stream bytes one set may hold: 4048 (v1), 129,288 (v2).
    pub fn capacity(self) -> usize {
        match self {
            Self::V1 => XATTR_CAP,
            Self::V2 => stream_capacity(MAX_MORE),
        }
    }

    /// The largest value this layout can store in a set of its own.
    pub fn max_value(self) -> usize {
        match self {
            Self::V1 => XATTR_CAP - 1 - 3,
            Self::V2 => XATTR_SIZE_MAX,
        }
    }

    /// Encoded size of one entry.
    pub fn entry_len(self, name: &[u8], value: &[u8]) -> usize {
        1 + self.value_len_bytes() + name.len() + value.len()
    }
}

/// Stream bytes a head with `more` overflow blocks, and those blocks, hold.
fn stream_capacity(more: usize) -> usize {
    head_cap(more) + more * OVERFLOW_CAP
}

/// Stream bytes in the head itself when it lists `more` overflow blocks.
fn head_cap(more: usize) -> usize {
    XATTR_CAP - PTR * more
}

pub fn encoded_len(map: &XattrMap, layout: Layout) -> usize {
    map.iter().map(|(k, v)| layout.entry_len(k, v)).sum()
}

/// Bytes of the listxattr reply for `map` (names, each NUL-terminated).
pub fn names_len(map: &XattrMap) -> usize {
    map.keys().map(|k| k.len() + 1).sum()
}

/// Overflow blocks a set of `used` stream bytes needs (the smallest count that holds it).
pub fn overflow_count(used: usize) -> usize {
    if used <= XATTR_CAP {
        0
    } else {
        (used - XATTR_CAP).div_ceil(OVERFLOW_CAP - PTR)
    }
}

fn encode_stream(map: &XattrMap, layout: Layout) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_len(map, layout));
    for (k, v) in map {
        #[allow(clippy::cast_possible_truncation)] // names <= 255, values bounded by the layout
        {
            out.push(k.len() as u8);
            match layout {
                Layout::V1 => out.extend_from_slice(&(v.len() as u16).to_le_bytes()),
                Layout::V2 => out.extend_from_slice(&(v.len() as u32).to_le_bytes()),
            }
        }
        out.extend_from_slice(k);
        out.extend_from_slice(v);
    }
    out
}

fn decode_stream(s: &[u8], count: usize, layout: Layout, at: u64) -> Result<XattrMap> {
    let bad = |m: &str| Error::corrupted(format!("xattr block {at}: {m}"));
    let r = Reader::new(s, "xattr set");
    let mut map = XattrMap::new();
    let mut o = 0;
    for _ in 0..count {
        let kl = r.u8(o)? as usize;
        let (vl, vlb) = match layout {
            Layout::V1 => (r.u16(o + 1)? as usize, 2),
            Layout::V2 => (r.u32(o + 1)? as usize, 4),
        };
        if vl > layout.max_value() {
            return Err(bad(&format!("value of {vl} bytes")));
        }
        let k = r.bytes(o + 1 + vlb, kl)?.to_vec();
        let v = r.bytes(o + 1 + vlb + kl, vl)?.to_vec();
        if kl == 0 || map.insert(k, v).is_some() {
            return Err(bad("empty or duplicate name"));
        }
        o += 1 + vlb + kl + vl;
    }
    if o != s.len() {
        return Err(bad("sizes do not add up"));
    }
    Ok(map)
}

/// Encode `map` as its head at `head = (block, seq)` and one overflow block per entry of
/// `more` (block, seq), in order; `more.len()` must be `overflow_count` of the encoded size
/// (the caller allocates them). Returns every block to write, the head first.
pub fn encode_set(
    map: &XattrMap,
    layout: Layout,
    head: (u64, u64),
    more: &[(u64, u64)],
    owner: u64,
) -> Vec<(u64, Vec<u8>)> {
    let stream = encode_stream(map, layout);
    assert!(stream.len() <= layout.capacity());
    assert_eq!(more.len(), overflow_count(stream.len()));
    assert!(layout == Layout::V2 || more.is_empty());
    let mut b = vec![0u8; FS_BLOCK_SIZE];
    let mut w = Writer::new(&mut b);
    let first = stream.len().min(head_cap(more.len()));
    #[allow(clippy::cast_possible_truncation)] // bounded by the capacity, asserted above
    {
        w.u16(40, map.len() as u16);
        w.u16(42, more.len() as u16);
        w.u32(44, stream.len() as u32);
    }
    for (i, (m, _)) in more.iter().enumerate() {
        w.u64(XATTR_HDR + PTR * i, *m);
    }
    w.bytes(XATTR_HDR + PTR * more.len(), &stream[..first]);
    BlockHeader {
        btype: BlockType::Xattr,
        blockno: head.0,
        seq: head.1,
        owner,
    }
    .seal(&mut b);
    let mut out = vec![(head.0, b)];
    let mut rest = &stream[first..];
    for (i, &(m, seq)) in more.iter().enumerate() {
        let (part, tail) = rest.split_at(rest.len().min(OVERFLOW_CAP));
        rest = tail;
        #[allow(clippy::cast_possible_truncation)] // i < MAX_MORE
        let o = Overflow {
            blockno: m,
            seq,
            owner,
            role: Role::XattrSet,
            index: i as u16 + 1,
            payload: part.to_vec(),
        };
        out.push((m, o.encode()));
    }
    out
}

/// A decoded head: what it says about its set, and the stream bytes it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub blockno: u64,
    pub seq: u64,
    pub owner: u64,
    count: usize,
    used: usize,
    /// The set's overflow blocks, in stream order.
    pub more: Vec<u64>,
    first: Vec<u8>,
}

impl Head {
    pub fn decode(buf: &[u8], at: u64, layout: Layout) -> Result<Self> {
        let h = BlockHeader::check(buf, BlockType::Xattr, at)?;
        let r = Reader::new(buf, "xattr block");
        let bad = |m: String| Error::corrupted(format!("xattr block {at}: {m}"));
        let count = r.u16(40)? as usize;
        let used = r.u32(44)? as usize;
        if used > layout.capacity() {
            return Err(bad(format!("{used} bytes of entries")));
        }
        let n = match layout {
            Layout::V1 => 0,
            Layout::V2 => r.u16(42)? as usize,
        };
        if n != overflow_count(used) {
            return Err(bad(format!(
                "{n} overflow blocks for {used} bytes of entries"
            )));
        }
        let mut more = Vec::with_capacity(n);
        for i in 0..n {
            let m = r.u64(XATTR_HDR + PTR * i)?;
            if m == 0 || m == at || more.contains(&m) {
                return Err(bad(format!("overflow pointer {i} ({m}) is invalid")));
            }
            more.push(m);
        }
        let first = r
            .bytes(XATTR_HDR + PTR * n, used.min(head_cap(n)))?
            .to_vec();
        Ok(Self {
            blockno: at,
            seq: h.seq,
            owner: h.owner,
            count,
            used,
            more,
            first,
        })
    }

    /// Payload bytes overflow block `i` (0-based in `more`) must hold.
    fn part_len(&self, i: usize) -> usize {
        let before = head_cap(self.more.len()) + i * OVERFLOW_CAP;
        self.used.saturating_sub(before).min(OVERFLOW_CAP)
    }

    /// The set, from this head and its decoded overflow blocks (`parts[i]` read from
    /// `more[i]`; the caller checked their owner). Checks each part's role, index and length,
    /// then decodes the entries.
    pub fn assemble(&self, parts: &[Overflow], layout: Layout) -> Result<XattrMap> {
        if parts.len() != self.more.len() {
            return Err(Error::corrupted(format!(
                "xattr block {}: {} of its {} overflow blocks given",
                self.blockno,
                parts.len(),
                self.more.len()
            )));
        }
        let mut stream = self.first.clone();
        for (i, p) in parts.iter().enumerate() {
            #[allow(clippy::cast_possible_truncation)] // i < MAX_MORE
            p.expect(Role::XattrSet, i as u16 + 1, self.part_len(i))
                .map_err(|e| e.wrap(format!("xattr block {}", self.blockno)))?;
            stream.extend_from_slice(&p.payload);
        }
        decode_stream(&stream, self.count, layout, self.blockno)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip_set(m: &XattrMap, layout: Layout) -> Result<XattrMap> {
        let more: Vec<(u64, u64)> = (0..overflow_count(encoded_len(m, layout)))
            .map(|i| (1000 + i as u64 * 3, 7))
            .collect();
        let blocks = encode_set(m, layout, (77, 3), &more, 5);
        let h = Head::decode(&blocks[0].1, 77, layout)?;
        assert_eq!(
            (h.seq, h.owner, &h.more),
            (3, 5, &more.iter().map(|x| x.0).collect::<Vec<_>>())
        );
        let parts = blocks[1..]
            .iter()
            .map(|(b, raw)| Overflow::decode(raw, *b))
            .collect::<Result<Vec<_>>>()?;
        h.assemble(&parts, layout)
    }

    proptest! {
        #[test]
        fn roundtrip_v1(m in proptest::collection::btree_map(proptest::collection::vec(1u8..255, 1..40), proptest::collection::vec(any::<u8>(), 0..100), 0..20), flip in 0usize..FS_BLOCK_SIZE*8) {
            prop_assert_eq!(&roundtrip_set(&m, Layout::V1).unwrap(), &m);
            let mut b = encode_set(&m, Layout::V1, (77, 3), &[], 5).remove(0).1;
            b[flip / 8] ^= 1 << (flip % 8);
            prop_assert!(Head::decode(&b, 77, Layout::V1).is_err());
        }

        #[test]
        fn roundtrip_v2_multi_block(m in proptest::collection::btree_map(proptest::collection::vec(1u8..255, 1..60), proptest::collection::vec(any::<u8>(), 0..20000), 0..6)) {
            prop_assume!(encoded_len(&m, Layout::V2) <= Layout::V2.capacity());
            prop_assert_eq!(&roundtrip_set(&m, Layout::V2).unwrap(), &m);
        }

        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..5000), at: u64, v2: bool) {
            let layout = if v2 { Layout::V2 } else { Layout::V1 };
            if let Ok(h) = Head::decode(&data, at, layout) {
                let _ = h.assemble(&[], layout);
            }
        }
    }

    #[test]
    fn capacity_and_block_counts() {
        assert_eq!(overflow_count(0), 0);
        assert_eq!(overflow_count(XATTR_CAP), 0);
        assert_eq!(overflow_count(XATTR_CAP + 1), 1);
        assert_eq!(stream_capacity(1), XATTR_CAP + OVERFLOW_CAP - PTR);
        assert_eq!(overflow_count(Layout::V2.capacity()), MAX_MORE);
        assert_eq!(Layout::V2.capacity(), 129_288);
        // A 64 KiB value with a full-length name fits, with room for ACLs and more.
        let mut m = XattrMap::new();
        m.insert(vec![b'u'; 255], vec![9; XATTR_SIZE_MAX]);
        m.insert(b"system.posix_acl_access".to_vec(), vec![2; 60]);
        m.insert(b"user.second".to_vec(), vec![3; 60_000]);
        assert!(encoded_len(&m, Layout::V2) <= Layout::V2.capacity());
        assert_eq!(roundtrip_set(&m, Layout::V2).unwrap(), m);
    }

    #[test]
    fn damaged_sets_are_refused() {
        let mut m = XattrMap::new();
        m.insert(b"user.big".to_vec(), vec![1; 10_000]);
        let more = [(500, 1), (501, 1)];
        let blocks = encode_set(&m, Layout::V2, (77, 3), &more, 5);
        let h = Head::decode(&blocks[0].1, 77, Layout::V2).unwrap();
        let parts: Vec<Overflow> = blocks[1..]
            .iter()
            .map(|(b, raw)| Overflow::decode(raw, *b).unwrap())
            .collect();
        assert_eq!(h.assemble(&parts, Layout::V2).unwrap(), m);
        // Swapped, missing, or of the wrong role.
        assert!(h
            .assemble(&[parts[1].clone(), parts[0].clone()], Layout::V2)
            .is_err());
        assert!(h.assemble(&parts[..1], Layout::V2).is_err());
        let mut wrong = parts.clone();
        wrong[1].role = Role::SymlinkTarget;
        assert!(h.assemble(&wrong, Layout::V2).is_err());
        // A v2 multi-block head is not a v1 block.
        assert!(Head::decode(&blocks[0].1, 77, Layout::V1).is_err());
        // Pointers: zero, self, duplicate; and a count that is not the smallest.
        for (off, v) in [(48usize, 0u64), (48, 77), (56, 500)] {
            let mut b = blocks[0].1.clone();
            b[off..off + 8].copy_from_slice(&v.to_le_bytes());
            BlockHeader::decode(&blocks[0].1).unwrap().seal(&mut b);
            assert!(Head::decode(&b, 77, Layout::V2).is_err(), "{off} {v}");
        }
        let mut b = blocks[0].1.clone();
        b[42..44].copy_from_slice(&3u16.to_le_bytes());
        BlockHeader::decode(&blocks[0].1).unwrap().seal(&mut b);
        assert!(Head::decode(&b, 77, Layout::V2).is_err());
    }
}
