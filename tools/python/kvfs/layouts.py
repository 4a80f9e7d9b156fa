"""Engine KV layouts as kvfs strided entries. Standard library only: no
torch, no vLLM, so the mapping is tested alone.

An engine keeps each layer's KV cache in one tensor; a kvfs group is one
(layer, block, KV head, K|V): `block_tokens × head_dim` elements. Where an
engine interleaves K and V, or heads, a group's elements are rows of
`head_dim` elements a fixed pitch apart, which a strided entry
(`(layer, block, head, kind, region, offset, row_bytes, pitch)`) names
directly, so a restore or store moves the engine's tensor as it lies.

Layouts (names as the engines use them):

- `"vllm"`: `[num_blocks, kv_heads, block_size, 2 × head_size]`, vLLM's
  current layout (K then V on each token's row of each head).
- `"flash"`: `[2, num_blocks, block_size, kv_heads, head_size]`, the
  FlashAttention-style layout (K and V planes, heads interleaved per token).
"""

LAYOUTS = ("vllm", "flash")


class LayoutError(ValueError):
    """An engine layout that a kvfs mount cannot hold."""


class EngineLayout:
    """One layer's KV tensor of an engine, as kvfs strided entries.

    num_blocks, kv_heads, block_size, head_size: the tensor's shape;
    dtype_bytes: bytes an element; layout: one of LAYOUTS."""

    def __init__(self, layout, num_blocks, kv_heads, block_size, head_size, dtype_bytes):
        if layout not in LAYOUTS:
            raise LayoutError(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
        for name, v in (("num_blocks", num_blocks), ("kv_heads", kv_heads), ("block_size", block_size),
                        ("head_size", head_size), ("dtype_bytes", dtype_bytes)):
            if not isinstance(v, int) or v <= 0:
                raise LayoutError(f"{name} must be a positive integer, not {v!r}")
        self.layout = layout
        self.num_blocks, self.kv_heads = num_blocks, kv_heads
        self.block_size, self.head_size, self.dtype_bytes = block_size, head_size, dtype_bytes
        self.row = head_size * dtype_bytes  # one token's K (or V) of one head

    @property
    def layer_bytes(self):
        """Bytes of one layer's tensor."""
        return 2 * self.num_blocks * self.kv_heads * self.block_size * self.row

    def check_mount(self, geometry, head_offset=0):
        """Raises LayoutError unless the mount's geometry (its `layout`
        dict) holds this tensor's groups: block_tokens = block_size,
        head_dim = head_size, element size equal, and heads
        [head_offset, head_offset + kv_heads) in range."""
        sizes = {"bf16": 2, "fp16": 2, "f16": 2, "fp32": 4, "f32": 4, "fp8": 1, "u8": 1}
        have = (geometry["block_tokens"], geometry["head_dim"], sizes.get(geometry["dtype"]))
        want = (self.block_size, self.head_size, self.dtype_bytes)
        if have != want or head_offset + self.kv_heads > geometry["kv_heads"]:
            raise LayoutError(
                f"the mount has block_tokens {have[0]}, head_dim {have[1]}, {geometry['dtype']} "
                f"({have[2]} bytes an element), {geometry['kv_heads']} KV heads; the engine's cache has "
                f"block_size {want[0]}, head_size {want[1]}, {want[2]} bytes an element, heads "
                f"{head_offset}..{head_offset + self.kv_heads}")

    def place(self, block, head, kind):
        """(offset, row_bytes, pitch) of (engine block, head, 'K'|'V') in
        the layer's tensor."""
        if not 0 <= block < self.num_blocks:
            raise LayoutError(f"block {block} is outside the tensor's {self.num_blocks} blocks")
        if not 0 <= head < self.kv_heads:
            raise LayoutError(f"head {head} is outside the tensor's {self.kv_heads} KV heads")
        v = {"K": 0, "V": 1}[kind]
        H, T, r = self.kv_heads, self.block_size, self.row
        if self.layout == "vllm":
            # [block][head][token][K row | V row]
            return ((block * H + head) * T * 2 + v) * r, r, 2 * r
        # flash: [K|V][block][token][head][row]
        return ((v * self.num_blocks + block) * T * H + head) * r, r, H * r

    def entries(self, layer, region, pairs, base=0, head_offset=0):
        """Strided entries moving engine blocks to or from kvfs blocks:
        `pairs` is [(engine_block, kvfs_block)], `base` the tensor's byte
        offset in `region`, kvfs heads `head_offset + h`. K and V of every
        head of every pair, in the tensor's byte order."""
        out = []
        for eb, kb in pairs:
            for h in range(self.kv_heads):
                for kind in ("K", "V"):
                    off, row, pitch = self.place(eb, h, kind)
                    out.append((layer, kb, head_offset + h, kind, region, base + off, row, pitch))
        return out
