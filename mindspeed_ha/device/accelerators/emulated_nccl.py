"""The CPU with NCCL's semantics, for drills (``MINDSPEED_HA_EMULATE_NCCL=1``): collectives that return
at once and complete later, and communicators a stop aborts. Its backend is ``comm.emulated_nccl``, a
wrapper of gloo's communicators."""
from __future__ import annotations

import os
from typing import Mapping

from mindspeed_ha.device.accelerators.cpu_gloo import CpuGloo

EMULATED_NCCL = "emulated_nccl"
EMULATE_ENV = "MINDSPEED_HA_EMULATE_NCCL"


def emulating_nccl(env: Mapping[str, str] | None = None) -> bool:
    """A CPU job runs its collectives on the NCCL-semantics backend instead of gloo."""
    env = os.environ if env is None else env
    return env.get(EMULATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class EmulatedNccl(CpuGloo):
    backend = EMULATED_NCCL
    stream_ordered = True
    abortable = True
    wraps = "gloo"

    def enabled(self) -> bool:
        return emulating_nccl()
