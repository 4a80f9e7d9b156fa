//! RESTORE/STORE into and out of CUDA regions: the cascade's side of the
//! GPU transfer engine (`crate::gpu::engine`).
//!
//! The engine copies; this room decides what it copies. A restore is
//! enqueued on admission (so the reply can carry the ticket's IPC event)
//! and resolved by the job: T1 hits are pinned (their slots cannot be
//! evicted or rewritten until the copy is done) and read by the kernel
//! through the device mapping; misses are read from the backing into the
//! engine's staging. A batch all in T1 goes on the fd's ordered lane; one
//! with misses on a stream of its own, holding nobody up. A store claims
//! T1 slots the kernel may write straight into (groups new to T1, or in it
//! and clean); the rest land in staging and are written into T1 after.

use super::admit::Batch;
use super::session::Session;
use super::wire::{Command, NO_ENTRY, Reply};
use super::{Rejection, reject};
use crate::cascade::CascadeError;
use crate::geometry::GroupIndex;
use crate::gpu::engine::Descriptor;
use std::sync::Arc;
use std::time::Instant;

fn no_driver() -> Rejection {
    reject(libc::ENODEV, NO_ENTRY, "no CUDA driver")
}

impl Session {
    /// A RESTORE into CUDA regions: enqueued before the reply, resolved
    /// and released by the job, which waits for the copy before it lets go
    /// of the slots.
    pub(super) fn submit_gpu_restore(
        self: &Arc<Session>,
        work: Batch,
        admitted: Instant,
    ) -> Result<Reply, Rejection> {
        crate::gpu::cuda::cuda().ok_or_else(no_driver)?;
        let n = work.len();
        let layout = self.ctl.cascade.layout();
        let (gb, stride) = (layout.group_bytes(), layout.stride() as usize);
        let fail = |e: String| {
            reject(
                libc::EIO,
                NO_ENTRY,
                format!("cannot start the GPU restore: {e}"),
            )
        };
        let checked = Instant::now();
        let resident = self
            .ctl
            .cascade
            .all_resident(work.items.iter().map(|it| it.g));
        let resident_us = checked.elapsed().as_micros() as u64;
        let mut lane = resident.then(|| self.lane.lock());
        let mut copy = self
            .ctl
            .gpu
            .restore(n, gb, stride, lane.as_mut())
            .map_err(fail)?;
        let ticket = self.new_ticket();
        let mut reply = Reply::ok(Command::Restore, ticket);
        reply.message = format!("ipc_event={}", copy.event().handle_hex());
        self.st.lock().events.insert(ticket, copy.event().clone());
        let s = self.clone();
        let started = Instant::now();
        tracing::debug!(
            ticket,
            n,
            admit_us = (started - admitted).as_micros() as u64,
            resident_us,
            "GPU restore enqueued"
        );
        self.ctl.exec.submit_ticket(
            self,
            ticket,
            Box::new(move || {
                let cascade = s.ctl.cascade.clone();
                let groups: Vec<GroupIndex> = work.items.iter().map(|it| it.g).collect();
                let job_started = Instant::now();
                let (hits, pins) = cascade.pin_for_device(&groups);
                let pin_us = job_started.elapsed().as_micros() as u64;
                let mut results: Vec<Result<(), CascadeError>> = (0..n).map(|_| Ok(())).collect();
                let misses: Vec<usize> = (0..n).filter(|&i| hits[i].is_none()).collect();
                let mut src: Vec<u64> = hits.iter().map(|h| h.unwrap_or(0)).collect();
                if !misses.is_empty() {
                    let (staging, base) = copy.staging();
                    let mut items: Vec<(GroupIndex, &mut [u8])> = staging
                        .chunks_mut(stride)
                        .zip(&misses)
                        .map(|(b, &i)| (groups[i], &mut b[..gb as usize]))
                        .collect();
                    let rs = cascade.read_groups(&mut items);
                    drop(items);
                    for (k, (&i, r)) in misses.iter().zip(rs).enumerate() {
                        match (r, base) {
                            (Ok(_), Some(base)) => src[i] = base + (k * stride) as u64,
                            (Ok(_), None) => {
                                results[i] = Err(CascadeError::Internal(
                                    "staging is not device-mapped".into(),
                                ))
                            }
                            (Err(e), _) => results[i] = Err(e),
                        }
                    }
                }
                copy.describe(|i| {
                    let it = &work.items[i];
                    Descriptor {
                        src: if results[i].is_ok() { src[i] } else { 0 },
                        dst: work.region(it).device_addr(it.offset).unwrap_or(0),
                    }
                });
                tracing::debug!(
                    ticket,
                    misses = misses.len(),
                    queued_us = (job_started - started).as_micros() as u64,
                    pin_us,
                    "GPU restore: descriptors ready"
                );
                let r = copy.finish();
                tracing::debug!(ticket, ok = r.is_ok(), "GPU restore: copy done");
                if let Err(e) = r {
                    tracing::error!("GPU restore of ticket {ticket} failed: {e}");
                    for r in results.iter_mut() {
                        *r = Err(CascadeError::RegionFault(format!("GPU copy failed: {e}")));
                    }
                }
                drop(pins);
                s.complete(Command::Restore, ticket, started, results);
            }),
        );
        // Held until the job is queued: jobs of the ordered lane reach
        // the executor in lane order, so a job never waits (on its event)
        // for a copy whose flag only a job queued behind it would set.
        drop(lane);
        Ok(reply)
    }

    /// A STORE from CUDA regions, at most a chunk of the engine's staging
    /// per launch: straight into claimed T1 slots where it can, else into
    /// staging, whose groups are then written into T1 (write-back).
    pub(super) fn submit_gpu_store(self: &Arc<Session>, work: Batch) -> Result<Reply, Rejection> {
        crate::gpu::cuda::cuda().ok_or_else(no_driver)?;
        let layout = self.ctl.cascade.layout();
        let (gb, stride) = (layout.group_bytes(), layout.stride() as usize);
        let mut copy = self.ctl.gpu.store(work.len(), gb, stride).map_err(|e| {
            reject(
                libc::EIO,
                NO_ENTRY,
                format!("cannot start the GPU store: {e}"),
            )
        })?;
        let chunk = copy.chunk();
        let ticket = self.new_ticket();
        let s = self.clone();
        let started = Instant::now();
        tracing::debug!(ticket, n = work.len(), chunk, "GPU store submitted");
        self.ctl.exec.submit_ticket(
            self,
            ticket,
            Box::new(move || {
                let cascade = &s.ctl.cascade;
                let mut results: Vec<Result<(), CascadeError>> = Vec::with_capacity(work.len());
                for items in work.items.chunks(chunk) {
                    let groups: Vec<GroupIndex> = items.iter().map(|it| it.g).collect();
                    // A batch naming a group twice goes through staging, in order.
                    let mut sorted: Vec<u64> = groups.iter().map(|g| g.0).collect();
                    sorted.sort_unstable();
                    let slots = sorted
                        .windows(2)
                        .all(|w| w[0] != w[1])
                        .then(|| cascade.claim_slots(&groups, true));
                    let direct: Vec<Option<u64>> = (0..items.len())
                        .map(|i| slots.as_ref().and_then(|w| w.device_addr(i)))
                        .collect();
                    // Admission made every region of a CUDA batch a CUDA
                    // region and checked offset + group_bytes inside it.
                    let descs: Vec<Descriptor> = items
                        .iter()
                        .enumerate()
                        .map(|(i, it)| Descriptor {
                            src: work.region(it).device_addr(it.offset).unwrap_or(0),
                            dst: direct[i].unwrap_or(copy.staging_addr(i)),
                        })
                        .collect();
                    // SAFETY: every descriptor names a checked range of a
                    // live CUDA region (the batch holds it) and either a
                    // staging slot or a T1 slot write-locked in `slots`
                    // until after the launch returns.
                    if let Err(e) = unsafe { copy.launch(&descs) } {
                        // Dropping `slots` gives back the claimed slots.
                        tracing::error!("GPU store of ticket {ticket} failed: {e}");
                        results.extend(items.iter().map(|_| {
                            Err(CascadeError::RegionFault(format!("GPU copy failed: {e}")))
                        }));
                        continue;
                    }
                    if let Some(w) = slots {
                        w.commit();
                    }
                    let staged: Vec<usize> =
                        (0..items.len()).filter(|&i| direct[i].is_none()).collect();
                    let gs: Vec<GroupIndex> = staged.iter().map(|&i| groups[i]).collect();
                    let mut rs: Vec<Result<(), CascadeError>> =
                        (0..items.len()).map(|_| Ok(())).collect();
                    for (&i, r) in staged.iter().zip(cascade.write_groups(&gs, |k, dst| {
                        dst.copy_from_slice(copy.staged(staged[k]));
                        Ok(())
                    })) {
                        rs[i] = r;
                    }
                    tracing::debug!(
                        ticket,
                        n = items.len(),
                        in_place = items.len() - staged.len(),
                        "GPU store: chunk done"
                    );
                    s.changed(&groups, &rs);
                    results.extend(rs);
                }
                drop(copy);
                s.complete(Command::Store, ticket, started, results);
            }),
        );
        Ok(Reply::ok(Command::Store, ticket))
    }
}
