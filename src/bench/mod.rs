//! Benchmarks: each prints its figure next to a baseline measured in the
//! same run on the same machine, never against a remembered number.
//!
//! `backing`: random group reads through a backing tier vs fio on the same
//! file, same block size, same queue depth.

pub mod backing;
pub mod crash;
pub mod fuse;
pub mod restore;

/// A cascade for a bench: a fresh uring-backed store in `dir` with
/// room in T1 for `t1_groups` groups.
pub fn scratch_cascade(
    dir: &std::path::Path,
    layout: crate::geometry::GroupLayout,
    t1_groups: u64,
) -> anyhow::Result<std::sync::Arc<crate::cascade::Cascade>> {
    use crate::cascade::{BackingConfig, Cascade, CascadeConfig};
    Ok(std::sync::Arc::new(Cascade::open(
        &BackingConfig {
            dir: dir.join("backing"),
            layout: Some(layout),
            tier: crate::tier::TierKind::Uring,
            queue_depth: crate::tier::DEFAULT_QUEUE_DEPTH,
        },
        CascadeConfig {
            t1_bytes: t1_groups * layout.stride(),
            ..CascadeConfig::default()
        },
    )?))
}

/// splitmix64: a fast, seedable generator for random offsets; benches need
/// speed and repeatability, not cryptographic quality.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        // splitmix64: every output bit depends on every state bit.
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
