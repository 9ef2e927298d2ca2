//! Parsers for INQUIRY data, the VPD pages 0x83/0xB0/0xB2 and READ CAPACITY(16).
//! They take bytes from the target and never panic; short pages yield `None` fields or errors.

use std::fmt::Write as _;

/// The parts of standard INQUIRY data worth logging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StandardInquiry {
    /// Peripheral qualifier (0 = LU connected, 1 = not connected, 3 = no LU).
    pub qualifier: u8,
    /// Peripheral device type (0 = direct access block device).
    pub device_type: u8,
    pub vendor: String,
    pub product: String,
    pub revision: String,
}

fn ascii_field(b: &[u8]) -> String {
    b.iter()
        .map(|&c| {
            if (0x20..0x7f).contains(&c) {
                c as char
            } else {
                ' '
            }
        })
        .collect::<String>()
        .trim()
        .to_string()
}

impl StandardInquiry {
    pub fn parse(d: &[u8]) -> Option<Self> {
        let b0 = *d.first()?;
        let get = |r: std::ops::Range<usize>| {
            d.get(r.start..r.end.min(d.len()))
                .map(ascii_field)
                .unwrap_or_default()
        };
        Some(Self {
            qualifier: b0 >> 5,
            device_type: b0 & 0x1F,
            vendor: get(8..16),
            product: get(16..32),
            revision: get(32..36),
        })
    }
}

/// Returns the payload of a VPD page after checking its header: the page code matches and the
/// PAGE LENGTH (bytes 2-3) is clipped to what was actually transferred.
pub fn vpd_payload(d: &[u8], page: u8) -> Option<&[u8]> {
    if d.len() < 4 || d[1] != page {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([d[2], d[3]]));
    Some(&d[4..d.len().min(4 + len)])
}

/// Total length a VPD page claims (header included), to re-issue INQUIRY with a larger buffer.
pub fn vpd_claimed_len(d: &[u8]) -> Option<usize> {
    (d.len() >= 4).then(|| 4 + usize::from(u16::from_be_bytes([d[2], d[3]])))
}

/// One designation descriptor of VPD 0x83.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Designator {
    /// 1 binary, 2 ASCII, 3 UTF-8.
    pub code_set: u8,
    /// 0 logical unit, 1 target port, 2 target device.
    pub association: u8,
    /// 1 T10 vendor id, 2 EUI-64, 3 NAA, 8 SCSI name string, 0xA UUID, ...
    pub designator_type: u8,
    pub value: Vec<u8>,
}

pub mod designator_type {
    pub const VENDOR_SPECIFIC: u8 = 0x0;
    pub const T10_VENDOR_ID: u8 = 0x1;
    pub const EUI64: u8 = 0x2;
    pub const NAA: u8 = 0x3;
    pub const SCSI_NAME_STRING: u8 = 0x8;
    pub const UUID: u8 = 0xA;
}

/// All designation descriptors of a Device Identification page (0x83), in page order.
pub fn parse_device_identification(d: &[u8]) -> Vec<Designator> {
    let Some(p) = vpd_payload(d, super::cdb::vpd_page::DEVICE_IDENTIFICATION) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut pos = 0;
    while pos + 4 <= p.len() {
        let len = usize::from(p[pos + 3]);
        let Some(value) = p.get(pos + 4..pos + 4 + len) else {
            break;
        };
        out.push(Designator {
            code_set: p[pos] & 0x0F,
            association: (p[pos + 1] >> 4) & 0x03,
            designator_type: p[pos + 1] & 0x0F,
            value: value.to_vec(),
        });
        pos += 4 + len;
    }
    out
}

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

fn text(v: &[u8]) -> String {
    // SCSI name strings are NUL-padded; T10 ids are space-padded with inner runs of spaces.
    let s: String = v
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| if c.is_ascii_graphic() { c as char } else { ' ' })
        .collect();
    s.split_whitespace().collect::<Vec<_>>().join("_")
}

/// Rank of a logical-unit designator as a stable identity; higher is better, `None` = unusable.
/// NAA first (and among NAA the IEEE Registered Extended format 6 > 5 > 2/3), then EUI-64, then
/// UUID and SCSI name string, then T10 vendor id, which is only vendor + product + serial.
fn rank(d: &Designator) -> Option<u8> {
    if d.association != 0 || d.value.is_empty() {
        return None;
    }
    Some(match d.designator_type {
        designator_type::NAA => match d.value[0] >> 4 {
            6 => 90,
            5 => 89,
            _ => 88,
        },
        designator_type::EUI64 => 70,
        designator_type::UUID => 60,
        designator_type::SCSI_NAME_STRING => 50,
        designator_type::T10_VENDOR_ID => 40,
        _ => return None,
    })
}

/// A stable, path-independent identity string for the LUN from its VPD 0x83 page, in the style
/// of Linux `wwid` (`naa.6001405…`, `eui.…`, `t10.VENDOR_…`). Every path to the same LUN
/// (multipath, several nexuses) yields the same string.
pub fn lun_identity(d: &[u8]) -> Option<String> {
    let all = parse_device_identification(d);
    let best = all
        .iter()
        .filter_map(|x| rank(x).map(|r| (r, x)))
        .max_by_key(|(r, _)| *r)?
        .1;
    let s = match best.designator_type {
        designator_type::NAA => format!("naa.{}", hex(&best.value)),
        designator_type::EUI64 => format!("eui.{}", hex(&best.value)),
        designator_type::UUID => {
            // UUID designator: 2 bytes of flags/reserved, then the 16-byte UUID
            let u = best.value.get(2..18).unwrap_or(&best.value);
            format!("uuid.{}", hex(u))
        }
        designator_type::SCSI_NAME_STRING => format!("name.{}", text(&best.value)),
        _ if best.code_set == 1 => format!("t10.{}", hex(&best.value)),
        _ => format!("t10.{}", text(&best.value)),
    };
    (s.len() > 4).then_some(s)
}

/// Block Limits VPD page (0xB0), SBC-3 table 192. Fields absent from a short page are `None`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockLimits {
    /// MAXIMUM COMPARE AND WRITE LENGTH in blocks; 0 means COMPARE AND WRITE is not supported.
    pub max_compare_and_write_len: Option<u8>,
    pub optimal_transfer_length_granularity: Option<u16>,
    /// In blocks; 0 = no limit reported.
    pub max_transfer_length: Option<u32>,
    pub optimal_transfer_length: Option<u32>,
    /// In blocks; 0 = UNMAP not supported, `0xFFFF_FFFF` = unlimited.
    pub max_unmap_lba_count: Option<u32>,
    pub max_unmap_block_descriptor_count: Option<u32>,
    /// In blocks.
    pub optimal_unmap_granularity: Option<u32>,
    /// Valid only when UGAVALID was set.
    pub unmap_granularity_alignment: Option<u32>,
}

fn be16(p: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(p.get(at..at + 2)?.try_into().ok()?))
}

fn be32(p: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(p.get(at..at + 4)?.try_into().ok()?))
}

impl BlockLimits {
    /// Parse the page including its 4-byte header (offsets as in SBC-3: byte 5 = max CAW length).
    pub fn parse(d: &[u8]) -> Option<Self> {
        let p = vpd_payload(d, super::cdb::vpd_page::BLOCK_LIMITS)?;
        // Work on page offsets (header included) so the numbers match the standard's table.
        let at = |i: usize| i.checked_sub(4);
        let byte = |i: usize| at(i).and_then(|j| p.get(j).copied());
        let w16 = |i: usize| at(i).and_then(|j| be16(p, j));
        let w32 = |i: usize| at(i).and_then(|j| be32(p, j));
        Some(Self {
            max_compare_and_write_len: byte(5),
            optimal_transfer_length_granularity: w16(6),
            max_transfer_length: w32(8),
            optimal_transfer_length: w32(12),
            max_unmap_lba_count: w32(20),
            max_unmap_block_descriptor_count: w32(24),
            optimal_unmap_granularity: w32(28),
            unmap_granularity_alignment: w32(32)
                .filter(|v| v & 0x8000_0000 != 0)
                .map(|v| v & 0x7FFF_FFFF),
        })
    }
}

/// Logical Block Provisioning VPD page (0xB2), SBC-3 table 200.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Provisioning {
    /// LBPU: the target supports UNMAP.
    pub unmap: bool,
    /// LBPWS: WRITE SAME(16) with UNMAP.
    pub write_same16_unmap: bool,
    /// LBPRZ (3 bits in SBC-4, 1 bit in SBC-3): unmapped blocks read as zeros when nonzero.
    pub lbprz: u8,
    /// 0 full, 1 resource provisioned, 2 thin.
    pub provisioning_type: u8,
}

impl Provisioning {
    pub fn parse(d: &[u8]) -> Option<Self> {
        let p = vpd_payload(d, super::cdb::vpd_page::LOGICAL_BLOCK_PROVISIONING)?;
        let b5 = *p.get(1)?;
        Some(Self {
            unmap: b5 & 0x80 != 0,
            write_same16_unmap: b5 & 0x40 != 0,
            lbprz: (b5 >> 2) & 0x07,
            provisioning_type: p.get(2).map_or(0, |b| b & 0x07),
        })
    }
}

/// READ CAPACITY(16) parameter data, SBC-3 table 65.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// RETURNED LOGICAL BLOCK ADDRESS + 1.
    pub blocks: u64,
    pub logical_block_size: u32,
    /// LOGICAL BLOCKS PER PHYSICAL BLOCK EXPONENT.
    pub physical_exponent: u8,
    /// Logical block provisioning management enabled (thin provisioned).
    pub lbpme: bool,
    /// Unmapped blocks read as zeros.
    pub lbprz: bool,
    pub lowest_aligned_lba: u16,
    pub protection_enabled: bool,
}

impl Capacity {
    pub fn parse(d: &[u8]) -> Option<Self> {
        if d.len() < 12 {
            return None;
        }
        let last = u64::from_be_bytes(d[0..8].try_into().ok()?);
        let lbs = u32::from_be_bytes(d[8..12].try_into().ok()?);
        let b12 = d.get(12).copied().unwrap_or(0);
        let b13 = d.get(13).copied().unwrap_or(0);
        let b14 = d.get(14).copied().unwrap_or(0);
        let b15 = d.get(15).copied().unwrap_or(0);
        Some(Self {
            blocks: last.checked_add(1)?,
            logical_block_size: lbs,
            physical_exponent: b13 & 0x0F,
            lbpme: b14 & 0x80 != 0,
            lbprz: b14 & 0x40 != 0,
            lowest_aligned_lba: u16::from_be_bytes([b14 & 0x3F, b15]),
            protection_enabled: b12 & 0x01 != 0,
        })
    }

    /// Physical block size in bytes (`None` if the exponent overflows u32).
    pub fn physical_block_size(&self) -> Option<u32> {
        1u32.checked_shl(u32::from(self.physical_exponent))
            .and_then(|m| m.checked_mul(self.logical_block_size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// VPD 0x83 as LIO 6.1 returns it for a fileio backstore with unit serial "liovm-disk0":
    /// NAA 6 (LU), T10 vendor id (LU), relative target port (port), TPG (port), LU group (LU),
    /// SCSI name string (port).
    fn lio_83() -> Vec<u8> {
        let mut descs: Vec<u8> = Vec::new();
        let naa = [
            0x60, 0x01, 0x40, 0x5a, 0xbc, 0xde, 0xf0, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde,
            0xf0, 0x12,
        ];
        descs.extend([0x01, 0x03, 0x00, 16]);
        descs.extend(naa);
        let t10 = b"LIO-ORG FILEIO          liovm-disk0";
        descs.extend([0x02, 0x01, 0x00, u8::try_from(t10.len()).unwrap()]);
        descs.extend(t10);
        descs.extend([0x61, 0x94, 0x00, 4, 0, 0, 0, 1]); // relative target port (association 1)
        descs.extend([0x61, 0x95, 0x00, 4, 0, 0, 0, 0]); // target port group
        descs.extend([0x01, 0x06, 0x00, 4, 0, 0, 0, 0]); // LU group
        let name = b"naa.5001405000000001,t,0x0001\0\0\0";
        descs.extend([0x53, 0x98, 0x00, u8::try_from(name.len()).unwrap()]);
        descs.extend(name);
        let mut d = vec![0x00, 0x83];
        d.extend(u16::try_from(descs.len()).unwrap().to_be_bytes());
        d.extend(descs);
        d
    }

    #[test]
    fn std_inquiry() {
        let mut d = vec![0u8; 36];
        d[0] = 0x00;
        d[8..16].copy_from_slice(b"LIO-ORG ");
        d[16..32].copy_from_slice(b"FILEIO          ");
        d[32..36].copy_from_slice(b"4.0\0");
        let i = StandardInquiry::parse(&d).unwrap();
        assert_eq!(
            (i.vendor.as_str(), i.product.as_str(), i.revision.as_str()),
            ("LIO-ORG", "FILEIO", "4.0")
        );
        assert_eq!((i.qualifier, i.device_type), (0, 0));
        let short = StandardInquiry::parse(&d[..12]).unwrap();
        assert_eq!(short.vendor, "LIO-");
        assert_eq!(short.product, "");
        assert!(StandardInquiry::parse(&[]).is_none());
    }

    #[test]
    fn identity_prefers_naa() {
        let d = lio_83();
        let all = parse_device_identification(&d);
        assert_eq!(all.len(), 6);
        assert_eq!(
            lun_identity(&d).unwrap(),
            "naa.6001405abcdef0123456789abcdef012"
        );
    }

    #[test]
    fn identity_eui_then_t10() {
        let mut d = vec![0x00, 0x83, 0, 0];
        d.extend([0x02, 0x01, 0, 11]);
        d.extend(b"ACME    X 1");
        d.extend([0x01, 0x02, 0, 8, 1, 2, 3, 4, 5, 6, 7, 8]);
        let n = u16::try_from(d.len() - 4).unwrap();
        d[2..4].copy_from_slice(&n.to_be_bytes());
        assert_eq!(lun_identity(&d).unwrap(), "eui.0102030405060708");
        // without the EUI, the T10 vendor id with runs of spaces collapsed
        d.truncate(4 + 15);
        d[2..4].copy_from_slice(&15u16.to_be_bytes());
        assert_eq!(lun_identity(&d).unwrap(), "t10.ACME_X_1");
    }

    #[test]
    fn identity_ignores_port_designators_and_garbage() {
        // NAA with association 1 (target port) must not become the LUN identity
        let d = [
            0x00, 0x83, 0, 12, 0x01, 0x13, 0, 8, 0x50, 1, 2, 3, 4, 5, 6, 7,
        ];
        assert_eq!(lun_identity(&d), None);
        assert_eq!(lun_identity(&[0x00, 0x80, 0, 0]), None);
        // descriptor claiming more bytes than the page holds
        let d = [0x00, 0x83, 0, 8, 0x01, 0x03, 0, 200, 0x60, 1, 2, 3];
        assert!(parse_device_identification(&d).is_empty());
    }

    #[test]
    fn block_limits_lio() {
        // LIO 6.1 fileio with emulate_tpu=1: max CAW 1, max unmap 8192 LBAs, 1 descriptor
        let mut d = vec![0u8; 64];
        d[1] = 0xB0;
        d[3] = 0x3C;
        d[5] = 1;
        d[6..8].copy_from_slice(&1u16.to_be_bytes());
        d[8..12].copy_from_slice(&0x4000u32.to_be_bytes());
        d[12..16].copy_from_slice(&0x4000u32.to_be_bytes());
        d[20..24].copy_from_slice(&8192u32.to_be_bytes());
        d[24..28].copy_from_slice(&1u32.to_be_bytes());
        d[28..32].copy_from_slice(&8u32.to_be_bytes());
        d[32..36].copy_from_slice(&(0x8000_0000u32 | 3).to_be_bytes());
        let b = BlockLimits::parse(&d).unwrap();
        assert_eq!(b.max_compare_and_write_len, Some(1));
        assert_eq!(b.max_transfer_length, Some(0x4000));
        assert_eq!(b.max_unmap_lba_count, Some(8192));
        assert_eq!(b.max_unmap_block_descriptor_count, Some(1));
        assert_eq!(b.optimal_unmap_granularity, Some(8));
        assert_eq!(b.unmap_granularity_alignment, Some(3));
        // short page: only byte 5 present
        let b = BlockLimits::parse(&[0, 0xB0, 0, 2, 0, 0]).unwrap();
        assert_eq!(b.max_compare_and_write_len, Some(0));
        assert_eq!(b.max_transfer_length, None);
        assert!(BlockLimits::parse(&[0, 0xB2, 0, 2, 0, 0]).is_none());
    }

    #[test]
    fn provisioning() {
        let p = Provisioning::parse(&[0, 0xB2, 0, 4, 0, 0x80 | 0x04, 0x02, 0]).unwrap();
        assert!(p.unmap && !p.write_same16_unmap);
        assert_eq!((p.lbprz, p.provisioning_type), (1, 2));
        assert!(Provisioning::parse(&[0, 0xB2, 0, 0]).is_none());
    }

    #[test]
    fn read_capacity16() {
        let mut d = [0u8; 32];
        d[0..8].copy_from_slice(&(2_097_151u64).to_be_bytes());
        d[8..12].copy_from_slice(&512u32.to_be_bytes());
        d[13] = 3; // 8 logical per physical
        d[14] = 0xC0; // LBPME + LBPRZ
        let c = Capacity::parse(&d).unwrap();
        assert_eq!(c.blocks, 2_097_152);
        assert_eq!(c.logical_block_size, 512);
        assert_eq!(c.physical_block_size(), Some(4096));
        assert!(c.lbpme && c.lbprz && !c.protection_enabled);
        assert_eq!(c.lowest_aligned_lba, 0);
        d[8..12].copy_from_slice(&4096u32.to_be_bytes());
        d[13] = 0;
        d[14] = 0;
        let c = Capacity::parse(&d).unwrap();
        assert_eq!(
            (c.logical_block_size, c.physical_block_size()),
            (4096, Some(4096))
        );
        assert!(!c.lbpme);
        assert!(Capacity::parse(&d[..11]).is_none());
        d[0..8].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(Capacity::parse(&d).is_none(), "block count overflow");
        d[0..8].copy_from_slice(&1u64.to_be_bytes());
        d[13] = 0x0F;
        d[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(Capacity::parse(&d).unwrap().physical_block_size(), None);
    }

    proptest! {
        #[test]
        fn parsers_never_panic(d in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = StandardInquiry::parse(&d);
            let _ = lun_identity(&d);
            let _ = BlockLimits::parse(&d);
            let _ = Provisioning::parse(&d);
            let _ = Capacity::parse(&d).map(|c| c.physical_block_size());
            let _ = vpd_claimed_len(&d);
        }

        #[test]
        fn vpd_parsers_never_panic_with_valid_header(
            page in prop::sample::select(vec![0x83u8, 0xB0, 0xB2]),
            body in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let mut d = vec![0u8, page];
            d.extend(u16::try_from(body.len()).unwrap().to_be_bytes());
            d.extend(body);
            let _ = parse_device_identification(&d);
            let _ = lun_identity(&d);
            let _ = BlockLimits::parse(&d);
            let _ = Provisioning::parse(&d);
        }
    }
}
