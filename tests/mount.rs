//! Real mounts (root and /dev/fuse needed; skipped with a message otherwise).

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

mod common;
use common::*;

#[test]
fn list_stat_read_write_and_compare() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    assert_eq!(
        names(&m.mp),
        BTreeSet::from([".kvfs".to_string(), "L0".into(), "L1".into()])
    );
    let ls = Command::new("ls").arg(&m.mp).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&ls.stdout),
        "L0\nL1\n",
        "ls shows only the layers"
    );
    assert_eq!(names(&m.p("L1")).len(), 8);
    assert!(names(&m.p("L1")).contains("B7"));
    assert_eq!(
        names(&m.p("L1/B7")),
        BTreeSet::from(["H0".to_string(), "H1".into()])
    );
    assert_eq!(
        names(&m.p("L1/B7/H1")),
        BTreeSet::from(["K".to_string(), "V".into()])
    );
    let md = fs::metadata(m.p("L1/B7/H1/V")).unwrap();
    assert!(md.is_file());
    assert_eq!(md.len(), GB as u64);
    // Never written: zeros.
    assert_eq!(fs::read(m.p("L0/B3/H0/K")).unwrap(), vec![0u8; GB]);
    // Partial write, then read back the whole group.
    let f = OpenOptions::new()
        .write(true)
        .open(m.p("L0/B3/H0/K"))
        .unwrap();
    let part = pattern(1, 100);
    f.write_all_at(&part, 500).unwrap();
    drop(f);
    let mut want = vec![0u8; GB];
    want[500..600].copy_from_slice(&part);
    assert_eq!(fs::read(m.p("L0/B3/H0/K")).unwrap(), want);
    // Full write and cmp(1) against the same bytes in a plain file.
    let full = pattern(2, GB);
    fs::write(m.p("L1/B0/H1/V"), &full).unwrap();
    let tmp = tempfile::NamedTempFile::new().unwrap();
    fs::write(tmp.path(), &full).unwrap();
    let cmp = Command::new("cmp")
        .arg(tmp.path())
        .arg(m.p("L1/B0/H1/V"))
        .status()
        .unwrap();
    assert!(cmp.success());
    // Direct (uncached) reads see the same bytes.
    let mut d = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.p("L1/B0/H1/V"))
        .unwrap();
    let mut buf = vec![0u8; GB];
    std::io::Read::read_exact(&mut d, &mut buf).unwrap();
    assert_eq!(buf, full);
    // fsync makes it durable and clean.
    File::open(m.p("L1/B0/H1/V")).unwrap().sync_all().unwrap();
    assert_eq!(
        xattr(&m.p("L1/B0/H1/V"), "user.kvfs.dirty").as_deref(),
        Some("0")
    );
}

#[test]
fn xattrs_and_stats_and_resident() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    let g = m.p("L0/B1/H1/K");
    assert_eq!(xattr(&g, "user.kvfs.tier").as_deref(), Some("empty"));
    assert_eq!(xattr(&g, "user.kvfs.crc32c"), None);
    let data = pattern(3, GB);
    fs::write(&g, &data).unwrap();
    fs::write(m.p("L1/B2/H0/V"), pattern(4, GB)).unwrap();
    assert_eq!(xattr(&g, "user.kvfs.tier").as_deref(), Some("t1"));
    assert_eq!(xattr(&g, "user.kvfs.dirty").as_deref(), Some("1"));
    let crc = format!("{:08x}", crc32c::crc32c(&data));
    assert_eq!(xattr(&g, "user.kvfs.crc32c"), Some(crc.clone()));
    if let Ok(out) = Command::new("getfattr").arg("-d").arg(&g).output() {
        let t = String::from_utf8_lossy(&out.stdout);
        assert!(
            t.contains("user.kvfs.tier=\"t1\"") && t.contains(&crc),
            "{t}"
        );
    } else {
        eprintln!("getfattr not installed: checked through getxattr(2) only");
    }
    // resident/ lists exactly what is in T1, as symlinks to the groups.
    let res = names(&m.p(".kvfs/resident"));
    assert_eq!(
        res,
        BTreeSet::from(["L0.B1.H1.K".to_string(), "L1.B2.H0.V".into()])
    );
    assert_eq!(
        fs::read_link(m.p(".kvfs/resident/L0.B1.H1.K")).unwrap(),
        Path::new("../../L0/B1/H1/K")
    );
    assert_eq!(fs::read(m.p(".kvfs/resident/L0.B1.H1.K")).unwrap(), data);
    assert!(fs::symlink_metadata(m.p(".kvfs/resident/L0.B0.H0.K")).is_err());
    // Stats: valid Prometheus text, with the counters that matter.
    let s = m.stats();
    for line in s.lines() {
        if line.starts_with('#') {
            assert!(
                line.starts_with("# HELP ") || line.starts_with("# TYPE "),
                "{line}"
            );
            continue;
        }
        let (name, value) = line.rsplit_once(' ').unwrap();
        assert!(value.parse::<f64>().is_ok() || value == "+Inf", "{line}");
        let metric = name.split('{').next().unwrap();
        assert!(
            metric
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "{line}"
        );
        if let Some(labels) = name.strip_prefix(metric) {
            assert!(
                labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')),
                "{line}"
            );
        }
    }
    for k in [
        "kvfs_hits_total{tier=\"t1\"}",
        "kvfs_t1_slots_total",
        "kvfs_dirty_bytes",
        "kvfs_evictions_total",
        "kvfs_checksum_failures_total",
        "kvfs_op_latency_seconds_count{op=\"write\"}",
    ] {
        assert!(
            s.lines().any(|l| l.starts_with(&format!("{k} "))),
            "{k} missing:\n{s}"
        );
    }
    assert!(s.contains(&format!("kvfs_dirty_bytes {}", 2 * GB)), "{s}");
    // T1's memory arrives in the background; the gauge reaches the total.
    let gauge = |s: &str, k: &str| -> u64 {
        kvfs::stats::find_sample(s, k).unwrap_or_else(|| panic!("{k} missing:\n{s}")) as u64
    };
    let total = gauge(&s, "kvfs_t1_slots_total");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let ready = gauge(&m.stats(), "kvfs_t1_slots_ready");
        assert!(
            ready > 0 && ready <= total,
            "{ready} of {total} slots ready"
        );
        if ready == total {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "T1 never all ready");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let layout: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(m.p(".kvfs/layout")).unwrap()).unwrap();
    assert_eq!(layout["group_bytes"], GB as u64);
    assert_eq!(layout["layers"], 2);
    // kvfs stat prints a table.
    let out = kvfs().arg("stat").arg(&m.mp).output().unwrap();
    let t = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && t.contains("dirty") && t.contains("T1"),
        "{t}"
    );
    // kvfs stat --watch: a header, then a line of rates a sample; the
    // dirty column shows what is dirty now.
    let out = kvfs()
        .args(["stat", "--watch", "--interval", "0.1", "--count", "2"])
        .arg(&m.mp)
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = t.lines().collect();
    assert!(out.status.success() && lines.len() == 3, "{t}");
    assert!(
        lines[0].contains("t1 hit%")
            && lines[0].contains("restore")
            && lines[0].contains("evict/s")
    );
    assert!(lines[1].contains("KiB") || lines[1].contains(" B "), "{t}");
    let out = kvfs()
        .args(["stat", "--watch", "--interval", "0"])
        .arg(&m.mp)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--interval"));
    // kvfs sync: everything clean.
    assert!(kvfs().arg("sync").arg(&m.mp).status().unwrap().success());
    assert_eq!(xattr(&g, "user.kvfs.dirty").as_deref(), Some("0"));
    assert!(m.stats().contains("kvfs_dirty_bytes 0"));
}

#[test]
fn bad_requests_get_their_errno() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    let g = m.p("L0/B0/H0/K");
    let f = OpenOptions::new().write(true).open(&g).unwrap();
    assert_eq!(errno_of(f.write_at(b"x", GB as u64)), libc::EFBIG);
    assert_eq!(errno_of(f.write_at(&[1u8; 10], GB as u64 - 5)), libc::EFBIG);
    assert_eq!(errno_of(f.set_len(GB as u64 + 1)), libc::EFBIG);
    // Truncation zeroes the tail; the size stays the group's.
    f.write_all_at(&[7u8; 8], 0).unwrap();
    f.set_len(3).unwrap();
    drop(f);
    let mut want = vec![0u8; GB];
    want[..3].copy_from_slice(&[7, 7, 7]);
    assert_eq!(fs::read(&g).unwrap(), want);
    assert_eq!(fs::metadata(&g).unwrap().len(), GB as u64);
    assert_eq!(errno_of(File::create(m.p("L0/B0/H0/X"))), libc::EPERM);
    assert_eq!(errno_of(File::create(m.p("newfile"))), libc::EPERM);
    assert_eq!(errno_of(fs::remove_file(&g)), libc::EPERM);
    assert_eq!(errno_of(fs::rename(&g, m.p("L0/B0/H0/V"))), libc::EPERM);
    assert_eq!(errno_of(fs::create_dir(m.p("L9"))), libc::EPERM);
    assert_eq!(errno_of(fs::remove_dir(m.p("L0/B0"))), libc::EPERM);
    assert_eq!(
        errno_of(std::os::unix::fs::symlink("x", m.p("L0/s"))),
        libc::EPERM
    );
    for bad in [
        "L2",
        "L0/B8",
        "L0/B0/H2",
        "L0/B0/H0/k",
        "L00",
        "L0/B01",
        "foo",
        ".kvfs/nope",
        "L0/B0/H0/K/x",
    ] {
        let e = errno_of(fs::metadata(m.p(bad)));
        assert!(e == libc::ENOENT || e == libc::ENOTDIR, "{bad}: errno {e}");
    }
    // The mount still serves after all that.
    fs::write(&g, pattern(5, GB)).unwrap();
    assert_eq!(fs::read(&g).unwrap(), pattern(5, GB));
}

#[test]
fn unmount_then_remount_keeps_everything() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    assert_eq!(df_used_groups(&m), (0, 64), "a fresh mount: nothing used");
    // More groups than T1 holds (64 KiB = 32 slots), so some are evicted.
    let mut written = Vec::new();
    for l in 0..2 {
        for b in 0..8 {
            for h in 0..2 {
                let p = format!("L{l}/B{b}/H{h}/K");
                let seed = (l * 100 + b * 10 + h) as u64;
                fs::write(m.p(&p), pattern(seed, GB)).unwrap();
                written.push((p, seed));
            }
        }
    }
    // df: written groups are used (some written back, some only dirty in T1).
    assert_eq!(df_used_groups(&m), (32, 64));
    m.umount();
    assert!(!is_mounted(&m.mp));
    // Geometry flags that disagree are refused, naming both.
    let out = kvfs()
        .arg("mount")
        .arg(&m.mp)
        .arg("--backing")
        .arg(&m.backing)
        .args(["--preset", "qwen2.5-7b"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("store:") && err.contains("requested:"),
        "{err}"
    );
    // No geometry flags: the store's geometry.
    kvfs_mount_plain(&m);
    for (p, seed) in &written {
        assert_eq!(fs::read(m.p(p)).unwrap(), pattern(*seed, GB), "{p}");
        assert_eq!(xattr(&m.p(p), "user.kvfs.dirty").as_deref(), Some("0"));
    }
    assert_eq!(
        xattr(&m.p("L0/B0/H0/V"), "user.kvfs.tier").as_deref(),
        Some("empty")
    );
    assert_eq!(df_used_groups(&m), (32, 64), "df after a remount");
}

/// (groups used, groups in all) as statfs(2) reports them (`df`): blocks
/// and files both count groups.
fn df_used_groups(m: &Mount) -> (u64, u64) {
    let c = std::ffi::CString::new(m.mp.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a zeroed statvfs filled by the call.
    let mut v: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a NUL-terminated path, v a valid out pointer.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut v) }, 0);
    let per = GB as u64 / v.f_frsize;
    let (blocks, free) = (v.f_blocks / per, v.f_bfree / per);
    assert_eq!(
        (v.f_files, v.f_ffree),
        (blocks, free),
        "files and blocks agree"
    );
    assert_eq!(v.f_bavail, v.f_bfree);
    (blocks - free, blocks)
}

/// Kills the mount's daemon (SIGKILL) and waits until it is gone.
fn kill_daemon(m: &Mount) {
    let pid = fs::read_to_string(m.p(".kvfs/pid")).unwrap();
    kill_and_wait(pid.trim().parse().unwrap());
}

/// `kvfs mount` of the test's backing with no geometry options; must succeed.
fn kvfs_mount_plain(m: &Mount) -> std::process::Output {
    let out = kvfs()
        .arg("mount")
        .arg(&m.mp)
        .arg("--backing")
        .arg(&m.backing)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn signals_and_plain_umount_flush() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    fs::write(m.p("L1/B1/H1/V"), pattern(7, GB)).unwrap();
    let pid: i32 = fs::read_to_string(m.p(".kvfs/pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: sending SIGTERM to the daemon we started.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let t = Instant::now();
    while is_mounted(&m.mp) && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!is_mounted(&m.mp), "SIGTERM did not unmount");
    // Wait until the daemon released the store.
    let t = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    kvfs_mount_plain(&m);
    assert_eq!(fs::read(m.p("L1/B1/H1/V")).unwrap(), pattern(7, GB));
    // A plain umount(8) flushes too.
    fs::write(m.p("L0/B5/H0/K"), pattern(8, GB)).unwrap();
    let pid: i32 = fs::read_to_string(m.p(".kvfs/pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        Command::new("umount")
            .arg(&m.mp)
            .status()
            .unwrap()
            .success()
    );
    let t = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    kvfs_mount_plain(&m);
    assert_eq!(fs::read(m.p("L0/B5/H0/K")).unwrap(), pattern(8, GB));
}

#[test]
fn mount_errors_are_clear() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    let out = kvfs()
        .arg("mount")
        .arg(&m.mp)
        .arg("--backing")
        .arg(&m.backing)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("busy"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = kvfs()
        .args(["mount", "/nonexistent/kvfs-mp"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    // A second mount of the same backing elsewhere: the store is locked.
    let other = tempfile::tempdir().unwrap();
    let out = kvfs()
        .arg("mount")
        .arg(other.path())
        .arg("--backing")
        .arg(&m.backing)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("in use"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = kvfs().arg("umount").arg(other.path()).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing is mounted"));
}

#[test]
fn concurrent_readers_and_writers() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&["--threads", "4"]);
    let mp = m.mp.clone();
    let handles: Vec<_> = (0..6u64)
        .map(|t| {
            let mp = mp.clone();
            std::thread::spawn(move || {
                // Thread t owns block t of both layers; everyone reads L0/B7.
                for i in 0..40u64 {
                    let p = mp.join(format!("L{}/B{t}/H{}/K", i % 2, (i / 2) % 2));
                    let d = pattern(t * 1000 + i, GB);
                    fs::write(&p, &d).unwrap();
                    assert_eq!(fs::read(&p).unwrap(), d, "{}", p.display());
                    let shared = fs::read(mp.join("L0/B7/H0/V")).unwrap();
                    assert_eq!(shared.len(), GB);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    m.umount();
}

#[test]
fn forty_million_groups_mount_at_once() {
    if !can_mount() {
        return;
    }
    let t = Instant::now();
    let m = Mount::new(&["--preset", "llama-3.1-70b", "--blocks", "31250"]);
    let mounted = t.elapsed();
    let layout: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(m.p(".kvfs/layout")).unwrap()).unwrap();
    assert_eq!(layout["groups"], 40_000_000);
    assert_eq!(names(&m.p("L79/B31249/H7")).len(), 2);
    let t = Instant::now();
    let n = fs::read_dir(m.p("L79")).unwrap().count();
    assert_eq!(n, 31250);
    eprintln!(
        "40M groups: mounted in {mounted:?}; listed 31250 blocks in {:?}",
        t.elapsed()
    );
    fs::write(m.p("L79/B31249/H7/V"), pattern(9, 4096)).unwrap();
    assert_eq!(fs::read(m.p("L79/B31249/H7/V")).unwrap(), pattern(9, 4096));
}

#[test]
fn fuse_bench_prints_figures_and_baselines() {
    if !can_mount() || !Path::new("/dev/shm").exists() {
        return;
    }
    let out = kvfs()
        .args([
            "bench",
            "fuse",
            "--groups",
            "64",
            "--seconds",
            "0.2",
            "--dir",
            env!("CARGO_TARGET_TMPDIR"),
        ])
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{t}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "cold (O_DIRECT)",
        "repeated (cached",
        "1 reader",
        "2 readers",
        "tmpfs",
        "bare fuser",
        "kvfs/bare",
    ] {
        assert!(t.contains(want), "{want} missing:\n{t}");
    }
}

#[test]
fn mount_helper_takes_fstab_options() {
    if !can_mount() {
        return;
    }
    let mp = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let helper = concat!(env!("CARGO_MANIFEST_DIR"), "/mount/mount.kvfs");
    let run = |opts: &str| {
        Command::new(helper)
            .arg(b.path())
            .arg(mp.path())
            .args(["-o", opts])
            .env("KVFS_BIN", env!("CARGO_BIN_EXE_kvfs"))
            .output()
            .unwrap()
    };
    let out = run(
        "t1=64KiB,layers=2,blocks=4,kv_heads=1,head_dim=64,dtype=fp16,policy=lru,noatime,nofail,_netdev",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let layout: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(mp.path().join(".kvfs/layout")).unwrap()).unwrap();
    assert_eq!(
        (layout["layers"].as_u64(), layout["blocks"].as_u64()),
        (Some(2), Some(4))
    );
    assert_eq!(layout["policy"], "lru");
    assert_eq!(layout["t1_slots"], 16);
    assert!(
        kvfs()
            .arg("umount")
            .arg(mp.path())
            .status()
            .unwrap()
            .success()
    );
    let out = run("t1=64KiB,bogus=1");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown option bogus=1"));
    let out = run("t1");
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs a value"));
}

#[test]
fn mounting_over_a_dead_mount_cleans_it_up() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    let g = m.p("L0/B1/H0/K");
    fs::write(&g, pattern(11, GB)).unwrap();
    File::open(&g).unwrap().sync_all().unwrap();
    kill_daemon(&m);
    assert_eq!(errno_of(fs::metadata(m.p("L0"))), libc::ENOTCONN);
    let out = kvfs_mount_plain(&m);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cleaned up a dead kvfs mount"));
    // The fsync'd group survived the kill.
    assert_eq!(fs::read(&g).unwrap(), pattern(11, GB));
}

#[test]
fn commands_at_a_dead_mount_say_so_and_umount_removes_it() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    let g = m.p("L1/B2/H0/V");
    fs::write(&g, pattern(12, GB)).unwrap();
    File::open(&g).unwrap().sync_all().unwrap();
    kill_daemon(&m);
    for cmd in ["stat", "sync"] {
        let out = kvfs().arg(cmd).arg(&m.mp).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{cmd} at a dead mount succeeded");
        assert!(
            err.contains("daemon of") && err.contains("is gone"),
            "{cmd}: {err}"
        );
    }
    let out = kvfs().arg("umount").arg(&m.mp).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("had died"), "{err}");
    assert!(!is_mounted(&m.mp));
    m.mount(&[]);
    assert_eq!(fs::read(&g).unwrap(), pattern(12, GB));
}

#[test]
fn a_t1_bigger_than_the_machine_is_refused() {
    if !can_mount() {
        return;
    }
    let info = fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .unwrap()
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    let m = Mount::unmounted();
    let t1 = format!("{}", (kib + (1 << 20)) * 1024);
    let out = m.try_mount(&["--t1", &t1]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a T1 bigger than RAM was mounted");
    assert!(err.contains("more than the memory"), "{err}");
    assert!(!is_mounted(&m.mp));
}

#[test]
fn a_foreground_mount_tells_systemd_when_it_is_ready_and_when_it_stops() {
    if !can_mount() {
        return;
    }
    let m = Mount::unmounted();
    let dir = tempfile::tempdir().unwrap();
    let sock_path = dir.path().join("notify");
    let sock = std::os::unix::net::UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut child = kvfs()
        .arg("mount")
        .arg(&m.mp)
        .arg("--backing")
        .arg(&m.backing)
        .args(["--t1", "64KiB", "--foreground"])
        .args(geometry(2, 8))
        .env("NOTIFY_SOCKET", &sock_path)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 512];
    let n = sock.recv(&mut buf).expect("no READY=1 from the daemon");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(msg.starts_with("READY=1\n"), "{msg}");
    // Ready means ready: the mount answers at once.
    assert!(is_mounted(&m.mp));
    fs::write(m.p("L1/B3/H0/V"), pattern(3, GB)).unwrap();
    m.umount();
    let n = sock.recv(&mut buf).expect("no STOPPING=1 from the daemon");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(msg.starts_with("STOPPING=1\n"), "{msg}");
    assert!(child.wait().unwrap().success());
}

#[test]
fn t1_chunk_from_the_environment() {
    if !can_mount() {
        return;
    }
    let m = Mount::unmounted();
    let mount = |chunk: &str| {
        kvfs()
            .arg("mount")
            .arg(&m.mp)
            .arg("--backing")
            .arg(&m.backing)
            .args(["--t1", "8MiB"])
            .args(geometry(2, 8))
            .env("KVFS_T1_CHUNK", chunk)
            .output()
            .unwrap()
    };
    let out = mount("4k");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("KVFS_T1_CHUNK=4k: give at least 1MiB"),
        "{err}"
    );
    // Eight chunks of 1 MiB: all of T1 arrives, the gauge says so.
    let out = mount("1MiB");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = m.stats();
        let get = |k: &str| {
            kvfs::stats::find_sample(&s, k).unwrap_or_else(|| panic!("{k} missing:\n{s}")) as u64
        };
        let (ready, total) = (get("kvfs_t1_slots_ready"), get("kvfs_t1_slots_total"));
        assert!(total > 0 && ready <= total, "{ready} of {total}");
        if ready == total {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "T1 never all ready: {ready} of {total}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    m.umount();
}
