//! A backing disk that fills up, through a real mount: the backing store
//! lives on a small tmpfs. Root and /dev/fuse needed.

mod common;
use common::*;

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// 2 layers × 64 blocks × 2 heads × K/V = 512 groups of 2 KiB (4 KiB stride).
const GEOMETRY: &[&str] = &[
    "--layers",
    "2",
    "--blocks",
    "64",
    "--kv-heads",
    "2",
    "--head-dim",
    "64",
    "--block-tokens",
    "16",
    "--dtype",
    "bf16",
];

struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn new(size: &str) -> Tmpfs {
        let d = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "kvfs-test"])
            .arg(d.path())
            .status()
            .unwrap();
        assert!(ok.success(), "cannot mount a tmpfs");
        Tmpfs(d)
    }

    fn resize(&self, size: &str) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(self.0.path())
            .status()
            .unwrap();
        assert!(ok.success(), "cannot resize the tmpfs");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

fn group(mp: &Path, g: u64) -> std::path::PathBuf {
    // Index order: layer-major, then block, head, K before V.
    let (kind, rest) = (g % 2, g / 2);
    let (head, rest) = (rest % 2, rest / 2);
    let (block, layer) = (rest % 64, rest / 64);
    mp.join(format!(
        "L{layer}/B{block}/H{head}/{}",
        ["K", "V"][kind as usize]
    ))
}

fn mount_on(mp: &Path, backing: &Path, t1: &str) {
    mount_with(mp, backing, &["--t1", t1]);
}

/// `kvfs mount` at `mp` of `backing` with the test geometry and `args`;
/// must succeed.
fn mount_with(mp: &Path, backing: &Path, args: &[&str]) {
    let out = kvfs()
        .arg("mount")
        .arg(mp)
        .arg("--backing")
        .arg(backing)
        .args(args)
        .args(GEOMETRY)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mount failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn umount(mp: &Path) -> std::process::Output {
    kvfs().arg("umount").arg(mp).output().unwrap()
}

#[test]
fn a_full_backing_keeps_dirty_groups_readable_and_sync_recovers_when_space_returns() {
    if !can_mount() {
        return;
    }
    const GB: usize = 2048;
    // Room for the superblock, metadata and ~100 group copies, not 512.
    let disk = Tmpfs::new("512k");
    let backing = disk.0.path().join("store");
    let mpd = tempfile::tempdir().unwrap();
    let mp = mpd.path();
    mount_on(mp, &backing, "4MiB"); // T1 holds every group
    for g in 0..512 {
        fs::write(group(mp, g), pattern(g, GB)).unwrap();
    }
    // fsync of a group that does not fit, and a whole sync: both fail with
    // ENOSPC, in bounded time, and nothing is lost.
    let t = Instant::now();
    let mut nospc = 0;
    for g in 0..512 {
        let f = fs::OpenOptions::new()
            .write(true)
            .open(group(mp, g))
            .unwrap();
        match f.sync_all() {
            Ok(()) => {}
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
                nospc += 1;
            }
        }
    }
    assert!(nospc > 0, "the small disk never filled");
    let out = kvfs().arg("sync").arg(mp).output().unwrap();
    assert!(!out.status.success(), "sync on a full disk succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("No space left") || err.contains("ENOSPC"),
        "{err}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "failing syncs took {:?}",
        t.elapsed()
    );
    for g in 0..512 {
        assert_eq!(fs::read(group(mp, g)).unwrap(), pattern(g, GB), "group {g}");
    }
    let stats = fs::read_to_string(mp.join(".kvfs/stats")).unwrap();
    assert!(
        !stats.contains("kvfs_write_back_failures_total 0\n"),
        "{stats}"
    );
    // Space returns: sync succeeds, and after a remount everything is there.
    disk.resize("64m");
    let out = kvfs().arg("sync").arg(mp).output().unwrap();
    assert!(
        out.status.success(),
        "sync after space returned: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(umount(mp).status.success());
    mount_on(mp, &backing, "64KiB");
    for g in 0..512 {
        assert_eq!(
            fs::read(group(mp, g)).unwrap(),
            pattern(g, GB),
            "group {g} after remount"
        );
    }
    assert!(umount(mp).status.success());
}

#[test]
fn a_t1_full_of_unflushable_groups_fails_writes_cleanly() {
    if !can_mount() {
        return;
    }
    const GB: usize = 2048;
    let disk = Tmpfs::new("512k");
    let backing = disk.0.path().join("store");
    let mpd = tempfile::tempdir().unwrap();
    let mp = mpd.path();
    mount_on(mp, &backing, "64KiB"); // 16 slots: every new group evicts
    let t = Instant::now();
    let mut written = Vec::new();
    let mut refused = 0;
    for g in 0..512 {
        let f = match fs::OpenOptions::new().write(true).open(group(mp, g)) {
            Ok(f) => f,
            Err(e) => {
                let log = fs::read_to_string(backing.join("kvfs.log")).unwrap_or_default();
                panic!("open of group {g}: {e}; daemon log:\n{log}");
            }
        };
        match f.write_all_at(&pattern(g + 1000, GB), 0) {
            Ok(()) => written.push(g),
            Err(e) => {
                assert!(
                    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EIO)),
                    "{e}"
                );
                refused += 1;
            }
        }
    }
    assert!(refused > 0, "the small disk never filled");
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "writes took {:?}",
        t.elapsed()
    );
    // Every write that was accepted reads back; the daemon still serves.
    for &g in &written {
        assert_eq!(
            fs::read(group(mp, g)).unwrap(),
            pattern(g + 1000, GB),
            "group {g}"
        );
    }
    assert!(
        kvfs()
            .arg("stat")
            .arg(mp)
            .output()
            .unwrap()
            .status
            .success()
    );
    disk.resize("64m");
    let f = fs::OpenOptions::new()
        .write(true)
        .open(group(mp, 511))
        .unwrap();
    f.write_all_at(&pattern(7, GB), 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert!(
        kvfs()
            .arg("sync")
            .arg(mp)
            .output()
            .unwrap()
            .status
            .success()
    );
    let out = umount(mp);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_store_whose_metadata_cannot_fit_is_not_made_and_a_smaller_one_then_is() {
    if !can_mount() {
        return;
    }
    let disk = Tmpfs::new("256k");
    let backing = disk.0.path().join("store");
    let mpd = tempfile::tempdir().unwrap();
    // 2 layers × 65536 blocks × 2 heads × K/V: 512 Ki groups, 8 MiB of
    // metadata on a 256 KiB disk.
    let mut big: Vec<&str> = GEOMETRY.to_vec();
    big[3] = "65536";
    let out = kvfs()
        .arg("mount")
        .arg(mpd.path())
        .arg("--backing")
        .arg(&backing)
        .args(["--t1", "1MiB"])
        .args(&big)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a store that cannot fit was made");
    assert!(
        err.contains("cannot reserve the metadata file's space"),
        "{err}"
    );
    // Its cause said once, not twice.
    let cause = std::io::Error::from_raw_os_error(libc::ENOSPC).to_string();
    assert_eq!(err.matches(&cause).count(), 1, "{err}");
    // Nothing of it stays: no superblock to refuse the next geometry, no
    // files holding the disk's space.
    let left: Vec<_> = fs::read_dir(&backing)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !matches!(n.as_str(), "lock" | "kvfs.log"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    mount_on(mpd.path(), &backing, "1MiB");
    fs::write(group(mpd.path(), 5), pattern(5, 2048)).unwrap();
    assert!(umount(mpd.path()).status.success());
}

#[test]
fn the_backing_filesystem_unmounts_as_soon_as_kvfs_umount_returns() {
    if !can_mount() {
        return;
    }
    // io_uring's deferred teardown once kept the data file open a moment
    // past the daemon: umount(8) of the backing then failed with EBUSY.
    for tier in ["uring", "file"] {
        let disk = Tmpfs::new("64m");
        let backing = disk.0.path().join("store");
        let mpd = tempfile::tempdir().unwrap();
        mount_with(mpd.path(), &backing, &["--t1", "1MiB", "--tier", tier]);
        for g in 0..64 {
            fs::write(group(mpd.path(), g), pattern(g, 2048)).unwrap();
        }
        fs::read(group(mpd.path(), 600 % 512)).unwrap();
        assert!(umount(mpd.path()).status.success());
        let out = Command::new("umount").arg(disk.0.path()).output().unwrap();
        assert!(
            out.status.success(),
            "{tier}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
