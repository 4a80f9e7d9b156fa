//! `SlotMap`: which T1 slot holds each resident group.
//!
//! Open addressing with linear probing over one array of (group, slot)
//! pairs, at most half full (T1 holds at most `n_slots` groups, and the
//! table has room for twice that), so a lookup mostly reads one cache
//! line: the key and its slot side by side, where a general hash map
//! reads a control line and then a bucket line. Batch lookups
//! (`get_many`) prefetch the entries of the groups a few places ahead, so
//! a GPU ticket's thousands of scattered lookups overlap their cache
//! misses instead of taking them one after another, all under the
//! cascade's state lock. Removal shifts later entries back (no
//! tombstones), so probe lengths never grow with churn.
//!
//! 0 marks an empty entry (keys are stored plus one). The array, 32 bytes
//! a T1 slot (under 1% of a 4 KiB slot, which is pinned whole anyway), is
//! written once when T1 is made, so T1's first fill takes no page faults
//! in it (left lazy, new-group claims of 4096 groups took 2x longer on a
//! fresh mount), and sits on huge pages where the system allows, so a
//! scattered lookup misses the TLB less often.

use super::{GroupIndex, SlotId};

/// How many places ahead `get_many` prefetches.
const AHEAD: usize = 32;

pub(super) struct SlotMap {
    /// Pairs: `[2i]` = group + 1 (0: empty), `[2i + 1]` = slot.
    words: Vec<u64>,
    /// Entries − 1 (a power of two less one).
    mask: usize,
    /// log2(entries), for the multiplicative hash.
    bits: u32,
    len: usize,
}

impl SlotMap {
    /// A map for at most `most` groups.
    pub(super) fn new(most: usize) -> SlotMap {
        let entries = (most.max(8) * 2).next_power_of_two();
        SlotMap {
            words: crate::gpu::huge_vec(entries * 2, |_| 0),
            mask: entries - 1,
            bits: entries.trailing_zeros(),
            len: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Where `g`'s probe starts: Fibonacci hashing, the product's top bits.
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - self.bits)) as usize
    }

    /// The entry holding `g`, or the empty entry ending its probe.
    fn find(&self, g: GroupIndex) -> (usize, bool) {
        let key = g.0.wrapping_add(1);
        let mut i = self.home(key);
        loop {
            match self.words[2 * i] {
                0 => return (i, false),
                k if k == key => return (i, true),
                _ => i = (i + 1) & self.mask,
            }
        }
    }

    pub(super) fn get(&self, g: &GroupIndex) -> Option<SlotId> {
        match self.find(*g) {
            (i, true) => Some(SlotId(self.words[2 * i + 1] as u32)),
            _ => None,
        }
    }

    pub(super) fn contains_key(&self, g: &GroupIndex) -> bool {
        self.find(*g).1
    }

    /// Each group's slot, in order, their cache misses overlapped.
    pub(super) fn get_many(&self, groups: &[GroupIndex]) -> Vec<Option<SlotId>> {
        for g in groups.iter().take(AHEAD) {
            self.prefetch(*g);
        }
        let mut out = Vec::with_capacity(groups.len());
        for (k, g) in groups.iter().enumerate() {
            if let Some(&ahead) = groups.get(k + AHEAD) {
                self.prefetch(ahead);
            }
            out.push(self.get(g));
        }
        out
    }

    /// Asks the CPU to bring `g`'s home entry into cache.
    fn prefetch(&self, g: GroupIndex) {
        prefetch(&self.words[2 * self.home(g.0.wrapping_add(1))]);
    }

    /// Maps `g` to `s`; returns the slot it had, if any.
    pub(super) fn insert(&mut self, g: GroupIndex, s: SlotId) -> Option<SlotId> {
        let (i, found) = self.find(g);
        let old = found.then(|| SlotId(self.words[2 * i + 1] as u32));
        debug_assert!(g.0 != u64::MAX, "NO_GROUP is never mapped");
        if !found {
            assert!(
                self.len < self.mask / 2 + 1,
                "slot map over half full: more groups than T1 slots"
            );
            self.words[2 * i] = g.0.wrapping_add(1);
            self.len += 1;
        }
        self.words[2 * i + 1] = s.0 as u64;
        old
    }

    /// Unmaps `g`; returns its slot, if it had one.
    pub(super) fn remove(&mut self, g: &GroupIndex) -> Option<SlotId> {
        let (mut hole, found) = self.find(*g);
        if !found {
            return None;
        }
        let old = SlotId(self.words[2 * hole + 1] as u32);
        self.len -= 1;
        // Shift back each later entry of the run that may sit in the hole:
        // one whose home is not cyclically in (hole, j].
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let key = self.words[2 * j];
            if key == 0 {
                break;
            }
            let home = self.home(key);
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.words.copy_within(2 * j..2 * j + 2, 2 * hole);
                hole = j;
            }
        }
        self.words[2 * hole] = 0;
        self.words[2 * hole + 1] = 0;
        Some(old)
    }

    /// Every mapped group, in no particular order.
    pub(super) fn keys(&self) -> impl Iterator<Item = GroupIndex> + '_ {
        self.words
            .chunks_exact(2)
            .filter(|e| e[0] != 0)
            .map(|e| GroupIndex(e[0] - 1))
    }
}

/// Asks the CPU to bring `x`'s cache line in, without waiting for it: a
/// pass over many scattered records does this a few records ahead, or for
/// all of them before a pass of atomics (each locked instruction waits for
/// earlier missing stores on x86, so misses taken there come one by one).
pub(super) fn prefetch<T>(x: &T) {
    let p: *const T = x;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint: it never faults and reads nothing
    // the program sees; p points at a live value anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts, replacements and removals, with keys that collide in
    /// a tiny table and keys far apart, agree with a std HashMap at every
    /// step, and the table never holds a key twice.
    #[test]
    fn agrees_with_a_hash_map() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for (most, keys) in [(8usize, 24u64), (100, 300), (5000, 1 << 40)] {
            let mut m = SlotMap::new(most);
            let mut want: HashMap<u64, u32> = HashMap::new();
            for step in 0..40_000u32 {
                let g = match keys {
                    k if k > 1 << 32 => (rnd() % 8000) * 0x1_0000_0001 % k,
                    k => rnd() % k,
                };
                let gi = GroupIndex(g);
                if rnd() % 3 == 0 || want.len() >= most {
                    assert_eq!(m.remove(&gi).map(|s| s.0), want.remove(&g));
                } else {
                    assert_eq!(
                        m.insert(gi, SlotId(step)).map(|s| s.0),
                        want.insert(g, step)
                    );
                }
                assert_eq!(m.len(), want.len());
                let probe = GroupIndex(rnd() % keys);
                assert_eq!(m.get(&probe).map(|s| s.0), want.get(&probe.0).copied());
            }
            let mut got: Vec<u64> = m.keys().map(|g| g.0).collect();
            got.sort_unstable();
            let mut all: Vec<u64> = want.keys().copied().collect();
            all.sort_unstable();
            assert_eq!(got, all);
            let asked: Vec<GroupIndex> = (0..2000).map(|_| GroupIndex(rnd() % keys)).collect();
            let many = m.get_many(&asked);
            for (g, s) in asked.iter().zip(many) {
                assert_eq!(s.map(|s| s.0), want.get(&g.0).copied());
            }
        }
    }

    /// The largest group index (u64::MAX − 1 is the last valid; NO_GROUP
    /// is u64::MAX and never mapped) round-trips.
    #[test]
    fn extreme_keys() {
        let mut m = SlotMap::new(4);
        m.insert(GroupIndex(0), SlotId(1));
        m.insert(GroupIndex(u64::MAX - 1), SlotId(2));
        assert_eq!(m.get(&GroupIndex(0)).map(|s| s.0), Some(1));
        assert_eq!(m.get(&GroupIndex(u64::MAX - 1)).map(|s| s.0), Some(2));
        assert_eq!(m.remove(&GroupIndex(0)).map(|s| s.0), Some(1));
        assert!(!m.contains_key(&GroupIndex(0)));
        assert_eq!(m.len(), 1);
    }
}
