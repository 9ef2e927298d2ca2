//! Command line of a mount helper: `mount.cetra DEVICE MOUNTPOINT [-o OPTIONS] [-f] [-v] [-n] [-s]`.
//!
//! mount(8) calls helpers as `mount.TYPE SPEC DIR [-sfnv] [-o OPTIONS] [-t TYPE.SUBTYPE]`, with
//! the options gathered from fstab and the command line; this parser accepts exactly that.
//! It is hand-written rather than clap because helper syntax (`-oOPTS`, options after the
//! positionals, flags mount(8) may add) does not map well onto a derive parser, and a usage
//! error must be one line.

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// Kernel attribute/entry cache lifetime when not given. Every node caches what it looked up for
/// this long without asking the volume again, so it bounds how stale a node's view of another
/// node's change (new file, chmod, size after an append elsewhere) can be. Half a second keeps
/// a change on one node visible on every other within 1 s (the TTL plus a lock handoff);
/// 0 makes every stat a round trip into the daemon.
pub const DEFAULT_TTL: Duration = Duration::from_millis(500);
/// Longer than this makes multi-node coherency meaningless; shorter than this is just a typo guard.
const MAX_TTL_SECS: f64 = 3600.0;
const MAX_HOST_LEN: usize = 64;
/// `inode_cache=`, `meta_cache=` or `bitmap_cache=` above this many MiB (1 TiB) is a typo.
const MAX_CACHE_MIB: usize = 1 << 20;

pub const USAGE: &str = concat!(
    "usage: mount.cetra DEVICE MOUNTPOINT [-o OPTIONS] [-f] [-v]\n",
    "  options: host=NAME, ro, rw, attr_timeout=SECS, entry_timeout=SECS, nofilelock, renew=caw,\n",
    "           inode_cache=MIB, meta_cache=MIB, bitmap_cache=MIB, inode_locks=N, granule=KIB,\n",
    "           watchdog=auto|none|PATH, fence=auto|pr|watchdog|none, pr_preempt=abort|plain,\n",
    "           discard[=MIB/s], nodiscard,\n",
    "           nosuid, nodev, noexec, noatime (and the generic fstab options)\n",
    "  -f  stay in the foreground    -v  verbose (debug) logging",
);

/// A command-line mistake: mount(8) treats helper exit status 1 as "incorrect invocation".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

fn usage(msg: impl Into<String>) -> UsageError {
    UsageError(msg.into())
}

/// Mount options after parsing `-o`.
#[derive(Debug, Clone, PartialEq)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "one field per on/off mount option"
)]
pub struct Options {
    /// Node identity for the heartbeat slot; `None` means "use the host name".
    pub host: Option<String>,
    pub read_only: bool,
    pub attr_timeout: Duration,
    pub entry_timeout: Duration,
    /// Cross-node open locks: a file open for writing on one node cannot be opened for
    /// writing on another (EBUSY). `nofilelock` turns them off: nothing then stops a second
    /// writer on another node (live migration does not need it).
    pub file_locks: bool,
    /// `renew=caw`: heartbeat renewal by COMPARE AND WRITE instead of write + re-read.
    pub caw_renewal: bool,
    /// `inode_cache=MIB`: memory budget of the inode table, in bytes.
    pub inode_cache_bytes: usize,
    /// `meta_cache=MIB`: memory budget of the metadata block cache, in bytes.
    pub meta_cache_bytes: usize,
    /// `bitmap_cache=MIB`: memory budget of the allocator's bitmap cache, in bytes.
    pub bitmap_cache_bytes: usize,
    /// `inode_locks=N`: most inode locks this node keeps cached (format v3; default: its share
    /// of the volume's lock area).
    pub inode_locks: Option<usize>,
    /// `granule=KIB`: allocation granule of image-sized sparse files, in bytes.
    pub alloc_granule: u64,
    /// `discard=MIB` (MiB/s), `discard` (the default rate) or `nodiscard`: give freed space
    /// back to the LUN in the background, in bytes per second (`fs/discard.rs`).
    pub discard_rate: Option<u64>,
    /// `watchdog=auto|none|PATH`: the host watchdog petted while the lease is valid.
    pub watchdog: cetrafs_core::cluster::watchdog::WatchdogSpec,
    /// `fence=auto|pr|watchdog|none`: how a node that lost its lease is kept from writing
    /// (`cluster/reservation.rs`).
    pub fence: cetrafs_core::cluster::reservation::FenceMode,
    /// `pr_preempt=abort|plain`: PREEMPT AND ABORT (default) or PREEMPT of a dead node's key.
    pub pr_preempt: cetrafs_core::cluster::reservation::Preempt,
    // Kernel mount flags. Unlike a FUSE mount made by an unprivileged user, a root-mounted
    // CetraFS defaults to suid and dev like any block filesystem (container root filesystems
    // need both); fstab can still say nosuid/nodev.
    pub nosuid: bool,
    pub nodev: bool,
    pub noexec: bool,
    pub noatime: bool,
    /// `transport=`: how FUSE requests reach the daemon.
    pub transport: Transport,
}

/// How FUSE requests reach the daemon (`transport=`; uring.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// FUSE over `io_uring` when the kernel offers it (`fuse.enable_uring=1`), else /dev/fuse.
    Auto,
    /// /dev/fuse reads and writes only.
    Classic,
    /// FUSE over `io_uring` or no mount.
    Uring,
}

impl Transport {
    fn parse(v: &str) -> Result<Self, UsageError> {
        match v {
            "auto" => Ok(Self::Auto),
            "classic" => Ok(Self::Classic),
            "uring" => Ok(Self::Uring),
            _ => Err(usage(format!(
                "transport={v}: use auto (io_uring when the kernel offers it), classic or uring"
            ))),
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            host: None,
            read_only: false,
            attr_timeout: DEFAULT_TTL,
            entry_timeout: DEFAULT_TTL,
            file_locks: true,
            caw_renewal: false,
            inode_cache_bytes: cetrafs_core::fs::DEFAULT_INODE_CACHE,
            meta_cache_bytes: cetrafs_core::fs::DEFAULT_META_CACHE,
            bitmap_cache_bytes: cetrafs_core::fs::DEFAULT_BITMAP_CACHE,
            inode_locks: None,
            alloc_granule: cetrafs_core::fs::DEFAULT_ALLOC_GRANULE,
            discard_rate: Some(cetrafs_core::fs::discard::DEFAULT_RATE),
            watchdog: cetrafs_core::cluster::watchdog::WatchdogSpec::Auto,
            fence: cetrafs_core::cluster::reservation::FenceMode::Auto,
            pr_preempt: cetrafs_core::cluster::reservation::Preempt::Abort,
            nosuid: false,
            nodev: false,
            noexec: false,
            noatime: false,
            transport: Transport::Auto,
        }
    }
}

/// Options mount(8) or fstab may pass that mean nothing to this helper.
/// `relatime` is the kernel default; `atime` is its opposite of `noatime`, handled below.
const IGNORED: &[&str] = &[
    "defaults", "_netdev", "nofail", "relatime", "auto", "noauto", "user", "nouser", "users",
    "owner", "group", "async",
];

impl Options {
    /// Apply one comma-separated `-o` string on top of the current values (later wins, as with
    /// mount(8) where command-line options follow fstab options).
    pub fn apply(&mut self, list: &str) -> Result<(), UsageError> {
        for opt in list.split(',').filter(|o| !o.is_empty()) {
            let (key, value) = match opt.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (opt, None),
            };
            match (key, value) {
                ("host", Some(v)) => self.host = Some(parse_host(v)?),
                ("attr_timeout", Some(v)) => self.attr_timeout = parse_secs(key, v)?,
                ("entry_timeout", Some(v)) => self.entry_timeout = parse_secs(key, v)?,
                ("ro", None) => self.read_only = true,
                ("rw", None) => self.read_only = false,
                ("nofilelock", None) => self.file_locks = false,
                ("inode_cache", Some(v)) => self.inode_cache_bytes = parse_mib(key, v)?,
                ("meta_cache", Some(v)) => self.meta_cache_bytes = parse_mib(key, v)?,
                ("bitmap_cache", Some(v)) => self.bitmap_cache_bytes = parse_mib(key, v)?,
                ("inode_locks", Some(v)) => self.inode_locks = Some(parse_count(key, v)?),
                ("granule", Some(v)) => self.alloc_granule = parse_granule(key, v)?,
                ("discard", None) => {
                    self.discard_rate = Some(cetrafs_core::fs::discard::DEFAULT_RATE);
                }
                ("discard", Some(v)) => self.discard_rate = Some(parse_rate(key, v)?),
                ("nodiscard", None) => self.discard_rate = None,
                ("watchdog", Some(v)) => {
                    self.watchdog =
                        cetrafs_core::cluster::watchdog::WatchdogSpec::parse(v).map_err(usage)?;
                }
                ("fence", Some(v)) => {
                    self.fence =
                        cetrafs_core::cluster::reservation::FenceMode::parse(v).map_err(usage)?;
                }
                ("pr_preempt", Some(v)) => {
                    self.pr_preempt =
                        cetrafs_core::cluster::reservation::Preempt::parse(v).map_err(usage)?;
                }
                ("transport", Some(v)) => self.transport = Transport::parse(v)?,
                ("renew", Some("caw")) => self.caw_renewal = true,
                ("renew", Some("write")) => self.caw_renewal = false,
                ("renew", _) => {
                    return Err(usage(
                        "renew= takes caw (heartbeat by COMPARE AND WRITE) or write (the default)"
                            .to_string(),
                    ))
                }
                ("suid", None) => self.nosuid = false,
                ("nosuid", None) => self.nosuid = true,
                ("dev", None) => self.nodev = false,
                ("nodev", None) => self.nodev = true,
                ("exec", None) => self.noexec = false,
                ("noexec", None) => self.noexec = true,
                ("atime", None) => self.noatime = false,
                ("noatime", None) => self.noatime = true,
                (k, None) if IGNORED.contains(&k) => {}
                // x-* are userspace comments (mount(8) normally strips them); comment= likewise.
                (k, _) if k.starts_with("x-") || k == "comment" => {}
                (k, None)
                    if matches!(
                        k,
                        "host"
                            | "attr_timeout"
                            | "entry_timeout"
                            | "inode_cache"
                            | "meta_cache"
                            | "bitmap_cache"
                            | "inode_locks"
                            | "granule"
                            | "watchdog"
                            | "fence"
                            | "pr_preempt"
                            | "transport"
                    ) =>
                {
                    return Err(usage(format!("option {k} needs a value ({k}=...)")))
                }
                (k, Some(_)) if is_flag(k) => {
                    return Err(usage(format!("option {k} takes no value")))
                }
                _ => return Err(usage(format!("unknown mount option {opt:?}"))),
            }
        }
        Ok(())
    }
}

fn is_flag(k: &str) -> bool {
    IGNORED.contains(&k)
        || matches!(
            k,
            "ro" | "rw"
                | "nofilelock"
                | "nodiscard"
                | "suid"
                | "nosuid"
                | "dev"
                | "nodev"
                | "exec"
                | "noexec"
                | "atime"
                | "noatime"
        )
}

fn parse_host(v: &str) -> Result<String, UsageError> {
    if v.is_empty() || v.len() > MAX_HOST_LEN {
        return Err(usage(format!(
            "host= must be 1 to {MAX_HOST_LEN} characters"
        )));
    }
    if !v
        .bytes()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
    {
        return Err(usage(format!(
            "host={v:?}: use letters, digits, '-', '_' and '.' only"
        )));
    }
    Ok(v.to_string())
}

fn parse_secs(key: &str, v: &str) -> Result<Duration, UsageError> {
    let bad = || {
        usage(format!(
            "{key}={v:?}: expected seconds between 0 and {MAX_TTL_SECS}, e.g. 1 or 0.5"
        ))
    };
    let secs: f64 = v.parse().map_err(|_| bad())?;
    if !secs.is_finite() || !(0.0..=MAX_TTL_SECS).contains(&secs) {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_mib(key: &str, v: &str) -> Result<usize, UsageError> {
    v.parse::<usize>()
        .ok()
        .filter(|&m| m <= MAX_CACHE_MIB)
        .map(|m| m << 20)
        .ok_or_else(|| {
            usage(format!(
                "{key}={v:?}: expected whole MiB between 0 and {MAX_CACHE_MIB}, e.g. 32"
            ))
        })
}

fn parse_count(key: &str, v: &str) -> Result<usize, UsageError> {
    v.parse::<usize>()
        .ok()
        .filter(|n| (1..=cetrafs_core::fs::MAX_CACHED_INODE_LOCKS).contains(n))
        .ok_or_else(|| {
            usage(format!(
                "{key}={v:?}: expected a count between 1 and {}, e.g. 4096",
                cetrafs_core::fs::MAX_CACHED_INODE_LOCKS
            ))
        })
}

fn parse_granule(key: &str, v: &str) -> Result<u64, UsageError> {
    let max = cetrafs_core::fs::MAX_ALLOC_GRANULE >> 10;
    v.parse::<u64>()
        .ok()
        .filter(|k| (4..=max).contains(k) && k % 4 == 0)
        .map(|k| k << 10)
        .ok_or_else(|| {
            usage(format!(
                "{key}={v:?}: expected KiB, a multiple of 4 from 4 (allocate exactly what is written) to {max} (the default)"
            ))
        })
}

/// Most `discard=` accepts, MiB/s (a typo guard: faster than any SAN discards).
const MAX_DISCARD_MIB: u64 = 1 << 16;

fn parse_rate(key: &str, v: &str) -> Result<u64, UsageError> {
    v.parse::<u64>()
        .ok()
        .filter(|m| (1..=MAX_DISCARD_MIB).contains(m))
        .map(|m| m << 20)
        .ok_or_else(|| {
            usage(format!(
                "{key}={v:?}: expected MiB per second from 1 to {MAX_DISCARD_MIB}, e.g. 64 (the default); nodiscard turns it off"
            ))
        })
}

/// A parsed command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    pub device: PathBuf,
    pub mountpoint: PathBuf,
    pub foreground: bool,
    pub verbose: bool,
    pub opts: Options,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Mount(Box<Args>),
    Help,
}

/// Parse the arguments after the program name.
pub fn parse(argv: impl IntoIterator<Item = OsString>) -> Result<Command, UsageError> {
    let mut positional: Vec<OsString> = Vec::new();
    let mut opts = Options::default();
    let (mut foreground, mut verbose) = (false, false);
    let mut it = argv.into_iter();
    let mut only_positional = false;
    while let Some(arg) = it.next() {
        let Some(s) = arg
            .to_str()
            .filter(|s| !only_positional && s.starts_with('-') && s.len() > 1)
        else {
            positional.push(arg);
            continue;
        };
        match s {
            "--" => only_positional = true,
            "-h" | "--help" => return Ok(Command::Help),
            "-o" => {
                let v = it.next().ok_or_else(|| usage("-o needs an option list"))?;
                let v = v
                    .to_str()
                    .ok_or_else(|| usage("mount options must be valid UTF-8"))?;
                opts.apply(v)?;
            }
            // mount(8) passes -t TYPE.SUBTYPE for subtypes; the type is implied by this helper.
            "-t" => {
                it.next().ok_or_else(|| usage("-t needs a type"))?;
            }
            _ if s.starts_with("-o") => opts.apply(&s[2..])?,
            _ if s.starts_with("--") => return Err(usage(format!("unknown argument {s}"))),
            // Bundled short flags, e.g. "-fv" or mount(8)'s "-sn".
            _ => {
                for c in s[1..].chars() {
                    match c {
                        'f' => foreground = true,
                        'v' => verbose = true,
                        // -n: do not write /etc/mtab (there is none to write); -s: sloppy
                        // (tolerate unknown options) is accepted but not honoured, because
                        // silently dropping an option like nosuid would be worse than failing.
                        'n' | 's' => {}
                        _ => return Err(usage(format!("unknown flag -{c} in {s}"))),
                    }
                }
            }
        }
    }
    let mut positional = positional.into_iter();
    let (Some(device), Some(mountpoint)) = (positional.next(), positional.next()) else {
        return Err(usage("expected DEVICE and MOUNTPOINT"));
    };
    if let Some(extra) = positional.next() {
        return Err(usage(format!(
            "unexpected argument {:?}",
            extra.to_string_lossy()
        )));
    }
    Ok(Command::Mount(Box::new(Args {
        device: device.into(),
        mountpoint: mountpoint.into(),
        foreground,
        verbose,
        opts,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Command, UsageError> {
        parse(args.iter().map(OsString::from))
    }

    fn mount(args: &[&str]) -> Args {
        match p(args) {
            Ok(Command::Mount(a)) => *a,
            other => panic!("{args:?} parsed as {other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let a = mount(&["/dev/sdb", "/mnt/x"]);
        assert_eq!(a.device, PathBuf::from("/dev/sdb"));
        assert_eq!(a.mountpoint, PathBuf::from("/mnt/x"));
        assert!(!a.foreground && !a.verbose);
        assert_eq!(a.opts, Options::default());
        assert_eq!(a.opts.attr_timeout, Duration::from_millis(500));
        assert!(a.opts.file_locks && !a.opts.read_only && !a.opts.nosuid && !a.opts.nodev);
    }

    #[test]
    fn mount8_style_invocation() {
        // What mount(8) runs for an fstab line "... cetra defaults,_netdev,host=pve1,noatime 0 0".
        let a = mount(&[
            "/dev/mapper/lun0",
            "/mnt/pve/c",
            "-n",
            "-o",
            "rw,defaults,_netdev,host=pve1,noatime",
        ]);
        assert_eq!(a.opts.host.as_deref(), Some("pve1"));
        assert!(a.opts.noatime && !a.opts.read_only);
        let a = mount(&[
            "-sfnv",
            "-t",
            "cetra",
            "/dev/x",
            "/m",
            "-oro,nofilelock",
            "-o",
            "nosuid,nodev,noexec",
        ]);
        assert!(a.foreground && a.verbose && a.opts.read_only && !a.opts.file_locks);
        assert!(a.opts.nosuid && a.opts.nodev && a.opts.noexec);
    }

    #[test]
    fn later_options_win() {
        assert!(!mount(&["d", "m", "-o", "ro", "-o", "rw"]).opts.read_only);
        assert!(mount(&["d", "m", "-o", "rw,ro"]).opts.read_only);
        assert!(!mount(&["d", "m", "-o", "nosuid,suid"]).opts.nosuid);
    }

    #[test]
    fn ignored_options_are_accepted() {
        let a = mount(&[
            "d",
            "m",
            "-o",
            "defaults,_netdev,nofail,noatime,relatime,auto,noauto,user,nouser,exec,noexec,suid,nosuid,dev,nodev,x-systemd.requires=iscsi.service",
        ]);
        assert!(a.opts.nosuid && a.opts.nodev && a.opts.noexec && a.opts.noatime);
    }

    #[test]
    fn timeouts() {
        let a = mount(&["d", "m", "-o", "attr_timeout=0,entry_timeout=2.5"]);
        assert_eq!(a.opts.attr_timeout, Duration::ZERO);
        assert_eq!(a.opts.entry_timeout, Duration::from_millis(2500));
        for bad in [
            "attr_timeout=-1",
            "attr_timeout=abc",
            "entry_timeout=inf",
            "entry_timeout=NaN",
            "attr_timeout=99999",
        ] {
            let e = p(&["d", "m", "-o", bad]).unwrap_err();
            assert!(e.0.contains("expected seconds"), "{bad}: {e}");
        }
        assert!(p(&["d", "m", "-o", "attr_timeout"])
            .unwrap_err()
            .0
            .contains("needs a value"));
    }

    #[test]
    fn meta_cache() {
        let o = mount(&["d", "m"]).opts;
        assert_eq!(o.meta_cache_bytes, cetrafs_core::fs::DEFAULT_META_CACHE);
        let o = mount(&["d", "m", "-o", "meta_cache=8,inode_cache=4"]).opts;
        assert_eq!(
            (o.meta_cache_bytes, o.inode_cache_bytes),
            (8 << 20, 4 << 20)
        );
        assert_eq!(
            mount(&["d", "m", "-o", "meta_cache=0"])
                .opts
                .meta_cache_bytes,
            0
        );
        for bad in ["meta_cache=-1", "meta_cache=2M", "meta_cache=9999999"] {
            let e = p(&["d", "m", "-o", bad]).unwrap_err();
            assert!(e.0.contains("expected whole MiB"), "{bad}: {e}");
        }
        assert!(p(&["d", "m", "-o", "meta_cache"])
            .unwrap_err()
            .0
            .contains("needs a value"));
    }

    #[test]
    fn discard() {
        let rate = |o: &str| mount(&["d", "m", "-o", o]).opts.discard_rate;
        assert_eq!(mount(&["d", "m"]).opts.discard_rate, Some(64 << 20));
        assert_eq!(rate("nodiscard"), None);
        assert_eq!(rate("discard=25"), Some(25 << 20));
        assert_eq!(rate("nodiscard,discard"), Some(64 << 20));
        assert_eq!(rate("discard=100,nodiscard"), None);
        for bad in ["discard=0", "discard=x", "discard=99999999", "nodiscard=1"] {
            assert!(p(&["d", "m", "-o", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn granule() {
        assert_eq!(mount(&["d", "m"]).opts.alloc_granule, 1 << 20);
        assert_eq!(
            mount(&["d", "m", "-o", "granule=4"]).opts.alloc_granule,
            4096
        );
        assert_eq!(
            mount(&["d", "m", "-o", "granule=64"]).opts.alloc_granule,
            64 << 10
        );
        assert_eq!(
            mount(&["d", "m", "-o", "granule=1024"]).opts.alloc_granule,
            1 << 20
        );
        for bad in ["granule=0", "granule=6", "granule=2048", "granule=x"] {
            let e = p(&["d", "m", "-o", bad]).unwrap_err();
            assert!(e.0.contains("expected KiB"), "{bad}: {e}");
        }
    }

    #[test]
    fn inode_locks() {
        assert_eq!(mount(&["d", "m"]).opts.inode_locks, None);
        let o = mount(&["d", "m", "-o", "inode_locks=64"]).opts;
        assert_eq!(o.inode_locks, Some(64));
        for bad in [
            "inode_locks=0",
            "inode_locks=-3",
            "inode_locks=x",
            "inode_locks=99999999",
        ] {
            let e = p(&["d", "m", "-o", bad]).unwrap_err();
            assert!(e.0.contains("expected a count"), "{bad}: {e}");
        }
        assert!(p(&["d", "m", "-o", "inode_locks"])
            .unwrap_err()
            .0
            .contains("needs a value"));
    }

    #[test]
    fn bitmap_cache() {
        assert_eq!(
            mount(&["d", "m"]).opts.bitmap_cache_bytes,
            cetrafs_core::fs::DEFAULT_BITMAP_CACHE
        );
        let o = mount(&["d", "m", "-o", "bitmap_cache=2,meta_cache=8"]).opts;
        assert_eq!(
            (o.bitmap_cache_bytes, o.meta_cache_bytes),
            (2 << 20, 8 << 20)
        );
        assert_eq!(
            mount(&["d", "m", "-o", "bitmap_cache=0"])
                .opts
                .bitmap_cache_bytes,
            0
        );
        for bad in [
            "bitmap_cache=-1",
            "bitmap_cache=0.5",
            "bitmap_cache=9999999",
        ] {
            let e = p(&["d", "m", "-o", bad]).unwrap_err();
            assert!(e.0.contains("expected whole MiB"), "{bad}: {e}");
        }
        assert!(p(&["d", "m", "-o", "bitmap_cache"])
            .unwrap_err()
            .0
            .contains("needs a value"));
    }

    #[test]
    fn inode_cache() {
        assert_eq!(
            mount(&["d", "m"]).opts.inode_cache_bytes,
            cetrafs_core::fs::DEFAULT_INODE_CACHE
        );
        assert_eq!(
            mount(&["d", "m", "-o", "inode_cache=16"])
                .opts
                .inode_cache_bytes,
            16 << 20
        );
        assert_eq!(
            mount(&["d", "m", "-o", "inode_cache=0"])
                .opts
                .inode_cache_bytes,
            0
        );
        for bad in [
            "inode_cache=-1",
            "inode_cache=1.5",
            "inode_cache=9999999",
            "inode_cache=x",
        ] {
            let e = p(&["d", "m", "-o", bad]).unwrap_err();
            assert!(e.0.contains("expected whole MiB"), "{bad}: {e}");
        }
        assert!(p(&["d", "m", "-o", "inode_cache"])
            .unwrap_err()
            .0
            .contains("needs a value"));
    }

    #[test]
    fn transport_option() {
        assert_eq!(mount(&["d", "m"]).opts.transport, Transport::Auto);
        for (v, t) in [
            ("auto", Transport::Auto),
            ("classic", Transport::Classic),
            ("uring", Transport::Uring),
        ] {
            let o = format!("transport={v}");
            assert_eq!(mount(&["d", "m", "-o", &o]).opts.transport, t);
        }
        assert!(p(&["d", "m", "-o", "transport=io_uring"])
            .unwrap_err()
            .0
            .contains("use auto"));
        assert!(p(&["d", "m", "-o", "transport"])
            .unwrap_err()
            .0
            .contains("needs a value"));
    }

    #[test]
    fn host_validation() {
        assert_eq!(
            mount(&["d", "m", "-o", "host=pve-2.lab"])
                .opts
                .host
                .as_deref(),
            Some("pve-2.lab")
        );
        assert!(p(&["d", "m", "-o", "host="]).is_err());
        assert!(p(&["d", "m", "-o", "host=a b"]).is_err());
        assert!(p(&["d", "m", "-o", &format!("host={}", "x".repeat(65))]).is_err());
    }

    #[test]
    fn usage_errors() {
        assert!(p(&["d", "m", "-o", "bogus"])
            .unwrap_err()
            .0
            .contains("unknown mount option \"bogus\""));
        assert!(p(&["d", "m", "-o", "ro=1"])
            .unwrap_err()
            .0
            .contains("takes no value"));
        assert!(p(&["d"])
            .unwrap_err()
            .0
            .contains("expected DEVICE and MOUNTPOINT"));
        assert!(p(&[]).is_err());
        assert!(p(&["d", "m", "extra"])
            .unwrap_err()
            .0
            .contains("unexpected argument"));
        assert!(p(&["d", "m", "-x"])
            .unwrap_err()
            .0
            .contains("unknown flag -x"));
        assert!(p(&["d", "m", "--bogus"]).is_err());
        assert!(p(&["d", "m", "-o"]).unwrap_err().0.contains("-o needs"));
        assert_eq!(p(&["--help"]), Ok(Command::Help));
    }

    #[test]
    fn double_dash_ends_flags() {
        let a = mount(&["-f", "--", "-weird-device", "m"]);
        assert_eq!(a.device, PathBuf::from("-weird-device"));
        assert!(a.foreground);
    }
}
