#!/bin/bash
# Same-run A/B of kvfs daemons on the GPU machine: each variant mounts a
# fresh T1 and backing, runs tools/gpu_e2e.py's bandwidth figures (every one
# against one big pinned copy of the same run) and is killed (its dirty T1
# is thrown away, not flushed), so variants alternate on one machine.
#
#   tools/gpu_ab.sh [-s "16 4"] [-r REPEATS] VARIANT...
#   VARIANT = NAME:BINARY[:VAR=VALUE,VAR=VALUE...]   (daemon environment)
#   e.g. tools/gpu_ab.sh base:.devbin/kvfs-old new:.devbin/kvfs-bin \
#        parts:.devbin/kvfs-bin:KVFS_RESTORE_PART_GROUPS=on
#
# Sizes: 16 (16 KiB groups, batches of 1024, T1 6 GiB) and 4 (4 KiB,
# llama-3.1-8b, batches of 4096, T1 12 GiB); 4 tickets in flight, 128
# batches, through RESTORE/STORE calls and the ring, timed once the daemon
# has pinned all of T1 (NOWAIT=1: at once, as the first seconds of a
# fresh mount run). LOG=debug adds the daemon's per-ticket timings to its
# log, copied to $OUT when set.
set -u
sizes="16 4"; reps=1
while getopts "s:r:h" o; do
  case $o in
    s) sizes=$OPTARG ;;
    r) reps=$OPTARG ;;
    *) sed -n 2,17p "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || { sed -n 2,17p "$0"; exit 2; }
for v in "$@"; do
  IFS=: read -r name bin _ <<< "$v"
  [ -x "$bin" ] || { echo "gpu_ab: variant $name: $bin is not an executable" >&2; exit 2; }
done
# One GPU run at a time (see tools/gpu_device_run.sh): figures taken beside
# another run's copies would be the two runs' share of the bus.
# Daemons are started without the lock's fd (9>&-): one left running by
# a run cut short would otherwise hold the lock, and the next run waits.
exec 9>/tmp/kvfs-gpu-run.lock
flock -w 600 9 || { echo "gpu_ab: another GPU run holds /tmp/kvfs-gpu-run.lock" >&2; exit 1; }
export PYTHONUNBUFFERED=1 RUST_LOG=info${LOG:+,kvfs::control=$LOG,kvfs::gpu=$LOG}
mnt=/mnt/kvfs-ab; back=/tmp/kvfs-ab
for rep in $(seq 1 "$reps"); do
  for sz in $sizes; do
    for v in "$@"; do
      IFS=: read -r name bin envs <<< "$v"
      env_args=(); [ -n "$envs" ] && IFS=, read -r -a env_args <<< "$envs"
      rm -rf $back; mkdir -p $mnt
      case $sz in
        16) geo=(--t1 6GiB --layers 8 --blocks 8192 --kv-heads 8 --head-dim 128 --block-tokens 64 --dtype bf16); batch=1024 ;;
        4) geo=(--t1 12GiB --preset llama-3.1-8b); batch=4096 ;;
        *) echo "gpu_ab: size $sz: 16 or 4" >&2; exit 2 ;;
      esac
      env "${env_args[@]}" "$bin" mount $mnt 9>&- --backing $back "${geo[@]}" >/dev/null || exit 1
      # T1 is pinned in the background after the mount returns, holding
      # GPU copies up meanwhile: every variant is timed once it is done
      # (the daemon logs it; older builds lack the stats gauge).
      for _ in $(seq $([ "${NOWAIT:-0}" = 1 ] && echo 0 || echo 600)); do
        awk '$1 == "kvfs_t1_slots_ready" { r = $2 } $1 == "kvfs_t1_slots_total" { t = $2 } END { exit !(r != "" && r == t) }' $mnt/.kvfs/stats && break
        grep -qE "chunks (pinned|allocated) in" $back/kvfs.log 2>/dev/null && break
        sleep 0.1
      done
      echo "== run $rep, $name, $sz KiB groups ${envs:+($envs)}"
      timeout -k 5 170 python3 tools/gpu_e2e.py $mnt --batch $batch --inflight 4 --rounds 128 --ring \
        $([ "${NOWAIT:-0}" = 1 ] && echo --no-t1-wait) 2>&1 \
        | grep -vE "^(registered|stored|restore)|CudaIPCTypes" | tail -19
      [ -n "${OUT:-}" ] && cp $back/kvfs.log "$OUT/ab_${rep}_${name}_$sz.log"
      pkill -9 -f "mount $mnt"; sleep 1; umount -l $mnt 2>/dev/null; rm -rf $back
    done
  done
done
