//! `kvfs bench restore`: batched restores through the control file into a
//! host region, next to a plain memcpy of the same bytes into the same
//! region in the same run. Groups of 4 KiB and 16 KiB; batches of 1, 64 and
//! 1024; all T1 hits, or all backing misses.

use super::{Rng, thousands};
use crate::cascade::Residence;
use crate::client::Client;
use crate::fs::{KvFs, mount_background};
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
    pub hits: bool,
    pub gbps: f64,
    pub requests_per_s: f64,
    pub memcpy_gbps: f64,
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
    let fs = mount_background(KvFs::new(cascade.clone(), 0, 0), &mnt, b.threads)
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
    let mut rows = Vec::new();
    let mut rng = Rng::new(3);
    for hits in [true, false] {
        let set = if hits { &hot } else { &cold };
        for &batch in &BATCHES {
            let bytes = batch as u64 * gb;
            let base = memcpy_gbps(
                &mut map[..bytes as usize],
                &src[..bytes as usize],
                b.seconds / 2.0,
            );
            let t = Instant::now();
            let mut n = 0u64;
            while t.elapsed() < Duration::from_secs_f64(b.seconds) {
                let entries: Vec<_> = (0..batch as u64)
                    .map(|i| {
                        let g = set[rng.below(set.len() as u64) as usize];
                        (layout.key(GroupIndex(g)).expect("in range"), rid, i * gb)
                    })
                    .collect();
                let ticket = client.restore(&entries)?;
                client.wait(ticket, None)?;
                n += 1;
            }
            let secs = t.elapsed().as_secs_f64();
            if map[..gb as usize] != data[..] {
                bail!("restored bytes differ from the group's");
            }
            rows.push(RestoreRow {
                group_bytes: gb,
                batch,
                hits,
                gbps: (n * bytes) as f64 / secs / 1e9,
                requests_per_s: n as f64 / secs,
                memcpy_gbps: base,
            });
        }
    }
    drop(map);
    drop(client);
    drop(fs.unmount());
    Ok(rows)
}

pub fn run(b: &RestoreBench) -> anyhow::Result<Vec<RestoreRow>> {
    println!(
        "restore bench: restores into a {} region through .kvfs/control, one ticket at a time, {} s a cell; baseline: memcpy of the same bytes into the same region",
        b.shm.display(),
        b.seconds
    );
    println!("  group   batch  source    restore GB/s   requests/s   memcpy GB/s   ratio");
    let mut all = Vec::new();
    for bt in [16u32, 64] {
        for r in run_size(b, bt)? {
            println!(
                "  {:>3} KiB {:>6}  {:<8} {:>12.2} {:>12} {:>13.2} {:>7.2}",
                r.group_bytes >> 10,
                r.batch,
                if r.hits { "T1 hits" } else { "misses" },
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
