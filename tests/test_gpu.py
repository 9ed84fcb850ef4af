"""The GPU check (benchmarks/gpu_check.py). CI has no GPU: there it must say so and exit 77; on a
machine with an NVIDIA GPU (``pytest -m cuda``) every check that applies must pass."""
from __future__ import annotations

import hashlib
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


NCCL_ABORT = str(REPO / "benchmarks" / "nccl_abort.py")


def probe(*args, timeout=120):
    proc = subprocess.run([sys.executable, NCCL_ABORT, *args], env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_abort_probe_frees_every_survivor_of_a_concurrent_abort_and_holds_those_of_a_serial_one(tmp_path):
    """The probe the GPU check starts with, on the CPU backend with NCCL's semantics (whose abort,
    as NCCL's, waits for the device to go idle). Two groups, the idle one registered first, the
    all-reduce that rank 1 skipped on the second: aborted all at once, every survivor is freed with
    only its own contribution (what an abort leaves) and makes and uses a new communicator; aborted
    one after another, each survivor is held in the idle group's abort, which never returns. Rank 1
    killed instead fails their all-reduce with an error (no handling by the watchdog keeps them
    alive), and the concurrent abort's survivors rebuild."""
    journal = tmp_path / "journal.jsonl"
    proc, out = probe("--cpu", "--ranks", "4", "--held-after", "2", "--journal", str(journal), timeout=180)
    assert proc.returncode == 0 and out["ok"], proc.stdout[-3000:] + proc.stderr[-2000:]
    # (every record as it changed, in one file: what a run cut short leaves behind)
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert {(r["scenario"], r["stage"]) for r in lines if r["rank"] == 0} >= {
        ("4/skip/concurrent", "waiting (item)"), ("4/skip/concurrent", "done"), ("4/skip/serial", "waiting (item)")}
    scenarios = out["scenarios"]
    assert sorted(scenarios) == ["4/kill/concurrent", "4/kill/serial", "4/skip/concurrent", "4/skip/serial"]
    freed, held = scenarios["4/skip/concurrent"]["survivors"], scenarios["4/skip/serial"]["survivors"]
    assert sorted(freed) == sorted(held) == ["0", "2", "3"]
    assert {s["way"] for s in freed.values()} == {"item", "stream", "device"}
    for s in freed.values():
        assert s["result"] == "own" and 0 <= s["freed_after_abort_s"] < 2 and "wait_error" not in s, s
        assert s["rebuild_ok"] and s["rebuild_sum"] == 3.0, s
        assert set(s["abort"]["took"]) == {"idle", "stuck"} and None not in s["abort"]["took"].values(), s
    for s in held.values():
        assert s["held"].startswith("waiting (") and s["exit"] == "held: ended by the probe", s
        assert s["abort"]["took"] == {"idle": None}, s  # (the idle group's abort began first, and never returned)
        assert "reclaim" in s["stacks"] and "emulated_nccl.py" in s["stacks"], s["stacks"]
    killed = scenarios["4/kill/concurrent"]["survivors"]
    assert all(s["rebuild_ok"] for s in killed.values()), killed
    assert any("wait_error" in s for s in killed.values()), killed
    assert "nccl_abort 4/skip/serial: HELD" in proc.stdout and "nccl_abort 4/skip/concurrent: passed" in proc.stdout


def test_without_the_abort_the_probe_reports_each_survivor_held_with_its_stack():
    """The control: the probe can fail. No abort, and the survivor is still waiting when its time is
    up (two ranks: one survivor); it says so, with the frame it waits in."""
    proc, out = probe("--cpu", "--ranks", "2", "--peer", "skip", "--no-abort", "--held-after", "2")
    assert proc.returncode == 1 and not out["ok"], proc.stdout[-3000:]
    survivors = out["scenarios"]["2/skip/none"]["survivors"]
    assert sorted(survivors) == ["0"]
    for s in survivors.values():
        assert s["held"] == f"waiting ({s['way']})" and s["exit"] == "held: ended by the probe", s
        assert "in worker" in s["stacks"] and "emulated_nccl.py" in s["stacks"], s["stacks"]
    assert "HELD in waiting (item)" in proc.stdout


def _device_kit(kit, *args: str, out=None, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "benchmarks" / "device_kit.sh"), *args], capture_output=True,
                          text=True, env=clean_env({"DEVICE_KIT": str(kit), **({"OUT": str(out)} if out else {})}),
                          timeout=timeout)


def test_the_device_kit_prepares_its_wheels_and_its_cpu_dry_run_answers_every_step(tmp_path):
    """What a lent GPU gets, checked here: ``prepare`` fetches the wheels the GPU image lacks (its
    Python's), and ``run --cpu`` takes every step of the GPU run on the emulated NCCL — the preflight,
    the probe with blocking then non-blocking communicators, the engine's DP=2 checks — each one's
    verdict in run.log as it ends, and the records under $OUT."""
    kit = tmp_path / "kit"
    proc = _device_kit(kit, "prepare", timeout=300)
    assert proc.returncode == 0 and "command: bash benchmarks/device_kit.sh run  timeout_s: 520" in proc.stdout, \
        proc.stdout + proc.stderr[-2000:]
    wheels = sorted(p.name.split("-")[0] for p in (kit / "whl").glob("*.whl"))
    assert wheels == ["concurrent_log_handler", "megatron_core", "pyzmq"], wheels
    out = tmp_path / "out"
    proc = _device_kit(kit, "run", "--cpu", out=out, timeout=1500)
    log = (out / "run.log").read_text()
    assert proc.returncode == 0, log[-4000:] + proc.stderr[-2000:]
    verdicts = [line for line in log.splitlines() if line.startswith("verdict ")]
    assert verdicts == ["verdict preflight: exit 0", "verdict nccl_abort blocking: exit 0",
                        "verdict nccl_abort non-blocking: exit 0", "verdict gpu_check: exit 0"], verdicts
    assert "nccl_abort 2/none/none: passed" in log and "nccl_abort 2/skip/concurrent: passed" in log, log[-3000:]
    checks = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert {c["check"] for c in checks} >= {"retry_uce", "recover_kill", "dump_then_load"}, checks
    assert (out / "nccl_abort.jsonl").stat().st_size > 0 and (out / "logs.tgz").exists()


def test_the_device_kit_refuses_a_kit_that_did_not_all_arrive(tmp_path):
    """The GPU run's kit travels in parts over several calls to a machine that keeps them only while
    warm: a kit not prepared, or a part lost between calls, is said before anything is installed."""
    proc = _device_kit(tmp_path / "none", "run")
    assert proc.returncode == 2 and "device_kit.sh prepare" in proc.stderr, proc.stderr
    kit = tmp_path / "kit"
    (kit / "nccl").mkdir(parents=True)
    (kit / "whl").mkdir()
    (kit / "whl" / "pyzmq-0-py3-none-any.whl").write_bytes(b"")
    library = bytes(range(256)) * 3
    (kit / "sha256").write_text(hashlib.sha256(library).hexdigest() + "\n")
    (kit / "nccl" / "part00").write_bytes(library[:256])
    (kit / "nccl" / "part02").write_bytes(library[512:])  # (part01 never came)
    proc = _device_kit(kit, "run")
    assert proc.returncode == 1, proc.stderr
    assert "a part is missing or cut short" in proc.stderr and "part02 (256 B)" in proc.stderr, proc.stderr
    assert _device_kit(kit).returncode == 2
