"""Tests of the kvfs package's client against a running mount (KVFS_MOUNT).

Run by `cargo test --release` (tests/python.rs mounts kvfs and runs the
package's tests); alone, from kvfs's repository root:
    KVFS_MOUNT=/mnt/kv PYTHONPATH=tools/python python3 -m unittest discover -s tools/python/tests -v
(PYTHONPATH not needed when the package is installed). Without KVFS_MOUNT
these tests are skipped.
"""

import errno
import json
import os
import shutil
import sys
import tempfile
import threading
import unittest

from kvfs import Kvfs, KvfsError

MOUNT = os.environ.get("KVFS_MOUNT")


def pattern(seed, n):
    x = (seed * 2654435761 + 12345) & 0xFFFFFFFF
    out = bytearray(n)
    for i in range(n):
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        out[i] = x >> 24
    return bytes(out)


class Region:
    def __init__(self, size):
        fd, self.path = tempfile.mkstemp(dir="/dev/shm", prefix="kvfs-py-")
        os.ftruncate(fd, size)
        self.fd = fd
        self.size = size

    def write(self, off, data):
        os.pwrite(self.fd, data, off)

    def read(self, off, n):
        return os.pread(self.fd, n, off)

    def close(self):
        os.close(self.fd)
        os.unlink(self.path)


@unittest.skipUnless(MOUNT, "KVFS_MOUNT is not set")
class ClientTest(unittest.TestCase):
    USE_IOCTL = True  # small requests by ioctl(2), as the client does by default

    def setUp(self):
        self.kv = Kvfs(MOUNT, use_ioctl=self.USE_IOCTL)
        self.gb = self.kv.layout["group_bytes"]
        self.regions = []

    def tearDown(self):
        self.kv.close()
        for r in self.regions:
            r.close()

    def region(self, n):
        r = Region(n * self.gb)
        self.regions.append(r)
        return r

    def group_path(self, l, b, h, k):
        return os.path.join(MOUNT, f"L{l}", f"B{b}", f"H{h}", k)

    def test_a_query_of_a_fresh_group(self):
        # Runs first (alphabetical order): nothing has written L1/B7/H1/V yet.
        self.assertEqual(self.kv.query([(1, 7, 1, "V")]), [("empty", False)])

    def test_stats_and_t1_ready(self):
        s = self.kv.stats()
        self.assertGreater(s["kvfs_t1_slots_total"], 0)
        self.assertIn('kvfs_hits_total{tier="t1"}', s)
        waited = self.kv.wait_t1_ready(timeout=60)
        self.assertGreaterEqual(waited, 0)
        s = self.kv.stats()
        self.assertEqual(s["kvfs_t1_slots_ready"], s["kvfs_t1_slots_total"])

    def test_a_missing_region_file_is_made_and_a_short_one_refused(self):
        # The README's example registers a file that need not exist yet.
        d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvfs-py-")
        self.addCleanup(shutil.rmtree, d)
        made = os.path.join(d, "kv")
        r = self.kv.register_host_region(made, 2 * self.gb)
        st = os.stat(made)
        self.assertEqual((st.st_size, st.st_mode & 0o777), (2 * self.gb, 0o600))
        with open(made, "r+b") as f:
            f.write(pattern(7, self.gb))
        self.kv.store([(1, 3, 0, "K", r, 0)])
        self.kv.restore([(1, 3, 0, "K", r, self.gb)])
        with open(made, "rb") as f:
            f.seek(self.gb)
            self.assertEqual(f.read(self.gb), pattern(7, self.gb))
        short = os.path.join(d, "short")
        with open(short, "wb") as f:
            f.write(b"x" * 100)
        with self.assertRaises(KvfsError) as e:
            self.kv.register_host_region(short, 4096)
        self.assertEqual(e.exception.errno, errno.EINVAL)
        self.assertIn("shorter", e.exception.message)
        self.assertEqual(os.stat(short).st_size, 100)
        with self.assertRaises(FileNotFoundError):
            self.kv.register_host_region(os.path.join(d, "no", "such"), 10)

    def test_layout(self):
        with open(os.path.join(MOUNT, ".kvfs", "layout")) as f:
            self.assertEqual(json.load(f)["groups"], self.kv.layout["groups"])
        self.assertEqual(self.kv.version, 1)

    def test_store_restore_round_trip(self):
        n = 64
        src = self.region(n)
        keys = [(l, b, h, k) for l in range(2) for b in range(8) for h in range(2) for k in "KV"]
        for i in range(n):
            src.write(i * self.gb, pattern(i + 100, self.gb))
        r = self.kv.register_host_region(src.path, src.size)
        self.kv.store([k + (r, i * self.gb) for i, k in enumerate(keys)])
        for i, k in enumerate(keys):
            with open(self.group_path(*k), "rb") as f:
                self.assertEqual(f.read(), pattern(i + 100, self.gb), k)
        dst = self.region(n)
        r2 = self.kv.register_host_region(dst.path, dst.size)
        enc = self.kv.encode_entries([k + (r2, (n - 1 - i) * self.gb) for i, k in enumerate(keys)])
        t = self.kv.restore(enc, wait=False)
        self.assertEqual(self.kv.wait(t, timeout=30), t)
        for i, k in enumerate(keys):
            with open(self.group_path(*k), "rb") as f:
                self.assertEqual(dst.read((n - 1 - i) * self.gb, self.gb), f.read())
        for state, dirty in self.kv.query(keys):
            self.assertIn(state, ("t1", "backing"))
            self.assertTrue(state == "t1" or not dirty)
        self.kv.unregister(r)
        self.kv.unregister(r2)

    def test_done_polls_without_waiting(self):
        n = 16
        src = self.region(n)
        r = self.kv.register_host_region(src.path, src.size)
        keys = [(l, b, 1, "V") for l in range(2) for b in range(8)]
        t = self.kv.store([k + (r, i * self.gb) for i, k in enumerate(keys)], wait=False)
        deadline = 30
        while not self.kv.done(t):  # False while it runs, True once collected
            deadline -= 0.01
            self.assertGreater(deadline, 0, "the ticket never finished")
            threading.Event().wait(0.01)
        with self.assertRaises(KvfsError) as e:
            self.kv.done(t)  # collected already: not a timeout, an error
        self.assertEqual(e.exception.errno, errno.EINVAL)
        self.kv.unregister(r)

    def test_strided_entries(self):
        # An engine layout where K and V rows interleave: per (block, head)
        # a slice of block_tokens rows of [K | V], each row_bytes long.
        g = self.kv.layout
        bt, row = g["block_tokens"], self.gb // g["block_tokens"]
        pitch, heads = 2 * row, g["kv_heads"]
        slice_ = bt * pitch
        blocks = 4
        n = blocks * heads * slice_
        src = Region(n)
        data = pattern(77, n)
        src.write(0, data)
        self.regions.append(src)
        rs = self.kv.register_host_region(src.path, n)
        keys = [(1, b, h, k) for b in range(blocks) for h in range(heads) for k in "KV"]

        def entries(region):
            return [(l, b, h, k, region, (b * heads + h) * slice_ + (row if k == "V" else 0), row, pitch)
                    for (l, b, h, k) in keys]

        self.kv.store(entries(rs))
        for (l, b, h, k), e in zip(keys, entries(rs)):
            want = b"".join(data[e[5] + r * pitch:e[5] + r * pitch + row] for r in range(bt))
            with open(self.group_path(l, b, h, k), "rb") as f:
                self.assertEqual(f.read(), want, (l, b, h, k))
        dst = self.region(n // self.gb)
        rd = self.kv.register_host_region(dst.path, dst.size)
        enc = self.kv.encode_entries(entries(rd))
        self.assertTrue(enc.strided)
        self.kv.restore(enc)
        self.assertEqual(dst.read(0, n), data)
        # Rows of two entries that collide are refused, naming both.
        bad = entries(rd)[:2]
        bad[1] = bad[1][:5] + (bad[0][5] + 16, row, pitch)
        with self.assertRaises(KvfsError) as e:
            self.kv.restore(bad)
        self.assertEqual(e.exception.errno, errno.EINVAL)
        self.assertIn("overlapping", e.exception.message)
        with self.assertRaises(ValueError):
            self.kv.restore([(1, 0, 0, "K", rd, 0, row)])
        self.kv.unregister(rs)
        self.kv.unregister(rd)

    def test_large_batches(self):
        # 1024 entries (32 KiB): too large for one ioctl, so the entries go
        # through the session's scratch region (or write/read without ioctl).
        keys = [(l, b, h, k) for l in range(2) for b in range(8) for h in range(2) for k in "KV"]
        n = 1024
        src = self.region(len(keys))
        for i in range(len(keys)):
            src.write(i * self.gb, pattern(i + 300, self.gb))
        rs = self.kv.register_host_region(src.path, src.size)
        self.kv.store([k + (rs, i * self.gb) for i, k in enumerate(keys)])
        dst = self.region(n)
        rd = self.kv.register_host_region(dst.path, dst.size)
        for rep in range(3):  # the scratch region is reused
            order = [(i * 7 + rep) % len(keys) for i in range(n)]
            self.kv.restore([keys[j] + (rd, i * self.gb) for i, j in enumerate(order)])
            for i, j in enumerate(order):
                self.assertEqual(dst.read(i * self.gb, self.gb), pattern(j + 300, self.gb), (rep, i))
        self.assertEqual(self.kv._scratch is not None, self.USE_IOCTL)
        # A bad entry deep in a large batch is still refused whole, naming it.
        bad = [keys[0] + (rd, i * self.gb) for i in range(n)]
        bad[700] = (9, 0, 0, "K", rd, 700 * self.gb)
        with self.assertRaises(KvfsError) as e:
            self.kv.restore(bad)
        self.assertEqual((e.exception.errno, e.exception.entry), (errno.ERANGE, 700))
        # Its text names the entry once ("entry 700: L9/B0/H0/K: …").
        self.assertEqual(str(e.exception).count("entry 700"), 1, str(e.exception))
        self.kv.unregister(rs)
        self.kv.unregister(rd)

    def test_prefetch_shows_in_resident(self):
        src = self.region(1)
        src.write(0, pattern(7, self.gb))
        r = self.kv.register_host_region(src.path, src.size)
        self.kv.store([(1, 3, 1, "K", r, 0)])
        # Push it out of T1 by writing many other groups.
        for b in range(8):
            for h in range(2):
                with open(self.group_path(0, b, h, "V"), "r+b") as f:
                    f.write(pattern(b * 2 + h, self.gb))
        self.kv.prefetch([(1, 3, 1, "K")])
        self.assertIn("L1.B3.H1.K", os.listdir(os.path.join(MOUNT, ".kvfs", "resident")))
        self.assertEqual(self.kv.query([(1, 3, 1, "K")])[0][0], "t1")

    def test_errors(self):
        r = self.kv.register_host_region(self.region(2).path, 2 * self.gb)
        with self.assertRaises(KvfsError) as e:
            self.kv.restore([(0, 0, 0, "K", r, 0), (99, 0, 0, "K", r, self.gb)])
        self.assertEqual(e.exception.errno, errno.ERANGE)
        self.assertEqual(e.exception.entry, 1)
        self.assertIn("layer 99", e.exception.message)
        with self.assertRaises(KvfsError) as e:
            self.kv.restore([(0, 0, 0, "K", r, self.gb + 1)])
        self.assertEqual(e.exception.errno, errno.EFAULT)
        with self.assertRaises(KvfsError) as e:
            self.kv.restore([(0, 0, 0, "K", r + 50, 0)])
        self.assertEqual(e.exception.errno, errno.EBADF)
        with self.assertRaises(KvfsError) as e:
            self.kv.register_host_region("/dev/null", 10)
        self.assertEqual(e.exception.errno, errno.EINVAL)
        with self.assertRaises(KvfsError) as e:
            self.kv.wait(987654, timeout=0.01)
        self.assertEqual(e.exception.errno, errno.EINVAL)
        with self.assertRaises(ValueError):
            self.kv.restore([(0, 0, 0, "X", r, 0)])
        # A done word is for restores into CUDA regions, and the session
        # has none registered.
        with self.assertRaises(KvfsError) as e:
            self.kv.restore([(0, 0, 0, "K", r, 0)], done_word=3)
        self.assertEqual(e.exception.errno, errno.EINVAL)
        self.assertIn("done word", e.exception.message)
        with self.assertRaises(ValueError):
            self.kv.restore([(0, 0, 0, "K", r, 0)], done_word=70000)
        with self.assertRaises(ValueError):
            self.kv.wait_done_word(None, 1, 0)
        # Still serving.
        self.kv.restore([(0, 0, 0, "K", r, 0)])

    def test_other_session_cannot_use_my_region(self):
        r = self.kv.register_host_region(self.region(1).path, self.gb)
        with Kvfs(MOUNT) as other:
            with self.assertRaises(KvfsError) as e:
                other.restore([(0, 0, 0, "K", r + 1, 0)])
            self.assertEqual(e.exception.errno, errno.EBADF)

    def test_threads_share_a_session(self):
        dst = self.region(32)
        r = self.kv.register_host_region(dst.path, dst.size)
        errors = []

        def work(t):
            try:
                for i in range(8):
                    g = t * 8 + i
                    self.kv.restore([(0, g % 8, g // 16 % 2, "KV"[g % 2], r, g * self.gb)])
            except Exception as ex:  # noqa: BLE001
                errors.append(ex)

        ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.assertEqual(errors, [])


@unittest.skipUnless(MOUNT, "KVFS_MOUNT is not set")
class RingTest(unittest.TestCase):
    """RESTORE and STORE through the session's ring (Kvfs.ring)."""

    def setUp(self):
        self.kv = Kvfs(MOUNT)
        self.gb = self.kv.layout["group_bytes"]
        self.r = Region(32 * self.gb)
        self.rid = self.kv.register_host_region(self.r.path, self.r.size)

    def tearDown(self):
        self.kv.close()
        self.r.close()

    def test_store_and_restore_through_the_ring(self):
        from kvfs import RESTORE, STORE

        gb = self.gb
        data = pattern(5, 8 * gb)
        self.r.write(0, data)
        ring = self.kv.ring(entries=8, data_bytes=1 << 16)
        keys = [(0, 6, h, k) for h in range(2) for k in "KV"] + [(1, 6, h, k) for h in range(2) for k in "KV"]
        st = ring.put([k + (self.rid, i * gb) for i, k in enumerate(keys)])
        self.assertTrue(ring.submit(STORE, st, user_data=41))
        (c,) = ring.reap(1, timeout=10)
        self.assertEqual((c.user_data, c.status, c.entry, c.failed), (41, 0, None, 0))
        self.assertGreater(c.ticket, 0)
        for i, (l, b, h, k) in enumerate(keys):
            with open(os.path.join(MOUNT, f"L{l}", f"B{b}", f"H{h}", k), "rb") as f:
                self.assertEqual(f.read(), data[i * gb:(i + 1) * gb])
        # One ticket a group, restored in reverse after the data, all in flight.
        handles = [ring.put([k + (self.rid, (16 + 7 - i) * gb)]) for i, k in enumerate(keys)]
        for i, hnd in enumerate(handles):
            self.assertTrue(ring.submit(RESTORE, hnd, user_data=100 + i))
        got = []
        while len(got) < 8:
            got += ring.reap(1, timeout=10)
        self.assertEqual(sorted(c.user_data for c in got), list(range(100, 108)))
        self.assertTrue(all(c.status == 0 for c in got), got)
        back = self.r.read(16 * gb, 8 * gb)
        for i in range(8):
            self.assertEqual(back[(7 - i) * gb:(8 - i) * gb], data[i * gb:(i + 1) * gb])

    def test_refusals_and_timeouts(self):
        import errno as E

        from kvfs import RESTORE

        ring = self.kv.ring(entries=4, data_bytes=4096)
        bad = ring.put([(0, 6, 0, "K", self.rid, self.r.size)])  # past the region's end
        self.assertTrue(ring.submit(RESTORE, bad, user_data=9))
        (c,) = ring.reap(1, timeout=10)
        self.assertEqual((c.user_data, c.status, c.ticket), (9, E.EFAULT, 0))
        self.assertEqual(ring.reap(1, timeout=0.05), [], "nothing more completes")
        with self.assertRaises(KvfsError) as e:
            self.kv.ring()
        self.assertEqual(e.exception.errno, E.EBUSY)
        with self.assertRaises(ValueError):
            ring.submit(99, bad)


class WriteReadTest(ClientTest):
    """The same tests with every request by write(2) and read(2)."""

    USE_IOCTL = False

    def test_a_query_of_a_fresh_group(self):
        # ClientTest's run has written every group by now: query them all.
        keys = [(l, b, h, k) for l in range(2) for b in range(8) for h in range(2) for k in "KV"]
        states = self.kv.query(keys)
        self.assertEqual(len(states), len(keys))
        self.assertTrue(all(s in ("t1", "backing") for s, _ in states), states)


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    sys.exit(0 if result.wasSuccessful() and not result.skipped else 1)
