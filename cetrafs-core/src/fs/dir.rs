//! Directories and the namespace operations on them.

use super::acl;
use super::btree::Tree;
use super::txn::Tx;
use super::{
    now, Attr, Caller, DirListEntry, EntryAttr, FileKind, Ino, InodeInner, OpenFile, RenameFlags,
    Volume,
};
use crate::error::{Error, ErrorKind, Result};
use crate::format::dirent::{decode_entries, encode_entries, name_hash, DirEntry, MAX_NAME};
use crate::format::inode::{flags, Inode};
use std::sync::Arc;

fn check_name(name: &[u8]) -> Result<()> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        bail!(
            InvalidInput,
            "invalid file name {:?}",
            String::from_utf8_lossy(name)
        );
    }
    if name.len() > MAX_NAME {
        bail!(NameTooLong, "file name longer than {MAX_NAME} bytes");
    }
    Ok(())
}

/// Up to about `max` entries of directory `dir` from cookie `offset` on ("." and ".." first),
/// for [`Volume::readdir`].
fn list_batch(tx: &mut Tx<'_>, dir: &Inode, offset: u64, max: usize) -> Result<Vec<DirListEntry>> {
    let mut batch = Vec::with_capacity(max + 2);
    if offset < 1 {
        batch.push(DirListEntry {
            ino: dir.ino,
            kind: FileKind::Directory,
            name: b".".to_vec(),
            next: 1,
        });
    }
    if offset < 2 {
        batch.push(DirListEntry {
            ino: dir.parent,
            kind: FileKind::Directory,
            name: b"..".to_vec(),
            next: 2,
        });
    }
    if dir.tree_root != 0 {
        let mut t = Tree::new(tx, dir.tree_root, dir.ino);
        t.scan_from(
            offset.max(crate::format::dirent::FIRST_HASH_KEY),
            &mut |k, v| {
                for e in decode_entries(v)? {
                    let kind = FileKind::from_dtype(e.dtype).unwrap_or(FileKind::Regular);
                    batch.push(DirListEntry {
                        ino: e.ino,
                        kind,
                        name: e.name,
                        next: k + 1,
                    });
                }
                Ok(batch.len() < max)
            },
        )?;
    }
    Ok(batch)
}

/// Look a name up in a directory inode.
pub(crate) fn dir_lookup(tx: &mut Tx<'_>, dir: &Inode, name: &[u8]) -> Result<Option<DirEntry>> {
    if dir.tree_root == 0 {
        return Ok(None);
    }
    let mut t = Tree::new(tx, dir.tree_root, dir.ino);
    let Some(v) = t.get(name_hash(name))? else {
        return Ok(None);
    };
    Ok(decode_entries(&v)?.into_iter().find(|e| e.name == name))
}

pub(super) fn dir_insert(tx: &mut Tx<'_>, dir: &mut Inode, e: DirEntry) -> Result<()> {
    if dir.tree_root == 0 {
        dir.tree_root = Tree::create(tx, dir.ino)?;
        dir.blocks += 1;
    }
    let key = name_hash(&e.name);
    let mut t = Tree::new(tx, dir.tree_root, dir.ino);
    let mut list = match t.get(key)? {
        Some(v) => decode_entries(&v)?,
        None => Vec::new(),
    };
    list.retain(|x| x.name != e.name);
    list.push(e);
    t.insert(key, &encode_entries(&list))?;
    dir.blocks = dir.blocks.saturating_add_signed(t.delta);
    Ok(())
}

fn dir_remove(tx: &mut Tx<'_>, dir: &mut Inode, name: &[u8]) -> Result<()> {
    let key = name_hash(name);
    let mut t = Tree::new(tx, dir.tree_root, dir.ino);
    let mut list = match t.get(key)? {
        Some(v) => decode_entries(&v)?,
        None => bail!(NotFound, "no entry {:?}", String::from_utf8_lossy(name)),
    };
    list.retain(|x| x.name != name);
    if list.is_empty() {
        t.remove(key)?;
    } else {
        t.insert(key, &encode_entries(&list))?;
    }
    dir.blocks = dir.blocks.saturating_add_signed(t.delta);
    Ok(())
}

fn dir_is_empty(tx: &mut Tx<'_>, dir: &Inode) -> Result<bool> {
    if dir.tree_root == 0 {
        return Ok(true);
    }
    Tree::new(tx, dir.tree_root, dir.ino).is_empty()
}

/// A whiteout (overlayfs, `RENAME_WHITEOUT)`: a character device with device number 0/0 and
/// no permission bits, as the kernel's `vfs_whiteout` makes it.
const WHITEOUT_MODE: u32 = libc::S_IFCHR;

fn kind_of(inode: &Inode) -> FileKind {
    FileKind::from_mode(inode.mode).unwrap_or(FileKind::Regular)
}

impl Volume {
    pub(super) fn dir_state(&self, tx: &mut Tx<'_>, ino: Ino) -> Result<Arc<super::InodeState>> {
        let st = self.state(tx, ino)?;
        if !st.read().inode.is_dir() {
            bail!(NotDir, "inode {ino} is not a directory");
        }
        Ok(st)
    }

    pub fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr> {
        if name.len() > MAX_NAME {
            bail!(NameTooLong, "file name longer than {MAX_NAME} bytes");
        }
        if let Some(r) = self.lookup_owned(parent, name) {
            return r;
        }
        self.read_or_by_own_locks(
            |tx| self.lookup_in(tx, parent, name),
            || self.lookup_by_own_locks(parent, name),
        )
    }

    /// [`Volume::lookup`] under the global lock (`tx`).
    fn lookup_in(&self, tx: &mut Tx<'_>, parent: Ino, name: &[u8]) -> Result<Attr> {
        let dst = self.dir_state(tx, parent)?;
        let (target, named) = {
            let d = dst.read();
            if name == b"." {
                (d.inode.ino, false)
            } else if name == b".." {
                (d.inode.parent, false)
            } else {
                match dir_lookup(tx, &d.inode, name)? {
                    Some(e) => (e.ino, true),
                    None => bail!(NotFound, "no entry {:?}", String::from_utf8_lossy(name)),
                }
            }
        };
        // The name exists (read in this same transaction): an inode that does not is damage,
        // not absence — EIO, so the entry is never mistaken for one that was removed.
        let st = if named {
            self.state_of_name(tx, target)
        } else {
            self.state(tx, target)
        };
        let st = st.map_err(|e| {
            if e.kind() == ErrorKind::NotFound {
                Error::corrupted(format!(
                    "directory {parent}: entry {:?} names inode {target}, which does not exist; run fsck.cetra",
                    String::from_utf8_lossy(name)
                ))
            } else {
                e
            }
        })?;
        Ok(Self::attr_with_pending(&st))
    }

    /// The attributes to list with entry `e` of directory `dir` (readdirplus), and whether to
    /// list it at all. Every name that is in the directory is listed: one whose inode cannot
    /// be loaded comes back [`EntryAttr::Unreadable`] with a warning in the log naming the
    /// directory, the name and the error. Only a name that is no longer in the directory
    /// (looked up again after the failure) is [`EntryAttr::Gone`]. While every holder of the
    /// global lock is silent, an inode this node cannot validate by its own lock is listed
    /// so as well (with its generation), without a warning, unless the kernel knows it
    /// (`fs/own_lock_reads.rs`): its name now, its attributes at the `stat` that follows.
    pub fn entry_attr(&self, dir: Ino, e: &DirListEntry) -> EntryAttr {
        let first = match self.loaded_state_unless_stalled(e.ino) {
            Ok(Some(st)) => Ok(st),
            Ok(None) => match self.listed_without_attributes(e) {
                Some(a) => return EntryAttr::Unreadable(a),
                None => self.loaded_state(e.ino),
            },
            Err(err) => Err(err),
        };
        if let Ok(st) = first {
            return EntryAttr::Loaded(Self::attr_with_pending(&st));
        }
        match self.lookup(dir, &e.name) {
            // Loaded on the second try, or the name now names another inode (renamed over).
            Ok(a) => EntryAttr::Loaded(a),
            Err(err) if err.kind() == ErrorKind::NotFound => EntryAttr::Gone,
            Err(err) => {
                tracing::warn!(
                    "directory {dir}: entry {:?} (inode {}) cannot be read, listing it without attributes: {err}",
                    String::from_utf8_lossy(&e.name),
                    e.ino
                );
                EntryAttr::Unreadable(Attr::placeholder(e.ino, e.kind))
            }
        }
    }

    /// Allocate and link a new inode; returns its state (write-locked by the caller after).
    #[allow(clippy::too_many_arguments)] // one call site per inode kind, all in this file
    fn new_inode(
        &self,
        tx: &mut Tx<'_>,
        parent: Ino,
        name: &[u8],
        mode: u32,
        rdev: u64,
        caller: Caller,
        target: &[u8],
    ) -> Result<Arc<super::InodeState>> {
        self.check_writable()?;
        check_name(name)?;
        let kind = FileKind::from_mode(mode).ok_or_else(|| {
            Error::new(ErrorKind::InvalidInput, format!("bad file mode {mode:#o}"))
        })?;
        let pst = self.dir_state(tx, parent)?;
        let mut p = pst.write();
        if p.inode.nlink == 0 {
            bail!(NotFound, "directory {parent} was removed");
        }
        if p.inode.flags & flags::IMMUTABLE != 0 {
            bail!(PermissionDenied, "directory {parent} is immutable");
        }
        if dir_lookup(tx, &p.inode, name)?.is_some() {
            bail!(Exists, "{:?} exists", String::from_utf8_lossy(name));
        }
        // Without the global lock (fs/detached_ns.rs): no xattr set to inherit a default ACL
        // from (a set allocates runs), no symlink (its target may need an overflow block).
        if tx.is_detached() && (p.inode.xattr_block != 0 || kind == FileKind::Symlink) {
            bail!(
                NeedsGlobalLock,
                "a create in directory {parent} needs the global lock"
            );
        }
        self.own_first(tx, &[parent], &[])?;
        let ino = tx.alloc_one(parent)?;
        if tx.is_detached() {
            // Known to no other node until this directory's hold goes (fs/detached_ns.rs).
            self.detached.mark_fresh(ino, parent);
        }
        let st = self
            .init_inode(tx, ino, &p.inode, kind, mode, rdev, caller, target)
            .inspect_err(|_| self.discard_new_inode(tx, ino))?;
        let entry = DirEntry {
            name: name.to_vec(),
            ino,
            dtype: kind.dtype(),
        };
        dir_insert(tx, &mut p.inode, entry).inspect_err(|_| self.discard_new_inode(tx, ino))?;
        if kind == FileKind::Directory {
            p.inode.nlink += 1;
        }
        let t = now();
        p.inode.mtime = t;
        p.inode.ctime = t;
        self.save(tx, &mut p)?;
        Ok(st)
    }

    /// Write a fresh inode into block `ino` (already allocated) for a new entry of directory
    /// `parent`, and cache its state. Linking it into the directory is the caller's.
    #[allow(clippy::too_many_arguments)] // new_inode's and the whiteout's one definition
    fn init_inode(
        &self,
        tx: &mut Tx<'_>,
        ino: Ino,
        parent: &Inode,
        kind: FileKind,
        mode: u32,
        rdev: u64,
        caller: Caller,
        target: &[u8],
    ) -> Result<Arc<super::InodeState>> {
        let t = now();
        // setgid directories pass their group (and, for directories, the bit) on.
        let sgid_dir = parent.mode & libc::S_ISGID != 0;
        let gid = if sgid_dir { parent.gid } else { caller.gid };
        let mut mode = mode;
        if sgid_dir && kind == FileKind::Directory {
            mode |= libc::S_ISGID;
        }
        // The umask, or the parent's default ACL (the kernel's posix_acl_create); symlinks
        // take neither. The ACLs are stored below, in this same transaction.
        let inherited = if kind == FileKind::Symlink {
            None
        } else {
            let parent_default = super::attrs::load_xattrs(tx, &self.sb, parent)?
                .map
                .remove(acl::DEFAULT);
            let inh = acl::inherit(
                parent_default.as_deref(),
                mode,
                caller.umask,
                kind == FileKind::Directory,
            );
            mode = inh.mode;
            Some(inh)
        };
        let prior = tx.prior_seq(ino)?;
        let mut inode = Inode {
            ino,
            seq: prior,
            mode,
            uid: caller.uid,
            gid,
            nlink: if kind == FileKind::Directory { 2 } else { 1 },
            flags: if kind == FileKind::Regular {
                flags::INLINE_EXTENTS
            } else {
                0
            },
            generation: rand::random(),
            size: target.len() as u64,
            rdev,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            blocks: 1,
            parent: if kind == FileKind::Directory {
                parent.ino
            } else {
                0
            },
            ..Default::default()
        };
        if kind == FileKind::Symlink {
            super::attrs::store_symlink_target(tx, &self.sb, &mut inode, target)?;
        }
        if let Some(inh) = inherited {
            let acls = [(acl::ACCESS, inh.access), (acl::DEFAULT, inh.default)];
            if acls.iter().any(|(_, v)| v.is_some()) {
                let mut set = super::attrs::load_xattrs(tx, &self.sb, &inode)?;
                for (name, v) in acls {
                    if let Some(v) = v {
                        set.map.insert(name.to_vec(), v);
                    }
                }
                // A new inode's set held no block: nothing is released.
                super::attrs::store_xattrs(tx, &self.sb, &mut inode, &set)?.free(tx);
            }
        }
        let st = Arc::new(super::InodeState::new(
            inode,
            super::ExtentMap::default(),
            self.cl.epoch.load(std::sync::atomic::Ordering::Acquire),
        ));
        {
            let mut inner = st.write();
            self.save(tx, &mut inner)?;
        }
        self.inodes.insert(st.clone());
        Ok(st)
    }

    /// Undo [`Volume::init_inode`] (and the allocation of `ino`) when linking it failed.
    fn discard_new_inode(&self, tx: &mut Tx<'_>, ino: Ino) {
        if let Some(st) = self.inodes.get(ino) {
            // A long symlink's overflow block goes with it.
            super::attrs::free_owned(tx, &self.sb, &st.read().inode);
        }
        self.inodes.remove(ino);
        self.detached.forget_fresh(ino);
        // Just allocated: its group is loaded, so this reads nothing.
        let _ = tx.free_one(ino);
    }

    /// Create a non-opened inode and return its attributes.
    fn make(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        rdev: u64,
        caller: Caller,
        target: &[u8],
    ) -> Result<Attr> {
        self.names_op(parent, |tx| {
            let st = self.new_inode(tx, parent, name, mode, rdev, caller, target)?;
            let a = Self::attr_of(&st.read().inode);
            Ok(a)
        })
    }

    /// Regular files, fifos, sockets and device nodes (mode includes the `S_IF*` type).
    pub fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        rdev: u64,
        caller: Caller,
    ) -> Result<Attr> {
        if mode & libc::S_IFMT == libc::S_IFDIR || mode & libc::S_IFMT == libc::S_IFLNK {
            bail!(InvalidInput, "mknod cannot create directories or symlinks");
        }
        let mode = if mode & libc::S_IFMT == 0 {
            mode | libc::S_IFREG
        } else {
            mode
        };
        self.make(parent, name, mode, rdev, caller, b"")
    }

    pub fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, caller: Caller) -> Result<Attr> {
        self.make(
            parent,
            name,
            libc::S_IFDIR | (mode & 0o7777),
            0,
            caller,
            b"",
        )
    }

    pub fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], caller: Caller) -> Result<Attr> {
        // The target's length is checked where it is stored (attrs::store_symlink_target).
        self.make(parent, name, libc::S_IFLNK | 0o777, 0, caller, target)
    }

    /// Create and open a regular file in one step (`O_CREAT`); `excl` gives EEXIST if it exists.
    pub fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        caller: Caller,
        excl: bool,
    ) -> Result<(Attr, Arc<OpenFile>)> {
        let r = self.names_op(parent, |tx| {
            let st = self.new_inode(
                tx,
                parent,
                name,
                libc::S_IFREG | (mode & 0o7777),
                0,
                caller,
                b"",
            )?;
            let a = Self::attr_of(&st.read().inode);
            Ok((a, st))
        });
        match r {
            Ok((a, st)) => {
                self.register_open(&st, true)?;
                self.detached.writer_opened();
                Ok((a, Self::open_state(st, true)))
            }
            Err(e) if e.kind() == ErrorKind::Exists && !excl => {
                let a = self.lookup(parent, name)?;
                if a.kind == FileKind::Directory {
                    bail!(IsDir, "{:?} is a directory", String::from_utf8_lossy(name));
                }
                let fh = self.open(a.ino, true, false)?;
                Ok((a, fh))
            }
            Err(e) => Err(e),
        }
    }

    pub fn readlink(&self, ino: Ino) -> Result<Vec<u8>> {
        self.read_op(|tx| {
            let st = self.state(tx, ino)?;
            let inner = st.read();
            if !inner.inode.is_symlink() {
                bail!(InvalidInput, "inode {ino} is not a symlink");
            }
            super::attrs::symlink_target(tx, &self.sb, &inner.inode)
        })
    }

    pub fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> Result<Attr> {
        self.check_writable()?;
        check_name(new_name)?;
        self.restartable_op(|tx| {
            let st = self.state(tx, ino)?;
            let pst = self.dir_state(tx, new_parent)?;
            let mut p = pst.write();
            let mut inner = st.write();
            if inner.inode.is_dir() {
                bail!(
                    PermissionDenied,
                    "hard links to directories are not allowed"
                );
            }
            if inner.inode.flags & (flags::IMMUTABLE | flags::APPEND) != 0 {
                bail!(PermissionDenied, "inode {ino} is immutable or append-only");
            }
            if inner.inode.nlink == 0 {
                bail!(NotFound, "inode {ino} was removed");
            }
            if inner.inode.nlink >= u32::from(u16::MAX) {
                bail!(TooManyLinks, "too many links");
            }
            if dir_lookup(tx, &p.inode, new_name)?.is_some() {
                bail!(Exists, "{:?} exists", String::from_utf8_lossy(new_name));
            }
            self.own_first(tx, &[new_parent], &[ino])?;
            // The count first: never a name more than the inode counts (a name left to a
            // freed inode). A failed save wrote nothing; a failed insert (no space for a
            // split) changed nothing, and the count is saved back (should that fail too, the
            // inode counts a link too many: a leak fsck reports). Either way the count in
            // memory is put back, so that the retry after a commit point counts once.
            let t = now();
            let (nlink, ctime) = (inner.inode.nlink, inner.inode.ctime);
            inner.inode.nlink += 1;
            inner.inode.ctime = t;
            if let Err(e) = self.save(tx, &mut inner) {
                (inner.inode.nlink, inner.inode.ctime) = (nlink, ctime);
                return Err(e);
            }
            let entry = DirEntry {
                name: new_name.to_vec(),
                ino,
                dtype: kind_of(&inner.inode).dtype(),
            };
            if let Err(e) = dir_insert(tx, &mut p.inode, entry) {
                (inner.inode.nlink, inner.inode.ctime) = (nlink, ctime);
                if let Err(undo) = self.save(tx, &mut inner) {
                    tracing::warn!("inode {ino} keeps a link count one too high after a failed link ({e}): {undo}");
                }
                return Err(e);
            }
            p.inode.mtime = t;
            p.inode.ctime = t;
            self.save(tx, &mut p)?;
            Ok(Self::attr_of(&inner.inode))
        })
    }

    /// Drop one link of `child` (already removed from its directory); free it if unused.
    fn drop_link(
        &self,
        tx: &mut Tx<'_>,
        st: &super::InodeState,
        inner: &mut InodeInner,
    ) -> Result<()> {
        let t = now();
        if inner.inode.is_dir() {
            inner.inode.nlink = 0;
        } else {
            inner.inode.nlink = inner.inode.nlink.saturating_sub(1);
        }
        inner.inode.ctime = t;
        if self.can_free(st, inner, super::FreeScope::Now) {
            self.free_inode(tx, inner)
        } else if tx.is_detached() && inner.inode.nlink == 0 {
            // Fresh and small (checked before anything changed). No orphan entry: this node's
            // slot header is changed under the global lock only (another node may remove an
            // entry from it). Instead:
            let ino = inner.inode.ino;
            if st.opens.load(std::sync::atomic::Ordering::Acquire) == 0 {
                // Only the kernel still references its number: freed into the pool now, its
                // block pinned there until the kernel forgets it.
                self.free_inode(tx, inner)?;
                tx.pin_pooled(ino);
                self.detached.hold_for_kernel(ino);
                // A FORGET that came in between found no hold: give the number back here.
                if !self.inodes.referenced(ino) && self.detached.take_kernel_hold(ino) {
                    tx.meta_mut().unpin_pooled(ino);
                }
                Ok(())
            } else {
                // Still open here (mostly a release in flight): *parked*, its one block the
                // pool's on disk, so a crash frees it with the pool; freed at its last close,
                // or put on the orphan list by its next change on the global path.
                tx.park_in_pool(ino);
                self.detached.park(ino);
                self.save(tx, inner)
            }
        } else {
            if inner.inode.nlink == 0 {
                // Open but nameless: remember it so a crash does not leak it.
                tx.add_orphan(inner.inode.ino)?;
            }
            self.save(tx, inner)
        }
    }

    fn remove_entry(&self, parent: Ino, name: &[u8], want_dir: bool) -> Result<()> {
        self.check_writable()?;
        if name == b"." {
            bail!(InvalidInput, "cannot remove \".\"");
        }
        if name == b".." {
            bail!(NotEmpty, "cannot remove \"..\"");
        }
        self.names_op(parent, |tx| {
            let pst = self.dir_state(tx, parent)?;
            let mut p = pst.write();
            let Some(e) = dir_lookup(tx, &p.inode, name)? else {
                bail!(NotFound, "no entry {:?}", String::from_utf8_lossy(name));
            };
            self.check_fresh(tx, e.ino)?;
            let st = self.state(tx, e.ino)?;
            let mut inner = st.write();
            self.check_detached_free(tx, &st, &inner)?;
            let is_dir = inner.inode.is_dir();
            if want_dir && !is_dir {
                bail!(
                    NotDir,
                    "{:?} is not a directory",
                    String::from_utf8_lossy(name)
                );
            }
            if !want_dir && is_dir {
                bail!(IsDir, "{:?} is a directory", String::from_utf8_lossy(name));
            }
            if (inner.inode.flags | p.inode.flags) & (flags::IMMUTABLE | flags::APPEND) != 0 {
                bail!(
                    PermissionDenied,
                    "{:?} or its directory is immutable or append-only",
                    String::from_utf8_lossy(name)
                );
            }
            if is_dir && !dir_is_empty(tx, &inner.inode)? {
                bail!(
                    NotEmpty,
                    "directory {:?} is not empty",
                    String::from_utf8_lossy(name)
                );
            }
            if is_dir {
                self.own_first(tx, &[parent, e.ino], &[])?;
            } else {
                self.own_first(tx, &[parent], &[e.ino])?;
            }
            if is_dir || inner.inode.nlink <= 1 {
                // The last link may free the inode: nothing changes unless that can be done.
                Self::prepare_inode_free(tx, &inner)?;
            }
            dir_remove(tx, &mut p.inode, name)?;
            if is_dir {
                p.inode.nlink -= 1;
            }
            let t = now();
            p.inode.mtime = t;
            p.inode.ctime = t;
            self.save(tx, &mut p)?;
            self.drop_link(tx, &st, &mut inner)
        })
    }

    pub fn unlink(&self, parent: Ino, name: &[u8]) -> Result<()> {
        self.remove_entry(parent, name, false)
    }

    pub fn rmdir(&self, parent: Ino, name: &[u8]) -> Result<()> {
        self.remove_entry(parent, name, true)
    }

    /// Is `ancestor` on the path from `dir` up to the root?
    fn is_ancestor(&self, tx: &mut Tx<'_>, ancestor: Ino, mut dir: Ino) -> Result<bool> {
        for _ in 0..100_000 {
            if dir == ancestor {
                return Ok(true);
            }
            if dir == self.sb.root_ino {
                return Ok(false);
            }
            dir = self.state(tx, dir)?.read().inode.parent;
        }
        Err(Error::corrupted(
            "directory parent chain does not reach the root",
        ))
    }

    pub fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        rflags: RenameFlags,
    ) -> Result<()> {
        self.check_writable()?;
        check_name(name)?;
        check_name(new_name)?;
        if rflags.exchange && (rflags.noreplace || rflags.whiteout.is_some()) {
            bail!(
                InvalidInput,
                "RENAME_EXCHANGE with RENAME_NOREPLACE or RENAME_WHITEOUT"
            );
        }
        self.names_op(parent, |tx| {
            // Without the global lock: a plain rename within one directory only.
            if tx.is_detached()
                && (parent != new_parent || rflags.exchange || rflags.whiteout.is_some())
            {
                bail!(NeedsGlobalLock, "this rename needs the global lock");
            }
            let sp = self.dir_state(tx, parent)?;
            let dp = self.dir_state(tx, new_parent)?;
            let src = {
                let p = sp.read();
                dir_lookup(tx, &p.inode, name)?.ok_or_else(|| {
                    Error::new(
                        ErrorKind::NotFound,
                        format!("no entry {:?}", String::from_utf8_lossy(name)),
                    )
                })?
            };
            let dst = {
                let p = dp.read();
                dir_lookup(tx, &p.inode, new_name)?
            };
            self.check_fresh(tx, src.ino)?;
            if let Some(d) = &dst {
                self.check_fresh(tx, d.ino)?;
            }
            let sst = self.state(tx, src.ino)?;
            let src_dir = sst.read().inode.is_dir();
            if sst.read().inode.flags & (flags::IMMUTABLE | flags::APPEND) != 0 {
                bail!(
                    PermissionDenied,
                    "{:?} is immutable or append-only",
                    String::from_utf8_lossy(name)
                );
            }
            // A directory cannot move into its own subtree.
            if src_dir && parent != new_parent && self.is_ancestor(tx, src.ino, new_parent)? {
                bail!(InvalidInput, "cannot move a directory into itself");
            }
            if let Some(d) = &dst {
                if rflags.noreplace {
                    bail!(Exists, "{:?} exists", String::from_utf8_lossy(new_name));
                }
                if d.ino == src.ino {
                    return Ok(()); // same inode: POSIX says do nothing
                }
            }
            let t = now();
            if rflags.exchange {
                let Some(d) = dst else {
                    bail!(NotFound, "no entry {:?}", String::from_utf8_lossy(new_name))
                };
                let dst_st = self.state(tx, d.ino)?;
                let dst_dir = dst_st.read().inode.is_dir();
                if dst_dir && parent != new_parent && self.is_ancestor(tx, d.ino, parent)? {
                    bail!(InvalidInput, "cannot move a directory into itself");
                }
                self.own_first_locking(tx, &[&sp, &dp, &sst, &dst_st])?;
                self.with_parents(
                    tx,
                    &sp,
                    &dp,
                    |tx, s, dd| {
                        dir_insert(
                            tx,
                            s,
                            DirEntry {
                                name: name.to_vec(),
                                ino: d.ino,
                                dtype: d.dtype,
                            },
                        )?;
                        dir_insert(
                            tx,
                            dd,
                            DirEntry {
                                name: new_name.to_vec(),
                                ino: src.ino,
                                dtype: src.dtype,
                            },
                        )?;
                        if parent != new_parent && src_dir != dst_dir {
                            if src_dir {
                                s.nlink -= 1;
                                dd.nlink += 1;
                            } else {
                                s.nlink += 1;
                                dd.nlink -= 1;
                            }
                        }
                        Ok(())
                    },
                    t,
                )?;
                for (st, newp) in [(&sst, new_parent), (&dst_st, parent)] {
                    let mut i = st.write();
                    if i.inode.is_dir() {
                        i.inode.parent = newp;
                    }
                    i.inode.ctime = t;
                    self.save(tx, &mut i)?;
                }
                return Ok(());
            }
            let mut victim = None;
            if let Some(d) = &dst {
                if rflags.noreplace {
                    bail!(Exists, "{:?} exists", String::from_utf8_lossy(new_name));
                }
                let vst = self.state(tx, d.ino)?;
                {
                    let v = vst.read();
                    self.check_detached_free(tx, &vst, &v)?;
                    if v.inode.flags & (flags::IMMUTABLE | flags::APPEND) != 0 {
                        bail!(
                            PermissionDenied,
                            "{:?} is immutable or append-only",
                            String::from_utf8_lossy(new_name)
                        );
                    }
                    if v.inode.is_dir() && !src_dir {
                        bail!(
                            IsDir,
                            "{:?} is a directory",
                            String::from_utf8_lossy(new_name)
                        );
                    }
                    if !v.inode.is_dir() && src_dir {
                        bail!(
                            NotDir,
                            "{:?} is not a directory",
                            String::from_utf8_lossy(new_name)
                        );
                    }
                    if v.inode.is_dir() && !dir_is_empty(tx, &v.inode)? {
                        bail!(
                            NotEmpty,
                            "directory {:?} is not empty",
                            String::from_utf8_lossy(new_name)
                        );
                    }
                }
                victim = Some(vst);
            }
            let victim_dir = victim.as_ref().is_some_and(|v| v.read().inode.is_dir());
            {
                let mut changed = vec![&sp, &dp, &sst];
                changed.extend(victim.as_ref());
                self.own_first_locking(tx, &changed)?;
            }
            if let Some(v) = &victim {
                let v = v.read();
                if victim_dir || v.inode.nlink <= 1 {
                    // Its last link may free it: nothing changes unless that can be done.
                    Self::prepare_inode_free(tx, &v)?;
                }
            }
            // The whiteout inode is written before any entry changes, so that a failure
            // leaves the rename undone rather than done without its whiteout.
            let whiteout = match rflags.whiteout {
                None => None,
                Some(who) => {
                    let ino = tx.alloc_one(parent)?;
                    let p = sp.read().inode.clone();
                    self.init_inode(
                        tx,
                        ino,
                        &p,
                        FileKind::CharDevice,
                        WHITEOUT_MODE,
                        0,
                        who,
                        b"",
                    )
                    .inspect_err(|_| self.discard_new_inode(tx, ino))?;
                    Some(ino)
                }
            };
            let moved = self.with_parents(
                tx,
                &sp,
                &dp,
                |tx, s, dd| {
                    dir_insert(
                        tx,
                        dd,
                        DirEntry {
                            name: new_name.to_vec(),
                            ino: src.ino,
                            dtype: src.dtype,
                        },
                    )?;
                    let old_name = match whiteout {
                        // Replaces the source's entry under the same name.
                        Some(w) => dir_insert(
                            tx,
                            s,
                            DirEntry {
                                name: name.to_vec(),
                                ino: w,
                                dtype: FileKind::CharDevice.dtype(),
                            },
                        ),
                        None => dir_remove(tx, s, name),
                    };
                    if let Err(e) = old_name {
                        // The new name is in the running transaction, which commits even on
                        // error: the file would keep both names with one link (a directory
                        // two parents). Only a failed read of the source directory's tree
                        // gets here (a node it empties that cannot be freed is leaked):
                        // fence, so that the half-made rename never reaches the LUN.
                        tx.fail_node(
                            &e,
                            &format!("a rename of inode {} (the new name was added)", src.ino),
                        );
                        return Err(e);
                    }
                    if src_dir && parent != new_parent {
                        s.nlink -= 1;
                        dd.nlink += 1;
                    }
                    if victim_dir {
                        dd.nlink -= 1;
                    }
                    Ok(())
                },
                t,
            );
            if let (Err(_), Some(w)) = (&moved, whiteout) {
                self.discard_new_inode(tx, w);
            }
            moved?;
            {
                let mut i = sst.write();
                if src_dir {
                    i.inode.parent = new_parent;
                }
                i.inode.ctime = t;
                self.save(tx, &mut i)?;
            }
            if let Some(vst) = victim {
                let mut v = vst.write();
                self.drop_link(tx, &vst, &mut v)?;
            }
            Ok(())
        })
    }

    /// Run `f` on the source and destination directory inodes (the same one when equal), then
    /// stamp and save them.
    fn with_parents(
        &self,
        tx: &mut Tx<'_>,
        sp: &Arc<super::InodeState>,
        dp: &Arc<super::InodeState>,
        f: impl FnOnce(&mut Tx<'_>, &mut Inode, &mut Inode) -> Result<()>,
        t: crate::format::inode::Timespec,
    ) -> Result<()> {
        if Arc::ptr_eq(sp, dp) {
            let mut s = sp.write();
            // Same directory in both roles: run the destination role on a copy and fold its
            // effect on the in-memory counters back (the tree itself is shared through tx).
            let orig = s.inode.clone();
            let mut copy = orig.clone();
            f(tx, &mut s.inode, &mut copy)?;
            let delta = |a: u64, b: u64| a.cast_signed() - b.cast_signed();
            s.inode.blocks = s
                .inode
                .blocks
                .saturating_add_signed(delta(copy.blocks, orig.blocks));
            s.inode.nlink = u32::try_from(
                i64::from(s.inode.nlink) + i64::from(copy.nlink) - i64::from(orig.nlink),
            )
            .unwrap_or(0);
            if orig.tree_root == 0 {
                s.inode.tree_root = s.inode.tree_root.max(copy.tree_root);
            }
            s.inode.mtime = t;
            s.inode.ctime = t;
            return self.save(tx, &mut s);
        }
        let mut s = sp.write();
        let mut d = dp.write();
        f(tx, &mut s.inode, &mut d.inode)?;
        for i in [&mut s, &mut d] {
            i.inode.mtime = t;
            i.inode.ctime = t;
        }
        self.save(tx, &mut s)?;
        self.save(tx, &mut d)
    }

    /// Entries after cookie `offset` (0 = start; "." and ".." included). `emit` returns false
    /// when the reply buffer is full; the entry it refused will be offered again next time.
    ///
    /// Entries are gathered in batches under the metadata lock and handed to `emit` after it
    /// is released, so `emit` may call back into the volume (readdirplus does getattr).
    /// Names that share a 63-bit hash share one cookie; if the reply fills up between them,
    /// the rest of that (vanishingly rare) group is skipped.
    pub fn readdir(
        &self,
        ino: Ino,
        offset: u64,
        emit: &mut dyn FnMut(&DirListEntry) -> bool,
    ) -> Result<()> {
        const BATCH: usize = 256;
        let mut offset = offset;
        loop {
            // A directory another node holds (perhaps a dead one) is waited for holding
            // nothing else (`Volume::read_op`).
            let batch = self.read_or_by_own_locks(
                |tx| {
                    let st = self.dir_state(tx, ino)?;
                    let inode = st.read().inode.clone();
                    list_batch(tx, &inode, offset, BATCH)
                },
                || {
                    self.read_dir_by_own_lock(ino, |tx, d| list_batch(tx, d, offset, BATCH))
                        .map(Ok)
                },
            )?;
            let Some(last) = batch.last().map(|e| e.next) else {
                return Ok(());
            };
            let full = batch.len() >= BATCH;
            for e in &batch {
                if !emit(e) {
                    return Ok(());
                }
            }
            if !full {
                return Ok(());
            }
            offset = last;
        }
    }
}
