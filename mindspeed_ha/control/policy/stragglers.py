"""Stragglers: a rank whose own work per step stays well above its peers'.

In synchronous data parallelism every rank's step takes as long as the slowest one's, so step time
says nothing about who is slow. What differs is a step's *own work*: its time less the time the rank
spent blocked in collectives waiting for peers (each rank measures it, heartbeats carry the mean
over the steps since the last one). A rank whose own work is ``ratio`` times the median of the
others' for ``steps`` steps in a row is a straggler — named once per process, judged only past its
warm-up (its first steps allocate and connect). A difference under NOISE_S per step is the host's
scheduling (a time slice, the interpreter's thread switch), not a rank worth moving.

Every heartbeat of a training rank carries its own work: at 16,384 ranks, 8,000 a second, each
judged on the controller's one thread. So the others' median is not taken afresh from every live
rank at each one (that cost the job's size per heartbeat: the thread could not keep up). The live
ranks' values are taken, sorted, once per eighth of the job's ranks heard (at most a few times a
heartbeat interval; at every heartbeat in a job of 8 ranks or fewer), and each judgement reads the
median of that list less the rank's own value.
"""
from __future__ import annotations

import bisect
from typing import Callable, Iterable

from ...options import WARM_UP_STEPS
from .ranks import Rank

NOISE_S = 0.02


REFRESH_SHARE = 8  # the others' values are taken again after a 1/REFRESH_SHARE of the ranks were heard


class StragglerWatch:
    def __init__(self, ratio: float, steps: int):
        self.ratio, self.steps = float(ratio), int(steps)
        self.slow: dict[tuple[int, int], int] = {}    # (rank, pid) -> slow steps in a row
        self.named: set[tuple[int, int]] = set()      # (rank, pid) already named
        self._sorted: list[float] = []                # the live ranks' own work per step, as last taken
        self._taken: dict[int, float] = {}            # rank -> its value in that list
        self._heard = 0                               # judgements since
        self._live = 0                                # live ranks then (those without a value yet too)

    def observe(self, info: Rank, live: Callable[[], Iterable[Rank]]) -> float | None:
        """``info``: a rank that just reported its work (``busy`` over ``busy_steps`` steps);
        ``live``: every live rank (asked for only when the others' values are taken again). Returns
        its ratio to the others' median the moment it becomes a straggler, else None."""
        if not info.busy_steps or info.steps <= WARM_UP_STEPS:
            return None
        self._heard += 1
        # (counted on the live ranks, not the values taken: as a job starts, most ranks have none yet,
        # and counting those alone took the list again at nearly every judgement)
        if self._heard >= max(1, self._live // REFRESH_SHARE):
            self._heard = 0
            ranks = list(live())
            self._taken = {i.rank: i.busy for i in ranks if i.busy > 0}
            self._sorted, self._live = sorted(self._taken.values()), len(ranks)
        median = self._median_without(info.rank)
        if median is None:
            return None
        key = (info.rank, info.pid)
        ratio = info.busy / max(median, 1e-9)
        if ratio < self.ratio or info.busy - median < NOISE_S:
            self.slow[key] = 0
            return None
        self.slow[key] = self.slow.get(key, 0) + info.busy_steps
        if self.slow[key] < self.steps or key in self.named:
            return None
        self.named.add(key)
        return ratio

    def _median_without(self, rank: int) -> float | None:
        """The median of the values taken, less ``rank``'s own (None: no other rank's)."""
        values = self._sorted
        mine = self._taken.get(rank)
        skip = bisect.bisect_left(values, mine) if mine is not None else len(values)
        n = len(values) - (mine is not None)
        if n == 0:
            return None

        def at(i: int) -> float:  # (the i-th of the others: the list with ``rank``'s value left out)
            return values[i if i < skip else i + 1]
        return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2
