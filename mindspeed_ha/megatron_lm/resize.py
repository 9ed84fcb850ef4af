"""Megatron-LM's objects in a new data-parallel layout (elastic). A scale-out's newcomers build their
model, optimizer and data loaders with Megatron-LM's set-up, alone, while the kept ranks rebuild
theirs here: no set-up collective of either side can meet the other's, so both answer theirs alone
(the only one that exchanges anything, the optimizer's parameter-group keys, aligns models that are
the same on every rank here)."""
from __future__ import annotations

from mindspeed_ha.events import get_logger

log = get_logger("megatron_lm")


def rewrap(ddp):
    """The model chunk ``ddp`` wraps, in a DDP wrapper over the new groups."""
    from mindspeed_ha.comm.interruptible import alone
    with alone():
        return type(ddp)(config=ddp.config, ddp_config=ddp.ddp_config, module=ddp.module)


class LoopOptimizer:
    """What Megatron-LM's loop holds as its optimizer when the job can change its layout (elastic):
    a resize builds a new optimizer, and the loop's reads (its learning rate and loss scale for the
    log, its checkpoint calls) follow it here."""

    def __init__(self, optimizer):
        self.ha_target = optimizer

    def __getattr__(self, name):
        return getattr(self.ha_target, name)


def unwrap_optimizer(optimizer):
    return optimizer.ha_target if isinstance(optimizer, LoopOptimizer) else optimizer


class RampupCheck:
    """Megatron-LM's micro-batch check between two steps, after a resize: the micro-batch count
    changed with the data-parallel size, which its rampup check would refuse. It is passed over once:
    through the switch by which its loop lets a count it reconfigures itself (sequence packing)
    change without a rampup's assertion and checkpoint; where the loop has no such switch
    (core_v0.12.1), by answering its check's one read of the count with the count before the
    resize (``count``), its next read taking the new one as the loop's own."""

    def __init__(self) -> None:
        self.resized = False  # a resize changed the micro-batch count since the loop's last check
        self.count_before: int | None = None  # the micro-batch count before that resize
        self._packing = None  # the loop's switch, set aside while its check is passed over
        self._answer: int | None = None  # the count the check's read is answered with, once

    def around(self, opening: bool) -> None:
        """Around the check (``opening``: before it)."""
        from megatron.training import get_args
        from mindspeed_ha import compat
        a = get_args()
        switch = compat.loop_rampup_switch(a)
        if opening and self.resized:
            log.info("the micro-batch count changed with the data-parallel size (global batch %d): Megatron-LM's "
                     "rampup check is passed over once", a.global_batch_size)
            if switch is None:
                self._answer, self.resized = self.count_before, False
                return
            self._packing = getattr(a, switch)
            setattr(a, switch, True)
        elif not opening and self._packing is not None:
            assert switch is not None  # (set aside above)
            setattr(a, switch, self._packing)
            self._packing, self.resized = None, False

    def count(self, original) -> int:
        """The micro-batch count as Megatron-LM's training module reads it: once the count before the
        resize (the check's read), else ``original()``."""
        answer, self._answer = self._answer, None
        return original() if answer is None else answer
