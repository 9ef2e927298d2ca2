//! Sense data decoding (SPC-4 §4.5): fixed (0x70/0x71) and descriptor (0x72/0x73) formats.
//! Decoders take arbitrary bytes from the wire and never panic.

use std::fmt;

/// Sense keys (SPC-4 table 48) this crate reacts to.
pub mod key {
    pub const NO_SENSE: u8 = 0x0;
    pub const RECOVERED_ERROR: u8 = 0x1;
    pub const NOT_READY: u8 = 0x2;
    pub const MEDIUM_ERROR: u8 = 0x3;
    pub const HARDWARE_ERROR: u8 = 0x4;
    pub const ILLEGAL_REQUEST: u8 = 0x5;
    pub const UNIT_ATTENTION: u8 = 0x6;
    pub const DATA_PROTECT: u8 = 0x7;
    pub const ABORTED_COMMAND: u8 = 0xB;
    pub const MISCOMPARE: u8 = 0xE;
}

/// Decoded sense data: what every caller needs, whatever the wire format was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    /// Response code (0x70..=0x73) without the VALID bit.
    pub response_code: u8,
    /// The error belongs to an earlier command (0x71/0x73).
    pub deferred: bool,
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
    /// INFORMATION field when the target marked it valid. For a COMPARE AND WRITE miscompare
    /// it is the offset of the first differing byte in the data-out buffer (SBC-3 §5.3).
    pub information: Option<u64>,
}

impl Sense {
    /// Decode sense bytes as returned in `sbp[..sb_len_wr]`. `None` when the buffer is empty,
    /// too short for its format, or carries an unknown response code.
    pub fn parse(sb: &[u8]) -> Option<Sense> {
        let rc = sb.first()? & 0x7F;
        match rc {
            0x70 | 0x71 => Self::parse_fixed(sb, rc),
            0x72 | 0x73 => Self::parse_descriptor(sb, rc),
            _ => None,
        }
    }

    fn parse_fixed(sb: &[u8], rc: u8) -> Option<Sense> {
        let key = sb.get(2)? & 0x0F;
        // ASC/ASCQ live at 12/13; targets may truncate the additional bytes (ADDITIONAL SENSE
        // LENGTH at byte 7), in which case they are reported as zero like sg3_utils does.
        let addl = usize::from(sb.get(7).copied().unwrap_or(0));
        let end = sb.len().min(8 + addl);
        let asc = if end > 12 { sb[12] } else { 0 };
        let ascq = if end > 13 { sb[13] } else { 0 };
        let information = if sb[0] & 0x80 != 0 && sb.len() >= 7 {
            Some(u64::from(u32::from_be_bytes([sb[3], sb[4], sb[5], sb[6]])))
        } else {
            None
        };
        Some(Sense {
            response_code: rc,
            deferred: rc == 0x71,
            key,
            asc,
            ascq,
            information,
        })
    }

    fn parse_descriptor(sb: &[u8], rc: u8) -> Option<Sense> {
        if sb.len() < 4 {
            return None;
        }
        let key = sb[1] & 0x0F;
        let (asc, ascq) = (sb[2], sb[3]);
        let addl = usize::from(sb.get(7).copied().unwrap_or(0));
        let end = sb.len().min(8 + addl);
        let mut information = None;
        let mut pos = 8;
        // Each descriptor: type, additional length, then `additional length` bytes.
        while pos + 2 <= end {
            let dtype = sb[pos];
            let dlen = usize::from(sb[pos + 1]);
            let dend = pos + 2 + dlen;
            if dend > end {
                break;
            }
            // Information descriptor: type 0x00, length 0x0A, VALID bit, 8-byte value.
            if dtype == 0x00 && dlen >= 0x0A && sb[pos + 2] & 0x80 != 0 {
                let mut v = [0u8; 8];
                v.copy_from_slice(&sb[pos + 4..pos + 12]);
                information = Some(u64::from_be_bytes(v));
            }
            pos = dend;
        }
        Some(Sense {
            response_code: rc,
            deferred: rc == 0x73,
            key,
            asc,
            ascq,
            information,
        })
    }

    pub fn is_miscompare(&self) -> bool {
        self.key == key::MISCOMPARE && self.asc == 0x1D
    }
}

/// Name of a sense key, for log lines.
pub fn key_name(k: u8) -> &'static str {
    match k {
        0x0 => "NO SENSE",
        0x1 => "RECOVERED ERROR",
        0x2 => "NOT READY",
        0x3 => "MEDIUM ERROR",
        0x4 => "HARDWARE ERROR",
        0x5 => "ILLEGAL REQUEST",
        0x6 => "UNIT ATTENTION",
        0x7 => "DATA PROTECT",
        0x8 => "BLANK CHECK",
        0x9 => "VENDOR SPECIFIC",
        0xA => "COPY ABORTED",
        0xB => "ABORTED COMMAND",
        0xD => "VOLUME OVERFLOW",
        0xE => "MISCOMPARE",
        _ => "RESERVED",
    }
}

/// A short description of the ASC/ASCQ pairs an administrator is likely to meet here.
pub fn asc_name(asc: u8, ascq: u8) -> Option<&'static str> {
    Some(match (asc, ascq) {
        (0x04, 0x00) => "logical unit not ready, cause not reportable",
        (0x04, 0x01) => "logical unit is in process of becoming ready",
        (0x04, 0x0A) => "logical unit not accessible, asymmetric access state transition",
        (0x04, 0x0B) => "logical unit not accessible, target port in standby state",
        (0x04, 0x0C) => "logical unit not accessible, target port in unavailable state",
        (0x0E, 0x03) => "invalid field in command information unit",
        (0x1A, 0x00) => "parameter list length error",
        (0x1D, 0x00) => "miscompare during verify operation",
        (0x1D, 0x01) => "miscompare verify of unmapped LBA",
        (0x20, 0x00) => "invalid command operation code",
        (0x21, 0x00) => "logical block address out of range",
        (0x24, 0x00) => "invalid field in CDB",
        (0x25, 0x00) => "logical unit not supported",
        (0x26, 0x00) => "invalid field in parameter list",
        (0x27, 0x00) => "write protected",
        (0x28, 0x00) => "not ready to ready change, medium may have changed",
        (0x29, _) => "power on, reset, or bus device reset occurred",
        (0x2A, 0x01) => "mode parameters changed",
        (0x2A, 0x03) => "reservations preempted",
        (0x2A, 0x09) => "capacity data has changed",
        (0x2A, 0x06) => "asymmetric access state changed",
        (0x3F, 0x0E) => "reported luns data has changed",
        (0x38, 0x07) => "thin provisioning soft threshold reached",
        (0x27, 0x07) => "space allocation failed write protect",
        (0x11, 0x00) => "unrecovered read error",
        (0x0C, 0x00) => "write error",
        (0x44, 0x00) => "internal target failure",
        (0x47, 0x00) => "SCSI parity error",
        (0x4B, _) => "data phase error",
        _ => return None,
    })
}

impl fmt::Display for Sense {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sense key 0x{:X} {} ASC/ASCQ 0x{:02X}/0x{:02X}",
            self.key,
            key_name(self.key),
            self.asc,
            self.ascq
        )?;
        if let Some(n) = asc_name(self.asc, self.ascq) {
            write!(f, " ({n})")?;
        }
        if let Some(i) = self.information {
            write!(f, " information={i}")?;
        }
        if self.deferred {
            f.write_str(" [deferred]")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fixed(valid: bool, k: u8, asc: u8, ascq: u8, info: u32) -> Vec<u8> {
        let mut sb = vec![0u8; 18];
        sb[0] = 0x70 | if valid { 0x80 } else { 0 };
        sb[2] = k;
        sb[3..7].copy_from_slice(&info.to_be_bytes());
        sb[7] = 10;
        sb[12] = asc;
        sb[13] = ascq;
        sb
    }

    #[test]
    fn fixed_miscompare_with_information() {
        let s = Sense::parse(&fixed(true, 0x0E, 0x1D, 0, 517)).unwrap();
        assert_eq!((s.key, s.asc, s.ascq), (0x0E, 0x1D, 0x00));
        assert_eq!(s.information, Some(517));
        assert!(s.is_miscompare());
        assert!(!s.deferred);
        assert!(s.to_string().contains("MISCOMPARE"), "{s}");
    }

    #[test]
    fn fixed_without_valid_bit_has_no_information() {
        let s = Sense::parse(&fixed(false, 0x06, 0x29, 0x00, 99)).unwrap();
        assert_eq!(s.key, key::UNIT_ATTENTION);
        assert_eq!(s.information, None);
        assert!(!s.is_miscompare());
    }

    #[test]
    fn fixed_truncated_reports_zero_asc() {
        let s = Sense::parse(&[0x70, 0, 0x05, 0, 0, 0, 0, 0]).unwrap();
        assert_eq!((s.key, s.asc, s.ascq), (5, 0, 0));
        // ADDITIONAL SENSE LENGTH 4 means bytes 12/13 are not part of the sense data
        let mut sb = fixed(false, 5, 0x24, 0, 0);
        sb[7] = 4;
        assert_eq!(Sense::parse(&sb).unwrap().asc, 0);
    }

    #[test]
    fn deferred_fixed() {
        let mut sb = fixed(false, 3, 0x0C, 0, 0);
        sb[0] = 0x71;
        assert!(Sense::parse(&sb).unwrap().deferred);
    }

    #[test]
    fn descriptor_with_information_descriptor() {
        // 0x72, key 0x0E, 1D/00, addl len 12; information descriptor: 00 0A 80 00 <u64>
        let mut sb = vec![0x72, 0x0E, 0x1D, 0x00, 0, 0, 0, 12, 0x00, 0x0A, 0x80, 0x00];
        sb.extend_from_slice(&4100u64.to_be_bytes());
        let s = Sense::parse(&sb).unwrap();
        assert!(s.is_miscompare());
        assert_eq!(s.information, Some(4100));
        assert_eq!(s.response_code, 0x72);
    }

    #[test]
    fn descriptor_skips_other_descriptors_and_invalid_information() {
        // a sense-key-specific descriptor (type 2, len 6) first, then an information
        // descriptor without VALID
        let mut sb = vec![
            0x73, 0x05, 0x24, 0x00, 0, 0, 0, 20, 0x02, 0x06, 0, 0, 0, 0, 0, 0, 0x00, 0x0A, 0x00,
            0x00,
        ];
        sb.extend_from_slice(&1u64.to_be_bytes());
        let s = Sense::parse(&sb).unwrap();
        assert_eq!((s.key, s.asc), (5, 0x24));
        assert!(s.deferred);
        assert_eq!(s.information, None);
    }

    #[test]
    fn descriptor_truncated_descriptor_ignored() {
        let sb = [
            0x72, 0x0E, 0x1D, 0x00, 0, 0, 0, 12, 0x00, 0x0A, 0x80, 0x00, 1, 2,
        ];
        let s = Sense::parse(&sb).unwrap();
        assert_eq!(s.information, None);
    }

    #[test]
    fn garbage_is_none() {
        assert_eq!(Sense::parse(&[]), None);
        assert_eq!(Sense::parse(&[0x00, 1, 2, 3]), None);
        assert_eq!(Sense::parse(&[0x70, 1]), None);
        assert_eq!(Sense::parse(&[0x72, 1, 2]), None);
    }

    proptest! {
        #[test]
        fn never_panics(sb in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = Sense::parse(&sb).map(|s| s.to_string());
        }

        #[test]
        fn never_panics_with_plausible_header(rc in 0x70u8..=0x73, rest in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut sb = vec![rc];
            sb.extend(rest);
            let s = Sense::parse(&sb);
            prop_assert!(sb.len() < 3 || s.is_some() || (rc >= 0x72 && sb.len() < 4));
        }
    }
}
