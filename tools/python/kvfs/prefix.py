"""The prefix index of kvfs.hf: block-aligned token prefixes -> kvfs
blocks, and the block ranges leased to live caches. Standard library only
(SQLite), so it is usable and testable without torch.

One row per block-aligned token prefix, keyed by a hash of the model id
and the tokens, names the block holding that prefix's last chunk: the
longest stored prefix of a prompt is the longest run of its prefixes'
keys found. Rows are immutable (the first writer wins: the bytes are the
same for the same weights and tokens). Leases keep two caches from ever
writing the same blocks, and keep indexed blocks from being handed out
again; a lease of a process that died is reclaimed. SQLite's locking
(WAL, `BEGIN IMMEDIATE`) keeps several processes writing at once
consistent, and the file outlives processes and mounts.
"""

import hashlib
import json
import os
import sqlite3
import time

DEFAULT_INDEX = os.path.join(os.path.expanduser("~"), ".cache", "kvfs", "prefix-index.sqlite")


class OutOfBlocks(RuntimeError):
    """The mount has no free range of blocks this large."""


class PrefixIndex:
    """Block-aligned token prefixes → kvfs blocks, and leases of block
    ranges to live caches (see the module note)."""

    def __init__(self, path=DEFAULT_INDEX):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.db = sqlite3.connect(path, timeout=30, isolation_level=None)
        # Switching to WAL needs the database to itself, and SQLite answers
        # "database is locked" at once (its busy timeout does not apply)
        # while another process opening it does the same: retry a while.
        deadline = time.monotonic() + 30
        while True:
            try:
                self.db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS prefix (key TEXT PRIMARY KEY, block INTEGER NOT NULL, "
            "tokens INTEGER NOT NULL, created REAL NOT NULL)")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS lease (base INTEGER NOT NULL, count INTEGER NOT NULL, "
            "pid INTEGER NOT NULL, started REAL NOT NULL)")

    @staticmethod
    def key(model_id, tokens):
        h = hashlib.sha256(model_id.encode())
        h.update(json.dumps([int(t) for t in tokens]).encode())
        return h.hexdigest()

    def lease(self, need, total):
        """A range of `need` consecutive blocks no live cache leases and no
        indexed prefix uses; raises OutOfBlocks."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            for base, count, pid in db.execute("SELECT base, count, pid FROM lease").fetchall():
                if not _alive(pid):
                    db.execute("DELETE FROM lease WHERE pid = ?", (pid,))
            used = [(b, b + 1) for (b,) in db.execute("SELECT block FROM prefix")]
            used += [(b, b + c) for b, c in db.execute("SELECT base, count FROM lease")]
            used.sort()
            at = 0
            for lo, hi in used:
                if lo - at >= need:
                    break
                at = max(at, hi)
            if at + need > total:
                raise OutOfBlocks(
                    f"the mount has {total} blocks; no {need} consecutive ones are free "
                    f"({len(used)} ranges in use by live caches and saved prefixes): "
                    f"lower max_tokens or batch_size, or mount with more --blocks")
            db.execute("INSERT INTO lease VALUES (?, ?, ?, ?)", (at, need, os.getpid(), time.time()))
            db.execute("COMMIT")
            return at
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def release(self, base):
        self.db.execute("DELETE FROM lease WHERE base = ? AND pid = ?", (base, os.getpid()))

    def add(self, rows):
        """rows: (key, block, tokens). The first writer of a key wins; the
        bytes are the same for the same model and tokens."""
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("INSERT OR IGNORE INTO prefix VALUES (?, ?, ?, ?)",
                            [(k, b, t, time.time()) for k, b, t in rows])
        self.db.execute("COMMIT")

    def find(self, keys):
        """Blocks of the longest run keys[0..k) that are all indexed."""
        out = []
        for k in keys:
            row = self.db.execute("SELECT block FROM prefix WHERE key = ?", (k,)).fetchone()
            if row is None:
                break
            out.append(row[0])
        return out


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
