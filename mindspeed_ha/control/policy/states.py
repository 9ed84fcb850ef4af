"""The recovery state machine: one table, state x outcome -> next state.

The life of a fault reads down the table: NORMAL -fault-> PAUSE (stop every survivor) -stopped->
DECIDE (pick the strategy) -> REPAIR -> ROLLBACK -> NORMAL (retry, recover), DOWNGRADE -> ROLLBACK
(elastic: scale in), or DUMP -> EXIT. Capacity coming back takes the same road without a fault:
NORMAL -scale-out-> PAUSE (at a step boundary) -> DECIDE -> UPGRADE -> ROLLBACK -> NORMAL. The
controller does a state's work when it enters it (REPAIR, ROLLBACK and DUMP play the chosen
playbook's rounds, playbooks.py) and feeds the outcome back here. A state whose work raises feeds
FAILED.
"""
from __future__ import annotations

import enum
import time
from typing import Callable, Iterable


class State(str, enum.Enum):
    INIT = "init"            # waiting for every rank to register
    NORMAL = "normal"        # training
    PAUSE = "pause"          # abnormal: a fault is known, survivors are being stopped
    DECIDE = "decide"        # survivors stopped: pick the strategy for the faults known
    REPAIR = "repair"        # retry / recover: restore the lost state from the twins
    ROLLBACK = "rollback"    # every rank back to the start of the failed step
    DUMP = "dump"            # the survivors write the dying-gasp checkpoint
    DOWNGRADE = "downgrade"  # elastic: drop the failed DP domain
    UPGRADE = "upgrade"      # elastic: a spare returned, scale back out
    EXIT = "exit"            # tell everyone to exit, write the diagnosis
    DONE = "done"            # terminal


class Outcome(str, enum.Enum):
    REGISTERED = "registered"    # every rank registered
    FAULT = "fault"              # a (new) fault was detected
    FINISHED = "finished"        # every rank left cleanly: the job is over
    STOPPED = "stopped"          # every survivor acknowledged stop
    RETRY = "retry"              # strategy: online repair of a memory/communication fault
    RECOVER = "recover"          # strategy: restart the failed process, repair from replicas
    DUMP = "dump"                # strategy: the dump (dying-gasp checkpoint)
    ELASTIC = "elastic"          # strategy: scale in
    NO_STRATEGY = "no-strategy"  # nothing enabled/built can handle this fault
    OK = "ok"                    # the state's action succeeded
    FAILED = "failed"            # the state's action failed
    TIMEOUT = "timeout"          # the state's action ran past its timeout
    SCALE_OUT = "scale-out"      # elastic: ranks of a returned node registered (NORMAL), scale out (DECIDE)


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
    (S.REPAIR, O.FINISHED): S.DONE,
    (S.DECIDE, O.RETRY): S.REPAIR,
    (S.DECIDE, O.RECOVER): S.REPAIR,
    (S.DECIDE, O.DUMP): S.DUMP,
    (S.DECIDE, O.ELASTIC): S.DOWNGRADE,
    (S.DECIDE, O.SCALE_OUT): S.UPGRADE,
    (S.DECIDE, O.NO_STRATEGY): S.EXIT,
    (S.DECIDE, O.FAILED): S.EXIT,
    (S.DECIDE, O.TIMEOUT): S.EXIT,
    (S.DECIDE, O.FAULT): S.PAUSE,
    (S.REPAIR, O.OK): S.ROLLBACK,
    (S.REPAIR, O.ELASTIC): S.DOWNGRADE,  # recover waited out --ha-spare-wait for a lost node: scale in
    (S.REPAIR, O.FAILED): S.DUMP,        # could not repair: save what we have
    (S.REPAIR, O.TIMEOUT): S.DUMP,
    (S.REPAIR, O.FAULT): S.PAUSE,
    (S.ROLLBACK, O.OK): S.NORMAL,
    (S.ROLLBACK, O.FAILED): S.DUMP,
    (S.ROLLBACK, O.TIMEOUT): S.DUMP,
    (S.ROLLBACK, O.FAULT): S.PAUSE,
    (S.DOWNGRADE, O.OK): S.ROLLBACK,
    (S.DOWNGRADE, O.FAILED): S.DUMP,
    (S.DOWNGRADE, O.TIMEOUT): S.DUMP,
    (S.DOWNGRADE, O.FAULT): S.PAUSE,
    (S.UPGRADE, O.OK): S.ROLLBACK,
    (S.UPGRADE, O.FAILED): S.DUMP,       # (a plan refused leaves the newcomers out and ends OK)
    (S.UPGRADE, O.TIMEOUT): S.DUMP,
    (S.UPGRADE, O.FAULT): S.PAUSE,
    (S.DUMP, O.OK): S.EXIT,
    (S.DUMP, O.FAILED): S.EXIT,
    (S.DUMP, O.TIMEOUT): S.EXIT,
    (S.DUMP, O.FAULT): S.DUMP,           # the dump elects among live holders; keep going
    (S.EXIT, O.OK): S.DONE,
    (S.EXIT, O.TIMEOUT): S.DONE,
    (S.EXIT, O.FAILED): S.DONE,
    (S.EXIT, O.FAULT): S.EXIT,
}

# Seconds an action bound to a state may take before the controller feeds TIMEOUT.
TIMEOUTS: dict[State, float] = {
    S.INIT: 600.0, S.PAUSE: 5.0, S.DECIDE: 10.0, S.REPAIR: 180.0, S.ROLLBACK: 30.0,
    S.DUMP: 120.0, S.DOWNGRADE: 60.0, S.UPGRADE: 120.0, S.EXIT: 5.0,
}


class TransitionError(KeyError):
    pass


def next_state(state: State, outcome: Outcome) -> State:
    try:
        return TABLE[(State(state), Outcome(outcome))]
    except KeyError:
        raise TransitionError(f"no transition from {state} on {outcome}") from None


# Which strategy can handle which fault class. retry repairs in place (the process is alive);
# recover restarts a lost process (or moves a live one: migrate); dump saves whatever the survivors
# hold (and is all a preempted job has time for); elastic drops a domain.
HANDLES: dict[str, frozenset[str]] = {
    "retry": frozenset({"memory-error", "comm-failure"}),
    "recover": frozenset({"memory-error", "comm-failure", "other", "process-exit", "hang",
                          "heartbeat-lost", "controller-lost", "node-lost", "migrate"}),
    "dump": frozenset({"memory-error", "comm-failure", "other", "process-exit", "hang",
                       "heartbeat-lost", "controller-lost", "node-lost", "preempted"}),
    # (communication failures: the survivors' view of a lost peer; without a lost rank the plan
    # has nothing to drop and the dump follows)
    "elastic-training": frozenset({"process-exit", "heartbeat-lost", "node-lost", "controller-lost",
                                   "comm-failure"}),
}
STRATEGY_OUTCOME = {"retry": O.RETRY, "recover": O.RECOVER, "dump": O.DUMP, "elastic-training": O.ELASTIC}


def choose_strategy(ordered: list[str], fault_kinds: Iterable[str], built: set[str]) -> tuple[Outcome, str]:
    """First enabled (``ordered``, preference order) and built strategy that handles every fault.

    Returns the outcome to feed the table and a reason for the log.
    """
    kinds = set(fault_kinds)
    skipped = []
    for s in ordered:
        if not kinds <= HANDLES.get(s, frozenset()):
            skipped.append(f"{s} does not handle {', '.join(sorted(kinds - HANDLES.get(s, set())))}")
        elif s not in built:
            skipped.append(f"{s} is not available in this build")
        else:
            return STRATEGY_OUTCOME[s], f"strategy {s}"
    if not ordered:
        skipped.append("no strategy enabled")
    return O.NO_STRATEGY, "; ".join(skipped)


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
