//! Submission and completion rings: RESTORE and STORE without a trip
//! through FUSE.
//!
//! Every request on the control fd crosses FUSE (~16 µs on this machine),
//! and a ticket needs two (the request and its WAIT). A client that sets up
//! a ring (RING: a host region of its own, `count` entries, the ring at
//! byte `arg1`) instead writes submission entries into shared memory and
//! reaps completion entries from it; a thread of the session takes the
//! submissions, admits them exactly as requests with their entries in a
//! region (all-or-nothing, the same checks and errors), and posts one
//! completion entry per submission, with its ticket's result, when the
//! ticket ends (or at once, for a submission refused). Nobody makes a
//! system call while the other side is busy: a sleeping side is woken with
//! a futex on the shared tail it waits for. The idea is the one behind
//! io_uring and 3FS's USRBIO.
//!
//! Layout (little-endian; u32 indices run freely, slot = index mod count):
//!
//! | at | field |
//! | --- | --- |
//! | 0 | SQ head (the daemon: submissions taken) |
//! | 64 | SQ tail (the client: submissions written) |
//! | 128 | CQ head (the client: completions reaped) |
//! | 192 | CQ tail (the daemon: completions written) |
//! | 256 | the daemon sleeps on SQ tail (1): wake it after a submission |
//! | 320 | the client sleeps on CQ tail (1): the daemon wakes it |
//! | 4096 | `count` submission entries of 32 bytes |
//! | 4096 + 32 × count | `count` completion entries of 32 bytes |
//!
//! Submission: user_data u64, command u32 (4 RESTORE, 5 STORE), count
//! u32, arg0 u64, arg1 u64: a RESTORE/STORE header with its entries in a
//! region (`arg0` flag 1 set, the region in its high 32 bits; flag 2 for
//! strided entries), any host region of the fd, the ring's own too.
//! Completion: user_data u64, ticket u64 (0 when refused), status u32 (0
//! or an errno), entry u32 (the first failed entry, or NO_ENTRY), failed
//! u32 (entries that failed), pad u32. A ring ticket is collected by its
//! completion entry (WAIT does not know it). The daemon takes a submission
//! only while fewer than `count` are taken and not yet reaped, so the
//! completion ring never overflows; a client that reaps nothing stalls its
//! own ring and nobody else's.

use super::region::Region;
use super::session::Session;
use super::wire::{self, Command, NO_ENTRY, Request};
use super::{Rejection, reject};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub const RING_HEADER_BYTES: u64 = 4096;
pub const SQE_BYTES: u64 = 32;
pub const CQE_BYTES: u64 = 32;
pub const MAX_RING_ENTRIES: u32 = 1 << 16;

pub const SQ_HEAD: usize = 0;
pub const SQ_TAIL: usize = 64;
pub const CQ_HEAD: usize = 128;
pub const CQ_TAIL: usize = 192;
pub const SQ_SLEEPING: usize = 256;
pub const CQ_WAITING: usize = 320;

/// How long the ring thread looks for new submissions before it sleeps.
const SPIN: Duration = Duration::from_micros(50);
/// How long it looks while tickets it took are still running, counted
/// from the last completion: a client that waits for each ticket before
/// it submits the next (an engine restoring layer by layer) submits right
/// after a completion, and a sleeping ring thread costs it a wake-up
/// (tens of microseconds) every ticket. Bounded, so a long ticket (misses
/// read from a slow backing) does not keep a core busy; and only where
/// cores are to spare (`spare_cores`): on two, the spinning thread takes
/// time from the very copies it waits for.
const FLIGHT_SPIN: Duration = Duration::from_millis(1);

/// The longest a sleep lasts (a missed wake-up costs at most this).
const NAP: Duration = Duration::from_millis(10);

/// Whether this machine has cores to spare for looking instead of
/// sleeping (4 or more).
pub fn spare_cores() -> bool {
    static SPARE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SPARE.get_or_init(|| std::thread::available_parallelism().is_ok_and(|n| n.get() >= 4))
}

/// Bytes of a ring of `entries` entries.
pub fn ring_bytes(entries: u32) -> u64 {
    RING_HEADER_BYTES + (SQE_BYTES + CQE_BYTES) * entries as u64
}

/// One completion entry.
pub(super) struct Cqe {
    pub user_data: u64,
    pub ticket: u64,
    pub status: u32,
    pub entry: u32,
    pub failed: u32,
}

impl Cqe {
    /// The completion of `ticket` from its finished reply.
    pub(super) fn of(user_data: u64, ticket: u64, r: &super::wire::Reply) -> Cqe {
        Cqe {
            user_data,
            ticket,
            status: r.status,
            entry: r.entry,
            failed: r.failed,
        }
    }
}

/// A session's ring (see the module note).
pub struct Ring {
    region: Arc<Region>,
    base: *mut u8,
    entries: u32,
    stop: AtomicBool,
    /// Serialises completion posting (tickets end on many threads).
    post: parking_lot::Mutex<()>,
}

// SAFETY: `base` points into `region`'s shared mapping, which the ring
// keeps alive; the fields the two sides share are accessed as atomics, and
// entries are copied in and out (a client scribbling on them can only
// garble its own requests, which admission checks like any other).
unsafe impl Send for Ring {}
// SAFETY: as for Send.
unsafe impl Sync for Ring {}

/// futex(2) on a u32 of a shared mapping (FUTEX_WAIT with `val` and an
/// optional timeout, or FUTEX_WAKE of `val` waiters); the daemon's ring
/// thread and the Rust client both use it.
pub fn futex(addr: &AtomicU32, op: i32, val: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: addr is a live, aligned u32 of a shared mapping (not a
    // private futex: the client waits on the same word from its process).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            addr.as_ptr(),
            op,
            val,
            tsp,
            std::ptr::null::<u32>(),
            0,
        );
    }
}

impl Ring {
    /// A ring of `entries` entries at `offset` of the host region.
    pub(super) fn new(region: Arc<Region>, offset: u64, entries: u32) -> Result<Ring, Rejection> {
        if region.is_cuda() {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                "a ring lives in a host region, not GPU memory",
            ));
        }
        if !entries.is_power_of_two() || entries > MAX_RING_ENTRIES {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "a ring of {entries} entries: give a power of two up to {MAX_RING_ENTRIES}"
                ),
            ));
        }
        let need = ring_bytes(entries);
        if !offset.is_multiple_of(4096) || offset > region.len() || region.len() - offset < need {
            return Err(reject(
                libc::EFAULT,
                NO_ENTRY,
                format!(
                    "a ring of {entries} entries needs {need} bytes at a 4096-aligned offset; \
                     region of {} bytes, offset {offset}",
                    region.len()
                ),
            ));
        }
        // SAFETY: in bounds (checked above); the range stays mapped while
        // `region` lives, which the ring holds.
        let base = unsafe { region.range(offset, need as usize).as_ptr() as *mut u8 };
        let r = Ring {
            region,
            base,
            entries,
            stop: AtomicBool::new(false),
            post: parking_lot::Mutex::new(()),
        };
        // A fresh ring: the client may not have zeroed it.
        for at in [SQ_HEAD, SQ_TAIL, CQ_HEAD, CQ_TAIL, SQ_SLEEPING, CQ_WAITING] {
            r.word(at).store(0, Ordering::Release);
        }
        Ok(r)
    }

    fn word(&self, at: usize) -> &AtomicU32 {
        // SAFETY: `at` is a 4-aligned header offset inside the ring; the
        // mapping is page-aligned and lives as long as `self`.
        unsafe { &*(self.base.add(at) as *const AtomicU32) }
    }

    fn slot(&self, first: u64, index: u32, bytes: u64) -> *mut u8 {
        let i = (index & (self.entries - 1)) as u64;
        // SAFETY: in bounds: slot i of `entries`, inside the checked range.
        unsafe { self.base.add((first + i * bytes) as usize) }
    }

    /// Tells the ring thread to end (the fd closed or another ring replaced it).
    pub(super) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        futex(self.word(SQ_TAIL), libc::FUTEX_WAKE, i32::MAX as u32, None);
    }

    /// Posts a completion and wakes a client sleeping for one.
    pub(super) fn post(&self, c: Cqe) {
        let _g = self.post.lock();
        let tail = self.word(CQ_TAIL).load(Ordering::Relaxed);
        let p = self.slot(
            RING_HEADER_BYTES + SQE_BYTES * self.entries as u64,
            tail,
            CQE_BYTES,
        );
        let mut b = [0u8; CQE_BYTES as usize];
        b[0..8].copy_from_slice(&c.user_data.to_le_bytes());
        b[8..16].copy_from_slice(&c.ticket.to_le_bytes());
        b[16..20].copy_from_slice(&c.status.to_le_bytes());
        b[20..24].copy_from_slice(&c.entry.to_le_bytes());
        b[24..28].copy_from_slice(&c.failed.to_le_bytes());
        // SAFETY: p is a CQE slot (32 bytes) of the ring.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), p, b.len()) };
        self.word(CQ_TAIL)
            .store(tail.wrapping_add(1), Ordering::Release);
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.word(CQ_WAITING).load(Ordering::Acquire) != 0 {
            futex(self.word(CQ_TAIL), libc::FUTEX_WAKE, i32::MAX as u32, None);
        }
    }

    /// Waits for submission `head` and room to take it: its bytes, or None
    /// when the ring ends.
    fn next(&self, head: u32) -> Option<[u8; SQE_BYTES as usize]> {
        let mut idle_since: Option<Instant> = None;
        let mut posted = self.word(CQ_TAIL).load(Ordering::Acquire);
        loop {
            if self.stop.load(Ordering::Acquire) || self.region.damaged() {
                return None;
            }
            let tail = self.word(SQ_TAIL).load(Ordering::Acquire);
            // Taken and not yet reaped: at most `entries` (no CQ overflow).
            let reaped = self.word(CQ_HEAD).load(Ordering::Acquire);
            let room = head.wrapping_sub(reaped) < self.entries;
            if tail != head && room {
                let mut b = [0u8; SQE_BYTES as usize];
                let p = self.slot(RING_HEADER_BYTES, head, SQE_BYTES);
                // SAFETY: p is an SQE slot (32 bytes) of the ring.
                unsafe { std::ptr::copy_nonoverlapping(p, b.as_mut_ptr(), b.len()) };
                return Some(b);
            }
            // A completion since: the client may submit again at once.
            let cq_tail = self.word(CQ_TAIL).load(Ordering::Acquire);
            if cq_tail != posted {
                posted = cq_tail;
                idle_since = None;
            }
            // Taken and not yet completed (CQ tail counts every posted
            // completion, one a taken submission).
            let running = head != cq_tail && spare_cores();
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() < if running { FLIGHT_SPIN } else { SPIN } {
                std::hint::spin_loop();
                std::thread::yield_now();
                continue;
            }
            if !room {
                // Waiting for the client to reap: it writes CQ head without
                // waking anyone, so look again shortly.
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
            self.word(SQ_SLEEPING).store(1, Ordering::Release);
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.word(SQ_TAIL).load(Ordering::Acquire) == head
                && !self.stop.load(Ordering::Acquire)
            {
                futex(self.word(SQ_TAIL), libc::FUTEX_WAIT, head, Some(NAP));
            }
            self.word(SQ_SLEEPING).store(0, Ordering::Release);
            idle_since = None;
        }
    }

    /// The ring thread: takes submissions until the ring ends.
    pub(super) fn run(self: Arc<Ring>, session: std::sync::Weak<Session>) {
        let mut head = self.word(SQ_HEAD).load(Ordering::Acquire);
        while let Some(b) = self.next(head) {
            head = head.wrapping_add(1);
            self.word(SQ_HEAD).store(head, Ordering::Release);
            let Some(s) = session.upgrade() else { return };
            let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
            let user_data = u64_at(0);
            let command = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
            let count = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
            let (arg0, arg1) = (u64_at(16), u64_at(24));
            match Self::request(command, count, arg0, arg1) {
                Ok((h, req)) => s.ring_submit(&self, user_data, req, wire::done_word(&h)),
                Err(rj) => self.post(Cqe {
                    user_data,
                    ticket: 0,
                    status: rj.errno as u32,
                    entry: rj.entry,
                    failed: 0,
                }),
            }
        }
    }

    /// The request a submission names: RESTORE or STORE with its entries
    /// in a region, through the wire decoder (the same checks).
    fn request(
        command: u32,
        count: u32,
        arg0: u64,
        arg1: u64,
    ) -> Result<(wire::Header, Request), Rejection> {
        let cmd = u16::try_from(command)
            .ok()
            .and_then(Command::from_u16)
            .filter(|c| matches!(c, Command::Restore | Command::Store));
        let Some(cmd) = cmd else {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!("ring command {command}: only RESTORE (4) and STORE (5)"),
            ));
        };
        if arg0 & wire::ENTRIES_IN_REGION == 0 {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                "a ring submission names its entries in a region (arg0 flag 1)",
            ));
        }
        let h = wire::Header {
            command: cmd as u16,
            count,
            arg0,
            arg1,
        };
        let mut raw = Vec::with_capacity(wire::HEADER_BYTES);
        wire::encode_header(&mut raw, wire::REQUEST_MAGIC, &h);
        wire::decode(&raw).map_err(|e| reject(libc::EINVAL, NO_ENTRY, e.to_string()))
    }
}
