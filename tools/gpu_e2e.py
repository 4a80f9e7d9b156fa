"""kvfs GPU end-to-end check and bandwidth runs, against a running mount.

    python3 tools/gpu_e2e.py MOUNT [--batch 1024] [--inflight 4] [--rounds 32]
    python3 tools/gpu_e2e.py MOUNT --guard      # a mount with a 2-slot T1
    python3 tools/gpu_e2e.py MOUNT --row 256    # strided: rows of 256 B, pitch 512

Correctness: store random groups from a GPU tensor, overwrite the tensor,
restore, and compare bit for bit, with a torch stream that waits on the
ticket's CUDA IPC event (no host round trip) before the comparing kernel.
Bandwidth: restores of T1-resident groups into a registered GPU region,
up to --inflight tickets at once, next to one large pinned host-to-device
copy of the same total bytes in the same run (torch). For context: one
synchronous ticket at a time, one cudaMemcpyAsync per group, and misses.
Stores of the same batch shape (GPU -> T1) next to one large pinned
device-to-host copy.
--guard: a T1 of 2 slots, 4 groups, async restore then evicting writes;
every restored group must be intact (a slot is never reused under a copy).
"""

import argparse
import os
import statistics
import sys
import time

import torch

# The kvfs package beside this script (tools/python), installed or not.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "python"))
from kvfs import Kvfs  # noqa: E402


WAIT_S = 60  # a ticket that takes longer than this is a failure, not a wait
DONE_WORDS = True  # --no-done-words: leave done words out (check and figure)
STORE_CHUNK = 16 << 20  # the daemon's staging per GPU store launch (gpu::engine::STORE_CHUNK)


def log(*a):
    print(*a, flush=True)


def keys_of(layout, n, start=0):
    """The first n group keys of the layout from index `start`, in index order."""
    heads, blocks = layout["kv_heads"], layout["blocks"]
    out = []
    for i in range(start, start + n):
        kind = "KV"[i % 2]
        j = i // 2
        head = j % heads
        j //= heads
        block = j % blocks
        layer = j // blocks
        out.append((layer, block, head, kind))
    return out


class Place:
    """Where group i of a batch lies in its tensor: contiguous at i x gb,
    or (--row R) as gb/R rows of R bytes `pitch` apart, pitch/R groups'
    rows interleaved (pitch 2R: K and V of a head side by side, as in
    vLLM's layout). Either way a batch of n groups fills n x gb bytes."""

    def __init__(self, gb, row=0, pitch=0):
        self.gb, self.row = gb, row
        self.pitch = pitch or 2 * row
        if row and (gb % row or self.pitch % row or self.pitch < row):
            raise SystemExit(f"--row {row} --pitch {self.pitch}: rows must divide the {gb}-byte group "
                             "and the pitch be a multiple of the row")
        self.k = self.pitch // row if row else 1

    def entry(self, key, region, i):
        if not self.row:
            return key + (region, i * self.gb)
        p, lane = divmod(i, self.k)
        return key + (region, p * self.k * self.gb + lane * self.row, self.row, self.pitch)

    def gather(self, t, n):
        """The groups of a batch of n in tensor t (so placed), in order."""
        if not self.row:
            return t[:n * self.gb].view(n, self.gb)
        rows = self.gb // self.row
        return t[:n * self.gb].view(n // self.k, rows, self.k, self.row).transpose(1, 2).reshape(n, self.gb)

    def __str__(self):
        return (f"{self.gb // self.row} rows of {self.row} B at pitch {self.pitch}" if self.row
                else "contiguous")


def correctness_strided(kv, gb, dev, place):
    """Groups stored contiguously, restored strided (reverse order), stored
    back strided from there into other groups, and read back: bit-identical."""
    n = 256 - 256 % place.k
    data = torch.randint(0, 256, (n * gb,), dtype=torch.uint8, device=dev)
    region = kv.register_tensor(data)
    keys = keys_of(kv.layout, 2 * n)
    torch.cuda.synchronize()
    kv.store([k + (region, i * gb) for i, k in enumerate(keys[:n])])
    back = torch.zeros(n * gb, dtype=torch.uint8, device=dev)
    r2 = kv.register_tensor(back)
    kv.restore([place.entry(k, r2, n - 1 - i) for i, k in enumerate(keys[:n])])
    torch.cuda.synchronize()
    assert torch.equal(place.gather(back, n).flip(0), data.view(n, gb)), "a strided restore moved bytes"
    kv.store([place.entry(k, r2, n - 1 - i) for i, k in enumerate(keys[n:])])
    data.zero_()
    torch.cuda.synchronize()
    kv.restore([k + (region, i * gb) for i, k in enumerate(keys[n:])])
    torch.cuda.synchronize()
    assert torch.equal(data.view(n, gb), place.gather(back, n).flip(0)), "a strided store moved bytes"
    # One batch of two shapes (strided and contiguous entries): the daemon
    # moves it in pieces of the largest size dividing both.
    h = n // 2 - (n // 2) % place.k
    back.zero_()
    flat = torch.zeros(n * gb, dtype=torch.uint8, device=dev)
    r3 = kv.register_tensor(flat)
    torch.cuda.synchronize()
    kv.restore([place.entry(k, r2, i) if i < h else k + (r3, (i - h) * gb) for i, k in enumerate(keys[n:])])
    torch.cuda.synchronize()
    want = data.view(n, gb)
    assert torch.equal(place.gather(back, h), want[:h]) and torch.equal(flat[:(n - h) * gb].view(-1, gb), want[h:]), \
        "a restore of strided and contiguous entries in one batch moved bytes"
    kv.unregister(region)
    kv.unregister(r2)
    kv.unregister(r3)
    print(f"correctness: {n} groups restored into and stored from GPU memory as {place}, and a batch "
          "mixing that shape with contiguous entries, bit-identical")


def done_words(kv, words):
    """Registers `words` as the session's done words: the region id, or
    None with --no-done-words or where the device cannot write them
    (EOPNOTSUPP, said so)."""
    import errno
    if not DONE_WORDS:
        return None
    try:
        return kv.register_done_words(words)
    except OSError as e:
        if e.errno != errno.EOPNOTSUPP:
            raise
        print(f"done words: not on this device ({e})")
        return None


def correctness(kv, gb, dev):
    # A device the driver does not report is refused with ENODEV, naming the count.
    import errno
    try:
        kv.register_cuda_region(bytes(64), 4096, device=torch.cuda.device_count())
        raise AssertionError("a REGISTER of a device that does not exist was accepted")
    except OSError as e:
        assert e.errno == errno.ENODEV, e
        log(f"REGISTER of CUDA device {torch.cuda.device_count()}: refused with ENODEV ({e})")
    n = 256
    data = torch.randint(0, 256, (n * gb,), dtype=torch.uint8, device=dev)
    expect = data.clone()
    region = kv.register_tensor(data)
    log("registered a CUDA region")
    keys = keys_of(kv.layout, n)
    torch.cuda.synchronize()
    t = kv.store([k + (region, i * gb) for i, k in enumerate(keys)], wait=False)
    kv.wait(t, timeout=WAIT_S)
    log(f"stored {n} groups from GPU memory")
    data.zero_()
    torch.cuda.synchronize()
    # Restore in reverse order into a second tensor, and wait on the IPC event.
    back = torch.zeros(n * gb, dtype=torch.uint8, device=dev)
    r2 = kv.register_tensor(back)
    t = kv.restore([k + (r2, (n - 1 - i) * gb) for i, k in enumerate(keys)], wait=False)
    assert t.ipc_event_handle is not None, "a CUDA restore carries an IPC event"
    log("restore submitted; waiting on its IPC event from a torch stream")
    kv.wait(t, timeout=WAIT_S)
    log("restore ticket completed")
    ev = torch.cuda.Event.from_ipc_handle(dev, t.ipc_event_handle)
    s = torch.cuda.Stream(dev)
    s.wait_event(ev)
    with torch.cuda.stream(s):
        flipped = back.view(n, gb).flip(0).reshape(-1)
        same = torch.equal(flipped, expect)
    assert same, "restored bytes differ (compared on a stream that waited on the IPC event)"
    print(f"correctness: {n} groups of {gb} B stored from and restored into GPU memory, bit-identical; "
          "the comparing stream waited on the ticket's IPC event")
    # Done words: the same restore (in order now) names done word 1; a
    # stream waits on the word, compares, and records an event, all before
    # the host learns anything of the ticket. Then word 1 again, for the
    # next ticket.
    words = torch.zeros(4, dtype=torch.int64, device=dev)
    rw = done_words(kv, words)
    for rep in range(2 if rw is not None else 0):
        back.zero_()
        torch.cuda.synchronize()
        t = kv.restore([k + (r2, i * gb) for i, k in enumerate(keys)], wait=False, done_word=1)
        kv.wait_done_word(s, t, 1)
        with torch.cuda.stream(s):
            same = (back == expect).all()
            seen = torch.cuda.Event()
            seen.record(s)
        until = time.time() + WAIT_S
        while not seen.query():
            assert time.time() < until, "a stream waiting on its done word never went on"
            time.sleep(0.001)
        assert bool(same), "restored bytes differ (compared on a stream that waited on the done word)"
        assert int(words[1]) == int(t), (int(words[1]), int(t))
        kv.wait(t, timeout=WAIT_S)
    if rw is not None:
        kv.unregister(rw)
    kv.unregister(region)
    kv.unregister(r2)
    if rw is not None:
        print("correctness: the same restore twice naming done word 1: a stream that waited on the word "
              "(not the IPC event) saw the bytes, and the word held each ticket")
    # A store larger than the daemon's 16 MiB staging runs in several
    # launches: scattered sources (reverse order), read back in order.
    m = min(2 * (STORE_CHUNK // gb) + 3, kv.layout["t1_slots"] // 2, kv.layout["groups"])
    data = torch.randint(0, 256, (m * gb,), dtype=torch.uint8, device=dev)
    region = kv.register_tensor(data)
    keys = keys_of(kv.layout, m)
    torch.cuda.synchronize()
    kv.wait(kv.store([k + (region, (m - 1 - i) * gb) for i, k in enumerate(keys)], wait=False), timeout=WAIT_S)
    back = torch.zeros(m * gb, dtype=torch.uint8, device=dev)
    r2 = kv.register_tensor(back)
    kv.wait(kv.restore([k + (r2, i * gb) for i, k in enumerate(keys)], wait=False), timeout=WAIT_S)
    torch.cuda.synchronize()
    assert torch.equal(back.view(m, gb), data.view(m, gb).flip(0)), "a multi-launch store lost or moved bytes"
    kv.unregister(region)
    kv.unregister(r2)
    print(f"correctness: one store of {m} groups ({m * gb / 2**20:.1f} MiB, several staging launches) from "
          "scattered GPU memory, restored bit-identical")
    # A restore (launched in parts on admission, the first of 64 groups: the
    # daemon's default one ticket at a time, or KVFS_RESTORE_PART_GROUPS=on
    # in its environment) whose last part is not in T1: the
    # groups there were never written, so they restore as zeros, through
    # the executor, after the parts already launched. Then the other way
    # round: the first part not in T1, the rest T1-resident.
    p = 256
    if m >= 3 * p:
        fresh = keys_of(kv.layout, p, start=kv.layout["groups"] - p)
        for name, ks, want in (
            ("last", keys[:3 * p] + fresh, [(0, 3 * p, False), (3 * p, 4 * p, True)]),
            ("first", fresh + keys[:3 * p], [(0, p, True), (p, 4 * p, False)]),
        ):
            back = torch.full((4 * p * gb,), 0xAB, dtype=torch.uint8, device=dev)
            r2 = kv.register_tensor(back)
            kv.wait(kv.restore([k + (r2, i * gb) for i, k in enumerate(ks)], wait=False), timeout=WAIT_S)
            torch.cuda.synchronize()
            rows = back.view(4 * p, gb)
            for a, b, zero in want:
                if zero:
                    assert int(rows[a:b].count_nonzero()) == 0, f"never-written groups ({name} part) restored non-zero"
                else:
                    assert torch.equal(rows[a:b], data.view(m, gb).flip(0)[a if name == "last" else a - p:(b if name == "last" else b - p)]), \
                        f"T1-resident groups of a restore whose {name} part is not in T1 moved bytes"
            kv.unregister(r2)
        print(f"correctness: restores of {4 * p} groups whose last or first {p} were never written "
              "(zeros) and the rest T1-resident, bit-identical")
    # A restore of over 2048 groups, one ticket at a time: the daemon's
    # executor pins and describes it (in parts, each let through as it is
    # described, with KVFS_RESTORE_LATER_PARTS=auto in the daemon's
    # environment); never-written groups (zeros, read from the backing)
    # in the first part and across the next two parts' boundary.
    if m >= 2400:
        fresh = keys_of(kv.layout, 600, start=kv.layout["groups"] - 600)
        ks = fresh[:300] + keys[:1200] + fresh[300:] + keys[1200:2400]
        zero = [(0, 300), (1500, 1800)]
        src = [(300, 0, 1200), (1800, 1200, 2400)]
        back = torch.full((len(ks) * gb,), 0xAB, dtype=torch.uint8, device=dev)
        r2 = kv.register_tensor(back)
        kv.wait(kv.restore([k + (r2, i * gb) for i, k in enumerate(ks)], wait=False), timeout=WAIT_S)
        torch.cuda.synchronize()
        rows, want = back.view(len(ks), gb), data.view(m, gb).flip(0)
        for a, b in zero:
            assert int(rows[a:b].count_nonzero()) == 0, f"never-written groups {a}..{b} of a {len(ks)}-group restore restored non-zero"
        for at, a, b in src:
            assert torch.equal(rows[at:at + b - a], want[a:b]), f"T1-resident groups {at}..{at + b - a} of a {len(ks)}-group restore moved bytes"
        kv.unregister(r2)
        print(f"correctness: a restore of {len(ks)} groups (600 never written, at its start and middle), "
              "one ticket at a time, bit-identical")


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bandwidth(kv, gb, dev, batch, inflight, rounds, reps, trace=None, place=None, use_ring=False):
    layout = kv.layout
    t1_groups = layout["t1_slots"]
    # Enough groups for `inflight` stores in flight on distinct groups.
    hot = min(batch * max(2, inflight), t1_groups // 2)
    if hot < 2 * batch:
        raise SystemExit(f"T1 holds {t1_groups} groups; need at least {4 * batch} for batches of {batch}")
    keys = keys_of(layout, hot)
    src = torch.randint(0, 256, (hot * gb,), dtype=torch.uint8, device=dev)
    rs = kv.register_tensor(src)
    torch.cuda.synchronize()
    kv.store([k + (rs, i * gb) for i, k in enumerate(keys)])
    states = kv.query(keys)
    resident = sum(1 for s, _ in states if s == "t1")
    dst = torch.empty(batch * gb, dtype=torch.uint8, device=dev)
    rd = kv.register_tensor(dst)
    g = torch.Generator().manual_seed(1)

    def entries():
        pick = torch.randperm(hot, generator=g)[:batch].tolist()
        return [place.entry(keys[p], rd, i) for i, p in enumerate(pick)]

    # Encoded once, outside the timed runs: the figure is kvfs's, not the
    # time Python takes to pack 1024 entries.
    batches = [kv.encode_entries(entries()) for _ in range(rounds)]
    total = rounds * batch * gb

    # Stores of new groups below: `fresh_n` runs of `new_rounds` batches,
    # all of them in half of T1 (half the runs through the ring, with it).
    fresh_n = reps * (2 if use_ring else 1)
    new_rounds = min(rounds, (t1_groups // 2) // (fresh_n * batch))
    calls = {"restore": 0.0, "wait": 0.0}
    spans = []  # (ticket, wall time the RESTORE call began, ended), last run

    def pipelined():
        pending = []
        calls["restore"] = calls["wait"] = 0.0
        spans.clear()
        for b in batches:
            t0 = time.perf_counter()
            w0 = time.time()
            pending.append(kv.restore(b, wait=False))
            t1 = time.perf_counter()
            spans.append((int(pending[-1]), w0, time.time()))
            if len(pending) >= inflight:
                kv.wait(pending.pop(0), timeout=WAIT_S)
            calls["restore"] += t1 - t0
            calls["wait"] += time.perf_counter() - t1
        for t in pending:
            kv.wait(t, timeout=WAIT_S)

    def one_at_a_time():
        for b in batches:
            kv.wait(kv.restore(b, wait=False), timeout=WAIT_S)

    ipc_events = {}

    def one_at_a_time_event():
        # As an engine waits: on the ticket's IPC event (the copy landed in
        # GPU memory), not for the daemon to retire the ticket; each
        # ticket is collected (WAIT, finished by then) while the next one
        # copies.
        prev = None
        for b in batches:
            t = kv.restore(b, wait=False)
            if prev is not None:
                kv.wait(prev, timeout=WAIT_S)
            h = t.ipc_event_handle
            ev = ipc_events.get(h)
            if ev is None:
                ev = ipc_events[h] = torch.cuda.Event.from_ipc_handle(dev, h)
            ev.synchronize()
            prev = t
        kv.wait(prev, timeout=WAIT_S)

    words = torch.zeros(1, dtype=torch.int64, device=dev)
    rw = done_words(kv, words)

    def ticket_latency(on_stream, word=False):
        # One ticket's latency, from sending the RESTORE until the waiter
        # sees the copy landed: a host waiting on the ticket's IPC event,
        # or (on_stream) a GPU stream waiting on it (stream.wait_event, as
        # an engine's compute stream does), seen when an event recorded on
        # that stream after the wait completes. Each ticket is collected
        # (WAIT) after, outside the time.
        side = torch.cuda.Stream(dev)
        lat = []
        for b in batches:
            t0 = time.perf_counter()
            t = kv.restore(b, wait=False, done_word=0 if word else None)
            h = t.ipc_event_handle
            ev = ipc_events.get(h)
            if ev is None:
                ev = ipc_events[h] = torch.cuda.Event.from_ipc_handle(dev, h)
            if word:
                kv.wait_done_word(side, t, 0)
                done = torch.cuda.Event()
                done.record(side)
                done.synchronize()
            elif on_stream:
                side.wait_event(ev)
                done = torch.cuda.Event()
                done.record(side)
                done.synchronize()
            else:
                ev.synchronize()
            lat.append((time.perf_counter() - t0) * 1e6)
            kv.wait(t, timeout=WAIT_S)
        return statistics.median(lat)

    def median(fn):
        # Each figure is the median of `reps` runs: one run is a few tens of
        # milliseconds, short enough for host scheduling noise to show.
        return statistics.median(timed(fn) for _ in range(reps))

    pipelined()  # warm: kernel load, pools
    per_call = {}

    def pipelined_calls():
        pipelined()
        for k, v in calls.items():
            per_call.setdefault(k, []).append(v / rounds * 1e6)

    t_pipe = median(pipelined_calls)
    per_call = {k: statistics.median(v) for k, v in per_call.items()}
    if trace:
        with open(trace, "w") as f:
            for t, a, b in spans:
                f.write(f"{t} {a:.6f} {b:.6f}\n")
    t_sync = median(one_at_a_time)
    one_at_a_time_event()  # warm: the events opened
    t_sync_ev = median(one_at_a_time_event)
    lat_host, lat_stream = ticket_latency(False), ticket_latency(True)
    lat_word = ticket_latency(True, word=True) if rw is not None else None
    ring_fig = None
    if use_ring:
        # The same batches through the session's ring: submissions through
        # shared memory, completions reaped (no IPC event: the host waits).
        from kvfs import RESTORE

        # Room for these batches and the stores' below (as many again, and
        # the new-group runs).
        ring = kv.ring(entries=2 * inflight, data_bytes=len(batches[0]) * (2 * rounds + fresh_n * new_rounds) + 4096)
        handles = [ring.put(b) for b in batches]
        sub = []

        def ring_pipelined(hs=handles, op=RESTORE):
            flying = 0
            for h in hs:
                while flying >= inflight:
                    got = ring.reap(1, timeout=WAIT_S)
                    assert all(c.status == 0 for c in got), got
                    flying -= len(got)
                t0 = time.perf_counter()
                assert ring.submit(op, h)
                sub.append(time.perf_counter() - t0)
                flying += 1
            while flying:
                got = ring.reap(1, timeout=WAIT_S)
                assert all(c.status == 0 for c in got), got
                flying -= len(got)

        def ring_one():
            for h in handles:
                assert ring.submit(RESTORE, h)
                (c,) = ring.reap(1, timeout=WAIT_S)
                assert c.status == 0, c

        ring_pipelined()
        ring_fig = (median(ring_pipelined), median(ring_one), statistics.median(sub) * 1e6)
        sub.clear()
    # Stores (GPU -> T1, write-back) of the same batch shape: each batch
    # overwrites `batch` distinct T1-resident (dirty) groups from scattered
    # places of the source tensor. Batch k takes part k mod `inflight` of
    # the hot groups (in a fresh order), so no group is in two tickets in
    # flight, as when an engine offloads each block once; `over` batches
    # pick among 2 × batch groups at random, so each group is in about
    # half of the tickets in flight (they wait on one another).
    parts = max(1, min(inflight, hot // batch))
    whole = torch.randperm(hot, generator=g).tolist()

    def store_entries(k):
        part = whole[(k % parts) * batch:(k % parts + 1) * batch]
        pick = [part[i] for i in torch.randperm(batch, generator=g).tolist()]
        src_at = torch.randperm(hot, generator=g)[:batch].tolist()
        return [place.entry(keys[p], rs, q) for p, q in zip(pick, src_at)]

    def overlapping_entries():
        pick = torch.randperm(2 * batch, generator=g)[:batch].tolist()
        src_at = torch.randperm(hot, generator=g)[:batch].tolist()
        return [place.entry(keys[p], rs, q) for p, q in zip(pick, src_at)]

    sbatches = [kv.encode_entries(store_entries(k)) for k in range(rounds)]
    obatches = [kv.encode_entries(overlapping_entries()) for _ in range(rounds)]

    def store_pipelined(encoded):
        pending = []
        for b in encoded:
            pending.append(kv.store(b, wait=False))
            if len(pending) >= inflight:
                kv.wait(pending.pop(0), timeout=WAIT_S)
        for t in pending:
            kv.wait(t, timeout=WAIT_S)

    def stores():
        store_pipelined(sbatches)

    stores()  # warm
    t_store = median(stores)
    t_over = median(lambda: store_pipelined(obatches))
    t_store_ring = t_new_ring = None
    if use_ring:
        from kvfs import STORE

        shandles = [ring.put(b) for b in sbatches]
        t_store_ring = median(lambda: ring_pipelined(shandles, STORE))
    # Stores of groups new to T1 (what an engine offloading fresh KV
    # blocks does): the kernel writes straight into free T1 slots. Each run
    # takes a fresh key range, so all of them fit in half of T1.
    t_new = None
    if new_rounds >= 4:
        fresh_runs = []
        for rep in range(fresh_n):
            ks = keys_of(layout, new_rounds * batch, start=hot + rep * new_rounds * batch)
            fresh_runs.append([kv.encode_entries([place.entry(k, rs, q) for k, q in zip(
                ks[r * batch:(r + 1) * batch], torch.randperm(hot, generator=g)[:batch].tolist())])
                for r in range(new_rounds)])
        # Half the runs through ioctls, half through the ring (alternating,
        # each on fresh groups).
        by_ioctl, by_ring = [], []
        for k, runs in enumerate(fresh_runs):
            if use_ring and k % 2:
                hs = [ring.put(b) for b in runs]
                by_ring.append(timed(lambda: ring_pipelined(hs, STORE)))
            else:
                by_ioctl.append(timed(lambda: store_pipelined(runs)))
        t_new = statistics.median(by_ioctl)
        t_new_ring = statistics.median(by_ring) if by_ring else None
    # Baseline: one large pinned copy of the same total bytes.
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    big = torch.empty(total, dtype=torch.uint8, device=dev)
    big.copy_(host, non_blocking=True)
    t_big = median(lambda: big.copy_(host, non_blocking=True))
    # Context: one cudaMemcpyAsync per group from scattered pinned slots.
    slots = torch.empty(hot * gb, dtype=torch.uint8, pin_memory=True)
    order = torch.randperm(hot, generator=g)[:batch].tolist()

    def per_group():
        for _ in range(rounds):
            for i, p in enumerate(order):
                dst[i * gb:(i + 1) * gb].copy_(slots[p * gb:(p + 1) * gb], non_blocking=True)

    t_each = timed(per_group)
    # Store baseline: one large pinned D2H copy of the same total bytes.
    host.copy_(big, non_blocking=True)
    t_big_d2h = median(lambda: host.copy_(big, non_blocking=True))
    gbps = lambda t: total / t / 1e9  # noqa: E731
    base = gbps(t_big)
    print(f"bandwidth (medians of {reps} runs), {gb >> 10} KiB groups ({place} in GPU memory), batches of {batch}, {rounds} batches ({total / 2**20:.0f} MiB), "
          f"{resident}/{hot} source groups T1-resident:")
    print(f"  one large pinned H2D copy (baseline)   {base:7.2f} GB/s")
    print(f"  kvfs restore, {inflight} tickets in flight       {gbps(t_pipe):7.2f} GB/s  ({gbps(t_pipe) / base:.2f} of baseline)")
    print(f"    (client side, per ticket: RESTORE call {per_call['restore']:.0f} us, "
          f"waiting for the oldest ticket {per_call['wait']:.0f} us)")
    print(f"  kvfs restore, one ticket at a time     {gbps(t_sync):7.2f} GB/s  ({gbps(t_sync) / base:.2f})  (waiting through WAIT)")
    print(f"    waiting on each ticket's IPC event   {gbps(t_sync_ev):7.2f} GB/s  ({gbps(t_sync_ev) / base:.2f})  (as an engine waits)")
    print(f"    one ticket, sent until seen landed: {lat_host:.0f} us by a host waiting on its IPC event, "
          f"{lat_stream:.0f} us by a GPU stream waiting on it (medians; its bytes take {batch * gb / base / 1e3:.0f} us "
          f"at the baseline, {t_pipe / rounds * 1e6:.0f} us a ticket at {inflight} in flight)")
    if lat_word is not None:
        print(f"    one ticket, sent until seen landed by a GPU stream waiting on its done word: {lat_word:.0f} us")
    if ring_fig is not None:
        tp, t1, us = ring_fig
        print(f"  through the ring, {inflight} in flight         {gbps(tp):7.2f} GB/s  ({gbps(tp) / base:.2f})"
              f"  (submission {us:.1f} us a ticket)")
        print(f"  through the ring, one at a time       {gbps(t1):7.2f} GB/s  ({gbps(t1) / base:.2f})")
    print(f"  one cudaMemcpyAsync per group          {gbps(t_each):7.2f} GB/s  ({gbps(t_each) / base:.2f})")
    base_d2h = gbps(t_big_d2h)
    print(f"  one large pinned D2H copy (baseline)   {base_d2h:7.2f} GB/s")
    print(f"  kvfs store, {inflight} tickets in flight         {gbps(t_store):7.2f} GB/s  ({gbps(t_store) / base_d2h:.2f} of baseline)"
          "  (overwrites of dirty T1 groups, none in two tickets in flight: copied on write into free slots)")
    if t_store_ring is not None:
        print(f"  through the ring, {inflight} in flight         {gbps(t_store_ring):7.2f} GB/s  ({gbps(t_store_ring) / base_d2h:.2f})")
    print(f"  overwrites, tickets overlapping        {gbps(t_over):7.2f} GB/s  ({gbps(t_over) / base_d2h:.2f})"
          "  (each group in about half of the tickets in flight: a held group goes through staging)")
    if t_new is not None:
        nb = new_rounds * batch * gb
        print(f"  kvfs store, new groups, {inflight} in flight  {nb / t_new / 1e9:7.2f} GB/s  ({nb / t_new / 1e9 / base_d2h:.2f} of baseline)"
              f"  ({new_rounds} batches a run: straight into free T1 slots; median of {len(by_ioctl)})")
    if t_new_ring is not None:
        print(f"  through the ring, {inflight} in flight         {nb / t_new_ring / 1e9:7.2f} GB/s  ({nb / t_new_ring / 1e9 / base_d2h:.2f})"
              f"  (median of {len(by_ring)})")
    # Misses: groups pushed out of T1 by storing more than it holds.
    spill = t1_groups + batch
    if layout["groups"] >= hot + spill:
        extra = keys_of(layout, spill, start=hot)
        big_src = torch.randint(0, 256, (batch * gb,), dtype=torch.uint8, device=dev)
        rb = kv.register_tensor(big_src)
        torch.cuda.synchronize()
        for i in range(0, spill, batch):
            chunk = extra[i:i + batch]
            kv.store([k + (rb, j * gb) for j, k in enumerate(chunk)])
        # Queried in parts: a QUERY names at most 1M groups.
        cold = []
        for i in range(0, spill, 1 << 16):
            part = extra[i:i + (1 << 16)]
            cold += [k for k, (s, _) in zip(part, kv.query(part)) if s == "backing"]
            if len(cold) >= batch:
                break
        cold = cold[:batch]
        if len(cold) == batch:
            t_miss = timed(lambda: kv.restore([k + (rd, i * gb) for i, k in enumerate(cold)]))
            print(f"  kvfs restore, all misses (backing)     {batch * gb / t_miss / 1e9:7.2f} GB/s  (one batch)")
        kv.unregister(rb)
    kv.unregister(rs)
    if rw is not None:
        kv.unregister(rw)
    kv.unregister(rd)
    # The best way an engine can submit: the ring where it was measured.
    best = t_pipe if ring_fig is None else min(t_pipe, ring_fig[0])
    return gbps(best) / base


def stored_groups(kv, gb, dev, n):
    """n groups of random bytes stored from GPU memory in one STORE, and a
    zeroed tensor to restore them into: (keys, expected bytes, their
    region, the tensor, its region)."""
    keys = keys_of(kv.layout, n)
    data = torch.randint(0, 256, (n * gb,), dtype=torch.uint8, device=dev)
    expect = data.clone()
    r = kv.register_tensor(data)
    torch.cuda.synchronize()
    kv.store([k + (r, i * gb) for i, k in enumerate(keys)])
    back = torch.zeros(n * gb, dtype=torch.uint8, device=dev)
    return keys, expect, r, back, kv.register_tensor(back)


def done_word_stress(kv, gb, dev, reps):
    """Many restores of 1024 groups stored in one STORE (their slots join
    into runs: the copy engines, unless the daemon runs with
    KVFS_GPU_COPY=kernel), each waited on by a stream through a done word,
    then through the IPC event, the bytes compared on that stream right
    after the wait. Any mismatch fails."""
    n = min(1024, kv.layout["t1_slots"] // 2)
    keys, expect, r, back, rb = stored_groups(kv, gb, dev, n)
    words = torch.zeros(8, dtype=torch.int64, device=dev)
    rw = done_words(kv, words)
    s = torch.cuda.Stream(dev)
    bad = {}
    for how in (("word", "event") if rw is not None else ("event",)):
        bad[how] = 0
        for rep in range(reps):
            back.zero_()
            torch.cuda.synchronize()
            w = rep % 8
            t = kv.restore([k + (rb, i * gb) for i, k in enumerate(keys)], wait=False,
                           done_word=w if how == "word" else None)
            if how == "word":
                kv.wait_done_word(s, t, w)
            else:
                s.wait_event(torch.cuda.Event.from_ipc_handle(dev, t.ipc_event_handle))
            with torch.cuda.stream(s):
                same = torch.equal(back, expect)
            bad[how] += not same
            kv.wait(t, timeout=WAIT_S)
    for x in (r, rb) + ((rw,) if rw is not None else ()):
        kv.unregister(x)
    print(f"done-word stress: {reps} restores of {n} groups stored in one STORE, the bytes compared on a "
          f"stream right after its wait; mismatches: " + ", ".join(f"{bad[h]} waiting on the {h}" for h in bad))
    assert not any(bad.values()), f"restored bytes differ after a stream's wait: {bad}"


def guard(kv, gb, dev):
    """The seed's eviction guard: T1 of 2 slots, 4 groups, async restore then evicting writes."""
    assert kv.layout["t1_slots"] == 2, "run --guard against a mount with a 2-slot T1"
    keys, expect, _, back, rb = stored_groups(kv, gb, dev, 4)
    for rep in range(50):
        back.zero_()
        torch.cuda.synchronize()
        t = kv.restore([k + (rb, i * gb) for i, k in enumerate(keys)], wait=False)
        # Evicting writes while the copy may be in flight: rewrite the same
        # groups' files with the same bytes (through T1, evicting others).
        host = expect.cpu().numpy().tobytes()
        for i, (l, b, h, k) in enumerate(keys):
            with open(os.path.join(kv.mountpoint, f"L{l}", f"B{b}", f"H{h}", k), "r+b") as f:
                f.write(host[i * gb:(i + 1) * gb])
        kv.wait(t)
        torch.cuda.synchronize()
        assert torch.equal(back, expect), f"round {rep}: a restored group was torn by an eviction"
    print("eviction guard: T1 of 2 slots, 4 groups, 50 rounds of async restore then evicting writes: every group intact")


def t1_ready(kv, timeout=300):
    """Waits until all of T1's memory has arrived (`Kvfs.wait_t1_ready`):
    the daemon pins T1 in the background after its first chunk, and each
    chunk's pinning waits for the GPU copies in flight and holds up new
    ones meanwhile, so figures taken before it ends are not the steady
    state's."""
    try:
        waited = kv.wait_t1_ready(timeout)
    except RuntimeError as e:
        print(f"T1: {e}; not waiting for its pinning")
        return
    except TimeoutError as e:
        raise SystemExit(f"T1: {e}")
    if waited > 0.1:
        total = int(kv.stats()["kvfs_t1_slots_total"])
        print(f"T1: waited {waited:.1f} s for the daemon to finish pinning all {total} slots")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mount")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5, help="runs per figure (the median is printed)")
    ap.add_argument("--trace", help="write each RESTORE call's ticket and wall-clock start and end here")
    ap.add_argument("--guard", action="store_true")
    ap.add_argument("--done-word-stress", type=int, default=0, metavar="REPS",
                    help="only: REPS restores of 1024 groups stored together, each waited on by a stream "
                         "through a done word (then through the IPC event) and compared there")
    ap.add_argument("--target", type=float, default=0.0, help="fail if restores with --inflight tickets in flight (through the ring too, with --ring: the faster) "
                         "reach less than this fraction of the baseline (exit status 3; other failures exit 1)")
    ap.add_argument("--row", type=int, default=0,
                    help="strided entries: each group as rows of this many bytes in GPU memory (0: contiguous)")
    ap.add_argument("--pitch", type=int, default=0, help="bytes from one row to the next (default 2 x --row)")
    ap.add_argument("--ring", action="store_true",
                    help="also restore the same batches through the session's submission/completion ring")
    ap.add_argument("--no-t1-wait", action="store_true",
                    help="time at once, not after the daemon has pinned all of T1 (the first seconds of a fresh mount)")
    ap.add_argument("--no-done-words", action="store_true",
                    help="leave out the done-word check and latency figure (a daemon without them)")
    a = ap.parse_args()
    global DONE_WORDS
    DONE_WORDS = not a.no_done_words
    dev = torch.device("cuda", 0)
    with Kvfs(a.mount) as kv:
        gb = kv.layout["group_bytes"]
        if a.guard:
            guard(kv, gb, dev)
            return
        if a.done_word_stress:
            done_word_stress(kv, gb, dev, a.done_word_stress)
            return
        place = Place(gb, a.row, a.pitch)
        if a.batch % place.k:
            raise SystemExit(f"--batch must be a multiple of {place.k} (groups interleaved at that pitch)")
        if a.row:
            correctness_strided(kv, gb, dev, place)
        else:
            correctness(kv, gb, dev)
        if not a.no_t1_wait:
            t1_ready(kv)
        ratio = bandwidth(kv, gb, dev, a.batch, a.inflight, a.rounds, a.reps, a.trace, place, a.ring)
        if ratio < a.target:
            print(f"BELOW TARGET: {ratio:.2f} < {a.target}")
            sys.exit(3)


if __name__ == "__main__":
    main()
