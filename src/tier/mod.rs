//! Backing tiers: where evicted groups live.
//!
//! A `Tier` reads and writes whole groups, in batches, at the offsets the
//! geometry's bijection gives (`index × stride`). Every transfer is exactly
//! one stride (the group padded to 4096) into or out of a buffer aligned to
//! `IO_ALIGN`, so O_DIRECT works and no tier needs a bounce buffer. Tiers
//! never transform bytes and never keep per-group state: checksums and
//! "written" bits are the cascade's. `file` is pread/pwrite, `uring` is
//! io_uring with O_DIRECT and a queue depth, `mem` is RAM for tests, and
//! `fault` wraps any tier to fail chosen operations. A short transfer is an
//! error, never silently padded.

mod fault;
mod file;
mod mem;
pub mod redis;
pub mod shadow;
mod uring;

pub use self::redis::{RedisTier, RemoteConfig};
pub use fault::{Fault, FaultSwitch, FaultTier};
pub use file::FileTier;
pub use mem::MemTier;
pub use uring::UringTier;

use crate::geometry::{GroupIndex, GroupLayout, IO_ALIGN, Location};
use std::fmt;
use std::io;

/// Which direction a transfer went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("backing {op} of group {index} at offset {offset} failed: {source}")]
    Io {
        op: Op,
        index: GroupIndex,
        offset: u64,
        #[source]
        source: io::Error,
    },
    #[error("short backing {op} of group {index}: {done} of {want} bytes")]
    Short {
        op: Op,
        index: GroupIndex,
        done: usize,
        want: usize,
    },
    #[error("group {index} is outside the backing ({count} groups)")]
    OutOfRange { index: GroupIndex, count: u64 },
    #[error(
        "buffer for group {index} must be {want} bytes aligned to {IO_ALIGN}, got {len} bytes at {addr:#x}"
    )]
    BadBuffer {
        index: GroupIndex,
        want: usize,
        len: usize,
        addr: usize,
    },
    #[error("backing sync failed: {0}")]
    Sync(#[source] io::Error),
    /// A remote tier's failure: the server refused (OOM: ENOSPC), could
    /// not be reached or timed out (EIO), or its value failed its checks.
    #[error("remote {op} of group {index} failed: {message}")]
    Remote {
        op: Op,
        index: GroupIndex,
        errno: i32,
        message: String,
    },
    #[error("remote sync failed: {message}")]
    RemoteSync { errno: i32, message: String },
}

impl TierError {
    /// The OS error number behind this error, where there is one.
    pub fn os_error(&self) -> Option<i32> {
        match self {
            TierError::Io { source, .. } | TierError::Sync(source) => source.raw_os_error(),
            TierError::Remote { errno, .. } | TierError::RemoteSync { errno, .. } => Some(*errno),
            TierError::Short { .. }
            | TierError::OutOfRange { .. }
            | TierError::BadBuffer { .. } => None,
        }
    }
}

/// One group to read; `buf` is `stride` bytes aligned to `IO_ALIGN`.
pub struct ReadOp<'a> {
    pub index: GroupIndex,
    pub buf: &'a mut [u8],
}

/// One group to write; `buf` is `stride` bytes aligned to `IO_ALIGN`.
/// `generation` is the group's write-back count after this write: tiers
/// that keep a header with each value (`redis`) record it; others ignore it.
pub struct WriteOp<'a> {
    pub index: GroupIndex,
    pub buf: &'a [u8],
    pub generation: u64,
}

/// A backing tier.
///
/// Contract: `read_batch`/`write_batch` return one result per op, in op
/// order, and return only once no transfer of the batch is in flight (the
/// buffers are borrowed for the call, never beyond it). A failed op does not
/// stop the others. A write that returned Ok is visible to later reads;
/// `sync` makes every Ok write durable.
pub trait Tier: Send + Sync {
    fn name(&self) -> &'static str;
    fn layout(&self) -> &GroupLayout;
    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Vec<Result<(), TierError>>;
    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Vec<Result<(), TierError>>;
    fn sync(&self) -> Result<(), TierError>;

    /// Appends the tier's own metrics (a remote tier's connections,
    /// errors, round trips) to a Prometheus exposition; most have none.
    fn render_stats(&self, _e: &mut crate::stats::Exposition) {}

    /// A remote tier's servers as the operator named them (`.kvfs/layout`);
    /// None for local tiers.
    fn remote(&self) -> Option<String> {
        None
    }

    /// Lets go of what the kernel would otherwise keep open a moment past
    /// the process (an io_uring's registered data file): called once the
    /// daemon is done with the store, so the backing filesystem can be
    /// unmounted as soon as `kvfs umount` returns. The tier still works
    /// after (it sets such things up again when next used).
    fn quiesce(&self) {}

    fn read_one(&self, index: GroupIndex, buf: &mut [u8]) -> Result<(), TierError> {
        let mut ops = [ReadOp { index, buf }];
        self.read_batch(&mut ops).pop().expect("one result per op")
    }

    fn write_one(&self, index: GroupIndex, buf: &[u8], generation: u64) -> Result<(), TierError> {
        self.write_batch(&[WriteOp {
            index,
            buf,
            generation,
        }])
        .pop()
        .expect("one result per op")
    }
}

/// A shared tier is a tier (tests keep a handle to a tier a cascade owns).
impl<T: Tier + ?Sized> Tier for std::sync::Arc<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn layout(&self) -> &GroupLayout {
        (**self).layout()
    }
    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Vec<Result<(), TierError>> {
        (**self).read_batch(ops)
    }
    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Vec<Result<(), TierError>> {
        (**self).write_batch(ops)
    }
    fn sync(&self) -> Result<(), TierError> {
        (**self).sync()
    }
    fn render_stats(&self, e: &mut crate::stats::Exposition) {
        (**self).render_stats(e)
    }
    fn remote(&self) -> Option<String> {
        (**self).remote()
    }
    fn quiesce(&self) {
        (**self).quiesce()
    }
}

/// Copies of each group in the data file: a write-back goes to the copy
/// that does not hold the group's last synced bytes, so a crash mid-write
/// never destroys them (see cascade::meta). Copy `k` of group `g` is the
/// tier's index `g × COPIES + k`.
pub const COPIES: u64 = 2;

/// The tier index of copy `copy` of group `g`.
pub fn copy_index(g: GroupIndex, copy: u8) -> GroupIndex {
    GroupIndex(g.0 * COPIES + copy as u64)
}

/// Bytes of the data file: every copy of every group, one stride each.
pub fn data_bytes(layout: &GroupLayout) -> u64 {
    layout.backing_bytes() * COPIES
}

/// Checks an op's index and buffer against the layout; every tier calls it
/// before touching the backing so a bad request never reaches the kernel.
pub(crate) fn check_op(
    layout: &GroupLayout,
    index: GroupIndex,
    buf: &[u8],
) -> Result<(), TierError> {
    let count = layout.group_count() * COPIES;
    if index.0 >= count {
        return Err(TierError::OutOfRange { index, count });
    }
    let want = layout.stride() as usize;
    let addr = buf.as_ptr() as usize;
    if buf.len() != want || !addr.is_multiple_of(IO_ALIGN as usize) {
        return Err(TierError::BadBuffer {
            index,
            want,
            len: buf.len(),
            addr,
        });
    }
    Ok(())
}

/// Backing kinds selectable on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TierKind {
    #[default]
    Uring,
    File,
    /// A Redis/Valkey server or cluster (`RemoteConfig`).
    Redis,
}

impl std::str::FromStr for TierKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "uring" => Ok(TierKind::Uring),
            "file" => Ok(TierKind::File),
            "redis" => Ok(TierKind::Redis),
            _ => Err(format!(
                "unknown tier {s:?} (expected uring, file or redis)"
            )),
        }
    }
}

impl fmt::Display for TierKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TierKind::Uring => "uring",
            TierKind::File => "file",
            TierKind::Redis => "redis",
        })
    }
}

impl TierKind {
    /// Where this tier keeps group bytes.
    pub fn location(self) -> Location {
        match self {
            TierKind::Uring | TierKind::File => Location::Local,
            TierKind::Redis => Location::Remote,
        }
    }
}

/// Default io_uring queue depth: 32 saturates NVMe random 4 KiB reads on the
/// machines we run on (fio shows no gain beyond it) without long tail waits.
pub const DEFAULT_QUEUE_DEPTH: u32 = 32;

/// Opens a data file as the chosen tier.
pub fn open_tier(
    kind: TierKind,
    path: &std::path::Path,
    layout: GroupLayout,
    queue_depth: u32,
) -> io::Result<Box<dyn Tier>> {
    Ok(match kind {
        TierKind::Uring => Box::new(UringTier::open(path, layout, queue_depth)?),
        TierKind::File => Box::new(FileTier::open(path, layout)?),
        TierKind::Redis => {
            return Err(io::Error::other(
                "the redis tier has no data file: it is opened with its RemoteConfig",
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Dtype;
    use crate::gpu::HostBuf;

    fn layout() -> GroupLayout {
        GroupLayout::new(2, 8, 2, 16, 128, Dtype::Fp16).unwrap()
    }

    fn exercise(tier: &dyn Tier) {
        let l = *tier.layout();
        let stride = l.stride() as usize;
        let n = l.group_count() as usize;
        let mut src = HostBuf::alloc(stride * n).unwrap();
        for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
            *b = (i * 7 + i / 4096) as u8;
        }
        let writes: Vec<WriteOp> = (0..n)
            .map(|i| WriteOp {
                index: GroupIndex(i as u64),
                buf: &src.as_slice()[i * stride..(i + 1) * stride],
                generation: 1,
            })
            .collect();
        assert!(tier.write_batch(&writes).iter().all(|r| r.is_ok()));
        tier.sync().unwrap();
        let mut dst = HostBuf::alloc(stride * n).unwrap();
        let mut reads: Vec<ReadOp> = dst
            .as_mut_slice()
            .chunks_mut(stride)
            .enumerate()
            .map(|(i, buf)| ReadOp {
                index: GroupIndex((n - 1 - i) as u64),
                buf,
            })
            .collect();
        assert!(tier.read_batch(&mut reads).iter().all(|r| r.is_ok()));
        for i in 0..n {
            let j = n - 1 - i;
            assert_eq!(
                &dst.as_slice()[i * stride..(i + 1) * stride],
                &src.as_slice()[j * stride..(j + 1) * stride]
            );
        }
        // Out of range and misaligned buffers are refused, not sent.
        let mut one = HostBuf::alloc(stride + 4096).unwrap();
        let e = tier
            .read_one(
                GroupIndex(n as u64 * COPIES),
                &mut one.as_mut_slice()[..stride],
            )
            .unwrap_err();
        assert!(matches!(e, TierError::OutOfRange { .. }), "{e}");
        let e = tier
            .read_one(GroupIndex(0), &mut one.as_mut_slice()[1..stride + 1])
            .unwrap_err();
        assert!(matches!(e, TierError::BadBuffer { .. }), "{e}");
    }

    #[test]
    fn all_tiers_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let l = layout();
        exercise(&MemTier::new(l));
        exercise(&FileTier::open(&dir.path().join("f"), l).unwrap());
        exercise(&UringTier::open(&dir.path().join("u"), l, 4).unwrap());
        exercise(&UringTier::open(&dir.path().join("u1"), l, 1).unwrap());
    }

    #[test]
    fn uring_and_file_agree_on_offsets() {
        let dir = tempfile::tempdir().unwrap();
        let l = layout();
        let p = dir.path().join("d");
        let stride = l.stride() as usize;
        let mut b = HostBuf::alloc(stride).unwrap();
        b.as_mut_slice().fill(0xab);
        UringTier::open(&p, l, 8)
            .unwrap()
            .write_one(GroupIndex(5), b.as_slice(), 1)
            .unwrap();
        let raw = std::fs::read(&p).unwrap();
        let off = l.offset(GroupIndex(5)) as usize;
        assert!(raw[off..off + stride].iter().all(|&x| x == 0xab));
        let mut c = HostBuf::alloc(stride).unwrap();
        FileTier::open(&p, l)
            .unwrap()
            .read_one(GroupIndex(5), c.as_mut_slice())
            .unwrap();
        assert_eq!(b.as_slice(), c.as_slice());
    }
}
