"""Elastic scale-out: a node whose ranks left the layout comes back, and the job grows onto it.

After a scale-in, the ranks left out (``left``) are neither restarted nor waited for. When a new
launcher agent registers for a node that holds some of them (``mindspeed-ha run`` started again
with that --node-rank: a replacement node), it is told to start those ranks as joiners (``offer``).
Once every one of them has registered, the controller asks for a scale-out (``registered``): the
job parks at its next step boundary like a migration, and the scale-out playbook (playbooks.py)
brings the newcomers into a larger layout. A request that comes while a recovery runs waits for
the job to train again (``retry``).

An agent that only restarts (the same process) offers nothing: ranks parked by a scale-in on a live
node stay out, or a batch size that forbids their size would start, refuse and park them forever.
"""
from __future__ import annotations

import time

from ..events import get_logger
from .states import Outcome as O, State as S

log = get_logger("control.controller")


class Growth:
    def __init__(self, controller):
        self.c = controller
        self.left: set[int] = set()          # ranks out of the layout since a scale-in
        self.agent_pid: dict[int, int] = {}  # node -> its agent's pid when its ranks left
        self.offered: set[int] = set()       # newcomers told to start, not yet in the layout
        self.at = 0.0                         # when the last newcomer registered

    def leave(self, ranks) -> None:
        self.left |= set(ranks)
        self.offered -= set(ranks)
        for a in self.c.agents.values():
            if set(a.ranks) & set(ranks):
                self.agent_pid[a.node_rank] = a.pid

    def offer(self, agent) -> None:
        """A node's agent registered: if it is a new one holding ranks that left, start them."""
        c = self.c
        mine = sorted(set(agent.ranks) & self.left - self.offered)
        if not mine or not c.scaled_in or self.agent_pid.get(agent.node_rank) == agent.pid:
            return
        self.offered |= set(mine)
        c.restarting |= set(mine)
        c.events.emit("scale_out_offer", node_rank=agent.node_rank, node=agent.node, ranks=mine)
        log.info("elastic: node %s (agent %d) is back: starting rank(s) %s to scale out", agent.node,
                 agent.node_rank, mine)
        c._to_agent(agent, "restart", {"ranks": mine})

    def registered(self, r: int) -> None:
        """Rank ``r`` registered; once every newcomer has, ask for the scale-out."""
        if r not in self.offered:
            return
        self.at = time.monotonic()
        self.retry()

    def retry(self) -> None:
        c = self.c
        live = c.table.live()
        if not self.offered or not self.offered <= live or c.machine.state != S.NORMAL or c.first_step is not None:
            return
        if any(f["kind"] == "scale-out" for f in c.active_faults):
            return
        rec = {"ranks": sorted(self.offered), "kind": "scale-out", "iteration": c.table.newest_iteration(),
               "phase": "boundary", "detect_s": 0.0, "detail": "returned ranks registered", "time": time.time(),
               "nodes": [c.ranks[r].node for r in sorted(self.offered)], "t_detect": self.at or time.monotonic(),
               "cpu_detect": time.thread_time()}
        c.active_faults.append(rec)
        c.events.emit("scale_out_requested", ranks=rec["ranks"], iteration=rec["iteration"])
        c._feed(O.SCALE_OUT)

    def newcomers(self) -> set:
        """Registered newcomers: no stop for them (they train nothing yet)."""
        return self.offered & self.c.table.live()

    def joined(self, ranks) -> None:
        """The scale-out brought ``ranks`` into the layout."""
        self.left -= set(ranks)
        self.offered -= set(ranks)
