//! Heartbeat timing, derived from the two parameters mkfs stores in the superblock (and every
//! node republishes in its own heartbeat): the renewal interval and the I/O timeout.
//! Numbers follow the design lessons (sanlock's 8 × `io_timeout`, VMFS's multi-second ATS stalls):
//! production defaults 2 s / 8 s give fail 64 s and dead 84 s; with `mkfs.cetra
//! --heartbeat-interval 100 --io-timeout 500` (fast test volumes) they are 4 s and 5.2 s.

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub interval: Duration,
    pub io_timeout: Duration,
}

impl Timing {
    pub fn from_ms(interval_ms: u32, io_timeout_ms: u32) -> Self {
        Self {
            interval: Duration::from_millis(u64::from(interval_ms.max(1))),
            io_timeout: Duration::from_millis(u64::from(io_timeout_ms.max(1))),
        }
    }

    /// A node that has not renewed for this long stops writing (self-fencing).
    pub fn fail_time(&self) -> Duration {
        self.io_timeout * 8
    }

    /// Others consider a node dead once its heartbeat has not changed for this long. The margin
    /// over `fail_time` covers writes the node issued just before it fenced (I/O cannot be
    /// cancelled, so they may still land) and one missed observation.
    pub fn dead_time(&self) -> Duration {
        self.fail_time() + self.io_timeout * 2 + self.interval * 2
    }
}
