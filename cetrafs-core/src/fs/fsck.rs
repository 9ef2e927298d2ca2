//! The namespace repairs `fsck.cetra -y` makes through the filesystem, on a volume it has
//! mounted in its own claimed slot (`MountOptions::claimed`): removing a directory entry
//! without touching the inode it names (which may not be one), moving an entry stored under
//! the wrong hash, dropping a name's second entry, and linking an unreachable inode into
//! `/lost+found`. The other repairs write blocks directly (`check/repair.rs`); these
//! change directory trees, which only the filesystem's transactions do safely (splits, merges,
//! block counts).

use super::btree::Tree;
use super::dir::{dir_insert, dir_lookup};
use super::{now, Caller, FileKind, Ino, Volume};
use crate::error::{Error, ErrorKind, Result};
use crate::format::dirent::{decode_entries, encode_entries, DirEntry};

/// The directory unreachable inodes are linked into, in the root.
pub const LOST_AND_FOUND: &[u8] = b"lost+found";

/// What a repair makes of one directory record (the entries under one name hash): None when
/// it has nothing to change, else the entries to keep (none: the record goes).
type RecordEdit<'a> = dyn Fn(&[u8]) -> Result<Option<Vec<DirEntry>>> + 'a;

impl Volume {
    /// One transaction on directory `dir`'s entry tree: `change` edits it (and the inode's
    /// block count); when it says it changed something, the times follow and the inode is
    /// saved. A directory without a tree: nothing (false).
    fn fsck_change_dir(
        &self,
        dir: Ino,
        change: impl FnOnce(&mut super::txn::Tx<'_>, &mut crate::format::inode::Inode) -> Result<bool>,
    ) -> Result<bool> {
        self.check_writable()?;
        self.meta_op(|tx| {
            let st = self.dir_state(tx, dir)?;
            let mut d = st.write();
            if d.inode.tree_root == 0 || !change(tx, &mut d.inode)? {
                return Ok(false);
            }
            let t = now();
            d.inode.mtime = t;
            d.inode.ctime = t;
            self.save(tx, &mut d)?;
            Ok(true)
        })
    }

    /// Rewrite the record under `hash` in directory `dir` as `edit` says, in one transaction
    /// (the directory's block count and times follow). Returns whether it changed anything.
    fn fsck_edit_record(&self, dir: Ino, hash: u64, edit: &RecordEdit<'_>) -> Result<bool> {
        self.fsck_change_dir(dir, |tx, inode| {
            let mut t = Tree::new(tx, inode.tree_root, dir);
            let Some(value) = t.get(hash)? else {
                return Ok(false);
            };
            match edit(&value)? {
                None => return Ok(false),
                Some(list) if list.is_empty() => {
                    t.remove(hash)?;
                }
                Some(list) => t.insert(hash, &encode_entries(&list))?,
            }
            let delta = t.delta;
            inode.blocks = inode.blocks.saturating_add_signed(delta);
            Ok(true)
        })
    }

    /// Move entry `name`, stored under `hash`, which is not its name's hash, to the record of
    /// its name's hash; if the directory already has an entry of that name there, the
    /// misplaced one is dropped (its inode's link count is left to the link-count repair).
    /// One transaction. Returns whether there was such an entry.
    pub fn fsck_rehash_entry(&self, dir: Ino, hash: u64, name: &[u8]) -> Result<bool> {
        self.fsck_change_dir(dir, |tx, inode| {
            let (moved, delta) = {
                let mut t = Tree::new(tx, inode.tree_root, dir);
                let Some(value) = t.get(hash)? else {
                    return Ok(false);
                };
                let mut list = decode_entries(&value)?;
                let Some(i) = list.iter().position(|e| e.name == name) else {
                    return Ok(false);
                };
                let moved = list.remove(i);
                if list.is_empty() {
                    t.remove(hash)?;
                } else {
                    t.insert(hash, &encode_entries(&list))?;
                }
                (moved, t.delta)
            };
            inode.blocks = inode.blocks.saturating_add_signed(delta);
            if dir_lookup(tx, inode, name)?.is_none() {
                dir_insert(tx, inode, moved)?;
            }
            Ok(true)
        })
    }

    /// Keep only the first entry of each name in the record under `hash` of directory `dir`.
    /// Returns whether it had a name twice.
    pub fn fsck_dedup_record(&self, dir: Ino, hash: u64) -> Result<bool> {
        self.fsck_edit_record(dir, hash, &|value| {
            let mut list = decode_entries(value)?;
            let before = list.len();
            let mut seen = std::collections::HashSet::new();
            list.retain(|e| seen.insert(e.name.clone()));
            Ok((list.len() != before).then_some(list))
        })
    }

    /// The corruption injector's (`check/wreck.rs`): add `e` to the record under `hash` of
    /// directory `dir` as it is (whatever its name hashes to, whether the record already
    /// names it), touching no link count.
    pub fn fsck_put_entry(&self, dir: Ino, hash: u64, e: DirEntry) -> Result<()> {
        self.check_writable()?;
        self.meta_op(move |tx| {
            let st = self.dir_state(tx, dir)?;
            let mut d = st.write();
            if d.inode.tree_root == 0 {
                return Err(Error::corrupted(format!("directory {dir} has no tree")));
            }
            let delta = {
                let mut t = Tree::new(tx, d.inode.tree_root, dir);
                let mut list = match t.get(hash)? {
                    Some(v) => decode_entries(&v)?,
                    None => Vec::new(),
                };
                list.push(e);
                t.insert(hash, &encode_entries(&list))?;
                t.delta
            };
            d.inode.blocks = d.inode.blocks.saturating_add_signed(delta);
            self.save(tx, &mut d)
        })
    }

    /// Remove entry `name` (None: the whole record, which does not decode) stored under
    /// `hash` in directory `dir`, leaving the inode it names alone. Returns whether there was
    /// such an entry. The directory's link count is left to the link-count repair.
    pub fn fsck_drop_entry(&self, dir: Ino, hash: u64, name: Option<&[u8]>) -> Result<bool> {
        self.fsck_edit_record(dir, hash, &|value| {
            let Some(n) = name else {
                return Ok(Some(Vec::new()));
            };
            let mut list = decode_entries(value)?;
            let before = list.len();
            list.retain(|e| e.name != n);
            Ok((list.len() != before).then_some(list))
        })
    }

    /// Set the file type recorded in entry `name` (under `hash`) of directory `dir` to
    /// `dtype`. Returns whether there was such an entry.
    pub fn fsck_set_entry_type(&self, dir: Ino, hash: u64, name: &[u8], dtype: u8) -> Result<bool> {
        self.fsck_edit_record(dir, hash, &|value| {
            let mut list = decode_entries(value)?;
            let Some(e) = list.iter_mut().find(|e| e.name == name) else {
                return Ok(None);
            };
            e.dtype = dtype;
            Ok(Some(list))
        })
    }

    /// Link inode `ino`, which no directory names, into `/lost+found` (made if missing) as
    /// `#INO`. A directory gets `lost+found` as its parent; a file with no links gets one. Link
    /// counts are otherwise left to the link-count repair. Returns the new path.
    pub fn fsck_reconnect(&self, ino: Ino) -> Result<String> {
        self.check_writable()?;
        let root = self.sb.root_ino;
        let lf = match self.lookup(root, LOST_AND_FOUND) {
            Ok(a) => a.ino,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                self.mkdir(root, LOST_AND_FOUND, 0o700, Caller::ROOT)?.ino
            }
            Err(e) => return Err(e),
        };
        let name = format!("#{ino}");
        self.meta_op(|tx| {
            let lst = self.dir_state(tx, lf)?;
            let cst = self.state(tx, ino)?;
            let mut c = cst.write();
            let kind = FileKind::from_mode(c.inode.mode).ok_or_else(|| {
                Error::corrupted(format!(
                    "inode {ino}: mode {:#o} has no file type",
                    c.inode.mode
                ))
            })?;
            let mut l = lst.write();
            if dir_lookup(tx, &l.inode, name.as_bytes())?.is_some() {
                return Ok(());
            }
            dir_insert(
                tx,
                &mut l.inode,
                DirEntry {
                    name: name.clone().into_bytes(),
                    ino,
                    dtype: kind.dtype(),
                },
            )?;
            if kind == FileKind::Directory {
                l.inode.nlink += 1;
                c.inode.parent = lf;
            } else if c.inode.nlink == 0 {
                c.inode.nlink = 1;
            }
            let t = now();
            l.inode.mtime = t;
            l.inode.ctime = t;
            c.inode.ctime = t;
            self.save(tx, &mut l)?;
            self.save(tx, &mut c)
        })?;
        Ok(format!("/lost+found/{name}"))
    }
}
