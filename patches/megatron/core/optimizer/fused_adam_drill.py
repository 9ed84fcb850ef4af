"""Patch group ``drill_optimizer`` (``MINDSPEED_HA_DRILL_OPTIMIZER=fused-adam``): megatron-core builds the
drill FusedAdam (``mindspeed_ha.replica.drill_optimizers``) where it would build Transformer Engine's —
the Adam class its optimizer factory builds and its distributed optimizer accepts, and the flags that
distributed optimizer reads to keep the step count per param group in its checkpoints, as for TE's."""

OPTIMIZER, DISTRIB = "megatron.core.optimizer", "megatron.core.optimizer.distrib_optimizer"


def patches(ctx=None):
    from mindspeed_ha.replica.drill_optimizers import FusedAdam
    return [(OPTIMIZER, "Adam", FusedAdam), (OPTIMIZER, "USING_PYTORCH_OPTIMIZER", False), (DISTRIB, "Adam", FusedAdam),
            (DISTRIB, "HAVE_APEX_OR_TE", True), (DISTRIB, "USING_TE_OPTIMIZER", True)]
