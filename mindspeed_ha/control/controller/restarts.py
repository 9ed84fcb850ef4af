"""Restarts: the recover strategy's lost ranks, started again by their launcher agents.

A rank's agent restarts its worker (or hands the rank to a spare); the ranks of a node lost with its
agent wait for a replacement node (``mindspeed-ha run`` with the same --node-rank starts them as
joiners by itself). Until a restarted rank registers again it is ``restarting``: its registration
then revives it (any other process of a dead rank stays dead). Every restart counts against the
budget (budget.py), which may refuse recover for the next fault.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Iterable

from ...events import EventLog, get_logger
from ..policy.budget import RestartBudget
from .orders import Orders
from ..policy.ranks import RankTable

log = get_logger("control.controller")


class Restarts:
    def __init__(self, table: RankTable, orders: Orders, events: EventLog, max_restarts: int,
                 host_rank: int | None, end_host: Callable[[], None] | None):
        self.table, self.orders, self.events = table, orders, events
        self.host_rank, self.end_host = host_rank, end_host
        self.budget = RestartBudget(max_restarts)
        self.restarting: set[int] = set()    # ranks restarted by their agent, not registered again yet
        # Of those, the ranks whose agent was not there to order: rank -> the worker pid its agent
        # listed when it was ordered at last (None: not yet), until the agent lists another one.
        self.awaiting: dict[int, int | None] = {}
        self.died_in: dict[int, int] = {}    # rank -> the iteration its process was lost in
        self.fell_silent: set[int] = set()   # of those, lost to silence (a node or its network), not a death seen

    def lost(self, ranks: Iterable[int], iteration: int, kind: str) -> None:
        ranks = list(ranks)
        self.died_in.update({r: int(iteration) for r in ranks})
        if kind in ("heartbeat-lost", "node-lost", "controller-lost"):
            self.fell_silent.update(ranks)
        else:
            self.fell_silent.difference_update(ranks)

    def restart(self, ranks: Iterable[int]) -> tuple[list[int], list[int], list[int]]:
        """The agents restart these ranks' workers. Returns (restarted by an agent, awaiting a
        replacement node, without any agent — nothing restarted then)."""
        ranks = sorted(ranks)
        agents = self.table.agents.values()
        # A rank an agent started whose agent has not registered here (not yet; or never with this
        # controller, a standby that took over while that node was cut off) waits for that node as
        # for a lost one: its agent, or a replacement, restarts it when it registers. Only a job
        # that no agent launched has ranks nothing can restart.
        under_agents = bool(self.table.agents) or os.environ.get("MINDSPEED_HA_AGENT_NODE", "").isdigit()
        orphans = [] if under_agents else sorted(r for r in ranks if self._started_by(r) is None)
        if orphans:
            return [], [], orphans
        if self.host_rank in ranks and self.end_host is not None:
            # The controller's own host must go (hung): it cannot drive its own replacement. It ends
            # the process instead; its agent reports the exit, and a standby takes over the recovery.
            self.events.emit("host_ends", rank=self.host_rank,
                             reason="the controller's host rank is to be replaced")
            log.error("rank %d hosts this controller and must be replaced: ending it, a standby takes over",
                      self.host_rank)
            self.end_host()
        live_agents = self.table.live_agents(time.monotonic())
        by_agent = sorted(r for a in live_agents for r in a.ranks if r in ranks)
        awaiting = sorted(set(ranks) - set(by_agent))
        self.restarting, self.awaiting = set(ranks), dict.fromkeys(awaiting)
        nodes = {a.node_rank for a in agents if set(a.ranks) & set(awaiting)}
        nodes |= {n for r in awaiting if (n := self._started_by(r)) is not None}
        self.budget.count({r: self.died_in.get(r, -1) for r in ranks}, sorted(nodes))
        if by_agent:
            self.orders.to_agents("restart", {"ranks": by_agent})
        return by_agent, awaiting, []

    def expect(self, ranks: Iterable[int]) -> None:
        """These ranks are to be started by their agent when it registers (a scale-out's newcomers):
        awaited like restarted ones, and not ordered yet."""
        ranks = list(ranks)
        self.restarting |= set(ranks)
        self.awaiting.update(dict.fromkeys(ranks))

    def no_longer_awaited(self) -> list[int]:
        """The restarts under way are given up (recover switched to scaling in): returns their ranks."""
        given_up = sorted(self.restarting)
        self.restarting.clear()
        return given_up

    def came_back(self, r: int) -> None:
        """Restarted rank ``r`` registered again: it is no longer awaited."""
        self.restarting.discard(r)
        self.awaiting.pop(r, None)

    def due(self, ranks: Iterable[int], pids: Iterable[int]) -> list[int]:
        """An agent registered with these ranks (``pids``: its workers, 0 for none): those of them
        this recovery restarts and nobody ordered yet — a replacement node's, or those of a node that
        was cut off and is back (its old workers, still running, are ended by the restart)."""
        due = []
        for r, pid in zip(ranks, pids):
            if r not in self.restarting:
                continue
            if r not in self.awaiting:
                if not pid:  # (a node replaced while its ranks were being restarted elsewhere)
                    due.append(r)
            elif self.awaiting[r] in (None, pid):  # not ordered yet, or the order was lost on the way
                self.awaiting[r] = pid
                due.append(r)
            else:  # a new worker: the order was carried out
                del self.awaiting[r]
        return sorted(due)

    def _started_by(self, r: int) -> int | None:
        """The node rank of the agent that started rank ``r``, as the rank registered (None: another
        launcher, or not known)."""
        info = self.table.ranks.get(r)
        return None if info is None else info.agent_node

    def refusal(self) -> str | None:
        """Why recover may not restart the lost ranks now (None: it may)."""
        now = time.monotonic()
        ranks = self.table.ranks
        lost = {r: self.died_in.get(r, ranks[r].it) for r in self.table.lost() if r in ranks}
        live_agents = self.table.live_agents(now)
        gone = {a.node_rank for a in self.table.agents.values() if set(a.ranks) & set(lost) and a not in live_agents}
        # (a crash loop is a restarted process dying again: not one still on its way back, nor one
        # that fell silent with its node — a cut link, a lost host —, though the budget counts both)
        crashed = {r for r in lost if r not in self.fell_silent and r not in self.restarting}
        return self.budget.refusal(lost, gone, crashed=crashed)
