//! On-disk format v2 (and v1, which differs only where `docs/format.md` says so). One file per structure; each owns its layout constants, encoder and a
//! validating decoder that never panics. No I/O happens here. `docs/format.md` draws them all.
//! All integers are little-endian.

pub mod block;
pub mod codec;
pub mod dirent;
pub mod extent;
pub mod group;
pub mod heartbeat;
pub mod inode;
pub mod journal;
pub mod layout;
pub mod lock_record;
pub mod mailbox;
pub mod object_lock;
pub mod overflow;
pub mod slot_header;
pub mod superblock;
pub mod tree_node;
pub mod xattr;

/// The filesystem block: unit of allocation, metadata blocks and extents.
pub const FS_BLOCK_SIZE: usize = 4096;
pub const FS_BLOCK: u64 = FS_BLOCK_SIZE as u64;
