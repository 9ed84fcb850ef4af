"""The rank's fault loop (rank/fault_loop.py) on a fake processor: raised, reported, orders, served,
resumed — and what it does when the controller goes silent, when the rank stopped itself, when there
is no control plane. No process, no socket: the processor is a stand-in that hands out scripted
orders and records the faults it is told."""
from __future__ import annotations

import types

import pytest

from mindspeed_ha.comm.stop import CollectiveStopped, Stop
from mindspeed_ha.faults import MemoryFault
from mindspeed_ha.options import HAOptions
from mindspeed_ha.rank.fault_loop import FaultLoop
from mindspeed_ha.rank.state import LEFT_COUNTS_MAX_WORLD, RankState


class Processor:
    """Hands out ``orders`` one per ``serve_order`` (None: no order within the timeout)."""

    def __init__(self, orders: list[str | None], recovering: bool = False) -> None:
        self.orders = list(orders)
        self.link = types.SimpleNamespace(recovering=recovering)
        self.faults: list[tuple] = []
        self.served: list[str | None] = []
        self.left: list[dict] = []

    def serve_order(self, timeout: float) -> str | None:
        action = self.orders.pop(0) if self.orders else None
        self.served.append(action)
        return action

    def report_fault(self, kind: str, detail: str, iteration: int, phase: str, entered=None, fault_class="fault",
                     frame="") -> None:
        self.faults.append((kind, iteration, phase))

    def report_left(self, entered: dict) -> None:
        self.left.append(entered)


class Events:
    def emit(self, event: str, **fields) -> None:
        pass


def _loop(orders: list[str | None], order_timeout: float = 60.0, world: int = 4, stop: Stop | None = None,
          **kw) -> tuple[FaultLoop, RankState, Processor]:
    options = HAOptions(strategies=frozenset({"retry"}), order_timeout_s=order_timeout)
    state = RankState(options, types.SimpleNamespace(backend="gloo"), 1, world, 1, Events(), None,  # type: ignore[arg-type]
                      stop or Stop())
    state.processor = processor = Processor(orders, **kw)  # type: ignore[assignment]
    state.phase = "backward"
    return FaultLoop(state), state, processor


def test_a_fault_is_reported_its_orders_served_and_training_resumes():
    loop, state, processor = _loop(["ha-status", "rebuild", "repair", "rollback", "resume"])
    assert loop.recover(MemoryFault("UCE ERROR: injected"), 5) is True
    assert processor.faults == [("memory-error", 5, "backward")]
    assert processor.served == ["ha-status", "rebuild", "repair", "rollback", "resume"]
    assert state.shard_poisoned and not loop.serving and state.stopped_at > 0


def test_a_rank_the_controller_stopped_reports_no_fault_of_its_own():
    loop, state, processor = _loop(["resume"])
    assert loop.recover(CollectiveStopped("collective stopped by request: comm-failure on rank(s) [3]"), 5)
    assert processor.faults == [] and not state.shard_poisoned


def test_a_communication_error_after_this_ranks_abort_is_the_stop_but_its_own_memory_error_is_a_fault():
    """Once the stop aborted this rank's communicators, the error a wait raises there (torch:
    DistBackendError, "... was aborted") is the stop: no fault of this rank is reported. Its own memory
    error at that moment still is."""
    import torch.distributed as dist
    stop = Stop()
    stop.request("rank 3's memory error")
    stop.abort_now(why="test")
    loop, state, processor = _loop(["resume", "resume"], stop=stop)
    attempts = iter([dist.DistBackendError("NCCL communicator was aborted on rank 1"), None])

    def attempt():
        e = next(attempts)
        if e is not None:
            raise e
        return "stepped"
    assert loop.survive(attempt, lambda: 5) == "stepped"
    assert processor.faults == [] and processor.served == ["resume"], processor.faults
    stop.request("again")
    stop.abort_now(why="test")
    assert loop.recover(loop._stop_or(MemoryFault("UCE ERROR: injected")), 6)
    assert processor.faults == [("memory-error", 6, "backward")]


@pytest.mark.parametrize("world,sent", [(4, True), (LEFT_COUNTS_MAX_WORLD + 1, False)])
def test_a_stopped_rank_sends_what_it_issued_for_the_peers_still_waiting_in_small_jobs_only(monkeypatch, world, sent):
    """Its counts go to every other rank: world - 1 orders per survivor, so not above the bound."""
    monkeypatch.setattr("torch.distributed.get_rank", lambda: 1)
    stop = Stop(identify_group=lambda g: ("k-dp", frozenset({0, 1, 2, 3})))
    stop.issued.issue("dp", "all_reduce")
    stop.request("memory-error on rank(s) [3]")
    loop, state, processor = _loop(["resume"], world=world, stop=stop)
    assert loop.recover(CollectiveStopped("collective stopped by request"), 5)
    assert processor.left == ([{"member": 1, "counts": {"k-dp": 1}}] if sent else [])


def test_a_silent_controller_ends_the_wait_after_the_order_timeout_but_a_recovery_under_way_does_not():
    loop, state, processor = _loop([], order_timeout=0.05)
    assert loop.recover(RuntimeError("gloo: connection reset"), 5) is False
    assert processor.faults == [("comm-failure", 5, "backward")]
    # A controller in a recovery (a round waiting out a restart) keeps the rank waiting: its orders come.
    loop, state, processor = _loop([None, None, None, "resume"], order_timeout=0.0001, recovering=True)
    assert loop.recover(RuntimeError("gloo: connection reset"), 5) is True


def test_survive_runs_the_step_again_after_the_recovery_or_takes_what_the_recovery_finished():
    loop, state, processor = _loop(["resume", "resume"])
    attempts = []

    def step():
        attempts.append(1)
        if len(attempts) == 1:
            raise MemoryFault("UCE ERROR: injected")
        return "loss"
    assert loop.survive(step, lambda: 5) == "loss" and len(attempts) == 2
    assert loop.survive(lambda: (_ for _ in ()).throw(MemoryFault("UCE ERROR")), lambda: 6,
                        after_recovery=lambda: "rolled forward") == "rolled forward"


def test_without_a_control_plane_or_with_a_silent_controller_the_fault_is_raised():
    loop, state, _ = _loop([])
    state.processor = None
    with pytest.raises(MemoryFault):
        loop.survive(lambda: (_ for _ in ()).throw(MemoryFault("UCE ERROR")), lambda: 5)


def test_a_restarted_worker_serves_until_the_order_it_waits_for_and_is_no_longer_joining_after_resume():
    loop, state, processor = _loop(["rebuild", "repair", "rollback", "resume"])
    state.joining = True
    loop.join(until=("rebuild",))
    assert processor.served == ["rebuild"] and state.joining
    loop.join(until=("resume",))
    assert processor.served[1:] == ["repair", "rollback", "resume"] and not state.joining
    loop, state, processor = _loop([], order_timeout=0.01)
    with pytest.raises(RuntimeError, match="restarted, but no order from the controller for 0 s"):
        loop.join(until=("resume",))
