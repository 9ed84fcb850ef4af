"""The CPU, with gloo's collectives: they block the calling thread."""
from __future__ import annotations

from typing import Mapping

import torch

from mindspeed_ha.device.accelerator import CPU, Accelerator


class CpuGloo(Accelerator):
    kind = "cpu"
    backend = "gloo"
    on_cpu = True

    def detected(self) -> bool:
        return True

    def torch_device(self, local_rank: int = 0) -> torch.device:
        return CPU

    def check_local_ranks(self, local_ranks: int, env: Mapping[str, str] | None = None) -> None:
        """Any number of ranks share the CPU."""
