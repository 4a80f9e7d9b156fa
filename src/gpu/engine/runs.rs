//! Restores on the copy engines: copies whose slots happen to be
//! contiguous joined into runs, enqueued whole (`Engine::copy_runs`).

use super::{Engine, LaneGuard, PooledEvent};
use crate::gpu::cuda::{Cuda, Signal};
use std::sync::Arc;

/// Copies as runs: adjacent copies whose sources and destinations both
/// continue one another are one run (see `Runs::push`).
#[derive(Default)]
pub struct Runs {
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
    copies: usize,
}

impl Runs {
    /// Adds a copy of `bytes` from `src` to `dst`, extending the last run
    /// when it ends where this one starts, on both sides.
    pub fn push(&mut self, src: u64, dst: u64, bytes: usize) {
        self.copies += 1;
        if let (Some(&s), Some(&d), Some(z)) =
            (self.srcs.last(), self.dsts.last(), self.sizes.last_mut())
            && s + *z as u64 == src
            && d + *z as u64 == dst
        {
            *z += bytes;
            return;
        }
        self.srcs.push(src);
        self.dsts.push(dst);
        self.sizes.push(bytes);
    }

    /// Runs so far.
    pub fn len(&self) -> usize {
        self.sizes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }

    /// Copies pushed so far.
    pub fn copies(&self) -> usize {
        self.copies
    }
}

/// A restore enqueued whole on the copy engines (see `Engine::copy_runs`).
pub struct DirectRestore {
    c: &'static Cuda,
    event: Arc<PooledEvent>,
}

impl DirectRestore {
    /// The ticket's event, recorded after the copies.
    pub fn event(&self) -> &Arc<PooledEvent> {
        &self.event
    }

    /// Waits for the copies.
    pub fn finish(self) -> Result<(), String> {
        self.c.wait_event(&self.event)
    }
}

impl Engine {
    /// Whether `copy_runs` can run here (a CUDA 13 driver).
    pub fn has_copy_engines(&self) -> bool {
        self.pool
            .driver()
            .map(|c| c.has_batch_copy())
            .unwrap_or(false)
    }

    /// Enqueues `runs` on `lane`, on the copy engines (one
    /// cuMemcpyBatchAsync): for restores whose sources are all
    /// device-visible already (pinned T1 slots), with no descriptors, no
    /// flag and no staging. The caller keeps the sources and destinations
    /// valid until the returned restore finishes.
    pub fn copy_runs(
        &self,
        mut runs: Runs,
        lane: &mut LaneGuard<'_>,
        signal: Signal,
    ) -> Result<DirectRestore, String> {
        let c = self.pool.driver()?;
        let event = Arc::new(self.pool.take_event()?);
        let stream = match &mut *lane.0 {
            Some(s) => s,
            slot => slot.insert(self.pool.take_stream()?),
        };
        // SAFETY: the caller's contract (see above).
        unsafe {
            c.enqueue_copies(
                stream,
                &mut runs.dsts,
                &mut runs.srcs,
                &mut runs.sizes,
                signal,
                &event,
            )
        }?;
        Ok(DirectRestore { c, event })
    }
}
