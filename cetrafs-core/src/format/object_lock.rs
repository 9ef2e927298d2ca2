//! Object-lock bucket record (issue 9, defined and tested, not yet written by mkfs or used by
//! the filesystem): exactly one logical block (512 or 4096 bytes) in the object-lock area, so
//! a bucket changes with one COMPARE AND WRITE. It holds the lock entries of the objects
//! (inodes, groups, volume-wide locks: [`crate::cluster::object_lock::ObjectId`]) that hash to
//! it; the protocol is `cluster/object_lock.rs`.
//!
//! ```text
//! off size field
//!   0   8 magic "CETRAOB\0"
//!   8   2 format version (1)
//!  10   2 entry count
//!  12   4 flags (0)
//!  16   8 bucket index   the record's own index in the area (checked on decode)
//!  24   8 nonce          random, fresh for every CAW attempt: "this image is mine"
//!  32   8 floor          highest version of any entry evicted from this bucket
//!  40  ..  entries, packed, strictly ascending object id; each:
//!          0  8 object id (non-zero)
//!          8  8 version      + 1 on every exclusive grant: the object's cache validator
//!         16  2 next         slot named by the last releaser (0xFFFF = none)
//!         18  1 mention count (n)
//!         19  1 reserved (0)
//!         20 12×n mentions, strictly ascending slot; each:
//!                0 2 slot (< 1024)   2 1 role   3 1 reserved (0)   4 8 slot generation
//!  ..  zero
//! lbs-4 4 crc32c of bytes 0..lbs-4
//! ```
//! Roles: 1 owner (holds it exclusively), 2 holder (holds it shared), 3 waits for shared, 4
//! waits for exclusive. A slot is named at most once per entry, an entry has at most one
//! owner and never an owner together with holders: the lock mode is *derived* from the
//! mentions (owner → exclusive, holders → shared, else free), so a record cannot state a mode
//! that contradicts its holders. An all-zero block (what an area zeroed at mkfs holds) is an
//! empty bucket with floor 0.
//!
//! The decoder is strict: every byte it accepts is one the encoder would write (reserved
//! bytes, unused space and unknown flags must be zero, order and uniqueness are checked), so
//! `encode(decode(b)) == b`. The encoder writes entries and mentions in canonical (sorted)
//! order whatever order they are in memory.

use super::codec::{Reader, Writer};
use super::lock_record::MAX_SLOTS;
use crate::error::{Error, Result};

pub const BUCKET_MAGIC: [u8; 8] = *b"CETRAOB\0";
pub const BUCKET_VERSION: u16 = 1;
/// "No slot" in an entry's `next`.
pub const NO_NEXT: u16 = u16::MAX;
/// Bytes before the first entry.
pub const HEADER_BYTES: usize = 40;
/// Bytes of an entry without its mentions.
pub const ENTRY_BYTES: usize = 20;
/// Bytes of one mention.
pub const MENTION_BYTES: usize = 12;
/// Most mentions one entry can carry (the count is one byte).
pub const MAX_MENTIONS: usize = 255;

const COUNT: usize = 10;
const FLAGS: usize = 12;
const INDEX: usize = 16;
const NONCE: usize = 24;
const FLOOR: usize = 32;

/// Offset of the nonce, for callers that compare raw images.
pub const NONCE_OFFSET: usize = NONCE;

/// Bytes available for entries in a block of `lbs` bytes.
pub fn payload_bytes(lbs: usize) -> usize {
    lbs.saturating_sub(HEADER_BYTES + 4)
}

/// What a slot named in an entry is doing with the object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Holds it exclusively.
    Owner,
    /// Holds it shared.
    Holder,
    /// Waits to hold it shared.
    WaitShared,
    /// Waits to hold it exclusively.
    WaitExclusive,
}

impl Role {
    fn code(self) -> u8 {
        match self {
            Self::Owner => 1,
            Self::Holder => 2,
            Self::WaitShared => 3,
            Self::WaitExclusive => 4,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => Self::Owner,
            2 => Self::Holder,
            3 => Self::WaitShared,
            4 => Self::WaitExclusive,
            _ => return None,
        })
    }

    /// Owner or holder (as opposed to a waiter).
    pub fn holds(self) -> bool {
        matches!(self, Self::Owner | Self::Holder)
    }
}

/// Slot `slot`, at heartbeat generation `gen`, has `role` for the entry's object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mention {
    pub slot: u32,
    pub role: Role,
    pub gen: u64,
}

/// The lock state of one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub object: u64,
    pub version: u64,
    /// The slot named by the last releaser (fairness), [`NO_NEXT`] for none.
    pub next: u16,
    /// At most one per slot; at most one [`Role::Owner`], never with a [`Role::Holder`].
    pub mentions: Vec<Mention>,
}

impl Entry {
    /// A new entry: nobody holds or waits, version `version`.
    pub fn new(object: u64, version: u64) -> Self {
        Self {
            object,
            version,
            next: NO_NEXT,
            mentions: Vec::new(),
        }
    }

    /// Encoded size.
    pub fn bytes(&self) -> usize {
        ENTRY_BYTES + MENTION_BYTES * self.mentions.len()
    }

    /// The mention of `slot`, whatever its generation.
    pub fn mention(&self, slot: u32) -> Option<&Mention> {
        self.mentions.iter().find(|m| m.slot == slot)
    }

    /// Nobody holds it and nobody waits: it may be evicted (its version folded into the floor).
    pub fn evictable(&self) -> bool {
        self.mentions.is_empty()
    }

    pub fn owner(&self) -> Option<&Mention> {
        self.mentions.iter().find(|m| m.role == Role::Owner)
    }

    pub fn holders(&self) -> impl Iterator<Item = &Mention> {
        self.mentions.iter().filter(|m| m.role.holds())
    }

    pub fn waiters(&self) -> impl Iterator<Item = &Mention> {
        self.mentions.iter().filter(|m| !m.role.holds())
    }
}

/// One bucket of the object-lock area.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub index: u64,
    pub nonce: u64,
    /// Highest version of any entry evicted from this bucket: a recreated entry starts above it.
    pub floor: u64,
    pub entries: Vec<Entry>,
}

fn valid_slot(s: u32) -> bool {
    usize::try_from(s).is_ok_and(|s| s < MAX_SLOTS)
}

impl Bucket {
    /// An empty bucket (what an all-zero block decodes to).
    pub fn empty(index: u64) -> Self {
        Self {
            index,
            nonce: 0,
            floor: 0,
            entries: Vec::new(),
        }
    }

    /// Encoded size of header and entries (without the zero padding and the crc).
    pub fn bytes(&self) -> usize {
        HEADER_BYTES + self.entries.iter().map(Entry::bytes).sum::<usize>()
    }

    /// Does the bucket encode into one block of `lbs` bytes (space, entry and mention counts)?
    pub fn fits(&self, lbs: usize) -> bool {
        self.bytes() + 4 <= lbs
            && u16::try_from(self.entries.len()).is_ok()
            && self
                .entries
                .iter()
                .all(|e| e.mentions.len() <= MAX_MENTIONS)
    }

    pub fn entry(&self, object: u64) -> Option<&Entry> {
        self.entries.iter().find(|e| e.object == object)
    }

    pub fn entry_mut(&mut self, object: u64) -> Option<&mut Entry> {
        self.entries.iter_mut().find(|e| e.object == object)
    }

    /// Exactly `lbs` bytes, entries by ascending object id and mentions by ascending slot.
    /// Err (`InvalidInput`) if the bucket does not [`fit`](Self::fits) or names a slot outside
    /// 0..1024; nothing is encoded then.
    pub fn encode(&self, lbs: usize) -> Result<Vec<u8>> {
        if !self.fits(lbs) || (lbs != 512 && lbs != 4096) {
            bail!(
                InvalidInput,
                "object-lock bucket {} needs {} bytes, more than a {lbs}-byte block holds",
                self.index,
                self.bytes() + 4
            );
        }
        let mut entries: Vec<&Entry> = self.entries.iter().collect();
        entries.sort_by_key(|e| e.object);
        let mut b = vec![0u8; lbs];
        let mut w = Writer::new(&mut b);
        w.bytes(0, &BUCKET_MAGIC);
        w.u16(8, BUCKET_VERSION);
        // fits() bounds the count far below u16::MAX.
        let Ok(count) = u16::try_from(entries.len()) else {
            bail!(
                InvalidInput,
                "object-lock bucket {}: too many entries",
                self.index
            );
        };
        w.u16(COUNT, count);
        w.u32(FLAGS, 0);
        w.u64(INDEX, self.index);
        w.u64(NONCE, self.nonce);
        w.u64(FLOOR, self.floor);
        let mut o = HEADER_BYTES;
        for e in entries {
            let mut ms = e.mentions.clone();
            ms.sort_by_key(|m| m.slot);
            w.u64(o, e.object);
            w.u64(o + 8, e.version);
            w.u16(o + 16, e.next);
            let Ok(mentions) = u8::try_from(ms.len()) else {
                bail!(
                    InvalidInput,
                    "object-lock bucket {}: too many mentions",
                    self.index
                );
            };
            w.u8(o + 18, mentions);
            o += ENTRY_BYTES;
            for m in ms {
                let Ok(slot) = u16::try_from(m.slot).map_err(drop).and_then(|s| {
                    if valid_slot(m.slot) {
                        Ok(s)
                    } else {
                        Err(())
                    }
                }) else {
                    bail!(InvalidInput, "object-lock mention of slot {}", m.slot);
                };
                w.u16(o, slot);
                w.u8(o + 2, m.role.code());
                w.u64(o + 4, m.gen);
                o += MENTION_BYTES;
            }
        }
        let crc = crc32c::crc32c(&b[..lbs - 4]);
        Writer::new(&mut b).u32(lbs - 4, crc);
        Ok(b)
    }

    /// Decode bucket `index`; an all-zero block is an empty bucket.
    pub fn decode(buf: &[u8], index: u64) -> Result<Self> {
        if buf.iter().all(|&b| b == 0) {
            return Ok(Self::empty(index));
        }
        let lbs = buf.len();
        if lbs != 512 && lbs != 4096 {
            return Err(Error::corrupted(format!(
                "object-lock bucket of {lbs} bytes"
            )));
        }
        let bad = |what: String| {
            Err(Error::corrupted(format!(
                "object-lock bucket {index}: {what}"
            )))
        };
        let r = Reader::new(buf, "object-lock bucket");
        if r.bytes(0, 8)? != BUCKET_MAGIC {
            return bad("bad magic".into());
        }
        if r.u32(lbs - 4)? != crc32c::crc32c(r.bytes(0, lbs - 4)?) {
            return bad("checksum mismatch".into());
        }
        let version = r.u16(8)?;
        if version != BUCKET_VERSION {
            return bad(format!("unknown format version {version}"));
        }
        let flags = r.u32(FLAGS)?;
        if flags != 0 {
            return bad(format!("unknown flags {flags:#x}"));
        }
        let at = r.u64(INDEX)?;
        if at != index {
            return bad(format!("holds the address of bucket {at}"));
        }
        let count = usize::from(r.u16(COUNT)?);
        let end = lbs - 4;
        let mut o = HEADER_BYTES;
        let mut entries: Vec<Entry> = Vec::with_capacity(count.min(end / ENTRY_BYTES));
        for i in 0..count {
            if o + ENTRY_BYTES > end {
                return bad(format!("entry {i} of {count} runs past the block"));
            }
            let object = r.u64(o)?;
            if object == 0 {
                return bad(format!("entry {i} names object 0"));
            }
            if entries.last().is_some_and(|p| p.object >= object) {
                return bad(format!("entry {i}: object ids not strictly ascending"));
            }
            let next = r.u16(o + 16)?;
            if next != NO_NEXT && !valid_slot(u32::from(next)) {
                return bad(format!("entry {i}: next slot {next} out of range"));
            }
            let n = usize::from(r.u8(o + 18)?);
            if r.u8(o + 19)? != 0 {
                return bad(format!("entry {i}: reserved byte is not zero"));
            }
            let mut e = Entry {
                object,
                version: r.u64(o + 8)?,
                next,
                mentions: Vec::with_capacity(n),
            };
            o += ENTRY_BYTES;
            if o + n * MENTION_BYTES > end {
                return bad(format!("entry {i}: {n} mentions run past the block"));
            }
            for k in 0..n {
                let slot = u32::from(r.u16(o)?);
                let code = r.u8(o + 2)?;
                if r.u8(o + 3)? != 0 {
                    return bad(format!("entry {i} mention {k}: reserved byte is not zero"));
                }
                if !valid_slot(slot) {
                    return bad(format!("entry {i} mention {k}: slot {slot} out of range"));
                }
                let Some(role) = Role::from_code(code) else {
                    return bad(format!("entry {i} mention {k}: unknown role {code}"));
                };
                if e.mentions.last().is_some_and(|p| p.slot >= slot) {
                    return bad(format!("entry {i}: mention slots not strictly ascending"));
                }
                e.mentions.push(Mention {
                    slot,
                    role,
                    gen: r.u64(o + 4)?,
                });
                o += MENTION_BYTES;
            }
            let owners = e.mentions.iter().filter(|m| m.role == Role::Owner).count();
            let holders = e.mentions.iter().filter(|m| m.role == Role::Holder).count();
            if owners > 1 || (owners == 1 && holders > 0) {
                return bad(format!(
                    "entry {i} (object {object:#x}): {owners} owners and {holders} shared holders"
                ));
            }
            entries.push(e);
        }
        if r.bytes(o, end - o)?.iter().any(|&b| b != 0) {
            return bad("bytes after the last entry are not zero".into());
        }
        Ok(Self {
            index,
            nonce: r.u64(NONCE)?,
            floor: r.u64(FLOOR)?,
            entries,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use proptest::prelude::*;

    fn sample() -> Bucket {
        Bucket {
            index: 7,
            nonce: 0x1234,
            floor: 99,
            entries: vec![
                Entry {
                    object: 5,
                    version: 100,
                    next: 3,
                    mentions: vec![
                        Mention {
                            slot: 1,
                            role: Role::Owner,
                            gen: 4,
                        },
                        Mention {
                            slot: 3,
                            role: Role::WaitShared,
                            gen: 9,
                        },
                        Mention {
                            slot: 1023,
                            role: Role::WaitExclusive,
                            gen: u64::MAX,
                        },
                    ],
                },
                Entry::new(1 << 62 | 3, 1),
                Entry {
                    object: u64::MAX,
                    version: 0,
                    next: NO_NEXT,
                    mentions: vec![
                        Mention {
                            slot: 0,
                            role: Role::Holder,
                            gen: 1,
                        },
                        Mention {
                            slot: 2,
                            role: Role::Holder,
                            gen: 2,
                        },
                    ],
                },
            ],
        }
    }

    fn reseal(b: &mut [u8]) {
        let n = b.len();
        let crc = crc32c::crc32c(&b[..n - 4]);
        b[n - 4..].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn bucket_roundtrip_and_every_bit_flip_detected() {
        for lbs in [512, 4096] {
            let s = sample();
            let b = s.encode(lbs).unwrap();
            assert_eq!(b.len(), lbs);
            assert_eq!(Bucket::decode(&b, 7).unwrap(), s);
            for bit in 0..lbs * 8 {
                let mut c = b.clone();
                c[bit / 8] ^= 1 << (bit % 8);
                assert!(Bucket::decode(&c, 7).is_err(), "bit {bit} lbs {lbs}");
            }
        }
    }

    #[test]
    fn bucket_zero_is_empty_and_rules_are_checked() {
        assert_eq!(Bucket::decode(&[0; 512], 3).unwrap(), Bucket::empty(3));
        let good = sample().encode(512).unwrap();
        assert_eq!(
            Bucket::decode(&good, 8).unwrap_err().kind(),
            ErrorKind::Corrupted
        );
        assert!(Bucket::decode(&good[..500], 7).is_err());
        let e0 = HEADER_BYTES;
        let m0 = e0 + ENTRY_BYTES;
        // (offset, bytes) patches that must each be refused once resealed.
        let cases: Vec<(usize, Vec<u8>)> = vec![
            (8, vec![2, 0]),                   // version
            (FLAGS, vec![1]),                  // flags
            (COUNT, vec![200, 0]),             // more entries than there are
            (e0, vec![0; 8]),                  // object 0
            (e0, vec![0xff; 8]),               // order: first entry now > later ones
            (e0 + 16, vec![0, 4]),             // next 1024
            (e0 + 19, vec![1]),                // reserved
            (m0 + 2, vec![9]),                 // role
            (m0 + 3, vec![1]),                 // mention reserved
            (m0, vec![0, 4]),                  // slot 1024
            (m0 + MENTION_BYTES, vec![1, 0]),  // duplicate slot 1
            (m0 + MENTION_BYTES + 2, vec![1]), // second owner
            (400, vec![1]),                    // non-zero tail
        ];
        for (off, bytes) in cases {
            let mut b = good.clone();
            b[off..off + bytes.len()].copy_from_slice(&bytes);
            reseal(&mut b);
            assert!(Bucket::decode(&b, 7).is_err(), "patch at {off}");
        }
        // An owner beside a shared holder.
        let mut s = sample();
        s.entries[2].mentions[0].role = Role::Owner;
        let mut b = s.encode(512).unwrap();
        reseal(&mut b);
        assert!(Bucket::decode(&b, 7).is_err());
    }

    #[test]
    fn bucket_capacity_follows_the_block_size() {
        for (lbs, want) in [(512usize, 14usize), (4096, 126)] {
            let mut s = Bucket::empty(0);
            let mut n = 0u64;
            loop {
                s.entries.push(Entry {
                    object: n + 1,
                    version: n,
                    next: NO_NEXT,
                    mentions: vec![Mention {
                        slot: 1,
                        role: Role::Owner,
                        gen: 1,
                    }],
                });
                if !s.fits(lbs) {
                    s.entries.pop();
                    break;
                }
                n += 1;
            }
            assert_eq!(s.entries.len(), want, "lbs {lbs}");
            assert!(s.encode(lbs).is_ok());
            s.entries.push(Entry::new(u64::MAX, 0));
            s.entries.push(Entry::new(u64::MAX - 1, 0));
            assert_eq!(s.encode(lbs).unwrap_err().kind(), ErrorKind::InvalidInput);
        }
        let mut s = Bucket::empty(0);
        s.entries.push(Entry::new(1, 0));
        s.entries[0].mentions.push(Mention {
            slot: 1024,
            role: Role::Holder,
            gen: 0,
        });
        assert!(s.encode(512).is_err());
    }

    fn arb_bucket() -> impl Strategy<Value = Bucket> {
        let mention = (0u32..1024, 1u8..=4, any::<u64>());
        let entry = (
            1u64..,
            any::<u64>(),
            prop_oneof![Just(NO_NEXT), 0u16..1024],
            proptest::collection::vec(mention, 0..6),
        );
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec(entry, 0..12),
        )
            .prop_map(|(index, nonce, floor, es)| {
                let mut b = Bucket {
                    index,
                    nonce,
                    floor,
                    entries: Vec::new(),
                };
                for (object, version, next, ms) in es {
                    if b.entry(object).is_some() {
                        continue;
                    }
                    let mut e = Entry {
                        object,
                        version,
                        next,
                        mentions: Vec::new(),
                    };
                    for (slot, role, gen) in ms {
                        let mut role = Role::from_code(role).unwrap();
                        if e.mention(slot).is_some() {
                            continue;
                        }
                        // Keep the owner/holder rule: one owner, alone among holders.
                        if role.holds() && e.holders().next().is_some() {
                            role = Role::WaitExclusive;
                        }
                        e.mentions.push(Mention { slot, role, gen });
                    }
                    b.entries.push(e);
                }
                b
            })
    }

    proptest! {
        #[test]
        fn bucket_roundtrip(b in arb_bucket(), big: bool) {
            let lbs = if big { 4096 } else { 512 };
            let mut b = b;
            while !b.fits(lbs) {
                b.entries.pop();
            }
            let raw = b.encode(lbs).unwrap();
            let back = Bucket::decode(&raw, b.index).unwrap();
            prop_assert_eq!(back.encode(lbs).unwrap(), raw.clone());
            let mut want = b.clone();
            want.entries.sort_by_key(|e| e.object);
            for e in &mut want.entries { e.mentions.sort_by_key(|m| m.slot); }
            prop_assert_eq!(back, want);
        }

        #[test]
        fn bucket_arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..5000), seal: bool) {
            let mut b = data;
            if seal && b.len() >= 8 {
                let n = if b.len() >= 4096 { 4096 } else { 512 };
                b.resize(n, 0);
                b[..8].copy_from_slice(&BUCKET_MAGIC);
                b[8..10].copy_from_slice(&1u16.to_le_bytes());
                reseal(&mut b);
            }
            let index = b.get(16..24).map_or(0, |s| u64::from_le_bytes(s.try_into().unwrap()));
            if let Ok(d) = Bucket::decode(&b, index) {
                if b.iter().any(|&x| x != 0) {
                    prop_assert_eq!(d.encode(b.len()).unwrap(), b);
                }
            }
        }
    }
}
