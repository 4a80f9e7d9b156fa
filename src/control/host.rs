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
use crate::cascade::{CascadeError, GroupSink, Residence};
use crate::geometry::GroupIndex;
use std::sync::Arc;
use std::time::Instant;

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

    /// The job of a RESTORE into host regions: each group read straight
    /// into its place, whole or row by row (`Places`).
    fn host_restore(self: &Arc<Session>, work: Batch, ticket: u64, started: Instant) -> Job {
        let s = self.clone();
        Box::new(move || {
            let gb = s.ctl.cascade.layout().group_bytes();
            let groups: Vec<GroupIndex> = work.items.iter().map(|it| it.g).collect();
            let results: Vec<Result<(), CascadeError>> = s
                .ctl
                .cascade
                .read_groups_to(&groups, &mut Places { work: &work, gb }, true)
                .into_iter()
                .map(|r| r.map(|_| ()))
                .collect();
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
                backing_crc: q.backing_crc,
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

/// Where a host RESTORE's groups go: item `i`'s range of its region,
/// whole, or its rows (strided entries), copied straight out of the T1
/// slot or the read buffer. A group whose read fails is not written.
struct Places<'a> {
    work: &'a Batch,
    gb: u64,
}

impl GroupSink for Places<'_> {
    fn len(&self, _: usize) -> usize {
        self.gb as usize
    }

    fn put(&mut self, i: usize, bytes: &[u8]) {
        let it = &self.work.items[i];
        let region = self.work.region(it);
        let (row, pitch, _) = it.rows(self.gb);
        for (k, src) in bytes.chunks(row as usize).enumerate() {
            // SAFETY: admission checked every row is inside its region
            // and that no two entries' bytes overlap; `work` keeps the
            // regions mapped until the job ends.
            unsafe { region.range_mut(it.offset + k as u64 * pitch, row as usize) }
                .copy_from_slice(src);
        }
    }
}
