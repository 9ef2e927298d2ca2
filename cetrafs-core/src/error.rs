//! One error type for the whole core: a small, stable [`ErrorKind`] that callers match on,
//! a human context string, and an optional source. `cetrafs-fuse` maps kinds to errno in one
//! place; binaries print `Display`, which is one line a sysadmin can act on.

use std::fmt;

/// What went wrong, as far as a caller needs to decide what to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    NotFound,
    Exists,
    NotEmpty,
    NotDir,
    IsDir,
    NoSpace,
    Busy,
    InvalidInput,
    NameTooLong,
    PermissionDenied,
    ReadOnly,
    /// Data on disk failed validation (bad magic, crc, out-of-range field).
    Corrupted,
    /// The device or request is not supported (no CAW, wrong geometry, unknown incompat feature).
    Unsupported,
    /// The node lost its lease; it must not write again under this generation.
    Fenced,
    Io,
    NoData,
    Range,
    /// An argument larger than the interface allows (an xattr value past 64 KiB): E2BIG.
    TooBig,
    CrossDevice,
    TooManyLinks,
    /// `SEEK_DATA`/`SEEK_HOLE` past the end, or no more data.
    NoSuchOffset,
    /// Internal: a change without the global lock (`fs/detached_ns.rs`) met something that
    /// needs the lock before it changed anything; the caller takes the global path instead.
    /// Never returned to a user (EIO if it were).
    NeedsGlobalLock,
    /// Internal: a read under the global lock found an inode's lock held elsewhere and not
    /// given up within a moment (its holder may be dead) before it read anything that
    /// matters; the caller gives the global lock and the metadata mutex up, waits for that
    /// lock ([`Error::lock_wait`]) without them, and starts again (`Volume::read_op`). A
    /// change that met it before it changed anything waits so too, for a hold it could own,
    /// or for another node's mark to go from a group it must free blocks into. Never
    /// returned to a user (EIO if it were).
    WaitForLock,
}

/// What an [`ErrorKind::WaitForLock`] waits for, holding no lock of this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockWait {
    /// Inode `ino`'s lock, to be held shared (a read) or to be free of every other node's
    /// hold (`exclusive`: a change that owns it).
    Inode { ino: u64, exclusive: bool },
    /// Another node's mark on allocation group `group` (its refill; a dead node's stays
    /// until its recovery), to go: a free into the group needs this node's mark there.
    GroupMark { group: u64 },
}

#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    context: String,
    /// The lock [`ErrorKind::WaitForLock`] waits for.
    lock_wait: Option<LockWait>,
    /// [`ErrorKind::NoSpace`] while freed blocks waited for the commit point after this many.
    frees_wait: Option<u64>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, context: impl Into<String>) -> Self {
        Self {
            kind,
            context: context.into(),
            lock_wait: None,
            frees_wait: None,
            source: None,
        }
    }

    /// [`ErrorKind::WaitForLock`] for inode `ino`'s lock, to hold it shared or, if
    /// `exclusive`, until no other node holds it.
    pub fn wait_for_inode_lock(ino: u64, exclusive: bool) -> Self {
        Self {
            lock_wait: Some(LockWait::Inode { ino, exclusive }),
            ..Self::new(
                ErrorKind::WaitForLock,
                format!("the lock of inode {ino} is held by another node"),
            )
        }
    }

    /// [`ErrorKind::WaitForLock`] for another node's mark to go from allocation group
    /// `group`.
    pub fn wait_for_group_mark(group: u64) -> Self {
        Self {
            lock_wait: Some(LockWait::GroupMark { group }),
            ..Self::new(
                ErrorKind::WaitForLock,
                format!("allocation group {group} is being changed by the node that owns it"),
            )
        }
    }

    /// The lock an [`ErrorKind::WaitForLock`] waits for.
    pub fn lock_wait(&self) -> Option<LockWait> {
        self.lock_wait
    }

    /// [`ErrorKind::NoSpace`] of an allocation that found no space while blocks freed
    /// since commit point number `commit_points` waited for the next one.
    pub fn no_space_until_commit(context: impl Into<String>, commit_points: u64) -> Self {
        Self {
            frees_wait: Some(commit_points),
            ..Self::new(ErrorKind::NoSpace, context)
        }
    }

    /// For [`Error::no_space_until_commit`]: the commit point after which freed blocks
    /// waited (the space the next commit point makes usable).
    pub fn frees_wait(&self) -> Option<u64> {
        self.frees_wait
    }

    pub fn with_source(
        kind: ErrorKind,
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            kind,
            context: context.into(),
            lock_wait: None,
            frees_wait: None,
            source: Some(Box::new(source)),
        }
    }

    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::with_source(ErrorKind::Io, context, source)
    }

    pub fn corrupted(context: impl Into<String>) -> Self {
        Self::new(ErrorKind::Corrupted, context)
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn context(&self) -> &str {
        &self.context
    }

    /// Prefix more context, keeping kind and source: "while mounting: <old context>".
    #[must_use]
    pub fn wrap(mut self, outer: impl fmt::Display) -> Self {
        self.context = format!("{outer}: {}", self.context);
        self
    }

    /// The raw OS error, if the source is an I/O error.
    pub fn raw_os_error(&self) -> Option<i32> {
        self.source
            .as_ref()
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .and_then(std::io::Error::raw_os_error)
    }

    /// The errno this error should surface as through POSIX interfaces.
    pub fn errno(&self) -> i32 {
        match self.kind {
            ErrorKind::NotFound => libc::ENOENT,
            ErrorKind::Exists => libc::EEXIST,
            ErrorKind::NotEmpty => libc::ENOTEMPTY,
            ErrorKind::NotDir => libc::ENOTDIR,
            ErrorKind::IsDir => libc::EISDIR,
            ErrorKind::NoSpace => libc::ENOSPC,
            ErrorKind::Busy => libc::EBUSY,
            ErrorKind::InvalidInput => libc::EINVAL,
            ErrorKind::NameTooLong => libc::ENAMETOOLONG,
            ErrorKind::PermissionDenied => libc::EPERM,
            ErrorKind::ReadOnly => libc::EROFS,
            ErrorKind::Unsupported => libc::EOPNOTSUPP,
            ErrorKind::NoData => libc::ENODATA,
            ErrorKind::Range => libc::ERANGE,
            ErrorKind::TooBig => libc::E2BIG,
            ErrorKind::CrossDevice => libc::EXDEV,
            ErrorKind::TooManyLinks => libc::EMLINK,
            ErrorKind::NoSuchOffset => libc::ENXIO,
            ErrorKind::Corrupted
            | ErrorKind::Fenced
            | ErrorKind::Io
            | ErrorKind::NeedsGlobalLock
            | ErrorKind::WaitForLock => libc::EIO,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.context)?;
        if let Some(s) = &self.source {
            write!(f, ": {s}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|s| &**s as &(dyn std::error::Error + 'static))
    }
}

/// Shorthand for early returns: `bail!(NotFound, "no such entry {name:?}")`.
#[macro_export]
macro_rules! bail {
    ($kind:ident, $($arg:tt)*) => {
        return Err($crate::Error::new($crate::ErrorKind::$kind, format!($($arg)*)))
    };
}
