"""What a recovery moves and allocates, per rank, as a ratio to its minimum, measured on real 4-rank jobs.

A GPT of ~125 M parameters (GPT-2 small's shape by default: 12 layers, hidden 768, vocabulary 50304)
on 4 ranks (gloo; NCCL on a GPU) under `mindspeed-ha run`, DP=4 with replicas (each ZeRO-1 shard held by two ranks):

- **repair** (`--enable-hbmfault-repair`, a memory error on rank 1 as its update begins): rank 1's
  shard comes back from its twin in place. Minimum: the shard's bytes received, nothing allocated.
  Ratios: bytes received / shard bytes, peak extra memory / shard bytes (`repaired` events).
- **replica check** (`--ha-verify-replicas-interval 1` in the same job): the host bytes a check reads
  (counted by benchmarks/host_reads) and its seconds against a step's.
- **elastic scale-in** (`--enable-elastic-training`, rank 1 killed, no spare): the survivors reshard to
  DP=2. Minimum: the new shard, allocated once. Ratio: peak extra memory over the whole resize (the
  new layout's model and optimizer, and the move) / the new shard's bytes (`resized` events).
- **dump** (`--enable-high-availability` alone, rank 1 killed): the survivors' dying-gasp checkpoint.
  Minimum: a rank's own slice of the weights. Ratio: bytes received by the weights' resync / that
  slice (`checkpoint` events).
- **host syncs a step adds**: Megatron-LM's own loop (when MEGATRON_LM_PATH names a checkout; a tiny
  model: the count does not depend on its size), mindspeed_ha's host reads from a step's start to
  the end of train_step (benchmarks/host_reads).

Every job runs with `--ha-recovery-message-mib` of `--message-mib` (default 64, the engine's): a
repair's extra memory is one such message whatever the shard's size, so its ratio to the shard is
that of the message to the shard (here a shard is 0.1-0.4 GB; at 7B-70B, 10-26 GB).

Memory is the process's peak resident set above its level at the operation's start (Linux VmHWM,
reset through /proc/self/clear_refs), with glibc's mmap threshold fixed so that large tensors come
and go with their own mappings: a CPU figure (a GPU's allocator counters are what the engine reads
there). Each rank's figure is printed; the ratios are the worst rank's.

Last line: one JSON object (repair_extra_mem_ratio, repair_bytes_ratio, reshard_extra_mem_ratio,
dump_bytes_received_ratio, check_host_copy_bytes, step_host_syncs_added, and the raw figures).
"""
from __future__ import annotations

import argparse
import glob
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
HOST_READS = os.path.join(HERE, "host_reads")
PARTS = ("repair", "elastic", "dump", "megatron-lm")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import jobs  # noqa: E402  (how every benchmark starts a job)


def model_args(a) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--micro-batch-size", "1",
            "--global-batch-size", "4", "--vocab-size", str(a.vocab), "--tokenizer-type", "NullTokenizer",
            "--lr", "1e-4", "--lr-warmup-iters", "1", "--use-distributed-optimizer", "--mock-data",
            "--log-interval", "1", *(["--bf16"] if a.bf16 else []),
            # a step of this size takes minutes on a few CPU cores: not a hang
            "--ha-hang-timeout", "600", "--distributed-timeout-minutes", "30"]


def run_job(a, work: str, name: str, flags: list[str], inject: str, iters: int, megatron_lm: bool = False,
            model: list[str] | None = None) -> dict:
    from mindspeed_ha.events import read_events
    log_dir = os.path.join(work, name)
    reads = os.path.join(log_dir, "host_reads")
    os.makedirs(reads, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MINDSPEED_HA_", "HIGH_AVAILABILITY", "MEGATRON_LM_PATH"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MINDSPEED_HA_INJECT=inject, MALLOC_MMAP_THRESHOLD_="65536",
               MINDSPEED_HA_HOST_READS=reads, PYTHONPATH=os.pathsep.join(filter(None, [HOST_READS, env.get("PYTHONPATH")])))
    if megatron_lm:
        env["MEGATRON_LM_PATH"] = os.environ["MEGATRON_LM_PATH"]
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", "4", PRETRAIN,
           *(model if model is not None else model_args(a)), "--train-iters", str(iters), "--ha-log-dir", log_dir,
           *flags, "--ha-recovery-message-mib", str(a.message_mib)]
    proc = jobs.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout, cwd=log_dir,
                    log_dir=log_dir)
    ev = {os.path.basename(f)[:-len(".jsonl")]: read_events(f) for f in glob.glob(os.path.join(log_dir, "events", "*.jsonl"))}
    return {"proc": proc, "events": ev, "reads": [json.load(open(f)) for f in sorted(glob.glob(os.path.join(reads, "*.json")))]}


def rank_events(job: dict, kind: str) -> dict[str, list[dict]]:
    return {r: [e for e in evs if e["event"] == kind] for r, evs in sorted(job["events"].items()) if r.startswith("rank_")}


def fail(name: str, job: dict, why: str) -> None:
    raise SystemExit(f"{name}: {why} (exit {job['proc'].returncode})\n{job['proc'].stderr[-3000:]}")


def expect_events(name: str, job: dict, kind: str, why: str, keep=lambda e: True, exit_ok: bool = True) -> dict:
    """Each rank's last ``kind`` event that ``keep`` accepts; the job fails where none came (or it exited
    non-zero, unless ``exit_ok`` is False: a dump's job ends with its fault's code)."""
    got = {r: e[-1] for r, e in rank_events(job, kind).items() if e and keep(e[-1])}
    if not got or (exit_ok and job["proc"].returncode != 0):
        fail(name, job, why)
    return got


def mb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:.1f} MB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--bf16", action="store_true", help="bf16 weights with fp32 main params (default: fp32)")
    p.add_argument("--message-mib", type=int, default=64,
                   help="the jobs' --ha-recovery-message-mib: the largest recovery message (default 64, the engine's)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per job")
    p.add_argument("--keep", default=None, help="keep the jobs' logs in this directory")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)} (default: all)")
    a = p.parse_args()
    parts = a.only.split(",")
    if not set(parts) <= set(PARTS):
        p.error(f"--only {a.only}: each part is one of {', '.join(PARTS)}")
    work = a.keep or tempfile.mkdtemp(prefix="scale_costs_")
    os.makedirs(work, exist_ok=True)
    h, L, V = a.hidden, a.layers, a.vocab
    params = L * 12 * h * h + (V + a.seq) * h
    print(f"GPT: {L} layers, hidden {h}, vocabulary {V}: ~{params / 1e6:.0f} M parameters; 4 ranks, DP=4 with replicas",
          flush=True)
    out: dict = {"parameters_m": round(params / 1e6, 1), "message_mib": a.message_mib}

    if "repair" in parts:
        measure_repair(a, work, out)
    if "elastic" in parts:
        measure_scale_in(a, work, out)
    if "dump" in parts:
        measure_dump(a, work, out)
    if "megatron-lm" in parts:
        measure_host_syncs(a, work, out)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


def measure_repair(a, work: str, out: dict) -> None:
    """A repair, and the replica check in the same job."""
    job = run_job(a, work, "repair", ["--enable-hbmfault-repair", "--ha-verify-replicas-interval", "1"],
                  "uce:rank=1:step=3:phase=optimizer", 4)
    repaired = expect_events("repair", job, "repaired", "expected a repair in place")
    for r, e in repaired.items():
        print(f"repair, {r}: received {mb(e['bytes'])} of a {mb(e['shard_bytes'])} shard, peak extra memory "
              f"{mb(e['extra_mem_bytes'])}", flush=True)
    out["repair_bytes_ratio"] = round(max(e["bytes"] / e["shard_bytes"] for e in repaired.values()), 4)
    out["repair_extra_mem_ratio"] = round(max(e["extra_mem_bytes"] / e["shard_bytes"] for e in repaired.values()), 4)
    out["repair_shard_bytes"] = max(e["shard_bytes"] for e in repaired.values())
    checks = [e for evs in rank_events(job, "replica_check").values() for e in evs if e.get("ok")]
    steps = [e["step_s"] for evs in rank_events(job, "step").values() for e in evs if e["iteration"] > 1]
    check_reads = [v for r in job["reads"] for site, v in r["step_end"].items() if site.startswith("replica/verify.py")]
    out["check_host_copy_bytes"] = int(max((nbytes / calls for calls, nbytes in check_reads if calls), default=0))
    out["check_s"] = round(statistics.median(e["seconds"] for e in checks), 4) if checks else None
    out["step_s"] = round(statistics.median(steps), 4) if steps else None
    if out["check_s"] and out["step_s"]:
        out["check_vs_step_ratio"] = round(out["check_s"] / out["step_s"], 4)
    print(f"replica check: {out['check_host_copy_bytes']} host bytes a check, {out['check_s']} s against a "
          f"{out['step_s']} s step", flush=True)



def measure_scale_in(a, work: str, out: dict) -> None:
    job = run_job(a, work, "elastic", ["--enable-elastic-training"], "kill:rank=1:step=3:phase=forward", 4)
    resized = expect_events("elastic", job, "resized", "expected a scale-in")
    for r, e in resized.items():
        print(f"scale-in, {r}: new shard {mb(e['shard_bytes'])}, received {mb(e['received'])}, peak extra memory "
              f"{mb(e['extra_mem_bytes'])} (resize {e['seconds']:.2f} s)", flush=True)
    out["reshard_extra_mem_ratio"] = round(max(e["extra_mem_bytes"] / e["shard_bytes"] for e in resized.values()), 4)
    out["reshard_shard_bytes"] = max(e["shard_bytes"] for e in resized.values())



def measure_dump(a, work: str, out: dict) -> None:
    job = run_job(a, work, "dump", ["--enable-high-availability", "--save", os.path.join(work, "dump", "ck")],
                  "kill:rank=1:step=3:phase=optimizer", 4)
    dumps = expect_events("dump", job, "checkpoint", "expected a dying-gasp checkpoint",
                          keep=lambda e: e.get("kind") == "dying_gasp", exit_ok=False)
    for r, e in dumps.items():
        print(f"dump, {r}: resync received {mb(e['resync_bytes_received'])}, own weights {mb(e['own_weights_bytes'])}",
              flush=True)
    out["dump_bytes_received_ratio"] = round(max(e["resync_bytes_received"] / e["own_weights_bytes"]
                                                 for e in dumps.values()), 4)
    shutil.rmtree(os.path.join(work, "dump", "ck"), ignore_errors=True)



def measure_host_syncs(a, work: str, out: dict) -> None:
    """Megatron-LM's own loop (a tiny model: the count does not depend on its size)."""
    if os.environ.get("MEGATRON_LM_PATH"):
        tiny = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                "--lr", "1e-3", "--lr-warmup-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
                "--vocab-size", "128", "--eval-iters", "0", "--eval-interval", "1000", "--use-distributed-optimizer"]
        job = run_job(a, work, "megatron_lm", ["--enable-high-availability", "--enable-hbmfault-repair",
                                               "--enable-worker-reboot"], "", 6, megatron_lm=True, model=tiny)
        if job["proc"].returncode != 0 or len(job["reads"]) != 4:
            fail("megatron_lm", job, "expected 4 ranks' host reads")
        mid = max(sum(c for c, _ in r["mid_step"].values()) / r["steps"] for r in job["reads"])
        end = max(sum(c for c, _ in r["step_end"].values()) / r["steps"] for r in job["reads"])
        print(f"Megatron-LM's loop: {mid:g} host reads a step by mindspeed_ha before train_step ends, {end:g} at its "
              f"end (where the loop reads its loss scale)", flush=True)
        out["step_host_syncs_added"] = mid
        out["step_end_host_reads"] = end
    else:
        print("Megatron-LM's loop: skipped (MEGATRON_LM_PATH is not set)", flush=True)
        out["step_host_syncs_added"] = None


if __name__ == "__main__":
    main()
