"""A rank's stop, as one object: the stop itself, its park, its abort, its commit marks and the
failures it defers. ``comm.interruptible`` builds the collectives that obey one; the processor
requests and parks it, the recovery clears it, the trainers' commit points ask it whether a result
is whole.

What a stop does: every collective blocked in (or entering) the code a recovery covers raises
:class:`CollectiveStopped` within one wait slice, after a grace for one already in flight (its peers
may have completed it). On a stream-ordered backend (NCCL, HCCL, the emulated NCCL) nothing raises:
once a collective issued before the stop is still pending after the grace, every communicator of the
process is aborted at once under a deadline (``comm.abort``), and from then on a commit point refuses
until the stop is cleared. A training thread that has not reached the recovery by that deadline is
held for good: the held hooks say so (the session reports the rank hung, to be replaced).

The process has one stop (``comm.interruptible.PROCESS_STOP``: megatron-core calls the patched
collectives with no object in hand); this module keeps no state of its own, so two stops can live in
one process (the tests make two).
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Callable, NamedTuple

from mindspeed_ha.comm import abort as _abort
from mindspeed_ha.device.accelerators import of_type
from mindspeed_ha.device.waits import EventWaits, HostWaits
from mindspeed_ha.faults import CollectiveStopped

__all__ = ["CollectiveStopped", "Entered", "InFlight", "Issued", "Park", "Stop", "as_stop"]

# One wait slice: the bound on stop latency. A slice ends at once when the work completes, so its
# length costs nothing on the fast path.
WAIT_SLICE_S = 0.02
# A collective already in flight gets this long to finish after a stop: its peers may have completed
# it (the stop reached this rank a moment later), and leaving it then would split them — e.g. TP
# peers on either side of the grad-norm all-reduce, one updating its shard and one not.
STOP_GRACE_S = 0.1
# Between a trainer's hooked calls (Megatron-LM's own loop: its timers' barriers, its logging
# reductions) no recovery is served: a rank thrown out of a collective there ends its process. A
# stop comes when a peer faulted in a hooked call, so every collective before that call is one the
# peer has passed: there a stop lets the collective finish (on a loaded host a peer's completion can
# take far longer than STOP_GRACE_S to be seen), and the rank raises at its next hooked call. Only a
# collective still unfinished after this long (a peer that faulted before it) fails. A collective that
# fails there (a stop's grace passed, or a peer lost in it) must not end the process either: its error
# is kept for the rank's next hooked call (``raise_deferred``), and until then the collectives of that
# code, which only time and log the loop, are answered by this rank alone.
UNCOVERED_GRACE_S = 10.0
# A training thread that has not reached the recovery (waiting for its orders) this long after a
# stop's grace is taken to be held on the device behind a collective no wrapper saw: one a library
# issued through the backend itself, a communicator's set-up inside a collective. Nothing tracked is
# pending then, yet the thread can leave only if the communicators are aborted, so they are. It costs
# nothing a recovery would not pay: every recovery after a stop replaces them.
BACKSTOP_S = 5.0
# The collectives none of whose members can complete while one member has not entered them (a
# broadcast's receivers, say, can complete without a third member): a faulted rank's counts say which
# of them it never entered (``Issued``).
NEEDS_EVERY_MEMBER = frozenset({"all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
                                "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
                                "_reduce_scatter_base", "reduce_scatter_single", "barrier", "all_to_all",
                                "all_to_all_single"})
# A stop's abort is bounded (``comm.abort``): its communicators' aborts are waited for this long, and a
# training thread that has not reached the recovery this long after they began is held for good.
STOP_DEADLINE_S = _abort.DEADLINE_S


def _log():
    from mindspeed_ha.events import get_logger
    return get_logger("comm")


class Tag(NamedTuple):
    """A collective that needs every member, as its issuer counted it (``Issued``)."""
    key: str            # its group's
    n: int              # its number among the group's collectives
    members: frozenset  # the group's members, ranks of the default group


class Issued:
    """How many collectives this process issued on each group (a group is known by its members, ranks
    of the default group) since its counts began: at the process's start, and again at each
    recovery's resume, before any collective of the step it resumes. Every member issues a group's
    collectives in the same order (the backends match them by order), so a collective is the n-th of
    its group on every member: a faulted rank's counts, sent with its report, say which collectives it
    never entered — and a survivor waiting in one of those that needs every member knows no member can
    complete it. (Two groups with the same members share a count: each rank issues on them in the
    same program order, so the shared count is aligned too.)

    The counts are aligned with the job's only from a resume to the next stop or fault of the rank: a
    stop leaves collectives counted on one rank and never issued on another, and a recovery's own
    collectives (a restarted rank's set-up among them) are not every member's. ``identify(group)``:
    the group's key and members (None: nothing is counted)."""

    def __init__(self, identify: Callable[[object], tuple[str, frozenset]] | None = None) -> None:
        self._identify = identify
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        # Each group object's key and members, by id, with a weak reference that proves the id is still
        # that group's (a strong one would hold up a replaced communicator's release).
        self._groups: dict[int, tuple[Callable[[], object] | None, str, frozenset]] = {}
        self._aligned = True
        # Each group's last collective: its kind and where it was issued, and the group's members (what
        # a desync's evidence says of this rank: ``evidence``).
        self._last: dict[str, tuple[str, str]] = {}
        self._members: dict[str, frozenset] = {}

    def issue(self, group, name: str, where: str = "") -> Tag | None:
        """One collective ``name`` issued on ``group`` (None: the default group) at ``where`` (its
        caller): its tag, when it needs every member."""
        if self._identify is None:
            return None
        with self._lock:
            known = self._groups.get(id(group))
            if known is None or (known[0]() if known[0] is not None else None) is not group:
                key, members = self._identify(group)
                self._groups[id(group)] = (_weak(group), key, members)
                self._members[key] = members
            else:
                _, key, members = known
            n = self._counts[key] = self._counts.get(key, 0) + 1
            self._last[key] = (name, where)
        return Tag(key, n, members) if name in NEEDS_EVERY_MEMBER else None

    def evidence(self) -> dict[str, list]:
        """Each group's count, last collective's kind and issue site, and members (ranks of the default
        group): what a rank that has waited in a collective for long says of itself (a desync is
        members of one group with different counts, or different kinds at the same count)."""
        with self._lock:
            return {key: [n, *self._last.get(key, ("", "")), sorted(self._members.get(key, ()))]
                    for key, n in self._counts.items()}

    def freeze(self) -> dict[str, int] | None:
        """The counts as they stand (None: not aligned with the job's); not aligned from now on (a
        stop or a fault of this rank)."""
        with self._lock:
            counts = dict(self._counts) if self._aligned and self._identify is not None else None
            self._aligned = False
            return counts

    def now(self) -> dict[str, int]:
        """The counts as they stand: a stopped rank's final ones once its training thread has left the
        step (it issues nothing more before the resume; each collective is counted by its issuer)."""
        with self._lock:
            return dict(self._counts)

    def restart(self) -> None:
        """A recovery's resume, before any collective of the step it resumes: counting starts again."""
        with self._lock:
            self._counts.clear()
            self._groups.clear()
            self._last.clear()
            self._members.clear()
            self._aligned = True


def _weak(group) -> Callable[[], object] | None:
    """A weak reference to ``group`` (for ``None``, the default group, one that always gives None; None
    where ``group`` takes no weak reference: it is identified again at each collective)."""
    if group is None:
        return lambda: None
    try:
        return weakref.ref(group)
    except TypeError:
        return None


class Entered:
    """What the stop in force knows of the collectives the faulted ranks issued: the counts
    (``Issued``) their reports carried, by their rank in the default group — taken only when this
    rank's own counts were aligned with theirs as the stop came. A collective that needs every member
    and that one of them never entered cannot complete."""

    def __init__(self) -> None:
        self.aligned = False  # this rank's counts were aligned as the stop came
        self._by_member: dict[int, dict[str, int]] = {}
        # The ranks that made the stop abort its communicators before the grace (none could complete).
        self.aborted_for: list[int] = []

    def take(self, entered: dict | None) -> bool:
        """``entered``: by job rank, each rank's place in the default group (``member``) and counts.
        True if taken (this rank's own counts were aligned as the stop came)."""
        if entered and self.aligned:
            self._by_member = {**self._by_member,
                               **{int(e["member"]): dict(e["counts"]) for e in entered.values()}}
            return True
        return False

    def never(self, tag: Tag | None) -> list[int]:
        """The ranks (of the default group) that are members of the collective ``tag`` and never entered it."""
        if tag is None or not self._by_member:
            return []
        key, n, members = tag
        return sorted(r for r, counts in self._by_member.items() if r in members and n > counts.get(key, 0))

    def none_can_complete(self, pending: list[Tag | None]) -> list[int]:
        """The ranks that never entered the ``pending`` collectives, when none of them can complete (else
        empty: one can, or none is pending)."""
        never = [self.never(t) for t in pending]
        return sorted({r for n in never for r in n}) if never and all(never) else []

    def reset(self, aligned: bool = False) -> None:
        self.aligned, self._by_member, self.aborted_for = aligned, {}, []


class InFlight:
    """What a process waits for in collectives: gloo's waits (polled on the host), and on
    stream-ordered backends the works issued and not seen complete (what a stop's abort is for) with
    the waits for them by device kind. The waits are the evidence hang diagnosis and straggler
    detection read.

    Once a stop's abort begins, no work is asked whether it completed (``frozen``): torch's
    ``Work.is_completed`` takes its communicator's mutex, which the abort holds until NCCL returns,
    and its binding keeps the GIL — asked then, from any thread, it can freeze the whole process in
    exactly the case where the rank must report itself held. What was pending is counted as the
    abort begins and kept until the stop is cleared."""

    def __init__(self) -> None:
        self.used = False  # a stream-ordered collective was issued by this process
        self.polled = HostWaits()
        self._lock = threading.Lock()
        self._works: list = []
        self._tags: dict[int, Tag] = {}
        self._groups: dict[int, object] = {}  # each work's group (what a stop's abort aborts)
        self._waits: dict[str, HostWaits | EventWaits] = {}
        self._frozen: int | None = None  # works pending as the abort began (None: no abort since forget)

    def freeze(self) -> int:
        """An abort begins (before it touches a communicator): count what is pending one last time and
        keep that count; no work is asked again until ``forget``."""
        with self._lock:
            if self._frozen is None:
                self._works = [w for w in self._works if not w.is_completed()]
                self._frozen = len(self._works)
            return self._frozen

    def issued(self, work, tag: Tag | None = None, group: object = None) -> None:
        """``work`` was issued on ``group`` (None: not known; a stop's abort then aborts every group)."""
        self.used = True
        with self._lock:
            self._groups[id(work)] = group
            if self._frozen is not None:  # (after an abort began: kept, never asked)
                self._works.append(work)
                return
            self._works = [w for w in self._works if not w.is_completed()] + [work]
            self._tags = {id(w): self._tags[id(w)] for w in self._works if id(w) in self._tags}
            self._groups = {id(w): self._groups[id(w)] for w in self._works}
            if tag is not None:
                self._tags[id(work)] = tag

    def pending_tags(self) -> list[Tag | None]:
        """The tags of the stream-ordered works issued and not complete (None where not tagged)."""
        with self._lock:
            if self._frozen is None:
                self._works = [w for w in self._works if not w.is_completed()]
            return [self._tags.get(id(w)) for w in self._works]

    def groups_to_abort(self) -> list | None:
        """The groups with a stream-ordered collective pending, once each (None: a work of an unknown
        group among them, or none: a stop's abort then aborts every group)."""
        groups = self.pending_groups()
        if not groups or any(g is None for g in groups):
            return None
        return list({id(g): g for g in groups}.values())

    def pending_groups(self) -> list:
        """The groups of the stream-ordered works issued and not complete (None where not known)."""
        with self._lock:
            if self._frozen is None:
                self._works = [w for w in self._works if not w.is_completed()]
            return [self._groups.get(id(w)) for w in self._works]

    def waits(self, kind: str) -> HostWaits | EventWaits:
        if kind not in self._waits:
            with self._lock:
                self._waits.setdefault(kind, of_type(kind).waits())
        return self._waits[kind]

    def pending(self) -> bool:
        return bool(self.pending_count()) or any(w.pending() for w in list(self._waits.values()))

    def pending_count(self) -> int:
        """The stream-ordered works issued and not complete (once an abort began: those pending then)."""
        with self._lock:
            if self._frozen is not None:
                return self._frozen
            self._works = [w for w in self._works if not w.is_completed()]
            return len(self._works)

    def waiting(self) -> bool:
        """This rank waits in a collective now: for a peer, not stuck itself."""
        return self.polled.waiting() or any(w.waiting() for w in list(self._waits.values()))

    def waited_s(self) -> float:
        """Seconds this process spent waiting for collectives (a rank's own work is the rest)."""
        return self.polled.waited_s() + sum(w.waited_s() for w in list(self._waits.values()))

    def forget(self) -> None:
        with self._lock:
            self._works = []
            self._tags = {}
            self._groups = {}
            self._frozen = None


class Park:
    """A stop at the next step boundary. A planned recovery (a migration) parks every rank between
    two steps, so no step is interrupted and nothing is rolled back. A rank that had already begun the
    next step when the order came waits in its first collective for peers that parked: after the
    grace it is stopped there instead (its partial step is cleaned up by the recovery, as after any
    stop)."""

    def __init__(self, stop: Callable[[str], None]) -> None:
        self._stop = stop
        self._asked = threading.Event()
        self._timer: threading.Timer | None = None

    def request(self, reason: str, grace_s: float) -> None:
        """Have the training thread park at its next step start (``take``); a stop after ``grace_s``."""
        self.cancel()
        self._asked.set()

        def stop_if_parked() -> None:
            if self._asked.is_set():
                self._stop(reason)
        self._timer = threading.Timer(grace_s, stop_if_parked)
        self._timer.daemon = True
        self._timer.start()

    def take(self) -> bool:
        """At a step start: True (once) if a park was requested; the stop that would follow is called off."""
        if not self._asked.is_set():
            return False
        self.cancel()
        return True

    def cancel(self) -> None:
        self._asked.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Stop:
    """One rank's stop. ``abort_communicators(deadline_s, groups)`` aborts the process's stream-ordered
    communicators (those of ``groups``; None: all) and says what it did (``comm.abort.abort_registered``);
    the grace periods are the module's constants, kept per stop so a drill can shorten its own."""

    def __init__(self, abort_communicators: Callable[[float, list | None], _abort.AbortReport | None] | None = None,
                 identify_group: Callable[[object], tuple[str, frozenset]] | None = None):
        """``identify_group(group)``: a group's key and members (ranks of the default group), for the
        counts of ``issued`` (None: no counts, and every collective waits out its grace)."""
        self.in_flight = InFlight()
        self.issued = Issued(identify_group)
        self.entered = Entered()  # what the faulted ranks issued (``never_entered``)
        self.park = Park(self.request)
        self.grace_s, self.uncovered_grace_s = STOP_GRACE_S, UNCOVERED_GRACE_S
        self.backstop_s, self.deadline_s = BACKSTOP_S, STOP_DEADLINE_S
        self._abort_communicators = abort_communicators
        self._held_hooks: list[Callable[[str], None]] = []
        self._set = threading.Event()
        self._reason, self._stopped_at = "", 0.0
        self._thread = threading.local()  # .uncovered: this thread runs code no recovery covers
        self._uncovered = False  # the training thread does (what the aborter reads)
        self._deferred: BaseException | None = None  # a collective's failure there, for the next hooked call
        self._loop_alone = False  # the uncovered code's collectives are answered alone until the next hooked call
        self._aborted = False  # communicators were aborted since the last clear: a result read now may be partial
        self._aborter: tuple[threading.Thread, int] | None = None  # the aborter, and the stop it serves
        # The training thread has waited for the controller's orders (``awaiting_orders``) since the stop:
        # it left the step, and serves the recovery until ``left_recovery``: not held in a step, however
        # long an order takes (a dump's write, a large shard's repair).
        self._reached = threading.Event()
        # Held by an abort and by ``clear``: a recovery that clears the stop (and then makes new
        # communicators) never runs beside an abort still deciding or aborting the old ones.
        self._abort_lock = threading.Lock()
        # The last abort: (seconds after its stop it began, seconds it took or None while it runs, why).
        self._abort_info: tuple[float, float | None, str] | None = None
        self._abort_report: _abort.AbortReport | None = None
        # Commit points passed, by how many stops had been cleared then: a commit point that passed
        # after a result was issued, and before the next stop was cleared, proves that result whole.
        self._cleared = 0
        self._passed: dict[int, int] = {}

    # ---- requesting and clearing -------------------------------------------------------------
    def request(self, reason: str = "", entered: dict | None = None) -> None:
        """Make every blocked or future collective raise ``CollectiveStopped`` until ``clear()``. Safe
        from any thread. Stream-ordered communicators are aborted once a collective issued before the
        stop is still pending after the grace a gloo one gets. ``entered``: what the faulted ranks sent
        with their reports, by job rank: each one's rank in the default group (``member``) and its counts
        of the collectives it issued (``counts``, ``Issued``): a collective one of them never entered is
        left at once."""
        self._reason = reason
        if not self._set.is_set():
            self._stopped_at = time.monotonic()
            self.entered.reset(aligned=self.issued.freeze() is not None)
            self.entered.take(entered)
            self._set.set()
        else:
            self.entered.take(entered)
        if self.in_flight.used and (self._aborter is None or not self._aborter[0].is_alive()
                                    or self._aborter[1] != self._cleared):
            thread = threading.Thread(target=self._abort_when_due, args=(self._cleared,),
                                      name="mindspeed-ha-aborter", daemon=True)
            self._aborter = (thread, self._cleared)
            thread.start()

    def requested(self) -> bool:
        return self._set.is_set()

    def never_entered(self, tag: Tag | None) -> list[int]:
        """The faulted ranks that sent their counts, are members of the collective ``tag`` and never
        entered it: if any, no member can complete it, so the grace a stop gives it is waited for nothing."""
        return self.entered.never(tag)

    def grace_over(self, stopped_at: float, tag: Tag | None = None) -> bool:
        """A collective this thread has waited in since the stop it saw at ``stopped_at`` is left now:
        its grace passed, or a faulted rank never entered it."""
        return time.monotonic() - stopped_at >= self.this_threads_grace_s() or bool(self.never_entered(tag))

    def clear(self) -> None:
        """The recovery is done with the stop: collectives run again (on the communicators it made)."""
        with self._abort_lock:  # (an abort under way ends first: it aborts the old communicators only)
            self._reason = ""
            self._cleared += 1
            self._deferred = None  # (a recovery ran: it covered that failure too)
            self._set.clear()
            self.entered.reset()
            self._aborted = False
            self._abort_info = None
            self._abort_report = None
            self.in_flight.forget()  # (the aborted communicators' works: they are being replaced)
        self.park.cancel()

    # ---- the abort -----------------------------------------------------------------------------
    def _abort_when_due(self, stop: int) -> None:
        """A stop's abort of the communicators with a stream-ordered collective pending, once its grace
        has passed (at once when none pending can complete: ``never_entered``); of every one when the
        training thread has still not reached the recovery ``backstop_s`` later. Otherwise no abort: the
        next collective raises at its entry, and every result read meanwhile was whole. ``stop``: the stop
        this thread serves (stops cleared before it)."""
        logged = False
        while True:
            with self._abort_lock:
                if not self._set.is_set() or self._aborted or self._cleared != stop:
                    return
                grace = self.uncovered_grace_s if self._uncovered else self.grace_s
                since = time.monotonic() - self._stopped_at
                why, only = "", self.in_flight.groups_to_abort()
                never = self.entered.none_can_complete(self.in_flight.pending_tags())
                if since >= grace and self.in_flight.pending():
                    why = "a stream-ordered collective was still pending"
                elif never:
                    why = "every pending collective was one a faulted rank never entered"
                    self.entered.aborted_for = never
                elif since >= grace + self.backstop_s and not self._reached.is_set():
                    why, only = "the training thread had not reached the recovery (held on the device?)", None
                if why:
                    what = "every communicator" if only is None else f"the {len(only)} communicator(s) holding it"
                    _log().warning("stop: %s %.2fs after the stop: aborting %s (%s)", why, since, what, self._reason)
                    began = time.monotonic()
                    self.abort_now(why=why, only=only)
                    break
            if since >= grace and not logged:
                _log().info("stop: no stream-ordered collective pending after the %.1fs grace: no abort, unless "
                            "the training thread has not reached the recovery %.0fs later", grace, self.backstop_s)
                logged = True
            time.sleep(WAIT_SLICE_S)
        self._watch_held(stop, began, rest=only is not None)

    def _watch_held(self, stop: int, began: float, rest: bool = False) -> None:
        """After a stop's abort (begun at ``began``): a training thread that has not reached the recovery
        within the deadline will not reach it. The held hooks are told why (once). ``rest``: only the
        groups with a collective pending were aborted; ``backstop_s`` later, every other one is too."""
        def over() -> bool:
            return self._reached.is_set() or not self._set.is_set() or self._cleared != stop
        while time.monotonic() - began < self.deadline_s:
            if over():
                return
            if rest and time.monotonic() - began >= self.backstop_s:
                rest, began = False, time.monotonic()
                with self._abort_lock:
                    if not over():
                        self.abort_now(why="the training thread had not reached the recovery after the first abort")
            time.sleep(WAIT_SLICE_S)
        if over():
            return
        why = (f"held: its training thread has not reached the recovery {time.monotonic() - began:.1f}s after "
               f"its communicators' abort began (deadline {self.deadline_s:g}s)")
        # The hooks first (the report that gets the rank replaced), then the log: nothing on this path
        # asks a communicator anything (``InFlight.freeze``).
        for hook in list(self._held_hooks):
            try:
                hook(why)
            except Exception:  # a failing report must not stop the others
                _log().exception("a held hook failed")
        _log().error("stop: %s; %s", why, self.report())

    def abort_now(self, why: str = "", only: list | None = None) -> None:
        """Abort the stream-ordered communicators of this process (``only`` those groups'; None: every
        one) now, at once and within the deadline (``comm.abort``): a communicator not aborted is not
        touched, and a recovery can keep it. A commit point refuses from here until ``clear()``."""
        self._aborted = True  # (first: a commit point that sees the abort's effect sees this too)
        self.in_flight.freeze()
        t0 = time.monotonic()
        began = t0 - self._stopped_at if self._set.is_set() else 0.0
        self._abort_info = (began, None, why or "asked")
        if self._abort_communicators is not None:
            report = self._abort_communicators(self.deadline_s, only)
            if report is not None:
                self._abort_report = report if self._abort_report is None else self._abort_report.merged(report)
        self._abort_info = (began, time.monotonic() - t0, why or "asked")

    def aborted(self) -> bool:
        """Stream-ordered communicators were aborted since the last ``clear()``."""
        return self._aborted

    def abort_summary(self) -> dict | None:
        """What this stop's abort did (for the recovery's answers): its seconds, each communicator's, and
        those that had not returned by the deadline; None when nothing was aborted since ``clear()``."""
        with self._abort_lock:  # (an abort under way is waited for, up to its deadline: the training thread
            # is freed by the first communicator's abort, often before the others have returned)
            return self._abort_report.to_wire() if self._abort_report is not None else None

    def report(self) -> str:
        """Where the stop stands, for a report of a training thread that does not serve the recovery:
        how long ago, and what its abort did."""
        if not self._set.is_set():
            return "no stop in force"
        text = f"stopped {time.monotonic() - self._stopped_at:.1f}s ago ({self._reason or '-'})"
        if self._abort_info is not None:
            text += _abort_text(self._abort_info, self._abort_report)
        elif self.in_flight.used:
            text += "; no communicator aborted"
        pending = self.in_flight.pending_count()
        return text + (f"; {pending} tracked collective(s) pending{' as the abort began' if self._aborted else ''}"
                       if pending else "")

    # ---- commit points -----------------------------------------------------------------------------
    def commit_point(self, what: str) -> None:
        """``what`` is about to use the results of this rank's collectives beyond them (an update on
        reduced gradients, a shard declared repaired, a checkpoint published): only if each completed
        before any abort cut it short. The device is synchronized first while a collective is pending
        (a GPU may still run one the host has moved past; where the trainer has just synced, a
        completed work with no abort flag raised was whole: no host sync is added); then an abort since
        the last ``clear()`` raises ``CollectiveStopped``. On gloo nothing is ever aborted: no cost."""
        if not self._aborted and self.in_flight.pending():
            from mindspeed_ha import device
            device.synchronize()
        if self._aborted:
            raise CollectiveStopped(f"{what} stopped: a stop aborted this rank's communicators, so results of its "
                                    f"collectives may be partial{': ' + self._reason if self._reason else ''}",
                                    never_entered=self.entered.aborted_for)
        self._passed[self._cleared] = self._passed.get(self._cleared, 0) + 1

    def commit_mark(self) -> tuple[int, int]:
        """Where this process stands now, for a later ``committed_since``."""
        return self._cleared, self._passed.get(self._cleared, 0)

    def committed_since(self, mark: tuple[int, int]) -> bool:
        """A commit point passed after ``mark`` and before the next stop was cleared: every collective
        issued before the mark completed whole (a result kept for later use, e.g. by a recovery)."""
        return self._passed.get(mark[0], 0) > mark[1]

    # ---- where the training thread is ------------------------------------------------------------------
    @contextlib.contextmanager
    def awaiting_orders(self):
        """The (training) thread waits for the controller's next order inside: it has left the step, so
        a backstop abort is not needed to free it, and it is not held (until ``left_recovery``)."""
        self._reached.set()
        yield

    def left_recovery(self) -> None:
        """The training thread trains again (the recovery it served is over, or it was never in one)."""
        self._reached.clear()

    def set_uncovered(self, on: bool) -> None:
        """The calling (training) thread leaves (True) or enters (False) the code a recovery covers."""
        self._thread.uncovered = self._uncovered = on

    def uncovered_here(self) -> bool:
        return getattr(self._thread, "uncovered", False)

    def this_threads_grace_s(self) -> float:
        return self.uncovered_grace_s if self.uncovered_here() else self.grace_s

    def stops_now(self) -> bool:
        """A collective entered now raises at once: stopped, and in code a recovery covers."""
        return self._set.is_set() and not self.uncovered_here()

    def raise_stopped(self, tag: Tag | None = None):
        """Leave (the collective ``tag``): ``CollectiveStopped``, whose ``never_entered`` names the faulted
        ranks that never entered that collective (why it was left before its grace; no tag: those that
        made this stop abort its communicators before the grace)."""
        never = self.never_entered(tag) if tag is not None else self.entered.aborted_for
        raise CollectiveStopped(f"collective stopped by request{': ' + self._reason if self._reason else ''}"
                                + (f" (never entered by rank(s) {never} of the default group)" if never else ""),
                                never_entered=never)

    def raise_if_stopped(self) -> None:
        """For waits outside a collective (a communicator's rendezvous): leave them as a collective would."""
        if self.stops_now():
            self.raise_stopped()

    # ---- failures of uncovered code -------------------------------------------------------------------
    @property
    def deferred(self) -> BaseException | None:
        return self._deferred

    def defer(self, e: BaseException, name: str) -> None:
        if self._deferred is None:
            self._deferred = e
            _log().warning("%s failed between two hooked calls (%s): it and the loop's collectives up to the next "
                           "hooked call are answered by this rank alone; the failure is reported there", name,
                           str(e).splitlines()[0][:200] if str(e) else type(e).__name__)

    def answer_loop_alone(self) -> None:
        """Until the next hooked call, the collectives of the uncovered code (the loop's, after the
        step a recovery finishes here: a roll-forward) are answered by this rank alone: the ranks that
        had ended that step passed them alone, a stop having reached them there."""
        self._loop_alone = True

    @property
    def loop_alone(self) -> bool:
        return self._loop_alone

    def raise_deferred(self) -> None:
        """At a hooked call's start (its step or save begun), in the code a recovery covers: raise (once)
        the failure of a collective of the uncovered code before it, to be recovered as a fault there."""
        self._loop_alone = False
        e, self._deferred = self._deferred, None
        if e is not None:
            raise e

    # ---- hooks ----------------------------------------------------------------------------------------
    def add_held_hook(self, fn: Callable[[str], None]) -> None:
        """``fn(why)`` runs when the training thread has not reached the recovery within the deadline
        of a stop's abort (the session reports the rank hung, to be replaced)."""
        if fn not in self._held_hooks:
            self._held_hooks.append(fn)

    def remove_held_hook(self, fn: Callable[[str], None]) -> None:
        if fn in self._held_hooks:
            self._held_hooks.remove(fn)


def _abort_text(info: tuple[float, float | None, str], report: _abort.AbortReport | None) -> str:
    """A stop's abort in its report: (seconds after the stop it began, seconds it took or None, why)."""
    began, took, why = info
    text = (f"; communicators aborted {began:.2f}s after the stop, in {took:.2f}s ({why})" if took is not None else
            f"; the communicators' abort began {began:.2f}s after the stop and has not returned ({why})")
    if report is not None and report.unfinished:
        text += f"; abort not returned: {', '.join(report.unfinished)}"
    return text


def as_stop(stop: Stop, exc: BaseException) -> BaseException:
    """What a wait for a collective (or its issue) raised, as this rank should take it: once ``stop``'s
    abort has begun, whatever it is (torch raises ``DistBackendError`` from a wait on an aborted
    communicator, or rethrows its watchdog's error), it is the stop — ``CollectiveStopped``, never a
    new fault of this rank; before, ``exc`` itself."""
    if not stop.aborted() or isinstance(exc, CollectiveStopped):
        return exc
    reason = stop._reason
    stopped = CollectiveStopped(f"collective stopped: this rank's stop aborted its communicators "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else '-'})"
                                f"{': ' + reason if reason else ''}", never_entered=stop.entered.aborted_for)
    stopped.__cause__ = exc
    return stopped
