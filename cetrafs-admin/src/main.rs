//! `cetra`: the CetraFS admin tool. Subcommands:
//!
//! * `cetra status DEVICE|MOUNTPOINT [--json] [--watch-ms N]`: the volume (UUID, label, size,
//!   free, format, sharing mode, timing), every slot in use (host, condition, generation,
//!   heartbeat age on this machine's clock, timing, watchdog bound, recoverer, journal,
//!   orphans) and what each holds (global lock, inode locks, allocation groups, open files).
//!   Read-only: works on an unmounted LUN and from any node while the volume is mounted
//!   (`cetrafs_core::status` says what it reads and how ages are measured).
//!
//! * `cetra extents FILE [--json]`: the file's extents (logical -> physical runs, unwritten
//!   flag, count), what `filefrag -v` prints on a filesystem with FIEMAP (FUSE has none). Read
//!   from the LUN after an fsync of the file, so as of this node's last change; read-only.
//! * `cetra defrag FILE [--json]`: copy a fragmented file's blocks into at most 4 contiguous
//!   runs and switch its map in one transaction (`cetrafs_core::fs` defrag), online, with a
//!   progress bar on a terminal. It opens the file for writing, so it is refused (EBUSY)
//!   while another node has it open for writing; the file's writes on this node wait.
//! * `cetra trim MOUNTPOINT [--minimum BYTES] [--json]`: discard all free space of a mounted
//!   volume now (what `fstrim` does, through the same `FITRIM` ioctl): freed space goes back
//!   to a thin LUN in the background anyway (mount option `discard`), but not what was freed
//!   under `nodiscard`, before the mount, or by a node that died with its queue.
//!
//! * `cetra grow MOUNTPOINT [--json]`: the LUN grew (on the array, or a LUN file extended):
//!   add allocation groups onto the new space, online (`cetrafs_core::fs::grow`); every node
//!   picks up the new size at its next metadata operation. A format-5 volume only, up to the
//!   size its lock area was made for (`mkfs.cetra --max-size`). Rescan the LUN on every node
//!   first (`iscsiadm -m session --rescan`, `multipathd resize map NAME`).
//!
//! * `cetra tune DEVICE [--label L] [--heartbeat-interval MS] [--io-timeout MS] [-N NODES]`:
//!   offline changes of the superblock (`cetrafs_core::tune`); `-N` adds node slots, each
//!   with a journal taken from free space (format 5). Refused while any node has the volume
//!   mounted; meanwhile it holds the offline claim (a slot named `cetra-tune:HOST`), so no node
//!   mounts until it is done.
//!
//! Exit codes: 0 done, 1 the device could not be read or is not a CetraFS volume (or the trim
//! failed), 2 usage.

use cetrafs_core::dev::open::open_for_reading;
use cetrafs_core::dev::SharedDevice;
use cetrafs_core::format::FS_BLOCK;
use cetrafs_core::status::{self, SlotStatus, VolumeStatus};
use clap::{Parser, Subcommand};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "cetra",
    version,
    about = "Inspect and operate a CetraFS volume"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Nodes, heartbeats, locks, groups and journals of a volume (read-only).
    Status {
        /// The volume's device (or LUN file), or a mountpoint of it.
        target: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Watch the heartbeats this long, ms (default: twice the longest renewal interval).
        #[arg(long, value_name = "MS")]
        watch_ms: Option<u64>,
    },
    /// A file's extents: logical -> physical runs (as filefrag -v).
    Extents {
        /// A regular file on a mounted CetraFS volume.
        file: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Copy a fragmented file into at most 4 contiguous runs (online).
    Defrag {
        /// A regular file on a mounted CetraFS volume.
        file: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Change an unmounted volume's label or heartbeat timing.
    Tune {
        /// The volume's device (or LUN file); no node may have it mounted.
        device: PathBuf,
        /// New volume label (up to 64 bytes; "" clears it).
        #[arg(short = 'L', long)]
        label: Option<String>,
        /// New heartbeat interval, ms (1 to 60000).
        #[arg(long, value_name = "MS")]
        heartbeat_interval: Option<u32>,
        /// New I/O timeout, ms (the interval to 300000).
        #[arg(long, value_name = "MS")]
        io_timeout: Option<u32>,
        /// Node slots to have: more than now, at most the heartbeat slots (64 by default); each
        /// added slot's journal is taken from free space (format 5 and later).
        #[arg(short = 'N', long = "max-nodes", value_name = "N")]
        max_nodes: Option<u32>,
    },
    /// Add the space the LUN gained to a mounted volume (online; every node follows).
    Grow {
        /// A mountpoint of the volume.
        mountpoint: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Discard all free space of a mounted volume now (as fstrim).
    Trim {
        /// A mountpoint of the volume.
        mountpoint: PathBuf,
        /// Leave free runs shorter than this many bytes alone.
        #[arg(long, value_name = "BYTES", default_value_t = 0)]
        minimum: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let usage = e.use_stderr();
            let _ = e.print();
            return ExitCode::from(if usage { 2 } else { 0 });
        }
    };
    match cli.command {
        Command::Status {
            target,
            json,
            watch_ms,
        } => match run_status(&target, json, watch_ms.map(Duration::from_millis)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("cetra status: {e}");
                ExitCode::from(1)
            }
        },
        Command::Tune {
            device,
            label,
            heartbeat_interval,
            io_timeout,
            max_nodes,
        } => {
            let t = cetrafs_core::tune::Tune {
                label,
                heartbeat_interval_ms: heartbeat_interval,
                io_timeout_ms: io_timeout,
                max_nodes,
            };
            match run_tune(&device, &t) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("cetra tune: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Defrag { file, json } => match run_defrag(&file, json) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("cetra defrag: {e}");
                ExitCode::from(1)
            }
        },
        Command::Extents { file, json } => match run_extents(&file, json) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("cetra extents: {e}");
                ExitCode::from(1)
            }
        },
        Command::Trim {
            mountpoint,
            minimum,
            json,
        } => match run_trim(&mountpoint, minimum, json) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("cetra trim: {e}");
                ExitCode::from(1)
            }
        },
        Command::Grow { mountpoint, json } => match run_grow(&mountpoint, json) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("cetra grow: {e}");
                ExitCode::from(1)
            }
        },
    }
}

nix::ioctl_read!(cetra_defrag, b'C', 0xD0, [u64; 3]);

/// The defrag progress the daemon publishes for `file` (`DEFRAG_PROGRESS_XATTR`): (done,
/// total) blocks.
fn defrag_progress(file: &std::ffi::CStr) -> Option<(u64, u64)> {
    let name = std::ffi::CString::new(cetrafs_core::fs::DEFRAG_PROGRESS_XATTR).ok()?;
    let mut buf = [0u8; 96];
    // SAFETY: valid NUL-terminated strings and a buffer of the length passed.
    let n = unsafe {
        libc::getxattr(
            file.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    let text = std::str::from_utf8(buf.get(..usize::try_from(n).ok()?)?).ok()?;
    let mut it = text.split(' ').skip(1).map(str::parse::<u64>);
    Some((it.next()?.ok()?, it.next()?.ok()?))
}

fn run_defrag(file: &Path, as_json: bool) -> Result<(), String> {
    use std::io::{IsTerminal as _, Write as _};
    use std::os::unix::ffi::OsStrExt as _;
    let real = std::fs::canonicalize(file).map_err(|e| format!("{}: {e}", file.display()))?;
    cetra_mount_of(&real)?;
    // Open for writing: the cross-node write lock keeps other nodes from writing meanwhile.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&real)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::EBUSY) {
                format!(
                    "{}: open for writing on another node; defrag it there, or once it is closed",
                    real.display()
                )
            } else {
                format!("{}: {e}", real.display())
            }
        })?;
    if !f.metadata().map_err(|e| e.to_string())?.is_file() {
        return Err(format!("{} is not a regular file", real.display()));
    }
    let started = std::time::Instant::now();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    let worker = std::thread::spawn(move || {
        let mut out = [0u64; 3];
        // SAFETY: a valid descriptor (the File outlives the thread: it is joined below) and
        // a pointer to a live u64[3].
        unsafe { cetra_defrag(fd, &raw mut out) }.map(|_| out)
    });
    let bar = std::io::stderr().is_terminal() && !as_json;
    let cpath = std::ffi::CString::new(real.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    while !worker.is_finished() {
        if bar {
            if let Some((done, total)) = defrag_progress(&cpath) {
                let pct = (done * 100).checked_div(total).unwrap_or(100);
                let filled = usize::try_from(pct / 2).unwrap_or(50);
                eprint!(
                    "\r[{:<50}] {pct:>3}% {} / {} MiB",
                    "#".repeat(filled),
                    (done * FS_BLOCK) >> 20,
                    (total * FS_BLOCK) >> 20
                );
                let _ = std::io::stderr().flush();
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    if bar {
        eprintln!();
    }
    let result = worker
        .join()
        .map_err(|_| "the defrag thread panicked".to_string())?;
    drop(f);
    let [before, after, copied] = result.map_err(|e| {
        let why = match e {
            nix::errno::Errno::ENOSPC => {
                "not enough contiguous free space (at most 4 runs) for a copy of the file"
            }
            nix::errno::Errno::EOPNOTSUPP => {
                "the volume is mounted nofilelock: other nodes could write the file during the copy"
            }
            nix::errno::Errno::EBUSY => {
                "the file changed during the defrag; its map was left as it was"
            }
            nix::errno::Errno::ENOTTY => {
                "the mounted daemon does not know defrag (an older mount.cetra?)"
            }
            _ => "",
        };
        format!(
            "{}: {e}{}{why}",
            real.display(),
            if why.is_empty() { "" } else { ": " }
        )
    })?;
    let took = started.elapsed().as_secs_f64();
    if as_json {
        let out = json!({
            "file": real.display().to_string(),
            "extents_before": before,
            "extents_after": after,
            "bytes_copied": copied * FS_BLOCK,
            "seconds": took,
        });
        println!("{out:#}");
    } else if copied == 0 {
        println!("{}: {before} extents; nothing to do", real.display());
    } else {
        println!(
            "{}: {before} extents -> {after}, {} MiB copied in {took:.1} s",
            real.display(),
            (copied * FS_BLOCK) >> 20
        );
    }
    Ok(())
}

fn run_tune(device: &Path, t: &cetrafs_core::tune::Tune) -> Result<(), String> {
    use cetrafs_core::cluster::{fsck_claim, membership};
    let shown = device.display();
    let dev = open(device)?;
    let located =
        cetrafs_core::fs::locate_superblock(&*dev).map_err(|e| format!("{shown}: {e}"))?;
    if let Some(e) = located.primary_error {
        return Err(format!(
            "{shown}: the primary superblock is damaged ({e}); run fsck.cetra -p first"
        ));
    }
    let sb = located.sb;
    let describe = |sb: &cetrafs_core::format::superblock::Superblock| {
        format!(
            "label {:?}, heartbeat every {} ms, I/O timeout {} ms, {} node slots",
            sb.label, sb.heartbeat_interval_ms, sb.io_timeout_ms, sb.max_nodes
        )
    };
    if t.is_empty() {
        println!("{shown}: {} (nothing to change)", describe(&sb));
        return Ok(());
    }
    // Refused before anything is claimed when the values are out of range.
    cetrafs_core::tune::tuned(&sb, t).map_err(|e| format!("{shown}: {e}"))?;
    let host = cetrafs_core::cluster::machine::kernel_host_name();
    // Nodes read the superblock at mount and keep it: none may have it mounted. Slots that
    // look live are watched for their dead time, as fsck does.
    let (alive, dead) = membership::find_holders(&*dev, &sb, &host, membership::Patience::Dead)
        .map_err(|e| format!("{shown}: cannot read the heartbeat area: {e}"))?;
    if !alive.is_empty() {
        let who: Vec<String> = alive.iter().map(membership::describe).collect();
        return Err(format!(
            "{shown} is mounted by {}; unmount it on every node first",
            who.join(", ")
        ));
    }
    drop(dev);
    let rw =
        cetrafs_core::dev::open::open_for_repair(device).map_err(|e| format!("{shown}: {e}"))?;
    let claim = fsck_claim::FsckClaim::take_for(fsck_claim::TUNE_PREFIX, &rw, &sb, &host, &dead)
        .map_err(|e| format!("{shown}: {e}"))?;
    // Read again under the claim: another tune may have changed it since.
    let guarded = claim.guard(rw);
    let written = cetrafs_core::fs::read_superblock(&*guarded)
        .and_then(|now| cetrafs_core::tune::apply(&*guarded, &now, t))
        .and_then(|new| cetrafs_core::tune::write_superblock(&*guarded, &new).map(|()| new));
    drop(guarded);
    let released = claim.release();
    let new = written.map_err(|e| format!("{shown}: writing the superblock: {e}"))?;
    released.map_err(|e| format!("{shown}: giving back the claim: {e}"))?;
    println!("{shown}: was {}", describe(&sb));
    println!("{shown}: now {}", describe(&new));
    Ok(())
}

/// The CetraFS mount holding `path` (canonical): the longest mountpoint that is a prefix of
/// it must be a CetraFS one. Returns (mountpoint, device).
fn cetra_mount_of(path: &Path) -> Result<(PathBuf, PathBuf), String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    let mp = info
        .lines()
        .filter_map(|line| Some(PathBuf::from(unescape(line.split(' ').nth(4)?))))
        .filter(|mp| path.starts_with(mp))
        .max_by_key(|mp| mp.components().count())
        .ok_or_else(|| format!("{}: no mount holds it", path.display()))?;
    let dev = mount_source(&info, &mp)
        .ok_or_else(|| format!("{} is not on a CetraFS mount", path.display()))?;
    Ok((mp, dev))
}

fn run_extents(file: &Path, as_json: bool) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt as _;
    let real = std::fs::canonicalize(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let (_, device) = cetra_mount_of(&real)?;
    let f = std::fs::File::open(&real).map_err(|e| format!("{}: {e}", real.display()))?;
    let meta = f
        .metadata()
        .map_err(|e| format!("{}: {e}", real.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", real.display()));
    }
    // This node's changes to the file's map reach the LUN at a commit point: make one.
    f.sync_all()
        .map_err(|e| format!("{}: fsync: {e}", real.display()))?;
    let dev = open(&device)?;
    let sb = cetrafs_core::fs::read_superblock(&*dev)
        .map_err(|e| format!("{}: {e}", device.display()))?;
    let map = cetrafs_core::inspect::file_map(&*dev, &sb, meta.ino())
        .map_err(|e| format!("{}: {e}", real.display()))?;
    if as_json {
        let extents: Vec<serde_json::Value> = map
            .extents
            .iter()
            .map(|e| {
                json!({
                    "logical": e.logical,
                    "physical": e.physical,
                    "blocks": e.len,
                    "unwritten": e.unwritten(),
                })
            })
            .collect();
        let out = json!({
            "file": real.display().to_string(),
            "device": device.display().to_string(),
            "inode": meta.ino(),
            "size": map.inode.size,
            "block_size": FS_BLOCK,
            "extent_count": map.extents.len(),
            "tree_nodes": map.tree_nodes,
            "extents": extents,
        });
        println!("{out:#}");
        return Ok(());
    }
    println!(
        "{}: inode {}, {} bytes, block size {FS_BLOCK}{}",
        real.display(),
        meta.ino(),
        map.inode.size,
        if map.tree_nodes > 0 {
            format!(", map in {} tree nodes", map.tree_nodes)
        } else {
            ", map inline".to_string()
        }
    );
    println!(
        "{:>5} {:>23} {:>23} {:>10}  flags",
        "ext", "logical", "physical", "length"
    );
    for (i, e) in map.extents.iter().enumerate() {
        let len = u64::from(e.len);
        println!(
            "{i:>5} {:>23} {:>23} {len:>10}  {}",
            format!("{}..{}", e.logical, e.logical + len - 1),
            format!("{}..{}", e.physical, e.physical + len - 1),
            if e.unwritten() { "unwritten" } else { "" }
        );
    }
    let contiguous = map
        .extents
        .windows(2)
        .filter(|w| {
            w[0].physical + u64::from(w[0].len) == w[1].physical
                && w[0].logical + u64::from(w[0].len) == w[1].logical
        })
        .count();
    println!(
        "{}: {} extent{} found{}",
        real.display(),
        map.extents.len(),
        if map.extents.len() == 1 { "" } else { "s" },
        if contiguous > 0 {
            format!(" ({contiguous} continue the one before on disk)")
        } else {
            String::new()
        }
    );
    Ok(())
}

/// `struct fstrim_range` of `<linux/fs.h>`: byte offsets; `len` comes back as bytes trimmed.
#[repr(C)]
struct FstrimRange {
    start: u64,
    len: u64,
    minlen: u64,
}

nix::ioctl_readwrite!(fitrim, b'X', 121, FstrimRange);

fn run_trim(mountpoint: &Path, minimum: u64, as_json: bool) -> Result<(), String> {
    // Only a CetraFS mountpoint: FITRIM on any other directory would trim whatever
    // filesystem holds it.
    let (real, device) = cetra_mountpoint(mountpoint)?;
    let dir = std::fs::File::open(&real).map_err(|e| format!("{}: {e}", real.display()))?;
    let mut range = FstrimRange {
        start: 0,
        len: u64::MAX,
        minlen: minimum,
    };
    let started = std::time::Instant::now();
    // SAFETY: a valid descriptor, and a pointer to a live `struct fstrim_range`.
    unsafe { fitrim(std::os::fd::AsRawFd::as_raw_fd(&dir), &raw mut range) }.map_err(|e| {
        let hint = if e == nix::errno::Errno::EPERM {
            " (trimming needs root)"
        } else {
            ""
        };
        format!("{}: FITRIM: {e}{hint}", real.display())
    })?;
    let took = started.elapsed();
    if as_json {
        let out = json!({
            "mountpoint": real.display().to_string(),
            "device": device.display().to_string(),
            "trimmed_bytes": range.len,
            "seconds": took.as_secs_f64(),
        });
        println!("{out:#}");
    } else {
        println!(
            "{}: {} trimmed in {:.1} s",
            real.display(),
            size(range.len / FS_BLOCK),
            took.as_secs_f64()
        );
    }
    Ok(())
}

nix::ioctl_read!(cetra_grow, b'C', 0xD1, [u64; 4]);

/// The CetraFS mountpoint `mountpoint` names (canonical), with its device; else an error.
fn cetra_mountpoint(mountpoint: &Path) -> Result<(PathBuf, PathBuf), String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    let real =
        std::fs::canonicalize(mountpoint).map_err(|e| format!("{}: {e}", mountpoint.display()))?;
    let device = mount_source(&info, &real)
        .ok_or_else(|| format!("{} is not a CetraFS mountpoint", mountpoint.display()))?;
    Ok((real, device))
}

fn run_grow(mountpoint: &Path, as_json: bool) -> Result<(), String> {
    let (real, device) = cetra_mountpoint(mountpoint)?;
    let dir = std::fs::File::open(&real).map_err(|e| format!("{}: {e}", real.display()))?;
    let mut out = [0u64; 4];
    // SAFETY: a valid descriptor, and a pointer to a live u64[4] the ioctl fills.
    unsafe { cetra_grow(std::os::fd::AsRawFd::as_raw_fd(&dir), &raw mut out) }.map_err(|e| {
        use nix::errno::Errno;
        let why = match e {
            Errno::EPERM => " (growing needs root)",
            Errno::EOPNOTSUPP => {
                " (the volume is format 4 or older: online grow needs a format-5 volume, made by mkfs.cetra of this release)"
            }
            Errno::ERANGE => {
                " (the LUN is not larger, by at least one allocation group, as this node sees it: grow the LUN first, then rescan it here: iscsiadm -m session --rescan; multipathd resize map NAME; a LUN file: truncate -s SIZE FILE)"
            }
            Errno::E2BIG => {
                " (the volume already has as many groups as its lock area has records for: it is at the largest size mkfs.cetra --max-size made it for)"
            }
            _ => " (the daemon's log says why)",
        };
        format!("{}: {e}{why}", real.display())
    })?;
    let [old_groups, new_groups, old_bytes, new_bytes] = out;
    if as_json {
        let j = json!({
            "mountpoint": real.display().to_string(),
            "device": device.display().to_string(),
            "groups_before": old_groups,
            "groups_after": new_groups,
            "bytes_before": old_bytes,
            "bytes_after": new_bytes,
        });
        println!("{j:#}");
    } else {
        println!(
            "{}: grew from {} to {} ({} to {} allocation groups); every node sees it at its next metadata operation",
            real.display(),
            size(old_bytes / FS_BLOCK),
            size(new_bytes / FS_BLOCK),
            old_groups,
            new_groups
        );
    }
    Ok(())
}

fn run_status(target: &Path, as_json: bool, watch: Option<Duration>) -> Result<(), String> {
    let device = device_of(target)?;
    let dev = open(&device)?;
    let st = status::gather(&dev, watch).map_err(|e| format!("{}: {e}", device.display()))?;
    let pr = Fencing::read(&device);
    if as_json {
        println!("{:#}", to_json(&device, &st, &pr));
    } else {
        print_table(&device, &st, &pr);
    }
    Ok(())
}

/// What the LUN says about persistent-reservation fencing (`fence=pr`): the registered keys
/// and the reservation holder, read with PERSISTENT RESERVE IN through `SG_IO`; None where
/// the path has no SCSI (a file LUN, a virtio disk) or does not answer.
#[derive(Debug, Default)]
struct Fencing {
    keys: Option<Vec<u64>>,
    holder: Option<u64>,
}

impl Fencing {
    fn read(device: &Path) -> Self {
        use cetrafs_core::cluster::reservation::PrPath as _;
        let opts = cetrafs_core::dev::sg::SgDeviceOptions {
            read_only: true,
            ..Default::default()
        };
        let Ok(sg) = cetrafs_core::dev::sg::SgDevice::open(device, &opts) else {
            return Self::default();
        };
        Self {
            keys: sg.read_keys().ok().map(|k| k.keys),
            holder: sg
                .read_reservation()
                .ok()
                .and_then(|r| r.holder)
                .map(|h| h.key),
        }
    }

    /// How slot `s` is fenced: `pr` when the LUN has its key (this generation) registered,
    /// else `lease` (it stops writing when its lease runs out); `+watchdog` when its host
    /// watchdog resets it too.
    fn mode_of(&self, uuid: &str, s: &SlotStatus) -> String {
        use cetrafs_core::scsi::pr;
        let prefix = uuid
            .get(..8)
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .unwrap_or(0);
        let key = pr::pr_key(prefix, s.slot, s.generation);
        let base = if self.keys.as_ref().is_some_and(|k| k.contains(&key)) {
            "pr"
        } else {
            "lease"
        };
        if s.watchdog_ms > 0 {
            format!("{base}+watchdog")
        } else {
            base.to_string()
        }
    }

    /// The slot holding the LUN's reservation, if a CetraFS key of this volume does.
    fn holder_slot(&self, uuid: &str) -> Option<u32> {
        let prefix = u32::from_str_radix(uuid.get(..8)?, 16).ok()?;
        cetrafs_core::scsi::pr::key_slot(self.holder?, prefix).flatten()
    }
}

/// The device behind `target`: itself, unless it is a CetraFS mountpoint, whose source (the
/// FUSE fsname mount.cetra sets) `/proc/self/mountinfo` gives. The mountpoint is looked up
/// before anything stats it: a stat of a hung node's mountpoint would hang `cetra` with it.
fn device_of(target: &Path) -> Result<PathBuf, String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    let cwd = std::env::current_dir().map_err(|e| format!("current directory: {e}"))?;
    let lexical: PathBuf = cwd.join(target).components().collect();
    if let Some(dev) = mount_source(&info, &lexical) {
        return Ok(dev);
    }
    let meta = std::fs::metadata(target).map_err(|e| format!("{}: {e}", target.display()))?;
    if !meta.is_dir() {
        return Ok(target.to_path_buf());
    }
    let real = std::fs::canonicalize(target).map_err(|e| format!("{}: {e}", target.display()))?;
    mount_source(&info, &real).ok_or_else(|| {
        format!(
            "{} is a directory but not a CetraFS mountpoint; give the device instead",
            target.display()
        )
    })
}

/// The source of the CetraFS mount (`fuse.cetra`) at `mountpoint` in a mountinfo text (the
/// last one mounted there wins, as the kernel resolves it).
fn mount_source(info: &str, mountpoint: &Path) -> Option<PathBuf> {
    let want = mountpoint.as_os_str().to_string_lossy();
    let (fstype, source) = info.lines().rev().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mp = left.split(' ').nth(4)?;
        let mut r = right.split(' ');
        (unescape(mp) == want).then_some((r.next()?, r.next()?))
    })?;
    (fstype == "fuse.cetra").then(|| PathBuf::from(unescape(source)))
}

/// mountinfo escapes space, tab, newline and backslash as \ooo.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match oct {
            Some(d) if b[i] == b'\\' => {
                let v = d.iter().fold(0u32, |a, c| a * 8 + u32::from(c - b'0'));
                out.push(u8::try_from(v).unwrap_or(b'?'));
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Read-only, as fsck.cetra reads (`open_for_reading`).
fn open(path: &Path) -> Result<SharedDevice, String> {
    open_for_reading(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn slot_json(s: &SlotStatus) -> serde_json::Value {
    let l = &s.locks;
    json!({
        "slot": s.slot,
        "condition": s.condition.name(),
        "host": s.host,
        "pid": s.pid,
        "generation": s.generation,
        "heartbeat_age_ms": s.heartbeat_age.map(ms),
        "heartbeat_interval_ms": s.interval_ms,
        "io_timeout_ms": s.io_timeout_ms,
        "dead_time_ms": ms(s.dead_time),
        "watchdog_ms": s.watchdog_ms,
        "recoverer": s.recoverer.map(|(slot, generation)| json!({"slot": slot, "generation": generation})),
        "journal_pending": s.journal_pending,
        "orphans": s.orphans,
        "locks": {
            "global": l.global,
            "global_waiting": l.global_waiting,
            "inodes_exclusive": l.objects_exclusive,
            "inodes_shared": l.objects_shared,
            "inodes_waiting": l.objects_waiting,
            "groups_owned": l.groups_owned,
            "groups_owned_free_blocks": l.groups_owned_free,
            "files_open": l.files_open,
            "files_open_writing": l.files_open_writing,
        },
    })
}

fn to_json(device: &Path, st: &VolumeStatus, pr: &Fencing) -> serde_json::Value {
    let slots: Vec<serde_json::Value> = st
        .slots
        .iter()
        .map(|s| {
            let mut j = slot_json(s);
            j["fence"] = json!(pr.mode_of(&st.uuid, s));
            j
        })
        .collect();
    json!({
        "device": device.display().to_string(),
        "uuid": st.uuid,
        "label": st.label,
        "format_version": st.format_version,
        "sharing": st.sharing,
        "block_size": FS_BLOCK,
        "total_blocks": st.total_blocks,
        "free_blocks": st.free_blocks,
        "max_nodes": st.max_nodes,
        "heartbeat_interval_ms": st.heartbeat_interval_ms,
        "io_timeout_ms": st.io_timeout_ms,
        "watched_ms": ms(st.watched),
        "global_lock": {"mode": st.global_mode, "version": st.global_version},
        "persistent_reservations": pr.keys.as_ref().map(|k| json!({
            "keys": k.len(),
            "reserved_by_slot": pr.holder_slot(&st.uuid),
        })),
        "slots": slots,
        "groups": st.groups.iter().map(|g| json!({"group": g.group, "owner": g.owner, "free_blocks": g.free_blocks})).collect::<Vec<_>>(),
    })
}

fn size(blocks: u64) -> String {
    let bytes = blocks.saturating_mul(FS_BLOCK);
    #[expect(clippy::cast_precision_loss, reason = "a size for people")]
    let gib = bytes as f64 / f64::from(1u32 << 30);
    format!("{gib:.1} GiB")
}

fn print_table(device: &Path, st: &VolumeStatus, pr: &Fencing) {
    let label = if st.label.is_empty() {
        String::new()
    } else {
        format!(" [{}]", st.label)
    };
    println!(
        "{}{label}: CetraFS {}, format {}, sharing {}",
        device.display(),
        st.uuid,
        st.format_version,
        st.sharing.as_deref().unwrap_or("not recorded")
    );
    println!(
        "size {}, free {}; {} node slots; heartbeat every {} ms, I/O timeout {} ms; heartbeats watched for {} ms",
        size(st.total_blocks),
        size(st.free_blocks),
        st.max_nodes,
        st.heartbeat_interval_ms,
        st.io_timeout_ms,
        ms(st.watched)
    );
    println!(
        "global lock: {} (version {}); persistent reservations: {}",
        st.global_mode,
        st.global_version,
        match (&pr.keys, pr.holder_slot(&st.uuid)) {
            (None, _) => "none on this path (fencing by lease and watchdog)".to_string(),
            (Some(k), Some(s)) => format!("{} keys, reserved by slot {s}", k.len()),
            (Some(k), None) => format!("{} keys, not reserved by this volume", k.len()),
        }
    );
    if st.slots.is_empty() {
        println!("no node has ever mounted the volume");
        return;
    }
    println!(
        "{:<4} {:<16} {:<10} {:>4} {:>9} {:>9} {:>9} {:<14} {:<9} {:>17} {:>14} {:>9} {:<8} {:>7}",
        "slot",
        "host",
        "condition",
        "gen",
        "age",
        "dead time",
        "watchdog",
        "fence",
        "global",
        "inodes ex/sh/wait",
        "groups (free)",
        "open (w)",
        "journal",
        "orphans"
    );
    for s in &st.slots {
        let l = &s.locks;
        let age = s.heartbeat_age.map_or_else(
            || format!(">{:.1}s", st.watched.as_secs_f64()),
            |a| format!("{:.1}s", a.as_secs_f64()),
        );
        let mut cond = s.condition.name().to_string();
        if let Some((r, _)) = s.recoverer {
            cond = format!("{cond} by {r}");
        }
        let global = match (l.global, l.global_waiting) {
            (Some(m), _) => m,
            (None, true) => "waiting",
            (None, false) => "-",
        };
        println!(
            "{:<4} {:<16} {:<10} {:>4} {:>9} {:>8.1}s {:>9} {:<14} {:<9} {:>17} {:>14} {:>9} {:<8} {:>7}",
            s.slot,
            s.host,
            cond,
            s.generation,
            age,
            s.dead_time.as_secs_f64(),
            if s.watchdog_ms == 0 {
                "none".to_string()
            } else {
                format!("{} ms", s.watchdog_ms)
            },
            pr.mode_of(&st.uuid, s),
            global,
            format!(
                "{}/{}/{}",
                l.objects_exclusive, l.objects_shared, l.objects_waiting
            ),
            format!("{} ({})", l.groups_owned, size(l.groups_owned_free)),
            format!("{} ({})", l.files_open, l.files_open_writing),
            if s.journal_pending {
                "pending"
            } else {
                "empty"
            },
            s.orphans
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mountpoint_resolves_to_its_fuse_source() {
        let info = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
90 22 0:50 / /mnt/cetra rw,nosuid,nodev shared:40 - fuse.cetra /dev/mapper/mpatha rw,user_id=0
91 22 0:51 / /mnt/with\\040space rw shared:41 - fuse.cetra /srv/lun\\040a.img rw,user_id=0
92 22 0:52 / /mnt/sshfs rw shared:42 - fuse.sshfs host:/srv rw,user_id=0
";
        assert_eq!(
            mount_source(info, Path::new("/mnt/cetra")),
            Some(PathBuf::from("/dev/mapper/mpatha"))
        );
        assert_eq!(
            mount_source(info, Path::new("/mnt/with space")),
            Some(PathBuf::from("/srv/lun a.img"))
        );
        assert_eq!(mount_source(info, Path::new("/")), None, "not a FUSE mount");
        assert_eq!(
            mount_source(info, Path::new("/mnt/sshfs")),
            None,
            "not CetraFS"
        );
        assert_eq!(mount_source(info, Path::new("/mnt/other")), None);
    }
}
