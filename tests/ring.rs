//! The submission/completion ring (RING) through a real mount: RESTORE and
//! STORE through shared memory, the same admission as requests, a
//! completion entry per submission, refusals that leave the ring working,
//! back-pressure when nothing is reaped, and setup errors (root and
//! /dev/fuse needed).

mod common;
use common::*;

use kvfs::client::Client;
use kvfs::control::wire::{Command, ENTRIES_IN_REGION};
use kvfs::geometry::{GroupKey, Kind};
use std::path::Path;
use std::time::Duration;

const GB: usize = 2048; // the harness mount's group bytes

fn key(i: u64) -> GroupKey {
    GroupKey::new(
        0,
        i / 4,
        ((i / 2) % 2) as u32,
        if i.is_multiple_of(2) {
            Kind::K
        } else {
            Kind::V
        },
    )
}

#[test]
fn stores_and_restores_through_the_ring() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    let c = Client::open(&m.mp).unwrap();
    let mut ring = c.ring(Path::new("/dev/shm"), 16, 1 << 20).unwrap();
    let r = ring.region();
    let data = ring.data_offset();
    // Groups' bytes at data + 64 KiB (16 groups), entries at the start.
    let payload = data + (64 << 10);
    let want = pattern(9, 16 * GB);
    ring.put_raw((payload - data) as usize, &want);
    let stores: Vec<_> = (0..16)
        .map(|i| (key(i), r, payload + i * GB as u64))
        .collect();
    let at = ring.put_entries(0, &stores);
    assert!(ring.submit(7, Command::Store, 16, at));
    let done = ring.reap(1, 8, Some(Duration::from_secs(10)));
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(
        (done[0].user_data, done[0].status, done[0].failed),
        (7, 0, 0)
    );
    assert!(done[0].ticket > 0);
    for i in 0..16u64 {
        let got = std::fs::read(m.p(&key(i).to_string())).unwrap();
        assert_eq!(got, want[i as usize * GB..][..GB], "group {i}");
    }
    // Restore them in reverse order after the payload, one ticket per
    // group, all in flight at once.
    let back = payload + 16 * GB as u64;
    for i in 0..16u64 {
        let at = ring.put_entries(
            4096 + i as usize * 32,
            &[(key(i), r, back + (15 - i) * GB as u64)],
        );
        assert!(ring.submit(100 + i, Command::Restore, 1, at));
    }
    let mut seen = Vec::new();
    while seen.len() < 16 {
        for c in ring.reap(1, 16, Some(Duration::from_secs(10))) {
            assert_eq!(c.status, 0, "{c:?}");
            seen.push(c.user_data);
        }
    }
    seen.sort();
    assert_eq!(seen, (100..116).collect::<Vec<_>>());
    let got = ring.read_raw(back as usize, 16 * GB);
    for i in 0..16 {
        assert_eq!(
            got[(15 - i) * GB..][..GB],
            want[i * GB..][..GB],
            "restored group {i}"
        );
    }
}

#[test]
fn refusals_complete_and_the_ring_keeps_working() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    let c = Client::open(&m.mp).unwrap();
    let mut ring = c.ring(Path::new("/dev/shm"), 4, 1 << 16).unwrap();
    let r = ring.region();
    let at = ring.put_entries(0, &[(key(0), r, ring.data_offset() + 4096)]);
    // A region the fd does not have, a command the ring does not take, no
    // entries-in-region flag, an entry outside the region.
    assert!(ring.submit_raw(
        1,
        Command::Restore as u32,
        1,
        (99u64 << 32) | ENTRIES_IN_REGION,
        at
    ));
    assert!(ring.submit_raw(
        2,
        Command::Query as u32,
        1,
        ((r as u64) << 32) | ENTRIES_IN_REGION,
        at
    ));
    assert!(ring.submit_raw(3, Command::Restore as u32, 1, (r as u64) << 32, at));
    let bad = ring.put_entries(64, &[(key(0), r, u64::MAX - 8)]);
    assert!(ring.submit(4, Command::Restore, 1, bad));
    let mut got = Vec::new();
    while got.len() < 4 {
        got.extend(ring.reap(1, 4, Some(Duration::from_secs(10))));
    }
    got.sort_by_key(|c| c.user_data);
    let errs: Vec<(u64, i32, u64)> = got
        .iter()
        .map(|c| (c.user_data, c.status, c.ticket))
        .collect();
    assert_eq!(
        errs,
        vec![
            (1, libc::EBADF, 0),
            (2, libc::EINVAL, 0),
            (3, libc::EINVAL, 0),
            (4, libc::EFAULT, 0)
        ]
    );
    // Still serving: a good store and restore.
    assert!(ring.submit(5, Command::Store, 1, at));
    let ok = ring.reap(1, 1, Some(Duration::from_secs(10)));
    assert_eq!((ok[0].user_data, ok[0].status), (5, 0));
}

#[test]
fn a_ring_that_is_not_reaped_stops_taking_and_resumes() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    let c = Client::open(&m.mp).unwrap();
    let mut ring = c.ring(Path::new("/dev/shm"), 4, 1 << 16).unwrap();
    let r = ring.region();
    let at = ring.put_entries(0, &[(key(1), r, ring.data_offset() + 4096)]);
    let mut submitted = 0;
    for i in 0..12 {
        if ring.submit(i, Command::Store, 1, at) {
            submitted += 1;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // 4 taken and completed (not reaped), 4 more waiting in the SQ: the
    // rest refused by the client side for want of room.
    assert_eq!(submitted, 8);
    let mut got = Vec::new();
    while got.len() < 8 {
        got.extend(ring.reap(1, 8, Some(Duration::from_secs(10))));
    }
    let mut ids: Vec<u64> = got.iter().map(|c| c.user_data).collect();
    ids.sort();
    assert_eq!(ids.len(), 8);
    assert!(got.iter().all(|c| c.status == 0), "{got:?}");
}

#[test]
fn ring_setup_errors() {
    if !can_mount() {
        return;
    }
    let m = Mount::new(&[]);
    let c = Client::open(&m.mp).unwrap();
    let e = c.ring(Path::new("/dev/shm"), 6, 0).err().unwrap();
    assert_eq!(e.errno(), Some(libc::EINVAL), "{e}");
    assert!(e.to_string().contains("power of two"), "{e}");
    let _ring = c.ring(Path::new("/dev/shm"), 8, 0).unwrap();
    let e = c.ring(Path::new("/dev/shm"), 8, 0).err().unwrap();
    assert_eq!(e.errno(), Some(libc::EBUSY), "{e}");
    // A region too small for the ring it names.
    let c2 = Client::open(&m.mp).unwrap();
    let small = ShmRegion::new(4096);
    let r = c2.register_host_region(&small.path(), 4096).unwrap();
    let e = c2
        .call_bytes(&kvfs::control::wire::encode_request(
            &kvfs::control::wire::Request::Ring {
                region: r,
                offset: 0,
                entries: 64,
            },
        ))
        .unwrap();
    assert_eq!(e.status as i32, libc::EFAULT, "{}", e.message);
    // The fd closes with the ring set up: the daemon serves on.
    drop(c);
    assert!(std::fs::metadata(m.p("L0/B0/H0/K")).is_ok());
}
