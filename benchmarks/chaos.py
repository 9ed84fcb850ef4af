"""Chaos: one job, a seeded schedule of mixed faults back to back; MTTR as a distribution.

Two jobs of the same 4-rank GPT under `mindspeed-ha run --enable-hbmfault-repair --enable-worker-reboot`:
a fault-free reference, then the chaos job with `MINDSPEED_HA_INJECT` set to the schedule: every kind
(uce, comm, exception, kill, exit, hang) at every phase of a step (forward, backward, grad-sync,
optimizer, param-sync) once, in an order, on ranks and with gaps of 1-4 steps drawn from the seed
(a gap of 1 or 2 puts a fault into the first steps after the previous recovery; a hang never lands
in a process's first 3 steps, whose hang limit is 30 s). Process-ending
faults (kill, exit, hang) land on ranks 1-3: rank 0 hosts the controller, whose failover
benchmarks/mttr.py and the tests measure on their own; with ``--controller-rank`` they land on rank 0
too (the controller's own process: a standby takes over; a hang of the controller's host costs about
31 s, the status round's wait for its own rank before it ends that process). A fault 1-2 steps after another never hits
that one's twin (both copies of a shard at once is a reload from the periodic checkpoint, tested on
its own, not an in-job recovery).

For each `recovered` event of the controller: its faults, strategy, MTTR and phases. MTTR is the
controller's own: fault observed -> every rank completed the step after the one it resumed at. A
hang's MTTR starts with the hang timeout (3 s here), so hangs are reported apart (`hang_mttr_s`).
`lost_steps`: the controller's count, summed. `bit_identical`: every run of every step of the chaos
job (recomputed ones included) has the reference's loss, `float.hex` for `float.hex`.

Last line: one JSON object (`mttr_median_s`, `mttr_max_s`, `hang_mttr_s`, `lost_steps`,
`bit_identical`, ...). Goals on a quiet 2-core machine: median <= 1 s, max <= 2 s, 0 lost, identical.
"""
from __future__ import annotations

import argparse
import json
import os
import random
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
KINDS = ("uce", "comm", "exception", "kill", "exit", "hang")
PHASES = ("forward", "backward", "grad-sync", "optimizer", "param-sync")
ENDS_PROCESS = {"kill", "exit", "hang"}
WORLD = 4
HANG_TIMEOUT_S = 3


def schedule(seed: int, first_step: int = 5, controller_rank: bool = False) -> list[tuple[str, int, int, str]]:
    """(kind, rank, step, phase) for every kind x phase, shuffled, at distinct steps, none in a
    process's warm-up (its first 3 steps, whose hang limit is 30 s)."""
    rng = random.Random(seed)
    combos = [(k, p) for k in KINDS for p in PHASES]
    rng.shuffle(combos)
    out, step, gap = [], first_step, 99
    started = {r: 1 for r in range(WORLD)}  # the step each rank's process started at
    for kind, phase in combos:
        ranks = range(1, WORLD) if kind in ENDS_PROCESS and not controller_rank else range(WORLD)
        if gap <= 2:  # not the twin of a rank still recovering: that is both copies of a shard at once
            ranks = [r for r in ranks if r != twin(out[-1][1])]
        if kind == "hang":
            ranks = [r for r in ranks if step > started[r] + 3] or ranks
        rank = rng.choice(list(ranks))
        if kind in ENDS_PROCESS:
            started[rank] = step
        out.append((kind, rank, step, phase))
        gap = rng.choice((1, 2, 2, 3, 4))
        step += gap
    return out


def twin(rank: int) -> int:
    """The other holder of ``rank``'s optimizer shard (DP 4, two replicas: 0-2 and 1-3)."""
    return (rank + WORLD // 2) % WORLD


def run(log_dir: str, iters: int, a, inject: str | None, backend: str = "gloo") -> subprocess.CompletedProcess:
    os.makedirs(log_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", str(WORLD), PRETRAIN,
           "--num-layers", "2", "--hidden-size", str(a.hidden), "--num-attention-heads", "4", "--seq-length", "32",
           "--micro-batch-size", "2", "--use-distributed-optimizer", "--mock-data", "--lr-warmup-iters", "2",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--train-iters", str(iters),
           "--enable-hbmfault-repair", "--enable-worker-reboot", "--ha-hang-timeout", str(HANG_TIMEOUT_S),
           "--ha-spares", str(a.spares), "--ha-log-dir", log_dir,
           "--ha-max-restarts", "1000"]  # (a drill of many kills: not a crash-looping node)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINDSPEED_HA_", "HIGH_AVAILABILITY"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if backend == "emulated_nccl":  # (the CPU backend with NCCL's semantics: a stop aborts, no collective raises)
        env["MINDSPEED_HA_EMULATE_NCCL"] = "1"
        if os.environ.get("MINDSPEED_HA_EMULATE_NCCL_ABORT_RAISES"):  # (or aborted collectives raise: asked for)
            env["MINDSPEED_HA_EMULATE_NCCL_ABORT_RAISES"] = os.environ["MINDSPEED_HA_EMULATE_NCCL_ABORT_RAISES"]
    if inject:
        env["MINDSPEED_HA_INJECT"] = inject
    with open(os.path.join(log_dir, "job.out"), "w") as out:
        proc = jobs.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800, cwd=log_dir,
                        log_dir=log_dir)
    if proc.returncode != 0:
        raise SystemExit(f"job in {log_dir} ended with {proc.returncode}; see {log_dir}/job.out")
    return proc


def events(log_dir: str, prefix: str) -> list[dict]:
    from mindspeed_ha.events import read_events
    d = os.path.join(log_dir, "events")
    return [e for f in sorted(os.listdir(d)) if f.startswith(prefix) for e in read_events(os.path.join(d, f))]


def step_losses(log_dir: str) -> dict[int, set]:
    runs: dict[int, set] = {}
    for e in events(log_dir, "rank_"):
        if e["event"] == "step":
            runs.setdefault(e["iteration"], set()).add(e["loss_hex"])
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--spares", type=int, default=2, help="--ha-spares of the chaos job")
    p.add_argument("--keep", default=None, help="keep the jobs' logs here")
    p.add_argument("--controller-rank", action="store_true",
                   help="kills, exits and hangs may land on rank 0, the controller's own process")
    p.add_argument("--backend", choices=("gloo", "emulated_nccl"), default="gloo",
                   help="the chaos job's collectives: gloo, or the CPU backend with NCCL's semantics "
                        "(the reference runs on gloo: its bits are the same)")
    a = p.parse_args()
    work = a.keep or tempfile.mkdtemp(prefix="chaos_bench_")
    plan = schedule(a.seed, controller_rank=a.controller_rank)
    iters = plan[-1][2] + 3
    inject = ",".join(f"{k}:rank={r}:step={s}:phase={ph}" for k, r, s, ph in plan)
    print(f"seed {a.seed}: {len(plan)} faults over {iters} steps: {inject}", flush=True)
    t0 = time.time()
    run(os.path.join(work, "reference"), iters, a, None)
    t_ref = time.time() - t0
    t0 = time.time()
    run(os.path.join(work, "chaos"), iters, a, inject, a.backend)
    t_chaos = time.time() - t0

    ref, got = step_losses(os.path.join(work, "reference")), step_losses(os.path.join(work, "chaos"))
    identical = sorted(got) == list(range(1, iters + 1)) and all(got[i] == ref[i] for i in got)
    rec = [e for e in events(os.path.join(work, "chaos"), "controller") if e["event"] == "recovered"]
    by_step = {s: (k, r, ph) for k, r, s, ph in plan}
    rows = []
    for e in rec:
        steps = sorted({f["iteration"] for f in e["faults"]})
        injected = [by_step[s] for s in steps if s in by_step]
        hang = any(k == "hang" for k, _, _ in injected) or any(f["kind"] == "hang" for f in e["faults"])
        rows.append({"steps": steps, "injected": injected, "kinds": sorted({f["kind"] for f in e["faults"]}),
                     "strategy": e["strategy"], "how": e["how"], "mttr_s": e["mttr_s"], "hang": hang,
                     "lost_steps": e["lost_steps"], "phases": e["phases"]})
        inj = " + ".join(f"{k}@{ph} r{r}" for k, r, ph in injected) or "?"
        ph = " ".join(f"{n} {v:.3f}" for n, v in e["phases"].items())
        print(f"step {','.join(map(str, steps)):>6} {inj:34s} {e['strategy']:8s} {e['how'] or '':9s} "
              f"MTTR {e['mttr_s']:6.3f} s | {ph}", flush=True)
    plain = [r["mttr_s"] for r in rows if not r["hang"]]
    hangs = [r["mttr_s"] for r in rows if r["hang"]]
    faults_recovered = len({s for r in rows for s in r["steps"] if s in by_step})
    worker_starts = [e for e in events(os.path.join(work, "chaos"), "agent_") if e["event"] == "worker_start"
                     and e.get("restarts")]
    out = {
        "seed": a.seed, "backend": a.backend, "faults": len(plan), "faults_recovered": faults_recovered, "recoveries": len(rows),
        "steps": iters, "bit_identical": identical, "lost_steps": sum(r["lost_steps"] for r in rows),
        "mttr_median_s": round(statistics.median(plain), 3) if plain else None,
        "mttr_p90_s": round(statistics.quantiles(plain, n=10)[-1], 3) if len(plain) > 1 else None,
        "mttr_max_s": round(max(plain), 3) if plain else None,
        "hang_mttr_s": round(statistics.median(hangs), 3) if hangs else None,
        "hang_timeout_s": HANG_TIMEOUT_S,
        "restarts": len(worker_starts), "warm_spare_restarts": sum(bool(e.get("warm")) for e in worker_starts),
        "reference_wall_s": round(t_ref, 1), "chaos_wall_s": round(t_chaos, 1),
    }
    for kind in ("memory-error", "comm-failure", "other", "process-exit", "hang"):
        mine = [r["mttr_s"] for r in rows if kind in r["kinds"]]
        if mine:
            out[f"mttr_median_s_{kind}"] = round(statistics.median(mine), 3)
    print(f"MTTR without hangs: median {out['mttr_median_s']} s, p90 {out['mttr_p90_s']} s, max {out['mttr_max_s']} s "
          f"over {len(plain)} recoveries; hangs (timeout {HANG_TIMEOUT_S} s): median {out['hang_mttr_s']} s; "
          f"lost steps {out['lost_steps']}; bit-identical {identical}; logs {work}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
