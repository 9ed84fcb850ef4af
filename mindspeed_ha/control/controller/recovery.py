"""The recovery, the controller's side: the survivors stopped (PAUSE), the strategy chosen (DECIDE), its
stages played round by round (RECOVERING, DUMP), each stage's end turned into the state machine's
outcome, and the first step that closes it (NORMAL).

Which strategy is DECIDE's: the options' order, less what the restart budget, a recurring fault and
the scale-in rules (``Scaling.order``) rule out, then the first that handles every fault
(``choose``). The playbook itself is the strategy's (control/strategies): this class only
plays it.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...events import EventLog, get_logger
from ...options import HAOptions
from ..policy.ledger import KIND_SCALE_OUT, FaultLedger
from ..policy.ranks import RankTable
from ..policy.recurrence import Recurrences
from ..policy.rounds import Port, RunOutcome, Runner
from ..policy.states import TIMEOUTS, Outcome as O, State as S
from ..strategies import (DUMP, RECOVER, REGISTRY, SCALE_IN, SCALE_OUT, Episode, FirstStep, Stage, Strategy, choose,
                          failed)
from .orders import Orders
from .restarts import Restarts

if TYPE_CHECKING:
    from .scaling import Scaling

log = get_logger("control.controller")


class Recovery:
    def __init__(self, port: Port, options: HAOptions, world: int, table: RankTable, orders: Orders,
                 ledger: FaultLedger, restarts: Restarts, recurrences: Recurrences, scaling: Scaling,
                 events: EventLog):
        self.port, self.options, self.world, self.table, self.orders = port, options, world, table, orders
        self.ledger, self.restarts, self.recurrences, self.scaling, self.events = (ledger, restarts, recurrences,
                                                                                    scaling, events)
        self.strategy: Strategy | None = None  # the one DECIDE chose (None: no strategy, or the dump's refusal)
        self.stage: Stage | None = None
        self.episode: Episode | None = None
        self.runner: Runner | None = None
        self.first_step: FirstStep | None = None
        self.note = ""                          # what the diagnosis says of the strategy
        self.failure = ""                       # why this episode's strategy failed (the dump follows)
        self._stop_id: int | None = None

    # ---- PAUSE ----------------------------------------------------------------------------------
    def stop_survivors(self, newcomers: set[int]) -> None:
        """Stop every survivor; decision latency is fault detection -> last stop sent."""
        fault = self.ledger.active[-1] if self.ledger.active else None
        # every live rank, reporters of comm failures included; not a newcomer waiting to scale out
        survivors = sorted(self.table.live() - newcomers)
        reason = (f"{fault['kind']} on rank(s) {fault['ranks'][:8]}" if fault else "controller")[:200]
        # Nothing broke for a migration or a scale-out: the ranks park between two steps, no step
        # is interrupted.
        planned = self.ledger.of_kind("migrate", KIND_SCALE_OUT)
        # The reporters' counts of the collectives they issued: what they never entered, the survivors
        # leave without waiting for it.
        entered = {str(r): f["entered"] for f in self.ledger.active if f.get("entered") for r in f["ranks"]}
        self._stop_id = self.orders.send("stop", survivors, {"reason": reason, **({"boundary": True} if planned else {}),
                                                             **({"entered": entered} if entered else {})})
        if fault is not None:
            decide_ms = (time.monotonic() - fault["t_detect"]) * 1e3
            cpu_ms = (time.thread_time() - fault["cpu_detect"]) * 1e3  # wall minus waiting for a CPU
            self.events.emit("decision", action="stop", ranks=len(survivors), decide_ms=round(decide_ms, 3),
                             cpu_ms=round(cpu_ms, 3))

    def stopped(self) -> bool:
        """PAUSE is over the moment every rank is accounted for: each live rank answered the stop
        (so it was alive after the fault), and a rank that cannot answer left the live set — its
        agent reported its exit (about 20 ms) or its silence reached the loss limit. The strategy
        then sees the real cause: a killed rank's exit report, not only its peers' broken links."""
        return not (self.orders.waiting(self._stop_id) & self.table.live())

    # ---- DECIDE ---------------------------------------------------------------------------------
    def decide(self) -> O:
        self.failure = ""
        kinds = {f["kind"] for f in self.ledger.active}
        if kinds == {KIND_SCALE_OUT}:
            return self._chose(SCALE_OUT, "scale-out onto returned rank(s)", kinds)
        if KIND_SCALE_OUT in kinds:  # a fault came first: its recovery; the newcomers are asked again after it
            self.ledger.close_planned(KIND_SCALE_OUT)
            kinds.discard(KIND_SCALE_OUT)
        ordered = self.options.ordered_strategies()
        recurs = self.recurrences.refusal(self.ledger.active)
        if recurs:  # not the machine's: no recovery, only the dump (none before a first step: nothing to save)
            dump = DUMP if DUMP.name in ordered and not self.recurrences.setup else None
            why = f"no recovery: {recurs}" + ("" if dump else "; the job ends at once")
            self.note, self.strategy = why, None
            outcome = O.DUMP if dump else O.NO_STRATEGY
            self.events.emit("strategy", outcome=dump.name if dump else outcome.value, reason=why)
            log.error("strategy for %s: %s (%s)", sorted(kinds), dump.name if dump else outcome.value, why)
            return outcome
        recover = RECOVER.name
        refusal = self.restarts.refusal() if recover in ordered else None
        if refusal:
            ordered = [s for s in ordered if s != recover]
            self.restarts.budget.spent = f"recover not tried: {refusal}"
        if SCALE_IN.name in ordered:
            ordered, why_not = self.scaling.order(ordered)
            refusal = "; ".join(x for x in (refusal, why_not) if x) or None
        chosen, why = choose(ordered, kinds)
        if refusal:
            why = f"recover not tried: {refusal}; {why}"
        if self.scaling.spare_wait and chosen is RECOVER:
            why += self.scaling.waiting_note()
        if chosen is None:
            self.note, self.strategy = why, None
            self.events.emit("strategy", outcome=O.NO_STRATEGY.value, reason=why)
            log.info("strategy for %s: %s (%s)", sorted(kinds), O.NO_STRATEGY.value, why)
            return O.NO_STRATEGY
        return self._chose(chosen, why, kinds)

    def _chose(self, strategy: Strategy, why: str, kinds: set[str]) -> O:
        self.note, self.strategy = why, strategy
        self.events.emit("strategy", outcome=strategy.name, reason=why)
        log.info("strategy for %s: %s (%s)", sorted(kinds), strategy.name, why)
        return O.DUMP if strategy is DUMP else O.CHOSEN

    # ---- RECOVERING, DUMP -------------------------------------------------------------------------
    def play(self, state: S, outcome: O) -> O | None:
        """Entering RECOVERING or DUMP on ``outcome``: a new episode for a strategy begun (chosen,
        switched to, or the dump), or the next stage of the one under way."""
        if state == S.DUMP:
            self.strategy = DUMP
        assert self.strategy is not None  # (DECIDE chose one, or the dump follows)
        if outcome == O.STAGE:
            assert self.stage is not None and self.episode is not None
            self.stage = self.strategy.after(self.stage.name)
            self.recurrences.count(self.ledger.active)  # the state is mended: each fault was recovered once more
        else:
            self.stage = self.strategy.stages[0]
            self.episode = self._episode(self.strategy, timed=state == S.RECOVERING)
        assert self.stage is not None and self.episode is not None
        self.events.emit("stage", strategy=self.strategy.name, stage=self.stage.name,
                         rounds=[r.name for r in self.stage.rounds])
        log.info("%s: %s (%s)", self.strategy.name, self.stage.name, " -> ".join(r.name for r in self.stage.rounds))
        self.runner = Runner(list(self.stage.rounds), self.episode)
        out = self.runner.start()
        return None if out is None else self.outcome(out)

    def _episode(self, strategy: Strategy, timed: bool) -> Episode:
        first = self.ledger.active[0] if self.ledger.active else None
        live = [i for i in self.table.ranks.values() if i.alive]
        episode = Episode(self.port, strategy.name, self.world, self.ledger.active,
                          {r: i.groups[0] for r, i in self.table.ranks.items() if i.groups},
                          replica=all(i.groups for i in live),  # (no replicas: groups are not sent)
                          spare_wait=self.scaling.spare_wait if strategy is RECOVER else None,
                          left=frozenset(self.scaling.left))
        if first is not None and timed:
            episode.phases["detect"] = first["detect_s"]
            # detection -> every survivor stopped and the strategy chosen
            episode.phases["stop"] = round(time.monotonic() - first["t_detect"], 4)
        return episode

    def tick(self) -> O | None:
        """The stage's rounds, on: its outcome once it has one."""
        runner = self.runner
        out = runner.tick() if runner is not None else None
        if out is None or self.runner is not runner:
            return None  # (a fault came meanwhile: the table moved on, this round's outcome is moot)
        return self.outcome(out)

    def outcome(self, out: RunOutcome) -> O:
        assert self.strategy is not None and self.stage is not None and self.episode is not None
        if out == "ok":
            return O.STAGE if self.strategy.after(self.stage.name) is not None else O.OK
        if out[0] == "switch":  # recover waited out the spare wait: the same episode scales in
            self.scaling.switched(out[2])
            self.note, self.strategy = out[2], REGISTRY[out[1]]
            return O.SWITCH
        failure = failed(self.strategy.failed_event, self.episode, out[1])
        if self.strategy is not DUMP:
            self.failure = self.note = failure
        else:  # (after a failed recovery the diagnosis names both: the first is what ended the job)
            self.note = f"{self.failure}; then the dump: {failure}" if self.failure else failure
        return O.FAILED

    def raised(self, state: S, error: Exception) -> None:
        """The work of ``state`` raised (its FAILED outcome follows): the diagnosis says so."""
        if state == S.RECOVERING and self.strategy is not None and self.stage is not None:
            self.failure = self.note = (f"{self.strategy.name} failed "
                                        f"(its {self.stage.name} raised {type(error).__name__}: {error})")

    def first_stage(self) -> bool:
        """The strategy under way is in its first stage (a migration's restart may still be ahead)."""
        return self.strategy is not None and self.stage is self.strategy.stages[0]

    def limit(self, state: S, now: float, dead_after: float) -> float | None:
        """A state's time limit: RECOVERING's is its stage's. The dump's is --ha-dump-timeout, or grows
        with the state to write (50 MB/s at least), and while its writers show progress it is extended,
        up to three times."""
        if state == S.PAUSE:  # a silent rank (its node gone with its agent) must be declared lost first
            return max(TIMEOUTS[S.PAUSE], dead_after + 2.0)
        if state == S.RECOVERING and self.stage is not None:
            return self.stage.time_limit
        if state != S.DUMP:
            return TIMEOUTS.get(state)
        base = DUMP.stages[0].time_limit
        if self.episode is None:
            return base
        if any(f["kind"] == "preempted" for f in self.episode.faults):
            return self.options.term_grace_s  # the scheduler kills the job after its grace: no extension
        base = self.options.dump_timeout_s or max(base, 30.0 + self.episode.state_bytes / 50e6)
        writers = [self.table.ranks[r] for r in self.episode.statuses
                   if r in self.table.ranks and self.table.ranks[r].alive]
        moving = writers and now - max(i.progress_at for i in writers) < 30.0
        return 3 * base if moving else base

    # ---- NORMAL again -----------------------------------------------------------------------------
    def resumed(self, now: float) -> None:
        """Training again after the recovery's last stage (its reports settled): its first step will
        close it."""
        assert self.episode is not None
        self.first_step = FirstStep(self.episode, self.ledger.close_active(), now)
        self.table.moved(now)

    def close_by_fault(self, iteration: int, detect_s: float) -> None:
        """A fault while the first step after a recovery was awaited: that recovery ends here. A
        fault past the awaited step proves that step done on every rank (its collectives needed them
        all), even if a rank's report of it has not come; a fault inside it interrupted a job that was
        training again."""
        if self.first_step is None:
            return
        done = max(iteration, self.table.newest_iteration()) > self.first_step.target
        self.first_step.close_by_fault(time.monotonic(), detect_s, done)
        self.first_step = None

    def check_first_step(self, now: float, newcomers: set[int]) -> None:
        if self.first_step is not None and self.first_step.check(
                now, self.table.completed(self.first_step.target, newcomers)):
            self.first_step = None

    def dump_result(self) -> dict[str, Any] | None:
        """The dying-gasp checkpoint this job's dump wrote (None: none was)."""
        return self.episode.result if self.episode is not None and self.strategy is DUMP else None
