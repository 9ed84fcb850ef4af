"""The GPU check: mindspeed-ha on NVIDIA GPUs, end to end, in one command (at most 5 minutes).

    python benchmarks/gpu_check.py            # on a machine with >= 1 NVIDIA GPU
    python benchmarks/gpu_check.py --cpu      # the same checks on the CPU (gloo): checks this script

Every check is a real job under ``mindspeed-ha run`` (a tiny bf16 GPT on the GPU), its losses read
from the ranks' event logs and compared bit for bit (``float.hex``) with a fault-free run:

- world size 1, built-in trainer: training; a second fault-free run (the run-to-run spread: with
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` it is expected to be zero); periodic checkpoints and a
  ``--load`` resume from iteration 8; retry with the no-replica in-process reload (``uce`` in step 6,
  the checkpoint of step 4 reloaded); a genuine sticky CUDA error (``cuda-illegal-address``: a Triton
  kernel stores out of bounds) -> exit 75 -> the job relaunched with ``--load`` finishes equal to the
  fault-free run;
- the same training and resume through Megatron-LM's own loop (``MEGATRON_LM_PATH``);
- where two or more ranks can have a GPU (>= 2 GPUs, or one shared: NCCL >= 2.30 with
  ``NCCL_MULTI_RANK_GPU_ENABLE=1``, or any NCCL with ``MINDSPEED_HA_NCCL_HOST_PER_RANK=1``): first the
  stop's abort alone, without the engine (``benchmarks/nccl_abort.py``: does aborting every group at
  once free survivors held behind a collective rank 1 skipped, or died in, and can they rebuild?;
  ``--skip-probe`` where it ran already); then, in the order of what they tell, the replica optimizer
  at the largest data-parallel size possible (the reference), a ``uce`` under retry, a kill in the
  optimizer phase under recover (only that rank restarted, its shard from its twin; the survivors
  stopped inside the grad-norm all-reduce), a kill inside the gradient reduce-scatter under the dump
  then a ``--load`` of the survivors' checkpoint, a ``bitflip`` caught by the replica check (exit 4),
  the replica optimizer at DP=2 where the reference was larger; and more ranks than GPUs refused with
  exit 2. ``--only multi-rank`` runs these alone.

A comparison passes when the losses are bit-identical, or, where the two fault-free runs already
differ, within that measured spread (the JSON says which). Last line: one JSON object. Exit 0: every
check that applies passed; 1: one failed; 77: no NVIDIA GPU here (nothing checked; the JSON says
what is missing).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
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
NO_GPU = 77
ITERS, RESUME_AT, INTERVAL = 12, 8, 4

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--vocab-size", "512",
         "--tokenizer-type", "NullTokenizer", "--mock-data", "--lr-warmup-iters", "2", "--bf16",
         "--use-distributed-optimizer", "--train-iters", str(ITERS)]
ALONE = ["--enable-high-availability", "--distributed-optimizer-no-replica"]  # HA on, one rank: no twin
# Megatron-LM without Transformer Engine, Apex or compiled kernels: what its local implementation needs.
MLM_MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--bf16",
             "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--train-iters", str(ITERS),
             "--use-distributed-optimizer", "--ckpt-format", "torch_dist", "--transformer-impl", "local",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
             "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm"]


# ---- what this machine has ------------------------------------------------------------------
def environment(cpu: bool) -> dict:
    import torch
    from mindspeed_ha import compat
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "megatron_core": compat.megatron_core_version(), "gpus": compat.cuda_device_count(),
           "gpu_names": [], "nccl": None, "triton": None, "mode": "cpu" if cpu else "cuda",
           "megatron_lm": os.environ.get("MEGATRON_LM_PATH") or None, "nvcc": shutil.which("nvcc")}
    if env["gpus"]:
        env["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(env["gpus"])]
        env["nccl"] = ".".join(map(str, compat.nccl_version() or ())) or None
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def ranks_possible(env: dict, most: int = 4) -> tuple[int, str]:
    """How many ranks (up to ``most``) can have a GPU of their own (or share one where NCCL allows it)."""
    if env["mode"] == "cpu":
        return most, "CPU mode: gloo"
    from mindspeed_ha.device import HOST_PER_RANK_ENV, NCCL_SHARED_GPU
    if env["gpus"] >= 2:
        return min(most, env["gpus"] - env["gpus"] % 2), f"{env['gpus']} GPUs"
    nccl = tuple(int(x) for x in (env["nccl"] or "0").split("."))
    if nccl >= NCCL_SHARED_GPU and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1":
        return most, f"one GPU shared by {most} ranks (NCCL {env['nccl']}, NCCL_MULTI_RANK_GPU_ENABLE=1, experimental)"
    if os.environ.get(HOST_PER_RANK_ENV) == "1":
        return most, (f"one GPU shared by {most} ranks, each an NCCL host of its own (NCCL {env['nccl']}, "
                      f"{HOST_PER_RANK_ENV}=1: NCCL_HOSTID per rank, the socket transport)")
    why = (f"one GPU, and NCCL {env['nccl']} refuses two ranks on it" if nccl < NCCL_SHARED_GPU else
           "one GPU; set NCCL_MULTI_RANK_GPU_ENABLE=1 to let NCCL >= 2.30 share it (experimental)")
    return 1, why


# ---- jobs -------------------------------------------------------------------------------------
class Job:
    def __init__(self, name: str, code: int, out: str, log_dir: str, seconds: float):
        self.name, self.code, self.out, self.log_dir, self.seconds = name, code, out, log_dir, seconds

    def events(self, name: str) -> list[dict]:
        out = []
        for path in sorted(glob.glob(os.path.join(self.log_dir, "events", f"{name}.jsonl"))):
            for line in open(path):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def losses(self) -> dict[int, str]:
        """iteration -> loss_hex of its last run (a recomputed step's runs must agree: checked)."""
        runs: dict[int, list[str]] = {}
        for e in self.events("rank_*"):
            if e.get("event") == "step" and e.get("loss_hex"):
                runs.setdefault(e["iteration"], []).append(e["loss_hex"])
        differ = {i: r for i, r in runs.items() if len(set(r)) > 1}
        if differ:
            raise Check.Failed(f"{self.name}: recomputed steps changed their loss: {differ}")
        return {i: r[-1] for i, r in sorted(runs.items())}

    def tail(self, n: int = 1500) -> str:
        """The job's last output, then what its ranks said of a stop: a failed multi-rank check
        shows there whether the survivors' communicators were aborted, and where a training thread
        that never served the recovery was held."""
        said = self.stop_evidence()
        return self.out[-n:] + (f"\n--- the ranks on the stop\n{said}" if said else "")

    def stop_evidence(self, n: int = 4000) -> str:
        lines = [f"rank {e.get('rank')}: {e.get('detail', '')}" for e in self.events("rank_*") if e.get("event") == "held"]
        path = os.path.join(self.log_dir, "ttp_log.log")
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                lines += [line.rstrip()[:600] for line in f
                          if "mindspeed_ha.comm: stop:" in line or "left its collective" in line]
        return "\n".join(lines)[-n:]


class Runner:
    def __init__(self, root: str, cpu: bool, deadline: float):
        self.root, self.cpu, self.deadline = root, cpu, deadline
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONHASHSEED="0", OMP_NUM_THREADS="1",
                        MINDSPEED_HA_DEVICE="cpu" if cpu else "cuda", CUBLAS_WORKSPACE_CONFIG=":4096:8",
                        PYTHONWARNINGS="ignore")
        for k in ("MINDSPEED_HA_INJECT", "HIGH_AVAILABILITY", "MS_ENABLE_TFT", "MINDSPEED_HA_JOB_ID"):
            self.env.pop(k, None)

    def run(self, name: str, nproc: int, args: list[str], inject: str = "", megatron_lm: bool = False,
            timeout: float = 150.0, agent: list[str] = ()) -> Job:
        left = self.deadline - time.monotonic()
        if left < 20:
            raise Check.Skipped("the 5-minute budget is spent")
        d = os.path.join(self.root, name)
        os.makedirs(d, exist_ok=True)
        env = dict(self.env)
        if inject:
            env["MINDSPEED_HA_INJECT"] = inject
        if not megatron_lm:
            env.pop("MEGATRON_LM_PATH", None)
        cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", str(nproc),
               *agent, PRETRAIN, *args, "--ha-log-dir", os.path.join(d, "logs")]
        t0 = time.monotonic()
        try:
            p = jobs.run(cmd, env=env, cwd=d, capture_output=True, text=True, timeout=min(timeout, left),
                         log_dir=os.path.join(d, "logs"))
            code, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            code = 124
            out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace") \
                if isinstance(e.stdout, bytes) else (e.stdout or "") + (e.stderr or "")
        return Job(name, code, out, os.path.join(d, "logs"), round(time.monotonic() - t0, 1))


class Check:
    class Failed(Exception):
        pass

    class Skipped(Exception):
        pass


def expect_ok(job: Job) -> Job:
    if job.code != 0:
        raise Check.Failed(f"{job.name}: exit {job.code}\n{job.tail()}")
    return job


def compare(got: dict, ref: dict, spread: float, iterations=None) -> dict:
    """Equal bits, or within the measured run-to-run ``spread`` (relative) where that is not 0."""
    its = sorted(iterations if iterations is not None else ref)
    missing = [i for i in its if i not in got or i not in ref]
    if missing:
        raise Check.Failed(f"iterations {missing} missing (got {sorted(got)}, reference {sorted(ref)})")
    differ = [i for i in its if got[i] != ref[i]]
    worst = max((abs(float.fromhex(got[i]) - float.fromhex(ref[i])) / abs(float.fromhex(ref[i])) for i in its),
                default=0.0)
    if differ and worst > spread:
        raise Check.Failed(f"iterations {differ} differ from the fault-free run (largest relative difference "
                           f"{worst:.3g}, run-to-run spread {spread:.3g})")
    return {"iterations": [its[0], its[-1]] if its else [], "bit_identical": not differ,
            "max_rel_diff": worst}


def resume_dir(src: str, dst: str, iteration: int) -> str:
    """A copy of a checkpoint directory whose newest checkpoint is ``iteration``."""
    shutil.copytree(src, dst)
    for d in glob.glob(os.path.join(dst, "iter_*")):
        if int(os.path.basename(d).split("_")[1]) > iteration:
            shutil.rmtree(d)
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return dst


# ---- the checks -------------------------------------------------------------------------------
def run_checks(r: Runner, env: dict, results: dict, skipped: dict, one_rank: bool = True, most_ranks: int = 4,
               probe: bool = True, journal: str | None = None) -> None:
    """``probe``: run nccl_abort first among the multi-rank checks; ``journal``: a file each check's
    result is appended to as it ends (JSON lines)."""
    state: dict = {}

    def check(name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            detail = fn() or {}
            results[name] = {"ok": True, "seconds": round(time.monotonic() - t0, 1), **detail}
        except Check.Skipped as e:
            skipped[name] = str(e)
        except Check.Failed as e:
            results[name] = {"ok": False, "seconds": round(time.monotonic() - t0, 1), "error": str(e)[-2500:]}
        except Exception as e:  # a bug of this script: reported, the other checks still run
            results[name] = {"ok": False, "seconds": round(time.monotonic() - t0, 1),
                             "error": f"{type(e).__name__}: {e}"}
        print(f"gpu_check: {name}: {results.get(name, {}).get('ok', 'skipped: ' + skipped.get(name, ''))}",
              flush=True)
        if journal:
            with open(journal, "a") as f:
                f.write(json.dumps({"check": name, **results.get(name, {"skipped": skipped.get(name)})}) + "\n")

    ck = os.path.join(r.root, "ck")

    def train():
        job = expect_ok(r.run("train", 1, MODEL + ALONE + ["--save", ck,
                                                    "--save-interval", str(INTERVAL)]))
        state["ref"] = job.losses()
        if sorted(state["ref"]) != list(range(1, ITERS + 1)):
            raise Check.Failed(f"logged iterations {sorted(state['ref'])}")
        return {"job_s": job.seconds, "final_loss": float.fromhex(state["ref"][ITERS])}

    def repeat():
        need(state, "ref")
        job = expect_ok(r.run("train_again", 1, MODEL + ALONE))
        try:
            compare(job.losses(), state["ref"], 0.0)
            state["spread"] = 0.0
        except Check.Failed:
            state["spread"] = compare(job.losses(), state["ref"], float("inf"))["max_rel_diff"]
        return {"run_to_run_spread": state["spread"], "deterministic": state["spread"] == 0.0,
                "settings": "CUBLAS_WORKSPACE_CONFIG=:4096:8, same seed, world size 1"}

    def resume():
        need(state, "ref", "spread")
        load = resume_dir(ck, os.path.join(r.root, "ck_resume"), RESUME_AT)
        job = expect_ok(r.run("resume", 1, MODEL + ALONE + ["--load", load]))
        return compare(job.losses(), state["ref"], state["spread"], range(RESUME_AT + 1, ITERS + 1))

    def retry_reload():
        need(state, "ref", "spread")
        job = expect_ok(r.run("retry_reload", 1, MODEL + ALONE + [
            "--enable-hbmfault-repair", "--save", os.path.join(r.root, "ck_r"),
            "--save-interval", str(INTERVAL)], inject="uce:rank=0:step=6:phase=backward"))
        rec = [e for e in job.events("controller") if e.get("event") == "recovered"]
        if not rec or rec[0].get("how") != "reload":
            raise Check.Failed(f"no in-process reload recorded: {rec}\n{job.tail()}")
        return {**compare(job.losses(), state["ref"], state["spread"]), "mttr_s": rec[0].get("mttr_s"),
                "lost_steps": rec[0].get("lost_steps")}

    def sticky_error():
        need(state, "ref", "spread")
        kind = "ecc" if r.cpu else "cuda-illegal-address"
        save = os.path.join(r.root, "ck_sticky")
        args = MODEL + ALONE + ["--save", save, "--save-interval", str(INTERVAL)]
        job = r.run("sticky_error", 1, args + ["--enable-worker-reboot"], inject=f"{kind}:rank=0:step=6")
        fatal = [e for e in job.events("rank_0") if e.get("event") == "process_fatal"]
        exits = [e for e in job.events("agent_0") if e.get("event") == "worker_exit"]
        if not fatal:
            raise Check.Failed(f"no process_fatal event (exit {job.code})\n{job.tail()}")
        if not any(e.get("code") == 75 for e in exits):
            raise Check.Failed(f"the worker did not end with exit 75: {exits}\n{job.tail()}")
        again = expect_ok(r.run("sticky_relaunch", 1, args + ["--load", save]))
        got = {**job.losses(), **again.losses()}
        return {**compare(got, state["ref"], state["spread"]), "error": fatal[0].get("detail", "")[:160],
                "first_job_exit": job.code}

    def megatron_lm():
        if not env["megatron_lm"]:
            raise Check.Skipped("MEGATRON_LM_PATH is not set (a checkout of NVIDIA/Megatron-LM at core_v0.16.1 or core_v0.12.1)")
        if not r.cpu and not env["nvcc"]:
            raise Check.Skipped("Megatron-LM's initialize runs nvcc -V (megatron.legacy.fused_kernels.load); "
                                "no nvcc on PATH")
        mck = os.path.join(r.root, "mlm_ck")
        ref = expect_ok(r.run("mlm_train", 1, MLM_MODEL + ["--save", mck, "--save-interval", str(INTERVAL)],
                              megatron_lm=True)).losses()
        again = expect_ok(r.run("mlm_train_again", 1, MLM_MODEL, megatron_lm=True)).losses()
        spread = compare(again, ref, float("inf"))["max_rel_diff"]
        load = resume_dir(mck, os.path.join(r.root, "mlm_ck_resume"), RESUME_AT)
        job = expect_ok(r.run("mlm_resume", 1, MLM_MODEL + ["--load", load], megatron_lm=True))
        return {**compare(job.losses(), ref, spread, range(RESUME_AT + 1, ITERS + 1)),
                "run_to_run_spread": spread}

    n, why = ranks_possible(env, most_ranks)
    # (first: seconds, before any model; the budget must not starve it)
    if r.cpu:
        skipped["ranks_refused"] = "CPU mode: a CPU never refuses ranks"
    elif n >= 2 and env["gpus"] < n:
        skipped["ranks_refused"] = f"ranks share the GPU here ({why})"
    else:
        def refused():
            job = r.run("ranks_refused", env["gpus"] + 1, MODEL + ALONE, timeout=90)
            if job.code != 2 or "--nproc-per-node" not in job.out or "CUDA_VISIBLE_DEVICES" not in job.out:
                raise Check.Failed(f"exit {job.code}, expected 2 with a message naming --nproc-per-node\n{job.tail()}")
            return {"message": next(l for l in job.out.splitlines() if "--nproc-per-node" in l)[:300]}
        check("ranks_refused", refused)

    for name, fn in (("train", train), ("run_to_run", repeat), ("resume", resume), ("retry_reload", retry_reload),
                     ("sticky_error", sticky_error), ("megatron_lm_resume", megatron_lm)):
        if one_rank:
            check(name, fn)
        else:
            skipped[name] = "not asked for (--only multi-rank)"

    multi = ["nccl_abort", "replica_dp2", "replica_dp4", "retry_uce", "recover_kill", "dump_then_load",
             "bitflip_caught"]
    if n < 2:
        for name in multi:
            skipped[name] = why
    else:
        state["why_multi"] = why
        if not probe:
            skipped["nccl_abort"] = "not asked for (--skip-probe: it ran before this check)"
        run_multi_rank(r, n, state, check, probe)


def run_multi_rank(r: Runner, n: int, state: dict, check, probe: bool = True) -> None:
    def abort_alone():
        # (first: every recovery below starts with this abort; if it does not free a survivor here,
        # the engine's checks cannot pass, and this says why in seconds)
        sys.path.insert(0, HERE)
        import nccl_abort
        if r.deadline - time.monotonic() < 90:
            raise Check.Skipped("the 5-minute budget is spent")
        runs = {peer: nccl_abort.run(peer, n, r.cpu, held_after=15.0, keep=r.root) for peer in ("skip", "kill")}
        if not all(s["ok"] for s in runs.values()):
            held = [f"rank {rank} held, its stacks:\n{s['stacks'][-900:]}" for run in runs.values()
                    for rank, s in run["survivors"].items() if s.get("stacks")]
            raise Check.Failed("\n".join([nccl_abort.summary(s) for s in runs.values()] + held))
        keep = ("way", "freed_after_abort_s", "freed_after_issue_s", "result", "wait_error", "rebuild_s")
        return {peer: {rank: {k: s[k] for k in keep if s.get(k) is not None} | {"abort_s": s["abort"].get("took_s")}
                       for rank, s in run["survivors"].items()} for peer, run in runs.items()}

    ha = ["--enable-high-availability", "--ha-verify-replicas-interval", "2", "--global-batch-size", "8"]

    def replica(dp: int):
        def fn():
            if dp > n:
                raise Check.Skipped(f"{n} ranks possible here")
            job = expect_ok(r.run(f"replica_dp{dp}", dp, MODEL + ha))
            state[f"ref{dp}"] = job.losses()
            checks = [e for e in job.events("rank_*") if e.get("event") == "replica_check"]
            if not checks or not all(e.get("ok") for e in checks):
                raise Check.Failed(f"replica checks: {checks}")
            return {"replica_checks": len(checks), "job_s": job.seconds, "ranks": state["why_multi"]}
        return fn

    def retry_uce():
        need(state, f"ref{n}")
        job = expect_ok(r.run("retry_uce", n, MODEL + ha + ["--enable-hbmfault-repair"],
                              inject="uce:rank=1:step=5:phase=backward"))
        rec = [e for e in job.events("controller") if e.get("event") == "recovered"]
        if not rec:
            raise Check.Failed(f"no recovery recorded\n{job.tail()}")
        return {**compare(job.losses(), state[f"ref{n}"], 0.0), "mttr_s": rec[0].get("mttr_s"), "dp": n}

    def recover_kill():
        need(state, f"ref{n}")
        job = expect_ok(r.run("recover_kill", n, MODEL + ha + ["--enable-worker-reboot"],
                              inject="kill:rank=1:step=6:phase=optimizer"))
        rec = [e for e in job.events("controller") if e.get("event") == "recovered"]
        starts = [e for e in job.events("agent_0") if e.get("event") == "worker_start"]
        if not rec:
            raise Check.Failed(f"no recovery recorded\n{job.tail()}")
        return {**compare(job.losses(), state[f"ref{n}"], 0.0), "mttr_s": rec[0].get("mttr_s"),
                "worker_starts": len(starts), "dp": n}

    def dump_then_load():
        need(state, f"ref{n}")
        dck = os.path.join(r.root, "ck_dump")
        job = r.run("dump", n, MODEL + ha + ["--save", dck], inject="kill:rank=1:step=6:phase=grad-sync")
        saved = [e for e in job.events("controller") if e.get("event") == "checkpoint" and e.get("kind") == "dying_gasp"]
        if job.code == 0 or not saved:
            raise Check.Failed(f"exit {job.code}: expected the survivors' dying-gasp checkpoint\n{job.tail()}")
        it = saved[0]["iteration"]
        again = expect_ok(r.run("dump_load", n, MODEL + ha + ["--load", dck]))
        return {**compare(again.losses(), state[f"ref{n}"], 0.0, range(it + 1, ITERS + 1)), "dumped_iteration": it,
                "survivors": saved[0].get("survivors"), "dp": n}

    def bitflip():
        job = r.run("bitflip", n, MODEL + ha, inject="bitflip:rank=1:step=3:phase=param-sync")
        codes = {e.get("code") for e in job.events("agent_0") if e.get("event") == "worker_exit"}
        if job.code == 0 or 4 not in codes or "replica mismatch at iteration 4" not in job.out:
            raise Check.Failed(f"exit {job.code}, workers {codes}: expected the replica check to stop the job "
                               f"at iteration 4 (workers exit 4)\n{job.tail()}")
        return {"message": next(l for l in job.out.splitlines() if "replica mismatch" in l)[:300]}

    if probe:
        check("nccl_abort", abort_alone)
    check(f"replica_dp{n}", replica(n))  # (the reference of the checks after it)
    check("retry_uce", retry_uce)
    check("recover_kill", recover_kill)
    check("dump_then_load", dump_then_load)
    check("bitflip_caught", bitflip)
    for dp in (2, 4):
        if dp != n:
            check(f"replica_dp{dp}", replica(dp))


def need(state: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in state]
    if missing:
        raise Check.Skipped(f"needs the result of an earlier check that did not pass ({', '.join(missing)})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run the checks on the CPU (gloo): tests this script")
    p.add_argument("--keep", default=None, help="keep the jobs' logs and checkpoints in this directory")
    p.add_argument("--budget", type=float, default=300.0, help="seconds for every check together (default 300)")
    p.add_argument("--only", choices=("all", "multi-rank"), default="all",
                   help="multi-rank: only the checks of several ranks (default: all)")
    p.add_argument("--ranks", type=int, choices=(2, 4), default=4,
                   help="at most this many ranks in the multi-rank checks (default 4)")
    p.add_argument("--skip-probe", action="store_true",
                   help="leave out the multi-rank checks' first one, nccl_abort (it ran on its own before)")
    p.add_argument("--journal", default=None, help="append each check's result to this file as it ends")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    env = environment(a.cpu)
    out = {"ok": False, "environment": env, "checks": {}, "skipped": {}}
    if not a.cpu and env["gpus"] == 0:
        out["missing"] = (f"no NVIDIA GPU visible (torch {env['torch']}, CUDA build {env['cuda'] or 'none'}, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                          "run on a machine with an NVIDIA GPU and driver, or pass --cpu to check this script")
        print(json.dumps(out))
        return NO_GPU
    root = a.keep or tempfile.mkdtemp(prefix="gpu_check_")
    os.makedirs(root, exist_ok=True)
    r = Runner(root, a.cpu, t0 + a.budget)
    run_checks(r, env, out["checks"], out["skipped"], one_rank=a.only == "all", most_ranks=a.ranks,
               probe=not a.skip_probe, journal=a.journal)
    out["ok"] = bool(out["checks"]) and all(c["ok"] for c in out["checks"].values())
    out["seconds"] = round(time.monotonic() - t0, 1)
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
