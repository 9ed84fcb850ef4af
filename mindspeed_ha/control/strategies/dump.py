"""dump (``--enable-high-availability``, always on under the others; MindSpeed's TTP): the survivors
write a verified dying-gasp checkpoint of the newest iteration every shard has a healthy holder for,
and the job ends. It is what a preempted job has time for, and where a failed recovery falls back to.

    dump     status -> plan -> write  (a writer lost: the others stop, plan again, write again)
"""
from __future__ import annotations

import time
from typing import Any

from ... import plan as planner
from ..policy.rounds import DONE, NEXT, Answers, Fail, Goto, Round, Step
from .retry import hung
from .episode import Episode, log
from .strategy import Stage, Strategy

DUMP_S = 120.0               # (grows with the state to write, and while its writers make progress)
DUMP_STATUS_WAIT_S = 15.0    # a live rank that has not parked by then (hung) is left out of the dump
WRITE_WAIT_S = 7 * 24 * 3600.0  # (the stage's own time limit, which grows with the state, ends a stuck write)


def _dump_status_to(ep: Episode) -> list[int]:
    # A hung rank will not answer. (One with nothing to save says so: corrupted, or still joining.)
    asked = sorted(ep.port.live() - hung(ep))
    log.info("dump: asking %d live rank(s) for their shard state", len(asked))
    return asked


def _dump_statuses(ep: Episode, ans: Answers) -> Step:
    refused = {r: why for r, why in ans.failed.items() if why not in ("lost", "no answer")}
    empty = {r: s.get("why", "") for r, s in ans.ok.items() if not s.get("holds", True)}
    if empty:
        log.info("dump: rank(s) %s hold nothing to save (%s)", sorted(empty), "; ".join(sorted(set(empty.values()))))
    # (every answer names the newest periodic checkpoint, one that holds nothing too: where to resume)
    fallbacks = [tuple(s["fallback"]) for s in ans.ok.values() if s.get("fallback")]
    ep.fallback = max(fallbacks) if fallbacks else None
    ep.statuses = {r: s for r, s in ans.ok.items() if r not in empty}
    ep.state_bytes = sum(int(s.get("bytes", 0)) for s in ep.statuses.values())
    if not ep.statuses:
        why = (next(iter(refused.values()), "") or "; ".join(f"rank {r}: {w}" for r, w in sorted(empty.items()))
               or "no live rank answered")
        ep.plan = planner.DumpPlan(False, reason=f"no survivor could prepare its state ({why})", fallback=ep.fallback)
        return Fail(ep.plan.message())
    if refused:
        log.warning("dump: rank(s) %s could not prepare and are left out: %s", sorted(refused),
                    "; ".join(sorted(set(map(str, refused.values()))))[:300])
    return NEXT


def _plan_dump(ep: Episode) -> Step:
    live = ep.port.live()
    statuses = {r: s for r, s in ep.statuses.items() if r in live}
    holders = {r: h for r, h in planner.holders(ep.world, statuses, ep.groups).items() if r not in ep.left}
    plan = planner.plan_dump(holders, ep.fallback)
    if not plan.ok:
        ep.plan = plan
        return Fail(plan.message())
    ep.plan, ep.generation = plan, ep.port.new_generation()
    ep.statuses = statuses
    writing = sorted(statuses)
    # Survivors whose own shard is newer than the plan: another shard's newest state died (a lost rank
    # can take the last message of a step with it, leaving its twin inside that step).
    assert plan.iteration is not None  # (a plan that is ok names its iteration)
    ahead = sorted(r for r in writing if max(planner.servable(holders[r]), default=-1) > plan.iteration)
    ep.port.emit("dump_plan", iteration=plan.iteration, writers=sorted(plan.writers.values()),
                 survivors=writing, generation=ep.generation, finishing=list(plan.finishing), ahead=ahead)
    log.info("dump: %s; %d survivor(s) write (generation %d)", plan.message(), len(writing), ep.generation)
    return NEXT


def _loss_logger(ep: Episode) -> int | None:
    """The survivor that prints the loss of the step the dump settles on, when no rank logged it (it
    was in flight): the one that logs losses if it survived, else the first one that holds it."""
    holders = sorted(r for r, s in ep.statuses.items()
                     if (s.get("unlogged") or {}).get("iteration") == ep.plan.iteration)
    chosen = [r for r in holders if ep.statuses[r]["unlogged"].get("writer")] or holders
    return chosen[0] if chosen else None


def _write_args(ep: Episode) -> dict[str, Any]:
    host, port = ep.port.store()
    return {"survivors": sorted(ep.statuses), "store_host": host, "store_port": port,
            "generation": ep.generation, "plan": ep.plan.to_wire(), "log_loss": _loss_logger(ep)}


def _written(ep: Episode, ans: Answers) -> Step:
    lost = [r for r, why in ans.failed.items() if why == "lost"]
    if lost:  # the others were stopped by the runner: plan again over the rest
        log.warning("dump: rank(s) %s lost while writing; re-planning without them", sorted(lost))
        for r in lost:
            ep.statuses.pop(r, None)
        return Goto("plan")
    if ans.failed:
        return Fail(f"the survivors could not write the checkpoint ({ans.why(600)})")
    info = next(d for d in ans.ok.values() if d)
    seconds = time.monotonic() - ep.started
    ep.result = {"iteration": ep.plan.iteration, "path": info["path"], "save": info["save"],
                 "seconds": round(seconds, 4), "write_s": info["seconds"],
                 "ranks": sorted(ep.plan.writers.values()), "survivors": sorted(ep.statuses),
                 "generation": ep.generation, "bytes": info.get("bytes")}
    ep.port.emit("checkpoint", kind="dying_gasp", **ep.result)
    ep.port.set_note(f"dying-gasp checkpoint of iteration {ep.plan.iteration} written to {info['path']} in "
                     f"{seconds:.2f}s by {len(ep.statuses)} survivor(s)")
    return DONE


STRATEGY = Strategy(
    "dump", "--enable-high-availability",
    handles=frozenset({"memory-error", "comm-failure", "other", "process-exit", "hang", "heartbeat-lost",
                       "controller-lost", "node-lost", "preempted"}),
    stages=(Stage("dump", (
        Round("status", order="dump-status", to=_dump_status_to, decide=_dump_statuses, wait_s=DUMP_STATUS_WAIT_S,
              partial=True),
        Round("plan", act=_plan_dump, timed=False),
        Round("write", order="dump", to=lambda ep: sorted(ep.statuses), args=_write_args, decide=_written,
              wait_s=WRITE_WAIT_S, stop_on_loss=True)), DUMP_S),),
    failed_event="dump_refused")
