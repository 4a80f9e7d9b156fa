//! The `kvfs` command line.

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
                  SSD (io_uring, O_DIRECT). Every group is checksummed; a group whose bytes fail their \
                  checksum is never served."
)]
struct Cli {
    /// Log filter (error, warn, info, debug, trace, or a tracing directive); RUST_LOG also works.
    #[arg(long, global = true, default_value = "info")]
    log: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Benchmarks that print their figure next to a baseline from the same run.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Random group reads through a backing tier, next to fio on the same file
    /// (same block size, queue depth and O_DIRECT setting).
    Backing {
        /// Directory for the bench file (kvfs-bench.data); put it on the disk to measure.
        #[arg(long)]
        dir: PathBuf,
        /// Tier to measure: uring (io_uring, O_DIRECT) or file (pread, compared with fio psync at depth 1).
        #[arg(long, default_value = "uring")]
        tier: TierKind,
        /// io_uring queue depth (also fio's iodepth).
        #[arg(long, default_value_t = 32)]
        qd: u32,
        /// Group size: 4k or 16k (any multiple of 4096).
        #[arg(long, default_value = "4k", value_parser = parse_size)]
        group_size: u64,
        /// Bench file size; the file is written in full once and reused.
        #[arg(long, default_value = "1GiB", value_parser = parse_size)]
        file_size: u64,
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
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| cli.log.clone());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(cli) {
        eprintln!("kvfs: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Bench { what } => match what {
            BenchCmd::Backing {
                dir,
                tier,
                qd,
                group_size,
                file_size,
                seconds,
                rounds,
            } => {
                kvfs::bench::backing::run(&BackingBench {
                    dir,
                    tier,
                    queue_depth: qd,
                    group_bytes: group_size,
                    file_bytes: file_size,
                    seconds,
                    rounds,
                })?;
            }
        },
    }
    Ok(())
}
