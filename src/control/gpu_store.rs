//! STORE from CUDA regions: the cascade's side of a GPU store (see
//! `super::gpu` for restores and the shared pieces). A store claims T1
//! slots the kernel may write straight into (groups new to T1, in it and
//! clean, or in it and dirty: those get a free slot, and their old one is
//! freed once the copy is done); the rest (a busy slot, no free slot left)
//! land in staging and are written into T1 after.

use super::admit::{Batch, Item};
use super::descs::{Shape, in_host_order, pieces};
use super::gpu::no_driver;
use super::session::Session;
use super::wire::{Command, NO_ENTRY, Reply};
use super::{Rejection, reject};
use crate::cascade::{CascadeError, SlotWrites};
use crate::geometry::GroupIndex;
use crate::gpu::engine::{Descriptor, STORE_CHUNK, Store};
use std::sync::Arc;
use std::time::Instant;

/// Groups a part of a store chunk holds by default: each part's slots
/// are claimed while the part before it copies, and committed while the
/// part after it does (`KVFS_STORE_PART_GROUPS`: a number, or `off` for
/// one part a chunk). Claims cost by the group, copies by the byte: 1024
/// groups of 4 KiB (4 MiB) are ~0.1 ms of claims and ~0.08 ms of copy on
/// an H100's host, and parts of them sped 4 KiB stores from 0.74–0.83×
/// of one big copy to 0.89–0.90×; 16 KiB chunks (1024 groups) stay one
/// part (in 4 MiB parts, 2% slower).
const STORE_PART_GROUPS: usize = 1024;

/// The groups of a store chunk's part: STORE_PART_GROUPS, or what
/// `KVFS_STORE_PART_GROUPS` says (see `groups_a_part`).
fn part_groups(per_chunk: usize) -> usize {
    static GROUPS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let groups = *GROUPS.get_or_init(
        || match std::env::var("KVFS_STORE_PART_GROUPS").as_deref() {
            Ok("off") => 0,
            Ok(v) => v.parse().unwrap_or(STORE_PART_GROUPS),
            Err(_) => STORE_PART_GROUPS,
        },
    );
    groups_a_part(groups, per_chunk)
}

/// Parts of `groups` (0: the whole chunk of `per_chunk`), at least 1 and
/// at most the chunk.
fn groups_a_part(groups: usize, per_chunk: usize) -> usize {
    match groups {
        0 => per_chunk.max(1),
        g => g.min(per_chunk.max(1)),
    }
}

impl Session {
    /// A STORE from CUDA regions, at most a chunk of the engine's staging
    /// per chunk, each chunk launched in parts on one thread: a part's
    /// slots are claimed while the part before it copies. Straight into
    /// claimed T1 slots where it can, else into staging, whose groups are
    /// then written into T1 (write-back). (Parts that claim, copy and
    /// commit on threads of their own were measured slower on the H200,
    /// 2026-12-06: their claims took turns on the state lock.)
    pub(super) fn submit_gpu_store(self: &Arc<Session>, work: Batch) -> Result<Reply, Rejection> {
        crate::gpu::cuda::cuda().ok_or_else(no_driver)?;
        let layout = self.ctl.cascade.layout();
        let (gb, stride) = (layout.group_bytes(), layout.stride() as usize);
        let shape = Shape::of(&work, gb);
        let engine = self.ctl.gpu.on(work.cuda_device());
        let per_chunk = (STORE_CHUNK / stride).clamp(1, work.len().max(1));
        let per_part = part_groups(per_chunk);
        let mut copy = engine
            .store(
                per_chunk,
                gb,
                stride,
                shape.unit,
                shape.kernel_rows(false),
                per_chunk.div_ceil(per_part),
            )
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
        tracing::debug!(
            ticket,
            n = work.len(),
            per_chunk,
            per_part,
            "GPU store submitted"
        );
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
                    per_part,
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
    /// Groups a part.
    per_part: usize,
}

/// A part launched and not yet waited for: its entries (of the chunk) and
/// the slots it writes.
struct InFlight<'c> {
    part: usize,
    at: std::ops::Range<usize>,
    slots: Option<SlotWrites<'c>>,
}

/// Where a chunk's time went, summed over its parts (for the debug line).
#[derive(Default)]
struct Spent {
    claim_us: u64,
    slots_us: u64,
    lock_wait_us: u64,
    wait_us: u64,
    commit_us: u64,
}

impl StoreChunk<'_> {
    /// Stores `items` (at most `copy.chunk()`) through `copy`, in parts of
    /// `per_part` groups: claims T1 slots for a part (where no group is
    /// named twice in the chunk) and launches its copy, then waits for the
    /// part before and commits it, so one part's claims overlap the copy
    /// of the one before; then writes what landed in staging into T1 and
    /// tells the mount of the change. A result an entry.
    fn run(&self, items: &[Item], copy: &mut Store) -> Vec<Result<(), CascadeError>> {
        let (s, work, gb, shape, ticket) = (self.s, self.work, self.gb, self.shape, self.ticket);
        let cascade = &s.ctl.cascade;
        let t0 = Instant::now();
        let groups: Vec<GroupIndex> = items.iter().map(|it| it.g).collect();
        let distinct = all_distinct(&groups);
        let distinct_us = t0.elapsed().as_micros() as u64;
        let mut rs: Vec<Result<(), CascadeError>> = (0..items.len()).map(|_| Ok(())).collect();
        // Entries that went through staging (their copy done).
        let mut staged: Vec<usize> = Vec::new();
        let mut spent = Spent::default();
        let mut failed: Option<String> = None;
        let mut flight: std::collections::VecDeque<InFlight> = Default::default();
        let mut table_at = 0;
        let n_parts = items.len().div_ceil(self.per_part);
        for (part, at) in (0..items.len())
            .step_by(self.per_part)
            .map(|a| a..(a + self.per_part).min(items.len()))
            .enumerate()
        {
            if let Some(e) = &failed {
                fail(&mut rs[at], e);
                continue;
            }
            let ts = Instant::now();
            let slots = distinct.then(|| cascade.claim_slots(&groups[at.clone()], true));
            spent.slots_us += ts.elapsed().as_micros() as u64;
            spent.lock_wait_us += slots.as_ref().map_or(0, |w| w.waited().as_micros() as u64);
            let direct: Vec<Option<u64>> = (0..at.len())
                .map(|k| slots.as_ref().and_then(|w| w.device_addr(k)))
                .collect();
            // Admission made every region of a CUDA batch a CUDA region
            // and checked offset + group_bytes inside it.
            let slot_at = |k: usize| direct[k].unwrap_or(copy.staging_addr(at.start + k));
            let part_items = &items[at.clone()];
            let mut descs: Vec<Descriptor> =
                pieces(work, part_items, gb, shape.piece(), slot_at, false).collect();
            in_host_order(&mut descs, shape.unit, false);
            staged.extend(at.clone().filter(|&i| direct[i - at.start].is_none()));
            spent.claim_us += ts.elapsed().as_micros() as u64;
            // SAFETY: every descriptor names a checked range of a live
            // CUDA region (the batch holds it) and either a staging slot
            // or a T1 slot `slots` holds until after the part is waited
            // for (write-locked, or a spare nobody else can reach); the
            // table's places from `table_at` on are this chunk's next.
            match unsafe { copy.enqueue(part % copy.parts(), table_at, &descs) } {
                Ok(()) => flight.push_back(InFlight { part, at, slots }),
                // Dropping `slots` gives back the claimed slots.
                Err(e) => {
                    fail(&mut rs[at], &e);
                    failed = Some(e);
                }
            }
            table_at += descs.len();
            // The part before this one: its copy ran while this one claimed.
            if flight.len() > 1 {
                let f = flight.pop_front().expect("two in flight");
                self.settle(f, copy, &mut rs, &mut spent, &mut failed);
            }
        }
        while let Some(f) = flight.pop_front() {
            self.settle(f, copy, &mut rs, &mut spent, &mut failed);
        }
        if let Some(e) = &failed {
            // Parts committed before the failure landed; the rest failed.
            tracing::error!("GPU store of ticket {ticket} failed: {e}");
        }
        let tw = Instant::now();
        let staged: Vec<usize> = staged.into_iter().filter(|&i| rs[i].is_ok()).collect();
        let gs: Vec<GroupIndex> = staged.iter().map(|&i| groups[i]).collect();
        let bytes: Vec<&[u8]> = staged.iter().map(|&i| copy.staged(i)).collect();
        for (&i, r) in staged
            .iter()
            .zip(write_staged(cascade, &gs, &bytes, distinct))
        {
            rs[i] = r;
        }
        let write_us = tw.elapsed().as_micros() as u64;
        let t3 = Instant::now();
        s.changed(&groups, &rs);
        // Where a chunk's time goes, summed over its parts: claiming T1
        // slots (looking for groups named twice once, then each part's
        // `claim_slots`, of that its wait for the state lock, and its
        // descriptors), waiting for the copies (the part's copy less what
        // ran while the next part claimed), committing the claimed slots,
        // writing staged groups into T1, telling the mount of the change.
        tracing::debug!(
            ticket,
            n = items.len(),
            parts = n_parts,
            in_place = items.len() - staged.len(),
            queued_us = self.queued_us,
            distinct_us,
            claim_us = spent.claim_us,
            slots_us = spent.slots_us,
            lock_wait_us = spent.lock_wait_us,
            wait_us = spent.wait_us,
            commit_us = spent.commit_us,
            write_us,
            changed_us = t3.elapsed().as_micros() as u64,
            total_us = t0.elapsed().as_micros() as u64,
            "GPU store: chunk done"
        );
        rs
    }

    /// Waits for part `f`'s copy and commits its slots; a copy that failed
    /// (or any after a failure) is not committed: its slots are given
    /// back, its entries marked failed, and `failed` set.
    fn settle<'c>(
        &self,
        f: InFlight<'c>,
        copy: &Store,
        rs: &mut [Result<(), CascadeError>],
        spent: &mut Spent,
        failed: &mut Option<String>,
    ) {
        let tw = Instant::now();
        let r = copy.wait(f.part % copy.parts());
        let tc = Instant::now();
        spent.wait_us += (tc - tw).as_micros() as u64;
        match (r, failed.is_some()) {
            (Ok(()), false) => {
                if let Some(w) = f.slots {
                    w.commit();
                }
            }
            // A copy after a failed one is not trusted either: dropping
            // f.slots gives back the claimed slots (nothing lost: each
            // group's old bytes stay in T1 or the backing).
            (r, _) => {
                if let Err(e) = r {
                    failed.get_or_insert(e);
                }
                fail(&mut rs[f.at], failed.as_deref().unwrap_or_default());
            }
        }
        spent.commit_us += tc.elapsed().as_micros() as u64;
    }
}

/// Marks every entry of `rs` failed by a GPU copy's error `e`.
fn fail(rs: &mut [Result<(), CascadeError>], e: &str) {
    for r in rs {
        *r = Err(CascadeError::RegionFault(format!("GPU copy failed: {e}")));
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

    /// A part is STORE_PART_GROUPS groups, at most the chunk; `off` (0)
    /// is the whole chunk.
    #[test]
    fn parts_are_sized_in_groups() {
        let chunk_4k = STORE_CHUNK / 4096;
        assert_eq!(groups_a_part(STORE_PART_GROUPS, chunk_4k), 1024);
        // 16 KiB groups: a chunk of 1024, one part.
        assert_eq!(groups_a_part(STORE_PART_GROUPS, STORE_CHUNK / 16384), 1024);
        // A small ticket: one part.
        assert_eq!(groups_a_part(STORE_PART_GROUPS, 100), 100);
        assert_eq!(groups_a_part(1, 100), 1);
        assert_eq!(groups_a_part(0, chunk_4k), chunk_4k);
        assert_eq!(groups_a_part(0, 0), 1);
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
