//! The `redis` tier against real `redis-server` processes on loopback
//! ports: standalone and a 3-master cluster, damaged and lost values, a
//! killed and a restarted server, OOM, eviction policy, replicas and WAIT.
//! Each test skips (with a message) where redis-server is not installed.

use kvfs::geometry::{Dtype, GroupIndex, GroupLayout};
use kvfs::gpu::HostBuf;
use kvfs::stats::{self, Exposition, find_sample};
use kvfs::tier::redis::testing::{self, RedisCluster, RedisServer};
use kvfs::tier::{COPIES, ReadOp, RedisTier, RemoteConfig, Tier, TierError, WriteOp, copy_index};
use std::time::{Duration, Instant};

const UUID: [u8; 16] = [
    0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10,
];
const NS: &str = "0123456789abcdeffedcba9876543210";

/// 2 layers × 8 blocks × 2 heads × K/V = 64 groups of 2 KiB (stride 4 KiB).
fn layout() -> GroupLayout {
    GroupLayout::new(2, 8, 2, 16, 64, Dtype::Fp16).unwrap()
}

fn cfg(urls: Vec<String>) -> RemoteConfig {
    RemoteConfig {
        qd: 16,
        timeout: Duration::from_millis(500),
        ..RemoteConfig::new(urls)
    }
}

fn stride() -> usize {
    layout().stride() as usize
}

/// Bytes of tier index `i` at generation `g`: distinct per index and generation.
fn pattern(i: u64, g: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (k as u64).wrapping_mul(31) ^ i.wrapping_mul(7) ^ g.wrapping_mul(131))
        .map(|x| x as u8)
        .collect()
}

/// Writes tier indices `idx` at generation `g`, one result per op.
fn write(t: &dyn Tier, idx: &[u64], g: u64) -> Vec<Result<(), TierError>> {
    let s = stride();
    let mut src = HostBuf::alloc_plain(s * idx.len().max(1)).unwrap();
    for (k, &i) in idx.iter().enumerate() {
        src.as_mut_slice()[k * s..(k + 1) * s].copy_from_slice(&pattern(i, g, s));
    }
    let ops: Vec<WriteOp> = idx
        .iter()
        .enumerate()
        .map(|(k, &i)| WriteOp {
            index: GroupIndex(i),
            buf: &src.as_slice()[k * s..(k + 1) * s],
            generation: g,
        })
        .collect();
    t.write_batch(&ops)
}

/// Reads tier indices `idx`; returns each result and, when Ok, whether the
/// bytes were generation `g`'s group bytes followed by zeros.
fn read(t: &dyn Tier, idx: &[u64], g: u64) -> Vec<Result<bool, TierError>> {
    let s = stride();
    let gb = layout().group_bytes() as usize;
    let mut dst = HostBuf::alloc_plain(s * idx.len().max(1)).unwrap();
    dst.as_mut_slice().fill(0xee);
    let mut ops: Vec<ReadOp> = dst
        .as_mut_slice()
        .chunks_mut(s)
        .zip(idx)
        .map(|(buf, &i)| ReadOp {
            index: GroupIndex(i),
            buf,
        })
        .collect();
    let res = t.read_batch(&mut ops);
    res.into_iter()
        .zip(idx)
        .enumerate()
        .map(|(k, (r, &i))| {
            r.map(|()| {
                let got = &dst.as_slice()[k * s..(k + 1) * s];
                got[..gb] == pattern(i, g, s)[..gb] && got[gb..].iter().all(|&b| b == 0)
            })
        })
        .collect()
}

fn all_indices() -> Vec<u64> {
    (0..layout().group_count() * COPIES).collect()
}

fn metrics(t: &dyn Tier) -> String {
    let mut e = Exposition::default();
    t.render_stats(&mut e);
    e.finish()
}

fn metric(t: &dyn Tier, name: &str) -> f64 {
    find_sample(&metrics(t), name).unwrap_or_else(|| panic!("no {name} in {}", metrics(t)))
}

fn errno(e: &TierError) -> Option<i32> {
    e.os_error()
}

/// The key of tier index `i`, as the tier names it.
fn key_of(i: u64) -> String {
    let l = layout();
    let k = l.key(GroupIndex(i / COPIES)).unwrap();
    format!(
        "kvfs:{{{NS}:{}}}:{}:{}:{}:{}",
        k.block,
        k.layer,
        k.head,
        k.kind.letter(),
        i % COPIES
    )
}

#[test]
fn standalone_round_trip_both_copies() {
    if !testing::available() {
        return;
    }
    let s = RedisServer::start(&[]);
    let t = RedisTier::connect(layout(), UUID, &cfg(vec![s.url()])).unwrap();
    assert_eq!(t.describe(), format!("standalone {}", s.url()));
    assert!(
        t.warnings().iter().any(|w| w.contains("persists nothing")),
        "{:?}",
        t.warnings()
    );
    let idx = all_indices();
    assert!(write(&t, &idx, 1).iter().all(|r| r.is_ok()));
    t.sync().unwrap();
    // Reverse order, so results must follow op order, not key order.
    let rev: Vec<u64> = idx.iter().rev().copied().collect();
    assert!(read(&t, &rev, 1).into_iter().all(|r| r.unwrap()));
    assert_eq!(s.cli(&["dbsize"]), idx.len().to_string());
    // The key scheme is the documented one.
    assert_eq!(
        s.cli(&["exists", &key_of(copy_index(GroupIndex(5), 1).0)]),
        "1"
    );
    // Rewrite one copy at a new generation; the other keeps its bytes.
    assert!(write(&t, &[10], 2)[0].is_ok());
    assert!(read(&t, &[10], 2)[0].as_ref().unwrap());
    assert!(read(&t, &[11], 1)[0].as_ref().unwrap());
    let m = metrics(&t);
    assert_eq!(
        find_sample(&m, "kvfs_remote_nodes{state=\"connected\"}"),
        Some(1.0)
    );
    assert!(
        find_sample(&m, "kvfs_remote_round_trip_seconds_count{tier=\"redis\"}").unwrap() >= 1.0
    );
    assert_eq!(find_sample(&m, stats::REMOTE_ERRORS), Some(0.0));
}

#[test]
fn unix_socket_url() {
    if !testing::available() {
        return;
    }
    let s = RedisServer::start(&["--unixsocket", "redis.sock", "--unixsocketperm", "700"]);
    let url = format!("unix://{}", s.socket_path().display());
    let t = RedisTier::connect(layout(), UUID, &cfg(vec![url])).unwrap();
    assert!(write(&t, &[0, 1, 2], 1).iter().all(|r| r.is_ok()));
    assert!(read(&t, &[2, 1, 0], 1).into_iter().all(|r| r.unwrap()));
}

#[test]
fn cluster_round_trip_spreads_keys_over_masters() {
    if !testing::available() {
        return;
    }
    let c = RedisCluster::start(3);
    // One seed is enough; the tier learns the rest.
    let t = RedisTier::connect(layout(), UUID, &cfg(vec![c.nodes[1].url()])).unwrap();
    let idx = all_indices();
    assert_eq!(round_trip_over_masters(&t, &c), idx.len());
    // Several seeds work too.
    let t2 = RedisTier::connect(layout(), UUID, &cfg(c.urls())).unwrap();
    assert!(read(&t2, &idx, 1).into_iter().all(|r| r.unwrap()));
}

/// Writes every group through `t`, a tier over the 3 masters of `c`,
/// syncs, checks that each master holds some, that they read back and
/// that all 3 masters count as connected; returns the keys the masters
/// hold in all.
fn round_trip_over_masters(t: &RedisTier, c: &RedisCluster) -> usize {
    assert!(
        t.describe().starts_with("cluster of 3 masters"),
        "{}",
        t.describe()
    );
    let idx = all_indices();
    assert!(write(t, &idx, 1).iter().all(|r| r.is_ok()));
    t.sync().unwrap();
    let mut total = 0;
    for s in &c.nodes {
        let n: usize = s.cli(&["dbsize"]).parse().unwrap();
        assert!(n > 0, "node {} holds no group", s.port);
        total += n;
    }
    assert!(read(t, &idx, 1).into_iter().all(|r| r.unwrap()));
    assert_eq!(metric(t, "kvfs_remote_nodes{state=\"connected\"}"), 3.0);
    total
}

/// A 3-master cluster speaking TLS (bus included), certificates of a test
/// CA: from one `rediss://` seed checked against that CA, the tier learns
/// every master's TLS port from `CLUSTER SLOTS` and reaches each with the
/// same TLS settings; without the CA it is refused.
#[test]
fn cluster_over_tls_with_a_private_ca() {
    if !testing::available() {
        return;
    }
    let Some(c) = RedisCluster::start_tls(3) else {
        return;
    };
    let urls = c.tls_urls();
    let e = refused(&cfg(vec![urls[0].clone()]));
    assert!(e.contains("--remote-ca"), "{e}");
    let with_ca = RemoteConfig {
        ca: Some(c.nodes[0].tls_pki().unwrap().ca()),
        ..cfg(vec![urls[2].clone()])
    };
    let t = RedisTier::connect(layout(), UUID, &with_ca).unwrap();
    // Every master connected and holding groups: each was reached over
    // TLS (a TLS handshake with a plain port fails).
    assert_eq!(round_trip_over_masters(&t, &c), all_indices().len());
}

/// Starts moving the slot of `key` from its owner to the next master by
/// hand: marks it importing and migrating, and migrates the first `share`
/// of its keys. Returns (slot, owner, target).
fn start_migration(c: &RedisCluster, key: &str, share: f64) -> (String, usize, usize) {
    let slot = c.nodes[0].cli(&["cluster", "keyslot", key]);
    let owner = c
        .nodes
        .iter()
        .position(|s| s.cli(&["cluster", "countkeysinslot", &slot]) != "0")
        .expect("some node holds the slot");
    let to = (owner + 1) % c.nodes.len();
    let (src, dst) = (&c.nodes[owner], &c.nodes[to]);
    let src_id = src.cli(&["cluster", "myid"]);
    let dst_id = dst.cli(&["cluster", "myid"]);
    assert_eq!(
        dst.cli(&["cluster", "setslot", &slot, "importing", &src_id]),
        "OK"
    );
    assert_eq!(
        src.cli(&["cluster", "setslot", &slot, "migrating", &dst_id]),
        "OK"
    );
    let keys = src.cli(&["cluster", "getkeysinslot", &slot, "1000"]);
    let keys: Vec<&str> = keys.lines().collect();
    let n = (keys.len() as f64 * share) as usize;
    for k in &keys[..n] {
        let r = src.cli(&[
            "migrate",
            "127.0.0.1",
            &dst.port.to_string(),
            k,
            "0",
            "5000",
        ]);
        assert_eq!(r, "OK", "migrate {k}");
    }
    (slot, owner, to)
}

/// Moves the slot of `key` from its owner to another master by hand,
/// leaving the tier's slot map stale, so the next op meets `MOVED`.
fn move_slot(c: &RedisCluster, key: &str) -> (usize, usize) {
    let (slot, owner, to) = start_migration(c, key, 1.0);
    let dst_id = c.nodes[to].cli(&["cluster", "myid"]);
    for s in &c.nodes {
        assert_eq!(s.cli(&["cluster", "setslot", &slot, "node", &dst_id]), "OK");
    }
    (owner, to)
}

#[test]
fn cluster_follows_moved_after_a_slot_migrates() {
    if !testing::available() {
        return;
    }
    let c = RedisCluster::start(3);
    let t = RedisTier::connect(layout(), UUID, &cfg(c.urls())).unwrap();
    let idx = all_indices();
    assert!(write(&t, &idx, 1).iter().all(|r| r.is_ok()));
    // Block 0's groups share one slot; move it.
    let (from, to) = move_slot(&c, &key_of(0));
    assert_ne!(from, to);
    assert!(read(&t, &idx, 1).into_iter().all(|r| r.unwrap()));
    assert!(write(&t, &idx, 2).iter().all(|r| r.is_ok()));
    assert!(read(&t, &idx, 2).into_iter().all(|r| r.unwrap()));
    assert_eq!(metric(&t, stats::REMOTE_ERRORS), 0.0);
}

#[test]
fn corrupt_value_is_eio_and_counted() {
    if !testing::available() {
        return;
    }
    let s = RedisServer::start(&[]);
    let t = RedisTier::connect(layout(), UUID, &cfg(vec![s.url()])).unwrap();
    assert!(write(&t, &[0, 1, 2, 3], 1).iter().all(|r| r.is_ok()));
    // Garbage; and a well-formed value of another copy.
    assert_eq!(s.cli(&["set", &key_of(0), "garbage"]), "OK");
    assert_eq!(s.cli(&["copy", &key_of(2), &key_of(3), "replace"]), "1");
    let r = read(&t, &[0, 1, 3], 1);
    assert_eq!(
        r[0].as_ref().err().and_then(errno),
        Some(libc::EIO),
        "{:?}",
        r[0]
    );
    assert!(r[1].as_ref().unwrap());
    assert_eq!(
        r[2].as_ref().err().and_then(errno),
        Some(libc::EIO),
        "{:?}",
        r[2]
    );
    assert_eq!(metric(&t, stats::REMOTE_CORRUPT), 2.0);
    assert_eq!(metric(&t, stats::REMOTE_LOST), 0.0);
}

#[test]
fn deleted_key_is_eio_and_counted_lost() {
    if !testing::available() {
        return;
    }
    let s = RedisServer::start(&[]);
    let t = RedisTier::connect(layout(), UUID, &cfg(vec![s.url()])).unwrap();
    assert!(write(&t, &[4, 5], 1).iter().all(|r| r.is_ok()));
    assert_eq!(s.cli(&["del", &key_of(4)]), "1");
    let r = read(&t, &[4, 5], 1);
    let e = r[0].as_ref().unwrap_err();
    assert_eq!(errno(e), Some(libc::EIO));
    assert!(e.to_string().contains("lost"), "{e}");
    assert!(r[1].as_ref().unwrap());
    assert_eq!(metric(&t, stats::REMOTE_LOST), 1.0);
}

#[test]
fn killed_server_fails_fast_with_eio() {
    if !testing::available() {
        return;
    }
    let mut s = RedisServer::start(&[]);
    let t = RedisTier::connect(layout(), UUID, &cfg(vec![s.url()])).unwrap();
    assert!(write(&t, &[0, 1], 1).iter().all(|r| r.is_ok()));
    s.kill();
    for _ in 0..2 {
        let start = Instant::now();
        let r = read(&t, &[0, 1], 1);
        assert!(
            r.iter()
                .all(|r| r.as_ref().err().and_then(errno) == Some(libc::EIO))
        );
        let w = write(&t, &[2], 1);
        assert_eq!(w[0].as_ref().err().and_then(errno), Some(libc::EIO));
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
    }
    assert_eq!(metric(&t, "kvfs_remote_nodes{state=\"down\"}"), 1.0);
    assert!(metric(&t, stats::REMOTE_ERRORS) >= 6.0);
}

#[test]
fn stalled_server_times_out() {
    if !testing::available() {
        return;
    }
    let s = RedisServer::start(&[]);
    let t = RedisTier::connect(layout(), UUID, &cfg(vec![s.url()])).unwrap();
    assert!(write(&t, &[0], 1).iter().all(|r| r.is_ok()));
    // Freeze the server: replies stop, sockets stay open.
    s.freeze(true);
    let start = Instant::now();
    let r = read(&t, &[0; 8], 1);
    assert!(
        r.iter()
            .all(|r| r.as_ref().err().and_then(errno) == Some(libc::EIO))
    );
    // One timeout for the batch, not one per command.
    assert!(
        start.elapsed() < Duration::from_millis(1500),
        "{:?}",
        start.elapsed()
    );
    assert!(metric(&t, stats::REMOTE_TIMEOUTS) >= 1.0);
    s.freeze(false);
    assert!(read(&t, &[0], 1)[0].as_ref().unwrap());
}

#[test]
fn restarted_server_reconnects_and_keeps_data() {
    if !testing::available() {
        return;
    }
    let mut s = RedisServer::start(&["--appendonly", "yes", "--appendfsync", "always"]);
    let t = RedisTier::connect(layout(), UUID, &cfg(vec![s.url()])).unwrap();
    assert!(
        !t.warnings().iter().any(|w| w.contains("persists nothing")),
        "{:?}",
        t.warnings()
    );
    let idx = all_indices();
    assert!(write(&t, &idx, 1).iter().all(|r| r.is_ok()));
    t.sync().unwrap();
    s.restart();
    // The pooled connection is stale; the tier notices and reconnects.
    assert!(read(&t, &idx, 1).into_iter().all(|r| r.unwrap()));
    assert!(write(&t, &[0], 2)[0].is_ok());
    assert_eq!(metric(&t, stats::REMOTE_ERRORS), 0.0);
}

#[test]
fn oom_write_is_enospc() {
    if !testing::available() {
        return;
    }
    let s = RedisServer::start(&[
        "--maxmemory",
        "2mb",
        "--maxmemory-policy",
        "noeviction",
        "--enable-debug-command",
        "yes",
    ]);
    let t = RedisTier::connect(layout(), UUID, &cfg(vec![s.url()])).unwrap();
    // Fill the server past maxmemory with keys of its own (1.2 MB of
    // values over a ~1 MB empty server); then group writes are refused.
    assert_eq!(
        s.cli(&["debug", "populate", "1200", "filler", "1024"]),
        "OK"
    );
    let idx = all_indices();
    let r = write(&t, &idx, 1);
    let enospc = r
        .iter()
        .filter(|r| r.as_ref().err().and_then(errno) == Some(libc::ENOSPC))
        .count();
    assert!(
        enospc > 0,
        "no write was refused: {:?}",
        s.cli(&["info", "memory"])
    );
    assert_eq!(metric(&t, stats::REMOTE_OOM), enospc as f64);
    // What was accepted reads back.
    let ok: Vec<u64> = idx
        .iter()
        .zip(&r)
        .filter(|(_, r)| r.is_ok())
        .map(|(i, _)| *i)
        .collect();
    assert!(read(&t, &ok, 1).into_iter().all(|r| r.unwrap()));
}

#[test]
fn evicting_policy_is_refused_unless_allowed() {
    if !testing::available() {
        return;
    }
    let s = RedisServer::start(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]);
    let e = RedisTier::connect(layout(), UUID, &cfg(vec![s.url()]))
        .err()
        .expect("refused");
    assert!(e.contains("maxmemory-policy allkeys-lru"), "{e}");
    assert!(
        e.contains("noeviction") && e.contains("--remote-allow-evict"),
        "{e}"
    );
    let mut c = cfg(vec![s.url()]);
    c.allow_evict = true;
    let t = RedisTier::connect(layout(), UUID, &c).unwrap();
    assert!(
        t.warnings().iter().any(|w| w.contains("evicts")),
        "{:?}",
        t.warnings()
    );
}

#[test]
fn unreachable_and_bad_urls_are_named() {
    if !testing::available() {
        return;
    }
    let s = RedisServer::start(&[]);
    let url = s.url();
    drop(s);
    let e = RedisTier::connect(layout(), UUID, &cfg(vec![url.clone()]))
        .err()
        .expect("refused");
    assert!(
        e.contains(&url.replace("redis://", "")) || e.contains(&url),
        "{e}"
    );
    let e = RedisTier::connect(layout(), UUID, &cfg(vec!["http://x".into()]))
        .err()
        .expect("refused");
    assert!(e.contains("http://x"), "{e}");
}

#[test]
fn sync_waits_for_replicas() {
    if !testing::available() {
        return;
    }
    let m = RedisServer::start(&[]);
    let r = RedisServer::start(&["--replicaof", "127.0.0.1", &m.port.to_string()]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !m
        .cli(&["info", "replication"])
        .contains("connected_slaves:1")
        || !r
            .cli(&["info", "replication"])
            .contains("master_link_status:up")
    {
        assert!(Instant::now() < deadline, "replica never connected");
        std::thread::sleep(Duration::from_millis(50));
    }
    let t = RedisTier::connect(layout(), UUID, &cfg(vec![m.url()])).unwrap();
    assert!(write(&t, &all_indices(), 1).iter().all(|r| r.is_ok()));
    t.sync().unwrap();
    assert_eq!(r.cli(&["exists", &key_of(7)]), "1");
    // Asking for more replicas than exist fails, naming the node.
    let mut c = cfg(vec![m.url()]);
    c.replicas = Some(2);
    let t2 = RedisTier::connect(layout(), UUID, &c).unwrap();
    let e = t2.sync().unwrap_err();
    assert_eq!(e.os_error(), Some(libc::EIO));
    assert!(
        e.to_string().contains(&format!("127.0.0.1:{}", m.port)),
        "{e}"
    );
}

#[test]
fn tls_url() {
    if !testing::available() {
        return;
    }
    let Some(s) = RedisServer::start_tls(false) else {
        return;
    };
    let url = s.tls_url().unwrap();
    let t = RedisTier::connect(layout(), UUID, &cfg(vec![url.clone()])).unwrap();
    assert!(t.describe().contains("rediss://"), "{}", t.describe());
    assert!(write(&t, &[0, 1, 2], 1).iter().all(|r| r.is_ok()));
    assert!(read(&t, &[2, 1, 0], 1).into_iter().all(|r| r.unwrap()));
}

/// `connect`'s error (it must fail).
fn refused(c: &RemoteConfig) -> String {
    match RedisTier::connect(layout(), UUID, c) {
        Ok(_) => panic!("connected to {:?}", c.urls),
        Err(e) => e,
    }
}

/// A TLS server of a test CA (see `RedisServer::start_tls`) and its
/// checked URL; None (with a message) where one cannot run.
fn tls_server(auth_clients: bool) -> Option<(RedisServer, String)> {
    if !testing::available() {
        return None;
    }
    let s = RedisServer::start_tls(auth_clients)?;
    let url = s.tls_url_checked().unwrap();
    Some((s, url))
}

#[test]
fn tls_checked_against_a_private_ca() {
    let Some((s, url)) = tls_server(false) else {
        return;
    };
    let pki = s.tls_pki().unwrap();
    // The web PKI roots do not know the test CA.
    let e = refused(&cfg(vec![url.clone()]));
    assert!(
        e.contains("cannot reach redis") && e.contains("certificate"),
        "{e}"
    );
    // Checked against it, the server's certificate (for 127.0.0.1) passes.
    let with_ca = RemoteConfig {
        ca: Some(pki.ca()),
        ..cfg(vec![url.clone()])
    };
    let t = RedisTier::connect(layout(), UUID, &with_ca).unwrap();
    assert!(write(&t, &[3, 4], 2).iter().all(|r| r.is_ok()));
    assert!(read(&t, &[4, 3], 2).into_iter().all(|r| r.unwrap()));
    // Another CA does not vouch for it.
    let Some(other) = testing::TestPki::make() else {
        return;
    };
    let e = refused(&RemoteConfig {
        ca: Some(other.ca()),
        ..cfg(vec![url.clone()])
    });
    assert!(e.contains("certificate"), "{e}");
    // Files and URLs that cannot go with a CA, each named.
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    for (ca, urls, says) in [
        (
            dir.path().join("none.pem"),
            vec![url.clone()],
            "cannot read the TLS CA file",
        ),
        (
            junk.clone(),
            vec![url.clone()],
            "holds no PEM CERTIFICATE block",
        ),
        (pki.ca(), vec![format!("{url}/#insecure")], "#insecure"),
        (
            pki.ca(),
            vec![format!("redis://127.0.0.1:{}", s.port)],
            "is not one",
        ),
    ] {
        let e = refused(&RemoteConfig {
            ca: Some(ca),
            ..cfg(urls)
        });
        assert!(e.contains(says), "{says}: {e}");
    }
    assert!(read(&t, &[3, 4], 2).into_iter().all(|r| r.unwrap()));
}

#[test]
fn tls_client_certificate_for_a_server_that_asks() {
    let Some((s, url)) = tls_server(true) else {
        return;
    };
    let pki = s.tls_pki().unwrap();
    let ca_only = RemoteConfig {
        ca: Some(pki.ca()),
        ..cfg(vec![url.clone()])
    };
    let e = refused(&ca_only);
    assert!(e.contains("cannot reach redis"), "{e}");
    let (cert, key) = pki.client();
    let e = refused(&RemoteConfig {
        client_cert: Some((cert.clone(), pki.ca())),
        ..ca_only.clone()
    });
    assert!(e.contains("holds no PEM PRIVATE KEY block"), "{e}");
    let t = RedisTier::connect(
        layout(),
        UUID,
        &RemoteConfig {
            client_cert: Some((cert, key)),
            ..ca_only
        },
    )
    .unwrap();
    assert!(write(&t, &[5], 3).iter().all(|r| r.is_ok()));
    assert!(read(&t, &[5], 3).into_iter().all(|r| r.unwrap()));
}

#[test]
fn cluster_follows_ask_during_a_slot_migration() {
    if !testing::available() {
        return;
    }
    let c = RedisCluster::start(3);
    let t = RedisTier::connect(layout(), UUID, &cfg(c.urls())).unwrap();
    let idx = all_indices();
    // Copies 0 of block 0 exist before the migration starts; copies 1 do not.
    let block0: Vec<u64> = idx
        .iter()
        .copied()
        .filter(|&i| layout().key(GroupIndex(i / COPIES)).unwrap().block == 0)
        .collect();
    let (c0, c1): (Vec<u64>, Vec<u64>) = block0.iter().partition(|&&i| i % COPIES == 0);
    assert!(write(&t, &c0, 1).iter().all(|r| r.is_ok()));
    // Start moving block 0's slot; move half its keys; leave it migrating.
    let (slot, _, to) = start_migration(&c, &key_of(0), 0.5);
    let dst = &c.nodes[to];
    // Migrated keys answer ASK; new keys are created on the target via ASK.
    assert!(read(&t, &c0, 1).into_iter().all(|r| r.unwrap()));
    assert!(write(&t, &c1, 1).iter().all(|r| r.is_ok()));
    assert!(read(&t, &c1, 1).into_iter().all(|r| r.unwrap()));
    assert_ne!(dst.cli(&["cluster", "countkeysinslot", &slot]), "0");
    assert_eq!(metric(&t, stats::REMOTE_ERRORS), 0.0);
}
