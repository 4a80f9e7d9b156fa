"""`python -m kvfs.hf demo`: KvfsCache with a random-initialised model.

No downloads: the model is built from a config (Llama-3.2-1B-shaped or
Llama-3.1-8B-shaped) with fixed seeds, so two processes get the same
weights. For each shape, in one run:

1. TTFT of a long prompt: full prefill (DynamicCache) vs its prefix
   restored from kvfs in a second process (`load_prefix`), after a first
   process saved it (`save_prefix`).
2. The second process checks its output equals recomputing: greedy tokens
   identical, first-token logits within bf16 tolerance.
3. Decode tokens/s and peak GPU memory (beyond the weights) of plain
   DynamicCache, transformers' offloaded cache and KvfsCache, same prompt
   and length.

The mount must have the shape's geometry (layers, KV heads, head_dim,
bf16); the demo says which `kvfs mount` flags it needs.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

SHAPES = {
    # Llama-3.2-1B: 16 layers, 32 query heads, 8 KV heads, head_dim 64.
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    # Llama-3.1-8B: 32 layers, 32 query heads, 8 KV heads, head_dim 128.
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def mount_flags(shape):
    s = SHAPES[shape]
    return (f"--layers {s['num_hidden_layers']} --kv-heads {s['num_key_value_heads']} "
            f"--head-dim {s['head_dim']} --block-tokens 16 --dtype bf16")


def build(shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                      tie_word_embeddings=False, **SHAPES[shape])
    cfg.dtype = torch.bfloat16
    torch.manual_seed(1234)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    return model


def prompt(n, batch=1):
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, 128000, (batch, n), generator=g).cuda()


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def gen(model, ids, new, cache=None, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, past_key_values=cache,
                          return_dict_in_generate=True, output_logits=True, pad_token_id=0, **kw)


def phase_save(a):
    """Process A: prefill the prompt into a KvfsCache and save the prefix."""
    from kvfs.hf import KvfsCache

    model = build(a.shape)
    ids = prompt(a.prompt)
    gen(model, prompt(64), 1)  # warm-up (kernels, cuBLAS)
    with KvfsCache(model.config, a.mount, max_tokens=a.prompt + a.new + 16, index=a.index) as c:
        t, _ = timed(lambda: gen(model, ids, 1, c))
        saved = c.save_prefix(ids)
    return {"prefill_into_kvfs_s": t, "saved_blocks": saved[0]}


def phase_load(a):
    """Process B: reference full prefill, then the prefix restored from kvfs."""
    from kvfs.hf import KvfsCache

    model = build(a.shape)
    ids = prompt(a.prompt)
    gen(model, prompt(64), 1)
    t_full, ref1 = timed(lambda: gen(model, ids, 1))
    ref = gen(model, ids, a.new)
    with KvfsCache(model.config, a.mount, max_tokens=a.prompt + a.new + 16, index=a.index) as c:
        n = c.load_prefix(ids)
        t_first, out1 = timed(lambda: gen(model, ids, 1, c))
    # Again, with the daemon's pinned staging pool warm (as it is once any
    # client has restored batches this large).
    with KvfsCache(model.config, a.mount, max_tokens=a.prompt + a.new + 16, index=a.index) as c:
        c.load_prefix(ids)
        t_rest, _ = timed(lambda: gen(model, ids, 1, c))
    with KvfsCache(model.config, a.mount, max_tokens=a.prompt + a.new + 16, index=a.index) as c:
        c.load_prefix(ids)
        out = gen(model, ids, a.new, c)
    same = torch.equal(ref.sequences, out.sequences)
    l_ref, l_out = ref1.logits[0].float(), out1.logits[0].float()
    diff = (l_ref - l_out).abs().max().item()
    scale = l_ref.abs().max().item()
    return {"ttft_full_s": t_full, "ttft_restored_s": t_rest, "ttft_restored_first_s": t_first,
            "prefix_tokens": n,
            "greedy_identical": same, "logit_max_abs_diff": diff, "logit_max_abs": scale,
            "logits_close": diff <= 0.05 * max(scale, 1.0),
            "tokens_ref": ref.sequences[0, -a.new:].tolist(),
            "tokens_kvfs": out.sequences[0, -a.new:].tolist()}


def phase_decode(a):
    """Decode rate and peak memory of three caches, same prompt and length."""
    from transformers import DynamicCache

    from kvfs.hf import KvfsCache

    model = build(a.shape)
    ids = prompt(a.prompt)
    gen(model, prompt(64), 2)
    weights = torch.cuda.memory_allocated()
    out = {}
    kinds = {
        "dynamic": lambda: (DynamicCache(), {}),
        "offloaded": lambda: (None, {"cache_implementation": "offloaded"}),
        "kvfs": lambda: (KvfsCache(model.config, a.mount, max_tokens=a.prompt + a.decode + 16,
                                   index=a.index), {}),
    }
    for name, make in kinds.items():
        rates = []
        for _ in range(2):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            c1, kw = make()
            t1, _ = timed(lambda: gen(model, ids, 1, c1, **kw))
            c2, kw = make()
            tn, _ = timed(lambda: gen(model, ids, a.decode, c2, **kw))
            for c in (c1, c2):
                if hasattr(c, "close"):
                    c.close()
            rates.append((a.decode - 1) / max(tn - t1, 1e-9))
        out[name] = {"tokens_per_s": max(rates),
                     "peak_gib_beyond_weights": (torch.cuda.max_memory_allocated() - weights) / 2**30}
    out["kvfs_vs_offloaded"] = out["kvfs"]["tokens_per_s"] / out["offloaded"]["tokens_per_s"]
    return out


def run_phase(a, phase):
    cmd = [sys.executable, "-m", "kvfs.hf", "demo", "--phase", phase, "--shape", a.shape,
           "--mount", a.mount, "--index", a.index, "--prompt", str(a.prompt),
           "--new", str(a.new), "--decode", str(a.decode)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"phase {phase} failed:\n{r.stdout}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv):
    ap = argparse.ArgumentParser(prog="python -m kvfs.hf demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mount", required=True, help="a kvfs mount with the shape's geometry")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--prompt", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--new", type=int, default=16, help="tokens generated for the identity check")
    ap.add_argument("--decode", type=int, default=64, help="tokens generated for the decode rate")
    ap.add_argument("--index", default=None, help="prefix index (default: a fresh temporary one)")
    ap.add_argument("--phase", choices=["save", "load", "decode"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.phase:
        res = {"save": phase_save, "load": phase_load, "decode": phase_decode}[a.phase](a)
        print(json.dumps(res))
        return 0
    from kvfs import Kvfs

    with Kvfs(a.mount) as kv:
        g = kv.layout
    s = SHAPES[a.shape]
    if (g["layers"], g["kv_heads"], g["head_dim"], g["dtype"]) != (
            s["num_hidden_layers"], s["num_key_value_heads"], s["head_dim"], "bf16"):
        raise SystemExit(f"{a.mount} has {g['layers']} layers, {g['kv_heads']} KV heads, head_dim "
                         f"{g['head_dim']}, {g['dtype']}; the {a.shape} shape needs a mount made with "
                         f"{mount_flags(a.shape)}")
    tmp = None
    if a.index is None:
        tmp = tempfile.mkdtemp(prefix="kvfs-demo-")
        a.index = os.path.join(tmp, "index.sqlite")
    print(f"== kvfs.hf demo: {a.shape} shape, {a.prompt}-token prompt, mount {a.mount}", flush=True)
    save = run_phase(a, "save")
    print(f"process A: prefill into KvfsCache {save['prefill_into_kvfs_s'] * 1e3:.0f} ms, "
          f"{save['saved_blocks']} blocks saved and indexed", flush=True)
    load = run_phase(a, "load")
    ratio = load["ttft_restored_s"] / load["ttft_full_s"]
    print(f"process B: TTFT full prefill {load['ttft_full_s'] * 1e3:.1f} ms, prefix restored from kvfs "
          f"({load['prefix_tokens']} tokens) {load['ttft_restored_s'] * 1e3:.1f} ms = {ratio:.3f} of full "
          f"(target <= 0.2 for 8b); the process's first restore {load['ttft_restored_first_s'] * 1e3:.1f} ms",
          flush=True)
    print(f"  greedy tokens identical to recomputing: {load['greedy_identical']}; first-token logits "
          f"max |diff| {load['logit_max_abs_diff']:.4f} (max |logit| {load['logit_max_abs']:.2f}): "
          f"{'within' if load['logits_close'] else 'OUTSIDE'} bf16 tolerance", flush=True)
    if not load["greedy_identical"]:
        print(f"  reference {load['tokens_ref']}\n  kvfs      {load['tokens_kvfs']}")
    dec = run_phase(a, "decode")
    for name in ("dynamic", "offloaded", "kvfs"):
        d = dec[name]
        print(f"decode {name:<10} {d['tokens_per_s']:8.1f} tokens/s, peak GPU memory beyond the "
              f"weights {d['peak_gib_beyond_weights']:.2f} GiB", flush=True)
    print(f"KvfsCache vs transformers' offloaded cache: {dec['kvfs_vs_offloaded']:.2f}x (target >= 1.0)")
    ok = load["greedy_identical"] and load["logits_close"]
    print(f"== checks: {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1
