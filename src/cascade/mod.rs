//! The cascade: T1, a bounded write-back cache of group slots, over a backing tier.
//!
//! Invariants: (1) the cascade is bit-identical to its backing alone (the
//! property test checks it against a HashMap); (2) a slot is never
//! overwritten while a copy out of it runs; (3) a dirty victim reaches the
//! backing before its slot is reused, and if that write fails the victim
//! stays resident and dirty and the caller gets the error; (4) drop flushes
//! every dirty group, `flush`/`sync_all` make data durable on return;
//! (5) backing bytes that fail their crc32c are never served. One state
//! lock holds the bookkeeping (map, policy, free list, slot states) and is
//! never held across a copy or an I/O: copies run under per-slot locks,
//! backing I/O under per-group stripes. Rooms: `slots` (T1 memory, pins),
//! `claim` (taking and giving up slots), `read` and `write` (the data
//! paths), `writeback` (reaching the backing, durability).

mod claim;
mod meta;
mod policy;
mod read;
mod slotmap;
mod slots;
mod store;
mod write;
mod writeback;

pub use claim::SlotWrites;
pub use meta::{GroupMeta, META_RECORD_BYTES, MetaTable};
pub use policy::{Lru, Policy, PolicyKind, Sieve};
pub use read::GroupSink;
pub use slots::DevicePins;
pub use store::{Backing, BackingConfig, StoreError};

use crate::geometry::{GroupIndex, GroupLayout, OutOfRange};
use crate::gpu::{HostBuf, huge_vec};
use crate::tier::{Tier, TierError};
use parking_lot::{Condvar, Mutex, MutexGuard};
use slotmap::SlotMap;
use slots::{Arena, SlotMeta};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::mpsc;

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
    #[error(
        "group {0} is being written by a GPU STORE right now; a restore into GPU memory does not wait for that (retry once the store completes)"
    )]
    Busy(GroupIndex),
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
                TierError::Remote { errno, .. } | TierError::RemoteSync { errno, .. } => *errno,
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
            CascadeError::Busy(_) => libc::EAGAIN,
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
    /// Slots whose memory has arrived: T1 is allocated (pinned, with a
    /// GPU) in the background after the first chunk (`t1_ready_slots`).
    pub t1_slots_ready: u64,
    pub dirty_slots: u64,
    pub dirty_bytes: u64,
}

/// Hashes a group index for the slot map, which is probed on every read
/// and write under the state lock: cheap (two multiplies; group indices
/// are not attacker-chosen in a way that could hurt more than one
/// client's own cache, so SipHash's cost buys nothing here), and kind to
/// the cache. hashbrown takes a bucket from the hash's low bits and a tag
/// from its top 7: the low INDEX_RUN_BITS of the index stay as they are,
/// so each run of 64 consecutive groups (a layer's blocks, a sequence's
/// K and V) lands in 64 neighbouring buckets, a few cache lines, where
/// every group of a batch would otherwise miss the cache on its own; the
/// bits above are mixed (the high half of a Fibonacci product), so
/// indices a power of two apart (one block across layers) spread out;
/// and the tag mixes every bit, so neighbours rarely share one.
#[derive(Default)]
struct IndexHasher(u64);

/// Low bits of a group index its hash keeps (see IndexHasher).
const INDEX_RUN_BITS: u32 = 6;

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
        const FIB: u64 = 0x9e37_79b9_7f4a_7c15;
        let run = v & ((1 << INDEX_RUN_BITS) - 1);
        let spread = ((v >> INDEX_RUN_BITS).wrapping_mul(FIB) >> 32) << INDEX_RUN_BITS;
        let tag = (v ^ (v >> 29)).wrapping_mul(FIB) & (0x7f << 57);
        self.0 = tag | ((spread | run) & ((1 << 57) - 1));
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

/// A T1 chunk: on huge pages registered with the driver
/// (`KVFS_T1_PAGES=huge`) or the driver's own pinned allocation (the
/// default, `driver`).
fn t1_alloc(bytes: usize) -> io::Result<HostBuf> {
    static HUGE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let huge = *HUGE.get_or_init(|| {
        let huge = std::env::var("KVFS_T1_PAGES").is_ok_and(|v| v == "huge");
        tracing::info!(
            "T1 chunks: {}",
            if huge {
                "huge pages, registered with the driver"
            } else {
                "the driver's pinned allocation"
            }
        );
        huge
    });
    match huge {
        true => HostBuf::alloc_huge(bytes),
        false => HostBuf::alloc(bytes),
    }
}

struct State {
    map: SlotMap,
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
    /// Each slot's words (lock, pins, group, flags, memory), together.
    slots: Box<[SlotMeta]>,
    state: Mutex<State>,
    /// The policy's hit bits where a hit is one bit (SIEVE): restores
    /// into GPU memory set them outside the state lock, after each slot's
    /// read lock (see `Policy::marks`); None: hits go through `touch`.
    marks: Option<std::sync::Arc<policy::Marks>>,
    /// Spare slots a GPU store's copies on write let go (see
    /// `claim_slots`): free, unpinned and unlocked, kept here until the
    /// next claim moves them onto the free list under the state lock, so
    /// that a store's commit never waits for that lock (behind other
    /// tickets' claims) only to give them back.
    spares: Mutex<Vec<SlotId>>,
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
    /// What opening the backing found worth telling the operator.
    notes: Vec<String>,
}
impl Cascade {
    /// Opens a backing directory and puts a T1 over it.
    pub fn open(backing: &BackingConfig, cfg: CascadeConfig) -> Result<Cascade, anyhow::Error> {
        let b = Backing::open(backing)?;
        let mut c = Cascade::new(b.layout, b.tier, b.meta, cfg)?;
        c.epoch = b.epoch;
        c.notes = b.notes;
        // The store stays locked for as long as the cascade lives.
        c.store_lock = Some(b.lock);
        Ok(c)
    }

    // Kept whole: T1 sizing, first chunk, background allocator and struct read best in order.
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
        let first = t1_alloc(first_bytes as usize).map_err(|source| CascadeError::Alloc {
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
                        match t1_alloc(bytes as usize) {
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
        let marks = policy.marks();
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
            slots: huge_vec(n_slots as usize, |i| SlotMeta::new(i as u32)).into_boxed_slice(),
            state: Mutex::new(State {
                // Sized for a full T1 up front, like the per-slot arrays: a
                // rehash of a large map under the state lock would stall
                // every reader and writer for milliseconds.
                map: SlotMap::new(n_slots as usize),
                slot_state: huge_vec(n_slots as usize, |_| SlotState::Free),
                // Reversed so slot 0 is used first.
                free: (0..first_slots).rev().map(SlotId).collect(),
                policy,
            }),
            marks,
            spares: Mutex::new(Vec::new()),
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
            notes: Vec::new(),
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

    /// Warnings from opening the backing (a remote server that persists
    /// nothing, say), for the operator.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// The remote tier's servers, as the operator named them; None for a
    /// local tier.
    pub fn tier_remote(&self) -> Option<String> {
        self.tier.remote()
    }

    /// Lets go of the tier's kernel resources that would outlive the
    /// process by a moment (see `Tier::quiesce`); for the daemon's exit.
    pub fn quiesce_tier(&self) {
        self.tier.quiesce()
    }

    /// Appends the tier's own metrics (remote tiers) to an exposition.
    pub fn render_tier_stats(&self, e: &mut crate::stats::Exposition) {
        self.tier.render_stats(e)
    }

    pub fn t1_slots(&self) -> u32 {
        self.n_slots
    }

    fn stripe(&self, g: GroupIndex) -> MutexGuard<'_, ()> {
        self.stripes[(g.0 % STRIPES as u64) as usize].lock()
    }

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

    /// Where `g` is and whether it is dirty.
    pub fn query(&self, g: GroupIndex) -> Result<GroupState, CascadeError> {
        self.check_index(g)?;
        let m = self.meta.get(g.0);
        let backing_crc = m.written.then_some(m.crc);
        let st = self.state.lock();
        if let Some(s) = st.map.get(&g) {
            return Ok(GroupState {
                residence: Residence::T1,
                dirty: self.slots[s.0 as usize].dirty.load(Ordering::Acquire),
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

    /// Groups holding bytes: written back at least once (the metadata
    /// keeps the count) or dirty in T1 and never written back. Costs a
    /// look at each T1 slot, not at the geometry (`df`).
    pub fn used_groups(&self) -> u64 {
        let fresh = (0..self.n_slots as usize)
            .filter(|&s| {
                self.slots[s].dirty.load(Ordering::Acquire) && {
                    let g = self.slots[s].tag.load(Ordering::Acquire);
                    g != NO_GROUP && g < self.meta.count() && !self.meta.get(g).written
                }
            })
            .count() as u64;
        (self.meta.written_count() + fresh).min(self.layout.group_count())
    }

    /// The groups resident in T1, sorted.
    pub fn resident(&self) -> Vec<GroupIndex> {
        let mut v: Vec<GroupIndex> = self.state.lock().map.keys().collect();
        v.sort_unstable();
        v
    }

    pub fn stats(&self) -> CascadeStats {
        let c = &self.counters;
        let used = {
            let mut st = self.state.lock();
            self.adopt_chunks(&mut st);
            st.map.len() as u64
        };
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
            t1_slots_ready: self.arena.ready_slots.load(Ordering::Relaxed),
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

#[cfg(test)]
mod tests {
    use super::{INDEX_RUN_BITS, IndexHasher};
    use std::collections::HashSet;
    use std::hash::Hasher;

    fn hash(v: u64) -> u64 {
        let mut h = IndexHasher::default();
        h.write_u64(v);
        h.finish()
    }

    /// Neighbouring groups land in neighbouring buckets, groups a power of
    /// two apart do not share a bucket, and tags differ among neighbours.
    #[test]
    fn index_hash_keeps_runs_together_and_spreads_the_rest() {
        let mask = (1u64 << 20) - 1; // the buckets of a T1 of 512Ki slots
        let base = 5u64 << 30;
        let run = 1u64 << INDEX_RUN_BITS;
        for i in 1..run {
            assert_eq!(hash(base + i) & mask, (hash(base) & mask) + i);
        }
        let tags: HashSet<u64> = (0..run).map(|i| hash(base + i) >> 57).collect();
        assert!(
            tags.len() > 32,
            "{} tags among {run} neighbours",
            tags.len()
        );
        // One block across 80 layers, layers 2^20 groups apart.
        let starts: HashSet<u64> = (0..80u64).map(|l| hash(7 + (l << 20)) & mask).collect();
        assert!(starts.len() >= 78, "{} buckets for 80 groups", starts.len());
    }
}
