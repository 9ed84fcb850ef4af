"""Patch group ``precision_aware_load``: megatron-core's DistributedOptimizer loads a precision-aware
optimizer's dp_reshardable state without handing it the checkpoint's bookkeeping keys (the fix is
``compat.precision_aware_load_fix``, gated on the method being there)."""
from mindspeed_ha import compat


def patches(ctx=None):
    return compat.precision_aware_load_fix()
