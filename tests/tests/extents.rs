//! Allocation quality seen from outside: a big VM image written sequentially must be a handful
//! of extents, and two files growing at the same time must not interleave into tiny extents.
//! Extents are read from the unmounted LUN with the core format decoders (FIEMAP does not pass
//! through FUSE).
//!
//! `CETRA_EXTENTS_GIB` changes the size of the big file (default 8).

use cetrafs_tests::{
    lstat, physical_runs, read_extents, require_fuse, secs, AlignedBuf, Lun, Mount,
};
use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::Instant;

const MIB: u64 = 1 << 20;

/// Write `mib` MiB sequentially with 1 MiB O_DIRECT writes; each MiB carries its index.
fn write_sequential(path: &Path, mib: u64) {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut buf = AlignedBuf::new(usize::try_from(MIB).unwrap());
    for i in 0..mib {
        for (k, chunk) in buf.chunks_mut(4096).enumerate() {
            chunk[..8].copy_from_slice(&i.to_le_bytes());
            chunk[8..16].copy_from_slice(&(k as u64).to_le_bytes());
            chunk[16] = 0xa5;
        }
        f.write_all_at(&buf, i * MIB)
            .unwrap_or_else(|e| panic!("write MiB {i} of {}: {e}", path.display()));
    }
    f.sync_all().expect("fsync");
}

/// Spot-check some MiBs of a file written by `write_sequential`.
fn spot_check(path: &Path, mib: u64) {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open");
    let mut buf = AlignedBuf::new(usize::try_from(MIB).unwrap());
    for i in [0, 1, mib / 3, mib / 2, mib - 2, mib - 1] {
        f.read_exact_at(&mut buf, i * MIB).expect("read");
        for (k, chunk) in buf.chunks(4096).enumerate() {
            assert!(
                chunk[..8] == i.to_le_bytes()
                    && chunk[8..16] == (k as u64).to_le_bytes()
                    && chunk[16] == 0xa5,
                "{}: MiB {i} block {k} has wrong content",
                path.display()
            );
        }
    }
}

/// Check that the extents cover [0, blocks) exactly, all written, and return (extents, runs).
fn check_extents(lun: &Path, ino: u64, bytes: u64, what: &str) -> (usize, usize) {
    let ext = read_extents(lun, ino)
        .unwrap_or_else(|e| panic!("{what}: reading extents of inode {ino}: {e:#}"));
    let mut next = 0u64;
    for e in &ext {
        assert_eq!(
            e.logical, next,
            "{what}: gap or overlap in the extent map at file block {next}: {ext:?}"
        );
        assert!(
            !e.unwritten(),
            "{what}: extent {e:?} is still unwritten after writing"
        );
        next = e.end();
    }
    assert_eq!(
        next,
        bytes / 4096,
        "{what}: extents cover {next} blocks, file has {}",
        bytes / 4096
    );
    let mut lens: Vec<u64> = ext.iter().map(|e| u64::from(e.len) * 4096 / 1024).collect();
    lens.sort_unstable();
    eprintln!(
        "extents: {what}: {} extents, sizes in KiB (sorted): {lens:?}",
        ext.len()
    );
    (ext.len(), physical_runs(&ext))
}

#[test]
fn big_sequential_file_has_few_extents() {
    require_fuse!();
    let gib: u64 = std::env::var("CETRA_EXTENTS_GIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let lun = Lun::new(16 << 30);
    lun.mkfs(&["-q"]);
    let m = Mount::new(&lun, "extents");
    let path = m.p("vm-100-disk-0.raw");
    let t = Instant::now();
    write_sequential(&path, gib << 10);
    let elapsed = t.elapsed();
    spot_check(&path, gib << 10);
    let st = lstat(&path).expect("stat");
    assert_eq!(u64::try_from(st.st_size).unwrap(), gib << 30);
    let ino = st.st_ino;
    m.unmount();
    let (n, runs) = check_extents(lun.path(), ino, gib << 30, "big file");
    eprintln!(
        "extents: {gib} GiB written with 1 MiB O_DIRECT writes in {} ({:.0} MiB/s): {n} extents, {runs} physical runs",
        secs(elapsed),
        (gib << 10) as f64 / elapsed.as_secs_f64()
    );
    assert!(
        n <= 16,
        "a {gib} GiB sequentially written file has {n} extents (limit 16)"
    );
    lun.assert_fsck_clean();
}

#[test]
fn concurrent_growth_does_not_interleave() {
    require_fuse!();
    const MIBS: u64 = 256;
    let lun = Lun::new(4 << 30);
    lun.mkfs(&["-q"]);
    let m = Mount::new(&lun, "interleave");
    let (a, b) = (m.p("a.raw"), m.p("b.raw"));
    let t = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| write_sequential(&a, MIBS));
        s.spawn(|| write_sequential(&b, MIBS));
    });
    let elapsed = t.elapsed();
    spot_check(&a, MIBS);
    spot_check(&b, MIBS);
    let (ia, ib) = (
        lstat(&a).expect("stat").st_ino,
        lstat(&b).expect("stat").st_ino,
    );
    m.unmount();
    let (na, ra) = check_extents(lun.path(), ia, MIBS * MIB, "file a");
    let (nb, rb) = check_extents(lun.path(), ib, MIBS * MIB, "file b");
    eprintln!(
        "extents: 2 x {MIBS} MiB written concurrently in {}: a {na} extents ({ra} runs), b {nb} extents ({rb} runs)",
        secs(elapsed)
    );
    assert!(
        na <= 32 && nb <= 32,
        "concurrently grown files fragmented: a {na} extents, b {nb} extents (limit 32)"
    );
    lun.assert_fsck_clean();
}
