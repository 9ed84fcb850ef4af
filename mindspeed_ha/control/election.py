"""Backup controllers: who stands by, and when a standby may take over.

Two ranks stand by (on nodes other than the controller's, and other than each other's, when there
are). A standby binds its own socket at once but answers ``ack(standby=True)`` until more than half
of the world's ranks talk to it: processors only come to a standby after losing the active
controller, so a majority there means the active one is gone for most of the job, and two standbys
can never both hold a majority (no split brain; an exact half counts when the controller's own
rank is not in it, see ``may_take_over``). Clients walk the candidates in one fixed order
(wire/announcement.py), so they gather at the same standby.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


def has_quorum(reachable: int, world: int) -> bool:
    """More than half of the world's ranks (the candidate's own rank included)."""
    return world > 0 and 2 * reachable > world


LEASE_S = 3.0  # the active controller's store counter (0.5 s rounds) standing still this long: it lost the store


def may_go_on(live: int, world: int, store_side: bool) -> bool:
    """A side of a split job may train on without the rest: a majority of the ranks, or exactly half
    on the job store's side (``store_side``)."""
    return has_quorum(live, world) or (world > 0 and 2 * live == world and store_side)


def may_take_over(reachable: int, world: int, controller_reachable: bool, store_lost_it: bool = True) -> bool:
    """A standby takes over with a quorum, or with exactly half of the world when the controller's
    own rank is not among them and the job store agrees that the controller is gone
    (``store_lost_it``: this standby reaches the store, where the controller's counter has stood
    still for LEASE_S, or the store's host refuses connections: it is up, its store is gone; jobs
    without a store have nothing to ask). A two-node job that loses the controller's node keeps half
    its ranks; a partition into two exact halves goes on only in the half that reaches the store:
    the other half's standby finds the store silent, so never takes over. (A node that dies silent
    with the store cannot be told from a partition: its half waits for the node's replacement, whose
    new store lets it take over.)"""
    return may_go_on(reachable, world, not controller_reachable and store_lost_it)


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
