//! Crash cycles through a real mount (`kvfs bench crash`): SIGKILL at random
//! moments, remount over the dead mount, every group checked. Root and
//! /dev/fuse needed. The long run: `kvfs bench crash --cycles 100`. Then
//! simulated power cuts (`--power-loss`): unsynced 4 KiB pages of the data
//! and metadata files kept or lost at random after each kill.

mod common;
use common::*;

#[test]
fn ten_crash_cycles_lose_no_fsynced_group_and_serve_no_garbage() {
    if !can_mount() {
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = kvfs()
        .args([
            "bench", "crash", "--cycles", "10", "--seed", "20261202", "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "crash cycles failed");
    let total = text
        .lines()
        .find(|l| l.starts_with("total:"))
        .expect("a total line");
    assert!(total.contains("10 cycles"), "{total}");
    assert!(
        total.contains(" 0 silent corruptions, 0 fsync'd groups lost"),
        "{total}"
    );
    // The writers did write and fsync, so the checks had something to check.
    let n = |what: &str| -> u64 {
        total
            .split(',')
            .chain(total.split(';'))
            .find_map(|p| {
                p.trim()
                    .strip_suffix(what)?
                    .trim()
                    .rsplit(' ')
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    };
    assert!(n("writes") > 100, "{total}");
    assert!(n("fsync'd") > 10, "{total}");
}

#[test]
fn ten_power_cuts_lose_no_fsynced_group_and_serve_no_garbage() {
    if !can_mount() {
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = kvfs()
        .args([
            "bench",
            "crash",
            "--cycles",
            "10",
            "--tier",
            "file",
            "--power-loss",
            "--seed",
            "20261203",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "power-cut cycles failed");
    let total = text.lines().find(|l| l.starts_with("total:")).unwrap();
    assert!(
        total.contains("10 cycles")
            && total.contains(" 0 silent corruptions, 0 fsync'd groups lost"),
        "{total}"
    );
    // The cuts found unsynced pages (so they had something to drop).
    let cuts = text.lines().find(|l| l.starts_with("power cuts:")).unwrap();
    let found: u64 = cuts
        .split_whitespace()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(found > 0, "{cuts}");
    // --power-loss follows the file tier's syncs only.
    let out = kvfs()
        .args(["bench", "crash", "--cycles", "1", "--power-loss", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tier file"));
}
