"""Elastic training, the controller's side: when to scale in, when to wait for a node, when to grow.

Scale-in is a strategy (``strategies/scale_in.py``). With elastic on, ``order`` adjusts the strategy
preference for a fault: recover only where a spare can take the lost ranks — their agent is alive,
or, for a lost node, a replacement comes within --ha-spare-wait (``spare_wait``: recover waits for
it, then switches the episode to elastic, ``switched``); once the job runs scaled in, neither retry
nor recover (a restarted worker or repaired ranks would meet the original layout).

Scale-out (``strategies/scale_out.py``) has no fault. After a scale-in the ranks left out (``left``) are
neither restarted nor waited for. When a new launcher agent registers for a node that holds some of
them (``mindspeed-ha run`` started again with that --node-rank: a replacement node), it is told to
start those ranks as joiners (``offer``). Once every one of them has registered, the controller asks
for a scale-out (``registered``): the job parks at its next step boundary like a migration, and the
scale-out playbook brings the newcomers into a larger layout. A request that comes while a recovery
runs waits for the job to train again (``scale_out_when_ready``). An agent that only restarts (the same process)
offers nothing: ranks parked by a scale-in on a live node stay out, or a batch size that forbids
their size would start, refuse and park them forever.

A fault during a resize starts it over with every fault known: the ranks in it answer with what they
held before it (``recovery.handlers``), so a scale-in plans again from the old layout, and a newcomer
lost during a scale-out leads to the old layout entered again (``scaled``: the lost newcomers leave,
the others are offered again). Newcomers still waiting when the job's ranks have all ended leave too.
"""
from __future__ import annotations

import time
from typing import Any, Iterable

from ...events import EventLog, get_logger
from ..policy import quorum
from ..policy.ledger import KIND_SCALE_OUT, FaultLedger, record
from ..policy.ranks import Agent, RankTable
from ..policy.states import Outcome as O, State as S
from ..strategies import RECOVER, RETRY, SCALE_IN
from ..wire.discovery import JobStore
from ..wire.hosts import this_host
from .orders import Orders
from .ports import ControllerPort
from .restarts import Restarts

log = get_logger("control.controller")


class Scaling:
    def __init__(self, port: ControllerPort, table: RankTable, orders: Orders, restarts: Restarts,
                 ledger: FaultLedger, events: EventLog, spare_wait_s: float, job_store: JobStore | None):
        """``spare_wait_s``: --ha-spare-wait; ``job_store``: the job's store (the tie-break of an
        exact half), None without one."""
        self.port, self.table, self.orders, self.restarts = port, table, orders, restarts
        self.ledger, self.events = ledger, events
        self.spare_wait_s, self.job_store = spare_wait_s, job_store
        self.dp = 0                           # the data-parallel size the job runs at, scaled in (0: its own)
        self.layout: dict[str, Any] | None = None      # the layout of the last resize (for status)
        self.spare_wait: float | None = None  # this episode: seconds recover waits for a lost node
        self.left: set[int] = set()           # ranks out of the layout since a scale-in
        self.agent_pid: dict[int, int] = {}   # node -> its agent's pid when its ranks left
        self.offered: set[int] = set()        # newcomers told to start, not yet in the layout
        self.at = 0.0                          # when the last newcomer registered

    # ---- scale-in: the strategy choice ------------------------------------------------------------
    def order(self, ordered: list[str]) -> tuple[list[str], str]:
        """The strategies to try, in order, for the faults of this episode, and why one was dropped."""
        self.spare_wait = None
        if self.dp:
            return [s for s in ordered if s not in (RETRY.name, RECOVER.name)], \
                f"the job runs scaled in (data-parallel size {self.dp}): retry and recover not tried"
        cut_off = self.cut_off()
        if cut_off:  # (recover waits for the lost ranks' node as ever, and never scales in)
            return [s for s in ordered if s != SCALE_IN.name], cut_off
        agents = self.table.live_agents(time.monotonic())
        stranded = sorted(r for r in self.table.lost() if not any(r in a.ranks for a in agents))
        if stranded and RECOVER.name in ordered:
            if self.spare_wait_s > 0:  # a replacement node may come: recover waits, then scales in
                self.spare_wait = self.spare_wait_s
                return ordered, ""
            return [s for s in ordered if s != RECOVER.name], f"no spare for rank(s) {stranded} (their node is lost)"
        return ordered, ""

    def cut_off(self) -> str:
        """Why this controller's side of the job must not train on without its lost ranks: the rule
        a standby takes over by (policy/quorum.py), applied to the side that has the controller. A
        majority of the job's members (its ranks, less those a scale-in left out) goes on; exactly
        half goes on only where the job store says it is the store's side (it answers, or its host
        refuses: the store is gone, not out of reach); less than half never (it may be the cut-off
        side of a partition whose other side goes on). Empty: it may."""
        here = this_host()
        if all(self.table.ranks[r].host == here for r in self.table.lost()):
            return ""  # (every lost rank ran on this host: nothing between them to cut)
        members = self.table.world - len(self.left)
        live = len(self.table.live() - self.left)
        store = self.job_store
        if quorum.may_go_on(live, members, store is None or store.refused
                            or time.monotonic() - store.answered_at < quorum.LEASE_S):
            return ""
        why = "no majority" if 2 * live < members else "half of them, and the job store does not answer"
        return (f"elastic not tried: {live} of the job's {members} ranks live ({why}): this may be the cut-off "
                "side of a partition, which must not train on alone")

    def waiting_note(self) -> str:
        return (f"; lost node(s) of rank(s) {sorted(self.table.lost())}: their replacement is waited for up to "
                f"{self.spare_wait:g} s (--ha-spare-wait), then the job scales in without them")

    def switched(self, reason: str) -> None:
        """recover waited out the spare wait: the same episode scales in (the controller plays it)."""
        stranded = self.restarts.no_longer_awaited()
        self.events.emit("strategy", outcome=SCALE_IN.name, reason=reason)
        log.warning("recover: %s", reason)
        self.orders.to_agents("leave", {"ranks": stranded})  # (their agents are gone; a late one must not wait)

    # ---- after a resize ---------------------------------------------------------------------------
    def scaled(self, dp: int, replica_groups: dict[int, list[int]]) -> None:
        """The job runs at data-parallel size ``dp``; ``replica_groups``: every rank of the new layout
        (all of the job's ranks when it is whole again) -> its replica group."""
        self.dp = 0 if len(replica_groups) == self.table.world else int(dp)
        self.layout = {"data_parallel_size": int(dp), "ranks": sorted(int(r) for r in replica_groups)}
        self.left -= {int(r) for r in replica_groups}
        self.offered -= {int(r) for r in replica_groups}
        for r, group in replica_groups.items():
            if int(r) in self.table.ranks:
                self.table.ranks[int(r)].groups = [list(group)]
        lost = sorted(self.offered - self.table.live())
        if lost:  # newcomers lost during a scale-out that was then undone: the others may be offered again
            self.leave(lost, "they were lost while the job scaled out")

    def leave(self, ranks: Iterable[int], reason: str) -> None:
        """These ranks are out of the layout — the lost ones are not restarted, the live ones
        (parked) are told to exit 0."""
        ranks = list(ranks)
        live = sorted(set(ranks) & self.table.live())
        for r in ranks:
            if r in self.table.ranks:
                self.table.ranks[r].done = True
        self.left |= set(ranks)
        self.offered -= set(ranks)
        for a in self.table.agents.values():
            if set(a.ranks) & set(ranks):
                self.agent_pid[a.node_rank] = a.pid
        if live:
            self.orders.send("exit", live,
                             {"code": 0, "diagnosis": f"mindspeed-ha: rank(s) {live} leave the job: {reason}"})
        self.orders.to_agents("leave", {"ranks": sorted(ranks)})

    def status(self) -> dict[str, Any]:
        if not self.layout:
            return {}
        return {"layout": {**self.layout, "left": sorted(self.left), "joining": sorted(self.offered)}}

    # ---- scale-out ----------------------------------------------------------------------------------

    def offer(self, agent: Agent, returned: bool = False) -> None:
        """A node's agent registered: if it is a new one holding ranks that left, or the same one back
        from a silence (``returned``: a node whose link was cut), they are to be started (counted in
        ``restarting``: the agent is told to start them, its old workers ended first — again on each
        of its hellos that shows them without a process, as for recover, since a first order can go
        to a link that is still being set up)."""
        mine = sorted(set(agent.ranks) & self.left - self.offered)
        if not mine or not self.dp or (self.agent_pid.get(agent.node_rank) == agent.pid and not returned):
            return
        self.offered |= set(mine)
        self.restarts.expect(mine)
        self.events.emit("scale_out_offer", node_rank=agent.node_rank, node=agent.node, ranks=mine)
        log.info("elastic: node %s (agent %d) is back: starting rank(s) %s to scale out", agent.node,
                 agent.node_rank, mine)

    def registered(self, r: int) -> None:
        """Rank ``r`` registered; once every newcomer has, ask for the scale-out."""
        if r not in self.offered:
            return
        self.at = time.monotonic()
        self.scale_out_when_ready()

    def scale_out_when_ready(self) -> None:
        """Ask for the scale-out once every newcomer is live and the job trains, its last recovery
        closed (a request that came meanwhile is asked again then)."""
        live = self.table.live()
        if (not self.offered or not self.offered <= live or self.port.state != S.NORMAL
                or self.port.first_step_pending()):
            return
        if self.ledger.under_way(KIND_SCALE_OUT):
            return
        ranks = sorted(self.offered)
        f = record(ranks, KIND_SCALE_OUT, self.table.newest_iteration(), "boundary",
                   [self.table.ranks[r].node for r in ranks], detail="returned ranks registered",
                   t_detect=self.at or time.monotonic())
        self.ledger.open_planned(f)  # (no fault: not in the job's faults, nor its diagnosis)
        self.events.emit("scale_out_requested", ranks=ranks, iteration=f["iteration"])
        self.port.feed(O.SCALE_OUT)

    def ended_without(self) -> bool:
        """The job's ranks have all ended while newcomers still wait to scale out: they are told to
        leave (the job is over). True if they were."""
        waiting = self.newcomers()
        if not waiting or not self.table.all_in() or any(
                i.alive and not i.done for r, i in self.table.ranks.items() if r not in waiting):
            return False
        self.leave(sorted(waiting), "the job ended before they could join it")
        return True

    def waiting(self) -> set[int]:
        """Registered newcomers waiting to scale out: they train nothing yet (none unless some ranks
        were offered a place)."""
        return self.newcomers() if self.offered else set()

    def newcomers(self) -> set[int]:
        """Registered newcomers: no stop for them (they train nothing yet)."""
        return self.offered & self.table.live()
