//! STORE from CUDA regions: the cascade's side of a GPU store (see
//! `super::gpu` for restores and the shared pieces). A store claims T1
//! slots the kernel may write straight into (groups new to T1, in it and
//! clean, or in it and dirty: those get a free slot, and their old one is
//! freed once the copy is done); the rest (a busy slot, no free slot left)
//! land in staging and are written into T1 after.

use super::admit::{Batch, Item};
use super::gpu::{Shape, no_driver, pieces};
use super::session::Session;
use super::wire::{Command, NO_ENTRY, Reply};
use super::{Rejection, reject};
use crate::cascade::CascadeError;
use crate::geometry::GroupIndex;
use crate::gpu::engine::{Descriptor, STORE_CHUNK, Store};
use std::sync::Arc;
use std::time::Instant;

impl Session {
    /// A STORE from CUDA regions, at most a chunk of the engine's staging
    /// per launch: straight into claimed T1 slots where it can, else into
    /// staging, whose groups are then written into T1 (write-back).
    /// (Splitting a chunk of many small groups into parts that claim, copy
    /// and commit on threads of their own was measured slower on the H200,
    /// 2026-12-06: the parts' claims take turns on the state lock.)
    pub(super) fn submit_gpu_store(self: &Arc<Session>, work: Batch) -> Result<Reply, Rejection> {
        crate::gpu::cuda::cuda().ok_or_else(no_driver)?;
        let layout = self.ctl.cascade.layout();
        let (gb, stride) = (layout.group_bytes(), layout.stride() as usize);
        let shape = Shape::of(&work, gb);
        let engine = self.ctl.gpu.on(work.cuda_device());
        let per_chunk = (STORE_CHUNK / stride).clamp(1, work.len().max(1));
        let mut copy = engine
            .store(per_chunk, gb, stride, shape.unit, shape.kernel_rows(false))
            .map_err(|e| {
                reject(
                    libc::EIO,
                    NO_ENTRY,
                    format!("cannot start the GPU store: {e}"),
                )
            })?;
        let ticket = self.new_ticket();
        let s = self.clone();
        let started = Instant::now();
        tracing::debug!(ticket, n = work.len(), per_chunk, "GPU store submitted");
        self.ctl.exec.submit_ticket(
            self,
            ticket,
            Box::new(move || {
                let mut results: Vec<Result<(), CascadeError>> = Vec::with_capacity(work.len());
                let queued_us = started.elapsed().as_micros() as u64;
                let chunk = StoreChunk {
                    s: &s,
                    work: &work,
                    gb,
                    shape,
                    ticket,
                    queued_us,
                };
                for items in work.items.chunks(per_chunk) {
                    results.extend(chunk.run(items, &mut copy));
                }
                drop(copy);
                s.complete(Command::Store, ticket, started, results);
            }),
        );
        Ok(Reply::ok(Command::Store, ticket))
    }
}

/// What every chunk of one GPU store shares.
struct StoreChunk<'a> {
    s: &'a Arc<Session>,
    work: &'a Batch,
    gb: u64,
    shape: Shape,
    ticket: u64,
    queued_us: u64,
}

impl StoreChunk<'_> {
    /// Stores `items` (at most `copy.chunk()`) through `copy`: claims T1
    /// slots for them (where no group is named twice), copies, commits,
    /// writes what landed in staging into T1 and tells the mount of the
    /// change. A result an entry.
    fn run(&self, items: &[Item], copy: &mut Store) -> Vec<Result<(), CascadeError>> {
        let (s, work, gb, shape, ticket) = (self.s, self.work, self.gb, self.shape, self.ticket);
        let cascade = &s.ctl.cascade;
        let t0 = Instant::now();
        let groups: Vec<GroupIndex> = items.iter().map(|it| it.g).collect();
        let distinct = all_distinct(&groups);
        let ts = Instant::now();
        let slots = distinct.then(|| cascade.claim_slots(&groups, true));
        let slots_us = ts.elapsed().as_micros() as u64;
        let distinct_us = (ts - t0).as_micros() as u64;
        let lock_wait_us = slots.as_ref().map_or(0, |w| w.waited().as_micros() as u64);
        let direct: Vec<Option<u64>> = (0..items.len())
            .map(|i| slots.as_ref().and_then(|w| w.device_addr(i)))
            .collect();
        // Admission made every region of a CUDA batch a CUDA
        // region and checked offset + group_bytes inside it.
        let at = |i: usize| direct[i].unwrap_or(copy.staging_addr(i));
        let descs: Vec<Descriptor> = pieces(work, items, gb, shape.piece(), at, false).collect();
        let t1 = Instant::now();
        // SAFETY: every descriptor names a checked range of a
        // live CUDA region (the batch holds it) and either a
        // staging slot or a T1 slot `slots` holds until after the
        // launch returns (write-locked, or a spare nobody else can
        // reach).
        if let Err(e) = unsafe { copy.launch(&descs) } {
            // Dropping `slots` gives back the claimed slots.
            tracing::error!("GPU store of ticket {ticket} failed: {e}");
            return items
                .iter()
                .map(|_| Err(CascadeError::RegionFault(format!("GPU copy failed: {e}"))))
                .collect();
        }
        let t2 = Instant::now();
        if let Some(w) = slots {
            w.commit();
        }
        let commit_us = t2.elapsed().as_micros() as u64;
        let staged: Vec<usize> = (0..items.len()).filter(|&i| direct[i].is_none()).collect();
        let gs: Vec<GroupIndex> = staged.iter().map(|&i| groups[i]).collect();
        let bytes: Vec<&[u8]> = staged.iter().map(|&i| copy.staged(i)).collect();
        let mut rs: Vec<Result<(), CascadeError>> = (0..items.len()).map(|_| Ok(())).collect();
        for (&i, r) in staged
            .iter()
            .zip(write_staged(cascade, &gs, &bytes, distinct))
        {
            rs[i] = r;
        }
        let write_us = t2.elapsed().as_micros() as u64;
        let t3 = Instant::now();
        s.changed(&groups, &rs);
        // Where a chunk's time goes: claiming T1 slots (looking for
        // groups named twice, `claim_slots` itself and of that its wait
        // for the state lock, then describing), the copy (launch and
        // wait), committing the claimed slots, writing staged groups into
        // T1 (write_us, from the copy's end, commit included) and telling
        // the mount of the change.
        tracing::debug!(
            ticket,
            n = items.len(),
            in_place = items.len() - staged.len(),
            queued_us = self.queued_us,
            claim_us = (t1 - t0).as_micros() as u64,
            distinct_us,
            slots_us,
            lock_wait_us,
            copy_us = (t2 - t1).as_micros() as u64,
            commit_us,
            write_us,
            changed_us = t3.elapsed().as_micros() as u64,
            "GPU store: chunk done"
        );
        rs
    }
}

/// Whether no group is named twice: an open-addressed set of twice the
/// batch's size (a sort of a 4 KiB ticket's 4096 indices took ~25 µs on
/// the CPU machine, ~60 on the H200's host).
fn all_distinct(groups: &[GroupIndex]) -> bool {
    const EMPTY: u64 = u64::MAX;
    let size = (groups.len() * 2).next_power_of_two().max(16);
    let mask = size - 1;
    let mut set = vec![EMPTY; size];
    for g in groups {
        // Fibonacci hashing: the top bits of a multiply spread runs of
        // neighbouring indices, the usual batch.
        let mut at = (g.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & mask;
        loop {
            match set[at] {
                EMPTY => {
                    set[at] = g.0;
                    break;
                }
                x if x == g.0 => return false,
                _ => at = (at + 1) & mask,
            }
        }
    }
    true
}

/// Staged bytes a GPU store writes into T1 on threads of its own, each
/// part at least this much: the host copy (and checksum) of a 16 MiB
/// chunk takes about four times its PCIe copy on one thread.
const PARALLEL_WRITE_BYTES: usize = 4 << 20;
/// Threads a store chunk's staged groups are written by, at most.
const WRITE_THREADS: usize = 4;

/// Writes staged groups `gs` (bytes in `bytes`) into T1, in parts on
/// several threads where the groups are `distinct` and many bytes; a
/// batch naming a group twice is written in order on this thread.
fn write_staged(
    cascade: &crate::cascade::Cascade,
    gs: &[GroupIndex],
    bytes: &[&[u8]],
    distinct: bool,
) -> Vec<Result<(), CascadeError>> {
    let total: usize = bytes.iter().map(|b| b.len()).sum();
    let parts = (total / PARALLEL_WRITE_BYTES).clamp(1, WRITE_THREADS);
    let write = |gs: &[GroupIndex], bytes: &[&[u8]]| {
        cascade.write_groups(gs, |k, dst| {
            dst.copy_from_slice(bytes[k]);
            Ok(())
        })
    };
    if !distinct || parts == 1 {
        return write(gs, bytes);
    }
    let per = gs.len().div_ceil(parts);
    std::thread::scope(|sc| {
        let handles: Vec<_> = gs
            .chunks(per)
            .zip(bytes.chunks(per))
            .map(|(g, b)| sc.spawn(move || write(g, b)))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a staged write panicked"))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cascade::{Cascade, CascadeConfig, MetaTable};
    use crate::geometry::{Dtype, GroupLayout};
    use crate::tier::MemTier;

    /// `all_distinct` agrees with a sort: batches with and without a group
    /// named twice, near and far apart, small and large.
    #[test]
    fn distinct_groups_are_told_from_repeats() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for n in [0usize, 1, 2, 3, 17, 1000, 4096] {
            for trial in 0..20 {
                let mut gs: Vec<GroupIndex> = (0..n as u64)
                    .map(|i| match trial % 3 {
                        0 => GroupIndex(i),
                        1 => GroupIndex(next() % (4 * n as u64 + 1)),
                        _ => GroupIndex(next()),
                    })
                    .collect();
                if n > 1 && trial % 2 == 1 {
                    let (a, b) = (next() as usize % n, next() as usize % n);
                    gs[a] = gs[b];
                }
                let mut sorted: Vec<u64> = gs.iter().map(|g| g.0).collect();
                sorted.sort_unstable();
                let want = sorted.windows(2).all(|w| w[0] != w[1]);
                assert_eq!(all_distinct(&gs), want, "n {n}, trial {trial}");
            }
        }
    }

    /// Staged groups written in parts on several threads land whole, each
    /// where it belongs, with a result per group in order; a batch naming
    /// a group twice is written in order (the later bytes win).
    #[test]
    fn staged_writes_in_parallel_land_in_order() {
        // 4 layers × 32 blocks × 2 heads × {K,V} = 512 groups of 32 KiB.
        let layout = GroupLayout::new(4, 32, 2, 64, 256, Dtype::Fp16).unwrap();
        let gb = layout.group_bytes() as usize;
        let slots = 300;
        let c = Cascade::new(
            layout,
            Box::new(MemTier::new(layout)),
            MetaTable::anonymous(layout.group_count()).unwrap(),
            CascadeConfig {
                t1_bytes: slots * layout.stride(),
                ..CascadeConfig::default()
            },
        )
        .unwrap();
        // More groups than T1 holds: writes evict as they go.
        let gs: Vec<GroupIndex> = (0..512).map(GroupIndex).collect();
        let data: Vec<Vec<u8>> = (0..512)
            .map(|i| (0..gb).map(|j| (i * 7 + j) as u8).collect())
            .collect();
        let bytes: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
        assert!(
            gb * 512 / PARALLEL_WRITE_BYTES >= WRITE_THREADS,
            "several parts"
        );
        let rs = write_staged(&c, &gs, &bytes, true);
        assert_eq!(rs.len(), 512);
        assert!(rs.iter().all(|r| r.is_ok()));
        let mut out = vec![0u8; gb];
        for (i, g) in gs.iter().enumerate() {
            c.read_groups(&mut [(*g, &mut out[..])])[0]
                .as_ref()
                .unwrap();
            assert_eq!(out, data[i], "group {i}");
        }
        // A group named twice: in order, one thread.
        let twice = [GroupIndex(3), GroupIndex(3)];
        let rs = write_staged(&c, &twice, &[&data[10], &data[11]], false);
        assert!(rs.iter().all(|r| r.is_ok()));
        c.read_groups(&mut [(GroupIndex(3), &mut out[..])])[0]
            .as_ref()
            .unwrap();
        assert_eq!(out, data[11]);
    }
}
