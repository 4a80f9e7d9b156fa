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
