"""The one seam between the fault-tolerance engine and a training loop.

The built-in megatron-core trainer and the Megatron-LM adaptor both implement it; recovery code
drives training only through it and never reaches into either trainer.
"""
from __future__ import annotations

import abc
from typing import Iterator


class TrainerInterface(abc.ABC):
    model_chunks: list          # DDP-wrapped megatron modules, one per virtual pipeline stage
    optimizer: object           # megatron optimizer (a ReplicaOptimizer when replicas are on)
    scheduler: object           # OptimizerParamScheduler
    iteration: int              # completed iterations
    ended: int                  # the last iteration whose bookkeeping (loss report) also finished
    consumed_samples: int       # data position: samples consumed by the whole job
    save_dir: str | None        # --save (where a dying-gasp checkpoint goes)
    global_batch_size: int      # samples per iteration (scheduler and data position steps)
    group_holders: tuple = ()   # objects besides model and optimizer that keep process groups (a rebuild re-points them)

    @abc.abstractmethod
    def data_iterator(self, consumed_samples: int) -> Iterator:
        """The data iterator of this rank, positioned at ``consumed_samples``."""

    @abc.abstractmethod
    def train_step(self) -> float | None:
        """Run one iteration; return the DP-reduced loss on the rank that holds it, else None."""

    @abc.abstractmethod
    def save_checkpoint(self, save_dir: str) -> str:
        """Write a checkpoint of the current iteration; return its directory."""

    @abc.abstractmethod
    def checkpoint_args(self):
        """The ``args`` object a checkpoint of this trainer stores (its load checks it)."""

    @abc.abstractmethod
    def load_checkpoint(self, load_dir: str) -> int:
        """Restore model, optimizer, scheduler, RNG and data position; return the iteration."""

    # -- what a restarted worker takes from its replica peer besides the optimizer shard ----------
    # Each trainer extends these two with what its own loop keeps (a loss, flags in args, ...).
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
        self.scheduler.load_state_dict(state["scheduler"])  # a fresh scheduler: its count is the peer's

    def after_reload(self, job_ended: int) -> None:
        """After an in-job reload (no replicas) on every rank: ``job_ended`` is the newest iteration
        any rank had completed. A trainer whose loop cannot go back catches up to it."""
