//! SCSI building blocks for the `SG_IO` backend ([`crate::dev::sg`]): the `sg_io_hdr` ABI,
//! CDB builders, sense/VPD/READ CAPACITY/persistent reservation parsers and the completion
//! classifier.
//! Everything here is pure (no file descriptors, no retry policy) and unit-tested on bytes.

pub mod cdb;
pub mod outcome;
pub mod pr;
pub mod sense;
pub mod sgio;
pub mod vpd;

pub use outcome::{
    classify, outcome_unknown, reservation_conflict, scsi_failure, CommandKind, Completion,
    FailureKind, Outcome, ScsiFailure,
};
pub use sense::Sense;
pub use sgio::{Direction, SgIoHdr};
pub use vpd::{BlockLimits, Capacity, Provisioning, StandardInquiry};
