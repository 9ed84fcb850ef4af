"""Interruptible collectives: the collectives that obey a rank's stop (``comm.stop``).

Why: gloo's ``ProcessGroup.abort()`` does not wake a collective blocked on a live (hung) peer, so a
rank blocked in a synchronous collective could only leave at the collective timeout (minutes).
Instead every blocking collective is issued with ``async_op=True`` and its work is waited on in
short slices, checking the stop between slices. A stop requested (by the processor thread) makes the
blocked thread raise :class:`CollectiveStopped` within one slice.

Stream-ordered backends (NCCL, HCCL, the emulated NCCL of drills: ``device.backends``) behave
otherwise: a collective returns at once and a stop does not raise anywhere. Their works are tracked
while in flight (the stop's ``in_flight``); a stop lets the ones already issued finish for a grace, as
on gloo, then aborts the communicators (NCCL's abort, HCCL's device stop), which makes what is still
pending return with partial results and no error. So nothing may consume a collective's result once
an abort may have cut it short: a commit point (``Stop.commit_point``) — a device sync, then "was
anything aborted?" — stands before every use that outlives a step (the optimizer's update, a shard
declared repaired, a checkpoint published). On gloo an abort never happens and it costs nothing.

After a stop, recovery clears it before the next collective (until then every new collective raises
at once). The interrupted operation stays pending inside the old group and completes if its peers
come back to it (a frozen node thawed): rebuild the groups and roll back. It never writes into the
caller's tensors then: a polled collective receives its result in tensors of its own, copied to the
caller's only when the wait sees it complete (``_Results``); a stream-ordered backend lands nothing
after its abort.

This module only *builds* wrappers, each bound to a stop; ``patches/torch/distributed.py`` installs
the ones bound to ``PROCESS_STOP``: megatron-core calls the patched collectives with no object in
hand, so the process's one stop is reached here, and everything else is handed it.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import inspect
import os
import queue
import sys
import threading
import time
import types
from typing import Callable

import torch
import torch.distributed as dist

from mindspeed_ha import compat
from mindspeed_ha.comm import abort
from mindspeed_ha.comm.stop import WAIT_SLICE_S, CollectiveStopped, Stop, Tag, as_stop
from mindspeed_ha.device import backends

__all__ = ["PROCESS_STOP", "CollectiveStopped", "PollingWork", "Stop", "alone", "make_interruptible",
           "make_interruptible_batch_p2p", "make_interruptible_coalescing_manager", "make_interruptible_p2p",
           "wait_work"]

_SLICE = datetime.timedelta(seconds=WAIT_SLICE_S)


def _group_identity(group) -> tuple[str, frozenset]:
    """A group's key and members, as ranks of the default group: the same on every member."""
    try:
        members = dist.get_process_group_ranks(compat.resolve_group(group))
    except Exception:  # (a group c10d does not know: counted apart, and never left before its grace)
        return f"unknown-{id(group)}", frozenset()
    return hashlib.blake2b(",".join(map(str, members)).encode(), digest_size=8).hexdigest(), frozenset(members)


# The process's stop: the one the installed wrappers obey, the processor requests and the recovery
# clears (the session hands it to both).
PROCESS_STOP = Stop(abort_communicators=abort.abort_registered, identify_group=_group_identity)

# This thread's state inside the wrappers: .issuing (an outer wrapper's call is under way), .blocks
# (its open coalescing blocks).
_thread = threading.local()


# The frames of the collectives' own code: a collective's issue site is the first frame outside them.
_OWN_FILES = (os.path.join("comm", "interruptible.py"), os.path.join("torch", "distributed"), "functools.py",
              "contextlib.py", os.path.join("c10d_logger.py"))


def _caller() -> str:
    """Where the collective being issued was called from (``file:line in function``), past the
    wrappers and torch.distributed's own frames: a desync's evidence (``Issued.evidence``)."""
    f: types.FrameType | None = sys._getframe(2)
    while f is not None and any(own in f.f_code.co_filename for own in _OWN_FILES):
        f = f.f_back
    if f is None:
        return ""
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"


def one_collective_more(stop: Stop) -> None:
    """(The desync drill.) An all-reduce on the default group that this rank's peers never issue: counted
    as issued (``Issued``), then waited in, as a wait for peers, until the stop comes — with no
    communicator involved, so nothing is left pending in one when the recovery replaces them."""
    stop.issued.issue(None, "all_reduce", _caller())
    token = stop.in_flight.polled.begin()
    try:
        while not stop.requested():
            time.sleep(WAIT_SLICE_S)
    finally:
        stop.in_flight.polled.end(token)
    stop.raise_stopped()


def wait_work(work, stop: Stop, p2p: bool = False, tag: Tag | None = None) -> None:
    """Wait for a c10d ``Work``, raising ``CollectiveStopped`` once ``stop`` is requested (``tag``: the
    collective's, as ``Stop.issued`` counted it)."""
    if work.is_completed() or stop.requested():
        return _wait_work(work, stop, p2p, tag)
    token = stop.in_flight.polled.begin()
    try:
        _wait_work(work, stop, p2p, tag)
    finally:
        stop.in_flight.polled.end(token)


def _wait_stream(work, kind: str, stop: Stop) -> None:
    """Wait for a stream-ordered collective as its caller would (NCCL: the compute stream waits; the
    emulated backend: the host), bracketed for the evidence."""
    waits = stop.in_flight.waits(kind)
    token = waits.begin()
    try:
        work.wait()
    except Exception as e:  # (once the stop aborted the communicators, whatever a wait raises is the stop)
        raise as_stop(stop, e)
    finally:
        waits.end(token)


def _wait_work(work, stop: Stop, p2p: bool = False, tag: Tag | None = None) -> None:
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
    before it faulted), and raising then would throw this rank out of code no recovery covers —
    unless a faulted rank never entered it (``Stop.never_entered``): then no member can complete it."""
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
                    if stop.requested():
                        stopped_at = stopped_at or time.monotonic()
                        if stop.grace_over(stopped_at, tag):
                            stop.raise_stopped(tag)
    done = threading.Event()
    errors = _wait_on_helper(work, done)
    _wait_event(done, stop, tag)
    if errors:
        raise errors[0]


def _wait_event(done: threading.Event, stop: Stop, tag: Tag | None = None) -> None:
    stopped_at = None
    while not done.wait(WAIT_SLICE_S):
        if stop.requested():
            stopped_at = stopped_at or time.monotonic()
            if stop.grace_over(stopped_at, tag):
                stop.raise_stopped(tag)


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

    def __init__(self, work, stop: Stop, p2p: bool = False, results: _Results = _NO_RESULTS,
                 stream: str | None = None, tag: Tag | None = None):
        super().__init__()
        self._tag = tag
        self._work = work
        self._stop = stop
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
            _wait_stream(self._work, self._stream, self._stop)
            done = True
        else:
            wait_work(self._work, self._stop, self._p2p, self._tag)
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
    return backends.stream_kind(name)  # (nothing to move: a barrier) the group's stream-ordered backend's


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
            or (compat.coalescing(group) and getattr(_blocks().get(group), "kind", "") is not None)):
        return args, kwargs, results  # nothing written, an outer wrapper's call, or a block not ours
    i = params.index(name)
    if i < len(args):
        args = args[:i] + (results.own(args[i], keep),) + args[i + 1:]
    elif name in kwargs:
        kwargs = {**kwargs, name: results.own(kwargs[name], keep)}
    return args, kwargs, results


class _Block:
    """An open coalescing block: the results its recorded collectives land (polled ones: ``kind``
    None; a stream-ordered backend's land nothing of ours), and their tags."""

    def __init__(self, kind: str | None) -> None:
        self.kind = kind
        self.results = _Results()
        self.tags: list[Tag | None] = []

    def tag(self) -> Tag | None:
        """The block's: its first collective's, when each of them needs every member (on the wire the
        block is issued at its exit, so a rank that never counted its first one never issued it)."""
        return self.tags[0] if self.tags and all(t is not None for t in self.tags) else None


def _blocks() -> dict:
    """This thread's open coalescing blocks: group -> the block (``_Block``)."""
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


def make_interruptible(fn: Callable, stop: Stop) -> Callable:
    """Wrap a c10d collective that takes ``async_op``: issue async, wait interruptibly (``stop``)."""
    params = list(inspect.signature(fn).parameters)
    idx = params.index("async_op")
    gidx = params.index("group") if "group" in params else None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if stop.stops_now():
            stop.raise_stopped()
        if _alone:
            return _answer_alone(fn, args, kwargs)
        deferred = stop.deferred
        if deferred is not None and stop.uncovered_here():
            return _answer_deferred(fn, args, kwargs, deferred)
        if stop.loop_alone and stop.uncovered_here():
            return _answer_alone(fn, args, kwargs)
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
            return _stream_collective(fn, args, kwargs, want_async, kind, stop, group)
        resolved = compat.resolve_group(group)
        args, kwargs, results = _with_own_results(fn, params, args, kwargs, resolved)
        work = _issue(fn, args, kwargs)
        if work is None:  # not a member of the group: nothing was received
            return None
        tag = stop.issued.issue(group, fn.__name__, _caller())
        block = _blocks().get(resolved)
        if block is not None:  # (recorded for the block's exit, or issued inside it: waited for with it)
            block.tags.append(tag)
        if compat.is_placeholder_work(work):  # inside a coalescing block: its results land with the block's
            if block is not None:
                block.results.add(results)
            return work if want_async else None
        work = _unwrap(work)
        if want_async:
            return PollingWork(work, stop, results=results, tag=tag)
        try:
            wait_work(work, stop, tag=tag)
        except Exception as e:
            if not stop.uncovered_here():
                raise
            stop.defer(e, fn.__name__)
            _answer_deferred(fn, *callers, e)
            return None
        results.land()
        return None

    setattr(wrapper, "__mindspeed_ha_original__", fn)
    return wrapper


def _stream_collective(fn: Callable, args: tuple, kwargs: dict, want_async: bool, kind: str, stop: Stop,
                       group=None):
    """A collective of a stream-ordered backend (issued async, so that its work is tracked): the
    caller's async work, or waited for as the caller's synchronous call would have."""
    if stop.aborted():  # (outside the covered calls: inside them the stop raised at the entry) no communicator
        return _answer_deferred(fn, args, kwargs, CollectiveStopped(f"{fn.__name__} after a stop's abort"))
    try:
        work = _issue(fn, args, kwargs)
    except Exception as e:  # (an abort begun meanwhile: the communicator refuses it, which is the stop)
        raise as_stop(stop, e)
    if work is None:  # not a member of the group
        return None
    tag = stop.issued.issue(group, fn.__name__, _caller())
    resolved = compat.resolve_group(group)
    block = _blocks().get(resolved)
    if block is not None:
        block.tags.append(tag)
    if compat.is_placeholder_work(work):  # inside a coalescing block: the block's work is tracked
        return work if want_async else None
    work = _unwrap(work)
    stop.in_flight.issued(work, tag, resolved)
    if want_async:
        return PollingWork(work, stop, stream=kind)
    try:
        _wait_stream(work, kind, stop)
    except Exception as e:
        if not stop.uncovered_here():
            raise
        stop.defer(e, fn.__name__)
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


def make_interruptible_p2p(fn: Callable, stop: Stop) -> Callable:
    """Wrap ``isend``/``irecv`` (always async): hand back a PollingWork so ``send``/``recv`` and
    callers' ``.wait()`` are interruptible (gloo) or tracked (a stream-ordered backend)."""
    params = list(inspect.signature(fn).parameters)
    gidx = params.index("group") if "group" in params else None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if stop.stops_now():
            stop.raise_stopped()
        _p2p_issued((fn.__name__,))
        work = fn(*args, **kwargs)
        if work is None or isinstance(work, PollingWork) or compat.is_placeholder_work(work):
            return work
        group = kwargs.get("group") if gidx is None or gidx >= len(args) else args[gidx]
        return _p2p_work(work, compat.resolve_group(group), _first_tensor(args, kwargs), stop)

    setattr(wrapper, "__mindspeed_ha_original__", fn)
    return wrapper


def _p2p_work(work, group, tensor, stop: Stop) -> PollingWork:
    kind = _stream_kind(group, tensor)
    if kind is None:
        return PollingWork(work, stop, p2p=True)
    stop.in_flight.issued(work, group=group)
    return PollingWork(work, stop, stream=kind)


def make_interruptible_batch_p2p(fn: Callable, stop: Stop) -> Callable:
    @functools.wraps(fn)
    def wrapper(p2p_op_list):
        if stop.stops_now():
            stop.raise_stopped()
        _p2p_issued([getattr(op.op, "__name__", "") for op in p2p_op_list])
        works = fn(p2p_op_list)
        if not p2p_op_list:
            return works
        group, tensor = compat.resolve_group(p2p_op_list[0].group), p2p_op_list[0].tensor
        return [w if w is None or isinstance(w, PollingWork) else _p2p_work(w, group, tensor, stop) for w in works]

    setattr(wrapper, "__mindspeed_ha_original__", fn)
    return wrapper


def make_interruptible_coalescing_manager(orig_cm: Callable, stop: Stop) -> Callable:
    """Wrap ``_coalescing_manager``: ops inside it only record themselves (returning ``_IllegalWork``);
    the real work is issued when the block exits. Force ``async_ops=True`` there and wait for the
    manager's works interruptibly (gloo) or tracked (a stream-ordered backend) — at exit for a sync
    block, in ``cm.wait()`` for an async one."""

    @contextlib.contextmanager
    @functools.wraps(orig_cm)
    def wrapper(group=None, device=None, async_ops=False):
        if stop.stops_now():
            stop.raise_stopped()
        resolved = compat.resolve_group(group)
        kind = _stream_kind(resolved, device=device)
        block = _blocks()[resolved] = _Block(kind)
        try:
            with orig_cm(group, device, async_ops=True) as cm:
                # (an instance attribute: megatron calls cm.wait())
                cm.wait = functools.partial(_wait_all, cm, block, stop, kind)
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
                stop.in_flight.issued(w, block.tag(), resolved)
        if not async_ops:
            _wait_all(cm, block, stop, kind)

    setattr(wrapper, "__mindspeed_ha_original__", orig_cm)
    return wrapper


def _works_of(cm) -> list:
    return [_unwrap(w) for w in cm.works if w is not None and not compat.is_placeholder_work(w)]


def _wait_all(cm, block: _Block, stop: Stop, kind: str | None = None) -> None:
    for w in _works_of(cm):
        if kind is None:
            wait_work(w, stop, tag=block.tag())
        else:
            _wait_stream(w, kind, stop)
    block.results.land()


