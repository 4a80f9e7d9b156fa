"""The prefix index of kvfs.hf (kvfs.prefix): standard library only, so it
runs everywhere; several processes write it at once."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from kvfs.prefix import OutOfBlocks, PrefixIndex  # noqa: E402

WORKER = r"""
import sys
sys.path.insert(0, sys.argv[1])
from kvfs.prefix import PrefixIndex
ix = PrefixIndex(sys.argv[2])
me = int(sys.argv[3])
got = []
for i in range(40):
    got.append(ix.lease(3, 100000))
    ix.add([(PrefixIndex.key("m", [i, j]), 1000000 + me * 1000 + i * 10 + j, 2) for j in range(5)])
print(" ".join(map(str, got)), flush=True)
sys.stdin.read()  # stay alive (holding the leases) until the test is done
"""


class PrefixIndexTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvfs-prefix-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.path = os.path.join(self.dir, "index.sqlite")

    def test_longest_run_of_indexed_prefixes(self):
        ix = PrefixIndex(self.path)
        toks = list(range(64))
        keys = [PrefixIndex.key("m", toks[: (c + 1) * 16]) for c in range(4)]
        ix.add([(keys[0], 7, 16), (keys[1], 9, 32), (keys[3], 11, 64)])
        self.assertEqual(ix.find(keys), [7, 9])  # the run stops at the first gap
        self.assertEqual(ix.find([PrefixIndex.key("other model", toks[:16])]), [])
        # The first writer of a key wins; rows survive reopening.
        ix.add([(keys[0], 99, 16)])
        self.assertEqual(PrefixIndex(self.path).find(keys[:1]), [7])

    def test_leases_are_disjoint_and_avoid_indexed_blocks(self):
        ix = PrefixIndex(self.path)
        ix.add([(PrefixIndex.key("m", [1]), 4, 1)])
        a = ix.lease(4, 20)
        b = ix.lease(4, 20)
        self.assertEqual((a, b), (0, 5))  # block 4 is a saved prefix's
        with self.assertRaises(OutOfBlocks) as e:
            ix.lease(12, 20)
        self.assertIn("no 12 consecutive", str(e.exception))
        ix.release(a)
        self.assertEqual(ix.lease(4, 20), 0)

    def test_a_dead_processs_lease_is_reclaimed(self):
        ix = PrefixIndex(self.path)
        p = subprocess.run([sys.executable, "-c", WORKER.replace("range(40)", "range(1)"),
                            os.path.dirname(HERE), self.path, "0"], capture_output=True, text=True,
                           input="")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.split(), ["0"])  # it leased [0, 3) and exited
        self.assertEqual(ix.lease(3, 100), 0)

    def test_two_processes_writing_at_once(self):
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, os.path.dirname(HERE), self.path,
                                   str(me)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for me in range(2)]
        # Both alive, holding their leases, when both have printed.
        lines = [p.stdout.readline() for p in procs]
        outs = [(line, p.communicate(input="", timeout=120)[1]) for line, p in zip(lines, procs)]
        for p, (out, err) in zip(procs, outs):
            self.assertEqual(p.returncode, 0, err)
        # Every lease of the two live processes is its own range.
        bases = [int(x) for out, _ in outs for x in out.split()]
        self.assertEqual(len(bases), 80)
        spans = sorted(bases)
        for lo, hi in zip(spans, spans[1:]):
            self.assertGreaterEqual(hi - lo, 3, f"leases at {lo} and {hi} overlap")
        # Every row of both is there, and the first writer of each key won.
        ix = PrefixIndex(self.path)
        for i in range(40):
            keys = [PrefixIndex.key("m", [i, j]) for j in range(5)]
            for j, k in enumerate(keys):
                got = ix.find([k])
                self.assertEqual(len(got), 1)
                self.assertIn(got[0] - i * 10 - j, (1000000, 1001000))
        self.assertEqual(ix.db.execute("PRAGMA integrity_check").fetchone()[0], "ok")


if __name__ == "__main__":
    unittest.main()
