//! Classifying a completed `SG_IO` command: what happened, and whether the caller may retry.
//!
//! The classifier only reads status bytes and sense data; retry counts, back-off and timeouts
//! are the device backend's business. The one thing it is strict about is the *outcome
//! unknown* case: after a timeout, a transport (host/driver) failure or an aborted task a
//! COMPARE AND WRITE may or may not have reached the medium, and only re-reading the block can
//! tell (design lesson: the VMware "false ATS miscompare").

use super::sense::{self, Sense};
use crate::error::{Error, ErrorKind};
use std::fmt;

/// SAM status codes.
pub mod status {
    pub const GOOD: u8 = 0x00;
    pub const CHECK_CONDITION: u8 = 0x02;
    pub const CONDITION_MET: u8 = 0x04;
    pub const BUSY: u8 = 0x08;
    pub const RESERVATION_CONFLICT: u8 = 0x18;
    pub const TASK_SET_FULL: u8 = 0x28;
    pub const ACA_ACTIVE: u8 = 0x30;
    pub const TASK_ABORTED: u8 = 0x40;
}

/// Linux `host_status` (DID_*) of a timed-out command.
pub const DID_TIME_OUT: u16 = 0x03;
/// Linux `driver_status` (DRIVER_*) of a timed-out command.
pub const DRIVER_TIMEOUT: u16 = 0x06;

/// The command class, as far as classification differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandKind {
    Read,
    Write,
    CompareAndWrite,
    SynchronizeCache,
    Unmap,
    /// INQUIRY, READ CAPACITY, TEST UNIT READY.
    Query,
    /// PERSISTENT RESERVE IN (READ KEYS, READ RESERVATION, REPORT CAPABILITIES).
    PersistentReserveIn,
    /// PERSISTENT RESERVE OUT (REGISTER, RESERVE, PREEMPT AND ABORT, ...). Not idempotent:
    /// a resent PREEMPT or REGISTER can conflict with its own first execution.
    PersistentReserveOut,
}

impl CommandKind {
    pub fn name(self) -> &'static str {
        match self {
            CommandKind::Read => "READ(16)",
            CommandKind::Write => "WRITE(16)",
            CommandKind::CompareAndWrite => "COMPARE AND WRITE",
            CommandKind::SynchronizeCache => "SYNCHRONIZE CACHE",
            CommandKind::Unmap => "UNMAP",
            CommandKind::Query => "INQUIRY/READ CAPACITY",
            CommandKind::PersistentReserveIn => "PERSISTENT RESERVE IN",
            CommandKind::PersistentReserveOut => "PERSISTENT RESERVE OUT",
        }
    }

    /// What RESERVATION CONFLICT means for this command, for the message.
    fn conflict_meaning(self) -> &'static str {
        match self {
            CommandKind::PersistentReserveOut => {
                "the key given does not match this path's registration, or this path is not registered (inspect with sg_persist -i -k -r)"
            }
            CommandKind::Write | CommandKind::CompareAndWrite | CommandKind::Unmap | CommandKind::SynchronizeCache => {
                "the LUN is reserved and this path is not registered: its key was removed (PREEMPT AND ABORT by a node recovering this one) or another host holds a reservation (inspect with sg_persist -i -k -r)"
            }
            CommandKind::Read | CommandKind::Query | CommandKind::PersistentReserveIn => {
                "another initiator holds a SCSI reservation on this LUN that excludes this path (inspect with sg_persist -i -k -r)"
            }
        }
    }
}

/// What the `SG_IO` header reported, copied out of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Completion {
    pub status: u8,
    pub host_status: u16,
    pub driver_status: u16,
    /// `sbp[..sb_len_wr]`.
    pub sense: Vec<u8>,
}

/// Failure classes a caller can act on differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// ILLEGAL REQUEST / INVALID COMMAND OPERATION CODE, or INVALID FIELD IN CDB on COMPARE
    /// AND WRITE (e.g. `NoLB` above the target's maximum): the target does not do this command.
    NotSupported,
    /// Any other ILLEGAL REQUEST.
    InvalidRequest,
    /// ILLEGAL REQUEST / LOGICAL BLOCK ADDRESS OUT OF RANGE.
    OutOfRange,
    /// Status RESERVATION CONFLICT (0x18): the target refused the command because of a SCSI
    /// reservation. Not executed (outcome known). On a write under a Write Exclusive –
    /// Registrants Only reservation it means this path's key was preempted: the node is
    /// fenced ([`reservation_conflict`]).
    ReservationConflict,
    /// BUSY or TASK SET FULL: not executed, try again later.
    Busy,
    /// The command timed out: outcome unknown.
    Timeout,
    /// `host_status`/`driver_status` error (path, HBA, midlayer): outcome unknown.
    Transport,
    /// ABORTED COMMAND sense or TASK ABORTED status: outcome unknown.
    Aborted,
    /// UNIT ATTENTION kept coming back after the allowed retries.
    UnitAttention,
    NotReady,
    WriteProtected,
    /// Thin pool exhausted (DATA PROTECT / SPACE ALLOCATION FAILED WRITE PROTECT).
    SpaceExhausted,
    /// MEDIUM ERROR or HARDWARE ERROR.
    Medium,
    Other,
}

/// A SCSI command that did not succeed, with everything needed for a one-line message.
/// Stored as the `source` of a [`crate::Error`], so callers can downcast to it
/// (see [`outcome_unknown`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScsiFailure {
    pub kind: FailureKind,
    pub command: CommandKind,
    /// The command may have been executed by the target: re-read before concluding anything.
    pub outcome_unknown: bool,
    pub sense: Option<Sense>,
    /// Set when the `SG_IO` ioctl itself failed with this errno.
    pub errno: Option<i32>,
    pub detail: String,
}

impl fmt::Display for ScsiFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)?;
        if self.outcome_unknown {
            f.write_str(" (outcome unknown: the command may have been executed)")?;
        }
        Ok(())
    }
}

impl std::error::Error for ScsiFailure {}

impl ScsiFailure {
    pub fn new(
        kind: FailureKind,
        command: CommandKind,
        unknown: bool,
        sense: Option<Sense>,
        detail: String,
    ) -> Self {
        Self {
            kind,
            command,
            outcome_unknown: unknown,
            sense,
            errno: None,
            detail,
        }
    }

    /// The [`ErrorKind`] this failure surfaces as.
    pub fn error_kind(&self) -> ErrorKind {
        match self.kind {
            FailureKind::NotSupported => ErrorKind::Unsupported,
            FailureKind::InvalidRequest => ErrorKind::InvalidInput,
            FailureKind::OutOfRange => ErrorKind::Range,
            FailureKind::Busy => ErrorKind::Busy,
            FailureKind::WriteProtected => ErrorKind::ReadOnly,
            FailureKind::SpaceExhausted => ErrorKind::NoSpace,
            FailureKind::ReservationConflict
            | FailureKind::Timeout
            | FailureKind::Transport
            | FailureKind::Aborted
            | FailureKind::UnitAttention
            | FailureKind::NotReady
            | FailureKind::Medium
            | FailureKind::Other => ErrorKind::Io,
        }
    }

    /// Wrap into the crate error with `context` (e.g. "COMPARE AND WRITE of LBA 8 on /dev/sg1").
    pub fn into_error(self, context: impl Into<String>) -> Error {
        Error::with_source(self.error_kind(), context, self)
    }

    /// A failure for an ioctl that returned an errno. Errors the kernel raises before the
    /// command is queued leave the outcome known; anything else (EINTR after submission, EIO,
    /// ETIMEDOUT...) does not.
    pub fn from_errno(command: CommandKind, errno: i32) -> Self {
        let before_submit = matches!(
            errno,
            libc::ENOTTY
                | libc::EINVAL
                | libc::EFAULT
                | libc::ENOMEM
                | libc::EPERM
                | libc::EACCES
                | libc::EBADF
                | libc::ENODEV
                | libc::ENXIO
                | libc::EAGAIN
        );
        let kind = match errno {
            libc::ETIMEDOUT => FailureKind::Timeout,
            libc::EAGAIN => FailureKind::Busy,
            libc::EINVAL | libc::ENOTTY => FailureKind::InvalidRequest,
            _ => FailureKind::Transport,
        };
        let msg = std::io::Error::from_raw_os_error(errno);
        let mut f = Self::new(
            kind,
            command,
            !before_submit,
            None,
            format!("SG_IO ioctl failed: {msg}"),
        );
        f.errno = Some(errno);
        f
    }
}

/// Whether `e` (or its source) is a SCSI failure after which the command's effect is unknown.
/// The lock layer answers that question by re-reading the block.
pub fn outcome_unknown(e: &Error) -> bool {
    scsi_failure(e).is_some_and(|f| f.outcome_unknown)
}

/// Whether `e`, or any error in its source chain, is a command the target refused with status
/// RESERVATION CONFLICT: a [`ScsiFailure`] of that kind (`SG_IO`), or an I/O error with errno
/// `EBADE`, which is how Linux reports the same status for a read or write through a block
/// node (`/dev/sdX` or a multipath map over it: the SCSI midlayer turns RESERVATION CONFLICT
/// into `BLK_STS_NEXUS`, "critical nexus error", errno EBADE, which dm-multipath does not retry
/// on another path; seen on LIO by `lio-check pr`). On a data write under the Write Exclusive –
/// Registrants Only reservation this is the hardware fence: the node's key was preempted and no
/// write of its will land again, so the caller must fence itself (stop writing, no retry). The
/// error's kind stays [`ErrorKind::Io`] (errno EIO); this predicate is what tells it apart from
/// other EIOs.
pub fn reservation_conflict(e: &Error) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if c.downcast_ref::<ScsiFailure>()
            .is_some_and(|f| f.kind == FailureKind::ReservationConflict)
            || c.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.raw_os_error() == Some(libc::EBADE))
        {
            return true;
        }
        cur = c.source();
    }
    false
}

/// The SCSI failure behind an error, if it came from the `SG_IO` backend.
pub fn scsi_failure(e: &Error) -> Option<&ScsiFailure> {
    std::error::Error::source(e).and_then(|s| s.downcast_ref::<ScsiFailure>())
}

/// Result of classifying one completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Good,
    /// MISCOMPARE DURING VERIFY OPERATION: nothing was written. `offset` is the INFORMATION
    /// field (first differing byte in the data-out buffer) when the target supplied it.
    Miscompare {
        offset: Option<u64>,
    },
    /// Not executed; send the same command again (UNIT ATTENTION, LU becoming ready,
    /// ALUA transition).
    Retry {
        reason: String,
    },
    Failed(ScsiFailure),
}

fn host_status_name(h: u16) -> &'static str {
    match h {
        0x01 => "DID_NO_CONNECT",
        0x02 => "DID_BUS_BUSY",
        0x03 => "DID_TIME_OUT",
        0x04 => "DID_BAD_TARGET",
        0x05 => "DID_ABORT",
        0x06 => "DID_PARITY",
        0x07 => "DID_ERROR",
        0x08 => "DID_RESET",
        0x09 => "DID_BAD_INTR",
        0x0A => "DID_PASSTHROUGH",
        0x0B => "DID_SOFT_ERROR",
        0x0C => "DID_IMM_RETRY",
        0x0D => "DID_REQUEUE",
        0x0E => "DID_TRANSPORT_DISRUPTED",
        0x0F => "DID_TRANSPORT_FAILFAST",
        0x10 => "DID_TARGET_FAILURE",
        0x11 => "DID_NEXUS_FAILURE",
        0x12 => "DID_ALLOC_FAILURE",
        0x13 => "DID_MEDIUM_ERROR",
        0x14 => "DID_TRANSPORT_MARGINAL",
        _ => "DID_?",
    }
}

/// Classify a completion of `cmd`. Never panics, whatever the bytes.
pub fn classify(cmd: CommandKind, c: &Completion) -> Outcome {
    use FailureKind as F;
    let fail = |kind, unknown, sense, detail: String| {
        Outcome::Failed(ScsiFailure::new(kind, cmd, unknown, sense, detail))
    };

    // Transport first: when the path failed, status and sense are not meaningful.
    if c.host_status != 0 {
        let kind = if c.host_status == DID_TIME_OUT {
            F::Timeout
        } else {
            F::Transport
        };
        let what = if kind == F::Timeout {
            "timed out"
        } else {
            "failed in transport"
        };
        return fail(
            kind,
            true,
            None,
            format!(
                "{} {what}: host_status 0x{:02x} {}",
                cmd.name(),
                c.host_status,
                host_status_name(c.host_status)
            ),
        );
    }
    // DRIVER_SENSE (0x08) only says sense data is present; the low bits are the error.
    let drv = c.driver_status & 0x07;
    if drv != 0 {
        let kind = if drv == DRIVER_TIMEOUT {
            F::Timeout
        } else {
            F::Transport
        };
        let what = if kind == F::Timeout {
            "timed out"
        } else {
            "failed in the SCSI midlayer"
        };
        return fail(
            kind,
            true,
            None,
            format!(
                "{} {what}: driver_status 0x{:02x}",
                cmd.name(),
                c.driver_status
            ),
        );
    }

    match c.status & 0xFE {
        status::GOOD | status::CONDITION_MET => Outcome::Good,
        status::CHECK_CONDITION => classify_sense(cmd, &c.sense),
        status::BUSY => fail(F::Busy, false, None, format!("{}: target BUSY", cmd.name())),
        status::TASK_SET_FULL => fail(
            F::Busy,
            false,
            None,
            format!("{}: target TASK SET FULL (queue full)", cmd.name()),
        ),
        status::RESERVATION_CONFLICT => fail(
            F::ReservationConflict,
            false,
            None,
            format!(
                "{}: RESERVATION CONFLICT, {}",
                cmd.name(),
                cmd.conflict_meaning()
            ),
        ),
        status::TASK_ABORTED => fail(
            F::Aborted,
            true,
            None,
            format!("{}: TASK ABORTED by the target", cmd.name()),
        ),
        s => fail(
            F::Other,
            true,
            None,
            format!("{}: unexpected SCSI status 0x{s:02x}", cmd.name()),
        ),
    }
}

fn classify_sense(cmd: CommandKind, raw: &[u8]) -> Outcome {
    use sense::key as K;
    use FailureKind as F;
    let Some(s) = Sense::parse(raw) else {
        return Outcome::Failed(ScsiFailure::new(
            F::Other,
            cmd,
            true,
            None,
            format!(
                "{}: CHECK CONDITION without usable sense data ({} bytes)",
                cmd.name(),
                raw.len()
            ),
        ));
    };
    let fail = |kind, unknown, detail: &str| {
        Outcome::Failed(ScsiFailure::new(
            kind,
            cmd,
            unknown,
            Some(s),
            format!("{}: {detail}{s}", cmd.name()),
        ))
    };
    if s.deferred {
        // A deferred error reports an earlier command's failure (typically a cached write);
        // this command's own fate is not described by it.
        return fail(F::Medium, true, "deferred error from an earlier write: ");
    }
    match s.key {
        K::RECOVERED_ERROR => Outcome::Good,
        K::MISCOMPARE if s.asc == 0x1D => Outcome::Miscompare {
            offset: s.information,
        },
        K::UNIT_ATTENTION => Outcome::Retry {
            reason: s.to_string(),
        },
        // becoming ready, ALUA state transition: not executed, try again
        K::NOT_READY if s.asc == 0x04 && matches!(s.ascq, 0x01 | 0x0A) => Outcome::Retry {
            reason: s.to_string(),
        },
        K::NOT_READY => fail(F::NotReady, false, "logical unit not ready: "),
        K::ILLEGAL_REQUEST => match s.asc {
            0x20 => fail(F::NotSupported, false, "not supported by the target: "),
            0x24 if cmd == CommandKind::CompareAndWrite => {
                fail(F::NotSupported, false, "rejected by the target: ")
            }
            0x21 => fail(F::OutOfRange, false, ""),
            _ => fail(F::InvalidRequest, false, ""),
        },
        K::DATA_PROTECT if s.asc == 0x27 && s.ascq == 0x07 => {
            fail(F::SpaceExhausted, false, "thin pool out of space: ")
        }
        K::DATA_PROTECT => fail(F::WriteProtected, false, "LUN is write protected: "),
        K::ABORTED_COMMAND => fail(F::Aborted, true, ""),
        K::MEDIUM_ERROR | K::HARDWARE_ERROR => fail(F::Medium, cmd != CommandKind::Read, ""),
        _ => fail(F::Other, true, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cc(key: u8, asc: u8, ascq: u8) -> Completion {
        let mut sb = vec![0u8; 18];
        sb[0] = 0x70;
        sb[2] = key;
        sb[7] = 10;
        sb[12] = asc;
        sb[13] = ascq;
        Completion {
            status: status::CHECK_CONDITION,
            host_status: 0,
            driver_status: 0x08,
            sense: sb,
        }
    }

    fn failed(o: Outcome) -> ScsiFailure {
        match o {
            Outcome::Failed(f) => f,
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn good() {
        assert_eq!(
            classify(CommandKind::Read, &Completion::default()),
            Outcome::Good
        );
        assert_eq!(
            classify(CommandKind::Write, &cc(1, 0x17, 0)),
            Outcome::Good,
            "recovered error"
        );
    }

    #[test]
    fn miscompare_with_and_without_information() {
        let mut c = cc(0x0E, 0x1D, 0);
        assert_eq!(
            classify(CommandKind::CompareAndWrite, &c),
            Outcome::Miscompare { offset: None }
        );
        c.sense[0] |= 0x80;
        c.sense[3..7].copy_from_slice(&12u32.to_be_bytes());
        assert_eq!(
            classify(CommandKind::CompareAndWrite, &c),
            Outcome::Miscompare { offset: Some(12) }
        );
    }

    #[test]
    fn unit_attention_and_becoming_ready_retry() {
        assert!(matches!(
            classify(CommandKind::CompareAndWrite, &cc(6, 0x29, 0)),
            Outcome::Retry { .. }
        ));
        assert!(matches!(
            classify(CommandKind::Read, &cc(2, 0x04, 0x0A)),
            Outcome::Retry { .. }
        ));
        let f = failed(classify(CommandKind::Read, &cc(2, 0x3A, 0)));
        assert_eq!(f.kind, FailureKind::NotReady);
    }

    #[test]
    fn caw_not_supported() {
        for asc in [0x20, 0x24] {
            let f = failed(classify(CommandKind::CompareAndWrite, &cc(5, asc, 0)));
            assert_eq!(f.kind, FailureKind::NotSupported);
            assert_eq!(f.error_kind(), ErrorKind::Unsupported);
            assert!(!f.outcome_unknown);
        }
        // INVALID FIELD IN CDB on a READ is a bug in the request, not a missing feature
        let f = failed(classify(CommandKind::Read, &cc(5, 0x24, 0)));
        assert_eq!(f.error_kind(), ErrorKind::InvalidInput);
        assert_eq!(
            failed(classify(CommandKind::Read, &cc(5, 0x21, 0))).error_kind(),
            ErrorKind::Range
        );
    }

    #[test]
    fn status_codes() {
        let st = |s| Completion {
            status: s,
            ..Default::default()
        };
        let f = failed(classify(
            CommandKind::CompareAndWrite,
            &st(status::RESERVATION_CONFLICT),
        ));
        assert_eq!(
            (f.kind, f.error_kind(), f.outcome_unknown),
            (FailureKind::ReservationConflict, ErrorKind::Io, false)
        );
        assert!(f.to_string().contains("RESERVATION CONFLICT"));
        assert!(f.to_string().contains("PREEMPT AND ABORT"), "{f}");
        let e = f.into_error("COMPARE AND WRITE of LBA 3 on /dev/sg1");
        assert!(reservation_conflict(&e));
        assert!(!outcome_unknown(&e));
        // found through a wrapping error too, and context kept
        let outer = Error::with_source(ErrorKind::Io, "journal write", e);
        assert!(reservation_conflict(&outer));
        assert!(!reservation_conflict(&Error::new(
            ErrorKind::Io,
            "plain EIO"
        )));
        // the block layer's form of the same status (O_DIRECT pwrite on /dev/sdX)
        let blk = Error::io(
            "write of 512 bytes",
            std::io::Error::from_raw_os_error(libc::EBADE),
        );
        assert!(reservation_conflict(&blk));
        assert_eq!(blk.errno(), libc::EIO);
        let eio = Error::io(
            "write of 512 bytes",
            std::io::Error::from_raw_os_error(libc::EIO),
        );
        assert!(!reservation_conflict(&eio));
        let busy = failed(classify(CommandKind::Write, &st(status::BUSY))).into_error("w");
        assert!(!reservation_conflict(&busy));
        for k in [
            CommandKind::PersistentReserveOut,
            CommandKind::Read,
            CommandKind::Write,
        ] {
            let f = failed(classify(k, &st(status::RESERVATION_CONFLICT)));
            assert_eq!(f.kind, FailureKind::ReservationConflict);
            assert!(f.to_string().starts_with(k.name()), "{f}");
        }
        for s in [status::BUSY, status::TASK_SET_FULL] {
            let f = failed(classify(CommandKind::CompareAndWrite, &st(s)));
            assert_eq!(
                (f.kind, f.error_kind(), f.outcome_unknown),
                (FailureKind::Busy, ErrorKind::Busy, false)
            );
        }
        let f = failed(classify(
            CommandKind::CompareAndWrite,
            &st(status::TASK_ABORTED),
        ));
        assert!(f.outcome_unknown);
        assert!(failed(classify(CommandKind::Read, &st(0x22))).outcome_unknown);
    }

    #[test]
    fn transport_errors_leave_outcome_unknown() {
        let c = Completion {
            host_status: DID_TIME_OUT,
            ..Default::default()
        };
        let f = failed(classify(CommandKind::CompareAndWrite, &c));
        assert_eq!(f.kind, FailureKind::Timeout);
        assert!(f.outcome_unknown);
        let e = f.into_error("COMPARE AND WRITE of LBA 7 on /dev/sg3");
        assert!(outcome_unknown(&e));
        assert_eq!(e.kind(), ErrorKind::Io);
        assert!(e.to_string().contains("DID_TIME_OUT"), "{e}");
        assert!(e.to_string().contains("outcome unknown"), "{e}");
        // host status wins even if a GOOD status byte is present
        let c = Completion {
            host_status: 0x0E,
            ..Default::default()
        };
        assert_eq!(
            failed(classify(CommandKind::Write, &c)).kind,
            FailureKind::Transport
        );
        let c = Completion {
            driver_status: DRIVER_TIMEOUT,
            ..Default::default()
        };
        assert_eq!(
            failed(classify(CommandKind::Write, &c)).kind,
            FailureKind::Timeout
        );
        // DRIVER_SENSE alone is not an error
        let c = Completion {
            driver_status: 0x08,
            ..Default::default()
        };
        assert_eq!(classify(CommandKind::Write, &c), Outcome::Good);
    }

    #[test]
    fn aborted_and_data_protect() {
        assert!(failed(classify(CommandKind::CompareAndWrite, &cc(0x0B, 0x47, 0))).outcome_unknown);
        assert_eq!(
            failed(classify(CommandKind::Write, &cc(7, 0x27, 0x07))).error_kind(),
            ErrorKind::NoSpace
        );
        assert_eq!(
            failed(classify(CommandKind::Write, &cc(7, 0x27, 0))).error_kind(),
            ErrorKind::ReadOnly
        );
        assert!(!failed(classify(CommandKind::Read, &cc(3, 0x11, 0))).outcome_unknown);
        let mut c = cc(3, 0x0C, 0);
        c.sense[0] = 0x71;
        assert!(
            failed(classify(CommandKind::Read, &c)).outcome_unknown,
            "deferred"
        );
    }

    #[test]
    fn missing_sense_is_unknown() {
        let c = Completion {
            status: status::CHECK_CONDITION,
            ..Default::default()
        };
        assert!(failed(classify(CommandKind::CompareAndWrite, &c)).outcome_unknown);
    }

    #[test]
    fn errno_classification() {
        let f = ScsiFailure::from_errno(CommandKind::CompareAndWrite, libc::ENOTTY);
        assert!(!f.outcome_unknown);
        assert_eq!(f.errno, Some(libc::ENOTTY));
        let f = ScsiFailure::from_errno(CommandKind::CompareAndWrite, libc::EINTR);
        assert!(f.outcome_unknown);
        let e = ScsiFailure::from_errno(CommandKind::CompareAndWrite, libc::EIO).into_error("x");
        assert!(outcome_unknown(&e));
        assert!(!outcome_unknown(&Error::new(ErrorKind::Io, "plain")));
    }

    proptest! {
        #[test]
        fn never_panics(st in any::<u8>(), h in any::<u16>(), d in any::<u16>(), sb in proptest::collection::vec(any::<u8>(), 0..64)) {
            let c = Completion { status: st, host_status: h, driver_status: d, sense: sb };
            for k in [CommandKind::Read, CommandKind::CompareAndWrite, CommandKind::Unmap] {
                if let Outcome::Failed(f) = classify(k, &c) {
                    let _ = f.to_string();
                }
            }
        }
    }
}
