"""Who controls the job next: standbys named and replaced, a standby's takeover when the controller
is lost, and a planned handover when the controller's own host rank is to be migrated.

The active controller announces where it listens (``announce``: controller.json in the log dir, and
the job store, where nodes without that dir look); it keeps the job store where the job can reach it
(``keep_store``) and steps down when a newer controller is announced there (``superseded``).

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
from typing import Any

from ...events import EventLog, get_logger
from ..policy import quorum
from ..policy.ledger import FaultLedger
from ..policy.ranks import RankTable
from ..policy.standbys import Standbys
from ..policy.states import State as S
from ..wire import discovery
from ..wire.announcement import write_controller_json
from ..wire.discovery import JobStore
from .orders import Orders
from .ports import ControllerPort, Identity

log = get_logger("control.controller")
HANDOVER_WAIT_S = 30.0   # the new controller waits this long for the job to come over before migrating


class Succession:
    def __init__(self, port: ControllerPort, identity: Identity, table: RankTable, orders: Orders,
                 standbys: Standbys, ledger: FaultLedger, events: EventLog, heartbeat_s: float,
                 job_store: JobStore | None, write_json: bool = True, previous: int | None = None):
        """``write_json``: announce in the log dir's controller.json too; ``previous``: a standby's,
        the rank hosting the controller it backs up."""
        self.port, self.identity, self.table, self.orders = port, identity, table, orders
        self.standbys, self.ledger, self.events = standbys, ledger, events
        self.heartbeat_s, self.job_store = heartbeat_s, job_store
        self.write_json, self.previous = write_json, previous
        self.handing_to: int | None = None     # the standby ordered to take over (this controller retires)
        self.ordered: dict[str, Any] | None = None  # a standby: the takeover ordered by the active controller
        self.after: tuple[int, str, float] | None = None  # a new controller: (rank to migrate, reason, since)
        self._store_moved_at = 0.0                        # when this controller moved the job store
        self._store_nowhere_said = False

    # ---- where the active controller is -------------------------------------------------------------
    def announce(self, quiet: bool = False) -> None:
        me, epoch = self.identity, self.port.epoch
        info = {"host": me.host, "port": me.port, "endpoint": me.endpoint,
                "server_public_key": me.keys.server_public_text(), "secure": me.keys.secure,
                "epoch": epoch, "rank": me.rank, "pid": os.getpid(), "job_id": me.job_id,
                "world_size": me.world, "hostname": socket.gethostname(), "started": time.time(),
                "backups": self.standbys.endpoints()}
        if self.write_json:
            write_controller_json(me.log_dir, info)
        if self.job_store is not None:  # where nodes without this log dir find us
            self.job_store.publish(discovery.CONTROLLER_KEY, info, epoch=epoch)
            self.job_store.beat(discovery.beat_key(epoch))  # (that this controller still reaches the store)
            self.job_store.watch(discovery.CONTROLLER_KEY)  # (a newer one's record, after a partition)
        if not quiet:
            log.info("controller (epoch %d) listening on %s, world %d, %s", epoch, me.endpoint,
                     me.world, "CurveZMQ" if me.keys.secure else "INSECURE")

    def keep_store(self, now: float) -> None:
        """Move the job store to a live agent's when it is lost while the job runs: its host refuses
        connections (node 0's agent, which served it, is gone), or it stays silent while this
        controller hears a majority of the ranks (node 0 is cut off or dead; less than half, and
        this controller may be the side cut off: the store stays the tie-break of the side that
        reaches it). Without a store, a restarted rank on a node without this log dir would find
        no controller, and a standby could not take over with half of the world."""
        store = self.job_store
        # (since the last round it answered in full: a call to a store cut off may hang, not fail)
        silent = now - max(store.answered_at, self._store_moved_at) if store is not None and store.ever_reached else 0.0
        if store is None or silent < 1.0:
            return
        if store.refused:
            why = "its host refuses connections (the agent that served it is gone)"
        elif silent >= 2 * quorum.LEASE_S and quorum.has_quorum(len(self.table.live()), self.identity.world):
            why = f"it has not answered for {silent:.0f} s, while this controller hears a majority of the ranks"
        else:
            return
        here = discovery.address_text(store.address)
        offers = sorted((a for a in self.table.live_agents(now) if a.store and a.store != here),
                        key=lambda a: a.node_rank)
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
        self.events.emit("store_moved", old=here, new=to.store, node_rank=to.node_rank, why=why)
        log.warning("the job store %s is lost: %s; it moves to node %d's agent, %s", here, why, to.node_rank, to.store)
        self.port.push_backups()  # (every answer names the store in use from now on)

    def tick(self, now: float) -> bool:
        """The controller's clock, for what succession watches: a standby's promotion (False: it only
        watches), the rank to migrate after a hand-over, and where a job store can move or announce a
        newer controller (False: superseded). Nothing otherwise."""
        if self.port.standby:
            self.maybe_promote(now)
            return False
        if self.after is not None:
            self.migrate_when_ready(now)
        if self.job_store is not None:
            if self.superseded():
                return False
            self.keep_store(now)
        return True

    def superseded(self) -> bool:
        """A newer controller is announced in the job store: a standby on the store's side of a
        partition took over while this controller was cut off from it. This one retires and sends
        every rank and agent it still reaches there (the new controller declared this side's ranks
        lost: it fences them and has their agents restart them)."""
        store = self.job_store
        rec = store.seen(discovery.CONTROLLER_KEY) if store is not None else None
        epoch = self.port.epoch
        if (not rec or int(rec.get("epoch", 0)) <= epoch or rec.get("job_id") not in (None, self.identity.job_id)
                or self.port.state == S.DONE or self.handing_to is not None):  # (a handover: taken_over)
            return False
        args = {"endpoint": str(rec["endpoint"])}
        self.orders.send("reconnect", sorted(self.table.live()), args)
        self.orders.to_agents("reconnect", args)
        self.events.emit("superseded", epoch=int(rec["epoch"]), endpoint=args["endpoint"])
        log.error("a newer controller (epoch %d, %s) took over while this one (epoch %d) was cut off from the job "
                  "store: this one retires, and its ranks and agents go there", int(rec["epoch"]), args["endpoint"],
                  epoch)
        self.port.retire()
        return True

    # ---- standbys -----------------------------------------------------------------------------
    def name_standbys(self) -> None:
        """Name the standbys; after a recovery, replace those whose process was lost (a restarted
        rank runs no standby), so that the controller's own loss stays survivable."""
        me = self.identity
        if self.port.state != S.NORMAL or me.world < 2 or self.handing_to is not None:
            return
        lost, new = self.standbys.renew(self.table.ranks, me.rank)
        if new:
            self.orders.send("standby", new, {"world": me.world, "epoch": self.port.epoch,
                                              "controller": -1 if me.rank is None else me.rank})
        if lost:
            self.port.push_backups()
            self.announce(quiet=True)
            log.info("standby controller(s) on rank(s) %s lost; new standby on %s", lost, new)

    def standby_up(self, r: int, endpoint: str) -> None:
        """Rank ``r``'s standby listens at ``endpoint``: every rank and agent learns it now, and so does
        a client that never got an answer naming it (it looks in the announcement)."""
        self.standbys.up(r, endpoint)
        self.port.push_backups()
        self.announce(quiet=True)
        self.events.emit("standby", rank=r, endpoint=endpoint)

    # ---- a standby ----------------------------------------------------------------------------
    def order_takeover(self, args: dict[str, Any]) -> None:
        """A standby: the active controller hands itself over to this one (its host is to be
        migrated); ``maybe_promote`` carries it out at the controller's next tick."""
        self.ordered = args

    def maybe_promote(self, now: float) -> None:
        world, epoch = self.identity.world, self.port.epoch
        window = 3.0 * max(self.heartbeat_s, 0.5)
        # Only ranks whose links came over count, this standby's own rank included: while its link
        # still hears the controller, the controller is alive, whoever else failed to reach it (a
        # rank starved at start-up gives up on it after a second, and with this standby's own rank
        # counted in advance made half of a world of four: two controllers).
        reachable = {r for r, i in self.table.ranks.items() if now - i.seen < window and i.alive}
        ordered, self.ordered = self.ordered, None
        if ordered is not None:
            self._promote(now, len(reachable), int(ordered["epoch"]), "handover")
            self.after = (int(ordered["migrate"]), str(ordered.get("reason") or "requested"), now)
            return
        known_lost = self.previous is not None and self.previous >= 0 and self.previous not in reachable
        store = self.job_store
        store_lost_it = store is None or store.refused or \
            store.still_for(discovery.beat_key(epoch)) >= quorum.LEASE_S
        if not quorum.may_take_over(len(reachable), world, not known_lost, store_lost_it):
            return
        if not quorum.has_quorum(len(reachable), world) and store is not None and not store.refused:
            # Exactly half: another standby may hear from the other half of the ranks. The store
            # lets one of them go on (without a store, or with it gone, the first takes over).
            if not store.claim(discovery.takeover_key(epoch + 1), f"{self.identity.rank}:{os.getpid()}"):
                return
        self._promote(now, len(reachable), epoch + 1, "quorum")

    def _promote(self, now: float, reachable: int, epoch: int, why: str) -> None:
        self.port.become_active(epoch, now)
        self.announce()
        self.port.serve_metrics()
        rank, epoch = self.identity.rank, self.port.epoch
        self.events.emit("takeover", rank=rank, epoch=epoch, reachable=reachable, why=why)
        log.warning("controller takeover by rank %s (epoch %d, %s): %d of %d ranks reachable",
                    rank, epoch, why, reachable, self.identity.world)
        for f in self.ledger.take_deferred():
            self.port.fault(f["ranks"], f["kind"], f["iteration"], f["phase"], f["detect_s"], f["detail"],
                            key=("deferred", tuple(f["ranks"]), f["kind"], f["time"]), rid=f["rid"])

    # ---- a handover ---------------------------------------------------------------------------
    def hand_over(self, r: int, reason: str) -> str | None:
        """Rank ``r`` hosts this controller and is to be migrated: the first live standby takes
        over first. The refusal's reason, or None."""
        if self.handing_to is not None:
            return f"the controller is being handed over to rank {self.handing_to} already"
        live = [s for s, ep in self.standbys.named() if ep and s in self.table.live() and s != r]
        if not live:
            return (f"rank {r} hosts the controller, and no standby stands by to take it over (they are named "
                    "while the job trains; ask again in a moment)")
        self.handing_to = live[0]
        self.orders.send("takeover", [live[0]], {"epoch": self.port.epoch + 1, "migrate": r, "reason": reason})
        self.events.emit("handover", to=live[0], rank=r, reason=reason)
        log.warning("rank %d hosts this controller: handing it over to the standby on rank %d, which then "
                    "migrates rank %d", r, live[0], r)
        return None

    def taken_over(self, endpoint: str) -> None:
        """The standby took over: everyone goes there, and this controller retires."""
        args = {"endpoint": endpoint}
        self.orders.send("reconnect", sorted(self.table.live()), args)
        self.orders.to_agents("reconnect", args)
        self.events.emit("retired", to=self.handing_to, endpoint=endpoint)
        log.warning("controller handed over to rank %s at %s: this one retires", self.handing_to, endpoint)
        self.port.retire()

    def cancel_hand_over(self, error: str) -> None:
        """The standby could not take over: this controller stays, and the migration is refused."""
        self.handing_to = None
        self.events.emit("migrate_refused", rank=self.identity.rank, why=f"handover failed: {error}")

    def migrate_when_ready(self, now: float) -> None:
        """A new controller from a handover: once the job has come over (every rank registered, the
        agents heard), it migrates the rank whose host handed it over."""
        if self.after is None or self.port.state != S.NORMAL:
            return
        r, reason, since = self.after
        if now - since > HANDOVER_WAIT_S:
            self.after = None
            self.events.emit("migrate_refused", rank=r, reason=reason, why="the job did not come over in time")
            return
        info, agent = self.table.ranks.get(r), self.table.agent_of(r)
        if info is None or not info.pid or agent is None or agent.spares < 1:
            return
        if self.port.request_migration(r, reason) is None:
            self.after = None
