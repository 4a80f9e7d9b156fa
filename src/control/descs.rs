//! What a batch's copies are: its shape (one copy a group, rows for the
//! rows kernel, or pieces), the descriptors of its copies (`pieces`), and
//! their order (`in_host_order`).

use super::admit::{Batch, Item};
use crate::gpu::cuda::Rows;
use crate::gpu::engine::Descriptor;

/// Whether batches of one row shape go to the rows kernel (the default:
/// one descriptor a group, 0.78-0.87x of one big copy on the H200), or,
/// with `KVFS_GPU_ROWS=pieces` in the daemon's environment, every strided
/// batch moves in pieces of whole rows through the plain kernel (one
/// descriptor a row: 0.36x there). Mixed shapes always move in pieces.
fn rows_kernel() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVFS_GPU_ROWS").as_deref() != Ok("pieces"))
}

/// How a batch's groups move: as one copy each (contiguous entries, or
/// entries all of one row shape, which the rows kernel lays out), or, for a
/// mix of shapes, as pieces of `unit` bytes, the largest size dividing
/// every entry's row (a contiguous entry is one row of `gb`).
#[derive(Clone, Copy)]
pub(super) struct Shape {
    /// Copies a group (`gb / unit`).
    pub(super) per: usize,
    pub(super) unit: u64,
    /// Every entry's (row, pitch), for the rows kernel (per 1).
    rows: Option<(u64, u64)>,
}

impl Shape {
    pub(super) fn of(work: &Batch, gb: u64) -> Shape {
        fn gcd(a: u64, b: u64) -> u64 {
            if b == 0 { a } else { gcd(b, a % b) }
        }
        let first = work
            .items
            .first()
            .map(|it| (it.row_bytes, it.pitch))
            .filter(|_| rows_kernel());
        let uniform = work
            .items
            .iter()
            .all(|it| Some((it.row_bytes, it.pitch)) == first);
        match first {
            Some((r, pitch)) if uniform && r != 0 => Shape {
                per: 1,
                unit: gb,
                rows: Some((r as u64, pitch)),
            },
            _ => {
                let unit = work.items.iter().fold(gb, |u, it| gcd(u, it.rows(gb).0));
                Shape {
                    per: (gb / unit) as usize,
                    unit,
                    rows: None,
                }
            }
        }
    }

    /// What `pieces` makes: None (a copy a group, from the entry's
    /// offset) for the rows kernel, else pieces of `unit`.
    pub(super) fn piece(&self) -> Option<u64> {
        self.rows.is_none().then_some(self.unit)
    }

    /// The rows kernel's shape (rows on the destination for a restore).
    pub(super) fn kernel_rows(&self, restore: bool) -> Option<Rows> {
        self.rows.map(|(row, pitch)| Rows {
            row,
            pitch,
            strided_dst: restore,
        })
    }

    /// Piece size for the copy engines, whose copies are contiguous.
    pub(super) fn engine_unit(&self) -> u64 {
        self.rows.map_or(self.unit, |(row, _)| row)
    }
}

/// The copies of `unit` bytes of `items` (of `work`) in order (entry by
/// entry, row by row; None: one a group): between `slot(i)`, entry i's
/// contiguous slot (T1 or staging; 0 skips the entry), and its rows in the
/// region; from the slot with `to_region`, into it otherwise (a store).
pub(super) fn pieces<'a, F: Fn(usize) -> u64>(
    work: &'a Batch,
    items: &'a [Item],
    gb: u64,
    unit: Option<u64>,
    slot: F,
    to_region: bool,
) -> Pieces<'a, F> {
    Pieces {
        work,
        items,
        gb,
        unit,
        slot,
        to_region,
        next_item: 0,
        at: Piece::default(),
    }
}

/// The iterator `pieces` returns: a plain state machine (entry, row,
/// piece), where nested `flat_map`s took ~20 ns a descriptor (80 µs for
/// the 4096 of a 4 KiB ticket on the CPU machine), and an exact length for
/// whole groups, so a collect allocates once.
pub(super) struct Pieces<'a, F> {
    work: &'a Batch,
    items: &'a [Item],
    gb: u64,
    unit: Option<u64>,
    slot: F,
    to_region: bool,
    next_item: usize,
    at: Piece,
}

/// Where `Pieces` is in the current entry: its slot and region address,
/// its shape in pieces of `unit`, and the next row and piece.
#[derive(Default)]
struct Piece {
    slot: u64,
    region: u64,
    unit: u64,
    row: u64,
    pitch: u64,
    rows: u64,
    per_row: u64,
    k: u64,
    m: u64,
}

impl<F> Pieces<'_, F> {
    /// The copy between `at_slot` and `at_region` (of an entry whose slot
    /// is `slot`: 0 skips it), in this direction.
    fn descriptor(&self, slot: u64, at_slot: u64, at_region: u64) -> Descriptor {
        match (slot, self.to_region) {
            (0, _) => Descriptor { src: 0, dst: 0 },
            (_, true) => Descriptor {
                src: at_slot,
                dst: at_region,
            },
            (_, false) => Descriptor {
                src: at_region,
                dst: at_slot,
            },
        }
    }
}

impl<F: Fn(usize) -> u64> Iterator for Pieces<'_, F> {
    type Item = Descriptor;

    // Inlined: called out of line, its result went back through memory
    // as two 8-byte stores read by one 16-byte load, a stall a copy.
    #[inline(always)]
    fn next(&mut self) -> Option<Descriptor> {
        if self.unit.is_none() {
            // Whole groups, one copy an entry: no row state.
            let it = self.items.get(self.next_item)?;
            let s = (self.slot)(self.next_item);
            self.next_item += 1;
            let r = self.work.region(it).device_addr(it.offset).unwrap_or(0);
            return Some(self.descriptor(s, s, r));
        }
        while self.at.k >= self.at.rows {
            let it = self.items.get(self.next_item)?;
            let i = self.next_item;
            self.next_item += 1;
            let (unit, (row, pitch, rows)) = match self.unit {
                Some(u) => (u, it.rows(self.gb)),
                None => (self.gb, (self.gb, self.gb, 1)),
            };
            let per_row = row / unit;
            self.at = Piece {
                slot: (self.slot)(i),
                region: self.work.region(it).device_addr(it.offset).unwrap_or(0),
                unit,
                row,
                pitch,
                rows: if per_row == 0 { 0 } else { rows },
                per_row,
                k: 0,
                m: 0,
            };
        }
        let p = &mut self.at;
        let (k, m) = (p.k, p.m);
        p.m += 1;
        if p.m == p.per_row {
            (p.k, p.m) = (k + 1, 0);
        }
        let s = p.slot;
        let (at_slot, at_region) = (
            s + k * p.row + m * p.unit,
            p.region + k * p.pitch + m * p.unit,
        );
        Some(self.descriptor(s, at_slot, at_region))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let p = &self.at;
        let here = match p.k < p.rows {
            true => ((p.rows - p.k) * p.per_row - p.m) as usize,
            false => 0,
        };
        match self.unit {
            // Whole groups: one copy an entry.
            None => {
                let n = here + self.items.len() - self.next_item;
                (n, Some(n))
            }
            Some(_) => (here, None),
        }
    }
}

/// Below how many bytes a copy's descriptors go in the order of their
/// host side's addresses (`KVFS_GPU_SORT`: `off`, the default, 0; `auto`,
/// copies under 16 KiB; `on`, all), so the device walks host memory
/// upwards (the kernel copies each descriptor alike in any order). An
/// H100 behind a translating IOMMU gathered 4 KiB groups of a 64 MiB span
/// at 0.91× of one big copy at random, 1.0× upwards
/// (`tools/gather_probe.cu`); through kvfs on that H100 (2026-12-07) it
/// did no better (4 KiB restores through the ring 0.84× against 0.89×:
/// a ticket's groups lie scattered over all of T1), so not the default
/// (a sort of 4096 costs ~47 µs on the CPU machine).
fn sort_below() -> u64 {
    static BELOW: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *BELOW.get_or_init(|| match std::env::var("KVFS_GPU_SORT").as_deref() {
        Ok("on") => u64::MAX,
        Ok("auto") => 16 << 10,
        _ => 0,
    })
}

/// Puts descriptors of copies of `unit` bytes in the order of their host
/// side's addresses (the source of a restore, `host_src`, the destination
/// of a store) where `sort_below` says so.
pub(super) fn in_host_order(d: &mut [Descriptor], unit: u64, host_src: bool) {
    sort_by_host(d, unit, host_src, sort_below());
}

/// `in_host_order` for copies of fewer than `below` bytes.
fn sort_by_host(d: &mut [Descriptor], unit: u64, host_src: bool, below: u64) {
    if unit < below {
        match host_src {
            true => d.sort_unstable_by_key(|x| x.src),
            false => d.sort_unstable_by_key(|x| x.dst),
        }
    }
}

/// A restore's descriptors: `pieces` into regions, as they come or, where
/// `sort_below` says so, gathered and put in host order.
pub(super) enum RestoreDescs<I> {
    AsTheyCome(I),
    Sorted(std::vec::IntoIter<Descriptor>),
}

impl<I: Iterator<Item = Descriptor>> Iterator for RestoreDescs<I> {
    type Item = Descriptor;

    #[inline(always)]
    fn next(&mut self) -> Option<Descriptor> {
        match self {
            RestoreDescs::AsTheyCome(i) => i.next(),
            RestoreDescs::Sorted(v) => v.next(),
        }
    }
}

/// `RestoreDescs` of `items` (of `work`) from `slot(i)`.
pub(super) fn restore_descs<'a, F: Fn(usize) -> u64>(
    work: &'a Batch,
    items: &'a [Item],
    gb: u64,
    shape: Shape,
    slot: F,
) -> RestoreDescs<Pieces<'a, F>> {
    let p = pieces(work, items, gb, shape.piece(), slot, true);
    restore_order(p, shape.unit, sort_below())
}

/// A restore's descriptors `p` (copies of `unit` bytes) as they come, or,
/// for copies under `below` bytes, gathered in the order of their sources.
fn restore_order<I: Iterator<Item = Descriptor>>(p: I, unit: u64, below: u64) -> RestoreDescs<I> {
    if unit >= below {
        return RestoreDescs::AsTheyCome(p);
    }
    let mut d: Vec<_> = p.collect();
    sort_by_host(&mut d, unit, true, below);
    RestoreDescs::Sorted(d.into_iter())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::GroupIndex;
    use std::sync::Arc;

    /// Copies under the bound go in the order of their host side (a
    /// restore's source, a store's destination), each copy kept whole;
    /// others keep the batch's order, as every copy does by default
    /// (KVFS_GPU_SORT unset).
    #[test]
    fn small_copies_go_in_host_order() {
        let d = |src: u64, dst: u64| Descriptor { src, dst };
        let batch = vec![d(30, 1), d(10, 3), d(0, 0), d(20, 2)];
        let mut r = batch.clone();
        sort_by_host(&mut r, 4096, true, 16 << 10);
        assert_eq!(r, vec![d(0, 0), d(10, 3), d(20, 2), d(30, 1)]);
        let mut s = batch.clone();
        sort_by_host(&mut s, 4096, false, 16 << 10);
        assert_eq!(s, vec![d(0, 0), d(30, 1), d(20, 2), d(10, 3)]);
        let mut big = batch.clone();
        sort_by_host(&mut big, 16 << 10, true, 16 << 10);
        assert_eq!(big, batch);
        let mut default = batch.clone();
        in_host_order(&mut default, 4096, true);
        assert_eq!(default, batch);
    }

    /// `pieces` makes, entry by entry and row by row, the copies a plain
    /// nested loop makes: contiguous entries, rows, skipped entries (slot
    /// 0), both directions, whole groups and pieces of rows.
    #[test]
    fn pieces_match_a_plain_loop() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("region");
        std::fs::write(&f, vec![0u8; 1 << 20]).unwrap();
        let path = f.as_os_str().as_encoded_bytes();
        let region = super::super::region::Region::map_host(path, 1 << 20, 0, 0).unwrap();
        let gb = 1024u64;
        let item = |i: u64, row_bytes: u32, pitch: u64| Item {
            g: GroupIndex(i),
            region: 0,
            offset: i * 4096,
            row_bytes,
            pitch,
        };
        let items = vec![
            item(0, 0, 0),
            item(1, 256, 512),
            item(2, 0, 0),
            item(3, 128, 1024),
            item(4, 512, 512),
        ];
        let work = Batch::of(vec![Arc::new(region)], items.clone());
        let slot = |i: usize| {
            if i == 2 {
                0
            } else {
                (1 << 30) + i as u64 * 8192
            }
        };
        for unit in [None, Some(128u64), Some(64)] {
            for to_region in [true, false] {
                let got: Vec<Descriptor> =
                    pieces(&work, &items, gb, unit, slot, to_region).collect();
                let mut want = Vec::new();
                for (i, it) in items.iter().enumerate() {
                    let s = slot(i);
                    let r = work.region(it).device_addr(it.offset).unwrap_or(0);
                    let (u, (row, pitch, rows)) = match unit {
                        Some(u) => (u, it.rows(gb)),
                        None => (gb, (gb, gb, 1)),
                    };
                    for k in 0..rows {
                        for m in 0..row / u {
                            let (a, b) = (s + k * row + m * u, r + k * pitch + m * u);
                            want.push(match (s, to_region) {
                                (0, _) => Descriptor { src: 0, dst: 0 },
                                (_, true) => Descriptor { src: a, dst: b },
                                (_, false) => Descriptor { src: b, dst: a },
                            });
                        }
                    }
                }
                assert_eq!(got, want, "unit {unit:?}, to_region {to_region}");
                // The length it promises holds all the way.
                let mut p = pieces(&work, &items, gb, unit, slot, to_region);
                for left in (0..=want.len()).rev() {
                    let (lo, hi) = p.size_hint();
                    assert!(lo <= left && hi.is_none_or(|h| h >= left), "{unit:?}");
                    if unit.is_none() {
                        assert_eq!((lo, hi), (left, Some(left)));
                    }
                    assert_eq!(p.next().is_some(), left > 0);
                }
                assert!(want.len() >= items.len());
            }
        }
        // Nothing to copy: nothing.
        assert_eq!(pieces(&work, &[], gb, None, slot, true).count(), 0);
        // A restore's descriptors, KVFS_GPU_SORT unset: `pieces` as they come.
        let shape = Shape::of(&work, gb);
        let got: Vec<Descriptor> = restore_descs(&work, &items, gb, shape, slot).collect();
        let want: Vec<Descriptor> = pieces(&work, &items, gb, shape.piece(), slot, true).collect();
        assert_eq!(got, want);
        // Under the bound, gathered in source order; at it, as they come.
        let mut sorted = want.clone();
        sorted.sort_unstable_by_key(|x| x.src);
        let u = shape.unit;
        let p = pieces(&work, &items, gb, shape.piece(), slot, true);
        assert_eq!(restore_order(p, u, u + 1).collect::<Vec<_>>(), sorted);
        let p = pieces(&work, &items, gb, shape.piece(), slot, true);
        assert_eq!(restore_order(p, u, u).collect::<Vec<_>>(), want);
        assert_ne!(sorted, want, "the test's sources are not already in order");
    }
}
