//! The `file` tier: pread/pwrite on the sparse data file, one call per
//! transfer. Portable and simple; the baseline the `uring` tier must beat.

use super::{Op, ReadOp, Tier, TierError, WriteOp, check_op};
use crate::geometry::GroupLayout;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The portable tier: plain pread/pwrite on a (sparse) data file.
pub struct FileTier {
    file: File,
    layout: GroupLayout,
    /// The durable image, for power-loss tests (see `shadow`).
    shadow: Option<super::shadow::Shadow>,
}

impl FileTier {
    /// Opens (creating if absent) the data file at `path`.
    pub fn open(path: &Path, layout: GroupLayout) -> io::Result<FileTier> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let shadow = match super::shadow::enabled() {
            true => Some(super::shadow::Shadow::open(path, &file)?),
            false => None,
        };
        Ok(FileTier {
            file,
            layout,
            shadow,
        })
    }
}

fn io_err(
    op: Op,
    layout: &GroupLayout,
    index: crate::geometry::GroupIndex,
    e: io::Error,
) -> TierError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        return TierError::Short {
            op,
            index,
            done: 0,
            want: layout.stride() as usize,
        };
    }
    TierError::Io {
        op,
        index,
        offset: layout.offset(index),
        source: e,
    }
}

impl Tier for FileTier {
    fn name(&self) -> &'static str {
        "file"
    }

    fn layout(&self) -> &GroupLayout {
        &self.layout
    }

    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Vec<Result<(), TierError>> {
        ops.iter_mut()
            .map(|op| {
                check_op(&self.layout, op.index, op.buf)?;
                self.file
                    .read_exact_at(op.buf, self.layout.offset(op.index))
                    .map_err(|e| io_err(Op::Read, &self.layout, op.index, e))
            })
            .collect()
    }

    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Vec<Result<(), TierError>> {
        ops.iter()
            .map(|op| {
                check_op(&self.layout, op.index, op.buf)?;
                let at = self.layout.offset(op.index);
                self.file
                    .write_all_at(op.buf, at)
                    .map_err(|e| io_err(Op::Write, &self.layout, op.index, e))?;
                // Recorded once written: a sync taking it then reads it.
                if let Some(s) = &self.shadow {
                    s.wrote(at, op.buf.len() as u64);
                }
                Ok(())
            })
            .collect()
    }

    fn sync(&self) -> Result<(), TierError> {
        let _one = self.shadow.as_ref().map(|s| s.sync_guard());
        let pages = self.shadow.as_ref().map(|s| s.before_sync(&self.file));
        self.file.sync_data().map_err(TierError::Sync)?;
        if let (Some(s), Some(p)) = (&self.shadow, pages) {
            s.after_sync(p);
        }
        Ok(())
    }
}
