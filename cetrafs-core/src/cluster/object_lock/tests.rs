use super::*;
use crate::dev::mem::MemDevice;
use crate::dev::{BlockDevice, CawOutcome, Geometry};
use crate::error::ErrorKind;
use crate::format::object_lock::{ENTRY_BYTES as ENTRY, MENTION_BYTES as MENTION};
use rand::Rng;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Condvar, Mutex};

const FAST_FIRST: Duration = Duration::from_micros(20);
const FAST_MAX: Duration = Duration::from_micros(500);
const SLOTS: u32 = 8;

/// A memory LUN that can lie about CAW outcomes and tear reads (the ATS lesson and LIO's torn
/// reads, `docs/locking.md` §6).
#[derive(Debug)]
struct Faulty {
    inner: MemDevice,
    /// Every CAW whose sequence number is a multiple of this (0 = never) is performed and
    /// then reported as a Miscompare (odd sequence) or an I/O error (even).
    lie_every: AtomicU32,
    cawn: AtomicU32,
    /// The next this-many reads come back with one flipped bit.
    torn: AtomicU32,
    lies: AtomicU32,
}

impl Faulty {
    fn new(size: u64, lbs: u32) -> Self {
        Self {
            inner: MemDevice::new(size, lbs),
            lie_every: AtomicU32::new(0),
            cawn: AtomicU32::new(0),
            torn: AtomicU32::new(0),
            lies: AtomicU32::new(0),
        }
    }
}

impl BlockDevice for Faulty {
    fn geometry(&self) -> &Geometry {
        self.inner.geometry()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.inner.read_at(offset, buf)?;
        if self
            .torn
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
        {
            buf[33] ^= 0x10;
        }
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.inner.write_at(offset, buf)
    }
    fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
        let r = self.inner.compare_and_write(lba, expected, new)?;
        let every = self.lie_every.load(Ordering::Relaxed);
        let n = self.cawn.fetch_add(1, Ordering::Relaxed) + 1;
        if r == CawOutcome::Written && every > 0 && n.is_multiple_of(every) {
            self.lies.fetch_add(1, Ordering::Relaxed);
            if n % 2 == 1 {
                return Ok(CawOutcome::Miscompare);
            }
            return Err(crate::scsi::ScsiFailure::new(
                crate::scsi::FailureKind::Timeout,
                crate::scsi::CommandKind::CompareAndWrite,
                true,
                None,
                "command timed out".into(),
            )
            .into_error("COMPARE AND WRITE"));
        }
        Ok(r)
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

fn area(buckets: u64, lbs: u64) -> ObjectLockArea {
    ObjectLockArea {
        bucket_offset: 16 * lbs,
        buckets,
        mailbox_offset: (16 + buckets) * lbs,
        mailboxes: SLOTS,
    }
}

fn locks_on(dev: SharedDevice, buckets: u64, grace: Duration) -> ObjectLocks {
    let lbs = dev.geometry().lbs();
    ObjectLocks::new(dev, area(buckets, lbs), grace)
        .unwrap()
        .with_backoff(FAST_FIRST, FAST_MAX)
        .with_refresh(Duration::from_millis(5))
}

fn mem(lbs: u32) -> Arc<MemDevice> {
    Arc::new(MemDevice::new(4 << 20, lbs))
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

fn ino(n: u64) -> ObjectId {
    ObjectId::inode(n).unwrap()
}

/// `n` inode objects that all hash to bucket 0 of `t`.
fn same_bucket(t: &ObjectLocks, n: usize) -> Vec<ObjectId> {
    (1..)
        .map(ino)
        .filter(|&o| t.bucket_of(o) == 0)
        .take(n)
        .collect()
}

#[test]
fn object_lock_ids_and_order() {
    assert!(ObjectId::inode(0).is_err());
    assert!(ObjectId::inode(1 << 62).is_err());
    let g0 = ObjectId::group(0).unwrap();
    assert_eq!((g0.class(), g0.number()), (Class::Group, 0));
    assert_ne!(g0.raw(), 0);
    let r = ObjectId::volume(VolumeLock::Rename);
    assert_eq!(r.class(), Class::Volume);
    assert_eq!(ObjectId::from_raw(ino(77).raw()).unwrap(), ino(77));
    assert!(ObjectId::from_raw(0).is_err() && ObjectId::from_raw(3 << 62).is_err());
    let w = |obj, mode, dir| LockWant { obj, mode, dir };
    let mut set = vec![
        w(ObjectId::group(3).unwrap(), LockMode::Exclusive, false),
        w(ino(50), LockMode::Shared, false),
        w(ino(90), LockMode::Exclusive, true),
        w(r, LockMode::Exclusive, false),
        w(ino(7), LockMode::Shared, false),
        w(ino(50), LockMode::Exclusive, false),
        w(ino(60), LockMode::Shared, true),
        w(g0, LockMode::Exclusive, false),
    ];
    lock_order(&mut set);
    let got: Vec<(ObjectId, LockMode)> = set.iter().map(|w| (w.obj, w.mode)).collect();
    assert_eq!(
        got,
        vec![
            (r, LockMode::Exclusive),
            (ino(60), LockMode::Shared),
            (ino(90), LockMode::Exclusive),
            (ino(7), LockMode::Shared),
            (ino(50), LockMode::Exclusive),
            (g0, LockMode::Exclusive),
            (ObjectId::group(3).unwrap(), LockMode::Exclusive),
        ]
    );
}

#[test]
fn object_lock_area_is_checked() {
    let dev: SharedDevice = mem(512);
    let ok = area(4, 512);
    assert!(ObjectLocks::new(dev.clone(), ok, Duration::ZERO).is_ok());
    for bad in [
        ObjectLockArea { buckets: 0, ..ok },
        ObjectLockArea {
            bucket_offset: 100,
            ..ok
        },
        ObjectLockArea {
            mailbox_offset: ok.bucket_offset + 512,
            ..ok
        },
        ObjectLockArea {
            buckets: u64::MAX / 2,
            ..ok
        },
        ObjectLockArea {
            mailbox_offset: 4 << 20,
            ..ok
        },
    ] {
        assert!(
            ObjectLocks::new(dev.clone(), bad, Duration::ZERO).is_err(),
            "{bad:?}"
        );
    }
}

#[test]
fn object_lock_grants_versions_upgrade_downgrade_release() {
    for lbs in [512, 4096] {
        let dev = mem(lbs);
        let t = locks_on(dev.clone(), 4, Duration::from_secs(1));
        let x = ino(42);
        let g = t.acquire(me(1), x, LockMode::Exclusive, &never).unwrap();
        assert_eq!((g.mode, g.version, g.previous), (LockMode::Exclusive, 2, 1));
        assert!(!g.cache_valid(None) && !g.contended);
        // Cached: asking again writes nothing.
        let w = dev.writes.load(Ordering::Relaxed);
        let again = t.acquire(me(1), x, LockMode::Shared, &never).unwrap();
        assert_eq!((again.mode, again.version), (LockMode::Exclusive, 2));
        assert_eq!(dev.writes.load(Ordering::Relaxed), w);
        let d = t.downgrade(me(1), x).unwrap();
        assert_eq!((d.mode, d.version), (LockMode::Shared, 2));
        assert!(t.downgrade(me(1), x).is_err(), "not exclusive any more");
        let s2 = t.acquire(me(2), x, LockMode::Shared, &never).unwrap();
        assert!(s2.cache_valid(Some(2)), "nobody changed it since version 2");
        t.release(me(1), x).unwrap();
        // Slot 2 is the only holder: it upgrades in place.
        let u = t.acquire(me(2), x, LockMode::Exclusive, &never).unwrap();
        assert_eq!((u.version, u.previous), (3, 2));
        assert!(u.cache_valid(Some(2)));
        t.release(me(2), x).unwrap();
        let s1 = t.acquire(me(1), x, LockMode::Shared, &never).unwrap();
        assert!(!s1.cache_valid(Some(2)), "slot 2 held it exclusively since");
        assert!(s1.cache_valid(Some(3)));
        t.release(me(1), x).unwrap();
        t.release(me(1), x).unwrap();
        let (_, b) = t.read_bucket(t.bucket_of(x)).unwrap();
        let e = b.entry(x.raw()).unwrap();
        assert!(
            e.evictable() && e.version == 3,
            "kept with its version: {e:?}"
        );
        assert!(t.acquire(me(1), x, LockMode::Free, &never).is_err());
        assert!(t.acquire(me(SLOTS), x, LockMode::Shared, &never).is_err());
    }
}

/// A node of the in-process cluster: its cached locks, the objects' cached values
/// (write-back), and its mailbox server. `Handoff` writes dirty values home.
struct Node {
    me: Me,
    t: Arc<ObjectLocks>,
    st: Mutex<NodeState>,
    cv: Condvar,
    home: Arc<Mutex<HashMap<ObjectId, u64>>>,
}

#[derive(Default)]
struct NodeState {
    /// obj -> (mode, users, validator, cached value, dirty)
    held: HashMap<ObjectId, (LockMode, u32, u64, u64, bool)>,
    busy: HashSet<ObjectId>,
    /// Last validator per object, kept after release.
    validators: HashMap<ObjectId, (u64, u64)>,
    grants: u64,
    reloads: u64,
}

impl Node {
    /// Take `obj` in `mode` for one use (acquiring if the cached hold is not enough).
    fn use_lock(&self, obj: ObjectId, mode: LockMode) -> Grant {
        {
            let mut st = self.st.lock().unwrap();
            while st.busy.contains(&obj) {
                st = self.cv.wait(st).unwrap();
            }
            if let Some(h) = st.held.get_mut(&obj) {
                if h.0.rank() >= mode.rank() {
                    h.1 += 1;
                    return Grant {
                        obj,
                        mode: h.0,
                        version: h.2,
                        previous: h.2,
                        contended: false,
                    };
                }
            }
            st.busy.insert(obj);
            drop(st);
            let g = self.t.acquire(self.me, obj, mode, &never).unwrap();
            let mut st = self.st.lock().unwrap();
            st.busy.remove(&obj);
            self.cv.notify_all();
            st.grants += 1;
            let cached = st.validators.get(&obj).copied();
            let value = match cached {
                Some((v, val)) if g.cache_valid(Some(v)) => val,
                _ => {
                    st.reloads += 1;
                    *self.home.lock().unwrap().get(&obj).unwrap_or(&0)
                }
            };
            st.held.insert(obj, (g.mode, 1, g.version, value, false));
            st.validators.insert(obj, (g.version, value));
            g
        }
    }

    fn done(&self, obj: ObjectId) {
        let mut st = self.st.lock().unwrap();
        st.held.get_mut(&obj).unwrap().1 -= 1;
        self.cv.notify_all();
    }

    fn bump(&self, obj: ObjectId) {
        let mut st = self.st.lock().unwrap();
        let h = st.held.get_mut(&obj).unwrap();
        assert_eq!(h.0, LockMode::Exclusive);
        h.3 += 1;
        h.4 = true;
        let (v, val) = (h.2, h.3);
        st.validators.insert(obj, (v, val));
    }
}

struct Server<'a>(&'a Node);

impl Handoff for Server<'_> {
    fn flush(&mut self, obj: ObjectId, _to: LockMode) -> Result<bool> {
        let n = self.0;
        let mut st = n.st.lock().unwrap();
        if st.busy.contains(&obj) {
            return Ok(false); // an acquire of it is running here
        }
        let Some(h) = st.held.get(&obj).copied() else {
            return Ok(true);
        };
        if h.1 > 0 {
            return Ok(false); // in use: hand over at a later tick
        }
        st.busy.insert(obj);
        if h.4 {
            n.home.lock().unwrap().insert(obj, h.3);
            st.held.get_mut(&obj).unwrap().4 = false;
        }
        Ok(true)
    }

    fn handed(&mut self, obj: ObjectId, now: LockMode, result: &Result<()>) {
        let n = self.0;
        let mut st = n.st.lock().unwrap();
        assert!(result.is_ok(), "{result:?}");
        if now == LockMode::Free {
            st.held.remove(&obj);
        } else if let Some(h) = st.held.get_mut(&obj) {
            h.0 = now;
        }
        st.busy.remove(&obj);
        n.cv.notify_all();
    }
}

/// Per object: (exclusive users, shared users) across all nodes, checked on every use.
type Usage = Arc<Mutex<HashMap<ObjectId, (u32, u32)>>>;

fn enter(u: &Usage, obj: ObjectId, mode: LockMode) {
    let mut m = u.lock().unwrap();
    let c = m.entry(obj).or_default();
    if mode == LockMode::Exclusive {
        assert_eq!(
            *c,
            (0, 0),
            "{obj:?} used exclusively while in use elsewhere"
        );
        c.0 = 1;
    } else {
        assert_eq!(c.0, 0, "{obj:?} used shared while used exclusively");
        c.1 += 1;
    }
}

fn leave(u: &Usage, obj: ObjectId, mode: LockMode) {
    let mut m = u.lock().unwrap();
    let c = m.get_mut(&obj).unwrap();
    if mode == LockMode::Exclusive {
        c.0 = 0;
    } else {
        c.1 -= 1;
    }
}

/// `nodes` simulated nodes doing `ops` multi-object operations each over `objects` (node `i`
/// uses objects `i .. i + span`, so neighbours overlap), serving their mailboxes every
/// millisecond. Returns (worst single acquire wait, total grants, stats of all tables).
fn stress(
    dev: SharedDevice,
    buckets: u64,
    objects: &[ObjectId],
    nodes: u32,
    span: usize,
    ops: usize,
) -> (Duration, u64, u64, u64) {
    let home: Arc<Mutex<HashMap<ObjectId, u64>>> = Arc::default();
    let usage: Usage = Arc::default();
    let increments: Arc<Mutex<HashMap<ObjectId, u64>>> = Arc::default();
    let nodes: Vec<Arc<Node>> = (0..nodes)
        .map(|s| {
            Arc::new(Node {
                me: me(s),
                t: Arc::new(locks_on(dev.clone(), buckets, Duration::from_millis(300))),
                st: Mutex::default(),
                cv: Condvar::new(),
                home: home.clone(),
            })
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let servers: Vec<_> = nodes
        .iter()
        .map(|n| {
            let (n, stop) = (n.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    n.t.serve_mailbox(n.me, &mut Server(&n)).unwrap();
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        })
        .collect();
    let workers: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let (n, usage, incs) = (n.clone(), usage.clone(), increments.clone());
            let mine: Vec<ObjectId> = (0..span)
                .map(|k| objects[(i * span / 2 + k) % objects.len()])
                .collect();
            std::thread::spawn(move || {
                let mut rng = rand::thread_rng();
                let mut worst = Duration::ZERO;
                let mut seen: HashMap<ObjectId, u64> = HashMap::new();
                for _ in 0..ops {
                    let mut set: Vec<LockWant> = (0..rng.gen_range(1..=3))
                        .map(|_| LockWant {
                            obj: mine[rng.gen_range(0..mine.len())],
                            mode: if rng.gen_bool(0.5) {
                                LockMode::Exclusive
                            } else {
                                LockMode::Shared
                            },
                            dir: false,
                        })
                        .collect();
                    lock_order(&mut set);
                    for w in &set {
                        let start = Instant::now();
                        let g = n.use_lock(w.obj, w.mode);
                        worst = worst.max(start.elapsed());
                        let last = seen.entry(w.obj).or_insert(0);
                        assert!(g.version >= *last, "version went back for {:?}", w.obj);
                        *last = g.version;
                        enter(&usage, w.obj, w.mode);
                    }
                    std::thread::yield_now();
                    for w in &set {
                        if w.mode == LockMode::Exclusive {
                            n.bump(w.obj);
                            *incs.lock().unwrap().entry(w.obj).or_default() += 1;
                        }
                        leave(&usage, w.obj, w.mode);
                        n.done(w.obj);
                    }
                }
                worst
            })
        })
        .collect();
    let worst = workers
        .into_iter()
        .map(|h| h.join().unwrap())
        .max()
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    for s in servers {
        s.join().unwrap();
    }
    // Everyone gives everything up (writing back), as at unmount.
    for n in &nodes {
        let held: Vec<_> = n.st.lock().unwrap().held.keys().copied().collect();
        for obj in held {
            let mut s = Server(n);
            assert!(s.flush(obj, LockMode::Free).unwrap());
            n.t.release(n.me, obj).unwrap();
            s.handed(obj, LockMode::Free, &Ok(()));
        }
    }
    let home = home.lock().unwrap();
    for (obj, n) in increments.lock().unwrap().iter() {
        assert_eq!(
            home.get(obj).copied().unwrap_or(0),
            *n,
            "lost or stale updates of {obj:?}: a cache validated falsely or two writers"
        );
    }
    let grants: u64 = nodes.iter().map(|n| n.st.lock().unwrap().grants).sum();
    let caws: u64 = nodes
        .iter()
        .map(|n| n.t.stats.caws.load(Ordering::Relaxed))
        .sum();
    let evictions: u64 = nodes
        .iter()
        .map(|n| n.t.stats.evictions.load(Ordering::Relaxed))
        .sum();
    // Nothing is left held or waited for.
    let t = locks_on(dev, buckets, Duration::ZERO);
    for obj in objects {
        let (_, b) = t.read_bucket(t.bucket_of(*obj)).unwrap();
        assert!(b.entry(obj.raw()).is_none_or(Entry::evictable), "{obj:?}");
    }
    eprintln!(
        "stress: {grants} grants, {caws} bucket CAWs, {evictions} evictions, worst wait {worst:?}"
    );
    (worst, grants, caws, evictions)
}

#[test]
fn object_lock_stress_overlapping_sets() {
    let dev: SharedDevice = mem(512);
    let objects: Vec<ObjectId> = (1..=16).map(ino).collect();
    let (worst, grants, _, _) = stress(dev, 4, &objects, 4, 6, 150);
    assert!(grants > 0);
    assert!(worst < Duration::from_secs(10), "a waiter waited {worst:?}");
}

#[test]
fn object_lock_stress_full_bucket_evicts_and_asks_for_room() {
    // One 512-byte bucket (14 entries with one mention each) for 24 objects: entries are
    // evicted into the floor, and room is asked of idle cached holders.
    let dev: SharedDevice = mem(512);
    let objects: Vec<ObjectId> = (1..=24).map(ino).collect();
    let (worst, _, _, evictions) = stress(dev, 1, &objects, 3, 12, 120);
    assert!(evictions > 0, "the bucket never filled");
    assert!(worst < Duration::from_secs(10), "a waiter waited {worst:?}");
}

#[test]
fn object_lock_eviction_floor_never_validates_a_stale_cache() {
    let dev = mem(512);
    let t = locks_on(dev.clone(), 1, Duration::from_secs(1));
    // As many idle entries as leave no room for one more entry with a mention.
    let idle_cap = (crate::format::object_lock::payload_bytes(512) - MENTION) / ENTRY;
    let objs = same_bucket(&t, idle_cap + 1);
    // Idle entries (exclusive once, then released) fill the bucket; versions differ.
    let mut validators = HashMap::new();
    for (k, &o) in objs[..idle_cap].iter().enumerate() {
        for _ in 0..=k % 4 {
            let g = t.acquire(me(1), o, LockMode::Exclusive, &never).unwrap();
            validators.insert(o, g.version);
            t.release(me(1), o).unwrap();
        }
    }
    let (_, b) = t.read_bucket(0).unwrap();
    assert_eq!((b.entries.len(), b.floor), (idle_cap, 0));
    // One more object: idle entries are evicted into the floor.
    let last = objs[idle_cap];
    let g = t.acquire(me(3), last, LockMode::Shared, &never).unwrap();
    let (_, b) = t.read_bucket(0).unwrap();
    let gone: Vec<ObjectId> = objs[..idle_cap]
        .iter()
        .copied()
        .filter(|o| b.entry(o.raw()).is_none())
        .collect();
    assert!(!gone.is_empty());
    assert_eq!(t.stats.evictions.load(Ordering::Relaxed), gone.len() as u64);
    assert_eq!(b.floor, gone.iter().map(|o| validators[o]).max().unwrap());
    assert_eq!(g.version, b.floor + 1, "created above the floor");
    // Every evicted object comes back above every version anyone cached for it.
    t.release(me(3), last).unwrap();
    for o in gone {
        let back = t.acquire(me(2), o, LockMode::Shared, &never).unwrap();
        assert!(back.version > validators[&o]);
        assert!(!back.cache_valid(Some(validators[&o])), "{o:?}");
        t.release(me(2), o).unwrap();
    }
}

#[test]
fn object_lock_full_bucket_waits_until_a_holder_gives_room() {
    // Slot 1 sees a Room request for one of its idle locks and gives it up.
    struct Yield(u32);
    impl Handoff for Yield {
        fn flush(&mut self, _: ObjectId, to: LockMode) -> Result<bool> {
            assert_eq!(to, LockMode::Free);
            self.0 += 1;
            Ok(true)
        }
        fn handed(&mut self, _: ObjectId, _: LockMode, r: &Result<()>) {
            assert!(r.is_ok());
        }
    }
    let dev = mem(512);
    let t = Arc::new(locks_on(dev.clone(), 1, Duration::from_secs(1)));
    let objs = same_bucket(&t, 15);
    for &o in &objs[..14] {
        t.acquire(me(1), o, LockMode::Exclusive, &never).unwrap();
    }
    let t2 = t.clone();
    let want = objs[14];
    let waiter = std::thread::spawn(move || {
        t2.acquire(me(2), want, LockMode::Exclusive, &never)
            .unwrap()
    });
    let mut y = Yield(0);
    let start = Instant::now();
    while !waiter.is_finished() {
        assert!(start.elapsed() < Duration::from_secs(10), "never got room");
        t.serve_mailbox(me(1), &mut y).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    let g = waiter.join().unwrap();
    assert_eq!(g.mode, LockMode::Exclusive);
    assert!(y.0 >= 1);
    let (_, b) = t.read_bucket(0).unwrap();
    let given_up = b.entries.iter().filter(|e| e.evictable()).count();
    assert!(
        (1..=2).contains(&given_up),
        "{given_up} cached locks given up for one entry's room"
    );
}

#[test]
fn object_lock_mailbox_handoff_latency() {
    // Two nodes bounce one inode lock; each serves its mailbox every 10 ms (the busy tick).
    let dev: SharedDevice = mem(512);
    let x = ino(5);
    let stop = Arc::new(AtomicBool::new(false));
    let node = |s: u32| {
        Arc::new(Node {
            me: me(s),
            t: Arc::new(locks_on(dev.clone(), 16, Duration::from_secs(1))),
            st: Mutex::default(),
            cv: Condvar::new(),
            home: Arc::default(),
        })
    };
    let (a, b) = (node(1), node(2));
    let servers: Vec<_> = [a.clone(), b.clone()]
        .into_iter()
        .map(|n| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    n.t.serve_mailbox(n.me, &mut Server(&n)).unwrap();
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        })
        .collect();
    let mut lat = Vec::new();
    for i in 0..40 {
        let n = if i % 2 == 0 { &a } else { &b };
        let start = Instant::now();
        n.use_lock(x, LockMode::Exclusive);
        lat.push(start.elapsed());
        n.bump(x);
        n.done(x);
    }
    stop.store(true, Ordering::Relaxed);
    for s in servers {
        s.join().unwrap();
    }
    lat.remove(0); // the first grant had nobody to ask
    lat.sort();
    let p50 = lat[lat.len() / 2];
    let p99 = lat[lat.len() * 99 / 100];
    eprintln!(
        "handoff latency over {} bounces: p50 {p50:?}, p99 {p99:?}",
        lat.len()
    );
    assert!(
        p50 >= Duration::from_micros(100),
        "no handoff happened: {p50:?}"
    );
    assert!(p99 < Duration::from_millis(200), "p99 {p99:?}");
}

#[test]
fn object_lock_fairness_round_robin() {
    // Three slots want one object exclusively over and over, releasing after each use: no slot
    // waits more than 2 × slots grants once it is registered.
    const N: u32 = 3;
    type State = (u64, HashMap<u32, u64>, u64);
    let dev: SharedDevice = mem(512);
    let x = ino(9);
    let state: Arc<Mutex<State>> = Arc::default();
    let threads: Vec<_> = (0..N)
        .map(|s| {
            let (dev, state) = (dev.clone(), state.clone());
            std::thread::spawn(move || {
                let t = locks_on(dev, 4, Duration::from_secs(10));
                for _ in 0..40 {
                    t.acquire(me(s), x, LockMode::Exclusive, &never).unwrap();
                    let (_, b) = t.read_bucket(t.bucket_of(x)).unwrap();
                    let e = b.entry(x.raw()).unwrap().clone();
                    {
                        let mut st = state.lock().unwrap();
                        st.0 += 1;
                        let n = st.0;
                        for w in e.waiters() {
                            st.1.entry(w.slot).or_insert(n);
                        }
                        if let Some(since) = st.1.remove(&s) {
                            st.2 = st.2.max(n - since);
                        }
                    }
                    std::thread::sleep(Duration::from_micros(200));
                    t.release(me(s), x).unwrap();
                }
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
    let st = state.lock().unwrap();
    assert_eq!(st.0, u64::from(N) * 40);
    assert!(
        st.2 <= 2 * u64::from(N),
        "a waiting slot waited {} grants",
        st.2
    );
}

#[test]
fn object_lock_scrub_dead_slot_after_replay() {
    // Slot 3 drops the dead waiter's request without handing z over.
    struct Never;
    impl Handoff for Never {
        fn flush(&mut self, o: ObjectId, _: LockMode) -> Result<bool> {
            panic!("handed {o:?} over for a dead requester");
        }
        fn handed(&mut self, _: ObjectId, _: LockMode, _: &Result<()>) {}
    }
    let dev = mem(512);
    let t = locks_on(dev.clone(), 2, Duration::from_millis(50));
    let dead = me(2);
    let (x, y, z) = (ino(1), ino(2), ino(3));
    let gx = t.acquire(dead, x, LockMode::Exclusive, &never).unwrap();
    t.acquire(dead, y, LockMode::Shared, &never).unwrap();
    t.acquire(me(1), y, LockMode::Shared, &never).unwrap();
    t.acquire(me(3), z, LockMode::Exclusive, &never).unwrap();
    // The dead slot waits for z (an abort after it registered and asked).
    let calls = AtomicU32::new(0);
    let abort =
        || (calls.fetch_add(1, Ordering::Relaxed) >= 3).then(|| Error::new(ErrorKind::Fenced, "x"));
    assert!(t.acquire(dead, z, LockMode::Shared, &abort).is_err());
    // Its abort left the waiters, but it asked slot 3: a request sits in 3's mailbox.
    assert!(!t.poll_mailbox(me(3)).unwrap().is_empty());
    // A mention of slot 2 at an older generation is not the dead incarnation's.
    let old = Me { slot: 2, gen: 3 };
    t.acquire(old, ino(4), LockMode::Exclusive, &never).unwrap();
    t.mailboxes()
        .post(
            2,
            Request {
                object: x.raw(),
                slot: 1,
                gen: 11,
                want: Want::Exclusive,
            },
        )
        .unwrap();
    let changed = t.scrub_slot(2, Some(dead.gen)).unwrap();
    assert!(changed >= 1);
    let entry = |o: ObjectId| {
        t.read_bucket(t.bucket_of(o))
            .unwrap()
            .1
            .entry(o.raw())
            .unwrap()
            .clone()
    };
    let ex = entry(x);
    assert!(ex.evictable());
    assert_eq!(
        ex.version,
        gx.version + 1,
        "freed dead exclusive hold bumps the version"
    );
    let ey = entry(y);
    assert_eq!(ey.holders().map(|m| m.slot).collect::<Vec<_>>(), vec![1]);
    assert_eq!(
        entry(ino(4)).owner().unwrap().gen,
        3,
        "other generation untouched"
    );
    assert!(
        t.poll_mailbox(dead).unwrap().is_empty(),
        "its mailbox is emptied"
    );
    let s = t.serve_mailbox(me(3), &mut Never).unwrap();
    assert_eq!((s.handed, s.deferred), (0, 0));
    assert!(t.poll_mailbox(me(3)).unwrap().is_empty());
    // Idempotent: nothing more to write.
    let w = dev.writes.load(Ordering::Relaxed);
    assert_eq!(t.scrub_slot(2, Some(dead.gen)).unwrap(), 0);
    assert_eq!(dev.writes.load(Ordering::Relaxed), w);
    // The old generation is stale by the heartbeat: anyone may drop it.
    let lives = || {
        let mut v = vec![SlotLife::Gone; SLOTS as usize];
        v[1] = SlotLife::Live(11);
        v[2] = SlotLife::Live(12);
        v[3] = SlotLife::Live(13);
        Ok(v)
    };
    let lines = t.drop_stale(&lives).unwrap();
    assert_eq!(lines.len(), 1, "{lines:?}");
    let e4 = entry(ino(4));
    assert!(e4.evictable() && e4.version == 3, "{e4:?}");
    assert!(t.drop_stale(&lives).unwrap().is_empty());
    // Scrubbing a slot while a waiter waits hands the lock to that waiter (next).
    let t3 = Arc::new(locks_on(dev.clone(), 2, Duration::from_secs(30)));
    let tw = t3.clone();
    let w = std::thread::spawn(move || tw.acquire(me(4), z, LockMode::Exclusive, &never).unwrap());
    while entry(z).waiters().next().is_none() {
        std::thread::sleep(Duration::from_millis(1));
    }
    t.scrub_slot(3, None).unwrap();
    let ez = entry(z);
    assert!(
        ez.next == 4 || ez.owner().is_some_and(|m| m.slot == 4),
        "{ez:?}"
    );
    let g = w.join().unwrap();
    assert_eq!(g.mode, LockMode::Exclusive);
}

#[test]
fn object_lock_caw_false_miscompares_and_torn_reads() {
    let dev = Arc::new(Faulty::new(4 << 20, 512));
    let t = Arc::new(locks_on(dev.clone(), 2, Duration::from_secs(1)));
    // Every third CAW lands but reports a miscompare or a timeout.
    dev.lie_every.store(3, Ordering::Relaxed);
    let objs: Vec<ObjectId> = (1..=6).map(ino).collect();
    let mut v = HashMap::new();
    for round in 0..5 {
        for (i, &o) in (0u32..).zip(objs.iter()) {
            let s = (round + i) % 3;
            let g = t.acquire(me(s), o, LockMode::Exclusive, &never).unwrap();
            let last = v.insert(o, g.version).unwrap_or(1);
            assert_eq!(g.version, last + 1, "one grant, one version step");
            let (_, b) = t.read_bucket(t.bucket_of(o)).unwrap();
            let e = b.entry(o.raw()).unwrap();
            assert_eq!(e.mentions.len(), 1, "no duplicate or lost mention: {e:?}");
            t.release(me(s), o).unwrap();
        }
    }
    assert!(dev.lies.load(Ordering::Relaxed) > 5);
    dev.lie_every.store(0, Ordering::Relaxed);
    // Torn reads are re-read; a block that stays bad is Corrupted.
    dev.torn.store(3, Ordering::Relaxed);
    let g = t.acquire(me(1), objs[0], LockMode::Shared, &never).unwrap();
    assert_eq!(g.version, v[&objs[0]]);
    dev.torn.store(3, Ordering::Relaxed);
    assert!(t.poll_mailbox(me(1)).unwrap().is_empty());
    dev.torn.store(1000, Ordering::Relaxed);
    assert_eq!(t.read_bucket(0).unwrap_err().kind(), ErrorKind::Corrupted);
    dev.torn.store(0, Ordering::Relaxed);
    // Contended through the lying device: several threads, one object each pair.
    dev.lie_every.store(4, Ordering::Relaxed);
    let counter = Arc::new(Mutex::new((0u32, 0u64)));
    let hs: Vec<_> = (0..3)
        .map(|s| {
            let (t, c, o) = (t.clone(), counter.clone(), objs[5]);
            std::thread::spawn(move || {
                for _ in 0..30 {
                    t.acquire(me(s), o, LockMode::Exclusive, &never).unwrap();
                    {
                        let mut c = c.lock().unwrap();
                        assert_eq!(c.0, 0, "two exclusive holders");
                        c.0 = 1;
                    }
                    std::thread::yield_now();
                    {
                        let mut c = c.lock().unwrap();
                        c.0 = 0;
                        c.1 += 1;
                    }
                    t.release(me(s), o).unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(counter.lock().unwrap().1, 90);
}

#[test]
fn object_lock_false_sharing_cost() {
    // 4 nodes, private objects (no logical conflict): miscompares come from sharing a bucket.
    let run = |buckets: u64| {
        let dev: SharedDevice = mem(4096);
        let hs: Vec<_> = (0..4u32)
            .map(|s| {
                let dev = dev.clone();
                std::thread::spawn(move || {
                    let t = locks_on(dev, buckets, Duration::from_secs(1));
                    for i in 0..150u64 {
                        let o = ino(1 + u64::from(s) * 1000 + i % 8);
                        t.acquire(me(s), o, LockMode::Exclusive, &never).unwrap();
                        t.release(me(s), o).unwrap();
                    }
                    (
                        t.stats.caws.load(Ordering::Relaxed),
                        t.stats.miscompares.load(Ordering::Relaxed),
                    )
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    };
    let (c1, m1) = run(1);
    let (c64, m64) = run(64);
    eprintln!("false sharing: 1 bucket {m1}/{c1} CAWs miscompared, 64 buckets {m64}/{c64}");
    // Each thread's objects are private: every acquire and release wins eventually.
    assert!(c1 >= 4 * 300 && c64 >= 4 * 300);
    assert!(
        c1 - m1 == 4 * 300 && c64 - m64 == 4 * 300,
        "exactly one winning CAW per change"
    );
}
