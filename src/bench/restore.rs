//! `kvfs bench restore`: batched restores through the control file into a
//! host region, next to a plain memcpy of the same bytes into the same
//! region in the same run (for stores: out of it). Groups of 4 KiB and 16 KiB; batches of 1, 64 and
//! 1024; all T1 hits, or all backing misses; and stores from the region
//! into T1-resident groups.

use super::{Rng, thousands};
use crate::cascade::Residence;
use crate::client::Client;
use crate::fs::{KvFs, MountOptions};
use crate::geometry::{Dtype, GroupIndex, GroupLayout};
use anyhow::{Context, bail};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct RestoreBench {
    pub dir: PathBuf,
    pub shm: PathBuf,
    pub seconds: f64,
    pub threads: usize,
}

/// One row of results.
#[derive(Clone, Debug)]
pub struct RestoreRow {
    pub group_bytes: u64,
    pub batch: usize,
    pub op: Op,
    pub gbps: f64,
    pub requests_per_s: f64,
    pub memcpy_gbps: f64,
}

/// What a row measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Restores of T1-resident groups.
    RestoreHits,
    /// Restores of groups only in the backing.
    RestoreMisses,
    /// Stores into T1-resident groups (write-back: nothing reaches the
    /// backing during the run).
    Store,
}

impl Op {
    fn label(self) -> &'static str {
        match self {
            Op::RestoreHits => "restore  T1 hits",
            Op::RestoreMisses => "restore  misses",
            Op::Store => "store    into T1",
        }
    }
}

const BATCHES: [usize; 3] = [1, 64, 1024];
/// Groups kept resident for the hit runs (the largest batch).
const HOT: u64 = 1024;
/// Groups in all: the rest are written, then evicted to the backing.
const GROUPS: u64 = 4096;

fn memcpy_gbps(dst: &mut [u8], src: &[u8], seconds: f64) -> f64 {
    let t = Instant::now();
    let mut bytes = 0u64;
    while t.elapsed().as_secs_f64() < seconds {
        dst.copy_from_slice(src);
        std::hint::black_box(&mut *dst);
        bytes += src.len() as u64;
    }
    bytes as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn run_size(b: &RestoreBench, block_tokens: u32) -> anyhow::Result<Vec<RestoreRow>> {
    // One layer, one head: group index = 2 × block (+1 for V).
    let layout = GroupLayout::new(1, GROUPS / 2, 1, block_tokens, 128, Dtype::Bf16)?;
    let gb = layout.group_bytes();
    let scratch = tempfile::Builder::new()
        .prefix("kvfs-bench-restore")
        .tempdir_in(&b.dir)?;
    let cascade = super::scratch_cascade(scratch.path(), layout, HOT + 64)?;
    let data: Vec<u8> = (0..gb as usize).map(|i| (i * 13 + 1) as u8).collect();
    // Cold groups first (they get evicted), then the hot set last.
    for g in (HOT..GROUPS).chain(0..HOT) {
        cascade.write(GroupIndex(g), 0, &data)?;
    }
    cascade.sync_all()?;
    let cold: Vec<u64> = (HOT..GROUPS)
        .filter(|&g| {
            matches!(
                cascade.query(GroupIndex(g)).map(|q| q.residence),
                Ok(Residence::Backing)
            )
        })
        .collect();
    let hot: Vec<u64> = (0..HOT)
        .filter(|&g| {
            matches!(
                cascade.query(GroupIndex(g)).map(|q| q.residence),
                Ok(Residence::T1)
            )
        })
        .collect();
    if cold.len() < 1024 || hot.len() < 1024 {
        bail!(
            "bench setup: {} hot and {} cold groups, need 1024 of each",
            hot.len(),
            cold.len()
        );
    }
    let mnt = scratch.path().join("mnt");
    std::fs::create_dir_all(&mnt)?;
    // Mounted as `kvfs mount` does (with the hook that drops cached pages
    // of stored groups), served from background threads.
    let opts = MountOptions {
        source: "kvfs-bench".into(),
        threads: b.threads,
        allow_other: false,
    };
    let fs = KvFs::new(cascade.clone(), 0, 0)
        .mount(&mnt, &opts)
        .and_then(|m| m.spawn())
        .with_context(|| format!("cannot mount at {}", mnt.display()))?;
    let client = Client::open(&mnt)?;
    let region_len = 1024 * gb;
    let region = tempfile::Builder::new()
        .prefix("kvfs-bench-region")
        .tempfile_in(&b.shm)?;
    region.as_file().set_len(region_len)?;
    let rid = client.register_host_region(region.path(), region_len)?;
    // The same mapping memcpy writes into, as the daemon's copies do.
    // SAFETY: a shared mapping of our own temporary file, used only here.
    let mut map = unsafe { memmap2::MmapMut::map_mut(region.as_file())? };
    let src = vec![0x5au8; region_len as usize];
    let mut sink = vec![0u8; region_len as usize];
    let mut rows = Vec::new();
    let mut rng = Rng::new(3);
    for op in [Op::RestoreHits, Op::RestoreMisses, Op::Store] {
        let set = if op == Op::RestoreMisses { &cold } else { &hot };
        if op == Op::Store {
            // The region holds the group's bytes, so every store keeps them.
            for c in map.chunks_mut(gb as usize) {
                c.copy_from_slice(&data);
            }
        }
        for &batch in &BATCHES {
            let bytes = batch as u64 * gb;
            // The baseline copies in the op's direction: into the region
            // for restores, out of it for stores.
            let base = if op == Op::Store {
                memcpy_gbps(
                    &mut sink[..bytes as usize],
                    &map[..bytes as usize],
                    b.seconds / 2.0,
                )
            } else {
                memcpy_gbps(
                    &mut map[..bytes as usize],
                    &src[..bytes as usize],
                    b.seconds / 2.0,
                )
            };
            let t = Instant::now();
            let mut n = 0u64;
            while t.elapsed() < Duration::from_secs_f64(b.seconds) {
                // Distinct groups: a window of the set at a random start.
                let start = rng.below(set.len() as u64) as usize;
                let entries: Vec<_> = (0..batch)
                    .map(|i| {
                        let g = set[(start + i) % set.len()];
                        (
                            layout.key(GroupIndex(g)).expect("in range"),
                            rid,
                            i as u64 * gb,
                        )
                    })
                    .collect();
                let ticket = if op == Op::Store {
                    client.store(&entries)?
                } else {
                    client.restore(&entries)?
                };
                client.wait(ticket, None)?;
                n += 1;
            }
            let secs = t.elapsed().as_secs_f64();
            if map[..gb as usize] != data[..] {
                bail!("restored bytes differ from the group's");
            }
            if op == Op::Store {
                let mut back = vec![0u8; gb as usize];
                cascade.read(GroupIndex(set[0]), 0, &mut back)?;
                if back != data {
                    bail!("a stored group differs from the region's bytes");
                }
            }
            rows.push(RestoreRow {
                group_bytes: gb,
                batch,
                op,
                gbps: (n * bytes) as f64 / secs / 1e9,
                requests_per_s: n as f64 / secs,
                memcpy_gbps: base,
            });
        }
    }
    if gb == 16 << 10 {
        ticket_rates(b, &client, rid, &layout, &hot, &mut map, &src)?;
    }
    drop(map);
    drop(client);
    drop(fs.unmount());
    Ok(rows)
}

/// Tickets in flight in the small-ticket runs.
const IN_FLIGHT: usize = 64;

/// Small tickets (one group each, IN_FLIGHT in flight, one client thread):
/// through ioctls (RESTORE, then WAIT for the oldest) and through the
/// fd's ring (`control::ring`), next to memcpy of the same bytes.
fn ticket_rates(
    b: &RestoreBench,
    client: &Client,
    rid: u32,
    layout: &GroupLayout,
    hot: &[u64],
    map: &mut [u8],
    src: &[u8],
) -> anyhow::Result<()> {
    let gb = layout.group_bytes() as usize;
    let entry = |i: usize| {
        let g = hot[i % hot.len()];
        (
            layout.key(GroupIndex(g)).expect("in range"),
            rid,
            ((i % IN_FLIGHT) * gb) as u64,
        )
    };
    let base = memcpy_gbps(&mut map[..gb], &src[..gb], b.seconds / 2.0);
    let t = Instant::now();
    let (mut n, mut pending) = (0u64, std::collections::VecDeque::new());
    while t.elapsed() < Duration::from_secs_f64(b.seconds) {
        pending.push_back(client.restore(&[entry(n as usize)])?);
        if pending.len() >= IN_FLIGHT {
            client
                .wait(pending.pop_front().expect("in flight"), None)?
                .ok()?;
        }
        n += 1;
    }
    for t in pending {
        client.wait(t, None)?.ok()?;
    }
    let ioctl = n as f64 / t.elapsed().as_secs_f64();
    let mut ring = client.ring(&b.shm, 2 * IN_FLIGHT as u32, (hot.len() * 32) as u64)?;
    let at: Vec<u64> = (0..hot.len())
        .map(|i| ring.put_entries(i * 32, &[entry(i)]))
        .collect();
    let t = Instant::now();
    let (mut n, mut flying, mut failed) = (0u64, 0usize, 0u64);
    while t.elapsed() < Duration::from_secs_f64(b.seconds) {
        while flying < IN_FLIGHT
            && ring.submit(
                n,
                crate::control::wire::Command::Restore,
                1,
                at[n as usize % at.len()],
            )
        {
            flying += 1;
            n += 1;
        }
        for c in ring.reap(1, IN_FLIGHT, Some(Duration::from_secs(10))) {
            flying -= 1;
            failed += (c.status != 0) as u64;
        }
    }
    while flying > 0 {
        for c in ring.reap(1, IN_FLIGHT, Some(Duration::from_secs(10))) {
            flying -= 1;
            failed += (c.status != 0) as u64;
        }
    }
    if failed > 0 {
        bail!("{failed} ring tickets failed");
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    // Submission cost of a 1024-entry batch (pre-encoded): a RESTORE
    // ioctl (the client waits for admission) against a ring submission.
    let batch: Vec<_> = (0..1024)
        .map(|i| {
            let (k, r, _) = entry(i);
            (k, r, (i * gb) as u64)
        })
        .collect();
    let (mut ioctl_us, mut ring_us) = (Vec::new(), Vec::new());
    // Each ticket's whole round trip too, one at a time (the client waits
    // for each before it submits the next, as an engine restoring layer
    // by layer may).
    let (mut ioctl_trip, mut ring_trip) = (Vec::new(), Vec::new());
    let big = ring.put_entries(hot.len() * 32 - 1024 * 32, &batch);
    for _ in 0..50 {
        let t0 = Instant::now();
        let tk = client.restore(&batch)?;
        ioctl_us.push(t0.elapsed().as_secs_f64() * 1e6);
        client.wait(tk, None)?.ok()?;
        ioctl_trip.push(t0.elapsed().as_secs_f64() * 1e6);
        let t0 = Instant::now();
        if !ring.submit(0, crate::control::wire::Command::Restore, 1024, big) {
            bail!("the ring is full with nothing in flight");
        }
        ring_us.push(t0.elapsed().as_secs_f64() * 1e6);
        let c = ring.reap(1, 1, Some(Duration::from_secs(10)));
        ring_trip.push(t0.elapsed().as_secs_f64() * 1e6);
        if c.first().is_none_or(|c| c.status != 0) {
            bail!("a 1024-entry ring restore failed: {c:?}");
        }
    }
    let ticket_bytes = 1024 * gb;
    let copy_gbps = memcpy_gbps(
        &mut map[..ticket_bytes],
        &src[..ticket_bytes],
        b.seconds / 2.0,
    );
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "  submitting 1024 pre-encoded entries ({} KiB groups): RESTORE ioctl {:.1} us of client \
         time (admission included), ring submission {:.2} us (admission runs in the daemon after)",
        gb >> 10,
        median(ioctl_us),
        median(ring_us)
    );
    let (io, ri) = (median(ioctl_trip), median(ring_trip));
    let gbps = |us: f64| ticket_bytes as f64 / us / 1e3;
    println!(
        "  one 1024-group ticket at a time ({} MiB, resident in T1): RESTORE + WAIT ioctls {io:.0} us \
         ({:.2} GB/s, {:.2} of memcpy), the fd's ring {ri:.0} us ({:.2} GB/s, {:.2}); memcpy of \
         the same bytes {copy_gbps:.2} GB/s",
        ticket_bytes >> 20,
        gbps(io),
        gbps(io) / copy_gbps,
        gbps(ri),
        gbps(ri) / copy_gbps,
    );
    let mb = |r: f64| r * gb as f64 / 1e9;
    println!(
        "  {:>3} KiB tickets of one group, {IN_FLIGHT} in flight, one client thread: RESTORE + WAIT \
         ioctls {} tickets/s ({:.2} GB/s); the fd's ring {} tickets/s ({:.2} GB/s); memcpy of a \
         group {base:.2} GB/s",
        gb >> 10,
        thousands(ioctl as u64),
        mb(ioctl),
        thousands(rate as u64),
        mb(rate),
    );
    Ok(())
}

pub fn run(b: &RestoreBench) -> anyhow::Result<Vec<RestoreRow>> {
    println!(
        "restore bench: restores into and stores from a {} region through .kvfs/control, one ticket at a time, {} s a cell; baseline: memcpy of the same bytes into (restores) or out of (stores) the same region",
        b.shm.display(),
        b.seconds
    );
    println!("  group   batch  what                GB/s   requests/s   memcpy GB/s   ratio");
    let mut all = Vec::new();
    for bt in [16u32, 64] {
        for r in run_size(b, bt)? {
            println!(
                "  {:>3} KiB {:>6}  {:<16} {:>8.2} {:>12} {:>13.2} {:>7.2}",
                r.group_bytes >> 10,
                r.batch,
                r.op.label(),
                r.gbps,
                thousands(r.requests_per_s as u64),
                r.memcpy_gbps,
                r.gbps / r.memcpy_gbps
            );
            all.push(r);
        }
    }
    Ok(all)
}
