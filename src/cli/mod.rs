//! The daemon's side of the command line (mount, unmount, stat, sync);
//! `main.rs` holds the argument parsing and the other commands.

pub mod mount;
pub mod running;
mod system;

/// `e` and its causes, joined by ": " as `{e:#}` does, leaving out a cause
/// whose text its outer message already ends with (errors that print their
/// source and also name it as their source would otherwise say it twice).
pub fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[test]
    fn a_cause_the_message_already_gives_is_said_once() {
        let io = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let text = io.to_string();
        let e = kvfs::cascade::StoreError::Io {
            path: "/b/meta".into(),
            what: "cannot reserve",
            source: io,
        };
        let e = anyhow::Error::new(e);
        assert_eq!(error_chain(&e), format!("/b/meta: cannot reserve: {text}"));
        let e = e.context("mounting /m");
        assert_eq!(
            error_chain(&e),
            format!("mounting /m: /b/meta: cannot reserve: {text}")
        );
        let e = anyhow::anyhow!("outer").context("top");
        assert_eq!(error_chain(&e), "top: outer");
    }
}
