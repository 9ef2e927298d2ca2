//! Per-object cluster locks, cached at the holder (issue 9 points 1, 2 and 5). On format v3
//! volumes mkfs places the area (`Superblock::object_lock_area`) and the filesystem uses inode
//! locks for its data path (`fs/inode_lock.rs`); metadata changes still take the one global lock
//! of `cluster/lock.rs` as well.
//!
//! # Objects
//! An [`ObjectId`] is a u64 whose top two bits are its class: 0 inode (the inode number), 1
//! allocation group (the group number), 2 volume-wide lock ([`VolumeLock`], e.g. the rename
//! lock for directory moves across parents); 3 is reserved. Id 0 is not an object.
//!
//! # The lock area: hashed buckets
//! `buckets` records of one logical block ([`crate::format::object_lock`]), each changed with
//! one COMPARE AND WRITE over the exact image read (fresh nonce, read-back after a miscompare
//! or an error of unknown outcome, torn reads re-read: the helpers of `cluster/lock.rs`). An
//! object lives in bucket `splitmix64(id) mod buckets`. A bucket holds a table of entries
//! {object, version, next, mentions}; a mention names a slot (with its heartbeat generation)
//! as owner (exclusive), holder (shared) or waiter (for shared or exclusive). The mode is
//! derived from the mentions, so a record cannot contradict itself.
//!
//! **Why hashed, not in the object's own block** (VMFS): inode blocks are metadata written
//! through the journal and cached; a lock there would make every lock change a CAW of a
//! journaled block (the journal's replay could roll a lock back) and tie lock records to the
//! fs block size (4 KiB) instead of the logical block that CAW covers. Groups and volume-wide
//! locks have no block of their own either. **What false sharing costs:** two objects in one
//! bucket never conflict logically (their entries are separate); they only share a CAW
//! target, so simultaneous changes of both make one CAW miscompare and retry after a re-read
//! (one extra read + CAW each, plus a backoff sleep of 0.5–8 ms). `object_lock_false_sharing_cost`
//! measures it (4 threads, private objects, 300 changes each, memory LUN): with one bucket
//! 44 of 1,244 CAWs (3.5 %) miscompared, with 64 buckets 2 of 1,202. Capacity: with one
//! mention per entry a 512-byte bucket holds 14 entries, a 4096-byte one 126; the area should
//! have room for about twice the locks the cluster caches at once (e.g. 8 nodes × 10,000
//! cached inodes = 80,000 entries: 16,384 buckets of 512 bytes, 8 MiB, hold 229,376).
//!
//! **Eviction and the floor.** An entry nobody holds or waits for stays (its version keeps
//! validating caches) until its bucket needs the space: it is then evicted and its version
//! folded into the bucket's `floor` (the maximum of every evicted version). An entry created
//! afterwards starts at `floor + 1`, above every version any node can have cached for any
//! object of the bucket, so an eviction never lets a stale cache validate. A bucket with no
//! evictable entry: the acquirer cannot be granted nor even registered as a waiter; it posts a
//! [`Want::Room`] request to the holders of one idle-looking entry (rate-limited like every
//! request), whose owners release that cached lock at their next poll, and **waits** (backoff,
//! `abort` polled) until the room is there.
//!
//! # Acquire ([`ObjectLocks::acquire`]`(me, obj, mode, abort)`), a loop
//! 1. Read the bucket. If its entry shows `me` (slot and generation) holding `obj` in `mode`
//!    or stronger, return that grant.
//! 2. **Eligible** if the entry's `next` is none or me, or the entry has not changed for
//!    `handoff_grace` on this process's monotonic clock (a named `next` that is dead or slow).
//! 3. **Compatible**: exclusive — no owner and no shared holder other than me (so the only
//!    shared holder upgrades in place); shared — no owner, and no slot other than me waits for
//!    exclusive unless `next` names me (so a stream of shared holders cannot starve an
//!    exclusive waiter, and a shared waiter named by a fair release goes first).
//! 4. Eligible and compatible: CAW the grant — exclusive: my mention becomes owner, version +
//!    1; shared: my mention becomes holder. `next` is cleared. Won: return [`Grant`].
//! 5. Otherwise make sure my mention says I wait (for `mode`). **An upgrade that cannot be
//!    granted at once gives up my shared hold in that same CAW** (a shared holder waiting to
//!    upgrade while holding would deadlock with a second upgrader); the caller must treat what
//!    the shared hold protected as unprotected until the exclusive grant returns (the grant's
//!    validator tells whether anything changed). Once my waiter mention is on disk, post a
//!    request ([`Want::Shared`] / [`Want::Exclusive`]) into the mailbox of every holder that
//!    blocks me (the owner; for exclusive also every shared holder), again every `refresh`
//!    while that holder still blocks me (a full mailbox, a lost request or a holder that
//!    re-took the lock is retried that way). Back off (`cluster/lock.rs`: 0.5 ms doubling to 2 ms for 20 ms, then to 8 ms, ±50 %), poll
//!    `abort` (a fenced node stops waiting and leaves the waiters, best effort), repeat.
//!
//! # Cached at the holder; handing over ([`ObjectLocks::serve_mailbox`])
//! A grant is kept until someone asks: the node reads **only its own mailbox**, once per tick
//! (by default 10 ms while in a lock exchange, 40 ms when idle: [`super::mailbox::PollPacer`],
//! whose doc gives the I/O budget; the filesystem polls every 5 ms during an exchange, see
//! docs/locking.md §15 for its budget). For each requested object it still holds:
//! * a request is **live** if it is [`Want::Room`], or its requester is still a waiter of that
//!   entry at the generation it posted with (so requests of dead, satisfied or aborted waiters
//!   are dropped without a handoff);
//! * the strongest live want decides: exclusive or room → release; shared while I hold it
//!   exclusively → downgrade; shared while I hold it shared → nothing to do;
//! * the caller's [`Handoff::flush`]`(obj, to)` runs first: it must wait for the in-flight work under that
//!   lock, start no new work under it, and **commit and write home every journaled block the
//!   lock protects** (issue 9 point 5: replaying this node's journal later must not roll back
//!   a change the next holder makes). Ok(true) = done, hand it over; Ok(false) = not yet (the
//!   request stays for the next tick); Err = the flush failed: nothing is released (the
//!   caller fences, and recovery releases the lock after replaying the journal);
//! * then the handoff CAW (release or downgrade, written only if the bucket still shows the
//!   hold the flush was for), [`Handoff::handed`] with its result, and the handled requests
//!   are cleared. Failpoints `objlock::post_request`, `objlock::handoff_after_flush` and
//!   `objlock::handoff_before_clear` stop there (the `failpoints` feature).
//!
//! **Release** removes my mention; if I held the lock (or was the named `next`), `next` names
//! the first waiter after my slot in ascending order, wrapping. **Downgrade** turns my owner
//! mention into a holder and names the first shared waiter after me as `next`. Neither bumps
//! the version: the version changes only when an exclusive hold begins (or a dead one ends).
//!
//! **Fairness.** A waiter that has registered and asked is granted, provided every holder
//! finishes its in-flight work: its request reaches each blocking holder within one tick
//! (re-posted every `refresh`), the holder hands over after its flush, and every release
//! names the next waiter round-robin, which nobody else may overtake until `handoff_grace`
//! passes. A waiter therefore waits at most about (number of waiting slots) grants of that
//! object. `object_lock_fairness_round_robin` asserts it.
//!
//! # Versions: the cache validator
//! [`Grant::previous`] is the entry's version before this grant (the version of the last
//! exclusive hold), [`Grant::version`] after it. A node that remembers the version of its last
//! grant of `obj` (its *validator*) knows nobody else held `obj` exclusively since iff
//! `previous == validator` ([`Grant::cache_valid`]). Versions of an object only grow (+ 1 per
//! exclusive grant and per scrubbed dead exclusive hold; eviction and recreation jump above
//! the floor).
//!
//! # Dead holders
//! [`ObjectLocks::scrub_slot`]`(slot, gen)` removes every mention of a dead slot (at that
//! generation; `None` = any, for a damaged heartbeat record) from every bucket, hands each
//! lock it held on as a release would, bumps the version of every entry it held exclusively
//! (its replayed changes are home now: every cache revalidates), and empties its mailbox.
//! **Recovery calls it only after the dead node's journal is replayed** (lesson 6): released
//! earlier, another node could change the object and the replay would roll that back.
//! Idempotent: it writes only buckets that mention the slot. [`ObjectLocks::drop_stale`]
//! removes mentions of slots that no longer hold that generation (Free, never used, or Live at
//! another generation, judged by a heartbeat scan made after each bucket read, as
//! `LockTable::scrub_stale` does): anyone may call it.
//!
//! # Lock order for multi-object operations
//! Take locks in this order, each class ascending by number ([`lock_order`] sorts and merges a
//! set): the volume-wide rename lock, then directory inodes, then other inodes, then
//! allocation groups. A node waits only while holding locks that come before the one it waits
//! for; cached locks it is not using are handed over on request, so no cycle can form.

use super::lock::{
    caw_read_back, check_slot, fresh_nonce, is_stale, read_validated, Backoff, IoPatience, Me,
    SlotLife, BACKOFF_FIRST, BACKOFF_MAX,
};
use super::mailbox::{Mailboxes, Posted};
use crate::dev::SharedDevice;
use crate::error::{Error, Result};
pub use crate::format::lock_record::LockMode;
use crate::format::mailbox::{Request, Want};
use crate::format::object_lock::{Bucket, Entry, Mention, Role, NONCE_OFFSET, NO_NEXT};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const CLASS_SHIFT: u32 = 62;
const NUMBER_MASK: u64 = (1 << CLASS_SHIFT) - 1;

/// What an [`ObjectId`] names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Inode,
    Group,
    Volume,
}

/// Volume-wide locks (class 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VolumeLock {
    /// Directory moves across parents (prevents loops, as ext4's and GFS2's rename lock).
    Rename = 1,
    /// The global metadata lock of `cluster/lock.rs` (record 0). It has no bucket entry: only
    /// its requests travel through the mailboxes, so that its holder learns of a waiter from
    /// the one record it polls anyway (fs/cluster.rs serves them, not `serve_mailbox`).
    Global = 2,
}

/// A lockable object: class in the top two bits, number below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectId(u64);

impl ObjectId {
    fn make(class: u64, n: u64, what: &str) -> Result<Self> {
        if n > NUMBER_MASK || (class == 0 && n == 0) {
            bail!(InvalidInput, "{what} {n} cannot be named by an object lock");
        }
        Ok(Self(class << CLASS_SHIFT | n))
    }

    /// Inode `ino` (1 ..= 2^62 − 1).
    pub fn inode(ino: u64) -> Result<Self> {
        Self::make(0, ino, "inode")
    }

    /// Allocation group `g` (< 2^62).
    pub fn group(g: u64) -> Result<Self> {
        Self::make(1, g, "allocation group")
    }

    pub fn volume(l: VolumeLock) -> Self {
        Self(2 << CLASS_SHIFT | l as u64)
    }

    /// The id as stored in buckets and mailboxes.
    pub fn raw(self) -> u64 {
        self.0
    }

    /// An id read from disk: non-zero, class 0 to 2.
    pub fn from_raw(raw: u64) -> Result<Self> {
        if raw == 0 || raw >> CLASS_SHIFT == 3 {
            return Err(Error::corrupted(format!(
                "object id {raw:#x} names no object"
            )));
        }
        Ok(Self(raw))
    }

    pub fn class(self) -> Class {
        match self.0 >> CLASS_SHIFT {
            0 => Class::Inode,
            1 => Class::Group,
            _ => Class::Volume,
        }
    }

    pub fn number(self) -> u64 {
        self.0 & NUMBER_MASK
    }
}

/// One lock a multi-object operation needs; `dir` says an inode is a directory (directory
/// inodes are locked before other inodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockWant {
    pub obj: ObjectId,
    pub mode: LockMode,
    pub dir: bool,
}

fn order_key(w: &LockWant) -> (u8, u64) {
    let rank = match (w.obj.class(), w.dir) {
        (Class::Volume, _) => 0,
        (Class::Inode, true) => 1,
        (Class::Inode, false) => 2,
        (Class::Group, _) => 3,
    };
    (rank, w.obj.number())
}

/// Put `set` into the global lock order of the module doc, merging duplicates (the stronger
/// mode wins; an object named as a directory anywhere counts as one).
pub fn lock_order(set: &mut Vec<LockWant>) {
    let mut merged: HashMap<ObjectId, LockWant> = HashMap::new();
    for w in set.drain(..) {
        merged
            .entry(w.obj)
            .and_modify(|m| {
                if w.mode.rank() > m.mode.rank() {
                    m.mode = w.mode;
                }
                m.dir |= w.dir;
            })
            .or_insert(w);
    }
    set.extend(merged.into_values());
    set.sort_by_key(order_key);
}

/// How long CAW errors of unknown outcome in a row are retried through unless
/// [`ObjectLocks::with_io_patience`] says otherwise (the mount sets the lease's fail time).
const DEFAULT_IO_PATIENCE: Duration = Duration::from_secs(10);

/// Where the two record arrays live: `buckets` bucket records from byte `bucket_offset`,
/// `mailboxes` mailbox records (one per node slot) from byte `mailbox_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjectLockArea {
    pub bucket_offset: u64,
    pub buckets: u64,
    pub mailbox_offset: u64,
    pub mailboxes: u32,
}

impl ObjectLockArea {
    /// The bucket `obj` lives in: `splitmix64(id) mod buckets` (0 for an area without buckets,
    /// which `ObjectLocks::new` refuses).
    pub fn bucket_of(&self, obj: ObjectId) -> u64 {
        splitmix64(obj.raw()) % self.buckets.max(1)
    }
}

/// A lock as granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub obj: ObjectId,
    /// Shared or Exclusive (what the entry shows me holding: may be stronger than asked).
    pub mode: LockMode,
    /// The entry's version now.
    pub version: u64,
    /// The entry's version before this grant (= `version` unless this grant began an
    /// exclusive hold).
    pub previous: u64,
    /// Another slot waits for this object: hand it over soon.
    pub contended: bool,
}

impl Grant {
    /// Is a cache that was valid at version `validator` (the version of this node's last grant
    /// of the object) still valid? None (nothing cached) is never valid.
    pub fn cache_valid(&self, validator: Option<u64>) -> bool {
        validator == Some(self.previous)
    }
}

/// The holder's side of a handoff, implemented by the filesystem (module doc).
///
/// The caller serializes, per object, its own `acquire`/`release` with a handoff: between
/// `flush` returning Ok(true) and `handed`, no local user may start using the object or
/// acquire it again (the bucket still shows this node holding it until the handoff CAW).
pub trait Handoff {
    /// `obj` is about to go from this node's hold to `to` (Free: released, Shared:
    /// downgraded). Wait for the in-flight work under it, block new work and acquires of it,
    /// and commit and write home every journaled block it protects. Ok(true) = ready; Ok(false)
    /// = not yet (nothing changes; the request is seen again next tick); Err = failed
    /// (nothing is released: the node should fence, and recovery releases after replay).
    fn flush(&mut self, obj: ObjectId, to: LockMode) -> Result<bool>;
    /// After `flush` said Ok(true): the result of the handoff CAW. On Ok, `now` is what this
    /// node holds of `obj` from here on: the `to` of the flush, or, if the bucket no longer
    /// showed the hold the flush was for (nothing was written), what it shows (Free if
    /// nothing). Local users must acquire again before using the object beyond `now`.
    fn handed(&mut self, obj: ObjectId, now: LockMode, result: &Result<()>);
}

/// What one [`ObjectLocks::serve_mailbox`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    /// Requests read.
    pub requests: usize,
    /// Locks released or downgraded.
    pub handed: usize,
    /// Requests left for the next tick (the flush said "not yet").
    pub deferred: usize,
}

/// Counters for tests and benchmarks.
#[derive(Debug, Default)]
pub struct Stats {
    /// Bucket COMPARE AND WRITEs issued.
    pub caws: AtomicU64,
    /// Of those, how many lost to another writer (miscompare, read-back without our nonce).
    pub miscompares: AtomicU64,
    /// Mailbox requests written.
    pub posts: AtomicU64,
    /// Entries evicted into a floor.
    pub evictions: AtomicU64,
}

/// The object-lock area of one volume (see the module doc).
#[derive(Debug)]
pub struct ObjectLocks {
    dev: SharedDevice,
    lbs: usize,
    area: ObjectLockArea,
    mail: Mailboxes,
    grace: Duration,
    refresh: Duration,
    backoff_first: Duration,
    backoff_max: Duration,
    /// How long I/O errors in a row are retried through ([`IoPatience`]).
    io_patience: Duration,
    pub stats: Stats,
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The first waiter of `e` after `slot` in ascending order, wrapping (not `slot` itself).
fn next_waiter(e: &Entry, slot: u32, shared_only: bool) -> u16 {
    let mut ws: Vec<u32> = e
        .waiters()
        .filter(|m| m.slot != slot && (!shared_only || m.role == Role::WaitShared))
        .map(|m| m.slot)
        .collect();
    ws.sort_unstable();
    ws.iter()
        .find(|&&s| s > slot)
        .or(ws.first())
        .and_then(|&s| u16::try_from(s).ok())
        .unwrap_or(NO_NEXT)
}

/// Remove the mentions `gone` picks from `e`, handing on what they held as a release does.
/// `dead`: the removed owner did not release (it died): version + 1.
fn remove_mentions(e: &mut Entry, gone: &dyn Fn(&Mention) -> bool, dead: bool) {
    let removed: Vec<Mention> = e.mentions.iter().filter(|m| gone(m)).copied().collect();
    if removed.is_empty() {
        return;
    }
    e.mentions.retain(|m| !gone(m));
    if dead && removed.iter().any(|m| m.role == Role::Owner) {
        e.version = e.version.wrapping_add(1);
    }
    for m in &removed {
        if m.role.holds() || u32::from(e.next) == m.slot {
            e.next = next_waiter(e, m.slot, false);
        }
    }
    if e.waiters().next().is_none() {
        e.next = NO_NEXT;
    }
}

/// My owner mention becomes a shared holder; the first shared waiter after me is `next`.
fn downgrade_entry(e: &mut Entry, me: Me) {
    for m in &mut e.mentions {
        if m.slot == me.slot {
            m.role = Role::Holder;
        }
    }
    e.next = next_waiter(e, me.slot, true);
}

/// What `e` says `me` holds (at my generation).
fn held(e: &Entry, me: Me) -> Option<LockMode> {
    e.mention(me.slot)
        .filter(|m| m.gen == me.gen)
        .and_then(|m| match m.role {
            Role::Owner => Some(LockMode::Exclusive),
            Role::Holder => Some(LockMode::Shared),
            _ => None,
        })
}

/// The holders that keep `me` from holding `e` in `mode`.
fn blockers(e: &Entry, me: Me, mode: LockMode) -> Vec<Mention> {
    e.holders()
        .filter(|m| m.slot != me.slot)
        .filter(|m| mode == LockMode::Exclusive || m.role == Role::Owner)
        .copied()
        .collect()
}

fn compatible(e: &Entry, me: Me, mode: LockMode) -> bool {
    let other_owner = e.owner().is_some_and(|m| m.slot != me.slot);
    match mode {
        LockMode::Exclusive => !other_owner && e.holders().all(|m| m.slot == me.slot),
        _ => {
            !other_owner
                && (u32::from(e.next) == me.slot
                    || !e
                        .waiters()
                        .any(|m| m.slot != me.slot && m.role == Role::WaitExclusive))
        }
    }
}

impl ObjectLocks {
    /// The area must lie inside the device, on logical-block boundaries, without overlap;
    /// `handoff_grace` (2 × `io_timeout` in production) bounds the wait for a named `next`.
    pub fn new(dev: SharedDevice, area: ObjectLockArea, handoff_grace: Duration) -> Result<Self> {
        let geo = dev.geometry();
        let lbs = geo.lbs();
        let end = |off: u64, n: u64| n.checked_mul(lbs).and_then(|b| off.checked_add(b));
        let (Some(be), Some(me)) = (
            end(area.bucket_offset, area.buckets),
            end(area.mailbox_offset, u64::from(area.mailboxes)),
        ) else {
            bail!(Range, "object-lock area {area:?} overflows");
        };
        if area.buckets == 0
            || area.mailboxes == 0
            || !area.bucket_offset.is_multiple_of(lbs)
            || !area.mailbox_offset.is_multiple_of(lbs)
            || be > geo.size_bytes
            || me > geo.size_bytes
            || (area.bucket_offset < me && area.mailbox_offset < be)
        {
            bail!(
                InvalidInput,
                "object-lock area {area:?} is empty, unaligned, overlapping or beyond the {}-byte device",
                geo.size_bytes
            );
        }
        Ok(Self {
            mail: Mailboxes::new(dev.clone(), area.mailbox_offset, area.mailboxes),
            lbs: usize::try_from(lbs)
                .map_err(|_| Error::new(crate::ErrorKind::Range, "logical block size"))?,
            dev,
            area,
            grace: handoff_grace,
            refresh: Duration::from_millis(50),
            backoff_first: BACKOFF_FIRST,
            backoff_max: BACKOFF_MAX,
            io_patience: DEFAULT_IO_PATIENCE,
            stats: Stats::default(),
        })
    }

    /// How long I/O errors of a lock change in a row are retried through (the lease's fail
    /// time on a mounted node: by then the lease has run out and the node is fenced).
    #[must_use]
    pub fn with_io_patience(mut self, budget: Duration) -> Self {
        self.io_patience = budget;
        self
    }

    /// Other contention backoff bounds (tests on memory devices poll faster).
    #[must_use]
    pub fn with_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff_first = first.max(Duration::from_micros(1));
        self.backoff_max = max.max(self.backoff_first);
        self.mail = self.mail.with_backoff(first, max);
        self
    }

    /// How often a waiter posts its request again to a holder that still blocks it (50 ms).
    #[must_use]
    pub fn with_refresh(mut self, refresh: Duration) -> Self {
        self.refresh = refresh;
        self
    }

    pub fn mailboxes(&self) -> &Mailboxes {
        &self.mail
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(self.backoff_first, self.backoff_max)
    }

    /// The bucket `obj` hashes to.
    pub fn bucket_of(&self, obj: ObjectId) -> u64 {
        self.area.bucket_of(obj)
    }

    /// How many entries with one mention the area holds (each bucket: as many as fit in its
    /// logical block): what the nodes may keep cached at once, together, before acquires
    /// start to wait for room (module doc, eviction).
    pub fn capacity(&self) -> u64 {
        use crate::format::object_lock::{ENTRY_BYTES, HEADER_BYTES, MENTION_BYTES};
        let per = self.lbs.saturating_sub(HEADER_BYTES + 4) / (ENTRY_BYTES + MENTION_BYTES);
        self.area
            .buckets
            .saturating_mul(u64::try_from(per).unwrap_or(0))
    }

    fn offset(&self, index: u64) -> u64 {
        self.area.bucket_offset + index * self.lbs as u64
    }

    /// Bucket `index` and its raw image (torn reads re-read).
    pub fn read_bucket(&self, index: u64) -> Result<(Vec<u8>, Bucket)> {
        if index >= self.area.buckets {
            bail!(
                Range,
                "object-lock bucket {index} is outside the area of {}",
                self.area.buckets
            );
        }
        read_validated(
            &*self.dev,
            self.offset(index),
            self.lbs,
            "object-lock bucket unreadable after re-reads",
            |b| Bucket::decode(b, index),
        )
    }

    fn swap(&self, index: u64, expected: &[u8], new: &mut Bucket) -> Result<bool> {
        let old = expected
            .get(NONCE_OFFSET..NONCE_OFFSET + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_le_bytes);
        new.index = index;
        new.nonce = fresh_nonce(old);
        let image = new.encode(self.lbs)?;
        let nonce = new.nonce;
        self.stats.caws.fetch_add(1, Ordering::Relaxed);
        let won = caw_read_back(
            &*self.dev,
            self.offset(index) / self.lbs as u64,
            expected,
            &image,
            &format_args!("object-lock bucket {index}"),
            || Ok(self.read_bucket(index)?.1.nonce == nonce),
        )?;
        if !won {
            self.stats.miscompares.fetch_add(1, Ordering::Relaxed);
        }
        Ok(won)
    }

    /// [`swap`](Self::swap) inside a read-modify-CAW loop: a CAW error of unknown outcome
    /// (our image may have landed and been changed since by another writer, so the read-back
    /// cannot tell) counts as a lost round — the loop re-reads and sees what is true — for as
    /// long as `io` allows ([`IoPatience`]); then it, and any other error, is returned.
    fn swap_in_loop(
        &self,
        index: u64,
        expected: &[u8],
        new: &mut Bucket,
        io: &mut IoPatience,
    ) -> Result<bool> {
        let what = format_args!("object-lock bucket {index}");
        match self.swap(index, expected, new) {
            Ok(won) => {
                io.ok(&what);
                Ok(won)
            }
            Err(e) => io.absorb(e, &what).map(|()| false),
        }
    }

    /// Read-modify-CAW until it sticks; `f` returns None to write nothing.
    fn update(
        &self,
        index: u64,
        mut f: impl FnMut(&Bucket) -> Option<Bucket>,
    ) -> Result<Option<Bucket>> {
        let mut backoff = self.backoff();
        let mut io = IoPatience::new(self.io_patience);
        loop {
            let (raw, cur) = self.read_bucket(index)?;
            let Some(mut new) = f(&cur) else {
                return Ok(None);
            };
            if self.swap_in_loop(index, &raw, &mut new, &mut io)? {
                return Ok(Some(new));
            }
            backoff.sleep();
        }
    }

    /// Put `e` (the new state of its object) into `b`, evicting idle entries of other objects
    /// while the block is too full; `fresh` = `b` had no entry for it, so its version counts
    /// from the floor after eviction (+ 1 more if `bump`, an exclusive grant). False if there
    /// is no room.
    fn place(&self, b: &mut Bucket, mut e: Entry, fresh: bool, bump: bool) -> bool {
        let obj = e.object;
        b.entries.retain(|x| x.object != obj);
        if !fresh && bump {
            e.version = e.version.wrapping_add(1);
        }
        b.entries.push(e);
        let mut evicted = 0;
        while !b.fits(self.lbs) {
            let Some(i) = b
                .entries
                .iter()
                .position(|x| x.object != obj && x.evictable())
            else {
                return false;
            };
            let x = b.entries.swap_remove(i);
            b.floor = b.floor.max(x.version);
            evicted += 1;
        }
        if fresh {
            let floor = b.floor;
            if let Some(x) = b.entry_mut(obj) {
                x.version = floor.wrapping_add(1 + u64::from(bump));
            }
        }
        self.stats.evictions.fetch_add(evicted, Ordering::Relaxed);
        true
    }

    /// Post `req` to `to` unless it was posted there less than `refresh` ago; errors are logged
    /// (the request is retried at the next refresh).
    fn ask(&self, to: Mention, req: Request, asked: &mut HashMap<(u32, u64, u64), Instant>) {
        let key = (to.slot, to.gen, req.object);
        if asked.get(&key).is_some_and(|t| t.elapsed() < self.refresh) {
            return;
        }
        asked.insert(key, Instant::now());
        match self.mail.post(to.slot, req) {
            Ok(Posted::Added) => {
                self.stats.posts.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Posted::Present) => {}
            Ok(Posted::Full) => tracing::debug!("mailbox of slot {} is full", to.slot),
            Err(e) => tracing::debug!("could not post a lock request to slot {}: {e}", to.slot),
        }
    }

    /// No room in `b` for `obj`: ask the holders of one held entry without waiters to give it
    /// up, at most once per `refresh` (the entry asked rotates, so a busy one does not block
    /// forever; one at a time, so no more cached locks are given up than needed).
    fn ask_room(
        &self,
        me: Me,
        b: &Bucket,
        obj: u64,
        last: &mut (Option<Instant>, usize),
        asked: &mut HashMap<(u32, u64, u64), Instant>,
    ) {
        if last.0.is_some_and(|t| t.elapsed() < self.refresh) {
            return;
        }
        *last = (Some(Instant::now()), last.1.wrapping_add(1));
        let round = last.1;
        let idle: Vec<&Entry> = b
            .entries
            .iter()
            .filter(|e| e.object != obj && e.waiters().next().is_none())
            .collect();
        let Some(victim) = idle.get(round % idle.len().max(1)) else {
            return;
        };
        for h in victim.holders() {
            let req = Request {
                object: victim.object,
                slot: me.slot,
                gen: me.gen,
                want: Want::Room,
            };
            self.ask(*h, req, asked);
        }
    }

    /// Block until `me` holds `obj` in `mode` (Shared or Exclusive); see the module doc.
    /// `abort` is polled every round; Some(err) ends the wait with that error.
    pub fn acquire(
        &self,
        me: Me,
        obj: ObjectId,
        mode: LockMode,
        abort: &dyn Fn() -> Option<Error>,
    ) -> Result<Grant> {
        check_slot(me.slot)?;
        if mode == LockMode::Free || me.slot >= self.area.mailboxes {
            bail!(
                InvalidInput,
                "acquire of {obj:?} needs Shared or Exclusive and a slot with a mailbox"
            );
        }
        let index = self.bucket_of(obj);
        let o = obj.raw();
        let excl = mode == LockMode::Exclusive;
        let wait_role = if excl {
            Role::WaitExclusive
        } else {
            Role::WaitShared
        };
        let want = if excl { Want::Exclusive } else { Want::Shared };
        let mut backoff = self.backoff();
        let mut last: Option<Entry> = None;
        let mut since = Instant::now();
        let mut asked = HashMap::new();
        let mut room_asked = (None, 0);
        let mut io = IoPatience::new(self.io_patience);
        loop {
            if let Some(e) = abort() {
                self.leave(me, obj);
                return Err(e);
            }
            let (raw, b) = self.read_bucket(index)?;
            let fresh = b.entry(o).is_none();
            let e = b
                .entry(o)
                .cloned()
                .unwrap_or_else(|| Entry::new(o, b.floor.wrapping_add(1)));
            if let Some(h) = held(&e, me).filter(|h| h.rank() >= mode.rank()) {
                return Ok(Grant {
                    obj,
                    mode: h,
                    version: e.version,
                    previous: e.version,
                    contended: e.waiters().any(|m| m.slot != me.slot),
                });
            }
            if last.as_ref() != Some(&e) {
                last = Some(e.clone());
                since = Instant::now();
            }
            let eligible =
                e.next == NO_NEXT || u32::from(e.next) == me.slot || since.elapsed() >= self.grace;
            let mut nb = b.clone();
            if eligible && compatible(&e, me, mode) {
                let mut ne = e.clone();
                ne.mentions.retain(|m| m.slot != me.slot);
                ne.mentions.push(Mention {
                    slot: me.slot,
                    role: if excl { Role::Owner } else { Role::Holder },
                    gen: me.gen,
                });
                ne.next = NO_NEXT;
                if self.place(&mut nb, ne, fresh, excl) {
                    let g = nb.entry(o).map(|x| Grant {
                        obj,
                        mode,
                        version: x.version,
                        previous: if excl {
                            x.version.wrapping_sub(1)
                        } else {
                            x.version
                        },
                        contended: x.waiters().next().is_some(),
                    });
                    if self.swap_in_loop(index, &raw, &mut nb, &mut io)? {
                        if let Some(g) = g {
                            return Ok(g);
                        }
                    }
                } else {
                    self.ask_room(me, &b, o, &mut room_asked, &mut asked);
                }
            } else {
                let mine = e.mention(me.slot);
                let registered = mine.is_some_and(|m| m.role == wait_role && m.gen == me.gen);
                let registered = registered || {
                    let mut ne = e.clone();
                    ne.mentions.retain(|m| m.slot != me.slot);
                    ne.mentions.push(Mention {
                        slot: me.slot,
                        role: wait_role,
                        gen: me.gen,
                    });
                    if self.place(&mut nb, ne, fresh, false) {
                        self.swap_in_loop(index, &raw, &mut nb, &mut io)?
                    } else {
                        self.ask_room(me, &b, o, &mut room_asked, &mut asked);
                        false
                    }
                };
                if registered {
                    let req = Request {
                        object: o,
                        slot: me.slot,
                        gen: me.gen,
                        want,
                    };
                    for h in blockers(&e, me, mode) {
                        self.ask(h, req, &mut asked);
                    }
                }
            }
            backoff.sleep();
        }
    }

    /// Best effort: take `me` out of `obj`'s waiters after giving up waiting.
    fn leave(&self, me: Me, obj: ObjectId) {
        let o = obj.raw();
        let r = self.update(self.bucket_of(obj), |b| {
            let e = b.entry(o)?;
            let m = e.mention(me.slot)?;
            if m.role.holds() {
                return None;
            }
            let mut n = b.clone();
            let x = n.entry_mut(o)?;
            remove_mentions(x, &|m| m.slot == me.slot, false);
            Some(n)
        });
        if let Err(e) = r {
            tracing::debug!("could not leave the waiters of {obj:?}: {e}");
        }
    }

    /// Give up `obj` (either mode; also a wait, and leftovers of an older generation of my
    /// slot), naming the next waiter round-robin. Ok also when I held nothing.
    pub fn release(&self, me: Me, obj: ObjectId) -> Result<()> {
        check_slot(me.slot)?;
        let o = obj.raw();
        self.update(self.bucket_of(obj), |b| {
            b.entry(o)?.mention(me.slot)?;
            let mut n = b.clone();
            remove_mentions(n.entry_mut(o)?, &|m| m.slot == me.slot, false);
            Some(n)
        })?;
        Ok(())
    }

    /// Exclusive → shared, naming the first shared waiter after me as `next`. Err
    /// (`InvalidInput`) if I do not hold `obj` exclusively.
    pub fn downgrade(&self, me: Me, obj: ObjectId) -> Result<Grant> {
        check_slot(me.slot)?;
        let o = obj.raw();
        let mut owned = false;
        let done = self.update(self.bucket_of(obj), |b| {
            let e = b.entry(o)?;
            owned = held(e, me) == Some(LockMode::Exclusive);
            if !owned {
                return None;
            }
            let mut n = b.clone();
            downgrade_entry(n.entry_mut(o)?, me);
            Some(n)
        })?;
        let Some(e) = done.as_ref().and_then(|b| b.entry(o)) else {
            bail!(
                InvalidInput,
                "downgrade of {obj:?}: this node does not hold it exclusively"
            );
        };
        let contended = e.waiters().next().is_some();
        Ok(Grant {
            obj,
            mode: LockMode::Shared,
            version: e.version,
            previous: e.version,
            contended,
        })
    }

    /// The requests in my own mailbox (one read).
    pub fn poll_mailbox(&self, me: Me) -> Result<Vec<Request>> {
        Ok(self.mail.read(me.slot)?.1.requests)
    }

    /// Remove exactly these requests from my mailbox.
    pub fn clear_requests(&self, me: Me, done: &[Request]) -> Result<()> {
        self.mail.clear(me.slot, done)
    }

    /// One tick of the holder's side (module doc): poll my mailbox, and for each object asked
    /// for that I hold, [`Handoff::flush`] it and hand it over (release or downgrade), then
    /// tell [`Handoff::handed`]; clear what was handled. A flush or handoff error returns at
    /// once (the requests stay).
    pub fn serve_mailbox(&self, me: Me, h: &mut dyn Handoff) -> Result<Served> {
        let reqs = self.poll_mailbox(me)?;
        self.serve_requests(me, reqs, h)
    }

    /// The part of [`serve_mailbox`](Self::serve_mailbox) after the poll, for requests the
    /// caller read (and perhaps filtered) itself.
    pub fn serve_requests(
        &self,
        me: Me,
        reqs: Vec<Request>,
        h: &mut dyn Handoff,
    ) -> Result<Served> {
        let mut out = Served {
            requests: reqs.len(),
            ..Served::default()
        };
        if reqs.is_empty() {
            return Ok(out);
        }
        let mut by_obj: BTreeMap<u64, Vec<Request>> = BTreeMap::new();
        for r in reqs {
            by_obj.entry(r.object).or_default().push(r);
        }
        let mut done = Vec::new();
        for (o, rs) in by_obj {
            let Ok(obj) = ObjectId::from_raw(o) else {
                done.extend(rs);
                continue;
            };
            let (_, b) = self.read_bucket(self.bucket_of(obj))?;
            let e = b.entry(o);
            let mine = e.and_then(|e| held(e, me));
            let live = |r: &Request| {
                r.want == Want::Room
                    || e.and_then(|e| e.mention(r.slot))
                        .is_some_and(|m| m.gen == r.gen && !m.role.holds())
            };
            let strongest = rs
                .iter()
                .filter(|r| live(r))
                .map(|r| r.want)
                .max_by_key(|w| match w {
                    Want::Shared => 0,
                    _ => 1,
                });
            let to = match (mine, strongest) {
                (Some(LockMode::Exclusive), Some(Want::Shared)) => Some(LockMode::Shared),
                (Some(_), Some(Want::Exclusive | Want::Room)) => Some(LockMode::Free),
                _ => None,
            };
            if let (Some(seen), Some(to)) = (mine, to) {
                if !h.flush(obj, to)? {
                    out.deferred += rs.len();
                    continue;
                }
                let (now, r) = match self.hand_over(me, obj, seen, to) {
                    Ok(now) => (now, Ok(())),
                    Err(e) => (to, Err(e)),
                };
                h.handed(obj, now, &r);
                r?;
                if now.rank() > to.rank() {
                    // Nothing moved (the hold became stronger meanwhile, e.g. a local upgrade):
                    // the requests stay for the next tick.
                    out.deferred += rs.len();
                    continue;
                }
                out.handed += 1;
            }
            done.extend(rs);
        }
        crate::failpoint!("objlock::handoff_before_clear");
        self.clear_requests(me, &done)?;
        Ok(out)
    }

    /// The handoff CAW of [`Self::serve_mailbox`] (also a holder's own give-back): release
    /// (`to` Free) or downgrade `obj`, only if the bucket still shows me holding it in `seen`.
    /// Returns what I hold now: `to`, or what the bucket shows (Free if nothing) when it did
    /// not show `seen` and nothing was written.
    pub fn hand_over(
        &self,
        me: Me,
        obj: ObjectId,
        seen: LockMode,
        to: LockMode,
    ) -> Result<LockMode> {
        crate::failpoint!("objlock::handoff_after_flush");
        let o = obj.raw();
        let mut shown = LockMode::Free;
        let written = self.update(self.bucket_of(obj), |b| {
            shown = b
                .entry(o)
                .and_then(|e| held(e, me))
                .unwrap_or(LockMode::Free);
            if shown != seen {
                return None;
            }
            let mut n = b.clone();
            let x = n.entry_mut(o)?;
            if to == LockMode::Free {
                remove_mentions(x, &|m| m.slot == me.slot, false);
            } else {
                downgrade_entry(x, me);
            }
            Some(n)
        })?;
        Ok(if written.is_some() { to } else { shown })
    }

    /// Every bucket that is not empty, with its index, in reads of up to 64 records (a record
    /// that fails validation is re-read on its own; one that stays corrupted is skipped: it
    /// names nobody readably, and fsck reports it). Only buckets with entries are kept, so a
    /// scan of a large, mostly idle area (16,384 buckets) costs memory for what is in use.
    fn used_buckets(&self) -> Result<Vec<(u64, Bucket)>> {
        let mut out = Vec::new();
        let mut first = 0;
        while first < self.area.buckets {
            let n = (self.area.buckets - first).min(64);
            let mut buf = crate::dev::AlignedBuf::new(usize::try_from(n).unwrap_or(64) * self.lbs);
            self.dev.read_at(self.offset(first), &mut buf)?;
            for (i, chunk) in (first..).zip(buf.chunks(self.lbs)) {
                let b = match Bucket::decode(chunk, i) {
                    Ok(b) => Some(b),
                    Err(_) => self.read_bucket(i).ok().map(|(_, b)| b),
                };
                if let Some(b) = b.filter(|b| !b.entries.is_empty()) {
                    out.push((i, b));
                }
            }
            first += n;
        }
        Ok(out)
    }

    /// Release every lock and wait of dead `slot` (at generation `gen`; None = any) and empty
    /// its mailbox. Call only after its journal is replayed. Returns the buckets changed.
    pub fn scrub_slot(&self, slot: u32, gen: Option<u64>) -> Result<usize> {
        check_slot(slot)?;
        let gone = |m: &Mention| m.slot == slot && gen.is_none_or(|g| g == m.gen);
        let mut changed = 0;
        for (i, b) in self.used_buckets()? {
            if !b.entries.iter().any(|e| e.mentions.iter().any(gone)) {
                continue;
            }
            let w = self.update(i, |b| {
                if !b.entries.iter().any(|e| e.mentions.iter().any(gone)) {
                    return None;
                }
                let mut n = b.clone();
                for e in &mut n.entries {
                    remove_mentions(e, &gone, true);
                }
                Some(n)
            })?;
            changed += usize::from(w.is_some());
        }
        if slot < self.area.mailboxes {
            self.mail.reset(slot)?;
        }
        Ok(changed)
    }

    /// Remove every mention of a slot that no longer holds that generation (lock.rs's
    /// staleness rule), judged by `life()`, a heartbeat scan called after each bucket read;
    /// the new image is CAW'd against that read. Returns one line per bucket changed.
    pub fn drop_stale(&self, life: &dyn Fn() -> Result<Vec<SlotLife>>) -> Result<Vec<String>> {
        let at = |lives: &[SlotLife], s: u32| {
            usize::try_from(s)
                .ok()
                .and_then(|s| lives.get(s).copied())
                .unwrap_or(SlotLife::Gone)
        };
        let first = life()?;
        let mut changed = Vec::new();
        for (i, b) in self.used_buckets()? {
            let stale_in = |b: &Bucket, lives: &[SlotLife]| {
                b.entries.iter().any(|e| {
                    e.mentions
                        .iter()
                        .any(|m| is_stale(at(lives, m.slot), Some(m.gen)))
                })
            };
            if !stale_in(&b, &first) {
                continue;
            }
            let mut backoff = self.backoff();
            loop {
                let (raw, cur) = self.read_bucket(i)?;
                let lives = life()?;
                if !stale_in(&cur, &lives) {
                    break;
                }
                let mut n = cur.clone();
                let mut what = Vec::new();
                for e in &mut n.entries {
                    let gone = |m: &Mention| is_stale(at(&lives, m.slot), Some(m.gen));
                    for m in e.mentions.iter().filter(|m| gone(m)) {
                        what.push(format!(
                            "{:?} slot {} (generation {}) of object {:#x}",
                            m.role, m.slot, m.gen, e.object
                        ));
                    }
                    remove_mentions(e, &gone, true);
                }
                if self.swap(i, &raw, &mut n)? {
                    changed.push(format!(
                        "object-lock bucket {i}: removed {}",
                        what.join(", ")
                    ));
                    break;
                }
                backoff.sleep();
            }
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests;
