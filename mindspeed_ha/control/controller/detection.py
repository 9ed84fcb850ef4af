"""Faults, however they are found: a rank's own report, its agent's, a silence, a hang, ranks out of
step (a desync). Each is recorded once (the fault ledger), a lost rank is marked dead where it is, and
the state machine is fed FAULT once for what one scan finds.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Hashable

from ...events import EventLog, get_logger
from ...options import HAOptions
from ..policy import desync, ledger
from ..policy.ledger import FaultLedger
from ..policy.ranks import RankTable
from ..policy.states import Outcome as O, State as S
from ..wire.router import Router
from .orders import Orders
from .ports import ControllerPort
from .restarts import Restarts

if TYPE_CHECKING:
    from .recovery import Recovery

log = get_logger("control.controller")
LOST = ("process-exit", "heartbeat-lost", "controller-lost", "node-lost")  # the rank's process is gone


class Detection:
    def __init__(self, port: ControllerPort, options: HAOptions, table: RankTable, ledger: FaultLedger,
                 orders: Orders, restarts: Restarts, recovery: Recovery, router: Router, events: EventLog,
                 publish: Callable[[], None]):
        self.port, self.options, self.table, self.ledger = port, options, table, ledger
        self.orders, self.restarts, self.recovery, self.router, self.events = orders, restarts, recovery, router, events
        self.publish = publish  # the metrics' live ranks, newest iteration and checkpoint, now

    def fault(self, ranks: list[int], kind: str, iteration: int, phase: str, detect_s: float = 0.0,
              detail: str = "", key: Hashable = None, rid: str | None = None, feed: bool = True,
              entered: dict[str, Any] | None = None, fault_class: str = "fault", frame: str = "") -> bool:
        """A fault, however it was found: recorded once, and fed to the state machine (``feed``: at
        once; else the caller feeds it, with others found together). True: recorded as a new fault.
        ``entered``: a reporting rank's counts of the collectives it issued (the survivors' stop);
        ``fault_class`` and ``frame``: a rank's own report says them (``faults.fault_class``)."""
        if not self.ledger.first_time(key or (kind, tuple(ranks), iteration)):
            return False
        if rid is not None and rid in self.ledger.settled:
            self.router.drops.drop("settled", f"rank(s) {list(ranks)} {kind} at iteration {iteration} ({rid})")
            self.events.emit("settled_fault", ranks=list(ranks), kind=kind, iteration=iteration, rid=rid)
            log.info("rank(s) %s: %s at iteration %s was re-sent (report %s), but a recovery already dealt with "
                     "it: ignored", list(ranks), kind, iteration, rid)
            return False
        ranks_ = self.table.ranks
        f = ledger.record(ranks, kind, iteration, phase, [ranks_[r].node if r in ranks_ else "?" for r in ranks],
                          detect_s=detect_s, detail=detail, rid=rid, entered=entered, fault_class=fault_class,
                          frame=frame)
        if self.port.standby:
            self.ledger.deferred.append(f)
            return False
        state = self.port.state
        if state == S.INIT:  # the job was not whole yet: who never registered must be found too
            self.table.expect_all(time.monotonic())
        if state == S.NORMAL:  # close the last recovery first, where its first step was awaited
            self.recovery.close_by_fault(iteration, detect_s)
        if kind in LOST:
            self.table.mark_dead(ranks)
            self.restarts.lost(ranks, iteration, kind)
            self.orders.excuse(ranks)  # a dead rank owes no answers (nor its successor)
            self.publish()  # a scrape during the recovery that follows counts them out already
        self.ledger.add(f)
        self.events.emit("fault", **ledger.public(f))
        log.error("fault: rank(s) %s %s at iteration %s, phase %s (%s), detected in %.3fs",
                  ranks, kind, iteration, phase, detail or "-", detect_s)
        if feed and self.port.state != S.DONE:
            self.port.feed(O.FAULT)
        return True

    def scan(self, now: float) -> None:
        """Silences, hangs and desyncs, found by the clock."""
        self.publish()
        state = self.port.state
        if state in (S.INIT, S.EXIT, S.DONE):
            return
        # What one scan finds (every rank silent past the loss limit, a hang) is fed to the state
        # machine once: the survivors are stopped once, not once per lost rank — at 16,384 ranks a
        # stop to every survivor for each of a thousand silent ranks kept the controller from reading
        # the heartbeats of the others, and they went "silent" too.
        found = [d for d in self.table.scan(now, training=state == S.NORMAL)
                 if self.fault(d.ranks, d.kind, d.iteration, d.phase, detect_s=d.detect_s, detail=d.detail,
                               key=d.key, feed=False)]
        desynced = not found and state == S.NORMAL and self.options.desync_after_s > 0 and self._desync()
        if found or desynced:  # (fault() fed nothing: the state is as it was)
            self.port.feed(O.FAULT)

    def _desync(self) -> bool:
        """Every live rank has waited in its collectives past --ha-desync-after and their counts say some
        group's members cannot match (policy/desync.py): a hang of the ranks out of step, named now
        rather than at the hang timeout. True: recorded as a fault (fed by the caller)."""
        ranks = self.table.ranks
        reports = {r: i.desync for r, i in ranks.items() if i.desync}
        if not reports:  # (as nearly always: no rank waited that long; the rest is the job's size again)
            return False
        live = {r for r in self.table.live() if not ranks[r].done}
        found = desync.find({r: d for r, d in reports.items() if r in live}, live)
        if found is None:
            return False
        first = ranks[found.out_of_step[0]]
        waited = min(float(ranks[r].desync.get("waited_s", 0) or 0) for r in live)  # type: ignore[union-attr]
        if not self.fault(found.out_of_step, "hang", first.it, first.phase, detect_s=waited, detail=found.text(),
                          key=("desync", tuple(found.out_of_step), first.it), feed=False):
            return False
        self.events.emit("desync", group=found.group, out_of_step=found.out_of_step, iteration=first.it,
                         collectives={str(r): list(c) for r, c in found.collectives.items()}, waited_s=waited)
        log.error("%s (every rank waited past %.1f s)", found.text(), waited)
        return True
