//! Fuzzes the group-name parser (`parse_path`, `parse_group_name`,
//! `name_component`) on arbitrary UTF-8: no panic, and since only the
//! canonical spelling parses, anything accepted formats back to exactly
//! the input (`GroupKey`'s `Display` for a group), and the parsers agree.
#![no_main]

use kvfs::geometry::{ParsedPath, name_component, parse_group_name, parse_path};
use libfuzzer_sys::fuzz_target;

/// The one spelling of a parsed path.
fn format_path(p: &ParsedPath) -> String {
    match p {
        ParsedPath::Root => String::new(),
        ParsedPath::Layer(l) => format!("L{l}"),
        ParsedPath::Block(l, b) => format!("L{l}/B{b}"),
        ParsedPath::Head(l, b, h) => format!("L{l}/B{b}/H{h}"),
        ParsedPath::Group(k) => k.to_string(),
    }
}

fn check(s: &str) {
    let path = parse_path(s);
    let group = parse_group_name(s);
    match &path {
        Ok(p) => {
            assert_eq!(format_path(p), s, "{p:?} does not format back");
            assert_eq!(parse_path(&format_path(p)).as_ref(), Ok(p));
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
    match (&path, &group) {
        (Ok(ParsedPath::Group(a)), Ok(b)) => {
            assert_eq!(a, b);
            assert_eq!(b.to_string(), s);
            assert_eq!(parse_group_name(&b.to_string()), Ok(*b));
        }
        (_, Ok(k)) => panic!("parse_group_name gave {k:?}, parse_path {path:?}"),
        (_, Err(e)) => {
            let _ = e.to_string();
        }
    }
    for prefix in ['L', 'B', 'H'] {
        for comp in s.split('/') {
            if let Some(v) = name_component(comp, prefix) {
                assert_eq!(format!("{prefix}{v}"), comp);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    match std::str::from_utf8(data) {
        Ok(s) => check(s),
        Err(_) => check(&String::from_utf8_lossy(data)),
    }
});
