//! Distributed locks as one-logical-block records on the LUN, changed only with COMPARE AND
//! WRITE (layout: [`crate::format::lock_record`]). There is no lock server: every node reads a
//! record, computes the record it wants, and CAWs it over exactly the image it read. A
//! miscompare means someone else changed the record first: re-read and decide again.
//!
//! # The lock area
//! `lock_count` records starting at fs block `lock_start`; record `i` is at byte
//! `lock_start × 4096 + i × logical_block_size`. mkfs zeroes the area, and an all-zero record is
//! a free lock that was never used.
//! * record 0: the global metadata lock (shared/exclusive, waiters, handoff);
//! * records `1 + g` for allocation group `g`: long-held exclusive ownership, with the group's
//!   free-block count in the value block (LVB) so others see it without reading the bitmap;
//! * the last `inode_lock_slots` records: open-file buckets. Inode `ino` registers in bucket
//!   `(ino × 0x9E3779B97F4A7C15 >> 32) mod inode_lock_slots`; a bucket holds up to 18
//!   (inode, slot, generation, writer) entries.
//!
//! # One CAW ([`LockTable::swap`])
//! Every new image carries a fresh random nonce. After a miscompare *or* an error of unknown
//! outcome (an I/O timeout), the record is re-read: if it holds our nonce, our write landed and
//! we won (arrays have reported false miscompares for writes that did land — the VMware ATS
//! lesson). A record that fails its checksum is re-read a few times before it is reported as
//! corrupted: a target may return a torn block while another initiator's CAW is running.
//! Contended loops back off with jitter: 0.5 ms doubling to 2 ms for the first 20 ms of a
//! wait, then on to 8 ms, each sleep ±50 % ([`BACKOFF_QUICK_MAX`]). In a loop, a CAW that
//! failed without landing (a path failing over) is a lost round too, for up to the lease's
//! fail time ([`IoPatience`]).
//!
//! # The global lock (record 0)
//! `acquire_global(me, mode)` loops:
//! 1. Read record 0. If it already shows `me` holding it in `mode` (or stronger), return it.
//! 2. **Eligible** if `next` is `NO_SLOT`, or `next` is me, or `next` is silent (its heartbeat
//!    stopped changing), or the record's raw image has not changed for `handoff_grace`, timed
//!    on this process's monotonic clock (clocks are never compared across nodes). The last
//!    releaser names `next`; the grace bounds the wait for a `next` that is slow, or dead
//!    and not yet silent to this node.
//! 3. **Compatible**: for Exclusive, the record is Free, or Shared with holders = {me} (an
//!    upgrade); for Shared, the record is Free, or Shared with no waiter other than me (so a
//!    stream of shared holders cannot starve an exclusive waiter).
//! 4. If eligible and compatible, CAW the grant — Exclusive: mode Exclusive, owner = me (slot
//!    and generation), holders cleared, `version + 1`; Shared: mode Shared, holders += me, no
//!    owner; both: waiters −= me, next = `NO_SLOT`. Won: return the granted record; its `version`
//!    is the fencing token and cache validator (it changes on every exclusive grant, so a node
//!    that sees the version it cached knows nobody else wrote metadata in between).
//! 5. Otherwise, if I am not in waiters, CAW a copy with waiters += me (a lost race is ignored:
//!    the next round retries). Back off, poll `abort` (a fenced node stops waiting), repeat.
//!    A node that stops waiting because of `abort` removes itself from waiters (best effort).
//!
//! `release_global(me)`: if I am the owner, mode Free and no owner; otherwise I leave the
//! holders (mode Free when none remain). I leave the waiters, and — if I held it — name as
//! `next` the first waiter after my slot in ascending order, wrapping around (`NO_SLOT` if none),
//! passing over waiters whose heartbeat has stopped changing (`silent`: a node that died while it
//! waited, not yet recovered) while another waits.
//! A node that was only waiting changes `next` only if `next` named it. Because every release
//! hands over round-robin and the releaser itself is not eligible while `next` names someone
//! else, a waiter gets the lock within (number of waiting slots) grants, unless the named
//! `next` fails to take it within `handoff_grace`, or a waiter is silent to the releaser (it is
//! then passed over until its heartbeat changes again) or a `next` silent to the others.
//!
//! # Recovery
//! `scrub_slot(dead)` removes every trace of a dead slot: from record 0 (owner, holders,
//! waiters, next — handed on round-robin as if it had released; if it held the lock
//! exclusively, `version` is bumped so every node drops its caches: the dead node's replayed
//! changes are now home), from every group record (owned groups become Free, LVB kept), and
//! from every open bucket. It writes only records that mention the slot, so it is idempotent.
//!
//! # Allocation groups and open files
//! `claim_group` takes a Free group exclusively (`version + 1`); `release_group` frees it and
//! publishes its free count in the LVB; `publish_group_free` updates the LVB alone.
//! `open_set`/`open_clear` maintain this node's entry for an inode in its bucket (the entry
//! carries the slot generation; entries of an older generation of my own slot are stale and
//! dropped when I next write the bucket); `open_others` lists other nodes' entries.

use crate::cluster::timing::Timing;
use crate::dev::{AlignedBuf, BlockDevice, CawOutcome, SharedDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::lock_record::{
    LockKind, LockMode, LockRecord, OpenEntry, SlotSet, BUCKET_ENTRIES, MAX_SLOTS, NONCE_OFFSET,
    NO_SLOT,
};
use crate::format::superblock::Superblock;
use crate::format::FS_BLOCK;
use rand::Rng;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often a record that fails validation is re-read before it counts as corrupted.
const TORN_READ_RETRIES: u32 = 5;
/// Contention backoff: first sleep and cap (each sleep is jittered ±50 %).
pub const BACKOFF_FIRST: Duration = Duration::from_micros(500);
pub const BACKOFF_MAX: Duration = Duration::from_millis(8);
/// For the first [`BACKOFF_QUICK_SPAN`] of a wait the sleeps stop doubling at
/// [`BACKOFF_QUICK_MAX`]: most waits are one handoff (a holder's mailbox poll, its hold
/// window, its commit: 5–15 ms), and a waiter that slept 8 ms just after the grant landed
/// added that to every handoff. About ten reads in those 20 ms, then at most one per 8 ms.
pub const BACKOFF_QUICK_MAX: Duration = Duration::from_millis(2);
/// See [`BACKOFF_QUICK_MAX`].
pub const BACKOFF_QUICK_SPAN: Duration = Duration::from_millis(20);

/// This node as lock records name it: its heartbeat slot and the slot's claim generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Me {
    pub slot: u32,
    pub gen: u64,
}

/// What [`LockTable::mark_group`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupMark {
    /// The mark names this node now (it may have already).
    Marked,
    /// Another node's mark is on the group: that slot's, at that record version (a new mark,
    /// even of the same slot, has a new version).
    Busy { slot: u32, version: u64 },
    /// Asked for a refill's mark, but the group is not this node's.
    NotMine,
}

/// Jittered exponential backoff, doubling only up to [`BACKOFF_QUICK_MAX`] during the first
/// [`BACKOFF_QUICK_SPAN`] of the wait.
#[derive(Debug)]
pub(crate) struct Backoff {
    cur: Duration,
    max: Duration,
    slept: Duration,
}

impl Backoff {
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Self {
            cur: first,
            max,
            slept: Duration::ZERO,
        }
    }

    /// The next sleep after one of `cur`, having slept `slept` in all (before jitter).
    fn next(cur: Duration, max: Duration, slept: Duration) -> Duration {
        let cap = if slept < BACKOFF_QUICK_SPAN {
            max.min(BACKOFF_QUICK_MAX)
        } else {
            max
        };
        (cur * 2).min(cap).max(cur.min(cap))
    }

    pub(crate) fn sleep(&mut self) {
        let f: f64 = rand::thread_rng().gen_range(0.5..1.5);
        std::thread::sleep(self.cur.mul_f64(f));
        self.slept += self.cur;
        self.cur = Self::next(self.cur, self.max, self.slept);
    }
}

/// First pause after a lock record's I/O failed; it doubles up to [`IO_PAUSE_MAX`].
const IO_PAUSE_FIRST: Duration = Duration::from_millis(20);
/// See [`IO_PAUSE_FIRST`].
const IO_PAUSE_MAX: Duration = Duration::from_millis(500);

/// "lock record N", for messages about one record of the lock table.
#[derive(Debug, Clone, Copy)]
struct RecordName(u64);

impl std::fmt::Display for RecordName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "lock record {}", self.0)
    }
}

/// How a read-modify-CAW loop on a lock record rides out failed COMPARE AND WRITEs (the one
/// home of that rule, for the lock table and the object locks alike).
///
/// On a dm-multipath map a COMPARE AND WRITE goes through `SG_IO` to the path dm picked, and dm
/// does not retry an ioctl on another path: while an iSCSI portal is down and multipathd has
/// not yet failed its path (its checker: tens of seconds), a CAW can end in
/// `DID_TRANSPORT_DISRUPTED`, outcome unknown. The read-back (a plain `O_DIRECT` read, which dm
/// does retry on another path) tells whether it landed; when it did not, giving up would turn
/// a path failover into `EIO` for an unlink. So a CAW error of unknown outcome
/// ([`crate::scsi::outcome_unknown`]: a SCSI timeout, transport failure or abort) counts as a
/// lost round: pause (20 ms doubling to 0.5 s), read again and decide again, until the errors
/// have lasted `budget` in a row. The budget is the lease's fail time: by then the heartbeat,
/// whose CAW goes the same way, has failed too and
/// [`LeaseGuard`](crate::cluster::membership::LeaseGuard) answers `Fenced`. Every other error
/// is returned at once: a fence, a reservation conflict, a corrupted record, a plain `EIO` of
/// a file or block device (nothing below would route it elsewhere), and a failed *read* (the
/// block layer below already retried it on every path).
#[derive(Debug)]
pub(crate) struct IoPatience {
    budget: Duration,
    since: Option<Instant>,
    errors: u32,
    pause: Duration,
}

impl IoPatience {
    pub(crate) fn new(budget: Duration) -> Self {
        Self {
            budget,
            since: None,
            errors: 0,
            pause: IO_PAUSE_FIRST,
        }
    }

    /// `Ok(())`: the error was absorbed after a pause, read the record again. Otherwise the
    /// error to return, saying for how long the I/O failed when it was retried at all.
    pub(crate) fn absorb(&mut self, e: Error, what: &dyn std::fmt::Display) -> Result<()> {
        if !crate::scsi::outcome_unknown(&e) {
            return Err(e);
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() >= self.budget {
            if self.errors == 0 {
                return Err(e);
            }
            return Err(e.wrap(format!(
                "{what}: still failing after {} errors in {} ms",
                self.errors + 1,
                since.elapsed().as_millis()
            )));
        }
        self.errors += 1;
        if self.errors == 1 {
            tracing::warn!(
                "{what}: {e}; reading it again (lock I/O errors are retried for up to {} s)",
                self.budget.as_secs()
            );
        }
        std::thread::sleep(self.pause);
        self.pause = (self.pause * 2).min(IO_PAUSE_MAX);
        Ok(())
    }

    /// A round's I/O worked: the next error starts a new streak.
    pub(crate) fn ok(&mut self, what: &dyn std::fmt::Display) {
        if let Some(since) = self.since.take() {
            if self.errors > 0 {
                tracing::info!(
                    "{what}: lock I/O works again after {} error(s) in {} ms",
                    self.errors,
                    since.elapsed().as_millis()
                );
            }
        }
        self.errors = 0;
        self.pause = IO_PAUSE_FIRST;
    }
}

/// Read the one-logical-block record at byte `offset` and decode it, re-reading a block that
/// fails `decode` up to [`TORN_READ_RETRIES`] times (200 µs × 2^attempt apart: a torn read
/// while another initiator's CAW runs) before reporting the last error, wrapped in `what`.
/// Returns the raw image (the `expected` of a CAW) and the decoded value. Every record that is
/// changed by COMPARE AND WRITE is read through here.
pub(crate) fn read_validated<T>(
    dev: &dyn BlockDevice,
    offset: u64,
    lbs: usize,
    what: &str,
    decode: impl Fn(&[u8]) -> Result<T>,
) -> Result<(Vec<u8>, T)> {
    let mut buf = AlignedBuf::new(lbs);
    let mut attempt = 0;
    loop {
        dev.read_at(offset, &mut buf)?;
        match decode(&buf) {
            Ok(v) => return Ok((buf.to_vec(), v)),
            Err(_) if attempt < TORN_READ_RETRIES => {
                attempt += 1;
                std::thread::sleep(Duration::from_micros(200 << attempt));
            }
            Err(e) => return Err(e.wrap(what)),
        }
    }
}

/// A random nonce that is non-zero and differs from `old` (the nonce of the image being
/// replaced), so that a read-back can tell the new image from every earlier one.
pub(crate) fn fresh_nonce(old: Option<u64>) -> u64 {
    loop {
        let n: u64 = rand::random();
        if n != 0 && Some(n) != old {
            break n;
        }
    }
}

/// One COMPARE AND WRITE of `image` over `expected` at logical block `lba`, with the
/// read-back rule: after a miscompare or an error of unknown outcome, `landed()` re-reads the
/// record and says whether it carries our nonce (the write landed although the device said
/// otherwise: the ATS lesson). Ok(true) = our image is on disk; Ok(false) = a real
/// miscompare; an error that did not land is returned as it came.
pub(crate) fn caw_read_back(
    dev: &dyn BlockDevice,
    lba: u64,
    expected: &[u8],
    image: &[u8],
    what: &dyn std::fmt::Display,
    landed: impl Fn() -> Result<bool>,
) -> Result<bool> {
    match dev.compare_and_write(lba, expected, image) {
        Ok(CawOutcome::Written) => Ok(true),
        Ok(CawOutcome::Miscompare) => landed(),
        Err(e) => match landed() {
            Ok(true) => {
                tracing::debug!("{what}: CAW reported {e} but our image landed");
                Ok(true)
            }
            _ => Err(e),
        },
    }
}

/// Which lock record protects what, from the superblock: record 0 global, `1 + g` group `g`,
/// the last `buckets` records open-file buckets. Clamped so that a wrong superblock gives
/// errors or collisions, never a panic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockLayout {
    pub lock_count: u64,
    /// Records the volume needs (`1 + group_count + inode_lock_slots`); 0 when unknown.
    pub needed: u64,
    pub groups: u64,
    pub bucket_base: u64,
    pub buckets: u64,
}

impl LockLayout {
    pub fn new(sb: &Superblock) -> Self {
        let lock_count = sb.lock_count;
        let buckets = u64::from(sb.inode_lock_slots)
            .min(lock_count.saturating_sub(1))
            .max(1);
        let bucket_base = lock_count.saturating_sub(buckets);
        Self {
            lock_count,
            needed: 1 + sb.group_count + u64::from(sb.inode_lock_slots),
            groups: sb.group_count.min(bucket_base.saturating_sub(1)),
            bucket_base,
            buckets,
        }
    }

    /// Record index of `ino`'s open-file bucket.
    pub fn bucket_of(&self, ino: u64) -> u64 {
        self.bucket_base + (ino.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % self.buckets
    }

    /// The kind and protected object of record `index`.
    pub fn kind_of(&self, index: u64) -> (LockKind, u64) {
        if index == LockTable::GLOBAL {
            (LockKind::Global, 0)
        } else if index < self.bucket_base {
            (LockKind::Group, index - 1)
        } else {
            (LockKind::OpenBucket, index - self.bucket_base)
        }
    }

    /// Decode record `index` and check that it is the record the layout puts there (a zero
    /// block decodes as a free record).
    pub fn decode_at(&self, buf: &[u8], index: u64) -> Result<LockRecord> {
        let (kind, object) = self.kind_of(index);
        match LockRecord::decode(buf, index)? {
            None => Ok(LockRecord::free(kind, index, object)),
            Some(r) if r.kind == kind && r.object == object => Ok(r),
            Some(r) => Err(Error::corrupted(format!(
                "lock record {index}: is a {:?} record for object {}, the layout expects {kind:?} {object}",
                r.kind, r.object
            ))),
        }
    }
}

/// The lock area of one volume.
#[derive(Debug)]
pub struct LockTable {
    dev: SharedDevice,
    lbs: usize,
    /// Byte offset of record 0.
    base: u64,
    lock_count: u64,
    /// The volume's group count as this node knows it (grows with `cetra grow`,
    /// [`LockTable::set_group_count`]).
    groups: AtomicU64,
    bucket_base: u64,
    buckets: u64,
    backoff_first: Duration,
    backoff_max: Duration,
    /// How long I/O errors in a row are retried through ([`IoPatience`]).
    io_patience: Duration,
    /// Group records read so far ([`LockTable::group_records`],
    /// [`LockTable::group_records_of`]): what the volume's size costs a node.
    group_records_read: AtomicU64,
}

/// The first slot of `set` after `slot` in ascending order, wrapping; `NO_SLOT` if none.
fn next_after(set: &SlotSet, slot: u32) -> u32 {
    set.iter()
        .find(|&s| s > slot)
        .or_else(|| set.iter().find(|&s| s != slot))
        .unwrap_or(NO_SLOT)
}

/// [`next_after`], passing over the slots `silent` names while another is left.
fn next_after_passing(set: &SlotSet, slot: u32, silent: &dyn Fn(u32) -> bool) -> u32 {
    let after = set.iter().filter(|&s| s > slot);
    let before = set.iter().filter(|&s| s < slot);
    after
        .chain(before)
        .find(|&s| !silent(s))
        .unwrap_or_else(|| next_after(set, slot))
}

pub(crate) fn check_slot(slot: u32) -> Result<()> {
    if usize::try_from(slot).is_ok_and(|s| s < MAX_SLOTS) {
        Ok(())
    } else {
        bail!(
            InvalidInput,
            "node slot {slot} is outside the lock table's {MAX_SLOTS} slots"
        )
    }
}

/// What the heartbeat area says about a slot named in a lock record, read *after* the lock
/// record (a node claims its slot before it writes any lock and releases or is recovered
/// before its slot turns Free, so a mention judged stale against a later heartbeat read, and
/// removed by a CAW against the lock image read before it, cannot belong to a live node).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotLife {
    /// Held by a mounted node of this generation (or one not yet found dead): what it holds
    /// at this generation stands.
    Live(u64),
    /// Free, never used, or beyond the slots a node can claim (`max_nodes`): holds nothing.
    Gone,
    /// Recovering (its recoverer scrubs it), damaged or unreadable: left alone.
    Unknown,
}

/// What [`LockTable::repair_corrupt`] did: the records reset, and those left corrupted (with
/// why) because another node may be alive.
pub type Repaired = (Vec<u64>, Vec<(u64, Error)>);

/// One mention of a slot in a lock record that no live node stands behind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stale {
    /// "owner", "holder", "waiter", "next" or "open entry".
    pub role: &'static str,
    pub slot: u32,
    /// The generation the record names (owner and open entries only).
    pub gen: Option<u64>,
    /// The inode of an open entry.
    pub ino: Option<u64>,
}

impl std::fmt::Display for Stale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} slot {}", self.role, self.slot)?;
        if let Some(g) = self.gen {
            write!(f, " (generation {g})")?;
        }
        if let Some(i) = self.ino {
            write!(f, " for inode {i}")?;
        }
        Ok(())
    }
}

/// The staleness rule: a mention of `slot` (at generation `gen`, when the record names one)
/// is stale when the slot holds nothing, or holds another generation.
pub(crate) fn is_stale(life: SlotLife, gen: Option<u64>) -> bool {
    match life {
        SlotLife::Gone => true,
        SlotLife::Live(g) => gen.is_some_and(|want| want != g),
        SlotLife::Unknown => false,
    }
}

/// Every stale mention in `rec` ([`SlotLife`]); `life(s)` describes slot `s`.
pub fn stale_mentions(rec: &LockRecord, life: &dyn Fn(u32) -> SlotLife) -> Vec<Stale> {
    let mut out = Vec::new();
    let mention = |role, slot, gen, ino| Stale {
        role,
        slot,
        gen,
        ino,
    };
    if rec.owner != NO_SLOT && is_stale(life(rec.owner), Some(rec.owner_gen)) {
        out.push(mention("owner", rec.owner, Some(rec.owner_gen), None));
    }
    for s in rec.holders.iter().filter(|&s| is_stale(life(s), None)) {
        out.push(mention("holder", s, None, None));
    }
    for s in rec.waiters.iter().filter(|&s| is_stale(life(s), None)) {
        out.push(mention("waiter", s, None, None));
    }
    if rec.next != NO_SLOT && is_stale(life(rec.next), None) {
        out.push(mention("next", rec.next, None, None));
    }
    for e in rec
        .entries
        .iter()
        .filter(|e| is_stale(life(e.slot), Some(e.slot_gen)))
    {
        out.push(mention("open entry", e.slot, Some(e.slot_gen), Some(e.ino)));
    }
    out
}

/// Modes that contradict the owner and holders: exclusive without an owner, shared without
/// holders, an owner or holders on a record that is not held that way. Nothing can ever
/// grant or release such a record, so it blocks its lock forever.
pub fn inconsistency(rec: &LockRecord) -> Option<&'static str> {
    match rec.mode {
        LockMode::Exclusive if rec.owner == NO_SLOT => Some("exclusive without an owner"),
        LockMode::Exclusive if !rec.holders.is_empty() => Some("exclusive with shared holders"),
        LockMode::Shared if rec.holders.is_empty() => Some("shared without holders"),
        LockMode::Shared | LockMode::Free if rec.owner != NO_SLOT => {
            Some("an owner on a record not held exclusively")
        }
        LockMode::Free if !rec.holders.is_empty() => Some("holders on a free record"),
        _ => None,
    }
}

/// `rec` without its stale mentions, and with a mode that matches what is left. A global
/// record whose exclusive owner goes has its version bumped (every cache revalidates).
fn scrubbed(rec: &LockRecord, life: &dyn Fn(u32) -> SlotLife) -> LockRecord {
    let mut n = rec.clone();
    let owner_gone = rec.owner != NO_SLOT && is_stale(life(rec.owner), Some(rec.owner_gen));
    if owner_gone || (rec.mode == LockMode::Exclusive && rec.owner == NO_SLOT) {
        if rec.mode == LockMode::Exclusive {
            n.mode = LockMode::Free;
            if rec.kind == LockKind::Global {
                n.version = rec.version.wrapping_add(1);
            }
        }
        n.owner = NO_SLOT;
        n.owner_gen = 0;
    }
    if n.mode != LockMode::Exclusive && n.owner != NO_SLOT {
        n.owner = NO_SLOT;
        n.owner_gen = 0;
    }
    n.holders = SlotSet::default();
    if n.mode == LockMode::Shared {
        for s in rec.holders.iter().filter(|&s| !is_stale(life(s), None)) {
            n.holders.insert(s);
        }
        if n.holders.is_empty() {
            n.mode = LockMode::Free;
        }
    }
    for s in rec.waiters.iter().filter(|&s| is_stale(life(s), None)) {
        n.waiters.remove(s);
    }
    if n.next != NO_SLOT && is_stale(life(n.next), None) {
        // A group's `next` is its mark (format 7), not a handoff target: nobody inherits it.
        n.next = if rec.kind == LockKind::Group {
            NO_SLOT
        } else {
            next_after(&n.waiters, n.next)
        };
    }
    n.entries
        .retain(|e| !is_stale(life(e.slot), Some(e.slot_gen)));
    n
}

impl LockTable {
    pub const GLOBAL: u64 = 0;

    pub fn new(dev: SharedDevice, sb: &Superblock) -> Self {
        let l = LockLayout::new(sb);
        if l.lock_count < l.needed {
            tracing::warn!(
                "lock area has {} records, fewer than the {} the volume needs; \
                 using fewer group and bucket records",
                l.lock_count,
                l.needed
            );
        }
        Self {
            dev,
            lbs: sb.logical_block_size as usize,
            base: sb.lock_start.saturating_mul(FS_BLOCK),
            lock_count: l.lock_count,
            groups: AtomicU64::new(l.groups),
            bucket_base: l.bucket_base,
            buckets: l.buckets,
            backoff_first: BACKOFF_FIRST,
            backoff_max: BACKOFF_MAX,
            io_patience: Timing::from_ms(sb.heartbeat_interval_ms, sb.io_timeout_ms).fail_time(),
            group_records_read: AtomicU64::new(0),
        }
    }

    /// Which record is which (shared with fsck).
    pub fn layout(&self) -> LockLayout {
        LockLayout {
            lock_count: self.lock_count,
            needed: 0,
            groups: self.group_count(),
            bucket_base: self.bucket_base,
            buckets: self.buckets,
        }
    }

    /// Other contention backoff bounds (tests on memory devices poll faster).
    #[must_use]
    pub fn with_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff_first = first.max(Duration::from_micros(1));
        self.backoff_max = max.max(self.backoff_first);
        self
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(self.backoff_first, self.backoff_max)
    }

    /// How long I/O errors of a lock change are retried through (default: the lease's fail
    /// time from the superblock's timings; tests shorten it).
    #[must_use]
    pub fn with_io_patience(mut self, budget: Duration) -> Self {
        self.io_patience = budget;
        self
    }

    pub fn group_index(&self, g: u64) -> u64 {
        g.saturating_add(1)
    }

    /// Record index of `ino`'s open-file bucket.
    pub fn bucket_of(&self, ino: u64) -> u64 {
        self.layout().bucket_of(ino)
    }

    /// Number of group records in use (the volume's group count).
    pub fn group_count(&self) -> u64 {
        self.groups.load(Ordering::Acquire)
    }

    /// The volume grew to `groups` groups (`fs/grow.rs`), at most as many as the lock area has
    /// group records for; returns the count now in use. Never shrinks.
    pub fn set_group_count(&self, groups: u64) -> u64 {
        let n = groups.min(self.bucket_base.saturating_sub(1));
        self.groups.fetch_max(n, Ordering::AcqRel).max(n)
    }

    /// First bucket record and number of buckets.
    pub fn bucket_range(&self) -> (u64, u64) {
        (self.bucket_base, self.buckets)
    }

    pub fn lock_count(&self) -> u64 {
        self.lock_count
    }

    /// The kind and protected object of record `index`, from the layout.
    pub fn kind_of(&self, index: u64) -> (LockKind, u64) {
        self.layout().kind_of(index)
    }

    fn offset(&self, index: u64) -> u64 {
        self.base
            .saturating_add(index.saturating_mul(self.lbs as u64))
    }

    fn lba(&self, index: u64) -> u64 {
        self.offset(index) / (self.lbs.max(1) as u64)
    }

    fn check_range(&self, first: u64, n: u64) -> Result<()> {
        if first.checked_add(n).is_none_or(|end| end > self.lock_count) {
            bail!(
                Range,
                "lock records {first}..+{n} are outside the lock area of {} records",
                self.lock_count
            );
        }
        Ok(())
    }

    fn check_group(&self, g: u64) -> Result<()> {
        let groups = self.group_count();
        if g >= groups {
            bail!(
                InvalidInput,
                "allocation group {g} does not exist (the volume has {groups})"
            );
        }
        Ok(())
    }

    fn decode_at(&self, buf: &[u8], index: u64) -> Result<LockRecord> {
        self.layout().decode_at(buf, index)
    }

    /// Read one record, re-reading one that fails validation a few times (a torn read while
    /// another initiator's CAW runs) before calling it corrupted. Returns the raw image (the
    /// `expected` of a CAW) and the decoded record (a zero block decodes as a free record).
    pub fn read(&self, index: u64) -> Result<(Vec<u8>, LockRecord)> {
        self.check_range(index, 1)?;
        read_validated(
            &*self.dev,
            self.offset(index),
            self.lbs,
            "lock record unreadable after re-reads",
            |b| self.decode_at(b, index),
        )
    }

    /// `n` consecutive records from `first` in one device read (a record that fails validation
    /// is re-read on its own, like [`Self::read`]).
    pub fn read_range(&self, first: u64, n: u64) -> Result<Vec<LockRecord>> {
        self.read_range_each(first, n)?.into_iter().collect()
    }

    /// Like [`Self::read_range`], but a record that stays corrupted is an `Err` in its own
    /// place instead of failing the whole range (the outer `Err` is a device error).
    /// Every record in use, with its index: the global lock, the groups the volume has, the
    /// open-file buckets. Group records reserved for a grow (format 5: most of the area on a
    /// new volume) are never written until a grow gives them a group, so they are not read.
    pub fn read_in_use(&self) -> Result<Vec<(u64, Result<LockRecord>)>> {
        let groups_end = 1 + self.group_count();
        let mut out: Vec<(u64, Result<LockRecord>)> =
            (0..).zip(self.read_range_each(0, groups_end)?).collect();
        let buckets = self.lock_count.saturating_sub(self.bucket_base);
        out.extend((self.bucket_base..).zip(self.read_range_each(self.bucket_base, buckets)?));
        Ok(out)
    }

    pub fn read_range_each(&self, first: u64, n: u64) -> Result<Vec<Result<LockRecord>>> {
        self.check_range(first, n)?;
        let len = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(self.lbs))
            .ok_or_else(|| Error::new(ErrorKind::Range, "lock record range too large"))?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let mut buf = AlignedBuf::new(len);
        self.dev.read_at(self.offset(first), &mut buf)?;
        Ok(buf
            .chunks(self.lbs)
            .zip(first..)
            .map(|(b, i)| match self.decode_at(b, i) {
                Ok(r) => Ok(r),
                Err(_) => self.read(i).map(|(_, r)| r),
            })
            .collect())
    }

    /// One COMPARE AND WRITE of `new` (stamped with its index and a fresh nonce) over
    /// `expected`. Ok(true) if our image is on disk. After a miscompare or a CAW error the
    /// record is re-read: our nonce there means the write landed. Otherwise a miscompare is
    /// Ok(false) and an error is returned as it came.
    pub fn swap(&self, index: u64, expected: &[u8], new: &mut LockRecord) -> Result<bool> {
        self.check_range(index, 1)?;
        let (kind, object) = self.kind_of(index);
        if new.kind != kind || new.object != object {
            bail!(
                InvalidInput,
                "lock record {index} is {kind:?} {object}, not {:?} {}",
                new.kind,
                new.object
            );
        }
        let old_nonce = expected
            .get(NONCE_OFFSET..NONCE_OFFSET + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_le_bytes);
        new.index = index;
        new.nonce = fresh_nonce(old_nonce);
        let image = new.encode(self.lbs);
        let nonce = new.nonce;
        caw_read_back(
            &*self.dev,
            self.lba(index),
            expected,
            &image,
            &RecordName(index),
            || Ok(self.read(index)?.1.nonce == nonce),
        )
    }

    /// Read-modify-CAW until it sticks: `f` sees the current record and returns the record to
    /// write, or None to stop without writing. Miscompares retry with jittered backoff.
    pub fn update(
        &self,
        index: u64,
        mut f: impl FnMut(&LockRecord) -> Option<LockRecord>,
    ) -> Result<Option<LockRecord>> {
        let mut backoff = self.backoff();
        let mut io = IoPatience::new(self.io_patience);
        // Named only if an error needs it: no string is built per call.
        let what = RecordName(index);
        loop {
            let (raw, cur) = self.read(index)?;
            let Some(mut new) = f(&cur) else {
                return Ok(None);
            };
            match self.swap(index, &raw, &mut new) {
                Ok(true) => return Ok(Some(new)),
                Ok(false) => io.ok(&what),
                Err(e) => {
                    io.absorb(e, &what)?;
                    continue;
                }
            }
            backoff.sleep();
        }
    }

    /// Block until `me` holds record 0 in `mode` (Shared or Exclusive); returns the record as
    /// granted. `abort` is polled every round; Some(err) ends the wait with that error.
    pub fn acquire_global(
        &self,
        me: Me,
        mode: LockMode,
        handoff_grace: Duration,
        abort: &dyn Fn() -> Option<Error>,
    ) -> Result<LockRecord> {
        self.acquire_global_notify(me, mode, handoff_grace, &|_| false, abort, &|_| {})
    }

    /// [`acquire_global`](Self::acquire_global), calling `notify(record)` after each round in
    /// which `me` waits (registered in the waiters of `record`), so that the caller can tell
    /// the holders (on a v3 volume: a request in their mailboxes, fs/cluster.rs). A `next`
    /// that `silent` names (its heartbeat stopped: a node that died waiting) is not waited
    /// for at all, rather than for `handoff_grace`.
    pub fn acquire_global_notify(
        &self,
        me: Me,
        mode: LockMode,
        handoff_grace: Duration,
        silent: &dyn Fn(u32) -> bool,
        abort: &dyn Fn() -> Option<Error>,
        notify: &dyn Fn(&LockRecord),
    ) -> Result<LockRecord> {
        check_slot(me.slot)?;
        if mode == LockMode::Free {
            bail!(InvalidInput, "acquire_global needs Shared or Exclusive");
        }
        let mut backoff = self.backoff();
        let mut last: Option<Vec<u8>> = None;
        let mut since = Instant::now();
        let mut io = IoPatience::new(self.io_patience);
        let what = "the global lock (record 0)";
        // A grant whose CAW ended in doubt may have landed: the next read tells, and no abort
        // comes before it (an abort then would leave this node holding the lock on disk
        // without knowing it).
        let mut in_doubt = false;
        loop {
            if !in_doubt {
                if let Some(e) = abort() {
                    self.leave_waiters(me);
                    return Err(e);
                }
            }
            let (raw, rec) = self.read(Self::GLOBAL)?;
            if Self::holds(&rec, me, mode) {
                return Ok(rec);
            }
            in_doubt = false;
            if last.as_deref() != Some(&raw[..]) {
                last = Some(raw.clone());
                since = Instant::now();
            }
            let eligible = rec.next == NO_SLOT
                || rec.next == me.slot
                || since.elapsed() >= handoff_grace
                || silent(rec.next);
            let compatible = match mode {
                LockMode::Exclusive => {
                    rec.mode == LockMode::Free
                        || (rec.mode == LockMode::Shared
                            && rec.holders.iter().all(|s| s == me.slot))
                }
                _ => {
                    rec.mode == LockMode::Free
                        || (rec.mode == LockMode::Shared && !Self::others_waiting(&rec, me))
                }
            };
            if eligible && compatible {
                let mut new = rec.clone();
                if mode == LockMode::Exclusive {
                    new.mode = LockMode::Exclusive;
                    new.owner = me.slot;
                    new.owner_gen = me.gen;
                    new.holders = SlotSet::default();
                    new.version = rec.version.wrapping_add(1);
                } else {
                    new.mode = LockMode::Shared;
                    new.holders.insert(me.slot);
                    new.owner = NO_SLOT;
                    new.owner_gen = 0;
                }
                new.waiters.remove(me.slot);
                new.next = NO_SLOT;
                match self.swap(Self::GLOBAL, &raw, &mut new) {
                    Ok(true) => return Ok(new),
                    Ok(false) => io.ok(&what),
                    // Unknown outcome: the next round's read shows whether we hold it.
                    Err(e) => {
                        io.absorb(e, &what)?;
                        in_doubt = true;
                        continue;
                    }
                }
            } else if !rec.waiters.contains(me.slot) {
                let mut new = rec.clone();
                new.waiters.insert(me.slot);
                // A lost race is fine: the next round sees the new record and tries again.
                match self.swap(Self::GLOBAL, &raw, &mut new) {
                    Ok(true) => {
                        io.ok(&what);
                        notify(&new);
                    }
                    Ok(false) => io.ok(&what),
                    Err(e) => {
                        io.absorb(e, &what)?;
                        continue;
                    }
                }
            } else {
                notify(&rec);
            }
            backoff.sleep();
        }
    }

    /// Best effort: take `me` out of the global waiters after giving up waiting.
    fn leave_waiters(&self, me: Me) {
        let r = self.update(Self::GLOBAL, |r| {
            if !r.waiters.contains(me.slot) {
                return None;
            }
            let mut n = r.clone();
            n.waiters.remove(me.slot);
            if n.next == me.slot {
                n.next = next_after(&n.waiters, me.slot);
            }
            Some(n)
        });
        if let Err(e) = r {
            tracing::debug!("could not leave the global lock's waiters: {e}");
        }
    }

    /// Give up record 0 (either mode) and hand it round-robin to the next waiter after my slot.
    /// Ok also when I did not hold it.
    pub fn release_global(&self, me: Me) -> Result<()> {
        self.release_global_passing(me, &|_| false)
    }

    /// [`release_global`](Self::release_global), naming as `next` the first waiter after my
    /// slot that `silent` does not name (a waiter whose heartbeat stopped would make the
    /// others wait out the handoff grace at every release until it is recovered); if all
    /// are silent, the first.
    pub fn release_global_passing(&self, me: Me, silent: &dyn Fn(u32) -> bool) -> Result<()> {
        self.update(Self::GLOBAL, |r| {
            let owner = r.owner == me.slot;
            let holder = r.holders.contains(me.slot);
            let waiter = r.waiters.contains(me.slot);
            if !owner && !holder && !waiter {
                return None;
            }
            let mut n = r.clone();
            if owner {
                n.mode = LockMode::Free;
                n.owner = NO_SLOT;
                n.owner_gen = 0;
            }
            n.holders.remove(me.slot);
            if n.mode == LockMode::Shared && n.holders.is_empty() {
                n.mode = LockMode::Free;
            }
            n.waiters.remove(me.slot);
            if owner || holder || n.next == me.slot {
                n.next = next_after_passing(&n.waiters, me.slot, silent);
            }
            Some(n)
        })?;
        Ok(())
    }

    /// Is some slot other than me waiting (the lock keeper's cue to release)?
    pub fn others_waiting(rec: &LockRecord, me: Me) -> bool {
        rec.waiters.iter().any(|s| s != me.slot)
    }

    /// Does `rec` show me holding it in at least `mode`?
    pub fn holds(rec: &LockRecord, me: Me, mode: LockMode) -> bool {
        let excl =
            rec.mode == LockMode::Exclusive && rec.owner == me.slot && rec.owner_gen == me.gen;
        match mode {
            LockMode::Free => true,
            LockMode::Shared => {
                excl || (rec.mode == LockMode::Shared && rec.holders.contains(me.slot))
            }
            LockMode::Exclusive => excl,
        }
    }

    /// Remove every trace of dead `slot` from the lock area. Idempotent.
    pub fn scrub_slot(&self, slot: u32) -> Result<()> {
        check_slot(slot)?;
        let mentions = |r: &LockRecord| {
            r.owner == slot
                || r.holders.contains(slot)
                || r.waiters.contains(slot)
                || r.next == slot
        };
        // A corrupted record 0 names nobody readably, and nobody can take it until it is reset
        // (`repair_corrupt`): nothing to release there.
        let global_readable = match self.read(Self::GLOBAL) {
            Ok(_) => true,
            Err(e) if e.kind() == ErrorKind::Corrupted => false,
            Err(e) => return Err(e),
        };
        let global = |r: &LockRecord| {
            if !mentions(r) {
                return None;
            }
            let mut n = r.clone();
            let owned = r.owner == slot;
            let held = owned || r.holders.contains(slot);
            if owned {
                n.mode = LockMode::Free;
                n.owner = NO_SLOT;
                n.owner_gen = 0;
                // Its replayed changes are home now: every cache must revalidate.
                n.version = r.version.wrapping_add(1);
            }
            n.holders.remove(slot);
            if n.mode == LockMode::Shared && n.holders.is_empty() {
                n.mode = LockMode::Free;
            }
            n.waiters.remove(slot);
            if held || n.next == slot {
                n.next = next_after(&n.waiters, slot);
            }
            Some(n)
        };
        if global_readable {
            self.update(Self::GLOBAL, global)?;
        }
        // A corrupted group or bucket record names nobody readably: it is skipped here (and
        // reset by `repair_corrupt` once no other node is alive), not a reason to fail.
        for (g, rec) in (0..).zip(self.read_range_each(1, self.group_count())?) {
            let Ok(rec) = rec else { continue };
            if !mentions(&rec) {
                continue;
            }
            self.update(self.group_index(g), |r| {
                if !mentions(r) {
                    return None;
                }
                let mut n = r.clone();
                if r.owner == slot {
                    n.mode = LockMode::Free;
                    n.owner = NO_SLOT;
                    n.owner_gen = 0;
                }
                n.holders.remove(slot);
                if n.mode == LockMode::Shared && n.holders.is_empty() {
                    n.mode = LockMode::Free;
                }
                n.waiters.remove(slot);
                if n.next == slot {
                    n.next = NO_SLOT;
                }
                Some(n)
            })?;
        }
        let has = |r: &LockRecord| r.entries.iter().any(|e| e.slot == slot);
        for (i, rec) in
            (self.bucket_base..).zip(self.read_range_each(self.bucket_base, self.buckets)?)
        {
            let Ok(rec) = rec else { continue };
            if !has(&rec) {
                continue;
            }
            self.update(i, |r| {
                if !has(r) {
                    return None;
                }
                let mut n = r.clone();
                n.entries.retain(|e| e.slot != slot);
                Some(n)
            })?;
        }
        Ok(())
    }

    /// Remove every stale mention ([`stale_mentions`]) from every lock record, and give
    /// records whose mode contradicts their owner or holders the mode that matches what is
    /// left. `life()` reads the heartbeat area; it is called after each lock record is read,
    /// and the new image is CAW'd against that read (see [`SlotLife`] for why this cannot
    /// remove a live node's lock). Returns one line per record changed, for the log.
    /// Corrupted records are skipped (see [`Self::repair_corrupt`]).
    pub fn scrub_stale(&self, life: &dyn Fn() -> Result<Vec<SlotLife>>) -> Result<Vec<String>> {
        let at = |lives: &[SlotLife], s: u32| {
            usize::try_from(s)
                .ok()
                .and_then(|s| lives.get(s).copied())
                .unwrap_or(SlotLife::Gone)
        };
        let all = self.read_in_use()?;
        let first = life()?;
        let mut changed = Vec::new();
        for (index, rec) in all {
            let Ok(rec) = rec else { continue };
            if scrubbed(&rec, &|s| at(&first, s)) == rec {
                continue;
            }
            let mut backoff = self.backoff();
            loop {
                let (raw, cur) = self.read(index)?;
                let lives = life()?;
                let f = |s| at(&lives, s);
                let mut new = scrubbed(&cur, &f);
                if new == cur {
                    break;
                }
                let what: Vec<String> = stale_mentions(&cur, &f)
                    .iter()
                    .map(ToString::to_string)
                    .chain(inconsistency(&cur).map(String::from))
                    .collect();
                if self.swap(index, &raw, &mut new)? {
                    changed.push(format!(
                        "lock record {index} ({:?} {}): removed {}",
                        cur.kind,
                        cur.object,
                        what.join(", ")
                    ));
                    break;
                }
                backoff.sleep();
            }
        }
        Ok(changed)
    }

    /// Reset every lock record that stays corrupted after re-reads, if `alone()` (a heartbeat
    /// scan made after the corrupted image was read) says no other node can hold any lock:
    /// the corrupted bytes are the CAW's verify image, so a record some node rewrote meanwhile
    /// is left to the next round. Record 0 becomes exclusively `me`'s (version 1) so that
    /// nobody can take the metadata lock before this node has recovered the dead and released
    /// it; group records become free (no published free count), buckets empty. Returns the
    /// records reset, and those left corrupted because another node may be alive.
    pub fn repair_corrupt(&self, me: Me, alone: &dyn Fn() -> Result<bool>) -> Result<Repaired> {
        check_slot(me.slot)?;
        let mut reset = Vec::new();
        let mut left = Vec::new();
        for (index, rec) in self.read_in_use()? {
            let Err(why) = rec else { continue };
            let mut buf = AlignedBuf::new(self.lbs);
            self.dev.read_at(self.offset(index), &mut buf)?;
            if self.decode_at(&buf, index).is_ok() {
                continue; // rewritten meanwhile
            }
            if !alone()? {
                left.push((index, why));
                continue;
            }
            let (kind, object) = self.kind_of(index);
            let mut new = LockRecord::free(kind, index, object);
            if kind == LockKind::Global {
                new.mode = LockMode::Exclusive;
                new.owner = me.slot;
                new.owner_gen = me.gen;
                new.version = 1;
            }
            // A miscompare re-reads the record, which may still be corrupted: not ours then.
            if self.swap(index, &buf, &mut new).unwrap_or(false) {
                tracing::error!(
                    "lock record {index} ({kind:?} {object}) was corrupted ({why}); no other node is alive, so it was reset"
                );
                reset.push(index);
            } else {
                left.push((index, why));
            }
        }
        Ok((reset, left))
    }

    /// Take group `g` if it is Free (version + 1). True if it is now mine (also if it already
    /// was).
    pub fn claim_group(&self, g: u64, me: Me) -> Result<bool> {
        self.claim(g, me, false)
    }

    /// Format 8 (docs/locking.md §9 "Group claims"): claim group `g` **without the global
    /// lock** — one CAW from Free *and unmarked* to owned by `me` and marked by `me`
    /// (`version + 1`). Unmarked means nobody changes it now: a node under the global lock
    /// marks a group nobody owns before it uses it, and takes the mark off only once what it
    /// changed there is home. False if the group is owned or marked (nothing written).
    pub fn claim_group_marked(&self, g: u64, me: Me) -> Result<bool> {
        self.claim(g, me, true)
    }

    /// [`claim_group`](Self::claim_group), and with `marked`
    /// [`claim_group_marked`](Self::claim_group_marked).
    fn claim(&self, g: u64, me: Me, marked: bool) -> Result<bool> {
        self.check_group(g)?;
        check_slot(me.slot)?;
        let mut mine = false;
        self.update(self.group_index(g), |r| {
            // Decided anew on every read (a lost CAW is retried on what is there now).
            mine = r.mode == LockMode::Exclusive
                && r.owner == me.slot
                && r.owner_gen == me.gen
                && (!marked || r.next == me.slot);
            if mine || r.mode != LockMode::Free || (marked && r.next != NO_SLOT) {
                return None;
            }
            let mut n = r.clone();
            n.mode = LockMode::Exclusive;
            n.owner = me.slot;
            n.owner_gen = me.gen;
            n.holders = SlotSet::default();
            n.waiters.remove(me.slot);
            // `next` is the group's mark (format 7): independent of who owns it, kept by a
            // claim under the global lock, this node's after a claim without it.
            if marked {
                n.next = me.slot;
            }
            n.version = r.version.wrapping_add(1);
            mine = true;
            Some(n)
        })?;
        Ok(mine)
    }

    /// Ask for group `g`, owned by another node: its owner gives it back (at its next metadata
    /// lock grant) when it sees a waiter. A no-op if it is free, mine, or already asked for.
    pub fn want_group(&self, g: u64, me: Me) -> Result<()> {
        self.check_group(g)?;
        check_slot(me.slot)?;
        self.update(self.group_index(g), |r| {
            if r.mode == LockMode::Free || r.owner == me.slot || r.waiters.contains(me.slot) {
                return None;
            }
            let mut n = r.clone();
            n.waiters.insert(me.slot);
            Some(n)
        })?;
        Ok(())
    }

    /// Put this node's **mark** on group `g` (format 7, docs/locking.md §9 "Group marks"):
    /// the record's `next` names the one node that may change the group's bitmap outside the
    /// ordinary rule (its owner refilling without the global lock, or another node changing a
    /// group it does not own under the global lock). `owner_only`: only if the group is this
    /// node's (a refill). Version + 1, so a node that checks the group later re-reads it.
    pub fn mark_group(&self, g: u64, me: Me, owner_only: bool) -> Result<GroupMark> {
        self.check_group(g)?;
        check_slot(me.slot)?;
        let mut out = GroupMark::Marked;
        self.update(self.group_index(g), |r| {
            let mine = r.mode == LockMode::Exclusive && r.owner == me.slot && r.owner_gen == me.gen;
            if owner_only && !mine {
                out = GroupMark::NotMine;
                return None;
            }
            if r.next == me.slot {
                out = GroupMark::Marked;
                return None;
            }
            if r.next != NO_SLOT {
                out = GroupMark::Busy {
                    slot: r.next,
                    version: r.version,
                };
                return None;
            }
            out = GroupMark::Marked;
            let mut n = r.clone();
            n.next = me.slot;
            n.version = r.version.wrapping_add(1);
            Some(n)
        })?;
        Ok(out)
    }

    /// Take this node's mark off group `g` (everything it changed there is home), publishing
    /// `free` in the value block if given. A no-op if the mark is not this node's.
    pub fn unmark_group(&self, g: u64, me: Me, free: Option<u64>) -> Result<()> {
        self.check_group(g)?;
        check_slot(me.slot)?;
        self.update(self.group_index(g), |r| {
            if r.next != me.slot {
                return None;
            }
            let mut n = r.clone();
            n.next = NO_SLOT;
            n.version = r.version.wrapping_add(1);
            if let Some(free) = free {
                n.set_group_free(free);
            }
            Some(n)
        })?;
        Ok(())
    }

    /// Every group record, in one read.
    pub fn group_records(&self) -> Result<Vec<LockRecord>> {
        let n = self.group_count();
        self.group_records_read.fetch_add(n, Ordering::Relaxed);
        self.read_range(self.group_index(0), n)
    }

    /// The records of groups `gs` only: one read per run of adjacent groups.
    pub fn group_records_of(&self, gs: &[u64]) -> Result<Vec<(u64, LockRecord)>> {
        let mut gs = gs.to_vec();
        gs.sort_unstable();
        gs.dedup();
        let mut out = Vec::with_capacity(gs.len());
        let mut i = 0;
        while let Some(&first) = gs.get(i) {
            self.check_group(first)?;
            let mut n = 1;
            while gs.get(i + n) == Some(&first.saturating_add(n as u64)) {
                n += 1;
            }
            let n64 = n as u64;
            self.group_records_read.fetch_add(n64, Ordering::Relaxed);
            let recs = self.read_range(self.group_index(first), n64)?;
            out.extend((first..).zip(recs));
            i += n;
        }
        Ok(out)
    }

    /// The size of every group record together: what [`LockTable::group_records`] reads.
    pub fn group_record_bytes(&self) -> u64 {
        self.group_count().saturating_mul(self.lbs as u64)
    }

    /// How many group records this node read ([`LockTable::group_records`],
    /// [`LockTable::group_records_of`]).
    pub fn group_records_read(&self) -> u64 {
        self.group_records_read.load(Ordering::Relaxed)
    }

    /// If group `g` is mine: Free it, publishing its free-block count in the LVB.
    pub fn release_group(&self, g: u64, me: Me, free: u64) -> Result<()> {
        self.check_group(g)?;
        check_slot(me.slot)?;
        self.update(self.group_index(g), |r| {
            if r.owner != me.slot {
                return None;
            }
            let mut n = r.clone();
            n.mode = LockMode::Free;
            n.owner = NO_SLOT;
            n.owner_gen = 0;
            n.set_group_free(free);
            Some(n)
        })?;
        Ok(())
    }

    /// Publish group `g`'s free-block count in its LVB, whoever owns it.
    pub fn publish_group_free(&self, g: u64, free: u64) -> Result<()> {
        self.check_group(g)?;
        self.update(self.group_index(g), |r| {
            if r.group_free() == Some(free) {
                return None;
            }
            let mut n = r.clone();
            n.set_group_free(free);
            Some(n)
        })?;
        Ok(())
    }

    /// For every group: its exclusive owner (`NO_SLOT` if none) and the free count in its LVB.
    pub fn group_owners(&self) -> Result<Vec<(u32, Option<u64>)>> {
        Ok(self
            .read_range(1, self.group_count())?
            .iter()
            .map(|r| {
                let owner = if r.mode == LockMode::Exclusive {
                    r.owner
                } else {
                    NO_SLOT
                };
                (owner, r.group_free())
            })
            .collect())
    }

    /// Register (or update) this node's open of `ino`; `writer` = open for writing here.
    pub fn open_set(&self, ino: u64, me: Me, writer: bool) -> Result<()> {
        check_slot(me.slot)?;
        let index = self.bucket_of(ino);
        let mut full = false;
        self.update(index, |r| {
            full = false;
            let mut n = r.clone();
            // Entries of an older generation of my own slot are leftovers of a dead mount.
            n.entries
                .retain(|e| e.slot != me.slot || e.slot_gen == me.gen);
            if let Some(e) = n
                .entries
                .iter_mut()
                .find(|e| e.ino == ino && e.slot == me.slot)
            {
                e.writer = writer;
            } else if n.entries.len() >= BUCKET_ENTRIES {
                full = true;
                return None;
            } else {
                n.entries.push(OpenEntry {
                    ino,
                    slot: me.slot,
                    writer,
                    slot_gen: me.gen,
                });
            }
            (n != *r).then_some(n)
        })?;
        if full {
            bail!(
                Busy,
                "open-file bucket {} (lock record {index}) is full: {BUCKET_ENTRIES} opens across the cluster hash to it; this is a lock-table limit (the volume has {} buckets, fixed at mkfs)",
                index - self.bucket_base,
                self.buckets
            );
        }
        Ok(())
    }

    /// Drop this node's registration of `ino`.
    pub fn open_clear(&self, ino: u64, me: Me) -> Result<()> {
        check_slot(me.slot)?;
        self.update(self.bucket_of(ino), |r| {
            if !r.entries.iter().any(|e| e.ino == ino && e.slot == me.slot) {
                return None;
            }
            let mut n = r.clone();
            n.entries.retain(|e| e.ino != ino || e.slot != me.slot);
            Some(n)
        })?;
        Ok(())
    }

    /// Other nodes' registrations of `ino`.
    pub fn open_others(&self, ino: u64, me: Me) -> Result<Vec<OpenEntry>> {
        let (_, r) = self.read(self.bucket_of(ino))?;
        Ok(r.entries
            .into_iter()
            .filter(|e| e.ino == ino && e.slot != me.slot)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::mem::MemDevice;
    use crate::dev::{BlockDevice, Geometry};
    use crate::mkfs::{format, MkfsOptions};
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};

    /// The waits between polls: doubling from the first to the quick cap during the quick
    /// span, then on to the cap.
    #[test]
    fn backoff_stays_quick_for_the_first_span() {
        let (mut cur, mut slept, mut seq) = (BACKOFF_FIRST, Duration::ZERO, Vec::new());
        while slept < Duration::from_millis(60) {
            seq.push(cur.as_micros());
            slept += cur;
            cur = Backoff::next(cur, BACKOFF_MAX, slept);
        }
        assert_eq!(&seq[..4], &[500, 1000, 2000, 2000]);
        let quick = seq.iter().take_while(|&&us| us <= 2000).count();
        assert!(
            (10..=12).contains(&quick),
            "quick polls in the first 20 ms: {seq:?}"
        );
        assert_eq!(seq.last(), Some(&8000), "then up to the cap: {seq:?}");
        // A cap below the quick one (tests on memory devices) is kept throughout.
        let small = Duration::from_micros(500);
        assert_eq!(Backoff::next(small, small, Duration::ZERO), small);
        assert_eq!(Backoff::next(small, small, Duration::from_secs(1)), small);
    }

    const FAST_FIRST: Duration = Duration::from_micros(20);
    const FAST_MAX: Duration = Duration::from_micros(500);

    /// A small formatted volume, unshared (for test doubles that wrap the device).
    fn formatted(lbs: u32) -> (MemDevice, Superblock) {
        let dev = MemDevice::new(128 << 20, lbs);
        let o = MkfsOptions {
            max_nodes: 4,
            journal_bytes: 1 << 20,
            inode_lock_slots: 64,
            ..Default::default()
        };
        let sb = format(&dev, &o, &mut |_, _| {}).unwrap();
        (dev, sb)
    }

    fn volume(lbs: u32) -> (Arc<MemDevice>, Superblock) {
        let (dev, sb) = formatted(lbs);
        (Arc::new(dev), sb)
    }

    fn table(dev: &Arc<MemDevice>, sb: &Superblock) -> LockTable {
        let d: SharedDevice = dev.clone();
        LockTable::new(d, sb).with_backoff(FAST_FIRST, FAST_MAX)
    }

    fn me(slot: u32) -> Me {
        Me {
            slot,
            gen: 10 + u64::from(slot),
        }
    }

    fn never() -> Option<Error> {
        None
    }

    #[test]
    fn lock_fresh_volume_reads_free_records() {
        for lbs in [512, 4096] {
            let (dev, sb) = volume(lbs);
            let t = table(&dev, &sb);
            assert_eq!(t.group_count(), sb.group_count);
            let (raw, g) = t.read(LockTable::GLOBAL).unwrap();
            assert!(
                raw.iter().all(|&b| b == 0),
                "mkfs leaves the lock area zero"
            );
            assert_eq!(g, LockRecord::free(LockKind::Global, 0, 0));
            let (_, r) = t.read(t.group_index(3)).unwrap();
            assert_eq!(r, LockRecord::free(LockKind::Group, 4, 3));
            let b = t.bucket_of(12345);
            let (first, n) = t.bucket_range();
            assert!(b >= first && b < first + n && first + n == sb.lock_count);
            assert_eq!(t.read(b).unwrap().1.kind, LockKind::OpenBucket);
            let all = t.read_range(0, sb.lock_count).unwrap();
            assert_eq!(all.len() as u64, sb.lock_count);
            assert_eq!(all[0].kind, LockKind::Global);
            assert!(t.read(sb.lock_count).is_err());
            assert!(t.read_range(1, sb.lock_count).is_err());
            // The last record is the last logical block of the lock area.
            assert!(t.offset(sb.lock_count) <= (sb.lock_start + sb.lock_blocks) * FS_BLOCK);
        }
    }

    #[test]
    fn lock_swap_miscompare_leaves_block_and_success_reads_back() {
        let (dev, sb) = volume(512);
        let t = table(&dev, &sb);
        let (raw, rec) = t.read(LockTable::GLOBAL).unwrap();
        let mut a = rec.clone();
        a.version = 5;
        assert!(t.swap(LockTable::GLOBAL, &raw, &mut a).unwrap());
        let (raw_a, back) = t.read(LockTable::GLOBAL).unwrap();
        assert_eq!(back, a);
        assert_ne!(a.nonce, 0);
        // A stale `expected`: miscompare, nothing written.
        let mut b = rec.clone();
        b.version = 6;
        assert!(!t.swap(LockTable::GLOBAL, &raw, &mut b).unwrap());
        assert_eq!(t.read(LockTable::GLOBAL).unwrap().0, raw_a);
        // A record of the wrong kind for the index is refused before any I/O.
        let mut wrong = LockRecord::free(LockKind::Group, 0, 0);
        assert!(t.swap(LockTable::GLOBAL, &raw_a, &mut wrong).is_err());
    }

    /// Performs every CAW but then reports a failure, as a confused array or a timed-out
    /// command whose write landed would.
    #[derive(Debug)]
    struct Liar {
        inner: MemDevice,
        /// 0 honest, 1 written but Err, 2 written but Miscompare, 3 not written and Err
        /// (a CAW failed in transport: `DID_TRANSPORT_DISRUPTED`), 4 not written and Fenced,
        /// 5 not written and a plain EIO (a file device).
        mode: AtomicU32,
    }

    impl BlockDevice for Liar {
        fn geometry(&self) -> &Geometry {
            self.inner.geometry()
        }
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
            self.inner.read_at(offset, buf)
        }
        fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
            self.inner.write_at(offset, buf)
        }
        fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
            match self.mode.load(Ordering::Relaxed) {
                4 => Err(Error::new(ErrorKind::Fenced, "node is fenced")),
                5 => Err(Error::new(ErrorKind::Io, "injected write error")),
                0 => self.inner.compare_and_write(lba, expected, new),
                1 => {
                    self.inner.compare_and_write(lba, expected, new)?;
                    Err(Error::new(ErrorKind::Io, "command timed out"))
                }
                2 => {
                    self.inner.compare_and_write(lba, expected, new)?;
                    Ok(CawOutcome::Miscompare)
                }
                _ => Err(crate::scsi::ScsiFailure::new(
                    crate::scsi::FailureKind::Transport,
                    crate::scsi::CommandKind::CompareAndWrite,
                    true,
                    None,
                    "host_status 0x0e DID_TRANSPORT_DISRUPTED".into(),
                )
                .into_error("COMPARE AND WRITE")),
            }
        }
        fn flush(&self) -> Result<()> {
            self.inner.flush()
        }
        fn discard(&self, offset: u64, len: u64) -> Result<()> {
            self.inner.discard(offset, len)
        }
        fn refresh_size(&self) -> Result<u64> {
            self.inner.refresh_size()
        }
    }

    #[test]
    fn lock_swap_won_although_the_device_said_otherwise() {
        let (mem, sb) = formatted(512);
        let liar = Arc::new(Liar {
            inner: mem,
            mode: AtomicU32::new(0),
        });
        let t = LockTable::new(liar.clone(), &sb);
        for mode in [1, 2] {
            liar.mode.store(mode, Ordering::Relaxed);
            let (raw, rec) = t.read(LockTable::GLOBAL).unwrap();
            let mut n = rec.clone();
            n.version += 1;
            assert!(
                t.swap(LockTable::GLOBAL, &raw, &mut n).unwrap(),
                "mode {mode}"
            );
            assert_eq!(t.read(LockTable::GLOBAL).unwrap().1, n);
        }
        // Not written: the error propagates; a real miscompare stays false.
        liar.mode.store(3, Ordering::Relaxed);
        let (raw, rec) = t.read(LockTable::GLOBAL).unwrap();
        let mut n = rec.clone();
        n.version += 1;
        assert_eq!(
            t.swap(LockTable::GLOBAL, &raw, &mut n).unwrap_err().kind(),
            ErrorKind::Io
        );
        liar.mode.store(2, Ordering::Relaxed);
        let mut stale = raw.clone();
        stale[100] ^= 1;
        assert!(!t.swap(LockTable::GLOBAL, &stale, &mut n).unwrap());
        assert_eq!(t.read(LockTable::GLOBAL).unwrap().1, rec);
        // The whole acquire path works through a device that always reports failure.
        liar.mode.store(1, Ordering::Relaxed);
        let g = t
            .acquire_global(me(1), LockMode::Exclusive, Duration::from_secs(1), &never)
            .unwrap();
        assert!(LockTable::holds(&g, me(1), LockMode::Exclusive));
        t.release_global(me(1)).unwrap();
        assert_eq!(t.read(0).unwrap().1.mode, LockMode::Free);
    }

    /// A path failover under dm-multipath: for a while every CAW fails in transport without
    /// landing (`SG_IO` goes to the failed path until multipathd fails it). A lock change waits that out instead of failing — in the SAN portal
    /// test an unlink got EIO from the global lock's CAW. Errors that outlast the patience
    /// are returned, saying so, and a fence is returned at once.
    #[test]
    fn lock_changes_ride_out_a_path_failover_within_the_patience() {
        let (mem, sb) = formatted(512);
        let liar = Arc::new(Liar {
            inner: mem,
            mode: AtomicU32::new(3),
        });
        let heal_after = |d: Duration| {
            let liar = liar.clone();
            std::thread::spawn(move || {
                std::thread::sleep(d);
                liar.mode.store(0, Ordering::Relaxed);
            })
        };
        let t = LockTable::new(liar.clone(), &sb)
            .with_backoff(FAST_FIRST, FAST_MAX)
            .with_io_patience(Duration::from_secs(20));
        let t0 = Instant::now();
        let heal = heal_after(Duration::from_millis(300));
        let g = t
            .acquire_global(me(1), LockMode::Exclusive, Duration::from_secs(1), &never)
            .unwrap();
        heal.join().unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(300));
        assert!(LockTable::holds(&g, me(1), LockMode::Exclusive));
        // The same for a read-modify-CAW (`update`): the release.
        liar.mode.store(3, Ordering::Relaxed);
        let heal = heal_after(Duration::from_millis(200));
        t.release_global(me(1)).unwrap();
        heal.join().unwrap();
        assert_eq!(t.read(0).unwrap().1.mode, LockMode::Free);
        // Errors beyond the patience are returned, and say how long they lasted.
        let short = LockTable::new(liar.clone(), &sb)
            .with_backoff(FAST_FIRST, FAST_MAX)
            .with_io_patience(Duration::from_millis(200));
        liar.mode.store(3, Ordering::Relaxed);
        let t0 = Instant::now();
        let e = short
            .acquire_global(me(2), LockMode::Shared, Duration::from_secs(1), &never)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io);
        assert!(e.to_string().contains("still failing after"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        let e = short.publish_group_free(0, 7).unwrap_err();
        assert!(e.to_string().contains("still failing after"), "{e}");
        // A fenced node's lock I/O, and a plain EIO, are never retried.
        for (mode, kind) in [(4, ErrorKind::Fenced), (5, ErrorKind::Io)] {
            liar.mode.store(mode, Ordering::Relaxed);
            let t0 = Instant::now();
            let e = t
                .acquire_global(me(2), LockMode::Shared, Duration::from_secs(1), &never)
                .unwrap_err();
            assert_eq!(e.kind(), kind);
            assert!(
                t0.elapsed() < Duration::from_millis(100),
                "{:?}",
                t0.elapsed()
            );
        }
        liar.mode.store(0, Ordering::Relaxed);
        assert_eq!(t.read(0).unwrap().1.mode, LockMode::Free);
    }

    /// The memory LUN returns damaged copies for its next `torn_reads` reads.
    #[test]
    fn lock_torn_reads_are_retried_then_reported() {
        let (mem, sb) = formatted(512);
        let dev = Arc::new(mem);
        let t = LockTable::new(dev.clone(), &sb);
        t.publish_group_free(0, 42).unwrap();
        t.open_set(9, me(1), true).unwrap();
        dev.faults.torn_reads.store(3, Ordering::Relaxed);
        assert_eq!(t.read(1).unwrap().1.group_free(), Some(42));
        dev.faults.torn_reads.store(2, Ordering::Relaxed);
        let r = t.read_range(1, 2).unwrap();
        assert_eq!(r[0].group_free(), Some(42));
        dev.faults.torn_reads.store(1000, Ordering::Relaxed);
        let e = t.read(1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted);
        // A record in the wrong place (a group record where a bucket belongs) is corrupted.
        dev.faults.torn_reads.store(0, Ordering::Relaxed);
        let (first, _) = t.bucket_range();
        let img = LockRecord::free(LockKind::Group, first, 0).encode(512);
        dev.write_at(t.offset(first), &img).unwrap();
        assert_eq!(t.read(first).unwrap_err().kind(), ErrorKind::Corrupted);
    }

    #[test]
    fn lock_contention_exclusive_no_lost_update() {
        let (dev, sb) = volume(512);
        let counter_at = sb.probe_block * FS_BLOCK;
        let threads: Vec<_> = (0..4u32)
            .map(|slot| {
                let dev = dev.clone();
                let sb = sb.clone();
                std::thread::spawn(move || {
                    let t = table(&dev, &sb);
                    let mut versions = Vec::new();
                    for _ in 0..300 {
                        let g = t
                            .acquire_global(
                                me(slot),
                                LockMode::Exclusive,
                                Duration::from_secs(2),
                                &never,
                            )
                            .unwrap();
                        versions.push(g.version);
                        let mut b = vec![0u8; 512];
                        dev.read_at(counter_at, &mut b).unwrap();
                        let v = u64::from_le_bytes(b[..8].try_into().unwrap());
                        std::thread::yield_now();
                        b[..8].copy_from_slice(&(v + 1).to_le_bytes());
                        dev.write_at(counter_at, &b).unwrap();
                        t.release_global(me(slot)).unwrap();
                    }
                    versions
                })
            })
            .collect();
        let mut versions: Vec<u64> = threads
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        let mut b = vec![0u8; 512];
        dev.read_at(counter_at, &mut b).unwrap();
        assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), 1200);
        // Every exclusive grant had its own version (the fencing token).
        versions.sort_unstable();
        versions.dedup();
        assert_eq!(versions.len(), 1200);
        let t = table(&dev, &sb);
        let g = t.read(0).unwrap().1;
        assert_eq!(g.mode, LockMode::Free);
        assert!(g.waiters.is_empty() && g.holders.is_empty());
        assert_eq!(g.version, 1200);
    }

    #[test]
    fn lock_shared_and_exclusive_never_coexist() {
        let (dev, sb) = volume(512);
        let excl = Arc::new(AtomicI32::new(0));
        let shared = Arc::new(AtomicI32::new(0));
        let threads: Vec<_> = (0..4u32)
            .map(|slot| {
                let (dev, sb, excl, shared) =
                    (dev.clone(), sb.clone(), excl.clone(), shared.clone());
                std::thread::spawn(move || {
                    let t = table(&dev, &sb);
                    let m = me(slot);
                    let mut rng = rand::thread_rng();
                    let mut grants = [0u32; 2];
                    for _ in 0..150 {
                        let mode = if rng.gen_bool(0.3) {
                            LockMode::Exclusive
                        } else {
                            LockMode::Shared
                        };
                        let g = t
                            .acquire_global(m, mode, Duration::from_secs(2), &never)
                            .unwrap();
                        assert!(LockTable::holds(&g, m, mode));
                        let (_, now) = t.read(0).unwrap();
                        if mode == LockMode::Exclusive {
                            grants[1] += 1;
                            assert_eq!(excl.fetch_add(1, Ordering::SeqCst), 0);
                            assert_eq!(shared.load(Ordering::SeqCst), 0);
                            assert_eq!(now.mode, LockMode::Exclusive);
                            assert_eq!(now.owner, slot);
                            assert!(now.holders.is_empty());
                            std::thread::yield_now();
                            excl.fetch_sub(1, Ordering::SeqCst);
                        } else {
                            grants[0] += 1;
                            shared.fetch_add(1, Ordering::SeqCst);
                            assert_eq!(excl.load(Ordering::SeqCst), 0);
                            assert_eq!(now.mode, LockMode::Shared);
                            assert_eq!(now.owner, NO_SLOT);
                            assert!(now.holders.contains(slot));
                            std::thread::sleep(Duration::from_micros(50));
                            shared.fetch_sub(1, Ordering::SeqCst);
                        }
                        t.release_global(m).unwrap();
                    }
                    grants
                })
            })
            .collect();
        for h in threads {
            h.join().unwrap();
        }
        let g = table(&dev, &sb).read(0).unwrap().1;
        assert_eq!(g.mode, LockMode::Free);
        assert!(g.holders.is_empty() && g.waiters.is_empty());
    }

    #[test]
    fn lock_fairness_round_robin_bounds_the_wait() {
        // (grants so far, grant number at which each slot was first seen waiting, worst wait,
        // grant order)
        type State = (u64, HashMap<u32, u64>, u64, Vec<u32>);
        const SLOTS: u32 = 3;
        let (dev, sb) = volume(512);
        let state: Arc<Mutex<State>> = Arc::new(Mutex::new((0, HashMap::new(), 0, Vec::new())));
        let threads: Vec<_> = (0..SLOTS)
            .map(|slot| {
                let (dev, sb, state) = (dev.clone(), sb.clone(), state.clone());
                std::thread::spawn(move || {
                    let t = table(&dev, &sb);
                    for _ in 0..60 {
                        let g = t
                            .acquire_global(
                                me(slot),
                                LockMode::Exclusive,
                                Duration::from_secs(10),
                                &never,
                            )
                            .unwrap();
                        {
                            let mut st = state.lock().unwrap();
                            st.0 += 1;
                            let n = st.0;
                            for w in g.waiters.iter() {
                                st.1.entry(w).or_insert(n);
                            }
                            if let Some(since) = st.1.remove(&slot) {
                                st.2 = st.2.max(n - since);
                            }
                            st.3.push(slot);
                        }
                        std::thread::sleep(Duration::from_micros(100));
                        t.release_global(me(slot)).unwrap();
                    }
                })
            })
            .collect();
        for h in threads {
            h.join().unwrap();
        }
        let st = state.lock().unwrap();
        assert_eq!(st.0, u64::from(SLOTS) * 60);
        assert!(
            st.2 <= 2 * u64::from(SLOTS),
            "a waiting slot waited {} grants: {:?}",
            st.2,
            st.3
        );
    }

    #[test]
    fn lock_handoff_grace_skips_a_next_that_never_comes() {
        let (dev, sb) = volume(512);
        let t = table(&dev, &sb);
        t.update(0, |r| {
            let mut n = r.clone();
            n.next = 7;
            Some(n)
        })
        .unwrap();
        let grace = Duration::from_millis(300);
        let start = Instant::now();
        let g = t
            .acquire_global(me(1), LockMode::Exclusive, grace, &never)
            .unwrap();
        let took = start.elapsed();
        assert!(took >= grace, "granted after {took:?}, before the grace");
        assert!(took < Duration::from_secs(5), "took {took:?}");
        assert!(LockTable::holds(&g, me(1), LockMode::Exclusive));
        assert_eq!(g.next, NO_SLOT);
        assert!(g.waiters.is_empty());
        // Named as next, a slot does not wait at all.
        t.release_global(me(1)).unwrap();
        t.update(0, |r| {
            let mut n = r.clone();
            n.next = 2;
            Some(n)
        })
        .unwrap();
        let start = Instant::now();
        t.acquire_global(me(2), LockMode::Shared, Duration::from_secs(30), &never)
            .unwrap();
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    /// A waiter whose heartbeat stopped (a node that died waiting) is passed over when the
    /// lock is handed on, and a `next` that names one is not waited for.
    #[test]
    fn a_handoff_passes_over_a_silent_waiter() {
        let (dev, sb) = volume(512);
        let t = table(&dev, &sb);
        let silent = |s: u32| s == 2;
        t.acquire_global(me(1), LockMode::Exclusive, Duration::from_secs(1), &never)
            .unwrap();
        t.update(0, |r| {
            let mut n = r.clone();
            n.waiters.insert(2);
            n.waiters.insert(3);
            Some(n)
        })
        .unwrap();
        t.release_global_passing(me(1), &silent).unwrap();
        assert_eq!(
            t.read(0).unwrap().1.next,
            3,
            "the silent slot 2 is passed over"
        );
        // Without anyone to pass it to, the silent waiter is named all the same.
        t.update(0, |r| {
            let mut n = r.clone();
            n.mode = LockMode::Exclusive;
            n.owner = 1;
            n.owner_gen = me(1).gen;
            n.waiters.remove(3);
            n.next = NO_SLOT;
            Some(n)
        })
        .unwrap();
        t.release_global_passing(me(1), &silent).unwrap();
        assert_eq!(t.read(0).unwrap().1.next, 2);
        // Named as next, the silent slot does not hold up a live waiter for the grace.
        let start = Instant::now();
        let grace = Duration::from_secs(30);
        let g = t
            .acquire_global_notify(me(3), LockMode::Exclusive, grace, &silent, &never, &|_| {})
            .unwrap();
        assert!(LockTable::holds(&g, me(3), LockMode::Exclusive));
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn lock_abort_ends_the_wait_and_leaves_the_waiters() {
        let (dev, sb) = volume(512);
        let t = table(&dev, &sb);
        t.acquire_global(me(1), LockMode::Exclusive, Duration::from_secs(1), &never)
            .unwrap();
        let calls = AtomicU32::new(0);
        let abort = || {
            (calls.fetch_add(1, Ordering::Relaxed) >= 5)
                .then(|| Error::new(ErrorKind::Fenced, "fenced"))
        };
        let e = t
            .acquire_global(me(2), LockMode::Shared, Duration::from_secs(1), &abort)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Fenced);
        let g = t.read(0).unwrap().1;
        assert!(!g.waiters.contains(2));
        assert!(LockTable::holds(&g, me(1), LockMode::Exclusive));
        assert!(!LockTable::others_waiting(&g, me(1)));
        // Upgrade: the only shared holder may become exclusive.
        t.release_global(me(1)).unwrap();
        let s = t
            .acquire_global(me(3), LockMode::Shared, Duration::from_secs(1), &never)
            .unwrap();
        let x = t
            .acquire_global(me(3), LockMode::Exclusive, Duration::from_secs(1), &never)
            .unwrap();
        assert_eq!(x.version, s.version + 1);
        assert!(x.holders.is_empty());
        // Releasing what we do not hold is fine and writes nothing.
        let writes = dev.writes.load(Ordering::Relaxed);
        t.release_global(me(2)).unwrap();
        assert_eq!(dev.writes.load(Ordering::Relaxed), writes);
        assert!(t
            .acquire_global(me(1), LockMode::Free, Duration::ZERO, &never)
            .is_err());
        assert!(t
            .acquire_global(me(NO_SLOT), LockMode::Shared, Duration::ZERO, &never)
            .is_err());
    }

    /// Two different inodes whose open entries share a bucket.
    #[expect(
        clippy::maybe_infinite_iter,
        reason = "the hash spreads consecutive numbers over every bucket: found within a few bucket counts"
    )]
    fn colliding(t: &LockTable, a: u64) -> u64 {
        (a + 1..)
            .find(|&b| t.bucket_of(b) == t.bucket_of(a))
            .unwrap()
    }

    #[test]
    fn lock_scrub_slot_removes_every_trace() {
        let (dev, sb) = volume(512);
        let t = table(&dev, &sb);
        let dead = me(2);
        let g = t
            .acquire_global(dead, LockMode::Exclusive, Duration::from_secs(1), &never)
            .unwrap();
        t.update(0, |r| {
            let mut n = r.clone();
            n.waiters.insert(2);
            n.waiters.insert(3);
            n.next = 2;
            Some(n)
        })
        .unwrap();
        assert!(t.claim_group(0, dead).unwrap());
        t.publish_group_free(0, 1234).unwrap();
        assert!(t.claim_group(1, me(3)).unwrap());
        let a = 1000;
        #[expect(
            clippy::maybe_infinite_iter,
            reason = "the hash spreads consecutive numbers over every bucket: found within a few bucket counts"
        )]
        let b = (a + 1..)
            .find(|&b| t.bucket_of(b) != t.bucket_of(a))
            .unwrap();
        let c = colliding(&t, b);
        t.open_set(a, dead, true).unwrap();
        t.open_set(b, dead, false).unwrap();
        t.open_set(a, me(3), false).unwrap();
        t.open_set(c, me(3), true).unwrap();
        t.open_set(c, me(1), false).unwrap();

        t.scrub_slot(2).unwrap();
        let after = t.read(0).unwrap().1;
        assert_eq!(after.mode, LockMode::Free);
        assert_eq!(after.owner, NO_SLOT);
        assert_eq!(after.version, g.version + 1, "caches must revalidate");
        assert_eq!(after.waiters.iter().collect::<Vec<_>>(), vec![3]);
        assert_eq!(after.next, 3);
        let owners = t.group_owners().unwrap();
        assert_eq!(owners[0], (NO_SLOT, Some(1234)));
        assert_eq!(owners[1].0, 3);
        for rec in t.read_range(0, sb.lock_count).unwrap() {
            assert_ne!(rec.owner, 2);
            assert!(!rec.holders.contains(2) && !rec.waiters.contains(2) && rec.next != 2);
            assert!(rec.entries.iter().all(|e| e.slot != 2));
        }
        let others = t.open_others(a, me(1)).unwrap();
        assert_eq!(others.len(), 1);
        assert_eq!((others[0].slot, others[0].writer), (3, false));
        assert!(t.open_others(b, me(1)).unwrap().is_empty());
        let cs = t.open_others(c, me(0)).unwrap();
        assert_eq!(cs.len(), 2);

        // Twice: nothing left to do, nothing written.
        let before = dev.snapshot();
        let writes = dev.writes.load(Ordering::Relaxed);
        t.scrub_slot(2).unwrap();
        assert_eq!(dev.writes.load(Ordering::Relaxed), writes);
        assert!(dev.snapshot() == before);
        assert!(t.scrub_slot(NO_SLOT).is_err());
    }

    #[test]
    fn lock_scrub_stale_keeps_live_generations_and_unknown_slots() {
        let (dev, sb) = volume(512);
        let t = table(&dev, &sb);
        let (raw, mut g) = t.read(LockTable::GLOBAL).unwrap();
        g.mode = LockMode::Shared;
        g.holders.insert(0); // live
        g.holders.insert(1); // gone
        g.holders.insert(2); // unknown (recovering or damaged)
        g.waiters.insert(3); // live at another generation: waiters carry none, kept
        g.next = 1;
        assert!(t.swap(LockTable::GLOBAL, &raw, &mut g).unwrap());
        let grp = t.group_index(0);
        let (raw, mut r) = t.read(grp).unwrap();
        r.mode = LockMode::Exclusive;
        r.owner = 3;
        r.owner_gen = 7; // slot 3 is live at generation 8: taken over
        assert!(t.swap(grp, &raw, &mut r).unwrap());
        let b = t.bucket_of(99);
        let (raw, mut br) = t.read(b).unwrap();
        for (slot, gen) in [(0, 5), (0, 4), (2, 1), (1, 1)] {
            br.entries.push(OpenEntry {
                ino: 99,
                slot,
                writer: false,
                slot_gen: gen,
            });
        }
        assert!(t.swap(b, &raw, &mut br).unwrap());
        let lives = || {
            Ok(vec![
                SlotLife::Live(5),
                SlotLife::Gone,
                SlotLife::Unknown,
                SlotLife::Live(8),
            ])
        };
        let changed = t.scrub_stale(&lives).unwrap();
        assert_eq!(changed.len(), 3, "{changed:?}");
        let g = t.read(LockTable::GLOBAL).unwrap().1;
        assert_eq!(g.holders.iter().collect::<Vec<_>>(), vec![0, 2]);
        assert!(g.waiters.contains(3) && g.next == 3 && g.mode == LockMode::Shared);
        let r = t.read(grp).unwrap().1;
        assert_eq!((r.mode, r.owner), (LockMode::Free, NO_SLOT));
        let kept: Vec<_> = t
            .read(b)
            .unwrap()
            .1
            .entries
            .iter()
            .map(|e| (e.slot, e.slot_gen))
            .collect();
        assert_eq!(kept, vec![(0, 5), (2, 1)]);
        assert!(t.scrub_stale(&lives).unwrap().is_empty(), "idempotent");
    }

    #[test]
    fn lock_repair_corrupt_only_when_alone() {
        let (dev, sb) = volume(512);
        let t = table(&dev, &sb);
        let b = t.bucket_of(5);
        for index in [LockTable::GLOBAL, b] {
            dev.write_at(t.offset(index), &[0x33; 512]).unwrap();
        }
        let (reset, left) = t.repair_corrupt(me(1), &|| Ok(false)).unwrap();
        assert!(reset.is_empty());
        assert_eq!(left.iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![0, b]);
        assert!(
            t.read(LockTable::GLOBAL).is_err(),
            "left alone while others may live"
        );
        let (reset, left) = t.repair_corrupt(me(1), &|| Ok(true)).unwrap();
        assert_eq!((reset, left.len()), (vec![0, b], 0));
        let g = t.read(LockTable::GLOBAL).unwrap().1;
        assert!(
            LockTable::holds(&g, me(1), LockMode::Exclusive),
            "held until released"
        );
        assert!(t.read(b).unwrap().1.entries.is_empty());
    }

    #[test]
    fn lock_scrub_of_a_shared_holder_keeps_the_others() {
        let (dev, sb) = volume(4096);
        let t = table(&dev, &sb);
        for s in [1, 4] {
            t.acquire_global(me(s), LockMode::Shared, Duration::from_secs(1), &never)
                .unwrap();
        }
        let v = t.read(0).unwrap().1.version;
        t.scrub_slot(4).unwrap();
        let r = t.read(0).unwrap().1;
        assert_eq!(r.mode, LockMode::Shared);
        assert_eq!(r.holders.iter().collect::<Vec<_>>(), vec![1]);
        assert_eq!(r.version, v, "a shared holder changed nothing");
        t.scrub_slot(1).unwrap();
        assert_eq!(t.read(0).unwrap().1.mode, LockMode::Free);
    }

    #[test]
    fn lock_open_registrations() {
        let (dev, sb) = volume(512);
        let t = table(&dev, &sb);
        let a = 77;
        let b = colliding(&t, a);
        assert_eq!(t.bucket_of(a), t.bucket_of(b));
        t.open_set(a, me(1), false).unwrap();
        t.open_set(a, me(2), true).unwrap();
        t.open_set(b, me(2), false).unwrap();
        let oa = t.open_others(a, me(1)).unwrap();
        assert_eq!(oa.len(), 1);
        assert_eq!(
            oa[0],
            OpenEntry {
                ino: a,
                slot: 2,
                writer: true,
                slot_gen: me(2).gen
            }
        );
        let ob = t.open_others(b, me(1)).unwrap();
        assert_eq!((ob.len(), ob[0].writer), (1, false));
        assert_eq!(t.open_others(a, me(2)).unwrap()[0].slot, 1);
        assert!(t.open_others(b, me(2)).unwrap().is_empty());
        // Upsert: same entry, new flag; an unchanged upsert writes nothing.
        t.open_set(a, me(1), true).unwrap();
        let writes = dev.writes.load(Ordering::Relaxed);
        t.open_set(a, me(1), true).unwrap();
        assert_eq!(dev.writes.load(Ordering::Relaxed), writes);
        assert_eq!(t.read(t.bucket_of(a)).unwrap().1.entries.len(), 3);
        assert!(t.open_others(a, me(2)).unwrap()[0].writer);
        // A new generation of slot 1 replaces the old generation's leftovers.
        let reborn = Me { slot: 1, gen: 99 };
        t.open_set(b, reborn, false).unwrap();
        let entries = t.read(t.bucket_of(a)).unwrap().1.entries;
        assert!(entries.iter().all(|e| e.slot != 1 || e.slot_gen == 99));
        t.open_clear(a, me(2)).unwrap();
        t.open_clear(a, me(2)).unwrap();
        assert!(t.open_others(a, me(1)).unwrap().is_empty());
        assert_eq!(t.open_others(b, me(1)).unwrap().len(), 1);
        t.open_clear(b, me(2)).unwrap();
        t.open_clear(b, reborn).unwrap();
        assert!(t.read(t.bucket_of(a)).unwrap().1.entries.is_empty());

        // A full bucket: 18 nodes have one file open; a 19th cannot register.
        let f = 5;
        for s in 0..u32::try_from(BUCKET_ENTRIES).unwrap() {
            t.open_set(f, me(s), s % 2 == 0).unwrap();
        }
        assert_eq!(t.open_others(f, me(0)).unwrap().len(), BUCKET_ENTRIES - 1);
        let e = t.open_set(f, me(100), false).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Busy);
        assert!(
            e.to_string().contains("bucket") && e.to_string().contains("lock-table limit"),
            "{e}"
        );
        // Updating an existing entry of a full bucket still works.
        t.open_set(f, me(3), true).unwrap();
        t.open_clear(f, me(0)).unwrap();
        t.open_set(f, me(100), false).unwrap();
    }

    #[test]
    fn lock_groups_claim_release_publish() {
        let (dev, sb) = volume(512);
        let t = table(&dev, &sb);
        assert!(t.claim_group(0, me(1)).unwrap());
        let v = t.read(1).unwrap().1.version;
        assert_eq!(v, 1);
        assert!(t.claim_group(0, me(1)).unwrap(), "already mine");
        assert_eq!(t.read(1).unwrap().1.version, v);
        assert!(!t.claim_group(0, me(2)).unwrap());
        t.publish_group_free(0, 77).unwrap();
        let owners = t.group_owners().unwrap();
        assert_eq!(owners.len() as u64, sb.group_count);
        assert_eq!(owners[0], (1, Some(77)));
        assert_eq!(owners[1], (NO_SLOT, None));
        t.release_group(0, me(2), 5).unwrap();
        assert_eq!(t.group_owners().unwrap()[0], (1, Some(77)));
        t.release_group(0, me(1), 99).unwrap();
        assert_eq!(t.group_owners().unwrap()[0], (NO_SLOT, Some(99)));
        assert!(t.claim_group(0, me(2)).unwrap());
        let r = t.read(1).unwrap().1;
        assert_eq!((r.owner, r.version, r.group_free()), (2, 2, Some(99)));
        assert!(t.claim_group(sb.group_count, me(1)).is_err());
        assert!(t.publish_group_free(sb.group_count, 1).is_err());
    }

    /// Format 8: a claim without the global lock takes only a Free, unmarked group, owner
    /// and mark in one write; its mark and ownership go as any other's.
    #[test]
    fn lock_group_claims_without_the_global_lock() {
        let (dev, sb) = volume(512);
        let t = table(&dev, &sb);
        // Free and unmarked: owned and marked by the claimer in one write.
        assert!(t.claim_group_marked(0, me(1)).unwrap());
        let r = t.read(1).unwrap().1;
        assert_eq!((r.mode, r.owner, r.next), (LockMode::Exclusive, 1, 1));
        let v = r.version;
        assert!(t.claim_group_marked(0, me(1)).unwrap(), "again: ours");
        assert_eq!(t.read(1).unwrap().1.version, v, "nothing written");
        assert!(!t.claim_group_marked(0, me(2)).unwrap(), "owned");
        // Marked by a node that uses it under the global lock: not claimable.
        assert_eq!(t.mark_group(1, me(2), false).unwrap(), GroupMark::Marked);
        assert!(!t.claim_group_marked(1, me(1)).unwrap(), "marked");
        assert_eq!(t.read(2).unwrap().1.mode, LockMode::Free);
        t.unmark_group(1, me(2), None).unwrap();
        assert!(t.claim_group_marked(1, me(1)).unwrap(), "the mark went");
        // The claimer's mark goes like any other; its recoverer frees the group.
        t.unmark_group(0, me(1), Some(7)).unwrap();
        assert_eq!(t.read(1).unwrap().1.next, NO_SLOT);
        t.scrub_slot(1).unwrap();
        for i in [1, 2] {
            let r = t.read(i).unwrap().1;
            assert_eq!((r.mode, r.next), (LockMode::Free, NO_SLOT), "record {i}");
        }
    }

    /// Format 7: one mark per group; a refill's mark only on the owner's own group; a mark
    /// survives a change of owner; a dead node's mark goes with `scrub_slot`.
    #[test]
    fn lock_group_marks() {
        let (dev, sb) = volume(512);
        let t = table(&dev, &sb);
        assert!(t.claim_group(0, me(1)).unwrap());
        assert_eq!(t.mark_group(0, me(2), true).unwrap(), GroupMark::NotMine);
        assert_eq!(t.mark_group(0, me(1), true).unwrap(), GroupMark::Marked);
        let v = t.read(1).unwrap().1.version;
        assert_eq!(
            t.mark_group(0, me(1), true).unwrap(),
            GroupMark::Marked,
            "again"
        );
        assert_eq!(t.read(1).unwrap().1.version, v, "nothing written");
        assert!(matches!(
            t.mark_group(0, me(2), false).unwrap(),
            GroupMark::Busy { slot: 1, .. }
        ));
        t.unmark_group(0, me(2), Some(5)).unwrap();
        assert_eq!(t.read(1).unwrap().1.next, 1, "not 2's mark");
        t.unmark_group(0, me(1), Some(40)).unwrap();
        let r = t.read(1).unwrap().1;
        assert_eq!(
            (r.next, r.version, r.group_free()),
            (NO_SLOT, v + 1, Some(40))
        );
        // Another node borrows the group; its owner's refill finds it busy.
        assert_eq!(t.mark_group(0, me(2), false).unwrap(), GroupMark::Marked);
        assert!(matches!(
            t.mark_group(0, me(1), true).unwrap(),
            GroupMark::Busy { slot: 2, .. }
        ));
        // The owner leaves; the mark stays with the borrower, and a new owner keeps it.
        t.release_group(0, me(1), 40).unwrap();
        assert!(t.claim_group(0, me(3)).unwrap());
        assert_eq!(t.read(1).unwrap().1.next, 2);
        // The borrower dies: its recoverer takes the mark off.
        t.scrub_slot(2).unwrap();
        let r = t.read(1).unwrap().1;
        assert_eq!((r.owner, r.next), (3, NO_SLOT));
        // And a stale mark found by a scrub of stale mentions is dropped, not handed on.
        assert_eq!(t.mark_group(0, me(3), true).unwrap(), GroupMark::Marked);
        let mut stale = t.read(1).unwrap().1;
        stale.next = 4;
        stale.waiters.insert(5);
        let life = |s: u32| {
            if s == 4 {
                SlotLife::Gone
            } else {
                SlotLife::Unknown
            }
        };
        assert_eq!(scrubbed(&stale, &life).next, NO_SLOT);
    }
}
