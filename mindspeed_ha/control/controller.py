"""The controller: sees every rank, detects faults, runs the recovery state machine.

A thread on rank 0 by default (``Controller(...).start()``), a standalone process with
``mindspeed-ha controller``, or a standby (``standby=True``) on a backup rank that promotes itself
when it holds a quorum (election.py). Everything runs on the one controller thread: no locks on the
rank table, and a decision is never late because a lock was held.

A fault's life: ``_fault`` records it and feeds FAULT; PAUSE stops every survivor; DECIDE picks the
strategy (states.py, one table); REPAIR / ROLLBACK / DUMP play that strategy's rounds
(playbooks.py, through rounds.Runner and the narrow ``_Port``); EXIT tells everyone to go with the
diagnosis. An exception inside a state's work is that state's FAILED outcome, never the end of the
controller.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time

from .. import exitcodes
from ..events import EventLog, get_logger
from ..options import HAOptions
from . import discovery, election, playbooks, protocol as P, security
from .budget import RestartBudget
from .diagnosis import diagnosis
from .elastic import Elastic
from .inbox import Inbox
from .migration import Migrations
from .playbooks import Episode, FirstStep
from .ranks import Agent, Rank, RankTable
from .router import Router
from .rounds import Runner
from .states import TABLE, TIMEOUTS, Machine, Outcome as O, State as S, choose_strategy
from .succession import Succession

log = get_logger("control.controller")
BUILT = {"dump", "retry", "recover", "elastic-training"}


def _host_addr() -> str:
    return os.environ.get("MINDSPEED_HA_NODE_HOST") or os.environ.get("MASTER_ADDR") or "127.0.0.1"


class _Port:
    """What a playbook may ask of the controller (rounds.Port): orders, answers, who is live, the
    launcher agents, the rebuild store, events — nothing else of its state."""

    def __init__(self, c: "Controller"):
        self._c = c

    def order(self, action, ranks, args):
        return self._c.order(action, ranks, args)

    def answers(self, order_id):
        pend = self._c.pending.get(order_id)
        return dict(pend["results"]) if pend else self._c.answered.get(order_id, {})

    def live(self):
        return self._c.table.live()

    def lost(self):
        return self._c.table.lost()

    def restart(self, ranks):
        return self._c.restart_ranks(ranks)

    def restarting(self):
        return set(self._c.restarting)

    def store(self):
        return self._c.host, self._c.store().port

    def new_generation(self):
        self._c.generation += 1
        return self._c.generation

    def emit(self, event, **fields):
        self._c.events.emit(event, **fields)

    def set_note(self, text):
        self._c.strategy_note = text

    def closed(self, faults, now, moved_bytes, phases):
        self._c.migrations.closed(faults, now, moved_bytes, phases)

    def hung(self, ranks, detail):
        c = self._c
        c._fault(list(ranks), "hang", c.table.newest_iteration(), "recovery", detail=detail,
                 key=("hang-in-recovery", tuple(ranks), c.generation))

    def scaled(self, dp, replica_groups):
        self._c.elastic.scaled(dp, replica_groups)

    def host_rank(self):
        return self._c.rank

    def leave(self, ranks, reason):
        self._c.elastic.leave(ranks, reason)

    def condemn(self, ranks):
        """recover: hung ranks are replaced like dead ones (their agent kills and restarts them)."""
        self._c.table.mark_dead(ranks)
        for pend in self._c.pending.values():
            pend["waiting"].difference_update(ranks)


class Controller:
    def __init__(self, log_dir: str, world_size: int, options: HAOptions | None = None,
                 keys: security.Keys | None = None, host: str | None = None, port: int = 0,
                 rank: int | None = None, standby: bool = False, epoch: int = 1,
                 job_id: str | None = None, local_exit=None, write_json: bool = True, job_store=None,
                 previous: int | None = None, settled=()):
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
        self.table = RankTable(self.world, self.hb, self.options.hang_timeout_s, dead_after)
        self.faults: list[dict] = []          # every fault, for status and the diagnosis
        self.active_faults: list[dict] = []   # faults of the episode being handled
        self._fault_keys: set = set()
        # The reports (rids) whose fault a recovery dealt with, by this controller or an earlier one: a
        # link re-sends what it was not told is settled, and a report is never acted on twice.
        self.settled: set[str] = set(settled)
        self._deferred: list[dict] = []       # faults reported to a standby, handled on promotion
        self.standbys = election.Standbys()
        self.exit_code = 0
        self.strategy_note = ""
        self.last_diagnosis = ""
        self.restarting: set[int] = set()     # ranks restarted by their agent, not registered again yet
        self.budget = RestartBudget(self.options.max_restarts)
        self.died_in: dict[int, int] = {}     # rank -> the iteration its process was lost in
        self.started_at = time.monotonic()
        self.generation = 0                   # of the rebuild store's key space; one per rebuild or dump
        self.pending: dict[int, dict] = {}    # order id -> {action, ranks waiting, results, cli ident, frame}
        self.answered: dict[int, dict] = {}   # order id -> results, once no one is waiting any more
        self._next_id = 1
        self.chosen: O | None = None          # the strategy DECIDE picked for the episode
        self.playbook = None
        self.episode: Episode | None = None
        self.runner: Runner | None = None
        self.first_step: FirstStep | None = None
        self.dump_result: dict | None = None
        self._stop_id = None
        self._tcp_store = None
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread: threading.Thread | None = None
        self.events = EventLog(log_dir, "controller")
        self.metrics = None
        self.machine = Machine(self._on_transition)
        self.playbook_port = _Port(self)  # what the playbooks see of this controller
        self.router = Router(self.keys, self.host, port)
        self.port_number, self.endpoint = self.router.port, self.router.endpoint
        self.handlers = Inbox(self).handlers()
        self.migrations = Migrations(self)
        self.elastic = Elastic(self)           # when to scale in, wait for a node, or grow onto one
        self.succession = Succession(self)    # standbys, takeovers, a handover before the host migrates
        self.actions = {S.NORMAL: self._training, S.PAUSE: self._stop_survivors, S.DECIDE: self._decide,
                        S.REPAIR: self._play, S.ROLLBACK: self._play, S.DUMP: self._play, S.DOWNGRADE: self._play,
                        S.UPGRADE: self._play, S.EXIT: self._tell_exit}
        self._last_scan = 0.0
        self._refresh_ack()

    @property
    def ranks(self) -> dict[int, Rank]:
        return self.table.ranks

    @property
    def agents(self) -> dict[int, Agent]:
        return self.table.agents

    # ---- life ---------------------------------------------------------------------------------
    def start(self) -> "Controller":
        if not self.standby:
            self._announce()
            self._serve_metrics()
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

    def _serve_metrics(self) -> None:
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

    def _announce(self, quiet: bool = False) -> None:
        info = {"host": self.host, "port": self.port_number, "endpoint": self.endpoint,
                "server_public_key": self.keys.server_public_text(), "secure": self.keys.secure,
                "epoch": self.epoch, "rank": self.rank, "pid": os.getpid(), "job_id": self.job_id,
                "world_size": self.world, "hostname": socket.gethostname(), "started": time.time(),
                "backups": self.standbys.endpoints()}
        if self.write_json:
            election.write_controller_json(self.log_dir, info)
        if self.job_store is not None:  # where nodes without this log dir find us
            self.job_store.publish(discovery.CONTROLLER_KEY, info, epoch=self.epoch)
        if not quiet:
            log.info("controller (epoch %d) listening on %s, world %d, %s", self.epoch, self.endpoint,
                     self.world, "CurveZMQ" if self.keys.secure else "INSECURE")

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.machine.state != S.DONE:
                for ident, msg in self.router.receive(10):
                    self._dispatch(ident, msg)
                self._tick()
        finally:
            self.done.set()
            self.router.close()

    def _dispatch(self, ident: bytes, msg: dict) -> None:
        try:
            self.handlers.get(msg["t"], self._unexpected)(ident, msg)
        except (KeyError, ValueError, TypeError, IndexError) as e:  # semantically bad, e.g. rank out of range
            self.router.drops.drop("invalid", f"{msg.get('t')}: {e}")
        except Exception:  # a bug in one handler must not take the controller down with it
            log.exception("error handling %s", msg.get("t"))

    def _unexpected(self, ident, msg) -> None:
        self.router.drops.drop("unexpected", msg["t"])

    def _tick(self) -> None:
        now = time.monotonic()
        try:
            if self.standby:
                self.succession.maybe_promote(now)
                return
            self.succession.migrate_when_ready(now)
            if now - self._last_scan >= self.hb / 10:
                self._last_scan = now
                self._scan(now)
            self._progress(now)
        except Exception:
            log.exception("controller: the work of state %s failed", self.machine.state.value)
            self._failed()

    # ---- output -------------------------------------------------------------------------------
    def _refresh_ack(self) -> None:
        self._ack = P.encode("ack", epoch=self.epoch, state=self.machine.state.value, standby=self.standby,
                             backups=self.standbys.endpoints())

    def push_backups(self) -> None:
        """Every live rank and agent learns the standbys now, not in its next heartbeat's answer: a
        controller lost right after naming them leaves nobody that does not know where to go."""
        self._refresh_ack()
        idents = [i.ident for i in self.ranks.values() if i.alive] + [a.ident for a in self.agents.values()]
        self.router.fan_out(idents, self._ack)

    def order(self, action: str, ranks, args=None, cli=None) -> int:
        """Send ``action`` to the live ones of ``ranks``; their answers collect under the returned id.
        The host rank's ``exit`` is left out: it exits last, locally."""
        oid = self._next_id
        self._next_id += 1
        data = P.encode("do", action=action, id=oid, args=args or {}, epoch=self.epoch)
        skip = self.rank if action == "exit" else None
        targets = [self.ranks[r] for r in ranks if r in self.ranks and self.ranks[r].alive and r != skip]
        self.router.fan_out((i.ident for i in targets), data)
        self.pending[oid] = {"action": action, "waiting": {i.rank for i in targets}, "results": {}, "cli": cli,
                             "sent": time.monotonic(), "data": data}
        if not targets:
            self.answered[oid] = self.pending.pop(oid)["results"]
        return oid

    def store(self):
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

    def _resend_pending(self, r: int) -> None:
        """A rank came back on a new connection: orders sent to the old one may be lost (it
        de-duplicates by id what it did receive)."""
        for pend in list(self.pending.values()):
            if r in pend["waiting"] and pend.get("data"):
                self.router.send(self.ranks[r].ident, pend["data"])

    def restart_ranks(self, ranks) -> tuple[list, list, list]:
        """recover: the agents restart these ranks' workers. Returns (restarted by an agent, awaiting
        a replacement node, without any agent — nothing restarted then)."""
        ranks = sorted(ranks)
        orphans = sorted(set(ranks) - {r for a in self.agents.values() for r in a.ranks})
        if orphans:
            return [], [], orphans
        if self.rank in ranks and self.local_exit is not None:
            # This controller's own host must go (hung): it cannot drive its own replacement. It ends
            # the process instead; its agent reports the exit, and a standby takes over the recovery.
            self.events.emit("host_ends", rank=self.rank, reason="the controller's host rank is to be replaced")
            log.error("rank %d hosts this controller and must be replaced: ending it, a standby takes over",
                      self.rank)
            self.router.sock.close(linger=1000)
            self.local_exit(1)
        # A node lost with its agent: its replacement (mindspeed-ha run with the same --node-rank)
        # starts its workers as joiners by itself.
        live_agents = self.table.live_agents(time.monotonic())
        by_agent = sorted(r for a in live_agents for r in a.ranks if r in ranks)
        awaiting = sorted(set(ranks) - set(by_agent))
        self.restarting = set(ranks)
        self.budget.count({r: self.died_in.get(r, -1) for r in ranks},
                          [a.node_rank for a in self.agents.values() if set(a.ranks) & set(awaiting)])
        if by_agent:
            self._to_agents("restart", {"ranks": by_agent})
        return by_agent, awaiting, []

    def _to_agents(self, action: str, args: dict) -> None:
        data = P.encode("do", action=action, id=0, args=args, epoch=self.epoch)
        self.router.fan_out((a.ident for a in self.agents.values()), data)

    # ---- detection ----------------------------------------------------------------------------
    def saw_epoch(self, epoch: int) -> None:
        """A standby learns the epoch of the controller its rank follows now. Taking over, it starts a
        newer one: a standby named by an earlier controller would otherwise reuse the epoch of the one
        that took over since, and the ranks would drop its orders as ones they had already taken."""
        if self.standby and epoch > self.epoch:
            self.epoch = epoch

    def settle(self, rids) -> None:
        """A standby learns the reports its controller settled (from its own rank's link)."""
        self.settled.update(rids)

    def _settle_episode(self) -> None:
        """The recovery is done (training resumed): its reports are settled, here and at every rank
        and agent, whose links then stop re-sending them, and at the standbys' ranks."""
        rids = [f["rid"] for f in self.active_faults if f.get("rid")]
        if not rids:
            return
        self.settled.update(rids)
        idents = [i.ident for i in self.ranks.values() if i.alive] + [a.ident for a in self.agents.values()]
        self.router.fan_out(idents, P.encode("settled", rids=rids))

    def _fault(self, ranks, kind, iteration, phase, detect_s=0.0, detail="", key=None, rid=None) -> None:
        key = key or (kind, tuple(ranks), iteration)
        if key in self._fault_keys:
            return
        self._fault_keys.add(key)
        if rid is not None and rid in self.settled:
            self.router.drops.drop("settled", f"rank(s) {list(ranks)} {kind} at iteration {iteration} ({rid})")
            self.events.emit("settled_fault", ranks=list(ranks), kind=kind, iteration=iteration, rid=rid)
            log.info("rank(s) %s: %s at iteration %s was re-sent (report %s), but a recovery already dealt with "
                     "it: ignored", list(ranks), kind, iteration, rid)
            return
        rec = {"ranks": list(ranks), "kind": kind, "iteration": iteration, "phase": phase, "rid": rid,
               "detect_s": round(detect_s, 4), "detail": detail, "time": time.time(),
               "nodes": [self.ranks[r].node if r in self.ranks else "?" for r in ranks],
               "t_detect": time.monotonic(), "cpu_detect": time.thread_time()}
        if self.standby:
            self._deferred.append(rec)
            return
        if self.machine.state == S.INIT:  # the job was not whole yet: who never registered must be found too
            self.table.expect_all(time.monotonic())
        if self.machine.state == S.NORMAL and self.first_step is not None:
            # Close the last recovery first. A fault past the awaited step proves that step done on
            # every rank (its collectives needed them all), even if a rank's report of it has not
            # come; a fault inside it interrupted a job that was training again.
            done = max(iteration, self.table.newest_iteration()) > self.first_step.target
            self.first_step.check(time.monotonic(), done, interrupted=not done)
            self.first_step = None
        if kind in ("process-exit", "heartbeat-lost", "controller-lost", "node-lost"):
            self.table.mark_dead(ranks)
            self.died_in.update({r: int(iteration) for r in ranks})
            for pend in self.pending.values():  # a dead rank owes no answers (nor its successor)
                pend["waiting"].difference_update(ranks)
            self._publish()  # a scrape during the recovery that follows counts them out already
        self.faults.append(rec)
        self.active_faults.append(rec)
        self.events.emit("fault", **{k: v for k, v in rec.items() if k not in ("time", "t_detect", "cpu_detect")})
        log.error("fault: rank(s) %s %s at iteration %s, phase %s (%s), detected in %.3fs",
                  ranks, kind, iteration, phase, detail or "-", detect_s)
        if self.machine.state != S.DONE:
            self._feed(O.FAULT)

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.seen(len(self.table.live()), self.table.newest_iteration(),
                              max([i.checkpoint for i in self.ranks.values()] or [-1]))

    def _scan(self, now: float) -> None:
        self._publish()
        if self.machine.state in (S.INIT, S.EXIT, S.DONE):
            return
        for d in self.table.scan(now, training=self.machine.state == S.NORMAL):
            self._fault(d.ranks, d.kind, d.iteration, d.phase, detect_s=d.detect_s, detail=d.detail, key=d.key)

    # ---- state machine ------------------------------------------------------------------------
    def _on_transition(self, old, outcome, new, seconds) -> None:
        self.events.emit("state", **{"from": old.value, "to": new.value, "outcome": outcome.value,
                                     "seconds": round(seconds, 4)})
        log.info("state %s -(%s)-> %s after %.3fs", old.value, outcome.value, new.value, seconds)
        self._refresh_ack()

    def _feed(self, outcome: O) -> None:
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
            self._feed(result)

    def _failed(self) -> None:
        """The work of the current state raised: its FAILED outcome, where the table has one."""
        if (self.machine.state, O.FAILED) in TABLE:
            self._feed(O.FAILED)

    def _progress(self, now: float) -> None:
        """Conditions a state waits on, and per-state timeouts."""
        st = self.machine.state
        if st == S.NORMAL and self.first_step is not None:  # first: the last step may also end the job
            if self.first_step.check(now, self.table.completed(self.first_step.target, self.elastic.newcomers())):
                self.first_step = None
        if st == S.NORMAL and self.elastic.ended_without():
            return
        if st in (S.NORMAL, S.INIT) and self.ranks and self.table.all_over() and not self.active_faults:
            self._feed(O.FINISHED)
            return
        if st == S.NORMAL and self.elastic.offered:
            self.elastic.retry()
        if st in (S.PAUSE, S.REPAIR) and self.migrations.outrun():
            # The job ended its last step as the migration began: nobody parks, there is nothing to move.
            if self.table.all_over():
                self.migrations.abandon()
                self._feed(O.FINISHED)
            return
        if st == S.PAUSE and self._stopped(now):
            self._feed(O.STOPPED)
            return
        if st in (S.REPAIR, S.ROLLBACK, S.DUMP, S.DOWNGRADE, S.UPGRADE) and self.runner is not None:
            runner = self.runner
            out = runner.tick()
            if self.machine.state != st or self.runner is not runner:
                return  # a fault came meanwhile: the table moved on, this round's outcome is moot
            if out is not None:
                self._feed(self._outcome(out))
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
            self._feed(O.TIMEOUT)

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
        rec = {"ranks": missing, "kind": "not-registered", "iteration": -1, "phase": "startup", "detect_s": 0.0,
               "detail": detail, "time": time.time(), "nodes": nodes or ["?"], "t_detect": time.monotonic(),
               "cpu_detect": time.thread_time()}
        self.faults.append(rec)
        self.active_faults.append(rec)
        self.events.emit("fault", **{k: v for k, v in rec.items() if k not in ("time", "t_detect", "cpu_detect")})
        log.error("%s", detail)
        self._feed(O.TIMEOUT)

    def _limit(self, st, now: float) -> float | None:
        """A state's time limit. The dump's is --ha-dump-timeout, or grows with the state to write
        (50 MB/s at least), and while its writers show progress it is extended, up to three times."""
        base = TIMEOUTS.get(st)
        if st == S.PAUSE:  # a silent rank (its node gone with its agent) must be declared lost first
            return max(base, self.table.dead_after + 2.0)
        if st != S.DUMP or self.episode is None:
            return base
        if any(f["kind"] == "preempted" for f in self.episode.faults):
            return self.options.term_grace_s  # the scheduler kills the job after its grace: no extension
        base = self.options.dump_timeout_s or max(base, 30.0 + self.episode.state_bytes / 50e6)
        writers = [self.ranks[r] for r in self.episode.statuses if r in self.ranks and self.ranks[r].alive]
        moving = writers and now - max(i.progress_at for i in writers) < 30.0
        return 3 * base if moving else base

    def _stopped(self, now: float) -> bool:
        """PAUSE is over the moment every rank is accounted for: each live rank answered the stop
        (so it was alive after the fault), and a rank that cannot answer left the live set — its
        agent reported its exit (about 20 ms) or its silence reached the loss limit. The strategy
        then sees the real cause: a killed rank's exit report, not only its peers' broken links."""
        pend = self.pending.get(self._stop_id)
        return pend is None or not (pend["waiting"] & self.table.live())

    def _outcome(self, out) -> O:
        if out == "ok":
            return O.OK
        if out[0] == "switch":  # recover waited out the spare wait: the same episode scales in
            return self.elastic.switched(out[2])
        self.strategy_note = playbooks.failed(self.playbook, self.episode, out[1])
        return O.FAILED

    # ---- what each state does on entry ----------------------------------------------------------
    def _training(self):
        now = time.monotonic()
        self.table.heard_all(now)  # detection clocks start with training, not at registration
        came_from = self.machine.history[-1][0] if self.machine.history else None
        if came_from == S.ROLLBACK and self.episode is not None:  # a recovery ended: its first step closes it
            self._settle_episode()
            self.first_step = FirstStep(self.episode, list(self.active_faults), now)
            self.active_faults.clear()
            self.table.moved(now)
        self.succession.name_standbys()
        return None

    def _stop_survivors(self):
        """Stop every survivor; decision latency is fault detection -> last stop sent."""
        fault = self.active_faults[-1] if self.active_faults else None
        # every live rank, reporters of comm failures included; not a newcomer waiting to scale out
        survivors = sorted(self.table.live() - self.elastic.newcomers())
        reason = (f"{fault['kind']} on rank(s) {fault['ranks'][:8]}" if fault else "controller")[:200]
        # Nothing broke for a migration or a scale-out: the ranks park between two steps, no step
        # is interrupted.
        planned = bool(self.active_faults) and all(f["kind"] in ("migrate", "scale-out") for f in self.active_faults)
        self._stop_id = self.order("stop", survivors, {"reason": reason, **({"boundary": True} if planned else {})})
        if fault is not None:
            decide_ms = (time.monotonic() - fault["t_detect"]) * 1e3
            cpu_ms = (time.thread_time() - fault["cpu_detect"]) * 1e3  # wall minus waiting for a CPU
            self.events.emit("decision", action="stop", ranks=len(survivors), decide_ms=round(decide_ms, 3),
                             cpu_ms=round(cpu_ms, 3))
        return None

    def _decide(self):
        kinds = {f["kind"] for f in self.active_faults}
        if kinds == {"scale-out"}:
            self.strategy_note = "scale-out onto returned rank(s)"
            self.events.emit("strategy", outcome=O.SCALE_OUT.value, reason=self.strategy_note)
            self.playbook, self.chosen = playbooks.SCALE_OUT, O.SCALE_OUT
            return O.SCALE_OUT
        if "scale-out" in kinds:  # a fault came first: its recovery; the newcomers are asked again after it
            self.active_faults[:] = [f for f in self.active_faults if f["kind"] != "scale-out"]
            kinds.discard("scale-out")
        ordered = self.options.ordered_strategies()
        refusal = self._budget_refusal() if "recover" in ordered else None
        if refusal:
            ordered = [s for s in ordered if s != "recover"]
            self.budget.spent = f"recover not tried: {refusal}"
        if "elastic-training" in ordered:
            ordered, why_not = self.elastic.order(ordered)
            refusal = "; ".join(x for x in (refusal, why_not) if x) or None
        outcome, why = choose_strategy(ordered, kinds, BUILT)
        if refusal:
            why = f"recover not tried: {refusal}; {why}"
        if self.elastic.spare_wait and outcome == O.RECOVER:
            why += self.elastic.waiting_note()
        self.strategy_note = why
        self.events.emit("strategy", outcome=outcome.value, reason=why)
        log.info("strategy for %s: %s (%s)", sorted(kinds), outcome.value, why)
        self.playbook = {O.RETRY: playbooks.RETRY, O.RECOVER: playbooks.RECOVER,
                         O.ELASTIC: playbooks.ELASTIC}.get(outcome)
        self.chosen = outcome
        return outcome

    def _budget_refusal(self) -> str | None:
        now = time.monotonic()
        lost = {r: self.died_in.get(r, self.ranks[r].it) for r in self.table.lost() if r in self.ranks}
        gone = {a.node_rank for a in self.agents.values()
                if set(a.ranks) & set(lost) and a not in self.table.live_agents(now)}
        return self.budget.refusal(lost, gone)

    def _play(self):
        """REPAIR, ROLLBACK, DUMP: the playbook's rounds for this state (a new episode on REPAIR and
        DUMP; ROLLBACK goes on with REPAIR's)."""
        st = self.machine.state
        if st in (S.REPAIR, S.DUMP, S.DOWNGRADE, S.UPGRADE):
            if st == S.DUMP:
                self.playbook = playbooks.DUMP
            strategy = ({O.RECOVER: "recover"}.get(self.chosen, "retry") if st == S.REPAIR else
                        {S.DOWNGRADE: "elastic-training", S.UPGRADE: "scale-out"}.get(st, "dump"))
            first = self.active_faults[0] if self.active_faults else None
            replica = all(i.groups for i in self.ranks.values() if i.alive)  # (no replicas: groups are not sent)
            self.episode = Episode(self.playbook_port, strategy, self.world, self.active_faults,
                                   {r: i.groups[0] for r, i in self.ranks.items() if i.groups}, replica=replica,
                                   spare_wait=self.elastic.spare_wait if strategy == "recover" else None,
                                   left=frozenset(self.elastic.left))
            if first is not None and st in (S.REPAIR, S.DOWNGRADE, S.UPGRADE):
                self.episode.phases["detect"] = first["detect_s"]
                # detection -> every survivor stopped and the strategy chosen
                self.episode.phases["stop"] = round(time.monotonic() - first["t_detect"], 4)
        self.runner = Runner(self.playbook.rounds(st), self.episode)
        out = self.runner.start()
        return None if out is None else self._outcome(out)

    def _tell_exit(self):
        faults = self.active_faults or self.faults
        kinds = {f["kind"] for f in faults}
        self.exit_code = (exitcodes.PREEMPTED if "preempted" in kinds else
                          exitcodes.NOT_REGISTERED if "not-registered" in kinds else
                          exitcodes.DO_NOT_RESTART if self.budget.spent else
                          exitcodes.FAULT if self.faults else exitcodes.OK)
        dump = self.episode.result if self.episode is not None and self.playbook is playbooks.DUMP else None
        note = self.strategy_note
        if self.budget.spent and self.budget.spent not in note:
            note = f"{self.budget.spent}; {note}"
        text = self.last_diagnosis = diagnosis(faults, len(self.table.live()), note, dump, self.log_dir,
                                               self.exit_code)
        self.events.emit("diagnosis", text=text, exit_code=self.exit_code)
        log.error(text)
        args = {"code": self.exit_code, "diagnosis": text}
        self.order("exit", sorted(self.table.live()), args)
        self._to_agents("exit", args)
        return None

    def _finish_exit(self) -> None:
        self._feed(O.OK)  # EXIT -> DONE
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
    def status(self) -> dict:
        now = time.monotonic()
        return {
            "state": self.machine.state.value, "epoch": self.epoch, "world_size": self.world,
            "controller": {"rank": self.rank, "pid": os.getpid(), "endpoint": self.endpoint,
                           "standby": self.standby},
            "backups": [{"rank": r, "endpoint": ep} for r, ep in self.standbys.named()],
            "ranks": self.table.status(now),
            "agents": [{"node_rank": a.node_rank, "node": a.node, "ranks": a.ranks, "pids": a.pids}
                       for a in self.agents.values()],
            "faults": [{k: v for k, v in f.items() if k not in ("t_detect", "cpu_detect")} for f in self.faults],
            "dropped": dict(self.router.drops.counts),
            **self.elastic.status(),
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
        print(c.last_diagnosis or diagnosis(c.faults, len(c.table.live()), c.strategy_note, None, log_dir),
              file=sys.stderr)
    return c.exit_code
