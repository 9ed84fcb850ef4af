"""The stop as an object (comm/stop.py): its state is its own, so two stops live in one process, and
its rules — the grace, the abort of stream-ordered communicators, the commit points, the held
deadline, the park — hold on each. No process is started; the abort is a recording stand-in for
``comm.abort.abort_registered`` and the works are stand-ins with ``is_completed()``."""
import ast
import os
import threading
import time

import pytest

from mindspeed_ha.comm import abort
from mindspeed_ha.comm.stop import CollectiveStopped, Stop, as_stop

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

    def __call__(self, deadline_s: float, only: list | None = None) -> abort.AbortReport:
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


def _groups(group):
    """Stand-in for the wrappers' group identity: group "dp" has ranks 0-3, "tp" ranks 0 and 4."""
    return {"dp": ("k-dp", frozenset({0, 1, 2, 3})), "tp": ("k-tp", frozenset({0, 4}))}[group]


def test_a_collective_a_faulted_rank_never_entered_is_left_at_once_and_one_it_entered_waits_its_grace():
    stop = Stop(identify_group=_groups)
    stop.grace_s = 30.0  # (far longer than the test: only never_entered can end a wait)
    issued = [stop.issued.issue("dp", "all_reduce") for _ in range(3)]
    broadcast = stop.issued.issue("dp", "broadcast")   # counted, but a broadcast completes without every member
    tp = stop.issued.issue("tp", "all_gather_into_tensor")
    assert [t[1] for t in issued] == [1, 2, 3] and broadcast is None and tp == ("k-tp", 1, frozenset({0, 4}))
    # Rank 2 faulted having issued two collectives of dp, none of tp (it is not a member).
    stop.request("memory-error on rank(s) [2]", entered={"2": {"member": 2, "counts": {"k-dp": 2}}})
    now = time.monotonic()
    assert [stop.grace_over(now, t) for t in issued] == [False, False, True]
    assert not stop.grace_over(now, tp) and not stop.grace_over(now, None)
    # A second faulted rank's counts join the first's while the stop is in force.
    stop.request("comm-failure on rank(s) [4]", entered={"4": {"member": 4, "counts": {}}})
    assert stop.grace_over(now, tp) and stop.never_entered(tp) == [4]
    with pytest.raises(CollectiveStopped, match=r"never entered by rank\(s\) \[2\]") as left:
        stop.raise_stopped(issued[2])
    assert left.value.never_entered == [2]
    stop.clear()
    assert not stop.never_entered(issued[2])


def test_a_peer_stopped_elsewhere_ends_the_wait_in_a_collective_it_never_entered():
    """Two survivors: rank 1 left a collective of a group with the faulted rank, rank 0 waits in one
    of a group without it (dp: ranks 0-3) (its peer, rank 1, never entered it: rank 1's final counts, taken from its
    ``Issued.now()`` once it left, say so). Rank 0 leaves at once, not after the grace; a collective
    rank 1 entered still waits out its grace."""
    survivor, waiting = Stop(identify_group=_groups), Stop(identify_group=_groups)
    waiting.grace_s = 30.0
    for stop in (survivor, waiting):
        stop.issued.issue("dp", "all_reduce")
    entered_by_both = waiting.issued.issue("dp", "all_reduce")
    survivor.issued.issue("dp", "all_reduce")
    pending = waiting.issued.issue("dp", "all_reduce")   # rank 1 never issues this one
    for stop in (survivor, waiting):
        stop.request("memory-error on rank(s) [4]", entered={"4": {"member": 4, "counts": {}}})
    assert survivor.issued.freeze() is None  # (the stop froze them; its final counts are read as they stand)
    now = time.monotonic()
    assert not waiting.grace_over(now, pending) and not waiting.never_entered(pending)
    waiting.entered.take({"1": {"member": 1, "counts": survivor.issued.now()}})  # (the controller's order)
    assert waiting.never_entered(pending) == [1] and waiting.grace_over(now, pending)
    assert not waiting.grace_over(now, entered_by_both)


def test_counts_align_only_from_a_resume_to_the_next_stop_or_fault():
    """A stop leaves collectives counted here and never issued elsewhere: counts sent after it are
    not sent at all, and a stop that comes while this rank's counts are not aligned compares nothing;
    a resume starts them again, from one."""
    stop = Stop(identify_group=_groups)
    stop.grace_s = 30.0
    stop.issued.issue("dp", "all_reduce")
    assert stop.issued.freeze() == {"k-dp": 1}  # (this rank's own fault report: aligned once)
    assert stop.issued.freeze() is None
    late = stop.issued.issue("dp", "all_reduce")
    stop.request("a peer faulted", entered={"2": {"member": 2, "counts": {"k-dp": 0}}})
    assert not stop.never_entered(late)  # (this rank's counts were not aligned when the stop came)
    stop.clear()
    stop.issued.restart()
    assert stop.issued.issue("dp", "all_reduce")[1] == 1
    stop.request("a peer faulted", entered={"2": {"member": 2, "counts": {"k-dp": 0}}})
    assert stop.never_entered(("k-dp", 1, frozenset({0, 1, 2, 3})))
    assert stop.issued.freeze() is None  # (a stop ends the alignment too)
    stop.clear()
    assert Stop().issued.issue("dp", "all_reduce") is None  # (no identity: nothing counted)


def test_a_stream_ordered_stop_aborts_at_once_when_no_pending_collective_can_complete():
    comms = _Communicators()
    stop = Stop(abort_communicators=comms, identify_group=_groups)
    stop.grace_s, stop.backstop_s = 30.0, 60.0
    stop.in_flight.issued(_Work(), stop.issued.issue("dp", "all_reduce"))
    stop.request("memory-error on rank(s) [1]", entered={"1": {"member": 1, "counts": {}}})
    assert _until(stop.aborted, timeout=2.0)
    assert comms.calls == [stop.deadline_s]
    with pytest.raises(CollectiveStopped) as refused:
        stop.commit_point("the update")
    assert refused.value.never_entered == [1]
    stop.clear()
    # One pending collective the faulted rank entered: the grace is waited for it.
    other = Stop(abort_communicators=comms, identify_group=_groups)
    other.grace_s, other.backstop_s = 30.0, 60.0
    other.in_flight.issued(_Work(), other.issued.issue("dp", "all_reduce"))
    other.in_flight.issued(_Work(), other.issued.issue("dp", "all_reduce"))
    other.request("memory-error on rank(s) [1]", entered={"1": {"member": 1, "counts": {"k-dp": 1}}})
    time.sleep(0.3)
    assert not other.aborted()
    other.clear()


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


class _MutexWork(_Work):
    """A work whose completion check, once its communicator's abort began, waits for that abort to
    return (torch's ``WorkNCCL::isCompleted`` takes the mutex ``NCCLComm::abort`` holds): here, for good."""

    def __init__(self, abort_began) -> None:
        super().__init__()
        self.abort_began = abort_began
        self.asked_after_abort = 0

    def is_completed(self) -> bool:
        if self.abort_began.is_set():
            self.asked_after_abort += 1
            threading.Event().wait()  # (held: the abort never returns)
        return self.done


def test_the_held_path_never_asks_a_communicator_whether_a_work_completed():
    """An abort that never returns (NCCL's held in its host code, holding the communicator's mutex): the
    held hooks are still told at the deadline, and the stop's report says what was pending as the abort
    began — nothing asks a work whether it completed once the abort began, from any thread."""
    began = threading.Event()

    def stuck_abort(deadline_s: float, only: list | None = None):
        began.set()
        threading.Event().wait(deadline_s)  # (returns at the deadline, as comm.abort does, without a report)
        return None

    held: list[str] = []
    stop = Stop(abort_communicators=stuck_abort)
    stop.grace_s, stop.deadline_s = 0.02, 0.3
    stop.add_held_hook(held.append)
    works = [_MutexWork(began), _MutexWork(began)]
    for w in works:
        stop.in_flight.issued(w)
    stop.request("a peer faulted")
    assert _until(lambda: held, timeout=5.0), "the held hooks were never told"
    report = stop.report()
    assert "2 tracked collective(s) pending as the abort began" in report, report
    assert stop.in_flight.pending() and stop.in_flight.pending_count() == 2
    assert [w.asked_after_abort for w in works] == [0, 0]
    assert not os.popen("true").close()  # (the process is not frozen: a fork and wait still run)
    stop.clear()
    assert stop.in_flight.pending_count() == 0 and stop.report() == "no stop in force"


def test_whatever_a_wait_raises_once_the_abort_began_is_the_stop():
    """torch raises ``DistBackendError`` from a wait on an aborted communicator (or rethrows its
    watchdog's error): once this rank's stop has aborted, that is the stop, not a new fault; before
    it, the error is what it says."""
    import torch.distributed as dist
    stop = Stop(abort_communicators=_Communicators())
    error = dist.DistBackendError("NCCL communicator was aborted on rank 2")
    assert as_stop(stop, error) is error  # (no stop: a real failure)
    stop.request("rank 1's memory error")
    assert as_stop(stop, error) is error  # (stopped, nothing aborted yet)
    stop.abort_now(why="test")
    stopped = as_stop(stop, error)
    assert isinstance(stopped, CollectiveStopped) and stopped.__cause__ is error
    assert "this rank's stop aborted its communicators (DistBackendError: NCCL communicator was aborted" in str(stopped)
    again = CollectiveStopped("left")
    assert as_stop(stop, again) is again
    stop.clear()
    assert as_stop(stop, error) is error


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



class _Events:
    """Stands in for ``torch.cuda``'s events as ``EventWaits`` uses them (record, query, elapsed_time),
    counting each event made and each released: what the pool must keep off a stop's path."""

    def __init__(self) -> None:
        self.made = self.released = 0
        self.done = True
        events = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                events.made += 1

            def record(self) -> None:
                pass

            def query(self) -> bool:
                return events.done

            def elapsed_time(self, other) -> float:
                return 2.0

            def __del__(self) -> None:
                events.released += 1
        self.Event = Event


def test_the_wait_evidence_on_a_gpu_never_makes_or_releases_an_event_once_its_pool_is_made():
    """``cudaEventDestroy`` can block while NCCL's kernels hold the device: the waits' events come from
    a pool made with the first wait and go back to it when read, none released, however many waits."""
    from mindspeed_ha.device.waits import EventWaits
    events = _Events()
    waits = EventWaits(events)
    for _ in range(1000):
        waits.end(waits.begin())
    assert waits.waited_s() == pytest.approx(1000 * 2e-3)
    events.done = False  # (held: the waits stay open, read again and again as a stop's report would)
    for _ in range(10):
        waits.end(waits.begin())
    assert waits.pending()
    assert events.made == waits.made() == EventWaits.POOL and events.released == 0
