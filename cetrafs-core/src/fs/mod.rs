//! The filesystem API: [`Volume`] is one mounted CetraFS on one node. The FUSE adapter is a
//! thin translation onto these methods; tests call them directly on a memory device.

pub mod types;

pub use types::*;

use crate::dev::SharedDevice;
use crate::error::Result;
use std::sync::Arc;

/// An open file. Handed to the kernel as a raw pointer inside the FUSE file handle so the data
/// path needs no volume-wide table lookup.
#[derive(Debug)]
pub struct OpenFile {
    pub ino: Ino,
    pub writable: bool,
}

#[derive(Debug)]
pub struct Volume {
    _dev: SharedDevice,
}

#[allow(unused_variables, clippy::missing_errors_doc)]
impl Volume {
    /// Mount: read and validate the superblock (falling back to the backup), load allocation
    /// state. Errors are one line a sysadmin can act on.
    pub fn mount(dev: SharedDevice, opts: &MountOptions) -> Result<Arc<Volume>> { todo!() }
    /// Flush everything; the volume must not be used afterwards.
    pub fn unmount(&self) -> Result<()> { todo!() }
    pub fn root_ino(&self) -> Ino { todo!() }
    pub fn is_read_only(&self) -> bool { todo!() }

    pub fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr> { todo!() }
    /// The kernel dropped its references to `ino`: a chance to free open-unlinked inodes.
    pub fn forget(&self, ino: Ino) { todo!() }
    pub fn getattr(&self, ino: Ino) -> Result<Attr> { todo!() }
    pub fn setattr(&self, ino: Ino, set: &SetAttr, caller: Caller) -> Result<Attr> { todo!() }
    /// Regular files, fifos, sockets and device nodes (mode includes the S_IF* type).
    pub fn mknod(&self, parent: Ino, name: &[u8], mode: u32, rdev: u64, caller: Caller) -> Result<Attr> { todo!() }
    pub fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, caller: Caller) -> Result<Attr> { todo!() }
    pub fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], caller: Caller) -> Result<Attr> { todo!() }
    pub fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> Result<Attr> { todo!() }
    pub fn unlink(&self, parent: Ino, name: &[u8]) -> Result<()> { todo!() }
    pub fn rmdir(&self, parent: Ino, name: &[u8]) -> Result<()> { todo!() }
    pub fn rename(&self, parent: Ino, name: &[u8], new_parent: Ino, new_name: &[u8], flags: RenameFlags) -> Result<()> { todo!() }
    pub fn readlink(&self, ino: Ino) -> Result<Vec<u8>> { todo!() }
    /// Entries after cookie `offset` (0 = start; "." and ".." included). `emit` returns false
    /// when the reply buffer is full; the entry it refused will be offered again next time.
    pub fn readdir(&self, ino: Ino, offset: u64, emit: &mut dyn FnMut(&DirListEntry) -> bool) -> Result<()> { todo!() }

    pub fn open(&self, ino: Ino, writable: bool, truncate: bool) -> Result<Arc<OpenFile>> { todo!() }
    /// Create and open a regular file in one step (O_CREAT); `excl` gives EEXIST if it exists.
    pub fn create(&self, parent: Ino, name: &[u8], mode: u32, caller: Caller, excl: bool) -> Result<(Attr, Arc<OpenFile>)> { todo!() }
    pub fn release(&self, fh: &Arc<OpenFile>) -> Result<()> { todo!() }
    /// Read up to `size` bytes at `offset`; `reply` receives the bytes (short at EOF).
    pub fn read(&self, fh: &OpenFile, offset: u64, size: u32, reply: &mut dyn FnMut(&[u8])) -> Result<()> { todo!() }
    pub fn write(&self, fh: &OpenFile, offset: u64, data: &[u8]) -> Result<u32> { todo!() }
    /// Make the file's data (and with !datasync its metadata) durable.
    pub fn fsync(&self, ino: Ino, datasync: bool) -> Result<()> { todo!() }
    pub fn fallocate(&self, ino: Ino, offset: u64, len: u64, mode: FallocMode) -> Result<()> { todo!() }
    pub fn lseek(&self, ino: Ino, offset: u64, whence: Whence) -> Result<u64> { todo!() }

    pub fn statfs(&self) -> Result<StatFs> { todo!() }
    pub fn getxattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>> { todo!() }
    /// flags: XATTR_CREATE / XATTR_REPLACE semantics.
    pub fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], create: bool, replace: bool) -> Result<()> { todo!() }
    pub fn listxattr(&self, ino: Ino) -> Result<Vec<Vec<u8>>> { todo!() }
    pub fn removexattr(&self, ino: Ino, name: &[u8]) -> Result<()> { todo!() }
    /// FS_IOC_GETFLAGS / FS_IOC_SETFLAGS (immutable, append-only, noatime).
    pub fn get_flags(&self, ino: Ino) -> Result<u32> { todo!() }
    pub fn set_flags(&self, ino: Ino, flags: u32) -> Result<()> { todo!() }
    /// Flush all dirty state (syncfs).
    pub fn sync(&self) -> Result<()> { todo!() }
}
