//! `fsck.cetra`: check and repair a CetraFS volume offline.
//!
//! * `-n`: check only; nothing is written (committed journals are applied in memory).
//! * `-p` (`-a`): preen: replay the journals, then make the repairs that cannot lose data
//!   (`cetrafs_core::check::repair` lists them).
//! * `-y`: replay, then make every repair there is.
//! * none of them: replay, check, repair nothing.
//!
//! A committed transaction that mount would refuse to replay (it logs a block that is not a
//! metadata home) is neither replayed nor applied in memory: the check reports it, and `-y`
//! discards it (`discard-journal`).
//!
//! Repairs run in rounds (check, repair, check again) until a check is clean or a round
//! repairs nothing. Exit codes follow e2fsck: 0 no errors, 1 errors corrected, 4 errors left
//! uncorrected, 8 operational error (cannot open or read the device, not a CetraFS volume,
//! unsupported features, mounted), 16 usage error.
//!
//! It refuses a volume any node has mounted. Any mode but `-n` holds fsck's claim while it
//! runs (a node slot named `fsck.cetra:HOST`, `cetrafs_core::cluster::fsck_claim`): a mount
//! started meanwhile is refused, naming this host.

use cetrafs_core::check::repair::{self, Mode};
use cetrafs_core::check::{self, Pass, Report, Severity};
use cetrafs_core::cluster::fsck_claim::FsckClaim;
use cetrafs_core::cluster::membership;
use cetrafs_core::dev::open::{open_for_reading, open_for_repair};
use cetrafs_core::dev::{BlockDevice, SharedDevice};
use cetrafs_core::fs::{ClaimedSlot, MountOptions, Volume};
use cetrafs_core::journal;
use clap::Parser;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const EXIT_CLEAN: u8 = 0;
const EXIT_FIXED: u8 = 1;
const EXIT_UNCORRECTED: u8 = 4;
const EXIT_OPERATIONAL: u8 = 8;
const EXIT_USAGE: u8 = 16;

#[derive(Debug, Parser)]
#[command(
    name = "fsck.cetra",
    version,
    about = "Check and repair a CetraFS volume"
)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "one field per command-line flag"
)]
struct Cli {
    /// Check only, change nothing.
    #[arg(short = 'n', conflicts_with_all = ["yes", "preen"])]
    no_change: bool,
    /// Force a full check (every check is full; accepted for fsck(8) compatibility).
    #[arg(short = 'f')]
    force: bool,
    /// Make every repair there is, without asking.
    #[arg(short = 'y', conflicts_with = "preen")]
    yes: bool,
    /// Preen (fsck -a / -p): make only the repairs that cannot lose data.
    #[arg(short = 'p', short_alias = 'a')]
    preen: bool,
    /// Print only findings and the summary line.
    #[arg(short, long)]
    quiet: bool,
    /// Block device or image file holding the volume.
    device: PathBuf,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() {
                EXIT_USAGE
            } else {
                EXIT_CLEAN
            };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    ExitCode::from(run(&cli))
}

impl Cli {
    fn mode(&self) -> Option<Mode> {
        if self.yes {
            Some(Mode::All)
        } else if self.preen {
            Some(Mode::Preen)
        } else {
            None
        }
    }
}

fn run(cli: &Cli) -> u8 {
    let shown = cli.device.display().to_string();
    let dev = match open(&cli.device) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("fsck.cetra: {e}");
            return EXIT_OPERATIONAL;
        }
    };
    let tty = std::io::stderr().is_terminal() && !cli.quiet;
    // Refuse to check a volume some node has mounted: it changes under the check (and a
    // replay would write under a live node). A read-only check watches heartbeats briefly; a
    // check that replays waits out the dead time of every live-looking slot.
    if let Ok(sb) = cetrafs_core::fs::read_superblock(&*dev) {
        let patience = if cli.no_change {
            membership::Patience::Brief
        } else {
            membership::Patience::Dead
        };
        let host = cetrafs_core::cluster::machine::kernel_host_name();
        match membership::find_holders(&*dev, &sb, &host, patience) {
            Ok((alive, _)) if !alive.is_empty() => {
                let who: Vec<String> = alive.iter().map(membership::describe).collect();
                eprintln!("fsck.cetra: {shown} is mounted by {}; unmount it on every node before checking", who.join(", "));
                return EXIT_OPERATIONAL;
            }
            Ok((_, dead)) => {
                for d in &dead {
                    println!(
                        "{shown}: {} stopped without unmounting (its heartbeat is not advancing)",
                        membership::describe(d)
                    );
                }
                if !cli.no_change {
                    drop(dev);
                    return repair_volume(cli, &shown, &sb, &host, &dead, cli.mode(), tty);
                }
            }
            Err(e) => {
                eprintln!("fsck.cetra: {shown}: cannot read the heartbeat area: {e}");
                return EXIT_OPERATIONAL;
            }
        }
    }
    // Here with -n (or a volume whose superblock does not read): a node that crashed leaves
    // a committed transaction in its journal, so the check runs on a view with the replay
    // applied in memory, and findings are about the volume as it will be. (Without -n the
    // replay is written, under fsck's claim: repair_volume.)
    // A transaction mount refuses to replay is left out of the view (the check reports it).
    let pending = match cetrafs_core::fs::read_superblock(&*dev)
        .and_then(|sb| journal::pending(&*dev, &sb).map(|p| (sb, p)))
    {
        Ok((sb, mut p)) => {
            p.retain(|(_, tx)| journal::check_homes(&sb, tx).is_ok());
            p
        }
        Err(_) => Vec::new(), // the checker reports superblock problems itself
    };
    if !pending.is_empty() {
        for (slot, tx) in &pending {
            println!(
                "{shown}: the journal of node slot {slot} holds committed transaction {} ({} blocks) that a mount will replay; checking with it applied",
                tx.seq,
                tx.blocks.len()
            );
        }
        let view = match journal::ReplayedView::new(&*dev, &pending) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("fsck.cetra: {shown}: cannot read the journal: {e}");
                return EXIT_OPERATIONAL;
            }
        };
        return check_and_report(&shown, &view, tty, None);
    }
    check_and_report(&shown, &*dev, tty, None)
}

/// Every mode but `-n`: claim the volume, replay, then check (and with `-p` / `-y` repair in
/// rounds).
fn repair_volume(
    cli: &Cli,
    shown: &str,
    sb: &cetrafs_core::format::superblock::Superblock,
    host: &str,
    dead: &[membership::SlotView],
    mode: Option<Mode>,
    tty: bool,
) -> u8 {
    let rw = match open_for_repair(&cli.device).map_err(|e| e.to_string()) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("fsck.cetra: cannot open {shown} to repair it: {e}");
            return EXIT_OPERATIONAL;
        }
    };
    let claim = match FsckClaim::take(&rw, sb, host, dead) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fsck.cetra: {shown}: {e}");
            return EXIT_OPERATIONAL;
        }
    };
    let dev = claim.guard(rw);
    let code = repair_claimed(cli, shown, sb, &dev, &claim, host, dead, mode, tty);
    drop(dev);
    if let Err(e) = claim.release() {
        eprintln!("fsck.cetra: {shown}: giving back fsck's node slot: {e}");
        return code.max(EXIT_OPERATIONAL);
    }
    code
}

#[expect(
    clippy::too_many_arguments,
    reason = "the run's context, passed down once"
)]
fn repair_claimed(
    cli: &Cli,
    shown: &str,
    sb: &cetrafs_core::format::superblock::Superblock,
    dev: &SharedDevice,
    claim: &FsckClaim,
    host: &str,
    dead: &[membership::SlotView],
    mode: Option<Mode>,
    tty: bool,
) -> u8 {
    // The e2e test of the claim holds fsck here (sleep) and tries to mount meanwhile.
    cetrafs_core::failpoint::process("fsck::claimed");
    match journal::pending(&**dev, sb) {
        Ok(p) => {
            for (slot, tx) in &p {
                // A transaction mount would refuse is not replayed: the check reports it and
                // `-y` discards it (discard-journal).
                if let Err(e) = journal::check_homes(sb, tx) {
                    println!("{shown}: not replaying the journal of node slot {slot}: {e}");
                    continue;
                }
                match journal::replay(&**dev, sb, journal::JournalArea::for_slot(sb, *slot)) {
                    Ok(n) => println!("{shown}: replayed the journal of node slot {slot} (transaction {}, {n} blocks written)", tx.seq),
                    Err(e) => {
                        eprintln!("fsck.cetra: {shown}: journal replay of node slot {slot} failed: {e}");
                        return EXIT_OPERATIONAL;
                    }
                }
            }
        }
        Err(e) => {
            eprintln!("fsck.cetra: {shown}: cannot read the journals: {e}");
            return EXIT_OPERATIONAL;
        }
    }
    let Some(mode) = mode else {
        // No repair asked for: the check of the replayed volume.
        return check_and_report(shown, &**dev, tty, Some(claim.slot()));
    };
    let mut check = |announce: bool| checked(&**dev, tty && announce, Some(claim.slot()));
    // The repairs that change directories mount the volume in fsck's own slot.
    let mount = || {
        Volume::mount(
            dev.clone(),
            &MountOptions {
                host: format!("{}{host}", cetrafs_core::cluster::fsck_claim::PREFIX),
                claimed: Some(ClaimedSlot {
                    member: claim.member(),
                    dead: dead.to_vec(),
                }),
                discard_rate: None,
                commit_interval: std::time::Duration::ZERO,
                ..MountOptions::default()
            },
        )
    };
    let quiet = cli.quiet;
    let outcome = repair::rounds(
        &**dev,
        mode,
        &mut check,
        &mount,
        &mut |round, report, fixed| {
            if round == 0 || !quiet {
                for f in &report.findings {
                    println!("{f}");
                }
            }
            for line in fixed {
                println!("{shown}: repaired: {line}");
            }
        },
    );
    let (report, fixed) = match outcome {
        Ok(o) => (o.last, o.fixed),
        Err(e) => {
            eprintln!("fsck.cetra: {shown}: {e}");
            return EXIT_OPERATIONAL;
        }
    };
    if !report.is_clean() {
        println!("{shown}: left after repair:");
        for f in &report.findings {
            println!("{f}");
        }
    }
    print_summary(shown, &report, Some((mode, fixed)));
    match (report.is_clean(), fixed) {
        (true, 0) => EXIT_CLEAN,
        (true, _) => EXIT_FIXED,
        (false, _) => EXIT_UNCORRECTED,
    }
}

/// The check, its passes announced on `tty`. `own_slot`: fsck's claim, a live slot that is
/// not a node that stopped (its finding is left out).
fn checked(
    dev: &dyn BlockDevice,
    tty: bool,
    own_slot: Option<u32>,
) -> cetrafs_core::Result<Report> {
    let mut r = check::check_volume_with(dev, &mut |p: Pass| {
        if tty {
            eprintln!("{p}");
        }
    })?;
    if let Some(slot) = own_slot {
        let mine = format!("heartbeat slot {slot} is Live");
        r.findings.retain(|f| !f.message.starts_with(&mine));
    }
    Ok(r)
}

fn check_and_report(shown: &str, dev: &dyn BlockDevice, tty: bool, own_slot: Option<u32>) -> u8 {
    let report = match checked(dev, tty, own_slot) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fsck.cetra: {shown}: {e}");
            return EXIT_OPERATIONAL;
        }
    };
    for f in &report.findings {
        println!("{f}");
    }
    print_summary(shown, &report, None);
    if report.is_clean() {
        EXIT_CLEAN
    } else {
        EXIT_UNCORRECTED
    }
}

/// `repaired`: the mode of a repair run and how many repairs it made.
fn print_summary(dev: &str, r: &Report, repaired: Option<(Mode, usize)>) {
    let s = &r.stats;
    let errors = r.errors().count();
    let warnings = r
        .findings
        .iter()
        .filter(|f| f.severity == Severity::Warning)
        .count();
    let label = r
        .superblock
        .as_ref()
        .map(|sb| {
            if sb.label.is_empty() {
                String::new()
            } else {
                format!(" [{}]", sb.label)
            }
        })
        .unwrap_or_default();
    println!(
        "{dev}{label}: {} inodes ({} directories, {} files, {} symlinks, {} other), {}/{} blocks used",
        s.inodes, s.directories, s.regular_files, s.symlinks, s.special_files, s.used_blocks, s.group_area_blocks
    );
    if let Some(sb) = &r.superblock {
        println!(
            "{dev}: format version {}, sharing mode {}",
            sb.format_version(),
            sb.sharing
                .map_or("not recorded (format 1 to 3)".to_string(), |m| m
                    .to_string())
        );
    }
    let warned = if warnings > 0 {
        format!(", {warnings} warnings")
    } else {
        String::new()
    };
    let fixed = match repaired {
        Some((_, n)) if n > 0 => format!("{n} repair{} made; ", if n == 1 { "" } else { "s" }),
        _ => String::new(),
    };
    let plural = if errors == 1 { "" } else { "s" };
    match (errors, repaired) {
        (0, _) => println!(
            "{dev}: {fixed}clean{}",
            if warnings > 0 {
                format!(" ({warnings} warnings)")
            } else {
                String::new()
            }
        ),
        (_, None) => println!(
            "{dev}: {errors} error{plural} found{warned}; not repaired (fsck.cetra -p repairs what cannot lose data, -y everything it can)"
        ),
        (_, Some((Mode::Preen, _))) => println!(
            "{dev}: {fixed}{errors} error{plural} left{warned}: UNEXPECTED INCONSISTENCY; run fsck.cetra -y"
        ),
        (_, Some((Mode::All, _))) => println!(
            "{dev}: {fixed}{errors} error{plural} left{warned} that fsck.cetra cannot repair"
        ),
    }
}

/// Open read-only through the backend the device needs (`cetrafs_core::dev::open`): `SG_IO` for
/// a whole SCSI LUN (partitions and LVs are refused), `O_DIRECT` otherwise. A regular file has no
/// logical block size of its own, so it is opened with the one its superblock records (the
/// checker compares the two); files on filesystems without `O_DIRECT` (tmpfs) fall back to
/// buffered reads. No COMPARE AND WRITE probe: fsck only reads (and replays journals, which
/// are plain writes), and it refuses volumes that any node has mounted.
fn open(path: &Path) -> Result<SharedDevice, String> {
    open_for_reading(path).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_flags() {
        let c = Cli::try_parse_from(["fsck.cetra", "-n", "-f", "/dev/x"]).unwrap();
        assert!(c.no_change && c.force && !c.yes);
        let c = Cli::try_parse_from(["fsck.cetra", "-y", "/dev/x"]).unwrap();
        assert_eq!(c.mode(), Some(Mode::All));
        let c = Cli::try_parse_from(["fsck.cetra", "-a", "/dev/x"]).unwrap();
        assert!(c.preen);
        assert_eq!(c.mode(), Some(Mode::Preen));
        assert!(Cli::try_parse_from(["fsck.cetra", "-n"]).is_err());
        assert!(Cli::try_parse_from(["fsck.cetra", "-n", "-y", "/dev/x"]).is_err());
        assert!(Cli::try_parse_from(["fsck.cetra", "-p", "-y", "/dev/x"]).is_err());
    }
}
