"""Stragglers: a rank whose own work per step stays well above its peers'.

In synchronous data parallelism every rank's step takes as long as the slowest one's, so step time
says nothing about who is slow. What differs is a step's *own work*: its time less the time the rank
spent blocked in collectives waiting for peers (each rank measures it, heartbeats carry the mean
over the steps since the last one). A rank whose own work is ``ratio`` times the median of the
others' for ``steps`` steps in a row is a straggler — named once per process, judged only past its
warm-up (its first steps allocate and connect). A difference under NOISE_S per step is the host's
scheduling (a time slice, the interpreter's thread switch), not a rank worth moving.
"""
from __future__ import annotations

import statistics

from ...options import WARM_UP_STEPS
from .ranks import Rank

NOISE_S = 0.02


class StragglerWatch:
    def __init__(self, ratio: float, steps: int):
        self.ratio, self.steps = float(ratio), int(steps)
        self.slow: dict[tuple[int, int], int] = {}    # (rank, pid) -> slow steps in a row
        self.named: set[tuple[int, int]] = set()      # (rank, pid) already named

    def observe(self, info: Rank, live: list[Rank]) -> float | None:
        """``info``: a rank that just reported its work (``busy`` over ``busy_steps`` steps);
        ``live``: every live rank. Returns its ratio to the others' median the moment it becomes
        a straggler, else None."""
        others = [i.busy for i in live if i.rank != info.rank and i.busy > 0]
        if not info.busy_steps or not others or info.steps <= WARM_UP_STEPS:
            return None
        key = (info.rank, info.pid)
        median = statistics.median(others)
        ratio = info.busy / max(median, 1e-9)
        if ratio < self.ratio or info.busy - median < NOISE_S:
            self.slow[key] = 0
            return None
        self.slow[key] = self.slow.get(key, 0) + info.busy_steps
        if self.slow[key] < self.steps or key in self.named:
            return None
        self.named.add(key)
        return ratio
