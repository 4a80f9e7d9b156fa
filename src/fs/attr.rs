//! Attributes and extended attributes, computed on each call from the
//! layout and the cascade, never stored. Every group file is exactly
//! `group_bytes` long whatever it holds; only `blocks` (what `du` shows)
//! says whether it holds anything. Groups carry three read-only xattrs:
//! `user.kvfs.tier`, `user.kvfs.dirty` and `user.kvfs.crc32c` (absent for
//! an empty group).

use super::{KvFs, Node, errno};
use crate::cascade::{CascadeError, Residence};
use crate::geometry::GroupIndex;
use fuser::{Errno, FileAttr, FileType, INodeNo, ReplyXattr};
use std::ffi::OsStr;

const XATTR_TIER: &str = "user.kvfs.tier";
const XATTR_DIRTY: &str = "user.kvfs.dirty";
const XATTR_CRC: &str = "user.kvfs.crc32c";

impl KvFs {
    pub(super) fn attr(&self, node: Node) -> FileAttr {
        let (kind, perm, size, nlink) = match node {
            Node::Root | Node::KvfsDir | Node::ResidentDir => (FileType::Directory, 0o755, 0, 2),
            Node::Layer(_) | Node::Block(..) | Node::Head(..) => (FileType::Directory, 0o755, 0, 2),
            Node::Group(_) => (
                FileType::RegularFile,
                0o644,
                self.cascade.layout().group_bytes(),
                1,
            ),
            Node::Stats | Node::Layout | Node::Pid => (FileType::RegularFile, 0o444, 0, 1),
            Node::Flush => (FileType::RegularFile, 0o200, 0, 1),
            Node::Control => (FileType::RegularFile, self.control_mode, 0, 1),
            Node::Resident(g) => (
                FileType::Symlink,
                0o777,
                self.resident_target(g).len() as u64,
                1,
            ),
        };
        let blocks = match node {
            Node::Group(g) => match self.cascade.query(g).map(|q| q.residence) {
                Ok(Residence::Empty) | Err(_) => 0,
                Ok(_) => size.div_ceil(512),
            },
            _ => 0,
        };
        FileAttr {
            ino: INodeNo(self.inodes.ino(node)),
            size,
            blocks,
            atime: self.born,
            mtime: self.born,
            ctime: self.born,
            crtime: self.born,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn xattr(&self, g: GroupIndex, name: &str) -> Result<Option<String>, CascadeError> {
        let q = self.cascade.query(g)?;
        Ok(match name {
            XATTR_TIER => Some(q.residence.name().to_string()),
            XATTR_DIRTY => Some(if q.dirty { "1" } else { "0" }.to_string()),
            XATTR_CRC => match q.residence {
                Residence::Empty => None,
                // A dirty group's checksum is that of its current bytes.
                _ if q.dirty || q.backing_crc.is_none() => {
                    let mut b = vec![0u8; self.cascade.layout().group_bytes() as usize];
                    self.cascade.read(g, 0, &mut b)?;
                    Some(format!("{:08x}", crc32c::crc32c(&b)))
                }
                _ => q.backing_crc.map(|c| format!("{c:08x}")),
            },
            _ => None,
        })
    }

    pub(super) fn get_xattr(&self, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let Some(Node::Group(g)) = self.inodes.node(ino.0) else {
            return reply.error(Errno::NO_XATTR);
        };
        match self.xattr(g, &name.to_string_lossy()) {
            Ok(Some(v)) => reply_xattr(reply, size, v.as_bytes()),
            Ok(None) => reply.error(Errno::NO_XATTR),
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(super) fn list_xattr(&self, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let Some(Node::Group(g)) = self.inodes.node(ino.0) else {
            return reply_xattr(reply, size, &[]);
        };
        let mut names = Vec::new();
        for n in [XATTR_TIER, XATTR_DIRTY, XATTR_CRC] {
            if n == XATTR_CRC
                && matches!(
                    self.cascade.query(g).map(|q| q.residence),
                    Ok(Residence::Empty)
                )
            {
                continue;
            }
            names.extend_from_slice(n.as_bytes());
            names.push(0);
        }
        reply_xattr(reply, size, &names)
    }
}

fn reply_xattr(reply: ReplyXattr, size: u32, data: &[u8]) {
    if size == 0 {
        reply.size(data.len() as u32);
    } else if (size as usize) < data.len() {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(data);
    }
}
