"""Device evidence of a sub-healthy rank, read by each launcher agent from the driver (NVIDIA: NVML).

A device that still works but is going bad is worth leaving at a step boundary, before it fails in
the middle of one: its memory has rows waiting to be remapped or pages waiting to be retired (both
need a reset), its uncorrectable error count rose while the process lived on, the driver reported a
critical XID, or its corrected errors come in a storm. Each is turned into the same finding the
user's health hook gives (ranks, why); the controller logs ``sub_healthy`` and, with
``--ha-migrate-stragglers``, moves the rank to a spare.

NVML comes from ``nvidia-ml-py`` (the ``nvidia`` extra). Without it, without a driver, or without
GPUs the agent says so once and watches nothing: a CPU job is not a GPU job with its checks off.
Ascend has no equivalent public query that torch_npu exposes; there the health hook is the way in.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from ..events import get_logger

log = get_logger("launcher.devices")

# Corrected errors are corrected; only a burst of them within one check predicts trouble.
CORRECTED_STORM = 1000


class Reading(NamedTuple):
    corrected: int = 0     # volatile corrected ECC errors since the driver loaded
    uncorrected: int = 0   # volatile uncorrectable ECC errors
    pending: str = ""      # a repair that waits for a reset ("row remapping", "page retirement")
    xids: tuple = ()       # critical XIDs reported since the last reading


def judge(before: Reading, now: Reading) -> str | None:
    """Why a device with these two readings is sub-healthy, or None."""
    if now.xids:
        return "XID " + ", ".join(str(x) for x in now.xids)
    if now.uncorrected > before.uncorrected:
        return f"uncorrectable ECC errors +{now.uncorrected - before.uncorrected}"
    if now.pending:
        return f"{now.pending} pending (needs a reset)"
    if now.corrected - before.corrected >= CORRECTED_STORM:
        return f"corrected ECC errors +{now.corrected - before.corrected} within one check"
    return None


def visible_devices(env=os.environ) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (indices or UUIDs), None when unset (every device, in order)."""
    v = env.get("CUDA_VISIBLE_DEVICES")
    return None if v is None else [d.strip() for d in v.split(",") if d.strip()]


class DeviceHealth:
    """One agent's watch over its workers' GPUs; ``poll`` every ``interval_s`` like the health hook."""

    def __init__(self, nvml, handles: dict[int, object], interval_s: float, now: float):
        self.nvml, self.handles, self.interval = nvml, handles, float(interval_s)
        self.next_at = now + self.interval
        self.last = {lr: self._read(h) for lr, h in handles.items()}
        self.local_rank_of = {nvml.nvmlDeviceGetUUID(h): lr for lr, h in handles.items()}  # for XID events
        self.events = self._register()

    @classmethod
    def open(cls, local_ranks: int, interval_s: float, now: float) -> "DeviceHealth | None":
        """The watch over local ranks 0..local_ranks-1 (rank L uses visible device L), or None with the
        reason logged."""
        try:
            import pynvml as nvml
        except ImportError:
            log.info("device health: off (nvidia-ml-py is not installed; pip install mindspeed-ha[nvidia])")
            return None
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as e:
            log.info("device health: off (NVML: %s)", e)
            return None
        ids = visible_devices()
        ids = [str(i) for i in range(count)] if ids is None else ids
        handles = {}
        try:
            for lr, d in enumerate(ids[:local_ranks]):
                handles[lr] = (nvml.nvmlDeviceGetHandleByIndex(int(d)) if d.isdigit()
                               else nvml.nvmlDeviceGetHandleByUUID(d))
        except nvml.NVMLError as e:
            log.warning("device health: off (NVML cannot open the device of local rank %d: %s)", len(handles), e)
            nvml.nvmlShutdown()
            return None
        if not handles:
            log.info("device health: off (no GPU for this node's ranks)")
            nvml.nvmlShutdown()
            return None
        log.info("device health: NVML watches %d GPU(s) every %gs (ECC, pending repairs, XIDs)",
                 len(handles), interval_s)
        return cls(nvml, handles, interval_s, now)

    def poll(self, now: float, workers: dict) -> list[tuple[list[int], str]]:
        """``workers``: rank -> Worker. Returns [(global ranks, why)] for devices gone sub-healthy."""
        if now < self.next_at:
            return []
        self.next_at = now + self.interval
        xids = self._drain_xids()
        found = []
        for w in sorted(workers.values(), key=lambda w: w.rank):
            h = self.handles.get(w.local_rank)
            if h is None:
                continue
            reading = self._read(h)._replace(xids=tuple(xids.get(w.local_rank, ())))
            why = judge(self.last[w.local_rank], reading)
            self.last[w.local_rank] = reading
            if why:
                found.append(([w.rank], f"GPU of local rank {w.local_rank}: {why}"))
        return found

    def close(self) -> None:
        if self.events is not None:
            self.nvml.nvmlEventSetFree(self.events)
        self.nvml.nvmlShutdown()

    def _read(self, h) -> Reading:
        nv = self.nvml

        def ask(fn, *args, default=0):
            try:
                return fn(h, *args)
            except nv.NVMLError:  # not supported on this board, or ECC off: nothing to say
                return default

        pending = ""
        remapped = ask(nv.nvmlDeviceGetRemappedRows, default=None)
        if remapped is not None and remapped[2]:
            pending = "row remapping"
        elif ask(nv.nvmlDeviceGetRetiredPagesPendingStatus) == nv.NVML_FEATURE_ENABLED:
            pending = "page retirement"
        return Reading(
            corrected=ask(nv.nvmlDeviceGetTotalEccErrors, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            uncorrected=ask(nv.nvmlDeviceGetTotalEccErrors, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                            nv.NVML_VOLATILE_ECC),
            pending=pending)

    def _register(self):
        nv = self.nvml
        try:
            events = nv.nvmlEventSetCreate()
        except nv.NVMLError:
            return None
        for lr, h in self.handles.items():
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, events)
            except nv.NVMLError as e:  # some boards and containers cannot: ECC and repairs still count
                log.info("device health: no XID events for local rank %d (%s)", lr, e)
        return events

    def _drain_xids(self) -> dict[int, list[int]]:
        nv = self.nvml
        got: dict[int, list[int]] = {}
        if self.events is None:
            return got
        while True:
            try:
                ev = nv.nvmlEventSetWait_v2(self.events, 0)
            except nv.NVMLError:  # a timeout: nothing (more) is waiting
                return got
            lr = self.local_rank_of.get(nv.nvmlDeviceGetUUID(ev.device))
            if lr is not None:
                got.setdefault(lr, []).append(int(ev.eventData))
