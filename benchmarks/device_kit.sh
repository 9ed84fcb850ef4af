#!/bin/bash
# The multi-rank NCCL check on a lent GPU machine, in two steps.
#
#   bash benchmarks/device_kit.sh prepare   # here, with the package registry: fills .device_kit/ (ignored)
#   bash benchmarks/device_kit.sh run       # there, on the GPU machine: the probe, then the engine's checks
#
# Why a kit: the GPU image has torch 2.11.0+cu130 with NCCL 2.28.9, which refuses two ranks on one GPU,
# and none of pyzmq, megatron-core, concurrent-log-handler; the machine reaches no registry. NCCL >= 2.30
# lets ranks share a GPU with NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental), so its library is carried in
# and loaded in place of torch's (LD_PRELOAD; compat.nccl_version() asks the loaded library). It is
# 344 MB; a call carries at most 64 MiB, so it travels in parts of 55 MiB over back-to-back calls (a
# warm machine keeps ignored files between calls) and is joined and checked there.
#
# The carry plan `prepare` prints: one call per part but the last, each carrying that part with the
# command `ls -la .device_kit/nccl`; then one call carrying the last part, .device_kit/sha256 and
# .device_kit/whl with the command `bash benchmarks/device_kit.sh run` (timeout_s 590). Logs come back
# under $OUT: nccl_abort.log, gpu_check.log, logs.tgz (the ranks' events and the held reports).
#
# Read them in this order: if nccl_abort.py reports a survivor held, NCCL's abort itself does not free a
# host held behind a collective on that machine (its stacks and the abort's took_s say where); if it
# passes and gpu_check's checks fail, the engine's `stop:` lines and held reports say where it is.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1  # (the repository's root: the run tool's working directory)
KIT=${DEVICE_KIT:-.device_kit}  # (relative to the root; DEVICE_KIT: elsewhere)
NCCL_WHEEL=nvidia-nccl-cu13==2.32.3  # (the one that ran on the H200; any >= 2.30 lets ranks share a GPU)
PART_SIZE=55M

prepare() {
  rm -rf "$KIT" && mkdir -p "$KIT/whl" "$KIT/nccl" "$KIT/download" || return 1
  # the GPU image's Python is 3.12; msgpack and prometheus-client are on it already
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$KIT/whl" \
    pyzmq==27.3.0 megatron-core==0.16.1 concurrent-log-handler==0.9.31 || return 1
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
  echo "kit ready in $KIT ($(du -sh "$KIT" | cut -f1)); carry plan for the device's run tool:"
  for part in "${parts[@]}"; do
    [ "$part" = "$last" ] || echo "  carry [\"$part\"]  command: ls -la $KIT/nccl"
  done
  echo "  carry [\"$last\", \"$KIT/sha256\", \"$KIT/whl\"]  command: bash benchmarks/device_kit.sh run  timeout_s: 590"
}

run() {
  local missing=""
  [ -s "$KIT/sha256" ] || missing="$missing $KIT/sha256"
  ls "$KIT"/whl/*.whl > /dev/null 2>&1 || missing="$missing $KIT/whl"
  ls "$KIT"/nccl/part* > /dev/null 2>&1 || missing="$missing $KIT/nccl/part*"
  if [ -n "$missing" ]; then
    echo "device_kit: missing$missing: run 'bash benchmarks/device_kit.sh prepare' where the registry is" \
         "reachable, then carry the parts as it prints" >&2
    return 2
  fi
  local out=${OUT:-/tmp/device_kit_out}
  mkdir -p "$out"
  cat "$KIT"/nccl/part* > /tmp/libnccl.so.2
  if [ "$(sha256sum < /tmp/libnccl.so.2 | cut -d' ' -f1)" != "$(cat "$KIT/sha256")" ]; then
    echo "device_kit: the joined NCCL library is not the one prepared: a part is missing or cut short" \
         "(was the machine given back between the carrying calls? it keeps ignored files only while warm)." \
         "Parts here: $(cd "$KIT/nccl" && ls -l part* | awk '{printf "%s (%s B) ", $NF, $5}')" >&2
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$KIT"/whl/*.whl || return 1
  export PYTHONPATH=/tmp/site:$PWD
  export LD_PRELOAD=/tmp/libnccl.so.2 NCCL_MULTI_RANK_GPU_ENABLE=1 PYTHONUNBUFFERED=1 PYTORCH_NVML_BASED_CUDA_CHECK=1
  unset MEGATRON_LM_PATH  # (--only multi-rank: Megatron-LM's loop is not part of it)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; from mindspeed_ha import compat; print('torch', torch.__version__, 'nccl', compat.nccl_version())"
  # 1. the stop's abort alone (about 30 s; a held survivor reports 20 s after its abort)
  timeout 150 python3 benchmarks/nccl_abort.py --ranks 4 --keep /tmp/na 2>&1 | tee "$out/nccl_abort.log"
  # 2. the engine's multi-rank checks (the probe runs again there, first)
  timeout 400 python3 benchmarks/gpu_check.py --only multi-rank --ranks 4 --budget 380 --keep /tmp/gc 2>&1 \
    | tee "$out/gpu_check.log"
  local rc=$?
  tar czf "$out/logs.tgz" -C /tmp --exclude='*.pt' --exclude='*.distcp' --exclude='ck*' na gc 2>/dev/null
  ls -la "$out"
  return $rc
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: bash benchmarks/device_kit.sh prepare|run (prepare here, run on the GPU machine)" >&2; exit 2 ;;
esac
