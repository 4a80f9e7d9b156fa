//! The in-memory tier, for tests: no disk quirks, and a way to corrupt a
//! stored group on purpose to prove checksums are checked.

use super::{ReadOp, Tier, TierError, WriteOp, check_op};
use crate::geometry::{GroupIndex, GroupLayout};
use parking_lot::Mutex;
use std::collections::HashMap;

/// A tier in RAM, for tests: groups never written read as zeros, like a
/// sparse file. Memory grows with the groups written, not the layout.
pub struct MemTier {
    layout: GroupLayout,
    groups: Mutex<HashMap<GroupIndex, Box<[u8]>>>,
}

impl MemTier {
    pub fn new(layout: GroupLayout) -> MemTier {
        MemTier {
            layout,
            groups: Mutex::new(HashMap::new()),
        }
    }

    /// Flips bits of a stored group (tests of checksum verification).
    pub fn corrupt(&self, index: GroupIndex, byte: usize) {
        let mut g = self.groups.lock();
        let stride = self.layout.stride() as usize;
        let e = g
            .entry(index)
            .or_insert_with(|| vec![0u8; stride].into_boxed_slice());
        e[byte] ^= 0xff;
    }
}

impl Tier for MemTier {
    fn name(&self) -> &'static str {
        "mem"
    }

    fn layout(&self) -> &GroupLayout {
        &self.layout
    }

    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Vec<Result<(), TierError>> {
        let g = self.groups.lock();
        ops.iter_mut()
            .map(|op| {
                check_op(&self.layout, op.index, op.buf)?;
                match g.get(&op.index) {
                    Some(b) => op.buf.copy_from_slice(b),
                    None => op.buf.fill(0),
                }
                Ok(())
            })
            .collect()
    }

    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Vec<Result<(), TierError>> {
        let mut g = self.groups.lock();
        ops.iter()
            .map(|op| {
                check_op(&self.layout, op.index, op.buf)?;
                g.insert(op.index, op.buf.into());
                Ok(())
            })
            .collect()
    }

    fn sync(&self) -> Result<(), TierError> {
        Ok(())
    }
}
