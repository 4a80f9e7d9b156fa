//! Claiming T1 slots for groups, and giving them up.
//!
//! A claim takes a free slot nobody pins, or a victim the policy picks
//! among resident slots with no pin and no lock holder, and returns it
//! mapped, pinned and write-locked. A dirty victim is marked `Evicting`
//! and written back outside the state lock before its slot is reused; if
//! that write fails it stays resident and dirty, and the claim takes a
//! clean victim instead, or, with none, gives the caller the error. A
//! fill that fails abandons its claim: the slot goes back to the free list
//! and the group reads from the backing as before. `claim_slots` hands out
//! only free or clean slots to write (a dirty group gets a free slot, and
//! its own slot takes that slot's memory on commit) and only try-locks
//! them, so holding many cannot deadlock and dropping them after a failed
//! copy loses nothing.

use super::slots::Pin;
use super::{Cascade, CascadeError, NO_GROUP, SlotId, SlotState, State};
use crate::geometry::GroupIndex;
use parking_lot::RwLockWriteGuard;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Slots held for writing whole groups in place, by a device or by the
/// caller (see `Cascade::claim_slots`): each write-locked until
/// `commit`, or dropped, which undoes the claims.
pub struct SlotWrites<'a> {
    c: &'a Cascade,
    /// For each batch entry, its index into `held`.
    of: Vec<Option<u32>>,
    held: Vec<Held<'a>>,
    /// How long the claim waited for the state lock (others' claims).
    waited: Duration,
}

/// One slot `claim_slots` holds for group `g`.
struct Held<'a> {
    g: GroupIndex,
    /// The slot written: `g`'s own, or (with `spare`) a fresh one.
    slot: SlotId,
    /// `g`'s own slot, write-locked (by `guard`): the slot written, or
    /// where `g` was dirty, the slot whose old bytes (T1's only copy) stay
    /// untouched until `commit` swaps in the spare's memory. Not pinned:
    /// it is mapped and resident, and a locked resident slot is never a
    /// victim; no pin, no locked instruction to add and drop one.
    own: SlotId,
    guard: RwLockWriteGuard<'a, ()>,
    /// `slot` is a spare for a copy on write: a free slot taken off the
    /// free list, seen unpinned under the state lock and never mapped, so
    /// nobody else can reach it and it is neither pinned nor locked (two
    /// locked instructions fewer to claim it, two to let it go).
    spare: bool,
}

impl SlotWrites<'_> {
    /// Whether entry `i` has a slot here (else the caller writes it through
    /// `write_groups`).
    pub fn has(&self, i: usize) -> bool {
        self.of[i].is_some()
    }

    /// How many entries have a slot.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// How long the claim waited for the cascade's state lock, held by
    /// other claims and lookups meanwhile (where a GPU store's time goes).
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// The device address of entry `i`'s slot (T1 pinned and mapped).
    pub fn device_addr(&self, i: usize) -> Option<u64> {
        let h = self.of[i]? as usize;
        self.c.slot_device_ptr(self.held[h].slot)
    }

    /// Entry `i`'s group bytes, for the caller to fill.
    pub fn bytes_mut(&mut self, i: usize) -> Option<&mut [u8]> {
        let h = self.of[i]? as usize;
        let gb = self.c.layout.group_bytes() as usize;
        // SAFETY: we hold the slot's write lock (or it is a spare nobody
        // else can reach) for as long as self lives, and the &mut self
        // borrow makes this the only view of it.
        Some(&mut unsafe { self.c.slot_bytes_mut(self.held[h].slot) }[..gb])
    }

    /// Every held slot was written in full: they become their groups'
    /// (dirty) contents. A dirty group's slot takes the fresh slot's
    /// memory, and the fresh slot (with the old bytes, nobody's now) goes
    /// back to the free list.
    pub fn commit(mut self) {
        let c = self.c;
        let n = self.held.len() as u64;
        // All marked while every slot is still held.
        c.set_dirty_all(self.held.iter().map(|h| h.own));
        let mut spare = Vec::new();
        for h in self.held.drain(..) {
            if h.spare {
                c.swap_memory(h.own, h.slot);
                spare.push(h.slot);
            }
            c.slots[h.own.0 as usize]
                .claimed
                .store(false, Ordering::Release);
            drop(h.guard);
        }
        c.free_spare(spare);
        // Claims waiting for a slot to become evictable wake now (no pin
        // was dropped to wake them).
        c.changed.notify_all();
        c.counters
            .t1_write_bytes
            .fetch_add(n * c.layout.group_bytes(), Ordering::Relaxed);
    }
}

impl Drop for SlotWrites<'_> {
    /// Not committed (the copy failed): the held slots hold unknown bytes.
    /// Each was free or held a clean group, so it goes back to the free
    /// list and its group reads from the backing, as before; a dirty
    /// group's own slot was never written: nothing lost.
    fn drop(&mut self) {
        let c = self.c;
        let mut spare = Vec::new();
        for h in self.held.drain(..) {
            c.slots[h.own.0 as usize]
                .claimed
                .store(false, Ordering::Release);
            if h.spare {
                spare.push(h.slot);
            } else {
                c.abandon_slot(h.g, h.own, h.guard);
            }
        }
        c.free_spare(spare);
        c.changed.notify_all();
    }
}

pub(super) enum Claim<'a> {
    /// The group got this slot, mapped, pinned and write-locked; the caller
    /// fills it.
    Got(Pin<'a>, RwLockWriteGuard<'a, ()>),
    /// Someone else mapped the group meanwhile: retry as a hit.
    Mapped,
}

impl Cascade {
    // Kept whole: every retry of the loop re-takes the state lock and looks afresh.
    /// Finds a slot for `g`: a free one, or a victim (written back first if
    /// dirty). Returns it mapped to `g`, pinned and write-locked.
    pub(super) fn claim(&self, g: GroupIndex) -> Result<Claim<'_>, CascadeError> {
        // Set once a dirty victim's write-back failed (the backing is full
        // or unreachable): from then on only clean victims are taken, and
        // with none left that error is the caller's. Without this, one
        // group that cannot be written back would fail every write while
        // T1 still holds clean slots that could be reused at no risk.
        let mut failed: Option<CascadeError> = None;
        loop {
            let mut st = self.state.lock();
            if st.map.contains_key(&g) {
                return Ok(Claim::Mapped);
            }
            self.take_spares(&mut st);
            if st.free.is_empty() {
                self.adopt_chunks(&mut st);
            }
            // A free slot nobody pins: nobody holds or waits for its lock.
            if let Some(pos) = st
                .free
                .iter()
                .rposition(|s| self.slots[s.0 as usize].pins.load(Ordering::Acquire) == 0)
            {
                let s = st.free[pos];
                if let Some(guard) = self.slots[s.0 as usize].lock.try_write() {
                    st.free.swap_remove(pos);
                    self.install(&mut st, s, g);
                    return Ok(Claim::Got(self.pin_now(s), guard));
                }
            }
            let slots = &self.slots;
            let victim = {
                let State {
                    policy, slot_state, ..
                } = &mut *st;
                let clean_only = failed.is_some();
                policy.victim(&mut |s| {
                    let m = &slots[s.0 as usize];
                    slot_state[s.0 as usize] == SlotState::Resident
                        && m.pins.load(Ordering::Acquire) == 0
                        && !m.lock.is_locked()
                        && !(clean_only && m.dirty.load(Ordering::Acquire))
                })
            };
            if victim.is_none()
                && let Some(e) = failed.take()
            {
                return Err(e);
            }
            let Some(v) = victim else {
                // Every slot is pinned or being evicted: wait for a change.
                self.changed.wait_for(&mut st, Duration::from_millis(1));
                continue;
            };
            let Some(guard) = self.slots[v.0 as usize].lock.try_write() else {
                continue;
            };
            let old = GroupIndex(self.slots[v.0 as usize].tag.load(Ordering::Acquire));
            if !self.slots[v.0 as usize].dirty.load(Ordering::Acquire) {
                st.map.remove(&old);
                st.policy.remove(v);
                self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                self.install(&mut st, v, g);
                return Ok(Claim::Got(self.pin_now(v), guard));
            }
            // Dirty victim: write it back outside the state lock.
            let pin = self.pin_now(v);
            st.slot_state[v.0 as usize] = SlotState::Evicting;
            drop(st);
            // SAFETY: we hold v's write lock (guard).
            let r = self.write_back(old, unsafe { self.slot_bytes(v) });
            let mut st = self.state.lock();
            if let Err(e) = r {
                st.slot_state[v.0 as usize] = SlotState::Resident;
                drop(guard);
                drop(st);
                drop(pin);
                failed = Some(e);
                continue;
            }
            self.clear_dirty(v);
            st.map.remove(&old);
            st.policy.remove(v);
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
            if st.map.contains_key(&g) {
                self.free_slot(&mut st, v);
                drop(guard);
                drop(st);
                drop(pin);
                self.changed.notify_all();
                return Ok(Claim::Mapped);
            }
            self.install(&mut st, v, g);
            return Ok(Claim::Got(pin, guard));
        }
    }

    /// Maps `g` to `s`, whose write lock the caller holds.
    fn install(&self, st: &mut State, s: SlotId, g: GroupIndex) {
        self.slots[s.0 as usize].tag.store(g.0, Ordering::Release);
        st.map.insert(g, s);
        st.slot_state[s.0 as usize] = SlotState::Resident;
        st.policy.insert(s);
    }

    /// Puts `s`, unmapped and untracked, on the free list; the caller holds
    /// its write lock.
    fn free_slot(&self, st: &mut State, s: SlotId) {
        self.slots[s.0 as usize]
            .tag
            .store(NO_GROUP, Ordering::Release);
        st.slot_state[s.0 as usize] = SlotState::Free;
        st.free.push(s);
    }

    /// Gives back spare slots a copy on write took (never mapped, now let
    /// go): to `spares`, for the next claim to put on the free list.
    fn free_spare(&self, spare: Vec<SlotId>) {
        if !spare.is_empty() {
            self.spares.lock().extend(spare);
        }
    }

    /// Moves the spares given back since onto the free list (its end, so
    /// they, warm in cache, are taken first).
    fn take_spares(&self, st: &mut State) {
        let mut sp = self.spares.lock();
        st.free.append(&mut sp);
    }

    /// Undoes a claim whose fill failed: the slot goes back to the free list.
    pub(super) fn abandon(&self, g: GroupIndex, pin: Pin<'_>, guard: RwLockWriteGuard<'_, ()>) {
        self.abandon_slot(g, pin.slot, guard);
        drop(pin);
    }

    /// `abandon` of slot `s`, write-locked by `guard` (pinned or not): it
    /// is unlocked before the state lock goes, so nobody finds it free and
    /// still locked.
    fn abandon_slot(&self, g: GroupIndex, s: SlotId, guard: RwLockWriteGuard<'_, ()>) {
        let mut st = self.state.lock();
        st.map.remove(&g);
        st.policy.remove(s);
        self.free_slot(&mut st, s);
        drop(guard);
    }

    /// Slots to write whole groups into in place (a GPU STORE writes them
    /// with one kernel launch, no host copy). Entry i gets a slot if its
    /// group is in T1 and clean (its own slot), or not in T1 while a free
    /// slot is left (claimed and mapped to it), or in T1 and dirty while a
    /// free slot is left (copy on write: the caller writes the free slot,
    /// the group's own slot, T1's only copy of its bytes, is held
    /// untouched, and `commit` swaps their memory); with `device`, only
    /// slots T1 has device-mapped.
    /// A busy slot (only try-locks are taken, so holding many can never
    /// deadlock) or no free slot: no slot, and the caller writes that
    /// entry through `write_groups`. Because every group's old bytes stay
    /// in T1 or the backing, dropping the claims after a failed copy loses
    /// nothing. `groups` must be distinct and in range.
    ///
    /// Under the state lock: the look ups, the free slots (locked and
    /// mapped for new groups; spares for groups that look dirty) and the
    /// policy's updates. The slots of groups found in T1 are locked after
    /// it, each checked under its lock to still hold its group, and its
    /// dirty bit read there: so four stores in flight take turns on the
    /// state lock for less, and lock their groups' slots side by side.
    pub fn claim_slots(&self, groups: &[GroupIndex], device: bool) -> SlotWrites<'_> {
        let mut w = SlotWrites {
            c: self,
            of: vec![None; groups.len()],
            held: Vec::with_capacity(groups.len()),
            waited: Duration::ZERO,
        };
        let mut fresh = Vec::new();
        // Groups found in T1: (entry, own slot, a spare if it looked dirty).
        let mut found_at: Vec<(u32, SlotId, Option<SlotId>)> = Vec::with_capacity(groups.len());
        {
            let asked = std::time::Instant::now();
            let mut st = self.state.lock();
            w.waited = asked.elapsed();
            self.take_spares(&mut st);
            if st.free.len() < groups.len() {
                self.adopt_chunks(&mut st);
            }
            // Every lookup first, then the free slots' locks on slot words
            // warmed beforehand, then the map and policy updates, plain
            // stores whose misses overlap: no locked instruction (a full
            // barrier on x86) stands between cache misses.
            let found: Vec<Option<SlotId>> = st.map.get_many(groups);
            // The slots taken below: the next free one for a new group or
            // one that looks dirty.
            let looks_dirty = |s: SlotId| self.slots[s.0 as usize].dirty.load(Ordering::Relaxed);
            let mut next_free = st.free.iter().rev();
            self.warm_slots(found.iter().filter_map(|&at| match at {
                Some(s) if !looks_dirty(s) => None,
                _ => next_free.next().copied(),
            }));
            let mut free = FreeTaker {
                c: self,
                free: &st.free,
                taken: 0,
                ok: true,
                device,
            };
            for (i, (&g, at)) in groups.iter().zip(found).enumerate() {
                debug_assert!(g.0 < self.layout.group_count());
                match at {
                    Some(s) => {
                        if st.slot_state[s.0 as usize] != SlotState::Resident {
                            continue;
                        }
                        // Settled under the slot's lock, after: a spare
                        // taken here for a group that turns out clean
                        // goes back.
                        let spare = match looks_dirty(s) {
                            true => match free.take_spare() {
                                None => continue,
                                spare => spare,
                            },
                            false => None,
                        };
                        found_at.push((i as u32, s, spare));
                    }
                    None => {
                        let Some((own, guard)) = free.take() else {
                            continue;
                        };
                        fresh.push(own);
                        w.of[i] = Some(w.held.len() as u32);
                        w.held.push(Held {
                            g,
                            slot: own,
                            own,
                            guard,
                            spare: false,
                        });
                    }
                }
            }
            let taken = free.taken;
            let left = st.free.len() - taken;
            st.free.truncate(left);
            for h in &w.held {
                self.install(&mut st, h.own, h.g);
                self.slots[h.own.0 as usize]
                    .claimed
                    .store(true, Ordering::Release);
            }
            // A dirty group's spare stays unmapped: its own slot is the one
            // touched.
            for &(_, s, _) in &found_at {
                st.policy.touch(s);
            }
        }
        let spares = self.lock_found(groups, device, &found_at, &mut w);
        let gb = self.layout.group_bytes() as usize;
        if self.layout.stride() as usize > gb {
            let spare = w.held.iter().filter(|h| h.spare);
            for s in fresh.into_iter().chain(spare.map(|h| h.slot)) {
                // SAFETY: we hold s's write lock (in w.held), or s is a
                // spare nobody else can reach.
                let slot = unsafe { self.slot_bytes_mut(s) };
                slot[gb..].fill(0);
            }
        }
        self.free_spare(spares);
        w
    }

    /// `claim_slots`' second half, with the state lock gone: write-locks
    /// the slots of the groups it found in T1, each only if it still holds
    /// its group (nothing held it since the look up), and settles each
    /// under its lock: dirty, a copy on write into the spare taken for it
    /// (none taken: no slot); clean, written in place (its spare unused).
    /// Returns the spares not used.
    fn lock_found<'a>(
        &'a self,
        groups: &[GroupIndex],
        device: bool,
        found_at: &[(u32, SlotId, Option<SlotId>)],
        w: &mut SlotWrites<'a>,
    ) -> Vec<SlotId> {
        let mut unused = Vec::new();
        for k in 0..found_at.len() {
            // Each try-lock is a full barrier: the slot a few entries on is
            // asked for now, so its miss overlaps the locks between.
            if let Some(&(_, a, _)) = found_at.get(k + 16) {
                super::slotmap::prefetch(&self.slots[a.0 as usize]);
            }
            let (i, s, spare) = found_at[k];
            let g = groups[i as usize];
            let m = &self.slots[s.0 as usize];
            let Some(guard) = m.lock.try_write().filter(|_| self.holds(s, g)) else {
                unused.extend(spare);
                continue;
            };
            // Read under the write lock: a writer may have made the group
            // dirty, or a write-back clean, since the look up, and a group
            // dirty in T1 is never written in place (a failed copy would
            // lose T1's only copy of it).
            let dirty = m.dirty.load(Ordering::Acquire);
            let slot = match (dirty, spare) {
                (true, Some(spare)) => spare,
                (true, None) => continue,
                (false, _) if device && self.slot_device_ptr(s).is_none() => {
                    unused.extend(spare);
                    continue;
                }
                (false, _) => {
                    unused.extend(spare);
                    s
                }
            };
            m.claimed.store(true, Ordering::Release);
            w.of[i as usize] = Some(w.held.len() as u32);
            w.held.push(Held {
                g,
                slot,
                own: s,
                guard,
                spare: dirty,
            });
        }
        unused
    }
}

/// Takes free slots for `claim_slots` from the end of the free list, in
/// order, until one is pinned, busy or (for a device) not device-mapped.
struct FreeTaker<'a, 'f> {
    c: &'a Cascade,
    free: &'f [SlotId],
    taken: usize,
    ok: bool,
    device: bool,
}

impl<'a> FreeTaker<'a, '_> {
    /// The next free slot if it can be taken: unpinned (so, under the
    /// state lock, nobody holds or waits for its lock) and, for a device,
    /// device-mapped; else None, and none after.
    fn next(&mut self) -> Option<SlotId> {
        let &s = self.free.iter().rev().nth(self.taken)?;
        let c = self.c;
        if !self.ok
            || c.slots[s.0 as usize].pins.load(Ordering::Acquire) != 0
            || (self.device && c.slot_device_ptr(s).is_none())
        {
            self.ok = false;
            return None;
        }
        Some(s)
    }

    /// The next free slot, write-locked (to be mapped), or None (and none
    /// after) where it is pinned, busy or has no device mapping.
    fn take(&mut self) -> Option<(SlotId, RwLockWriteGuard<'a, ()>)> {
        let s = self.next()?;
        let Some(guard) = self.c.slots[s.0 as usize].lock.try_write() else {
            self.ok = false;
            return None;
        };
        self.taken += 1;
        Some((s, guard))
    }

    /// The next free slot as a spare (see `Held::spare`): off the free
    /// list, neither pinned nor locked; None (and none after) as `next`.
    fn take_spare(&mut self) -> Option<SlotId> {
        let s = self.next()?;
        self.taken += 1;
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cascade::slots::tests::two_resident;

    /// `claim_slots`' second half settles each group found in T1 under its
    /// slot's lock: a slot reused since the look up is let go (and the
    /// spare taken for it given back); a dirty group is copied on write
    /// into its spare, or left to the caller without one; a clean group is
    /// written in place, its spare given back.
    #[test]
    fn a_claim_settles_found_groups_under_their_slots_locks() {
        let (c, s0, s1) = two_resident();
        let (g0, g1) = (GroupIndex(0), GroupIndex(1));
        let spare = || c.state.lock().free.pop().unwrap();
        let writes = |n: usize| SlotWrites {
            c: &c,
            of: vec![None; n],
            held: Vec::new(),
            waited: Duration::ZERO,
        };
        let unlocked = |s: SlotId| !c.slots[s.0 as usize].lock.is_locked();

        // Group 0 looked up in slot 1 (reused since): let go.
        let sp = spare();
        let mut w = writes(1);
        let unused = c.lock_found(&[g0], false, &[(0, s1, Some(sp))], &mut w);
        assert_eq!((w.held(), unused), (0, vec![sp]));
        assert!(unlocked(s1) && unlocked(s0));

        // Dirty, with a spare: a copy on write into it; without: no slot.
        let mut w = writes(2);
        let unused = c.lock_found(
            &[g0, g1],
            false,
            &[(0, s0, Some(sp)), (1, s1, None)],
            &mut w,
        );
        assert!(unused.is_empty());
        assert!(w.has(0) && !w.has(1));
        assert_eq!(
            (w.held[0].slot, w.held[0].own, w.held[0].spare),
            (sp, s0, true)
        );
        assert!(unlocked(s1));
        drop(w); // not committed: the spare goes to `spares`, slot 0 is let go
        assert!(unlocked(s0));
        assert_eq!(*c.spares.lock(), vec![sp]);

        // Clean (written back), with a spare taken as it looked dirty: in
        // place, the spare given back.
        c.sync_all().unwrap();
        let mut w = writes(1);
        let unused = c.lock_found(&[g1], false, &[(0, s1, Some(sp))], &mut w);
        assert_eq!(unused, vec![sp]);
        assert_eq!(
            (w.held[0].slot, w.held[0].own, w.held[0].spare),
            (s1, s1, false)
        );
        assert!(c.slots[s1.0 as usize].claimed.load(Ordering::Acquire));
        drop(w);
    }
}
