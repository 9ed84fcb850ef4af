"""Device layer: which accelerator a rank trains on, the collective backend that goes with it, and
where the tensors mindspeed-ha makes live.

cpu -> gloo, cuda -> nccl, npu -> hccl (only when torch_npu imports). Chosen automatically;
``MINDSPEED_HA_DEVICE=cpu|cuda|npu`` overrides; ``MINDSPEED_HA_EMULATE_NCCL=1`` gives a CPU job the
emulated NCCL backend instead of gloo (drills: ``comm.emulated_nccl``). ``current()`` is the rank's
device once ``Device.set_current`` ran: every tensor the engine creates for a collective, a batch or
a copy of state is made there, so an NCCL/HCCL group never sees a CPU tensor. (A tensor that must
stay on the CPU, Adam's ``step`` counter, is moved to ``current()`` to travel and back where it
belongs.)

What a recovery asks of the device itself: ``synchronize()`` (the commit point's, and a recovery's
entry, where a sticky CUDA error shows itself), ``stop_device()`` (HCCL's stop) and
``restart_after_stop()`` (torch_npu's ``restart_device``, before anything runs there again).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Mapping

import torch

from mindspeed_ha import compat

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
CPU = torch.device("cpu")
_here = CPU  # this rank's device (set_current)
# NCCL serves two ranks on one GPU from this version, with NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental).
NCCL_SHARED_GPU = (2, 30, 0)
# Ranks that share a GPU under any NCCL, each one an NCCL host of its own (a drill on a one-GPU
# machine): NCCL_HOSTID differs per process, so NCCL's duplicate-GPU check (same host hash and bus
# id) does not apply and they talk over its socket transport on the loopback, as ranks on separate
# nodes would (slow, and a check of behaviour only: no P2P, SHM or NVLS path is exercised).
HOST_PER_RANK_ENV = "MINDSPEED_HA_NCCL_HOST_PER_RANK"


class DeviceError(RuntimeError):
    pass


def current() -> torch.device:
    """The device this rank's tensors live on (the CPU until ``Device.set_current``)."""
    return _here


@dataclasses.dataclass(frozen=True)
class Device:
    kind: str  # cpu | cuda | npu

    @property
    def backend(self) -> str:
        from mindspeed_ha.device.backends import EMULATED_NCCL, emulating_nccl
        if self.kind == "cpu" and emulating_nccl():
            return EMULATED_NCCL
        return BACKENDS[self.kind]

    @property
    def needs_cpu_shim(self) -> bool:
        return self.kind == "cpu"

    def count(self) -> int:
        """Devices of this kind visible to the process."""
        if self.kind == "cuda":
            return compat.cuda_device_count()
        if self.kind == "npu":
            return int(torch.npu.device_count())  # type: ignore[attr-defined]
        return 1

    def torch_device(self, local_rank: int = 0) -> torch.device:
        if self.kind == "cpu":
            return CPU
        # More local ranks than devices only where they may share one (check_local_ranks).
        return torch.device(self.kind, local_rank % max(1, self.count()))

    def set_current(self, local_rank: int) -> torch.device:
        global _here
        dev = self.torch_device(local_rank)
        if self.kind == "cuda":
            if os.environ.get(HOST_PER_RANK_ENV) == "1":
                own_nccl_host(local_rank)
            torch.cuda.set_device(dev)
        elif self.kind == "npu":
            torch.npu.set_device(dev)  # type: ignore[attr-defined]
        _here = dev
        return dev

    def check_local_ranks(self, local_ranks: int, env: Mapping[str, str] | None = None) -> None:
        """One device per local rank (the node's ``--nproc-per-node``), before anything is built: a
        clear refusal instead of 'invalid device ordinal' in the middle of a set-up."""
        env = os.environ if env is None else env
        if self.kind == "cpu" or local_ranks <= 0:
            return
        visible = self.count()
        if local_ranks <= visible:
            return
        if self.kind == "cuda" and visible >= 1 and env.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1" \
                and (compat.nccl_version() or (0,)) >= NCCL_SHARED_GPU:
            return  # NCCL lets ranks share a GPU (round robin over the visible ones)
        if self.kind == "cuda" and visible >= 1 and env.get(HOST_PER_RANK_ENV) == "1":
            return  # each rank an NCCL host of its own (own_nccl_host)
        var = "CUDA_VISIBLE_DEVICES" if self.kind == "cuda" else "ASCEND_RT_VISIBLE_DEVICES"
        shown = env.get(var)
        shown = f"{var}={shown}" if shown is not None else f"{var} unset"
        share = (" or let ranks share a GPU (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1, experimental; "
                 f"this NCCL is {'.'.join(map(str, compat.nccl_version() or ())) or 'unknown'}; or, for drills, "
                 f"{HOST_PER_RANK_ENV}=1: each rank an NCCL host of its own, over sockets)"
                 if self.kind == "cuda" else "")
        raise DeviceError(
            f"--nproc-per-node {local_ranks} starts {local_ranks} ranks on this node, but {visible} "
            f"{self.kind.upper()} device(s) are visible ({shown}): one rank per device. Use "
            f"--nproc-per-node {max(1, visible)}, make more devices visible{share}, or train on the CPU "
            "with MINDSPEED_HA_DEVICE=cpu")


def own_nccl_host(local_rank: int, env: "os._Environ[str] | dict[str, str] | None" = None) -> None:
    """Before this process's first NCCL call (NCCL hashes its host once): make it an NCCL host of its
    own (``HOST_PER_RANK_ENV``), reached over NCCL's socket transport on the loopback."""
    import socket
    environ = os.environ if env is None else env
    environ["NCCL_HOSTID"] = f"{socket.gethostname()}-rank{local_rank}"
    environ.setdefault("NCCL_NET", "Socket")
    environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    environ.setdefault("NCCL_IB_DISABLE", "1")


def local_ranks(env: Mapping[str, str] | None = None) -> int:
    """Ranks of this node, as the launcher (torchrun, ``mindspeed-ha run``) says."""
    env = os.environ if env is None else env
    try:
        return int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def _npu_importable() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def detect(env: Mapping[str, str] | None = None) -> Device:
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
        if forced == "cuda" and compat.cuda_device_count() == 0:
            raise DeviceError("MINDSPEED_HA_DEVICE=cuda but no CUDA device is visible "
                              f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                              f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')}); use cpu")
        return Device(forced)
    if _npu_importable():
        import torch_npu  # noqa: F401  (registers torch.npu)
        if torch.npu.is_available():  # type: ignore[attr-defined]
            return Device("npu")
    # The driver's count, not torch.cuda.is_available(): a CUDA build of torch on a machine without
    # a GPU (what pip installs by default) must train on the CPU.
    if compat.cuda_device_count() > 0:
        return Device("cuda")
    return Device("cpu")


# ---- what a recovery asks of the device -----------------------------------------------------------
_stopped = False  # the device was stopped (HCCL) and not restarted since


def synchronize() -> None:
    """Wait for the work queued on this rank's current stream (nothing on the CPU). Raises the
    device's error, a sticky one included, where there is one."""
    if _here.type == "cuda":
        torch.cuda.current_stream().synchronize()
    elif _here.type == "npu":
        torch.npu.current_stream().synchronize()  # type: ignore[attr-defined]  # (torch_npu adds torch.npu)


def stop_device() -> None:
    """ASCEND (unverified: no NPU here): stop this rank's NPU, so that HCCL kernels blocked on a lost
    peer exit (torch_npu's ``stop_device``); every NPU op fails until ``restart_after_stop``."""
    global _stopped
    if _here.type != "npu":
        return
    import torch_npu  # noqa: F401  (an NPU job has imported it long before)
    torch_npu.npu.stop_device(_here.index or 0)
    _stopped = True


def restart_after_stop() -> None:
    """At a recovery's entry, before anything runs on the device again. NPU (unverified): restart a
    stopped device (torch_npu's ``restart_device``, MindSpeed-LLM's sequence). CUDA: synchronize, so
    that a sticky error (the context is lost) shows itself here, where the caller ends the process."""
    global _stopped
    if _here.type == "npu" and _stopped:
        import torch_npu  # noqa: F401
        torch_npu.npu.restart_device(_here.index or 0)
        _stopped = False
    synchronize()


# torch_npu's check_uce_in_memory verdicts that leave the process usable (MindSpeed-LLM's reading):
# the bad address is in memory a repair rewrites (2), or in memory rebuilt from a replica (3).
_NPU_UCE_REPAIRABLE = (2, 3)


def memory_error_repairable() -> bool:
    """After an uncorrectable memory error: may this process repair it in place? ASCEND (unverified):
    torch_npu's ``check_uce_in_memory`` says where the bad address lies; anywhere else than memory a
    repair rewrites, the process must be replaced. Elsewhere the error names the shard it poisoned."""
    if _here.type != "npu":
        return True
    import torch_npu  # noqa: F401
    return int(torch_npu.npu.check_uce_in_memory(_here.index or 0)) in _NPU_UCE_REPAIRABLE
