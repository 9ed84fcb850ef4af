"""Patch group ``interruptible_collectives``: route blocking c10d collectives through
``mindspeed_ha.comm.interruptible`` so the stop action can pull a rank out of them. The wrappers
obey the process's stop (``interruptible.PROCESS_STOP``): megatron-core calls them with no object in
hand.

Replaced in ``torch.distributed`` *and* ``torch.distributed.distributed_c10d`` (so torch's own
helpers that call them by module global - ``send``/``recv``, ``all_gather_object``,
``broadcast_object_list``, the coalescing fast path - get them too), and in every already-imported
``megatron.*`` module that bound an original by name (``from torch.distributed import
_coalescing_manager``, ``dist_all_gather_func = torch.distributed.all_gather_into_tensor``, ...).
One wrapper object per original, used everywhere: c10d compares ops by identity
(``op0 is all_reduce``, ``p2p_op.op is isend``).
Modules imported after ``apply`` bind the wrappers themselves; the megatron modules known to bind
names are imported here first (ctx ``{"import_megatron": False}`` skips that). ``remove_all``
restores every attribute set here, not names bound by modules imported while the patch was on.
"""
from __future__ import annotations

import importlib
import sys

from torch.distributed import distributed_c10d as c10d

from mindspeed_ha.comm import interruptible as ic

COLLECTIVES = (
    "all_reduce", "broadcast", "barrier", "reduce",
    "all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single",
    "gather", "scatter", "all_to_all", "all_to_all_single",
)
P2P = ("isend", "irecv")
MEGATRON_MODULES = (  # modules of megatron-core 0.16 that bind a collective by name at import
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.multi_token_prediction",
)


def _wrappers() -> dict[int, tuple[str, object]]:
    """id(original) -> (name, wrapper), built once per original."""
    out = {}
    for name in COLLECTIVES + P2P + ("batch_isend_irecv", "_coalescing_manager"):
        orig = getattr(c10d, name, None)
        if orig is None or hasattr(orig, "__mindspeed_ha_original__"):
            continue
        if name in P2P:
            new = ic.make_interruptible_p2p(orig, ic.PROCESS_STOP)
        elif name == "batch_isend_irecv":
            new = ic.make_interruptible_batch_p2p(orig, ic.PROCESS_STOP)
        elif name == "_coalescing_manager":
            new = ic.make_interruptible_coalescing_manager(orig, ic.PROCESS_STOP)
        else:
            new = ic.make_interruptible(orig, ic.PROCESS_STOP)
        out[id(orig)] = (name, new)
    return out


def _ctx_get(ctx, key, default):
    if isinstance(ctx, dict):
        return ctx.get(key, default)
    return getattr(ctx, key, default)


def patches(ctx=None):
    import torch.distributed as dist

    # ctx {"import_megatron": False}: patch only what is already imported (tests without megatron)
    if _ctx_get(ctx, "import_megatron", True):
        for mod in MEGATRON_MODULES:
            try:
                importlib.import_module(mod)
            except Exception:  # megatron absent or needs extras: nothing of it to patch
                pass
    wrappers = _wrappers()
    out = []
    for owner in (c10d, dist):
        for oid, (name, new) in wrappers.items():
            if id(getattr(owner, name, None)) == oid:
                out.append((owner, name, new))
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("megatron.") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            hit = wrappers.get(id(value))
            if hit is not None:
                out.append((mod, attr, hit[1]))
    return out
