"""Engine block keys -> kvfs blocks: the index behind kvfs.vllm's
offloading manager. Standard library only (SQLite), so it is tested
without vLLM.

An engine names an offloaded chunk of KV by a key (vLLM: a block hash and
its KV-cache group, as bytes). The index gives each stored key a chunk of
`chunk_blocks` consecutive kvfs blocks from a range of the mount, evicts
the least recently used unpinned chunks when the range is full, and keeps
stored keys in a SQLite file, so an engine restarted later (or another
process) finds what was stored before. A key is only written to the file
once its STORE has completed; a chunk being stored or loaded is never
evicted or handed out again.

The file records which key a chunk holds, not the bytes: rows whose groups
the mount no longer holds (`drop_missing`) are dropped when it is opened.
"""

import collections
import fcntl
import os
import sqlite3

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "kvfs")


class BlockIndexError(ValueError):
    """A range or chunk size the index cannot use, or an index file in
    use by another live engine."""


class BlockIndex:
    """Keys -> chunks of kvfs blocks, LRU over [first, first + count).

    path: the SQLite file (created); first, count: the mount's blocks the
    index may use; chunk_blocks: kvfs blocks a key holds."""

    def __init__(self, path, first, count, chunk_blocks=1):
        if chunk_blocks < 1 or first < 0 or count < chunk_blocks:
            raise BlockIndexError(
                f"blocks {first}..{first + count} cannot hold chunks of {chunk_blocks} blocks")
        self.path, self.first, self.count, self.chunk = path, first, count, chunk_blocks
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # One engine an index: two would hand out the same free chunks.
        self._lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise BlockIndexError(
                f"the block index {path} is in use by another process: give each engine its "
                "own index (and its own range of the mount's blocks)") from None
        self.db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE IF NOT EXISTS chunk (key BLOB PRIMARY KEY, "
                        "base INTEGER NOT NULL UNIQUE, used INTEGER NOT NULL)")
        self.stored = collections.OrderedDict()  # key -> base, least recently used first
        self.pending = {}                         # key -> base, being stored
        self.pins = collections.Counter()         # key -> loads in flight
        self.db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER)")
        row = self.db.execute("SELECT value FROM meta WHERE name = 'chunk_blocks'").fetchone()
        if row is None or row[0] != chunk_blocks:
            # Chunks of another size: their rows name other blocks.
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("DELETE FROM chunk")
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('chunk_blocks', ?)", (chunk_blocks,))
            self.db.execute("COMMIT")
        rows = self.db.execute("SELECT key, base FROM chunk ORDER BY used").fetchall()
        bases = set(self._bases())
        stale = []
        for key, base in rows:
            if base in bases:
                self.stored[bytes(key)] = base
                bases.discard(base)
            else:  # outside this range: not ours to use
                stale.append(key)
        self.free = sorted(bases, reverse=True)   # pop() takes the lowest
        self.clock = len(rows)
        if stale:
            self._write(delete=stale)

    def _bases(self):
        n = self.count // self.chunk
        return range(self.first, self.first + n * self.chunk, self.chunk)

    @property
    def capacity(self):
        """Chunks the range holds."""
        return self.count // self.chunk

    def _write(self, put=(), delete=()):
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            if delete:
                db.executemany("DELETE FROM chunk WHERE key = ?", [(k,) for k in delete])
            if put:
                # A chunk handed to a new key loses its old row first.
                db.executemany("DELETE FROM chunk WHERE base = ?", [(b,) for _, b in put])
                rows = []
                for k, b in put:
                    self.clock += 1
                    rows.append((k, b, self.clock))
                db.executemany("INSERT OR REPLACE INTO chunk VALUES (?, ?, ?)", rows)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def drop_missing(self, holds):
        """Drops stored keys whose chunk the mount no longer holds
        (`holds(base)` False), in memory and in the file; returns them."""
        gone = [k for k, b in self.stored.items() if not holds(b)]
        for k in gone:
            self.free.append(self.stored.pop(k))
        self.free.sort(reverse=True)
        if gone:
            self._write(delete=gone)
        return gone

    def lookup(self, key):
        """Whether `key` is stored (and loadable)."""
        return key in self.stored

    def prepare_load(self, keys):
        """The chunks of stored `keys`, pinned until complete_load."""
        out = []
        for k in keys:
            base = self.stored[k]
            self.stored.move_to_end(k)
            self.pins[k] += 1
            out.append(base)
        return out

    def complete_load(self, keys):
        for k in keys:
            if self.pins[k] <= 1:
                del self.pins[k]
            else:
                self.pins[k] -= 1

    def prepare_store(self, keys):
        """Chunks for the `keys` not stored or being stored yet: (to_store
        [(key, base)], evicted keys), or None when the range cannot hold
        them all (nothing changes then)."""
        new = []
        for k in dict.fromkeys(keys):
            if k in self.stored:
                self.stored.move_to_end(k)
            elif k not in self.pending:
                new.append(k)
        short = len(new) - len(self.free)
        victims = []
        if short > 0:
            for k in self.stored:  # least recently used first
                if len(victims) == short:
                    break
                if not self.pins[k]:
                    victims.append(k)
            if len(victims) < short:
                return None
        for k in victims:
            self.free.append(self.stored.pop(k))
        if victims:
            self.free.sort(reverse=True)
            self._write(delete=victims)
        out = []
        for k in new:
            base = self.free.pop()
            self.pending[k] = base
            out.append((k, base))
        return out, victims

    def complete_store(self, keys, success=True):
        """Keys whose STORE finished: stored (and written to the file) on
        success, their chunks freed otherwise."""
        done = []
        for k in keys:
            base = self.pending.pop(k, None)
            if base is None:
                continue
            if success:
                self.stored[k] = base
                done.append((k, base))
            else:
                self.free.append(base)
        self.free.sort(reverse=True)
        if done:
            self._write(put=done)

    def reset(self):
        """Forgets every stored key (in memory and in the file); chunks
        being stored or loaded stay until they complete."""
        gone = [k for k in self.stored if not self.pins[k]]
        for k in gone:
            self.free.append(self.stored.pop(k))
        self.free.sort(reverse=True)
        if gone:
            self._write(delete=gone)

    def close(self):
        self.db.close()
        os.close(self._lock)
