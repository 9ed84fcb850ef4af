"""migration (``mindspeed-ha migrate``, ``--ha-migrate-stragglers``; needs recover): a live rank moves
to a spare worker, planned, while nothing failed. It is recover's playbook for a ``migrate`` fault: the
ranks park between two steps (the moving rank too: it answers the status, and what it holds is not
counted), the moving rank is then ended and restarted as a hung one would be, and takes its state from
its twins. When to migrate (a straggler, a host to drain, a hand-over first where the
rank hosts the controller) is the controller's helper's (``controller.migration``); this is what the
playbook does differently for it.
"""
from __future__ import annotations

from .episode import Episode
from .strategy import Strategy


def moving(ep: Episode) -> set[int]:
    """The ranks the episode moves to a spare (alive: recover ends them before their restart)."""
    return {r for f in ep.faults if f["kind"] == "migrate" for r in f["ranks"]}


STRATEGY = Strategy("migration", "mindspeed-ha migrate, --ha-migrate-stragglers (with --enable-worker-reboot)",
                    handles=frozenset({"migrate"}), stages=(), part_of=("recover",))
