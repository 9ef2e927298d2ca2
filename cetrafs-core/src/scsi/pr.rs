//! SCSI-3 persistent reservations (SPC-4 §5.13, §6.15 PERSISTENT RESERVE IN, §6.16
//! PERSISTENT RESERVE OUT): CDB builders, the 24-byte basic PR OUT parameter list, parsers of
//! the READ KEYS / READ RESERVATION / REPORT CAPABILITIES replies, and the reservation key
//! CetraFS derives for a node ([`pr_key`]). Pure byte layout, no I/O; every parser takes bytes
//! from the target and never panics.
//!
//! The model, briefly: every I_T nexus (initiator port → target port, i.e. every path of every
//! host) *registers* an 8-byte key; one registrant *reserves* the LUN with a type. With
//! **Write Exclusive – Registrants Only** (type 5) every registered nexus may read and write,
//! an unregistered one may only read: its writes complete with status RESERVATION CONFLICT.
//! PREEMPT AND ABORT by a registrant removes another key's registrations (on every nexus that
//! registered it) and aborts the tasks those nexuses still have queued in the target, so a
//! node whose key was preempted can neither land a queued write nor issue a new one.
//!
//! Multi-byte fields are big-endian, as everywhere in SCSI.

use std::fmt;

/// Operation code of PERSISTENT RESERVE IN (10-byte CDB).
pub const PERSISTENT_RESERVE_IN: u8 = 0x5E;
/// Operation code of PERSISTENT RESERVE OUT (10-byte CDB).
pub const PERSISTENT_RESERVE_OUT: u8 = 0x5F;
/// Bytes of the basic PERSISTENT RESERVE OUT parameter list (SPC-4 table 227).
pub const PR_OUT_PARAM_LEN: usize = 24;
/// [`PR_OUT_PARAM_LEN`] as the CDB's 4-byte PARAMETER LIST LENGTH.
const PR_OUT_PARAM_LEN_FIELD: u32 = 24;
/// Bytes of the REPORT CAPABILITIES reply (SPC-4 table 215).
pub const REPORT_CAPABILITIES_LEN: u16 = 8;
/// Header bytes of the READ KEYS and READ RESERVATION replies (generation + additional length).
pub const PR_IN_HEADER_LEN: usize = 8;

/// PERSISTENT RESERVE IN service actions (CDB byte 1, bits 4-0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InAction {
    ReadKeys = 0x00,
    ReadReservation = 0x01,
    ReportCapabilities = 0x02,
}

/// PERSISTENT RESERVE OUT service actions (CDB byte 1, bits 4-0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutAction {
    /// Register SERVICE ACTION RESERVATION KEY if RESERVATION KEY matches the nexus's current
    /// key (0 when unregistered); a service action key of 0 unregisters.
    Register = 0x00,
    /// Create the reservation of the CDB's type; the nexus must be registered with this key.
    Reserve = 0x01,
    /// Release the reservation held by this nexus (type must match).
    Release = 0x02,
    /// Remove the reservation and every registration of every nexus.
    Clear = 0x03,
    /// Remove the registrations of SERVICE ACTION RESERVATION KEY (and take the reservation
    /// if that key held it).
    Preempt = 0x04,
    /// PREEMPT, and abort every task of the preempted nexuses in the task set.
    PreemptAndAbort = 0x05,
    /// Register SERVICE ACTION RESERVATION KEY whatever key the nexus had (RESERVATION KEY is
    /// ignored); 0 unregisters.
    RegisterAndIgnoreExistingKey = 0x06,
}

impl OutAction {
    pub fn name(self) -> &'static str {
        match self {
            OutAction::Register => "REGISTER",
            OutAction::Reserve => "RESERVE",
            OutAction::Release => "RELEASE",
            OutAction::Clear => "CLEAR",
            OutAction::Preempt => "PREEMPT",
            OutAction::PreemptAndAbort => "PREEMPT AND ABORT",
            OutAction::RegisterAndIgnoreExistingKey => "REGISTER AND IGNORE EXISTING KEY",
        }
    }

    /// Whether the TYPE field of the CDB is meaningful for this action (SPC-4 §6.16.2).
    pub fn uses_type(self) -> bool {
        matches!(
            self,
            OutAction::Reserve
                | OutAction::Release
                | OutAction::Preempt
                | OutAction::PreemptAndAbort
        )
    }
}

/// Persistent reservation types (SPC-4 table 212). Scope is always `LU_SCOPE` (0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrType {
    WriteExclusive = 1,
    ExclusiveAccess = 3,
    /// The type CetraFS uses: every registered nexus reads and writes, others only read.
    WriteExclusiveRegistrantsOnly = 5,
    ExclusiveAccessRegistrantsOnly = 6,
    WriteExclusiveAllRegistrants = 7,
    ExclusiveAccessAllRegistrants = 8,
}

impl PrType {
    pub const ALL: [PrType; 6] = [
        PrType::WriteExclusive,
        PrType::ExclusiveAccess,
        PrType::WriteExclusiveRegistrantsOnly,
        PrType::ExclusiveAccessRegistrantsOnly,
        PrType::WriteExclusiveAllRegistrants,
        PrType::ExclusiveAccessAllRegistrants,
    ];

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.code() == code)
    }

    pub fn code(self) -> u8 {
        self as u8
    }

    /// Short name as `sg_persist` prints it.
    pub fn name(self) -> &'static str {
        match self {
            PrType::WriteExclusive => "Write Exclusive",
            PrType::ExclusiveAccess => "Exclusive Access",
            PrType::WriteExclusiveRegistrantsOnly => "Write Exclusive, registrants only",
            PrType::ExclusiveAccessRegistrantsOnly => "Exclusive Access, registrants only",
            PrType::WriteExclusiveAllRegistrants => "Write Exclusive, all registrants",
            PrType::ExclusiveAccessAllRegistrants => "Exclusive Access, all registrants",
        }
    }

    /// This type's bit in REPORT CAPABILITIES' PERSISTENT RESERVATION TYPE MASK, read as one
    /// big-endian u16 of bytes 4-5: byte 4 bit 7 `WR_EX_AR`, 6 `EX_AC_RO`, 5 `WR_EX_RO`, 3 `EX_AC`,
    /// 1 `WR_EX`; byte 5 bit 0 `EX_AC_AR` (SPC-4 table 217).
    pub fn mask_bit(self) -> u16 {
        match self {
            PrType::WriteExclusiveAllRegistrants => 0x8000,
            PrType::ExclusiveAccessRegistrantsOnly => 0x4000,
            PrType::WriteExclusiveRegistrantsOnly => 0x2000,
            PrType::ExclusiveAccess => 0x0800,
            PrType::WriteExclusive => 0x0200,
            PrType::ExclusiveAccessAllRegistrants => 0x0001,
        }
    }
}

impl fmt::Display for PrType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (type {})", self.name(), self.code())
    }
}

/// PERSISTENT RESERVE IN: byte 1 service action, bytes 7-8 ALLOCATION LENGTH.
pub fn pr_in(action: InAction, alloc_len: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = PERSISTENT_RESERVE_IN;
    c[1] = action as u8;
    c[7..9].copy_from_slice(&alloc_len.to_be_bytes());
    c
}

/// PERSISTENT RESERVE OUT: byte 1 service action, byte 2 SCOPE (bits 7-4, always `LU_SCOPE` 0)
/// and TYPE (bits 3-0, 0 for actions that ignore it), bytes 5-8 PARAMETER LIST LENGTH (24
/// for the basic list).
pub fn pr_out(action: OutAction, ty: Option<PrType>) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = PERSISTENT_RESERVE_OUT;
    c[1] = action as u8;
    if action.uses_type() {
        c[2] = ty.map_or(0, PrType::code) & 0x0F;
    }
    c[5..9].copy_from_slice(&PR_OUT_PARAM_LEN_FIELD.to_be_bytes());
    c
}

/// The basic PERSISTENT RESERVE OUT parameter list (SPC-4 table 227).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutParams {
    /// Bytes 0-7: the key this nexus is registered with (ignored by REGISTER AND IGNORE
    /// EXISTING KEY; 0 for an unregistered nexus).
    pub key: u64,
    /// Bytes 8-15: the new key (REGISTER*) or the key to preempt (PREEMPT*).
    pub service_action_key: u64,
    /// Byte 20 bit 2, `ALL_TG_PT`: register on every target port at once (REGISTER* only).
    pub all_target_ports: bool,
    /// Byte 20 bit 0, APTPL: keep registrations and reservation over a target power loss
    /// (REGISTER* only).
    pub aptpl: bool,
}

impl OutParams {
    /// The 24 bytes. `SPEC_I_PT` (byte 20 bit 3) is never set: no `TransportID` list follows.
    pub fn encode(&self) -> [u8; PR_OUT_PARAM_LEN] {
        let mut p = [0u8; PR_OUT_PARAM_LEN];
        p[0..8].copy_from_slice(&self.key.to_be_bytes());
        p[8..16].copy_from_slice(&self.service_action_key.to_be_bytes());
        // bytes 16-19: obsolete (scope-specific address), 0
        if self.all_target_ports {
            p[20] |= 0x04;
        }
        if self.aptpl {
            p[20] |= 0x01;
        }
        p
    }
}

fn be_u32(d: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(d.get(at..at + 4)?.try_into().ok()?))
}

fn be_u64(d: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(d.get(at..at + 8)?.try_into().ok()?))
}

/// Total length a READ KEYS / READ RESERVATION reply claims (header included), to re-issue the
/// command with a larger allocation length.
pub fn pr_in_claimed_len(d: &[u8]) -> Option<usize> {
    let n = usize::try_from(be_u32(d, 4)?).ok()?;
    n.checked_add(PR_IN_HEADER_LEN)
}

/// The READ KEYS reply (SPC-4 table 213): every registered key, once per registered nexus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    /// `PRgeneration`: bumped by every REGISTER*, CLEAR, PREEMPT*, not by RESERVE/RELEASE.
    pub generation: u32,
    pub keys: Vec<u64>,
    /// The reply claimed more keys than the allocation length let through.
    pub truncated: bool,
}

impl Keys {
    /// `None` when the reply is shorter than its 8-byte header.
    pub fn parse(d: &[u8]) -> Option<Self> {
        let generation = be_u32(d, 0)?;
        let claimed = usize::try_from(be_u32(d, 4)?).unwrap_or(usize::MAX);
        let body = &d[PR_IN_HEADER_LEN..];
        let avail = claimed.min(body.len());
        let keys = body[..avail]
            .chunks_exact(8)
            .filter_map(|k| be_u64(k, 0))
            .collect();
        Some(Self {
            generation,
            keys,
            truncated: claimed > body.len(),
        })
    }
}

/// The reservation READ RESERVATION reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    /// The holder's reservation key (0 for the all-registrants types, SPC-4 §6.15.3.3).
    pub key: u64,
    /// Raw TYPE code (byte 21 bits 3-0); see [`Holder::pr_type`].
    pub type_code: u8,
    /// SCOPE (byte 21 bits 7-4); 0 = `LU_SCOPE`.
    pub scope: u8,
}

impl Holder {
    pub fn pr_type(&self) -> Option<PrType> {
        PrType::from_code(self.type_code)
    }
}

/// The READ RESERVATION reply (SPC-4 tables 214-215).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    pub generation: u32,
    /// `None` when the LUN is not reserved (ADDITIONAL LENGTH 0).
    pub holder: Option<Holder>,
}

impl Reservation {
    /// `None` when the reply is shorter than its header, or announces a reservation descriptor
    /// (ADDITIONAL LENGTH ≥ 16) that was not transferred whole.
    pub fn parse(d: &[u8]) -> Option<Self> {
        let generation = be_u32(d, 0)?;
        let claimed = be_u32(d, 4)?;
        if claimed == 0 {
            return Some(Self {
                generation,
                holder: None,
            });
        }
        if claimed < 16 {
            return None;
        }
        let key = be_u64(d, 8)?;
        let st = *d.get(21)?;
        Some(Self {
            generation,
            holder: Some(Holder {
                key,
                type_code: st & 0x0F,
                scope: st >> 4,
            }),
        })
    }
}

/// The REPORT CAPABILITIES reply (SPC-4 table 216).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "one field per capability bit of the reply, as SPC-4 names them"
)]
pub struct Capabilities {
    /// Byte 2 bit 4: Compatible Reservation Handling (SPC-2 RESERVE/RELEASE vs PR).
    pub crh: bool,
    /// Byte 2 bit 3: `SPEC_I_PT` is accepted.
    pub sip_c: bool,
    /// Byte 2 bit 2: `ALL_TG_PT` is accepted.
    pub atp_c: bool,
    /// Byte 2 bit 0: APTPL is accepted.
    pub ptpl_c: bool,
    /// Byte 3 bit 7: the type mask is valid.
    pub tmv: bool,
    /// Byte 3 bits 6-4: ALLOW COMMANDS.
    pub allow_commands: u8,
    /// Byte 3 bit 0: persist through power loss is active.
    pub ptpl_a: bool,
    /// Bytes 4-5 as one big-endian u16 (see [`PrType::mask_bit`]).
    pub type_mask: u16,
}

impl Capabilities {
    /// `None` when fewer than the 6 meaningful bytes arrived or LENGTH (bytes 0-1) is below 6.
    pub fn parse(d: &[u8]) -> Option<Self> {
        let len = u16::from_be_bytes([*d.first()?, *d.get(1)?]);
        if len < 6 || d.len() < 6 {
            return None;
        }
        Some(Self {
            crh: d[2] & 0x10 != 0,
            sip_c: d[2] & 0x08 != 0,
            atp_c: d[2] & 0x04 != 0,
            ptpl_c: d[2] & 0x01 != 0,
            tmv: d[3] & 0x80 != 0,
            allow_commands: (d[3] >> 4) & 0x07,
            ptpl_a: d[3] & 0x01 != 0,
            type_mask: u16::from_be_bytes([d[4], d[5]]),
        })
    }

    /// Whether the target says it supports `ty`. A target that leaves the type mask invalid
    /// (TMV=0) is taken at its word only as far as it says nothing: `None`.
    pub fn supports(&self, ty: PrType) -> Option<bool> {
        self.tmv.then_some(self.type_mask & ty.mask_bit() != 0)
    }

    /// The supported types (empty when TMV=0).
    pub fn types(&self) -> Vec<PrType> {
        PrType::ALL
            .into_iter()
            .filter(|&t| self.supports(t) == Some(true))
            .collect()
    }
}

impl fmt::Display for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CRH={} SIP_C={} ATP_C={} PTPL_C={} TMV={} ALLOW_COMMANDS={} PTPL_A={} types=",
            u8::from(self.crh),
            u8::from(self.sip_c),
            u8::from(self.atp_c),
            u8::from(self.ptpl_c),
            u8::from(self.tmv),
            self.allow_commands,
            u8::from(self.ptpl_a)
        )?;
        let t = self.types();
        if t.is_empty() {
            return f.write_str("unknown (type mask not valid)");
        }
        let codes: Vec<String> = t.iter().map(|t| t.code().to_string()).collect();
        f.write_str(&codes.join(","))
    }
}

/// Bits of the generation field in [`pr_key`].
pub const KEY_GENERATION_BITS: u32 = 20;
/// Bits of the slot field in [`pr_key`].
pub const KEY_SLOT_BITS: u32 = 12;

/// The reservation key of node slot `slot` at slot generation `generation` on the volume whose
/// uuid starts with the 4 bytes `volume_uuid_prefix` (big-endian, `uuid[0..4]`):
///
/// ```text
///  63                32 31        20 19                 0
/// +--------------------+------------+--------------------+
/// | volume uuid[0..4]  |  slot + 1  | generation mod 2^20 |
/// +--------------------+------------+--------------------+
/// ```
///
/// Never 0 (0 means "unregister" in REGISTER): the slot field holds `slot + 1`, 1..=4095.
/// mkfs caps slots at 1024, so distinct slots always get distinct keys; a slot number of 4095
/// or more (not made by mkfs) wraps modulo 4095 rather than panicking. Consecutive generations
/// of one slot differ, so a remount's key is never the key a survivor may be preempting. The
/// uuid prefix makes CetraFS keys recognisable in `sg_persist -k` output and keeps a previous
/// volume's stale keys apart from the current one's.
pub fn pr_key(volume_uuid_prefix: u32, slot: u32, generation: u64) -> u64 {
    let slot_field = u64::from(slot % ((1 << KEY_SLOT_BITS) - 1)) + 1;
    let gen_field = generation & ((1 << KEY_GENERATION_BITS) - 1);
    (u64::from(volume_uuid_prefix) << 32) | (slot_field << KEY_GENERATION_BITS) | gen_field
}

/// The key a node registers while it joins, before it knows its slot: the slot field is 0,
/// which [`pr_key`] never produces, so no recovery of a slot ever preempts it; the low 20
/// bits are `nonce`. It lets the joining node's mount probe and slot claim write through a
/// reserved LUN; the node replaces it by its slot key right after the claim.
pub fn joining_key(volume_uuid_prefix: u32, nonce: u32) -> u64 {
    let gen_field = u64::from(nonce) & ((1 << KEY_GENERATION_BITS) - 1);
    (u64::from(volume_uuid_prefix) << 32) | gen_field.max(1)
}

/// The node slot a CetraFS key of the volume with prefix `volume_uuid_prefix` names: `None`
/// for another volume's or a foreign key, `Some(None)` for a [`joining_key`].
pub fn key_slot(key: u64, volume_uuid_prefix: u32) -> Option<Option<u32>> {
    if key >> 32 != u64::from(volume_uuid_prefix) {
        return None;
    }
    let field = (key >> KEY_GENERATION_BITS) & ((1 << KEY_SLOT_BITS) - 1);
    Some(u32::try_from(field).ok().and_then(|f| f.checked_sub(1)))
}

/// [`pr_key`] with the prefix taken from a volume uuid.
pub fn volume_key_prefix(uuid: &[u8; 16]) -> u32 {
    u32::from_be_bytes([uuid[0], uuid[1], uuid[2], uuid[3]])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn key_slot_reads_back_pr_key_and_joining_key() {
        let prefix = 0xdead_beef;
        for (slot, gen) in [(0, 0), (3, 7), (1023, (1 << 20) + 5)] {
            assert_eq!(
                key_slot(pr_key(prefix, slot, gen), prefix),
                Some(Some(slot))
            );
        }
        let j = joining_key(prefix, 0);
        assert_ne!(j, 0);
        assert_eq!(key_slot(j, prefix), Some(None));
        assert_eq!(key_slot(pr_key(prefix, 3, 1), 0x1234), None);
    }

    #[test]
    fn pr_in_cdbs() {
        assert_eq!(
            pr_in(InAction::ReadKeys, 0x1234),
            [0x5e, 0, 0, 0, 0, 0, 0, 0x12, 0x34, 0]
        );
        assert_eq!(pr_in(InAction::ReadReservation, 24)[1], 1);
        assert_eq!(
            pr_in(InAction::ReportCapabilities, REPORT_CAPABILITIES_LEN),
            [0x5e, 2, 0, 0, 0, 0, 0, 0, 8, 0]
        );
    }

    #[test]
    fn pr_out_cdbs() {
        // same bytes as sg_persist --out --reserve --param-rk=.. --prout-type=5
        assert_eq!(
            pr_out(
                OutAction::Reserve,
                Some(PrType::WriteExclusiveRegistrantsOnly)
            ),
            [0x5f, 1, 5, 0, 0, 0, 0, 0, 24, 0]
        );
        assert_eq!(
            pr_out(
                OutAction::PreemptAndAbort,
                Some(PrType::WriteExclusiveRegistrantsOnly)
            )[..3],
            [0x5f, 5, 5]
        );
        // REGISTER* and CLEAR ignore the type: it is sent as 0 even if given
        assert_eq!(
            pr_out(
                OutAction::RegisterAndIgnoreExistingKey,
                Some(PrType::ExclusiveAccess)
            ),
            [0x5f, 6, 0, 0, 0, 0, 0, 0, 24, 0]
        );
        assert_eq!(pr_out(OutAction::Clear, None)[1..3], [3, 0]);
        assert_eq!(pr_out(OutAction::Register, None)[1], 0);
        assert_eq!(
            pr_out(OutAction::Release, Some(PrType::WriteExclusive))[1..3],
            [2, 1]
        );
        assert_eq!(
            pr_out(
                OutAction::Preempt,
                Some(PrType::ExclusiveAccessAllRegistrants)
            )[1..3],
            [4, 8]
        );
    }

    #[test]
    fn parameter_list_layout() {
        let p = OutParams {
            key: 0x0102_0304_0506_0708,
            service_action_key: 0x1112_1314_1516_1718,
            all_target_ports: false,
            aptpl: false,
        }
        .encode();
        assert_eq!(&p[0..8], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&p[8..16], &[0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18]);
        assert_eq!(&p[16..24], &[0; 8]);
        let p = OutParams {
            aptpl: true,
            all_target_ports: true,
            ..OutParams::default()
        }
        .encode();
        assert_eq!(p[20], 0x05);
        assert_eq!(p.iter().filter(|&&b| b != 0).count(), 1);
        assert_eq!(
            usize::try_from(PR_OUT_PARAM_LEN_FIELD).unwrap(),
            PR_OUT_PARAM_LEN
        );
    }

    #[test]
    fn read_keys() {
        let mut d = vec![0, 0, 0, 7, 0, 0, 0, 16];
        d.extend_from_slice(&0xAAu64.to_be_bytes());
        d.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        let k = Keys::parse(&d).unwrap();
        assert_eq!(k.generation, 7);
        assert_eq!(k.keys, vec![0xAA, 0x0102_0304_0506_0708]);
        assert!(!k.truncated);
        assert_eq!(pr_in_claimed_len(&d), Some(24));
        // allocation length cut the list: the whole keys that arrived, and truncated
        let mut short = d[..20].to_vec();
        short[7] = 24;
        let k = Keys::parse(&short).unwrap();
        assert_eq!((k.keys, k.truncated), (vec![0xAA], true));
        // no registrations
        let k = Keys::parse(&[0, 0, 1, 0, 0, 0, 0, 0]).unwrap();
        assert_eq!((k.generation, k.keys.len(), k.truncated), (256, 0, false));
        // a padded buffer beyond ADDITIONAL LENGTH is not read as keys
        let mut padded = d.clone();
        padded.extend_from_slice(&[0xFF; 16]);
        assert_eq!(Keys::parse(&padded).unwrap().keys.len(), 2);
        assert!(Keys::parse(&d[..7]).is_none());
    }

    #[test]
    fn read_reservation() {
        let none = Reservation::parse(&[0, 0, 0, 3, 0, 0, 0, 0]).unwrap();
        assert_eq!(
            none,
            Reservation {
                generation: 3,
                holder: None
            }
        );
        let mut d = vec![0, 0, 0, 9, 0, 0, 0, 16];
        d.extend_from_slice(&0xDEAD_BEEFu64.to_be_bytes());
        d.extend_from_slice(&[0, 0, 0, 0, 0, 0x05, 0, 0]);
        let r = Reservation::parse(&d).unwrap();
        let h = r.holder.unwrap();
        assert_eq!((r.generation, h.key, h.scope), (9, 0xDEAD_BEEF, 0));
        assert_eq!(h.pr_type(), Some(PrType::WriteExclusiveRegistrantsOnly));
        d[21] = 0x2F;
        let h = Reservation::parse(&d).unwrap().holder.unwrap();
        assert_eq!((h.scope, h.type_code, h.pr_type()), (2, 0xF, None));
        assert!(Reservation::parse(&d[..20]).is_none(), "descriptor cut");
        let mut bad = d.clone();
        bad[7] = 8;
        assert!(
            Reservation::parse(&bad).is_none(),
            "length 8 is no descriptor"
        );
    }

    #[test]
    fn report_capabilities() {
        // SIP_C, ATP_C, PTPL_C, TMV, all six types
        let d = [0, 8, 0x0D, 0x80, 0xEA, 0x01, 0, 0];
        let c = Capabilities::parse(&d).unwrap();
        assert!(c.sip_c && c.atp_c && c.ptpl_c && c.tmv && !c.crh && !c.ptpl_a);
        assert_eq!(c.allow_commands, 0);
        assert_eq!(c.types(), PrType::ALL.to_vec());
        assert_eq!(
            c.supports(PrType::WriteExclusiveRegistrantsOnly),
            Some(true)
        );
        assert!(c.to_string().contains("types=1,3,5,6,7,8"), "{c}");
        let c = Capabilities::parse(&[0, 8, 0x10, 0xA1, 0x20, 0, 0, 0]).unwrap();
        assert!(c.crh && c.ptpl_a);
        assert_eq!(c.allow_commands, 2);
        assert_eq!(c.types(), vec![PrType::WriteExclusiveRegistrantsOnly]);
        assert_eq!(c.supports(PrType::WriteExclusive), Some(false));
        let c = Capabilities::parse(&[0, 8, 0, 0, 0xFF, 0xFF, 0, 0]).unwrap();
        assert_eq!(c.supports(PrType::WriteExclusive), None, "TMV=0");
        assert!(c.types().is_empty());
        assert!(c.to_string().contains("unknown"), "{c}");
        assert!(Capabilities::parse(&[0, 8, 0, 0, 0]).is_none());
        assert!(Capabilities::parse(&[0, 4, 0, 0, 0, 0, 0, 0]).is_none());
    }

    #[test]
    fn type_codes_and_mask_bits_are_distinct() {
        for t in PrType::ALL {
            assert_eq!(PrType::from_code(t.code()), Some(t));
        }
        for c in [0, 2, 4, 9, 15] {
            assert_eq!(PrType::from_code(c), None);
        }
        let mut bits: Vec<u16> = PrType::ALL.iter().map(|t| t.mask_bit()).collect();
        bits.dedup();
        assert_eq!(bits.len(), 6);
        assert_eq!(bits.iter().fold(0, |a, b| a | b), 0xEA01);
    }

    #[test]
    fn key_layout() {
        assert_eq!(pr_key(0xA1B2_C3D4, 0, 0), 0xA1B2_C3D4_0010_0000);
        assert_eq!(pr_key(0xA1B2_C3D4, 2, 7), 0xA1B2_C3D4_0030_0007);
        assert_eq!(
            pr_key(0, 0, 0),
            1 << 20,
            "nonzero even for an all-zero input"
        );
        assert_eq!(pr_key(1, 1023, (1 << 20) + 5), (1 << 32) | (1024 << 20) | 5);
        assert_ne!(pr_key(1, 3, 8), pr_key(1, 3, 9));
        assert_eq!(
            volume_key_prefix(&[0xDE, 0xAD, 0xBE, 0xEF, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]),
            0xDEAD_BEEF
        );
    }

    proptest! {
        #[test]
        fn parsers_never_panic(d in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Keys::parse(&d);
            let _ = Reservation::parse(&d);
            if let Some(c) = Capabilities::parse(&d) { let _ = c.to_string(); }
            let _ = pr_in_claimed_len(&d);
        }

        #[test]
        fn keys_round_trip(gen in any::<u32>(), keys in proptest::collection::vec(any::<u64>(), 0..20)) {
            let mut d = gen.to_be_bytes().to_vec();
            d.extend_from_slice(&u32::try_from(keys.len() * 8).unwrap().to_be_bytes());
            for k in &keys { d.extend_from_slice(&k.to_be_bytes()); }
            let k = Keys::parse(&d).unwrap();
            prop_assert_eq!(k.generation, gen);
            prop_assert_eq!(k.keys, keys);
            prop_assert!(!k.truncated);
        }

        #[test]
        fn keys_nonzero_and_distinct_per_slot(p in any::<u32>(), s in 0u32..1024, t in 0u32..1024, g in any::<u64>()) {
            prop_assert_ne!(pr_key(p, s, g), 0);
            prop_assert_eq!(pr_key(p, s, g) >> 32, u64::from(p));
            if s != t { prop_assert_ne!(pr_key(p, s, g), pr_key(p, t, g)); }
            prop_assert_ne!(pr_key(p, s, g), pr_key(p, s, g.wrapping_add(1)));
        }

        #[test]
        fn key_never_zero_any_slot(p in any::<u32>(), s in any::<u32>(), g in any::<u64>()) {
            prop_assert_ne!(pr_key(p, s, g), 0);
        }
    }
}
