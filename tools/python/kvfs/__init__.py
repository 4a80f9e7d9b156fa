"""kvfs: the Python client of kvfs's control file (MOUNT/.kvfs/control).

Standard library only; torch is optional and imported only by
Kvfs.register_tensor.

    from kvfs import Kvfs, KvfsError
    with Kvfs("/mnt/kv") as kv:
        r = kv.register_host_region("/dev/shm/kv-region", 1 << 20)
        kv.store([(3, 17, 0, "K", r, 0)])
        kv.restore([(3, 17, 0, "K", r, 8192)])

See kvfs.client for the wire format's constants and kvfs's README.md
("The control file") for the protocol.
"""

from .client import (
    COMPLETION,
    ENTRIES_IN_REGION,
    FOREVER,
    HELLO,
    NO_ENTRY,
    PREFETCH,
    QUERY,
    REGISTER,
    REGISTER_CUDA,
    REPLY_MAGIC,
    REQUEST_MAGIC,
    RESTORE,
    RING,
    STATES,
    STORE,
    UNREGISTER,
    VERSION,
    WAIT,
    Encoded,
    Kvfs,
    KvfsError,
    Ring,
    RingCompletion,
    Ticket,
)

__version__ = "0.1.0"

__all__ = [
    "Kvfs",
    "KvfsError",
    "Ticket",
    "Ring",
    "RingCompletion",
    "Encoded",
    "REQUEST_MAGIC",
    "REPLY_MAGIC",
    "VERSION",
    "HELLO",
    "REGISTER",
    "UNREGISTER",
    "RESTORE",
    "STORE",
    "QUERY",
    "PREFETCH",
    "WAIT",
    "COMPLETION",
    "RING",
    "NO_ENTRY",
    "FOREVER",
    "STATES",
    "REGISTER_CUDA",
    "ENTRIES_IN_REGION",
    "__version__",
]
