"""Checkpoints in Megatron-LM's layout through megatron-core dist_checkpointing (torch_dist).

``DIR/iter_0000010/`` plus ``DIR/latest_checkpointed_iteration.txt`` (checkpoint_dir.py: the tracker,
publishing, the manifest). Every writer (periodic saves here, the dump in rank/recovery/dump.py) writes
into ``iter_XXXXXXX_tmp``, adds the manifest of checksums and publishes it. Before ``--load`` reads a
tensor it checks the tracker, the model settings the checkpoint was written with and (unless
``--no-verify-checkpoint``) every file against the manifest. Loading handles three traps of
megatron-core's distributed optimizer on torch's Adam (see ``load``).
"""
from __future__ import annotations

import os
import queue
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from mindspeed_ha import compat
from mindspeed_ha.events import get_logger
from mindspeed_ha.trainer_state import rng
from mindspeed_ha.trainer_state.interface import load_scheduler
from mindspeed_ha.trainer_state.checkpoint_dir import (MANIFEST, TRACKER, CheckpointError, checksums, iter_dir,  # noqa: F401
                                                 mismatches, publish, read_manifest, remove_leftovers, tracker,
                                                 write_manifest)

log = get_logger("checkpoint")
CHECKPOINT_VERSION = 3.0


def unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _rng_state(state: dict | None = None) -> ShardedObject:
    """Megatron-LM's layout: one RNG state per TP and PP rank; with expert parallelism one per
    data-parallel rank too (an expert's generator is seeded by its expert-parallel rank), except
    where Megatron-LM core_v0.12.1's loop reads it (``compat.rng_state_sharded_with_experts``)."""
    pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    data = [state if state is not None else rng.snapshot()]
    dp = ps.get_data_parallel_rank(with_context_parallel=True)
    if ps.get_expert_model_parallel_world_size() > 1 and compat.rng_state_sharded_with_experts():
        return ShardedObject("rng_state", data, (*shape, ps.get_data_parallel_world_size(with_context_parallel=True)),
                             (pp, tp, dp), replica_id=0)
    return ShardedObject("rng_state", data, shape, (pp, tp), replica_id=dp)


def state_dict(trainer, is_loading: bool = False, optimizer: bool = True) -> dict:
    model_sd = {}
    chunks = [unwrap(m) for m in trainer.model_chunks]  # Megatron-LM saves the unwrapped modules
    if len(chunks) == 1:
        model_sd["model"] = chunks[0].sharded_state_dict()
    else:
        for i, m in enumerate(chunks):
            model_sd[f"model{i}"] = m.sharded_state_dict()
    sd = dict(model_sd)
    if optimizer:  # (a loading sharded_state_dict initialises the optimizer's state: not when it is not loaded)
        sd["optimizer"] = compat.optimizer_sharded_state_dict(trainer.optimizer, model_sd, is_loading)
    sd["opt_param_scheduler"] = trainer.scheduler.state_dict()
    sd["iteration"] = trainer.iteration
    sd["consumed_samples"] = trainer.consumed_samples
    sd["checkpoint_version"] = CHECKPOINT_VERSION
    sd["args"] = trainer.checkpoint_args()
    sd["rng_state"] = _rng_state()
    return sd


def at_iteration(sd: dict, trainer, iteration: int, rng_state) -> None:
    """Make the non-sharded part of ``sd`` describe ``iteration``: the trainer's own, the one after it
    when its update has finished but its bookkeeping (counters, scheduler) has not run yet, or the one
    before it. A replica instance can finish a step the other instance has not: a rank killed just
    after it can take the last message of that step's collective with it, so the twins of its shard
    are still inside the step and the newest iteration every shard has is the one before. The
    counters and the scheduler are functions of the iteration, so they step back exactly."""
    ahead = iteration - trainer.iteration
    if ahead not in (-1, 0, 1):
        raise ValueError(f"trainer at iteration {trainer.iteration} cannot describe iteration {iteration}")
    gbs = trainer.global_batch_size
    sd["iteration"] = iteration
    sd["consumed_samples"] = trainer.consumed_samples + ahead * gbs
    sd["args"].consumed_train_samples = sd["consumed_samples"]
    sched = dict(trainer.scheduler.state_dict())
    sched["num_steps"] += ahead * gbs  # load_state_dict recomputes lr and wd from it
    sd["opt_param_scheduler"] = sched
    old = sd["rng_state"]
    sd["rng_state"] = ShardedObject(old.key, [rng_state], old.global_shape, old.global_offset,
                                    replica_id=old.replica_id)


def save(trainer, root: str, group=None) -> tuple[str, float]:
    """Collective over ``group`` (default: world). Returns (directory, seconds)."""
    t0 = time.perf_counter()
    tmp = iter_dir(root, trainer.iteration) + "_tmp"
    rank = dist.get_rank(group)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier(group=group)
    sd = state_dict(trainer)
    writer_in_process()  # (the built-in trainer's saves are synchronous)
    compat.save_checkpoint(sd, tmp, validate_access_integrity=False)
    dist.barrier(group=group)
    add_manifest(tmp, {"kind": "periodic", "iteration": trainer.iteration}, group)
    if rank == 0:
        publish(root, tmp, trainer.iteration)
    dist.barrier(group=group)
    return iter_dir(root, trainer.iteration), time.perf_counter() - t0


def add_manifest(path: str, fields: dict, group=None) -> dict:
    """Collective: every rank checksums the files it wrote; the first writes the manifest."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    every: list[Any] = [None] * size  # (filled by all_gather_object)
    dist.all_gather_object(every, checksums(path, rank, size), group=group)
    manifest = {**fields, "files": {n: e for files in every for n, e in files.items()}}
    if rank == 0:
        write_manifest(path, manifest)
    dist.barrier(group=group)
    return manifest


def verify(path: str, group=None) -> bool:
    """Collective: every file of the checkpoint against its manifest, each rank reading its share.
    Raises CheckpointError naming the first bad file; False when the checkpoint has no manifest
    (written by something else: loaded unverified, with a warning)."""
    manifest = read_manifest(path)
    if manifest is None:
        if dist.get_rank(group) == 0:
            log.warning("%s has no %s (not written by mindspeed-ha): loaded without verifying it", path, MANIFEST)
        return False
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    bad = mismatches(path, manifest, sorted(manifest["files"])[rank::size])
    every: list[Any] = [None] * size  # (filled by all_gather_object)
    dist.all_gather_object(every, bad, group=group)
    bad = [b for part in every for b in part]
    if bad:
        raise CheckpointError(f"--load: {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") +
                              ": the checkpoint is damaged; load an older one, or pass --no-verify-checkpoint "
                              "to load it anyway")
    return True


# Settings whose mismatch loads wrong weights (or none): a checkpoint written with other values is
# refused rather than read. Compared where both the checkpoint and this job name them (values Megatron-LM
# derives later in its set-up, such as num_query_groups without grouped-query attention, are left out).
MODEL_SETTINGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                  "max_position_embeddings", "padded_vocab_size",
                  "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_experts",
                  "position_embedding_type", "normalization", "swiglu", "untie_embeddings_and_output_weights")


def check_settings(path: str, current, names=MODEL_SETTINGS) -> None:
    """Refuse a checkpoint written with other model settings than ``current`` (an args namespace),
    naming the setting and both values."""
    try:
        saved = dist_checkpointing.load_common_state_dict(path).get("args")
    except Exception as e:
        raise CheckpointError(f"--load: {path}: its common part cannot be read ({e}): the checkpoint is "
                              "damaged") from None
    for name in names:
        a, b = getattr(saved, name, None), getattr(current, name, None)
        if a is not None and b is not None and a != b:
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(f"--load: {path} was written with {flag} {a}, this job has {flag} {b}: its "
                                  f"weights would load wrong; run with {flag} {a} (or load another checkpoint)")


def before_load(root: str, current, verify_files: bool = True, group=None) -> tuple[int, str] | None:
    """What --load checks before any tensor is read: the tracker names a complete checkpoint (None:
    no tracker, a fresh start), written with this job's model settings, every file as written."""
    it = tracker(root)
    if it is None:
        return None
    path = iter_dir(root, it)
    check_settings(path, current)
    if verify_files:
        verify(path, group)
    return it, path


# -- where the writer hands back its results -----------------------------------------------------------
def writer_in_process() -> None:
    """A synchronous save's write results come back inside this process (dist_checkpointing forks its
    writers and gathers their results here): a plain queue carries them. Left alone, its first save
    would spawn a multiprocessing manager for that queue, a Python start-up per rank (seconds on a
    loaded host, on the path of a dying gasp). An asynchronous save (Megatron-LM's --async-save) writes
    from another process and needs dist_checkpointing's own manager: then this is not called."""
    if compat.writer_queue() is None:
        compat.set_writer_queue(queue.Queue())


def _import_checkpoint_modules() -> None:
    import torch.distributed.checkpoint  # noqa: F401  (runs in the writer's manager process)


_writer_manager = None


def _warm_writer() -> None:
    """For asynchronous saves: dist_checkpointing's first save spawns a multiprocessing manager whose
    server then imports torch when it first unpickles write results: seconds each on a busy host. Do
    both now, with the import in the server's initializer — two client threads unpickling concurrently
    there can race on that import ("partially initialized module") if it is left to the first requests."""
    global _writer_manager
    import multiprocessing.managers
    from torch import multiprocessing as mp
    if compat.writer_queue() is not None:
        return
    manager = multiprocessing.managers.SyncManager(ctx=mp.get_context("spawn"))
    manager.start(_import_checkpoint_modules)
    results = manager.Queue()
    if compat.writer_queue() is None:  # a save that started meanwhile made its own: leave it that one
        compat.set_writer_queue(results)
        _writer_manager = manager
    else:
        manager.shutdown()


_prewarm_thread = None


def prewarm_writer(asynchronous: bool = False):
    """Ready the checkpoint writer now, so that a rank whose first write is a dying-gasp checkpoint does
    not pay for it then: the in-process queue, or for asynchronous saves the helper process, started in
    the background (see ``_warm_writer``; the script must guard ``if __name__ == "__main__"``, as any
    script that saves must)."""
    import threading
    global _prewarm_thread
    if not asynchronous:
        writer_in_process()
        return None
    _prewarm_thread = threading.Thread(target=_warm_writer, name="ha-writer-prewarm", daemon=True)
    _prewarm_thread.start()
    return _prewarm_thread


def release_writer(timeout: float = 300.0) -> None:
    """At the end of a job: wait for a pre-warm still starting the manager and shut that manager
    down. Otherwise a short job on a busy host exits while ``start()`` is under way: the manager's
    finalizer is registered only when ``start()`` returns, too late for the exit handlers, and
    multiprocessing's exit then joins the (non-daemonic) manager process forever."""
    global _writer_manager
    if _prewarm_thread is not None:
        _prewarm_thread.join(timeout)
    if _writer_manager is not None:  # then fa's queue is this manager's (set together)
        compat.set_writer_queue(None)
        _writer_manager.shutdown()
        _writer_manager = None


def writer_ready() -> None:
    """Wait for a pre-warm under way: a second writer manager must not start next to it."""
    if _prewarm_thread is not None:
        _prewarm_thread.join()


def fix_adam_steps(optimizer) -> None:
    """Traps 2 and 3 of a distributed-optimizer load on torch's Adam: after a load the per-parameter
    Adam ``step`` is not the checkpoint's (the right value is in the param group), and it is one
    tensor shared by every parameter, which torch's Adam would bump once per parameter per step.
    Set each its own, right one. (A fused Adam keeps its count in the param group, which the load
    restores; SGD has none: nothing is written for them.)"""
    from mindspeed_ha.replica.optimizer import set_step_counts
    set_step_counts(optimizer)


def load(trainer, root: str, load_optim: bool = True, load_rng: bool = True, verify_files: bool = True) -> int:
    found = before_load(root, trainer.checkpoint_args(), verify_files)
    if found is None:
        raise CheckpointError(f"--load {root}: no checkpoint there (no {TRACKER})")
    it, path = found
    inners = getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]
    if load_optim and not all(isinstance(i, DistributedOptimizer) for i in inners):
        raise CheckpointError(f"--load {root}: its optimizer state is a distributed optimizer's; add "
                              "--use-distributed-optimizer, or pass --no-load-optim to take only the weights")
    if load_optim:
        # Trap 1: the optimizer needs real state (with ``step``) before sharded_state_dict(is_loading);
        # megatron-core creates it only at the first step.
        for inner in getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]:
            compat.init_optimizer_state(inner)
    sd = state_dict(trainer, is_loading=True, optimizer=load_optim)
    if not load_rng:
        sd.pop("rng_state")
    loaded = dist_checkpointing.load(sd, path, strict="assume_ok_unexpected")
    chunks = [unwrap(m) for m in trainer.model_chunks]
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"])
    else:
        for i, m in enumerate(chunks):
            m.load_state_dict(loaded[f"model{i}"])
    if load_optim:
        with torch.no_grad():  # fp32 shards are views of leaf parameters
            trainer.optimizer.load_state_dict(loaded["optimizer"])
        fix_adam_steps(trainer.optimizer)
    load_scheduler(trainer.scheduler, loaded["opt_param_scheduler"])
    if load_rng and "rng_state" in loaded:
        rng.restore(loaded["rng_state"])
    trainer.iteration = int(loaded["iteration"])
    if hasattr(trainer.optimizer, "ha_iteration"):
        trainer.optimizer.ha_iteration = trainer.iteration  # the shard is now at the loaded iteration
    trainer.consumed_samples = int(loaded.get("consumed_samples", trainer.iteration * trainer.args.global_batch_size))
    return trainer.iteration
