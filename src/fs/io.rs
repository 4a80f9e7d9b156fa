//! Group file I/O: reads, writes and truncation of `L{l}/B{b}/H{h}/{K|V}`
//! go straight to the cascade, which owns every byte and its durability.
//! A group's size never changes: reads stop at `group_bytes`, and a
//! truncate zeroes the tail instead of shortening the file.

use super::{ATTR_TTL, KvFs, Node, errno};
use crate::geometry::GroupIndex;
use fuser::{Errno, ReplyAttr, ReplyData, ReplyWrite};
use std::time::Instant;

thread_local! {
    /// Each FUSE thread's read buffer, reused so a read allocates nothing.
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl KvFs {
    /// Reads group `g`; `t` is when the request arrived, for the latency
    /// histogram.
    pub(super) fn read_group(
        &self,
        g: GroupIndex,
        offset: u64,
        size: u32,
        t: Instant,
        reply: ReplyData,
    ) {
        let gb = self.cascade.layout().group_bytes();
        if offset >= gb {
            return reply.data(&[]);
        }
        let len = (size as u64).min(gb - offset) as usize;
        READ_BUF.with_borrow_mut(|buf| {
            if buf.len() < len {
                buf.resize(len, 0);
            }
            match self.cascade.read(g, offset, &mut buf[..len]) {
                Ok(_) => reply.data(&buf[..len]),
                Err(e) => reply.error(errno(&e)),
            }
        });
        self.lat.read.observe(t.elapsed());
    }

    /// Writes group `g`; `t` is when the request arrived, for the latency
    /// histogram.
    pub(super) fn write_group(
        &self,
        g: GroupIndex,
        offset: u64,
        data: &[u8],
        t: Instant,
        reply: ReplyWrite,
    ) {
        match self.cascade.write(g, offset, data) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(errno(&e)),
        }
        self.lat.write.observe(t.elapsed());
    }

    /// The size part of a setattr on `n`, then the attributes in reply.
    pub(super) fn set_size(&self, n: Node, size: Option<u64>, reply: ReplyAttr) {
        let gb = self.cascade.layout().group_bytes();
        match (n, size) {
            // Groups keep their size. Truncating to `s` zeroes the bytes from
            // `s` on, as truncate-then-extend would on a plain file; so
            // `echo x > group` (an O_TRUNC open) leaves x and then zeros.
            (Node::Group(g), Some(s)) if s <= gb => {
                if s < gb
                    && let Err(e) = self.cascade.write(g, s, &vec![0u8; (gb - s) as usize])
                {
                    return reply.error(errno(&e));
                }
            }
            (Node::Group(_), Some(_)) => return reply.error(Errno::EFBIG),
            (_, Some(_)) => return reply.error(Errno::EPERM),
            _ => {}
        }
        reply.attr(&ATTR_TTL, &self.attr(n));
    }
}
