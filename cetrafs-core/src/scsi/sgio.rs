//! The Linux `SG_IO` interface: `struct sg_io_hdr` from `<scsi/sg.h>` and the ioctl itself.
//!
//! libc does not carry `sg_io_hdr` or `SG_IO`, so the header is declared here by hand and its
//! layout pinned by compile-time assertions. `SG_IO` (0x2285) is a legacy ioctl number that is
//! not `_IOWR`-encoded, hence nix's `_bad` variant.

use std::ffi::{c_int, c_uint, c_ushort, c_void};

/// `interface_id` value for the v3 interface (`'S'`).
pub const SG_INTERFACE_ID_ORIG: c_int = b'S' as c_int;
/// No data transfer (TEST UNIT READY, SYNCHRONIZE CACHE).
pub const SG_DXFER_NONE: c_int = -1;
/// Data-out: host to device (WRITE, COMPARE AND WRITE, UNMAP).
pub const SG_DXFER_TO_DEV: c_int = -2;
/// Data-in: device to host (READ, INQUIRY, READ CAPACITY).
pub const SG_DXFER_FROM_DEV: c_int = -3;
/// `info` bit: set when status, `host_status` or `driver_status` is not clean.
pub const SG_INFO_CHECK: c_uint = 0x1;

/// Data direction of one command, as the `SG_IO` header encodes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    None,
    ToDevice,
    FromDevice,
}

impl Direction {
    pub fn as_sg(self) -> c_int {
        match self {
            Direction::None => SG_DXFER_NONE,
            Direction::ToDevice => SG_DXFER_TO_DEV,
            Direction::FromDevice => SG_DXFER_FROM_DEV,
        }
    }
}

/// `struct sg_io_hdr` (Linux `include/uapi/scsi/sg.h`), field for field.
#[repr(C)]
#[derive(Debug)]
pub struct SgIoHdr {
    pub interface_id: c_int,
    pub dxfer_direction: c_int,
    pub cmd_len: u8,
    pub mx_sb_len: u8,
    pub iovec_count: c_ushort,
    pub dxfer_len: c_uint,
    pub dxferp: *mut c_void,
    pub cmdp: *const u8,
    pub sbp: *mut u8,
    /// Milliseconds; 0 means the driver default (which for sg is 60 s).
    pub timeout: c_uint,
    pub flags: c_uint,
    pub pack_id: c_int,
    pub usr_ptr: *mut c_void,
    /// SCSI status byte (GOOD 0x00, CHECK CONDITION 0x02, BUSY 0x08, ...).
    pub status: u8,
    pub masked_status: u8,
    pub msg_status: u8,
    /// Bytes of sense data actually written to `sbp`.
    pub sb_len_wr: u8,
    /// Transport (HBA) result: DID_* codes.
    pub host_status: c_ushort,
    /// Midlayer result: DRIVER_* codes.
    pub driver_status: c_ushort,
    pub resid: c_int,
    pub duration: c_uint,
    pub info: c_uint,
}

#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
const _: () = {
    assert!(std::mem::size_of::<SgIoHdr>() == 88);
    assert!(std::mem::offset_of!(SgIoHdr, dxferp) == 16);
    assert!(std::mem::offset_of!(SgIoHdr, timeout) == 40);
    assert!(std::mem::offset_of!(SgIoHdr, usr_ptr) == 56);
    assert!(std::mem::offset_of!(SgIoHdr, status) == 64);
    assert!(std::mem::offset_of!(SgIoHdr, host_status) == 68);
    assert!(std::mem::offset_of!(SgIoHdr, resid) == 72);
    assert!(std::mem::offset_of!(SgIoHdr, info) == 80);
};

impl SgIoHdr {
    /// A header for one command. The caller keeps `cdb`, `data` and `sense` alive and unmoved
    /// until the ioctl returns: the header holds raw pointers into them.
    pub fn new(
        cdb: &[u8],
        dir: Direction,
        data: *mut u8,
        data_len: u32,
        sense: &mut [u8],
        timeout_ms: u32,
    ) -> Self {
        Self {
            interface_id: SG_INTERFACE_ID_ORIG,
            dxfer_direction: dir.as_sg(),
            cmd_len: u8::try_from(cdb.len()).unwrap_or(u8::MAX),
            mx_sb_len: u8::try_from(sense.len()).unwrap_or(u8::MAX),
            iovec_count: 0,
            dxfer_len: data_len,
            dxferp: data.cast::<c_void>(),
            cmdp: cdb.as_ptr(),
            sbp: sense.as_mut_ptr(),
            timeout: timeout_ms,
            flags: 0,
            pack_id: 0,
            usr_ptr: std::ptr::null_mut(),
            status: 0,
            masked_status: 0,
            msg_status: 0,
            sb_len_wr: 0,
            host_status: 0,
            driver_status: 0,
            resid: 0,
            duration: 0,
            info: 0,
        }
    }
}

nix::ioctl_readwrite_bad!(
    /// `ioctl(fd, SG_IO, &mut hdr)`: submit one command and wait for it.
    sg_io,
    0x2285,
    SgIoHdr
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_points_at_buffers() {
        let cdb = [0u8; 16];
        let mut sense = [0u8; 32];
        let mut data = [0u8; 512];
        let h = SgIoHdr::new(
            &cdb,
            Direction::FromDevice,
            data.as_mut_ptr(),
            512,
            &mut sense,
            30_000,
        );
        assert_eq!(h.interface_id, 0x53);
        assert_eq!(h.cmd_len, 16);
        assert_eq!(h.mx_sb_len, 32);
        assert_eq!(h.dxfer_direction, -3);
        assert_eq!(h.dxfer_len, 512);
        assert_eq!(h.timeout, 30_000);
        assert_eq!(Direction::None.as_sg(), -1);
        assert_eq!(Direction::ToDevice.as_sg(), -2);
    }
}
