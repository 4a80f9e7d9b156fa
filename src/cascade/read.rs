//! The read paths: single reads, batched reads, prefetch and promotion.
//!
//! A hit copies out of its slot under the slot's read lock, after checking
//! the slot still holds the group (a failed fill may have given it up). A
//! miss reads the backing under the group's stripe and first re-checks the
//! map there: a group installed meanwhile is newer than its backing bytes.
//! Backing bytes that fail their crc32c are never served; only a newest copy
//! from an earlier mount (possibly cut short by a crash) gives way to the
//! last synced copy. Staging buffers are plain memory, never pinned.

use super::claim::Claim;
use super::{Cascade, CascadeError, GroupMeta, Residence, STAGING_KEEP, STRIPES, SYNC_BATCH};
use crate::geometry::GroupIndex;
use crate::gpu::HostBuf;
use crate::tier::copy_index;
use std::io;
use std::sync::atomic::Ordering;

impl Cascade {
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

    /// Reads `g`'s current backing bytes into `buf` (stride bytes, aligned),
    /// verifying the checksum. Never-written groups read as zeros.
    /// The caller holds `g`'s stripe.
    pub(super) fn read_backing_locked(
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

    /// Reads `out.len()` bytes of group `g` from `offset`.
    pub fn read(
        &self,
        g: GroupIndex,
        offset: u64,
        out: &mut [u8],
    ) -> Result<Residence, CascadeError> {
        self.read_with(g, offset, out, true)
    }

    /// `read`; without `wait`, for a job that must never wait on the GPU
    /// (see `read_lock_nowait`): a hit whose slot a GPU STORE holds is
    /// `Busy`, and a miss is not promoted (finding a slot can wait for pins
    /// that GPU copies hold).
    fn read_with(
        &self,
        g: GroupIndex,
        offset: u64,
        out: &mut [u8],
        wait: bool,
    ) -> Result<Residence, CascadeError> {
        self.check_index(g)?;
        self.check_range(offset, out.len())?;
        let off = offset as usize;
        loop {
            if let Some(pin) = self.pin_resident(g, true) {
                let _r = self
                    .read_lock(pin.slot.0 as usize, wait)
                    .ok_or(CascadeError::Busy(g))?;
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
                if wait && self.cfg.promote_on_miss {
                    self.promote(g, buf.as_slice(), generation);
                }
            }
            self.give_staging(buf);
            return Ok(res);
        }
    }

    // Kept whole: hits, then misses in stripe-locked batches, all filling one `results`.
    /// Reads whole groups (each `out` is `group_bytes` long, or shorter for
    /// a prefix). Hits copy straight out of their slots; the misses go to the
    /// backing together, in batches through the tier's queue depth. One
    /// result per item, in order; a failed item does not stop the others.
    pub fn read_groups(
        &self,
        items: &mut [(GroupIndex, &mut [u8])],
    ) -> Vec<Result<Residence, CascadeError>> {
        self.read_groups_with(items, true)
    }

    /// `read_groups` for a job that must never wait on the GPU (see
    /// `read_lock_nowait`): a group whose slot a GPU STORE holds is not
    /// read (`CascadeError::Busy`).
    pub fn read_groups_nowait(
        &self,
        items: &mut [(GroupIndex, &mut [u8])],
    ) -> Vec<Result<Residence, CascadeError>> {
        self.read_groups_with(items, false)
    }

    fn read_groups_with(
        &self,
        items: &mut [(GroupIndex, &mut [u8])],
        wait: bool,
    ) -> Vec<Result<Residence, CascadeError>> {
        let groups: Vec<GroupIndex> = items.iter().map(|(g, _)| *g).collect();
        let mut outs: Vec<&mut [u8]> = items.iter_mut().map(|(_, out)| &mut **out).collect();
        self.read_groups_to(&groups, &mut outs[..], wait)
    }

    /// `read_groups` of `groups` into `sink` (group `i`'s bytes go to
    /// `sink.put(i, ..)`, each once, unless its read fails), so a caller
    /// can place them where they belong (rows, say) with no copy between.
    /// Without `wait`, as `read_groups_nowait`.
    pub fn read_groups_to(
        &self,
        groups: &[GroupIndex],
        sink: &mut (impl GroupSink + ?Sized),
        wait: bool,
    ) -> Vec<Result<Residence, CascadeError>> {
        let mut results: Vec<Option<Result<Residence, CascadeError>>> =
            (0..groups.len()).map(|_| None).collect();
        let mut misses = Vec::new();
        let valid: Vec<GroupIndex> = groups
            .iter()
            .enumerate()
            .filter_map(|(i, g)| {
                match self
                    .check_index(*g)
                    .and_then(|_| self.check_range(0, sink.len(i)))
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
        for (i, g) in groups.iter().enumerate() {
            if results[i].is_some() {
                continue;
            }
            match pins.next().expect("one pin slot per valid item") {
                Some(pin) => {
                    let Some(_r) = self.read_lock(pin.slot.0 as usize, wait) else {
                        results[i] = Some(Err(CascadeError::Busy(*g)));
                        continue;
                    };
                    if !self.holds(pin.slot, *g) {
                        misses.push(i);
                        continue;
                    }
                    // SAFETY: we hold the slot's read lock.
                    let bytes = unsafe { self.slot_bytes(pin.slot) };
                    let len = sink.len(i);
                    sink.put(i, &bytes[..len]);
                    self.counters.hits.fetch_add(1, Ordering::Relaxed);
                    self.counters
                        .t1_read_bytes
                        .fetch_add(len as u64, Ordering::Relaxed);
                    results[i] = Some(Ok(Residence::T1));
                }
                None => misses.push(i),
            }
        }
        let stride = self.layout.stride() as usize;
        // What a never-written group reads as.
        let zeros = match misses.is_empty() {
            true => Vec::new(),
            false => vec![0u8; self.layout.group_bytes() as usize],
        };
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
                .map(|&i| (groups[i].0 % STRIPES as u64) as usize)
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
                        let g = groups[i];
                        if st.map.contains_key(&g) {
                            retry.push(i); // installed meanwhile: T1 is newer
                        } else if !self.meta.get(g.0).written {
                            sink.put(i, &zeros[..sink.len(i)]);
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
                    .map(|&(_, i)| self.meta.get(groups[i].0))
                    .collect();
                let mut ops: Vec<crate::tier::ReadOp<'_>> = to_read
                    .iter()
                    .zip(&metas)
                    .map(|(&(k, i), m)| crate::tier::ReadOp {
                        index: copy_index(groups[i], m.cur),
                        buf: by_k[k].take().expect("one buffer per miss"),
                    })
                    .collect();
                let rs = self.tier.read_batch(&mut ops);
                for (((op, r), &(_, i)), m) in ops.iter_mut().zip(rs).zip(&to_read).zip(&metas) {
                    let g = groups[i];
                    results[i] = Some(match r {
                        Err(e) => Err(e.into()),
                        Ok(()) => {
                            self.counters
                                .backing_read_bytes
                                .fetch_add(stride as u64, Ordering::Relaxed);
                            let checked = self.verify_backing(g, m, op.buf);
                            if checked.is_ok() {
                                sink.put(i, &op.buf[..sink.len(i)]);
                                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                            }
                            checked
                        }
                    });
                }
            }
            for i in retry {
                let mut out = vec![0u8; sink.len(i)];
                let r = match wait {
                    true => self.read(groups[i], 0, &mut out),
                    false => self.read_with(groups[i], 0, &mut out, false),
                };
                if r.is_ok() {
                    sink.put(i, &out);
                }
                results[i] = Some(r);
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every item answered"))
            .collect()
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
}

/// Where `Cascade::read_groups_to` puts the groups it reads.
pub trait GroupSink {
    /// The bytes wanted of group `i` (its first `len`; at most a group).
    fn len(&self, i: usize) -> usize;
    /// Group `i`'s bytes (`len(i)` of them), read and checked.
    fn put(&mut self, i: usize, bytes: &[u8]);
}

/// A buffer an item: each group's bytes copied into its own.
impl GroupSink for [&mut [u8]] {
    fn len(&self, i: usize) -> usize {
        self[i].len()
    }

    fn put(&mut self, i: usize, bytes: &[u8]) {
        self[i].copy_from_slice(bytes);
    }
}
