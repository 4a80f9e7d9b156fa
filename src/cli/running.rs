//! Commands against a running mount: `kvfs umount`, `kvfs sync`, `kvfs stat`
//! (and `--watch`). They talk to the daemon through `.kvfs/` files only.

use super::system::{SOURCE_PREFIX, dead_kvfs_mount, mount_entry, process_alive, unmount};
use anyhow::{Context, Result, bail};
use kvfs::control::wire::MountLayout;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::{Duration, Instant};

/// What a command finds at a kvfs mount whose daemon died.
fn daemon_gone(mp: &Path) -> anyhow::Error {
    anyhow::anyhow!(
        "the kvfs daemon of {} is gone (killed or crashed); `kvfs umount {}` removes its dead mount, then mount again",
        mp.display(),
        mp.display()
    )
}

fn read_kvfs_file(mp: &Path, name: &str) -> Result<String> {
    let p = mp.join(".kvfs").join(name);
    std::fs::read_to_string(&p).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOTCONN) => daemon_gone(mp),
        _ => anyhow::Error::new(e).context(format!(
            "cannot read {} (is {} a kvfs mount?)",
            p.display(),
            mp.display()
        )),
    })
}

fn check_kvfs(mp: &Path) -> Result<()> {
    match mount_entry(mp) {
        Some((t, src)) if t.starts_with("fuse") && src.starts_with(SOURCE_PREFIX) => Ok(()),
        Some((t, src)) => bail!("{} is not a kvfs mount ({src}, {t})", mp.display()),
        None => bail!("nothing is mounted at {}", mp.display()),
    }
}

fn dirty_bytes(mp: &Path) -> Option<u64> {
    let s = read_kvfs_file(mp, "stats").ok()?;
    kvfs::stats::find_sample(&s, kvfs::stats::DIRTY_BYTES).map(|v| v as u64)
}

pub(super) fn human(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i < units.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", units[i])
}

/// Writes back every dirty group through `.kvfs/flush`, showing progress
/// when it takes over a second.
pub fn flush(mp: &Path) -> Result<()> {
    check_kvfs(mp)?;
    if dead_kvfs_mount(mp) {
        return Err(daemon_gone(mp));
    }
    let total = dirty_bytes(mp).unwrap_or(0);
    let p = mp.join(".kvfs/flush");
    let worker = std::thread::spawn(move || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).open(&p)?;
        f.write_all(b"1\n")
    });
    let start = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let mut last_log = Instant::now();
    while !worker.is_finished() {
        std::thread::sleep(Duration::from_millis(200));
        if start.elapsed() < Duration::from_secs(1) || worker.is_finished() {
            continue;
        }
        let left = dirty_bytes(mp).unwrap_or(0);
        let done = total.saturating_sub(left) as f64;
        let rate = done / start.elapsed().as_secs_f64();
        let eta = if rate > 0.0 {
            left as f64 / rate
        } else {
            f64::INFINITY
        };
        let frac = if total > 0 { done / total as f64 } else { 1.0 };
        if tty {
            let w = 30;
            let filled = (frac * w as f64) as usize;
            eprint!(
                "\rflushing [{}{}] {} / {}  {}/s  {:.0}s left   ",
                "#".repeat(filled),
                "-".repeat(w - filled.min(w)),
                human(done),
                human(total as f64),
                human(rate),
                eta
            );
        } else if last_log.elapsed() >= Duration::from_secs(5) {
            last_log = Instant::now();
            eprintln!(
                "kvfs: flushing {}: {} of {} written back, {}/s, {:.0}s left",
                mp.display(),
                human(done),
                human(total as f64),
                human(rate),
                eta
            );
        }
    }
    if tty && start.elapsed() >= Duration::from_secs(1) {
        eprintln!();
    }
    worker
        .join()
        .map_err(|_| anyhow::anyhow!("flush thread panicked"))?
        .with_context(|| {
            format!(
                "flushing {} failed; the mount stays up and nothing was dropped",
                mp.display()
            )
        })
}

/// Unmounts `mp`; a busy mount is said so (`note` added to the message).
fn unmount_or_busy(mp: &Path, note: &str) -> Result<()> {
    if let Err(e) = unmount(mp, false) {
        if e.raw_os_error() == Some(libc::EBUSY) {
            bail!(
                "cannot unmount {}: it is busy (a process has a file or directory open there){note}",
                mp.display()
            );
        }
        return Err(e).with_context(|| format!("cannot unmount {}", mp.display()));
    }
    Ok(())
}

pub fn umount(mp: &Path) -> Result<()> {
    check_kvfs(mp)?;
    if dead_kvfs_mount(mp) {
        // Its daemon died (killed, crashed): nothing is left to flush, and
        // the dead mount only fails every access until it goes.
        if let Err(e) = unmount(mp, true) {
            bail!(
                "the daemon of {} is gone, and its dead mount cannot be removed: {e}",
                mp.display()
            );
        }
        eprintln!(
            "kvfs: the daemon of {} had died; its dead mount is removed (groups it had not \
             written back are lost; what was synced is kept, see README Reliability)",
            mp.display()
        );
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let denied = std::fs::read(mp.join(".kvfs").join("pid"))
        .is_err_and(|e| e.raw_os_error() == Some(libc::EACCES));
    if root && denied {
        // Another user's mount without --allow-other: FUSE keeps even root
        // out, so no flush from here; the daemon makes its own on unmount.
        unmount_or_busy(mp, "")?;
        eprintln!(
            "kvfs: {} is another user's mount (closed to root without --allow-other): unmounted; its daemon writes back every dirty group before it exits",
            mp.display()
        );
        return Ok(());
    }
    let pid: i32 = read_kvfs_file(mp, "pid")?
        .trim()
        .parse()
        .context("bad .kvfs/pid")?;
    flush(mp)?;
    unmount_or_busy(mp, "; everything is flushed")?;
    // Wait for the daemon's final flush and exit.
    let t = Instant::now();
    while process_alive(pid) {
        if t.elapsed() > Duration::from_secs(120) {
            bail!("unmounted, but the daemon (pid {pid}) has not exited after 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// `kvfs stat --watch`: a line of rates every `interval` seconds, from
/// the differences of `.kvfs/stats` between samples.
pub fn stat_watch(mp: &Path, interval: f64, count: u64) -> Result<()> {
    use kvfs::stats::*;
    check_kvfs(mp)?;
    if !(interval.is_finite() && interval >= 0.05) {
        anyhow::bail!("--interval {interval}: give a number of seconds of at least 0.05");
    }
    let sample = || -> Result<(std::time::Instant, String)> {
        Ok((std::time::Instant::now(), read_kvfs_file(mp, "stats")?))
    };
    let keys = [
        "kvfs_hits_total{tier=\"t1\"}",
        "kvfs_hits_total{tier=\"backing\"}",
        EMPTY_READS,
        "kvfs_control_bytes_total{op=\"restore\"}",
        "kvfs_control_bytes_total{op=\"store\"}",
        "kvfs_read_bytes_total{tier=\"t1\"}",
        "kvfs_write_bytes_total{tier=\"t1\"}",
        EVICTIONS,
        FLUSHES,
    ];
    let values = |s: &str| keys.map(|k| find_sample(s, k).unwrap_or(0.0));
    println!(
        "{:>8} {:>9} {:>9} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>9}",
        "time",
        "t1 hit/s",
        "miss/s",
        "t1 hit%",
        "restore",
        "store",
        "T1 read",
        "T1 write",
        "dirty",
        "evict/s",
        "wback/s"
    );
    let (mut t0, s0) = sample()?;
    let mut prev = values(&s0);
    let mut n = 0u64;
    while count == 0 || n < count {
        std::thread::sleep(std::time::Duration::from_secs_f64(interval));
        let (t, s) = sample()?;
        let now = values(&s);
        let secs = (t - t0).as_secs_f64().max(1e-9);
        let d: Vec<f64> = now
            .iter()
            .zip(&prev)
            .map(|(a, b)| (a - b).max(0.0) / secs)
            .collect();
        let reads = d[0] + d[1];
        let rate = |x: f64| format!("{}/s", human(x));
        println!(
            "{:>8} {:>9.0} {:>9.0} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8.0} {:>9.0}",
            clock(),
            d[0],
            d[1],
            if reads > 0.0 {
                format!("{:.1}%", 100.0 * d[0] / reads)
            } else {
                "-".into()
            },
            rate(d[3]),
            rate(d[4]),
            rate(d[5]),
            rate(d[6]),
            human(find_sample(&s, DIRTY_BYTES).unwrap_or(0.0)),
            d[7],
            d[8]
        );
        (t0, prev) = (t, now);
        n += 1;
    }
    Ok(())
}

/// The wall-clock time of day, UTC, as HH:MM:SS.
fn clock() -> String {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("{:02}:{:02}:{:02}", s / 3600 % 24, s / 60 % 60, s % 60)
}

pub fn stat(mp: &Path) -> Result<()> {
    check_kvfs(mp)?;
    let layout = MountLayout::from_json(&read_kvfs_file(mp, "layout")?)
        .context("cannot parse .kvfs/layout")?;
    let s = read_kvfs_file(mp, "stats")?;
    let get = |k: &str| kvfs::stats::find_sample(&s, k).unwrap_or(0.0);
    let (t1h, bh) = (
        get("kvfs_hits_total{tier=\"t1\"}"),
        get("kvfs_hits_total{tier=\"backing\"}"),
    );
    let reads = t1h + bh + get(kvfs::stats::EMPTY_READS);
    let ratio = |x: f64| {
        if reads > 0.0 {
            format!("{:.1}%", 100.0 * x / reads)
        } else {
            "-".into()
        }
    };
    let used = get(kvfs::stats::T1_SLOTS_USED);
    let total = get(kvfs::stats::T1_SLOTS_TOTAL);
    println!("kvfs at {}", mp.display());
    println!(
        "  geometry   {} layers × {} blocks × {} kv heads × {} tokens × head_dim {} × {}",
        layout.layers,
        layout.blocks,
        layout.kv_heads,
        layout.block_tokens,
        layout.head_dim,
        layout.dtype
    );
    println!(
        "  groups     {} of {} bytes",
        layout.groups, layout.group_bytes
    );
    // T1 arrives in the background after its first chunk (pinned, with
    // a GPU): said while it still does.
    let ready = kvfs::stats::find_sample(&s, kvfs::stats::T1_SLOTS_READY).unwrap_or(total);
    println!(
        "  T1         {} ({} slots), {} used ({:.1}%){}",
        human(layout.t1_bytes as f64),
        total,
        used,
        if total > 0.0 {
            100.0 * used / total
        } else {
            0.0
        },
        if ready < total {
            format!(", still allocating: {ready} slots ready")
        } else {
            String::new()
        }
    );
    println!("  dirty      {}", human(get(kvfs::stats::DIRTY_BYTES)));
    println!("  backing    {} ({})", layout.tier, layout.policy);
    if let Some(remote) = &layout.remote {
        use kvfs::stats::*;
        let up = get(&format!("{REMOTE_NODES}{{state=\"connected\"}}"));
        let down = get(&format!("{REMOTE_NODES}{{state=\"down\"}}"));
        let trips = get(&format!("{REMOTE_ROUND_TRIP}_count{{tier=\"redis\"}}"));
        let secs = get(&format!("{REMOTE_ROUND_TRIP}_sum{{tier=\"redis\"}}"));
        let nodes = if up == 1.0 { "node" } else { "nodes" };
        println!("  remote     {remote}: {up} {nodes} connected, {down} down");
        println!(
            "             errors {}, timeouts {}, lost {}, corrupt {}, OOM {}; round trips {trips}{}",
            get(REMOTE_ERRORS),
            get(REMOTE_TIMEOUTS),
            get(REMOTE_LOST),
            get(REMOTE_CORRUPT),
            get(REMOTE_OOM),
            if trips > 0.0 {
                format!(", mean {:.0} µs", 1e6 * secs / trips)
            } else {
                String::new()
            }
        );
    }
    println!(
        "  reads      {reads}: T1 {} ({}), backing {} ({}), never written {}",
        t1h,
        ratio(t1h),
        bh,
        ratio(bh),
        get(kvfs::stats::EMPTY_READS)
    );
    println!(
        "  evictions  {}, write-backs {}, checksum failures {}",
        get(kvfs::stats::EVICTIONS),
        get(kvfs::stats::FLUSHES),
        get(kvfs::stats::CHECKSUM_FAILURES)
    );
    Ok(())
}
