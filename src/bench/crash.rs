//! `kvfs bench crash`: crash cycles against a real daemon. Each cycle mounts
//! (over the dead mount the last cycle left), lets writer threads write
//! whole groups through the filesystem and fsync some of them, kills the
//! daemon with SIGKILL at a random moment, remounts and reads every group
//! back. The writers keep, outside the daemon, the newest version they
//! issued of each group and the newest whose fsync returned; every group's
//! bytes name their group and version, so a read can be judged exactly:
//!
//! - an fsync'd group must hold its last fsync'd version or a later one;
//! - no group may hold bytes that were never written to it (another
//!   group's, a mix of versions, a version never issued): a *silent
//!   corruption*;
//! - a group that was never fsync'd may fail with EIO (its newest copy was
//!   cut short and it has no synced copy): counted, allowed.
//!
//! Exit status 1 when any cycle broke a rule or a remount failed.

use super::Rng;
use crate::geometry::{Dtype, GroupIndex, GroupLayout};
use anyhow::{Context, bail};
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct CrashBench {
    /// Scratch directory: the backing store and the mount point go here.
    pub dir: PathBuf,
    pub cycles: u32,
    /// Writer threads.
    pub writers: usize,
    /// Seed of the kill times and the writers' choices.
    pub seed: u64,
    /// A backing directory to use instead of a scratch one.
    pub backing: Option<PathBuf>,
    pub tier: crate::tier::TierKind,
    /// A shell command run after each kill, before the remount.
    pub after_kill: Option<String>,
    /// After each kill, a simulated power cut (`tier::shadow`): every page
    /// of the data and metadata files not covered by a completed sync gets
    /// its written or its durable bytes, at random.
    pub power_loss: bool,
}

/// What the writers issued and saw fsync'd, per group (0: none).
struct Ledger {
    issued: Vec<AtomicU64>,
    synced: Vec<AtomicU64>,
}

#[derive(Default, Debug, Clone, Copy)]
pub struct CycleReport {
    pub writes: u64,
    pub fsyncs: u64,
    pub torn: u64,
    pub silent: u64,
    pub lost_synced: u64,
    pub recovered: u64,
}

/// The test geometry: 2 layers × 64 blocks × 2 heads × K/V = 512 groups of
/// 2 KiB, over a 16-slot T1, so write-backs run all the time.
fn layout() -> GroupLayout {
    GroupLayout::new(2, 64, 2, 16, 64, Dtype::Bf16).expect("a valid geometry")
}

const T1: &str = "64KiB";

/// Version `v` of group `g`: its index and version, then bytes that depend
/// on both.
fn content(g: u64, v: u64, len: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(&g.to_le_bytes());
    b.extend_from_slice(&v.to_le_bytes());
    let mut r = Rng::new(g.wrapping_mul(1 << 32) ^ v);
    while b.len() < len {
        b.extend_from_slice(&r.next_u64().to_le_bytes());
    }
    b.truncate(len);
    b
}

fn group_file(mp: &Path, layout: &GroupLayout, g: u64) -> PathBuf {
    let key = layout.key(GroupIndex(g)).expect("an index below the count");
    mp.join(key.to_string())
}

fn mount(
    exe: &Path,
    mp: &Path,
    backing: &Path,
    tier: &str,
    power_loss: bool,
) -> anyhow::Result<Duration> {
    let l = layout();
    let t = Instant::now();
    let mut c = super::mount_command(exe, mp, backing, T1, &l);
    if power_loss {
        c.env("KVFS_CRASH_SHADOW", "1");
    }
    let mut child = c
        .args(["--tier", tier])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("cannot start kvfs mount")?;
    // A remount must never hang: give it a generous limit and say so.
    loop {
        if let Some(status) = child.try_wait()? {
            if !status.success() {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    use std::io::Read;
                    let _ = e.read_to_string(&mut err);
                }
                bail!("kvfs mount failed ({status}): {}", err.trim());
            }
            return Ok(t.elapsed());
        }
        if t.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            bail!("kvfs mount did not return within 60 s");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn kill_and_wait(pid: i32) -> anyhow::Result<()> {
    // SAFETY: sending a signal to the daemon we started.
    if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
        bail!("kill -9 {pid}: {}", std::io::Error::last_os_error());
    }
    let t = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        if t.elapsed() > Duration::from_secs(30) {
            bail!("daemon {pid} still alive 30 s after SIGKILL");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// One writer: whole-group writes to its own groups (g % n == id), a
/// quarter of them fsync'd, until the daemon is gone or `stop` is set.
fn writer(
    id: usize,
    n: usize,
    mp: PathBuf,
    ledger: Arc<Ledger>,
    stop: Arc<AtomicBool>,
    seed: u64,
    counts: Arc<(AtomicU64, AtomicU64)>,
) {
    let layout = layout();
    let gb = layout.group_bytes() as usize;
    let mine: Vec<u64> = (0..layout.group_count())
        .filter(|g| *g as usize % n == id)
        .collect();
    let mut r = Rng::new(seed ^ ((id as u64 + 1) * 0x51));
    while !stop.load(Ordering::Relaxed) {
        let g = mine[(r.next_u64() % mine.len() as u64) as usize];
        // Counted before the write: a write the daemon took but never
        // answered still counts as written.
        let v = ledger.issued[g as usize].fetch_add(1, Ordering::SeqCst) + 1;
        let f = match fs::OpenOptions::new()
            .write(true)
            .open(group_file(&mp, &layout, g))
        {
            Ok(f) => f,
            Err(_) => return,
        };
        if f.write_all_at(&content(g, v, gb), 0).is_err() {
            return;
        }
        counts.0.fetch_add(1, Ordering::Relaxed);
        if r.next_u64().is_multiple_of(4) {
            if f.sync_all().is_err() {
                return;
            }
            ledger.synced[g as usize].fetch_max(v, Ordering::SeqCst);
            counts.1.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Reads every group back and judges it against the ledger.
fn verify(mp: &Path, ledger: &Ledger, report: &mut CycleReport) -> Vec<String> {
    let layout = layout();
    let gb = layout.group_bytes() as usize;
    let mut problems = Vec::new();
    for g in 0..layout.group_count() {
        let issued = ledger.issued[g as usize].load(Ordering::SeqCst);
        let synced = ledger.synced[g as usize].load(Ordering::SeqCst);
        let path = group_file(mp, &layout, g);
        match fs::read(&path) {
            Err(e) if e.raw_os_error() == Some(libc::EIO) => {
                if synced > 0 {
                    report.lost_synced += 1;
                    problems.push(format!(
                        "{}: EIO, but version {synced} was fsync'd",
                        path.display()
                    ));
                } else {
                    report.torn += 1;
                }
            }
            Err(e) => problems.push(format!("{}: {e}", path.display())),
            Ok(b) if b.len() != gb => {
                report.silent += 1;
                problems.push(format!("{}: {} bytes, not {gb}", path.display(), b.len()));
            }
            Ok(b) if b.iter().all(|&x| x == 0) => {
                if synced > 0 {
                    report.lost_synced += 1;
                    problems.push(format!(
                        "{}: zeros, but version {synced} was fsync'd",
                        path.display()
                    ));
                }
            }
            Ok(b) => {
                let who = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
                let v = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
                if who != g || v == 0 || v > issued || b != content(g, v, gb) {
                    report.silent += 1;
                    problems.push(format!(
                        "{}: SILENT CORRUPTION: bytes that were never written to it (header says group {who} version {v}; issued up to {issued})",
                        path.display()
                    ));
                } else if v < synced {
                    report.lost_synced += 1;
                    problems.push(format!(
                        "{}: version {v}, older than the fsync'd version {synced}",
                        path.display()
                    ));
                }
            }
        }
    }
    problems
}

fn recovered_reads(mp: &Path) -> u64 {
    fs::read_to_string(mp.join(".kvfs/stats"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(crate::stats::RECOVERED_READS))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

pub fn run(b: &CrashBench) -> anyhow::Result<Vec<CycleReport>> {
    let exe = std::env::current_exe().context("cannot find the kvfs executable")?;
    fs::create_dir_all(&b.dir).with_context(|| format!("cannot create {}", b.dir.display()))?;
    let scratch = tempfile::Builder::new()
        .prefix("kvfs-crash")
        .tempdir_in(&b.dir)
        .with_context(|| format!("cannot make a scratch directory in {}", b.dir.display()))?;
    let mp = scratch.path().join("mnt");
    let backing = b
        .backing
        .clone()
        .unwrap_or_else(|| scratch.path().join("store"));
    let tier = b.tier.to_string();
    fs::create_dir_all(&mp)?;
    let n = layout().group_count() as usize;
    let ledger = Arc::new(Ledger {
        issued: (0..n).map(|_| AtomicU64::new(0)).collect(),
        synced: (0..n).map(|_| AtomicU64::new(0)).collect(),
    });
    let mut rng = Rng::new(b.seed);
    let mut reports = Vec::new();
    let mut failed = false;
    println!(
        "crash cycles: {} cycles, {} writers, seed {}, {} groups of {} B, T1 {T1}, backing {} ({tier}){}",
        b.cycles,
        b.writers,
        b.seed,
        n,
        layout().group_bytes(),
        backing.display(),
        b.after_kill
            .as_ref()
            .map(|c| format!(", after each kill: {c}"))
            .unwrap_or_default()
            + if b.power_loss {
                ", after each kill: a simulated power cut (unsynced 4 KiB pages of the data and metadata files kept or lost at random)"
            } else {
                ""
            }
    );
    // The mount that verifies a cycle is the one the next cycle crashes.
    if b.power_loss && b.tier != crate::tier::TierKind::File {
        bail!("--power-loss needs --tier file (the durable image follows the file tier's syncs)");
    }
    let mut took = mount(&exe, &mp, &backing, &tier, b.power_loss)?;
    let (mut cut_pages, mut cut_reverted) = (0u64, 0u64);
    for cycle in 1..=b.cycles {
        let pid = super::daemon_pid(&mp)?;
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
        let cycle_seed = rng.next_u64();
        let threads: Vec<_> = (0..b.writers)
            .map(|id| {
                let (mp, ledger, stop, counts) =
                    (mp.clone(), ledger.clone(), stop.clone(), counts.clone());
                let n = b.writers;
                std::thread::spawn(move || writer(id, n, mp, ledger, stop, cycle_seed, counts))
            })
            .collect();
        let after = Duration::from_millis(20 + rng.next_u64() % 400);
        std::thread::sleep(after);
        kill_and_wait(pid)?;
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().map_err(|_| anyhow::anyhow!("a writer panicked"))?;
        }
        if let Some(cmd) = &b.after_kill {
            // The dead mount point first, or the command may trip over it.
            let _ = Command::new("umount").arg("-l").arg(&mp).status();
            let st = Command::new("sh").args(["-c", cmd]).status()?;
            if !st.success() {
                bail!("--after-kill {cmd:?} failed ({st})");
            }
        }
        let mut cut = String::new();
        if b.power_loss {
            let _ = Command::new("umount").arg("-l").arg(&mp).status();
            let (mut d, mut r) = (0, 0);
            for name in ["data", "meta"] {
                let (dd, rr) = crate::tier::shadow::power_cut(&backing.join(name), || {
                    rng.next_u64().is_multiple_of(2)
                })
                .with_context(|| format!("the power cut on {name}"))?;
                d += dd;
                r += rr;
            }
            cut = format!("; power cut: {d} unsynced pages, {r} of them lost");
            cut_pages += d;
            cut_reverted += r;
        }
        let remount = mount(&exe, &mp, &backing, &tier, b.power_loss)
            .context("the remount after the crash failed")?;
        let mut report = CycleReport {
            writes: counts.0.load(Ordering::Relaxed),
            fsyncs: counts.1.load(Ordering::Relaxed),
            ..Default::default()
        };
        let problems = verify(&mp, &ledger, &mut report);
        report.recovered = recovered_reads(&mp);
        println!(
            "cycle {cycle:3}: mounted in {:>6.1} ms, killed after {:>3} ms ({} writes, {} fsync'd){cut}; remounted in {:>6.1} ms; {} groups: {} torn (EIO, never fsync'd), {} served from the synced copy, {} silent corruptions, {} fsync'd groups lost",
            took.as_secs_f64() * 1e3,
            after.as_millis(),
            report.writes,
            report.fsyncs,
            remount.as_secs_f64() * 1e3,
            n,
            report.torn,
            report.recovered,
            report.silent,
            report.lost_synced
        );
        for p in problems.iter().take(10) {
            println!("  {p}");
        }
        failed |= !problems.is_empty();
        reports.push(report);
        took = remount;
    }
    let out = Command::new(&exe).arg("umount").arg(&mp).output()?;
    if !out.status.success() {
        bail!(
            "kvfs umount after the last cycle failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let sum = |f: fn(&CycleReport) -> u64| reports.iter().map(f).sum::<u64>();
    if b.power_loss {
        println!(
            "power cuts: {cut_pages} unsynced pages of the data and metadata files found after the kills, {cut_reverted} of them given their durable bytes back"
        );
    }
    println!(
        "total: {} cycles, {} writes, {} fsync'd; {} torn (EIO, never fsync'd), {} served from the synced copy, {} silent corruptions, {} fsync'd groups lost",
        reports.len(),
        sum(|r| r.writes),
        sum(|r| r.fsyncs),
        sum(|r| r.torn),
        sum(|r| r.recovered),
        sum(|r| r.silent),
        sum(|r| r.lost_synced)
    );
    if failed {
        bail!("crash cycles found problems (listed above)");
    }
    Ok(reports)
}
