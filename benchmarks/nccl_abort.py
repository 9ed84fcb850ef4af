"""The stop's abort alone, without the engine: does aborting a process's communicators free a host held
behind a collective that a peer never joined, and can survivors make and use new communicators after it?
One after another (the abort the engine did until now) and all at once (what it does now), side by side.

    python benchmarks/nccl_abort.py                  # NCCL: a GPU a rank, or ranks sharing one (see below)
    python benchmarks/nccl_abort.py --cpu            # the emulated NCCL: checks this script, and its model

Why: on a GPU every recovery of the engine starts with this. A survivor's training thread waits on
the device for a collective the faulted rank will never join, and only the stop's abort
(``comm/interruptible.py``, ``comm/abort.py``) can free it. NCCL's abort of a communicator sets its
abort flag, then frees its device memory, and a free waits for the device to go idle: aborting an
idle communicator first waits for a kernel stuck in another, whose flag is not set yet. A job has
many groups; the collective a survivor is held in is rarely on the first one. So each rank here makes
two groups over all ranks, ``idle`` registered first, ``stuck`` second, and the held collective is on
``stuck``: a probe with one group could pass while the engine fails.

Each scenario runs ``ranks`` processes; rank 1 is the faulted one.
1. Every rank makes both groups, as the engine makes its groups (``comm.groups.make_communicator``,
   connected on the rank's device, the engine's NCCL settings: ``backends.nccl_environment``), and
   all-reduces a tensor of the test's size on each (the warm-up: every algorithm the test uses is
   connected before it, whatever ``NCCL_RUNTIME_CONNECT`` says).
2. Rank 1 leaves. ``skip``: it stays alive and never joins the next collective (a memory error).
   ``kill``: it is SIGKILLed.
3. Every survivor all-reduces on ``stuck`` and waits for it as torch's synchronous call does
   (``work.wait()``: on NCCL the stream waits, the host goes on). It then blocks the host where a
   trainer does, one way per survivor in turn: ``item`` (a sum's ``.item()``: Megatron's grad norm),
   ``stream`` (the current stream's synchronize: a recovery's entry), ``device`` (the whole device's).
4. A second after the all-reduce was issued, another thread aborts both groups: ``serial``, idle then
   stuck, each ``ProcessGroup.abort()`` after the last returned; ``concurrent``, the engine's
   ``comm.abort.abort_all`` (a thread each, all at once). ``none`` (``--no-abort``): the control.
5. The probe records, for each survivor: when the host's wait returned, counted from the abort; the
   result (``whole``, ``own``: only this rank's contribution, or ``partial``); each group's abort
   time (None: it had not returned); any error the wait or a device synchronize raised.
6. The survivors make a new communicator over themselves (the rebuild) and all-reduce on it. Is the
   sum right?

``--preflight`` makes the two groups on 2 ranks and checks their warm-up all-reduces, nothing more
(seconds): whether the transport works at all, before anything asks more of it. Every rank has a
set-up deadline (``--setup-deadline``, 30 s): one still making its communicators then writes its
stacks and counts as held there.

A survivor still held ``--held-after`` seconds after the abort (or into its rebuild) writes where it
is: its stage, and every thread's stack (``faulthandler``). It stays as it is (its end would break
the others' collectives and free them, or fail them, for a reason that is no part of the probe): the
probe ends the held ones once every survivor is either through or held, and counts them as held.

Every record is written as it changes: ``--keep DIR`` keeps each rank's record, output and stacks,
``--journal FILE`` appends each record as a JSON line (one file a run cut short still leaves behind).

Ranks sharing one GPU: NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``, or any NCCL with
``MINDSPEED_HA_NCCL_HOST_PER_RANK=1`` (each rank an NCCL host of its own, over sockets: the engine's
``device.own_nccl_host``).

Last line: one JSON object. Exit codes: 0 when every survivor of every concurrent abort was freed and
its rebuild's sum was right (the serial ones are there to compare: the emulated NCCL holds them, as
NCCL is read to); 1 otherwise; 77 when no GPU can run the ranks (the JSON says why).
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
sys.path.insert(0, HERE)
import jobs  # noqa: E402  (how every benchmark starts a job)
NO_GPU = 77
FAULTED = 1
WAYS = ("item", "stream", "device")  # how a survivor's host waits, by its place among the survivors
ELEMENTS = 1 << 22  # floats in every all-reduce (16 MiB: several NCCL chunks, a small gradient bucket)
ABORT_AFTER_S = 1.0
ABORTS = ("concurrent", "serial")  # in the order each pair of scenarios runs


# ---- one rank ---------------------------------------------------------------------------------
def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from mindspeed_ha.comm import abort as engine_abort
    from mindspeed_ha.comm import groups as engine_groups
    from mindspeed_ha.device import backends

    started = time.monotonic()
    backends.nccl_environment()  # the engine's NCCL settings (a caller's own kept), before any communicator
    record: dict = {"rank": a.rank, "scenario": a.scenario, "stage": "set-up",
                    "nonblocking": os.environ.get("TORCH_NCCL_USE_COMM_NONBLOCKING", "0")}
    out = os.path.join(a.out, f"rank_{a.rank}.json")

    def write(**more) -> None:
        record.update(more)
        with open(out + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(out + ".tmp", out)
        if a.journal:
            with open(a.journal, "a") as f:  # (one short line per write: appends do not interleave)
                f.write(json.dumps({k: v for k, v in record.items() if k != "stacks"}) + "\n")

    if a.cpu:
        device, backend = torch.device("cpu"), backends.EMULATED_NCCL
    else:
        from mindspeed_ha.device import Device
        device, backend = Device("cuda").set_current(a.rank), "nccl"  # (round robin where ranks share)

    def synchronize(way: str) -> None:
        if device.type == "cuda":
            (torch.cuda.current_stream().synchronize if way == "stream" else torch.cuda.synchronize)()

    abort: dict = {"mode": a.abort, "took": {}}

    def report_held() -> None:
        stacks = os.path.join(a.out, f"rank_{a.rank}.stacks")
        with open(stacks, "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        with open(stacks) as f:
            write(held=record["stage"], stacks=f.read()[-3000:], abort=_plain(abort))
        # (and stays held: the probe ends it when every survivor is through or held)

    # The set-up has a deadline too: a rank held making its communicators (a transport that never
    # connects) says so, with its stacks, instead of leaving the probe silent until its end.
    held = threading.Timer(a.setup_deadline, report_held)
    held.daemon = True
    held.start()
    timeout = datetime.timedelta(seconds=a.held_after + 60)
    store = dist.TCPStore("127.0.0.1", a.port, is_master=False, timeout=datetime.timedelta(seconds=60))
    groups = {name: engine_groups.make_communicator(dist.PrefixStore(name, store), a.rank, a.world, backend, timeout,
                                             device=device) for name in ("idle", "stuck")}  # (idle first)
    for name, group in groups.items():
        warm = torch.ones(a.elements, device=device)
        group.allreduce([warm]).wait()
        synchronize("device")
        if warm[0].item() != a.world:
            write(stage="failed", error=f"the {name} group's warm-up all-reduce gave {warm[0].item()}, not {a.world}")
            os._exit(1)
    store.add("ready", 1)
    while store.add("ready", 0) < a.world:
        time.sleep(0.01)
    held.cancel()
    if a.peer == "none":  # (the preflight: communicators made on this transport, and their sums right)
        write(stage="done", rebuild_ok=True, setup_s=round(time.monotonic() - started, 3))
        os._exit(0)

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

    def abort_groups() -> None:
        time.sleep(max(0.0, issued + ABORT_AFTER_S - time.monotonic()))
        abort["began"] = time.monotonic()
        if a.abort == "concurrent":
            report = engine_abort.abort_all(list(groups.items()), a.held_after + 30)
            abort["took"] = {n: (None if t is None else round(t, 3)) for n, t in report.took.items()}
            abort.update({"errors": report.failed} if report.failed else {})
        else:
            for name, group in groups.items():
                abort["took"][name] = None
                t0 = time.monotonic()
                try:
                    group.abort()
                except Exception as e:  # recorded: the survivor may still be freed
                    abort.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:300]
                abort["took"][name] = round(time.monotonic() - t0, 3)
        abort["took_s"] = round(time.monotonic() - abort["began"], 3)

    aborter = threading.Thread(target=abort_groups, name="aborter", daemon=True)
    if a.abort != "none":
        aborter.start()
    held = threading.Timer(ABORT_AFTER_S + a.held_after, report_held)
    held.daemon = True
    held.start()
    write(stage=f"waiting ({way})", way=way)
    try:
        groups["stuck"].allreduce([x]).wait()
        if way != "item":
            synchronize(way)
        value = x[:1].sum().item() if way == "item" else float(x[0])
    except Exception as e:
        record["wait_error"] = f"{type(e).__name__}: {e}"[:300]
        value = None
    freed = time.monotonic()
    write(stage="freed: synchronizing the device")
    try:
        synchronize("device")
    except Exception as e:  # a sticky error: this process could not go on
        record["sync_error"] = f"{type(e).__name__}: {e}"[:300]
    result = ("whole" if value == whole else "own" if value == a.rank + 1 else "none" if value is None
              else "partial")
    record.update(freed_after_abort_s=round(freed - abort["began"], 3) if "began" in abort else None,
                  freed_after_issue_s=round(freed - issued, 3), result=result, value=value, abort=_plain(abort))

    held.cancel()  # (the rebuild gets a whole --held-after of its own)
    held = threading.Timer(a.held_after, report_held)
    held.daemon = True
    held.start()
    write(stage="rebuilding")
    t0 = time.monotonic()
    try:
        rebuilt = engine_groups.make_communicator(dist.PrefixStore("rebuilt", store), survivors.index(a.rank),
                                           len(survivors), backend, timeout, device=device)
        check = torch.ones(8, device=device)
        rebuilt.allreduce([check]).wait()
        synchronize("device")
        record.update(rebuild_ok=check[0].item() == len(survivors), rebuild_sum=check[0].item())
    except Exception as e:
        record.update(rebuild_ok=False, rebuild_error=f"{type(e).__name__}: {e}"[:300])
    held.cancel()
    record["rebuild_s"] = round(time.monotonic() - t0, 3)
    if aborter.is_alive():  # (freed before every abort returned: their times, once they have)
        aborter.join(a.held_after)
    write(stage="done", abort=_plain(abort))
    os._exit(0)  # (the aborted communicators are left as they are: their destruction is no part of this)


def _plain(abort: dict) -> dict:
    """The abort's record as it stands (its thread may still be writing it), without its clock."""
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in list(abort.items()) if k != "began"}


# ---- the scenarios ----------------------------------------------------------------------------
def run(peer: str, ranks: int, cpu: bool, held_after: float, abort: str = "concurrent",
        elements: int = ELEMENTS, keep: str | None = None, journal: str | None = None,
        setup_deadline: float = 30.0) -> dict:
    """One scenario in ``ranks`` fresh processes: each survivor's record, and whether it passed.
    ``keep``: a directory for the ranks' records and stacks (otherwise removed afterwards)."""
    name = f"{ranks}/{peer}/{abort}"
    tag = name.replace("/", "_")
    out = os.path.join(keep, f"nccl_abort_{tag}") if keep else tempfile.mkdtemp(prefix=f"nccl_abort_{tag}_")
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
               "--elements", str(elements), "--abort", abort, "--scenario", name,
               "--setup-deadline", str(setup_deadline)] + (
                   ["--cpu"] if cpu else []) + (["--journal", journal] if journal else [])
        # (its output to a file, not a pipe read at the end: NCCL_DEBUG=INFO fills a pipe, and a rank
        # blocked writing to it would pass for a held one)
        with open(os.path.join(out, f"rank_{rank}.log"), "w") as log:
            procs.append(jobs.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    t0 = time.monotonic()
    deadline = t0 + max(held_after, setup_deadline) + 90

    def record(rank: int) -> dict:
        path = os.path.join(out, f"rank_{rank}.json")
        try:
            return json.load(open(path))
        except (OSError, ValueError):
            return {"rank": rank, "stage": "never started"}

    survivor_ranks = [r for r in range(ranks) if r != FAULTED or peer == "none"]
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
        if records[rank].get("stage") != "done" and rank in survivor_ranks:
            with open(os.path.join(out, f"rank_{rank}.log"), errors="replace") as f:
                records[rank]["output"] = f.read()[-1500:] + (
                    "\n(killed: past the probe's deadline)" if rank in past_deadline else "")
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    survivors = [records[r] for r in survivor_ranks]
    ok = all(s.get("stage") == "done" and s.get("rebuild_ok") and s.get("exit") == 0 for s in survivors)
    return {"ok": ok, "name": name, "peer": peer, "ranks": ranks, "abort": abort,
            "seconds": round(time.monotonic() - t0, 1), "survivors": {s["rank"]: s for s in survivors}}


def summary(scenario: dict) -> str:
    parts = []
    for rank, s in scenario["survivors"].items():
        took = (s.get("abort") or {}).get("took") or {}
        aborts = ", ".join(f"{n} {'not returned' if t is None else f'{t} s'}" for n, t in took.items())
        if s.get("held"):
            parts.append(f"rank {rank} ({s.get('way')}): HELD in {s['held']}; aborts: {aborts or 'none begun'}")
        elif s.get("stage") != "done":
            parts.append(f"rank {rank}: ended in {s.get('stage')} (exit {s.get('exit')})")
        elif scenario["peer"] == "none":
            parts.append(f"rank {rank}: communicators made and their sums right in {s.get('setup_s')} s")
        else:
            when = (f"freed {s['freed_after_abort_s']} s after the abort began"
                    if s.get("freed_after_abort_s") is not None else
                    f"freed {s.get('freed_after_issue_s')} s after the all-reduce was issued, before any abort")
            parts.append(f"rank {rank} ({s['way']}): {when} (aborts: {aborts}), result {s['result']}"
                         + (f", the wait raised {s['wait_error'][:120]}" if s.get("wait_error") else "")
                         + (f", the device's synchronize raised {s['sync_error'][:120]}" if s.get("sync_error") else "")
                         + f"; rebuilt in {s.get('rebuild_s')} s, sum right: {s.get('rebuild_ok')}")
    verdict = "passed" if scenario["ok"] else ("HELD" if any(s.get("held") for s in scenario["survivors"].values())
                                               else "FAILED")
    return f"nccl_abort {scenario['name']}: {verdict}\n  " + "\n  ".join(parts)


def environment(cpu: bool, ranks: list[int]) -> tuple[dict, str]:
    """What runs the ranks, and why they cannot run here ('' when they can)."""
    import torch
    from mindspeed_ha import compat
    from mindspeed_ha.device import HOST_PER_RANK_ENV, Device, DeviceError
    env: dict = {"torch": torch.__version__, "mode": "cpu (emulated NCCL)" if cpu else "cuda", "gpus": 0,
                 "nccl": None}
    if cpu:
        return env, ""
    gpus = env["gpus"] = compat.cuda_device_count()
    if not gpus:
        return env, "no NVIDIA GPU visible: run on a machine with one, or pass --cpu to check this script"
    env["gpu_names"] = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    env["nccl"] = ".".join(map(str, compat.nccl_version() or ()))
    env["shared_gpu"] = ("NCCL host per rank" if os.environ.get(HOST_PER_RANK_ENV) == "1" and max(ranks) > gpus
                         else "NCCL_MULTI_RANK_GPU_ENABLE" if max(ranks) > gpus else "no")
    try:  # (the engine's own refusal: one GPU a rank, unless ranks may share one)
        Device("cuda").check_local_ranks(max(ranks))
    except DeviceError as e:
        return env, f"{e} (here: --ranks)"
    return env, ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the emulated NCCL on the CPU (checks this script)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                   help="processes in each scenario, each at least 2; several: each in turn (default 2 4)")
    p.add_argument("--peer", choices=("skip", "kill", "both", "none"), default="both",
                   help="how rank 1 leaves: skip the collective, or be SIGKILLed (default both, one after the other)")
    p.add_argument("--preflight", action="store_true",
                   help="only make the two groups on 2 ranks and check their all-reduces (seconds): the transport works")
    p.add_argument("--setup-deadline", type=float, default=30.0,
                   help="seconds after its start at which a rank still making its communicators reports itself "
                        "held there (default 30)")
    p.add_argument("--abort", choices=("concurrent", "serial", "both", "none"), default="both",
                   help="how the survivors abort their two groups (default both: all at once, then one after another)")
    p.add_argument("--held-after", type=float, default=10.0,
                   help="seconds after the abort at which a survivor not yet freed reports itself held (default 10)")
    p.add_argument("--no-abort", action="store_true", help="the control: no abort (every survivor must be held)")
    p.add_argument("--keep", default=None, help="keep the ranks' records, output and stacks in this directory")
    p.add_argument("--journal", default=None, help="append every rank's record, as it changes, to this file")
    p.add_argument("--elements", type=int, default=ELEMENTS, help=argparse.SUPPRESS)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--scenario", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        a.rank = a.worker
        worker(a)
        return 0
    if min(a.ranks) < 2:
        p.error("--ranks must be at least 2: rank 1 is the one that leaves")
    env, why = environment(a.cpu, a.ranks)
    if why:
        print(json.dumps({"ok": False, "environment": env, "missing": why}))
        return NO_GPU
    aborts = ("none",) if a.no_abort else ABORTS if a.abort == "both" else (a.abort,)
    results = {}
    if a.preflight:
        scenario = run("none", 2, a.cpu, a.held_after, "none", a.elements, a.keep, a.journal, a.setup_deadline)
        print(summary(scenario), flush=True)
        print(json.dumps({"ok": scenario["ok"], "environment": env, "preflight": scenario}))
        return 0 if scenario["ok"] else 1
    for ranks in a.ranks:
        for peer in (("skip", "kill") if a.peer == "both" else (a.peer,)):
            for abort in aborts:
                scenario = run(peer, ranks, a.cpu, a.held_after, abort, a.elements, a.keep, a.journal,
                               a.setup_deadline)
                results[scenario["name"]] = scenario
                print(summary(scenario), flush=True)
    judged = [r for r in results.values() if r["abort"] in ("concurrent", "none")]
    ok = all(r["ok"] for r in judged)
    print(json.dumps({"ok": ok, "environment": env, "ranks": a.ranks, "scenarios": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
