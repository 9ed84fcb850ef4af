"""A desync: ranks of one group in collectives that cannot match.

Every member of a group issues its collectives in the same order (the backends match them by order),
so the n-th collective of a group is the same call on every member. Each rank counts the collectives it
issues on each group (the stop's ``Issued``); once it has waited in its collectives past
``--ha-desync-after`` its heartbeats carry those counts, with each group's last collective (kind and
issue site) and members (control/rank/long_wait.py). When every live rank does, none of them can move
unless a wait completes: a group whose members' counts differ — one issued a collective the others
never will — or whose members' last collectives differ in kind at the same count, is a desync. The
ranks out of step are those whose count (or kind) differs from most members'. A rank that computes
(a straggler) sends no counts, and nothing is concluded while it may still come.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Desync:
    group: list[int]                            # the group's members (job ranks)
    collectives: dict[int, tuple[int, str, str]]  # each member: its count on the group, last kind, issue site
    out_of_step: list[int]                      # the members whose count or kind differs from most members'

    def text(self) -> str:
        each = "; ".join(f"rank {r}: collective {n} of the group, {kind or '-'}" + (f" from {where}" if where else "")
                         for r, (n, kind, where) in sorted(self.collectives.items()))
        return (f"desync in the group of ranks {self.group}: its members wait in collectives that cannot match "
                f"({each}); out of step: rank(s) {self.out_of_step}")


def find(reports: dict[int, dict[str, Any]], live: set[int]) -> Desync | None:
    """``reports``: job rank -> what it sent once it had waited past the threshold (``member``, its rank
    in the default group; ``groups``: key -> [count, kind, where, members]). None unless every rank of
    ``live`` sent one and a group's members disagree — the largest such group first: a rank that waits
    in a collective its peers never issue is ahead of most of a large group, while the peers that
    wait for it in a small one are only ahead of it there."""
    if not live or not live <= set(reports):
        return None
    rank_of = {int(e["member"]): r for r, e in reports.items()}
    groups: dict[str, list[int]] = {}
    for e in reports.values():
        for key, (_, _, _, members) in e["groups"].items():
            if members and all(int(m) in rank_of for m in members):
                groups.setdefault(key, [rank_of[int(m)] for m in members])
    for key, ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        seen = {r: tuple(reports[r]["groups"].get(key, [0, "", "", []])[:3]) for r in ranks}
        counts = collections.Counter(n for n, _, _ in seen.values())
        if len(counts) > 1:
            usual = _most(counts)
            odd = sorted(r for r, (n, _, _) in seen.items() if n != usual)
        else:
            kinds = collections.Counter(k for _, k, _ in seen.values())
            if len(kinds) == 1:
                continue
            usual_kind = _most(kinds)
            odd = sorted(r for r, (_, k, _) in seen.items() if k != usual_kind)
        return Desync(sorted(ranks), {r: (int(n), str(k), str(w)) for r, (n, k, w) in seen.items()}, odd)
    return None


def _most(counter: "collections.Counter[Any]") -> Any:
    """The most common value; on a tie the smallest (a rank that issued one more is the odd one)."""
    top = max(counter.values())
    return min(v for v, c in counter.items() if c == top)
