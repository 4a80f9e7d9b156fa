//! `kvfs bench soak`: a long mixed load against a real daemon, every byte
//! checked. Workers (16 by default) each own a disjoint set of groups and
//! keep, in the bench process, the exact bytes each of them must hold; they
//! mix whole and partial FUSE writes, FUSE reads, fsyncs, and control-file
//! STOREs and RESTOREs of batches through a /dev/shm region of their own,
//! over a T1 much smaller than the working set (so most operations evict or
//! miss). Every read and restore is compared with the expected bytes.
//! Reported: operations by kind, errors (must be 0), and the daemon's
//! resident memory at the start and the end (must stay within T1 + 64 MiB).

use super::Rng;
use crate::client::Client;
use crate::geometry::{GroupIndex, GroupKey, GroupLayout};
use anyhow::{Context, bail};
use parking_lot::Mutex;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct SoakBench {
    /// Scratch directory: the backing store and the mount point go here.
    pub dir: PathBuf,
    /// Directory for the workers' region files (tmpfs).
    pub shm: PathBuf,
    pub seconds: f64,
    pub workers: usize,
    pub seed: u64,
}

/// 4 layers × 256 blocks × 2 heads × K/V = 4096 groups of 2 KiB (16 MiB
/// of strides) over a 1 MiB T1 (256 slots).
const LAYERS: u32 = 4;
const BLOCKS: u64 = 256;
const HEADS: u32 = 2;
const T1_BYTES: u64 = 1 << 20;
/// Most entries one control batch carries.
const BATCH: usize = 32;
/// Allowed growth of the daemon's memory beyond T1.
const RSS_SLACK: u64 = 64 << 20;

const OPS: [&str; 7] = [
    "fuse_write",
    "fuse_partial_write",
    "fuse_read",
    "fsync",
    "ctl_store",
    "ctl_restore",
    "errors",
];

fn layout() -> GroupLayout {
    GroupLayout::new(LAYERS, BLOCKS, HEADS, 16, 64, crate::geometry::Dtype::Bf16)
        .expect("a valid geometry")
}

fn rss_bytes(pid: i32) -> anyhow::Result<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("cannot read /proc/{pid}/status"))?;
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no VmRSS line")?;
    Ok(kb << 10)
}

struct Worker {
    id: usize,
    mp: PathBuf,
    shm_path: PathBuf,
    /// Expected bytes of each owned group, by position in `groups`.
    groups: Vec<u64>,
    expect: Vec<Vec<u8>>,
    counts: Arc<[AtomicU64; 7]>,
    errors: Arc<Mutex<Vec<String>>>,
}

impl Worker {
    fn fail(&self, what: String) {
        self.counts[6].fetch_add(1, Ordering::Relaxed);
        let mut e = self.errors.lock();
        if e.len() < 20 {
            e.push(format!("worker {}: {what}", self.id));
        }
    }

    fn path(&self, g: u64) -> PathBuf {
        let key = layout()
            .key(GroupIndex(g))
            .expect("an index below the count");
        self.mp.join(key.to_string())
    }

    fn key(g: u64) -> GroupKey {
        layout()
            .key(GroupIndex(g))
            .expect("an index below the count")
    }

    fn run(mut self, stop: Arc<AtomicBool>, seed: u64) {
        let gb = layout().group_bytes() as usize;
        let mut r = Rng::new(seed);
        let client = match Client::open(&self.mp) {
            Ok(c) => c,
            Err(e) => return self.fail(format!("cannot open the control file: {e}")),
        };
        let region_len = (BATCH * gb) as u64;
        let shm = match fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&self.shm_path)
        {
            Ok(f) => f,
            Err(e) => return self.fail(format!("cannot create {}: {e}", self.shm_path.display())),
        };
        if let Err(e) = shm.set_len(region_len) {
            return self.fail(format!("cannot size the region: {e}"));
        }
        let region = match client.register_host_region(&self.shm_path, region_len) {
            Ok(r) => r,
            Err(e) => return self.fail(format!("REGISTER: {e}")),
        };
        let mut scratch = vec![0u8; gb];
        while !stop.load(Ordering::Relaxed) {
            let op = r.next_u64() % 16;
            let pick = (r.next_u64() % self.groups.len() as u64) as usize;
            let g = self.groups[pick];
            match op {
                // Whole-group write.
                0..=2 => {
                    r.fill(&mut scratch);
                    match fs::OpenOptions::new().write(true).open(self.path(g)) {
                        Ok(f) => match f.write_all_at(&scratch, 0) {
                            Ok(()) => {
                                self.expect[pick].copy_from_slice(&scratch);
                                self.counts[0].fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => self.fail(format!("write {}: {e}", self.path(g).display())),
                        },
                        Err(e) => self.fail(format!("open {}: {e}", self.path(g).display())),
                    }
                }
                // A partial write: a random range of the group.
                3..=4 => {
                    let off = (r.next_u64() % gb as u64) as usize;
                    let len = 1 + (r.next_u64() % (gb - off) as u64) as usize;
                    r.fill(&mut scratch[..len]);
                    match fs::OpenOptions::new().write(true).open(self.path(g)) {
                        Ok(f) => match f.write_all_at(&scratch[..len], off as u64) {
                            Ok(()) => {
                                self.expect[pick][off..off + len].copy_from_slice(&scratch[..len]);
                                self.counts[1].fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                self.fail(format!("partial write {}: {e}", self.path(g).display()))
                            }
                        },
                        Err(e) => self.fail(format!("open {}: {e}", self.path(g).display())),
                    }
                }
                // Read and compare.
                5..=8 => match fs::read(self.path(g)) {
                    Ok(b) if b == self.expect[pick] => {
                        self.counts[2].fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => self.fail(format!("read {}: WRONG BYTES", self.path(g).display())),
                    Err(e) => self.fail(format!("read {}: {e}", self.path(g).display())),
                },
                9 => match fs::OpenOptions::new().write(true).open(self.path(g)) {
                    Ok(f) => match f.sync_all() {
                        Ok(()) => {
                            self.counts[3].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => self.fail(format!("fsync {}: {e}", self.path(g).display())),
                    },
                    Err(e) => self.fail(format!("open {}: {e}", self.path(g).display())),
                },
                // STORE a batch of distinct owned groups from the region.
                10..=12 => {
                    let picks = self.batch(&mut r);
                    let mut entries = Vec::new();
                    for (slot, &p) in picks.iter().enumerate() {
                        r.fill(&mut scratch);
                        if let Err(e) = shm.write_all_at(&scratch, (slot * gb) as u64) {
                            return self.fail(format!("region write: {e}"));
                        }
                        entries.push((Self::key(self.groups[p]), region, (slot * gb) as u64));
                    }
                    let done = client
                        .store(&entries)
                        .and_then(|t| client.wait(t, None))
                        .and_then(|c| c.ok());
                    match done {
                        Ok(_) => {
                            for (slot, &p) in picks.iter().enumerate() {
                                if let Err(e) =
                                    shm.read_exact_at(&mut self.expect[p], (slot * gb) as u64)
                                {
                                    return self.fail(format!("region read: {e}"));
                                }
                            }
                            self.counts[4].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => self.fail(format!("STORE of {} groups: {e}", picks.len())),
                    }
                }
                // RESTORE a batch into the region and compare.
                _ => {
                    let picks = self.batch(&mut r);
                    let entries: Vec<_> = picks
                        .iter()
                        .enumerate()
                        .map(|(slot, &p)| (Self::key(self.groups[p]), region, (slot * gb) as u64))
                        .collect();
                    let done = client
                        .restore(&entries)
                        .and_then(|t| client.wait(t, None))
                        .and_then(|c| c.ok());
                    match done {
                        Ok(_) => {
                            for (slot, &p) in picks.iter().enumerate() {
                                if let Err(e) = shm.read_exact_at(&mut scratch, (slot * gb) as u64)
                                {
                                    return self.fail(format!("region read: {e}"));
                                }
                                if scratch != self.expect[p] {
                                    self.fail(format!(
                                        "RESTORE of {}: WRONG BYTES",
                                        Self::key(self.groups[p])
                                    ));
                                }
                            }
                            self.counts[5].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => self.fail(format!("RESTORE of {} groups: {e}", picks.len())),
                    }
                }
            }
        }
        let _ = fs::remove_file(&self.shm_path);
    }

    /// 1..=BATCH distinct positions in `groups`.
    fn batch(&self, r: &mut Rng) -> Vec<usize> {
        let n = 1 + (r.next_u64() % BATCH as u64) as usize;
        let mut v: Vec<usize> = (0..n)
            .map(|_| (r.next_u64() % self.groups.len() as u64) as usize)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

fn mount(exe: &Path, mp: &Path, backing: &Path) -> anyhow::Result<()> {
    let l = layout();
    let out = super::mount_command(exe, mp, backing, &T1_BYTES.to_string(), &l)
        .output()
        .context("cannot start kvfs mount")?;
    if !out.status.success() {
        bail!(
            "kvfs mount failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

pub fn run(b: &SoakBench) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot find the kvfs executable")?;
    fs::create_dir_all(&b.dir).with_context(|| format!("cannot create {}", b.dir.display()))?;
    let scratch = tempfile::Builder::new()
        .prefix("kvfs-soak")
        .tempdir_in(&b.dir)
        .with_context(|| format!("cannot make a scratch directory in {}", b.dir.display()))?;
    let mp = scratch.path().join("mnt");
    let backing = scratch.path().join("store");
    fs::create_dir_all(&mp)?;
    mount(&exe, &mp, &backing)?;
    let pid = super::daemon_pid(&mp)?;
    let l = layout();
    let gb = l.group_bytes() as usize;
    println!(
        "soak: {} workers, {:.0} s, seed {}, {} groups of {} B ({} MiB of strides) over a {} MiB T1",
        b.workers,
        b.seconds,
        b.seed,
        l.group_count(),
        gb,
        (l.group_count() * l.stride()) >> 20,
        T1_BYTES >> 20
    );
    let rss_start = rss_bytes(pid)?;
    let counts: Arc<[AtomicU64; 7]> = Arc::new(Default::default());
    let errors = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut seeds = Rng::new(b.seed);
    let threads: Vec<_> = (0..b.workers)
        .map(|id| {
            let groups: Vec<u64> = (0..l.group_count())
                .filter(|g| *g as usize % b.workers == id)
                .collect();
            let w = Worker {
                id,
                mp: mp.clone(),
                shm_path: b.shm.join(format!("kvfs-soak-{}-{id}", std::process::id())),
                expect: vec![vec![0u8; gb]; groups.len()],
                groups,
                counts: counts.clone(),
                errors: errors.clone(),
            };
            let (stop, seed) = (stop.clone(), seeds.next_u64());
            std::thread::spawn(move || w.run(stop, seed))
        })
        .collect();
    let t = Instant::now();
    let mut rss_max = rss_start;
    let mut next_report = Duration::from_secs(60);
    while t.elapsed().as_secs_f64() < b.seconds {
        std::thread::sleep(Duration::from_millis(200));
        rss_max = rss_max.max(rss_bytes(pid)?);
        if t.elapsed() >= next_report {
            let total: u64 = counts[..6].iter().map(|c| c.load(Ordering::Relaxed)).sum();
            println!(
                "  {:>5.0} s: {total} operations, {} errors, daemon RSS {} MiB",
                t.elapsed().as_secs_f64(),
                counts[6].load(Ordering::Relaxed),
                rss_bytes(pid)? >> 20
            );
            next_report += Duration::from_secs(60);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for th in threads {
        th.join()
            .map_err(|_| anyhow::anyhow!("a worker panicked"))?;
    }
    let secs = t.elapsed().as_secs_f64();
    let rss_end = rss_bytes(pid)?;
    let out = Command::new(&exe).arg("umount").arg(&mp).output()?;
    let umount_ok = out.status.success();
    let c: Vec<u64> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let total: u64 = c[..6].iter().sum();
    for (name, n) in OPS.iter().zip(&c) {
        println!("  {name:<20} {n:>12}");
    }
    println!(
        "total: {total} operations in {secs:.1} s ({:.0}/s), {} errors; daemon RSS {} MiB at the start, {} MiB at the end, {} MiB at most (limit: T1 {} MiB + {} MiB = {} MiB)",
        total as f64 / secs,
        c[6],
        rss_start >> 20,
        rss_end >> 20,
        rss_max >> 20,
        T1_BYTES >> 20,
        RSS_SLACK >> 20,
        (T1_BYTES + RSS_SLACK) >> 20
    );
    for e in errors.lock().iter() {
        println!("  {e}");
    }
    if c[6] > 0 {
        bail!("the soak saw {} errors", c[6]);
    }
    if rss_max > T1_BYTES + RSS_SLACK {
        bail!(
            "the daemon grew to {} MiB, beyond T1 + {} MiB",
            rss_max >> 20,
            RSS_SLACK >> 20
        );
    }
    if !umount_ok {
        bail!(
            "kvfs umount failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
