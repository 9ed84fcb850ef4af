"""A CPU optimizer with the state layout of Transformer Engine's (and apex's) ``FusedAdam``, for drills.

Why: on a GPU megatron-core trains with Transformer Engine's ``FusedAdam`` whenever TE imports (apex's
next, torch's ``AdamW`` only when neither does). Its state is laid out otherwise than torch's: the
step count lives in each **param group** (``group["step"]``, an int), not in each parameter's state,
and with the precision-aware optimizer a ``master_param`` joins ``exp_avg`` and ``exp_avg_sq``, any of
them possibly kept in a lower dtype with a per-tensor fp32 scale (``optimizer._scales``). TE cannot
import without CUDA, so the replica optimizer's handling of that layout — export, repair, reshard,
checkpoint, the replica check — is drilled on this class instead:
``MINDSPEED_HA_DRILL_OPTIMIZER=fused-adam`` has megatron-core build it where it would build TE's.

What it reproduces (TE 2.x ``transformer_engine.pytorch.optimizers.FusedAdam``): the constructor's
arguments, ``param_groups`` with ``step`` per group (incremented once per ``step()``, before the
update), the per-parameter state names and dtypes (``name_to_dtype_map``), ``_scales``,
``initialize_state`` / ``get_unscaled_state`` / ``set_scaled_state``, the fp32 ``state_dict`` and
``load_state_dict`` (states unscaled on the way out, rescaled on the way in), ``use_decoupled_grad``,
and the update rule of its ``multi_tensor_adam`` kernel: m and v in fp32, bias corrections from the
group's step, ``p -= lr * (m̂ / (sqrt(v̂) + eps) + wd * p)`` in AdamW mode (the L2 form adds ``wd * p``
to the gradient instead), a master param updated in fp32 and cast into the model param.

What it cannot reproduce: the CUDA kernels' bits (this is elementwise torch arithmetic on the CPU, so
a job's losses differ from TE's and from torch's AdamW: compare a drill with a fault-free run on this
same optimizer), FP8 states (``torch.uint8``), ``capturable`` (CUDA graphs) and
``store_param_remainders``.
"""
from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Iterable, Iterator

import torch

_MAX_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0}  # TE's dtype_to_range_map (fp16)


class FusedAdam(torch.optim.Optimizer):
    """See the module's text. Kept by the engine as the fused-Adam layout (``replica.state``)."""

    keeps_fused_adam_layout = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, bias_correction: bool = True,
                 adam_w_mode: bool = True, capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype: torch.dtype = torch.float32, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, use_decoupled_grad: bool = False,
                 store_param_remainders: bool = False, set_grad_none: bool | None = None):
        # (TE keeps remainders only of fp32 master params: with others the flag changes nothing)
        remainders = store_param_remainders and master_weights and master_weight_dtype == torch.float32
        if amsgrad or capturable or remainders:
            raise RuntimeError("the drill FusedAdam does not reproduce amsgrad, capturable or store_param_remainders "
                               "(keep master params in fp16: --main-params-dtype fp16)")
        for name, dtype in (("master_weight_dtype", master_weight_dtype), ("exp_avg_dtype", exp_avg_dtype),
                            ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise RuntimeError(f"the drill FusedAdam keeps {name} in fp32, fp16 or bf16, not {dtype}")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = False
        self.master_weights = master_weights
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = False
        self.master_weight_dtype = master_weight_dtype
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self._scales: dict[Any, dict[str, torch.Tensor]] = {}

    # -- state, as TE lays it out -------------------------------------------------------------
    def _initialize_state(self, param: torch.Tensor, name: str, zero_buffer: bool) -> None:
        dtype = self.name_to_dtype_map[name]
        data = torch.empty_like(param, dtype=dtype)
        if zero_buffer:
            data.zero_()
        self.state[param][name] = data
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[name] = torch.ones([1], dtype=torch.float32, device=param.device)

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero_buffer=False)
            self.set_scaled_state(param, "master_param", param.clone().detach().float())

    def get_unscaled_state(self, param: torch.Tensor, name: str) -> torch.Tensor:
        state: torch.Tensor = self.state[param][name]
        dtype = self.name_to_dtype_map[name]
        if dtype == torch.float16:
            return state.float().mul_(self._scales[param][name])
        if dtype == torch.bfloat16:
            return state.float()
        return state

    def set_scaled_state(self, param: torch.Tensor, name: str, unscaled: torch.Tensor) -> None:
        if name not in self.state[param]:
            self._initialize_state(param, name, zero_buffer=False)
        state, dtype = self.state[param][name], self.name_to_dtype_map[name]
        if dtype == torch.float32:
            state.copy_(unscaled)
        elif dtype == torch.bfloat16:
            state.copy_(unscaled.bfloat16())
        else:  # fp16: a per-tensor scale so that the largest magnitude sits at half fp16's range
            scale = self._scales[param][name]
            torch.div(unscaled.abs().max().float(), _MAX_RANGE[dtype], out=scale.view(()))
            rscale = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
            state.copy_(unscaled * rscale)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entry in sd["state"].items():
            p = params[index]
            sd["state"][index] = {name: self.get_unscaled_state(p, name).clone() for name in entry}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entry in state_dict["state"].items():
            p = params[index]
            self.state[p] = {}
            for name, value in entry.items():
                if value is not None:
                    self.set_scaled_state(p, name, value.float())

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.decoupled_grad = None
                elif getattr(p, "decoupled_grad", None) is not None:
                    p.decoupled_grad.zero_()

    # -- the update -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            lr, eps, wd, step = group["lr"], group["eps"], group["weight_decay"], group["step"]
            c1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            c2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if not self.state[p]:
                    self.initialize_state(p)
                if grad is None:
                    continue
                g = grad.float()
                master = self.master_weights and p.dtype in (torch.float16, torch.bfloat16)
                w = self.get_unscaled_state(p, "master_param").clone() if master else p.data.float()
                m = self.get_unscaled_state(p, "exp_avg").clone()
                v = self.get_unscaled_state(p, "exp_avg_sq").clone()
                if not self.adam_w_mode:
                    g = g + wd * w
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / c1) / ((v / c2).sqrt_() + eps)
                if self.adam_w_mode:
                    update.add_(w, alpha=wd)
                w.add_(update, alpha=-lr)
                self.set_scaled_state(p, "exp_avg", m)
                self.set_scaled_state(p, "exp_avg_sq", v)
                if master:
                    self.set_scaled_state(p, "master_param", w)
                p.data.copy_(w)
        return loss


# The Transformer Engine this class stands in for (megatron-core checks a version before it accepts
# the precision-aware optimizer).
TE_VERSION = "2.8.0"
_STAND_IN = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers")


@contextlib.contextmanager
def te_stand_in() -> Iterator[None]:
    """For the duration, ``transformer_engine.pytorch.optimizers`` is a module offering this FusedAdam
    (and ``transformer_engine`` has TE's version): what megatron-core's ``OptimizerConfig`` looks up
    before it takes ``--use-precision-aware-optimizer``. Only for that moment: a module that checks for
    TE as it imports must keep finding it absent (nothing else of TE is here)."""
    if any(name in sys.modules for name in _STAND_IN):  # (TE itself, or a stand-in already)
        yield
        return
    te, pt, opt = (types.ModuleType(name) for name in _STAND_IN)
    te.__version__ = TE_VERSION  # type: ignore[attr-defined]  # (a module made here: its attributes are ours to set)
    te.pytorch, pt.optimizers, opt.FusedAdam = pt, opt, FusedAdam  # type: ignore[attr-defined]
    sys.modules.update(zip(_STAND_IN, (te, pt, opt)))
    try:
        yield
    finally:
        for name in _STAND_IN:
            sys.modules.pop(name, None)
