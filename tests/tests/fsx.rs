//! fsx-style randomized data-path exerciser: one file, ≥100,000 operations mixing buffered and
//! `O_DIRECT` opens, every read checked byte-for-byte against an in-memory model, then umount,
//! remount, full verification and `fsck -n`.
//!
//! Environment: `CETRA_SEED` replays a run, `CETRA_FSX_OPS` changes the number of operations.

use cetrafs_tests::{require_fuse, secs, seed, AlignedBuf, Lun, Mount};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Largest file size the exerciser produces.
const MAXLEN: u64 = 4 << 20;
const DIO_ALIGN: u64 = 512;

/// A file offset or length of the model as an index into it (the model is a few MiB).
fn ix(v: u64) -> usize {
    usize::try_from(v).expect("fsx offsets fit usize")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    Buffered,
    Direct,
}

struct Fsx {
    path: PathBuf,
    seed: u64,
    rng: StdRng,
    model: Vec<u8>,
    buffered: File,
    direct: File,
    /// Recent operations, for the failure report.
    log: VecDeque<String>,
    op_no: u64,
    counts: BTreeMap<&'static str, u64>,
}

fn open(path: &Path, direct: bool) -> File {
    let mut o = OpenOptions::new();
    o.read(true).write(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
        .unwrap_or_else(|e| panic!("open {} (direct={direct}): {e}", path.display()))
}

impl Fsx {
    fn new(path: PathBuf, seed: u64) -> Self {
        File::create(&path).expect("create fsx file");
        let buffered = open(&path, false);
        let direct = open(&path, true);
        Self {
            path,
            seed,
            rng: StdRng::seed_from_u64(seed),
            model: Vec::new(),
            buffered,
            direct,
            log: VecDeque::new(),
            op_no: 0,
            counts: BTreeMap::default(),
        }
    }

    fn note(&mut self, what: &str) {
        if self.log.len() == 200 {
            self.log.pop_front();
        }
        self.log.push_back(format!("#{} {what}", self.op_no));
    }

    fn fail(&self, msg: &str) -> ! {
        let mut s = format!(
            "fsx FAILED at op #{} (seed {}, replay with CETRA_SEED={}): {msg}\nmodel size {}\nlast operations:\n",
            self.op_no,
            self.seed,
            self.seed,
            self.model.len()
        );
        for l in &self.log {
            s.push_str("  ");
            s.push_str(l);
            s.push('\n');
        }
        panic!("{s}");
    }

    fn size(&self) -> u64 {
        self.model.len() as u64
    }

    fn fd(&self, via: Via) -> &File {
        match via {
            Via::Buffered => &self.buffered,
            Via::Direct => &self.direct,
        }
    }

    /// A random length: mostly small, sometimes up to 256 KiB.
    fn rand_len(&mut self) -> u64 {
        match self.rng.gen_range(0..16) {
            0 => self.rng.gen_range(1..=256 << 10),
            1..=5 => self.rng.gen_range(1..=512),
            _ => self.rng.gen_range(1..=16 << 10),
        }
    }

    /// Offset biased towards interesting places: anywhere, near EOF, block boundaries.
    fn rand_off(&mut self, max: u64) -> u64 {
        let size = self.size();
        let o = match self.rng.gen_range(0..8) {
            0 if size > 0 => size.saturating_sub(self.rng.gen_range(0..8192)),
            1 => self.rng.gen_range(0..=max / 4096) * 4096,
            2 => {
                (self.rng.gen_range(0..=max / 4096) * 4096).saturating_sub(self.rng.gen_range(0..3))
            }
            _ => self.rng.gen_range(0..=max),
        };
        o.min(max)
    }

    fn align_for(via: Via, off: u64, len: u64) -> (u64, u64) {
        if via == Via::Direct {
            let off = off / DIO_ALIGN * DIO_ALIGN;
            let len = len.div_ceil(DIO_ALIGN).max(1) * DIO_ALIGN;
            (off, len)
        } else {
            (off, len)
        }
    }

    fn check_size(&mut self, after: &str) {
        let st = self
            .buffered
            .metadata()
            .unwrap_or_else(|e| self.fail(&format!("fstat after {after}: {e}")));
        if st.len() != self.size() {
            let msg = format!(
                "size after {after}: file {} model {}",
                st.len(),
                self.size()
            );
            self.fail(&msg);
        }
    }

    fn op_write(&mut self) {
        let via = if self.rng.gen_bool(0.5) {
            Via::Direct
        } else {
            Via::Buffered
        };
        let len = self.rand_len();
        let off = self.rand_off(MAXLEN - 1);
        let (off, mut len) = Self::align_for(via, off, len);
        len = len.min(MAXLEN - off);
        if via == Via::Direct {
            len = len / DIO_ALIGN * DIO_ALIGN;
            if len == 0 {
                return;
            }
        }
        let tag = self.op_no;
        let mut data = AlignedBuf::new(ix(len));
        self.rng.fill(&mut data[..]);
        // Make some writes compressible/recognizable: leading 8 bytes carry the op number.
        if len >= 8 {
            data[..8].copy_from_slice(&tag.to_le_bytes());
        }
        self.note(&format!(
            "write {via:?} off {off:#x} len {len:#x} (end {:#x})",
            off + len
        ));
        let r = self.fd(via).write_at(&data, off);
        match r {
            Ok(n) if n as u64 == len => {}
            Ok(n) => self.fail(&format!("short write: {n} of {len}")),
            Err(e) => self.fail(&format!("write failed: {e}")),
        }
        let end = ix(off + len);
        if self.model.len() < end {
            self.model.resize(end, 0);
        }
        self.model[ix(off)..end].copy_from_slice(&data);
        self.bump("write");
    }

    fn read_and_check(&mut self, via: Via, off: u64, len: u64, what: &str) {
        let mut buf = AlignedBuf::new(ix(len));
        let r = self.fd(via).read_at(&mut buf, off);
        let n = match r {
            Ok(n) => n,
            Err(e) => self.fail(&format!(
                "{what}: read {via:?} off {off:#x} len {len:#x}: {e}"
            )),
        };
        let size = self.size();
        let expect_n = ix(if off >= size {
            0
        } else {
            (size - off).min(len)
        });
        if n != expect_n {
            // A short read before EOF is legal for read(2) in general but not for a regular
            // file on a local filesystem; report it.
            self.fail(&format!("{what}: read {via:?} off {off:#x} len {len:#x} returned {n} bytes, expected {expect_n}"));
        }
        let want = if n == 0 {
            &[][..]
        } else {
            &self.model[ix(off)..ix(off) + n]
        };
        if buf[..n] != *want {
            let first = buf[..n]
                .iter()
                .zip(want)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            let last = buf[..n]
                .iter()
                .zip(want)
                .rposition(|(a, b)| a != b)
                .unwrap_or(0);
            let at = ix(off) + first;
            let show = |s: &[u8]| {
                s.iter().take(16).fold(String::new(), |mut h, b| {
                    let _ = write!(h, "{b:02x}");
                    h
                })
            };
            self.fail(&format!(
                "{what}: DATA MISMATCH reading {via:?} off {off:#x} len {len:#x}: first bad byte at file offset {at:#x}, \
                 last at {:#x}; got {} expected {}",
                ix(off) + last,
                show(&buf[first..n]),
                show(&want[first..])
            ));
        }
    }

    fn op_read(&mut self) {
        let via = if self.rng.gen_bool(0.5) {
            Via::Direct
        } else {
            Via::Buffered
        };
        let len = self.rand_len();
        let max = self.size().max(1) + 4096;
        let off = self.rand_off(max);
        let (off, len) = Self::align_for(via, off, len);
        self.note(&format!("read {via:?} off {off:#x} len {len:#x}"));
        self.read_and_check(via, off, len, "read");
        self.bump("read");
    }

    fn op_truncate(&mut self) {
        let new = match self.rng.gen_range(0..4) {
            0 => self.rng.gen_range(0..=MAXLEN / 4096) * 4096,
            1 => self.size().saturating_sub(self.rng.gen_range(0..=65536)),
            2 => (self.size() + self.rng.gen_range(0..=65536)).min(MAXLEN),
            _ => self.rng.gen_range(0..=MAXLEN),
        };
        let via = if self.rng.gen_bool(0.5) {
            Via::Direct
        } else {
            Via::Buffered
        };
        self.note(&format!(
            "truncate {via:?} from {:#x} to {new:#x}",
            self.size()
        ));
        if let Err(e) = self.fd(via).set_len(new) {
            self.fail(&format!("ftruncate to {new}: {e}"));
        }
        let up = new >= self.size();
        self.model.resize(ix(new), 0);
        self.check_size("truncate");
        self.bump(if up { "truncate-up" } else { "truncate-down" });
    }

    fn op_fallocate(&mut self) {
        let len = self.rand_len();
        let off = self.rand_off(MAXLEN - 1);
        let len = len.min(MAXLEN - off);
        let (mode, name) = match self.rng.gen_range(0..5) {
            0 => (0, "falloc"),
            1 => (libc::FALLOC_FL_KEEP_SIZE, "falloc-keep"),
            2 => (
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                "punch",
            ),
            3 => (libc::FALLOC_FL_ZERO_RANGE, "zero"),
            _ => (
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                "zero-keep",
            ),
        };
        let via = if self.rng.gen_bool(0.5) {
            Via::Direct
        } else {
            Via::Buffered
        };
        self.note(&format!(
            "fallocate {name} {via:?} off {off:#x} len {len:#x} (end {:#x})",
            off + len
        ));
        let fd = self.fd(via).as_raw_fd();
        #[allow(clippy::cast_possible_wrap)] // both < 4 MiB
        // SAFETY: plain syscall on an open fd.
        let r = unsafe { libc::fallocate(fd, mode, off as i64, len as i64) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            self.fail(&format!("fallocate {name} off {off} len {len}: {e}"));
        }
        let size = self.size();
        let end = off + len;
        let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        if mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) != 0 {
            let zend = end.min(size);
            if off < zend {
                self.model[ix(off)..ix(zend)].fill(0);
            }
        }
        if !keep && end > size {
            self.model.resize(ix(end), 0);
        }
        self.check_size(name);
        self.bump(name);
    }

    fn lseek(&self, whence: libc::c_int, off: u64) -> Result<u64, i32> {
        #[allow(clippy::cast_possible_wrap)]
        // SAFETY: plain syscall on an open fd.
        let r = unsafe { libc::lseek(self.buffered.as_raw_fd(), off as i64, whence) };
        if r < 0 {
            Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
        } else {
            Ok(r.cast_unsigned())
        }
    }

    fn op_seek(&mut self) {
        let size = self.size();
        let off = if self.rng.gen_range(0..10) == 0 {
            size + self.rng.gen_range(0..3)
        } else {
            self.rand_off(size)
        };
        self.note(&format!("seek data/hole from {off:#x} (size {size:#x})"));
        let data = self.lseek(libc::SEEK_DATA, off);
        let hole = self.lseek(libc::SEEK_HOLE, off);
        if off >= size {
            if data != Err(libc::ENXIO) || hole != Err(libc::ENXIO) {
                self.fail(&format!("SEEK_DATA/SEEK_HOLE at {off:#x} >= size {size:#x}: {data:?}/{hole:?}, want ENXIO"));
            }
            self.bump("seek");
            return;
        }
        // SEEK_DATA: everything skipped over must be zeros in the model.
        let d = match data {
            Ok(d) => d,
            Err(libc::ENXIO) => size,
            Err(e) => self.fail(&format!("SEEK_DATA at {off:#x}: errno {e}")),
        };
        if d < off || d > size {
            self.fail(&format!(
                "SEEK_DATA at {off:#x} returned {d:#x} outside [{off:#x}, size {size:#x}]"
            ));
        }
        if let Some(p) = self.model[ix(off)..ix(d)].iter().position(|&b| b != 0) {
            self.fail(&format!(
                "SEEK_DATA at {off:#x} returned {d:#x} but the model has data at {:#x} (data reported as hole)",
                ix(off) + p
            ));
        }
        // SEEK_HOLE: the hole it reports (up to the next data) must be zeros; EOF is a hole.
        let h = match hole {
            Ok(h) => h,
            Err(e) => self.fail(&format!("SEEK_HOLE at {off:#x}: errno {e}")),
        };
        if h < off || h > size {
            self.fail(&format!(
                "SEEK_HOLE at {off:#x} returned {h:#x} outside [{off:#x}, size {size:#x}]"
            ));
        }
        if h < size {
            let d2 = match self.lseek(libc::SEEK_DATA, h) {
                Ok(d2) => d2,
                Err(libc::ENXIO) => size,
                Err(e) => self.fail(&format!("SEEK_DATA at hole {h:#x}: errno {e}")),
            };
            if d2 <= h {
                self.fail(&format!(
                    "SEEK_HOLE at {off:#x} said hole at {h:#x} but SEEK_DATA({h:#x}) = {d2:#x}"
                ));
            }
            if let Some(p) = self.model[ix(h)..ix(d2)].iter().position(|&b| b != 0) {
                self.fail(&format!(
                    "hole [{h:#x}, {d2:#x}) reported by SEEK_HOLE({off:#x}) but the model has data at {:#x}",
                    ix(h) + p
                ));
            }
        }
        self.bump("seek");
    }

    fn op_fsync(&mut self) {
        let via = if self.rng.gen_bool(0.5) {
            Via::Direct
        } else {
            Via::Buffered
        };
        let datasync = self.rng.gen_bool(0.5);
        self.note(&format!(
            "{} {via:?}",
            if datasync { "fdatasync" } else { "fsync" }
        ));
        let r = if datasync {
            self.fd(via).sync_data()
        } else {
            self.fd(via).sync_all()
        };
        if let Err(e) = r {
            self.fail(&format!("fsync: {e}"));
        }
        self.bump("fsync");
    }

    fn op_reopen(&mut self) {
        self.note("close and reopen both descriptors");
        self.buffered = open(&self.path, false);
        self.direct = open(&self.path, true);
        self.bump("reopen");
    }

    fn verify_all(&mut self, what: &str) {
        self.note(&format!("verify whole file ({what})"));
        self.check_size(what);
        let size = self.size();
        let mut off = 0;
        while off < size + 1 {
            let len = (1u64 << 20).min(size + 1 - off).div_ceil(512) * 512;
            self.read_and_check(Via::Buffered, off, len, what);
            self.read_and_check(Via::Direct, off, len, what);
            off += len;
        }
    }

    fn bump(&mut self, what: &'static str) {
        *self.counts.entry(what).or_default() += 1;
    }

    fn step(&mut self) {
        self.op_no += 1;
        match self.rng.gen_range(0..100) {
            0..=29 => self.op_write(),
            30..=59 => self.op_read(),
            60..=66 => self.op_truncate(),
            67..=81 => self.op_fallocate(),
            82..=93 => self.op_seek(),
            94..=98 => self.op_fsync(),
            _ => self.op_reopen(),
        }
    }
}

#[test]
fn fsx_random_data_path() {
    require_fuse!();
    let ops: u64 = std::env::var("CETRA_FSX_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let seed = seed("fsx");
    let lun = Lun::new(2 << 30);
    lun.mkfs(&["-q", "-L", "fsx"]);
    let mount = Mount::new(&lun, "fsx-node");
    let path = mount.p("fsx.dat");
    let started = Instant::now();
    let mut fsx = Fsx::new(path.clone(), seed);
    for i in 0..ops {
        fsx.step();
        if i % 10_000 == 9_999 {
            fsx.verify_all("periodic verify");
            eprintln!(
                "fsx: {} ops in {}, size {}",
                i + 1,
                secs(started.elapsed()),
                fsx.size()
            );
        }
    }
    fsx.verify_all("final verify");
    eprintln!(
        "fsx: {ops} ops in {} (seed {seed}): {:?}",
        secs(started.elapsed()),
        fsx.counts
    );

    // Close, unmount, remount and compare everything again.
    let model = std::mem::take(&mut fsx.model);
    drop(fsx);
    mount.unmount();
    let mount = Mount::new(&lun, "fsx-node");
    let mut fsx2 = Fsx {
        path: path.clone(),
        seed,
        rng: StdRng::seed_from_u64(seed),
        model,
        buffered: open(&path, false),
        direct: open(&path, true),
        log: VecDeque::new(),
        op_no: ops,
        counts: BTreeMap::default(),
    };
    fsx2.verify_all("after remount");
    drop(fsx2);
    mount.unmount();
    lun.assert_fsck_clean();
}
