"""``comm.abort.abort_all``: every communicator's abort at once, under one deadline — on stand-ins
whose abort waits as NCCL's reclaim does (until no other communicator that is not aborted has a
collective in flight), in one process, in milliseconds."""
from __future__ import annotations

import threading
import time

from mindspeed_ha.comm import abort


class Reclaiming:
    """A communicator whose abort sets its flag, then waits until every other one of the same
    "device" that holds a collective is aborted too (``ncclCommAbort``'s free of device memory)."""

    def __init__(self, device: list, busy: bool):
        self.device, self.busy, self.aborted = device, busy, False
        device.append(self)

    def abort(self) -> None:
        self.aborted = True
        while any(c.busy and not c.aborted for c in self.device if c is not self):
            time.sleep(0.001)


class Stuck:
    def __init__(self):
        self.release = threading.Event()

    def abort(self) -> None:
        self.release.wait()


class Failing:
    def abort(self) -> None:
        raise RuntimeError("torn down already")


def test_at_once_an_idle_communicator_registered_first_does_not_wait_for_the_one_that_holds_a_collective():
    device: list = []
    idle, stuck = Reclaiming(device, busy=False), Reclaiming(device, busy=True)
    report = abort.abort_all([("idle", idle), ("stuck", stuck)], deadline_s=5.0)
    assert idle.aborted and stuck.aborted
    assert report.unfinished == [] and report.failed == {} and report.seconds < 1.0, report
    assert set(report.took) == {"idle", "stuck"} and all(t is not None for t in report.took.values())
    assert report.line().startswith("2 communicator(s) aborted at once in ")


def test_one_after_another_the_idle_ones_abort_never_returns():
    """The control: what the serial loop does on the same stand-ins (bounded here by a thread)."""
    device: list = []
    idle, stuck = Reclaiming(device, busy=False), Reclaiming(device, busy=True)

    def serial():
        for comm in (idle, stuck):
            comm.abort()
    t = threading.Thread(target=serial, daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive() and not stuck.aborted
    stuck.aborted = True  # (lets the stand-in's thread end)
    t.join(1.0)


def test_an_abort_that_does_not_return_by_the_deadline_is_named_and_left_on_its_thread():
    held = Stuck()
    t0 = time.monotonic()
    report = abort.abort_all([("world", Reclaiming([], busy=False)), ("dp", held), ("tp", Failing())],
                             deadline_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 1.0
    assert report.unfinished == ["dp"] and report.took["dp"] is None and report.took["world"] is not None
    assert report.failed == {"tp": "RuntimeError: torn down already"}
    line = report.line()
    assert "1 had not returned after the 0.3s deadline: dp" in line and "1 raised: tp" in line, line
    assert report.to_wire()["unfinished"] == ["dp"]
    held.release.set()  # (its thread ends; the report it gave is unchanged)
    time.sleep(0.05)
    assert report.took["dp"] is None


def test_names_are_unique_in_the_report():
    report = abort.abort_all([("dp", Reclaiming([], False)), ("dp", Reclaiming([], False))], deadline_s=1.0)
    assert sorted(report.took) == ["dp", "dp#2"]
