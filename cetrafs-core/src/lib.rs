//! CetraFS core: the on-disk format, the shared-LUN device layer, allocation, extent trees,
//! directories and the filesystem API ([`fs::Volume`]). No FUSE types live here.

#[macro_use]
pub mod error;
#[macro_use]
pub mod failpoint;
pub mod alloc;
pub mod check;
pub mod cluster;
pub mod dev;
pub mod format;
pub mod fs;
pub mod inspect;
pub mod journal;
pub mod mkfs;
pub mod probe;
pub mod scsi;
pub mod status;
pub mod sync;
pub mod tune;

pub use error::{Error, ErrorKind, Result};
