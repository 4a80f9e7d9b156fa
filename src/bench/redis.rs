//! `kvfs bench backing --tier redis`: random group reads and writes
//! through the redis tier, next to `redis-benchmark` against the same
//! server in the same run.
//!
//! Both sides use the same value size (one group), the same pipeline depth
//! (`--qd`: kvfs pipelines a batch of `qd` commands a round trip, as
//! `redis-benchmark -P qd` does) and the same number of connections
//! (`--connections`: kvfs runs that many threads, each taking its own
//! pooled connection). Rounds alternate which side goes first. The
//! figure that matters is the ratio; the group header kvfs stores with
//! each value (32 bytes) is part of what it pays.

use super::{Rng, thousands};
use crate::geometry::{GroupIndex, GroupLayout};
use crate::gpu::HostBuf;
use crate::tier::{ReadOp, RedisTier, RemoteConfig, Tier, WriteOp, copy_index};
use anyhow::{Context, bail};
use std::process::Command;
use std::time::{Duration, Instant};

/// The bench's store identity: fixed, so a rerun finds its groups written
/// (like the reused fio file) and a server's other keys are never touched.
const BENCH_UUID: [u8; 16] = *b"kvfs-bench-store";

#[derive(Clone)]
pub struct RedisBench {
    pub remote: RemoteConfig,
    pub layout: GroupLayout,
    pub connections: usize,
    pub seconds: f64,
    pub rounds: u32,
}

/// kvfs's rate: `connections` threads, each a batch of `qd` random groups
/// a call, for `seconds`.
fn run_kvfs(tier: &RedisTier, b: &RedisBench, write: bool) -> anyhow::Result<f64> {
    let layout = b.layout;
    let stride = layout.stride() as usize;
    let qd = b.remote.qd;
    let n = layout.group_count();
    let deadline = Instant::now() + Duration::from_secs_f64(b.seconds);
    let start = Instant::now();
    let done: Vec<anyhow::Result<u64>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..b.connections)
            .map(|t| {
                s.spawn(move || -> anyhow::Result<u64> {
                    let mut bufs = HostBuf::alloc(stride * qd)?;
                    let mut rng = Rng::new(7 + t as u64);
                    let mut done = 0u64;
                    while Instant::now() < deadline {
                        let idx: Vec<GroupIndex> = (0..qd)
                            .map(|_| copy_index(GroupIndex(rng.below(n)), 0))
                            .collect();
                        let results = if write {
                            let ops: Vec<WriteOp> = bufs
                                .as_slice()
                                .chunks(stride)
                                .zip(&idx)
                                .map(|(buf, &index)| WriteOp {
                                    index,
                                    buf,
                                    generation: 1,
                                })
                                .collect();
                            tier.write_batch(&ops)
                        } else {
                            let mut ops: Vec<ReadOp> = bufs
                                .as_mut_slice()
                                .chunks_mut(stride)
                                .zip(&idx)
                                .map(|(buf, &index)| ReadOp { index, buf })
                                .collect();
                            tier.read_batch(&mut ops)
                        };
                        for r in results {
                            r?;
                        }
                        done += qd as u64;
                    }
                    Ok(done)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a bench thread panicked"))
            .collect()
    });
    let mut total = 0;
    for d in done {
        total += d?;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// How redis-benchmark reaches the server the first URL names, with the
/// same TLS settings as the tier (`remote`).
fn server_args(url: &str, remote: &RemoteConfig) -> anyhow::Result<Vec<String>> {
    if let Some(path) = url.strip_prefix("unix://") {
        return Ok(vec!["-s".into(), path.into()]);
    }
    let (tls, rest) = match url.strip_prefix("rediss://") {
        Some(r) => (true, r),
        None => (
            false,
            url.strip_prefix("redis://")
                .with_context(|| format!("{url}: not a redis:// or unix:// URL"))?,
        ),
    };
    let hostport = rest.rsplit('@').next().unwrap_or(rest);
    let hostport = hostport.split('/').next().unwrap_or(hostport);
    let (host, port) = hostport.rsplit_once(':').unwrap_or((hostport, "6379"));
    let mut a = vec!["-h".into(), host.into(), "-p".into(), port.into()];
    if tls {
        a.push("--tls".into());
        if url.ends_with("#insecure") {
            a.push("--insecure".into());
        }
        if let Some(ca) = &remote.ca {
            a.extend(["--cacert".into(), ca.display().to_string()]);
        }
        if let Some((cert, key)) = &remote.client_cert {
            a.extend(["--cert".into(), cert.display().to_string()]);
            a.extend(["--key".into(), key.display().to_string()]);
        }
    }
    Ok(a)
}

/// redis-benchmark's rate for `test` (GET or SET) with the same value
/// size, depth, connections and key space; None if it is not installed.
fn run_redis_benchmark(b: &RedisBench, test: &str, requests: u64) -> anyhow::Result<Option<f64>> {
    let mut cmd = Command::new("redis-benchmark");
    cmd.args(server_args(&b.remote.urls[0], &b.remote)?)
        .args(["-t", &test.to_ascii_lowercase()])
        .args(["-d", &b.layout.group_bytes().to_string()])
        .args(["-P", &b.remote.qd.to_string()])
        .args(["-c", &b.connections.to_string()])
        .args(["-r", &b.layout.group_count().to_string()])
        .args(["-n", &requests.to_string()])
        .args(["--threads", &b.connections.min(4).to_string()])
        .arg("--csv");
    if b.remote.urls.len() > 1 {
        cmd.arg("--cluster");
    }
    let out = match cmd.output() {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).context("cannot run redis-benchmark"),
    };
    if !out.status.success() {
        bail!(
            "redis-benchmark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // --csv: a header line, then "GET","103092.78",…
    let text = String::from_utf8_lossy(&out.stdout);
    let want = format!("\"{test}\"");
    let rps = text
        .lines()
        .find(|l| l.starts_with(&want))
        .and_then(|l| l.split(',').nth(1))
        .map(|v| v.trim_matches('"').parse::<f64>())
        .with_context(|| format!("redis-benchmark printed no {test} line: {text}"))?
        .context("redis-benchmark's rate is not a number")?;
    Ok(Some(rps))
}

pub fn run(b: &RedisBench) -> anyhow::Result<()> {
    let tier = RedisTier::connect(b.layout, BENCH_UUID, &b.remote).map_err(anyhow::Error::msg)?;
    let gb = b.layout.group_bytes();
    println!(
        "redis bench: {}, {} KiB groups, {} groups ({} MiB), pipeline depth {}, {} connections, {} s each",
        tier.describe(),
        gb >> 10,
        b.layout.group_count(),
        (b.layout.group_count() * gb) >> 20,
        b.remote.qd,
        b.connections,
        b.seconds
    );
    for w in tier.warnings() {
        println!("  note: {w}");
    }
    // Every group once, so reads find values (and redis-benchmark's SETs
    // fill its own key space the same way before its GETs).
    let t = Instant::now();
    let stride = b.layout.stride() as usize;
    let mut buf = HostBuf::alloc(stride * 256)?;
    for (i, x) in buf.as_mut_slice().iter_mut().enumerate() {
        *x = (i * 31 + 7) as u8;
    }
    let n = b.layout.group_count();
    for first in (0..n).step_by(256) {
        let ops: Vec<WriteOp> = (first..(first + 256).min(n))
            .zip(buf.as_slice().chunks(stride))
            .map(|(g, buf)| WriteOp {
                index: copy_index(GroupIndex(g), 0),
                buf,
                generation: 1,
            })
            .collect();
        for r in tier.write_batch(&ops) {
            r?;
        }
    }
    println!("  filled in {:.1} s", t.elapsed().as_secs_f64());
    // Size redis-benchmark's run to about the same time as kvfs's.
    let probe = run_kvfs(
        &tier,
        &RedisBench {
            seconds: 0.5,
            ..b.clone()
        },
        false,
    )?;
    let requests = ((probe * b.seconds) as u64).max(10_000);
    let mut missing = false;
    for (test, write) in [("GET", false), ("SET", true)] {
        let (mut k_sum, mut r_sum) = (0.0, 0.0);
        let rounds = b.rounds.max(1);
        for round in 0..rounds {
            let mut order = [true, false];
            if round % 2 == 1 {
                order.reverse();
            }
            for is_kvfs in order {
                if is_kvfs {
                    let rate = run_kvfs(&tier, b, write)?;
                    k_sum += rate;
                    println!(
                        "  round {}  {test}  kvfs            {:>10} ops/s {:>9.1} MiB/s",
                        round + 1,
                        thousands(rate as u64),
                        rate * gb as f64 / (1 << 20) as f64
                    );
                } else if !missing {
                    if test == "GET" && round == 0 {
                        // Its GETs must find values as kvfs's do (a nil
                        // reply costs the server far less): ten random
                        // passes over the key space leave e^-10 of it empty.
                        run_redis_benchmark(b, "SET", 10 * b.layout.group_count())?;
                    }
                    match run_redis_benchmark(b, test, requests)? {
                        Some(rate) => {
                            r_sum += rate;
                            println!(
                                "  round {}  {test}  redis-benchmark {:>10} ops/s {:>9.1} MiB/s",
                                round + 1,
                                thousands(rate as u64),
                                rate * gb as f64 / (1 << 20) as f64
                            );
                        }
                        None => {
                            missing = true;
                            println!(
                                "  redis-benchmark is not installed: no baseline (apt-get install redis-tools)"
                            );
                        }
                    }
                }
            }
        }
        let k = k_sum / rounds as f64;
        println!(
            "  mean     {test}  kvfs            {:>10} ops/s",
            thousands(k as u64)
        );
        if !missing {
            let r = r_sum / rounds as f64;
            println!(
                "  mean     {test}  redis-benchmark {:>10} ops/s",
                thousands(r as u64)
            );
            println!("  ratio kvfs/redis-benchmark ({test}): {:.3}", k / r);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{RemoteConfig, server_args};
    use std::path::PathBuf;

    #[test]
    fn redis_benchmark_reaches_the_server_as_the_tier_does() {
        let plain = RemoteConfig::new(Vec::new());
        let args = |url: &str, c: &RemoteConfig| server_args(url, c).unwrap().join(" ");
        assert_eq!(args("redis://u:p@h:7000/2", &plain), "-h h -p 7000");
        assert_eq!(args("unix:///run/r.sock", &plain), "-s /run/r.sock");
        assert_eq!(
            args("rediss://h:7000/#insecure", &plain),
            "-h h -p 7000 --tls --insecure"
        );
        let tls = RemoteConfig {
            ca: Some(PathBuf::from("/c/ca.pem")),
            client_cert: Some((PathBuf::from("/c/me.pem"), PathBuf::from("/c/me.key"))),
            ..plain
        };
        assert_eq!(
            args("rediss://h:7000", &tls),
            "-h h -p 7000 --tls --cacert /c/ca.pem --cert /c/me.pem --key /c/me.key"
        );
        assert!(server_args("http://h:1", &tls).is_err());
    }
}
