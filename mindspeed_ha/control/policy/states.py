"""The recovery state machine: one table, state x outcome -> next state, the same for every strategy.

The life of a fault reads down the table: NORMAL -fault-> PAUSE (stop every survivor) -stopped->
DECIDE (pick the strategy) -> RECOVERING (the strategy's stages, one after the other) -> NORMAL, or
DUMP -> EXIT. Capacity coming back takes the same road without a fault: NORMAL -scale-out-> PAUSE (at
a step boundary) -> DECIDE -> RECOVERING (scale-out) -> NORMAL. The controller does a state's work when
it enters it (RECOVERING and DUMP play the chosen strategy's stage, control/strategies) and feeds the
outcome back here; which strategy, and which of its stages, is the controller's, not the table's. A
state whose work raises feeds FAILED.
"""
from __future__ import annotations

import enum
import time
from typing import Callable


class State(str, enum.Enum):
    INIT = "init"            # waiting for every rank to register
    NORMAL = "normal"        # training
    PAUSE = "pause"          # abnormal: a fault is known, survivors are being stopped
    DECIDE = "decide"        # survivors stopped: pick the strategy for the faults known
    RECOVERING = "recovering"  # the chosen strategy plays its stages
    DUMP = "dump"            # the survivors write the dying-gasp checkpoint
    EXIT = "exit"            # tell everyone to exit, write the diagnosis
    DONE = "done"            # terminal


class Outcome(str, enum.Enum):
    REGISTERED = "registered"    # every rank registered
    FAULT = "fault"              # a (new) fault was detected
    FINISHED = "finished"        # every rank left cleanly: the job is over
    STOPPED = "stopped"          # every survivor acknowledged stop
    CHOSEN = "chosen"            # DECIDE chose a strategy that recovers (retry, recover, elastic, scale-out)
    DUMP = "dump"                # DECIDE chose the dump (dying-gasp checkpoint)
    NO_STRATEGY = "no-strategy"  # nothing enabled/built can handle this fault
    STAGE = "stage"              # a strategy's stage is through and its next one begins
    SWITCH = "switch"            # the strategy gave the episode to another (recover waited out: scale in)
    OK = "ok"                    # the state's action succeeded
    FAILED = "failed"            # the state's action failed
    TIMEOUT = "timeout"          # the state's action ran past its timeout
    SCALE_OUT = "scale-out"      # elastic: ranks of a returned node registered (NORMAL)


S, O = State, Outcome
TABLE: dict[tuple[State, Outcome], State] = {
    (S.INIT, O.REGISTERED): S.NORMAL,
    (S.INIT, O.FAULT): S.PAUSE,
    (S.INIT, O.FINISHED): S.DONE,
    (S.INIT, O.TIMEOUT): S.EXIT,
    (S.NORMAL, O.FAULT): S.PAUSE,
    (S.NORMAL, O.FINISHED): S.DONE,
    (S.NORMAL, O.SCALE_OUT): S.PAUSE,    # returned ranks registered: every rank parks at a step boundary
    (S.PAUSE, O.STOPPED): S.DECIDE,
    (S.PAUSE, O.TIMEOUT): S.DECIDE,      # a survivor that won't stop is a new fault; decide anyway
    (S.PAUSE, O.FAILED): S.DECIDE,
    (S.PAUSE, O.FAULT): S.PAUSE,         # more faults while stopping: same pause, wider fault set
    (S.PAUSE, O.FINISHED): S.DONE,       # a migration asked for as the job ended its last step
    (S.DECIDE, O.CHOSEN): S.RECOVERING,
    (S.DECIDE, O.DUMP): S.DUMP,
    (S.DECIDE, O.NO_STRATEGY): S.EXIT,
    (S.DECIDE, O.FAILED): S.EXIT,
    (S.DECIDE, O.TIMEOUT): S.EXIT,
    (S.DECIDE, O.FAULT): S.PAUSE,
    (S.RECOVERING, O.STAGE): S.RECOVERING,
    (S.RECOVERING, O.SWITCH): S.RECOVERING,  # recover waited out --ha-spare-wait for a lost node: scale in
    (S.RECOVERING, O.OK): S.NORMAL,
    (S.RECOVERING, O.FAILED): S.DUMP,    # could not recover: save what we have
    (S.RECOVERING, O.TIMEOUT): S.DUMP,
    (S.RECOVERING, O.FAULT): S.PAUSE,
    (S.RECOVERING, O.FINISHED): S.DONE,
    (S.DUMP, O.OK): S.EXIT,
    (S.DUMP, O.FAILED): S.EXIT,
    (S.DUMP, O.TIMEOUT): S.EXIT,
    (S.DUMP, O.FAULT): S.DUMP,           # the dump elects among live holders; keep going
    (S.EXIT, O.OK): S.DONE,
    (S.EXIT, O.TIMEOUT): S.DONE,
    (S.EXIT, O.FAILED): S.DONE,
    (S.EXIT, O.FAULT): S.EXIT,
}

# Seconds an action bound to a state may take before the controller feeds TIMEOUT (RECOVERING and
# DUMP: the stage's own, control/strategies).
TIMEOUTS: dict[State, float] = {S.INIT: 600.0, S.PAUSE: 5.0, S.DECIDE: 10.0, S.EXIT: 5.0}


class TransitionError(KeyError):
    pass


def next_state(state: State, outcome: Outcome) -> State:
    try:
        return TABLE[(State(state), Outcome(outcome))]
    except KeyError:
        raise TransitionError(f"no transition from {state} on {outcome}") from None


class Machine:
    """The current state and the clock of its entry; ``feed`` applies the table and logs the move."""

    def __init__(self, on_transition: Callable[[State, Outcome, State, float], None] | None = None,
                 state: State = S.INIT):
        self.state = state
        self.entered = time.monotonic()
        self.history: list[tuple[State, Outcome, State, float]] = []
        self._on_transition = on_transition

    def feed(self, outcome: Outcome) -> State:
        new = next_state(self.state, outcome)
        now = time.monotonic()
        seconds = now - self.entered
        old = self.state
        self.history.append((old, Outcome(outcome), new, seconds))
        self.state, self.entered = new, now
        if self._on_transition:
            self._on_transition(old, Outcome(outcome), new, seconds)
        return new

    def overdue(self, limit: float | None = None) -> bool:
        """Past the state's time limit (``limit``: this time's, else the table's)."""
        limit = TIMEOUTS.get(self.state) if limit is None else limit
        return limit is not None and time.monotonic() - self.entered > limit
