"""What a strategy is: its name, the switch that enables it, the faults it handles, and its playbook:
the stages it plays, each an ordered list of rounds (``policy.rounds``) with the time it may take.

The controller's state machine (``policy.states``) does not know one strategy from another: DECIDE
picks one of these, RECOVERING plays its stages one after the other (DUMP plays the dump's), and a
stage's rounds say what each rank is ordered to do.
"""
from __future__ import annotations

import dataclasses

from ..policy.rounds import Round


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    rounds: tuple[Round, ...] = dataclasses.field(repr=False)
    time_limit: float            # seconds the stage may take before its outcome is TIMEOUT


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str                    # as HIGH_AVAILABILITY, the options and the events name it
    switch: str                  # the flag (or command) that enables it
    handles: frozenset[str]      # the fault kinds it can recover
    stages: tuple[Stage, ...] = dataclasses.field(repr=False)  # its playbook, in the order it plays
    failed_event: str = "strategy_failed"  # the event that says it failed (the dump's: dump_refused)
    # Played inside another's stages rather than chosen by DECIDE (the reload is retry's and recover's
    # where no twin can serve; a migration is recover's, asked for while nothing failed).
    part_of: tuple[str, ...] = ()

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def after(self, name: str) -> Stage | None:
        """The stage that follows ``name`` (None: ``name`` is the last)."""
        names = [s.name for s in self.stages]
        i = names.index(name) + 1
        return self.stages[i] if i < len(self.stages) else None
