"""The HA runtime of one rank, in two parts named by who calls them.

``RankSession`` is what the trainers call (both the built-in trainer and the Megatron-LM adaptor):
attach the trainer and its optimizer, mark each step's start, end and phases, ``survive`` a step
(a fault in it is reported and the recovery served), note checkpoints, close. As torchft's Manager
gives a training loop start_quorum / report_error / should_commit, this is the loop's whole surface.

``RankState`` is what a recovery uses (recovery/handlers.Session): who the rank is, its trainer,
optimizer and replica topology, its processor, whether it joins or holds a poisoned shard, and the
hooks a recovery reports through (phase points, progress, a fault while serving, the resume).

The session owns the state and the processor; after a fault the training thread parks in
``RankSession.report_fault`` and serves the controller's recovery orders (rank/recovery/handlers.py) on
the state until the job trains on or ends. The rank's one session is installed by its constructor
and reached through ``current()`` (Megatron-LM's hooks and the patches, which megatron calls
without it).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import torch.distributed as dist

from mindspeed_ha.events import EventLog, get_logger, setup_text_log
from mindspeed_ha.options import HAOptions

if TYPE_CHECKING:
    from mindspeed_ha.comm.stop import Stop
    from mindspeed_ha.control.rank.processor import Processor
    from mindspeed_ha.inject import Injector
    from mindspeed_ha.replica.topology import ReplicaTopology
    from mindspeed_ha.trainer_state.interface import TrainerInterface

log = get_logger("session")
_current: "RankSession | None" = None


def current() -> "RankSession | None":
    """The rank's session (None before one is made, or once it closed): the one place the global is read."""
    return _current


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

    def relaid_out(self) -> None:
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
        self.processor.report_fault(kind, f"{type(exc).__name__}: {exc}", iteration, phase)

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
        if self.processor is not None:
            self.processor.health = "ok"
            self.processor.report_next_step()
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


def load_ahead() -> None:
    """Load what a rank's session loads lazily once it starts: its control plane (the processor and
    the controller a rank may come to host) and the recovery's handlers. A spare template calls it
    ahead of a fault, so that a forked joiner does not pay it (0.14 s on a 2-core host) between its
    start and its registration."""
    import mindspeed_ha.control.controller  # noqa: F401
    import mindspeed_ha.control.rank.processor  # noqa: F401
    import mindspeed_ha.rank.recovery.handlers  # noqa: F401


class RankSession:
    """What a trainer calls: the rank's HA hooks (see the module's docstring)."""

    def __init__(self, options: HAOptions, device, rank: int, world_size: int, local_rank: int = 0,
                 control_plane: bool = True):
        """``control_plane=False``: no processor (and no controller on rank 0) — for harnesses that
        play the controller's part themselves."""
        global _current
        self.control_plane = control_plane
        setup_text_log(options.log_dir, rank)
        events = EventLog.for_rank(options.log_dir, rank)
        from mindspeed_ha.inject import Injector
        injector = Injector.from_env(rank, options.log_dir, events)  # also takes live faults
        # what a recovery uses: handed to its handlers (start_processor)
        from mindspeed_ha.comm import interruptible
        self.state = RankState(options, device, rank, world_size, local_rank, events, injector,
                               interruptible.PROCESS_STOP)
        if injector is not None:
            interruptible.add_p2p_hook(self.state.pipeline_point)
        self._replica_pg = None
        self._tracking = False
        self._t_step = time.perf_counter()  # start of the step in flight
        self.serving = False                # serving a recovery's orders on the training thread
        _current = self

    # -- what the trainers read of the rank (its state's) -------------------------------------------
    @property
    def options(self) -> HAOptions:
        return self.state.options

    @property
    def device(self) -> Any:
        return self.state.device

    @property
    def events(self) -> EventLog:
        return self.state.events

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def world_size(self) -> int:
        return self.state.world_size

    @property
    def local_rank(self) -> int:
        return self.state.local_rank

    @property
    def injector(self) -> Injector:
        return self.state.injector

    @property
    def processor(self) -> Processor | None:
        return self.state.processor

    @property
    def trainer(self) -> TrainerInterface | None:
        return self.state.trainer

    @trainer.setter
    def trainer(self, trainer: TrainerInterface | None) -> None:
        self.state.trainer = trainer

    @property
    def optimizer(self) -> Any:
        return self.state.optimizer

    @property
    def joining(self) -> bool:
        return self.state.joining

    @property
    def after_setup(self) -> Callable[[TrainerInterface], object] | None:
        return self.state.after_setup

    @after_setup.setter
    def after_setup(self, finish: Callable[[TrainerInterface], object] | None) -> None:
        self.state.after_setup = finish

    @property
    def writes_loss(self) -> bool:
        return self.state.writes_loss

    @property
    def phase(self) -> str:
        return self.state.phase

    # -- optimizer -------------------------------------------------------------------------------
    def on_optimizer_built(self, optimizer):
        """Called (through the get_megatron_optimizer patch) for every optimizer megatron builds."""
        if not self.options.use_replica_optimizer:
            return optimizer
        from megatron.core import parallel_state as ps
        from mindspeed_ha.replica.optimizer import _inner_optimizers, make_replica
        from mindspeed_ha.replica.topology import from_parallel_state

        R = self.options.replica_num
        for inner in _inner_optimizers(optimizer):
            got = getattr(getattr(inner, "ddp_config", None), "num_distributed_optimizer_instances", None)
            if got != R:
                raise RuntimeError(
                    f"the replica optimizer needs megatron-core's partial distributed optimizer with "
                    f"num_distributed_optimizer_instances={R} (DDP config and initialize_model_parallel), "
                    f"got {got}; with Megatron-LM pass --use-distributed-optimizer")
        st = self.state
        st.topology = topology = from_parallel_state(R)
        if getattr(self.trainer_config(optimizer), "num_moe_experts", None):
            # megatron-core reduces expert and dense gradients across instances over ONE group, so an
            # expert shard's twins must be its dense twins; check that instead of assuming it.
            st.expert_topology = expert = from_parallel_state(R, expert=True)
            if expert.replica_group != topology.replica_group:
                raise RuntimeError(
                    f"rank {self.rank}: expert replica group {expert.replica_group} differs from "
                    f"the dense one {topology.replica_group}; this MoE layout is not supported by the "
                    "replica optimizer (try another --expert-model-parallel-size)")
        make_replica(optimizer, topology)
        optimizer.ha_add_listener(self._on_update)
        if self._tracking:  # an optimizer rebuilt in a running job (elastic resize)
            self._track_rng(optimizer)
        self.injector.set_uce_corruptor(optimizer.ha_corrupt)
        st.optimizer = optimizer
        self._replica_pg = ps.get_inter_distributed_optimizer_instance_group()
        pg_ranks = dist.get_process_group_ranks(self._replica_pg)
        if sorted(pg_ranks) != sorted(topology.replica_group):
            raise RuntimeError(f"rank {self.rank}: megatron-core's inter-instance group {pg_ranks} is not "
                               f"the replica group {topology.replica_group}")
        # The seeds' line (MindIO's wording), then the same as an event; in job ranks (an elastic
        # resize renumbers the default group, not the job).
        from mindspeed_ha.comm.groups import job_rank
        group = [job_rank(r) for r in topology.replica_group]
        if self.processor is not None:
            self.processor.groups = [group]
        log.info("rank:%d, report group list: %s", self.rank, group)
        self.events.emit("replica_groups", replica_group=group,
                         instance=topology.instance, shard_index=topology.shard_index,
                         dp_ranks=[job_rank(r) for r in topology.dp_ranks], replica_num=R,
                         expert_replica_group=st.expert_topology.replica_group if st.expert_topology else None,
                         expert_dp_ranks=list(st.expert_topology.dp_ranks) if st.expert_topology else None,
                         shard_tensors=len(optimizer.ha_shard_description()))
        return optimizer

    @staticmethod
    def trainer_config(optimizer):
        from mindspeed_ha.replica.optimizer import _inner_optimizers
        for inner in _inner_optimizers(optimizer):
            for chunk in getattr(inner, "model_chunks", None) or []:
                return getattr(chunk, "config", None)
        return None

    def relaid_out(self) -> None:
        self.state.relaid_out()

    def before_param_sync(self) -> None:
        """The parameter all-gather is about to start: this rank's shard update is complete."""
        opt = self.optimizer
        if opt is not None and opt.ha_updating:
            opt.ha_mark_update_end()
            self.fire("param-sync", opt.ha_iteration)

    def _on_update(self, event: str, iteration: int) -> None:
        if event == "update_start":
            self.fire("optimizer", iteration)  # inside the update window: the shard is mid-update
        if self.processor is not None:
            (self.processor.update_start if event == "update_start" else self.processor.update_end)(iteration)

    # -- trainer hooks ---------------------------------------------------------------------------
    def attach_trainer(self, trainer) -> None:
        self.state.trainer = trainer
        self.state.relaid_out()
        from mindspeed_ha.device.backends import NCCL_DEFAULTS, NCCL_ERROR_HANDLING, stream_ordered
        errors = ({"error_handling": os.environ.get(NCCL_ERROR_HANDLING),
                   "nccl_env": {name: os.environ.get(name) for name, _ in NCCL_DEFAULTS}}
                  if stream_ordered(self.device.backend) else {})
        self.events.emit("start", world_size=self.world_size, device=self.device.kind,
                         backend=self.device.backend, strategies=sorted(self.options.strategies),
                         replica=self.options.use_replica_optimizer, **errors)
        if self.options.enabled and self.control_plane and self.processor is None:
            self.start_processor()

    def trainer_ready(self) -> None:
        """After setup and ``--load``, before the first step: start what recovery needs from the live
        state (the RNG as of every update's end; the checkpoint writer warmed up when --save is set)."""
        if self.optimizer is None or self._tracking:
            return
        self._tracking = True
        assert self.trainer is not None  # (attach_trainer came first)
        self.trainer.rng.record(self.trainer.iteration)  # after setup/--load, before any forward: the current RNG
        self._track_rng(self.optimizer)
        if self.processor is not None and self.trainer.save_dir:
            from mindspeed_ha.trainer_state import checkpoint
            checkpoint.prewarm_writer(asynchronous=self.trainer.async_saves)

    def _track_rng(self, optimizer) -> None:
        assert self.trainer is not None  # (only once trainer_ready ran)
        history = self.trainer.rng
        optimizer.ha_add_listener(lambda event, it: history.record(it) if event == "update_end" else None)

    # -- control plane ---------------------------------------------------------------------------
    def start_processor(self) -> None:
        """Report to the controller (hosted by rank 0's processor unless one runs elsewhere)."""
        from mindspeed_ha.control.controller import Controller
        from mindspeed_ha.control.rank.processor import Processor
        groups = [self.state.topology.replica_group] if self.state.topology else []
        from mindspeed_ha.rank.recovery.handlers import RankRecovery
        # (any rank may host a controller: rank 0 the first, the others when they are named standbys)
        self.state.processor = processor = Processor(self.rank, self.world_size, self.local_rank,
                                   os.environ.get("MINDSPEED_HA_NODE", ""), self.options, groups,
                                   events=self.events, controller_factory=Controller, stop=self.state.stop)
        self.state.stop.add_held_hook(processor.report_held)
        processor.serve({"inject": self._live_inject}, training_thread=False)
        processor.serve(RankRecovery(self.state).handlers(), training_thread=True)
        processor.start()

    def _live_inject(self, args: dict) -> str:
        f = self.injector.add(args["kind"], self.rank, args.get("step"), args.get("phase"), args.get("factor"))
        return f"armed {f.spec()}"

    @staticmethod
    def restarted_worker() -> bool:
        """Started by the agent in place of a failed worker (``mindspeed-ha run`` counts restarts)."""
        return int(os.environ.get("MINDSPEED_HA_RESTART_COUNT", "0") or 0) > 0

    def join_running_job(self, trainer, until: tuple = ("resume",)) -> None:
        """A restarted worker under recover or elastic: register (no env:// rendezvous — that world
        is gone), then serve the controller's orders on this thread: ``rebuild`` (recover) or
        ``scale-out`` builds the groups and the trainer, ``repair`` brings the state from the peers
        (a scale-out moves it itself), ``rollback``/``resume`` as everywhere. ``until``: the orders
        after which to return (a loop that builds its own trainer returns once its groups exist,
        then calls this again to serve the rest)."""
        self.state.trainer, self.state.joining = trainer, True
        self.state.stopped_at = time.monotonic()
        if self.processor is None:
            self.start_processor()
            log.info("rank %d: restarted worker, waiting for the controller to bring it into the job", self.rank)
        assert self.processor is not None  # (start_processor made it)
        wait = max(120.0, 3 * self.options.hang_timeout_s)
        with self._serving():
            while True:
                action = self.processor.serve_order(timeout=wait)
                if action == "resume":
                    self.state.joining = False
                if action in until:
                    return
                if action is None:
                    raise RuntimeError(f"rank {self.rank}: restarted, but no order from the controller for "
                                       f"{wait:.0f} s")

    @contextlib.contextmanager
    def _serving(self):
        """This (training) thread serves a recovery's orders: a step it ends here is a roll-forward."""
        self.serving = True
        try:
            yield
        finally:
            self.serving = False
            self.state.stop.left_recovery()

    def report_fault(self, exc: BaseException, iteration: int) -> bool:
        """An exception left the step: classify and report it at once, then serve the controller's
        orders on this (training) thread — repairs and the dump run here — until one ends the
        process (``exit``, from the processor thread) or training resumes in place (returns True).
        Returns False if the controller goes silent."""
        self.state.pipeline_iteration = None  # (a recovery's own point-to-point moves are no pipeline drill points)
        if self.processor is None:
            return False
        self.state.stopped_at = time.monotonic()
        from mindspeed_ha.comm.stop import CollectiveStopped
        from mindspeed_ha.faults import fault_kind, process_fatal
        if process_fatal(exc):
            self.state.end_for_lost_device(exc, iteration)
        self.state.device_ready(iteration)
        if fault_kind(exc) == "memory-error":
            from mindspeed_ha import device
            if not device.memory_error_repairable():
                self.state.end_for_lost_device(exc, iteration)
        if isinstance(exc, CollectiveStopped):  # we stopped it ourselves: not a new fault
            log.info("rank %d left its collective in iteration %d (%s): stopped by the controller",
                     self.rank, iteration, self.phase)
        else:
            kind = fault_kind(exc)
            self.state.report(kind, exc, iteration, self.phase)
            log.error("rank %d: %s fault in iteration %d (%s): %s", self.rank, kind, iteration, self.phase, exc)
        wait = max(30.0, 3 * self.options.hang_timeout_s)
        assert self.processor.link is not None  # (start_processor started it)
        with self._serving():
            quiet = time.monotonic()
            while True:
                action = self.processor.serve_order(timeout=1.0)
                if action == "resume":
                    return True
                now = time.monotonic()
                # Each order restarts the clock, and so does a live controller in a recovery: one of its
                # rounds may wait out a hung rank or a restart, longer than this. A lost one's standby
                # has the same time to take over.
                if action is not None or self.processor.link.recovering:
                    quiet = now
                elif now - quiet > wait:
                    break
        log.error("rank %d: no order from the controller for %.0f s after the fault", self.rank, wait)
        return False

    def survive(self, attempt, iteration_of, after_recovery=None):
        """Run ``attempt()`` until it returns. An exception is a fault of this rank: it is reported
        and the controller's recovery served here (``report_fault``); once repaired in place,
        ``after_recovery()`` may give the result (a step the recovery finished), else ``attempt``
        runs again. ``iteration_of()``: the iteration in flight. What cannot be recovered in place
        (a replica mismatch, a controller gone silent) is raised."""
        import traceback
        from mindspeed_ha.comm.stop import CollectiveStopped
        from mindspeed_ha.replica.verify import ReplicaMismatchError
        while True:
            try:
                return attempt()
            except ReplicaMismatchError:
                raise
            except Exception as e:
                if not isinstance(e, CollectiveStopped):  # a stopped rank is not a fault of its own
                    traceback.print_exc()
                if not self.report_fault(e, iteration_of()):
                    raise
            out = after_recovery() if after_recovery is not None else None
            if out is not None:
                return out

    def fire(self, phase: str, iteration: int) -> None:
        """A phase point of the step in flight (forward, grad-sync, checkpoint...): progress for the
        controller, and where fault drills fire."""
        self.state.fire(phase, iteration)

    def backward_point(self, tensor: Any, iteration: int) -> None:
        """The "backward" phase point, fired as the backward pass reaches ``tensor``: the loss on the
        last pipeline stage, a stage's own output on every stage (the others have no loss: their
        backward starts from the gradient the next stage sends)."""
        def reached(grad: Any) -> Any:
            self.fire("backward", iteration)
            return grad
        if getattr(tensor, "requires_grad", False):
            tensor.register_hook(reached)

    def step_start(self, iteration: int) -> None:
        self._t_step = time.perf_counter()
        self.state.pipeline_iteration = iteration
        if self.processor is not None:
            from mindspeed_ha.comm.stop import CollectiveStopped
            if self.state.stop.park.take():  # a planned recovery: wait for it here, between two steps
                self.fire("recovery", iteration)
                raise CollectiveStopped(f"parked before iteration {iteration} by the controller")
            self.processor.await_controller()
            self.processor.step_start(iteration)

    def step_end(self, iteration: int, loss, **extra) -> None:
        seconds = time.perf_counter() - self._t_step
        self.state.last_step = (iteration, loss)  # (the DP-reduced loss: the same bits on every DP rank)
        if self.injector is not None:  # (the step has ended job-wide; this rank has not logged it)
            self.injector.fire_point("step-end", iteration)
        if loss is not None and self.writes_loss:
            fields = {"iteration": iteration, "loss": loss, "loss_hex": float.hex(loss), "step_s": seconds}
            gn = extra.get("grad_norm")
            if gn is not None:
                fields["grad_norm"] = float(gn)
            if extra.get("lr") is not None:
                fields["lr"] = float(extra["lr"])
            if extra.get("samples_hash"):
                fields["samples_hash"] = extra["samples_hash"]
            self.events.emit("step", **fields)
        if self.processor is not None:
            self.processor.step_end(iteration, loss)
        trainer = self.trainer
        recovered = self.state.take_recovered() if trainer is not None and not self.serving else None
        if trainer is not None and recovered is not None:
            stopped_at, lost = recovered
            if stopped_at:
                trainer.log_recovery(iteration, time.monotonic() - stopped_at, lost)
        n = self.options.verify_replicas_interval
        # Not when a recovery rolls a step forward: the check is a world collective, and ranks whose
        # own end of that step was interrupted do not run it again. The next one compares the twins.
        if n and self.optimizer is not None and iteration % n == 0 and not self.serving:
            self.verify_replicas(iteration)

    def verify_replicas(self, iteration: int) -> dict:
        from mindspeed_ha.comm.groups import job_rank
        from mindspeed_ha.replica.verify import ReplicaMismatchError, check_replicas
        t0 = time.perf_counter()
        try:
            fields = check_replicas(self.optimizer, iteration, self._replica_pg, job_rank)
        except ReplicaMismatchError as e:
            self.events.emit("replica_check", iteration=iteration, ok=False, error=str(e))
            log.error("%s", e)
            raise
        fields["seconds"] = time.perf_counter() - t0
        self.events.emit("replica_check", **fields)
        if self.rank == 0:  # every rank checked; one line for the console
            log.info("replica check at iteration %d: every shard equals its twin, bit for bit (%d tensors "
                     "on rank 0, %.3f s)", iteration, fields["tensors"], fields["seconds"])
        return fields

    def saved(self, iteration: int, path: str, seconds: float) -> None:
        if self.processor is not None:
            self.processor.checkpoint = int(iteration)
        self.events.emit("checkpoint", kind="periodic", iteration=iteration, path=os.path.abspath(path), seconds=seconds)
        log.info("saved iteration %d to %s in %.2f s", iteration, path, seconds)

    def loaded(self, iteration: int, path: str, seconds: float) -> None:
        self.state.loaded(iteration, path, seconds)

    def _report_unfired_drills(self) -> None:
        """A drill (MINDSPEED_HA_INJECT, or `mindspeed-ha inject`) for this rank that never fired by its
        end: an error in the log and the events (``report`` lists it), never a silent pass."""
        for f in self.injector.unfired() if self.injector is not None else ():
            at = f"phase {f.phase}" + ("" if f.step is None else f" of iteration {f.step}")
            self.events.emit("drill_unfired", spec=f.spec(), kind=f.kind, step=f.step, phase=f.phase,
                             iteration=getattr(self.trainer, "iteration", None))
            log.error("fault drill %s never fired: rank %d ended without reaching %s (a phase this job does not "
                      "run there, e.g. a checkpoint at a step no save falls on, or a recovery that never came)",
                      f.spec(), self.rank, at)

    def close(self) -> None:
        global _current
        if self.processor is not None:
            self.processor.close()
            from mindspeed_ha.trainer_state import checkpoint
            checkpoint.release_writer()
        deadline = time.monotonic() + 5.0
        self.state.finish_settling(deadline)
        self._report_unfired_drills()
        # One wait for the settle reports and the end's: a release still going after it waits for a
        # lost peer (it may never end), and the other ranks wait in the job's last barrier meanwhile.
        self.events.emit("end", iteration=getattr(self.trainer, "iteration", None),
                         **self.state.resources(wait_s=max(0.0, deadline - time.monotonic())))
        self.events.close()
        if _current is self:
            _current = None
