#!/bin/bash
# The multi-rank NCCL check on a lent GPU machine, in two steps.
#
#   bash benchmarks/device_kit.sh prepare           # here, with the package registry: fills .device_kit/ (ignored)
#   bash benchmarks/device_kit.sh run               # there, on the GPU machine: the probe, then the engine's checks
#
# Why a kit: the GPU image (Python 3.12, torch 2.11.0+cu130 with NCCL 2.28.9) has none of pyzmq,
# megatron-core, concurrent-log-handler, and the machine reaches no registry: their wheels are carried.
#
# Several ranks on its one GPU: NCCL refuses two ranks with the same host hash and bus id. The run gives
# each rank an NCCL host of its own instead (MINDSPEED_HA_NCCL_HOST_PER_RANK=1: NCCL_HOSTID per process,
# NCCL's socket transport on the loopback; the engine's device.own_nccl_host), which the image's own NCCL
# serves: nothing large travels. That is how ranks on separate nodes meet (no P2P, SHM or NVLS path), and
# what the stop's abort has to free is the same: a kernel spinning on a peer that never comes. Read from
# NCCL 2.28.9's code (init.cc's duplicate-GPU check, utils.cc's getHostHash); not yet run on a GPU here.
# `prepare --nccl` also carries NCCL 2.32.3's library (344 MB, in six 55 MiB parts: one call each), for
# the other way, NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental; P2P/SHM between ranks).
#
# The plan, against the 15 minutes of device time (the start and every call count):
#   start of the machine                      1-4 min   (the device tool: "a minute or more")
#   one call: the wheels (about 5 MB)          seconds   (--nccl: five more calls before it, ~0.5 min each)
#   1. nccl_abort.py --ranks 2 4              ~2-3 min   (8 scenarios, <= 3 min; a held one reports at 10 s)
#      the same, 2 ranks, blocking comms       <= 1 min   (2 scenarios)
#   2. gpu_check.py --only multi-rank          <= 5 min  (its --budget: DP=2 reference, retry, recover, dump
#      --ranks 2                                          then --load, bitflip, in that order)
# so the probe's first scenario answers 2-5 minutes after the call is made, the whole probe 4-8 minutes
# after it, and the run ends within the call's timeout_s 590 (11-14 minutes in all). `prepare` prints the call.
#
# What comes back under $OUT, each written as it happens (a run cut short still tells): run.log (this
# script's output: versions, every probe scenario's verdict, every check's), nccl_abort.jsonl (each rank's
# record of each scenario as it changes: stage, abort times, held stacks), gpu_check.jsonl (each check's
# result as it ends), logs.tgz (the jobs' event logs and the ranks' held reports, refreshed every 30 s).
#
# Read them in this order: if nccl_abort reports the concurrent abort's survivors held, NCCL's abort
# itself does not free a host held behind a collective on that machine (its stacks and each group's abort
# time say where); if the serial abort's survivors are held and the concurrent one's freed, the device-wide
# wait is real and the engine's abort is the answer to it; if both pass and gpu_check's checks fail, the
# engine's `stop:` lines and held reports in logs.tgz say where.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1  # (the repository's root: the run tool's working directory)
KIT=${DEVICE_KIT:-.device_kit}  # (relative to the root; DEVICE_KIT: elsewhere)
NCCL_WHEEL=nvidia-nccl-cu13==2.32.3  # (prepare --nccl: any >= 2.30 lets ranks share a GPU)
# The newest megatron-core the engine supports: its own cp312 wheel (the GPU image is Python 3.12).
MEGATRON_CORE=megatron-core==0.19.2
PART_SIZE=55M

prepare() {
  rm -rf "$KIT" && mkdir -p "$KIT/whl" || return 1
  # the GPU image's Python is 3.12; msgpack and prometheus-client are on it already
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$KIT/whl" \
    pyzmq==27.3.0 "$MEGATRON_CORE" concurrent-log-handler==0.9.31 || return 1
  if [ "${1:-}" != "--nccl" ]; then
    echo "kit ready in $KIT ($(du -sh "$KIT" | cut -f1)); the one call for the device's run tool:"
    echo "  carry [\"$KIT/whl\"]  command: bash benchmarks/device_kit.sh run  timeout_s: 590"
    return 0
  fi
  mkdir -p "$KIT/nccl" "$KIT/download" || return 1
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$KIT/download" "$NCCL_WHEEL" || return 1
  python3 - "$KIT" <<'EOF' || return 1
import glob, sys, zipfile
kit = sys.argv[1]
(wheel,) = glob.glob(f"{kit}/download/nvidia_nccl*.whl")
with zipfile.ZipFile(wheel) as z, open(f"{kit}/download/libnccl.so.2", "wb") as out:
    out.write(z.read("nvidia/nccl/lib/libnccl.so.2"))
EOF
  sha256sum "$KIT/download/libnccl.so.2" | cut -d' ' -f1 > "$KIT/sha256"
  split -b "$PART_SIZE" -d "$KIT/download/libnccl.so.2" "$KIT/nccl/part"
  rm -rf "$KIT/download"
  local parts=("$KIT"/nccl/part*) last
  last=${parts[-1]}
  echo "kit ready in $KIT ($(du -sh "$KIT" | cut -f1)); the calls for the device's run tool, back to back:"
  for part in "${parts[@]}"; do
    [ "$part" = "$last" ] || echo "  carry [\"$part\"]  command: ls -la $KIT/nccl"
  done
  echo "  carry [\"$last\", \"$KIT/sha256\", \"$KIT/whl\"]  command: bash benchmarks/device_kit.sh run  timeout_s: 590"
}

# The carried NCCL library, joined and checked, when `prepare --nccl` made one (0: it is ready, 1: a
# part is missing, 3: none was carried).
nccl_library() {
  ls "$KIT"/nccl/part* > /dev/null 2>&1 || return 3
  [ -s "$KIT/sha256" ] || { echo "device_kit: $KIT/nccl has parts but no $KIT/sha256" >&2; return 1; }
  cat "$KIT"/nccl/part* > /tmp/libnccl.so.2
  if [ "$(sha256sum < /tmp/libnccl.so.2 | cut -d' ' -f1)" != "$(cat "$KIT/sha256")" ]; then
    echo "device_kit: the joined NCCL library is not the one prepared: a part is missing or cut short" \
         "(was the machine given back between the carrying calls? it keeps ignored files only while warm)." \
         "Parts here: $(cd "$KIT/nccl" && ls -l part* | awk '{printf "%s (%s B) ", $NF, $5}')" >&2
    return 1
  fi
}

run() {
  if ! ls "$KIT"/whl/*.whl > /dev/null 2>&1; then
    echo "device_kit: missing $KIT/whl: run 'bash benchmarks/device_kit.sh prepare' where the registry is" \
         "reachable, then carry it as it prints" >&2
    return 2
  fi
  nccl_library
  case $? in
    0) export LD_PRELOAD=/tmp/libnccl.so.2 NCCL_MULTI_RANK_GPU_ENABLE=1 ;;
    3) export MINDSPEED_HA_NCCL_HOST_PER_RANK=1 ;;
    *) return 1 ;;
  esac
  local out=${OUT:-/tmp/device_kit_out}
  mkdir -p "$out"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$KIT"/whl/*.whl || return 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_NVML_BASED_CUDA_CHECK=1
  unset MEGATRON_LM_PATH  # (--only multi-rank: Megatron-LM's loop is not part of it)
  # the jobs' logs, refreshed under $OUT while they are written
  ( while sleep 30; do tar czf "$out/logs.tgz.tmp" -C /tmp --exclude='*.pt' --exclude='*.distcp' \
      --exclude='ck*' na na_blocking gc 2>/dev/null && mv "$out/logs.tgz.tmp" "$out/logs.tgz"; done ) &
  local snapshots=$!
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch; from mindspeed_ha import compat; print('torch', torch.__version__, 'nccl', compat.nccl_version())"
    echo "ranks share the GPU: ${MINDSPEED_HA_NCCL_HOST_PER_RANK:+each an NCCL host of its own (NCCL_HOSTID)}${NCCL_MULTI_RANK_GPU_ENABLE:+NCCL_MULTI_RANK_GPU_ENABLE=1 (carried NCCL)}"
    # 1. the stop's abort alone: two groups, serial and concurrent, 2 and 4 ranks
    timeout 180 python3 benchmarks/nccl_abort.py --ranks 2 4 --held-after 10 --keep /tmp/na \
      --journal "$out/nccl_abort.jsonl" 2>&1
    echo "nccl_abort exit: $?"
    # 1b. the same question with blocking communicators (the engine makes non-blocking ones)
    TORCH_NCCL_USE_COMM_NONBLOCKING=0 timeout 60 python3 benchmarks/nccl_abort.py --ranks 2 --peer skip \
      --held-after 10 --keep /tmp/na_blocking --journal "$out/nccl_abort.jsonl" 2>&1
    echo "nccl_abort (blocking communicators) exit: $?"
    # 2. the engine's multi-rank checks, in order of what they tell (its probe ran above)
    timeout 320 python3 benchmarks/gpu_check.py --only multi-rank --ranks 2 --budget 300 --skip-probe \
      --keep /tmp/gc --journal "$out/gpu_check.jsonl" 2>&1
  } 2>&1 | tee "$out/run.log"
  local rc=$?
  kill "$snapshots" 2>/dev/null
  tar czf "$out/logs.tgz" -C /tmp --exclude='*.pt' --exclude='*.distcp' --exclude='ck*' na na_blocking gc 2>/dev/null
  ls -la "$out"
  return $rc
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) run ;;
  *) echo "usage: bash benchmarks/device_kit.sh prepare [--nccl]|run (prepare here, run on the GPU machine)" >&2
     exit 2 ;;
esac
