"""The stop as an object (comm/stop.py): its state is its own, so two stops live in one process, and
its rules — the grace, the abort of stream-ordered communicators, the commit points, the held
deadline, the park — hold on each. No process is started; the abort is a recording stand-in for
``comm.abort.abort_registered`` and the works are stand-ins with ``is_completed()``."""
import ast
import os
import time

import pytest

from mindspeed_ha.comm import abort
from mindspeed_ha.comm.stop import CollectiveStopped, Stop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Work:
    """A stream-ordered collective's work as the stop sees it: pending until ``done``."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


class _Communicators:
    """Records each abort; its report names one communicator, aborted in 1 ms."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, deadline_s: float) -> abort.AbortReport:
        self.calls.append(deadline_s)
        return abort.AbortReport({"dp": 0.001}, {}, 0.001, deadline_s)


def _until(cond, timeout=5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def test_two_stops_in_one_process_keep_their_own_state():
    a, b = Stop(), Stop()
    mark_b = b.commit_mark()
    a.request("a's peer faulted")
    assert a.requested() and not b.requested()
    assert a.stops_now() and not b.stops_now()
    with pytest.raises(CollectiveStopped, match="a's peer faulted"):
        a.raise_if_stopped()
    b.raise_if_stopped()  # (b is not stopped: nothing raised)
    b.commit_point("b's update")
    assert b.committed_since(mark_b) and not a.committed_since(a.commit_mark())
    a.set_uncovered(True)
    assert a.uncovered_here() and not b.uncovered_here() and not a.stops_now()
    a.set_uncovered(False)
    a.clear()
    assert not a.requested()


def test_wrappers_bound_to_one_stop_obey_it_and_not_the_other():
    """Two sets of collectives in one process, each built on its own stop (a world of one on gloo):
    stopping one stops its collectives only."""
    import torch
    import torch.distributed as dist

    from mindspeed_ha.comm import interruptible
    a, b = Stop(), Stop()
    reduce_a = interruptible.make_interruptible(dist.all_reduce, a)
    reduce_b = interruptible.make_interruptible(dist.all_reduce, b)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(2)
        reduce_a(t)
        reduce_b(t)
        a.request("test")
        with pytest.raises(CollectiveStopped):
            reduce_a(t)
        reduce_b(t)  # (b's collectives run on)
        assert t.tolist() == [1.0, 1.0]
        a.clear()
        reduce_a(t)
    finally:
        dist.destroy_process_group()


def test_a_stop_with_a_collective_pending_after_the_grace_aborts_and_the_commit_point_refuses():
    comms = _Communicators()
    stop = Stop(abort_communicators=comms)
    stop.grace_s = 0.05
    mark = stop.commit_mark()
    work = _Work()
    stop.in_flight.issued(work)
    stop.request("a peer faulted")
    assert _until(stop.aborted)
    assert comms.calls == [stop.deadline_s]
    with pytest.raises(CollectiveStopped, match="may be partial: a peer faulted"):
        stop.commit_point("the update")
    assert not stop.committed_since(mark)
    assert stop.abort_summary() == {"seconds": 0.001, "unfinished": [], "took": {"dp": 0.001}}
    assert "communicators aborted" in stop.report() and "1 tracked collective(s) pending" in stop.report()
    stop.clear()
    assert not stop.aborted() and stop.abort_summary() is None
    stop.commit_point("the next update")
    assert stop.report() == "no stop in force"


def test_a_stop_with_nothing_pending_aborts_nothing_and_every_result_is_whole():
    comms = _Communicators()
    stop = Stop(abort_communicators=comms)
    stop.grace_s, stop.backstop_s = 0.02, 60.0
    work = _Work()
    stop.in_flight.issued(work)
    mark = stop.commit_mark()
    work.done = True
    stop.request("a peer faulted")
    time.sleep(0.2)
    assert not stop.aborted() and comms.calls == []
    stop.commit_point("the update")
    assert stop.committed_since(mark)
    assert stop.report().endswith("; no communicator aborted")
    stop.clear()


def test_a_training_thread_that_never_reaches_the_recovery_is_reported_held_once():
    """After the abort, the deadline passes with the thread still in its step: the held hooks are
    told why, once. A thread that reached the recovery (awaiting its orders) is not held."""
    held: list[str] = []
    stop = Stop(abort_communicators=_Communicators())
    stop.grace_s, stop.deadline_s = 0.02, 0.2
    stop.add_held_hook(held.append)
    stop.in_flight.issued(_Work())
    stop.request("a peer hung")
    assert _until(lambda: held, timeout=3.0)
    time.sleep(0.2)
    assert len(held) == 1 and held[0].startswith("held: its training thread has not reached the recovery")
    stop.clear()

    held.clear()
    stop.in_flight.issued(_Work())
    stop.request("a peer hung")
    with stop.awaiting_orders():
        time.sleep(0.5)
    assert stop.aborted() and held == []
    stop.left_recovery()
    stop.clear()


def test_a_park_becomes_a_stop_only_if_the_step_boundary_is_not_reached_within_its_grace():
    stop = Stop()
    stop.park.request("migration", grace_s=0.05)
    assert stop.park.take() and not stop.park.take()  # (once; the stop that would follow is called off)
    time.sleep(0.15)
    assert not stop.requested()
    stop.park.request("migration", grace_s=0.05)
    assert _until(stop.requested)
    stop.clear()
    assert not stop.park.take()


def test_a_failure_of_uncovered_code_is_deferred_to_the_next_hooked_call_once():
    stop = Stop()
    first, second = RuntimeError("peer lost"), RuntimeError("later")
    stop.defer(first, "barrier")
    stop.defer(second, "all_reduce")  # (the first failure is the one reported)
    assert stop.deferred is first
    with pytest.raises(RuntimeError, match="peer lost"):
        stop.raise_deferred()
    stop.raise_deferred()  # (once)
    stop.defer(first, "barrier")
    stop.clear()  # (a recovery ran: it covered that failure too)
    assert stop.deferred is None


def test_the_stops_module_keeps_no_state_of_its_own():
    """No lower-case module-level variable and no ``global`` in comm/stop.py: every stop's state is
    its object's."""
    path = os.path.join(ROOT, "mindspeed_ha", "comm", "stop.py")
    tree = ast.parse(open(path).read(), path)
    found = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        found += [t.id for t in targets if isinstance(t, ast.Name) and not t.id.isupper() and not t.id.startswith("__")]
    found += [f"global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    assert found == []

