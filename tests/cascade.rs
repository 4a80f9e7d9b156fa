//! The storage core against a plain model, under faults, and under threads.

use kvfs::cascade::{
    BackingConfig, Cascade, CascadeConfig, CascadeError, MetaTable, PolicyKind, Residence,
};
use kvfs::geometry::{Dtype, GroupIndex, GroupKey, GroupLayout, Kind};
use kvfs::tier::{Fault, FaultTier, FileTier, MemTier, TierKind};
use proptest::prelude::*;

mod common;
#[path = "common/model.rs"]
mod model;
use common::pattern;
use model::{cfg, op_strategy, open, run_model, small_layout};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn cascade_matches_model_file(
        ops in proptest::collection::vec(op_strategy(32, 256), 1..120),
        slots in 1u64..5, lru in any::<bool>(), promote in any::<bool>(),
    ) {
        let p = if lru { PolicyKind::Lru } else { PolicyKind::Sieve };
        run_model(TierKind::File, None, &ops, slots, p, promote)?;
    }

    #[test]
    fn cascade_matches_model_uring(
        ops in proptest::collection::vec(op_strategy(32, 256), 1..120),
        slots in 1u64..5, lru in any::<bool>(), promote in any::<bool>(),
    ) {
        let p = if lru { PolicyKind::Lru } else { PolicyKind::Sieve };
        run_model(TierKind::Uring, None, &ops, slots, p, promote)?;
    }
}

fn mem_cascade(slots: u64) -> (Cascade, kvfs::tier::FaultSwitch, GroupLayout) {
    let layout = small_layout();
    let (tier, sw) = FaultTier::new(MemTier::new(layout));
    let meta = MetaTable::anonymous(layout.group_count()).unwrap();
    let c = Cascade::new(
        layout,
        Box::new(tier),
        meta,
        cfg(slots, &layout, PolicyKind::Sieve, false),
    )
    .unwrap();
    (c, sw, layout)
}

/// `mem_cascade` once all of its T1 has arrived (T1 comes in chunks).
fn mem_cascade_ready(slots: u64) -> (Cascade, kvfs::tier::FaultSwitch, GroupLayout) {
    let (k, sw, layout) = mem_cascade(slots);
    let t = std::time::Instant::now();
    while k.t1_ready_slots() < slots {
        assert!(t.elapsed().as_secs() < 60, "T1 never arrived");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    (k, sw, layout)
}

fn errno(e: &CascadeError) -> Option<i32> {
    match e {
        CascadeError::Tier(t) => t.os_error(),
        _ => None,
    }
}

#[test]
fn failed_eviction_keeps_the_victim_and_reports() {
    let (c, sw, layout) = mem_cascade(2);
    let gb = layout.group_bytes() as usize;
    let data: Vec<Vec<u8>> = (0..4).map(|i| pattern(i, gb)).collect();
    c.write(GroupIndex(0), 0, &data[0]).unwrap();
    c.write(GroupIndex(1), 0, &data[1]).unwrap();
    sw.fail_writes(Some(Fault::Enospc));
    // T1 is full of dirty groups that cannot be written back.
    let e = c.write(GroupIndex(2), 0, &data[2]).unwrap_err();
    assert_eq!(errno(&e), Some(libc::ENOSPC), "{e}");
    let e = c.write(GroupIndex(3), 7, &data[3][..9]).unwrap_err();
    assert_eq!(errno(&e), Some(libc::ENOSPC), "{e}");
    // Nothing lost: both dirty groups are still in T1 and read back.
    for g in 0..2 {
        let mut out = vec![0; gb];
        assert_eq!(c.read(GroupIndex(g), 0, &mut out).unwrap(), Residence::T1);
        assert_eq!(out, data[g as usize]);
        let q = c.query(GroupIndex(g)).unwrap();
        assert_eq!((q.residence, q.dirty), (Residence::T1, true));
    }
    // The failed group was never half-installed.
    assert_eq!(c.query(GroupIndex(2)).unwrap().residence, Residence::Empty);
    let e = c.flush(GroupIndex(0)).unwrap_err();
    assert_eq!(errno(&e), Some(libc::ENOSPC));
    assert!(c.sync_all().is_err());
    assert!(c.stats().write_back_failures >= 4);
    assert_eq!(c.stats().dirty_slots, 2);
    // Space returns: everything goes through, nothing was lost.
    sw.heal();
    c.write(GroupIndex(2), 0, &data[2]).unwrap();
    c.write(GroupIndex(3), 0, &data[3]).unwrap();
    c.sync_all().unwrap();
    for g in 0..4 {
        let mut out = vec![0; gb];
        c.read(GroupIndex(g), 0, &mut out).unwrap();
        assert_eq!(out, data[g as usize], "group {g}");
    }
    assert_eq!(c.stats().dirty_slots, 0);
}

#[test]
fn a_failed_eviction_takes_a_clean_victim_instead() {
    for policy in [PolicyKind::Sieve, PolicyKind::Lru] {
        let layout = small_layout();
        let gb = layout.group_bytes() as usize;
        let (tier, sw) = FaultTier::new(MemTier::new(layout));
        let meta = MetaTable::anonymous(layout.group_count()).unwrap();
        // One chunk: all 4 slots from the start.
        let c4 = CascadeConfig {
            t1_chunk_bytes: 4 * layout.stride(),
            ..cfg(4, &layout, policy, false)
        };
        let c = Cascade::new(layout, Box::new(tier), meta, c4).unwrap();
        assert_eq!(c.t1_ready_slots(), 4);
        // The two oldest groups (the policy's first victims) are dirty, the
        // two newest clean.
        for g in 0..4 {
            c.write(GroupIndex(g), 0, &pattern(g, gb)).unwrap();
        }
        c.flush(GroupIndex(2)).unwrap();
        c.flush(GroupIndex(3)).unwrap();
        sw.fail_writes(Some(Fault::Eio));
        // The backing takes nothing: new groups go to the clean slots.
        for g in 4..6 {
            c.write(GroupIndex(g), 0, &pattern(g, gb))
                .unwrap_or_else(|e| panic!("{policy:?}: write of group {g}: {e}"));
        }
        for g in 0..2 {
            let q = c.query(GroupIndex(g)).unwrap();
            assert_eq!((q.residence, q.dirty), (Residence::T1, true), "{policy:?}");
        }
        // Only dirty slots are left: a new group fails, and nothing is lost.
        let e = c.write(GroupIndex(6), 0, &pattern(6, gb)).unwrap_err();
        assert_eq!(errno(&e), Some(libc::EIO), "{e}");
        assert_eq!(c.query(GroupIndex(6)).unwrap().residence, Residence::Empty);
        sw.heal();
        c.write(GroupIndex(6), 0, &pattern(6, gb)).unwrap();
        c.sync_all().unwrap();
        for g in 0..7 {
            let mut out = vec![0; gb];
            c.read(GroupIndex(g), 0, &mut out).unwrap();
            assert_eq!(out, pattern(g, gb), "{policy:?}: group {g}");
        }
    }
}

#[test]
fn failed_flush_and_sync_keep_data() {
    let (c, sw, layout) = mem_cascade(4);
    let gb = layout.group_bytes() as usize;
    let d = pattern(9, gb);
    c.write(GroupIndex(5), 0, &d).unwrap();
    sw.fail_writes(Some(Fault::Eio));
    assert_eq!(errno(&c.flush(GroupIndex(5)).unwrap_err()), Some(libc::EIO));
    assert!(c.query(GroupIndex(5)).unwrap().dirty);
    sw.heal();
    sw.fail_syncs(Some(Fault::Eio));
    assert!(c.flush(GroupIndex(5)).is_err());
    sw.heal();
    c.flush(GroupIndex(5)).unwrap();
    let mut out = vec![0; gb];
    c.read(GroupIndex(5), 0, &mut out).unwrap();
    assert_eq!(out, d);
    assert!(!c.query(GroupIndex(5)).unwrap().dirty);
}

#[test]
fn failed_backing_read_fails_the_read_only() {
    let (c, sw, layout) = mem_cascade(1);
    let gb = layout.group_bytes() as usize;
    c.write(GroupIndex(1), 0, &pattern(1, gb)).unwrap();
    c.write(GroupIndex(2), 0, &pattern(2, gb)).unwrap(); // evicts 1
    sw.fail_reads(Some(Fault::Eio));
    let mut out = vec![0; gb];
    assert_eq!(
        errno(&c.read(GroupIndex(1), 0, &mut out).unwrap_err()),
        Some(libc::EIO)
    );
    // A partial write needs the old bytes: it fails too, and installs nothing.
    assert!(c.write(GroupIndex(1), 3, &[1, 2, 3]).is_err());
    sw.heal();
    c.read(GroupIndex(1), 0, &mut out).unwrap();
    assert_eq!(out, pattern(1, gb));
}

#[test]
fn corrupted_backing_byte_is_never_served() {
    for tier in [TierKind::File, TierKind::Uring] {
        let layout = small_layout();
        let gb = layout.group_bytes() as usize;
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(2, &layout, PolicyKind::Sieve, false);
        let k = open(dir.path(), tier, layout, c);
        for g in 0..6 {
            k.write(GroupIndex(g), 0, &pattern(g, gb)).unwrap();
        }
        drop(k);
        // Flip one byte of group 3 on disk (its only copy so far: copy 0).
        let off = layout.offset(kvfs::tier::copy_index(GroupIndex(3), 0)) + 100;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.path().join("data"))
            .unwrap();
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, off).unwrap();
        f.write_all_at(&[b[0] ^ 0x40], off).unwrap();
        f.sync_all().unwrap();
        let k = open(dir.path(), tier, layout, c);
        let mut out = vec![0; gb];
        let e = k.read(GroupIndex(3), 0, &mut out).unwrap_err();
        assert!(matches!(e, CascadeError::Checksum { .. }), "{e}");
        assert!(e.to_string().contains("checksum"));
        assert_eq!(k.stats().checksum_failures, 1);
        assert!(k.read(GroupIndex(3), 0, &mut out[..10]).is_err());
        assert_eq!(k.stats().checksum_failures, 2);
        // Neighbours are fine, and a full rewrite heals the group.
        k.read(GroupIndex(2), 0, &mut out).unwrap();
        assert_eq!(out, pattern(2, gb));
        k.write(GroupIndex(3), 0, &pattern(33, gb)).unwrap();
        k.sync_all().unwrap();
        drop(k);
        let k = open(dir.path(), tier, layout, c);
        k.read(GroupIndex(3), 0, &mut out).unwrap();
        assert_eq!(out, pattern(33, gb));
    }
}

/// Flips one byte of copy `copy` of group `g` in the data file.
fn flip(dir: &Path, layout: &GroupLayout, g: u64, copy: u8) {
    use std::os::unix::fs::FileExt;
    let off = layout.offset(kvfs::tier::copy_index(GroupIndex(g), copy)) + 7;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("data"))
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, off).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], off).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn a_crash_mid_write_back_leaves_the_synced_copy() {
    for tier in [TierKind::File, TierKind::Uring] {
        let layout = small_layout();
        let gb = layout.group_bytes() as usize;
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(2, &layout, PolicyKind::Lru, false);
        let mut out = vec![0; gb];
        // A, synced: copy 0 is durable.
        let k = open(dir.path(), tier, layout, c);
        k.write(GroupIndex(1), 0, &pattern(100, gb)).unwrap();
        k.write(GroupIndex(2), 0, &pattern(200, gb)).unwrap();
        k.sync_all().unwrap();
        // B, written back by evictions but never synced (copy 1), then a
        // crash that cut both write-backs short (a flipped byte each).
        k.write(GroupIndex(1), 0, &pattern(101, gb)).unwrap();
        k.write(GroupIndex(2), 0, &pattern(201, gb)).unwrap();
        for g in 3..7 {
            k.write(GroupIndex(g), 0, &pattern(g, gb)).unwrap();
        }
        k.crash();
        flip(dir.path(), &layout, 1, 1);
        // Group 2's B survived whole.
        let k = open(dir.path(), tier, layout, c);
        k.read(GroupIndex(1), 0, &mut out).unwrap();
        assert_eq!(out, pattern(100, gb), "the synced A, not a torn B");
        assert_eq!(k.stats().recovered_reads, 1);
        k.read(GroupIndex(2), 0, &mut out).unwrap();
        assert_eq!(out, pattern(201, gb), "a later write that survived");
        // The next write-back of group 1 must not overwrite A's copy 0
        // before a sync: crash again with that write-back cut short too.
        k.write(GroupIndex(1), 0, &pattern(102, gb)).unwrap();
        for g in 3..7 {
            k.write(GroupIndex(g), 0, &pattern(g + 10, gb)).unwrap();
        }
        k.crash();
        flip(dir.path(), &layout, 1, 1);
        let k = open(dir.path(), tier, layout, c);
        k.read(GroupIndex(1), 0, &mut out).unwrap();
        assert_eq!(out, pattern(100, gb));
        // Within one mount a bad newest copy is corruption, not a crash:
        // it fails rather than serving older bytes.
        k.write(GroupIndex(2), 0, &pattern(202, gb)).unwrap();
        for g in 3..7 {
            k.write(GroupIndex(g), 0, &pattern(g + 20, gb)).unwrap();
        }
        // Group 2's durable copy is 0 (the first sync), so 202 went to copy 1.
        flip(dir.path(), &layout, 2, 1);
        let e = k.read(GroupIndex(2), 0, &mut out).unwrap_err();
        assert!(matches!(e, CascadeError::Checksum { .. }), "{e}");
        assert_eq!(k.stats().recovered_reads, 1, "only group 1's, above");
        drop(k);
    }
}

#[test]
fn a_long_run_of_write_backs_with_no_sync_is_synced() {
    // With a limit of 3 unsynced write-backs, evictions alone make group
    // 1's second write (B) durable: after a crash, its copy is the synced
    // one, so a damaged B fails (EIO) rather than falling back to A. With
    // the default limit the same run recovers A: the forced sync is what
    // differs.
    let layout = small_layout();
    let gb = layout.group_bytes() as usize;
    for (limit, forced) in [(3, true), (kvfs::cascade::DEFAULT_UNSYNCED_LIMIT, false)] {
        let dir = tempfile::tempdir().unwrap();
        let c = CascadeConfig {
            unsynced_limit: limit,
            ..cfg(2, &layout, PolicyKind::Lru, false)
        };
        let mut out = vec![0; gb];
        let k = open(dir.path(), TierKind::File, layout, c);
        k.write(GroupIndex(1), 0, &pattern(100, gb)).unwrap();
        k.sync_all().unwrap();
        k.write(GroupIndex(1), 0, &pattern(101, gb)).unwrap();
        for g in 3..9 {
            k.write(GroupIndex(g), 0, &pattern(g, gb)).unwrap();
        }
        k.crash();
        flip(dir.path(), &layout, 1, 1);
        let k = open(dir.path(), TierKind::File, layout, c);
        let r = k.read(GroupIndex(1), 0, &mut out);
        if forced {
            let e = r.unwrap_err();
            assert!(matches!(e, CascadeError::Checksum { .. }), "{e}");
            assert_eq!(k.stats().recovered_reads, 0);
        } else {
            r.unwrap();
            assert_eq!(out, pattern(100, gb));
            assert_eq!(k.stats().recovered_reads, 1);
        }
        // The groups written back (all but the two left in T1, lost in
        // the crash) read back whole either way.
        for g in 3..7 {
            k.read(GroupIndex(g), 0, &mut out).unwrap();
            assert_eq!(out, pattern(g, gb), "group {g}");
        }
    }
}

#[test]
fn slots_claimed_for_in_place_writes() {
    // All of T1, so the counts below hold.
    let (k, _sw, layout) = mem_cascade_ready(6);
    let gb = layout.group_bytes() as usize;
    let g = GroupIndex;
    let read = |x: u64| {
        let mut out = vec![0u8; gb];
        k.read(g(x), 0, &mut out).unwrap();
        out
    };
    for x in 0..4 {
        k.write(g(x), 0, &pattern(x, gb)).unwrap();
    }
    k.sync_all().unwrap();
    k.write(g(0), 0, &pattern(100, gb)).unwrap(); // dirty: copied on write
    // 0 dirty (a fresh slot), 1 clean in T1 (its own), 5 new (the last
    // free slot), 6 and 7 new (none left).
    let want = [g(0), g(1), g(5), g(6), g(7)];
    let mut w = k.claim_slots(&want, false);
    let has: Vec<bool> = (0..5).map(|i| w.has(i)).collect();
    assert_eq!(has, [true, true, true, false, false]);
    assert_eq!(w.held(), 3);
    for (i, x) in [(0, 0), (1, 1), (2, 5)] {
        w.bytes_mut(i)
            .unwrap()
            .copy_from_slice(&pattern(x + 10, gb));
    }
    // A reader of a held group waits for the commit: it never sees a
    // half-written slot, nor the dirty group's old bytes once committed.
    std::thread::scope(|s| {
        let r1 = s.spawn(|| read(1));
        let r0 = s.spawn(|| read(0));
        std::thread::sleep(std::time::Duration::from_millis(50));
        w.commit();
        assert_eq!(r1.join().unwrap(), pattern(11, gb));
        assert_eq!(r0.join().unwrap(), pattern(10, gb));
    });
    assert_eq!(read(5), pattern(15, gb));
    assert!(k.query(g(5)).unwrap().dirty);
    assert!(k.query(g(0)).unwrap().dirty);
    // The dirty group's old slot went back to the free list.
    assert_eq!(k.stats().t1_slots_used, 5);
    // Dropped without commit (a failed copy): clean and new groups read as
    // before, from the backing; a dirty group keeps its old bytes in T1.
    k.sync_all().unwrap();
    k.write(g(5), 0, &pattern(105, gb)).unwrap();
    let mut w = k.claim_slots(&[g(1), g(7), g(2), g(5)], false);
    for i in 0..4 {
        if let Some(b) = w.bytes_mut(i) {
            b.fill(0xa5);
        }
    }
    assert!(
        w.has(0) && w.has(1) && w.has(2) && !w.has(3),
        "one free slot"
    );
    drop(w);
    let mut w = k.claim_slots(&[g(5)], false);
    assert!(w.has(0), "a dirty group copied on write");
    w.bytes_mut(0).unwrap().fill(0xa5);
    drop(w);
    assert_eq!(read(1), pattern(11, gb));
    assert_eq!(read(2), pattern(2, gb));
    assert_eq!(read(7), vec![0u8; gb]);
    assert_eq!(k.query(g(7)).unwrap().residence, Residence::Empty);
    assert_eq!(read(5), pattern(105, gb));
    assert!(k.query(g(5)).unwrap().dirty);
    k.sync_all().unwrap();
    assert_eq!(
        k.query(g(5)).unwrap().backing_crc,
        Some(crc32c::crc32c(&pattern(105, gb)))
    );
}

/// A sync or flush that meets a dirty group while a store copies it on
/// write waits for the commit and writes back the new bytes: neither
/// returns with the group dirty or its old bytes in the backing.
#[test]
fn sync_and_flush_follow_a_group_copied_on_write() {
    let (k, _sw, layout) = mem_cascade_ready(6);
    let gb = layout.group_bytes() as usize;
    let g = GroupIndex;
    for (x, via_sync) in [(0u64, true), (1, false)] {
        k.write(g(x), 0, &pattern(x, gb)).unwrap();
        let mut w = k.claim_slots(&[g(x)], false);
        assert!(w.has(0));
        w.bytes_mut(0)
            .unwrap()
            .copy_from_slice(&pattern(x + 50, gb));
        std::thread::scope(|s| {
            let waiter = s.spawn(|| match via_sync {
                true => k.sync_all(),
                false => k.flush(g(x)),
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            w.commit();
            waiter.join().unwrap().unwrap();
        });
        let q = k.query(g(x)).unwrap();
        assert!(!q.dirty, "group {x} left dirty (sync: {via_sync})");
        assert_eq!(q.backing_crc, Some(crc32c::crc32c(&pattern(x + 50, gb))));
    }
}

#[test]
fn corrupt_memory_tier_group_counts() {
    let layout = small_layout();
    let gb = layout.group_bytes() as usize;
    let tier = Arc::new(MemTier::new(layout));
    let c = Cascade::new(
        layout,
        Box::new(tier.clone()),
        MetaTable::anonymous(32).unwrap(),
        cfg(1, &layout, PolicyKind::Lru, false),
    )
    .unwrap();
    c.write(GroupIndex(0), 0, &pattern(0, gb)).unwrap();
    c.write(GroupIndex(1), 0, &pattern(1, gb)).unwrap();
    tier.corrupt(GroupIndex(0), 5);
    let mut out = vec![0; gb];
    assert!(c.read(GroupIndex(0), 0, &mut out).is_err());
    assert_eq!(c.stats().checksum_failures, 1);
}

#[test]
fn out_of_bounds_requests_are_refused() {
    let (c, _sw, layout) = mem_cascade(2);
    let gb = layout.group_bytes();
    let e = c.write(GroupIndex(0), gb - 1, &[1, 2]).unwrap_err();
    assert!(matches!(e, CascadeError::OutOfBounds { .. }), "{e}");
    let mut b = [0u8; 1];
    assert!(c.read(GroupIndex(0), gb, &mut b).is_err());
    assert!(c.read(GroupIndex(0), u64::MAX, &mut b).is_err());
    assert!(matches!(
        c.read(GroupIndex(32), 0, &mut b).unwrap_err(),
        CascadeError::OutOfRange(_)
    ));
    assert!(c.flush(GroupIndex(99)).is_err());
    assert_eq!(c.stats().t1_slots_used, 0);
}

/// Each writer stamps a whole group with one value; a reader must always see
/// one stamp across the whole group, never a mix.
fn stamped(stamp: u64, gb: usize) -> Vec<u8> {
    let mut v = pattern(stamp, gb);
    v[..8].copy_from_slice(&stamp.to_le_bytes());
    v
}

fn check_stamped(v: &[u8]) -> bool {
    let stamp = u64::from_le_bytes(v[..8].try_into().unwrap());
    stamp == 0 && v.iter().all(|&b| b == 0) || v == stamped(stamp, v.len())
}

#[test]
fn eight_threads_no_lost_update_no_torn_group() {
    for tier in [TierKind::Uring, TierKind::File] {
        let layout = GroupLayout::new(2, 8, 4, 16, 64, Dtype::Bf16).unwrap(); // 128 groups of 2 KiB
        let gb = layout.group_bytes() as usize;
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(12, &layout, PolicyKind::Sieve, true);
        let k = Arc::new(open(dir.path(), tier, layout, c));
        const THREADS: u64 = 8;
        const SHARED: u64 = 16; // groups 0..16 are shared, the rest split by thread
        let per = (layout.group_count() - SHARED) / THREADS;
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let k = k.clone();
                std::thread::spawn(move || {
                    let mine: Vec<u64> = (SHARED + t * per..SHARED + (t + 1) * per).collect();
                    let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
                    let mut rng = pattern(t + 1000, 4096).into_iter().cycle();
                    let mut r =
                        move || rng.next().unwrap() as u64 | (rng.next().unwrap() as u64) << 8;
                    for i in 0..3000u64 {
                        let op = r() % 10;
                        if op < 4 {
                            let g = r() % SHARED;
                            if op < 2 {
                                let stamp = (t << 32) | i | 1;
                                k.write(GroupIndex(g), 0, &stamped(stamp, gb)).unwrap();
                            } else {
                                let mut out = vec![0; gb];
                                k.read(GroupIndex(g), 0, &mut out).unwrap();
                                assert!(check_stamped(&out), "torn shared group {g}");
                            }
                        } else {
                            let g = mine[(r() % per) as usize];
                            let m = model.entry(g).or_insert_with(|| vec![0; gb]);
                            match op {
                                4..=5 => {
                                    let o = (r() as usize) % gb;
                                    let l = 1 + (r() as usize) % (gb - o);
                                    let d = pattern(r() ^ i, l);
                                    k.write(GroupIndex(g), o as u64, &d).unwrap();
                                    m[o..o + l].copy_from_slice(&d);
                                }
                                6..=8 => {
                                    let mut out = vec![0; gb];
                                    k.read(GroupIndex(g), 0, &mut out).unwrap();
                                    assert_eq!(&out, m, "lost update on group {g}");
                                }
                                _ => k.flush(GroupIndex(g)).unwrap(),
                            }
                        }
                        if i % 500 == 0 && t == 0 {
                            k.sync_all().unwrap();
                        }
                    }
                    model
                })
            })
            .collect();
        let models: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(k.stats().evictions > 0);
        drop(Arc::try_unwrap(k).ok().unwrap());
        let k = open(dir.path(), tier, layout, c);
        for m in &models {
            for (g, want) in m {
                let mut out = vec![0; gb];
                k.read(GroupIndex(*g), 0, &mut out).unwrap();
                assert_eq!(&out, want, "group {g} after reopen");
            }
        }
        for g in 0..SHARED {
            let mut out = vec![0; gb];
            k.read(GroupIndex(g), 0, &mut out).unwrap();
            assert!(check_stamped(&out));
        }
        assert_eq!(k.stats().checksum_failures, 0);
    }
}

#[test]
fn reopen_restores_every_group_and_state() {
    let layout = GroupLayout::preset("qwen2.5-7b", 8, 16).unwrap();
    let gb = layout.group_bytes() as usize;
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(10, &layout, PolicyKind::Sieve, false);
    let k = open(dir.path(), TierKind::Uring, layout, c);
    let written: Vec<u64> = (0..layout.group_count()).filter(|g| g % 3 != 1).collect();
    for &g in &written {
        k.write(GroupIndex(g), 0, &pattern(g, gb)).unwrap();
    }
    drop(k); // no explicit sync: drop must flush
    let k = open(dir.path(), TierKind::File, layout, c);
    for g in 0..layout.group_count() {
        let mut out = vec![1; gb];
        let r = k.read(GroupIndex(g), 0, &mut out).unwrap();
        if g % 3 == 1 {
            assert_eq!(r, Residence::Empty);
            assert!(out.iter().all(|&b| b == 0));
        } else {
            assert_eq!(r, Residence::Backing);
            assert_eq!(out, pattern(g, gb));
            assert_eq!(
                k.query(GroupIndex(g)).unwrap().backing_crc,
                Some(crc32c::crc32c(&out))
            );
        }
    }
}

fn bcfg(dir: &Path, layout: Option<GroupLayout>) -> BackingConfig {
    BackingConfig {
        dir: dir.to_path_buf(),
        layout,
        tier: TierKind::File,
        queue_depth: 4,
        remote: None,
    }
}

#[test]
fn a_version_2_store_gets_a_uuid_and_keeps_its_groups() {
    let layout = small_layout();
    let gb = layout.group_bytes() as usize;
    let dir = tempfile::tempdir().unwrap();
    let k = Cascade::open(&bcfg(dir.path(), Some(layout)), CascadeConfig::default()).unwrap();
    k.write(GroupIndex(3), 0, &pattern(3, gb)).unwrap();
    drop(k);
    // Turn the superblock into the version-2 form: no uuid, the checksum
    // over the first 48 bytes.
    let sb = dir.path().join("superblock");
    let mut b = std::fs::read(&sb).unwrap();
    assert_eq!(u32::from_le_bytes(b[8..12].try_into().unwrap()), 3);
    b[8..12].copy_from_slice(&2u32.to_le_bytes());
    b[48..].fill(0);
    let crc = crc32c::crc32c(&b[..48]);
    b[48..52].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&sb, &b).unwrap();
    let k = Cascade::open(&bcfg(dir.path(), None), CascadeConfig::default()).unwrap();
    let mut out = vec![0; gb];
    k.read(GroupIndex(3), 0, &mut out).unwrap();
    assert_eq!(out, pattern(3, gb));
    drop(k);
    let b = std::fs::read(&sb).unwrap();
    assert_eq!(u32::from_le_bytes(b[8..12].try_into().unwrap()), 3);
    assert_ne!(&b[48..64], &[0u8; 16], "the upgrade draws a uuid");
    // A local store refuses the remote tier, with both named.
    let mut c = bcfg(dir.path(), None);
    c.tier = TierKind::Redis;
    let e = Cascade::open(&c, CascadeConfig::default()).err().unwrap();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("local data file") && msg.contains("redis"),
        "{msg}"
    );
}

#[test]
fn geometry_mismatch_names_both() {
    let dir = tempfile::tempdir().unwrap();
    let a = GroupLayout::preset("llama-3.1-8b", 16, 16).unwrap();
    let b = GroupLayout::preset("qwen2.5-7b", 16, 16).unwrap();
    drop(Cascade::open(&bcfg(dir.path(), Some(a)), CascadeConfig::default()).unwrap());
    let e = Cascade::open(&bcfg(dir.path(), Some(b)), CascadeConfig::default())
        .err()
        .unwrap();
    let msg = format!("{e:#}");
    assert!(
        msg.contains(&a.describe()) && msg.contains(&b.describe()),
        "{msg}"
    );
    // No geometry given: the store's is used.
    let k = Cascade::open(&bcfg(dir.path(), None), CascadeConfig::default()).unwrap();
    assert_eq!(*k.layout(), a);
    // A second opener is refused while the first holds the store.
    let e = Cascade::open(&bcfg(dir.path(), None), CascadeConfig::default())
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("in use by another kvfs"), "{e:#}");
    drop(k);
    // A directory with no store and no geometry says so.
    let empty = tempfile::tempdir().unwrap();
    let e = Cascade::open(&bcfg(empty.path(), None), CascadeConfig::default())
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("no geometry was given"), "{e:#}");
}

#[test]
fn damaged_superblock_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let a = GroupLayout::preset("llama-3.1-8b", 4, 16).unwrap();
    drop(Cascade::open(&bcfg(dir.path(), Some(a)), CascadeConfig::default()).unwrap());
    let sb = dir.path().join("superblock");
    let good = std::fs::read(&sb).unwrap();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            {
                let mut b = good.clone();
                b[20] ^= 1;
                b
            },
            "checksum mismatch",
        ),
        (
            {
                let mut b = good.clone();
                b[1] = b'x';
                b
            },
            "bad magic",
        ),
        (good[..512].to_vec(), "truncated"),
        (Vec::new(), "truncated"),
        (vec![0xff; 4096], "bad magic"),
    ];
    for (bytes, why) in cases {
        std::fs::write(&sb, &bytes).unwrap();
        let e = Cascade::open(&bcfg(dir.path(), None), CascadeConfig::default())
            .err()
            .unwrap();
        let msg = format!("{e:#}");
        assert!(msg.contains(why) && msg.contains("superblock"), "{msg}");
    }
    std::fs::write(&sb, &good).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("data"))
        .unwrap()
        .set_len(4096)
        .unwrap();
    let e = Cascade::open(&bcfg(dir.path(), None), CascadeConfig::default())
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("damaged"), "{e:#}");
}

#[test]
fn a_metadata_file_cut_short_is_refused_not_grown_with_zeros() {
    let layout = small_layout();
    let gb = layout.group_bytes() as usize;
    let dir = tempfile::tempdir().unwrap();
    let k = Cascade::open(&bcfg(dir.path(), Some(layout)), CascadeConfig::default()).unwrap();
    let last = GroupIndex(layout.group_count() - 1);
    k.write(last, 0, &pattern(9, gb)).unwrap();
    k.sync_all().unwrap();
    drop(k);
    let meta = dir.path().join("meta");
    let whole = std::fs::metadata(&meta).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&meta)
        .unwrap()
        .set_len(whole / 2)
        .unwrap();
    let e = Cascade::open(&bcfg(dir.path(), None), CascadeConfig::default())
        .err()
        .unwrap();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("damaged") && msg.contains("cut short"),
        "{msg}"
    );
    // Left as it was found: not grown back with zeros.
    assert_eq!(std::fs::metadata(&meta).unwrap().len(), whole / 2);
}

#[test]
fn forty_million_groups_open_at_once() {
    // llama-3.1-70b: 80 layers × 8 heads × 2 = 1280 groups a block.
    let layout = GroupLayout::preset("llama-3.1-70b", 31_250, 16).unwrap();
    assert_eq!(layout.group_count(), 40_000_000);
    let dir = tempfile::tempdir().unwrap();
    let t = std::time::Instant::now();
    let k = Cascade::open(&bcfg(dir.path(), Some(layout)), CascadeConfig::default()).unwrap();
    let created = t.elapsed();
    drop(k);
    let t = std::time::Instant::now();
    let k = Cascade::open(&bcfg(dir.path(), None), CascadeConfig::default()).unwrap();
    eprintln!("40M groups: create {created:?}, reopen {:?}", t.elapsed());
    let last = layout.index(GroupKey::new(79, 31_249, 7, Kind::V)).unwrap();
    assert_eq!(last.0, 39_999_999);
    let gb = layout.group_bytes() as usize;
    k.write(last, 0, &pattern(5, gb)).unwrap();
    k.sync_all().unwrap();
    let mut out = vec![0; gb];
    k.read(last, 0, &mut out).unwrap();
    assert_eq!(out, pattern(5, gb));
    // Sparse: only what was written takes space.
    use std::os::unix::fs::MetadataExt;
    let used = std::fs::metadata(dir.path().join("data")).unwrap().blocks() * 512;
    assert!(used < 1 << 20, "data file uses {used} bytes");
}

#[test]
fn file_tier_is_usable_directly() {
    let layout = small_layout();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d");
    let t = FileTier::open(&p, layout).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(layout.backing_bytes())
        .unwrap();
    let meta = MetaTable::anonymous(layout.group_count()).unwrap();
    let c = Cascade::new(
        layout,
        Box::new(t),
        meta,
        cfg(1, &layout, PolicyKind::Sieve, false),
    )
    .unwrap();
    c.write(GroupIndex(0), 0, &[1; 256]).unwrap();
    c.write(GroupIndex(1), 0, &[2; 256]).unwrap();
    let mut out = [0u8; 256];
    c.read(GroupIndex(0), 0, &mut out).unwrap();
    assert_eq!(out, [1; 256]);
    assert!(
        Cascade::new(
            layout,
            Box::new(MemTier::new(layout)),
            MetaTable::anonymous(32).unwrap(),
            CascadeConfig {
                t1_bytes: 100,
                ..CascadeConfig::default()
            }
        )
        .is_err()
    );
}

#[test]
fn t1_arrives_in_chunks_and_all_of_it_is_used() {
    let layout = small_layout();
    let gb = layout.group_bytes() as usize;
    let c = Cascade::new(
        layout,
        Box::new(MemTier::new(layout)),
        MetaTable::anonymous(layout.group_count()).unwrap(),
        CascadeConfig {
            t1_bytes: 10 * layout.stride(),
            t1_chunk_bytes: 3 * layout.stride(),
            ..CascadeConfig::default()
        },
    )
    .unwrap();
    assert_eq!(c.t1_slots(), 10);
    let t = std::time::Instant::now();
    while c.t1_ready_slots() < 10 {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "T1 chunks never arrived"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    for g in 0..10 {
        c.write(GroupIndex(g), 0, &pattern(g, gb)).unwrap();
    }
    let s = c.stats();
    assert_eq!((s.t1_slots_used, s.evictions), (10, 0));
    for g in 0..10 {
        let mut out = vec![0; gb];
        assert_eq!(c.read(GroupIndex(g), 0, &mut out).unwrap(), Residence::T1);
        assert_eq!(out, pattern(g, gb));
    }
}

/// A cascade over an in-memory tier with a T1 of `slots` slots, every one
/// of them ready.
fn ready_cascade(layout: GroupLayout, slots: u64) -> Arc<Cascade> {
    let c = Arc::new(
        Cascade::new(
            layout,
            Box::new(MemTier::new(layout)),
            MetaTable::anonymous(layout.group_count()).unwrap(),
            cfg(slots, &layout, PolicyKind::Sieve, false),
        )
        .unwrap(),
    );
    while c.t1_ready_slots() < slots {
        std::thread::yield_now();
    }
    c
}

/// The seed's eviction guard, at the cascade level: slots held for a device
/// copy are never evicted, overwritten or reused until the copy lets go.
/// T1 of 2 slots, 4 groups: pin the 2 resident groups "for the GPU", then a
/// writer needs slots for the other 2 and must wait, not evict.
#[test]
fn slots_held_for_a_device_copy_are_never_reused() {
    let layout = small_layout();
    let gb = layout.group_bytes() as usize;
    let c = ready_cascade(layout, 2);
    for g in 0..4 {
        c.write(GroupIndex(g), 0, &pattern(g, gb)).unwrap();
    }
    // Groups 2 and 3 are the resident ones now.
    let held = [GroupIndex(2), GroupIndex(3)];
    let (addrs, pins, busy) = c.pin_for_device(&held);
    assert_eq!(addrs.len(), 2); // no device mapping here: None, but held all the same
    assert!(busy.is_empty());
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (c, done) = (c.clone(), done.clone());
        std::thread::spawn(move || {
            c.write(GroupIndex(0), 0, &pattern(100, gb)).unwrap();
            c.write(GroupIndex(1), 0, &pattern(101, gb)).unwrap();
            done.store(true, std::sync::atomic::Ordering::SeqCst);
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(
        !done.load(std::sync::atomic::Ordering::SeqCst),
        "a writer evicted a slot held for a device copy"
    );
    let mut resident = c.resident();
    resident.sort();
    assert_eq!(resident, held.to_vec());
    drop(pins);
    writer.join().unwrap();
    for (g, seed) in [(0, 100), (1, 101), (2, 2), (3, 3)] {
        let mut out = vec![0; gb];
        c.read(GroupIndex(g), 0, &mut out).unwrap();
        assert_eq!(out, pattern(seed, gb), "group {g}");
    }
}

/// Runs `f` on a thread and fails (instead of hanging) if it does not
/// return within a minute: for calls that must not wait on others.
fn without_waiting<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what} waited (a GPU restore's gate would stay shut)"))
}

#[test]
fn a_gate_job_passes_queued_writers_and_skips_slots_a_gpu_store_holds() {
    // What holds a GPU restore's gate shut (pin_for_device, read_groups_nowait)
    // must not wait behind a writer that only queues, nor on a slot that
    // claim_slots holds (a GPU STORE's kernel may be queued behind the gate).
    let layout = small_layout();
    let gb = layout.group_bytes() as usize;
    let c = ready_cascade(layout, 4);
    for g in 0..3 {
        c.write(GroupIndex(g), 0, &pattern(g, gb)).unwrap();
    }
    c.sync_all().unwrap(); // clean: claim_slots takes clean groups in place
    let claims = c.claim_slots(&[GroupIndex(0)], false);
    assert!(claims.has(0));
    let c2 = c.clone();
    let (addrs, pins, busy) = without_waiting("pin_for_device on a claimed slot", move || {
        c2.pin_for_device(&[GroupIndex(0), GroupIndex(1)])
    });
    assert_eq!(busy, vec![0], "the claimed group is reported busy");
    assert_eq!(addrs[0], None);
    drop(pins);
    let c2 = c.clone();
    let r = without_waiting("read_groups_nowait on a claimed slot", move || {
        let mut out = vec![0u8; gb];
        let r = c2.read_groups_nowait(&mut [(GroupIndex(0), &mut out[..])]);
        r.into_iter().next().unwrap().map(|_| out)
    });
    match r {
        Err(e @ CascadeError::Busy(_)) => assert_eq!(e.errno(), libc::EAGAIN),
        other => panic!("expected Busy, got {other:?}"),
    }
    drop(claims); // not committed: group 0 reads its old bytes again
    let mut out = vec![0; gb];
    c.read(GroupIndex(0), 0, &mut out).unwrap();
    assert_eq!(out, pattern(0, gb));

    // A writer queued on a pinned slot does not hold up another reader of it.
    let (_, held, _) = c.pin_for_device(&[GroupIndex(1)]);
    let writer = {
        let c = c.clone();
        std::thread::spawn(move || c.write(GroupIndex(1), 0, &pattern(101, gb)).unwrap())
    };
    std::thread::sleep(std::time::Duration::from_millis(100)); // let it queue
    let c2 = c.clone();
    let (_, again, busy) = without_waiting("pin_for_device behind a queued writer", move || {
        let (a, p, b) = c2.pin_for_device(&[GroupIndex(1)]);
        (a, p, b)
    });
    assert!(busy.is_empty());
    drop(again);
    drop(held);
    writer.join().unwrap();
    c.read(GroupIndex(1), 0, &mut out).unwrap();
    assert_eq!(out, pattern(101, gb));
}

/// Device restores lock the slots a look up found with no pin, so a slot
/// may be reused between the two: under writers that evict and reuse
/// slots all the time, restores that hold their slots a while never hang,
/// never keep a slot from being written for good, and every group reads
/// back the last bytes written to it.
#[test]
fn device_restores_race_writers_that_reuse_slots() {
    let layout = small_layout();
    let gb = layout.group_bytes() as usize;
    let c = ready_cascade(layout, 6);
    let groups = 24u64;
    let last: Arc<Vec<std::sync::atomic::AtomicU64>> = Arc::new(
        (0..groups)
            .map(|_| std::sync::atomic::AtomicU64::new(0))
            .collect(),
    );
    for g in 0..groups {
        c.write(GroupIndex(g), 0, &pattern(g << 32, gb)).unwrap();
        last[g as usize].store(g << 32, std::sync::atomic::Ordering::SeqCst);
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (c2, last2) = (c.clone(), last.clone());
    without_waiting("writers beside device restores", move || {
        let (c, last) = (c2, last2);
        std::thread::scope(|s| {
            for w in 0..2u64 {
                let (c, last, stop) = (c.clone(), last.clone(), stop.clone());
                s.spawn(move || {
                    let mut n = 0u64;
                    // Writer w owns the groups of its parity, so the last
                    // write to each is known.
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        n += 1;
                        let g = (n * 7 + w) % groups / 2 * 2 + w;
                        let v = g << 32 | n;
                        c.write(GroupIndex(g), 0, &pattern(v, gb)).unwrap();
                        last[g as usize].store(v, std::sync::atomic::Ordering::SeqCst);
                    }
                });
            }
            for r in 0..2u64 {
                let (c, stop) = (c.clone(), stop.clone());
                s.spawn(move || {
                    let mut n = r;
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        n += 1;
                        let batch: Vec<GroupIndex> = (0..5)
                            .map(|k| GroupIndex((n * 5 + k * 3) % groups))
                            .collect();
                        let (addrs, held, busy) = c.pin_for_device(&batch);
                        assert_eq!(addrs.len(), batch.len());
                        assert!(busy.is_empty(), "no GPU store here");
                        std::thread::sleep(std::time::Duration::from_micros(200));
                        drop(held);
                    }
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(1500));
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
        });
    });
    let mut out = vec![0u8; gb];
    for g in 0..groups {
        c.read(GroupIndex(g), 0, &mut out).unwrap();
        let v = last[g as usize].load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(out, pattern(v, gb), "group {g}");
    }
}

/// The slot protocols side by side on a small T1 that evicts all the time:
/// in-place claims (committed, or dropped as after a failed GPU copy),
/// single and batched writes, device restores holding their slots a
/// while, syncs and flushes. Each writer owns a third of the groups, so
/// the last bytes given to each are known: nothing hangs, and every group
/// reads back exactly those, before and after a final sync.
#[test]
fn claims_writes_restores_and_syncs_race() {
    // T1 larger than the groups: free slots for claims, copies on write of
    // dirty groups, clean groups written in place; then T1 a quarter of
    // them: evictions all the time, claims mostly without a slot.
    race_slot_protocols(40);
    race_slot_protocols(8);
}

fn race_slot_protocols(slots: u64) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    let layout = small_layout();
    let gb = layout.group_bytes() as usize;
    let c = ready_cascade(layout, slots);
    let groups = 30u64;
    let last: Arc<Vec<AtomicU64>> = Arc::new((0..groups).map(|_| AtomicU64::new(0)).collect());
    for g in 0..groups {
        c.write(GroupIndex(g), 0, &pattern(g << 32, gb)).unwrap();
        last[g as usize].store(g << 32, SeqCst);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (c2, last2, stop2) = (c.clone(), last.clone(), stop.clone());
    without_waiting(
        "claims, writes, restores and syncs side by side",
        move || {
            let (c, last, stop) = (c2, last2, stop2);
            // Owner `w`'s k-th group.
            let owned = move |w: u64, k: u64| (k % (groups / 3)) * 3 + w;
            std::thread::scope(|s| {
                // Owner 0: single writes.
                s.spawn(|| {
                    let mut n = 0u64;
                    while !stop.load(SeqCst) {
                        n += 1;
                        let g = owned(0, n * 7);
                        c.write(GroupIndex(g), 0, &pattern(g << 32 | n, gb))
                            .unwrap();
                        last[g as usize].store(g << 32 | n, SeqCst);
                    }
                });
                // Owner 1: in-place claims of 3 groups, one in five dropped.
                s.spawn(|| {
                    let mut n = 0u64;
                    while !stop.load(SeqCst) {
                        n += 1;
                        let gs: Vec<GroupIndex> =
                            (0..3).map(|k| GroupIndex(owned(1, n * 3 + k))).collect();
                        let mut w = c.claim_slots(&gs, false);
                        for (i, g) in gs.iter().enumerate() {
                            if let Some(b) = w.bytes_mut(i) {
                                b.copy_from_slice(&pattern(g.0 << 32 | n, gb));
                            }
                        }
                        let (held, staged): (Vec<usize>, Vec<usize>) =
                            (0..3).partition(|&i| w.has(i));
                        if !n.is_multiple_of(5) {
                            w.commit();
                            for i in held {
                                last[gs[i].0 as usize].store(gs[i].0 << 32 | n, SeqCst);
                            }
                        } else {
                            drop(w);
                        }
                        // No slot: written once the claims are let go, as a GPU store
                        // writes its staged groups (a writer holding claims could wait
                        // on a sync that waits on them).
                        for i in staged {
                            let v = gs[i].0 << 32 | n;
                            c.write(gs[i], 0, &pattern(v, gb)).unwrap();
                            last[gs[i].0 as usize].store(v, SeqCst);
                        }
                    }
                });
                // Owner 2: batched writes.
                s.spawn(|| {
                    let mut n = 0u64;
                    while !stop.load(SeqCst) {
                        n += 1;
                        let gs: Vec<GroupIndex> =
                            (0..4).map(|k| GroupIndex(owned(2, n * 4 + k))).collect();
                        let rs = c.write_groups(&gs, |k, dst| {
                            dst.copy_from_slice(&pattern(gs[k].0 << 32 | n, gb));
                            Ok(())
                        });
                        for (g, r) in gs.iter().zip(rs) {
                            r.unwrap();
                            last[g.0 as usize].store(g.0 << 32 | n, SeqCst);
                        }
                    }
                });
                // Device restores holding their slots a while.
                s.spawn(|| {
                    let mut n = 0u64;
                    while !stop.load(SeqCst) {
                        n += 1;
                        let batch: Vec<GroupIndex> = (0..6)
                            .map(|k| GroupIndex((n * 5 + k * 4) % groups))
                            .collect();
                        let (addrs, held, _busy) = c.pin_for_device(&batch);
                        assert_eq!(addrs.len(), batch.len());
                        std::thread::sleep(std::time::Duration::from_micros(100));
                        drop(held);
                    }
                });
                // Syncs and flushes.
                s.spawn(|| {
                    let mut n = 0u64;
                    while !stop.load(SeqCst) {
                        n += 1;
                        match n % 4 {
                            0 => c.sync_all().unwrap(),
                            _ => c.flush(GroupIndex(n % groups)).unwrap(),
                        }
                        std::thread::sleep(std::time::Duration::from_micros(300));
                    }
                });
                std::thread::sleep(std::time::Duration::from_millis(1500));
                stop.store(true, SeqCst);
            });
        },
    );
    let mut out = vec![0u8; gb];
    for round in ["before", "after"] {
        for g in 0..groups {
            c.read(GroupIndex(g), 0, &mut out).unwrap();
            let v = last[g as usize].load(SeqCst);
            assert_eq!(
                out,
                pattern(v, gb),
                "group {g}, {round} the final sync, T1 of {slots} slots"
            );
        }
        c.sync_all().unwrap();
    }
}
