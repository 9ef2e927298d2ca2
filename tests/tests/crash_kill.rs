//! Crash consistency through the real FUSE mount: the daemon is SIGKILLed at a random moment
//! of a metadata + data storm, the volume is checked by fsck, remounted (journal replay) and
//! every byte of every file is validated against what the storm could have written.
//!
//! * The LUN is filled with a marker (`STALE!!\x01` repeated) before mkfs, so a block that
//!   reaches a file without having been written by that file is recognisable.
//! * Every byte any thread writes is a pattern of (key, offset); a regular file's key is its
//!   inode number. After the crash each byte of a file must be 0 or its own pattern byte:
//!   the marker is stale data, another inode's pattern is foreign data.
//! * Durable files (`D/`): recorded only after `fsync`/`fdatasync` of the file and `fsync` of
//!   `D/` returned (or, for the `O_SYNC` variant, after each `O_SYNC` write returned); their
//!   content must survive exactly. Deleting one first moves it to a "maybe deleted" set; once
//!   unlink and `fsync(D/)` returned the name must stay gone.
//! * A preallocated 64 MiB image (`I/disk.raw`) gets `O_DIRECT` 4 KiB writes of per-(block,
//!   version) patterns with periodic fdatasync: after the crash each block must hold its last
//!   synced version (zeros if none) or a version written after that sync — nothing else.
//! * Scratch namespace (`S/`): create/write/rename/unlink/link/symlink/mkdir/rmdir/truncate/
//!   fallocate/setxattr from several threads; only the byte invariant and the xattr invariant
//!   (values name their inode) are checked.
//!
//! Rounds: `CETRA_KILL_ROUNDS` (default 24). Seed: `CETRA_SEED`.

use cetrafs_tests::{
    cstr, errno_name, errno_of, list_xattrs, lstat, mount_fstype, require_fuse, secs, seed,
    AlignedBuf, Lun, Mount,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const LUN_SIZE: u64 = 1 << 30;
const MARKER: [u8; 8] = *b"STALE!!\x01";
const BLK: usize = 4096;
const IMAGE_SIZE: u64 = 64 << 20;
#[allow(clippy::cast_possible_truncation)] // a constant: 64 MiB / 4 KiB
const IMAGE_BLOCKS: usize = (IMAGE_SIZE / BLK as u64) as usize;
/// Blocks 0..HOT of the image get half of the writes, so blocks are overwritten between syncs.
const IMAGE_HOT: usize = 256;
const SCRATCH_DIRS: usize = 4;
const SCRATCH_NAMES: usize = 12;
const SCRATCH_THREADS: usize = 3;
/// Scratch writes, truncates and fallocates stay below this file offset.
const SCRATCH_SPAN: u64 = 768 << 10;
const HOST: &str = "killnode";
/// Violations listed in a failure message (all are counted).
const SHOW: usize = 40;

// ---------------------------------------------------------------------------------------------
// Patterns

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fill `buf` with the pattern of `key` for file offsets `off..off + buf.len()`.
fn fill(key: u64, off: u64, buf: &mut [u8]) {
    let k = mix(key);
    let mut i = 0;
    while i < buf.len() {
        let o = off + i as u64;
        let w = mix(k ^ (o >> 3)).to_le_bytes();
        let s = (o & 7) as usize;
        let n = (8 - s).min(buf.len() - i);
        buf[i..i + n].copy_from_slice(&w[s..s + n]);
        i += n;
    }
}

fn pattern(key: u64, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(key, off, &mut v);
    v
}

/// Key of version `v` of image block `b` (offsets within the block are 0..4096).
fn image_key(b: usize, v: u32) -> u64 {
    (1u64 << 63) | ((b as u64) << 24) | u64::from(v)
}

/// First byte of `data` (file offset `off`) that is neither 0 nor `key`'s pattern byte.
fn first_bad(key: u64, off: u64, data: &[u8]) -> Option<usize> {
    let mut exp = vec![0u8; data.len().min(1 << 20)];
    let mut base = 0;
    while base < data.len() {
        let n = exp.len().min(data.len() - base);
        fill(key, off + base as u64, &mut exp[..n]);
        if let Some(i) = data[base..base + n]
            .iter()
            .zip(&exp[..n])
            .position(|(d, e)| *d != 0 && d != e)
        {
            return Some(base + i);
        }
        base += n;
    }
    None
}

/// What a wrong byte range looks like: the LUN marker, another inode's pattern, or unknown.
fn diagnose(off: u64, data: &[u8], known_inos: &HashSet<u64>) -> String {
    let n = data.len().min(64);
    let d = &data[..n];
    let marker = d
        .iter()
        .enumerate()
        .filter(|(i, b)| **b == MARKER[((off + *i as u64) % 8) as usize])
        .count();
    let mut what = if marker * 4 >= n * 3 {
        "STALE (LUN marker: never-written block exposed)".to_string()
    } else {
        "unknown bytes".to_string()
    };
    for &ino in known_inos {
        let p = pattern(ino, off, n);
        let m = d.iter().zip(&p).filter(|(a, b)| a == b).count();
        if m * 4 >= n * 3 {
            what = format!("FOREIGN (pattern of inode {ino})");
            break;
        }
    }
    format!("{what}; bytes {:02x?}", &d[..n.min(24)])
}

// ---------------------------------------------------------------------------------------------
// Models

#[derive(Debug, Clone)]
struct DFile {
    ino: u64,
    /// Final size once complete; None while `O_SYNC` writes are still being added.
    exact_len: Option<u64>,
    /// Ranges whose content must be exactly the pattern.
    ranges: Vec<(u64, u64)>,
    variant: &'static str,
    round: usize,
}

#[derive(Debug, Default)]
struct Durable {
    live: BTreeMap<String, DFile>,
    /// Unlink issued but not known durable: may exist (then intact) or not.
    maybe_deleted: BTreeMap<String, DFile>,
    /// Unlink and fsync of the directory returned: must not exist.
    deleted: BTreeSet<String>,
    created: u64,
}

#[derive(Debug)]
struct Image {
    ino: u64,
    /// Last synced version per block (0 = never written: zeros).
    durable: Vec<u32>,
    /// Versions written since that sync (possibly durable, possibly not).
    since: Vec<Vec<u32>>,
    next: Vec<u32>,
}

#[derive(Debug, Default)]
struct Stats {
    ops: AtomicU64,
    scratch_ops: AtomicU64,
    durable_syncs: AtomicU64,
    image_writes: AtomicU64,
    image_syncs: AtomicU64,
}

/// Flags shared by the storm threads of one round.
#[derive(Debug, Default)]
struct Round {
    stop: AtomicBool,
    /// Set just before SIGKILL: errors seen after this are expected.
    killed: AtomicBool,
    violations: Mutex<Vec<String>>,
}

impl Round {
    fn violation(&self, s: String) {
        self.violations.lock().expect("violations lock").push(s);
    }
    /// An I/O error in a storm thread: fine once the daemon is being killed, a violation before.
    fn io_error(&self, what: &str, e: &io::Error) {
        if !self.killed.load(Ordering::SeqCst) {
            self.violation(format!(
                "before the kill: {what}: {e} ({})",
                errno_name(errno_of(e))
            ));
        }
    }
    fn going(&self) -> bool {
        !self.stop.load(Ordering::SeqCst)
    }
}

// ---------------------------------------------------------------------------------------------
// Small syscall helpers

fn fsync_dir(p: &Path) -> io::Result<()> {
    fs::File::open(p)?.sync_all()
}

fn fallocate(f: &fs::File, mode: libc::c_int, off: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on an open fd; no pointers.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            mode,
            i64::try_from(off).expect("offset"),
            i64::try_from(len).expect("length"),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn fsetxattr(f: &fs::File, name: &str, value: &[u8]) -> io::Result<()> {
    let n = std::ffi::CString::new(name).expect("xattr name");
    // SAFETY: valid fd, C string and value buffer.
    let r = unsafe {
        libc::fsetxattr(
            f.as_raw_fd(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn fremovexattr(f: &fs::File, name: &str) -> io::Result<()> {
    let n = std::ffi::CString::new(name).expect("xattr name");
    // SAFETY: valid fd and C string.
    let r = unsafe { libc::fremovexattr(f.as_raw_fd(), n.as_ptr()) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn truncate_path(p: &Path, len: u64) -> io::Result<()> {
    let c = cstr(p);
    // SAFETY: valid C string.
    let r = unsafe { libc::truncate(c.as_ptr(), i64::try_from(len).expect("length")) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Errnos the scratch storm provokes on purpose (races between threads, wrong file types).
fn expected_scratch_errno(e: i32) -> bool {
    [
        libc::ENOENT,
        libc::EEXIST,
        libc::ENOTEMPTY,
        libc::EISDIR,
        libc::ENOTDIR,
        libc::EINVAL,
        libc::ELOOP,
        libc::EMLINK,
        libc::ENODATA,
        libc::EPERM,
        libc::EXDEV,
    ]
    .contains(&e)
}

// ---------------------------------------------------------------------------------------------
// Storm threads

fn scratch_path(rng: &mut StdRng, mp: &Path) -> PathBuf {
    let mut p = mp
        .join("S")
        .join(format!("d{}", rng.gen_range(0..SCRATCH_DIRS)))
        .join(format!("x{}", rng.gen_range(0..SCRATCH_NAMES)));
    if rng.gen_ratio(1, 4) {
        p = p.join(format!("x{}", rng.gen_range(0..4)));
    }
    p
}

fn open_nofollow(p: &Path, write: bool, create: bool) -> io::Result<fs::File> {
    fs::OpenOptions::new()
        .read(true)
        .write(write)
        .create(create)
        .custom_flags(libc::O_NOFOLLOW)
        .open(p)
}

fn scratch_op(rng: &mut StdRng, mp: &Path, rd: &Round) -> Option<io::Error> {
    let p = scratch_path(rng, mp);
    let k = rng.gen_range(0..100);
    let op = match k {
        0..=29 => "write",
        30..=34 => "read",
        35..=42 => "truncate",
        43..=50 => "fallocate",
        51..=60 => "rename",
        61..=68 => "unlink",
        69..=73 => "link",
        74..=77 => "symlink",
        78..=83 => "mkdir",
        84..=88 => "rmdir",
        89..=95 => "setxattr",
        96..=97 => "removexattr",
        _ => "fsync",
    };
    let r: io::Result<()> = (|| match k {
        // write (creating the file if needed); the pattern is keyed by the inode number
        0..=29 => {
            let f = open_nofollow(&p, true, true)?;
            let ino = f.metadata()?.ino();
            let off = if rng.gen_bool(0.5) {
                rng.gen_range(0..SCRATCH_SPAN / 4096) * 4096
            } else {
                rng.gen_range(0..SCRATCH_SPAN)
            };
            let len = match rng.gen_range(0..4) {
                0 => rng.gen_range(1..=600),
                1 => 4096 * rng.gen_range(1..=16),
                _ => rng.gen_range(1..=64 << 10),
            }
            .min(SCRATCH_SPAN - off)
            .max(1);
            let buf = pattern(ino, off, usize::try_from(len).expect("len"));
            f.write_all_at(&buf, off)?;
            if rng.gen_ratio(1, 16) {
                f.sync_all()?;
            }
            Ok(())
        }
        // read back while the daemon is alive: 0 or own pattern
        30..=34 => {
            let f = open_nofollow(&p, false, false)?;
            let md = f.metadata()?;
            if !md.is_file() {
                return Ok(());
            }
            let mut data = vec![0u8; usize::try_from(md.len()).expect("size")];
            let n = f.read_at(&mut data, 0)?;
            data.truncate(n);
            if let Some(i) = first_bad(md.ino(), 0, &data) {
                rd.violation(format!(
                    "live read of {} (inode {}) at offset {i}: {}",
                    p.display(),
                    md.ino(),
                    diagnose(i as u64, &data[i..], &HashSet::new())
                ));
            }
            Ok(())
        }
        35..=42 => truncate_path(&p, rng.gen_range(0..SCRATCH_SPAN)),
        43..=50 => {
            let f = open_nofollow(&p, true, false)?;
            let off = rng.gen_range(0..SCRATCH_SPAN);
            let len = rng.gen_range(1..=(SCRATCH_SPAN - off).min(256 << 10));
            let mode = [
                0,
                libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_ZERO_RANGE,
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
            ][rng.gen_range(0..5)];
            fallocate(&f, mode, off, len)
        }
        51..=60 => fs::rename(&p, scratch_path(rng, mp)),
        61..=68 => fs::remove_file(&p),
        69..=73 => fs::hard_link(&p, scratch_path(rng, mp)),
        74..=77 => {
            std::os::unix::fs::symlink(format!("tgt-{}", rng.gen::<u32>()), scratch_path(rng, mp))
        }
        78..=83 => fs::create_dir(&p),
        84..=88 => fs::remove_dir(&p),
        89..=95 => {
            let f = open_nofollow(&p, false, false)?;
            let ino = f.metadata()?.ino();
            let mut v = format!("ino:{ino};").into_bytes();
            v.resize(rng.gen_range(v.len()..=200), b'v');
            fsetxattr(&f, &format!("user.t{}", rng.gen_range(0..4)), &v)
        }
        96..=97 => {
            let f = open_nofollow(&p, false, false)?;
            fremovexattr(&f, &format!("user.t{}", rng.gen_range(0..4)))
        }
        _ => {
            let f = open_nofollow(&p, false, false)?;
            if rng.gen_bool(0.5) {
                f.sync_all()
            } else {
                f.sync_data()
            }
        }
    })();
    match r {
        Ok(()) => None,
        Err(e) if expected_scratch_errno(errno_of(&e)) => None,
        Err(e) => {
            rd.io_error(&format!("scratch {op} on {}", p.display()), &e);
            Some(e)
        }
    }
}

fn scratch_thread(mut rng: StdRng, mp: &Path, rd: &Round, st: &Stats) {
    while rd.going() {
        st.ops.fetch_add(1, Ordering::Relaxed);
        st.scratch_ops.fetch_add(1, Ordering::Relaxed);
        if scratch_op(&mut rng, mp, rd).is_some() {
            return;
        }
    }
}

/// Chunks `(offset, len)` covering `0..len` in random order.
fn chunks(rng: &mut StdRng, len: u64) -> Vec<(u64, u64)> {
    let mut v = Vec::new();
    let mut o = 0;
    while o < len {
        let n = rng.gen_range(1..=(len - o).min(96 << 10));
        v.push((o, n));
        o += n;
    }
    for i in (1..v.len()).rev() {
        v.swap(i, rng.gen_range(0..=i));
    }
    v
}

fn durable_size(rng: &mut StdRng) -> u64 {
    match rng.gen_range(0..6) {
        0 => 0,
        1 => rng.gen_range(1..4096),
        2 => 4096 * rng.gen_range(1..=8),
        3 => rng.gen_range(4096..=300 << 10),
        _ => rng.gen_range(1..=64 << 10),
    }
}

/// Create, write and sync one durable file; on success it is in `dm.live`.
fn durable_create(
    rng: &mut StdRng,
    dir: &Path,
    round: usize,
    dm: &mut Durable,
    rd: &Round,
    st: &Stats,
) -> io::Result<()> {
    let name = format!("r{round}-{}", dm.created);
    dm.created += 1;
    let p = dir.join(&name);
    let len = durable_size(rng);
    let variant = rng.gen_range(0..3);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&p)?;
    let ino = f.metadata()?.ino();
    st.ops.fetch_add(1, Ordering::Relaxed);
    if variant < 2 {
        for (o, n) in chunks(rng, len) {
            f.write_all_at(&pattern(ino, o, usize::try_from(n).expect("n")), o)?;
            st.ops.fetch_add(1, Ordering::Relaxed);
        }
        if variant == 0 {
            f.sync_all()?;
        } else {
            f.sync_data()?;
        }
        fsync_dir(dir)?;
        st.durable_syncs.fetch_add(1, Ordering::Relaxed);
        dm.live.insert(
            name,
            DFile {
                ino,
                exact_len: Some(len),
                ranges: vec![(0, len)],
                variant: if variant == 0 {
                    "fsync+fsync(dir)"
                } else {
                    "fdatasync+fsync(dir)"
                },
                round,
            },
        );
        return Ok(());
    }
    // O_SYNC: the empty file is made durable first; then each O_SYNC write is durable on return.
    f.sync_all()?;
    fsync_dir(dir)?;
    drop(f);
    st.durable_syncs.fetch_add(1, Ordering::Relaxed);
    dm.live.insert(
        name.clone(),
        DFile {
            ino,
            exact_len: None,
            ranges: Vec::new(),
            variant: "O_SYNC writes",
            round,
        },
    );
    let f = fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_SYNC)
        .open(&p)?;
    for (o, n) in chunks(rng, len) {
        if !rd.going() {
            break;
        }
        f.write_all_at(&pattern(ino, o, usize::try_from(n).expect("n")), o)?;
        st.ops.fetch_add(1, Ordering::Relaxed);
        st.durable_syncs.fetch_add(1, Ordering::Relaxed);
        dm.live
            .get_mut(&name)
            .expect("live O_SYNC file")
            .ranges
            .push((o, n));
    }
    let d = dm.live.get_mut(&name).expect("live O_SYNC file");
    if d.ranges.iter().map(|r| r.1).sum::<u64>() == len {
        d.exact_len = Some(len);
    }
    Ok(())
}

fn durable_thread(
    mut rng: StdRng,
    mp: &Path,
    round: usize,
    dm: &mut Durable,
    rd: &Round,
    st: &Stats,
) {
    let dir = mp.join("D");
    while rd.going() {
        // Delete a complete durable file (of this or an earlier round) now and then.
        let names: Vec<&String> = dm
            .live
            .iter()
            .filter(|(_, d)| d.exact_len.is_some())
            .map(|(n, _)| n)
            .collect();
        // Deleting faster once there are many keeps the verification time per round bounded.
        let delete = if dm.live.len() > 500 {
            rng.gen_ratio(1, 2)
        } else {
            rng.gen_ratio(1, 5)
        };
        let r = if delete && !names.is_empty() {
            let name = names[rng.gen_range(0..names.len())].clone();
            let d = dm.live.remove(&name).expect("live");
            dm.maybe_deleted.insert(name.clone(), d);
            st.ops.fetch_add(1, Ordering::Relaxed);
            fs::remove_file(dir.join(&name))
                .and_then(|()| fsync_dir(&dir))
                .map(|()| {
                    dm.maybe_deleted.remove(&name);
                    dm.deleted.insert(name);
                })
        } else {
            durable_create(&mut rng, &dir, round, dm, rd, st)
        };
        if let Err(e) = r {
            rd.io_error("durable file op", &e);
            return;
        }
    }
}

fn image_thread(mut rng: StdRng, mp: &Path, img: &mut Image, rd: &Round, st: &Stats) {
    let p = mp.join("I").join("disk.raw");
    let f = match fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
    {
        Ok(f) => f,
        Err(e) => return rd.io_error("open image O_DIRECT", &e),
    };
    let mut buf = AlignedBuf::new(16 * BLK);
    let mut touched: BTreeSet<usize> = BTreeSet::new();
    let mut until_sync = rng.gen_range(1..=24);
    while rd.going() {
        let n = if rng.gen_ratio(1, 8) {
            rng.gen_range(2..=16)
        } else {
            1
        };
        let b0 = if rng.gen_bool(0.5) {
            rng.gen_range(0..IMAGE_HOT)
        } else {
            rng.gen_range(0..IMAGE_BLOCKS - n)
        };
        for i in 0..n {
            let b = b0 + i;
            img.next[b] += 1;
            let v = img.next[b];
            // Recorded before the write is issued: it may land even if the call fails.
            img.since[b].push(v);
            fill(image_key(b, v), 0, &mut buf[i * BLK..(i + 1) * BLK]);
        }
        st.ops.fetch_add(1, Ordering::Relaxed);
        st.image_writes.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = f.write_all_at(&buf[..n * BLK], (b0 * BLK) as u64) {
            return rd.io_error("image O_DIRECT write", &e);
        }
        touched.extend(b0..b0 + n);
        until_sync -= 1;
        if until_sync == 0 {
            until_sync = rng.gen_range(1..=24);
            st.ops.fetch_add(1, Ordering::Relaxed);
            let r = if rng.gen_ratio(1, 5) {
                f.sync_all()
            } else {
                f.sync_data()
            };
            if let Err(e) = r {
                return rd.io_error("image fdatasync", &e);
            }
            st.image_syncs.fetch_add(1, Ordering::Relaxed);
            for b in std::mem::take(&mut touched) {
                img.durable[b] = *img.since[b].last().expect("written block has a version");
                img.since[b].clear();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Killing the daemon

/// SIGKILL the daemon of `m`, reap it, detach the mount.
fn kill_daemon(m: Mount) -> Result<String, String> {
    let pid = m.pid();
    let mp = m.path().to_path_buf();
    // What it logged before the kill is held to the no-ERROR rule too.
    m.check_log()?;
    // The daemon is gone; the harness's clean unmount (which insists on exit 0) must not run.
    std::mem::forget(m);
    // SAFETY: signalling the daemon we started (found by its private mountpoint).
    if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
        return Err(format!(
            "kill({pid}, SIGKILL): {}",
            io::Error::last_os_error()
        ));
    }
    let start = Instant::now();
    let status = loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid out-pointer; the test is the daemon's subreaper.
        let r = unsafe { libc::waitpid(pid, &raw mut status, libc::WNOHANG) };
        if r == pid {
            break format!("{status:#x}");
        }
        // SAFETY: signal 0 only checks existence.
        if r < 0 && unsafe { libc::kill(pid, 0) } != 0 {
            break "gone (not our child)".to_string();
        }
        if start.elapsed() > Duration::from_secs(30) {
            return Err(format!("daemon {pid} still alive 30 s after SIGKILL"));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    if let Err(e) = nix::mount::umount2(&mp, nix::mount::MntFlags::MNT_DETACH) {
        let o = std::process::Command::new("fusermount3")
            .arg("-uz")
            .arg(&mp)
            .output();
        if !o.as_ref().is_ok_and(|o| o.status.success()) {
            return Err(format!(
                "lazy unmount of {}: {e}; fusermount3 -uz: {o:?}",
                mp.display()
            ));
        }
    }
    if let Some(t) = mount_fstype(&mp) {
        return Err(format!(
            "{} still mounted ({t}) after lazy unmount",
            mp.display()
        ));
    }
    Ok(format!(
        "daemon {pid} SIGKILLed mid-storm, wait status {status}"
    ))
}

// ---------------------------------------------------------------------------------------------
// Verification after the crash

#[derive(Debug, Default)]
struct Checked {
    files: u64,
    bytes: u64,
    durable: u64,
    durable_bytes: u64,
    image_blocks: u64,
    image_written_blocks: u64,
}

/// Walk the whole tree: every regular file's bytes are 0 or its own pattern, every xattr names
/// its own inode, symlinks are ours. Returns the inode numbers seen.
fn walk(root: &Path, image_ino: u64, v: &mut Vec<String>, c: &mut Checked) {
    let mut files: Vec<(PathBuf, u64)> = Vec::new();
    let mut inos: HashSet<u64> = HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let st = match lstat(&p) {
            Ok(s) => s,
            Err(e) => {
                v.push(format!("lstat {}: {e}", p.display()));
                continue;
            }
        };
        inos.insert(st.st_ino);
        match list_xattrs(&p) {
            Ok(xs) => {
                for (n, val) in xs {
                    let want = format!("ino:{};", st.st_ino);
                    if n.starts_with(b"user.t") && !val.starts_with(want.as_bytes()) {
                        v.push(format!(
                            "xattr {} of {} (inode {}) is {:?}: expected it to start with {want:?}",
                            String::from_utf8_lossy(&n),
                            p.display(),
                            st.st_ino,
                            String::from_utf8_lossy(&val[..val.len().min(40)])
                        ));
                    }
                }
            }
            Err(e) => v.push(format!("listxattr {}: {e}", p.display())),
        }
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => match fs::read_dir(&p) {
                Ok(rd) => {
                    for e in rd {
                        match e {
                            Ok(e) => stack.push(e.path()),
                            Err(e) => v.push(format!("readdir {}: {e}", p.display())),
                        }
                    }
                }
                Err(e) => v.push(format!("opendir {}: {e}", p.display())),
            },
            libc::S_IFREG => files.push((p, st.st_ino)),
            libc::S_IFLNK => match fs::read_link(&p) {
                Ok(t) if t.to_string_lossy().starts_with("tgt-") => {}
                Ok(t) => v.push(format!(
                    "symlink {} -> {} is not ours",
                    p.display(),
                    t.display()
                )),
                Err(e) => v.push(format!("readlink {}: {e}", p.display())),
            },
            m => v.push(format!("{} has unexpected file type {m:o}", p.display())),
        }
    }
    let mut seen_ino = HashSet::new();
    for (p, ino) in files {
        if ino == image_ino || !seen_ino.insert(ino) {
            continue;
        }
        let data = match fs::read(&p) {
            Ok(d) => d,
            Err(e) => {
                v.push(format!("read {}: {e}", p.display()));
                continue;
            }
        };
        c.files += 1;
        c.bytes += data.len() as u64;
        if let Some(i) = first_bad(ino, 0, &data) {
            let others: HashSet<u64> = inos.iter().copied().filter(|x| *x != ino).collect();
            v.push(format!(
                "{} (inode {ino}, {} bytes) at offset {i}: {}",
                p.display(),
                data.len(),
                diagnose(i as u64, &data[i..], &others)
            ));
        }
    }
}

fn check_dfile(p: &Path, name: &str, d: &DFile, v: &mut Vec<String>, c: &mut Checked) -> bool {
    let what = format!(
        "durable {name} (inode {}, {}, round {}, expected size {:?}, ranges {})",
        d.ino,
        d.variant,
        d.round,
        d.exact_len,
        d.ranges.len()
    );
    let md = match fs::symlink_metadata(p) {
        Ok(m) => m,
        Err(e) => {
            v.push(format!("{what}: {e}"));
            return false;
        }
    };
    if md.ino() != d.ino || !md.is_file() {
        v.push(format!(
            "{what}: now inode {} ({:?})",
            md.ino(),
            md.file_type()
        ));
        return false;
    }
    let data = match fs::read(p) {
        Ok(x) => x,
        Err(e) => {
            v.push(format!("{what}: read: {e}"));
            return false;
        }
    };
    c.durable += 1;
    c.durable_bytes += data.len() as u64;
    let mut ok = true;
    if let Some(l) = d.exact_len {
        if data.len() as u64 != l {
            v.push(format!("{what}: size {} instead of {l}", data.len()));
            ok = false;
        }
    }
    for &(o, n) in &d.ranges {
        let exp = pattern(d.ino, o, usize::try_from(n).expect("n"));
        let lo = usize::try_from(o).expect("o");
        let got = data.get(lo..lo + exp.len());
        if got != Some(&exp[..]) {
            let detail = match got {
                None => format!("file is only {} bytes", data.len()),
                Some(g) => {
                    let i = g.iter().zip(&exp).position(|(a, b)| a != b).unwrap_or(0);
                    format!(
                        "first difference at offset {}: {}",
                        o + i as u64,
                        diagnose(o + i as u64, &g[i..], &HashSet::new())
                    )
                }
            };
            v.push(format!("{what}: synced range {o}+{n} lost: {detail}"));
            ok = false;
        }
    }
    ok
}

fn check_durable(mp: &Path, dm: &mut Durable, v: &mut Vec<String>, c: &mut Checked) {
    let dir = mp.join("D");
    for (name, d) in &dm.live {
        check_dfile(&dir.join(name), name, d, v, c);
    }
    for (name, d) in std::mem::take(&mut dm.maybe_deleted) {
        let p = dir.join(&name);
        match fs::symlink_metadata(&p) {
            // The unlink did not commit: the file is back and must be intact.
            Ok(_) => {
                if check_dfile(&p, &name, &d, v, c) {
                    dm.live.insert(name, d);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => v.push(format!("maybe-deleted durable {name}: {e}")),
        }
    }
    for name in &dm.deleted {
        if fs::symlink_metadata(dir.join(name)).is_ok() {
            v.push(format!(
                "durable {name} was unlinked and D/ fsynced, yet it exists again"
            ));
        }
    }
    // An interrupted O_SYNC file is never written again: its size is now fixed.
    for (name, d) in &mut dm.live {
        if d.exact_len.is_none() {
            if let Ok(m) = fs::symlink_metadata(dir.join(name)) {
                d.exact_len = Some(m.len());
            }
        }
    }
}

fn check_image(mp: &Path, img: &mut Image, v: &mut Vec<String>, c: &mut Checked) {
    const CHUNK: usize = 256;
    let p = mp.join("I").join("disk.raw");
    let f = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
    {
        Ok(f) => f,
        Err(e) => return v.push(format!("open image: {e}")),
    };
    match f.metadata() {
        Ok(m) if m.ino() == img.ino && m.len() == IMAGE_SIZE => {}
        Ok(m) => {
            return v.push(format!(
                "image is inode {} of {} bytes, expected inode {} of {IMAGE_SIZE}",
                m.ino(),
                m.len(),
                img.ino
            ))
        }
        Err(e) => return v.push(format!("stat image: {e}")),
    }
    let mut buf = AlignedBuf::new(CHUNK * BLK);
    let mut exp = vec![0u8; BLK];
    let mut bad = 0;
    for c0 in (0..IMAGE_BLOCKS).step_by(CHUNK) {
        if let Err(e) = f.read_exact_at(&mut buf, (c0 * BLK) as u64) {
            return v.push(format!("read image block {c0}+{CHUNK}: {e}"));
        }
        for i in 0..CHUNK {
            let b = c0 + i;
            let got = &buf[i * BLK..(i + 1) * BLK];
            c.image_blocks += 1;
            let mut found = None;
            let mut cands = vec![img.durable[b]];
            cands.extend(img.since[b].iter().copied());
            for &ver in &cands {
                let ok = if ver == 0 {
                    got.iter().all(|x| *x == 0)
                } else {
                    fill(image_key(b, ver), 0, &mut exp);
                    got == &exp[..]
                };
                if ok {
                    found = Some(ver);
                    break;
                }
            }
            if img.durable[b] != 0 || !img.since[b].is_empty() {
                c.image_written_blocks += 1;
            }
            if let Some(ver) = found {
                img.durable[b] = ver;
                img.since[b].clear();
            } else {
                bad += 1;
                if bad <= 8 {
                    // Which version (if any) does each sector hold?
                    let sectors: Vec<String> = (0..8)
                        .map(|s| {
                            let g = &got[s * 512..(s + 1) * 512];
                            if g.iter().all(|x| *x == 0) {
                                return "0".to_string();
                            }
                            for ver in 1..=img.next[b] {
                                fill(image_key(b, ver), 0, &mut exp);
                                if g == &exp[s * 512..(s + 1) * 512] {
                                    return format!("v{ver}");
                                }
                            }
                            "?".to_string()
                        })
                        .collect();
                    v.push(format!(
                        "image block {b}: holds none of the allowed versions (last synced v{}, \
                         written since {:?}, latest written v{}); sectors: {sectors:?}; {}",
                        img.durable[b],
                        img.since[b],
                        img.next[b],
                        diagnose(0, got, &HashSet::new())
                    ));
                }
            }
        }
    }
    if bad > 8 {
        v.push(format!("... {bad} bad image blocks in all"));
    }
}

// ---------------------------------------------------------------------------------------------
// The test

fn fill_marker(lun: &Lun) {
    let f = fs::OpenOptions::new()
        .write(true)
        .open(lun.path())
        .expect("open LUN");
    let chunk: Vec<u8> = MARKER.iter().copied().cycle().take(1 << 20).collect();
    for i in 0..(lun.size() >> 20) {
        f.write_all_at(&chunk, i << 20)
            .expect("fill LUN with marker");
    }
    f.sync_all().expect("sync LUN");
}

fn log_len(p: &Path) -> usize {
    fs::metadata(p).map_or(0, |m| usize::try_from(m.len()).unwrap_or(usize::MAX))
}

/// The last `lines` lines of the daemon log written between byte offsets `from` and `to`.
fn log_slice(p: &Path, from: usize, to: usize, lines: usize) -> String {
    let b = fs::read(p).unwrap_or_default();
    let s = String::from_utf8_lossy(&b[from.min(b.len())..to.min(b.len())]).into_owned();
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

#[test]
fn sigkill_during_storm() {
    require_fuse!();
    let t0 = Instant::now();
    let seed = seed("crash_kill");
    let rounds: usize = std::env::var("CETRA_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    let mut rng = StdRng::seed_from_u64(seed);

    let lun = Lun::new(LUN_SIZE);
    fill_marker(&lun);
    // A short heartbeat interval: `fsck -n` watches a crashed node's slot for a few intervals
    // before it calls it dead, and every round leaves one behind.
    lun.mkfs(&[
        "-q",
        "-N",
        "2",
        "--journal-size",
        "8M",
        "--heartbeat-interval",
        "250",
        "--io-timeout",
        "2000",
        "-L",
        "crashkill",
    ]);

    // Layout: D/ durable files, S/d*/ scratch, I/disk.raw the preallocated image.
    let m = Mount::new(&lun, HOST);
    for d in ["D", "S", "I"] {
        fs::create_dir(m.p(d)).expect("mkdir");
    }
    for i in 0..SCRATCH_DIRS {
        fs::create_dir(m.p(format!("S/d{i}"))).expect("mkdir scratch");
    }
    let img_file = fs::File::create(m.p("I/disk.raw")).expect("create image");
    fallocate(&img_file, 0, 0, IMAGE_SIZE).expect("fallocate image");
    img_file.sync_all().expect("fsync image");
    let image_ino = img_file.metadata().expect("stat image").ino();
    drop(img_file);
    m.unmount();
    lun.assert_fsck_clean();
    eprintln!(
        "crash_kill: setup (marker fill, mkfs, layout) {}",
        secs(t0.elapsed())
    );

    let mut img = Image {
        ino: image_ino,
        durable: vec![0; IMAGE_BLOCKS],
        since: vec![Vec::new(); IMAGE_BLOCKS],
        next: vec![0; IMAGE_BLOCKS],
    };
    let mut dm = Durable::default();
    let stats = Stats::default();
    let mut checked = Checked::default();
    let mut replayed_rounds = 0;
    let mut storm_time = Duration::ZERO;
    let mut log_from = 0;

    for round in 0..rounds {
        let m = Mount::new(&lun, HOST);
        let mp = m.path().to_path_buf();
        let log = m.log_path().to_path_buf();
        let rd = Round::default();
        let storm_ms = rng.gen_range(200..=3000);
        let seeds: Vec<u64> = (0..SCRATCH_THREADS + 2).map(|_| rng.gen()).collect();
        let ops_before = stats.ops.load(Ordering::Relaxed);
        let storm_start = Instant::now();
        let killed = std::thread::scope(|s| {
            for &sd in &seeds[..SCRATCH_THREADS] {
                let (mp, rd, st) = (&mp, &rd, &stats);
                s.spawn(move || scratch_thread(StdRng::seed_from_u64(sd), mp, rd, st));
            }
            {
                let (mp, rd, st, dm) = (&mp, &rd, &stats, &mut dm);
                let sd = seeds[SCRATCH_THREADS];
                s.spawn(move || durable_thread(StdRng::seed_from_u64(sd), mp, round, dm, rd, st));
            }
            {
                let (mp, rd, st, img) = (&mp, &rd, &stats, &mut img);
                let sd = seeds[SCRATCH_THREADS + 1];
                s.spawn(move || image_thread(StdRng::seed_from_u64(sd), mp, img, rd, st));
            }
            // The random crash moment (not a synchronization: any moment is a valid test).
            std::thread::sleep(Duration::from_millis(storm_ms));
            rd.killed.store(true, Ordering::SeqCst);
            let r = kill_daemon(m);
            rd.stop.store(true, Ordering::SeqCst);
            r
        });
        storm_time += storm_start.elapsed();
        let log_kill = log_len(&log);
        let kill_info = killed.unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
        let mut v = std::mem::take(&mut *rd.violations.lock().expect("violations"));
        let ops = stats.ops.load(Ordering::Relaxed) - ops_before;

        // fsck on the crashed volume (it checks the view with the journal replayed).
        let mut t = Instant::now();
        let phase = |t: &mut Instant| {
            let d = t.elapsed();
            *t = Instant::now();
            secs(d)
        };
        let f = lun.fsck();
        let t_fsck1 = phase(&mut t);
        if f.code != 0 {
            v.push(format!("fsck -n after the kill: {f}"));
        }
        if f.output().contains("replay") {
            replayed_rounds += 1;
        }

        // Remount (replays), then validate everything.
        let mut m = Mount::new(&lun, HOST);
        let t_mount = phase(&mut t);
        walk(m.path(), image_ino, &mut v, &mut checked);
        check_durable(m.path(), &mut dm, &mut v, &mut checked);
        check_image(m.path(), &mut img, &mut v, &mut checked);
        let recovery_log = m.log_path().to_path_buf();
        let t_verify = phase(&mut t);
        if let Err(e) = m.try_unmount() {
            v.push(format!("clean unmount after recovery: {e}"));
        }
        let t_umount = phase(&mut t);
        let f = lun.fsck();
        let t_fsck2 = phase(&mut t);
        if f.code != 0 {
            v.push(format!("fsck -n after recovery + clean unmount: {f}"));
        }
        eprintln!(
            "crash_kill: round {round}: storm {storm_ms} ms, {ops} ops; {kill_info}; \
             {} live durable files, {} violations; fsck {t_fsck1}, mount {t_mount}, \
             verify {t_verify}, umount {t_umount}, fsck {t_fsck2}",
            dm.live.len(),
            v.len()
        );
        if !v.is_empty() {
            let n = v.len();
            v.truncate(SHOW);
            panic!(
                "seed {seed} (CETRA_SEED={seed}), round {round} (storm {storm_ms} ms, {ops} ops): \
                 {n} violations:\n  {}\n--- log of the killed daemon ({}) ---\n{}\n\
                 --- log of the recovery mount ---\n{}",
                v.join("\n  "),
                log.display(),
                log_slice(&log, log_from, log_kill, 60),
                log_slice(&recovery_log, log_kill, usize::MAX, 30),
            );
        }
        log_from = log_len(&recovery_log);
    }

    eprintln!(
        "crash_kill: {rounds} rounds in {} (storms {}): {} ops ({} scratch, {} durable syncs, \
         {} image writes, {} image syncs); {} rounds had a journal to replay; checked {} files / \
         {} MiB, {} durable files / {} MiB, {} image blocks ({} ever written)",
        secs(t0.elapsed()),
        secs(storm_time),
        stats.ops.load(Ordering::Relaxed),
        stats.scratch_ops.load(Ordering::Relaxed),
        stats.durable_syncs.load(Ordering::Relaxed),
        stats.image_writes.load(Ordering::Relaxed),
        stats.image_syncs.load(Ordering::Relaxed),
        replayed_rounds,
        checked.files,
        checked.bytes >> 20,
        checked.durable,
        checked.durable_bytes >> 20,
        checked.image_blocks,
        checked.image_written_blocks
    );
}

/// The byte checker itself: own pattern and zeros pass; the LUN marker and another inode's
/// pattern are caught and named.
#[test]
fn checker_flags_stale_and_foreign_bytes() {
    let own = pattern(4242, 8190, 9000);
    assert_eq!(first_bad(4242, 8190, &own), None);
    let mut holes = own.clone();
    holes[100..5000].fill(0);
    assert_eq!(first_bad(4242, 8190, &holes), None);
    let mut stale = own.clone();
    for (i, b) in stale[4098..8194].iter_mut().enumerate() {
        *b = MARKER[(8190 + 4098 + i) % 8];
    }
    let i = first_bad(4242, 8190, &stale).expect("marker caught");
    assert!((4098..4106).contains(&i), "marker caught late, at {i}");
    assert!(diagnose(8190 + i as u64, &stale[i..], &HashSet::new()).starts_with("STALE"));
    let mut foreign = own;
    foreign[20..4116].copy_from_slice(&pattern(77, 8190 + 20, 4096));
    let i = first_bad(4242, 8190, &foreign).expect("foreign caught");
    assert!((20..28).contains(&i), "foreign bytes caught late, at {i}");
    let known: HashSet<u64> = [5, 77, 9].into_iter().collect();
    let d = diagnose(8190 + i as u64, &foreign[i..], &known);
    assert!(d.starts_with("FOREIGN (pattern of inode 77)"), "{d}");
}
