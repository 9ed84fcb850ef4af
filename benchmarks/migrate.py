"""Migration: the pause of a requested migration, and a straggler found and moved by itself.

One 4-rank GPT job under `mindspeed-ha run --enable-worker-reboot --ha-migrate-stragglers`:
- at step ``--request-at`` the script asks `mindspeed-ha migrate --rank 2` (as an operator would);
- from step ``--slow-at`` rank 1 turns ``--factor`` times slower (the `slow` inject kind: it sleeps at
  each step's start), is found by its own work per step and moved to a spare by the controller.

Figures, from the job's own events:
- ``pause_s``: of the requested migration, the time no rank trained (last rank parked -> resume), as
  the `migrated` event gives it; ``step_gap_s``: the same seen from the steps, the time between the
  ends of the steps around the migration less one median step;
- ``straggler_detect_steps``: steps the slow rank ran before the `straggler` event (its first slow
  step counts as one);
- ``step_time_recovered``: the median step time after the automatic migration (past 3 settling
  steps) / before the slowdown (past the requested migration's settling steps) — 1.0 means the job
  is back at its speed; ``reference_after_over_before``: the same two windows of the fault-free
  run, the noise of this host;
- ``bit_identical``: every loss equals a fault-free reference run's, `float.hex` for `float.hex`.

Last line: one JSON object. Goals on a quiet 2-core machine: pause <= 1 s, detection within
--ha-straggler-steps + 1 steps, step time back within 5 %.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PRETRAIN = os.path.join(ROOT, "examples", "pretrain_gpt.py")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import jobs  # noqa: E402  (how every benchmark starts a job)
CLI = [sys.executable, "-m", "mindspeed_ha.cli"]


def command(a, log_dir: str) -> list[str]:
    return CLI + ["run", "--standalone", "--nproc-per-node", "4", PRETRAIN, "--num-layers", "2", "--hidden-size",
                  str(a.hidden), "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
                  "--use-distributed-optimizer", "--mock-data", "--lr-warmup-iters", "2", "--tokenizer-type",
                  "NullTokenizer", "--vocab-size", "128", "--train-iters", str(a.iters), "--enable-worker-reboot",
                  "--ha-migrate-stragglers", "--ha-straggler-steps", str(a.straggler_steps),
                  "--ha-log-dir", log_dir]


def env(inject: str | None = None) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MINDSPEED_HA_", "HIGH_AVAILABILITY"))}
    e.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if inject:
        e["MINDSPEED_HA_INJECT"] = inject
    return e


def events(log_dir: str, name: str) -> list[dict]:
    from mindspeed_ha.events import read_events
    path = os.path.join(log_dir, "events", f"{name}.jsonl")
    return read_events(path) if os.path.exists(path) else []


def steps(log_dir: str) -> dict[int, dict]:
    return {e["iteration"]: e for e in events(log_dir, "rank_0") if e["event"] == "step"}


def job(a, log_dir: str, inject: str | None, request: bool) -> None:
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "job.out"), "w") as out:
        proc = jobs.popen(command(a, log_dir), env=env(inject), stdout=out, stderr=subprocess.STDOUT,
                                cwd=log_dir)
        asked = False
        while request and not asked and proc.poll() is None:
            if max(steps(log_dir), default=0) >= a.request_at:
                ans = subprocess.run(CLI + ["migrate", "--log-dir", log_dir, "--rank", "2", "--reason", "benchmark"],
                                     env=env(), capture_output=True, text=True, timeout=60)
                print(f"migrate --rank 2: {(ans.stdout or ans.stderr).strip()}", flush=True)
                asked = ans.returncode == 0 or "no spare worker is ready" not in ans.stderr
                if not asked:
                    time.sleep(0.2)
            else:
                time.sleep(0.02)
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"job in {log_dir} ended with {proc.returncode}; see {log_dir}/job.out")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=90)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--request-at", type=int, default=8)
    p.add_argument("--slow-at", type=int, default=45)
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--straggler-steps", type=int, default=5)
    p.add_argument("--keep", default=None, help="keep the jobs' logs here")
    a = p.parse_args()
    work = a.keep or tempfile.mkdtemp(prefix="migrate_bench_")
    ref_dir, run_dir = os.path.join(work, "reference"), os.path.join(work, "migrate")
    job(a, ref_dir, None, request=False)
    job(a, run_dir, f"slow:rank=1:step={a.slow_at}:factor={a.factor:g}", request=True)

    ref, got = steps(ref_dir), steps(run_dir)
    identical = sorted(got) == list(range(1, a.iters + 1)) and all(got[i]["loss_hex"] == ref[i]["loss_hex"] for i in got)
    ctl = events(run_dir, "controller")
    moved = [e for e in ctl if e["event"] == "migrated"]
    asked = next(e for e in moved if e["reason"] == "benchmark")
    auto = next((e for e in moved if e["reason"].startswith("straggler")), None)
    found = next((e for e in ctl if e["event"] == "straggler" and e["rank"] == 1), None)
    ends = {i: e["time"] for i, e in got.items()}
    step_s = {i: ends[i] - ends[i - 1] for i in ends if i - 1 in ends}
    # Step time before the slowdown: past the requested migration and its settling steps, so that
    # before and after are alike (both after a migration, a spare being forked again).
    window = range(a.request_at + 6, a.slow_at)
    before = statistics.median(step_s[i] for i in window if i in step_s)
    # The requested migration happened between the steps around its event: the longest gap there.
    near = [i for i in step_s if ends[i] >= asked["time"] - asked["request_to_first_step_s"] and ends[i] <= asked["time"] + 0.5]
    gap = max(step_s[i] for i in near) - before if near else None
    mig_step = max(i for i in ends if ends[i] <= auto["time"]) if auto else None
    after = [step_s[i] for i in step_s if mig_step and i > mig_step + 3]
    # The same windows of the reference run: how much two windows of one healthy job differ here.
    ref_s = {i: ref[i]["time"] - ref[i - 1]["time"] for i in ref if i - 1 in ref}
    ref_ratio = (statistics.median(ref_s[i] for i in ref_s if mig_step and i > mig_step + 3)
                 / statistics.median(ref_s[i] for i in window if i in ref_s)) if after else None
    detect = found["iteration"] - a.slow_at + 1 if found else None
    out = {
        "pause_s": asked["pause_s"], "request_to_first_step_s": asked["request_to_first_step_s"],
        "step_gap_s": round(gap, 4) if gap is not None else None,
        "straggler_detect_steps": detect, "straggler_steps": a.straggler_steps,
        "straggler_ratio_seen": found["ratio"] if found else None,
        "auto_pause_s": auto["pause_s"] if auto else None,
        "step_s_before": round(before, 4), "step_s_after": round(statistics.median(after), 4) if after else None,
        "step_time_recovered": round(statistics.median(after) / before, 3) if after else None,
        "reference_after_over_before": round(ref_ratio, 3) if ref_ratio else None,
        "bytes_moved": asked["bytes"], "migrations": len(moved), "bit_identical": identical,
    }
    print(f"requested migration of rank 2: training paused {out['pause_s']} s (step gap {out['step_gap_s']} s); "
          f"straggler (rank 1, {a.factor:g}x from step {a.slow_at}) found after {detect} steps, moved in "
          f"{out['auto_pause_s']} s; step time after / before {out['step_time_recovered']}; bit-identical {identical}; "
          f"logs {work}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
