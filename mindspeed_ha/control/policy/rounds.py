"""The round runner: plays a playbook's rounds, one at a time, on the controller thread.

A round either sends one order to a set of ranks and collects their answers, or has the controller
act alone (``act``) and wait for a condition (``ready``). The runner owns what every recovery needs
the same way — sending, waiting, collecting, the round's time limit, ranks lost while it waits — and
hands the answers to the round's ``decide``, which says what comes next:

    NEXT          the following round of the list
    Goto(name)    another round of the list (e.g. plan again after a writer was lost)
    DONE          the list is through: the state's outcome is OK
    Fail(reason)  the state's outcome is FAILED (the table says where that leads)

Two rounds can be one order (``with_next``): each rank runs the first's order and then the next's,
and answers both at once, a round trip fewer (rebuild with repair, rollback with resume). The ranks
that answered have gone on (into the next's collectives, or training), so a rank that fails it is not
the end of the state but a new fault (``Port.failed``): the controller stops every survivor (PAUSE),
as for any fault while the job trains, before it plans again.

It sees the job only through a ``Port`` (what a playbook may ask of the controller), so a fake port
drives every playbook in unit tests without processes.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Protocol

from .ledger import Fault


class Port(Protocol):
    """The controller as a playbook sees it: exactly what the playbooks use, nothing else of its state."""

    # ---- orders and who is there
    def order(self, action: str, ranks: Iterable[int], args: dict[str, Any]) -> int:
        """Send ``action`` to the live ones of ``ranks``; returns the order's id."""

    def answers(self, order_id: int) -> dict[int, tuple[bool, Any]]:
        """rank -> (ok, data or error text) for every rank that has answered so far."""

    def quiet(self, order_id: int) -> bool:
        """A live rank still owes its answer, and none failed nor was lost so far (True: the round
        waits; False: the runner looks at every answer). Never True where that is not so."""

    def live(self) -> set[int]:
        """Ranks alive and not finished."""

    def lost(self) -> set[int]:
        """Ranks of the job that are dead (their process lost or condemned)."""

    def host_rank(self) -> int | None:
        """The rank whose process runs this controller (None: a process of its own)."""

    def held(self, rank: int) -> str:
        """Where the rank says its training thread is held, when it has not taken an order ("": no
        such report)."""

    # ---- recover: restarts
    def condemn(self, ranks: list[int]) -> None:
        """Live ranks to be replaced like dead ones (hung, or migrating): marked dead, they owe no answers."""

    def restart(self, ranks: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Have the launcher agents restart these ranks: (restarted by an agent, awaiting a
        replacement node, without any agent — nothing was restarted then)."""

    def restarting(self) -> set[int]:
        """Restarted ranks that have not registered again yet."""

    # ---- the rebuild
    def store(self) -> tuple[str, int]:
        """(host, port) of the TCPStore the ranks' new communicators meet at."""

    def new_generation(self) -> int:
        """A fresh key space in that store for one rebuild or dump."""

    # ---- what happened
    def hung(self, ranks: list[int], detail: str) -> None:
        """Live ranks that stopped answering: a new fault (the recovery starts over with it)."""

    def failed(self, ranks: list[int], detail: str, order_id: int) -> None:
        """Ranks whose answer to a merged round (order ``order_id``) failed while others went on: a new
        fault (the survivors are stopped, and the recovery starts over with it), of the kind each
        rank's answer named (a memory error in its rebuild is one: "other" where it named none)."""

    def emit(self, event: str, **fields: Any) -> None:
        """An event in the controller's event log."""

    def set_note(self, text: str) -> None:
        """What the diagnosis says of the strategy (e.g. where the dying gasp was written)."""

    def closed(self, faults: list[Fault], now: float, moved_bytes: int, phases: dict[str, float]) -> None:
        """A recovery's first step ended: what the faults started (a migration) is done."""

    # ---- elastic
    def scaled(self, dp: int, replica_groups: dict[int, list[int]]) -> None:
        """The job runs at data-parallel size ``dp``; the kept ranks' new replica groups."""

    def leave(self, ranks: list[int], reason: str) -> None:
        """These ranks are out of the layout for good (live ones are told to exit 0)."""


@dataclasses.dataclass(frozen=True)
class Goto:
    name: str


@dataclasses.dataclass(frozen=True)
class Fail:
    reason: str


@dataclasses.dataclass(frozen=True)
class Switch:
    """Nothing failed, but another strategy takes the recovery over (the runner returns
    ``("switch", strategy)``)."""
    strategy: str
    reason: str


NEXT, DONE = object(), object()
Step = Any                     # what a round's decide returns: NEXT, DONE, Goto, Fail or Switch
RunOutcome = str | tuple[str, ...]   # "ok", ("failed", reason) or ("switch", strategy, reason)


@dataclasses.dataclass
class Answers:
    """What a round collected: ``ok`` rank -> data; ``failed`` rank -> why (an error, "no answer"
    past the round's time limit, "lost" when the rank died meanwhile)."""
    ok: dict[int, Any]
    failed: dict[int, Any]
    seconds: float
    held: dict[int, str] = dataclasses.field(default_factory=dict)   # silent ranks' own reports of why

    def why(self, limit: int = 500) -> str:
        # (a silent rank's report is kept whole: it is what explains the silence)
        told = sum(len(text) + 3 for r, text in self.held.items() if r in self.failed)
        return "; ".join(f"rank {r}: {d}" + (f" ({self.held[r]})" if r in self.held else "")
                         for r, d in sorted(self.failed.items()))[:limit + told]


class Memory(Protocol):
    """What the runner needs of an episode (strategies.Episode): the port, and where rounds are timed."""
    port: Port
    phases: dict[str, float]


def everyone(ep: Memory) -> list[int]:
    return sorted(ep.port.live())


def _failed_if_any(ep: Any, ans: Answers) -> Step:
    return NEXT if not ans.failed else Fail(f"failed ({ans.why()})")


@dataclasses.dataclass(frozen=True)
class Round:
    name: str                                     # its entry in the recovery's timed phases
    order: str | None = None                      # action sent to the ranks (None: the controller acts alone)
    # (each callable takes the playbook's episode)
    to: Callable[[Any], Iterable[int]] = everyone
    args: Callable[[Any], dict[str, Any]] = lambda ep: {}
    decide: Callable[[Any, Answers], Step] = _failed_if_any
    wait_s: float = 30.0
    partial: bool = False                         # past wait_s, go on with whoever answered
    silent_is_hung: bool = False                  # past wait_s, a live rank that did not answer is hung
    stop_on_loss: bool = False                    # a rank lost meanwhile: stop the others (they may be blocked on it)
    act: Callable[[Any], Step] | None = None      # controller-only: runs once when the round starts
    ready: Callable[[Any], bool] | None = None    # controller-only: the round ends when this holds (or at wait_s)
    timed: bool = True                            # counted in the recovery's phases
    when: Callable[[Any], bool] | None = None     # skipped (not even timed) unless this holds
    # Where this holds and the next round of the list is played too, to the same ranks: one order for
    # both (its arguments carry the next's as ``then``; the next's must not need this one's answers).
    with_next: Callable[[Any], bool] | None = None


class Runner:
    """Runs one list of rounds for an episode (``ep``: the playbook's working memory, with ``port``
    and ``phases``). ``start()`` then ``tick()`` until either returns an outcome: ``"ok"`` or
    ``("failed", reason)``."""

    def __init__(self, rounds: list[Round], ep: Memory, clock: Callable[[], float] = time.monotonic):
        if not rounds:
            raise ValueError("a playbook state needs at least one round")
        self.rounds, self.ep, self.clock = list(rounds), ep, clock
        self.index = 0
        self.current: Round = rounds[0]
        self.order_id = -1
        self.waiting: set[int] = set()
        self.t0 = 0.0
        self.stopped_for: set[int] = set()
        self.merged: Round | None = None   # the next round, played within the current one's order

    def start(self) -> RunOutcome | None:
        return self._enter(0)

    def _enter(self, index: int) -> RunOutcome | None:
        while True:
            self.index, self.current = index, self.rounds[index]
            self.t0, self.stopped_for = self.clock(), set()
            r = self.current
            if r.when is not None and not r.when(self.ep):
                if index + 1 >= len(self.rounds):
                    return "ok"
                index += 1
                continue
            if r.order is not None:
                self.waiting = set(r.to(self.ep))
                args = r.args(self.ep)
                self.merged = self._mergeable(index)
                if self.merged is not None:
                    args = {**args, "then": [self.merged.order, self.merged.args(self.ep)]}
                self.order_id = self.ep.port.order(r.order, sorted(self.waiting), args)
                return None
            step = r.act(self.ep) if r.act is not None else None
            if step is None and r.ready is not None:
                return None  # wait in tick()
            if step is None:
                step = r.decide(self.ep, Answers({}, {}, 0.0))
            out = self._follow(step)
            if isinstance(out, int):
                index = out
                continue
            return out

    def _mergeable(self, index: int) -> Round | None:
        """The round after ``index``, where the two are to be one order."""
        r = self.rounds[index]
        if r.with_next is None or index + 1 >= len(self.rounds) or not r.with_next(self.ep):
            return None
        nxt = self.rounds[index + 1]
        if nxt.order is None or (nxt.when is not None and not nxt.when(self.ep)) or set(nxt.to(self.ep)) != self.waiting:
            return None
        return nxt

    def _follow(self, step: Step, name: str = "") -> int | RunOutcome:
        """A decision -> the next round's index, or the state's outcome (``name``: the phase timed)."""
        r = self.current
        if r.timed:
            self.ep.phases[name or r.name] = round(self.clock() - self.t0, 4)
        if step is NEXT:
            if self.index + 1 >= len(self.rounds):
                return "ok"
            return self.index + 1
        if step is DONE:
            return "ok"
        if isinstance(step, Goto):
            return next(i for i, x in enumerate(self.rounds) if x.name == step.name)
        if isinstance(step, Fail):
            return ("failed", step.reason)
        if isinstance(step, Switch):
            return ("switch", step.strategy, step.reason)
        raise TypeError(f"round {r.name}: decision {step!r}")

    def tick(self) -> RunOutcome | None:
        """None while the round waits; else the state's outcome."""
        r, now = self.current, self.clock()
        late = now - self.t0 > r.wait_s
        if r.order is None:  # the controller acts alone and waits for a condition
            ready = r.ready is None or r.ready(self.ep)
            if not (ready or late):
                return None
            step = r.decide(self.ep, Answers({}, {} if ready else {-1: "timed out"}, now - self.t0))
        else:
            # (the common case, cheap: at 16,384 ranks the full look below is 2 ms, and a round ticks
            # as its answers come in)
            if not late and not r.stop_on_loss and self.ep.port.quiet(self.order_id):
                return None
            live = self.ep.port.live()
            got = self.ep.port.answers(self.order_id)
            lost = self.waiting - live
            working = (self.waiting & live) - set(got)
            if lost and r.stop_on_loss and not lost <= self.stopped_for:
                self.stopped_for |= lost
                if working:
                    self.ep.port.order("stop", sorted(working), {"reason": f"rank(s) {sorted(lost)} lost during {r.name}"})
            name = f"{r.name}+{self.merged.name}" if self.merged is not None else r.name
            if self.merged is not None and (failed_now := self._failed_now(got, lost)):
                # (at once: the others may wait on it in the next one's collectives, or train on)
                self.ep.port.failed(sorted(failed_now), f"{name} failed ({Answers({}, failed_now, 0.0).why()})",
                                    self.order_id)
                return None
            if working and not late:
                return None
            silent = sorted(working) if late else []
            held = {q: text for q in silent if (text := self.ep.port.held(q))}
            if silent and (r.silent_is_hung or self.merged is not None):
                self.ep.port.hung(silent, f"no answer to {name} within {r.wait_s:g}s"
                                  + "".join(f"; rank {q}: {text}" for q, text in held.items()))
                return None  # (a new fault: the controller starts the recovery over)
            ok: dict[int, Any] = {}
            failed: dict[int, Any] = {}
            for q in self.waiting:
                if q not in live:
                    failed[q] = "lost"  # (an answer from before its death is stale)
                elif q in got:
                    good, data = got[q]
                    if good:
                        ok[q] = data
                    else:
                        failed[q] = data or "failed"
                elif not r.partial:
                    failed[q] = "no answer"
            if self.merged is not None:
                return self._decide_merged(ok, now - self.t0)
            step = r.decide(self.ep, Answers(ok, failed, now - self.t0, held))
        out = self._follow(step)
        if isinstance(out, int):
            return self._enter(out)
        return out

    def _failed_now(self, got: dict[int, tuple[bool, Any]], lost: set[int]) -> dict[int, Any]:
        """The ranks whose answer to a merged round failed (or did not hold both answers), or lost."""
        out = {q: "lost" for q in lost}
        for q in self.waiting & set(got):
            good, data = got[q]
            if not good:
                out[q] = data or "failed"
            elif not (isinstance(data, list) and len(data) == 2):
                out[q] = "did not run both"
        return out

    def _decide_merged(self, ok: dict[int, Any], seconds: float) -> RunOutcome | None:
        """Every rank answered both rounds (its answer: [the first's, the next's]): each round decides
        on its own part, timed as one phase."""
        r, nxt = self.current, self.merged
        assert nxt is not None
        name = f"{r.name}+{nxt.name}"
        step = r.decide(self.ep, Answers({q: d[0] for q, d in ok.items()}, {}, seconds))
        if step is NEXT:
            self.index, self.current = self.index + 1, nxt
            step = nxt.decide(self.ep, Answers({q: d[1] for q, d in ok.items()}, {}, seconds))
        self.merged = None
        out = self._follow(step, name)
        if isinstance(out, int):
            return self._enter(out)
        return out
