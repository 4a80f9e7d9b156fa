//! RESTORE/STORE into and out of CUDA regions: the cascade's side of the
//! GPU transfer engine (`crate::gpu::engine`).
//!
//! The engine copies; this room decides what it copies. A restore is
//! enqueued on admission (so the reply can carry the ticket's IPC event).
//! A batch all in T1 (up to PIN_ON_ADMISSION_MAX groups; a bigger one in
//! parts where the fd holds no other ticket) is pinned then and there (its slots cannot be
//! evicted or rewritten until the copy is done), its descriptors written
//! and its copy let go on the fd's ordered lane, with no staging; the
//! engine's completion thread waits for it and unpins. Any other batch is
//! resolved by an executor job (on the lane too where only its size sent
//! it there, else on a stream of its own, holding nobody up):
//! T1 hits are pinned and read by the kernel through the device mapping,
//! misses read from the backing into the engine's staging. A store claims
//! T1 slots the kernel may write straight into (groups new to T1, in it
//! and clean, or in it and dirty: those get a free slot, and their old one
//! is freed once the copy is done); the rest (a busy slot, no free slot
//! left) land in staging and are written into T1 after.

use super::admit::{Batch, Item};
use super::descs::{Shape, pieces, restore_descs};
use super::done::DoneWord;
use super::session::Session;
use super::wire::{Command, NO_ENTRY, Reply};
use super::{Rejection, reject};
use crate::cascade::DevicePins;
use crate::cascade::{Cascade, CascadeError};
use crate::geometry::GroupIndex;
use crate::gpu::engine::{Engine, Lane, OnLane, PartedRestore, PooledEvent, Restore, Runs};
use std::sync::Arc;
use std::time::Instant;

/// How restores of pinned T1 groups copy (`KVFS_GPU_COPY`): `auto`
/// (the default) puts a batch on the copy engines when its copies join
/// into runs of at least ENGINE_RUN_BYTES on average, else runs the gather
/// kernel; `engines` and `kernel` force one.
#[derive(Clone, Copy, PartialEq)]
enum CopyMode {
    Auto,
    Engines,
    Kernel,
}

/// The largest RESTORE pinned on admission. Pinning costs ~100 ns a
/// group of random lookups (measured on the H200 host: ~0.42 ms for 4096),
/// and admission serves a session's requests one at a time, where the
/// executor pins several tickets' groups at once: bigger batches go there
/// (on the gather kernel).
const PIN_ON_ADMISSION_MAX: usize = 2048;

/// Auto mode's average run for the copy engines: shorter runs go faster
/// through the gather kernel.
const ENGINE_RUN_BYTES: usize = 64 << 10;

/// Copies auto mode looks at before it judges a batch by the runs so far
/// (each costs tens of nanoseconds on the admission path).
const PROJECT_AFTER: usize = 64;

fn copy_mode() -> CopyMode {
    static MODE: std::sync::OnceLock<CopyMode> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("KVFS_GPU_COPY").as_deref() {
        Ok("engines") => CopyMode::Engines,
        Ok("kernel") => CopyMode::Kernel,
        _ => CopyMode::Auto,
    })
}

/// Every entry's result after one copy of the whole batch.
fn copy_results(n: usize, r: &Result<(), String>) -> Vec<Result<(), CascadeError>> {
    if let Err(e) = r {
        tracing::error!("a GPU restore failed: {e}");
    }
    (0..n)
        .map(|_| match r {
            Ok(()) => Ok(()),
            Err(e) => Err(CascadeError::RegionFault(format!("GPU copy failed: {e}"))),
        })
        .collect()
}

/// Groups a part of a restore pinned on admission holds at least:
/// 256 groups of 16 KiB are ~75 µs of copy, longer than looking up,
/// pinning and describing the next 256.
const RESTORE_PART_GROUPS: usize = 256;
/// Parts such a restore is launched in at most.
const RESTORE_PARTS_MAX: usize = 8;

/// When a restore pinned on admission is launched in parts
/// (`KVFS_RESTORE_PART_GROUPS`): by default (`auto`) only when no other
/// ticket of its lane is copying, as one ticket at a time (parts of
/// RESTORE_PART_GROUPS): on the H200 parts sped one ticket at a time
/// (0.53× of one big copy against 0.46×) but slowed 4 in flight through
/// the ring (0.84× against 0.90×; the lane runs the parts' small launches
/// one after another). `on` or `1`: always; a number: always, parts of at
/// least that many groups; `off` or 0: never.
#[derive(Clone, Copy, PartialEq, Debug)]
enum PartsWhen {
    Idle(usize),
    Always(usize),
    Never,
}

impl PartsWhen {
    fn parse(v: Option<&str>) -> PartsWhen {
        match v {
            None | Some("auto") => PartsWhen::Idle(RESTORE_PART_GROUPS),
            Some("on") | Some("1") => PartsWhen::Always(RESTORE_PART_GROUPS),
            Some(v) => match v.parse() {
                Ok(0) | Err(_) => PartsWhen::Never,
                Ok(n) => PartsWhen::Always(n),
            },
        }
    }

    /// The parts a restore of `n` groups pinned on admission is launched
    /// in, with `busy` other tickets of its lane copying.
    fn parts(self, n: usize, busy: usize) -> usize {
        let Some(least) = self.least(busy) else {
            return 1;
        };
        (n / least).clamp(1, RESTORE_PARTS_MAX)
    }

    /// `parts`, for a restore pinned on admission: by default one part
    /// for a batch over PIN_ON_ADMISSION_MAX unless `alone` (see
    /// `restore_parts`).
    fn on_admission(self, n: usize, busy: usize, alone: bool) -> usize {
        match self {
            PartsWhen::Idle(_) if n > PIN_ON_ADMISSION_MAX && !alone => 1,
            _ => self.parts(n, busy),
        }
    }

    /// The least groups of a part where parts are wanted, `busy` other
    /// tickets of the lane copying; None where they are not.
    fn least(self, busy: usize) -> Option<usize> {
        match self {
            PartsWhen::Idle(g) if busy == 0 => Some(g),
            PartsWhen::Always(g) => Some(g),
            _ => None,
        }
    }

    /// Where the parts of a restore of `n` groups pinned by an executor
    /// job end (see `restore_later`), `busy` other tickets of its lane
    /// copying: up to three, each half as big again as the one before
    /// (looking a 4 KiB group up and pinning it takes about two thirds of
    /// its copy), none under RESTORE_PART_GROUPS; `[n]`, one part, where
    /// parts are not wanted.
    fn later_ends(self, n: usize, busy: usize) -> Vec<usize> {
        if self.least(busy).is_none() {
            return vec![n];
        }
        // Parts of 4, 6 and 9 nineteenths, or 2 and 3 fifths.
        let weights: &[usize] = match n * 4 / 19 >= RESTORE_PART_GROUPS {
            true => &[4, 6, 9],
            false if n * 2 / 5 >= RESTORE_PART_GROUPS => &[2, 3],
            false => &[1],
        };
        let total: usize = weights.iter().sum();
        let mut sum = 0;
        weights
            .iter()
            .map(|w| {
                sum += w;
                n * sum / total
            })
            .collect()
    }
}

/// The parts a restore of `n` groups pinned on admission is launched in,
/// `busy` other tickets of its lane copying (see `PartsWhen`); `alone`:
/// the fd holds no other ticket (running, or ended and not collected).
/// By default (`auto`) a batch over PIN_ON_ADMISSION_MAX goes in parts
/// only when alone: its admission pins every group before the RESTORE
/// call returns (~0.4–0.6 ms for 4096), and a client with tickets
/// outstanding is pipelining: each of its calls then found the lane
/// idle again, the copy of the ticket before having ended during that
/// very call, and it stayed one ticket at a time (4 KiB × 4096, 4 in
/// flight through RESTORE calls, an H100, 2026-12-07: 0.45× of one big
/// copy, RESTORE calls of 581 µs, against 0.86× through the ring).
fn restore_parts(n: usize, busy: usize, alone: bool) -> usize {
    if copy_mode() == CopyMode::Engines {
        return 1;
    }
    parts_when().on_admission(n, busy, alone)
}

/// Where the parts of a restore of `n` groups pinned on admission end,
/// launched in `parts` parts: equal parts, or (`first`, see
/// `part_first`) a first part of `first` groups and each
/// next one twice the one before, the last taking what is left, at most
/// RESTORE_PARTS_MAX. A small first part starts the copy sooner (its
/// groups looked up and pinned sooner); doubling keeps each next part's
/// look ups shorter than the copy before it (a 4 KiB group takes about
/// two thirds of its copy to look up and pin).
fn admission_ends(n: usize, parts: usize, first: Option<usize>) -> Vec<usize> {
    let Some(first) = first.filter(|_| parts > 1) else {
        let size = n.div_ceil(parts.max(1));
        return (1..=n.div_ceil(size)).map(|k| (k * size).min(n)).collect();
    };
    let mut ends = Vec::new();
    let (mut at, mut size) = (0, first.max(1));
    while at < n {
        // The last part takes what is left once the next would not fit
        // twice, or where the parts would run out.
        let end = match at + 2 * size >= n || ends.len() + 1 == RESTORE_PARTS_MAX {
            true => n,
            false => at + size,
        };
        ends.push(end);
        at = end;
        size *= 2;
    }
    ends
}

/// The first part of a restore launched in parts on admission, by
/// default: on an H100 (2026-12-07, eleventh session, three same-run
/// A/Bs) one 4 KiB × 4096 ticket at a time was seen landed in 655–668 µs
/// against 689–695 with equal parts, 16 KiB × 1024 in 570–580 against
/// 581–587; 4 in flight unchanged (no parts there); 32 no better.
const PART_FIRST: usize = 64;

/// `KVFS_RESTORE_PART_FIRST`: the first part's groups of a restore
/// launched in parts on admission (then doubling; default PART_FIRST);
/// 0: equal parts.
fn part_first() -> Option<usize> {
    static FIRST: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *FIRST.get_or_init(|| {
        match std::env::var("KVFS_RESTORE_PART_FIRST").map(|v| v.parse::<usize>()) {
            Ok(Ok(0)) => None,
            Ok(Ok(f)) => Some(f),
            _ => Some(PART_FIRST),
        }
    })
}

/// `KVFS_RESTORE_PART_STREAMS`: 2 puts every second part of a restore
/// launched in parts on admission on a second stream; 1 (the default)
/// keeps them all on the fd's lane. `tools/parts_probe.cu` on an H100
/// (2026-12-07): one 16 MiB restore in admission's parts landed in 353 /
/// 347 µs over two streams against 370 / 358 µs on one (4 KiB / 16 KiB
/// groups), but in kvfs, same-run A/Bs on two H100 hosts (2026-12-07,
/// twelfth session) found one 4 KiB × 4096 ticket at a time through the
/// ring no faster (0.46× / 0.49× against 0.52× / 0.63× on one stream).
fn part_streams() -> usize {
    static STREAMS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *STREAMS.get_or_init(
        || match std::env::var("KVFS_RESTORE_PART_STREAMS").as_deref() {
            Ok("2") => 2,
            _ => 1,
        },
    )
}

/// `KVFS_RESTORE_PART_GROUPS`, read once.
fn parts_when() -> PartsWhen {
    static WHEN: std::sync::OnceLock<PartsWhen> = std::sync::OnceLock::new();
    *WHEN
        .get_or_init(|| PartsWhen::parse(std::env::var("KVFS_RESTORE_PART_GROUPS").ok().as_deref()))
}

/// Whether a restore the executor pins on the fd's lane may go in parts
/// (`KVFS_RESTORE_LATER_PARTS`: `auto`, `on` or 1 as
/// `KVFS_RESTORE_PART_GROUPS` says, see `PartsWhen::later_ends`; unset,
/// `off` or 0: never). Off by default: on an H100 (2026-12-07, ninth
/// session) every GPU check passed with it on, but one 4 KiB ticket at a
/// time was no faster than without, and whether its parts were used was
/// not logged.
fn later_parts() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        matches!(
            std::env::var("KVFS_RESTORE_LATER_PARTS").as_deref(),
            Ok("auto") | Ok("on") | Ok("1")
        )
    })
}

/// Whether a restore resolved by an executor job goes on the fd's lane,
/// in order with its other tickets, not on a stream of its own
/// (`KVFS_RESTORE_LATER_LANE`: `auto`, the default, when its size alone
/// sent it there, not groups found missing or busy; `on` or 1; `off` or 0). Tickets
/// on streams of their own run side by side and end together, leaving the
/// bus idle while the next are pinned: 4 KiB × 4096 restores, 4 in flight,
/// ran at 0.76× / 0.79× of one big copy so (ioctls / ring), 0.87× / 0.88×
/// on the lane (an H100, 2026-12-07, same call). A batch with misses on
/// the lane holds the fd's later tickets until its backing reads are done.
fn later_on_lane(size_only: bool) -> bool {
    static WHEN: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let when = WHEN.get_or_init(
        || match std::env::var("KVFS_RESTORE_LATER_LANE").as_deref() {
            Ok("on") | Ok("1") => Some(true),
            Ok("off") | Ok("0") => Some(false),
            _ => None,
        },
    );
    when.unwrap_or(size_only)
}

/// What `restore_in_parts` did.
enum Parted {
    /// Every part launched: the ticket's reply.
    Done(Reply),
    /// The first part is not all in T1 (nothing held, nothing launched).
    NotInT1,
    /// The first part's slots join into copy-engine runs (nothing held,
    /// nothing launched): the whole batch goes to the copy engines.
    Runs,
    /// The first `done` entries launched; the rest not all in T1.
    Rest(Box<Held>),
}

/// The parts of a restore launched already, and their pins.
struct Held {
    /// First field, so dropped first: its drop waits for the copies
    /// before the pins go.
    copy: PartedRestore,
    done: usize,
    pins: Vec<DevicePins>,
}

fn restore_failed(e: String) -> Rejection {
    reject(
        libc::EIO,
        NO_ENTRY,
        format!("cannot start the GPU restore: {e}"),
    )
}

pub(super) fn no_driver() -> Rejection {
    reject(libc::ENODEV, NO_ENTRY, "no CUDA driver")
}

impl Session {
    /// A RESTORE into CUDA regions, enqueued before the reply: a batch all
    /// in T1 pinned and let go at once (copy engines or kernel), its slots
    /// released by the engine's completion thread after the copy; any
    /// other resolved and released by an executor job.
    ///
    /// Its ticket is taken first (a done word's value is the ticket
    /// number, written by the copy's stream), and taken back if the
    /// RESTORE is refused.
    pub(super) fn submit_gpu_restore(
        self: &Arc<Session>,
        work: Batch,
        admitted: Instant,
        done: Option<u16>,
    ) -> Result<Reply, Rejection> {
        crate::gpu::cuda::cuda().ok_or_else(no_driver)?;
        let ticket = self.new_ticket();
        let r = match done {
            Some(w) => self
                .claim_done_word(w, ticket, work.cuda_device())
                .and_then(|d| self.gpu_restore(work, admitted, ticket, Some(d))),
            None => self.gpu_restore(work, admitted, ticket, None),
        };
        if r.is_err() {
            self.forget_ticket(ticket);
        }
        r
    }

    /// `submit_gpu_restore` with its ticket (and done word) taken.
    fn gpu_restore(
        self: &Arc<Session>,
        work: Batch,
        admitted: Instant,
        ticket: u64,
        mut done: Option<DoneWord>,
    ) -> Result<Reply, Rejection> {
        let signal = DoneWord::signal(done.as_ref(), ticket);
        let gpu = self.ctl.gpu.on(work.cuda_device());
        let n = work.len();
        let layout = self.ctl.cascade.layout();
        let gb = layout.group_bytes();
        // Strided entries: by the rows kernel, or in pieces (see Shape).
        let shape = Shape::of(&work, gb);
        let (per, unit) = (shape.per, shape.unit);
        let checked = Instant::now();
        // Admission's checks of every entry (admit_io), before this call.
        let checks_us = (checked - admitted).as_micros() as u64;
        let timing = (admitted, checks_us);
        // A batch all in T1 (and of at most PIN_ON_ADMISSION_MAX groups)
        // is pinned here, looked up once, needs no staging, and goes on the
        // fd's ordered lane, let go before the lane is. A bigger one is
        // pinned here in parts only when the fd holds no other ticket (one
        // ticket at a time, see `restore_parts`), else by an executor job
        // (see `restore_later`), so a pipelining client's next submission
        // waits for none of it.
        let groups: Vec<GroupIndex> = work.items.iter().map(|it| it.g).collect();
        let lane = self.lane(&gpu);
        let busy = lane.busy();
        // Whether the fd holds other tickets (a look under the session's
        // lock) matters only to a big batch on an idle lane.
        let alone = n <= PIN_ON_ADMISSION_MAX || busy > 0 || self.holds_only(ticket);
        let parts = restore_parts(n, busy, alone);
        if parts > 1 {
            let parted = self.restore_in_parts(
                &gpu,
                &work,
                &groups,
                parts,
                shape,
                timing,
                (ticket, &mut done),
            )?;
            match parted {
                Parted::Done(reply) => return Ok(reply),
                Parted::NotInT1 => {
                    let t = (ticket, done);
                    return self.restore_later(gpu, work, groups, shape, None, timing, t, false);
                }
                Parted::Rest(held) => {
                    let t = (ticket, done);
                    return self.restore_later(
                        gpu,
                        work,
                        groups,
                        shape,
                        Some(*held),
                        timing,
                        t,
                        false,
                    );
                }
                Parted::Runs => {}
            }
        }
        let pinned = match n <= PIN_ON_ADMISSION_MAX {
            true => self.ctl.cascade.try_pin_resident(&groups),
            false => None,
        };
        let Some((addrs, pins)) = pinned else {
            let t = (ticket, done);
            let size_only = n > PIN_ON_ADMISSION_MAX;
            return self.restore_later(gpu, work, groups, shape, None, timing, t, size_only);
        };
        let resident_us = checked.elapsed().as_micros() as u64;
        let items = &work.items;
        if let Some(runs) = self.engine_runs(&gpu, &work, items, &addrs, gb, shape.engine_unit()) {
            let n_runs = runs.len();
            let copy = gpu
                .copy_runs(runs, &mut lane.lock(), signal)
                .map_err(restore_failed)?;
            let reply = self.gpu_reply(ticket, copy.event());
            tracing::debug!(
                ticket,
                n,
                runs = n_runs,
                admit_us = admitted.elapsed().as_micros() as u64,
                checks_us,
                resident_us,
                "GPU restore of pinned T1 groups on the copy engines"
            );
            let held = (pins, lane.enter(), done);
            self.release_after(&gpu, ticket, n, held, move || copy.finish());
            return Ok(reply);
        }
        // Described before it is enqueued: no flag to wait on.
        let runs_us = checked.elapsed().as_micros() as u64 - resident_us;
        let copy = gpu
            .restore_now(
                n * per,
                unit,
                shape.kernel_rows(true),
                &mut lane.lock(),
                restore_descs(&work, items, gb, shape, |i| addrs[i]),
                signal,
            )
            .map_err(restore_failed)?;
        let launched_us = checked.elapsed().as_micros() as u64;
        let reply = self.gpu_reply(ticket, copy.event());
        // Where admission's time goes: checks, pins, the look at the
        // copy engines' runs, descriptors and launch, the ticket.
        tracing::debug!(
            ticket,
            n,
            admit_us = admitted.elapsed().as_micros() as u64,
            checks_us,
            resident_us,
            runs_us,
            launch_us = launched_us - resident_us - runs_us,
            "GPU restore of pinned T1 groups by the kernel"
        );
        let held = (pins, lane.enter(), done);
        self.release_after(&gpu, ticket, n, held, move || copy.finish());
        Ok(reply)
    }

    /// A restore of up to PIN_ON_ADMISSION_MAX groups pinned and launched
    /// on the fd's lane a part at a time: each part's groups looked up and
    /// pinned, described and launched before the next part's are looked
    /// up, so the copy starts after a part's lookups, not the whole
    /// batch's (one ticket at a time, those lookups were a third of a
    /// ticket's time). A part not all in T1 hands the rest of the batch
    /// to `restore_later`, whose copy waits for the parts launched.
    #[expect(clippy::too_many_arguments, reason = "one restore, all its parts")]
    fn restore_in_parts(
        self: &Arc<Session>,
        gpu: &Arc<Engine>,
        work: &Batch,
        groups: &[GroupIndex],
        parts: usize,
        shape: Shape,
        (admitted, checks_us): (Instant, u64),
        (ticket, done): (u64, &mut Option<DoneWord>),
    ) -> Result<Parted, Rejection> {
        let cascade = &self.ctl.cascade;
        let n = work.len();
        let gb = cascade.layout().group_bytes();
        let ends = admission_ends(n, parts, part_first());
        let Some((addrs, pins)) = cascade.try_pin_resident(&groups[..ends[0]]) else {
            return Ok(Parted::NotInT1);
        };
        // Slots that happen to be contiguous go to the copy engines, the
        // whole batch at once (judged by the first part's copies: auto
        // judges by the first PROJECT_AFTER anyway).
        let items = &work.items[..ends[0]];
        if self
            .engine_runs(gpu, work, items, &addrs, gb, shape.engine_unit())
            .is_some()
        {
            return Ok(Parted::Runs);
        }
        let first_us = admitted.elapsed().as_micros() as u64;
        // Declared before `copy`, so dropped after it: a failure below
        // waits (copy's drop) for the parts launched before the pins go.
        let mut held = vec![pins];
        let on = self.lane(gpu);
        let mut lane = on.lock();
        let mut copy = gpu
            .restore_parts(
                n * shape.per,
                shape.unit,
                shape.kernel_rows(true),
                &mut lane,
                DoneWord::signal(done.as_ref(), ticket),
                part_streams() == 2,
            )
            .map_err(restore_failed)?;
        let mut next = Some(addrs);
        let mut at = 0;
        for &end in &ends {
            let addrs = match next.take() {
                Some(a) => a,
                None => match cascade.try_pin_resident(&groups[at..end]) {
                    Some((a, p)) => {
                        held.push(p);
                        a
                    }
                    // Not all in T1: the rest goes to `restore_later`.
                    None => break,
                },
            };
            let items = &work.items[at..end];
            let descs = restore_descs(work, items, gb, shape, |i| addrs[i]);
            // SAFETY: every descriptor names a pinned, read-locked T1 slot
            // (held until the copy is done: `release_after` or the rest's
            // completion) and a checked range of a live CUDA region (the
            // batch holds it).
            unsafe { copy.launch(&mut lane, (end - at) * shape.per, descs) }
                .map_err(restore_failed)?;
            at = end;
        }
        let launched = at;
        if launched < n {
            // The rest's copy waits for the ticket's event: after every
            // part launched, on both streams.
            copy.join(&mut lane).map_err(restore_failed)?;
        }
        drop(lane);
        if launched < n {
            tracing::debug!(
                n,
                launched,
                "GPU restore in parts: the rest is not all in T1"
            );
            return Ok(Parted::Rest(Box::new(Held {
                done: launched,
                pins: held,
                copy,
            })));
        }
        let reply = self.gpu_reply(ticket, copy.event());
        tracing::debug!(
            ticket,
            n,
            parts = ends.len(),
            admit_us = admitted.elapsed().as_micros() as u64,
            checks_us,
            first_us,
            "GPU restore of pinned T1 groups by the kernel, in parts"
        );
        let held = (held, on.enter(), done.take());
        self.release_after(gpu, ticket, n, held, move || copy.finish());
        Ok(Parted::Done(reply))
    }

    /// A restore resolved by an executor job: T1 hits pinned, misses read
    /// from the backing into staging, then described; its copy, enqueued
    /// now behind a flag the job sets (on the lane where `size_only` alone
    /// sent it here, see `later_on_lane`, else on a stream of its own), waits for
    /// `held`'s parts (the batch's first `done` entries, launched
    /// already) too, so the ticket's event covers the whole batch. With
    /// `later_parts`, on an idle lane the copy is enqueued in parts (`PartsWhen::later_ends`),
    /// each behind its own value of the flag, and the job pins, reads and
    /// describes a part at a time, letting each through as it is
    /// described: one 4 KiB × 4096 ticket at a time waited ~0.25 ms for
    /// all its pins before any copy (an H100, 2026-12-07).
    #[expect(clippy::too_many_arguments, reason = "one restore, all its parts")]
    fn restore_later(
        self: &Arc<Session>,
        gpu: Arc<Engine>,
        work: Batch,
        groups: Vec<GroupIndex>,
        shape: Shape,
        held: Option<Held>,
        (admitted, checks_us): (Instant, u64),
        (ticket, done): (u64, Option<DoneWord>),
        size_only: bool,
    ) -> Result<Reply, Rejection> {
        let layout = self.ctl.cascade.layout();
        let (gb, stride) = (layout.group_bytes(), layout.stride() as usize);
        let skip = held.as_ref().map_or(0, |h| h.done);
        let n = work.len() - skip;
        let groups = groups[skip..].to_vec();
        let on = later_on_lane(size_only).then(|| self.lane(&gpu));
        // On an idle lane (one ticket at a time), in parts: the first part
        // copies while the job pins the next (see `later_ends`).
        let ends = match (&on, &held) {
            (Some(l), None) if later_parts() && copy_mode() != CopyMode::Engines => {
                parts_when().later_ends(n, l.busy())
            }
            _ => vec![n],
        };
        let descs_at: Vec<usize> = ends.iter().map(|e| e * shape.per).collect();
        let mut guard = on.as_ref().map(|l| l.lock());
        let mut copy = gpu
            .restore(
                n * shape.per,
                shape.unit,
                stride,
                n,
                shape.kernel_rows(true),
                guard.as_mut(),
                None,
                held.as_ref().map(|h| &***h.copy.event()),
                DoneWord::signal(done.as_ref(), ticket),
                &descs_at,
            )
            .map_err(restore_failed)?;
        drop(guard);
        let entered = on.as_ref().map(|l| l.enter());
        let reply = self.gpu_reply(ticket, copy.event());
        let s = self.clone();
        let started = Instant::now();
        tracing::debug!(
            ticket,
            n,
            skip,
            admit_us = (started - admitted).as_micros() as u64,
            checks_us,
            "GPU restore enqueued"
        );
        // The copy waits on its flag, and the device may hold other copies
        // behind it, so this job never waits for a GPU copy: it runs on the
        // gated executor, never waits on a slot a GPU STORE holds (those
        // entries fail with EAGAIN), and leaves waiting for the copy to the
        // engine's completion thread.
        self.ctl.gated().submit_ticket(
            self,
            ticket,
            Box::new(move || {
                let cascade = s.ctl.cascade.clone();
                let job_started = Instant::now();
                let mut results: Vec<Result<(), CascadeError>> = (0..n).map(|_| Ok(())).collect();
                let mut src = vec![0u64; n];
                let mut pins = Vec::with_capacity(ends.len());
                let (mut misses, mut first_us) = (0, 0);
                let mut at = 0;
                for (k, &end) in ends.iter().enumerate() {
                    let (p, lost) = resolve_part(
                        &cascade,
                        &groups,
                        at..end,
                        &mut copy,
                        (gb, stride),
                        &mut src,
                        &mut results,
                    );
                    pins.push(p);
                    misses += lost;
                    let ok = |i: usize| {
                        if results[at + i].is_ok() {
                            src[at + i]
                        } else {
                            0
                        }
                    };
                    let items = &work.items[skip + at..skip + end];
                    copy.describe_at(
                        at * shape.per,
                        (end - at) * shape.per,
                        restore_descs(&work, items, gb, shape, ok),
                    );
                    if end < n {
                        copy.let_through(k + 1);
                    }
                    if k == 0 {
                        first_us = job_started.elapsed().as_micros() as u64;
                    }
                    at = end;
                }
                tracing::debug!(
                    ticket,
                    misses,
                    parts = ends.len(),
                    queued_us = (job_started - started).as_micros() as u64,
                    first_us,
                    all_us = job_started.elapsed().as_micros() as u64,
                    "GPU restore: descriptors ready"
                );
                copy.start();
                gpu.then(Box::new(move || {
                    // This copy waited for the parts launched before it.
                    let waiting = Instant::now();
                    let r = copy.finish();
                    // Where the end of a ticket's time goes: the wait for
                    // its copy here, from its enqueue to now.
                    tracing::debug!(
                        ticket,
                        ok = r.is_ok(),
                        finish_us = waiting.elapsed().as_micros() as u64,
                        since_enqueue_us = started.elapsed().as_micros() as u64,
                        "GPU restore: copy done"
                    );
                    let mut all: Vec<Result<(), CascadeError>> =
                        (0..skip).map(|_| Ok(())).collect();
                    let held_pins = held.map(|h| {
                        let parts = h.copy.finish();
                        if let Err(e) = &parts {
                            tracing::error!("GPU restore of ticket {ticket} failed: {e}");
                            all = copy_results(skip, &parts);
                        }
                        h.pins
                    });
                    if let Err(e) = r {
                        tracing::error!("GPU restore of ticket {ticket} failed: {e}");
                        for r in results.iter_mut() {
                            *r = Err(CascadeError::RegionFault(format!("GPU copy failed: {e}")));
                        }
                    }
                    // The lane is idle once the copy is done: counted so
                    // before the client hears of it, so its next ticket
                    // (one at a time) finds the lane idle and goes in parts.
                    drop(entered);
                    all.extend(results);
                    s.complete(Command::Restore, ticket, started, all);
                    // Unpinned after the completion (see `release_after`).
                    drop((held_pins, pins));
                    // Written by the copy's stream, before the event.
                    drop(done);
                }));
            }),
        );
        Ok(reply)
    }

    /// This fd's ordered lane on `gpu`'s device.
    fn lane(&self, gpu: &Engine) -> Arc<Lane> {
        let mut lanes = self.lanes.lock();
        if let Some((_, l)) = lanes.iter().find(|(d, _)| *d == gpu.device()) {
            return l.clone();
        }
        let l = Arc::new(gpu.lane());
        lanes.push((gpu.device(), l.clone()));
        l
    }

    /// The reply of GPU restore `ticket`, which carries the
    /// ticket's IPC event (kept for the ticket until it is collected).
    fn gpu_reply(&self, ticket: u64, event: &Arc<PooledEvent>) -> Reply {
        let mut reply = Reply::ok(Command::Restore, ticket);
        reply.message = format!("ipc_event={}", event.handle_hex());
        self.st.lock().events.insert(ticket, event.clone());
        reply
    }

    /// Completes a restore of pinned T1 groups on the engine's completion
    /// thread: waits for its copy (`finish`), counts the lane idle, posts
    /// the completion, then unpins (the copy is done: the pins guard
    /// nothing the client waits for, and a ticket's thousands of unlocks
    /// came before its completion, 15–30 µs of a 16 MiB ticket at a time).
    /// No executor thread is involved, so a writer waiting on an executor
    /// for these slots cannot hold up their release.
    fn release_after<P: Send + 'static>(
        self: &Arc<Session>,
        gpu: &Engine,
        ticket: u64,
        n: usize,
        (pins, entered, done): (P, OnLane, Option<DoneWord>),
        finish: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) {
        let s = self.clone();
        let started = Instant::now();
        gpu.then(Box::new(move || {
            let r = finish();
            drop(entered);
            s.complete(Command::Restore, ticket, started, copy_results(n, &r));
            drop(pins);
            // Written by the copy's stream, before the event.
            drop(done);
        }));
    }

    /// The runs of a restore of pinned T1 groups (at `addrs`) when the
    /// copy mode puts it on the copy engines; None when the kernel copies.
    /// (copies of `unit` bytes; see Shape).
    fn engine_runs(
        &self,
        gpu: &Engine,
        work: &Batch,
        items: &[Item],
        addrs: &[u64],
        gb: u64,
        unit: u64,
    ) -> Option<Runs> {
        let mode = copy_mode();
        if mode == CopyMode::Kernel || !gpu.has_copy_engines() {
            return None;
        }
        // Auto: as soon as the runs are too many for ENGINE_RUN_BYTES on
        // average, the kernel copies (rows that do not join stop this early).
        let most = match mode {
            CopyMode::Auto => (items.len() * gb as usize).div_ceil(ENGINE_RUN_BYTES),
            _ => usize::MAX,
        };
        // Every copy is `unit` bytes.
        let total = items.len() * (gb / unit) as usize;
        let mut runs = Runs::default();
        for p in pieces(work, items, gb, Some(unit), |i| addrs[i], true) {
            runs.push(p.src, p.dst, unit as usize);
            if p.dst == 0 || runs.len() > most {
                return None;
            }
            // Auto: the first PROJECT_AFTER copies making runs at twice the
            // rate allowed stop the look (scattered slots, the usual case:
            // 64 copies looked at, not 257).
            let seen = runs.copies();
            if seen >= PROJECT_AFTER && most != usize::MAX && runs.len() * total > 2 * most * seen {
                return None;
            }
        }
        Some(runs)
    }
}

/// Part `part` of a restore an executor job resolves: its T1 hits pinned
/// (their device addresses into `src`), its misses read from the backing
/// into the staging slots of their places in the batch, a busy slot or a
/// failed read an error in `results`. Returns the part's pins and how
/// many misses it read.
fn resolve_part(
    cascade: &Arc<Cascade>,
    groups: &[GroupIndex],
    part: std::ops::Range<usize>,
    copy: &mut Restore,
    (gb, stride): (u64, usize),
    src: &mut [u64],
    results: &mut [Result<(), CascadeError>],
) -> (DevicePins, usize) {
    let at = part.start;
    let (hits, pins, busy) = cascade.pin_for_device(&groups[part.clone()]);
    for &b in &busy {
        results[at + b] = Err(CascadeError::Busy(groups[at + b]));
    }
    let lost: Vec<usize> = part
        .clone()
        .filter(|&i| hits[i - at].is_none() && busy.binary_search(&(i - at)).is_err())
        .collect();
    for (i, h) in part.clone().zip(&hits) {
        src[i] = h.unwrap_or(0);
    }
    if lost.is_empty() {
        return (pins, 0);
    }
    let (staging, base) = copy.staging();
    let mut want = lost.iter().peekable();
    let mut items: Vec<(GroupIndex, &mut [u8])> = Vec::with_capacity(lost.len());
    for (i, b) in staging
        .chunks_mut(stride)
        .enumerate()
        .take(part.end)
        .skip(at)
    {
        if want.next_if_eq(&&i).is_some() {
            items.push((groups[i], &mut b[..gb as usize]));
        }
    }
    let rs = cascade.read_groups_nowait(&mut items);
    drop(items);
    for (&i, r) in lost.iter().zip(rs) {
        match (r, base) {
            (Ok(_), Some(base)) => src[i] = base + (i * stride) as u64,
            (Ok(_), None) => {
                results[i] = Err(CascadeError::Internal(
                    "staging is not device-mapped".into(),
                ))
            }
            (Err(e), _) => results[i] = Err(e),
        }
    }
    (pins, lost.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts on admission: equal (the last may be short), or growing
    /// from a first part by doubling, the last taking the rest, never
    /// over RESTORE_PARTS_MAX; every end ascending, the last n.
    #[test]
    fn admission_parts_are_equal_or_double_from_the_first() {
        assert_eq!(
            admission_ends(4096, 8, None),
            (1..=8).map(|k| k * 512).collect::<Vec<_>>()
        );
        assert_eq!(admission_ends(1000, 3, None), vec![334, 668, 1000]);
        assert_eq!(admission_ends(1024, 1, Some(64)), vec![1024]);
        assert_eq!(
            admission_ends(4096, 8, Some(64)),
            vec![64, 192, 448, 960, 1984, 4096]
        );
        assert_eq!(admission_ends(1024, 4, Some(64)), vec![64, 192, 448, 1024]);
        assert_eq!(
            admission_ends(2048, 8, Some(1)),
            vec![1, 3, 7, 15, 31, 63, 127, 2048]
        );
        for n in [2, 3, 100, 511, 512, 513, 2047, 4096] {
            for first in [None, Some(1), Some(64), Some(5000)] {
                for parts in 1..=RESTORE_PARTS_MAX {
                    let e = admission_ends(n, parts, first);
                    assert_eq!(*e.last().unwrap(), n, "{n} {parts} {first:?}");
                    assert!(e.windows(2).all(|w| w[0] < w[1]) && e[0] > 0);
                    let most = if first.is_some() {
                        RESTORE_PARTS_MAX
                    } else {
                        parts
                    };
                    assert!(e.len() <= most, "{n} {parts} {first:?}: {e:?}");
                }
            }
        }
    }

    /// Parts by default only on an idle lane; `on`, a size, `off` as the
    /// variable says; never more than RESTORE_PARTS_MAX, never below one.
    #[test]
    fn restore_parts_follow_the_lane_and_the_variable() {
        let auto = PartsWhen::parse(None);
        assert_eq!(auto, PartsWhen::parse(Some("auto")));
        assert_eq!(auto.parts(1024, 0), 4);
        assert_eq!(auto.parts(1024, 1), 1);
        assert_eq!(auto.parts(100, 0), 1);
        assert_eq!(auto.parts(2048, 0), RESTORE_PARTS_MAX);
        // On admission, a batch too big to pin there otherwise goes in
        // parts only where the fd holds no other ticket; `on` always.
        assert_eq!(auto.on_admission(4096, 0, true), RESTORE_PARTS_MAX);
        assert_eq!(auto.on_admission(4096, 0, false), 1);
        assert_eq!(auto.on_admission(4096, 1, true), 1);
        assert_eq!(auto.on_admission(2048, 0, false), RESTORE_PARTS_MAX);
        assert_eq!(auto.on_admission(1024, 0, false), 4);
        let on = PartsWhen::parse(Some("on"));
        assert_eq!(on.on_admission(4096, 2, false), RESTORE_PARTS_MAX);
        // An executor job's parts: growing, on an idle lane, none small.
        assert_eq!(auto.later_ends(4096, 0), vec![862, 2155, 4096]);
        assert_eq!(auto.later_ends(4096, 1), vec![4096]);
        assert_eq!(auto.later_ends(1024, 0), vec![409, 1024]);
        assert_eq!(auto.later_ends(600, 0), vec![600]);
        assert_eq!(auto.later_ends(100, 0), vec![100]);
        assert_eq!(on.later_ends(8192, 3), vec![1724, 4311, 8192]);
        assert_eq!(
            PartsWhen::parse(Some("off")).later_ends(4096, 0),
            vec![4096]
        );
        assert_eq!((on.parts(1024, 0), on.parts(1024, 3)), (4, 4));
        assert_eq!(PartsWhen::parse(Some("128")).parts(1024, 2), 8);
        for off in ["off", "0", "x"] {
            assert_eq!(PartsWhen::parse(Some(off)).parts(2048, 0), 1, "{off}");
        }
    }
}
