//! RESTORE/STORE into and out of host regions, QUERY and PREFETCH.
//!
//! `submit_io` is where an admitted batch takes its road: CUDA batches go
//! to the GPU room, host batches become one executor job each. A host
//! restore reads the groups straight into the region's mapping (T1 hits
//! copied out under a pin, misses read from the backing in batches); a
//! host store copies each group out of the region first, so a client that
//! shrinks its file under the copy never turns a group into zeros (the
//! entry fails with EFAULT instead). Groups a STORE changed are reported
//! to the change hook (the filesystem drops the kernel's cached pages).

use super::admit::Batch;
use super::exec::Job;
use super::session::Session;
use super::wire::{self, Command, IoEntry, NO_ENTRY, RawKey, Reply, StateEntry};
use super::{Rejection, reject};
use crate::cascade::{CascadeError, Residence};
use crate::geometry::GroupIndex;
use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;

/// The most bytes of whole groups an executor thread keeps between
/// strided restores (one 16 MiB ticket's).
const SPREAD_KEEP: usize = 16 << 20;

thread_local! {
    /// A strided restore's whole groups before they are spread into rows,
    /// kept by each executor thread between jobs (up to SPREAD_KEEP), not
    /// a fresh zeroed one a ticket (a memset, or page faults: a sixth of
    /// the daemon's time in such restores, perf). One 16 MiB ticket of 16
    /// KiB groups as rows of 256 B at a time, CPU machine, two alternating
    /// A/B rounds, against contiguous groups on the same mount: 0.31× and
    /// 0.34× against 0.28× and 0.29× before (3.1–3.7 GB/s, 2.8–3.6 before).
    /// Every group read whole overwrites its part (a never-written one
    /// with zeros), and a failed one is not spread: nothing left from an
    /// earlier job reaches a region.
    static SPREAD: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl Session {
    /// Admits a RESTORE or STORE and starts it; the reply carries its ticket.
    pub(super) fn submit_io(
        self: &Arc<Session>,
        cmd: Command,
        entries: &[IoEntry],
        done: Option<u16>,
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
        if done.is_some() && !work.is_cuda() {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                "a done word is for a RESTORE into CUDA regions (a host waits with WAIT or the ring)",
            ));
        }
        if work.is_cuda() {
            return match cmd {
                Command::Restore => self.submit_gpu_restore(work, admitted, done),
                _ => self.submit_gpu_store(work),
            };
        }
        let ticket = self.new_ticket();
        let started = Instant::now();
        let job = match cmd {
            Command::Restore => self.host_restore(work, ticket, started),
            _ => self.host_store(work, ticket, started),
        };
        self.ctl.exec.submit_ticket(self, ticket, job);
        Ok(Reply::ok(cmd, ticket))
    }

    /// The job of a RESTORE into host regions.
    fn host_restore(self: &Arc<Session>, work: Batch, ticket: u64, started: Instant) -> Job {
        let s = self.clone();
        Box::new(move || {
            let gb = s.ctl.cascade.layout().group_bytes() as usize;
            // Strided groups are read whole into a buffer, then spread.
            let strided = work.items.iter().filter(|it| it.row_bytes != 0).count();
            let need = strided * gb;
            let mut spread = SPREAD.take();
            if spread.len() < need {
                spread = vec![0u8; need];
            }
            let mut parts = spread[..need].chunks_mut(gb.max(1));
            let mut items: Vec<(GroupIndex, &mut [u8])> = work
                .items
                .iter()
                .map(|it| match it.row_bytes {
                    // SAFETY: admission checked each range is inside its
                    // region and that no two ranges overlap; `work` keeps
                    // the regions mapped until the job ends.
                    0 => (it.g, unsafe { work.region(it).range_mut(it.offset, gb) }),
                    _ => (it.g, parts.next().expect("one part per strided item")),
                })
                .collect();
            let results: Vec<Result<(), CascadeError>> = s
                .ctl
                .cascade
                .read_groups(&mut items)
                .into_iter()
                .map(|r| r.map(|_| ()))
                .collect();
            drop(items);
            let mut parts = spread[..need].chunks(gb.max(1));
            for (it, r) in work.items.iter().zip(&results) {
                if it.row_bytes == 0 {
                    continue;
                }
                let part = parts.next().expect("one part per strided item");
                if r.is_err() {
                    continue;
                }
                let (row, pitch, _) = it.rows(gb as u64);
                for (k, src) in part.chunks(row as usize).enumerate() {
                    // SAFETY: admission checked every row is inside the
                    // region and no two entries' rows overlap.
                    unsafe {
                        work.region(it)
                            .range_mut(it.offset + k as u64 * pitch, row as usize)
                    }
                    .copy_from_slice(src);
                }
            }
            if spread.len() <= SPREAD_KEEP {
                SPREAD.set(spread);
            }
            let results = work.mark_damaged(results);
            s.complete(Command::Restore, ticket, started, results);
        })
    }

    /// The job of a STORE from host regions.
    fn host_store(self: &Arc<Session>, work: Batch, ticket: u64, started: Instant) -> Job {
        let s = self.clone();
        Box::new(move || {
            let gb = s.ctl.cascade.layout().group_bytes() as usize;
            let mut copy = vec![0u8; gb];
            let groups: Vec<GroupIndex> = work.items.iter().map(|it| it.g).collect();
            let results = s.ctl.cascade.write_groups(&groups, |i, dst| {
                let it = &work.items[i];
                let r = work.region(it);
                // Copy out first: if the client shrinks the file under
                // us, the group must not take the zero page.
                let (row, pitch, _) = it.rows(gb as u64);
                for (k, dst) in copy.chunks_mut(row as usize).enumerate() {
                    // SAFETY: admission checked every row is inside the region.
                    dst.copy_from_slice(unsafe {
                        r.range(it.offset + k as u64 * pitch, row as usize)
                    });
                }
                if r.damaged() {
                    return Err(CascadeError::RegionFault(r.path.display().to_string()));
                }
                dst.copy_from_slice(&copy);
                Ok(())
            });
            s.changed(&groups, &results);
            s.complete(Command::Store, ticket, started, results);
        })
    }

    /// Tells the filesystem which groups a STORE changed.
    pub(super) fn changed(&self, groups: &[GroupIndex], results: &[Result<(), CascadeError>]) {
        if let Some(h) = self.ctl.on_change.get() {
            for (&g, _) in groups.iter().zip(results).filter(|(_, r)| r.is_ok()) {
                h(g);
            }
        }
    }

    pub(super) fn query(&self, keys: &[RawKey]) -> Result<Reply, Rejection> {
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

    pub(super) fn prefetch(self: &Arc<Session>, keys: &[RawKey]) -> Result<Reply, Rejection> {
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
