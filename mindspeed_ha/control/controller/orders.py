"""Orders: what the controller tells ranks and launcher agents to do, and the answers that come back.

An order goes to the live ones of a set of ranks under an id; each answer is kept under that id
until no rank owes one (``answers``). A rank that dies owes nothing (``excuse``); a rank that comes
back on a new connection gets the orders it still owes again (``resend``: it drops by id what it did
receive). Agents get one-way orders (``to_agents``): restart, leave, reconnect, exit. Every order
carries the controller's epoch, so that a rank obeys only the newest controller.

Where a node's agent relays (``mindspeed-ha run --relay``), an order for its ranks goes to the agent
once, naming them, and their answers come back in its batches (``Inbox.results``): a round at N ranks
is N / ranks-per-node frames each way through this thread. Only ranks whose current process is
connected to the agent's relay go that way; the rest, and every rank of an agent gone silent
(``reroute``), get the order directly: a lost agent costs a resend, never the round.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable

from ..wire import protocol
from ..policy.ranks import RankTable
from ..wire.router import Router

Answer = tuple[bool, Any]   # (ok, the handler's data, or its error text)
# An agent that heartbeats every half second (the default): silent this long, or two of its intervals
# if longer, it is taken for lost as a relay (its ranks, heard directly, may be well).
RELAY_SILENCE_S = 2.0
# Orders that always go directly: the rank ends right after its answer (exit), or the controller moves.
DIRECT = frozenset({"exit", "standby", "takeover", "reconnect", "inject"})


@dataclasses.dataclass
class Pending:
    action: str
    waiting: set[int]                 # ranks that owe an answer
    data: bytes                       # the order as sent (re-sent to a rank that reconnects)
    cli: bytes | None = None          # a CLI's socket identity: it gets each answer as it comes
    results: dict[int, Answer] = dataclasses.field(default_factory=dict)
    sent: float = dataclasses.field(default_factory=time.monotonic)
    via: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> the node whose agent relayed it
    failed: bool = False              # an answer so far was a failure
    excused: bool = False             # a rank that owed one died


class Orders:
    def __init__(self, router: Router, table: RankTable, epoch: Callable[[], int], host_rank: int | None):
        self.router, self.table, self.epoch, self.host_rank = router, table, epoch, host_rank
        self.pending: dict[int, Pending] = {}
        self.answered: dict[int, dict[int, Answer]] = {}   # order id -> answers, once none is owed
        self.kinds: dict[tuple[int, int], str] = {}        # (order id, rank) -> its failed answer's fault kind
        self._next_id = 1

    def send(self, action: str, ranks: Iterable[int], args: dict[str, Any] | None = None,
             cli: bytes | None = None) -> int:
        """Send ``action`` to the live ones of ``ranks``; their answers collect under the returned id.
        The host rank's ``exit`` is left out: it exits last, locally."""
        oid = self._next_id
        self._next_id += 1
        data = protocol.encode("do", action=action, id=oid, args=args or {}, epoch=self.epoch())
        skip = self.host_rank if action == "exit" else None
        ranks_ = self.table.ranks
        targets = [ranks_[r] for r in ranks if r in ranks_ and ranks_[r].alive and r != skip]
        relays = self._relays()
        direct: list[bytes] = []
        by_agent: dict[int, list[int]] = {}
        via: dict[int, int] = {}
        for i in targets:
            agent = relays.get(i.rank) if action not in DIRECT else None
            if agent is not None and agent.relayed.get(i.rank) == i.pid:
                by_agent.setdefault(agent.node_rank, []).append(i.rank)
                via[i.rank] = agent.node_rank
            else:
                direct.append(i.ident)
        self.router.fan_out(direct, data)
        for n, frame in zip(by_agent, protocol.encode_each("do", "ranks", list(by_agent.values()), action=action,
                                                           id=oid, args=args or {}, epoch=self.epoch())):
            self.router.send(self.table.agents[n].ident, frame)
        self.pending[oid] = Pending(action, {i.rank for i in targets}, data, cli, via=via)
        if not targets:
            self.answered[oid] = self.pending.pop(oid).results
        return oid

    def _relays(self) -> dict[int, Any]:
        """rank -> the live agent that relays for it (none: every order goes directly)."""
        now, silence = time.monotonic(), self.relay_silence
        return {r: a for a in self.table.agents.values() if a.relay and a.relayed and now - a.seen <= silence
                for r in a.relayed}

    @property
    def relay_silence(self) -> float:
        """An agent silent this long relays nothing more: what it still owes is sent directly."""
        return min(self.table.dead_after, max(RELAY_SILENCE_S, self.table.fresh_s))

    def reroute(self, now: float) -> None:
        """The orders relayed by an agent now silent, or that no longer lists the rank as connected
        (its process ended, or never said hello: the agent could not pass the order on): sent again
        directly to the ranks that owe an answer (a rank drops by id an order it did take, and answers
        directly what it answered)."""
        relayed = [pend for pend in self.pending.values() if pend.via]
        if not relayed:
            return
        silence, agents = self.relay_silence, self.table.agents
        silent = {n for n, a in agents.items() if not a.relay or now - a.seen > silence}
        for pend in relayed:
            lost = {r for r, n in pend.via.items()
                    if r in pend.waiting and (n in silent or n not in agents or r not in agents[n].relayed)}
            for r in sorted(lost):
                del pend.via[r]
                info = self.table.ranks.get(r)
                if info is not None:
                    self.router.send(info.ident, pend.data)

    def to_agents(self, action: str, args: dict[str, Any]) -> None:
        data = protocol.encode("do", action=action, id=0, args=args, epoch=self.epoch())
        self.router.fan_out((a.ident for a in self.table.agents.values()), data)

    def answer(self, r: int, oid: int, ok: bool, data: Any, kind: str = "") -> Pending | None:
        """Rank ``r`` answered order ``oid`` (``kind``: a failure's fault kind, where the rank named one);
        returns the order (None: not one that waits)."""
        pend = self.pending.get(oid)
        if pend is None:
            return None
        if not ok and kind:
            self.kinds[(oid, r)] = kind
        pend.waiting.discard(r)
        pend.results[r] = (ok, data)
        pend.failed = pend.failed or not ok
        if not pend.waiting:
            self.answered[oid] = self.pending.pop(oid).results
        return pend

    def kind(self, oid: int, r: int) -> str:
        """The fault kind of rank ``r``'s failed answer to order ``oid``: a memory or communication
        error its handler raised, or "other" (any other error, or none named)."""
        kind = self.kinds.get((oid, r), "")
        return kind if kind in ("memory-error", "comm-failure") else "other"

    def answers(self, oid: int) -> dict[int, Answer]:
        """rank -> (ok, data or error text) for every rank that has answered so far."""
        pend = self.pending.get(oid)
        return dict(pend.results) if pend else self.answered.get(oid, {})

    def quiet(self, oid: int) -> bool:
        """A live rank still owes its answer to order ``oid``, and nothing went wrong so far (no
        answer failed, no rank that owed one died): the round has nothing to decide yet. Cheap at
        any size (it stops at the first such rank), where the answers so far are as many as ranks."""
        pend = self.pending.get(oid)
        if pend is None or pend.failed or pend.excused:
            return False
        ranks = self.table.ranks
        for r in pend.waiting:
            info = ranks.get(r)
            if info is not None and info.alive and not info.done:
                return True
        return False

    def waiting(self, oid: int | None) -> set[int]:
        """The ranks that still owe an answer to order ``oid``."""
        pend = self.pending.get(oid) if oid is not None else None
        return set(pend.waiting) if pend else set()

    def excuse(self, ranks: Iterable[int]) -> None:
        """These ranks are dead (or condemned): they owe no answers, nor do their successors."""
        gone = set(ranks)
        for pend in self.pending.values():
            pend.excused = pend.excused or bool(pend.waiting & gone)
            pend.waiting -= gone

    def resend(self, r: int) -> None:
        """Rank ``r`` came back on a new connection: the orders it owes may have been lost."""
        for pend in list(self.pending.values()):
            if r in pend.waiting:
                self.router.send(self.table.ranks[r].ident, pend.data)
