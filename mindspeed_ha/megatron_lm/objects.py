"""The trainer interface's reads and writes of Megatron-LM's objects, global ``args`` and functions,
with no state of its loop: its batch sizes and save directory, its checkpoints, data loaders,
process groups and writers, a new layout's parts (``resize``), the bookkeeping a restarted rank
takes from its twin; and what its set-up used (``SETUP``). The loop's part: ``trainer``."""
from __future__ import annotations

import os

from mindspeed_ha.trainer_state.interface import TrainerInterface

from .resize import rewrap, unwrap_optimizer

# What Megatron-LM's set-up used and the trainer needs again (recorded by the hooks): how it made its
# process groups ("init_parallel"), its dataset provider ("train_valid_test") and its optimizer
# ("optimizer": the call, for a model in a new layout).
SETUP: dict = {}

# What Megatron-LM's load_checkpoint writes into args but the running loop owns (an in-loop reload
# keeps the loop's values; the loop has counted the steps the catch-up recomputes).
_LOOP_ARGS = ("load", "iteration", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples",
              "num_floating_point_operations_so_far")


class MegatronLMObjects(TrainerInterface):
    """Megatron-LM's model chunks, optimizer and scheduler, at ``iteration`` completed steps and
    ``consumed_samples``, behind the trainer interface."""

    def __init__(self, model, optimizer, scheduler, iteration: int):
        from megatron.training import get_args
        super().__init__()
        self.model_chunks, self.optimizer, self.scheduler = model, unwrap_optimizer(optimizer), scheduler
        self.iteration = iteration
        self.consumed_samples = get_args().consumed_train_samples

    def setup(self, joining: bool = False) -> None:
        raise RuntimeError("Megatron-LM sets itself up (initialize, setup_model_and_optimizer); the adaptor's "
                           "hooks build this trainer from what it made")

    @property
    def save_dir(self) -> str | None:
        from megatron.training import get_args
        return get_args().save

    @property
    def async_saves(self) -> bool:
        from megatron.training import get_args
        return bool(getattr(get_args(), "async_save", False))

    @property
    def global_batch_size(self) -> int:
        from megatron.training import get_args
        return get_args().global_batch_size

    @property
    def micro_batch_size(self) -> int:
        from megatron.training import get_args
        return get_args().micro_batch_size

    def init_parallel(self) -> None:
        """megatron-core's groups as Megatron-LM made them (again after an in-place rebuild)."""
        SETUP["init_parallel"]()

    def _rewrap(self, ddp):
        return rewrap(ddp)

    def _build_optimizer(self):
        """Megatron-LM's optimizer for the model chunks, made as its set-up made it (resize)."""
        from mindspeed_ha.comm.interruptible import alone
        with alone():
            return SETUP["optimizer"](self.model_chunks)

    def data_iterator(self, consumed_samples: int):
        """Megatron-LM's training data iterator, built at ``consumed_samples``."""
        from megatron.training import get_args
        from megatron.training.training import build_train_valid_test_data_iterators
        a = get_args()
        keep = ("consumed_train_samples", "iteration", "do_train", "do_valid", "do_test")
        saved = {k: getattr(a, k, None) for k in keep}
        a.consumed_train_samples, a.iteration = consumed_samples, consumed_samples // a.global_batch_size
        try:
            return build_train_valid_test_data_iterators(SETUP["train_valid_test"])[0]
        finally:
            for k, v in saved.items():
                setattr(a, k, v)

    def checkpoint_args(self):
        """Megatron-LM's own arguments, as its save_checkpoint stores them (the dump writes them into
        a checkpoint that Megatron-LM's load_checkpoint then checks and reads)."""
        import copy
        from megatron.training import get_args
        from mindspeed_ha import compat
        ns = copy.copy(get_args())
        ns.consumed_train_samples = self.consumed_samples
        # Megatron-LM core_v0.12.1 reads the optimizer's layout from this flag of the saved args
        # (its later releases from the checkpoint's metadata): the dump's is the model-space one there.
        ns.ckpt_fully_parallel_save = ns.ckpt_fully_parallel_save or compat.optimizer_sharding() == \
            "fully_sharded_model_space"
        return ns

    def save_checkpoint(self, save_dir: str) -> str:
        import megatron.training.training as training
        from megatron.training import get_args
        a = get_args()
        saved = a.save, a.consumed_train_samples
        a.save, a.consumed_train_samples = save_dir, self.consumed_samples  # saved with the args
        try:
            training.save_checkpoint(self.iteration, self.model_chunks, self.optimizer, self.scheduler,
                                     getattr(a, "num_floating_point_operations_so_far", 0))
        finally:
            a.save, a.consumed_train_samples = saved
        return os.path.join(save_dir, f"iter_{self.iteration:07d}")

    def _load(self, load_dir: str) -> int:
        """Megatron-LM's load_checkpoint from ``load_dir`` into the objects, ``iteration`` and
        ``consumed_samples``; the FLOPs so far. The args the running loop owns keep their values."""
        import megatron.training.training as training
        from megatron.training import get_args
        a = get_args()
        loop_args = {k: getattr(a, k, None) for k in _LOOP_ARGS}
        a.load = load_dir
        # (what a new process has: core_v0.12.1's load_checkpoint asserts these counters are 0)
        a.consumed_train_samples = a.skipped_train_samples = a.consumed_valid_samples = 0
        # OptimizerParamScheduler.load_state_dict *adds* the checkpoint's step count (it expects a
        # fresh scheduler): start it from zero, as a new process would.
        self.scheduler.num_steps = 0
        try:
            self.iteration, flops = training.load_checkpoint(self.model_chunks, self.optimizer, self.scheduler)
            self.consumed_samples = a.consumed_train_samples  # restored from the checkpoint's args
        finally:
            for k, v in loop_args.items():
                setattr(a, k, v)
        return flops

    def bookkeeping(self) -> dict:
        """What a restarted rank takes from its twin besides the optimizer shard."""
        from megatron.training import get_args
        a = get_args()
        return {**super().bookkeeping(), "flops": getattr(a, "num_floating_point_operations_so_far", 0),
                "do": [bool(getattr(a, k, False)) for k in ("do_train", "do_valid", "do_test")]}

    def install_bookkeeping(self, state: dict) -> None:
        """Into the trainer and into ``args``, where Megatron-LM's loop and data loaders read them."""
        from megatron.training import get_args
        super().install_bookkeeping(state)
        a = get_args()  # (iteration and data position: on_setup_model_and_optimizer)
        a.num_floating_point_operations_so_far = state["flops"]
        # Megatron-LM broadcasts these from rank 0 when it builds the data loaders; alone, the
        # broadcast keeps the local value, and `args.do_train or flag` then keeps the twin's.
        a.do_train, a.do_valid, a.do_test = state["do"]

    def log_recovery(self, iteration: int, seconds: float, lost_steps: int) -> None:
        """Megatron-LM's TensorBoard and W&B writers (on the rank that has them) get the recovery."""
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
        tb, wandb = get_tensorboard_writer(), get_wandb_writer()
        scalars = {"ha/recovery_seconds": seconds, "ha/lost_steps": lost_steps}
        if tb is not None:
            for name, value in scalars.items():
                tb.add_scalar(name, value, iteration)
        if wandb is not None:
            wandb.log(scalars, iteration)

    def _lr(self):
        for group in self.optimizer.param_groups:
            if group["params"]:
                return group["lr"]
        return None
