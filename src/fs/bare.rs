//! A bare fuser filesystem, the baseline for `kvfs bench fuse`: one flat
//! directory of `count` files of `size` bytes, all holding the same bytes
//! from RAM. It does nothing kvfs does not have to do too, so kvfs's cost
//! over it is the cost of kvfs itself.

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, Request,
};
use std::ffi::OsStr;
use std::time::{Duration, SystemTime};

const TTL: Duration = Duration::from_secs(3600);
const FIRST: u64 = 2;

pub struct BareFs {
    count: u64,
    data: Vec<u8>,
    born: SystemTime,
}

impl BareFs {
    pub fn new(count: u64, data: Vec<u8>) -> BareFs {
        BareFs {
            count,
            data,
            born: SystemTime::now(),
        }
    }

    fn attr(&self, ino: u64) -> FileAttr {
        let dir = ino == 1;
        FileAttr {
            ino: INodeNo(ino),
            size: if dir { 0 } else { self.data.len() as u64 },
            blocks: 0,
            atime: self.born,
            mtime: self.born,
            ctime: self.born,
            crtime: self.born,
            kind: if dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            },
            perm: if dir { 0o755 } else { 0o644 },
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

impl Filesystem for BareFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let n = name
            .to_str()
            .and_then(|s| s.strip_prefix('f'))
            .and_then(|s| s.parse::<u64>().ok());
        match n {
            Some(n) if parent.0 == 1 && n < self.count => {
                reply.entry(&TTL, &self.attr(FIRST + n), Generation(0))
            }
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino.0 == 1 || (ino.0 >= FIRST && ino.0 < FIRST + self.count) {
            reply.attr(&TTL, &self.attr(ino.0))
        } else {
            reply.error(Errno::ENOENT)
        }
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let start = (offset as usize).min(self.data.len());
        let end = (start + size as usize).min(self.data.len());
        reply.data(&self.data[start..end]);
    }

    fn flush(&self, _r: &Request, _i: INodeNo, _fh: FileHandle, _lo: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        for i in offset..self.count {
            if reply.add(
                INodeNo(FIRST + i),
                i + 1,
                FileType::RegularFile,
                format!("f{i}"),
            ) {
                break;
            }
        }
        reply.ok();
    }
}
