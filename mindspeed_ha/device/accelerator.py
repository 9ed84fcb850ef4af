"""What the engine asks of an accelerator: the device a rank trains on and the collective backend that
goes with it. One subclass per accelerator (``device.accelerators``); nothing outside the device room
branches on a device's or a backend's name, it asks the accelerator.

The defaults here are a device's that needs nothing done (the CPU's): no stream to wait for, no stop,
memory measured by the process (``device.memory``), waits timed on the host (``device.waits``).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from mindspeed_ha.device.waits import HostWaits

CPU = torch.device("cpu")


class DeviceError(RuntimeError):
    pass


class Accelerator:
    """One accelerator and its collective backend (a singleton: ``device.accelerators``)."""

    kind = ""                   # MINDSPEED_HA_DEVICE's name, and torch's device type
    backend = ""                # its collective backend, as the engine's groups record it
    stream_ordered = False      # collectives return at once and complete later (NCCL's semantics)
    abortable = False           # a replaced or stopped communicator is aborted, which frees what it holds
    stops_device = False        # a stop stops the whole device (``stop``) instead of aborting communicators
    on_cpu = False              # its tensors live in host memory
    wraps: str | None = None    # the backend whose communicator this backend's wraps (a drill's emulated one)
    visible_env = ""            # the variable that says which devices a process sees

    @property
    def type(self) -> str:
        """Torch's device type of its tensors."""
        return self.kind

    @property
    def needs_cpu_shim(self) -> bool:
        """Megatron-core runs on it only with torch.cuda's CPU stand-ins (``patches``)."""
        return self.on_cpu

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind}, {self.backend})"

    # ---- choosing it ------------------------------------------------------------------------------
    def enabled(self) -> bool:
        """It may stand for its kind now (a drill's variant only when asked for)."""
        return True

    def detected(self) -> bool:
        """This machine has it (``detect``: the registry's first such one is the rank's)."""
        return False

    def refuse_forced(self, env: Mapping[str, str]) -> None:
        """Raise ``DeviceError`` where ``MINDSPEED_HA_DEVICE`` names it and it cannot run here."""

    # ---- the rank's device ------------------------------------------------------------------------
    def count(self) -> int:
        """Devices of this kind visible to the process."""
        return 1

    def torch_device(self, local_rank: int = 0) -> torch.device:
        """The device of local rank ``local_rank``."""
        # More local ranks than devices only where they may share one (check_local_ranks).
        return torch.device(self.kind, local_rank % max(1, self.count()))

    def set_current(self, local_rank: int) -> torch.device:
        """Make ``local_rank``'s device this process's (``device.current``)."""
        return _make_current(self, self.torch_device(local_rank))

    def may_share(self, visible: int, env: Mapping[str, str]) -> bool:
        """Ranks may share the ``visible`` devices (more local ranks than devices)."""
        return False

    def share_hint(self) -> str:
        """How ranks could share a device, for ``check_local_ranks``'s refusal."""
        return ""

    def check_local_ranks(self, local_ranks: int, env: Mapping[str, str] | None = None) -> None:
        """One device per local rank (the node's ``--nproc-per-node``), before anything is built: a
        clear refusal instead of 'invalid device ordinal' in the middle of a set-up."""
        env = os.environ if env is None else env
        if local_ranks <= 0:
            return
        visible = self.count()
        if local_ranks <= visible or self.may_share(visible, env):
            return
        var = self.visible_env
        shown = env.get(var)
        shown = f"{var}={shown}" if shown is not None else f"{var} unset"
        raise DeviceError(
            f"--nproc-per-node {local_ranks} starts {local_ranks} ranks on this node, but {visible} "
            f"{self.kind.upper()} device(s) are visible ({shown}): one rank per device. Use "
            f"--nproc-per-node {max(1, visible)}, make more devices visible{self.share_hint()}, or train on the CPU "
            "with MINDSPEED_HA_DEVICE=cpu")

    # ---- what a recovery asks of the device -------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for the work queued on the current stream; raise the device's (sticky) error."""

    def stop(self) -> None:
        """Stop the device so that collectives blocked on a lost peer exit (HCCL's stop)."""

    def restart_after_stop(self) -> None:
        """Before anything runs on the device again after a stop; ends with a ``synchronize``."""
        self.synchronize()

    def memory_error_repairable(self) -> bool:
        """After an uncorrectable memory error: may this process repair it in place?"""
        return True

    def memory_counters(self) -> Any:
        """The module with the allocator's peak counters (``torch.cuda``'s names); None: the process's."""
        return None

    def waits(self) -> Any:
        """A new record of the waits of collectives on its tensors (``device.waits``)."""
        return HostWaits()

    # megatron-core's "CUDA" generator: the GPU's on CUDA, the CPU shim's stand-in on the CPU.
    def rng_state(self) -> torch.Tensor:
        """The device generator's state (megatron-core's "CUDA" one)."""
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore ``rng_state``'s state."""
        torch.cuda.set_rng_state(state)

    # ---- its communicators ------------------------------------------------------------------------
    def group_device_id(self, backend: str) -> torch.device | None:
        """The ``device_id`` that connects a default group of ``backend`` at once (None: none)."""
        return None

    def can_abort_now(self) -> bool:
        """A stop aborts this backend's communicators in this process (``comm.abort``)."""
        return self.abortable


# This process's accelerator and device, once set_current ran (the CPU until then).
_current: tuple[Accelerator | None, torch.device] = (None, CPU)


def _make_current(acc: Accelerator, dev: torch.device) -> torch.device:
    global _current
    _current = (acc, dev)
    return dev


def current_device() -> torch.device:
    """The device this rank's tensors live on (the CPU until ``set_current``)."""
    return _current[1]


def selected() -> Accelerator | None:
    """The accelerator whose ``set_current`` ran in this process (None: none yet)."""
    return _current[0]
