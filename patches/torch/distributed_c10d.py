"""Patch group ``stable_groups``: torch.distributed's ``init_process_group`` and ``new_group`` ->
``mindspeed_ha.comm.groups``, so that every process group of the job is a StableGroup whose
communicator a recovery can replace in place. Replaced in ``torch.distributed`` and in
``torch.distributed.distributed_c10d`` (megatron-core and Megatron-LM call them through either)."""
from __future__ import annotations

from torch.distributed import distributed_c10d as c10d


def _route(name: str, original):
    def patched(*args, **kwargs):
        from mindspeed_ha.comm import groups
        return getattr(groups, name)(original, *args, **kwargs)
    patched.__wrapped__ = original
    patched.__name__ = name
    return patched


def patches(ctx=None):
    import torch.distributed as dist
    out = []
    for name in ("init_process_group", "new_group"):
        new = _route(name, getattr(c10d, name))
        out += [(c10d, name, new), (dist, name, new)]
    return out
