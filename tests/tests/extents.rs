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

/// Write `mib` MiB sequentially with 1 MiB `O_DIRECT` writes; each MiB carries its index.
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

/// Spot-check some MiB of a file written by `write_sequential`.
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
    #[expect(clippy::cast_precision_loss, reason = "a rate for the log")]
    let rate = (gib << 10) as f64 / elapsed.as_secs_f64();
    eprintln!(
        "extents: {gib} GiB written with 1 MiB O_DIRECT writes in {} ({rate:.0} MiB/s): {n} extents, {runs} physical runs",
        secs(elapsed),
    );
    assert!(
        n <= 16,
        "a {gib} GiB sequentially written file has {n} extents (limit 16)"
    );
    lun.assert_fsck_clean();
}

#[test]
fn concurrent_growth_does_not_interleave() {
    const MIBS: u64 = 256;
    require_fuse!();
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

/// The byte at `offset` of the file `thin_image_takes_concurrent_direct_writers` writes.
fn thin_byte(offset: u64) -> u8 {
    (offset.wrapping_mul(0x9e37_79b9) >> 13).to_le_bytes()[0] ^ 0xa5
}

/// Read the whole file with `O_DIRECT` and compare every byte with `thin_byte`.
fn verify_thin(path: &Path, bytes: u64, what: &str) {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open");
    let mut buf = AlignedBuf::new(usize::try_from(MIB).expect("1 MiB fits"));
    for m in 0..bytes / MIB {
        f.read_exact_at(&mut buf, m * MIB).expect("read");
        for (i, &b) in buf.iter().enumerate() {
            let off = m * MIB + i as u64;
            assert_eq!(b, thin_byte(off), "{what}: wrong byte at offset {off}");
        }
    }
}

/// A thin (sparse) image written at a deep queue: 16 threads with their own `O_DIRECT`
/// descriptors write every 4 KiB block of a fresh sparse file once, in shuffled order; every
/// eighth block is written as two 2 KiB halves by two different threads, so writers race for
/// the same unmapped block. Every byte is checked, before and after a remount, and fsck is
/// clean (no block allocated twice or leaked).
#[test]
fn thin_image_takes_concurrent_direct_writers() {
    const BYTES: u64 = 64 * MIB;
    const THREADS: usize = 16;
    require_fuse!();
    let lun = Lun::new(2 << 30);
    lun.mkfs(&["-q"]);
    let m = Mount::new(&lun, "thin");
    let path = m.p("vm-101-disk-0.raw");
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("create");
    f.set_len(BYTES).expect("ftruncate");
    drop(f);
    // (offset, length) of every write, dealt to the threads and shuffled per thread.
    let blocks = BYTES / 4096;
    let mut work: Vec<Vec<(u64, usize)>> = vec![Vec::new(); THREADS];
    for k in 0..blocks {
        let t = usize::try_from(k).expect("block index fits") % THREADS;
        if k % 8 == 0 {
            work[t].push((k * 4096, 2048));
            work[(t + 1) % THREADS].push((k * 4096 + 2048, 2048));
        } else {
            work[t].push((k * 4096, 4096));
        }
    }
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for w in &mut work {
        for i in (1..w.len()).rev() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let n = u64::try_from(i + 1).expect("fits");
            w.swap(i, usize::try_from(seed % n).expect("below i + 1"));
        }
    }
    let t = Instant::now();
    std::thread::scope(|s| {
        for w in &work {
            let path = &path;
            s.spawn(move || {
                let f = OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(path)
                    .expect("open O_DIRECT");
                let mut buf = AlignedBuf::new(4096);
                for &(off, len) in w {
                    for (i, b) in buf[..len].iter_mut().enumerate() {
                        *b = thin_byte(off + i as u64);
                    }
                    f.write_all_at(&buf[..len], off)
                        .unwrap_or_else(|e| panic!("write {len} bytes at {off}: {e}"));
                }
            });
        }
    });
    let elapsed = t.elapsed();
    let writes: usize = work.iter().map(Vec::len).sum();
    #[expect(clippy::cast_precision_loss, reason = "a rate for the log")]
    let rate = writes as f64 / elapsed.as_secs_f64();
    eprintln!(
        "extents: {writes} O_DIRECT writes from {THREADS} threads into a fresh sparse file in {} ({rate:.0} writes/s)",
        secs(elapsed),
    );
    verify_thin(&path, BYTES, "before remount");
    let st = lstat(&path).expect("stat");
    assert_eq!(u64::try_from(st.st_size).ok(), Some(BYTES));
    // Data blocks plus the extent tree's nodes: no block was allocated twice.
    let used = u64::try_from(st.st_blocks).expect("non-negative") * 512;
    assert!(
        (BYTES..BYTES + 2 * MIB).contains(&used),
        "{used} bytes allocated for a {BYTES}-byte file"
    );
    let ino = st.st_ino;
    m.unmount();
    // Every block mapped exactly once, all written (check_extents would list 16,000 sizes).
    let ext = read_extents(lun.path(), ino).expect("reading the extents");
    let mut next = 0;
    for e in &ext {
        assert!(
            e.logical == next && !e.unwritten(),
            "extent {e:?} at block {next}"
        );
        next = e.end();
    }
    assert_eq!(next, BYTES / 4096, "extents end at block {next}");
    lun.assert_fsck_clean();
    let m = Mount::new(&lun, "thin");
    verify_thin(&m.p("vm-101-disk-0.raw"), BYTES, "after remount");
    m.unmount();
}
