//! Durable images for power-loss tests (`kvfs bench crash --power-loss`).
//!
//! With `KVFS_CRASH_SHADOW=1` in the daemon's environment, the data file
//! (file tier) and the metadata file each keep a *durable image* beside
//! them (`NAME.durable`): a copy of the file as it was at open (what
//! survived the last power cut is durable by definition), to which every
//! 4 KiB page is copied once a sync that covers it has returned
//! (fdatasync of the data file, msync of a metadata range). Page contents
//! are read before the sync starts, so a write racing the sync stays
//! undurable. A power cut (`power_cut`) then gives every page that differs
//! from the image, at random, its written bytes or its durable ones, page
//! by page: any subset of the unsynced writes, torn at 4 KiB, in whatever
//! order the kernel might have written them. Test machinery: off, it costs
//! one branch per write and sync.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub const PAGE: u64 = 4096;

/// Whether durable images are kept (`KVFS_CRASH_SHADOW=1`).
pub fn enabled() -> bool {
    std::env::var("KVFS_CRASH_SHADOW").as_deref() == Ok("1")
}

pub fn image_path(file: &Path) -> PathBuf {
    let mut p = file.as_os_str().to_owned();
    p.push(".durable");
    PathBuf::from(p)
}

/// The durable image of one file.
pub struct Shadow {
    image: File,
    /// Pages written since the last sync.
    dirty: parking_lot::Mutex<BTreeSet<u64>>,
    /// Held across a whole sync (read, sync, copy): with two at once, the
    /// one that returns first could find pages the other took not yet in
    /// the image, or an older snapshot could land over a newer one.
    one: parking_lot::Mutex<()>,
}

impl Shadow {
    /// The image of `file` (at `path`), made a copy of it now.
    pub fn open(path: &Path, file: &File) -> io::Result<Shadow> {
        let image = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(image_path(path))?;
        let len = file.metadata()?.len();
        image.set_len(len)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0;
        while at < len {
            let n = buf.len().min((len - at) as usize);
            file.read_exact_at(&mut buf[..n], at)?;
            image.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
        Ok(Shadow {
            image,
            dirty: parking_lot::Mutex::new(BTreeSet::new()),
            one: parking_lot::Mutex::new(()),
        })
    }

    /// Bytes `[offset, offset + len)` were written (not yet synced).
    pub fn wrote(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let mut d = self.dirty.lock();
        for p in offset / PAGE..=(offset + len - 1) / PAGE {
            d.insert(p);
        }
    }

    /// Held by a sync from before its reads to after its copies.
    pub fn sync_guard(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.one.lock()
    }

    /// The pages written so far, read now (before the sync starts).
    pub fn before_sync(&self, file: &File) -> Vec<(u64, Vec<u8>)> {
        let pages = std::mem::take(&mut *self.dirty.lock());
        pages
            .into_iter()
            .filter_map(|p| {
                let mut b = vec![0u8; PAGE as usize];
                let n = file.read_at(&mut b, p * PAGE).ok()?;
                b.truncate(n);
                Some((p, b))
            })
            .collect()
    }

    /// The sync returned: those pages are durable.
    pub fn after_sync(&self, pages: Vec<(u64, Vec<u8>)>) {
        for (p, b) in pages {
            let _ = self.image.write_all_at(&b, p * PAGE);
        }
    }

    /// `before_sync` for a file seen through a mapping (`file_bytes`).
    pub fn all_before_sync(&self, file_bytes: &[u8]) -> Vec<(u64, Vec<u8>)> {
        let pages = std::mem::take(&mut *self.dirty.lock());
        page_bytes(file_bytes, pages)
    }

    /// A sync of `[offset, offset + len)` only (an msync of a range):
    /// those pages' bytes now, for `after_sync`.
    pub fn range_before_sync(
        &self,
        file_bytes: &[u8],
        offset: u64,
        len: u64,
    ) -> Vec<(u64, Vec<u8>)> {
        let pages = offset / PAGE..=(offset + len.max(1) - 1) / PAGE;
        {
            let mut d = self.dirty.lock();
            for p in pages.clone() {
                d.remove(&p);
            }
        }
        page_bytes(file_bytes, pages)
    }
}

/// The bytes of `pages` of a mapped file (a last page may be short).
fn page_bytes(file_bytes: &[u8], pages: impl IntoIterator<Item = u64>) -> Vec<(u64, Vec<u8>)> {
    pages
        .into_iter()
        .filter_map(|p| {
            let at = (p * PAGE) as usize;
            let end = (at + PAGE as usize).min(file_bytes.len());
            (at < end).then(|| (p, file_bytes[at..end].to_vec()))
        })
        .collect()
}

/// A power cut on `file`: every page that differs from its durable image
/// gets, at random (`coin`), its written or its durable bytes. Returns
/// (pages that differed, pages reverted to their durable bytes).
pub fn power_cut(file: &Path, mut coin: impl FnMut() -> bool) -> io::Result<(u64, u64)> {
    let f = OpenOptions::new().read(true).write(true).open(file)?;
    let image = File::open(image_path(file))?;
    let len = f.metadata()?.len().max(image.metadata()?.len());
    let (mut differ, mut reverted) = (0, 0);
    let mut a = vec![0u8; PAGE as usize];
    let mut b = vec![0u8; PAGE as usize];
    let mut at = 0;
    while at < len {
        a.fill(0);
        b.fill(0);
        let na = f.read_at(&mut a, at)?;
        let nb = image.read_at(&mut b, at)?;
        if a != b {
            differ += 1;
            if coin() {
                reverted += 1;
                f.write_all_at(&b[..nb.max(na)], at)?;
            }
        }
        at += PAGE;
    }
    f.sync_all()?;
    Ok((differ, reverted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_power_cut_keeps_synced_pages_and_may_lose_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.write_all_at(&[1u8; 3 * PAGE as usize], 0).unwrap();
        let s = Shadow::open(&path, &f).unwrap(); // all three pages durable
        let _one = s.sync_guard();
        // Page 0 rewritten and synced; page 1 rewritten, not synced; page 2
        // rewritten after the sync took its pages.
        f.write_all_at(&[2u8; PAGE as usize], 0).unwrap();
        s.wrote(0, PAGE);
        let pages = s.before_sync(&f);
        f.write_all_at(&[3u8; PAGE as usize], 2 * PAGE).unwrap();
        s.wrote(2 * PAGE, PAGE);
        f.sync_data().unwrap();
        s.after_sync(pages);
        f.write_all_at(&[4u8; PAGE as usize], PAGE).unwrap();
        s.wrote(PAGE, PAGE);
        drop(f);
        // Every unsynced page reverted: pages 1 and 2 go back to 1s.
        let (differ, reverted) = power_cut(&path, || true).unwrap();
        assert_eq!((differ, reverted), (2, 2));
        let b = std::fs::read(&path).unwrap();
        assert!(
            b[..PAGE as usize].iter().all(|&x| x == 2),
            "the synced page stays"
        );
        assert!(
            b[PAGE as usize..].iter().all(|&x| x == 1),
            "unsynced pages lost"
        );
        // Nothing differs any more; a cut that keeps everything changes nothing.
        assert_eq!(power_cut(&path, || false).unwrap(), (0, 0));
    }
}
