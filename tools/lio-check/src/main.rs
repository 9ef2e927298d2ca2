//! Guest-side checks of `cetrafs_core::dev::sg::SgDevice` against a real SCSI target.
//!
//! `tests/lio/run` boots a qemu guest whose kernel exports LIO backstores through `tcm_loop` and
//! runs `lio-check all ...` there. Every check prints one `PASS`/`FAIL` line; the last line is
//! `LIO-CHECK-RESULT PASS|FAIL` and the exit status is 0 only if everything passed.
//!
//! Subcommands:
//! - `all --d512 SG --d512-sd SD --d4k SG --d4k-sd SD --paths SG,SG,SG --nocaw SG --size BYTES
//!   [--caw-total N] [--stall SG --stall-dm NAME] [--pr-abort 1]`: everything below.
//! - `pr --paths SG,SG,SG [--pr-abort 1]`: SCSI-3 persistent reservations through three nexuses of one LUN
//!   (register, reserve Write Exclusive – Registrants Only, RESERVATION CONFLICT of an
//!   unregistered and of a preempted nexus, PREEMPT AND ABORT, CLEAR; see `pr.rs`); `all`
//!   runs it on its `--paths` after the contention check.
//! - `fs-multi --tag TAG --devs SD,SD,SD --interval MS --io-timeout MS [--files N]`: the
//!   multi-node filesystem scenarios with the real mkfs.cetra / mount.cetra / fsck.cetra on
//!   three nexuses of one LUN (see `fsmulti.rs`).
//! - `daemon-log --tag TAG --name NAME --log FILE`: one check that a `mount.cetra` log has no
//!   ERROR line and no panic (see `daemonlog.rs`; guest-init.sh's single-node mount).
//! - `worker --dev SG --lba N --count N --id N --out FILE`: one contention process (spawned by
//!   `all`): read + COMPARE AND WRITE(counter+1) until `count` CAWs succeeded.

mod daemonlog;
mod fence;
mod fsmulti;
mod pr;

use cetrafs_core::dev::file::{FileDevice, FileDeviceOptions};
use cetrafs_core::dev::sg::{is_whole_lun, DataBuf, SgDevice, SgDeviceOptions, WholeLun};
use cetrafs_core::dev::{AlignedBuf, BlockDevice, CawKind, CawOutcome};
use cetrafs_core::scsi::{self, cdb, sense, CommandKind, Outcome};
use cetrafs_core::ErrorKind;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

type CheckResult = Result<String, String>;

struct Report {
    pass: u32,
    fail: u32,
}

impl Report {
    fn check(&mut self, lun: &str, name: &str, r: CheckResult) {
        match r {
            Ok(detail) => {
                self.pass += 1;
                println!("PASS {lun} {name}: {detail}");
            }
            Err(detail) => {
                self.fail += 1;
                println!("FAIL {lun} {name}: {detail}");
            }
        }
        let _ = std::io::stdout().flush();
    }
}

fn args_map(args: &[String]) -> Result<HashMap<String, String>, String> {
    let mut m = HashMap::new();
    let mut it = args.iter();
    while let Some(k) = it.next() {
        let key = k
            .strip_prefix("--")
            .ok_or_else(|| format!("unexpected argument {k:?}"))?;
        let v = it.next().ok_or_else(|| format!("--{key} needs a value"))?;
        m.insert(key.to_string(), v.clone());
    }
    Ok(m)
}

fn get<'a>(m: &'a HashMap<String, String>, k: &str) -> Result<&'a str, String> {
    m.get(k)
        .map(String::as_str)
        .ok_or_else(|| format!("missing --{k}"))
}

fn num(m: &HashMap<String, String>, k: &str) -> Result<u64, String> {
    get(m, k)?.parse().map_err(|e| format!("--{k}: {e}"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        eprintln!("usage: lio-check all|pr|worker|fs-multi|fence|daemon-log --key value ...");
        return ExitCode::from(2);
    };
    let r = args_map(rest).and_then(|m| match cmd.as_str() {
        "all" => run_all(&m),
        "pr" => {
            let paths: Vec<String> = get(&m, "paths")?.split(',').map(str::to_string).collect();
            let mut rep = Report { pass: 0, fail: 0 };
            pr::pr(
                &mut rep,
                &paths,
                m.get("pr-abort").is_some_and(|v| v == "1"),
            );
            Ok(rep.fail == 0 && rep.pass > 0)
        }
        "worker" => worker(&m).map(|()| true),
        "fs-multi" => fsmulti::fs_multi(&m),
        "fence" => fence::fence(&m),
        "daemon-log" => daemonlog::daemon_log(&m),
        other => Err(format!("unknown subcommand {other:?}")),
    });
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("lio-check {cmd}: {e}");
            if cmd == "all" {
                println!("LIO-CHECK-RESULT FAIL ({e})");
            }
            ExitCode::from(2)
        }
    }
}

fn open(path: &str) -> Result<SgDevice, String> {
    SgDevice::open(Path::new(path), &SgDeviceOptions::default()).map_err(|e| e.to_string())
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "a rounded index in 0..len"
    )]
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn us(d: Duration) -> String {
    format!("{}us", d.as_micros())
}

fn random_block(len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    for x in b.iter_mut() {
        *x = rand::random();
    }
    b
}

fn run_all(m: &HashMap<String, String>) -> Result<bool, String> {
    let t_all = Instant::now();
    let size = num(m, "size")?;
    let caw_total = m
        .get("caw-total")
        .map_or(Ok(10_200), |_| num(m, "caw-total"))?;
    let mut rep = Report { pass: 0, fail: 0 };
    let mut summary = Vec::new();

    for (tag, lbs) in [("d512", 512u32), ("d4k", 4096u32)] {
        let t = Instant::now();
        conformance(
            &mut rep,
            tag,
            get(m, tag)?,
            get(m, &format!("{tag}-sd"))?,
            lbs,
            size,
            &mut summary,
        );
        summary.push(format!(
            "conformance {tag}: {:.2}s",
            t.elapsed().as_secs_f64()
        ));
    }

    let paths: Vec<String> = get(m, "paths")?.split(',').map(str::to_string).collect();
    let t = Instant::now();
    contention(&mut rep, &paths, caw_total, &mut summary);
    summary.push(format!("contention: {:.2}s", t.elapsed().as_secs_f64()));

    // persistent reservations on the same nexuses; leaves the LUN unreserved (CLEAR)
    let t = Instant::now();
    pr::pr(
        &mut rep,
        &paths,
        m.get("pr-abort").is_some_and(|v| v == "1"),
    );
    summary.push(format!(
        "persistent reservations: {:.2}s",
        t.elapsed().as_secs_f64()
    ));

    nocaw(&mut rep, get(m, "nocaw")?);

    match (m.get("stall"), m.get("stall-dm")) {
        (Some(sg), Some(dm)) => {
            let t = Instant::now();
            stall(&mut rep, sg, dm);
            summary.push(format!("stall: {:.2}s", t.elapsed().as_secs_f64()));
        }
        _ => println!("SKIP stall: no --stall LUN"),
    }

    println!("---- summary ----");
    for s in &summary {
        println!("SUMMARY {s}");
    }
    println!(
        "SUMMARY checks: {} passed, {} failed, {:.2}s",
        rep.pass,
        rep.fail,
        t_all.elapsed().as_secs_f64()
    );
    let ok = rep.fail == 0 && rep.pass > 0;
    println!("LIO-CHECK-RESULT {}", if ok { "PASS" } else { "FAIL" });
    Ok(ok)
}

/// (a) `SgDevice` against one LUN, through its sg node and its sd node.
fn conformance(
    rep: &mut Report,
    tag: &str,
    sg: &str,
    sd: &str,
    lbs: u32,
    size: u64,
    summary: &mut Vec<String>,
) {
    let dev = match open(sg) {
        Ok(d) => d,
        Err(e) => return rep.check(tag, "open", Err(e)),
    };
    let geo = dev.geometry().clone();
    let info = dev.info().clone();
    let lbsz = lbs as usize;
    rep.check(
        tag,
        "open+INQUIRY",
        if info.inquiry.vendor == "LIO-ORG" && geo.caw == CawKind::Scsi {
            Ok(format!(
                "{sg}: {} {} {}",
                info.inquiry.vendor, info.inquiry.product, info.inquiry.revision
            ))
        } else {
            Err(format!("{:?} caw={:?}", info.inquiry, geo.caw))
        },
    );
    rep.check(
        tag,
        "READ CAPACITY(16)",
        if geo.logical_block_size == lbs
            && geo.size_bytes == size
            && info.capacity.blocks == size / u64::from(lbs)
        {
            Ok(format!(
                "{} blocks x {} B, physical {} B, lbpme={} lbprz={}",
                info.capacity.blocks,
                geo.logical_block_size,
                geo.physical_block_size,
                info.capacity.lbpme,
                info.capacity.lbprz
            ))
        } else {
            Err(format!(
                "expected {size} bytes of {lbs}-byte blocks, got {geo:?}"
            ))
        },
    );
    rep.check(
        tag,
        "VPD 0x83 identity",
        if geo.identity.starts_with("naa.") && geo.identity.len() > 8 {
            Ok(geo.identity.clone())
        } else {
            Err(format!("identity {:?}", geo.identity))
        },
    );
    rep.check(
        tag,
        "VPD 0xB0 block limits",
        match &info.block_limits {
            Some(b) if b.max_compare_and_write_len == Some(1) => Ok(format!(
                "max CAW {:?}, max transfer {:?} blocks, max unmap {:?} LBAs / {:?} descriptors, unmap granularity {:?}; using {} B per command",
                b.max_compare_and_write_len,
                b.max_transfer_length,
                b.max_unmap_lba_count,
                b.max_unmap_block_descriptor_count,
                b.optimal_unmap_granularity,
                info.max_transfer_bytes
            )),
            other => Err(format!("{other:?}")),
        },
    );
    rep.check(
        tag,
        "VPD 0xB2 provisioning",
        match info.provisioning {
            Some(p) if p.unmap => Ok(format!("{p:?}")),
            other => Err(format!("expected LBPU=1 (emulate_tpu=1), got {other:?}")),
        },
    );
    rep.check(
        tag,
        "unsupported VPD page",
        match dev.vpd(0xC7) {
            Ok(None) => Ok("VPD 0xC7 rejected cleanly (ILLEGAL REQUEST -> None)".into()),
            other => Err(format!("{other:?}")),
        },
    );

    // READ/WRITE round trip across the per-command chunk boundary, at a non-zero offset.
    let chunk = info.max_transfer_bytes as usize;
    let len = 2 * chunk + 3 * lbsz;
    let off = 7 * u64::from(lbs);
    rep.check(
        tag,
        "WRITE(16)/READ(16) round trip",
        (|| {
            let data = random_block(len);
            let t = Instant::now();
            dev.write_at(off, &data).map_err(|e| e.to_string())?;
            let tw = t.elapsed();
            let mut back = AlignedBuf::new(len);
            let t = Instant::now();
            dev.read_at(off, &mut back).map_err(|e| e.to_string())?;
            let tr = t.elapsed();
            if back[..] != data[..] {
                return Err("read back differs".into());
            }
            // unaligned caller buffers work too (the kernel bounces)
            let mut v = vec![0u8; lbsz * 3 + 1];
            dev.read_at(off + u64::from(lbs), &mut v[1..])
                .map_err(|e| e.to_string())?;
            if v[1..] != data[lbsz..lbsz * 4] {
                return Err("unaligned read differs".into());
            }
            #[expect(clippy::cast_precision_loss, reason = "a rate for the log")]
            let mb = len as f64 / 1e6;
            Ok(format!(
                "{len} B in {} commands: write {:.1} MB/s, read {:.1} MB/s, unaligned read ok",
                len.div_ceil(chunk),
                mb / tw.as_secs_f64(),
                mb / tr.as_secs_f64()
            ))
        })(),
    );
    rep.check(
        tag,
        "SYNCHRONIZE CACHE",
        dev.flush()
            .map(|()| "GOOD".to_string())
            .map_err(|e| e.to_string()),
    );

    // The sd node of the same LUN sees the data written through the sg node.
    rep.check(
        tag,
        "sd node sees sg writes",
        (|| {
            let sdd = open(sd)?;
            if sdd.geometry().identity != geo.identity {
                return Err(format!(
                    "identity {} vs {}",
                    sdd.geometry().identity,
                    geo.identity
                ));
            }
            let mut a = AlignedBuf::new(lbsz * 4);
            let mut b = AlignedBuf::new(lbsz * 4);
            dev.read_at(off, &mut a).map_err(|e| e.to_string())?;
            sdd.read_at(off, &mut b).map_err(|e| e.to_string())?;
            if a[..] != b[..] {
                return Err("data differs between sg and sd node".into());
            }
            Ok(format!("{sd} identity and data match"))
        })(),
    );
    // Block zeroing as a granule's zeros go out (`BlockDevice::write_zeroes` of a kernel block
    // device: BLKZEROOUT, which the sd driver sends as WRITE SAME): the range reads as zeros
    // through the sg node, its neighbours keep their data.
    rep.check(
        tag,
        "write_zeroes (BLKZEROOUT) through the sd node",
        (|| {
            let fdev = FileDevice::open(Path::new(sd), &FileDeviceOptions::default())
                .map_err(|e| e.to_string())?;
            // LIO reports WRITE SAME: the data path's granules take the offloaded way.
            if !fdev.offloads_zeroes() {
                return Err("the sd node does not report zeroing offload".into());
            }
            let zoff = 4u64 << 20;
            let data = random_block(256 << 10);
            dev.write_at(zoff, &data).map_err(|e| e.to_string())?;
            let (z0, z1) = (zoff + u64::from(lbs), zoff + (256 << 10) - u64::from(lbs));
            fdev.write_zeroes(z0, z1 - z0).map_err(|e| e.to_string())?;
            let mut back = AlignedBuf::new(256 << 10);
            dev.read_at(zoff, &mut back).map_err(|e| e.to_string())?;
            let edge = lbsz;
            if back[..edge] != data[..edge]
                || back[back.len() - edge..] != data[data.len() - edge..]
            {
                return Err("the blocks next to the zeroed range changed".into());
            }
            if back[edge..back.len() - edge].iter().any(|&x| x != 0) {
                return Err("the zeroed range does not read as zeros".into());
            }
            let name = Path::new(sd)
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default();
            let offload =
                std::fs::read_to_string(format!("/sys/block/{name}/queue/write_zeroes_max_bytes"))
                    .map_or_else(|_| "unknown".to_string(), |s| s.trim().to_string());
            Ok(format!(
                "{} bytes read as zeros, neighbours kept (write_zeroes_max_bytes {offload})",
                z1 - z0
            ))
        })(),
    );
    rep.check(
        tag,
        "is_whole_lun",
        match (is_whole_lun(Path::new(sg)), is_whole_lun(Path::new(sd))) {
            (Ok(WholeLun::ScsiGeneric { name: a }), Ok(WholeLun::ScsiDisk { name: b })) => {
                Ok(format!("{a}: ScsiGeneric, {b}: ScsiDisk"))
            }
            other => Err(format!("{other:?}")),
        },
    );

    // COMPARE AND WRITE: success, then a miscompare that must leave the block alone.
    let lba = 4096 / u64::from(lbs) * 16 + 5;
    let boff = lba * u64::from(lbs);
    let mut cur = AlignedBuf::new(lbsz);
    let a = random_block(lbsz);
    rep.check(
        tag,
        "CAW success",
        (|| {
            dev.read_at(boff, &mut cur).map_err(|e| e.to_string())?;
            match dev
                .compare_and_write(lba, &cur, &a)
                .map_err(|e| e.to_string())?
            {
                CawOutcome::Written => {}
                CawOutcome::Miscompare => return Err("miscompare with the current contents".into()),
            }
            let mut back = AlignedBuf::new(lbsz);
            dev.read_at(boff, &mut back).map_err(|e| e.to_string())?;
            if back[..] != a[..] {
                return Err("block does not hold the write image".into());
            }
            Ok(format!("LBA {lba} now holds the new image"))
        })(),
    );
    rep.check(
        tag,
        "CAW miscompare",
        (|| {
            let mut wrong = a.clone();
            wrong[37] ^= 0xFF;
            let b = random_block(lbsz);
            match dev
                .compare_and_write(lba, &wrong, &b)
                .map_err(|e| e.to_string())?
            {
                CawOutcome::Miscompare => {}
                CawOutcome::Written => {
                    return Err("wrote although the verify image differed".into())
                }
            }
            let mut back = AlignedBuf::new(lbsz);
            dev.read_at(boff, &mut back).map_err(|e| e.to_string())?;
            if back[..] != a[..] {
                return Err("miscompare changed the block".into());
            }
            Ok("Miscompare, block unchanged".into())
        })(),
    );
    // Same miscompare through the raw interface: decode the sense data ourselves.
    rep.check(
        tag,
        "CAW miscompare sense",
        (|| {
            let mut wrong = a.clone();
            wrong[37] ^= 0xFF;
            let mut data = AlignedBuf::new(2 * lbsz);
            cdb::compare_and_write_data(&wrong, &random_block(lbsz), &mut data);
            let r = dev
                .execute(
                    &cdb::compare_and_write(lba, 1),
                    DataBuf::Out(&data),
                    Duration::from_secs(10),
                )
                .map_err(|e| e.to_string())?;
            let s = sense::Sense::parse(&r.completion.sense)
                .ok_or_else(|| format!("no sense data: {:?}", r.completion))?;
            if r.completion.status != scsi::outcome::status::CHECK_CONDITION
                || s.key != 0x0E
                || s.asc != 0x1D
            {
                return Err(format!("status 0x{:02x}, {s}", r.completion.status));
            }
            if let Some(i) = s.information {
                if i != 37 {
                    return Err(format!(
                        "INFORMATION {i}, expected 37 (first differing byte)"
                    ));
                }
            }
            let cls = scsi::classify(CommandKind::CompareAndWrite, &r.completion);
            if !matches!(cls, Outcome::Miscompare { .. }) {
                return Err(format!("classified as {cls:?}"));
            }
            Ok(format!(
                "status CHECK CONDITION, response code 0x{:02x}, {s}",
                s.response_code
            ))
        })(),
    );
    // READ beyond the end: ILLEGAL REQUEST / LBA OUT OF RANGE, classified as Range.
    rep.check(
        tag,
        "READ beyond capacity",
        (|| {
            let mut buf = AlignedBuf::new(lbsz);
            let r = dev
                .execute(
                    &cdb::read16(info.capacity.blocks, 1),
                    DataBuf::In(&mut buf),
                    Duration::from_secs(10),
                )
                .map_err(|e| e.to_string())?;
            match scsi::classify(CommandKind::Read, &r.completion) {
                Outcome::Failed(f) if f.error_kind() == ErrorKind::Range => Ok(f.to_string()),
                other => Err(format!("{other:?}")),
            }
        })(),
    );

    // UNMAP: raw command must be GOOD (the backend would hide a rejection), then discard().
    rep.check(
        tag,
        "UNMAP",
        (|| {
            let ulba = 2048 * 512 / u64::from(lbs);
            let n = 64u32;
            dev.write_at(ulba * u64::from(lbs), &random_block(n as usize * lbsz))
                .map_err(|e| e.to_string())?;
            let list = cdb::unmap_parameter_list(&[(ulba, n)]);
            let plen = u16::try_from(list.len()).map_err(|e| e.to_string())?;
            let r = dev
                .execute(
                    &cdb::unmap(plen),
                    DataBuf::Out(&list),
                    Duration::from_secs(10),
                )
                .map_err(|e| e.to_string())?;
            if scsi::classify(CommandKind::Unmap, &r.completion) != Outcome::Good {
                return Err(format!(
                    "raw UNMAP: {:?}",
                    scsi::classify(CommandKind::Unmap, &r.completion)
                ));
            }
            dev.discard(
                (ulba + u64::from(n)) * u64::from(lbs),
                u64::from(n) * u64::from(lbs),
            )
            .map_err(|e| e.to_string())?;
            let mut back = AlignedBuf::new(2 * n as usize * lbsz);
            dev.read_at(ulba * u64::from(lbs), &mut back)
                .map_err(|e| e.to_string())?;
            let zero = back.iter().all(|&x| x == 0);
            if info.capacity.lbprz && !zero {
                return Err("LBPRZ=1 but unmapped blocks do not read as zeros".into());
            }
            Ok(format!(
                "raw UNMAP GOOD, discard() ok, unmapped range reads {} (lbprz={})",
                if zero { "zeros" } else { "old data" },
                info.capacity.lbprz
            ))
        })(),
    );

    rep.check(
        tag,
        "probe_caw",
        match dev.probe_caw(lba + 1) {
            Ok(p) => Ok(format!(
                "ok, vpd max {:?}, first CAW {}",
                p.vpd_max_compare_and_write,
                us(p.latency)
            )),
            Err(e) => Err(e.to_string()),
        },
    );

    // Uncontended CAW latency, for comparison with the contended numbers.
    rep.check(
        tag,
        "uncontended CAW latency",
        (|| {
            let mut cur = AlignedBuf::new(lbsz);
            dev.read_at(boff, &mut cur).map_err(|e| e.to_string())?;
            let mut lat = Vec::with_capacity(500);
            for i in 0..500u32 {
                let mut next = cur.clone();
                next[..4].copy_from_slice(&i.to_le_bytes());
                next[4] ^= 1;
                let t = Instant::now();
                if dev
                    .compare_and_write(lba, &cur, &next)
                    .map_err(|e| e.to_string())?
                    != CawOutcome::Written
                {
                    return Err(format!("miscompare at iteration {i} without contention"));
                }
                lat.push(t.elapsed());
                cur = next;
            }
            lat.sort();
            let s = format!(
                "500 CAWs: p50 {} p99 {} max {}",
                us(pct(&lat, 0.5)),
                us(pct(&lat, 0.99)),
                us(lat[lat.len() - 1])
            );
            summary.push(format!("{tag} uncontended CAW latency {s}"));
            Ok(s)
        })(),
    );
    let st = dev.stats();
    println!(
        "INFO {tag} retries: unit attention {}, busy {}, transport {}",
        st.unit_attention_retries
            .load(std::sync::atomic::Ordering::Relaxed),
        st.busy_retries.load(std::sync::atomic::Ordering::Relaxed),
        st.transport_retries
            .load(std::sync::atomic::Ordering::Relaxed)
    );
}

const MAGIC: u64 = 0x5A5A_C3C3_0F0F_9696;
const CONTEND_LBA: u64 = 1000;

fn encode(block: &mut [u8], counter: u64, id: u64, nonce: u64) {
    block[0..8].copy_from_slice(&counter.to_le_bytes());
    block[8..16].copy_from_slice(&(counter ^ MAGIC).to_le_bytes());
    block[16..24].copy_from_slice(&id.to_le_bytes());
    block[24..32].copy_from_slice(&nonce.to_le_bytes());
    // Fill the rest from the counter so the whole block, not just the header, is compared.
    #[allow(clippy::cast_possible_truncation)]
    let f = (counter as u8).wrapping_mul(31).wrapping_add(id as u8);
    block[32..].fill(f);
}

fn decode(block: &[u8]) -> Result<u64, String> {
    let c = u64::from_le_bytes(block[0..8].try_into().map_err(|_| "short block")?);
    let chk = u64::from_le_bytes(block[8..16].try_into().map_err(|_| "short block")?);
    if chk != c ^ MAGIC {
        return Err(format!(
            "counter block is torn or foreign: counter {c}, check {chk:#x}"
        ));
    }
    Ok(c)
}

/// One contention process: `count` successful CAW(counter → counter+1) on `dev`.
/// Writes (value, `latency_ns`) pairs of its successful CAWs to `out`.
fn worker(m: &HashMap<String, String>) -> Result<(), String> {
    let dev = open(get(m, "dev")?)?;
    let lba = num(m, "lba")?;
    let count = num(m, "count")?;
    let id = num(m, "id")?;
    let lbs = dev.geometry().logical_block_size as usize;
    let off = lba * lbs as u64;
    let mut cur = AlignedBuf::new(lbs);
    let mut new = AlignedBuf::new(lbs);
    let mut out = Vec::with_capacity(usize::try_from(count).unwrap_or(0) * 16);
    let (mut ok, mut miscompares, mut reads, mut torn) = (0u64, 0u64, 1u64, 0u64);
    let mut all_lat = Vec::new();
    dev.read_at(off, &mut cur).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    while ok < count {
        // A plain READ racing with another initiator's CAW may return a torn block: SCSI gives
        // READ no atomicity against a concurrent write (LIO fileio copies through the page
        // cache without a lock against readers). Lock records therefore carry a checksum, and
        // a torn image is simply read again (a CAW with it could only miscompare).
        let c = match decode(&cur) {
            Ok(c) => c,
            Err(e) => {
                torn += 1;
                if torn > 100_000 {
                    return Err(format!("{e} (after {torn} torn reads)"));
                }
                reads += 1;
                dev.read_at(off, &mut cur).map_err(|e| e.to_string())?;
                continue;
            }
        };
        encode(&mut new, c + 1, id, rand::random());
        let t = Instant::now();
        let r = dev
            .compare_and_write(lba, &cur, &new)
            .map_err(|e| e.to_string())?;
        let lat = t.elapsed();
        all_lat.push(lat);
        match r {
            CawOutcome::Written => {
                ok += 1;
                out.extend_from_slice(&(c + 1).to_le_bytes());
                out.extend_from_slice(
                    &u64::try_from(lat.as_nanos())
                        .unwrap_or(u64::MAX)
                        .to_le_bytes(),
                );
                cur.copy_from_slice(&new);
            }
            CawOutcome::Miscompare => {
                miscompares += 1;
                reads += 1;
                dev.read_at(off, &mut cur).map_err(|e| e.to_string())?;
            }
        }
    }
    std::fs::write(get(m, "out")?, &out).map_err(|e| e.to_string())?;
    all_lat.sort();
    println!(
        "WORKER id={id} dev={} ok={ok} miscompares={miscompares} reads={reads} torn-reads={torn} elapsed={:.2}s all-CAW p50={} p99={}",
        dev.path().display(),
        t0.elapsed().as_secs_f64(),
        us(pct(&all_lat, 0.5)),
        us(pct(&all_lat, 0.99))
    );
    Ok(())
}

/// (b) N processes, each on its own nexus (sg node) to the same backstore, increment one
/// counter block with read + CAW; no update may be lost or duplicated.
fn contention(rep: &mut Report, paths: &[String], total: u64, summary: &mut Vec<String>) {
    let n = paths.len() as u64;
    rep.check(
        "multi",
        "nexuses share one LUN",
        (|| {
            let ids: Vec<String> = paths
                .iter()
                .map(|p| open(p).map(|d| d.geometry().identity.clone()))
                .collect::<Result<_, _>>()?;
            if n < 3 || ids.iter().any(|i| *i != ids[0]) {
                return Err(format!("{paths:?} -> {ids:?}"));
            }
            Ok(format!("{} paths {paths:?}, identity {}", n, ids[0]))
        })(),
    );
    let r = (|| -> Result<String, String> {
        let dev = open(&paths[0])?;
        let lbs = dev.geometry().logical_block_size as usize;
        let mut b = AlignedBuf::new(lbs);
        encode(&mut b, 0, 0, 0);
        dev.write_at(CONTEND_LBA * lbs as u64, &b)
            .map_err(|e| e.to_string())?;
        dev.flush().map_err(|e| e.to_string())?;
        let per = total.div_ceil(n);
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        let children: Vec<_> = paths
            .iter()
            .enumerate()
            .map(|(i, p)| {
                std::process::Command::new(&exe)
                    .args([
                        "worker",
                        "--dev",
                        p,
                        "--lba",
                        &CONTEND_LBA.to_string(),
                        "--count",
                        &per.to_string(),
                    ])
                    .args([
                        "--id",
                        &(i + 1).to_string(),
                        "--out",
                        &format!("/tmp/worker-{i}.bin"),
                    ])
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<_, _>>()?;
        let mut failed = Vec::new();
        for (i, c) in children.into_iter().enumerate() {
            let o = c.wait_with_output().map_err(|e| e.to_string())?;
            print!("{}", String::from_utf8_lossy(&o.stdout));
            if !o.status.success() {
                failed.push(format!("worker {i}: {}", o.status));
            }
        }
        let elapsed = t0.elapsed();
        if !failed.is_empty() {
            return Err(failed.join(", "));
        }
        let mut values = Vec::new();
        let mut lat = Vec::new();
        for i in 0..paths.len() {
            let d = std::fs::read(format!("/tmp/worker-{i}.bin")).map_err(|e| e.to_string())?;
            for rec in d.chunks_exact(16) {
                let mut v = [0u8; 8];
                v.copy_from_slice(&rec[..8]);
                values.push(u64::from_le_bytes(v));
                v.copy_from_slice(&rec[8..]);
                lat.push(Duration::from_nanos(u64::from_le_bytes(v)));
            }
        }
        let expected = per * n;
        values.sort_unstable();
        let dups = values.windows(2).filter(|w| w[0] == w[1]).count();
        let contiguous = values.iter().copied().eq(1..=expected);
        dev.read_at(CONTEND_LBA * lbs as u64, &mut b)
            .map_err(|e| e.to_string())?;
        let fin = decode(&b)?;
        lat.sort();
        #[expect(clippy::cast_precision_loss, reason = "a rate for the log")]
        let rate = values.len() as f64 / elapsed.as_secs_f64();
        let s = format!(
            "{} successful CAWs by {n} processes in {:.2}s ({rate:.0}/s); final counter {fin}; duplicates {dups}; lost updates {}; CAW latency p50 {} p99 {} max {}",
            values.len(),
            elapsed.as_secs_f64(),
            expected.saturating_sub(fin),
            us(pct(&lat, 0.5)),
            us(pct(&lat, 0.99)),
            us(lat.last().copied().unwrap_or_default())
        );
        summary.push(format!("contention {s}"));
        if fin != expected || !contiguous || dups != 0 || (values.len() as u64) < 10_000.min(total)
        {
            return Err(s);
        }
        Ok(s)
    })();
    rep.check("multi", "CAW counter contention", r);
}

/// (c) A LUN with `emulate_caw=0`: `probe_caw` must fail with the clear Unsupported message.
fn nocaw(rep: &mut Report, sg: &str) {
    let dev = match open(sg) {
        Ok(d) => d,
        Err(e) => return rep.check("nocaw", "open", Err(e)),
    };
    rep.check(
        "nocaw",
        "probe_caw refuses",
        match dev.probe_caw(100) {
            Err(e)
                if e.kind() == ErrorKind::Unsupported
                    && e.to_string().contains("does not support COMPARE AND WRITE") =>
            {
                Ok(e.to_string())
            }
            Err(e) => Err(format!("wrong error ({:?}): {e}", e.kind())),
            Ok(p) => Err(format!("probe succeeded: {p:?}")),
        },
    );
    let lbs = dev.geometry().logical_block_size as usize;
    let b = AlignedBuf::new(lbs);
    rep.check(
        "nocaw",
        "compare_and_write error kind",
        match dev.compare_and_write(5, &b, &b) {
            Err(e) if e.kind() == ErrorKind::Unsupported && !scsi::outcome_unknown(&e) => {
                Ok(e.to_string())
            }
            other => Err(format!("{other:?}")),
        },
    );
    // A LUN without thin provisioning: discard must be a silent no-op.
    rep.check(
        "nocaw",
        "discard without UNMAP support",
        match dev.discard(0, 8 * lbs as u64) {
            Ok(()) => Ok(format!(
                "no-op (provisioning {:?}, lbpme {})",
                dev.info().provisioning,
                dev.info().capacity.lbpme
            )),
            Err(e) => Err(e.to_string()),
        },
    );
}

fn dmsetup(args: &[&str]) -> Result<(), String> {
    let o = std::process::Command::new("dmsetup")
        .arg("--noudevsync")
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "dmsetup {args:?}: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ))
    }
}

/// (d) A COMPARE AND WRITE that outlives its timeout: the dm device under the LUN's iblock
/// backstore is suspended, so the target cannot finish the command; `SG_IO` times out and the
/// error must say "outcome unknown". After resuming, re-reading the block resolves it, which
/// is what the lock layer does.
fn stall(rep: &mut Report, sg: &str, dm: &str) {
    let opts = SgDeviceOptions {
        io_timeout: Duration::from_secs(2),
        ..SgDeviceOptions::default()
    };
    let dev = match SgDevice::open(Path::new(sg), &opts) {
        Ok(d) => d,
        Err(e) => return rep.check("stall", "open", Err(e.to_string())),
    };
    let lbs = dev.geometry().logical_block_size as usize;
    let lba = 10u64;
    let r = (|| -> CheckResult {
        let mut cur = AlignedBuf::new(lbs);
        dev.read_at(lba * lbs as u64, &mut cur)
            .map_err(|e| e.to_string())?;
        let new = random_block(lbs);
        dmsetup(&["suspend", "--noflush", dm])?;
        let dm_name = dm.to_string();
        let resumer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(6));
            dmsetup(&["resume", &dm_name])
        });
        let t = Instant::now();
        let res = dev.compare_and_write(lba, &cur, &new);
        let waited = t.elapsed();
        resumer
            .join()
            .map_err(|_| "resume thread panicked".to_string())??;
        let e = match res {
            Ok(o) => {
                return Err(format!(
                    "CAW returned {o:?} after {waited:?} although the LUN was stalled for 6 s with a 2 s timeout"
                ))
            }
            Err(e) => e,
        };
        if !scsi::outcome_unknown(&e) || e.kind() != ErrorKind::Io {
            return Err(format!(
                "error does not say outcome unknown ({:?}): {e}",
                e.kind()
            ));
        }
        // Resolve the unknown outcome the way the lock layer will: re-read.
        let mut back = AlignedBuf::new(lbs);
        let t2 = Instant::now();
        let mut tries = 0;
        loop {
            match dev.read_at(lba * lbs as u64, &mut back) {
                Ok(()) => break,
                Err(err) if tries < 20 => {
                    tries += 1;
                    println!("INFO stall re-read attempt {tries}: {err}");
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(err) => return Err(format!("LUN unusable after the timeout: {err}")),
            }
        }
        let state = if back[..] == new[..] {
            "the CAW was applied after all (the write image is on the LUN)"
        } else if back[..] == cur[..] {
            "the CAW was not applied"
        } else {
            return Err("block holds neither the verify nor the write image".into());
        };
        Ok(format!(
            "SG_IO returned after {:.1}s: {e}; re-read after {:.1}s: {state}",
            waited.as_secs_f64(),
            t2.elapsed().as_secs_f64()
        ))
    })();
    rep.check("stall", "CAW timeout -> outcome unknown", r);
}
