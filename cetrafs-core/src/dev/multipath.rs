//! The multipath guard (docs/san.md §5): a dm-multipath map that queues I/O for as long as
//! no path exists (`queue_if_no_path` with nothing that ends the queueing) can deliver a
//! fenced node's writes long after the survivors recovered it and reused its blocks.
//!
//! What bounds the queue, in the order it is looked at:
//! 1. the map's table (`dmsetup table MAP`): without `queue_if_no_path` among its features,
//!    I/O fails as soon as the last path is gone;
//! 2. the kernel's own bound, `dm_multipath.queue_if_no_path_timeout_secs` (0: none);
//! 3. multipathd's view of the map (`multipathd show maps raw format "%n %Q"`): `off` (it
//!    fails I/O), `N chk` / `N sec` (`no_path_retry N`: it stops queueing after N path
//!    checks), `on` (`no_path_retry queue`: forever), `-` (undefined: the table decides).
//!
//! A map that queues forever is then judged against what else stops the node's writes
//! ([`Protection`]): SCSI-3 persistent reservations make the target refuse whatever the host
//! sends once the node's key is preempted, so the queue is harmless (logged); a host watchdog
//! resets the host before the survivors act, so the queue dies with it (a loud warning: a
//! watchdog is a weaker guarantee); software fencing alone cannot take back a queued write,
//! so the mount is refused, with the `multipath.conf` lines that fix it.

use crate::error::{Error, ErrorKind, Result};

/// The `multipath.conf` lines docs/san.md §5 gives (quoted in messages).
pub const MULTIPATH_CONF: &str = "devices { device { vendor \"<VENDOR>\" product \"<PRODUCT>\" no_path_retry fail fast_io_fail_tmo 5 dev_loss_tmo 30 } } (and no features \"1 queue_if_no_path\")";

/// The kernel's bound on `queue_if_no_path` (seconds; 0 or absent: none).
const KERNEL_TIMEOUT: &str = "/sys/module/dm_multipath/parameters/queue_if_no_path_timeout_secs";

/// What happens to I/O on a map whose every path failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Queueing {
    /// It fails at once.
    Fails,
    /// It is queued for a bounded time (how, for messages).
    Bounded(String),
    /// It is queued until a path comes back (why, for messages).
    Forever(String),
    /// The map's table could not be read (`dmsetup` missing or failing).
    Unknown(String),
}

/// What stops this node's writes once it lost its lease, besides its own lease check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protection {
    /// SCSI-3 persistent reservations (`fence=pr`).
    Reservations,
    /// A host watchdog that resets the host (`watchdog=`).
    Watchdog,
    /// Nothing but the lease check.
    Software,
}

/// What the mount does about a map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Fine(String),
    Warn(String),
    Refuse(String),
}

/// Does the `multipath` target line of a `dmsetup table` listing queue when no path is left
/// (`queue_if_no_path` among its features)? `None`: no multipath line.
pub fn table_queues(table: &str) -> Option<bool> {
    table.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (_, _, ty) = (f.next()?, f.next()?, f.next()?);
        if ty != "multipath" {
            return None;
        }
        let n: usize = f.next()?.parse().ok()?;
        Some(f.take(n).any(|w| w == "queue_if_no_path"))
    })
}

/// multipathd's queueing column (`%Q`) for `map` in `show maps raw format "%n %Q"` output.
pub fn multipathd_queueing<'a>(listing: &'a str, map: &str) -> Option<&'a str> {
    listing.lines().find_map(|l| {
        let l = l.trim();
        let (name, q) = l.split_once(char::is_whitespace)?;
        (name == map).then(|| q.trim())
    })
}

/// Combine the three sources (module doc). `multipathd`: its `%Q` column for the map, if it
/// answered; `kernel_timeout`: the kernel bound in seconds, if readable.
pub fn classify(table: &str, multipathd: Option<&str>, kernel_timeout: Option<u64>) -> Queueing {
    match table_queues(table) {
        Some(false) => return Queueing::Fails,
        None => {
            return Queueing::Unknown(
                "its table could not be read (is dmsetup installed?), so whether it queues I/O forever is unknown".into(),
            )
        }
        Some(true) => {}
    }
    if let Some(t) = kernel_timeout.filter(|t| *t > 0) {
        return Queueing::Bounded(format!(
            "dm_multipath.queue_if_no_path_timeout_secs={t}: the kernel fails queued I/O after {t} s"
        ));
    }
    match multipathd {
        Some("off") => Queueing::Fails,
        Some(q) if q.ends_with(" chk") || q.ends_with(" sec") => Queueing::Bounded(format!(
            "multipathd stops queueing after no_path_retry checks ({q})"
        )),
        Some("on") => Queueing::Forever(
            "queue_if_no_path with multipathd's no_path_retry queue".into(),
        ),
        Some(q) => Queueing::Forever(format!(
            "queue_if_no_path in the map's table, multipathd's no_path_retry undefined ({q:?}), no kernel timeout"
        )),
        None => Queueing::Forever(
            "queue_if_no_path in the map's table, multipathd not answering, no kernel timeout".into(),
        ),
    }
}

/// What the mount of `map` does about its queueing under `protection`.
pub fn judge(map: &str, q: &Queueing, protection: Protection) -> Verdict {
    match (q, protection) {
        (Queueing::Fails, _) => Verdict::Fine(format!(
            "multipath map {map}: I/O fails when no path is left"
        )),
        (Queueing::Bounded(how), _) => Verdict::Fine(format!("multipath map {map}: {how}")),
        (Queueing::Unknown(why), Protection::Reservations) => Verdict::Fine(format!(
            "multipath map {map}: {why}; harmless with fence=pr"
        )),
        (Queueing::Unknown(why), _) => Verdict::Warn(format!(
            "multipath map {map}: {why}; if it queues forever when no path is left, a write queued before this node fenced can land after the others recovered it: check `multipath -ll` and put this in /etc/multipath.conf: {MULTIPATH_CONF}"
        )),
        (Queueing::Forever(why), Protection::Reservations) => Verdict::Fine(format!(
            "multipath map {map} queues I/O forever when no path is left ({why}); harmless with fence=pr: the target refuses the queued writes of a node whose key was preempted"
        )),
        (Queueing::Forever(why), Protection::Watchdog) => Verdict::Warn(format!(
            "multipath map {map} queues I/O forever when no path is left ({why}): a write queued before this node fenced can land after the others recovered it, unless the host watchdog resets this host first; persistent reservations (fence=pr) or this in /etc/multipath.conf make it safe: {MULTIPATH_CONF}"
        )),
        (Queueing::Forever(why), Protection::Software) => Verdict::Refuse(format!(
            "multipath map {map} queues I/O forever when no path is left ({why}), and nothing but this node's own lease check (no persistent reservation, no watchdog) would stop a write queued before it fenced from landing after the others recovered it and reused its blocks; put this in /etc/multipath.conf and run `multipathd reconfigure`: {MULTIPATH_CONF}; or mount with fence=pr on a LUN with persistent reservations, or with a host watchdog (watchdog=)"
        )),
    }
}

/// Look at the live map `dm_name` (module doc). Commands that are missing count as "did not
/// answer".
pub fn probe(dm_name: &str) -> Queueing {
    let run = |prog: &str, args: &[&str]| {
        std::process::Command::new(prog)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let table = run("dmsetup", &["table", "--", dm_name]).unwrap_or_default();
    let listing = run("multipathd", &["show", "maps", "raw", "format", "%n %Q"]);
    let kernel = std::fs::read_to_string(KERNEL_TIMEOUT)
        .ok()
        .and_then(|s| s.trim().parse().ok());
    classify(
        &table,
        listing
            .as_deref()
            .and_then(|l| multipathd_queueing(l, dm_name)),
        kernel,
    )
}

/// [`judge`] as a mount step: `Err` (`InvalidInput`) for a refusal, a log line otherwise.
pub fn guard(dm_name: &str, protection: Protection) -> Result<()> {
    match judge(dm_name, &probe(dm_name), protection) {
        Verdict::Fine(m) => tracing::info!("{m}"),
        Verdict::Warn(m) => tracing::warn!("{m}"),
        Verdict::Refuse(m) => return Err(Error::new(ErrorKind::InvalidInput, m)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUEUES: &str =
        "0 2097152 multipath 1 queue_if_no_path 1 alua 1 1 service-time 0 2 1 8:16 1 8:32 1\n";
    const FAILS: &str = "0 2097152 multipath 0 1 alua 1 1 service-time 0 2 1 8:16 1 8:32 1\n";

    #[test]
    fn table_features() {
        assert_eq!(table_queues(QUEUES), Some(true));
        assert_eq!(table_queues(FAILS), Some(false));
        // a feature argument named like the feature does not count beyond the count
        assert_eq!(
            table_queues("0 8 multipath 2 pg_init_retries 50 0 1 1 round-robin 0 1 1 8:0 1\n"),
            Some(false)
        );
        assert_eq!(
            table_queues("0 8 multipath 3 queue_if_no_path queue_mode mq 0 1 1 x 0 1 1 8:0 1"),
            Some(true)
        );
        assert_eq!(table_queues("0 8 linear 8:0 0\n"), None);
        assert_eq!(table_queues("garbage"), None);
        assert_eq!(table_queues("0 8 multipath x"), None);
    }

    #[test]
    fn multipathd_column() {
        let l = "mpatha on\nmpathb 12 chk\nmpathc -\n";
        assert_eq!(multipathd_queueing(l, "mpatha"), Some("on"));
        assert_eq!(multipathd_queueing(l, "mpathb"), Some("12 chk"));
        assert_eq!(multipathd_queueing(l, "mpathc"), Some("-"));
        assert_eq!(multipathd_queueing(l, "mpathd"), None);
    }

    #[test]
    fn what_bounds_the_queue() {
        assert_eq!(classify(FAILS, Some("on"), None), Queueing::Fails);
        assert!(matches!(
            classify(QUEUES, Some("on"), Some(30)),
            Queueing::Bounded(_)
        ));
        assert!(matches!(
            classify(QUEUES, Some("on"), Some(0)),
            Queueing::Forever(_)
        ));
        assert!(matches!(
            classify(QUEUES, Some("5 chk"), None),
            Queueing::Bounded(_)
        ));
        assert!(matches!(
            classify(QUEUES, Some("20 sec"), None),
            Queueing::Bounded(_)
        ));
        assert_eq!(classify(QUEUES, Some("off"), None), Queueing::Fails);
        assert!(matches!(
            classify(QUEUES, Some("-"), None),
            Queueing::Forever(_)
        ));
        assert!(matches!(classify(QUEUES, None, None), Queueing::Forever(_)));
        let unread = classify("", Some("off"), Some(30));
        assert!(matches!(unread, Queueing::Unknown(_)), "{unread:?}");
        assert!(matches!(
            judge("m", &unread, Protection::Software),
            Verdict::Warn(_)
        ));
        assert!(matches!(
            judge("m", &unread, Protection::Reservations),
            Verdict::Fine(_)
        ));
    }

    #[test]
    fn forever_is_refused_only_without_reservations_or_watchdog() {
        let q = classify(QUEUES, Some("on"), None);
        assert!(matches!(
            judge("mpatha", &q, Protection::Reservations),
            Verdict::Fine(_)
        ));
        assert!(
            matches!(judge("mpatha", &q, Protection::Watchdog), Verdict::Warn(m) if m.contains("no_path_retry fail"))
        );
        let Verdict::Refuse(m) = judge("mpatha", &q, Protection::Software) else {
            panic!("software fencing on a queue-forever map must be refused")
        };
        assert!(
            m.contains("mpatha") && m.contains("no_path_retry fail") && m.contains("fence=pr"),
            "{m}"
        );
        for p in [Protection::Software, Protection::Watchdog] {
            assert!(matches!(judge("m", &Queueing::Fails, p), Verdict::Fine(_)));
        }
    }
}
