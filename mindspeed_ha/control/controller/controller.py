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

A fault's life: ``fault`` records it and feeds FAULT; PAUSE stops every survivor; DECIDE picks the
strategy (policy/states.py, one table); REPAIR / ROLLBACK / DUMP play that strategy's rounds
(policy/playbooks.py, through rounds.Runner and the narrow ``PlaybookPort``); EXIT tells everyone to
go with the diagnosis. An exception inside a state's work is that state's FAILED outcome, never the end of the
controller.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable

from ... import exitcodes
from ...events import EventLog, get_logger
from ...options import HAOptions
from ..policy import desync, ledger, playbooks
from ..policy.diagnosis import diagnosis
from ..policy.ledger import Fault, FaultLedger
from ..policy.playbooks import Episode, FirstStep
from ..policy.ranks import Agent, Rank, RankTable
from ..policy.recurrence import Recurrences
from ..policy.rounds import Port, RunOutcome, Runner
from ..policy.standbys import Standbys
from ..policy.states import TABLE, TIMEOUTS, Machine, Outcome as O, State as S, choose_strategy
from ..wire import discovery, hosts, protocol, security
from ..wire.router import Router
from .inbox import Inbox
from .migration import Migrations
from .orders import Answer, Orders
from .ports import ControllerPort, Identity
from .restarts import Restarts
from .scaling import Scaling
from .succession import Succession

if TYPE_CHECKING:
    from .metrics import Metrics

log = get_logger("control.controller")
BUILT = {"dump", "retry", "recover", "elastic-training"}


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
        c = self._c
        c.fault(list(ranks), "hang", c.table.newest_iteration(), "recovery", detail=detail,
                key=("hang-in-recovery", tuple(ranks), c.generation))

    def emit(self, event: str, **fields: Any) -> None:
        self._c.events.emit(event, **fields)

    def set_note(self, text: str) -> None:
        self._c.strategy_note = text

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
        return self._c.first_step is not None

    def ack(self) -> bytes:
        return self._c.ack

    def status(self) -> dict[str, Any]:
        return self._c.status()

    def feed(self, outcome: O) -> None:
        self._c.feed(outcome)

    def fault(self, ranks: list[int], kind: str, iteration: int, phase: str, detect_s: float = 0.0,
              detail: str = "", key: Hashable = None, rid: str | None = None, feed: bool = True,
              entered: dict[str, Any] | None = None, fault_class: str = "fault", frame: str = "") -> bool:
        return self._c.fault(ranks, kind, iteration, phase, detect_s, detail, key, rid, feed, entered, fault_class,
                             frame)

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


class Controller:
    def __init__(self, log_dir: str, world_size: int, options: HAOptions | None = None,
                 keys: security.Keys | None = None, host: str | None = None, port: int = 0,
                 rank: int | None = None, standby: bool = False, epoch: int = 1,
                 job_id: str | None = None, local_exit: Callable[[int], None] | None = None,
                 write_json: bool = True, job_store: discovery.JobStore | None = None,
                 previous: int | None = None, settled: Iterable[str] = ()):
        self.log_dir, self.world = log_dir, int(world_size)
        self.options = options or HAOptions(strategies=frozenset({"dump"}), log_dir=log_dir)
        self.job_id = job_id or os.environ.get("MINDSPEED_HA_JOB_ID")
        self.keys = keys if keys is not None else security.Keys.load(log_dir, self.options.key_dir,
                                                                     self.options.insecure, job=self.job_id)
        self.host = host or _host_addr()
        self.rank, self.standby, self.epoch = rank, standby, epoch
        self.previous = previous              # a standby: the rank hosting the controller it backs up
        self.local_exit = local_exit          # how the host rank exits (never through the socket)
        self.write_json = write_json
        self.job_store = job_store            # discovery.JobStore: announcements reach every node there
        self.hb = float(self.options.heartbeat_s)
        dead_after = float(os.environ.get("MINDSPEED_HA_DEAD_AFTER", 0) or 0) or None
        self.table = RankTable(self.world, self.hb, self.options.hang_timeout_s, dead_after,
                               runs_here=lambda info: hosts.runs_here(info.pid, info.host))
        # The reports (rids) a recovery dealt with, by this controller or an earlier one, are settled:
        # a link re-sends what it was not told is settled, and a report is never acted on twice.
        self.ledger = FaultLedger(settled)
        self.standbys = Standbys()
        self.exit_code = 0
        self.strategy_note = ""
        self.repair_failure = ""              # why this episode's retry/recover/resize failed (the dump follows)
        self.last_diagnosis = ""
        self.started_at = time.monotonic()
        self.generation = 0                   # of the rebuild store's key space; one per rebuild or dump
        self.chosen: O | None = None          # the strategy DECIDE picked for the episode
        self.playbook: playbooks.Playbook | None = None
        self.episode: Episode | None = None
        self.runner: Runner | None = None
        self.first_step: FirstStep | None = None
        self._stop_id: int | None = None
        self._tcp_store: Any = None
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread: threading.Thread | None = None
        self.events = EventLog(log_dir, "controller")
        self.metrics: Metrics | None = None
        self.machine = Machine(self._on_transition)
        self.router = Router(self.keys, self.host, port)
        self.port_number, self.endpoint = self.router.port, self.router.endpoint
        self.orders = Orders(self.router, self.table, lambda: self.epoch, rank)
        self.restarts = Restarts(self.table, self.orders, self.events, self.options.max_restarts, rank,
                                 self._end_host if local_exit is not None else None)
        self.recurrences = Recurrences(self.options.max_recurrences)  # each fault's recoveries so far
        self.identity = Identity(host=self.host, endpoint=self.endpoint, port=self.port_number, keys=self.keys,
                                 job_id=self.job_id, log_dir=log_dir, world=self.world, rank=rank)
        self.playbook_port: Port = PlaybookPort(self)  # what the playbooks see of this controller
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
        self.actions: dict[S, Callable[[], O | None]] = {
            S.NORMAL: self._training, S.PAUSE: self._stop_survivors, S.DECIDE: self._decide, S.REPAIR: self._play,
            S.ROLLBACK: self._play, S.DUMP: self._play, S.DOWNGRADE: self._play, S.UPGRADE: self._play,
            S.EXIT: self._tell_exit}
        self._last_scan = 0.0
        self.ack = b""                        # the answer to a heartbeat: epoch, state, standbys
        self.refresh_ack()

    @property
    def ranks(self) -> dict[int, Rank]:
        return self.table.ranks

    @property
    def agents(self) -> dict[int, Agent]:
        return self.table.agents

    # ---- life ---------------------------------------------------------------------------------
    def start(self) -> "Controller":
        if not self.standby:
            self.succession.announce()
            self.serve_metrics()
        self._thread = threading.Thread(target=self._run, name="mindspeed-ha-controller", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.machine.state != S.DONE:
                for ident, msg in self.router.receive(10):
                    self._dispatch(ident, msg)
                self._tick()
        finally:
            self.done.set()
            self.router.close()

    def _dispatch(self, ident: bytes, msg: dict[str, Any]) -> None:
        try:
            self.handlers.get(msg["t"], self._unexpected)(ident, msg)
        except (KeyError, ValueError, TypeError, IndexError) as e:  # semantically bad, e.g. rank out of range
            self.router.drops.drop("invalid", f"{msg.get('t')}: {e}")
        except Exception:  # a bug in one handler must not take the controller down with it
            log.exception("error handling %s", msg.get("t"))

    def _unexpected(self, ident: bytes, msg: dict[str, Any]) -> None:
        self.router.drops.drop("unexpected", msg["t"])

    def _tick(self) -> None:
        now = time.monotonic()
        try:
            if self.standby:
                self.succession.maybe_promote(now)
                return
            # Succession has something to say after a hand-over (a rank to migrate), and where a job
            # store can move or announce a newer controller; not otherwise.
            if self.succession.after is not None:
                self.succession.migrate_when_ready(now)
            if self.job_store is not None:
                if self.succession.superseded():
                    return
                self.succession.keep_store(now)
            if now - self._last_scan >= self.hb / 10:
                self._last_scan = now
                self._scan(now)
            self._progress(now)
        except Exception as e:
            log.exception("controller: the work of state %s failed", self.machine.state.value)
            self._failed(e)

    # ---- output -------------------------------------------------------------------------------
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
        return [i.ident for i in self.ranks.values() if i.alive] + [a.ident for a in self.agents.values()]

    def serve_metrics(self) -> None:
        """--ha-metrics-port: the active controller (a standby from its takeover) serves /metrics."""
        port = self.options.metrics_port
        if not port or self.metrics is not None:
            return
        from .metrics import Metrics
        try:
            self.metrics = Metrics(self.host, port, self.world)
        except OSError as e:  # metrics are for people: a taken port must not take the job down
            log.error("--ha-metrics-port %d on %s: cannot serve metrics (%s)", port, self.host, e)
            self.events.emit("metrics_failed", port=port, host=self.host, error=str(e))
            return
        self.metrics.set_state(self.machine.state.value)
        self.events.listeners.append(self.metrics.on_event)

    def store(self) -> Any:
        """A TCPStore served by the controller's process, where the ranks' new communicators meet:
        a store hosted by a rank would die with that rank. One per controller; every rebuild and
        dump keys its own generation. (torch is needed here only, when the first recovery needs it.)"""
        if self._tcp_store is None:
            try:
                import torch.distributed  # noqa: F401
            except ImportError:
                raise RuntimeError("this controller runs without torch, so it cannot serve the store that "
                                   "rebuilt process groups meet at; run it where torch is installed") from None
            from mindspeed_ha.comm.stores import serve
            self._tcp_store = serve(self.host)
        return self._tcp_store

    def _end_host(self) -> None:
        """This controller's host rank is to be replaced: flush what was sent, and end the process."""
        self.router.sock.close(linger=1000)
        assert self.local_exit is not None
        self.local_exit(1)

    # ---- detection ----------------------------------------------------------------------------
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

    def _settle_episode(self) -> None:
        """The recovery is done (training resumed): its reports are settled, here and at every rank
        and agent, whose links then stop re-sending them, and at the standbys' ranks."""
        rids = self.ledger.settle_active()
        if rids:
            self.router.fan_out(self._everyone(), protocol.encode("settled", rids=rids))

    def fault(self, ranks: list[int], kind: str, iteration: int, phase: str, detect_s: float = 0.0,
              detail: str = "", key: Hashable = None, rid: str | None = None, feed: bool = True,
              entered: dict[str, Any] | None = None, fault_class: str = "fault", frame: str = "") -> bool:
        """A fault, however it was found: recorded once, and fed to the state machine (``feed``: at
        once; else the caller feeds it, with others found together). True: recorded as a new fault.
        ``entered``: a reporting rank's counts of the collectives it issued (the survivors' stop);
        ``fault_class`` and ``frame``: a rank's own report says them (``faults.fault_class``)."""
        if not self.ledger.first_time(key or (kind, tuple(ranks), iteration)):
            return False
        if rid is not None and rid in self.ledger.settled:
            self.router.drops.drop("settled", f"rank(s) {list(ranks)} {kind} at iteration {iteration} ({rid})")
            self.events.emit("settled_fault", ranks=list(ranks), kind=kind, iteration=iteration, rid=rid)
            log.info("rank(s) %s: %s at iteration %s was re-sent (report %s), but a recovery already dealt with "
                     "it: ignored", list(ranks), kind, iteration, rid)
            return False
        f = ledger.record(ranks, kind, iteration, phase, [self.ranks[r].node if r in self.ranks else "?" for r in ranks],
                          detect_s=detect_s, detail=detail, rid=rid, entered=entered, fault_class=fault_class,
                          frame=frame)
        if self.standby:
            self.ledger.deferred.append(f)
            return False
        if self.machine.state == S.INIT:  # the job was not whole yet: who never registered must be found too
            self.table.expect_all(time.monotonic())
        if self.machine.state == S.NORMAL and self.first_step is not None:
            # Close the last recovery first. A fault past the awaited step proves that step done on
            # every rank (its collectives needed them all), even if a rank's report of it has not
            # come; a fault inside it interrupted a job that was training again.
            done = max(iteration, self.table.newest_iteration()) > self.first_step.target
            self.first_step.close_by_fault(time.monotonic(), detect_s, done)
            self.first_step = None
        if kind in ("process-exit", "heartbeat-lost", "controller-lost", "node-lost"):
            self.table.mark_dead(ranks)
            self.restarts.lost(ranks, iteration, kind)
            self.orders.excuse(ranks)  # a dead rank owes no answers (nor its successor)
            self._publish()  # a scrape during the recovery that follows counts them out already
        self._record(f)
        log.error("fault: rank(s) %s %s at iteration %s, phase %s (%s), detected in %.3fs",
                  ranks, kind, iteration, phase, detail or "-", detect_s)
        if feed and self.machine.state != S.DONE:
            self.feed(O.FAULT)
        return True

    def _record(self, f: Fault) -> None:
        self.ledger.add(f)
        self.events.emit("fault", **ledger.public(f))

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.seen(len(self.table.live()), self.table.newest_iteration(),
                              max([i.checkpoint for i in self.ranks.values()] or [-1]))

    def _scan(self, now: float) -> None:
        self._publish()
        if self.machine.state in (S.INIT, S.EXIT, S.DONE):
            return
        # What one scan finds (every rank silent past the loss limit, a hang) is fed to the state
        # machine once: the survivors are stopped once, not once per lost rank — at 16,384 ranks a
        # stop to every survivor for each of a thousand silent ranks kept the controller from reading
        # the heartbeats of the others, and they went "silent" too.
        found = [d for d in self.table.scan(now, training=self.machine.state == S.NORMAL)
                 if self.fault(d.ranks, d.kind, d.iteration, d.phase, detect_s=d.detect_s, detail=d.detail,
                               key=d.key, feed=False)]
        desynced = not found and self.machine.state == S.NORMAL and self.options.desync_after_s > 0 and self._desync()
        if found or desynced:  # (fault() fed nothing: the state is as it was)
            self.feed(O.FAULT)

    def _desync(self) -> bool:
        """Every live rank has waited in its collectives past --ha-desync-after and their counts say some
        group's members cannot match (policy/desync.py): a hang of the ranks out of step, named now
        rather than at the hang timeout. True: recorded as a fault (fed by the caller)."""
        live = {r for r in self.table.live() if not self.ranks[r].done}
        found = desync.find({r: i.desync for r, i in self.ranks.items() if r in live and i.desync}, live)
        if found is None:
            return False
        first = self.ranks[found.out_of_step[0]]
        waited = min(float(self.ranks[r].desync.get("waited_s", 0) or 0) for r in live)  # type: ignore[union-attr]
        if not self.fault(found.out_of_step, "hang", first.it, first.phase, detect_s=waited, detail=found.text(),
                          key=("desync", tuple(found.out_of_step), first.it), feed=False):
            return False
        self.events.emit("desync", group=found.group, out_of_step=found.out_of_step, iteration=first.it,
                         collectives={str(r): list(c) for r, c in found.collectives.items()}, waited_s=waited)
        log.error("%s (every rank waited past %.1f s)", found.text(), waited)
        return True

    # ---- state machine ------------------------------------------------------------------------
    def _on_transition(self, old: S, outcome: O, new: S, seconds: float) -> None:
        self.events.emit("state", **{"from": old.value, "to": new.value, "outcome": outcome.value,
                                     "seconds": round(seconds, 4)})
        log.info("state %s -(%s)-> %s after %.3fs", old.value, outcome.value, new.value, seconds)
        self.refresh_ack()

    def feed(self, outcome: O) -> None:
        """The state machine's next outcome; the new state's work runs at once."""
        before = self.machine.state
        new = self.machine.feed(outcome)
        # A new fault while stopping widens the stop to the new set of survivors.
        if new == before and not (new == S.PAUSE and outcome == O.FAULT):
            return
        action = self.actions.get(new)
        if action is None:
            return
        try:
            result = action()
        except Exception:
            log.exception("controller: the action of state %s failed", new.value)
            result = O.FAILED if (new, O.FAILED) in TABLE else None
        if result is not None:
            self.feed(result)

    def _failed(self, error: Exception) -> None:
        """The work of the current state raised: its FAILED outcome, where the table has one."""
        st = self.machine.state
        if st in (S.REPAIR, S.ROLLBACK, S.DOWNGRADE, S.UPGRADE):
            self.repair_failure = self.strategy_note = (f"{self._strategy_of(st)} failed "
                                                        f"(its {st.value} raised {type(error).__name__}: {error})")
        if (st, O.FAILED) in TABLE:
            self.feed(O.FAILED)

    def _progress(self, now: float) -> None:
        """Conditions a state waits on, and per-state timeouts."""
        st = self.machine.state
        if st == S.NORMAL and self.first_step is not None:  # first: the last step may also end the job
            if self.first_step.check(now, self.table.completed(self.first_step.target, self._newcomers())):
                self.first_step = None
        if st == S.NORMAL and self.scaling.offered and self.scaling.ended_without():
            return
        if st in (S.NORMAL, S.INIT) and self.ranks and self.table.all_over() and not self.ledger.active:
            self.feed(O.FINISHED)
            return
        if st == S.NORMAL and self.scaling.offered:
            self.scaling.scale_out_when_ready()
        if st in (S.PAUSE, S.REPAIR) and self.ledger.of_kind("migrate") and self.migrations.outrun():
            # The job ended its last step as the migration began: nobody parks, there is nothing to move.
            if self.table.all_over():
                self.migrations.abandon()
                self.feed(O.FINISHED)
            return
        if st == S.PAUSE and self._stopped(now):
            self.feed(O.STOPPED)
            return
        if st in (S.REPAIR, S.ROLLBACK, S.DUMP, S.DOWNGRADE, S.UPGRADE) and self.runner is not None:
            runner = self.runner
            out = runner.tick()
            if self.machine.state != st or self.runner is not runner:
                return  # a fault came meanwhile: the table moved on, this round's outcome is moot
            if out is not None:
                self.feed(self._outcome(out))
                return
        if st == S.EXIT:
            others = [r for r in self.table.live() if r != self.rank]
            if not others or now - self.machine.entered > TIMEOUTS[S.EXIT] - 1:
                self._finish_exit()
                return
        if st == S.INIT and now - self.started_at > self.options.register_timeout_s:
            self._not_registered()
            return
        limit = self._limit(st, now)
        if st != S.INIT and self.machine.overdue(limit):
            log.error("state %s ran past its %.1fs time limit", st.value, limit)
            self.feed(O.TIMEOUT)

    def _newcomers(self) -> set[int]:
        """Registered newcomers waiting to scale out: they train nothing yet (none unless scaling
        offered some ranks a place)."""
        return self.scaling.newcomers() if self.scaling.offered else set()

    def _not_registered(self) -> None:
        """INIT past --ha-register-timeout: the job cannot start whole; name who is missing."""
        missing = [r for r in range(self.world) if r not in self.ranks]
        nodes = sorted({a.node for a in self.agents.values() if set(a.ranks) & set(missing)})
        orphans = [r for r in missing if self.table.agent_of(r) is None]
        where = (f"; node(s) {', '.join(nodes)} run their agents, so those workers hang or fail in their set-up"
                 if nodes else "") + (f"; no agent registered for rank(s) {orphans}" if orphans and self.agents else "")
        detail = (f"rank(s) {missing} did not register within --ha-register-timeout "
                  f"{self.options.register_timeout_s:g} s{where}")
        self.strategy_note = "none: the job never started whole"
        self._record(ledger.record(missing, "not-registered", -1, "startup", nodes or ["?"], detail=detail))
        log.error("%s", detail)
        self.feed(O.TIMEOUT)

    def _limit(self, st: S, now: float) -> float | None:
        """A state's time limit. The dump's is --ha-dump-timeout, or grows with the state to write
        (50 MB/s at least), and while its writers show progress it is extended, up to three times."""
        base = TIMEOUTS.get(st)
        if st == S.PAUSE:  # a silent rank (its node gone with its agent) must be declared lost first
            return max(TIMEOUTS[S.PAUSE], self.table.dead_after + 2.0)
        if st != S.DUMP or self.episode is None:
            return base
        if any(f["kind"] == "preempted" for f in self.episode.faults):
            return self.options.term_grace_s  # the scheduler kills the job after its grace: no extension
        base = self.options.dump_timeout_s or max(TIMEOUTS[S.DUMP], 30.0 + self.episode.state_bytes / 50e6)
        writers = [self.ranks[r] for r in self.episode.statuses if r in self.ranks and self.ranks[r].alive]
        moving = writers and now - max(i.progress_at for i in writers) < 30.0
        return 3 * base if moving else base

    def _stopped(self, now: float) -> bool:
        """PAUSE is over the moment every rank is accounted for: each live rank answered the stop
        (so it was alive after the fault), and a rank that cannot answer left the live set — its
        agent reported its exit (about 20 ms) or its silence reached the loss limit. The strategy
        then sees the real cause: a killed rank's exit report, not only its peers' broken links."""
        return not (self.orders.waiting(self._stop_id) & self.table.live())

    def _outcome(self, out: RunOutcome) -> O:
        if out == "ok":
            return O.OK
        if out[0] == "switch":  # recover waited out the spare wait: the same episode scales in
            self.scaling.switched(out[2])
            self.strategy_note = out[2]
            self.playbook, self.chosen = playbooks.ELASTIC, O.ELASTIC
            return O.ELASTIC
        assert self.playbook is not None and self.episode is not None
        failure = playbooks.failed(self.playbook, self.episode, out[1])
        if self.playbook is not playbooks.DUMP:
            self.repair_failure = self.strategy_note = failure
        else:  # (after a failed recovery the diagnosis names both: the first is what ended the job)
            self.strategy_note = f"{self.repair_failure}; then the dump: {failure}" if self.repair_failure else failure
        return O.FAILED

    # ---- what each state does on entry ----------------------------------------------------------
    def _training(self) -> O | None:
        now = time.monotonic()
        self.table.heard_all(now)  # detection clocks start with training, not at registration
        came_from = self.machine.history[-1][0] if self.machine.history else None
        if came_from == S.ROLLBACK and self.episode is not None:  # a recovery ended: its first step closes it
            self._settle_episode()
            self.first_step = FirstStep(self.episode, self.ledger.close_active(), now)
            self.table.moved(now)
        if self.standbys.due(self.ranks):  # (after a recovery that cost a standby its process)
            self.succession.name_standbys()
        return None

    def _stop_survivors(self) -> O | None:
        """Stop every survivor; decision latency is fault detection -> last stop sent."""
        fault = self.ledger.active[-1] if self.ledger.active else None
        # every live rank, reporters of comm failures included; not a newcomer waiting to scale out
        survivors = sorted(self.table.live() - self._newcomers())
        reason = (f"{fault['kind']} on rank(s) {fault['ranks'][:8]}" if fault else "controller")[:200]
        # Nothing broke for a migration or a scale-out: the ranks park between two steps, no step
        # is interrupted.
        planned = self.ledger.of_kind("migrate", "scale-out")
        # The reporters' counts of the collectives they issued: what they never entered, the survivors
        # leave without waiting for it.
        entered = {str(r): f["entered"] for f in self.ledger.active if f.get("entered") for r in f["ranks"]}
        self._stop_id = self.orders.send("stop", survivors, {"reason": reason, **({"boundary": True} if planned else {}),
                                                             **({"entered": entered} if entered else {})})
        if fault is not None:
            decide_ms = (time.monotonic() - fault["t_detect"]) * 1e3
            cpu_ms = (time.thread_time() - fault["cpu_detect"]) * 1e3  # wall minus waiting for a CPU
            self.events.emit("decision", action="stop", ranks=len(survivors), decide_ms=round(decide_ms, 3),
                             cpu_ms=round(cpu_ms, 3))
        return None

    def _decide(self) -> O | None:
        self.repair_failure = ""
        kinds = {f["kind"] for f in self.ledger.active}
        if kinds == {"scale-out"}:
            self.strategy_note = "scale-out onto returned rank(s)"
            self.events.emit("strategy", outcome=O.SCALE_OUT.value, reason=self.strategy_note)
            self.playbook, self.chosen = playbooks.SCALE_OUT, O.SCALE_OUT
            return O.SCALE_OUT
        if "scale-out" in kinds:  # a fault came first: its recovery; the newcomers are asked again after it
            self.ledger.close_planned("scale-out")
            kinds.discard("scale-out")
        ordered = self.options.ordered_strategies()
        recurs = self.recurrences.refusal(self.ledger.active)
        if recurs:  # not the machine's: no recovery, only the dump (none before a first step: nothing to save)
            ordered = [s for s in ordered if s == "dump" and not self.recurrences.setup]
            why = f"no recovery: {recurs}" + ("" if ordered else "; the job ends at once")
            self.strategy_note = why
            outcome = O.DUMP if ordered else O.NO_STRATEGY
            self.events.emit("strategy", outcome=outcome.value, reason=why)
            log.error("strategy for %s: %s (%s)", sorted(kinds), outcome.value, why)
            self.playbook, self.chosen = None, outcome
            return outcome
        refusal = self.restarts.refusal() if "recover" in ordered else None
        if refusal:
            ordered = [s for s in ordered if s != "recover"]
            self.restarts.budget.spent = f"recover not tried: {refusal}"
        if "elastic-training" in ordered:
            ordered, why_not = self.scaling.order(ordered)
            refusal = "; ".join(x for x in (refusal, why_not) if x) or None
        outcome, why = choose_strategy(ordered, kinds, BUILT)
        if refusal:
            why = f"recover not tried: {refusal}; {why}"
        if self.scaling.spare_wait and outcome == O.RECOVER:
            why += self.scaling.waiting_note()
        self.strategy_note = why
        self.events.emit("strategy", outcome=outcome.value, reason=why)
        log.info("strategy for %s: %s (%s)", sorted(kinds), outcome.value, why)
        self.playbook = {O.RETRY: playbooks.RETRY, O.RECOVER: playbooks.RECOVER,
                         O.ELASTIC: playbooks.ELASTIC}.get(outcome)
        self.chosen = outcome
        return outcome

    def _play(self) -> O | None:
        """REPAIR, ROLLBACK, DUMP: the playbook's rounds for this state (a new episode on REPAIR and
        DUMP; ROLLBACK goes on with REPAIR's)."""
        st = self.machine.state
        if st in (S.REPAIR, S.DUMP, S.DOWNGRADE, S.UPGRADE):
            if st == S.DUMP:
                self.playbook = playbooks.DUMP
            strategy = self._strategy_of(st)
            first = self.ledger.active[0] if self.ledger.active else None
            replica = all(i.groups for i in self.ranks.values() if i.alive)  # (no replicas: groups are not sent)
            self.episode = Episode(self.playbook_port, strategy, self.world, self.ledger.active,
                                   {r: i.groups[0] for r, i in self.ranks.items() if i.groups}, replica=replica,
                                   spare_wait=self.scaling.spare_wait if strategy == "recover" else None,
                                   left=frozenset(self.scaling.left))
            if first is not None and st in (S.REPAIR, S.DOWNGRADE, S.UPGRADE):
                self.episode.phases["detect"] = first["detect_s"]
                # detection -> every survivor stopped and the strategy chosen
                self.episode.phases["stop"] = round(time.monotonic() - first["t_detect"], 4)
        assert self.playbook is not None and self.episode is not None  # (DECIDE chose one; REPAIR made it)
        if st == S.ROLLBACK:  # the state is mended: each of the episode's faults was recovered once more
            self.recurrences.count(self.ledger.active)
        self.runner = Runner(self.playbook.rounds(st), self.episode)
        out = self.runner.start()
        return None if out is None else self._outcome(out)

    def _strategy_of(self, st: S) -> str:
        """The strategy whose playbook state ``st`` plays (ROLLBACK goes on with the episode before it)."""
        if st == S.ROLLBACK and self.episode is not None:
            return self.episode.strategy
        if st == S.REPAIR:
            return "recover" if self.chosen == O.RECOVER else "retry"
        return {S.DOWNGRADE: "elastic-training", S.UPGRADE: "scale-out"}.get(st, "dump")

    def _tell_exit(self) -> O | None:
        faults = self.ledger.active or self.ledger.all
        kinds = {f["kind"] for f in faults}
        self.exit_code = (exitcodes.PREEMPTED if "preempted" in kinds else
                          exitcodes.NOT_REGISTERED if "not-registered" in kinds else
                          exitcodes.DO_NOT_RESTART if self.restarts.budget.spent or self.recurrences.why else
                          exitcodes.FAULT if self.ledger.all else exitcodes.OK)
        dump = self.episode.result if self.episode is not None and self.playbook is playbooks.DUMP else None
        note = self.strategy_note
        for why in (self.restarts.budget.spent, self.recurrences.why and f"no recovery: {self.recurrences.why}"):
            if why and why not in note:
                note = f"{why}; {note}"
        text = self.last_diagnosis = diagnosis(faults, len(self.table.live()), note, dump, self.log_dir,
                                               self.exit_code)
        self.events.emit("diagnosis", text=text, exit_code=self.exit_code)
        log.error(text)
        args = {"code": self.exit_code, "diagnosis": text}
        self.orders.send("exit", sorted(self.table.live()), args)
        self.orders.to_agents("exit", args)
        return None

    def _finish_exit(self) -> None:
        self.feed(O.OK)  # EXIT -> DONE
        if self.local_exit is not None and self.rank is not None and self.rank in self.table.live():
            try:
                self.router.sock.close(linger=1000)  # flush what we sent before the process goes
            finally:
                self.local_exit(self.exit_code)

    def retire(self) -> None:
        """Handed over to a standby: stop controlling (the router flushes what was sent as it closes)."""
        self._stop.set()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    # ---- status -------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "state": self.machine.state.value, "epoch": self.epoch, "world_size": self.world,
            "controller": {"rank": self.rank, "pid": os.getpid(), "endpoint": self.endpoint,
                           "standby": self.standby},
            "backups": [{"rank": r, "endpoint": ep} for r, ep in self.standbys.named()],
            "ranks": self.table.status(now),
            "agents": [{"node_rank": a.node_rank, "node": a.node, "ranks": a.ranks, "pids": a.pids}
                       for a in self.agents.values()],
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
    if c.exit_code:
        print(c.last_diagnosis or diagnosis(c.ledger.all, len(c.table.live()), c.strategy_note, None, log_dir),
              file=sys.stderr)
    return c.exit_code
