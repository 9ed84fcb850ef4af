"""The rank side of an elastic scale-in: the same processes train on at a smaller data-parallel size.

Every kept rank, in step (the plan is ``mindspeed_ha.plan.plan_elastic``'s):

1. notes its optimizer shard in parameter coordinates (``ha_state_ranges``) — the old layout's;
2. makes the kept ranks the job's default group, in their new order, forgetting every old group
   (``comm.groups.new_epoch``);
3. has the trainer rebuild megatron-core's groups, DDP around the same model and a new optimizer at
   the new size (``relayout``): weights never move, every kept rank keeps its TP/PP position;
4. moves fp32 main values and Adam moments from the plan's writers into the new shards, point to
   point (``replica.reshard``), and gives every new entry the old ``step``.

The controller decides and plays it (``control/playbooks.ELASTIC``): the ranks left out are told to
exit, the kept ones then roll back to the plan's iteration at the new layout. Not built yet: scale-out,
Megatron-LM's loop, PP > 1 (the new order assumes data-parallel ranks outermost after TP), and a new
size at which the optimizer instance count changes.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mindspeed_ha.events import get_logger
from mindspeed_ha.replica.optimizer import _inner_optimizers
from mindspeed_ha.replica.reshard import described, exchange, schedule, state_io

log = get_logger("recovery.elastic")


def _step(optimizer) -> float:
    """Adam's step count (every entry has the same; a shard can be empty)."""
    for inner in _inner_optimizers(optimizer):
        for st in inner.optimizer.state.values():
            if "step" in st:
                return float(st["step"])
    return 0.0


def scale_in(trainer, plan, rank: int, store_host: str, store_port: int, generation: int,
             backend: str = "gloo", host_store: bool = False) -> dict:
    """This kept rank's part of ``plan`` (an ok ``ElasticPlan``), meeting the others over the store
    at ``store_host:store_port`` (the controller's; ``host_store``: the first kept rank serves it).
    Returns timings and bytes moved."""
    from mindspeed_ha.comm import groups
    t = {"start": time.perf_counter()}
    order = [r for rep in plan.kept for r in rep]
    old = trainer.optimizer
    old_ranges = old.ha_state_ranges()
    writer = rank in plan.writers.values()
    world = groups.new_epoch(order, rank, store_host, store_port, generation, backend=backend,
                             host_rank=order[0] if host_store else None)
    t["group"] = time.perf_counter()
    trainer.relayout()
    new = trainer.optimizer
    t["relayout"] = time.perf_counter()
    new_ranges = new.ha_state_ranges()
    every = [None] * len(order)
    dist.all_gather_object(every, {"held": described(old_ranges) if writer else [],
                                   "wanted": described(new_ranges), "step": _step(old)})
    steps = {e["step"] for e in every if e["held"]}
    if len(steps) != 1:
        raise RuntimeError(f"the writers' Adam step counts differ: {sorted(steps)}")
    moves = schedule({i: e["held"] for i, e in enumerate(every) if e["held"]},
                     {i: e["wanted"] for i, e in enumerate(every)})
    read, _ = state_io(old_ranges)
    _, write = state_io(new_ranges)
    got = exchange(moves, world.new_rank, read, write)
    step = steps.pop()
    for inner in _inner_optimizers(new):
        for st in inner.optimizer.state.values():
            st["step"] = torch.tensor(step, dtype=torch.float32)
    new.ha_iteration = plan.iteration
    trainer.resync_weights()
    t["moved"] = time.perf_counter()
    out = {"dp": plan.dp, "new_rank": world.new_rank, "received": got,
           "group_s": round(t["group"] - t["start"], 4), "relayout_s": round(t["relayout"] - t["group"], 4),
           "move_s": round(t["moved"] - t["relayout"], 4), "seconds": round(t["moved"] - t["start"], 4)}
    log.info("scaled in to data-parallel size %d: %s", plan.dp, out)
    return out
