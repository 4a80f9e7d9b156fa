"""kvfs.hf: a Hugging Face transformers KV cache that lives in kvfs.

    from kvfs.hf import KvfsCache
    cache = KvfsCache(model.config, "/mnt/kv", batch_size=1, max_tokens=8192)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
    cache.save_prefix(input_ids)               # stored, made durable, indexed

    # another process, same model weights:
    cache = KvfsCache(model.config, "/mnt/kv", batch_size=1, max_tokens=8192)
    n = cache.load_prefix(input_ids)           # tokens found in kvfs (block-aligned)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)

Mapping. Token `t` of sequence `s` of the batch lies in chunk `c = t //
block_tokens`; chunk `c` of sequence `s` is kvfs block `table[s][c]`,
by default `base + s * blocks_per_seq + c`, where `base` is a range of
blocks leased to this cache in the index (so two caches never write the
same blocks) and `blocks_per_seq = ceil(max_tokens / block_tokens)`.
Chunks loaded by `load_prefix` point at the blocks the saving process
wrote; they are only read. Each (layer, block, KV head, K|V) is one kvfs
group: the `block_tokens × head_dim` slice of that head's keys or values.
`cache.block_of(seq, token)` gives the block.

GPU memory. Only `resident_layers` layers are on the GPU at a time, in
slots of one registered device buffer (allocated and registered once).
Before a layer runs, its K/V are restored into a slot by one RESTORE
ticket whose CUDA IPC event the compute stream waits on (no host wait);
the next layer's restore is issued while this one computes. When a slot
is reused, the groups its layer changed since they were last stored (a
decode step changes one partial block per head) go back by one STORE.
Everything a layer holds is in kvfs before its slot is reused, so a
layer restored later sees every token.

The prefix index is a small SQLite file (default
`~/.cache/kvfs/prefix-index.sqlite`): one row per block-aligned token
prefix (keyed by a hash of the model id and the tokens) naming the block
that holds its last chunk, and the block ranges leased to live caches.
SQLite's locking keeps two processes writing it at once consistent, and
it outlives processes and mounts. A row whose groups the mount no longer
holds is ignored.
"""

import ctypes
import hashlib
import os

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .client import Encoded, Kvfs
from .prefix import DEFAULT_INDEX, OutOfBlocks, PrefixIndex  # noqa: F401  (re-exported)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class GeometryError(ValueError):
    """The mount's geometry cannot hold this model's KV cache."""


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_shape(config):
    """(layers, kv_heads, head_dim, dtype) of a transformers config."""
    c = _text_config(config)
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    dtype = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return c.num_hidden_layers, kv_heads, head_dim, dtype


class KvfsLayer(DynamicLayer):
    """One model layer of a KvfsCache: its K/V are views of a device slot
    while resident (see KvfsCache)."""

    def __init__(self, cache, idx):
        super().__init__()
        self.cache = cache
        self.idx = idx

    def lazy_initialization(self, key_states, value_states, *args, **kwargs):
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache._update(self.idx, key_states, value_states)

    def get_seq_length(self, *args, **kwargs):
        return self.cache.seq_len[self.idx]

    def get_mask_sizes(self, query_length, *args, **kwargs):
        if torch.is_tensor(query_length):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        return self.cache.seq_len[self.idx] + query_length, 0

    def get_max_length(self):
        return self.cache.max_tokens

    def offload(self):
        pass  # KvfsCache moves layers itself

    def prefetch(self):
        pass

    def reset(self):
        self.cache.reset()

    def crop(self, max_length):
        raise NotImplementedError("KvfsCache does not crop (assisted decoding is not supported)")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("KvfsCache does not reorder (beam search is not supported)")

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError("KvfsCache is made for one batch size; build it with batch_size=…")

    def batch_select_indices(self, indices):
        raise NotImplementedError("KvfsCache is made for one batch size")


class KvfsCache(Cache):
    """A transformers Cache whose K/V live in kvfs, with only
    `resident_layers` layers on the GPU at a time (see the module note).

    config: the model's config (layers, KV heads, head_dim and dtype must
    fit the mount's geometry). mount: a kvfs mount point. batch_size,
    max_tokens: the sequences this cache holds (prompt and generated
    tokens). index: a PrefixIndex or its path. model_id: names the
    weights in prefix keys (default: a hash of the config; give your own
    when two models share a config)."""

    def __init__(self, config, mount, *, batch_size=1, max_tokens=4096, device=None,
                 resident_layers=3, index=None, model_id=None, kv=None, dtype=None):
        layers, kv_heads, head_dim, cfg_dtype = model_shape(config)
        dtype = dtype or cfg_dtype
        self.kv = kv or Kvfs(mount)
        self.mount = mount
        g = self.kv.layout
        want = (layers, kv_heads, head_dim, dtype)
        have_dtype = DTYPES.get(g["dtype"])
        if (g["layers"] < layers or g["kv_heads"] != kv_heads or g["head_dim"] != head_dim
                or have_dtype != dtype):
            raise GeometryError(
                f"the mount at {mount} cannot hold this model's KV cache: mount has {g['layers']} layers, "
                f"{g['kv_heads']} KV heads, head_dim {g['head_dim']}, {g['dtype']}; the model needs "
                f"{want[0]} layers, {want[1]} KV heads, head_dim {want[2]}, {str(dtype).replace('torch.', '')} "
                f"(mount one with --layers {layers} --kv-heads {kv_heads} --head-dim {head_dim} "
                f"--dtype {next((k for k, v in DTYPES.items() if v == dtype), '?')})")
        self.n_layers, self.heads, self.head_dim, self.dtype = layers, kv_heads, head_dim, dtype
        self.bt = g["block_tokens"]
        self.batch = batch_size
        self.blocks_per_seq = -(-max_tokens // self.bt)
        self.max_tokens = self.blocks_per_seq * self.bt
        self.index = index if isinstance(index, PrefixIndex) else PrefixIndex(index or DEFAULT_INDEX)
        self.model_id = model_id or hashlib.sha256(
            _text_config(config).to_json_string(use_diff=False).encode()).hexdigest()
        need = batch_size * self.blocks_per_seq
        self.base = self.index.lease(need, g["blocks"])
        self.device = torch.device(device or "cuda")
        if self.device.type != "cuda":
            raise ValueError("KvfsCache restores into GPU memory: give a CUDA device")
        self.slots = max(2, min(resident_layers, layers))
        # Slot r, K|V k, sequence s, head h, token t: one buffer, registered once.
        self.buf = torch.zeros((self.slots, 2, batch_size, kv_heads, self.max_tokens, head_dim),
                               dtype=dtype, device=self.device)
        self.region = self.kv.register_tensor(self.buf)
        self.table = (self.base + torch.arange(need, dtype=torch.int64)).view(batch_size, -1)
        self.seq_len = [0] * layers
        self.stored = [0] * layers      # tokens of each layer already in kvfs
        self.slot_of = {}                # resident layer -> slot
        self.owner = [None] * self.slots
        self.pending = {}               # layer -> CUDA event after its last use
        self.ready = {}                 # layer -> CUDA event of its restore
        self.last = None                # the layer updated last
        self.encoded = {}               # (layer, slot, c0, c1) -> Encoded entries
        self.stats = {"restores": 0, "restored_groups": 0, "stores": 0, "stored_groups": 0}
        self._tickets = []              # restore tickets not yet collected
        super().__init__(layers=[KvfsLayer(self, i) for i in range(layers)])

    # ---- mapping -------------------------------------------------------

    def block_of(self, seq, token):
        """The kvfs block holding token `token` of sequence `seq`."""
        return int(self.table[seq, token // self.bt])

    def _entries(self, layer, slot, c0, c1):
        """RESTORE/STORE entries for chunks [c0, c1) of every sequence,
        head, K and V of `layer`, into/out of `slot`, in ascending offsets."""
        key = (layer, slot, c0, c1)
        e = self.encoded.get(key)
        if e is not None:
            return e
        if len(self.encoded) > 4 * self.n_layers:
            self.encoded.clear()
        B, H, T, D, bt = self.batch, self.heads, self.max_tokens, self.head_dim, self.bt
        k = torch.arange(2, dtype=torch.int64).view(2, 1, 1, 1)
        s = torch.arange(B, dtype=torch.int64).view(1, B, 1, 1)
        h = torch.arange(H, dtype=torch.int64).view(1, 1, H, 1)
        c = torch.arange(c0, c1, dtype=torch.int64).view(1, 1, 1, -1)
        shape = (2, B, H, c1 - c0)
        block = self.table[:, c0:c1].view(1, B, 1, -1).expand(shape)
        elt = self.buf.element_size()
        offset = (((((slot * 2 + k) * B + s) * H + h) * T + c * bt) * D * elt).expand(shape)
        lh = (layer + (h << 32)).expand(shape)
        kr = (k + (self.region << 32)).expand(shape)
        rows = torch.stack([block, lh, kr, offset], dim=-1).reshape(-1, 4).contiguous()
        e = Encoded(ctypes.string_at(rows.data_ptr(), rows.numel() * 8))
        self.encoded[key] = e
        return e

    # ---- moving layers ---------------------------------------------------

    def _store(self, layer):
        """Writes the chunks `layer` changed since its last store from its
        slot into kvfs, once the GPU is done with the slot."""
        ev = self.pending.pop(layer, None)
        if ev is not None:
            ev.synchronize()
        lo, hi = self.stored[layer] // self.bt, -(-self.seq_len[layer] // self.bt)
        if hi > lo:
            t = self.kv.store(self._entries(layer, self.slot_of[layer], lo, hi), wait=True)
            del t
            self.stats["stores"] += 1
            self.stats["stored_groups"] += 2 * self.batch * self.heads * (hi - lo)
        self.stored[layer] = self.seq_len[layer]

    def _evict(self, slot):
        old = self.owner[slot]
        if old is None:
            return
        self._store(old)
        self.ready.pop(old, None)
        del self.slot_of[old]
        self.owner[slot] = None

    def _bring(self, layer):
        """Makes `layer` resident: a slot, and a RESTORE of what kvfs holds
        of it (the compute stream waits for its event in _update)."""
        if layer in self.slot_of:
            return
        slot = layer % self.slots
        self._evict(slot)
        self.owner[slot] = layer
        self.slot_of[layer] = slot
        chunks = -(-self.stored[layer] // self.bt)
        if chunks:
            t = self.kv.restore(self._entries(layer, slot, 0, chunks), wait=False)
            self.ready[layer] = (t, torch.cuda.Event.from_ipc_handle(self.device, t.ipc_event_handle))
            self.stats["restores"] += 1
            self.stats["restored_groups"] += 2 * self.batch * self.heads * chunks

    def _update(self, layer, key_states, value_states):
        stream = torch.cuda.current_stream(self.device)
        if self.last is not None and self.last != layer:
            # The previous layer's attention has been enqueued: after this
            # event its slot may be stored and reused.
            ev = torch.cuda.Event()
            ev.record(stream)
            self.pending[self.last] = ev
        self.last = layer
        self._bring(layer)
        r = self.ready.pop(layer, None)
        if r is not None:
            stream.wait_event(r[1])
            self._tickets.append(r[0])
        slot = self.slot_of[layer]
        n = key_states.shape[-2]
        lo, hi = self.seq_len[layer], self.seq_len[layer] + n
        if hi > self.max_tokens:
            raise ValueError(f"KvfsCache holds {self.max_tokens} tokens a sequence (max_tokens); "
                             f"layer {layer} would reach {hi}")
        if key_states.shape[0] != self.batch:
            raise ValueError(f"KvfsCache was made for batch size {self.batch}, got {key_states.shape[0]}")
        self.buf[slot, 0, :, :, lo:hi].copy_(key_states)
        self.buf[slot, 1, :, :, lo:hi].copy_(value_states)
        self.seq_len[layer] = hi
        # The next layer's restore runs while this one computes.
        self._bring((layer + 1) % self.n_layers)
        self._reap()
        return self.buf[slot, 0, :, :, :hi], self.buf[slot, 1, :, :, :hi]

    def _reap(self):
        """Collects restore tickets whose copies the stream has waited on,
        a few layers back (so the daemon can reuse their events)."""
        while len(self._tickets) > self.slots:
            self.kv.wait(self._tickets.pop(0))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self._update(layer_idx, key_states, value_states)

    # ---- whole-cache operations -----------------------------------------

    def flush(self):
        """Stores every layer's changes into kvfs and waits for it."""
        if self.last is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.pending[self.last] = ev
        for layer in list(self.slot_of):
            self._store(layer)
        for t in self._tickets:
            self.kv.wait(t)
        self._tickets = []

    def get_seq_length(self, layer_idx=0, *args, **kwargs):
        return self.seq_len[layer_idx]

    def save_prefix(self, input_ids):
        """Stores the cache, makes it durable, and indexes each full block of
        each sequence's tokens (`input_ids`: [batch, tokens], the tokens
        this cache holds first). Returns the blocks indexed per sequence."""
        self.flush()
        fd = os.open(os.path.join(self.mount, ".kvfs", "flush"), os.O_WRONLY)
        try:
            os.write(fd, b"1")  # every group durable (fdatasync, metadata msync)
        finally:
            os.close(fd)
        ids = input_ids.tolist() if torch.is_tensor(input_ids) else [list(x) for x in input_ids]
        held = min(self.seq_len)
        rows, per_seq = [], []
        for s, toks in enumerate(ids):
            full = min(len(toks), held) // self.bt
            for c in range(full):
                rows.append((PrefixIndex.key(self.model_id, toks[:(c + 1) * self.bt]),
                             self.block_of(s, c * self.bt), (c + 1) * self.bt))
            per_seq.append(full)
        self.index.add(rows)
        return per_seq

    def load_prefix(self, input_ids):
        """Finds the longest stored block-aligned prefix of every sequence of
        `input_ids` (leaving at least one token to compute), points this
        empty cache at it, and returns the tokens it holds now (the same
        for every sequence: the shortest match). The groups are restored
        layer by layer as the model runs."""
        if any(self.seq_len):
            raise ValueError("load_prefix needs an empty KvfsCache")
        ids = input_ids.tolist() if torch.is_tensor(input_ids) else [list(x) for x in input_ids]
        if len(ids) != self.batch:
            raise ValueError(f"KvfsCache was made for batch size {self.batch}, got {len(ids)} sequences")
        found = []
        for toks in ids:
            full = (len(toks) - 1) // self.bt
            keys = [PrefixIndex.key(self.model_id, toks[:(c + 1) * self.bt]) for c in range(full)]
            blocks = self.index.find(keys)
            # The index may outlive the store: keep only blocks kvfs holds.
            if blocks:
                states = self.kv.query([(0, b, 0, "K") for b in blocks])
                n = next((i for i, (st, _) in enumerate(states) if st == "empty"), len(blocks))
                blocks = blocks[:n]
            found.append(blocks)
        k = min(len(b) for b in found)
        for s, blocks in enumerate(found):
            if k:
                self.table[s, :k] = torch.tensor(blocks[:k], dtype=torch.int64)
        self.encoded.clear()
        self.seq_len = [k * self.bt] * self.n_layers
        self.stored = list(self.seq_len)
        return k * self.bt

    def reset(self):
        """Empties the cache (a new conversation); saved prefixes stay."""
        self.flush()
        for slot in range(self.slots):
            if self.owner[slot] is not None:
                del self.slot_of[self.owner[slot]]
                self.owner[slot] = None
        self.seq_len = [0] * self.n_layers
        self.stored = [0] * self.n_layers
        self.pending.clear()
        self.last = None
        # Fresh blocks: the old ones may be part of saved prefixes.
        self.index.release(self.base)
        self.base = self.index.lease(self.batch * self.blocks_per_seq, self.kv.layout["blocks"])
        self.table = (self.base + torch.arange(self.batch * self.blocks_per_seq,
                                               dtype=torch.int64)).view(self.batch, -1)
        self.encoded.clear()

    def close(self):
        """Stores what is pending and gives the block lease back."""
        if getattr(self, "kv", None) is None:
            return
        try:
            self.flush()
            self.kv.unregister(self.region)
        finally:
            self.index.release(self.base)
            self.kv = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["demo"]:
        print("usage: python -m kvfs.hf demo --mount MOUNT [--shape 1b|8b] [--prompt N] "
              "(python -m kvfs.hf demo --help)", file=sys.stderr)
        raise SystemExit(2)
    from .hf_demo import main

    raise SystemExit(main(sys.argv[2:]))
