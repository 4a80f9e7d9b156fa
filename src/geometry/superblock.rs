//! The superblock: the first and only fixed-format record of a backing store.
//!
//! 4096 bytes (one aligned block, so it is written atomically on every device
//! we care about), little-endian: magic, format version, the geometry, the
//! store's identity (a random uuid: it names the store's keys in a remote
//! server) and where its group bytes live (the local data file or a remote
//! server), and a crc32c over everything before the checksum. Decoding
//! never panics: any damage gives a `SuperblockError` that says what is
//! wrong. A version-2 superblock (no uuid, bytes always local) still
//! decodes, with a zero uuid; the store upgrades it on open.

use super::{Dtype, GroupLayout};

pub const SUPERBLOCK_BYTES: usize = 4096;
const MAGIC: &[u8; 8] = b"KVFSSB\0\x01";
/// Bumped on any change to the on-disk format (superblock, data or metadata).
/// 2: two copies of every group in the data file (crash-safe write-back).
/// 3: the store's uuid and where its group bytes live.
pub const FORMAT_VERSION: u32 = 3;
/// The oldest version still read (upgraded on open).
const OLDEST_VERSION: u32 = 2;
/// Bytes covered by the checksum: magic..head_dim..dtype..stride, the uuid
/// and the location, then the crc follows (version 2: up to the stride).
const BODY: usize = 80;
const BODY_V2: usize = 48;

/// Where a store's group bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// The `data` file of the backing directory (tiers `uring`, `file`).
    Local,
    /// A remote server or cluster (tier `redis`); the directory keeps the
    /// superblock and the per-group metadata.
    Remote,
}

/// What a superblock records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub layout: GroupLayout,
    /// All zero only in a version-2 superblock not yet upgraded.
    pub uuid: [u8; 16],
    pub location: Location,
}

impl Superblock {
    /// The uuid as 32 lowercase hex digits (how remote keys name the store).
    pub fn uuid_hex(&self) -> String {
        self.uuid.iter().map(|b| format!("{b:02x}")).collect()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SuperblockError {
    #[error("superblock is {0} bytes, expected {SUPERBLOCK_BYTES} (truncated or not a kvfs store)")]
    Size(usize),
    #[error("not a kvfs superblock (bad magic number)")]
    Magic,
    #[error(
        "superblock checksum mismatch (stored {stored:08x}, computed {computed:08x}): the superblock is damaged"
    )]
    Checksum { stored: u32, computed: u32 },
    #[error(
        "store format version {0} is not supported (this kvfs reads version {FORMAT_VERSION}); the store was made by another kvfs release: move its directory aside to start a new one"
    )]
    Version(u32),
    #[error("superblock holds an invalid geometry: {0}")]
    Geometry(String),
}

pub fn encode_superblock(sb: &Superblock) -> Vec<u8> {
    let layout = &sb.layout;
    let mut b = vec![0u8; SUPERBLOCK_BYTES];
    b[0..8].copy_from_slice(MAGIC);
    b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&layout.layers.to_le_bytes());
    b[16..24].copy_from_slice(&layout.blocks.to_le_bytes());
    b[24..28].copy_from_slice(&layout.kv_heads.to_le_bytes());
    b[28..32].copy_from_slice(&layout.block_tokens.to_le_bytes());
    b[32..36].copy_from_slice(&layout.head_dim.to_le_bytes());
    b[36] = layout.dtype.code();
    b[40..48].copy_from_slice(&layout.stride().to_le_bytes());
    b[48..64].copy_from_slice(&sb.uuid);
    b[64] = match sb.location {
        Location::Local => 0,
        Location::Remote => 1,
    };
    let crc = crc32c::crc32c(&b[..BODY]);
    b[BODY..BODY + 4].copy_from_slice(&crc.to_le_bytes());
    b
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

pub fn decode_superblock(b: &[u8]) -> Result<Superblock, SuperblockError> {
    if b.len() != SUPERBLOCK_BYTES {
        return Err(SuperblockError::Size(b.len()));
    }
    if &b[0..8] != MAGIC {
        return Err(SuperblockError::Magic);
    }
    // The version says how much the checksum covers; it counts only once
    // the checksum holds.
    let version = u32_at(b, 8);
    let body = if version == OLDEST_VERSION {
        BODY_V2
    } else {
        BODY
    };
    let stored = u32_at(b, body);
    let computed = crc32c::crc32c(&b[..body]);
    if stored != computed {
        return Err(SuperblockError::Checksum { stored, computed });
    }
    if !(OLDEST_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(SuperblockError::Version(version));
    }
    let dtype = Dtype::from_code(b[36])
        .ok_or_else(|| SuperblockError::Geometry(format!("unknown dtype code {}", b[36])))?;
    let layout = GroupLayout::new(
        u32_at(b, 12),
        u64_at(b, 16),
        u32_at(b, 24),
        u32_at(b, 28),
        u32_at(b, 32),
        dtype,
    )
    .map_err(|e| SuperblockError::Geometry(e.to_string()))?;
    let stride = u64_at(b, 40);
    if stride != layout.stride() {
        return Err(SuperblockError::Geometry(format!(
            "stride {stride} does not match the geometry's {}",
            layout.stride()
        )));
    }
    if version == OLDEST_VERSION {
        return Ok(Superblock {
            layout,
            uuid: [0; 16],
            location: Location::Local,
        });
    }
    let location = match b[64] {
        0 => Location::Local,
        1 => Location::Remote,
        x => {
            return Err(SuperblockError::Geometry(format!(
                "unknown data location code {x}"
            )));
        }
    };
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&b[48..64]);
    Ok(Superblock {
        layout,
        uuid,
        location,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sb(l: GroupLayout) -> Superblock {
        Superblock {
            layout: l,
            uuid: *b"0123456789abcdef",
            location: Location::Remote,
        }
    }

    #[test]
    fn round_trip() {
        let l = GroupLayout::preset("llama-3.1-70b", 31250, 16).unwrap();
        let s = sb(l);
        assert_eq!(decode_superblock(&encode_superblock(&s)).unwrap(), s);
        assert_eq!(s.uuid_hex(), "30313233343536373839616263646566");
    }

    #[test]
    fn version_2_still_reads_as_a_local_store_without_uuid() {
        let l = GroupLayout::preset("qwen2.5-7b", 10, 16).unwrap();
        let mut b = encode_superblock(&sb(l));
        b[8..12].copy_from_slice(&2u32.to_le_bytes());
        b[48..].fill(0);
        let crc = crc32c::crc32c(&b[..BODY_V2]);
        b[BODY_V2..BODY_V2 + 4].copy_from_slice(&crc.to_le_bytes());
        let got = decode_superblock(&b).unwrap();
        assert_eq!(got.layout, l);
        assert_eq!(got.uuid, [0; 16]);
        assert_eq!(got.location, Location::Local);
        b[8..12].copy_from_slice(&9u32.to_le_bytes());
        let crc = crc32c::crc32c(&b[..BODY]);
        b[BODY..BODY + 4].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode_superblock(&b), Err(SuperblockError::Version(9)));
    }

    #[test]
    fn damage_is_reported() {
        let l = GroupLayout::preset("qwen2.5-7b", 10, 16).unwrap();
        let good = encode_superblock(&sb(l));
        let mut b = good.clone();
        b[13] ^= 1;
        assert!(matches!(
            decode_superblock(&b),
            Err(SuperblockError::Checksum { .. })
        ));
        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(decode_superblock(&b), Err(SuperblockError::Magic));
        assert_eq!(
            decode_superblock(&good[..100]),
            Err(SuperblockError::Size(100))
        );
    }

    proptest! {
        #[test]
        fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..5000), flip in any::<usize>()) {
            let _ = decode_superblock(&bytes);
            let l = GroupLayout::preset("llama-3.1-8b", 7, 16).unwrap();
            let mut b = encode_superblock(&sb(l));
            let i = flip % b.len();
            b[i] ^= 0x5a;
            let r = decode_superblock(&b);
            if i < BODY + 4 { prop_assert!(r.is_err()); } else { prop_assert_eq!(r.unwrap(), sb(l)); }
        }
    }
}
