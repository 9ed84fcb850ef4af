"""Launch real multi-process training jobs on 127.0.0.1 and read their event logs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = str(REPO / "examples" / "pretrain_gpt.py")
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--use-distributed-optimizer", "--mock-data", "--lr-warmup-iters", "2",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MINDSPEED_HA_", "HIGH_AVAILABILITY", "MS_ENABLE_TFT", "MEGATRON_LM_PATH"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"})
    env.update(extra or {})
    return env


def torchrun(nproc: int, args: list[str], log_dir, env: dict | None = None, timeout: int = 300,
             cwd=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           PRETRAIN, *args, "--ha-log-dir", str(log_dir)]
    os.makedirs(log_dir, exist_ok=True)
    return subprocess.run(cmd, env=clean_env(env), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or str(log_dir))


def events(log_dir, name: str) -> list[dict]:
    path = Path(log_dir) / "events" / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def all_rank_events(log_dir) -> list[dict]:
    out = []
    for p in sorted((Path(log_dir) / "events").glob("rank_*.jsonl")):
        out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return out


def losses(log_dir) -> dict[int, str]:
    """iteration -> loss_hex, from whichever rank wrote step events."""
    return {e["iteration"]: e["loss_hex"] for e in all_rank_events(log_dir) if e["event"] == "step"}


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
