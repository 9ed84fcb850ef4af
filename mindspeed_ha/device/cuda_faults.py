"""A genuine sticky CUDA error, for drills on a real GPU (``cuda-illegal-address``).

A one-program Triton kernel stores far outside its one-element buffer; the next synchronisation
raises "CUDA error: an illegal memory access was encountered" (``torch.AcceleratorError``) and
every CUDA call of this process fails from then on: only a new process recovers, as after an
uncorrectable ECC error. Imported only when such a drill fires (it needs triton and a GPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mindspeed_ha.device import current


@triton.jit
def _store_out_of_bounds(ptr):
    tl.store(ptr + (1 << 40), 1.0)


def illegal_address() -> None:
    buf = torch.zeros(1, dtype=torch.float32, device=current())
    _store_out_of_bounds[(1,)](buf)
    torch.cuda.synchronize()  # raises here: the fault is asynchronous until a sync
    raise RuntimeError("the out-of-bounds store raised no CUDA error")  # (never seen on a real GPU)
