"""The controller: sees every rank, detects faults, runs the recovery state machine.

One ROUTER socket; processors, agents and the CLI are DEALER clients. A thread on rank 0 by default
(``Controller(...).start()``), a standalone process with ``mindspeed-ha controller``, or a standby
(``standby=True``) on a backup rank that promotes itself when it holds a quorum (see election.py).
Everything runs on the one controller thread: no locks on the rank table, and a decision is never
late because a lock was held.
"""
from __future__ import annotations

import json
import os
import socket as _socket
import sys
import threading
import time
from dataclasses import dataclass, field

import zmq

from ..events import EventLog, get_logger
from ..faults import PROCESS_FATAL_EXIT
from ..options import HAOptions
from . import election, protocol as P, security
from .dying_gasp import DumpDriver
from .retry import RetryDriver
from .states import TIMEOUTS, Machine, Outcome as O, State as S, choose_strategy

log = get_logger("control.controller")
# pyzmq's Cython send, without the Python-level wrapper: half the cost per frame, which is most of
# a decision's time at 16k ranks (fan-out of one action) and of a heartbeat's ack.
_raw_send = getattr(getattr(zmq, "backend", None), "Socket", zmq.Socket).send
_MORE_NB = zmq.SNDMORE | zmq.NOBLOCK
STEP_PHASES = {p: i for i, p in enumerate(("startup", "forward", "backward", "grad-sync", "optimizer",
                                           "param-sync", "checkpoint", "step"))}


@dataclass
class Rank:
    rank: int
    ident: bytes
    node: str = "?"
    pid: int = 0
    host: str = ""
    groups: list = field(default_factory=list)
    it: int = -1
    upd: bool = False
    health: str = "ok"
    phase: str = "startup"
    progress: float = 0.0
    seen: float = 0.0            # monotonic time of the last message
    progress_at: float = 0.0     # monotonic time the rank last moved (iteration/phase/progress changed)
    alive: bool = True
    done: bool = False           # said bye / exited 0
    stopped: bool = False


@dataclass
class Agent:
    node_rank: int
    ident: bytes
    node: str
    ranks: list
    pids: list
    seen: float = 0.0


def _host_addr() -> str:
    return os.environ.get("MINDSPEED_HA_NODE_HOST") or os.environ.get("MASTER_ADDR") or "127.0.0.1"


class Controller:
    def __init__(self, log_dir: str, world_size: int, options: HAOptions | None = None,
                 keys: security.Keys | None = None, host: str | None = None, port: int = 0,
                 rank: int | None = None, standby: bool = False, epoch: int = 1,
                 job_id: str | None = None, local_exit=None, write_json: bool = True):
        self.log_dir, self.world = log_dir, int(world_size)
        self.options = options or HAOptions(strategies=frozenset({"dump"}), log_dir=log_dir)
        self.keys = keys if keys is not None else security.Keys.load(log_dir, self.options.key_dir,
                                                                     self.options.insecure)
        self.host = host or _host_addr()
        self.rank, self.standby, self.epoch = rank, standby, epoch
        self.job_id = job_id or os.environ.get("MINDSPEED_HA_JOB_ID")
        self.local_exit = local_exit          # how the host rank exits (never through the socket)
        self.write_json = write_json
        self.hb = float(self.options.heartbeat_s)
        # Silent for 1.8 heartbeats (<= 2 with the scan granularity) means lost, but never under 3 s:
        # a rank's processor thread can be starved of the GIL or a CPU for a second, and a dead
        # process is reported by its agent long before (MINDSPEED_HA_DEAD_AFTER overrides).
        self.dead_after = (float(os.environ.get("MINDSPEED_HA_DEAD_AFTER", 0) or 0)
                           or max(1.8 * self.hb, 3.0))
        self.hang_timeout = float(self.options.hang_timeout_s)
        self.settle_s = 0.25
        self.settle_comm_s = 1.5
        self.ranks: dict[int, Rank] = {}
        self.by_ident: dict[bytes, int] = {}
        self.agents: dict[int, Agent] = {}
        self.faults: list[dict] = []          # every fault, for status and the diagnosis
        self.active_faults: list[dict] = []   # faults of the episode being handled
        self._fault_keys: set = set()
        self._deferred: list[dict] = []       # faults reported to a standby, handled on promotion
        self.backups: list[int] = []
        self.backup_eps: dict[int, str] = {}
        self.backup_pids: dict[int, int] = {}  # the process each standby runs in
        self.exit_code = 0
        self.strategy_note = ""
        self.last_diagnosis = ""
        self.actions = {S.NORMAL: self._act_normal, S.PAUSE: self._act_pause, S.ENV_CLEAR: self._act_env_clear, S.EXIT: self._act_exit}
        self._tcp_store = None
        self.dumper = DumpDriver(self)
        self.retrier = RetryDriver(self)
        self.actions.update({S.DUMP: self.dumper.start, S.REPAIR: self.retrier.start,
                             S.ROLLBACK: self.retrier.start_rollback})
        self.built_strategies: set[str] = {"dump", "retry", "recover"}
        self.chosen: O | None = None            # the strategy picked for the current episode
        self._pending: dict[int, dict] = {}     # action id -> {action, ranks waiting, cli ident}
        self._next_id = 1
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread: threading.Thread | None = None
        self.events = EventLog(log_dir, "controller")
        self.drops = P.DropCounter(log)
        self.machine = Machine(self._on_transition)
        self._ack = b""
        self._dispatch = {t: getattr(self, "_on_" + t.replace("?", "_q"), self._on_unexpected) for t in P.SCHEMAS}
        self._ctx = zmq.Context()  # its own context: ZAP is per context, and keys are per job
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.linger = 500
        self.sock.rcvhwm = self.sock.sndhwm = 100000
        self.sock.maxmsgsize = P.MAX_BYTES + 1024  # libzmq drops oversized frames before Python sees them
        # Thousands of ranks connect at once and every handshake waits its turn at the ZAP handler:
        # the default 30 s handshake limit would drop them and start a reconnect storm.
        self.sock.handshake_ivl = 300_000
        self.sock.backlog = 65535  # (capped by net.core.somaxconn) a full accept queue drops SYNs: 1-7 s retries
        security.start_authenticator(self._ctx, self.keys)
        security.secure_server(self.sock, self.keys)
        bind_host = "127.0.0.1" if self.host.startswith("127.") or self.host == "localhost" else "*"
        self.sock.bind(f"tcp://{bind_host}:{port or '*'}")
        self.port = int(self.sock.last_endpoint.decode().rsplit(":", 1)[1])
        self.endpoint = f"tcp://{self.host}:{self.port}"
        self._started = time.monotonic()
        self._last_scan = 0.0
        self._refresh_ack()

    # ---- life ---------------------------------------------------------------------------------
    def start(self) -> "Controller":
        if not self.standby:
            self._announce()
        self._thread = threading.Thread(target=self._run, name="mindspeed-ha-controller", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _announce(self, quiet: bool = False) -> None:
        info = {"host": self.host, "port": self.port, "endpoint": self.endpoint,
                "server_public_key": self.keys.server_public_text(), "secure": self.keys.secure,
                "epoch": self.epoch, "rank": self.rank, "pid": os.getpid(), "job_id": self.job_id,
                "world_size": self.world, "hostname": _socket.gethostname(), "started": time.time(),
                "backups": [self.backup_eps[r] for r in self.backups if r in self.backup_eps]}
        if self.write_json:
            election.write_controller_json(self.log_dir, info)
        if quiet:
            return
        log.info("controller (epoch %d) listening on %s, world %d, %s", self.epoch, self.endpoint,
                 self.world, "CurveZMQ" if self.keys.secure else "INSECURE")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stop.is_set() and self.machine.state != S.DONE:
                if poller.poll(10):
                    for _ in range(5000):  # drain, but keep timers alive under a flood
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                self._tick()
        except Exception:  # the controller must say why it died
            log.exception("controller thread failed")
            raise
        finally:
            self.done.set()
            self.sock.close(linger=500)
            security.stop_authenticator(self._ctx)
            self._ctx.term()

    # ---- input --------------------------------------------------------------------------------
    def _on_frames(self, frames: list) -> None:
        if len(frames) != 2:
            self.drops.drop("frames", f"{len(frames)} frames")
            return
        ident, data = frames
        try:
            msg = P.decode(data)
        except P.ProtocolError as e:
            self.drops.drop("malformed", str(e))
            return
        try:
            self._dispatch.get(msg["t"], self._on_unexpected)(ident, msg)
        except (KeyError, ValueError, TypeError, IndexError) as e:  # semantically bad, e.g. rank out of range
            self.drops.drop("invalid", f"{msg.get('t')}: {e}")
        except Exception:  # a bug in one handler must not take the controller down with it
            log.exception("error handling %s", msg.get("t"))

    def _on_unexpected(self, ident, msg) -> None:
        self.drops.drop("unexpected", msg["t"])

    def _check_rank(self, r: int) -> int:
        if not 0 <= r < self.world:
            raise ValueError(f"rank {r} outside world {self.world}")
        return r

    def _on_register(self, ident, msg) -> None:
        r = self._check_rank(msg["rank"])
        if msg["world"] != self.world:
            raise ValueError(f"rank {r} says world {msg['world']}, controller has {self.world}")
        now = time.monotonic()
        old = self.ranks.get(r)
        info = Rank(rank=r, ident=ident, node=msg["node"], pid=msg["pid"], host=msg.get("host", ""),
                    groups=msg.get("groups", []), it=msg.get("iteration", -1), seen=now, progress_at=now)
        if old is not None and old.pid == info.pid:
            info.it, info.phase, info.progress, info.progress_at = old.it, old.phase, old.progress, old.progress_at
        if old is not None and not info.groups:
            info.groups = old.groups  # a restarted worker learns its groups only when it joins
        if old is not None and old.pid != info.pid and old.alive and self.machine.state not in (S.INIT,):
            log.warning("rank %d re-registered with a new pid %d (was %d)", r, info.pid, old.pid)
        if old is not None and not old.alive:
            # A dead rank stays dead, unless it is the worker the recover strategy restarted.
            info.alive = old.pid != info.pid and r in self.retrier.restarting
            if info.alive:
                self.retrier.restarting.discard(r)
                self.events.emit("rejoined", rank=r, pid=info.pid, old_pid=old.pid)
                log.info("rank %d rejoined with pid %d (was %d)", r, info.pid, old.pid)
        self.ranks[r] = info
        self.by_ident[ident] = r
        self._send(ident, self._ack)
        if old is not None and old.ident != ident and old.pid in (info.pid, 0):  # 0: placeholder of a takeover
            self._resend_pending(r)
        if self.machine.state == S.INIT and not self.standby and len(self.ranks) == self.world:
            self._feed(O.REGISTERED)

    def _on_hb(self, ident, msg) -> None:
        r = msg["rank"]
        info = self.ranks.get(r)
        if info is None or info.ident != ident:
            if info is None:
                self._send(ident, P.encode("refused", reason="register first"))
                return
            info.ident = ident  # the rank reconnected (new socket) without re-registering
            self.by_ident[ident] = r
            self._resend_pending(r)
        now = time.monotonic()
        info.seen = now
        phase = msg.get("phase", info.phase)
        prog = msg.get("progress", info.progress)
        if msg["it"] != info.it or phase != info.phase or prog != info.progress or msg["upd"] != info.upd:
            info.progress_at = now
        info.it, info.upd, info.health, info.phase, info.progress = msg["it"], msg["upd"], msg["health"], phase, prog
        self._send(ident, self._ack)

    def _on_fault(self, ident, msg) -> None:
        r = self._check_rank(msg["rank"])
        info = self.ranks.get(r)
        if info:
            info.health = "faulty"
            info.it = max(info.it, msg["iteration"])
            info.phase = msg["phase"]
        at = msg.get("at")
        self._fault([r], msg["kind"], msg["iteration"], msg["phase"],
                    detect_s=max(0.0, time.time() - at) if at else 0.0, detail=msg.get("detail", ""),
                    key=("fault", r, msg["kind"], at))

    def _on_result(self, ident, msg) -> None:
        r = self._check_rank(msg["rank"])
        pend = self._pending.get(msg["id"])
        if pend is None:
            return
        pend["waiting"].discard(r)
        pend["results"][r] = (msg["ok"], msg.get("detail", ""))
        if msg["action"] == "stop" and r in self.ranks:
            self.ranks[r].stopped = True
        if msg["action"] == "standby" and msg["ok"]:
            self.backup_eps[r] = msg.get("detail", "")
            self._refresh_ack()
            self._announce(quiet=True)  # a client that never got an ack naming it finds it there
            self.events.emit("standby", rank=r, endpoint=self.backup_eps[r])
        if pend.get("cli") is not None:
            self._send(pend["cli"], P.encode("status", body=json.dumps(
                {"ok": msg["ok"], "rank": r, "action": msg["action"], "detail": msg.get("detail", "")})))
        if not pend["waiting"]:
            self._pending.pop(msg["id"], None)

    def _on_bye(self, ident, msg) -> None:
        r = self._check_rank(msg["rank"])
        if r in self.ranks:
            self.ranks[r].done = True
            self.ranks[r].seen = time.monotonic()

    def _on_agent(self, ident, msg) -> None:
        self.agents[msg["node_rank"]] = Agent(msg["node_rank"], ident, msg["node"], list(msg["ranks"]),
                                              list(msg["pids"]), seen=time.monotonic())
        self._send(ident, self._ack)

    def _on_agent_hb(self, ident, msg) -> None:
        a = self.agents.get(msg["node_rank"])
        if a is None:
            self._send(ident, P.encode("refused", reason="register first"))
            return
        a.ident, a.seen = ident, time.monotonic()
        self._send(ident, self._ack)

    def _on_exit(self, ident, msg) -> None:
        r = self._check_rank(msg["rank"])
        code, sig = msg.get("code", 0), msg.get("signal", 0)
        info = self.ranks.get(r)
        if info is not None and info.pid and info.pid != msg["pid"]:
            return  # an older incarnation of this rank
        agent = self.agents.get(msg.get("node_rank", -1))
        if agent is not None and r in agent.ranks and agent.pids[agent.ranks.index(r)] != msg["pid"]:
            return  # the same, told by the agent's current worker list (a report replayed to a new controller)
        if info is not None and not info.alive:
            return
        if info is not None:
            info.alive = False
        if code == 0 and not sig:
            if info is not None:
                info.done = True
            return
        if self.machine.state in (S.EXIT, S.DONE):
            return  # survivors we told to exit
        how = f"killed by signal {sig}" if sig else f"exit code {code}"
        if code == PROCESS_FATAL_EXIT and not sig:
            how += " (process-fatal device error: the process must be replaced)"
        it = msg.get("iteration", info.it if info else -1)
        phase = msg.get("phase", info.phase if info else "unknown")
        at = msg.get("at")
        self._fault([r], "process-exit", it, phase, detect_s=max(0.0, time.time() - at) if at else 0.0,
                    detail=f"pid {msg['pid']} {how}", key=("exit", r, msg["pid"]))

    def _on_status_q(self, ident, msg) -> None:
        self._send(ident, P.encode("status", body=json.dumps(self.status())))

    def _on_inject(self, ident, msg) -> None:
        r = self._check_rank(msg["rank"])
        info = self.ranks.get(r)
        if info is None or not info.alive or self.standby:
            self._send(ident, P.encode("refused", reason=f"rank {r} is not a live registered rank"))
            return
        if msg["kind"] not in P.INJECT_KINDS or msg.get("phase", "forward") not in P.INJECT_PHASES:
            self._send(ident, P.encode("refused", reason=f"unknown fault {msg['kind']!r}/{msg.get('phase')!r}"))
            return
        args = {k: msg[k] for k in ("kind", "step", "phase") if k in msg}
        aid = self._do("inject", [r], args)
        # Answer on delivery: the fault may kill the rank before its handler's result gets out.
        self._send(ident, P.encode("status", body=json.dumps(
            {"ok": True, "rank": r, "action": "inject", "id": aid, "detail": "delivered", **args})))
        self.events.emit("inject", target=r, **args)

    # ---- output -------------------------------------------------------------------------------
    def _send(self, ident: bytes, data: bytes) -> None:
        try:
            _raw_send(self.sock, ident, _MORE_NB)
            _raw_send(self.sock, data, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a peer that vanished or is flooded must not stall us

    def _refresh_ack(self) -> None:
        self._ack = P.encode("ack", epoch=self.epoch, state=self.machine.state.value, standby=self.standby,
                             backups=[self.backup_eps[r] for r in self.backups if r in self.backup_eps])

    def _do(self, action: str, ranks, args=None, cli=None) -> int:
        aid = self._next_id
        self._next_id += 1
        data = P.encode("do", action=action, id=aid, args=args or {}, epoch=self.epoch)
        waiting = set()
        sock, send, more, nb = self.sock, _raw_send, _MORE_NB, zmq.NOBLOCK
        get, skip = self.ranks.get, (self.rank if action == "exit" else None)  # the host rank exits last, locally
        for r in ranks:  # the hot loop of a decision at scale: keep it flat
            info = get(r)
            if info is None or not info.alive or r == skip:
                continue
            waiting.add(r)
            try:
                send(sock, info.ident, more)
                send(sock, data, nb)
            except zmq.ZMQError:
                pass
        self._pending[aid] = {"action": action, "waiting": waiting, "results": {}, "cli": cli,
                              "sent": time.monotonic(), "data": data}
        return aid

    def store(self):
        """A TCPStore served by the controller's process, for the ranks' new process groups: a store
        hosted by a rank would die with that rank. One per controller; callers prefix their keys
        with a generation."""
        if self._tcp_store is None:
            import torch.distributed as dist
            bind = "127.0.0.1" if self.host.startswith("127.") or self.host == "localhost" else self.host
            self._tcp_store = dist.TCPStore(bind, 0, None, True, wait_for_workers=False)
        return self._tcp_store

    def _resend_pending(self, r: int) -> None:
        """A rank came back on a new connection: orders sent to the old one may be lost (it
        de-duplicates by id what it did receive)."""
        for pend in list(self._pending.values()):
            if r in pend["waiting"] and pend.get("data"):
                self._send(self.ranks[r].ident, pend["data"])

    def restart_workers(self, ranks=None) -> None:
        """Ask the agents to restart these ranks' workers (all when ``None``): the recover (ARF)
        strategy's tool. Like every action, call it on the controller thread (from a state action)."""
        self._to_agents("restart", {"ranks": sorted(ranks)} if ranks else {})

    def _to_agents(self, action: str, args: dict) -> None:
        data = P.encode("do", action=action, id=0, args=args, epoch=self.epoch)
        for a in self.agents.values():
            self._send(a.ident, data)

    # ---- detection ----------------------------------------------------------------------------
    def _fault(self, ranks, kind, iteration, phase, detect_s=0.0, detail="", key=None) -> None:
        key = key or (kind, tuple(ranks), iteration)
        if key in self._fault_keys:
            return
        self._fault_keys.add(key)
        rec = {"ranks": list(ranks), "kind": kind, "iteration": iteration, "phase": phase,
               "detect_s": round(detect_s, 4), "detail": detail, "time": time.time(),
               "nodes": [self.ranks[r].node if r in self.ranks else "?" for r in ranks],
               "t_detect": time.monotonic(), "cpu_detect": time.thread_time()}
        if self.standby:
            self._deferred.append(rec)
            return
        if self.machine.state == S.NORMAL:  # close the last recovery first, if this fault is past it
            self.retrier.watch(time.monotonic(), fault_at=max([iteration] + [self.ranks[r].it for r in self.ranks]))
        for r in ranks:
            if r in self.ranks and kind in ("process-exit", "heartbeat-lost", "controller-lost", "node-lost"):
                self.ranks[r].alive = False
                for pend in self._pending.values():  # a dead rank owes no answers (nor its successor)
                    pend["waiting"].discard(r)
        self.faults.append(rec)
        self.active_faults.append(rec)
        self.events.emit("fault", **{k: v for k, v in rec.items() if k not in ("time", "t_detect", "cpu_detect")})
        log.error("fault: rank(s) %s %s at iteration %s, phase %s (%s), detected in %.3fs",
                  ranks, kind, iteration, phase, detail or "-", detect_s)
        if self.machine.state not in (S.DONE,):
            self._feed(O.FAULT)

    def _scan(self, now: float) -> None:
        if self.machine.state in (S.INIT, S.EXIT, S.DONE) or self.standby:
            return
        lost, stuck = [], []
        # A rank whose agent is heard from is watched by that agent: its death arrives as an exit
        # report within 20 ms, so a silent processor there is a starved thread (8 ranks on 2 cores,
        # a long GIL hold), not a lost rank; a real hang is the hang detector's to find.
        watched = {r for a in self.agents.values() if now - a.seen <= self.dead_after for r in a.ranks}
        for info in self.ranks.values():
            if not info.alive or info.done:
                continue
            silent = now - info.seen
            # The same for a rank on this host whose process still runs (e.g. under plain torchrun).
            if silent > self.dead_after and ((info.rank not in watched and not self._runs_here(info))
                                             or silent > max(self.dead_after, self.hang_timeout)):
                lost.append(info)
            elif (self.machine.state == S.NORMAL and info.it >= 0
                  and now - info.progress_at > self.hang_timeout):
                stuck.append(info)
        for info in lost:
            self._fault([info.rank], "heartbeat-lost", info.it, info.phase, detect_s=now - info.seen,
                        detail=f"no heartbeat for {now - info.seen:.2f}s", key=("hb", info.rank, info.pid))
        if stuck:
            # Everyone blocks behind a hung rank; blame those that got least far (iteration, phase).
            cands = [i for i in self.ranks.values() if i.alive and not i.done and i.it >= 0
                     and now - i.progress_at > self.hang_timeout / 2]
            low = min((i.it, STEP_PHASES.get(i.phase, 99)) for i in cands)
            hung = [i for i in cands if (i.it, STEP_PHASES.get(i.phase, 99)) == low]
            first = hung[0]
            self._fault([i.rank for i in hung], "hang", first.it, first.phase,
                        detect_s=now - min(i.progress_at for i in hung),
                        detail=f"no progress for {now - first.progress_at:.1f}s "
                               f"(hang timeout {self.hang_timeout:g}s)", key=("hang", first.it))

    @staticmethod
    def _runs_here(info: Rank) -> bool:
        if not info.pid or info.host != _socket.gethostname():
            return False
        import psutil
        try:
            return psutil.Process(info.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _tick(self) -> None:
        now = time.monotonic()
        if self.standby:
            self._maybe_promote(now)
            return
        if now - self._last_scan >= self.hb / 10:
            self._last_scan = now
            self._scan(now)
        self._progress(now)

    # ---- state machine ------------------------------------------------------------------------
    def _on_transition(self, old, outcome, new, seconds) -> None:
        self.events.emit("state", **{"from": old.value, "to": new.value, "outcome": outcome.value,
                                     "seconds": round(seconds, 4)})
        log.info("state %s -(%s)-> %s after %.3fs", old.value, outcome.value, new.value, seconds)
        self._refresh_ack()

    def _feed(self, outcome: O) -> None:
        before = self.machine.state
        new = self.machine.feed(outcome)
        if new != before or outcome == O.FAULT:
            action = self.actions.get(new)
            if action is not None and (new != before or new == S.PAUSE):
                result = action()
                if result is not None:
                    self._feed(result)

    def _progress(self, now: float) -> None:
        """Conditions a state waits on, and per-action timeouts."""
        st = self.machine.state
        if st == S.NORMAL:
            self.retrier.watch(now)  # first: the last step after a recovery may also end the job
        if st in (S.NORMAL, S.INIT):
            if self.ranks and len(self.ranks) == self.world and all(
                    i.done or not i.alive for i in self.ranks.values()) and not self.active_faults:
                self._feed(O.FINISHED)
                return
        if st == S.PAUSE and self._stop_id is not None:
            pend = self._pending.get(self._stop_id)
            # Dwell a little: the agent's exit report of a killed rank can trail the survivors'
            # communication errors, and the strategy must see the real cause. Communication errors
            # alone are nearly always a consequence, so wait longer for their cause.
            only_comm = all(f["kind"] == "comm-failure" for f in self.active_faults)
            # A rank that reported its own memory error or exception, or an agent's exit report, is
            # the cause: nothing more to wait for (an agent reports all its dead workers at once).
            known = any(f["kind"] in ("memory-error", "other", "process-exit") for f in self.active_faults)
            settle = self.settle_comm_s if only_comm else (0.05 if known else self.settle_s)
            if only_comm and any(now - i.seen > 2 * self.hb for r, i in self.ranks.items() if r in self._live()):
                # A rank is silent too (a node whose agent died with it reports no exit): wait until
                # it is declared lost, so that the strategy sees the cause.
                settle = self.dead_after + 0.5
            if now - self.machine.entered < settle:
                pass
            elif pend is None or not (pend["waiting"] & self._live()):
                self._feed(O.STOPPED)
                return
        if st in (S.DUMP, S.REPAIR, S.ROLLBACK):
            outcome = (self.dumper if st == S.DUMP else self.retrier).progress(now)
            if outcome is not None:
                self._feed(outcome)
                return
        if st == S.EXIT:
            others = [r for r in self._live() if r != self.rank]
            if not others or now - self.machine.entered > TIMEOUTS[S.EXIT] - 1:
                self._finish_exit()
                return
        if st != S.INIT and self.machine.overdue():
            log.error("state %s ran past its %.1fs timeout", st.value, TIMEOUTS[st])
            self._feed(O.TIMEOUT)

    def _live(self) -> set:
        return {r for r, i in self.ranks.items() if i.alive and not i.done}

    _stop_id = None

    def _act_pause(self):
        """Stop every survivor; decision latency is fault detection -> last stop sent."""
        fault = self.active_faults[-1] if self.active_faults else None
        survivors = sorted(self._live())  # every live rank, reporters of comm failures included
        reason = (f"{fault['kind']} on rank(s) {fault['ranks'][:8]}" if fault else "controller")[:200]
        self._stop_id = self._do("stop", survivors, {"reason": reason})
        if fault is not None:
            decide_ms = (time.monotonic() - fault["t_detect"]) * 1e3
            cpu_ms = (time.thread_time() - fault["cpu_detect"]) * 1e3  # wall minus waiting for a CPU
            self.events.emit("decision", action="stop", ranks=len(survivors), decide_ms=round(decide_ms, 3),
                             cpu_ms=round(cpu_ms, 3))
        return None

    def _act_env_clear(self):
        kinds = {f["kind"] for f in self.active_faults}
        outcome, why = choose_strategy(self.options.ordered_strategies(), kinds, self.built_strategies)
        self.strategy_note, self.chosen = why, outcome
        self.events.emit("strategy", outcome=outcome.value, reason=why)
        log.info("strategy for %s: %s (%s)", sorted(kinds), outcome.value, why)
        return outcome

    def diagnosis(self) -> str:
        faults = self.active_faults or self.faults
        if not faults:
            return "mindspeed-ha: the job ended without a recorded fault."
        # The first fault of an episode is the cause; communication failures that follow it are
        # survivors noticing the loss, so they are summarised, not described.
        root = next((f for f in faults if f["kind"] != "comm-failure"), faults[0])
        nodes = ", ".join(sorted(set(root["nodes"])))
        detail = f" ({root['detail'][:160]})" if root["detail"] else ""
        text = (f"mindspeed-ha diagnosis: rank {', '.join(map(str, root['ranks']))} (node {nodes}) failed: "
                f"{root['kind']}{detail} at iteration {root['iteration']}, phase {root['phase']}; "
                f"the controller knew {root['detect_s']:.2f}s after the fault was observed.")
        rest = [f for f in faults if f is not root]
        follow = sorted({r for f in rest if f["kind"] == "comm-failure" for r in f["ranks"]})
        other = [f for f in rest if f["kind"] != "comm-failure"]
        if follow:
            text += f" Then rank(s) {', '.join(map(str, follow))} reported communication failures (consequences)."
        for f in other:
            text += (f" Also rank {', '.join(map(str, f['ranks']))}: {f['kind']} at iteration "
                     f"{f['iteration']}, phase {f['phase']}.")
        live = sorted(self._live())
        saved = self.dumper.result
        resume = (f"Resume with --load {saved['save']}: it continues from iteration {saved['iteration']}, "
                  f"no completed step is lost." if saved else "Resume from the last checkpoint.")
        text += (f" Recovery: {self.strategy_note or 'none'}; so the job ends here: the {len(live)} live "
                 f"rank(s) were told to exit (exit code {1 if self.faults else 0}). {resume} "
                 f"Events: {os.path.join(self.log_dir, 'events', 'controller.jsonl')}.")
        return text

    def _act_exit(self):
        self.exit_code = 1 if self.faults else 0
        text = self.last_diagnosis = self.diagnosis()
        self.events.emit("diagnosis", text=text, exit_code=self.exit_code)
        log.error(text)
        args = {"code": self.exit_code, "diagnosis": text}
        self._do("exit", sorted(self._live()), args)
        self._to_agents("exit", args)
        return None

    def _finish_exit(self) -> None:
        self._feed(O.OK)  # EXIT -> DONE
        if self.local_exit is not None and self.rank is not None and self.rank in self._live():
            try:
                self.sock.close(linger=1000)  # flush what we sent before the process goes
            finally:
                self.local_exit(self.exit_code)

    # ---- backups ------------------------------------------------------------------------------
    def _act_normal(self):
        now = time.monotonic()
        for i in self.ranks.values():  # detection clocks start with training, not at registration
            i.seen = max(i.seen, now)
        self._maybe_start_backups()  # name the standbys once everyone is in
        return None

    def _maybe_start_backups(self) -> None:
        """Name the standbys; after a recovery, replace those whose process was lost (a restarted
        rank runs no standby), so that the controller's own loss stays survivable."""
        if self.machine.state != S.NORMAL or self.world < 2:
            return
        lost = [r for r in self.backups if not self.ranks[r].alive or self.ranks[r].pid != self.backup_pids.get(r)]
        for r in lost:
            self.backups.remove(r)
            self.backup_eps.pop(r, None)
        if len(self.backups) >= 2 or (self.backups and not lost):
            return
        nodes = {r: i.node for r, i in self.ranks.items() if i.alive and r not in self.backups}
        new = election.choose_backups(nodes, self.rank, n=2 - len(self.backups))
        self.backups += new
        for r in new:
            self.backup_pids[r] = self.ranks[r].pid
        self._do("standby", new, {"world": self.world, "epoch": self.epoch})
        if lost:
            self._refresh_ack()
            self._announce(quiet=True)
            log.info("standby controller(s) on rank(s) %s lost; new standby on %s", lost, new)

    def _maybe_promote(self, now: float) -> None:
        window = 3.0 * max(self.hb, 0.5)
        reachable = {r for r, i in self.ranks.items() if now - i.seen < window and i.alive}
        if self.rank is not None:
            reachable.add(self.rank)
        if not election.has_quorum(len(reachable), self.world):
            return
        self.standby = False
        self.epoch += 1
        self.machine = Machine(self._on_transition, state=S.NORMAL)
        for i in self.ranks.values():
            i.seen = max(i.seen, now)  # start the clocks now for ranks that have not come over yet
        for r in range(self.world):
            if r not in self.ranks:
                self.ranks[r] = Rank(rank=r, ident=b"", seen=now, progress_at=now)
        self._announce()
        self.events.emit("takeover", rank=self.rank, epoch=self.epoch, reachable=len(reachable))
        log.warning("controller takeover by rank %s (epoch %d): %d of %d ranks reachable",
                    self.rank, self.epoch, len(reachable), self.world)
        self._refresh_ack()
        deferred, self._deferred = self._deferred, []
        for rec in deferred:
            self._fault(rec["ranks"], rec["kind"], rec["iteration"], rec["phase"], rec["detect_s"],
                        rec["detail"], key=("deferred", tuple(rec["ranks"]), rec["kind"], rec["time"]))

    # ---- status -------------------------------------------------------------------------------
    def status(self) -> dict:
        now = time.monotonic()
        return {
            "state": self.machine.state.value, "epoch": self.epoch, "world_size": self.world,
            "controller": {"rank": self.rank, "pid": os.getpid(), "endpoint": self.endpoint,
                           "standby": self.standby},
            "backups": [{"rank": r, "endpoint": self.backup_eps.get(r)} for r in self.backups],
            "ranks": [{"rank": i.rank, "pid": i.pid, "node": i.node, "iteration": i.it, "phase": i.phase,
                       "update": i.upd, "health": i.health, "alive": i.alive, "done": i.done,
                       "last_seen_s": round(now - i.seen, 3), "replica_groups": i.groups}
                      for i in sorted(self.ranks.values(), key=lambda i: i.rank)],
            "agents": [{"node_rank": a.node_rank, "node": a.node, "ranks": a.ranks, "pids": a.pids}
                       for a in self.agents.values()],
            "faults": [{k: v for k, v in f.items() if k not in ("t_detect", "cpu_detect")} for f in self.faults],
            "dropped": dict(self.drops.counts),
        }


def run_standalone(log_dir: str, world_size: int, options: HAOptions, host: str | None = None,
                   port: int = 0) -> int:
    """``mindspeed-ha controller``: make the keys if needed, serve until the job is over."""
    keys = security.Keys.load(log_dir, options.key_dir, options.insecure, create=True)
    c = Controller(log_dir, world_size, options, keys, host=host, port=port).start()
    try:
        while not c.done.wait(0.5):
            pass
    except KeyboardInterrupt:
        c.close()
    if c.exit_code:
        print(c.last_diagnosis or c.diagnosis(), file=sys.stderr)
    return c.exit_code
