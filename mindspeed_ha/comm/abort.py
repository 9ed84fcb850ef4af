"""Aborting a process's stream-ordered communicators: all at once, under one deadline.

Why at once: ``ncclCommAbort`` sets a communicator's abort flag (its kernels exit), then reclaims it —
syncs its streams and frees its device memory — and a free waits for the whole device to go idle.
A survivor's kernel stuck in one communicator (a reduce-scatter the faulted rank never joined) keeps
the device busy until *that* communicator's flag is set; aborting the job's groups one after another
waits forever in the first idle one's free (NVIDIA/nccl#1013, pytorch/pytorch#119797). torch's
``ProcessGroupNCCL::abort`` does not bound that wait either: it waits up to the group's timeout on a
``std::async`` future whose destructor then blocks until NCCL returns. So every communicator's abort
runs on a thread of its own, all started together (NVRx's in-process abort does the same, one
thread a group): every flag is set at once, and the device drains. NCCL's own group abort
(``ncclGroupStart``/``End`` around several aborts, torch's experimental ``_abort_process_group``)
is not used: torch runs each group's abort on a thread of its own, where NCCL's group state
(thread-local) does not reach, and that call empties torch's group tables, which hold the job's
stable groups.

Why a deadline: an abort that never returns (a kernel that never sees its flag, a host thread stuck
inside NCCL) must not hold the stop for good. The caller waits ``deadline_s`` for them all, then
goes on with what it knows; an abort still running stays on its (daemon) thread, and the report says
which. The deadline is the engine's, whatever the groups' timeouts (``--distributed-timeout-minutes``).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Iterable

import torch.distributed as dist

from mindspeed_ha import compat
from mindspeed_ha.device import backends

# How long a stop waits for its communicators' aborts (and, measured from the same start, for the
# training thread to reach the recovery: comm.interruptible).
DEADLINE_S = 10.0


@dataclasses.dataclass
class AbortReport:
    """What one abort of several communicators did: each one's seconds (None: it had not returned by
    the deadline), each one's error, and the seconds the whole took."""
    took: dict[str, float | None]
    failed: dict[str, str]
    seconds: float
    deadline_s: float

    @property
    def unfinished(self) -> list[str]:
        return [name for name, t in self.took.items() if t is None]

    def line(self) -> str:
        """For the ``stop:`` log line: how many, how long, each one's time."""
        done = sorted(((t, name) for name, t in self.took.items() if t is not None), reverse=True)
        each = ", ".join(f"{name} {t:.3f}s" for t, name in done)
        text = f"{len(done)} communicator(s) aborted at once in {self.seconds:.3f}s ({each or 'none'})"
        if self.unfinished:
            text += (f"; {len(self.unfinished)} had not returned after the {self.deadline_s:g}s deadline: "
                     f"{', '.join(self.unfinished)}")
        if self.failed:
            text += f"; {len(self.failed)} raised: " + "; ".join(f"{n}: {e}" for n, e in self.failed.items())
        return text

    def merged(self, later: "AbortReport") -> "AbortReport":
        """This abort and a later one of the same stop (the rest of the communicators)."""
        return AbortReport({**self.took, **later.took}, {**self.failed, **later.failed},
                           self.seconds + later.seconds, self.deadline_s)

    def to_wire(self) -> dict:
        """For the recovery's answers (msgpack): the slowest first."""
        return {"seconds": round(self.seconds, 4), "unfinished": self.unfinished,
                "took": {n: (None if t is None else round(t, 4)) for n, t in self.took.items()}}


def abort_all(communicators: Iterable[tuple[str, object]], deadline_s: float = DEADLINE_S) -> AbortReport:
    """Call ``abort()`` on every ``(name, communicator)`` at once, a thread each; wait for them up to
    ``deadline_s``. Names must be unique (a duplicate is numbered)."""
    t0 = time.monotonic()
    took: dict[str, float | None] = {}
    failed: dict[str, str] = {}
    lock = threading.Lock()
    threads = []

    def abort_one(name: str, comm) -> None:
        start = time.monotonic()
        try:
            comm.abort()
        except Exception as e:  # one that cannot be aborted must not keep the others from it
            with lock:
                failed[name] = f"{type(e).__name__}: {e}"[:200]
        with lock:
            took[name] = time.monotonic() - start

    for name, comm in communicators:
        unique, n = name, 1
        while unique in took:
            n += 1
            unique = f"{name}#{n}"
        took[unique] = None
        threads.append(threading.Thread(target=abort_one, args=(unique, comm), daemon=True,
                                        name=f"mindspeed-ha-abort-{unique}"[:60]))
    for t in threads:
        t.start()
    deadline = t0 + deadline_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        return AbortReport(dict(took), dict(failed), time.monotonic() - t0, deadline_s)


def abort_registered(deadline_s: float = DEADLINE_S, only: list | None = None) -> AbortReport | None:
    """A stop's abort of this process's communicators (``comm.stop``). NCCL (and the emulated NCCL):
    every communicator of the groups ``only`` (None: of every group torch knows), at once
    (``abort_all``); one not aborted is not touched. HCCL: stop the device (torch_npu's
    ``stop_device``; a recovery restarts it before anything runs there again:
    ``device.restart_after_stop``), which ends every communicator of the device. None before the process
    group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    registered = compat.registered_groups()
    chosen = registered if only is None else [pg for pg in registered if any(pg is g for g in only)]
    report = abort_all([(_group_label(pg), pg) for pg in chosen if _abortable(pg)], deadline_s)
    from mindspeed_ha.events import get_logger
    (get_logger("comm").error if report.unfinished or report.failed else get_logger("comm").warning)(
        "stop: %s", report.line())
    if any(_stops_device(pg) for pg in registered):
        from mindspeed_ha import device
        device.stop_device()
        for pg in registered:  # (every communicator of the device ended with it: a stable group hears so)
            ended = getattr(pg, "ended_with_device", None)
            if ended is not None:
                ended()
    return report


def _backend_of(pg) -> str:
    try:
        return backends.canonical(str(dist.get_backend(pg)))
    except Exception:  # not a group torch knows (any more)
        return ""


def _abortable(pg) -> bool:
    """``pg``'s communicators are NCCL's (or the emulated NCCL's): a stop aborts them."""
    acc = backends.accelerator(_backend_of(pg))
    return acc is not None and acc.abortable and acc.can_abort_now()


def _stops_device(pg) -> bool:
    """``pg``'s backend (HCCL) is stopped with its device, not aborted."""
    acc = backends.accelerator(_backend_of(pg))
    return acc is not None and acc.stops_device


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
