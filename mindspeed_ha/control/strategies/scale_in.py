"""elastic-training (``--enable-elastic-training``): a lost rank with no spare to take its place: the job
drops the data-parallel replicas it was in and trains on at a smaller data-parallel size.

    resize   status -> plan -> scale-in
    resume   rollback -> resume (the kept ranks, data read at their new data-parallel rank)

The plan (``plan.plan_elastic``) keeps the replicas every shard of which has a live holder; each kept
rank builds its new layout and takes the optimizer state of its new shard from whoever holds it
(``scale-in``). With recover on too, a lost node is waited for first (``--ha-spare-wait``: recover's
restart round gives way to this). ``scale_out`` grows the job again with this module's layout parts.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ... import plan as planner
from ..policy.rounds import DONE, NEXT, Answers, Fail, Round, Step
from .retry import RESUME, ROLLBACK, STATUS, remake_args, then
from .episode import Episode, log
from .strategy import Stage, Strategy

RESIZE_S = 60.0
RESUME_S = 30.0


def dp_replicas(ep: Episode) -> list[list[int]]:
    """The job's data-parallel replicas now, from the ranks' data-parallel groups (job ranks): the
    d-th member of every group, the groups in their members' order (TP, then PP position)."""
    dp_groups = sorted({tuple(st["layout"]["dp_ranks"]) for st in ep.statuses.values() if st.get("layout")})
    return [[g[d] for g in dp_groups] for d in range(len(dp_groups[0]))] if dp_groups else []


def plan_for(holders: planner.Holders, replicas: list[list[int]], layout: dict[str, Any]) -> planner.ElasticPlan:
    """The layout ``replicas`` can keep (``plan_elastic``), with the job's batch and instances."""
    return planner.plan_elastic(holders, replicas, layout["global_batch"], layout["micro_batch"],
                                layout["replica_num"], layout.get("stages", 1), layout.get("experts", 1))


def _plan_elastic(ep: Episode) -> Step:
    layout = next((st["layout"] for st in ep.statuses.values() if st.get("layout")), None)
    replicas = dp_replicas(ep)
    if layout is None or not replicas:
        return Fail("no rank reported the job's layout (elastic needs the replica optimizer)")
    members = {r for rep in replicas for r in rep}
    groups = {r: ep.group_of(r) for r in members if ep.group_of(r)}
    holders = {r: h for r, h in planner.holders(ep.world, ep.statuses, groups).items() if r in members}
    plan = plan_for(holders, replicas, layout)
    if not plan.ok:
        return Fail(plan.message())
    # Ranks between two layouts (a resize that did not complete) enter one again, the same size included.
    unfinished = any(st.get("unfinished") for st in ep.statuses.values())
    if plan.dp == len(replicas) and not unfinished:
        return Fail("no rank is lost: nothing to scale in")
    if ep.port.host_rank() in plan.parked:
        return Fail(f"{plan.message()}: the controller's own rank {ep.port.host_rank()} would leave the job "
                    "(handing the controller over first is not built)")
    if plan.instances != layout["replica_num"]:
        return Fail(f"{plan.message()}: changing the optimizer instance count in process is not built "
                    f"(a global batch that divides by micro-batch x an even size keeps the twins)")
    ep.plan, ep.generation = plan, ep.port.new_generation()
    ep.dropped = sorted(members - {r for rep in plan.kept for r in rep})
    ep.old_dp = len(replicas)
    ep.port.emit("resize_plan", iteration=plan.iteration, dp=plan.dp, old_dp=ep.old_dp,
                 kept=[list(r) for r in plan.kept], parked=list(plan.parked), dropped=ep.dropped,
                 writers=sorted(set(plan.writers.values())), redundancy=plan.redundancy, generation=ep.generation)
    log.info("elastic: %s", plan.message())
    return NEXT


def resize_args(ep: Episode, plan: planner.ElasticPlan) -> dict[str, Any]:
    host, port = ep.port.store()
    return {"plan": plan.to_wire(), "store_host": host, "store_port": port, "generation": ep.generation,
            **remake_args(ep)}


def resize_to_plan(ep: Episode) -> dict[str, Any]:
    return resize_args(ep, ep.plan)


def _scaled_in(ep: Episode, ans: Answers) -> Step:
    if ans.failed:
        return Fail(f"scale-in failed ({ans.why()})")
    ep.moved_bytes = sum(int((a or {}).get("received") or 0) for a in ans.ok.values())
    ep.port.scaled(ep.plan.dp, {r: a["replica_group"] for r, a in ans.ok.items() if a and a.get("replica_group")})
    ep.port.leave(ep.dropped, f"the job scaled in to data-parallel size {ep.plan.dp} without them")
    seconds = max(float((a or {}).get("seconds") or 0) for a in ans.ok.values())
    ep.how = (f"data-parallel size {ep.old_dp} -> {ep.plan.dp}" if ep.plan.dp != ep.old_dp else
              f"data-parallel size {ep.old_dp} again: the interrupted resize undone")
    ep.port.emit("scaled_in", old_dp=ep.old_dp, dp=ep.plan.dp, iteration=ep.plan.iteration,
                 kept=[list(r) for r in ep.plan.kept], dropped=ep.dropped, parked=list(ep.plan.parked),
                 redundancy=ep.plan.redundancy, microbatches=ep.plan.microbatches, bytes=ep.moved_bytes,
                 seconds=round(seconds, 4))
    return DONE


def fresh_rollback(ep: Episode) -> dict[str, Any]:
    """A new layout: back to the plan's iteration, data read at the new data-parallel rank and size.
    (Its decision keeps the episode's ``how``: the resize, "data-parallel size 4 -> 2".)"""
    return {"iteration": ep.target, "fresh_data": True}


def kept(ep: Episode) -> list[int]:
    return sorted(r for rep in ep.plan.kept for r in rep)


STRATEGY = Strategy(
    "elastic-training", "--enable-elastic-training",
    # (communication failures: the survivors' view of a lost peer; without a lost rank the plan has nothing
    # to drop and the dump follows)
    handles=frozenset({"process-exit", "heartbeat-lost", "node-lost", "controller-lost", "comm-failure"}),
    stages=(Stage("resize", (STATUS, Round("plan", act=_plan_elastic, timed=False),
                             Round("scale-in", order="scale-in", to=kept, args=resize_to_plan, decide=_scaled_in)),
                  RESIZE_S),
            Stage("resume", (dataclasses.replace(ROLLBACK, args=fresh_rollback, decide=then("rollback", NEXT),
                                                 when=None, to=kept),
                             dataclasses.replace(RESUME, to=kept)), RESUME_S)))
