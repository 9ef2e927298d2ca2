//! Lock-request mailbox record (issue 9, defined and tested, not yet written by mkfs or used
//! by the filesystem): exactly one logical block (512 or 4096 bytes) per node slot, so a
//! request is posted or cleared with one COMPARE AND WRITE. Other nodes post requests for
//! locks that slot holds; the slot's owner polls only its own mailbox
//! (`cluster/mailbox.rs`, `cluster/object_lock.rs`).
//!
//! ```text
//! off size field
//!   0   8 magic "CETRAMB\0"
//!   8   2 format version (1)
//!  10   2 request count
//!  12   4 flags (0)
//!  16   4 slot           the node slot this mailbox belongs to (checked on decode)
//!  20   4 reserved (0)
//!  24   8 nonce          random, fresh for every CAW attempt
//!  32  ..  requests, 20 bytes each, strictly ascending (object id, requester slot):
//!          0 8 object id (non-zero)
//!          8 8 requester generation
//!         16 2 requester slot (< 1024)
//!         18 1 wanted: 1 shared, 2 exclusive, 3 room (give it up: its bucket is full)
//!         19 1 reserved (0)
//!  ..  zero
//! lbs-4 4 crc32c of bytes 0..lbs-4
//! ```
//! One request per (object, requester slot): a requester that asks again replaces its own
//! request. Capacity: 23 requests in 512 bytes, 203 in 4096. An all-zero block is an empty
//! mailbox. The decoder is strict (`encode(decode(b)) == b`); the encoder writes requests in
//! canonical order.

use super::codec::{Reader, Writer};
use super::lock_record::MAX_SLOTS;
use crate::error::{Error, Result};

pub const MAILBOX_MAGIC: [u8; 8] = *b"CETRAMB\0";
pub const MAILBOX_VERSION: u16 = 1;
pub const HEADER_BYTES: usize = 32;
pub const REQUEST_BYTES: usize = 20;

const COUNT: usize = 10;
const FLAGS: usize = 12;
const SLOT: usize = 16;
const RESERVED: usize = 20;
const NONCE: usize = 24;

/// Offset of the nonce, for callers that compare raw images.
pub const NONCE_OFFSET: usize = NONCE;

/// Requests one mailbox of `lbs` bytes holds.
pub fn capacity(lbs: usize) -> usize {
    lbs.saturating_sub(HEADER_BYTES + 4) / REQUEST_BYTES
}

/// What the requester wants the holder to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Want {
    /// It wants the lock shared: an exclusive holder downgrades (or releases).
    Shared,
    /// It wants the lock exclusively: every holder releases.
    Exclusive,
    /// Nobody wants this object, but its bucket is full and the requester needs room there for
    /// another object: release it (an idle cached lock) so its entry can be evicted.
    Room,
}

impl Want {
    fn code(self) -> u8 {
        match self {
            Self::Shared => 1,
            Self::Exclusive => 2,
            Self::Room => 3,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => Self::Shared,
            2 => Self::Exclusive,
            3 => Self::Room,
            _ => return None,
        })
    }
}

/// "Slot `slot` (generation `gen`) asks you about `object`."
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Request {
    pub object: u64,
    pub slot: u32,
    pub gen: u64,
    pub want: Want,
}

/// The mailbox of one node slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mailbox {
    pub slot: u32,
    pub nonce: u64,
    pub requests: Vec<Request>,
}

impl Mailbox {
    pub fn empty(slot: u32) -> Self {
        Self {
            slot,
            nonce: 0,
            requests: Vec::new(),
        }
    }

    /// Exactly `lbs` bytes, requests in ascending (object, slot) order. Err (`InvalidInput`) if
    /// the requests do not fit, two share an (object, slot), or a slot is out of range.
    pub fn encode(&self, lbs: usize) -> Result<Vec<u8>> {
        if (lbs != 512 && lbs != 4096) || self.requests.len() > capacity(lbs) {
            bail!(
                InvalidInput,
                "mailbox of slot {}: {} requests do not fit a {lbs}-byte block",
                self.slot,
                self.requests.len()
            );
        }
        let mut rs = self.requests.clone();
        rs.sort_by_key(|r| (r.object, r.slot));
        if rs
            .windows(2)
            .any(|w| (w[0].object, w[0].slot) == (w[1].object, w[1].slot))
        {
            bail!(
                InvalidInput,
                "mailbox of slot {}: two requests of one slot for one object",
                self.slot
            );
        }
        let mut b = vec![0u8; lbs];
        let mut w = Writer::new(&mut b);
        w.bytes(0, &MAILBOX_MAGIC);
        w.u16(8, MAILBOX_VERSION);
        let Ok(count) = u16::try_from(rs.len()) else {
            bail!(
                InvalidInput,
                "mailbox of slot {}: too many requests",
                self.slot
            );
        };
        w.u16(COUNT, count);
        w.u32(SLOT, self.slot);
        w.u64(NONCE, self.nonce);
        for (i, r) in rs.iter().enumerate() {
            let Some(slot) = u16::try_from(r.slot)
                .ok()
                .filter(|&s| usize::from(s) < MAX_SLOTS)
            else {
                bail!(InvalidInput, "mailbox request from slot {}", r.slot);
            };
            let o = HEADER_BYTES + i * REQUEST_BYTES;
            w.u64(o, r.object);
            w.u64(o + 8, r.gen);
            w.u16(o + 16, slot);
            w.u8(o + 18, r.want.code());
        }
        let crc = crc32c::crc32c(&b[..lbs - 4]);
        Writer::new(&mut b).u32(lbs - 4, crc);
        Ok(b)
    }

    /// Decode the mailbox of `slot`; an all-zero block is an empty mailbox.
    pub fn decode(buf: &[u8], slot: u32) -> Result<Self> {
        if buf.iter().all(|&b| b == 0) {
            return Ok(Self::empty(slot));
        }
        let lbs = buf.len();
        if lbs != 512 && lbs != 4096 {
            return Err(Error::corrupted(format!("mailbox of {lbs} bytes")));
        }
        let bad = |what: String| Err(Error::corrupted(format!("mailbox of slot {slot}: {what}")));
        let r = Reader::new(buf, "mailbox");
        if r.bytes(0, 8)? != MAILBOX_MAGIC {
            return bad("bad magic".into());
        }
        if r.u32(lbs - 4)? != crc32c::crc32c(r.bytes(0, lbs - 4)?) {
            return bad("checksum mismatch".into());
        }
        let version = r.u16(8)?;
        if version != MAILBOX_VERSION {
            return bad(format!("unknown format version {version}"));
        }
        let flags = r.u32(FLAGS)?;
        if flags != 0 || r.u32(RESERVED)? != 0 {
            return bad("unknown flags or reserved field not zero".into());
        }
        let at = r.u32(SLOT)?;
        if at != slot {
            return bad(format!("is the mailbox of slot {at}"));
        }
        let n = usize::from(r.u16(COUNT)?);
        if n > capacity(lbs) {
            return bad(format!("{n} requests (at most {})", capacity(lbs)));
        }
        let mut requests: Vec<Request> = Vec::with_capacity(n);
        for i in 0..n {
            let o = HEADER_BYTES + i * REQUEST_BYTES;
            let object = r.u64(o)?;
            let rslot = u32::from(r.u16(o + 16)?);
            let code = r.u8(o + 18)?;
            if object == 0 {
                return bad(format!("request {i} names object 0"));
            }
            if usize::try_from(rslot).map_or(true, |s| s >= MAX_SLOTS) {
                return bad(format!("request {i} from slot {rslot}"));
            }
            let Some(want) = Want::from_code(code) else {
                return bad(format!("request {i}: unknown kind {code}"));
            };
            if r.u8(o + 19)? != 0 {
                return bad(format!("request {i}: reserved byte is not zero"));
            }
            if requests
                .last()
                .is_some_and(|p| (p.object, p.slot) >= (object, rslot))
            {
                return bad(format!(
                    "request {i}: not in ascending (object, slot) order"
                ));
            }
            requests.push(Request {
                object,
                slot: rslot,
                gen: r.u64(o + 8)?,
                want,
            });
        }
        let used = HEADER_BYTES + n * REQUEST_BYTES;
        if r.bytes(used, lbs - 4 - used)?.iter().any(|&b| b != 0) {
            return bad("bytes after the last request are not zero".into());
        }
        Ok(Self {
            slot,
            nonce: r.u64(NONCE)?,
            requests,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reseal(b: &mut [u8]) {
        let n = b.len();
        let crc = crc32c::crc32c(&b[..n - 4]);
        b[n - 4..].copy_from_slice(&crc.to_le_bytes());
    }

    fn sample() -> Mailbox {
        Mailbox {
            slot: 3,
            nonce: 77,
            requests: vec![
                Request {
                    object: 9,
                    slot: 1,
                    gen: 5,
                    want: Want::Exclusive,
                },
                Request {
                    object: 9,
                    slot: 2,
                    gen: 6,
                    want: Want::Shared,
                },
                Request {
                    object: 1 << 62,
                    slot: 1023,
                    gen: u64::MAX,
                    want: Want::Room,
                },
            ],
        }
    }

    #[test]
    fn mailbox_roundtrip_bitflips_and_rules() {
        assert_eq!((capacity(512), capacity(4096)), (23, 203));
        for lbs in [512, 4096] {
            let b = sample().encode(lbs).unwrap();
            assert_eq!(Mailbox::decode(&b, 3).unwrap(), sample());
            assert!(Mailbox::decode(&b, 4).is_err());
            for bit in 0..lbs * 8 {
                let mut c = b.clone();
                c[bit / 8] ^= 1 << (bit % 8);
                assert!(Mailbox::decode(&c, 3).is_err(), "bit {bit}");
            }
        }
        assert_eq!(Mailbox::decode(&[0; 4096], 8).unwrap(), Mailbox::empty(8));
        let good = sample().encode(512).unwrap();
        let r0 = HEADER_BYTES;
        let r1 = r0 + REQUEST_BYTES;
        let cases: Vec<(usize, Vec<u8>)> = vec![
            (8, vec![9]),
            (FLAGS, vec![1]),
            (RESERVED, vec![1]),
            (COUNT, vec![24, 0]),
            (COUNT, vec![4, 0]),
            (r0, vec![0; 8]),
            (r0 + 16, vec![0, 4]),
            (r0 + 18, vec![4]),
            (r0 + 19, vec![1]),
            (r1 + 16, vec![1, 0]),
        ];
        for (off, bytes) in cases {
            let mut b = good.clone();
            b[off..off + bytes.len()].copy_from_slice(&bytes);
            reseal(&mut b);
            assert!(Mailbox::decode(&b, 3).is_err(), "patch at {off}");
        }
        let mut dup = sample();
        dup.requests[1].slot = 1;
        assert!(dup.encode(512).is_err());
        let mut full = Mailbox::empty(0);
        for i in 0..24 {
            full.requests.push(Request {
                object: i + 1,
                slot: 0,
                gen: 0,
                want: Want::Shared,
            });
        }
        assert!(full.encode(512).is_err());
        assert!(full.encode(4096).is_ok());
    }

    proptest! {
        #[test]
        fn mailbox_roundtrip(slot in 0u32..1024, nonce: u64, big: bool,
                             rs in proptest::collection::vec((1u64.., 0u32..1024, any::<u64>(), 1u8..=3), 0..30)) {
            let lbs = if big { 4096 } else { 512 };
            let mut m = Mailbox { slot, nonce, requests: Vec::new() };
            for (object, s, gen, w) in rs {
                if m.requests.len() < capacity(lbs) && !m.requests.iter().any(|r| (r.object, r.slot) == (object, s)) {
                    m.requests.push(Request { object, slot: s, gen, want: Want::from_code(w).unwrap() });
                }
            }
            let raw = m.encode(lbs).unwrap();
            let back = Mailbox::decode(&raw, slot).unwrap();
            m.requests.sort_by_key(|r| (r.object, r.slot));
            prop_assert_eq!(back, m);
        }

        #[test]
        fn mailbox_arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..5000), seal: bool) {
            let mut b = data;
            if seal && b.len() >= 8 {
                let n = if b.len() >= 4096 { 4096 } else { 512 };
                b.resize(n, 0);
                b[..8].copy_from_slice(&MAILBOX_MAGIC);
                b[8..10].copy_from_slice(&1u16.to_le_bytes());
                reseal(&mut b);
            }
            let slot = b.get(16..20).map_or(0, |s| u32::from_le_bytes(s.try_into().unwrap()));
            if let Ok(m) = Mailbox::decode(&b, slot) {
                if b.iter().any(|&x| x != 0) {
                    prop_assert_eq!(m.encode(b.len()).unwrap(), b);
                }
            }
        }
    }
}
