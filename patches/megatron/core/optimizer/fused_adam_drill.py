"""Patch group ``drill_optimizer`` (``MINDSPEED_HA_DRILL_OPTIMIZER=fused-adam`` or ``fused-adam-master``):
megatron-core builds the drill FusedAdam (``mindspeed_ha.replica.drill_optimizers``) where it would build
Transformer Engine's — the Adam class its optimizer factory builds and its distributed optimizer
accepts, and the flags that distributed optimizer reads to keep the step count per param group in its
checkpoints, as for TE's. With ``{"master": True}`` (the precision-aware optimizer) also
``OptimizerConfig``'s check, which looks TE's FusedAdam and version up, runs with the drill's stand-in
for TE (``drill_optimizers.te_stand_in``)."""
OPTIMIZER, DISTRIB = "megatron.core.optimizer", "megatron.core.optimizer.distrib_optimizer"
CONFIG = "megatron.core.optimizer.optimizer_config"


def patches(ctx=None):
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from mindspeed_ha.replica.drill_optimizers import FusedAdam, te_stand_in
    table = [(OPTIMIZER, "Adam", FusedAdam), (OPTIMIZER, "USING_PYTORCH_OPTIMIZER", False), (DISTRIB, "Adam", FusedAdam),
             (DISTRIB, "HAVE_APEX_OR_TE", True), (DISTRIB, "USING_TE_OPTIMIZER", True)]
    if isinstance(ctx, dict) and ctx.get("master"):
        original = OptimizerConfig.__post_init__

        def __post_init__(self):
            with te_stand_in():
                return original(self)
        table.append((OptimizerConfig, "__post_init__", __post_init__))
    return table
