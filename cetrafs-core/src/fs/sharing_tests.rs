//! The sharing mode of a format-4 volume, enforced at mount (`fs/mount.rs` steps 1b and 2b):
//! a single-host volume refuses a node of another machine while that machine's slot is alive,
//! and writes nothing doing so; a multi-node volume refuses a path without SCSI COMPARE AND
//! WRITE; a volume that records no mode (format 3) mounts as before. Machines are played with
//! `MountOptions::machine`; tests/tests/multinode.rs runs the same through daemons and
//! `CETRA_MACHINE_ID`.

use super::multinode_tests::volume;
use super::*;
use crate::cluster::machine::MachineId;
use crate::cluster::membership;
use crate::dev::mem::MemDevice;
use crate::dev::BlockDevice;
use crate::format::superblock::SharingMode;
use crate::mkfs::{format, MkfsOptions};
use std::time::{Duration, Instant};

const A: MachineId = MachineId([0xaa; 16]);
const B: MachineId = MachineId([0xbb; 16]);

fn mount_on(dev: &Arc<MemDevice>, host: &str, machine: MachineId) -> Result<Arc<Volume>> {
    Volume::mount(
        dev.clone(),
        &MountOptions {
            host: host.into(),
            machine: Some(machine),
            ..MountOptions::default()
        },
    )
}

/// The heartbeat area, byte for byte.
fn heartbeats(dev: &MemDevice) -> Vec<u8> {
    let sb = read_superblock(dev).unwrap();
    let mut b = vec![0u8; usize::try_from(sb.hb_blocks * crate::format::FS_BLOCK).unwrap()];
    dev.read_at(sb.hb_start * crate::format::FS_BLOCK, &mut b)
        .unwrap();
    b
}

#[test]
fn a_single_host_volume_refuses_a_second_machine_until_the_first_unmounts() {
    let dev = volume(4);
    let sb = read_superblock(&*dev).unwrap();
    assert_eq!(sb.sharing, Some(SharingMode::SingleHost));
    let a = mount_on(&dev, "node-a", A).unwrap();
    // Its record carries the machine.
    let views = membership::scan(&*dev, &sb).unwrap();
    let rec = views[a.slot() as usize].record.clone().unwrap();
    assert_eq!(rec.machine, A);

    let before = heartbeats(&dev);
    let started = Instant::now();
    let e = mount_on(&dev, "node-b", B).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    let m = e.to_string();
    for want in [
        "single-host volume is mounted on another machine",
        "\"node-a\"",
        &A.to_string(),
        &B.to_string(),
        "without SCSI COMPARE AND WRITE",
        "Unmount it there",
        "docs/san.md",
    ] {
        assert!(m.contains(want), "{want:?} missing from: {m}");
    }
    // Refused as soon as a's heartbeat moved, not after a dead time; nothing written.
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let after = heartbeats(&dev);
    let changed: Vec<usize> = (0..before.len() / 512)
        .filter(|&s| before[s * 512..(s + 1) * 512] != after[s * 512..(s + 1) * 512])
        .collect();
    assert_eq!(
        changed,
        vec![a.slot() as usize],
        "only a's renewals changed the area"
    );
    // Read-only is refused too: it takes locks with the same COMPARE AND WRITE.
    let e = Volume::mount(
        dev.clone(),
        &MountOptions {
            host: "node-b".into(),
            machine: Some(B),
            read_only: true,
            ..MountOptions::default()
        },
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");

    // Another node of the same machine is welcome.
    let c = mount_on(&dev, "node-c", A).unwrap();
    a.unmount().unwrap();
    // While c (machine A) holds it, B is still refused, naming c.
    let e = mount_on(&dev, "node-b", B).unwrap_err();
    assert!(e.to_string().contains("\"node-c\""), "{e}");
    c.unmount().unwrap();
    // Both unmounted cleanly: machine B mounts, and its record says so.
    let b = mount_on(&dev, "node-b", B).unwrap();
    let views = membership::scan(&*dev, &sb).unwrap();
    assert_eq!(views[b.slot() as usize].record.as_ref().unwrap().machine, B);
    b.unmount().unwrap();
}

/// A slot of another machine that stays silent for its dead time is a dead node, recovered
/// by the mount like any other; the refusal is for machines that are alive.
#[test]
fn a_dead_slot_of_another_machine_is_recovered() {
    let dev = volume(4);
    let a = mount_on(&dev, "node-a", A).unwrap();
    let r = a.root_ino();
    let (f, fh) = a.create(r, b"kept", 0o644, Caller::ROOT, true).unwrap();
    a.write(&fh, 0, b"journaled").unwrap();
    a.fsync(f.ino, false).unwrap();
    a.member.fence("test: simulated crash".into());
    let started = Instant::now();
    let b = mount_on(&dev, "node-b", B).unwrap();
    let dead = crate::cluster::Timing::from_ms(50, 100).dead_time();
    assert!(started.elapsed() >= dead, "waited {:?}", started.elapsed());
    assert_eq!(b.lookup(r, b"kept").unwrap().size, 9);
    drop(fh);
    b.unmount().unwrap();
}

#[test]
fn a_multi_node_volume_refuses_a_path_without_scsi_compare_and_write() {
    let dev = Arc::new(MemDevice::new(512 << 20, 512));
    let opts = MkfsOptions {
        max_nodes: 2,
        journal_bytes: 1 << 20,
        sharing: Some(SharingMode::MultiNode),
        ..Default::default()
    };
    format(&*dev, &opts, &mut |_, _| {}).unwrap();
    let before = heartbeats(&dev);
    let e = mount_on(&dev, "n", A).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    let m = e.to_string();
    assert!(
        m.contains("multi-node volume") && m.contains("no SCSI COMPARE AND WRITE"),
        "{m}"
    );
    assert!(m.contains("dm-multipath map"), "{m}");
    assert_eq!(heartbeats(&dev), before, "nothing written");
}

/// A format-3 volume records no sharing mode: machines are not told apart, as before.
#[test]
fn a_volume_without_a_sharing_mode_mounts_from_any_machine() {
    let dev = Arc::new(MemDevice::new(512 << 20, 512));
    let opts = MkfsOptions {
        max_nodes: 2,
        journal_bytes: 1 << 20,
        heartbeat_interval_ms: 50,
        io_timeout_ms: 100,
        sharing: None,
        ..Default::default()
    };
    let sb = format(&*dev, &opts, &mut |_, _| {}).unwrap();
    assert_eq!((sb.format_version(), sb.sharing), (3, None));
    let a = mount_on(&dev, "node-a", A).unwrap();
    let b = mount_on(&dev, "node-b", B).unwrap();
    b.unmount().unwrap();
    a.unmount().unwrap();
}
