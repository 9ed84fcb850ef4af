"""A DataLoader's forked workers and the communicators an old layout left behind, on 2 real gloo ranks.

The workers are this file run as a script (``python test_fork.py MODE RANK PORT PORT2``); the test
process hosts the TCPStores (the job's, the recovery's).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta

WORLD = 2
HERE = os.path.abspath(__file__)


def worker(mode: str, rank: int, port: int, port2: int) -> None:
    """A recovery replaces the job's communicators while something of the old layout (a resized
    model, an old optimizer) still holds an old one in a reference cycle; then Megatron-LM's data
    iterators are built (``hook``: through the session's hook; ``plain``: not), their DataLoader
    forks a worker whose collector runs, and the ranks all-reduce again."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    from mindspeed_ha import patches
    from mindspeed_ha.comm import groups
    from mindspeed_ha.megatron_lm.hooks import on_build_data_iterators

    gc.disable()  # the old communicator stays garbage until someone collects it
    patches.apply("stable_groups")
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(4))

    class Old:
        pass
    old = Old()
    old.pg = dist.group.WORLD.inner()
    old.self = old
    del old
    groups.reconnect("127.0.0.1", port2, 1, timedelta(seconds=30))
    assert groups.released(10)

    class Collecting(Dataset):  # a worker's collector runs sooner or later; here at once
        def __len__(self):
            return 4

        def __getitem__(self, i):
            gc.collect()
            return i

    def build(provider):
        return iter(DataLoader(Collecting(), num_workers=1, timeout=15)), None, None

    result = {}
    try:
        it = (on_build_data_iterators(build, None) if mode == "hook" else build(None))[0]
        result["items"] = [int(x) for x in it]
        t = torch.ones(4)
        dist.all_reduce(t)
        result["sum"] = t[0].item()
    except Exception as e:  # what the data loader or the next collective raised
        result["error"] = f"{type(e).__name__}: {e}"[:300]
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)


def _run(mode: str, tmp) -> list[dict]:
    import torch.distributed as dist

    from helpers import clean_env, free_port

    port, port2 = free_port(), free_port()
    servers = [dist.TCPStore("127.0.0.1", p, WORLD, is_master=True, timeout=timedelta(seconds=60),
                             wait_for_workers=False) for p in (port, port2)]
    logs = [tmp / f"{mode}-{r}.out" for r in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, HERE, mode, str(r), str(port), str(port2)], env=clean_env(),
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
             for r, log in enumerate(logs)]
    try:
        for p in procs:
            p.wait(90)
    finally:
        for p in procs:  # with any data loader worker left behind (one can hang for good)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        del servers
    outs = [log.read_text() for log in logs]
    return [next((json.loads(ln[7:]) for ln in o.splitlines() if ln.startswith("RESULT ")), {"error": o[-1500:]})
            for o in outs]


def test_forked_data_loader_workers_leave_the_old_layouts_communicators_alone(tmp_path):
    """Through the hook, the replaced communicator is destroyed before the fork: the worker reads every
    item and the ranks' next all-reduce works. Without it (the control), the worker's collector
    runs the communicator's destructor on the parent's sockets: the worker hangs in it (or dies), and
    the rank's read times out."""
    assert _run("hook", tmp_path) == [{"items": [0, 1, 2, 3], "sum": 2.0}] * WORLD
    control = _run("plain", tmp_path)
    assert any("error" in r for r in control), control


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
