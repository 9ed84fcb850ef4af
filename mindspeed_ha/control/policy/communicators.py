"""Which communicators a recovery remakes: only those the fault reached.

Each rank's status answer says, for every group it is a member of (by the group's key, the same on
every member), what its communicator carried (``comm.ledger``): ``{"keys": [...], "ops": [...]}`` its
collectives, ``odd`` [state, sent, received] where it is not idle or sent point to point, ``members``
said by the group's first member only. A group is remade when

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
_NONE: list[Any] = [OK, {}, {}]  # (a peer that sent and received nothing on the group)


def to_remake(statuses: dict[int, dict[str, Any]], fresh: Iterable[int]) -> dict[str, str] | None:
    """The groups to remake, key -> why; None: every group (a rank said nothing of its communicators,
    as one that runs a release before this one)."""
    fresh = set(int(r) for r in fresh)
    said = {int(r): st.get("comm") for r, st in statuses.items() if not st.get("joining")}
    if any(not isinstance(comm, dict) or "keys" not in comm for comm in said.values()):
        return None
    # (one dict of counts a group, and the few entries that are not idle apart: at 16,384 ranks of ten
    # groups each, this loop is the controller's to run through 164k of them)
    ops: dict[str, dict[int, int]] = {}
    odd: dict[str, dict[int, list[Any]]] = {}
    members: dict[str, list[int]] = {}
    for rank, comm in said.items():
        assert comm is not None  # (checked above: every rank said a section)
        for key, n in zip(comm["keys"], comm["ops"]):
            group = ops.get(key)
            if group is None:
                group = ops[key] = {}
            group[rank] = n
        for key, entry in (comm.get("odd") or {}).items():
            odd.setdefault(key, {})[rank] = entry
        for key, ranks in (comm.get("members") or {}).items():
            if key not in members:
                members[key] = [int(m) for m in ranks]
    remake: dict[str, str] = {}
    for key, counts in ops.items():
        why = (_why(members[key], counts, odd.get(key, {}), fresh) if key in members
               else "its first member said nothing of it")
        if why:
            remake[key] = why
    return remake


def count_groups(statuses: dict[int, dict[str, Any]]) -> int:
    """How many groups the ranks said they are members of (each list of keys read once: the ranks of a
    node that answered through their agent share one)."""
    lists = {id(keys): keys for st in statuses.values() if isinstance(keys := (st.get("comm") or {}).get("keys"), list)}
    return len({key for keys in lists.values() for key in keys})


def _why(members: list[int], counts: dict[int, int], odd: dict[int, list[Any]], fresh: set[int]) -> str:
    """Why one group is remade ('' : it is kept). ``counts``: each answering member's count of
    collectives; ``odd``: [state, sent, received] of the members that said more than that."""
    new = sorted(fresh & set(members))
    if new:
        return f"rank(s) {_few(new)} restarted, replaced or lost"
    silent = [m for m in members if m not in counts]
    if silent:
        return f"rank(s) {_few(silent)} said nothing of it"
    states = {rank: e[0] for rank, e in odd.items()}
    if len(states) == len(counts) and all(s == UNCONNECTED for s in states.values()):
        return ""  # (made on first use, and not used since the last recovery: it connects when used)
    busy = sorted((rank, s) for rank, s in states.items() if s != OK)
    if busy:
        return "; ".join(f"{s} on rank {rank}" for rank, s in busy[:3])
    if len(set(counts.values())) > 1:
        listed = sorted(counts.items())
        return "collective counts differ (" + ", ".join(f"rank {r}: {n}" for r, n in listed[:4]) + \
            (", ..." if len(listed) > 4 else "") + ")"
    for rank, (_, sent, received) in odd.items():
        for peer, n in sent.items():
            got = odd.get(int(peer), _NONE)[2].get(str(rank), 0) if peer != "any" else -1
            if got != n:
                return f"rank {rank} sent rank {peer} {n} message(s), which received {got}"
        for peer, n in received.items():
            if peer == "any":
                return f"rank {rank} received from any source"
            was_sent = odd.get(int(peer), _NONE)[1].get(str(rank), 0)
            if was_sent != n:
                return f"rank {rank} received {n} message(s) from rank {peer}, which sent {was_sent}"
    return ""


def _few(ranks: list[int]) -> str:
    """At most four ranks of a list, for a reason's text (a world group's can be every rank)."""
    return str(ranks) if len(ranks) <= 4 else f"[{', '.join(map(str, ranks[:4]))}, ... ({len(ranks)})]"
