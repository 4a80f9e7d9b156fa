#!/bin/bash
# The kvfs vLLM plug-in (kvfs.vllm) against vLLM itself, on this machine's
# CPU: its worker with vLLM's own transfer specs, then vLLM's real
# Scheduler and OffloadingConnector loading kvfs.vllm (request A stores,
# the prefix cache is reset, request B hits and loads identical bytes; a
# new process finds them again). See tools/vllm_check.py.
#
#   tools/vllm_check.sh [--setup-only] [MOUNT]
#
# Without MOUNT it mounts a small kvfs (target/release/kvfs, or $KVFS_BIN;
# root and /dev/fuse needed) and unmounts it after. vLLM lives in a virtual
# environment outside the repository (KVFS_VLLM_VENV, default
# ~/.cache/kvfs/vllm-venv; about 8.5 GB with torch's CUDA libraries),
# built the first time, which needs the network: vLLM's pinned
# flashinfer-python is not on the package index, so vLLM's other
# requirements are installed, then vLLM itself without dependencies
# (VLLM_VERSION, default 0.34.0). CI does not run this.
set -euo pipefail
VENV=${KVFS_VLLM_VENV:-$HOME/.cache/kvfs/vllm-venv}
VERSION=${VLLM_VERSION:-0.34.0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
setup_only=0
if [ "${1:-}" = --setup-only ]; then setup_only=1; shift; fi
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "== building $VENV (vLLM $VERSION; needs the network)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  tmp=$(mktemp -d)
  "$VENV/bin/pip" download -q --no-deps -d "$tmp" "vllm==$VERSION"
  # Its requirements (no extras), less the ones the index lacks.
  "$VENV/bin/python" - "$tmp"/vllm-*.whl > "$tmp/req.txt" <<'PY'
import sys, zipfile
from email.parser import Parser
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for r in Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist"):
    if "extra ==" in r or r.startswith("flashinfer-python"):
        continue
    print(r)
PY
  "$VENV/bin/pip" install -q -r "$tmp/req.txt"
  "$VENV/bin/pip" install -q --no-deps "$tmp"/vllm-*.whl
  rm -rf "$tmp"
fi
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in', '$VENV')"
[ $setup_only = 1 ] && exit 0
MOUNT=${1:-}
cleanup() { :; }
if [ -z "$MOUNT" ]; then
  BIN=${KVFS_BIN:-$ROOT/target/release/kvfs}
  [ -x "$BIN" ] || { echo "no kvfs binary at $BIN: cargo build --release, or give KVFS_BIN or a MOUNT" >&2; exit 1; }
  work=$(mktemp -d)
  MOUNT=$work/mnt
  mkdir -p "$MOUNT"
  "$BIN" mount "$MOUNT" --backing "$work/backing" --t1 64MiB --layers 4 --blocks 256 --kv-heads 4 \
    --head-dim 64 --block-tokens 16 --dtype bf16
  cleanup() { "$BIN" umount "$MOUNT" >/dev/null 2>&1 || umount -l "$MOUNT"; rm -rf "$work"; }
fi
trap cleanup EXIT
PYTHONPATH="$ROOT/tools/python" PYTHONDONTWRITEBYTECODE=1 "$VENV/bin/python" "$ROOT/tools/vllm_check.py" "$MOUNT" \
  2>&1 | grep -vE "^(W[0-9]{4} |Failed to import from vllm._C|Initializing KVConnectorBase|Loading out-of-tree)"
