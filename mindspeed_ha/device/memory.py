"""How much memory a recovery's step allocates beside what the rank already holds: the figure that
decides whether it fits a GPU at scale (a repair that allocates a second shard does not, at 70B).

``PeakExtra`` measures the peak above the level at its start, for the rank's device:
- CUDA: the caching allocator's own counters (``max_memory_allocated`` after a peak reset), which
  count tensors, not the cache;
- NPU (unverified: no NPU here): torch_npu's counters of the same names;
- CPU: the process's resident set (Linux: ``VmHWM`` after resetting it through ``clear_refs``), and
  only under a fixed ``MALLOC_MMAP_THRESHOLD_`` (benchmarks/scale_costs.py sets one): then large
  tensors come and go with mappings of their own, where otherwise glibc reuses freed blocks unseen or
  holds them after they are freed (no figure then: None). Garbage is collected first, so that what
  was garbage already is not freed during the measure, masking what it allocates.

A measurement nests in none other of the same device (each resets the device's one peak counter).
"""
from __future__ import annotations

import gc
import os
import time

from mindspeed_ha import device

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def _proc_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakExtra:
    """``with PeakExtra() as m: ...`` then ``m.bytes``: the peak the block reached above its start (None
    where the device or the system gives no figure), and ``m.seconds``."""

    def __init__(self) -> None:
        self.bytes: int | None = None
        self.seconds = 0.0
        self._base: int | None = None
        self._counters = device.current_accelerator().memory_counters()  # (None: the process's own)

    def __enter__(self) -> "PeakExtra":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "PeakExtra":
        """(A measurement that spans calls: ``start`` here, ``stop`` there.)"""
        self._t0 = time.perf_counter()
        if self._counters is not None:
            self._counters.reset_peak_memory_stats()
            self._base = int(self._counters.memory_allocated())
        elif os.environ.get("MALLOC_MMAP_THRESHOLD_"):
            gc.collect()
            try:
                with open(_CLEAR_REFS, "w") as f:
                    f.write("5")  # resets the peak resident set (VmHWM) to the current one
                rss = _proc_kib("VmRSS")
                self._base = None if rss is None else rss * 1024
            except OSError:
                self._base = None
        return self

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self._t0
        if self._base is None:
            return
        if self._counters is not None:
            peak = int(self._counters.max_memory_allocated())
        else:
            hwm = _proc_kib("VmHWM")
            if hwm is None:
                return
            peak = hwm * 1024
        self.bytes = max(0, peak - self._base)
