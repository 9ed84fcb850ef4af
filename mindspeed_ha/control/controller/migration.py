"""Proactive migration: a live rank's work moves to a spare worker between two steps, before it fails.

A migration is a planned recover. ``request`` checks that it can be done (the job trains, the rank
has a twin to take its state from and a launcher agent with a spare ready) and records a ``migrate``
fault: PAUSE then parks every rank at its next step boundary instead of interrupting the step in
flight, and the recover playbook replaces the rank like a hung one — its agent ends the old process
and hands the rank to a spare, which takes the shard, counters and RNG from the twin — with nothing
to roll back. On request (``mindspeed-ha migrate``), or on evidence with ``--ha-migrate-stragglers``:
a straggler (stragglers.py) or a rank the agents' health hook names (launcher/health.py). The
recovery's first step closes it with a ``migrated`` event.
"""
from __future__ import annotations

from typing import Any

from ...events import EventLog, get_logger
from ...options import WARM_UP_STEPS, HAOptions
from ..policy.ledger import Fault, FaultLedger
from ..policy.ranks import Rank, RankTable
from ..policy.states import State as S
from ..policy.stragglers import StragglerWatch
from ..strategies import RECOVER
from .ports import ControllerPort

log = get_logger("control.controller")


class Migrations:
    def __init__(self, port: ControllerPort, table: RankTable, ledger: FaultLedger, events: EventLog,
                 options: HAOptions, host_rank: int | None):
        """``host_rank``: the rank whose process runs this controller (its migration is a hand-over first)."""
        self.port, self.table, self.ledger, self.events = port, table, ledger, events
        self.options, self.host_rank = options, host_rank
        self.watch = StragglerWatch(options.straggler_ratio, options.straggler_steps)
        self.moving: dict[int, dict[str, Any]] = {}   # rank -> what it was (pid, node) and why it moves
        self.settle_until = 0               # no straggler judged up to this iteration (after a recovery)

    def refusal(self, r: int) -> str | None:
        """Why rank ``r`` cannot be migrated now (None: it can)."""
        info = self.table.ranks.get(r)
        if self.port.standby:
            return "this controller is a standby"
        if info is None or not info.alive or info.done:
            return f"rank {r} is not a live registered rank"
        if self.port.state != S.NORMAL:
            return f"the job is in state {self.port.state.value}; a migration starts only while it trains"
        if self.port.first_step_pending():  # (a planned move can wait for the last recovery to settle)
            return "the last recovery has not completed its first step yet; a migration starts only while it trains"
        if RECOVER.name not in self.options.strategies:
            return ("migration hands the rank to a spare worker, which the recover strategy provides: start the "
                    "job with --enable-worker-reboot (or HIGH_AVAILABILITY=...,recover)")
        if not info.groups:
            return ("migration takes the rank's state from its twin, and this job runs without replicas "
                    "(--distributed-optimizer-no-replica)")
        twins = [t for t in info.groups[0] if t != r and t in self.table.live()]
        if not twins:
            return f"rank {r} has no live twin to take its state from (replica group {info.groups[0]})"
        agent = self.table.agent_of(r)
        if agent is None:
            return f"rank {r} has no launcher agent to restart it (start the job with mindspeed-ha run)"
        if agent.spares < 1:
            return (f"no spare worker is ready on node {agent.node} (its agent keeps --ha-spares N ready and "
                    "starts a new one after each use); training goes on")
        return None

    def request(self, r: int, reason: str) -> str | None:
        """Start moving rank ``r`` at the next step boundary; the refusal's reason if it cannot."""
        why = self.refusal(r)
        if why:
            self.events.emit("migrate_refused", rank=r, reason=reason, why=why)
            log.warning("migration of rank %d refused: %s", r, why)
            return why
        if r == self.host_rank:  # this controller's host: a standby takes over first, then migrates it
            why = self.port.hand_over(r, reason)
            if why:
                self.events.emit("migrate_refused", rank=r, reason=reason, why=why)
            return why
        info = self.table.ranks[r]
        self.moving[r] = {"old_pid": info.pid, "old_node": info.node, "reason": reason}
        self.events.emit("migrate", rank=r, old_pid=info.pid, node=info.node, reason=reason)
        log.warning("migrating rank %d (pid %d on %s) to a spare at the next step boundary: %s",
                    r, info.pid, info.node, reason)
        self.port.fault([r], "migrate", info.it, info.phase, detail=f"{reason} (pid {info.pid} on {info.node})",
                        key=("migrate", r, info.pid))
        return None

    def outrun(self) -> bool:
        """The episode is only migrations, and a rank has finished training: the request came in the
        job's last step (a rank parks only before a step it will run, and no rank finishes while
        another is parked), so the job is ending, not waiting."""
        return self.ledger.of_kind("migrate") and any(i.done for i in self.table.ranks.values())

    def abandon(self) -> None:
        for r, was in sorted(self.moving.items()):
            self.events.emit("migrate_abandoned", rank=r, reason=was.get("reason"),
                             why="the job ended its last step first")
            log.info("migration of rank %d abandoned: the job ended its last step first", r)
        self.moving.clear()
        self.ledger.close_active()

    def observe(self, info: Rank) -> None:
        """A heartbeat told a rank's own work per step: a straggler is named (and moved, if asked)."""
        if self.port.state != S.NORMAL or self.port.first_step_pending() or info.it <= self.settle_until:
            return  # (the first steps after a recovery are slow on every rank: not evidence)
        ratio = self.watch.observe(info, self._live)
        if ratio is None:
            return
        steps = self.watch.slow.get((info.rank, info.pid), 0)
        self.events.emit("straggler", rank=info.rank, node=info.node, rank_pid=info.pid, ratio=round(ratio, 3),
                         steps=steps, iteration=info.it, busy_s=round(info.busy, 4))
        log.warning("rank %d (node %s) is a straggler: its own work per step is %.2fx the others' median "
                    "for %d steps", info.rank, info.node, ratio, steps)
        if self.options.migrate_stragglers:
            self.request(info.rank, f"straggler: {ratio:.2f}x the others' work per step for {steps} steps")

    def _live(self) -> list[Rank]:
        return [i for i in self.table.ranks.values() if i.alive and not i.done]

    def sub_healthy(self, r: int, why: str) -> None:
        """Evidence from outside training (the agents' health hook): weighed like a straggler."""
        info = self.table.ranks.get(r)
        if info is None or not info.alive or r in self.moving:
            return
        self.events.emit("sub_healthy", rank=r, node=info.node, rank_pid=info.pid, detail=why)
        log.warning("rank %d (node %s) is sub-healthy: %s", r, info.node, why)
        if self.options.migrate_stragglers and self.port.state == S.NORMAL:
            self.request(r, why)

    def closed(self, faults: list[Fault], now: float, moved_bytes: int, phases: dict[str, float]) -> None:
        """The recovery of these faults has ended its first step: each migration in it is done.
        Its pause is the time no rank trained: from the last rank parked to the resume."""
        pause = sum(v for k, v in phases.items() if k not in ("detect", "stop", "status", "first_step"))
        self.settle_until = self.table.newest_iteration() + WARM_UP_STEPS
        self.watch.slow.clear()
        for f in faults:
            if f["kind"] != "migrate":
                continue
            r = f["ranks"][0]
            was, info = self.moving.pop(r, {}), self.table.ranks.get(r)
            self.events.emit("migrated", rank=r, old_pid=was.get("old_pid"), new_pid=info.pid if info else None,
                             old_node=was.get("old_node"), new_node=info.node if info else None,
                             reason=was.get("reason"), pause_s=round(pause, 4),
                             request_to_first_step_s=round(now - f["t_detect"], 4), bytes=moved_bytes)
            log.info("rank %d migrated: pid %s -> %s, training paused %.3f s (%.3f s from the request to the "
                     "first step after)", r, was.get("old_pid"), info.pid if info else "?", pause, now - f["t_detect"])
