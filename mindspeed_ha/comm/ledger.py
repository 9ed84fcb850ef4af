"""What one communicator carried since it was made, and whether it can be kept through a recovery.

Why: a recovery used to give every group of every rank a new communicator. Making one is the known
cost of a recovery on GPUs at scale (NCCL's initialisation: minutes at thousands of GPUs), yet a fault
on one rank leaves most communicators as they were: idle between two collectives every member
completed. Such a communicator can be kept, on every backend, if

- every member issued the same number of collectives on it (the backends match collectives by their
  order: equal counts, every one completed, means no member is one ahead of another);
- no member holds one of them open (gloo: a wait a stop abandoned; its work would complete later
  against the peer's *next* collective) or pending (a stream-ordered backend: a kernel in flight);
- it was not aborted (a stop's abort, a broken link) and is connected on every member;
- every member received from each peer what that peer sent it (gloo completes a send once the bytes
  are written: a message no receive took would be taken by the next receive);
- and none of its members is a rank that was restarted, replaced or lost (``fresh``).

Each rank counts (``Ledger``) and says its groups' states in its status answer
(``groups.communicators``); the controller compares the members' counts
(``control.policy.communicators.to_remake``); the rebuild order names the groups to remake, and every
member of one remakes it, the others keep theirs (``groups.reconnect``).

What it relies on: a communicator uses its store only to connect (gloo's full mesh at construction;
NCCL's communicator made at once on the rank's device, which carries its point-to-point messages
too), so a kept one does not need the store it met over to live on.
"""
from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

from mindspeed_ha import compat

SENDS = frozenset({"send"})
RECEIVES = frozenset({"recv", "recv_anysource"})

# A group's state, as its member says it (``groups.communicators``).
OK = "ok"                    # idle: every collective it issued completed
OPEN = "open"                # a collective's work not complete (gloo: a wait a stop abandoned)
PENDING = "pending"          # a stream-ordered collective still in flight (NCCL, the emulated NCCL)
ABORTED = "aborted"          # aborted (a stop's abort; HCCL: its device stopped)
BROKEN = "broken"            # torn down (a broken link)
UNCONNECTED = "unconnected"  # no communicator for the current generation (a lazy group not used since)


class Ledger:
    """One communicator's counts: collectives issued, messages sent and received per peer (group
    ranks), and the works of a host-completed backend (gloo) not seen complete. Reset with the
    communicator (``StableGroup._swap``)."""

    __slots__ = ("ops", "sent", "received", "_open", "_lock")

    def __init__(self) -> None:
        self.ops = 0
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}
        self._open: list = []
        self._lock = threading.Lock()

    def record(self, name: str, args: tuple, kwargs: dict[str, Any], work: object, track: bool) -> None:
        """``name`` was called on the communicator and gave ``work``; ``track``: keep the work until it
        completes (a host-completed backend; a stream-ordered one's works are the stop's: ``InFlight``,
        and asking them while an abort runs can freeze the process)."""
        if not isinstance(work, dist.Work):
            return  # (not a collective: a query, a coalescing block's start)
        with self._lock:
            if name in SENDS or name in RECEIVES:
                peer = _peer(name, args, kwargs)
                book = self.sent if name in SENDS else self.received
                book[peer] = book.get(peer, 0) + 1
            else:
                self.ops += 1
            if track and not compat.is_placeholder_work(work):  # (a coalescing block's: its block's work is)
                self._open = [w for w in self._open if not _completed(w)] + [work]

    def open_works(self) -> int:
        with self._lock:
            self._open = [w for w in self._open if not _completed(w)]
            return len(self._open)

    def said(self, key: str, state: str, ranks: list[int], with_members: bool, into: dict[str, Any]) -> None:
        """Add this group (``key``) to a status answer's section ``into`` (``communicators``): its count
        of collectives in ``ops`` (in ``keys``' order); under ``odd``, [state, sent, received] only where
        it is not idle or sent point to point (peers as text: msgpack's map keys); under ``members``
        its members, said by one member (``with_members``: the world's 16,384 ranks said by each of
        them would be 268 M numbers a status round). ``ranks``: the group's rank i is ``ranks[i]``."""
        with self._lock:
            into["keys"].append(key)
            into["ops"].append(self.ops)
            if state != OK or self.sent or self.received:
                into["odd"][key] = [state, {str(ranks[p]) if p >= 0 else "any": n for p, n in self.sent.items()},
                                    {str(ranks[p]) if p >= 0 else "any": n for p, n in self.received.items()}]
            if with_members:
                into["members"][key] = list(ranks)


def section() -> dict[str, Any]:
    """An empty ``comm`` section of a status answer (``Ledger.said`` fills it)."""
    return {"keys": [], "ops": [], "odd": {}, "members": {}}


def _peer(name: str, args: tuple, kwargs: dict[str, Any]) -> int:
    """The peer's group rank of a send or receive (-1: any source)."""
    if name == "recv_anysource":
        return -1
    if len(args) > 1:
        return int(args[1])
    return int(kwargs.get("dstRank", kwargs.get("srcRank", -1)))


def _completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # (one that cannot say: taken as open, its group remade)
        return False
