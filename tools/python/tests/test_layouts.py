"""kvfs.layouts: engine KV layouts as strided entries. The offsets are
checked against each layout's shape (row-major element index) without a
mount; with KVFS_MOUNT, tensors hand-built in each layout in host regions
are stored and restored byte for byte."""

import itertools
import os
import tempfile
import unittest

from kvfs import Kvfs
from kvfs.layouts import EngineLayout, LayoutError, Regions, chunk_pages, page_entries

MOUNT = os.environ.get("KVFS_MOUNT")


def element(layout, shape, block, head, token, kv, d):
    """Row-major element index of (block, head, token, K|V, d) in a tensor
    of the layout's shape."""
    nb, H, T, D = shape
    if layout == "vllm":  # [nb, H, T, 2 × D]
        return ((block * H + head) * T + token) * 2 * D + kv * D + d
    # flash: [2, nb, T, H, D]
    return (((kv * nb + block) * T + token) * H + head) * D + d


class PlacementTest(unittest.TestCase):
    def test_offsets_match_the_shapes(self):
        shape = (3, 2, 4, 8)
        for name in ("vllm", "flash"):
            lay = EngineLayout(name, *shape, dtype_bytes=2)
            for block, head, token, kv, d in itertools.product(range(3), range(2), range(4), range(2), (0, 7)):
                off, row, pitch = lay.place(block, head, "KV"[kv])
                self.assertEqual(row, 16)
                self.assertEqual(off + token * pitch + d * 2,
                                 element(name, shape, block, head, token, kv, d) * 2,
                                 (name, block, head, token, kv, d))

    def test_bad_shapes_and_places(self):
        with self.assertRaises(LayoutError):
            EngineLayout("nhd", 1, 1, 1, 1, 2)
        with self.assertRaises(LayoutError):
            EngineLayout("vllm", 0, 1, 1, 1, 2)
        lay = EngineLayout("vllm", 2, 2, 16, 64, 2)
        with self.assertRaises(LayoutError):
            lay.place(2, 0, "K")
        with self.assertRaises(LayoutError):
            lay.place(0, 2, "V")

    def test_mount_fit(self):
        geo = {"block_tokens": 16, "head_dim": 64, "dtype": "bf16", "kv_heads": 8}
        EngineLayout("vllm", 4, 8, 16, 64, 2).check_mount(geo)
        EngineLayout("vllm", 4, 4, 16, 64, 2).check_mount(geo, head_offset=4)
        for bad, off in (((4, 8, 32, 64, 2), 0), ((4, 8, 16, 128, 2), 0), ((4, 8, 16, 64, 4), 0),
                         ((4, 4, 16, 64, 2), 5)):
            with self.assertRaises(LayoutError) as e:
                EngineLayout("vllm", *bad).check_mount(geo, head_offset=off)
            self.assertIn("block_size", str(e.exception))


class PagesTest(unittest.TestCase):
    """vLLM's offloading worker names pages by address, layer by layer;
    chunks of offloaded blocks may start mid-chunk."""

    def test_chunk_pages_and_regions(self):
        # 2 layers, 3 engine blocks from logical block 5, chunks of 4: block
        # 5 is the second of chunk [4, 8), so pages go to 101, 102, 103.
        ptrs = [1000, 1100, 1200, 5000, 5100, 5200]
        got = chunk_pages(ptrs, 3, 2, 5, 4, [100])
        self.assertEqual(got, [(0, 1000, 101), (0, 1100, 102), (0, 1200, 103),
                               (1, 5000, 101), (1, 5100, 102), (1, 5200, 103)])
        got = chunk_pages(ptrs[:2] + ptrs[3:5], 2, 2, 7, 4, [300, 400])
        self.assertEqual([kb for _, _, kb in got], [303, 400, 303, 400])
        with self.assertRaises(LayoutError):
            chunk_pages(ptrs, 3, 2, 5, 4, [100, 200])
        r = Regions()
        r.add(1000, 300, 7)
        r.add(5000, 300, 8)
        self.assertEqual(r.find(1100, 100), (7, 100))
        self.assertEqual(r.find(5200, 100), (8, 200))
        for addr in (900, 1250, 2000):
            with self.assertRaises(LayoutError):
                r.find(addr, 100)
        with self.assertRaises(LayoutError):
            r.add(1200, 10, 9)

    def test_page_entries_match_the_layout(self):
        page = EngineLayout("vllm", 1, 2, 4, 8, 2)
        r = Regions()
        r.add(4096, 10 * page.layer_bytes, 3)
        ents = page_entries(page, r, [(1, 4096 + 2 * page.layer_bytes, 9)], head_offset=2)
        whole = EngineLayout("vllm", 10, 2, 4, 8, 2)
        self.assertEqual(ents, [(1, 9, 2 + h, k, 3) + whole.place(2, h, k) for h in range(2) for k in "KV"])


@unittest.skipUnless(MOUNT, "KVFS_MOUNT is not set")
class MountedLayoutTest(unittest.TestCase):
    def setUp(self):
        self.kv = Kvfs(MOUNT)
        g = self.kv.layout
        self.g = g
        self.files = []

    def tearDown(self):
        self.kv.close()
        for fd, path in self.files:
            os.close(fd)
            os.unlink(path)

    def region(self, size, data=None):
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="kvfs-layout-")
        os.ftruncate(fd, size)
        if data is not None:
            os.pwrite(fd, data, 0)
        self.files.append((fd, path))
        return fd, self.kv.register_host_region(path, size)

    def test_layer_tensors_round_trip(self):
        g = self.g
        for name in ("vllm", "flash"):
            lay = EngineLayout(name, 4, g["kv_heads"], g["block_tokens"], g["head_dim"], 2)
            lay.check_mount(g)
            base = 64  # the tensor need not start the region
            data = os.urandom(lay.layer_bytes)
            _, src = self.region(base + lay.layer_bytes, b"\0" * base + data)
            # Engine blocks 0..3 to kvfs blocks 7, 5, 3, 1 of layer 1.
            pairs = [(0, 7), (1, 5), (2, 3), (3, 1)]
            self.kv.store(lay.entries(1, src, pairs, base=base))
            for eb, kb in pairs:
                for h in range(g["kv_heads"]):
                    for kind in "KV":
                        off, row, pitch = lay.place(eb, h, kind)
                        want = b"".join(data[off + t * pitch:off + t * pitch + row]
                                        for t in range(g["block_tokens"]))
                        with open(os.path.join(MOUNT, "L1", f"B{kb}", f"H{h}", kind), "rb") as f:
                            self.assertEqual(f.read(), want, (name, eb, kb, h, kind))
            fd, dst = self.region(base + lay.layer_bytes)
            self.kv.restore(lay.entries(1, dst, pairs, base=base))
            self.assertEqual(os.pread(fd, lay.layer_bytes, base), data, name)

    def test_pages_by_address_round_trip(self):
        """vLLM's worker path: pages named by address in per-layer tensors,
        chunks of 2 kvfs blocks, the transfer starting mid-chunk."""
        g = self.g
        page = EngineLayout("vllm", 1, g["kv_heads"], g["block_tokens"], g["head_dim"], 2)
        nb, size = 4, page.layer_bytes
        regions = Regions()
        fds, datas = [], []
        for layer in range(2):  # a tensor a layer, at made-up "addresses"
            data = os.urandom(nb * size)
            fd, rid = self.region(nb * size, data)
            regions.add(0x10000000 * (layer + 1), nb * size, rid)
            fds.append(fd)
            datas.append(data)
        blocks = [3, 0, 2]  # engine blocks of logical blocks 1, 2, 3
        ptrs = [0x10000000 * (layer + 1) + b * size for layer in range(2) for b in blocks]
        pages = chunk_pages(ptrs, 3, 2, 1, 2, [4, 6])  # kvfs blocks 5, 6, 7
        self.kv.store(page_entries(page, regions, pages))
        for layer, addr, kb in pages:
            b = (addr - 0x10000000 * (layer + 1)) // size
            for h in range(g["kv_heads"]):
                for kind in "KV":
                    off, row, pitch = page.place(0, h, kind)
                    want = b"".join(datas[layer][b * size + off + t * pitch:][:row]
                                    for t in range(g["block_tokens"]))
                    with open(os.path.join(MOUNT, f"L{layer}", f"B{kb}", f"H{h}", kind), "rb") as f:
                        self.assertEqual(f.read(), want, (layer, b, kb, h, kind))
        for fd in fds:
            os.pwrite(fd, b"\0" * (nb * size), 0)
        self.kv.restore(page_entries(page, regions, pages))
        for layer, fd in enumerate(fds):
            got = os.pread(fd, nb * size, 0)
            for b in blocks:
                self.assertEqual(got[b * size:(b + 1) * size], datas[layer][b * size:(b + 1) * size])
            self.assertEqual(got[size:2 * size], b"\0" * size, "block 1 was not in the transfer")


def _cuda():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@unittest.skipUnless(MOUNT and _cuda(), "needs KVFS_MOUNT and a CUDA GPU with torch")
class CudaLayoutTest(unittest.TestCase):
    """The same round trip with the layer tensors in GPU memory (CUDA
    regions): the daemon's copies move the rows."""

    def test_layer_tensors_round_trip_on_the_gpu(self):
        import torch

        with Kvfs(MOUNT) as kv:
            g = kv.layout
            for name in ("vllm", "flash"):
                lay = EngineLayout(name, 4, g["kv_heads"], g["block_tokens"], g["head_dim"], 2)
                lay.check_mount(g)
                base = 64
                src = torch.randint(0, 256, (base + lay.layer_bytes,), dtype=torch.uint8, device="cuda")
                rs = kv.register_tensor(src)
                pairs = [(0, 6), (1, 4), (2, 2), (3, 0)]
                torch.cuda.synchronize()
                kv.store(lay.entries(2, rs, pairs, base=base))
                data = bytes(src[base:].cpu().tolist())
                for eb, kb in pairs:
                    for h in range(g["kv_heads"]):
                        for kind in "KV":
                            off, row, pitch = lay.place(eb, h, kind)
                            want = b"".join(data[off + t * pitch:off + t * pitch + row]
                                            for t in range(g["block_tokens"]))
                            with open(os.path.join(MOUNT, "L2", f"B{kb}", f"H{h}", kind), "rb") as f:
                                self.assertEqual(f.read(), want, (name, eb, kb, h, kind))
                dst = torch.zeros_like(src)
                rd = kv.register_tensor(dst)
                kv.restore(lay.entries(2, rd, pairs, base=base))
                torch.cuda.synchronize()
                self.assertTrue(torch.equal(dst[base:], src[base:]), name)
                self.assertEqual(int(dst[:base].count_nonzero()), 0, "bytes before the tensor untouched")
                kv.unregister(rs)
                kv.unregister(rd)


if __name__ == "__main__":
    unittest.main()
