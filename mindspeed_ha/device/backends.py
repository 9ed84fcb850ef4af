"""What the engine needs to know of a collective backend: whether it blocks the calling thread (gloo)
or is stream-ordered (NCCL, HCCL), and which backend a group runs a tensor's collectives on.

A stream-ordered backend returns at once and completes later; a stop does not raise there: aborting
its communicators makes the collectives in flight return with whatever they had. The engine treats
such backends alike (``comm.interruptible``): it waits for their work where the caller would, tracks
what is in flight, aborts what is still pending after a stop's grace, and consumes no result past a
commit point (``Stop.commit_point``) once an abort may have cut one short.

``EMULATED_NCCL`` is a CPU backend with NCCL's semantics for drills (``comm.emulated_nccl``): a job
runs on it with ``MINDSPEED_HA_EMULATE_NCCL=1``.
"""
from __future__ import annotations

import os
from typing import MutableMapping

from mindspeed_ha.device.accelerator import Accelerator
from mindspeed_ha.device.accelerators import ACCELERATORS, HOST, of_backend
from mindspeed_ha.device.accelerators.emulated_nccl import EMULATE_ENV, EMULATED_NCCL, emulating_nccl

__all__ = ["EMULATED_NCCL", "EMULATE_ENV", "emulating_nccl", "accelerator", "stream_ordered", "abortable",
           "device_type", "stream_kind", "for_device", "canonical", "nccl_environment"]

def accelerator(name: str) -> Accelerator | None:
    """The accelerator of backend ``name`` (None: a backend the engine does not know)."""
    return of_backend(name)


def stream_ordered(name: str) -> bool:
    acc = of_backend(name)
    return acc is not None and acc.stream_ordered


def abortable(name: str) -> bool:
    """A group of ``name`` (any spelling ``canonical`` reads) has communicators whose abort frees them."""
    acc = of_backend(canonical(name))
    return acc is not None and acc.abortable


def device_type(name: str) -> str:
    """Where backend ``name``'s tensors live (the host for one the engine does not know)."""
    acc = of_backend(name)
    return (acc or HOST).type


def stream_kind(backend: str) -> str | None:
    """The device type of a group of ``backend``'s stream-ordered backend (a barrier's: nothing to
    move says which), devices before the host; None where it has none."""
    for acc in ACCELERATORS:
        own = of_backend(for_device(backend, acc.type))
        if own is not None and own.stream_ordered and own.type == acc.type:
            return acc.type
    return None


def for_device(backend: str, device_type: str) -> str:
    """The backend a group of ``backend`` (a name, or torch's ``"cpu:gloo,cuda:nccl"``) runs a
    collective of ``device_type`` tensors on."""
    name = str(backend).lower()
    if ":" not in name:
        return name
    table = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    return table.get(device_type, next(iter(table.values()), name))


def canonical(name: str) -> str:
    """A backend's name as the engine's groups record it: torch's names as they are; a multi-device
    spec (``cpu:gloo,cuda:nccl``) by its device backend."""
    name = str(name or "").lower()
    if of_backend(name) is not None:
        return name
    if ":" in name:
        return for_device(name, "cuda") if "cuda:" in name else for_device(name, "cpu")
    return "gloo" if name == "cpu" else name


# torch's NCCL error handling (TORCH_NCCL_ASYNC_ERROR_HANDLING, ProcessGroupNCCL.hpp): 0 none,
# 1 TearDown (abort, then end the process), 2 CleanUpOnly (abort the communicators, keep the process),
# 3 SkipCleanUp (end the process): the default. Under 1 and 3 a collective that times out or meets
# a peer's error ends a survivor, often before the controller's stop reaches it.
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NONBLOCKING = "TORCH_NCCL_USE_COMM_NONBLOCKING"
KEEPS_PROCESS = ("0", "2")

# How every NCCL communicator of a job with HA on is made, set before the first one exists (a user's
# own value is kept, but for the error handling's 1 and 3, which end survivors). Decided by reading
# NCCL's and torch's code (docs/nccl.md): no GPU run has shown them yet.
NCCL_DEFAULTS = (
    # The engine is the one that aborts, every communicator at once (comm.abort); the watchdog
    # only marks a failed collective's work (under 2 it aborts that group's communicators alone,
    # on its own thread: one group at a time is what waits on the device for the others).
    (NCCL_ERROR_HANDLING, "0"),
    # (Communicators stay blocking, torch's default: with non-blocking ones torch polls a coalesced
    # group's end and a pair's first connect under the communicator's mutex, the one its abort needs
    # before it sets NCCL's abort flag — an abort could then wait up to TORCH_NCCL_NONBLOCKING_TIMEOUT.
    # No GPU run has shown a survivor that only non-blocking ones free: docs/nccl.md.)
    # Every algorithm's peers connected when the communicator is made, not inside the first
    # collective that uses it, where a host thread can be held with no work to abort.
    ("NCCL_RUNTIME_CONNECT", "0"),
    # NVRx's rules for in-process restart: NVLS (multicast objects) off; the watchdog does not end
    # the process on a CUDA error (the recovery's entry sync finds a sticky one and ends it itself).
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0"),
    # torch >= 2.15 makes "nccl" groups of ProcessGroupNCCL2 (torchcomms) by default: one
    # implementation in the job, the one the engine rebuilds with and whose abort was read.
    ("TORCH_DIST_USE_NCCL2", "0"),
)


def nccl_environment(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """With HA on, before any NCCL group exists: the settings above (``NCCL_DEFAULTS``). Returns
    what the job runs with, for its start event; a user's error handling that ends survivors is
    replaced, and said."""
    environ: MutableMapping[str, str] = os.environ if env is None else env
    mode = environ.get(NCCL_ERROR_HANDLING, "").strip()
    if mode and mode not in KEEPS_PROCESS:
        from mindspeed_ha.events import get_logger
        get_logger("comm").warning("%s=%s would end a survivor whose collective fails before the recovery reaches "
                                   "it: mindspeed-ha sets 0 (no handling: it aborts the communicators itself)",
                                   NCCL_ERROR_HANDLING, mode)
        environ[NCCL_ERROR_HANDLING] = "0"
    if environ.get(NONBLOCKING, "").strip() == "1":
        from mindspeed_ha.events import get_logger
        get_logger("comm").warning("%s=1 kept: with non-blocking communicators torch polls their set-up and a "
                                   "coalesced group's end under the communicator's mutex, which a stop's abort "
                                   "needs first: a survivor's abort can wait up to TORCH_NCCL_NONBLOCKING_TIMEOUT "
                                   "(%s) before it frees the rank (unset it for torch's default, blocking)",
                                   NONBLOCKING, environ.get("TORCH_NCCL_NONBLOCKING_TIMEOUT", "unset: torch's default"))
    for name, value in NCCL_DEFAULTS:
        environ.setdefault(name, value)
    return {name: environ[name] for name, _ in NCCL_DEFAULTS} | (
        {NONBLOCKING: environ[NONBLOCKING]} if NONBLOCKING in environ else {})
