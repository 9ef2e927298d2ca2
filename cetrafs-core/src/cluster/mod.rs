//! Node membership on the disk alone: heartbeat slots, liveness judged by change on the
//! observer's monotonic clock, and the lease that every write of this node depends on.
//! (Lock records and multi-node coherency build on this; see docs/locking.md when they land.)

pub mod lock;
pub mod membership;
pub mod timing;

pub use membership::{LeaseGuard, Membership, SlotView};
pub use timing::Timing;
