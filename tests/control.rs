//! The control file through a real mount: round trips, batches, rejections,
//! isolation between fds, concurrency (root and /dev/fuse needed).

mod common;
use common::*;

use kvfs::client::{Client, Transport};
use kvfs::control::wire::{self, Request};
use kvfs::geometry::{GroupKey, Kind};
use std::fs;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;

/// 4 layers × 512 blocks × 2 heads × {K,V} = 8192 groups of 2 KiB; T1 32 slots.
const BIG: &[&str] = &[
    "--layers",
    "4",
    "--blocks",
    "512",
    "--kv-heads",
    "2",
    "--head-dim",
    "64",
    "--block-tokens",
    "16",
    "--dtype",
    "bf16",
];

fn key(i: u64) -> GroupKey {
    // Spread over the layout: layer-major order as the geometry numbers groups.
    let kind = if i.is_multiple_of(2) {
        Kind::K
    } else {
        Kind::V
    };
    let i = i / 2;
    GroupKey::new((i / 1024) as u32, i / 2 % 512, (i % 2) as u32, kind)
}

fn path(k: &GroupKey) -> String {
    k.to_string()
}

#[test]
fn store_and_restore_round_trip_against_file_reads() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(BIG);
    for transport in [Transport::Auto, Transport::WriteRead] {
        let c = Client::open(&m.mp).unwrap().with_transport(transport);
        let (version, layout) = c.hello().unwrap();
        assert_eq!(version, 1);
        assert!(layout.contains("\"groups\":8192"), "{layout}");
        for n in [1u64, 4096] {
            let seed = n * 7 + (transport == Transport::Auto) as u64;
            let src = ShmRegion::new(n * GB as u64);
            for i in 0..n {
                src.write(i * GB as u64, &pattern(seed + i, GB));
            }
            let r = c.register_host_region(&src.path(), src.len).unwrap();
            let entries: Vec<_> = (0..n).map(|i| (key(i * 2 + 1), r, i * GB as u64)).collect();
            let t = c.store(&entries).unwrap();
            c.wait(t, None).unwrap();
            // Every stored group reads back through the filesystem.
            for i in (0..n).step_by(97) {
                assert_eq!(
                    fs::read(m.p(&path(&key(i * 2 + 1)))).unwrap(),
                    pattern(seed + i, GB),
                    "group {i}"
                );
            }
            // Restore into a second region, in reverse order; T1 holds 32, so
            // most are misses from the backing and a few are hits.
            let dst = ShmRegion::new(n * GB as u64);
            let r2 = c.register_host_region(&dst.path(), dst.len).unwrap();
            let entries: Vec<_> = (0..n)
                .map(|i| (key(i * 2 + 1), r2, (n - 1 - i) * GB as u64))
                .collect();
            let t = c.restore(&entries).unwrap();
            c.wait(t, None).unwrap();
            for i in 0..n {
                let got = dst.read((n - 1 - i) * GB as u64, GB);
                assert_eq!(
                    got,
                    fs::read(m.p(&path(&key(i * 2 + 1)))).unwrap(),
                    "restore of group {i}"
                );
            }
            c.unregister(r).unwrap();
            c.unregister(r2).unwrap();
        }
    }
    let s = m.stats();
    assert!(
        s.contains("kvfs_control_requests_total{command=\"restore\"} 4"),
        "{s}"
    );
    assert!(
        s.contains("kvfs_control_ticket_latency_seconds_count{op=\"restore\"} 4"),
        "{s}"
    );
}

#[test]
fn hits_and_misses_in_one_batch_and_query_prefetch() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(BIG);
    let c = Client::open(&m.mp).unwrap();
    // 64 groups written through files: the first 32+ are evicted to the backing.
    for i in 0..64 {
        fs::write(m.p(&path(&key(i))), pattern(i, GB)).unwrap();
    }
    let states = c.query(&(0..64).map(key).collect::<Vec<_>>()).unwrap();
    let in_t1 = states.iter().filter(|s| s.state == wire::STATE_T1).count();
    let in_backing = states
        .iter()
        .filter(|s| s.state == wire::STATE_BACKING)
        .count();
    assert!(
        in_t1 > 0 && in_backing > 0,
        "t1 {in_t1}, backing {in_backing}"
    );
    let dst = ShmRegion::new(64 * GB as u64);
    let r = c.register_host_region(&dst.path(), dst.len).unwrap();
    let t = c
        .restore(
            &(0..64)
                .map(|i| (key(i), r, i * GB as u64))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    c.wait(t, None).unwrap();
    for i in 0..64 {
        assert_eq!(dst.read(i * GB as u64, GB), pattern(i, GB), "group {i}");
    }
    // A never-written group restores as zeros and queries as empty.
    let q = c.query(&[key(5000)]).unwrap();
    assert_eq!((q[0].state, q[0].dirty), (wire::STATE_EMPTY, false));
    // PREFETCH brings backing groups into T1, and resident/ shows them.
    let cold: Vec<GroupKey> = (0..64)
        .map(key)
        .zip(&states)
        .filter(|(_, s)| s.state == wire::STATE_BACKING)
        .map(|(k, _)| k)
        .take(3)
        .collect();
    for k in &cold {
        let name = format!("L{}.B{}.H{}.{}", k.layer, k.block, k.head, k.kind.letter());
        assert!(!names(&m.p(".kvfs/resident")).contains(&name));
    }
    let t = c.prefetch(&cold).unwrap();
    c.wait(t, None).unwrap();
    let res = names(&m.p(".kvfs/resident"));
    for k in &cold {
        let name = format!("L{}.B{}.H{}.{}", k.layer, k.block, k.head, k.kind.letter());
        assert!(res.contains(&name), "{name} not resident after prefetch");
        assert_eq!(c.query(&[*k]).unwrap()[0].state, wire::STATE_T1);
    }
    // A STORE invalidates pages the kernel cached for the group.
    let g = m.p(&path(&key(0)));
    let f = fs::File::open(&g).unwrap();
    let mut before = vec![0u8; GB];
    f.read_exact_at(&mut before, 0).unwrap();
    dst.write(0, &pattern(999, GB));
    let t = c.store(&[(key(0), r, 0)]).unwrap();
    c.wait(t, None).unwrap();
    let mut after = vec![0u8; GB];
    f.read_exact_at(&mut after, 0).unwrap();
    assert_eq!(
        after,
        pattern(999, GB),
        "a kept-open fd saw stale cached bytes after STORE"
    );
}

#[test]
fn every_bad_request_is_refused_and_the_daemon_still_serves() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(BIG);
    let c = Client::open(&m.mp).unwrap();
    let reg = ShmRegion::new(4 * GB as u64);
    let r = c.register_host_region(&reg.path(), reg.len).unwrap();
    let ok = |c: &Client| {
        let t = c.store(&[(key(3), r, 0)]).unwrap();
        c.wait(t, None).unwrap();
        let t = c.restore(&[(key(3), r, GB as u64)]).unwrap();
        c.wait(t, None).unwrap();
        assert_eq!(reg.read(0, GB), reg.read(GB as u64, GB));
    };
    reg.write(0, &pattern(1, GB));
    ok(&c);
    // Keys outside the geometry, naming the entry.
    let (e, entry, msg) = errno(c.restore(&[
        (key(0), r, 0),
        (GroupKey::new(4, 0, 0, Kind::K), r, GB as u64),
    ]));
    assert_eq!((e, entry), (libc::ERANGE, Some(1)), "{msg}");
    assert!(msg.contains("layer 4 is out of range"), "{msg}");
    let (e, _, msg) = errno(c.restore(&[(GroupKey::new(0, 512, 0, Kind::K), r, 0)]));
    assert!(e == libc::ERANGE && msg.contains("block"), "{msg}");
    // Unknown region, out-of-bounds and overflowing offsets, overlaps.
    assert_eq!(errno(c.restore(&[(key(0), r + 7, 0)])).0, libc::EBADF);
    let (e, entry, msg) = errno(c.restore(&[(key(0), r, 0), (key(1), r, 3 * GB as u64 + 1)]));
    assert_eq!((e, entry), (libc::EFAULT, Some(1)), "{msg}");
    assert_eq!(errno(c.store(&[(key(0), r, u64::MAX - 5)])).0, libc::EFAULT);
    let (e, entry, msg) = errno(c.restore(&[(key(0), r, 0), (key(1), r, GB as u64 / 2)]));
    assert_eq!((e, entry), (libc::EINVAL, Some(1)), "{msg}");
    assert!(msg.contains("overlapping"), "{msg}");
    // Nothing of a refused batch ran: group 0 is still empty.
    assert_eq!(c.query(&[key(0)]).unwrap()[0].state, wire::STATE_EMPTY);
    // Bad kind.
    let mut raw = wire::encode_request(&Request::Query(vec![wire::RawKey {
        layer: 0,
        block: 0,
        head: 0,
        kind: 2,
    }]));
    let rep = c.call_bytes(&raw).unwrap();
    assert_eq!(rep.status as i32, libc::EINVAL, "{}", rep.message);
    // Unknown command, wrong version, bad magic: EINVAL with a message.
    raw[6] = 99;
    let rep = c.call_bytes(&raw).unwrap();
    assert!(
        rep.status as i32 == libc::EINVAL && rep.message.contains("unknown command 99"),
        "{}",
        rep.message
    );
    let mut v = wire::encode_request(&Request::Hello);
    v[4] = 7;
    let rep = c.call_bytes(&v).unwrap();
    assert!(
        rep.status as i32 == libc::EINVAL && rep.message.contains("version 7"),
        "{}",
        rep.message
    );
    let rep = c.call_bytes(b"GARBAGE-GARBAGE-GARBAGE-GARBAGE-!").unwrap();
    assert!(
        rep.status as i32 == libc::EINVAL && rep.message.contains("magic"),
        "{}",
        rep.message
    );
    // A truncated request (write, then read before the rest comes).
    let full = wire::encode_request(&Request::Query(vec![wire::RawKey {
        layer: 0,
        block: 0,
        head: 0,
        kind: 0,
    }]));
    let rep = c.call_bytes(&full[..40]).unwrap();
    assert!(
        rep.status as i32 == libc::EINVAL && rep.message.contains("truncated"),
        "{}",
        rep.message
    );
    // An oversized count.
    let mut big = wire::encode_request(&Request::Query(vec![]));
    big[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    let rep = c.call_bytes(&big).unwrap();
    assert!(
        rep.status as i32 == libc::EINVAL && rep.message.contains("too many"),
        "{}",
        rep.message
    );
    // Unknown ioctl numbers are ENOTTY; a WAIT for an unknown ticket is EINVAL.
    // SAFETY: TCGETS into a buffer large enough for a termios.
    let e = unsafe { libc::ioctl(c.fd(), libc::TCGETS, [0u8; 128].as_mut_ptr()) };
    assert!(e < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOTTY));
    assert_eq!(errno(c.wait(12345, None)).0, libc::EINVAL);
    // REGISTER of things that are not the client's regular files.
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(reg.path(), &link).unwrap();
    let short = ShmRegion::new(100);
    for (p, len, want, why) in [
        (PathBuf::from("relative/path"), 10, libc::EINVAL, "absolute"),
        (
            PathBuf::from("/dev/null"),
            10,
            libc::EINVAL,
            "not a regular file",
        ),
        (dir.path().to_path_buf(), 10, libc::EISDIR, ""),
        (link.clone(), 10, libc::ELOOP, "symbolic link"),
        (
            PathBuf::from("/dev/shm/kvfs-no-such-file"),
            10,
            libc::ENOENT,
            "",
        ),
        (short.path(), 4096, libc::EINVAL, "shorter"),
        (reg.path(), 0, libc::EINVAL, "at least 1"),
    ] {
        // Sent as they are (the client would make a missing file and
        // an absolute path): the daemon's own refusals.
        let raw = wire::encode_request(&Request::Register {
            path: p.as_os_str().as_encoded_bytes().to_vec(),
            len,
            flags: 0,
        });
        let rep = c.call_bytes(&raw).unwrap();
        let (e, msg) = (rep.status as i32, rep.message);
        assert!(
            e == want && msg.contains(why),
            "{}: errno {e}: {msg}",
            p.display()
        );
    }
    // The client makes a missing region file (zeros, 0600) and refuses a
    // short existing one without growing it.
    let made = dir.path().join("made");
    let r8 = c.register_host_region(&made, 3 * GB as u64).unwrap();
    let md = std::fs::metadata(&made).unwrap();
    assert_eq!((md.len(), md.mode() & 0o777), (3 * GB as u64, 0o600));
    c.unregister(r8).unwrap();
    let (e, _, msg) = errno(c.register_host_region(&short.path(), 4096));
    assert!(e == libc::EINVAL && msg.contains("shorter"), "{msg}");
    assert_eq!(std::fs::metadata(short.path()).unwrap().len(), 100);
    let (e, _, msg) = errno(c.register_host_region(&dir.path().join("no/such/dir"), 10));
    assert!(
        e == libc::ENOENT && msg.contains("cannot make region file"),
        "{msg}"
    );
    // Unregister twice.
    let r9 = c.register_host_region(&reg.path(), reg.len).unwrap();
    c.unregister(r9).unwrap();
    assert_eq!(errno(c.unregister(r9)).0, libc::EBADF);
    // After all of that, everything still works.
    reg.write(0, &pattern(2, GB));
    ok(&c);
    let s = m.stats();
    assert!(
        s.contains("kvfs_control_rejected_total{command=\"restore\"}"),
        "{s}"
    );
}

#[test]
fn fds_cannot_use_each_others_regions() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(BIG);
    let a = Client::open(&m.mp).unwrap();
    let b = Client::open(&m.mp).unwrap();
    let ra = ShmRegion::new(GB as u64);
    let rb = ShmRegion::new(GB as u64);
    let ida = a.register_host_region(&ra.path(), ra.len).unwrap();
    let idb = b.register_host_region(&rb.path(), rb.len).unwrap();
    assert_eq!(ida, idb, "ids are per fd, so both are the first");
    // b's id 1 on a's fd names a's region, never b's; an id b never got is refused.
    assert_eq!(errno(b.restore(&[(key(0), idb + 1, 0)])).0, libc::EBADF);
    assert_eq!(errno(a.unregister(ida + 1)).0, libc::EBADF);
    rb.write(0, &pattern(5, GB));
    let t = b.store(&[(key(9), idb, 0)]).unwrap();
    b.wait(t, None).unwrap();
    // a cannot wait on b's ticket.
    assert_eq!(
        errno(a.wait(t, Some(std::time::Duration::from_millis(10)))).0,
        libc::EINVAL
    );
    let t = a.restore(&[(key(9), ida, 0)]).unwrap();
    a.wait(t, None).unwrap();
    assert_eq!(ra.read(0, GB), pattern(5, GB));
    // Closing b releases its regions; a is unaffected.
    drop(b);
    let t = a.restore(&[(key(9), ida, 0)]).unwrap();
    a.wait(t, None).unwrap();
}

#[test]
fn many_tickets_in_flight_and_completions_by_poll() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(BIG);
    let c = Client::open(&m.mp).unwrap().with_transport(Transport::Auto);
    let n = 256u64;
    let src = ShmRegion::new(n * GB as u64);
    for i in 0..n {
        src.write(i * GB as u64, &pattern(i + 40, GB));
    }
    let r = c.register_host_region(&src.path(), src.len).unwrap();
    let tickets: Vec<u64> = (0..n)
        .map(|i| c.store(&[(key(i), r, i * GB as u64)]).unwrap())
        .collect();
    for t in tickets.iter().rev() {
        c.wait(*t, Some(std::time::Duration::from_secs(60)))
            .unwrap();
    }
    // Restores collected through poll(2) + read(2) completion records.
    let dst = ShmRegion::new(n * GB as u64);
    let r2 = c.register_host_region(&dst.path(), dst.len).unwrap();
    let mut pending: std::collections::BTreeSet<u64> = (0..n)
        .map(|i| c.restore(&[(key(i), r2, i * GB as u64)]).unwrap())
        .collect();
    while !pending.is_empty() {
        let mut pfd = libc::pollfd {
            fd: c.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd we own.
        let rc = unsafe { libc::poll(&mut pfd, 1, 10_000) };
        assert!(
            rc == 1 && pfd.revents & libc::POLLIN != 0,
            "poll said {rc} / {:#x}",
            pfd.revents
        );
        let done = c.next_completion().unwrap();
        assert_eq!(done.status, 0, "{}", done.message);
        assert!(
            pending.remove(&done.ticket),
            "unexpected ticket {}",
            done.ticket
        );
    }
    for i in 0..n {
        assert_eq!(
            dst.read(i * GB as u64, GB),
            pattern(i + 40, GB),
            "group {i}"
        );
    }
    // Threads sharing one client.
    let c = std::sync::Arc::new(c);
    let hs: Vec<_> = (0..4u64)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                for i in 0..32 {
                    let g = t * 32 + i;
                    let tk = c.restore(&[(key(g), r2, g * GB as u64)]).unwrap();
                    c.wait(tk, None).unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn control_file_is_owner_only() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(BIG);
    use std::os::unix::fs::MetadataExt;
    let md = fs::metadata(m.p(".kvfs/control")).unwrap();
    assert_eq!(md.mode() & 0o777, 0o600);
    // SAFETY: getuid has no preconditions.
    assert_eq!(md.uid(), unsafe { libc::getuid() });
    assert!(names(&m.p(".kvfs")).contains("control"));
}

#[test]
fn ctl_command_queries_and_prefetches() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    let ctl = |args: &[&str]| kvfs().arg("ctl").arg(&m.mp).args(args).output().unwrap();
    fs::write(m.p("L1/B2/H0/V"), pattern(1, GB)).unwrap();
    let out = ctl(&["query", "L1/B2/H0/V", "L0/B0/H0/K"]);
    let t = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Neither was ever written back: no backing checksum to show.
    assert!(
        t.contains("L1/B2/H0/V\tt1\tdirty=1\tbacking_crc32c=-\n")
            && t.contains("L0/B0/H0/K\tempty\tdirty=0\tbacking_crc32c=-\n"),
        "{t}"
    );
    assert!(kvfs().arg("sync").arg(&m.mp).status().unwrap().success());
    let out = ctl(&["query", "L1/B2/H0/V"]);
    let crc = format!("{:08x}", crc32c::crc32c(&pattern(1, GB)));
    let t = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        t,
        format!("L1/B2/H0/V\tt1\tdirty=0\tbacking_crc32c={crc}\n")
    );
    assert!(ctl(&["prefetch", "L0/B1/H1/K"]).status.success());
    assert!(names(&m.p(".kvfs/resident")).contains("L0.B1.H1.K"));
    let out = ctl(&["query", "L01/B2/H0/V"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("leading zeros"));
}

#[test]
fn restore_bench_prints_figures_and_baselines() {
    if !can_mount() || !std::path::Path::new("/dev/shm").exists() {
        return;
    }
    let out = kvfs()
        .args([
            "bench",
            "restore",
            "--seconds",
            "0.05",
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
    assert_eq!(
        t.lines()
            .filter(|l| l.contains("T1 hits") || l.contains("misses") || l.contains("into T1"))
            .count(),
        18,
        "{t}"
    );
    assert!(t.contains("memcpy GB/s"), "{t}");
    assert!(
        t.contains("one 1024-group ticket at a time") && t.contains("of memcpy), the fd's ring"),
        "{t}"
    );
    // Its mounts go once every release is answered: no reply sent into
    // an unmounted filesystem, logged as an error to the user.
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!e.contains("ERROR"), "{e}");
}

#[test]
fn a_region_file_shrunk_under_the_daemon_fails_cleanly() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(BIG);
    let c = Client::open(&m.mp).unwrap();
    let reg = ShmRegion::new(64 * GB as u64);
    let r = c.register_host_region(&reg.path(), reg.len).unwrap();
    for i in 0..64 {
        fs::write(m.p(&path(&key(i))), pattern(i, GB)).unwrap();
    }
    // The client truncates its own region file: the daemon's copies into
    // the lost pages must not kill it.
    reg.file.as_file().set_len(0).unwrap();
    let t = c
        .restore(
            &(0..64)
                .map(|i| (key(i), r, i * GB as u64))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let (e, entry, msg) = errno(c.wait(t, None));
    assert_eq!((e, entry), (libc::EFAULT, Some(0)), "{msg}");
    assert!(msg.contains("shrank"), "{msg}");
    let t = c.store(&[(key(100), r, 0)]);
    assert_eq!(errno(t).0, libc::EFAULT);
    assert_eq!(c.query(&[key(100)]).unwrap()[0].state, wire::STATE_EMPTY);
    // The daemon and this session still serve.
    c.unregister(r).unwrap();
    let good = ShmRegion::new(GB as u64);
    let r = c.register_host_region(&good.path(), good.len).unwrap();
    let t = c.restore(&[(key(5), r, 0)]).unwrap();
    c.wait(t, None).unwrap();
    assert_eq!(good.read(0, GB), pattern(5, GB));
}

#[test]
fn cuda_regions_without_a_driver_are_enodev() {
    if !can_mount() {
        return;
    }
    if kvfs::gpu::cuda::cuda().is_some() {
        eprintln!("skipped: this machine has a CUDA driver (tools/gpu_e2e.py covers it)");
        return;
    }
    let m = Mount::new(&[]);
    let c = Client::open(&m.mp).unwrap();
    let (e, _, msg) = errno(c.register_cuda_region(&[7u8; 64], 4096, 0, 0));
    assert_eq!(e, libc::ENODEV, "{msg}");
    assert!(msg.contains("no CUDA driver was found"), "{msg}");
    // A malformed CUDA REGISTER is still just refused, and the fd serves on.
    let bad = wire::encode_request(&Request::Register {
        path: vec![1; 10],
        len: 10,
        flags: wire::REGISTER_CUDA,
    });
    let rep = c.call_bytes(&bad).unwrap();
    assert_eq!(rep.status as i32, libc::ENODEV);
    assert_eq!(c.hello().unwrap().0, 1);
}

#[test]
fn an_idle_fd_is_not_readable_and_nonblocking_reads_say_eagain() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    use std::os::unix::fs::OpenOptionsExt;
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(m.p(".kvfs/control"))
        .unwrap();
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: f.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd we own.
    let ready = unsafe { libc::poll(&mut pfd, 1, 50) };
    assert_eq!(ready, 0, "nothing is waiting, yet poll said readable");
    let mut buf = [0u8; 64];
    let e = std::io::Read::read(&mut &f, &mut buf).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EAGAIN));
    // A request makes it readable.
    std::io::Write::write_all(&mut &f, &wire::encode_request(&Request::Hello)).unwrap();
    // SAFETY: as above.
    let ready = unsafe { libc::poll(&mut pfd, 1, 5000) };
    assert_eq!(ready, 1);
    let n = std::io::Read::read(&mut &f, &mut buf).unwrap();
    assert!(n >= wire::HEADER_BYTES, "{n}");
    assert_eq!(&buf[..4], b"KVFR");
}

/// Reads replies from `f` until `n` have arrived; returns them in order.
fn read_replies(f: &fs::File, n: usize) -> Vec<wire::Reply> {
    let mut buf = Vec::new();
    let mut out = Vec::new();
    while out.len() < n {
        let mut chunk = [0u8; 4096];
        let got = std::io::Read::read(&mut &*f, &mut chunk).unwrap();
        buf.extend_from_slice(&chunk[..got]);
        while let Ok((r, used)) = wire::Reply::decode(&buf) {
            buf.drain(..used);
            out.push(r);
        }
    }
    out
}

#[test]
fn requests_split_across_writes_or_packed_in_one_are_all_served() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.p(".kvfs/control"))
        .unwrap();
    let keys: Vec<wire::RawKey> = (0..3)
        .map(|b| wire::RawKey {
            layer: 0,
            block: b,
            head: 0,
            kind: 0,
        })
        .collect();
    let query = wire::encode_request(&Request::Query(keys));
    let hello = wire::encode_request(&Request::Hello);
    // One byte per write: the daemon assembles the request.
    for b in &query {
        std::io::Write::write_all(&mut &f, std::slice::from_ref(b)).unwrap();
    }
    let r = read_replies(&f, 1);
    assert_eq!((r[0].status, r[0].states.len()), (0, 3), "{}", r[0].message);
    // Three requests in one write, the last split mid-header into the next
    // write, which also carries a whole request after it.
    let mut all = [hello.clone(), query.clone(), query.clone(), hello.clone()].concat();
    let cut = hello.len() + 2 * query.len() + 10;
    let tail = all.split_off(cut);
    std::io::Write::write_all(&mut &f, &all).unwrap();
    std::io::Write::write_all(&mut &f, &tail).unwrap();
    let r = read_replies(&f, 4);
    let cmds: Vec<u16> = r.iter().map(|r| r.command).collect();
    let q = wire::Command::Query as u16;
    let h = wire::Command::Hello as u16;
    assert_eq!(cmds, vec![h, q, q, h]);
    assert!(r.iter().all(|r| r.status == 0));
    assert_eq!(r[1].states.len(), 3);
    // A bad header after a good request: the good one is served, the rest
    // of that write is refused as one error, and the fd serves again.
    let bad = [
        hello.clone(),
        b"GARBAGE-GARBAGE-GARBAGE-GARBAGE-!".to_vec(),
        hello.clone(),
    ]
    .concat();
    std::io::Write::write_all(&mut &f, &bad).unwrap();
    let r = read_replies(&f, 2);
    assert_eq!(r[0].status, 0);
    assert_eq!(r[1].status as i32, libc::EINVAL, "{}", r[1].message);
    std::io::Write::write_all(&mut &f, &query).unwrap();
    let r = read_replies(&f, 1);
    assert_eq!((r[0].status, r[0].states.len()), (0, 3));
}

#[test]
fn entries_named_in_a_region_and_their_refusals() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(BIG);
    let c = Client::open(&m.mp).unwrap();
    let n = 600u64; // 19 KiB of entries: more than one ioctl could carry
    let data = ShmRegion::new(n * GB as u64);
    for i in 0..n {
        data.write(i * GB as u64, &pattern(900 + i, GB));
    }
    let rd = c.register_host_region(&data.path(), data.len).unwrap();
    let list = ShmRegion::new(64 + n * wire::IO_ENTRY_BYTES as u64);
    let rl = c.register_host_region(&list.path(), list.len).unwrap();
    let entries = |dst: u64| -> Vec<wire::IoEntry> {
        (0..n)
            .map(|i| {
                let k = key(i * 3);
                wire::IoEntry::new(
                    wire::RawKey {
                        layer: k.layer,
                        block: k.block,
                        head: k.head,
                        kind: k.kind as u32,
                    },
                    dst as u32,
                    i * GB as u64,
                )
            })
            .collect()
    };
    let mut bytes = Vec::new();
    wire::encode_io_entries(&mut bytes, &entries(rd as u64));
    list.write(64, &bytes);
    let at = wire::EntriesAt {
        region: rl,
        offset: 64,
        count: n as u32,
        strided: false,
    };
    let req = wire::encode_request(&Request::StoreFrom(at));
    assert_eq!(req.len(), wire::HEADER_BYTES);
    let rep = c.ioctl_bytes(&req, 1024).unwrap();
    assert_eq!(rep.status, 0, "{}", rep.message);
    c.wait(rep.value, None).unwrap();
    for i in (0..n).step_by(37) {
        assert_eq!(
            fs::read(m.p(&path(&key(i * 3)))).unwrap(),
            pattern(900 + i, GB)
        );
    }
    // Restore them into a fresh region through the same entry list,
    // rewritten to name it.
    let back = ShmRegion::new(n * GB as u64);
    let rb = c.register_host_region(&back.path(), back.len).unwrap();
    bytes.clear();
    wire::encode_io_entries(&mut bytes, &entries(rb as u64));
    list.write(64, &bytes);
    let rep = c
        .ioctl_bytes(&wire::encode_request(&Request::RestoreFrom(at)), 1024)
        .unwrap();
    assert_eq!(rep.status, 0, "{}", rep.message);
    c.wait(rep.value, None).unwrap();
    assert_eq!(
        back.read(0, (n * GB as u64) as usize),
        data.read(0, (n * GB as u64) as usize)
    );
    // Refusals: an unknown region, entries past the end, unknown flags, a
    // bad entry inside the list (named by its index).
    let refuse = |req: Vec<u8>| c.ioctl_bytes(&req, 1024).unwrap();
    let r = refuse(wire::encode_request(&Request::RestoreFrom(
        wire::EntriesAt { region: 999, ..at },
    )));
    assert_eq!(r.status as i32, libc::EBADF, "{}", r.message);
    let r = refuse(wire::encode_request(&Request::RestoreFrom(
        wire::EntriesAt { offset: 65, ..at },
    )));
    assert_eq!(r.status as i32, libc::EFAULT, "{}", r.message);
    let r = refuse(wire::encode_request(&Request::RestoreFrom(
        wire::EntriesAt {
            offset: u64::MAX - 8,
            ..at
        },
    )));
    assert_eq!(r.status as i32, libc::EFAULT, "{}", r.message);
    let mut flags = wire::encode_request(&Request::RestoreFrom(at));
    flags[16] |= 4;
    let r = refuse(flags);
    assert!(
        r.status as i32 == libc::EINVAL && r.message.contains("flags"),
        "{}",
        r.message
    );
    let mut bad = entries(rb as u64);
    bad[333].key.layer = 99;
    bytes.clear();
    wire::encode_io_entries(&mut bytes, &bad);
    list.write(64, &bytes);
    let r = refuse(wire::encode_request(&Request::RestoreFrom(at)));
    assert_eq!(
        (r.status as i32, r.entry),
        (libc::ERANGE, 333),
        "{}",
        r.message
    );
    // And the fd still serves.
    assert_eq!(c.hello().unwrap().0, 1);
}

/// Done words (RESTORE arg0 bits 16–31) are for restores into CUDA
/// regions of a fd that registered them: a RESTORE into a host region
/// naming one is refused and loses nothing, a STORE cannot name one, and
/// REGISTER refuses done words that are not a CUDA allocation. (The GPU
/// side, the word written after the copy, is checked by tools/gpu_e2e.py.)
#[test]
fn done_words_are_refused_where_they_cannot_be_written() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(BIG);
    let c = Client::open(&m.mp).unwrap();
    let data = ShmRegion::new(4 * GB as u64);
    data.write(0, &pattern(5, GB));
    let rd = c.register_host_region(&data.path(), data.len).unwrap();
    let k = key(1);
    let entry = wire::IoEntry::new(
        wire::RawKey {
            layer: k.layer,
            block: k.block,
            head: k.head,
            kind: k.kind as u32,
        },
        rd,
        0,
    );
    let t = c.store(&[(k, rd, 0)]).unwrap();
    c.wait(t, None).unwrap();
    let with_done = |r: Request| {
        let mut b = wire::encode_request(&r);
        b[16..24].copy_from_slice(&(1u64 << wire::DONE_WORD_SHIFT).to_le_bytes());
        c.ioctl_bytes(&b, 1024).unwrap()
    };
    let r = with_done(Request::Restore(vec![entry]));
    assert!(
        r.status as i32 == libc::EINVAL && r.message.contains("done word"),
        "{}",
        r.message
    );
    let r = with_done(Request::Store(vec![entry]));
    assert!(
        r.status as i32 == libc::EINVAL && r.message.contains("done word"),
        "{}",
        r.message
    );
    let register = |path: Vec<u8>, flags: u64| {
        let req = wire::encode_request(&Request::Register {
            path,
            len: 64,
            flags,
        });
        c.ioctl_bytes(&req, 1024).unwrap()
    };
    // Flag 2 alone: not a CUDA allocation.
    let path = data.path().as_os_str().as_encoded_bytes().to_vec();
    let r = register(path, wire::REGISTER_DONE_WORDS);
    assert!(
        r.status as i32 == libc::EINVAL && r.message.contains("done words"),
        "{}",
        r.message
    );
    // Flags 3 with no CUDA allocation behind them (no driver here: ENODEV;
    // with one, the handle does not open).
    let payload = vec![0; wire::CUDA_REGISTER_BYTES];
    let r = register(payload, wire::REGISTER_CUDA | wire::REGISTER_DONE_WORDS);
    assert!(
        [libc::ENODEV, libc::EINVAL].contains(&(r.status as i32)),
        "{}: {}",
        r.status,
        r.message
    );
    // Nothing was lost, and a plain restore still works.
    let t = c.restore(&[(k, rd, GB as u64)]).unwrap();
    c.wait(t, None).unwrap();
    assert_eq!(data.read(GB as u64, GB), pattern(5, GB));
}
