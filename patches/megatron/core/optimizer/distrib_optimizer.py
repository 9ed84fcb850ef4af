"""Patch group ``distrib_optimizer_fixes``: what the engine mends in megatron-core's
DistributedOptimizer module, by release: a precision-aware optimizer's dp_reshardable state loaded
without the checkpoint's bookkeeping keys (0.16 and later), no fp8 quantisation asked of an absent
Transformer Engine when there is nothing to quantise (0.12). The fixes and their gates are
``compat.distrib_optimizer_fixes``."""
from mindspeed_ha import compat


def patches(ctx=None):
    return compat.distrib_optimizer_fixes()
