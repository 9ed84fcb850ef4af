"""Who controls the job next: standbys named and replaced, a standby's takeover when the controller
is lost, and a planned handover when the controller's own host rank is to be migrated.

The active controller announces where it listens (``announce``: controller.json in the log dir, and
the job store, where nodes without that dir look) and serves the metrics.

A takeover (policy/quorum.py says when one may happen) is the standby becoming the active controller
with the next epoch: the ranks that never came over are expected like any other (lost if they stay
silent), the faults reported to it while it stood by are handled.

A handover is the same takeover, ordered: the controller tells its first live standby to take over
at once (``takeover``), and once it has, tells every rank and agent to ``reconnect`` there and
retires — its process trains on as an ordinary rank, which the new controller then migrates.
"""
from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any

from ...events import get_logger
from ..policy import quorum
from ..policy.states import State as S
from ..wire import discovery
from ..wire.announcement import write_controller_json

if TYPE_CHECKING:
    from .controller import Controller

log = get_logger("control.controller")
HANDOVER_WAIT_S = 30.0   # the new controller waits this long for the job to come over before migrating


class Succession:
    def __init__(self, controller: Controller):
        self.c = controller
        self.handing_to: int | None = None     # the standby ordered to take over (this controller retires)
        self.ordered: dict[str, Any] | None = None  # a standby: the takeover ordered by the active controller
        self.after: tuple[int, str, float] | None = None  # a new controller: (rank to migrate, reason, since)
        self._store_moved_at = 0.0                        # when this controller moved the job store
        self._store_nowhere_said = False

    # ---- where the active controller is -------------------------------------------------------------
    def announce(self, quiet: bool = False) -> None:
        c = self.c
        info = {"host": c.host, "port": c.port_number, "endpoint": c.endpoint,
                "server_public_key": c.keys.server_public_text(), "secure": c.keys.secure,
                "epoch": c.epoch, "rank": c.rank, "pid": os.getpid(), "job_id": c.job_id,
                "world_size": c.world, "hostname": socket.gethostname(), "started": time.time(),
                "backups": c.standbys.endpoints()}
        if c.write_json:
            write_controller_json(c.log_dir, info)
        if c.job_store is not None:  # where nodes without this log dir find us
            c.job_store.publish(discovery.CONTROLLER_KEY, info, epoch=c.epoch)
            c.job_store.beat(discovery.beat_key(c.epoch))  # (that this controller still reaches the store)
            c.job_store.watch(discovery.CONTROLLER_KEY)    # (a newer one's record, after a partition)
        if not quiet:
            log.info("controller (epoch %d) listening on %s, world %d, %s", c.epoch, c.endpoint,
                     c.world, "CurveZMQ" if c.keys.secure else "INSECURE")

    def keep_store(self, now: float) -> None:
        """Move the job store to a live agent's when it is lost while the job runs: its host refuses
        connections (node 0's agent, which served it, is gone), or it stays silent while this
        controller hears a majority of the ranks (node 0 is cut off or dead; less than half, and
        this controller may be the side cut off: the store stays the tie-break of the side that
        reaches it). Without a store, a restarted rank on a node without this log dir would find
        no controller, and a standby could not take over with half of the world."""
        c = self.c
        store = c.job_store
        # (since the last round it answered in full: a call to a store cut off may hang, not fail)
        silent = now - max(store.answered_at, self._store_moved_at) if store is not None and store.ever_reached else 0.0
        if store is None or silent < 1.0:
            return
        if store.refused:
            why = "its host refuses connections (the agent that served it is gone)"
        elif silent >= 2 * quorum.LEASE_S and quorum.has_quorum(len(c.table.live()), c.world):
            why = f"it has not answered for {silent:.0f} s, while this controller hears a majority of the ranks"
        else:
            return
        here = discovery.address_text(store.address)
        offers = sorted((a for a in c.table.live_agents(now) if a.store and a.store != here), key=lambda a: a.node_rank)
        if not offers:
            if not self._store_nowhere_said:
                self._store_nowhere_said = True
                log.error("the job store %s is lost (%s) and no live agent offers one: a rank restarted on a node "
                          "without this log dir will not find the controller", here, why)
            return
        to = offers[0]
        address = discovery.parse_address(to.store)
        if address is None or not store.move(address):
            return
        self._store_moved_at, self._store_nowhere_said = now, False
        c.events.emit("store_moved", old=here, new=to.store, node_rank=to.node_rank, why=why)
        log.warning("the job store %s is lost: %s; it moves to node %d's agent, %s", here, why, to.node_rank, to.store)
        c.push_backups()  # (every answer names the store in use from now on)

    def serve_metrics(self) -> None:
        """--ha-metrics-port: the active controller (a standby from its takeover) serves /metrics."""
        c = self.c
        port = c.options.metrics_port
        if not port or c.metrics is not None:
            return
        from .metrics import Metrics
        try:
            c.metrics = Metrics(c.host, port, c.world)
        except OSError as e:  # metrics are for people: a taken port must not take the job down
            log.error("--ha-metrics-port %d on %s: cannot serve metrics (%s)", port, c.host, e)
            c.events.emit("metrics_failed", port=port, host=c.host, error=str(e))
            return
        c.metrics.set_state(c.machine.state.value)
        c.events.listeners.append(c.metrics.on_event)

    def superseded(self) -> bool:
        """A newer controller is announced in the job store: a standby on the store's side of a
        partition took over while this controller was cut off from it. This one retires and sends
        every rank and agent it still reaches there (the new controller declared this side's ranks
        lost: it fences them and has their agents restart them)."""
        c = self.c
        rec = c.job_store.seen(discovery.CONTROLLER_KEY) if c.job_store is not None else None
        if (not rec or int(rec.get("epoch", 0)) <= c.epoch or rec.get("job_id") not in (None, c.job_id)
                or c.machine.state == S.DONE or self.handing_to is not None):  # (a handover: taken_over)
            return False
        args = {"endpoint": str(rec["endpoint"])}
        c.orders.send("reconnect", sorted(c.table.live()), args)
        c.orders.to_agents("reconnect", args)
        c.events.emit("superseded", epoch=int(rec["epoch"]), endpoint=args["endpoint"])
        log.error("a newer controller (epoch %d, %s) took over while this one (epoch %d) was cut off from the job "
                  "store: this one retires, and its ranks and agents go there", int(rec["epoch"]), args["endpoint"],
                  c.epoch)
        c.retire()
        return True

    # ---- standbys -----------------------------------------------------------------------------
    def name_standbys(self) -> None:
        """Name the standbys; after a recovery, replace those whose process was lost (a restarted
        rank runs no standby), so that the controller's own loss stays survivable."""
        c = self.c
        if c.machine.state != S.NORMAL or c.world < 2 or self.handing_to is not None:
            return
        lost, new = c.standbys.renew(c.ranks, c.rank)
        if new:
            c.orders.send("standby", new, {"world": c.world, "epoch": c.epoch, "controller": -1 if c.rank is None else c.rank})
        if lost:
            c.push_backups()
            self.announce(quiet=True)
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
        store = c.job_store
        store_lost_it = store is None or store.refused or \
            store.still_for(discovery.beat_key(c.epoch)) >= quorum.LEASE_S
        if not quorum.may_take_over(len(reachable), c.world, not known_lost, store_lost_it):
            return
        if not quorum.has_quorum(len(reachable), c.world) and store is not None and not store.refused:
            # Exactly half: another standby may hear from the other half of the ranks. The store
            # lets one of them go on (without a store, or with it gone, the first takes over).
            if not store.claim(discovery.takeover_key(c.epoch + 1), f"{c.rank}:{os.getpid()}"):
                return
        self._promote(now, len(reachable), c.epoch + 1, "quorum")

    def _promote(self, now: float, reachable: int, epoch: int, why: str) -> None:
        c = self.c
        c.become_active(epoch, now)
        self.announce()
        self.serve_metrics()
        c.events.emit("takeover", rank=c.rank, epoch=c.epoch, reachable=reachable, why=why)
        log.warning("controller takeover by rank %s (epoch %d, %s): %d of %d ranks reachable",
                    c.rank, c.epoch, why, reachable, c.world)
        for f in c.ledger.take_deferred():
            c.fault(f["ranks"], f["kind"], f["iteration"], f["phase"], f["detect_s"], f["detail"],
                    key=("deferred", tuple(f["ranks"]), f["kind"], f["time"]), rid=f["rid"])

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
        c.orders.send("takeover", [live[0]], {"epoch": c.epoch + 1, "migrate": r, "reason": reason})
        c.events.emit("handover", to=live[0], rank=r, reason=reason)
        log.warning("rank %d hosts this controller: handing it over to the standby on rank %d, which then "
                    "migrates rank %d", r, live[0], r)
        return None

    def taken_over(self, endpoint: str) -> None:
        """The standby took over: everyone goes there, and this controller retires."""
        c = self.c
        args = {"endpoint": endpoint}
        c.orders.send("reconnect", sorted(c.table.live()), args)
        c.orders.to_agents("reconnect", args)
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
        info, agent = c.ranks.get(r), c.table.agent_of(r)
        if info is None or not info.pid or agent is None or agent.spares < 1:
            return
        if c.migrations.request(r, reason) is None:
            self.after = None

