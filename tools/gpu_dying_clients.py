"""Clients that die with GPU work in flight, against a running mount:
100 fresh clients in a row, each registering CUDA tensors (CUDA IPC
regions), submitting RESTOREs into and STOREs out of GPU memory without
waiting, then killed with SIGKILL. Afterwards the daemon must still
serve, and its resident memory, pinned host memory and device memory (its
own gauges in .kvfs/stats, and nvidia-smi's figure), open IPC mappings,
open files and mappings must be flat (figures before and after). Flat
allows what does not grow with the kills: 64 MiB of RSS and of pinned and
device memory, and 32 mappings (the daemon's buffer pools, at most 16
buffers of a kind, may reach a higher mark than the warm-up's, and a
thread started on first need maps a stack and its guard page). A leak
of one mapping a client would add 100; every IPC mapping must be closed.

    python3 tools/gpu_dying_clients.py MOUNT [--kills 100] [--parallel 8]

Clients start --parallel at a time (each takes seconds to load torch and
make its CUDA context); each is killed as soon as its tickets are in flight.
"""

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from kvfs import Kvfs
def say(m):
    print(m, file=sys.stderr, flush=True) if len(sys.argv) > 3 else None
kv = Kvfs(sys.argv[1])
say("opened")
g = kv.layout
gb, n = g["group_bytes"], min(g["groups"], 1024)
keys = []
for i in range(n):
    j = i // 2
    keys.append((j // (g["kv_heads"] * g["blocks"]) % g["layers"], (j // g["kv_heads"]) % g["blocks"],
                 j % g["kv_heads"], "KV"[i % 2]))
src = torch.randint(0, 256, (n * gb,), dtype=torch.uint8, device="cuda")
dst = torch.empty(n * gb, dtype=torch.uint8, device="cuda")
rs, rd = kv.register_tensor(src), kv.register_tensor(dst)
torch.cuda.synchronize()
say("registered")
kv.store([k + (rs, i * gb) for i, k in enumerate(keys)])
say("stored")
st = kv.encode_entries([k + (rs, i * gb) for i, k in enumerate(keys)])
re = kv.encode_entries([k + (rd, i * gb) for i, k in enumerate(keys)])
for _ in range(8):
    kv.restore(re, wait=False)
    kv.store(st, wait=False)
print("ready", flush=True)
sys.stdin.read()
"""


def gauges(mount):
    out = {}
    for line in open(os.path.join(mount, ".kvfs", "stats")):
        k = line.split()
        if len(k) == 2 and k[0] in ("kvfs_gpu_pinned_bytes", "kvfs_gpu_device_bytes", "kvfs_gpu_ipc_mappings"):
            out[k[0]] = int(float(k[1]))
    if len(out) != 3:
        raise SystemExit(f"{mount}/.kvfs/stats lacks the kvfs_gpu_* gauges (an older kvfs?)")
    return out


def daemon(mount):
    pid = int(open(os.path.join(mount, ".kvfs", "pid")).read())
    st = open(f"/proc/{pid}/status").read()
    kb = {l.split(":")[0]: int(l.split()[1]) for l in st.splitlines()
          if l.split(":")[0] in ("VmRSS", "VmPin", "VmLck")}
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    maps = sum(1 for _ in open(f"/proc/{pid}/maps"))
    dev = 0
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout
        dev = sum(int(l.split(",")[1]) for l in out.splitlines() if l.split(",")[0].strip() == str(pid))
    except (OSError, ValueError, IndexError):
        pass
    g = gauges(mount)
    return {"rss_kib": kb.get("VmRSS", 0), "pinned_mib": g["kvfs_gpu_pinned_bytes"] >> 20,
            "device_pool_kib": g["kvfs_gpu_device_bytes"] >> 10, "ipc_mappings": g["kvfs_gpu_ipc_mappings"],
            "fds": fds, "maps": maps, "device_mib": dev}


def kill_some(mount, n):
    """Starts n clients at once and kills each once its tickets are in flight."""
    verbose = ["-v"] if os.environ.get("KVFS_DYING_VERBOSE") else []
    ps = [subprocess.Popen([sys.executable, "-c", CHILD, mount, os.path.join(HERE, "python")] + verbose,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    bad = None
    for p in ps:
        line = p.stdout.readline().strip()
        if line != "ready":
            bad = line
        p.kill()
        p.wait()
    if bad is not None:
        for p in ps:
            p.kill()
        raise SystemExit(f"a client did not get its GPU tickets in flight: {bad!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mount")
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--parallel", type=int, default=8, help="clients alive at once (default 8)")
    a = ap.parse_args()
    if a.kills < 1 or a.parallel < 1:
        raise SystemExit("--kills and --parallel must be at least 1")
    for _ in range(2):  # warm-up at full width: pools, the CUDA context, IPC caches
        kill_some(a.mount, a.parallel)
    time.sleep(1)
    before = daemon(a.mount)
    t = time.time()
    done = 0
    while done < a.kills:
        n = min(a.parallel, a.kills - done)
        kill_some(a.mount, n)
        done += n
        print(f"  {done} killed, {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    after = before
    for _ in range(50):
        time.sleep(0.2)
        after = daemon(a.mount)
        if (after["fds"] <= before["fds"] and after["maps"] <= before["maps"] + 32
                and after["ipc_mappings"] <= before["ipc_mappings"]):
            break
    print(f"{a.kills} clients killed with GPU tickets in flight in {time.time() - t:.0f} s; daemon before -> after: "
          + ", ".join(f"{k} {before[k]} -> {after[k]}" for k in before))
    sys.path.insert(0, os.path.join(HERE, "python"))
    from kvfs import Kvfs
    with Kvfs(a.mount) as kv:
        kv.query([(0, 0, 0, "K")])
    ok = (after["fds"] <= before["fds"] and after["maps"] <= before["maps"] + 32
          and after["ipc_mappings"] <= before["ipc_mappings"]
          and after["rss_kib"] <= before["rss_kib"] + 64 * 1024 and after["pinned_mib"] <= before["pinned_mib"] + 64
          and after["device_pool_kib"] <= before["device_pool_kib"] + 64 * 1024
          and after["device_mib"] <= before["device_mib"] + 64)
    print("dying GPU clients: " + ("flat, still serving" if ok else "GREW"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
