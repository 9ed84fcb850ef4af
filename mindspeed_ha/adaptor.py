"""Apply the patches a run needs, once: the CPU shim (only on CPU) and the optimizer re-route."""
from __future__ import annotations

import importlib.util
import os

from mindspeed_ha import process  # noqa: F401  (first: it notes who started this process, before torch loads)
import mindspeed_ha.patches as registry  # noqa: I001
from mindspeed_ha.device.backends import nccl_environment
from mindspeed_ha.device import Accelerator, detect


def megatron_lm_available() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def before_megatron(device: Accelerator) -> None:
    """What must precede megatron-core's import on ``device`` (its modules decorate functions as they load)."""
    if device.needs_cpu_shim:
        registry.apply("torch_cpu_compile")


def apply_patches(device: Accelerator | None = None, megatron_lm: bool | None = None, ha: bool = True) -> Accelerator:
    """``ha``: the run may need to stop ranks inside collectives (the processor's stop handler)."""
    from mindspeed_ha.process import end_with_launcher
    end_with_launcher()  # (a worker of plain torchrun does not outlive it)
    device = device or detect()
    if device.wraps is not None:  # (a drill: the CPU job's collectives get NCCL's semantics)
        from mindspeed_ha import compat
        from mindspeed_ha.comm import emulated_nccl
        emulated_nccl.register(compat.make_communicator)
    if device.needs_cpu_shim:
        # The shim says CUDA is available; torch.compile must not believe it. The env var also
        # covers functions megatron decorates at import time, after this point.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        before_megatron(device)
        registry.apply("torch_cpu")
        registry.apply("megatron_cpu")
    if importlib.util.find_spec("transformer_engine") is None:
        registry.apply("megatron_no_te")
    registry.apply("replica_optimizer")
    registry.apply("distrib_optimizer_fixes")
    registry.apply("checkpoint_writer_fixes")
    drill = _drill_optimizer()
    if drill:  # (a drill: megatron-core builds a CPU optimizer with a fused Adam's state layout)
        registry.apply("drill_optimizer", {"master": drill == "fused-adam-master"})
    registry.apply("step_hooks")
    if ha:
        nccl_environment()  # (the session's start event says what the job runs with)
        registry.apply("interruptible_collectives")
        registry.apply("stable_groups")
    if megatron_lm if megatron_lm is not None else megatron_lm_available():
        registry.apply("megatron_training")
    return device


def _drill_optimizer() -> str | None:
    """The drill optimizer asked for; an unknown name is refused where the job's options are read."""
    from mindspeed_ha.options import HAConfigError, drill_optimizer
    try:
        return drill_optimizer()
    except HAConfigError:
        return None
