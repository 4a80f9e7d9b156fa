//! Runs the Python package's tests (tools/python/tests: the client against
//! a real mount, and the package itself) with the package from the source
//! tree (PYTHONPATH=tools/python).

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
    let root = env!("CARGO_MANIFEST_DIR");
    let out = std::process::Command::new("python3")
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(format!("{root}/tools/python/tests"))
        .current_dir(root)
        .env("PYTHONPATH", format!("{root}/tools/python"))
        // No __pycache__ in the source tree.
        .env("PYTHONDONTWRITEBYTECODE", "1")
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
    assert!(text.lines().any(|l| l.starts_with("OK")), "{text}");
    // The mount tests ran: none skipped (KVFS_MOUNT unset would skip them),
    // and both transports' classes passed.
    let client = |l: &&str| l.contains("(test_client.");
    let skipped: Vec<&str> = text
        .lines()
        .filter(client)
        .filter(|l| l.contains(" ... skipped"))
        .collect();
    assert!(skipped.is_empty(), "mount tests skipped: {skipped:?}");
    for class in ["test_client.ClientTest", "test_client.WriteReadTest"] {
        let ran = text
            .lines()
            .filter(|l| l.contains(class) && l.ends_with(" ... ok"))
            .count();
        assert!(ran >= 8, "only {ran} tests of {class} passed:\n{text}");
    }
    assert!(
        text.lines()
            .any(|l| l.contains("(test_package.") && l.ends_with(" ... ok")),
        "the package tests did not run:\n{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("(test_layouts.MountedLayoutTest.") && l.ends_with(" ... ok")),
        "the engine-layout tests did not run against the mount:\n{text}"
    );
}
