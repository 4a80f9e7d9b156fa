//! Mount plumbing: fuser's session types stay behind `Mounted` and
//! `BackgroundMount`, so callers never name fuser. `KvFs::mount` is also
//! where the control file's change hook is wired to the kernel notifier:
//! a STORE through the control file bypasses the page cache, so the pages
//! the kernel holds for that group must be dropped, or FOPEN_KEEP_CACHE
//! would serve stale bytes.

use super::{Inodes, KvFs, Node};
use fuser::{Filesystem, INodeNo};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How to mount kvfs.
pub struct MountOptions {
    /// The source shown in /proc/mounts.
    pub source: String,
    pub threads: usize,
    pub allow_other: bool,
}

/// A mounted kvfs, not yet served (and its count of open handles).
pub struct Mounted(fuser::Session<KvFs>, Arc<AtomicU64>);

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
        let open = self.1;
        self.0.spawn().map(|s| BackgroundMount(s, Some(open)))
    }
}

/// A filesystem mounted by this process, served by background threads;
/// dropping it unmounts.
pub struct BackgroundMount(fuser::BackgroundSession, Option<Arc<AtomicU64>>);

/// How long `BackgroundMount::unmount` waits for releases in flight.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

impl BackgroundMount {
    /// Unmounts and waits for the serving threads. A kvfs mount first
    /// waits (up to RELEASE_WAIT) for the releases of files just closed:
    /// the kernel sends those without waiting for their replies, and one
    /// answered after the unmount fails ("Failed to send FUSE reply").
    pub fn unmount(self) -> std::io::Result<()> {
        if let Some(open) = &self.1 {
            let t = Instant::now();
            while open.load(Ordering::Acquire) > 0 && t.elapsed() < RELEASE_WAIT {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
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
    fuser::spawn_mount(fs, mountpoint, &config).map(|s| BackgroundMount(s, None))
}

impl KvFs {
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
        let open = self.open.clone();
        let session = fuser::Session::new(self, mountpoint, &config)?;
        let notifier = session.notifier();
        control.set_change_hook(Box::new(move |g| {
            let ino = inodes.ino(Node::Group(g));
            if known.holds(ino) {
                let _ = notifier.inval_inode(INodeNo(ino), 0, 0);
            }
        }));
        Ok(Mounted(session, open))
    }
}
