"""A step's own work: its time less the time it waited in collectives for slower peers — what tells a
straggler from the ranks it holds up. The processor's heartbeats carry its average since the last
one; a step far above the rank's own recent average goes out at once, alone. The first steps of a
process, and those right after a recovery, are a warm-up (allocations, new communicators, a
recomputed step, peers catching up): they are not counted.
"""
from __future__ import annotations

import time
from typing import Callable

from ...options import WARM_UP_STEPS


class OwnWork:
    """Counted on the training thread (``step_start`` / ``step_end``), taken by the heartbeat (``take``).
    ``waited_s()``: seconds this process has waited in collectives so far; ``clock()``: seconds."""

    def __init__(self, straggler_ratio: float, waited_s: Callable[[], float],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.straggler_ratio = straggler_ratio
        self.waited_s, self.clock = waited_s, clock
        self.steps_done = 0   # steps this process has ended (its warm-up is the first few)
        self.step_s = 0.0     # the last step's time, waits included
        self._t0 = self._waited_t0 = 0.0
        self._sum, self._n = 0.0, 0
        self._avg = 0.0   # its running average: a step far above it is reported at once
        self._judge_from = WARM_UP_STEPS + 1   # the first step whose own work counts (past a warm-up)

    def step_start(self) -> None:
        self._t0, self._waited_t0 = self.clock(), self.waited_s()

    def step_end(self) -> bool:
        """The step ended: counted. True when the heartbeat should go out now (the first figure, or a
        step slower than the rank itself lately)."""
        self.steps_done += 1
        if not self._t0:
            return False
        self.step_s = self.clock() - self._t0
        own = max(0.0, self.step_s - (self.waited_s() - self._waited_t0))
        self._t0 = 0.0
        return self._count(own)

    def _count(self, own: float) -> bool:
        if self.steps_done < self._judge_from:
            return False  # (a warm-up step allocates and connects: no measure of the rank's speed)
        self._sum, self._n = self._sum + own, self._n + 1
        now = False
        if self.steps_done == self._judge_from:
            # Its first figure goes out at once: a straggler's first slow steps are then weighed
            # against every peer's figure, not dropped while the peers' first heartbeats are due.
            now = True
        elif self._avg and own > self.straggler_ratio * self._avg:
            # Slower than itself lately: reported at once, alone (not averaged with the steps
            # before it), so that the controller counts straggling steps one by one.
            self._sum, self._n, now = own, 1, True
        self._avg = 0.9 * self._avg + 0.1 * own if self._avg else own
        return now

    def warm_up_again(self) -> None:
        """After an in-place recovery: the next steps are a warm-up again."""
        self._sum, self._n, self._avg = 0.0, 0, 0.0
        self._judge_from = self.steps_done + WARM_UP_STEPS + 1

    def take(self) -> float | None:
        """The average own work of the steps counted since the last take (None: none was)."""
        total, n = self._sum, self._n
        self._sum, self._n = 0.0, 0
        return total / n if n else None
