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
    /// `--tier redis`: the backing is a redis-server (AOF, fsync always)
    /// that is killed every `kill_every` seconds and restarted after
    /// `down` seconds; EIO and ENOSPC during outages are counted, not
    /// errors, and after a final sync every group must verify.
    pub redis: Option<RedisOutages>,
}

#[derive(Clone, Copy, Debug)]
pub struct RedisOutages {
    pub kill_every: f64,
    pub down: f64,
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

const OPS: [&str; 9] = [
    "fuse_write",
    "fuse_partial_write",
    "fuse_read",
    "fsync",
    "ctl_store",
    "ctl_restore",
    "errors",
    "outage_errors",
    "unchecked_reads",
];

/// Most versions a group may be in after failed writes (either the old or
/// the new bytes may have landed); more are folded away by reads.
const MAX_CANDIDATES: usize = 16;

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
    /// Expected bytes of each owned group, by position in `groups`: the
    /// versions it may hold (one, unless a write failed mid-way during an
    /// outage: then the old bytes or the new).
    groups: Vec<u64>,
    expect: Vec<Vec<Vec<u8>>>,
    counts: Arc<[AtomicU64; 9]>,
    errors: Arc<Mutex<Vec<String>>>,
    /// EIO and ENOSPC are outages, not errors (`--tier redis`).
    outages: bool,
    history: Vec<Vec<Vec<u8>>>,
}

impl Worker {
    /// Whether an errno is an outage's (counted) rather than an error.
    fn outage(&self, errno: Option<i32>) -> bool {
        let soft = self.outages && matches!(errno, Some(libc::EIO) | Some(libc::ENOSPC));
        if soft {
            self.counts[7].fetch_add(1, Ordering::Relaxed);
            // Back off a little, as a client of a failing store would.
            std::thread::sleep(Duration::from_millis(5));
        }
        soft
    }

    /// The group may now hold `new` as well as what it held. Past
    /// MAX_CANDIDATES versions it is unknown (no versions) until a read or
    /// a successful write pins it again (counted as unchecked).
    fn maybe(&mut self, pick: usize, new: Vec<u8>) {
        let c = &mut self.expect[pick];
        if c.is_empty() {
            return;
        }
        if !c.contains(&new) {
            c.push(new);
        }
        if c.len() > MAX_CANDIDATES {
            c.clear();
        }
    }

    /// `got` was read: it must be one of the versions; it is the one now.
    fn seen(&mut self, pick: usize, got: &[u8]) -> bool {
        if self.expect[pick].is_empty() {
            self.counts[8].fetch_add(1, Ordering::Relaxed);
            self.expect[pick] = vec![got.to_vec()];
            return true;
        }
        let ok = self.expect[pick].iter().any(|c| c == got);
        if ok {
            self.expect[pick] = vec![got.to_vec()];
        } else if self.outages {
            let age = self.history[pick].iter().rev().position(|h| h == got);
            let at = self.history[pick].len();
            let mut e = self.errors.lock();
            if e.len() < 20 {
                e.push(format!(
                    "worker {}: group {}: {} ({} versions written, {} expected now)",
                    self.id,
                    self.groups[pick],
                    match age {
                        Some(a) => format!("an OLD version ({a} writes back)"),
                        None => "bytes never written whole".into(),
                    },
                    at,
                    self.expect[pick].len()
                ));
            }
        }
        ok
    }

    /// Remembers every version written to a group (outage runs: to tell a
    /// stale read from garbage).
    fn wrote(&mut self, pick: usize, v: &[u8]) {
        if self.outages {
            self.history[pick].push(v.to_vec());
        }
    }

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

    fn run(mut self, stop: Arc<AtomicBool>, seed: u64) -> Self {
        self.work(&stop, seed);
        self
    }

    fn work(&mut self, stop: &AtomicBool, seed: u64) {
        self.history = vec![Vec::new(); self.groups.len()];
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
                                self.wrote(pick, &scratch);
                                self.expect[pick] = vec![scratch.clone()];
                                self.counts[0].fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) if self.outage(e.raw_os_error()) => {
                                self.wrote(pick, &scratch);
                                self.maybe(pick, scratch.clone())
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
                                for c in self.expect[pick].iter_mut() {
                                    c[off..off + len].copy_from_slice(&scratch[..len]);
                                }
                                for c in self.expect[pick].clone() {
                                    self.wrote(pick, &c);
                                }
                                self.counts[1].fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) if self.outage(e.raw_os_error()) => {
                                let news: Vec<Vec<u8>> = self.expect[pick]
                                    .iter()
                                    .map(|c| {
                                        let mut n = c.clone();
                                        n[off..off + len].copy_from_slice(&scratch[..len]);
                                        n
                                    })
                                    .collect();
                                for n in news {
                                    self.wrote(pick, &n);
                                    self.maybe(pick, n);
                                }
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
                    Ok(b) if self.seen(pick, &b) => {
                        self.counts[2].fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => self.fail(format!("read {}: WRONG BYTES", self.path(g).display())),
                    Err(e) if self.outage(e.raw_os_error()) => {}
                    Err(e) => self.fail(format!("read {}: {e}", self.path(g).display())),
                },
                9 => match fs::OpenOptions::new().write(true).open(self.path(g)) {
                    Ok(f) => match f.sync_all() {
                        Ok(()) => {
                            self.counts[3].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) if self.outage(e.raw_os_error()) => {}
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
                    let mut stored = Vec::with_capacity(picks.len());
                    for slot in 0..picks.len() {
                        let mut b = vec![0u8; gb];
                        if let Err(e) = shm.read_exact_at(&mut b, (slot * gb) as u64) {
                            return self.fail(format!("region read: {e}"));
                        }
                        stored.push(b);
                    }
                    match done {
                        Ok(_) => {
                            for (&p, b) in picks.iter().zip(stored) {
                                self.wrote(p, &b);
                                self.expect[p] = vec![b];
                            }
                            self.counts[4].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) if self.outage(e.errno()) => {
                            for (&p, b) in picks.iter().zip(stored) {
                                self.wrote(p, &b);
                                self.maybe(p, b);
                            }
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
                                if !self.seen(p, &scratch) {
                                    self.fail(format!(
                                        "RESTORE of {}: WRONG BYTES",
                                        Self::key(self.groups[p])
                                    ));
                                }
                            }
                            self.counts[5].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) if self.outage(e.errno()) => {}
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

fn mount(exe: &Path, mp: &Path, backing: &Path, remote: Option<&str>) -> anyhow::Result<()> {
    let l = layout();
    let mut c = super::mount_command(exe, mp, backing, &T1_BYTES.to_string(), &l);
    if let Some(url) = remote {
        c.args(["--tier", "redis", "--remote", url]);
    }
    let out = c.output().context("cannot start kvfs mount")?;
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
    let server = match b.redis {
        Some(_) => {
            if !crate::tier::redis::testing::available() {
                bail!("--tier redis needs redis-server and redis-cli on PATH");
            }
            Some(Arc::new(Mutex::new(
                crate::tier::redis::testing::RedisServer::start(&[
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "always",
                ]),
            )))
        }
        None => None,
    };
    let url = server.as_ref().map(|s| s.lock().url());
    mount(&exe, &mp, &backing, url.as_deref())?;
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
    if let (Some(o), Some(u)) = (b.redis, &url) {
        println!(
            "  backing: redis-server at {u} (AOF, fsync always), killed every {:.1} s and restarted {:.1} s later",
            o.kill_every, o.down
        );
    }
    let rss_start = rss_bytes(pid)?;
    let counts: Arc<[AtomicU64; 9]> = Arc::new(Default::default());
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
                expect: vec![vec![vec![0u8; gb]]; groups.len()],
                groups,
                counts: counts.clone(),
                errors: errors.clone(),
                outages: b.redis.is_some(),
                history: Vec::new(),
            };
            let (stop, seed) = (stop.clone(), seeds.next_u64());
            std::thread::spawn(move || w.run(stop, seed))
        })
        .collect();
    // The outages: SIGKILL, a pause, a restart on the same port and AOF.
    let killer = match (b.redis, &server) {
        (Some(o), Some(srv)) => {
            let (stop, srv) = (stop.clone(), srv.clone());
            Some(std::thread::spawn(move || {
                let mut kills = 0u64;
                let nap = |secs: f64, stop: &AtomicBool| {
                    let t = Instant::now();
                    while t.elapsed().as_secs_f64() < secs && !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                };
                loop {
                    nap(o.kill_every, &stop);
                    if stop.load(Ordering::Relaxed) {
                        return kills;
                    }
                    srv.lock().kill();
                    kills += 1;
                    nap(o.down, &AtomicBool::new(false));
                    srv.lock().restart();
                }
            }))
        }
        _ => None,
    };
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
    let mut workers = Vec::new();
    for th in threads {
        workers.push(
            th.join()
                .map_err(|_| anyhow::anyhow!("a worker panicked"))?,
        );
    }
    let secs = t.elapsed().as_secs_f64();
    if let Some(k) = killer {
        let kills = k
            .join()
            .map_err(|_| anyhow::anyhow!("the outage thread panicked"))?;
        // The server is up: a sync must succeed (retried while the tier
        // reconnects), then every group must hold one of its versions.
        let t = Instant::now();
        loop {
            let out = Command::new(&exe).arg("sync").arg(&mp).output()?;
            if out.status.success() {
                break;
            }
            if t.elapsed() > Duration::from_secs(60) {
                bail!(
                    "kvfs sync still fails 60 s after the last outage: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let mut bad = 0u64;
        for w in &workers {
            for (pick, &g) in w.groups.iter().enumerate() {
                match fs::read(w.path(g)) {
                    Ok(b) if w.expect[pick].is_empty() || w.expect[pick].contains(&b) => {}
                    Ok(_) => {
                        bad += 1;
                        errors
                            .lock()
                            .push(format!("final check {}: WRONG BYTES", w.path(g).display()));
                    }
                    Err(e) => {
                        bad += 1;
                        errors
                            .lock()
                            .push(format!("final check {}: {e}", w.path(g).display()));
                    }
                }
            }
        }
        counts[6].fetch_add(bad, Ordering::Relaxed);
        println!(
            "  {kills} outages (redis-server killed and restarted); after a final sync, {} groups checked: {bad} wrong or unreadable",
            l.group_count()
        );
    }
    let rss_end = rss_bytes(pid)?;
    let out = Command::new(&exe).arg("umount").arg(&mp).output()?;
    let umount_ok = out.status.success();
    let c: Vec<u64> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let total: u64 = c[..6].iter().sum();
    for (name, n) in OPS.iter().zip(&c) {
        if (*name == "outage_errors" || *name == "unchecked_reads") && b.redis.is_none() {
            continue;
        }
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
