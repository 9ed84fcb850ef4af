"""What the dump (the survivors' dying-gasp checkpoint) costs and saves, measured on real 4-rank jobs under `mindspeed-ha run`.

Two kinds of job, the same GPT, `--save CK --save-interval K`:

- Save time, same state: rank 1 is killed in the forward of step K+1, so the survivors' dump
  writes iteration K — the very state the job's periodic save of iteration K wrote moments before.
  Compared: the periodic save (every rank, collective; `checkpoint` events of the ranks, the
  slowest rank) against the dump's write on the survivors (`write_s`: group of survivors,
  weight re-sync, replica election, save, checksums, re-read verification, rename) and against the
  controller's whole DUMP state (`seconds`: also the status round and the plan). Repeated; medians.
- Lost steps: rank 1 is killed in step 2K's optimizer update, the worst case for periodic
  checkpoints (K-1 completed steps since the last one). Lost = completed steps the resumed job must
  recompute: (2K-1) - (checkpoint iteration). Measured for the dump, and for a periodic-only
  restart from the newest periodic checkpoint of the same job; plus the expectation over a fault
  time uniform in the interval, (K-1)/2 for periodic, and the rank-seconds that wastes.

Last line: one JSON object (dump_vs_periodic_ratio, dump_write_vs_periodic_ratio, lost_steps_*...).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PRETRAIN = os.path.join(ROOT, "examples", "pretrain_gpt.py")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import jobs  # noqa: E402  (how every benchmark starts a job)


def model_args(a) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(a.seq), "--micro-batch-size", "2", "--vocab-size", str(a.vocab),
            "--tokenizer-type", "NullTokenizer", "--lr-warmup-iters", "1", "--use-distributed-optimizer",
            "--mock-data", "--log-interval", str(10 ** 6)]


def run_job(a, work: str, name: str, inject: str, iters: int) -> dict:
    from mindspeed_ha.events import read_events
    log_dir, ck = os.path.join(work, name), os.path.join(work, name, "ck")
    os.makedirs(log_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINDSPEED_HA_", "HIGH_AVAILABILITY"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MINDSPEED_HA_INJECT=inject)
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", "4", PRETRAIN,
           *model_args(a), "--train-iters", str(iters), "--save", ck, "--save-interval", str(a.interval),
           "--enable-high-availability", "--ha-log-dir", log_dir]
    proc = jobs.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=log_dir, log_dir=log_dir)
    ev_dir = os.path.join(log_dir, "events")
    ranks = [e for f in sorted(os.listdir(ev_dir)) if f.startswith("rank_")
             for e in read_events(os.path.join(ev_dir, f))]
    ctl = read_events(os.path.join(ev_dir, "controller.jsonl"))
    dumps = [e for e in ctl if e["event"] == "checkpoint" and e.get("kind") == "dying_gasp"]
    if proc.returncode == 0 or not dumps:
        raise SystemExit(f"{name}: expected a fault and a dump, got exit {proc.returncode}\n"
                         + proc.stderr[-3000:])
    periodic: dict[int, float] = {}
    for e in ranks:
        if e["event"] == "checkpoint" and e.get("kind") == "periodic":
            periodic[e["iteration"]] = max(periodic.get(e["iteration"], 0.0), e["seconds"])
    steps = [e["step_s"] for e in ranks if e["event"] == "step" and e["iteration"] > 1]
    if not a.keep:
        shutil.rmtree(ck, ignore_errors=True)
    return {"dump": dumps[0], "periodic": periodic, "step_s": statistics.median(steps) if steps else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--interval", type=int, default=4, help="periodic checkpoint interval K (steps)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keep", default=None, help="keep the jobs' logs and checkpoints in this directory")
    a = p.parse_args()
    K = a.interval
    work = a.keep or tempfile.mkdtemp(prefix="dump_bench_")
    os.makedirs(work, exist_ok=True)

    same = []
    for i in range(a.repeats):
        r = run_job(a, work, f"same_state_{i}", f"kill:rank=1:step={K + 1}:phase=forward", K + 2)
        d = r["dump"]
        if d["iteration"] != K or K not in r["periodic"]:
            raise SystemExit(f"same-state job {i}: dump of {d['iteration']}, periodic saves {sorted(r['periodic'])}")
        same.append({"periodic_s": r["periodic"][K], "dump_write_s": d["write_s"], "dump_s": d["seconds"],
                     "bytes": d["bytes"]})
        print(f"same state (iteration {K}), run {i}: periodic save {r['periodic'][K]:.3f} s (4 ranks), "
              f"dump write {d['write_s']:.3f} s, whole DUMP state {d['seconds']:.3f} s (3 survivors), "
              f"{d['bytes'] / 1e6:.1f} MB", flush=True)

    worst = run_job(a, work, "worst_case", f"kill:rank=1:step={2 * K}:phase=optimizer", 2 * K + 1)
    done_steps = 2 * K - 1  # completed before the fault
    dump_lost = max(0, done_steps - worst["dump"]["iteration"])
    periodic_it = max(i for i in worst["periodic"] if i <= done_steps)
    periodic_lost = done_steps - periodic_it
    step_s = worst["step_s"]
    print(f"fault in step {2 * K} (K={K}): dump of iteration {worst['dump']['iteration']} -> {dump_lost} "
          f"lost steps; periodic restart from iteration {periodic_it} -> {periodic_lost} lost steps "
          f"({periodic_lost * step_s * 4:.2f} rank-seconds at {step_s * 1000:.0f} ms/step)", flush=True)

    med = lambda k: statistics.median(x[k] for x in same)  # noqa: E731
    result = {
        "interval_k": K, "repeats": a.repeats, "checkpoint_bytes": same[0]["bytes"],
        "periodic_save_s": round(med("periodic_s"), 4), "dump_write_s": round(med("dump_write_s"), 4),
        "dump_state_s": round(med("dump_s"), 4),
        "dump_write_vs_periodic_ratio": round(statistics.median(x["dump_write_s"] / x["periodic_s"] for x in same), 3),
        "dump_vs_periodic_ratio": round(statistics.median(x["dump_s"] / x["periodic_s"] for x in same), 3),
        "lost_steps_dump": dump_lost, "lost_steps_periodic_worst": periodic_lost,
        "lost_steps_periodic_expected": (K - 1) / 2, "step_s": round(step_s, 4),
        "lost_rank_seconds_periodic_worst": round(periodic_lost * step_s * 4, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
