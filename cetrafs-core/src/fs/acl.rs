//! POSIX.1e ACL handling that the kernel leaves to a FUSE filesystem with `FUSE_POSIX_ACL`.
//!
//! The kernel *enforces* ACLs (it reads `system.posix_acl_access` through getxattr), but unlike
//! ext4 it does not *maintain* them for us:
//! - on create, a new inode inherits the parent's default ACL (and the umask is ignored when
//!   one exists) — the kernel's `posix_acl_create` logic, here as [`inherit`];
//! - on chmod, the ACL's owner/mask/other entries must follow the mode — [`Acl::chmod`];
//! - on setfacl, the mode's permission bits must follow the new ACL — [`Acl::mode_bits`].
//!
//! The xattr value format is the kernel's `posix_acl_xattr` (little-endian): a 4-byte version
//! (2), then 8-byte entries `{u16 tag, u16 perm, u32 id}`. Pure functions only: the volume
//! applies them inside the transaction of the change that needs them (`Volume::init_inode` for
//! creates, `setattr_by` for chmod, `setxattr` for setfacl), so a new inode exists with its
//! inherited ACLs or not at all, and a chmod never leaves the mode and the ACL disagreeing.

pub const ACCESS: &[u8] = b"system.posix_acl_access";
pub const DEFAULT: &[u8] = b"system.posix_acl_default";

const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;
const RWX: u16 = 0o7;
const PERM_BITS: u32 = 0o777;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    tag: u16,
    perm: u16,
    id: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acl {
    entries: Vec<Entry>,
}

impl Acl {
    /// Decode and validate as the kernel would (`posix_acl_valid`): exactly one owner, owning
    /// group and other entry, at most one mask, and a mask whenever named entries exist.
    /// `None` for anything else, including an empty ACL (which means "no ACL").
    pub fn decode(b: &[u8]) -> Option<Acl> {
        let (hdr, body) = b.split_first_chunk::<4>()?;
        if u32::from_le_bytes(*hdr) != VERSION || body.is_empty() || body.len() % 8 != 0 {
            return None;
        }
        let entries: Vec<Entry> = body
            .chunks_exact(8)
            .map(|c| Entry {
                tag: u16::from_le_bytes([c[0], c[1]]),
                perm: u16::from_le_bytes([c[2], c[3]]),
                id: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            })
            .collect();
        let count = |t: u16| entries.iter().filter(|e| e.tag == t).count();
        let named = count(USER) + count(GROUP);
        let known = [USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER];
        let ok = entries
            .iter()
            .all(|e| known.contains(&e.tag) && e.perm & !RWX == 0)
            && count(USER_OBJ) == 1
            && count(GROUP_OBJ) == 1
            && count(OTHER) == 1
            && count(MASK) <= 1
            && (named == 0 || count(MASK) == 1);
        ok.then_some(Acl { entries })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(4 + 8 * self.entries.len());
        v.extend_from_slice(&VERSION.to_le_bytes());
        for e in &self.entries {
            v.extend_from_slice(&e.tag.to_le_bytes());
            v.extend_from_slice(&e.perm.to_le_bytes());
            v.extend_from_slice(&e.id.to_le_bytes());
        }
        v
    }

    fn perm_of(&self, tag: u16) -> Option<u16> {
        self.entries.iter().find(|e| e.tag == tag).map(|e| e.perm)
    }

    fn set_perm(&mut self, tag: u16, perm: u16) {
        for e in self.entries.iter_mut().filter(|e| e.tag == tag) {
            e.perm = perm & RWX;
        }
    }

    /// True if the ACL says no more than the mode bits (only owner, group, other): such an
    /// ACL is not stored, like `posix_acl_equiv_mode` == 0 in the kernel.
    pub fn is_equivalent_to_mode(&self) -> bool {
        self.entries
            .iter()
            .all(|e| matches!(e.tag, USER_OBJ | GROUP_OBJ | OTHER))
    }

    /// The rwxrwxrwx bits this ACL implies; the group class comes from the mask if present.
    pub fn mode_bits(&self) -> u32 {
        let p = |t| u32::from(self.perm_of(t).unwrap_or(0));
        let group = self.perm_of(MASK).map_or_else(|| p(GROUP_OBJ), u32::from);
        (p(USER_OBJ) << 6) | (group << 3) | p(OTHER)
    }

    /// chmod: owner, group class (mask if present, else owning group) and other follow `mode`.
    pub fn chmod(&mut self, mode: u32) {
        #[allow(clippy::cast_possible_truncation)] // masked to 3 bits
        let bits = |shift: u32| ((mode >> shift) & 0o7) as u16;
        self.set_perm(USER_OBJ, bits(6));
        let group_tag = if self.perm_of(MASK).is_some() {
            MASK
        } else {
            GROUP_OBJ
        };
        self.set_perm(group_tag, bits(3));
        self.set_perm(OTHER, bits(0));
    }

    /// `posix_acl_create_masq`: restrict this (inherited default) ACL by the requested create
    /// mode and the mode by the ACL. Returns the new mode (file type and special bits kept).
    fn create_masq(&mut self, mode: u32) -> u32 {
        #[allow(clippy::cast_possible_truncation)] // masked to 3 bits
        let bits = |m: u32, shift: u32| ((m >> shift) & 0o7) as u16;
        let mut m = mode & PERM_BITS;
        for e in &mut self.entries {
            match e.tag {
                USER_OBJ => {
                    e.perm &= bits(m, 6);
                    m = (m & !0o700) | (u32::from(e.perm) << 6);
                }
                OTHER => {
                    e.perm &= bits(m, 0);
                    m = (m & !0o007) | u32::from(e.perm);
                }
                _ => {}
            }
        }
        let group_tag = if self.perm_of(MASK).is_some() {
            MASK
        } else {
            GROUP_OBJ
        };
        for e in self.entries.iter_mut().filter(|e| e.tag == group_tag) {
            e.perm &= bits(m, 3);
            m = (m & !0o070) | (u32::from(e.perm) << 3);
        }
        (mode & !PERM_BITS) | m
    }
}

/// What a new inode gets: its final mode, and the ACL xattrs to store on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inherited {
    pub mode: u32,
    pub access: Option<Vec<u8>>,
    pub default: Option<Vec<u8>>,
}

/// Mode and ACLs for a new inode (not a symlink) created with `mode` under a parent whose
/// `system.posix_acl_default` is `parent_default` (None if it has none), by a process whose
/// umask is `umask`. Mirrors the kernel's `posix_acl_create`: without a default ACL the umask
/// applies; with one, the umask is ignored, the new inode's access ACL is the default ACL
/// masked by the mode (stored only if it says more than the mode does), and a directory also
/// inherits the default ACL itself. An unparsable default ACL counts as none.
pub fn inherit(parent_default: Option<&[u8]>, mode: u32, umask: u32, is_dir: bool) -> Inherited {
    let Some(default) = parent_default.and_then(Acl::decode) else {
        return Inherited {
            mode: mode & !(umask & 0o777),
            access: None,
            default: None,
        };
    };
    let mut access = default.clone();
    let mode = access.create_masq(mode);
    Inherited {
        mode,
        access: (!access.is_equivalent_to_mode()).then(|| access.encode()),
        default: is_dir.then(|| default.encode()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(entries: &[(u16, u16, u32)]) -> Acl {
        Acl {
            entries: entries
                .iter()
                .map(|&(tag, perm, id)| Entry { tag, perm, id })
                .collect(),
        }
    }

    const UNDEF: u32 = u32::MAX;

    #[test]
    fn roundtrip_and_validation() {
        let a = acl(&[
            (USER_OBJ, 7, UNDEF),
            (USER, 5, 1000),
            (GROUP_OBJ, 5, UNDEF),
            (MASK, 7, UNDEF),
            (OTHER, 0, UNDEF),
        ]);
        let bytes = a.encode();
        assert_eq!(bytes.len(), 4 + 5 * 8);
        assert_eq!(&bytes[..4], &[2, 0, 0, 0]);
        assert_eq!(Acl::decode(&bytes), Some(a));
        // Named entry without a mask is invalid; so are a missing OTHER, bad version, bad perm.
        assert!(Acl::decode(
            &acl(&[
                (USER_OBJ, 7, UNDEF),
                (USER, 5, 1),
                (GROUP_OBJ, 5, UNDEF),
                (OTHER, 0, UNDEF)
            ])
            .encode()
        )
        .is_none());
        assert!(
            Acl::decode(&acl(&[(USER_OBJ, 7, UNDEF), (GROUP_OBJ, 5, UNDEF)]).encode()).is_none()
        );
        assert!(Acl::decode(
            &acl(&[
                (USER_OBJ, 8, UNDEF),
                (GROUP_OBJ, 5, UNDEF),
                (OTHER, 0, UNDEF)
            ])
            .encode()
        )
        .is_none());
        let mut v1 = acl(&[
            (USER_OBJ, 7, UNDEF),
            (GROUP_OBJ, 5, UNDEF),
            (OTHER, 0, UNDEF),
        ])
        .encode();
        v1[0] = 1;
        assert!(Acl::decode(&v1).is_none());
        assert!(Acl::decode(&[2, 0, 0, 0]).is_none());
        assert!(Acl::decode(&[2, 0, 0, 0, 1]).is_none());
    }

    #[test]
    fn no_default_acl_applies_umask() {
        let r = inherit(None, libc::S_IFREG | 0o666, 0o022, false);
        assert_eq!(
            r,
            Inherited {
                mode: libc::S_IFREG | 0o644,
                access: None,
                default: None
            }
        );
        let r = inherit(None, libc::S_IFDIR | 0o1777, 0o027, true);
        assert_eq!(r.mode, libc::S_IFDIR | 0o1750);
        // Garbage in the parent's default ACL is treated as no ACL.
        assert_eq!(inherit(Some(b"junk"), 0o666, 0o022, false).mode, 0o644);
    }

    #[test]
    fn minimal_default_acl_ignores_umask_and_stores_no_access_acl() {
        // setfacl -d -m u::rwx,g::rx,o::- dir ; then open(O_CREAT, 0666) with umask 077.
        let d = acl(&[
            (USER_OBJ, 7, UNDEF),
            (GROUP_OBJ, 5, UNDEF),
            (OTHER, 0, UNDEF),
        ])
        .encode();
        let r = inherit(Some(&d), libc::S_IFREG | 0o666, 0o077, false);
        assert_eq!(r.mode, libc::S_IFREG | 0o640);
        assert_eq!(r.access, None);
        assert_eq!(r.default, None);
        let r = inherit(Some(&d), libc::S_IFDIR | 0o777, 0o077, true);
        assert_eq!(r.mode, libc::S_IFDIR | 0o750);
        assert_eq!(r.default.as_deref(), Some(&d[..]));
    }

    #[test]
    fn extended_default_acl_is_inherited_masked_by_mode() {
        // setfacl -d -m u::rwx,u:1000:rwx,g::r-x,m::rwx,o::r-x dir
        let d = acl(&[
            (USER_OBJ, 7, UNDEF),
            (USER, 7, 1000),
            (GROUP_OBJ, 5, UNDEF),
            (MASK, 7, UNDEF),
            (OTHER, 5, UNDEF),
        ]);
        // A file created with 0644: the mask becomes r--, the group class of the mode follows it.
        let r = inherit(Some(&d.encode()), libc::S_IFREG | 0o644, 0o022, false);
        assert_eq!(r.mode, libc::S_IFREG | 0o644);
        let a = Acl::decode(r.access.as_deref().unwrap()).unwrap();
        assert_eq!(
            a,
            acl(&[
                (USER_OBJ, 6, UNDEF),
                (USER, 7, 1000),
                (GROUP_OBJ, 5, UNDEF),
                (MASK, 4, UNDEF),
                (OTHER, 4, UNDEF)
            ])
        );
        assert_eq!(a.mode_bits(), 0o644);
        assert_eq!(r.default, None);
        // A directory created with 0777 (umask 077 ignored) keeps rwx for the group class via the mask.
        let r = inherit(Some(&d.encode()), libc::S_IFDIR | 0o777, 0o077, true);
        assert_eq!(r.mode, libc::S_IFDIR | 0o775);
        assert_eq!(r.default, Some(d.encode()));
        // Special bits pass through untouched.
        assert_eq!(
            inherit(Some(&d.encode()), libc::S_IFDIR | 0o2777, 0, true).mode,
            libc::S_IFDIR | 0o2775
        );
    }

    #[test]
    fn chmod_updates_mask_not_owning_group() {
        let mut a = acl(&[
            (USER_OBJ, 7, UNDEF),
            (USER, 7, 1000),
            (GROUP_OBJ, 7, UNDEF),
            (MASK, 7, UNDEF),
            (OTHER, 5, UNDEF),
        ]);
        a.chmod(0o640);
        assert_eq!(
            a,
            acl(&[
                (USER_OBJ, 6, UNDEF),
                (USER, 7, 1000),
                (GROUP_OBJ, 7, UNDEF),
                (MASK, 4, UNDEF),
                (OTHER, 0, UNDEF)
            ])
        );
        assert_eq!(a.mode_bits(), 0o640);
        assert!(!a.is_equivalent_to_mode());
        let mut m = acl(&[
            (USER_OBJ, 7, UNDEF),
            (GROUP_OBJ, 7, UNDEF),
            (OTHER, 7, UNDEF),
        ]);
        m.chmod(0o4751);
        assert_eq!(m.mode_bits(), 0o751);
        assert!(m.is_equivalent_to_mode());
    }
}
