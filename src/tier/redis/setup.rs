//! What `connect` asks a server before trusting it with groups.
//!
//! Cluster or not (`INFO cluster`), the masters and their slots (`CLUSTER
//! SLOTS`), whether a master may evict keys (`maxmemory-policy`: an
//! evicted group would read as lost, so an evicting policy is refused
//! unless allowed) and whether it persists anything (`appendonly`, `save`:
//! if not, a server restart loses every group, which is worth a warning,
//! not a refusal). Managed servers often refuse `CONFIG`; then kvfs cannot
//! tell, says so in a warning, and goes on.

use redis::{Connection, RedisError, Value};

/// `field:value` out of an `INFO` reply.
pub(super) fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines().find_map(|l| {
        let (k, v) = l.trim_end().split_once(':')?;
        (k == field).then_some(v)
    })
}

pub(super) fn info(con: &mut Connection, section: &str) -> Result<String, RedisError> {
    redis::cmd("INFO").arg(section).query(con)
}

/// A textual reply value, where it is one.
pub(super) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::Okay => Some("OK".into()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

/// `CONFIG GET name`'s value (RESP2 array or RESP3 map); `None` if the
/// server does not know the parameter.
pub(super) fn config_get(con: &mut Connection, name: &str) -> Result<Option<String>, RedisError> {
    let v: Value = redis::cmd("CONFIG").arg("GET").arg(name).query(con)?;
    let pairs: Vec<(Value, Value)> = match v {
        Value::Array(items) => {
            let mut it = items.into_iter();
            let mut out = Vec::new();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                out.push((k, v));
            }
            out
        }
        Value::Map(m) => m,
        _ => Vec::new(),
    };
    Ok(pairs
        .iter()
        .find(|(k, _)| text(k).is_some_and(|k| k.eq_ignore_ascii_case(name)))
        .and_then(|(_, v)| text(v)))
}

/// Checks one master's eviction policy and persistence, adding warnings.
pub(super) fn check_master(
    con: &mut Connection,
    addr: &str,
    allow_evict: bool,
    warnings: &mut Vec<String>,
) -> Result<(), String> {
    match config_get(con, "maxmemory-policy") {
        Ok(Some(policy)) => {
            let evicts = policy.starts_with("allkeys-") || policy.starts_with("volatile-");
            if evicts && !allow_evict {
                return Err(format!(
                    "redis at {addr} evicts keys under memory pressure (maxmemory-policy {policy}): \
                     a group kvfs wrote could vanish; set maxmemory-policy noeviction, or pass \
                     --remote-allow-evict to accept that such groups read as EIO"
                ));
            }
            if evicts {
                warnings.push(format!(
                    "redis at {addr} evicts keys under memory pressure (maxmemory-policy {policy}): \
                     evicted groups will read as EIO"
                ));
            }
        }
        Ok(None) => warnings.push(format!(
            "redis at {addr} did not report maxmemory-policy: kvfs cannot tell whether it evicts keys"
        )),
        Err(e) => warnings.push(format!(
            "redis at {addr} refused CONFIG GET maxmemory-policy ({e}): kvfs cannot tell whether it evicts keys"
        )),
    }
    let aof = config_get(con, "appendonly");
    let save = config_get(con, "save");
    match (aof, save) {
        (Ok(aof), Ok(save)) => {
            let aof_on = aof.as_deref().is_some_and(|a| a.eq_ignore_ascii_case("yes"));
            let snapshots = save.as_deref().is_some_and(|s| !s.trim().is_empty());
            if !aof_on && !snapshots {
                warnings.push(format!(
                    "redis at {addr} persists nothing (appendonly no, save \"\"): a server restart \
                     loses every group kvfs wrote there"
                ));
            } else if aof_on
                && let Ok(Some(fsync)) = config_get(con, "appendfsync")
                && !fsync.eq_ignore_ascii_case("always")
            {
                // Not a warning: everysec is the usual, sane setting; the
                // note is for `describe` readers who expect fsync-on-sync.
                tracing::debug!("redis at {addr}: appendfsync {fsync}");
            }
        }
        (Err(e), _) | (_, Err(e)) => warnings.push(format!(
            "redis at {addr} refused CONFIG GET of its persistence settings ({e}): kvfs cannot tell what survives a restart"
        )),
    }
    Ok(())
}

/// A master's slot range from `CLUSTER SLOTS`.
pub(super) struct SlotRange {
    pub(super) start: u16,
    pub(super) end: u16,
    pub(super) host: String,
    pub(super) port: u16,
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        other => text(other)?.parse().ok(),
    }
}

/// Parses a `CLUSTER SLOTS` reply; a master announced with an empty or
/// `?` host is at `default_host` (the node that answered).
pub(super) fn parse_cluster_slots(v: &Value, default_host: &str) -> Result<Vec<SlotRange>, String> {
    let Value::Array(ranges) = v else {
        return Err(format!("CLUSTER SLOTS replied {v:?}"));
    };
    let mut out = Vec::with_capacity(ranges.len());
    for r in ranges {
        let bad = || format!("CLUSTER SLOTS entry {r:?} is malformed");
        let Value::Array(f) = r else {
            return Err(bad());
        };
        let (Some(start), Some(end), Some(Value::Array(master))) =
            (f.first().and_then(int), f.get(1).and_then(int), f.get(2))
        else {
            return Err(bad());
        };
        let host = master.first().and_then(text).ok_or_else(bad)?;
        let port = master.get(1).and_then(int).ok_or_else(bad)?;
        let host = if host.is_empty() || host == "?" {
            default_host.to_string()
        } else {
            host
        };
        let (Ok(start), Ok(end), Ok(port)) = (
            u16::try_from(start),
            u16::try_from(end),
            u16::try_from(port),
        ) else {
            return Err(bad());
        };
        out.push(SlotRange {
            start,
            end,
            host,
            port,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_fields() {
        let i = "# Cluster\r\ncluster_enabled:1\r\n";
        assert_eq!(info_field(i, "cluster_enabled"), Some("1"));
        assert_eq!(info_field(i, "nope"), None);
    }

    #[test]
    fn cluster_slots_parse() {
        let b = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let v = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(5460),
            Value::Array(vec![b(""), Value::Int(7000), b("id")]),
        ])]);
        let r = parse_cluster_slots(&v, "10.0.0.1").unwrap();
        assert_eq!((r[0].start, r[0].end, r[0].port), (0, 5460, 7000));
        assert_eq!(r[0].host, "10.0.0.1");
        assert!(parse_cluster_slots(&Value::Int(3), "h").is_err());
    }
}
