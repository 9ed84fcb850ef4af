"""Elastic training: scale in when a node is lost without a spare, scale out when it comes back.

One GPT job of two nodes x two ranks on loopback (node 1 on 127.0.0.2), `HIGH_AVAILABILITY=elastic-training`,
a periodic checkpoint every ``--save-interval`` steps. At step ``--lose-at`` node 1 is lost whole (its
agent and workers SIGKILLed): the job scales in to data-parallel size 2; ``--back-after`` steps later a
new node 1 starts (`mindspeed-ha run` again, a fresh log dir) and the job scales out to 4 again.

Figures, from the job's own events:
- ``scale_in_s``: fault -> first step completed at the new size (the `recovered` event's MTTR; with a
  whole node gone, its detection is the heartbeat loss, ``detect_s``, part of it; there is no spare
  wait: none is configured);
- ``scale_out_s``: the last newcomer registered -> first step completed at full size (`scaled_out`);
- ``step_s``: rank 0's median step time before, scaled in and after (past 3 settling steps each);
- ``throughput_kept``: per surviving rank, samples per second scaled in / before — each rank reads
  twice the samples per step at half the size (2 x before / scaled in). Two CPU cores share the ranks,
  so fewer ranks also means more CPU per rank: on this machine the figure says how little the
  resize costs, not what a GPU cluster would see;
- ``torchrun_ratio``: the baseline / ``scale_in_s``. The baseline is what a job without elastic does
  on the same loss: the same detection, then a whole-job restart at the smaller size with torchrun
  (`torch.distributed.run --nproc-per-node 2`, HA off) from the periodic checkpoint taken before the
  fault, until it has trained again the step the elastic job resumed at (start-up, load, and the
  steps lost since the checkpoint recomputed), measured here in the same run.

Last line: one JSON object. Goals on this CPU: scale-in and scale-out <= 3 s each, throughput kept
>= 0.95, >= 3x faster than the restart.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
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


def model(a) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", str(a.hidden), "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--use-distributed-optimizer", "--mock-data",
            "--lr-warmup-iters", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def env(extra: dict | None = None) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MINDSPEED_HA_", "HIGH_AVAILABILITY"))}
    e.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(extra or {}))
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events(log_dirs, name: str) -> list[dict]:
    from mindspeed_ha.events import read_events
    out = []
    for d in log_dirs:
        path = os.path.join(d, "events", f"{name}.jsonl")
        out += read_events(path) if os.path.exists(path) else []
    return out


class Job:
    def __init__(self, a, root: str):
        self.a, self.root, self.port = a, root, free_port()
        self.ck = os.path.join(root, "ck")
        keys = os.path.join(root, "keys")
        subprocess.run(CLI + ["keygen", keys], check=True, capture_output=True, env=env())
        self.env = env({"HIGH_AVAILABILITY": "elastic-training", "MINDSPEED_HA_KEY_DIR": keys})
        self.dirs: list[str] = []
        self.node_dir: dict[int, str] = {}
        self.agents: dict[int, subprocess.Popen] = {}

    def start(self, node: int) -> None:
        d = os.path.join(self.root, f"node{node}-{len(self.dirs)}")
        os.makedirs(d)
        self.dirs.append(d)
        self.node_dir[node] = d
        cmd = CLI + ["run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr",
                     "127.0.0.1", "--master-port", str(self.port), "--local-addr", f"127.0.0.{node + 1}", PRETRAIN,
                     *model(self.a), "--train-iters", str(self.a.iters), "--save", self.ck, "--save-interval",
                     str(self.a.save_interval), "--ha-log-dir", d]
        with open(os.path.join(d, "agent.out"), "w") as out:
            self.agents[node] = jobs.popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=d)

    def lose(self, node: int) -> None:
        """The node is gone: its agent and every process it started, at once."""
        self.agents[node].kill()
        for e in events([self.node_dir[node]], f"agent_{node}"):
            if e["event"] in ("worker_start", "spare_template_start", "spare_start"):
                for kill in (lambda p: os.killpg(p, signal.SIGKILL), lambda p: os.kill(p, signal.SIGKILL)):
                    try:
                        kill(e["worker_pid"])
                        break
                    except (ProcessLookupError, PermissionError):
                        continue
        self.agents[node].wait(30)

    def controller(self, name: str) -> list[dict]:
        return [e for e in events(self.dirs, "controller") if e["event"] == name]

    def steps(self) -> dict[int, dict]:
        return {e["iteration"]: e for e in events(self.dirs, "rank_0") if e["event"] == "step"}

    def wait(self, pred, what: str, timeout: float = 300.0):
        t = time.monotonic()
        while not pred():
            if time.monotonic() - t > timeout or self.agents[0].poll() is not None:
                raise SystemExit(f"elastic benchmark: no {what} (see {self.root})")
            time.sleep(0.05)

    def close(self) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                p.kill()


def baseline(a, ck: str, until: int, root: str) -> float:
    """A whole-job restart at data-parallel size 2 with torchrun, HA off, from ``ck``: seconds from
    its launch to the end of step ``until`` (read from its log line)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", PRETRAIN,
           *model(a), "--train-iters", str(until), "--load", ck, "--log-interval", "1"]
    t0 = time.monotonic()
    proc = jobs.popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root)
    mark, seen, tail = f"iteration {until:8d}/", None, []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        if mark in line and seen is None:
            seen = time.monotonic() - t0
    proc.wait()
    if seen is None:
        raise SystemExit("elastic benchmark: the torchrun baseline never reached step "
                         f"{until}:\n{''.join(tail)}")
    return seen


def at_fault(ck: str, iteration: int, dest: str) -> str:
    """The periodic checkpoint the job had when the node went (the job saves on meanwhile)."""
    from mindspeed_ha.trainer_state.checkpoint_dir import TRACKER, iter_dir
    shutil.copytree(iter_dir(ck, iteration), iter_dir(dest, iteration))
    with open(os.path.join(dest, TRACKER), "w") as f:
        f.write(str(iteration))
    return dest


def median_step(steps: dict, first: int, last: int) -> float:
    return statistics.median(steps[i]["step_s"] for i in range(first, last + 1) if i in steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=1200)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--save-interval", type=int, default=20)
    p.add_argument("--lose-at", type=int, default=150)
    p.add_argument("--back-after", type=int, default=100, help="steps at the smaller size before node 1 starts again")
    p.add_argument("--keep", action="store_true", help="keep the log dirs")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="mindspeed-ha-elastic-")
    job = Job(a, root)
    try:
        job.start(0)
        job.start(1)
        job.wait(lambda: max(job.steps(), default=0) >= a.lose_at, f"step {a.lose_at}")
        saved = [e["iteration"] for e in events(job.dirs, "rank_0") if e["event"] == "checkpoint"
                 and e.get("kind", "periodic") == "periodic"]
        job.lose(1)
        ck = at_fault(job.ck, max(saved), os.path.join(root, "ck-at-fault"))
        print(f"node 1 lost at step {max(job.steps())}; newest periodic checkpoint {max(saved, default=None)}",
              flush=True)
        job.wait(lambda: job.controller("recovered"), "scale-in")
        rec, scaled_in = job.controller("recovered")[0], job.controller("scaled_in")[0]
        resumed = rec["iteration"]
        job.wait(lambda: max(job.steps()) >= resumed + a.back_after, f"{a.back_after} steps scaled in")
        back_at = max(job.steps())
        job.start(1)
        job.wait(lambda: job.controller("scaled_out"), "scale-out")
        out_ev = job.controller("scaled_out")[0]
        code = job.agents[0].wait(600)
        job.agents[1].wait(60)
        if code != 0:
            raise SystemExit(f"elastic benchmark: the job ended with {code} (see {root})")
        steps = job.steps()
        before = median_step(steps, a.lose_at - 40, a.lose_at - 1)
        scaled = median_step(steps, resumed + 4, back_at)
        after = median_step(steps, out_ev["iteration"] + 4, a.iters)
        print(f"scale-in  {scaled_in['old_dp']} -> {scaled_in['dp']} at iteration {resumed}: MTTR {rec['mttr_s']} s "
              f"(detect {rec['phases'].get('detect')}, stop {rec['phases'].get('stop')}, "
              f"scale-in {rec['phases'].get('scale-in')}, first step {rec['phases'].get('first_step')})", flush=True)
        print(f"scale-out {out_ev['old_dp']} -> {out_ev['dp']} at iteration {out_ev['iteration']}: "
              f"{out_ev['seconds']} s from registration, phases {out_ev['phases']}", flush=True)
        print(f"median step: before {before * 1e3:.1f} ms, scaled in {scaled * 1e3:.1f} ms, after {after * 1e3:.1f} ms",
              flush=True)
        restart = baseline(a, ck, resumed + 1, root)
        detect = rec["phases"].get("detect", 0.0) + rec["phases"].get("stop", 0.0)
        base = detect + restart
        print(f"torchrun restart at DP=2 from the checkpoint: {restart:.2f} s to step {resumed + 1} "
              f"(+ the same {detect:.2f} s to know the node is lost) = {base:.2f} s", flush=True)
        result = {"scale_in_s": rec["mttr_s"], "scale_in_detect_s": round(detect, 4),
                  "scale_out_s": out_ev["seconds"], "step_s_before": round(before, 5),
                  "step_s_scaled_in": round(scaled, 5), "step_s_after": round(after, 5),
                  "throughput_kept": round(2 * before / scaled, 3), "after_over_before": round(after / before, 3),
                  "baseline_s": round(base, 3), "torchrun_ratio": round(base / rec["mttr_s"], 2),
                  "bytes_moved_in": scaled_in["bytes"], "bytes_moved_out": out_ev["bytes"]}
    finally:
        job.close()
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
