"""The controller's side of the TTP dying gasp (state DUMP): plan, drive the survivors, report.

Runs on the controller thread, like every action. Three steps, each a round of orders:

1. ``dump-status`` to every live rank. It runs on each rank's training thread, so an answer also
   means that rank has left its collective (and finished an update it had begun); it prepares its
   state dict locally and reports its shard's iteration, update window and save directory.
2. ``plan_dump`` over the answers (ranks that did not answer count as lost), then ``dump`` to the
   survivors with the plan and a TCPStore served here, in the controller's process: a store hosted
   by a rank would die with that rank.
3. A survivor lost while writing: the others are stopped and, if a complete holder set is still
   alive, the write is repeated over the rest with the next store generation (item 6 of the issue).

The outcome is fed back to the state machine: OK (written) or FAILED (refused, nothing written);
either way the job then ends (DUMP -> EXIT) with the result in the diagnosis.
"""
from __future__ import annotations

import json
import time

from ..events import get_logger
from ..recovery.dump import DumpPlan, plan_dump
from .states import Outcome as O

log = get_logger("control.dying_gasp")
STATUS_WAIT_S = 15.0   # a live rank that has not parked by then (hung) is left out of the dump


class DumpDriver:
    def __init__(self, controller):
        self.c = controller
        self.result: dict | None = None      # the written checkpoint, for the diagnosis
        self.refusal: str | None = None
        self._reset()

    def _reset(self) -> None:
        self.step, self.pend, self.t_sent = None, None, 0.0
        self.statuses: dict[int, dict] = {}
        self.plan: DumpPlan | None = None
        self.writing: list[int] = []
        self.generation = 0
        self.stopped_gen = 0

    # ---- step 1 -------------------------------------------------------------------------------
    def start(self):
        """Action bound to State.DUMP."""
        c = self.c
        self._reset()
        self.t0 = time.monotonic()
        poisoned = {r for f in c.active_faults if f["kind"] == "memory-error" for r in f["ranks"]}
        asked = sorted(c._live() - poisoned)  # a rank whose memory failed holds nothing we may save
        self._send("status", "dump-status", asked, {})
        log.info("dying gasp: asking %d live rank(s) for their shard state", len(asked))
        return None

    def _send(self, step: str, action: str, ranks, args: dict) -> None:
        aid = self.c._do(action, ranks, args)
        self.step, self.pend, self.t_sent = step, self.c._pending[aid], time.monotonic()

    def _answered(self, now: float, wait: float) -> bool:
        return not (self.pend["waiting"] & self.c._live()) or now - self.t_sent > wait

    def progress(self, now: float):
        """Called every controller tick while in DUMP; returns an outcome to feed, or None."""
        if self.step == "status" and self._answered(now, STATUS_WAIT_S):
            return self._plan_and_write()
        if self.step == "write":
            return self._check_write(now)
        return None

    # ---- step 2 -------------------------------------------------------------------------------
    def _plan_and_write(self):
        refused = {}
        for r, (ok, detail) in self.pend["results"].items():
            if ok:
                self.statuses[r] = json.loads(detail)
            else:
                refused[r] = detail
        if not self.statuses:
            why = next(iter(refused.values()), "no live rank answered")
            return self._refuse(f"no survivor could prepare its state ({why})")
        return self._write(refused)

    def _holders(self) -> dict:
        """plan_dump's input: the survivors' answers, every other rank lost. A lost rank's replica
        group comes from its registration, or (a rank that never registered with this controller,
        e.g. after a takeover) from a survivor's group that names it."""
        groups = {r: i.groups[0] for r, i in self.c.ranks.items() if i.groups}
        for s in self.statuses.values():
            for m in s["replica_group"]:
                groups.setdefault(m, s["replica_group"])
        holders = {}
        for r in range(self.c.world):
            s = self.statuses.get(r)
            if s is not None and self.c.ranks.get(r) is not None and self.c.ranks[r].alive:
                holders[r] = {k: s[k] for k in ("iteration", "updating", "touched", "replica_group")}
                holders[r]["alive"] = True
            else:
                holders[r] = {"iteration": -1, "updating": False, "alive": False,
                              "replica_group": groups.get(r, [r])}
        return holders

    def _fallback(self):
        fb = [s.get("fallback") for s in self.statuses.values() if s.get("fallback")]
        return tuple(max(fb)) if fb else None

    def _write(self, refused: dict | None = None):
        c = self.c
        holders = self._holders()
        plan = plan_dump(holders, self._fallback())
        if not plan.ok:
            return self._refuse(plan.message(), plan)
        if refused:
            log.warning("dying gasp: rank(s) %s could not prepare and are left out: %s", sorted(refused),
                        "; ".join(sorted(set(refused.values())))[:300])
        self.plan, self.generation = plan, self.generation + 1
        self.writing = sorted(r for r, h in holders.items() if h["alive"])
        store = c.store()
        c.events.emit("dump_plan", iteration=plan.iteration, writers=sorted(plan.writers.values()),
                      survivors=self.writing, generation=self.generation, finishing=list(plan.finishing))
        log.info("dying gasp: %s; %d survivor(s) write (generation %d)", plan.message(), len(self.writing),
                 self.generation)
        self._send("write", "dump", self.writing,
                   {"survivors": self.writing, "store_host": c.host, "store_port": store.port,
                    "generation": self.generation, "plan": plan.to_json()})
        return None

    # ---- step 3 -------------------------------------------------------------------------------
    def _check_write(self, now: float):
        c = self.c
        live = c._live()
        lost = [r for r in self.writing if r not in live]
        if lost and self.stopped_gen != self.generation:
            # The others may be blocked on the lost rank inside the survivors' group: stop them.
            self.stopped_gen = self.generation
            c._do("stop", sorted(set(self.writing) & live), {"reason": f"rank(s) {lost} lost during the dump"})
        if self.pend["waiting"] & live:
            return None
        results = self.pend["results"]
        failed = {r: d for r, (ok, d) in results.items() if not ok}
        if not lost and not failed and len(results) == len(self.writing):
            return self._done(results)
        if lost:
            log.warning("dying gasp: rank(s) %s lost while writing; re-planning without them", lost)
            for r in lost:
                self.statuses.pop(r, None)
            return self._write()
        why = "; ".join(f"rank {r}: {d}" for r, d in sorted(failed.items()))[:600]
        return self._refuse(f"the survivors could not write the checkpoint ({why})")

    def _done(self, results):
        c = self.c
        info = json.loads(next(d for ok, d in results.values() if ok and d))
        seconds = time.monotonic() - self.t0
        self.result = {"iteration": self.plan.iteration, "path": info["path"], "save": info["save"],
                       "seconds": round(seconds, 4), "write_s": info["seconds"],
                       "ranks": sorted(self.plan.writers.values()), "survivors": self.writing,
                       "generation": self.generation, "bytes": info.get("bytes")}
        c.events.emit("checkpoint", kind="dying_gasp", **self.result)
        c.strategy_note = (f"dying-gasp checkpoint of iteration {self.plan.iteration} written to "
                           f"{info['path']} in {seconds:.2f}s by {len(self.writing)} survivor(s)")
        log.info("dying gasp: %s", c.strategy_note)
        return O.OK

    def _refuse(self, message: str, plan: DumpPlan | None = None):
        c = self.c
        self.refusal = message
        c.events.emit("dump_refused", message=message,
                      missing=[list(g) for g in plan.missing] if plan is not None else [])
        c.strategy_note = message
        log.error("dying gasp: %s", message)
        return O.FAILED
