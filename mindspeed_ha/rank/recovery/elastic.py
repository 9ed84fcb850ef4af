"""The rank side of an elastic resize: the job trains on at another data-parallel size, in process.

Every rank of the new layout, in step (the plan is ``mindspeed_ha.plan``'s ``plan_elastic`` for a
scale-in, ``plan_scale_out`` for a scale-out):

1. a rank already training notes its optimizer shard in parameter coordinates
   (``ha_state_ranges``) — the old layout's; a newcomer (a fresh process) holds nothing;
2. the new layout's ranks become the job's default group, in their new order, every old group
   forgotten (``comm.groups.new_epoch``);
3. megatron-core's groups, DDP and a new optimizer at the new size: a running rank re-wraps the
   model it has (``resize``: its weights never move, it keeps its TP/PP position); a newcomer
   sets itself up from scratch, without a ``--load`` — a newcomer of the built-in trainer did so
   before it registered, for the job's own layout (``rank.session.build_ahead``), and where the plan
   lays the job out so, its build stands and only its groups connect here
   (``enter_built_layout``; elsewhere it builds again);
4. fp32 main values and Adam moments move from the plan's writers into the new shards, point to
   point (``replica.reshard``), every new entry gets the old ``step``; each newcomer takes counters,
   scheduler, data position and RNG from the kept rank at its TP/PP position; the weights are
   gathered from the new shards, as the end of an optimizer step does.

The controller decides and plays it (``control/playbooks.ELASTIC`` and ``SCALE_OUT``): ranks left
out are told to exit; the new layout then rolls back to the plan's iteration and trains on. With a
pipeline, the plan's order puts each stage's ranks together (megatron-core lays stages outermost), so
every kept rank keeps its stage; with MoE, replicas stay and come in blocks that hold every expert
between them (``plan_elastic``'s ``experts``), so every kept rank keeps its experts. A pipeline's
newcomer replica is one rank per stage, so it comes back from as many nodes (started together). Not
built: a new size at which the optimizer instance count changes.
"""
from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from mindspeed_ha.comm.groups import DEFAULT_TIMEOUT
from mindspeed_ha.comm.interruptible import PROCESS_STOP
from mindspeed_ha.events import get_logger
from mindspeed_ha.replica.optimizer import set_step_counts, step_count
from mindspeed_ha.replica.reshard import CHUNK_BYTES, described, exchange, schedule, state_io

if TYPE_CHECKING:
    from mindspeed_ha.plan import ElasticPlan
    from mindspeed_ha.trainer_state.interface import TrainerInterface

log = get_logger("recovery.elastic")


def resize(trainer: TrainerInterface, plan: ElasticPlan, rank: int, store_host: str, store_port: int,
           generation: int, backend: str = "gloo", host_store: bool = False,
           timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """This rank's part of ``plan`` (an ok ``ElasticPlan``), meeting the others over the store at
    ``store_host:store_port`` (the controller's; ``host_store``: the first rank of the new layout
    serves it). ``trainer``: a running one, or a newcomer's not set up yet (no optimizer).
    Returns timings and bytes moved."""
    entered = enter_layout(trainer, plan, rank, store_host, store_port, generation, backend, host_store,
                           timeout=timeout)
    return move_state(trainer, plan, rank, entered)


def parallel_sizes() -> tuple[int, int]:
    """(pipeline stages, expert-parallel size) of the job's layout: what an elastic plan keeps of it."""
    from megatron.core import parallel_state as ps
    return int(ps.get_pipeline_model_parallel_world_size()), int(ps.get_expert_model_parallel_world_size())


def holdings(trainer: TrainerInterface) -> dict[str, Any]:
    """Step 1: what this rank brings to a resize — its optimizer shard in parameter coordinates (live
    views of the tensors: they stay valid while the rank re-wraps its model) and Adam's step; a
    newcomer brings nothing. A resize that does not complete leaves the trainer between two layouts;
    these holdings, kept, are then still the rank's state, and the next resize starts from them."""
    old = None if getattr(trainer, "built_ahead", None) is not None else trainer.optimizer  # (built ahead: no state)
    return {"old_ranges": {} if old is None else old.ha_state_ranges(), "step": None if old is None else step_count(old),
            "scalers": None if old is None else old.ha_scaler_states(), "newcomer": old is None}


def enter_layout(trainer: TrainerInterface, plan: ElasticPlan, rank: int, store_host: str, store_port: int,
                 generation: int, backend: str = "gloo", host_store: bool = False,
                 held: dict[str, Any] | None = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                 remake: dict[str, str] | None = None) -> dict[str, Any]:
    """Steps 1-3 (``held``: ``holdings`` taken before an earlier resize that did not complete;
    ``timeout``: the job's collective timeout, every group of the new layout's; ``remake``: the old
    groups whose communicators the new layout may not keep, None: all). A
    newcomer whose loop builds its own model (Megatron-LM's) has only its groups afterwards (no
    optimizer yet): ``move_state`` follows once its loop has built them."""
    from mindspeed_ha.comm import groups
    from mindspeed_ha.device.memory import PeakExtra
    t = {"start": time.perf_counter()}
    mem = PeakExtra().start()  # (to the end of move_state: the new layout's allocations and the move's)
    held = held or holdings(trainer)
    world = groups.new_epoch(plan.order, rank, store_host, store_port, generation, timeout=timeout, backend=backend,
                             host_rank=plan.order[0] if host_store else None, remake=remake)
    t["group"] = time.perf_counter()
    # A newcomer built ahead for this very layout: its model, DDP and optimizer stand in its groups.
    built = getattr(trainer, "built_ahead", None) is not None and trainer.enter_built_layout(plan.order)
    if not built and trainer.optimizer is None:
        trainer.setup(joining=True)
    elif not built:
        trainer.resize(keep=[t for values in held["old_ranges"].values() for t in values])
    t["resize"] = time.perf_counter()
    return {"t": t, "world": world, "mem": mem, "built_ahead": built, "communicators": groups.layout_communicators(),
            **held}


def move_state(trainer: TrainerInterface, plan: ElasticPlan, rank: int, entered: dict[str, Any],
               chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """Step 4, with every rank of the new layout, in messages of at most ``chunk_bytes``."""
    from mindspeed_ha.rank.recovery.restore import transfer_bookkeeping
    t, old_ranges, newcomer = entered["t"], entered["old_ranges"], entered["newcomer"]
    t["built"] = time.perf_counter()  # (a newcomer of Megatron-LM's loop: its model built meanwhile)
    writer = rank in plan.writers.values()
    new = trainer.optimizer
    new_ranges = new.ha_state_ranges()
    every: list[Any] = [None] * len(plan.order)  # filled by all_gather_object
    dist.all_gather_object(every, {"held": described(old_ranges) if writer else [],
                                   "wanted": described(new_ranges), "step": entered["step"],
                                   "scalers": entered["scalers"] if writer else None})
    steps = {e["step"] for e in every if e["held"]}
    if len(steps) != 1:
        raise RuntimeError(f"the writers' optimizer step counts differ: {sorted(map(str, steps))}")
    scalers = [e["scalers"] for e in every if e["held"]]
    if any(sc != scalers[0] for sc in scalers):
        raise RuntimeError(f"the writers' loss scalers differ: {scalers}")
    moves = schedule({i: e["held"] for i, e in enumerate(every) if e["held"]},
                     {i: e["wanted"] for i, e in enumerate(every)})
    read, _ = state_io(old_ranges)
    _, write = state_io(new_ranges)
    width = len(next(iter(new_ranges.values()), (None, None, None)))  # main values, then the moments
    got = exchange(moves, entered["world"].new_rank, read, write, width=width, chunk_bytes=chunk_bytes)
    t["exchanged"] = time.perf_counter()
    new.ha_install_state_ranges(new_ranges)
    set_step_counts(new, steps.pop())
    new.ha_install_scaler_states(scalers[0])
    new.ha_iteration = plan.iteration
    transfer_bookkeeping(trainer, plan.sources, rank)
    t["bookkept"] = time.perf_counter()
    trainer.resync_weights()
    PROCESS_STOP.commit_point("the resize")  # (state, counters and weights all moved by collectives none cut short)
    t["moved"] = time.perf_counter()
    entered["mem"].stop()
    out = {"dp": plan.dp, "new_rank": entered["world"].new_rank, "received": got, "newcomer": newcomer,
           "built_ahead": entered.get("built_ahead", False),
           "shard_bytes": sum(v.numel() * v.element_size() for vals in new_ranges.values() for v in vals),
           "extra_mem_bytes": entered["mem"].bytes,
           "group_s": round(t["group"] - t["start"], 4), "relayout_s": round(t["built"] - t["group"], 4),
           "move_s": round(t["moved"] - t["built"], 4), "seconds": round(t["moved"] - t["start"], 4),
           # (the move's parts: the state's exchange, a newcomer's counters and RNG, the weights' gather)
           "exchange_s": round(t["exchanged"] - t["built"], 4), "bookkeeping_s": round(t["bookkept"] - t["exchanged"], 4),
           "weights_s": round(t["moved"] - t["bookkept"], 4)}
    log.info("scaled %s to data-parallel size %d: %s", plan.direction, plan.dp, out)
    return out
