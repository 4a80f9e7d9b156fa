use super::{ALL_PARTS, POOL_KEEP, Pool, best_fit, passes};
use crate::gpu::host::HostBuf;

#[test]
fn the_flag_set_lets_every_part_through() {
    // Parts wait for 1, 2, 3, …: let_through(k) passes the first k,
    // set passes all (and a cleared table's 0 passes none).
    for v in 1..=64 {
        assert!(passes(ALL_PARTS, v), "set holds part {v}");
        assert!(!passes(0, v));
        for k in 1..=64 {
            assert_eq!(passes(k, v), k >= v);
        }
    }
    // The cyclic comparison: the value set wrote before held them all.
    assert!(!passes(u32::MAX, 1));
}

fn bufs(lens: &[usize]) -> Vec<HostBuf> {
    lens.iter()
        .map(|&l| HostBuf::alloc_plain(l).unwrap())
        .collect()
}

#[test]
fn the_pool_takes_the_smallest_buffer_that_fits() {
    let b = bufs(&[1 << 20, 4096, 64 << 10, 16 << 20]);
    assert_eq!(best_fit(&b, 4096), Some(1));
    assert_eq!(best_fit(&b, 5000), Some(2));
    assert_eq!(best_fit(&b, 2 << 20), Some(3));
    assert_eq!(best_fit(&b, 32 << 20), None);
}

#[test]
fn a_full_pool_keeps_its_largest_buffers() {
    let pool = Pool::default();
    for b in bufs(&[4096; POOL_KEEP]) {
        pool.give_host(&pool.staging, b);
    }
    // A big one in: a small one goes.
    pool.give_host(&pool.staging, HostBuf::alloc_plain(16 << 20).unwrap());
    let lens = |p: &Pool| -> Vec<usize> { p.staging.lock().iter().map(HostBuf::len).collect() };
    assert_eq!(lens(&pool).len(), POOL_KEEP);
    assert!(lens(&pool).contains(&(16 << 20)));
    // A small one in: it goes itself, the big one stays.
    pool.give_host(&pool.staging, HostBuf::alloc_plain(4096).unwrap());
    assert_eq!(lens(&pool).len(), POOL_KEEP);
    assert_eq!(lens(&pool).iter().filter(|&&l| l == 16 << 20).count(), 1);
    // And a ticket of 16 MiB finds it.
    assert!(pool.take_staging(16 << 20).unwrap().len() >= 16 << 20);
    assert_eq!(lens(&pool).iter().filter(|&&l| l == 16 << 20).count(), 0);
}
