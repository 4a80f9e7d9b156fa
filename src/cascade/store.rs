//! The backing directory: `superblock`, `data` (sparse, `index × stride`),
//! `meta` (16-byte records, see `meta.rs`) and `lock`.
//!
//! Creation writes the data and metadata files first and the superblock
//! last (via rename), so a crash mid-creation leaves no superblock and the
//! next open starts over instead of trusting half-made files. An exclusive
//! flock on `lock` keeps a second kvfs off the same store.

use super::meta::{META_RECORD_BYTES, MetaTable};
use crate::geometry::{
    GroupLayout, Location, SUPERBLOCK_BYTES, Superblock, SuperblockError, decode_superblock,
    encode_superblock,
};
use crate::tier::{RemoteConfig, Tier, TierKind, open_tier};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{dir}: no kvfs store here yet, and no geometry was given to create one")]
    NoGeometry { dir: PathBuf },
    #[error(
        "{dir}: the store's geometry differs from the one requested\n  store:     {on_disk}\n  requested: {requested}\n(omit the geometry options to use the store's, or use another directory)"
    )]
    Mismatch {
        dir: PathBuf,
        on_disk: Box<GroupLayout>,
        requested: Box<GroupLayout>,
    },
    #[error("{path}: {source}")]
    Superblock {
        path: PathBuf,
        #[source]
        source: SuperblockError,
    },
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{dir} is in use by another kvfs process (its lock file is held)")]
    Busy { dir: PathBuf },
    #[error("{path}: the store is damaged: {why}")]
    Damaged { path: PathBuf, why: String },
    #[error(
        "{dir}: the store keeps its groups {}, but tier {tier} keeps them {} (use the tier the store was made with, or another directory)",
        where_(*store), where_(tier.location())
    )]
    Location {
        dir: PathBuf,
        store: Location,
        tier: TierKind,
    },
    #[error("{dir}: {why}")]
    Remote { dir: PathBuf, why: String },
}

fn where_(l: Location) -> &'static str {
    match l {
        Location::Local => "in its local data file",
        Location::Remote => "in a remote server (--tier redis)",
    }
}

/// 16 random bytes from the kernel: the store's identity.
fn new_uuid() -> io::Result<[u8; 16]> {
    let mut u = [0u8; 16];
    let mut f = File::open("/dev/urandom")?;
    io::Read::read_exact(&mut f, &mut u)?;
    Ok(u)
}

fn io_at(path: &Path, what: &'static str) -> impl FnOnce(io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { path, what, source }
}

/// How to open a backing directory.
#[derive(Clone, Debug)]
pub struct BackingConfig {
    pub dir: PathBuf,
    /// Required to create a store; if given for an existing one, must match.
    pub layout: Option<GroupLayout>,
    pub tier: TierKind,
    pub queue_depth: u32,
    /// How to reach the server of a remote tier (`TierKind::Redis`).
    pub remote: Option<RemoteConfig>,
}

/// An opened backing directory.
pub struct Backing {
    pub layout: GroupLayout,
    /// The store's identity (names its keys in a remote server).
    pub uuid: [u8; 16],
    /// What opening the tier found worth telling the operator (a remote
    /// server that persists nothing, say).
    pub notes: Vec<String>,
    pub tier: Box<dyn Tier>,
    pub meta: MetaTable,
    pub created: bool,
    /// This opening's mount epoch (mod 256): one more than the last.
    pub epoch: u8,
    /// Held for the store's life: the flock is released when it closes.
    pub lock: File,
}

impl Backing {
    pub fn open(cfg: &BackingConfig) -> Result<Backing, StoreError> {
        let dir = &cfg.dir;
        fs::create_dir_all(dir).map_err(io_at(dir, "cannot create the backing directory"))?;
        let lock_path = dir.join("lock");
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(io_at(&lock_path, "cannot open the lock file"))?;
        // SAFETY: flock on an fd we own; no memory is involved.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(StoreError::Busy { dir: dir.clone() });
            }
            return Err(io_at(&lock_path, "cannot lock")(e));
        }

        let sb_path = dir.join("superblock");
        let data_path = dir.join("data");
        let meta_path = dir.join("meta");
        let (sb, created) = match fs::read(&sb_path) {
            Ok(bytes) => {
                let mut sb =
                    decode_superblock(&bytes).map_err(|source| StoreError::Superblock {
                        path: sb_path.clone(),
                        source,
                    })?;
                if let Some(req) = cfg.layout
                    && req != sb.layout
                {
                    return Err(StoreError::Mismatch {
                        dir: dir.clone(),
                        on_disk: Box::new(sb.layout),
                        requested: Box::new(req),
                    });
                }
                if sb.uuid == [0; 16] {
                    // A version-2 store: give it its identity.
                    sb.uuid = new_uuid().map_err(io_at(dir, "cannot draw a uuid"))?;
                    install_superblock(dir, &sb)?;
                }
                (sb, false)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let layout = cfg
                    .layout
                    .ok_or_else(|| StoreError::NoGeometry { dir: dir.clone() })?;
                let sb = Superblock {
                    layout,
                    uuid: new_uuid().map_err(io_at(dir, "cannot draw a uuid"))?,
                    location: cfg.tier.location(),
                };
                create(dir, &sb)?;
                (sb, true)
            }
            Err(e) => return Err(io_at(&sb_path, "cannot read the superblock")(e)),
        };
        if sb.location != cfg.tier.location() {
            return Err(StoreError::Location {
                dir: dir.clone(),
                store: sb.location,
                tier: cfg.tier,
            });
        }
        let layout = sb.layout;
        if sb.location == Location::Local {
            check_data_file(&data_path, &layout)?;
        }
        let meta_file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&meta_path)
            .map_err(io_at(&meta_path, "cannot open the metadata file"))?;
        let meta_len = layout.group_count() * META_RECORD_BYTES;
        let found = meta_file
            .metadata()
            .map_err(io_at(&meta_path, "cannot stat the metadata file"))?
            .len();
        if found != meta_len {
            // Reserving would grow a short file with zeros: every group
            // past its end would read as never written, silently.
            return Err(StoreError::Damaged {
                path: meta_path.clone(),
                why: format!(
                    "the metadata file is {found} bytes, the geometry needs {meta_len} ({META_RECORD_BYTES} a group): it was cut short or replaced, and the groups it no longer describes cannot be told apart from never-written ones; restore the file, or move the directory aside and start a new store"
                ),
            });
        }
        reserve(&meta_file, meta_len).map_err(io_at(
            &meta_path,
            "cannot reserve the metadata file's space",
        ))?;
        let mut meta =
            MetaTable::open(&meta_file, layout.group_count()).map_err(|e| StoreError::Damaged {
                path: meta_path.clone(),
                why: e.to_string(),
            })?;
        if crate::tier::shadow::enabled() {
            meta.keep_durable_image(&meta_path, &meta_file)
                .map_err(io_at(&meta_path, "cannot make its durable image"))?;
        }
        let (tier, notes) = match sb.location {
            Location::Local => (
                open_tier(cfg.tier, &data_path, layout, cfg.queue_depth)
                    .map_err(io_at(&data_path, "cannot open the data file"))?,
                Vec::new(),
            ),
            Location::Remote => open_remote(cfg, &sb)?,
        };
        let epoch = next_epoch(dir)?;
        Ok(Backing {
            layout,
            uuid: sb.uuid,
            notes,
            tier,
            meta,
            created,
            epoch,
            lock,
        })
    }
}

/// The data file must hold every copy of every group of the geometry.
fn check_data_file(path: &Path, layout: &GroupLayout) -> Result<(), StoreError> {
    let len = fs::metadata(path)
        .map_err(|e| StoreError::Damaged {
            path: path.to_path_buf(),
            why: format!("data file unusable: {e}"),
        })?
        .len();
    let want = crate::tier::data_bytes(layout);
    if len != want {
        return Err(StoreError::Damaged {
            path: path.to_path_buf(),
            why: format!(
                "data file is {len} bytes, the geometry needs {want} ({} copies of each group)",
                crate::tier::COPIES
            ),
        });
    }
    Ok(())
}

/// Connects the remote tier of a store whose bytes live in a server.
fn open_remote(
    cfg: &BackingConfig,
    sb: &Superblock,
) -> Result<(Box<dyn Tier>, Vec<String>), StoreError> {
    let remote = cfg.remote.as_ref().ok_or_else(|| StoreError::Remote {
        dir: cfg.dir.clone(),
        why: "the redis tier needs --remote URL (a server, or seed nodes of a cluster)".into(),
    })?;
    let tier = crate::tier::RedisTier::connect(sb.layout, sb.uuid, remote).map_err(|why| {
        StoreError::Remote {
            dir: cfg.dir.clone(),
            why,
        }
    })?;
    let notes = tier.warnings().to_vec();
    Ok((Box::new(tier), notes))
}

/// Gives the metadata file its blocks up front (fallocate; unwritten
/// extents, so nothing is zeroed): the table is written through a shared
/// mapping, and a store to a page of a hole on a full disk is a SIGBUS,
/// not an error anyone could return. A filesystem without fallocate is
/// let be (logged): its holes are the risk it carries.
fn reserve(f: &File, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on an fd we own, within its length.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, len as libc::off_t) };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        tracing::warn!(
            "the backing filesystem has no fallocate: metadata pages are allocated as they are first written, and a full disk then stops the daemon"
        );
        return Ok(());
    }
    Err(e)
}

/// Bumps the store's mount epoch (file `epoch`: one byte) and returns the
/// new one. Write-backs record the epoch they happened in; a newest copy
/// that fails its checksum may be replaced by the last synced copy only if
/// it was written in an earlier epoch, i.e. before a crash could have cut
/// it short. A missing or unreadable file counts as epoch 0.
fn next_epoch(dir: &Path) -> Result<u8, StoreError> {
    let path = dir.join("epoch");
    let last = fs::read(&path)
        .ok()
        .and_then(|b| b.first().copied())
        .unwrap_or(0);
    let epoch = last.wrapping_add(1);
    let tmp = dir.join("epoch.new");
    let mut f = File::create(&tmp).map_err(io_at(&tmp, "cannot create"))?;
    f.write_all(&[epoch]).map_err(io_at(&tmp, "cannot write"))?;
    f.sync_all().map_err(io_at(&tmp, "cannot sync"))?;
    fs::rename(&tmp, &path).map_err(io_at(&path, "cannot install"))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_at(dir, "cannot sync the directory"))?;
    Ok(epoch)
}

/// Makes a fresh store's files; the superblock goes last.
fn create(dir: &Path, sb: &Superblock) -> Result<(), StoreError> {
    let layout = &sb.layout;
    let sized = |name: &str, len: u64| -> Result<(), StoreError> {
        let p = dir.join(name);
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .map_err(io_at(&p, "cannot create"))?;
        // Sparse: blocks are allocated only as groups are written.
        f.set_len(len).map_err(io_at(&p, "cannot size"))?;
        f.sync_all().map_err(io_at(&p, "cannot sync"))
    };
    let made = (|| {
        if sb.location == Location::Local {
            sized("data", crate::tier::data_bytes(layout))?;
        }
        let meta_len = layout.group_count() * META_RECORD_BYTES;
        sized("meta", meta_len)?;
        // Reserved before the superblock goes in: a store whose metadata
        // cannot fit is never made.
        let p = dir.join("meta");
        let f = OpenOptions::new()
            .write(true)
            .open(&p)
            .map_err(io_at(&p, "cannot open"))?;
        reserve(&f, meta_len).map_err(io_at(&p, "cannot reserve the metadata file's space"))
    })();
    if made.is_err() {
        // Nothing of a store that was not made stays behind (a retry with
        // another geometry or more room starts clean).
        for name in ["data", "meta"] {
            let _ = fs::remove_file(dir.join(name));
        }
    }
    made?;
    install_superblock(dir, sb)
}

/// Writes the superblock whole (a new file, synced, renamed over the old).
fn install_superblock(dir: &Path, sb: &Superblock) -> Result<(), StoreError> {
    let tmp = dir.join("superblock.new");
    let bytes = encode_superblock(sb);
    debug_assert_eq!(bytes.len(), SUPERBLOCK_BYTES);
    let mut f = File::create(&tmp).map_err(io_at(&tmp, "cannot create"))?;
    f.write_all(&bytes).map_err(io_at(&tmp, "cannot write"))?;
    f.sync_all().map_err(io_at(&tmp, "cannot sync"))?;
    let sb_path = dir.join("superblock");
    fs::rename(&tmp, &sb_path).map_err(io_at(&sb_path, "cannot install"))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_at(dir, "cannot sync the directory"))
}
