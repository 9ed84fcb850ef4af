"""Who controls the job next: standbys named and replaced, a standby's takeover when the controller
is lost, and a planned handover when the controller's own host rank is to be migrated.

A takeover (election.py says when one may happen) is the standby becoming the active controller
with the next epoch: the ranks that never came over are expected like any other (lost if they stay
silent), the faults reported to it while it stood by are handled.

A handover is the same takeover, ordered: the controller tells its first live standby to take over
at once (``takeover``), and once it has, tells every rank and agent to ``reconnect`` there and
retires — its process trains on as an ordinary rank, which the new controller then migrates.
"""
from __future__ import annotations

from ..events import get_logger
from . import election
from .states import Machine, State as S

log = get_logger("control.controller")
HANDOVER_WAIT_S = 30.0   # the new controller waits this long for the job to come over before migrating


class Succession:
    def __init__(self, controller):
        self.c = controller
        self.handing_to: int | None = None     # the standby ordered to take over (this controller retires)
        self.ordered: dict | None = None       # a standby: the takeover ordered by the active controller
        self.after: tuple | None = None        # a new controller: (rank to migrate, reason, since)

    # ---- standbys -----------------------------------------------------------------------------
    def name_standbys(self) -> None:
        """Name the standbys; after a recovery, replace those whose process was lost (a restarted
        rank runs no standby), so that the controller's own loss stays survivable."""
        c = self.c
        if c.machine.state != S.NORMAL or c.world < 2 or self.handing_to is not None:
            return
        lost, new = c.standbys.renew(c.ranks, c.rank)
        if new:
            c.order("standby", new, {"world": c.world, "epoch": c.epoch, "controller": -1 if c.rank is None else c.rank})
        if lost:
            c.push_backups()
            c._announce(quiet=True)
            log.info("standby controller(s) on rank(s) %s lost; new standby on %s", lost, new)

    # ---- a standby ----------------------------------------------------------------------------
    def maybe_promote(self, now: float) -> None:
        c = self.c
        window = 3.0 * max(c.hb, 0.5)
        # Only ranks whose links came over count, this standby's own rank included: while its link
        # still hears the controller, the controller is alive, whoever else failed to reach it (a
        # rank starved at start-up gives up on it after a second, and with this standby's own rank
        # counted in advance made half of a world of four: two controllers).
        reachable = {r for r, i in c.ranks.items() if now - i.seen < window and i.alive}
        ordered, self.ordered = self.ordered, None
        if ordered is not None:
            self._promote(now, len(reachable), int(ordered["epoch"]), "handover")
            self.after = (int(ordered["migrate"]), str(ordered.get("reason") or "requested"), now)
            return
        known_lost = c.previous is not None and c.previous >= 0 and c.previous not in reachable
        if election.may_take_over(len(reachable), c.world, not known_lost):
            self._promote(now, len(reachable), c.epoch + 1, "quorum")

    def _promote(self, now: float, reachable: int, epoch: int, why: str) -> None:
        c = self.c
        c.standby = False
        c.epoch = max(epoch, c.epoch + 1)
        c.machine = Machine(c._on_transition, state=S.NORMAL)
        c.table.heard_all(now)  # start the clocks now for ranks that have not come over yet
        c.table.expect_all(now)
        c._announce()
        c._serve_metrics()
        c.events.emit("takeover", rank=c.rank, epoch=c.epoch, reachable=reachable, why=why)
        log.warning("controller takeover by rank %s (epoch %d, %s): %d of %d ranks reachable",
                    c.rank, c.epoch, why, reachable, c.world)
        c._refresh_ack()
        deferred, c._deferred = c._deferred, []
        for rec in deferred:
            c._fault(rec["ranks"], rec["kind"], rec["iteration"], rec["phase"], rec["detect_s"],
                     rec["detail"], key=("deferred", tuple(rec["ranks"]), rec["kind"], rec["time"]), rid=rec.get("rid"))

    # ---- a handover ---------------------------------------------------------------------------
    def hand_over(self, r: int, reason: str) -> str | None:
        """Rank ``r`` hosts this controller and is to be migrated: the first live standby takes
        over first. The refusal's reason, or None."""
        c = self.c
        if self.handing_to is not None:
            return f"the controller is being handed over to rank {self.handing_to} already"
        live = [s for s, ep in c.standbys.named() if ep and s in c.table.live() and s != r]
        if not live:
            return (f"rank {r} hosts the controller, and no standby stands by to take it over (they are named "
                    "while the job trains; ask again in a moment)")
        self.handing_to = live[0]
        c.order("takeover", [live[0]], {"epoch": c.epoch + 1, "migrate": r, "reason": reason})
        c.events.emit("handover", to=live[0], rank=r, reason=reason)
        log.warning("rank %d hosts this controller: handing it over to the standby on rank %d, which then "
                    "migrates rank %d", r, live[0], r)
        return None

    def taken_over(self, endpoint: str) -> None:
        """The standby took over: everyone goes there, and this controller retires."""
        c = self.c
        args = {"endpoint": endpoint}
        c.order("reconnect", sorted(c.table.live()), args)
        c._to_agents("reconnect", args)
        c.events.emit("retired", to=self.handing_to, endpoint=endpoint)
        log.warning("controller handed over to rank %s at %s: this one retires", self.handing_to, endpoint)
        c.retire()

    def migrate_when_ready(self, now: float) -> None:
        """A new controller from a handover: once the job has come over (every rank registered, the
        agents heard), it migrates the rank whose host handed it over."""
        c = self.c
        if self.after is None or c.machine.state != S.NORMAL:
            return
        r, reason, since = self.after
        if now - since > HANDOVER_WAIT_S:
            self.after = None
            c.events.emit("migrate_refused", rank=r, reason=reason, why="the job did not come over in time")
            return
        info = c.ranks.get(r)
        if info is None or not info.pid or not c.agents or not c.table.agent_of(r) or c.table.agent_of(r).spares < 1:
            return
        if c.migrations.request(r, reason) is None:
            self.after = None

