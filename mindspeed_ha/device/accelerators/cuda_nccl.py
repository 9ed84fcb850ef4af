"""An NVIDIA GPU, with NCCL's collectives (stream-ordered; a stop aborts their communicators)."""
from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from mindspeed_ha import compat
from mindspeed_ha.device.accelerator import Accelerator, DeviceError, _make_current, current_device
from mindspeed_ha.device.waits import EventWaits

# NCCL serves two ranks on one GPU from this version, with NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental).
NCCL_SHARED_GPU = (2, 30, 0)
# Ranks that share a GPU under any NCCL, each one an NCCL host of its own (a drill on a one-GPU
# machine): NCCL_HOSTID differs per process, so NCCL's duplicate-GPU check (same host hash and bus
# id) does not apply and they talk over its socket transport on the loopback, as ranks on separate
# nodes would (slow, and a check of behaviour only: no P2P, SHM or NVLS path is exercised).
HOST_PER_RANK_ENV = "MINDSPEED_HA_NCCL_HOST_PER_RANK"


def own_nccl_host(local_rank: int, env: "os._Environ[str] | dict[str, str] | None" = None) -> None:
    """Before this process's first NCCL call (NCCL hashes its host once): make it an NCCL host of its
    own (``HOST_PER_RANK_ENV``), reached over NCCL's socket transport on the loopback."""
    import socket
    environ = os.environ if env is None else env
    environ["NCCL_HOSTID"] = f"{socket.gethostname()}-rank{local_rank}"
    environ.setdefault("NCCL_NET", "Socket")
    environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    environ.setdefault("NCCL_IB_DISABLE", "1")


class CudaNccl(Accelerator):
    kind = "cuda"
    backend = "nccl"
    stream_ordered = True
    abortable = True
    visible_env = "CUDA_VISIBLE_DEVICES"

    # The driver's count, not torch.cuda.is_available(): a CUDA build of torch on a machine without
    # a GPU (what pip installs by default) must train on the CPU.
    def detected(self) -> bool:
        return compat.cuda_device_count() > 0

    def refuse_forced(self, env: Mapping[str, str]) -> None:
        if compat.cuda_device_count() == 0:
            raise DeviceError("MINDSPEED_HA_DEVICE=cuda but no CUDA device is visible "
                              f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                              f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')}); use cpu")

    def count(self) -> int:
        return compat.cuda_device_count()

    def set_current(self, local_rank: int) -> torch.device:
        dev = self.torch_device(local_rank)
        if os.environ.get(HOST_PER_RANK_ENV) == "1":
            own_nccl_host(local_rank)
        torch.cuda.set_device(dev)
        return _make_current(self, dev)

    def may_share(self, visible: int, env: Mapping[str, str]) -> bool:
        if visible >= 1 and env.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1" \
                and (compat.nccl_version() or (0,)) >= NCCL_SHARED_GPU:
            return True  # NCCL lets ranks share a GPU (round robin over the visible ones)
        return visible >= 1 and env.get(HOST_PER_RANK_ENV) == "1"  # each rank an NCCL host of its own

    def share_hint(self) -> str:
        return (" or let ranks share a GPU (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1, experimental; "
                f"this NCCL is {'.'.join(map(str, compat.nccl_version() or ())) or 'unknown'}; or, for drills, "
                f"{HOST_PER_RANK_ENV}=1: each rank an NCCL host of its own, over sockets)")

    # A sticky error (the context is lost) shows itself here, where the caller ends the process.
    def synchronize(self) -> None:
        torch.cuda.current_stream().synchronize()

    def memory_counters(self) -> Any:
        return torch.cuda

    def waits(self) -> Any:
        return EventWaits(torch.cuda)

    def group_device_id(self, backend: str) -> torch.device | None:
        return current_device() if "nccl" in backend.lower() else None

    def can_abort_now(self) -> bool:
        return torch.cuda.is_available()
