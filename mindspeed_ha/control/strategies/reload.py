"""reload: where no twin can serve a shard (the job runs without replicas,
``--distributed-optimizer-no-replica``, or both holders of a shard are lost or poisoned), every rank
reloads the newest periodic checkpoint they all have, and the steps since it are recomputed.

It is played inside retry's and recover's stages (their plan picks it): the rounds before it (status,
restart, rebuild) and after it (resume) are theirs.
"""
from __future__ import annotations

from ... import plan as planner
from ..policy.rounds import DONE, NEXT, Answers, Fail, Round, Step
from .episode import Episode, log
from .strategy import Strategy


def plan(ep: Episode, why: str) -> Step:
    """Every rank goes back to the newest periodic checkpoint they all hold (``why``: the twins could not
    serve)."""
    reload = planner.plan_reload(ep.statuses)
    if not reload.ok:
        return Fail(reload.reason if not ep.replica else f"{why}; and {reload.reason}")
    ep.plan, ep.source, ep.generation, ep.lost_steps = reload, "checkpoint", ep.port.new_generation(), reload.lost_steps
    ep.port.emit("restore_plan", iteration=reload.iteration, reload=reload.path, lost_steps=reload.lost_steps,
                 generation=ep.generation, reason=why)
    log.info("%s: %s: every rank reloads iteration %d from %s (%d step(s) lost)", ep.strategy, why,
             reload.iteration, reload.path, reload.lost_steps)
    return NEXT


def _reloaded(ep: Episode, ans: Answers) -> Step:
    if ans.failed:
        return Fail(f"reload failed ({ans.why()})")
    ep.how = "reload"
    return DONE


RELOAD = Round("reload", order="reload", decide=_reloaded, when=lambda ep: ep.source == "checkpoint",
               args=lambda ep: {"ended": ep.target + ep.lost_steps})

STRATEGY = Strategy("reload", "--distributed-optimizer-no-replica (or no twin left for a shard)",
                    handles=frozenset(), stages=(), part_of=("retry", "recover"))
