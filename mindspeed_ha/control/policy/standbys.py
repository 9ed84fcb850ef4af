"""The standby controllers: which ranks stand by, and who replaces one that was lost.

Two ranks stand by (on nodes other than the controller's, and other than each other's, when there
are); when one may take over is the quorum rule (quorum.py).
"""
from __future__ import annotations

from .ranks import Rank


def choose_backups(nodes: dict[int, str], controller_rank: int | None, n: int = 2) -> list[int]:
    """``nodes``: rank -> node name. Prefer ranks on other nodes than the controller's, one per node,
    then any other rank; deterministic (lowest rank first within a node)."""
    ctrl_node = nodes.get(controller_rank) if controller_rank is not None else None
    picked: list[int] = []
    used_nodes = {ctrl_node}
    by_rank = sorted(r for r in nodes if r != controller_rank)
    for r in by_rank:  # other nodes, one each
        if len(picked) < n and nodes[r] not in used_nodes:
            picked.append(r)
            used_nodes.add(nodes[r])
    for r in reversed(by_rank):  # then other ranks, from the far end (often a different host)
        if len(picked) < n and r not in picked:
            picked.append(r)
    return picked[:n]


class Standbys:
    """The controller's record of its standbys: which ranks, in which process, at which endpoint."""

    def __init__(self, count: int = 2):
        self.count = count
        self.ranks: list[int] = []
        self.eps: dict[int, str] = {}
        self.pids: dict[int, int] = {}   # the process each standby runs in

    def endpoints(self) -> list[str]:
        return [self.eps[r] for r in self.ranks if r in self.eps]

    def named(self) -> list[tuple[int, str | None]]:
        return [(r, self.eps.get(r)) for r in self.ranks]

    def up(self, rank: int, endpoint: str) -> None:
        self.eps[rank] = endpoint

    def due(self, ranks: dict[int, Rank]) -> bool:
        """Standbys are to be named: none is yet, or one's process is gone (``renew`` would act)."""
        return not self.ranks or any(not ranks[r].alive or ranks[r].pid != self.pids.get(r) for r in self.ranks)

    def renew(self, ranks: dict[int, Rank], controller_rank: int | None) -> tuple[list[int], list[int]]:
        """Drop standbys whose process is gone (a restarted rank runs no standby) and name new ones
        up to ``count``. ``ranks``: rank -> record with ``alive``, ``pid``, ``node``.
        Returns (lost, newly named): the caller orders the new ones to stand by."""
        lost = [r for r in self.ranks if not ranks[r].alive or ranks[r].pid != self.pids.get(r)]
        for r in lost:
            self.ranks.remove(r)
            self.eps.pop(r, None)
        if len(self.ranks) >= self.count or (self.ranks and not lost):
            return lost, []
        nodes = {r: i.node for r, i in ranks.items() if i.alive and r not in self.ranks}
        new = choose_backups(nodes, controller_rank, n=self.count - len(self.ranks))
        self.ranks += new
        for r in new:
            self.pids[r] = ranks[r].pid
        return lost, new
