"""In-place recovery of a live job (the retry strategy): every process keeps running.

Each function is one step the controller orders on every rank's training thread, after the stop
(every rank has left its collective): ``rebuild`` (clean + fresh communicators), ``transfer_shards``
+ ``regather_params`` (repair), ``resume_at`` (rollback, or roll forward). They use the trainer
interface only.

The recover strategy adds a restarted worker (a "joiner"): it enters with ``join`` (the default
group of the survivors' rebuild, then the trainer's set-up without collectives of its own), receives
its shard like a poisoned rank and, with ``transfer_bookkeeping``, the counters, scheduler and RNG of
its shard's twin — a DP peer at the same TP/PP position, whose RNG streams are the same.

Which iteration: the controller plans it like the dying gasp (``dump.plan_dump``): the newest
iteration every optimizer shard has a healthy holder for. Shards that are behind it (a rank stopped
before touching its shard while its twin finished the update) or poisoned (the memory error) are
copied from a holder at that iteration. If that is the iteration the trainer had completed, the
failed step is recomputed (RNG and data position back to its start); if it is one past it, the
update of the failed step had finished somewhere, so only its bookkeeping is finished.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mindspeed_ha.events import get_logger

log = get_logger("repair")


class RepairError(RuntimeError):
    pass


def status(trainer) -> dict:
    """The dying gasp's shard status (the same planner reads it) plus the last step that ended."""
    from mindspeed_ha.recovery.dump import local_status
    return {**local_status(trainer), "ended": trainer.ended}


def clean(trainer) -> None:
    """Drop what the interrupted step left: gradients, DDP bucket state and pending handles (the
    interrupted operations belong to the old groups and are never waited on again)."""
    for m in trainer.model_chunks:
        for bg in list(getattr(m, "bucket_groups", [])) + list(getattr(m, "expert_parallel_bucket_groups", [])):
            bg.grad_reduce_handle = None
            bg.param_gather_handle = None
            bg.param_gather_dispatched = False
        m.zero_grad_buffer()
    trainer.optimizer.zero_grad()


def rebuild(trainer, roots, store_host: str, store_port: int, generation: int, world_size: int, rank: int,
            backend: str) -> int:
    """Clean, then a new generation of the default group and of every megatron-core group, with
    every reference the model, the optimizer and the session hold re-pointed."""
    from datetime import timedelta
    from mindspeed_ha.comm.interruptible import clear_stop
    from mindspeed_ha.recovery import groups
    clear_stop()
    clean(trainer)
    return groups.rebuild_in_place(world_size, rank, store_host, store_port, generation, roots=roots,
                                   init_parallel=trainer.init_parallel, host_rank=None,
                                   timeout=timedelta(seconds=60), backend=backend)


def join(trainer, store_host: str, store_port: int, generation: int, world_size: int, rank: int,
         backend: str) -> None:
    """A restarted worker: the default group of this generation (formed with the survivors'
    ``rebuild``), then the trainer's set-up without any collective of its own."""
    from datetime import timedelta
    from mindspeed_ha.recovery import groups
    groups._new_default_group(range(world_size), rank, store_host, store_port, generation, None,
                              timedelta(seconds=60), backend)
    trainer.setup(joining=True)  # (megatron-core's world gather is answered locally: patches/)


def transfer_bookkeeping(trainer, joiners: dict[int, int], rank: int) -> None:
    """``joiners``: restarted rank -> the twin that sends it what is not in the optimizer shard:
    the trainer's counters, scheduler and pending loss, the RNG now and the snapshots of recent
    iterations (so that ``resume_at`` rolls back or forward exactly as on the twin)."""
    from mindspeed_ha import session
    from mindspeed_ha.recovery.dump import _rng_snapshot
    from mindspeed_ha.trainer.checkpoint import _set_rng_state
    for dst, src in sorted(joiners.items()):
        if rank == src:
            state = getattr(trainer, "ha_step_state", None)
            box = [{"trainer": trainer.bookkeeping(), "rng_now": _rng_snapshot(),
                    "rng": dict(state.rng) if state is not None else {}}]
            dist.send_object_list(box, dst)
        elif rank == dst:
            box = [None]
            dist.recv_object_list(box, src)
            trainer.install_bookkeeping(box[0]["trainer"])
            session.current().report_unlogged_step(trainer.ended, box[0]["trainer"].get("step_loss"))
            _set_rng_state(box[0]["rng_now"])
            trainer.ha_step_state.rng = dict(box[0]["rng"])


def transfer_shards(optimizer, pairs: list[tuple[int, int]], rank: int, iteration: int) -> int:
    """Point to point over the rebuilt default group: for each (src, dst), src sends its shard state
    (fp32 main params, exp_avg, exp_avg_sq, step), dst overwrites its own. Every rank walks the pairs
    in the same order. Returns the bytes this rank received."""
    got = 0
    for src, dst in pairs:
        if rank not in (src, dst):
            continue
        optimizer.ha_ensure_state()
        mine = optimizer.ha_export_shard()
        if rank == src:
            for t in mine.values():
                dist.send(t.detach().contiguous(), dst)
        else:
            fresh = {k: torch.empty_like(t) for k, t in mine.items()}
            for t in fresh.values():
                dist.recv(t, src)
                got += t.numel() * t.element_size()
            optimizer.ha_import_shard(fresh)
    if any(dst == rank for _, dst in pairs):
        optimizer.ha_iteration = iteration
    optimizer.ha_updating = False  # a window stopped before the arithmetic, or finished by the copy
    return got


def regather_params(trainer) -> None:
    """Model weights := the (repaired) fp32 main params: copy the own shard into the model and
    all-gather the rest, as the end of an optimizer step does. Same bits on healthy ranks."""
    from mindspeed_ha.replica.optimizer import _inner_optimizers
    with torch.no_grad():
        for inner in _inner_optimizers(trainer.optimizer):
            inner._copy_main_params_to_model_params()
    for m in trainer.model_chunks:
        m.start_param_sync(force_sync=True)


def resume_at(trainer, iteration: int) -> str:
    """Rollback (the failed step will be recomputed) or roll forward (its update is done: finish
    its bookkeeping and report its loss). Returns which."""
    from mindspeed_ha.trainer.checkpoint import _set_rng_state
    if trainer.ended == iteration:
        state = getattr(trainer, "ha_step_state", None)
        rng = state.rng.get(iteration) if state is not None else None
        if rng is None:
            raise RepairError(f"no RNG snapshot of iteration {iteration}: cannot recompute step {iteration + 1}")
        _set_rng_state(rng)
        trainer.restart_from(iteration)
        return "rollback"
    if trainer.ended + 1 == iteration:
        trainer.finish_step(iteration)
        return "roll-forward"
    raise RepairError(f"trainer at iteration {trainer.iteration} (last step ended {trainer.ended}) "
                      f"cannot resume at {iteration}")
