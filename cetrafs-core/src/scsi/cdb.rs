//! Command descriptor block builders (SBC-3/SPC-4). Pure byte layout, no I/O.
//!
//! Every multi-byte field is big-endian. Byte offsets below follow the standards' tables so a
//! reader can check them against SBC-3 §5 / SPC-4 §6 directly.

/// Operation codes used by the `SG_IO` backend.
pub mod op {
    pub const TEST_UNIT_READY: u8 = 0x00;
    pub const INQUIRY: u8 = 0x12;
    pub const SYNCHRONIZE_CACHE_10: u8 = 0x35;
    pub const UNMAP: u8 = 0x42;
    pub const READ_16: u8 = 0x88;
    pub const COMPARE_AND_WRITE: u8 = 0x89;
    pub const WRITE_16: u8 = 0x8A;
    pub const SYNCHRONIZE_CACHE_16: u8 = 0x91;
    pub const SERVICE_ACTION_IN_16: u8 = 0x9E;
    /// Service action of SERVICE ACTION IN(16) for READ CAPACITY(16).
    pub const SA_READ_CAPACITY_16: u8 = 0x10;
}

/// VPD page codes this crate parses.
pub mod vpd_page {
    pub const SUPPORTED_PAGES: u8 = 0x00;
    pub const UNIT_SERIAL: u8 = 0x80;
    pub const DEVICE_IDENTIFICATION: u8 = 0x83;
    pub const BLOCK_LIMITS: u8 = 0xB0;
    pub const LOGICAL_BLOCK_PROVISIONING: u8 = 0xB2;
}

/// Bytes of one UNMAP block descriptor.
pub const UNMAP_DESCRIPTOR_LEN: usize = 16;
/// Bytes of the UNMAP parameter list header.
pub const UNMAP_HEADER_LEN: usize = 8;

fn rw16(opcode: u8, lba: u64, blocks: u32, fua: bool) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = opcode;
    if fua {
        c[1] = 0x08;
    }
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

/// READ(16): `blocks` logical blocks from `lba`.
pub fn read16(lba: u64, blocks: u32) -> [u8; 16] {
    rw16(op::READ_16, lba, blocks, false)
}

/// WRITE(16): `blocks` logical blocks at `lba`; `fua` forces them to the medium before GOOD.
pub fn write16(lba: u64, blocks: u32, fua: bool) -> [u8; 16] {
    rw16(op::WRITE_16, lba, blocks, fua)
}

/// COMPARE AND WRITE (0x89) of `nolb` blocks at `lba`. The data-out buffer is
/// `2 * nolb * block_size` bytes: the verify image first, then the write image.
/// `nolb` is a one-byte field; LIO and most arrays accept only 1.
pub fn compare_and_write(lba: u64, nolb: u8) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op::COMPARE_AND_WRITE;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[13] = nolb;
    c
}

/// The COMPARE AND WRITE data-out buffer: verify image then write image, in one allocation.
pub fn compare_and_write_data(expected: &[u8], new: &[u8], out: &mut [u8]) {
    let n = expected.len();
    out[..n].copy_from_slice(expected);
    out[n..n + new.len()].copy_from_slice(new);
}

/// SYNCHRONIZE CACHE(16) of the whole LUN (LBA 0, NUMBER OF BLOCKS 0 = to the end), IMMED=0 so
/// GOOD means the cache is on stable media.
pub fn synchronize_cache16() -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op::SYNCHRONIZE_CACHE_16;
    c
}

/// SYNCHRONIZE CACHE(10) of the whole LUN: fallback for targets without the 16-byte form.
pub fn synchronize_cache10() -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = op::SYNCHRONIZE_CACHE_10;
    c
}

/// UNMAP(10) with a parameter list of `param_len` bytes (see [`unmap_parameter_list`]).
pub fn unmap(param_len: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = op::UNMAP;
    c[7..9].copy_from_slice(&param_len.to_be_bytes());
    c
}

/// The UNMAP parameter list for `(lba, blocks)` ranges: an 8-byte header (UNMAP DATA LENGTH =
/// n-2, BLOCK DESCRIPTOR DATA LENGTH = 16 * ranges) then one 16-byte descriptor per range.
pub fn unmap_parameter_list(ranges: &[(u64, u32)]) -> Vec<u8> {
    let desc_len = ranges.len() * UNMAP_DESCRIPTOR_LEN;
    let total = UNMAP_HEADER_LEN + desc_len;
    let mut p = vec![0u8; total];
    // Both lengths are u16 fields; callers cap the descriptor count far below 4095.
    let data_len = u16::try_from(total - 2).unwrap_or(u16::MAX);
    let bd_len = u16::try_from(desc_len).unwrap_or(u16::MAX);
    p[0..2].copy_from_slice(&data_len.to_be_bytes());
    p[2..4].copy_from_slice(&bd_len.to_be_bytes());
    for (i, &(lba, blocks)) in ranges.iter().enumerate() {
        let d = &mut p[UNMAP_HEADER_LEN + i * UNMAP_DESCRIPTOR_LEN..][..UNMAP_DESCRIPTOR_LEN];
        d[0..8].copy_from_slice(&lba.to_be_bytes());
        d[8..12].copy_from_slice(&blocks.to_be_bytes());
    }
    p
}

/// Standard INQUIRY with `alloc_len` bytes of allocation length.
pub fn inquiry(alloc_len: u16) -> [u8; 6] {
    let mut c = [0u8; 6];
    c[0] = op::INQUIRY;
    c[3..5].copy_from_slice(&alloc_len.to_be_bytes());
    c
}

/// INQUIRY with EVPD=1 for vital product data page `page`.
pub fn inquiry_vpd(page: u8, alloc_len: u16) -> [u8; 6] {
    let mut c = inquiry(alloc_len);
    c[1] = 0x01;
    c[2] = page;
    c
}

/// Bytes READ CAPACITY(16) returns (SBC-3 table 65).
pub const READ_CAPACITY_16_LEN: u32 = 32;

/// READ CAPACITY(16): SERVICE ACTION IN(16) / 0x10, allocation length 32.
pub fn read_capacity16() -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op::SERVICE_ACTION_IN_16;
    c[1] = op::SA_READ_CAPACITY_16;
    c[10..14].copy_from_slice(&READ_CAPACITY_16_LEN.to_be_bytes());
    c
}

/// TEST UNIT READY: clears pending UNIT ATTENTIONs at open.
pub fn test_unit_ready() -> [u8; 6] {
    [op::TEST_UNIT_READY, 0, 0, 0, 0, 0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_write_16() {
        let c = read16(0x0102_0304_0506_0708, 0x0a0b_0c0d);
        assert_eq!(
            c,
            [0x88, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0x0a, 0x0b, 0x0c, 0x0d, 0, 0]
        );
        let w = write16(5, 8, false);
        assert_eq!(w, [0x8a, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 8, 0, 0]);
        assert_eq!(write16(5, 8, true)[1], 0x08);
    }

    /// Same bytes as libiscsi's `scsi_cdb_compareandwrite(lba, xferlen = 2*bs, bs, 0, 0, 0, 0, 0)`.
    #[test]
    fn caw_cdb_matches_libiscsi_layout() {
        let c = compare_and_write(0x1234, 1);
        assert_eq!(c, [0x89, 0, 0, 0, 0, 0, 0, 0, 0x12, 0x34, 0, 0, 0, 1, 0, 0]);
        let c = compare_and_write(u64::MAX, 255);
        assert_eq!(&c[2..10], &[0xff; 8]);
        assert_eq!(c[13], 255);
        assert_eq!(c[1], 0, "no DPO/FUA/WRPROTECT");
    }

    #[test]
    fn caw_data_is_verify_then_write() {
        let mut out = [0u8; 8];
        compare_and_write_data(&[1, 2, 3, 4], &[5, 6, 7, 8], &mut out);
        assert_eq!(out, [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn sync_cache() {
        assert_eq!(synchronize_cache16(), {
            let mut c = [0u8; 16];
            c[0] = 0x91;
            c
        });
        assert_eq!(synchronize_cache10(), [0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn unmap_cdb_and_list() {
        let p = unmap_parameter_list(&[(0x10, 0x20), (0x1_0000_0000, 7)]);
        assert_eq!(p.len(), 8 + 32);
        assert_eq!(&p[0..8], &[0, 38, 0, 32, 0, 0, 0, 0]);
        assert_eq!(
            &p[8..24],
            &[0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0x20, 0, 0, 0, 0]
        );
        assert_eq!(
            &p[24..40],
            &[0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0]
        );
        let c = unmap(40);
        assert_eq!(c, [0x42, 0, 0, 0, 0, 0, 0, 0, 40, 0]);
    }

    #[test]
    fn inquiry_cdbs() {
        assert_eq!(inquiry(96), [0x12, 0, 0, 0, 96, 0]);
        assert_eq!(inquiry_vpd(0x83, 0x1000), [0x12, 1, 0x83, 0x10, 0, 0]);
        assert_eq!(
            inquiry_vpd(vpd_page::BLOCK_LIMITS, 64),
            [0x12, 1, 0xb0, 0, 64, 0]
        );
        assert_eq!(
            inquiry_vpd(vpd_page::LOGICAL_BLOCK_PROVISIONING, 64)[2],
            0xb2
        );
    }

    #[test]
    fn read_capacity() {
        let c = read_capacity16();
        assert_eq!(c, [0x9e, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0]);
        assert_eq!(test_unit_ready(), [0; 6]);
    }
}
