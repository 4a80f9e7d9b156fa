"""kvfs control-file client, standard library only.

    from kvfs import Kvfs, KvfsError
    with Kvfs("/mnt/kv") as kv:
        r = kv.register_host_region("/dev/shm/kv-region", 1 << 20)
        kv.store([(3, 17, 0, "K", r, 0)])            # region bytes -> group L3/B17/H0/K
        kv.restore([(3, 17, 0, "K", r, 8192)])       # group -> region offset 8192
        print(kv.query([(3, 17, 0, "K")]))           # [('t1', True)]

A request whose record and reply fit in 16 KiB travels as one ioctl(2);
a larger RESTORE or STORE puts its entries in a scratch host region of the
session (a /dev/shm file) and sends one ioctl naming them; other large
requests go as write(2) of the request record and read(2) of its reply
(Kvfs(mount, use_ioctl=False) uses write/read for all; the wire format is
specified in kvfs's README.md). Failures raise
KvfsError with .errno, .entry (the offending entry's index, or None) and a
message from the daemon.
"""

import ctypes
import errno
import fcntl
import json
import mmap
import os
import tempfile
import struct
import threading
import time

REQUEST_MAGIC = struct.unpack("<I", b"KVFQ")[0]
REPLY_MAGIC = struct.unpack("<I", b"KVFR")[0]
VERSION = 1
HELLO, REGISTER, UNREGISTER, RESTORE, STORE, QUERY, PREFETCH, WAIT, COMPLETION, RING = range(1, 11)
NO_ENTRY = 0xFFFFFFFF
FOREVER = 0xFFFFFFFFFFFFFFFF
STATES = {0: "empty", 1: "backing", 2: "t1"}
_HEADER = struct.Struct("<IHHIIQQ")     # magic, version, command, count, reserved, arg0, arg1
_REPLY = struct.Struct("<IHHIIQII")     # magic, version, command, status, count, value, failed, entry
_IO_ENTRY = "QIIIIQ"    # block, layer, head, kind, region, offset (32 bytes)
_STRIDED_ENTRY = "QIIIIQIIQ"  # ... offset, row_bytes, pad, pitch (48 bytes)
_KEY_ENTRY = "QIIII"     # block, layer, head, kind, pad (24 bytes)
_STATE = struct.Struct("<BBHI")         # state, dirty, pad, crc32c


REGISTER_CUDA = 1
ENTRIES_IN_REGION = 1  # RESTORE/STORE arg0 flag; the region id is in arg0's upper 32 bits
ENTRIES_STRIDED = 2    # RESTORE/STORE arg0 flag: 48-byte entries with row_bytes and pitch
DONE_WORD_SHIFT = 16   # RESTORE arg0 bits 16-31: done word index + 1 (see register_done_words)
REGISTER_DONE_WORDS = 2  # REGISTER flag, with REGISTER_CUDA: this fd's done words
_IOCTL_MAX = (1 << 14) - 1  # the size field of an ioctl number
_IOCTL_MESSAGE = 1024       # room for a reply's message in an ioctl buffer


def _ioctl_cmd(size):
    # _IOWR(0x4b, 1, size): the kernel copies `size` bytes in and out.
    return (3 << 30) | ((size & 0x3FFF) << 16) | (0x4B << 8) | 1


class Ticket(int):
    """A ticket number; for restores into CUDA regions, also the handle of
    the CUDA IPC event recorded after the copy (open it with
    torch.cuda.Event.from_ipc_handle(device, handle) or cuIpcOpenEventHandle
    and make a stream wait on it: no host round trip). done_word: the
    done word it names, if any (see Kvfs.register_done_words)."""

    ipc_event_handle = None
    done_word = None


def _ticket(value, message):
    t = Ticket(value)
    if message.startswith("ipc_event="):
        t.ipc_event_handle = bytes.fromhex(message[len("ipc_event="):])
    return t


def _done_bits(word):
    """RESTORE arg0 bits naming done word `word` (None: none)."""
    if word is None:
        return 0
    if not 0 <= word < 0xFFFF:
        raise ValueError(f"done word {word}: 0..65534")
    return (word + 1) << DONE_WORD_SHIFT


_libcuda = None


def _cuda():
    """The CUDA driver library (loaded on first use)."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuStreamWaitValue64_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        _libcuda.cuStreamWaitValue64_v2.restype = ctypes.c_int
    return _libcuda


class Encoded(bytes):
    """RESTORE/STORE entries already in wire form (see Kvfs.encode_entries);
    .strided: in the 48-byte strided form."""

    strided = False


class KvfsError(OSError):
    """A request or ticket kvfs refused or failed."""

    def __init__(self, errno, message, entry=None):
        super().__init__(errno, message)
        self.entry = entry
        self.message = message

    def __str__(self):
        # The daemon's messages about one entry begin "entry N:" already.
        named = self.entry is None or self.message.startswith(f"entry {self.entry}:")
        where = "" if named else f" (entry {self.entry})"
        return f"[errno {self.errno}] {self.message}{where}"


_KINDS = {"K": 0, "k": 0, 0: 0, "V": 1, "v": 1, 1: 1}


def _kind(k):
    try:
        return _KINDS[k]
    except (KeyError, TypeError):
        raise ValueError(f"kind must be 'K' or 'V', not {k!r}") from None


class Kvfs:
    """One session (one open fd) of MOUNT/.kvfs/control."""

    def __init__(self, mountpoint, use_ioctl=True):
        self.mountpoint = os.fspath(mountpoint)
        self._use_ioctl = use_ioctl
        control = os.path.join(self.mountpoint, ".kvfs", "control")
        try:
            self._fd = os.open(control, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT, f"{self.mountpoint} is not a kvfs mount (no .kvfs/control there)", control
            ) from None
        except OSError as e:
            if e.errno != errno.ENOTCONN:
                raise
            raise OSError(
                errno.ENOTCONN,
                f"the kvfs daemon of {self.mountpoint} is gone (killed or crashed); "
                f"`kvfs umount {self.mountpoint}` removes its dead mount, then mount again",
            ) from None
        self._lock = threading.RLock()
        self._scratch = None  # (region, mmap, size): where large batches' entries go
        self._done_words = None  # the int64 CUDA tensor of register_done_words
        version, layout = self._call(HELLO)
        self.version = version
        self.layout = json.loads(layout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def fileno(self):
        return self._fd

    def close(self):
        """Closes the session; in-flight work finishes, then its regions go."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._scratch is not None:
            self._scratch[1].close()
            self._scratch = None

    # --- the daemon's gauges ----------------------------------------------

    def stats(self):
        """The samples of MOUNT/.kvfs/stats (Prometheus text) as a dict:
        {"kvfs_t1_slots_total": 65536.0, 'kvfs_hits_total{tier="t1"}': ...}."""
        out = {}
        with open(os.path.join(self.mountpoint, ".kvfs", "stats")) as f:
            for line in f:
                if line.startswith("#") or not line.strip():
                    continue
                name, _, value = line.rstrip("\n").rpartition(" ")
                out[name] = float(value)
        return out

    def wait_t1_ready(self, timeout=None, poll=0.05):
        """Waits until all of T1's memory has arrived: the daemon allocates
        T1 (pinned, with a GPU) in the background after its first chunk,
        and GPU restores submitted meanwhile may wait milliseconds to be
        enqueued while a chunk is pinned. Returns the seconds waited; raises
        TimeoutError after `timeout` seconds (None: no limit) and
        RuntimeError with a daemon that does not report it."""
        t0 = time.monotonic()
        while True:
            s = self.stats()
            ready, total = s.get("kvfs_t1_slots_ready"), s.get("kvfs_t1_slots_total")
            if ready is None or total is None:
                raise RuntimeError("this kvfs daemon does not report kvfs_t1_slots_ready")
            if ready >= total:
                return time.monotonic() - t0
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise TimeoutError(f"T1: {ready:.0f} of {total:.0f} slots ready after {timeout} s")
            time.sleep(poll)

    # --- transport -------------------------------------------------------

    def _read_exact(self, n, buf):
        while len(buf) < n:
            chunk = os.read(self._fd, max(n - len(buf), 4096))
            buf += chunk  # an empty read ends one read(2); just read again
        return buf

    @staticmethod
    def _parse_reply(buf, read_more):
        """Decodes one reply from buf; read_more(n, buf) must return buf
        grown to at least n bytes."""
        buf = read_more(_REPLY.size + 4, buf)
        magic, version, command, status, count, value, failed, entry = _REPLY.unpack_from(buf)
        if magic != REPLY_MAGIC or version != VERSION:
            raise KvfsError(71, "bad reply from kvfs (magic or version)")  # EPROTO
        states_end = _REPLY.size + count * _STATE.size
        buf = read_more(states_end + 4, buf)
        (msg_len,) = struct.unpack_from("<I", buf, states_end)
        buf = read_more(states_end + 4 + msg_len, buf)
        states = [_STATE.unpack_from(buf, _REPLY.size + i * _STATE.size) for i in range(count)]
        message = bytes(buf[states_end + 4:states_end + 4 + msg_len]).decode("utf-8", "replace")
        return command, status, value, failed, entry, states, message

    def _read_reply(self):
        return self._parse_reply(b"", self._read_exact)

    def _send(self, header, body):
        # One writev, no joined copy: a 4096-entry batch is 128 KiB, and
        # copying it costs more than the rest of the call.
        n = os.writev(self._fd, [header, body])
        if n < len(header) + len(body):
            rest = memoryview(header + bytes(body))[n:]
            while rest:
                rest = rest[os.write(self._fd, rest):]

    def _ioctl(self, header, body, size):
        buf = bytearray(size)
        buf[:len(header)] = header
        buf[len(header):len(header) + len(body)] = body
        fcntl.ioctl(self._fd, _ioctl_cmd(size), buf, True)

        def have(n, b):
            if len(b) < n:
                raise KvfsError(71, "kvfs reply larger than the ioctl buffer")  # EPROTO
            return b

        return self._parse_reply(buf, have)

    def _call(self, command, count=0, arg0=0, arg1=0, body=b"", states=False):
        header = _HEADER.pack(REQUEST_MAGIC, VERSION, command, count, 0, arg0, arg1)
        # One ioctl(2) (one trip through FUSE) when the request and its reply
        # fit in an ioctl buffer; write(2) then read(2) otherwise.
        reply = _REPLY.size + (count * _STATE.size if states else 0) + 4 + _IOCTL_MESSAGE
        size = max(len(header) + len(body), reply)
        with self._lock:
            if size <= _IOCTL_MAX and self._use_ioctl:
                _, status, value, _, entry, st, message = self._ioctl(header, body, size)
            else:
                self._send(header, body)
                _, status, value, _, entry, st, message = self._read_reply()
        if status:
            raise KvfsError(status, message, None if entry == NO_ENTRY else entry)
        if states:
            return st
        return value, message

    # --- API -------------------------------------------------------------

    def register_host_region(self, path, size):
        """Registers `size` bytes of a regular file (e.g. in /dev/shm) as a region of this fd.

        A file that does not exist yet is made (mode 0600, `size` bytes of
        zeros); an existing one is used as it is (never truncated or grown:
        one shorter than `size` is refused)."""
        path = os.path.abspath(os.fspath(path))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            try:
                os.ftruncate(fd, size)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
            os.close(fd)
        p = path.encode()
        value, _ = self._call(REGISTER, len(p), 0, size, p)
        return value

    def register_cuda_region(self, ipc_handle, size, device=0, offset=0, _flags=REGISTER_CUDA):
        """Registers `size` bytes at `offset` of a CUDA allocation exported by
        cuIpcGetMemHandle (64 bytes). Raises KvfsError(ENODEV) without a CUDA driver."""
        handle = bytes(ipc_handle)
        if len(handle) != 64:
            raise ValueError(f"a CUDA IPC memory handle is 64 bytes, not {len(handle)}")
        payload = handle + struct.pack("<QII", offset, device, 0)
        value, _ = self._call(REGISTER, len(payload), _flags, size, payload)
        return value

    def register_tensor(self, tensor, _flags=REGISTER_CUDA):
        """Registers a contiguous CUDA tensor's bytes (torch is imported only here)."""
        import torch  # noqa: F401  (only to fail clearly when it is missing)

        if not tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError("register_tensor needs a contiguous CUDA tensor")
        storage = tensor.untyped_storage()
        device, handle, _size, storage_offset = storage._share_cuda_()[:4]
        handle = bytes(handle)
        # torch's caching allocator prefixes the cudaIpcMemHandle_t with a
        # version byte and a type byte ('c': a plain cudaMalloc block).
        if len(handle) == 66:
            if handle[1:2] != b"c":
                raise ValueError("this tensor lives in an expandable segment, which has no CUDA IPC "
                                 "memory handle; allocate it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
            handle = handle[2:]
        offset = storage_offset + tensor.storage_offset() * tensor.element_size()
        return self.register_cuda_region(handle, tensor.numel() * tensor.element_size(), device, offset, _flags)

    def register_done_words(self, tensor):
        """Registers a 1-D int64 CUDA tensor as this session's done words
        (one set a session); it is zeroed here, and the zeros have landed
        before the daemon can write a word (memory the caching allocator
        hands out again may hold an older session's tickets). A restore into CUDA
        regions may then name a word (restore(..., done_word=i)): right
        after its copy, the daemon's stream writes the ticket number into
        it, so a stream of this process can wait for the copy with
        wait_done_word, on the GPU, without the cross-process IPC event
        (whose stream wait cost about 0.27 ms a ticket on an H100). A word
        serves one running ticket at a time (EBUSY otherwise). Returns the
        region id."""
        import torch

        if tensor.dtype != torch.int64 or tensor.dim() != 1:
            raise ValueError("done words are a 1-D int64 CUDA tensor")
        if tensor.is_cuda:
            tensor.zero_()
            torch.cuda.synchronize(tensor.device)
        region = self.register_tensor(tensor, REGISTER_CUDA | REGISTER_DONE_WORDS)
        self._done_words = tensor
        return region

    def wait_done_word(self, stream, ticket, word):
        """Makes `stream` (a torch.cuda.Stream) wait, on the GPU, until done
        word `word` reaches `ticket` (the ticket of the restore that named
        it): cuStreamWaitValue64, no host round trip. The host should
        still collect the ticket (wait/done) to learn of failed entries."""
        t = self._done_words
        if t is None:
            raise ValueError("no done words registered on this session (register_done_words)")
        if not 0 <= word < t.numel():
            raise ValueError(f"done word {word}: the session has {t.numel()}")
        r = _cuda().cuStreamWaitValue64_v2(ctypes.c_void_p(stream.cuda_stream),
                                           ctypes.c_uint64(t.data_ptr() + 8 * word),
                                           ctypes.c_uint64(int(ticket)), ctypes.c_uint(0))  # GEQ
        if r != 0:
            raise KvfsError(errno.EIO, f"cuStreamWaitValue64 failed: CUresult {r}")

    def unregister(self, region):
        self._call(UNREGISTER, 0, region)

    def _io_body(self, entries):
        """(body, strided): 6-tuples (layer, block, head, kind, region,
        offset) in the 32-byte form; if any entry is an 8-tuple (…, offset,
        row_bytes, pitch), all in the 48-byte strided form (a 6-tuple is
        then contiguous: row_bytes 0)."""
        # One struct.pack call for the whole batch: per-entry packing costs
        # more than the rest of a 1024-entry request.
        flat = []
        add = flat.extend
        if all(len(e) == 6 for e in entries):
            for layer, block, head, kind, region, offset in entries:
                add((block, layer, head, _kind(kind), region, offset))
            return struct.pack("<" + _IO_ENTRY * len(entries), *flat), False
        for e in entries:
            if len(e) == 6:
                layer, block, head, kind, region, offset = e
                row_bytes, pitch = 0, 0
            elif len(e) == 8:
                layer, block, head, kind, region, offset, row_bytes, pitch = e
            else:
                raise ValueError(f"an entry is (layer, block, head, kind, region, offset) or that and "
                                 f"(row_bytes, pitch), not {e!r}")
            add((block, layer, head, _kind(kind), region, offset, row_bytes, 0, pitch))
        return struct.pack("<" + _STRIDED_ENTRY * len(entries), *flat), True

    def _key_body(self, keys):
        flat = []
        add = flat.extend
        for layer, block, head, kind in keys:
            add((block, layer, head, _kind(kind), 0))
        return struct.pack("<" + _KEY_ENTRY * (len(flat) // 5), *flat)

    def encode_entries(self, entries):
        """Pre-encodes RESTORE/STORE entries; pass the result to restore() or
        store() in place of the list to skip encoding on every call (an
        engine reusing the same block tables, a benchmark)."""
        body, strided = self._io_body(list(entries))
        e = Encoded(body)
        e.strided = strided
        return e

    def _entries(self, entries):
        """(count, body, arg0 flags)."""
        if isinstance(entries, Encoded):
            size = 48 if entries.strided else 32
            return len(entries) // size, entries, ENTRIES_STRIDED if entries.strided else 0
        entries = list(entries)
        body, strided = self._io_body(entries)
        return len(entries), body, ENTRIES_STRIDED if strided else 0

    def _scratch_for(self, size):
        """A host region of this session for batches' entries, at least
        `size` bytes (called with the lock held)."""
        if self._scratch is None or self._scratch[2] < size:
            old = self._scratch
            cap = 1 << max(20, (size - 1).bit_length())
            d = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="kvfs-entries-", dir=d)
            try:
                os.ftruncate(fd, cap)
                region = self.register_host_region(path, cap)
                mm = mmap.mmap(fd, cap)
            finally:
                os.close(fd)
                os.unlink(path)  # the daemon keeps its mapping
            self._scratch = (region, mm, cap)
            if old is not None:
                self.unregister(old[0])
                old[1].close()
        return self._scratch

    def ring(self, entries=256, data_bytes=16 << 20):
        """Sets up this session's submission/completion ring (one a session):
        RESTORE and STORE through shared memory, with no system call while
        the daemon is busy. Returns a Ring (see Ring)."""
        return Ring(self, entries, data_bytes)

    def _io(self, command, entries, flags_more=0):
        count, body, flags = self._entries(entries)
        flags |= flags_more
        if not self._use_ioctl or _HEADER.size + len(body) <= _IOCTL_MAX:
            return self._call(command, count, flags, body=body)
        # Too large for one ioctl: the entries go into this session's
        # scratch region and the request names them there (a bare header,
        # one trip through FUSE). The daemon has read them when the call
        # returns, so the next call may reuse the space.
        with self._lock:
            region, mm, _ = self._scratch_for(len(body))
            mm[:len(body)] = body
            return self._call(command, count, (region << 32) | ENTRIES_IN_REGION | flags, 0)

    def restore(self, entries, wait=True, done_word=None):
        """Restores groups into regions. entries: (layer, block, head, 'K'|'V', region, offset),
        or (…, offset, row_bytes, pitch): the group's bytes as rows of
        row_bytes, pitch bytes apart (an engine's interleaved layout).
        Returns the ticket (after it finished, when wait is true); for CUDA
        regions the ticket carries .ipc_event_handle. done_word: a word of
        register_done_words the copy's stream writes the ticket into
        (see wait_done_word), then kept as the ticket's .done_word."""
        ticket = _ticket(*self._io(RESTORE, entries, _done_bits(done_word)))
        ticket.done_word = done_word
        if wait:
            self.wait(ticket)
        return ticket

    def store(self, entries, wait=True):
        """Makes region bytes the groups' contents. Same entries as restore."""
        ticket, _ = self._io(STORE, entries)
        if wait:
            self.wait(ticket)
        return ticket

    def prefetch(self, keys, wait=True):
        """Brings groups into T1. keys: (layer, block, head, 'K'|'V')."""
        keys = list(keys)
        ticket, _ = self._call(PREFETCH, len(keys), body=self._key_body(keys))
        if wait:
            self.wait(ticket)
        return ticket

    def query(self, keys):
        """[(state, dirty)] per key, state one of 't1', 'backing', 'empty'."""
        keys = list(keys)
        st = self._call(QUERY, len(keys), body=self._key_body(keys), states=True)
        return [(STATES.get(s, "unknown"), bool(d)) for s, d, _, _ in st]

    def done(self, ticket):
        """Collects a ticket if it has finished (True), without waiting
        (False while it runs). Raises KvfsError if an entry failed."""
        try:
            self.wait(ticket, timeout=0)
            return True
        except KvfsError as e:
            if e.errno == errno.ETIMEDOUT:
                return False
            raise

    def wait(self, ticket, timeout=None):
        """Waits for a ticket (timeout in seconds; None: forever). Raises
        KvfsError if any entry failed or the timeout passed."""
        ms = FOREVER if timeout is None else max(0, int(timeout * 1000))
        self._call(WAIT, 0, ticket, ms)
        return ticket


_RING_HEADER = 4096
_SQE = struct.Struct("<QIIQQ")    # user_data, command, count, arg0, arg1
_CQE = struct.Struct("<QQIII4x")  # user_data, ticket, status, entry, failed
_U32 = struct.Struct("<I")
_SQ_HEAD, _SQ_TAIL, _CQ_HEAD, _CQ_TAIL, _SQ_SLEEPING, _CQ_WAITING = 0, 64, 128, 192, 256, 320
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)
_libc = None


def _futex(mm, at, op, val, timeout=None):
    """futex(2) on the u32 at byte `at` of the shared mapping (op 0 WAIT,
    1 WAKE; not private: the daemon's process shares the word)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    word = ctypes.c_uint32.from_buffer(mm, at)
    ts = None
    if timeout is not None:
        class _Ts(ctypes.Structure):
            _fields_ = [("s", ctypes.c_long), ("ns", ctypes.c_long)]
        ts = ctypes.byref(_Ts(int(timeout), int((timeout % 1) * 1e9)))
    _libc.syscall(_SYS_FUTEX, ctypes.byref(word), op, ctypes.c_uint32(val), ts, None, 0)
    del word


class RingCompletion(tuple):
    """(user_data, ticket, status, entry, failed): `ticket` 0 when the
    submission was refused, `status` 0 or an errno, `entry` the first
    failed entry (or None)."""

    __slots__ = ()

    user_data = property(lambda self: self[0])
    ticket = property(lambda self: self[1])
    status = property(lambda self: self[2])
    entry = property(lambda self: self[3])
    failed = property(lambda self: self[4])


class Ring:
    """A session's submission/completion ring (Kvfs.ring): a /dev/shm file
    registered as a region, `entries` submission and completion slots, then
    `data_bytes` where batches' entries are written (put) and named by
    offset when submitted, so a batch encoded once is submitted again and
    again without copying. The daemon admits each submission exactly as a
    RESTORE/STORE request and posts one completion per submission.

        ring = kv.ring()
        at = ring.put(kv.encode_entries(entries))   # once
        ring.submit(RESTORE, at, user_data=7)       # no system call while kvfs is busy
        for c in ring.reap(1):                       # completions, waiting for one
            assert c.status == 0

    Not thread-safe: one submitting and reaping thread a ring."""

    def __init__(self, kv, entries, data_bytes):
        if _SYS_FUTEX is None:
            raise KvfsError(errno.ENOSYS, f"kvfs rings need futex(2) on x86_64 or aarch64, not "
                                          f"{os.uname().machine}")
        if entries < 1 or entries & (entries - 1):
            raise ValueError(f"a ring of {entries} entries: give a power of two")
        self.kv, self.entries = kv, entries
        self.data_at = _RING_HEADER + 64 * entries
        size = self.data_at + data_bytes
        d = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="kvfs-ring-", dir=d)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
            self.region = kv.register_host_region(path, size)
        finally:
            os.close(fd)
            os.unlink(path)  # the daemon keeps its mapping
        kv._call(RING, entries, self.region, 0)
        self.size, self.sq_tail, self.cq_head, self._put_at = size, 0, 0, 0

    def _word(self, at):
        return _U32.unpack_from(self.mm, at)[0]

    def put(self, entries, at=None):
        """Writes a batch's entries (a list, or Kvfs.encode_entries' result)
        into the data area (at byte `at` of it, or after the last put):
        returns the handle `submit` takes."""
        e = entries if isinstance(entries, Encoded) else self.kv.encode_entries(entries)
        if at is None:
            at = self._put_at
        off = self.data_at + at
        if off + len(e) > self.size:
            raise KvfsError(errno.ENOSPC, f"{len(e)} bytes of entries at {at} do not fit the ring's "
                                          f"{self.size - self.data_at}-byte data area")
        self.mm[off:off + len(e)] = e
        self._put_at = at + len(e)
        return (off, len(e) // (48 if e.strided else 32), e.strided)

    def room(self):
        """Submission slots free now."""
        return self.entries - ((self.sq_tail - self._word(_SQ_HEAD)) & 0xFFFFFFFF)

    def submit(self, command, handle, user_data=0, done_word=None):
        """Submits a RESTORE or STORE of the entries `handle` names (from
        put); False when the submission ring is full (reap, then again).
        done_word: as Kvfs.restore's (a RESTORE into CUDA regions; the
        completion entry carries the ticket to wait for)."""
        if command not in (RESTORE, STORE):
            raise ValueError("a ring takes RESTORE and STORE")
        if self.room() == 0:
            return False
        off, count, strided = handle
        arg0 = ((self.region << 32) | ENTRIES_IN_REGION | (ENTRIES_STRIDED if strided else 0)
                | _done_bits(done_word))
        slot = self.sq_tail & (self.entries - 1)
        _SQE.pack_into(self.mm, _RING_HEADER + 32 * slot, user_data, command, count, arg0, off)
        self.sq_tail = (self.sq_tail + 1) & 0xFFFFFFFF
        _U32.pack_into(self.mm, _SQ_TAIL, self.sq_tail)
        if self._word(_SQ_SLEEPING):
            _futex(self.mm, _SQ_TAIL, 1, 0x7FFFFFFF)
        return True

    def peek(self, max_n=1 << 30):
        """Completions ready now (reaped)."""
        tail = self._word(_CQ_TAIL)
        out = []
        cq = _RING_HEADER + 32 * self.entries
        while self.cq_head != tail and len(out) < max_n:
            u, t, st, ent, failed = _CQE.unpack_from(self.mm, cq + 32 * (self.cq_head & (self.entries - 1)))
            out.append(RingCompletion((u, t, st, None if ent == NO_ENTRY else ent, failed)))
            self.cq_head = (self.cq_head + 1) & 0xFFFFFFFF
        _U32.pack_into(self.mm, _CQ_HEAD, self.cq_head)
        return out

    def reap(self, min_n=1, timeout=None, spin=None):
        """Waits until at least `min_n` completions are ready (or `timeout`
        seconds pass), then reaps all that are ready. It looks for them
        without sleeping for up to `spin` seconds first (by default 1 ms
        on a machine of 4 cores or more, else none: a 16 MiB ticket takes
        about half a millisecond on a GPU, and a futex wake-up tens of
        microseconds), then sleeps until the daemon wakes it."""
        if spin is None:
            spin = 1e-3 if (os.cpu_count() or 1) >= 4 else 0.0

        deadline = None if timeout is None else time.monotonic() + timeout
        out = self.peek()
        while len(out) < min_n:
            if deadline is not None and time.monotonic() >= deadline:
                break
            tail = self._word(_CQ_TAIL)
            if tail == self.cq_head and spin > 0:
                until = time.perf_counter() + spin
                while tail == self.cq_head and time.perf_counter() < until:
                    tail = self._word(_CQ_TAIL)
                spin = 0  # once a wait; after it, sleep
            if tail == self.cq_head:
                _U32.pack_into(self.mm, _CQ_WAITING, 1)
                if self._word(_CQ_TAIL) == self.cq_head:
                    _futex(self.mm, _CQ_TAIL, 0, tail, 0.01)
                _U32.pack_into(self.mm, _CQ_WAITING, 0)
            out.extend(self.peek())
        return out
