"""Fault injection, for chaos drills and tests.

``MINDSPEED_HA_INJECT="KIND:rank=R:step=S[:phase=P][:every],..."`` (``step=any``: the first time the phase is
reached; ``every``: at every run of that step, by every process of the rank — a fault that recurs, as a bug does)
    KIND   kill (SIGKILL self) | exit (os._exit(1)) | exception (RuntimeError in the step)
           | bug (ValueError in the step: an error of the job's own code, as a model's or a data loader's)
           | desync (this rank issues one collective more than its peers, on the default group, and waits in
             it: its peers then wait for it in their next one — ranks in collectives that cannot match)
           | uce (corrupt this rank's optimizer shard, raise a "UCE ERROR" MemoryFault)
           | hang (the calling thread sleeps forever; other threads keep running)
           | freeze (the whole process stops, SIGSTOP: silent, its sockets open, as on a frozen
             node; SIGCONT resumes it)
           | comm (abort this rank's communicators, raise a CommFault)
           | held (this thread waits on a receive no peer sends, issued past the engine's tracking, then
             syncs the device: a host held in a device sync behind a collective the engine never saw,
             as a library's own call into the backend leaves it; only an abort of this rank's
             communicators frees it. Stream-ordered backends only: NCCL, HCCL, the emulated NCCL)
           | bitflip (flip one bit of this rank's optimizer shard, silently: a drill for
             --ha-verify-replicas-interval)
           | ecc (raise CUDA's sticky "uncorrectable ECC error encountered": process-fatal)
           | cuda-illegal-address (a real one, on a GPU: a Triton kernel stores out of bounds, and
             the CUDA context is poisoned for good: process-fatal)
           | slow (from step S on, this process's steps take FACTOR times as long: it sleeps at
             each step's start; ``:factor=F``, default 3 — a straggler for migration drills;
             factor 1 ends an earlier slowdown: the straggler is back to speed)
    PHASE  forward (default) | backward | grad-sync | optimizer | param-sync | checkpoint
           | recovery (when the rank starts serving an in-job recovery of a fault in step S, or
             parks before step S for a migration: a fault during recovery)
           | rebuild (as the rank starts an in-job recovery's rebuild of its communicators)
           | connect (in that rebuild, as the rank passes a remade communicator's open gate, before
             its backend connects: its peers are connecting to it)
           | pipeline-send | pipeline-recv (as a pipeline stage issues its send or receive of
             activations or gradients, in step S's forward and backward: only on PP > 1)
           | resize (when the rank has entered an elastic resize's new layout, before any state
             moves; S: the step the resized job goes on with: a fault during a scale-in or -out)

The trainer calls ``fire_point(phase, iteration)`` at each phase of each step. Each fault fires once
per *job*: before firing, the rank claims ``DIR/inject/<job id>/<hash>.fired`` with an exclusive
create, so a restarted worker of the same job skips it and a new job (a drill run again in the same
log dir) fires it again. The ``inject`` event is written (unbuffered) before firing. Live faults from
the controller arrive through ``add()`` on the processor thread.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

from mindspeed_ha.events import EventLog, get_logger
from mindspeed_ha.faults import CommFault, MemoryFault

ENV = "MINDSPEED_HA_INJECT"
KINDS = ("kill", "exit", "exception", "bug", "desync", "uce", "hang", "freeze", "comm", "bitflip", "ecc", "slow",
         "cuda-illegal-address", "held")
DEVICE_KINDS = {"cuda-illegal-address": "cuda"}  # drills that need a real device of that kind
STREAM_ORDERED_KINDS = ("held",)  # drills that need a backend whose abort ends a pending collective
PHASES = ("forward", "backward", "grad-sync", "optimizer", "param-sync", "step-end", "checkpoint", "recovery",
          "rebuild", "connect", "resize", "pipeline-send", "pipeline-recv")
DEFAULT_PHASE = "forward"
EXAMPLE = f'{ENV}="kill:rank=1:step=3:phase=backward,hang:rank=2:step=5"'

log = get_logger("inject")


class InjectSpecError(ValueError):
    pass


class InjectedError(RuntimeError):
    """The ``exception`` fault."""


class InjectedBug(ValueError):
    """The ``bug`` fault: an error of the job's own code (``faults.SOFTWARE_ERRORS``)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int | None  # None: the next phase point reached (step=any, live injection)
    phase: str = DEFAULT_PHASE
    nonce: str = ""   # distinguishes repeated live injections of the same fault
    factor: float = 3.0  # slow: how many times as long each step takes
    every: bool = False  # fires at every run of its step (not once per job)

    def spec(self) -> str:
        step = "" if self.step is None else f":step={self.step}"
        factor = f":factor={self.factor:g}" if self.kind == "slow" else ""
        return f"{self.kind}:rank={self.rank}{step}:phase={self.phase}{factor}{':every' if self.every else ''}"

    def key(self) -> str:
        return hashlib.sha1(f"{self.spec()}#{self.nonce}".encode()).hexdigest()[:16]


def _bad(spec: str, why: str) -> InjectSpecError:
    return InjectSpecError(
        f"{ENV}: bad fault {spec!r}: {why}. Expected KIND:rank=R:step=S|any[:phase=P][:every],... with KIND in "
        f"{'|'.join(KINDS)} and PHASE in {'|'.join(PHASES)} (default {DEFAULT_PHASE}); "
        f"e.g. {EXAMPLE}")


def validate(kind: str, rank, step, phase: str | None, spec: str | None = None, factor=None,
             every: bool = False) -> Fault:
    """Check one fault's fields (also the live injection path); raises InjectSpecError."""
    spec = spec or f"{kind}:rank={rank}:step={step}:phase={phase}"
    if kind not in KINDS:
        raise _bad(spec, f"unknown kind {kind!r}")
    phase = phase or DEFAULT_PHASE
    if phase not in PHASES:
        raise _bad(spec, f"unknown phase {phase!r}")
    for name, v in (("rank", rank), ("step", step)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise _bad(spec, f"{name} must be an integer >= 0, got {v!r}")
    if rank is None:
        raise _bad(spec, "rank is required")
    if factor is not None and kind != "slow":
        raise _bad(spec, "factor is for the slow kind only")
    if factor is not None and not (isinstance(factor, (int, float)) and 1.0 <= factor <= 100.0):
        raise _bad(spec, f"factor must be a number from 1 (back to full speed) to 100, got {factor!r}")
    if every and step is None:
        raise _bad(spec, "every needs a step (step=any fires once, at the first phase point)")
    if every and kind in ("slow", "freeze", "hang", "bitflip"):
        raise _bad(spec, f"every is for faults that raise or end the process; {kind} changes the process for good")
    return Fault(kind, rank, step, phase, factor=float(factor or 3.0), every=bool(every))


def parse(value: str) -> list[Fault]:
    """Parse a ``MINDSPEED_HA_INJECT`` value. Every field is checked; step is required (a number, or
    ``any``: the first time the phase is reached)."""
    faults = []
    for spec in (s.strip() for s in value.split(",")):
        if not spec:
            continue
        kind, *fields = [p.strip() for p in spec.split(":")]
        kv: dict[str, Any] = {}  # the given strings; rank, step and factor then converted
        every = "every" in fields
        for f in (f for f in fields if f != "every"):
            key, eq, val = f.partition("=")
            if not eq or not val:
                raise _bad(spec, f"field {f!r} is not key=value")
            if key not in ("rank", "step", "phase", "factor"):
                raise _bad(spec, f"unknown field {key!r}")
            if key in kv:
                raise _bad(spec, f"field {key!r} given twice")
            kv[key] = val
        for key in ("rank", "step"):
            if key not in kv:
                raise _bad(spec, f"{key} is required")
            if key == "step" and kv[key] == "any":
                kv[key] = None
                continue
            try:
                kv[key] = int(kv[key])
            except ValueError:
                raise _bad(spec, f"{key} must be an integer, got {kv[key]!r}") from None
        if "factor" in kv:
            try:
                kv["factor"] = float(kv["factor"])
            except ValueError:
                raise _bad(spec, f"factor must be a number, got {kv['factor']!r}") from None
        faults.append(validate(kind.lower(), kv["rank"], kv["step"], kv.get("phase"), spec, kv.get("factor"), every))
    return faults


def check_reachable(faults: list[Fault], world_size: int, train_iters: int) -> None:
    """Every fault names a rank of this job and a step it trains; raises InjectSpecError."""
    for f in faults:
        if f.rank >= world_size:
            raise InjectSpecError(f"{ENV}: {f.spec()}: there is no rank {f.rank} in a job of {world_size} ranks "
                                  f"(ranks 0..{world_size - 1})")
        if f.step is not None and train_iters and not 1 <= f.step <= train_iters:
            raise InjectSpecError(f"{ENV}: {f.spec()}: step {f.step} is never reached; this job trains steps "
                                  f"1..{train_iters} (--train-iters {train_iters})")


def check_device(faults: list[Fault], device_kind: str, backend: str) -> None:
    """A drill that needs a real GPU is refused on any other device, and one that needs a
    stream-ordered backend on gloo, before anything is built."""
    from mindspeed_ha.device.backends import EMULATE_ENV, stream_ordered
    for f in faults:
        need = DEVICE_KINDS.get(f.kind)
        if need and need != device_kind:
            raise InjectSpecError(f"{ENV}: {f.spec()} needs a {need.upper()} device, and this rank trains on "
                                  f"{device_kind}; on the CPU, ecc drills the same process-fatal path")
        if f.kind in STREAM_ORDERED_KINDS and not stream_ordered(backend):
            raise InjectSpecError(f"{ENV}: {f.spec()} needs a stream-ordered backend (NCCL, HCCL), and this rank's "
                                  f"collectives run on {backend}, whose abort frees no waiting thread; on the CPU, "
                                  f"set {EMULATE_ENV}=1 (the emulated NCCL)")


def check_layout(faults: list[Fault], args: object) -> None:
    """A phase this job's layout never runs is refused before anything is built (a drill that never
    fires tested nothing): ``args``, the trainer's parsed flags (Megatron-LM's names)."""
    for f in faults:
        why = ""
        if f.phase == "param-sync" and getattr(args, "overlap_param_gather", False):
            why = ("--overlap-param-gather: the parameter all-gather is not started after the update but bucket by "
                   "bucket in the next step's forward; drill phase=optimizer, or phase=forward of the next step")
        elif f.phase in ("pipeline-send", "pipeline-recv") and int(
                getattr(args, "pipeline_model_parallel_size", 1) or 1) == 1:
            why = "a job without a pipeline (--pipeline-model-parallel-size 1) sends and receives no activations"
        elif f.phase == "checkpoint" and not getattr(args, "save", None):
            why = "no --save: this job writes no periodic checkpoint"
        if why:
            raise InjectSpecError(f"{ENV}: {f.spec()}: phase {f.phase} never comes in this layout, {why}")


def job_id(env: Mapping[str, str] | None = None) -> str:
    """This job's name as its launcher gives it (the same for every rank and for a restarted one)."""
    env = os.environ if env is None else env
    jid = env.get("MINDSPEED_HA_JOB_ID") or env.get("TORCHELASTIC_RUN_ID")
    if not jid:
        jid = f"{env.get('MASTER_ADDR', 'local')}-{env.get('MASTER_PORT', '0')}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in jid)[:80]


class ShardCorruptor(Protocol):
    def __call__(self, bit_flip: bool = ...) -> object: ...


class Injector:
    def __init__(self, rank: int, log_dir: str, events: EventLog | None, faults=(), job: str | None = None):
        self.rank = rank
        self.marker_dir = os.path.join(log_dir, "inject", job or job_id())
        self.events = events
        self._lock = threading.Lock()
        self._pending: list[Fault] = [f for f in faults if f.rank == rank]
        self._uce_corruptor: ShardCorruptor | None = None
        self._comm_breaker: Callable[[], None] | None = None
        self._live = 0
        self._step_t = 0.0       # when the last step began (its forward point)
        self._slow_s = 0.0       # slow: seconds added to every step from the one it fired in

    @classmethod
    def from_env(cls, rank: int, log_dir: str, events: EventLog | None,
                 env: Mapping[str, str] | None = None) -> "Injector":
        env = os.environ if env is None else env
        return cls(rank, log_dir, events, parse(env.get(ENV, "")), job_id(env))  # every rank validates every fault

    def set_uce_corruptor(self, fn: ShardCorruptor) -> None:
        """``fn(bit_flip=False)`` corrupts this rank's optimizer shard (the trainer knows where it
        lives); with ``bit_flip=True`` it flips a single bit instead."""
        self._uce_corruptor = fn

    def set_comm_breaker(self, fn: Callable[[], None]) -> None:
        """``fn()`` aborts this rank's communicators; default: abort/destroy the process groups."""
        self._comm_breaker = fn

    def add(self, kind: str, rank: int, step: int | None = None, phase: str | None = None,
            factor: float | None = None) -> Fault:
        """Queue a live fault (any thread). Faults for other ranks are ignored."""
        with self._lock:
            self._live += 1
            f = validate(kind, rank, step, phase, factor=factor)
            f = dataclasses.replace(f, nonce=f"live-{os.getpid()}-{time.time_ns()}-{self._live}")
            if rank == self.rank:
                self._pending.append(f)
        return f

    def pending(self) -> list[Fault]:
        with self._lock:
            return list(self._pending)

    def unfired(self) -> list[Fault]:
        """This rank's faults that no process of the job fired (asked at a process's end: a drill
        that never fired tested nothing, and must say so)."""
        return [f for f in self.pending() if not os.path.exists(self._marker(f))]

    def fire_point(self, phase: str, iteration: int) -> None:
        """Called by the trainer at each phase point; fires the faults due here (at most once per job)."""
        last = self._step_t
        if phase == "forward":
            self._step_t = time.perf_counter()
            if self._slow_s:
                time.sleep(self._slow_s)
        if not self._pending:
            return
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        with self._lock:
            due = [f for f in self._pending if f.phase == phase and f.step in (None, iteration)]
            for f in due:
                if not f.every:  # (a recurring one stays: the step's next run fires it again)
                    self._pending.remove(f)
        for f in due:
            if self._claim(f, iteration):
                if f.kind == "slow":  # each step takes factor x the last one before it
                    self._slow_s = (f.factor - 1) * (self._step_t - last if phase == "forward" and last else 0.1)
                    time.sleep(self._slow_s)
                self._fire(f, iteration)

    # ------------------------------------------------------------------------------------------

    def _claim(self, f: Fault, iteration: int) -> bool:
        """Atomically mark ``f`` fired for the whole job; False if some process already did (a
        recurring one fires every time: its mark says only that it did once)."""
        os.makedirs(self.marker_dir, exist_ok=True)
        path = self._marker(f)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if f.every else os.O_EXCL), 0o644)
        except FileExistsError:
            log.info("inject %s already fired in this job: skipped", f.spec())
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump({"spec": f.spec(), "rank": self.rank, "pid": os.getpid(),
                       "iteration": iteration, "time": time.time()}, fh)
        return True

    def _marker(self, f: Fault) -> str:
        return os.path.join(self.marker_dir, f"{f.key()}.fired")

    def _fire(self, f: Fault, iteration: int) -> None:
        if self.events is not None:
            self.events.emit("inject", kind=f.kind, phase=f.phase, iteration=iteration, step=f.step,
                             live=bool(f.nonce))
        where = f"rank {self.rank}, iteration {iteration}, phase {f.phase}"
        log.warning("injecting %s fault (%s)", f.kind, where)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # SIGKILL is asynchronous only in theory
        elif f.kind == "exit":
            os._exit(1)
        elif f.kind == "exception":
            raise InjectedError(f"injected exception ({where})")
        elif f.kind == "bug":
            raise InjectedBug(f"injected bug ({where})")
        elif f.kind == "ecc":
            raise InjectedError(f"CUDA error: uncorrectable ECC error encountered (injected, {where})")
        elif f.kind == "cuda-illegal-address":
            from mindspeed_ha.device.cuda_faults import illegal_address
            illegal_address()
        elif f.kind == "uce":
            if self._uce_corruptor is not None:
                self._uce_corruptor()
            else:
                log.warning("uce injected but no corruptor registered: nothing corrupted")
            raise MemoryFault(f"UCE ERROR: injected uncorrectable memory error ({where})")
        elif f.kind == "bitflip":
            if self._uce_corruptor is None:
                raise InjectSpecError("bitflip needs the replica optimizer (--enable-high-availability)")
            self._uce_corruptor(bit_flip=True)  # silent: training goes on until the replica check
        elif f.kind == "slow":
            pass  # (set up by fire_point: it sleeps at every step's start from now on)
        elif f.kind == "hang":
            while True:  # alive, no progress; only this thread stops
                time.sleep(3600)
        elif f.kind == "freeze":  # the whole process stops (SIGSTOP), silent, its sockets open: a frozen node
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "comm":
            (self._comm_breaker or default_comm_breaker)()
            raise CommFault(f"injected communication failure: communicators aborted ({where})")
        elif f.kind == "held":
            hold_on_untracked()
        elif f.kind == "desync":
            from mindspeed_ha.comm.interruptible import PROCESS_STOP, one_collective_more
            one_collective_more(PROCESS_STOP)


def default_comm_breaker() -> None:
    """Tear down this rank's communicators. Stable groups (HA on): every communicator is dropped
    (peers see "Connection closed by peer") and the groups fail until the recovery reconnects them.
    Otherwise every process group is aborted (NCCL/HCCL: the communicators die; gloo's abort is a
    no-op, so the default group is destroyed too)."""
    import torch.distributed as dist
    from mindspeed_ha import compat
    from mindspeed_ha.comm import groups

    if not (dist.is_available() and dist.is_initialized()):
        return
    if isinstance(compat.default_group(), groups.StableGroup):
        groups.break_communicators()
        return
    for pg in compat.registered_groups():
        try:
            pg.abort()
        except Exception:
            pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass


# The tag of the held drill's receive (no message of a job carries it; NCCL ignores tags: on a layout
# with point-to-point messages of its own there, the drill may take one of them).
HELD_TAG = 0x4D48


def hold_on_untracked() -> None:
    """The held drill: a receive from the next rank, which never sends it, issued on the world
    group's communicator itself (past the engine's tracking, as a library calling the backend would),
    then the device synced: this thread stays there until an abort of this rank's communicators
    completes the receive (with nothing received). The step then goes on, and its next collective
    meets the stop."""
    import torch
    import torch.distributed as dist
    from mindspeed_ha import compat, device
    from mindspeed_ha.device import backends
    backend = backends.canonical(str(dist.get_backend()))
    if not backends.stream_ordered(backend):  # (a live injection: the environment's are refused at start)
        log.error("held drill not run: it needs a stream-ordered backend, and this rank's collectives run on %s, "
                  "whose abort frees no waiting thread", backend)
        return
    from mindspeed_ha.comm.interruptible import PROCESS_STOP
    if PROCESS_STOP.aborted():  # (a stop's abort came first: a device sync would return at once now)
        log.warning("held drill: this rank's communicators were aborted already: nothing holds it")
        return
    peer = (dist.get_rank() + 1) % dist.get_world_size()
    work = compat.default_group().recv([torch.empty(1, device=device.current())], peer, HELD_TAG)
    work.wait()  # (the emulated NCCL: the host waits here; NCCL: the stream does)
    device.synchronize()
