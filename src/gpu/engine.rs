//! The GPU transfer engine: moves groups between pinned host memory (T1
//! slots, staging) and device memory, in batches, by the gather kernel.
//!
//! Callers hand it resolved copies: `Descriptor { src, dst }` pairs of
//! device-visible addresses (a device-mapped T1 slot or staging slot on one
//! side, a CUDA region's bytes on the other), `bytes` each. It owns what
//! the copies need and pools it, since creating streams, events and pinned
//! memory per ticket would cost more than the copies: descriptor tables
//! (pinned and device-mapped, with a ready flag: the kernel reads its
//! descriptors from there), pinned staging, streams and IPC events.
//!
//! A restore is enqueued before its sources are known (`Engine::restore`):
//! the stream waits on the table's ready flag, so the client can be given
//! the ticket's IPC event at once; the caller then resolves each copy,
//! fills the table and `finish`es, which sets the flag and waits for the
//! copy. Every path sets the flag (a dropped `Restore` too), so no stream
//! waits forever. Such a restore may be enqueued in parts (`restore`'s
//! `ends`), each waiting for its own value of the flag
//! (`Restore::let_through`), so the first copies while the caller
//! resolves the next. A restore whose sources are known at once
//! (`Engine::restore_now`) is described first and enqueued with no flag.
//! Copies that join into runs go to the copy engines instead (`runs`).
//! A store (`Engine::store`) fills and launches one chunk at
//! a time and waits for each. Nothing here knows of the cascade: pins and
//! slot claims are the caller's, held until `finish`/`launch` return.
//!
//! Strided entries arrive as more, smaller copies (a descriptor a row);
//! several devices would go behind the same calls.

use super::HostBuf;
use super::cuda::{Cuda, IpcEvent, Rows, Signal, Stream};
use parking_lot::{Mutex, MutexGuard};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

mod parted;
mod runs;
pub use parted::PartedRestore;
pub use runs::{DirectRestore, Runs};

/// Pooled buffers kept per kind.
const POOL_KEEP: usize = 16;

/// A store moves at most this many bytes of groups per launch: the size
/// of a restore's staging, so both draw on one pool.
pub const STORE_CHUNK: usize = 16 << 20;

/// Bytes before the descriptors in a table: the u32 ready flag, padded so
/// the descriptors stay 16-byte aligned.
const FLAG_BYTES: usize = 16;

/// Bytes of one descriptor in a table: {src u64, dst u64}.
const DESCRIPTOR_BYTES: usize = 16;

/// One copy of `bytes` bytes between device-visible addresses; `src` 0
/// skips it (an entry that failed before the copy).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub src: u64,
    pub dst: u64,
}

/// An IPC event, back to the pool once dropped: a ticket keeps it until
/// it is both done and collected (a client opens the handle any time
/// before it collects). A client still waiting on an old handle after that
/// waits on a later ticket's copy: later, never earlier, than its own.
pub struct PooledEvent {
    ev: Option<IpcEvent>,
    pool: Arc<Mutex<Vec<IpcEvent>>>,
}

impl std::ops::Deref for PooledEvent {
    type Target = IpcEvent;
    fn deref(&self) -> &Self::Target {
        self.ev.as_ref().expect("an event until dropped")
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        let mut p = self.pool.lock();
        if p.len() < POOL_KEEP * 4 {
            p.extend(self.ev.take());
        }
    }
}

impl PooledEvent {
    /// The exported handle as hex: what a client opens
    /// (`torch.cuda.Event.from_ipc_handle`).
    pub fn handle_hex(&self) -> String {
        self.handle.iter().map(|x| format!("{x:02x}")).collect()
    }
}

/// Sets a ticket's ready flag (a u32 in pinned memory the stream waits
/// on); dropping it sets it too, so no stream ever waits forever. An
/// armed flag holds a window (`cuda::open_window`) from before its stream
/// is told to wait until it is set, so no driver call that waits for the
/// device runs meanwhile.
struct ReadyFlag {
    flag: *mut u32,
    window: bool,
}
// SAFETY: the flag lives in the ticket's table, which its owner keeps.
unsafe impl Send for ReadyFlag {}

/// The flag's value that lets every part through. A stream's wait for
/// value v (`cuStreamWaitValue32`, GEQ) passes once `(flag - v) as i32`
/// is not negative, a cyclic comparison: u32::MAX would read as -2
/// against a wait for 1 and hold the copy forever (it did, in the first
/// GPU run of 1304e29), so the largest value positive as an i32.
const ALL_PARTS: u32 = i32::MAX as u32;

/// Whether a stream waiting for `value` goes on with the flag at `flag`
/// (the driver's GEQ comparison, as documented for `cuStreamWaitValue32`).
#[cfg(test)]
fn passes(flag: u32, value: u32) -> bool {
    flag.wrapping_sub(value) as i32 >= 0
}

impl ReadyFlag {
    /// A flag a stream is about to wait on.
    fn armed(flag: *mut u32) -> ReadyFlag {
        super::cuda::open_window();
        ReadyFlag { flag, window: true }
    }

    /// A flag no stream waits on.
    fn unarmed(flag: *mut u32) -> ReadyFlag {
        ReadyFlag {
            flag,
            window: false,
        }
    }

    /// Lets every part of the copy run (their waits are for 1, 2, …).
    fn set(&mut self) {
        self.let_through(ALL_PARTS);
        if std::mem::take(&mut self.window) {
            super::cuda::close_window();
        }
    }

    /// Lets the first `parts` parts of the copy run, the window kept open
    /// for the rest.
    fn let_through(&mut self, parts: u32) {
        std::sync::atomic::fence(Ordering::SeqCst);
        // SAFETY: the pointer is the first word of a live pinned table.
        unsafe { std::ptr::write_volatile(self.flag, parts) };
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

impl Drop for ReadyFlag {
    fn drop(&mut self) {
        self.set();
    }
}

/// Work for the completion thread (see `Engine::then`).
pub type Completion = Box<dyn FnOnce() + Send>;

/// Reused GPU resources of one device.
#[derive(Default)]
struct Pool {
    /// The device (its context: `cuda::cuda_on`).
    dev: i32,
    events: Arc<Mutex<Vec<IpcEvent>>>,
    streams: Mutex<Vec<Stream>>,
    tables: Mutex<Vec<HostBuf>>,
    staging: Mutex<Vec<HostBuf>>,
    reaper: OnceLock<Mutex<std::sync::mpsc::Sender<Box<dyn Send>>>>,
    completer: OnceLock<Mutex<std::sync::mpsc::Sender<Completion>>>,
}

/// The smallest of `bufs` that holds `len` bytes.
fn best_fit(bufs: &[HostBuf], len: usize) -> Option<usize> {
    (bufs.iter().enumerate())
        .filter(|(_, b)| b.len() >= len)
        .min_by_key(|(_, b)| b.len())
        .map(|(i, _)| i)
}

impl Pool {
    fn driver(&self) -> Result<&'static Cuda, String> {
        super::cuda::cuda_on(self.dev)
    }

    fn take_event(&self) -> Result<PooledEvent, String> {
        // Not under the pool's lock: creating an event takes the driver's.
        let pooled = self.events.lock().pop();
        let ev = match pooled {
            Some(e) => e,
            None => self.driver()?.new_ipc_event()?,
        };
        Ok(PooledEvent {
            ev: Some(ev),
            pool: self.events.clone(),
        })
    }

    /// A table for `n` descriptors, its ready flag clear.
    fn take_table(&self, n: usize) -> Result<HostBuf, String> {
        let need = FLAG_BYTES + DESCRIPTOR_BYTES * n;
        let mut t = self.tables.lock();
        if let Some(i) = best_fit(&t, need) {
            let mut b = t.swap_remove(i);
            // The flag only: every descriptor is written before it is set.
            b.as_mut_slice()[..FLAG_BYTES].fill(0);
            return Ok(b);
        }
        drop(t);
        HostBuf::alloc(need.next_power_of_two().max(4096)).map_err(|e| e.to_string())
    }

    fn take_staging(&self, len: usize) -> Result<HostBuf, String> {
        let mut t = self.staging.lock();
        if let Some(i) = best_fit(&t, len) {
            return Ok(t.swap_remove(i));
        }
        drop(t);
        HostBuf::alloc(len.next_power_of_two().max(4096)).map_err(|e| e.to_string())
    }

    fn take_stream(&self) -> Result<Stream, String> {
        if let Some(s) = self.streams.lock().pop() {
            return Ok(s);
        }
        self.driver()?.new_stream()
    }

    /// Drops GPU memory (pinned or device) on a thread of its own: a
    /// free waits for the device to go idle (and, in `cuda::quietly`, for
    /// every open ready flag to be set), and an executor thread must never
    /// wait on a stream that may be waiting on a job still queued behind it.
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

    /// Keeps `b` for reuse; a full pool keeps its largest buffers (the
    /// smallest goes, `b` or one kept), so the big tables and staging of
    /// 16 MiB tickets are found again whatever smaller ones came before:
    /// a miss allocates pinned memory, which waits for every ready flag
    /// in flight (`cuda::quietly`), and a free waits the same way.
    fn give_host(&self, list: &Mutex<Vec<HostBuf>>, b: HostBuf) {
        let mut t = list.lock();
        if t.len() < POOL_KEEP {
            t.push(b);
            return;
        }
        let out = match t.iter().enumerate().min_by_key(|(_, k)| k.len()) {
            Some((i, k)) if k.len() < b.len() => std::mem::replace(&mut t[i], b),
            _ => b,
        };
        drop(t);
        self.free_later(Box::new(out));
    }

    fn give_stream(&self, stream: Option<Stream>) {
        self.streams.lock().extend(stream);
    }

    fn give(&self, table: HostBuf, stream: Option<Stream>, staging: Option<HostBuf>) {
        self.give_host(&self.tables, table);
        self.give_stream(stream);
        if let Some(staging) = staging {
            self.give_host(&self.staging, staging);
        }
    }
}

/// The transfer engine of one device: its streams, events, kernels,
/// descriptor tables and completion thread.
#[derive(Default)]
pub struct Engine {
    pool: Arc<Pool>,
}

/// The engines of a process, one a device, each made on first use.
#[derive(Default)]
pub struct Engines(Mutex<Vec<Arc<Engine>>>);

impl Engines {
    /// The engine of CUDA device `device` (whose context `cuda::cuda_on`
    /// has opened).
    pub fn on(&self, device: i32) -> Arc<Engine> {
        let mut v = self.0.lock();
        if let Some(e) = v.iter().find(|e| e.pool.dev == device) {
            return e.clone();
        }
        let e = Arc::new(Engine {
            pool: Arc::new(Pool {
                dev: device,
                ..Pool::default()
            }),
        });
        v.push(e.clone());
        e
    }
}

/// An ordered stream: copies enqueued on it run in submission order (a
/// client's T1-resident restores, so its oldest ticket finishes first).
/// Its stream goes back to the engine's pool when the lane is dropped.
pub struct Lane {
    stream: Mutex<Option<Stream>>,
    pool: Arc<Pool>,
    /// Tickets on the lane whose copy is not yet done (see `enter`).
    busy: Arc<AtomicUsize>,
}

/// A ticket counted on its lane until dropped (after its copy is done).
pub struct OnLane(Arc<AtomicUsize>);

impl Drop for OnLane {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// A held lane: enqueues on it stay in the order they are made while it
/// is held, so the holder can also queue the work that releases them in
/// that same order.
pub struct LaneGuard<'a>(MutexGuard<'a, Option<Stream>>);

impl Lane {
    pub fn lock(&self) -> LaneGuard<'_> {
        LaneGuard(self.stream.lock())
    }

    /// Counts a ticket on the lane until the guard drops.
    pub fn enter(&self) -> OnLane {
        self.busy.fetch_add(1, Ordering::Acquire);
        OnLane(self.busy.clone())
    }

    /// Tickets on the lane whose copy is not yet done.
    pub fn busy(&self) -> usize {
        self.busy.load(Ordering::Acquire)
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // Its owner enqueues nothing more on it.
        if let Some(s) = self.stream.get_mut().take() {
            self.pool.streams.lock().push(s);
        }
    }
}

/// A restore enqueued and waiting for its descriptors (see the module note).
pub struct Restore {
    /// First field: dropped (the flag set) before the table can go.
    ready: ReadyFlag,
    c: &'static Cuda,
    n: usize,
    stride: usize,
    table: Option<HostBuf>,
    /// `staging_slots` slots; None for a restore taken with none.
    staging: Option<HostBuf>,
    staging_slots: usize,
    own_stream: Option<Stream>,
    event: Arc<PooledEvent>,
    pool: Arc<Pool>,
    finished: bool,
    /// Where the parts of a copy waiting on its flag end (`restore`).
    ends: Vec<usize>,
    /// Descriptors of the parts let through (`let_through`).
    through: usize,
}

/// A store's resources, reused for each chunk it launches.
pub struct Store {
    c: &'static Cuda,
    chunk: usize,
    /// Copies a group (rows of `unit` bytes).
    per: usize,
    stride: usize,
    bytes: u64,
    unit: u64,
    rows: Option<Rows>,
    table: Option<HostBuf>,
    table_dev: u64,
    staging: Option<HostBuf>,
    staging_dev: u64,
    stream: Option<Stream>,
    /// One a part of a chunk (see `enqueue`).
    events: Vec<PooledEvent>,
    pool: Arc<Pool>,
}

impl Engine {
    /// Runs `f` on the engine's completion thread, after every `f` given
    /// before it: for work that waits on copies already free to run (their
    /// descriptors written, their flags set) and then lets go of what
    /// they held. It must not wait on anything else, so nothing it waits
    /// for can be queued behind it.
    pub fn then(&self, f: Completion) {
        let tx = self.pool.completer.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<Completion>();
            std::thread::Builder::new()
                .name("kvfs-gpu-done".into())
                .spawn(move || {
                    for f in rx {
                        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
                            tracing::error!("a GPU completion panicked");
                        }
                    }
                })
                .expect("cannot start the GPU completion thread");
            Mutex::new(tx)
        });
        let _ = tx.lock().send(f);
    }

    /// The device this engine serves.
    pub fn device(&self) -> i32 {
        self.pool.dev
    }

    /// An ordered stream for one client.
    pub fn lane(&self) -> Lane {
        Lane {
            stream: Mutex::new(None),
            pool: self.pool.clone(),
            busy: Arc::default(),
        }
    }

    /// Enqueues a restore of `n` copies of `bytes` each (their
    /// destinations laid out as `rows`, if given): on `lane` (held
    /// by the caller) or, with None, on a stream of its own that holds up
    /// no other ticket. `stride` ≥ bytes spaces its staging slots, of
    /// which there are `staging_slots` (0 when every source is already
    /// device-visible, e.g. pinned T1 slots). Everything the copy needs is taken here,
    /// before the stream is told to wait: pinning memory makes CUDA wait
    /// for the device to go idle, and the device then waits on this
    /// restore's flag, which only `finish` (or drop) sets. With `descs`
    /// (all the copies, known now), see `restore_now`. Without, the copy
    /// is enqueued in parts ending at `ends` (ascending, the last `n`;
    /// empty: one part), each let through by `let_through` once its
    /// descriptors are written, so the first copies while the host looks
    /// up the next.
    #[expect(clippy::too_many_arguments, reason = "one restore, all its parts")]
    pub fn restore(
        &self,
        n: usize,
        bytes: u64,
        stride: usize,
        staging_slots: usize,
        rows: Option<Rows>,
        lane: Option<&mut LaneGuard<'_>>,
        descs: Option<&mut dyn Iterator<Item = Descriptor>>,
        after: Option<&IpcEvent>,
        signal: Signal,
        ends: &[usize],
    ) -> Result<Restore, String> {
        let c = self.pool.driver()?;
        let pool = &self.pool;
        let t0 = std::time::Instant::now();
        let mut table = pool.take_table(n)?;
        let table_dev = table
            .device_ptr()
            .ok_or("the descriptor table is not device-mapped")?;
        let staging = match staging_slots {
            0 => None,
            k => Some(pool.take_staging(k * stride)?),
        };
        let event = Arc::new(pool.take_event()?);
        let own_stream = match lane {
            Some(_) => None,
            None => Some(pool.take_stream()?),
        };
        let now = descs.is_some();
        let t1 = std::time::Instant::now();
        if let Some(descs) = descs {
            write_descriptors(&mut table, n, descs);
        }
        let t2 = std::time::Instant::now();
        let whole = [n];
        let ends = match ends.is_empty() || now {
            true => &whole[..],
            false => ends,
        };
        assert!(
            ends.windows(2).all(|w| w[0] < w[1]) && ends.last() == Some(&n),
            "parts ascend and end at n"
        );
        let flag = table.as_ptr().cast::<u32>();
        let r = Restore {
            ready: match now {
                true => ReadyFlag::unarmed(flag),
                false => ReadyFlag::armed(flag),
            },
            c,
            n,
            stride,
            table: Some(table),
            staging,
            staging_slots,
            own_stream,
            event,
            pool: pool.clone(),
            finished: false,
            ends: ends.to_vec(),
            through: 0,
        };
        // From here a failure drops `r`, which sets the flag, so whatever
        // was enqueued does not wait forever.
        let stream = match (&r.own_stream, lane) {
            (Some(s), _) => s,
            (None, Some(LaneGuard(slot))) => match &mut **slot {
                Some(s) => s,
                slot => slot.insert(pool.take_stream()?),
            },
            (None, None) => unreachable!("a stream was taken above"),
        };
        if let Some(after) = after {
            c.stream_wait_event(stream, after)?;
        }
        let enqueue = || {
            let mut at = 0;
            for (k, &end) in ends.iter().enumerate() {
                // SAFETY: the table holds FLAG_BYTES + DESCRIPTOR_BYTES × n
                // bytes (take_table), device-mapped; it lives in `r` until
                // the event completes (finish, or drop); every descriptor
                // of part k is written before the flag reaches k + 1
                // (`let_through`, `start`), or (now) before this call.
                unsafe {
                    c.enqueue_gather_part(
                        stream,
                        (!now).then_some((table_dev, k as u32 + 1)),
                        table_dev + (FLAG_BYTES + DESCRIPTOR_BYTES * at) as u64,
                        (end - at) as u32,
                        bytes,
                        rows,
                    )
                }?;
                at = end;
            }
            c.enqueue_end(stream, signal, &r.event)
        };
        let e = enqueue();
        // Where a launch's time goes: the pooled table, event and stream;
        // the descriptors; the driver's enqueue.
        if now {
            tracing::debug!(
                n,
                take_us = (t1 - t0).as_micros() as u64,
                describe_us = (t2 - t1).as_micros() as u64,
                enqueue_us = t2.elapsed().as_micros() as u64,
                "GPU restore launched"
            );
        }
        e.map(|()| r)
    }

    /// `restore` of copies known now (pinned T1 slots): `descs` (n of
    /// them) are written first and the copy enqueued with no flag to wait
    /// on, so nothing but the kernel stands between it and the copy
    /// before. Not to be `describe_at`d again (the kernel may be reading the
    /// table); `start` is not needed.
    pub fn restore_now(
        &self,
        n: usize,
        bytes: u64,
        rows: Option<Rows>,
        lane: &mut LaneGuard<'_>,
        mut descs: impl Iterator<Item = Descriptor>,
        signal: Signal,
    ) -> Result<Restore, String> {
        let stride = bytes as usize;
        self.restore(
            n,
            bytes,
            stride,
            0,
            rows,
            Some(lane),
            Some(&mut descs),
            None,
            signal,
            &[],
        )
    }

    /// Takes what a store of `n` groups of `bytes` each needs, each moved
    /// as `bytes / unit` copies of `unit` bytes (pieces of rows), or as
    /// one copy whose source is laid out as `rows`: one chunk of at
    /// most STORE_CHUNK bytes of staging (slots `stride` apart), its
    /// table and stream, and an event for each of up to `parts` launches
    /// in flight at once. All memory is taken here, on admission (see
    /// `restore`); launches only enqueue and wait.
    pub fn store(
        &self,
        n: usize,
        bytes: u64,
        stride: usize,
        unit: u64,
        rows: Option<Rows>,
        parts: usize,
    ) -> Result<Store, String> {
        let c = self.pool.driver()?;
        let pool = &self.pool;
        let chunk = (STORE_CHUNK / stride).clamp(1, n.max(1));
        let per = (bytes / unit) as usize;
        let table = pool.take_table(chunk * per)?;
        let table_dev = table
            .device_ptr()
            .ok_or("the descriptor table is not device-mapped")?;
        let staging = pool.take_staging(chunk * stride)?;
        let staging_dev = staging.device_ptr().ok_or("staging is not device-mapped")?;
        let events = (0..parts.max(1))
            .map(|_| pool.take_event())
            .collect::<Result<Vec<_>, _>>()?;
        let stream = pool.take_stream()?;
        // Nothing to wait for: the descriptors are written before each launch.
        drop(ReadyFlag::unarmed(table.as_ptr().cast::<u32>()));
        Ok(Store {
            c,
            chunk,
            per,
            stride,
            bytes,
            unit,
            rows,
            table: Some(table),
            table_dev,
            staging: Some(staging),
            staging_dev,
            stream: Some(stream),
            events,
            pool: pool.clone(),
        })
    }
}

/// Writes `n` descriptors into `table` after its flag: those of `descs`
/// in order, any left over skipped (src 0).
fn write_descriptors(table: &mut HostBuf, n: usize, descs: impl Iterator<Item = Descriptor>) {
    write_descriptors_at(table, 0, n, descs)
}

/// `write_descriptors` into places `at..at + n` of the table.
fn write_descriptors_at(
    table: &mut HostBuf,
    at: usize,
    n: usize,
    descs: impl Iterator<Item = Descriptor>,
) {
    let first = FLAG_BYTES + DESCRIPTOR_BYTES * at;
    let out = &mut table.as_mut_slice()[first..first + DESCRIPTOR_BYTES * n];
    let mut slots = out.chunks_exact_mut(DESCRIPTOR_BYTES);
    for (d, Descriptor { src, dst }) in slots.by_ref().zip(descs) {
        d[..8].copy_from_slice(&src.to_le_bytes());
        d[8..].copy_from_slice(&dst.to_le_bytes());
    }
    for d in slots {
        d.fill(0);
    }
}

impl Restore {
    /// The ticket's event, recorded after the copy: the client's stream
    /// waits on it. Keep it until the ticket is collected.
    pub fn event(&self) -> &Arc<PooledEvent> {
        &self.event
    }

    /// All staging slots at once (slot k at `k × stride`), with the
    /// device address of the first; empty for a restore taken with none.
    pub fn staging(&mut self) -> (&mut [u8], Option<u64>) {
        match self.staging.as_mut() {
            Some(s) => {
                let dev = s.device_ptr();
                (
                    &mut s.as_mut_slice()[..self.staging_slots * self.stride],
                    dev,
                )
            }
            None => (&mut [], None),
        }
    }

    /// Writes descriptors `at..at + n` (those of `descs`, any left over
    /// zero: skipped), the places of parts about to be let through.
    pub fn describe_at(&mut self, at: usize, n: usize, descs: impl Iterator<Item = Descriptor>) {
        let table = self.table.as_mut().expect("until finished");
        assert!(at + n <= self.n, "places of the n copies taken");
        write_descriptors_at(table, at, n, descs);
    }

    /// Lets the first `parts` parts of the copy run (`restore`'s `ends`),
    /// their descriptors written (`describe_at`); `start` lets the rest.
    pub fn let_through(&mut self, parts: usize) {
        self.through = self.ends[parts - 1];
        self.ready.let_through(parts as u32);
    }

    /// Lets the copy run once its descriptors are written (`describe_at`);
    /// `finish` then waits for it.
    pub fn start(&mut self) {
        self.ready.set();
    }

    /// Lets the copy run (sets the flag), waits for it, and gives the
    /// resources back; the caller's pins may go once this returns.
    pub fn finish(mut self) -> Result<(), String> {
        self.ready.set();
        self.finished = true;
        let r = self.c.wait_event(&self.event);
        self.release();
        r
    }

    fn release(&mut self) {
        if let Some(t) = self.table.take() {
            let s = self.staging.take();
            self.pool.give(t, self.own_stream.take(), s);
        }
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        if !self.finished {
            // An unfinished restore (its caller failed): let the enqueued
            // copy run and wait for it before its memory is reused. Where
            // its stream still waits on the flag, descriptors not yet
            // written may be a pooled table's old ones: all are zeroed
            // first (a zero source is skipped), so the copy writes nothing
            // it was not told to (parts let through may lose copies; the
            // ticket fails anyway).
            if self.ready.window
                && let Some(t) = self.table.as_mut()
            {
                // Past the parts let through, whose copies may be running.
                let from = self.through;
                write_descriptors_at(t, from, self.n - from, std::iter::empty());
            }
            self.ready.set();
            let _ = self.c.wait_event(&self.event);
            self.release();
        }
    }
}

impl Store {
    /// Copies a launch moves at most.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// The device address of staging slot `i` (< chunk).
    pub fn staging_addr(&self, i: usize) -> u64 {
        self.staging_dev + (i * self.stride) as u64
    }

    /// The bytes a launch left in staging slot `i`.
    pub fn staged(&self, i: usize) -> &[u8] {
        let s = self.staging.as_ref().expect("until dropped");
        &s.as_slice()[i * self.stride..][..self.bytes as usize]
    }

    /// Launches the copies `descs` (of `unit` bytes each) from place `at`
    /// of the table on, as part `part` (< the store's `parts`), without
    /// waiting: `wait(part)` does. Parts run in the order launched; the
    /// places of a chunk's parts in flight at once must not overlap, and
    /// the last must end by `chunk` groups' worth.
    ///
    /// # Safety
    /// Every descriptor names `unit` readable device-visible bytes at
    /// `src` and writable ones at `dst` (in a staging slot, or memory the
    /// caller holds for writing until `wait(part)` returns), 16-byte
    /// aligned; no part in flight used these places of the table.
    pub unsafe fn enqueue(
        &mut self,
        part: usize,
        at: usize,
        descs: &[Descriptor],
    ) -> Result<(), String> {
        assert!(
            at + descs.len() <= self.chunk * self.per,
            "a chunk of at most chunk groups"
        );
        let table = self.table.as_mut().expect("until dropped");
        write_descriptors_at(table, at, descs.len(), descs.iter().copied());
        // SAFETY: the table and staging live in `self` until it drops,
        // after the wait; the descriptors, written above, are the
        // caller's contract.
        unsafe {
            self.c.enqueue_gather(
                self.stream.as_ref().expect("until dropped"),
                None,
                self.table_dev + (FLAG_BYTES + DESCRIPTOR_BYTES * at) as u64,
                descs.len() as u32,
                self.unit,
                self.rows,
                None,
                &self.events[part],
            )
        }
    }

    /// Waits for part `part`'s copies (and every part launched before it).
    pub fn wait(&self, part: usize) -> Result<(), String> {
        self.c.wait_event(&self.events[part])
    }

    /// Parts a chunk may have in flight at once.
    pub fn parts(&self) -> usize {
        self.events.len()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let (Some(t), Some(s)) = (self.table.take(), self.staging.take()) {
            self.pool.give(t, self.stream.take(), Some(s));
        }
    }
}

#[cfg(test)]
mod tests;
