"""torch.cuda -> CPU stand-ins (applied only when the device layer picked cpu)."""
import os

import torch

from mindspeed_ha.device import cpu

_mode = None


def _own(fn):
    """A distinct function object per patched name: torch._dynamo's trace rules reject one object
    registered under two torch names."""
    def f(*args, **kwargs):
        return fn(*args, **kwargs)
    f.__name__ = getattr(fn, "__name__", "f")
    return f


def patches(ctx=None):
    c = torch.cuda
    # torch.cuda.is_available() is left alone: it says False on the CPU, also with a CUDA build of
    # torch (torch's own code, e.g. the optimizers' graph-capture check, would call the driver on a
    # True). Megatron-LM's assertion of CUDA is answered where it is made (patches/megatron/training).
    table = [
        (c, "current_device", cpu.current_device),
        (c, "device_count", lambda: 1),
        (c, "set_device", cpu.noop),
        (c, "synchronize", cpu.noop),
        (c, "empty_cache", cpu.noop),
        (c, "Stream", cpu.Stream),
        (c, "Event", cpu.Event),
        (c, "stream", cpu.stream),
        (c, "current_stream", cpu.current_stream),
        (c, "default_stream", cpu.current_stream),
        (c, "set_stream", cpu.noop),
        (c, "manual_seed", cpu.cuda_manual_seed),
        (c, "manual_seed_all", cpu.noop),  # torch.manual_seed calls it after seeding the CPU
        (c, "get_rng_state", cpu.get_rng_state),
        (c, "set_rng_state", cpu.set_rng_state),
        (c.random, "get_rng_state", cpu.get_rng_state),
        (c.random, "set_rng_state", cpu.set_rng_state),
        (c, "memory_allocated", lambda *a, **k: 0),
        (c, "max_memory_allocated", lambda *a, **k: 0),
        (c, "memory_reserved", lambda *a, **k: 0),
        (c, "get_device_properties", cpu.device_properties),
        (c, "get_device_capability", lambda *a, **k: (0, 0)),
        (c.nvtx, "range_push", cpu.noop),
        (c.nvtx, "range_pop", cpu.noop),
        (torch.Tensor, "type", cpu.make_tensor_type(torch.Tensor.type)),
        (torch.Tensor, "cuda", cpu.tensor_cuda),
    ]
    return [(o, a, v if isinstance(v, type) or o is torch.Tensor else _own(v)) for o, a, v in table]


def after_apply(ctx=None):
    global _mode
    # With it, torch.cuda.is_available() asks device_count(), which the shim answers 1 (megatron-core
    # divides by it): torch's own code would then reach for the driver.
    os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    # megatron jit-fuses a few MoE and activation functions with torch.compile: on the CPU that is a
    # C++ compile per function for tiny tensors; run them eagerly instead. (TORCHDYNAMO_DISABLE, set
    # before, is read by dynamo when it is imported; torch_cpu_compile keeps megatron from importing it.)
    import sys
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].config.disable = True
    _mode = cpu.CpuDeviceMode()
    _mode.__enter__()  # process-wide: device='cuda' literals anywhere become cpu


def before_remove():
    global _mode
    if _mode is not None:
        _mode.__exit__(None, None, None)
        _mode = None
