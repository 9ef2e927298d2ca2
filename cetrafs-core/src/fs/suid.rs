//! When setuid and setgid bits are removed: the rules Linux applies to local filesystems
//! (`fs/attr.c`: `setattr_should_drop_suidgid`, `setattr_should_drop_sgid`; `fs/open.c`:
//! `chown_common`), as one policy the volume applies inside the same transaction as the
//! change that triggers it.
//!
//! * **Write or truncate** of a regular file (write(2), truncate(2), ftruncate(2),
//!   `open(O_TRUNC)`) by a caller *without* `CAP_FSETID` removes `S_ISUID`, and `S_ISGID` when the
//!   group-execute bit is set or the caller is not in the file's group. A caller with
//!   `CAP_FSETID` keeps both.
//! * **Change of owner or group** (chown(2)) of anything but a directory removes `S_ISUID`
//!   always (even for root), and `S_ISGID` when the group-execute bit is set (even for root) or
//!   when the caller neither is in the file's group nor holds `CAP_FSETID`. The group is the
//!   file's group *before* the change.
//! * `S_ISGID` without group-execute on a file a group member writes is the old mandatory-locking
//!   marker and is kept; directories keep their bits.
//!
//! What the caller holds is asked through [`Credentials`] only when the file has one of the
//! bits, so the common case costs one test of the mode.

use super::Caller;

/// What the rules need to know about whoever changes a file.
pub trait Credentials {
    /// The caller holds `CAP_FSETID` (may keep setuid/setgid bits across a write).
    fn has_fsetid(&self) -> bool;
    /// `gid` is the caller's filesystem gid or one of its supplementary groups.
    fn in_group(&self, gid: u32) -> bool;
}

/// A plain caller: root holds every capability; the group is its one gid. (Used by callers
/// that know nothing more, such as tests and the volume's own internal changes.)
impl Credentials for Caller {
    fn has_fsetid(&self) -> bool {
        self.uid == 0
    }
    fn in_group(&self, gid: u32) -> bool {
        self.gid == gid
    }
}

const SUID: u32 = libc::S_ISUID;
const SGID: u32 = libc::S_ISGID;
const XGRP: u32 = libc::S_IXGRP;

/// True if `mode` carries a bit that a write might remove: the data fast path's one test.
pub(crate) fn may_drop(mode: u32) -> bool {
    mode & (SUID | SGID) != 0 && mode & libc::S_IFMT == libc::S_IFREG
}

/// Bits of `mode` (a file of group `gid`) that a write or truncate by `who` removes.
pub(crate) fn on_write(mode: u32, gid: u32, who: &dyn Credentials) -> u32 {
    if !may_drop(mode) || who.has_fsetid() {
        return 0;
    }
    let sgid = mode & SGID != 0 && (mode & XGRP != 0 || !who.in_group(gid));
    (mode & SUID) | if sgid { SGID } else { 0 }
}

/// Bits of `mode` (a file of group `gid`, before the change) that a chown by `who` removes.
pub(crate) fn on_chown(mode: u32, gid: u32, who: &dyn Credentials) -> u32 {
    if mode & (SUID | SGID) == 0 || mode & libc::S_IFMT == libc::S_IFDIR {
        return 0;
    }
    let sgid = mode & SGID != 0 && (mode & XGRP != 0 || !(who.in_group(gid) || who.has_fsetid()));
    (mode & SUID) | if sgid { SGID } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REG: u32 = libc::S_IFREG;
    const NOBODY: Caller = Caller {
        uid: 65534,
        gid: 65534,
        umask: 0,
    };

    #[test]
    fn write_by_unprivileged_caller() {
        // Not in the file's group (gid 0).
        assert_eq!(on_write(REG | 0o4777, 0, &NOBODY), SUID);
        assert_eq!(on_write(REG | 0o2777, 0, &NOBODY), SGID);
        assert_eq!(on_write(REG | 0o6777, 0, &NOBODY), SUID | SGID);
        assert_eq!(on_write(REG | 0o2767, 0, &NOBODY), SGID);
        // In the file's group: setgid without group-exec is kept, with it removed.
        assert_eq!(on_write(REG | 0o2767, 65534, &NOBODY), 0);
        assert_eq!(on_write(REG | 0o2777, 65534, &NOBODY), SGID);
        assert_eq!(on_write(REG | 0o0777, 0, &NOBODY), 0);
    }

    #[test]
    fn write_by_root_and_non_regular_files_keep_bits() {
        assert_eq!(on_write(REG | 0o6777, 0, &Caller::ROOT), 0);
        assert_eq!(on_write(libc::S_IFDIR | 0o2777, 0, &NOBODY), 0);
        assert!(!may_drop(REG | 0o1777));
        assert!(may_drop(REG | 0o2000));
    }

    #[test]
    fn chown_rules() {
        // Setuid always goes, even for root; setgid with group-exec too.
        assert_eq!(on_chown(REG | 0o6777, 0, &Caller::ROOT), SUID | SGID);
        assert_eq!(on_chown(REG | 0o2767, 0, &Caller::ROOT), 0);
        assert_eq!(on_chown(REG | 0o2767, 0, &NOBODY), SGID);
        assert_eq!(on_chown(REG | 0o2767, 65534, &NOBODY), 0);
        assert_eq!(on_chown(libc::S_IFLNK | 0o4777, 0, &NOBODY), SUID);
        assert_eq!(on_chown(libc::S_IFDIR | 0o6777, 0, &NOBODY), 0);
    }
}
