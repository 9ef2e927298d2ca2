//! Heartbeat (node slot) record: exactly one logical block (512 or 4096 bytes) per slot in the
//! heartbeat area, so a slot changes with one COMPARE AND WRITE.
//!
//! ```text
//!   0  4 magic "CTHB"      4 2 version (1)      6 2 state (0 free, 1 live, 2 recovering)
//!   8  8 generation        bumped on every claim: the owner's identity for locks and fencing
//!  16  8 counter           bumped on every renewal: liveness is judged by its *change*
//!  24  8 nonce             random per claim and renewal: proves "this image is mine"
//!  32 16 volume uuid       a record from another volume is never trusted
//!  48  4 heartbeat interval (ms)   52 4 io timeout (ms)   the owner's own timing, which
//!                                   observers use to compute *its* fail and dead times
//!  56  4 slot index        60 4 recoverer slot (state 2: the node recovering this slot)
//!  64 64 host name (UTF-8, NUL padded)
//! 128  8 owner pid (diagnostics only)
//! 136  8 recoverer generation (state 2): with the recoverer slot, who claimed the recovery;
//!        the claim is void once that slot no longer holds that generation alive
//! 144 16 machine id        the owner's machine (`cluster/machine.rs`); all zero in records
//!                          written before format 4 (those bytes were zero), read as unknown
//! 160  4 watchdog (ms)     format 4: 0 = none; else how long after its lease ran out the
//!                          owner's host is certainly reset (`cluster/watchdog.rs`); observers
//!                          wait that much longer before they call it dead
//! 164 .. zero
//! lbs-4 4 crc32c of bytes 0..lbs-4
//! ```
//! An all-zero block is a free slot that was never used.
//!
//! The machine id went into bytes that every earlier release wrote as zero and never read,
//! so the record version stays 1: an older binary decodes a record carrying it (the crc covers
//! the whole block either way), and a record of an older binary decodes here with
//! [`MachineId::UNKNOWN`]. What it is used for is decided by the superblock's sharing mode
//! (format 4, `format/superblock.rs`).
//!
//! The timing fields must satisfy [`check_timing`] (1 ≤ interval ≤ 60 000 ms, interval ≤
//! io timeout ≤ 300 000 ms): the same rule mkfs and the superblock decoder apply, so every
//! legal volume fits and a record with absurd timing (which would make observers wait for
//! years before calling its node dead) does not decode.

use super::codec::{Reader, Writer};
use crate::cluster::machine::MachineId;
use crate::error::{Error, Result};

pub const HB_MAGIC: u32 = u32::from_le_bytes(*b"CTHB");
pub const HB_VERSION: u16 = 1;
pub const HOST_LEN: usize = 64;
/// Where the owner's machine id sits (16 bytes).
const MACHINE: usize = 144;
/// Where the owner's watchdog bound sits (u32 ms).
const WATCHDOG: usize = 160;
const _: () = assert!(WATCHDOG + 4 + 4 <= 512);
/// Longest legal watchdog bound (ms): a record claiming more does not decode (observers would
/// wait for it before recovering the node).
pub const MAX_WATCHDOG_MS: u32 = 600_000;

/// Longest legal heartbeat renewal interval (ms).
pub const MAX_INTERVAL_MS: u32 = 60_000;
/// Longest legal I/O timeout (ms): fail time 40 min, dead time at most 52 min.
pub const MAX_IO_TIMEOUT_MS: u32 = 300_000;

/// The one rule for heartbeat timing, wherever it is stored (superblock, heartbeat record) or
/// chosen (mkfs): 1 ≤ interval ≤ [`MAX_INTERVAL_MS`], interval ≤ io timeout ≤
/// [`MAX_IO_TIMEOUT_MS`]. Err says what is wrong, in words for a sysadmin.
pub fn check_timing(interval_ms: u32, io_timeout_ms: u32) -> std::result::Result<(), String> {
    if interval_ms == 0 || interval_ms > MAX_INTERVAL_MS {
        return Err(format!(
            "heartbeat interval {interval_ms} ms is outside 1..={MAX_INTERVAL_MS} ms"
        ));
    }
    if io_timeout_ms < interval_ms || io_timeout_ms > MAX_IO_TIMEOUT_MS {
        return Err(format!(
            "io timeout {io_timeout_ms} ms is outside {interval_ms} (the interval)..={MAX_IO_TIMEOUT_MS} ms"
        ));
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Free = 0,
    Live = 1,
    /// The node died; a survivor (recoverer slot, generation) is replaying and releasing
    /// what it held. Writing this state also fences the dead node should it resume.
    Recovering = 2,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    pub state: SlotState,
    pub generation: u64,
    pub counter: u64,
    pub nonce: u64,
    pub uuid: [u8; 16],
    pub interval_ms: u32,
    pub io_timeout_ms: u32,
    pub slot: u32,
    pub host: String,
    pub pid: u64,
    pub recoverer: u32,
    pub recoverer_gen: u64,
    /// The owner's machine; [`MachineId::UNKNOWN`] in records of releases before format 4.
    pub machine: MachineId,
    /// How long after its lease ran out the owner's host watchdog has certainly reset it, ms
    /// (0: it has none).
    pub watchdog_ms: u32,
}

impl Heartbeat {
    pub fn encode(&self, lbs: usize) -> Vec<u8> {
        let mut b = vec![0u8; lbs];
        let mut w = Writer::new(&mut b);
        w.u32(0, HB_MAGIC);
        w.u16(4, HB_VERSION);
        w.u16(6, self.state as u16);
        w.u64(8, self.generation);
        w.u64(16, self.counter);
        w.u64(24, self.nonce);
        w.bytes(32, &self.uuid);
        w.u32(48, self.interval_ms);
        w.u32(52, self.io_timeout_ms);
        w.u32(56, self.slot);
        w.u32(60, self.recoverer);
        w.u64(136, self.recoverer_gen);
        let h = self.host.as_bytes();
        w.bytes(64, &h[..h.len().min(HOST_LEN)]);
        w.u64(128, self.pid);
        w.bytes(MACHINE, &self.machine.0);
        w.u32(WATCHDOG, self.watchdog_ms);
        let crc = crc32c::crc32c(&b[..lbs - 4]);
        Writer::new(&mut b).u32(lbs - 4, crc);
        b
    }

    /// Decode a slot; Ok(None) for a never-used (all-zero) slot.
    pub fn decode(buf: &[u8]) -> Result<Option<Self>> {
        if buf.iter().all(|&b| b == 0) {
            return Ok(None);
        }
        let lbs = buf.len();
        if lbs != 512 && lbs != 4096 {
            return Err(Error::corrupted(format!("heartbeat record of {lbs} bytes")));
        }
        let r = Reader::new(buf, "heartbeat");
        if r.u32(0)? != HB_MAGIC || r.u16(4)? != HB_VERSION {
            return Err(Error::corrupted("heartbeat record: bad magic or version"));
        }
        if r.u32(lbs - 4)? != crc32c::crc32c(&buf[..lbs - 4]) {
            return Err(Error::corrupted("heartbeat record: checksum mismatch"));
        }
        let state = match r.u16(6)? {
            0 => SlotState::Free,
            1 => SlotState::Live,
            2 => SlotState::Recovering,
            s => {
                return Err(Error::corrupted(format!(
                    "heartbeat record: unknown state {s}"
                )))
            }
        };
        let (interval_ms, io_timeout_ms) = (r.u32(48)?, r.u32(52)?);
        check_timing(interval_ms, io_timeout_ms)
            .map_err(|e| Error::corrupted(format!("heartbeat record: {e}")))?;
        let raw = r.bytes(64, HOST_LEN)?;
        let end = raw.iter().position(|&c| c == 0).unwrap_or(HOST_LEN);
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(r.bytes(32, 16)?);
        let mut machine = MachineId::UNKNOWN;
        machine.0.copy_from_slice(r.bytes(MACHINE, 16)?);
        let watchdog_ms = r.u32(WATCHDOG)?;
        if watchdog_ms > MAX_WATCHDOG_MS {
            return Err(Error::corrupted(format!(
                "heartbeat record: watchdog bound {watchdog_ms} ms is over {MAX_WATCHDOG_MS} ms"
            )));
        }
        Ok(Some(Self {
            state,
            generation: r.u64(8)?,
            counter: r.u64(16)?,
            nonce: r.u64(24)?,
            uuid,
            interval_ms,
            io_timeout_ms,
            slot: r.u32(56)?,
            host: std::str::from_utf8(&raw[..end])
                .map_err(|_| Error::corrupted("heartbeat record: host name is not UTF-8"))?
                .to_string(),
            pid: r.u64(128)?,
            recoverer: r.u32(60)?,
            recoverer_gen: r.u64(136)?,
            machine,
            watchdog_ms,
        }))
    }

    /// How long observers wait for this record to change before they call its owner dead:
    /// its own timing's dead time, or, when it advertises a host watchdog, at least its fail
    /// time + the watchdog's bound + two intervals (one missed observation) — by then its host
    /// has been reset, so nothing it issued can land any more.
    pub fn dead_time(&self) -> std::time::Duration {
        let t = crate::cluster::Timing::from_ms(self.interval_ms, self.io_timeout_ms);
        let reset = t.fail_time()
            + std::time::Duration::from_millis(u64::from(self.watchdog_ms))
            + t.interval * 2;
        if self.watchdog_ms == 0 {
            t.dead_time()
        } else {
            t.dead_time().max(reset)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    #[test]
    fn non_utf8_host_is_rejected_not_mangled() {
        // Found by the fuzzer: a lossy decode re-encoded to different bytes.
        let h = Heartbeat {
            state: SlotState::Live,
            generation: 1,
            counter: 1,
            nonce: 1,
            uuid: [1; 16],
            interval_ms: 1,
            io_timeout_ms: 1,
            slot: 0,
            host: "x".into(),
            pid: 1,
            recoverer: 0,
            recoverer_gen: 0,
            machine: MachineId::UNKNOWN,
            watchdog_ms: 0,
        };
        let mut b = h.encode(512);
        b[64] = 0xff;
        let crc = crc32c::crc32c(&b[..508]);
        b[508..].copy_from_slice(&crc.to_le_bytes());
        assert!(Heartbeat::decode(&b).is_err());
    }

    fn live(interval_ms: u32, io_timeout_ms: u32) -> Heartbeat {
        Heartbeat {
            state: SlotState::Live,
            generation: 3,
            counter: 9,
            nonce: 5,
            uuid: [2; 16],
            interval_ms,
            io_timeout_ms,
            slot: 1,
            host: "n".into(),
            pid: 7,
            recoverer: NO_RECOVERER,
            recoverer_gen: 0,
            machine: MachineId([0xaa; 16]),
            watchdog_ms: 0,
        }
    }
    const NO_RECOVERER: u32 = u32::MAX;

    /// An advertised watchdog stretches the dead time to fail time + its bound + two
    /// intervals when that is longer; an absurd bound does not decode.
    #[test]
    fn an_advertised_watchdog_stretches_the_dead_time() {
        use std::time::Duration;
        let mut h = live(100, 500); // fail 4 s, dead 4 + 1 + 0.2 = 5.2 s
        assert_eq!(h.dead_time(), Duration::from_millis(5_200));
        h.watchdog_ms = 16_000;
        assert_eq!(h.dead_time(), Duration::from_millis(20_200));
        let mut prod = live(2_000, 8_000); // fail 64 s, dead 84 s
        prod.watchdog_ms = 16_000;
        assert_eq!(
            prod.dead_time(),
            Duration::from_secs(84),
            "production timing already covers watchdog-mux's bound"
        );
        let back = Heartbeat::decode(&h.encode(512)).unwrap().unwrap();
        assert_eq!(back.watchdog_ms, 16_000);
        h.watchdog_ms = MAX_WATCHDOG_MS + 1;
        let e = Heartbeat::decode(&h.encode(512)).unwrap_err();
        assert!(e.to_string().contains("watchdog"), "{e}");
    }

    #[test]
    fn timing_bounds_are_enforced_by_the_decoder() {
        for (i, t) in [
            (1, 1),
            (10, 20),
            (100, 500),
            (2000, 8000),
            (MAX_INTERVAL_MS, MAX_IO_TIMEOUT_MS),
        ] {
            let b = live(i, t).encode(512);
            assert_eq!(Heartbeat::decode(&b).unwrap(), Some(live(i, t)), "{i}/{t}");
        }
        for (i, t) in [
            (0, 500),
            (100, 99),
            (100, u32::MAX),
            (100, MAX_IO_TIMEOUT_MS + 1),
            (MAX_INTERVAL_MS + 1, MAX_IO_TIMEOUT_MS),
            (u32::MAX, u32::MAX),
        ] {
            // A valid checksum: the encoder writes what it is given.
            let e = Heartbeat::decode(&live(i, t).encode(4096)).unwrap_err();
            assert!(e.to_string().contains("ms"), "{i}/{t}: {e}");
        }
    }

    /// A record as a release before format 4 wrote it (bytes 144.. zero) decodes, with the
    /// machine unknown; this release's record differs from it only in bytes 144..160 (and
    /// the crc), so an older decoder, which reads nothing there, accepts it too.
    #[test]
    fn records_without_a_machine_id_decode_as_unknown() {
        for lbs in [512, 4096] {
            let mut old = live(100, 500).encode(lbs);
            old[144..160].fill(0);
            let crc = crc32c::crc32c(&old[..lbs - 4]);
            old[lbs - 4..].copy_from_slice(&crc.to_le_bytes());
            let h = Heartbeat::decode(&old).unwrap().unwrap();
            assert!(h.machine.is_unknown());
            assert_eq!(
                h,
                Heartbeat {
                    machine: MachineId::UNKNOWN,
                    ..live(100, 500)
                }
            );
            let new = live(100, 500).encode(lbs);
            let differ: Vec<usize> = (0..lbs).filter(|&i| old[i] != new[i]).collect();
            assert!(
                differ
                    .iter()
                    .all(|&i| (144..160).contains(&i) || i >= lbs - 4),
                "{differ:?}"
            );
            assert_eq!(&new[144..160], &[0xaa; 16]);
        }
    }

    proptest! {
        #[test]
        fn timing_rule_matches_its_definition(i: u32, t: u32) {
            let legal = (1..=MAX_INTERVAL_MS).contains(&i) && (i..=MAX_IO_TIMEOUT_MS).contains(&t);
            prop_assert_eq!(check_timing(i, t).is_ok(), legal);
            prop_assert_eq!(Heartbeat::decode(&live(i, t).encode(512)).is_ok(), legal);
        }
        #[test]
        fn roundtrip(gen: u64, counter: u64, nonce: u64, host in "[a-z0-9.-]{1,64}", big: bool, flip in 0usize..4096*8, machine: [u8; 16], watchdog_ms in 0..=MAX_WATCHDOG_MS) {
            let lbs = if big { 4096 } else { 512 };
            let h = Heartbeat { state: SlotState::Live, generation: gen, counter, nonce, uuid: [7; 16], interval_ms: 100, io_timeout_ms: 500, slot: 3, host, pid: 42, recoverer: 5, recoverer_gen: gen ^ 1, machine: MachineId(machine), watchdog_ms };
            let mut b = h.encode(lbs);
            prop_assert_eq!(&b[144..160], &machine[..]);
            prop_assert!(b[164..lbs - 4].iter().all(|&x| x == 0));
            prop_assert_eq!(Heartbeat::decode(&b).unwrap(), Some(h));
            let bit = flip % (lbs * 8);
            b[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(Heartbeat::decode(&b).is_err());
        }
        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..5000)) {
            let _ = Heartbeat::decode(&data);
        }
    }
}
