//! The soak load through a real mount (`kvfs bench soak`) for 60 seconds:
//! every byte read or restored is checked, errors must be 0 and the
//! daemon's memory must stay within T1 + 64 MiB. Root and /dev/fuse needed.
//! The long run: `kvfs bench soak --seconds 600`.

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
