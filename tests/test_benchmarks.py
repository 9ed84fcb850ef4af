"""Smoke test of benchmarks/replica_overhead.py: real 4-rank torchrun jobs, behaviour only (no timing)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers import REPO, clean_env, extended, extended_test

REQUIRED = ("ha_runtime_ratio", "step_time_ratio", "bytes_per_param_replica", "formula_replica",
            "bytes_per_param_distributed", "formula_distributed")


@extended_test  # (the replica optimizer's steps: every drill; the benchmark's own code: docs/figures.md)
def test_replica_overhead_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "replica_overhead.py"), "--iters", "4", "--warmup", "2",
         "--repeats", "1", "--keep", str(tmp_path)],
        env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(k in result for k in REQUIRED), result
    d = result["dp_size"]
    assert d == 4 and result["grad_dtype"] == "torch.bfloat16"
    # Measured from the live DDP buffers and optimizer: exactly ZeRO-1's 4+16/d, and twice the shard.
    assert result["formula_distributed"] == 4 + 16 / d and result["formula_replica"] == 4 + 32 / d
    assert result["bytes_per_param_distributed"] == result["formula_distributed"]
    assert result["bytes_per_param_replica"] == result["formula_replica"]
    # Counted collectives equal what the live buckets imply; per rank the replica scheme sends
    # S (one grad buffer), the plain one (d-1)/d S, MindSpeed's full all-reduce 2(d-1)/d S.
    assert result["grad_comm_matches_buckets"]
    s = result["grad_comm_bytes_distributed"]
    assert result["grad_wire_bytes_distributed"] == round(s * (d - 1) / d)
    assert result["grad_wire_bytes_replica"] == s
    assert result["grad_wire_bytes_mindspeed"] == round(2 * s * (d - 1) / d)
    assert result["step_time_ratio"] > 0


def test_chaos_schedule_covers_every_kind_at_every_phase():
    """benchmarks/chaos.py's schedule (its jobs take minutes: run by hand, figures in docs/figures.md)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import chaos
    for seed in (1, 2, 3):
        plan = chaos.schedule(seed)
        assert sorted((k, p) for k, _, _, p in plan) == sorted((k, p) for k in chaos.KINDS for p in chaos.PHASES)
        steps = [s for _, _, s, _ in plan]
        assert steps == sorted(set(steps)) and steps[0] >= 3
        assert all(r != 0 for k, r, _, _ in plan if k in chaos.ENDS_PROCESS)
        close = [(a, b) for a, b in zip(plan, plan[1:]) if b[2] - a[2] <= 2]
        assert close and all(b[1] != chaos.twin(a[1]) for a, b in close)
    assert chaos.schedule(7) == chaos.schedule(7) != chaos.schedule(8)


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
def test_controller_scale_recovery_smoke(relay):
    """benchmarks/controller_scale.py at 64 simulated ranks: its simulators answer every round as real ranks
    do today (a changed answer would turn its figure into a failed recovery), and status reads the job.
    With --relay every round's order reaches the ranks through their node's agent (the standby orders
    directly), and the agents' batches of answers carry the recovery."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "controller_scale.py"), "--ranks", "64",
                           "--recovery", *(["--relay"] if relay else [])], env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["recovery_ok"] and result["status_ok"], proc.stdout[-3000:]
    assert result["stop_received"] == 64 and result["dropped"] == 0
    assert set(result["recovery_phases"]) >= {"stop", "status", "rebuild+repair", "rollback+resume"}
    rounds = 4 * 64  # (stop, status, rebuild+repair, rollback+resume)
    assert result["orders_via"].get("agents", 0) == (rounds if relay else 0), result["orders_via"]


def test_the_projection_counts_the_communicators_with_the_controllers_own_policy(tmp_path):
    """benchmarks/projection.py at 1,024 GPUs (its control-plane figures given): a memory error in a forward
    remakes the faulted rank's tensor- and pipeline-parallel groups only (none with TP=1 and no pipeline),
    a recover every group of the restarted rank, the world's included; every MTTR adds its parts."""
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"1024": {"rounds_s": 0.5}}))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "projection.py"), "--control-json", str(control),
                           "--sizes", "1024"], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["layout"], r["strategy"]): r for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"]}
    assert rows[("16k TP=8 PP=8", "retry (forward)")]["remade"] == {"tp": 8, "pp": 8}
    assert rows[("7B TP=1", "retry (forward)")]["remade"] == {}
    recover = rows[("70B TP=8 PP=2", "recover")]["remade"]
    assert recover["world"] == 1024 and recover == rows[("70B TP=8 PP=2", "before")]["remade"]
    for r in rows.values():
        assert abs(r["mttr_s"] - (r["control_s"] + r["rebuild_s"] + r["repair_s"] + r["step_s"])) < 0.2, r


def test_controller_scale_says_which_round_failed_and_why():
    """A recovery that fails names its round and why: here the odd simulated ranks refuse the rebuild."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "controller_scale.py"), "--ranks", "64",
                           "--recovery", "--misbehave", "rebuild:refuse"], env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    failure = result.get("recovery_failure")
    assert not result["recovery_ok"] and failure, proc.stdout[-3000:]
    # (one order with the repair: its failure is a new fault of the ranks that refused it)
    assert failure["round"] == "rebuild+repair" and failure["kind"] == "refusal", failure
    # (reported with the first refusals to come in, from whichever agents answered first: odd ranks)
    refused = [int(r) for r in re.findall(r"rank (\d+): simulated refusal of rebuild", failure["why"])]
    assert refused and all(r % 2 for r in refused), failure
    assert "recovery FAILED in round rebuild+repair (refusal)" in proc.stdout


def test_mttr_short_form_ends_0_with_its_ratios(tmp_path):
    """benchmarks/mttr.py in a short form (retry against the torchrun baseline, a short job): the
    baseline's two launches are one drill job, so the relaunch resumes instead of failing again, and
    the benchmark ends 0 with the ratios docs/figures.md quotes."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "mttr.py"), "--no-torchft", "--ours", "retry",
                           "--layers", "1", "--hidden", "64", "--seq", "32", "--interval", "3", "--fault-step", "5",
                           "--iters", "6", "--keep", str(tmp_path)], env=clean_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["retry_lost_steps"] == 0
    assert result["torchrun_lost_steps"] == 1 and result["torchrun_processes"] == 8
    assert result["torchrun_mttr_ratio"] > 0 and result["torchrun_regain_ratio"] > 0, result


@pytest.mark.compat
def test_torchs_own_reconfigure_and_the_handwritten_rebuild_give_the_same_sums():
    """benchmarks/reconfigure.py: on torch >= 2.15 (the compat subset runs it there) both ways of
    giving the DP=4 drills' 21 groups new communicators — the same processes (retry) and a new
    process for rank 1 (recover) — leave every group's all-reduce right, and both are timed; before
    2.15 it says what is missing (exit 77)."""
    import torch.distributed as dist
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "reconfigure.py"), "--rounds", "1"],
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not hasattr(dist.ProcessGroupGloo, "get_reconfigure_handle"):
        assert proc.returncode == 77 and "torch >= 2.15" in result["missing"], proc.stdout[-2000:]
        return
    assert proc.returncode == 0 and result["ok"], proc.stdout[-3000:] + proc.stderr[-3000:]
    for drill in ("retry", "recover"):
        assert result[drill]["wrong"] == [] and result[drill]["handwritten_s"] > 0 and result[drill]["reconfigure_s"] > 0


def _job_workers(marker: str) -> list:
    import psutil
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if marker in cmd and "replica_overhead_worker.py" in cmd and "torch.distributed.run" not in cmd \
                and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


# (CI: the benchmark killed, which ends its torchrun, which ends the workers: both links of the chain;
# its torchrun alone with MINDSPEED_HA_TEST_ALL=1)
@pytest.mark.parametrize("victim", [extended("torchrun"), "benchmark"])
def test_a_benchmark_leaves_no_worker_behind_when_it_or_its_launcher_is_killed(tmp_path, victim):
    """benchmarks/replica_overhead.py's torchrun job, its four workers training: SIGKILL its torchrun
    (the workers end with their launcher), or the benchmark itself (the kernel ends its torchrun,
    and with it the workers): after 10 s no worker is left."""
    import signal
    import time

    import psutil
    bench = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "replica_overhead.py"), "--iters", "100000",
                              "--warmup", "1", "--repeats", "1", "--keep", str(tmp_path)],
                             env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not list(tmp_path.rglob("events/rank_3.jsonl")):
            time.sleep(0.5)  # (its workers are past their set-up: they train)
        workers = _job_workers(str(tmp_path))
        assert len(workers) == 4, f"{len(workers)} workers training (the benchmark: {bench.poll()})"
        if victim == "torchrun":
            (launcher,) = [c for c in psutil.Process(bench.pid).children() if "torch.distributed.run" in
                           " ".join(c.cmdline())]
            launcher.send_signal(signal.SIGKILL)
        else:
            bench.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _job_workers(str(tmp_path)):
            time.sleep(0.2)
        assert not _job_workers(str(tmp_path)), "workers left behind"
    finally:
        for p in _job_workers(str(tmp_path)):
            p.kill()
        bench.kill()
        bench.wait()


def test_the_baseline_check_names_a_figure_that_moved_the_wrong_way_beyond_its_noise(tmp_path):
    """benchmarks/check_baseline.py against a baseline of its own: within the noise is ok, beyond it
    the wrong way is WORSE (exit 1), the right way better (exit 0); a flag that must hold fails on
    any change; the committed baseline names a command for each benchmark and only figures its
    benchmark prints (read from the benchmark's docstring)."""
    base = {"host": "test", "benchmarks": {"b": {"command": "python benchmarks/b.py", "figures": {
        "mttr_median_s": {"runs": [0.50, 0.56], "noise": 0.06, "better": "lower"},
        "speedup": {"runs": [2.0, 2.2], "noise": 0.2, "better": "higher"},
        "bit_identical": {"runs": [True, True], "noise": 0}}}}}
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(base))

    def check(measured: dict, name: str = "b"):
        out = "progress line\n" + json.dumps(measured) + "\n"
        p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "check_baseline.py"), name, "--baseline",
                            str(path)], input=out, capture_output=True, text=True, timeout=60)
        return p.returncode, p.stdout, p.stderr

    code, out, _ = check({"mttr_median_s": 0.58, "speedup": 2.05, "bit_identical": True})
    assert code == 0 and json.loads(out.splitlines()[-1])["worse"] == [], out
    code, out, _ = check({"mttr_median_s": 0.70, "speedup": 2.5, "bit_identical": True})
    verdicts = {v["figure"]: v["verdict"] for v in json.loads(out.splitlines()[-1])["verdicts"]}
    assert code == 1 and verdicts == {"mttr_median_s": "worse", "speedup": "better", "bit_identical": "ok"}, out
    assert "WORSE" in out
    code, out, _ = check({"mttr_median_s": 0.40, "speedup": 1.7, "bit_identical": False})
    verdicts = {v["figure"]: v["verdict"] for v in json.loads(out.splitlines()[-1])["verdicts"]}
    assert code == 1 and verdicts == {"mttr_median_s": "better", "speedup": "worse", "bit_identical": "worse"}, out
    code, out, _ = check({"speedup": 2.1})
    assert code == 0 and "mttr_median_s" in out and "missing" in out, out
    code, _, err = check({}, name="nope")
    assert code == 2 and "'nope'" in err and "known: b" in err

    committed = json.loads((REPO / "benchmarks" / "baseline.json").read_text())
    for name, entry in committed["benchmarks"].items():
        script = entry["command"].split()[1]
        assert (REPO / script).is_file(), (name, script)
        text = (REPO / script).read_text()
        for figure, spec in entry["figures"].items():
            # (a figure its benchmark prints; a kind's or a strategy's keys are made in an f-string)
            parts = figure.split("_")
            pieces = [figure.split("_s_")[0]] + ["_".join(parts[i:]) for i in range(len(parts) - 1)]
            assert any(piece in text for piece in pieces), (name, figure)
            assert spec["noise"] >= 0 and spec["runs"], (name, figure)
