//! Fencing by SCSI-3 persistent reservations (`fence=pr`; docs/locking.md §11): the target
//! itself refuses the writes of a node the survivors have given up on.
//!
//! * **Join.** Before its first write (the mount's COMPARE AND WRITE probe) a node registers a
//!   *joining* key ([`pr::joining_key`]) on every path of the LUN with REGISTER AND IGNORE
//!   EXISTING KEY; once it has claimed its heartbeat slot it registers its slot key
//!   ([`pr::pr_key`]: volume uuid prefix, slot, slot generation) the same way. A remount gets
//!   the next generation and so a new key.
//! * **Reserve.** The LUN is reserved *Write Exclusive – Registrants Only* (type 5): every
//!   registered path reads and writes, any other only reads. A node reserves it when nobody
//!   holds a reservation and every live slot's key is registered (a node mounted with
//!   `fence=none` would otherwise lose its writes); it checks again every
//!   [`RECHECK_EVERY`], because a type-5 reservation ends when its holder unregisters.
//! * **Preempt.** The survivor that claimed a dead slot issues PREEMPT AND ABORT of every key
//!   of that slot (any generation) before it replays the slot's journal: the target aborts
//!   what the dead node still has queued and refuses whatever it sends later. A target where
//!   PREEMPT AND ABORT is unusable (LIO over `tcm_loop` deadlocks on it, tests/lio/README.md)
//!   can be told `pr_preempt=plain`: PREEMPT refuses the future commands but does not abort
//!   queued ones.
//! * **Conflict.** A write of this node that comes back RESERVATION CONFLICT means it was
//!   preempted: `LeaseGuard` fences the node at once (`membership.rs`).
//! * **Leave.** A clean unmount unregisters the key on every path after the slot is free.
//!
//! The commands go through [`PrPath`], which [`SgDevice`] implements; unit tests use a model.

use crate::cluster::watchdog::{WatchdogSpec, MUX_SOCKET};
use crate::dev::multipath::Protection;
use crate::dev::sg::SgDevice;
use crate::error::{Error, ErrorKind, Result};
use crate::scsi::pr::{self, PrType};
use crate::sync::LockPolicy;
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The reservation type CetraFS uses.
pub const TYPE: PrType = PrType::WriteExclusiveRegistrantsOnly;

/// How often a mounted node checks that the LUN is still reserved.
pub const RECHECK_EVERY: Duration = Duration::from_secs(10);

/// `fence=`: how a node that lost its lease is stopped from writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FenceMode {
    /// Persistent reservations where the LUN supports Write Exclusive – Registrants Only,
    /// software fencing (and the watchdog `watchdog=` asks for) otherwise.
    #[default]
    Auto,
    /// Persistent reservations, required: the mount fails without them.
    Pr,
    /// No reservations; the host watchdog (`watchdog=`) is the fence.
    Watchdog,
    /// Software fencing only (`LeaseGuard`), no reservation, no watchdog.
    None,
}

impl FenceMode {
    /// Parse the value of `fence=`.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "pr" => Ok(Self::Pr),
            "watchdog" => Ok(Self::Watchdog),
            "none" => Ok(Self::None),
            other => Err(format!(
                "fence={other:?}: takes auto, pr (SCSI-3 persistent reservations), watchdog or none"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Pr => "pr",
            Self::Watchdog => "watchdog",
            Self::None => "none",
        }
    }
}

/// `pr_preempt=`: what the recovering node sends to remove a dead node's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preempt {
    /// PREEMPT AND ABORT: also aborts the commands the dead node still has queued.
    #[default]
    Abort,
    /// PREEMPT: refuses the dead node's future commands only (for targets where PREEMPT AND
    /// ABORT hangs).
    Plain,
}

impl Preempt {
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s {
            "abort" => Ok(Self::Abort),
            "plain" => Ok(Self::Plain),
            other => Err(format!(
                "pr_preempt={other:?}: takes abort (PREEMPT AND ABORT, the default) or plain (PREEMPT)"
            )),
        }
    }

    pub fn command(self) -> &'static str {
        match self {
            Self::Abort => "PREEMPT AND ABORT",
            Self::Plain => "PREEMPT",
        }
    }
}

/// One path (I_T nexus) of the LUN, as far as reservations go.
pub trait PrPath: Send + Sync + fmt::Debug {
    /// The path's name, for messages.
    fn label(&self) -> String;
    fn capabilities(&self) -> Result<pr::Capabilities>;
    fn read_keys(&self) -> Result<pr::Keys>;
    fn read_reservation(&self) -> Result<pr::Reservation>;
    /// REGISTER AND IGNORE EXISTING KEY `key` (0 unregisters).
    fn register_and_ignore(&self, key: u64) -> Result<()>;
    /// RESERVE with [`TYPE`], registered as `key`.
    fn reserve(&self, key: u64) -> Result<()>;
    /// PREEMPT (AND ABORT) `victim`, registered as `key`.
    fn preempt(&self, key: u64, victim: u64, how: Preempt) -> Result<()>;
}

impl PrPath for SgDevice {
    fn label(&self) -> String {
        self.path().display().to_string()
    }
    fn capabilities(&self) -> Result<pr::Capabilities> {
        self.pr_capabilities()
    }
    fn read_keys(&self) -> Result<pr::Keys> {
        self.pr_read_keys()
    }
    fn read_reservation(&self) -> Result<pr::Reservation> {
        self.pr_read_reservation()
    }
    fn register_and_ignore(&self, key: u64) -> Result<()> {
        self.pr_register_and_ignore(key, false)
    }
    fn reserve(&self, key: u64) -> Result<()> {
        self.pr_reserve(key, TYPE)
    }
    fn preempt(&self, key: u64, victim: u64, how: Preempt) -> Result<()> {
        match how {
            Preempt::Abort => self.pr_preempt_and_abort(key, victim, TYPE),
            Preempt::Plain => self.pr_preempt(key, victim, TYPE),
        }
    }
}

/// This node's persistent reservation state on one LUN (all of its paths).
pub struct Reservations {
    paths: Vec<Arc<dyn PrPath>>,
    prefix: u32,
    /// The key registered on every path; 0 before [`Self::register_joining`].
    key: AtomicU64,
    preempt: Preempt,
    /// When the reservation was last checked, and whether a missing registration was already
    /// reported (so a mixed cluster warns once per recheck period, not per heartbeat).
    checked: Mutex<Option<Instant>>,
}

impl fmt::Debug for Reservations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservations")
            .field("paths", &self.paths.len())
            .field("key", &format_args!("{:#018x}", self.key()))
            .field("preempt", &self.preempt)
            .finish_non_exhaustive()
    }
}

impl Reservations {
    /// Reservations on `paths` (every path of the LUN, at least one) for the volume `uuid`.
    /// Checks with REPORT CAPABILITIES that the LUN supports [`TYPE`]: `Unsupported` if it
    /// says it does not or has no persistent reservations at all.
    pub fn probe(paths: Vec<Arc<dyn PrPath>>, uuid: &[u8; 16], preempt: Preempt) -> Result<Self> {
        let Some(first) = paths.first() else {
            crate::bail!(
                InvalidInput,
                "persistent reservations need at least one path"
            );
        };
        // REPORT CAPABILITIES is optional in SPC-4: a target that refuses it as an invalid
        // field (ILLEGAL REQUEST, 0x24) may still have persistent reservations; the join
        // finds out.
        let caps = match first.capabilities() {
            Ok(c) => Some(c),
            Err(e) if e.kind() == ErrorKind::InvalidInput => {
                tracing::info!(
                    "{}: REPORT CAPABILITIES refused ({e}); assuming {TYPE} works",
                    first.label()
                );
                None
            }
            Err(e) => return Err(e),
        };
        match caps.as_ref().and_then(|c| c.supports(TYPE)) {
            Some(false) => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "{}: the LUN's persistent reservations do not include {TYPE} (it reports {:?})",
                        first.label(),
                        caps.iter()
                            .flat_map(pr::Capabilities::types)
                            .map(PrType::name)
                            .collect::<Vec<_>>()
                    ),
                ))
            }
            Some(true) => {}
            None => tracing::info!(
                "{}: REPORT CAPABILITIES does not list the reservation types; assuming {TYPE} works",
                first.label()
            ),
        }
        Ok(Self {
            paths,
            prefix: pr::volume_key_prefix(uuid),
            key: AtomicU64::new(0),
            preempt,
            checked: Mutex::new(None),
        })
    }

    /// The key registered on every path (0: none).
    pub fn key(&self) -> u64 {
        self.key.load(Ordering::Acquire)
    }

    pub fn path_count(&self) -> usize {
        self.paths.len()
    }

    pub fn preempt_mode(&self) -> Preempt {
        self.preempt
    }

    /// Run `f` (a command any one path may carry: READ KEYS, READ RESERVATION, RESERVE,
    /// PREEMPT) on the first path whose transport carries it. An I/O error (the path's
    /// session is down: ENODEV, a transport host byte, a timeout) moves on to the next path,
    /// as dm-multipath does for reads and writes, which it does not do for `SG_IO`; any answer
    /// of the target (GOOD, RESERVATION CONFLICT, a sense key) is the LUN's and is returned.
    /// All paths failing returns the last error. Found on a real multipath map
    /// (tests/lio/san): with the first path's portal down, every reservation check and a
    /// recovery's PREEMPT failed although the other path was live.
    fn on_some_path<T>(&self, f: impl Fn(&dyn PrPath) -> Result<T>) -> Result<(T, &dyn PrPath)> {
        let mut last = None;
        for p in &self.paths {
            match f(p.as_ref()) {
                Ok(v) => return Ok((v, p.as_ref())),
                Err(e) if e.kind() == ErrorKind::Io && !crate::scsi::reservation_conflict(&e) => {
                    if self.paths.len() > 1 {
                        tracing::warn!(
                            "fence=pr: {} failed ({e}); trying the next path",
                            p.label()
                        );
                    }
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::new(ErrorKind::InvalidInput, "no path")))
    }

    fn register_everywhere(&self, key: u64) -> Result<()> {
        // Stored first: a registration that fails half-way is undone by `leave` all the same.
        self.key.store(key, Ordering::Release);
        for p in &self.paths {
            p.register_and_ignore(key).map_err(|e| {
                e.wrap(format!(
                    "registering reservation key {key:#018x} on {}",
                    p.label()
                ))
            })?;
        }
        Ok(())
    }

    /// Step 0 of a mount: register a joining key on every path, so that the probe and the
    /// slot claim may write to a LUN the others have reserved.
    pub fn register_joining(&self) -> Result<()> {
        self.register_everywhere(pr::joining_key(self.prefix, rand::random()))
    }

    /// After the claim: register this node's slot key on every path, then reserve the LUN
    /// if nobody does (see [`Self::ensure_reserved`]).
    pub fn join(&self, slot: u32, generation: u64, live: &[(u32, u64)]) -> Result<()> {
        let key = pr::pr_key(self.prefix, slot, generation);
        self.register_everywhere(key)?;
        tracing::info!(
            "fence=pr: registered reservation key {key:#018x} (node slot {slot}, generation {generation}) on {} path(s): {}",
            self.paths.len(),
            self.paths.iter().map(|p| p.label()).collect::<Vec<_>>().join(", ")
        );
        *self.checked.lock().or_panic() = None;
        if let Err(e) = self.ensure_reserved(live) {
            tracing::warn!("fence=pr: checking the LUN's reservation failed: {e}; checked again within {RECHECK_EVERY:?}");
        }
        Ok(())
    }

    /// Make sure the LUN is reserved [`TYPE`]. A reservation of that type held by anyone is
    /// fine (every registrant may write). With none, this node reserves it, but only when
    /// every live slot in `live` (slot, generation; this node's included or not) has its key
    /// registered: reserving would otherwise cut off a node mounted without `fence=pr`.
    /// Another type is left alone with a warning (someone else reserved the LUN).
    pub fn ensure_reserved(&self, live: &[(u32, u64)]) -> Result<()> {
        *self.checked.lock().or_panic() = Some(Instant::now());
        let (r, _) = self.on_some_path(|p| p.read_reservation())?;
        if let Some(h) = &r.holder {
            if h.pr_type() != Some(TYPE) {
                tracing::warn!(
                    "fence=pr: the LUN is reserved by key {:#018x} with type {} (not {TYPE}): persistent reservation fencing is not in force",
                    h.key,
                    h.type_code
                );
            }
            return Ok(());
        }
        let (keys, _) = self.on_some_path(|p| p.read_keys())?;
        let missing: Vec<u32> = live
            .iter()
            .filter(|(s, g)| !keys.keys.contains(&pr::pr_key(self.prefix, *s, *g)))
            .map(|(s, _)| *s)
            .collect();
        if !missing.is_empty() {
            tracing::warn!(
                "fence=pr: not reserving the LUN: live node slot(s) {missing:?} have no reservation key registered (mounted with fence=none or fence=watchdog?), and a reservation would refuse their writes; fencing stays in software until they remount with fence=pr or auto"
            );
            return Ok(());
        }
        let key = self.key();
        match self.on_some_path(|p| p.reserve(key)) {
            Ok(((), _)) => {
                tracing::info!(
                    "fence=pr: reserved the LUN {TYPE} with key {key:#018x}: only registered nodes can write"
                );
                Ok(())
            }
            // Another node reserved it between our read and our RESERVE.
            Err(e) if crate::scsi::reservation_conflict(&e) => {
                match self.on_some_path(|p| p.read_reservation())?.0.holder {
                    Some(_) => Ok(()),
                    None => Err(e.wrap("reserving the LUN")),
                }
            }
            Err(e) => Err(e.wrap("reserving the LUN")),
        }
    }

    /// [`Self::ensure_reserved`] if the last check is older than [`RECHECK_EVERY`]; `live`
    /// is asked only then.
    pub fn recheck(&self, live: impl FnOnce() -> Vec<(u32, u64)>) -> Result<()> {
        let due = self
            .checked
            .lock()
            .or_panic()
            .is_none_or(|t| t.elapsed() >= RECHECK_EVERY);
        if due {
            self.ensure_reserved(&live())
        } else {
            Ok(())
        }
    }

    /// Recovery, before the dead slot's journal is replayed: remove every key of `slot` (any
    /// generation, never our own) with PREEMPT AND ABORT (or PREEMPT, `pr_preempt=plain`).
    /// Returns the keys preempted. A key that vanished meanwhile (another survivor preempted
    /// it, or the node unregistered) is not an error. PREEMPT removes registrations; only a
    /// reservation makes the target refuse an unregistered initiator's writes, so the caller
    /// makes sure of it first ([`Self::ensure_reserved`], which [`Self::join`] runs), and a
    /// preempt that leaves the LUN unreserved says that the node is not fenced.
    ///
    /// `still_mine` is asked right before each PREEMPT: the commands bypass `LeaseGuard`, so a
    /// recoverer paused after its claim must look again (through the guarded device) that the
    /// claim is still its own; a later incarnation of the slot may hold a key by then.
    pub fn preempt_slot(
        &self,
        slot: u32,
        still_mine: &dyn Fn() -> Result<bool>,
    ) -> Result<Vec<u64>> {
        let me = self.key();
        let mut victims: Vec<u64> = self
            .on_some_path(|p| p.read_keys())?
            .0
            .keys
            .into_iter()
            .filter(|k| *k != me && pr::key_slot(*k, self.prefix) == Some(Some(slot)))
            .collect();
        victims.sort_unstable();
        victims.dedup();
        let mut done = Vec::new();
        for v in victims {
            crate::failpoint::process("fence::before_preempt");
            if !still_mine()? {
                crate::bail!(
                    Busy,
                    "not preempting reservation key {v:#018x}: node slot {slot} is no longer this node's to fence (another node took its recovery over)"
                );
            }
            match self.on_some_path(|p| p.preempt(me, v, self.preempt)) {
                Ok(((), path)) => {
                    tracing::warn!(
                        "fence=pr: {} of reservation key {v:#018x} (node slot {slot}) through {}: the target refuses its writes from now on{}",
                        self.preempt.command(),
                        path.label(),
                        if self.preempt == Preempt::Abort {
                            " and has aborted those it still had queued"
                        } else {
                            " (queued ones are not aborted: pr_preempt=plain)"
                        }
                    );
                    done.push(v);
                }
                // Refused because the key is gone already (another survivor was first): done.
                Err(e)
                    if crate::scsi::reservation_conflict(&e)
                        && !self.on_some_path(|p| p.read_keys())?.0.keys.contains(&v) => {}
                Err(e) => {
                    return Err(e.wrap(format!(
                        "{} of reservation key {v:#018x} (node slot {slot})",
                        self.preempt.command()
                    )))
                }
            }
        }
        if !done.is_empty()
            && !self
                .on_some_path(|p| p.read_reservation())
                .is_ok_and(|(r, _)| r.holder.is_some_and(|h| h.pr_type() == Some(TYPE)))
        {
            tracing::warn!(
                "fence=pr: node slot {slot}'s key is removed but the LUN is not reserved {TYPE} (a live node without a key, or the check failed): the target does not refuse its writes; fencing stays in software"
            );
        }
        Ok(done)
    }

    /// Clean unmount (after the slot is free) or a failed mount: unregister on every path.
    /// Failures are logged: the key of a node that is gone is harmless, and the next mount of
    /// this host replaces it.
    pub fn leave(&self) {
        let key = self.key.swap(0, Ordering::AcqRel);
        if key == 0 {
            return;
        }
        for p in &self.paths {
            if let Err(e) = p.register_and_ignore(0) {
                tracing::warn!(
                    "fence=pr: unregistering key {key:#018x} on {} failed: {e}",
                    p.label()
                );
            }
        }
        tracing::info!("fence=pr: reservation key {key:#018x} unregistered");
    }
}

/// Another CetraFS mount daemon on this host with one of `devs` open: its pid and that device.
/// Daemons are told by their executable's name (`mount.cetra`, or `mount-cetra` as built; their
/// `comm` is `exe` once they re-executed themselves), devices by device number, so
/// `/dev/sdb` and a `by-id` link match. Runs before any PERSISTENT RESERVE OUT of a mount.
pub fn other_daemon_on(devs: &[std::path::PathBuf]) -> Option<(i32, std::path::PathBuf)> {
    let wanted: Vec<(u64, std::path::PathBuf)> = devs
        .iter()
        .filter_map(|d| cached_rdev(d).map(|r| (r, d.clone())))
        .collect();
    let parent = i32::try_from(std::os::unix::process::parent_id()).unwrap_or(-1);
    // Every process is looked at through `cluster/procs.rs` (a process stuck in exec blocks
    // reads of its `exe` and `fd/`); its descriptors are stat'ed from cached attributes only,
    // so a file on a FUSE or NFS mount that does not answer is never asked.
    let scan = crate::cluster::procs::scan(
        move |pid, dir| {
            let exe = std::fs::read_link(dir.join("exe")).unwrap_or_default();
            let name = exe.file_name().map(|n| n.to_string_lossy().into_owned());
            let name = name.as_deref().unwrap_or("");
            let name = name.strip_suffix(" (deleted)").unwrap_or(name);
            if pid == parent || !matches!(name, "mount.cetra" | "mount-cetra") {
                return None;
            }
            std::fs::read_dir(dir.join("fd"))
                .ok()?
                .flatten()
                .find_map(|fd| {
                    let r = cached_rdev(&fd.path())?;
                    wanted.iter().find(|(w, _)| *w == r).map(|(_, d)| d.clone())
                })
        },
        crate::cluster::procs::PER_PROCESS,
        std::time::Instant::now() + std::time::Duration::from_secs(30),
    );
    if !scan.unreadable.is_empty() {
        tracing::warn!(
            "{} process(es) could not be looked at in time (stuck in the kernel?) while \
             looking for another daemon on {devs:?}: {:?}",
            scan.unreadable.len(),
            scan.unreadable
        );
    }
    scan.found.into_iter().next()
}

/// The device number of the block device `p`: a device path, or a `/proc/<pid>/fd/N` link
/// (the open file itself, a deleted node or one in another mount namespace included). From
/// the attributes the kernel has cached (`AT_STATX_DONT_SYNC`: a FUSE or NFS file is not
/// asked). None if it is not a block device.
fn cached_rdev(p: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: a NUL-terminated path and a pointer to a statx buffer the kernel fills.
    let r = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_STATX_DONT_SYNC,
            libc::STATX_TYPE,
            st.as_mut_ptr(),
        )
    };
    if r != 0 {
        return None;
    }
    // SAFETY: statx returned 0: the buffer is filled (and was zeroed before).
    let st = unsafe { st.assume_init() };
    (u32::from(st.stx_mode) & libc::S_IFMT == libc::S_IFBLK)
        .then(|| libc::makedev(st.stx_rdev_major, st.stx_rdev_minor))
}

/// (slot, generation) of every live slot in `views`: whose keys a reservation must not cut off.
pub fn live_slots(views: &[crate::cluster::SlotView]) -> Vec<(u32, u64)> {
    views
        .iter()
        .filter_map(|v| {
            v.record
                .as_ref()
                .filter(|h| h.state == crate::format::heartbeat::SlotState::Live)
                .map(|h| (v.slot, h.generation))
        })
        .collect()
}

/// How a mount is fenced, decided by [`Fencing::decide`] before its first write.
#[derive(Debug)]
pub struct Fencing {
    /// The reservations joined (joining key registered on every path), or None.
    pub reservations: Option<Arc<Reservations>>,
    /// The watchdog to open (`fence=none`: none, whatever `watchdog=` says).
    pub watchdog: WatchdogSpec,
    mode: FenceMode,
}

impl Fencing {
    /// `fence=mode` on `lun` (volume `uuid`): [`choose`] the reservations and register the
    /// joining key, settle the watchdog, then run the multipath guard
    /// ([`crate::dev::multipath`]) against what protects this node. On an error nothing stays
    /// registered.
    pub fn decide(
        mode: FenceMode,
        lun: &crate::dev::open::Lun,
        uuid: &[u8; 16],
        preempt: Preempt,
        watchdog: &WatchdogSpec,
    ) -> Result<Self> {
        let reservations = choose(mode, lun, uuid, preempt)?;
        if let Some(r) = &reservations {
            let mut devs = vec![lun.path().to_path_buf()];
            devs.extend(r.paths.iter().map(|p| std::path::PathBuf::from(p.label())));
            if let Some((pid, dev)) = other_daemon_on(&devs) {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "{}: process {pid}, another CetraFS mount daemon, already uses {} on this host; with persistent reservations (fence={}) the target keeps one key per initiator port, so two mounts through one path would overwrite, and at unmount remove, each other's registration: mount a volume once per host",
                        lun.path().display(),
                        dev.display(),
                        mode.name()
                    ),
                ));
            }
        }
        let watchdog = if mode == FenceMode::None {
            WatchdogSpec::Off
        } else {
            watchdog.for_volume(lun.kind.is_scsi())
        };
        let f = Self {
            reservations,
            watchdog,
            mode,
        };
        if let crate::dev::open::LunKind::Scsi {
            node: crate::dev::sg::WholeLun::Multipath { dm_name, .. },
            ..
        } = &lun.kind
        {
            crate::dev::multipath::guard(dm_name, f.protection())?;
        }
        if let Some(r) = &f.reservations {
            r.register_joining()?;
        }
        Ok(f)
    }

    /// What stops this node's writes once it lost its lease.
    pub fn protection(&self) -> Protection {
        if self.reservations.is_some() {
            return Protection::Reservations;
        }
        match &self.watchdog {
            WatchdogSpec::Path(_) => Protection::Watchdog,
            WatchdogSpec::Auto if Path::new(MUX_SOCKET).exists() => Protection::Watchdog,
            WatchdogSpec::Off | WatchdogSpec::Auto => Protection::Software,
        }
    }

    /// One line for the mount's log.
    pub fn describe(&self) -> String {
        match (&self.reservations, self.protection()) {
            (Some(r), _) => format!(
                "fence=pr: SCSI-3 persistent reservations ({TYPE}) on {} path(s), a dead node's key removed by {}",
                r.path_count(),
                r.preempt_mode().command()
            ),
            (None, Protection::Watchdog) => format!(
                "fence={}: no persistent reservations; software fencing and the host watchdog",
                self.mode.name()
            ),
            (None, _) if self.mode == FenceMode::None => {
                "fence=none: software fencing only (a lease check before every write)".into()
            }
            (None, _) => format!(
                "fence={}: no persistent reservations and no watchdog: software fencing only (a lease check before every write)",
                self.mode.name()
            ),
        }
    }

    /// A mount that fails after [`Self::decide`]: unregister.
    pub fn abandon(&self) {
        if let Some(r) = &self.reservations {
            r.leave();
        }
    }
}

/// Decide the fencing of a mount on `lun` (volume `uuid`) for `fence=mode`: the
/// reservations to join, or None for software fencing (plus the watchdog `watchdog=` asks
/// for). `pr` fails unless the LUN has persistent reservations with [`TYPE`]; `auto` uses them
/// when it does. `none` and `watchdog` refuse a LUN that CetraFS nodes have reserved: this
/// node's writes would be refused.
pub fn choose(
    mode: FenceMode,
    lun: &crate::dev::open::Lun,
    uuid: &[u8; 16],
    preempt: Preempt,
) -> Result<Option<Arc<Reservations>>> {
    let shown = lun.path().display();
    match mode {
        FenceMode::None | FenceMode::Watchdog => {
            let holder = lun
                .scsi()
                .and_then(|sg| sg.pr_read_reservation().ok())
                .and_then(|r| r.holder);
            if let Some(h) = holder.filter(|h| {
                h.pr_type() == Some(TYPE)
                    && pr::key_slot(h.key, pr::volume_key_prefix(uuid)).is_some()
            }) {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "{shown}: fence={}: the LUN is reserved ({TYPE}, key {:#018x}) by nodes of this volume mounted with fence=pr, so the target would refuse every write of this node; mount with fence=pr or fence=auto",
                        mode.name(),
                        h.key
                    ),
                ));
            }
            Ok(None)
        }
        FenceMode::Pr => {
            let r = lun_paths(lun)
                .and_then(|paths| Reservations::probe(paths, uuid, preempt))
                .map_err(|e| {
                    e.wrap(format!(
                        "{shown}: fence=pr needs SCSI-3 persistent reservations ({TYPE}); use fence=auto or fence=watchdog on a LUN without them"
                    ))
                })?;
            Ok(Some(Arc::new(r)))
        }
        FenceMode::Auto => {
            if !lun.kind.is_scsi() {
                return Ok(None);
            }
            match lun_paths(lun).and_then(|paths| Reservations::probe(paths, uuid, preempt)) {
                Ok(r) => Ok(Some(Arc::new(r))),
                Err(e) if e.kind() == ErrorKind::Unsupported => {
                    tracing::warn!(
                        "{shown}: fence=auto: no usable SCSI-3 persistent reservations ({e}); fencing in software and by the watchdog only"
                    );
                    Ok(None)
                }
                Err(e) => Err(e.wrap("fence=auto: probing persistent reservations")),
            }
        }
    }
}

/// The `/dev/…` nodes whose I_T nexuses must each register: the LUN itself, or every path of a
/// dm-multipath map.
pub fn lun_paths(lun: &crate::dev::open::Lun) -> Result<Vec<Arc<dyn PrPath>>> {
    use crate::dev::sg::{SgDeviceOptions, WholeLun};
    let Some(sg) = lun.scsi_arc().map(|s| s as Arc<dyn PrPath>) else {
        crate::bail!(
            Unsupported,
            "{} is not a SCSI LUN: persistent reservations need one",
            lun.path().display()
        );
    };
    let crate::dev::open::LunKind::Scsi { node, .. } = &lun.kind else {
        return Ok(vec![sg]);
    };
    let WholeLun::Multipath { paths, .. } = node else {
        return Ok(vec![sg]);
    };
    let mut out: Vec<Arc<dyn PrPath>> = Vec::new();
    for p in paths {
        let dev = std::path::PathBuf::from(format!("/dev/{p}"));
        let opened = SgDevice::open(&dev, &SgDeviceOptions::default()).map_err(|e| {
            e.wrap(format!(
                "opening path {} of the multipath map",
                dev.display()
            ))
        })?;
        out.push(Arc::new(opened));
    }
    if out.is_empty() {
        out.push(sg);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A LUN's reservation state as SPC-4 describes it, shared by the paths (nexuses) of a test.
    #[derive(Debug, Default)]
    struct Target {
        /// nexus -> key
        regs: BTreeMap<usize, u64>,
        holder: Option<(usize, u64)>,
        preempts: Vec<(u64, Preempt)>,
        /// Nexuses whose transport is down (their session failed): every command fails
        /// with `ENODEV`, as `SG_IO` on a path of a failed iSCSI session does.
        down: std::collections::BTreeSet<usize>,
    }

    #[derive(Debug)]
    struct Nexus {
        id: usize,
        t: Arc<Mutex<Target>>,
    }

    fn conflict() -> Error {
        // What SgDevice reports: the predicate must accept it.
        Error::io("test", std::io::Error::from_raw_os_error(libc::EBADE))
    }

    impl Nexus {
        fn up(&self) -> Result<()> {
            if self.t.lock().unwrap().down.contains(&self.id) {
                return Err(Error::io(
                    "SG_IO ioctl failed",
                    std::io::Error::from_raw_os_error(libc::ENODEV),
                ));
            }
            Ok(())
        }
    }

    impl PrPath for Nexus {
        fn label(&self) -> String {
            format!("nexus{}", self.id)
        }
        fn capabilities(&self) -> Result<pr::Capabilities> {
            let mut d = [0u8; 8];
            d[1] = 8;
            d[3] = 0x80; // TMV
            d[4] = 0x20; // WR_EX_RO
            Ok(pr::Capabilities::parse(&d).unwrap())
        }
        fn read_keys(&self) -> Result<pr::Keys> {
            self.up()?;
            Ok(pr::Keys {
                generation: 0,
                keys: self.t.lock().unwrap().regs.values().copied().collect(),
                truncated: false,
            })
        }
        fn read_reservation(&self) -> Result<pr::Reservation> {
            self.up()?;
            let t = self.t.lock().unwrap();
            Ok(pr::Reservation {
                generation: 0,
                holder: t.holder.map(|(_, key)| pr::Holder {
                    key,
                    type_code: TYPE.code(),
                    scope: 0,
                }),
            })
        }
        fn register_and_ignore(&self, key: u64) -> Result<()> {
            self.up()?;
            let mut t = self.t.lock().unwrap();
            if key == 0 {
                t.regs.remove(&self.id);
                if t.holder.is_some_and(|(n, _)| n == self.id) {
                    t.holder = None;
                }
            } else {
                t.regs.insert(self.id, key);
                if let Some(h) = t.holder.as_mut().filter(|(n, _)| *n == self.id) {
                    h.1 = key;
                }
            }
            Ok(())
        }
        fn reserve(&self, key: u64) -> Result<()> {
            self.up()?;
            let mut t = self.t.lock().unwrap();
            if t.regs.get(&self.id) != Some(&key) || t.holder.is_some_and(|(n, _)| n != self.id) {
                return Err(conflict());
            }
            t.holder = Some((self.id, key));
            Ok(())
        }
        fn preempt(&self, key: u64, victim: u64, how: Preempt) -> Result<()> {
            self.up()?;
            let mut t = self.t.lock().unwrap();
            if t.regs.get(&self.id) != Some(&key) || !t.regs.values().any(|k| *k == victim) {
                return Err(conflict());
            }
            t.regs.retain(|_, k| *k != victim);
            if t.holder.is_some_and(|(_, k)| k == victim) {
                t.holder = Some((self.id, key));
            }
            t.preempts.push((victim, how));
            Ok(())
        }
    }

    const UUID: [u8; 16] = [0xab, 0xcd, 0xef, 0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

    fn node(t: &Arc<Mutex<Target>>, nexuses: &[usize]) -> Reservations {
        let paths: Vec<Arc<dyn PrPath>> = nexuses
            .iter()
            .map(|&id| Arc::new(Nexus { id, t: t.clone() }) as Arc<dyn PrPath>)
            .collect();
        Reservations::probe(paths, &UUID, Preempt::Abort).unwrap()
    }

    /// A node on `nexuses` that joined as (`slot`, `generation`) with `live` slots.
    fn joined(
        t: &Arc<Mutex<Target>>,
        nexuses: &[usize],
        slot: u32,
        generation: u64,
        live: &[(u32, u64)],
    ) -> Reservations {
        let n = node(t, nexuses);
        n.register_joining().unwrap();
        n.join(slot, generation, live).unwrap();
        n
    }

    #[test]
    fn nodes_register_on_every_path_and_the_first_reserves() {
        let t = Arc::new(Mutex::new(Target::default()));
        let a = joined(&t, &[0, 1], 0, 5, &[(0, 5)]);
        let _b = joined(&t, &[2], 1, 2, &[(0, 5), (1, 2)]);
        let t = t.lock().unwrap();
        assert_eq!(t.regs.len(), 3, "{t:?}");
        assert_eq!(t.regs[&0], a.key());
        assert_eq!(t.regs[&1], a.key());
        assert_eq!(
            t.holder,
            Some((0, a.key())),
            "a reserved, b found it reserved"
        );
    }

    #[test]
    fn a_dead_first_path_does_not_stop_the_checks_or_a_recovery() {
        let t = Arc::new(Mutex::new(Target::default()));
        let a = joined(&t, &[0, 1], 0, 1, &[(0, 1)]);
        let b = joined(&t, &[2, 3], 1, 4, &[(0, 1), (1, 4)]);
        // a's first path (and b's) loses its session: a portal went down
        t.lock().unwrap().down.extend([0, 2]);
        a.ensure_reserved(&[(0, 1), (1, 4)]).unwrap();
        assert_eq!(a.preempt_slot(1, &|| Ok(true)).unwrap(), vec![b.key()]);
        let tt = t.lock().unwrap();
        assert!(!tt.regs.values().any(|k| *k == b.key()), "{tt:?}");
        drop(tt);
        // every path down: the error is the path's, not a conflict
        t.lock().unwrap().down.insert(1);
        let e = a.ensure_reserved(&[(0, 1)]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{e}");
        assert!(!crate::scsi::reservation_conflict(&e));
    }

    #[test]
    fn a_live_node_without_a_key_keeps_the_lun_unreserved() {
        let t = Arc::new(Mutex::new(Target::default()));
        let a = node(&t, &[0]);
        a.register_joining().unwrap();
        // slot 1 is live but never registered (fence=none).
        a.join(0, 1, &[(0, 1), (1, 9)]).unwrap();
        assert_eq!(t.lock().unwrap().holder, None);
    }

    #[test]
    fn recovery_preempts_every_key_of_the_dead_slot_and_only_those() {
        let t = Arc::new(Mutex::new(Target::default()));
        let a = joined(&t, &[0], 0, 1, &[(0, 1)]);
        let b = joined(&t, &[1, 2], 1, 4, &[(0, 1), (1, 4)]);
        let c = node(&t, &[3]);
        c.register_joining().unwrap(); // still joining: never preempted by a slot recovery
        let done = a.preempt_slot(1, &|| Ok(true)).unwrap();
        assert_eq!(done, vec![b.key()]);
        let tt = t.lock().unwrap();
        assert!(!tt.regs.values().any(|k| *k == b.key()), "{tt:?}");
        assert!(tt.regs.values().any(|k| *k == c.key()));
        assert_eq!(tt.preempts, vec![(b.key(), Preempt::Abort)]);
        drop(tt);
        assert!(
            a.preempt_slot(1, &|| Ok(true)).unwrap().is_empty(),
            "idempotent"
        );
        assert!(
            a.preempt_slot(0, &|| Ok(true)).unwrap().is_empty(),
            "never our own key"
        );
    }

    #[test]
    fn a_recoverer_whose_claim_is_gone_preempts_nothing() {
        let t = Arc::new(Mutex::new(Target::default()));
        let a = joined(&t, &[0], 0, 1, &[(0, 1)]);
        let b = joined(&t, &[1], 1, 3, &[(0, 1), (1, 3)]);
        let e = a.preempt_slot(1, &|| Ok(false)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
        let tt = t.lock().unwrap();
        assert!(tt.regs.values().any(|k| *k == b.key()), "{tt:?}");
        assert!(tt.preempts.is_empty());
    }

    #[test]
    fn the_holder_leaving_releases_and_the_next_check_reserves_again() {
        let t = Arc::new(Mutex::new(Target::default()));
        let a = joined(&t, &[0], 0, 1, &[(0, 1)]);
        let b = joined(&t, &[1], 1, 1, &[(0, 1), (1, 1)]);
        a.leave();
        assert_eq!(t.lock().unwrap().holder, None);
        b.ensure_reserved(&[(1, 1)]).unwrap();
        assert_eq!(t.lock().unwrap().holder, Some((1, b.key())));
        assert_eq!(a.key(), 0);
    }

    #[test]
    fn fence_mode_parses() {
        assert_eq!(FenceMode::parse("pr"), Ok(FenceMode::Pr));
        assert_eq!(FenceMode::parse("auto"), Ok(FenceMode::Auto));
        assert!(FenceMode::parse("scsi").is_err());
        assert_eq!(Preempt::parse("plain"), Ok(Preempt::Plain));
        assert!(Preempt::parse("x").is_err());
    }
}
