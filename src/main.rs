//! The `kvfs` command line.

mod cli;

use anyhow::Result;
use clap::{Parser, Subcommand};
use kvfs::bench::backing::BackingBench;
use kvfs::tier::TierKind;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "kvfs",
    version,
    about = "KV-cache storage for LLM inference: a pinned-RAM write-back cache (T1) over SSD",
    long_about = "kvfs keeps the KV cache an inference engine spills out of GPU memory: hot groups \
                  in T1, a bounded write-back cache in host RAM, the rest in a backing store on local \
                  SSD (io_uring, O_DIRECT) or in other machines' RAM through a Redis/Valkey server \
                  or cluster (mount --tier redis). Engines restore and store groups in batches \
                  through the mount's control file (.kvfs/control). Every group is checksummed; a \
                  group whose bytes fail their checksum is never served."
)]
struct Cli {
    /// Log filter (error, warn, info, debug, trace, or a tracing directive); RUST_LOG also works.
    #[arg(long, global = true, default_value = "info")]
    log: String,
    #[command(subcommand)]
    cmd: Cmd,
}

/// The daemon's environment variables, for `kvfs mount --help` (a test
/// checks every one the sources read is here).
const MOUNT_ENV: &str = "\
Environment (read by the daemon when it starts; each default is the measured choice, see README):
  RUST_LOG                              log filter, as --log
  NOTIFY_SOCKET                         set by systemd (Type=notify): READY=1 once mounted, STOPPING=1 at the final flush
  KVFS_GPU_COPY=auto|engines|kernel     restores of T1-resident groups: copy engines where slots join into runs, else the gather kernel (auto); or force one
  KVFS_GPU_ROWS=pieces                  strided GPU entries as one copy a piece, not the rows kernel
  KVFS_GPU_SORT=off|auto|on             GPU copies in the order of their host addresses (auto: copies under 16 KiB); default off
  KVFS_RESTORE_PART_GROUPS=auto|on|N|off  GPU restores pinned on admission launched in parts (auto: one ticket at a time; over 2048 groups, only with no other ticket on the fd)
  KVFS_RESTORE_PART_FIRST=N|0           those parts growing from a first of N groups (default 64), each next twice the last; 0: equal parts
  KVFS_RESTORE_PART_STREAMS=1|2         those parts all on the client's lane (default) or alternating over two streams
  KVFS_RESTORE_LATER_LANE=auto|on|off   big GPU restores on the client's ordered lane (auto: those sent to the executor by size alone)
  KVFS_RESTORE_LATER_PARTS=auto|off     big GPU restores on an idle lane in up to three parts; default off (no faster where measured yet)
  KVFS_STORE_PART_GROUPS=N|off          GPU store chunks launched in parts of N groups (default 1024)
  KVFS_T1_PAGES=huge                    T1 on transparent huge pages registered with the CUDA driver
  KVFS_T1_CHUNK=SIZE                    T1 allocated (pinned, with a GPU) in chunks of this size, the first before the mount is ready (default 256MiB)
  KVFS_T1_NUMA=off                      T1 not placed on the GPU's NUMA node";

#[derive(Subcommand)]
enum Cmd {
    /// Mount kvfs: every KV group appears as a file L{layer}/B{block}/H{head}/{K|V}.
    ///
    /// With no options it works on a fresh machine: the backing store goes to
    /// /var/lib/kvfs (root) or ~/.local/share/kvfs, T1 is 1 GiB of RAM, and a new
    /// store gets the llama-3.1-8b geometry with 4096 blocks of 16 tokens. An
    /// existing store keeps its own geometry; geometry options that disagree
    /// with it are refused. Returns once the mount is ready (or failed).
    #[command(after_long_help = MOUNT_ENV)]
    Mount(cli::mount::MountArgs),
    /// Flush every dirty group to the backing, then unmount; returns when both are done.
    Umount { mountpoint: PathBuf },
    /// Geometry, T1 use, dirty bytes and hit ratios of a mount; with
    /// --watch, a live line a second (like iostat): reads by tier and T1
    /// hit ratio, restore and store rates through the control file, T1
    /// read and write rates, dirty bytes, evictions and write-backs a second.
    Stat {
        mountpoint: PathBuf,
        /// Print a line of rates every --interval seconds until interrupted
        /// (or --count lines).
        #[arg(long)]
        watch: bool,
        /// Seconds between --watch lines.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Stop --watch after this many lines (0: never).
        #[arg(long, default_value_t = 0)]
        count: u64,
    },
    /// Write back every dirty group and make it durable (the kernel does not
    /// pass sync(2)/syncfs(2) on to FUSE filesystems; this does the same job).
    Sync { mountpoint: PathBuf },
    /// Talk to a mount's control file from the shell.
    Ctl {
        mountpoint: PathBuf,
        #[command(subcommand)]
        what: CtlCmd,
    },
    /// Benchmarks that print their figure next to a baseline from the same run.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
}

#[derive(Subcommand)]
enum CtlCmd {
    /// Protocol version and geometry.
    Hello,
    /// Where each group is (t1, backing, empty), whether it is dirty, and the crc32c of its bytes as last written back ("-" if never).
    Query {
        /// Group names, e.g. L3/B17/H0/K.
        #[arg(required = true)]
        groups: Vec<String>,
    },
    /// Bring groups into T1 and wait until they are there.
    Prefetch {
        /// Group names, e.g. L3/B17/H0/K.
        #[arg(required = true)]
        groups: Vec<String>,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Batched restores through the control file into a /dev/shm region
    /// (1, 64, 1024 entries; 4 KiB and 16 KiB groups; T1 hits and misses),
    /// next to a memcpy of the same bytes. Needs root (or FUSE mount rights).
    Restore {
        /// Scratch directory for the backing store and mount point.
        #[arg(long, default_value = "/var/tmp")]
        dir: PathBuf,
        /// Directory for the region file (tmpfs).
        #[arg(long, default_value = "/dev/shm")]
        shm: PathBuf,
        /// Seconds for each measurement.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// FUSE serving threads [default: number of cores].
        #[arg(long)]
        threads: Option<usize>,
    },
    /// 4 KiB random reads of T1-resident group files through a kvfs mount,
    /// next to tmpfs and a bare fuser filesystem holding the same bytes, cold
    /// (O_DIRECT) and repeated (cached), with 1 and 2 readers. Needs root (or
    /// FUSE mount rights) and /dev/fuse.
    Fuse {
        /// Scratch directory for the backing store and the mount points.
        #[arg(long, default_value = "/var/tmp")]
        dir: PathBuf,
        /// A tmpfs directory for the baseline files.
        #[arg(long, default_value = "/dev/shm")]
        tmpfs: PathBuf,
        /// Group files to read at random (all T1-resident).
        #[arg(long, default_value_t = 1024)]
        groups: u64,
        /// Seconds for each measurement.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// FUSE serving threads [default: number of cores].
        #[arg(long)]
        threads: Option<usize>,
        /// Rounds, alternating the order of the three; means are printed.
        #[arg(long, default_value_t = 2)]
        rounds: u32,
    },
    /// Crash cycles: writers write and fsync groups through a real mount, the
    /// daemon is killed with SIGKILL at a random moment, the mount is made
    /// again over the dead one and every group is checked: fsync'd groups
    /// hold their last fsync'd bytes or later ones, and no group holds bytes
    /// never written to it. Exits 1 on any violation. Needs root and /dev/fuse.
    Crash {
        /// Scratch directory for the backing store and the mount point.
        #[arg(long, default_value = "/var/tmp")]
        dir: PathBuf,
        /// Crash cycles to run.
        #[arg(long, default_value_t = 10)]
        cycles: u32,
        /// Writer threads.
        #[arg(long, default_value_t = 4)]
        writers: usize,
        /// Seed of the kill times and the writers' choices [default: from the clock].
        #[arg(long)]
        seed: Option<u64>,
        /// The backing directory to use (e.g. on LazyFS), instead of one in --dir.
        #[arg(long)]
        backing: Option<PathBuf>,
        /// Backing tier of the mounts (uring needs O_DIRECT from the
        /// backing's filesystem; file works on any).
        #[arg(long, default_value = "uring")]
        tier: TierKind,
        /// A shell command run after each kill, before the remount (a power
        /// cut: e.g. `echo lazyfs::clear-cache > FIFO`, dropping every write
        /// the backing's filesystem holds unsynced). It must exit 0.
        #[arg(long)]
        after_kill: Option<String>,
        /// After each kill, a simulated power cut: the daemon keeps a
        /// durable image of its data and metadata files (what completed
        /// syncs covered), and every 4 KiB page that differs from it gets
        /// its written or its durable bytes at random (any subset of the
        /// unsynced writes, in any order). Needs --tier file.
        #[arg(long)]
        power_loss: bool,
    },
    /// A mixed load with every byte checked: workers (each with its own
    /// groups) mix FUSE writes (whole and partial), reads and fsyncs with
    /// control-file STOREs and RESTOREs over a T1 much smaller than the
    /// working set. Prints operations, errors (must be 0) and the daemon's
    /// memory at the start and end (must stay within T1 + 64 MiB); exits 1
    /// otherwise. Needs root and /dev/fuse.
    Soak {
        /// Seconds to run.
        #[arg(long, default_value_t = 60.0)]
        seconds: f64,
        /// Worker threads.
        #[arg(long, default_value_t = 16)]
        workers: usize,
        /// Scratch directory for the backing store and the mount point.
        #[arg(long, default_value = "/var/tmp")]
        dir: PathBuf,
        /// Directory for the workers' region files (tmpfs).
        #[arg(long, default_value = "/dev/shm")]
        shm: PathBuf,
        /// Seed of the workers' choices [default: from the clock].
        #[arg(long)]
        seed: Option<u64>,
        /// Backing tier: uring (the default, local disk) or redis (a
        /// redis-server started for the run, AOF on, killed and restarted
        /// every --kill-every seconds: EIO and ENOSPC during its outages
        /// are counted apart, and after a final sync every group must
        /// verify). Needs redis-server and redis-cli for redis.
        #[arg(long, default_value = "uring")]
        tier: TierKind,
        /// --tier redis: seconds between kills of the server.
        #[arg(long, default_value_t = 5.0)]
        kill_every: f64,
        /// --tier redis: seconds the server stays down.
        #[arg(long, default_value_t = 1.0)]
        down: f64,
    },
    /// Random group reads through a backing tier, next to fio on the same file
    /// (same block size, queue depth and O_DIRECT setting).
    Backing {
        /// Directory for the bench file (kvfs-bench.data); put it on the disk to measure (not used by --tier redis).
        #[arg(long, default_value = "/var/tmp/kvfs-bench")]
        dir: PathBuf,
        /// Tier to measure: uring (io_uring, O_DIRECT), file (pread, compared with fio psync at depth 1), or redis (GETs and SETs through the redis tier, compared with redis-benchmark on the same server; needs --remote).
        #[arg(long, default_value = "uring")]
        tier: TierKind,
        /// io_uring queue depth (also fio's iodepth); redis: commands per pipeline (also redis-benchmark's -P).
        #[arg(long, default_value_t = 32)]
        qd: u32,
        /// redis: the server (redis://HOST:PORT, unix:///PATH, rediss://HOST:PORT) or cluster seed nodes.
        #[arg(long, value_delimiter = ',', value_name = "URL")]
        remote: Vec<String>,
        /// redis over TLS: the CA's PEM file (as kvfs mount --remote-ca; redis-benchmark's --cacert).
        #[arg(long, value_name = "FILE")]
        remote_ca: Option<PathBuf>,
        /// redis over TLS: a client certificate, with --remote-key (redis-benchmark's --cert).
        #[arg(long, value_name = "FILE", requires = "remote_key")]
        remote_cert: Option<PathBuf>,
        /// redis over TLS: the client certificate's key (redis-benchmark's --key).
        #[arg(long, value_name = "FILE", requires = "remote_cert")]
        remote_key: Option<PathBuf>,
        /// redis: client connections on each side (kvfs threads; redis-benchmark's -c).
        #[arg(long, default_value_t = 4)]
        connections: usize,
        /// Group size: 4k or 16k (any multiple of 4096).
        #[arg(long, default_value = "4k", value_parser = parse_size)]
        group_size: u64,
        /// Bench file size; the file is written in full once and reused (redis: the bytes of groups kept in the server) [default: 1GiB; redis: 256MiB].
        #[arg(long, value_parser = parse_size)]
        file_size: Option<u64>,
        /// Seconds for each of the two runs.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Rounds of (kvfs, fio), alternating which runs first; means are compared.
        #[arg(long, default_value_t = 2)]
        rounds: u32,
    },
}

fn parse_size(s: &str) -> Result<u64, String> {
    kvfs::geometry::parse_size(s)
}

fn main() {
    let cli = Cli::parse();
    // fuser warns when its own unmount-on-exit finds the mount already gone
    // (after `kvfs umount` or `umount`): expected, so not shown by default.
    let filter =
        std::env::var("RUST_LOG").unwrap_or_else(|_| format!("{},fuser::session=error", cli.log));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(cli) {
        eprintln!("kvfs: {}", cli::error_chain(&e));
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Mount(args) => cli::mount::mount(args)?,
        Cmd::Umount { mountpoint } => cli::running::umount(&mountpoint)?,
        Cmd::Stat {
            mountpoint,
            watch,
            interval,
            count,
        } => {
            if watch {
                cli::running::stat_watch(&mountpoint, interval, count)?
            } else {
                cli::running::stat(&mountpoint)?
            }
        }
        Cmd::Sync { mountpoint } => cli::running::flush(&mountpoint)?,
        Cmd::Ctl { mountpoint, what } => ctl(&mountpoint, what)?,
        Cmd::Bench { what } => match what {
            BenchCmd::Restore {
                dir,
                shm,
                seconds,
                threads,
            } => {
                kvfs::bench::restore::run(&kvfs::bench::restore::RestoreBench {
                    dir,
                    shm,
                    seconds,
                    threads: threads.unwrap_or_else(|| {
                        std::thread::available_parallelism()
                            .map(|n| n.get())
                            .unwrap_or(2)
                    }),
                })?;
            }
            BenchCmd::Fuse {
                dir,
                tmpfs,
                groups,
                seconds,
                threads,
                rounds,
            } => {
                kvfs::bench::fuse::run(&kvfs::bench::fuse::FuseBench {
                    dir,
                    tmpfs,
                    groups,
                    seconds,
                    rounds,
                    threads: threads.unwrap_or_else(|| {
                        std::thread::available_parallelism()
                            .map(|n| n.get())
                            .unwrap_or(2)
                    }),
                })?;
            }
            BenchCmd::Soak {
                seconds,
                workers,
                dir,
                shm,
                seed,
                tier,
                kill_every,
                down,
            } => {
                let redis = match tier {
                    TierKind::Redis => {
                        if !(kill_every > 0.0 && down >= 0.0) {
                            anyhow::bail!("--kill-every must be positive and --down not negative");
                        }
                        Some(kvfs::bench::soak::RedisOutages { kill_every, down })
                    }
                    TierKind::Uring => None,
                    TierKind::File => anyhow::bail!("bench soak runs --tier uring or redis"),
                };
                kvfs::bench::soak::run(&kvfs::bench::soak::SoakBench {
                    dir,
                    shm,
                    seconds,
                    workers: workers.max(1),
                    seed: seed.unwrap_or_else(clock_seed),
                    redis,
                })?;
            }
            BenchCmd::Crash {
                dir,
                cycles,
                writers,
                seed,
                backing,
                tier,
                after_kill,
                power_loss,
            } => {
                let seed = seed.unwrap_or_else(clock_seed);
                if tier == TierKind::Redis {
                    anyhow::bail!("bench crash runs the uring or file tier");
                }
                kvfs::bench::crash::run(&kvfs::bench::crash::CrashBench {
                    dir,
                    cycles,
                    writers: writers.max(1),
                    seed,
                    backing,
                    tier,
                    after_kill,
                    power_loss,
                })?;
            }
            BenchCmd::Backing {
                tier: TierKind::Redis,
                qd,
                remote,
                remote_ca,
                remote_cert,
                remote_key,
                connections,
                group_size,
                file_size,
                seconds,
                rounds,
                ..
            } => {
                if remote.is_empty() {
                    anyhow::bail!("--tier redis needs --remote URL");
                }
                kvfs::bench::redis::run(&kvfs::bench::redis::RedisBench {
                    remote: kvfs::tier::RemoteConfig {
                        urls: remote,
                        qd: qd.max(1) as usize,
                        timeout: std::time::Duration::from_secs(5),
                        replicas: None,
                        allow_evict: true,
                        ca: remote_ca,
                        client_cert: remote_cert.zip(remote_key),
                    },
                    layout: kvfs::bench::backing::bench_layout(
                        group_size,
                        file_size.unwrap_or(256 << 20),
                    )?,
                    connections: connections.max(1),
                    seconds,
                    rounds,
                })?;
            }
            BenchCmd::Backing {
                dir,
                tier,
                qd,
                remote,
                remote_ca,
                remote_cert,
                group_size,
                file_size,
                seconds,
                rounds,
                ..
            } => {
                if !remote.is_empty() || remote_ca.is_some() || remote_cert.is_some() {
                    anyhow::bail!("--remote and the --remote-* options are for --tier redis");
                }
                kvfs::bench::backing::run(&BackingBench {
                    dir,
                    tier,
                    queue_depth: qd,
                    group_bytes: group_size,
                    file_bytes: file_size.unwrap_or(1 << 30),
                    seconds,
                    rounds,
                })?;
            }
        },
    }
    Ok(())
}

/// A seed for benches that were not given one.
fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
}

fn ctl(mount: &std::path::Path, what: CtlCmd) -> Result<()> {
    use anyhow::Context;
    let c = kvfs::client::Client::open(mount).with_context(|| {
        format!(
            "cannot open {}/.kvfs/control (is it a kvfs mount?)",
            mount.display()
        )
    })?;
    let parse = |names: &[String]| -> Result<Vec<kvfs::geometry::GroupKey>> {
        names
            .iter()
            .map(|n| {
                kvfs::geometry::parse_group_name(n)
                    .map_err(|e| anyhow::anyhow!("{n:?} is not a group name: {e}"))
            })
            .collect()
    };
    match what {
        CtlCmd::Hello => {
            let (v, layout) = c.hello()?;
            println!("protocol {v}\n{layout}");
        }
        CtlCmd::Query { groups } => {
            let keys = parse(&groups)?;
            let states = c.query(&keys)?;
            for (k, s) in keys.iter().zip(states) {
                let state = match s.state {
                    kvfs::control::wire::STATE_T1 => "t1",
                    kvfs::control::wire::STATE_BACKING => "backing",
                    _ => "empty",
                };
                // "-" where the group was never written back (empty, or
                // only in T1 so far).
                let crc = s
                    .backing_crc
                    .map_or("-".to_string(), |c| format!("{c:08x}"));
                println!(
                    "{k}\t{state}\tdirty={}\tbacking_crc32c={crc}",
                    s.dirty as u8
                );
            }
        }
        CtlCmd::Prefetch { groups } => {
            let keys = parse(&groups)?;
            let t = c.prefetch(&keys)?;
            c.wait(t, None)?;
            println!("{} groups in T1", keys.len());
        }
    }
    Ok(())
}
