//! `kvfs bench backing`: random group reads through a tier, next to fio.
//!
//! Both read the same fully written file with the same block size (one
//! group stride), the same queue depth and the same O_DIRECT setting, for
//! the same time; the figure that matters is the ratio.

use super::{Rng, thousands};
use crate::geometry::{Dtype, GroupIndex, GroupLayout};
use crate::gpu::HostBuf;
use crate::tier::{FileTier, ReadOp, Tier, TierKind, UringTier};
use anyhow::{Context, bail};
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct BackingBench {
    pub dir: PathBuf,
    pub tier: TierKind,
    pub queue_depth: u32,
    pub group_bytes: u64,
    pub file_bytes: u64,
    pub seconds: f64,
    /// Rounds of (kvfs, fio), alternating which goes first, so a disk or
    /// host cache that warms up over the run favours neither.
    pub rounds: u32,
}

#[derive(Clone, Debug)]
pub struct BackingResult {
    pub kvfs_iops: f64,
    pub fio_iops: Option<f64>,
    pub direct: bool,
}

/// The bench's layout: one layer, one head, head_dim 128 bf16, with
/// block_tokens chosen to give the requested group size.
pub fn bench_layout(group_bytes: u64, file_bytes: u64) -> anyhow::Result<GroupLayout> {
    let per_token = 128 * Dtype::Bf16.bytes();
    if group_bytes == 0
        || !group_bytes.is_multiple_of(per_token)
        || !group_bytes.is_multiple_of(4096)
    {
        bail!("group size {group_bytes} must be a multiple of 4096 (e.g. 4k or 16k)");
    }
    let groups = file_bytes / group_bytes;
    if groups < 2 {
        bail!("file size {file_bytes} holds fewer than two groups of {group_bytes} bytes");
    }
    Ok(GroupLayout::new(
        1,
        groups / 2,
        1,
        (group_bytes / per_token) as u32,
        128,
        Dtype::Bf16,
    )?)
}

/// Writes the file in full (reads of holes would measure nothing), unless
/// it is already there at the right size with its blocks allocated.
fn prepare_file(path: &std::path::Path, bytes: u64) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    if let Ok(m) = std::fs::metadata(path)
        && m.len() == bytes
        && m.blocks() * 512 >= bytes
    {
        return Ok(());
    }
    eprintln!(
        "writing {} MiB bench file {} ...",
        bytes >> 20,
        path.display()
    );
    let mut f =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut chunk = vec![0u8; 1 << 20];
    let mut rng = Rng::new(7);
    let mut left = bytes;
    while left > 0 {
        for w in chunk.chunks_mut(8) {
            w.copy_from_slice(&rng.next_u64().to_le_bytes());
        }
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n])
            .with_context(|| format!("cannot write {}", path.display()))?;
        left -= n as u64;
    }
    f.sync_all()?;
    Ok(())
}

/// Random reads through the tier for `seconds`; returns reads per second.
fn run_tier(tier: &dyn Tier, queue_depth: u32, seconds: f64) -> anyhow::Result<f64> {
    let layout = *tier.layout();
    let stride = layout.stride() as usize;
    // Batches of sixteen queue depths: the queue drains only at the end of
    // a batch, which then costs about half a device latency in sixteen.
    let batch = (queue_depth as usize * 16).max(64);
    let mut bufs = HostBuf::alloc(stride * batch)?;
    let mut rng = Rng::new(42);
    let n = layout.group_count();
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let mut done = 0u64;
    while Instant::now() < deadline {
        let mut ops: Vec<ReadOp> = bufs
            .as_mut_slice()
            .chunks_mut(stride)
            .map(|buf| ReadOp {
                index: GroupIndex(rng.below(n)),
                buf,
            })
            .collect();
        for r in tier.read_batch(&mut ops) {
            r?;
        }
        done += ops.len() as u64;
    }
    Ok(done as f64 / start.elapsed().as_secs_f64())
}

fn run_fio(b: &BackingBench, path: &std::path::Path, direct: bool) -> anyhow::Result<Option<f64>> {
    let (engine, depth) = match b.tier {
        TierKind::Uring => ("io_uring", b.queue_depth),
        _ => ("psync", 1),
    };
    let out = Command::new("fio")
        .arg("--name=kvfs-bench")
        .arg(format!("--filename={}", path.display()))
        .arg("--rw=randread")
        .arg(format!("--bs={}", b.group_bytes))
        .arg(format!("--direct={}", direct as u8))
        .arg(format!("--ioengine={engine}"))
        .arg(format!("--iodepth={depth}"))
        .arg(format!(
            "--size={}",
            b.file_bytes / b.group_bytes * b.group_bytes
        ))
        .arg(format!("--runtime={}", b.seconds.ceil() as u64))
        .arg("--time_based")
        .arg("--norandommap")
        .arg("--randrepeat=0")
        .arg("--output-format=json")
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).context("cannot run fio"),
    };
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // fio may print warnings before the JSON document.
    let json = &text[text.find('{').context("fio printed no JSON")?..];
    let v: serde_json::Value = serde_json::from_str(json).context("cannot parse fio's JSON")?;
    let iops = v["jobs"][0]["read"]["iops"]
        .as_f64()
        .context("fio's JSON has no jobs[0].read.iops")?;
    Ok(Some(iops))
}

pub fn run(b: &BackingBench) -> anyhow::Result<BackingResult> {
    if b.tier == TierKind::Redis {
        bail!("the redis tier's bench needs --remote URL");
    }
    let layout = bench_layout(b.group_bytes, b.file_bytes)?;
    std::fs::create_dir_all(&b.dir)
        .with_context(|| format!("cannot create {}", b.dir.display()))?;
    let path = b.dir.join("kvfs-bench.data");
    prepare_file(&path, layout.backing_bytes())?;
    let (tier, direct): (Box<dyn Tier>, bool) = match b.tier {
        TierKind::Uring => {
            let t = UringTier::open(&path, layout, b.queue_depth)
                .with_context(|| format!("cannot open {} with io_uring", path.display()))?;
            let d = t.is_direct();
            (Box::new(t), d)
        }
        TierKind::File => (Box::new(FileTier::open(&path, layout)?), false),
        TierKind::Redis => bail!("the redis tier's bench needs --remote URL"),
    };
    let depth = if b.tier == TierKind::Uring {
        b.queue_depth
    } else {
        1
    };
    println!(
        "backing bench: tier {}, queue depth {}, {} KiB groups, {} MiB file {}, {}, {} s each",
        b.tier,
        depth,
        b.group_bytes >> 10,
        layout.backing_bytes() >> 20,
        path.display(),
        if direct { "O_DIRECT" } else { "buffered" },
        b.seconds
    );
    let mib = |iops: f64| iops * b.group_bytes as f64 / (1 << 20) as f64;
    let fio_name = if b.tier == TierKind::Uring {
        "uring"
    } else {
        "psync"
    };
    let (mut kvfs_sum, mut fio_sum, mut fio_missing) = (0.0, 0.0, false);
    let rounds = b.rounds.max(1);
    for round in 0..rounds {
        let mut order = [true, false];
        if round % 2 == 1 {
            order.reverse();
        }
        for is_kvfs in order {
            if is_kvfs {
                let iops = run_tier(tier.as_ref(), depth, b.seconds)?;
                kvfs_sum += iops;
                println!(
                    "  round {}  kvfs {:<6} {:>12} reads/s {:>9.1} MiB/s",
                    round + 1,
                    b.tier.to_string(),
                    thousands(iops as u64),
                    mib(iops)
                );
            } else if !fio_missing {
                match run_fio(b, &path, direct)? {
                    Some(iops) => {
                        fio_sum += iops;
                        println!(
                            "  round {}  fio  {:<6} {:>12} reads/s {:>9.1} MiB/s",
                            round + 1,
                            fio_name,
                            thousands(iops as u64),
                            mib(iops)
                        );
                    }
                    None => {
                        fio_missing = true;
                        println!("  fio is not installed: no baseline (apt-get install fio)");
                    }
                }
            }
        }
    }
    let kvfs_iops = kvfs_sum / rounds as f64;
    let fio_iops = (!fio_missing).then_some(fio_sum / rounds as f64);
    println!(
        "  mean     kvfs {:<6} {:>12} reads/s {:>9.1} MiB/s",
        b.tier.to_string(),
        thousands(kvfs_iops as u64),
        mib(kvfs_iops)
    );
    if let Some(f) = fio_iops {
        println!(
            "  mean     fio  {:<6} {:>12} reads/s {:>9.1} MiB/s",
            fio_name,
            thousands(f as u64),
            mib(f)
        );
        println!("  ratio kvfs/fio: {:.3}", kvfs_iops / f);
    }
    Ok(BackingResult {
        kvfs_iops,
        fio_iops,
        direct,
    })
}
