//! A write/flush recorder (in the spirit of dm-log-writes): wraps a device, passes everything
//! through, and logs every write and every flush so a test can rebuild the device as it could
//! look after a power cut at any point of the workload.
//!
//! A *crash state* is: the image before the workload, plus every write logged before the last
//! flush preceding the crash point, plus any subset of the writes issued after that flush (a
//! device may persist those in any order), where one of them may be torn at a sector boundary.

use super::{BlockDevice, CawOutcome, Geometry};
use crate::error::Result;
use crate::sync::LockPolicy;
use std::sync::Mutex;

#[derive(Debug, Clone)]
pub enum Op {
    Write { offset: u64, data: Vec<u8> },
    Flush,
}

#[derive(Debug)]
pub struct RecordingDevice<D: BlockDevice> {
    inner: D,
    log: Mutex<Vec<Op>>,
}

impl<D: BlockDevice> RecordingDevice<D> {
    pub fn new(inner: D) -> Self {
        Self {
            inner,
            log: Mutex::new(Vec::new()),
        }
    }

    pub fn log(&self) -> Vec<Op> {
        self.log.lock().or_panic().clone()
    }

    /// Number of ops logged so far (a position in the log).
    pub fn position(&self) -> usize {
        self.log.lock().or_panic().len()
    }

    fn push(&self, op: Op) {
        self.log.lock().or_panic().push(op);
    }
}

impl<D: BlockDevice> BlockDevice for RecordingDevice<D> {
    fn geometry(&self) -> &Geometry {
        self.inner.geometry()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.inner.write_at(offset, buf)?;
        self.push(Op::Write {
            offset,
            data: buf.to_vec(),
        });
        Ok(())
    }
    fn compare_and_write(&self, lba: u64, expected: &[u8], new: &[u8]) -> Result<CawOutcome> {
        let r = self.inner.compare_and_write(lba, expected, new)?;
        if r == CawOutcome::Written {
            self.push(Op::Write {
                offset: lba * self.inner.geometry().lbs(),
                data: new.to_vec(),
            });
        }
        Ok(r)
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()?;
        self.push(Op::Flush);
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len)
    }
    fn refresh_size(&self) -> Result<u64> {
        self.inner.refresh_size()
    }
}

/// How to treat the writes issued after the last flush before the crash point.
#[derive(Debug, Clone)]
pub struct Unflushed {
    /// Which of them reached the medium (indexes into the unflushed writes, in log order).
    pub persisted: Vec<bool>,
    /// Tear one persisted write: (its index, bytes kept — a multiple of the sector size).
    pub torn: Option<(usize, usize)>,
}

/// The writes that make up the crash at log position `at` (ops before `at` were issued), in
/// the order to apply them onto the image before the workload: every write before the last
/// flush preceding `at`, then the persisted unflushed ones (the torn one cut short).
pub fn crash_writes<'a>(log: &'a [Op], at: usize, unflushed: &Unflushed) -> Vec<(u64, &'a [u8])> {
    let last_flush = log[..at]
        .iter()
        .rposition(|o| matches!(o, Op::Flush))
        .map_or(0, |i| i + 1);
    let mut out: Vec<(u64, &[u8])> = log[..last_flush]
        .iter()
        .filter_map(|op| match op {
            Op::Write { offset, data } => Some((*offset, data.as_slice())),
            Op::Flush => None,
        })
        .collect();
    let mut i = 0;
    for op in &log[last_flush..at] {
        if let Op::Write { offset, data } = op {
            if unflushed.persisted.get(i).copied().unwrap_or(false) {
                match unflushed.torn {
                    Some((t, keep)) if t == i => out.push((*offset, &data[..keep.min(data.len())])),
                    _ => out.push((*offset, data)),
                }
            }
            i += 1;
        }
    }
    out
}

/// Build the image of a crash at log position `at` (ops before `at` were issued).
pub fn crash_image(base: &[u8], log: &[Op], at: usize, unflushed: &Unflushed) -> Vec<u8> {
    let mut img = base.to_vec();
    for (offset, data) in crash_writes(log, at, unflushed) {
        let o = usize::try_from(offset).unwrap_or(usize::MAX);
        img[o..o + data.len()].copy_from_slice(data);
    }
    img
}

/// Number of writes between the last flush before `at` and `at`.
pub fn unflushed_writes(log: &[Op], at: usize) -> usize {
    let last_flush = log[..at]
        .iter()
        .rposition(|o| matches!(o, Op::Flush))
        .map_or(0, |i| i + 1);
    log[last_flush..at]
        .iter()
        .filter(|o| matches!(o, Op::Write { .. }))
        .count()
}
