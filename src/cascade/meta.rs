//! Per-group metadata: 16 bytes a group in one memory-mapped file.
//!
//! Every group has two copies in the data file (A/B, see `tier::COPIES`).
//! Record (little-endian, two u64 words):
//! - word 0: state in bits 0..8 (0 never written, 1 written); bit 8 the
//!   copy holding the newest written-back bytes (`cur`); bit 9 set when a
//!   copy is known durable (synced), bit 10 which one; bits 16..24 the
//!   mount epoch (mod 256) of the newest write-back; bits 32..64 the crc32c
//!   of the newest copy.
//! - word 1: bits 0..32 the crc32c of the durable copy; bits 32..64 the
//!   generation (mod 2^32), bumped on every write-back.
//!
//! A write-back never overwrites the durable copy, so a crash in the middle
//! of one leaves the last synced bytes intact (see Cascade::write_back).
//! The file is sparse and mapped, so opening a 40-million-group table reads
//! nothing; the kernel pages in only the records touched. Writers of one
//! group's record are serialised by the cascade (its per-group I/O
//! stripes); readers may look at any record at any time (atomic words).

use memmap2::{MmapMut, MmapOptions};
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

pub const META_RECORD_BYTES: u64 = 16;

const STATE_WRITTEN: u64 = 1;

/// One group's metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct GroupMeta {
    pub written: bool,
    /// The copy with the newest written-back bytes.
    pub cur: u8,
    /// The copy known durable (synced), if any.
    pub durable: Option<u8>,
    /// Mount epoch (mod 256) of the newest write-back.
    pub epoch: u8,
    /// crc32c of copy `cur`.
    pub crc: u32,
    /// crc32c of copy `durable`.
    pub durable_crc: u32,
    /// Bumped on every write-back (kept mod 2^32).
    pub generation: u64,
}

pub struct MetaTable {
    map: MmapMut,
    count: u64,
    /// Records in the written state (kept by `set`).
    written: AtomicU64,
    /// The durable image, for power-loss tests (`tier::shadow`).
    shadow: Option<crate::tier::shadow::Shadow>,
}

impl MetaTable {
    /// Maps an existing metadata file of exactly `count` records.
    pub fn open(file: &File, count: u64) -> io::Result<MetaTable> {
        let want = count * META_RECORD_BYTES;
        let len = file.metadata()?.len();
        if len != want {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("metadata file is {len} bytes, the geometry needs {want}"),
            ));
        }
        // SAFETY: the backing directory is locked by this process (flock), so
        // no other kvfs maps or truncates the file while it is mapped; the
        // length was checked above.
        let map = unsafe { MmapOptions::new().len(want as usize).map_mut(file)? };
        let t = MetaTable {
            map,
            count,
            written: AtomicU64::new(0),
            shadow: None,
        };
        let n = t.count_written(file)?;
        t.written.store(n, Ordering::Relaxed);
        Ok(t)
    }

    /// Written records, reading only the file's data extents (SEEK_DATA /
    /// SEEK_HOLE): the table is sparse, and a mount with few written groups
    /// opens as fast as a fresh one, whatever its geometry.
    fn count_written(&self, file: &File) -> io::Result<u64> {
        use std::os::fd::AsRawFd;
        let fd = file.as_raw_fd();
        let len = (self.count * META_RECORD_BYTES) as i64;
        let (mut at, mut n) = (0i64, 0u64);
        while at < len {
            // SAFETY: lseek on our own open fd.
            let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
            if data < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ENXIO) {
                    break; // no data past `at`
                }
                return Err(e);
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
            let end = if hole < 0 { len } else { hole.min(len) };
            let first = data as u64 / META_RECORD_BYTES;
            let last = (end as u64).div_ceil(META_RECORD_BYTES).min(self.count);
            n += (first..last).filter(|&i| self.get(i).written).count() as u64;
            at = end.max(data + 1);
        }
        Ok(n)
    }

    /// Keeps a durable image of the file at `path` (power-loss tests).
    pub fn keep_durable_image(&mut self, path: &std::path::Path, file: &File) -> io::Result<()> {
        self.shadow = Some(crate::tier::shadow::Shadow::open(path, file)?);
        Ok(())
    }

    /// Groups written (back) at least once.
    pub fn written_count(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// An anonymous table (tests, in-memory tiers): lost on drop.
    pub fn anonymous(count: u64) -> io::Result<MetaTable> {
        let map = MmapMut::map_anon((count * META_RECORD_BYTES) as usize)?;
        Ok(MetaTable {
            map,
            count,
            written: AtomicU64::new(0),
            shadow: None,
        })
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    fn words(&self, index: u64) -> &[AtomicU64; 2] {
        assert!(index < self.count, "metadata index {index} out of range");
        let at = (index * META_RECORD_BYTES) as usize;
        // SAFETY: `at..at+16` lies inside the mapping (checked above); the
        // mapping is page-aligned so the record is 8-byte aligned; AtomicU64
        // has the layout of u64; all access to the mapping goes through
        // these atomics while `self` lives.
        unsafe { &*(self.map.as_ptr().add(at) as *const [AtomicU64; 2]) }
    }

    pub fn get(&self, index: u64) -> GroupMeta {
        let w = self.words(index);
        let w0 = u64::from_le(w[0].load(Ordering::Acquire));
        let w1 = u64::from_le(w[1].load(Ordering::Acquire));
        GroupMeta {
            written: w0 & 0xff == STATE_WRITTEN,
            cur: ((w0 >> 8) & 1) as u8,
            durable: (w0 & (1 << 9) != 0).then_some(((w0 >> 10) & 1) as u8),
            epoch: (w0 >> 16) as u8,
            crc: (w0 >> 32) as u32,
            durable_crc: w1 as u32,
            generation: w1 >> 32,
        }
    }

    pub fn set(&self, index: u64, m: GroupMeta) {
        let w = self.words(index);
        let mut w0 = (m.crc as u64) << 32 | (m.epoch as u64) << 16 | (m.cur as u64 & 1) << 8;
        if m.written {
            w0 |= STATE_WRITTEN;
        }
        if let Some(d) = m.durable {
            w0 |= 1 << 9 | (d as u64 & 1) << 10;
        }
        let w1 = (m.generation & 0xffff_ffff) << 32 | m.durable_crc as u64;
        // Writers of one record are serialised (see the module note).
        let was = u64::from_le(w[0].load(Ordering::Acquire)) & 0xff == STATE_WRITTEN;
        w[1].store(w1.to_le(), Ordering::Release);
        w[0].store(w0.to_le(), Ordering::Release);
        if let Some(s) = &self.shadow {
            s.wrote(index * META_RECORD_BYTES, META_RECORD_BYTES);
        }
        match (was, m.written) {
            (false, true) => self.written.fetch_add(1, Ordering::Relaxed),
            (true, false) => self.written.fetch_sub(1, Ordering::Relaxed),
            _ => 0,
        };
    }

    /// Makes one record durable.
    pub fn flush_one(&self, index: u64) -> io::Result<()> {
        let at = (index * META_RECORD_BYTES) as usize;
        let _one = self.shadow.as_ref().map(|s| s.sync_guard());
        let pages = self
            .shadow
            .as_ref()
            .map(|s| s.range_before_sync(&self.map, at as u64, META_RECORD_BYTES));
        self.map.flush_range(at, META_RECORD_BYTES as usize)?;
        if let (Some(s), Some(p)) = (&self.shadow, pages) {
            s.after_sync(p);
        }
        Ok(())
    }

    /// Makes every record durable.
    pub fn flush_all(&self) -> io::Result<()> {
        let _one = self.shadow.as_ref().map(|s| s.sync_guard());
        let pages = self.shadow.as_ref().map(|s| s.all_before_sync(&self.map));
        self.map.flush()?;
        if let (Some(s), Some(p)) = (&self.shadow, pages) {
            s.after_sync(p);
        }
        Ok(())
    }
}
