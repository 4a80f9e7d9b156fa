//! `kvfs bench fuse`: 4 KiB random reads of T1-resident group files through
//! a kvfs mount, next to the same reads of the same bytes on tmpfs and
//! through a bare fuser filesystem (the floor any FUSE filesystem pays), in
//! the same run: cold (O_DIRECT: every read reaches the filesystem) and
//! repeated (buffered reads through fds kept open, which the kernel may
//! serve from its page cache), with 1 and 2 reader threads.

use super::{Rng, thousands};
use crate::fs::{BareFs, KvFs, mount_background};
use crate::geometry::{GroupIndex, GroupLayout};
use crate::gpu::HostBuf;
use anyhow::{Context, bail};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct FuseBench {
    /// Scratch directory for the backing store and mount points.
    pub dir: PathBuf,
    /// A tmpfs directory for the baseline files.
    pub tmpfs: PathBuf,
    pub groups: u64,
    pub seconds: f64,
    /// FUSE serving threads for kvfs and the bare filesystem alike.
    pub threads: usize,
    /// Rounds, alternating the order of tmpfs, bare and kvfs so machine
    /// noise that drifts over the run favours none; figures are means.
    pub rounds: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Cold,
    Repeated,
}

/// reads/s for one (target, mode, readers) cell.
#[derive(Clone, Debug, Default)]
pub struct FuseResult {
    /// [mode][readers-1] for tmpfs, bare, kvfs.
    pub tmpfs: [[f64; 2]; 2],
    pub bare: [[f64; 2]; 2],
    pub kvfs: [[f64; 2]; 2],
    pub tmpfs_direct: bool,
}

const TMPFS_MAGIC: i64 = 0x0102_1994;
const READ: usize = 4096;

fn is_tmpfs(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs fills the zeroed struct we own.
    unsafe {
        let mut s: libc::statfs = std::mem::zeroed();
        libc::statfs(c.as_ptr(), &mut s) == 0 && s.f_type as i64 == TMPFS_MAGIC
    }
}

/// Lets this process hold one fd per group file.
fn raise_fd_limit(need: u64) {
    // SAFETY: get/setrlimit on a struct we own.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < need + 64 {
            r.rlim_cur = r.rlim_max.min(need + 64);
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// Opens every path; with `direct`, O_DIRECT (falling back to buffered
/// where refused, reported by the bool).
fn open_all(paths: &[PathBuf], direct: bool) -> anyhow::Result<(Vec<File>, bool)> {
    let mut used_direct = direct;
    let mut out = Vec::with_capacity(paths.len());
    for p in paths {
        let f = if used_direct {
            match OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(p)
            {
                Ok(f) => f,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    used_direct = false;
                    File::open(p)?
                }
                Err(e) => return Err(e).with_context(|| format!("cannot open {}", p.display())),
            }
        } else {
            File::open(p).with_context(|| format!("cannot open {}", p.display()))?
        };
        out.push(f);
    }
    Ok((out, used_direct))
}

/// `readers` threads doing random 4 KiB preads over `files` for `seconds`.
fn hammer(files: &Arc<Vec<File>>, readers: usize, seconds: f64) -> anyhow::Result<f64> {
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let threads: Vec<_> = (0..readers)
        .map(|t| {
            let files = files.clone();
            std::thread::spawn(move || -> std::io::Result<u64> {
                let mut buf = HostBuf::alloc(READ)?;
                let mut rng = Rng::new(t as u64 + 1);
                let mut n = 0u64;
                while Instant::now() < deadline {
                    for _ in 0..64 {
                        let f = &files[rng.below(files.len() as u64) as usize];
                        let got = f.read_at(buf.as_mut_slice(), 0)?;
                        if got != READ {
                            return Err(std::io::Error::other(format!("short read: {got} bytes")));
                        }
                        n += 1;
                    }
                }
                Ok(n)
            })
        })
        .collect();
    let mut total = 0;
    for t in threads {
        total += t.join().map_err(|_| anyhow::anyhow!("reader panicked"))??;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

fn measure(paths: &[PathBuf], mode: Mode, seconds: f64) -> anyhow::Result<([f64; 2], bool)> {
    let (files, direct) = open_all(paths, mode == Mode::Cold)?;
    if mode == Mode::Repeated {
        // Warm: one read of each file, so the kernel holds every page.
        let mut buf = HostBuf::alloc(READ)?;
        for f in &files {
            f.read_at(buf.as_mut_slice(), 0)?;
        }
    }
    let files = Arc::new(files);
    let one = hammer(&files, 1, seconds)?;
    let two = hammer(&files, 2, seconds)?;
    Ok(([one, two], direct))
}

pub fn run(b: &FuseBench) -> anyhow::Result<FuseResult> {
    if !is_tmpfs(&b.tmpfs) {
        bail!(
            "{} is not a tmpfs; give one with --tmpfs (e.g. /dev/shm)",
            b.tmpfs.display()
        );
    }
    raise_fd_limit(b.groups);
    let scratch = tempfile::Builder::new()
        .prefix("kvfs-bench-fuse")
        .tempdir_in(&b.dir)
        .with_context(|| format!("cannot make a scratch directory in {}", b.dir.display()))?;
    // llama-3.1-8b groups are 4 KiB; 512 groups a block.
    let layout = GroupLayout::preset("llama-3.1-8b", b.groups.div_ceil(512).max(1), 16)?;
    let gb = layout.group_bytes() as usize;
    if gb != READ {
        bail!("bench layout has {gb}-byte groups, expected {READ}");
    }
    let cascade = super::scratch_cascade(scratch.path(), layout, b.groups + 16)?;
    let tmp = tempfile::Builder::new()
        .prefix("kvfs-bench-fuse")
        .tempdir_in(&b.tmpfs)?;
    let data: Vec<u8> = (0..gb).map(|i| (i * 31 + 7) as u8).collect();
    let mut kvfs_paths = Vec::new();
    let mut bare_paths = Vec::new();
    let mut tmpfs_paths = Vec::new();
    let kmnt = scratch.path().join("kvfs");
    let bmnt = scratch.path().join("bare");
    std::fs::create_dir_all(&kmnt)?;
    std::fs::create_dir_all(&bmnt)?;
    for i in 0..b.groups {
        cascade.write(GroupIndex(i), 0, &data)?;
        kvfs_paths.push(kmnt.join(layout.key(GroupIndex(i))?.to_string()));
        bare_paths.push(bmnt.join(format!("f{i}")));
        let p = tmp.path().join(format!("g{i}"));
        std::fs::write(&p, &data)?;
        tmpfs_paths.push(p);
    }
    if cascade.stats().t1_slots_used != b.groups {
        bail!("not every bench group is T1-resident");
    }
    let kv = mount_background(KvFs::new(cascade.clone(), 0, 0), &kmnt, b.threads)
        .with_context(|| format!("cannot mount kvfs at {}", kmnt.display()))?;
    let bare = mount_background(BareFs::new(b.groups, data.clone()), &bmnt, b.threads)
        .with_context(|| format!("cannot mount the bare filesystem at {}", bmnt.display()))?;
    // Same bytes everywhere, or the comparison means nothing.
    for p in [&kvfs_paths[0], &bare_paths[0], &tmpfs_paths[0]] {
        if std::fs::read(p)? != data {
            bail!("{} does not hold the bench bytes", p.display());
        }
    }
    println!(
        "fuse bench: {} T1-resident groups of 4 KiB, random 4 KiB preads, {} s a cell, {} FUSE threads, mean of {} rounds",
        b.groups,
        b.seconds,
        b.threads,
        b.rounds.max(1)
    );
    let mut r = FuseResult {
        tmpfs_direct: true,
        ..FuseResult::default()
    };
    let rounds = b.rounds.max(1);
    let add = |acc: &mut [f64; 2], v: [f64; 2]| {
        acc[0] += v[0] / rounds as f64;
        acc[1] += v[1] / rounds as f64;
    };
    for round in 0..rounds {
        for (mi, mode) in [Mode::Cold, Mode::Repeated].into_iter().enumerate() {
            let mut order = [0, 1, 2];
            if round % 2 == 1 {
                order.reverse();
            }
            for which in order {
                match which {
                    0 => {
                        let (t, direct) = measure(&tmpfs_paths, mode, b.seconds)?;
                        add(&mut r.tmpfs[mi], t);
                        if mode == Mode::Cold {
                            r.tmpfs_direct &= direct;
                        }
                    }
                    1 => add(&mut r.bare[mi], measure(&bare_paths, mode, b.seconds)?.0),
                    _ => add(&mut r.kvfs[mi], measure(&kvfs_paths, mode, b.seconds)?.0),
                }
            }
        }
    }
    drop(kv.unmount());
    drop(bare.unmount());
    let pct = |a: f64, b: f64| if b > 0.0 { 100.0 * a / b } else { 0.0 };
    for (mi, name) in ["cold (O_DIRECT)", "repeated (cached, fds kept open)"]
        .iter()
        .enumerate()
    {
        println!("  {name}:");
        for readers in 0..2 {
            let (t, ba, k) = (
                r.tmpfs[mi][readers],
                r.bare[mi][readers],
                r.kvfs[mi][readers],
            );
            println!(
                "    {} reader{}  tmpfs {:>11}/s  bare fuser {:>9}/s ({:5.1}% of tmpfs)  kvfs {:>9}/s ({:5.1}% of tmpfs, {:5.1}% of bare)",
                readers + 1,
                if readers == 0 { " " } else { "s" },
                thousands(t as u64),
                thousands(ba as u64),
                pct(ba, t),
                thousands(k as u64),
                pct(k, t),
                pct(k, ba)
            );
        }
    }
    println!(
        "  kvfs/bare of the cold tmpfs ratios: {:.1}% (1 reader), {:.1}% (2 readers); repeated kvfs/tmpfs: {:.1}%, {:.1}%",
        pct(r.kvfs[0][0] / r.tmpfs[0][0], r.bare[0][0] / r.tmpfs[0][0]),
        pct(r.kvfs[0][1] / r.tmpfs[0][1], r.bare[0][1] / r.tmpfs[0][1]),
        pct(r.kvfs[1][0], r.tmpfs[1][0]),
        pct(r.kvfs[1][1], r.tmpfs[1][1])
    );
    if !r.tmpfs_direct {
        println!("  (tmpfs refused O_DIRECT here: its cold column is buffered reads)");
    }
    Ok(r)
}
