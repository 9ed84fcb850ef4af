"""Where Megatron-LM's own training loop is and what it reads: the state the adaptor keeps so that a
recovery can bring the loop and the trainer back into step (the step in flight: ``step.StepRecord``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

from mindspeed_ha.device import backends
from mindspeed_ha.trainer.replay import Replayable


class LoopFunctions(NamedTuple):
    """What Megatron-LM's loop hands each train_step call (the same every step)."""
    train_step: Callable          # Megatron-LM's own train_step (unpatched)
    forward_step: Callable
    config: Any
    forward_backward: Callable


@dataclasses.dataclass
class LoopPosition:
    """The trainer's ``iteration`` counts completed steps. The loop runs one step behind it while a
    step a recovery finished waits for the loop's train_step call to return it (``finished``); after
    an in-loop reload the trainer is behind the loop until the steps in between are recomputed
    (``catch_up``); a restarted rank enters its loop where the survivors' loops are (``enter_at``)."""
    running: int                              # the iteration in flight (phase points)
    entered: bool = False                     # the loop has called train_step (recovery set up)
    finished: tuple | None = None             # train_step's result of a step a recovery finished
    finished_from: tuple | None = None        # (iteration, consumed samples) before that step
    catch_up: Any = None                      # after a reload: the checkpoint's data position (or its iterator)
    enter_at: int | None = None               # a joiner after a reload: the survivors' iteration



class LoopData:
    """The loop's data iterator, read through Replayable so that a rollback can hand the failed step
    its microbatches again (Megatron-LM's loop keeps its iterator object, a list of them for an
    interleaved pipeline). Megatron's RerunDataIterator stays the outer object: its rerun state
    machine checks the type."""

    def __init__(self) -> None:
        self.iterator: Any = None          # what the loop's steps read: the loop's own, wrapped
        self.replays: list[Replayable] = []
        self._loop_iter: Any = None

    def bind(self, data_iterator) -> None:
        """The loop's iterator (it hands the same object every step: wrapped once)."""
        if data_iterator is self._loop_iter:
            return
        from megatron.core.rerun_state_machine import RerunDataIterator
        self._loop_iter, self.replays = data_iterator, []

        def wrap(d):
            if d is None:  # ranks that receive their batch from TP rank 0
                return None
            if isinstance(d, RerunDataIterator):
                if not isinstance(d.iterable, Replayable):
                    d.iterable = Replayable(d.iterable)
                self.replays.append(d.iterable)
                return d
            self.replays.append(Replayable(d))
            return self.replays[-1]
        self.iterator = [wrap(d) for d in data_iterator] if isinstance(data_iterator, list) else wrap(data_iterator)

    def rewind(self) -> None:
        """The step starts over: what it drew comes again."""
        for r in self.replays:
            r.rewind()

    def restart(self, fresh) -> None:
        """Reads come from ``fresh`` (a new layout's iterator; inside Megatron's RerunDataIterator)."""
        for r in self.replays:
            r.restart(getattr(fresh, "iterable", fresh))


def keep_pipeline_outputs(config) -> None:
    """Megatron-LM frees a stage's output once its send is posted (the storage swapped out under the
    tensor). A gloo send (the emulated NCCL's too) still running in the background (an interleaved
    pipeline overlaps its transfers) then reads freed memory: NaN losses. Off on those backends."""
    import torch.distributed as dist
    acc = backends.accelerator(dist.get_backend())  # (a CPU backend's send reads the tensor on a thread of its own)
    if config.deallocate_pipeline_outputs and acc is not None and acc.on_cpu:
        config.deallocate_pipeline_outputs = False


def own_train_step(fns: LoopFunctions | None, model_chunks) -> tuple[Callable, Any]:
    """Megatron-LM's own train_step and the model config (a restarted rank rolling forward has not
    been called by the loop yet: the unpatched function and its model's config)."""
    if fns is not None:
        return fns.train_step, fns.config
    import megatron.training.training as training
    from megatron.core.utils import get_model_config
    return getattr(training.train_step, "__wrapped__", training.train_step), get_model_config(model_chunks[0])
