"""The controller: sees every rank, detects faults, runs the recovery state machine.

A thread on rank 0 by default (``Controller(...).start()``), a standalone process with
``mindspeed-ha controller``, or a standby (``standby=True``) on a backup rank that promotes itself
when it holds a quorum (policy/quorum.py). Everything runs on the one controller thread: no locks on
the rank table, and a decision is never late because a lock was held.

The controller's own job is receiving (``_run``: each message to its handler in inbox.py), timing
(``_tick``: silences, hangs, time limits) and deciding (the state machine). What it decides is carried
out by the parts that hold each piece of the job: the rank table (policy/ranks.py), orders and
answers (orders.py), the fault ledger (policy/ledger.py), restarts (restarts.py), elastic resizes
(scaling.py), migrations (migration.py) and who controls next (succession.py). The helpers see the
controller through ``HelperPort`` (ports.py), and are consulted when they have something to say —
newcomers offered a place, a migration in the episode, a rank to migrate after a hand-over, a job
store, a standby lost — not on every tick or fault.

A fault's life: ``Detection.fault`` records it and feeds FAULT; PAUSE stops every survivor; DECIDE
picks the strategy; RECOVERING plays its stages, DUMP the dump's (control/strategies, one file each,
through rounds.Runner and the narrow ``PlaybookPort``: ``Recovery``); EXIT tells everyone to go with
the diagnosis (``Ending``). The states and their moves are one table (policy/states.py), the same for
every strategy. An exception inside a state's work is that state's FAILED outcome, never the end of
the controller.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Any, Callable, Hashable, Iterable

from ...events import EventLog, get_logger
from ...options import HAOptions
from ..policy.diagnosis import diagnosis
from ..policy.ledger import Fault, FaultLedger
from ..policy.ranks import RankTable
from ..policy.recurrence import Recurrences
from ..policy.standbys import Standbys
from ..policy.states import TABLE, TIMEOUTS, Machine, Outcome as O, State as S
from ..wire import discovery, hosts, protocol, security
from ..wire.router import Router
from ..strategies import DUMP
from .collector import CollectorHold
from .detection import Detection
from .ending import Ending
from .inbox import Inbox
from .metrics import Served
from .migration import Migrations
from .orders import Answer, Orders
from .ports import ControllerPort, Identity
from .recovery import Recovery
from .restarts import Restarts
from .scaling import Scaling
from .succession import Succession

log = get_logger("control.controller")


def _serve_store(host: str) -> Any:
    """The rebuild store (torch is needed here only, when the first recovery needs it)."""
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        raise RuntimeError("this controller runs without torch, so it cannot serve the store that "
                           "rebuilt process groups meet at; run it where torch is installed") from None
    from mindspeed_ha.comm.stores import serve
    return serve(host)


def _host_addr() -> str:
    return os.environ.get("MINDSPEED_HA_NODE_HOST") or os.environ.get("MASTER_ADDR") or "127.0.0.1"


class PlaybookPort:
    """What a playbook may ask of the controller (rounds.Port): orders, answers, who is live, the
    launcher agents, the rebuild store, events — nothing else of its state."""

    def __init__(self, c: Controller):
        self._c = c

    def order(self, action: str, ranks: Iterable[int], args: dict[str, Any]) -> int:
        return self._c.orders.send(action, ranks, args)

    def answers(self, order_id: int) -> dict[int, Answer]:
        return self._c.orders.answers(order_id)

    def quiet(self, order_id: int) -> bool:
        return self._c.orders.quiet(order_id)

    def live(self) -> set[int]:
        return self._c.table.live()

    def lost(self) -> set[int]:
        return self._c.table.lost()

    def host_rank(self) -> int | None:
        return self._c.rank

    def held(self, rank: int) -> str:
        info = self._c.table.ranks.get(rank)
        return info.held if info is not None and info.alive else ""

    def condemn(self, ranks: list[int]) -> None:
        """recover: hung ranks are replaced like dead ones (their agent kills and restarts them)."""
        self._c.table.mark_dead(ranks)
        self._c.orders.excuse(ranks)

    def restart(self, ranks: list[int]) -> tuple[list[int], list[int], list[int]]:
        return self._c.restarts.restart(ranks)

    def restarting(self) -> set[int]:
        return set(self._c.restarts.restarting)

    def store(self) -> tuple[str, int]:
        return self._c.host, self._c.store().port

    def new_generation(self) -> int:
        self._c.generation += 1
        return self._c.generation

    def hung(self, ranks: list[int], detail: str) -> None:
        self._fault_in_recovery(ranks, "hang", detail)

    def failed(self, ranks: list[int], detail: str, order_id: int) -> None:
        by_kind: dict[str, list[int]] = {}
        for r in ranks:
            by_kind.setdefault(self._c.orders.kind(order_id, r), []).append(r)
        for kind, theirs in by_kind.items():
            self._fault_in_recovery(theirs, kind, detail)

    def _fault_in_recovery(self, ranks: list[int], kind: str, detail: str) -> None:
        c = self._c
        c.detection.fault(list(ranks), kind, c.table.newest_iteration(), "recovery", detail=detail,
                          key=(f"{kind}-in-recovery", tuple(ranks), c.generation))

    def emit(self, event: str, **fields: Any) -> None:
        self._c.events.emit(event, **fields)

    def set_note(self, text: str) -> None:
        self._c.recovery.note = text

    def closed(self, faults: list[Fault], now: float, moved_bytes: int, phases: dict[str, float]) -> None:
        self._c.migrations.closed(faults, now, moved_bytes, phases)

    def scaled(self, dp: int, replica_groups: dict[int, list[int]]) -> None:
        self._c.scaling.scaled(dp, replica_groups)

    def leave(self, ranks: list[int], reason: str) -> None:
        self._c.scaling.leave(ranks, reason)


class HelperPort:
    """What a helper (inbox, scaling, migrations, succession) may ask of the controller
    (ports.ControllerPort): where it stands, an outcome or a fault fed to it, a takeover or its
    retirement, and the requests one helper makes of another — nothing else of its state."""

    def __init__(self, c: Controller):
        self._c = c

    @property
    def state(self) -> S:
        return self._c.machine.state

    @property
    def epoch(self) -> int:
        return self._c.epoch

    @property
    def standby(self) -> bool:
        return self._c.standby

    def first_step_pending(self) -> bool:
        return self._c.recovery.first_step is not None

    def ack(self) -> bytes:
        return self._c.ack

    def status(self) -> dict[str, Any]:
        return self._c.status()

    def feed(self, outcome: O) -> None:
        self._c.feed(outcome)

    def fault(self, ranks: list[int], kind: str, iteration: int, phase: str, detect_s: float = 0.0,
              detail: str = "", key: Hashable = None, rid: str | None = None, feed: bool = True,
              entered: dict[str, Any] | None = None, fault_class: str = "fault", frame: str = "") -> bool:
        return self._c.detection.fault(ranks, kind, iteration, phase, detect_s, detail, key, rid, feed, entered,
                                       fault_class, frame)

    def become_active(self, epoch: int, now: float) -> None:
        self._c.become_active(epoch, now)

    def retire(self) -> None:
        self._c.retire()

    def push_backups(self) -> None:
        self._c.push_backups()

    def serve_metrics(self) -> None:
        self._c.serve_metrics()

    def request_migration(self, rank: int, reason: str) -> str | None:
        return self._c.migrations.request(rank, reason)

    def hand_over(self, rank: int, reason: str) -> str | None:
        return self._c.succession.hand_over(rank, reason)

    def registered_strategies(self, rank: int, names: frozenset[str]) -> None:
        """A controller whose strategies are the ranks' (``mindspeed-ha controller``: options.source
        "ranks") takes those of the first rank that says them; a rank whose differ from the job's is
        named (every rank must enable the same: its flags, or HIGH_AVAILABILITY on its node)."""
        c = self._c
        if c.options.source == "ranks":
            options = dataclasses.replace(c.options, strategies=names, source=f"rank {rank}")
            for part in (c, c.recovery, c.migrations, c.detection, c.ending):  # (one options object, shared)
                part.options = options
            c.events.emit("strategies", rank=rank, strategies=sorted(names))
            log.info("strategies %s, as rank %d registered them", ", ".join(options.ordered_strategies()), rank)
        elif names != c.options.strategies:
            c.events.emit("strategies_differ", rank=rank, strategies=sorted(names), job=sorted(c.options.strategies))
            log.error("rank %d enables the strategies %s, the job's controller %s: every rank must enable the same "
                      "(its flags, or HIGH_AVAILABILITY on its node); the controller's are used", rank, sorted(names),
                      sorted(c.options.strategies))


class Controller:
    def __init__(self, log_dir: str, world_size: int, options: HAOptions | None = None,
                 keys: security.Keys | None = None, host: str | None = None, port: int = 0,
                 rank: int | None = None, standby: bool = False, epoch: int = 1,
                 job_id: str | None = None, local_exit: Callable[[int], None] | None = None,
                 write_json: bool = True, job_store: discovery.JobStore | None = None,
                 previous: int | None = None, settled: Iterable[str] = ()):
        self.log_dir, self.world = log_dir, int(world_size)
        self.options = options or HAOptions(strategies=frozenset({DUMP.name}), source="ranks", log_dir=log_dir)
        self.job_id = job_id or os.environ.get("MINDSPEED_HA_JOB_ID")
        self.keys = keys if keys is not None else security.Keys.load(log_dir, self.options.key_dir,
                                                                     self.options.insecure, job=self.job_id)
        self.host = host or _host_addr()
        self.rank, self.standby, self.epoch = rank, standby, epoch
        self.local_exit = local_exit          # how the host rank exits (never through the socket)
        self.job_store = job_store            # discovery.JobStore: announcements reach every node there
        self.hb = float(self.options.heartbeat_s)
        dead_after = float(os.environ.get("MINDSPEED_HA_DEAD_AFTER", 0) or 0) or None
        self.table = RankTable(self.world, self.hb, self.options.hang_timeout_s, dead_after,
                               runs_here=lambda info: hosts.runs_here(info.pid, info.host))
        # The reports (rids) a recovery dealt with, by this controller or an earlier one, are settled:
        # a link re-sends what it was not told is settled, and a report is never acted on twice.
        self.ledger = FaultLedger(settled)
        self.standbys = Standbys()
        self.started_at = time.monotonic()
        self.generation = 0                   # of the rebuild store's key space; one per rebuild or dump
        self._tcp_store: Any = None
        self._closing = threading.Event()     # this controller stops controlling (closed, retired)
        self.done = threading.Event()
        self._thread: threading.Thread | None = None
        self.events = EventLog(log_dir, "controller")
        self.metrics = Served(self.host, self.options.metrics_port, self.world, self.events,
                              lambda: self.machine.state.value)
        self.machine = Machine(self._on_transition)
        self.router = Router(self.keys, self.host, port)
        self.port_number, self.endpoint = self.router.port, self.router.endpoint
        self.orders = Orders(self.router, self.table, lambda: self.epoch, rank)
        self.restarts = Restarts(self.table, self.orders, self.events, self.options.max_restarts, rank,
                                 self._end_host if local_exit is not None else None)
        recurrences = Recurrences(self.options.max_recurrences)  # each fault's recoveries so far
        self.identity = Identity(host=self.host, endpoint=self.endpoint, port=self.port_number, keys=self.keys,
                                 job_id=self.job_id, log_dir=log_dir, world=self.world, rank=rank)
        helper_port: ControllerPort = HelperPort(self)  # what its helpers see of it
        self.migrations = Migrations(helper_port, self.table, self.ledger, self.events, self.options, rank)
        # when to scale in, wait for a node, or grow onto one
        self.scaling = Scaling(helper_port, self.table, self.orders, self.restarts, self.ledger, self.events,
                               self.options.spare_wait_s, job_store)
        # standbys, takeovers, a handover before the host migrates
        self.succession = Succession(helper_port, self.identity, self.table, self.orders, self.standbys, self.ledger,
                                     self.events, self.hb, job_store, write_json=write_json, previous=previous)
        self.inbox = Inbox(helper_port, self.router, self.table, self.orders, self.restarts, self.events, self.scaling,
                           self.migrations, self.succession)
        self.handlers = self.inbox.handlers()
        # the strategies played (what the playbooks see of this controller: PlaybookPort), their faults
        # found, and the job's end
        self.collector = CollectorHold()
        self.recovery = Recovery(PlaybookPort(self), self.options, self.world, self.table, self.orders, self.ledger,
                                 self.restarts, recurrences, self.scaling, self.events)
        self.detection = Detection(helper_port, self.options, self.table, self.ledger, self.orders, self.restarts,
                                   self.recovery, self.router, self.events, self._publish)
        self.ending = Ending(self.options, log_dir, self.table, self.ledger, self.orders, self.restarts, recurrences,
                             self.recovery, self.router, self.events, rank, local_exit)
        self._last_scan = 0.0
        self.ack = b""                        # the answer to a heartbeat: epoch, state, standbys
        self.refresh_ack()

    # ---- life ---------------------------------------------------------------------------------
    def start(self) -> "Controller":
        if not self.standby:
            self.succession.announce()
            self.serve_metrics()
        self._thread = threading.Thread(target=self._run, name="mindspeed-ha-controller", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        self._closing.set()
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.metrics.close()
        self.collector.release()

    def retire(self) -> None:
        """Handed over to a standby: stop controlling (the router flushes what was sent as it closes)."""
        self._closing.set()
        self.metrics.close()

    def _run(self) -> None:
        try:
            while not self._closing.is_set() and self.machine.state != S.DONE:
                for ident, msg in self.router.receive(10):
                    self._dispatch(ident, msg)
                self._tick()
        finally:
            self.done.set()
            self.router.close()

    def _dispatch(self, ident: bytes, msg: dict[str, Any]) -> None:
        try:
            handler = self.handlers.get(msg["t"])
            if handler is None:
                self.router.drops.drop("unexpected", msg["t"])
            else:
                handler(ident, msg)
        except (KeyError, ValueError, TypeError, IndexError) as e:  # semantically bad, e.g. rank out of range
            self.router.drops.drop("invalid", f"{msg.get('t')}: {e}")
        except Exception:  # a bug in one handler must not take the controller down with it
            log.exception("error handling %s", msg.get("t"))

    def _tick(self) -> None:
        now = time.monotonic()
        try:
            if not self.succession.tick(now):  # a standby's watch; superseded
                return
            if now - self._last_scan >= self.hb / 10:
                self._last_scan = now
                self.detection.scan(now)
                self.orders.reroute(now)
            self._progress(now)
        except Exception as e:  # the work of the state raised: its FAILED outcome, where the table has one
            st = self.machine.state
            log.exception("controller: the work of state %s failed", st.value)
            self.recovery.raised(st, e)
            if (st, O.FAILED) in TABLE:
                self.feed(O.FAILED)

    # ---- the state machine --------------------------------------------------------------------
    def _on_transition(self, old: S, outcome: O, new: S, seconds: float) -> None:
        self.events.emit("state", **{"from": old.value, "to": new.value, "outcome": outcome.value,
                                     "seconds": round(seconds, 4)})
        log.info("state %s -(%s)-> %s after %.3fs", old.value, outcome.value, new.value, seconds)
        self.refresh_ack()
        self.collector.entered(new.value)

    def feed(self, outcome: O) -> None:
        """The state machine's next outcome; the new state's work runs at once."""
        before = self.machine.state
        new = self.machine.feed(outcome)
        # A new fault while stopping widens the stop to the new set of survivors; a strategy's next
        # stage (or the strategy it gave way to) is RECOVERING again.
        if new == before and not (new == S.PAUSE and outcome == O.FAULT) and new != S.RECOVERING:
            return
        try:
            result = self._enter(new, before, outcome)
        except Exception:
            log.exception("controller: the action of state %s failed", new.value)
            result = O.FAILED if (new, O.FAILED) in TABLE else None
        if result is not None:
            self.feed(result)

    def _enter(self, state: S, before: S, outcome: O) -> O | None:
        """A state's work, as it is entered."""
        if state == S.NORMAL:
            now = time.monotonic()
            self.table.heard_all(now)  # detection clocks start with training, not at registration
            if before == S.RECOVERING and self.recovery.episode is not None:  # its first step closes it
                self._settle_episode()
                self.recovery.resumed(now)
            if self.standbys.due(self.table.ranks):  # (after a recovery that cost a standby its process)
                self.succession.name_standbys()
        elif state == S.PAUSE:
            self.recovery.stop_survivors(self.scaling.waiting())
        elif state == S.DECIDE:
            return self.recovery.decide()
        elif state in (S.RECOVERING, S.DUMP):
            return self.recovery.play(state, outcome)
        elif state == S.EXIT:
            self.ending.tell()
        return None

    def _progress(self, now: float) -> None:
        """Conditions a state waits on, and per-state timeouts."""
        st = self.machine.state
        if st == S.NORMAL:  # first: the last step may also end the job
            self.recovery.check_first_step(now, self.scaling.waiting())
            if self.recovery.first_step is None:  # (the recovery is over)
                self.collector.release()
        if st == S.NORMAL and self.scaling.offered and self.scaling.ended_without():
            return
        if st in (S.NORMAL, S.INIT) and self.table.ranks and self.table.all_over() and not self.ledger.active:
            self.feed(O.FINISHED)
            return
        if st == S.NORMAL and self.scaling.offered:
            self.scaling.scale_out_when_ready()
        migrating = st == S.PAUSE or (st == S.RECOVERING and self.recovery.first_stage())
        if migrating and self.ledger.of_kind("migrate") and self.migrations.outrun():
            # The job ended its last step as the migration began: nobody parks, there is nothing to move.
            if self.table.all_over():
                self.migrations.abandon()
                self.feed(O.FINISHED)
            return
        if st == S.PAUSE and self.recovery.stopped():
            self.feed(O.STOPPED)
            return
        if st in (S.RECOVERING, S.DUMP):
            out = self.recovery.tick()
            if out is not None and self.machine.state == st:
                self.feed(out)
                return
        if st == S.EXIT:
            others = [r for r in self.table.live() if r != self.rank]
            if not others or now - self.machine.entered > TIMEOUTS[S.EXIT] - 1:
                self.feed(O.OK)  # EXIT -> DONE
                self.ending.exit_host()
                return
        if st == S.INIT and now - self.started_at > self.options.register_timeout_s:
            self.ending.not_registered()
            self.feed(O.TIMEOUT)
            return
        limit = self.recovery.limit(st, now, self.table.dead_after)
        if st != S.INIT and self.machine.overdue(limit):
            log.error("state %s ran past its %.1fs time limit", st.value, limit)
            self.feed(O.TIMEOUT)

    # ---- what the ranks, agents and people are told --------------------------------------------
    def refresh_ack(self) -> None:
        store = self.job_store
        moved = {"store": discovery.address_text(store.address)} if store is not None and store.moves else {}
        self.ack = protocol.encode("ack", epoch=self.epoch, state=self.machine.state.value, standby=self.standby,
                                   backups=self.standbys.endpoints(), **moved)

    def push_backups(self) -> None:
        """Every live rank and agent learns the standbys now, not in its next heartbeat's answer: a
        controller lost right after naming them leaves nobody that does not know where to go."""
        self.refresh_ack()
        self.router.fan_out(self._everyone(), self.ack)

    def _everyone(self) -> list[bytes]:
        """The sockets of every live rank and every agent."""
        return [i.ident for i in self.table.ranks.values() if i.alive] + [a.ident for a in self.table.agents.values()]

    def _settle_episode(self) -> None:
        """The recovery is done (training resumed): its reports are settled, here and at every rank
        and agent, whose links then stop re-sending them, and at the standbys' ranks."""
        rids = self.ledger.settle_active()
        if rids:
            self.router.fan_out(self._everyone(), protocol.encode("settled", rids=rids))

    def serve_metrics(self) -> None:
        """--ha-metrics-port: the active controller (a standby from its takeover) serves /metrics."""
        self.metrics.serve()

    def _publish(self) -> None:
        self.metrics.seen(*self.table.figures())

    def store(self) -> Any:
        """A TCPStore served by the controller's process, where the ranks' new communicators meet:
        a store hosted by a rank would die with that rank. One per controller; every rebuild and
        dump keys its own generation."""
        if self._tcp_store is None:
            self._tcp_store = _serve_store(self.host)
        return self._tcp_store

    def _end_host(self) -> None:
        """This controller's host rank is to be replaced: flush what was sent, and end the process."""
        self.router.sock.close(linger=1000)
        assert self.local_exit is not None
        self.local_exit(1)

    # ---- who controls ---------------------------------------------------------------------------
    def become_active(self, epoch: int, now: float) -> None:
        """A standby takes over: from now on the active controller, at the newer ``epoch``."""
        self.standby = False
        self.epoch = max(epoch, self.epoch + 1)
        self.machine = Machine(self._on_transition, state=S.NORMAL)
        self.table.heard_all(now)  # start the clocks now for ranks that have not come over yet
        self.table.expect_all(now)
        self.refresh_ack()

    def saw_epoch(self, epoch: int) -> None:
        """A standby learns the epoch of the controller its rank follows now. Taking over, it starts a
        newer one: a standby named by an earlier controller would otherwise reuse the epoch of the one
        that took over since, and the ranks would drop its orders as ones they had already taken."""
        if self.standby and epoch > self.epoch:
            self.epoch = epoch

    def order_takeover(self, args: dict[str, Any]) -> None:
        """A standby: the active controller hands itself over to this one (its host is to be
        migrated); this controller's own thread promotes it at its next tick."""
        self.succession.order_takeover(args)

    def settle(self, rids: Iterable[str]) -> None:
        """A standby learns the reports its controller settled (from its own rank's link)."""
        self.ledger.settled.update(rids)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "state": self.machine.state.value, "epoch": self.epoch, "world_size": self.world,
            "controller": {"rank": self.rank, "pid": os.getpid(), "endpoint": self.endpoint,
                           "standby": self.standby},
            "backups": [{"rank": r, "endpoint": ep} for r, ep in self.standbys.named()],
            "ranks": self.table.status(now),
            "agents": [{"node_rank": a.node_rank, "node": a.node, "ranks": a.ranks, "pids": a.pids}
                       for a in self.table.agents.values()],
            "faults": [{k: v for k, v in f.items() if k not in ("t_detect", "cpu_detect")} for f in self.ledger.all],
            "dropped": dict(self.router.drops.counts),
            **self.scaling.status(),
        }


def run_standalone(log_dir: str, world_size: int, options: HAOptions, host: str | None = None,
                   port: int = 0) -> int:
    """``mindspeed-ha controller``: make the keys if needed, serve until the job is over."""
    keys = security.Keys.load(log_dir, options.key_dir, options.insecure, create=True,
                              job=os.environ.get("MINDSPEED_HA_JOB_ID"))
    store = discovery.JobStore.from_env()
    c = Controller(log_dir, world_size, options, keys, host=host, port=port, job_store=store).start()
    try:
        while not c.done.wait(0.5):
            pass
    except KeyboardInterrupt:
        c.close()
    finally:
        if store is not None:
            store.close()
    if c.ending.exit_code:
        print(c.ending.last_diagnosis or diagnosis(c.ledger.all, len(c.table.live()), c.recovery.note, None, log_dir),
              file=sys.stderr)
    return c.ending.exit_code
