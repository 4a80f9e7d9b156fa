//! The `.kvfs/` files: `stats` (Prometheus text), `layout` (JSON),
//! `resident/` (a symlink per T1-resident group), `flush` (write anything:
//! every dirty group is written back and made durable before the write
//! returns), `pid`, and `control`, whose protocol lives in `control`; here
//! is only the glue from FUSE open/read/write/ioctl/poll to its `Session`.
//! Text files are rendered once at open, so a reader sees one consistent
//! snapshot however it splits its reads; all are opened FOPEN_DIRECT_IO, so
//! the kernel never serves a stale copy.

use super::{Handle, KvFs, Node, errno};
use crate::control::wire;
use crate::geometry::{GroupIndex, GroupKey};
use crate::stats::{self, Exposition};
use fuser::{
    Errno, FileHandle, FopenFlags, INodeNo, OpenFlags, ReplyData, ReplyOpen, ReplyWrite, Request,
};

impl KvFs {
    fn key(&self, g: GroupIndex) -> GroupKey {
        self.cascade
            .layout()
            .key(g)
            .expect("inode ranges only hold valid groups")
    }

    pub(super) fn resident_name(&self, g: GroupIndex) -> String {
        let k = self.key(g);
        format!("L{}.B{}.H{}.{}", k.layer, k.block, k.head, k.kind.letter())
    }

    pub(super) fn resident_target(&self, g: GroupIndex) -> String {
        format!("../../{}", self.key(g))
    }

    /// The `.kvfs/stats` document.
    pub fn render_stats(&self) -> String {
        let s = self.cascade.stats();
        let mut e = Exposition::default();
        e.header(stats::HITS, "counter", "Group reads served, by tier.");
        e.sample(stats::HITS, "tier=\"t1\"", s.hits);
        e.sample(stats::HITS, "tier=\"backing\"", s.misses);
        e.single(
            stats::MISSES,
            "counter",
            "Group reads that missed T1 and went to the backing.",
            s.misses,
        );
        e.single(
            stats::EMPTY_READS,
            "counter",
            "Reads of never-written groups (zeros, no I/O).",
            s.empty_reads,
        );
        e.header(stats::READ_BYTES, "counter", "Bytes read, by tier.");
        e.sample(stats::READ_BYTES, "tier=\"t1\"", s.t1_read_bytes);
        e.sample(stats::READ_BYTES, "tier=\"backing\"", s.backing_read_bytes);
        e.header(stats::WRITE_BYTES, "counter", "Bytes written, by tier.");
        e.sample(stats::WRITE_BYTES, "tier=\"t1\"", s.t1_write_bytes);
        e.sample(
            stats::WRITE_BYTES,
            "tier=\"backing\"",
            s.backing_write_bytes,
        );
        e.single(
            stats::EVICTIONS,
            "counter",
            "Groups evicted from T1.",
            s.evictions,
        );
        e.single(
            stats::FLUSHES,
            "counter",
            "Groups written back to the backing.",
            s.flushes,
        );
        e.single(
            stats::FLUSHED_BYTES,
            "counter",
            "Bytes written back to the backing.",
            s.flushed_bytes,
        );
        e.single(
            stats::CHECKSUM_FAILURES,
            "counter",
            "Backing reads refused for a bad checksum.",
            s.checksum_failures,
        );
        e.single(
            stats::RECOVERED_READS,
            "counter",
            "Backing reads that found a group's newest copy cut short by a crash and served its last synced copy.",
            s.recovered_reads,
        );
        e.single(
            stats::WRITE_BACK_FAILURES,
            "counter",
            "Write-backs the backing failed.",
            s.write_back_failures,
        );
        e.single(
            stats::T1_SLOTS_USED,
            "gauge",
            "T1 slots holding a group.",
            s.t1_slots_used,
        );
        e.single(
            stats::T1_SLOTS_TOTAL,
            "gauge",
            "T1 slots in all.",
            s.t1_slots_total,
        );
        e.single(
            stats::T1_SLOTS_READY,
            "gauge",
            "T1 slots whose memory is allocated (pinned, with a GPU): T1 is allocated in the background after its first chunk; equal to kvfs_t1_slots_total once that is done.",
            s.t1_slots_ready,
        );
        e.single(
            stats::DIRTY_GROUPS,
            "gauge",
            "Groups in T1 not yet written back.",
            s.dirty_slots,
        );
        e.single(
            stats::DIRTY_BYTES,
            "gauge",
            "Bytes in T1 not yet written back.",
            s.dirty_bytes,
        );
        e.histogram(
            stats::OP_LATENCY,
            "Filesystem operation latency.",
            &[
                ("op=\"read\"", &self.lat.read),
                ("op=\"write\"", &self.lat.write),
                ("op=\"fsync\"", &self.lat.fsync),
                ("op=\"lookup\"", &self.lat.lookup),
            ],
        );
        self.control.render_stats(&mut e);
        self.cascade.render_tier_stats(&mut e);
        e.single(
            "kvfs_uptime_seconds",
            "gauge",
            "Seconds since the mount.",
            self.started.elapsed().as_secs(),
        );
        e.finish()
    }

    fn render_layout(&self) -> String {
        format!("{}\n", self.control.layout().to_json())
    }

    /// Opens a node other than a group file: a `.kvfs/` file, or a
    /// directory (EISDIR).
    pub(super) fn open_special(&self, req: &Request, node: Node, reply: ReplyOpen) {
        match node {
            Node::Stats => {
                let fh = self.new_handle(Handle::Text(self.render_stats().into_bytes()));
                reply.opened(fh, FopenFlags::FOPEN_DIRECT_IO)
            }
            Node::Layout => {
                let fh = self.new_handle(Handle::Text(self.render_layout().into_bytes()));
                reply.opened(fh, FopenFlags::FOPEN_DIRECT_IO)
            }
            Node::Pid => {
                let fh = self.new_handle(Handle::Text(
                    format!("{}\n", std::process::id()).into_bytes(),
                ));
                reply.opened(fh, FopenFlags::FOPEN_DIRECT_IO)
            }
            Node::Flush => {
                reply.opened(self.new_handle(Handle::Group), FopenFlags::FOPEN_DIRECT_IO)
            }
            Node::Control => {
                // Group files are the owner's to write (0644): through the
                // control file, too, only the owner (or root) may STORE.
                let may_write = req.uid() == self.uid || req.uid() == 0;
                let s = self.control.open_session(req.uid(), req.gid(), may_write);
                let fh = self.new_handle(Handle::Control(s));
                reply.opened(
                    fh,
                    FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_NONSEEKABLE,
                )
            }
            _ => reply.error(Errno::EISDIR),
        }
    }

    /// Reads a node other than a group file: the control session's next
    /// reply, or a slice of the text rendered at open.
    pub(super) fn read_special(
        &self,
        node: Node,
        fh: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        reply: ReplyData,
    ) {
        match node {
            Node::Control => match self.session(fh) {
                Some(s) => {
                    let nonblock = flags.0 & libc::O_NONBLOCK != 0;
                    s.read(
                        size as usize,
                        nonblock,
                        Box::new(move |r| match r {
                            Ok(b) => reply.data(&b),
                            Err(e) => reply.error(Errno::from_i32(e)),
                        }),
                    )
                }
                None => reply.error(Errno::EBADF),
            },
            _ => {
                let h = self.handles.lock();
                match h.get(&fh.0) {
                    Some(Handle::Text(b)) => {
                        let start = (offset as usize).min(b.len());
                        let end = (start + size as usize).min(b.len());
                        reply.data(&b[start..end])
                    }
                    _ => reply.error(Errno::EBADF),
                }
            }
        }
    }

    /// Writes to a node other than a group file: a control request, or a
    /// flush of every dirty group.
    pub(super) fn write_special(&self, node: Node, fh: FileHandle, data: &[u8], reply: ReplyWrite) {
        match node {
            Node::Control => match self.session(fh) {
                Some(s) => reply.written(s.write(data) as u32),
                None => reply.error(Errno::EBADF),
            },
            Node::Flush => match self.cascade.sync_all() {
                Ok(()) => reply.written(data.len() as u32),
                Err(e) => {
                    tracing::error!("flush requested through .kvfs/flush failed: {e}");
                    reply.error(errno(&e))
                }
            },
            _ => reply.error(Errno::EBADF),
        }
    }

    /// An ioctl on the control file: one request, its reply in the ioctl
    /// buffer (or an E2BIG reply saying to use write/read instead).
    pub(super) fn control_ioctl(
        &self,
        ino: INodeNo,
        fh: FileHandle,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        if self.inodes.node(ino.0) != Some(Node::Control) || wire::ioctl_len(cmd).is_none() {
            return reply.error(Errno::ENOTTY);
        }
        let Some(s) = self.session(fh) else {
            return reply.error(Errno::EBADF);
        };
        let out_size = out_size as usize;
        s.ioctl(
            in_data,
            Box::new(move |r| {
                let b = r.encode();
                if b.len() <= out_size {
                    return reply.ioctl(0, &b);
                }
                let e = wire::Reply::error(
                    r.command,
                    libc::E2BIG,
                    wire::NO_ENTRY,
                    format!(
                        "the reply is {} bytes, the ioctl buffer {out_size}; use write(2)/read(2)",
                        b.len()
                    ),
                )
                .encode();
                if e.len() <= out_size {
                    reply.ioctl(0, &e)
                } else {
                    reply.error(Errno::from_i32(libc::E2BIG))
                }
            }),
        );
    }

    /// Polls the control file: always writable, readable once a reply is
    /// waiting. Any other file is always ready.
    pub(super) fn control_poll(
        &self,
        ino: INodeNo,
        fh: FileHandle,
        ph: fuser::PollNotifier,
        flags: fuser::PollFlags,
        reply: fuser::ReplyPoll,
    ) {
        use fuser::PollEvents as P;
        if self.inodes.node(ino.0) != Some(Node::Control) {
            return reply.poll(P::POLLIN | P::POLLRDNORM | P::POLLOUT | P::POLLWRNORM);
        }
        let Some(s) = self.session(fh) else {
            return reply.error(Errno::EBADF);
        };
        let notify: Option<Box<dyn FnOnce() + Send>> = flags
            .contains(fuser::PollFlags::FUSE_POLL_SCHEDULE_NOTIFY)
            .then(|| -> Box<dyn FnOnce() + Send> {
                Box::new(move || {
                    let _ = ph.notify();
                })
            });
        let mut ev = P::POLLOUT | P::POLLWRNORM;
        if s.poll(notify) {
            ev |= P::POLLIN | P::POLLRDNORM;
        }
        reply.poll(ev);
    }
}
