"""Where Megatron-LM's own training loop is, and what the step in flight has done: the state the
adaptor keeps so that a recovery can bring the loop and the trainer back into step."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple


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


@dataclasses.dataclass
class StepRecord:
    """What the step in flight has done so far: a roll-forward reuses its forward-backward output,
    a restarted twin takes its DP-reduced losses, and a rollback undoes what its tail advanced."""
    done: bool = False                        # it returned: the loop is between steps (e.g. saving)
    out: tuple | None = None                  # what it returned (for the loop's call, if a fault came after)
    fb_out: list | None = None                # its forward-backward output
    reduced: dict | None = None               # its [loss sum, tokens] reduced over DP (under recover)
    reduced_mark: tuple | None = (-1, 0)      # interruptible.commit_mark() as they were issued (None: a twin's, whole)
    samples_hash: Any = None                  # its global batch's samples (tokens_fingerprint), on the device
    samples_mark: tuple = (-1, 0)             # interruptible.commit_mark() when that sum was issued
    at_start: dict = dataclasses.field(default_factory=dict)  # scheduler, rerun state, timers at its start
