"""Device layer: which accelerator a rank trains on, the collective backend that goes with it, and
where the tensors mindspeed-ha makes live.

cpu -> gloo, cuda -> nccl, npu -> hccl (only when torch_npu imports). Chosen automatically;
``MINDSPEED_HA_DEVICE=cpu|cuda|npu`` overrides; ``MINDSPEED_HA_EMULATE_NCCL=1`` gives a CPU job the
emulated NCCL backend instead of gloo (drills: ``comm.emulated_nccl``). ``current()`` is the rank's
device once its accelerator's ``set_current`` ran: every tensor the engine creates for a collective, a batch or
a copy of state is made there, so an NCCL/HCCL group never sees a CPU tensor. (A tensor that must
stay on the CPU, Adam's ``step`` counter, is moved to ``current()`` to travel and back where it
belongs.)

Each accelerator is an object (the interface: ``device.accelerator``; one class per accelerator in
``device.accelerators``): ``detect()`` returns the rank's. What a recovery asks of the device itself
(here, of the current accelerator): ``synchronize()`` (the commit point's, and a recovery's entry,
where a sticky CUDA error shows itself), ``stop_device()`` (HCCL's stop) and ``restart_after_stop()``
(torch_npu's ``restart_device``, before anything runs there again).
"""
from __future__ import annotations

import os
from typing import Mapping

import torch

from mindspeed_ha.device import accelerators
from mindspeed_ha.device.accelerator import CPU, Accelerator, DeviceError, current_device, selected
from mindspeed_ha.device.accelerators.cuda_nccl import HOST_PER_RANK_ENV, NCCL_SHARED_GPU, own_nccl_host

__all__ = ["CPU", "HOST_PER_RANK_ENV", "NCCL_SHARED_GPU", "Accelerator", "Device", "DeviceError", "current",
           "current_accelerator", "detect", "local_ranks", "memory_error_repairable", "own_nccl_host",
           "restart_after_stop", "stop_device", "synchronize"]


def current() -> torch.device:
    """The device this rank's tensors live on (the CPU until ``set_current``)."""
    return current_device()


def current_accelerator() -> Accelerator:
    """The accelerator of ``current()`` (the CPU's until ``set_current``)."""
    return selected() or accelerators.HOST


def Device(kind: str) -> Accelerator:  # noqa: N802  (what a device was called when it was a dataclass)
    """The accelerator of ``kind`` (cpu | cuda | npu)."""
    return accelerators.of_kind(kind)


def local_ranks(env: Mapping[str, str] | None = None) -> int:
    """Ranks of this node, as the launcher (torchrun, ``mindspeed-ha run``) says."""
    env = os.environ if env is None else env
    try:
        return int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def detect(env: Mapping[str, str] | None = None) -> Accelerator:
    """The accelerator this rank trains on: ``MINDSPEED_HA_DEVICE``'s, else the first one found."""
    env = os.environ if env is None else env
    forced = env.get("MINDSPEED_HA_DEVICE", "").strip().lower()
    if forced:
        if forced not in accelerators.KINDS:
            raise DeviceError(
                f"MINDSPEED_HA_DEVICE={forced!r} is not a device; use one of cpu, cuda, npu "
                "(or unset it to detect automatically)")
        acc = accelerators.of_kind(forced)
        acc.refuse_forced(env)
        return acc
    return next(a for a in accelerators.ACCELERATORS if a.enabled() and a.detected())


# ---- what a recovery asks of the device -----------------------------------------------------------
def synchronize() -> None:
    """Wait for the work queued on this rank's current stream (nothing on the CPU). Raises the
    device's error, a sticky one included, where there is one."""
    current_accelerator().synchronize()


def stop_device() -> None:
    """Stop this rank's device, so that collectives blocked on a lost peer exit (HCCL's: torch_npu's
    ``stop_device``; nothing elsewhere); every op there fails until ``restart_after_stop``."""
    current_accelerator().stop()


def restart_after_stop() -> None:
    """At a recovery's entry, before anything runs on the device again. NPU (unverified): restart a
    stopped device (torch_npu's ``restart_device``, MindSpeed-LLM's sequence). CUDA: synchronize, so
    that a sticky error (the context is lost) shows itself here, where the caller ends the process."""
    current_accelerator().restart_after_stop()


def memory_error_repairable() -> bool:
    """After an uncorrectable memory error: may this process repair it in place? ASCEND (unverified):
    torch_npu's ``check_uce_in_memory`` says where the bad address lies; anywhere else than memory a
    repair rewrites, the process must be replaced. Elsewhere the error names the shard it poisoned."""
    return current_accelerator().memory_error_repairable()
