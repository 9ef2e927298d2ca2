//! Per-slot lock-request mailboxes (issue 9, not used by the filesystem yet): one
//! logical-block record per node slot ([`crate::format::mailbox`]) in which other nodes post
//! "I want the lock on object X" with COMPARE AND WRITE, and which only the slot's owner polls.
//! This is how a node learns that someone wants one of its cached object locks without reading
//! every lock record it holds. The protocol around it (who posts, who serves) is
//! [`super::object_lock`]; this module owns the record's I/O and the poll pacing.
//!
//! * [`Mailboxes::post`] adds or replaces the requester's request for one object (one per
//!   (object, requester slot)); an identical request already there writes nothing
//!   ([`Posted::Present`]); a full mailbox writes nothing either ([`Posted::Full`]): the
//!   requester posts again at its next refresh.
//! * [`Mailboxes::clear`] removes exactly the requests given (a request the requester
//!   replaced meanwhile stays); [`Mailboxes::reset`] empties a mailbox (recovery, mount).
//! * Every write is a CAW over the exact image read, with a fresh nonce and the read-back
//!   rule of `cluster/lock.rs`; reads re-read torn blocks the same way.
//!
//! # Poll pacing and its I/O cost ([`PollPacer`])
//! Reading one 512-byte block is assumed to cost 0.2 ms of LUN time. Polling the mailbox every
//! 10 ms is 100 reads/s = 20 ms/s = **2 % of LUN time per node**, twice the 1 % budget of
//! issue 9, so the tick adapts: **10 ms while the node is in a lock exchange** (it received a
//! request, or posted one because it waits, within the last second), **40 ms otherwise**:
//! 25 reads/s = 5 ms/s = 0.5 %. The heartbeat adds one read + one write per interval (2 s by
//! default): 1 I/O/s ≈ 0.2 ms/s = 0.02 %. So an idle node spends **≈ 0.52 %** of LUN time on
//! polling and heartbeat; a node in a sustained exchange 2.02 % for as long as the exchange
//! lasts, when every handoff already costs a commit of several I/Os of its own. What this
//! costs in latency: the first request to an idle node waits up to 40 ms (20 ms on average)
//! before the holder sees it; every following one within the second up to 10 ms.

use super::lock::{
    caw_read_back, fresh_nonce, read_validated, Backoff, BACKOFF_FIRST, BACKOFF_MAX,
};
use crate::dev::SharedDevice;
use crate::error::Result;
use crate::format::mailbox::{Mailbox, Request, NONCE_OFFSET};
use std::time::{Duration, Instant};

/// What [`Mailboxes::post`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Posted {
    /// The request is now in the mailbox (added, or replaced the requester's older one).
    Added,
    /// The same request was already there: nothing written.
    Present,
    /// No room: nothing written; post again later.
    Full,
}

/// The mailbox area: `slots` records of one logical block from byte `offset`.
#[derive(Debug, Clone)]
pub struct Mailboxes {
    dev: SharedDevice,
    lbs: usize,
    offset: u64,
    slots: u32,
    backoff_first: Duration,
    backoff_max: Duration,
}

impl Mailboxes {
    /// `offset` must be a multiple of the logical block size (checked by the caller that
    /// places the area, [`super::object_lock::ObjectLocks::new`]).
    pub fn new(dev: SharedDevice, offset: u64, slots: u32) -> Self {
        let lbs = dev.geometry().logical_block_size as usize;
        Self {
            dev,
            lbs,
            offset,
            slots,
            backoff_first: BACKOFF_FIRST,
            backoff_max: BACKOFF_MAX,
        }
    }

    #[must_use]
    pub fn with_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff_first = first.max(Duration::from_micros(1));
        self.backoff_max = max.max(self.backoff_first);
        self
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    fn offset_of(&self, slot: u32) -> Result<u64> {
        if slot >= self.slots {
            bail!(
                InvalidInput,
                "node slot {slot} has no mailbox (the area has {})",
                self.slots
            );
        }
        Ok(self.offset + u64::from(slot) * self.lbs as u64)
    }

    /// The mailbox of `slot` and its raw image (torn reads re-read).
    pub fn read(&self, slot: u32) -> Result<(Vec<u8>, Mailbox)> {
        let off = self.offset_of(slot)?;
        read_validated(
            &*self.dev,
            off,
            self.lbs,
            "mailbox unreadable after re-reads",
            |b| Mailbox::decode(b, slot),
        )
    }

    fn swap(&self, expected: &[u8], new: &mut Mailbox) -> Result<bool> {
        let off = self.offset_of(new.slot)?;
        let old = expected
            .get(NONCE_OFFSET..NONCE_OFFSET + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_le_bytes);
        new.nonce = fresh_nonce(old);
        let image = new.encode(self.lbs)?;
        let (slot, nonce) = (new.slot, new.nonce);
        caw_read_back(
            &*self.dev,
            off / self.lbs as u64,
            expected,
            &image,
            &format_args!("mailbox of slot {slot}"),
            || Ok(self.read(slot)?.1.nonce == nonce),
        )
    }

    /// Read-modify-CAW until it sticks; `f` returns None to write nothing.
    fn update(&self, slot: u32, mut f: impl FnMut(&Mailbox) -> Option<Mailbox>) -> Result<()> {
        let mut backoff = Backoff::new(self.backoff_first, self.backoff_max);
        loop {
            let (raw, cur) = self.read(slot)?;
            let Some(mut new) = f(&cur) else {
                return Ok(());
            };
            if self.swap(&raw, &mut new)? {
                return Ok(());
            }
            backoff.sleep();
        }
    }

    /// Post `req` into the mailbox of slot `to` (see the module doc).
    pub fn post(&self, to: u32, req: Request) -> Result<Posted> {
        crate::failpoint!("objlock::post_request");
        let cap = crate::format::mailbox::capacity(self.lbs);
        let mut out = Posted::Present;
        self.update(to, |m| {
            let same = |r: &Request| r.object == req.object && r.slot == req.slot;
            if m.requests.contains(&req) {
                out = Posted::Present;
                return None;
            }
            let mut n = m.clone();
            n.requests.retain(|r| !same(r));
            if n.requests.len() >= cap {
                out = Posted::Full;
                return None;
            }
            n.requests.push(req);
            out = Posted::Added;
            Some(n)
        })?;
        Ok(out)
    }

    /// Remove exactly the requests in `done` from the mailbox of `slot`.
    pub fn clear(&self, slot: u32, done: &[Request]) -> Result<()> {
        if done.is_empty() {
            return Ok(());
        }
        self.update(slot, |m| {
            if !m.requests.iter().any(|r| done.contains(r)) {
                return None;
            }
            let mut n = m.clone();
            n.requests.retain(|r| !done.contains(r));
            Some(n)
        })
    }

    /// Empty the mailbox of `slot` (nothing written if it is empty already).
    pub fn reset(&self, slot: u32) -> Result<()> {
        self.update(slot, |m| {
            (!m.requests.is_empty()).then(|| Mailbox::empty(m.slot))
        })
    }
}

/// The adaptive mailbox poll interval of the module doc: `busy` while there was lock traffic
/// (a request received or posted) within `linger`, `idle` otherwise.
#[derive(Debug, Clone)]
pub struct PollPacer {
    pub busy: Duration,
    pub idle: Duration,
    pub linger: Duration,
    last: Option<Instant>,
}

impl Default for PollPacer {
    fn default() -> Self {
        Self {
            busy: Duration::from_millis(10),
            idle: Duration::from_millis(40),
            linger: Duration::from_secs(1),
            last: None,
        }
    }
}

impl PollPacer {
    /// Lock traffic at `now`: a request was received, or this node posted one.
    pub fn activity(&mut self, now: Instant) {
        self.last = Some(now);
    }

    /// How long to sleep before the next poll.
    pub fn interval(&self, now: Instant) -> Duration {
        match self.last {
            Some(t) if now.saturating_duration_since(t) < self.linger => self.busy,
            _ => self.idle,
        }
    }

    /// Share of LUN time polling costs at `reads_per_s`, for a read costing `read_cost`
    /// (the module doc's arithmetic, kept next to the numbers it justifies).
    pub fn lun_share(reads_per_s: f64, read_cost: Duration) -> f64 {
        reads_per_s * read_cost.as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::mem::MemDevice;
    use crate::format::mailbox::Want;
    use std::sync::Arc;

    fn boxes(lbs: u32) -> Mailboxes {
        let dev: SharedDevice = Arc::new(MemDevice::new(1 << 20, lbs));
        Mailboxes::new(dev, 8 * u64::from(lbs), 4)
    }

    fn req(object: u64, slot: u32, want: Want) -> Request {
        Request {
            object,
            slot,
            gen: 10 + u64::from(slot),
            want,
        }
    }

    #[test]
    fn mailbox_post_dedupes_replaces_fills_and_clears() {
        let m = boxes(512);
        assert!(m.read(0).unwrap().1.requests.is_empty());
        assert_eq!(m.post(1, req(5, 2, Want::Shared)).unwrap(), Posted::Added);
        assert_eq!(m.post(1, req(5, 2, Want::Shared)).unwrap(), Posted::Present);
        assert_eq!(
            m.post(1, req(5, 2, Want::Exclusive)).unwrap(),
            Posted::Added
        );
        assert_eq!(m.post(1, req(5, 3, Want::Shared)).unwrap(), Posted::Added);
        let got = m.read(1).unwrap().1.requests;
        assert_eq!(
            got,
            vec![req(5, 2, Want::Exclusive), req(5, 3, Want::Shared)]
        );
        // Clearing an older request leaves its replacement.
        m.clear(1, &[req(5, 2, Want::Shared)]).unwrap();
        assert_eq!(m.read(1).unwrap().1.requests.len(), 2);
        m.clear(1, &[req(5, 2, Want::Exclusive)]).unwrap();
        assert_eq!(m.read(1).unwrap().1.requests, vec![req(5, 3, Want::Shared)]);
        for o in 100..123 {
            assert_eq!(m.post(2, req(o, 0, Want::Room)).unwrap(), Posted::Added);
        }
        assert_eq!(m.post(2, req(999, 0, Want::Room)).unwrap(), Posted::Full);
        // Replacing one's own request in a full mailbox still works.
        assert_eq!(m.post(2, req(100, 0, Want::Shared)).unwrap(), Posted::Added);
        m.reset(2).unwrap();
        assert!(m.read(2).unwrap().1.requests.is_empty());
        assert!(
            m.post(4, req(1, 0, Want::Shared)).is_err(),
            "no such mailbox"
        );
        // Other mailboxes untouched.
        assert_eq!(m.read(1).unwrap().1.requests.len(), 1);
        assert!(m.read(3).unwrap().1.requests.is_empty());
    }

    #[test]
    fn mailbox_poll_pacer_and_budget() {
        let mut p = PollPacer::default();
        let t0 = Instant::now();
        assert_eq!(p.interval(t0), Duration::from_millis(40));
        p.activity(t0);
        assert_eq!(p.interval(t0 + Duration::from_millis(999)), p.busy);
        assert_eq!(p.interval(t0 + Duration::from_secs(1)), p.idle);
        // The module doc's numbers: 0.2 ms per 512-byte read.
        let read = Duration::from_micros(200);
        let idle = PollPacer::lun_share(1.0 / p.idle.as_secs_f64(), read);
        let busy = PollPacer::lun_share(1.0 / p.busy.as_secs_f64(), read);
        let heartbeat = PollPacer::lun_share(2.0 / 2.0, read);
        assert!((idle - 0.005).abs() < 1e-9 && (busy - 0.02).abs() < 1e-9);
        assert!(idle + heartbeat < 0.01, "idle polling must stay under 1 %");
    }
}
