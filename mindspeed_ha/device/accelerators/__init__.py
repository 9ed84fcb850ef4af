"""The accelerators the engine runs on, one file and one class each, in the order ``detect`` tries
them (devices before the host). A new accelerator is a file here and a line in ``ACCELERATORS``."""
from __future__ import annotations

from mindspeed_ha.device.accelerator import Accelerator
from mindspeed_ha.device.accelerators.ascend_hccl import AscendHccl
from mindspeed_ha.device.accelerators.cpu_gloo import CpuGloo
from mindspeed_ha.device.accelerators.cuda_nccl import CudaNccl
from mindspeed_ha.device.accelerators.emulated_nccl import EmulatedNccl

HOST = CpuGloo()  # (the process's accelerator until one's set_current ran)
ACCELERATORS: tuple[Accelerator, ...] = (
    AscendHccl(),
    CudaNccl(),
    EmulatedNccl(),  # (before the CPU's: it stands for the CPU when enabled)
    HOST,
)
KINDS = tuple(dict.fromkeys(a.kind for a in ACCELERATORS))


def of_kind(kind: str) -> Accelerator:
    """The accelerator of a device kind (cpu, cuda, npu): its first one enabled now."""
    for acc in ACCELERATORS:
        if acc.kind == kind and acc.enabled():
            return acc
    raise KeyError(kind)


def of_type(device_type: str) -> Accelerator:
    """The accelerator of tensors of ``device_type`` (the host's for a type none has)."""
    return next((a for a in ACCELERATORS if a.type == device_type and a.enabled()), HOST)


def of_backend(backend: str) -> Accelerator | None:
    """The accelerator of a collective backend's name (None: not one the engine knows)."""
    name = str(backend).lower()
    return next((a for a in ACCELERATORS if a.backend == name), None)
