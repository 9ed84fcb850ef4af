"""What each message from a rank, a launcher agent or the CLI does to the controller's picture of
the job: registrations (a restarted rank revives), heartbeats, fault and exit reports (faults for the
state machine), answers to orders, status requests and live fault injection. One method per message
type, in one table (``handlers``)."""
from __future__ import annotations

import time
from typing import Any, Callable

from ...events import EventLog, get_logger
from ...faults import PROCESS_FATAL_EXIT
from ..policy.ranks import Rank, RankTable
from ..policy.states import Outcome as O, State as S
from ..wire import protocol
from ..wire.folding import merged
from ..wire.router import Router
from .agent_inbox import AgentInbox
from .migration import Migrations
from .orders import Orders
from .ports import ControllerPort
from .restarts import Restarts
from .scaling import Scaling
from .succession import Succession

log = get_logger("control.controller")
Msg = dict[str, Any]                       # a decoded, validated message (protocol.py)
Handler = Callable[[bytes, Msg], None]    # (the sender's socket identity, its message)


class Inbox:
    """The messages' handlers. Each updates the parts it is handed (the rank table, orders, restarts)
    and tells the helper a message concerns (scaling, migrations, succession) what it says: the
    helpers are consulted when there is something for them, not polled."""

    def __init__(self, port: ControllerPort, router: Router, table: RankTable, orders: Orders,
                 restarts: Restarts, events: EventLog, scaling: Scaling, migrations: Migrations,
                 succession: Succession):
        self.port, self.router, self.table, self.orders = port, router, table, orders
        self.restarts, self.events = restarts, events
        self.scaling, self.migrations, self.succession = scaling, migrations, succession
        self.fenced_once: set[int] = set()
        self.agents = AgentInbox(port, router, table, restarts, events, scaling, migrations)

    def handlers(self) -> dict[str, Handler]:
        fenced = {"register": self.register, "hb": self.heartbeat, "fault": self.fault, "left": self.left,
                  "result": self.result, "bye": self.bye}
        return {**{t: self._fenced(fn) for t, fn in fenced.items()}, **self.agents.handlers(),
                "results": self.results, "exit": self.exit, "status?": self.status,
                "inject": self.inject, "migrate": self.migrate, "preempt": self.preempt}

    def _fenced(self, handle: Handler) -> Handler:
        """A rank's message from a process this controller declared lost — a partition that healed, a
        rank stopped and replaced meanwhile — is dropped, and that process is told to exit: the job
        has another process for its rank (or will have)."""
        def checked(ident: bytes, msg: Msg) -> None:
            r = self.table.check(msg["rank"])
            if not self.table.stale(r, msg.get("pid")):
                handle(ident, msg)
                return
            self.router.drops.drop("stale", f"rank {r} pid {msg.get('pid')}: {msg['t']}")
            text = (f"mindspeed-ha: rank {r}, process {msg.get('pid')}, was declared lost and replaced; this "
                    "process must not come back into the job, so it ends here")
            self.router.send(ident, protocol.encode("do", action="exit", id=0, epoch=self.port.epoch,
                                                    args={"code": 1, "diagnosis": text}))
            if r not in self.fenced_once:
                self.fenced_once.add(r)
                self.events.emit("fenced", rank=r, pid=msg.get("pid"), message=msg["t"])
                log.warning("rank %d: a message from its old process %s (declared lost): told to exit",
                            r, msg.get("pid"))
        return checked

    def register(self, ident: bytes, msg: Msg) -> None:
        r = self.table.check(msg["rank"])
        if msg["world"] != self.table.world:
            raise ValueError(f"rank {r} says world {msg['world']}, controller has {self.table.world}")
        now = time.monotonic()
        old = self.table.ranks.get(r)
        info = Rank(rank=r, ident=ident, node=msg["node"], pid=msg["pid"], host=msg.get("host", ""),
                    groups=msg.get("groups", []), it=msg.get("iteration", -1), seen=now, progress_at=now,
                    agent_node=msg.get("agent_node"))
        if old is not None and old.pid == info.pid:
            info.it, info.phase, info.progress, info.progress_at = old.it, old.phase, old.progress, old.progress_at
        if old is not None and not info.groups:
            info.groups = old.groups  # a restarted worker learns its groups only when it joins
        if old is not None and old.pid != info.pid and old.alive and self.port.state != S.INIT:
            log.warning("rank %d re-registered with a new pid %d (was %d)", r, info.pid, old.pid)
        if old is not None and not old.alive:
            # A dead rank stays dead, unless it is the worker the recover strategy restarted: a new
            # process, and where the lost one's pid is not known (a controller that took over never
            # heard from it) the one its agent says it started — not the lost one coming back
            # (a node whose link healed: its old workers reconnect before their agent ends them).
            # While the restart is awaited, the pid the agent lists is the old worker's: its new one
            # is listed only once the agent carried the order out.
            agent = self.table.agent_of(r)
            started = agent is not None and agent.pids[agent.ranks.index(r)] == info.pid \
                and r not in self.restarts.awaiting
            info.alive = old.pid != info.pid and r in self.restarts.restarting and (old.pid != 0 or started)
            if info.alive:
                self.restarts.came_back(r)
                self.events.emit("rejoined", rank=r, pid=info.pid, old_pid=old.pid)
                log.info("rank %d rejoined with pid %d (was %d)", r, info.pid, old.pid)
        self.table.ranks[r] = info
        self.table.by_ident[ident] = r
        if msg.get("strategies"):
            self.port.registered_strategies(r, frozenset(msg["strategies"]))
        self.router.send(ident, self.port.ack())
        if old is not None and old.ident != ident and old.pid in (info.pid, 0):  # 0: placeholder of a takeover
            self.orders.resend(r)
        if info.alive:
            self.scaling.registered(r)
        if self.port.state == S.INIT and not self.port.standby and self.table.all_in():
            self.port.feed(O.REGISTERED)

    def heartbeat(self, ident: bytes, msg: Msg) -> None:
        known = self.table.ranks.get(msg["rank"])
        reconnected = known is not None and known.ident != ident
        info = self.table.heard(ident, msg, time.monotonic())
        if info is None:
            self.router.send(ident, protocol.encode("refused", reason="register first"))
            return
        if "busy" in msg:
            self.migrations.observe(info)
        if reconnected:
            self.orders.resend(msg["rank"])
        self.router.send(ident, self.port.ack())

    def fault(self, ident: bytes, msg: Msg) -> None:
        r = self.table.check(msg["rank"])
        info = self.table.ranks.get(r)
        if info:
            info.health = "faulty"
            info.it = max(info.it, msg["iteration"])
            info.phase = msg["phase"]
        at = msg.get("at")
        self.port.fault([r], msg["kind"], msg["iteration"], msg["phase"],
                        detect_s=max(0.0, time.time() - at) if at else 0.0, detail=msg.get("detail", ""),
                        key=("fault", r, msg["kind"], at), rid=msg.get("rid"), entered=msg.get("entered"),
                        fault_class=msg.get("class", "fault"), frame=msg.get("frame", ""))

    def left(self, ident: bytes, msg: Msg) -> None:
        """A survivor left the step's collectives for the stop: its counts go to the other ranks, so
        that one still waiting in a collective it never entered leaves it at once (a peer it waits for
        was stopped elsewhere: a group without the faulted rank) instead of after the stop's grace."""
        r = self.table.check(msg["rank"])
        others = sorted(self.table.live() - {r})
        if self.port.state not in (S.NORMAL, S.DONE) and others:
            self.orders.send("entered", others, {"entered": {str(r): msg["entered"]}})

    def result(self, ident: bytes, msg: Msg) -> None:
        r = self.table.check(msg["rank"])
        pend = self.orders.answer(r, msg["id"], msg["ok"], msg.get("data") if msg["ok"] else msg.get("error", ""),
                                  msg.get("kind", ""))
        if pend is None:
            return
        if msg["action"] == "stop" and r in self.table.ranks:
            self.table.ranks[r].stopped = True
        if msg["action"] == "takeover":
            if msg["ok"]:
                self.succession.taken_over(str(msg.get("data") or ""))
            else:
                self.succession.cancel_hand_over(str(msg.get("error")))
        if msg["action"] == "standby" and msg["ok"]:
            self.succession.standby_up(r, msg.get("data") or "")
        if pend.cli is not None:
            self.router.send(pend.cli, protocol.encode("status", body={
                "ok": msg["ok"], "rank": r, "action": msg["action"], "data": msg.get("data"),
                "error": msg.get("error", "")}))

    def results(self, ident: bytes, msg: Msg) -> None:
        """An agent's batch of its ranks' answers: each taken as if its rank had sent it. One from a
        process declared lost is dropped here (its own link's next message has it told to exit)."""
        a = self.table.agents.get(msg["node_rank"])
        if a is not None:
            a.seen = time.monotonic()
        items = list(msg["items"])
        for alike in msg.get("same", ()):  # (one answer for several ranks: each its own again)
            ranks, pids, own = alike["ranks"], alike["pids"], alike.get("own")
            if len(pids) != len(ranks) or own is not None and (
                    len(own) != len(ranks) or not isinstance(alike.get("data", {}), dict)):
                self.router.drops.drop("invalid", f"answers of ranks {ranks} via agent {msg['node_rank']}: "
                                                  "their pids or own parts do not match them")
                continue
            answer = {k: v for k, v in alike.items() if k not in ("ranks", "pids", "own")}
            if own is None:
                items += [{**answer, "rank": r, "pid": pid or None} for r, pid in zip(ranks, pids)]
            else:
                items += [{**answer, "rank": r, "pid": pid or None, "data": merged(answer.get("data") or {}, mine)}
                          for r, pid, mine in zip(ranks, pids, own)]
        for item in items:
            r, pid = item["rank"], item.get("pid")
            why = "invalid" if not 0 <= r < self.table.world else "stale" if self.table.stale(r, pid) else ""
            if why:
                self.router.drops.drop(why, f"rank {r} pid {pid}: result via agent {msg['node_rank']}")
                continue
            self.result(ident, item)

    def bye(self, ident: bytes, msg: Msg) -> None:
        r = self.table.check(msg["rank"])
        if r in self.table.ranks:
            self.table.ranks[r].done = True
            self.table.ranks[r].seen = time.monotonic()

    def exit(self, ident: bytes, msg: Msg) -> None:
        r = self.table.check(msg["rank"])
        code, sig = msg.get("code", 0), msg.get("signal", 0)
        info = self.table.ranks.get(r)
        if info is not None and info.pid and info.pid != msg["pid"]:
            return  # an older incarnation of this rank
        agent = self.table.agents.get(msg.get("node_rank", -1))
        if agent is not None and r in agent.ranks and agent.pids[agent.ranks.index(r)] != msg["pid"]:
            return  # the same, told by the agent's current worker list (a report replayed to a new controller)
        if info is not None and not info.alive:
            return
        if info is not None:
            self.table.mark_dead([r])
        if code == 0 and not sig:
            if info is not None:
                info.done = True
            return
        if self.port.state in (S.EXIT, S.DONE):
            return  # survivors we told to exit
        how = f"killed by signal {sig}" if sig else f"exit code {code}"
        if code == PROCESS_FATAL_EXIT and not sig:
            how += " (process-fatal device error: the process must be replaced)"
        it = msg.get("iteration", info.it if info else -1)
        phase = msg.get("phase", info.phase if info else "unknown")
        at = msg.get("at")
        self.port.fault([r], "process-exit", it, phase, detect_s=max(0.0, time.time() - at) if at else 0.0,
                        detail=f"pid {msg['pid']} {how}", key=("exit", r, msg["pid"]), rid=msg.get("rid"))

    def status(self, ident: bytes, msg: Msg) -> None:
        self.router.send(ident, protocol.encode("status", body=self.port.status()))

    def inject(self, ident: bytes, msg: Msg) -> None:
        r = self.table.check(msg["rank"])
        info = self.table.ranks.get(r)
        if info is None or not info.alive or self.port.standby:
            self.router.send(ident, protocol.encode("refused", reason=f"rank {r} is not a live registered rank"))
            return
        if msg["kind"] not in protocol.INJECT_KINDS or msg.get("phase", "forward") not in protocol.INJECT_PHASES:
            self.router.send(ident, protocol.encode(
                "refused", reason=f"unknown fault {msg['kind']!r}/{msg.get('phase')!r}"))
            return
        args: dict[str, Any] = {k: msg[k] for k in ("kind", "step", "phase", "factor") if k in msg}
        oid = self.orders.send("inject", [r], args)
        # Answer on delivery: the fault may kill the rank before its handler's result gets out.
        self.router.send(ident, protocol.encode("status", body={"ok": True, "rank": r, "action": "inject",
                                                              "id": oid, "detail": "delivered", **args}))
        self.events.emit("inject", target=r, **args)

    def migrate(self, ident: bytes, msg: Msg) -> None:
        r = msg["rank"]
        why = (self.migrations.request(r, msg.get("reason") or "requested") if 0 <= r < self.table.world
               else f"there is no rank {r} in this job (ranks 0..{self.table.world - 1})")
        if why:
            self.router.send(ident, protocol.encode("refused", reason=why))
            return
        self.router.send(ident, protocol.encode("status", body={"ok": True, "rank": r, "action": "migrate",
                                                              "detail": "at the next step boundary"}))

    def preempt(self, ident: bytes, msg: Msg) -> None:
        """The scheduler is taking the job away: stop now, write the dying gasp, exit (once, whoever
        got the signal first: any agent, any rank)."""
        import signal
        try:
            name = signal.Signals(msg["signal"]).name
        except ValueError:
            name = f"signal {msg['signal']}"
        who = f"rank {msg['rank']}" if "rank" in msg else f"node {msg.get('node_rank', '?')}'s agent"
        ranks = [msg["rank"]] if "rank" in msg else (self.table.agents[msg["node_rank"]].ranks
                                                     if msg.get("node_rank") in self.table.agents else [])
        self.port.fault(ranks, "preempted", self.table.newest_iteration(), "step",
                        detail=f"{name} to {who}", key=("preempted",))

