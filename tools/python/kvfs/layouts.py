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

import bisect

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


class Regions:
    """An engine's KV tensors registered with kvfs: address ranges ->
    (region, offset), so a page named by its address (as vLLM's offloading
    worker names them) becomes an entry's region and offset."""

    def __init__(self):
        self._starts, self._spans = [], []

    def add(self, start, length, region):
        i = bisect.bisect_right(self._starts, start)
        for s, e, _ in self._spans[max(i - 1, 0):i + 1]:
            if start < e and s < start + length:
                raise LayoutError(f"tensor at {start:#x} (+{length}) overlaps one registered at {s:#x}")
        self._starts.insert(i, start)
        self._spans.insert(i, (start, start + length, region))

    def find(self, addr, length):
        """(region, offset) of [addr, addr + length), which must lie in one
        registered tensor."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            s, e, region = self._spans[i]
            if addr + length <= e:
                return region, addr - s
        raise LayoutError(f"page at {addr:#x} (+{length}) is in no registered KV tensor")

    def __iter__(self):
        return iter(self._spans)


def chunk_pages(ptrs, group_size, n_layers, first_block, chunk_blocks, bases):
    """(layer, page address, kvfs block) of a transfer laid out as vLLM's
    DevicePointers are (for each layer, for each engine block: a page
    address): engine block k of the transfer is logical block
    `first_block + k`; chunk c of `chunk_blocks` logical blocks (counted
    from the chunk holding `first_block`) lives in kvfs blocks
    bases[c] .. bases[c] + chunk_blocks."""
    skip = first_block % chunk_blocks
    need = -(-(group_size + skip) // chunk_blocks)
    if len(bases) != need:
        raise LayoutError(f"{group_size} blocks from logical block {first_block} span {need} chunks "
                          f"of {chunk_blocks}; {len(bases)} kvfs chunks were given")
    out = []
    for layer in range(n_layers):
        row = ptrs[layer * group_size:(layer + 1) * group_size]
        for k, addr in enumerate(row):
            c, sub = divmod(skip + k, chunk_blocks)
            out.append((layer, int(addr), bases[c] + sub))
    return out


def page_entries(page, regions, pages, head_offset=0):
    """Strided entries for whole pages: `page` an EngineLayout of one block
    (num_blocks 1: a page's heads, tokens, K and V), `pages` [(layer, page
    address, kvfs block)] as chunk_pages gives them."""
    if page.num_blocks != 1:
        raise LayoutError("page_entries takes the layout of one page (num_blocks=1)")
    places = [(h, kind) + page.place(0, h, kind) for h in range(page.kv_heads) for kind in ("K", "V")]
    size = page.layer_bytes
    out = []
    for layer, addr, kb in pages:
        region, off = regions.find(addr, size)
        out.extend((layer, kb, head_offset + h, kind, region, off + o, row, pitch)
                   for h, kind, o, row, pitch in places)
    return out
