//! A device write log attributed per process, for the multi-node fencing tests: wraps a device,
//! passes everything through, and appends one text line per write that reached the device:
//!
//! ```text
//! <CLOCK_REALTIME ns> <pid> <write|caw> <byte offset> <len>\n
//! ```
//!
//! * The timestamp is taken immediately **before** the write is issued (issue time), so a write
//!   that was already inside the kernel when the process was SIGSTOPped is logged with a time
//!   before the stop, and a write issued after SIGCONT has a time after the resume. `CLOCK_REALTIME`
//!   is used because the observer (the test) is another process.
//! * A line is appended only for a write that succeeded, and for a `compare_and_write` only when it
//!   wrote (`Written`); miscompares and failed writes write nothing to the device.
//! * The pid is the writing process's (`getpid`), read at every write, so the log stays right
//!   across a fork.
//!
//! The daemon installs it when `CETRA_WRITE_LOG` names a file (opened in append mode; several
//! processes may share one log, each line is one `write(2)` of an `O_APPEND` file).
//!
//! A write whose line cannot be appended is reported as failed: the log is evidence for a test,
//! and a silently missing line could hide a write after fencing.

use super::{BlockDevice, CawOutcome, Geometry, SharedDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::sync::LockPolicy;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// The environment variable the daemon reads: a file to append the write log to.
pub const WRITE_LOG_ENV: &str = "CETRA_WRITE_LOG";

#[derive(Debug)]
pub struct WriteLog {
    inner: SharedDevice,
    file: Mutex<std::fs::File>,
}

/// What kind of device write a log line records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteKind {
    Write,
    Caw,
}

impl WriteKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Write => "write",
            Self::Caw => "caw",
        }
    }
}

/// One parsed line of a write log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteLogLine {
    /// `CLOCK_REALTIME` nanoseconds at issue time.
    pub time_ns: u128,
    pub pid: u32,
    pub kind: WriteKind,
    pub offset: u64,
    pub len: u64,
}

impl WriteLogLine {
    /// Parse one line (without its newline); None if it is not a well-formed log line.
    pub fn parse(line: &str) -> Option<Self> {
        let mut it = line.split_ascii_whitespace();
        let time_ns = it.next()?.parse().ok()?;
        let pid = it.next()?.parse().ok()?;
        let kind = match it.next()? {
            "write" => WriteKind::Write,
            "caw" => WriteKind::Caw,
            _ => return None,
        };
        let offset = it.next()?.parse().ok()?;
        let len = it.next()?.parse().ok()?;
        if it.next().is_some() {
            return None;
        }
        Some(Self {
            time_ns,
            pid,
            kind,
            offset,
            len,
        })
    }
}

/// `CLOCK_REALTIME` in nanoseconds since the epoch.
pub fn realtime_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

impl WriteLog {
    /// Wrap `inner`, appending to `file` (which should be opened with append).
    pub fn new(inner: SharedDevice, file: std::fs::File) -> Self {
        Self {
            inner,
            file: Mutex::new(file),
        }
    }

    /// Wrap `inner`, appending to the file at `path` (created if missing).
    pub fn open(inner: SharedDevice, path: &Path) -> Result<Self> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening write log {}", path.display()), e))?;
        Ok(Self::new(inner, f))
    }

    fn append(&self, t: u128, kind: WriteKind, offset: u64, len: usize) -> Result<()> {
        let line = format!(
            "{t} {} {} {offset} {len}\n",
            std::process::id(),
            kind.as_str()
        );
        let mut f = self.file.lock().or_panic();
        f.write_all(line.as_bytes()).map_err(|e| {
            Error::with_source(
                ErrorKind::Io,
                format!(
                    "device {} at {offset} len {len} reached the device but the write log \
                     could not record it",
                    kind.as_str()
                ),
                e,
            )
        })
    }
}

impl BlockDevice for WriteLog {
    fn geometry(&self) -> &Geometry {
        self.inner.geometry()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.inner.read_at(offset, buf)
    }
    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.inner.read_many(reads)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let t = realtime_ns();
        self.inner.write_at(offset, buf)?;
        self.append(t, WriteKind::Write, offset, buf.len())
    }
    fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
        let t = realtime_ns();
        let r = self.inner.compare_and_write(lba, expected, new)?;
        if r == CawOutcome::Written {
            self.append(
                t,
                WriteKind::Caw,
                lba * self.inner.geometry().lbs(),
                new.len(),
            )?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::mem::MemDevice;
    use std::sync::Arc;

    #[test]
    fn logs_writes_and_successful_caws_with_pid_and_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w.log");
        let mem = Arc::new(MemDevice::new(1 << 20, 512));
        let dev = WriteLog::open(mem.clone(), &path).expect("open log");
        let t0 = realtime_ns();

        dev.write_at(4096, &[7u8; 1024]).expect("write");
        let mut old = vec![0u8; 512];
        dev.read_at(8192, &mut old).expect("read");
        let new = vec![9u8; 512];
        assert_eq!(
            dev.compare_and_write(16, &old, &new).expect("caw"),
            CawOutcome::Written
        );
        // A miscompare writes nothing and logs nothing.
        assert_eq!(
            dev.compare_and_write(16, &old, &[1u8; 512]).expect("caw"),
            CawOutcome::Miscompare
        );
        // A failed write logs nothing.
        mem.faults
            .fail_writes
            .store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(dev.write_at(0, &[1u8; 512]).is_err());
        mem.faults
            .fail_writes
            .store(false, std::sync::atomic::Ordering::SeqCst);
        dev.flush().expect("flush");
        let t1 = realtime_ns();

        // Data went through.
        let mut b = vec![0u8; 1024];
        mem.read_at(4096, &mut b).expect("read back");
        assert!(b.iter().all(|x| *x == 7));
        mem.read_at(8192, &mut b[..512]).expect("read back");
        assert!(b[..512].iter().all(|x| *x == 9));

        let text = std::fs::read_to_string(&path).expect("read log");
        let lines: Vec<WriteLogLine> = text
            .lines()
            .map(|l| WriteLogLine::parse(l).unwrap_or_else(|| panic!("bad line {l:?}")))
            .collect();
        assert_eq!(lines.len(), 2, "log:\n{text}");
        let pid = std::process::id();
        assert_eq!(
            (lines[0].pid, lines[0].kind, lines[0].offset, lines[0].len),
            (pid, WriteKind::Write, 4096, 1024)
        );
        assert_eq!(
            (lines[1].pid, lines[1].kind, lines[1].offset, lines[1].len),
            (pid, WriteKind::Caw, 8192, 512)
        );
        for l in &lines {
            assert!((t0..=t1).contains(&l.time_ns), "{l:?} outside {t0}..={t1}");
        }
        assert!(lines[0].time_ns <= lines[1].time_ns);

        // Append mode: a second logger adds to the same file.
        let dev2 = WriteLog::open(mem, &path).expect("reopen log");
        dev2.write_at(0, &[3u8; 512]).expect("write");
        let text = std::fs::read_to_string(&path).expect("read log");
        assert_eq!(text.lines().count(), 3, "log:\n{text}");
        assert!(text.ends_with('\n'));
    }

    #[test]
    fn parse_rejects_malformed_lines() {
        assert!(WriteLogLine::parse("1 2 write 3 4").is_some());
        assert!(WriteLogLine::parse("1 2 read 3 4").is_none());
        assert!(WriteLogLine::parse("1 2 write 3").is_none());
        assert!(WriteLogLine::parse("1 2 write 3 4 5").is_none());
        assert!(WriteLogLine::parse("x 2 caw 3 4").is_none());
    }
}
