"""Device layer: which accelerator we train on and which collective backend goes with it.

cpu -> gloo, cuda -> nccl, npu -> hccl (only when torch_npu imports). Chosen automatically;
``MINDSPEED_HA_DEVICE=cpu|cuda|npu`` overrides.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class DeviceError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Device:
    kind: str  # cpu | cuda | npu

    @property
    def backend(self) -> str:
        return BACKENDS[self.kind]

    @property
    def needs_cpu_shim(self) -> bool:
        return self.kind == "cpu"

    def torch_device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, local_rank)

    def set_current(self, local_rank: int) -> None:
        if self.kind == "cuda":
            torch.cuda.set_device(local_rank)
        elif self.kind == "npu":
            torch.npu.set_device(local_rank)  # type: ignore[attr-defined]


def _npu_importable() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def _cuda_real() -> bool:
    # Read the driver, not torch.cuda.is_available(): on CPU the shim makes that say True.
    try:
        return torch._C._cuda_getDeviceCount() > 0  # type: ignore[attr-defined]
    except Exception:
        return False


def detect(env: dict | None = None) -> Device:
    env = os.environ if env is None else env
    forced = env.get("MINDSPEED_HA_DEVICE", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise DeviceError(
                f"MINDSPEED_HA_DEVICE={forced!r} is not a device; use one of cpu, cuda, npu "
                "(or unset it to detect automatically)")
        if forced == "npu" and not _npu_importable():
            raise DeviceError("MINDSPEED_HA_DEVICE=npu but torch_npu is not importable; "
                              "install the npu extra (pip install mindspeed-ha[npu]) or use cpu/cuda")
        if forced == "cuda" and not _cuda_real():
            raise DeviceError("MINDSPEED_HA_DEVICE=cuda but no CUDA device is visible; use cpu")
        return Device(forced)
    if _npu_importable():
        import torch_npu  # noqa: F401  (registers torch.npu)
        if torch.npu.is_available():  # type: ignore[attr-defined]
            return Device("npu")
    if _cuda_real():
        return Device("cuda")
    return Device("cpu")
