"""The stop's abort alone, without the engine: does aborting a communicator free a host held behind a
collective that a peer never joined, and can survivors make and use new communicators after it?

    python benchmarks/nccl_abort.py                  # NCCL: a GPU a rank, or one shared (NCCL >= 2.30 and
                                                     # NCCL_MULTI_RANK_GPU_ENABLE=1)
    python benchmarks/nccl_abort.py --cpu            # the emulated NCCL: checks this script

Why: on a GPU every recovery of the engine starts with this. A survivor's training thread waits on
the device for a collective the faulted rank will never join, and only the stop's abort
(``comm/interruptible.py``) can free it. When a recovery fails on a GPU, this probe tells whether
NCCL's abort itself is the cause, in seconds of device time.

Each scenario runs ``--ranks`` processes; rank 1 is the faulted one.
1. Every rank makes one group over all ranks, as the engine makes its groups
   (``compat.make_communicator``, connected on the rank's device, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``
   as the engine sets it). One all-reduce checks the group.
2. Rank 1 leaves. ``skip``: it stays alive and never joins the next collective (a memory error).
   ``kill``: it is SIGKILLed.
3. Every survivor all-reduces a gradient-sized tensor and waits for it as torch's synchronous call
   does (``work.wait()``: on NCCL the stream waits, the host goes on). It then blocks the host where
   a trainer does, one way per survivor in turn:
   - ``item``: a sum's ``.item()`` (Megatron's grad norm);
   - ``stream``: the current stream's synchronize (a recovery's entry);
   - ``device``: the whole device's synchronize.
4. A second after the all-reduce was issued, another thread calls ``ProcessGroup.abort()``, the
   stop's abort.
5. The probe records, for each survivor:
   - when the host's wait returned, counted from the abort;
   - the result: ``whole``, ``own`` (only this rank's contribution) or ``partial``;
   - any error that the wait or a device synchronize raises (is the context sticky?).
6. The survivors make a new communicator over themselves (the rebuild) and all-reduce on it. Is the
   sum right?

A survivor still held ``--held-after`` seconds after the abort (or into its rebuild) writes where it
is: its stage, and every thread's stack (``faulthandler``). It stays as it is (its end would break
the others' collectives and free them, or fail them, for a reason that is no part of the probe): the
probe ends the held ones once every survivor is either through or held, and counts them as held.
``--no-abort`` skips step 4: the control, where every survivor must be held.

Last line: one JSON object. Exit codes: 0 when every survivor was freed and its rebuild's sum was
right; 1 otherwise; 77 when no GPU can run the ranks (the JSON says why).
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
NO_GPU = 77
FAULTED = 1
WAYS = ("item", "stream", "device")  # how a survivor's host waits, by its place among the survivors
ELEMENTS = 1 << 22  # floats in the all-reduce (16 MiB: several NCCL chunks, a small gradient bucket)
ABORT_AFTER_S = 1.0


# ---- one rank ---------------------------------------------------------------------------------
def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from mindspeed_ha import compat
    from mindspeed_ha.comm import backends

    backends.keep_survivors()  # TORCH_NCCL_ASYNC_ERROR_HANDLING=2, before any communicator
    record: dict = {"rank": a.rank, "stage": "set-up"}
    out = os.path.join(a.out, f"rank_{a.rank}.json")

    def write(**more) -> None:
        record.update(more)
        with open(out + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(out + ".tmp", out)

    if a.cpu:
        device, backend = torch.device("cpu"), backends.EMULATED_NCCL
    else:
        from mindspeed_ha.device import Device
        device, backend = Device("cuda").set_current(a.rank), "nccl"  # (round robin where ranks share)

    def synchronize(way: str) -> None:
        if device.type == "cuda":
            (torch.cuda.current_stream().synchronize if way == "stream" else torch.cuda.synchronize)()

    timeout = datetime.timedelta(seconds=a.held_after + 60)
    store = dist.TCPStore("127.0.0.1", a.port, is_master=False, timeout=datetime.timedelta(seconds=60))
    group = compat.make_communicator(dist.PrefixStore("all", store), a.rank, a.world, backend, timeout, device=device)
    ones = torch.ones(8, device=device)
    group.allreduce([ones]).wait()
    synchronize("device")
    if ones[0].item() != a.world:
        write(stage="failed", error=f"the group's first all-reduce gave {ones[0].item()}, not {a.world}")
        os._exit(1)
    store.add("ready", 1)
    while store.add("ready", 0) < a.world:
        time.sleep(0.01)

    survivors = [r for r in range(a.world) if r != FAULTED]
    if a.rank == FAULTED:
        write(stage="left", how=a.peer)
        if a.peer == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        store.wait(["done"], datetime.timedelta(seconds=a.held_after + 120))  # alive, never joining
        os._exit(0)

    way = WAYS[survivors.index(a.rank) % len(WAYS)]
    x = torch.full((a.elements,), float(a.rank + 1), device=device)
    whole = float(sum(r + 1 for r in range(a.world)))
    issued = time.monotonic()
    abort: dict = {}

    def abort_group() -> None:
        time.sleep(max(0.0, issued + ABORT_AFTER_S - time.monotonic()))
        abort["began"] = time.monotonic()
        try:
            group.abort()
        except Exception as e:  # recorded: the survivor may still be freed
            abort["error"] = f"{type(e).__name__}: {e}"[:300]
        abort["took_s"] = round(time.monotonic() - abort["began"], 3)

    def report_held() -> None:
        stacks = os.path.join(a.out, f"rank_{a.rank}.stacks")
        with open(stacks, "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        with open(stacks) as f:
            write(held=record["stage"], stacks=f.read()[-3000:], abort=dict(abort))
        # (and stays held: the probe ends it when every survivor is through or held)

    if not a.no_abort:
        threading.Thread(target=abort_group, name="aborter", daemon=True).start()
    held = threading.Timer(ABORT_AFTER_S + a.held_after, report_held)
    held.daemon = True
    held.start()
    write(stage=f"waiting ({way})", way=way)
    try:
        group.allreduce([x]).wait()
        if way != "item":
            synchronize(way)
        value = x[:1].sum().item() if way == "item" else float(x[0])
    except Exception as e:
        record["wait_error"] = f"{type(e).__name__}: {e}"[:300]
        value = None
    freed = time.monotonic()
    record["stage"] = "freed: synchronizing the device"
    try:
        synchronize("device")
    except Exception as e:  # a sticky error: this process could not go on
        record["sync_error"] = f"{type(e).__name__}: {e}"[:300]
    result = ("whole" if value == whole else "own" if value == a.rank + 1 else "none" if value is None
              else "partial")
    record.update(freed_after_abort_s=round(freed - abort["began"], 3) if "began" in abort else None,
                  freed_after_issue_s=round(freed - issued, 3), result=result, value=value, abort=dict(abort))

    record["stage"] = "rebuilding"
    held.cancel()  # (the rebuild gets a whole --held-after of its own)
    held = threading.Timer(a.held_after, report_held)
    held.daemon = True
    held.start()
    t0 = time.monotonic()
    try:
        rebuilt = compat.make_communicator(dist.PrefixStore("rebuilt", store), survivors.index(a.rank),
                                           len(survivors), backend, timeout, device=device)
        check = torch.ones(8, device=device)
        rebuilt.allreduce([check]).wait()
        synchronize("device")
        record.update(rebuild_ok=check[0].item() == len(survivors), rebuild_sum=check[0].item())
    except Exception as e:
        record.update(rebuild_ok=False, rebuild_error=f"{type(e).__name__}: {e}"[:300])
    held.cancel()
    record["rebuild_s"] = round(time.monotonic() - t0, 3)
    write(stage="done")
    os._exit(0)  # (the aborted communicators are left as they are: their destruction is no part of this)


# ---- the scenarios ----------------------------------------------------------------------------
def run(peer: str, ranks: int, cpu: bool, held_after: float, no_abort: bool = False,
        elements: int = ELEMENTS, keep: str | None = None) -> dict:
    """One scenario in ``ranks`` fresh processes: each survivor's record, and whether it passed.
    ``keep``: a directory for the ranks' records and stacks (otherwise removed afterwards)."""
    out = os.path.join(keep, f"nccl_abort_{peer}") if keep else tempfile.mkdtemp(prefix=f"nccl_abort_{peer}_")
    os.makedirs(out, exist_ok=True)
    import torch.distributed as dist
    # (the store lives here: a rank that ends, held or done, takes nothing from the others)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = []
    for rank in range(ranks):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(rank), "--world", str(ranks),
               "--port", str(port), "--out", out, "--peer", peer, "--held-after", str(held_after),
               "--elements", str(elements)] + (["--cpu"] if cpu else []) + (["--no-abort"] if no_abort else [])
        # (its output to a file, not a pipe read at the end: NCCL_DEBUG=INFO fills a pipe, and a rank
        # blocked writing to it would pass for a held one)
        with open(os.path.join(out, f"rank_{rank}.log"), "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    t0 = time.monotonic()
    deadline = t0 + held_after + 90

    def record(rank: int) -> dict:
        path = os.path.join(out, f"rank_{rank}.json")
        return json.load(open(path)) if os.path.exists(path) else {"rank": rank, "stage": "never started"}

    survivor_ranks = [r for r in range(ranks) if r != FAULTED]
    while time.monotonic() < deadline and not all(
            procs[r].poll() is not None or "held" in record(r) for r in survivor_ranks):
        time.sleep(0.1)
    ended_held = {r for r in survivor_ranks if procs[r].poll() is None and "held" in record(r)}
    for r in ended_held:
        procs[r].kill()
    store.set("done", "1")  # (the survivors are through or held: the faulted rank may go)
    past_deadline = set()
    for rank, p in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            past_deadline.add(rank)
    records = {}
    for rank in range(ranks):
        records[rank] = record(rank)
        records[rank]["exit"] = "held: ended by the probe" if rank in ended_held else procs[rank].returncode
        if records[rank].get("stage") != "done" and rank != FAULTED:
            with open(os.path.join(out, f"rank_{rank}.log"), errors="replace") as f:
                records[rank]["output"] = f.read()[-1500:] + (
                    "\n(killed: past the probe's deadline)" if rank in past_deadline else "")
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    survivors = [records[r] for r in range(ranks) if r != FAULTED]
    ok = all(s.get("stage") == "done" and s.get("rebuild_ok") and s.get("exit") == 0 for s in survivors)
    return {"ok": ok, "peer": peer, "seconds": round(time.monotonic() - t0, 1), "abort": not no_abort,
            "survivors": {s["rank"]: s for s in survivors}}


def summary(scenario: dict) -> str:
    parts = []
    for rank, s in scenario["survivors"].items():
        if s.get("held"):
            parts.append(f"rank {rank} ({s.get('way')}): HELD in {s['held']}; abort {s.get('abort')}")
        elif s.get("stage") != "done":
            parts.append(f"rank {rank}: ended in {s.get('stage')} (exit {s.get('exit')})")
        else:
            when = (f"freed {s['freed_after_abort_s']} s after the abort (which took {s['abort'].get('took_s')} s)"
                    if s.get("freed_after_abort_s") is not None else
                    f"freed {s.get('freed_after_issue_s')} s after the all-reduce was issued, before any abort")
            parts.append(f"rank {rank} ({s['way']}): {when}, result {s['result']}"
                         + (f", the wait raised {s['wait_error'][:120]}" if s.get("wait_error") else "")
                         + (f", the device's synchronize raised {s['sync_error'][:120]}" if s.get("sync_error") else "")
                         + f"; rebuilt in {s.get('rebuild_s')} s, sum right: {s.get('rebuild_ok')}")
    return f"nccl_abort {scenario['peer']}: " + ("passed" if scenario["ok"] else "FAILED") + "\n  " + "\n  ".join(parts)


def environment(cpu: bool, ranks: int) -> tuple[dict, str]:
    """What runs the ranks, and why they cannot run here ('' when they can)."""
    import torch
    from mindspeed_ha import compat
    from mindspeed_ha.device import Device, DeviceError
    env: dict = {"torch": torch.__version__, "mode": "cpu (emulated NCCL)" if cpu else "cuda", "gpus": 0,
                 "nccl": None}
    if cpu:
        return env, ""
    gpus = env["gpus"] = compat.cuda_device_count()
    if not gpus:
        return env, "no NVIDIA GPU visible: run on a machine with one, or pass --cpu to check this script"
    env["gpu_names"] = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    env["nccl"] = ".".join(map(str, compat.nccl_version() or ()))
    try:  # (the engine's own refusal: one GPU a rank, unless NCCL may share one)
        Device("cuda").check_local_ranks(ranks)
    except DeviceError as e:
        return env, f"{e} (here: --ranks)"
    return env, ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the emulated NCCL on the CPU (checks this script)")
    p.add_argument("--ranks", type=int, default=4, help="processes in each scenario, at least 2 (default 4)")
    p.add_argument("--peer", choices=("skip", "kill", "both"), default="both",
                   help="how rank 1 leaves: skip the collective, or be SIGKILLed (default both, one after the other)")
    p.add_argument("--held-after", type=float, default=20.0,
                   help="seconds after the abort at which a survivor not yet freed reports itself held (default 20)")
    p.add_argument("--no-abort", action="store_true", help="the control: no abort (every survivor must be held)")
    p.add_argument("--keep", default=None, help="keep the ranks' records and stacks in this directory")
    p.add_argument("--elements", type=int, default=ELEMENTS, help=argparse.SUPPRESS)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        a.rank = a.worker
        worker(a)
        return 0
    if a.ranks < 2:
        p.error("--ranks must be at least 2: rank 1 is the one that leaves")
    env, why = environment(a.cpu, a.ranks)
    if why:
        print(json.dumps({"ok": False, "environment": env, "missing": why}))
        return NO_GPU
    results = {}
    for peer in (("skip", "kill") if a.peer == "both" else (a.peer,)):
        results[peer] = run(peer, a.ranks, a.cpu, a.held_after, a.no_abort, a.elements, a.keep)
        print(summary(results[peer]), flush=True)
    ok = all(r["ok"] for r in results.values())
    print(json.dumps({"ok": ok, "environment": env, "ranks": a.ranks, "scenarios": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
