//! The cascade: T1, a bounded write-back cache of group slots, over a backing tier.
//!
//! T1 is one `HostBuf` cut into `stride`-sized slots (aligned for O_DIRECT, so
//! write-back and fills go straight from and into slots). A state lock holds
//! the group → slot map, the replacement policy, the free list and per-slot
//! states; it is held only for lookups and bookkeeping, never across a copy
//! or an I/O. Copies run under a per-slot RwLock, taken only by a thread
//! that holds a pin on the slot, and pins are only added under the state
//! lock: so under that lock a slot with no pins has no lock holder, and is
//! the only kind of slot that may be chosen as a victim or reused.
//!
//! Invariants: (1) the cascade is bit-identical to its backing alone (the
//! property test checks it against a HashMap); (2) a slot is never
//! overwritten while a copy out of it runs (the copy holds the slot's read
//! lock; a reuse needs its write lock); (3) a dirty victim reaches the
//! backing before its slot is reused, and if that write fails the victim
//! stays resident and dirty and the caller gets the error; (4) drop flushes
//! every dirty group, `flush`/`sync_all` make data durable on return;
//! (5) backing bytes that fail their crc32c are never served. Backing I/O
//! of one group is serialised by a striped lock, so a miss never reads a
//! group's data and metadata halfway through its write-back.

mod meta;
mod policy;
mod store;

pub use meta::{GroupMeta, META_RECORD_BYTES, MetaTable};
pub use policy::{Lru, Policy, PolicyKind, Sieve};
pub use store::{Backing, BackingConfig, StoreError};

use crate::geometry::{GroupIndex, GroupLayout, OutOfRange};
use crate::gpu::HostBuf;
use crate::tier::{Tier, TierError, WriteOp, copy_index};
use parking_lot::{Condvar, Mutex, MutexGuard, RwLock, RwLockWriteGuard};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

/// Index of a T1 slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

/// Backing I/O stripes: enough that unrelated groups rarely share one, few
/// enough that the array is a few pages.
const STRIPES: usize = 1024;

/// Groups written back per batch by `sync_all`: deep enough to keep an NVMe
/// queue busy, small enough that writers are not held off long.
const SYNC_BATCH: usize = 256;

/// Staging buffers kept for misses; more are made on demand and dropped.
const STAGING_KEEP: usize = 64;

/// `slot_tag` value of a slot that holds no group.
const NO_GROUP: u64 = u64::MAX;

#[derive(Debug, thiserror::Error)]
pub enum CascadeError {
    #[error(transparent)]
    Tier(#[from] TierError),
    #[error(
        "group {index} failed its checksum (stored {stored:08x}, read {computed:08x}); its bytes are not served"
    )]
    Checksum {
        index: GroupIndex,
        stored: u32,
        computed: u32,
    },
    #[error("bytes {offset}..{end} are outside the group ({group_bytes} bytes)")]
    OutOfBounds {
        offset: u64,
        end: u64,
        group_bytes: u64,
    },
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
    #[error("metadata sync failed: {0}")]
    MetaSync(#[source] io::Error),
    #[error("region file {0} shrank under the copy; its bytes were not moved")]
    RegionFault(String),
    #[error("internal error: {0}")]
    Internal(String),
    #[error("T1 needs room for at least one group ({stride} bytes), got {t1_bytes}")]
    T1TooSmall { t1_bytes: u64, stride: u64 },
    #[error("cannot allocate T1 ({bytes} bytes): {source}")]
    Alloc {
        bytes: u64,
        #[source]
        source: io::Error,
    },
}

impl CascadeError {
    /// The errno this error means, at every boundary that speaks errno (the
    /// FUSE replies in `fs`, completion records of the control file).
    pub fn errno(&self) -> i32 {
        match self {
            CascadeError::Tier(t) => match t {
                TierError::Io { source, .. } | TierError::Sync(source) => {
                    source.raw_os_error().unwrap_or(libc::EIO)
                }
                TierError::Short { .. } => libc::EIO,
                TierError::OutOfRange { .. } => libc::EINVAL,
                TierError::BadBuffer { .. } => libc::EINVAL,
            },
            CascadeError::Checksum { .. } => libc::EIO,
            CascadeError::OutOfBounds { .. } => libc::EFBIG,
            CascadeError::OutOfRange(_) => libc::ENOENT,
            CascadeError::MetaSync(source) => source.raw_os_error().unwrap_or(libc::EIO),
            CascadeError::RegionFault(_) => libc::EFAULT,
            CascadeError::Internal(_) => libc::EIO,
            CascadeError::T1TooSmall { .. } => libc::EINVAL,
            CascadeError::Alloc { .. } => libc::ENOMEM,
        }
    }
}

/// Where a group's current bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residence {
    T1,
    Backing,
    Empty,
}

impl Residence {
    pub fn name(self) -> &'static str {
        match self {
            Residence::T1 => "t1",
            Residence::Backing => "backing",
            Residence::Empty => "empty",
        }
    }
}

/// What `query` reports for one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupState {
    pub residence: Residence,
    pub dirty: bool,
    /// crc32c of the bytes last written back, where the group was ever.
    pub backing_crc: Option<u32>,
}

#[derive(Clone, Copy, Debug)]
pub struct CascadeConfig {
    pub t1_bytes: u64,
    pub policy: PolicyKind,
    /// Install a group in T1 when a read misses (off by default: a miss
    /// read is often a one-off restore, and promoting it would evict hot
    /// groups).
    pub promote_on_miss: bool,
    /// T1 is allocated (pinned, where there is a GPU) in chunks of this
    /// size: the first before the cascade is usable, the rest by a
    /// background thread, so a large T1 does not hold up a mount.
    pub t1_chunk_bytes: u64,
    /// Write-backs (evictions) with no sync in between after which the
    /// cascade syncs the data file itself, so the list of groups awaiting a
    /// sync stays bounded (about 40 bytes each).
    pub unsynced_limit: usize,
}

/// Default T1 chunk: pinning 256 MiB takes a fraction of a second, and the
/// driver call overhead per chunk is nothing next to it.
pub const DEFAULT_T1_CHUNK: u64 = 256 << 20;

impl Default for CascadeConfig {
    fn default() -> Self {
        CascadeConfig {
            t1_bytes: 64 << 20,
            policy: PolicyKind::Sieve,
            promote_on_miss: false,
            t1_chunk_bytes: DEFAULT_T1_CHUNK,
            unsynced_limit: DEFAULT_UNSYNCED_LIMIT,
        }
    }
}

/// T1's memory: chunks of slots, adopted as the background allocator
/// delivers them. A slot is reachable (on the free list) only once its
/// chunk's base is set, so `slot_ptr` never sees a missing chunk.
struct Arena {
    per_chunk: u32,
    bases: Box<[AtomicPtr<u8>]>,
    /// Each chunk's device address (0: not arrived, or not device-mapped),
    /// stored before its slots become free.
    dev_bases: Box<[AtomicU64]>,
    owned: Mutex<Vec<HostBuf>>,
    incoming: Mutex<Option<mpsc::Receiver<(usize, HostBuf)>>>,
    ready_slots: AtomicU64,
}

/// Monotonic counters; read with `Cascade::stats`.
#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    empty_reads: AtomicU64,
    evictions: AtomicU64,
    flushes: AtomicU64,
    flushed_bytes: AtomicU64,
    checksum_failures: AtomicU64,
    recovered_reads: AtomicU64,
    write_back_failures: AtomicU64,
    t1_read_bytes: AtomicU64,
    t1_write_bytes: AtomicU64,
    backing_read_bytes: AtomicU64,
    backing_write_bytes: AtomicU64,
    dirty_slots: AtomicU64,
}

/// A snapshot of the cascade's counters and occupancy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CascadeStats {
    pub hits: u64,
    pub misses: u64,
    pub empty_reads: u64,
    pub evictions: u64,
    pub flushes: u64,
    pub flushed_bytes: u64,
    pub checksum_failures: u64,
    /// Backing reads that found the newest copy cut short by a crash and
    /// served the last synced copy instead.
    pub recovered_reads: u64,
    pub write_back_failures: u64,
    pub t1_read_bytes: u64,
    pub t1_write_bytes: u64,
    pub backing_read_bytes: u64,
    pub backing_write_bytes: u64,
    pub t1_slots_used: u64,
    pub t1_slots_total: u64,
    pub dirty_slots: u64,
    pub dirty_bytes: u64,
}

/// Hashes a group index with one multiply (Fibonacci hashing): the map is
/// probed on every read and write under the state lock, and group indices
/// are not attacker-chosen in a way that could hurt more than one client's
/// own cache, so SipHash's cost buys nothing here.
#[derive(Default)]
struct IndexHasher(u64);

/// Default write-backs awaiting a sync before one is forced (see
/// bound_unsynced): about 40 MB of bookkeeping at most.
pub const DEFAULT_UNSYNCED_LIMIT: usize = 1 << 20;

impl Hasher for IndexHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Resident,
    /// Chosen as a victim; its evictor holds the write lock and is writing
    /// it back. Still mapped, so readers of its group wait, then retry.
    Evicting,
}

struct State {
    map: HashMap<GroupIndex, SlotId, BuildHasherDefault<IndexHasher>>,
    slot_state: Vec<SlotState>,
    free: Vec<SlotId>,
    policy: Box<dyn Policy>,
}

pub struct Cascade {
    layout: GroupLayout,
    tier: Box<dyn Tier>,
    meta: MetaTable,
    cfg: CascadeConfig,
    arena: Arena,
    n_slots: u32,
    slot_locks: Box<[RwLock<()>]>,
    pins: Box<[AtomicU32]>,
    /// Group held by each slot; written only under the slot's write lock.
    tags: Box<[AtomicU64]>,
    /// Changed only under the slot's lock: set under the write lock, cleared
    /// by a write-back under the read or write lock.
    dirty: Box<[AtomicBool]>,
    state: Mutex<State>,
    changed: Condvar,
    stripes: Box<[Mutex<()>]>,
    sync_lock: Mutex<()>,
    staging: Mutex<Vec<HostBuf>>,
    counters: Counters,
    /// Groups written back since the last sync, with the generation of that
    /// write-back: a sync makes their newest copies the durable ones.
    unsynced: Mutex<HashMap<GroupIndex, u64, BuildHasherDefault<IndexHasher>>>,
    /// Set when `unsynced` grew past the unsynced limit, so a write checks one
    /// atomic rather than taking the `unsynced` lock.
    unsynced_over: AtomicBool,
    unsynced_limit: usize,
    /// This mount's epoch (see store::next_epoch).
    epoch: u8,
    /// Set by `crash`: drop without the final flush.
    crashed: bool,
    /// The backing directory's flock, released after the final flush.
    store_lock: Option<std::fs::File>,
}

/// A pin on a slot, dropped when the copy or fill that needed it is done.
struct Pin<'a> {
    c: &'a Cascade,
    slot: SlotId,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        if self.c.pins[self.slot.0 as usize].fetch_sub(1, Ordering::AcqRel) == 1 {
            self.c.changed.notify_all();
        }
    }
}

/// Slots held for device copies (see `Cascade::pin_for_device`): each
/// slot in `locked` read-locked once, each entry of `pinned` one pin.
pub struct DevicePins<'a> {
    c: &'a Cascade,
    locked: Vec<u32>,
    pinned: Vec<(u32, u32)>,
}

impl Drop for DevicePins<'_> {
    fn drop(&mut self) {
        // Locks before pins, as everywhere.
        for &s in &self.locked {
            // SAFETY: pin_for_device took exactly one read lock on each of
            // these slots and forgot its guard.
            unsafe { self.c.slot_locks[s as usize].force_unlock_read() };
        }
        let mut freed = false;
        for &(s, _) in &self.pinned {
            freed |= self.c.pins[s as usize].fetch_sub(1, Ordering::AcqRel) == 1;
        }
        if freed {
            self.c.changed.notify_all();
        }
    }
}

/// Slots held for writing whole groups in place, by a device or by the
/// caller (see `Cascade::claim_slots`): each pinned and write-locked until
/// `commit`, or dropped, which undoes the claims.
pub struct SlotWrites<'a> {
    c: &'a Cascade,
    /// For each batch entry, its index into `held`.
    of: Vec<Option<u32>>,
    held: Vec<(GroupIndex, Pin<'a>, RwLockWriteGuard<'a, ()>)>,
}

impl SlotWrites<'_> {
    /// Whether entry `i` has a slot here (else the caller writes it through
    /// `write_groups`).
    pub fn has(&self, i: usize) -> bool {
        self.of[i].is_some()
    }

    /// How many entries have a slot.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The device address of entry `i`'s slot (T1 pinned and mapped).
    pub fn device_addr(&self, i: usize) -> Option<u64> {
        let h = self.of[i]? as usize;
        self.c.slot_device_ptr(self.held[h].1.slot)
    }

    /// Entry `i`'s group bytes, for the caller to fill.
    pub fn bytes_mut(&mut self, i: usize) -> Option<&mut [u8]> {
        let h = self.of[i]? as usize;
        let gb = self.c.layout.group_bytes() as usize;
        // SAFETY: we hold the slot's write lock for as long as self lives,
        // and the &mut self borrow makes this the only view of it.
        Some(&mut unsafe { self.c.slot_bytes_mut(self.held[h].1.slot) }[..gb])
    }

    /// Every held slot was written in full: they become their groups'
    /// (dirty) contents.
    pub fn commit(mut self) {
        let n = self.held.len() as u64;
        for (_, pin, guard) in self.held.drain(..) {
            self.c.set_dirty(pin.slot);
            drop(guard);
            drop(pin);
        }
        self.c
            .counters
            .t1_write_bytes
            .fetch_add(n * self.c.layout.group_bytes(), Ordering::Relaxed);
    }
}

impl Drop for SlotWrites<'_> {
    /// Not committed (the copy failed): the held slots hold unknown bytes.
    /// Each was free or held a clean group, so it goes back to the free
    /// list and its group reads from the backing, as before: nothing lost.
    fn drop(&mut self) {
        for (g, pin, guard) in self.held.drain(..) {
            self.c.abandon(g, pin, guard);
        }
    }
}

enum Claim<'a> {
    /// The group got this slot, mapped, pinned and write-locked; the caller
    /// fills it.
    Got(Pin<'a>, RwLockWriteGuard<'a, ()>),
    /// Someone else mapped the group meanwhile: retry as a hit.
    Mapped,
}

impl Cascade {
    /// Opens a backing directory and puts a T1 over it.
    pub fn open(backing: &BackingConfig, cfg: CascadeConfig) -> Result<Cascade, anyhow::Error> {
        let b = Backing::open(backing)?;
        let mut c = Cascade::new(b.layout, b.tier, b.meta, cfg)?;
        c.epoch = b.epoch;
        // The store stays locked for as long as the cascade lives.
        c.store_lock = Some(b.lock);
        Ok(c)
    }

    /// A cascade over any tier, with its metadata table.
    pub fn new(
        layout: GroupLayout,
        tier: Box<dyn Tier>,
        meta: MetaTable,
        cfg: CascadeConfig,
    ) -> Result<Cascade, CascadeError> {
        let stride = layout.stride();
        let n = cfg.t1_bytes / stride;
        if n == 0 {
            return Err(CascadeError::T1TooSmall {
                t1_bytes: cfg.t1_bytes,
                stride,
            });
        }
        let n_slots = n.min(u32::MAX as u64 - 1) as u32;
        let per_chunk = (cfg.t1_chunk_bytes / stride).clamp(1, n_slots as u64) as u32;
        let n_chunks = n_slots.div_ceil(per_chunk) as usize;
        let chunk_slots = move |i: usize| per_chunk.min(n_slots - i as u32 * per_chunk);
        let t = std::time::Instant::now();
        let first_bytes = chunk_slots(0) as u64 * stride;
        let first = HostBuf::alloc(first_bytes as usize).map_err(|source| CascadeError::Alloc {
            bytes: first_bytes,
            source,
        })?;
        let pinned = first.device_ptr().is_some();
        let bases: Box<[AtomicPtr<u8>]> = (0..n_chunks)
            .map(|_| AtomicPtr::new(std::ptr::null_mut()))
            .collect();
        bases[0].store(first.as_ptr(), Ordering::Release);
        let dev_bases: Box<[AtomicU64]> = (0..n_chunks).map(|_| AtomicU64::new(0)).collect();
        dev_bases[0].store(first.device_ptr().unwrap_or(0), Ordering::Release);
        let incoming = if n_chunks > 1 {
            let (tx, rx) = mpsc::channel();
            std::thread::Builder::new()
                .name("kvfs-t1-alloc".into())
                .spawn(move || {
                    for i in 1..n_chunks {
                        let bytes = chunk_slots(i) as u64 * stride;
                        match HostBuf::alloc(bytes as usize) {
                            Ok(b) => {
                                if tx.send((i, b)).is_err() {
                                    return; // the cascade is gone
                                }
                            }
                            Err(e) => {
                                tracing::error!("T1 chunk {i} ({bytes} bytes) could not be allocated: {e}; T1 stays smaller");
                                return;
                            }
                        }
                    }
                    tracing::info!(
                        "T1: {} MiB in {n_chunks} chunks {} in {:.2?}",
                        (n_slots as u64 * stride) >> 20,
                        if pinned { "pinned" } else { "allocated" },
                        t.elapsed()
                    );
                })
                .map_err(|source| CascadeError::Alloc { bytes: 0, source })?;
            Some(rx)
        } else {
            tracing::debug!(
                "T1: {} MiB allocated in {:.2?}",
                first_bytes >> 20,
                t.elapsed()
            );
            None
        };
        let first_slots = chunk_slots(0);
        let policy = cfg.policy.build(n_slots);
        Ok(Cascade {
            layout,
            tier,
            meta,
            cfg,
            arena: Arena {
                per_chunk,
                bases,
                dev_bases,
                owned: Mutex::new(vec![first]),
                incoming: Mutex::new(incoming),
                ready_slots: AtomicU64::new(first_slots as u64),
            },
            n_slots,
            slot_locks: (0..n_slots).map(|_| RwLock::new(())).collect(),
            pins: (0..n_slots).map(|_| AtomicU32::new(0)).collect(),
            tags: (0..n_slots).map(|_| AtomicU64::new(NO_GROUP)).collect(),
            dirty: (0..n_slots).map(|_| AtomicBool::new(false)).collect(),
            state: Mutex::new(State {
                // Sized for a full T1 up front, like the per-slot arrays: a
                // rehash of a large map under the state lock would stall
                // every reader and writer for milliseconds.
                map: HashMap::with_capacity_and_hasher(n_slots as usize, Default::default()),
                slot_state: vec![SlotState::Free; n_slots as usize],
                // Reversed so slot 0 is used first.
                free: (0..first_slots).rev().map(SlotId).collect(),
                policy,
            }),
            changed: Condvar::new(),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            sync_lock: Mutex::new(()),
            staging: Mutex::new(Vec::new()),
            counters: Counters::default(),
            unsynced: Mutex::new(HashMap::default()),
            unsynced_over: AtomicBool::new(false),
            unsynced_limit: cfg.unsynced_limit.max(1),
            epoch: 1,
            crashed: false,
            store_lock: None,
        })
    }

    pub fn layout(&self) -> &GroupLayout {
        &self.layout
    }

    pub fn tier_name(&self) -> &'static str {
        self.tier.name()
    }

    pub fn policy_name(&self) -> &'static str {
        self.state.lock().policy.name()
    }

    pub fn t1_slots(&self) -> u32 {
        self.n_slots
    }

    /// The geometry plus T1 size, tier and policy, as one JSON object
    /// (`.kvfs/layout`, the control file's HELLO).
    pub fn describe_json(&self) -> String {
        let l = &self.layout;
        let json = l.to_json();
        format!(
            "{},\"t1_bytes\":{},\"t1_slots\":{},\"tier\":\"{}\",\"policy\":\"{}\",\"t1_pinned\":{}}}",
            &json[..json.len() - 1],
            self.n_slots as u64 * l.stride(),
            self.n_slots,
            self.tier_name(),
            self.policy_name(),
            self.slot_device_ptr(SlotId(0)).is_some()
        )
    }

    // ---- slot memory -------------------------------------------------

    fn slot_ptr(&self, s: SlotId) -> *mut u8 {
        debug_assert!(s.0 < self.n_slots);
        let a = &self.arena;
        let base = a.bases[(s.0 / a.per_chunk) as usize].load(Ordering::Acquire);
        debug_assert!(
            !base.is_null(),
            "slot {} used before its chunk arrived",
            s.0
        );
        // SAFETY: the slot's chunk is allocated (slots reach the free list
        // only after their chunk's base is set) and the offset is inside it.
        unsafe { base.add((s.0 % a.per_chunk) as usize * self.layout.stride() as usize) }
    }

    /// Takes in the T1 chunks the background allocator has finished.
    fn adopt_chunks(&self, st: &mut State) {
        let a = &self.arena;
        let Some(mut guard) = a.incoming.try_lock() else {
            return;
        };
        let Some(rx) = guard.as_ref() else { return };
        loop {
            match rx.try_recv() {
                Ok((i, buf)) => {
                    a.bases[i].store(buf.as_ptr(), Ordering::Release);
                    a.dev_bases[i].store(buf.device_ptr().unwrap_or(0), Ordering::Release);
                    let first = i as u32 * a.per_chunk;
                    let n = (buf.len() as u64 / self.layout.stride()) as u32;
                    st.free.extend((first..first + n).rev().map(SlotId));
                    a.ready_slots.fetch_add(n as u64, Ordering::Relaxed);
                    a.owned.lock().push(buf);
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    *guard = None;
                    break;
                }
            }
        }
    }

    /// Slots whose memory has arrived (all of T1 once the background
    /// allocation is done).
    pub fn t1_ready_slots(&self) -> u64 {
        self.adopt_chunks(&mut self.state.lock());
        self.arena.ready_slots.load(Ordering::Relaxed)
    }

    /// The device address of slot `s` where T1 is pinned and mapped.
    pub fn slot_device_ptr(&self, s: SlotId) -> Option<u64> {
        let a = &self.arena;
        let base = a.dev_bases[(s.0 / a.per_chunk) as usize].load(Ordering::Acquire);
        (base != 0).then(|| base + (s.0 % a.per_chunk) as u64 * self.layout.stride())
    }

    /// # Safety
    /// The caller holds slot `s`'s lock (read or write) for as long as the
    /// returned slice lives.
    unsafe fn slot_bytes(&self, s: SlotId) -> &[u8] {
        // SAFETY: in bounds (slot_ptr); the caller's lock excludes writers.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(s), self.layout.stride() as usize) }
    }

    /// # Safety
    /// The caller holds slot `s`'s write lock for as long as the returned
    /// slice lives.
    #[expect(
        clippy::mut_from_ref,
        reason = "exclusivity comes from the slot's write lock"
    )]
    unsafe fn slot_bytes_mut(&self, s: SlotId) -> &mut [u8] {
        // SAFETY: in bounds (slot_ptr); the write lock makes this the only
        // reference to the slot's bytes.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(s), self.layout.stride() as usize) }
    }

    fn stripe(&self, g: GroupIndex) -> MutexGuard<'_, ()> {
        self.stripes[(g.0 % STRIPES as u64) as usize].lock()
    }

    fn take_staging(&self) -> Result<HostBuf, CascadeError> {
        if let Some(b) = self.staging.lock().pop() {
            return Ok(b);
        }
        let bytes = self.layout.stride();
        // Plain memory, never pinned: pinning is a CUDA call that waits for
        // the device to go idle, and a miss may be read while a GPU stream
        // waits on this very thread (see control's GPU restores).
        HostBuf::alloc_plain(bytes as usize).map_err(|source| CascadeError::Alloc { bytes, source })
    }

    fn give_staging(&self, b: HostBuf) {
        let mut s = self.staging.lock();
        if s.len() < STAGING_KEEP {
            s.push(b);
        }
    }

    fn set_dirty(&self, s: SlotId) {
        if !self.dirty[s.0 as usize].swap(true, Ordering::AcqRel) {
            self.counters.dirty_slots.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn clear_dirty(&self, s: SlotId) {
        if self.dirty[s.0 as usize].swap(false, Ordering::AcqRel) {
            self.counters.dirty_slots.fetch_sub(1, Ordering::Relaxed);
        }
    }

    // ---- lookups -----------------------------------------------------

    fn check_range(&self, offset: u64, len: usize) -> Result<(), CascadeError> {
        let end = offset.saturating_add(len as u64);
        if end > self.layout.group_bytes() {
            return Err(CascadeError::OutOfBounds {
                offset,
                end,
                group_bytes: self.layout.group_bytes(),
            });
        }
        Ok(())
    }

    fn check_index(&self, g: GroupIndex) -> Result<(), CascadeError> {
        if g.0 >= self.layout.group_count() {
            return Err(OutOfRange {
                what: "group index",
                value: g.0,
                limit: self.layout.group_count(),
            }
            .into());
        }
        Ok(())
    }

    /// Pins the slot holding `g`, if any (and tells the policy of the hit).
    fn pin_resident(&self, g: GroupIndex, touch: bool) -> Option<Pin<'_>> {
        let mut st = self.state.lock();
        let s = *st.map.get(&g)?;
        self.pins[s.0 as usize].fetch_add(1, Ordering::AcqRel);
        if touch && st.slot_state[s.0 as usize] == SlotState::Resident {
            st.policy.touch(s);
        }
        Some(Pin { c: self, slot: s })
    }

    /// `pin_resident` for many groups under one acquisition of the state
    /// lock (a batch of 1024 would otherwise take it 1024 times).
    fn pin_resident_many(&self, groups: &[GroupIndex]) -> Vec<Option<Pin<'_>>> {
        let mut st = self.state.lock();
        groups
            .iter()
            .map(|g| {
                let s = *st.map.get(g)?;
                self.pins[s.0 as usize].fetch_add(1, Ordering::AcqRel);
                if st.slot_state[s.0 as usize] == SlotState::Resident {
                    st.policy.touch(s);
                }
                Some(Pin { c: self, slot: s })
            })
            .collect()
    }

    /// Whether every group of `groups` is in T1 right now (one acquisition
    /// of the state lock; the answer may be stale as soon as it returns).
    pub fn all_resident(&self, groups: impl IntoIterator<Item = GroupIndex>) -> bool {
        let st = self.state.lock();
        groups.into_iter().all(|g| st.map.contains_key(&g))
    }

    fn holds(&self, s: SlotId, g: GroupIndex) -> bool {
        self.tags[s.0 as usize].load(Ordering::Acquire) == g.0
    }

    // ---- backing I/O -------------------------------------------------

    /// Reads `g`'s current backing bytes into `buf` (stride bytes, aligned),
    /// verifying the checksum. Never-written groups read as zeros.
    /// The caller holds `g`'s stripe.
    fn read_backing_locked(
        &self,
        g: GroupIndex,
        buf: &mut [u8],
    ) -> Result<Residence, CascadeError> {
        let m = self.meta.get(g.0);
        if !m.written {
            buf.fill(0);
            self.counters.empty_reads.fetch_add(1, Ordering::Relaxed);
            return Ok(Residence::Empty);
        }
        self.tier.read_one(copy_index(g, m.cur), buf)?;
        self.counters
            .backing_read_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        self.verify_backing(g, &m, buf)
    }

    /// Checks bytes just read from `g`'s newest copy against its checksum.
    /// On a mismatch, a newest copy written before this mount (so possibly
    /// cut short by a crash) gives way to the last synced copy, re-read
    /// into `buf`; anything else is a checksum error. The caller holds
    /// `g`'s stripe.
    fn verify_backing(
        &self,
        g: GroupIndex,
        m: &GroupMeta,
        buf: &mut [u8],
    ) -> Result<Residence, CascadeError> {
        let gb = self.layout.group_bytes() as usize;
        let computed = crc32c::crc32c(&buf[..gb]);
        if computed == m.crc {
            return Ok(Residence::Backing);
        }
        if let Some(d) = m.durable.filter(|&d| d != m.cur && m.epoch != self.epoch)
            && self.tier.read_one(copy_index(g, d), buf).is_ok()
            && crc32c::crc32c(&buf[..gb]) == m.durable_crc
        {
            self.counters
                .recovered_reads
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                group = %g,
                "the newest copy was cut short (a crash before it was synced); serving the last synced copy"
            );
            // From now on that copy is the group's newest.
            self.meta.set(
                g.0,
                GroupMeta {
                    cur: d,
                    crc: m.durable_crc,
                    generation: m.generation + 1,
                    ..*m
                },
            );
            return Ok(Residence::Backing);
        }
        self.counters
            .checksum_failures
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(group = %g, "checksum mismatch on backing read");
        Err(CascadeError::Checksum {
            index: g,
            stored: m.crc,
            computed,
        })
    }

    /// The copy a write-back of a group with metadata `m` goes to: never
    /// the durable one, so the last synced bytes survive a crash mid-write.
    fn target_copy(m: &GroupMeta) -> u8 {
        match m.durable {
            Some(d) => 1 - d,
            None => 0,
        }
    }

    /// Writes `bytes` (a slot) back as `g` and records its checksum.
    /// The caller holds the slot's lock; this takes `g`'s stripe.
    fn write_back(&self, g: GroupIndex, bytes: &[u8]) -> Result<(), CascadeError> {
        let _io = self.stripe(g);
        let m = self.meta.get(g.0);
        let target = Self::target_copy(&m);
        if let Err(e) = self.tier.write_one(copy_index(g, target), bytes) {
            self.counters
                .write_back_failures
                .fetch_add(1, Ordering::Relaxed);
            return Err(e.into());
        }
        self.record_written(g, bytes, target, &m);
        Ok(())
    }

    /// Records a write-back of `bytes` to copy `target` of `g` (whose
    /// metadata was `old`). The caller holds `g`'s stripe.
    fn record_written(&self, g: GroupIndex, bytes: &[u8], target: u8, old: &GroupMeta) {
        let new = GroupMeta {
            written: true,
            cur: target,
            durable: old.durable,
            durable_crc: old.durable_crc,
            epoch: self.epoch,
            crc: crc32c::crc32c(&bytes[..self.layout.group_bytes() as usize]),
            generation: (old.generation + 1) & 0xffff_ffff,
        };
        self.meta.set(g.0, new);
        {
            let mut u = self.unsynced.lock();
            u.insert(g, new.generation);
            if u.len() > self.unsynced_limit {
                self.unsynced_over.store(true, Ordering::Relaxed);
            }
        }
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        self.counters
            .flushed_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.counters
            .backing_write_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
    }

    /// After a successful sync of the data file: the newest copies of
    /// `groups` (those not written back again since) become durable.
    fn mark_durable(&self, groups: &[(GroupIndex, u64)]) {
        for &(g, generation) in groups {
            let _io = self.stripe(g);
            let m = self.meta.get(g.0);
            if m.written && m.generation == generation {
                self.meta.set(
                    g.0,
                    GroupMeta {
                        durable: Some(m.cur),
                        durable_crc: m.crc,
                        ..m
                    },
                );
            }
        }
    }

    /// Syncs the data file, then marks `taken` (write-backs recorded
    /// before the sync began) durable; on failure they stay unsynced.
    fn sync_taken(&self, taken: Vec<(GroupIndex, u64)>) -> Result<(), CascadeError> {
        if let Err(e) = self.tier.sync() {
            let mut u = self.unsynced.lock();
            for (g, generation) in taken {
                u.entry(g).or_insert(generation);
            }
            return Err(e.into());
        }
        self.mark_durable(&taken);
        Ok(())
    }

    // ---- slot allocation ---------------------------------------------

    /// Finds a slot for `g`: a free one, or a victim (written back first if
    /// dirty). Returns it mapped to `g`, pinned and write-locked.
    fn claim(&self, g: GroupIndex) -> Result<Claim<'_>, CascadeError> {
        loop {
            let mut st = self.state.lock();
            if st.map.contains_key(&g) {
                return Ok(Claim::Mapped);
            }
            if st.free.is_empty() {
                self.adopt_chunks(&mut st);
            }
            // A free slot nobody pins: nobody holds or waits for its lock.
            if let Some(pos) = st
                .free
                .iter()
                .rposition(|s| self.pins[s.0 as usize].load(Ordering::Acquire) == 0)
            {
                let s = st.free[pos];
                if let Some(guard) = self.slot_locks[s.0 as usize].try_write() {
                    st.free.swap_remove(pos);
                    self.install(&mut st, s, g);
                    return Ok(Claim::Got(self.pin_now(s), guard));
                }
            }
            let pins = &self.pins;
            let locks = &self.slot_locks;
            let victim = {
                let State {
                    policy, slot_state, ..
                } = &mut *st;
                policy.victim(&mut |s| {
                    slot_state[s.0 as usize] == SlotState::Resident
                        && pins[s.0 as usize].load(Ordering::Acquire) == 0
                        && !locks[s.0 as usize].is_locked()
                })
            };
            let Some(v) = victim else {
                // Every slot is pinned or being evicted: wait for a change.
                self.changed.wait_for(&mut st, Duration::from_millis(1));
                continue;
            };
            let Some(guard) = self.slot_locks[v.0 as usize].try_write() else {
                continue;
            };
            let old = GroupIndex(self.tags[v.0 as usize].load(Ordering::Acquire));
            if !self.dirty[v.0 as usize].load(Ordering::Acquire) {
                st.map.remove(&old);
                st.policy.remove(v);
                self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                self.install(&mut st, v, g);
                return Ok(Claim::Got(self.pin_now(v), guard));
            }
            // Dirty victim: write it back outside the state lock.
            let pin = self.pin_now(v);
            st.slot_state[v.0 as usize] = SlotState::Evicting;
            drop(st);
            // SAFETY: we hold v's write lock (guard).
            let r = self.write_back(old, unsafe { self.slot_bytes(v) });
            let mut st = self.state.lock();
            if let Err(e) = r {
                st.slot_state[v.0 as usize] = SlotState::Resident;
                drop(guard);
                drop(st);
                drop(pin);
                return Err(e);
            }
            self.clear_dirty(v);
            st.map.remove(&old);
            st.policy.remove(v);
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
            if st.map.contains_key(&g) {
                self.free_slot(&mut st, v);
                drop(guard);
                drop(st);
                drop(pin);
                self.changed.notify_all();
                return Ok(Claim::Mapped);
            }
            self.install(&mut st, v, g);
            return Ok(Claim::Got(pin, guard));
        }
    }

    /// Maps `g` to `s`, whose write lock the caller holds.
    fn install(&self, st: &mut State, s: SlotId, g: GroupIndex) {
        self.tags[s.0 as usize].store(g.0, Ordering::Release);
        st.map.insert(g, s);
        st.slot_state[s.0 as usize] = SlotState::Resident;
        st.policy.insert(s);
    }

    /// Puts `s`, unmapped and untracked, on the free list; the caller holds
    /// its write lock.
    fn free_slot(&self, st: &mut State, s: SlotId) {
        self.tags[s.0 as usize].store(NO_GROUP, Ordering::Release);
        st.slot_state[s.0 as usize] = SlotState::Free;
        st.free.push(s);
    }

    /// Pins `s`; the caller holds the state lock (pins are only added under it).
    fn pin_now(&self, s: SlotId) -> Pin<'_> {
        self.pins[s.0 as usize].fetch_add(1, Ordering::AcqRel);
        Pin { c: self, slot: s }
    }

    /// Undoes a claim whose fill failed: the slot goes back to the free list.
    fn abandon(&self, g: GroupIndex, pin: Pin<'_>, guard: RwLockWriteGuard<'_, ()>) {
        let s = pin.slot;
        let mut st = self.state.lock();
        st.map.remove(&g);
        st.policy.remove(s);
        self.free_slot(&mut st, s);
        drop(st);
        drop(guard);
        drop(pin);
    }

    // ---- the API -----------------------------------------------------

    /// Reads `out.len()` bytes of group `g` from `offset`.
    pub fn read(
        &self,
        g: GroupIndex,
        offset: u64,
        out: &mut [u8],
    ) -> Result<Residence, CascadeError> {
        self.check_index(g)?;
        self.check_range(offset, out.len())?;
        let off = offset as usize;
        loop {
            if let Some(pin) = self.pin_resident(g, true) {
                let _r = self.slot_locks[pin.slot.0 as usize].read();
                if !self.holds(pin.slot, g) {
                    continue; // its fill failed; look again
                }
                // SAFETY: we hold the slot's read lock.
                let bytes = unsafe { self.slot_bytes(pin.slot) };
                out.copy_from_slice(&bytes[off..off + out.len()]);
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .t1_read_bytes
                    .fetch_add(out.len() as u64, Ordering::Relaxed);
                return Ok(Residence::T1);
            }
            let mut buf = self.take_staging()?;
            let (r, generation) = {
                let _io = self.stripe(g);
                // Re-check under the stripe: a group installed meanwhile is newer.
                if self.state.lock().map.contains_key(&g) {
                    self.give_staging(buf);
                    continue;
                }
                (
                    self.read_backing_locked(g, buf.as_mut_slice()),
                    self.meta.get(g.0).generation,
                )
            };
            let res = match r {
                Ok(res) => res,
                Err(e) => {
                    self.give_staging(buf);
                    return Err(e);
                }
            };
            out.copy_from_slice(&buf.as_slice()[off..off + out.len()]);
            if res == Residence::Backing {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                if self.cfg.promote_on_miss {
                    self.promote(g, buf.as_slice(), generation);
                }
            }
            self.give_staging(buf);
            return Ok(res);
        }
    }

    /// Reads whole groups (each `out` is `group_bytes` long, or shorter for
    /// a prefix). Hits copy straight out of their slots; the misses go to the
    /// backing together, in batches through the tier's queue depth. One
    /// result per item, in order; a failed item does not stop the others.
    pub fn read_groups(
        &self,
        items: &mut [(GroupIndex, &mut [u8])],
    ) -> Vec<Result<Residence, CascadeError>> {
        let mut results: Vec<Option<Result<Residence, CascadeError>>> =
            (0..items.len()).map(|_| None).collect();
        let mut misses = Vec::new();
        let valid: Vec<GroupIndex> = items
            .iter()
            .enumerate()
            .filter_map(|(i, (g, out))| {
                match self
                    .check_index(*g)
                    .and_then(|_| self.check_range(0, out.len()))
                {
                    Ok(()) => Some(*g),
                    Err(e) => {
                        results[i] = Some(Err(e));
                        None
                    }
                }
            })
            .collect();
        let mut pins = self.pin_resident_many(&valid).into_iter();
        for (i, (g, out)) in items.iter_mut().enumerate() {
            if results[i].is_some() {
                continue;
            }
            match pins.next().expect("one pin slot per valid item") {
                Some(pin) => {
                    let _r = self.slot_locks[pin.slot.0 as usize].read();
                    if !self.holds(pin.slot, *g) {
                        misses.push(i);
                        continue;
                    }
                    // SAFETY: we hold the slot's read lock.
                    let bytes = unsafe { self.slot_bytes(pin.slot) };
                    out.copy_from_slice(&bytes[..out.len()]);
                    self.counters.hits.fetch_add(1, Ordering::Relaxed);
                    self.counters
                        .t1_read_bytes
                        .fetch_add(out.len() as u64, Ordering::Relaxed);
                    results[i] = Some(Ok(Residence::T1));
                }
                None => misses.push(i),
            }
        }
        let stride = self.layout.stride() as usize;
        for chunk in misses.chunks(SYNC_BATCH) {
            // Plain, never pinned (see take_staging).
            let mut staging = match HostBuf::alloc_plain(stride * chunk.len()) {
                Ok(b) => b,
                Err(source) => {
                    for &i in chunk {
                        results[i] = Some(Err(CascadeError::Alloc {
                            bytes: (stride * chunk.len()) as u64,
                            source: io::Error::new(source.kind(), source.to_string()),
                        }));
                    }
                    continue;
                }
            };
            // Stripes in order (as sync_all takes them), so no deadlock.
            let mut stripe_ids: Vec<usize> = chunk
                .iter()
                .map(|&i| (items[i].0.0 % STRIPES as u64) as usize)
                .collect();
            stripe_ids.sort_unstable();
            stripe_ids.dedup();
            let mut retry = Vec::new();
            {
                let _io: Vec<_> = stripe_ids.iter().map(|&s| self.stripes[s].lock()).collect();
                let mut to_read = Vec::new();
                {
                    let st = self.state.lock();
                    for (k, &i) in chunk.iter().enumerate() {
                        let g = items[i].0;
                        if st.map.contains_key(&g) {
                            retry.push(i); // installed meanwhile: T1 is newer
                        } else if !self.meta.get(g.0).written {
                            items[i].1.fill(0);
                            self.counters.empty_reads.fetch_add(1, Ordering::Relaxed);
                            results[i] = Some(Ok(Residence::Empty));
                        } else {
                            to_read.push((k, i));
                        }
                    }
                }
                let bufs = staging.as_mut_slice().chunks_mut(stride);
                let mut by_k: Vec<Option<&mut [u8]>> = bufs.map(Some).collect();
                let metas: Vec<GroupMeta> = to_read
                    .iter()
                    .map(|&(_, i)| self.meta.get(items[i].0.0))
                    .collect();
                let mut ops: Vec<crate::tier::ReadOp<'_>> = to_read
                    .iter()
                    .zip(&metas)
                    .map(|(&(k, i), m)| crate::tier::ReadOp {
                        index: copy_index(items[i].0, m.cur),
                        buf: by_k[k].take().expect("one buffer per miss"),
                    })
                    .collect();
                let rs = self.tier.read_batch(&mut ops);
                for (((op, r), &(_, i)), m) in ops.iter_mut().zip(rs).zip(&to_read).zip(&metas) {
                    let g = items[i].0;
                    results[i] = Some(match r {
                        Err(e) => Err(e.into()),
                        Ok(()) => {
                            self.counters
                                .backing_read_bytes
                                .fetch_add(stride as u64, Ordering::Relaxed);
                            let checked = self.verify_backing(g, m, op.buf);
                            if checked.is_ok() {
                                let out = &mut *items[i].1;
                                out.copy_from_slice(&op.buf[..out.len()]);
                                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                            }
                            checked
                        }
                    });
                }
            }
            for i in retry {
                let (g, out) = &mut items[i];
                results[i] = Some(self.read(*g, 0, out));
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every item answered"))
            .collect()
    }

    /// Pins and read-locks the T1 slots of those `groups` that are
    /// resident, for copies the GPU makes straight out of them: returns each
    /// group's slot device address (None where the group is not in T1 or
    /// T1 is not device-mapped). The slots cannot be written, evicted or
    /// reused until the returned guard drops.
    pub fn pin_for_device(&self, groups: &[GroupIndex]) -> (Vec<Option<u64>>, DevicePins<'_>) {
        // Pin first, then lock in ascending slot order, each slot once: every
        // holder of several slot locks (this, sync_all) takes them in that
        // order, so waits cannot form a cycle even with queued writers.
        // Slots and indexes as plain u32 pairs: a batch of 4096 costs tens
        // of microseconds here, and every byte moved counts.
        let mut pinned: Vec<(u32, u32)> = Vec::with_capacity(groups.len());
        {
            let mut st = self.state.lock();
            for (i, g) in groups.iter().enumerate() {
                let Some(&s) = st.map.get(g) else { continue };
                self.pins[s.0 as usize].fetch_add(1, Ordering::AcqRel);
                if st.slot_state[s.0 as usize] == SlotState::Resident {
                    st.policy.touch(s);
                }
                pinned.push((s.0, i as u32));
            }
        }
        pinned.sort_unstable();
        let mut addrs = vec![None; groups.len()];
        let mut locked: Vec<u32> = Vec::with_capacity(pinned.len());
        let mut hits = 0;
        for &(s, i) in &pinned {
            if locked.last() != Some(&s) {
                // Released by DevicePins::drop.
                std::mem::forget(self.slot_locks[s as usize].read());
                locked.push(s);
            }
            if self.holds(SlotId(s), groups[i as usize])
                && let Some(d) = self.slot_device_ptr(SlotId(s))
            {
                addrs[i as usize] = Some(d);
                hits += 1;
            }
        }
        // Once per batch: these counters are shared by every thread.
        self.counters.hits.fetch_add(hits, Ordering::Relaxed);
        self.counters
            .t1_read_bytes
            .fetch_add(hits * self.layout.group_bytes(), Ordering::Relaxed);
        (
            addrs,
            DevicePins {
                c: self,
                locked,
                pinned,
            },
        )
    }

    /// Installs bytes just read from the backing, unless the group changed.
    fn promote(&self, g: GroupIndex, bytes: &[u8], generation: u64) {
        match self.claim(g) {
            Ok(Claim::Got(pin, guard)) => {
                if self.meta.get(g.0).generation != generation {
                    self.abandon(g, pin, guard);
                    return;
                }
                // SAFETY: we hold the slot's write lock.
                unsafe { self.slot_bytes_mut(pin.slot) }.copy_from_slice(bytes);
            }
            Ok(Claim::Mapped) => {}
            Err(e) => tracing::debug!(group = %g, "not promoted: {e}"),
        }
    }

    /// Brings `g` into T1 (reading it from the backing if needed).
    pub fn prefetch(&self, g: GroupIndex) -> Result<(), CascadeError> {
        self.check_index(g)?;
        match self.claim(g)? {
            Claim::Mapped => Ok(()),
            Claim::Got(pin, guard) => {
                // SAFETY: we hold the slot's write lock.
                let slot = unsafe { self.slot_bytes_mut(pin.slot) };
                let r = {
                    let _io = self.stripe(g);
                    self.read_backing_locked(g, slot)
                };
                match r {
                    Ok(_) => Ok(()),
                    Err(e) => {
                        self.abandon(g, pin, guard);
                        Err(e)
                    }
                }
            }
        }
    }

    /// Writes `data` into group `g` at `offset` (write-back: the group is
    /// dirty in T1 until evicted or flushed). A partial write of a group not
    /// in T1 reads the rest of it first.
    pub fn write(&self, g: GroupIndex, offset: u64, data: &[u8]) -> Result<(), CascadeError> {
        let r = self.write_inner(g, offset, data);
        self.bound_unsynced();
        r
    }

    /// Whole-group writes of many groups (a STORE batch), in batch order.
    /// The groups in T1 are found under one acquisition of the state lock
    /// and filled in place, each under its slot's write lock (one at a
    /// time, so no lock order arises); the rest go through `write`.
    /// `fill(i, dst)` puts group i's bytes into `dst` (group_bytes long)
    /// and returns Ok, or returns an error and leaves `dst` untouched.
    pub fn write_groups(
        &self,
        groups: &[GroupIndex],
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), CascadeError>,
    ) -> Vec<Result<(), CascadeError>> {
        let gb = self.layout.group_bytes() as usize;
        let mut results: Vec<Result<(), CascadeError>> =
            groups.iter().map(|&g| self.check_index(g)).collect();
        // Each pin is dropped once its group is written; the misses wait
        // until then, so their claims never find T1 pinned full by us.
        let mut later = Vec::new();
        let mut written = 0u64;
        for (i, pin) in self.pin_resident_many(groups).into_iter().enumerate() {
            if results[i].is_err() {
                continue;
            }
            let Some(pin) = pin else {
                later.push(i);
                continue;
            };
            let _w = self.slot_locks[pin.slot.0 as usize].write();
            if !self.holds(pin.slot, groups[i]) {
                later.push(i); // its fill failed meanwhile
                continue;
            }
            // SAFETY: we hold the slot's write lock.
            let slot = unsafe { self.slot_bytes_mut(pin.slot) };
            match fill(i, &mut slot[..gb]) {
                Ok(()) => {
                    self.set_dirty(pin.slot);
                    written += gb as u64;
                }
                Err(e) => results[i] = Err(e),
            }
        }
        self.counters
            .t1_write_bytes
            .fetch_add(written, Ordering::Relaxed);
        let mut buf = vec![0u8; if later.is_empty() { 0 } else { gb }];
        for i in later {
            results[i] = fill(i, &mut buf).and_then(|()| self.write_inner(groups[i], 0, &buf));
        }
        self.bound_unsynced();
        results
    }

    /// Slots to write whole groups into in place (a GPU STORE writes them
    /// with one kernel launch, no host copy). Entry i gets a slot if its
    /// group is in T1 and clean (its own slot), or not in T1 while a free
    /// slot is left (claimed and mapped to it); with `device`, only slots
    /// T1 has device-mapped. A dirty group, a busy slot (only try-locks are
    /// taken, so holding many can never deadlock) or no free slot: no slot,
    /// and the caller writes that entry through `write_groups`. Because a
    /// held slot is free or clean, dropping the claims after a failed copy
    /// loses nothing. `groups` must be distinct and in range.
    pub fn claim_slots(&self, groups: &[GroupIndex], device: bool) -> SlotWrites<'_> {
        let mut w = SlotWrites {
            c: self,
            of: vec![None; groups.len()],
            held: Vec::with_capacity(groups.len()),
        };
        let mut fresh = Vec::new();
        {
            let mut st = self.state.lock();
            if st.free.len() < groups.len() {
                self.adopt_chunks(&mut st);
            }
            for (i, &g) in groups.iter().enumerate() {
                debug_assert!(g.0 < self.layout.group_count());
                let (s, guard) = match st.map.get(&g) {
                    Some(&s) => {
                        let i = s.0 as usize;
                        if self.dirty[i].load(Ordering::Acquire)
                            || st.slot_state[i] != SlotState::Resident
                            || (device && self.slot_device_ptr(s).is_none())
                        {
                            continue;
                        }
                        let Some(guard) = self.slot_locks[i].try_write() else {
                            continue;
                        };
                        st.policy.touch(s);
                        (s, guard)
                    }
                    None => {
                        let Some(&s) = st.free.last() else { continue };
                        if self.pins[s.0 as usize].load(Ordering::Acquire) != 0
                            || (device && self.slot_device_ptr(s).is_none())
                        {
                            continue;
                        }
                        let Some(guard) = self.slot_locks[s.0 as usize].try_write() else {
                            continue;
                        };
                        st.free.pop();
                        self.install(&mut st, s, g);
                        fresh.push(s);
                        (s, guard)
                    }
                };
                w.of[i] = Some(w.held.len() as u32);
                w.held.push((g, self.pin_now(s), guard));
            }
        }
        let gb = self.layout.group_bytes() as usize;
        if self.layout.stride() as usize > gb {
            for s in fresh {
                // SAFETY: we hold s's write lock (in w.held).
                let slot = unsafe { self.slot_bytes_mut(s) };
                slot[gb..].fill(0);
            }
        }
        w
    }

    /// Keeps the list of write-backs awaiting a sync bounded: past
    /// `unsynced_limit` groups (a long run of evictions with no fsync or
    /// sync), the data file is synced and they become durable. Called with
    /// no lock held.
    fn bound_unsynced(&self) {
        if !self.unsynced_over.swap(false, Ordering::Relaxed) {
            return;
        }
        let taken: Vec<(GroupIndex, u64)> = std::mem::take(&mut *self.unsynced.lock())
            .into_iter()
            .collect();
        if let Err(e) = self.sync_taken(taken) {
            tracing::warn!("a background sync of write-backs failed: {e}; they stay unsynced");
        }
    }

    fn write_inner(&self, g: GroupIndex, offset: u64, data: &[u8]) -> Result<(), CascadeError> {
        self.check_index(g)?;
        self.check_range(offset, data.len())?;
        let off = offset as usize;
        let gb = self.layout.group_bytes() as usize;
        loop {
            if let Some(pin) = self.pin_resident(g, true) {
                let _w = self.slot_locks[pin.slot.0 as usize].write();
                if !self.holds(pin.slot, g) {
                    continue; // evicted or abandoned meanwhile
                }
                self.set_dirty(pin.slot);
                // SAFETY: we hold the slot's write lock.
                let slot = unsafe { self.slot_bytes_mut(pin.slot) };
                slot[off..off + data.len()].copy_from_slice(data);
                self.counters
                    .t1_write_bytes
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                return Ok(());
            }
            let (pin, guard) = match self.claim(g)? {
                Claim::Mapped => continue,
                Claim::Got(p, w) => (p, w),
            };
            // SAFETY: we hold the slot's write lock.
            let slot = unsafe { self.slot_bytes_mut(pin.slot) };
            if off == 0 && data.len() == gb {
                slot[gb..].fill(0);
            } else {
                let r = {
                    let _io = self.stripe(g);
                    self.read_backing_locked(g, slot)
                };
                if let Err(e) = r {
                    self.abandon(g, pin, guard);
                    return Err(e);
                }
            }
            slot[off..off + data.len()].copy_from_slice(data);
            self.set_dirty(pin.slot);
            self.counters
                .t1_write_bytes
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            return Ok(());
        }
    }

    /// Makes group `g` durable: writes it back if dirty, then syncs the
    /// backing data and `g`'s metadata record.
    pub fn flush(&self, g: GroupIndex) -> Result<(), CascadeError> {
        self.check_index(g)?;
        if let Some(pin) = self.pin_resident(g, false) {
            let _r = self.slot_locks[pin.slot.0 as usize].read();
            if self.holds(pin.slot, g) && self.dirty[pin.slot.0 as usize].load(Ordering::Acquire) {
                // SAFETY: we hold the slot's read lock (writers are excluded).
                self.write_back(g, unsafe { self.slot_bytes(pin.slot) })?;
                self.clear_dirty(pin.slot);
            }
        }
        // An evicted group was written back without a sync: sync regardless.
        let taken: Vec<(GroupIndex, u64)> = self
            .unsynced
            .lock()
            .remove(&g)
            .map(|generation| (g, generation))
            .into_iter()
            .collect();
        self.sync_taken(taken)?;
        self.meta.flush_one(g.0).map_err(CascadeError::MetaSync)
    }

    /// Writes back every dirty group and makes everything durable. Returns
    /// the first error; groups that failed stay dirty in T1.
    pub fn sync_all(&self) -> Result<(), CascadeError> {
        let _one = self.sync_lock.lock();
        let mut first_err: Option<CascadeError> = None;
        let pinned: Vec<Pin<'_>> = loop {
            let st = self.state.lock();
            let busy = (0..self.n_slots as usize).any(|s| {
                st.slot_state[s] == SlotState::Evicting && self.dirty[s].load(Ordering::Acquire)
            });
            if busy {
                // An eviction is writing a group back; let it finish (or fail
                // and leave the group dirty for us).
                drop(st);
                std::thread::sleep(Duration::from_micros(100));
                continue;
            }
            break (0..self.n_slots)
                .filter(|&s| {
                    st.slot_state[s as usize] == SlotState::Resident
                        && self.dirty[s as usize].load(Ordering::Acquire)
                })
                .map(|s| self.pin_now(SlotId(s)))
                .collect();
        };
        for chunk in pinned.chunks(SYNC_BATCH) {
            // Slot locks first, then stripes in order: never the other way
            // round, so no thread can wait on us while we wait on it.
            let guards: Vec<_> = chunk
                .iter()
                .map(|p| self.slot_locks[p.slot.0 as usize].read())
                .collect();
            let work: Vec<(SlotId, GroupIndex)> = chunk
                .iter()
                .filter(|p| self.dirty[p.slot.0 as usize].load(Ordering::Acquire))
                .map(|p| {
                    (
                        p.slot,
                        GroupIndex(self.tags[p.slot.0 as usize].load(Ordering::Acquire)),
                    )
                })
                .filter(|(_, g)| g.0 != NO_GROUP)
                .collect();
            let mut stripe_ids: Vec<usize> = work
                .iter()
                .map(|(_, g)| (g.0 % STRIPES as u64) as usize)
                .collect();
            stripe_ids.sort_unstable();
            stripe_ids.dedup();
            let _io: Vec<_> = stripe_ids.iter().map(|&i| self.stripes[i].lock()).collect();
            // We hold the stripes: the metadata cannot change under us.
            let metas: Vec<GroupMeta> = work.iter().map(|&(_, g)| self.meta.get(g.0)).collect();
            let ops: Vec<WriteOp<'_>> = work
                .iter()
                .zip(&metas)
                .map(|(&(s, g), m)| WriteOp {
                    index: copy_index(g, Self::target_copy(m)),
                    // SAFETY: we hold s's read lock (guards) until after the batch.
                    buf: unsafe { self.slot_bytes(s) },
                })
                .collect();
            let results = self.tier.write_batch(&ops);
            for (((&(s, g), op), r), m) in work.iter().zip(&ops).zip(results).zip(&metas) {
                match r {
                    Ok(()) => {
                        self.record_written(g, op.buf, Self::target_copy(m), m);
                        self.clear_dirty(s);
                    }
                    Err(e) => {
                        self.counters
                            .write_back_failures
                            .fetch_add(1, Ordering::Relaxed);
                        first_err.get_or_insert(e.into());
                    }
                }
            }
            drop(guards);
        }
        drop(pinned);
        if let Some(e) = first_err {
            return Err(e);
        }
        let taken: Vec<(GroupIndex, u64)> = std::mem::take(&mut *self.unsynced.lock())
            .into_iter()
            .collect();
        self.sync_taken(taken)?;
        self.meta.flush_all().map_err(CascadeError::MetaSync)
    }

    /// Where `g` is and whether it is dirty.
    pub fn query(&self, g: GroupIndex) -> Result<GroupState, CascadeError> {
        self.check_index(g)?;
        let m = self.meta.get(g.0);
        let backing_crc = m.written.then_some(m.crc);
        let st = self.state.lock();
        if let Some(&s) = st.map.get(&g) {
            return Ok(GroupState {
                residence: Residence::T1,
                dirty: self.dirty[s.0 as usize].load(Ordering::Acquire),
                backing_crc,
            });
        }
        Ok(GroupState {
            residence: if m.written {
                Residence::Backing
            } else {
                Residence::Empty
            },
            dirty: false,
            backing_crc,
        })
    }

    /// The groups resident in T1, sorted.
    pub fn resident(&self) -> Vec<GroupIndex> {
        let mut v: Vec<GroupIndex> = self.state.lock().map.keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub fn stats(&self) -> CascadeStats {
        let c = &self.counters;
        let used = self.state.lock().map.len() as u64;
        let dirty = c.dirty_slots.load(Ordering::Relaxed);
        CascadeStats {
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            empty_reads: c.empty_reads.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            flushes: c.flushes.load(Ordering::Relaxed),
            flushed_bytes: c.flushed_bytes.load(Ordering::Relaxed),
            checksum_failures: c.checksum_failures.load(Ordering::Relaxed),
            recovered_reads: c.recovered_reads.load(Ordering::Relaxed),
            write_back_failures: c.write_back_failures.load(Ordering::Relaxed),
            t1_read_bytes: c.t1_read_bytes.load(Ordering::Relaxed),
            t1_write_bytes: c.t1_write_bytes.load(Ordering::Relaxed),
            backing_read_bytes: c.backing_read_bytes.load(Ordering::Relaxed),
            backing_write_bytes: c.backing_write_bytes.load(Ordering::Relaxed),
            t1_slots_used: used,
            t1_slots_total: self.n_slots as u64,
            dirty_slots: dirty,
            dirty_bytes: dirty * self.layout.group_bytes(),
        }
    }
}

impl Cascade {
    /// Ends the cascade as a crash would: no final write-back or sync
    /// (crash-consistency tests; the store's lock is released).
    #[doc(hidden)]
    pub fn crash(mut self) {
        self.crashed = true;
    }
}

impl Drop for Cascade {
    fn drop(&mut self) {
        if self.crashed {
            return;
        }
        if let Err(e) = self.sync_all() {
            tracing::error!("flush on close failed; dirty groups were lost: {e}");
        }
    }
}
