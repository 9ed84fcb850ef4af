"""The GPU check (benchmarks/gpu_check.py). CI has no GPU: there it must say so and exit 77; on a
machine with an NVIDIA GPU (``pytest -m cuda``) every check that applies must pass."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import REPO, clean_env

GPU_CHECK = str(REPO / "benchmarks" / "gpu_check.py")
HAS_GPU = torch.cuda.device_count() > 0


def run(*args, timeout=600):
    proc = subprocess.run([sys.executable, GPU_CHECK, *args], env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.compat
@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the check runs instead (test_gpu_check_passes)")
def test_without_a_gpu_it_exits_77_naming_what_is_missing():
    proc, out = run(timeout=60)
    assert proc.returncode == 77, proc.stderr[-2000:]
    assert not out["ok"] and out["checks"] == {} and "no NVIDIA GPU visible" in out["missing"]
    assert out["environment"]["torch"] == torch.__version__ and "--cpu" in out["missing"]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU (benchmarks/gpu_check.py)")
def test_gpu_check_passes():
    proc, out = run()
    assert proc.returncode == 0 and out["ok"], json.dumps(out, indent=1)[-6000:]
