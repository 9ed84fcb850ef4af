"""scale-out (with ``--enable-elastic-training``): the ranks of a lost node registered again (or new
ones came); at a step boundary, the job grows back to a larger data-parallel size. No fault: the
episode starts at the newcomers' registration.

    resize   status -> plan -> scale-out | re-enter
    resume   rollback -> resume (the new layout)

The newcomers join as whole replicas (``plan.plan_scale_out``); a plan that cannot be made leaves
them out, and the job trains on as it was (entering its own layout again on new communicators where a
rank had begun its next step when the pause came: ``re-enter``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ... import plan as planner
from ..policy.ledger import KIND_SCALE_OUT
from ..policy.rounds import DONE, NEXT, Answers, Fail, Round, Step
from .retry import RESUME, ROLLBACK, STATUS, then
from .episode import Episode, log
from .scale_in import dp_replicas, fresh_rollback, kept, plan_for, resize_args, resize_to_plan
from .strategy import Stage, Strategy

RESIZE_S = 120.0
RESUME_S = 30.0


def _plan_scale_out(ep: Episode) -> Step:
    """Newcomers (``ep.joiners``: the returned ranks, registered, holding nothing) join as whole
    replicas; a plan that cannot be made leaves them out and the job trains on as it was."""
    layout = next((st["layout"] for st in ep.statuses.values() if st.get("layout")), None)
    replicas = dp_replicas(ep)
    if layout is None or not replicas:
        return Fail("no rank reported the job's layout (elastic needs the replica optimizer)")
    ep.running = sorted(r for rep in replicas for r in rep)
    groups = {r: ep.group_of(r) for r in ep.running if ep.group_of(r)}
    holders = {r: h for r, h in planner.holders(ep.world, ep.statuses, groups).items() if r in ep.running}
    ep.plan = planner.plan_scale_out(holders, replicas, ep.joiners, layout["global_batch"], layout["micro_batch"],
                                     layout["replica_num"], layout.get("stages", 1), layout.get("experts", 1),
                                     world=ep.world)
    ep.old_dp = len(replicas)
    ep.dropped = sorted(ep.plan.parked) if ep.plan.ok else list(ep.joiners)
    if not ep.plan.ok:
        if ep.plan.iteration is None:
            return Fail(ep.plan.message())
        ep.port.emit("scale_out_refused", reason=ep.plan.reason, newcomers=list(ep.joiners), dp=ep.old_dp)
        log.warning("elastic: %s; training goes on at data-parallel size %d", ep.plan.message(), ep.old_dp)
        ep.port.leave(ep.dropped, ep.plan.message())
        return _reenter_if_stopped(ep, holders, replicas, layout)
    ep.generation = ep.port.new_generation()
    ep.port.emit("resize_plan", iteration=ep.plan.iteration, dp=ep.plan.dp, old_dp=ep.old_dp,
                 kept=[list(r) for r in ep.plan.kept], parked=ep.dropped, added=sorted(ep.plan.sources),
                 writers=sorted(set(ep.plan.writers.values())), redundancy=ep.plan.redundancy,
                 generation=ep.generation)
    log.info("elastic: %s", ep.plan.message())
    return NEXT


def _reenter_if_stopped(ep: Episode, holders: planner.Holders, replicas: list[list[int]],
                        layout: dict[str, Any]) -> Step:
    """A refused scale-out: the running ranks train on. One that had begun its next step when the
    pause came was stopped inside it once its grace passed (its peers had parked): its communicators
    still hold that step's collectives, so the job enters its own layout again, on new ones (as after
    an interrupted resize), before it rolls back."""
    stopped = sorted(r for r in ep.running if (ep.statuses.get(r) or {}).get("stopped_in_step"))
    if not stopped:
        return NEXT
    again = plan_for(holders, replicas, layout)
    if not again.ok or again.dp != len(replicas):
        return Fail(f"rank(s) {stopped} stopped inside a step, and the job's layout cannot be entered again: "
                    f"{again.message()}")
    ep.reentry, ep.generation = again, ep.port.new_generation()
    log.info("elastic: rank(s) %s stopped inside a step: data-parallel size %d entered again on new communicators",
             stopped, again.dp)
    return NEXT


def _reentry_args(ep: Episode) -> dict[str, Any]:
    return resize_args(ep, ep.reentry)


def _reentered(ep: Episode, ans: Answers) -> Step:
    if ans.failed:
        return Fail(f"entering the job's layout again failed ({ans.why()})")
    ep.port.scaled(ep.reentry.dp, {r: a["replica_group"] for r, a in ans.ok.items() if a and a.get("replica_group")})
    return NEXT


def _scaled_out(ep: Episode, ans: Answers) -> Step:
    if ans.failed:
        return Fail(f"scale-out failed ({ans.why()})")
    ep.moved_bytes = sum(int((a or {}).get("received") or 0) for a in ans.ok.values())
    ep.port.scaled(ep.plan.dp, {r: a["replica_group"] for r, a in ans.ok.items() if a and a.get("replica_group")})
    if ep.dropped:
        ep.port.leave(ep.dropped, f"the job scaled out to data-parallel size {ep.plan.dp} without them")
    ep.phases["resize"] = round(max(float((a or {}).get("seconds") or 0) for a in ans.ok.values()), 4)
    ep.how = f"data-parallel size {ep.old_dp} -> {ep.plan.dp}"
    return DONE


def _new_layout(ep: Episode) -> list[int]:
    return kept(ep) if ep.plan.ok else ep.running


STRATEGY = Strategy(
    "scale-out", "--enable-elastic-training",
    handles=frozenset({KIND_SCALE_OUT}),
    stages=(Stage("resize", (STATUS, Round("plan", act=_plan_scale_out, timed=False),
                             Round("scale-out", order="scale-out", to=kept, args=resize_to_plan, decide=_scaled_out,
                                   when=lambda ep: ep.plan.ok),
                             Round("re-enter", order="scale-in", to=lambda ep: ep.running, args=_reentry_args,
                                   decide=_reentered, when=lambda ep: ep.reentry is not None)), RESIZE_S),
            Stage("resume", (dataclasses.replace(ROLLBACK, args=fresh_rollback, decide=then("rollback", NEXT),
                                                 when=None, to=_new_layout),
                             dataclasses.replace(RESUME, to=_new_layout)), RESUME_S)),
)
