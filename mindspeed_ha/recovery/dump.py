"""TTP dying-gasp checkpoint: after a fault the survivors write a standard, reshardable checkpoint.

Two parts:

* ``plan_dump`` (pure): from every rank's shard status, the newest iteration that every optimizer
  shard has a live holder for, and one writer per shard — or a refusal naming the shards that have no
  usable holder and the newest periodic checkpoint to fall back on.
* ``write_dying_gasp`` (collective over the survivors' default group, see ``groups.survivor_world``):
  model weights are re-synchronised from the writers' fp32 main params, every survivor builds its
  sharded state dict locally, one main replica per (key, offset) is elected among the survivors by
  rewriting ``replica_id``, and megatron-core dist_checkpointing saves into ``iter_XXXXXXX_tmp``;
  the files are checksummed into a manifest, re-read and compared, the metadata's coverage checked,
  and only then is the directory renamed and ``latest_checkpointed_iteration.txt`` replaced.

The result is the layout of ``mindspeed_ha.trainer.checkpoint.save`` (dp_reshardable optimizer), so
a plain ``--load`` resumes from it, with any DP size.

Driving it (the controller's side; ``tests/workers/dump_worker.py`` plays that part in tests):

0. at start, every rank: ``track(trainer)`` (RNG at the end of each update, writer pre-warm);
1. fault: stop the survivors; a rank inside its update lets it finish (``ha_updating`` drops at the
   parameter all-gather) — or, stopped before touching its shard, reports ``touched: False``;
2. collect ``local_status`` of the survivors, ``plan_dump(holders, newest_checkpoint(save))``,
   send the plan to the survivors (or report the refusal, ``plan.message()``);
3. every survivor: ``prep = prepare(trainer)`` (local), then
   ``world = groups.survivor_world(survivors, rank, host, port, generation)``, then
   ``write_dying_gasp(prep, plan, world, save_dir)``;
4. a survivor lost during 3 (an exception on the others): re-plan without it and repeat 3 from
   ``survivor_world`` with ``generation + 1``, reusing ``prep``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist

from mindspeed_ha.events import get_logger

log = get_logger("dump")
MANIFEST = "ha_manifest.json"


class DumpError(RuntimeError):
    """Nothing was written (or the temporary directory was removed): the dump did not happen."""


# ================================================================================================
# Planning
# ================================================================================================
@dataclasses.dataclass(frozen=True)
class DumpPlan:
    ok: bool
    iteration: int | None = None
    writers: dict = dataclasses.field(default_factory=dict)   # shard (sorted replica group) -> rank
    at_target: tuple = ()     # live ranks whose shard is (or, once finished, will be) at `iteration`
    finishing: tuple = ()     # live ranks inside their update: they must finish it before the dump
    missing: tuple = ()       # shards with no live holder at all (every replica lost)
    reason: str = ""
    fallback: tuple | None = None  # (iteration, path) of the newest periodic checkpoint, or None

    def message(self) -> str:
        if self.ok:
            return (f"dying-gasp checkpoint of iteration {self.iteration}: writers "
                    f"{sorted(self.writers.values())}")
        fb = (f"fall back to the newest periodic checkpoint, iteration {self.fallback[0]} in {self.fallback[1]}"
              if self.fallback else "no periodic checkpoint exists to fall back on")
        return f"dying-gasp checkpoint refused, nothing written: {self.reason}; {fb}"

    def to_json(self) -> str:
        """The plan as the controller sends it to the survivors (shard tuples as "r,r" keys)."""
        d = dataclasses.asdict(self)
        d["writers"] = {",".join(map(str, g)): r for g, r in self.writers.items()}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "DumpPlan":
        d = json.loads(text)
        d["writers"] = {tuple(int(r) for r in g.split(",")): int(w) for g, w in d["writers"].items()}
        for k in ("at_target", "finishing"):
            d[k] = tuple(d[k])
        d["missing"] = tuple(tuple(g) for g in d["missing"])
        d["fallback"] = tuple(d["fallback"]) if d["fallback"] else None
        return cls(**d)


def _servable(h: dict) -> set:
    """Iterations a holder's shard can be written at.

    Not updating: its ``iteration``. Updating: the optimizer update toward ``iteration + 1`` is local
    arithmetic, so a holder that has begun changing its shard finishes it (the shard is half-updated
    until then and can serve neither iteration); one stopped before touching it (``touched`` False,
    e.g. blocked in the grad-norm all-reduce, which a dead peer never completes) still holds
    ``iteration`` and cannot advance.
    """
    if not h.get("alive", True):
        return set()
    it = int(h["iteration"])
    if not h.get("updating", False):
        return {it}
    return {it + 1} if h.get("touched", True) else {it}


def plan_dump(holders: dict, fallback: tuple | None = None) -> DumpPlan:
    """``holders``: rank -> {"iteration", "updating", "replica_group", "alive"[, "touched"]} for every
    rank of the job (dead ones included: their replica group says which shard is at stake).
    ``fallback``: (iteration, path) of the newest periodic checkpoint, for the refusal message."""
    shards: dict[tuple, list[int]] = {}
    for rank, h in holders.items():
        group = tuple(sorted(int(r) for r in h["replica_group"]))
        if rank not in group:
            raise ValueError(f"rank {rank} is not in its own replica group {list(group)}")
        shards.setdefault(group, []).append(rank)
    for group, members in shards.items():
        if sorted(members) != list(group) and any(r in holders for r in group if r not in members):
            raise ValueError(f"replica group {list(group)} is not reported consistently by its ranks")

    missing = tuple(sorted(g for g in shards if not any(_servable(holders[r]) for r in shards[g] if r in holders)))
    if missing:
        lost = ", ".join(str(list(g)) for g in missing)
        return DumpPlan(False, missing=missing, fallback=fallback,
                        reason=f"no live holder for shard(s) with replica group {lost} (every replica lost)")

    per_shard = {g: set().union(*(_servable(holders[r]) for r in shards[g] if r in holders)) for g in shards}
    common = set.intersection(*per_shard.values()) if per_shard else set()
    if not common:
        detail = "; ".join(f"{list(g)}: {sorted(v)}" for g, v in sorted(per_shard.items()))
        return DumpPlan(False, fallback=fallback,
                        reason=f"the live holders cannot be brought to one iteration ({detail})")
    target = max(common)
    writers, at_target = {}, []
    for g in sorted(shards):
        able = [r for r in sorted(shards[g]) if r in holders and target in _servable(holders[r])]
        at_target += able
        # Prefer a holder already at rest at the target (nothing to wait for), then the lowest rank.
        writers[g] = min(able, key=lambda r: (bool(holders[r].get("updating")), r))
    finishing = tuple(sorted(r for r, h in holders.items()
                             if h.get("alive", True) and h.get("updating") and h.get("touched", True)))
    return DumpPlan(True, target, writers, tuple(sorted(at_target)), finishing, fallback=fallback)


def newest_checkpoint(save_dir: str | None) -> tuple | None:
    """(iteration, path) that ``--load save_dir`` would pick, or None."""
    from mindspeed_ha.trainer import checkpoint
    if not save_dir:
        return None
    it = checkpoint.read_tracker(save_dir)
    return (it, os.path.abspath(checkpoint.iter_dir(save_dir, it))) if it is not None else None


# ================================================================================================
# Per-rank state the dump needs that the live objects no longer hold
# ================================================================================================
def _rng_snapshot() -> dict:
    from megatron.core import tensor_parallel
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


class StepState:
    """RNG states at the end of recent iterations. A fault lands mid-step, after the forward of the
    next step has drawn dropout masks; the checkpoint needs the RNG as it was when the shard's update
    finished (nothing draws random numbers between that and the next forward)."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.rng: dict[int, dict] = {}
        self.prewarm_thread = None

    def snapshot(self, iteration: int) -> None:
        self.rng[iteration] = _rng_snapshot()
        for old in sorted(self.rng)[:-self.keep]:
            del self.rng[old]


def _import_checkpoint_modules() -> None:
    import torch.distributed.checkpoint  # noqa: F401  (runs in the writer's manager process)


_writer_manager = None


def _warm_writer() -> None:
    """dist_checkpointing's first save spawns a multiprocessing manager whose server then imports
    torch when it first unpickles write results: seconds each on a busy host. Do both now, with the
    import in the server's initializer — two client threads unpickling concurrently there can race
    on that import ("partially initialized module") if it is left to the first requests."""
    global _writer_manager
    import multiprocessing.managers
    from torch import multiprocessing as mp
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    if fa._results_queue is not None:
        return
    manager = multiprocessing.managers.SyncManager(ctx=mp.get_context("spawn"))
    manager.start(_import_checkpoint_modules)
    queue = manager.Queue()
    if fa._results_queue is None:  # a save that started meanwhile made its own: leave it that one
        fa._results_queue, _writer_manager = queue, manager
    else:
        manager.shutdown()


_prewarm_thread = None


def prewarm_writer():
    """Start the checkpoint writer's helper process in the background (see ``_warm_writer``), so
    that a rank whose first write is the dying gasp does not pay for it then. (The script must guard
    ``if __name__ == "__main__"``, as any script that saves must.)"""
    import threading
    global _prewarm_thread
    _prewarm_thread = threading.Thread(target=_warm_writer, name="ha-writer-prewarm", daemon=True)
    _prewarm_thread.start()
    return _prewarm_thread


def release_writer(timeout: float = 300.0) -> None:
    """At the end of a job: wait for a pre-warm still starting the manager and shut that manager
    down. Otherwise a short job on a busy host exits while ``start()`` is under way: the manager's
    finalizer is registered only when ``start()`` returns, too late for the exit handlers, and
    multiprocessing's exit then joins the (non-daemonic) manager process forever."""
    global _writer_manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    if _prewarm_thread is not None:
        _prewarm_thread.join(timeout)
    if _writer_manager is not None:  # then fa's queue is this manager's (set together)
        fa._results_queue = None
        _writer_manager.shutdown()
        _writer_manager = None


def track(trainer, prewarm: bool = True) -> StepState:
    """Call once after ``trainer.setup()`` (the processor would do it on start)."""
    state = StepState()
    if prewarm:
        state.prewarm_thread = prewarm_writer()
    opt = trainer.optimizer
    state.snapshot(trainer.iteration)  # after setup/--load, before any forward: the current RNG
    if hasattr(opt, "ha_add_listener"):
        opt.ha_add_listener(lambda event, it: state.snapshot(it) if event == "update_end" else None)
    trainer.ha_step_state = state
    return state


def local_status(trainer) -> dict:
    """This rank's entry for ``plan_dump`` (the processor reports the same to the controller)."""
    opt = trainer.optimizer
    topo = getattr(opt, "ha_topology", None)
    rank = dist.get_rank() if topo is None else topo.rank
    return {"rank": rank, "iteration": int(getattr(opt, "ha_iteration", trainer.iteration)),
            "updating": bool(getattr(opt, "ha_updating", False)), "touched": bool(getattr(opt, "ha_touched", True)),
            "alive": True,
            "replica_group": list(topo.replica_group) if topo else [rank],
            "dp_ranks": list(topo.dp_ranks) if topo else [rank], "replica_num": topo.replica_num if topo else 1,
            "trainer_iteration": trainer.iteration}


def holders_from_status(statuses: list[dict], world_size: int) -> dict:
    """The ``holders`` argument of plan_dump from the survivors' ``local_status``: dead ranks get
    ``alive: False`` and the replica group their DP group's layout gives them."""
    from mindspeed_ha.replica.topology import ReplicaTopology
    holders = {s["rank"]: {k: s[k] for k in ("iteration", "updating", "touched", "replica_group", "alive") if k in s}
               for s in statuses}
    for s in statuses:
        for r in s["dp_ranks"]:
            if r not in holders:
                topo = ReplicaTopology(r, tuple(s["dp_ranks"]), s["replica_num"])
                holders[r] = {"iteration": -1, "updating": False, "replica_group": topo.replica_group, "alive": False}
    for r in range(world_size):
        if r not in holders:  # a whole DP group dead: its shards are unknown here, report them lost
            holders[r] = {"iteration": -1, "updating": False, "replica_group": [r], "alive": False}
    return holders


# ================================================================================================
# Writing
# ================================================================================================
@dataclasses.dataclass
class DumpResult:
    iteration: int
    path: str
    seconds: float
    writers: list
    files: int
    bytes: int


def _position(param, ps) -> tuple:
    """Which copy of a parameter this is: same position = same tensor (DP peers)."""
    if getattr(param, "allreduce", True):
        return ("dense", ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    return ("expert", ps.get_expert_tensor_parallel_rank(), ps.get_expert_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank())


@dataclasses.dataclass
class Prepared:
    """What a survivor reads while its old process groups still exist (see ``prepare``)."""
    trainer: object
    status: dict
    sd: dict                  # sharded state dict of the live state (model tensors are the parameters)
    step_state: object        # StepState or None
    params: dict              # parameter name -> (parameter, position)
    shard: list               # this rank's shard description, with positions
    seconds: float


def prepare(trainer, abandon_update: bool = False) -> Prepared:
    """Local, no collective. Call on every survivor once it has stopped (and finished an update it
    had begun), BEFORE ``groups.survivor_world``: building a sharded state dict asks megatron's
    parallel_state, some of whose getters need the old groups still registered.

    ``abandon_update``: this rank was stopped inside its update window but before touching its shard
    (a collective before the Adam arithmetic — the grad-norm all-reduce — was interrupted; the
    arithmetic itself has no collective and the window closes before the parameter all-gather).
    Its shard is still at ``ha_iteration``; the window is closed without counting an update."""
    from megatron.core import parallel_state as ps
    from mindspeed_ha.replica.optimizer import _inner_optimizers
    from mindspeed_ha.trainer import checkpoint
    t0 = time.perf_counter()
    opt = trainer.optimizer
    if not hasattr(opt, "ha_export_shard"):
        raise DumpError("the dying-gasp checkpoint needs the replica optimizer (--enable-high-availability)")
    if opt.ha_updating and abandon_update:
        opt.ha_updating = False
    if opt.ha_updating:
        raise DumpError(f"rank {opt.ha_topology.rank} is inside its optimizer update; finish it first")
    params = {}
    for inner in _inner_optimizers(opt):
        for p, name in inner.param_to_name.items():
            params[name] = (p, _position(p, ps))
    shard = opt.ha_shard_description()
    for d in shard:
        d["pos"] = params[d["param"]][1]
    sd = checkpoint.state_dict(trainer)
    return Prepared(trainer, local_status(trainer), sd, getattr(trainer, "ha_step_state", None), params, shard,
                    time.perf_counter() - t0)


def _resync_model_weights(prep: Prepared, plan: DumpPlan, world) -> None:
    """Model weights := the writers' fp32 main params (cast like the distributed optimizer's own
    copy). A fault between the shard updates and the parameter all-gather leaves stale weights for
    other ranks' shards; this is that all-gather, from the chosen holders only."""
    me = world.rank
    dev = next(iter(prep.params.values()))[0].device  # NCCL/HCCL broadcast device tensors only
    descs = [None] * len(world.ranks)
    dist.all_gather_object(descs, prep.shard if me in plan.writers.values() else None)
    for src, desc in enumerate(descs):
        if desc is None:
            continue
        if world.original(src) == me:
            exported = prep.trainer.optimizer.ha_export_shard()
            blob = torch.cat([exported[f"{d['name']}.param"].reshape(-1).float() for d in desc]) if desc \
                else torch.empty(0, device=dev)
        else:
            blob = torch.empty(sum(d["end"] - d["start"] for d in desc), dtype=torch.float32, device=dev)
        dist.broadcast(blob, src=src)
        if world.original(src) == me:
            continue
        off = 0
        with torch.no_grad():
            for d in desc:
                n = d["end"] - d["start"]
                p, pos = prep.params.get(d["param"], (None, None))
                if p is not None and pos == tuple(d["pos"]):
                    p.data.view(-1)[d["start"]:d["end"]].copy_(blob[off:off + n])
                off += n


def _normalize(prep: Prepared, plan: DumpPlan) -> bool:
    """Bring the common part of the state dict to ``plan.iteration``; True if this rank's RNG state
    for that iteration is known."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    trainer, sd = prep.trainer, prep.sd
    behind = plan.iteration - trainer.iteration
    if behind not in (0, 1):
        # The trainer's counters move right after optimizer.step(): a survivor is at T or T-1.
        raise DumpError(f"rank {prep.status['rank']}: trainer at iteration {trainer.iteration}, "
                        f"cannot describe iteration {plan.iteration}")
    gbs = trainer.global_batch_size
    sd["iteration"] = plan.iteration
    sd["consumed_samples"] = trainer.consumed_samples + behind * gbs
    sd["args"].consumed_train_samples = sd["consumed_samples"]
    sched = dict(trainer.scheduler.state_dict())
    sched["num_steps"] += behind * gbs  # load_state_dict recomputes lr and wd from it
    sd["opt_param_scheduler"] = sched
    state = prep.step_state
    rng = state.rng.get(plan.iteration) if state is not None else None
    old = sd["rng_state"]
    if rng is None and state is None and behind == 0:
        rng = old.data[0]  # untracked: the live RNG, right only if no forward has run since
    sd["rng_state"] = ShardedObject(old.key, [rng], old.global_shape, old.global_offset, replica_id=old.replica_id)
    return rng is not None


def _ident(obj) -> tuple:
    fr = getattr(obj, "flattened_range", None)
    return (obj.key, tuple(obj.global_offset), (fr.start, fr.stop) if fr is not None else None)


def _elect(sd: dict, plan: DumpPlan, world, eligible: dict) -> int:
    """Rewrite replica_id so that every (key, offset) has exactly one main replica among the
    survivors: a plan writer if one is eligible, else the lowest eligible survivor. ``eligible``
    says per section whether this rank's copy is at the plan's iteration (optimizer: shard at the
    target; rng: snapshot of the target; model: always, after the resync). Every survivor sees the
    same offers, so every survivor computes the same election. Returns this rank's main count."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, apply_factories
    apply_factories(sd)
    mine = []
    for section, sub in sd.items():
        if not isinstance(sub, (dict, list)) and not isinstance(sub, ShardedBase):
            continue
        kind = "optimizer" if section == "optimizer" else "rng" if section == "rng_state" else "model"
        values = [sub] if isinstance(sub, ShardedBase) else nested_values(sub)
        for v in values:
            if isinstance(v, ShardedBase):
                mine.append((kind, v))
    offer = list(dict.fromkeys((_ident(v), eligible[kind]) for kind, v in mine))
    offers = [None] * len(world.ranks)
    dist.all_gather_object(offers, offer)
    writers = {world.ranks.index(r) for r in plan.writers.values() if r in world.ranks}
    chosen: dict[tuple, int] = {}
    for src, items in enumerate(offers):
        for ident, ok in items:
            chosen.setdefault(ident, None)
            if not ok:
                continue
            cur = chosen[ident]
            if cur is None or ((src in writers) and cur not in writers):
                chosen[ident] = src
    lost = [i for i, c in chosen.items() if c is None]
    if lost:
        raise DumpError(f"no eligible survivor holds {len(lost)} checkpoint item(s), e.g. {lost[:3]}")
    me, done, count = world.new_rank, set(), 0
    for _, v in mine:
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


def _digest(path: str) -> str:
    """CRC-32 of the file: the check is for torn and partial writes, not tampering, and it runs
    twice per file inside the dump (after the write and in the re-read) — 4x faster than blake2b."""
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _own_files(tmp: str, new_rank: int, size: int) -> list[str]:
    names = sorted(os.listdir(tmp))
    ours = [n for n in names if n.startswith(f"__{new_rank}_")]
    if new_rank == 0:  # rank 0 also answers for the files no rank-numbered name claims
        ours += [n for n in names if not any(n.startswith(f"__{r}_") for r in range(size)) and n != MANIFEST]
    return ours


def _verify(tmp: str, world, manifest: dict) -> None:
    """Re-read another rank's files and compare with the manifest; rank 0 checks that the torch
    DCP metadata only points into manifest files, inside their sizes."""
    size = len(world.ranks)
    other = (world.new_rank + 1) % size
    errors = []
    for name, entry in manifest["files"].items():
        if entry["rank"] != other:
            continue
        path = os.path.join(tmp, name)
        if not os.path.exists(path) or os.path.getsize(path) != entry["bytes"] or _digest(path) != entry["crc32"]:
            errors.append(f"{name}: missing or differs from the manifest")
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
    found = [None] * size
    dist.all_gather_object(found, errors)
    bad = [e for errs in found for e in errs]
    if bad:
        raise DumpError("verification failed: " + "; ".join(bad[:5]))


def write_dying_gasp(prep: Prepared, plan: DumpPlan, world, save_dir: str, events=None) -> DumpResult:
    """Collective over ``world``, the survivors' default group from ``groups.survivor_world``
    (called after ``prepare``). ``plan`` must be the same on every survivor."""
    from megatron.core import dist_checkpointing
    from mindspeed_ha.trainer import checkpoint
    t0 = time.perf_counter()
    if not plan.ok:
        raise DumpError(plan.message())
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
    try:
        _resync_model_weights(prep, plan, world)
        rng_ok = _normalize(prep, plan)
        sd = prep.sd
        mains = _elect(sd, plan, world, {"optimizer": at_target, "rng": rng_ok, "model": True})
        keys = sorted(set(_sharded_keys(sd)))
        warm = getattr(prep.step_state, "prewarm_thread", None)
        if warm is not None:
            warm.join()  # never start a second writer manager next to a half-started one
        session = getattr(prep.trainer, "session", None)
        if session is not None:
            session.fire("checkpoint", plan.iteration)  # fault drills: a rank lost mid-dump
        dist.barrier()
        t_save = time.perf_counter()
        dist_checkpointing.save(sd, tmp, validate_access_integrity=True, content_metadata=checkpoint.SHARDING)
        t_saved = time.perf_counter()
        # Checksums: each rank hashes what it wrote; rank 0 records them all in the manifest.
        mine = {n: {"rank": world.new_rank, "bytes": os.path.getsize(os.path.join(tmp, n)),
                    "crc32": _digest(os.path.join(tmp, n))} for n in _own_files(tmp, world.new_rank, len(world.ranks))}
        every = [None] * len(world.ranks)
        dist.all_gather_object(every, (mine, keys))
        manifest = {"kind": "dying_gasp", "iteration": plan.iteration, "files": {},
                    "writers": sorted(plan.writers.values()), "survivors": list(world.ranks),
                    "keys": sorted({k for _, ks in every for k in ks})}
        for files, _ in every:
            manifest["files"].update(files)
        if me0:
            _write_json(os.path.join(tmp, MANIFEST), manifest)
        dist.barrier()
        _verify(tmp, world, manifest)
        if me0:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(save_dir)
            _write_tracker(save_dir, plan.iteration)
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
                save_s=t_saved - t_save, prepare_s=prep.seconds, bytes=total)
    log.info("dying-gasp checkpoint: iteration %d written to %s in %.2f s (writers %s)",
             plan.iteration, final, seconds, result.writers)
    return result


def _sharded_keys(sd: dict):
    """Checkpoint keys this rank writes as main replica (as torch DCP's metadata names them)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
    for v in nested_values(sd):
        if isinstance(v, (ShardedTensor, ShardedObject)) and is_main_replica(v.replica_id):
            yield v.unique_key if isinstance(v, ShardedObject) else v.key


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tracker(root: str, iteration: int) -> None:
    from mindspeed_ha.trainer.checkpoint import TRACKER
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))
    _fsync_dir(root)
