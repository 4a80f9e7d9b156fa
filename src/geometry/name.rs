//! Canonical group names: `L{layer}/B{block}/H{head}/{K|V}`, plain decimal.
//!
//! Only the canonical spelling parses, so every group has exactly one name
//! (no `L03`, no `+3`, no `l3`, no trailing slash): the filesystem can then
//! map a name to an inode and back without any table.

use super::{GroupKey, Kind};

/// Why a name was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("empty name")]
    Empty,
    #[error("component {0:?} should be {1} followed by a decimal number")]
    BadPrefix(String, char),
    #[error("component {0:?}: the number must be plain decimal without leading zeros or signs")]
    NotCanonical(String),
    #[error("component {0:?}: the number is too large")]
    TooLarge(String),
    #[error("last component {0:?} must be K or V")]
    BadKind(String),
    #[error("name {0:?} has an empty component (a leading, trailing or doubled '/')")]
    EmptyComponent(String),
    #[error("name {0:?} has more than four components (L/B/H/K|V)")]
    TooDeep(String),
    #[error("name {0:?} is not a complete group name (L{{layer}}/B{{block}}/H{{head}}/{{K|V}})")]
    Incomplete(String),
}

/// A path inside the group tree, possibly a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParsedPath {
    Root,
    Layer(u32),
    Block(u32, u64),
    Head(u32, u64, u32),
    Group(GroupKey),
}

/// Parses one numbered component such as `L12`.
pub(crate) fn parse_component(comp: &str, prefix: char) -> Result<u64, NameError> {
    let digits = comp
        .strip_prefix(prefix)
        .ok_or_else(|| NameError::BadPrefix(comp.to_string(), prefix))?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(NameError::BadPrefix(comp.to_string(), prefix));
    }
    if digits.len() > 1 && digits.starts_with('0') {
        return Err(NameError::NotCanonical(comp.to_string()));
    }
    digits
        .parse::<u64>()
        .map_err(|_| NameError::TooLarge(comp.to_string()))
}

fn parse_u32_component(comp: &str, prefix: char) -> Result<u32, NameError> {
    let v = parse_component(comp, prefix)?;
    u32::try_from(v).map_err(|_| NameError::TooLarge(comp.to_string()))
}

/// Parses the kind component.
pub(crate) fn parse_kind(comp: &str) -> Result<Kind, NameError> {
    match comp {
        "K" => Ok(Kind::K),
        "V" => Ok(Kind::V),
        _ => Err(NameError::BadKind(comp.to_string())),
    }
}

/// Parses a path relative to the tree root (`""`, `L3`, `L3/B17`, ... `L3/B17/H0/K`).
/// Range checks against a layout are the caller's (`GroupLayout::check`).
pub fn parse_path(path: &str) -> Result<ParsedPath, NameError> {
    if path.is_empty() {
        return Ok(ParsedPath::Root);
    }
    let comps: Vec<&str> = path.split('/').collect();
    if comps.iter().any(|c| c.is_empty()) {
        return Err(NameError::EmptyComponent(path.to_string()));
    }
    if comps.len() > 4 {
        return Err(NameError::TooDeep(path.to_string()));
    }
    let layer = parse_u32_component(comps[0], 'L')?;
    if comps.len() == 1 {
        return Ok(ParsedPath::Layer(layer));
    }
    let block = parse_component(comps[1], 'B')?;
    if comps.len() == 2 {
        return Ok(ParsedPath::Block(layer, block));
    }
    let head = parse_u32_component(comps[2], 'H')?;
    if comps.len() == 3 {
        return Ok(ParsedPath::Head(layer, block, head));
    }
    let kind = parse_kind(comps[3])?;
    Ok(ParsedPath::Group(GroupKey::new(layer, block, head, kind)))
}

/// Parses a complete canonical group name.
pub fn parse_group_name(name: &str) -> Result<GroupKey, NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    match parse_path(name)? {
        ParsedPath::Group(k) => Ok(k),
        _ => Err(NameError::Incomplete(name.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_names_parse() {
        assert_eq!(
            parse_group_name("L3/B17/H0/K").unwrap(),
            GroupKey::new(3, 17, 0, Kind::K)
        );
        assert_eq!(
            parse_group_name("L0/B0/H7/V").unwrap(),
            GroupKey::new(0, 0, 7, Kind::V)
        );
        assert_eq!(parse_path("L3/B17").unwrap(), ParsedPath::Block(3, 17));
        assert_eq!(parse_path("").unwrap(), ParsedPath::Root);
    }

    #[test]
    fn non_canonical_names_are_rejected_with_a_reason() {
        let cases = [
            ("", "empty name"),
            ("L03/B17/H0/K", "leading zeros"),
            ("l3/B17/H0/K", "should be L"),
            ("L3/B17/H0/k", "must be K or V"),
            ("L3/B17/H0/K/", "empty component"),
            ("/L3/B17/H0/K", "empty component"),
            ("L3/B17/H0/K/X", "more than four"),
            ("L3/B17/H0", "not a complete group name"),
            ("L+3/B17/H0/K", "should be L"),
            ("L3/B 17/H0/K", "should be B"),
            ("L99999999999/B0/H0/K", "too large"),
            ("L3/B99999999999999999999999/H0/K", "too large"),
            ("L3//H0/K", "empty component"),
        ];
        for (name, why) in cases {
            let e = parse_group_name(name).unwrap_err().to_string();
            assert!(e.contains(why), "{name:?}: {e:?} should mention {why:?}");
        }
    }
}
