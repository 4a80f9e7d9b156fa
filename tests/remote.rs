//! The `redis` backing tier end to end: the cascade model over a real
//! server, and real mounts (root and /dev/fuse) over real `redis-server`
//! processes: a small T1 evicting to a standalone server and a remount; a
//! 3-master cluster; RESTORE of misses through the control file; a server
//! killed with SIGKILL and restarted (AOF); a server out of memory
//! (noeviction); refused and warned-about servers; the `kvfs_remote_*`
//! metrics. Each test skips, with a message, where it cannot run; servers
//! are killed and mounts unmounted on drop, panics included (a mount is
//! always declared after its servers, so it goes first).

mod common;
#[path = "common/model.rs"]
mod model;
use common::*;

use kvfs::cascade::PolicyKind;
use kvfs::client::Client;
use kvfs::control::wire::MountLayout;
use kvfs::geometry::{Dtype, GroupIndex, GroupKey, GroupLayout};
use kvfs::stats::{self, find_sample};
use kvfs::tier::redis::testing::{self, RedisCluster, RedisServer};
use kvfs::tier::{RemoteConfig, TierKind};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::process::Output;
use std::time::{Duration, Instant};

const GBU: u64 = GB as u64;

/// What a no-hang check allows: the mounts use `--remote-timeout 1`, so
/// anything bounded by the timeout returns within a few seconds.
const NO_HANG: Duration = Duration::from_secs(20);

fn mountable() -> bool {
    can_mount() && testing::available()
}

/// 2 layers × `blocks` blocks × 2 KV heads × K/V: groups of 2 KiB (`GB`),
/// 4 KiB apart in T1 (so a T1 of 16 KiB holds 4).
fn layout(blocks: u64) -> GroupLayout {
    GroupLayout::new(2, blocks, 2, 16, 64, Dtype::Bf16).unwrap()
}

/// Runs `f`, which must return within `NO_HANG` (a no-hang check, not a
/// speed test).
fn bounded<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    assert!(
        t.elapsed() < NO_HANG,
        "{what} took {:?} (the remote timeout is 1 s)",
        t.elapsed()
    );
    r
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Expected bytes of every written group (others read as zeros).
type Model = BTreeMap<u64, Vec<u8>>;

/// A kvfs mount over redis (unmounted on drop): its geometry and the
/// options it mounts with.
struct Remote {
    m: Mount,
    layout: GroupLayout,
    /// Every option but `--remote`.
    opts: Vec<String>,
    urls: Vec<String>,
}

impl Remote {
    /// Nothing mounted yet: a store of `blocks` blocks over `urls`, T1 of
    /// `t1`, a 1 s remote timeout.
    fn new(urls: &[String], blocks: u64, t1: &str) -> Remote {
        let mut opts: Vec<String> = ["--tier", "redis", "--remote-timeout", "1", "--t1", t1]
            .iter()
            .map(|s| s.to_string())
            .collect();
        opts.extend(geometry(2, blocks));
        Remote {
            m: Mount::unmounted(),
            layout: layout(blocks),
            opts,
            urls: urls.to_vec(),
        }
    }

    /// `kvfs mount` over `urls` (comma-separated) and `extra` options.
    fn try_mount_on(&self, urls: &[String], extra: &[&str]) -> Output {
        let joined = urls.join(",");
        let mut a: Vec<&str> = self.opts.iter().map(String::as_str).collect();
        a.extend(["--remote", &joined]);
        a.extend(extra);
        self.m.try_mount(&a)
    }

    /// Mounts over `urls`; returns what `kvfs mount` said on stderr.
    fn mount_on(&self, urls: &[String]) -> String {
        let out = self.try_mount_on(urls, &[]);
        assert!(
            out.status.success(),
            "mount failed: {}\nlog:\n{}",
            stderr(&out),
            self.log()
        );
        stderr(&out)
    }

    fn mount(&self) -> String {
        self.mount_on(&self.urls)
    }

    fn umount(&self) {
        self.m.umount();
        assert!(!is_mounted(&self.m.mp));
    }

    fn log(&self) -> String {
        fs::read_to_string(self.m.backing.join("kvfs.log")).unwrap_or_default()
    }

    fn key(&self, g: u64) -> GroupKey {
        self.layout.key(GroupIndex(g)).unwrap()
    }

    fn path(&self, g: u64) -> PathBuf {
        self.m.p(&self.key(g).to_string())
    }

    fn groups(&self) -> u64 {
        self.layout.group_count()
    }

    /// Writes `data` at `off` of group `g` (no O_TRUNC: one write).
    fn write_at(&self, g: u64, off: u64, data: &[u8]) -> io::Result<()> {
        OpenOptions::new()
            .write(true)
            .open(self.path(g))?
            .write_all_at(data, off)
    }

    /// Writes group `g` whole with `pattern(seed)` and records it.
    fn put(&self, model: &mut Model, g: u64, seed: u64) {
        let d = pattern(seed, GB);
        self.write_at(g, 0, &d)
            .unwrap_or_else(|e| panic!("write of group {g}: {e}\nlog:\n{}", self.log()));
        model.insert(g, d);
    }

    /// Group `g`'s bytes, read with O_DIRECT: from the daemon, never from
    /// the kernel's page cache.
    fn read(&self, g: u64) -> io::Result<Vec<u8>> {
        let mut f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(self.path(g))?;
        let mut b = vec![0u8; GB];
        f.read_exact(&mut b)?;
        Ok(b)
    }

    /// Every group of the geometry holds what `model` says (zeros if absent).
    fn verify(&self, model: &Model, when: &str) {
        for g in 0..self.groups() {
            let got = self
                .read(g)
                .unwrap_or_else(|e| panic!("read of group {g} {when}: {e}\nlog:\n{}", self.log()));
            let ok = match model.get(&g) {
                Some(want) => got == *want,
                None => got.iter().all(|&b| b == 0),
            };
            assert!(ok, "group {g} {when}: wrong bytes");
        }
    }

    fn sync(&self) -> Output {
        kvfs().arg("sync").arg(&self.m.mp).output().unwrap()
    }

    fn stats(&self) -> String {
        self.m.stats()
    }

    fn metric(&self, name: &str) -> f64 {
        let s = self.stats();
        find_sample(&s, name).unwrap_or_else(|| panic!("no {name} in\n{s}"))
    }

    fn xattr(&self, g: u64, name: &str) -> String {
        xattr(&self.path(g), name).unwrap_or_else(|| panic!("no {name} on group {g}"))
    }

    fn tier_of(&self, g: u64) -> String {
        self.xattr(g, "user.kvfs.tier")
    }

    fn layout_json(&self) -> MountLayout {
        MountLayout::from_json(&fs::read_to_string(self.m.p(".kvfs/layout")).unwrap()).unwrap()
    }

    fn stat(&self) -> String {
        let out = kvfs().arg("stat").arg(&self.m.mp).output().unwrap();
        assert!(out.status.success(), "kvfs stat: {}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

fn nodes(state: &str) -> String {
    format!("{}{{state=\"{state}\"}}", stats::REMOTE_NODES)
}

fn round_trips() -> String {
    format!("{}_count{{tier=\"redis\"}}", stats::REMOTE_ROUND_TRIP)
}

/// (1) The cascade against the `HashMap` model (tests/common/model.rs) with
/// the redis tier under it: random writes, reads, batches, flushes, syncs
/// and reopens over a 1-to-4-slot T1, so evictions happen constantly.
#[test]
fn cascade_matches_model_over_redis() {
    if !testing::available() {
        return;
    }
    let s = RedisServer::start(&[]);
    let remote = RemoteConfig::new(vec![s.url()]);
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 16,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let strategy = (
        proptest::collection::vec(model::op_strategy(32, 256), 1..120),
        1u64..5,
        any::<bool>(),
        any::<bool>(),
    );
    let r = runner.run(&strategy, |(ops, slots, lru, promote)| {
        let p = if lru {
            PolicyKind::Lru
        } else {
            PolicyKind::Sieve
        };
        model::run_model(TierKind::Redis, Some(&remote), &ops, slots, p, promote)
    });
    if let Err(e) = r {
        panic!("{e}");
    }
    // Each case's store has its own namespace in the one server.
    let keys: u64 = s.cli(&["dbsize"]).parse().unwrap();
    assert!(keys > 0, "nothing reached the server");
}

/// (2, 8) A 4-slot T1 over a standalone server: writes of many more
/// groups than T1 holds evict to the server and read back; the layout names
/// the server; evicted groups say `backing`; a remount finds every byte;
/// partial writes of groups only the server holds work; the remote metrics
/// are there; a key the server lost or damaged reads as EIO, counted.
#[test]
fn small_t1_over_a_standalone_server_evicts_and_survives_a_remount() {
    if !mountable() {
        return;
    }
    let s = RedisServer::start(&[]);
    let r = Remote::new(&[s.url()], 16, "16KiB");
    r.mount();
    let l = r.layout_json();
    assert_eq!((l.tier.as_str(), l.t1_slots), ("redis", 4));
    assert_eq!(
        l.remote.as_deref(),
        Some(format!("standalone {}", s.url()).as_str())
    );
    let mut model = Model::new();
    for g in 0..96 {
        r.put(&mut model, g, g + 1);
    }
    r.verify(&model, "after writing");
    let evicted = (0..96).filter(|&g| r.tier_of(g) == "backing").count();
    assert!(evicted >= 92, "only {evicted} of 96 groups were evicted");
    for g in 96..r.groups() {
        assert_eq!(r.tier_of(g), "empty", "group {g}");
    }
    assert!(names(&r.m.p(".kvfs/resident")).len() <= 4);
    assert!(r.metric(stats::EVICTIONS) >= 92.0);
    assert!(r.metric("kvfs_hits_total{tier=\"backing\"}") >= 92.0);
    // Every remote metric is exposed, and they say all went well.
    let st = r.stats();
    for name in [
        stats::REMOTE_ERRORS,
        stats::REMOTE_TIMEOUTS,
        stats::REMOTE_LOST,
        stats::REMOTE_CORRUPT,
        stats::REMOTE_OOM,
    ] {
        assert_eq!(find_sample(&st, name), Some(0.0), "{name} in\n{st}");
    }
    assert_eq!(find_sample(&st, &nodes("connected")), Some(1.0), "{st}");
    assert_eq!(find_sample(&st, &nodes("down")), Some(0.0), "{st}");
    assert!(
        find_sample(&st, &round_trips()).unwrap_or(0.0) > 0.0,
        "{st}"
    );
    // `kvfs stat` names the server and says how its nodes are.
    let stat = r.stat();
    assert!(
        stat.contains(&format!("standalone {}", s.url())) && stat.contains("connected"),
        "{stat}"
    );
    let keys: u64 = s.cli(&["dbsize"]).parse().unwrap();
    assert!(keys >= 92, "the server holds {keys} keys");

    r.umount();
    let keys: u64 = s.cli(&["dbsize"]).parse().unwrap();
    assert!(keys >= 96, "after unmounting the server holds {keys} keys");
    r.mount();
    for g in 0..96 {
        assert_eq!(r.tier_of(g), "backing", "group {g} after a remount");
    }
    r.verify(&model, "after a remount");
    // Partial writes of groups only the server holds: the rest of each
    // group comes from the server.
    for g in (0..96).step_by(7) {
        let d = pattern(g + 500, 100);
        r.write_at(g, 300, &d).unwrap();
        model.get_mut(&g).unwrap()[300..400].copy_from_slice(&d);
    }
    r.verify(&model, "after partial writes");
    r.umount();
    r.mount();
    r.verify(&model, "after partial writes and a remount");

    // A group whose keys the server lost reads as EIO, never zeros; one
    // whose value is garbage reads as EIO too; both are counted.
    let keys_of = |g: u64| -> Vec<String> {
        let k = r.key(g);
        let pat = format!(
            "kvfs:{{*:{}}}:{}:{}:{}:*",
            k.block,
            k.layer,
            k.head,
            k.kind.letter()
        );
        let out = s.cli(&["keys", &pat]);
        out.lines().map(str::to_string).collect()
    };
    let (lost, bad) = (10, 11);
    assert_eq!(r.tier_of(lost), "backing");
    for k in keys_of(lost) {
        assert_eq!(s.cli(&["del", &k]), "1");
    }
    let bad_keys = keys_of(bad);
    assert!(!bad_keys.is_empty());
    for k in bad_keys {
        assert_eq!(s.cli(&["set", &k, "garbage"]), "OK");
    }
    for g in [lost, bad] {
        let e = r.read(g).expect_err("a read of a lost or damaged group");
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "group {g}: {e}");
    }
    assert!(r.metric(stats::REMOTE_LOST) >= 1.0);
    assert!(r.metric(stats::REMOTE_CORRUPT) >= 1.0);
    // A whole rewrite heals them.
    r.put(&mut model, lost, 901);
    r.put(&mut model, bad, 902);
    r.umount();
    r.mount();
    r.verify(&model, "after healing");
}

/// (3) A 3-master cluster, mounted with every seed: the groups spread over
/// all masters; a remount through one seed finds every byte.
#[test]
fn cluster_spreads_groups_over_every_master() {
    if !mountable() {
        return;
    }
    let c = RedisCluster::start(3);
    let r = Remote::new(&c.urls(), 16, "16KiB");
    r.mount();
    let desc = r.layout_json().remote.unwrap();
    assert!(desc.starts_with("cluster of 3 masters"), "{desc}");
    let mut model = Model::new();
    for g in 0..r.groups() {
        r.put(&mut model, g, g * 3 + 1);
    }
    let out = r.sync();
    assert!(out.status.success(), "sync: {}", stderr(&out));
    assert_eq!(r.metric(stats::DIRTY_BYTES), 0.0);
    let mut total = 0;
    for n in &c.nodes {
        let k: u64 = n.cli(&["dbsize"]).parse().unwrap();
        assert!(k > 0, "master {} holds no group", n.port);
        total += k;
    }
    assert!(
        total >= r.groups(),
        "{total} keys for {} groups",
        r.groups()
    );
    assert_eq!(r.metric(&nodes("connected")), 3.0);
    r.verify(&model, "in the cluster");
    r.umount();
    r.mount_on(&c.urls()[2..]);
    r.verify(&model, "after a remount through one seed");
    assert_eq!(r.metric(&nodes("connected")), 3.0);
    assert_eq!(r.metric(stats::REMOTE_ERRORS), 0.0);
}

/// (4) RESTORE through the control file of groups T1 no longer holds (a
/// 4-slot T1 under 64 STOREs, then a remount), mixed with T1 hits and
/// never-written groups.
#[test]
fn restore_of_misses_through_the_control_file() {
    if !mountable() {
        return;
    }
    let s = RedisServer::start(&[]);
    let r = Remote::new(&[s.url()], 16, "16KiB");
    r.mount();
    let n = 64u64;
    let keys: Vec<GroupKey> = (0..n).map(|g| r.key(g)).collect();
    {
        let c = Client::open(&r.m.mp).unwrap();
        let src = ShmRegion::new(n * GBU);
        for g in 0..n {
            src.write(g * GBU, &pattern(g + 7, GB));
        }
        let rs = c.register_host_region(src.file.path(), src.len).unwrap();
        let entries: Vec<_> = (0..n).map(|g| (keys[g as usize], rs, g * GBU)).collect();
        let t = c.store(&entries).unwrap();
        c.wait(t, None).unwrap().ok().unwrap();
        let q = c.query(&keys).unwrap();
        let in_t1 = q.iter().filter(|e| e.state == 2).count();
        assert!(in_t1 <= 4, "{in_t1} groups in a 4-slot T1");
        assert!(q.iter().all(|e| e.state == 1 || e.state == 2), "{q:?}");
        // Restore into another region, in reverse order: mostly misses.
        let misses = r.metric(stats::MISSES);
        let dst = ShmRegion::new(n * GBU);
        let rd = c.register_host_region(dst.file.path(), dst.len).unwrap();
        let entries: Vec<_> = (0..n)
            .map(|g| (keys[g as usize], rd, (n - 1 - g) * GBU))
            .collect();
        let t = c.restore(&entries).unwrap();
        c.wait(t, None).unwrap().ok().unwrap();
        for g in 0..n {
            assert!(
                dst.read((n - 1 - g) * GBU, GB) == pattern(g + 7, GB),
                "restore of group {g}"
            );
        }
        assert!(r.metric(stats::MISSES) >= misses + 60.0);
    }
    // After a remount every group is a miss; add two T1 hits (written
    // through their files) and four never-written groups.
    r.umount();
    r.mount();
    let mut model = Model::new();
    for g in 0..n {
        model.insert(g, pattern(g + 7, GB));
    }
    r.put(&mut model, 3, 333);
    r.put(&mut model, 40, 444);
    let c = Client::open(&r.m.mp).unwrap();
    let q = c.query(&keys).unwrap();
    for (g, e) in q.iter().enumerate() {
        let want = if g == 3 || g == 40 { 2 } else { 1 };
        assert_eq!(e.state, want, "group {g}");
    }
    let batch: Vec<u64> = (0..n).chain(100..104).collect();
    let dst = ShmRegion::new(batch.len() as u64 * GBU);
    let rd = c.register_host_region(dst.file.path(), dst.len).unwrap();
    let entries: Vec<_> = batch
        .iter()
        .enumerate()
        .map(|(i, &g)| (r.key(g), rd, i as u64 * GBU))
        .collect();
    let t = c.restore(&entries).unwrap();
    c.wait(t, None).unwrap().ok().unwrap();
    for (i, &g) in batch.iter().enumerate() {
        let got = dst.read(i as u64 * GBU, GB);
        let ok = match model.get(&g) {
            Some(w) => got == *w,
            None => got.iter().all(|&b| b == 0),
        };
        assert!(ok, "restore of group {g} after a remount");
    }
    drop(c);
    r.verify(&model, "after the restores");
}

/// (5, 8) A server with AOF (appendfsync always), stalled (SIGSTOP) for a
/// moment, then killed with SIGKILL: reads of groups only it held fail
/// with EIO promptly, T1's groups are served, new writes go into T1 while
/// it has clean or free slots, fsync and `kvfs sync` fail, RESTORE of a
/// miss completes with EIO; the metrics show it. Restarted (same port, its
/// AOF): `kvfs sync` succeeds, every group (synced before, or written while
/// it was down) reads back, after another crash of the server and after a
/// remount too.
#[test]
fn a_killed_server_fails_fast_keeps_t1_and_recovers_on_restart() {
    if !mountable() {
        return;
    }
    let mut s = RedisServer::start(&["--appendonly", "yes", "--appendfsync", "always"]);
    let r = Remote::new(&[s.url()], 16, "64KiB"); // 16 slots
    let said = r.mount();
    assert!(!said.contains("persists nothing"), "{said}");
    let mut model = Model::new();
    for g in 0..64 {
        r.put(&mut model, g, g + 1);
    }
    let out = r.sync();
    assert!(out.status.success(), "sync: {}", stderr(&out));
    // A fresh mount: T1 empty, every group in the server only. Then 8
    // dirty groups, 4 clean ones (fsync'd) and 4 free slots.
    r.umount();
    r.mount();
    for g in 64..76 {
        r.put(&mut model, g, g + 1);
    }
    for g in 72..76 {
        File::open(r.path(g)).unwrap().sync_all().unwrap();
        assert_eq!(r.xattr(g, "user.kvfs.dirty"), "0");
    }
    for g in 64..76 {
        assert_eq!(r.tier_of(g), "t1", "group {g}");
    }
    assert_eq!(r.metric(stats::REMOTE_ERRORS), 0.0);

    // A stalled server (SIGSTOP: its sockets stay open, no reply comes): a
    // read of a group only it holds fails with EIO after about the 1 s
    // timeout; once it runs again, so do the reads.
    s.freeze(true);
    let e = bounded("a read from a stalled server", || r.read(1))
        .expect_err("a read of a group only the stalled server holds");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    s.freeze(false);
    assert!(r.metric(stats::REMOTE_TIMEOUTS) >= 1.0);
    assert!(r.read(1).unwrap() == model[&1]);
    let errors = r.metric(stats::REMOTE_ERRORS);
    assert!(errors >= 1.0);

    s.kill();
    for g in [0, 17, 63] {
        let e = bounded("a read with the server down", || r.read(g))
            .expect_err("a read of a group only the dead server holds");
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "group {g}: {e}");
    }
    for g in 64..76 {
        assert!(r.read(g).unwrap() == model[&g], "T1 group {g}");
    }
    // New groups take the free slots, then the clean ones.
    for g in 76..84 {
        bounded("a write with the server down", || {
            r.put(&mut model, g, g + 1)
        });
    }
    // A partial write needs the old bytes: EIO, and nothing is installed.
    let e = bounded("a partial write", || r.write_at(5, 10, &[1, 2, 3])).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert_eq!(r.tier_of(5), "backing");
    // T1 is now all dirty: a new group cannot get a slot.
    let e = bounded("a write into a T1 full of dirty groups", || {
        r.write_at(90, 0, &pattern(90, GB))
    })
    .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert_eq!(r.tier_of(90), "empty");
    // Nothing can be made durable.
    let e = bounded("fsync", || File::open(r.path(64)).unwrap().sync_all()).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let out = bounded("kvfs sync", || r.sync());
    assert!(!out.status.success(), "kvfs sync with the server down");
    assert!(
        stderr(&out).contains("Input/output error"),
        "{}",
        stderr(&out)
    );
    // RESTORE: the miss fails with EIO, the T1 hit is copied.
    {
        let c = Client::open(&r.m.mp).unwrap();
        let dst = ShmRegion::new(2 * GBU);
        let rd = c.register_host_region(dst.file.path(), dst.len).unwrap();
        let t = c
            .restore(&[(r.key(64), rd, 0), (r.key(20), rd, GBU)])
            .unwrap();
        match bounded("a RESTORE", || c.wait(t, Some(NO_HANG))) {
            Err(kvfs::client::ClientError::Refused {
                errno,
                entry,
                message,
            }) => {
                assert_eq!((errno, entry), (libc::EIO, Some(1)), "{message}");
                assert!(message.contains("entry 1"), "{message}");
            }
            other => panic!("RESTORE with the server down: {other:?}"),
        }
        assert!(dst.read(0, GB) == model[&64]);
    }
    assert!(r.metric(stats::REMOTE_ERRORS) > errors);
    assert_eq!(r.metric(&nodes("down")), 1.0);
    assert!(r.metric(stats::WRITE_BACK_FAILURES) > 0.0);
    let stat = r.stat();
    assert!(stat.contains("1 down"), "{stat}");

    s.restart();
    let keys: u64 = s.cli(&["dbsize"]).parse().unwrap();
    assert!(keys >= 64, "the AOF gave back {keys} keys");
    let out = bounded("kvfs sync", || r.sync());
    assert!(out.status.success(), "sync after restart: {}", stderr(&out));
    assert_eq!(r.metric(stats::DIRTY_BYTES), 0.0);
    assert_eq!(r.metric(&nodes("connected")), 1.0);
    r.verify(&model, "after the server came back");
    // What was synced survives another crash of the server.
    s.kill();
    s.restart();
    r.verify(&model, "after a second crash of the server");
    r.umount();
    r.mount();
    r.verify(&model, "after a remount");
}

/// (6, 8) A server at its maxmemory with noeviction: writes go into
/// T1, `kvfs sync` and fsync fail with ENOSPC, the dirty groups stay
/// readable; once maxmemory is raised `kvfs sync` succeeds and a remount
/// finds every byte.
#[test]
fn a_server_out_of_memory_is_enospc_and_nothing_is_lost() {
    if !mountable() {
        return;
    }
    let s = RedisServer::start(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]);
    // 1024 groups of 2 KiB (over 2.5 MB in the server), all in a 4 MiB T1.
    let r = Remote::new(&[s.url()], 128, "4MiB");
    r.mount();
    let mut model = Model::new();
    for g in 0..r.groups() {
        r.put(&mut model, g, g + 11);
    }
    // fsync(2) of each group: the server takes groups until it is full,
    // then refuses (ENOSPC). (Not "the first refusal, then every one": its
    // memory use moves a little as buffers come and go.)
    let (mut taken, mut refused) = (0, 0);
    for g in 0..r.groups() {
        let f = File::open(r.path(g)).unwrap();
        match bounded("fsync", || f.sync_all()) {
            Ok(()) => taken += 1,
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "group {g}: {e}");
                refused += 1;
            }
        }
    }
    assert!(taken > 0, "the server took no group at all");
    assert!(refused > 0, "every group fit in 2 MB");
    let out = bounded("kvfs sync", || r.sync());
    assert!(!out.status.success(), "sync into a full server succeeded");
    assert!(stderr(&out).contains("No space left"), "{}", stderr(&out));
    let dirty = (0..r.groups())
        .filter(|&g| r.xattr(g, "user.kvfs.dirty") == "1")
        .count();
    assert!(dirty > 0, "kvfs sync failed, yet nothing is dirty");
    assert!(r.metric(stats::REMOTE_OOM) > 0.0);
    // Writes still land in T1, and every dirty group reads back.
    for g in 0..4 {
        r.put(&mut model, g, g + 77);
    }
    r.verify(&model, "with the server full");
    assert_eq!(s.cli(&["config", "set", "maxmemory", "0"]), "OK");
    let out = r.sync();
    assert!(out.status.success(), "sync after room: {}", stderr(&out));
    assert_eq!(r.metric(stats::DIRTY_BYTES), 0.0);
    r.umount();
    r.mount();
    r.verify(&model, "after a remount");
}

/// (7) What `kvfs mount` refuses, and what it warns about.
#[test]
fn mount_refuses_evicting_servers_and_warns_about_volatile_ones() {
    if !mountable() {
        return;
    }
    // An evicting policy: refused, saying why and what to do ...
    let lru = RedisServer::start(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]);
    let r = Remote::new(&[lru.url()], 16, "16KiB");
    let out = r.try_mount_on(&r.urls, &[]);
    let err = stderr(&out);
    assert!(!out.status.success(), "mounted over an evicting server");
    assert!(
        err.contains("maxmemory-policy allkeys-lru") && err.contains("--remote-allow-evict"),
        "{err}"
    );
    assert!(!is_mounted(&r.m.mp));
    // ... unless allowed, with a warning.
    let out = r.try_mount_on(&r.urls, &["--remote-allow-evict"]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("warning") && err.contains("evicts"), "{err}");
    let mut model = Model::new();
    r.put(&mut model, 5, 5);
    r.verify(&model, "over an evicting server");
    r.umount();
    // A store made for redis refuses another tier.
    let mut other: Vec<&str> = vec!["--tier", "file", "--t1", "16KiB"];
    let geo = geometry(2, 16);
    other.extend(geo.iter().map(String::as_str));
    let out = r.m.try_mount(&other);
    assert!(
        !out.status.success(),
        "a redis store opened with --tier file"
    );
    assert!(stderr(&out).contains("remote server"), "{}", stderr(&out));

    // --tier redis needs --remote; --remote needs --tier redis.
    let bare = Mount::unmounted();
    let mut args: Vec<&str> = vec!["--tier", "redis", "--t1", "16KiB"];
    args.extend(geo.iter().map(String::as_str));
    let out = bare.try_mount(&args);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--remote URL"), "{}", stderr(&out));
    let url = lru.url();
    let out = bare.try_mount(&["--tier", "file", "--remote", &url]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("for --tier redis"),
        "{}",
        stderr(&out)
    );

    // A server nobody listens on: refused promptly, naming it.
    let gone = RedisServer::start(&[]);
    let (url, port) = (gone.url(), gone.port);
    drop(gone);
    let r2 = Remote::new(&[url], 16, "16KiB");
    let out = bounded("a mount over a dead server", || {
        r2.try_mount_on(&r2.urls, &[])
    });
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!("127.0.0.1:{port}")),
        "{}",
        stderr(&out)
    );
    assert!(!is_mounted(&r2.m.mp));

    // A server that persists nothing: mounted, with a warning.
    let volatile = RedisServer::start(&["--save", "", "--appendonly", "no"]);
    let r3 = Remote::new(&[volatile.url()], 16, "16KiB");
    let said = r3.mount();
    assert!(
        said.contains("warning") && said.contains("persists nothing"),
        "{said}"
    );
    assert!(is_mounted(&r3.m.mp));
}

/// A TLS server whose certificate comes from a private CA and which asks
/// clients for theirs: `kvfs mount` refuses it without the CA (saying to
/// give `--remote-ca`) and without a client certificate, mounts with both,
/// and `mount.kvfs` passes the same as `-o` options; bytes written through
/// one mount read back through the next.
#[test]
fn a_tls_server_of_a_private_ca_that_checks_clients() {
    if !mountable() {
        return;
    }
    let Some(s) = RedisServer::start_tls(true) else {
        return;
    };
    let url = s.tls_url_checked().unwrap();
    let pki = s.tls_pki().unwrap();
    let (ca, (cert, key)) = (pki.ca(), pki.client());
    let (ca, cert, key) = (
        ca.to_str().unwrap(),
        cert.to_str().unwrap(),
        key.to_str().unwrap(),
    );
    let r = Remote::new(std::slice::from_ref(&url), 4, "16KiB");
    let out = r.try_mount_on(&r.urls, &[]);
    assert!(!out.status.success(), "mounted with no CA");
    assert!(stderr(&out).contains("--remote-ca"), "{}", stderr(&out));
    let out = r.try_mount_on(&r.urls, &["--remote-ca", ca]);
    assert!(!out.status.success(), "mounted with no client certificate");
    let out = r.try_mount_on(&r.urls, &["--remote-ca", ca, "--remote-cert", cert]);
    assert!(stderr(&out).contains("--remote-key"), "{}", stderr(&out));
    assert!(!is_mounted(&r.m.mp));
    let out = r.try_mount_on(
        &r.urls,
        &[
            "--remote-ca",
            ca,
            "--remote-cert",
            cert,
            "--remote-key",
            key,
        ],
    );
    assert!(out.status.success(), "{}\n{}", stderr(&out), r.log());
    let mut model = Model::new();
    for g in 0..8 {
        r.put(&mut model, g, g + 40);
    }
    assert!(r.sync().status.success());
    r.umount();
    let helper = concat!(env!("CARGO_MANIFEST_DIR"), "/mount/mount.kvfs");
    let opts = format!(
        "tier=redis,remote={url},remote_ca={ca},remote_cert={cert},remote_key={key},t1=16KiB"
    );
    let out = std::process::Command::new(helper)
        .arg(&r.m.backing)
        .arg(&r.m.mp)
        .args(["-o", &opts])
        .env("KVFS_BIN", env!("CARGO_BIN_EXE_kvfs"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}\n{}", stderr(&out), r.log());
    r.verify(&model, "through a second mount over TLS");
    r.umount();
}
