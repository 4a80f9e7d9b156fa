//! Replacement policies for T1 slots.
//!
//! Contract. The caller (the cascade, under its state lock) guarantees: slot
//! ids are below the capacity given at construction; `insert` is called only
//! for a slot not tracked, `touch` and `remove` only for a tracked slot.
//! The implementation MUST: return from `victim` only a tracked slot for
//! which `evictable` returned true; consider each tracked slot a bounded
//! number of times, returning None when none is evictable (never loop
//! forever); keep tracking the victim until the caller calls `remove` (an
//! eviction can fail, and then the slot stays where it was). Every method
//! runs under the cascade's state lock, on every hit: O(1) apart from the
//! victim scan. A policy whose hit is one bit (`marks`) may have that
//! bit set without the lock, by whoever holds the slot's read lock.

use super::SlotId;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A replacement policy.
pub trait Policy: Send {
    fn name(&self) -> &'static str;
    fn insert(&mut self, slot: SlotId);
    fn touch(&mut self, slot: SlotId);
    fn remove(&mut self, slot: SlotId);
    fn victim(&mut self, evictable: &mut dyn FnMut(SlotId) -> bool) -> Option<SlotId>;
    /// Brings what `touch(slot)` or `insert(slot)` will write into cache
    /// (see `slotmap::prefetch`).
    fn prefetch(&self, slot: SlotId);
    /// Where a hit is one bit (SIEVE's "visited"): the bits, which a
    /// caller may set (`Marks::set`) for a slot whose group it holds
    /// read-locked, instead of `touch` under the state lock. A bit set for
    /// a slot not tracked is harmless: `insert` clears it.
    fn marks(&self) -> Option<Arc<Marks>> {
        None
    }
}

/// One bit a slot, set and taken atomically: 1 MiB of bits covers 8 Mi
/// slots, so a batch's hits mostly find their word in cache where each
/// would otherwise miss on its own list node.
pub struct Marks(Box<[AtomicU64]>);

impl Marks {
    fn new(capacity: u32) -> Marks {
        Marks(
            (0..(capacity as usize).div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        )
    }

    fn word(&self, s: SlotId) -> (&AtomicU64, u64) {
        (&self.0[s.0 as usize / 64], 1 << (s.0 % 64))
    }

    /// Sets `s`'s bit (a hit); a word whose bit is set already is not
    /// written, so hits on hot slots do not bounce its line between cores.
    pub fn set(&self, s: SlotId) {
        let (w, bit) = self.word(s);
        if w.load(Ordering::Relaxed) & bit == 0 {
            w.fetch_or(bit, Ordering::Relaxed);
        }
    }

    fn clear(&self, s: SlotId) {
        let (w, bit) = self.word(s);
        if w.load(Ordering::Relaxed) & bit != 0 {
            w.fetch_and(!bit, Ordering::Relaxed);
        }
    }

    /// Clears `s`'s bit; whether it was set.
    fn take(&self, s: SlotId) -> bool {
        let (w, bit) = self.word(s);
        w.load(Ordering::Relaxed) & bit != 0 && w.fetch_and(!bit, Ordering::Relaxed) & bit != 0
    }
}

/// Policies selectable by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// SIEVE (Zhang et al., NSDI '24): a FIFO with a visited bit and a
    /// moving hand; as good as LRU or better on cache traces, and a hit is
    /// one bit set, with no list surgery under the lock.
    #[default]
    Sieve,
    Lru,
}

impl PolicyKind {
    pub fn build(self, capacity: u32) -> Box<dyn Policy> {
        match self {
            PolicyKind::Sieve => Box::new(Sieve::new(capacity)),
            PolicyKind::Lru => Box::new(Lru::new(capacity)),
        }
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sieve" => Ok(PolicyKind::Sieve),
            "lru" => Ok(PolicyKind::Lru),
            _ => Err(format!("unknown policy {s:?} (expected sieve or lru)")),
        }
    }
}

const NIL: u32 = u32::MAX;

/// One slot's place in a list: its neighbours and flag side by side, so
/// an insert touches one cache line of it (slots come and go in
/// scattered order, and each line missed costs ~100 ns under the lock).
#[derive(Clone, Copy)]
struct Node {
    prev: u32,
    next: u32,
    linked: bool,
}

/// An intrusive doubly-linked list over slot ids; head is newest.
struct SlotList {
    nodes: Vec<Node>,
    head: u32,
    tail: u32,
    len: u32,
}

impl SlotList {
    fn new(capacity: u32) -> SlotList {
        SlotList {
            nodes: crate::gpu::huge_vec(capacity as usize, |_| Node {
                prev: NIL,
                next: NIL,
                linked: false,
            }),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    fn prev(&self, s: u32) -> u32 {
        self.nodes[s as usize].prev
    }

    fn push_head(&mut self, s: u32) {
        debug_assert!(!self.nodes[s as usize].linked);
        let head = self.head;
        let n = &mut self.nodes[s as usize];
        n.prev = NIL;
        n.next = head;
        n.linked = true;
        if head != NIL {
            self.nodes[head as usize].prev = s;
        } else {
            self.tail = s;
        }
        self.head = s;
        self.len += 1;
    }

    fn unlink(&mut self, s: u32) {
        let Node {
            prev: p,
            next: n,
            linked,
            ..
        } = self.nodes[s as usize];
        if !linked {
            return;
        }
        if p != NIL {
            self.nodes[p as usize].next = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.nodes[n as usize].prev = p;
        } else {
            self.tail = p;
        }
        self.nodes[s as usize].linked = false;
        self.len -= 1;
    }
}

pub struct Sieve {
    list: SlotList,
    /// Each slot's visited bit, set by hits with or without the lock.
    visited: Arc<Marks>,
    hand: u32,
}

impl Sieve {
    pub fn new(capacity: u32) -> Sieve {
        Sieve {
            list: SlotList::new(capacity),
            visited: Arc::new(Marks::new(capacity)),
            hand: NIL,
        }
    }
}

impl Policy for Sieve {
    fn name(&self) -> &'static str {
        "sieve"
    }

    fn insert(&mut self, slot: SlotId) {
        self.visited.clear(slot);
        self.list.push_head(slot.0);
    }

    fn prefetch(&self, slot: SlotId) {
        super::slotmap::prefetch(&self.list.nodes[slot.0 as usize]);
    }

    fn touch(&mut self, slot: SlotId) {
        self.visited.set(slot);
    }

    fn marks(&self) -> Option<Arc<Marks>> {
        Some(self.visited.clone())
    }

    fn remove(&mut self, slot: SlotId) {
        if self.hand == slot.0 {
            self.hand = self.list.prev(slot.0);
        }
        self.list.unlink(slot.0);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(SlotId) -> bool) -> Option<SlotId> {
        // Two full sweeps: the first may only clear visited bits.
        let mut budget = 2 * self.list.len as u64 + 1;
        while budget > 0 && self.list.len > 0 {
            budget -= 1;
            if self.hand == NIL {
                self.hand = self.list.tail;
            }
            let h = self.hand;
            self.hand = self.list.prev(h);
            // A visited slot is spared in the first sweep only: hits may
            // set bits while this runs (without the lock), and a second
            // sweep that spared them could miss an evictable slot.
            let first_sweep = budget >= self.list.len as u64;
            if self.visited.take(SlotId(h)) && first_sweep {
                // Spared this time round.
            } else if evictable(SlotId(h)) {
                return Some(SlotId(h));
            }
        }
        None
    }
}

pub struct Lru {
    list: SlotList,
}

impl Lru {
    pub fn new(capacity: u32) -> Lru {
        Lru {
            list: SlotList::new(capacity),
        }
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn insert(&mut self, slot: SlotId) {
        self.list.push_head(slot.0);
    }

    fn prefetch(&self, slot: SlotId) {
        super::slotmap::prefetch(&self.list.nodes[slot.0 as usize]);
    }

    fn touch(&mut self, slot: SlotId) {
        self.list.unlink(slot.0);
        self.list.push_head(slot.0);
    }

    fn remove(&mut self, slot: SlotId) {
        self.list.unlink(slot.0);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(SlotId) -> bool) -> Option<SlotId> {
        let mut s = self.list.tail;
        while s != NIL {
            if evictable(SlotId(s)) {
                return Some(SlotId(s));
            }
            s = self.list.prev(s);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[test]
    fn lru_evicts_least_recent() {
        let mut p = Lru::new(4);
        for s in 0..4 {
            p.insert(SlotId(s));
        }
        p.touch(SlotId(0));
        assert_eq!(p.victim(&mut |_| true), Some(SlotId(1)));
        assert_eq!(p.victim(&mut |s| s != SlotId(1)), Some(SlotId(2)));
    }

    #[test]
    fn sieve_spares_visited() {
        let mut p = Sieve::new(4);
        for s in 0..4 {
            p.insert(SlotId(s));
        }
        p.touch(SlotId(0));
        p.touch(SlotId(1));
        // Oldest is 0 (visited → spared), then 1 (spared), then 2.
        assert_eq!(p.victim(&mut |_| true), Some(SlotId(2)));
        p.remove(SlotId(2));
        assert_eq!(p.victim(&mut |_| true), Some(SlotId(3)));
        assert_eq!(p.victim(&mut |_| false), None);
    }

    /// Hits may set SIEVE's bits while a victim is sought (without the
    /// lock): the second sweep no longer spares them, so an evictable
    /// slot is still found.
    #[test]
    fn sieve_finds_a_victim_while_hits_mark_every_slot() {
        let mut p = Sieve::new(3);
        for s in 0..3 {
            p.insert(SlotId(s));
            p.touch(SlotId(s));
        }
        let marks = p.marks().unwrap();
        let v = p.victim(&mut |s| {
            (0..3).for_each(|t| marks.set(SlotId(t)));
            s == SlotId(2)
        });
        assert_eq!(v, Some(SlotId(2)));
    }

    proptest! {
        // Both policies honour the contract under random use.
        #[test]
        fn contract(ops in proptest::collection::vec((0u8..4, 0u32..16, any::<u16>()), 1..400)) {
            for kind in [PolicyKind::Sieve, PolicyKind::Lru] {
                let mut p = kind.build(16);
                let mut tracked = HashSet::new();
                for &(op, s, mask) in &ops {
                    match op {
                        0 if !tracked.contains(&s) => { p.insert(SlotId(s)); tracked.insert(s); }
                        1 if tracked.contains(&s) => p.touch(SlotId(s)),
                        2 if tracked.contains(&s) => { p.remove(SlotId(s)); tracked.remove(&s); }
                        3 => {
                            let ok = |x: SlotId| mask & (1 << x.0) != 0;
                            let v = p.victim(&mut |x| ok(x));
                            match v {
                                Some(v) => { prop_assert!(tracked.contains(&v.0)); prop_assert!(ok(v)); }
                                None => prop_assert!(!tracked.iter().any(|&t| ok(SlotId(t)))),
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}
