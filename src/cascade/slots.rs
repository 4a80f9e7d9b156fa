//! T1's memory and the pins on its slots.
//!
//! T1 is `HostBuf` chunks cut into `stride`-sized slots (aligned for
//! O_DIRECT, so write-back and fills go straight from and into slots); a
//! slot is reachable (on the free list) only once its chunk has arrived.
//! Copies run under a per-slot RwLock, taken by a thread that holds a pin
//! on the slot, or with a try-lock under the state lock on a free slot it
//! then maps (`claim_slots`), or with neither by a GPU restore or store (a
//! try-lock on the slot a look up found, checked under that lock to still
//! hold the group, let go at once where it does not); pins are only added
//! under the state lock. So under that lock a free slot with no pins has
//! no lock holder but, for a moment, such a restore's or store's (a
//! try-lock on it fails, and the claim takes another), and a resident slot
//! only with no pins and no lock holder may be chosen as a victim. A copy out of a slot
//! holds its read lock and a reuse needs its write lock, so a slot is
//! never overwritten under a reader. A holder of several slot locks that
//! waits for one takes those it waits for in ascending slot order, and a
//! writer never waits holding another slot's lock, so waits cannot form a
//! cycle.

use super::{Cascade, NO_GROUP, SlotId, SlotState, State};
use crate::geometry::GroupIndex;
use crate::gpu::HostBuf;
use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc;

/// T1's memory: chunks of slots, adopted as the background allocator
/// delivers them. A slot is reachable (on the free list) only once its
/// chunk's base is set, so `slot_ptr` never sees a missing chunk.
pub(super) struct Arena {
    pub(super) per_chunk: u32,
    pub(super) bases: Box<[AtomicPtr<u8>]>,
    /// Each chunk's device address (0: not arrived, or not device-mapped),
    /// stored before its slots become free.
    pub(super) dev_bases: Box<[AtomicU64]>,
    pub(super) owned: Mutex<Vec<HostBuf>>,
    pub(super) incoming: Mutex<Option<mpsc::Receiver<(usize, HostBuf)>>>,
    pub(super) ready_slots: AtomicU64,
}

/// One slot's words, kept together so that a claim, pin or copy of a
/// slot misses the cache once, not once an array: on a host whose last
/// level cache is far smaller than T1's metadata, each of 4096 scattered
/// slots a GPU ticket touches is a trip to DRAM per line.
#[repr(C, align(32))]
pub(super) struct SlotMeta {
    pub(super) lock: RwLock<()>,
    /// Group held; written only under the slot's write lock.
    pub(super) tag: AtomicU64,
    pub(super) pins: AtomicU32,
    /// The arena place whose memory the slot uses (its own at first). A
    /// store's commit swaps a dirty group's slot with a fresh one here,
    /// under both slots' write locks (see `claim_slots`); anyone using a
    /// slot's bytes holds its lock, so never sees a swap halfway.
    pub(super) phys: AtomicU32,
    /// Changed only under the slot's lock: set under the write lock,
    /// cleared by a write-back under the read or write lock.
    pub(super) dirty: AtomicBool,
    /// Held by `claim_slots` (write-locked, maybe while a GPU kernel fills
    /// it): a job that must not wait on the GPU does not wait on it
    /// (`read_lock_nowait`).
    pub(super) claimed: AtomicBool,
}

// Two to a cache line, each whole in one.
const _: () = assert!(std::mem::size_of::<SlotMeta>() == 32);

impl SlotMeta {
    /// Slot `i`, free and using its own memory.
    pub(super) fn new(i: u32) -> SlotMeta {
        SlotMeta {
            lock: RwLock::new(()),
            tag: AtomicU64::new(NO_GROUP),
            pins: AtomicU32::new(0),
            phys: AtomicU32::new(i),
            dirty: AtomicBool::new(false),
            claimed: AtomicBool::new(false),
        }
    }
}

/// A pin on a slot, dropped when the copy or fill that needed it is done.
pub(super) struct Pin<'a> {
    c: &'a Cascade,
    pub(super) slot: SlotId,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        if self.c.slots[self.slot.0 as usize]
            .pins
            .fetch_sub(1, Ordering::AcqRel)
            == 1
        {
            self.c.changed.notify_all();
        }
    }
}

/// Slots held for device copies (see `Cascade::pin_for_device`): each
/// entry of `locked` one read lock (a slot named twice in a batch may be
/// there twice). A read lock keeps a slot from being written, evicted or
/// reused, as a pin would: no pins are taken.
pub struct DevicePins {
    c: Arc<Cascade>,
    locked: Vec<u32>,
}

/// A `DevicePins` entry's slot and batch index.
fn slot_and_index(p: u64) -> (u32, u32) {
    ((p >> 32) as u32, p as u32)
}

/// Sorts `v` (entries `slot << 32 | index`, indexes ascending) by slot,
/// keeping indexes in order within a slot: a least-significant-digit
/// radix sort of 11-bit digits over the slot's `slot_bits`, two passes
/// for T1s of up to 4M slots (several times faster than a comparison sort
/// of the 4096 entries of a batch, which runs on every GPU restore).
fn sort_by_slot(v: &mut Vec<u64>, slot_bits: u32) {
    const DIGIT: u32 = 11;
    if v.len() < 64 {
        v.sort_unstable();
        return;
    }
    let mut tmp = vec![0u64; v.len()];
    let mut shift = 32;
    while shift < 32 + slot_bits.max(1) {
        let mut count = [0usize; 1 << DIGIT];
        for &x in v.iter() {
            count[((x >> shift) as usize) & ((1 << DIGIT) - 1)] += 1;
        }
        let mut at = 0;
        for c in count.iter_mut() {
            (*c, at) = (at, at + *c);
        }
        for &x in v.iter() {
            let d = ((x >> shift) as usize) & ((1 << DIGIT) - 1);
            tmp[count[d]] = x;
            count[d] += 1;
        }
        std::mem::swap(v, &mut tmp);
        shift += DIGIT;
    }
}

impl Drop for DevicePins {
    fn drop(&mut self) {
        for &s in &self.locked {
            // SAFETY: lock_mapped, pin_for_device or try_pin_resident took
            // one read lock for each entry of `locked` and forgot its guard.
            unsafe { self.c.slots[s as usize].lock.force_unlock_read() };
        }
        // Slots unlocked may be victims now: wake the claims waiting for
        // one (no pin was dropped to wake them).
        if !self.locked.is_empty() {
            self.c.changed.notify_all();
        }
    }
}

impl Cascade {
    // ---- slot memory -------------------------------------------------

    fn slot_ptr(&self, s: SlotId) -> *mut u8 {
        debug_assert!(s.0 < self.n_slots);
        let a = &self.arena;
        let p = self.slots[s.0 as usize].phys.load(Ordering::Relaxed);
        let base = a.bases[(p / a.per_chunk) as usize].load(Ordering::Acquire);
        debug_assert!(
            !base.is_null(),
            "slot {} used before its chunk arrived",
            s.0
        );
        // SAFETY: the slot's memory is allocated (slots reach the free list
        // only after their chunk's base is set, and swap memory only with
        // such slots) and the offset is inside its chunk.
        unsafe { base.add((p % a.per_chunk) as usize * self.layout.stride() as usize) }
    }

    /// Swaps the memory of slots `a` and `b`; the caller holds both
    /// slots' write locks.
    pub(super) fn swap_memory(&self, a: SlotId, b: SlotId) {
        // Plain loads and stores, no locked swap: the write locks keep
        // every other user of either slot's memory out.
        let (a, b) = (
            &self.slots[a.0 as usize].phys,
            &self.slots[b.0 as usize].phys,
        );
        let (pa, pb) = (a.load(Ordering::Relaxed), b.load(Ordering::Relaxed));
        a.store(pb, Ordering::Relaxed);
        b.store(pa, Ordering::Relaxed);
    }

    /// Takes in the T1 chunks the background allocator has finished.
    pub(super) fn adopt_chunks(&self, st: &mut State) {
        let a = &self.arena;
        let Some(mut guard) = a.incoming.try_lock() else {
            return;
        };
        let Some(rx) = guard.as_ref() else { return };
        loop {
            match rx.try_recv() {
                Ok((i, buf)) => {
                    a.bases[i].store(buf.as_ptr(), Ordering::Release);
                    a.dev_bases[i].store(buf.device_ptr().unwrap_or(0), Ordering::Release);
                    let first = i as u32 * a.per_chunk;
                    let n = (buf.len() as u64 / self.layout.stride()) as u32;
                    st.free.extend((first..first + n).rev().map(SlotId));
                    a.ready_slots.fetch_add(n as u64, Ordering::Relaxed);
                    a.owned.lock().push(buf);
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    *guard = None;
                    break;
                }
            }
        }
    }

    /// Slots whose memory has arrived (all of T1 once the background
    /// allocation is done).
    pub fn t1_ready_slots(&self) -> u64 {
        self.adopt_chunks(&mut self.state.lock());
        self.arena.ready_slots.load(Ordering::Relaxed)
    }

    /// The device address of slot `s` where T1 is pinned and mapped.
    pub fn slot_device_ptr(&self, s: SlotId) -> Option<u64> {
        let a = &self.arena;
        let p = self.slots[s.0 as usize].phys.load(Ordering::Relaxed);
        let base = a.dev_bases[(p / a.per_chunk) as usize].load(Ordering::Acquire);
        (base != 0).then(|| base + (p % a.per_chunk) as u64 * self.layout.stride())
    }

    /// # Safety
    /// The caller holds slot `s`'s lock (read or write) for as long as the
    /// returned slice lives.
    pub(super) unsafe fn slot_bytes(&self, s: SlotId) -> &[u8] {
        // SAFETY: in bounds (slot_ptr); the caller's lock excludes writers.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(s), self.layout.stride() as usize) }
    }

    /// # Safety
    /// The caller holds slot `s`'s write lock for as long as the returned
    /// slice lives.
    #[expect(
        clippy::mut_from_ref,
        reason = "exclusivity comes from the slot's write lock"
    )]
    pub(super) unsafe fn slot_bytes_mut(&self, s: SlotId) -> &mut [u8] {
        // SAFETY: in bounds (slot_ptr); the write lock makes this the only
        // reference to the slot's bytes.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(s), self.layout.stride() as usize) }
    }

    pub(super) fn set_dirty(&self, s: SlotId) {
        self.set_dirty_all(std::iter::once(s));
    }

    /// Marks every slot of `slots` dirty, adding to the shared dirty count
    /// once (every thread's writes and write-backs update it). The caller
    /// holds each slot's write lock, and only a write-lock holder sets the
    /// flag, so a load and a store do (no locked swap per slot).
    pub(super) fn set_dirty_all(&self, slots: impl Iterator<Item = SlotId>) {
        let newly = slots
            .filter(|s| {
                let d = &self.slots[s.0 as usize].dirty;
                let was = d.load(Ordering::Acquire);
                d.store(true, Ordering::Release);
                !was
            })
            .count();
        if newly > 0 {
            self.counters
                .dirty_slots
                .fetch_add(newly as u64, Ordering::Relaxed);
        }
    }

    pub(super) fn clear_dirty(&self, s: SlotId) {
        self.clear_dirty_all(std::iter::once(s));
    }

    /// Marks every slot of `slots` clean, taking from the shared dirty
    /// count once.
    pub(super) fn clear_dirty_all(&self, slots: impl Iterator<Item = SlotId>) {
        let cleared = slots
            .filter(|s| self.slots[s.0 as usize].dirty.swap(false, Ordering::AcqRel))
            .count();
        if cleared > 0 {
            self.counters
                .dirty_slots
                .fetch_sub(cleared as u64, Ordering::Relaxed);
        }
    }

    // ---- pins --------------------------------------------------------

    /// Pins the slot holding `g`, if any (and tells the policy of the hit).
    pub(super) fn pin_resident(&self, g: GroupIndex, touch: bool) -> Option<Pin<'_>> {
        let mut st = self.state.lock();
        let s = st.map.get(&g)?;
        self.slots[s.0 as usize].pins.fetch_add(1, Ordering::AcqRel);
        if touch && st.slot_state[s.0 as usize] == SlotState::Resident {
            st.policy.touch(s);
        }
        Some(Pin { c: self, slot: s })
    }

    /// `pin_resident` for many groups under one acquisition of the state
    /// lock (a batch of 1024 would otherwise take it 1024 times).
    pub(super) fn pin_resident_many(&self, groups: &[GroupIndex]) -> Vec<Option<Pin<'_>>> {
        let mut st = self.state.lock();
        groups
            .iter()
            .map(|g| {
                let s = st.map.get(g)?;
                self.slots[s.0 as usize].pins.fetch_add(1, Ordering::AcqRel);
                if st.slot_state[s.0 as usize] == SlotState::Resident {
                    st.policy.touch(s);
                }
                Some(Pin { c: self, slot: s })
            })
            .collect()
    }

    /// Whether every group of `groups` is in T1 right now (one acquisition
    /// of the state lock; the answer may be stale as soon as it returns).
    pub fn all_resident(&self, groups: impl IntoIterator<Item = GroupIndex>) -> bool {
        let st = self.state.lock();
        groups.into_iter().all(|g| st.map.contains_key(&g))
    }

    pub(super) fn holds(&self, s: SlotId, g: GroupIndex) -> bool {
        self.slots[s.0 as usize].tag.load(Ordering::Acquire) == g.0
    }

    /// Reads each of `slots`' words (one line: see `SlotMeta`) with plain
    /// loads and nothing between them that waits, so the CPU overlaps
    /// their cache misses: a caller about to take atomics on many scattered
    /// slots (each locked instruction a full barrier on x86, which would
    /// otherwise take the misses one at a time) calls this first.
    pub(super) fn warm_slots(&self, slots: impl Iterator<Item = SlotId>) {
        let mut x = 0u64;
        for s in slots {
            x = x.wrapping_add(self.slots[s.0 as usize].tag.load(Ordering::Relaxed));
        }
        std::hint::black_box(x);
    }

    /// Brings slot `s`'s words, state and policy record into cache, for a
    /// pass of atomics over many scattered slots that follows.
    pub(super) fn prefetch_slot(&self, st: &State, s: SlotId) {
        use super::slotmap::prefetch;
        prefetch(&self.slots[s.0 as usize]);
        prefetch(&st.slot_state[s.0 as usize]);
        st.policy.prefetch(s);
    }

    /// Pins `s`; the caller holds the state lock (pins are only added under it).
    pub(super) fn pin_now(&self, s: SlotId) -> Pin<'_> {
        self.slots[s.0 as usize].pins.fetch_add(1, Ordering::AcqRel);
        Pin { c: self, slot: s }
    }

    /// Read-locks slot `s` for a job that must never wait on the GPU
    /// (one that holds a GPU restore's gate shut): it passes writers that
    /// only queue (a recursive read), waits out a writer busy on the host
    /// (a copy, a write-back), and gives up (None) on a slot `claim_slots`
    /// holds: a GPU STORE may be writing it in place, with its kernel
    /// queued behind that very gate.
    pub(super) fn read_lock_nowait(&self, s: usize) -> Option<RwLockReadGuard<'_, ()>> {
        let lock = &self.slots[s].lock;
        let mut spins = 0u32;
        loop {
            if let Some(g) = lock.try_read_recursive() {
                return Some(g);
            }
            if self.slots[s].claimed.load(Ordering::Acquire) {
                return None;
            }
            spins += 1;
            if spins < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// Slot `s`'s read lock: waited for, or (without `wait`)
    /// `read_lock_nowait`.
    pub(super) fn read_lock(&self, s: usize, wait: bool) -> Option<RwLockReadGuard<'_, ()>> {
        match wait {
            true => Some(self.slots[s].lock.read()),
            false => self.read_lock_nowait(s),
        }
    }

    /// Read-locks the T1 slots of those `groups` that are resident, for
    /// copies the GPU makes straight out of them: returns each group's slot
    /// device address (None where the group is not in T1 or T1 is not
    /// device-mapped), and the entries whose slot a GPU STORE holds
    /// (`read_lock_nowait`): those are neither served nor to be read
    /// elsewhere. The slots cannot be written, evicted or reused until the
    /// returned guard drops. It never waits on the GPU.
    pub fn pin_for_device(
        self: &Arc<Self>,
        groups: &[GroupIndex],
    ) -> (Vec<Option<u64>>, DevicePins, Vec<usize>) {
        let (mut pins, ready, mut later) = self
            .lock_mapped(groups, false)
            .expect("only a batch that must be all in T1 gives up");
        let mut addrs = vec![None; groups.len()];
        let mut hits = 0;
        for p in ready {
            let (s, i) = slot_and_index(p);
            if let Some(d) = self.slot_device_ptr(SlotId(s)) {
                addrs[i as usize] = Some(d);
                hits += 1;
            }
        }
        let mut serve = |addrs: &mut Vec<Option<u64>>, s: u32, i: u32| {
            // Under the slot's read lock its group cannot change: a slot
            // reused since the look up holds another (the group is then
            // read from the backing, like any miss).
            if self.holds(SlotId(s), groups[i as usize])
                && let Some(d) = self.slot_device_ptr(SlotId(s))
            {
                addrs[i as usize] = Some(d);
                hits += 1;
                self.mark_hit(SlotId(s));
            }
        };
        // The slots busy at first: waited for in ascending slot order,
        // each slot once, as every holder of several slot locks that waits
        // for them (this, sync_all) takes them, so waits cannot form a
        // cycle even with queued writers.
        sort_by_slot(&mut later, u32::BITS - self.n_slots.leading_zeros());
        let mut busy = Vec::new();
        let mut last: Option<(u32, bool)> = None;
        for p in later {
            let (s, i) = slot_and_index(p);
            let locked = match last {
                Some((t, locked)) if t == s => locked,
                _ => {
                    let locked = match self.read_lock_nowait(s as usize) {
                        Some(g) => {
                            // Released by DevicePins::drop.
                            std::mem::forget(g);
                            pins.locked.push(s);
                            true
                        }
                        None => false,
                    };
                    last = Some((s, locked));
                    locked
                }
            };
            if locked {
                serve(&mut addrs, s, i);
            } else {
                busy.push(i as usize);
            }
        }
        busy.sort_unstable();
        self.count_device_hits(hits);
        (addrs, pins, busy)
    }

    /// Tells a one-bit policy of a hit on `s`, whose group the caller holds
    /// read-locked (`lock_mapped` left it to this).
    fn mark_hit(&self, s: SlotId) {
        if let Some(m) = &self.marks {
            m.set(s);
        }
    }

    /// How many entries ahead `lock_looked_up` asks for a slot's line.
    const AHEAD: usize = 16;

    /// Looks `groups` up in T1 under one acquisition of the state lock
    /// (telling the policy of the hits), then, with the state lock gone,
    /// read-locks their slots with a try-lock each: the guard, the entries
    /// so locked and those whose slot was busy (each `slot << 32 | batch
    /// index`). Nothing holds a slot between the look up and its lock, so
    /// it may have been reused meanwhile: a slot that holds another group
    /// once locked is let go at once, its group left out as not in T1 (a
    /// busy slot's caller checks the same once it has the lock). Under the
    /// state lock only the look ups and the policy's bits: four restores
    /// in flight take turns on it for that alone, and lock their slots side
    /// by side. With `all`, None (nothing held) as soon as a group is not
    /// in T1; otherwise groups not in T1 are left out.
    fn lock_mapped(
        self: &Arc<Self>,
        groups: &[GroupIndex],
        all: bool,
    ) -> Option<(DevicePins, Vec<u64>, Vec<u64>)> {
        let slots: Vec<Option<SlotId>> = {
            let mut st = self.state.lock();
            // Every lookup first, with nothing between them that waits: so
            // the CPU overlaps their cache misses.
            let slots = st.map.get_many(groups);
            if all && slots.iter().any(Option::is_none) {
                return None;
            }
            // Hits that are one bit are marked once each slot is locked,
            // with this lock gone (`lock_looked_up`).
            if self.marks.is_none() {
                for &s in slots.iter().flatten() {
                    self.prefetch_slot(&st, s);
                }
                for &s in slots.iter().flatten() {
                    if st.slot_state[s.0 as usize] == SlotState::Resident {
                        st.policy.touch(s);
                    }
                }
            }
            slots
        };
        self.lock_looked_up(groups, &slots, all)
    }

    /// `lock_mapped`'s second half: read-locks `slots` (where `groups`
    /// were found, nothing held since), each kept only if it still holds
    /// its group.
    fn lock_looked_up(
        self: &Arc<Self>,
        groups: &[GroupIndex],
        slots: &[Option<SlotId>],
        all: bool,
    ) -> Option<(DevicePins, Vec<u64>, Vec<u64>)> {
        let mut pins = DevicePins {
            c: self.clone(),
            locked: Vec::with_capacity(groups.len()),
        };
        let mut ready = Vec::with_capacity(groups.len());
        let mut busy = Vec::new();
        for i in 0..slots.len() {
            // Each try-lock is a full barrier: the line a few entries on is
            // asked for now, so its miss overlaps the locks between.
            if let Some(Some(a)) = slots.get(i + Self::AHEAD) {
                super::slotmap::prefetch(&self.slots[a.0 as usize]);
            }
            let Some(s) = slots[i] else { continue };
            let entry = (s.0 as u64) << 32 | i as u64;
            match self.slots[s.0 as usize].lock.try_read() {
                // Under the slot's read lock its group cannot change.
                Some(g) if self.holds(s, groups[i]) => {
                    // Released by DevicePins::drop.
                    std::mem::forget(g);
                    pins.locked.push(s.0);
                    ready.push(entry);
                    self.mark_hit(s);
                }
                // Reused since the look up: not in T1 (any more).
                Some(_) if all => return None,
                Some(_) => {}
                None => busy.push(entry),
            }
        }
        Some((pins, ready, busy))
    }

    /// Counts T1 hits of device copies, once per batch: these counters are
    /// shared by every thread.
    fn count_device_hits(&self, hits: u64) {
        self.counters.hits.fetch_add(hits, Ordering::Relaxed);
        self.counters
            .t1_read_bytes
            .fetch_add(hits * self.layout.group_bytes(), Ordering::Relaxed);
    }

    /// `pin_for_device` for a batch that is all in T1, taken on admission:
    /// every group's slot device address, read-locked, or None (nothing
    /// held) when a group is not in T1, T1 is not device-mapped, or a slot
    /// is being written right now. It never waits, so a caller may hold it
    /// across the reply; and it looks every group up once, where a
    /// residence check and a later lock would look twice.
    pub fn try_pin_resident(
        self: &Arc<Self>,
        groups: &[GroupIndex],
    ) -> Option<(Vec<u64>, DevicePins)> {
        let (pins, ready, busy) = self.lock_mapped(groups, true)?;
        if !busy.is_empty() {
            return None;
        }
        let mut addrs = vec![0u64; groups.len()];
        for p in ready {
            let (s, i) = slot_and_index(p);
            addrs[i as usize] = self.slot_device_ptr(SlotId(s))?;
        }
        self.count_device_hits(groups.len() as u64);
        Some((addrs, pins))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::sort_by_slot;
    use crate::cascade::{Cascade, CascadeConfig, MetaTable, PolicyKind, SlotId};
    use crate::geometry::{Dtype, GroupIndex, GroupLayout};
    use crate::tier::MemTier;
    use std::sync::Arc;

    /// A cascade of 4 groups' T1 over 8 groups, under `policy`.
    fn four_slots(policy: PolicyKind) -> Arc<Cascade> {
        let layout = GroupLayout::new(1, 4, 1, 16, 64, Dtype::Bf16).unwrap();
        Arc::new(
            Cascade::new(
                layout,
                Box::new(MemTier::new(layout)),
                MetaTable::anonymous(layout.group_count()).unwrap(),
                CascadeConfig {
                    t1_bytes: 4 * layout.stride(),
                    policy,
                    ..CascadeConfig::default()
                },
            )
            .unwrap(),
        )
    }

    /// `four_slots` with groups 0 and 1 written (resident, dirty): it and
    /// their slots.
    pub(in crate::cascade) fn two_resident() -> (Arc<Cascade>, SlotId, SlotId) {
        let c = four_slots(PolicyKind::default());
        let gb = c.layout.group_bytes() as usize;
        for g in 0..2u64 {
            c.write(GroupIndex(g), 0, &vec![g as u8 + 1; gb]).unwrap();
        }
        let slot = |g| c.state.lock().map.get(&GroupIndex(g)).unwrap();
        let (s0, s1) = (slot(0), slot(1));
        (c, s0, s1)
    }

    /// A GPU restore's hit counts for SIEVE though it is marked outside
    /// the state lock: the slot it read is spared by the next eviction,
    /// which takes the next oldest instead; under LRU the hit moves it up.
    #[test]
    fn a_device_hit_spares_its_slot_from_the_next_eviction() {
        for policy in [PolicyKind::Sieve, PolicyKind::Lru] {
            let c = four_slots(policy);
            let gb = c.layout.group_bytes() as usize;
            for g in 0..4u64 {
                c.write(GroupIndex(g), 0, &vec![g as u8 + 1; gb]).unwrap();
            }
            // Group 0 is the oldest: without a hit it would go first.
            let (_, pins, busy) = c.pin_for_device(&[GroupIndex(0)]);
            assert!(busy.is_empty());
            drop(pins);
            c.write(GroupIndex(4), 0, &vec![5; gb]).unwrap();
            let resident = c.resident();
            assert!(
                resident.contains(&GroupIndex(0)),
                "{policy:?}: {resident:?}"
            );
            assert!(
                !resident.contains(&GroupIndex(1)),
                "{policy:?}: {resident:?}"
            );
        }
    }

    /// A restore's look up found a group in a slot that holds another
    /// group by the time it is locked (reused meanwhile): that slot is let
    /// go at once and the group counts as not in T1; with `all`, nothing is
    /// held. The entries whose slot holds their group stay locked until
    /// the guard goes.
    #[test]
    fn a_restore_lets_go_of_a_slot_reused_since_the_look_up() {
        let (c, s0, s1) = two_resident();
        let (g0, g1) = (GroupIndex(0), GroupIndex(1));
        let (pins, ready, busy) = c
            .lock_looked_up(&[g0, g1], &[Some(s1), Some(s1)], false)
            .unwrap();
        assert_eq!(
            ready,
            vec![(s1.0 as u64) << 32 | 1],
            "only group 1, in its own slot"
        );
        assert!(busy.is_empty());
        assert_eq!(pins.locked, vec![s1.0], "one read lock, group 1's");
        assert!(!c.slots[s0.0 as usize].lock.is_locked());
        drop(pins);
        assert!(!c.slots[s1.0 as usize].lock.is_locked());
        assert!(
            c.lock_looked_up(&[g1, g0], &[Some(s1), Some(s1)], true)
                .is_none()
        );
        assert!(!c.slots[s1.0 as usize].lock.is_locked(), "nothing held");
    }

    /// The radix sort orders by slot and keeps each slot's indexes in
    /// order, as a comparison sort of the whole entries does, for batches
    /// small and large and slots that repeat.
    #[test]
    fn radix_sort_by_slot_matches_a_full_sort() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for (n, slots) in [(10usize, 7u64), (300, 5000), (4096, 524_288), (5000, 3)] {
            let v: Vec<u64> = (0..n as u64)
                .map(|i| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % slots) << 32 | i
                })
                .collect();
            let mut want = v.clone();
            want.sort_unstable();
            let mut got = v;
            sort_by_slot(&mut got, u64::BITS - slots.leading_zeros());
            assert_eq!(got, want, "{n} entries over {slots} slots");
        }
    }
}
