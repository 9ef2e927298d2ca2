//! Pass 6: the control areas — heartbeat slots and lock records — against the superblock and
//! each other, with the rules the runtime applies (`cluster::membership`, `cluster::lock`):
//!
//! * a heartbeat slot is zero (never used) or a record of this volume and slot that decodes
//!   (timing within bounds included); anything else is damaged (error: a mount waits its dead
//!   time before recovering it). Live or Recovering records mean a node stopped without
//!   unmounting (warning: the next mount recovers it); only slots below `max_nodes` may be
//!   anything but zero or Free (error);
//! * the lock area has the records the layout needs; every record decodes as the record the
//!   layout puts there (error: mount resets it only when no other node is alive); its mode
//!   agrees with its owner and holders (error); every slot it names is below `max_nodes`
//!   (error); an owner, shared holder or open entry naming a slot that holds nothing at that
//!   generation is stale (error for owners and holders, which block others until a mount
//!   scrubs them; warning for open entries, waiters and handoff targets, which the runtime
//!   ignores); an open entry sits in the bucket its inode hashes to (error);
//! * format v3: every object-lock bucket and every mailbox decodes as the record of its
//!   position (error: the runtime cannot take, or post requests for, the locks stored there
//!   until it is rewritten); a bucket entry names an object and sits in the bucket that object
//!   hashes to (error); every slot a bucket names is below `max_nodes` (error); an owner or
//!   shared holder naming a slot that holds nothing at that generation is stale (error: it
//!   blocks others until it is scrubbed), a stale waiter or handoff target is a warning (the
//!   runtime passes over it); a mailbox request of a slot that holds nothing at that
//!   generation, or of a slot beyond `max_nodes`, is a warning.

use super::{finding, FindingKind, Report, Severity};
use crate::cluster::lock::{inconsistency, is_stale, stale_mentions, LockLayout, SlotLife};
use crate::cluster::membership::{self, SlotView};
use crate::cluster::object_lock::ObjectId;
use crate::dev::{for_each_record, read_aligned, BlockDevice};
use crate::error::Result;
use crate::format::heartbeat::SlotState;
use crate::format::lock_record::NO_SLOT;
use crate::format::mailbox::Mailbox;
use crate::format::object_lock::{Bucket, Role, NO_NEXT};
use crate::format::superblock::Superblock;
use crate::format::FS_BLOCK;

pub(super) fn check_control_areas(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    report: &mut Report,
) -> Result<()> {
    if dev.geometry().logical_block_size != sb.logical_block_size {
        return Ok(()); // reported in pass 1: the records would be misread
    }
    let lbs = sb.logical_block_size as usize;
    let views = check_heartbeats(dev, sb, lbs, report)?;
    let lives: Vec<SlotLife> = views.iter().map(|v| membership::life_of(v, sb)).collect();
    let life = |s: u32| {
        usize::try_from(s)
            .ok()
            .and_then(|s| lives.get(s).copied())
            .unwrap_or(SlotLife::Gone)
    };
    check_locks(dev, sb, lbs, &life, report)?;
    check_object_locks(dev, sb, lbs, &life, report)
}

/// The record at byte `offset` is to be rewritten empty by a repair if any finding since the
/// `before`-th is an error.
fn reset_if_error(report: &mut Report, before: usize, offset: u64) {
    if report
        .findings
        .get(before..)
        .is_some_and(|f| f.iter().any(|f| f.severity == Severity::Error))
    {
        report.plan.reset_records.insert(offset);
    }
}

fn push(report: &mut Report, kind: FindingKind, severity: Severity, message: String) {
    let mut f = finding(kind, None, None, message);
    f.severity = severity;
    report.findings.push(f);
}

fn check_heartbeats(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    lbs: usize,
    report: &mut Report,
) -> Result<Vec<SlotView>> {
    let len = usize::try_from(sb.hb_slots).unwrap_or(0) * lbs;
    let area = read_aligned(dev, sb.hb_start * FS_BLOCK, len)?;
    let mut views = Vec::new();
    for (slot, raw) in (0u32..).zip(area.chunks(lbs)) {
        let before = report.findings.len();
        let record = match membership::decode_slot(raw, sb, slot) {
            Ok(r) => r,
            Err(e) => {
                push(
                    report,
                    FindingKind::Heartbeat,
                    Severity::Error,
                    format!("heartbeat slot {slot} is damaged: {e}; a mount waits its dead time before recovering it"),
                );
                None
            }
        };
        if let Some(h) = &record {
            let state = match h.state {
                SlotState::Free => None,
                SlotState::Live => Some("Live"),
                SlotState::Recovering => Some("Recovering"),
            };
            match state {
                Some(state) if slot >= sb.max_nodes => push(
                    report,
                    FindingKind::Heartbeat,
                    Severity::Error,
                    format!(
                        "heartbeat slot {slot} is {state} but only slots below max nodes ({}) are ever claimed",
                        sb.max_nodes
                    ),
                ),
                Some(state) => push(
                    report,
                    FindingKind::Heartbeat,
                    Severity::Warning,
                    format!(
                        "heartbeat slot {slot} is {state}: node {:?} (pid {}, generation {}) stopped without unmounting; the next mount recovers it",
                        h.host, h.pid, h.generation
                    ),
                ),
                None => {}
            }
            // A free slot's timing is its last owner's; the next claim writes its own.
            if h.state != SlotState::Free
                && (h.interval_ms, h.io_timeout_ms) != (sb.heartbeat_interval_ms, sb.io_timeout_ms)
            {
                push(
                    report,
                    FindingKind::Heartbeat,
                    Severity::Warning,
                    format!(
                        "heartbeat slot {slot} publishes timing {} ms / {} ms, the volume's is {} ms / {} ms",
                        h.interval_ms, h.io_timeout_ms, sb.heartbeat_interval_ms, sb.io_timeout_ms
                    ),
                );
            }
        }
        reset_if_error(
            report,
            before,
            sb.hb_start * FS_BLOCK + u64::from(slot) * lbs as u64,
        );
        views.push(SlotView {
            slot,
            raw: raw.to_vec(),
            record,
        });
    }
    Ok(views)
}

fn check_locks(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    lbs: usize,
    life: &dyn Fn(u32) -> SlotLife,
    report: &mut Report,
) -> Result<()> {
    let layout = LockLayout::new(sb);
    if layout.lock_count < layout.needed {
        push(
            report,
            FindingKind::LockRecord,
            Severity::Error,
            format!(
                "the lock area has {} records, the volume needs {} (1 global, {} groups, {} buckets)",
                layout.lock_count, layout.needed, sb.group_count, sb.inode_lock_slots
            ),
        );
    }
    let len = usize::try_from(layout.lock_count).unwrap_or(0) * lbs;
    let area = read_aligned(dev, sb.lock_start * FS_BLOCK, len)?;
    for (index, raw) in (0u64..).zip(area.chunks(lbs)) {
        let before = report.findings.len();
        let offset = sb.lock_start * FS_BLOCK + index * lbs as u64;
        let rec = match layout.decode_at(raw, index) {
            Ok(r) => r,
            Err(e) => {
                report.plan.reset_records.insert(offset);
                push(
                    report,
                    FindingKind::LockRecord,
                    Severity::Error,
                    format!("{e}; a mount resets it only when no other node is alive"),
                );
                continue;
            }
        };
        let what = format!("lock record {index} ({:?} {})", rec.kind, rec.object);
        let mut error = |m: String| push(report, FindingKind::LockRecord, Severity::Error, m);
        if let Some(why) = inconsistency(&rec) {
            error(format!("{what}: {why}"));
        }
        let named = [rec.owner, rec.next]
            .into_iter()
            .filter(|&s| s != NO_SLOT)
            .chain(rec.holders.iter())
            .chain(rec.waiters.iter())
            .chain(rec.entries.iter().map(|e| e.slot));
        let mut beyond: Vec<u32> = named.filter(|&s| s >= sb.max_nodes).collect();
        beyond.sort_unstable();
        beyond.dedup();
        if !beyond.is_empty() {
            error(format!(
                "{what}: names slots {beyond:?}, beyond max nodes ({})",
                sb.max_nodes
            ));
        }
        for e in rec
            .entries
            .iter()
            .filter(|e| layout.bucket_of(e.ino) != index)
        {
            error(format!(
                "{what}: open entry for inode {} belongs in lock record {}",
                e.ino,
                layout.bucket_of(e.ino)
            ));
        }
        for m in stale_mentions(&rec, life) {
            if m.slot >= sb.max_nodes {
                continue; // reported above
            }
            let severity = match m.role {
                "owner" | "holder" => Severity::Error,
                _ => Severity::Warning,
            };
            push(
                report,
                FindingKind::LockRecord,
                severity,
                format!("{what}: stale {m}: that slot holds nothing at that generation; the next mount removes it"),
            );
        }
        reset_if_error(report, before, offset);
    }
    Ok(())
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Owner => "owner",
        Role::Holder => "holder",
        Role::WaitShared => "waiter (shared)",
        Role::WaitExclusive => "waiter (exclusive)",
    }
}

/// Format v3: the object-lock buckets and the mailboxes (rules in the module doc).
fn check_object_locks(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    lbs: usize,
    life: &dyn Fn(u32) -> SlotLife,
    report: &mut Report,
) -> Result<()> {
    let Some(area) = sb.object_lock_area() else {
        return Ok(());
    };
    for_each_record(
        dev,
        area.bucket_offset,
        area.buckets,
        lbs,
        &mut |index, raw| {
            let before = report.findings.len();
            check_bucket(sb, &area, life, index, raw, report);
            reset_if_error(report, before, area.bucket_offset + index * lbs as u64);
        },
    )?;
    for_each_record(
        dev,
        area.mailbox_offset,
        u64::from(area.mailboxes),
        lbs,
        &mut |index, raw| {
            let before = report.findings.len();
            check_mailbox(sb, life, index, raw, report);
            reset_if_error(report, before, area.mailbox_offset + index * lbs as u64);
        },
    )
}

/// One object-lock bucket (format v3).
fn check_bucket(
    sb: &Superblock,
    area: &crate::cluster::object_lock::ObjectLockArea,
    life: &dyn Fn(u32) -> SlotLife,
    index: u64,
    raw: &[u8],
    report: &mut Report,
) {
    let kind = FindingKind::ObjectLock;
    {
        {
            let bucket = match Bucket::decode(raw, index) {
            Ok(b) => b,
            Err(e) => {
                return push(
                    report,
                    kind,
                    Severity::Error,
                    format!("object-lock bucket {index} is damaged: {e}; the locks of the objects that hash to it cannot be taken until it is rewritten"),
                )
            }
        };
            for e in &bucket.entries {
                let what = format!("object-lock bucket {index}, object {:#x}", e.object);
                match ObjectId::from_raw(e.object) {
                    Err(err) => push(report, kind, Severity::Error, format!("{what}: {err}")),
                    Ok(obj) if area.bucket_of(obj) != index => push(
                        report,
                        kind,
                        Severity::Error,
                        format!(
                        "{what} ({obj:?}): belongs in bucket {}, where the runtime looks for it",
                        area.bucket_of(obj)
                    ),
                    ),
                    Ok(_) => {}
                }
                let mut beyond: Vec<u32> = e
                    .mentions
                    .iter()
                    .map(|m| m.slot)
                    .chain((e.next != NO_NEXT).then_some(u32::from(e.next)))
                    .filter(|&s| s >= sb.max_nodes)
                    .collect();
                beyond.sort_unstable();
                beyond.dedup();
                if !beyond.is_empty() {
                    push(
                        report,
                        kind,
                        Severity::Error,
                        format!(
                            "{what}: names slots {beyond:?}, beyond max nodes ({})",
                            sb.max_nodes
                        ),
                    );
                }
                for m in &e.mentions {
                    if m.slot >= sb.max_nodes || !is_stale(life(m.slot), Some(m.gen)) {
                        continue;
                    }
                    let severity = if m.role.holds() {
                        Severity::Error
                    } else {
                        Severity::Warning
                    };
                    push(
                    report,
                    kind,
                    severity,
                    format!(
                        "{what}: stale {} slot {} (generation {}): that slot holds nothing at that generation",
                        role_name(m.role),
                        m.slot,
                        m.gen
                    ),
                );
                }
                let next = u32::from(e.next);
                if e.next != NO_NEXT && next < sb.max_nodes && is_stale(life(next), None) {
                    push(
                        report,
                        kind,
                        Severity::Warning,
                        format!("{what}: stale next slot {next}: that slot holds nothing"),
                    );
                }
            }
        }
    }
}

/// The lock-request mailbox of one slot (format v3).
fn check_mailbox(
    sb: &Superblock,
    life: &dyn Fn(u32) -> SlotLife,
    index: u64,
    raw: &[u8],
    report: &mut Report,
) {
    let kind = FindingKind::Mailbox;
    {
        {
            let Ok(slot) = u32::try_from(index) else {
                return;
            };
            let mailbox = match Mailbox::decode(raw, slot) {
                Ok(m) => m,
                Err(e) => {
                    return push(
                        report,
                        kind,
                        Severity::Error,
                        format!("the mailbox of slot {slot} is damaged: {e}; no lock of that slot can be requested until it is rewritten"),
                    )
                }
            };
            for r in &mailbox.requests {
                let what = format!(
                    "the mailbox of slot {slot}: request of slot {} (generation {}) for object {:#x}",
                    r.slot, r.gen, r.object
                );
                if let Err(err) = ObjectId::from_raw(r.object) {
                    push(report, kind, Severity::Error, format!("{what}: {err}"));
                }
                if r.slot >= sb.max_nodes {
                    push(
                        report,
                        kind,
                        Severity::Warning,
                        format!("{what}: slot beyond max nodes ({})", sb.max_nodes),
                    );
                } else if is_stale(life(r.slot), Some(r.gen)) {
                    push(
                        report,
                        kind,
                        Severity::Warning,
                        format!("{what}: stale: that slot holds nothing at that generation"),
                    );
                }
            }
        }
    }
}
