"""torch 2.15's own regrouping (``ProcessGroup.reconfigure``, experimental) against the engine's
hand-written rebuild, side by side, on the process groups of the DP=4 drills, on gloo (CPU).

    python benchmarks/reconfigure.py [--ranks 4] [--rounds 3]      # torch >= 2.15

Why: a recovery's ``rebuild`` phase gives every process group of the job new communicators
(``comm/groups.py``: a new ``ProcessGroupGloo``/``ProcessGroupNCCL`` over a fresh key space of the
controller's store, made by ``compat.make_communicator``). torch 2.15 can give a group made with
``enable_reconfigure=True`` a new set of peers in place instead (``get_reconfigure_handle`` on every
peer, an out-of-band exchange, ``reconfigure(uuid, handles)``). Before adopting it, this measures
both on the same groups and checks that both give right sums.

The groups: those of the tiny DP=4 drills (21 a rank: 6 of 4 ranks — the world, data-parallel with
and without context parallelism, expert data-parallel, tensor-and-data-parallel, model-parallel —,
2 of 2 ranks — the optimizer instance and the pair across instances —, and 13 of one rank — tensor,
pipeline, context, expert, embedding, position-embedding ... parallel), connected in that order, as
``groups.reconnect`` does.

Two drills, each ``--rounds`` times (medians):
- ``retry``: the same processes, every group reconnected (a retry's rebuild);
- ``recover``: rank 1's process ends, a new one (torch imported, not timed) takes rank 1, and every
  group is reconnected with it (a recover's rebuild).
Timed on every rank from the rebuild's start to a verified all-reduce on every group; the slowest
rank's time is the drill's. Last line: one JSON object; exit 0 when every sum was right, 1 otherwise,
77 on a torch without ``reconfigure``.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import jobs  # noqa: E402  (how every benchmark starts a job)
NO_RECONFIGURE = 77
REPLACED = 1  # the rank the recover drill replaces
TIMEOUT = datetime.timedelta(seconds=60)


def layout(world: int) -> list[tuple[str, list[int]]]:
    """(name, this group's ranks) for every group a rank of the DP=``world`` drill is in, in order,
    as a function of the rank (so every rank lists the same groups in the same order)."""
    half = world // 2
    def groups(rank: int) -> list[tuple[str, list[int]]]:
        whole = list(range(world))
        instance = [r for r in whole if r // half == rank // half]        # the optimizer instance
        across = [r for r in whole if r % half == rank % half]            # the twins
        out = [(f"dp{n}", whole) for n in ("world", "dp", "dp_cp", "expert_dp", "tp_dp", "mp")]
        out += [("instance", instance), ("across", across)]
        out += [(f"one{n}", [rank]) for n in range(13)]
        return out
    return groups  # type: ignore[return-value]


# ---- one rank ---------------------------------------------------------------------------------
def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from mindspeed_ha import compat

    store = dist.TCPStore("127.0.0.1", a.port, is_master=False, timeout=TIMEOUT)
    mine = layout(a.world)(a.rank)
    out: dict = {"rank": a.rank, "handwritten": [], "reconfigure": [], "wrong": []}

    def check(name, pg, ranks) -> None:
        x = torch.full((4,), float(a.rank + 1))
        pg.allreduce([x]).wait()
        if x[0].item() != sum(r + 1 for r in ranks):
            out["wrong"].append(name)

    def meet(key: str, ranks: list[int], value: str = "1") -> list[str]:
        store.set(f"{key}/{a.rank}", value)
        keys = [f"{key}/{r}" for r in ranks]
        store.wait(keys)
        return [store.get(k).decode() for k in keys]

    # torch's reconfigurable groups: made once, never connected until reconfigured
    reconfigurable = {name: dist.ProcessGroupGloo(dist.PrefixStore(f"rc-made/{name}/", store), ranks.index(a.rank),
                                                  len(ranks), TIMEOUT, enable_reconfigure=True)
                      for name, ranks in mine}

    def handwritten(gen: str) -> float:
        t0 = time.perf_counter()
        for name, ranks in mine:
            key = f"hw/{gen}/{name}/{ranks}"
            meet(key + "/here", ranks)  # (groups._await_members: every member has come)
            pg = compat.make_communicator(dist.PrefixStore(key + "/", store), ranks.index(a.rank), len(ranks),
                                          "gloo", TIMEOUT)
            check(name, pg, ranks)
        return time.perf_counter() - t0

    def reconfigure(gen: str) -> float:
        t0 = time.perf_counter()
        for name, ranks in mine:
            pg = reconfigurable[name]
            handles = meet(f"rc/{gen}/{name}/{ranks}", ranks, pg.get_reconfigure_handle())
            opts = torch._C._distributed_c10d.ReconfigureOptions()
            # (a fresh uuid per group and generation, the same on its members: they meet under it in
            # the one store every group's handle names, so two groups of one name must not share it)
            uid = int(hashlib.sha1(f"{gen}/{name}/{ranks}".encode()).hexdigest()[:12], 16)
            opts.uuid, opts.handles, opts.timeout = uid, handles, TIMEOUT
            pg.reconfigure(opts).wait()
            check(name, pg, ranks)
        return time.perf_counter() - t0

    # the first connection of every group (the job's set-up: not a new rank 1's), then the rounds
    if not a.joined:
        handwritten("setup")
        reconfigure("setup")
    drill = a.drill
    for n in range(a.rounds):
        if drill == "recover" and n == 0 and a.rank == REPLACED and not a.joined:
            out["replaced"] = True
            _write(a, out)
            os._exit(0)  # (this process is lost; a new one, started and imported, takes rank 1: see run)
        meet(f"round/{drill}/{n}", list(range(a.world)))  # (the rebuild starts with every process there)
        out["handwritten"].append(handwritten(f"{drill}{n}"))
        out["reconfigure"].append(reconfigure(f"{drill}{n}"))
    _write(a, out)
    meet(f"end/{drill}", list(range(a.world)))
    os._exit(0)


def _write(a, out: dict) -> None:
    with open(os.path.join(a.out, f"{a.drill}_{a.rank}{'_new' if a.joined else ''}.json"), "w") as f:
        json.dump(out, f)


# ---- the drills -------------------------------------------------------------------------------
def run(drill: str, world: int, rounds: int, out: str) -> dict:
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")

    def start(rank: int, joined: bool = False) -> subprocess.Popen:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(rank), "--world", str(world),
               "--port", str(store.port), "--out", out, "--drill", drill, "--rounds", str(rounds)]
        return jobs.popen(cmd + (["--joined"] if joined else []), env=env)

    procs = [start(r) for r in range(world)]
    if drill == "recover":
        # (rank 1 ends at the first round; a new process for it goes through the set-up under the
        # same keys, then joins every round: one replacement for all rounds, as the timing wants)
        procs[REPLACED].wait(120)
        procs.append(start(REPLACED, joined=True))
    codes = [p.wait(300) for p in procs]
    results = []
    for r in range(world):
        path = os.path.join(out, f"{drill}_{r}{'_new' if drill == 'recover' and r == REPLACED else ''}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else {"rank": r, "missing": True})
    wrong = sorted({w for res in results for w in res.get("wrong", [])})
    per = {how: [max(res[how][n] for res in results) for n in range(rounds)]
           for how in ("handwritten", "reconfigure") if all(how in res for res in results)}
    med = {how: statistics.median(v) for how, v in per.items()}
    return {"ok": not wrong and all(c == 0 for c in codes) and len(med) == 2, "wrong": wrong, "codes": codes,
            "handwritten_s": round(med.get("handwritten", float("nan")), 4),
            "reconfigure_s": round(med.get("reconfigure", float("nan")), 4),
            "ratio": round(med["reconfigure"] / med["handwritten"], 3) if len(med) == 2 else None,
            "rounds": {how: [round(x, 4) for x in v] for how, v in per.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="processes (an even number, at least 4; default 4)")
    p.add_argument("--rounds", type=int, default=3, help="rebuilds per drill, the median reported (default 3)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--drill", help=argparse.SUPPRESS)
    p.add_argument("--joined", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        a.rank = a.worker
        worker(a)
        return 0
    import tempfile

    import torch
    import torch.distributed as dist
    if not hasattr(dist.ProcessGroupGloo, "get_reconfigure_handle"):
        print(json.dumps({"ok": False, "torch": torch.__version__,
                          "missing": "ProcessGroup.reconfigure needs torch >= 2.15 (experimental there)"}))
        return NO_RECONFIGURE
    if a.ranks < 4 or a.ranks % 2:
        p.error("--ranks must be even and at least 4 (two optimizer instances)")
    out = tempfile.mkdtemp(prefix="reconfigure_")
    results = {drill: run(drill, a.ranks, a.rounds, out) for drill in ("retry", "recover")}
    for drill, r in results.items():
        print(f"{drill}: hand-written rebuild {r['handwritten_s']} s, torch's reconfigure {r['reconfigure_s']} s "
              f"(ratio {r['ratio']}); sums right: {not r['wrong']}", flush=True)
    ok = all(r["ok"] for r in results.values())
    print(json.dumps({"ok": ok, "torch": torch.__version__, "ranks": a.ranks, "groups_per_rank": len(layout(a.ranks)(0)),
                      **results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
