//! The `uring` tier: io_uring with O_DIRECT, many transfers in flight.
//! Buffers are owned by the caller for the whole call and every submitted
//! transfer is reaped before it returns, so the kernel never holds memory
//! past its owner's life; a short transfer is an error, never data.

use super::{Op, ReadOp, Tier, TierError, WriteOp, check_op};
use crate::geometry::{GroupIndex, GroupLayout};
use io_uring::{IoUring, opcode, types};
use parking_lot::Mutex;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// How often one transfer is resubmitted after EAGAIN/EINTR before it counts
/// as failed: those are transient, but a device that keeps answering them is
/// not going to succeed.
const MAX_RETRIES: u32 = 8;

/// The default tier on Linux: io_uring, O_DIRECT, batched.
///
/// Each calling thread borrows a ring from a small pool (rings are not safe
/// to share between concurrent submitters), keeps up to `queue_depth`
/// transfers in flight, refills the queue as completions arrive, and returns
/// only when every submitted transfer has completed: the batch's buffers are
/// borrowed for the call, and the kernel never holds them past it.
pub struct UringTier {
    file: File,
    layout: GroupLayout,
    queue_depth: u32,
    direct: bool,
    rings: Mutex<Vec<IoUring>>,
}

impl UringTier {
    /// Opens (creating if absent) the data file with O_DIRECT; where the
    /// filesystem refuses O_DIRECT (tmpfs on older kernels), opens it buffered
    /// and says so once.
    pub fn open(path: &Path, layout: GroupLayout, queue_depth: u32) -> io::Result<UringTier> {
        if queue_depth == 0 || queue_depth > 4096 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("queue depth {queue_depth} must be between 1 and 4096"),
            ));
        }
        let open = |direct: bool| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .custom_flags(if direct { libc::O_DIRECT } else { 0 })
                .open(path)
        };
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::info!(
                    "{}: the filesystem refuses O_DIRECT; using buffered I/O",
                    path.display()
                );
                (open(false)?, false)
            }
            Err(e) => return Err(e),
        };
        let tier = UringTier {
            file,
            layout,
            queue_depth,
            direct,
            rings: Mutex::new(Vec::new()),
        };
        // Fail at open, not at first I/O, where io_uring is unavailable.
        let ring = tier.new_ring()?;
        tier.rings.lock().push(ring);
        Ok(tier)
    }

    /// Whether transfers bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    pub fn queue_depth(&self) -> u32 {
        self.queue_depth
    }

    fn new_ring(&self) -> io::Result<IoUring> {
        let entries = self.queue_depth.next_power_of_two();
        // COOP_TASKRUN (Linux 5.19+) spares the task an interrupt per
        // completion; older kernels refuse the flag, so fall back to none.
        let ring = match IoUring::builder().setup_coop_taskrun().build(entries) {
            Ok(r) => r,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => IoUring::new(entries)?,
            Err(e) => return Err(e),
        };
        // A registered file saves an fd lookup per transfer.
        ring.submitter().register_files(&[self.file.as_raw_fd()])?;
        Ok(ring)
    }

    fn take_ring(&self) -> io::Result<IoUring> {
        match self.rings.lock().pop() {
            Some(r) => Ok(r),
            None => self.new_ring(),
        }
    }

    /// Runs the transfers `xfers` (already checked), writing each result into
    /// `out[xfer.slot]`.
    fn run(&self, op: Op, xfers: &[Xfer], out: &mut [Result<(), TierError>]) {
        if xfers.is_empty() {
            return;
        }
        let mut ring = match self.take_ring() {
            Ok(r) => r,
            Err(e) => {
                for x in xfers {
                    out[x.slot] = Err(TierError::Io {
                        op,
                        index: x.index,
                        offset: x.offset,
                        source: io::Error::new(e.kind(), format!("cannot set up io_uring: {e}")),
                    });
                }
                return;
            }
        };
        let depth = self.queue_depth as usize;
        let mut next = 0usize;
        let mut inflight = 0usize;
        let mut retry: Vec<usize> = Vec::new();
        let mut tries = vec![0u32; xfers.len()];
        while next < xfers.len() || inflight > 0 || !retry.is_empty() {
            {
                while inflight < depth {
                    let i = match retry.pop() {
                        Some(i) => i,
                        None if next < xfers.len() => {
                            next += 1;
                            next - 1
                        }
                        None => break,
                    };
                    let x = &xfers[i];
                    let sqe = match op {
                        Op::Read => opcode::Read::new(types::Fixed(0), x.ptr, x.len)
                            .offset(x.offset)
                            .build(),
                        Op::Write => opcode::Write::new(types::Fixed(0), x.ptr, x.len)
                            .offset(x.offset)
                            .build(),
                    }
                    .user_data(i as u64);
                    // SAFETY: the buffer `x.ptr..x.ptr+x.len` is borrowed by
                    // the caller of read_batch/write_batch for this whole call,
                    // and this loop does not return until every pushed entry's
                    // completion has been reaped (inflight == 0), so the kernel
                    // never touches it after it is released.
                    if unsafe { ring.submission().push(&sqe) }.is_err() {
                        // Queue full: put it back and submit what we have.
                        retry.push(i);
                        break;
                    }
                    inflight += 1;
                    // Submit each transfer as soon as it is queued: a batch
                    // submitted in one call is plugged and reaches the device
                    // as one burst, and on the virtio disks we measured that
                    // kept fewer transfers truly in flight (fio submits one
                    // at a time too). Errors surface in submit_and_wait below.
                    let _ = ring.submit();
                }
            }
            if inflight == 0 {
                continue;
            }
            if let Err(e) = ring.submit_and_wait(1) {
                match e.raw_os_error() {
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY) => {}
                    _ => {
                        // The ring itself is failing: fail what was not yet
                        // submitted, and keep reaping what is in flight.
                        for i in retry.drain(..).chain(next..xfers.len()) {
                            let x = &xfers[i];
                            out[x.slot] = Err(TierError::Io {
                                op,
                                index: x.index,
                                offset: x.offset,
                                source: io::Error::new(e.kind(), e.to_string()),
                            });
                        }
                        next = xfers.len();
                        std::thread::yield_now();
                    }
                }
            }
            for cqe in ring.completion() {
                let i = cqe.user_data() as usize;
                let x = &xfers[i];
                inflight -= 1;
                let res = cqe.result();
                if res < 0 {
                    let errno = -res;
                    if (errno == libc::EAGAIN || errno == libc::EINTR) && tries[i] < MAX_RETRIES {
                        tries[i] += 1;
                        retry.push(i);
                        continue;
                    }
                    out[x.slot] = Err(TierError::Io {
                        op,
                        index: x.index,
                        offset: x.offset,
                        source: io::Error::from_raw_os_error(errno),
                    });
                } else if res as u32 != x.len {
                    out[x.slot] = Err(TierError::Short {
                        op,
                        index: x.index,
                        done: res as usize,
                        want: x.len as usize,
                    });
                } else {
                    out[x.slot] = Ok(());
                }
            }
        }
        self.rings.lock().push(ring);
    }
}

struct Xfer {
    slot: usize,
    index: GroupIndex,
    ptr: *mut u8,
    len: u32,
    offset: u64,
}

impl Tier for UringTier {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn layout(&self) -> &GroupLayout {
        &self.layout
    }

    /// A ring is torn down by the kernel after its fd closes (deferred
    /// work), and until that is done its registered data file stays open:
    /// unmounting the backing filesystem right after `kvfs umount` failed
    /// with EBUSY. Unregistering is synchronous, and the pooled rings have
    /// nothing in flight (every call reaps its transfers before it gives
    /// its ring back).
    fn quiesce(&self) {
        let rings: Vec<IoUring> = std::mem::take(&mut *self.rings.lock());
        for ring in rings {
            if let Err(e) = ring.submitter().unregister_files() {
                tracing::warn!("cannot unregister the data file from an io_uring: {e}");
            }
        }
    }

    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Vec<Result<(), TierError>> {
        let mut out = Vec::with_capacity(ops.len());
        let mut xfers = Vec::with_capacity(ops.len());
        for (slot, op) in ops.iter_mut().enumerate() {
            let r = check_op(&self.layout, op.index, op.buf);
            if r.is_ok() {
                xfers.push(Xfer {
                    slot,
                    index: op.index,
                    ptr: op.buf.as_mut_ptr(),
                    len: op.buf.len() as u32,
                    offset: self.layout.offset(op.index),
                });
            }
            out.push(r);
        }
        self.run(Op::Read, &xfers, &mut out);
        out
    }

    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Vec<Result<(), TierError>> {
        let mut out = Vec::with_capacity(ops.len());
        let mut xfers = Vec::with_capacity(ops.len());
        for (slot, op) in ops.iter().enumerate() {
            let r = check_op(&self.layout, op.index, op.buf);
            if r.is_ok() {
                xfers.push(Xfer {
                    slot,
                    index: op.index,
                    // The kernel only reads from a write's buffer.
                    ptr: op.buf.as_ptr().cast_mut(),
                    len: op.buf.len() as u32,
                    offset: self.layout.offset(op.index),
                });
            }
            out.push(r);
        }
        self.run(Op::Write, &xfers, &mut out);
        out
    }

    fn sync(&self) -> Result<(), TierError> {
        self.file.sync_data().map_err(TierError::Sync)
    }
}
