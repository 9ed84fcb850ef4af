"""Every private torch and megatron call mindspeed-ha makes, each behind a version gate.

Stable process groups (comm/groups.py) register their own ``ProcessGroup`` objects in torch's c10d
world, and recovery reads a few internals of megatron-core's distributed optimizer and checkpoint
writer. None of that is public API, so nothing else in the package touches it: it calls the
functions here. ``check()`` runs on every rank before anything is built and refuses (exit 2) a
torch or megatron-core whose internals are not the ones these functions use, naming what is
missing and the versions CI tests.

Tested (CI): torch 2.13.0 (the whole suite), 2.11.0 and 2.15.0 (a whole-job subset, CUDA builds on a
machine without a GPU); megatron-core 0.16.1. 2.14 is admitted and was tested until 2.15 took its place
(a warning says it is not now).
"""
from __future__ import annotations

import datetime
import re
import warnings
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

TESTED_TORCH = ("2.11.0", "2.13.0", "2.15.0")
TESTED_MEGATRON_CORE = ("0.16.1",)


class CompatError(RuntimeError):
    pass


def _version(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


TORCH = _version(torch.__version__)

# ---- torch.distributed's registry of process groups (c10d._world) -------------------------------
# torch 2.13 gathered the registration of a new group into ``_register_pg_in_world``; before it,
# new_group wrote the same tables itself.
_HAS_REGISTER_PG_IN_WORLD = TORCH >= (2, 13)
_WORLD_TABLES = ("pg_map", "pg_names", "pg_backend_config", "pg_group_ranks", "tags_to_pg", "pg_to_tag",
                 "pg_coalesce_state")


def default_group():
    """The job's default group as torch holds it (None before init_process_group)."""
    return c10d._world.default_pg


def set_default_group(pg) -> None:
    c10d._world.default_pg = pg


def group_store(pg):
    """The store ``pg`` met over (what torch registered with it)."""
    return c10d._world.pg_map[pg][1]


def registered_groups() -> list:
    return list(c10d._world.pg_map.keys())


def register_group(pg, backend: str, store, name: str, rank_mapping: dict[int, int]) -> None:
    """Make ``pg`` a group torch knows (its rank mapping, name, backend and tag), as new_group does."""
    # BackendConfig takes a backend's plain name as well (it calls str() on it first)
    config = str(c10d.BackendConfig(backend))  # type: ignore[arg-type]
    group_name = cast("GroupName", name)  # torch's NewType over str (absent from older torch)
    if _HAS_REGISTER_PG_IN_WORLD:
        c10d._register_pg_in_world(pg, backend_name=backend, store=store, group_name=group_name,
                                   backend_config=config, rank_mapping=rank_mapping)
        return
    w = c10d._world
    w.pg_map[pg] = (backend, store)
    w.pg_names[pg] = group_name
    w.pg_backend_config[pg] = config
    c10d._register_process_group(group_name, pg)
    w.pg_group_ranks[pg] = rank_mapping
    tag = f"ptd:{name}"
    w.tags_to_pg.setdefault(tag, []).append(pg)
    w.pg_to_tag[pg] = tag


def unregister_group(pg) -> None:
    """Remove every trace of ``pg`` from torch's tables (it is being replaced or dropped)."""
    w = c10d._world
    name = w.pg_names.pop(pg, None)
    if name is not None:
        c10d._unregister_process_group(name)
    for table in (w.pg_map, w.pg_backend_config, w.pg_group_ranks, w.pg_to_tag):
        table.pop(pg, None)
    for members in w.tags_to_pg.values():
        while pg in members:
            members.remove(pg)


def is_placeholder_work(work) -> bool:
    """The handle torch returns for an op recorded inside a coalescing block (nothing to wait on)."""
    return isinstance(work, c10d._IllegalWork)


def coalescing(group) -> bool:
    """A coalescing block is open on ``group``: its collectives are recorded, not issued."""
    return group in c10d._world.pg_coalesce_state


def drop_coalescing(group) -> None:
    """Forget a coalescing block's recorded ops (torch leaves them behind when the block raises)."""
    c10d._world.pg_coalesce_state.pop(group, None)


def resolve_group(group):
    return group or c10d._get_default_group()


# ---- communicators -----------------------------------------------------------------------------
def make_communicator(store, rank: int, size: int, backend: str, timeout: datetime.timedelta,
                      options: Any = None, device: torch.device | None = None):
    """A ProcessGroup of one backend over ``store`` (what new_group builds inside, without registering
    anything): gloo for CPU tensors, NCCL for CUDA ones, HCCL for NPU ones (the emulated NCCL of drills
    is made over a gloo one by ``comm.groups.make_communicator``). ``options``: the backend's options
    the group was made with (Megatron's ``pg_options``; NCCL's and HCCL's are kept, with ``timeout``
    set in them); ``device``: the rank's device, to which an NCCL communicator is connected here and
    now (as torch's own groups are when ``init_process_group`` is given a ``device_id``) rather than in
    its first collective. Gloo connects every member at construction anyway."""
    pg = dist.ProcessGroup(store, rank, size)
    inner: Any
    if backend == "nccl":
        opts = options if isinstance(options, dist.ProcessGroupNCCL.Options) else dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        inner = dist.ProcessGroupNCCL(store, rank, size, opts)
        kind, device_type = dist.ProcessGroup.BackendType.NCCL, "cuda"
    elif backend == "gloo":
        inner = dist.ProcessGroupGloo(store, rank, size, gloo_options(timeout))
        kind, device_type = dist.ProcessGroup.BackendType.GLOO, "cpu"
    elif backend == "hccl":
        # ASCEND (unverified: no NPU here): torch_npu's communicator, registered as a custom backend
        # for NPU tensors, as torch_npu's own group helper does.
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # type: ignore[import-not-found]
        hccl_opts = options if isinstance(options, ProcessGroupHCCL.Options) else ProcessGroupHCCL.Options()
        hccl_opts._timeout = timeout
        inner = ProcessGroupHCCL(store, rank, size, hccl_opts)
        kind, device_type = dist.ProcessGroup.BackendType.CUSTOM, "npu"
    else:
        raise RuntimeError(f"mindspeed-ha cannot rebuild {backend!r} process groups (gloo, nccl and hccl only)")
    pg._set_default_backend(kind)
    pg._register_backend(torch.device(device_type), kind, inner)
    if backend == "nccl" and device is not None and device.type == "cuda":
        # torch's own eager path (distributed_c10d's _new_process_group_helper with a device_id):
        # ncclCommInitRank now, for the device the collectives will use, instead of in the first one
        inner.eager_connect_single_device(device)
    return pg


_gloo_devices: dict[tuple[int, str], list] = {}  # (pid, GLOO_SOCKET_IFNAME) -> this process's gloo devices


def gloo_options(timeout: datetime.timedelta):
    """A gloo communicator's options, as torch's ``ProcessGroupGloo(store, rank, size, timeout)`` makes
    them (a device per interface named in GLOO_SOCKET_IFNAME, else the host name's; two threads per
    device), except that the devices are made once per process and shared by every communicator it
    makes: torch makes new ones for each, and a device took 10 ms to make here (the host name's
    lookup and a listening socket) against 0.1 ms for the rest of a one-member communicator, most
    of a recovery's reconnection of some thirty groups. A gloo device serves any number of
    communicators (its listener tells their connections apart). Not across a fork: a device's event
    loop is a thread of the process that made it."""
    import os
    ifnames = os.environ.get("GLOO_SOCKET_IFNAME", "")
    devices = _gloo_devices.get((os.getpid(), ifnames))
    if devices is None:
        gloo = dist.ProcessGroupGloo
        devices = ([gloo.create_device(interface=i) for i in ifnames.split(",") if i] if len(ifnames) > 1
                   else [gloo.create_default_device()])
        _gloo_devices.clear()  # (another process's, inherited through a fork: not usable here)
        _gloo_devices[(os.getpid(), ifnames)] = devices
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (not in torch's stub)
    opts._devices, opts._timeout, opts._threads = devices, timeout, 2 * len(devices)
    return opts


# ---- devices -----------------------------------------------------------------------------------
# torch's own count, taken before the CPU shim replaces it (this module is imported before any patch):
# it asks NVML first, so the process can still fork (a spare template) without a CUDA context.
_cuda_device_count = torch.cuda.device_count


def cuda_device_count() -> int:
    """GPUs visible to this process (0 without a driver, also on a CUDA build of torch)."""
    try:
        return int(_cuda_device_count())
    except RuntimeError:
        return 0


def nccl_version() -> tuple | None:
    """The NCCL this process runs: the loaded library's ``ncclGetVersion``, since
    ``torch.cuda.nccl.version()`` is the version torch was built with (a newer libnccl.so.2 loaded in
    its place, e.g. through LD_PRELOAD, reports the old one there); torch's figure where no library
    answers."""
    try:
        import ctypes
        lib = ctypes.CDLL("libnccl.so.2")  # (the one already loaded, if any: same soname)
        code = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(code)) == 0 and code.value > 0:
            v = code.value  # NCCL >= 2.9 encodes major*10000 + minor*100 + patch
            return (v // 10000, v % 10000 // 100, v % 100)
    except (OSError, AttributeError):
        pass
    try:
        return tuple(torch.cuda.nccl.version())
    except Exception:
        return None


# ---- megatron-core's distributed optimizer ---------------------------------------------------
def init_optimizer_state(inner) -> None:
    """Allocate Adam's state (with ``step``) before anything is loaded or copied into it."""
    inner._init_optimizer_states_with_dummy_values()


def copy_main_to_model_params(inner) -> None:
    inner._copy_main_params_to_model_params()


def param_name(inner, model_param) -> str:
    """megatron's name for ``model_param`` (its module path, experts numbered job-wide). An
    interleaved pipeline's chunks repeat their module paths, which megatron refuses to name: there
    each name starts with its chunk (``model0.``, ``model1.``, as in a checkpoint)."""
    if len(inner.model_chunks) == 1:
        return inner._param_name(model_param)
    names = getattr(inner, "_ha_param_names", None)
    if names is None:
        from megatron.core.optimizer.distrib_optimizer import handle_experts_in_state_dict
        experts = inner.model_chunks[0].config.num_moe_experts
        names = inner._ha_param_names = {
            p: f"model{i}.{n}" for i, chunk in enumerate(inner.model_chunks)
            for n, p in handle_experts_in_state_dict(dict(chunk.named_parameters()), experts).items()}
    return names[model_param]


def param_names(inner) -> dict:
    """Every model parameter of ``inner`` -> its ``param_name``."""
    return {p: param_name(inner, p) for chunk in inner.model_chunks for p in chunk.parameters()}


def param_range(inner, model_param):
    """The range of ``model_param``'s flattened elements this rank's shard holds."""
    return inner._get_model_param_range_map(model_param)["param"]


# megatron-core 0.16.1 hands a precision-aware optimizer's ``set_scaled_state`` every key of a
# dp_reshardable checkpoint's entry when it loads one, its bookkeeping included: Transformer Engine's
# FusedAdam (and the drill's) fails on 'padding'. Those keys are dropped on the way in.
_CHECKPOINT_BOOKKEEPING = ("padding", "gbuf_local_start", "gbuf_local_end")


def precision_aware_load_fix() -> list:
    """(owner, attr, replacement) for megatron-core's ``_set_main_param_and_optimizer_states``; none
    where the method is not there (another megatron-core)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    original = getattr(DistributedOptimizer, "_set_main_param_and_optimizer_states", None)
    if original is None:
        return []

    def set_main_param_and_optimizer_states(self, model_param, tensors):
        return original(self, model_param, {k: v for k, v in tensors.items() if k not in _CHECKPOINT_BOOKKEEPING})
    return [(DistributedOptimizer, "_set_main_param_and_optimizer_states", set_main_param_and_optimizer_states)]


# ---- megatron-core's checkpoint writer ---------------------------------------------------------
def writer_queue():
    """The results queue dist_checkpointing's async writer shares between saves (None: not made)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    return fa._results_queue


def set_writer_queue(queue) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    fa._results_queue = queue


# ---- Megatron-LM -------------------------------------------------------------------------------
def program_start_time(pretrain_module) -> float:
    return pretrain_module._PROGRAM_START_TIME


# ---- the check ---------------------------------------------------------------------------------
def _missing_torch() -> list[str]:
    missing = [f"torch.distributed.distributed_c10d.{n}" for n in
               ("_world", "_register_process_group", "_unregister_process_group", "_IllegalWork",
                "_get_default_group", "BackendConfig") if not hasattr(c10d, n)]
    if _HAS_REGISTER_PG_IN_WORLD and not hasattr(c10d, "_register_pg_in_world"):
        missing.append("torch.distributed.distributed_c10d._register_pg_in_world")
    world = getattr(c10d, "_world", None)
    if world is not None:
        missing += [f"c10d._world.{t}" for t in _WORLD_TABLES if not hasattr(world, t)]
    missing += [f"ProcessGroup.{m}" for m in ("_set_default_backend", "_register_backend")
                if not hasattr(dist.ProcessGroup, m)]
    if dist.is_gloo_available() and not hasattr(dist.ProcessGroupGloo, "_Options"):
        missing.append("ProcessGroupGloo._Options")
    return missing


def _missing_megatron() -> list[str]:
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    except ImportError as e:
        return [f"megatron-core ({e})"]
    missing = [f"DistributedOptimizer.{m}" for m in
               ("_init_optimizer_states_with_dummy_values", "_copy_main_params_to_model_params", "_param_name",
                "_get_model_param_range_map") if not hasattr(DistributedOptimizer, m)]
    if not hasattr(fa, "_results_queue"):
        missing.append("megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue")
    return missing


def megatron_core_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "not installed"


def check() -> None:
    """Refuse (CompatError) a torch or megatron-core without the internals used here; warn once for a
    version CI does not test that has them."""
    missing = _missing_torch() + _missing_megatron()
    versions = f"torch {torch.__version__}, megatron-core {megatron_core_version()}"
    if missing:
        raise CompatError(
            f"{versions} lacks what mindspeed-ha needs: {', '.join(missing)}. Install a tested pair: "
            f"torch {' / '.join(TESTED_TORCH)} with megatron-core {' / '.join(TESTED_MEGATRON_CORE)} "
            f"(pip install 'torch=={TESTED_TORCH[1]}' 'megatron-core=={TESTED_MEGATRON_CORE[0]}')")
    tested_torch = {_version(v) for v in TESTED_TORCH}
    tested_core = {_version(v) for v in TESTED_MEGATRON_CORE}
    if TORCH not in tested_torch or _version(megatron_core_version()) not in tested_core:
        warnings.warn(f"mindspeed-ha: {versions} is not a tested combination (tested: torch "
                      f"{', '.join(TESTED_TORCH)}; megatron-core {', '.join(TESTED_MEGATRON_CORE)})", stacklevel=2)
