//! The `kvfs` binary: help, errors, and a tiny backing bench.

use std::process::Command;

fn kvfs() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvfs"))
}

#[test]
fn help_explains_commands() {
    let out = kvfs().arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("bench"), "{text}");
    let out = kvfs()
        .args(["bench", "backing", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("--qd") && text.contains("--group-size"),
        "{text}"
    );
}

/// Every environment variable the daemon reads is listed in `kvfs mount
/// --help` (found by reading the sources for `env::var("KVFS_…")`), but
/// the crash bench's own test machinery.
#[test]
fn mount_help_lists_every_environment_variable() {
    let out = kvfs().args(["mount", "--help"]).output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    let mut names = Vec::new();
    let mut dirs = vec![std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                for part in text.split("env::var(\"").skip(1) {
                    let name: String = part.chars().take_while(|&c| c != '"').collect();
                    if name.starts_with("KVFS_") && name != "KVFS_CRASH_SHADOW" {
                        names.push(name);
                    }
                }
            }
        }
    }
    assert!(names.len() >= 9, "the sources' variables: {names:?}");
    for n in &names {
        assert!(
            help.contains(n.as_str()),
            "{n} is missing from kvfs mount --help:\n{help}"
        );
    }
}

#[test]
fn bad_arguments_are_clear_errors() {
    let out = kvfs()
        .args(["bench", "backing", "--dir", "/tmp", "--group-size", "12XB"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown unit"));
    let out = kvfs()
        .args(["bench", "backing", "--dir", "/tmp", "--group-size", "1000"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("multiple of 4096"));
    let out = kvfs()
        .args(["bench", "backing", "--dir", "/tmp", "--tier", "floppy"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected uring, file or redis"));
    // FUSE threads: 0 would serve nothing, and each holds a /dev/fuse fd.
    for n in ["0", "1025"] {
        let out = kvfs()
            .args(["mount", "/nonexistent-kvfs-mp", "--threads", n])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("1..=1024"),
            "{n}: {err}"
        );
    }
}

#[test]
fn tiny_backing_bench_prints_figure_and_baseline() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    for tier in ["uring", "file"] {
        let out = kvfs()
            .args([
                "bench",
                "backing",
                "--tier",
                tier,
                "--qd",
                "4",
                "--seconds",
                "0.3",
            ])
            .args(["--rounds", "1", "--file-size", "8MiB", "--dir"])
            .arg(dir.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("mean     kvfs"), "{text}");
        let fio = Command::new("fio").arg("--version").output().is_ok();
        if fio {
            assert!(text.contains("ratio kvfs/fio:"), "{text}");
        } else {
            eprintln!("fio not installed: the baseline half was skipped");
        }
    }
}
