"""A small real worker for control-plane tests: gloo all-reduces in a loop with the Processor hooks.

Faults for the tests: --fault KIND:rank=R:step=S[:phase=P] with KIND kill | exit | exception | hang.
The "inject" handler (driven by ``mindspeed-ha inject``) arms the same faults at a live job.
"""
import argparse
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from mindspeed_ha.control.controller import Controller
from mindspeed_ha.events import EventLog
from mindspeed_ha.faults import fault_kind
from mindspeed_ha.options import HAOptions
from mindspeed_ha.rank.processor.processor import Processor

PHASES = ("forward", "backward", "grad-sync", "optimizer")


def parse_fault(text):
    kind, *rest = text.split(":")
    f = {"kind": kind, "phase": "forward"}
    for kv in rest:
        k, v = kv.split("=")
        f[k] = v if k == "phase" else int(v)
    return f


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--fault", default=None)
    p.add_argument("--ha-log-dir", default=None)
    p.add_argument("--ha-insecure", action="store_true")
    p.add_argument("--ha-hang-timeout", type=float, default=60.0)
    p.add_argument("--ha-heartbeat-interval", type=float, default=0.5)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log_dir = a.ha_log_dir or os.environ.get("MINDSPEED_HA_LOG_DIR", "./logs")
    opts = HAOptions(strategies=frozenset({"dump"}), log_dir=log_dir, insecure=a.ha_insecure,
                     heartbeat_s=a.ha_heartbeat_interval, hang_timeout_s=a.ha_hang_timeout)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    half = world // 2
    groups = [[i, i + half] for i in range(half)]
    proc = Processor(rank, world, int(os.environ.get("LOCAL_RANK", 0)), os.environ.get("MINDSPEED_HA_NODE", ""),
                     opts, groups, controller_factory=Controller).start()
    events = EventLog.for_rank(log_dir, rank)
    fault = parse_fault(a.fault) if a.fault else None
    armed = {}

    def on_inject(args):
        armed.update({"kind": args["kind"], "rank": rank, "step": args.get("step", -1),
                      "phase": args.get("phase") or "forward"})
        return f"armed {args['kind']}"
    proc.serve({"inject": on_inject}, training_thread=False)

    def maybe_fire(it, phase):
        for f in (fault, armed):
            if not f or f.get("rank") != rank or f.get("fired"):
                continue
            if f.get("step", -1) not in (-1, it) or f["phase"] != phase:
                continue
            f["fired"] = True
            events.emit("inject", kind=f["kind"], phase=phase, iteration=it)
            if f["kind"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f["kind"] == "exit":
                os._exit(1)
            elif f["kind"] == "exception":
                raise RuntimeError(f"injected exception at iteration {it}")
            elif f["kind"] == "hang":
                while True:
                    time.sleep(1)

    x = torch.ones(1024)
    for it in range(a.steps):
        proc.step_start(it)
        try:
            for phase in PHASES:
                proc.mark_phase(phase)
                maybe_fire(it, phase)
                if phase == "grad-sync":
                    dist.all_reduce(x)
                    x /= world
                elif phase == "optimizer":
                    proc.update_start(it)
                    x += 0.001
                    proc.update_end(it)
                else:
                    time.sleep(a.step_time / 3)
        except Exception as e:
            kind = fault_kind(e)
            proc.report_fault(kind, f"{type(e).__name__}: {e}", it, phase)
            print(f"rank {rank}: {kind}: {e}", file=sys.stderr, flush=True)
            while proc.serve_order(30) is not None:  # the controller decides; exit ends us
                pass
            sys.exit(3)
        proc.step_end(it, float(x[0]))
    proc.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
