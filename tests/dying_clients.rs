//! Clients that die mid-ticket: 100 fresh clients in a row, each with host
//! regions registered, a ring set up and RESTORE/STORE tickets in flight
//! (through ioctls and through the ring), killed with SIGKILL. The daemon
//! finishes or fails their tickets, releases their regions and sessions
//! (its mappings, open files and memory stay flat), and keeps serving
//! (root, /dev/fuse and python3 needed; the client is the Python package).

mod common;
use common::*;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

const CLIENT: &str = r#"
import os, sys, tempfile
from kvfs import Kvfs, RESTORE, STORE
kv = Kvfs(sys.argv[1])
gb, groups = kv.layout["group_bytes"], kv.layout["groups"]
regions = []
for _ in range(2):
    fd, p = tempfile.mkstemp(dir="/dev/shm", prefix="kvfs-dying-")
    os.ftruncate(fd, groups * gb)
    regions.append(kv.register_host_region(p, groups * gb))
    os.unlink(p)
keys = [(l, b, h, k) for l in range(2) for b in range(8) for h in range(2) for k in "KV"]
src, dst = regions
store = kv.encode_entries([k + (src, i * gb) for i, k in enumerate(keys)])
restore = kv.encode_entries([k + (dst, i * gb) for i, k in enumerate(keys)])
ring = kv.ring(entries=16, data_bytes=1 << 16)
hs, hr = ring.put(store), ring.put(restore)
for i in range(8):
    ring.submit(STORE if i % 2 else RESTORE, hs if i % 2 else hr, user_data=i)
for _ in range(20):
    kv.store(store, wait=False)
    kv.restore(restore, wait=False)
print("ready", flush=True)
sys.stdin.read()
"#;

fn proc_count(pid: i32, what: &str) -> usize {
    match what {
        "fd" => std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count(),
        _ => std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .unwrap()
            .lines()
            .count(),
    }
}

fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn a_hundred_clients_killed_mid_ticket() {
    if !can_mount() {
        return;
    }
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: python3 is not installed");
        return;
    }
    let m = Mount::new(&[]);
    let pid: i32 = std::fs::read_to_string(m.p(".kvfs/pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let root = env!("CARGO_MANIFEST_DIR");
    let kill_one = || {
        let mut child = Command::new("python3")
            .args(["-c", CLIENT])
            .arg(&m.mp)
            .env("PYTHONPATH", format!("{root}/tools/python"))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(
            line.trim(),
            "ready",
            "the client did not get its tickets in flight"
        );
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
    };
    // Warm up (pools, thread stacks), then measure across 100 kills.
    for _ in 0..5 {
        kill_one();
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let before = (rss_kib(pid), proc_count(pid, "fd"), proc_count(pid, "maps"));
    for _ in 0..100 {
        kill_one();
    }
    // Tickets of the dead finish on their own; then everything is released.
    let mut after = before;
    for _ in 0..50 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        after = (rss_kib(pid), proc_count(pid, "fd"), proc_count(pid, "maps"));
        if after.1 <= before.1 && after.2 <= before.2 {
            break;
        }
    }
    eprintln!(
        "100 clients killed mid-ticket: daemon RSS {} -> {} KiB, open fds {} -> {}, mappings {} -> {}",
        before.0, after.0, before.1, after.1, before.2, after.2
    );
    assert!(
        after.1 <= before.1,
        "open files grew: {before:?} -> {after:?}"
    );
    assert!(
        after.2 <= before.2,
        "mappings grew: {before:?} -> {after:?}"
    );
    assert!(
        after.0 <= before.0 + 16 * 1024,
        "RSS grew by more than 16 MiB: {before:?} -> {after:?}"
    );
    // Still serving: a fresh client's round trip, and the group files.
    let c = kvfs::client::Client::open(&m.mp).unwrap();
    let r = ShmRegion::new(GB as u64);
    r.write(0, &pattern(3, GB));
    let rid = c.register_host_region(&r.path(), GB as u64).unwrap();
    let k = kvfs::geometry::GroupKey::new(1, 7, 1, kvfs::geometry::Kind::V);
    let t = c.store(&[(k, rid, 0)]).unwrap();
    c.wait(t, None).unwrap().ok().unwrap();
    assert_eq!(std::fs::read(m.p("L1/B7/H1/V")).unwrap(), pattern(3, GB));
    let stats = m.stats();
    assert!(stats.contains("kvfs_control_sessions_total"), "{stats}");
}
