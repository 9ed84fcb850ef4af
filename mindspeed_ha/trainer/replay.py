"""A data iterator that can hand out again what an interrupted step drew.

A rollback recomputes the failed step with the same microbatches. The built-in trainer simply
rebuilds its iterator at the step's data position; a training loop that owns its iterator object
(Megatron-LM's) cannot be handed a new one, so the object it reads from replays instead.
"""
from __future__ import annotations


class Replayable:
    def __init__(self, source) -> None:
        self._source = iter(source)
        self._drawn: list = []    # items of the current step, in order
        self._pending: list = []  # items to hand out again before reading on

    def __iter__(self):
        return self

    def __next__(self):
        item = self._pending.pop(0) if self._pending else next(self._source)
        self._drawn.append(item)
        return item

    def drawn(self) -> list:
        """The items the current step has read so far."""
        return list(self._drawn)

    def begin_step(self) -> None:
        """Items of completed steps are never needed again."""
        self._drawn = []

    def rewind(self) -> None:
        """The step starts over: what it drew comes again, in the same order."""
        self._pending = self._drawn + self._pending
        self._drawn = []

    def restart(self, source) -> None:
        """Reads come from ``source`` from now on (a new layout's iterator); nothing is replayed."""
        self._source, self._drawn, self._pending = iter(source), [], []
