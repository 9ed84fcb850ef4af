"""What an optimizer keeps, in whichever layout megatron-core hands it: the state a twin must hold
byte for byte, and what a repair, a reshard and the replica check move and compare.

megatron-core builds its distributed optimizer around one of:

- **torch's Adam / AdamW** (what it takes without Transformer Engine or apex): per parameter
  ``exp_avg``, ``exp_avg_sq`` and ``step`` (a tensor: a CPU scalar, on the device when fused or
  capturable).
- **a fused Adam** — Transformer Engine's or apex's ``FusedAdam``, and the CPU reproduction drills run
  with (``replica.drill_optimizers``): per parameter ``exp_avg`` and ``exp_avg_sq`` (and with the
  precision-aware optimizer ``master_param``), any of them possibly in a lower dtype with a
  per-tensor scale in ``optimizer._scales[param][name]``; the step count per **param group**
  (``group["step"]``: an int, or a device tensor when capturable).
- **SGD**: a ``momentum_buffer`` per parameter once it has stepped with momentum.

``layout_of`` says which, and refuses any other optimizer: the engine would not know what a twin must
copy. The functions here read and write the state as exactly what the optimizer holds (raw dtypes,
scales included), so a repaired shard equals its twin's bytes and the replica check covers every key.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, MutableMapping

import torch

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


class UnknownOptimizer(TypeError):
    """An optimizer whose state layout the engine does not know."""


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    per_param: tuple[str, ...]     # the per-parameter state, in a stable order (those present are kept)
    moments: tuple[str, ...]       # what a reshard moves besides the main values (elementwise state)
    group_step: bool               # the step count is kept per param group (fused Adam)
    param_step: bool               # ... or per parameter (torch's Adam)


TORCH_ADAM = Layout("torch-adam", ("exp_avg", "exp_avg_sq", "step"), ADAM_MOMENTS, False, True)
FUSED_ADAM = Layout("fused-adam", ("exp_avg", "exp_avg_sq", "master_param"), ADAM_MOMENTS, True, False)
SGD = Layout("sgd", ("momentum_buffer",), ("momentum_buffer",), False, False)


def layout_of(optimizer: Any) -> Layout:
    """The layout of a torch optimizer (the ``.optimizer`` inside megatron-core's)."""
    cls = type(optimizer)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return TORCH_ADAM
    if isinstance(optimizer, torch.optim.SGD) or cls.__name__ == "FusedSGD":
        return SGD
    if cls.__name__ == "FusedAdam" or getattr(cls, "keeps_fused_adam_layout", False):
        return FUSED_ADAM
    if cls.__name__ == "HybridDeviceOptimizer":
        raise UnknownOptimizer(
            "--optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer splits the optimizer state over "
            "sub-optimizers on the host and on the device, which the replica optimizer does not copy to a twin; drop "
            "--optimizer-cpu-offload, or train without replicas (--distributed-optimizer-no-replica: a fault "
            "reloads the periodic checkpoint)")
    raise UnknownOptimizer(
        f"the replica optimizer does not know the state of {cls.__module__}.{cls.__qualname__}: a twin could not be "
        "kept byte for byte. Known: torch's Adam and AdamW, Transformer Engine's and apex's FusedAdam, SGD "
        "(--optimizer adam or sgd, without --optimizer-cpu-offload)")


def scales(optimizer: Any) -> dict[Any, dict[str, torch.Tensor]]:
    """A fused Adam's per-tensor scales of its lower-precision state: param -> {name: scale}."""
    return getattr(optimizer, "_scales", None) or {}


def group_step(optimizer: Any, group: dict[str, Any]) -> float | None:
    """The step count of ``group`` (fused Adam): None before its first step."""
    step = group.get("step")
    return None if step is None else float(step)


def step_count(optimizer: Any, layout: Layout) -> float | None:
    """The optimizer's step count, the same for every parameter and group (None for SGD: it has none)."""
    if layout.group_step:
        steps = {group_step(optimizer, g) for g in optimizer.param_groups if g["params"]}
        steps.discard(None)
        return steps.pop() if steps else 0.0
    if layout.param_step:
        for st in optimizer.state.values():
            if "step" in st:
                return float(st["step"])
        return 0.0
    return None


def set_step_count(optimizer: Any, layout: Layout, step: float | None = None) -> None:
    """Every parameter's (torch's Adam: its own tensor, where torch keeps it) or every group's (fused
    Adam) step count := ``step`` — None: the one the param groups hold (after a checkpoint load, which
    restores it there). Nothing for an optimizer without one; never a key the optimizer does not have."""
    for group in optimizer.param_groups:
        value = step if step is not None else group.get("step")
        if layout.group_step:
            if value is not None and group["params"]:
                old = group.get("step")
                group["step"] = old.new_tensor(int(value)) if torch.is_tensor(old) else int(value)
            continue
        if not layout.param_step:
            continue
        on_device = bool(group.get("capturable") or group.get("fused"))
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st is not None:
                v = value if value is not None else st.get("step")
                st["step"] = torch.tensor(float(v), dtype=torch.float32, device=p.device if on_device else "cpu")


def own_step_tensors(optimizer: Any, layout: Layout) -> None:
    """torch's Adam: no two parameters may share one ``step`` tensor (it would be bumped once per
    parameter per step)."""
    if not layout.param_step:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st is not None and torch.is_tensor(st.get("step")):
                st["step"] = st["step"].detach().clone()


def export_param(optimizer: Any, layout: Layout, main: torch.Tensor, prefix: str,
                 out: MutableMapping[str, torch.Tensor]) -> None:
    """The state of one parameter, as held: ``{prefix}.{key}`` (and ``{prefix}.{key}.scale``)."""
    st = optimizer.state.get(main, {})
    own_scales = scales(optimizer).get(main, {})
    for key in layout.per_param:
        v = st.get(key)
        if v is None:
            continue
        out[f"{prefix}.{key}"] = v.detach() if torch.is_tensor(v) else torch.tensor(float(v), device="cpu")
        if key in own_scales:
            out[f"{prefix}.{key}.scale"] = own_scales[key].detach()


def export_groups(optimizer: Any, layout: Layout, prefix: str, out: MutableMapping[str, torch.Tensor],
                  device: torch.device) -> None:
    """A fused Adam's step count per group: ``{prefix}.g{g}.step`` (0 before the first step)."""
    if not layout.group_step:
        return
    for g, group in enumerate(optimizer.param_groups):
        step = group.get("step")
        out[f"{prefix}.g{g}.step"] = (step.detach() if torch.is_tensor(step)
                                      else torch.tensor(int(step or 0), dtype=torch.int64, device=device))


def import_param(optimizer: Any, layout: Layout, main: torch.Tensor, prefix: str,
                 tensors: Mapping[str, torch.Tensor]) -> None:
    st = optimizer.state.setdefault(main, {})
    for key in layout.per_param:
        got = tensors.get(f"{prefix}.{key}")
        if got is None:
            continue
        if torch.is_tensor(st.get(key)):
            if st[key].data_ptr() != got.data_ptr():  # (else written in place already)
                st[key].copy_(got)
        else:
            st[key] = got.detach().clone().to(main.device if key != "step" else got.device)
        scale = tensors.get(f"{prefix}.{key}.scale")
        if scale is not None:
            own = scales(optimizer).setdefault(main, {})
            if key in own:
                if own[key].data_ptr() != scale.data_ptr():
                    own[key].copy_(scale)
            else:
                own[key] = scale.detach().clone()


def import_groups(optimizer: Any, layout: Layout, prefix: str, tensors: Mapping[str, torch.Tensor]) -> None:
    if not layout.group_step:
        return
    for g, group in enumerate(optimizer.param_groups):
        got = tensors.get(f"{prefix}.g{g}.step")
        if got is None:
            continue
        old = group.get("step")
        if torch.is_tensor(old):
            old.copy_(got)
        elif int(got) or old is not None:  # (0: not stepped yet, as the twin)
            group["step"] = int(got)
        else:
            group.pop("step", None)


def holds_master(optimizer: Any, main: torch.Tensor) -> bool:
    """The optimizer keeps ``main``'s fp32 values itself (a precision-aware fused Adam's
    ``master_param``): ``main`` is then the 16-bit model shard."""
    return "master_param" in optimizer.state.get(main, {})


def reshard_values(optimizer: Any, layout: Layout, main: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What a reshard moves of ``main``, as fp32 tensors: its values, then its elementwise state (and,
    where the optimizer holds the master values itself, those after the model shard's own 16-bit
    values, which are the weights and not a cast of the stored master). Live views where the
    optimizer keeps them in fp32; otherwise fp32 copies, unscaled, that ``reshard_install`` writes back."""
    st = optimizer.state[main]
    names = [k for k in layout.moments if k in st]
    if not holds_master(optimizer, main) and all(st[k].dtype == torch.float32 for k in names):
        return (main, *(st[k] for k in names))
    unscaled = optimizer.get_unscaled_state
    own = ("master_param",) if holds_master(optimizer, main) else ()
    return (main.detach().float(), *(unscaled(main, k).clone() for k in (*own, *names)))


def reshard_install(optimizer: Any, layout: Layout, main: torch.Tensor, values: tuple[torch.Tensor, ...]) -> None:
    """Write back what ``reshard_values`` copied, each state scaled as the optimizer keeps it."""
    if values[0] is main:
        return
    names = [k for k in layout.moments if k in optimizer.state[main]]
    own = ["master_param"] if holds_master(optimizer, main) else []
    with torch.no_grad():
        main.copy_(values[0])
        for name, value in zip([*own, *names], values[1:]):
            optimizer.set_scaled_state(main, name, value)

