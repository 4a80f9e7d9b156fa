"""The kvfs vLLM plug-in (kvfs.vllm) against vLLM itself, on CPU: run by
tools/vllm_check.sh with a vLLM environment and a kvfs mount.

1. worker: KvfsOffloadingSpec's worker with KV tensors in vLLM's
   canonical form (int8 (num_blocks, page) per layer, pages in vLLM's
   [kv_heads, block_size, 2 x head_size] layout), transfers described by
   vLLM's own GPULoadStoreSpec and resolve_device_pointers: stores, group
   files read back, loads into other blocks (a transfer starting mid-chunk
   too), bytes compared.
2. scheduler: vLLM's real Scheduler with its OffloadingConnector loading
   kvfs.vllm by spec_module_path (see scheduler_check).
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import torch

from kvfs import Kvfs


def offloading_config(mount, extra=None, block_size=16, bpc=1, model="kvfs-check"):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig, OffloadingModelConfig,
        OffloadingParallelConfig)

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=block_size, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=0, enable_kv_cache_events=False,
        extra_config={"kvfs_mount": mount, **(extra or {})}, engine_id="check",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=block_size, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def worker_check(mount, index_dir):
    from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,
                                         CanonicalKVCacheTensor, GPULoadStoreSpec)
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    from kvfs.layouts import EngineLayout
    from kvfs.vllm import KvfsOffloadingSpec

    with Kvfs(mount) as kv:
        g = kv.layout
    bs, H, D = g["block_tokens"], g["kv_heads"], g["head_dim"]
    page = H * bs * 2 * D * 2
    nb = 8
    for bpc in (1, 2):
        spec = KvfsOffloadingSpec(offloading_config(
            mount, {"kvfs_index": os.path.join(index_dir, f"w{bpc}.sqlite")}, bs, bpc))
        layers = [torch.randint(-128, 128, (nb, page), dtype=torch.int8) for _ in range(2)]
        caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in layers],
                                   [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]])
        w = spec.get_worker(caches)
        keys = [bytes([bpc, i]) * 8 for i in range(4)]
        mgr = spec.get_manager()
        out = mgr.prepare_store(keys, None)
        # Engine blocks 5, 2, 7, 0 are logical blocks 0.. of a request.
        engine = [5, 2, 7, 0, 1, 3, 4, 6][:4 * bpc]
        src = GPULoadStoreSpec(engine, group_sizes=[len(engine)], block_indices=[0])
        assert w.submit_store(1, resolve_device_pointers(src, caches), out.store_spec)
        w.wait({1})
        res = w.get_finished()
        assert [(r.job_id, r.success) for r in res] == [(1, True)], res
        mgr.complete_store(keys, None)
        lay = EngineLayout("vllm", 1, H, bs, D, 2)
        for c, base in enumerate(out.store_spec.bases):
            for sub in range(bpc):
                b = engine[c * bpc + sub]
                for layer in range(2):
                    data = layers[layer][b].numpy().tobytes()
                    for h in range(H):
                        for kind in "KV":
                            off, row, pitch = lay.place(0, h, kind)
                            want = b"".join(data[off + t * pitch:off + t * pitch + row] for t in range(bs))
                            with open(os.path.join(mount, f"L{layer}", f"B{base + sub}", f"H{h}", kind), "rb") as f:
                                assert f.read() == want, (bpc, c, sub, layer, h, kind)
        # Load the last chunks into other engine blocks, starting mid-chunk
        # when chunks are 2 blocks: logical blocks 3..7 (bpc 2) or 1..3.
        first = 3 if bpc == 2 else 1
        n = 4 * bpc - first
        ks = keys[first // bpc:]
        spec_l = mgr.prepare_load(ks, None)
        back = [t.clone() for t in layers]
        for t in layers:
            t.zero_()
        dst_blocks = list(range(nb - n, nb))[::-1]
        dst = GPULoadStoreSpec(dst_blocks, group_sizes=[n], block_indices=[first])
        assert w.submit_load(2, spec_l, resolve_device_pointers(dst, caches))
        res = []
        while not res:
            res = w.get_finished()
        assert [(r.job_id, r.success) for r in res] == [(2, True)], res
        mgr.complete_load(ks, None)
        for layer in range(2):
            for k, b in enumerate(dst_blocks):
                assert torch.equal(layers[layer][b], back[layer][engine[first + k]]), (bpc, layer, k)
            untouched = [b for b in range(nb) if b not in dst_blocks]
            assert not layers[layer][untouched].any(), "blocks outside the load were written"
        w.shutdown()
        mgr.shutdown()
        print(f"worker: {4 * bpc} blocks x 2 layers stored as strided entries ({bpc} block(s) a chunk), "
              f"group files match vLLM's page layout, {n} loaded back from logical block {first} "
              "into other blocks: bit-identical")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mount")
    a = ap.parse_args()
    import vllm

    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, kvfs mount {a.mount}")
    with tempfile.TemporaryDirectory() as d:
        worker_check(a.mount, d)
    print("vllm checks: passed")


if __name__ == "__main__":
    sys.exit(main())
