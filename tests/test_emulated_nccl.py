"""The CPU backend with NCCL's semantics (``comm.emulated_nccl``) and the engine's stop on it, on four
real processes. The backend alone: results equal gloo's bits, a collective returns before it has
completed, an abort completes what is pending without error (partial results, nothing landing later),
and torch's default error handling ends the process on a failed collective. With the engine's
patches: a stop aborts only what is still pending after its grace, the commit point refuses
afterwards, the evidence says a rank waits, and code no recovery covers finishes what its peers
passed or is answered alone.

The workers are this file run as a script (``python test_emulated_nccl.py MODE RANK ...``); the test
process hosts the TCPStore, so a killed or hung rank never takes the rendezvous down with it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

pytestmark = pytest.mark.nccl
WORLD = 4
HERE = os.path.abspath(__file__)


# ----------------------------------------------------------------------------------- workers

def _init(rank, port, backend="emulated_nccl"):
    import torch.distributed as dist

    from mindspeed_ha import compat
    from mindspeed_ha.comm import emulated_nccl

    emulated_nccl.register(compat.make_communicator)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))


def _engine():
    """The engine's collective wrappers and stable groups, as a job with HA on has them."""
    from mindspeed_ha import patches

    patches.apply("interruptible_collectives", {"import_megatron": False})
    patches.apply("stable_groups")


def _write(out, name, rank, result):
    with open(os.path.join(out, f"{name}_{rank}.json"), "w") as f:
        json.dump(result, f)


def worker_equiv(rank, port, out):
    """The mixed collectives of test_interruptible, on ``TEST_BACKEND``: their bits."""
    import torch
    import torch.distributed as dist
    from test_interruptible import _mixed_collectives

    backend = os.environ["TEST_BACKEND"]
    _init(rank, port, backend)
    if os.environ.get("TEST_ENGINE"):
        _engine()
    sub = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    res = _mixed_collectives(rank, sub)
    digest = [x.numpy().tobytes().hex() if isinstance(x, torch.Tensor) else json.dumps(x) for x in res]
    _write(out, f"equiv_{backend}{'_engine' if os.environ.get('TEST_ENGINE') else ''}", rank, digest)
    dist.barrier()
    os._exit(0)


def worker_backend(rank, port, out):
    """The backend on its own. Rank 3 is late to the first all-reduce and never comes to the second."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    _init(rank, port)
    result = {"rank": rank}
    t = torch.full((4,), float(rank + 1))
    if rank == WORLD - 1:
        time.sleep(0.5)
    w = dist.all_reduce(t, async_op=True)
    result["returned_before_complete"] = not w.is_completed()
    w.wait()
    result["sum"] = t.tolist()
    dist.barrier()
    if rank == WORLD - 1:  # comes to the second all-reduce only after the others aborted theirs
        time.sleep(2.0)
        dist.all_reduce(torch.full((4,), 4.0), async_op=True)
        time.sleep(1.0)
        os._exit(0)
    threading.Timer(0.5, c10d._get_default_group().abort).start()
    t = torch.full((4,), float(rank + 1))
    t0 = time.monotonic()
    dist.all_reduce(t)  # (no error: the abort completes it)
    result["aborted_after_s"] = time.monotonic() - t0
    result["partial"] = t.tolist()
    try:
        dist.all_reduce(torch.ones(1))
        result["after_abort"] = "returned"
    except Exception as e:
        result["after_abort"] = type(e).__name__ + ": " + str(e)[:120]
    time.sleep(2.5)  # rank 3 completed the aborted all-reduce with its peers' old contributions
    result["later"] = t.tolist()
    _write(out, "backend", rank, result)
    os._exit(0)


def worker_watchdog(rank, port, out):
    """Rank 3 dies inside an all-reduce: under torch's default error handling the watchdog ends the
    survivors (a gloo peer's "connection closed" is the remote error), under CleanUpOnly the wait
    raises and the process goes on."""
    import torch
    import torch.distributed as dist

    _init(rank, port)
    dist.barrier()
    if rank == WORLD - 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    result = {"rank": rank}
    try:
        dist.all_reduce(torch.ones(1 << 16))
        result["wait"] = "returned"
    except Exception as e:
        result["wait"] = type(e).__name__
    _write(out, "watchdog", rank, result)
    os._exit(0)


def worker_stop(rank, port, out):
    """The engine's stop. Rank 3 hangs (alive): the others block in an all-reduce it never joins;
    the stop aborts it after the grace (partial, no error), the commit point refuses, the next
    collective raises, the evidence said they were waiting. A stop with nothing pending aborts
    nothing: a collective its peers completed is whole and the commit point passes."""
    import torch
    import torch.distributed as dist

    from mindspeed_ha.comm import PROCESS_STOP as stop, CollectiveStopped

    _init(rank, port)
    _engine()
    result = {"rank": rank}
    mark = stop.commit_mark()
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    dist.barrier()
    # nothing pending when the stop comes: no abort, the commit passes, the next collective raises
    stop.request("test: a peer faulted")
    time.sleep(0.3)
    result["idle_stop"] = {"aborted": stop.aborted()}
    try:
        stop.commit_point("test")
        result["idle_stop"]["commit"] = "passed"
    except CollectiveStopped:
        result["idle_stop"]["commit"] = "refused"
    result["idle_stop"]["whole"] = stop.committed_since(mark)  # (the all-reduce issued after the mark)
    try:
        dist.barrier()
        result["idle_stop"]["next"] = "returned"
    except CollectiveStopped:
        result["idle_stop"]["next"] = "raised"
    stop.clear()
    dist.barrier()
    if rank == WORLD - 1:
        time.sleep(30)
        os._exit(0)
    seen = {}

    def watch():
        time.sleep(0.6)
        seen["waiting"] = stop.in_flight.waiting()
        stop.request("test: rank 3 hung")
        seen["at"] = time.monotonic()
    threading.Thread(target=watch, daemon=True).start()
    waited0 = stop.in_flight.waited_s()
    mark = stop.commit_mark()
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    result["blocked"] = {"waiting": seen["waiting"], "left_after_stop_s": time.monotonic() - seen["at"],
                         "partial": t.tolist(), "aborted": stop.aborted(), "waited_s": stop.in_flight.waited_s() - waited0}
    try:
        stop.commit_point("test")
        result["blocked"]["commit"] = "passed"
    except CollectiveStopped:
        result["blocked"]["commit"] = "refused"
    try:
        dist.all_reduce(t)
        result["blocked"]["next"] = "returned"
    except CollectiveStopped:
        result["blocked"]["next"] = "raised"
    # After the recovery clears the stop, a commit point passing says nothing of what came before it.
    stop.clear()
    stop.commit_point("test")
    result["blocked"]["whole"] = stop.committed_since(mark)
    _write(out, "stop", rank, result)
    os._exit(0)


def worker_uncovered(rank, port, out):
    """Code no recovery covers (a trainer's loop between its hooked calls). Rank 0 reaches a barrier
    1 s late: ranks stopped before or while they wait finish it with rank 0 (their communicators are
    not aborted within the uncovered grace). Then rank 3 hangs: after the (shortened) uncovered grace
    the abort ends the others' all-reduce, and their next collective is answered alone; in covered
    code the next one raises."""
    import torch
    import torch.distributed as dist

    from mindspeed_ha.comm import PROCESS_STOP as stop, CollectiveStopped

    _init(rank, port)
    _engine()
    dist.barrier()
    result = {"rank": rank}
    stop.set_uncovered(True)
    for what, before in (("stopped_before", True), ("stopped_during", False)):
        if rank == 0:
            time.sleep(1.0)
            dist.barrier()
            continue
        if before:
            stop.request("test: a peer faulted")
        else:
            threading.Timer(0.2, stop.request, ("test: a peer faulted",)).start()
        t0 = time.monotonic()
        dist.barrier()
        time.sleep(0.3)  # (the timer has fired)
        result[what] = [time.monotonic() - t0 - 0.3, stop.aborted()]
        stop.clear()
    dist.barrier()
    if rank == WORLD - 1:
        time.sleep(30)
        os._exit(0)
    stop.uncovered_grace_s = 1.0
    threading.Timer(0.3, stop.request, ("test: rank 3 hung",)).start()
    t0 = time.monotonic()
    dist.all_reduce(torch.ones(4))
    result["hung_peer"] = [time.monotonic() - t0, stop.aborted()]
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)  # answered alone
    result["alone"] = t.tolist()
    stop.set_uncovered(False)
    try:
        dist.all_reduce(t)
        result["covered"] = "returned"
    except CollectiveStopped:
        result["covered"] = "raised"
    _write(out, "uncovered", rank, result)
    # No rank leaves before the others have been aborted too: a peer's exit closes its connections,
    # and a rank whose aborter is still in its grace (a loaded machine) would see its pending
    # collective fail, which torch's default watchdog mode answers by ending the process.
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=60))
    store.set(f"uncovered_done/{rank}", "1")
    store.wait([f"uncovered_done/{r}" for r in range(WORLD - 1)])
    os._exit(0)


def worker_rebuild(rank, port, out):
    """A recovery's rebuild of the stable groups (``groups.reconnect``) on the emulated NCCL: the
    communicators of the new generation are connected in it, none in a collective after it, and each
    replaced one is aborted; torch's own default group (made without a device, as a job's is) is the
    control that connects in its first collective."""
    import torch
    import torch.distributed as dist

    from mindspeed_ha.comm import emulated_nccl, groups

    _engine()
    _init(rank, port)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # (every rank makes every group)
    sub = pairs[rank // 2]
    groups.seal()
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
    result = {"before": [list(x) for x in emulated_nccl.lazy_inits], "sum_before": t.tolist()}
    old_sub = sub._inner
    emulated_nccl.lazy_inits.clear()
    result["reconnect"] = groups.reconnect("127.0.0.1", port, generation=1)
    result["old_sub_aborted"] = bool(old_sub.aborted)
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
    peer = rank ^ 1
    msg = torch.full((3,), float(rank))
    if rank % 2 == 0:
        dist.send(msg, peer)
    else:
        dist.recv(msg, peer)
    result.update(after=[list(x) for x in emulated_nccl.lazy_inits], sum_after=t.tolist(), received=msg.tolist())
    _write(out, "rebuild", rank, result)
    dist.barrier()
    os._exit(0)


# ----------------------------------------------------------------------------------- tests

def _run(mode, tmp_path, env=None, timeout=60, ranks=range(WORLD)):
    """Launch the four workers of ``mode``; return each rank's exit code (None: still running, killed)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MINDSPEED_HA_", "TORCH_NCCL_"))}
    full = dict(base, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                PYTHONPATH=os.path.dirname(HERE) + os.pathsep + base.get("PYTHONPATH", ""), **(env or {}))
    procs = [subprocess.Popen([sys.executable, HERE, mode, str(r), str(store.port), str(tmp_path)], env=full)
             for r in range(WORLD)]
    deadline = time.monotonic() + timeout
    codes = {}
    try:
        for r in ranks:
            try:
                codes[r] = procs[r].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[r] = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


def _read(tmp_path, name, rank):
    return json.load(open(tmp_path / f"{name}_{rank}.json"))


def test_results_equal_gloos_bits(tmp_path):
    """Every collective megatron-core and the engine use, coalesced and point to point included: the
    same bits as on gloo, with and without the engine's wrappers."""
    runs = [("gloo", {}), ("emulated_nccl", {}), ("emulated_nccl", {"TEST_ENGINE": "1"})]
    for backend, env in runs:
        assert _run("equiv", tmp_path, {"TEST_BACKEND": backend, **env}, timeout=90) == {r: 0 for r in range(WORLD)}
    for r in range(WORLD):
        gloo = _read(tmp_path, "equiv_gloo", r)
        assert _read(tmp_path, "equiv_emulated_nccl", r) == gloo
        assert _read(tmp_path, "equiv_emulated_nccl_engine", r) == gloo


@pytest.mark.alone  # (asserts a latency)
def test_returns_at_once_and_an_abort_completes_without_error(tmp_path):
    assert _run("backend", tmp_path) == {r: 0 for r in range(WORLD)}
    for r in range(WORLD - 1):
        res = _read(tmp_path, "backend", r)
        assert res["returned_before_complete"] and res["sum"] == [10.0] * 4, res
        assert 0.4 < res["aborted_after_s"] < 2.0, res
        assert res["partial"] == [float(r + 1)] * 4, res  # this rank's own contribution
        assert "was aborted" in res["after_abort"], res
        assert res["later"] == res["partial"], res  # nothing landed after the abort


@pytest.mark.parametrize("mode,ends", [("3", True), ("2", False)])
def test_the_watchdog_ends_survivors_unless_told_to_clean_up_only(tmp_path, mode, ends):
    codes = _run("watchdog", tmp_path, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": mode}, ranks=range(WORLD - 1))
    if ends:
        assert codes == {r: 134 for r in range(WORLD - 1)}, codes
        return
    assert codes == {r: 0 for r in range(WORLD - 1)}, codes
    for r in range(WORLD - 1):
        assert _read(tmp_path, "watchdog", r)["wait"] == "DistBackendError"


@pytest.mark.alone  # (asserts a latency)
def test_the_engines_stop_aborts_only_what_is_pending_and_the_commit_point_refuses(tmp_path):
    assert _run("stop", tmp_path, ranks=range(WORLD - 1)) == {r: 0 for r in range(WORLD - 1)}
    for r in range(WORLD - 1):
        res = _read(tmp_path, "stop", r)
        assert res["idle_stop"] == {"aborted": False, "commit": "passed", "next": "raised", "whole": True}, res
        blocked = res["blocked"]
        assert blocked["waiting"] and blocked["waited_s"] > 0.5, res  # the evidence: waiting for a peer
        assert blocked["left_after_stop_s"] < 1.0 and blocked["aborted"], res
        assert blocked["partial"] == [float(r + 1)] * 4, res
        assert blocked["commit"] == "refused" and blocked["next"] == "raised", res
        assert blocked["whole"] is False, res  # (the partial all-reduce: no commit point passed before the stop)


def test_uncovered_code_finishes_what_its_peers_passed_and_is_answered_alone_after_an_abort(tmp_path):
    assert _run("uncovered", tmp_path, ranks=range(WORLD - 1)) == {r: 0 for r in range(WORLD - 1)}
    for r in range(1, WORLD - 1):
        res = _read(tmp_path, "uncovered", r)
        for what in ("stopped_before", "stopped_during"):
            assert res[what][0] > 0.5 and res[what][1] is False, res  # waited for rank 0, not aborted
    for r in range(WORLD - 1):
        res = _read(tmp_path, "uncovered", r)
        assert 1.0 < res["hung_peer"][0] < 3.0 and res["hung_peer"][1], res
        assert res["alone"] == [float(r + 1)] * 2 and res["covered"] == "raised", res


# ----------------------------------------------------------------------------------- whole jobs

def _drill_job(log_dir, inject, extra=(), env=None):
    from helpers import NCCL_SEMANTICS, PRETRAIN, TINY, TINY_ITERS, clean_env
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", "4", PRETRAIN, *TINY,
           "--train-iters", str(TINY_ITERS), "--enable-hbmfault-repair", "--enable-worker-reboot",
           "--ha-verify-replicas-interval", "1", "--ha-log-dir", str(log_dir), *extra]
    return subprocess.run(cmd, env=clean_env({**NCCL_SEMANTICS, "MINDSPEED_HA_INJECT": inject, **(env or {})}),
                          capture_output=True, text=True, timeout=300, cwd=str(log_dir))


# Rank 1 hangs as its update begins (alive, heartbeating): rank 0, its partner in the optimizer
# instance, blocks in the grad-norm all-reduce until the controller names the hang; the stop then
# aborts that all-reduce, which returns rank 0's own sum of squares as the norm, and no error.
HUNG_IN_THE_NORM = "hang:rank=1:step=5:phase=optimizer"


def test_a_stop_inside_the_grad_norm_all_reduce_leaves_no_wrong_shard(tmp_path, references):
    """Recover replaces the hung rank (and only it: the others said they were waiting for it), rank 0
    stays at iteration 4 (its update refused at the commit point) and takes its shard from its twin,
    and every loss equals the fault-free run's bits; the twins agree after every step."""
    from helpers import all_rank_events, assert_ok, events, losses, twins_agree
    proc = _drill_job(tmp_path, HUNG_IN_THE_NORM, ("--ha-hang-timeout", "3"))
    assert_ok(proc)
    assert losses(tmp_path) == references.tiny("dp4")
    faults = [(e["kind"], e["ranks"]) for e in events(tmp_path, "controller") if e["event"] == "fault"]
    assert faults == [("hang", [1])], faults
    rec = [e for e in events(tmp_path, "controller") if e["event"] == "recovered"]
    assert [(e["strategy"], e["iteration"]) for e in rec] == [("recover", 5)], rec
    repaired = {e["rank"]: e["sources"] for e in all_rank_events(tmp_path) if e["event"] == "repaired"}
    assert repaired.get(0) == [2] and repaired.get(1) == [3], repaired  # rank 0's update was refused
    twins_agree(tmp_path, rec)


def test_without_the_commit_point_the_same_stop_leaves_a_wrong_shard(tmp_path, references):
    """The same drill with the commit point switched off in every process (a sitecustomize on the
    path): rank 0 updates its shard with the partial norm, its shard claims iteration 5, the recovery
    keeps it, and the next replica check finds it differs from its twin's. (Its premise is the abort
    that completes with partial outputs, never one whose works raise.)"""
    off = tmp_path / "no_commit_point"
    off.mkdir()
    (off / "sitecustomize.py").write_text("import mindspeed_ha.comm.interruptible as ic\n"
                                          "ic.PROCESS_STOP.commit_point = lambda what: None\n")
    proc = _drill_job(tmp_path / "job", HUNG_IN_THE_NORM, ("--ha-hang-timeout", "3"),
                      {"PYTHONPATH": os.pathsep.join(filter(None, [str(off), os.environ.get("PYTHONPATH")])),
                       "MINDSPEED_HA_EMULATE_NCCL_ABORT_RAISES": "0"})
    from helpers import all_rank_events, losses
    assert proc.returncode != 0, proc.stderr[-2000:]
    bad = [e for e in all_rank_events(tmp_path / "job") if e["event"] == "replica_check" and not e["ok"]]
    assert bad and "ranks 0 and 2 hold different optimizer shards" in bad[0]["error"], bad
    got, want = losses(tmp_path / "job"), references.tiny("dp4")
    assert {i: want[i] for i in range(1, 5)} == {i: got[i] for i in range(1, 5)}  # (before the stop: the same)


# Rank 2 ends step 5 and is held at its end (the held drill: a wait on a receive the engine never saw,
# as a host held in a device sync behind a library's own collective); nothing it tracks is pending.
# Rank 1 goes on to step 6 (no replica check after step 5: they run every 2nd step here, and each is a
# world collective) and meets a memory error there — seconds later (a slow step first): a rank 2 that
# still waited for step 5's last collective to land when the stop came would have it aborted by the
# stop's first rule (pending), not held.
HELD_UNTRACKED = ("held:rank=2:step=5:phase=step-end,slow:rank=1:step=6:factor=30,uce:rank=1:step=6:phase=forward,"
                  "slow:rank=1:step=7:factor=1")
HELD_FLAGS = ("--ha-verify-replicas-interval", "2")


def test_a_rank_held_behind_a_collective_the_engine_never_saw_is_freed_by_the_backstop_abort(tmp_path, references):
    """The stop finds nothing pending on rank 2, so its grace aborts nothing; the backstop does, once
    rank 2 has not reached the recovery: its wait ends, it joins the retry, and every loss is the
    fault-free run's bits, nobody restarted, the twins equal."""
    from helpers import all_rank_events, assert_ok, events, losses, twins_agree
    proc = _drill_job(tmp_path, HELD_UNTRACKED, HELD_FLAGS)
    assert_ok(proc)
    assert losses(tmp_path) == references.tiny("dp4")
    assert sorted(e["rank"] for e in all_rank_events(tmp_path) if e["event"] == "start") == [0, 1, 2, 3]
    rec = [e for e in events(tmp_path, "controller") if e["event"] == "recovered"]
    assert [(e["strategy"], [f["ranks"] for f in e["faults"]]) for e in rec] == [("retry", [[1]])], rec
    assert "stop: the training thread had not reached the recovery (held on the device?)" in proc.stderr
    twins_agree(tmp_path, rec)


def test_without_the_backstop_the_held_rank_never_answers_and_the_controller_says_where_it_is(tmp_path):
    """The same drill with the backstop switched off (a sitecustomize): rank 2 never takes the
    controller's order; after HELD_REPORT_S its processor reports where its training thread is, and
    the failed retry's reason names the drill's frame and the stop's state (no abort). The dump
    follows, without rank 2."""
    from helpers import events
    off = tmp_path / "no_backstop"
    off.mkdir()
    (off / "sitecustomize.py").write_text("import mindspeed_ha.comm.interruptible as ic\n"
                                          "ic.PROCESS_STOP.backstop_s = 1e9\n")
    proc = _drill_job(tmp_path / "job", HELD_UNTRACKED, HELD_FLAGS, env={
        "PYTHONPATH": os.pathsep.join(filter(None, [str(off), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode != 0, proc.stderr[-2000:]
    failed = [e["reason"] for e in events(tmp_path / "job", "controller") if e["event"] == "strategy_failed"]
    assert failed and failed[0].startswith("status failed (rank 2: no answer (the training thread has not taken "
                                           "the controller's order for "), failed
    assert "<- hold_on_untracked (inject.py:" in failed[0] and "no communicator aborted" in failed[0], failed
    held = [e for e in events(tmp_path / "job", "rank_2") if e["event"] == "held"]
    assert held and "hold_on_untracked" in held[0]["detail"], held


# Rank 1 meets a memory error as the gradients are to be reduced, half a second late (a slow step
# first): by then every survivor waits on the device in a grad-sync collective of a later group than
# the world's — rank 0 in its optimizer instance's reduce-scatter (with rank 1), ranks 2 and 3 in
# the all-reduce across instances — the world group, registered first, idle.
HELD_IN_A_LATER_GROUP = ("slow:rank=1:step=4:phase=grad-sync:factor=6,uce:rank=1:step=4:phase=grad-sync,"
                         "slow:rank=1:step=5:factor=1")
RETRY_ONLY = ("--enable-hbmfault-repair", "--ha-verify-replicas-interval", "1")


def _job(log_dir, inject, flags, env=None):
    from helpers import NCCL_SEMANTICS, PRETRAIN, TINY, TINY_ITERS, clean_env
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", "4", PRETRAIN, *TINY,
           "--train-iters", str(TINY_ITERS), "--ha-log-dir", str(log_dir), *flags]
    return subprocess.run(cmd, env=clean_env({**NCCL_SEMANTICS, "MINDSPEED_HA_INJECT": inject, **(env or {})}),
                          capture_output=True, text=True, timeout=300, cwd=str(log_dir))


def _site(tmp_path, name, code):
    """A sitecustomize on the workers' path: a control that switches one piece of the engine off."""
    d = tmp_path / name
    d.mkdir()
    (d / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(d), os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("aborted_works", ["complete", "raise"])
def test_the_stop_aborts_the_communicators_holding_a_collective_and_leaves_the_idle_world_group(tmp_path, references,
                                                                                                 aborted_works):
    """On the backend whose abort waits for the device to go idle, as NCCL's does: the stop aborts
    the survivors' communicators that hold a collective (the grad-sync groups), at once, each on its own
    thread, and does not touch the idle world group (the rebuild keeps it); every survivor leaves its
    collective, the retry repairs rank 1 in place, and every loss is the fault-free run's bits. Each
    rank's stop line times each communicator, and the recovery's phases carry the abort. ``raise``: the aborted
    collectives fail under their waits (DistBackendError, as torch's can) instead of completing with
    partial outputs: that is each survivor's stop, none is reported as faulted."""
    from helpers import all_rank_events, assert_ok, events, losses, twins_agree
    raises = {"MINDSPEED_HA_EMULATE_NCCL_ABORT_RAISES": "1"} if aborted_works == "raise" else {}
    proc = _job(tmp_path, HELD_IN_A_LATER_GROUP, RETRY_ONLY, raises)
    assert_ok(proc)
    assert losses(tmp_path) == references.tiny("dp4")
    rec = [e for e in events(tmp_path, "controller") if e["event"] == "recovered"]
    assert [(e["strategy"], [f["ranks"] for f in e["faults"]]) for e in rec] == [("retry", [[1]])], rec
    assert 0 < rec[0]["phases"]["abort"] < 2.0, rec[0]["phases"]
    stops = [line for line in proc.stderr.splitlines() if "communicator(s) aborted at once in" in line]
    assert sorted(line.split("[rank ")[1][0] for line in stops) == ["0", "2", "3"], stops
    assert all("1 communicator(s) aborted" in line and "default_pg " not in line for line in stops), stops
    kept = [e for e in all_rank_events(tmp_path) if e["event"] == "rebuilt" and [0, 1, 2, 3] in e["kept"]]
    assert sorted(e["rank"] for e in kept) == [0, 1, 2, 3], kept
    twins_agree(tmp_path, rec)


# The abort the engine once made: every group's (the idle ones too), each after the last one's
# returned, in torch's order (the world group first), bounded by the same deadline so that the drill ends.
SERIAL_ABORTS = """import threading
import mindspeed_ha.comm.abort as abort
import mindspeed_ha.comm.stop as stop
stop.InFlight.groups_to_abort = lambda self: None
def one_after_another(communicators, deadline_s=abort.DEADLINE_S):
    communicators = list(communicators)
    def run():
        for name, comm in communicators:
            comm.abort()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline_s)
    return abort.AbortReport({name: None for name, _ in communicators}, {}, deadline_s, deadline_s)
abort.abort_all = one_after_another
"""


def test_aborted_one_after_another_the_same_survivors_stay_held_and_report_it(tmp_path):
    """The control: the same drill with every group's abort, the idle world group's first, made one
    after another (a sitecustomize). Each survivor's world abort waits for the device, which its
    grad-sync collective keeps busy: no
    survivor reaches the recovery, and each reports itself held at the deadline. Retry does not
    replace ranks: the dump follows, and has no one to write rank 1's shard (its twin, rank 3, is
    held): refused, and the job ends naming the checkpoint to resume from (none here)."""
    from helpers import events
    proc = _job(tmp_path / "job", HELD_IN_A_LATER_GROUP, RETRY_ONLY, _site(tmp_path, "serial", SERIAL_ABORTS))
    assert proc.returncode != 0, proc.stderr[-2000:]
    faults = [e for e in events(tmp_path / "job", "controller") if e["event"] == "fault"]
    held = sorted(f["ranks"][0] for f in faults if f["kind"] == "hang")
    assert held == [0, 2, 3], faults
    assert all("has not reached the recovery" in f["detail"] for f in faults if f["kind"] == "hang"), faults
    refused = [e for e in events(tmp_path / "job", "controller") if e["event"] == "dump_refused"]
    assert refused and "no periodic checkpoint exists to fall back on" in refused[0]["message"], refused


# The drill of an abort that never frees its host: rank 2's aborts block for good (its first process).
HOLD_RANK_2 = {"MINDSPEED_HA_EMULATE_NCCL_HOLD": "2"}


def test_a_survivor_its_abort_never_frees_is_replaced_from_its_twin(tmp_path, references):
    """Rank 2's aborts never return and free nothing: at the stop's deadline it reports itself held
    (a hang), the recovery starts over with that fault, and recover restarts rank 2, which takes its
    shard from its twin, while rank 1 is repaired in place: every loss is the fault-free run's bits,
    within the deadline plus 10 s of the memory error."""
    from helpers import all_rank_events, assert_ok, events, losses, twins_agree
    from mindspeed_ha.comm.abort import DEADLINE_S
    proc = _job(tmp_path, HELD_IN_A_LATER_GROUP, (*RETRY_ONLY, "--enable-worker-reboot"), HOLD_RANK_2)
    assert_ok(proc)
    assert losses(tmp_path) == references.tiny("dp4")
    rec = [e for e in events(tmp_path, "controller") if e["event"] == "recovered"]
    assert [(e["strategy"], [(f["kind"], f["ranks"]) for f in e["faults"]]) for e in rec] == [
        ("recover", [("memory-error", [1]), ("hang", [2])])], rec
    assert rec[0]["mttr_s"] < DEADLINE_S + 10, rec
    starts = sorted(e["rank"] for e in all_rank_events(tmp_path) if e["event"] == "start")
    assert starts == [0, 1, 2, 2, 3], starts  # (rank 2 restarted, no one else)
    repaired = {e["rank"]: e["sources"] for e in all_rank_events(tmp_path) if e["event"] == "repaired"}
    assert repaired.get(1) == [3] and repaired.get(2) == [0], repaired
    assert "had not returned after the 10s deadline" in proc.stderr
    twins_agree(tmp_path, rec)


def test_without_recover_the_survivors_that_are_free_write_the_dump_and_the_held_rank_is_named(tmp_path):
    """The same held rank under retry alone: it is left out as hung, the free survivors (rank 1's
    shard is poisoned: rank 3 writes it, rank 0 writes rank 2's) write the dying-gasp checkpoint,
    and the diagnosis names the held rank and the checkpoint to resume from."""
    from helpers import events
    proc = _job(tmp_path, HELD_IN_A_LATER_GROUP, (*RETRY_ONLY, "--save", str(tmp_path / "ck")), HOLD_RANK_2)
    assert proc.returncode == 1, proc.stderr[-2000:]
    written = [e for e in events(tmp_path, "controller") if e["event"] == "checkpoint"]
    assert [(e["kind"], e["iteration"], e["ranks"]) for e in written] == [("dying_gasp", 3, [0, 3])], written
    text = next(e["text"] for e in events(tmp_path, "controller") if e["event"] == "diagnosis")
    assert "rank 2: hang at iteration 4" in text and f"--load {tmp_path / 'ck'}" in text, text


def test_a_rebuild_connects_its_communicators_and_aborts_the_replaced_ones(tmp_path):
    """``groups.reconnect`` (a recovery's rebuild phase) on NCCL's semantics: every communicator of
    the new generation is initialised inside it, on the rank's device, so none is left to the first
    step after the recovery (where its set-up would count in no phase and no stop could abort it);
    each replaced communicator is aborted before its successor allocates. Torch's own default
    group, made without a device as a job's first one is, connects in its first collective: the
    record that tells the two apart works."""
    assert _run("rebuild", tmp_path) == {r: 0 for r in range(WORLD)}
    for r in range(WORLD):
        res = _read(tmp_path, "rebuild", r)
        assert res["before"] == [["allreduce", r, WORLD]], res  # (the control: torch's own group, lazily)
        assert res["reconnect"]["groups"] == 2 and res["reconnect"]["lazy"] == 0, res  # (the world, its pair)
        assert res["after"] == [], res  # every collective and message after the rebuild: nothing set up late
        assert res["old_sub_aborted"], res
        assert res["sum_before"] == res["sum_after"] == [20.0] * 2, res  # (1+2+3+4, then twice that)
        assert res["received"] == [float(r - r % 2)] * 3, res


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    mode, rank, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    {"equiv": worker_equiv, "backend": worker_backend, "watchdog": worker_watchdog, "stop": worker_stop,
     "uncovered": worker_uncovered, "rebuild": worker_rebuild}[mode](rank, port, out)
