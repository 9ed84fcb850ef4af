"""The quorum rules: when a standby may take over, and when a side of a split job may train on.

A standby binds its own socket at once but answers ``ack(standby=True)`` until more than half
of the world's ranks talk to it: processors only come to a standby after losing the active
controller, so a majority there means the active one is gone for most of the job, and two standbys
can never both hold a majority (no split brain; an exact half counts when the controller's own
rank is not in it, see ``may_take_over``). Clients walk the candidates in one fixed order
(wire/announcement.py), so they gather at the same standby.
"""
from __future__ import annotations


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
