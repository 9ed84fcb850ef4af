"""Interruptible collectives on a real 4-process gloo job.

The workers are this file run as a script (``python test_interruptible.py MODE RANK ...``); the test
process hosts the TCPStores, so a hung or stopped rank never takes the rendezvous down with it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest


WORLD = 4
HERE = os.path.abspath(__file__)


# ----------------------------------------------------------------------------------- workers

def _init(rank, port):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))


def _apply_patches():
    from mindspeed_ha import patches

    patches.apply("interruptible_collectives", {"import_megatron": False})
    return patches


def worker_stop(rank, port, port2, out):
    """Ranks 0-2 block in an all_reduce that rank 3 never joins (it hangs, alive); a watcher thread
    requests a stop; the main thread must raise CollectiveStopped within 1 s. Survivors then
    rebuild a 3-rank gloo group over a fresh store and all-reduce."""
    import torch
    import torch.distributed as dist

    from mindspeed_ha.comm import PROCESS_STOP as stop, CollectiveStopped

    _init(rank, port)
    _apply_patches()
    t = torch.ones(1024)
    dist.all_reduce(t)  # all four ranks: the group works
    assert t[0].item() == WORLD
    dist.barrier()
    if rank == WORLD - 1:
        time.sleep(600)  # hung but alive; the test kills it
        return
    from torch.distributed import distributed_c10d as c10d

    def expect_stop(what, fn, delay):
        """Run ``fn`` (which blocks on rank 3); a watcher thread requests a stop after ``delay``."""
        stopped_at = {}

        def watcher():
            time.sleep(delay)
            stopped_at["t"] = time.monotonic()
            stop.request("test: rank 3 hung")

        th = threading.Thread(target=watcher, daemon=True)
        th.start()
        try:
            fn()
            result.setdefault("error", f"{what} returned")
        except CollectiveStopped as e:
            result[f"{what}_latency_s"] = time.monotonic() - stopped_at["t"]
            result["message"] = str(e)
        th.join()
        # a collective issued while the stop is pending raises at once
        try:
            dist.barrier()
            result.setdefault("error", f"barrier after stop ({what}) returned")
        except CollectiveStopped:
            pass
        assert stop.requested()
        stop.clear()

    def coalesced():  # megatron's grad-sync shape: sync ops inside a coalescing block
        with c10d._coalescing_manager():
            dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(4))

    def async_handle():
        dist.all_reduce(torch.ones(4), async_op=True).wait()

    result = {"rank": rank}
    expect_stop("all_reduce", lambda: dist.all_reduce(t), 1.0)
    expect_stop("coalesced", coalesced, 0.3)
    expect_stop("async_wait", async_handle, 0.3)
    expect_stop("recv", lambda: dist.recv(torch.empty(2), WORLD - 1), 0.3)
    # gloo's reduce-scatter work has no future and finishes inside wait(): the helper-thread path
    expect_stop("reduce_scatter", lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * WORLD)), 0.3)

    # rebuild: a fresh ProcessGroupGloo over a PrefixStore of a new TCPStore, survivors only
    t0 = time.monotonic()
    store = dist.TCPStore("127.0.0.1", port2, WORLD - 1, is_master=False,
                          timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("rebuild/1", store), rank, WORLD - 1,
                               timedelta(seconds=60))
    x = torch.full((8,), float(rank + 1))
    pg.allreduce([x]).wait()
    result["rebuilt_sum"] = x[0].item()
    result["rebuild_s"] = time.monotonic() - t0
    with open(os.path.join(out, f"stop_{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # the old default group still has a pending op on the hung peer: don't tear it down


def worker_uncovered(rank, port, port2, out):
    """Rank 0 reaches each barrier 1 s late; ranks 1-3 are stopped before or while they wait in it.
    Marked uncovered (a trainer's loop between hooked calls), they finish it with rank 0; in covered
    code the same stop throws them out at once."""
    import torch.distributed as dist

    from mindspeed_ha.comm import PROCESS_STOP as stop, CollectiveStopped

    _init(rank, port)
    _apply_patches()
    dist.barrier()
    result = {"rank": rank}

    def late_barrier(what, stop_before):
        if rank == 0:
            time.sleep(1.0)
            dist.barrier()
            return
        if stop_before:
            stop.request("test: a peer faulted")
        else:
            threading.Timer(0.2, stop.request, ("test: a peer faulted",)).start()
        t0 = time.monotonic()
        try:
            dist.barrier()
            result[what] = ["finished", time.monotonic() - t0]
        except CollectiveStopped:
            result[what] = ["stopped", time.monotonic() - t0]
        time.sleep(0.3)  # (the timer has fired)
        stop.clear()

    stop.set_uncovered(True)
    late_barrier("uncovered_stopped_before", True)
    late_barrier("uncovered_stopped_during", False)
    stop.set_uncovered(False)
    late_barrier("covered_stopped_during", False)
    time.sleep(1.5)  # the stopped barrier still runs in gloo: rank 0 comes to it before any peer exits
    with open(os.path.join(out, f"uncovered_{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def worker_uncovered_lost(rank, port, port2, out):
    """Rank 3 dies as the others enter a barrier in uncovered code (a trainer's loop between hooked
    calls); the controller's stop comes 1 s later. The barrier fails (the lost peer's error, or the
    stop after its grace) without raising out of the loop; the loop's next collective is answered by
    the rank alone; the failure is raised at the next hooked call, once."""
    import torch
    import torch.distributed as dist

    from mindspeed_ha.comm import PROCESS_STOP as stop

    _init(rank, port)
    _apply_patches()
    dist.barrier()
    if rank == WORLD - 1:
        os._exit(0)
    stop.uncovered_grace_s = 2.0
    result = {"rank": rank}
    stop.set_uncovered(True)
    threading.Timer(1.0, stop.request, ("test: rank 3 lost",)).start()
    t0 = time.monotonic()
    dist.barrier()
    result["barrier_s"] = time.monotonic() - t0
    t, t0 = torch.ones(4), time.monotonic()
    dist.all_reduce(t)
    result["all_reduce"] = [t[0].item(), time.monotonic() - t0]
    stop.set_uncovered(False)
    raised = []
    for _ in range(2):
        try:
            stop.raise_deferred()
        except Exception as e:
            raised.append(type(e).__name__)
    result["raised"] = raised
    time.sleep(max(0.0, 1.2 - (time.monotonic() - t0)))  # (the stop's timer has fired)
    stop.clear()
    with open(os.path.join(out, f"uncovered_lost_{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def worker_loop_alone(rank, port, port2, out):
    """Rank 0 finishes a step in a recovery while its peers had ended it and passed the loop's code
    after it alone (``Stop.answer_loop_alone``): its barrier and all-reduce there are answered by
    itself at once; its peers are elsewhere (sleeping). The mode ends at its next hooked call, with
    nothing raised: the next collective of the loop is a real one again, with every rank."""
    import torch
    import torch.distributed as dist

    from mindspeed_ha.comm import PROCESS_STOP as stop

    _init(rank, port)
    _apply_patches()
    result = {"rank": rank}
    if rank == 0:
        stop.answer_loop_alone()
        stop.set_uncovered(True)
        t0 = time.monotonic()
        dist.barrier()
        t = torch.full((4,), 2.0)
        dist.all_reduce(t)
        result["alone"] = [t[0].item(), time.monotonic() - t0]
        stop.set_uncovered(False)
        stop.raise_deferred()  # (the next hooked call's start: nothing to raise, the mode ends)
        stop.set_uncovered(True)
    else:
        time.sleep(0.5)
    t = torch.ones(4)
    dist.all_reduce(t)  # every rank: a real one
    result["together"] = t[0].item()
    with open(os.path.join(out, f"loop_alone_{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def worker_late(rank, port, port2, out):
    """Ranks 0-2 are stopped in three collectives rank 3 has not reached: an all-reduce, megatron's
    grad-sync (a coalesced reduce-scatter into a shard of its own input) and its param-sync (an
    all-gather into the buffer that holds its input); they then put those tensors to other use (a
    rollback and the next step). Rank 3 comes back (a frozen node thawed) and runs the same three, so
    the survivors' stopped collectives complete in the old group: they must not write into the
    survivors' tensors any more."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from mindspeed_ha.comm import PROCESS_STOP as stop, CollectiveStopped

    _init(rank, port)
    _apply_patches()
    signals = dist.TCPStore("127.0.0.1", port2, WORLD - 1, is_master=False, timeout=timedelta(seconds=60))
    t = torch.full((4,), float(rank + 1))
    grads = torch.full((2 * WORLD,), float(rank + 1))
    params = torch.zeros(2 * WORLD)
    params[2 * rank:2 * rank + 2] = float(rank + 1)
    own_shard = params[2 * rank:2 * rank + 2]

    def all_reduce():
        dist.all_reduce(t)

    def grad_sync():
        with c10d._coalescing_manager():
            dist.reduce_scatter_tensor(grads[2 * rank:2 * rank + 2], grads)

    def param_sync():
        dist.all_gather_into_tensor(params, own_shard)

    result = {"rank": rank}
    if rank == WORLD - 1:
        signals.wait(["stopped_0", "stopped_1", "stopped_2"])
        for fn in (all_reduce, grad_sync, param_sync):
            fn()
        result.update(t=t.tolist(), grads=grads.tolist(), params=params.tolist())
        signals.set("late_done", "1")
    else:
        for fn in (all_reduce, grad_sync, param_sync):
            threading.Timer(0.3, stop.request, ("test: rank 3 frozen",)).start()
            try:
                fn()
                result.setdefault("error", f"{fn.__name__} returned")
            except CollectiveStopped:
                pass
            time.sleep(0.1)
            stop.clear()
        for x in (t, grads, params):
            x.fill_(-1.0)  # what training keeps in them after the rollback
        signals.set(f"stopped_{rank}", "1")
        signals.wait(["late_done"])
        time.sleep(1.0)  # rank 3 has its results: the last messages of the old collectives reach this rank
        result.update(t=t.tolist(), grads=grads.tolist(), params=params.tolist())
    with open(os.path.join(out, f"late_{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # the old collectives' threads may still hold the group: don't tear it down


def _mixed_collectives(rank, sub):
    """A deterministic mix of collectives; returns their results as a list of tensors/objects."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    g = torch.Generator().manual_seed(1234 + rank)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    out = []
    a = r(37)
    dist.all_reduce(a)
    out.append(a)
    b = r(5)
    dist.all_reduce(b, dist.ReduceOp.MAX, None, False)  # async_op passed positionally
    out.append(b)
    w = dist.all_reduce(c := r(11), async_op=True)
    w.wait()
    out.append(c)
    d = r(6) if rank == 1 else torch.zeros(6)
    dist.broadcast(d, src=1)
    out.append(d)
    ag = torch.empty(WORLD * 3)
    dist.all_gather_into_tensor(ag, r(3))
    out.append(ag)
    lst = [torch.empty(2) for _ in range(WORLD)]
    dist.all_gather(lst, r(2))
    out += lst
    rs = torch.empty(4)
    dist.reduce_scatter_tensor(rs, r(4 * WORLD))
    out.append(rs)
    rs2 = torch.empty(3)
    dist.reduce_scatter(rs2, [r(3) for _ in range(WORLD)])
    out.append(rs2)
    ab = torch.empty(WORLD * 2)
    dist._all_gather_base(ab, r(2))
    out.append(ab)
    dist.barrier()
    # coalesced, sync and async, as megatron's param_and_grad_buffer does
    xs = [r(8) for _ in range(3)]
    with c10d._coalescing_manager(sub):
        for x in xs:
            dist.all_reduce(x, group=sub)
    out += xs
    shards = [torch.empty(2) for _ in range(2)]
    with c10d._coalescing_manager(sub, async_ops=True) as cm:
        for s in shards:
            dist.reduce_scatter_tensor(s, r(2 * dist.get_world_size(sub)), group=sub, async_op=True)
    cm.wait()
    out += shards
    # p2p ring, send/recv and batch
    nxt, prv = (rank + 1) % WORLD, (rank - 1) % WORLD
    buf = torch.empty(4)
    if rank % 2 == 0:
        dist.send(r(4), nxt)
        dist.recv(buf, prv)
    else:
        dist.recv(buf, prv)
        dist.send(r(4), nxt)
    out.append(buf)
    rb = torch.empty(3)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, r(3), nxt), dist.P2POp(dist.irecv, rb, prv)])
    for q in reqs:
        q.wait()
    out.append(rb)
    objs = [None] * WORLD
    dist.all_gather_object(objs, {"rank": rank, "v": r(1).item()})
    out.append(objs)
    return out


def worker_equiv(rank, port, port2, out):
    """Same collectives unpatched, patched, and unpatched again: bit-identical results."""
    import torch
    import torch.distributed as dist

    _init(rank, port)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    sub = groups[rank // 2]

    def digest(res):
        return [x.numpy().tobytes().hex() if isinstance(x, torch.Tensor) else json.dumps(x)
                for x in res]

    base = digest(_mixed_collectives(rank, sub))
    patches = _apply_patches()
    from mindspeed_ha.comm.interruptible import PollingWork

    assert hasattr(dist.all_reduce, "__mindspeed_ha_original__")
    w = dist.all_reduce(torch.ones(2), async_op=True)
    assert isinstance(w, PollingWork) and w.wait()
    patched = digest(_mixed_collectives(rank, sub))
    patches.remove_all()
    assert not hasattr(dist.all_reduce, "__mindspeed_ha_original__")
    again = digest(_mixed_collectives(rank, sub))
    with open(os.path.join(out, f"equiv_{rank}.json"), "w") as f:
        json.dump({"base": base, "patched": patched, "again": again}, f)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------- tests

def _launch(mode, tmp_path, env_extra=None):
    import torch.distributed as dist

    stores = [dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False)
              for n in (WORLD, WORLD - 1)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning",
               **(env_extra or {}))
    procs = [subprocess.Popen([sys.executable, HERE, mode, str(r), str(stores[0].port),
                               str(stores[1].port), str(tmp_path)], env=env)
             for r in range(WORLD)]
    return stores, procs


def _reap(procs, ranks, timeout):
    deadline = time.monotonic() + timeout
    codes = {}
    for r in ranks:
        try:
            codes[r] = procs[r].wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[r] = None
    return codes


def _kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.alone  # (asserts a latency)
def test_stop_leaves_blocked_collective_and_group_rebuilds(tmp_path):
    stores, procs = _launch("stop", tmp_path)
    try:
        codes = _reap(procs, range(WORLD - 1), 90)
        assert procs[WORLD - 1].poll() is None, "the hung rank should still be alive"
    finally:
        _kill_all(procs)
    assert codes == {0: 0, 1: 0, 2: 0}, codes
    for r in range(WORLD - 1):
        res = json.load(open(tmp_path / f"stop_{r}.json"))
        assert "error" not in res, res
        lat = {k[:-len("_latency_s")]: v for k, v in res.items() if k.endswith("_latency_s")}
        assert set(lat) == {"all_reduce", "coalesced", "async_wait", "recv", "reduce_scatter"}, res
        assert max(lat.values()) < 1.0, res
        assert "rank 3 hung" in res["message"]
        assert res["rebuilt_sum"] == 1 + 2 + 3
        print(f"rank {r}: stop latency (ms) " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in lat.items())
              + f"; rebuild {res['rebuild_s']:.2f} s")


def _run_to_the_end(mode, tmp_path, timeout):
    """Every rank of a ``mode`` job exits 0 within ``timeout``."""
    stores, procs = _launch(mode, tmp_path)
    try:
        codes = _reap(procs, range(WORLD), timeout)
    finally:
        _kill_all(procs)
    assert codes == {r: 0 for r in range(WORLD)}, codes


@pytest.mark.alone  # (asserts a latency)
def test_uncovered_code_finishes_the_collective_its_peers_passed(tmp_path):
    _run_to_the_end("uncovered", tmp_path, 90)
    for r in range(1, WORLD):
        res = json.load(open(tmp_path / f"uncovered_{r}.json"))
        assert res["uncovered_stopped_before"][0] == res["uncovered_stopped_during"][0] == "finished", res
        assert min(res["uncovered_stopped_before"][1], res["uncovered_stopped_during"][1]) > 0.5, res
        assert res["covered_stopped_during"][0] == "stopped" and res["covered_stopped_during"][1] < 0.8, res


def test_uncovered_code_survives_a_peer_lost_in_its_collective(tmp_path):
    _run_to_the_end("uncovered_lost", tmp_path, 90)
    for r in range(WORLD - 1):
        res = json.load(open(tmp_path / f"uncovered_lost_{r}.json"))
        assert res["barrier_s"] < 1.0 + 2.0 + 1.5, res  # at the latest, the stop's grace after the stop
        assert res["all_reduce"][0] == 1.0 and res["all_reduce"][1] < 0.5, res  # this rank's own
        assert len(res["raised"]) == 1 and res["raised"][0] in ("RuntimeError", "CollectiveStopped"), res


def test_a_rank_answers_the_loops_code_alone_until_its_next_hooked_call(tmp_path):
    _run_to_the_end("loop_alone", tmp_path, 90)
    res = [json.load(open(tmp_path / f"loop_alone_{r}.json")) for r in range(WORLD)]
    assert res[0]["alone"][0] == 2.0 and res[0]["alone"][1] < 0.4, res[0]  # its own value, no peer waited for
    assert all(r["together"] == float(WORLD) for r in res), res


def test_patched_collectives_bit_identical(tmp_path):
    _run_to_the_end("equiv", tmp_path, 120)
    for r in range(WORLD):
        res = json.load(open(tmp_path / f"equiv_{r}.json"))
        assert res["base"] == res["patched"] == res["again"]


def test_a_stopped_collective_completed_late_writes_nothing(tmp_path):
    _run_to_the_end("late", tmp_path, 90)  # rank 3 finished its three: the survivors' old ones completed
    for r in range(WORLD - 1):
        res = json.load(open(tmp_path / f"late_{r}.json"))
        assert "error" not in res, res
        assert res["t"] == [-1.0] * 4 and res["grads"] == [-1.0] * 8 and res["params"] == [-1.0] * 8, res
    late = json.load(open(tmp_path / f"late_{WORLD - 1}.json"))
    # and they reduced what the survivors held when they issued them
    assert late["t"] == [10.0] * 4 and late["grads"][-2:] == [10.0, 10.0], late


def test_request_stop_api():
    from mindspeed_ha.comm import PROCESS_STOP as stop

    assert not stop.requested()
    stop.request("x")
    assert stop.requested()
    stop.clear()
    assert not stop.requested()


if __name__ == "__main__":
    mode, rank, port, port2, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    {"stop": worker_stop, "equiv": worker_equiv, "uncovered": worker_uncovered,
     "uncovered_lost": worker_uncovered_lost, "late": worker_late,
     "loop_alone": worker_loop_alone}[mode](rank, port, port2, out)
