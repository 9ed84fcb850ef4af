"""Patch group ``torch_cpu_compile``: on the CPU, ``torch.compile`` -> the function itself, before
megatron-core is imported.

megatron-core decorates a few fusions with ``torch.compile`` as its modules import. On the CPU
dynamo is off (``TORCHDYNAMO_DISABLE=1``: the compiled functions run eagerly anyway), but the
decoration still imports ``torch._dynamo``, about a second of every process's start-up. Returning the
function unchanged runs the same eager code without that import."""
import os

import torch


def _eager(model=None, **kwargs):
    """``torch.compile`` with dynamo off: the function (or module) as it is, also as a decorator."""
    if model is None:
        return lambda fn: fn
    return model


def patches(ctx=None):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    return [(torch, "compile", _eager)]
