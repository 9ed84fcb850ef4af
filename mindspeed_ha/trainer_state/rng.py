"""Every random-number generator a Megatron step draws from, as one state: snapshot and restore.

Python's, NumPy's, torch's CPU and "CUDA" generators and megatron-core's RNG tracker (dropout streams
per model-parallel region). ``History`` keeps the state as of the end of recent iterations: a fault
lands mid-step, after the next step's forward has drawn its dropout masks, and both a rollback and a
checkpoint of the last completed iteration need the state as it was when that iteration's update
finished (nothing draws random numbers between that and the next forward).
"""
from __future__ import annotations

import random

import numpy as np
import torch

from mindspeed_ha.device import current_accelerator


def snapshot() -> dict:
    from megatron.core import tensor_parallel
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": current_accelerator().rng_state(),
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def restore(state) -> None:
    """``state``: a ``snapshot()`` (or the one-element list a checkpoint's ShardedObject holds)."""
    from megatron.core import tensor_parallel
    state = state[0] if isinstance(state, list) else state
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    current_accelerator().set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


class History:
    """RNG states at the end of the last ``keep`` iterations."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.states: dict[int, dict] = {}

    def record(self, iteration: int) -> None:
        self.states[iteration] = snapshot()
        for old in sorted(self.states)[:-self.keep]:
            del self.states[old]

    def at(self, iteration: int) -> dict | None:
        return self.states.get(iteration)

    def export(self) -> dict:
        return dict(self.states)

    def install(self, states: dict) -> None:
        self.states = dict(states)
