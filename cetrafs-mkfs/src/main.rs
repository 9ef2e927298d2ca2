//! `mkfs.cetra`: create a CetraFS volume on a shared LUN (or a regular file for testing).
//!
//! Exit codes: 0 success, 1 usage error or refusal (existing data without `--force`, device
//! too small, bad option values, a partition/LV, a SCSI LUN without working COMPARE AND WRITE),
//! 8 operational error (I/O, device cannot be opened).

use anyhow::anyhow;
use cetrafs_core::dev::open::{open_lun, LunKind, LunOptions, Sharing};
use cetrafs_core::dev::sg::SgDeviceOptions;
use cetrafs_core::dev::BlockDevice;
use cetrafs_core::format::superblock::{SharingMode, Superblock};
use cetrafs_core::format::FS_BLOCK;
use cetrafs_core::mkfs::{self, GroupRules, MkfsOptions};
use cetrafs_core::{probe, ErrorKind};
use clap::Parser;
use std::io::IsTerminal;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

const EXIT_USAGE: u8 = 1;
const EXIT_OPERATIONAL: u8 = 8;

#[derive(Debug, Parser)]
#[command(
    name = "mkfs.cetra",
    version,
    about = "Create a CetraFS shared-disk filesystem"
)]
struct Cli {
    /// Volume label (up to 64 bytes).
    #[arg(short = 'L', long = "label", default_value = "")]
    label: String,
    /// Most nodes that can mount at once (one journal each).
    #[arg(short = 'N', long = "max-nodes", default_value_t = mkfs::DEFAULT_MAX_NODES)]
    max_nodes: u32,
    /// Journal size per node (K/M/G suffixes).
    #[arg(long = "journal-size", value_parser = parse_size, default_value = "64M")]
    journal_size: u64,
    /// Allocation group size (K/M/G suffixes; default: up to 1G, at least 8 groups).
    #[arg(long = "group-size", value_parser = parse_size)]
    group_size: Option<u64>,
    /// Heartbeat renewal interval in milliseconds.
    #[arg(long = "heartbeat-interval", value_name = "MS", default_value_t = mkfs::DEFAULT_HEARTBEAT_INTERVAL_MS)]
    heartbeat_interval: u32,
    /// Deadline for one I/O in milliseconds; a node that cannot write its heartbeat within it
    /// is considered dead.
    #[arg(long = "io-timeout", value_name = "MS", default_value_t = mkfs::DEFAULT_IO_TIMEOUT_MS)]
    io_timeout: u32,
    /// Logical block size to use for a regular file (block devices report their own).
    #[arg(long = "logical-block-size", value_parser = ["512", "4096"])]
    logical_block_size: Option<String>,
    /// On-disk format version: 8 (default) also lets a node whose own allocation groups are
    /// full claim a free one without the global lock (group claims); 7 lets a node refill its
    /// block pool from its own allocation groups without the global lock (group marks) and
    /// stays mountable by version-7 binaries; 5 can grow online (`cetra
    /// grow`) and stays mountable by version-5 binaries; 4 records the
    /// sharing mode (single-host or multi-node, from the COMPARE AND WRITE probe) and enforces
    /// it at mount; 3 has per-object locks and stays mountable by version-3 binaries; 2 has the
    /// global lock only. Each version has everything of the versions below it.
    #[arg(long = "format-version", value_name = "N", value_parser = ["2", "3", "4", "5", "7", "8"], default_value = "8")]
    format_version: String,
    /// Format 5: the largest size `cetra grow` can take the volume to (K/M/G/T suffixes;
    /// default: 16 times the device, at most 64T). Costs one logical block of lock area per
    /// allocation group.
    #[arg(long = "max-size", value_parser = parse_size)]
    max_size: Option<u64>,
    /// Overwrite existing filesystems, partition tables or volume labels.
    #[arg(short = 'f', long)]
    force: bool,
    /// Print nothing but errors.
    #[arg(short, long)]
    quiet: bool,
    /// Block device (or regular file) to format.
    device: PathBuf,
}

/// "64M" → 67108864. Suffixes are binary (K = 1024); "B"/"iB" after the suffix is accepted.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => {
                    return Err(format!(
                        "unknown size suffix {c:?} in {s:?} (use K, M, G or T)"
                    ))
                }
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 512M, 4G)"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

#[expect(clippy::cast_precision_loss, reason = "a size shown to one decimal")]
fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// An error with the exit code it should produce.
struct Failure {
    code: u8,
    err: anyhow::Error,
}

fn usage(err: anyhow::Error) -> Failure {
    Failure {
        code: EXIT_USAGE,
        err,
    }
}

fn operational(err: anyhow::Error) -> Failure {
    Failure {
        code: EXIT_OPERATIONAL,
        err,
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("mkfs.cetra: {:#}", f.err);
            ExitCode::from(f.code)
        }
    }
}

fn validate(cli: &Cli) -> Result<MkfsOptions, Failure> {
    if cli.journal_size < (1 << 20) || !cli.journal_size.is_multiple_of(FS_BLOCK) {
        return Err(usage(anyhow!(
            "--journal-size must be at least 1M and a multiple of 4K"
        )));
    }
    if let Some(g) = cli.group_size {
        let min = mkfs::MIN_GROUP_BLOCKS * FS_BLOCK;
        if g < min || !g.is_multiple_of(FS_BLOCK) {
            return Err(usage(anyhow!(
                "--group-size must be at least {} and a multiple of 4K",
                human(min)
            )));
        }
    }
    Ok(MkfsOptions {
        label: cli.label.clone(),
        max_nodes: cli.max_nodes,
        journal_bytes: cli.journal_size,
        group_bytes: cli.group_size,
        heartbeat_interval_ms: cli.heartbeat_interval,
        io_timeout_ms: cli.io_timeout,
        object_locks: cli.format_version != "2",
        // Format 4: replaced by what the probe finds, before anything is written (`run`).
        sharing: matches!(cli.format_version.as_str(), "4" | "5" | "7" | "8")
            .then_some(SharingMode::SingleHost),
        growable: matches!(cli.format_version.as_str(), "5" | "7" | "8"),
        group_rules: match cli.format_version.as_str() {
            "8" => GroupRules::Claims,
            "7" => GroupRules::Marks,
            _ => GroupRules::GlobalLock,
        },
        max_bytes: cli.max_size,
        ..MkfsOptions::default()
    })
}

fn run(cli: &Cli) -> Result<(), Failure> {
    let mut opts = validate(cli)?;
    let path = &cli.device;
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| {
        let f = if e.kind() == std::io::ErrorKind::NotFound {
            usage
        } else {
            operational
        };
        f(anyhow!("cannot access {shown}: {e}"))
    })?;
    let is_file = meta.file_type().is_file();
    let is_block = meta.file_type().is_block_device();
    let lbs = match (&cli.logical_block_size, is_file) {
        (Some(_), false) => {
            return Err(usage(anyhow!(
                "--logical-block-size applies to regular files only; {shown} reports its own"
            )))
        }
        (Some(s), true) => s
            .parse()
            .map_err(|_| usage(anyhow!("bad logical block size {s}")))?,
        (None, _) => 512,
    };
    // Claim a block device exclusively: fails with EBUSY while it is mounted or held by
    // device-mapper/md, and keeps other O_EXCL openers (mkfs, mount) out while we write.
    let _exclusive = if is_block {
        Some(
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_EXCL)
                .open(path)
                .map_err(|e| {
                    if e.raw_os_error() == Some(libc::EBUSY) {
                        usage(anyhow!("{shown} is in use (mounted, or held by LVM/md/multipath); refusing to format it"))
                    } else {
                        operational(anyhow!("cannot open {shown}: {e}"))
                    }
                })?,
        )
    } else {
        None
    };
    let lun = open_lun(
        path,
        &LunOptions {
            file_logical_block_size: Some(lbs),
            buffered_file_fallback: true,
            // the probe's COMPARE AND WRITE gets the volume's I/O deadline
            sg: SgDeviceOptions {
                io_timeout: Duration::from_millis(u64::from(opts.io_timeout_ms.max(1))),
                ..SgDeviceOptions::default()
            },
            ..LunOptions::default()
        },
    )
    .map_err(|e| match e.kind() {
        // partitions, LVs, other dm devices, character devices that are not sg nodes
        ErrorKind::InvalidInput | ErrorKind::Unsupported => usage(anyhow!("{e}")),
        _ => operational(anyhow!("{e}")),
    })?;
    let dev = &*lun.dev;
    let geo = dev.geometry().clone();
    // Plan first: a bad option or a too-small device is reported before anything is read.
    let planned =
        mkfs::plan(geo.size_bytes, geo.logical_block_size, &opts).map_err(|e| match e.kind() {
            ErrorKind::InvalidInput | ErrorKind::NoSpace => usage(anyhow!("{shown}: {e}")),
            _ => operational(anyhow!("{shown}: {e}")),
        })?;
    let found =
        probe::probe_device(dev).map_err(|e| operational(anyhow!("cannot read {shown}: {e}")))?;
    if !found.is_empty() {
        let list = found.iter().map(ToString::to_string).collect::<Vec<_>>();
        if !cli.force {
            return Err(usage(anyhow!(
                "{shown} contains {}; use --force to overwrite it",
                list.join(" and ")
            )));
        }
        if !cli.quiet {
            for f in &list {
                eprintln!("mkfs.cetra: overwriting {f} on {shown}");
            }
        }
    }
    // Before anything is written: a SCSI LUN must execute COMPARE AND WRITE correctly, tried
    // on the block the superblock reserves for that probe (its content is restored).
    let sharing = lun.check_sharing(planned.probe_block).map_err(|e| {
        let f = if e.kind() == ErrorKind::Unsupported {
            usage
        } else {
            operational
        };
        f(anyhow!("refusing to format {shown}: {e}"))
    })?;
    if opts.sharing.is_some() {
        opts.sharing = Some(sharing.mode());
    }
    if !cli.quiet && !lun.kind.is_scsi() {
        eprintln!(
            "mkfs.cetra: {shown} is a {}: the volume will be single-host (no SCSI COMPARE AND WRITE){}",
            lun.kind,
            if opts.sharing.is_some() {
                "; a mount from a second machine is refused"
            } else {
                ""
            }
        );
    }
    let sb = format_with_progress(dev, &opts, cli.quiet)
        .map_err(|e| operational(anyhow!("formatting {shown} failed: {e}")))?;
    if !cli.quiet {
        print_summary(&shown.to_string(), &sb, geo.size_bytes, &lun.kind, &sharing);
    }
    Ok(())
}

fn format_with_progress(
    dev: &dyn BlockDevice,
    opts: &MkfsOptions,
    quiet: bool,
) -> cetrafs_core::Result<Superblock> {
    if quiet || !std::io::stderr().is_terminal() {
        return mkfs::format(dev, opts, &mut |_, _| {});
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message("writing metadata");
    let r = mkfs::format(dev, opts, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    r
}

fn print_summary(dev: &str, sb: &Superblock, size: u64, kind: &LunKind, sharing: &Sharing) {
    let fs_bytes = sb.total_blocks * FS_BLOCK;
    println!("Created CetraFS on {dev}");
    println!("  device:             {kind}");
    println!(
        "  size:               {} ({} blocks of 4096 bytes{})",
        human(fs_bytes),
        sb.total_blocks,
        if fs_bytes < size {
            format!("; {} bytes at the end unused", size - fs_bytes)
        } else {
            String::new()
        }
    );
    println!("  format version:     {}", sb.format_version());
    println!("  logical block size: {}", sb.logical_block_size);
    println!(
        "  node slots:         {} journals, {} heartbeat slots",
        sb.max_nodes, sb.hb_slots
    );
    println!(
        "  journal size:       {} per node",
        human(sb.journal_blocks * FS_BLOCK)
    );
    println!(
        "  groups:             {} x {}",
        sb.group_count,
        human(sb.group_blocks * FS_BLOCK)
    );
    println!(
        "  lock records:       {} ({} inode lock slots)",
        sb.lock_count, sb.inode_lock_slots
    );
    if sb.can_grow() {
        println!(
            "  can grow to:        {} ({} groups; cetra grow)",
            human(
                sb.group_start
                    .saturating_add(sb.group_capacity().saturating_mul(sb.group_blocks))
                    .saturating_add(1)
                    .saturating_mul(FS_BLOCK)
            ),
            sb.group_capacity()
        );
    }
    if let Some(a) = sb.object_lock_area() {
        println!(
            "  object locks:       {} buckets ({}), {} mailboxes",
            a.buckets,
            human(sb.objlock_blocks() * FS_BLOCK),
            a.mailboxes
        );
    }
    println!(
        "  heartbeat:          every {} ms, I/O timeout {} ms",
        sb.heartbeat_interval_ms, sb.io_timeout_ms
    );
    println!("  UUID:               {}", sb.uuid_string());
    println!(
        "  label:              {}",
        if sb.label.is_empty() {
            "(none)"
        } else {
            &sb.label
        }
    );
    match sb.sharing {
        Some(mode) => println!("  sharing:            {sharing}; recorded: {mode}"),
        None => println!(
            "  sharing:            {sharing}; not recorded (format {} does not; a second machine is not refused)",
            sb.format_version()
        ),
    }
    if let Sharing::MultiNode { probe } = sharing {
        println!(
            "  COMPARE AND WRITE:  {} us (probe){}",
            probe.latency.as_micros(),
            probe
                .vpd_max_compare_and_write
                .map_or(String::new(), |n| format!(
                    ", VPD 0xB0 maximum {n} block(s)"
                ))
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn cli_parses() {
        let c = Cli::try_parse_from([
            "mkfs.cetra",
            "-L",
            "x",
            "-N",
            "4",
            "--journal-size",
            "8M",
            "-f",
            "/dev/null",
        ])
        .unwrap();
        assert_eq!((c.max_nodes, c.journal_size, c.force), (4, 8 << 20, true));
        assert!(Cli::try_parse_from(["mkfs.cetra", "--logical-block-size", "1024", "x"]).is_err());
    }

    #[test]
    fn files_are_single_host() {
        let f = std::env::temp_dir().join(format!("mkfs-cetra-test-{}", std::process::id()));
        std::fs::write(&f, vec![0u8; 1 << 20]).unwrap();
        let lun = open_lun(
            &f,
            &LunOptions {
                buffered_file_fallback: true,
                ..LunOptions::default()
            },
        )
        .unwrap();
        assert_eq!(
            lun.check_sharing(1).unwrap().to_string(),
            "single-host (regular file: COMPARE AND WRITE is emulated with locks of this host only)"
        );
        std::fs::remove_file(f).unwrap();
    }
}
