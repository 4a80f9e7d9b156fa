//! Strided RESTORE/STORE entries through a real mount (host regions): an
//! engine layout where K and V interleave row by row, as vLLM's
//! `[blocks, kv_heads, block_size, 2 × head_size]` does, stored and
//! restored byte for byte; entries named in a region; every bad shape
//! refused, and the daemon still serving (root and /dev/fuse needed).

mod common;
use common::*;

use kvfs::client::{Client, Strided};
use kvfs::control::wire::{self, Request};
use kvfs::geometry::{GroupKey, Kind};
use std::fs;

// The harness's default mount: 2 layers × 8 blocks × 2 heads × {K,V},
// groups (GB) of 16 tokens × 64 × bf16 = 2 KiB: 16 rows of 128 bytes in
// the engine's layout.
const ROW: u32 = 128; // one token's K (or V) of one head
const PITCH: u64 = 256; // one token's K and V
const SLICE: u64 = 16 * PITCH; // a (block, head): block_tokens rows of K|V

/// The engine-layout entry of (layer 0, block, head, kind): K rows at the
/// slice's start, V rows `ROW` bytes in.
fn entry(region: u32, block: u64, head: u32, kind: Kind) -> Strided {
    Strided {
        key: GroupKey::new(0, block, head, kind),
        region,
        offset: (block * 2 + head as u64) * SLICE + if kind == Kind::V { ROW as u64 } else { 0 },
        row_bytes: ROW,
        pitch: PITCH,
    }
}

fn all(region: u32) -> Vec<Strided> {
    let mut v = Vec::new();
    for block in 0..8 {
        for head in 0..2 {
            for kind in [Kind::K, Kind::V] {
                v.push(entry(region, block, head, kind));
            }
        }
    }
    v
}

/// The group's bytes as the engine layout holds them: its rows, gathered.
fn gathered(layout: &[u8], e: &Strided) -> Vec<u8> {
    (0..16u64)
        .flat_map(|r| {
            let at = (e.offset + r * e.pitch) as usize;
            layout[at..at + e.row_bytes as usize].to_vec()
        })
        .collect()
}

/// A mount, a client, and a host region (registered) holding layer 0 of
/// the engine's cache, filled with `pattern(seed)`.
fn engine_layer(seed: u64) -> (Mount, Client, ShmRegion, u32) {
    let m = Mount::new(&[]);
    let c = Client::open(&m.mp).unwrap();
    let len = 8 * 2 * SLICE;
    let src = ShmRegion::new(len);
    src.write(0, &pattern(seed, len as usize));
    let rs = c.register_host_region(&src.path(), src.len).unwrap();
    (m, c, src, rs)
}

/// `engine_layer`, stored whole through strided entries: the mount, the
/// client, the region's length and id, and the layout's bytes.
fn stored_layer(seed: u64) -> (Mount, Client, u64, u32, Vec<u8>) {
    let (m, c, src, rs) = engine_layer(seed);
    let layout = src.read(0, src.len as usize);
    let t = c.store_strided(&all(rs)).unwrap();
    c.wait(t, None).unwrap().ok().unwrap();
    (m, c, src.len, rs, layout)
}

#[test]
fn interleaved_k_and_v_round_trip_byte_for_byte() {
    if !can_mount() {
        return;
    }
    let (m, c, len, rs, layout) = stored_layer(7);
    // Each group file holds its rows, gathered: kvfs keeps groups contiguous.
    for e in all(rs) {
        let got = fs::read(m.p(&e.key.to_string())).unwrap();
        assert_eq!(got, gathered(&layout, &e), "{}", e.key);
    }
    // Restored into a fresh region in the same layout: the same bytes,
    // K and V rows interleaving (their spans overlap, their rows do not).
    let dst = ShmRegion::new(len);
    let rd = c.register_host_region(&dst.path(), dst.len).unwrap();
    let t = c.restore_strided(&all(rd)).unwrap();
    c.wait(t, None).unwrap().ok().unwrap();
    assert_eq!(dst.read(0, len as usize), layout);
    // A batch mixing contiguous and strided entries, restored in reverse
    // order: contiguous groups land whole, strided ones row by row.
    let mixed = ShmRegion::new(len + 4 * GB as u64);
    let rm = c.register_host_region(&mixed.path(), mixed.len).unwrap();
    let mut entries = all(rm);
    for (i, kind) in [Kind::K, Kind::V].into_iter().enumerate() {
        entries.push(Strided {
            key: GroupKey::new(0, 3, 1, kind),
            region: rm,
            offset: len + (i * GB) as u64,
            row_bytes: 0,
            pitch: 0,
        });
    }
    entries.reverse();
    let t = c.restore_strided(&entries).unwrap();
    c.wait(t, None).unwrap().ok().unwrap();
    assert_eq!(mixed.read(0, len as usize), layout);
    for (i, kind) in [Kind::K, Kind::V].into_iter().enumerate() {
        assert_eq!(
            mixed.read(len + (i * GB) as u64, GB),
            gathered(&layout, &entry(rs, 3, 1, kind))
        );
    }
}

#[test]
fn strided_entries_named_in_a_region() {
    if !can_mount() {
        return;
    }
    let (_m, c, src, rs) = engine_layer(11);
    let (len, layout) = (src.len, src.read(0, src.len as usize));
    let dst = ShmRegion::new(len);
    let rd = c.register_host_region(&dst.path(), dst.len).unwrap();
    let list = ShmRegion::new(64 + 32 * wire::STRIDED_ENTRY_BYTES as u64);
    let rl = c.register_host_region(&list.path(), list.len).unwrap();
    let encode = |region: u32| {
        let entries: Vec<wire::IoEntry> = all(region)
            .iter()
            .map(|e| wire::IoEntry {
                key: wire::RawKey::from_key(e.key),
                region: e.region,
                offset: e.offset,
                row_bytes: e.row_bytes,
                pitch: e.pitch,
            })
            .collect();
        let mut bytes = Vec::new();
        wire::encode_strided_entries(&mut bytes, &entries);
        bytes
    };
    for (region, store) in [(rs, true), (rd, false)] {
        list.write(64, &encode(region));
        let at = wire::EntriesAt {
            region: rl,
            offset: 64,
            count: 32,
            strided: true,
        };
        let req = if store {
            Request::StoreFrom(at)
        } else {
            Request::RestoreFrom(at)
        };
        let bytes = wire::encode_request(&req);
        assert_eq!(bytes.len(), wire::HEADER_BYTES);
        let rep = c.ioctl_bytes(&bytes, 1024).unwrap();
        assert_eq!(rep.status, 0, "{}", rep.message);
        c.wait(rep.value, None).unwrap().ok().unwrap();
    }
    assert_eq!(dst.read(0, len as usize), layout);
}

#[test]
fn bad_strided_entries_are_refused_and_nothing_changes() {
    if !can_mount() {
        return;
    }
    let (m, c, reg, r) = engine_layer(3);
    let len = reg.len;
    let good = entry(r, 0, 0, Kind::K);
    let cases: Vec<(&str, Vec<Strided>, i32, &str)> = vec![
        (
            "rows that do not divide the group",
            vec![Strided {
                row_bytes: 96,
                ..good
            }],
            libc::EINVAL,
            "do not divide",
        ),
        (
            "a pitch shorter than a row",
            vec![Strided { pitch: 64, ..good }],
            libc::EINVAL,
            "less than a row",
        ),
        (
            "the last row outside the region",
            vec![Strided {
                offset: len - 15 * PITCH,
                ..good
            }],
            libc::EFAULT,
            "outside region",
        ),
        (
            "K and V rows that collide",
            vec![
                good,
                Strided {
                    key: GroupKey::new(0, 0, 0, Kind::V),
                    offset: 64,
                    ..good
                },
            ],
            libc::EINVAL,
            "overlapping",
        ),
        (
            "a contiguous group over strided rows",
            vec![
                good,
                Strided {
                    key: GroupKey::new(0, 1, 0, Kind::K),
                    region: r,
                    offset: 2 * PITCH + 8,
                    row_bytes: 0,
                    pitch: 0,
                },
            ],
            libc::EINVAL,
            "overlapping",
        ),
    ];
    for (what, entries, want, words) in cases {
        let (e, _, msg) = errno(c.restore_strided(&entries));
        assert_eq!(e, want, "{what}: {msg}");
        assert!(msg.contains(words), "{what}: {msg}");
    }
    // The region was not touched, nothing was stored, and the fd still serves.
    assert_eq!(reg.read(0, len as usize), pattern(3, len as usize));
    assert_eq!(c.query(&[good.key]).unwrap()[0].state, wire::STATE_EMPTY);
    // A STORE may read overlapping rows (sources are only read).
    let both = vec![
        good,
        Strided {
            key: GroupKey::new(0, 0, 1, Kind::K),
            ..good
        },
    ];
    let t = c.store_strided(&both).unwrap();
    c.wait(t, None).unwrap().ok().unwrap();
    let layout = reg.read(0, len as usize);
    for e in &both {
        assert_eq!(
            fs::read(m.p(&e.key.to_string())).unwrap(),
            gathered(&layout, e)
        );
    }
}

/// Strided restores write each group's rows straight into the region:
/// a group never written comes back as zeros over whatever the region
/// held, and every written group as its own bytes, round after round.
#[test]
fn a_strided_restore_of_unwritten_groups_writes_zeros() {
    if !can_mount() {
        return;
    }
    let (_m, c, len, _, layout) = stored_layer(11);
    let dst = ShmRegion::new(len);
    let rd = c.register_host_region(&dst.path(), dst.len).unwrap();
    // Layer 1 was never written: the same places, its keys.
    let unwritten: Vec<Strided> = all(rd)
        .into_iter()
        .map(|mut e| {
            e.key = GroupKey::new(1, e.key.block, e.key.head, e.key.kind);
            e
        })
        .collect();
    for round in 0..4 {
        let t = c.restore_strided(&all(rd)).unwrap();
        c.wait(t, None).unwrap().ok().unwrap();
        assert_eq!(dst.read(0, len as usize), layout, "round {round}");
        dst.write(0, &vec![0xAA; len as usize]);
        let t = c.restore_strided(&unwritten).unwrap();
        c.wait(t, None).unwrap().ok().unwrap();
        assert!(
            dst.read(0, len as usize).iter().all(|&b| b == 0),
            "round {round}: a never-written group did not come back as zeros"
        );
    }
}
