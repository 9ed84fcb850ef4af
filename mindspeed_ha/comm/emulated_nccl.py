"""A CPU process-group backend with NCCL's semantics, for fault drills on machines without a GPU.

Why: on gloo a stopped collective raises in the thread that waits for it, so every recovery drill on
a CPU exercises a behaviour users never see. Users train on NCCL, where collectives are queued on a
stream and return at once, and where ``abort()`` makes the queued kernels return with whatever they
had: nothing raises until something checks. This backend wraps gloo (which does the arithmetic, so a
job's results equal a gloo job's bits) and reproduces what matters to fault tolerance:

- A collective returns at once and completes later: a thread per communicator waits for its
  collectives in issue order, as a CUDA stream runs them; results land in the caller's tensors when
  it completes.
- Waiting for it (``work.wait()``, what torch's synchronous calls do) blocks until it has completed:
  the point where a GPU's compute stream would consume the result.
- ``abort()`` makes every pending collective of that communicator complete *without error*, its
  outputs partial: an in-place reduction keeps the rank's own contribution, an out-of-place output
  what it held (what a ring leaves in the chunks it never received); nothing lands later. Every
  collective issued after it raises, as NCCL's aborted communicator does.
- ``abort()`` then returns only once no other communicator of the process that is not aborted has a
  collective in flight (``Device.reclaim``): ``ncclCommAbort`` sets the communicator's abort flag,
  then reclaims it, freeing its device memory, and a free waits for the whole device to go idle — so
  it waits for a kernel stuck in another communicator until that one is aborted too. torch's
  ``ProcessGroupNCCL::abort`` waits for it on a future whose destructor blocks until NCCL returns,
  so the group's timeout does not bound the wait either: here it has no bound. Aborting the
  communicators one after another then never gets past the first idle one while a later one holds a
  collective (NVIDIA/nccl#1013, pytorch/pytorch#119797); aborting them all at once frees them all.
- A communicator is initialised (``ncclCommInitRank``) in its first collective unless it was connected
  eagerly (``eager_connect_single_device``, what torch does for a group bound to a device): an
  initialisation in a collective is recorded (``lazy_inits``), so a drill can tell whether a rebuild
  left its communicators' set-up to the first step after it.
- A collective that fails (a peer's connection closed, the timeout) fails its work, as NCCL's
  watchdog does with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 0 (no handling) or 2 (CleanUpOnly). Under
  torch's default, 3 (SkipCleanUp), or 1 (TearDown), the watchdog ends the process instead, and so
  does this backend.

- Asking whether a collective completed (``work.is_completed()``) takes its communicator's lock, which
  its abort holds until it returns: torch's ``WorkNCCL::isCompleted`` checks for NCCL errors under the
  communicator's mutex, the mutex ``NCCLComm::abort`` holds while ``ncclCommAbort`` runs — so a thread
  that asks while an abort is stuck waits as long as it. (torch's binding keeps the GIL there, which
  freezes every thread of the process; here only the asking thread waits.)
- With ``MINDSPEED_HA_EMULATE_NCCL_ABORT_RAISES=1`` an aborted collective fails instead of completing
  with partial outputs: waiting for it raises ``DistBackendError`` ("... was aborted"), as torch's can
  after an abort (the wait's own check, or the watchdog's error rethrown).

A drill of an abort that never frees its host (``MINDSPEED_HA_EMULATE_NCCL_HOLD=R``): in the first
process of job rank R (not a restarted one), an abort completes nothing (the kernels never see their
flag), so a thread waiting for one of its collectives stays where it is, and every abort waits for
good while such a collective is in flight (the device never drains) — what a GPU whose kernel never
sees its abort flag, or an abort stuck in NCCL's host code, does to a survivor. With nothing in
flight an abort returns, as NCCL's of an idle device does.

What it cannot reproduce: device memory and a compute stream that runs ahead of the host (tensors are
CPU tensors; a synchronous collective blocks the host where a GPU's would block the stream, so a
result is never read early), NCCL's algorithms and their numerics, communicator splitting or
shrinking, the cost of an initialisation (the gloo underneath connects when it is made: a lazy one is
recorded, not slower) and the separate two-rank communicators NCCL makes for point-to-point
messages on a group not bound to a device, kernels of other processes sharing the device, and a
peer's abort failing this rank's collective (here, as NCCL's kernel, it waits until its own abort or
the timeout), non-blocking communicators (``TORCH_NCCL_USE_COMM_NONBLOCKING``: their set-up and
connection polled under the communicator's mutex), and a process frozen whole by a call that keeps
the GIL.

A job runs on it with ``MINDSPEED_HA_EMULATE_NCCL=1`` (the device layer picks it instead of gloo for
a CPU job, ``register()`` makes it torch's backend ``emulated_nccl``).
"""
from __future__ import annotations

import datetime
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from mindspeed_ha.device.backends import EMULATED_NCCL

# ProcessGroup method -> (index of the argument it writes its result into, whether that argument's
# value is an input too), as torch's Python API calls them (their names move between versions: every
# one that exists is served). None: the method writes nothing.
_WRITES: dict[str, tuple[int, bool] | None] = {
    "allreduce": (0, True), "allreduce_coalesced": (0, True), "broadcast": (0, True), "reduce": (0, True),
    "allgather": (0, False), "all_gather_single": (0, False), "_allgather_base": (0, False),
    "all_gather_single_coalesced": (0, False), "allgather_into_tensor_coalesced": (0, False),
    "allgather_coalesced": (0, False),
    "reduce_scatter": (0, False), "reduce_scatter_single": (0, False), "_reduce_scatter_base": (0, False),
    "reduce_scatter_single_coalesced": (0, False), "reduce_scatter_tensor_coalesced": (0, False),
    "alltoall": (0, False), "alltoall_base": (0, False), "all_to_all_single": (0, False),
    "gather": (0, False), "scatter": (0, False), "recv": (0, False), "recv_anysource": (0, False),
    "send": None, "barrier": None,
}
# torch's documented error-handling modes (ProcessGroupNCCL.hpp): the watchdog ends the process on a
# failed collective under 1 (TearDown) and 3 (SkipCleanUp, the default), keeps it under 0 and 2.
ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_ENDS_PROCESS = ("1", "3")
# The drill of an abort that never frees its host: the job rank whose first process it holds.
HOLD_ENV = "MINDSPEED_HA_EMULATE_NCCL_HOLD"
# Aborted collectives fail (DistBackendError) instead of completing with partial outputs.
ABORT_RAISES_ENV = "MINDSPEED_HA_EMULATE_NCCL_ABORT_RAISES"
_STOP = object()
# The collectives in which a communicator of this process was initialised, not connected before
# (what NCCL does without a bound device): (method, rank in the group, group size).
lazy_inits: list[tuple[str, int, int]] = []


class CommunicatorAborted(RuntimeError):
    """A collective issued on an aborted communicator (NCCL: DistBackendError)."""


def _own(value: Any, keep: bool, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """The collective's own tensor(s) in place of ``value``; (caller's, own) pairs in ``pairs``."""
    if isinstance(value, torch.Tensor):
        mine = value.clone() if keep else torch.empty_like(value)
        pairs.append((value, mine))
        return mine
    if isinstance(value, (list, tuple)):
        return [_own(v, keep, pairs) for v in value]
    return value


class _Work(dist.Work):
    """One collective as its caller holds it: complete when its results landed, or when an abort cut
    it short (no error then: the outputs keep what they held)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], outputs: list[torch.Tensor],
                 mutex: threading.Lock):
        super().__init__()
        self._pairs, self._outputs = pairs, outputs
        self._mutex = mutex  # (its communicator's: held by an abort until it returns)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()
        self.aborted = False
        self.completed_at: float | None = None

    def finish(self, error: BaseException | None = None, aborted: bool = False) -> None:
        with self._lock:
            if self._done.is_set():
                return
            if error is None and not aborted:
                with torch.no_grad():
                    for callers, own in self._pairs:
                        callers.copy_(own)
            self._error, self.aborted = error, aborted
            self.completed_at = time.monotonic()
            self._pairs = []
            self._done.set()
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(self._outputs)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout:
            if not self._done.wait(timeout.total_seconds()):
                raise RuntimeError("emulated NCCL: wait timed out (the collective goes on)")
        else:
            self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        with self._mutex:  # (torch: isCompleted checks NCCL's errors under the communicator's mutex)
            return self._done.is_set()

    def done(self) -> bool:
        """Complete, as the device sees it (no lock: what NCCL's own reclaim reads)."""
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:  # type: ignore[override]  # (torch's stub: an exception_ptr)
        return self._error

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        raise RuntimeError("emulated NCCL: recv from any source is not supported")


def _stream(jobs: "queue.SimpleQueue[Any]", rank: int) -> None:
    """A communicator's stream: its collectives complete in the order they were issued. (It holds
    the queue, never the process group, which may be released while a collective stays pending.)"""
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        inner, work = job
        try:
            inner.wait()
        except BaseException as e:  # a peer lost, the timeout: NCCL's watchdog sees the same
            if os.environ.get(ERROR_HANDLING_ENV, "3") in _ENDS_PROCESS and not work.done():
                sys.stderr.write(f"[rank {rank}] emulated NCCL watchdog: a collective failed ({e}); "
                                 f"{ERROR_HANDLING_ENV}={os.environ.get(ERROR_HANDLING_ENV, '3')} ends the "
                                 "process\n")
                sys.stderr.flush()
                os._exit(134)  # (torch's watchdog aborts the process: SIGABRT's code)
            work.finish(error=dist.DistBackendError(f"NCCL error (emulated): {e}")
                        if hasattr(dist, "DistBackendError") else e)
        else:
            work.finish()


class Device:
    """The process's device as NCCL's reclaim sees it: idle when no communicator that is not aborted
    has a collective in flight. (An aborted communicator's kernels exit at once: its flag is set.)"""

    POLL_S = 0.005

    def __init__(self) -> None:
        self._communicators: "weakref.WeakSet[EmulatedNCCL]" = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, comm: "EmulatedNCCL") -> None:
        with self._lock:
            self._communicators.add(comm)

    def busy(self, but: "EmulatedNCCL | None" = None, aborted: bool = False) -> list["EmulatedNCCL"]:
        """Communicators other than ``but``, not aborted (``aborted``: aborted ones too), with a
        collective in flight."""
        with self._lock:
            comms = list(self._communicators)
        return [c for c in comms if c is not but and (aborted or not c.aborted) and c.in_flight()]

    def reclaim(self, comm: "EmulatedNCCL", held: bool = False) -> None:
        """``comm``'s abort frees its device memory: wait until the device is idle, however long.
        ``held``: the drill of kernels that never see their abort flag (``HOLD_ENV``): an aborted
        communicator's collectives stay in flight, so the device never drains while one does."""
        while self.busy(but=None if held else comm, aborted=held):
            time.sleep(self.POLL_S)


DEVICE = Device()


def _holds_here() -> bool:
    """This process is the one the never-freeing abort drill holds (``HOLD_ENV``)."""
    held = os.environ.get(HOLD_ENV, "").strip()
    return (bool(held) and held == os.environ.get("RANK", "").strip()
            and os.environ.get("MINDSPEED_HA_RESTART_COUNT", "0") in ("", "0"))


class EmulatedNCCL(dist.ProcessGroup):
    """One communicator (see the module's text) over a gloo one made on the same store."""

    def __init__(self, gloo: dist.ProcessGroup, rank: int, size: int):
        super().__init__(rank, size)  # type: ignore[call-arg]  # (torch's stub lists (store, rank, size) only)
        self._rank, self._size = rank, size
        self._gloo = gloo
        self._jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._pending: "weakref.WeakSet[_Work]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._mutex = threading.Lock()  # (NCCLComm's mutex: an abort holds it until it returns)
        self._aborted = False
        self.connected = False  # initialised (eagerly, or by its first collective)
        DEVICE.add(self)
        self._thread = threading.Thread(target=_stream, args=(self._jobs, rank), daemon=True,
                                        name=f"emulated-nccl-stream-r{rank}")
        self._thread.start()
        weakref.finalize(self, self._jobs.put, _STOP)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def name(self) -> str:
        return EMULATED_NCCL

    def _get_backend_name(self) -> str:
        return EMULATED_NCCL

    def eager_connect_single_device(self, device: torch.device | None) -> None:
        """Initialise the communicator now (NCCL: ``ncclCommInitRank`` for ``device``), not in its
        first collective."""
        self.connected = True

    def _issue(self, method: str, args: tuple, kwargs: dict[str, Any]) -> _Work:
        with self._lock:
            if self._aborted:
                raise CommunicatorAborted(f"NCCL communicator was aborted on rank {self._rank} (emulated): "
                                          f"{method} after the abort")
            if not self.connected:
                self.connected = True
                lazy_inits.append((method, self._rank, self._size))
        writes = _WRITES.get(method)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        outputs: list[torch.Tensor] = []
        if writes is not None:
            i, keep = writes
            callers = args[i]
            args = args[:i] + (_own(callers, keep, pairs),) + args[i + 1:]
            outputs = [c for c, _ in pairs]
        work = _Work(pairs, outputs, self._mutex)
        inner = getattr(self._gloo, method)(*args, **kwargs)
        with self._lock:
            if self._aborted:  # (aborted meanwhile: this one never started)
                work.finish(aborted=True)
                return work
            self._pending.add(work)
        self._jobs.put((inner, work))
        return work

    def in_flight(self) -> bool:
        """A collective of this communicator is issued and not complete (its kernel runs)."""
        return any(not w.done() for w in list(self._pending))

    def abort(self) -> None:
        """Every pending collective completes now, without error and with partial outputs (or fails,
        ``ABORT_RAISES_ENV``); then the communicator is reclaimed, which waits until the device is idle
        (see the module's text), holding the communicator's mutex throughout. A second abort returns at
        once, as torch's does."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            pending = list(self._pending)
        held = _holds_here()
        with self._mutex:
            if not held:  # (the drill: the kernels never see the flag, nothing completes)
                error = (dist.DistBackendError(f"NCCL communicator was aborted on rank {self._rank} (emulated)")
                         if os.environ.get(ABORT_RAISES_ENV, "") == "1" else None)
                for work in pending:
                    work.finish(error=error, aborted=True)
            DEVICE.reclaim(self, held)

    def shutdown(self) -> None:
        self.abort()

    def _wait_for_pending_works(self) -> None:
        for work in list(self._pending):
            work.wait()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._gloo.set_timeout(timeout)

    @property
    def aborted(self) -> bool:
        return self._aborted


def _method(name: str):
    def call(self: EmulatedNCCL, *args: Any, **kwargs: Any) -> _Work:
        return self._issue(name, args, kwargs)
    call.__name__ = name
    return call


for _name in _WRITES:
    if hasattr(dist.ProcessGroup, _name):
        setattr(EmulatedNCCL, _name, _method(_name))


def register(make_gloo: Callable[..., dist.ProcessGroup]) -> None:
    """Make ``emulated_nccl`` a backend torch knows (``init_process_group(backend=...)``), once.
    ``make_gloo(store, rank, size, "gloo", timeout)``: the gloo communicator underneath one."""
    if not hasattr(dist.Backend, EMULATED_NCCL.upper()):
        def create(store: "dist.Store", rank: int, size: int, timeout: datetime.timedelta) -> EmulatedNCCL:
            return EmulatedNCCL(make_gloo(store, rank, size, "gloo", timeout), rank, size)
        dist.Backend.register_backend(EMULATED_NCCL, create, devices=["cpu"])
