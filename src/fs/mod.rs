//! The FUSE face of kvfs: the only place fuser's types appear.
//!
//! A thin adapter over the cascade (mountpoint-s3's shape): every group is a
//! regular file `L{l}/B{b}/H{h}/{K|V}` of exactly `group_bytes` bytes; the
//! directory tree is computed from the layout (inode numbers are arithmetic,
//! see `inode.rs`, and readdir pages through entries by offset), so memory
//! and mount time do not grow with the geometry. `.kvfs/` holds `stats`
//! (Prometheus text), `layout` (JSON), `resident/` (a symlink per T1-resident
//! group), `flush` (write anything: every dirty group is written back and
//! made durable before the write returns) and `pid`. Errors become errnos
//! in one exhaustive mapping, `errno()`. Group files are opened with
//! FOPEN_KEEP_CACHE: every change to a group passes through this process
//! (kernel writes keep their page cache coherent themselves), so repeat
//! reads of an unchanged group can be served from the kernel's cache.

mod bare;
mod inode;

pub use bare::BareFs;
pub use inode::{Inodes, KVFS_FILES, Node};

use crate::cascade::{Cascade, CascadeError, Residence};
use crate::control::{Control, Session, wire};
use crate::geometry::{GroupIndex, GroupKey, Kind, parse_group_name};
use crate::stats::{self, Exposition, Histogram};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen,
    ReplyStatfs, ReplyWrite, ReplyXattr, Request, WriteFlags,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

thread_local! {
    /// Each FUSE thread's read buffer, reused so a read allocates nothing.
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Names never change meaning, so the kernel may cache lookups for long.
const ENTRY_TTL: Duration = Duration::from_secs(3600);
/// Attributes (blocks, for `du`) change as groups are written; short.
const ATTR_TTL: Duration = Duration::from_secs(1);

const XATTR_TIER: &str = "user.kvfs.tier";
const XATTR_DIRTY: &str = "user.kvfs.dirty";
const XATTR_CRC: &str = "user.kvfs.crc32c";

/// How to mount kvfs.
pub struct MountOptions {
    /// The source shown in /proc/mounts.
    pub source: String,
    pub threads: usize,
    pub allow_other: bool,
}

/// A mounted kvfs, not yet served.
pub struct Mounted(fuser::Session<KvFs>);

impl Mounted {
    /// A handle that unmounts from another thread (signal handling).
    pub fn unmounter(&mut self) -> impl FnMut() -> std::io::Result<()> + Send + 'static {
        let mut u = self.0.unmount_callable();
        move || u.unmount()
    }

    /// Serves requests until the filesystem is unmounted.
    pub fn run(self) -> std::io::Result<()> {
        self.0.run()
    }

    /// Serves requests from background threads (benches and tests).
    pub fn spawn(self) -> std::io::Result<BackgroundMount> {
        self.0.spawn().map(BackgroundMount)
    }
}

/// A filesystem mounted by this process, served by background threads;
/// dropping it unmounts.
pub struct BackgroundMount(fuser::BackgroundSession);

impl BackgroundMount {
    /// Unmounts and waits for the serving threads.
    pub fn unmount(self) -> std::io::Result<()> {
        self.0.umount_and_join()
    }
}

/// Mounts `fs` at `mountpoint` with `threads` serving threads (each with its
/// own /dev/fuse fd), in the background.
pub fn mount_background<F: Filesystem>(
    fs: F,
    mountpoint: &std::path::Path,
    threads: usize,
) -> std::io::Result<BackgroundMount> {
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName("kvfs-bench".into()),
        fuser::MountOption::NoAtime,
    ];
    config.n_threads = Some(threads.max(1));
    config.clone_fd = true;
    fuser::spawn_mount(fs, mountpoint, &config).map(BackgroundMount)
}

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
struct KnownInodes([Mutex<HashMap<u64, u64>>; 16]);

impl KnownInodes {
    fn shard(&self, ino: u64) -> &Mutex<HashMap<u64, u64>> {
        &self.0[(ino % 16) as usize]
    }

    /// A lookup of `ino` is about to be answered.
    fn add(&self, ino: u64) {
        *self.shard(ino).lock().entry(ino).or_insert(0) += 1;
    }

    /// The kernel dropped `n` lookups of `ino`.
    fn forget(&self, ino: u64, n: u64) {
        let mut m = self.shard(ino).lock();
        if let Some(c) = m.get_mut(&ino) {
            *c = c.saturating_sub(n);
            if *c == 0 {
                m.remove(&ino);
            }
        }
    }

    fn holds(&self, ino: u64) -> bool {
        self.shard(ino).lock().contains_key(&ino)
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
            next_fh: AtomicU64::new(1),
            lat: Latencies::default(),
            started: Instant::now(),
            known: Arc::default(),
        }
    }

    pub fn cascade(&self) -> &Arc<Cascade> {
        &self.cascade
    }

    /// Mounts this filesystem at `mountpoint`; the returned session is
    /// served by `run`. Groups changed through the control file have their
    /// kernel-cached pages dropped through the session's notifier.
    pub fn mount(
        mut self,
        mountpoint: &std::path::Path,
        opts: &MountOptions,
    ) -> std::io::Result<Mounted> {
        if opts.allow_other {
            self.control_mode = 0o666;
        }
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            fuser::MountOption::FSName(opts.source.clone()),
            fuser::MountOption::Subtype("kvfs".into()),
            fuser::MountOption::DefaultPermissions,
            fuser::MountOption::NoAtime,
            fuser::MountOption::RW,
        ];
        config.acl = if opts.allow_other {
            fuser::SessionACL::All
        } else {
            fuser::SessionACL::Owner
        };
        config.n_threads = Some(opts.threads.max(1));
        config.clone_fd = true;
        let control = self.control.clone();
        let inodes = Inodes::new(*self.cascade.layout());
        let known = self.known.clone();
        let session = fuser::Session::new(self, mountpoint, &config)?;
        let notifier = session.notifier();
        control.set_change_hook(Box::new(move |g| {
            let ino = inodes.ino(Node::Group(g));
            if known.holds(ino) {
                let _ = notifier.inval_inode(INodeNo(ino), 0, 0);
            }
        }));
        Ok(Mounted(session))
    }

    fn attr(&self, node: Node) -> FileAttr {
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

    fn key(&self, g: GroupIndex) -> GroupKey {
        self.cascade
            .layout()
            .key(g)
            .expect("inode ranges only hold valid groups")
    }

    fn resident_name(&self, g: GroupIndex) -> String {
        let k = self.key(g);
        format!("L{}.B{}.H{}.{}", k.layer, k.block, k.head, k.kind.letter())
    }

    fn resident_target(&self, g: GroupIndex) -> String {
        format!("../../{}", self.key(g))
    }

    /// Looks up `name` in directory `parent`.
    fn child(&self, parent: Node, name: &str) -> Option<Node> {
        use crate::geometry::name_component as comp;
        let l = self.cascade.layout();
        let n = match parent {
            Node::Root if name == ".kvfs" => Node::KvfsDir,
            Node::Root => {
                let x = comp(name, 'L')?;
                (x < l.layers as u64).then_some(Node::Layer(x as u32))?
            }
            Node::Layer(x) => {
                let b = comp(name, 'B')?;
                (b < l.blocks).then_some(Node::Block(x, b))?
            }
            Node::Block(x, b) => {
                let h = comp(name, 'H')?;
                (h < l.kv_heads as u64).then_some(Node::Head(x, b, h as u32))?
            }
            Node::Head(x, b, h) => {
                let kind = match name {
                    "K" => Kind::K,
                    "V" => Kind::V,
                    _ => return None,
                };
                Node::Group(l.index(GroupKey::new(x, b, h, kind)).ok()?)
            }
            Node::KvfsDir => {
                let ino = KVFS_FILES.iter().find(|(n, _)| *n == name)?.1;
                self.inodes.node(ino)?
            }
            Node::ResidentDir => {
                let path = name.replace('.', "/");
                let g = l.index(parse_group_name(&path).ok()?).ok()?;
                (self.cascade.query(g).ok()?.residence == Residence::T1)
                    .then_some(Node::Resident(g))?
            }
            _ => return None,
        };
        Some(n)
    }

    /// Entry number `i` of directory `dir` (after `.` and `..`).
    fn entry(&self, dir: Node, i: u64, resident: Option<&[GroupIndex]>) -> Option<(Node, String)> {
        let l = self.cascade.layout();
        Some(match dir {
            Node::Root if i == 0 => (Node::KvfsDir, ".kvfs".into()),
            Node::Root => {
                let x = i - 1;
                (x < l.layers as u64).then(|| (Node::Layer(x as u32), format!("L{x}")))?
            }
            Node::Layer(x) => (i < l.blocks).then(|| (Node::Block(x, i), format!("B{i}")))?,
            Node::Block(x, b) => {
                (i < l.kv_heads as u64).then(|| (Node::Head(x, b, i as u32), format!("H{i}")))?
            }
            Node::Head(x, b, h) => {
                let kind = [Kind::K, Kind::V].get(i as usize)?;
                let g = l.index(GroupKey::new(x, b, h, *kind)).ok()?;
                (Node::Group(g), kind.letter().to_string())
            }
            Node::KvfsDir => {
                let (name, ino) = KVFS_FILES.get(i as usize)?;
                (self.inodes.node(*ino)?, name.to_string())
            }
            Node::ResidentDir => {
                let g = *resident?.get(i as usize)?;
                (Node::Resident(g), self.resident_name(g))
            }
            _ => return None,
        })
    }

    fn parent_of(&self, dir: Node) -> Node {
        match dir {
            Node::Layer(_) | Node::KvfsDir | Node::Root => Node::Root,
            Node::Block(x, _) => Node::Layer(x),
            Node::Head(x, b, _) => Node::Block(x, b),
            _ => Node::KvfsDir,
        }
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
        FileHandle(fh)
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
        e.single(
            "kvfs_uptime_seconds",
            "gauge",
            "Seconds since the mount.",
            self.started.elapsed().as_secs(),
        );
        e.finish()
    }

    fn render_layout(&self) -> String {
        format!("{}\n", self.cascade.describe_json())
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
            Some(Node::Stats) => {
                let fh = self.new_handle(Handle::Text(self.render_stats().into_bytes()));
                reply.opened(fh, FopenFlags::FOPEN_DIRECT_IO)
            }
            Some(Node::Layout) => {
                let fh = self.new_handle(Handle::Text(self.render_layout().into_bytes()));
                reply.opened(fh, FopenFlags::FOPEN_DIRECT_IO)
            }
            Some(Node::Pid) => {
                let fh = self.new_handle(Handle::Text(
                    format!("{}\n", std::process::id()).into_bytes(),
                ));
                reply.opened(fh, FopenFlags::FOPEN_DIRECT_IO)
            }
            Some(Node::Flush) => {
                reply.opened(self.new_handle(Handle::Group), FopenFlags::FOPEN_DIRECT_IO)
            }
            Some(Node::Control) => {
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
            Some(_) => reply.error(Errno::EISDIR),
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
            Some(Node::Group(g)) => {
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
            Some(Node::Control) => match self.session(fh) {
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
            Some(_) => {
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
            Some(Node::Group(g)) => {
                match self.cascade.write(g, offset, data) {
                    Ok(()) => reply.written(data.len() as u32),
                    Err(e) => reply.error(errno(&e)),
                }
                self.lat.write.observe(t.elapsed());
            }
            Some(Node::Control) => match self.session(fh) {
                Some(s) => reply.written(s.write(data) as u32),
                None => reply.error(Errno::EBADF),
            },
            Some(Node::Flush) => match self.cascade.sync_all() {
                Ok(()) => reply.written(data.len() as u32),
                Err(e) => {
                    tracing::error!("flush requested through .kvfs/flush failed: {e}");
                    reply.error(errno(&e))
                }
            },
            Some(_) => reply.error(Errno::EBADF),
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
        if let Some(Handle::Control(s)) = self.handles.lock().remove(&fh.0) {
            s.close();
        }
        reply.ok();
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
        mut reply: ReplyDirectory,
    ) {
        let Some(dir) = self.inodes.node(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let handles = self.handles.lock();
        let resident = match handles.get(&fh.0) {
            Some(Handle::Resident(v)) => Some(v.as_slice()),
            _ => None,
        };
        // Offsets: 0 is ".", 1 is "..", 2 + i is entry i; the offset given
        // with each entry is the one to resume after it.
        let mut off = offset;
        loop {
            let (node, name) = match off {
                0 => (dir, ".".to_string()),
                1 => (self.parent_of(dir), "..".to_string()),
                _ => match self.entry(dir, off - 2, resident) {
                    Some(e) => e,
                    None => break,
                },
            };
            let kind = self.attr(node).kind;
            if reply.add(INodeNo(self.inodes.ino(node)), off + 1, kind, &name) {
                break;
            }
            off += 1;
        }
        drop(handles);
        reply.ok();
    }

    fn releasedir(
        &self,
        _r: &Request,
        _i: INodeNo,
        fh: FileHandle,
        _f: OpenFlags,
        reply: ReplyEmpty,
    ) {
        if let Some(Handle::Control(s)) = self.handles.lock().remove(&fh.0) {
            s.close();
        }
        reply.ok();
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
        let l = self.cascade.layout();
        let blocks = l.group_count() * l.group_bytes() / 4096;
        reply.statfs(blocks, 0, 0, l.group_count(), 0, 4096, 255, 4096);
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let Some(Node::Group(g)) = self.inodes.node(ino.0) else {
            return reply.error(Errno::NO_XATTR);
        };
        match self.xattr(g, &name.to_string_lossy()) {
            Ok(Some(v)) => reply_xattr(reply, size, v.as_bytes()),
            Ok(None) => reply.error(Errno::NO_XATTR),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
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

    fn access(&self, _req: &Request, ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        match self.inodes.node(ino.0) {
            Some(_) => reply.ok(),
            None => reply.error(Errno::ENOENT),
        }
    }
}
