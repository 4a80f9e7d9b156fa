//! Admission: a RESTORE or STORE is checked whole before any work starts.
//!
//! All or nothing: every key in the geometry, every region registered on
//! this session (and not damaged), `offset + group_bytes` inside its
//! region (every row of a strided entry: rows dividing the group, a
//! pitch no less than a row), CUDA destinations 16-byte aligned, one batch naming host
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
    /// 0: the group is contiguous at `offset`; else rows of this many
    /// bytes, `pitch` apart (admission checked the shape).
    pub(super) row_bytes: u32,
    pub(super) pitch: u64,
}

impl Item {
    /// (row bytes, pitch, rows) of a group of `gb` bytes: one row when
    /// contiguous.
    pub(super) fn rows(&self, gb: u64) -> (u64, u64, u64) {
        match self.row_bytes {
            0 => (gb, gb, 1),
            r => (r as u64, self.pitch, gb / r as u64),
        }
    }

    /// Bytes from `offset` to the end of the last row.
    pub(super) fn extent(&self, gb: u64) -> u64 {
        let (row, pitch, rows) = self.rows(gb);
        (rows - 1) * pitch + row
    }
}

impl Batch {
    /// A batch of `items` over `regions` (ids 0, 1, ...), for tests.
    #[cfg(test)]
    pub(super) fn of(regions: Vec<Arc<Region>>, items: Vec<Item>) -> Batch {
        Batch {
            ids: (0..regions.len() as u32).collect(),
            regions,
            items,
        }
    }

    pub(super) fn region(&self, it: &Item) -> &Region {
        &self.regions[it.region as usize]
    }

    pub(super) fn len(&self) -> usize {
        self.items.len()
    }

    pub(super) fn is_cuda(&self) -> bool {
        self.regions.first().is_some_and(|r| r.is_cuda())
    }

    /// The CUDA device of a CUDA batch (admission keeps a batch to one).
    pub(super) fn cuda_device(&self) -> i32 {
        self.regions
            .first()
            .and_then(|r| r.cuda_device())
            .unwrap_or(0)
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
        let bytes = at.count as u64 * at.entry_bytes() as u64;
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
        let raw = unsafe { region.range(at.offset, bytes as usize) };
        let entries = if at.strided {
            wire::decode_strided_entries(raw)
        } else {
            wire::decode_io_entries(raw)
        };
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
            let (row_bytes, pitch, extent) = shape(i, e, gb)?;
            let g = match e.key.key().map(|k| layout.index(k)) {
                Some(Ok(g)) => g,
                _ => return Err(self.key_index(i, &e.key).expect_err("a bad key")),
            };
            // By reference: a copy of it each entry went through the
            // stack in halves and stalled the check that read it back
            // (admission of 1024 entries 12.2 µs so, 8.6 µs now).
            let r = match &mut cur {
                Some(r) if r.id == e.region => &*r,
                slot => &*slot.insert(Self::resolve(&st, &mut batch, i, e.region)?),
            };
            if e.offset > r.len || r.len - e.offset < extent {
                return Err(reject(
                    libc::EFAULT,
                    i as u32,
                    format!(
                        "entry {i}: bytes {}..{} lie outside region {} ({} bytes)",
                        e.offset,
                        e.offset.saturating_add(extent),
                        e.region,
                        r.len,
                    ),
                ));
            }
            if row_bytes != 0 && r.mask != 0 && !(row_bytes as u64 | pitch).is_multiple_of(16) {
                return Err(reject(
                    libc::EINVAL,
                    i as u32,
                    format!(
                        "entry {i}: rows in CUDA memory need a row size and a pitch that are multiples of 16 bytes (rows of {row_bytes} bytes, pitch {pitch})"
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
            if row_bytes != 0 {
                // Rows of different entries may interleave: the general check.
                ascending = false;
            }
            if let Some((pr, po)) = prev.filter(|_| ascending) {
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
                row_bytes,
                pitch,
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
                if let (Some(a), Some(b)) = (
                    batch.regions.first().and_then(|r| r.cuda_device()),
                    region.cuda_device(),
                ) && a != b
                {
                    return Err(reject(
                        libc::EINVAL,
                        i as u32,
                        format!(
                            "entry {i}: region {id} is on CUDA device {b}, the batch's first region on device {a}; \
                             a batch names regions of one device (submit a batch a device)"
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

/// An entry's shape: (row_bytes, pitch, extent), row_bytes 0 for a
/// contiguous group (`row_bytes` 0 or the group's size on the wire).
fn shape(i: usize, e: &IoEntry, gb: u64) -> Result<(u32, u64, u64), Rejection> {
    let row = e.row_bytes as u64;
    if row == 0 || row == gb {
        return Ok((0, gb, gb));
    }
    if row > gb || !gb.is_multiple_of(row) {
        return Err(reject(
            libc::EINVAL,
            i as u32,
            format!("entry {i}: rows of {row} bytes do not divide the group's {gb} bytes"),
        ));
    }
    if e.pitch < row {
        return Err(reject(
            libc::EINVAL,
            i as u32,
            format!(
                "entry {i}: a pitch of {} bytes is less than a row ({row} bytes): rows would overlap",
                e.pitch
            ),
        ));
    }
    let rows = gb / row;
    let extent = (rows - 1)
        .checked_mul(e.pitch)
        .and_then(|x| x.checked_add(row))
        .ok_or_else(|| {
            reject(
                libc::EFAULT,
                i as u32,
                format!("entry {i}: {rows} rows {} bytes apart overflow", e.pitch),
            )
        })?;
    Ok((e.row_bytes, e.pitch, extent))
}

/// Refuses a RESTORE whose destinations overlap, in any entry order; rows
/// of strided entries may interleave as long as no two bytes are shared.
fn check_overlaps(batch: &Batch, entries: &[IoEntry], gb: u64) -> Result<(), Rejection> {
    let mut spans: Vec<(u32, u64, u32)> = batch
        .items
        .iter()
        .enumerate()
        .map(|(i, it)| (it.region, it.offset, i as u32))
        .collect();
    spans.sort_unstable();
    // Entries whose spans reach past the current start, same region.
    let mut active: Vec<u32> = Vec::new();
    let mut region = u32::MAX;
    for &(r, start, i) in &spans {
        if r != region {
            active.clear();
            region = r;
        }
        let items = &batch.items;
        active.retain(|&a| {
            let it = &items[a as usize];
            it.offset + it.extent(gb) > start
        });
        for &a in &active {
            if rows_meet(&items[a as usize], &items[i as usize], gb) {
                let (x, y) = (a.min(i), a.max(i));
                return Err(overlap(x as usize, y as usize, entries[y as usize].region));
            }
        }
        active.push(i);
    }
    Ok(())
}

/// Whether two entries whose spans overlap share a byte, `a` starting no
/// later than `b`.
fn rows_meet(a: &Item, b: &Item, gb: u64) -> bool {
    let (ra, pa, na) = a.rows(gb);
    let (rb, pb, nb) = b.rows(gb);
    if na == 1 && nb == 1 {
        return true;
    }
    if pa == pb && na > 1 && nb > 1 {
        // Same pitch: a row of b starts `d` into a period of a's rows; it
        // can only meet the row it starts in or the next one.
        let d = (b.offset - a.offset) % pa;
        if d >= ra && d + rb <= pa {
            return false;
        }
    }
    // Exact: walk both lists of rows (each ascending).
    let (mut i, mut j) = (0, 0);
    while i < na && j < nb {
        let (s1, s2) = (a.offset + i * pa, b.offset + j * pb);
        if s1 < s2 + rb && s2 < s1 + ra {
            return true;
        }
        if s1 + ra <= s2 + rb {
            i += 1;
        } else {
            j += 1;
        }
    }
    false
}
