//! Detect what a device already holds before mkfs overwrites it: filesystems, volume-manager
//! labels, partition tables and swap. Like `wipefs`/`blkid`, but only the magic numbers mkfs
//! needs to refuse by default; a false positive only costs the admin a `--force`, a miss costs
//! their data, so the checks lean towards reporting.
//!
//! [`probe_device`] reads the head of the device (256 KiB: covers the btrfs superblock at
//! 64 KiB, swap headers up to 64 KiB pages and the first ZFS uberblock ring), the fs block
//! holding the CetraFS backup superblock and the last 4 KiB (backup GPT header). The pure
//! [`probe_sample`] does the matching, so it is testable and fuzzable without I/O.

use crate::dev::{AlignedBuf, BlockDevice};
use crate::error::Result;
use crate::format::superblock::Superblock;
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};
use std::fmt;

/// Bytes read from the start of the device.
pub const HEAD_BYTES: usize = 256 << 10;
/// Bytes read from the end of the device (the last 4 KiB).
pub const TAIL_BYTES: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignatureKind {
    CetraFs,
    /// Only the backup superblock (last fs block) is a CetraFS superblock.
    CetraFsBackup,
    Ext2,
    Ext3,
    Ext4,
    /// An ext3/4 external journal device.
    ExtJournal,
    Xfs,
    Btrfs,
    Lvm2Pv,
    Mbr,
    Gpt,
    /// Only the backup GPT header (last LBA) was found.
    GptBackup,
    Swap,
    Iso9660,
    ZfsMember,
}

impl SignatureKind {
    /// A noun phrase for "DEVICE contains ...".
    pub fn describe(self) -> &'static str {
        match self {
            Self::CetraFs => "a CetraFS filesystem",
            Self::CetraFsBackup => "a CetraFS backup superblock (the primary is gone)",
            Self::Ext2 => "an ext2 filesystem",
            Self::Ext3 => "an ext3 filesystem",
            Self::Ext4 => "an ext4 filesystem",
            Self::ExtJournal => "an ext3/ext4 external journal",
            Self::Xfs => "an XFS filesystem",
            Self::Btrfs => "a btrfs filesystem",
            Self::Lvm2Pv => "an LVM2 physical volume",
            Self::Mbr => "an MBR (DOS) partition table",
            Self::Gpt => "a GPT partition table",
            Self::GptBackup => "a backup GPT partition table header",
            Self::Swap => "a swap area",
            Self::Iso9660 => "an ISO9660 filesystem",
            Self::ZfsMember => "a ZFS pool member",
        }
    }
}

/// One signature found on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub kind: SignatureKind,
    /// Byte offset of the magic that identified it.
    pub offset: u64,
    /// Extra identification (label, UUID) when the format carries it.
    pub detail: Option<String>,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.describe())?;
        if let Some(d) = &self.detail {
            write!(f, " ({d})")?;
        }
        Ok(())
    }
}

/// What [`probe_sample`] looks at.
#[derive(Debug, Clone, Copy)]
pub struct Sample<'a> {
    /// The first bytes of the device (up to [`HEAD_BYTES`], fewer if the device is smaller).
    pub head: &'a [u8],
    /// The fs block where the CetraFS backup superblock would be, if the device has one.
    pub backup_block: Option<&'a [u8]>,
    /// The last [`TAIL_BYTES`] of the device, if it is that large.
    pub tail: Option<&'a [u8]>,
    /// Device size in bytes.
    pub size: u64,
}

/// Read what the probe needs from `dev` and match every known signature.
pub fn probe_device(dev: &dyn BlockDevice) -> Result<Vec<Finding>> {
    let size = dev.geometry().size_bytes;
    // Device sizes are multiples of the logical block size, which divides HEAD_BYTES and 4096.
    let head_len = usize::try_from(size).unwrap_or(usize::MAX).min(HEAD_BYTES);
    let mut head = AlignedBuf::new(head_len);
    dev.read_at(0, &mut head)?;
    let backup = if size / FS_BLOCK >= 2 {
        let mut b = AlignedBuf::new(FS_BLOCK_SIZE);
        dev.read_at((size / FS_BLOCK - 1) * FS_BLOCK, &mut b)?;
        Some(b)
    } else {
        None
    };
    let tail = if size >= TAIL_BYTES as u64 {
        let mut b = AlignedBuf::new(TAIL_BYTES);
        dev.read_at(size - TAIL_BYTES as u64, &mut b)?;
        Some(b)
    } else {
        None
    };
    Ok(probe_sample(&Sample {
        head: &head,
        backup_block: backup.as_deref(),
        tail: tail.as_deref(),
        size,
    }))
}

fn at(buf: &[u8], off: usize, len: usize) -> Option<&[u8]> {
    buf.get(off..off.checked_add(len)?)
}

fn le16(buf: &[u8], off: usize) -> Option<u16> {
    at(buf, off, 2).map(|b| u16::from_le_bytes([b[0], b[1]]))
}

fn le32(buf: &[u8], off: usize) -> Option<u32> {
    at(buf, off, 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn le64(buf: &[u8], off: usize) -> Option<u64> {
    at(buf, off, 8).map(|b| {
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        u64::from_le_bytes(a)
    })
}

/// A NUL-padded label field as text, or None when empty.
fn label(raw: &[u8]) -> Option<String> {
    let end = raw.iter().position(|&c| c == 0).unwrap_or(raw.len());
    let s = String::from_utf8_lossy(&raw[..end]).trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn uuid_string(u: &[u8]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        h[..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

fn label_uuid(label_raw: Option<&[u8]>, uuid: Option<&[u8]>) -> Option<String> {
    let mut parts = Vec::new();
    if let Some(l) = label_raw.and_then(label) {
        parts.push(format!("label \"{l}\""));
    }
    if let Some(u) = uuid.filter(|u| u.len() == 16 && u.iter().any(|&b| b != 0)) {
        parts.push(format!("UUID {}", uuid_string(u)));
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

fn add(
    out: &mut Vec<Finding>,
    kind: SignatureKind,
    offset: impl TryInto<u64>,
    detail: Option<String>,
) {
    out.push(Finding {
        kind,
        offset: offset.try_into().unwrap_or(u64::MAX),
        detail,
    });
}

/// Match every known signature in `s`. Never panics, whatever the bytes.
pub fn probe_sample(s: &Sample<'_>) -> Vec<Finding> {
    /// The ZFS uberblock magic (ZFS case below).
    const UB_MAGIC: u64 = 0x00ba_b10c;
    let mut out = Vec::new();
    let head = s.head;

    // CetraFS, primary then backup (only reported on its own: mkfs overwrites both).
    if Superblock::has_magic(head) {
        let detail = match at(head, 0, FS_BLOCK_SIZE).map(Superblock::decode) {
            Some(Ok(sb)) => label_uuid(Some(sb.label.as_bytes()), Some(&sb.uuid)),
            Some(Err(e)) => Some(format!("damaged: {e}")),
            None => Some("truncated".into()),
        };
        add(&mut out, SignatureKind::CetraFs, 0, detail);
    } else if let Some(b) = s.backup_block.filter(|b| Superblock::has_magic(b)) {
        let detail = match Superblock::decode(b) {
            Ok(sb) => label_uuid(Some(sb.label.as_bytes()), Some(&sb.uuid)),
            Err(e) => Some(format!("damaged: {e}")),
        };
        let off = (s.size / FS_BLOCK).saturating_sub(1) * FS_BLOCK;
        add(&mut out, SignatureKind::CetraFsBackup, off, detail);
    }

    // ext2/3/4: superblock at 1024, s_magic at +56.
    if le16(head, 1080) == Some(0xEF53) {
        // The classification blkid uses: beyond ext3's feature set means ext4.
        const HAS_JOURNAL: u32 = 0x4;
        const JOURNAL_DEV: u32 = 0x8;
        const EXT3_INCOMPAT: u32 = 0x2 | 0x4 | 0x10;
        const EXT3_RO_COMPAT: u32 = 0x1 | 0x2 | 0x4;
        let compat = le32(head, 1024 + 0x5C).unwrap_or(0);
        let incompat = le32(head, 1024 + 0x60).unwrap_or(0);
        let ro_compat = le32(head, 1024 + 0x64).unwrap_or(0);
        let kind = if incompat & JOURNAL_DEV != 0 {
            SignatureKind::ExtJournal
        } else if incompat & !EXT3_INCOMPAT != 0 || ro_compat & !EXT3_RO_COMPAT != 0 {
            SignatureKind::Ext4
        } else if compat & HAS_JOURNAL != 0 {
            SignatureKind::Ext3
        } else {
            SignatureKind::Ext2
        };
        add(
            &mut out,
            kind,
            1080,
            label_uuid(at(head, 1024 + 0x78, 16), at(head, 1024 + 0x68, 16)),
        );
    }

    if at(head, 0, 4) == Some(b"XFSB") {
        add(
            &mut out,
            SignatureKind::Xfs,
            0,
            label_uuid(at(head, 108, 12), at(head, 32, 16)),
        );
    }

    // btrfs: superblock at 64 KiB, magic at +0x40, fsid at +0x20, label at +0x12b.
    if at(head, 65600, 8) == Some(b"_BHRfS_M") {
        add(
            &mut out,
            SignatureKind::Btrfs,
            65600,
            label_uuid(at(head, 65536 + 0x12b, 256), at(head, 65536 + 0x20, 16)),
        );
    }

    // LVM2: a label header in one of the first four 512-byte sectors.
    for sector in 0..4 {
        let o = sector * 512;
        if at(head, o, 8) == Some(b"LABELONE") && at(head, o + 24, 8) == Some(b"LVM2 001") {
            // The PV header follows at the offset stored in the label; its first 32 bytes
            // are the PV UUID as text.
            let pv = le32(head, o + 20).and_then(|x| at(head, o + x as usize, 32));
            let detail = pv.map(|u| format!("PV UUID {}", String::from_utf8_lossy(u)));
            add(&mut out, SignatureKind::Lvm2Pv, o, detail);
            break;
        }
    }

    // GPT header at LBA 1 for 512- and 4096-byte sectors.
    let mut gpt = false;
    for lba_size in [512usize, 4096] {
        if at(head, lba_size, 8) == Some(b"EFI PART") && le64(head, lba_size + 24) == Some(1) {
            gpt = true;
            let guid = at(head, lba_size + 56, 16).map(|g| format!("disk GUID {}", guid_string(g)));
            add(&mut out, SignatureKind::Gpt, lba_size, guid);
            break;
        }
    }
    if !gpt {
        if let Some(t) = s.tail {
            // The backup header lives at the last LBA and names itself there.
            for lba_size in [512usize, 4096] {
                let Some(o) = TAIL_BYTES.checked_sub(lba_size) else {
                    continue;
                };
                let last_lba = (s.size / lba_size as u64).saturating_sub(1);
                if at(t, o, 8) == Some(b"EFI PART") && le64(t, o + 24) == Some(last_lba) {
                    add(
                        &mut out,
                        SignatureKind::GptBackup,
                        s.size - lba_size as u64,
                        None,
                    );
                    break;
                }
            }
        }
    }

    // MBR: boot signature plus at least one plausible partition entry. A protective MBR
    // (only type 0xEE entries) belongs to the GPT reported above.
    if at(head, 510, 2) == Some(&[0x55, 0xAA]) {
        // Entry = status (0 or 0x80), CHS, type (non-zero when used), CHS, LBA start, size.
        let used: Vec<u8> = (0..4)
            .filter_map(|i| at(head, 446 + 16 * i, 16))
            .filter(|e| (e[0] == 0 || e[0] == 0x80) && e[4] != 0)
            .map(|e| e[4])
            .collect();
        let protective_only = gpt && used.iter().all(|&t| t == 0xEE);
        if !used.is_empty() && !protective_only {
            let detail = format!(
                "{} partition{}",
                used.len(),
                if used.len() == 1 { "" } else { "s" }
            );
            add(&mut out, SignatureKind::Mbr, 510, Some(detail));
        }
    }

    // Swap: the signature ends the first page, whatever the page size was.
    for page in [4096usize, 8192, 16384, 65536] {
        let o = page - 10;
        let sig = at(head, o, 10);
        if sig == Some(b"SWAPSPACE2") || sig == Some(b"SWAP-SPACE") {
            add(
                &mut out,
                SignatureKind::Swap,
                o,
                label_uuid(at(head, 1024 + 28, 16), at(head, 1024 + 12, 16)),
            );
            break;
        }
    }

    // ISO9660: primary volume descriptor at 32 KiB.
    if at(head, 32769, 5) == Some(b"CD001") {
        add(
            &mut out,
            SignatureKind::Iso9660,
            32769,
            at(head, 32768 + 40, 32)
                .and_then(label)
                .map(|l| format!("label \"{l}\"")),
        );
    }

    // ZFS: uberblock ring at 128 KiB of vdev label 0, 1 KiB slots; magic in either byte order.
    let ub = (0..128)
        .map(|i| (128 << 10) + i * 1024)
        .find(|&o| le64(head, o).is_some_and(|m| m == UB_MAGIC || m.swap_bytes() == UB_MAGIC));
    if let Some(o) = ub {
        add(&mut out, SignatureKind::ZfsMember, o, None);
    }
    out
}

/// GPT GUIDs store the first three fields little-endian.
fn guid_string(g: &[u8]) -> String {
    let mut u = [0u8; 16];
    u.copy_from_slice(g);
    u[..4].reverse();
    u[4..6].reverse();
    u[6..8].reverse();
    uuid_string(&u)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::mem::MemDevice;

    fn kinds(head: &[u8]) -> Vec<SignatureKind> {
        probe_sample(&Sample {
            head,
            backup_block: None,
            tail: None,
            size: head.len() as u64,
        })
        .iter()
        .map(|f| f.kind)
        .collect()
    }

    #[test]
    fn blank_device_has_nothing() {
        assert!(kinds(&vec![0u8; HEAD_BYTES]).is_empty());
        let d = MemDevice::new(1 << 20, 512);
        assert!(probe_device(&d).unwrap().is_empty());
    }

    #[test]
    fn ext_variants() {
        let mut b = vec![0u8; 8192];
        b[1080..1082].copy_from_slice(&0xEF53u16.to_le_bytes());
        assert_eq!(kinds(&b), [SignatureKind::Ext2]);
        b[1024 + 0x5C] = 0x4; // has_journal
        assert_eq!(kinds(&b), [SignatureKind::Ext3]);
        b[1024 + 0x60] = 0x40; // extents
        b[1024 + 0x78..1024 + 0x78 + 4].copy_from_slice(b"data");
        let f = probe_sample(&Sample {
            head: &b,
            backup_block: None,
            tail: None,
            size: 8192,
        });
        assert_eq!(f[0].kind, SignatureKind::Ext4);
        assert_eq!(f[0].to_string(), "an ext4 filesystem (label \"data\")");
    }

    #[test]
    fn simple_magics() {
        let mut b = vec![0u8; HEAD_BYTES];
        b[..4].copy_from_slice(b"XFSB");
        assert_eq!(kinds(&b), [SignatureKind::Xfs]);
        let mut b = vec![0u8; HEAD_BYTES];
        b[65600..65608].copy_from_slice(b"_BHRfS_M");
        assert_eq!(kinds(&b), [SignatureKind::Btrfs]);
        let mut b = vec![0u8; HEAD_BYTES];
        b[512..520].copy_from_slice(b"LABELONE");
        b[512 + 24..512 + 32].copy_from_slice(b"LVM2 001");
        assert_eq!(kinds(&b), [SignatureKind::Lvm2Pv]);
        let mut b = vec![0u8; HEAD_BYTES];
        b[16384 - 10..16384].copy_from_slice(b"SWAPSPACE2");
        assert_eq!(kinds(&b), [SignatureKind::Swap]);
        let mut b = vec![0u8; HEAD_BYTES];
        b[32769..32774].copy_from_slice(b"CD001");
        assert_eq!(kinds(&b), [SignatureKind::Iso9660]);
        let mut b = vec![0u8; HEAD_BYTES];
        b[(128 << 10) + 5 * 1024..][..8].copy_from_slice(&0x00ba_b10cu64.to_be_bytes());
        assert_eq!(kinds(&b), [SignatureKind::ZfsMember]);
    }

    #[test]
    fn partition_tables() {
        let mut b = vec![0u8; HEAD_BYTES];
        b[510] = 0x55;
        b[511] = 0xAA;
        assert!(
            kinds(&b).is_empty(),
            "a boot signature without partitions is not a partition table"
        );
        b[446 + 16 + 4] = 0x83;
        assert_eq!(kinds(&b), [SignatureKind::Mbr]);
        // GPT with 4096-byte sectors and its protective MBR: one finding, the GPT.
        b[446 + 16 + 4] = 0;
        b[446 + 4] = 0xEE;
        b[4096..4104].copy_from_slice(b"EFI PART");
        b[4096 + 24] = 1;
        assert_eq!(kinds(&b), [SignatureKind::Gpt]);
        // Backup GPT header alone, at the last 512-byte LBA.
        let head = vec![0u8; HEAD_BYTES];
        let mut tail = vec![0u8; TAIL_BYTES];
        let size = 1u64 << 30;
        tail[TAIL_BYTES - 512..][..8].copy_from_slice(b"EFI PART");
        tail[TAIL_BYTES - 512 + 24..][..8].copy_from_slice(&(size / 512 - 1).to_le_bytes());
        let f = probe_sample(&Sample {
            head: &head,
            backup_block: None,
            tail: Some(&tail),
            size,
        });
        assert_eq!(f.len(), 1);
        assert_eq!(
            (f[0].kind, f[0].offset),
            (SignatureKind::GptBackup, size - 512)
        );
    }

    #[test]
    fn cetrafs_primary_and_backup() {
        let dev = MemDevice::new(64 << 20, 512);
        let opts = crate::mkfs::MkfsOptions {
            label: "vmstore".into(),
            max_nodes: 2,
            journal_bytes: 1 << 20,
            inode_lock_slots: 64,
            ..Default::default()
        };
        crate::mkfs::format(&dev, &opts, &mut |_, _| {}).unwrap();
        let f = probe_device(&dev).unwrap();
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].kind, SignatureKind::CetraFs);
        assert!(f[0].to_string().contains("label \"vmstore\""), "{}", f[0]);
        dev.write_at(0, &[0u8; 4096]).unwrap();
        let f = probe_device(&dev).unwrap();
        assert_eq!(
            f.iter().map(|f| f.kind).collect::<Vec<_>>(),
            [SignatureKind::CetraFsBackup]
        );
    }

    #[test]
    fn short_and_hostile_buffers_do_not_panic() {
        for len in [0usize, 1, 511, 512, 1081, 4096, 65601] {
            let b = vec![0xffu8; len];
            let _ = probe_sample(&Sample {
                head: &b,
                backup_block: Some(&b),
                tail: Some(&b),
                size: len as u64,
            });
        }
    }

    /// A real ext4 made by mke2fs must be recognised (skipped when mkfs.ext4 is missing).
    #[test]
    fn real_ext4_image() {
        let Some(mkfs) = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
        else {
            eprintln!("mkfs.ext4 not installed; skipping");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("ext4.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(32 << 20)
            .unwrap();
        let st = std::process::Command::new(mkfs)
            .args(["-F", "-q", "-L", "probe-test"])
            .arg(&img)
            .status()
            .unwrap();
        assert!(st.success());
        let opts = crate::dev::file::FileDeviceOptions {
            read_only: true,
            direct: false,
            ..Default::default()
        };
        let dev = crate::dev::file::FileDevice::open(&img, &opts).unwrap();
        let f = probe_device(&dev).unwrap();
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].kind, SignatureKind::Ext4);
        assert!(
            f[0].to_string()
                .starts_with("an ext4 filesystem (label \"probe-test\", UUID "),
            "{}",
            f[0]
        );
    }
}
