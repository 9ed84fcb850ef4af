"""What the controller knows of every rank and agent, and the faults that silence or stillness mean.

A rank is *lost* when it is silent past ``dead_after`` (1.8 heartbeats, never under 3 s) — unless
its launcher agent is heard from (the agent reports a death within 20 ms, so a silent processor
there is a thread starved of the CPU, not a dead rank) or its process still runs on this host. A
live rank that has not moved (iteration, phase, progress) for the hang timeout is *hung*: everyone
blocks behind a hung rank, so the blame goes to the ranks that are not waiting in a collective, and
among them to those that got least far — judged only from recent heartbeats: a rank whose last one is
older than two intervals (a starved thread, a loaded host) may have moved on since, and is not blamed. A process's first WARM_UP_STEPS steps get at least
WARM_UP_S; when every rank stands still at once, twice the limit.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, Iterable

from mindspeed_ha.options import WARM_UP_HANG_S, WARM_UP_STEPS

PHASE_ORDER = {p: i for i, p in enumerate(("startup", "forward", "backward", "grad-sync", "optimizer",
                                           "param-sync", "checkpoint", "step"))}
WARM_UP_S = WARM_UP_HANG_S


@dataclasses.dataclass
class Rank:
    rank: int
    ident: bytes
    node: str = "?"
    pid: int = 0
    host: str = ""
    groups: list[list[int]] = dataclasses.field(default_factory=list)
    it: int = -1
    upd: bool = False
    health: str = "ok"
    phase: str = "startup"
    progress: float = 0.0
    seen: float = 0.0            # monotonic time of the last message
    progress_at: float = 0.0     # monotonic time the rank last moved (iteration/phase/progress changed)
    alive: bool = True
    done: bool = False           # said bye / exited 0
    stopped: bool = False
    waiting: bool = False        # blocked in a collective (waiting for a peer) at its last heartbeat
    steps: int = 0               # steps this process has ended, as it reports them
    busy: float = 0.0            # its own work per step (step time less waits for peers), lately
    busy_steps: int = 0          # the steps that figure covers (ended since the heartbeat before)
    checkpoint: int = -1         # the newest iteration it saved (periodic checkpoints)
    agent_node: int | None = None  # the node rank of the mindspeed-ha run agent that started it
    held: str = ""               # where its training thread is held, when it has not taken an order (its report)
    desync: dict[str, Any] | None = None  # its counts by group, once it has waited in collectives for long


@dataclasses.dataclass
class Agent:
    node_rank: int
    ident: bytes
    node: str
    ranks: list[int]
    pids: list[int]
    seen: float = 0.0
    spares: int = 0              # spare workers ready to take a rank (as of its last heartbeat)
    pid: int = 0                 # the agent's own process: a new one for a node means the node was replaced
    store: str = ""              # host:port of the job store it serves or stands ready to serve
    relay: bool = False          # it passes orders to its ranks and their answers back (``mindspeed-ha run --relay``)
    relayed: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> pid connected to its relay


@dataclasses.dataclass(frozen=True)
class Detected:
    """A fault the table found: handed to the controller's fault intake."""
    ranks: list[int]
    kind: str
    iteration: int
    phase: str
    detect_s: float
    detail: str
    key: tuple[str | int, ...]


def _nowhere(info: Rank) -> bool:
    return False


class RankTable:
    def __init__(self, world: int, heartbeat_s: float, hang_timeout_s: float, dead_after: float | None = None,
                 runs_here: Callable[[Rank], bool] = _nowhere):
        """``runs_here``: whether a rank's process still runs on the controller's host (a silent rank
        that does is starved, not lost); the controller asks the host, this table only decides."""
        self.world = world
        self.runs_here = runs_here
        self.hang_timeout = float(hang_timeout_s)
        self.dead_after = dead_after or max(1.8 * float(heartbeat_s), 3.0)
        self.fresh_s = max(2.0 * float(heartbeat_s), 1.0)   # a heartbeat this recent tells where a rank is now
        self.ranks: dict[int, Rank] = {}
        self.agents: dict[int, Agent] = {}
        self.by_ident: dict[bytes, int] = {}
        self.retired: dict[int, set[int]] = {}   # rank -> pids of its processes declared lost: never back

    def check(self, r: int) -> int:
        if not 0 <= r < self.world:
            raise ValueError(f"rank {r} outside world {self.world}")
        return r

    def live(self) -> set[int]:
        return {r for r, i in self.ranks.items() if i.alive and not i.done}

    def lost(self) -> set[int]:
        return {r for r, i in self.ranks.items() if not i.alive and not i.done}

    def all_in(self) -> bool:
        return len(self.ranks) == self.world

    def all_over(self) -> bool:
        return self.all_in() and all(i.done or not i.alive for i in self.ranks.values())

    def agent_of(self, r: int) -> Agent | None:
        return next((a for a in self.agents.values() if r in a.ranks), None)

    def live_agents(self, now: float) -> list[Agent]:
        return [a for a in self.agents.values() if now - a.seen <= self.dead_after]

    def heard(self, ident: bytes | None, msg: dict[str, Any], now: float) -> Rank | None:
        """A heartbeat (``ident`` None: passed on by its agent, sent at ``now``). None: the rank is
        unknown (it must register first)."""
        r = msg["rank"]
        info = self.ranks.get(r)
        if info is None:
            return None
        if ident is not None and info.ident != ident:  # the rank reconnected (new socket) without re-registering
            info.ident = ident
            self.by_ident[ident] = r
        if ident is None and now < info.seen:
            return info  # (sent before what was heard since: directly, while its agent was slow)
        info.seen = now
        phase, prog = msg.get("phase", info.phase), msg.get("progress", info.progress)
        if msg["it"] != info.it or phase != info.phase or prog != info.progress or msg["upd"] != info.upd:
            info.progress_at = now
        if "busy" in msg:
            info.busy, info.busy_steps = float(msg["busy"]), max(0, msg.get("steps", info.steps) - info.steps)
        info.steps = msg.get("steps", info.steps)
        info.checkpoint = msg.get("ckpt", info.checkpoint)
        info.it, info.upd, info.health, info.phase, info.progress = msg["it"], msg["upd"], msg["health"], phase, prog
        info.waiting = bool(msg.get("wait", False))
        info.held = str(msg.get("held", ""))
        info.desync = msg.get("desync")
        return info

    def mark_dead(self, ranks: Iterable[int]) -> None:
        for r in ranks:
            if r in self.ranks:
                self.ranks[r].alive = False
                if self.ranks[r].pid:
                    self.retired.setdefault(r, set()).add(self.ranks[r].pid)

    def stale(self, rank: int, pid: int | None) -> bool:
        """A message from a process of ``rank`` that was declared lost (it was replaced, or will be)."""
        return pid is not None and pid in self.retired.get(rank, ())

    def moved(self, now: float) -> None:
        """After a recovery: every rank starts its progress clock again."""
        for i in self.ranks.values():
            i.health = "ok" if i.alive else i.health
            i.progress_at = max(i.progress_at, now)

    def expect_all(self, now: float) -> None:
        """Every rank of the world has a record from now: one that never registered (a standby that
        took over, a fault before the job had registered whole) is lost if it stays silent, like
        any other, unless it registers meanwhile."""
        for r in range(self.world):
            if r not in self.ranks:
                self.ranks[r] = Rank(rank=r, ident=b"", seen=now, progress_at=now)

    def heard_all(self, now: float) -> None:
        """Detection clocks start now (training begins, or a standby took over)."""
        for i in self.ranks.values():
            i.seen = max(i.seen, now)

    def completed(self, step: int, outside: Collection[int] = frozenset()) -> bool:
        """Every live rank has ended ``step`` (or saved after it, or moved on); ``outside``: live ranks
        that train nothing (newcomers waiting to scale out)."""
        return all(i.done or i.it > step or (i.it == step and i.phase in ("step", "checkpoint"))
                   for i in self.ranks.values() if i.alive and i.rank not in outside)

    def figures(self) -> tuple[int, int, int]:
        """The live ranks, the newest iteration and the newest checkpoint (-1: none), in one pass over
        the ranks: the metrics take them at every scan of the clock."""
        live, newest, checkpoint = 0, -1, -1
        for i in self.ranks.values():
            live += i.alive and not i.done
            newest = i.it if i.it > newest else newest
            checkpoint = i.checkpoint if i.checkpoint > checkpoint else checkpoint
        return live, newest, checkpoint

    def newest_iteration(self) -> int:
        return max([i.it for i in self.ranks.values()] or [-1])

    def hang_limit(self, info: Rank) -> float:
        """A process's first steps also allocate, connect its groups' peers, warm caches and start
        helpers (the checkpoint writer's process): on a loaded host seconds of honest work, so until
        it has ended WARM_UP_STEPS steps it gets at least WARM_UP_S."""
        return self.hang_timeout if info.steps >= WARM_UP_STEPS else max(self.hang_timeout, WARM_UP_S)

    def scan(self, now: float, training: bool) -> list[Detected]:
        """Lost and hung ranks; ``training``: hangs are looked for only while the job trains."""
        lost, stuck = [], []
        # (ranks a live agent runs a worker for: one it lists without a process is not watched over)
        watched = {r for a in self.live_agents(now) for r, pid in zip(a.ranks, a.pids) if pid}
        for info in self.ranks.values():
            if not info.alive or info.done:
                continue
            silent = now - info.seen
            if silent > self.dead_after and ((info.rank not in watched and not self.runs_here(info))
                                             or silent > max(self.dead_after, self.hang_limit(info))):
                lost.append(info)
            elif (training and info.it >= 0 and now - info.progress_at > self.hang_limit(info)
                  and silent <= self.fresh_s):
                stuck.append(info)
        out = [Detected([i.rank], "heartbeat-lost", i.it, i.phase, now - i.seen,
                        f"no heartbeat for {now - i.seen:.2f}s", ("hb", i.rank, i.pid)) for i in lost]
        if stuck:
            live = [i for i in self.ranks.values() if i.alive and not i.done]
            still = [i for i in live if i.it >= 0 and now - i.progress_at > self.hang_timeout / 2]
            fresh = [i for i in still if now - i.seen <= self.fresh_s]
            # Ranks blocked in a collective wait for someone; those that are not are the stuck ones.
            cands = [i for i in fresh if not i.waiting]
            if not cands and len(fresh) < len(live):
                # Everyone heard from waits in a collective, for a rank whose heartbeat is late
                # (a loaded host): blaming the waiters would leave only that rank to recover with.
                # Its next heartbeat, or its loss, will say where it is.
                return out
            cands = cands or fresh
            low = min((i.it, PHASE_ORDER.get(i.phase, 99)) for i in cands)
            hung = [i for i in cands if (i.it, PHASE_ORDER.get(i.phase, 99)) == low]
            first = hung[0]
            if len(hung) == len(live) and any(now - i.progress_at <= 2 * self.hang_limit(i) for i in hung):
                # Every rank stands still at the same point: a stall of the whole host or network
                # more often than a hang, and blaming them all leaves nobody to recover with.
                # Declared only at twice the timeout.
                return out
            out.append(Detected([i.rank for i in hung], "hang", first.it, first.phase,
                                now - min(i.progress_at for i in hung),
                                f"no progress for {now - first.progress_at:.1f}s (hang timeout {self.hang_timeout:g}s)",
                                ("hang", first.it)))
        return out

    def status(self, now: float) -> list[dict[str, Any]]:
        return [{"rank": i.rank, "pid": i.pid, "node": i.node, "iteration": i.it, "phase": i.phase,
                 "update": i.upd, "health": i.health, "alive": i.alive, "done": i.done,
                 "last_seen_s": round(now - i.seen, 3), "replica_groups": i.groups}
                for i in sorted(self.ranks.values(), key=lambda i: i.rank)]
