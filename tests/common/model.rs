//! The cascade against a plain `HashMap` model: random full and partial
//! writes, reads, batched reads and writes, in-place slot writes, flushes,
//! prefetches, syncs and reopens, every byte compared. Shared by
//! `tests/cascade.rs` (the local tiers) and `tests/remote.rs` (redis);
//! included with `#[path]` next to `mod common`.
#![allow(dead_code)]

use crate::common::pattern;
use kvfs::cascade::{
    BackingConfig, Cascade, CascadeConfig, CascadeError, PolicyKind, Residence, StoreError,
};
use kvfs::geometry::{Dtype, GroupIndex, GroupLayout};
use kvfs::tier::{RemoteConfig, TierKind};
use proptest::prelude::*;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// 2 layers × 4 blocks × 2 heads × {K,V} = 32 groups of 256 bytes.
pub fn small_layout() -> GroupLayout {
    GroupLayout::new(2, 4, 2, 4, 32, Dtype::Fp16).unwrap()
}

pub fn cfg(slots: u64, layout: &GroupLayout, policy: PolicyKind, promote: bool) -> CascadeConfig {
    CascadeConfig {
        t1_bytes: slots * layout.stride(),
        policy,
        promote_on_miss: promote,
        // Two-slot chunks: most T1s here arrive in several pieces, so the
        // background allocation and adoption run under every test.
        t1_chunk_bytes: 2 * layout.stride(),
        ..CascadeConfig::default()
    }
}

pub fn open(dir: &Path, tier: TierKind, layout: GroupLayout, c: CascadeConfig) -> Cascade {
    open_with(dir, tier, None, layout, c)
}

/// `open`, with how to reach the server of a remote tier.
///
/// A store just closed may still be locked for a moment when the test
/// binary also spawns processes (tests/remote.rs does, from other
/// threads): a child holds a copy of every fd, the flock'd lock file's
/// included, from fork until its exec closes them. So a busy store is
/// retried for a while; a lock that outlives that is a real failure.
pub fn open_with(
    dir: &Path,
    tier: TierKind,
    remote: Option<&RemoteConfig>,
    layout: GroupLayout,
    c: CascadeConfig,
) -> Cascade {
    let cfg = BackingConfig {
        dir: dir.to_path_buf(),
        layout: Some(layout),
        tier,
        queue_depth: 8,
        remote: remote.cloned(),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match Cascade::open(&cfg, c) {
            Ok(k) => return k,
            Err(e)
                if matches!(e.downcast_ref(), Some(StoreError::Busy { .. }))
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("cannot open the store in {}: {e:#}", dir.display()),
        }
    }
}

#[derive(Clone, Debug)]
pub enum Op {
    Full(u64, u64),
    Partial(u64, usize, usize, u64),
    Read(u64, usize, usize),
    /// Whole groups through the batched path (hits, misses, empties mixed).
    ReadMany(Vec<u64>),
    /// Whole-group writes through write_groups (duplicates allowed: the
    /// last wins); a `false` entry's fill fails and must change nothing.
    WriteMany(Vec<(u64, u64, bool)>),
    /// Whole-group writes in place through claim_slots (distinct groups;
    /// those without a slot through write_groups), committed or dropped.
    WriteSlots(Vec<(u64, u64)>, bool),
    Flush(u64),
    Prefetch(u64),
    SyncAll,
    Reopen,
}

pub fn op_strategy(groups: u64, gb: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..groups, any::<u64>()).prop_map(|(g, s)| Op::Full(g, s)),
        4 => (0..groups, 0..gb, 1..=gb, any::<u64>()).prop_map(move |(g, o, l, s)| {
            let l = l.min(gb - o);
            Op::Partial(g, o, l.max(1), s)
        }),
        6 => (0..groups, 0..gb, 1..=gb).prop_map(move |(g, o, l)| Op::Read(g, o, l.min(gb - o).max(1))),
        2 => proptest::collection::vec(0..groups, 1..12).prop_map(Op::ReadMany),
        2 => proptest::collection::vec((0..groups, any::<u64>(), proptest::bool::weighted(0.9)), 1..12)
            .prop_map(Op::WriteMany),
        2 => (proptest::collection::vec((0..groups, any::<u64>()), 1..12), proptest::bool::weighted(0.8))
            .prop_map(|(ws, commit)| Op::WriteSlots(ws, commit)),
        1 => (0..groups).prop_map(Op::Flush),
        1 => (0..groups).prop_map(Op::Prefetch),
        1 => Just(Op::SyncAll),
        1 => Just(Op::Reopen),
    ]
}

/// Runs `ops` on a fresh store of `small_layout()` in a temp directory
/// (on `tier`, reached through `remote` for a remote tier) with a T1 of
/// `slots` slots, against the model; then reads every group, twice, with
/// a reopen between.
pub fn run_model(
    tier: TierKind,
    remote: Option<&RemoteConfig>,
    ops: &[Op],
    slots: u64,
    policy: PolicyKind,
    promote: bool,
) -> Result<(), TestCaseError> {
    let layout = small_layout();
    let gb = layout.group_bytes() as usize;
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(slots, &layout, policy, promote);
    let mut cas = Some(open_with(dir.path(), tier, remote, layout, c));
    let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
    for op in ops {
        let k = cas.as_ref().unwrap();
        match *op {
            Op::Full(g, s) => {
                let d = pattern(s, gb);
                k.write(GroupIndex(g), 0, &d).unwrap();
                model.insert(g, d);
            }
            Op::Partial(g, o, l, s) => {
                let d = pattern(s, l);
                k.write(GroupIndex(g), o as u64, &d).unwrap();
                model.entry(g).or_insert_with(|| vec![0; gb])[o..o + l].copy_from_slice(&d);
            }
            Op::Read(g, o, l) => {
                let mut out = vec![0xeeu8; l];
                k.read(GroupIndex(g), o as u64, &mut out).unwrap();
                let want = model
                    .get(&g)
                    .map(|m| m[o..o + l].to_vec())
                    .unwrap_or(vec![0; l]);
                prop_assert_eq!(out, want, "group {} bytes {}..{}", g, o, o + l);
            }
            Op::ReadMany(ref gs) => {
                let mut bufs: Vec<Vec<u8>> = gs.iter().map(|_| vec![0xeeu8; gb]).collect();
                let mut items: Vec<(GroupIndex, &mut [u8])> = gs
                    .iter()
                    .zip(bufs.iter_mut())
                    .map(|(g, b)| (GroupIndex(*g), b.as_mut_slice()))
                    .collect();
                for r in k.read_groups(&mut items) {
                    r.unwrap();
                }
                for (g, b) in gs.iter().zip(&bufs) {
                    let want = model.get(g).cloned().unwrap_or(vec![0; gb]);
                    prop_assert_eq!(b, &want, "batched read of group {}", g);
                }
            }
            Op::WriteMany(ref ws) => {
                let groups: Vec<GroupIndex> = ws.iter().map(|w| GroupIndex(w.0)).collect();
                let rs = k.write_groups(&groups, |i, dst| {
                    let (_, seed, ok) = ws[i];
                    if !ok {
                        return Err(CascadeError::RegionFault("test: fill refused".into()));
                    }
                    dst.copy_from_slice(&pattern(seed, gb));
                    Ok(())
                });
                for (&(g, seed, ok), r) in ws.iter().zip(rs) {
                    prop_assert_eq!(r.is_ok(), ok, "write_groups entry for group {}", g);
                    if ok {
                        model.insert(g, pattern(seed, gb));
                    }
                }
            }
            Op::WriteSlots(ref ws, commit) => {
                let mut seen = std::collections::HashSet::new();
                let ws: Vec<(u64, u64)> = ws.iter().copied().filter(|w| seen.insert(w.0)).collect();
                let groups: Vec<GroupIndex> = ws.iter().map(|w| GroupIndex(w.0)).collect();
                let mut sw = k.claim_slots(&groups, false);
                let mut rest = Vec::new();
                for (i, &(g, seed)) in ws.iter().enumerate() {
                    match sw.bytes_mut(i) {
                        Some(b) => {
                            // What a failed device copy would leave: a torn mix.
                            b.copy_from_slice(&pattern(seed, gb));
                            if !commit {
                                b[..gb / 2].fill(0xa5);
                            }
                        }
                        None => rest.push((g, seed)),
                    }
                }
                if commit {
                    for &(g, seed) in ws.iter() {
                        model.insert(g, pattern(seed, gb));
                    }
                    sw.commit();
                } else {
                    for &(g, seed) in &rest {
                        model.insert(g, pattern(seed, gb));
                    }
                    drop(sw);
                }
                let gs: Vec<GroupIndex> = rest.iter().map(|w| GroupIndex(w.0)).collect();
                for r in k.write_groups(&gs, |i, dst| {
                    dst.copy_from_slice(&pattern(rest[i].1, gb));
                    Ok(())
                }) {
                    r.unwrap();
                }
            }
            Op::Flush(g) => k.flush(GroupIndex(g)).unwrap(),
            Op::Prefetch(g) => k.prefetch(GroupIndex(g)).unwrap(),
            Op::SyncAll => k.sync_all().unwrap(),
            Op::Reopen => {
                drop(cas.take());
                cas = Some(open_with(dir.path(), tier, remote, layout, c));
                // After a close every group is clean and where it belongs.
                let k = cas.as_ref().unwrap();
                for g in 0..layout.group_count() {
                    let q = k.query(GroupIndex(g)).unwrap();
                    prop_assert!(!q.dirty);
                    let want = if model.contains_key(&g) {
                        Residence::Backing
                    } else {
                        Residence::Empty
                    };
                    prop_assert_eq!(q.residence, want, "group {}", g);
                }
            }
        }
        let k = cas.as_ref().unwrap();
        let st = k.stats();
        prop_assert!(st.t1_slots_used <= st.t1_slots_total);
        prop_assert!(st.dirty_slots <= st.t1_slots_used);
    }
    // Every group, in full, matches the model at the end and after a reopen.
    for pass in 0..2 {
        let k = cas.as_ref().unwrap();
        for g in 0..layout.group_count() {
            let mut out = vec![0u8; gb];
            k.read(GroupIndex(g), 0, &mut out).unwrap();
            let want = model.get(&g).cloned().unwrap_or(vec![0; gb]);
            prop_assert_eq!(&out, &want, "group {} (pass {})", g, pass);
            let q = k.query(GroupIndex(g)).unwrap();
            if model.contains_key(&g) {
                prop_assert_ne!(q.residence, Residence::Empty);
            } else {
                prop_assert!(q.residence != Residence::Backing);
            }
        }
        drop(cas.take());
        cas = Some(open_with(dir.path(), tier, remote, layout, c));
    }
    prop_assert_eq!(cas.as_ref().unwrap().stats().checksum_failures, 0);
    Ok(())
}
