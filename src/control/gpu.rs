//! RESTORE/STORE into and out of CUDA regions: the cascade's side of the
//! GPU transfer engine (`crate::gpu::engine`).
//!
//! The engine copies; this room decides what it copies. A restore is
//! enqueued on admission (so the reply can carry the ticket's IPC event).
//! A batch all in T1 (up to PIN_ON_ADMISSION_MAX groups) is pinned then and there (its slots cannot be
//! evicted or rewritten until the copy is done), its descriptors written
//! and its copy let go on the fd's ordered lane, with no staging; the
//! engine's completion thread waits for it and unpins. Any other batch is
//! resolved by an executor job on a stream of its own, holding nobody up:
//! T1 hits are pinned and read by the kernel through the device mapping,
//! misses read from the backing into the engine's staging. A store claims
//! T1 slots the kernel may write straight into (groups new to T1, or in it
//! and clean); the rest land in staging and are written into T1 after.

use super::admit::Batch;
use super::session::Session;
use super::wire::{Command, NO_ENTRY, Reply};
use super::{Rejection, reject};
use crate::cascade::CascadeError;
use crate::cascade::DevicePins;
use crate::geometry::GroupIndex;
use crate::gpu::engine::{Descriptor, PooledEvent, Runs};
use std::sync::Arc;
use std::time::Instant;

/// How restores of pinned T1 groups copy (`KVFS_GPU_COPY`): `auto`
/// (the default) puts a batch on the copy engines when its copies join
/// into runs of at least ENGINE_RUN_BYTES on average, else runs the gather
/// kernel; `engines` and `kernel` force one.
#[derive(Clone, Copy, PartialEq)]
enum CopyMode {
    Auto,
    Engines,
    Kernel,
}

/// The largest RESTORE pinned on admission. Pinning costs ~100 ns a
/// group of random lookups (measured on the H200 host: ~0.42 ms for 4096),
/// and admission serves a session's requests one at a time, where the
/// executor pins several tickets' groups at once: bigger batches go there
/// (on the gather kernel).
const PIN_ON_ADMISSION_MAX: usize = 2048;

/// Auto mode's average run for the copy engines: shorter runs go faster
/// through the gather kernel.
const ENGINE_RUN_BYTES: usize = 64 << 10;

fn copy_mode() -> CopyMode {
    static MODE: std::sync::OnceLock<CopyMode> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("KVFS_GPU_COPY").as_deref() {
        Ok("engines") => CopyMode::Engines,
        Ok("kernel") => CopyMode::Kernel,
        _ => CopyMode::Auto,
    })
}

/// Every entry's result after one copy of the whole batch.
fn copy_results(n: usize, r: &Result<(), String>) -> Vec<Result<(), CascadeError>> {
    if let Err(e) = r {
        tracing::error!("a GPU restore failed: {e}");
    }
    (0..n)
        .map(|_| match r {
            Ok(()) => Ok(()),
            Err(e) => Err(CascadeError::RegionFault(format!("GPU copy failed: {e}"))),
        })
        .collect()
}

fn no_driver() -> Rejection {
    reject(libc::ENODEV, NO_ENTRY, "no CUDA driver")
}

impl Session {
    /// A RESTORE into CUDA regions, enqueued before the reply: a batch all
    /// in T1 pinned and let go at once (copy engines or kernel), its slots
    /// released by the engine's completion thread after the copy; any
    /// other resolved and released by an executor job.
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
        // A batch all in T1 (and of at most PIN_ON_ADMISSION_MAX groups)
        // is pinned here, looked up once, needs no staging, and goes on the
        // fd's ordered lane. Only such batches use
        // the lane, and each is let go before the lane is: no copy on the
        // lane waits for a job.
        let groups: Vec<GroupIndex> = work.items.iter().map(|it| it.g).collect();
        let pinned = match n <= PIN_ON_ADMISSION_MAX {
            true => self.ctl.cascade.try_pin_resident(&groups),
            false => None,
        };
        if let Some((addrs, pins)) = pinned {
            let resident_us = checked.elapsed().as_micros() as u64;
            if let Some(runs) = self.engine_runs(&work, &addrs, gb as usize) {
                let n_runs = runs.len();
                let copy = self
                    .ctl
                    .gpu
                    .copy_runs(runs, &mut self.lane.lock())
                    .map_err(fail)?;
                let (ticket, reply) = self.gpu_ticket(copy.event());
                tracing::debug!(
                    ticket,
                    n,
                    runs = n_runs,
                    admit_us = admitted.elapsed().as_micros() as u64,
                    resident_us,
                    "GPU restore of pinned T1 groups on the copy engines"
                );
                self.release_after(ticket, n, pins, move || copy.finish());
                return Ok(reply);
            }
            let mut lane = self.lane.lock();
            let mut copy = self
                .ctl
                .gpu
                .restore(n, gb, stride, 0, Some(&mut lane))
                .map_err(fail)?;
            let (ticket, reply) = self.gpu_ticket(copy.event());
            copy.describe(|i| {
                let it = &work.items[i];
                Descriptor {
                    src: addrs[i],
                    dst: work.region(it).device_addr(it.offset).unwrap_or(0),
                }
            });
            copy.start();
            drop(lane);
            tracing::debug!(
                ticket,
                n,
                admit_us = admitted.elapsed().as_micros() as u64,
                resident_us,
                "GPU restore of pinned T1 groups by the kernel"
            );
            self.release_after(ticket, n, pins, move || copy.finish());
            return Ok(reply);
        }
        let resident_us = checked.elapsed().as_micros() as u64;
        let mut copy = self.ctl.gpu.restore(n, gb, stride, n, None).map_err(fail)?;
        let (ticket, reply) = self.gpu_ticket(copy.event());
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
                let job_started = Instant::now();
                let mut results: Vec<Result<(), CascadeError>> = (0..n).map(|_| Ok(())).collect();
                let (hits, pins) = cascade.pin_for_device(&groups);
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
                let misses = misses.len();
                let pin_us = job_started.elapsed().as_micros() as u64;
                copy.describe(|i| {
                    let it = &work.items[i];
                    Descriptor {
                        src: if results[i].is_ok() { src[i] } else { 0 },
                        dst: work.region(it).device_addr(it.offset).unwrap_or(0),
                    }
                });
                tracing::debug!(
                    ticket,
                    misses,
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
        Ok(reply)
    }

    /// A new ticket of a GPU restore and its reply, which carries the
    /// ticket's IPC event (kept for the ticket until it is collected).
    fn gpu_ticket(&self, event: &Arc<PooledEvent>) -> (u64, Reply) {
        let ticket = self.new_ticket();
        let mut reply = Reply::ok(Command::Restore, ticket);
        reply.message = format!("ipc_event={}", event.handle_hex());
        self.st.lock().events.insert(ticket, event.clone());
        (ticket, reply)
    }

    /// Completes a restore of pinned T1 groups on the engine's completion
    /// thread: waits for its copy (`finish`), then unpins. No executor
    /// thread is involved, so a writer waiting on an executor for these
    /// slots cannot hold up their release.
    fn release_after(
        self: &Arc<Session>,
        ticket: u64,
        n: usize,
        pins: DevicePins,
        finish: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) {
        let s = self.clone();
        let started = Instant::now();
        self.ctl.gpu.then(Box::new(move || {
            let r = finish();
            drop(pins);
            s.complete(Command::Restore, ticket, started, copy_results(n, &r));
        }));
    }

    /// The runs of a restore of pinned T1 groups (at `addrs`) when the
    /// copy mode puts it on the copy engines; None when the kernel copies.
    fn engine_runs(&self, work: &Batch, addrs: &[u64], gb: usize) -> Option<Runs> {
        let mode = copy_mode();
        if mode == CopyMode::Kernel || !self.ctl.gpu.has_copy_engines() {
            return None;
        }
        let mut runs = Runs::default();
        for (it, &src) in work.items.iter().zip(addrs) {
            runs.push(src, work.region(it).device_addr(it.offset)?, gb);
        }
        if mode == CopyMode::Auto && runs.len() * ENGINE_RUN_BYTES > runs.copies() * gb {
            return None;
        }
        Some(runs)
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
