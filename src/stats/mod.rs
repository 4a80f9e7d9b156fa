//! Metrics: names in one place, rendered as Prometheus text exposition.
//!
//! Counters come from the layers that own them (the cascade's
//! `CascadeStats`, the filesystem's request latencies); this module only
//! names and renders them, so a metric's name is written once.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub const HITS: &str = "kvfs_hits_total";
pub const MISSES: &str = "kvfs_misses_total";
pub const READ_BYTES: &str = "kvfs_read_bytes_total";
pub const WRITE_BYTES: &str = "kvfs_write_bytes_total";
pub const EMPTY_READS: &str = "kvfs_empty_reads_total";
pub const EVICTIONS: &str = "kvfs_evictions_total";
pub const FLUSHES: &str = "kvfs_flushes_total";
pub const FLUSHED_BYTES: &str = "kvfs_flushed_bytes_total";
pub const CHECKSUM_FAILURES: &str = "kvfs_checksum_failures_total";
pub const RECOVERED_READS: &str = "kvfs_recovered_reads_total";
pub const WRITE_BACK_FAILURES: &str = "kvfs_write_back_failures_total";
pub const T1_SLOTS_USED: &str = "kvfs_t1_slots_used";
pub const T1_SLOTS_TOTAL: &str = "kvfs_t1_slots_total";
pub const T1_SLOTS_READY: &str = "kvfs_t1_slots_ready";
pub const DIRTY_BYTES: &str = "kvfs_dirty_bytes";
pub const DIRTY_GROUPS: &str = "kvfs_dirty_groups";
pub const OP_LATENCY: &str = "kvfs_op_latency_seconds";
pub const REMOTE_NODES: &str = "kvfs_remote_nodes";
pub const REMOTE_ERRORS: &str = "kvfs_remote_errors_total";
pub const REMOTE_TIMEOUTS: &str = "kvfs_remote_timeouts_total";
pub const REMOTE_LOST: &str = "kvfs_remote_lost_total";
pub const REMOTE_CORRUPT: &str = "kvfs_remote_corrupt_total";
pub const REMOTE_OOM: &str = "kvfs_remote_oom_total";
pub const REMOTE_ROUND_TRIP: &str = "kvfs_remote_round_trip_seconds";

/// Upper bounds of latency buckets, in microseconds: 1 µs to 1 s, ×~3.
const BUCKETS_US: [u64; 13] = [
    1, 3, 10, 30, 100, 300, 1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000,
];

/// A lock-free latency histogram.
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS_US.len() + 1],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: Default::default(),
            sum_ns: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let us = d.as_micros() as u64;
        let i = BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(BUCKETS_US.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Appends this histogram as `name{labels,le=...}` lines.
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cum = 0;
        for (i, b) in BUCKETS_US.iter().enumerate() {
            cum += self.buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{}\"}} {cum}",
                *b as f64 / 1e6
            );
        }
        cum += self.buckets[BUCKETS_US.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cum}");
        let _ = writeln!(
            out,
            "{name}_sum{{{labels}}} {}",
            self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9
        );
        let _ = writeln!(
            out,
            "{name}_count{{{labels}}} {}",
            self.count.load(Ordering::Relaxed)
        );
    }
}

/// Builds a Prometheus text exposition document.
#[derive(Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    pub fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    pub fn sample(&mut self, name: &str, labels: &str, value: u64) {
        if labels.is_empty() {
            let _ = writeln!(self.out, "{name} {value}");
        } else {
            let _ = writeln!(self.out, "{name}{{{labels}}} {value}");
        }
    }

    /// A metric with a single unlabelled sample.
    pub fn single(&mut self, name: &str, kind: &str, help: &str, value: u64) {
        self.header(name, kind, help);
        self.sample(name, "", value);
    }

    pub fn histogram(&mut self, name: &str, help: &str, series: &[(&str, &Histogram)]) {
        self.header(name, "histogram", help);
        for (labels, h) in series {
            h.render(&mut self.out, name, labels);
        }
    }

    pub fn finish(self) -> String {
        self.out
    }
}

/// Parses one sample line's value out of an exposition (for `kvfs stat`
/// and tests): `name{labels} value` with the exact name and label text.
pub fn find_sample(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (k, v) = l.rsplit_once(' ')?;
        (k == name_and_labels).then(|| v.parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_and_finds() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(5));
        h.observe(Duration::from_millis(2));
        let mut e = Exposition::default();
        e.single(HITS, "counter", "hits", 7);
        e.histogram(OP_LATENCY, "latency", &[("op=\"read\"", &h)]);
        let t = e.finish();
        assert_eq!(find_sample(&t, HITS), Some(7.0));
        assert_eq!(
            find_sample(&t, "kvfs_op_latency_seconds_count{op=\"read\"}"),
            Some(2.0)
        );
        assert_eq!(
            find_sample(
                &t,
                "kvfs_op_latency_seconds_bucket{op=\"read\",le=\"0.00001\"}"
            ),
            Some(1.0)
        );
        assert_eq!(
            find_sample(
                &t,
                "kvfs_op_latency_seconds_bucket{op=\"read\",le=\"+Inf\"}"
            ),
            Some(2.0)
        );
    }
}
