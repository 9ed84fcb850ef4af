"""Recovery playbooks: each strategy as the ordered rounds it runs (played by ``rounds.Runner``).

    retry    REPAIR: status -> plan -> rebuild -> repair | reload     ROLLBACK: [rollback] -> resume
    recover  REPAIR: status -> [restart] -> plan -> rebuild -> repair | reload   ROLLBACK: [rollback] -> resume
    dump     DUMP:   status -> plan -> write  (a writer lost: the others stop, plan again, write again)
    elastic  DOWNGRADE: status -> plan -> scale-in    ROLLBACK: rollback -> resume (the kept ranks)
    scale-out UPGRADE: status -> plan -> scale-out    ROLLBACK: rollback -> resume (the new layout)

What each round asks of a rank is in ``mindspeed_ha.rank.recovery.handlers`` (same names). After
ROLLBACK the job trains again; ``FirstStep`` closes the recovery (the ``recovered`` event, MTTR)
when every rank has completed the step after the one the recovery resumed at.

retry (memory and communication faults, every process alive): every rank reports where its optimizer
shard is (``status``); the controller picks the newest iteration every shard has a healthy holder for
(``plan``, the dump's own planner); every rank builds new communicators (``rebuild``); broken or
lagging shards are copied from their twins and the weights re-gathered (``repair``); every rank goes
back to the start of the failed step, or finishes it if its update had completed everywhere
(``rollback``); training resumes. recover adds ``restart``: the launcher agents restart the lost
ranks and the round waits until they register; they join at ``rebuild`` and take their shard and
counters from their twins at ``repair``. Where no twin can serve — without replicas, or with both
holders of a shard lost or poisoned — every rank reloads the newest periodic checkpoint instead
(``reload``): the steps since it are recomputed, and the job goes on.

A failed round (or a plan that cannot be made) ends the state with FAILED: the table falls back to
the dump; a new fault meanwhile starts the recovery over from PAUSE with every fault known.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from ... import plan as planner
from ...events import get_logger
from .ledger import Fault
from .rounds import DONE, NEXT, Answers, Fail, Goto, Port, Round, Step, Switch
from .states import State as S

log = get_logger("control.playbooks")
ROUND_WAIT_S = 30.0
RESTART_WAIT_S = 120.0       # a restarted worker imports torch and megatron before it registers
DUMP_STATUS_WAIT_S = 15.0    # a live rank that has not parked by then (hung) is left out of the dump
WRITE_WAIT_S = 7 * 24 * 3600.0  # (the DUMP state's own time limit, which grows with the state, ends a stuck write)


@dataclasses.dataclass
class Episode:
    """The working memory of one recovery: what the playbook learned and decided so far."""
    port: Port
    strategy: str
    world: int
    faults: list[Fault]                    # the episode's faults (the controller appends while it runs)
    groups: dict[int, list[int]]           # rank -> replica group as registered
    replica: bool = True                   # the ranks run the replica optimizer (else: reload)
    fallback: tuple[int, str] | None = None  # dump: newest periodic checkpoint (iteration, path)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    statuses: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # rank -> its answer to status
    joiners: list[int] = dataclasses.field(default_factory=list)    # restarted ranks (hold nothing yet)
    plan: Any = None                       # the planner's plan (plan.py): repair, reload, elastic or dump
    source: str = ""                       # where the lost state comes from: "twins" (the repair round)
                                           # or "checkpoint" (the reload round: the periodic checkpoint)
    generation: int = 0
    how: str = ""
    lost_steps: int = 0
    result: dict[str, Any] | None = None            # dump: the written checkpoint
    state_bytes: int = 0                   # dump: what the survivors will write (sets its time limit)
    moved_bytes: int = 0                   # repair: shard bytes copied from the twins
    dropped: list[int] = dataclasses.field(default_factory=list)   # elastic: ranks out of the new layout
    old_dp: int = 0                        # elastic: the data-parallel size before
    running: list[int] = dataclasses.field(default_factory=list)   # scale-out: the ranks training before
    reentry: Any = None                    # refused scale-out: the job's own layout, entered again
    spare_wait: float | None = None        # recover with elastic on: seconds a lost node is waited for
    restart_at: float = 0.0                # when the restart round asked for the replacements
    left: frozenset[int] = frozenset()         # elastic: ranks out of the layout since a scale-in (no shard)
    started: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def target(self) -> int:
        return int(self.plan.iteration)

    def group_of(self, rank: int) -> list[int] | None:
        """A rank's replica group: as it registered, or (a backup controller it never registered
        with) from a survivor's group that contains it."""
        if self.groups.get(rank):
            return list(self.groups[rank])
        return next((list(s["replica_group"]) for s in self.statuses.values()
                     if rank in (s.get("replica_group") or ())), None)


@dataclasses.dataclass(frozen=True)
class Playbook:
    name: str
    states: dict[S, list[Round]]
    event_on_fail: str            # repair_failed | dump_refused

    def rounds(self, state: S) -> list[Round]:
        return self.states[state]


# ---- retry / recover / reload: REPAIR ---------------------------------------------------------------
def _ha_status(ep: Episode, ans: Answers) -> Step:
    if ans.failed:
        return Fail(f"status failed ({ans.why()})")
    # A rank restarted by an earlier round of this recovery (a new fault came while it was joining)
    # holds nothing yet.
    ep.joiners = sorted(set(ep.joiners) | {r for r, st in ans.ok.items() if st.get("joining")})
    ep.statuses = {r: st for r, st in ans.ok.items() if not st.get("joining")}
    aborts = [float(st["abort"]["seconds"]) for st in ans.ok.values() if isinstance(st.get("abort"), dict)]
    if aborts:  # (the stop's abort of the survivors' communicators: the slowest rank's, before this round)
        ep.phases["abort"] = round(max(aborts), 4)
    return NEXT


def hung(ep: Episode) -> set[int]:
    """Ranks a hang fault names: alive, but their training thread will not serve an order."""
    return {r for f in ep.faults if f["kind"] == "hang" for r in f["ranks"]}


def replaced(ep: Episode) -> set[int]:
    """Live ranks recover replaces: the hung, and those migrating to a spare."""
    return {r for f in ep.faults if f["kind"] in ("hang", "migrate") for r in f["ranks"]}


STATUS = Round("status", order="ha-status", decide=_ha_status, wait_s=ROUND_WAIT_S,
               to=lambda ep: sorted(ep.port.live() - replaced(ep)))
# recover: a rank that stops answering is hung: replaced like a dead one
STATUS_OR_HUNG = dataclasses.replace(STATUS, silent_is_hung=True)


def _restart(ep: Episode) -> Step:
    """Have the agents restart every lost, hung or migrating worker (the agent ends a live one
    first); they join at the rebuild."""
    ep.port.condemn(sorted(replaced(ep) & ep.port.live()))
    lost = sorted(ep.port.lost())
    unknown = [r for r in lost if ep.replica and ep.group_of(r) is None]
    if unknown:
        return Fail(f"the replica group of rank(s) {unknown} is unknown")
    restarted, awaiting, orphans = ep.port.restart(lost)
    if orphans:
        return Fail(f"rank(s) {sorted(orphans)} have no launcher agent to restart them "
                    "(start the job with mindspeed-ha run)")
    ep.joiners = sorted(set(ep.joiners) | set(lost))
    ep.restart_at = time.monotonic()
    ep.port.emit("restart", ranks=restarted, awaiting_node=awaiting)
    log.info("recover: restarting rank(s) %s%s", restarted, f"; waiting for a replacement node for rank(s) "
             f"{awaiting} (mindspeed-ha run with its --node-rank)" if awaiting else "")
    return None


def _waited_out(ep: Episode) -> bool:
    """recover with elastic on: the lost node's replacement did not come within --ha-spare-wait."""
    return ep.spare_wait is not None and time.monotonic() - ep.restart_at > ep.spare_wait


def _restarted(ep: Episode, ans: Answers) -> Step:
    waiting = sorted(ep.port.restarting())
    if waiting and ep.spare_wait is not None and (ans.failed or _waited_out(ep)):
        return Switch("elastic-training", f"no replacement for rank(s) {waiting} within --ha-spare-wait "
                                          f"{ep.spare_wait:g} s: the job scales in without them")
    if ans.failed:
        return Fail(f"restart failed ({', '.join(f'rank {r}: did not come back' for r in sorted(ep.port.restarting()))})")
    return NEXT


RESTART = Round("restart", act=_restart, ready=lambda ep: not ep.port.restarting() or _waited_out(ep),
                decide=_restarted,
                wait_s=RESTART_WAIT_S, when=lambda ep: bool(ep.port.lost() or replaced(ep) & ep.port.live()))


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
            ep.port.emit("repair_plan", iteration=plan.iteration, pairs=plan.pairs_flat, joiners=plan.joiners_flat,
                         generation=ep.generation)
            log.info("%s: resume at iteration %d; shards to copy (src, dst): %s", ep.strategy, plan.iteration,
                     list(plan.copies))
            return NEXT
        why = plan.reason
    reload = planner.plan_reload(ep.statuses)
    if not reload.ok:
        return Fail(reload.reason if not ep.replica else f"{why}; and {reload.reason}")
    ep.plan, ep.source, ep.generation, ep.lost_steps = reload, "checkpoint", ep.port.new_generation(), reload.lost_steps
    ep.port.emit("repair_plan", iteration=reload.iteration, reload=reload.path, lost_steps=reload.lost_steps,
                 generation=ep.generation, reason=why)
    log.info("%s: %s: every rank reloads iteration %d from %s (%d step(s) lost)", ep.strategy, why,
             reload.iteration, reload.path, reload.lost_steps)
    return NEXT


def _rebuild_args(ep: Episode) -> dict[str, Any]:
    host, port = ep.port.store()
    return {"store_host": host, "store_port": port, "generation": ep.generation}


def _then(name: str, step: Step, how: str = "") -> Callable[[Episode, Answers], Step]:
    """Every rank did ``name``: go on with ``step`` (NEXT or DONE); any failure fails the state."""
    def decide(ep: Episode, ans: Answers) -> Step:
        if ans.failed:
            return Fail(f"{name} failed ({ans.why()})")
        ep.how = how or ep.how
        return step
    return decide


PLAN = Round("plan", act=_plan, timed=False)
REBUILD = Round("rebuild", order="rebuild", args=_rebuild_args, decide=_then("rebuild", NEXT))
def _repaired(ep: Episode, ans: Answers) -> Step:
    if ans.failed:
        return Fail(f"repair failed ({ans.why()})")
    ep.moved_bytes = sum(int((a or {}).get("received") or 0) for a in ans.ok.values())
    return DONE


REPAIR = Round("repair", order="repair", decide=_repaired, when=lambda ep: ep.source == "twins",
               args=lambda ep: {"pairs": ep.plan.pairs_flat, "iteration": ep.target, "joiners": ep.plan.joiners_flat})
RELOAD = Round("reload", order="reload", decide=_then("reload", DONE, how="reload"),
               when=lambda ep: ep.source == "checkpoint",
               args=lambda ep: {"ended": ep.target + ep.lost_steps})


# ---- ROLLBACK ---------------------------------------------------------------------------------------
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
                 when=lambda ep: ep.source == "twins")  # (a reload put every rank at the checkpoint already)
RESUME = Round("resume", order="resume", decide=_then("resume", DONE),
               args=lambda ep: {"strategy": ep.strategy, "lost_steps": ep.lost_steps})


RETRY = Playbook("retry", {S.REPAIR: [STATUS, PLAN, REBUILD, REPAIR, RELOAD], S.ROLLBACK: [ROLLBACK, RESUME]},
                 "repair_failed")
RECOVER = Playbook("recover", {S.REPAIR: [STATUS_OR_HUNG, RESTART, *(dataclasses.replace(r, silent_is_hung=True)
                                                                      for r in (PLAN, REBUILD, REPAIR, RELOAD))],
                               S.ROLLBACK: [dataclasses.replace(r, silent_is_hung=True) for r in (ROLLBACK, RESUME)]},
                   "repair_failed")


# ---- elastic-training: DOWNGRADE (scale in without a spare) ---------------------------------------------
def _replicas(ep: Episode) -> list[list[int]]:
    """The job's data-parallel replicas now, from the ranks' data-parallel groups (job ranks): the
    d-th member of every group, the groups in their members' order (TP, then PP position)."""
    dp_groups = sorted({tuple(st["layout"]["dp_ranks"]) for st in ep.statuses.values() if st.get("layout")})
    return [[g[d] for g in dp_groups] for d in range(len(dp_groups[0]))] if dp_groups else []


def _plan_for(holders: planner.Holders, replicas: list[list[int]], layout: dict[str, Any]) -> planner.ElasticPlan:
    """The layout ``replicas`` can keep (``plan_elastic``), with the job's batch and instances."""
    return planner.plan_elastic(holders, replicas, layout["global_batch"], layout["micro_batch"],
                                layout["replica_num"], layout.get("stages", 1), layout.get("experts", 1))


def _plan_elastic(ep: Episode) -> Step:
    layout = next((st["layout"] for st in ep.statuses.values() if st.get("layout")), None)
    replicas = _replicas(ep)
    if layout is None or not replicas:
        return Fail("no rank reported the job's layout (elastic needs the replica optimizer)")
    members = {r for rep in replicas for r in rep}
    groups = {r: ep.group_of(r) for r in members if ep.group_of(r)}
    holders = {r: h for r, h in planner.holders(ep.world, ep.statuses, groups).items() if r in members}
    plan = _plan_for(holders, replicas, layout)
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
    ep.port.emit("elastic_plan", iteration=plan.iteration, dp=plan.dp, old_dp=ep.old_dp,
                 kept=[list(r) for r in plan.kept], parked=list(plan.parked), dropped=ep.dropped,
                 writers=sorted(set(plan.writers.values())), redundancy=plan.redundancy, generation=ep.generation)
    log.info("elastic: %s", plan.message())
    return NEXT


def _resize_args(ep: Episode, plan: planner.ElasticPlan) -> dict[str, Any]:
    host, port = ep.port.store()
    return {"plan": plan.to_wire(), "store_host": host, "store_port": port, "generation": ep.generation}


def _scale_in_args(ep: Episode) -> dict[str, Any]:
    return _resize_args(ep, ep.plan)


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


def _fresh_rollback(ep: Episode) -> dict[str, Any]:
    """A new layout: back to the plan's iteration, data read at the new data-parallel rank and size.
    (Its decision keeps the episode's ``how``: the resize, "data-parallel size 4 -> 2".)"""
    return {"iteration": ep.target, "fresh_data": True}


def _kept(ep: Episode) -> list[int]:
    return sorted(r for rep in ep.plan.kept for r in rep)


ELASTIC = Playbook("elastic-training", {
    S.DOWNGRADE: [STATUS, Round("plan", act=_plan_elastic, timed=False),
                  Round("scale-in", order="scale-in", to=_kept, args=_scale_in_args, decide=_scaled_in)],
    S.ROLLBACK: [dataclasses.replace(ROLLBACK, args=_fresh_rollback, decide=_then("rollback", NEXT),
                                     when=None, to=_kept),
                 dataclasses.replace(RESUME, to=_kept)],
}, "repair_failed")


# ---- elastic-training: UPGRADE (scale out when a lost node's ranks registered again) ---------------------
def _plan_scale_out(ep: Episode) -> Step:
    """Newcomers (``ep.joiners``: the returned ranks, registered, holding nothing) join as whole
    replicas; a plan that cannot be made leaves them out and the job trains on as it was."""
    layout = next((st["layout"] for st in ep.statuses.values() if st.get("layout")), None)
    replicas = _replicas(ep)
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
    ep.port.emit("elastic_plan", iteration=ep.plan.iteration, dp=ep.plan.dp, old_dp=ep.old_dp,
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
    again = _plan_for(holders, replicas, layout)
    if not again.ok or again.dp != len(replicas):
        return Fail(f"rank(s) {stopped} stopped inside a step, and the job's layout cannot be entered again: "
                    f"{again.message()}")
    ep.reentry, ep.generation = again, ep.port.new_generation()
    log.info("elastic: rank(s) %s stopped inside a step: data-parallel size %d entered again on new communicators",
             stopped, again.dp)
    return NEXT


def _reentry_args(ep: Episode) -> dict[str, Any]:
    return _resize_args(ep, ep.reentry)


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
    return _kept(ep) if ep.plan.ok else ep.running


SCALE_OUT = Playbook("scale-out", {
    S.UPGRADE: [STATUS, Round("plan", act=_plan_scale_out, timed=False),
                Round("scale-out", order="scale-out", to=_kept, args=_scale_in_args, decide=_scaled_out,
                      when=lambda ep: ep.plan.ok),
                Round("re-enter", order="scale-in", to=lambda ep: ep.running, args=_reentry_args, decide=_reentered,
                      when=lambda ep: ep.reentry is not None)],
    S.ROLLBACK: [dataclasses.replace(ROLLBACK, args=_fresh_rollback, decide=_then("rollback", NEXT),
                                     when=None, to=_new_layout),
                 dataclasses.replace(RESUME, to=_new_layout)],
}, "repair_failed")


# ---- dump (the dying-gasp checkpoint) -----------------------------------------------------------------
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


DUMP = Playbook("dump", {S.DUMP: [
    Round("status", order="dump-status", to=_dump_status_to, decide=_dump_statuses, wait_s=DUMP_STATUS_WAIT_S,
          partial=True),
    Round("plan", act=_plan_dump, timed=False),
    Round("write", order="dump", to=lambda ep: sorted(ep.statuses), args=_write_args, decide=_written,
          wait_s=WRITE_WAIT_S, stop_on_loss=True),
]}, "dump_refused")


def failed(playbook: Playbook, ep: Episode, reason: str) -> str:
    """Report a playbook's failure; returns the note the diagnosis gives."""
    if playbook is DUMP:
        missing = [list(g) for g in getattr(ep.plan, "missing", ())]
        ep.port.emit("dump_refused", message=reason, missing=missing)
        log.error("dump: %s", reason)
        return reason
    ep.port.emit("repair_failed", reason=reason, strategy=ep.strategy)
    log.error("%s failed: %s; falling back to the dump", ep.strategy, reason)
    return f"{ep.strategy} failed ({reason})"


# ---- after the recovery: the first step closes it -----------------------------------------------------
class FirstStep:
    """In NORMAL after a retry, recover, reload or resize: the recovery ends when every live rank
    has completed the step after the iteration it resumed at (``recovered``, with the MTTR from the
    first fault's detection; a scale-out: ``scaled_out``, timed from the newcomers' registration)."""

    def __init__(self, ep: Episode, faults: list[Fault], resumed_at: float):
        self.ep, self.faults, self.resumed_at = ep, faults, resumed_at
        self.target = ep.target + 1

    def close_by_fault(self, now: float, detect_s: float, done: bool) -> bool:
        """A new fault came, found ``detect_s`` after it struck: the awaited step is ``done`` (the
        fault proves it) or it was interrupted. Either way the recovery ends where the new fault
        struck, not where it was found: the time between is the new fault's (its MTTR starts with its
        detection), and would otherwise be counted twice — a hang in the first step added its 3 s
        timeout to the recovery before it too."""
        return self.check(max(self.resumed_at, now - detect_s), done, interrupted=not done)

    def check(self, now: float, completed: bool, interrupted: bool = False) -> bool:
        """``completed``: every live rank has ended step ``target`` (or a later fault proves it);
        ``interrupted``: a new fault struck while the job trained that step again — the recovery
        was over (the job was training), so it is reported, its MTTR up to the new fault.
        Emits ``recovered`` and returns True once."""
        if not (completed or interrupted):
            return False
        ep, first = self.ep, self.faults[0]
        phases = dict(ep.phases)
        phases["first_step"] = round(now - self.resumed_at, 4)
        mttr = first["detect_s"] + (now - first["t_detect"])
        extra = {} if completed else {"first_step_interrupted": True}
        if ep.strategy == "scale-out":  # no fault: the time from the newcomers' registration
            if not ep.plan.ok:  # refused (said so then): the job went on as it was
                ep.port.closed(self.faults, now, 0, phases)
                return True
            ep.port.emit("scaled_out", old_dp=ep.old_dp, dp=ep.plan.dp, iteration=ep.target,
                         added=sorted(ep.plan.sources), parked=ep.dropped, kept=[list(r) for r in ep.plan.kept],
                         redundancy=ep.plan.redundancy, microbatches=ep.plan.microbatches, bytes=ep.moved_bytes,
                         seconds=round(mttr, 4), phases=phases, **extra)
            log.info("scaled out (%s) at iteration %d in %.3f s from the newcomers' registration, phases %s",
                     ep.how, ep.target, mttr, phases)
            ep.port.closed(self.faults, now, ep.moved_bytes, phases)
            return True
        ep.port.emit("recovered", strategy=ep.strategy, iteration=ep.target, lost_steps=ep.lost_steps,
                     mttr_s=round(mttr, 4), phases=phases, how=ep.how,
                     faults=[{"ranks": f["ranks"], "kind": f["kind"], "iteration": f["iteration"],
                              "phase": f["phase"]} for f in self.faults], **extra)
        log.info("recovered by %s (%s) at iteration %d: MTTR %.3f s, phases %s%s", ep.strategy, ep.how,
                 ep.target, mttr, phases, "" if completed else " (a new fault came in its first step)")
        ep.port.closed(self.faults, now, ep.moved_bytes, phases)
        return True
