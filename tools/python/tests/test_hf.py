"""kvfs.hf.KvfsCache byte for byte on a GPU, without a model: K/V tensors
fed to update() as a model's layers would (a prefill, then decode steps),
saved as a prefix, then loaded by a new cache, which must hand back the
very bytes that went in, with fewer slots than layers so layers are
evicted and restored. Needs torch with CUDA, transformers, and
KVFS_HF_MOUNT: a mount made with
    --layers 4 --kv-heads 2 --head-dim 64 --block-tokens 16 --dtype bf16
(tools/gpu_device_run.sh makes one)."""

import os
import tempfile
import unittest

MOUNT = os.environ.get("KVFS_HF_MOUNT")
LAYERS, HEADS, DIM, BT = 4, 2, 64, 16


def _ready():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@unittest.skipUnless(MOUNT and _ready(), "needs KVFS_HF_MOUNT, transformers and a CUDA GPU with torch")
class KvfsCacheBytesTest(unittest.TestCase):
    def setUp(self):
        import torch
        from transformers import LlamaConfig

        self.torch = torch
        self.config = LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=HEADS,
                                  head_dim=DIM, hidden_size=256, intermediate_size=512, vocab_size=1000,
                                  dtype=torch.bfloat16)
        self.tmp = tempfile.TemporaryDirectory()
        self.index = os.path.join(self.tmp.name, "index.sqlite")
        g = torch.Generator(device="cuda").manual_seed(7)
        self.total = 300  # a prefill of 250 tokens, then 50 decode steps
        self.k = [torch.randn((1, HEADS, self.total, DIM), generator=g, device="cuda").to(torch.bfloat16)
                  for _ in range(LAYERS)]
        self.v = [torch.randn((1, HEADS, self.total, DIM), generator=g, device="cuda").to(torch.bfloat16)
                  for _ in range(LAYERS)]
        self.ids = torch.arange(1, self.total + 1).view(1, -1)

    def tearDown(self):
        self.tmp.cleanup()

    def cache(self):
        from kvfs.hf import KvfsCache

        return KvfsCache(self.config, MOUNT, max_tokens=self.total + 16, index=self.index,
                         resident_layers=2, prefetch=1, model_id="kvfs-test-bytes")

    def feed(self, c, lo, hi):
        """Tokens [lo, hi) through every layer, in model order; each
        returned K/V must be every token so far, bit for bit."""
        torch = self.torch
        for layer in range(LAYERS):
            k, v = c.update(self.k[layer][:, :, lo:hi], self.v[layer][:, :, lo:hi], layer)
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(k, self.k[layer][:, :, :hi]), f"layer {layer} K, tokens {lo}..{hi}")
            self.assertTrue(torch.equal(v, self.v[layer][:, :, :hi]), f"layer {layer} V, tokens {lo}..{hi}")

    def test_a_saved_prefix_comes_back_bit_identical(self):
        with self.cache() as a:
            self.assertLess(a.slots, LAYERS, "the test needs layers evicted and restored")
            self.feed(a, 0, 250)
            for t in range(250, self.total):
                self.feed(a, t, t + 1)
            saved = a.save_prefix(self.ids)
        self.assertEqual(saved, [self.total // BT])
        # A new cache (a new process would do the same): the longest
        # stored prefix, leaving a token to compute, then decode on it.
        with self.cache() as b:
            n = b.load_prefix(self.ids)
            self.assertEqual(n, (self.total - 1) // BT * BT)
            self.feed(b, n, n + 1)
            for t in range(n + 1, self.total):
                self.feed(b, t, t + 1)
            # The compute stream waited for every restore on the GPU: on a
            # done word where they are on (KVFS_HF_DONE_WORDS=1) and the
            # device writes them, else the IPC event.
            waits = b.stats["done_word_waits"] + b.stats["event_waits"]
            self.assertGreater(waits, 0)
            if b.restorer.words is not None:
                self.assertEqual(b.stats["event_waits"], 0, "a done word was busy")


if __name__ == "__main__":
    unittest.main()
