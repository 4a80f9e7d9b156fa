//! Users kept apart on one mount: a second user (made with useradd here)
//! against a mount with --allow-other. Root, /dev/fuse and useradd needed.

mod common;
use common::*;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::process::Command;

const USER: &str = "kvfs-iso";

/// The second user's uid and gid (made on first use).
fn other_user() -> Option<(u32, u32)> {
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").arg(flag).arg(USER).output().ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    if id("-u").is_none() {
        let ok = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                USER,
            ])
            .status()
            .ok()?
            .success();
        if !ok {
            return None;
        }
    }
    Some((id("-u")?, id("-g")?))
}

/// The second user, where this machine can mount at all and the user
/// can be made (else None, the skip said).
fn mountable_second_user() -> Option<(u32, u32)> {
    if !can_mount() {
        return None;
    }
    let user = other_user();
    if user.is_none() {
        eprintln!("skipped: cannot make the user {USER} (useradd)");
    }
    user
}

/// Runs Python as the second user with the client library on its path;
/// returns its stdout (one "name=value" line per check).
fn as_other(uid: u32, gid: u32, libdir: &std::path::Path, script: &str) -> String {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .env("PYTHONPATH", libdir)
        .env_remove("HOME")
        .current_dir("/")
        .as_user(uid, gid)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "python as {USER} failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

trait AsUser {
    fn as_user(&mut self, uid: u32, gid: u32) -> &mut Self;
}

impl AsUser for Command {
    /// Runs the child as uid:gid with no supplementary groups.
    fn as_user(&mut self, uid: u32, gid: u32) -> &mut Self {
        // SAFETY: only async-signal-safe calls (setgroups, setgid, setuid)
        // between fork and exec.
        unsafe {
            self.pre_exec(move || {
                let groups = [gid];
                if libc::setgroups(1, groups.as_ptr()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        }
    }
}

fn field<'a>(text: &'a str, name: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

#[test]
fn a_second_user_uses_only_its_own_regions_and_may_not_store() {
    let Some((uid, gid)) = mountable_second_user() else {
        return;
    };
    let m = Mount::new(&["--allow-other"]);
    // The second user must be able to reach the mount point.
    fs::set_permissions(m.mp.parent().unwrap(), fs::Permissions::from_mode(0o755)).ok();
    let ctl = m.p(".kvfs/control");
    assert_eq!(fs::metadata(&ctl).unwrap().mode() & 0o777, 0o666);
    // Root writes a group through the filesystem.
    fs::write(m.p("L0/B1/H0/K"), pattern(41, GB)).unwrap();
    // The client package (tools/python/kvfs), readable by anyone.
    let lib = tempfile::tempdir().unwrap();
    fs::set_permissions(lib.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let pkg = lib.path().join("kvfs");
    fs::create_dir(&pkg).unwrap();
    fs::set_permissions(&pkg, fs::Permissions::from_mode(0o755)).unwrap();
    for f in ["__init__.py", "client.py"] {
        let src = format!("{}/tools/python/kvfs/{f}", env!("CARGO_MANIFEST_DIR"));
        fs::copy(src, pkg.join(f)).unwrap();
    }
    // Region files: root's (0600) and the second user's own.
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    fs::set_permissions(shm.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let roots = shm.path().join("root-region");
    fs::write(&roots, vec![0u8; GB]).unwrap();
    fs::set_permissions(&roots, fs::Permissions::from_mode(0o600)).unwrap();
    let mine = shm.path().join("user-region");
    fs::write(&mine, vec![0u8; GB]).unwrap();
    std::os::unix::fs::chown(&mine, Some(uid), Some(gid)).unwrap();
    fs::set_permissions(&mine, fs::Permissions::from_mode(0o600)).unwrap();
    // Root holds a region on its own fd.
    let root = kvfs::client::Client::open(&m.mp).unwrap();
    // Ids are per fd: root's third region's id names nothing on the
    // second user's fd, which registers one region.
    root.register_host_region(&roots, GB as u64).unwrap();
    root.register_host_region(&roots, GB as u64).unwrap();
    let root_region = root.register_host_region(&roots, GB as u64).unwrap();
    assert!(root_region > 1);
    let script = format!(
        r#"
import errno, os
from kvfs import Kvfs, KvfsError
def code(f):
    try:
        f()
        return "ok"
    except KvfsError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
with Kvfs("{mp}") as kv:
    print("register_roots=" + code(lambda: kv.register_host_region("{roots}", {gb})))
    r = kv.register_host_region("{mine}", {gb})
    print("use_roots_region=" + code(lambda: kv.restore([(0, 1, 0, "K", {root_region}, 0)])))
    print("restore_own=" + code(lambda: kv.restore([(0, 1, 0, "K", r, 0)])))
    with open("{mine}", "rb") as f:
        got = f.read()
    with open("{mp}/L0/B1/H0/K", "rb") as f:
        print("restored_matches=" + str(got == f.read()))
    print("store=" + code(lambda: kv.store([(0, 2, 0, "K", r, 0)])))
    print("query=" + code(lambda: kv.query([(0, 1, 0, "K")])))
def write_group():
    with open("{mp}/L0/B2/H0/K", "r+b") as f:
        f.write(b"x")
print("fuse_write=" + code(write_group))
"#,
        mp = m.mp.display(),
        roots = roots.display(),
        mine = mine.display(),
        gb = GB,
    );
    let text = as_other(uid, gid, lib.path(), &script);
    assert_eq!(field(&text, "register_roots"), "EACCES", "{text}");
    assert_eq!(field(&text, "use_roots_region"), "EBADF", "{text}");
    assert_eq!(field(&text, "restore_own"), "ok", "{text}");
    assert_eq!(field(&text, "restored_matches"), "True", "{text}");
    assert_eq!(field(&text, "store"), "EACCES", "{text}");
    assert_eq!(field(&text, "query"), "ok", "{text}");
    assert_eq!(field(&text, "fuse_write"), "EACCES", "{text}");
    // Root's own session still works, and its region was never touched.
    let t = root
        .restore(&[(
            kvfs::geometry::GroupKey::new(0, 1, 0, kvfs::geometry::Kind::K),
            root_region,
            0,
        )])
        .unwrap();
    root.wait(t, None).unwrap();
    assert_eq!(fs::read(&roots).unwrap(), pattern(41, GB));
    assert_eq!(
        fs::read(m.p("L0/B2/H0/K")).unwrap(),
        vec![0u8; GB],
        "the refused STORE changed nothing"
    );
}

#[test]
fn without_allow_other_a_second_user_cannot_reach_the_mount() {
    let Some((uid, gid)) = mountable_second_user() else {
        return;
    };
    let m = Mount::new(&[]);
    fs::set_permissions(m.mp.parent().unwrap(), fs::Permissions::from_mode(0o755)).ok();
    let ctl = m.p(".kvfs/control");
    assert_eq!(fs::metadata(&ctl).unwrap().mode() & 0o777, 0o600);
    let out = Command::new("cat")
        .arg(m.p("L0/B0/H0/K"))
        .current_dir("/")
        .as_user(uid, gid)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "another user read a group of an owner-only mount"
    );
}

/// Puts /dev/fuse's mode back, and removes a user's mount left by a
/// failed check.
struct Restore {
    mode: u32,
    mp: std::path::PathBuf,
}

impl Drop for Restore {
    fn drop(&mut self) {
        fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(self.mode)).ok();
        if is_mounted(&self.mp) {
            let _ = Command::new("umount").arg("-l").arg(&self.mp).status();
        }
    }
}

#[test]
fn a_user_mounts_and_unmounts_a_store_of_their_own() {
    let Some((uid, gid)) = mountable_second_user() else {
        return;
    };
    let helper = [
        "/usr/bin/fusermount3",
        "/bin/fusermount3",
        "/usr/bin/fusermount",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists());
    if !helper {
        eprintln!("skipped: no fusermount3 (fuse3) for a user's mount");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.path().join("kvfs");
    fs::copy(env!("CARGO_BIN_EXE_kvfs"), &bin).unwrap();
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
    let home = dir.path().join("home");
    let mp = home.join("m");
    fs::create_dir_all(&mp).unwrap();
    for p in [&home, &mp] {
        std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
    }
    let backing = home.join("b");
    let geo = geometry(2, 8);
    let run = |args: &[&str]| {
        Command::new(&bin)
            .args(args)
            .env("HOME", &home)
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .current_dir("/")
            .as_user(uid, gid)
            .output()
            .unwrap()
    };
    let (mps, bs) = (mp.to_str().unwrap(), backing.to_str().unwrap());
    let mut mount_args = vec!["mount", mps, "--backing", bs, "--t1", "1MiB"];
    mount_args.extend(geo.iter().map(String::as_str));
    let shell = |script: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .current_dir("/")
            .as_user(uid, gid)
            .output()
            .unwrap()
    };
    let mode = fs::metadata("/dev/fuse").unwrap().mode() & 0o7777;
    let _restore = Restore {
        mode,
        mp: mp.clone(),
    };
    // /dev/fuse closed to users: a clear refusal, nothing mounted.
    fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(0o600)).unwrap();
    let out = run(&mount_args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "mounted without /dev/fuse access");
    assert!(err.contains("/dev/fuse is not open to this user"), "{err}");
    assert!(!is_mounted(&mp));
    // Open to users (the usual 0666): mounted and unmounted through
    // fusermount3, as the user.
    fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(0o666)).unwrap();
    let out = run(&mount_args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let group = mp.join("L0/B1/H0/K");
    let out = shell(&format!(
        "printf kvfs-user > {0} && sync {0}",
        group.display()
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["umount", mps]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!is_mounted(&mp));
    // Its daemon killed: `kvfs umount` (the user's) removes the dead mount.
    let out = run(&mount_args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = shell(&format!("cat {}", mp.join(".kvfs/pid").display()));
    kill_and_wait(String::from_utf8_lossy(&out.stdout).trim().parse().unwrap());
    let out = run(&["umount", mps]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("had died"), "{err}");
    assert!(!is_mounted(&mp));
    // The synced group is there after all of it.
    let out = run(&mount_args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = shell(&format!("head -c 9 {}", group.display()));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "kvfs-user");
    // Root's `kvfs umount` of it (FUSE keeps root out without
    // --allow-other): unmounted, and the daemon's own final flush keeps a
    // group written but never synced.
    let dirty = mp.join("L1/B2/H1/V");
    let out = shell(&format!("printf unsynced > {}", dirty.display()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = shell(&format!("cat {}", mp.join(".kvfs/pid").display()));
    let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let out = kvfs().arg("umount").arg(&mp).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains("another user's mount"),
        "{err}"
    );
    assert!(!is_mounted(&mp));
    let t = std::time::Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}")).exists()
        && t.elapsed() < std::time::Duration::from_secs(20)
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = run(&mount_args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = shell(&format!("head -c 8 {}", dirty.display()));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "unsynced");
    let out = run(&["umount", mps]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
