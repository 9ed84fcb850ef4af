"""Mean time to recover: in-job retry and recover against a torchrun whole-job restart, same job.

Both jobs: the same 4-rank GPT, `--save CK --save-interval K`, and a fault on rank 1 in the backward
of step F (the worst case for periodic checkpoints is F = K*n + K, the best F = K*n + 1).

- **retry** (ours): `mindspeed-ha run ... --enable-hbmfault-repair` with `uce:rank=1:step=F:phase=backward`
  (an uncorrectable memory error: the rank's optimizer shard is poisoned). No process restarts. From
  the controller's `recovered` event: `mttr_s` (fault -> every rank completed the failed step again),
  `lost_steps`, and the phases.
- **recover** (ours): `... --enable-worker-reboot` with `kill:rank=1:step=F:phase=backward` (the
  process dies). Its agent restarts only that worker, which joins the running job and gets its
  state from its twin; the three others keep their processes. Same event, same definitions.
- **recover, the controller's rank** (ours): the same kill on rank 0, which hosts the controller: a
  standby takes over (``takeover_s``: the kill -> the standby's ``takeover`` event), then recovers
  rank 0 like any other; its MTTR is the new controller's ``recovered`` event, beside rank 1's.
- **torchrun** (baseline): `torchrun ... --load CK` with HA off (megatron-core's plain distributed
  optimizer) and `exit:rank=1:step=F:phase=backward` (the process dies; a memory error without
  repair ends the same way), then the same command again: every worker restarts and reloads the
  newest periodic checkpoint (see run_torchrun on why not `--max-restarts 1`). Measured from the ranks' events: fault -> first completed step of the new
  incarnation (MTTR, the same definition), fault -> step F completed again (back where it was), lost
  steps = (F - 1) - loaded iteration.

- **torchft** (the closest open peer; `pip install 'mindspeed-ha[peers]'`, else skipped): the same
  GPT, one torchft replica group per rank (4), torchft's Manager, DDP and optimizer wrapper and its
  own lighthouse (benchmarks/torchft_replica.py). Replica 1 is SIGKILLed after step F and started
  again at once (what a scheduler or torchelastic would do); it heals from a peer over torchft's
  HTTP checkpoint transport while the others go on with one replica less. MTTR: fault -> the
  restarted replica's first completed step. The survivors lose no step but train on 3/4 of the
  batch meanwhile (`missed_steps`: steps the group completed without replica 1); wasted
  rank-seconds = the dead replica's MTTR plus the survivors' steps beyond their steady step time.

Also: steady-state step time of each job, the rank-seconds each fault wastes (world x time until
step F is completed again) and the effective training time ratio (ETTR) those imply at a published
failure rate (Meta, 1,024-GPU jobs: one failure every 7.9 h), counting recovery only.
Ratios are baseline / ours (bigger is better).

Last line: one JSON object.
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
MTTF_S = 7.9 * 3600
WORLD = 4


def model_args(a) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "4",
            "--seq-length", str(a.seq), "--micro-batch-size", "2", "--vocab-size", "1024",
            "--tokenizer-type", "NullTokenizer", "--lr-warmup-iters", "1", "--use-distributed-optimizer",
            "--mock-data", "--log-interval", str(10 ** 6), "--train-iters", str(a.iters),
            "--save-interval", str(a.interval)]


def env() -> dict:
    # (MEGATRON_LM_PATH would send the example to Megatron-LM's loop, whose arguments differ)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MINDSPEED_HA_", "HIGH_AVAILABILITY", "MEGATRON_LM_PATH"))}
    e.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return e


def rank_events(log_dir: str) -> list[dict]:
    from mindspeed_ha.events import read_events
    d = os.path.join(log_dir, "events")
    return [e for f in sorted(os.listdir(d)) if f.startswith("rank_") for e in read_events(os.path.join(d, f))]


def median_step(events: list[dict], skip_below: int = 2) -> float:
    return statistics.median(e["step_s"] for e in events if e["event"] == "step" and e["iteration"] >= skip_below)


OURS = {"retry": ("--enable-hbmfault-repair", "uce", 1), "recover": ("--enable-worker-reboot", "kill", 1),
        "recover_rank0": ("--enable-worker-reboot", "kill", 0)}


def run_ours(a, work: str, name: str) -> dict:
    from mindspeed_ha.events import read_events
    flag, fault, rank = OURS[name]
    log = os.path.join(work, name)
    os.makedirs(log)
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", str(WORLD), PRETRAIN,
           *model_args(a), "--save", os.path.join(log, "ck"), flag, "--ha-log-dir", log]
    e = env()
    e["MINDSPEED_HA_INJECT"] = f"{fault}:rank={rank}:step={a.fault_step}:phase=backward"
    t0 = time.time()
    proc = jobs.run(cmd, env=e, capture_output=True, text=True, timeout=1200, cwd=log, log_dir=log)
    wall = time.time() - t0
    rec = [x for x in read_events(os.path.join(log, "events", "controller.jsonl")) if x["event"] == "recovered"]
    if proc.returncode != 0 or not rec:
        raise SystemExit(f"{name} job failed:\n" + proc.stderr[-3000:])
    ev = rank_events(log)
    pids = {x["pid"] for x in ev if x["event"] == "start"}
    out = {"mttr_s": rec[0]["mttr_s"], "regain_s": rec[0]["mttr_s"], "lost_steps": rec[0]["lost_steps"],
           "phases": rec[0]["phases"], "step_s": median_step(ev), "wall_s": wall, "processes": len(pids)}
    takeover = [x for x in read_events(os.path.join(log, "events", "controller.jsonl")) + ev if x["event"] == "takeover"]
    if takeover:
        fault = min(x["time"] for x in ev if x["event"] == "inject")
        out["takeover_s"] = takeover[0]["time"] - fault
    return out


def run_torchrun(a, work: str) -> dict:
    """The whole-job restart: the job dies with its rank, torchrun is started again with --load.
    (``torchrun --max-restarts 1`` restarts the workers itself, but here its restarted gloo workers
    hung in init_process_group — torch 2.13, CPU; the relaunch does the same work and leaves out
    torchrun's own restart latency, which favours the baseline.)"""
    log = os.path.join(work, "torchrun")
    os.makedirs(log)
    ck = os.path.join(log, "ck")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           PRETRAIN, *model_args(a), "--save", ck, "--load", ck, "--ha-log-dir", log]
    e = env()
    e["MINDSPEED_HA_INJECT"] = f"exit:rank=1:step={a.fault_step}:phase=backward"
    # Both launches are one job to the drill (it fires once per job): torchrun names each launch anew,
    # and the relaunch would otherwise fire the same exit again and end 1 too.
    e["MINDSPEED_HA_JOB_ID"] = f"mttr-torchrun-{os.getpid()}"
    t0 = time.time()
    # Output to files, not pipes: workers torchrun kills leave dist_checkpointing's writer process
    # behind, holding inherited pipes open (subprocess.run would wait for it forever).
    codes = []
    for i in range(2):
        with open(os.path.join(log, f"job{i}.out"), "w") as out:
            codes.append(jobs.run(cmd, env=e, stdout=out, stderr=subprocess.STDOUT, timeout=1200,
                                  cwd=log, log_dir=log).returncode)
    wall = time.time() - t0
    if codes[0] == 0 or codes[1] != 0:
        raise SystemExit(f"torchrun jobs: exit codes {codes} (want fault, then success); see {log}/job*.out")
    ev = rank_events(log)
    fault = min(x["time"] for x in ev if x["event"] == "inject")
    loads = [x for x in ev if x["event"] == "load"]
    loaded = loads[0]["iteration"] if loads else 0
    # Steps of the relaunch only: a first-launch rank may still log its step F-1 after the fault.
    relaunched = {x["pid"] for x in ev if x["event"] == "start" and x["time"] > fault}
    after = sorted((x for x in ev if x["event"] == "step" and x["pid"] in relaunched), key=lambda x: x["time"])
    regain = next(x for x in after if x["iteration"] == a.fault_step)
    return {"mttr_s": after[0]["time"] - fault, "regain_s": regain["time"] - fault,
            "lost_steps": a.fault_step - 1 - loaded, "loaded_iteration": loaded,
            "step_s": median_step([x for x in ev if x["event"] == "step" and x["time"] < fault]), "wall_s": wall,
            "processes": len({x["pid"] for x in ev if x["event"] == "start"})}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchft(a, work: str) -> dict | None:
    import shutil
    lighthouse = shutil.which("torchft_lighthouse")
    try:
        import torchft  # noqa: F401
    except ImportError:
        lighthouse = None
    if lighthouse is None:
        print("torchft not installed (pip install 'mindspeed-ha[peers]'): its baseline is skipped", flush=True)
        return None
    log = os.path.join(work, "torchft")
    os.makedirs(log)
    events = os.path.join(log, "events.jsonl")
    lport = _free_port()
    lh = jobs.popen([lighthouse, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "1000",
                           "--bind", f"127.0.0.1:{lport}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    args = [a2 for a2 in model_args(a) if a2 != "--use-distributed-optimizer"]
    script = os.path.join(HERE, "torchft_replica.py")

    def start(rid: int, restarted: bool) -> subprocess.Popen:
        e = env()
        e.update(FT_REPLICA_ID=str(rid), FT_REPLICAS=str(WORLD), FT_EVENTS=events,
                 FT_FAULT_STEP=str(a.fault_step - 1 if rid == 1 else -1),
                 FT_RESTARTED="1" if restarted else "0", TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{lport}",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        out = open(os.path.join(log, f"replica{rid}{'b' if restarted else ''}.out"), "w")
        return jobs.popen([sys.executable, script, *args], env=e, stdout=out, stderr=subprocess.STDOUT, cwd=log)
    t0 = time.time()
    try:
        procs = {r: start(r, False) for r in range(WORLD)}
        procs[1].wait(600)  # it kills itself after step F-1
        procs[1] = start(1, True)
        codes = {r: p.wait(600) for r, p in procs.items()}
    finally:
        for p in list(procs.values()) + [lh]:
            if p.poll() is None:
                p.kill()
    wall = time.time() - t0
    from mindspeed_ha.events import read_events
    ev = read_events(events)
    if any(codes.values()) or not any(x["event"] == "inject" for x in ev):
        raise SystemExit(f"torchft jobs: exit codes {codes}; see {log}/replica*.out")
    fault = next(x["time"] for x in ev if x["event"] == "inject")
    back = next(x for x in ev if x["event"] == "step" and x["replica"] == 1 and x["time"] > fault)
    steady = median_step([dict(x, iteration=x["step"]) for x in ev if x["event"] == "step" and x["time"] < fault])
    during = [x for x in ev if x["event"] == "step" and x["replica"] != 1 and fault < x["time"] <= back["time"]]
    stall = sum(max(0.0, x["step_s"] - steady) for x in during)
    missed = len({x["step"] for x in during})
    mttr = back["time"] - fault
    return {"mttr_s": mttr, "regain_s": mttr, "lost_steps": 0, "missed_steps": missed, "step_s": steady,
            "wasted_rank_s": mttr + stall, "wall_s": wall,
            "processes": len({x["pid"] for x in ev if x["event"] == "start"})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--interval", type=int, default=5, help="periodic checkpoint interval K")
    p.add_argument("--fault-step", type=int, default=10, help="F: the step the fault lands in")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--keep", default=None)
    p.add_argument("--no-torchft", action="store_true", help="skip the torchft baseline")
    p.add_argument("--ours-only", action="store_true", help="skip both baselines (retry, recover, rank 0's recover)")
    p.add_argument("--ours", default=",".join(OURS), help=f"which of ours to run (comma list of {', '.join(OURS)})")
    a = p.parse_args()
    work = a.keep or tempfile.mkdtemp(prefix="mttr_bench_")
    os.makedirs(work, exist_ok=True)
    unknown = set(a.ours.split(",")) - set(OURS)
    if unknown:
        raise SystemExit(f"--ours {a.ours}: {', '.join(sorted(unknown))} unknown; use {', '.join(OURS)}")
    ours = {name: run_ours(a, work, name) for name in OURS if name in a.ours.split(",")}
    base = None if a.ours_only else run_torchrun(a, work)
    peer = None if a.no_torchft or a.ours_only else run_torchft(a, work)
    out = {"fault_step": a.fault_step, "interval_k": a.interval, "world": WORLD}
    rows = (*ours.items(),) + ((("torchrun", base),) if base else ()) + ((("torchft", peer),) if peer else ())
    for name, r in rows:
        wasted = r.setdefault("wasted_rank_s", WORLD * r["regain_s"])
        r["wasted_rank_s"] = wasted
        r["ettr_at_meta_mttf"] = MTTF_S / (MTTF_S + r["regain_s"])
        print(f"{name:9s} MTTR {r['mttr_s']:7.3f} s | back at step {a.fault_step} after {r['regain_s']:7.3f} s | "
              f"lost steps {r['lost_steps']} | wasted {wasted:7.2f} rank-s | steady step {r['step_s'] * 1000:6.1f} ms | "
              f"{r['processes']} processes | ETTR at 7.9 h MTTF {r['ettr_at_meta_mttf']:.6f}", flush=True)
        for k in ("mttr_s", "regain_s", "lost_steps", "wasted_rank_s", "step_s", "ettr_at_meta_mttf", "processes"):
            out[f"{name}_{k}"] = round(r[k], 6) if isinstance(r[k], float) else r[k]
    if peer:
        out["torchft_missed_steps"] = peer["missed_steps"]
    if "recover_rank0" in ours and "recover" in ours:
        rank0 = ours["recover_rank0"]
        out["recover_rank0_takeover_s"] = round(rank0.get("takeover_s", float("nan")), 4)
        out["recover_rank0_vs_recover_mttr_ratio"] = round(rank0["mttr_s"] / ours["recover"]["mttr_s"], 2)
        print(f"the controller's own rank lost: a standby took over {out['recover_rank0_takeover_s']:.3f} s after the "
              f"kill; its MTTR is {out['recover_rank0_vs_recover_mttr_ratio']}x rank 1's", flush=True)
    for name, r in ours.items():  # torchrun_* (retry) keep their names; the others are prefixed
        out[f"{name}_phases"] = r["phases"]
        for bname, b in (("torchrun", base), ("torchft", peer)):
            if b is None:
                continue
            pre = bname if name == "retry" else f"{bname}_vs_{name}"
            out[f"{pre}_mttr_ratio"] = round(b["mttr_s"] / r["mttr_s"], 2)
            out[f"{pre}_regain_ratio"] = round(b["regain_s"] / r["regain_s"], 2)
            out[f"{pre}_wasted_rank_s_ratio"] = round(b["wasted_rank_s"] / r["wasted_rank_s"], 2)
            out[f"{pre}_step_time_ratio"] = round(b["step_s"] / r["step_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
