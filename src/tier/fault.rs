//! A fault-injecting wrapper over any tier, for tests: EIO or ENOSPC on
//! chosen operations (reads, writes, syncs), armed and cleared at will,
//! so the cascade's error paths run without a failing disk. The wrapped
//! tier's bytes are never changed; a fault fails the operation whole.

use super::{Op, ReadOp, Tier, TierError, WriteOp};
use crate::geometry::{GroupIndex, GroupLayout};
use parking_lot::Mutex;
use std::io;
use std::sync::Arc;

/// An error to inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// EIO: the device failed.
    Eio,
    /// ENOSPC: the backing is full.
    Enospc,
}

impl Fault {
    fn errno(self) -> i32 {
        match self {
            Fault::Eio => libc::EIO,
            Fault::Enospc => libc::ENOSPC,
        }
    }
}

#[derive(Default)]
struct Plan {
    reads: Option<Fault>,
    writes: Option<Fault>,
    syncs: Option<Fault>,
    /// When set, only operations on this group fail.
    only: Option<GroupIndex>,
    injected: u64,
}

/// Shared handle that switches a `FaultTier`'s faults on and off while the
/// tier is owned elsewhere (inside a cascade).
#[derive(Clone, Default)]
pub struct FaultSwitch(Arc<Mutex<Plan>>);

impl FaultSwitch {
    pub fn fail_reads(&self, f: Option<Fault>) {
        self.0.lock().reads = f;
    }
    pub fn fail_writes(&self, f: Option<Fault>) {
        self.0.lock().writes = f;
    }
    pub fn fail_syncs(&self, f: Option<Fault>) {
        self.0.lock().syncs = f;
    }
    /// Restricts read/write faults to one group (None: every group).
    pub fn only(&self, g: Option<GroupIndex>) {
        self.0.lock().only = g;
    }
    /// Clears every fault.
    pub fn heal(&self) {
        let mut p = self.0.lock();
        p.reads = None;
        p.writes = None;
        p.syncs = None;
        p.only = None;
    }
    /// How many operations have been failed so far.
    pub fn injected(&self) -> u64 {
        self.0.lock().injected
    }

    fn check(&self, op: Op, index: GroupIndex, layout: &GroupLayout) -> Result<(), TierError> {
        let mut p = self.0.lock();
        let f = match op {
            Op::Read => p.reads,
            Op::Write => p.writes,
        };
        match f {
            Some(f) if p.only.is_none_or(|g| g == index) => {
                p.injected += 1;
                Err(TierError::Io {
                    op,
                    index,
                    offset: layout.offset(index),
                    source: io::Error::from_raw_os_error(f.errno()),
                })
            }
            _ => Ok(()),
        }
    }
}

/// Wraps a tier and fails chosen operations with EIO or ENOSPC.
pub struct FaultTier<T: Tier> {
    inner: T,
    switch: FaultSwitch,
}

impl<T: Tier> FaultTier<T> {
    pub fn new(inner: T) -> (FaultTier<T>, FaultSwitch) {
        let switch = FaultSwitch::default();
        (
            FaultTier {
                inner,
                switch: switch.clone(),
            },
            switch,
        )
    }

    pub fn inner(&self) -> &T {
        &self.inner
    }
}

impl<T: Tier> Tier for FaultTier<T> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn layout(&self) -> &GroupLayout {
        self.inner.layout()
    }

    fn quiesce(&self) {
        self.inner.quiesce()
    }

    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Vec<Result<(), TierError>> {
        let layout = *self.inner.layout();
        let verdicts: Vec<_> = ops
            .iter()
            .map(|op| self.switch.check(Op::Read, op.index, &layout))
            .collect();
        // Pass through only the ops that are not failed.
        let mut pass: Vec<ReadOp> = Vec::new();
        let mut slots = Vec::new();
        for (i, (op, v)) in ops.iter_mut().zip(&verdicts).enumerate() {
            if v.is_ok() {
                pass.push(ReadOp {
                    index: op.index,
                    buf: &mut *op.buf,
                });
                slots.push(i);
            }
        }
        let mut inner = self.inner.read_batch(&mut pass).into_iter();
        let mut out: Vec<Result<(), TierError>> = verdicts;
        for i in slots {
            out[i] = inner.next().expect("one result per op");
        }
        out
    }

    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Vec<Result<(), TierError>> {
        let layout = *self.inner.layout();
        let mut out: Vec<Result<(), TierError>> = ops
            .iter()
            .map(|op| self.switch.check(Op::Write, op.index, &layout))
            .collect();
        let pass: Vec<(usize, WriteOp)> = ops
            .iter()
            .enumerate()
            .filter(|(i, _)| out[*i].is_ok())
            .map(|(i, op)| {
                (
                    i,
                    WriteOp {
                        index: op.index,
                        buf: op.buf,
                        generation: op.generation,
                    },
                )
            })
            .collect();
        let (idx, wops): (Vec<usize>, Vec<WriteOp>) = pass.into_iter().unzip();
        for (i, r) in idx.into_iter().zip(self.inner.write_batch(&wops)) {
            out[i] = r;
        }
        out
    }

    fn sync(&self) -> Result<(), TierError> {
        let f = {
            let mut p = self.switch.0.lock();
            let f = p.syncs;
            if f.is_some() {
                p.injected += 1;
            }
            f
        };
        match f {
            Some(f) => Err(TierError::Sync(io::Error::from_raw_os_error(f.errno()))),
            None => self.inner.sync(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Dtype;
    use crate::gpu::HostBuf;
    use crate::tier::MemTier;

    #[test]
    fn fails_chosen_ops_only() {
        let l = GroupLayout::new(1, 4, 1, 16, 128, Dtype::Fp16).unwrap();
        let (t, sw) = FaultTier::new(MemTier::new(l));
        let mut b = HostBuf::alloc(l.stride() as usize).unwrap();
        sw.fail_writes(Some(Fault::Enospc));
        sw.only(Some(GroupIndex(2)));
        let r = t.write_batch(&[
            WriteOp {
                index: GroupIndex(1),
                buf: b.as_slice(),
                generation: 1,
            },
            WriteOp {
                index: GroupIndex(2),
                buf: b.as_slice(),
                generation: 1,
            },
        ]);
        assert!(r[0].is_ok());
        assert_eq!(r[1].as_ref().unwrap_err().os_error(), Some(libc::ENOSPC));
        sw.fail_reads(Some(Fault::Eio));
        sw.only(None);
        assert_eq!(
            t.read_one(GroupIndex(1), b.as_mut_slice())
                .unwrap_err()
                .os_error(),
            Some(libc::EIO)
        );
        sw.fail_syncs(Some(Fault::Eio));
        assert!(t.sync().is_err());
        sw.heal();
        t.read_one(GroupIndex(1), b.as_mut_slice()).unwrap();
        t.sync().unwrap();
        assert_eq!(sw.injected(), 3);
    }
}
