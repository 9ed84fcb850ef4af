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


def _chain(exc: BaseException | None, handling: BaseException | None = None) -> Iterator[BaseException]:
    seen = {id(handling)} if handling is not None else set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _text(exc: BaseException, handling: BaseException | None = None) -> str:
    return " | ".join(f"{type(e).__name__}: {e}" for e in _chain(exc, handling)).lower()


def classify(exc: BaseException, handling: BaseException | None = None) -> str:
    """``"memory"`` | ``"comm"`` | ``"other"`` for an exception raised in a training step (``handling``:
    the exception that was being handled where ``exc`` was raised, which Python chains to it as its
    context: it and what it chains are not ``exc``'s, and are left out)."""
    import torch

    chain = list(_chain(exc, handling))
    if any(isinstance(e, MemoryFault) for e in chain):
        return "memory"
    text = _text(exc, handling)
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


def fault_kind(exc: BaseException, handling: BaseException | None = None) -> str:
    """The fault's kind as the controller names it: memory-error, comm-failure or other."""
    return {"memory": "memory-error", "comm": "comm-failure"}.get(classify(exc, handling), "other")


# The exceptions a user's step raises that are its own software's errors, not the machine's: a retry on
# the same data, or a restart from the same state, can only raise them again. The builtin classes a
# bug raises (an import, a name, a type, a value, a key or an index that is wrong, an assertion, a
# division by zero, a missing implementation, unbounded recursion). Everything else is a fault: a
# memory or communication error (whatever its class), a device error (torch raises those as
# RuntimeError and its subclasses), an allocation that failed, an I/O error, a lost process, a hang.
SOFTWARE_ERRORS: tuple[type[BaseException], ...] = (
    ArithmeticError, AssertionError, AttributeError, ImportError, LookupError, NameError,
    NotImplementedError, RecursionError, SyntaxError, TypeError, ValueError)
FAULT_CLASSES = ("setup", "software", "fault")


def fault_class(exc: BaseException, first_step: bool = False) -> str:
    """What an exception raised in a step is, for what recovery may do: ``"setup"``, an error of a
    rank's own (neither memory nor communication) in the job's first step, before any step completed
    (an import, a configuration, a data path: no recovery mends it, the job ends at once);
    ``"software"``, an error of the job's own code (``SOFTWARE_ERRORS``, neither memory nor
    communication): recovered once at most; ``"fault"``: anything else."""
    if classify(exc) != "other":
        return "fault"
    if first_step:
        return "setup"
    return "software" if isinstance(exc, SOFTWARE_ERRORS) else "fault"


# Where a traceback's frames are library code, not the job's: this package, torch, megatron (core and
# Megatron-LM's training loop), the standard library and installed packages.
def _library_roots() -> tuple[str, ...]:
    import os
    import sys
    import sysconfig
    here = os.path.dirname(os.path.abspath(__file__))
    roots = {here, os.path.join(os.path.dirname(here), "patches")}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(os.path.abspath(path))
    for name in ("torch", "megatron"):
        module = sys.modules.get(name)
        for path in list(getattr(module, "__path__", []) or []):
            roots.add(os.path.abspath(path))
    return tuple(sorted(roots))


def user_frame(exc: BaseException) -> str:
    """The innermost frame of ``exc``'s traceback in the job's own code (``file:line in function``),
    else the innermost frame of all; "" without a traceback."""
    import os
    import traceback
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if not frames:
        return ""
    roots = _library_roots()
    own = [f for f in frames if not os.path.abspath(f.filename).startswith(roots)]
    f = (own or frames)[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def process_fatal(exc: BaseException) -> bool:
    """True when the device context is poisoned (CUDA sticky error, e.g. uncorrectable ECC)."""
    text = _text(exc)
    return any(m in text for m in CUDA_STICKY_MARKERS)
