"""The controller's ledger of faults: each fault once, the ones the current recovery deals with, and
the reports already settled.

A fault is found several ways at once (a rank's report, its agent's exit report, its peers' broken
links, its silence), and a rank's link re-sends a report until it hears that a recovery settled it
— possibly from a later controller. So a fault is keyed (``first_time``), a report that a recovery
dealt with is remembered by its id (``settled``, handed on to a standby), and a standby keeps what
it was told (``deferred``) for the moment it takes over.
"""
from __future__ import annotations

import time
from typing import Any, Hashable, Iterable, TypedDict

# The kind of a planned episode's fault that grows the job (nothing failed: newcomers registered).
KIND_SCALE_OUT = "scale-out"


class Fault(TypedDict):
    ranks: list[int]
    kind: str           # process-exit, heartbeat-lost, hang, uce, migrate, scale-out, preempted ...
    iteration: int
    phase: str
    rid: str | None     # the report's id (a rank's or agent's): settled once its recovery is done
    detect_s: float     # from the fault to its detection, where the reporter timed it
    detail: str
    time: float         # wall clock, for people
    nodes: list[str]
    t_detect: float     # monotonic: when the controller learnt of it (MTTR counts from here)
    cpu_detect: float   # the controller thread's CPU time then (decisions measured without waits)
    entered: dict[str, Any] | None  # a reporting rank's counts of the collectives it issued, by group (for the stop)
    fault_class: str    # software (an error of the job's own code) or fault (faults.fault_class)
    frame: str          # where a rank's report says it was raised, in the job's own code ("" if none)


# What a fault's event and status carry (the clocks and the counts are the controller's own business).
PRIVATE = ("time", "t_detect", "cpu_detect", "entered")


def record(ranks: Iterable[int], kind: str, iteration: int, phase: str, nodes: list[str], detect_s: float = 0.0,
           detail: str = "", rid: str | None = None, t_detect: float | None = None,
           entered: dict[str, Any] | None = None, fault_class: str = "fault", frame: str = "") -> Fault:
    return Fault(ranks=list(ranks), kind=kind, iteration=int(iteration), phase=phase, rid=rid,
                 detect_s=round(detect_s, 4), detail=detail, time=time.time(), nodes=nodes,
                 t_detect=time.monotonic() if t_detect is None else t_detect, cpu_detect=time.thread_time(),
                 entered=entered, fault_class=fault_class, frame=frame)


def public(f: Fault) -> dict[str, Any]:
    return {k: v for k, v in f.items() if k not in PRIVATE}


class FaultLedger:
    def __init__(self, settled: Iterable[str] = ()):
        self.all: list[Fault] = []       # every fault, for status and the diagnosis
        self.active: list[Fault] = []    # the faults of the recovery under way (or about to start)
        self.settled: set[str] = set(settled)
        self.deferred: list[Fault] = []  # told to a standby, handled when it takes over
        self._keys: set[Hashable] = set()

    def first_time(self, key: Hashable) -> bool:
        """False for a fault already recorded under ``key`` (found again another way)."""
        if key in self._keys:
            return False
        self._keys.add(key)
        return True

    def add(self, f: Fault) -> None:
        self.all.append(f)
        self.active.append(f)

    def open_planned(self, f: Fault) -> None:
        """A planned change (a scale-out) the next recovery carries out: in the episode, not a fault of
        the job (neither in ``all`` nor in the diagnosis)."""
        self.active.append(f)

    def close_planned(self, kind: str) -> None:
        """The episode drops its planned changes of ``kind`` (a fault came first: its recovery runs,
        and the change is asked for again after it)."""
        self.active[:] = [f for f in self.active if f["kind"] != kind]

    def close_active(self) -> list[Fault]:
        """The episode is over (recovered, or abandoned): its faults leave the active list, returned."""
        closed = list(self.active)
        self.active.clear()
        return closed

    def under_way(self, kind: str) -> bool:
        """The episode under way (or about to start) deals with a fault or change of ``kind``."""
        return any(f["kind"] == kind for f in self.active)

    def of_kind(self, *kinds: str) -> bool:
        """The recovery under way deals with faults of these kinds only (and with some)."""
        return bool(self.active) and all(f["kind"] in kinds for f in self.active)

    def settle_active(self) -> list[str]:
        """The recovery under way is done: its reports are settled. Returns their ids."""
        rids = [f["rid"] for f in self.active if f["rid"]]
        self.settled.update(rids)
        return rids

    def take_deferred(self) -> list[Fault]:
        deferred, self.deferred = self.deferred, []
        return deferred
