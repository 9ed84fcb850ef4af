"""Every monkey-patch mindspeed-ha applies, registered in one place.

A patch re-routes one attribute of a target module into the engine; it holds no logic of its own.
Patches are grouped in modules mirroring the target's module path (``patches/megatron/core/...``).
``apply(group)`` is idempotent; ``remove_all()`` restores every original (tests rely on that).
"""
from __future__ import annotations

import importlib
import threading
from typing import Any, Callable

_lock = threading.RLock()
_applied: dict[tuple[int, str], tuple[Any, str, Any, bool]] = {}  # (id(owner), attr) -> (owner, attr, original, existed)
_groups_applied: set[str] = set()

# group name -> module under mindspeed_ha.patches that defines ``patches(ctx) -> list[(owner_or_path, attr, new)]``
GROUPS = {
    "torch_cpu": "mindspeed_ha.patches.torch_cpu",
    "torch_cpu_compile": "mindspeed_ha.patches.torch_compile",
    "megatron_cpu": "mindspeed_ha.patches.megatron.core.tensor_parallel.random",
    "megatron_no_te": "mindspeed_ha.patches.megatron.core.transformer.moe.moe_utils",
    "replica_optimizer": "mindspeed_ha.patches.megatron.core.optimizer",
    "drill_optimizer": "mindspeed_ha.patches.megatron.core.optimizer.fused_adam_drill",
    "distrib_optimizer_fixes": "mindspeed_ha.patches.megatron.core.optimizer.distrib_optimizer",
    "checkpoint_writer_fixes": "mindspeed_ha.patches.megatron.core.dist_checkpointing.strategies",
    "step_hooks": "mindspeed_ha.patches.megatron.core.distributed.distributed_data_parallel",
    "megatron_training": "mindspeed_ha.patches.megatron.training",
    "interruptible_collectives": "mindspeed_ha.patches.torch.distributed",
    "stable_groups": "mindspeed_ha.patches.torch.distributed_c10d",
}


def _resolve(owner):
    if isinstance(owner, str):
        return importlib.import_module(owner)
    return owner


def set_attr(owner, attr: str, new: Any) -> None:
    """Replace ``owner.attr`` with ``new``, remembering the first original."""
    owner = _resolve(owner)
    key = (id(owner), attr)
    with _lock:
        if key not in _applied:
            existed = attr in vars(owner) if hasattr(owner, "__dict__") else hasattr(owner, attr)
            _applied[key] = (owner, attr, getattr(owner, attr, None), existed)
        setattr(owner, attr, new)


def original(owner, attr: str) -> Any:
    """The value ``owner.attr`` had before mindspeed-ha touched it."""
    owner = _resolve(owner)
    entry = _applied.get((id(owner), attr))
    return entry[2] if entry else getattr(owner, attr)


def apply(group: str, ctx: Any = None) -> bool:
    """Apply one patch group; returns False if it was already applied."""
    with _lock:
        if group in _groups_applied:
            return False
        module = importlib.import_module(GROUPS[group])
        for owner, attr, new in module.patches(ctx):
            set_attr(owner, attr, new)
        hook: Callable | None = getattr(module, "after_apply", None)
        if hook:
            hook(ctx)
        _groups_applied.add(group)
        return True


def applied() -> set[str]:
    return set(_groups_applied)


def remove_all() -> None:
    with _lock:
        for group in list(_groups_applied):
            hook = getattr(importlib.import_module(GROUPS[group]), "before_remove", None)
            if hook:
                hook()
        for owner, attr, orig, existed in reversed(list(_applied.values())):
            if existed:
                setattr(owner, attr, orig)
            else:
                try:
                    delattr(owner, attr)
                except AttributeError:
                    pass
        _applied.clear()
        _groups_applied.clear()
