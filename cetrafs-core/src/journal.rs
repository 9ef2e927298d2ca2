//! The per-node redo journal: write a compound transaction, find and replay one.
//!
//! Ordering (see docs/recovery.md): at a commit point the device is flushed first (so every
//! data block the transaction maps is durable before the mapping is), then the transaction is
//! written here and flushed, then the blocks are written home. The next commit point's first
//! flush makes those home writes durable, which is what allows the next transaction to
//! overwrite this one. Replay applies a logged block only if the home copy does not decode or
//! has an older sequence number than the logged copy (the GFS2 replay hazard: a node must never
//! roll a block back to an older image another node has since superseded).

use crate::dev::{AlignedBuf, BlockDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::format::block::BlockHeader;
use crate::format::journal::{Commit, Descriptor, ENTRIES_PER_DESCRIPTOR};
use crate::format::superblock::Superblock;
use crate::format::{FS_BLOCK, FS_BLOCK_SIZE};

/// Where one slot's journal lives.
#[derive(Debug, Clone, Copy)]
pub struct JournalArea {
    pub start: u64,
    pub blocks: u64,
}

impl JournalArea {
    pub fn for_slot(sb: &Superblock, slot: u32) -> Self {
        Self {
            start: sb.journal_of(slot),
            blocks: sb.journal_blocks,
        }
    }

    /// The most blocks one transaction can log.
    pub fn capacity(&self) -> usize {
        // header block, commit block, one descriptor per 504 entries
        let usable = self.blocks.saturating_sub(2);
        let per = ENTRIES_PER_DESCRIPTOR as u64;
        usize::try_from(usable * per / (per + 1)).unwrap_or(usize::MAX)
    }
}

/// A transaction found in a journal.
#[derive(Debug)]
pub struct FoundTx {
    pub seq: u64,
    pub blocks: Vec<(u64, Vec<u8>)>,
}

fn tx_crc(descs: &[Vec<u8>], images: &[&[u8]]) -> u32 {
    let mut c = 0;
    for d in descs {
        c = crc32c::crc32c_append(c, d);
    }
    for i in images {
        c = crc32c::crc32c_append(c, i);
    }
    c
}

/// Write one compound transaction (caller flushes before and after).
pub fn write_tx(
    dev: &dyn BlockDevice,
    area: JournalArea,
    seq: u64,
    blocks: &[(u64, &[u8])],
) -> Result<()> {
    if blocks.len() > area.capacity() {
        return Err(Error::new(
            ErrorKind::NoSpace,
            format!(
                "transaction of {} blocks exceeds the journal ({} blocks)",
                blocks.len(),
                area.capacity()
            ),
        ));
    }
    let n = blocks.len();
    let d = n.div_ceil(ENTRIES_PER_DESCRIPTOR).max(1);
    let first = area.start + 1;
    let total = d + n + 1;
    let mut buf = AlignedBuf::new(total * FS_BLOCK_SIZE);
    let mut descs = Vec::with_capacity(d);
    for (i, chunk) in blocks
        .chunks(ENTRIES_PER_DESCRIPTOR)
        .chain(std::iter::repeat_n(&[][..], usize::from(n == 0)))
        .enumerate()
    {
        let desc = Descriptor {
            seq,
            index: u32::try_from(i).unwrap_or(u32::MAX),
            count: u32::try_from(d).unwrap_or(u32::MAX),
            logged: u32::try_from(n).unwrap_or(u32::MAX),
            homes: chunk.iter().map(|(h, _)| *h).collect(),
        };
        descs.push(desc.encode(first + i as u64));
    }
    for (i, dsc) in descs.iter().enumerate() {
        buf[i * FS_BLOCK_SIZE..(i + 1) * FS_BLOCK_SIZE].copy_from_slice(dsc);
    }
    for (i, (_, img)) in blocks.iter().enumerate() {
        let o = (d + i) * FS_BLOCK_SIZE;
        buf[o..o + FS_BLOCK_SIZE].copy_from_slice(img);
    }
    let images: Vec<&[u8]> = blocks.iter().map(|(_, i)| *i).collect();
    let commit = Commit {
        seq,
        descriptors: u32::try_from(d).unwrap_or(u32::MAX),
        logged: u32::try_from(n).unwrap_or(u32::MAX),
        crc: tx_crc(&descs, &images),
    };
    let o = (d + n) * FS_BLOCK_SIZE;
    buf[o..o + FS_BLOCK_SIZE].copy_from_slice(&commit.encode(first + (d + n) as u64));
    dev.write_at(first * FS_BLOCK, &buf)
}

/// Find the transaction in a journal, if a complete one is there.
pub fn find_tx(dev: &dyn BlockDevice, area: JournalArea) -> Result<Option<FoundTx>> {
    let first = area.start + 1;
    let read = |b: u64| -> Result<Vec<u8>> {
        let mut buf = AlignedBuf::new(FS_BLOCK_SIZE);
        dev.read_at(b * FS_BLOCK, &mut buf)?;
        Ok(buf.to_vec())
    };
    let d0raw = read(first)?;
    let Ok(d0) = Descriptor::decode(&d0raw, first) else {
        return Ok(None);
    };
    let (d, n) = (d0.count as usize, d0.logged as usize);
    if d == 0 || d != n.div_ceil(ENTRIES_PER_DESCRIPTOR).max(1) || (d + n + 2) as u64 > area.blocks
    {
        return Ok(None);
    }
    let mut descs = vec![d0raw];
    let mut homes = d0.homes;
    for i in 1..d {
        let raw = read(first + i as u64)?;
        let Ok(di) = Descriptor::decode(&raw, first + i as u64) else {
            return Ok(None);
        };
        if di.seq != d0.seq || di.index as usize != i {
            return Ok(None);
        }
        homes.extend(di.homes);
        descs.push(raw);
    }
    if homes.len() != n {
        return Ok(None);
    }
    let mut images = Vec::with_capacity(n);
    for i in 0..n {
        images.push(read(first + (d + i) as u64)?);
    }
    let craw = read(first + (d + n) as u64)?;
    let Ok(c) = Commit::decode(&craw, first + (d + n) as u64) else {
        return Ok(None);
    };
    let refs: Vec<&[u8]> = images.iter().map(Vec::as_slice).collect();
    if c.seq != d0.seq
        || c.descriptors as usize != d
        || c.logged as usize != n
        || c.crc != tx_crc(&descs, &refs)
    {
        return Ok(None);
    }
    Ok(Some(FoundTx {
        seq: d0.seq,
        blocks: homes.into_iter().zip(images).collect(),
    }))
}

/// The rule for what a transaction may write home, checked before replay writes anything
/// (fsck reports what it refuses): every home must be a metadata block
/// (`Superblock::check_journal_home`), and every logged image must name that home as its own
/// address. Commit points log only encoded metadata blocks, each self-addressed, so an image
/// naming another block was never written by one (a forged or damaged transaction): replaying
/// it would overwrite its home with another block's contents.
pub fn check_homes(sb: &Superblock, tx: &FoundTx) -> Result<()> {
    tx.blocks.iter().try_for_each(|(home, img)| {
        sb.check_journal_home(*home, tx.seq)?;
        match BlockHeader::decode(img).map(|h| h.blockno) {
            Ok(named) if named == *home => Ok(()),
            named => Err(crate::Error::corrupted(format!(
                "journal transaction {} logs an image for block {home} that {}; refusing to replay it (run fsck.cetra)",
                tx.seq,
                named.map_or("is not a metadata block".to_string(), |b| format!("is block {b}'s"))
            ))),
        }
    })
}

/// Should the logged image replace the home image? Only if it is newer (or home is garbage).
pub fn replay_wins(home: &[u8], logged: &[u8]) -> bool {
    let Ok(l) = BlockHeader::decode(logged) else {
        return false;
    };
    match BlockHeader::decode(home) {
        Ok(h) => h.seq < l.seq || (h.seq == l.seq && home != logged),
        Err(_) => true,
    }
}

/// Replay a slot's journal onto the device (idempotent), then invalidate it.
/// Returns the number of blocks written home. A transaction naming any home that is not a
/// metadata block (`Superblock::check_journal_home`) is refused whole, before any write.
pub fn replay(dev: &dyn BlockDevice, sb: &Superblock, area: JournalArea) -> Result<usize> {
    let Some(tx) = find_tx(dev, area)? else {
        return Ok(0);
    };
    check_homes(sb, &tx)?;
    let mut applied = 0;
    let mut home = AlignedBuf::new(FS_BLOCK_SIZE);
    for (b, img) in &tx.blocks {
        dev.read_at(b * FS_BLOCK, &mut home)?;
        if replay_wins(&home, img) {
            home.copy_from_slice(img);
            dev.write_at(b * FS_BLOCK, &home)?;
            applied += 1;
        }
    }
    dev.flush()?;
    invalidate(dev, area)?;
    tracing::info!(
        "journal replay: transaction {} with {} blocks, {applied} written home",
        tx.seq,
        tx.blocks.len()
    );
    Ok(applied)
}

/// Mark the journal empty (after everything in it is durable at home).
pub fn invalidate(dev: &dyn BlockDevice, area: JournalArea) -> Result<()> {
    dev.write_at((area.start + 1) * FS_BLOCK, &AlignedBuf::new(FS_BLOCK_SIZE))?;
    dev.flush()
}

/// Journals that hold a committed transaction (slot, transaction).
pub fn pending(dev: &dyn BlockDevice, sb: &Superblock) -> Result<Vec<(u32, FoundTx)>> {
    let mut out = Vec::new();
    for slot in 0..sb.max_nodes {
        if let Some(tx) = find_tx(dev, JournalArea::for_slot(sb, slot))? {
            out.push((slot, tx));
        }
    }
    Ok(out)
}

/// A read-only view of a device with every pending journal replayed in memory, for
/// `fsck.cetra -n` on a volume that crashed: it checks what a mount would see.
#[derive(Debug)]
pub struct ReplayedView<'a> {
    dev: &'a dyn BlockDevice,
    overlay: std::collections::HashMap<u64, Vec<u8>>,
}

impl<'a> ReplayedView<'a> {
    pub fn new(dev: &'a dyn BlockDevice, txs: &[(u32, FoundTx)]) -> Result<Self> {
        let mut overlay: std::collections::HashMap<u64, Vec<u8>> = std::collections::HashMap::new();
        let mut home = AlignedBuf::new(FS_BLOCK_SIZE);
        for (_, tx) in txs {
            for (b, img) in &tx.blocks {
                let cur = if let Some(v) = overlay.get(b) {
                    v.clone()
                } else {
                    dev.read_at(b * FS_BLOCK, &mut home)?;
                    home.to_vec()
                };
                if replay_wins(&cur, img) {
                    overlay.insert(*b, img.clone());
                }
            }
        }
        Ok(Self { dev, overlay })
    }
}

impl BlockDevice for ReplayedView<'_> {
    fn geometry(&self) -> &crate::dev::Geometry {
        self.dev.geometry()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.dev.read_at(offset, buf)?;
        let end = offset + buf.len() as u64;
        for b in offset / FS_BLOCK..end.div_ceil(FS_BLOCK) {
            if let Some(img) = self.overlay.get(&b) {
                let bs = b * FS_BLOCK;
                let (from, to) = (bs.max(offset), (bs + FS_BLOCK).min(end));
                let src = &img[usize::try_from(from - bs).unwrap_or(0)
                    ..usize::try_from(to - bs).unwrap_or(0)];
                buf[usize::try_from(from - offset).unwrap_or(0)
                    ..usize::try_from(to - offset).unwrap_or(0)]
                    .copy_from_slice(src);
            }
        }
        Ok(())
    }
    fn write_at(&self, _offset: u64, _buf: &[u8]) -> Result<()> {
        Err(Error::new(
            ErrorKind::ReadOnly,
            "replayed view is read-only",
        ))
    }
    fn compare_and_write(&self, _lba: u64, _e: &[u8], _n: &[u8]) -> Result<crate::dev::CawOutcome> {
        Err(Error::new(
            ErrorKind::ReadOnly,
            "replayed view is read-only",
        ))
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn discard(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }
    fn refresh_size(&self) -> Result<u64> {
        self.dev.refresh_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::mem::MemDevice;
    use crate::format::block::BlockType;

    fn meta_block(at: u64) -> Vec<u8> {
        let mut b = vec![0u8; FS_BLOCK_SIZE];
        BlockHeader {
            btype: BlockType::Xattr,
            blockno: at,
            seq: 3,
            owner: 9,
        }
        .seal(&mut b);
        b
    }

    #[test]
    fn a_transaction_logging_an_image_for_another_home_is_refused_before_any_write() {
        let dev = MemDevice::new(256 << 20, 512);
        let opts = crate::mkfs::MkfsOptions {
            max_nodes: 2,
            journal_bytes: 1 << 20,
            ..Default::default()
        };
        let sb = crate::mkfs::plan(256 << 20, 512, &opts).unwrap();
        let area = JournalArea::for_slot(&sb, 0);
        let home = sb.root_ino;
        let good = meta_block(home);
        write_tx(&dev, area, 5, &[(home, &good)]).unwrap();
        assert!(find_tx(&dev, area).unwrap().is_some());
        // The same image logged for block 0: a replay would overwrite the superblock.
        write_tx(&dev, area, 6, &[(home, &good), (0, &good)]).unwrap();
        let e = replay(&dev, &sb, area).unwrap_err();
        assert!(e.to_string().contains("logs block 0"), "{e}");
        // Logged for another metadata home: the image names the wrong block.
        let other = home + 1;
        write_tx(&dev, area, 7, &[(other, &good)]).unwrap();
        let e = replay(&dev, &sb, area).unwrap_err();
        assert!(e.to_string().contains(&format!("is block {home}'s")), "{e}");
        let mut b0 = AlignedBuf::new(FS_BLOCK_SIZE);
        dev.read_at(0, &mut b0).unwrap();
        assert!(b0.iter().all(|&x| x == 0), "block 0 untouched");
    }
}
