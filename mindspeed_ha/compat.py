"""Every private torch and megatron call mindspeed-ha makes, each behind a version gate.

Stable process groups (comm/groups.py) register their own ``ProcessGroup`` objects in torch's c10d
world, and recovery reads a few internals of megatron-core's distributed optimizer and checkpoint
writer, and meets its releases' differences (the table above the megatron-core section). None of
that is public API, so nothing else in the package touches it: it calls the functions here.
``check()`` runs on every rank before anything is built and refuses (exit 2, one line) a
megatron-core outside the supported range, or a torch or megatron-core whose internals are not the
ones these functions use, naming what is missing and the versions CI tests.

Tested (CI): torch 2.13.0 (the whole suite), 2.11.0 and 2.15.0 (a whole-job subset, CUDA builds on a
machine without a GPU); 2.14 is admitted and was tested until 2.15 took its place (a warning says it
is not now). megatron-core 0.16.1 (the whole suite), 0.12.1 and 0.19.2 (the whole-job drills of every
strategy, ``pytest -m megatron_release``).
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


# ---- megatron-core: which release ------------------------------------------------------------
# What the engine relies on in megatron-core, and how each release gives it (each row a gate below; the
# rest of the package calls these functions and never asks which release it runs on):
#
#   what                                  0.12          0.13          0.14          0.15-0.18     0.19
#   the chunk of an interleaved stage     parallel_state's virtual rank (0.12); a ``vp_stage`` argument (0.13+)
#   the twins' (inter-instance) group     a module global (0.12); ``get_inter_distributed_optimizer_instance_group`` (0.13+)
#   optimizer state before a load/copy    a step on zero gradients      ``_init_optimizer_states_with_dummy_values``
#   fp8 quantisation without TE           skipped here  megatron skips it when there is nothing to quantise
#   checkpoint's optimizer layout         ``fully_sharded_model_space``               ``dp_reshardable``
#   that layout named by                  argument      metadata (and the checkpoint's content metadata)
#   a checkpoint entry's missing keys     kept (Adam's ``step``)                      bookkeeping dropped
#   a synchronous save                    written in place here (it forked a writer)  in place (megatron's)
#   torch's ``_write_item`` format        passed here   passed by megatron
#   numpy                                 < 2 (``numpy.product``)     any
#   answers of collectives it keeps       none                                                      grad-norm groups
#   a shard's element range, main->model  ``_get_model_param_range_map``, ``_copy_main_params_to_model_params``
#   the async writer's results queue      ``filesystem_async._results_queue``
#
# Releases before 0.12 lack the replica optimizer itself (``num_distributed_optimizer_instances``);
# 0.20 is not out: it is admitted when CI has run it.
MEGATRON_CORE_RANGE = ((0, 12), (0, 19))  # the first and the last minor release admitted
TESTED_MEGATRON_CORE = ("0.12.1", "0.16.1", "0.19.2")
MEGATRON_CORE_PIN = "megatron-core>=0.12.1,<0.20"

_megatron_core: dict[str, tuple[int, int, int]] = {}  # package_info's path -> its release


def megatron_core() -> tuple[int, int, int]:
    """The release of the ``megatron.core`` this process imports, from its own ``package_info`` (a
    Megatron-LM checkout on MEGATRON_LM_PATH carries its own, whatever pip installed beside it)."""
    import importlib.util
    spec = importlib.util.find_spec("megatron.core.package_info")
    origin = spec.origin if spec is not None and spec.origin else ""
    if origin not in _megatron_core:
        from megatron.core import package_info
        _megatron_core[origin] = (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))
    return _megatron_core[origin]


def megatron_core_version() -> str:
    try:
        return ".".join(map(str, megatron_core()))
    except ImportError:
        return "not installed"


def _at_least(*release: int) -> bool:
    return megatron_core()[:len(release)] >= release


# ---- megatron-core's public interface, where its releases differ -------------------------------
def pipeline_chunk(vp_stage: int | None) -> tuple[bool, bool, dict]:
    """(pre_process, post_process, GPTModel's keywords) for the model chunk ``vp_stage`` of this
    pipeline stage (None: not interleaved). From 0.13 the chunk is an argument everywhere
    (``vp_stage``); 0.12 reads parallel_state's virtual rank instead, set before the chunk is built as
    Megatron-LM 0.12's ``get_model`` sets it."""
    from megatron.core import parallel_state as ps
    if _at_least(0, 13):
        return (ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage), {"vp_stage": vp_stage})
    if vp_stage is not None:
        ps.set_virtual_pipeline_model_parallel_rank(vp_stage)
    return ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(), {}


def inter_instance_group():
    """The group across the distributed optimizer's instances (a shard's twins): parallel_state's
    getter from 0.13, its module global in 0.12."""
    from megatron.core import parallel_state as ps
    if _at_least(0, 13):
        return ps.get_inter_distributed_optimizer_instance_group()
    return ps._INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP


# ---- megatron-core's distributed optimizer ---------------------------------------------------
def init_optimizer_state(inner) -> None:
    """Allocate the optimizer's state (Adam's moments and ``step``) before anything is loaded or
    copied into it: a step on zero gradients, whose values are overwritten next (what megatron-core
    0.14+ does in ``_init_optimizer_states_with_dummy_values``; 0.12 and 0.13 allocate inside
    ``load_state_dict`` only)."""
    if _at_least(0, 14):
        inner._init_optimizer_states_with_dummy_values()
        return
    for group in inner.optimizer.param_groups:
        for param in group["params"]:
            if param.numel():
                param.grad = torch.zeros_like(param)
    inner.optimizer.step()
    inner.optimizer.zero_grad()


def copy_main_to_model_params(inner) -> None:
    inner._copy_main_params_to_model_params()


def param_range(inner, model_param):
    """The range of ``model_param``'s flattened elements this rank's shard holds."""
    return inner._get_model_param_range_map(model_param)["param"]


# megatron-core 0.19 asks its ranks once whether any holds parameters of a separately clipped
# grad-norm group (``has_grad_norm_group``: an all-reduce at the first clip) and keeps the answer on
# each optimizer, the chained one and each it chains.
_COLLECTIVE_ANSWERS = ("_has_grad_norm_group_cache",)


def forget_collective_answers(optimizer) -> None:
    """Drop what megatron-core's ``optimizer`` keeps of a collective it issues only when it has no
    answer yet. A restarted or rebuilt rank's optimizer has none and issues it in its first step; a
    kept rank's would not, and the job would sit in different collectives: every rank forgets them as
    a recovery ends. Nothing to forget before 0.19."""
    if not _at_least(0, 19):
        return
    for opt in [optimizer, *(getattr(optimizer, "chained_optimizers", None) or [])]:
        for attr in _COLLECTIVE_ANSWERS:
            if getattr(opt, attr, None):
                setattr(opt, attr, None)


def checkpoint_entry_fix() -> list:
    """(owner, attr, replacement) for megatron-core's ``_set_main_param_and_optimizer_states``, which
    copies a checkpoint's entry for one parameter into the live state, by release:

    - 0.15 and later (dp_reshardable): a precision-aware optimizer's ``set_scaled_state`` is handed
      every key of the entry, its bookkeeping included: Transformer Engine's FusedAdam (and the drill's)
      fails on 'padding'. Those keys are dropped on the way in.
    - before 0.15 (the model-space layout): the entry leaves out torch Adam's per-parameter ``step``,
      which the loader has just set from the param groups, while the copy walks every key of the live
      state (KeyError: 'step' on a CPU, where there is no fused Adam). A key the entry lacks keeps its
      value."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    original = DistributedOptimizer._set_main_param_and_optimizer_states

    if _at_least(0, 15):
        def set_main_param_and_optimizer_states(self, model_param, tensors):
            return original(self, model_param, {k: v for k, v in tensors.items() if k not in _CHECKPOINT_BOOKKEEPING})
    else:
        def set_main_param_and_optimizer_states(self, model_param, tensors):
            live = self._get_main_param_and_optimizer_states(model_param)
            return original(self, model_param, {**{k: v for k, v in live.items() if k not in tensors}, **tensors})
    return [(DistributedOptimizer, "_set_main_param_and_optimizer_states", set_main_param_and_optimizer_states)]


_CHECKPOINT_BOOKKEEPING = ("padding", "gbuf_local_start", "gbuf_local_end")


def fp8_without_te_fix() -> list:
    """(owner, attr, replacement) for megatron-core 0.12's ``quantize_param_shard`` without Transformer
    Engine: it raises "Invalid Transformer Engine version for FP8 distributed optimizer" at every
    optimizer step, also with no fp8 parameter to quantize; from 0.13 it returns when there is none,
    as it does here."""
    import importlib.util
    if _at_least(0, 13) or importlib.util.find_spec("transformer_engine") is not None:
        return []
    from megatron.core.optimizer import distrib_optimizer
    original = distrib_optimizer.quantize_param_shard

    def quantize_param_shard(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return original(model_params, *args, **kwargs)
    return [(distrib_optimizer, "quantize_param_shard", quantize_param_shard)]


def distrib_optimizer_fixes() -> list:
    """What the engine mends in megatron-core's distributed optimizer, by release (each gated)."""
    return checkpoint_entry_fix() + fp8_without_te_fix()


# ---- megatron-core's checkpoints ---------------------------------------------------------------
def optimizer_sharding() -> str:
    """How the distributed optimizer's state is laid out in a checkpoint: one that loads into another
    data-parallel size (a dump resumed on fewer ranks, a reshard): ``dp_reshardable`` from 0.15, the
    model-space layout before it (0.16 refuses the latter on CPU: "flattened_range is not supported")."""
    return "dp_reshardable" if _at_least(0, 15) else "fully_sharded_model_space"


def optimizer_sharded_state_dict(optimizer, model_sd: dict, is_loading: bool) -> dict:
    """``optimizer.sharded_state_dict`` in ``optimizer_sharding()``'s layout (named by argument in 0.12,
    by metadata from 0.13)."""
    if _at_least(0, 13):
        return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=checkpoint_metadata())
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, sharding_type=optimizer_sharding())


def checkpoint_metadata() -> dict:
    return {"distrib_optim_sharding_type": optimizer_sharding()}


def save_checkpoint(sd: dict, path: str, validate_access_integrity: bool) -> None:
    """``dist_checkpointing.save``, with the optimizer's layout in the checkpoint's metadata where the
    release keeps one (0.13+)."""
    from megatron.core import dist_checkpointing
    if _at_least(0, 13):
        dist_checkpointing.save(sd, path, validate_access_integrity=validate_access_integrity,
                                content_metadata=checkpoint_metadata())
    else:
        dist_checkpointing.save(sd, path, validate_access_integrity=validate_access_integrity)


# ---- megatron-core's checkpoint writer ---------------------------------------------------------
def writer_queue():
    """The results queue dist_checkpointing's async writer shares between saves (None: not made)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    return fa._results_queue


def set_writer_queue(queue) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    fa._results_queue = queue


def checkpoint_writer_fixes() -> list:
    """(owner, attr, replacement) for megatron-core's checkpoint writer, by release:

    - before 0.15 a synchronous save goes through the process's queue of asynchronous saves: it forks
      a writer and checks that every rank has made as many saves as the others (an all-reduce of the
      queue's count). A rank restarted into a running job has made none: its first save fails
      ("Unmatched async calls") on every recovery after. From 0.15 a synchronous save runs its write
      in place (``AsyncRequest.execute_sync``), as it does here.
    - 0.12 calls torch's ``_write_item`` without the ``serialization_format`` torch added (0.13 and
      later pass it where torch asks for it, as the replacement does)."""
    import inspect

    from torch.distributed.checkpoint import filesystem
    fixes: list = []
    if not _at_least(0, 15):
        from megatron.core.dist_checkpointing.strategies import base

        def save(self, sharded_state_dict, checkpoint_dir):
            self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()
        fixes.append((base.AsyncSaveShardedStrategy, "save", save))
    original = filesystem._write_item
    if not _at_least(0, 13) and "serialization_format" in inspect.signature(original).parameters:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

        def write_item(*args, **kwargs):
            kwargs.setdefault("serialization_format", filesystem.SerializationFormat.TORCH_SAVE)
            return original(*args, **kwargs)
        fixes.append((fa, "_write_item", write_item))
    return fixes


# ---- Megatron-LM (megatron.training), where its releases differ ---------------------------------
# Megatron-LM's own loop runs here at core_v0.16.1 and at core_v0.12.1 (MindSpeed-LLM's); from 0.17
# its megatron.training needs Python 3.12. Where the two differ, each is told from the loaded code:
#
#   what                                       core_v0.16.1                    core_v0.12.1
#   pretrain_gpt.py's entry                    start-up timestamps, in-process restart, a model builder,
#                                              the embedding ranks, the store  none of them
#   _initialize_distributed                    (..., store)                    no store
#   train_step's forward-backward, iteration   arguments                       the training module's getter,
#                                                                              args.curr_iteration
#   the loss report (megatron_lm.step)         [sum, tokens] tensors that      (sum, tokens) pairs the loss
#                                              train_step reduces over DP      function reduced over DP
#   the loop's micro-batch check, passed over  its sequence-packing switch     the count it reads
#   a reload inside the running loop           -                               asserts the loop's counters are 0
def program_start_time(pretrain_module) -> float | None:
    return getattr(pretrain_module, "_PROGRAM_START_TIME", None)


def pretrain_gpt_call(m) -> tuple[Any, Any, dict]:
    """(pretrain, model provider, keywords) of Megatron-LM's ``pretrain_gpt.py`` module ``m``, as its
    own ``__main__`` block calls them: with in-process restart's wrapper, the model builder, the
    embedding ranks and the store where the release has them."""
    import functools
    import time
    if hasattr(m, "set_startup_timestamps"):
        m.set_startup_timestamps(program_start=program_start_time(m), main_entry=time.time())
    pretrain, kwargs = m.pretrain, {}
    if hasattr(m, "inprocess_restart"):
        pretrain, kwargs["store"] = m.inprocess_restart.maybe_wrap_for_inprocess_restart(m.pretrain)
    if hasattr(m, "get_embedding_ranks"):
        kwargs["get_embedding_ranks"] = m.get_embedding_ranks
    model_provider = functools.partial(m.model_provider, m.gpt_builder) if hasattr(m, "gpt_builder") \
        else m.model_provider
    return pretrain, model_provider, kwargs


def initialize_distributed(original, get_embedding_ranks, get_position_embedding_ranks, store=None):
    """Megatron-LM's ``initialize._initialize_distributed`` (with the store where it takes one:
    core_v0.16.1; core_v0.12.1 takes none)."""
    import inspect
    if "store" in inspect.signature(original).parameters:
        return original(get_embedding_ranks, get_position_embedding_ranks, store)
    return original(get_embedding_ranks, get_position_embedding_ranks)


def loop_step_arguments(forward_backward_func, iteration) -> tuple[Any, int]:
    """(forward-backward function, iteration) of the train_step Megatron-LM's loop called: its
    arguments, or where it passes neither (core_v0.12.1) what its train_step reads instead."""
    if forward_backward_func is not None:
        return forward_backward_func, iteration
    import megatron.training.training as training
    from megatron.training import get_args
    return training.get_forward_backward_func(), get_args().curr_iteration


def loop_rampup_switch(args) -> str | None:
    """The argument by which Megatron-LM's loop lets the micro-batch count change between two steps
    without its rampup check (sequence packing's, core_v0.16.1); None where it has none (core_v0.12.1)."""
    return "rl_use_sequence_packing" if hasattr(args, "rl_use_sequence_packing") else None


def rng_state_sharded_with_experts() -> bool:
    """A checkpoint's RNG states with expert parallelism: one per (PP, TP, DP) rank, as Megatron-LM's
    loop writes them at core_v0.16.1 and the built-in trainer always (an expert's generator is seeded
    by its expert-parallel rank); one per (PP, TP) rank, DP ranks as replicas, where Megatron-LM
    core_v0.12.1's loop runs (its load expects that layout)."""
    import inspect
    import sys
    loop = sys.modules.get("megatron.training.checkpointing")
    return loop is None or "tp_group" in inspect.signature(loop.get_rng_state).parameters


def call_train_step(train_step, forward_step_func, data_iterator, model, optimizer, scheduler, config,
                    forward_backward_func, iteration: int):
    """Megatron-LM's ``train_step`` run with ``forward_backward_func`` for ``iteration``: arguments
    where it takes them (core_v0.16.1); core_v0.12.1 takes the function from the training module's
    getter and the iteration from ``args.curr_iteration``, both set for the call."""
    import inspect
    if "forward_backward_func" in inspect.signature(train_step).parameters:
        return train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config,
                          forward_backward_func, iteration=iteration)
    import megatron.training.training as training
    from megatron.training import get_args
    a, getter = get_args(), training.get_forward_backward_func
    before = a.curr_iteration
    training.get_forward_backward_func, a.curr_iteration = (lambda: forward_backward_func), iteration
    try:
        return train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config)
    finally:
        training.get_forward_backward_func, a.curr_iteration = getter, before


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
    """What the engine uses of megatron-core (the table above) that the running release lacks."""
    try:
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    except ImportError as e:
        return [f"megatron-core ({e})"]
    import inspect
    missing = []
    if "num_distributed_optimizer_instances" not in inspect.signature(parallel_state.initialize_model_parallel).parameters:
        missing.append("the partial distributed optimizer (initialize_model_parallel's "
                       "num_distributed_optimizer_instances, which the replica optimizer is)")
    needed = ["_copy_main_params_to_model_params", "_get_model_param_range_map"]
    if _at_least(0, 14):
        needed.append("_init_optimizer_states_with_dummy_values")
    missing += [f"DistributedOptimizer.{m}" for m in needed if not hasattr(DistributedOptimizer, m)]
    if not hasattr(fa, "_results_queue"):
        missing.append("megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue")
    if not _at_least(0, 14):
        import numpy
        if not hasattr(numpy, "product"):  # (its checkpoints call it: every load and every parallel save)
            missing.append(f"numpy.product, which numpy 2 removed (numpy {numpy.__version__} is installed: "
                           "pip install 'numpy<2', as megatron-core 0.13 requires)")
    return missing


# A release newer than the range may be tried at the user's own risk (a warning says so).
UNTESTED_MEGATRON_CORE_ENV = "MINDSPEED_HA_UNTESTED_MEGATRON_CORE"


def _megatron_core_outside_range() -> str | None:
    """Where the running megatron-core lies outside the range (None: inside it, or a newer one the
    user asked to try)."""
    import os
    release = megatron_core()
    first, last = MEGATRON_CORE_RANGE
    if release[:2] < first or release[:3] < (0, 12, 1):
        return "is older than the releases mindspeed-ha supports"
    if release[:2] > last and os.environ.get(UNTESTED_MEGATRON_CORE_ENV) != "1":
        return (f"is newer than any release mindspeed-ha has run on ({UNTESTED_MEGATRON_CORE_ENV}=1 tries "
                "it anyway)")
    return None


def check() -> None:
    """Refuse (CompatError, one line) a megatron-core outside the supported range, or a torch or
    megatron-core without the internals used here; warn once for a version CI does not test."""
    first, last = MEGATRON_CORE_RANGE
    core = f"megatron-core {megatron_core_version()}"
    supported = (f"mindspeed-ha supports megatron-core {first[0]}.{first[1]}.1 to {last[0]}.{last[1]}.x "
                 f"(tested: {', '.join(TESTED_MEGATRON_CORE)}; pip install '{MEGATRON_CORE_PIN}')")
    missing = _missing_torch() + _missing_megatron()
    lacks = f"; it lacks {', '.join(missing)}" if missing else ""
    outside = _megatron_core_outside_range()
    if outside:
        raise CompatError(f"{core} {outside}{lacks}. {supported}")
    if missing:
        raise CompatError(
            f"torch {torch.__version__}, {core} lacks what mindspeed-ha needs: {', '.join(missing)}. Tested: "
            f"torch {' / '.join(TESTED_TORCH)} with megatron-core {' / '.join(TESTED_MEGATRON_CORE)} "
            f"(pip install 'torch=={TESTED_TORCH[1]}' '{MEGATRON_CORE_PIN}')")
    if TORCH not in {_version(v) for v in TESTED_TORCH} or megatron_core_version() not in TESTED_MEGATRON_CORE:
        warnings.warn(f"mindspeed-ha: torch {torch.__version__}, {core} is not a tested combination (tested: torch "
                      f"{', '.join(TESTED_TORCH)}; megatron-core {', '.join(TESTED_MEGATRON_CORE)})", stacklevel=2)
