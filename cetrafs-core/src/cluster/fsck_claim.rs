//! The claim of an offline tool on a volume: while `fsck.cetra` changes a volume (any mode but
//! `-n`) or `cetra tune` rewrites its superblock, no node may mount it, and neither may start
//! while a node has it mounted.
//!
//! **The claim is a node slot.** The tool claims a heartbeat slot exactly as a mount does
//! (COMPARE AND WRITE of the slot record, then a renewer that keeps it alive), with the host
//! name `TOOL:HOST` ([`PREFIX`] for fsck, [`TUNE_PREFIX`] for `cetra tune`): a name no mount can
//! take (`host=` allows letters, digits, `-`, `_` and `.` only, never `:`), so the record
//! itself says "this tool is running here, on HOST", with its nonce, generation and pid like
//! any claim. Nothing in the format changes.
//!
//! **The handshake.** Both sides claim their slot first and look at the others after:
//! * fsck, once its slot is claimed, refuses (and gives the slot back) if any other slot is
//!   live apart from those it found dead before claiming (a node that stopped without
//!   unmounting);
//! * a mount, once its slot is claimed, refuses (and gives its slot back) if a live fsck slot
//!   is there, naming fsck's host ([`running`]), unless it found that slot dead before
//!   claiming (an fsck that was killed: its slot is recovered like a dead node's, which
//!   holds no lock and has an empty journal).
//!
//! Each claim is one write to the one LUN followed by a read of the whole heartbeat area, so
//! of two that race, the later claimer sees the earlier: at most one of fsck and the mounts
//! goes on. While fsck holds its slot, its writes go through [`LeaseGuard`]: should it stall
//! beyond its lease (and others call it dead) it writes nothing more.

use super::machine::MachineId;
use super::membership::{self, LeaseGuard, Membership, SlotView};
use crate::dev::SharedDevice;
use crate::error::{ErrorKind, Result};
use crate::format::heartbeat::SlotState;
use crate::format::superblock::Superblock;
use std::sync::Arc;

/// The host-name prefix of a slot claimed by fsck.
pub const PREFIX: &str = "fsck.cetra:";
/// The host-name prefix of a slot claimed by `cetra tune`.
pub const TUNE_PREFIX: &str = "cetra-tune:";

/// A held fsck claim. Give it back with [`FsckClaim::release`].
#[derive(Debug)]
pub struct FsckClaim {
    member: Arc<Membership>,
}

/// The live slots of `views`, other than `mine` and those still as they were when found
/// `dead` (same slot, same generation: a node that claimed a dead slot since has a new
/// generation, and is live).
fn others_live<'a>(
    views: &'a [SlotView],
    mine: u32,
    dead: &'a [SlotView],
) -> impl Iterator<Item = &'a SlotView> {
    let generation = |v: &SlotView| v.record.as_ref().map(|h| h.generation);
    views.iter().filter(move |v| {
        v.slot != mine
            && !dead
                .iter()
                .any(|d| d.slot == v.slot && generation(d) == generation(v))
            && v.record
                .as_ref()
                .is_some_and(|h| h.state == SlotState::Live)
    })
}

impl FsckClaim {
    /// Claim a slot for fsck on `host`; `dead` are the slots the caller found dead (watched
    /// for their dead time) before. Refuses (Busy) if another node is live after the claim.
    pub fn take(
        dev: &SharedDevice,
        sb: &Superblock,
        host: &str,
        dead: &[SlotView],
    ) -> Result<Self> {
        Self::take_for(PREFIX, dev, sb, host, dead)
    }

    /// [`FsckClaim::take`] for the tool whose host-name prefix is `prefix`.
    pub fn take_for(
        prefix: &str,
        dev: &SharedDevice,
        sb: &Superblock,
        host: &str,
        dead: &[SlotView],
    ) -> Result<Self> {
        let mut name = format!("{prefix}{host}");
        name.truncate(crate::format::heartbeat::HOST_LEN);
        let member = Membership::claim(dev.clone(), sb, &name, MachineId::local()?, None)?;
        let views = match membership::scan(&**dev, sb) {
            Ok(v) => v,
            Err(e) => {
                let _ = member.release();
                return Err(e);
            }
        };
        let who: Vec<String> = others_live(&views, member.slot, dead)
            .map(membership::describe)
            .collect();
        if !who.is_empty() {
            let _ = member.release();
            bail!(
                Busy,
                "the volume was mounted meanwhile by {}; unmount it on every node before repairing",
                who.join(", ")
            );
        }
        Ok(Self { member })
    }

    /// The slot fsck holds.
    pub fn slot(&self) -> u32 {
        self.member.slot
    }

    /// The membership of fsck's slot: what fsck mounts the volume in for the repairs made
    /// through the filesystem (`MountOptions::claimed`).
    pub fn member(&self) -> Arc<Membership> {
        self.member.clone()
    }

    /// `dev` with every I/O refused once fsck's lease has run out.
    pub fn guard(&self, dev: SharedDevice) -> SharedDevice {
        Arc::new(LeaseGuard::new(dev, self.member.clone()))
    }

    /// Give the slot back (the volume may be mounted again).
    pub fn release(self) -> Result<()> {
        self.member.release()
    }
}

/// A live offline tool found by a mount: its slot, its name and its host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Running {
    pub slot: u32,
    pub tool: String,
    pub host: String,
}

/// A mount's side: after claiming `mine`, a live offline tool on the volume (a slot whose host
/// name is `TOOL:HOST`), if there is one that the mount did not find `dead` before claiming.
pub fn running(views: &[SlotView], mine: u32, dead: &[SlotView]) -> Option<Running> {
    others_live(views, mine, dead).find_map(|v| {
        let h = v.record.as_ref()?;
        let (tool, host) = h.host.split_once(':')?;
        Some(Running {
            slot: v.slot,
            tool: tool.replace('-', " "),
            host: host.to_string(),
        })
    })
}

/// The error a mount gives when an offline tool is running.
pub fn refusal(r: &Running) -> crate::error::Error {
    crate::error::Error::new(
        ErrorKind::Busy,
        format!(
            "{} is running on {} (node slot {}); mount again once it has finished",
            r.tool, r.host, r.slot
        ),
    )
}
