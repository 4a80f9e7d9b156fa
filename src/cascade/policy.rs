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
//! victim scan.

use super::SlotId;

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

/// One slot's place in a list: its neighbours and flags side by side, so
/// an insert or a hit touches one cache line of it (slots come and go in
/// scattered order, and each line missed costs ~100 ns under the lock).
#[derive(Clone, Copy)]
struct Node {
    prev: u32,
    next: u32,
    linked: bool,
    /// The policy's bit (SIEVE's "visited").
    mark: bool,
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
                mark: false,
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
    /// Each node's mark is its visited bit.
    list: SlotList,
    hand: u32,
}

impl Sieve {
    pub fn new(capacity: u32) -> Sieve {
        Sieve {
            list: SlotList::new(capacity),
            hand: NIL,
        }
    }
}

impl Policy for Sieve {
    fn name(&self) -> &'static str {
        "sieve"
    }

    fn insert(&mut self, slot: SlotId) {
        self.list.nodes[slot.0 as usize].mark = false;
        self.list.push_head(slot.0);
    }

    fn prefetch(&self, slot: SlotId) {
        super::slotmap::prefetch(&self.list.nodes[slot.0 as usize]);
    }

    fn touch(&mut self, slot: SlotId) {
        self.list.nodes[slot.0 as usize].mark = true;
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
            let node = &mut self.list.nodes[h as usize];
            self.hand = node.prev;
            if node.mark {
                node.mark = false;
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
