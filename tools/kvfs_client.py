"""Compatibility shim: the client is now the `kvfs` package (tools/python/kvfs).

    from kvfs import Kvfs, KvfsError      # new code
    from kvfs_client import Kvfs          # old scripts keep working

Every public name of kvfs.client is re-exported here. When this file sits
in kvfs's tools/ directory, tools/python goes first on sys.path, so the
package beside it is used even when it is not installed.
"""

import os as _os
import sys as _sys

_PKG_DIR = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "python")
if _os.path.isdir(_os.path.join(_PKG_DIR, "kvfs")) and _PKG_DIR not in _sys.path:
    _sys.path.insert(0, _PKG_DIR)

try:
    from kvfs.client import *  # noqa: E402,F401,F403
    from kvfs.client import (  # noqa: E402,F401
        Encoded,
        Kvfs,
        KvfsError,
        Ticket,
    )
except ModuleNotFoundError as _e:
    if _e.name not in ("kvfs", "kvfs.client"):
        raise
    raise ModuleNotFoundError(
        "kvfs_client.py re-exports the kvfs package: install it (pip install tools/python) "
        "or put tools/python on PYTHONPATH",
        name=_e.name,
    ) from _e
