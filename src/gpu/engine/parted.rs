//! Restores launched a part at a time on a client's lane as their T1
//! slots are pinned (`Engine::restore_parts`), optionally alternating
//! over a second stream.

use super::{
    DESCRIPTOR_BYTES, Descriptor, Engine, FLAG_BYTES, LaneGuard, Pool, PooledEvent, ReadyFlag,
    Restore, write_descriptors_at,
};
use crate::gpu::cuda::{Cuda, IpcEvent, Rows, Signal, Stream};
use std::sync::Arc;

impl Engine {
    /// A restore of `n` copies of `bytes` each (known in parts: pinned
    /// T1 slots, pinned a part at a time) launched on `lane` a part at a
    /// time (`PartedRestore::launch`), each part as soon as its
    /// descriptors are written, so the copy starts after the first part's
    /// lookups, not after all of them. No flag: nothing on the lane waits
    /// on the host. With `two_streams`, every second part goes on a
    /// stream of its own, so a part starts while the one before it
    /// drains (on one stream each part's first blocks wait for the last
    /// one's last); the lane waits for that stream before the ticket's
    /// end (done word, event).
    pub fn restore_parts(
        &self,
        n: usize,
        bytes: u64,
        rows: Option<Rows>,
        lane: &mut LaneGuard<'_>,
        signal: Signal,
        two_streams: bool,
    ) -> Result<PartedRestore, String> {
        let c = self.pool.driver()?;
        let pool = &self.pool;
        let table = pool.take_table(n)?;
        let table_dev = table
            .device_ptr()
            .ok_or("the descriptor table is not device-mapped")?;
        let event = Arc::new(pool.take_event()?);
        if lane.0.is_none() {
            *lane.0 = Some(pool.take_stream()?);
        }
        let side = match two_streams {
            true => Some(Side {
                c,
                event: pool.take_event()?,
                stream: Some(pool.take_stream()?),
                pending: false,
                pool: pool.clone(),
            }),
            false => None,
        };
        let flag = table.as_ptr().cast::<u32>();
        Ok(PartedRestore {
            side,
            parts: 0,
            inner: Restore {
                ready: ReadyFlag::unarmed(flag),
                c,
                n,
                stride: bytes as usize,
                table: Some(table),
                staging: None,
                staging_slots: 0,
                own_stream: None,
                event,
                pool: pool.clone(),
                finished: false,
                ends: Vec::new(),
                through: 0,
            },
            table_dev,
            bytes,
            rows,
            launched: 0,
            signal,
        })
    }
}

/// A restore launched a part at a time (see `Engine::restore_parts`).
pub struct PartedRestore {
    /// First, so dropped first: a restore given up waits for its parts
    /// on the second stream before `inner`'s drop waits for the lane's.
    side: Option<Side>,
    /// Parts launched so far.
    parts: usize,
    inner: Restore,
    table_dev: u64,
    bytes: u64,
    rows: Option<Rows>,
    /// Descriptors launched so far (the next part's first place).
    launched: usize,
    /// The done word, written after the part that completes the n copies
    /// (never, if the rest goes elsewhere).
    signal: Signal,
}

impl PartedRestore {
    /// The ticket's event, recorded on the lane after each part there
    /// and at `join`: after `finish`'s wait, or a stream's wait on it once
    /// the last part is launched (or `join` called), every part launched
    /// is done.
    pub fn event(&self) -> &Arc<PooledEvent> {
        &self.inner.event
    }

    /// Copies launched so far.
    pub fn launched(&self) -> usize {
        self.launched
    }

    /// Writes the next `n` descriptors (those of `descs`, any left over
    /// skipped) and launches them on `lane`, the lane `restore_parts` was
    /// given.
    ///
    /// # Safety
    /// Every descriptor names `bytes` readable device-visible bytes at
    /// `src` and writable ones at `dst` (laid out as `rows` on the
    /// destination side), which the caller keeps valid until `finish`
    /// returns (or a drop, which waits for the copies).
    pub unsafe fn launch(
        &mut self,
        lane: &mut LaneGuard<'_>,
        n: usize,
        descs: impl Iterator<Item = Descriptor>,
    ) -> Result<(), String> {
        let at = self.launched;
        assert!(
            at + n <= self.inner.n,
            "parts of at most the n copies taken"
        );
        let table = self.inner.table.as_mut().expect("until finished");
        write_descriptors_at(table, at, n, descs);
        self.launched += n;
        let part = self.parts;
        self.parts += 1;
        let descs = self.table_dev + (FLAG_BYTES + DESCRIPTOR_BYTES * at) as u64;
        let c = self.inner.c;
        let lane_stream = lane
            .0
            .as_ref()
            .expect("restore_parts gave the lane a stream");
        // Every second part on the second stream, its event recorded
        // after it (what the lane, or a drop, waits for); on the lane, the
        // ticket's event after each part but the last (`join` ends it).
        let last = self.launched == self.inner.n;
        let (stream, event): (&Stream, Option<&IpcEvent>) =
            match self.side.as_mut().filter(|_| part % 2 == 1) {
                Some(side) => {
                    side.pending = true;
                    let stream = side.stream.as_ref().expect("until dropped");
                    (stream, Some(&side.event))
                }
                None => (lane_stream, (!last).then_some(&self.inner.event)),
            };
        // SAFETY: places at..at + n of the table (live in `inner` until
        // the event completes) were written above; the copies are the
        // caller's contract.
        unsafe { c.enqueue_gather_part(stream, None, descs, n as u32, self.bytes, self.rows) }?;
        if let Some(event) = event {
            c.enqueue_end(stream, None, event)?;
        }
        match last {
            true => self.join(lane),
            false => Ok(()),
        }
    }

    /// Makes the lane wait for the parts on the second stream, then
    /// records the ticket's end on it (the done word once all n copies
    /// are launched, and the event): after this, the event covers every
    /// part launched. `launch` does it after the last part; a caller that
    /// stops early (the rest goes elsewhere) does it before handing the
    /// event on.
    pub fn join(&mut self, lane: &mut LaneGuard<'_>) -> Result<(), String> {
        let c = self.inner.c;
        let stream = lane
            .0
            .as_ref()
            .expect("restore_parts gave the lane a stream");
        if let Some(side) = self.side.as_mut().filter(|s| s.pending) {
            c.stream_wait_event(stream, &side.event)?;
            side.pending = false;
        }
        let signal = self.signal.filter(|_| self.launched == self.inner.n);
        c.enqueue_end(stream, signal, &self.inner.event)
    }

    /// Waits for every part launched and gives the resources back.
    pub fn finish(self) -> Result<(), String> {
        self.inner.finish()
    }
}

/// A parted restore's second stream and its event, recorded after each
/// part launched on it. Dropped with parts the lane was never told to
/// wait for (a restore given up), it waits for them; the stream goes back
/// to the pool.
struct Side {
    c: &'static Cuda,
    stream: Option<Stream>,
    event: PooledEvent,
    pending: bool,
    pool: Arc<Pool>,
}

impl Drop for Side {
    fn drop(&mut self) {
        if self.pending {
            let _ = self.c.wait_event(&self.event);
        }
        self.pool.give_stream(self.stream.take());
    }
}
