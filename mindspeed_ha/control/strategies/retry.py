"""retry (``--enable-hbmfault-repair``; MindSpeed's UCE): a memory or communication fault, every process
alive, is mended in place.

    restore  status -> plan -> rebuild+repair | rebuild -> reload
    resume   rollback+resume | resume

Every rank reports where its optimizer shard is (``status``); the controller picks the newest
iteration every shard has a healthy holder for (``plan``, the dump's own planner); every rank builds
new communicators where the fault reached (``rebuild``: the others are kept); broken or lagging shards are copied from their twins and the weights
re-gathered (``repair``), or, where no twin can serve, every rank reloads the newest periodic
checkpoint (``reload``); every rank goes back to the start of the failed step, or finishes it if its
update had completed everywhere (``rollback``); training resumes. After the last stage the job trains
again, and the first step every rank completes closes the recovery (``episode.FirstStep``).

``a+b``: one order, each rank does ``a`` then ``b`` (``Round.with_next``); the rebuild and the repair
are two orders where a restarted rank joins.

recover plays these rounds too (with its restart), and the resizes their status, rollback and resume.
What each round asks of a rank is in ``mindspeed_ha.rank.recovery.handlers`` (same names).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ... import plan as planner
from ..policy import communicators
from ..policy.rounds import DONE, NEXT, Answers, Fail, Round, Step
from . import migration, reload
from .episode import Episode, log
from .strategy import Stage, Strategy

RESTORE_S = 180.0  # the whole restore stage (its rounds have their own limits)
RESUME_S = 30.0
ROUND_WAIT_S = 30.0


def _ha_status(ep: Episode, ans: Answers) -> Step:
    if ans.failed:
        return Fail(f"status failed ({ans.why()})")
    # A rank restarted by an earlier round of this recovery (a new fault came while it was joining)
    # holds nothing yet.
    ep.joiners = sorted(set(ep.joiners) | {r for r, st in ans.ok.items() if st.get("joining")})
    # A migrating rank answers too, parked between two steps like the others, so that it is ended
    # there and not inside a step; what it holds does not count: its place takes its state from twins.
    moving = migration.moving(ep)
    ep.statuses = {r: st for r, st in ans.ok.items() if not st.get("joining") and r not in moving}
    aborts = [float(st["abort"]["seconds"]) for st in ans.ok.values() if isinstance(st.get("abort"), dict)]
    if aborts:  # (the stop's abort of the survivors' communicators: the slowest rank's, before this round)
        ep.phases["abort"] = round(max(aborts), 4)
    return NEXT


def hung(ep: Episode) -> set[int]:
    """Ranks a hang fault names: alive, but their training thread will not serve an order."""
    return {r for f in ep.faults if f["kind"] == "hang" for r in f["ranks"]}


def replaced(ep: Episode) -> set[int]:
    """Live ranks recover replaces: the hung, and those migrating to a spare."""
    return hung(ep) | migration.moving(ep)


STATUS = Round("status", order="ha-status", decide=_ha_status, wait_s=ROUND_WAIT_S,
               to=lambda ep: sorted(ep.port.live() - hung(ep)))
# recover: a rank that stops answering is hung: replaced like a dead one
STATUS_OR_HUNG = dataclasses.replace(STATUS, silent_is_hung=True)


def _plan(ep: Episode) -> Step:
    """Repair from the twins where every shard has a healthy holder; else (no replicas, or both holders
    of a shard lost or poisoned) every rank reloads the newest periodic checkpoint they all have."""
    why = "no replicas"
    # (after a takeover, registrations of ranks that did not come over yet say nothing: their answers do)
    if ep.replica or any(st.get("replica") for st in ep.statuses.values()):
        unknown = [r for r in ep.joiners if ep.group_of(r) is None]
        if unknown:
            return Fail(f"the replica group of rank(s) {unknown} is unknown")
        groups = {r: ep.group_of(r) for r in ep.joiners}
        # (which shards a memory error corrupted: their ranks say so, however long ago it was reported)
        holders = planner.holders(ep.world, ep.statuses, groups)
        plan = planner.plan_repair(holders, ep.joiners)
        if plan.ok:
            ep.plan, ep.source, ep.generation = plan, "twins", ep.port.new_generation()
            ep.port.emit("restore_plan", iteration=plan.iteration, pairs=plan.pairs_flat, joiners=plan.joiners_flat,
                         generation=ep.generation)
            log.info("%s: resume at iteration %d; shards to copy (src, dst): %s", ep.strategy, plan.iteration,
                     list(plan.copies))
            return NEXT
        why = plan.reason
    return reload.plan(ep, why)


def remake_args(ep: Episode) -> dict[str, Any]:
    """Which groups get a new communicator: those the fault reached (``policy.communicators``); every
    other group keeps its own. ``{}``: every group (a rank said nothing of its communicators)."""
    remake = communicators.to_remake(ep.statuses, ep.joiners)
    groups = communicators.count_groups(ep.statuses)
    if remake is None:
        log.info("%s: every communicator is remade (a rank said nothing of its own)", ep.strategy)
    else:
        log.info("%s: %d of %d communicator(s) remade, the others kept: %s", ep.strategy, len(remake), groups,
                 "; ".join(sorted(set(remake.values())))[:300] or "-")
    ep.port.emit("rebuild_plan", generation=ep.generation, groups=groups,
                 remake=None if remake is None else len(remake))
    return {} if remake is None else {"remake": remake}


def _rebuild_args(ep: Episode) -> dict[str, Any]:
    host, port = ep.port.store()
    return {"store_host": host, "store_port": port, "generation": ep.generation, **remake_args(ep)}


def then(name: str, step: Step, how: str = "") -> Callable[[Episode, Answers], Step]:
    """Every rank did ``name``: go on with ``step`` (NEXT or DONE); any failure fails the state."""
    def decide(ep: Episode, ans: Answers) -> Step:
        if ans.failed:
            return Fail(f"{name} failed ({ans.why()})")
        ep.how = how or ep.how
        return step
    return decide


PLAN = Round("plan", act=_plan, timed=False)
# With the repair, one order (a rank rebuilds, then copies its shards), unless a restarted rank joins:
# Megatron-LM's loop builds a joiner's model itself after the rebuild, before it can repair.
REBUILD = Round("rebuild", order="rebuild", args=_rebuild_args, decide=then("rebuild", NEXT),
                with_next=lambda ep: not ep.joiners)


def _repaired(ep: Episode, ans: Answers) -> Step:
    if ans.failed:
        return Fail(f"repair failed ({ans.why()})")
    ep.moved_bytes = sum(int((a or {}).get("received") or 0) for a in ans.ok.values())
    return DONE


REPAIR = Round("repair", order="repair", decide=_repaired, when=lambda ep: ep.source == "twins",
               args=lambda ep: {"pairs": ep.plan.pairs_flat, "iteration": ep.target, "joiners": ep.plan.joiners_flat})
RELOAD = reload.RELOAD


def _rolled(ep: Episode, ans: Answers) -> Step:
    if ans.failed:
        return Fail(f"rollback failed ({ans.why()})")
    ep.how = "/".join(sorted({str(how) for how in ans.ok.values()}))
    return NEXT


def _rollback_args(ep: Episode) -> dict[str, Any]:
    """The iteration every rank resumes at, and whether a survivor had ended that step already (then
    a rank that finishes it answers the loop's code after it alone, as that survivor passed it)."""
    return {"iteration": ep.target, "ended_elsewhere": any(st.get("ended") == ep.target for st in ep.statuses.values())}


ROLLBACK = Round("rollback", order="rollback", args=_rollback_args, decide=_rolled,
                 when=lambda ep: ep.source == "twins",  # (a reload put every rank at the checkpoint already)
                 with_next=lambda ep: True)  # (with the resume: a rank rolls back, then trains on)
RESUME = Round("resume", order="resume", decide=then("resume", DONE),
               args=lambda ep: {"strategy": ep.strategy, "lost_steps": ep.lost_steps})


STRATEGY = Strategy(
    "retry", "--enable-hbmfault-repair",
    handles=frozenset({"memory-error", "comm-failure"}),
    stages=(Stage("restore", (STATUS, PLAN, REBUILD, REPAIR, RELOAD), RESTORE_S),
            Stage("resume", (ROLLBACK, RESUME), RESUME_S)))
