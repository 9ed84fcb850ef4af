"""A recovery's working memory (``Episode``: what its rounds learned and decided so far), what ends it
(``FirstStep``: the first step every rank completes after it) and how a failure is told.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from ...events import get_logger
from ..policy.ledger import Fault
from ..policy.rounds import Port

log = get_logger("control.strategies")


@dataclasses.dataclass
class Episode:
    """The working memory of one recovery: what the playbook learned and decided so far."""
    port: Port
    strategy: str
    world: int
    faults: list[Fault]                    # the episode's faults (the controller appends while it runs)
    groups: dict[int, list[int]]           # rank -> replica group as registered
    replica: bool = True                   # the ranks run the replica optimizer (else: reload)
    fallback: tuple[int, str] | None = None  # dump: newest periodic checkpoint (iteration, path)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    statuses: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # rank -> its answer to status
    joiners: list[int] = dataclasses.field(default_factory=list)    # restarted ranks (hold nothing yet)
    plan: Any = None                       # the planner's plan (plan.py): repair, reload, elastic or dump
    source: str = ""                       # where the lost state comes from: "twins" (the repair round)
                                           # or "checkpoint" (the reload round: the periodic checkpoint)
    generation: int = 0
    how: str = ""
    lost_steps: int = 0
    result: dict[str, Any] | None = None            # dump: the written checkpoint
    state_bytes: int = 0                   # dump: what the survivors will write (sets its time limit)
    moved_bytes: int = 0                   # repair: shard bytes copied from the twins
    dropped: list[int] = dataclasses.field(default_factory=list)   # elastic: ranks out of the new layout
    old_dp: int = 0                        # elastic: the data-parallel size before
    running: list[int] = dataclasses.field(default_factory=list)   # scale-out: the ranks training before
    reentry: Any = None                    # refused scale-out: the job's own layout, entered again
    spare_wait: float | None = None        # recover with elastic on: seconds a lost node is waited for
    restart_at: float = 0.0                # when the restart round asked for the replacements
    left: frozenset[int] = frozenset()         # elastic: ranks out of the layout since a scale-in (no shard)
    started: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def target(self) -> int:
        return int(self.plan.iteration)

    def group_of(self, rank: int) -> list[int] | None:
        """A rank's replica group: as it registered, or (a backup controller it never registered
        with) from a survivor's group that contains it."""
        if self.groups.get(rank):
            return list(self.groups[rank])
        return next((list(s["replica_group"]) for s in self.statuses.values()
                     if rank in (s.get("replica_group") or ())), None)


def failed(event: str, ep: Episode, reason: str) -> str:
    """Tell of a strategy's failure in its ``event`` (``Strategy.failed_event``); returns the note the
    diagnosis gives."""
    if event == "dump_refused":
        missing = [list(g) for g in getattr(ep.plan, "missing", ())]
        ep.port.emit("dump_refused", message=reason, missing=missing)
        log.error("dump: %s", reason)
        return reason
    ep.port.emit(event, reason=reason, strategy=ep.strategy)
    log.error("%s failed: %s; falling back to the dump", ep.strategy, reason)
    return f"{ep.strategy} failed ({reason})"


class FirstStep:
    """In NORMAL after a retry, recover, reload or resize: the recovery ends when every live rank
    has completed the step after the iteration it resumed at (``recovered``, with the MTTR from the
    first fault's detection; a scale-out: ``scaled_out``, timed from the newcomers' registration)."""

    def __init__(self, ep: Episode, faults: list[Fault], resumed_at: float):
        self.ep, self.faults, self.resumed_at = ep, faults, resumed_at
        self.target = ep.target + 1

    def close_by_fault(self, now: float, detect_s: float, done: bool) -> bool:
        """A new fault came, found ``detect_s`` after it struck: the awaited step is ``done`` (the
        fault proves it) or it was interrupted. Either way the recovery ends where the new fault
        struck, not where it was found: the time between is the new fault's (its MTTR starts with its
        detection), and would otherwise be counted twice — a hang in the first step added its 3 s
        timeout to the recovery before it too."""
        return self.check(max(self.resumed_at, now - detect_s), done, interrupted=not done)

    def check(self, now: float, completed: bool, interrupted: bool = False) -> bool:
        """``completed``: every live rank has ended step ``target`` (or a later fault proves it);
        ``interrupted``: a new fault struck while the job trained that step again — the recovery
        was over (the job was training), so it is reported, its MTTR up to the new fault.
        Emits ``recovered`` and returns True once."""
        if not (completed or interrupted):
            return False
        ep, first = self.ep, self.faults[0]
        phases = dict(ep.phases)
        phases["first_step"] = round(now - self.resumed_at, 4)
        mttr = first["detect_s"] + (now - first["t_detect"])
        extra = {} if completed else {"first_step_interrupted": True}
        if ep.strategy == "scale-out":  # no fault: the time from the newcomers' registration
            if not ep.plan.ok:  # refused (said so then): the job went on as it was
                ep.port.closed(self.faults, now, 0, phases)
                return True
            ep.port.emit("scaled_out", old_dp=ep.old_dp, dp=ep.plan.dp, iteration=ep.target,
                         added=sorted(ep.plan.sources), parked=ep.dropped, kept=[list(r) for r in ep.plan.kept],
                         redundancy=ep.plan.redundancy, microbatches=ep.plan.microbatches, bytes=ep.moved_bytes,
                         seconds=round(mttr, 4), phases=phases, **extra)
            log.info("scaled out (%s) at iteration %d in %.3f s from the newcomers' registration, phases %s",
                     ep.how, ep.target, mttr, phases)
            ep.port.closed(self.faults, now, ep.moved_bytes, phases)
            return True
        ep.port.emit("recovered", strategy=ep.strategy, iteration=ep.target, lost_steps=ep.lost_steps,
                     mttr_s=round(mttr, 4), phases=phases, how=ep.how,
                     faults=[{"ranks": f["ranks"], "kind": f["kind"], "iteration": f["iteration"],
                              "phase": f["phase"]} for f in self.faults], **extra)
        log.info("recovered by %s (%s) at iteration %d: MTTR %.3f s, phases %s%s", ep.strategy, ep.how,
                 ep.target, mttr, phases, "" if completed else " (a new fault came in its first step)")
        ep.port.closed(self.faults, now, ep.moved_bytes, phases)
        return True

