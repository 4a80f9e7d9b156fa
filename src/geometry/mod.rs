//! Geometry: the shape of a KV cache and the one bijection every tier shares.
//!
//! A `GroupLayout` is `layers × blocks × kv_heads × {K,V}` groups of
//! `block_tokens × head_dim × dtype_bytes` bytes each. A group is named by a
//! `GroupKey`, numbered by a dense `GroupIndex`, and stored at
//! `index × stride` in every backing file. The stride is the group size
//! rounded up to 4096 so O_DIRECT I/O is always aligned. Because the mapping
//! is arithmetic, nothing anywhere keeps a per-group table just to name a
//! group: a 40-million-group layout costs nothing until groups are used.
//!
//! Invariants (property-tested below): `key → index → key` and
//! `index → key → index` are identities over the whole layout, offsets are
//! distinct and stride-aligned, and `parse(name(key)) == key` while any
//! non-canonical spelling of a name is rejected with a reason.

mod name;
mod superblock;

pub use name::{NameError, ParsedPath, parse_group_name, parse_path};
pub use superblock::{
    Location, SUPERBLOCK_BYTES, Superblock, SuperblockError, decode_superblock, encode_superblock,
};

use std::fmt;

/// Parses one canonical numbered path component such as `L12` (`None` if
/// it is not canonical); the filesystem's lookups use it.
pub fn name_component(comp: &str, prefix: char) -> Option<u64> {
    name::parse_component(comp, prefix).ok()
}

/// Backing I/O alignment: O_DIRECT needs offsets, lengths and buffers aligned
/// to the logical block size; 4096 covers every device and page size we run on.
pub const IO_ALIGN: u64 = 4096;

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bf16,
    Fp16,
    Fp32,
    Fp8,
}

impl Dtype {
    pub const ALL: [Dtype; 4] = [Dtype::Bf16, Dtype::Fp16, Dtype::Fp32, Dtype::Fp8];

    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
            Dtype::Fp8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp32 => "fp32",
            Dtype::Fp8 => "fp8",
        }
    }

    /// Stable on-disk code (superblock).
    pub fn code(self) -> u8 {
        match self {
            Dtype::Bf16 => 1,
            Dtype::Fp16 => 2,
            Dtype::Fp32 => 3,
            Dtype::Fp8 => 4,
        }
    }

    pub fn from_code(code: u8) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.code() == code)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown dtype {s:?} (expected bf16, fp16, fp32 or fp8)"))
    }
}

/// Key or value half of an attention head's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    K,
    V,
}

impl Kind {
    pub fn letter(self) -> char {
        match self {
            Kind::K => 'K',
            Kind::V => 'V',
        }
    }
}

/// Names one group: `L{layer}/B{block}/H{head}/{K|V}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupKey {
    pub layer: u32,
    pub block: u64,
    pub head: u32,
    pub kind: Kind,
}

impl GroupKey {
    pub fn new(layer: u32, block: u64, head: u32, kind: Kind) -> GroupKey {
        GroupKey {
            layer,
            block,
            head,
            kind,
        }
    }
}

impl fmt::Display for GroupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "L{}/B{}/H{}/{}",
            self.layer,
            self.block,
            self.head,
            self.kind.letter()
        )
    }
}

/// Dense number of a group, `0..layout.group_count()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupIndex(pub u64);

impl fmt::Display for GroupIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A key that does not fit the layout, and which coordinate is at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {value} is out of range (the layout has {limit})")]
pub struct OutOfRange {
    pub what: &'static str,
    pub value: u64,
    pub limit: u64,
}

/// The fixed shape of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupLayout {
    pub layers: u32,
    pub blocks: u64,
    pub kv_heads: u32,
    pub block_tokens: u32,
    pub head_dim: u32,
    pub dtype: Dtype,
}

/// Default tokens per KV block, as in vLLM's paged attention.
pub const DEFAULT_BLOCK_TOKENS: u32 = 16;

/// Default block count for presets: 4096 blocks × 16 tokens = 64 Ki tokens of context.
pub const DEFAULT_PRESET_BLOCKS: u64 = 4096;

/// Model presets: (name, layers, kv_heads, head_dim, dtype).
pub const PRESETS: &[(&str, u32, u32, u32, Dtype)] = &[
    ("llama-3.1-8b", 32, 8, 128, Dtype::Bf16),
    ("llama-3.1-70b", 80, 8, 128, Dtype::Bf16),
    ("llama-3.1-405b", 126, 8, 128, Dtype::Bf16),
    ("qwen2.5-7b", 28, 4, 128, Dtype::Bf16),
    ("qwen2.5-72b", 80, 8, 128, Dtype::Bf16),
    ("mistral-7b", 32, 8, 128, Dtype::Bf16),
];

/// Why a layout was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    #[error("the layout has {0} groups; the most kvfs addresses is 2^48")]
    TooManyGroups(u128),
    #[error("a group would be {0} bytes; the most kvfs allows is 64 MiB")]
    GroupTooLarge(u128),
    #[error("unknown preset {0:?}; known presets: {1}")]
    UnknownPreset(String, String),
}

/// Most groups one layout may have: 2^48 keeps `index × stride` and inode
/// numbers (index + a small base) far from u64 overflow for any stride we allow.
pub const MAX_GROUPS: u64 = 1 << 48;

/// Largest group: 64 MiB, far above any real (block_tokens × head_dim × dtype)
/// and small enough that `MAX_GROUPS × stride` fits in u64.
pub const MAX_GROUP_BYTES: u64 = 64 << 20;

impl GroupLayout {
    /// Checks every field and the derived totals.
    pub fn new(
        layers: u32,
        blocks: u64,
        kv_heads: u32,
        block_tokens: u32,
        head_dim: u32,
        dtype: Dtype,
    ) -> Result<GroupLayout, LayoutError> {
        let l = GroupLayout {
            layers,
            blocks,
            kv_heads,
            block_tokens,
            head_dim,
            dtype,
        };
        l.validate()?;
        Ok(l)
    }

    pub fn validate(&self) -> Result<(), LayoutError> {
        for (what, v) in [
            ("layers", self.layers as u64),
            ("blocks", self.blocks),
            ("kv_heads", self.kv_heads as u64),
            ("block_tokens", self.block_tokens as u64),
            ("head_dim", self.head_dim as u64),
        ] {
            if v == 0 {
                return Err(LayoutError::Zero(what));
            }
        }
        // Checked: u32 × u64 × u32 × 2 can pass u128, and a wrapped
        // product could look small enough to accept.
        let groups = [self.blocks as u128, self.kv_heads as u128, 2]
            .into_iter()
            .try_fold(self.layers as u128, |a, b| a.checked_mul(b))
            .unwrap_or(u128::MAX);
        if groups > MAX_GROUPS as u128 {
            return Err(LayoutError::TooManyGroups(groups));
        }
        let gb = self.block_tokens as u128 * self.head_dim as u128 * self.dtype.bytes() as u128;
        if gb > MAX_GROUP_BYTES as u128 {
            return Err(LayoutError::GroupTooLarge(gb));
        }
        Ok(())
    }

    /// A model preset with `blocks` blocks of `block_tokens` tokens.
    pub fn preset(name: &str, blocks: u64, block_tokens: u32) -> Result<GroupLayout, LayoutError> {
        let &(_, layers, kv_heads, head_dim, dtype) =
            PRESETS.iter().find(|p| p.0 == name).ok_or_else(|| {
                LayoutError::UnknownPreset(
                    name.to_string(),
                    PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", "),
                )
            })?;
        GroupLayout::new(layers, blocks, kv_heads, block_tokens, head_dim, dtype)
    }

    /// Bytes of one group's payload.
    pub fn group_bytes(&self) -> u64 {
        self.block_tokens as u64 * self.head_dim as u64 * self.dtype.bytes()
    }

    /// Distance between consecutive groups in a backing file: the group size
    /// rounded up to `IO_ALIGN`.
    pub fn stride(&self) -> u64 {
        self.group_bytes().div_ceil(IO_ALIGN) * IO_ALIGN
    }

    pub fn group_count(&self) -> u64 {
        self.layers as u64 * self.blocks * self.kv_heads as u64 * 2
    }

    /// Bytes a fully written backing data file spans.
    pub fn backing_bytes(&self) -> u64 {
        self.group_count() * self.stride()
    }

    pub fn check(&self, key: GroupKey) -> Result<(), OutOfRange> {
        if key.layer >= self.layers {
            return Err(OutOfRange {
                what: "layer",
                value: key.layer as u64,
                limit: self.layers as u64,
            });
        }
        if key.block >= self.blocks {
            return Err(OutOfRange {
                what: "block",
                value: key.block,
                limit: self.blocks,
            });
        }
        if key.head >= self.kv_heads {
            return Err(OutOfRange {
                what: "head",
                value: key.head as u64,
                limit: self.kv_heads as u64,
            });
        }
        Ok(())
    }

    /// Key → dense index; order is layer-major, then block, head, K before V.
    pub fn index(&self, key: GroupKey) -> Result<GroupIndex, OutOfRange> {
        self.check(key)?;
        let kind = match key.kind {
            Kind::K => 0,
            Kind::V => 1,
        };
        let i = ((key.layer as u64 * self.blocks + key.block) * self.kv_heads as u64
            + key.head as u64)
            * 2
            + kind;
        Ok(GroupIndex(i))
    }

    /// Dense index → key.
    pub fn key(&self, index: GroupIndex) -> Result<GroupKey, OutOfRange> {
        if index.0 >= self.group_count() {
            return Err(OutOfRange {
                what: "group index",
                value: index.0,
                limit: self.group_count(),
            });
        }
        let mut i = index.0;
        let kind = if i.is_multiple_of(2) {
            Kind::K
        } else {
            Kind::V
        };
        i /= 2;
        let head = (i % self.kv_heads as u64) as u32;
        i /= self.kv_heads as u64;
        let block = i % self.blocks;
        let layer = (i / self.blocks) as u32;
        Ok(GroupKey {
            layer,
            block,
            head,
            kind,
        })
    }

    /// Byte offset of a group in a backing data file.
    pub fn offset(&self, index: GroupIndex) -> u64 {
        index.0 * self.stride()
    }

    /// Short one-line description, used in messages that compare layouts.
    pub fn describe(&self) -> String {
        format!(
            "{} layers × {} blocks × {} kv heads × {} tokens × head_dim {} × {} ({} B/group, {} groups)",
            self.layers,
            self.blocks,
            self.kv_heads,
            self.block_tokens,
            self.head_dim,
            self.dtype,
            self.group_bytes(),
            self.group_count()
        )
    }
}

impl fmt::Display for GroupLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// Parses a size such as `64MiB`, `1GiB`, `4G`, `16k` or plain bytes.
/// Binary multiples throughout (`4G` = 4 GiB), as storage users expect.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!(
            "size {s:?} must start with a number (e.g. 64MiB, 4G, 4096)"
        ));
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("size {s:?}: {num:?} is not a whole number"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => {
            return Err(format!(
                "size {s:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, TiB or k, M, G, T)"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout_strategy() -> impl Strategy<Value = GroupLayout> {
        (
            1u32..100,
            1u64..5000,
            1u32..17,
            1u32..64,
            1u32..300,
            0usize..4,
        )
            .prop_map(|(layers, blocks, kv_heads, bt, hd, d)| {
                GroupLayout::new(layers, blocks, kv_heads, bt, hd, Dtype::ALL[d]).unwrap()
            })
    }

    proptest! {
        #[test]
        fn index_key_bijection(layout in layout_strategy(), r in any::<u64>()) {
            let idx = GroupIndex(r % layout.group_count());
            let key = layout.key(idx).unwrap();
            prop_assert_eq!(layout.index(key).unwrap(), idx);
            prop_assert_eq!(layout.offset(idx) % IO_ALIGN, 0);
            prop_assert!(layout.stride() >= layout.group_bytes());
            // parse(name(key)) == key
            let name = key.to_string();
            prop_assert_eq!(parse_group_name(&name).unwrap(), key);
        }

        #[test]
        fn key_index_bijection(layout in layout_strategy(), l in any::<u32>(), b in any::<u64>(), h in any::<u32>(), v in any::<bool>()) {
            let key = GroupKey::new(l % layout.layers, b % layout.blocks, h % layout.kv_heads, if v { Kind::V } else { Kind::K });
            let idx = layout.index(key).unwrap();
            prop_assert!(idx.0 < layout.group_count());
            prop_assert_eq!(layout.key(idx).unwrap(), key);
        }

        #[test]
        fn neighbours_are_distinct(layout in layout_strategy(), r in any::<u64>()) {
            let n = layout.group_count();
            let i = r % n;
            if i + 1 < n {
                let a = layout.key(GroupIndex(i)).unwrap();
                let b = layout.key(GroupIndex(i + 1)).unwrap();
                prop_assert_ne!(a, b);
                prop_assert_eq!(layout.offset(GroupIndex(i + 1)) - layout.offset(GroupIndex(i)), layout.stride());
            }
        }
    }

    #[test]
    fn exhaustive_small_layout() {
        let l = GroupLayout::new(3, 5, 2, 16, 128, Dtype::Fp8).unwrap();
        let mut seen = std::collections::HashSet::new();
        for layer in 0..3 {
            for block in 0..5 {
                for head in 0..2 {
                    for kind in [Kind::K, Kind::V] {
                        let k = GroupKey::new(layer, block, head, kind);
                        let i = l.index(k).unwrap();
                        assert!(seen.insert(i));
                        assert_eq!(l.key(i).unwrap(), k);
                    }
                }
            }
        }
        assert_eq!(seen.len() as u64, l.group_count());
        assert_eq!(l.group_bytes(), 2048);
        assert_eq!(l.stride(), 4096);
    }

    #[test]
    fn out_of_range_names_the_coordinate() {
        let l = GroupLayout::preset("llama-3.1-8b", 100, 16).unwrap();
        let e = l.index(GroupKey::new(32, 0, 0, Kind::K)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "layer 32 is out of range (the layout has 32)"
        );
        let e = l.index(GroupKey::new(0, 100, 0, Kind::K)).unwrap_err();
        assert_eq!(e.what, "block");
        let e = l.index(GroupKey::new(0, 0, 8, Kind::V)).unwrap_err();
        assert_eq!(e.what, "head");
        assert!(l.key(GroupIndex(l.group_count())).is_err());
    }

    #[test]
    fn presets() {
        let l = GroupLayout::preset("llama-3.1-8b", 4096, 16).unwrap();
        assert_eq!((l.layers, l.kv_heads, l.head_dim), (32, 8, 128));
        assert_eq!(l.group_bytes(), 16 * 128 * 2);
        let l = GroupLayout::preset("llama-3.1-70b", 1, 16).unwrap();
        assert_eq!((l.layers, l.kv_heads, l.head_dim), (80, 8, 128));
        let l = GroupLayout::preset("qwen2.5-7b", 1, 16).unwrap();
        assert_eq!((l.layers, l.kv_heads, l.head_dim), (28, 4, 128));
        let e = GroupLayout::preset("gpt-9", 1, 16).unwrap_err();
        assert!(e.to_string().contains("llama-3.1-8b"));
    }

    #[test]
    fn refuses_degenerate_layouts() {
        assert_eq!(
            GroupLayout::new(0, 1, 1, 1, 1, Dtype::Bf16).unwrap_err(),
            LayoutError::Zero("layers")
        );
        assert!(matches!(
            GroupLayout::new(u32::MAX, u64::MAX, u32::MAX, 1, 1, Dtype::Bf16),
            Err(LayoutError::TooManyGroups(_))
        ));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("4G").unwrap(), 4 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("16k").unwrap(), 16384);
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("12XB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("99999999999999T").is_err());
    }
}
