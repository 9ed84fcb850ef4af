"""A rank that has waited in its collectives for long: what it says of itself, so that the controller
can tell a desync (members of one group in collectives that cannot match) from a hang.

Nothing is sent per collective: the rank counts the collectives it issues on each group anyway (the
stop's ``Issued``); only once its training thread has waited past ``--ha-desync-after`` do its
heartbeats carry those counts, with each group's last collective (its kind and where it was issued)
and members.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable


def default_group_rank() -> int | None:
    """This process's rank in the default group, where torch.distributed is up (None elsewhere: the
    processor imports no torch itself)."""
    dist = sys.modules.get("torch.distributed")
    return int(dist.get_rank()) if dist is not None and dist.is_initialized() else None


class LongWait:
    """``waiting()``: the training thread waits in a collective now; ``evidence()``: the counts by group
    (``Issued.evidence``); ``member``: this rank's place in the default group (None: not known yet)."""

    def __init__(self, after_s: float, waiting: Callable[[], bool], evidence: Callable[[], dict[str, list[Any]]],
                 member: Callable[[], int | None]) -> None:
        self.after_s = float(after_s)
        self._waiting, self._evidence, self._member = waiting, evidence, member
        self._since: float | None = None

    def report(self, now: float | None = None) -> dict[str, Any] | None:
        """At a heartbeat: the evidence once the rank has waited past the threshold (sampled at each
        heartbeat: a wait between two of them is not seen), else None."""
        now = time.monotonic() if now is None else now
        if not self._waiting():
            self._since = None
            return None
        self._since = self._since if self._since is not None else now
        member = self._member()
        if self.after_s <= 0 or now - self._since < self.after_s or member is None:
            return None
        return {"member": member, "waited_s": round(now - self._since, 1), "groups": self._evidence()}
