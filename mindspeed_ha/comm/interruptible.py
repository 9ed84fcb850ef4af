"""Interruptible collectives: the rank-side half of the *stop* action.

Why: gloo's ``ProcessGroup.abort()`` does not wake a collective blocked on a live (hung) peer, so a
rank blocked in a synchronous collective could only leave at the collective timeout (minutes).
Instead every blocking collective is issued with ``async_op=True`` and its work is waited on in
short slices, checking a process-wide stop flag between slices. ``request_stop()`` (called by the
processor thread) makes the blocked thread raise :class:`CollectiveStopped` within one slice.

Stream-ordered backends (NCCL, HCCL, the emulated NCCL of drills: ``comm.backends``) behave
otherwise: a collective returns at once and a stop does not raise anywhere. Their works are tracked
while in flight; a stop lets the ones already issued finish for a grace, as on gloo, then aborts the
communicators (NCCL's abort, HCCL's device stop), which makes what is still pending return with
partial results and no error. So nothing may consume a collective's result once an abort may have
cut it short: ``commit_point()`` — a device sync, then "was anything aborted?" — stands before every
use that outlives a step (the optimizer's update, a shard declared repaired, a checkpoint published).
On gloo an abort never happens and the commit point costs nothing.

After a stop, recovery calls ``clear_stop()`` before the next collective (until then every new
collective raises at once). The interrupted operation stays pending inside the old group and
completes if its peers come back to it (a frozen node thawed): rebuild the groups and roll back.
It never writes into the caller's tensors then: a polled collective receives its result in tensors
of its own, copied to the caller's only when the wait sees it complete (``_Results``); a
stream-ordered backend lands nothing after its abort.

This module only *builds* wrappers; ``mindspeed_ha.patches.torch.distributed`` installs them.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import queue
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from mindspeed_ha import compat
from mindspeed_ha.comm import abort as _abort
from mindspeed_ha.comm import backends
from mindspeed_ha.device.waits import EventWaits, HostWaits, for_device as waits_for

# One wait slice: the bound on stop latency. A slice ends at once when the work completes, so its
# length costs nothing on the fast path.
WAIT_SLICE_S = 0.02
_SLICE = datetime.timedelta(seconds=WAIT_SLICE_S)
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
# stop's grace is taken to be held on the device behind a collective this module never saw: one a
# library issued through the backend itself, a communicator's set-up inside a collective. Nothing
# tracked is pending then, yet the thread can leave only if the communicators are aborted, so they
# are. It costs nothing a recovery would not pay: every recovery after a stop replaces them.
BACKSTOP_S = 5.0
# A stop's abort is bounded (``comm.abort``): its communicators' aborts are waited for this long, and a
# training thread that has not reached the recovery this long after they began is held for good (an
# abort that never returned, a kernel that never saw its flag, a host stuck inside the backend): the
# rank says so (the held hooks: the session reports itself hung), and the controller replaces it.
STOP_DEADLINE_S = _abort.DEADLINE_S

_stop = threading.Event()
_thread = threading.local()  # .uncovered: this thread runs code no recovery covers
_deferred: BaseException | None = None  # a collective's failure there, for the next hooked call
_reason = ""
_abort_hooks: list[Callable[[str], None]] = []
_held_hooks: list[Callable[[str], None]] = []
_stopped_at = 0.0
# Stream-ordered communicators were aborted since the last clear_stop: a result read now may be partial.
_aborted = False
_uncovered = False  # the training thread runs code no recovery covers (what the aborter reads)
_aborter: tuple[threading.Thread, int] | None = None  # the stop's aborter, and the stop it serves (_cleared)
# The training thread waits for the controller's next order (``awaiting_orders``): it left the step.
_awaiting = threading.Event()
# ... or serves the recovery's orders since it first waited for one (``left_recovery`` ends that):
# not held in a step, however long an order takes (a dump's write, a large shard's repair).
_reached = threading.Event()
# Held by the abort of a stop, and by ``clear_stop``: a recovery that clears the stop (and then
# makes new communicators) never runs beside an abort still deciding or aborting the old ones.
_abort_lock = threading.Lock()
# The last abort: (seconds after its stop it began, seconds it took or None while it runs, why).
_abort_info: tuple[float, float | None, str] | None = None
# What the last abort did to each communicator (comm.abort), until the next clear_stop.
_abort_report: _abort.AbortReport | None = None


class CollectiveStopped(RuntimeError):
    """Raised in the thread blocked in (or entering) a collective after ``request_stop()``."""


def request_stop(reason: str = "") -> None:
    """Make every blocked or future collective raise ``CollectiveStopped`` until ``clear_stop()``.

    Safe to call from any thread. Stream-ordered communicators are aborted (the abort hooks) once a
    collective issued before the stop is still pending after the grace a gloo one gets."""
    global _reason, _stopped_at, _aborter
    _reason = reason
    if not _stop.is_set():
        _stopped_at = time.monotonic()
        _stop.set()
    if _streams.used and (_aborter is None or not _aborter[0].is_alive() or _aborter[1] != _cleared):
        thread = threading.Thread(target=_abort_when_due, args=(_cleared,), name="mindspeed-ha-aborter",
                                  daemon=True)
        _aborter = (thread, _cleared)
        thread.start()


def _abort_when_due(stop: int) -> None:
    """A stop's communicator abort, once its grace has passed (the uncovered one while the training
    thread is outside the covered calls), when a stream-ordered collective issued before it is still
    pending, or (``BACKSTOP_S`` later) when the training thread has still not reached the recovery.
    Otherwise no abort: the next collective raises at its entry, and every result read meanwhile was
    whole. After an abort, the training thread has ``STOP_DEADLINE_S`` from its start to reach the
    recovery; else the rank is held (``_watch_held``). ``stop``: the stop this thread serves (the
    number of stops cleared before it)."""
    logged = False
    while True:
        with _abort_lock:
            if not _stop.is_set() or _aborted or _cleared != stop:
                return
            grace = UNCOVERED_GRACE_S if _uncovered else STOP_GRACE_S
            since = time.monotonic() - _stopped_at
            why = ""
            if since >= grace and _streams.pending():
                why = "a stream-ordered collective was still pending"
            elif since >= grace + BACKSTOP_S and not _reached.is_set():
                why = "the training thread had not reached the recovery (held on the device?)"
            if why:
                _log().warning("stop: %s %.2fs after the stop: aborting this rank's communicators (%s)",
                               why, since, _reason or "-")
                began = time.monotonic()
                abort_now(why=why)
                break
        if since >= grace and not logged:
            _log().info("stop: no stream-ordered collective pending after the %.1fs grace: no abort, unless the "
                        "training thread has not reached the recovery %.0fs later", grace, BACKSTOP_S)
            logged = True
        time.sleep(WAIT_SLICE_S)
    _watch_held(stop, began)


def _watch_held(stop: int, began: float) -> None:
    """After a stop's abort (begun at ``began``): a training thread that has not reached the recovery
    within ``STOP_DEADLINE_S`` will not reach it. The held hooks are told why (once)."""
    while time.monotonic() - began < STOP_DEADLINE_S:
        if _reached.is_set() or not _stop.is_set() or _cleared != stop:
            return
        time.sleep(WAIT_SLICE_S)
    if _reached.is_set() or not _stop.is_set() or _cleared != stop:
        return
    why = (f"held: its training thread has not reached the recovery {time.monotonic() - began:.1f}s after its "
           f"communicators' abort began (deadline {STOP_DEADLINE_S:g}s)")
    _log().error("stop: %s; %s", why, stop_report())
    for hook in list(_held_hooks):
        try:
            hook(why)
        except Exception:  # a failing report must not stop the others
            _log().exception("a held hook failed")


@contextlib.contextmanager
def awaiting_orders():
    """The (training) thread waits for the controller's next order inside: it has left the step, so
    a stop's backstop abort is not needed to free it, and it is not held (until ``left_recovery``)."""
    _awaiting.set()
    _reached.set()
    try:
        yield
    finally:
        _awaiting.clear()


def left_recovery() -> None:
    """The training thread trains again (the recovery it served is over, or it was never in one)."""
    _reached.clear()


def stop_report() -> str:
    """Where this rank's stop stands, for a report of a training thread that does not serve the
    recovery: how long ago, and what its abort did."""
    if not _stop.is_set():
        return "no stop in force"
    text = f"stopped {time.monotonic() - _stopped_at:.1f}s ago ({_reason or '-'})"
    if _abort_info is not None:
        began, took, why = _abort_info
        text += (f"; communicators aborted {began:.2f}s after the stop, in {took:.2f}s ({why})" if took is not None
                 else f"; the communicators' abort began {began:.2f}s after the stop and has not returned ({why})")
        if _abort_report is not None and _abort_report.unfinished:
            text += f"; abort not returned: {', '.join(_abort_report.unfinished)}"
    elif _streams.used:
        text += "; no communicator aborted"
    pending = _streams.pending_count()
    return text + (f"; {pending} tracked collective(s) pending" if pending else "")


def _log():
    from mindspeed_ha.events import get_logger
    return get_logger("comm")


def abort_now(reason: str = "", why: str = "") -> None:
    """Abort every stream-ordered communicator of this process now (the abort hooks), at once and
    within ``STOP_DEADLINE_S`` (``comm.abort``). A commit point refuses from here until ``clear_stop()``."""
    global _aborted, _abort_info
    _aborted = True  # (first: a commit point that sees the abort's effect sees this too)
    t0 = time.monotonic()
    began = t0 - _stopped_at if _stop.is_set() else 0.0
    _abort_info = (began, None, why or "asked")
    for hook in list(_abort_hooks):
        try:
            hook(reason or _reason)
        except Exception:  # a failing abort must not stop the others
            pass
    _abort_info = (began, time.monotonic() - t0, why or "asked")


def abort_summary() -> dict | None:
    """What this stop's abort did (for the recovery's answers): its seconds, each communicator's, and
    those that had not returned by the deadline; None when nothing was aborted since ``clear_stop``."""
    with _abort_lock:  # (an abort under way is waited for, up to its deadline: the training thread is
        # freed by the first communicator's abort, often before the others have returned)
        return _abort_report.to_wire() if _abort_report is not None else None


def aborted() -> bool:
    """Stream-ordered communicators were aborted since the last ``clear_stop()``."""
    return _aborted


def commit_point(what: str) -> None:
    """``what`` is about to use the results of this rank's collectives beyond them (an update on
    reduced gradients and their norm, a shard declared repaired, a checkpoint published): only if
    each completed before any abort cut it short. The device is synchronized first (a GPU may still
    run a collective the host has moved past); then a stop's abort since the last ``clear_stop()``
    raises ``CollectiveStopped``, the results untouched by ``what``. On gloo nothing is ever aborted (a
    stopped collective raises instead): no sync, no cost.

    The sync is only needed while a collective is pending (its work queried, not waited for): where
    the trainer has just synced (Megatron's grad-norm ``.item()`` before the update) every work is
    complete, and a completed work with no abort flag raised was whole, since an abort raises the
    flag before it aborts anything. There the commit point adds no host sync to the step."""
    if not _aborted and _streams.pending():
        from mindspeed_ha import device
        device.synchronize()
    if _aborted:
        raise CollectiveStopped(f"{what} stopped: a stop aborted this rank's communicators, so results of its "
                                f"collectives may be partial{': ' + _reason if _reason else ''}")
    _passed[_cleared] = _passed.get(_cleared, 0) + 1


# Commit points passed, by how many stops had been cleared then: a commit point that passed after a
# result was issued, and before the next stop was cleared, proves that result whole.
_cleared = 0
_passed: dict[int, int] = {}


def commit_mark() -> tuple[int, int]:
    """Where this process stands now, for a later ``committed_since``."""
    return _cleared, _passed.get(_cleared, 0)


def committed_since(mark: tuple[int, int]) -> bool:
    """A commit point passed after ``mark`` and before the next stop was cleared: every collective this
    process issued before the mark completed whole (a result kept for later use, e.g. by a recovery
    after that stop)."""
    return _passed.get(mark[0], 0) > mark[1]


def clear_stop() -> None:
    global _reason, _deferred, _aborted, _cleared, _abort_info, _abort_report
    with _abort_lock:  # (an abort under way ends first: it aborts the old communicators only)
        _reason = ""
        _cleared += 1
        _deferred = None  # (a recovery ran: it covered that failure too)
        _stop.clear()
        _aborted = False
        _abort_info = None
        _abort_report = None
        _streams.forget()  # (the aborted communicators' works: they are being replaced)
    _cancel_park()


# ---- a stop at the next step boundary -------------------------------------------------------------
# A planned recovery (a migration) parks every rank between two steps, so no step is interrupted and
# nothing is rolled back. A rank that had already begun the next step when the order came waits in its
# first collective for peers that parked: after ``grace_s`` it is stopped there instead (its partial
# step is cleaned up by the recovery, as after any stop).
_park = threading.Event()
_park_timer: threading.Timer | None = None


def request_park(reason: str, grace_s: float) -> None:
    """Have the training thread park at its next step start (``take_park``); a stop after ``grace_s``."""
    global _park_timer
    _cancel_park()
    _park.set()

    def stop_if_parked() -> None:
        if _park.is_set():
            request_stop(reason)
    _park_timer = threading.Timer(grace_s, stop_if_parked)
    _park_timer.daemon = True
    _park_timer.start()


def take_park() -> bool:
    """At a step start: True (once) if a park was requested; the stop that would follow is called off."""
    if not _park.is_set():
        return False
    _cancel_park()
    return True


def _cancel_park() -> None:
    global _park_timer
    _park.clear()
    if _park_timer is not None:
        _park_timer.cancel()
        _park_timer = None


def stop_requested() -> bool:
    return _stop.is_set()


def add_abort_hook(fn: Callable[[str], None]) -> None:
    """Register ``fn(reason)`` to run on ``request_stop`` (e.g. a trainer's own communicator abort)."""
    if fn not in _abort_hooks:
        _abort_hooks.append(fn)


def remove_abort_hook(fn: Callable[[str], None]) -> None:
    if fn in _abort_hooks:
        _abort_hooks.remove(fn)


def add_held_hook(fn: Callable[[str], None]) -> None:
    """Register ``fn(why)`` to run when the training thread has not reached the recovery within
    ``STOP_DEADLINE_S`` of a stop's abort (the session reports the rank hung, to be replaced)."""
    if fn not in _held_hooks:
        _held_hooks.append(fn)


def remove_held_hook(fn: Callable[[str], None]) -> None:
    if fn in _held_hooks:
        _held_hooks.remove(fn)


def set_uncovered(on: bool) -> None:
    """The calling (training) thread leaves (True) or enters (False) the code a recovery covers."""
    global _uncovered
    _thread.uncovered = _uncovered = on


def raise_deferred() -> None:
    """At a hooked call's start (its step or save begun), in the code a recovery covers: raise (once)
    the failure of a collective of the uncovered code before it, to be recovered as a fault there."""
    global _deferred
    e, _deferred = _deferred, None
    if e is not None:
        raise e


def _defer(e: BaseException, name: str) -> None:
    global _deferred
    from mindspeed_ha.events import get_logger
    if _deferred is None:
        _deferred = e
        get_logger("comm").warning("%s failed between two hooked calls (%s): it and the loop's collectives up to "
                                   "the next hooked call are answered by this rank alone; the failure is "
                                   "reported there", name, str(e).splitlines()[0][:200] if str(e) else type(e).__name__)


def _grace_s() -> float:
    return UNCOVERED_GRACE_S if getattr(_thread, "uncovered", False) else STOP_GRACE_S


def _stop_now() -> bool:
    """A collective entered now raises at once: stopped, and in code a recovery covers."""
    return _stop.is_set() and not getattr(_thread, "uncovered", False)


def _raise_stopped():
    raise CollectiveStopped(f"collective stopped by request{': ' + _reason if _reason else ''}")


def raise_if_stopped() -> None:
    """For waits outside a collective (a communicator's rendezvous): leave them as a collective would."""
    if _stop_now():
        _raise_stopped()


class _InFlight:
    """What this process has in flight on stream-ordered backends: the works issued and not seen
    complete (what a stop's abort is for), and the waits for them by device kind (the evidence)."""

    def __init__(self) -> None:
        self.used = False  # a stream-ordered collective was issued by this process
        self._lock = threading.Lock()
        self._works: list = []
        self._waits: dict[str, HostWaits | EventWaits] = {}

    def issued(self, work) -> None:
        self.used = True
        with self._lock:
            self._works = [w for w in self._works if not w.is_completed()] + [work]

    def waits(self, kind: str) -> HostWaits | EventWaits:
        if kind not in self._waits:
            with self._lock:
                self._waits.setdefault(kind, waits_for(kind))
        return self._waits[kind]

    def pending(self) -> bool:
        return bool(self.pending_count()) or any(w.pending() for w in list(self._waits.values()))

    def pending_count(self) -> int:
        """The works issued and not complete."""
        with self._lock:
            self._works = [w for w in self._works if not w.is_completed()]
            return len(self._works)

    def waiting(self) -> bool:
        return any(w.waiting() for w in list(self._waits.values()))

    def waited_s(self) -> float:
        return sum(w.waited_s() for w in list(self._waits.values()))

    def forget(self) -> None:
        with self._lock:
            self._works = []


_polled = HostWaits()   # gloo's waits: this module polls them, on the host
_streams = _InFlight()  # stream-ordered backends' works and waits


def waited_s() -> float:
    """Seconds this process spent waiting for collectives (a rank's own work is the rest)."""
    return _polled.waited_s() + _streams.waited_s()


def waiting() -> bool:
    """This rank waits in a collective now: for a peer, not stuck itself."""
    return _polled.waiting() or _streams.waiting()


def wait_work(work, p2p: bool = False) -> None:
    """Wait for a c10d ``Work``, raising ``CollectiveStopped`` once a stop is requested."""
    if work.is_completed() or _stop.is_set():
        return _wait_work(work, p2p)
    token = _polled.begin()
    try:
        _wait_work(work, p2p)
    finally:
        _polled.end(token)


def _wait_stream(work, kind: str) -> None:
    """Wait for a stream-ordered collective as its caller would (NCCL: the compute stream waits; the
    emulated backend: the host), bracketed for the evidence."""
    waits = _streams.waits(kind)
    token = waits.begin()
    try:
        work.wait()
    finally:
        waits.end(token)


def _wait_work(work, p2p: bool = False) -> None:
    """(``wait_work``'s body.)

    Collectives that complete asynchronously (those with a future): ``work.wait(slice)`` in a loop.
    It is torch's own condition-variable wait, so completion wakes the caller at once, and a slice
    that times out leaves the work untouched ("Operation timed out!"; torch: "this will not abort
    the work"). Works without a future (gloo p2p and reduce-scatter) do their last part inside
    ``wait()``: a timed-out wait there closes gloo's connection, ``is_completed()`` stays False
    until ``wait()``, and a second ``wait()`` blocks for the next message - so their one
    ``wait()`` runs on a helper thread while the caller watches an Event and the stop flag.

    A stop that came between the issue and this wait gets the same grace as one that comes during
    it: the peers may have completed the collective already (a barrier the faulted rank left
    before it faulted), and raising then would throw this rank out of code no recovery covers."""
    if not p2p:
        if work.is_completed():
            work.wait()  # returns at once, or raises the backend's error
            return
        try:
            work.get_future()
        except RuntimeError:  # "getFuture not implemented": not a plain async collective
            pass
        else:
            stopped_at = None
            while True:
                try:
                    work.wait(_SLICE)
                    return
                except RuntimeError:
                    if work.is_completed():  # it failed (or just finished): the real outcome
                        work.wait()
                        return
                    if _stop.is_set():
                        stopped_at = stopped_at or time.monotonic()
                        if time.monotonic() - stopped_at >= _grace_s():
                            _raise_stopped()
    done = threading.Event()
    errors = _wait_on_helper(work, done)
    _wait_event(done)
    if errors:
        raise errors[0]


def _wait_event(done: threading.Event) -> None:
    stopped_at = None
    while not done.wait(WAIT_SLICE_S):
        if _stop.is_set():
            stopped_at = stopped_at or time.monotonic()
            if time.monotonic() - stopped_at >= _grace_s():
                _raise_stopped()


def _wait_on_helper(work, done: threading.Event) -> list:
    errors: list[BaseException] = []

    def run():
        try:
            work.wait()
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)
        done.set()

    _waiters.submit(run)
    return errors


class _WaiterPool:
    """Long-lived daemon threads that run blocking ``wait()``s (a thread start per wait costs a
    scheduling round trip). One left blocked on a hung peer after a stop is simply not reused;
    daemon, so it never holds up the process' exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if spawn:
            threading.Thread(target=self._loop, name="mindspeed-ha-wait", daemon=True).start()
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


_waiters = _WaiterPool()


# ---------------------------------------------------------------------------------------------
# Where a polled collective writes its result. One left by a stop stays pending in the old
# communicator, and completes if its peers come back to it: a frozen node thawed goes on with the
# collective it was in. Written into the caller's tensor, that late result would land in a buffer
# training reuses after the rollback (megatron's grad buffer, its parameter buffer) in the middle
# of a later step. So the collective writes into tensors of its own, copied to the caller's once
# the wait sees it complete; a stopped one's result is simply never looked at.

# collective -> (the parameter it writes, whether its current value is an input too)
_RESULT_PARAM = {
    "all_reduce": ("tensor", True), "broadcast": ("tensor", True), "reduce": ("tensor", True),
    "all_gather": ("tensor_list", False), "all_gather_into_tensor": ("output_tensor", False),
    "_all_gather_base": ("output_tensor", False), "all_gather_single": ("output_tensor", False),
    "reduce_scatter": ("output", False), "reduce_scatter_tensor": ("output", False),
    "_reduce_scatter_base": ("output", False), "reduce_scatter_single": ("output", False),
    "gather": ("gather_list", False), "scatter": ("tensor", False),
    "all_to_all": ("output_tensor_list", False), "all_to_all_single": ("output", False),
}


class _Results:
    """The caller's result tensors and the collective's own; ``land()`` copies them over, once."""

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def own(self, value, keep: bool):
        """The collective's own tensor(s) in place of ``value`` (a tensor or a list of them)."""
        if isinstance(value, torch.Tensor):
            mine = value.clone() if keep else torch.empty_like(value)
            self._pairs.append((value, mine))
            return mine
        if isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value):
            return [self.own(t, keep) for t in value]
        return value

    def __bool__(self) -> bool:  # results still to land
        return bool(self._pairs)

    def add(self, other: "_Results") -> None:
        self._pairs.extend(other._pairs)

    def land(self) -> None:
        pairs, self._pairs = self._pairs, []
        for callers, mine in pairs:
            callers.copy_(mine)


_NO_RESULTS = _Results()


class PollingWork(dist.Work):
    """What an ``async_op=True`` caller gets back: ``wait()`` is interruptible (gloo), or bracketed for
    the evidence (``stream``: a stream-ordered backend of that device kind); the rest delegates."""

    def __init__(self, work, p2p: bool = False, results: _Results = _NO_RESULTS, stream: str | None = None):
        super().__init__()
        self._work = work
        self._p2p = p2p
        self._waited = False
        self._results = results
        self._stream = stream

    def wait(self, timeout=None):
        if self._waited:
            return True
        if timeout:  # an explicit timeout keeps torch's meaning
            done = self._work.wait(timeout)
        elif self._stream is not None:
            _wait_stream(self._work, self._stream)
            done = True
        else:
            wait_work(self._work, self._p2p)
            done = True
        self._results.land()
        self._waited = True
        return done

    def is_completed(self):
        return self._work.is_completed()

    def is_success(self):
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def source_rank(self):
        return self._work.source_rank()

    def _source_rank(self):
        return self._work._source_rank()

    def result(self):
        return self._work.result()

    def synchronize(self):
        return self._work.synchronize()

    def get_future(self):
        fut = self._work.get_future()
        if not self._results:
            return fut
        return fut.then(lambda done: (self._results.land(), done.value())[1])

    def __getattr__(self, name):
        return getattr(self._work, name)


def _unwrap(work):
    return work._work if isinstance(work, PollingWork) else work


# ---------------------------------------------------------------------------------------------
# Which calls to poll: those of a backend that blocks the calling thread (gloo, or gloo in a
# multi-backend group for CPU tensors). Stream-ordered ones (NCCL, HCCL, the emulated NCCL) are
# tracked instead.

def _first_tensor(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0]
    return None


def _stream_kind(group, tensor=None, device=None) -> str | None:
    """The device kind of a collective on a stream-ordered backend (what its waits are timed on);
    None where the backend blocks the calling thread. ``tensor`` or ``device``: what it moves."""
    try:
        name = str(dist.get_backend(group)).lower()
    except Exception:  # not a registered group (or not a member): let torch decide what happens
        return None
    kind = tensor.device.type if tensor is not None else torch.device(device).type if device is not None else None
    if kind is not None:
        return kind if backends.stream_ordered(backends.for_device(name, kind)) else None
    # (nothing to move: a barrier) the group's stream-ordered backend, if it has one
    for kind in ("cuda", "npu", "cpu"):
        backend = backends.for_device(name, kind)
        if backends.stream_ordered(backend) and backends.DEVICE_OF.get(backend) == kind:
            return kind
    return None


# A restarted worker sets up (groups, model, optimizer; in Megatron-LM also its data loaders) while
# the survivors wait in the controller's recovery, so its set-up's collectives have no peers. Inside
# ``alone()`` they are answered by this rank by itself: barriers pass, reductions and broadcasts keep
# the local value (start-time minimums, flags already set from the twin), gathers repeat the local
# input (megatron-core's param-group keys, which every rank of the layout shares; timer readings).
# Other kinds are refused.
_alone = False


@contextlib.contextmanager
def alone():
    global _alone
    before, _alone = _alone, True
    try:
        yield
    finally:
        _alone = before


class _DoneWork:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _answer_alone(fn: Callable, args, kwargs):
    name = fn.__name__
    a = inspect.signature(fn).bind(*args, **kwargs).arguments
    if name in ("all_gather_into_tensor", "_all_gather_base", "all_gather_single"):  # (the last: torch >= 2.15)
        out, inp = a["output_tensor"], a["input_tensor"]  # (required parameters: always bound)
        out.view(-1).copy_(inp.reshape(-1).repeat(out.numel() // max(1, inp.numel())))
    elif name == "all_gather":
        for t in a["tensor_list"]:
            t.copy_(a["tensor"])
    elif name not in ("barrier", "all_reduce", "broadcast", "reduce"):
        raise RuntimeError(f"{name} during a restarted worker's set-up: it has no peers until it has joined; "
                           "only barriers, reductions, broadcasts and all-gathers can be answered alone")
    return _DoneWork() if a.get("async_op") else None


def _with_own_results(fn: Callable, params: list[str], args: tuple, kwargs: dict, group):
    """``fn``'s arguments with its result tensor(s) replaced by its own (see ``_Results``)."""
    name, keep = _RESULT_PARAM.get(fn.__name__, (None, False))
    results = _Results()
    if (name is None or name not in params or getattr(_thread, "issuing", False)
            or (compat.coalescing(group) and group not in _blocks())):
        return args, kwargs, results  # nothing written, an outer wrapper's call, or a block not ours
    i = params.index(name)
    if i < len(args):
        args = args[:i] + (results.own(args[i], keep),) + args[i + 1:]
    elif name in kwargs:
        kwargs = {**kwargs, name: results.own(kwargs[name], keep)}
    return args, kwargs, results


def _blocks() -> dict:
    """This thread's open coalescing blocks: group -> the results its recorded collectives land."""
    if not hasattr(_thread, "blocks"):
        _thread.blocks = {}
    return _thread.blocks


def _issue(fn: Callable, args: tuple, kwargs: dict):
    """Call ``fn``; the collectives it calls in turn (torch's deprecated names) leave results alone."""
    before, _thread.issuing = getattr(_thread, "issuing", False), True
    try:
        return fn(*args, **kwargs)
    finally:
        _thread.issuing = before


def make_interruptible(fn: Callable) -> Callable:
    """Wrap a c10d collective that takes ``async_op``: issue async, wait interruptibly."""
    params = list(inspect.signature(fn).parameters)
    idx = params.index("async_op")
    gidx = params.index("group") if "group" in params else None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _stop_now():
            _raise_stopped()
        if _alone:
            return _answer_alone(fn, args, kwargs)
        if _deferred is not None and getattr(_thread, "uncovered", False):
            return _answer_deferred(fn, args, kwargs, _deferred)
        if idx < len(args):
            want_async = bool(args[idx])
            args = args[:idx] + (True,) + args[idx + 1:]
        else:
            want_async = bool(kwargs.get("async_op", False))
            kwargs["async_op"] = True
        group = kwargs.get("group") if gidx is None or gidx >= len(args) else args[gidx]
        callers = args, kwargs
        kind = _stream_kind(group, _first_tensor(args, kwargs))
        if kind is not None:
            return _stream_collective(fn, args, kwargs, want_async, kind)
        resolved = compat.resolve_group(group)
        args, kwargs, results = _with_own_results(fn, params, args, kwargs, resolved)
        work = _issue(fn, args, kwargs)
        if work is None:  # not a member of the group: nothing was received
            return None
        if compat.is_placeholder_work(work):  # inside a coalescing block: its results land with the block's
            if resolved in _blocks():
                _blocks()[resolved].add(results)
            return work if want_async else None
        work = _unwrap(work)
        if want_async:
            return PollingWork(work, results=results)
        try:
            wait_work(work)
        except Exception as e:
            if not getattr(_thread, "uncovered", False):
                raise
            _defer(e, fn.__name__)
            _answer_deferred(fn, *callers, e)
            return None
        results.land()
        return None

    setattr(wrapper, "__mindspeed_ha_original__", fn)
    return wrapper


def _stream_collective(fn: Callable, args: tuple, kwargs: dict, want_async: bool, kind: str):
    """A collective of a stream-ordered backend (issued async, so that its work is tracked): the
    caller's async work, or waited for as the caller's synchronous call would have."""
    if _aborted:  # (outside the covered calls: inside them the stop raised at the entry) no communicator
        return _answer_deferred(fn, args, kwargs, CollectiveStopped(f"{fn.__name__} after a stop's abort"))
    work = _issue(fn, args, kwargs)
    if work is None:  # not a member of the group
        return None
    if compat.is_placeholder_work(work):  # inside a coalescing block: the block's work is tracked
        return work if want_async else None
    work = _unwrap(work)
    _streams.issued(work)
    if want_async:
        return PollingWork(work, stream=kind)
    try:
        _wait_stream(work, kind)
    except Exception as e:
        if not getattr(_thread, "uncovered", False):
            raise
        _defer(e, fn.__name__)
        _answer_deferred(fn, args, kwargs, e)
    return None


def _answer_deferred(fn: Callable, args, kwargs, e: BaseException):
    """A collective of uncovered code after a failure there: this rank's own answer, or the failure
    itself where there is none."""
    try:
        return _answer_alone(fn, args, kwargs)
    except RuntimeError:
        raise e from None


# Called with ("send",), ("recv",) or a batch's kinds as a point-to-point op is issued: where fault
# drills reach a pipeline stage's own sends and receives (the session decides which count).
_p2p_hooks: list[Callable[[tuple[str, ...]], None]] = []


def add_p2p_hook(fn: Callable[[tuple[str, ...]], None]) -> None:
    if fn not in _p2p_hooks:
        _p2p_hooks.append(fn)


def remove_p2p_hook(fn: Callable[[tuple[str, ...]], None]) -> None:
    if fn in _p2p_hooks:
        _p2p_hooks.remove(fn)


def _p2p_issued(names) -> None:
    kinds = tuple("send" if n == "isend" else "recv" for n in names)
    for hook in list(_p2p_hooks):
        hook(kinds)


def make_interruptible_p2p(fn: Callable) -> Callable:
    """Wrap ``isend``/``irecv`` (always async): hand back a PollingWork so ``send``/``recv`` and
    callers' ``.wait()`` are interruptible (gloo) or tracked (a stream-ordered backend)."""
    params = list(inspect.signature(fn).parameters)
    gidx = params.index("group") if "group" in params else None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _stop_now():
            _raise_stopped()
        _p2p_issued((fn.__name__,))
        work = fn(*args, **kwargs)
        if work is None or isinstance(work, PollingWork) or compat.is_placeholder_work(work):
            return work
        group = kwargs.get("group") if gidx is None or gidx >= len(args) else args[gidx]
        return _p2p_work(work, compat.resolve_group(group), _first_tensor(args, kwargs))

    setattr(wrapper, "__mindspeed_ha_original__", fn)
    return wrapper


def _p2p_work(work, group, tensor) -> PollingWork:
    kind = _stream_kind(group, tensor)
    if kind is None:
        return PollingWork(work, p2p=True)
    _streams.issued(work)
    return PollingWork(work, stream=kind)


def make_interruptible_batch_p2p(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(p2p_op_list):
        if _stop_now():
            _raise_stopped()
        _p2p_issued([getattr(op.op, "__name__", "") for op in p2p_op_list])
        works = fn(p2p_op_list)
        if not p2p_op_list:
            return works
        group, tensor = compat.resolve_group(p2p_op_list[0].group), p2p_op_list[0].tensor
        return [w if w is None or isinstance(w, PollingWork) else _p2p_work(w, group, tensor) for w in works]

    setattr(wrapper, "__mindspeed_ha_original__", fn)
    return wrapper


def make_interruptible_coalescing_manager(orig_cm: Callable) -> Callable:
    """Wrap ``_coalescing_manager``: ops inside it only record themselves (returning ``_IllegalWork``);
    the real work is issued when the block exits. Force ``async_ops=True`` there and wait for the
    manager's works interruptibly (gloo) or tracked (a stream-ordered backend) — at exit for a sync
    block, in ``cm.wait()`` for an async one."""

    @contextlib.contextmanager
    @functools.wraps(orig_cm)
    def wrapper(group=None, device=None, async_ops=False):
        if _stop_now():
            _raise_stopped()
        resolved = compat.resolve_group(group)
        kind = _stream_kind(resolved, device=device)
        results = _Results()
        if kind is None:
            _blocks()[resolved] = results
        try:
            with orig_cm(group, device, async_ops=True) as cm:
                # (an instance attribute: megatron calls cm.wait())
                cm.wait = functools.partial(_wait_all, cm, results, kind)
                yield cm
        except BaseException:
            # torch leaves the op list behind when the block raises, poisoning the next coalescing
            # block on this group ("non-empty op list"): drop it
            compat.drop_coalescing(resolved)
            raise
        finally:
            _blocks().pop(resolved, None)
        if kind is not None:
            for w in _works_of(cm):
                _streams.issued(w)
        if not async_ops:
            _wait_all(cm, results, kind)

    setattr(wrapper, "__mindspeed_ha_original__", orig_cm)
    return wrapper


def _works_of(cm) -> list:
    return [_unwrap(w) for w in cm.works if w is not None and not compat.is_placeholder_work(w)]


def _wait_all(cm, results: _Results, kind: str | None = None) -> None:
    for w in _works_of(cm):
        if kind is None:
            wait_work(w)
        else:
            _wait_stream(w, kind)
    results.land()


# ---------------------------------------------------------------------------------------------
# The abort of stream-ordered communicators (a stop's, once the grace has passed).

def _backend_of(pg) -> str:
    try:
        return backends.canonical(str(dist.get_backend(pg)))
    except Exception:  # not a group torch knows (any more)
        return ""


def _abortable(pg) -> bool:
    """``pg``'s communicators are NCCL's (or the emulated NCCL's): a stop aborts them."""
    name = _backend_of(pg)
    return name == backends.EMULATED_NCCL or (name == "nccl" and torch.cuda.is_available())


def _abort_stream_ordered(reason: str) -> None:
    """NCCL (and the emulated NCCL): abort every communicator of the process at once, each on a
    thread of its own, so that kernels blocked on a dead or hung peer exit with what they had
    (``comm.abort``: why at once, and the deadline). HCCL: stop the device (torch_npu's
    ``stop_device``; a recovery restarts it before anything runs there again:
    ``device.restart_after_stop``)."""
    global _abort_report
    if not (dist.is_available() and dist.is_initialized()):
        return
    registered = compat.registered_groups()
    named = [(_group_label(pg), pg) for pg in registered if _abortable(pg)]
    report = _abort.abort_all(named, STOP_DEADLINE_S)
    _abort_report = report
    (_log().error if report.unfinished or report.failed else _log().warning)("stop: %s", report.line())
    if any(_backend_of(pg) == "hccl" for pg in registered):
        from mindspeed_ha import device
        device.stop_device()


def _group_label(pg) -> str:
    """A group's name in the stop's log: its description (megatron-core's), else torch's name."""
    for attr in ("group_desc", "group_name"):
        try:
            value = str(getattr(pg, attr) or "")
        except Exception:  # (torch's own groups answer both; a broken one neither)
            value = ""
        if value and value != "undefined":
            return value
    return f"group@{id(pg):x}"


add_abort_hook(_abort_stream_ordered)
