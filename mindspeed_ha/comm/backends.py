"""What the engine needs to know of a collective backend: whether it blocks the calling thread (gloo)
or is stream-ordered (NCCL, HCCL), and which backend a group runs a tensor's collectives on.

A stream-ordered backend returns at once and completes later; a stop does not raise there: aborting
its communicators makes the collectives in flight return with whatever they had. The engine treats
such backends alike (``comm.interruptible``): it waits for their work where the caller would, tracks
what is in flight, aborts what is still pending after a stop's grace, and consumes no result past a
commit point (``interruptible.commit_point``) once an abort may have cut one short.

``EMULATED_NCCL`` is a CPU backend with NCCL's semantics for drills (``comm.emulated_nccl``): a job
runs on it with ``MINDSPEED_HA_EMULATE_NCCL=1``.
"""
from __future__ import annotations

import os
from typing import Mapping, MutableMapping

EMULATED_NCCL = "emulated_nccl"
EMULATE_ENV = "MINDSPEED_HA_EMULATE_NCCL"
STREAM_ORDERED = ("nccl", "hccl", EMULATED_NCCL)
DEVICE_OF = {"nccl": "cuda", "hccl": "npu", EMULATED_NCCL: "cpu", "gloo": "cpu"}  # where its tensors live


def emulating_nccl(env: Mapping[str, str] | None = None) -> bool:
    """A CPU job runs its collectives on the NCCL-semantics backend instead of gloo."""
    env = os.environ if env is None else env
    return env.get(EMULATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def stream_ordered(name: str) -> bool:
    return str(name).lower() in STREAM_ORDERED


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
    if name in STREAM_ORDERED or name == "gloo":
        return name
    if ":" in name:
        return for_device(name, "cuda") if "cuda:" in name else for_device(name, "cpu")
    return "gloo" if name == "cpu" else name


# torch's NCCL error handling (TORCH_NCCL_ASYNC_ERROR_HANDLING, ProcessGroupNCCL.hpp): 0 none,
# 1 TearDown (abort, then end the process), 2 CleanUpOnly (abort the communicators, keep the process),
# 3 SkipCleanUp (end the process): the default. Under 1 and 3 a collective that times out or meets
# a peer's error ends a survivor, often before the controller's stop reaches it.
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
KEEPS_PROCESS = ("0", "2")


def keep_survivors(env: MutableMapping[str, str] | None = None) -> None:
    """With HA on: NCCL's watchdog aborts a failed collective's communicator and leaves the process
    to the recovery (CleanUpOnly; 0, no handling, is kept too). Before any NCCL group exists."""
    environ: MutableMapping[str, str] = os.environ if env is None else env
    if environ.get(NCCL_ERROR_HANDLING, "").strip() not in KEEPS_PROCESS:
        environ[NCCL_ERROR_HANDLING] = "2"
