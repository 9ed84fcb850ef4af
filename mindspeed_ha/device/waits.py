"""How long a rank waits for its collectives, and whether it waits now: the evidence hang diagnosis and
straggler detection read (``comm.interruptible.waiting`` / ``waited_s``).

Where a wait blocks the host — gloo, polled by ``comm.interruptible``, and the emulated NCCL
backend — the host's clock measures it (``HostWaits``). On a GPU the host does not wait: a
collective's ``work.wait()`` makes the compute stream wait for it, and the host is usually ahead,
inside a later ``.item()`` or stream sync. There an event recorded on the stream just before the wait
and one just after bracket it (``EventWaits``): the first completing means the rank's own work up to
the collective is done, the second that the collective is; one without the other, the rank waits for
a peer. ``elapsed_time`` between them is the wait's length. (NCCL's flight recorder knows the same per
collective; these events need nothing enabled and work alike on CUDA and on Ascend's torch_npu.)
"""
from __future__ import annotations

import threading
import time
from typing import Any


class HostWaits:
    """Waits that block a host thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocked = 0
        self._waited = 0.0

    def begin(self) -> float:
        with self._lock:
            self._blocked += 1
        return time.perf_counter()

    def end(self, token: Any) -> None:
        dt = time.perf_counter() - token
        with self._lock:
            self._blocked -= 1
            self._waited += dt

    def waiting(self) -> bool:
        return self._blocked > 0

    pending = waiting

    def waited_s(self) -> float:
        return self._waited


class EventWaits:
    """Waits that hold a device stream (CUDA, or an NPU through torch_npu's ``torch.npu.Event``).

    Its events come from a pool made with the first wait and are given back to it, never destroyed:
    a stop's path (the held watch, the recovery's reports) reads the waits while NCCL's kernels may
    hold the device, and ``cudaEventDestroy`` (an event's release) can block there with the GIL held
    (pytorch#122732, #110449). The pool grows only when a wait begins with every event in use (more
    collectives in flight than ever before: the finished ones are taken back first), on the training
    thread, which a stop keeps from issuing."""

    POOL = 64  # events made at once: 32 waits in flight (a pipeline's sends and receives, coalesced blocks)

    def __init__(self, events_of: Any) -> None:
        self._event = events_of.Event
        self._lock = threading.Lock()
        self._open: list[tuple[Any, Any]] = []
        self._free: list[Any] = []
        self._made = 0
        self._waited = 0.0

    def _take(self) -> Any:
        with self._lock:
            if not self._free:
                self._account()
            if not self._free:
                self._free = [self._event(enable_timing=True) for _ in range(self.POOL)]
                self._made += self.POOL
            return self._free.pop()

    def _account(self) -> None:
        """(Under the lock.) The finished waits accounted, their events back to the pool."""
        still = []
        for pre, post in self._open:
            if post.query():
                self._waited += pre.elapsed_time(post) / 1e3
                self._free += [pre, post]
            else:
                still.append((pre, post))
        self._open = still

    def made(self) -> int:
        """Events made so far (none is ever destroyed)."""
        return self._made

    def begin(self) -> Any:
        ev = self._take()
        ev.record()
        return ev

    def end(self, token: Any) -> None:
        ev = self._take()
        ev.record()
        with self._lock:
            self._open.append((token, ev))

    def _harvest(self) -> list[tuple[Any, Any]]:
        """Account the finished waits (their events back to the pool); return those still open."""
        with self._lock:
            self._account()
            return list(self._open)

    def waiting(self) -> bool:
        return any(pre.query() for pre, _ in self._harvest())

    def pending(self) -> bool:
        return bool(self._harvest())

    def waited_s(self) -> float:
        self._harvest()
        return self._waited
