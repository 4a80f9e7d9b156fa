//! The write paths: partial writes and whole-group batch writes.
//!
//! Writes go into T1 (write-back): a resident group is written under its
//! slot's write lock and marked dirty; a group not in T1 is claimed, and a
//! partial write reads the rest of it from the backing first (a fill that
//! fails abandons the claim). Every public write ends with
//! `bound_unsynced`, called with no lock held.

use super::claim::Claim;
use super::{Cascade, CascadeError};
use crate::geometry::GroupIndex;
use std::sync::atomic::Ordering;

impl Cascade {
    /// Writes `data` into group `g` at `offset` (write-back: the group is
    /// dirty in T1 until evicted or flushed). A partial write of a group not
    /// in T1 reads the rest of it first.
    pub fn write(&self, g: GroupIndex, offset: u64, data: &[u8]) -> Result<(), CascadeError> {
        let r = self.write_inner(g, offset, data);
        self.bound_unsynced();
        r
    }

    /// Whole-group writes of many groups (a STORE batch), in batch order.
    /// The groups in T1 are found under one acquisition of the state lock
    /// and filled in place, each under its slot's write lock (one at a
    /// time, so no lock order arises); the rest go through `write`.
    /// `fill(i, dst)` puts group i's bytes into `dst` (group_bytes long)
    /// and returns Ok, or returns an error and leaves `dst` untouched.
    pub fn write_groups(
        &self,
        groups: &[GroupIndex],
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), CascadeError>,
    ) -> Vec<Result<(), CascadeError>> {
        if groups.is_empty() {
            // No turn on the state lock for nothing: a GPU store with
            // nothing staged (the usual case) waited ~0.3 ms here behind
            // other tickets' claims (4 KiB × 4096, H200, 2026-12-06).
            return Vec::new();
        }
        let gb = self.layout.group_bytes() as usize;
        let mut results: Vec<Result<(), CascadeError>> =
            groups.iter().map(|&g| self.check_index(g)).collect();
        // Each pin is dropped once its group is written; the misses wait
        // until then, so their claims never find T1 pinned full by us.
        let mut later = Vec::new();
        let mut written = 0u64;
        for (i, pin) in self.pin_resident_many(groups).into_iter().enumerate() {
            if results[i].is_err() {
                continue;
            }
            let Some(pin) = pin else {
                later.push(i);
                continue;
            };
            let _w = self.slots[pin.slot.0 as usize].lock.write();
            if !self.holds(pin.slot, groups[i]) {
                later.push(i); // its fill failed meanwhile
                continue;
            }
            // SAFETY: we hold the slot's write lock.
            let slot = unsafe { self.slot_bytes_mut(pin.slot) };
            match fill(i, &mut slot[..gb]) {
                Ok(()) => {
                    self.set_dirty(pin.slot);
                    written += gb as u64;
                }
                Err(e) => results[i] = Err(e),
            }
        }
        self.counters
            .t1_write_bytes
            .fetch_add(written, Ordering::Relaxed);
        let mut buf = vec![0u8; if later.is_empty() { 0 } else { gb }];
        for i in later {
            results[i] = fill(i, &mut buf).and_then(|()| self.write_inner(groups[i], 0, &buf));
        }
        self.bound_unsynced();
        results
    }

    fn write_inner(&self, g: GroupIndex, offset: u64, data: &[u8]) -> Result<(), CascadeError> {
        self.check_index(g)?;
        self.check_range(offset, data.len())?;
        let off = offset as usize;
        let gb = self.layout.group_bytes() as usize;
        loop {
            if let Some(pin) = self.pin_resident(g, true) {
                let _w = self.slots[pin.slot.0 as usize].lock.write();
                if !self.holds(pin.slot, g) {
                    continue; // evicted or abandoned meanwhile
                }
                self.set_dirty(pin.slot);
                // SAFETY: we hold the slot's write lock.
                let slot = unsafe { self.slot_bytes_mut(pin.slot) };
                slot[off..off + data.len()].copy_from_slice(data);
                self.counters
                    .t1_write_bytes
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                return Ok(());
            }
            let (pin, guard) = match self.claim(g)? {
                Claim::Mapped => continue,
                Claim::Got(p, w) => (p, w),
            };
            // SAFETY: we hold the slot's write lock.
            let slot = unsafe { self.slot_bytes_mut(pin.slot) };
            if off == 0 && data.len() == gb {
                slot[gb..].fill(0);
            } else {
                let r = {
                    let _io = self.stripe(g);
                    self.read_backing_locked(g, slot)
                };
                if let Err(e) = r {
                    self.abandon(g, pin, guard);
                    return Err(e);
                }
            }
            slot[off..off + data.len()].copy_from_slice(data);
            self.set_dirty(pin.slot);
            self.counters
                .t1_write_bytes
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            return Ok(());
        }
    }
}
