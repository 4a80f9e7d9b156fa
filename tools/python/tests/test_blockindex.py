"""kvfs.blockindex: engine block keys -> kvfs chunks, LRU, pins, and the
SQLite file that outlives the process (no mount needed)."""

import os
import subprocess
import sys
import tempfile
import unittest

from kvfs.blockindex import BlockIndex, BlockIndexError


class BlockIndexTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "index.sqlite")

    def tearDown(self):
        self.dir.cleanup()

    def store(self, ix, keys):
        out = ix.prepare_store(keys)
        self.assertIsNotNone(out)
        ix.complete_store([k for k, _ in out[0]])
        return out

    def test_chunks_are_disjoint_and_inside_the_range(self):
        ix = BlockIndex(self.path, 100, 20, chunk_blocks=4)
        self.assertEqual(ix.capacity, 5)
        (got, evicted) = self.store(ix, [b"a", b"b", b"c"])
        self.assertEqual(evicted, [])
        bases = [b for _, b in got]
        self.assertEqual(len(set(bases)), 3)
        for b in bases:
            self.assertTrue(100 <= b and b + 4 <= 120 and (b - 100) % 4 == 0, b)
        # Stored or in-flight keys are not stored twice.
        again, _ = ix.prepare_store([b"a", b"d", b"d"])
        self.assertEqual([k for k, _ in again], [b"d"])
        self.assertEqual(ix.prepare_store([b"d"]), ([], []))
        ix.close()

    def test_lru_eviction_skips_pinned_chunks(self):
        ix = BlockIndex(self.path, 0, 3)
        self.store(ix, [b"a", b"b", b"c"])
        self.assertTrue(ix.lookup(b"a"))
        base_a = ix.prepare_load([b"a"])[0]    # a: most recent, and pinned
        got, evicted = self.store(ix, [b"d"])
        self.assertEqual(evicted, [b"b"])       # the least recently used unpinned
        self.assertFalse(ix.lookup(b"b"))
        got, evicted = self.store(ix, [b"e"])
        self.assertEqual(evicted, [b"c"])
        # Only a (pinned), d, e remain: two new keys need two victims, one is pinned.
        self.assertIsNone(ix.prepare_store([b"f", b"g", b"h"]))
        self.assertTrue(ix.lookup(b"d") and ix.lookup(b"e"), "a refused store changes nothing")
        ix.complete_load([b"a"])
        got, evicted = self.store(ix, [b"f", b"g", b"h"])
        self.assertEqual(sorted(evicted), [b"a", b"d", b"e"])
        self.assertIn(base_a, [b for _, b in got])
        ix.close()

    def test_failed_store_frees_its_chunks(self):
        ix = BlockIndex(self.path, 0, 2)
        out, _ = ix.prepare_store([b"a", b"b"])
        self.assertIsNone(ix.prepare_store([b"c"]), "chunks being stored are not handed out")
        ix.complete_store([b"a", b"b"], success=False)
        self.assertFalse(ix.lookup(b"a"))
        self.store(ix, [b"c", b"d"])
        ix.close()

    def test_stored_keys_survive_reopening_and_another_process(self):
        ix = BlockIndex(self.path, 10, 8, chunk_blocks=2)
        got, _ = self.store(ix, [b"k1", b"k2"])
        ix.prepare_store([b"k3"])   # never completed: not in the file
        ix.close()
        code = ("import sys; from kvfs.blockindex import BlockIndex\n"
                "ix = BlockIndex(sys.argv[1], 10, 8, chunk_blocks=2)\n"
                "print(ix.prepare_load([b'k1', b'k2']), ix.lookup(b'k3'))")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        out = subprocess.run([sys.executable, "-c", code, self.path], capture_output=True, text=True,
                             env=env, check=True).stdout.split()
        self.assertEqual(out[0] + out[1], str([b for _, b in got]).replace(" ", ""))
        self.assertEqual(out[2], "False")
        # Another range or chunk size does not take rows it cannot use.
        ix = BlockIndex(self.path, 10, 8, chunk_blocks=4)
        self.assertFalse(ix.lookup(b"k1"))
        ix.close()

    def test_drop_missing_and_reset(self):
        ix = BlockIndex(self.path, 0, 4)
        got, _ = self.store(ix, [b"a", b"b", b"c"])
        where = dict(got)
        self.assertEqual(ix.drop_missing(lambda base: base != where[b"b"]), [b"b"])
        self.assertFalse(ix.lookup(b"b"))
        ix.prepare_load([b"a"])
        ix.reset()
        self.assertTrue(ix.lookup(b"a"), "a chunk being loaded survives a reset")
        self.assertFalse(ix.lookup(b"c"))
        ix.close()
        ix = BlockIndex(self.path, 0, 4)
        self.assertFalse(ix.lookup(b"c"), "the reset reached the file")
        ix.close()

    def test_one_engine_an_index_and_bad_ranges(self):
        ix = BlockIndex(self.path, 0, 4)
        with self.assertRaises(BlockIndexError) as e:
            BlockIndex(self.path, 0, 4)
        self.assertIn("in use by another process", str(e.exception))
        ix.close()
        BlockIndex(self.path, 0, 4).close()
        with self.assertRaises(BlockIndexError):
            BlockIndex(self.path, 0, 3, chunk_blocks=4)


if __name__ == "__main__":
    unittest.main()
