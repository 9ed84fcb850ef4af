"""Stand-ins that let unmodified megatron-core (and Megatron-LM) run on CPU.

megatron-core assumes CUDA everywhere: streams, events, ``device='cuda'`` literals,
``'torch.cuda.FloatTensor'`` type checks and the CUDA RNG. On CPU there is one stream and one
generator, so every stream/event op is a no-op and the "CUDA" RNG *is* the CPU RNG: forks of
megatron's RNG tracker swap CPU generator states exactly as they would swap CUDA ones.
``patches/torch_cpu.py`` installs these; MindSpeed's transfer_to_npu is the same idea for Ascend.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


class Stream:
    """A CPU 'stream': work is already ordered, so every method is a no-op."""

    def __init__(self, *args, **kwargs):
        self.device = CPU

    def wait_stream(self, other=None):
        pass

    def wait_event(self, event=None):
        pass

    def record_event(self, event=None):
        return event if event is not None else Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_STREAM = Stream()


class Event:
    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end: "Event") -> float:
        return ((end._t or 0.0) - (self._t or 0.0)) * 1000.0


def current_stream(device=None):
    return _STREAM


def stream(s=None):
    return contextlib.nullcontext(s)


def noop(*args, **kwargs):
    return None


def current_device():
    return CPU


def device_properties(device=None):
    """What megatron reads of a device (name, memory, SM count) for a CPU."""
    import types
    import psutil
    return types.SimpleNamespace(name="cpu", total_memory=psutil.virtual_memory().total, major=0, minor=0,
                                 multi_processor_count=os.cpu_count() or 1)


def cuda_manual_seed(seed):
    """The 'CUDA' generator is the CPU one (see the module docstring)."""
    torch.default_generator.manual_seed(int(seed))


def get_rng_state(device="cuda"):
    return torch.get_rng_state()


def set_rng_state(state, device="cuda"):
    torch.set_rng_state(state)


def rng_state_get(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def rng_state_set(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _is_accel(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # Bare ints are CUDA ordinals in megatron (torch.cuda.current_device()).
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def make_tensor_type(original):
    """``Tensor.type()`` reports CUDA type names (megatron checks 'torch.cuda.FloatTensor')."""

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CUDA_TYPES.get(name, name)  # already-CUDA names (subclasses) pass through
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def tensor_is_cuda(self):  # property getter replacement is not needed; kept for symmetry
    return False


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites ``device=`` arguments that name CUDA to the CPU, wherever a tensor is made or moved."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and _is_accel(dev):
            kwargs["device"] = CPU
        elif func in _TO_FUNCS and len(args) > 1 and _is_accel(args[1]):
            args = (args[0], CPU) + tuple(args[2:])
        return func(*args, **kwargs)


_TO_FUNCS = {torch.Tensor.to}
