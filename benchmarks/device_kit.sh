#!/bin/bash
# The multi-rank NCCL check on a lent GPU machine, in two steps.
#
#   bash benchmarks/device_kit.sh prepare           # here, with the package registry: fills .device_kit/ (ignored)
#   bash benchmarks/device_kit.sh run               # there, on the GPU machine: the probe, then the engine's checks
#   bash benchmarks/device_kit.sh run --cpu         # here: the same steps on the emulated NCCL (checks this kit)
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
# The plan, against the 15 minutes of device time (the start and every call count), from a cold start:
#   start of the machine                      <= 4.0 min  (the device tool: "a minute or more")
#   one call: the wheels (about 5 MB)         <= 0.3 min  (--nccl: five more calls before it, ~0.5 min each)
#   0. preflight: 2 ranks make two NCCL       <= 0.3 min  (timeout 20 s: the transport the kit uses works at
#      communicators and all-reduce on them                all; if not, its output is the answer, and nothing
#                                                          else runs)
#   1. nccl_abort.py, blocking communicators  <= 2.5 min  (torch's default and the engine's: 2 and 4 ranks,
#                                                          a rank that skips and one killed, concurrent then
#                                                          serial aborts; a held one reports at 10 s)
#   2. the same, non-blocking communicators   <= 0.75 min (2 ranks, skip: does the mode change the answer?)
#   3. gpu_check.py --only multi-rank         <= 4.2 min  (its --budget 240: DP=2 reference, retry, recover,
#      --ranks 2                                           dump then --load, bitflip, in that order)
#                                             = 12.05 min at the worst, every step at its timeout; the call's
# timeout_s 520 covers steps 0-3 (500 s) and the install. `prepare` prints the call.
#
# What comes back under $OUT, each written as it happens (a run cut short still tells): run.log (this
# script's output: versions, every probe scenario's verdict, every check's), nccl_abort.jsonl (each rank's
# record of each scenario as it changes: stage, abort times, held stacks), gpu_check.jsonl (each check's
# result as it ends), logs.tgz (the jobs' event logs and the ranks' held reports, refreshed every 30 s).
#
# Read them in this order: run.log's `verdict` lines (one a step, as each ends); a failed preflight means
# the transport itself does not work there (its output says why, a rank held making its communicators
# says where after 15 s) and nothing else ran; if nccl_abort reports the concurrent abort's survivors held, NCCL's abort
# itself does not free a host held behind a collective on that machine (its stacks and each group's abort
# time say where); if the serial abort's survivors are held and the concurrent one's freed, the device-wide
# wait is real and the engine's abort is the answer to it; if both pass and gpu_check's checks fail, the
# engine's `stop:` lines and held reports in logs.tgz say where. Blocking and non-blocking communicators
# answering differently is the evidence docs/nccl.md's choice of mode waits for.
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
    echo "  carry [\"$KIT/whl\"]  command: bash benchmarks/device_kit.sh run  timeout_s: 520"
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
  echo "  carry [\"$last\", \"$KIT/sha256\", \"$KIT/whl\"]  command: bash benchmarks/device_kit.sh run  timeout_s: 520"
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
  # each step's timeout (the plan's), the probe's ranks and its held report's delay
  local cpu=() ranks=(2 4) held_after=10 t_preflight=20 t_blocking=150 t_nonblocking=45 t_checks=250
  if [ "${1:-}" = "--cpu" ]; then  # (this machine's own packages and the emulated NCCL: the kit's dry run;
    # a CPU starts a process's torch and its ranks' gloo slower than a GPU machine its NCCL: thrice the time)
    cpu=(--cpu) ranks=(2) held_after=3 t_preflight=60 t_blocking=450 t_nonblocking=135 t_checks=750
  elif ! ls "$KIT"/whl/*.whl > /dev/null 2>&1; then
    echo "device_kit: missing $KIT/whl: run 'bash benchmarks/device_kit.sh prepare' where the registry is" \
         "reachable, then carry it as it prints" >&2
    return 2
  fi
  local out=${OUT:-/tmp/device_kit_out}
  mkdir -p "$out"
  if [ ${#cpu[@]} -eq 0 ]; then
    nccl_library
    case $? in
      0) export LD_PRELOAD=/tmp/libnccl.so.2 NCCL_MULTI_RANK_GPU_ENABLE=1 ;;
      3) export MINDSPEED_HA_NCCL_HOST_PER_RANK=1 ;;
      *) return 1 ;;
    esac
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$KIT"/whl/*.whl || return 1
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONUNBUFFERED=1 PYTORCH_NVML_BASED_CUDA_CHECK=1
  unset MEGATRON_LM_PATH  # (--only multi-rank: Megatron-LM's loop is not part of it)
  # the jobs' logs, refreshed under $OUT while they are written
  ( while sleep 30; do tar czf "$out/logs.tgz.tmp" -C /tmp --exclude='*.pt' --exclude='*.distcp' \
      --exclude='ck*' na_preflight na na_nonblocking gc 2>/dev/null && mv "$out/logs.tgz.tmp" "$out/logs.tgz"; done ) &
  local snapshots=$!
  {
    date -u
    [ ${#cpu[@]} -ne 0 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch; from mindspeed_ha import compat; print('torch', torch.__version__, 'nccl', compat.nccl_version())"
    echo "ranks share the GPU: ${MINDSPEED_HA_NCCL_HOST_PER_RANK:+each an NCCL host of its own (NCCL_HOSTID)}${NCCL_MULTI_RANK_GPU_ENABLE:+NCCL_MULTI_RANK_GPU_ENABLE=1 (carried NCCL)}${cpu[*]:+no GPU: the emulated NCCL (--cpu)}"
    # 0. the transport works at all (else every step after it would fail the same way: its output says why)
    timeout "$t_preflight" python3 benchmarks/nccl_abort.py "${cpu[@]}" --preflight --setup-deadline 15 --keep /tmp/na_preflight \
      --journal "$out/nccl_abort.jsonl" 2>&1
    local r=$? worst=0
    echo "verdict preflight: exit $r"
    if [ $r -ne 0 ]; then
      worst=1
    else
      # 1. the stop's abort alone: two groups, concurrent and serial aborts, blocking communicators (torch's default)
      TORCH_NCCL_USE_COMM_NONBLOCKING=0 timeout "$t_blocking" python3 benchmarks/nccl_abort.py "${cpu[@]}" --ranks "${ranks[@]}" \
        --held-after "$held_after" --keep /tmp/na --journal "$out/nccl_abort.jsonl" 2>&1
      r=$?; echo "verdict nccl_abort blocking: exit $r"; [ $r -eq 0 ] || worst=1
      # 2. the same question with non-blocking communicators
      TORCH_NCCL_USE_COMM_NONBLOCKING=1 timeout "$t_nonblocking" python3 benchmarks/nccl_abort.py "${cpu[@]}" --ranks 2 --peer skip \
        --held-after "$held_after" --keep /tmp/na_nonblocking --journal "$out/nccl_abort.jsonl" 2>&1
      r=$?; echo "verdict nccl_abort non-blocking: exit $r"; [ $r -eq 0 ] || worst=1
      # 3. the engine's multi-rank checks, in order of what they tell (its probe ran above)
      timeout "$t_checks" python3 benchmarks/gpu_check.py "${cpu[@]}" --only multi-rank --ranks 2 --budget 240 --skip-probe \
        --keep /tmp/gc --journal "$out/gpu_check.jsonl" 2>&1
      r=$?; echo "verdict gpu_check: exit $r"; [ $r -eq 0 ] || worst=1
    fi
    [ $worst -eq 0 ]
  } 2>&1 | tee "$out/run.log"
  local rc=$?
  kill "$snapshots" 2>/dev/null
  tar czf "$out/logs.tgz" -C /tmp --exclude='*.pt' --exclude='*.distcp' --exclude='ck*' na_preflight na na_nonblocking gc 2>/dev/null
  ls -la "$out"
  return $rc
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash benchmarks/device_kit.sh prepare [--nccl]|run [--cpu] (prepare here, run on the GPU machine)" >&2
     exit 2 ;;
esac
