//! Crash cycles through a real mount (`kvfs bench crash`): SIGKILL at random
//! moments, remount over the dead mount, every group checked. Root and
//! /dev/fuse needed. The long run: `kvfs bench crash --cycles 100`.

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
