"""MTTR at 1,024, 16,384 and 131,072 GPUs, projected from measured parts: arithmetic, marked as such.

What a recovery costs on a cluster is the sum of its parts, each of which grows with something else:

- **the control plane's rounds** (stop, status, rebuild, repair, rollback, resume through the
  controller): measured here by ``controller_scale.py --recovery --relay`` at each size (its MTTR less
  the first step, which the simulated ranks end at once), through node agents of 8 ranks as
  ``mindspeed-ha run`` does by default (``--no-relay``: every rank directly); at 131,072 ranks with a
  10 s heartbeat (at 2 s the simulators' 65,536 heartbeats a second alone fill this 2-core machine); a
  size not measured is extrapolated linearly per rank from the largest one measured, and marked so;
- **the communicators the fault remakes**: which groups, of what size, each rank remakes for each
  strategy, counted for the layouts of docs/scale.md from megatron-core's own rank generator and the
  rules the 8-rank drills measured (docs/concepts.md, "Which communicators a recovery remakes"); a rank
  makes its groups one after another, so its rebuild is the sum of their set-up times, and the
  recovery waits for its slowest rank;
- **NCCL's set-up of one communicator**, a parameter with its sources: 2.5 s for 8 ranks (the
  non-kernel parts of ``ncclCommInitRankConfig`` on a DGX B200, NVIDIA/nccl#1646: alloc 0.41,
  bootstrap 0.57, allgathers 0.08, topo 1.10, connections 0.39; its 52 s of kernel loading is a
  process's first communicator's only) and 150 s at a few thousand GPUs (NVIDIA/nccl#1156, "2.5-minute
  init time at large scale (e.g. above certain K GPUs)", the default init path, taken at 4,096 ranks),
  linear between the two and held at 150 s above 4,096 ranks, where the figure is a floor (marked
  ">="): an assumption, not a measurement — the robust part is which communicators, of what size, a
  fault remakes;
- **the per-rank phases**: the repair moves one shard from its twin (10.5 GB at 7B, 26 GB at 70B: docs/
  scale.md; the 16k layout's 26 GB too) at a link's bandwidth (50 GB/s: one 400 Gb/s NIC a GPU, as on
  a DGX H100), and the step is recomputed (``--step-s``, a parameter: a step's time is the job's).

The anchors' figures are printed beside (DESIGN.md: TrainMover ~20 s at 1,024 GPUs, DeadPool < 40 s at
512, FlashRecovery 150 s at 4,800, HyperPod < 2 min at thousands, MindCluster <= 30 s at 10k cards).
ETTR at 16,384 GPUs with a failure every 30 minutes: 1 - MTTR / 1,800 s (no step lost: the strategies
here recompute only the failed step, counted in the MTTR).

    python benchmarks/projection.py [--control-json FILE] [--measure 1024,16384] [--step-s 10]
Last line: JSON (each size's and strategy's parts and total, and the inputs).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = (1024, 16384, 131072)
# docs/scale.md's layouts, and the 16k-GPU one of the issue (TP=8, PP=8, DP=256): (tp, pp, dp) for a
# world of ``n`` ranks: the model-parallel part fixed, the data-parallel size what the world leaves.
LAYOUTS = {"7B TP=1": (1, 1), "70B TP=8 PP=2": (8, 2), "16k TP=8 PP=8": (8, 8)}
SHARD_GB = {"7B TP=1": 10.5, "70B TP=8 PP=2": 26.0, "16k TP=8 PP=8": 26.0}
INIT_8_S, INIT_K_S, INIT_K_N = 2.5, 150.0, 4096
LINK_GB_S = 50.0
ANCHORS = {"TrainMover (1,024 GPUs)": "~20 s", "DeadPool (512 GPUs)": "< 40 s", "FlashRecovery (4,800 GPUs)": "150 s",
           "HyperPod (thousands)": "< 2 min", "MindCluster (10k cards)": "<= 30 s"}


def init_s(n: int) -> float:
    """One NCCL communicator's set-up for ``n`` ranks: linear between the two cited points (8 ranks,
    4,096 ranks), and held at the second above it (a floor there: ``above_cited``); a 1-rank group
    costs nothing (none is set up)."""
    if n <= 1:
        return 0.0
    n = min(max(n, 8), INIT_K_N)
    return INIT_8_S + (INIT_K_S - INIT_8_S) * (n - 8) / (INIT_K_N - 8)


def above_cited(sizes) -> bool:
    """A communicator larger than the cited sizes is among them: its time is a floor, so is the sum."""
    return any(n > INIT_K_N for n in sizes)


def groups_of_a_rank(n: int, tp: int, pp: int, rank: int) -> dict[str, list[int]]:
    """The groups ``rank`` of a ``tp`` x ``pp`` x dp layout of ``n`` ranks is in, by megatron-core's
    name, with their members: its rank generator's (tp, pp, dp, cp and their products, read from
    ``RankGenerator``), the world, the pipeline's embedding group (first and last stage), and the
    replica optimizer's two (its data-parallel group split into two instances, and the pairs across)."""
    from megatron.core.parallel_state import RankGenerator
    dp = n // (tp * pp)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    groups = {"world": list(range(n))}
    for token in ("tp", "pp", "dp", "tp-pp", "tp-dp", "dp-cp", "tp-dp-cp"):
        groups[token] = next(g for g in gen.get_ranks(token) if rank in g)
    if pp > 1 and rank in (groups["pp"][0], groups["pp"][-1]):
        groups["embedding"] = [groups["pp"][0], groups["pp"][-1]]
    data = groups["dp"]
    half = len(data) // 2 if len(data) > 1 else 1
    mine = data.index(rank)
    groups["dp-instance"] = data[:half] if mine < half else data[half:]
    twin = data[(mine + half) % len(data)] if len(data) > 1 else rank
    groups["dp-across-instances"] = sorted({rank, twin})
    return {k: v for k, v in groups.items() if len(v) > 1}


def statuses_for(groups: dict[str, list[int]], faulted: int, scenario: str) -> dict[int, dict]:
    """What every member of the faulted rank's groups says of them in its status (``comm.ledger``), for
    a memory error of ``faulted`` in its forward or in its gradients' reduce-scatter, on NCCL (the stop
    aborted the groups whose collective the faulted rank never entered: their other members one
    collective ahead), as the 8-rank drills measured it. Other groups of the job are idle and equal:
    the policy keeps them, so they are left out (they could only be kept)."""
    stuck = {"forward": ("tp", "pp"), "grad-sync": ("dp-instance", "dp-across-instances")}.get(scenario, ())
    out: dict[int, dict] = {}
    for key, members in groups.items():
        for r in members:
            ahead = key in stuck and r != faulted
            comm = out.setdefault(r, {"replica": True, "comm": {"keys": [], "ops": [], "odd": {}, "members": {}}})["comm"]
            comm["keys"].append(key)
            comm["ops"].append(11 if ahead else 10)
            if ahead:
                comm["odd"][key] = ["aborted", {}, {}]
            if r == members[0]:
                comm["members"][key] = members
    return out


def remade(strategy: str, groups: dict[str, list[int]], faulted: int) -> dict[str, int]:
    """The groups the faulted rank's recovery remakes, with their sizes: the controller's own policy
    (``control.policy.communicators.to_remake``) on the statuses above for retry and recover; before:
    every group; an elastic scale-in: the world and every group the data-parallel size is part of (their
    members change; a resize keeps only groups whose members all stay)."""
    from mindspeed_ha.control.policy.communicators import to_remake
    if strategy == "before":
        chosen = set(groups)
    elif strategy == "elastic scale-in":
        chosen = {k for k in groups if k in ("world", "dp", "tp-dp", "dp-cp", "tp-dp-cp", "dp-instance",
                                            "dp-across-instances")}
    else:
        scenario = strategy.split("(")[-1].rstrip(")") if "(" in strategy else ""
        fresh = [faulted] if strategy == "recover" else []
        chosen = to_remake(statuses_for(groups, faulted, scenario), fresh)
        chosen = set(groups) if chosen is None else set(chosen)
    return {k: len(groups[k]) for k in groups if k in chosen}


LARGE = 65536          # from this many ranks the simulation heartbeats every
LARGE_HEARTBEAT_S = 10.0   # (a real job of that size would not beat every 2 s either: 65,536 a second)


def measure_control(sizes: list[int], relay: bool = True) -> dict[int, dict]:
    """controller_scale.py --recovery at each size: its MTTR less the first step, and its slowest round."""
    out = {}
    for n in sizes:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "controller_scale.py"), "--ranks", str(n),
                               "--recovery", *(["--relay"] if relay else []),
                               *(["--heartbeat", str(LARGE_HEARTBEAT_S)] if n >= LARGE else [])],
                              capture_output=True, text=True)
        last = json.loads(proc.stdout.strip().splitlines()[-1])
        phases = last.get("recovery_phases") or {}
        out[n] = {"rounds_s": round(sum(v for k, v in phases.items() if k != "first_step"), 3),
                  "slowest_round": last.get("recovery_round"), "slowest_round_s": last.get("recovery_round_s"),
                  "ok": last.get("recovery_ok"), "measured": True, "relay": relay,
                  "heartbeat_s": last.get("heartbeat_s")}
    return out


def control_at(n: int, measured: dict[int, dict]) -> tuple[float, str]:
    if n in measured:
        return measured[n]["rounds_s"], "measured"
    top = max(measured)
    return measured[top]["rounds_s"] * n / top, f"extrapolated from {top} linearly per rank"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--control-json", help="controller_scale figures to use: {ranks: {rounds_s, ...}} (else measured)")
    p.add_argument("--measure", default="1024,16384,131072",
                   help="sizes controller_scale.py runs at (with --recovery)")
    p.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True,
                   help="the rounds through node agents of 8 ranks (mindspeed-ha run's default); --no-relay: direct")
    p.add_argument("--step-s", type=float, default=10.0, help="one training step, recomputed by every strategy")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="the GPU counts projected")
    a = p.parse_args()
    if a.control_json:
        with open(a.control_json) as f:
            measured = {int(k): v for k, v in json.load(f).items()}
    else:
        measured = measure_control([int(x) for x in a.measure.split(",")], a.relay)
    rows = []
    for layout, (tp, pp) in LAYOUTS.items():
        for n in [int(x) for x in a.sizes.split(",")]:
            faulted = n // 2 + 1  # (a rank inside the job: every kind of group it is in has peers)
            groups = groups_of_a_rank(n, tp, pp, faulted)
            control_s, how = control_at(n, measured)
            repair_s = SHARD_GB[layout] / LINK_GB_S
            for strategy in ("before", "retry (forward)", "retry (grad-sync)", "recover", "elastic scale-in"):
                made = remade(strategy, groups, faulted)
                rebuild_s = sum(init_s(size) for size in made.values())
                total = control_s + rebuild_s + repair_s + a.step_s  # (a scale-in moves a new shard's worth)
                rows.append({"layout": layout, "gpus": n, "strategy": strategy, "floor": above_cited(made.values()),
                             "remade": {k: v for k, v in made.items()}, "rebuild_s": round(rebuild_s, 1),
                             "control_s": round(control_s, 2), "control": how, "repair_s": round(repair_s, 2),
                             "step_s": a.step_s, "mttr_s": round(total, 1)})
    print(f"{'layout':16} {'GPUs':>7} {'strategy':18} {'communicators remade (sizes)':42} {'rebuild':>8} "
          f"{'control':>8} {'repair':>7} {'MTTR':>7}")
    for r in rows:
        sizes = ",".join(str(v) for v in sorted(r["remade"].values(), reverse=True))
        print(f"{r['layout']:16} {r['gpus']:>7} {r['strategy']:18} {len(r['remade']):>2} ({sizes[:36]:36}) "
              f"{'>=' if r['floor'] else '  '}{r['rebuild_s']:>6.1f}s {r['control_s']:>7.2f}s {r['repair_s']:>6.2f}s "
              f"{'>=' if r['floor'] else '  '}{r['mttr_s']:>6.1f}s")
    ettr = {r["strategy"]: round(max(0.0, 1 - r["mttr_s"] / 1800), 4) for r in rows
            if r["gpus"] == 16384 and r["layout"] == "16k TP=8 PP=8"}
    print("ETTR at 16,384 GPUs (16k TP=8 PP=8), a failure every 30 minutes (at most, where the MTTR is a floor):",
          ", ".join(f"{k} {v:.1%}" for k, v in ettr.items()))
    print("anchors:", "; ".join(f"{k} {v}" for k, v in ANCHORS.items()))
    print(json.dumps({"rows": rows, "ettr_16k": ettr, "control": measured,
                      "inputs": {"init_8_s": INIT_8_S, "init_k_s": INIT_K_S, "init_k_n": INIT_K_N,
                                 "link_gb_s": LINK_GB_S, "step_s": a.step_s, "shard_gb": SHARD_GB},
                      "arithmetic": True}))


if __name__ == "__main__":
    main()
