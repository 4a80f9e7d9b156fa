"""kvfs as a vLLM offload tier: an out-of-tree OffloadingSpec for vLLM's
OffloadingConnector.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {"spec_name": "KvfsOffloadingSpec",
      "spec_module_path": "kvfs.vllm", "kvfs_mount": "/mnt/kv"}}'

vLLM keeps hashing, scheduling, asynchronous loads and preemption; kvfs
keeps the bytes. The scheduler side (KvfsOffloadingManager) gives each
offloaded chunk (a block hash and KV-cache group) a chunk of kvfs blocks
from the mount's range, least recently used evicted first, in a
kvfs.blockindex file that survives restarts of vLLM, so chunks stored
before are found again. The worker side (KvfsOffloadingWorker) registers
each KV tensor once (CUDA IPC for GPU tensors) and turns each load and
store into one RESTORE or STORE ticket of strided entries
(kvfs.layouts.page_entries): every page of the transfer, every KV head, K
and V, where vLLM's layout puts them.

kv_connector_extra_config keys (kvfs_mount required):
  kvfs_mount    the kvfs mount point
  kvfs_blocks   "FIRST:COUNT": the mount's blocks this engine may use
                (default: all of them); give engines sharing a mount
                disjoint ranges
  kvfs_index    the block index file (default ~/.cache/kvfs/vllm-<hash of
                mount, model, range>.sqlite)
  kvfs_layout   the layout of a page of vLLM's KV tensors: "vllm"
                ([kv_heads, block_size, 2 x head_size], the default)

The mount's geometry must fit the model: block_tokens = vLLM's
block_size, head_dim, element size and enough layers and KV heads, or the
spec refuses to start and names both. Only the vLLM versions in SUPPORTED
are accepted: the offloading API is marked experimental and changes
between releases (KVFS_VLLM_ANY_VERSION=1 tries anyway).

Memory the daemon cannot map (CPU tensors that are not in /dev/shm, as in
vLLM's CPU-only runs) goes through a host mirror: a /dev/shm copy of the
tensor, registered, that loads and stores pass through.
"""

import hashlib
import itertools
import mmap
import os
import queue
import tempfile
import threading
import time

from .blockindex import DEFAULT_DIR, BlockIndex, BlockIndexError
from .client import Kvfs, KvfsError
from .layouts import EngineLayout, LayoutError, Regions, chunk_pages, page_entries

SUPPORTED = ("0.34.0",)


def _check_version():
    import vllm

    v = getattr(vllm, "__version__", "unknown")
    if v.split("+")[0] not in SUPPORTED and os.environ.get("KVFS_VLLM_ANY_VERSION") != "1":
        raise ImportError(
            f"kvfs.vllm supports vLLM {', '.join(SUPPORTED)}; this is vLLM {v}, whose offloading "
            "API (vllm.v1.kv_offload) may differ. KVFS_VLLM_ANY_VERSION=1 tries anyway.")


_check_version()

from vllm.v1.kv_offload.base import (  # noqa: E402
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.pointer_utils import iter_pointer_groups  # noqa: E402

_ELEMENT = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
            "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
_MOUNT_ELEMENT = {"bf16": 2, "fp16": 2, "f16": 2, "fp32": 4, "f32": 4, "fp8": 1, "u8": 1}


class KvfsLoadStoreSpec(LoadStoreSpec):
    """Where a transfer's chunks live in kvfs: the first kvfs block of
    each chunk, in the order of the transfer's chunks."""

    def __init__(self, bases):
        self.bases = [int(b) for b in bases]

    def __repr__(self):
        return f"KvfsLoadStoreSpec({self.bases})"


class KvfsOffloadingManager(OffloadingManager):
    """The scheduler side: vLLM's offload keys -> kvfs chunks
    (kvfs.blockindex.BlockIndex; one scheduler thread, so no lock)."""

    def __init__(self, index):
        self.index = index

    def lookup(self, key, req_context):
        return LookupResult.HIT if self.index.lookup(bytes(key)) else LookupResult.MISS

    def prepare_load(self, keys, req_context):
        return KvfsLoadStoreSpec(self.index.prepare_load([bytes(k) for k in keys]))

    def complete_load(self, keys, req_context):
        self.index.complete_load([bytes(k) for k in keys])

    def prepare_store(self, keys, req_context):
        got = self.index.prepare_store([bytes(k) for k in keys])
        if got is None:
            return None
        to_store, evicted = got
        return PrepareStoreOutput(keys_to_store=[k for k, _ in to_store],
                                  store_spec=KvfsLoadStoreSpec([b for _, b in to_store]),
                                  evicted_keys=evicted)

    def complete_store(self, keys, req_context, success=True):
        self.index.complete_store([bytes(k) for k in keys], success)

    def on_new_request(self, req_context):
        return RequestOffloadingContext()

    def reset_cache(self):
        self.index.reset()

    def shutdown(self):
        self.index.close()


class _Mirror:
    """A /dev/shm copy of a CPU tensor the daemon cannot map, registered as
    a host region: stores copy pages in before the STORE, loads copy them
    out after the RESTORE."""

    def __init__(self, kv, flat):
        import torch

        self.flat = flat  # the tensor's bytes, as a 1-D int8 view
        n = flat.numel()
        fd, self.path = tempfile.mkstemp(dir="/dev/shm", prefix="kvfs-vllm-")
        try:
            os.ftruncate(fd, n)
            self.map = mmap.mmap(fd, n)
        finally:
            os.close(fd)
        self.view = torch.frombuffer(self.map, dtype=torch.int8)
        self.region = kv.register_host_region(self.path, n)

    def copy(self, offsets, size, into_mirror):
        for o in offsets:
            a, b = self.view[o:o + size], self.flat[o:o + size]
            (a.copy_(b) if into_mirror else b.copy_(a))

    def close(self, kv):
        try:
            kv.unregister(self.region)
        except KvfsError:
            pass
        del self.view
        self.map.close()
        os.unlink(self.path)


class _Job:
    __slots__ = ("job_id", "store", "entries", "event", "mirrors", "ticket", "error", "size", "t0",
                 "collected")


class KvfsOffloadingWorker(OffloadingWorker):
    """The worker side: loads and stores of vLLM pages as RESTORE/STORE
    tickets of strided entries. Submissions wait (on a thread of their
    own, not vLLM's) for the compute stream's work queued before them, as
    vLLM's own CPU worker does: a store reads what the model wrote, a load
    lands after the blocks' earlier writes."""

    def __init__(self, spec, kv_caches):
        import torch

        self.spec = spec
        self.kv = Kvfs(spec.mount)
        self.chunk = spec.blocks_per_chunk
        self.regions = Regions()
        self.mirrors = []      # (start, end, _Mirror)
        self.cuda = False
        refs = kv_caches.group_data_refs
        # kvfs layer of (group, data ref): refs numbered across groups.
        self.layer_base = list(itertools.accumulate([0] + [len(r) for r in refs[:-1]]))
        n_layers = sum(len(r) for r in refs)
        geo = spec.geometry
        if n_layers > geo["layers"]:
            raise LayoutError(f"the model's KV cache has {n_layers} layers; the mount {spec.mount} "
                              f"has {geo['layers']}")
        pages = {ref.page_size_bytes for group in refs for ref in group}
        if len(pages) != 1:
            raise LayoutError(f"layers of different page sizes ({sorted(pages)}) are not supported")
        page = pages.pop()
        el = _MOUNT_ELEMENT[geo["dtype"]]
        per_head = geo["block_tokens"] * 2 * geo["head_dim"] * el
        if page % per_head:
            raise LayoutError(
                f"a vLLM page of {page} bytes is not whole KV heads of the mount's geometry "
                f"(block_tokens {geo['block_tokens']} x 2 x head_dim {geo['head_dim']} x {el} bytes "
                f"= {per_head} bytes a head)")
        heads = page // per_head
        rank = spec.config.parallel.rank % max(spec.config.parallel.tp_size, 1)
        self.head_offset = rank * heads
        self.page = EngineLayout(spec.layout, 1, heads, geo["block_tokens"], geo["head_dim"], el)
        self.page.check_mount(geo, head_offset=self.head_offset)
        for t in kv_caches.tensors:
            x = t.tensor
            if x.dtype != torch.int8 or x.dim() != 2 or x.stride(1) != 1:
                raise LayoutError(f"a KV tensor of shape {tuple(x.shape)}, {x.dtype}, strides "
                                  f"{x.stride()}: vLLM's canonical (num_blocks, page bytes) int8 expected")
            length = x.shape[0] * x.stride(0)
            flat = x.as_strided((length,), (1,))  # the bytes of every block
            if x.is_cuda:
                self.cuda = True
                self.regions.add(x.data_ptr(), length, self.kv.register_tensor(flat))
            else:
                m = _Mirror(self.kv, flat)
                self.regions.add(x.data_ptr(), length, m.region)
                self.mirrors.append((x.data_ptr(), x.data_ptr() + length, m))
        self.torch = torch
        self.jobs = queue.Queue()
        self.pending = {}      # job_id -> _Job submitted (or failed)
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="kvfs-vllm", daemon=True)
        self.thread.start()

    # ---- building a transfer ------------------------------------------------

    def _pages(self, device_ptrs, spec):
        ptrs = device_ptrs.ptrs
        bases = spec.bases
        out, used = [], 0
        for g in iter_pointer_groups(device_ptrs, self.chunk):
            group_bases = bases[used:used + g.n_chunks]
            used += g.n_chunks
            span = ptrs[g.dev_ptr_offset:g.dev_ptr_offset + g.group_size * g.n_data_refs]
            first = device_ptrs.block_indices[g.group_idx]
            for layer, addr, kb in chunk_pages(span, g.group_size, g.n_data_refs, first, self.chunk,
                                               group_bases):
                out.append((self.layer_base[g.group_idx] + layer, addr, kb))
        if used != len(bases):
            raise LayoutError(f"a transfer of {used} chunks was given {len(bases)} kvfs chunks")
        return out

    def _submit(self, job_id, store, device_ptrs, spec):
        job = _Job()
        job.job_id, job.store, job.ticket, job.error = job_id, store, None, None
        job.collected, job.mirrors, job.size = False, [], 0
        job.t0 = time.perf_counter()
        try:
            pages = self._pages(device_ptrs, spec)
            job.entries = page_entries(self.page, self.regions, pages, self.head_offset)
            job.size = len(pages) * self.page.layer_bytes
            job.mirrors = self._mirror_pages(pages)
            job.event = None
            if self.cuda:
                job.event = self.torch.cuda.Event()
                job.event.record(self.torch.cuda.current_stream())
            if store and job.mirrors:
                for m, offsets in job.mirrors:
                    m.copy(offsets, self.page.layer_bytes, True)
        except Exception as e:  # reported through get_finished
            job.error = e
        with self.lock:
            self.pending[job_id] = job
        if job.error is None:
            if job.event is None:
                self._send(job)  # nothing to wait for: admission only, no copy waited on
            else:
                self.jobs.put(job)
        return True

    def _mirror_pages(self, pages):
        if not self.mirrors:
            return []
        by = {}
        for _, addr, _ in pages:
            for start, end, m in self.mirrors:
                if start <= addr < end:
                    by.setdefault(id(m), (m, []))[1].append(addr - start)
        return list(by.values())

    def _send(self, job):
        try:
            send = self.kv.store if job.store else self.kv.restore
            job.ticket = send(job.entries, wait=False)
        except Exception as e:
            job.error = e

    def _run(self):
        """Submits jobs whose GPU work must finish first (CUDA tensors)."""
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job.event.synchronize()
            except Exception as e:
                job.error = e
                continue
            self._send(job)

    # ---- vLLM's worker API ------------------------------------------------------

    def submit_store(self, job_id, device_ptrs, dst_spec):
        return self._submit(job_id, True, device_ptrs, dst_spec)

    def submit_load(self, job_id, src_spec, device_ptrs, expedited=False):
        return self._submit(job_id, False, device_ptrs, src_spec)

    def _collect(self, job, block):
        """Collects the job's ticket (waiting, with block): True once it is
        done, failed or not; a load's mirrored pages are copied out then."""
        if job.collected or job.error is not None:
            return True
        while job.ticket is None and job.error is None:
            if not block:
                return False
            time.sleep(0.0002)
        if job.error is None:
            try:
                if block:
                    self.kv.wait(job.ticket)
                elif not self.kv.done(job.ticket):
                    return False
                if not job.store:
                    for m, offsets in job.mirrors:
                        m.copy(offsets, self.page.layer_bytes, False)
            except KvfsError as e:
                job.error = e
        job.collected = True
        return True

    def _finish(self, job, block):
        """A TransferResult once the job is done, else None."""
        if not self._collect(job, block):
            return None
        if job.error is not None:
            import logging

            logging.getLogger("kvfs.vllm").error("kvfs %s of job %d failed: %s",
                                                 "store" if job.store else "load", job.job_id, job.error)
        with self.lock:
            self.pending.pop(job.job_id, None)
        return TransferResult(job_id=job.job_id, success=job.error is None,
                              transfer_size=job.size if job.error is None else None,
                              transfer_time=time.perf_counter() - job.t0)

    def get_finished(self):
        with self.lock:
            jobs = list(self.pending.values())
        out = []
        for job in jobs:
            r = self._finish(job, block=False)
            if r is not None:
                out.append(r)
        return out

    def wait(self, job_ids):
        """Waits for the jobs; their results still come from get_finished."""
        for j in job_ids:
            with self.lock:
                job = self.pending.get(j)
            if job is not None:
                self._collect(job, block=True)

    def shutdown(self):
        self.jobs.put(None)
        self.thread.join()
        with self.lock:
            jobs = list(self.pending.values())
        for job in jobs:
            self._finish(job, block=True)
        for _, _, m in self.mirrors:
            m.close(self.kv)
        self.kv.close()


class KvfsOffloadingSpec(OffloadingSpec):
    """vLLM's OffloadingSpec for a kvfs mount (see the module note)."""

    def __init__(self, config):
        super().__init__(config)
        extra = self.extra_config
        self.mount = extra.get("kvfs_mount")
        if not self.mount:
            raise ValueError('kvfs.vllm needs "kvfs_mount" (a kvfs mount point) in kv_connector_extra_config')
        try:
            with Kvfs(self.mount) as kv:
                self.geometry = dict(kv.layout)
        except (OSError, KvfsError) as e:
            raise ValueError(f"kvfs_mount {self.mount!r} is not a usable kvfs mount: {e}") from e
        geo = self.geometry
        self.layout = extra.get("kvfs_layout", "vllm")
        if self.layout != "vllm":
            raise LayoutError(f'kvfs_layout {self.layout!r}: kvfs.vllm knows "vllm" '
                              "([kv_heads, block_size, 2 x head_size] a page)")
        for g in config.groups:
            if g.tokens_per_block != geo["block_tokens"]:
                raise LayoutError(
                    f"vLLM's blocks hold {g.tokens_per_block} tokens; the mount {self.mount} has "
                    f"block_tokens {geo['block_tokens']}: mount with --block-tokens {g.tokens_per_block} "
                    f"(or run vLLM with --block-size {geo['block_tokens']})")
        el = _ELEMENT.get(config.model.dtype)
        if el is not None and el != _MOUNT_ELEMENT.get(geo["dtype"]):
            raise LayoutError(f"vLLM's KV cache is {config.model.dtype}; the mount {self.mount} "
                              f"holds {geo['dtype']}")
        first, count = 0, geo["blocks"]
        if "kvfs_blocks" in extra:
            try:
                first, count = (int(x) for x in str(extra["kvfs_blocks"]).split(":"))
            except ValueError:
                raise ValueError(f'kvfs_blocks {extra["kvfs_blocks"]!r}: give "FIRST:COUNT"') from None
            if first < 0 or count < 1 or first + count > geo["blocks"]:
                raise ValueError(f"kvfs_blocks {first}:{count} is outside the mount's "
                                 f"{geo['blocks']} blocks")
        self.block_range = (first, count)
        tag = hashlib.sha256(
            f"{os.path.realpath(self.mount)}|{config.model.name}|{first}:{count}|"
            f"{self.blocks_per_chunk}".encode()).hexdigest()[:16]
        self.index_path = extra.get("kvfs_index") or os.path.join(DEFAULT_DIR, f"vllm-{tag}.sqlite")
        self._manager = None

    def get_manager(self):
        if self._manager is None:
            first, count = self.block_range
            try:
                index = BlockIndex(self.index_path, first, count, self.blocks_per_chunk)
            except BlockIndexError as e:
                raise ValueError(str(e)) from e
            # Chunks the mount no longer holds (a mount wiped or replaced
            # since) are dropped, not served.
            with Kvfs(self.mount) as kv:
                def holds(base):
                    return kv.query([(0, base, 0, "K")])[0][0] != "empty"
                index.drop_missing(holds)
            self._manager = KvfsOffloadingManager(index)
        return self._manager

    def get_worker(self, kv_caches):
        return KvfsOffloadingWorker(self, kv_caches)
