//! The superblock: the first and only fixed-format record of a backing store.
//!
//! 4096 bytes (one aligned block, so it is written atomically on every device
//! we care about), little-endian: magic, format version, the geometry, and a
//! crc32c over everything before the checksum. Decoding never panics: any
//! damage gives a `SuperblockError` that says what is wrong.

use super::{Dtype, GroupLayout};

pub const SUPERBLOCK_BYTES: usize = 4096;
const MAGIC: &[u8; 8] = b"KVFSSB\0\x01";
/// Bumped on any change to the on-disk format (superblock, data or metadata).
/// 2: two copies of every group in the data file (crash-safe write-back).
pub const FORMAT_VERSION: u32 = 2;
/// Bytes covered by the checksum: magic..head_dim..dtype, then the crc follows.
const BODY: usize = 48;

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

pub fn encode_superblock(layout: &GroupLayout) -> Vec<u8> {
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

pub fn decode_superblock(b: &[u8]) -> Result<GroupLayout, SuperblockError> {
    if b.len() != SUPERBLOCK_BYTES {
        return Err(SuperblockError::Size(b.len()));
    }
    if &b[0..8] != MAGIC {
        return Err(SuperblockError::Magic);
    }
    let stored = u32_at(b, BODY);
    let computed = crc32c::crc32c(&b[..BODY]);
    if stored != computed {
        return Err(SuperblockError::Checksum { stored, computed });
    }
    let version = u32_at(b, 8);
    if version != FORMAT_VERSION {
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
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let l = GroupLayout::preset("llama-3.1-70b", 31250, 16).unwrap();
        assert_eq!(decode_superblock(&encode_superblock(&l)).unwrap(), l);
    }

    #[test]
    fn damage_is_reported() {
        let l = GroupLayout::preset("qwen2.5-7b", 10, 16).unwrap();
        let good = encode_superblock(&l);
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
            let mut b = encode_superblock(&l);
            let i = flip % b.len();
            b[i] ^= 0x5a;
            let r = decode_superblock(&b);
            if i < BODY + 4 { prop_assert!(r.is_err()); } else { prop_assert_eq!(r.unwrap(), l); }
        }
    }
}
