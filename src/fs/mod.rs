//! The FUSE face of kvfs: the only place fuser's types appear, and the one
//! errno boundary (`errno()`, over the exhaustive `CascadeError::errno`).
//! A thin adapter over the cascade (mountpoint-s3's shape): every group is a
//! regular file `L{l}/B{b}/H{h}/{K|V}` of exactly `group_bytes` bytes, and the
//! tree is computed from the layout (`inode.rs`, `tree.rs`). The
//! `Filesystem` impl here only dispatches on the node; the work is in rooms:
//! `io.rs` (group files), `special.rs` (`.kvfs/`), `attr.rs` (attributes
//! and xattrs), `mount.rs` (mounting). What must stay true: group files are
//! opened FOPEN_KEEP_CACHE, which is sound only because every change to a
//! group passes through this process (kernel writes keep their page cache
//! coherent themselves; a control-file STORE drops the kernel's pages through
//! the change hook, for the inodes `KnownInodes` says the kernel holds).

mod attr;
mod bare;
mod inode;
mod io;
mod mount;
mod special;
mod tree;

pub use bare::BareFs;
pub use inode::{Inodes, KVFS_FILES, Node};
pub use mount::{BackgroundMount, MountOptions, Mounted, mount_background};

use crate::cascade::{Cascade, CascadeError};
use crate::control::{Control, Session};
use crate::geometry::GroupIndex;
use crate::stats::Histogram;
use fuser::{
    Errno, FileHandle, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, OpenFlags,
    ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, WriteFlags,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

/// Names never change meaning, so the kernel may cache lookups for long.
const ENTRY_TTL: Duration = Duration::from_secs(3600);
/// Attributes (blocks, for `du`) change as groups are written; short.
const ATTR_TTL: Duration = Duration::from_secs(1);

/// The errno boundary of FUSE replies: the mapping itself is
/// `CascadeError::errno`, exhaustive, shared with the control file.
pub fn errno(e: &CascadeError) -> Errno {
    Errno::from_i32(e.errno())
}

/// What an open file handle carries.
enum Handle {
    /// A group file: nothing to keep.
    Group,
    /// A generated text file, rendered once at open so a reader sees one
    /// consistent snapshot however it splits its reads.
    Text(Vec<u8>),
    /// The resident directory, listed once at opendir for stable offsets.
    Resident(Vec<GroupIndex>),
    /// A control-file session.
    Control(Arc<Session>),
}

#[derive(Default)]
struct Latencies {
    read: Histogram,
    write: Histogram,
    fsync: Histogram,
    lookup: Histogram,
}

pub struct KvFs {
    cascade: Arc<Cascade>,
    control: Arc<Control>,
    inodes: Inodes,
    uid: u32,
    gid: u32,
    /// Mode of `.kvfs/control`: owner-only, or open to all with
    /// --allow-other (each fd is its own session; see control::Session).
    control_mode: u16,
    born: SystemTime,
    handles: Mutex<HashMap<u64, Handle>>,
    /// Handles in `handles`, less those whose release is not yet replied
    /// to: an in-process unmount waits for none (see `BackgroundMount`),
    /// else a release the kernel sent before it would be answered after.
    open: Arc<AtomicU64>,
    next_fh: AtomicU64,
    lat: Latencies,
    started: Instant,
    /// Group inodes the kernel holds (looked up, not yet forgotten): only
    /// those can have cached pages to drop when a STORE changes a group.
    known: Arc<KnownInodes>,
}

/// Lookup counts of the group inodes the kernel holds, sharded by inode.
/// An inode the kernel has not looked up has no page cache, so a STORE
/// into it needs no invalidation (one write to /dev/fuse a group saved).
#[derive(Default)]
struct KnownInodes {
    shards: [Mutex<HashMap<u64, u64>>; 16],
    /// Inodes held, over all shards: while none is (an engine that never
    /// looks at the files), a STORE's groups are checked with one shared
    /// read each, not a shard lock each (4096 a 4 KiB ticket).
    held: AtomicUsize,
}

impl KnownInodes {
    fn shard(&self, ino: u64) -> &Mutex<HashMap<u64, u64>> {
        &self.shards[(ino % 16) as usize]
    }

    /// A lookup of `ino` is about to be answered.
    fn add(&self, ino: u64) {
        let mut m = self.shard(ino).lock();
        let c = m.entry(ino).or_insert(0);
        if *c == 0 {
            // Counted before the reply leaves: a STORE committed after
            // the kernel has the inode sees it held.
            self.held.fetch_add(1, Ordering::SeqCst);
        }
        *c += 1;
    }

    /// The kernel dropped `n` lookups of `ino`.
    fn forget(&self, ino: u64, n: u64) {
        let mut m = self.shard(ino).lock();
        if let Some(c) = m.get_mut(&ino) {
            *c = c.saturating_sub(n);
            if *c == 0 {
                m.remove(&ino);
                self.held.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    fn holds(&self, ino: u64) -> bool {
        self.held.load(Ordering::SeqCst) > 0 && self.shard(ino).lock().contains_key(&ino)
    }
}

impl KvFs {
    pub fn new(cascade: Arc<Cascade>, uid: u32, gid: u32) -> KvFs {
        let inodes = Inodes::new(*cascade.layout());
        KvFs {
            control: Control::new(cascade.clone()),
            cascade,
            inodes,
            uid,
            gid,
            control_mode: 0o600,
            born: SystemTime::now(),
            handles: Mutex::new(HashMap::new()),
            open: Arc::default(),
            next_fh: AtomicU64::new(1),
            lat: Latencies::default(),
            started: Instant::now(),
            known: Arc::default(),
        }
    }

    pub fn cascade(&self) -> &Arc<Cascade> {
        &self.cascade
    }

    fn session(&self, fh: FileHandle) -> Option<Arc<Session>> {
        match self.handles.lock().get(&fh.0) {
            Some(Handle::Control(s)) => Some(s.clone()),
            _ => None,
        }
    }

    fn new_handle(&self, h: Handle) -> FileHandle {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(fh, h);
        self.open.fetch_add(1, Ordering::Release);
        FileHandle(fh)
    }

    /// A file or directory's release: its handle goes (a control session
    /// closes), the release is answered, then counted out of `open`.
    fn release_handle(&self, fh: FileHandle, reply: ReplyEmpty) {
        // Taken out before the session closes and drops: the handle table's
        // lock is not held meanwhile (dropping a session lets go of its
        // regions, which can take a while).
        let handle = self.handles.lock().remove(&fh.0);
        if let Some(Handle::Control(s)) = &handle {
            s.close();
        }
        reply.ok();
        if handle.is_some() {
            self.open.fetch_sub(1, Ordering::Release);
        }
    }
}

impl Filesystem for KvFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let t = Instant::now();
        let found = self
            .inodes
            .node(parent.0)
            .zip(name.to_str())
            .and_then(|(p, n)| self.child(p, n));
        match found {
            Some(n) => {
                if matches!(n, Node::Group(_)) {
                    // Counted before the kernel can hold it (see KnownInodes).
                    self.known.add(self.inodes.ino(n));
                }
                reply.entry(&ENTRY_TTL, &self.attr(n), Generation(0))
            }
            None => reply.error(Errno::ENOENT),
        }
        self.lat.lookup.observe(t.elapsed());
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.known.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.inodes.node(ino.0) {
            Some(n) => reply.attr(&ATTR_TTL, &self.attr(n)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(n) = self.inodes.node(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        if mode.is_some() || uid.is_some() || gid.is_some() {
            return reply.error(Errno::EPERM);
        }
        self.set_size(n, size, reply);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.inodes.node(ino.0) {
            Some(Node::Resident(g)) => reply.data(self.resident_target(g).as_bytes()),
            _ => reply.error(Errno::EINVAL),
        }
    }

    fn mknod(
        &self,
        _r: &Request,
        _p: INodeNo,
        _n: &OsStr,
        _m: u32,
        _u: u32,
        _d: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EPERM);
    }

    fn mkdir(&self, _r: &Request, _p: INodeNo, _n: &OsStr, _m: u32, _u: u32, reply: ReplyEntry) {
        reply.error(Errno::EPERM);
    }

    fn unlink(&self, _r: &Request, _p: INodeNo, _n: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EPERM);
    }

    fn rmdir(&self, _r: &Request, _p: INodeNo, _n: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EPERM);
    }

    fn symlink(
        &self,
        _r: &Request,
        _p: INodeNo,
        _n: &OsStr,
        _t: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EPERM);
    }

    fn rename(
        &self,
        _r: &Request,
        _p: INodeNo,
        _n: &OsStr,
        _np: INodeNo,
        _nn: &OsStr,
        _f: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EPERM);
    }

    fn link(&self, _r: &Request, _i: INodeNo, _np: INodeNo, _nn: &OsStr, reply: ReplyEntry) {
        reply.error(Errno::EPERM);
    }

    fn create(
        &self,
        _r: &Request,
        _p: INodeNo,
        _n: &OsStr,
        _m: u32,
        _u: u32,
        _f: i32,
        reply: fuser::ReplyCreate,
    ) {
        reply.error(Errno::EPERM);
    }

    fn open(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.inodes.node(ino.0) {
            Some(Node::Group(_)) => {
                reply.opened(self.new_handle(Handle::Group), FopenFlags::FOPEN_KEEP_CACHE)
            }
            Some(n) => self.open_special(req, n, reply),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let t = Instant::now();
        match self.inodes.node(ino.0) {
            Some(Node::Group(g)) => self.read_group(g, offset, size, t, reply),
            Some(n) => self.read_special(n, fh, offset, size, flags, reply),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _wf: WriteFlags,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let t = Instant::now();
        match self.inodes.node(ino.0) {
            Some(Node::Group(g)) => self.write_group(g, offset, data, t, reply),
            Some(n) => self.write_special(n, fh, data, reply),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn flush(&self, _r: &Request, _i: INodeNo, _fh: FileHandle, _lo: LockOwner, reply: ReplyEmpty) {
        // close(2) promises nothing about durability; fsync does.
        reply.ok();
    }

    fn release(
        &self,
        _r: &Request,
        _i: INodeNo,
        fh: FileHandle,
        _f: OpenFlags,
        _lo: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.release_handle(fh, reply);
    }

    fn fsync(&self, _r: &Request, ino: INodeNo, _fh: FileHandle, _ds: bool, reply: ReplyEmpty) {
        let t = Instant::now();
        let r = match self.inodes.node(ino.0) {
            Some(Node::Group(g)) => self.cascade.flush(g),
            Some(_) => Ok(()),
            None => return reply.error(Errno::ENOENT),
        };
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
        self.lat.fsync.observe(t.elapsed());
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.inodes.node(ino.0) {
            Some(Node::ResidentDir) => {
                let fh = self.new_handle(Handle::Resident(self.cascade.resident()));
                reply.opened(fh, FopenFlags::empty())
            }
            Some(
                Node::Group(_)
                | Node::Stats
                | Node::Layout
                | Node::Flush
                | Node::Pid
                | Node::Resident(_),
            ) => reply.error(Errno::ENOTDIR),
            Some(_) => reply.opened(FileHandle(0), FopenFlags::empty()),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectory,
    ) {
        let Some(dir) = self.inodes.node(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        self.list_dir(dir, fh, offset, reply);
    }

    fn releasedir(
        &self,
        _r: &Request,
        _i: INodeNo,
        fh: FileHandle,
        _f: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.release_handle(fh, reply);
    }

    fn fsyncdir(&self, _r: &Request, _i: INodeNo, _fh: FileHandle, _ds: bool, reply: ReplyEmpty) {
        // fsync on any directory makes every group durable (the kernel does
        // not forward sync(2)/syncfs(2) to FUSE filesystems).
        match self.cascade.sync_all() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // Capacity: every group of the geometry; used: groups holding bytes
        // (written back, or dirty in T1); the rest is free.
        // Blocks of gcd(group bytes, 4096), so a group is whole blocks.
        let l = self.cascade.layout();
        let (groups, used) = (l.group_count(), self.cascade.used_groups());
        let (mut a, mut b) = (l.group_bytes(), 4096u64);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        let per = l.group_bytes() / a;
        let free = (groups - used) * per;
        reply.statfs(
            groups * per,
            free,
            free,
            groups,
            groups - used,
            4096,
            255,
            a as u32,
        );
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        self.get_xattr(ino, name, size, reply);
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        self.list_xattr(ino, size, reply);
    }

    fn setxattr(
        &self,
        _r: &Request,
        _i: INodeNo,
        _n: &OsStr,
        _v: &[u8],
        _f: i32,
        _p: u32,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EPERM);
    }

    fn removexattr(&self, _r: &Request, _i: INodeNo, _n: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EPERM);
    }

    fn ioctl(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: fuser::IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        self.control_ioctl(ino, fh, cmd, in_data, out_size, reply);
    }

    fn poll(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        ph: fuser::PollNotifier,
        _events: fuser::PollEvents,
        flags: fuser::PollFlags,
        reply: fuser::ReplyPoll,
    ) {
        self.control_poll(ino, fh, ph, flags, reply);
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        match self.inodes.node(ino.0) {
            Some(_) => reply.ok(),
            None => reply.error(Errno::ENOENT),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::KnownInodes;

    /// An inode is held from its first lookup until the kernel forgets
    /// every lookup of it, and the count of held inodes follows: with none
    /// held, nothing is.
    #[test]
    fn known_inodes_follow_lookups_and_forgets() {
        let k = KnownInodes::default();
        assert!(!k.holds(7));
        k.add(7);
        k.add(7);
        k.add(23);
        assert!(k.holds(7) && k.holds(23) && !k.holds(8));
        k.forget(7, 1);
        assert!(k.holds(7), "one lookup of 7 is left");
        k.forget(7, 1);
        assert!(!k.holds(7) && k.holds(23));
        // Forgetting more than was looked up, or what was never looked up,
        // counts nothing twice.
        k.forget(23, 5);
        k.forget(99, 1);
        assert_eq!(k.held.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert!(!k.holds(23));
        k.add(23);
        assert!(k.holds(23));
    }
}
