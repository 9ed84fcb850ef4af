"""ASCEND (unverified: no NPU here): an NPU through torch_npu, with HCCL's collectives. A stop does not
abort a communicator: it stops the whole device (torch_npu's ``stop_device``), and a recovery restarts
it before anything runs there again."""
from __future__ import annotations

import importlib.util
from typing import Any, Mapping

import torch

from mindspeed_ha.device.accelerator import Accelerator, DeviceError, _make_current, current_device
from mindspeed_ha.device.waits import EventWaits

# torch_npu's check_uce_in_memory verdicts that leave the process usable (MindSpeed-LLM's reading):
# the bad address is in memory a repair rewrites (2), or in memory rebuilt from a replica (3).
_NPU_UCE_REPAIRABLE = (2, 3)


def _npu_importable() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


class AscendHccl(Accelerator):
    kind = "npu"
    backend = "hccl"
    stream_ordered = True
    stops_device = True
    visible_env = "ASCEND_RT_VISIBLE_DEVICES"

    def __init__(self) -> None:
        self._stopped = False  # the device was stopped and not restarted since

    def detected(self) -> bool:
        if not _npu_importable():
            return False
        import torch_npu  # noqa: F401  (registers torch.npu)
        return bool(torch.npu.is_available())  # type: ignore[attr-defined]

    def refuse_forced(self, env: Mapping[str, str]) -> None:
        if not _npu_importable():
            raise DeviceError("MINDSPEED_HA_DEVICE=npu but torch_npu is not importable; "
                              "install the npu extra (pip install mindspeed-ha[npu]) or use cpu/cuda")

    def count(self) -> int:
        return int(torch.npu.device_count())  # type: ignore[attr-defined]

    def set_current(self, local_rank: int) -> torch.device:
        dev = self.torch_device(local_rank)
        torch.npu.set_device(dev)  # type: ignore[attr-defined]
        return _make_current(self, dev)

    def synchronize(self) -> None:
        torch.npu.current_stream().synchronize()  # type: ignore[attr-defined]  # (torch_npu adds torch.npu)

    def stop(self) -> None:
        """Every NPU op fails until ``restart_after_stop``."""
        import torch_npu  # noqa: F401  (an NPU job has imported it long before)
        torch_npu.npu.stop_device(current_device().index or 0)
        self._stopped = True

    def restart_after_stop(self) -> None:
        """torch_npu's ``restart_device`` (MindSpeed-LLM's sequence), then a synchronize."""
        if self._stopped:
            import torch_npu  # noqa: F401
            torch_npu.npu.restart_device(current_device().index or 0)
            self._stopped = False
        self.synchronize()

    def memory_error_repairable(self) -> bool:
        """torch_npu's ``check_uce_in_memory`` says where the bad address lies; anywhere else than
        memory a repair rewrites, the process must be replaced."""
        import torch_npu  # noqa: F401
        return int(torch_npu.npu.check_uce_in_memory(current_device().index or 0)) in _NPU_UCE_REPAIRABLE

    def memory_counters(self) -> Any:
        return torch.npu  # type: ignore[attr-defined]  # (torch_npu's counters of torch.cuda's names)

    def waits(self) -> Any:
        return EventWaits(torch.npu)  # type: ignore[attr-defined]
