"""Where a whole-job drill's time goes: start-up, training, recovery and the end, with the node's first
workers forked from the pre-imported template and started as processes, side by side.

    python benchmarks/job_phases.py [--repeats 2]

The drills are the test suite's typical ones (the tiny GPT of tests/helpers.py, 9 steps, under
`mindspeed-ha run`): fault-free on 4 ranks and on 8 (TP=2 x DP=4), a memory error under retry, a kill
under recover, a kill under dump. For each: start-up (launch -> rank 0's first step ended), training
(first to last step, less recovery), recovery (the controller's MTTRs), end (last step -> the agent's
exit), measured from the job's own event logs; then the recovery's phases (``phase_*``, the
controller's ``recovered`` event) and a restarted worker's join by part (``join_*``, its ``joined``
event: from its assignment to its session, to the rebuild order, its set-up by part, its groups'
connection). Each pair runs forked then processes
(``MINDSPEED_HA_FORK_WORKERS=0``), interleaved; figures are medians over the repeats. Last line: one
JSON object with each drill's phases and ``ratio`` (processes / forked, whole job).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import jobs  # noqa: E402  (how every benchmark starts a job)
PRETRAIN = os.path.join(ROOT, "examples", "pretrain_gpt.py")
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--use-distributed-optimizer", "--mock-data", "--lr-warmup-iters", "2",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--train-iters", "9"]
DRILLS = {
    "fault-free dp4": (4, ["--enable-high-availability"], ""),
    "fault-free tp2xdp4": (8, ["--enable-high-availability", "--tensor-model-parallel-size", "2"], ""),
    "retry (uce)": (4, ["--enable-hbmfault-repair"], "uce:rank=2:step=4:phase=backward"),
    "recover (kill)": (4, ["--enable-worker-reboot"], "kill:rank=1:step=5:phase=optimizer"),
    "dump (kill)": (4, ["--enable-high-availability", "--save", "{dir}/ck"], "kill:rank=1:step=5:phase=optimizer"),
}


def events(log_dir: str) -> list[dict]:
    out = []
    for path in glob.glob(os.path.join(log_dir, "events", "*.jsonl")):
        for line in open(path):
            try:
                out.append({**json.loads(line), "file": os.path.basename(path)})
            except ValueError:
                pass
    return out


def run(name: str, forked: bool, root: str) -> dict:
    nproc, extra, inject = DRILLS[name]
    d = tempfile.mkdtemp(dir=root)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MINDSPEED_HA_FORK_WORKERS="1" if forked else "0")
    env.pop("MINDSPEED_HA_INJECT", None)
    env.pop("MEGATRON_LM_PATH", None)  # (it would send the example to Megatron-LM's loop, whose arguments differ)
    if inject:
        env["MINDSPEED_HA_INJECT"] = inject
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", str(nproc), PRETRAIN,
           *TINY, *[a.format(dir=d) for a in extra], "--ha-log-dir", os.path.join(d, "logs")]
    t0 = time.time()
    p = jobs.run(cmd, env=env, cwd=d, capture_output=True, text=True, timeout=600, log_dir=d)
    t_end = time.time()
    ev = events(os.path.join(d, "logs"))
    steps = sorted(e["time"] for e in ev if e["event"] == "step" and e["file"] == "rank_0.jsonl")
    steps = steps or sorted(e["time"] for e in ev if e["event"] == "step")
    mttr = sum(e.get("mttr_s", 0.0) for e in ev if e["event"] == "recovered")
    if not steps:
        raise RuntimeError(f"{name}: no step ran (exit {p.returncode})\n{p.stderr[-2000:]}")
    out = {"exit": p.returncode, "startup_s": steps[0] - t0, "training_s": max(0.0, steps[-1] - steps[0] - mttr),
           "recovery_s": mttr, "end_s": t_end - steps[-1], "total_s": t_end - t0}
    # A recovery's phases (the controller's), and a restarted worker's join by part (its own)
    for e in ev:
        if e["event"] == "recovered":
            out.update({f"phase_{k}_s": v for k, v in e.get("phases", {}).items()})
        if e["event"] == "joined":
            out.update({f"join_{k}": e[k] for k in ("to_session_s", "to_rebuild_s", "setup_s", "reconnect_s",
                                                     "total_s") if e.get(k) is not None})
            out.update({f"join_setup_{k}_s": v for k, v in (e.get("setup") or {}).items()})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--drills", nargs="*", default=list(DRILLS), choices=list(DRILLS))
    a = p.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as root:
        for name in a.drills:
            got = {True: [], False: []}
            for _ in range(a.repeats):
                for forked in (True, False):
                    got[forked].append(run(name, forked, root))
            med = {("forked" if k else "processes"): {f: round(statistics.median(r[f] for r in v if f in r), 3)
                                                      for f in v[0] if f != "exit"} for k, v in got.items()}
            exits = sorted({r["exit"] for v in got.values() for r in v})
            out[name] = {**med, "exit_codes": exits,
                         "ratio": round(med["processes"]["total_s"] / med["forked"]["total_s"], 2)}
            print(f"{name}: {json.dumps(out[name])}", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
