//! What kvfs stores in Redis: one key per group copy, one framed value.
//!
//! Key: `kvfs:{<uuid>:<block>}:<layer>:<head>:<K|V>:<copy>`. The uuid keeps
//! stores that share a server apart; the hash tag `{uuid:block}` puts every
//! group of a block in one cluster slot, so a block's restore is one node's
//! pipeline. Value: a 32-byte little-endian header (magic `KVFG`, version,
//! reserved, tier index, generation, crc32c of the payload, payload length)
//! then the group's `group_bytes` bytes, never the stride padding. A value
//! is served only if every header field matches what the reader asked for
//! and the crc holds: a server that returns someone else's bytes, a
//! truncated value or a hand-edited key reads as corrupt, never as data.

use crate::geometry::{GroupIndex, GroupLayout};
use crate::tier::COPIES;
use redis::{RedisWrite, ToRedisArgs, ToSingleRedisArg};
use std::fmt::Write as _;
use std::io::Write as _;

pub(super) const MAGIC: [u8; 4] = *b"KVFG";
pub(super) const VERSION: u16 = 1;
/// Header bytes: 4 magic + 2 version + 2 reserved + 8 index + 8 generation
/// + 4 crc + 4 length; a multiple of 8 so the fields stay aligned.
pub(super) const HEADER_BYTES: usize = 32;

/// The store's namespace: its uuid as 32 lowercase hex digits.
pub(super) fn namespace(uuid: [u8; 16]) -> String {
    let mut s = String::with_capacity(32);
    for b in uuid {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The key of tier index `index` (a copy index: group × COPIES + copy).
/// The caller has checked `index` against the layout.
pub(super) fn group_key(
    ns: &str,
    layout: &GroupLayout,
    index: GroupIndex,
) -> Result<String, String> {
    let group = GroupIndex(index.0 / COPIES);
    let copy = index.0 % COPIES;
    let k = layout
        .key(group)
        .map_err(|e| format!("group {group} has no key: {e}"))?;
    Ok(format!(
        "kvfs:{{{ns}:{}}}:{}:{}:{}:{copy}",
        k.block,
        k.layer,
        k.head,
        k.kind.letter()
    ))
}

/// The key a node's sync write goes to: hash tag `{ns:sync:n}`, with `n`
/// picked so the key's slot is one the node owns.
pub(super) fn sync_key(ns: &str, n: u32) -> String {
    format!("kvfs:{{{ns}:sync:{n}}}")
}

/// A group's value as one SET argument, written straight into the
/// command buffer (header then payload) without an intermediate copy.
#[derive(Clone, Copy)]
pub(super) struct Framed<'a> {
    header: [u8; HEADER_BYTES],
    payload: &'a [u8],
}

impl<'a> Framed<'a> {
    pub(super) fn new(index: GroupIndex, generation: u64, payload: &'a [u8]) -> Framed<'a> {
        let mut h = [0u8; HEADER_BYTES];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&VERSION.to_le_bytes());
        // 6..8 reserved, zero.
        h[8..16].copy_from_slice(&index.0.to_le_bytes());
        h[16..24].copy_from_slice(&generation.to_le_bytes());
        h[24..28].copy_from_slice(&crc32c::crc32c(payload).to_le_bytes());
        h[28..32].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        Framed { header: h, payload }
    }
}

impl ToRedisArgs for Framed<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + RedisWrite,
    {
        let mut w = out.writer_for_next_arg();
        // Writing into the command's Vec cannot fail.
        let _ = w.write_all(&self.header);
        let _ = w.write_all(self.payload);
    }
}

impl ToSingleRedisArg for Framed<'_> {}

/// Checks a stored value against the op that asked for it and copies its
/// payload into `out[..payload]`, zeroing the rest of `out` (the stride
/// padding). Returns the stored generation. Any mismatch is a message.
pub(super) fn decode(
    index: GroupIndex,
    value: &[u8],
    out: &mut [u8],
    payload: usize,
) -> Result<u64, String> {
    if value.len() < HEADER_BYTES {
        return Err(format!(
            "value is {} bytes, shorter than its header",
            value.len()
        ));
    }
    let (h, body) = value.split_at(HEADER_BYTES);
    let u16_at = |o: usize| u16::from_le_bytes([h[o], h[o + 1]]);
    let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
    let u64_at = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[o..o + 8]);
        u64::from_le_bytes(b)
    };
    if h[0..4] != MAGIC {
        return Err(format!("bad magic {:02x?}", &h[0..4]));
    }
    if u16_at(4) != VERSION {
        return Err(format!("format version {} (expected {VERSION})", u16_at(4)));
    }
    if u64_at(8) != index.0 {
        return Err(format!("value is of tier index {}", u64_at(8)));
    }
    let len = u32_at(28) as usize;
    if len != payload || body.len() != payload {
        return Err(format!(
            "payload is {} bytes, header says {len}, group is {payload}",
            body.len()
        ));
    }
    if crc32c::crc32c(body) != u32_at(24) {
        return Err("payload fails its crc32c".into());
    }
    if out.len() < payload {
        return Err(format!(
            "buffer of {} bytes is smaller than the group",
            out.len()
        ));
    }
    out[..payload].copy_from_slice(body);
    out[payload..].fill(0);
    Ok(u64_at(16))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Dtype;

    #[test]
    fn keys_name_block_layer_head_kind_copy() {
        let l = GroupLayout::new(2, 8, 2, 16, 128, Dtype::Fp16).unwrap();
        let ns = namespace([0xab; 16]);
        assert_eq!(ns.len(), 32);
        let g = l
            .index(crate::geometry::GroupKey::new(
                1,
                5,
                1,
                crate::geometry::Kind::V,
            ))
            .unwrap();
        let k = group_key(&ns, &l, crate::tier::copy_index(g, 1)).unwrap();
        assert_eq!(k, format!("kvfs:{{{ns}:5}}:1:1:V:1"));
    }

    #[test]
    fn framed_round_trip_and_every_check() {
        let payload: Vec<u8> = (0..100u32).map(|i| i as u8).collect();
        let v = Framed::new(GroupIndex(7), 3, &payload).to_redis_args();
        assert_eq!(v.len(), 1);
        let v = &v[0];
        let mut out = vec![0xffu8; 128];
        assert_eq!(decode(GroupIndex(7), v, &mut out, 100), Ok(3));
        assert_eq!(&out[..100], &payload[..]);
        assert!(out[100..].iter().all(|&b| b == 0));
        assert!(decode(GroupIndex(8), v, &mut out, 100).is_err());
        assert!(decode(GroupIndex(7), v, &mut out, 99).is_err());
        assert!(decode(GroupIndex(7), &v[..50], &mut out, 100).is_err());
        for at in [0, 4, 40] {
            let mut bad = v.clone();
            bad[at] ^= 1;
            assert!(
                decode(GroupIndex(7), &bad, &mut out, 100).is_err(),
                "flip at {at}"
            );
        }
    }
}
