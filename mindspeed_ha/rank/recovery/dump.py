"""The dump: after a fault the survivors write the dying-gasp checkpoint, a standard reshardable one.

``prepare`` (local, while the old groups still answer) builds this rank's sharded state dict of the
live state; ``write`` (collective over the survivors' default group, ``comm.groups.survivor_world``)
re-synchronises the model weights from the writers' fp32 main params, elects one main replica per
(key, offset) among the survivors by rewriting ``replica_id``, and saves with megatron-core's
dist_checkpointing into ``iter_XXXXXXX_tmp``; the files are checksummed into a manifest, re-read and
compared, the metadata's coverage checked, and only then is the directory put in place and
``latest_checkpointed_iteration.txt`` replaced (``trainer_state.checkpoint_dir.publish``).

The plan it writes (which iteration, which writer per shard) is ``mindspeed_ha.plan.plan_dump``'s.
The result is the layout of ``mindspeed_ha.trainer_state.checkpoint.save`` (an optimizer layout that
loads into another data-parallel size: ``compat.optimizer_sharding``), so a plain ``--load`` resumes
from it, with any DP size.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist

from mindspeed_ha.events import EventLog, get_logger
from mindspeed_ha.plan import DumpPlan
from mindspeed_ha.replica.reshard import CHUNK_BYTES

if TYPE_CHECKING:
    from mindspeed_ha.comm.groups import World
    from mindspeed_ha.trainer_state.interface import TrainerInterface

Ident = tuple[str, tuple[int, ...], tuple[int, int] | None]  # a checkpoint item: key, offset, flattened range

log = get_logger("dump")


class DumpError(RuntimeError):
    """Nothing was written (or the temporary directory was removed): the dump did not happen."""


# ================================================================================================
# Writing
# ================================================================================================
@dataclasses.dataclass
class DumpResult:
    iteration: int
    path: str
    seconds: float
    writers: list[int]
    files: int
    bytes: int


@dataclasses.dataclass
class Prepared:
    """What a survivor reads while its old process groups still exist (see ``prepare``)."""
    trainer: TrainerInterface
    status: dict[str, Any]
    sd: dict[str, Any]        # sharded state dict of the live state (model tensors are the parameters)
    params: dict[str, tuple[torch.nn.Parameter, tuple[str | int, ...]]]  # parameter name -> (parameter, position)
    shard: list[dict[str, Any]]  # this rank's shard description, with positions
    seconds: float
    bytes: int = 0            # what this rank holds of the state (its shard and its weights)


def prepare(trainer: TrainerInterface, abandon_update: bool = False) -> Prepared:
    """Local, no collective. Call on every survivor once it has stopped (and finished an update it
    had begun), before ``survivor_world``: a sharded state dict describes the job's layout, which
    the survivors' world no longer has.

    ``abandon_update``: this rank was stopped inside its update window but before touching its shard
    (a collective before the Adam arithmetic — the grad-norm all-reduce — was interrupted; the
    arithmetic itself has no collective and the window closes before the parameter all-gather).
    Its shard is still at ``ha_iteration``; the window is closed without counting an update."""
    from mindspeed_ha.trainer_state import checkpoint
    t0 = time.perf_counter()
    opt = trainer.optimizer
    if not hasattr(opt, "ha_export_shard"):
        raise DumpError("the dying-gasp checkpoint needs the replica optimizer (--enable-high-availability)")
    if opt.ha_updating and abandon_update:
        opt.ha_abandon_update()
    if opt.ha_updating:
        raise DumpError(f"rank {opt.ha_topology.rank} is inside its optimizer update; finish it first")
    params = opt.ha_param_positions()
    shard = opt.ha_shard_description()
    for d in shard:
        d["pos"] = params[d["param"]][1]
    sd = checkpoint.state_dict(trainer)
    size = sum(t.numel() * t.element_size() for t in opt.ha_export_shard().values())
    size += sum(p.numel() * p.element_size() for p, _ in params.values())
    from mindspeed_ha.rank.recovery.restore import local_status
    return Prepared(trainer, local_status(trainer), sd, params, shard, time.perf_counter() - t0, size)


def _resync_model_weights(prep: Prepared, plan: DumpPlan, world: World, chunk_bytes: int) -> int:
    """Model weights := the writers' fp32 main params (cast like the distributed optimizer's own
    copy). A fault between the shard updates and the parameter all-gather leaves stale weights for
    other ranks' shards; this is that all-gather, from the chosen holders only, and only to the
    survivors that hold the same parameter at the same (TP, PP, EP) position — their data-parallel
    peers — in the weights' own dtype (the cast the receiver would make). Point to point, every rank
    walking the (writer, receiver) pairs in one order, in messages of at most ``chunk_bytes``.
    Returns the bytes this rank received."""
    me = world.rank
    held = sorted((name, tuple(pos)) for name, (_, pos) in prep.params.items())
    every: list[Any] = [None] * len(world.ranks)  # filled by all_gather_object
    dist.all_gather_object(every, {"shard": prep.shard if me in plan.writers.values() else None, "held": held})
    holders: dict[tuple[str, tuple[Any, ...]], list[int]] = {}
    for r, e in enumerate(every):
        for name, pos in e["held"]:
            holders.setdefault((name, tuple(pos)), []).append(r)
    # (writer, receiver) -> the writer's shard entries the receiver holds too
    pairs: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for src, e in enumerate(every):
        for d in e["shard"] or ():
            for dst in holders.get((d["param"], tuple(d["pos"])), ()):
                if dst != src:
                    pairs.setdefault((src, dst), []).append(d)
    mine = world.new_rank
    exported = prep.trainer.optimizer.ha_export_shard() if any(src == mine for src, _ in pairs) else {}
    got = 0
    for (src, dst), entries in sorted(pairs.items()):
        if mine not in (src, dst):
            continue
        views = [prep.params[d["param"]][0].data.view(-1)[d["start"]:d["end"]] for d in entries]
        if src == mine:  # (the weights the receiver will hold: the fp32 main values in their dtype)
            views = [exported[f"{d['name']}.param"].reshape(-1).to(v.dtype) for d, v in zip(entries, views)]
        got += _move_weights(views, sending=src == mine, peer=dst if src == mine else src, chunk=chunk_bytes)
    return got


def _move_weights(views: list[torch.Tensor], sending: bool, peer: int, chunk: int) -> int:
    """Send these tensors' bytes to ``peer`` or receive them into them (as a repair moves a shard)."""
    from mindspeed_ha.rank.recovery.restore import move_bytes
    with torch.no_grad():
        return move_bytes(views, sending, peer, chunk)


def _normalize(prep: Prepared, plan: DumpPlan) -> bool:
    """Bring the common part of the state dict to ``plan.iteration``; True if this rank's RNG state
    as of that iteration is known."""
    from mindspeed_ha.trainer_state import checkpoint
    trainer = prep.trainer
    assert plan.iteration is not None  # an ok plan (write() refuses any other) names its iteration
    state = trainer.rng.at(plan.iteration)
    if state is None and not trainer.rng.states and plan.iteration == trainer.iteration:
        state = prep.sd["rng_state"].data[0]  # untracked: the live RNG, right only if no forward ran since
    try:
        checkpoint.at_iteration(prep.sd, trainer, plan.iteration, state)
    except ValueError as e:  # a survivor's trainer is at T-1, T or T+1 (see at_iteration)
        raise DumpError(f"rank {prep.status['rank']}: {e}") from None
    return state is not None


def _stand_ins(own: Any, topology: Any) -> list[Any]:
    """With expert parallelism every data-parallel rank has an RNG state of its own in the
    checkpoint (Megatron-LM's layout). Where a rank's own is not there (lost, or not known at the
    plan's iteration), its twin's stands in: the same TP, PP and expert-parallel rank, so the same
    state unless an expert layer draws random numbers in a shape set by the rank's own tokens (a
    rank restarted under recover starts from its twin's too)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    if len(own.global_shape) < 3:
        return []
    pp, tp, _ = own.global_offset
    return [ShardedObject(own.key, own.data, own.global_shape, (pp, tp, topology.dp_ranks.index(r)), replica_id=0)
            for r in topology.replica_group if r != topology.rank]


def _ident(obj: Any) -> Ident:
    fr = getattr(obj, "flattened_range", None)
    return (obj.key, tuple(obj.global_offset), (fr.start, fr.stop) if fr is not None else None)


def _elect(sd: dict[str, Any], plan: DumpPlan, world: World, eligible: dict[str, bool]) -> int:
    """Rewrite replica_id so that every (key, offset) has exactly one main replica among the
    survivors: a plan writer if one is eligible, else the lowest eligible survivor; a twin's RNG
    state (``rng_stand_ins``) only where no rank offers its own. ``eligible`` says per section
    whether this rank's copy is at the plan's iteration (optimizer: shard at the target; rng:
    snapshot of the target; model: always, after the resync). Every survivor sees the same offers,
    so every survivor computes the same election. Returns this rank's main count."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, apply_factories
    apply_factories(sd)
    mine = []
    for section, sub in sd.items():
        if not isinstance(sub, (dict, list)) and not isinstance(sub, ShardedBase):
            continue
        kind = {"optimizer": "optimizer", "rng_state": "rng", "rng_stand_ins": "rng"}.get(section, "model")
        rank = 1 if section == "rng_stand_ins" else 2  # (an offer of one's own wins over a stand-in)
        values = [sub] if isinstance(sub, ShardedBase) else nested_values(sub)
        for v in values:
            if isinstance(v, ShardedBase):
                mine.append((kind, rank, v))
    offer = list(dict.fromkeys((_ident(v), rank if eligible[kind] else 0) for kind, rank, v in mine))
    offers: list[Any] = [None] * len(world.ranks)  # filled by all_gather_object
    dist.all_gather_object(offers, offer)
    writers = {world.ranks.index(r) for r in plan.writers.values() if r in world.ranks}
    chosen: dict[Ident, int | None] = {}
    best: dict[Ident, int] = {}
    for src, items in enumerate(offers):
        for ident, level in items:
            chosen.setdefault(ident, None)
            if not level:
                continue
            cur = chosen[ident]
            if cur is None or level > best[ident] or (level == best[ident] and src in writers and cur not in writers):
                chosen[ident], best[ident] = src, level
    lost = [i for i, c in chosen.items() if c is None]
    if lost:
        raise DumpError(f"no eligible survivor holds {len(lost)} checkpoint item(s), e.g. {lost[:3]}")
    me, done, count = world.new_rank, set(), 0
    for _, _, v in mine:
        ident = _ident(v)
        main = chosen[ident] == me and ident not in done  # a duplicate in one rank's dict: once
        if main:
            done.add(ident)
            count += 1
        rid = v.replica_id
        if isinstance(rid, tuple):
            v.replica_id = tuple(0 for _ in rid) if main else (1,) + tuple(0 for _ in rid[1:])
        else:
            v.replica_id = 0 if main else 1
    return count


def _verify(tmp: str, world: World, manifest: dict[str, Any]) -> None:
    """Re-read another rank's files and compare with the manifest; rank 0 checks that the torch
    DCP metadata only points into manifest files, inside their sizes."""
    from mindspeed_ha.trainer_state.checkpoint_dir import mismatches
    size = len(world.ranks)
    other = (world.new_rank + 1) % size
    errors = mismatches(tmp, manifest, [n for n, e in manifest["files"].items() if e["rank"] == other])
    if world.new_rank == 0:
        from torch.distributed.checkpoint import FileSystemReader
        meta = FileSystemReader(tmp).read_metadata()
        for idx, info in (meta.storage_data or {}).items():
            entry = manifest["files"].get(info.relative_path)
            if entry is None or info.offset + info.length > entry["bytes"]:
                errors.append(f"{idx.fqn}: stored at {info.relative_path}+{info.offset} outside the written files")
                break
        missing = [k for k in manifest["keys"] if k not in meta.state_dict_metadata]
        if missing:
            errors.append(f"metadata lacks {len(missing)} key(s), e.g. {missing[:3]}")
    found: list[Any] = [None] * size  # filled by all_gather_object
    dist.all_gather_object(found, errors)
    bad = [e for errs in found for e in errs]
    if bad:
        raise DumpError("verification failed: " + "; ".join(bad[:5]))


def write(prep: Prepared, plan: DumpPlan, world: World, save_dir: str, events: EventLog | None = None,
          progress: Callable[[], None] = lambda: None, chunk_bytes: int = CHUNK_BYTES) -> DumpResult:
    """Collective over ``world``, the survivors' default group from ``comm.groups.survivor_world``
    (called after ``prepare``). ``plan`` must be the same on every survivor. ``progress()`` is called
    after each part (the controller extends the dump's time limit while writers make progress)."""
    from mindspeed_ha import compat
    from mindspeed_ha.comm.interruptible import PROCESS_STOP
    from mindspeed_ha.trainer_state import checkpoint, checkpoint_dir
    t0 = time.perf_counter()
    if not plan.ok:
        raise DumpError(plan.message())
    assert plan.iteration is not None  # an ok plan names its iteration
    opt = prep.trainer.optimizer
    at_target = world.rank in plan.at_target
    if at_target and opt.ha_iteration != plan.iteration:
        raise DumpError(f"rank {world.rank}: shard at iteration {opt.ha_iteration}, the plan says {plan.iteration}")

    final = checkpoint.iter_dir(save_dir, plan.iteration)
    tmp = final + "_tmp"
    me0 = world.new_rank == 0
    if me0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        checkpoint_dir.remove_leftovers(save_dir, keep=tmp)  # e.g. a periodic save the fault interrupted
    try:
        resync_bytes = _resync_model_weights(prep, plan, world, chunk_bytes)
        progress()
        rng_ok = _normalize(prep, plan)
        sd = prep.sd
        sd["rng_stand_ins"] = _stand_ins(sd["rng_state"], opt.ha_topology)
        mains = _elect(sd, plan, world, {"optimizer": at_target, "rng": rng_ok, "model": True})
        keys = sorted(set(_sharded_keys(sd)))
        checkpoint.writer_ready()  # never start a second writer manager next to a half-started one
        checkpoint.writer_in_process()  # (this save is synchronous)
        session = getattr(prep.trainer, "session", None)
        if session is not None:
            session.fire("checkpoint", plan.iteration)  # fault drills: a rank lost mid-dump
        dist.barrier()
        PROCESS_STOP.commit_point("the dying gasp's save")  # (the weights re-gathered, the election: none cut short)
        t_save = time.perf_counter()
        compat.save_checkpoint(sd, tmp, validate_access_integrity=True)
        t_saved = time.perf_counter()
        progress()
        # Checksums: each rank hashes what it wrote; rank 0 records them all in the manifest.
        mine = checkpoint_dir.checksums(tmp, world.new_rank, len(world.ranks))
        every: list[Any] = [None] * len(world.ranks)  # filled by all_gather_object
        dist.all_gather_object(every, (mine, keys))
        manifest: dict[str, Any] = {"kind": "dying_gasp", "iteration": plan.iteration, "files": {},
                                    "writers": sorted(plan.writers.values()), "survivors": list(world.ranks),
                                    "keys": sorted({k for _, ks in every for k in ks})}
        for files, _ in every:
            manifest["files"].update(files)
        if me0:
            checkpoint_dir.write_manifest(tmp, manifest)
        dist.barrier()
        progress()
        _verify(tmp, world, manifest)
        progress()
        PROCESS_STOP.commit_point("the dying gasp's publication")  # (nothing it holds came from a collective cut short)
        if me0:
            checkpoint_dir.publish(save_dir, tmp, plan.iteration)
        dist.barrier()
    except BaseException:
        if me0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    total = sum(e["bytes"] for e in manifest["files"].values())
    result = DumpResult(plan.iteration, os.path.abspath(final), seconds, sorted(plan.writers.values()),
                        len(manifest["files"]), total)
    ev = events or getattr(getattr(prep.trainer, "session", None), "events", None)
    if ev is not None:
        ev.emit("checkpoint", kind="dying_gasp", iteration=plan.iteration, path=result.path, seconds=seconds,
                ranks=result.writers, survivors=list(world.ranks), main_items=mains,
                save_s=t_saved - t_save, prepare_s=prep.seconds, bytes=total, resync_bytes_received=resync_bytes,
                own_weights_bytes=sum(p.numel() * p.element_size() for p, _ in prep.params.values()))
    log.info("dying-gasp checkpoint: iteration %d written to %s in %.2f s (writers %s)",
             plan.iteration, final, seconds, result.writers)
    return result


def _sharded_keys(sd: dict[str, Any]) -> Iterator[str]:
    """Checkpoint keys this rank writes as main replica (as torch DCP's metadata names them)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
    for v in nested_values(sd):
        if isinstance(v, (ShardedTensor, ShardedObject)) and is_main_replica(v.replica_id):
            yield v.unique_key if isinstance(v, ShardedObject) else v.key
