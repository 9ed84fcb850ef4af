"""What HA costs in steady state: step time, optimizer-state memory, gradient traffic.

Runs the same GPT twice per repeat, interleaved (plain, replica, plain, replica, ...), each as a
torchrun job on 127.0.0.1: "plain" is megatron-core's distributed optimizer with HA off (no HA
flags, none of our collective wrappers); "replica" turns the whole HA runtime on with
--enable-high-availability --enable-hbmfault-repair: two optimizer instances (every shard has a
twin), the processor thread and its heartbeats, the controller thread on rank 0, the step-phase
hooks and progress board, interruptible collectives and stable process groups. Every rank of both
runs is ``replica_overhead_worker.py``: the built-in trainer plus counters.

Shapes: ``--shape tiny`` (default; 2 layers, hidden 64: communication and the optimizer dominate, the
worst case for the replica's second Adam pass) and ``--shape compute`` (4 layers, hidden 256, seq 256:
forward and backward dominate, as on real jobs). ``ha_runtime_ratio`` = HA-on / HA-off step time.

- Step time: per run, the median of the per-step ``step_s`` in rank 0's events (warm-up steps
  skipped); the ratio is the median over the interleaved pairs of replica/plain, so that a slow
  phase of a shared machine hits both members of a pair (the pooled ratio is printed too).
  A job's start (imports, model build) is most of its wall time, so steps per job are cheap.
  On a shared machine wall time is noisy (other tenants take the cores), so the CPU seconds per
  step summed over the ranks are compared too (``cpu_time_ratio``).
- Memory: bytes per parameter per rank measured from the live DDP buffers and optimizer (distinct
  storages), against 4+16/d (distributed) and 4+32/d (replica), d = DP size: bf16 params (2) +
  bf16 grads (2) + a 1/d (resp. 2/d) shard of fp32 main params, fp32 main grads, exp_avg, exp_avg_sq.
  The formula assumes bf16 grads, so the runs pass --grad-reduce-in-bf16 (Megatron-LM's flag;
  with --bf16 Megatron-LM and the built-in trainer otherwise keep fp32 grad buffers: 6+12/d).
- Gradient traffic per step, per rank: bytes handed to the collectives inside finalize_model_grads
  (counted by wrapping torch.distributed), and the ring-algorithm bytes each rank sends
  (reduce-scatter/all-gather over n: (n-1)/n of the message; all-reduce: 2(n-1)/n). MindSpeed's scheme
  (all-reduce of the whole grad buffer over the full DP group) is computed from the live buckets.

Last line: one JSON object (step_time_ratio, bytes_per_param_*, formula_*, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "replica_overhead_worker.py")
HA_FLAGS = ["--enable-high-availability", "--enable-hbmfault-repair"]
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import jobs  # noqa: E402  (how every benchmark starts a job)


SHAPES = {"tiny": dict(layers=2, hidden=64, heads=4, seq=32, mbs=2),
          "compute": dict(layers=4, hidden=256, heads=8, seq=256, mbs=4)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_args(a) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(a.seq), "--micro-batch-size", str(a.mbs), "--vocab-size", str(a.vocab),
            "--global-batch-size", str(a.mbs * a.nproc * a.micro_batches),
            "--train-iters", str(a.iters), "--lr-warmup-iters", "0", "--log-interval", str(10 ** 6),
            "--use-distributed-optimizer", "--mock-data", "--bench-warmup", str(a.warmup)] + \
           (["--bf16"] + ([] if a.fp32_grads else ["--grad-reduce-in-bf16"]) if not a.fp32 else [])


def run_once(a, replica: bool, log_dir: str) -> dict:
    from mindspeed_ha.events import read_events

    env = dict(os.environ)
    for k in ("HIGH_AVAILABILITY", "MS_ENABLE_TFT", "MINDSPEED_HA_INJECT", "MINDSPEED_HA_LOG_DIR"):
        env.pop(k, None)  # the env would override the flags that make the two variants differ
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")  # per-rank megatron-core CPU warnings would bury errors
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(a.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), WORKER,
           *model_args(a), "--ha-log-dir", log_dir] + (HA_FLAGS if replica else [])
    t0 = time.perf_counter()
    p = jobs.run(cmd, env=env, cwd=log_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                 log_dir=log_dir,
                       timeout=a.timeout)
    if p.returncode:
        sys.stderr.write(p.stdout[-6000:])
        raise SystemExit(f"{'replica' if replica else 'plain'} run failed (rc {p.returncode}): {' '.join(cmd)}")
    ranks = []
    for r in range(a.nproc):
        ev = read_events(os.path.join(log_dir, "events", f"rank_{r}.jsonl"))
        bench = [e for e in ev if e["event"] == "bench"]
        if not bench:
            raise SystemExit(f"rank {r} wrote no bench event in {log_dir}")
        ranks.append(bench[-1])
    steps = [e for e in read_events(os.path.join(log_dir, "events", "rank_0.jsonl")) if e["event"] == "step"]
    # CPU seconds per step summed over the ranks: the job's compute+communication cost of a step
    cpu = [sum(x) for x in zip(*(rb["cpu_s"] for rb in ranks))]
    return {"step_s": [e["step_s"] for e in steps if e["iteration"] > a.warmup], "cpu_s": cpu,
            "loss_hex": [e["loss_hex"] for e in steps], "ranks": ranks, "wall_s": time.perf_counter() - t0}


def wire(op: str, n: int, nbytes: float) -> float:
    """Bytes one rank sends for a ring collective over n ranks whose message is nbytes."""
    return nbytes * (2 if op == "all_reduce" else 1) * (n - 1) / n


def comm_summary(rank_bench: dict) -> dict:
    """Per-step bytes of rank 0; gradient and parameter traffic checked constant over the steps
    (other collectives, e.g. a periodic replica check, may come and go)."""
    steps = rank_bench["comm"]
    if not steps:
        raise SystemExit("no communication was recorded after warm-up: raise --iters")
    first = steps[0]

    def sync(step):
        return [c for c in step if c["phase"] == "grad" or (c["phase"] == "optimizer" and "all_gather" in c["op"])]
    if any(sync(s) != sync(first) for s in steps):
        raise SystemExit(f"gradient/parameter communication differs between steps: {steps}")
    out = {"grad_msg_bytes": 0, "grad_wire_bytes": 0.0, "param_gather_msg_bytes": 0, "param_gather_wire_bytes": 0.0,
           "other_msg_bytes": 0, "grad_ops": []}
    for c in first:
        if c["phase"] == "grad":
            out["grad_msg_bytes"] += c["bytes"]
            out["grad_wire_bytes"] += wire(c["op"], c["group_size"], c["bytes"])
            out["grad_ops"].append(f"{c['op']}/{c['group_size']}:{c['bytes']}")
        elif c["phase"] == "optimizer" and "all_gather" in c["op"]:
            out["param_gather_msg_bytes"] += c["bytes"]
            out["param_gather_wire_bytes"] += wire(c["op"], c["group_size"], c["bytes"])
        else:
            out["other_msg_bytes"] += c["bytes"]
    return out


def expected_grad_comm(buckets: list[dict], scheme: str) -> tuple[int, float]:
    """(message bytes, wire bytes) per step from the live buckets for a scheme."""
    msg = wire_b = 0
    for b in buckets:
        d, inst, s = b["dp_size"], b["instance_size"], b["bytes"]
        if scheme == "mindspeed":  # all-reduce of the whole buffer over the full DP group
            msg, wire_b = msg + s, wire_b + wire("all_reduce", d, s)
        else:  # reduce-scatter in the instance, then all-reduce of the shard across instances
            msg, wire_b = msg + s, wire_b + wire("reduce_scatter_tensor", inst, s)
            if d // inst > 1:
                msg, wire_b = msg + s // inst, wire_b + wire("all_reduce", d // inst, s // inst)
    return msg, wire_b


def memory_summary(ranks: list[dict]) -> dict:
    per_rank = []
    for rb in ranks:
        m = rb["memory"]
        per_rank.append({"bytes_per_param": sum(m["bytes"].values()) / m["numel"],
                         "by_kind": {k: v / m["numel"] for k, v in sorted(m["bytes"].items())},
                         "numel": m["numel"], "padding": m["numel_buffers"] - m["numel"],
                         "step_scalar_bytes": m["step_scalar_bytes"],
                         "grad_dtype": sorted({b["grad_dtype"] for b in m["buffers"]}),
                         "param_dtype": sorted({b["param_dtype"] for b in m["buffers"]})})
    worst = max(per_rank, key=lambda x: x["bytes_per_param"])
    return {**worst, "min_bytes_per_param": min(x["bytes_per_param"] for x in per_rank)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks (= DP size d; the replica run needs d even)")
    p.add_argument("--iters", type=int, default=80)
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of timing and comm counts")
    p.add_argument("--repeats", type=int, default=3, help="plain/replica pairs, interleaved")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                   help="model preset (the flags below override it)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--mbs", type=int, default=None)
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches per rank per step (gradient accumulation, as real jobs have: the "
                        "gradient sync and the optimizer are paid once per step)")
    p.add_argument("--vocab", type=int, default=127, help="NullTokenizer vocab; padded to 128 x TP")
    p.add_argument("--fp32", action="store_true", help="fp32 params (the bf16 formulas do not apply)")
    p.add_argument("--fp32-grads", action="store_true",
                   help="bf16 params with fp32 grad buffers (the trainer's default; formula 6+12/d)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per torchrun job")
    p.add_argument("--keep", default=None, help="keep the runs' logs in this directory")
    a = p.parse_args(argv)
    for k, v in SHAPES[a.shape].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.warmup = min(a.warmup, max(a.iters - 2, 0))

    base = a.keep or tempfile.mkdtemp(prefix="replica_overhead_")
    os.makedirs(base, exist_ok=True)
    runs = {"plain": [], "replica": []}
    t0 = time.perf_counter()
    try:
        for i in range(a.repeats):
            for name in ("plain", "replica"):  # interleaved: A B A B ...
                d = os.path.join(base, f"{i}_{name}")
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
                r = run_once(a, name == "replica", d)
                runs[name].append(r)
                print(f"run {i} {name:7s}: median step {1000 * statistics.median(r['step_s']):.2f} ms over "
                      f"{len(r['step_s'])} steps, job {r['wall_s']:.1f} s", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)

    d = runs["plain"][-1]["ranks"][0]["dp_size"]
    med = {k: statistics.median([s for r in v for s in r["step_s"]]) for k, v in runs.items()}
    pair_ratios = [statistics.median(r["step_s"]) / statistics.median(pl["step_s"])
                   for pl, r in zip(runs["plain"], runs["replica"])]
    cpu_ratios = [statistics.median(r["cpu_s"]) / statistics.median(pl["cpu_s"])
                  for pl, r in zip(runs["plain"], runs["replica"])]
    mem = {k: memory_summary(v[-1]["ranks"]) for k, v in runs.items()}
    comm = {k: comm_summary(v[-1]["ranks"][0]) for k, v in runs.items()}
    buckets = {k: v[-1]["ranks"][0]["buckets"] for k, v in runs.items()}
    exp = {"plain": expected_grad_comm(buckets["plain"], "distributed"),
           "replica": expected_grad_comm(buckets["replica"], "replica"),
           "mindspeed": expected_grad_comm(buckets["plain"], "mindspeed")}
    if a.fp32:
        f_dist, f_rep, assumes = 8 + 8 / d, 8 + 16 / d, "fp32 params and grads: 8+8/d, 8+16/d"
    elif a.fp32_grads:
        f_dist, f_rep, assumes = 6 + 12 / d, 6 + 24 / d, "bf16 params, fp32 grads: 6+12/d, 6+24/d"
    else:
        f_dist, f_rep, assumes = 4 + 16 / d, 4 + 32 / d, "bf16 params, bf16 grads: 4+16/d, 4+32/d"

    print(f"\nconfig: shape {a.shape}, {a.nproc} ranks (DP d={d}), {a.layers} layers, hidden {a.hidden}, seq {a.seq}, "
          f"mbs {a.mbs} x {a.micro_batches} micro-batch(es), {a.iters} iters ({a.warmup} warm-up), {a.repeats} interleaved pairs; {assumes}")
    print(f"step time: plain {1000 * med['plain']:.2f} ms, replica {1000 * med['replica']:.2f} ms, "
          f"ratio {statistics.median(pair_ratios):.4f} (median of pairs: {', '.join(f'{x:.3f}' for x in pair_ratios)}; "
          f"pooled {med['replica'] / med['plain']:.4f})")
    for k in ("plain", "replica"):
        ph = runs[k][-1]["ranks"][0]["phases"]
        print(f"rank 0 {k:7s} per step (last run, median): " + ", ".join(
            f"{n} {1000 * ph.get(f'{n}_wall', 0):.2f} ms wall / {1000 * ph.get(f'{n}_cpu', 0):.2f} ms cpu"
            for n in ("grad", "optimizer")))
    print(f"CPU time per step (all ranks): ratio {statistics.median(cpu_ratios):.4f} "
          f"(pairs: {', '.join(f'{x:.3f}' for x in cpu_ratios)}); less sensitive to other load than wall time")
    for k, label, f in (("plain", "distributed", f_dist), ("replica", "replica", f_rep)):
        m = mem[k]
        kinds = ", ".join(f"{n} {v:g}" for n, v in m["by_kind"].items())
        print(f"memory {label:11s}: {m['bytes_per_param']:.6g} B/param/rank (formula {f:.6g}) = {kinds}; "
              f"{m['numel']} params, padding {m['padding']}, grads {m['grad_dtype']}, "
              f"+{m['step_scalar_bytes']} B of Adam step scalars")
    for k, label in (("plain", "distributed"), ("replica", "replica")):
        c, (emsg, ewire) = comm[k], exp[k]
        print(f"grad comm {label:11s}: {c['grad_msg_bytes']} B handed to collectives ({'; '.join(c['grad_ops'])}), "
              f"{c['grad_wire_bytes']:.0f} B sent per rank (ring); from buckets: {emsg} B / {ewire:.0f} B; "
              f"param all-gather {c['param_gather_wire_bytes']:.0f} B sent per rank")
    print(f"grad comm mindspeed  : {exp['mindspeed'][0]} B all-reduced over DP={d}, "
          f"{exp['mindspeed'][1]:.0f} B sent per rank (ring), from the live buckets")
    print(f"total {time.perf_counter() - t0:.1f} s")

    result = {
        "shape": a.shape, "micro_batches": a.micro_batches,
        "ha_runtime_ratio": round(statistics.median(pair_ratios), 4),
        "step_time_ratio": round(statistics.median(pair_ratios), 4),
        "step_time_ratio_pooled": round(med["replica"] / med["plain"], 4),
        "bytes_per_param_replica": mem["replica"]["bytes_per_param"], "formula_replica": f_rep,
        "bytes_per_param_distributed": mem["plain"]["bytes_per_param"], "formula_distributed": f_dist,
        "dp_size": d, "nproc": a.nproc, "iters": a.iters, "warmup": a.warmup, "repeats": a.repeats,
        "step_ms_plain": round(1000 * med["plain"], 3), "step_ms_replica": round(1000 * med["replica"], 3),
        "pair_ratios": [round(x, 4) for x in pair_ratios],
        "cpu_time_ratio": round(statistics.median(cpu_ratios), 4),
        "cpu_pair_ratios": [round(x, 4) for x in cpu_ratios],
        "params": mem["plain"]["numel"], "padding_replica": mem["replica"]["padding"],
        "padding_distributed": mem["plain"]["padding"], "grad_dtype": mem["plain"]["grad_dtype"][0],
        "grad_comm_bytes_distributed": comm["plain"]["grad_msg_bytes"],
        "grad_comm_bytes_replica": comm["replica"]["grad_msg_bytes"],
        "grad_comm_bytes_mindspeed": exp["mindspeed"][0],
        "grad_wire_bytes_distributed": round(comm["plain"]["grad_wire_bytes"]),
        "grad_wire_bytes_replica": round(comm["replica"]["grad_wire_bytes"]),
        "grad_wire_bytes_mindspeed": round(exp["mindspeed"][1]),
        "grad_comm_matches_buckets": all(comm[k]["grad_msg_bytes"] == exp[k][0] and
                                         round(comm[k]["grad_wire_bytes"]) == round(exp[k][1])
                                         for k in ("plain", "replica")),
        "param_gather_wire_bytes_distributed": round(comm["plain"]["param_gather_wire_bytes"]),
        "param_gather_wire_bytes_replica": round(comm["replica"]["param_gather_wire_bytes"]),
        # grads + params sent per rank per step: with grads and params of one dtype both are
        # 2(d-1)/d x the buffer (the replica moves traffic from the param all-gather to the
        # cross-instance grad all-reduce)
        "total_wire_bytes_distributed": round(comm["plain"]["grad_wire_bytes"] + comm["plain"]["param_gather_wire_bytes"]),
        "total_wire_bytes_replica": round(comm["replica"]["grad_wire_bytes"] + comm["replica"]["param_gather_wire_bytes"]),
        "losses_equal": runs["plain"][-1]["loss_hex"] == runs["replica"][-1]["loss_hex"],
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
