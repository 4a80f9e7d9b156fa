//! `kvfs mount`: the daemon's life (`umount`, `stat`, `sync` are in `running.rs`).
//!
//! `kvfs mount` without `--foreground` re-executes itself as a detached
//! daemon and waits on a pipe until the daemon says the mount is ready (exit
//! 0) or why it could not mount (exit 1, with the daemon's message). The
//! daemon blocks SIGTERM/SIGINT/SIGHUP in every thread and takes them in one
//! thread with sigwait: a signal flushes every dirty group, then unmounts.
//! However the session ends (signal, `kvfs umount`, plain `umount`), the
//! daemon flushes again before it exits, so nothing written is left behind.

use super::running::human;
use super::system::{
    SOURCE_PREFIX, dead_kvfs_mount, detach, memory_room, mount_entry, notify_systemd, on_path,
    raise_open_files_limit,
};
use anyhow::{Context, Result, bail};
use kvfs::cascade::{BackingConfig, Cascade, CascadeConfig, PolicyKind};
use kvfs::fs::{KvFs, MountOptions};
use kvfs::geometry::{DEFAULT_BLOCK_TOKENS, Dtype, GroupLayout};
use kvfs::tier::{RemoteConfig, TierKind};
use std::fs::File;
use std::io::{Read, Write};
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
    /// PEM file of the CA certificate(s) that rediss:// servers' certificates
    /// are checked against (a private CA) [default: the web PKI roots].
    #[arg(long, value_name = "FILE")]
    pub remote_ca: Option<PathBuf>,
    /// PEM client certificate for rediss:// servers that check clients
    /// (tls-auth-clients yes); with --remote-key.
    #[arg(long, value_name = "FILE", requires = "remote_key")]
    pub remote_cert: Option<PathBuf>,
    /// PEM private key of --remote-cert.
    #[arg(long, value_name = "FILE", requires = "remote_cert")]
    pub remote_key: Option<PathBuf>,
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
    /// FUSE worker threads, 1 to 1024 (each holds a /dev/fuse fd) [default: number of cores].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,
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
        let given = !self.remote.is_empty()
            || self.remote_replicas.is_some()
            || self.remote_allow_evict
            || self.remote_ca.is_some()
            || self.remote_cert.is_some();
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
            // Absolute, as the detached daemon reads them.
            ca: self.remote_ca.as_deref().map(absolute).transpose()?,
            client_cert: match (&self.remote_cert, &self.remote_key) {
                (Some(c), Some(k)) => Some((absolute(c)?, absolute(k)?)),
                _ => None,
            },
        }))
    }
}

fn absolute(p: &Path) -> Result<PathBuf> {
    std::path::absolute(p)
        .with_context(|| format!("{}: cannot make the path absolute", p.display()))
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

fn serve(args: &MountArgs, ready: &mut Option<File>) -> Result<()> {
    check_mountpoint(&args.mountpoint)?;
    raise_open_files_limit();
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
        threads: args.threads.map(usize::from).unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get().min(1024))
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
