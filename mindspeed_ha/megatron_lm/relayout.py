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
    changed with the data-parallel size, which its rampup check would refuse. It is passed over once,
    through the switch by which its loop lets a count it reconfigures itself (sequence packing) change
    without a rampup's assertion and checkpoint."""

    def __init__(self) -> None:
        self.resized = False  # a resize changed the micro-batch count since the loop's last check
        self._packing = None  # the loop's switch, set aside while its check is passed over

    def around(self, opening: bool) -> None:
        """Around the check (``opening``: before it)."""
        from megatron.training import get_args
        a = get_args()
        if opening and self.resized:
            self._packing, a.rl_use_sequence_packing = a.rl_use_sequence_packing, True
            log.info("the micro-batch count changed with the data-parallel size (global batch %d): Megatron-LM's "
                     "rampup check is passed over once", a.global_batch_size)
        elif not opening and self._packing is not None:
            a.rl_use_sequence_packing, self._packing = self._packing, None
            self.resized = False
