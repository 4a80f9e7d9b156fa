//! The control file: per-fd sessions, registered regions, async tickets.
//!
//! A `Session` is one open file descriptor of `.kvfs/control`. It owns the
//! regions registered on it (nobody else can name them), its tickets, and
//! the output the fd reads: replies to requests written to it, in request
//! order, then completion records of finished tickets. Every request is
//! checked whole before any work starts (all-or-nothing admission): keys in
//! the geometry, regions registered on this session, `offset + group_bytes`
//! inside the region, no two RESTORE destinations overlapping. Admitted
//! RESTORE/STORE/PREFETCH batches become one job each on the executor's
//! threads; jobs hold their regions and session by reference, so closing
//! the fd or UNREGISTER never frees memory a job still copies into. Waiting
//! (a blocking read, an ioctl WAIT, poll) never holds a thread: callers
//! park a callback that runs when output is ready. This layer knows nothing
//! of FUSE; `fs` adapts it.

mod guard;
pub mod wire;

use crate::cascade::{Cascade, CascadeError, Residence};
use crate::geometry::GroupIndex;
use crate::stats::{Exposition, Histogram};
use parking_lot::{Condvar, Mutex};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};
use wire::{Command, IoEntry, NO_ENTRY, RawKey, Reply, Request, StateEntry};

/// A region registered by a client: a shared mapping of its file, or a
/// CUDA allocation of another process opened through its IPC handle.
pub struct Region {
    len: u64,
    /// The host file, or `cuda:DEVICE` for a CUDA region.
    pub path: std::path::PathBuf,
    mem: Memory,
}

enum Memory {
    Host {
        ptr: *mut u8,
        /// Dropped before the mapping (field order): no stale table entry.
        guard: guard::Guard,
        _map: memmap2::MmapMut,
    },
    Cuda {
        /// The region's first byte on the device.
        dptr: u64,
        /// What cuIpcOpenMemHandle returned (closed on drop).
        ipc_base: u64,
    },
}

// SAFETY: host regions are shared memory that lives as long as the Region;
// the executor reaches them only through bounds-checked, non-overlapping
// ranges of one request (see `admit_io`). CUDA regions are device
// addresses, touched only by the copy engine and kernels.
unsafe impl Send for Region {}
// SAFETY: as for Send.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        if let Memory::Cuda { ipc_base, .. } = self.mem
            && let Some(c) = crate::gpu::cuda::cuda()
        {
            c.close_ipc_mem(ipc_base);
        }
    }
}

impl Region {
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self.mem, Memory::Cuda { .. })
    }

    /// The device address of byte `offset` of a CUDA region.
    fn device_addr(&self, offset: u64) -> Option<u64> {
        match self.mem {
            Memory::Cuda { dptr, .. } => Some(dptr + offset),
            Memory::Host { .. } => None,
        }
    }

    /// The client shrank the region's file under a copy (see `guard`).
    pub fn damaged(&self) -> bool {
        match &self.mem {
            Memory::Host { guard, .. } => guard.damaged(),
            Memory::Cuda { .. } => false,
        }
    }

    fn host_ptr(&self) -> *mut u8 {
        match self.mem {
            Memory::Host { ptr, .. } => ptr,
            Memory::Cuda { .. } => unreachable!("host copies only reach host regions (admission)"),
        }
    }

    /// # Safety
    /// A host region; `offset + len <= self.len()` and no other live slice
    /// covers the range.
    #[expect(clippy::mut_from_ref, reason = "ranges are made disjoint by admission")]
    unsafe fn range_mut(&self, offset: u64, len: usize) -> &mut [u8] {
        // SAFETY: in bounds by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.host_ptr().add(offset as usize), len) }
    }

    /// # Safety
    /// A host region; `offset + len <= self.len()`.
    unsafe fn range(&self, offset: u64, len: usize) -> &[u8] {
        // SAFETY: in bounds by the caller's contract.
        unsafe { std::slice::from_raw_parts(self.host_ptr().add(offset as usize), len) }
    }
}

/// Fails the entries whose region's file shrank under the copy.
/// An admitted RESTORE or STORE: each item names its region by position
/// in `regions` (one reference per region, not per entry).
struct Batch {
    regions: Vec<Arc<Region>>,
    items: Vec<Item>,
}

#[derive(Clone, Copy)]
struct Item {
    g: GroupIndex,
    region: u32,
    offset: u64,
}

impl Batch {
    fn region(&self, it: &Item) -> &Region {
        &self.regions[it.region as usize]
    }

    fn len(&self) -> usize {
        self.items.len()
    }

    fn is_cuda(&self) -> bool {
        self.regions.first().is_some_and(|r| r.is_cuda())
    }

    /// Entries whose region's file shrank under the copy fail with EFAULT.
    fn mark_damaged(
        &self,
        results: Vec<Result<(), CascadeError>>,
    ) -> Vec<Result<(), CascadeError>> {
        results
            .into_iter()
            .zip(&self.items)
            .map(|(r, it)| {
                let region = self.region(it);
                if region.damaged() {
                    Err(CascadeError::RegionFault(region.path.display().to_string()))
                } else {
                    r
                }
            })
            .collect()
    }
}

/// A request's rejection: errno, the offending entry, and why.
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

/// Executor threads: enough to overlap backing reads with copies on a
/// small machine; a batch is one job, so more threads than cores buys little.
const MIN_EXECUTORS: usize = 2;

type Job = Box<dyn FnOnce() + Send>;

struct Executor {
    queue: Mutex<VecDeque<Job>>,
    ready: Condvar,
}

impl Executor {
    fn start(threads: usize) -> Arc<Executor> {
        let e = Arc::new(Executor {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
        });
        for i in 0..threads {
            let e = e.clone();
            std::thread::Builder::new()
                .name(format!("kvfs-exec-{i}"))
                .spawn(move || {
                    loop {
                        let job = {
                            let mut q = e.queue.lock();
                            loop {
                                if let Some(j) = q.pop_front() {
                                    break j;
                                }
                                e.ready.wait(&mut q);
                            }
                        };
                        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                            tracing::error!("an executor job panicked; its ticket fails with EIO");
                        }
                    }
                })
                .expect("cannot start executor thread");
        }
        e
    }

    fn submit(&self, job: Job) {
        self.queue.lock().push_back(job);
        self.ready.notify_one();
    }

    /// Runs `job` for `ticket`; if it panics, the ticket still completes
    /// (with EIO), so no waiter waits forever.
    fn submit_ticket(&self, s: &Arc<Session>, ticket: u64, job: Job) {
        let s = s.clone();
        self.submit(Box::new(move || {
            let guard = Unfinished(Some((s, ticket)));
            job();
            std::mem::forget(guard);
        }));
    }
}

/// Wakes sessions whose WAIT deadlines pass.
struct Timer {
    heap: Mutex<BinaryHeap<std::cmp::Reverse<(Instant, u64, usize)>>>,
    sessions: Mutex<HashMap<usize, Weak<Session>>>,
    ready: Condvar,
}

impl Timer {
    fn start() -> Arc<Timer> {
        let t = Arc::new(Timer {
            heap: Mutex::new(BinaryHeap::new()),
            sessions: Mutex::new(HashMap::new()),
            ready: Condvar::new(),
        });
        let t2 = t.clone();
        std::thread::Builder::new()
            .name("kvfs-timer".into())
            .spawn(move || {
                loop {
                    let due = {
                        let mut h = t2.heap.lock();
                        loop {
                            let now = Instant::now();
                            match h.peek() {
                                Some(std::cmp::Reverse((at, _, _))) if *at <= now => {
                                    break h.pop().expect("peeked").0;
                                }
                                Some(std::cmp::Reverse((at, _, _))) => {
                                    let at = *at;
                                    t2.ready.wait_until(&mut h, at);
                                }
                                None => t2.ready.wait(&mut h),
                            }
                        }
                    };
                    let s = t2.sessions.lock().get(&due.2).and_then(Weak::upgrade);
                    match s {
                        Some(s) => s.pump(),
                        None => {
                            t2.sessions.lock().remove(&due.2);
                        }
                    }
                }
            })
            .expect("cannot start timer thread");
        t
    }

    fn at(&self, when: Instant, session: &Arc<Session>) {
        let key = Arc::as_ptr(session) as usize;
        self.sessions.lock().insert(key, Arc::downgrade(session));
        self.heap.lock().push(std::cmp::Reverse((when, 0, key)));
        self.ready.notify_one();
    }
}

#[derive(Default)]
struct ControlStats {
    requests: [AtomicU64; 10],
    rejected: [AtomicU64; 10],
    restore_latency: Histogram,
    store_latency: Histogram,
    restored_bytes: AtomicU64,
    stored_bytes: AtomicU64,
    failed_entries: AtomicU64,
    sessions: AtomicU64,
}

/// Completes a ticket with an error if its job unwinds before finishing it.
struct Unfinished(Option<(Arc<Session>, u64)>);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some((s, t)) = self.0.take() {
            s.finish(
                t,
                vec![Err(CascadeError::Internal(format!(
                    "ticket {t}'s job failed; see the daemon log"
                )))],
            );
        }
    }
}

/// Sets a GPU ticket's ready flag (a u32 in pinned memory the stream waits
/// on); dropping it sets it too, so no stream ever waits forever.
struct ReadyFlag(*mut u32);
// SAFETY: the flag lives in the ticket's table, which the job owns.
unsafe impl Send for ReadyFlag {}

impl ReadyFlag {
    fn set(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        // SAFETY: the pointer is the first word of a live pinned table.
        unsafe { std::ptr::write_volatile(self.0, 1) };
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

impl Drop for ReadyFlag {
    fn drop(&mut self) {
        self.set();
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Reused GPU resources: creating streams and pinning memory per ticket
/// would cost more than the copies.
#[derive(Default)]
struct GpuPool {
    events: Arc<Mutex<Vec<crate::gpu::cuda::IpcEvent>>>,
    device: Mutex<Vec<crate::gpu::cuda::DeviceBuf>>,
    streams: Mutex<Vec<crate::gpu::cuda::Stream>>,
    tables: Mutex<Vec<crate::gpu::HostBuf>>,
    staging: Mutex<Vec<crate::gpu::HostBuf>>,
    reaper: OnceLock<Mutex<std::sync::mpsc::Sender<Box<dyn Send>>>>,
}

/// Pooled buffers kept per kind.
const GPU_POOL_KEEP: usize = 16;

/// A GPU store moves at most this many bytes of groups per launch: the
/// size of a restore's staging, so both draw on one pool.
const GPU_STORE_CHUNK: usize = 16 << 20;

/// A ticket's IPC event; back to the pool once the ticket is both done
/// and collected (a client opens the handle any time before it collects).
/// A client still waiting on an old handle after that waits on a later
/// ticket's copy: later, never earlier, than its own.
struct PooledEvent {
    ev: Option<crate::gpu::cuda::IpcEvent>,
    pool: Arc<Mutex<Vec<crate::gpu::cuda::IpcEvent>>>,
}

impl std::ops::Deref for PooledEvent {
    type Target = crate::gpu::cuda::IpcEvent;
    fn deref(&self) -> &Self::Target {
        self.ev.as_ref().expect("an event until dropped")
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        let mut p = self.pool.lock();
        if p.len() < GPU_POOL_KEEP * 4 {
            p.extend(self.ev.take());
        }
    }
}

impl GpuPool {
    /// Device memory for a ticket's descriptors.
    fn take_device(&self, len: usize) -> Result<crate::gpu::cuda::DeviceBuf, String> {
        let mut t = self.device.lock();
        if let Some(i) = t.iter().position(|b| b.len() >= len) {
            return Ok(t.swap_remove(i));
        }
        drop(t);
        crate::gpu::cuda::cuda()
            .ok_or("no CUDA driver")?
            .alloc_device(len.next_power_of_two().max(4096))
    }

    fn give_device(&self, b: crate::gpu::cuda::DeviceBuf) {
        let mut t = self.device.lock();
        if t.len() < GPU_POOL_KEEP {
            t.push(b);
        } else {
            drop(t);
            // cuMemFree may wait for the device: not on an executor thread.
            self.free_later(Box::new(b));
        }
    }

    fn take_event(&self) -> Result<PooledEvent, String> {
        let ev = match self.events.lock().pop() {
            Some(e) => e,
            None => crate::gpu::cuda::cuda()
                .ok_or("no CUDA driver")?
                .new_ipc_event()?,
        };
        Ok(PooledEvent {
            ev: Some(ev),
            pool: self.events.clone(),
        })
    }

    fn take_table(&self, n: usize) -> std::io::Result<crate::gpu::HostBuf> {
        let need = 16 + 16 * n;
        let mut t = self.tables.lock();
        if let Some(i) = t.iter().position(|b| b.len() >= need) {
            let mut b = t.swap_remove(i);
            // The flag only: the job writes every descriptor before setting it.
            b.as_mut_slice()[..16].fill(0);
            return Ok(b);
        }
        drop(t);
        crate::gpu::HostBuf::alloc(need.next_power_of_two().max(4096))
    }

    fn take_staging(&self, len: usize) -> std::io::Result<crate::gpu::HostBuf> {
        let mut t = self.staging.lock();
        if let Some(i) = t.iter().position(|b| b.len() >= len) {
            return Ok(t.swap_remove(i));
        }
        drop(t);
        crate::gpu::HostBuf::alloc(len.next_power_of_two().max(4096))
    }

    fn take_stream(&self) -> Result<crate::gpu::cuda::Stream, String> {
        if let Some(s) = self.streams.lock().pop() {
            return Ok(s);
        }
        crate::gpu::cuda::cuda()
            .ok_or("no CUDA driver")?
            .new_stream()
    }

    /// Frees pinned memory on a thread of its own: cuMemFreeHost waits for
    /// the device to go idle, and an executor thread must never wait on a
    /// stream that may be waiting on a job still queued behind it.
    fn free(&self, b: crate::gpu::HostBuf) {
        self.free_later(Box::new(b));
    }

    /// Drops GPU memory (pinned or device) on a thread of its own.
    fn free_later(&self, b: Box<dyn Send>) {
        let tx = self.reaper.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<Box<dyn Send>>();
            std::thread::Builder::new()
                .name("kvfs-gpu-free".into())
                .spawn(move || {
                    for b in rx {
                        drop(b);
                    }
                })
                .expect("cannot start the GPU free thread");
            Mutex::new(tx)
        });
        let _ = tx.lock().send(b);
    }

    fn give_staging(&self, b: crate::gpu::HostBuf) {
        let mut t = self.staging.lock();
        if t.len() < GPU_POOL_KEEP {
            t.push(b);
        } else {
            drop(t);
            self.free(b);
        }
    }

    fn give(
        &self,
        table: crate::gpu::HostBuf,
        stream: Option<crate::gpu::cuda::Stream>,
        staging: Option<crate::gpu::HostBuf>,
    ) {
        {
            let mut t = self.tables.lock();
            if t.len() < GPU_POOL_KEEP {
                t.push(table);
            } else {
                drop(t);
                self.free(table);
            }
        }
        self.streams.lock().extend(stream);
        if let Some(b) = staging {
            self.give_staging(b);
        }
    }
}

/// Called with each group a STORE changed (the filesystem drops the
/// kernel's cached pages of it).
pub type ChangeHook = Box<dyn Fn(GroupIndex) + Send + Sync>;

/// The shared state of the control file: cascade, executor, metrics.
pub struct Control {
    cascade: Arc<Cascade>,
    exec: Arc<Executor>,
    timer: Arc<Timer>,
    stats: ControlStats,
    on_change: OnceLock<ChangeHook>,
    gpu_pool: GpuPool,
}

impl Control {
    pub fn new(cascade: Arc<Cascade>) -> Arc<Control> {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(MIN_EXECUTORS)
            .max(MIN_EXECUTORS);
        Arc::new(Control {
            cascade,
            exec: Executor::start(threads),
            timer: Timer::start(),
            stats: ControlStats::default(),
            on_change: OnceLock::new(),
            gpu_pool: GpuPool::default(),
        })
    }

    pub fn cascade(&self) -> &Arc<Cascade> {
        &self.cascade
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
            gpu_stream: Mutex::new(None),
        })
    }

    /// Appends the control metrics to a Prometheus exposition.
    pub fn render_stats(&self, e: &mut Exposition) {
        use wire::Command::*;
        let cmds = [
            Hello, Register, Unregister, Restore, Store, Query, Prefetch, Wait,
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

enum Ticket {
    Running,
    Done(Reply),
}

/// An item of the fd's output, in request order.
enum Out {
    Ready(Vec<u8>),
    /// A WAIT sent by write(2): resolved when the ticket ends or the deadline passes.
    Wait {
        ticket: u64,
        deadline: Option<Instant>,
    },
}

type Parked = Box<dyn FnOnce(Result<Vec<u8>, i32>) + Send>;
type WaitCallback = Box<dyn FnOnce(Reply) + Send>;

#[derive(Default)]
struct SessionState {
    regions: HashMap<u32, Arc<Region>>,
    next_region: u32,
    next_ticket: u64,
    tickets: HashMap<u64, Ticket>,
    /// Finished tickets not yet collected, oldest first.
    done: VecDeque<u64>,
    out: VecDeque<Out>,
    /// The partly read current output item.
    cursor: Option<(Vec<u8>, usize)>,
    /// The last read ended exactly at an item's end, with the buffer full.
    boundary: bool,
    /// Bytes of a request still arriving over several writes.
    partial: Vec<u8>,
    readers: VecDeque<(usize, Parked)>,
    waiters: Vec<(u64, Option<Instant>, WaitCallback)>,
    pollers: Vec<Box<dyn FnOnce() + Send>>,
    /// IPC events of GPU tickets, kept until the ticket is collected.
    events: HashMap<u64, Arc<PooledEvent>>,
}

impl SessionState {
    fn readable(&self) -> bool {
        self.cursor.is_some()
            || matches!(self.out.front(), Some(Out::Ready(_)))
            || (self.out.is_empty() && !self.done.is_empty())
    }

    /// Takes a finished ticket's completion (collecting it).
    fn collect(&mut self, ticket: u64) -> Option<Reply> {
        match self.tickets.get(&ticket) {
            Some(Ticket::Done(_)) => {}
            _ => return None,
        }
        self.done.retain(|&t| t != ticket);
        self.events.remove(&ticket);
        match self.tickets.remove(&ticket) {
            Some(Ticket::Done(r)) => Some(r),
            _ => None,
        }
    }

    fn wait_result(
        &mut self,
        ticket: u64,
        deadline: Option<Instant>,
        now: Instant,
    ) -> Option<Reply> {
        if let Some(mut r) = self.collect(ticket) {
            r.command = Command::Wait as u16;
            return Some(r);
        }
        if !self.tickets.contains_key(&ticket) {
            return Some(Reply::error(
                Command::Wait as u16,
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "ticket {ticket} is neither in flight nor waiting to be collected on this fd"
                ),
            ));
        }
        match deadline {
            Some(d) if d <= now => {
                let mut r = Reply::error(
                    Command::Wait as u16,
                    libc::ETIMEDOUT,
                    NO_ENTRY,
                    format!("ticket {ticket} still running at the timeout"),
                );
                r.value = ticket;
                Some(r)
            }
            _ => None,
        }
    }

    /// Next bytes for a read of at most `size`, if any are ready.
    fn next_bytes(&mut self, size: usize) -> Option<Vec<u8>> {
        if self.cursor.is_none() {
            let item = match self.out.front() {
                Some(Out::Ready(_)) => match self.out.pop_front() {
                    Some(Out::Ready(b)) => b,
                    _ => unreachable!("front was Ready"),
                },
                Some(Out::Wait { .. }) => return None,
                None => {
                    let t = *self.done.front()?;
                    let mut r = self.collect(t)?;
                    r.command = Command::Completion as u16;
                    r.encode()
                }
            };
            self.cursor = Some((item, 0));
        }
        let (item, at) = self.cursor.as_mut().expect("set above");
        let n = size.min(item.len() - *at);
        let chunk = item[*at..*at + n].to_vec();
        *at += n;
        if *at == item.len() {
            self.cursor = None;
            self.boundary = n == size;
        } else {
            self.boundary = false;
        }
        Some(chunk)
    }
}

/// One open control fd.
pub struct Session {
    ctl: Arc<Control>,
    uid: u32,
    gid: u32,
    may_write: bool,
    st: Mutex<SessionState>,
    /// This fd's stream for GPU restores of T1-resident batches: their
    /// copies run in submission order, so the oldest ticket finishes first
    /// and a client keeping a few tickets in flight always has queued work
    /// behind the one it waits for.
    gpu_stream: Mutex<Option<crate::gpu::cuda::Stream>>,
}

impl Drop for Session {
    fn drop(&mut self) {
        // Jobs hold the session, so nothing is enqueued on it any more.
        if let Some(s) = self.gpu_stream.get_mut().take() {
            self.ctl.gpu_pool.streams.lock().push(s);
        }
    }
}

impl Session {
    /// Feeds bytes written to the fd; complete requests are handled and
    /// their replies queued. Returns how many bytes were taken (all).
    pub fn write(self: &Arc<Session>, data: &[u8]) -> usize {
        let mut st = self.st.lock();
        let mut input = data;
        loop {
            // The next complete request: straight from `input` when none is
            // being assembled (the usual case: no copy of a large batch),
            // else from `partial`, topped up from `input`.
            let assembled;
            let req: &[u8] = if st.partial.is_empty() {
                match wire::request_len(input) {
                    Ok((_, n)) if input.len() >= n => {
                        let (r, rest) = input.split_at(n);
                        input = rest;
                        r
                    }
                    Err(e) if input.len() >= wire::HEADER_BYTES => {
                        st.out.push_back(Out::Ready(Self::stream_error(input, e)));
                        break;
                    }
                    _ => {
                        st.partial.extend_from_slice(input);
                        break;
                    }
                }
            } else {
                // Enough of the header first, then exactly the rest of the request.
                let need_header = wire::HEADER_BYTES.saturating_sub(st.partial.len());
                let take = need_header.min(input.len());
                st.partial.extend_from_slice(&input[..take]);
                input = &input[take..];
                if st.partial.len() < wire::HEADER_BYTES {
                    break;
                }
                let want = match wire::request_len(&st.partial) {
                    Ok((_, n)) => n,
                    Err(e) => {
                        let r = Self::stream_error(&st.partial, e);
                        st.partial.clear();
                        st.out.push_back(Out::Ready(r));
                        break;
                    }
                };
                let take = (want - st.partial.len()).min(input.len());
                st.partial.extend_from_slice(&input[..take]);
                input = &input[take..];
                if st.partial.len() < want {
                    break;
                }
                assembled = std::mem::take(&mut st.partial);
                &assembled
            };
            drop(st);
            let out = match wire::decode_request(req) {
                Ok(Request::Wait { ticket, timeout_ms }) => {
                    self.ctl.stats.requests[Command::Wait as usize].fetch_add(1, Ordering::Relaxed);
                    let deadline = self.deadline(timeout_ms);
                    Out::Wait { ticket, deadline }
                }
                Ok(r) => Out::Ready(self.handle(r).encode()),
                Err(e) => Out::Ready(
                    Reply::error(
                        u16::from_le_bytes([req[6], req[7]]),
                        libc::EINVAL,
                        NO_ENTRY,
                        e.to_string(),
                    )
                    .encode(),
                ),
            };
            st = self.st.lock();
            st.out.push_back(out);
        }
        drop(st);
        self.pump();
        data.len()
    }

    /// The reply to a request header that cannot be parsed: the stream
    /// cannot be resynchronised, so the rest of this write is dropped.
    fn stream_error(header: &[u8], e: wire::DecodeError) -> Vec<u8> {
        let cmd = u16::from_le_bytes([header[6], header[7]]);
        Reply::error(cmd, libc::EINVAL, NO_ENTRY, e.to_string()).encode()
    }

    fn deadline(self: &Arc<Session>, timeout_ms: u64) -> Option<Instant> {
        (timeout_ms != u64::MAX).then(|| {
            let d = Instant::now() + Duration::from_millis(timeout_ms.min(1 << 40));
            self.ctl.timer.at(d, self);
            d
        })
    }

    /// A read of at most `size` bytes: answered now (`Ok`), or `cb` is
    /// parked and called when output arrives. `nonblock` answers EAGAIN
    /// instead of parking.
    pub fn read(&self, size: usize, nonblock: bool, cb: Parked) {
        let mut st = self.st.lock();
        if !st.partial.is_empty() && st.out.is_empty() && st.cursor.is_none() {
            let have = st.partial.len();
            st.partial.clear();
            let r = Reply::error(
                0,
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "truncated request: {have} bytes of a request were written, then a read came"
                ),
            );
            st.out.push_back(Out::Ready(r.encode()));
        }
        if let Some(b) = st.next_bytes(size) {
            drop(st);
            return cb(Ok(b));
        }
        if std::mem::take(&mut st.boundary) {
            // The last read ended exactly at an item's end with its buffer
            // full: this may be the kernel asking for the rest of that
            // read(2). End it here rather than block it.
            drop(st);
            return cb(Ok(Vec::new()));
        }
        if nonblock {
            drop(st);
            return cb(Err(libc::EAGAIN));
        }
        st.readers.push_back((size, cb));
    }

    /// Handles one ioctl(2) request: `cb` gets the reply (now, or when a
    /// WAIT ends).
    pub fn ioctl(self: &Arc<Session>, req: &[u8], cb: WaitCallback) {
        let request = wire::request_len(req).and_then(|(_, n)| {
            if n > req.len() {
                Err(wire::DecodeError::Length {
                    command: "ioctl request",
                    count: 0,
                    want: n,
                    got: req.len(),
                })
            } else {
                wire::decode_request(&req[..n])
            }
        });
        match request {
            Ok(Request::Wait { ticket, timeout_ms }) => {
                self.ctl.stats.requests[Command::Wait as usize].fetch_add(1, Ordering::Relaxed);
                let deadline = self.deadline(timeout_ms);
                let mut st = self.st.lock();
                match st.wait_result(ticket, deadline, Instant::now()) {
                    Some(r) => {
                        drop(st);
                        cb(r)
                    }
                    None => st.waiters.push((ticket, deadline, cb)),
                }
            }
            Ok(r) => cb(self.handle(r)),
            Err(e) => {
                let cmd = if req.len() >= 8 {
                    u16::from_le_bytes([req[6], req[7]])
                } else {
                    0
                };
                cb(Reply::error(cmd, libc::EINVAL, NO_ENTRY, e.to_string()))
            }
        }
    }

    /// Whether a read would return now; if not, `notify` is called once it would.
    pub fn poll(&self, notify: Option<Box<dyn FnOnce() + Send>>) -> bool {
        let mut st = self.st.lock();
        if st.readable() {
            return true;
        }
        if let Some(n) = notify {
            st.pollers.push(n);
        }
        false
    }

    /// Runs whatever waiters can now be answered (after any state change).
    fn pump(&self) {
        let now = Instant::now();
        let mut actions: Vec<Box<dyn FnOnce() + Send>> = Vec::new();
        let mut st = self.st.lock();
        // WAITs sent by write(2).
        for i in 0..st.out.len() {
            if let Out::Wait { ticket, deadline } = st.out[i]
                && let Some(r) = st.wait_result(ticket, deadline, now)
            {
                st.out[i] = Out::Ready(r.encode());
            }
        }
        // WAITs sent by ioctl(2).
        let waiters = std::mem::take(&mut st.waiters);
        for (ticket, deadline, cb) in waiters {
            match st.wait_result(ticket, deadline, now) {
                Some(r) => actions.push(Box::new(move || cb(r))),
                None => st.waiters.push((ticket, deadline, cb)),
            }
        }
        // Parked reads.
        while let Some((size, _)) = st.readers.front() {
            let size = *size;
            let Some(b) = st.next_bytes(size) else { break };
            st.boundary = false;
            let (_, cb) = st.readers.pop_front().expect("front exists");
            actions.push(Box::new(move || cb(Ok(b))));
        }
        if st.readable() {
            actions.append(&mut st.pollers);
        }
        drop(st);
        for a in actions {
            a();
        }
    }

    /// The fd is closing: parked callers get EBADF; in-flight tickets run
    /// to their end (they hold the session and their regions).
    pub fn close(&self) {
        let mut st = self.st.lock();
        let readers: Vec<_> = st.readers.drain(..).collect();
        let waiters: Vec<_> = st.waiters.drain(..).collect();
        st.pollers.clear();
        drop(st);
        for (_, cb) in readers {
            cb(Err(libc::EBADF));
        }
        for (t, _, cb) in waiters {
            cb(Reply::error(
                Command::Wait as u16,
                libc::EBADF,
                NO_ENTRY,
                format!("fd closed while waiting for ticket {t}"),
            ));
        }
    }

    fn count(&self, cmd: Command, ok: bool) {
        let a = if ok {
            &self.ctl.stats.requests
        } else {
            &self.ctl.stats.rejected
        };
        a[cmd as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Handles every request but WAIT.
    fn handle(self: &Arc<Session>, r: Request) -> Reply {
        let cmd = match &r {
            Request::Hello => Command::Hello,
            Request::Register { .. } => Command::Register,
            Request::Unregister { .. } => Command::Unregister,
            Request::Restore(_) | Request::RestoreFrom(_) => Command::Restore,
            Request::Store(_) | Request::StoreFrom(_) => Command::Store,
            Request::Query(_) => Command::Query,
            Request::Prefetch(_) => Command::Prefetch,
            Request::Wait { .. } => unreachable!("WAIT is handled by its transport"),
        };
        let out = match r {
            Request::Hello => Ok(self.hello()),
            Request::Register { path, len, flags } => self.register(&path, len, flags),
            Request::Unregister { region } => self.unregister(region),
            Request::Restore(e) => self.submit_io(Command::Restore, &e),
            Request::Store(e) => self.submit_io(Command::Store, &e),
            Request::RestoreFrom(at) => self
                .entries_from(at)
                .and_then(|e| self.submit_io(Command::Restore, &e)),
            Request::StoreFrom(at) => self
                .entries_from(at)
                .and_then(|e| self.submit_io(Command::Store, &e)),
            Request::Query(k) => self.query(&k),
            Request::Prefetch(k) => self.prefetch(&k),
            Request::Wait { .. } => unreachable!(),
        };
        self.count(cmd, out.is_ok());
        out.unwrap_or_else(|rj| Reply::error(cmd as u16, rj.errno, rj.entry, rj.message))
    }

    fn hello(&self) -> Reply {
        let mut r = Reply::ok(Command::Hello, wire::VERSION as u64);
        r.message = self.ctl.cascade.describe_json();
        r
    }

    fn register(&self, path: &[u8], len: u64, flags: u64) -> Result<Reply, Rejection> {
        if flags == wire::REGISTER_CUDA {
            return self.register_cuda(path, len);
        }
        if flags != 0 {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!("unknown REGISTER flags {flags:#x} (0 = host file)"),
            ));
        }
        let path = std::str::from_utf8(path)
            .map_err(|_| reject(libc::EINVAL, NO_ENTRY, "region path is not UTF-8"))?;
        let p = std::path::Path::new(path);
        if !p.is_absolute() {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!("region path {path:?} must be absolute"),
            ));
        }
        if len == 0 {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                "region length must be at least 1 byte",
            ));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(p)
            .map_err(|e| {
                let errno = e.raw_os_error().unwrap_or(libc::EIO);
                let why = if errno == libc::ELOOP {
                    "is a symbolic link".to_string()
                } else {
                    e.to_string()
                };
                reject(
                    errno,
                    NO_ENTRY,
                    format!("cannot open region file {path}: {why}"),
                )
            })?;
        let md = file
            .metadata()
            .map_err(|e| reject(libc::EIO, NO_ENTRY, format!("cannot stat {path}: {e}")))?;
        if !md.file_type().is_file() {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!("region {path} is not a regular file"),
            ));
        }
        // The daemon may run as root: check the requester's own rights.
        if self.uid != 0 {
            let mode = md.mode();
            let bits = if md.uid() == self.uid {
                (mode >> 6) & 0o7
            } else if md.gid() == self.gid {
                (mode >> 3) & 0o7
            } else {
                mode & 0o7
            };
            if bits & 0o6 != 0o6 {
                return Err(reject(
                    libc::EACCES,
                    NO_ENTRY,
                    format!("uid {} may not read and write {path}", self.uid),
                ));
            }
        }
        if md.len() < len {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "region file {path} is {} bytes, shorter than the length {len}",
                    md.len()
                ),
            ));
        }
        if len > isize::MAX as u64 {
            return Err(reject(libc::EINVAL, NO_ENTRY, "region length too large"));
        }
        // SAFETY: a shared mapping of a regular file we just checked; the
        // client may change the bytes at any time, which the daemon treats
        // as data, never as structure.
        let map = unsafe { memmap2::MmapOptions::new().len(len as usize).map_mut(&file) }.map_err(
            |e| {
                reject(
                    e.raw_os_error().unwrap_or(libc::EIO),
                    NO_ENTRY,
                    format!("cannot map {path}: {e}"),
                )
            },
        )?;
        let ptr = map.as_ptr() as *mut u8;
        let guard = guard::Guard::new(ptr as usize, len as usize).ok_or_else(|| {
            reject(
                libc::ENOSPC,
                NO_ENTRY,
                format!("too many regions registered (at most {})", guard::SLOTS),
            )
        })?;
        let region = Arc::new(Region {
            len,
            path: p.to_path_buf(),
            mem: Memory::Host {
                ptr,
                guard,
                _map: map,
            },
        });
        let mut st = self.st.lock();
        st.next_region += 1;
        let id = st.next_region;
        st.regions.insert(id, region);
        Ok(Reply::ok(Command::Register, id as u64))
    }

    /// REGISTER of a CUDA allocation: payload = IPC memory handle (64
    /// bytes), offset into the allocation (u64), device ordinal (u32), pad.
    fn register_cuda(&self, payload: &[u8], len: u64) -> Result<Reply, Rejection> {
        let Some(c) = crate::gpu::cuda::cuda() else {
            return Err(reject(
                libc::ENODEV,
                NO_ENTRY,
                format!(
                    "{}: CUDA regions are unavailable",
                    crate::gpu::cuda::unavailable_reason()
                ),
            ));
        };
        if payload.len() != wire::CUDA_REGISTER_BYTES {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "a CUDA REGISTER carries {} bytes (IPC handle, offset, device, pad), got {}",
                    wire::CUDA_REGISTER_BYTES,
                    payload.len()
                ),
            ));
        }
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&payload[..64]);
        let offset = u64::from_le_bytes(payload[64..72].try_into().expect("8 bytes"));
        let device = u32::from_le_bytes(payload[72..76].try_into().expect("4 bytes"));
        if device as i32 != c.device {
            return Err(reject(
                libc::ENODEV,
                NO_ENTRY,
                format!(
                    "CUDA device {device}: this kvfs drives device {} only",
                    c.device
                ),
            ));
        }
        if len == 0 {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                "region length must be at least 1 byte",
            ));
        }
        let (base, avail) = c.open_ipc_mem(&handle).map_err(|e| {
            reject(
                libc::EINVAL,
                NO_ENTRY,
                format!("cannot open the CUDA IPC handle: {e}"),
            )
        })?;
        let region = Region {
            len,
            path: format!("cuda:{device}").into(),
            mem: Memory::Cuda {
                dptr: base + offset,
                ipc_base: base,
            },
        };
        if offset.checked_add(len).is_none_or(|end| end > avail) {
            return Err(reject(
                libc::EFAULT,
                NO_ENTRY,
                format!(
                    "bytes {offset}..{} lie outside the CUDA allocation ({avail} bytes)",
                    offset.saturating_add(len)
                ),
            ));
        }
        let mut st = self.st.lock();
        st.next_region += 1;
        let id = st.next_region;
        st.regions.insert(id, Arc::new(region));
        Ok(Reply::ok(Command::Register, id as u64))
    }

    fn unregister(&self, region: u32) -> Result<Reply, Rejection> {
        match self.st.lock().regions.remove(&region) {
            Some(_) => Ok(Reply::ok(Command::Unregister, region as u64)),
            None => Err(reject(
                libc::EBADF,
                NO_ENTRY,
                format!("region {region} is not registered on this fd"),
            )),
        }
    }

    fn key_index(&self, i: usize, k: &RawKey) -> Result<GroupIndex, Rejection> {
        let key = k.key().ok_or_else(|| {
            reject(
                libc::EINVAL,
                i as u32,
                format!("entry {i}: kind {} is not 0 (K) or 1 (V)", k.kind),
            )
        })?;
        self.ctl
            .cascade
            .layout()
            .index(key)
            .map_err(|e| reject(libc::ERANGE, i as u32, format!("entry {i}: {key}: {e}")))
    }

    /// The entries of a RESTORE/STORE that names them in a host region
    /// (wire::ENTRIES_IN_REGION), each field read once: the client may
    /// change the region at any moment, and what was read is what counts.
    fn entries_from(&self, at: wire::EntriesAt) -> Result<Vec<IoEntry>, Rejection> {
        let region = self.st.lock().regions.get(&at.region).cloned();
        let region = region.ok_or_else(|| {
            reject(
                libc::EBADF,
                NO_ENTRY,
                format!(
                    "the entries' region {} is not registered on this fd",
                    at.region
                ),
            )
        })?;
        if region.is_cuda() {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "the entries' region {} is GPU memory; entries are read from a host region",
                    at.region
                ),
            ));
        }
        let bytes = at.count as u64 * wire::IO_ENTRY_BYTES as u64;
        if at.offset > region.len() || region.len() - at.offset < bytes {
            return Err(reject(
                libc::EFAULT,
                NO_ENTRY,
                format!(
                    "{} entries at bytes {}..{} lie outside region {} ({} bytes)",
                    at.count,
                    at.offset,
                    at.offset.saturating_add(bytes),
                    at.region,
                    region.len()
                ),
            ));
        }
        // SAFETY: the range was checked to lie inside the region, which
        // `region` keeps mapped; a shrunk file reads as zeros (guard) and
        // is caught just below.
        let entries = wire::decode_io_entries(unsafe { region.range(at.offset, bytes as usize) });
        if region.damaged() {
            return Err(reject(
                libc::EFAULT,
                NO_ENTRY,
                format!(
                    "region {}'s file shrank while its entries were read",
                    at.region
                ),
            ));
        }
        Ok(entries)
    }

    /// All-or-nothing admission of RESTORE/STORE entries.
    fn admit_io(&self, cmd: Command, entries: &[IoEntry]) -> Result<Batch, Rejection> {
        let layout = *self.ctl.cascade.layout();
        let gb = layout.group_bytes();
        let st = self.st.lock();
        let mut batch = Batch {
            regions: Vec::new(),
            items: Vec::with_capacity(entries.len()),
        };
        let mut ids: Vec<u32> = Vec::new();
        // The region of the previous entry (batches mostly name one):
        // (id, position in batch.regions, length, device base, alignment
        // mask: 15 for CUDA regions, whose destinations must be 16-byte
        // aligned, else 0).
        let mut cur: Option<(u32, u32, u64, u64, u64)> = None;
        // Restore destinations must not overlap. Engines mostly name them
        // in ascending order, which one comparison per entry checks; any
        // other order is sorted and checked after the loop.
        let mut ascending = true;
        let mut prev: Option<(u32, u64)> = None;
        for (i, e) in entries.iter().enumerate() {
            let g = match e.key.key().map(|k| layout.index(k)) {
                Some(Ok(g)) => g,
                _ => return Err(self.key_index(i, &e.key).expect_err("a bad key")),
            };
            let (at, len, base, mask) = match cur {
                Some((id, at, len, base, mask)) if id == e.region => (at, len, base, mask),
                _ => {
                    let at = match ids.iter().position(|&id| id == e.region) {
                        Some(at) => at as u32,
                        None => {
                            let region = st.regions.get(&e.region).ok_or_else(|| {
                                reject(
                                    libc::EBADF,
                                    i as u32,
                                    format!(
                                        "entry {i}: region {} is not registered on this fd",
                                        e.region
                                    ),
                                )
                            })?;
                            if region.damaged() {
                                return Err(reject(
                                    libc::EFAULT,
                                    i as u32,
                                    format!(
                                        "entry {i}: region {}'s file shrank under a copy; unregister it and register again",
                                        e.region
                                    ),
                                ));
                            }
                            if let Some(first) = batch.regions.first()
                                && first.is_cuda() != region.is_cuda()
                            {
                                return Err(reject(
                                    libc::EINVAL,
                                    i as u32,
                                    format!(
                                        "entry {i}: one batch targets host regions or CUDA regions, not both"
                                    ),
                                ));
                            }
                            ids.push(e.region);
                            batch.regions.push(region.clone());
                            (ids.len() - 1) as u32
                        }
                    };
                    let r = &batch.regions[at as usize];
                    let (base, mask) = r.device_addr(0).map_or((0, 0), |d| (d, 15));
                    cur = Some((e.region, at, r.len(), base, mask));
                    (at, r.len(), base, mask)
                }
            };
            if e.offset > len || len - e.offset < gb {
                return Err(reject(
                    libc::EFAULT,
                    i as u32,
                    format!(
                        "entry {i}: bytes {}..{} lie outside region {} ({len} bytes)",
                        e.offset,
                        e.offset.saturating_add(gb),
                        e.region,
                    ),
                ));
            }
            if base.wrapping_add(e.offset) & mask != 0 {
                return Err(reject(
                    libc::EINVAL,
                    i as u32,
                    format!(
                        "entry {i}: a group in CUDA memory must start 16-byte aligned (offset {})",
                        e.offset
                    ),
                ));
            }
            if let Some((pr, po)) = prev {
                if (at, e.offset) <= (pr, po) {
                    ascending = false;
                } else if cmd == Command::Restore && pr == at && po + gb > e.offset {
                    return Err(overlap(i - 1, i, e.region));
                }
            }
            prev = Some((at, e.offset));
            batch.items.push(Item {
                g,
                region: at,
                offset: e.offset,
            });
        }
        drop(st);
        if batch.is_cuda() && !gb.is_multiple_of(16) {
            return Err(reject(
                libc::EINVAL,
                0,
                format!("GPU copies need groups of a multiple of 16 bytes; these are {gb}"),
            ));
        }
        if cmd == Command::Restore && !ascending {
            // Two restores into the same bytes would race: refuse.
            let mut spans: Vec<(u32, u64, u32)> = batch
                .items
                .iter()
                .enumerate()
                .map(|(i, it)| (it.region, it.offset, i as u32))
                .collect();
            spans.sort_unstable();
            for w in spans.windows(2) {
                if w[0].0 == w[1].0 && w[0].1 + gb > w[1].1 {
                    let (a, b) = (w[0].2.min(w[1].2), w[0].2.max(w[1].2));
                    return Err(overlap(a as usize, b as usize, entries[b as usize].region));
                }
            }
        }
        Ok(batch)
    }

    fn new_ticket(&self) -> u64 {
        let mut st = self.st.lock();
        st.next_ticket += 1;
        let t = st.next_ticket;
        st.tickets.insert(t, Ticket::Running);
        t
    }

    /// Counts a finished RESTORE or STORE job's bytes and latency, then
    /// finishes its ticket.
    fn complete(
        self: &Arc<Session>,
        cmd: Command,
        ticket: u64,
        started: Instant,
        results: Vec<Result<(), CascadeError>>,
    ) {
        let gb = self.ctl.cascade.layout().group_bytes();
        let bytes = results.iter().filter(|r| r.is_ok()).count() as u64 * gb;
        let st = &self.ctl.stats;
        let (counter, latency) = match cmd {
            Command::Restore => (&st.restored_bytes, &st.restore_latency),
            _ => (&st.stored_bytes, &st.store_latency),
        };
        counter.fetch_add(bytes, Ordering::Relaxed);
        latency.observe(started.elapsed());
        self.finish(ticket, results);
    }

    fn finish(self: &Arc<Session>, ticket: u64, results: Vec<Result<(), CascadeError>>) {
        let failed = results.iter().filter(|r| r.is_err()).count() as u32;
        let first = results.iter().position(|r| r.is_err());
        let mut r = Reply::ok(Command::Completion, ticket);
        if let Some(i) = first {
            let e = results[i].as_ref().expect_err("position found an error");
            r.status = e.errno() as u32;
            r.failed = failed;
            r.entry = i as u32;
            r.message = format!("entry {i}: {e}");
            self.ctl
                .stats
                .failed_entries
                .fetch_add(failed as u64, Ordering::Relaxed);
        }
        {
            let mut st = self.st.lock();
            st.tickets.insert(ticket, Ticket::Done(r));
            st.done.push_back(ticket);
        }
        self.pump();
    }

    fn submit_io(
        self: &Arc<Session>,
        cmd: Command,
        entries: &[IoEntry],
    ) -> Result<Reply, Rejection> {
        let admitted = Instant::now();
        if cmd == Command::Store && !self.may_write {
            return Err(reject(
                libc::EACCES,
                NO_ENTRY,
                format!(
                    "uid {} may not change groups of this mount (only its owner may STORE, as only its owner may write the group files)",
                    self.uid
                ),
            ));
        }
        let work = self.admit_io(cmd, entries)?;
        if work.is_cuda() {
            return match cmd {
                Command::Restore => self.submit_gpu_restore(work, admitted),
                _ => self.submit_gpu_store(work),
            };
        }
        let ticket = self.new_ticket();
        let s = self.clone();
        let started = Instant::now();
        let job: Job = match cmd {
            Command::Restore => Box::new(move || {
                let gb = s.ctl.cascade.layout().group_bytes() as usize;
                let mut items: Vec<(GroupIndex, &mut [u8])> = work
                    .items
                    .iter()
                    // SAFETY: admission checked each range is inside its
                    // region and that no two ranges overlap; `work` keeps
                    // the regions mapped until the job ends.
                    .map(|it| (it.g, unsafe { work.region(it).range_mut(it.offset, gb) }))
                    .collect();
                let results: Vec<Result<(), CascadeError>> = s
                    .ctl
                    .cascade
                    .read_groups(&mut items)
                    .into_iter()
                    .map(|r| r.map(|_| ()))
                    .collect();
                drop(items);
                let results = work.mark_damaged(results);
                s.complete(Command::Restore, ticket, started, results);
            }),
            _ => Box::new(move || {
                let gb = s.ctl.cascade.layout().group_bytes() as usize;
                let mut copy = vec![0u8; gb];
                let groups: Vec<GroupIndex> = work.items.iter().map(|it| it.g).collect();
                let results = s.ctl.cascade.write_groups(&groups, |i, dst| {
                    let it = &work.items[i];
                    let r = work.region(it);
                    // Copy out first: if the client shrinks the file under
                    // us, the group must not take the zero page.
                    // SAFETY: admission checked the range is inside the region.
                    copy.copy_from_slice(unsafe { r.range(it.offset, gb) });
                    if r.damaged() {
                        return Err(CascadeError::RegionFault(r.path.display().to_string()));
                    }
                    dst.copy_from_slice(&copy);
                    Ok(())
                });
                s.changed(&groups, &results);
                s.complete(Command::Store, ticket, started, results);
            }),
        };
        self.ctl.exec.submit_ticket(self, ticket, job);
        Ok(Reply::ok(cmd, ticket))
    }

    /// Tells the filesystem which groups a STORE changed.
    fn changed(&self, groups: &[GroupIndex], results: &[Result<(), CascadeError>]) {
        if let Some(h) = self.ctl.on_change.get() {
            for (&g, _) in groups.iter().zip(results).filter(|(_, r)| r.is_ok()) {
                h(g);
            }
        }
    }

    /// A RESTORE into CUDA regions. Before replying, it enqueues on a
    /// stream: wait for a ready flag in pinned memory, the gather kernel
    /// over a descriptor table, and the ticket's IPC event; the reply
    /// carries the event's handle, so a client stream can wait on it at
    /// once. The executor then pins the T1 hits (the kernel reads their
    /// slots through the device mapping), reads the misses into pinned
    /// staging, fills the table, sets the flag, and waits for the event
    /// before it lets go of the slots.
    fn submit_gpu_restore(
        self: &Arc<Session>,
        work: Batch,
        admitted: Instant,
    ) -> Result<Reply, Rejection> {
        let validated = Instant::now();
        let c = crate::gpu::cuda::cuda()
            .ok_or_else(|| reject(libc::ENODEV, NO_ENTRY, "no CUDA driver"))?;
        let n = work.len();
        let gb = self.ctl.cascade.layout().group_bytes();
        let fail = |e: String| {
            reject(
                libc::EIO,
                NO_ENTRY,
                format!("cannot start the GPU restore: {e}"),
            )
        };
        // Table: a 16-byte ready flag, then n descriptors {src, dst}.
        let table = self
            .ctl
            .gpu_pool
            .take_table(n)
            .map_err(|e| fail(e.to_string()))?;
        let table_dev = table
            .device_ptr()
            .ok_or_else(|| fail("the descriptor table is not device-mapped".into()))?;
        let stride = self.ctl.cascade.layout().stride() as usize;
        // Everything the job needs is allocated here, before the stream is
        // told to wait: pinning memory makes CUDA wait for the device to go
        // idle, and the device then waits on this ticket's flag, which only
        // the job sets. The job itself makes no such call.
        let staging = self
            .ctl
            .gpu_pool
            .take_staging(n * stride)
            .map_err(|e| fail(e.to_string()))?;
        let event = Arc::new(self.ctl.gpu_pool.take_event().map_err(fail)?);
        let staged_descs = self.ctl.gpu_pool.take_device(16 * n).map_err(fail)?;
        // A batch all in T1 goes on this fd's ordered stream; one with
        // misses (backing reads first) on a stream of its own, so it holds
        // up no other ticket.
        let checked = Instant::now();
        let resident = self
            .ctl
            .cascade
            .all_resident(work.items.iter().map(|it| it.g));
        let resident_us = checked.elapsed().as_micros() as u64;
        let own_stream = if resident {
            None
        } else {
            Some(self.ctl.gpu_pool.take_stream().map_err(fail)?)
        };
        let mut ordered = self.gpu_stream.lock();
        let stream = match &own_stream {
            Some(s) => s,
            None => match &mut *ordered {
                Some(s) => s,
                slot => slot.insert(self.ctl.gpu_pool.take_stream().map_err(fail)?),
            },
        };
        let ready = ReadyFlag(table.as_ptr().cast::<u32>());
        // SAFETY: the table holds 16 + 16 × n bytes (take_table).
        let descs = unsafe { table.as_ptr().add(16) };
        // SAFETY: the table and staged_descs stay alive (moved into the
        // job) until the job has waited for the event; the job sets the
        // flag on every path.
        let r = unsafe {
            c.enqueue_gather(
                stream,
                table_dev,
                descs,
                &staged_descs,
                n as u32,
                gb,
                &event,
            )
        };
        if let Err(e) = r {
            ready.set(); // whatever was enqueued must not wait forever
            return Err(fail(e));
        }
        let ticket = self.new_ticket();
        let mut reply = Reply::ok(Command::Restore, ticket);
        reply.message = format!("ipc_event={}", hex(&event.handle));
        self.st.lock().events.insert(ticket, event.clone());
        let s = self.clone();
        let started = Instant::now();
        tracing::debug!(
            ticket,
            n,
            admit_us = (started - admitted).as_micros() as u64,
            resident_us,
            validate_us = (validated - admitted).as_micros() as u64,
            "GPU restore enqueued"
        );
        self.ctl.exec.submit_ticket(
            self,
            ticket,
            Box::new(move || {
                let mut table = table;
                let ready = ready;
                let cascade = s.ctl.cascade.clone();
                let groups: Vec<GroupIndex> = work.items.iter().map(|it| it.g).collect();
                let job_started = Instant::now();
                let (hits, pins) = cascade.pin_for_device(&groups);
                let pin_us = job_started.elapsed().as_micros() as u64;
                let mut results: Vec<Result<(), CascadeError>> = (0..n).map(|_| Ok(())).collect();
                let misses: Vec<usize> = (0..n).filter(|&i| hits[i].is_none()).collect();
                let mut staging = staging;
                let mut src: Vec<u64> = hits.iter().map(|h| h.unwrap_or(0)).collect();
                if !misses.is_empty() {
                    let base = staging.device_ptr().unwrap_or(0);
                    let mut items: Vec<(GroupIndex, &mut [u8])> = staging
                        .as_mut_slice()
                        .chunks_mut(stride)
                        .zip(&misses)
                        .map(|(b, &i)| (groups[i], &mut b[..gb as usize]))
                        .collect();
                    let rs = cascade.read_groups(&mut items);
                    drop(items);
                    for (k, (&i, r)) in misses.iter().zip(rs).enumerate() {
                        match r {
                            Ok(_) if base != 0 => src[i] = base + (k * stride) as u64,
                            Ok(_) => {
                                results[i] = Err(CascadeError::Internal(
                                    "staging is not device-mapped".into(),
                                ))
                            }
                            Err(e) => results[i] = Err(e),
                        }
                    }
                }
                {
                    let descs = &mut table.as_mut_slice()[16..16 + 16 * n];
                    for (i, d) in descs.chunks_exact_mut(16).enumerate() {
                        let it = &work.items[i];
                        let dst = work.region(it).device_addr(it.offset).unwrap_or(0);
                        let sv = if results[i].is_ok() { src[i] } else { 0 };
                        d[..8].copy_from_slice(&sv.to_le_bytes());
                        d[8..].copy_from_slice(&dst.to_le_bytes());
                    }
                }
                tracing::debug!(
                    ticket,
                    misses = misses.len(),
                    queued_us = (job_started - started).as_micros() as u64,
                    pin_us,
                    "GPU restore: descriptors ready"
                );
                ready.set();
                // Before the table can go back to the pool (its drop sets the flag).
                drop(ready);
                let r = c.wait_event(&event);
                tracing::debug!(ticket, ok = r.is_ok(), "GPU restore: copy done");
                if let Err(e) = r {
                    tracing::error!("GPU restore of ticket {ticket} failed: {e}");
                    for r in results.iter_mut() {
                        *r = Err(CascadeError::RegionFault(format!("GPU copy failed: {e}")));
                    }
                }
                drop(pins);
                s.ctl.gpu_pool.give(table, own_stream, Some(staging));
                s.ctl.gpu_pool.give_device(staged_descs);
                s.complete(Command::Restore, ticket, started, results);
            }),
        );
        // Held until the job is queued: jobs of the ordered stream reach
        // the executor in stream order, so a job never waits (on its event)
        // for a copy whose flag only a job queued behind it would set.
        drop(ordered);
        Ok(reply)
    }

    /// A STORE from CUDA regions. The gather kernel copies the batch, at
    /// most GPU_STORE_CHUNK bytes at a time, from device memory straight
    /// into T1 slots (device-mapped; see Cascade::claim_slots) where it can,
    /// else into pinned staging, whose groups are then written into T1
    /// (write-back). All memory is taken here, on admission (see
    /// submit_gpu_restore); the job only enqueues and waits.
    fn submit_gpu_store(self: &Arc<Session>, work: Batch) -> Result<Reply, Rejection> {
        let c = crate::gpu::cuda::cuda()
            .ok_or_else(|| reject(libc::ENODEV, NO_ENTRY, "no CUDA driver"))?;
        let layout = self.ctl.cascade.layout();
        let (gb, stride) = (layout.group_bytes(), layout.stride() as usize);
        let chunk = (GPU_STORE_CHUNK / stride).clamp(1, work.len().max(1));
        let fail = |e: String| {
            reject(
                libc::EIO,
                NO_ENTRY,
                format!("cannot start the GPU store: {e}"),
            )
        };
        let pool = &self.ctl.gpu_pool;
        let table = pool.take_table(chunk).map_err(|e| fail(e.to_string()))?;
        let table_dev = table
            .device_ptr()
            .ok_or_else(|| fail("the descriptor table is not device-mapped".into()))?;
        let staging = pool
            .take_staging(chunk * stride)
            .map_err(|e| fail(e.to_string()))?;
        let staging_dev = staging
            .device_ptr()
            .ok_or_else(|| fail("staging is not device-mapped".into()))?;
        let staged_descs = pool.take_device(16 * chunk).map_err(fail)?;
        let event = pool.take_event().map_err(fail)?;
        let stream = pool.take_stream().map_err(fail)?;
        // Nothing to wait for: the descriptors are written before each launch.
        drop(ReadyFlag(table.as_ptr().cast::<u32>()));
        let ticket = self.new_ticket();
        let s = self.clone();
        let started = Instant::now();
        tracing::debug!(ticket, n = work.len(), chunk, "GPU store submitted");
        self.ctl.exec.submit_ticket(
            self,
            ticket,
            Box::new(move || {
                let (mut table, mut staging) = (table, staging);
                let cascade = &s.ctl.cascade;
                let mut results: Vec<Result<(), CascadeError>> = Vec::with_capacity(work.len());
                for items in work.items.chunks(chunk) {
                    let groups: Vec<GroupIndex> = items.iter().map(|it| it.g).collect();
                    // The kernel writes straight into T1 slots where it can
                    // (groups new to T1, or in it and clean); the rest land
                    // in staging and are written after. A batch naming a
                    // group twice goes through staging, in order.
                    let mut sorted: Vec<u64> = groups.iter().map(|g| g.0).collect();
                    sorted.sort_unstable();
                    let slots = sorted
                        .windows(2)
                        .all(|w| w[0] != w[1])
                        .then(|| cascade.claim_slots(&groups, true));
                    let direct: Vec<Option<u64>> = (0..items.len())
                        .map(|i| slots.as_ref().and_then(|w| w.device_addr(i)))
                        .collect();
                    for (d, (i, it)) in table.as_mut_slice()[16..16 + 16 * items.len()]
                        .chunks_exact_mut(16)
                        .zip(items.iter().enumerate())
                    {
                        // Admission made every region of a CUDA batch a CUDA
                        // region and checked offset + group_bytes inside it.
                        let src = work.region(it).device_addr(it.offset).unwrap_or(0);
                        let dst = direct[i].unwrap_or(staging_dev + (i * stride) as u64);
                        d[..8].copy_from_slice(&src.to_le_bytes());
                        d[8..].copy_from_slice(&dst.to_le_bytes());
                    }
                    // SAFETY: the table, staging and staged_descs live until
                    // this job returns, after the event; every descriptor
                    // names a checked range of a live CUDA region (the batch
                    // holds it) and either a staging slot of `stride` ≥ gb
                    // bytes or a T1 slot write-locked in `slots` until then.
                    let r = unsafe {
                        c.enqueue_gather(
                            &stream,
                            table_dev,
                            table.as_ptr().add(16),
                            &staged_descs,
                            items.len() as u32,
                            gb,
                            &event,
                        )
                    }
                    .and_then(|()| c.wait_event(&event));
                    if let Err(e) = r {
                        // Dropping `slots` gives back the claimed slots.
                        tracing::error!("GPU store of ticket {ticket} failed: {e}");
                        results.extend(items.iter().map(|_| {
                            Err(CascadeError::RegionFault(format!("GPU copy failed: {e}")))
                        }));
                        continue;
                    }
                    if let Some(w) = slots {
                        w.commit();
                    }
                    let data = staging.as_mut_slice();
                    let staged: Vec<usize> =
                        (0..items.len()).filter(|&i| direct[i].is_none()).collect();
                    let gs: Vec<GroupIndex> = staged.iter().map(|&i| groups[i]).collect();
                    let mut rs: Vec<Result<(), CascadeError>> =
                        (0..items.len()).map(|_| Ok(())).collect();
                    for (&i, r) in staged.iter().zip(cascade.write_groups(&gs, |k, dst| {
                        dst.copy_from_slice(&data[staged[k] * stride..][..gb as usize]);
                        Ok(())
                    })) {
                        rs[i] = r;
                    }
                    tracing::debug!(
                        ticket,
                        n = items.len(),
                        in_place = items.len() - staged.len(),
                        "GPU store: chunk done"
                    );
                    s.changed(&groups, &rs);
                    results.extend(rs);
                }
                s.ctl.gpu_pool.give(table, Some(stream), Some(staging));
                s.ctl.gpu_pool.give_device(staged_descs);
                drop(event);
                s.complete(Command::Store, ticket, started, results);
            }),
        );
        Ok(Reply::ok(Command::Store, ticket))
    }

    fn query(&self, keys: &[RawKey]) -> Result<Reply, Rejection> {
        let gs: Vec<GroupIndex> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| self.key_index(i, k))
            .collect::<Result<_, _>>()?;
        let mut r = Reply::ok(Command::Query, gs.len() as u64);
        for (i, g) in gs.iter().enumerate() {
            let q = self
                .ctl
                .cascade
                .query(*g)
                .map_err(|e| reject(libc::EIO, i as u32, format!("entry {i}: {e}")))?;
            r.states.push(StateEntry {
                state: match q.residence {
                    Residence::Empty => wire::STATE_EMPTY,
                    Residence::Backing => wire::STATE_BACKING,
                    Residence::T1 => wire::STATE_T1,
                },
                dirty: q.dirty,
                crc: q.backing_crc.unwrap_or(0),
            });
        }
        Ok(r)
    }

    fn prefetch(self: &Arc<Session>, keys: &[RawKey]) -> Result<Reply, Rejection> {
        let gs: Vec<GroupIndex> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| self.key_index(i, k))
            .collect::<Result<_, _>>()?;
        let ticket = self.new_ticket();
        let s = self.clone();
        self.ctl.exec.submit_ticket(
            self,
            ticket,
            Box::new(move || {
                let results = gs.iter().map(|g| s.ctl.cascade.prefetch(*g)).collect();
                s.finish(ticket, results);
            }),
        );
        Ok(Reply::ok(Command::Prefetch, ticket))
    }
}
