//! The identity of the machine a node runs on, as its heartbeat record carries it (16 bytes at
//! offset 144, `format/heartbeat.rs`).
//!
//! Node identities (host names, the `host=` mount option) tell the daemons of one volume
//! apart; the machine identity tells *machines* apart. It matters for a **single-host** volume
//! (made on a device without SCSI COMPARE AND WRITE: its lock records are only atomic among
//! the processes of one kernel), which refuses to mount while a live slot belongs to another
//! machine (`fs/mount.rs`).
//!
//! [`MachineId::local`] is the one place it is read, in this order:
//! 1. the environment variable [`MACHINE_ID_ENV`] (`CETRA_MACHINE_ID`, 32 hex digits), so that
//!    tests can play several machines on one; any other non-empty value is an error;
//! 2. `/etc/machine-id` (systemd's 128-bit id, 32 hex digits, fixed at installation);
//! 3. if that is missing or unreadable: a 128-bit FNV-1a hash of the kernel's host name, said
//!    in a debug log line.
//!
//! All-zero ([`MachineId::UNKNOWN`]) is what records written before format 4 hold in those
//! bytes; no source above yields it.

use crate::error::{Error, ErrorKind, Result};
use std::fmt;

/// The environment variable that overrides the machine identity (32 hex digits).
pub const MACHINE_ID_ENV: &str = "CETRA_MACHINE_ID";

const MACHINE_ID_FILE: &str = "/etc/machine-id";

/// 128 bits naming one machine (one kernel).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MachineId(pub [u8; 16]);

impl MachineId {
    /// Not recorded: a heartbeat record written by a release before format 4.
    pub const UNKNOWN: Self = Self([0; 16]);

    pub fn is_unknown(&self) -> bool {
        *self == Self::UNKNOWN
    }

    /// This machine's identity (module docs). Err only for a malformed `CETRA_MACHINE_ID`.
    pub fn local() -> Result<Self> {
        if let Some(v) = std::env::var_os(MACHINE_ID_ENV).filter(|v| !v.is_empty()) {
            let s = v.to_string_lossy();
            return Self::parse_hex(&s).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidInput,
                    format!("{MACHINE_ID_ENV}={s:?} is not a machine identity: it must be 32 hex digits, not all zero"),
                )
            });
        }
        match std::fs::read_to_string(MACHINE_ID_FILE) {
            Ok(s) => {
                if let Some(id) = Self::parse_hex(&s) {
                    return Ok(id);
                }
                tracing::debug!(
                    "{MACHINE_ID_FILE} does not hold 32 hex digits; the machine identity is a hash of the host name"
                );
            }
            Err(e) => tracing::debug!(
                "{MACHINE_ID_FILE}: {e}; the machine identity is a hash of the host name"
            ),
        }
        Ok(Self::from_host_name(&kernel_host_name()))
    }

    /// 32 hex digits (surrounding white space allowed, as in `/etc/machine-id`); None for
    /// anything else, and for all zeros (that is [`Self::UNKNOWN`]).
    pub fn parse_hex(s: &str) -> Option<Self> {
        let s = s.trim();
        if s.len() != 32 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        let mut id = [0u8; 16];
        for (i, b) in id.iter_mut().enumerate() {
            *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        let id = Self(id);
        (!id.is_unknown()).then_some(id)
    }

    /// The fallback identity: FNV-1a (128-bit) of the host name, never all zero.
    pub fn from_host_name(host: &str) -> Self {
        const OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
        const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
        let h = host
            .bytes()
            .fold(OFFSET, |h, b| (h ^ u128::from(b)).wrapping_mul(PRIME));
        let id = Self(h.to_le_bytes());
        if id.is_unknown() {
            Self([1; 16])
        } else {
            id
        }
    }
}

/// The kernel's host name (shared by every daemon of this machine, whatever `host=` says).
pub fn kernel_host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

impl fmt::Display for MachineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_unknown() {
            return f.write_str("(not recorded)");
        }
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for MachineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MachineId({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_parsed_strictly() {
        let id = MachineId::parse_hex("3d1219c7c4c5404aaa1f6d2a48adfda4\n").unwrap();
        assert_eq!(id.0[0], 0x3d);
        assert_eq!(id.0[15], 0xa4);
        assert_eq!(id.to_string(), "3d1219c7c4c5404aaa1f6d2a48adfda4");
        assert_eq!(
            MachineId::parse_hex("3D1219C7C4C5404AAA1F6D2A48ADFDA4"),
            Some(id)
        );
        for bad in [
            "",
            "uninitialized",
            "3d1219c7c4c5404aaa1f6d2a48adfda",
            "3d1219c7c4c5404aaa1f6d2a48adfda44",
            "3d1219c7c4c5404aaa1f6d2a48adfdaz",
            "+d1219c7c4c5404aaa1f6d2a48adfda4",
            "00000000000000000000000000000000",
            "é1219c7c4c5404aaa1f6d2a48adfda4",
        ] {
            assert_eq!(MachineId::parse_hex(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn host_name_hash_is_stable_and_never_unknown() {
        let a = MachineId::from_host_name("pve1");
        assert_eq!(a, MachineId::from_host_name("pve1"));
        assert_ne!(a, MachineId::from_host_name("pve2"));
        assert!(!MachineId::from_host_name("").is_unknown());
        assert_eq!(MachineId::UNKNOWN.to_string(), "(not recorded)");
    }
}
