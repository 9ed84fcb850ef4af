"""The controller's side of the retry strategy (UCE / communication faults, every process alive)
and of recover (ARF: a lost worker is restarted by its agent and joins the running job).

States REPAIR then ROLLBACK, each a sequence of rounds of orders to every live rank, run on the
controller thread and timed (the ``recovered`` event's ``phases``):

  REPAIR:   ha-status -> [recover: the agents restart the lost workers; wait until they register]
            -> plan (dump.plan_dump over the healthy holders; a restarted rank holds nothing)
            -> rebuild (new communicator generation over a TCPStore served here; a restarted rank
            joins it) -> repair (shards copied from twins, weights re-gathered; a restarted rank
            also gets counters, scheduler and RNG)
  ROLLBACK: rollback (recompute the failed step, or finish it) -> resume

Then NORMAL; the MTTR ends when every rank has completed the next step (processors heartbeat at
once after it). A plan that cannot be made (a shard with no healthy holder, holders at different
iterations) or a failed round feeds FAILED, and the table falls back to the dying gasp.
"""
from __future__ import annotations

import json
import time

from ..events import get_logger
from ..recovery.dump import _servable, plan_dump
from .states import Outcome as O

log = get_logger("control.retry")
ROUND_WAIT_S = 30.0
RESTART_WAIT_S = 120.0  # a restarted worker imports torch and megatron before it registers


class RetryDriver:
    def __init__(self, controller):
        self.c = controller
        self.generation = 100  # store key prefixes apart from the dying gasp's
        self.awaiting = None   # after resume: (step to complete, faults, phases, how, lost steps, t_resume)
        self.restarting: set[int] = set()  # ranks restarted by their agent, not registered again yet
        self._reset()

    def _reset(self) -> None:
        self.round, self.pend, self.t_round = None, None, 0.0
        self.phases: dict[str, float] = {}
        self.plan = None
        self.pairs: list[int] = []
        self.target = None
        self.reload_from = None   # no replicas: (iteration, path) of the periodic checkpoint to reload
        self.lost = 0
        self.how = ""
        self.joiners: list[int] = []   # restarted ranks that join in this episode (recover)
        self.statuses: dict = {}

    # ---- REPAIR ---------------------------------------------------------------------------------
    def start(self):
        self._reset()
        self.t0 = time.monotonic()
        f = self.c.active_faults[0] if self.c.active_faults else None
        if f is not None:
            self.phases["detect"] = f["detect_s"]
            self.phases["stop"] = round(self.t0 - f["t_detect"], 4)  # detection -> all stopped, strategy chosen
        self._send("status", "ha-status", {})
        return None

    def start_rollback(self):
        if self.reload_from is not None:  # the reload already put every rank at the checkpoint
            self._send("resume", "resume", {})
        else:
            self._send("rollback", "rollback", {"iteration": self.target})
        return None

    def _send(self, name: str, action: str, args: dict) -> None:
        aid = self.c._do(action, sorted(self.c._live()), args)
        self.round, self.pend, self.t_round = name, self.c._pending[aid], time.monotonic()

    @property
    def strategy(self) -> str:
        return "recover" if self.c.chosen == O.RECOVER else "retry"

    def _restart_lost(self, now: float):
        """recover: have the agents restart every lost worker; they join at the rebuild."""
        c = self.c
        lost = sorted(r for r, i in c.ranks.items() if not i.alive and not i.done)
        orphans = set(lost) - {r for a in c.agents.values() for r in a.ranks}
        if orphans:
            return self._fail(f"rank(s) {sorted(orphans)} have no launcher agent to restart them "
                              "(start the job with mindspeed-ha run)")
        # A node lost with its agent: its replacement (mindspeed-ha run with the same --node-rank)
        # starts its workers as joiners by itself; the others are restarted by their agents.
        live_agents = [a for a in c.agents.values() if now - a.seen <= c.dead_after]
        by_agent = sorted(r for a in live_agents for r in a.ranks if r in lost)
        replicas = all(st["replica"] for st in self.statuses.values())  # (without: all reload, no twin needed)
        unknown = [r for r in lost if replicas and self._group_of(r) is None]
        if unknown:
            return self._fail(f"the replica group of rank(s) {unknown} is unknown")
        self.joiners = sorted(set(self.joiners) | set(lost))
        self.restarting = set(lost)
        if by_agent:
            c.restart_workers(by_agent)
        waiting = sorted(set(lost) - set(by_agent))
        c.events.emit("restart", ranks=by_agent, awaiting_node=waiting)
        log.info("recover: restarting rank(s) %s%s", by_agent, f"; waiting for a replacement node for rank(s) "
                 f"{waiting} (mindspeed-ha run with its --node-rank)" if waiting else "")
        self.round, self.pend, self.t_round = "restart", None, now
        return None

    def _group_of(self, r: int):
        """A lost rank's replica group: as it registered, or (a backup controller it never
        registered with) from a survivor's group that contains it."""
        info = self.c.ranks.get(r)
        if info is not None and info.groups:
            return list(info.groups[0])
        return next((list(s["replica_group"]) for s in self.statuses.values()
                     if r in s.get("replica_group", ())), None)

    def _round_done(self, now: float):
        """None while waiting; else (ok, failures)."""
        live = self.c._live()
        if self.round == "restart":
            if self.restarting and now - self.t_round < RESTART_WAIT_S:
                return None
            self.phases["restart"] = round(now - self.t_round, 4)
            return not self.restarting, {r: "did not come back" for r in self.restarting}
        if self.pend["waiting"] & live and now - self.t_round < ROUND_WAIT_S:
            return None
        failed = {r: d for r, (ok, d) in self.pend["results"].items() if not ok}
        missing = (self.pend["waiting"] & live) | {r for r in self.pend["results"] if r not in live}
        for r in missing:
            failed.setdefault(r, "no answer" if r in live else "lost")
        self.phases[self.round] = round(now - self.t_round, 4)
        return not failed, failed

    def progress(self, now: float):
        done = self._round_done(now)
        if done is None:
            return None
        ok, failed = done
        if not ok:
            why = "; ".join(f"rank {r}: {d}" for r, d in sorted(failed.items()))[:500]
            return self._fail(f"{self.round} failed ({why})")
        if self.round == "status":
            self.statuses = {r: json.loads(d) for r, (ok, d) in self.pend["results"].items()}
            # Restarted ranks still joining (this recovery restarted after a new fault) hold nothing.
            self.joiners = sorted(r for r, st in self.statuses.items() if st.get("joining"))
            for r in self.joiners:
                del self.statuses[r]
            if self.c.chosen == O.RECOVER and any(not i.alive and not i.done for i in self.c.ranks.values()):
                return self._restart_lost(now)
            return self._plan()
        if self.round == "restart":
            return self._plan()
        if self.round == "rebuild":
            if self.reload_from is not None:
                self._send("reload", "reload", {"ended": self.target + self.lost})
            else:
                self._send("repair", "repair", {"pairs": self.pairs, "iteration": self.target,
                                                "joiners": self.joiner_src})
            return None
        if self.round in ("repair", "reload"):
            if self.round == "reload":
                self.how = "reload"
            return O.OK  # -> ROLLBACK
        if self.round == "rollback":
            how = {d for ok_, d in self.pend["results"].values()}
            self.how = "/".join(sorted(how))
            self._send("resume", "resume", {})
            return None
        if self.round == "resume":
            return self._resumed(now)
        return None

    def _plan(self):
        c = self.c
        statuses = self.statuses
        if not all(s["replica"] for s in statuses.values()):
            return self._plan_reload(statuses)
        poisoned = {r for f in c.active_faults if f["kind"] == "memory-error" for r in f["ranks"]}
        holders = {r: {k: s[k] for k in ("iteration", "updating", "touched", "replica_group")}
                   | {"alive": r not in poisoned} for r, s in statuses.items()}
        for r in self.joiners:  # restarted: holds nothing yet
            holders[r] = {"iteration": -1, "updating": False, "touched": False,
                          "replica_group": self._group_of(r), "alive": False}
        plan = plan_dump(holders)
        if not plan.ok:
            return self._fail(plan.message().replace("dying-gasp checkpoint refused, nothing written: ", ""))
        pairs = []
        for r, h in sorted(holders.items()):
            if not h["alive"] or plan.iteration not in _servable(h):
                pairs += [plan.writers[tuple(sorted(h["replica_group"]))], r]
        self.plan, self.pairs, self.target = plan, pairs, plan.iteration
        self.joiner_src = []  # restarted rank, the twin that also sends it counters, scheduler and RNG
        for r in self.joiners:
            self.joiner_src += [r, plan.writers[tuple(sorted(holders[r]["replica_group"]))]]
        c.events.emit("repair_plan", iteration=plan.iteration, pairs=pairs, joiners=self.joiner_src,
                      generation=self.generation + 1)
        log.info("%s: resume at iteration %d; shards to copy (src, dst): %s", self.strategy, plan.iteration,
                 list(zip(pairs[0::2], pairs[1::2])))
        return self._rebuild()

    def _plan_reload(self, statuses: dict):
        """Without replicas nothing holds a second copy: every rank reloads the newest periodic
        checkpoint in process (no restart); the steps since it are lost and recomputed."""
        ckpts = {tuple(s["checkpoint"]) if s.get("checkpoint") else None for s in statuses.values()}
        if None in ckpts or len(ckpts) != 1:
            return self._fail("no replicas and no periodic checkpoint every rank can reload "
                              "(--save with --save-interval)")
        self.reload_from = ckpts.pop()
        self.target = int(self.reload_from[0])
        self.lost = max(s["ended"] for s in statuses.values()) - self.target
        self.c.events.emit("repair_plan", iteration=self.target, reload=self.reload_from[1], lost_steps=self.lost,
                           generation=self.generation + 1)
        log.info("retry without replicas: every rank reloads iteration %d from %s (%d step(s) lost)",
                 self.target, self.reload_from[1], self.lost)
        return self._rebuild()

    def _rebuild(self):
        c = self.c
        store = c.store()
        self.generation += 1
        self._send("rebuild", "rebuild", {"store_host": c.host, "store_port": store.port,
                                          "generation": self.generation})
        return None

    def _fail(self, why: str):
        self.c.events.emit("repair_failed", reason=why, strategy=self.strategy)
        log.error("%s failed: %s; falling back to the dying gasp", self.strategy, why)
        self.c.strategy_note = f"{self.strategy} failed ({why})"
        return O.FAILED

    # ---- back to NORMAL -------------------------------------------------------------------------
    def _resumed(self, now: float):
        c = self.c
        for i in c.ranks.values():
            i.health = "ok" if i.alive else i.health
            i.progress_at = max(i.progress_at, now)
        faults = list(c.active_faults)
        c.active_faults.clear()
        self.awaiting = (self.target + 1, faults, dict(self.phases), self.how, self.lost, now, self.strategy)
        return O.OK  # -> NORMAL

    def watch(self, now: float, fault_at: int = -1) -> None:
        """In NORMAL after a retry: the recovery ends when every live rank completed a step.
        ``fault_at``: a new fault's iteration; one past the awaited step proves that step done on
        every rank (its collectives needed them all), even if a rank's report has not come yet."""
        if self.awaiting is None:
            return
        target, faults, phases, how, lost, t_resume, strategy = self.awaiting
        def completed(i) -> bool:  # the step ended ("step"), or it saved after it, or moved on
            return i.done or i.it > target or (i.it == target and i.phase in ("step", "checkpoint"))
        if fault_at > target or all(completed(i) for i in self.c.ranks.values() if i.alive):
            self.awaiting = None
            first = faults[0]
            phases["first_step"] = round(now - t_resume, 4)
            mttr = first["detect_s"] + (now - first["t_detect"])
            plan_it = target - 1
            self.c.events.emit("recovered", strategy=strategy, iteration=plan_it, lost_steps=lost,
                               mttr_s=round(mttr, 4), phases=phases, how=how,
                               faults=[{"ranks": f["ranks"], "kind": f["kind"], "iteration": f["iteration"],
                                        "phase": f["phase"]} for f in faults])
            log.info("recovered by %s (%s) at iteration %d: MTTR %.3f s, phases %s", strategy, how, plan_it,
                     mttr, phases)
