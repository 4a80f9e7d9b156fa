//! Admission: a RESTORE or STORE is checked whole before any work starts.
//!
//! All or nothing: every key in the geometry, every region registered on
//! this session (and not damaged), `offset + group_bytes` inside its
//! region, CUDA destinations 16-byte aligned, one batch naming host
//! regions or CUDA regions but not both, and no two RESTORE destinations
//! overlapping (two copies into the same bytes would race). The product is
//! a `Batch` that holds one reference per region it names, so the regions
//! outlive the job whatever the client does meanwhile. Entries may arrive
//! in the request or in a host region of the session (read once: what was
//! read is what counts).

use super::region::Region;
use super::session::{Session, SessionState};
use super::wire::{self, Command, IoEntry, NO_ENTRY, RawKey};
use super::{Rejection, overlap, reject};
use crate::cascade::CascadeError;
use crate::geometry::GroupIndex;
use std::sync::Arc;

/// An admitted RESTORE or STORE: each item names its region by position
/// in `regions` (one reference per region, not per entry).
pub(super) struct Batch {
    pub(super) regions: Vec<Arc<Region>>,
    /// The client's ids of `regions`, in the same order.
    ids: Vec<u32>,
    pub(super) items: Vec<Item>,
}

#[derive(Clone, Copy)]
pub(super) struct Item {
    pub(super) g: GroupIndex,
    pub(super) region: u32,
    pub(super) offset: u64,
}

impl Batch {
    pub(super) fn region(&self, it: &Item) -> &Region {
        &self.regions[it.region as usize]
    }

    pub(super) fn len(&self) -> usize {
        self.items.len()
    }

    pub(super) fn is_cuda(&self) -> bool {
        self.regions.first().is_some_and(|r| r.is_cuda())
    }

    /// Entries whose region's file shrank under the copy fail with EFAULT.
    pub(super) fn mark_damaged(
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

impl Session {
    pub(super) fn key_index(&self, i: usize, k: &RawKey) -> Result<GroupIndex, Rejection> {
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
    pub(super) fn entries_from(&self, at: wire::EntriesAt) -> Result<Vec<IoEntry>, Rejection> {
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
    /// All-or-nothing admission of RESTORE/STORE entries.
    pub(super) fn admit_io(&self, cmd: Command, entries: &[IoEntry]) -> Result<Batch, Rejection> {
        let layout = *self.ctl.cascade.layout();
        let gb = layout.group_bytes();
        let st = self.st.lock();
        let mut batch = Batch {
            regions: Vec::new(),
            ids: Vec::new(),
            items: Vec::with_capacity(entries.len()),
        };
        // The region of the previous entry (batches mostly name one).
        let mut cur: Option<Resolved> = None;
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
            let r = match cur {
                Some(r) if r.id == e.region => r,
                _ => *cur.insert(Self::resolve(&st, &mut batch, i, e.region)?),
            };
            if e.offset > r.len || r.len - e.offset < gb {
                return Err(reject(
                    libc::EFAULT,
                    i as u32,
                    format!(
                        "entry {i}: bytes {}..{} lie outside region {} ({} bytes)",
                        e.offset,
                        e.offset.saturating_add(gb),
                        e.region,
                        r.len,
                    ),
                ));
            }
            if r.base.wrapping_add(e.offset) & r.mask != 0 {
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
                if (r.at, e.offset) <= (pr, po) {
                    ascending = false;
                } else if cmd == Command::Restore && pr == r.at && po + gb > e.offset {
                    return Err(overlap(i - 1, i, e.region));
                }
            }
            prev = Some((r.at, e.offset));
            batch.items.push(Item {
                g,
                region: r.at,
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
            check_overlaps(&batch, entries, gb)?;
        }
        Ok(batch)
    }

    /// Region `id`, named by entry `i`: its position in the batch (added
    /// there on first use), checked registered, undamaged and of the
    /// batch's kind (host or CUDA).
    fn resolve(
        st: &SessionState,
        batch: &mut Batch,
        i: usize,
        id: u32,
    ) -> Result<Resolved, Rejection> {
        let at = match batch.ids.iter().position(|&x| x == id) {
            Some(at) => at as u32,
            None => {
                let region = st.regions.get(&id).ok_or_else(|| {
                    reject(
                        libc::EBADF,
                        i as u32,
                        format!("entry {i}: region {id} is not registered on this fd"),
                    )
                })?;
                if region.damaged() {
                    return Err(reject(
                        libc::EFAULT,
                        i as u32,
                        format!(
                            "entry {i}: region {id}'s file shrank under a copy; unregister it and register again"
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
                batch.ids.push(id);
                batch.regions.push(region.clone());
                (batch.ids.len() - 1) as u32
            }
        };
        let r = &batch.regions[at as usize];
        // CUDA destinations must be 16-byte aligned (the gather kernel's loads).
        let (base, mask) = r.device_addr(0).map_or((0, 0), |d| (d, 15));
        Ok(Resolved {
            id,
            at,
            len: r.len(),
            base,
            mask,
        })
    }
}

/// A region as admission checks entries against it.
#[derive(Clone, Copy)]
struct Resolved {
    id: u32,
    /// Position in the batch's regions.
    at: u32,
    len: u64,
    /// Device address of byte 0 (CUDA regions), else 0.
    base: u64,
    /// Alignment mask destinations must clear: 15 for CUDA regions, else 0.
    mask: u64,
}

/// Refuses a RESTORE whose destinations overlap, in any entry order.
fn check_overlaps(batch: &Batch, entries: &[IoEntry], gb: u64) -> Result<(), Rejection> {
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
    Ok(())
}
