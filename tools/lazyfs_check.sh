#!/bin/bash
# Power cuts under LazyFS: kvfs's backing directory on LazyFS (a FUSE
# filesystem that keeps writes in its own cache until they are synced and
# drops every unsynced byte on `lazyfs::clear-cache`), crash cycles of
# `kvfs bench crash` (writers write and fsync groups, the daemon is
# SIGKILLed at a random moment), and after each kill a power cut:
# clear-cache, so whatever kvfs had not made durable with fsync/msync is
# gone. Then the remount, and every group judged against the writers'
# ledger: fsync'd groups hold their last fsync'd bytes or later ones, no
# group holds bytes never written to it. Exits non-zero on any violation.
#
#   tools/lazyfs_check.sh [--cycles N] [--writers N] [--seed S]
#
# kvfs: target/release/kvfs or $KVFS_BIN. LazyFS: built once (about a
# minute) into $KVFS_LAZYFS_DIR (default ~/.cache/kvfs/lazyfs) from
# $KVFS_LAZYFS_SRC (default ../shared/third_party, with lazyfs-build.sh),
# which needs libtoml11-dev libspdlog-dev libfuse3-dev cmake g++. The
# backing uses the file tier: LazyFS does not take O_DIRECT (the uring
# tier's reads and writes fail with EINVAL there). Root and /dev/fuse.
# Exit status 77: LazyFS could not be built here (nothing was tested).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${KVFS_BIN:-$ROOT/target/release/kvfs}
SRC=${KVFS_LAZYFS_SRC:-$ROOT/../shared/third_party}
OUT=${KVFS_LAZYFS_DIR:-$HOME/.cache/kvfs/lazyfs}
cycles=10; args=()
while [ $# -gt 0 ]; do
  case $1 in
    --cycles) cycles=$2; shift 2 ;;
    --writers|--seed) args+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$BIN" ] || { echo "no kvfs binary at $BIN: cargo build --release, or set KVFS_BIN" >&2; exit 1; }
if [ ! -x "$OUT/lazyfs" ]; then
  if [ ! -x "$SRC/lazyfs-build.sh" ] && [ ! -f "$SRC/lazyfs-build.sh" ]; then
    echo "LazyFS sources not found at $SRC (set KVFS_LAZYFS_SRC)" >&2; exit 77
  fi
  echo "== building LazyFS into $OUT"
  mkdir -p "$(dirname "$OUT")"
  # libfuse3-dev unpacked by .ci/run where it cannot be installed: its
  # headers and link name, found through the compiler's search paths.
  f3=${KVFS_FUSE3_DEV:-$HOME/.cache/kvfs/fuse3-dev}
  if [ -f "$f3/usr/include/fuse3/fuse.h" ]; then
    export CPATH="$f3/usr/include${CPATH:+:$CPATH}"
    export LIBRARY_PATH="$f3/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
  fi
  if ! bash "$SRC/lazyfs-build.sh" "$OUT" > "$OUT.build.log" 2>&1; then
    echo "LazyFS did not build (its dependencies: libtoml11-dev libspdlog-dev libfuse3-dev cmake g++); see $OUT.build.log" >&2
    exit 77
  fi
fi
work=$(mktemp -d /var/tmp/kvfs-lazyfs.XXXXXX)
mkdir -p "$work/root" "$work/lazy" "$work/scratch"
mkfifo "$work/done.fifo"
cat > "$work/lazyfs.toml" <<TOML
[faults]
fifo_path="$work/faults.fifo"
fifo_path_completed="$work/done.fifo"
[cache]
apply_eviction=false
[cache.simple]
custom_size="512mb"
blocks_per_page=1
[filesystem]
log_all_operations=false
logfile=""
TOML
cleanup() {
  for m in "$work"/scratch/*/mnt; do umount -l "$m" 2>/dev/null || true; done
  fusermount3 -u "$work/lazy" 2>/dev/null || umount -l "$work/lazy" 2>/dev/null || true
  kill "$lazy_pid" 2>/dev/null || true
  rm -rf "$work"
}
LD_LIBRARY_PATH=$OUT "$OUT/lazyfs" "$work/lazy" --config-path "$work/lazyfs.toml" \
  -o allow_other -o modules=subdir -o "subdir=$work/root" -f > "$work/lazyfs.log" 2>&1 &
lazy_pid=$!
trap cleanup EXIT
for _ in $(seq 100); do mountpoint -q "$work/lazy" && [ -p "$work/faults.fifo" ] && break; sleep 0.1; done
mountpoint -q "$work/lazy" || { echo "LazyFS did not mount:"; cat "$work/lazyfs.log"; exit 1; }
# Synchronous: the completion FIFO is held open before the command goes,
# so LazyFS's "finished" line cannot be missed; 20 s at most.
cut="timeout 20 bash -c 'exec 3<>$work/done.fifo; echo lazyfs::clear-cache > $work/faults.fifo; read -r -t 15 line <&3 && [ \"\${line#finished}\" != \"\$line\" ]'"
# The power cut itself, checked: an unsynced file's bytes go, a synced one's stay.
echo unsynced > "$work/lazy/probe-a"
python3 -c "import os,sys; f=os.open(sys.argv[1], os.O_CREAT|os.O_WRONLY); os.write(f, b'synced'); os.fsync(f)" "$work/lazy/probe-b"
sh -c "$cut"
if [ -s "$work/lazy/probe-a" ] || [ "$(cat "$work/lazy/probe-b")" != synced ]; then
  echo "LazyFS did not drop unsynced data on clear-cache: the check would prove nothing" >&2; exit 1
fi
echo "power cut (lazyfs::clear-cache): unsynced data dropped, synced data kept"
"$BIN" bench crash --dir "$work/scratch" --backing "$work/lazy/store" --tier file --cycles "$cycles" \
  --after-kill "$cut" "${args[@]}"
