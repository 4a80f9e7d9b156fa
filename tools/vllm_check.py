"""The kvfs vLLM plug-in (kvfs.vllm) against vLLM itself, on CPU: run by
tools/vllm_check.sh with a vLLM environment and a kvfs mount.

1. worker: KvfsOffloadingSpec's worker with KV tensors in vLLM's
   canonical form (int8 (num_blocks, page) per layer, pages in vLLM's
   [kv_heads, block_size, 2 x head_size] layout), transfers described by
   vLLM's own GPULoadStoreSpec and resolve_device_pointers: stores, group
   files read back, loads into other blocks (a transfer starting mid-chunk
   too), bytes compared.
2. scheduler: vLLM's real Scheduler with its OffloadingConnector loading
   kvfs.vllm by spec_module_path (see Engine and scheduler_check): request
   A stores, the prefix cache is reset, request B hits and loads, bytes
   identical; then a new process (vLLM restarted) finds them again.
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


def errors_check(mount, index_dir):
    """A clear error for a mount that does not fit, a path that is no
    mount, and a vLLM version whose offloading API is not the one known."""
    import importlib

    import vllm

    import kvfs.vllm as kv_vllm
    from kvfs.layouts import LayoutError

    with Kvfs(mount) as kv:
        bt = kv.layout["block_tokens"]
    try:
        kv_vllm.KvfsOffloadingSpec(offloading_config(mount, {"kvfs_index": os.path.join(index_dir, "e.sqlite")},
                                                     block_size=2 * bt))
        raise AssertionError("a block size the mount does not have was accepted")
    except LayoutError as e:
        assert f"block_tokens {bt}" in str(e) and str(2 * bt) in str(e), e
    try:
        kv_vllm.KvfsOffloadingSpec(offloading_config("/nonexistent-kvfs"))
        raise AssertionError("a path that is no mount was accepted")
    except ValueError as e:
        assert "not a usable kvfs mount" in str(e), e
    real = vllm.__version__
    vllm.__version__ = "0.33.0"
    try:
        importlib.reload(kv_vllm)
        raise AssertionError("an unsupported vLLM version was accepted")
    except ImportError as e:
        assert "0.34.0" in str(e) and "0.33.0" in str(e), e
    finally:
        vllm.__version__ = real
        importlib.reload(kv_vllm)
    print("errors: a mount of another block size, a path that is no mount, and vLLM 0.33.0 are refused, "
          "each naming what it found and what it needs")


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


class Engine:
    """vLLM's real Scheduler with its OffloadingConnector (scheduler role
    inside it, worker role beside it, driven through the CPU model runner's
    connector hooks, vllm.v1.worker.cpu.kv_connector.ActiveKVConnector) and
    kvfs.vllm loaded by spec_module_path. Simulated: the model's forward
    (random K/V written into the slots of the scheduled tokens, a fixed
    sampled token) and its ModelRunnerOutput."""

    LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    NUM_BLOCKS = 64

    def __init__(self, mount, index, workdir):
        import json

        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                                 SchedulerConfig, VllmConfig, set_current_vllm_config)
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,
                                                 resolve_kv_cache_block_sizes)
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                                KVCacheTensor)
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.cpu.kv_connector import ActiveKVConnector
        from vllm.v1.worker.utils import allocate_kv_cache

        from kvfs.vllm import KvfsOffloadingManager

        with Kvfs(mount) as kv:
            g = kv.layout
        self.bs = bs = g["block_tokens"]
        model_dir = os.path.join(workdir, "model")
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                       "hidden_size": g["kv_heads"] * g["head_dim"], "intermediate_size": 128,
                       "num_attention_heads": g["kv_heads"], "num_key_value_heads": g["kv_heads"],
                       "head_dim": g["head_dim"], "num_hidden_layers": 2, "vocab_size": 1000,
                       "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                       "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}, f)
        cache = CacheConfig(block_size=bs, gpu_memory_utilization=0.9, cache_dtype="auto",
                            enable_prefix_caching=True)
        cache.kv_cache_layout = "LBHNC"  # what OffloadingConnector asks the engine for
        config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=42),
            scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1000,
                                             max_model_len=4096, enable_chunked_prefill=True,
                                             is_encoder_decoder=False, async_scheduling=False),
            cache_config=cache,
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both",
                kv_connector_extra_config={"spec_name": "KvfsOffloadingSpec", "spec_module_path": "kvfs.vllm",
                                           "kvfs_mount": mount, "kvfs_index": index}),
            device_config=DeviceConfig("cpu"))
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=g["kv_heads"], head_size=g["head_dim"],
                                 dtype=torch.bfloat16)
        n = self.NUM_BLOCKS
        kv_config = KVCacheConfig(
            num_blocks=n,
            kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * n * len(self.LAYERS),
                                            layers=list(self.LAYERS), layer_stride=spec.page_size_bytes * n,
                                            block_stride=spec.page_size_bytes)],
            kv_cache_groups=[KVCacheGroupSpec(self.LAYERS, spec)])
        config.cache_config.num_gpu_blocks = n
        sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_config, config)
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=sched_bs, hash_block_size=hash_bs, log_stats=True)
        conn = self.scheduler.connector
        assert isinstance(conn, OffloadingConnector), type(conn)
        self.conn_sched = conn.connector_scheduler
        assert isinstance(self.conn_sched.manager, KvfsOffloadingManager), type(self.conn_sched.manager)
        self.matched = {}
        orig = conn.get_num_new_matched_tokens

        def spy(request, num_computed_tokens):
            r = orig(request, num_computed_tokens)
            self.matched.setdefault(request.request_id, []).append(r)
            return r

        conn.get_num_new_matched_tokens = spy
        self.kv_caches = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout.LBHNC, [bs])
        self.worker_conn = OffloadingConnector(config, KVConnectorRole.WORKER, kv_config)
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker_conn
        with set_current_vllm_config(config):
            self.runner = ActiveKVConnector(config, self.kv_caches)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(hash_bs, sha256)
        self.external = {}

    def request(self, rid, prompt):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self.scheduler.add_request(Request(
            request_id=rid, prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=3, ignore_eos=True),
            pooling_params=None, block_hasher=self.hasher))

    def blocks(self, rid):
        return [b.block_id for b in self.scheduler.kv_cache_manager.get_blocks(rid).blocks[0]]

    def _forward(self, so):
        from vllm.v1.outputs import ModelRunnerOutput

        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cr = so.scheduled_cached_reqs
        starts.update(zip(cr.req_ids, cr.num_computed_tokens))
        rids = list(so.num_scheduled_tokens)
        for rid in rids:
            blocks = self.blocks(rid)
            start = starts[rid]
            for pos in range(start, start + so.num_scheduled_tokens[rid]):
                b, slot = blocks[pos // self.bs], pos % self.bs
                for t in self.kv_caches.values():  # [blocks, heads, tokens, K|V]
                    t[b, :, slot] = torch.randn(t.shape[1], t.shape[3], dtype=t.dtype)
        return ModelRunnerOutput(req_ids=rids, sampled_token_ids=[[7] for _ in rids])

    def step(self):
        so = self.scheduler.schedule()
        if so.total_num_scheduled_tokens > 0:
            self.runner.pre_forward(so)
            out = self._forward(so)
            self.runner.finish_forward()
            out.kv_connector_output = self.runner.post_forward(so.finished_req_ids)
        else:
            out = self.runner.no_forward(so)
        for eco in self.scheduler.update_from_output(so, out).values():
            for o in eco.outputs:
                if o.prefill_stats is not None:
                    self.external[o.request_id] = o.prefill_stats.num_external_cached_tokens
        return so

    def run(self, max_steps=40):
        for _ in range(max_steps):
            if not self.scheduler.requests and not self.conn_sched._jobs:
                return
            self.step()
        raise RuntimeError(f"requests not done after {max_steps} steps")

    def close(self):
        self.scheduler.shutdown()
        self.worker_conn.shutdown()


PROMPT = [(i * 37 + 11) % 997 + 3 for i in range(100)]


def scheduler_check(mount, workdir, phase):
    """phase "a": request A computes and stores its full blocks, the
    prefix cache is reset (the GPU's; vLLM keeps the connector's), request
    B with the same prompt hits and loads them, bytes compared with A's;
    A's bytes are saved for phase "b". Phase "b" (a new process: vLLM
    restarted) finds them again through the index file."""
    index = os.path.join(workdir, "vllm-index.sqlite")
    e = Engine(mount, index, workdir)
    n_full = len(PROMPT) // e.bs
    snap = os.path.join(workdir, "a-blocks.pt")
    if phase == "a":
        e.request("A", PROMPT)
        e.step()  # A's prefill
        a = e.blocks("A")[:n_full]
        want = {n: t[a].clone() for n, t in e.kv_caches.items()}
        e.run()
        assert e.external.get("A", 0) == 0, e.external
        assert e.scheduler.reset_prefix_cache(), "the prefix cache was not reset"
        for t in e.kv_caches.values():
            t.fill_(0)
        torch.save(want, snap)
        rid = "B"
    else:
        want = torch.load(snap)
        rid = "C"
    e.request(rid, PROMPT)
    e.step()
    got_blocks = e.blocks(rid)
    e.run()
    ext = e.external.get(rid, 0)
    assert ext == n_full * e.bs, f"request {rid} found {ext} tokens in kvfs, expected {n_full * e.bs}"
    for n, t in e.kv_caches.items():
        assert torch.equal(t[got_blocks[:n_full]], want[n]), f"{rid}: loaded bytes differ in {n}"
        assert want[n].any()
    e.close()
    where = "after A, in the same engine" if phase == "a" else "in a new process (vLLM restarted)"
    print(f"scheduler: request {rid} {where}: {ext} of {len(PROMPT)} prompt tokens loaded from kvfs "
          f"({n_full} blocks x {len(e.LAYERS)} layers), bytes identical to request A's")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mount")
    ap.add_argument("--phase", choices=["a", "b"], help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase:
        scheduler_check(a.mount, a.workdir, a.phase)
        return 0
    import subprocess

    import vllm

    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, kvfs mount {a.mount}")
    with tempfile.TemporaryDirectory() as d:
        errors_check(a.mount, d)
        worker_check(a.mount, d)
        for phase in ("a", "b"):
            r = subprocess.run([sys.executable, __file__, a.mount, "--phase", phase, "--workdir", d],
                               capture_output=True, text=True)
            lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(("scheduler:", "Traceback",
                                                                                       "AssertionError"))]
            print("\n".join(lines) if r.returncode == 0 else r.stdout + r.stderr)
            if r.returncode != 0:
                print(f"vllm checks: FAILED (scheduler phase {phase})")
                return 1
    print("vllm checks: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
