"""Launch real multi-process training jobs on 127.0.0.1 and read their event logs."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

from mindspeed_ha.events import read_events

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = str(REPO / "examples" / "pretrain_gpt.py")
# (--optimizer adam: Megatron's own flag, which starts like one of ours: every drill passes it through)
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--use-distributed-optimizer", "--mock-data", "--lr-warmup-iters", "2",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--optimizer", "adam"]

# Megatron-LM's own loop (examples/pretrain_gpt.py with MEGATRON_LM_PATH set): ordinary Megatron-LM
# flags; the CPU ones (--transformer-impl local, fusions off, gloo, ...) are set by the adaptor.
# Dropout stays on (Megatron's default 0.1): the resume checks cover the RNG too.
MLM_PATH = os.environ.get("MEGATRON_LM_PATH", "")
MLM_READY = os.path.isdir(os.path.join(MLM_PATH, "megatron", "training"))
MLM_MISSING = ("needs Megatron-LM's megatron.training: set MEGATRON_LM_PATH to a checkout of NVIDIA/Megatron-LM "
               "at tag core_v0.16.1 or core_v0.12.1 (see docs/megatron-lm.md)")


def _mlm_release() -> tuple[int, int]:
    """The release of the Megatron-LM checkout at MEGATRON_LM_PATH (its megatron/core/package_info.py)."""
    import re
    try:
        text = open(os.path.join(MLM_PATH, "megatron", "core", "package_info.py")).read()
    except OSError:
        return (0, 0)
    major, minor = (re.search(rf"^{k} = (\d+)", text, re.M) for k in ("MAJOR", "MINOR"))
    return (int(major.group(1)), int(minor.group(1))) if major and minor else (0, 0)


MLM_RELEASE = _mlm_release()
# megatron-core 0.12 reduces the distributed optimizer's grad norm over every rank, later releases
# within the optimizer instance: only from 0.13 does a rank lost as its update starts leave the twin
# instance free to finish that update (a recovery then rolls forward).
MLM_GRAD_NORM_OVER_EVERY_RANK = MLM_RELEASE < (0, 13)
# Megatron-LM's mock documents count their tokens up to 4,095 before core_v0.16 (later ones wrap them
# into the vocabulary): a smaller vocabulary fails in the embedding, in Megatron-LM's own loop.
MLM_VOCAB = "128" if MLM_RELEASE >= (0, 16) else "4096"
MLM_TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", MLM_VOCAB,
            "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
            "--use-distributed-optimizer", "--enable-high-availability", "--ckpt-format", "torch_dist",
            "--optimizer", "adam"]
MLM_ENV = {"MEGATRON_LM_PATH": MLM_PATH}


# The CPU backend with NCCL's semantics (mindspeed_ha/comm/emulated_nccl.py): collectives return at
# once and a stop aborts them, with partial results and no error. Its results are gloo's bits, so its
# drills compare with the same fault-free references.
BACKENDS = ("gloo", "emulated_nccl")
# (MINDSPEED_HA_TEST_ABORT_RAISES=1: every drill on that backend with aborted collectives that raise)
NCCL_SEMANTICS = {"MINDSPEED_HA_EMULATE_NCCL": "1", **(
    {"MINDSPEED_HA_EMULATE_NCCL_ABORT_RAISES": "1"} if os.environ.get("MINDSPEED_HA_TEST_ABORT_RAISES") == "1" else {})}


def backend_env(backend: str) -> dict:
    return NCCL_SEMANTICS if backend == "emulated_nccl" else {}


# Drills CI leaves out for its time (the same code path is drilled on the other backend or layout in
# CI): they run with MINDSPEED_HA_TEST_ALL=1.
ALL = os.environ.get("MINDSPEED_HA_TEST_ALL", "") == "1"


def extended(*values, marks=(), **kw):
    """A ``pytest.param`` CI leaves out (skipped with the reason unless MINDSPEED_HA_TEST_ALL=1)."""
    import pytest
    marks = [*marks,
             pytest.mark.skipif(not ALL, reason="extended drill: runs with MINDSPEED_HA_TEST_ALL=1 (docs/quickstart.md)")]
    if "emulated_nccl" in values:
        marks.append(pytest.mark.nccl)
    return pytest.param(*values, marks=marks, **kw)


def extended_test(fn):
    """A whole test CI leaves out, as ``extended`` does a parameter (its docstring or a comment says
    where CI drills the same path)."""
    import pytest
    return pytest.mark.skipif(not ALL, reason="extended drill: runs with MINDSPEED_HA_TEST_ALL=1 (docs/quickstart.md)")(fn)


def on(*values, marks=(), **kw):
    """A ``pytest.param`` CI runs (marked ``nccl`` when it runs on the emulated NCCL backend)."""
    import pytest
    return pytest.param(*values, marks=[*marks, *([pytest.mark.nccl] if "emulated_nccl" in values else [])], **kw)


# The session's fork server (conftest.py): the agents' spare templates fork from it instead of
# importing torch and megatron-core again (mindspeed_ha/launcher/fork_server.py).
FORK_SERVER: str | None = None


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MINDSPEED_HA_", "HIGH_AVAILABILITY", "MS_ENABLE_TFT", "MEGATRON_LM_PATH"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"})
    if FORK_SERVER:
        env["MINDSPEED_HA_FORK_SERVER"] = FORK_SERVER
    env.update(extra or {})
    return env


def torchrun(nproc: int, args: list[str], log_dir, env: dict | None = None, timeout: int = 300,
             cwd=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           PRETRAIN, *args, "--ha-log-dir", str(log_dir)]
    os.makedirs(log_dir, exist_ok=True)
    return subprocess.run(cmd, env=clean_env(env), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or str(log_dir))


def _dirs(log_dir) -> list:
    """One log dir, or several (nodes with node-local log dirs): read as one."""
    return list(log_dir) if isinstance(log_dir, (list, tuple)) else [log_dir]


def _lines(path: Path) -> list[dict]:
    return read_events(str(path))  # (the project's reader: a torn last line is skipped)


def events(log_dir, name: str) -> list[dict]:
    out = []
    for d in _dirs(log_dir):
        path = Path(d) / "events" / f"{name}.jsonl"
        if path.exists():
            out += _lines(path)
    return sorted(out, key=lambda e: e["time"]) if len(_dirs(log_dir)) > 1 else out


def all_rank_events(log_dir) -> list[dict]:
    out = []
    for d in _dirs(log_dir):
        for p in sorted((Path(d) / "events").glob("rank_*.jsonl")):
            out += _lines(p)
    return out


def step_runs(log_dir) -> dict[int, list[str]]:
    """iteration -> the loss_hex of every run of that step, in the order the logs hold them (a step
    recomputed after a rollback or a reload appears more than once)."""
    runs: dict[int, list[str]] = {}
    for e in all_rank_events(log_dir):
        if e["event"] == "step":
            runs.setdefault(e["iteration"], []).append(e["loss_hex"])
    return runs


def losses(log_dir) -> dict[int, str]:
    """iteration -> loss_hex. Every run of a step counts: a recomputed step whose loss differs from its
    first run by one bit fails here, whichever copy a later comparison would have looked at."""
    runs = step_runs(log_dir)
    differ = {i: r for i, r in runs.items() if len(set(r)) > 1}
    assert not differ, f"recomputed steps changed their loss: {differ}"
    return {i: r[0] for i, r in sorted(runs.items())}


def recomputed(log_dir) -> list[int]:
    return sorted(i for i, r in step_runs(log_dir).items() if len(r) > 1)


def twins_agree(log_dir, recovered: list[dict]) -> list[dict]:
    """Every replica check of the job passed (``--ha-verify-replicas-interval``), on every rank, and each
    recovery was followed by one: a repaired or rejoined shard equals its twin bit for bit."""
    checks = [e for e in all_rank_events(log_dir) if e["event"] == "replica_check"]
    bad = [e for e in checks if not e["ok"]]
    assert checks and not bad, bad or "no replica check ran"
    last = max(e["iteration"] for e in checks)
    for r in recovered:
        assert last >= r["iteration"] + 1, (last, r["iteration"])
    return checks


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode == 0:
        return
    # The controller's lines tell a failed recovery's story; four ranks' tracebacks would push them
    # out of the stderr's tail.
    story = [line for line in proc.stderr.splitlines() if "mindspeed_ha.control" in line]
    raise AssertionError(f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- controller\n"
                         + "\n".join(line[:600] for line in story[-40:]) + f"\n--- stderr\n{proc.stderr[-6000:]}")


def free_port() -> int:
    """A free port below the ephemeral range: a job binds it seconds after this check, and meanwhile
    the kernel hands ephemeral ports (what binding port 0 returns) to every outgoing connection of the
    jobs running on the host: gloo's, the stores', ZeroMQ's."""
    lo, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(200):
        port = random.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port below the ephemeral range")


# The fault-free runs most whole-job drills compare with: the tiny GPT for TINY_ITERS steps under
# `mindspeed-ha run` with HA on (a recovery strategy does not change a fault-free run's bits), DP=4 on
# 4 ranks, TP=2 x DP=4 on 8, or PP=2 x DP=2 on 4.
TINY_ITERS = 9
TINY_LAYOUTS = {"dp4": (4, []), "dp6": (6, []), "tp2": (8, ["--tensor-model-parallel-size", "2"]),
                "pp2": (4, ["--pipeline-model-parallel-size", "2"]),
                # an interleaved pipeline: 2 stages of 2 one-layer chunks, 4 micro-batches a rank and step (a
                # steady state, where a stage sends and receives both ways at once)
                "vpp2": (4, ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                             "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "16"]),
                "moe": (4, ["--num-experts", "4", "--expert-model-parallel-size", "2"]),
                "overlap": (4, ["--overlap-grad-reduce", "--overlap-param-gather"])}


class References:
    """Fault-free runs, one per configuration per test session, each made when a test first needs it
    (a selection of tests pays only for the references it uses). Under pytest-xdist the workers share
    them: the first to need one makes it under a file lock in the session's common temporary
    directory and writes its losses there; the others wait for it and read them."""

    def __init__(self, tmp_path_factory):
        self.factory, self.done, self.lock = tmp_path_factory, {}, threading.Lock()
        base = tmp_path_factory.getbasetemp()
        # (xdist gives each worker its own basetemp inside the session's: popen-gw0, popen-gw1, ...)
        self.shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def losses(self, name: str, nproc: int, args: list, env: dict | None = None, timeout: int = 300) -> dict:
        from filelock import FileLock
        with self.lock:
            if name in self.done:
                return self.done[name]
            made = self.shared / f"reference-{name}.json"
            with FileLock(str(made) + ".lock"):
                if not made.exists():
                    d = self.factory.mktemp(f"reference-{name}")
                    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", f"--nproc-per-node={nproc}",
                           PRETRAIN, *args, "--ha-log-dir", str(d)]
                    assert_ok(subprocess.run(cmd, env=clean_env(env), capture_output=True, text=True, timeout=timeout,
                                             cwd=str(d)))
                    made.write_text(json.dumps(losses(d)))
                self.done[name] = {int(k): v for k, v in json.loads(made.read_text()).items()}
            return self.done[name]

    def tiny(self, layout: str) -> dict:
        nproc, extra = TINY_LAYOUTS[layout]
        return self.losses(f"tiny-{layout}", nproc, [*TINY, "--train-iters", str(TINY_ITERS), *extra,
                                                     "--enable-high-availability", "--ha-verify-replicas-interval", "1"])

    def tiny_layouts(self) -> "TinyReferences":
        return TinyReferences(self)


class TinyReferences:
    """``ref["dp4"]`` / ``ref["tp2"]``: the tiny GPT's fault-free losses, made on first use."""

    def __init__(self, refs: References):
        self.refs = refs

    def __getitem__(self, layout: str) -> dict:
        return self.refs.tiny(layout)
