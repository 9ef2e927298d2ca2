//! Plain types of the filesystem API: what the FUSE adapter (and tests) pass in and get back.

use crate::format::inode::Timespec;

pub type Ino = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Regular,
    Directory,
    Symlink,
    Fifo,
    CharDevice,
    BlockDevice,
    Socket,
}

impl FileKind {
    pub fn from_mode(mode: u32) -> Option<Self> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG => Self::Regular,
            libc::S_IFDIR => Self::Directory,
            libc::S_IFLNK => Self::Symlink,
            libc::S_IFIFO => Self::Fifo,
            libc::S_IFCHR => Self::CharDevice,
            libc::S_IFBLK => Self::BlockDevice,
            libc::S_IFSOCK => Self::Socket,
            _ => return None,
        })
    }

    /// The DT_* value stored in directory entries.
    pub fn dtype(self) -> u8 {
        match self {
            Self::Regular => libc::DT_REG,
            Self::Directory => libc::DT_DIR,
            Self::Symlink => libc::DT_LNK,
            Self::Fifo => libc::DT_FIFO,
            Self::CharDevice => libc::DT_CHR,
            Self::BlockDevice => libc::DT_BLK,
            Self::Socket => libc::DT_SOCK,
        }
    }

    pub fn from_dtype(d: u8) -> Option<Self> {
        Some(match d {
            libc::DT_REG => Self::Regular,
            libc::DT_DIR => Self::Directory,
            libc::DT_LNK => Self::Symlink,
            libc::DT_FIFO => Self::Fifo,
            libc::DT_CHR => Self::CharDevice,
            libc::DT_BLK => Self::BlockDevice,
            libc::DT_SOCK => Self::Socket,
            _ => return None,
        })
    }
}

/// Attributes as stat(2) reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    pub ino: Ino,
    pub kind: FileKind,
    /// Permission bits and setuid/setgid/sticky (mode & 0o7777).
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    pub size: u64,
    /// 512-byte units, as `st_blocks`.
    pub blocks: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub crtime: Timespec,
    /// FS_*_FL flags (immutable, append-only, noatime).
    pub flags: u32,
    pub generation: u32,
}

/// A time to set: a given value, or "now" (`UTIME_NOW`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetTime {
    Now,
    At(Timespec),
}

/// setattr request; `None` fields are left unchanged.
#[derive(Debug, Clone, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<SetTime>,
    pub mtime: Option<SetTime>,
    /// Explicit ctime (rarely sent by the kernel); otherwise ctime becomes now on any change.
    pub ctime: Option<Timespec>,
}

/// Who is asking: used for new inodes' ownership and for checks the kernel cannot do for us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    /// The process's umask, applied to the permission bits of the inodes it creates unless the
    /// parent has a default ACL (then the ACL decides, as in the kernel's `posix_acl_create`).
    /// 0 where the kernel has already applied it.
    pub umask: u32,
}

impl Caller {
    pub const ROOT: Caller = Caller {
        uid: 0,
        gid: 0,
        umask: 0,
    };
}

/// Where a write goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteAt {
    /// At this byte offset (pwrite, or write at the file position).
    Offset(u64),
    /// At the end of the file (`O_APPEND)`: the volume reads the file's size under the metadata
    /// mutex with the file's inode lock held exclusively (under the global lock, or owned by
    /// this node), so appends from any number of nodes never overlap. Whatever offset the
    /// caller's kernel computed from its cached size is not used.
    End,
}

/// What a write did: where it went, bytes written, and the setuid/setgid bits it removed (0
/// nearly always).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// The byte offset the data was written at ([`WriteAt::End`]: the file's size then).
    pub offset: u64,
    pub bytes: u32,
    pub dropped: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RenameFlags {
    pub noreplace: bool,
    pub exchange: bool,
    /// `RENAME_WHITEOUT`: leave a whiteout (a character device 0/0, mode 0, owned by this
    /// caller) at the source name, in the same transaction as the rename.
    pub whiteout: Option<Caller>,
}

/// fallocate(2) modes we support.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallocMode {
    /// Mode 0 (or `KEEP_SIZE` when `keep_size`): allocate unwritten extents that read as zeros.
    Allocate { keep_size: bool },
    /// `PUNCH_HOLE` | `KEEP_SIZE`: free the blocks; the range reads as zeros.
    PunchHole,
    /// `ZERO_RANGE` (optionally `KEEP_SIZE`): the range reads as zeros, and stays allocated.
    ZeroRange { keep_size: bool },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whence {
    Data,
    Hole,
}

/// One readdir entry; `next` is the cookie to resume after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirListEntry {
    pub ino: Ino,
    pub kind: FileKind,
    pub name: Vec<u8>,
    pub next: u64,
}

/// What a listing with attributes (readdirplus) reports for one entry; see
/// `Volume::entry_attr`, which owns the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryAttr {
    /// The entry's inode, loaded.
    Loaded(Attr),
    /// The name was removed (here or on another node) after the directory was read: leave it
    /// out of the listing.
    Gone,
    /// The name is in the directory but its inode cannot be loaded (damaged, I/O error): list
    /// it anyway with these placeholder attributes (inode number and type from the entry,
    /// nothing else), which must not be cached; a lookup or stat of the name fails with EIO
    /// (or, listed while the global lock's holders were silent, waits for the global lock:
    /// `fs/own_lock_reads.rs`).
    Unreadable(Attr),
}

impl Attr {
    /// Placeholder attributes of an entry whose inode cannot be read.
    pub fn placeholder(ino: Ino, kind: FileKind) -> Self {
        Self {
            ino,
            kind,
            perm: 0,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: 0,
            blocks: 0,
            atime: Timespec::default(),
            mtime: Timespec::default(),
            ctime: Timespec::default(),
            crtime: Timespec::default(),
            flags: 0,
            generation: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
}

/// Options a node mounts with.
#[derive(Debug, Clone)]
pub struct MountOptions {
    pub read_only: bool,
    /// Node identity (host name), recorded in the node's heartbeat slot.
    pub host: String,
    /// The machine this node runs on, recorded in its heartbeat slot too; None: this
    /// machine's, as `cluster::machine::MachineId::local` reads it (`CETRA_MACHINE_ID`, else
    /// `/etc/machine-id`). In-process tests set it to play several machines.
    pub machine: Option<crate::cluster::machine::MachineId>,
    /// How often pending metadata is committed without an fsync (zero: only on fsync, sync,
    /// unmount and journal pressure — deterministic, for crash tests).
    pub commit_interval: std::time::Duration,
    /// Cross-node open locks (`nofilelock` turns them off): a regular file open for writing
    /// on one node cannot be opened for writing on another.
    pub file_locks: bool,
    /// Renew the heartbeat with COMPARE AND WRITE (`renew=caw`) instead of write + re-read.
    pub caw_renewal: bool,
    /// Memory budget of the inode table's idle states, bytes (`inode_cache=MiB`;
    /// `fs/inode_table.rs`).
    pub inode_cache_bytes: usize,
    /// Memory budget of the metadata block cache, bytes (`meta_cache=MiB`;
    /// `fs/block_cache.rs`).
    pub meta_cache_bytes: usize,
    /// Memory budget of the allocator's bitmap cache, bytes (`bitmap_cache=MiB`; alloc.rs).
    pub bitmap_cache_bytes: usize,
    /// Most inode locks this node keeps cached on a v3 volume (`inode_locks=N`; None: its
    /// share of the lock area, `fs/inode_lock.rs`).
    pub inode_locks: Option<usize>,
    /// Allocation granule of image-sized sparse files, bytes (`granule=KiB`): a multiple of
    /// 4096 up to 1 MiB; 4096 (the default) allocates exactly the blocks written (fs/data.rs).
    pub alloc_granule: u64,
    /// The host watchdog (`watchdog=auto|none|PATH`; `cluster/watchdog.rs`). Off unless asked
    /// for: a library user or a test that drops a mounted volume without unmounting must not
    /// leave an armed watchdog behind. The daemon's default is `auto`.
    pub watchdog: crate::cluster::watchdog::WatchdogSpec,
    /// Where the volume is mounted: the processes using files under it are stopped when the
    /// node loses its lease (None: nobody is stopped).
    pub mountpoint: Option<std::path::PathBuf>,
    /// SCSI-3 persistent reservation fencing (`fence=pr`, `cluster/reservation.rs`), chosen
    /// and joined (joining key) by whoever opened the LUN; None: software fencing only.
    pub reservations: Option<std::sync::Arc<crate::cluster::reservation::Reservations>>,
    /// Discard freed blocks in the background at this many bytes per second
    /// (`discard=MiB/s`; `fs/discard.rs`); None (`nodiscard`): never; `Some(0)`: queued, and
    /// discarded only when asked (`Volume::discard_queued`).
    pub discard_rate: Option<u64>,
    /// Mount in a slot the caller already holds (fsck's claim, `cluster/fsck_claim.rs`): no
    /// slot is claimed, and unmount leaves the slot to the caller.
    pub claimed: Option<ClaimedSlot>,
    /// What happens to locks this node holds but has not used for a second
    /// ([`IdleLocks`]).
    pub idle_locks: IdleLocks,
}

/// What a node does with the global lock and inode locks it holds but has not used for a
/// second (docs/locking.md §5, "A hold nobody uses goes back").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IdleLocks {
    /// Give them back (the global lock; inode locks except those of files open here).
    #[default]
    GiveBack,
    /// Keep them until another node asks. For tests that need one node to hold a lock while
    /// others show they work without it; a real node should not: if it dies, what it keeps
    /// stalls the others until it is recovered.
    Keep,
}

/// The slot of [`MountOptions::claimed`], and the slots its holder watched for their dead
/// time before claiming it: recovered by the mount as any mount recovers the dead.
#[derive(Debug, Clone)]
pub struct ClaimedSlot {
    pub member: std::sync::Arc<crate::cluster::Membership>,
    pub dead: Vec<crate::cluster::SlotView>,
}

impl Default for MountOptions {
    fn default() -> Self {
        Self {
            read_only: false,
            host: "localhost".into(),
            machine: None,
            commit_interval: std::time::Duration::from_secs(1),
            file_locks: true,
            caw_renewal: false,
            inode_cache_bytes: super::inode_table::DEFAULT_BUDGET,
            meta_cache_bytes: super::block_cache::DEFAULT_BUDGET,
            bitmap_cache_bytes: crate::alloc::DEFAULT_BITMAP_CACHE,
            inode_locks: None,
            alloc_granule: super::data::DEFAULT_ALLOC_GRANULE,
            watchdog: crate::cluster::watchdog::WatchdogSpec::Off,
            mountpoint: None,
            reservations: None,
            discard_rate: Some(super::discard::DEFAULT_RATE),
            claimed: None,
            idle_locks: IdleLocks::GiveBack,
        }
    }
}
