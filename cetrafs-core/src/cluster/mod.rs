//! Node membership on the disk alone: heartbeat slots, liveness judged by change on the
//! observer's monotonic clock, and the lease that every write of this node depends on.
//! Lock records (`lock`) and dead-node recovery (`recovery`) build on this; the filesystem's
//! use of them is in `fs/cluster.rs`. See docs/locking.md and docs/recovery.md.

pub mod fsck_claim;
pub mod lock;
pub mod machine;
pub mod mailbox;
pub mod membership;
pub mod object_lock;
pub mod procs;
pub mod recovery;
pub mod reservation;
pub mod timing;
pub mod watchdog;

pub use membership::{LeaseGuard, Membership, SlotView};
pub use timing::Timing;
