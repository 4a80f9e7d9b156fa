//! The soak load through a real mount (`kvfs bench soak`) for 60 seconds:
//! every byte read or restored is checked, errors must be 0 and the
//! daemon's memory must stay within T1 + 64 MiB. Root and /dev/fuse needed.
//! The long run: `kvfs bench soak --seconds 600`. Then the remote tier
//! with its redis-server killed every 4 s for 20 s (`--tier redis`): only
//! EIO/ENOSPC during outages, and every group verifies after a final sync.

mod common;
use common::*;

#[test]
fn a_minute_of_mixed_load_has_no_errors_and_bounded_memory() {
    if !can_mount() {
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = kvfs()
        .args([
            "bench",
            "soak",
            "--seconds",
            "60",
            "--seed",
            "20261202",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the soak failed");
    let total = text
        .lines()
        .find(|l| l.starts_with("total:"))
        .expect("a total line");
    assert!(total.contains(", 0 errors;"), "{total}");
    // Every kind of operation ran.
    for op in [
        "fuse_write",
        "fuse_partial_write",
        "fuse_read",
        "fsync",
        "ctl_store",
        "ctl_restore",
    ] {
        let n: u64 = text
            .lines()
            .find_map(|l| l.trim().strip_prefix(op)?.trim().parse().ok())
            .unwrap_or(0);
        assert!(n > 0, "no {op} ran:\n{text}");
    }
}

#[test]
fn the_remote_tier_through_server_kills_loses_nothing() {
    if !can_mount() || !kvfs::tier::redis::testing::available() {
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = kvfs()
        .args([
            "bench",
            "soak",
            "--tier",
            "redis",
            "--seconds",
            "20",
            "--kill-every",
            "4",
            "--down",
            "1",
            "--workers",
            "8",
            "--seed",
            "20261203",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the outage soak failed");
    let outages = text
        .lines()
        .find(|l| l.contains("outages (redis-server killed and restarted)"))
        .expect("an outage line");
    assert!(!outages.trim_start().starts_with("0 outages"), "{outages}");
    assert!(outages.ends_with(": 0 wrong or unreadable"), "{outages}");
    let total = text.lines().find(|l| l.starts_with("total:")).unwrap();
    assert!(total.contains(", 0 errors;"), "{total}");
}
