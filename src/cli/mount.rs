//! `kvfs mount`, `umount`, `stat`, `sync`: the daemon's lifecycle.
//!
//! `kvfs mount` without `--foreground` re-executes itself as a detached
//! daemon and waits on a pipe until the daemon says the mount is ready (exit
//! 0) or why it could not mount (exit 1, with the daemon's message). The
//! daemon blocks SIGTERM/SIGINT/SIGHUP in every thread and takes them in one
//! thread with sigwait: a signal flushes every dirty group, then unmounts.
//! However the session ends (signal, `kvfs umount`, plain `umount`), the
//! daemon flushes again before it exits, so nothing written is left behind.

use anyhow::{Context, Result, bail};
use kvfs::cascade::{BackingConfig, Cascade, CascadeConfig, PolicyKind};
use kvfs::control::wire::MountLayout;
use kvfs::fs::{KvFs, MountOptions};
use kvfs::geometry::{DEFAULT_BLOCK_TOKENS, Dtype, GroupLayout};
use kvfs::tier::{RemoteConfig, TierKind};
use std::fs::File;
use std::io::{IsTerminal, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default T1 size: large enough to matter, small enough for any machine
/// (the memory is only touched as groups are written).
pub const DEFAULT_T1: &str = "1GiB";
/// Default model preset for a new backing store.
pub const DEFAULT_PRESET: &str = "llama-3.1-8b";
/// Default block count for a new store: 4096 blocks × 16 tokens = 64 Ki tokens.
pub const DEFAULT_BLOCKS: u64 = 4096;

/// Where a new store goes when `--backing` is not given: /var/lib/kvfs for
/// root, $XDG_DATA_HOME/kvfs (or ~/.local/share/kvfs) for anyone else.
pub fn default_backing() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/lib/kvfs");
    }
    if let Some(x) = std::env::var_os("XDG_DATA_HOME") {
        return PathBuf::from(x).join("kvfs");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into());
    PathBuf::from(home).join(".local/share/kvfs")
}

#[derive(clap::Args, Clone, Debug)]
pub struct MountArgs {
    /// Where to mount (an existing, empty directory).
    pub mountpoint: PathBuf,
    /// Backing store directory (made if absent) [default: /var/lib/kvfs as root, else ~/.local/share/kvfs].
    #[arg(long)]
    pub backing: Option<PathBuf>,
    /// T1 size: host RAM for the write-back cache (64MiB, 1GiB, 4G, bytes); more than the
    /// machine's (or its cgroup's) memory is refused, more than is available now warned of.
    #[arg(long, default_value = DEFAULT_T1)]
    pub t1: String,
    /// Backing tier: uring (io_uring, O_DIRECT), file (pread/pwrite), or
    /// redis (a Redis/Valkey server or cluster: needs --remote; the
    /// backing directory then keeps only the superblock and metadata).
    #[arg(long, default_value = "uring")]
    pub tier: TierKind,
    /// Queue depth: io_uring transfers in flight, or (redis) commands in
    /// flight per server node.
    #[arg(long, default_value_t = kvfs::tier::DEFAULT_QUEUE_DEPTH)]
    pub qd: u32,
    /// Redis/Valkey server(s) for --tier redis: redis://HOST:PORT,
    /// unix:///PATH or rediss://HOST:PORT (TLS). One standalone server, or
    /// one or more seed nodes of a Redis Cluster (detected). Comma-separated
    /// or repeated.
    #[arg(long, value_delimiter = ',', value_name = "URL")]
    pub remote: Vec<String>,
    /// Seconds a remote connection or round trip may take before it fails
    /// with EIO (a dead server never hangs a read).
    #[arg(long, default_value_t = 3.0, value_name = "SECONDS")]
    pub remote_timeout: f64,
    /// Replicas each sync waits for (WAIT) [default: every replica the
    /// node reports; 0 if none].
    #[arg(long, value_name = "N")]
    pub remote_replicas: Option<u32>,
    /// Mount even if the server's maxmemory-policy evicts keys; a group
    /// the server dropped then reads as EIO (counted), never as zeros.
    #[arg(long)]
    pub remote_allow_evict: bool,
    /// Replacement policy for T1: sieve or lru.
    #[arg(long, default_value = "sieve")]
    pub policy: PolicyKind,
    /// Model preset for a new store (llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, ...) [default: llama-3.1-8b when no geometry is given].
    #[arg(long)]
    pub preset: Option<String>,
    /// Layers (with the other geometry options, instead of a preset).
    #[arg(long)]
    pub layers: Option<u32>,
    /// KV blocks per layer [default: 4096].
    #[arg(long)]
    pub blocks: Option<u64>,
    /// KV heads.
    #[arg(long)]
    pub kv_heads: Option<u32>,
    /// Tokens per block [default: 16].
    #[arg(long)]
    pub block_tokens: Option<u32>,
    /// Head dimension.
    #[arg(long)]
    pub head_dim: Option<u32>,
    /// Element type: bf16, fp16, fp32 or fp8.
    #[arg(long)]
    pub dtype: Option<Dtype>,
    /// FUSE worker threads [default: number of cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Stay in the foreground (logs to stderr) instead of detaching.
    #[arg(long)]
    pub foreground: bool,
    /// Let other users reach the mount (FUSE allow_other).
    #[arg(long)]
    pub allow_other: bool,
    /// Install a group in T1 when a read misses it.
    #[arg(long)]
    pub promote_on_miss: bool,
    /// Internal: the pipe on which a detached daemon reports readiness.
    #[arg(long, hide = true)]
    pub ready_fd: Option<i32>,
}

impl MountArgs {
    /// The geometry the flags ask for; None when no geometry flag was given
    /// (an existing store's is used, a new one gets the default preset).
    fn requested_layout(&self) -> Result<Option<GroupLayout>> {
        let explicit = self.layers.is_some()
            || self.kv_heads.is_some()
            || self.head_dim.is_some()
            || self.dtype.is_some();
        let blocks = self.blocks.unwrap_or(DEFAULT_BLOCKS);
        let bt = self.block_tokens.unwrap_or(DEFAULT_BLOCK_TOKENS);
        if let Some(p) = &self.preset {
            if explicit {
                bail!("give either --preset or --layers/--kv-heads/--head-dim/--dtype, not both");
            }
            return Ok(Some(GroupLayout::preset(p, blocks, bt)?));
        }
        if explicit {
            let need = |v: Option<u32>, what: &str| {
                v.with_context(|| format!("--{what} is needed with the other geometry options"))
            };
            return Ok(Some(GroupLayout::new(
                need(self.layers, "layers")?,
                blocks,
                need(self.kv_heads, "kv-heads")?,
                bt,
                need(self.head_dim, "head-dim")?,
                self.dtype.unwrap_or(Dtype::Bf16),
            )?));
        }
        if self.blocks.is_some() || self.block_tokens.is_some() {
            return Ok(Some(GroupLayout::preset(DEFAULT_PRESET, blocks, bt)?));
        }
        Ok(None)
    }

    /// How to reach the remote tier; None for the local tiers.
    fn remote_config(&self) -> Result<Option<RemoteConfig>> {
        let given =
            !self.remote.is_empty() || self.remote_replicas.is_some() || self.remote_allow_evict;
        if self.tier != TierKind::Redis {
            if given {
                bail!("--remote and the --remote-* options are for --tier redis");
            }
            return Ok(None);
        }
        if self.remote.is_empty() {
            bail!(
                "--tier redis needs --remote URL (redis://HOST:PORT of a server, or seed nodes of a cluster)"
            );
        }
        if !(self.remote_timeout.is_finite() && self.remote_timeout > 0.0) {
            bail!(
                "--remote-timeout must be a positive number of seconds, got {}",
                self.remote_timeout
            );
        }
        if self.qd == 0 {
            bail!("--qd must be at least 1");
        }
        Ok(Some(RemoteConfig {
            urls: self.remote.clone(),
            qd: self.qd as usize,
            timeout: Duration::from_secs_f64(self.remote_timeout),
            replicas: self.remote_replicas,
            allow_evict: self.remote_allow_evict,
        }))
    }
}

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
fn unmount(mp: &Path, lazy: bool) -> std::io::Result<()> {
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
fn on_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|d| {
            std::fs::metadata(d.join(name))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// Lazily unmounts `mp`; whether it worked.
fn detach(mp: &Path) -> bool {
    unmount(mp, true).is_ok()
}

/// Whether `mp` holds a kvfs mount whose daemon is gone: the mount entry
/// is kvfs's and a read of `.kvfs/pid` finds no daemon (ENOTCONN). A stat
/// of the mount point alone is no proof of life: the kernel answers it
/// from its attribute cache for a while after the daemon died.
fn dead_kvfs_mount(mp: &Path) -> bool {
    let ours = mount_entry(mp).is_some_and(|(_, src)| src.starts_with(SOURCE_PREFIX));
    ours && std::fs::read(mp.join(".kvfs").join("pid"))
        .is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN))
}

fn check_mountpoint(mp: &Path) -> Result<()> {
    match std::fs::metadata(mp) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => bail!("mount point {} is not a directory", mp.display()),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            // A FUSE mount whose daemon died: detach it if it is kvfs's,
            // then look again. Anything else is not ours to remove.
            let ours = mount_entry(mp).is_some_and(|(_, src)| src.starts_with(SOURCE_PREFIX));
            if !ours || !detach(mp) {
                bail!(
                    "mount point {} holds a dead FUSE mount (its daemon is gone); run `umount -l {}` (or `fusermount3 -uz {}`) and mount again",
                    mp.display(),
                    mp.display(),
                    mp.display()
                );
            }
            eprintln!("kvfs: cleaned up a dead kvfs mount at {}", mp.display());
            return check_mountpoint(mp);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!(
                "mount point {} does not exist (mkdir -p {} first)",
                mp.display(),
                mp.display()
            )
        }
        Err(e) => bail!("mount point {}: {e}", mp.display()),
    }
    if dead_kvfs_mount(mp) && detach(mp) {
        eprintln!("kvfs: cleaned up a dead kvfs mount at {}", mp.display());
        return check_mountpoint(mp);
    }
    if let Some((t, src)) = mount_entry(mp) {
        bail!(
            "mount point {} is busy: {src} ({t}) is mounted there",
            mp.display()
        );
    }
    if !Path::new("/dev/fuse").exists() {
        bail!(
            "/dev/fuse does not exist: load the fuse module (modprobe fuse) or run where FUSE is available"
        );
    }
    // SAFETY: geteuid has no preconditions; access with a valid C string.
    let (root, dev_ok) = unsafe {
        (
            libc::geteuid() == 0,
            libc::access(c"/dev/fuse".as_ptr(), libc::R_OK | libc::W_OK) == 0,
        )
    };
    if !root && !dev_ok {
        bail!(
            "/dev/fuse is not open to this user (only root may open it here): mount as root, or let users open it (chmod 0666 /dev/fuse, the usual setting; fusermount3 then mounts for them)"
        );
    }
    if !root && !["fusermount3", "fusermount"].iter().any(|h| on_path(h)) {
        bail!(
            "mounting as a user needs the setuid helper fusermount3 (or fusermount): install fuse3, or mount as root"
        );
    }
    Ok(())
}

pub fn mount(mut args: MountArgs) -> Result<()> {
    // Absolute from here on: the mount's source name (`kvfs:BACKING`), the
    // messages and the daemon's log all name real places, whatever the
    // directory `kvfs mount` ran in.
    args.mountpoint = std::path::absolute(&args.mountpoint)
        .with_context(|| format!("mount point {}", args.mountpoint.display()))?;
    if let Some(b) = &args.backing {
        args.backing = Some(
            std::path::absolute(b).with_context(|| format!("backing directory {}", b.display()))?,
        );
    }
    if args.foreground || args.ready_fd.is_some() {
        // A daemon reports the outcome on its pipe; a foreground run just returns it.
        let ready = args.ready_fd.map(|fd| {
            // SAFETY: the fd was created for us by the parent `kvfs mount`
            // and is owned by this process alone.
            unsafe { File::from_raw_fd(fd) }
        });
        return run_daemon(args, ready);
    }
    check_mountpoint(&args.mountpoint)?;
    spawn_daemon(&args)
}

/// Re-executes this binary detached, and waits for it to say ready.
fn spawn_daemon(args: &MountArgs) -> Result<()> {
    let backing = args.backing.clone().unwrap_or_else(default_backing);
    std::fs::create_dir_all(&backing)
        .with_context(|| format!("cannot create the backing directory {}", backing.display()))?;
    let log_path = backing.join("kvfs.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("cannot open the log {}", log_path.display()))?;
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error()).context("cannot make a pipe");
    }
    // SAFETY: both fds were just created and are owned here.
    let (mut rd, wr) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    let wr_fd = wr.as_raw_fd();
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    argv.push("--ready-fd".into());
    argv.push(wr_fd.to_string().into());
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(&argv)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log);
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec only async-signal-safe calls: setsid
    // and fcntl to let the pipe's write end survive exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            let fl = libc::fcntl(wr_fd, libc::F_GETFD);
            libc::fcntl(wr_fd, libc::F_SETFD, fl & !libc::FD_CLOEXEC);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("cannot start the kvfs daemon")?;
    drop(wr);
    let mut msg = String::new();
    rd.read_to_string(&mut msg).ok();
    // The daemon's warnings (a remote server that persists nothing, say)
    // come first, a line each, so the operator sees them here.
    for w in msg.lines().filter_map(|l| l.strip_prefix("warning: ")) {
        eprintln!("kvfs: warning: {w}");
    }
    if msg.lines().any(|l| l == "ok") {
        println!(
            "kvfs mounted at {} (backing {}, log {})",
            args.mountpoint.display(),
            backing.display(),
            log_path.display()
        );
        return Ok(());
    }
    let _ = child.wait();
    if msg.is_empty() {
        bail!(
            "the kvfs daemon exited before the mount was ready; see {}",
            log_path.display()
        );
    }
    let err = msg.find("error: ").map_or(msg.as_str(), |i| &msg[i + 7..]);
    bail!("{}", err.trim_end())
}

fn block_signals() -> libc::sigset_t {
    // SAFETY: plain libc signal-set manipulation on a local set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGHUP);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn run_daemon(args: MountArgs, mut ready: Option<File>) -> Result<()> {
    let r = serve(&args, &mut ready);
    if let (Err(e), Some(f)) = (&r, ready.as_mut()) {
        let _ = write!(f, "error: {}", super::error_chain(e));
    }
    r
}

/// T1's allocation chunk (`KVFS_T1_CHUNK`, a size; default 256 MiB): the
/// first is allocated before the mount is ready, the rest in the
/// background. With a GPU each chunk is pinned, and while one is, GPU
/// restores an executor job resolves wait to be enqueued (`cuda::quietly`):
/// smaller chunks make each such wait shorter, and there are more of them.
fn t1_chunk() -> Result<u64> {
    let Ok(v) = std::env::var("KVFS_T1_CHUNK") else {
        return Ok(kvfs::cascade::DEFAULT_T1_CHUNK);
    };
    let b =
        kvfs::geometry::parse_size(&v).map_err(|e| anyhow::anyhow!("KVFS_T1_CHUNK={v}: {e}"))?;
    if b < 1 << 20 {
        anyhow::bail!("KVFS_T1_CHUNK={v}: give at least 1MiB (e.g. 64MiB; the default is 256MiB)");
    }
    Ok(b)
}

/// The memory this daemon may use: the machine's RAM (MemTotal), or its
/// cgroup's limit (cgroup v2 `memory.max`) where that is lower; and what
/// is available now (MemAvailable). None where /proc/meminfo is unreadable.
fn memory_room() -> Option<(u64, u64)> {
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

/// Refuses a T1 bigger than the memory the daemon may ever have (it would
/// be killed for memory with dirty groups in T1 once T1 filled); a warning
/// (returned) for one bigger than what is available now.
fn check_t1_fits(t1_bytes: u64) -> Result<Option<String>> {
    let Some((total, avail)) = memory_room() else {
        return Ok(None);
    };
    if t1_bytes > total {
        bail!(
            "--t1 {} is more than the memory this machine (or cgroup) has, {}: once T1 filled, the daemon would be killed for memory with dirty groups in it; give a smaller --t1",
            human(t1_bytes as f64),
            human(total as f64)
        );
    }
    Ok((t1_bytes > avail).then(|| {
        format!(
            "T1 ({}) is more than the memory available now ({}): as it fills, the machine may swap or kill processes for memory",
            human(t1_bytes as f64),
            human(avail as f64)
        )
    }))
}

/// Tells systemd how the service stands (`Type=notify` units: READY=1
/// once the mount is ready, STOPPING=1 when the final flush starts), where
/// it gave a socket (NOTIFY_SOCKET: a path, or `@name` in the abstract
/// namespace). Failures are logged, never fatal.
fn notify_systemd(state: &str) {
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

fn serve(args: &MountArgs, ready: &mut Option<File>) -> Result<()> {
    check_mountpoint(&args.mountpoint)?;
    // Before any thread starts, so every thread inherits the mask.
    let sigs = block_signals();
    let t1_bytes = kvfs::geometry::parse_size(&args.t1).map_err(anyhow::Error::msg)?;
    let t1_chunk_bytes = t1_chunk()?;
    let t1_note = check_t1_fits(t1_bytes)?;
    let backing = args.backing.clone().unwrap_or_else(default_backing);
    let requested = args.requested_layout()?;
    let fresh = !backing.join("superblock").exists();
    let layout = match (requested, fresh) {
        (Some(l), _) => Some(l),
        (None, true) => Some(GroupLayout::preset(
            DEFAULT_PRESET,
            DEFAULT_BLOCKS,
            DEFAULT_BLOCK_TOKENS,
        )?),
        (None, false) => None,
    };
    let t = Instant::now();
    let cascade = Arc::new(Cascade::open(
        &BackingConfig {
            dir: backing.clone(),
            layout,
            tier: args.tier,
            queue_depth: args.qd,
            remote: args.remote_config()?,
        },
        CascadeConfig {
            t1_bytes,
            policy: args.policy,
            promote_on_miss: args.promote_on_miss,
            t1_chunk_bytes,
            ..CascadeConfig::default()
        },
    )?);
    tracing::info!(
        "backing {} ({}), T1 {} slots, opened in {:?}: {}",
        backing.display(),
        cascade.tier_name(),
        cascade.t1_slots(),
        t.elapsed(),
        cascade.layout()
    );
    // SAFETY: getuid/getgid have no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let fs = KvFs::new(cascade.clone(), uid, gid);
    let opts = MountOptions {
        source: format!("{SOURCE_PREFIX}{}", backing.display()),
        threads: args.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
        }),
        allow_other: args.allow_other,
    };
    let mut session = fs
        .mount(&args.mountpoint, &opts)
        .with_context(|| format!("cannot mount at {}", args.mountpoint.display()))?;
    let mut unmount = session.unmounter();
    let c2 = cascade.clone();
    let mp = args.mountpoint.clone();
    std::thread::Builder::new()
        .name("kvfs-signals".into())
        .spawn(move || {
            let mut sig = 0;
            // SAFETY: sigwait on the set blocked in every thread.
            unsafe { libc::sigwait(&sigs, &mut sig) };
            tracing::info!("signal {sig}: flushing, then unmounting {}", mp.display());
            if let Err(e) = c2.sync_all() {
                tracing::error!(
                    "flush failed: {e}; unmounting anyway, dirty groups stay until exit"
                );
            }
            if let Err(e) = unmount() {
                tracing::error!("unmount of {} failed: {e}", mp.display());
            }
        })?;
    tracing::info!("mounted at {}", args.mountpoint.display());
    let notes: Vec<String> = t1_note
        .into_iter()
        .chain(cascade.notes().iter().cloned())
        .collect();
    for note in &notes {
        tracing::warn!("{note}");
    }
    if let Some(mut f) = ready.take() {
        for note in &notes {
            let _ = writeln!(f, "warning: {}", note.replace('\n', " "));
        }
        let _ = f.write_all(b"ok\n");
    }
    notify_systemd(&format!(
        "READY=1\nSTATUS=mounted at {}",
        args.mountpoint.display()
    ));
    let r = session.run();
    let t = Instant::now();
    let dirty = cascade.stats().dirty_bytes;
    notify_systemd(&format!(
        "STOPPING=1\nSTATUS=unmounted; flushing {dirty} dirty bytes"
    ));
    match cascade.sync_all() {
        Ok(()) => tracing::info!(
            "unmounted; flushed {dirty} dirty bytes in {:?}",
            t.elapsed()
        ),
        Err(e) => tracing::error!("unmounted, but the final flush failed: {e}"),
    }
    cascade.quiesce_tier();
    r.context("FUSE session failed")
}

/// What a command finds at a kvfs mount whose daemon died.
fn daemon_gone(mp: &Path) -> anyhow::Error {
    anyhow::anyhow!(
        "the kvfs daemon of {} is gone (killed or crashed); `kvfs umount {}` removes its dead mount, then mount again",
        mp.display(),
        mp.display()
    )
}

fn read_kvfs_file(mp: &Path, name: &str) -> Result<String> {
    let p = mp.join(".kvfs").join(name);
    std::fs::read_to_string(&p).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOTCONN) => daemon_gone(mp),
        _ => anyhow::Error::new(e).context(format!(
            "cannot read {} (is {} a kvfs mount?)",
            p.display(),
            mp.display()
        )),
    })
}

/// The FUSE source name kvfs mounts with: `kvfs:BACKING_DIR`.
pub const SOURCE_PREFIX: &str = "kvfs:";

fn check_kvfs(mp: &Path) -> Result<()> {
    match mount_entry(mp) {
        Some((t, src)) if t.starts_with("fuse") && src.starts_with(SOURCE_PREFIX) => Ok(()),
        Some((t, src)) => bail!("{} is not a kvfs mount ({src}, {t})", mp.display()),
        None => bail!("nothing is mounted at {}", mp.display()),
    }
}

fn dirty_bytes(mp: &Path) -> Option<u64> {
    let s = read_kvfs_file(mp, "stats").ok()?;
    kvfs::stats::find_sample(&s, kvfs::stats::DIRTY_BYTES).map(|v| v as u64)
}

fn human(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i < units.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", units[i])
}

/// Writes back every dirty group through `.kvfs/flush`, showing progress
/// when it takes over a second.
pub fn flush(mp: &Path) -> Result<()> {
    check_kvfs(mp)?;
    if dead_kvfs_mount(mp) {
        return Err(daemon_gone(mp));
    }
    let total = dirty_bytes(mp).unwrap_or(0);
    let p = mp.join(".kvfs/flush");
    let worker = std::thread::spawn(move || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).open(&p)?;
        f.write_all(b"1\n")
    });
    let start = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let mut last_log = Instant::now();
    while !worker.is_finished() {
        std::thread::sleep(Duration::from_millis(200));
        if start.elapsed() < Duration::from_secs(1) || worker.is_finished() {
            continue;
        }
        let left = dirty_bytes(mp).unwrap_or(0);
        let done = total.saturating_sub(left) as f64;
        let rate = done / start.elapsed().as_secs_f64();
        let eta = if rate > 0.0 {
            left as f64 / rate
        } else {
            f64::INFINITY
        };
        let frac = if total > 0 { done / total as f64 } else { 1.0 };
        if tty {
            let w = 30;
            let filled = (frac * w as f64) as usize;
            eprint!(
                "\rflushing [{}{}] {} / {}  {}/s  {:.0}s left   ",
                "#".repeat(filled),
                "-".repeat(w - filled.min(w)),
                human(done),
                human(total as f64),
                human(rate),
                eta
            );
        } else if last_log.elapsed() >= Duration::from_secs(5) {
            last_log = Instant::now();
            eprintln!(
                "kvfs: flushing {}: {} of {} written back, {}/s, {:.0}s left",
                mp.display(),
                human(done),
                human(total as f64),
                human(rate),
                eta
            );
        }
    }
    if tty && start.elapsed() >= Duration::from_secs(1) {
        eprintln!();
    }
    worker
        .join()
        .map_err(|_| anyhow::anyhow!("flush thread panicked"))?
        .with_context(|| {
            format!(
                "flushing {} failed; the mount stays up and nothing was dropped",
                mp.display()
            )
        })
}

pub fn umount(mp: &Path) -> Result<()> {
    check_kvfs(mp)?;
    if dead_kvfs_mount(mp) {
        // Its daemon died (killed, crashed): nothing is left to flush, and
        // the dead mount only fails every access until it goes.
        if let Err(e) = unmount(mp, true) {
            bail!(
                "the daemon of {} is gone, and its dead mount cannot be removed: {e}",
                mp.display()
            );
        }
        eprintln!(
            "kvfs: the daemon of {} had died; its dead mount is removed (groups it had not \
             written back are lost; what was synced is kept, see README Reliability)",
            mp.display()
        );
        return Ok(());
    }
    let pid: i32 = read_kvfs_file(mp, "pid")?
        .trim()
        .parse()
        .context("bad .kvfs/pid")?;
    flush(mp)?;
    if let Err(e) = unmount(mp, false) {
        if e.raw_os_error() == Some(libc::EBUSY) {
            bail!(
                "cannot unmount {}: it is busy (a process has a file or directory open there); everything is flushed",
                mp.display()
            );
        }
        return Err(e).with_context(|| format!("cannot unmount {}", mp.display()));
    }
    // Wait for the daemon's final flush and exit.
    let t = Instant::now();
    while process_alive(pid) {
        if t.elapsed() > Duration::from_secs(120) {
            bail!("unmounted, but the daemon (pid {pid}) has not exited after 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Whether `pid` still runs (a zombie waiting for its reaper has exited).
fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(s) => !matches!(
            s.rsplit_once(") ").map(|(_, r)| r.as_bytes()[0]),
            Some(b'Z' | b'X')
        ),
        Err(_) => false,
    }
}

/// `kvfs stat --watch`: a line of rates every `interval` seconds, from
/// the differences of `.kvfs/stats` between samples.
pub fn stat_watch(mp: &Path, interval: f64, count: u64) -> Result<()> {
    use kvfs::stats::*;
    check_kvfs(mp)?;
    if !(interval.is_finite() && interval >= 0.05) {
        anyhow::bail!("--interval {interval}: give a number of seconds of at least 0.05");
    }
    let sample = || -> Result<(std::time::Instant, String)> {
        Ok((std::time::Instant::now(), read_kvfs_file(mp, "stats")?))
    };
    let keys = [
        "kvfs_hits_total{tier=\"t1\"}",
        "kvfs_hits_total{tier=\"backing\"}",
        EMPTY_READS,
        "kvfs_control_bytes_total{op=\"restore\"}",
        "kvfs_control_bytes_total{op=\"store\"}",
        "kvfs_read_bytes_total{tier=\"t1\"}",
        "kvfs_write_bytes_total{tier=\"t1\"}",
        EVICTIONS,
        FLUSHES,
    ];
    let values = |s: &str| keys.map(|k| find_sample(s, k).unwrap_or(0.0));
    println!(
        "{:>8} {:>9} {:>9} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>9}",
        "time",
        "t1 hit/s",
        "miss/s",
        "t1 hit%",
        "restore",
        "store",
        "T1 read",
        "T1 write",
        "dirty",
        "evict/s",
        "wback/s"
    );
    let (mut t0, s0) = sample()?;
    let mut prev = values(&s0);
    let mut n = 0u64;
    while count == 0 || n < count {
        std::thread::sleep(std::time::Duration::from_secs_f64(interval));
        let (t, s) = sample()?;
        let now = values(&s);
        let secs = (t - t0).as_secs_f64().max(1e-9);
        let d: Vec<f64> = now
            .iter()
            .zip(&prev)
            .map(|(a, b)| (a - b).max(0.0) / secs)
            .collect();
        let reads = d[0] + d[1];
        let rate = |x: f64| format!("{}/s", human(x));
        println!(
            "{:>8} {:>9.0} {:>9.0} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8.0} {:>9.0}",
            clock(),
            d[0],
            d[1],
            if reads > 0.0 {
                format!("{:.1}%", 100.0 * d[0] / reads)
            } else {
                "-".into()
            },
            rate(d[3]),
            rate(d[4]),
            rate(d[5]),
            rate(d[6]),
            human(find_sample(&s, DIRTY_BYTES).unwrap_or(0.0)),
            d[7],
            d[8]
        );
        (t0, prev) = (t, now);
        n += 1;
    }
    Ok(())
}

/// The wall-clock time of day, UTC, as HH:MM:SS.
fn clock() -> String {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("{:02}:{:02}:{:02}", s / 3600 % 24, s / 60 % 60, s % 60)
}

pub fn stat(mp: &Path) -> Result<()> {
    check_kvfs(mp)?;
    let layout = MountLayout::from_json(&read_kvfs_file(mp, "layout")?)
        .context("cannot parse .kvfs/layout")?;
    let s = read_kvfs_file(mp, "stats")?;
    let get = |k: &str| kvfs::stats::find_sample(&s, k).unwrap_or(0.0);
    let (t1h, bh) = (
        get("kvfs_hits_total{tier=\"t1\"}"),
        get("kvfs_hits_total{tier=\"backing\"}"),
    );
    let reads = t1h + bh + get(kvfs::stats::EMPTY_READS);
    let ratio = |x: f64| {
        if reads > 0.0 {
            format!("{:.1}%", 100.0 * x / reads)
        } else {
            "-".into()
        }
    };
    let used = get(kvfs::stats::T1_SLOTS_USED);
    let total = get(kvfs::stats::T1_SLOTS_TOTAL);
    println!("kvfs at {}", mp.display());
    println!(
        "  geometry   {} layers × {} blocks × {} kv heads × {} tokens × head_dim {} × {}",
        layout.layers,
        layout.blocks,
        layout.kv_heads,
        layout.block_tokens,
        layout.head_dim,
        layout.dtype
    );
    println!(
        "  groups     {} of {} bytes",
        layout.groups, layout.group_bytes
    );
    // T1 arrives in the background after its first chunk (pinned, with
    // a GPU): said while it still does.
    let ready = kvfs::stats::find_sample(&s, kvfs::stats::T1_SLOTS_READY).unwrap_or(total);
    println!(
        "  T1         {} ({} slots), {} used ({:.1}%){}",
        human(layout.t1_bytes as f64),
        total,
        used,
        if total > 0.0 {
            100.0 * used / total
        } else {
            0.0
        },
        if ready < total {
            format!(", still allocating: {ready} slots ready")
        } else {
            String::new()
        }
    );
    println!("  dirty      {}", human(get(kvfs::stats::DIRTY_BYTES)));
    println!("  backing    {} ({})", layout.tier, layout.policy);
    if let Some(remote) = &layout.remote {
        use kvfs::stats::*;
        let up = get(&format!("{REMOTE_NODES}{{state=\"connected\"}}"));
        let down = get(&format!("{REMOTE_NODES}{{state=\"down\"}}"));
        let trips = get(&format!("{REMOTE_ROUND_TRIP}_count{{tier=\"redis\"}}"));
        let secs = get(&format!("{REMOTE_ROUND_TRIP}_sum{{tier=\"redis\"}}"));
        let nodes = if up == 1.0 { "node" } else { "nodes" };
        println!("  remote     {remote}: {up} {nodes} connected, {down} down");
        println!(
            "             errors {}, timeouts {}, lost {}, corrupt {}, OOM {}; round trips {trips}{}",
            get(REMOTE_ERRORS),
            get(REMOTE_TIMEOUTS),
            get(REMOTE_LOST),
            get(REMOTE_CORRUPT),
            get(REMOTE_OOM),
            if trips > 0.0 {
                format!(", mean {:.0} µs", 1e6 * secs / trips)
            } else {
                String::new()
            }
        );
    }
    println!(
        "  reads      {reads}: T1 {} ({}), backing {} ({}), never written {}",
        t1h,
        ratio(t1h),
        bh,
        ratio(bh),
        get(kvfs::stats::EMPTY_READS)
    );
    println!(
        "  evictions  {}, write-backs {}, checksum failures {}",
        get(kvfs::stats::EVICTIONS),
        get(kvfs::stats::FLUSHES),
        get(kvfs::stats::CHECKSUM_FAILURES)
    );
    Ok(())
}
