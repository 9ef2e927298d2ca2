//! Lock record: exactly one logical block (512 or 4096 bytes) per record in the lock area, so a
//! lock changes with one COMPARE AND WRITE. Record `i` lives at byte
//! `lock_start × 4096 + i × logical_block_size`. Everything lives in the first 512 bytes; the
//! rest of a 4096-byte record is zero.
//!
//! ```text
//! off size field
//!   0   8 magic "CETRALK\0"
//!   8   2 format version (1)
//!  10   2 kind: 1 global metadata lock, 2 allocation-group lock, 3 open-file bucket
//!  12   4 flags (0)
//!  16   8 index        the record's own index in the lock area (checked on decode)
//!  24   8 object       what it protects: 0 (global), group number, bucket number
//!  32   8 version      bumped on every exclusive grant: fencing token and cache validator
//!  40   8 nonce        random, fresh for every CAW attempt: "this image is mine"
//!  48   4 mode         0 free, 1 shared, 2 exclusive
//!  52   4 owner slot   exclusive holder (u32::MAX = none)
//!  56   8 owner slot generation
//!  64   4 next         handoff target chosen by the last releaser (u32::MAX = none)
//!  68   4 reserved 0
//! -- kinds 1 and 2:
//!  72 128 holders      bitmap of slots holding it shared (1024 slots, bit s%64 of u64 s/64)
//! 200 128 waiters      bitmap of slots waiting for it
//! 328  64 value block  (LVB) groups: u64 free blocks at 328, u8 valid (1) at 336;
//!                      global (format v5): u64 superblock seq at 328, u8 valid (1) at 336
//! 392 116 reserved 0
//! -- kind 3 (open-file bucket) instead:
//!  72   4 entry count (<= 18)
//!  76 24×18 entries    ino u64, slot u32, flags u32 (bit 0 = open for writing),
//!                      slot generation u64; unused entries are zero
//! -- all kinds:
//! 508   4 crc32c of bytes 0..508
//! 512 ..  zero (4096-byte logical blocks)
//! ```
//! An all-zero block (what mkfs leaves) is a free record that was never used.
//!
//! The decoder is strict: every byte it accepts is one the encoder would write (reserved bytes,
//! unused entries and unknown flags must be zero), so `encode(decode(b)) == b`. Kind 3 records
//! carry no holders, waiters or LVB; kinds 1 and 2 carry no entries.

use super::codec::{Reader, Writer};
use crate::error::{Error, Result};

pub const LOCK_MAGIC: [u8; 8] = *b"CETRALK\0";
pub const LOCK_VERSION: u16 = 1;
/// "No slot" in owner, next.
pub const NO_SLOT: u32 = u32::MAX;
/// Slots a holders/waiters bitmap can name.
pub const MAX_SLOTS: usize = 1024;
pub const LVB_LEN: usize = 64;
/// Entries of an open-file bucket.
pub const BUCKET_ENTRIES: usize = 18;

/// Bytes of a record that carry data; the rest of a larger logical block is zero.
pub const RECORD_BYTES: usize = 512;

const MAGIC: usize = 0;
const VERSION: usize = 8;
const KIND: usize = 10;
const FLAGS: usize = 12;
const INDEX: usize = 16;
const OBJECT: usize = 24;
const LVERSION: usize = 32;
const NONCE: usize = 40;
const MODE: usize = 48;
const OWNER: usize = 52;
const OWNER_GEN: usize = 56;
const NEXT: usize = 64;
const RESERVED0: usize = 68;
const HOLDERS: usize = 72;
const SET_BYTES: usize = MAX_SLOTS / 8;
const WAITERS: usize = HOLDERS + SET_BYTES;
const LVB: usize = WAITERS + SET_BYTES;
const RESERVED1: usize = LVB + LVB_LEN;
const COUNT: usize = 72;
const ENTRIES: usize = COUNT + 4;
const ENTRY_LEN: usize = 24;
/// Offset of the nonce, for callers that compare raw images.
pub const NONCE_OFFSET: usize = NONCE;
/// Offset of the crc32c.
pub const CRC_OFFSET: usize = RECORD_BYTES - 4;
const _: () = assert!(RESERVED1 == 392);
const _: () = assert!(ENTRIES + ENTRY_LEN * BUCKET_ENTRIES == CRC_OFFSET);

/// Offset of the group free count inside the LVB, and of its valid byte.
const LVB_FREE: usize = 0;
const LVB_VALID: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockKind {
    /// Record 0: the global metadata lock.
    Global,
    /// Records `1..=group_count`: allocation-group ownership.
    Group,
    /// The last `inode_lock_slots` records: open-file registrations hashed by inode.
    OpenBucket,
}

impl LockKind {
    fn code(self) -> u16 {
        match self {
            Self::Global => 1,
            Self::Group => 2,
            Self::OpenBucket => 3,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockMode {
    Free,
    Shared,
    Exclusive,
}

impl LockMode {
    fn code(self) -> u32 {
        match self {
            Self::Free => 0,
            Self::Shared => 1,
            Self::Exclusive => 2,
        }
    }

    /// Strength order: Free < Shared < Exclusive.
    pub fn rank(self) -> u8 {
        match self {
            Self::Free => 0,
            Self::Shared => 1,
            Self::Exclusive => 2,
        }
    }
}

/// A set of node slots (0..1024) as a bitmap. Slots outside the range are never members:
/// `insert` ignores them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SlotSet(pub [u64; 16]);

impl SlotSet {
    fn at(s: u32) -> Option<(usize, u64)> {
        let s = usize::try_from(s).ok().filter(|&s| s < MAX_SLOTS)?;
        Some((s / 64, 1u64 << (s % 64)))
    }

    pub fn insert(&mut self, s: u32) {
        if let Some((w, bit)) = Self::at(s) {
            self.0[w] |= bit;
        }
    }

    pub fn remove(&mut self, s: u32) {
        if let Some((w, bit)) = Self::at(s) {
            self.0[w] &= !bit;
        }
    }

    pub fn contains(&self, s: u32) -> bool {
        Self::at(s).is_some_and(|(w, bit)| self.0[w] & bit != 0)
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&w| w == 0)
    }

    /// Members in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().enumerate().flat_map(|(wi, &w)| {
            (0..64u32)
                .filter(move |b| w & (1u64 << b) != 0)
                .map(move |b| u32::try_from(wi * 64).expect("a set of u32 members") + b)
        })
    }

    pub fn len(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    fn encode(&self, w: &mut Writer<'_>, off: usize) {
        for (i, word) in self.0.iter().enumerate() {
            w.u64(off + i * 8, *word);
        }
    }

    fn decode(r: &Reader<'_>, off: usize) -> Result<Self> {
        let mut s = Self::default();
        for (i, word) in s.0.iter_mut().enumerate() {
            *word = r.u64(off + i * 8)?;
        }
        Ok(s)
    }
}

/// One open-file registration in a bucket: node `slot` (generation `slot_gen`) has `ino` open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenEntry {
    pub ino: u64,
    pub slot: u32,
    pub writer: bool,
    pub slot_gen: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockRecord {
    pub kind: LockKind,
    pub index: u64,
    pub object: u64,
    pub version: u64,
    pub nonce: u64,
    pub mode: LockMode,
    pub owner: u32,
    pub owner_gen: u64,
    pub next: u32,
    /// Kinds Global and Group only.
    pub holders: SlotSet,
    /// Kinds Global and Group only.
    pub waiters: SlotSet,
    /// Kinds Global and Group only.
    pub lvb: [u8; LVB_LEN],
    /// Kind `OpenBucket` only; at most [`BUCKET_ENTRIES`].
    pub entries: Vec<OpenEntry>,
}

fn valid_slot(s: u32) -> bool {
    s == NO_SLOT || usize::try_from(s).is_ok_and(|s| s < MAX_SLOTS)
}

impl LockRecord {
    /// An unheld record: mode Free, no owner, no handoff target, version 0.
    pub fn free(kind: LockKind, index: u64, object: u64) -> Self {
        Self {
            kind,
            index,
            object,
            version: 0,
            nonce: 0,
            mode: LockMode::Free,
            owner: NO_SLOT,
            owner_gen: 0,
            next: NO_SLOT,
            holders: SlotSet::default(),
            waiters: SlotSet::default(),
            lvb: [0; LVB_LEN],
            entries: Vec::new(),
        }
    }

    /// Exactly `lbs` bytes (512 or 4096). Fields that do not belong to the record's kind are not
    /// written; a bucket keeps at most [`BUCKET_ENTRIES`] entries.
    pub fn encode(&self, lbs: usize) -> Vec<u8> {
        let mut b = vec![0u8; RECORD_BYTES];
        let mut w = Writer::new(&mut b);
        w.bytes(MAGIC, &LOCK_MAGIC);
        w.u16(VERSION, LOCK_VERSION);
        w.u16(KIND, self.kind.code());
        w.u32(FLAGS, 0);
        w.u64(INDEX, self.index);
        w.u64(OBJECT, self.object);
        w.u64(LVERSION, self.version);
        w.u64(NONCE, self.nonce);
        w.u32(MODE, self.mode.code());
        w.u32(OWNER, self.owner);
        w.u64(OWNER_GEN, self.owner_gen);
        w.u32(NEXT, self.next);
        match self.kind {
            LockKind::Global | LockKind::Group => {
                self.holders.encode(&mut w, HOLDERS);
                self.waiters.encode(&mut w, WAITERS);
                w.bytes(LVB, &self.lvb);
            }
            LockKind::OpenBucket => {
                debug_assert!(self.entries.len() <= BUCKET_ENTRIES);
                let n = self.entries.len().min(BUCKET_ENTRIES);
                w.u32(COUNT, u32::try_from(n).expect("n <= BUCKET_ENTRIES"));
                for (i, e) in self.entries.iter().take(n).enumerate() {
                    let o = ENTRIES + i * ENTRY_LEN;
                    w.u64(o, e.ino);
                    w.u32(o + 8, e.slot);
                    w.u32(o + 12, u32::from(e.writer));
                    w.u64(o + 16, e.slot_gen);
                }
            }
        }
        let crc = crc32c::crc32c(&b[..CRC_OFFSET]);
        Writer::new(&mut b).u32(CRC_OFFSET, crc);
        debug_assert!(lbs >= RECORD_BYTES, "lock record in a {lbs}-byte block");
        b.resize(lbs, 0);
        b
    }

    /// Decode record `index`; Ok(None) for a never-used (all-zero) block.
    pub fn decode(buf: &[u8], index: u64) -> Result<Option<Self>> {
        if buf.iter().all(|&b| b == 0) {
            return Ok(None);
        }
        let lbs = buf.len();
        if lbs != 512 && lbs != 4096 {
            return Err(Error::corrupted(format!("lock record of {lbs} bytes")));
        }
        let bad = |what: String| Err(Error::corrupted(format!("lock record {index}: {what}")));
        let r = Reader::new(buf, "lock record");
        if r.bytes(MAGIC, 8)? != LOCK_MAGIC {
            return bad("bad magic".into());
        }
        if r.u32(CRC_OFFSET)? != crc32c::crc32c(r.bytes(0, CRC_OFFSET)?) {
            return bad("checksum mismatch".into());
        }
        let version = r.u16(VERSION)?;
        if version != LOCK_VERSION {
            return bad(format!("unknown format version {version}"));
        }
        if r.bytes(RECORD_BYTES, lbs - RECORD_BYTES)?
            .iter()
            .any(|&b| b != 0)
        {
            return bad("nonzero bytes after the first 512".into());
        }
        let kind = match r.u16(KIND)? {
            1 => LockKind::Global,
            2 => LockKind::Group,
            3 => LockKind::OpenBucket,
            k => return bad(format!("unknown kind {k}")),
        };
        let flags = r.u32(FLAGS)?;
        if flags != 0 {
            return bad(format!("unknown flags {flags:#x}"));
        }
        let at = r.u64(INDEX)?;
        if at != index {
            return bad(format!("holds the address of record {at}"));
        }
        let mode = match r.u32(MODE)? {
            0 => LockMode::Free,
            1 => LockMode::Shared,
            2 => LockMode::Exclusive,
            m => return bad(format!("unknown mode {m}")),
        };
        let owner = r.u32(OWNER)?;
        let next = r.u32(NEXT)?;
        if !valid_slot(owner) || !valid_slot(next) {
            return bad(format!(
                "slot number out of range (owner {owner}, next {next})"
            ));
        }
        if r.u32(RESERVED0)? != 0 {
            return bad("reserved field is not zero".into());
        }
        let mut rec = Self {
            kind,
            index,
            object: r.u64(OBJECT)?,
            version: r.u64(LVERSION)?,
            nonce: r.u64(NONCE)?,
            mode,
            owner,
            owner_gen: r.u64(OWNER_GEN)?,
            next,
            holders: SlotSet::default(),
            waiters: SlotSet::default(),
            lvb: [0; LVB_LEN],
            entries: Vec::new(),
        };
        match kind {
            LockKind::Global | LockKind::Group => {
                rec.holders = SlotSet::decode(&r, HOLDERS)?;
                rec.waiters = SlotSet::decode(&r, WAITERS)?;
                rec.lvb.copy_from_slice(r.bytes(LVB, LVB_LEN)?);
                if r.bytes(RESERVED1, CRC_OFFSET - RESERVED1)?
                    .iter()
                    .any(|&b| b != 0)
                {
                    return bad("reserved bytes are not zero".into());
                }
            }
            LockKind::OpenBucket => {
                let count = r.u32(COUNT)?;
                let Some(n) = usize::try_from(count).ok().filter(|&n| n <= BUCKET_ENTRIES) else {
                    return bad(format!("{count} open entries (max {BUCKET_ENTRIES})"));
                };
                for i in 0..n {
                    let o = ENTRIES + i * ENTRY_LEN;
                    let slot = r.u32(o + 8)?;
                    let eflags = r.u32(o + 12)?;
                    if eflags & !1 != 0 {
                        return bad(format!("open entry {i} has unknown flags {eflags:#x}"));
                    }
                    if slot == NO_SLOT || !valid_slot(slot) {
                        return bad(format!("open entry {i} names slot {slot}"));
                    }
                    rec.entries.push(OpenEntry {
                        ino: r.u64(o)?,
                        slot,
                        writer: eflags & 1 != 0,
                        slot_gen: r.u64(o + 16)?,
                    });
                }
                if r.bytes(ENTRIES + n * ENTRY_LEN, (BUCKET_ENTRIES - n) * ENTRY_LEN)?
                    .iter()
                    .any(|&b| b != 0)
                {
                    return bad("unused open entries are not zero".into());
                }
            }
        }
        Ok(Some(rec))
    }

    /// The group free-block count published in the LVB, if one was published.
    pub fn group_free(&self) -> Option<u64> {
        if self.lvb[LVB_VALID] != 1 {
            return None;
        }
        let mut a = [0u8; 8];
        a.copy_from_slice(&self.lvb[LVB_FREE..LVB_FREE + 8]);
        Some(u64::from_le_bytes(a))
    }

    pub fn set_group_free(&mut self, free: u64) {
        self.lvb[LVB_FREE..LVB_FREE + 8].copy_from_slice(&free.to_le_bytes());
        self.lvb[LVB_VALID] = 1;
    }

    /// Global record (format v5): the `seq` of the newest superblock a node grew the volume
    /// to, if any grow published one (`fs/grow.rs`). Same bytes as the group free count.
    pub fn geometry_seq(&self) -> Option<u64> {
        self.group_free()
    }

    pub fn set_geometry_seq(&mut self, seq: u64) {
        self.set_group_free(seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn samples(rng: &mut StdRng) -> Vec<LockRecord> {
        let mut g = LockRecord::free(LockKind::Global, 0, 0);
        g.version = rng.gen();
        g.nonce = rng.gen();
        g.mode = LockMode::Exclusive;
        g.owner = 5;
        g.owner_gen = rng.gen();
        g.next = 1023;
        g.holders.insert(0);
        g.holders.insert(63);
        g.holders.insert(64);
        g.holders.insert(1023);
        g.waiters.insert(7);
        g.waiters.insert(900);
        let mut grp = LockRecord::free(LockKind::Group, 9, 8);
        grp.mode = LockMode::Shared;
        grp.nonce = rng.gen();
        grp.set_group_free(rng.gen());
        grp.lvb[63] = 0xaa;
        let mut b = LockRecord::free(LockKind::OpenBucket, 12345, 4000);
        b.nonce = rng.gen();
        for _ in 0..BUCKET_ENTRIES {
            b.entries.push(OpenEntry {
                ino: rng.gen(),
                slot: rng.gen_range(0..1024),
                writer: rng.gen(),
                slot_gen: rng.gen(),
            });
        }
        let mut partial = b.clone();
        partial.entries.truncate(3);
        partial.index = 7;
        vec![
            g,
            grp,
            b,
            partial,
            LockRecord::free(LockKind::Global, 0, 0),
            LockRecord::free(LockKind::OpenBucket, 1, 0),
        ]
    }

    #[test]
    fn lock_record_roundtrip_all_kinds_both_block_sizes() {
        let mut rng = StdRng::seed_from_u64(1);
        for lbs in [512, 4096] {
            for rec in samples(&mut rng) {
                let b = rec.encode(lbs);
                assert_eq!(b.len(), lbs);
                let back = LockRecord::decode(&b, rec.index).unwrap().unwrap();
                assert_eq!(back, rec);
                assert_eq!(back.encode(lbs), b);
            }
        }
    }

    #[test]
    fn lock_record_every_flipped_bit_is_detected() {
        let mut rng = StdRng::seed_from_u64(2);
        for lbs in [512, 4096] {
            for rec in samples(&mut rng) {
                let b = rec.encode(lbs);
                let bits = (RECORD_BYTES * 8..lbs * 8).step_by(997);
                for bit in (0..RECORD_BYTES * 8).chain(bits) {
                    let mut c = b.clone();
                    c[bit / 8] ^= 1 << (bit % 8);
                    assert!(
                        LockRecord::decode(&c, rec.index).is_err(),
                        "flip of bit {bit} (lbs {lbs}, {:?}) went unnoticed",
                        rec.kind
                    );
                }
            }
        }
    }

    #[test]
    fn lock_record_zero_is_free_and_index_is_checked() {
        assert_eq!(LockRecord::decode(&[0; 512], 3).unwrap(), None);
        assert_eq!(LockRecord::decode(&[0; 4096], 3).unwrap(), None);
        let b = LockRecord::free(LockKind::Group, 3, 2).encode(512);
        let e = LockRecord::decode(&b, 4).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted);
        assert!(LockRecord::decode(&b[..500], 3).is_err());
    }

    /// Re-seal a mutated image with a valid crc so the decoder's deeper checks are exercised.
    fn reseal(b: &mut [u8]) {
        let crc = crc32c::crc32c(&b[..CRC_OFFSET]);
        b[CRC_OFFSET..RECORD_BYTES].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn lock_record_semantic_checks() {
        let good = LockRecord::free(LockKind::OpenBucket, 1, 0).encode(512);
        let cases: [(usize, &[u8]); 7] = [
            (VERSION, &[2, 0]),
            (KIND, &[4, 0]),
            (FLAGS, &[1]),
            (MODE, &[3]),
            (COUNT, &[19]),
            (RESERVED0, &[1]),
            (OWNER, &[0, 4, 0, 0]),
        ];
        for (off, bytes) in cases {
            let mut b = good.clone();
            b[off..off + bytes.len()].copy_from_slice(bytes);
            reseal(&mut b);
            assert!(LockRecord::decode(&b, 1).is_err(), "field at {off}");
        }
        // An unused entry that is not zero.
        let mut b = good.clone();
        b[ENTRIES + 5] = 1;
        reseal(&mut b);
        assert!(LockRecord::decode(&b, 1).is_err());
        // Nonzero tail of a 4096-byte record (crc covers only the first 512 bytes).
        let mut b = LockRecord::free(LockKind::Global, 0, 0).encode(4096);
        b[4000] = 1;
        assert!(LockRecord::decode(&b, 0).is_err());
    }

    #[test]
    fn lock_record_random_bytes_never_panic() {
        let mut rng = StdRng::seed_from_u64(3);
        let valid: Vec<Vec<u8>> = samples(&mut rng).iter().map(|r| r.encode(512)).collect();
        for i in 0..4000 {
            let len = match i % 4 {
                0 => 512,
                1 => 4096,
                _ => rng.gen_range(0..5000),
            };
            let mut b: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            if len >= 512 && i % 2 == 0 {
                // Valid header, random everything else, good crc: reaches the field checks.
                let v = &valid[i % valid.len()];
                let keep = rng.gen_range(0..512);
                b[..keep].copy_from_slice(&v[..keep]);
                b[512..].fill(0);
                reseal(&mut b);
            }
            let index = u64::from_le_bytes(
                b.get(16..24)
                    .and_then(|s| s.try_into().ok())
                    .unwrap_or([0; 8]),
            );
            if let Ok(Some(r)) = LockRecord::decode(&b, index) {
                assert_eq!(
                    r.encode(b.len()),
                    b,
                    "decode accepted bytes it would not write"
                );
            }
        }
        // Mutations of valid records, resealed: accepted ones must re-encode identically.
        for i in 0..4000 {
            let mut b = valid[i % valid.len()].clone();
            for _ in 0..rng.gen_range(1..4) {
                let at = rng.gen_range(0..CRC_OFFSET);
                b[at] = rng.gen();
            }
            reseal(&mut b);
            let index = u64::from_le_bytes(b[16..24].try_into().unwrap());
            if let Ok(Some(r)) = LockRecord::decode(&b, index) {
                assert_eq!(r.encode(512), b);
            }
        }
    }

    #[test]
    fn lock_record_slot_set_and_lvb() {
        let mut s = SlotSet::default();
        assert!(s.is_empty());
        for x in [1023, 0, 64, 65, 5] {
            s.insert(x);
        }
        s.insert(1024); // out of range: ignored
        s.insert(NO_SLOT);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 5, 64, 65, 1023]);
        assert_eq!(s.len(), 5);
        assert!(s.contains(64) && !s.contains(63) && !s.contains(NO_SLOT));
        s.remove(64);
        s.remove(5000);
        assert_eq!(s.len(), 4);
        let mut r = LockRecord::free(LockKind::Group, 1, 0);
        assert_eq!(r.group_free(), None);
        r.set_group_free(0);
        assert_eq!(r.group_free(), Some(0));
        r.set_group_free(u64::MAX);
        assert_eq!(r.group_free(), Some(u64::MAX));
    }
}
