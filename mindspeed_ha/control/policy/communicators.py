"""Which communicators a recovery remakes: only those the fault reached.

Each rank's status answer says, for every group it is a member of (by the group's key, the same on
every member), what its communicator carried: ``[collectives, state, sent, received, members]``
(``comm.ledger``; the members are said by the group's first member only). A group is remade when

- a member says it is not idle: a collective open or pending, aborted, broken;
- it is connected on some members and not on others;
- its members issued different numbers of collectives on it (one is ahead: a collective it entered
  that another never will);
- a member sent a peer more or fewer messages than that peer received;
- a member is ``fresh``: restarted, replaced or lost (its communicators are gone, or new);
- or a member did not answer for it at all (a rank that said nothing of its communicators: all of them).

Every other group keeps its communicator, on every member. Pure: the controller calls it with the
statuses it holds; the rebuild order carries the answer (``strategies.retry``).
"""
from __future__ import annotations

from typing import Any, Iterable

OK = "ok"
UNCONNECTED = "unconnected"


def to_remake(statuses: dict[int, dict[str, Any]], fresh: Iterable[int]) -> dict[str, str] | None:
    """The groups to remake, key -> why; None: every group (a rank said nothing of its communicators,
    as one that runs a release before this one)."""
    fresh = set(int(r) for r in fresh)
    said = {int(r): st.get("comm") for r, st in statuses.items() if not st.get("joining")}
    if any(not isinstance(comm, dict) for comm in said.values()):
        return None
    groups: dict[str, dict[int, list[Any]]] = {}
    members: dict[str, list[int]] = {}
    for rank, comm in said.items():
        assert comm is not None  # (checked above: every rank said a dict)
        for key, entry in comm.items():
            groups.setdefault(key, {})[rank] = entry
            if entry[4] is not None and key not in members:  # (its first member says them)
                members[key] = [int(m) for m in entry[4]]
    remake: dict[str, str] = {}
    for key, entries in groups.items():
        why = _why(members[key], entries, fresh) if key in members else "its first member said nothing of it"
        if why:
            remake[key] = why
    return remake


def _why(members: list[int], entries: dict[int, list[Any]], fresh: set[int]) -> str:
    """Why one group is remade ('' : it is kept). ``entries``: each answering member's entry."""
    new = sorted(fresh & set(members))
    if new:
        return f"rank(s) {new} restarted, replaced or lost"
    silent = [m for m in members if m not in entries]
    if silent:
        return f"rank(s) {silent} said nothing of it"
    states = {rank: e[1] for rank, e in entries.items()}
    if all(s == UNCONNECTED for s in states.values()):
        return ""  # (made on first use, and not used since the last recovery: it connects when used)
    busy = sorted((rank, s) for rank, s in states.items() if s != OK)
    if busy:
        return "; ".join(f"{s} on rank {rank}" for rank, s in busy[:3])
    ops = {e[0] for e in entries.values()}
    if len(ops) > 1:
        return f"collective counts differ ({', '.join(f'rank {r}: {e[0]}' for r, e in sorted(entries.items()))})"
    for rank, e in entries.items():
        for peer, n in e[2].items():
            got = entries.get(int(peer), [0, "", {}, {}])[3].get(str(rank), 0) if peer != "any" else -1
            if got != n:
                return f"rank {rank} sent rank {peer} {n} message(s), which received {got}"
        for peer, n in e[3].items():
            if peer == "any":
                return f"rank {rank} received from any source"
            sent = entries.get(int(peer), [0, "", {}, {}])[2].get(str(rank), 0)
            if sent != n:
                return f"rank {rank} received {n} message(s) from rank {peer}, which sent {sent}"
    return ""
