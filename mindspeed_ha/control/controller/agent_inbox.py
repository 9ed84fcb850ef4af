"""What the node agents (``mindspeed-ha run``) tell the controller: their registration (which ranks
they run, with which processes; a node started again), their heartbeats (with the heartbeats of their
ranks they relay) and their health hooks' findings. The agents' half of the controller's inbox."""
from __future__ import annotations

import time
from typing import Any

from ...events import EventLog, get_logger
from ..policy.ranks import Agent, RankTable
from ..wire import protocol
from ..wire.folding import rows
from ..wire.router import Router
from .migration import Migrations
from .ports import ControllerPort
from .restarts import Restarts
from .scaling import Scaling

log = get_logger("control.controller")
Msg = dict[str, Any]


class AgentInbox:
    def __init__(self, port: ControllerPort, router: Router, table: RankTable, restarts: Restarts,
                 events: EventLog, scaling: Scaling, migrations: Migrations):
        self.port, self.router, self.table, self.restarts, self.events = port, router, table, restarts, events
        self.scaling, self.migrations = scaling, migrations

    def handlers(self) -> dict[str, Any]:
        return {"agent": self.agent, "agent_hb": self.agent_heartbeat, "health": self.health}

    def agent(self, ident: bytes, msg: Msg) -> None:
        n = msg["node_rank"]
        old = self.table.agents.get(n)
        # (the same agent, silent past the loss limit until now: its node's link was cut, and healed)
        returned = old is not None and old.pid == msg["pid"] and time.monotonic() - old.seen > self.table.dead_after
        self.table.agents[n] = Agent(n, ident, msg["node"], list(msg["ranks"]), list(msg["pids"]), seen=time.monotonic(),
                                 pid=msg["pid"], store=msg.get("store", ""), relay=bool(msg.get("relay")),
                                 relayed=dict(zip(msg.get("relayed", ()), msg.get("relayed_pids", ()))))
        self.router.send(ident, self.port.ack())
        # A node started again (a new agent), or an agent with no worker for a rank we think alive
        # (a standby that took over never knew the old node): those processes are gone.
        replaced = old is not None and old.pid and old.pid != msg["pid"]
        live = self.table.live()
        gone = sorted(r for r, pid in zip(msg["ranks"], msg["pids"])
                      if r in live and (replaced or not pid) and r not in self.restarts.restarting)
        if gone:
            info = self.table.ranks[gone[0]]
            self.port.fault(gone, "node-lost", info.it, info.phase,
                            detail=f"node {n} came back as a new agent (pid {msg['pid']}) without these ranks' processes",
                            key=("node-replaced", n, msg["pid"]))
        self._start_due(ident, self.table.agents[n], returned)
        self._vouch(self.table.agents[n])

    def _vouch(self, agent: Agent) -> None:
        """A restarted worker that registered before its agent said it had started it (a fork is that
        quick): where this controller never knew its predecessor's pid (it took over after that one
        died), its registration was not taken as the restarted worker's (``register``). The agent's
        list now names that pid as the worker it started: it is."""
        for r, pid in zip(agent.ranks, agent.pids):
            info = self.table.ranks.get(r)
            if (info is not None and not info.alive and pid and info.pid == pid and not self.table.stale(r, pid)
                    and r in self.restarts.restarting and r not in self.restarts.awaiting):
                info.alive = True
                self.restarts.came_back(r)
                self.events.emit("rejoined", rank=r, pid=pid, old_pid=0)
                log.info("rank %d rejoined with pid %d (its agent says so)", r, pid)

    def _start_due(self, ident: bytes, agent: Agent, returned: bool) -> None:
        """The ranks this agent is to start now: those the recovery under way waits for, and a
        scale-out's newcomers (the offer counts them in) — its node new, or back from a silence."""
        self.scaling.offer(agent, returned)
        due = self.restarts.due(agent.ranks, agent.pids)
        if due:  # (a scale-out's newcomers are named: each builds itself before it registers)
            args = {"ranks": due, "scale_out": sorted(set(due) & self.scaling.offered)}
            self.router.send(ident, protocol.encode("do", action="restart", id=0, args=args, epoch=self.port.epoch))

    def agent_heartbeat(self, ident: bytes, msg: Msg) -> None:
        a = self.table.agents.get(msg["node_rank"])
        if a is None:
            self.router.send(ident, protocol.encode("refused", reason="register first"))
            return
        now = time.monotonic()
        # (heartbeats queued while the node's link was cut can arrive before its agent registers again)
        returned = now - a.seen > self.table.dead_after
        a.ident, a.seen, a.spares = ident, now, msg.get("spares", a.spares)
        if "relayed" in msg:
            a.relayed = dict(zip(msg["relayed"], msg.get("relayed_pids", ())))
        unheard = self._beats(rows(msg["beats"]) if "beats" in msg else [], now)
        self.router.send(ident, self.port.ack())
        if unheard:
            self.router.send(ident, protocol.encode("unheard", ranks=unheard))
        if returned:
            self._start_due(ident, a, returned)

    def _beats(self, beats: list[Msg], now: float) -> list[int]:
        """Heartbeats an agent passed on: each taken as its rank's own, sent when it came to the agent
        (``age`` before). Returns the ranks not taken — unknown here, or a process declared lost —
        which the agent has register on their own link (where a lost one is told to exit)."""
        unheard = []
        for beat in beats:
            r = beat["rank"]
            if not 0 <= r < self.table.world:
                self.router.drops.drop("invalid", f"rank {r}: heartbeat via its agent")
                continue
            info = None if self.table.stale(r, beat.get("pid")) else \
                self.table.heard(None, beat, now - min(beat.get("age", 0.0), self.table.dead_after))
            if info is None:
                unheard.append(r)
            elif "busy" in beat:
                self.migrations.observe(info)
        return unheard

    def health(self, ident: bytes, msg: Msg) -> None:
        """An agent's health hook named ranks of its node sub-healthy."""
        for r in msg["ranks"]:
            self.migrations.sub_healthy(self.table.check(r), msg.get("detail") or "health check")
