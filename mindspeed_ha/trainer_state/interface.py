"""The one seam between the fault-tolerance engine and a training loop.

The built-in megatron-core trainer and the Megatron-LM adaptor both implement it; recovery code
drives training only through it (rank/recovery/handlers.py, rank/recovery/restore.py, rank/recovery/dump.py) and
never reaches into either trainer or into Megatron's objects. Both drive megatron-core's DDP and
distributed optimizer, so what only those need (cleaning a partial step, re-syncing the weights,
the counters a restarted rank takes from its twin) has its implementation here.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Iterable, Iterator, Sequence

from mindspeed_ha.trainer_state import rng


@dataclasses.dataclass(frozen=True)
class BuiltAhead:
    """What a scale-out's newcomer was set up for before it joined (``rank.session.build_ahead``): the
    job's own layout of ``world_size`` ranks in their order, over ``groups`` (each with the newcomer's
    rank in it), made by megatron-core's set-up; ``made_on_use``: its model or optimizer made more
    groups as they were built (a set-up made again would not make them again: the build is not kept)."""
    world_size: int
    groups: tuple
    made_on_use: bool


def load_scheduler(scheduler: Any, state: dict) -> None:
    """megatron-core's ``OptimizerParamScheduler.load_state_dict`` *adds* the saved step count (it
    expects a fresh scheduler): a live one's own count is dropped first."""
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)


class TrainerInterface(abc.ABC):
    model_chunks: list          # DDP-wrapped megatron modules, one per virtual pipeline stage
    optimizer: Any              # megatron optimizer (a ReplicaOptimizer when replicas are on)
    scheduler: Any              # OptimizerParamScheduler
    iteration: int              # completed iterations
    ended: int                  # the last iteration whose bookkeeping (loss report) also finished
    consumed_samples: int       # data position: samples consumed by the whole job

    # What each trainer reads from its own arguments:
    @property
    @abc.abstractmethod
    def save_dir(self) -> str | None:
        """--save (where a dying-gasp checkpoint goes)."""

    @property
    @abc.abstractmethod
    def global_batch_size(self) -> int:
        """Samples per iteration (scheduler and data position steps)."""

    @property
    @abc.abstractmethod
    def micro_batch_size(self) -> int:
        """Samples per micro-batch and data-parallel rank."""

    @property
    def async_saves(self) -> bool:
        """Periodic saves written by another process (Megatron-LM's --async-save)."""
        return False

    def __init__(self) -> None:
        self.model_chunks, self.optimizer, self.scheduler = [], None, None  # until setup()
        self.built_ahead: BuiltAhead | None = None  # (a scale-out's newcomer, until it enters a layout)
        self.iteration = self.ended = self.consumed_samples = 0
        self.rng = rng.History()    # the RNG as of recent iterations' ends (rollback, dump)

    # -- set-up --------------------------------------------------------------------------------
    @abc.abstractmethod
    def setup(self, joining: bool = False) -> None:
        """Groups, model, optimizer, scheduler, data (and ``--load``). ``joining``: a restarted worker
        entering a running job: no collective of its own (the survivors wait in the recovery) and no
        ``--load`` (its state comes from its twin)."""

    @abc.abstractmethod
    def init_parallel(self) -> None:
        """megatron-core's process groups for this layout."""

    # -- the step ------------------------------------------------------------------------------
    @abc.abstractmethod
    def data_iterator(self, consumed_samples: int) -> Iterator:
        """The data iterator of this rank, positioned at ``consumed_samples``."""

    @abc.abstractmethod
    def train_step(self) -> float | None:
        """Run one iteration; return the DP-reduced loss on the rank that holds it, else None."""

    # -- recovery ------------------------------------------------------------------------------
    @abc.abstractmethod
    def restart_from(self, iteration: int) -> None:
        """Rollback: the next step is ``iteration + 1`` again, with its data (the RNG was restored)."""

    @abc.abstractmethod
    def finish_step(self, iteration: int) -> float | None:
        """Roll forward: the update of step ``iteration`` completed on every shard; finish the rest
        of the step (scheduler, counters, loss report). A trainer may return the step's loss, as
        ``train_step`` does."""

    def peers_ended(self, iteration: int) -> None:
        """After a rollback or roll-forward to ``iteration``: some rank had ended that step before the
        recovery, and may have passed the trainer's own code between two steps alone (a stop reached
        it there). Nothing to do for a trainer whose code between steps has no collective."""

    def clean_partial_step(self) -> None:
        """Drop what an interrupted step left: gradients, DDP bucket state and pending handles (the
        interrupted operations belong to replaced communicators and are never waited on again)."""
        for m in self.model_chunks:
            for bg in list(getattr(m, "bucket_groups", [])) + list(getattr(m, "expert_parallel_bucket_groups", [])):
                bg.grad_reduce_handle = None
                bg.param_gather_handle = None
                bg.param_gather_dispatched = False
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

    def resync_weights(self) -> None:
        """Model weights := the (repaired) fp32 main params: copy the own shard into the model and
        all-gather the rest, as the end of an optimizer step does. Same bits on healthy ranks."""
        import torch
        from mindspeed_ha import compat
        from mindspeed_ha.replica.optimizer import inner_optimizers
        with torch.no_grad():
            for inner in inner_optimizers(self.optimizer):
                compat.copy_main_to_model_params(inner)
        for m in self.model_chunks:
            m.start_param_sync(force_sync=True)

    # -- elastic resize ----------------------------------------------------------------------------
    def resize(self, keep: Iterable[Any] = ()) -> None:
        """The default group is a new layout's now (elastic resize, ``comm.groups.new_epoch``):
        megatron-core's groups again, the same model in a new DDP, a new optimizer (its state is the
        caller's to move in), the scheduler pointed at it, the micro-batch count and the data position
        at the new data-parallel size (the global batch stays). The model list is changed in place (a
        loop holding it sees the new DDP); the old DDP is emptied and its buffers freed before the new
        optimizer allocates: its gradients first, its parameters once the new DDP holds their values,
        unless a tensor of ``keep`` (the old state the caller still moves) lives in them."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator
        ps.destroy_model_parallel()
        self.init_parallel()
        dp = ps.get_data_parallel_world_size()
        reconfigure_num_microbatches_calculator(dist.get_rank(), None, self.global_batch_size, self.micro_batch_size,
                                                dp, decrease_batch_size_if_needed=False)
        old = list(self.model_chunks)
        old_buffers = [b for m in old for b in list(getattr(m, "buffers", [])) + list(getattr(m, "expert_parallel_buffers", []))]
        drop_grad_buffers(old_buffers)
        self.model_chunks[:] = [self._rewrap(m) for m in old]
        for m in old:
            release_ddp(m)
        drop_param_buffers(old_buffers, keep)
        # Alone: its one exchange, the parameter-group keys, aligns models that are the same on
        # every rank of a stage here, and a newcomer built ahead builds no optimizer in the resize.
        from mindspeed_ha.comm.interruptible import alone
        with alone():
            self.optimizer = self._build_optimizer()
        self.scheduler.optimizer = self.optimizer
        self.scheduler.step(increment=0)  # the current lr and weight decay into the new param groups
        self._resized(dp)

    def enter_built_layout(self, order: Sequence[int]) -> bool:
        """A newcomer built ahead (``built_ahead``), the default group now the new layout of the job's
        ranks ``order`` (``comm.groups.new_epoch``): megatron-core's groups made again. Where the plan
        lays the job out as it was built for (its own ranks, in their order), each group comes back
        as the very object its model, DDP and optimizer hold (``new_epoch``: same members, same
        description), now connected, and its build stands: True. Otherwise it is dropped (False):
        the caller sets the trainer up again in the place the plan gives it."""
        from megatron.core import parallel_state as ps
        from mindspeed_ha.comm import groups
        built, self.built_ahead = self.built_ahead, None
        assert built is not None
        if list(order) != list(range(built.world_size)) or built.made_on_use:
            self.drop_build()
            return False
        ps.destroy_model_parallel()  # (its groups are unregistered already: nothing is destroyed)
        self.init_parallel()
        now = {id(g) for g in groups.groups()}
        moved = [g for g, r in built.groups if id(g) not in now or g.group_rank != r]
        if moved:  # (new_epoch keeps every group of a layout that did not change: never seen)
            raise RuntimeError(f"a newcomer built ahead for the job's layout found its groups changed in it: {moved}")
        return True

    def drop_build(self) -> None:
        """Forget a newcomer's set-up (built for a place the plan did not give it): its DDP buffers
        freed before another is built, megatron-core's groups and micro-batch count forgotten."""
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
        ps.destroy_model_parallel()
        destroy_num_microbatches_calculator()
        buffers = [b for m in self.model_chunks
                   for b in list(getattr(m, "buffers", [])) + list(getattr(m, "expert_parallel_buffers", []))]
        drop_grad_buffers(buffers)
        for m in self.model_chunks:
            release_ddp(m)
        drop_param_buffers(buffers, ())
        self.model_chunks, self.optimizer, self.scheduler = [], None, None

    def _rewrap(self, ddp):
        """The module of ``ddp`` in a new DDP of the current layout (no broadcast: the weights are
        the job's already)."""
        raise NotImplementedError(f"{type(self).__name__} cannot change its layout")

    def _build_optimizer(self):
        """A new optimizer over ``model_chunks``, as the trainer's set-up built its first."""
        raise NotImplementedError(f"{type(self).__name__} cannot change its layout")

    def _resized(self, dp: int) -> None:
        """What else follows the data-parallel size ``dp`` (arguments, the data iterator)."""

    # What a restarted worker takes from its twin besides the optimizer shard. Each trainer extends
    # these two with what its own loop keeps (a loss, flags in args, ...).
    def bookkeeping(self) -> dict:
        return {"iteration": self.iteration, "ended": self.ended,
                "consumed_samples": self.consumed_samples, "scheduler": self.scheduler.state_dict(),
                "param_groups": len(self.optimizer.param_groups)}

    def install_bookkeeping(self, state: dict) -> None:
        if state["param_groups"] != len(self.optimizer.param_groups):
            raise RuntimeError(f"restarted rank has {len(self.optimizer.param_groups)} optimizer param groups, "
                               f"its replica peer {state['param_groups']}: this layout cannot be rejoined")
        self.iteration, self.ended = state["iteration"], state["ended"]
        self.consumed_samples = state["consumed_samples"]
        load_scheduler(self.scheduler, state["scheduler"])  # (a live rank taken back to its twin's step too)

    def unlogged_loss(self) -> tuple[int, float] | None:
        """(iteration, loss) of the step this rank is inside, when it has its loss reduced over data
        parallelism, whole (a commit point passed after the reduction), and has not ended that step:
        what a dump that settles on that step prints, since no rank will (None: none such here)."""
        return None

    def log_recovery(self, iteration: int, seconds: float, lost_steps: int) -> None:
        """A recovery ended with step ``iteration``: ``seconds`` from this rank's stop to that step's
        end, ``lost_steps`` recomputed. A trainer with its own metric writers records them there."""

    def after_reload(self, job_ended: int) -> None:
        """After an in-job reload (no replicas) on every rank: ``job_ended`` is the newest iteration
        any rank had completed. A trainer whose loop cannot go back catches up to it."""

    # -- checkpoints ---------------------------------------------------------------------------
    @abc.abstractmethod
    def save_checkpoint(self, save_dir: str) -> str:
        """Write a checkpoint of the current iteration; return its directory."""

    @abc.abstractmethod
    def checkpoint_args(self):
        """The ``args`` object a checkpoint of this trainer stores (its load checks it)."""

    @abc.abstractmethod
    def load_checkpoint(self, load_dir: str) -> int:
        """Restore model, optimizer, scheduler, RNG and data position; return the iteration."""


def drop_grad_buffers(buffers: Iterable[Any]) -> None:
    """Free the gradients of DDP ``buffers`` about to be replaced by another layout's, before the new
    ones are allocated: a resize runs between two steps, where they hold nothing anyone reads again
    (a whole model slice of fp32 gradients, ~17 GB a rank at 70B: the two are never held at once).
    The storage itself goes (the views into it, ``main_grad``, go with the old DDP); gradients that
    share their storage with the parameters' are left."""
    for buf in buffers:
        grad, params = getattr(buf, "grad_data", None), getattr(buf, "param_data", None)
        shared = params is not None and grad is not None and \
            params.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
        if grad is not None and not shared:
            grad.untyped_storage().resize_(0)


def drop_param_buffers(buffers: Iterable[Any], keep: Iterable[Any]) -> None:
    """Free the parameter storage of replaced DDP ``buffers`` (the new DDP copied the values) unless a
    tensor of ``keep`` lives in it: fp32 main values are views of fp32 parameters, and a
    precision-aware optimizer's may be too."""
    kept = {t.untyped_storage().data_ptr() for t in keep}
    for buf in buffers:
        params = getattr(buf, "param_data", None)
        if params is not None and params.untyped_storage().data_ptr() not in kept:
            params.untyped_storage().resize_(0)


def release_ddp(ddp) -> None:
    """A DDP replaced by another around the same module. Its gradient hooks stay on the parameters'
    AccumulateGrad nodes (megatron-core keeps no handle to remove them): with no bucket group left
    they do nothing, and with its buffers dropped nothing large stays reachable through them."""
    ddp.param_to_bucket_group = {}
    ddp.buffers, ddp.bucket_groups, ddp.params_with_grad = [], [], []
    ddp.expert_parallel_buffers, ddp.expert_parallel_bucket_groups = [], []
