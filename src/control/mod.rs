//! The control file: per-fd sessions, registered regions, async tickets.
//!
//! An engine moves many groups through `.kvfs/control` without a FUSE
//! round trip each. The rooms, in the order a request travels:
//! - `wire`: the versioned little-endian request/reply format;
//! - `session`: one per open fd: its byte streams, tickets, waiting, and
//!   the dispatch of each request;
//! - `region`: client memory (host files, CUDA allocations) it registers;
//! - `admit`: all-or-nothing checks that turn entries into a `Batch`;
//! - `host` and `gpu`: the jobs that move a batch (host regions, CUDA
//!   regions through the GPU transfer engine), QUERY and PREFETCH;
//! - `exec`: the executor threads that run jobs and the WAIT timer.
//!
//! Every request is checked whole before any work starts. Jobs hold their
//! regions and session by reference, so closing the fd or UNREGISTER never
//! frees memory a job still copies into. This layer knows nothing of FUSE;
//! `fs` adapts it.

mod admit;
mod descs;
mod done;
mod exec;
mod gpu;
mod gpu_store;
mod guard;
mod host;
mod region;
pub mod ring;
mod session;
pub mod wire;

pub use region::Region;
pub use session::Session;

use crate::cascade::Cascade;
use crate::geometry::GroupIndex;
use crate::stats::{Exposition, Histogram};
use exec::{Executor, GATED_EXECUTORS, MIN_EXECUTORS, Timer};
use parking_lot::Mutex;
use session::SessionState;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

#[derive(Debug)]
pub struct Rejection {
    pub errno: i32,
    pub entry: u32,
    pub message: String,
}

fn overlap(a: usize, b: usize, region: u32) -> Rejection {
    reject(
        libc::EINVAL,
        b as u32,
        format!("entries {a} and {b} restore into overlapping bytes of region {region}"),
    )
}

fn reject(errno: i32, entry: u32, message: impl Into<String>) -> Rejection {
    Rejection {
        errno,
        entry,
        message: message.into(),
    }
}

#[derive(Default)]
struct ControlStats {
    requests: [AtomicU64; 11],
    rejected: [AtomicU64; 11],
    restore_latency: Histogram,
    store_latency: Histogram,
    restored_bytes: AtomicU64,
    stored_bytes: AtomicU64,
    failed_entries: AtomicU64,
    sessions: AtomicU64,
}

/// Called with each group a STORE changed (the filesystem drops the
/// kernel's cached pages of it).
pub type ChangeHook = Box<dyn Fn(GroupIndex) + Send + Sync>;

/// The shared state of the control file: cascade, executor, metrics.
pub struct Control {
    cascade: Arc<Cascade>,
    exec: Arc<Executor>,
    /// Jobs that open a GPU restore's gate (see `Control::gated`).
    gated: OnceLock<Arc<Executor>>,
    timer: Arc<Timer>,
    stats: ControlStats,
    on_change: OnceLock<ChangeHook>,
    /// The GPU transfer engines, one a device (none without a driver).
    gpu: crate::gpu::engine::Engines,
}

impl Control {
    pub fn new(cascade: Arc<Cascade>) -> Arc<Control> {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(MIN_EXECUTORS)
            .max(MIN_EXECUTORS);
        Arc::new(Control {
            cascade,
            exec: Executor::start(threads, "kvfs-exec"),
            gated: OnceLock::new(),
            timer: Timer::start(),
            stats: ControlStats::default(),
            on_change: OnceLock::new(),
            gpu: Default::default(),
        })
    }

    /// The executor of GPU restores whose copy is enqueued on admission
    /// behind a ready flag (groups not all in T1). The device may hold
    /// other streams' copies behind that flag (streams share the GPU's few
    /// hardware queues), so these jobs run on threads of their own that
    /// never wait for a GPU copy: a busy general executor (its threads
    /// waiting on STORE kernels) cannot keep a gate shut. Started on first
    /// use.
    fn gated(&self) -> &Arc<Executor> {
        self.gated
            .get_or_init(|| Executor::start(GATED_EXECUTORS, "kvfs-gate"))
    }

    pub fn cascade(&self) -> &Arc<Cascade> {
        &self.cascade
    }

    /// The mount's shape (HELLO, `.kvfs/layout`).
    pub fn layout(&self) -> wire::MountLayout {
        let c = &self.cascade;
        let mut m = wire::MountLayout::new(
            c.layout(),
            c.t1_slots(),
            c.tier_name(),
            c.policy_name(),
            c.slot_device_ptr(crate::cascade::SlotId(0)).is_some(),
        );
        m.remote = c.tier_remote();
        m
    }

    /// Sets the hook told of groups changed through the control file.
    pub fn set_change_hook(&self, hook: ChangeHook) {
        let _ = self.on_change.set(hook);
    }

    /// Opens a session for a client with these credentials.
    /// `may_write`: whether the client may change groups (STORE); the
    /// filesystem grants it to the mount's owner and root.
    pub fn open_session(self: &Arc<Control>, uid: u32, gid: u32, may_write: bool) -> Arc<Session> {
        self.stats.sessions.fetch_add(1, Ordering::Relaxed);
        Arc::new(Session {
            ctl: self.clone(),
            uid,
            gid,
            may_write,
            st: Mutex::new(SessionState::default()),
            lanes: Mutex::new(Vec::new()),
        })
    }

    /// Appends the control metrics to a Prometheus exposition.
    pub fn render_stats(&self, e: &mut Exposition) {
        use wire::Command::*;
        let cmds = [
            Hello, Register, Unregister, Restore, Store, Query, Prefetch, Wait, Ring,
        ];
        for (name, help, counts) in [
            (
                "kvfs_control_requests_total",
                "Control requests admitted, by command.",
                &self.stats.requests,
            ),
            (
                "kvfs_control_rejected_total",
                "Control requests rejected, by command.",
                &self.stats.rejected,
            ),
        ] {
            e.header(name, "counter", help);
            for c in cmds {
                e.sample(
                    name,
                    &format!("command=\"{}\"", c.name()),
                    counts[c as usize].load(Ordering::Relaxed),
                );
            }
        }
        e.single(
            "kvfs_control_failed_entries_total",
            "counter",
            "Entries of admitted tickets that failed.",
            self.stats.failed_entries.load(Ordering::Relaxed),
        );
        e.header(
            "kvfs_control_bytes_total",
            "counter",
            "Group bytes moved through the control file.",
        );
        e.sample(
            "kvfs_control_bytes_total",
            "op=\"restore\"",
            self.stats.restored_bytes.load(Ordering::Relaxed),
        );
        e.sample(
            "kvfs_control_bytes_total",
            "op=\"store\"",
            self.stats.stored_bytes.load(Ordering::Relaxed),
        );
        e.single(
            "kvfs_control_sessions_total",
            "counter",
            "Control file opens.",
            self.stats.sessions.load(Ordering::Relaxed),
        );
        use crate::gpu::cuda::{DEVICE_BYTES, IPC_MAPPINGS, PINNED_BYTES};
        for (name, help, v) in [
            (
                "kvfs_gpu_pinned_bytes",
                "Pinned host memory held (T1, GPU staging and descriptor tables).",
                &PINNED_BYTES,
            ),
            (
                "kvfs_gpu_device_bytes",
                "Device memory the daemon allocated (0 today: the gather kernel reads its descriptors from the pinned tables).",
                &DEVICE_BYTES,
            ),
            (
                "kvfs_gpu_ipc_mappings",
                "Clients' CUDA regions mapped (IPC handles open).",
                &IPC_MAPPINGS,
            ),
        ] {
            e.single(name, "gauge", help, v.load(Ordering::Relaxed));
        }
        e.histogram(
            "kvfs_control_ticket_latency_seconds",
            "Time from admission to completion of a ticket.",
            &[
                ("op=\"restore\"", &self.stats.restore_latency),
                ("op=\"store\"", &self.stats.store_latency),
            ],
        );
    }
}
