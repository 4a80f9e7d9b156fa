//! Shared harness of the mounted tests: a kvfs daemon on a temp mount.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const GB: usize = 16 * 64 * 2; // block_tokens × head_dim × bf16

pub fn kvfs() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvfs"))
}

pub fn can_mount() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root || !Path::new("/dev/fuse").exists() {
        eprintln!("skipped: mounting needs root and /dev/fuse");
        return false;
    }
    true
}

pub struct Mount {
    pub mp: PathBuf,
    pub backing: PathBuf,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

impl Mount {
    pub fn new(extra: &[&str]) -> Mount {
        let mount = Mount::unmounted();
        mount.mount(extra);
        mount
    }

    /// The mount point and backing directory, with nothing mounted yet.
    pub fn unmounted() -> Mount {
        let m = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        Mount {
            mp: m.path().to_path_buf(),
            backing: b.path().join("store"),
            _dirs: (m, b),
        }
    }

    pub fn mount(&self, extra: &[&str]) {
        let out = self.try_mount(extra);
        assert!(
            out.status.success(),
            "mount failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `kvfs mount` with the small default geometry (unless `extra` gives
    /// one) and a 64 KiB T1 (unless `extra` gives `--t1`); its output,
    /// success or not.
    pub fn try_mount(&self, extra: &[&str]) -> std::process::Output {
        let geo = geometry(2, 8);
        let mut args: Vec<&str> = Vec::new();
        if !extra.iter().any(|a| *a == "--t1" || a.starts_with("--t1=")) {
            args.extend(["--t1", "64KiB"]);
        }
        if !extra
            .iter()
            .any(|a| a.starts_with("--preset") || a.starts_with("--layers"))
        {
            args.extend(geo.iter().map(String::as_str));
        }
        args.extend(extra);
        kvfs()
            .arg("mount")
            .arg(&self.mp)
            .arg("--backing")
            .arg(&self.backing)
            .args(&args)
            .output()
            .unwrap()
    }

    pub fn p(&self, rel: &str) -> PathBuf {
        self.mp.join(rel)
    }

    pub fn umount(&self) {
        let out = kvfs().arg("umount").arg(&self.mp).output().unwrap();
        assert!(
            out.status.success(),
            "umount failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn stats(&self) -> String {
        fs::read_to_string(self.p(".kvfs/stats")).unwrap()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if is_mounted(&self.mp) {
            let _ = kvfs().arg("umount").arg(&self.mp).output();
        }
        if is_mounted(&self.mp) {
            let _ = Command::new("umount").arg("-l").arg(&self.mp).status();
        }
    }
}

/// Kills process `pid` (a daemon the test started) with SIGKILL and
/// waits, up to 20 s, until it is gone.
pub fn kill_and_wait(pid: i32) {
    // SAFETY: a signal to a process the test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let t = std::time::Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists()
        && t.elapsed() < std::time::Duration::from_secs(20)
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

pub fn is_mounted(mp: &Path) -> bool {
    let canon = fs::canonicalize(mp).unwrap_or(mp.to_path_buf());
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(canon.to_str().unwrap()))
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn errno_of(r: std::io::Result<impl Sized>) -> i32 {
    r.err().and_then(|e| e.raw_os_error()).unwrap_or(0)
}

pub fn xattr(path: &Path, name: &str) -> Option<String> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    let mut buf = [0u8; 256];
    // SAFETY: valid C strings and a buffer of the length passed.
    let r = unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (r >= 0).then(|| String::from_utf8_lossy(&buf[..r as usize]).into_owned())
}

pub fn names(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

/// A file in /dev/shm to register as a host region of the control file.
pub struct ShmRegion {
    pub file: tempfile::NamedTempFile,
    pub len: u64,
}

impl ShmRegion {
    pub fn new(len: u64) -> ShmRegion {
        let file = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
        file.as_file().set_len(len).unwrap();
        ShmRegion { file, len }
    }
    pub fn path(&self) -> PathBuf {
        self.file.path().to_path_buf()
    }
    pub fn read(&self, off: u64, len: usize) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; len];
        self.file.as_file().read_exact_at(&mut b, off).unwrap();
        b
    }
    pub fn write(&self, off: u64, data: &[u8]) {
        use std::os::unix::fs::FileExt;
        self.file.as_file().write_all_at(data, off).unwrap();
    }
}

/// `kvfs mount` flags of the small test geometry: `layers` × `blocks` × 2
/// KV heads × 16 tokens × head_dim 64, bf16 (groups of `GB` bytes).
pub fn geometry(layers: u32, blocks: u64) -> Vec<String> {
    let (l, b) = (layers.to_string(), blocks.to_string());
    [
        "--layers",
        &l,
        "--blocks",
        &b,
        "--kv-heads",
        "2",
        "--head-dim",
        "64",
        "--block-tokens",
        "16",
        "--dtype",
        "bf16",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The errno, entry and message of a refused control request (panics on
/// anything else).
pub fn errno(
    r: Result<impl std::fmt::Debug, kvfs::client::ClientError>,
) -> (i32, Option<u32>, String) {
    match r {
        Err(kvfs::client::ClientError::Refused {
            errno,
            entry,
            message,
        }) => (errno, entry, message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}
