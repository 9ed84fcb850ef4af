"""The rank's session: what the trainers call (both the built-in trainer and the Megatron-LM adaptor),
and nothing else — attach the trainer and its optimizer, mark each step's start, end and phases,
``survive`` a step (a fault in it goes through the rank's fault loop), note checkpoints, close. As
torchft's Manager gives a training loop start_quorum / report_error / should_commit, this is the
loop's whole surface.

The session makes the rank's state (``rank.state``: what a recovery uses), its fault loop
(``rank.fault_loop``), the wiring of its replica optimizer (``rank.replicas``) and its processor,
which serves the recovery's orders (``rank.recovery.handlers``) on the state. The rank's one session
is installed by its constructor and reached through ``current()`` (Megatron-LM's hooks and the
patches, which megatron calls without it).
"""
from __future__ import annotations

import datetime
import os
import time
from typing import TYPE_CHECKING, Any, Callable

from mindspeed_ha.events import EventLog, get_logger, setup_text_log
from mindspeed_ha.options import HAOptions
from mindspeed_ha.rank.fault_loop import FaultLoop
from mindspeed_ha.rank.replicas import ReplicaWiring
from mindspeed_ha.rank.state import RankState

if TYPE_CHECKING:
    from mindspeed_ha.trainer_state.interface import TrainerInterface

log = get_logger("session")
_current: "RankSession | None" = None


def current() -> "RankSession | None":
    """The rank's session (None before one is made, or once it closed): the one place the global is read."""
    return _current


def load_ahead() -> None:
    """Load what a rank loads lazily once it starts or joins: its control plane (the processor and
    the controller a rank may come to host), the recovery's handlers, and what torch's first
    optimizer imports (``torch._dynamo``: 1.3 s of a core on a 2-core host, most of a joiner's
    set-up). A spare template calls it ahead of a fault, so that a forked joiner does not pay it (the
    imports cost 0.14 s between its start and its registration); a joiner started afresh (a returned
    node's, a restart without a spare) calls it before it registers, not in the recovery or the
    scale-out that then waits for its set-up.

    Then what the process has made so far (mostly its imports: they live as long as it does) is
    left out of Python's collector for good, as a spare template does before it forks: a full
    collection otherwise walks all of it — 0.27 s in a fresh newcomer, which came inside a
    scale-out's state move with every rank waiting for it."""
    import gc

    import torch

    import mindspeed_ha.control.controller  # noqa: F401
    import mindspeed_ha.rank.processor.processor  # noqa: F401
    import mindspeed_ha.rank.recovery.engine  # noqa: F401  (repair, elastic, dump: what the orders call)
    import mindspeed_ha.rank.recovery.handlers  # noqa: F401
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1, device="cpu"))])
    gc.collect()
    gc.freeze()


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
        self.faults = FaultLoop(self.state)
        self.replicas = ReplicaWiring(self.state)
        self._t_step = time.perf_counter()  # start of the step in flight
        _current = self

    # -- what the trainers read of the rank (its state's) -------------------------------------------
    options = property(lambda self: self.state.options)
    device = property(lambda self: self.state.device)
    events = property(lambda self: self.state.events)
    rank = property(lambda self: self.state.rank)
    local_rank = property(lambda self: self.state.local_rank)
    optimizer = property(lambda self: self.state.optimizer)
    joining = property(lambda self: self.state.joining)

    @property
    def trainer(self) -> TrainerInterface | None:
        return self.state.trainer

    @trainer.setter
    def trainer(self, trainer: TrainerInterface | None) -> None:
        self.state.trainer = trainer

    @property
    def after_setup(self) -> Callable[[TrainerInterface], object] | None:
        return self.state.after_setup

    @after_setup.setter
    def after_setup(self, finish: Callable[[TrainerInterface], object] | None) -> None:
        self.state.after_setup = finish

    # -- the optimizer ---------------------------------------------------------------------------
    def on_optimizer_built(self, optimizer):
        """Called (through the get_megatron_optimizer patch) for every optimizer megatron builds."""
        return self.replicas.on_optimizer_built(optimizer)

    def resized(self) -> None:
        self.state.resized()

    def before_param_sync(self) -> None:
        """The parameter all-gather is about to start: this rank's shard update is complete."""
        opt = self.state.optimizer
        if opt is not None and opt.ha_updating:
            opt.ha_mark_update_end()
            self.fire("param-sync", opt.ha_iteration)

    # -- the trainer -----------------------------------------------------------------------------
    def attach_trainer(self, trainer) -> None:
        st = self.state
        st.trainer = trainer
        st.resized()
        from mindspeed_ha.device.backends import NCCL_DEFAULTS, NCCL_ERROR_HANDLING, NONBLOCKING, stream_ordered
        errors = ({"error_handling": os.environ.get(NCCL_ERROR_HANDLING),
                   "nccl_env": {name: os.environ.get(name) for name in (*dict(NCCL_DEFAULTS), NONBLOCKING)}}
                  if stream_ordered(st.device.backend) else {})
        st.events.emit("start", world_size=st.world_size, device=st.device.kind,
                       backend=st.device.backend, strategies=sorted(st.options.strategies),
                       replica=st.options.use_replica_optimizer, **errors)
        # (a newcomer built ahead registers afterwards, in join_running_job: the pause it is asked
        # for comes once it has registered)
        if st.options.enabled and self.control_plane and st.processor is None and not st.joining:
            self.start_processor()

    def trainer_ready(self) -> None:
        """After setup and ``--load``, before the first step: start what recovery needs from the live
        state (the RNG as of every update's end; the checkpoint writer warmed up when --save is set)."""
        st = self.state
        if st.optimizer is None or self.replicas.tracking:
            return
        self.replicas.track()
        self._prewarm_writer()

    def _prewarm_writer(self) -> None:
        st = self.state
        assert st.trainer is not None  # (attach_trainer came first)
        if st.processor is not None and st.trainer.save_dir:
            from mindspeed_ha.trainer_state import checkpoint
            checkpoint.prewarm_writer(asynchronous=st.trainer.async_saves)

    # -- the control plane -------------------------------------------------------------------------
    def start_processor(self) -> None:
        """Report to the controller (hosted by rank 0's processor unless one runs elsewhere)."""
        from mindspeed_ha.control.controller import Controller
        from mindspeed_ha.rank.processor.processor import Processor
        from mindspeed_ha.rank.recovery.handlers import RankRecovery
        st = self.state
        groups = [st.topology.replica_group] if st.topology else []
        # (any rank may host a controller: rank 0 the first, the others when they are named standbys)
        st.processor = processor = Processor(st.rank, st.world_size, st.local_rank,
                                             os.environ.get("MINDSPEED_HA_NODE", ""), st.options, groups,
                                             events=st.events, controller_factory=Controller, stop=st.stop)
        st.stop.add_held_hook(processor.report_held)
        # (at once: a migration asked for right after a live fault must find it armed when its rank parks)
        processor.serve({"inject": self._live_inject}, training_thread=False, at_once=True)
        processor.serve(RankRecovery(st).handlers(), training_thread=True)
        processor.start()

    def _live_inject(self, args: dict) -> str:
        f = self.state.injector.add(args["kind"], self.rank, args.get("step"), args.get("phase"), args.get("factor"))
        return f"armed {f.spec()}"

    # -- faults ----------------------------------------------------------------------------------
    def survive(self, attempt, iteration_of, after_recovery=None):
        """Run ``attempt()`` through the rank's fault loop (``FaultLoop.survive``)."""
        return self.faults.survive(attempt, iteration_of, after_recovery)

    @staticmethod
    def restarted_worker() -> bool:
        """Started by the agent in place of a failed worker (``mindspeed-ha run`` counts restarts)."""
        return int(os.environ.get("MINDSPEED_HA_RESTART_COUNT", "0") or 0) > 0

    @staticmethod
    def joins_to_scale_out() -> bool:
        """Started by its agent as a scale-out's newcomer (the controller said so in its order):
        no recovery waits for it, and the layout it comes into is the job's own."""
        from mindspeed_ha.options import JOINS_AS_ENV
        return os.environ.get(JOINS_AS_ENV) == "scale-out"

    def build_ahead(self, trainer) -> None:
        """A scale-out's newcomer, before it registers: its trainer set up alone (as a restarted
        worker's is at its rebuild) in the layout it expects to enter, the job's own at full size,
        over groups that connect only once the scale-out makes that layout (``groups.joining``). The
        job trains meanwhile; its pause, asked for once this rank has registered, then holds only
        the groups' connection and the state's move for it (``recovery.elastic.enter_layout``). A
        plan that gives it another place builds it again there."""
        from mindspeed_ha.comm import groups
        from mindspeed_ha.comm.interruptible import alone
        from mindspeed_ha.trainer_state.interface import BuiltAhead
        st = self.state
        st.joining = True  # (its trainer's attach leaves the registration to join_running_job)
        t0 = time.perf_counter()
        load_ahead()  # (the optimizer's first imports: 2 s of this build without it)
        with groups.joining(st.world_size, st.rank, st.device.backend,
                            datetime.timedelta(seconds=st.options.collective_timeout_s)), alone():
            trainer.setup(joining=True)
        made = groups.groups()[1:]  # (not the default group: the scale-out makes its own)
        trainer.built_ahead = BuiltAhead(st.world_size, tuple((g, g.group_rank) for g in made),
                                         bool(groups.made_after_seal()))
        seconds = round(time.perf_counter() - t0, 4)
        st.events.emit("built_ahead", seconds=seconds, world_size=st.world_size, groups=len(made),
                       made_on_use=trainer.built_ahead.made_on_use, setup=getattr(trainer, "setup_seconds", None) or {})
        log.info("rank %d: built ahead of the scale-out in %.3f s, for the job's layout of %d ranks", st.rank,
                 seconds, st.world_size)

    def join_running_job(self, trainer, until: tuple = ("resume",)) -> None:
        """A restarted worker under recover or elastic: register (no env:// rendezvous — that world
        is gone), then serve the controller's orders on this thread (``FaultLoop.join``) until one of
        ``until`` (a loop that builds its own trainer returns once its groups exist, then calls this
        again to serve the rest)."""
        st = self.state
        st.trainer, st.joining = trainer, True
        st.stopped_at = time.monotonic()
        if st.processor is None:
            load_ahead()  # (before it registers: a forked joiner has it all already; built ahead, its build too)
            self.start_processor()
            if st.optimizer is not None:  # (built ahead: its writer is warmed up now that it reports)
                self._prewarm_writer()
            log.info("rank %d: restarted worker, waiting for the controller to bring it into the job", st.rank)
        self.faults.join(until)

    # -- the step ----------------------------------------------------------------------------------
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
        st = self.state
        self._t_step = time.perf_counter()
        st.pipeline_iteration = iteration
        if st.processor is not None:
            from mindspeed_ha.comm.stop import CollectiveStopped
            if st.stop.park.take():  # a planned recovery: wait for it here, between two steps
                self.fire("recovery", iteration)
                raise CollectiveStopped(f"parked before iteration {iteration} by the controller")
            st.processor.await_controller()
            st.processor.step_start(iteration)

    def step_end(self, iteration: int, loss, **extra) -> None:
        st = self.state
        seconds = time.perf_counter() - self._t_step
        st.last_step = (iteration, loss)  # (the DP-reduced loss: the same bits on every DP rank)
        if st.injector is not None:  # (the step has ended job-wide; this rank has not logged it)
            st.injector.fire_point("step-end", iteration)
        if loss is not None and st.writes_loss:
            fields = {"iteration": iteration, "loss": loss, "loss_hex": float.hex(loss), "step_s": seconds}
            gn = extra.get("grad_norm")
            if gn is not None:
                fields["grad_norm"] = float(gn)
            if extra.get("lr") is not None:
                fields["lr"] = float(extra["lr"])
            if extra.get("samples_hash"):
                fields["samples_hash"] = extra["samples_hash"]
            st.events.emit("step", **fields)
        if st.processor is not None:
            st.processor.step_end(iteration, loss)
        trainer, serving = st.trainer, self.faults.serving
        recovered = st.take_recovered() if trainer is not None and not serving else None
        if trainer is not None and recovered is not None:
            stopped_at, lost = recovered
            if stopped_at:
                trainer.log_recovery(iteration, time.monotonic() - stopped_at, lost)
        n = st.options.verify_replicas_interval
        # Not when a recovery rolls a step forward: the check is a world collective, and ranks whose
        # own end of that step was interrupted do not run it again. The next one compares the twins.
        if n and st.optimizer is not None and iteration % n == 0 and not serving:
            self.replicas.verify(iteration)

    # -- checkpoints and the end ----------------------------------------------------------------------
    def saved(self, iteration: int, path: str, seconds: float) -> None:
        st = self.state
        if st.processor is not None:
            st.processor.saved(iteration)
        st.events.emit("checkpoint", kind="periodic", iteration=iteration, path=os.path.abspath(path), seconds=seconds)
        log.info("saved iteration %d to %s in %.2f s", iteration, path, seconds)

    def loaded(self, iteration: int, path: str, seconds: float) -> None:
        self.state.loaded(iteration, path, seconds)

    def _report_unfired_drills(self) -> None:
        """A drill (MINDSPEED_HA_INJECT, or `mindspeed-ha inject`) for this rank that never fired by its
        end: an error in the log and the events (``report`` lists it), never a silent pass."""
        st = self.state
        for f in st.injector.unfired() if st.injector is not None else ():
            at = f"phase {f.phase}" + ("" if f.step is None else f" of iteration {f.step}")
            st.events.emit("drill_unfired", spec=f.spec(), kind=f.kind, step=f.step, phase=f.phase,
                           iteration=getattr(st.trainer, "iteration", None))
            log.error("fault drill %s never fired: rank %d ended without reaching %s (a phase this job does not "
                      "run there, e.g. a checkpoint at a step no save falls on, or a recovery that never came)",
                      f.spec(), st.rank, at)

    def close(self) -> None:
        global _current
        st = self.state
        if st.processor is not None:
            st.processor.close()
            from mindspeed_ha.trainer_state import checkpoint
            checkpoint.release_writer()
        deadline = time.monotonic() + 5.0
        st.finish_settling(deadline)
        self._report_unfired_drills()
        # One wait for the settle reports and the end's: a release still going after it waits for a
        # lost peer (it may never end), and the other ranks wait in the job's last barrier meanwhile.
        st.events.emit("end", iteration=getattr(st.trainer, "iteration", None),
                       **st.resources(wait_s=max(0.0, deadline - time.monotonic())))
        st.events.close()
        if _current is self:
            _current = None
