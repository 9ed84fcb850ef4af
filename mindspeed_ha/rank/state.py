"""The rank's HA state, and what a recovery uses of it (``rank.recovery.handlers.Session``): who the
rank is, its trainer, optimizer and replica topology, its processor and its stop, whether it joins or
holds a poisoned shard, and the hooks a recovery reports through (phase points, progress, a fault
while serving, the resume). The session makes it; the fault loop and the recovery's orders work on it.
"""
from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from mindspeed_ha.events import EventLog, get_logger
from mindspeed_ha.options import HAOptions

if TYPE_CHECKING:
    from mindspeed_ha.comm.stop import Stop
    from mindspeed_ha.inject import Injector
    from mindspeed_ha.rank.processor.processor import Processor
    from mindspeed_ha.replica.topology import ReplicaTopology
    from mindspeed_ha.trainer_state.interface import TrainerInterface

log = get_logger("session")


# A survivor's counts go to every other rank (the controller does not know which of them share a
# group with it): world - 1 orders for each of world - 1 survivors, about 4,000 for 64 ranks, some 0.1 s
# of the controller's thread here, which is what they save. Above it the wait ends with the grace.
LEFT_COUNTS_MAX_WORLD = 64


class RankState:
    """The rank's HA state, and what a recovery uses of it (recovery/handlers.Session)."""

    def __init__(self, options: HAOptions, device, rank: int, world_size: int, local_rank: int,
                 events: EventLog, injector: Injector, stop: Stop):
        self.options, self.device = options, device
        self.stop = stop  # the rank's stop (the process's: the installed collectives obey it)
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.events, self.injector = events, injector
        # (a Megatron-LM joiner's is a stand-in with setup() only until its loop builds the model)
        self.trainer: TrainerInterface | None = None
        self.optimizer: Any = None  # the megatron optimizer, made a replica one (make_replica)
        self.topology: ReplicaTopology | None = None
        self.expert_topology: ReplicaTopology | None = None
        self.processor: Processor | None = None
        # The step whose forward and backward run now (None elsewhere): its pipeline sends and
        # receives are the pipeline-send / pipeline-recv drill points.
        self.pipeline_iteration: int | None = None
        self._writes_loss = False
        # the iteration and loss of the last step that ended here
        self.last_step: tuple[int | None, float | None] = (None, None)
        self.phase = "startup"
        self.joining = False  # a restarted worker until it has resumed (recover, elastic scale-out)
        # A memory error corrupted this rank's optimizer shard: its status says so, and the plans
        # take the shard from its twin (what the rank holds now decides, not the faults reported).
        self.shard_poisoned = False
        # a newcomer's scale-out, to finish once its loop has built the model
        self.after_setup: Callable[[TrainerInterface], object] | None = None
        self.stopped_at = 0.0                # when this rank last left training for a recovery
        self._recovered: tuple | None = None  # (stopped at, lost steps) until the first step after it
        # A restarted worker's timeline (wall clock): the agent's assignment, this session, the rebuild
        # order (``joined`` reports it)
        self.join_marks: list[tuple[str, float]] = [("session", time.time())]
        assigned = os.environ.get("MINDSPEED_HA_ASSIGNED_AT")
        if assigned:
            self.join_marks.insert(0, ("assigned", float(assigned)))
        self._releases_seen: set = set()     # communicator-release threads a resources report waited for
        self._settlers: list = []            # the threads that make those reports
        self._unsettled: set = set()         # those still waiting when the job ended (reported then)
        self._reports = threading.Lock()

    @property
    def writes_loss(self) -> bool:
        return self._writes_loss

    def resized(self) -> None:
        """The layout is set (or changed: an elastic resize can make another rank data-parallel rank 0):
        the first data-parallel rank of the last stage and TP rank 0 writes the step losses."""
        from megatron.core import parallel_state as ps
        self._writes_loss = (ps.is_pipeline_last_stage(ignore_virtual=True)
                             and ps.get_tensor_model_parallel_rank() == 0
                             and ps.get_data_parallel_rank(with_context_parallel=True) == 0)

    def fire(self, phase: str, iteration: int) -> None:
        self.phase = phase
        if phase not in ("forward", "backward"):
            self.pipeline_iteration = None  # (past the pipeline's sends and receives)
        if self.processor is not None:
            self.processor.mark_phase(phase)
        if self.injector is not None:
            self.injector.fire_point(phase, iteration)

    def pipeline_point(self, kinds: tuple[str, ...]) -> None:
        it = self.pipeline_iteration
        if it is not None and self.injector is not None:
            for kind in kinds:
                self.injector.fire_point(f"pipeline-{kind}", it)

    def progressed(self) -> None:
        """Long work outside a step (the dump) moved on: the controller sees this rank is not stuck."""
        if self.processor is not None:
            self.processor.progressed()

    def loaded(self, iteration: int, path: str, seconds: float) -> None:
        self.events.emit("load", iteration=iteration, path=os.path.abspath(path), seconds=seconds)
        log.info("loaded iteration %d from %s in %.2f s", iteration, path, seconds)

    def device_ready(self, iteration: int) -> None:
        """At a recovery's entry, and before its rebuild, dump or resize touch the device: a stopped
        device (HCCL) is restarted, and the device synchronized, where an error a kernel left behind
        shows itself. Raising there, the context is lost whatever the message says (a sticky CUDA
        error): the process ends to be replaced."""
        from mindspeed_ha import device
        try:
            device.restart_after_stop()
        except Exception as e:
            self.end_for_lost_device(e, iteration)

    def end_for_lost_device(self, exc: BaseException, iteration: int) -> NoReturn:
        """A poisoned device context (a CUDA sticky error, e.g. uncorrectable ECC): nothing here can be
        repaired in place or even freed. End the process; its agent reports the exit and recover
        restarts it from its twin (without recover: the survivors' dump)."""
        from mindspeed_ha.faults import PROCESS_FATAL_EXIT
        from mindspeed_ha.process import exit_now
        log.error("rank %d: process-fatal device error in iteration %d (%s): %s; exiting with %d so "
                  "that the process is replaced", self.rank, iteration, self.phase, exc, PROCESS_FATAL_EXIT)
        self.events.emit("process_fatal", iteration=int(iteration), phase=self.phase, detail=str(exc)[:500])
        exit_now(PROCESS_FATAL_EXIT)

    def report_fault_in_recovery(self, exc: BaseException) -> None:
        """A fault found while serving a recovery (its orders run on the training thread): reported
        like one in a step, so that the recovery starts over with every fault known."""
        from mindspeed_ha.faults import fault_kind
        kind = fault_kind(exc)
        log.error("rank %d: %s fault while serving a recovery: %s", self.rank, kind, exc)
        assert self.trainer is not None  # (a recovery is served with a trainer)
        self.report(kind, exc, self.trainer.iteration + 1, "recovery")

    def report(self, kind: str, exc: BaseException, iteration: int, phase: str) -> None:
        """A fault of this rank, to the controller (a memory error also marks its shard poisoned)."""
        if kind == "memory-error":  # (until a twin's copy or a checkpoint overwrites it)
            self.shard_poisoned = True
        assert self.processor is not None  # (faults are reported only with a control plane)
        # With the collectives it issued: a survivor waiting in one it never entered leaves it at once.
        import torch.distributed as dist
        counts = self.stop.issued.freeze()
        entered = {"member": dist.get_rank(), "counts": counts} if counts is not None else None
        from mindspeed_ha.faults import fault_class, user_frame
        self.processor.report_fault(kind, f"{type(exc).__name__}: {exc}", iteration, phase, entered=entered,
                                    fault_class=fault_class(exc, first_step=self.first_step()), frame=user_frame(exc))

    def first_step(self) -> bool:
        """This process has ended no step, and it is one of the job's first processes (not a worker
        restarted into a running job, nor a scale-out's newcomer): the job's first step is in flight."""
        from mindspeed_ha.options import JOINS_AS_ENV
        return (self.last_step[0] is None and int(os.environ.get("MINDSPEED_HA_RESTART_COUNT", "0") or 0) == 0
                and not os.environ.get(JOINS_AS_ENV))

    def report_left(self) -> None:
        """This rank's training thread left the step's collectives for a stop: the collectives it issued,
        to the peers still waiting in one (through the controller). A peer waiting in one this rank never
        entered leaves it at once, as for a faulted rank's. Only counts aligned with the job's as the
        stop came (``Entered.aligned``), and final: nothing more is issued before the resume. Not in a
        job of more than ``LEFT_COUNTS_MAX_WORLD`` ranks: there the waits end with the grace, as before."""
        if self.processor is None or not self.stop.entered.aligned or self.world_size > LEFT_COUNTS_MAX_WORLD:
            return
        import torch.distributed as dist
        self.processor.report_left({"member": dist.get_rank(), "counts": self.stop.issued.now()})

    def report_unlogged_step(self, iteration: int, loss) -> None:
        """A restarted worker that writes the losses: its predecessor may have died after step
        ``iteration`` completed job-wide but before reporting it (its update or the parameter
        all-gather); the twin's loss of that step (reduced over DP: the same bits) goes out then."""
        from mindspeed_ha.events import read_events
        if loss is None or not self._writes_loss:
            return
        if not any(e["event"] == "step" and e.get("iteration") == iteration for e in read_events(self.events.path)):
            self.events.emit("step", iteration=iteration, loss=loss, loss_hex=float.hex(loss), late=True)

    def joined(self, setup_s: float, setup: dict, reconnect: dict) -> None:
        """A restarted worker has set itself up and connected its groups (its rebuild): where the time
        went since the agent gave it its rank — to its session (the script's start after a spare's
        wake-up), to the rebuild order (the processor, the registration, the controller's rounds
        before it), the set-up by part, the groups' connection — in the ``joined`` event."""
        now = time.time()
        marks = dict(self.join_marks)
        assigned = marks.get("assigned")
        fields = {"setup_s": round(setup_s, 4), "setup": setup, "reconnect_s": reconnect.get("seconds"),
                  "groups": reconnect.get("groups")}
        if assigned is not None:
            fields["to_session_s"] = round(marks["session"] - assigned, 4)
            fields["total_s"] = round(now - assigned, 4)
        if "rebuild" in marks:
            fields["to_rebuild_s"] = round(marks["rebuild"] - marks["session"], 4)
        self.events.emit("joined", **fields)
        log.info("rank %d joined: %s", self.rank, fields)

    def log_step_at_dump(self, iteration: int, loss: float) -> None:
        """The dump settled on step ``iteration``, which this rank computed the loss of (reduced over
        data parallelism, whole) and which no rank logged: it goes out now, marked as written at
        the dump, so that the loss curve has no hole before the checkpoint it resumes from."""
        self.events.emit("step", iteration=int(iteration), loss=loss, loss_hex=float.hex(loss), late=True,
                         written_at="dump")
        log.info("iteration %d: lm loss %.6E (its step ended in the dump: logged there)", iteration, loss)

    def resumed(self, lost_steps: int = 0) -> None:
        """Training goes on after an in-place recovery: heartbeat as soon as the next step ends (the
        controller's MTTR ends there), and say then what the process holds."""
        self.phase = "step"
        self._recovered = (self.stopped_at, lost_steps)
        self.stop.issued.restart()  # (every rank, before the step it resumes: the counts align again)
        # What megatron-core caches of a collective's answer, a restarted or rebuilt optimizer has not
        # asked yet: every rank forgets it here, so the first step after a recovery asks it everywhere.
        optimizer = self.trainer.optimizer if self.trainer is not None else self.optimizer
        if optimizer is not None:
            from mindspeed_ha import compat
            compat.forget_collective_answers(optimizer)
        if self.processor is not None:
            self.processor.resumed()
        from mindspeed_ha.comm import groups
        # This recovery's releases only: one an earlier recovery left for good must not hold up the report.
        mine = [t for t in groups.releasing() if t not in self._releases_seen]
        self._releases_seen.update(mine)
        t = threading.Thread(target=self._settled, args=(mine,), name="mindspeed-ha-settled", daemon=True)
        self._settlers.append(t)
        t.start()

    def take_recovered(self) -> tuple | None:
        """(stopped at, lost steps) of the recovery the step that just ended was the first after; once."""
        recovered, self._recovered = self._recovered, None
        return recovered

    def _settled(self, releasing: list) -> None:
        """Once the communicators this recovery replaced are released: what the process holds."""
        held = self.resources(extra_threads=1, releasing=releasing)
        with self._reports:
            if threading.current_thread() not in self._unsettled:
                self.events.emit("resources", after="recovery", settled=True, **held)

    def resources(self, extra_threads: int = 0, releasing: list | None = None, wait_s: float = 30.0) -> dict:
        """Open file descriptors and OS threads of this process, once replaced communicators
        (``releasing``: those threads' only) are released — waiting up to ``wait_s``: a recovery must
        leave them as it found them. (``extra_threads``: the caller's own.)"""
        from mindspeed_ha.comm import groups
        groups.released(timeout=wait_s, threads=releasing)
        out = {}
        for key, path in (("fds", "/proc/self/fd"), ("threads", "/proc/self/task")):
            try:
                out[key] = len(os.listdir(path))
            except OSError:
                pass
        if "threads" in out:
            out["threads"] -= extra_threads
        return out

    def finish_settling(self, deadline: float) -> None:
        """The job ends: the last recovery's report is made, waited for until ``deadline``, else now
        (a release still going can wait for good, see comm.groups.released)."""
        for t in self._settlers:  # (the last recovery's report, if the job ended right after it)
            t.join(max(0.0, deadline - time.monotonic()))
        with self._reports:
            self._unsettled.update(t for t in self._settlers if t.is_alive())
        for _ in self._unsettled:
            # The report is made now, as what the process holds with the release unfinished.
            self.events.emit("resources", after="recovery", settled=False,
                             **self.resources(extra_threads=len(self._unsettled), wait_s=0.0))
