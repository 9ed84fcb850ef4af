"""The phase points inside Megatron-LM's step where drills inject faults and progress is marked:
"forward" and "backward" around its forward_step and loss function, "grad-sync" before its
finalize_model_grads."""
from __future__ import annotations

from typing import Callable


def forward_with_phases(forward_step_func, s, it: int):
    """Megatron-LM's forward_step with the "forward" and "backward" phase points of session ``s``."""
    def forward_step(data_iterator, model, *args, **kwargs):
        s.fire("forward", it)
        output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)
        s.backward_point(output, it)  # (every pipeline stage, the last included)

        def loss_with_hook(*largs, **lkwargs):
            result = loss_func(*largs, **lkwargs)
            s.backward_point(result[0] if isinstance(result, tuple) else result, it)
            return result
        return output, loss_with_hook
    return forward_step


def add_grad_sync_point(config, running: Callable[[], int]) -> None:
    """The "grad-sync" phase point at the iteration ``running()`` says: Megatron-LM's loop sets
    config.finalize_model_grads_func (wrapped once)."""
    f = getattr(config, "finalize_model_grads_func", None)
    if f is None or getattr(f, "ha_phase_point", False):
        return
    from mindspeed_ha.rank import session

    def finalize_model_grads(*args, **kwargs):
        session.current().fire("grad-sync", running())
        return f(*args, **kwargs)
    setattr(finalize_model_grads, "ha_phase_point", True)
    config.finalize_model_grads_func = finalize_model_grads
