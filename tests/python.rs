//! Runs the Python client's tests (tools/test_kvfs_client.py) against a real mount.

mod common;
use common::*;

#[test]
fn python_client() {
    if !can_mount() {
        return;
    }
    if std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: python3 is not installed");
        return;
    }
    let m = Mount::new(&[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tools/test_kvfs_client.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .env("KVFS_MOUNT", &m.mp)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "python client tests failed:\n{text}");
    assert!(text.contains("OK"), "{text}");
}
