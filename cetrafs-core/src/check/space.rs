//! Block ownership bookkeeping for the checker: which blocks the bitmaps say are in use, and
//! which structure claims each block. Claims are kept as disjoint ranges so memory grows with
//! the number of extents and metadata blocks, not with the volume size.

use std::collections::BTreeMap;
use std::fmt;

/// Who holds a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// A group's header or bitmap blocks.
    Group(u64),
    /// An inode: its own block, xattr block, tree nodes and data.
    Inode(u64),
    /// The journal of a node slot added after mkfs (format v6), inside a group.
    Journal(u32),
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Group(g) => write!(f, "the header/bitmap of group {g}"),
            Self::Inode(i) => write!(f, "inode {i}"),
            Self::Journal(s) => write!(f, "the journal of node slot {s}"),
        }
    }
}

/// Disjoint claimed ranges `[start, end)`, keyed by start.
#[derive(Debug, Default)]
pub struct Claims {
    map: BTreeMap<u64, (u64, Owner)>,
}

impl Claims {
    /// Claim `[start, end)` for `owner`. Returns the parts somebody already held (with that
    /// holder); only the unclaimed parts are recorded for `owner`.
    pub fn claim(&mut self, start: u64, end: u64, owner: Owner) -> Vec<(u64, u64, Owner)> {
        if start >= end {
            return Vec::new();
        }
        // Ranges are disjoint and sorted by start, hence also by end: walking back from the
        // last range starting before `end`, the first one ending at or before `start` ends
        // the overlaps.
        let mut overlaps: Vec<(u64, u64, Owner)> = self
            .map
            .range(..end)
            .rev()
            .take_while(|(_, (e, _))| *e > start)
            .map(|(&s, &(e, o))| (s.max(start), e.min(end), o))
            .collect();
        overlaps.reverse();
        let mut cursor = start;
        for &(s, e, _) in &overlaps {
            if s > cursor {
                self.map.insert(cursor, (s, owner));
            }
            cursor = cursor.max(e);
        }
        if cursor < end {
            self.map.insert(cursor, (end, owner));
        }
        overlaps
    }

    /// Claimed ranges in block order.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64, Owner)> + '_ {
        self.map.iter().map(|(&s, &(e, o))| (s, e, o))
    }
}

/// One bit per block of the group area: set = the bitmap says "in use".
#[derive(Debug)]
pub struct BlockBits {
    words: Vec<u64>,
    len: u64,
}

impl BlockBits {
    pub fn new(len: u64) -> Self {
        Self {
            words: vec![0; usize::try_from(len.div_ceil(64)).unwrap_or(usize::MAX)],
            len,
        }
    }

    fn idx(bit: u64) -> usize {
        usize::try_from(bit / 64).unwrap_or(usize::MAX)
    }

    pub fn get(&self, bit: u64) -> bool {
        bit < self.len && self.words[Self::idx(bit)] & (1 << (bit % 64)) != 0
    }

    pub fn set(&mut self, bit: u64) {
        if bit < self.len {
            self.words[Self::idx(bit)] |= 1 << (bit % 64);
        }
    }

    /// Maximal runs of bits equal to `value` inside `[from, to)`, as `[start, end)`.
    pub fn runs(&self, from: u64, to: u64, value: bool) -> Vec<(u64, u64)> {
        let to = to.min(self.len);
        let mut out = Vec::new();
        let mut b = from;
        while b < to {
            // Skip whole words that cannot start a run.
            if b.is_multiple_of(64) && b + 64 <= to {
                let w = self.words[Self::idx(b)];
                if (value && w == 0) || (!value && w == u64::MAX) {
                    b += 64;
                    continue;
                }
            }
            if self.get(b) != value {
                b += 1;
                continue;
            }
            let start = b;
            while b < to && self.get(b) == value {
                b += 1;
            }
            out.push((start, b));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_report_overlaps_and_keep_first_owner() {
        let mut c = Claims::default();
        assert!(c.claim(10, 20, Owner::Inode(1)).is_empty());
        assert!(c.claim(30, 40, Owner::Inode(2)).is_empty());
        let o = c.claim(15, 35, Owner::Inode(3));
        assert_eq!(
            o,
            vec![(15, 20, Owner::Inode(1)), (30, 35, Owner::Inode(2))]
        );
        let r: Vec<_> = c.ranges().collect();
        assert_eq!(
            r,
            vec![
                (10, 20, Owner::Inode(1)),
                (20, 30, Owner::Inode(3)),
                (30, 40, Owner::Inode(2))
            ]
        );
        assert_eq!(c.claim(0, 100, Owner::Group(0)).len(), 3);
        assert!(c.claim(5, 5, Owner::Group(0)).is_empty());
    }

    #[test]
    fn runs_find_both_values() {
        let mut b = BlockBits::new(300);
        for i in (3..7).chain(64..200) {
            b.set(i);
        }
        assert_eq!(b.runs(0, 300, true), vec![(3, 7), (64, 200)]);
        assert_eq!(b.runs(0, 300, false), vec![(0, 3), (7, 64), (200, 300)]);
        assert_eq!(b.runs(5, 70, true), vec![(5, 7), (64, 70)]);
    }
}
