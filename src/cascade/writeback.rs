//! Write-back of dirty slots to the backing, and durability.
//!
//! A write-back never goes to a group's durable copy, so the last synced
//! bytes survive a crash mid-write; a copy becomes durable only after a
//! data-file sync that began after it was recorded and only if the group
//! was not written back again since (its generation still matches). Until
//! then the group waits in `unsynced`, which `bound_unsynced` keeps bounded
//! by syncing. Backing I/O of one group is serialised by its stripe, so a
//! miss never reads a group's data and metadata halfway through its
//! write-back; slot locks are taken before stripes, stripes in order.

use super::slots::Pin;
use super::{Cascade, CascadeError, GroupMeta, NO_GROUP, STRIPES, SYNC_BATCH, SlotId, SlotState};
use crate::geometry::GroupIndex;
use crate::tier::{WriteOp, copy_index};
use std::sync::atomic::Ordering;
use std::time::Duration;

impl Cascade {
    /// The copy a write-back of a group with metadata `m` goes to: never
    /// the durable one, so the last synced bytes survive a crash mid-write.
    fn target_copy(m: &GroupMeta) -> u8 {
        match m.durable {
            Some(d) => 1 - d,
            None => 0,
        }
    }

    /// The generation a group with metadata `m` has once written back
    /// (kept mod 2^32 in the metadata).
    fn next_generation(m: &GroupMeta) -> u64 {
        (m.generation + 1) & 0xffff_ffff
    }

    /// Writes `bytes` (a slot) back as `g` and records its checksum.
    /// The caller holds the slot's lock; this takes `g`'s stripe.
    pub(super) fn write_back(&self, g: GroupIndex, bytes: &[u8]) -> Result<(), CascadeError> {
        let _io = self.stripe(g);
        let m = self.meta.get(g.0);
        let target = Self::target_copy(&m);
        if let Err(e) = self
            .tier
            .write_one(copy_index(g, target), bytes, Self::next_generation(&m))
        {
            self.counters
                .write_back_failures
                .fetch_add(1, Ordering::Relaxed);
            return Err(e.into());
        }
        self.record_written(g, bytes, target, &m);
        Ok(())
    }

    /// Records a write-back of `bytes` to copy `target` of `g` (whose
    /// metadata was `old`). The caller holds `g`'s stripe.
    fn record_written(&self, g: GroupIndex, bytes: &[u8], target: u8, old: &GroupMeta) {
        let new = GroupMeta {
            written: true,
            cur: target,
            durable: old.durable,
            durable_crc: old.durable_crc,
            epoch: self.epoch,
            crc: crc32c::crc32c(&bytes[..self.layout.group_bytes() as usize]),
            generation: Self::next_generation(old),
        };
        self.meta.set(g.0, new);
        {
            let mut u = self.unsynced.lock();
            u.insert(g, new.generation);
            if u.len() > self.unsynced_limit {
                self.unsynced_over.store(true, Ordering::Relaxed);
            }
        }
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        self.counters
            .flushed_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.counters
            .backing_write_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
    }

    /// After a successful sync of the data file: the newest copies of
    /// `groups` (those not written back again since) become durable.
    fn mark_durable(&self, groups: &[(GroupIndex, u64)]) {
        for &(g, generation) in groups {
            let _io = self.stripe(g);
            let m = self.meta.get(g.0);
            if m.written && m.generation == generation {
                self.meta.set(
                    g.0,
                    GroupMeta {
                        durable: Some(m.cur),
                        durable_crc: m.crc,
                        ..m
                    },
                );
            }
        }
    }

    /// Syncs the data file, then marks `taken` (write-backs recorded
    /// before the sync began) durable; on failure they stay unsynced.
    fn sync_taken(&self, taken: Vec<(GroupIndex, u64)>) -> Result<(), CascadeError> {
        if let Err(e) = self.tier.sync() {
            let mut u = self.unsynced.lock();
            for (g, generation) in taken {
                u.entry(g).or_insert(generation);
            }
            return Err(e.into());
        }
        self.mark_durable(&taken);
        Ok(())
    }

    /// Keeps the list of write-backs awaiting a sync bounded: past
    /// `unsynced_limit` groups (a long run of evictions with no fsync or
    /// sync), the data file is synced and they become durable. Called with
    /// no lock held.
    pub(super) fn bound_unsynced(&self) {
        if !self.unsynced_over.swap(false, Ordering::Relaxed) {
            return;
        }
        let taken: Vec<(GroupIndex, u64)> = std::mem::take(&mut *self.unsynced.lock())
            .into_iter()
            .collect();
        if let Err(e) = self.sync_taken(taken) {
            tracing::warn!("a background sync of write-backs failed: {e}; they stay unsynced");
        }
    }

    /// Makes group `g` durable: writes it back if dirty, then syncs the
    /// backing data and `g`'s metadata record.
    pub fn flush(&self, g: GroupIndex) -> Result<(), CascadeError> {
        self.check_index(g)?;
        if let Some(pin) = self.pin_resident(g, false) {
            let _r = self.slots[pin.slot.0 as usize].lock.read();
            if self.holds(pin.slot, g)
                && self.slots[pin.slot.0 as usize]
                    .dirty
                    .load(Ordering::Acquire)
            {
                // SAFETY: we hold the slot's read lock (writers are excluded).
                self.write_back(g, unsafe { self.slot_bytes(pin.slot) })?;
                self.clear_dirty(pin.slot);
            }
        }
        // An evicted group was written back without a sync: sync regardless.
        let taken: Vec<(GroupIndex, u64)> = self
            .unsynced
            .lock()
            .remove(&g)
            .map(|generation| (g, generation))
            .into_iter()
            .collect();
        self.sync_taken(taken)?;
        self.meta.flush_one(g.0).map_err(CascadeError::MetaSync)
    }

    // Kept whole: its lock order (sync lock, slot locks, stripes in order) shows in one place.
    /// Writes back every dirty group and makes everything durable. Returns
    /// the first error; groups that failed stay dirty in T1.
    pub fn sync_all(&self) -> Result<(), CascadeError> {
        let _one = self.sync_lock.lock();
        let mut first_err: Option<CascadeError> = None;
        let pinned: Vec<Pin<'_>> = loop {
            let st = self.state.lock();
            let busy = (0..self.n_slots as usize).any(|s| {
                st.slot_state[s] == SlotState::Evicting
                    && self.slots[s].dirty.load(Ordering::Acquire)
            });
            if busy {
                // An eviction is writing a group back; let it finish (or fail
                // and leave the group dirty for us).
                drop(st);
                std::thread::sleep(Duration::from_micros(100));
                continue;
            }
            break (0..self.n_slots)
                .filter(|&s| {
                    st.slot_state[s as usize] == SlotState::Resident
                        && self.slots[s as usize].dirty.load(Ordering::Acquire)
                })
                .map(|s| self.pin_now(SlotId(s)))
                .collect();
        };
        for chunk in pinned.chunks(SYNC_BATCH) {
            // Slot locks first, then stripes in order: never the other way
            // round, so no thread can wait on us while we wait on it.
            let guards: Vec<_> = chunk
                .iter()
                .map(|p| self.slots[p.slot.0 as usize].lock.read())
                .collect();
            let work: Vec<(SlotId, GroupIndex)> = chunk
                .iter()
                .filter(|p| self.slots[p.slot.0 as usize].dirty.load(Ordering::Acquire))
                .map(|p| {
                    (
                        p.slot,
                        GroupIndex(self.slots[p.slot.0 as usize].tag.load(Ordering::Acquire)),
                    )
                })
                .filter(|(_, g)| g.0 != NO_GROUP)
                .collect();
            let mut stripe_ids: Vec<usize> = work
                .iter()
                .map(|(_, g)| (g.0 % STRIPES as u64) as usize)
                .collect();
            stripe_ids.sort_unstable();
            stripe_ids.dedup();
            let _io: Vec<_> = stripe_ids.iter().map(|&i| self.stripes[i].lock()).collect();
            // We hold the stripes: the metadata cannot change under us.
            let metas: Vec<GroupMeta> = work.iter().map(|&(_, g)| self.meta.get(g.0)).collect();
            let ops: Vec<WriteOp<'_>> = work
                .iter()
                .zip(&metas)
                .map(|(&(s, g), m)| WriteOp {
                    index: copy_index(g, Self::target_copy(m)),
                    // SAFETY: we hold s's read lock (guards) until after the batch.
                    buf: unsafe { self.slot_bytes(s) },
                    generation: Self::next_generation(m),
                })
                .collect();
            let results = self.tier.write_batch(&ops);
            for (((&(s, g), op), r), m) in work.iter().zip(&ops).zip(results).zip(&metas) {
                match r {
                    Ok(()) => {
                        self.record_written(g, op.buf, Self::target_copy(m), m);
                        self.clear_dirty(s);
                    }
                    Err(e) => {
                        self.counters
                            .write_back_failures
                            .fetch_add(1, Ordering::Relaxed);
                        first_err.get_or_insert(e.into());
                    }
                }
            }
            drop(guards);
        }
        drop(pinned);
        if let Some(e) = first_err {
            return Err(e);
        }
        let taken: Vec<(GroupIndex, u64)> = std::mem::take(&mut *self.unsynced.lock())
            .into_iter()
            .collect();
        self.sync_taken(taken)?;
        self.meta.flush_all().map_err(CascadeError::MetaSync)
    }
}
