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
    consumed_samples: int       # data position: samples consumed by the whole job
    save_dir: str | None        # --save (where a dying-gasp checkpoint goes)
    global_batch_size: int      # samples per iteration (scheduler and data position steps)

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
