//! What kvfs asks of the system around a mount: the mount table, unmounting
//! (umount(2), or the fusermount3 helper for a user's own mount), dead
//! mounts, PATH, the memory a T1 may take, systemd's notify socket, and
//! whether a daemon still runs.

use std::path::Path;

/// The FUSE source name kvfs mounts with: `kvfs:BACKING_DIR`.
pub const SOURCE_PREFIX: &str = "kvfs:";

/// What /proc/self/mountinfo says is mounted at `path`, if anything:
/// (filesystem type, source). The last entry wins, as the kernel stacks mounts.
pub fn mount_entry(path: &Path) -> Option<(String, String)> {
    let canon = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        let sep = f.iter().position(|x| *x == "-")?;
        let mp = f.get(4)?.replace("\\040", " ");
        (Path::new(&mp) == canon)
            .then(|| Some((f.get(sep + 1)?.to_string(), f.get(sep + 2)?.to_string())))?
    })
}

/// Unmounts `mp` (lazily: MNT_DETACH). Where umount(2) is not allowed
/// (a user's own FUSE mount, not root), through the setuid helper that
/// mounted it, `fusermount3 -u` (or `fusermount`); a busy mount is EBUSY
/// either way.
pub(super) fn unmount(mp: &Path, lazy: bool) -> std::io::Result<()> {
    let c = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes())?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: umount2 with a valid C string.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EPERM) {
        return Err(e);
    }
    let mut last = e;
    for helper in ["fusermount3", "fusermount"] {
        let mut cmd = std::process::Command::new(helper);
        cmd.arg(if lazy { "-uz" } else { "-u" }).arg(mp);
        match cmd.output() {
            Ok(out) if out.status.success() => return Ok(()),
            Ok(out) => {
                let why = String::from_utf8_lossy(&out.stderr).trim().to_string();
                if why.contains("busy") {
                    return Err(std::io::Error::from_raw_os_error(libc::EBUSY));
                }
                return Err(std::io::Error::other(format!("{helper}: {why}")));
            }
            Err(e) => last = e,
        }
    }
    Err(std::io::Error::new(
        last.kind(),
        format!("umount(2) is for root, and no fusermount3 or fusermount helper ran: {last}"),
    ))
}

/// Whether an executable `name` is in a directory of PATH.
pub(super) fn on_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|d| {
            std::fs::metadata(d.join(name))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// Lazily unmounts `mp`; whether it worked.
pub(super) fn detach(mp: &Path) -> bool {
    unmount(mp, true).is_ok()
}

/// Whether `mp` holds a kvfs mount whose daemon is gone: the mount entry
/// is kvfs's and a read of `.kvfs/pid` finds no daemon (ENOTCONN). A stat
/// of the mount point alone is no proof of life: the kernel answers it
/// from its attribute cache for a while after the daemon died.
pub(super) fn dead_kvfs_mount(mp: &Path) -> bool {
    let ours = mount_entry(mp).is_some_and(|(_, src)| src.starts_with(SOURCE_PREFIX));
    ours && std::fs::read(mp.join(".kvfs").join("pid"))
        .is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN))
}

/// The memory this daemon may use: the machine's RAM (MemTotal), or its
/// cgroup's limit (cgroup v2 `memory.max`) where that is lower; and what
/// is available now (MemAvailable). None where /proc/meminfo is unreadable.
pub(super) fn memory_room() -> Option<(u64, u64)> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = info.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    };
    let mut total = field("MemTotal:")?;
    let mut avail = field("MemAvailable:").unwrap_or(total);
    // cgroup v2 (`0::PATH`: memory.max, memory.current) or v1 (`N:memory:PATH`:
    // memory.limit_in_bytes, memory.usage_in_bytes); "max" or a huge v1
    // number is no limit.
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), Some(c)) => (a, b, c.trim_start_matches('/')),
            _ => continue,
        };
        let (dir, max, current) = match controllers {
            "" => (
                Path::new("/sys/fs/cgroup").join(path),
                "memory.max",
                "memory.current",
            ),
            c if c.split(',').any(|c| c == "memory") => (
                Path::new("/sys/fs/cgroup/memory").join(path),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            ),
            _ => continue,
        };
        let read = |f: &str| -> Option<u64> {
            std::fs::read_to_string(dir.join(f))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        if let Some(max) = read(max) {
            total = total.min(max);
            avail = avail.min(max.saturating_sub(read(current).unwrap_or(0)));
        }
    }
    Some((total, avail))
}

/// Tells systemd how the service stands (`Type=notify` units: READY=1
/// once the mount is ready, STOPPING=1 when the final flush starts), where
/// it gave a socket (NOTIFY_SOCKET: a path, or `@name` in the abstract
/// namespace). Failures are logged, never fatal.
pub(super) fn notify_systemd(state: &str) {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let bytes = socket.as_encoded_bytes();
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name),
        None => SocketAddr::from_pathname(Path::new(&socket)),
    };
    let sent = addr.and_then(|a| UnixDatagram::unbound()?.send_to_addr(state.as_bytes(), &a));
    if let Err(e) = sent {
        tracing::warn!("cannot notify systemd at {}: {e}", socket.to_string_lossy());
    }
}

/// Whether `pid` still runs (a zombie waiting for its reaper has exited).
pub(super) fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(s) => !matches!(
            s.rsplit_once(") ").map(|(_, r)| r.as_bytes()[0]),
            Some(b'Z' | b'X')
        ),
        Err(_) => false,
    }
}

/// Raises this process's soft limit on open files to its hard limit: the
/// daemon holds a /dev/fuse fd per FUSE thread and the files of every
/// control session and region, and a soft limit of 1024 (a common default)
/// would fail a mount with many threads after it was reported ready.
pub(super) fn raise_open_files_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit on a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}
