"""Fault classes: what kind of failure an exception raised in a training step is.

``classify(exc)`` -> ``"memory"`` (hardware memory corruption: UCE / multi-bit ECC; repairable from a
replica on Ascend), ``"comm"`` (a collective or link failed, or was stopped on purpose) or
``"other"`` (everything else, out-of-memory included). ``process_fatal(exc)``: the device context
is poisoned (CUDA sticky errors such as uncorrectable ECC), so the process must be restarted even
when its memory fault could otherwise be repaired in place.
"""
from __future__ import annotations

from typing import Iterator

# The exit code of a rank that ends itself because its device context is poisoned: its agent
# reports the exit, and recover replaces the process (its twin holds its shard).
from .exitcodes import PROCESS_FATAL as PROCESS_FATAL_EXIT  # noqa: F401


class MemoryFault(RuntimeError):
    """Hardware memory corruption (UCE). Messages carry the "UCE ERROR" marker as torch_npu's do."""


class CommFault(RuntimeError):
    """A communication failure raised by mindspeed-ha itself (e.g. an injected ``comm`` fault)."""


class CollectiveStopped(RuntimeError):
    """Raised in the thread blocked in (or entering) a collective after a stop was requested
    (``comm.stop``). ``never_entered``: the faulted ranks (of the default group) that never entered
    the collective it left, which is why it left before its grace (empty: left at its grace, or at
    its entry)."""

    def __init__(self, *args: object, never_entered: list[int] | None = None) -> None:
        super().__init__(*args)
        self.never_entered = list(never_entered or [])


# Substrings, matched case-insensitively on the message of the exception and of its causes.
MEMORY_MARKERS = (
    "uce error",                  # torch_npu: uncorrectable error in HBM
    "hbm multi bit ecc",          # Ascend HBM multi-bit ECC
    "uncorrectable ecc",          # CUDA: "uncorrectable ECC error encountered"
    "suspect mem error",          # torch_npu
)
COMM_MARKERS = (
    "connection closed by peer", "connection reset", "connection refused", "broken pipe",
    "pair closure", "gloo", "nccl error", "ncclremoteerror", "ncclsystemerror", "nccl watchdog",
    "hccl", "hccs link error", "processgroup", "process group", "collective operation timeout",
    "socket timeout", "force stop",  # torch_npu: a collective interrupted by stop_device
)
# CUDA errors that leave the context unusable ("sticky"): only a new process recovers. The messages
# are cudaGetErrorString's for the errors CUDA's runtime API documents as leaving "the process in an
# inconsistent state" (any further CUDA work returns the same error, the process must be relaunched).
# Whatever the message, a recovery's entry synchronizes the device and ends the process if that
# raises (RankSession.device_ready): an NCCL "unhandled cuda error" on a dead context ends there.
CUDA_STICKY_MARKERS = (
    "uncorrectable ecc error encountered",                       # cudaErrorECCUncorrectable
    "an illegal memory access was encountered",                  # cudaErrorIllegalAddress
    "the launch timed out and was terminated",                   # cudaErrorLaunchTimeout
    "device-side assert triggered",                              # cudaErrorAssert
    "hardware stack error",                                      # cudaErrorHardwareStackError
    "an illegal instruction was encountered",                    # cudaErrorIllegalInstruction
    "misaligned address",                                        # cudaErrorMisalignedAddress
    "operation not supported on global/shared address space",    # cudaErrorInvalidAddressSpace
    "invalid program counter",                                   # cudaErrorInvalidPc
    "unspecified launch failure",                                # cudaErrorLaunchFailure
)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _text(exc: BaseException) -> str:
    return " | ".join(f"{type(e).__name__}: {e}" for e in _chain(exc)).lower()


def classify(exc: BaseException) -> str:
    """``"memory"`` | ``"comm"`` | ``"other"`` for an exception raised in a training step."""
    import torch

    chain = list(_chain(exc))
    if any(isinstance(e, MemoryFault) for e in chain):
        return "memory"
    text = _text(exc)
    if any(m in text for m in MEMORY_MARKERS):
        return "memory"
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text:
        return "other"  # allocation failure, not corruption: nothing to repair from a replica

    comm_types = (CommFault, CollectiveStopped) + tuple(
        t for t in (getattr(torch.distributed, "DistError", None),) if t is not None)
    if any(isinstance(e, comm_types) for e in chain):
        return "comm"  # DistError covers DistBackendError, DistNetworkError, DistStoreError
    if any(m in text for m in COMM_MARKERS):
        return "comm"
    return "other"


def fault_kind(exc: BaseException) -> str:
    """The fault's kind as the controller names it: memory-error, comm-failure or other."""
    return {"memory": "memory-error", "comm": "comm-failure"}.get(classify(exc), "other")


def process_fatal(exc: BaseException) -> bool:
    """True when the device context is poisoned (CUDA sticky error, e.g. uncorrectable ECC)."""
    text = _text(exc)
    return any(m in text for m in CUDA_STICKY_MARKERS)
