"""The processor: a thread on every rank that reports to the controller and runs its actions.

The main (training) thread only touches plain attributes through the hooks (``step_start`` ...) and
an outbox; the processor thread owns the ZeroMQ socket (sockets are not thread-safe). Actions run
through handlers registered by name; ``exit`` and ``stop`` run on the processor thread at once
(they must work while the main thread is blocked in a collective), the others on a handler thread
so heartbeats go on while a long repair runs.
"""
from __future__ import annotations

import collections
import logging
import mmap
import os
import queue
import socket as _socket
import struct
import threading
import time

import zmq

from ..events import EventLog, get_logger, setup_text_log
from ..options import HAOptions
from ..faults import classify as engine_classify
from . import election, protocol as P, security

log = get_logger("control.processor")
INLINE_ACTIONS = ("stop", "exit", "standby")

def classify(exc: BaseException) -> str:
    """memory-error / comm-failure / other, by the engine's classifier (mindspeed_ha.faults: it knows
    the UCE/ECC markers, and that running out of memory is not a memory fault)."""
    return {"memory": "memory-error", "comm": "comm-failure"}.get(engine_classify(exc), "other")


class ProgressBoard:
    """Iteration and phase of a rank in a small shared-memory file the agent reads when the rank
    dies: exact even for a SIGKILL between two heartbeats, and a few microseconds per hook."""
    FMT = struct.Struct("<qq40s")  # iteration, sequence, phase

    def __init__(self, path: str, create: bool = True):
        self.path = path
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, self.FMT.size)
            self.mm = mmap.mmap(fd, self.FMT.size)
        finally:
            os.close(fd)
        self.seq = 0

    def write(self, iteration: int, phase: str) -> None:
        self.seq += 1
        self.mm[:] = self.FMT.pack(int(iteration), self.seq, phase.encode()[:40])

    @classmethod
    def read(cls, path: str) -> tuple[int, str] | None:
        try:
            with open(path, "rb") as f:
                it, seq, ph = cls.FMT.unpack(f.read(cls.FMT.size))
        except (OSError, struct.error):
            return None
        return (it, ph.rstrip(b"\0").decode(errors="replace")) if seq else None


def board_path(rank: int) -> str | None:
    d = os.environ.get("MINDSPEED_HA_PROGRESS_DIR")
    return os.path.join(d, f"rank_{rank}") if d else None


def job_id_from_env() -> str | None:
    return os.environ.get("MINDSPEED_HA_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or None


class ControllerLink:
    """A DEALER connection to whichever controller is active, with failover.

    ``hello()`` returns the registration frame, resent on every new connection; frames sent with
    ``replay=True`` (fault and exit reports) are resent after it too, so a report made while the
    controller was dying reaches its successor (controllers de-duplicate)."""

    def __init__(self, keys: security.Keys, log_dir: str, job_id: str | None, hello, heartbeat_s: float,
                 name: str = "processor", ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.keys, self.hello, self.name = keys, hello, name
        self.cands = election.Candidates(log_dir, job_id, answer_wait=max(1.0, 2 * heartbeat_s),
                                         standby_wait=max(4.0, 8 * heartbeat_s))
        # A starved controller is slow, not dead, and so is a starved processor thread that did not
        # read its acks (8 ranks on 2 cores: > 3 s seen); switching then loses orders in flight.
        self.lost_after = max(6 * heartbeat_s, 6.0)
        self.sock: zmq.Socket | None = None
        self.endpoint: str | None = None
        self.epoch = 0
        self.active = False          # answered by a controller that is not a standby
        self.answered = False
        self._t_connect = self._last_heard = self._standby_since = 0.0
        self._replay: collections.deque = collections.deque(maxlen=64)
        self.drops = P.DropCounter(log)
        self.ever_active = False
        self.state = ""              # the controller's state in its last ack

    def _connect(self, ep: str) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 500
        s.maxmsgsize = P.MAX_BYTES + 1024
        s.handshake_ivl = 300_000  # a controller busy with a thousand handshakes is slow, not dead
        security.secure_client(s, self.keys)
        s.connect(ep)
        self.sock, self.endpoint = s, ep
        self.answered = self.active = False
        self._t_connect = time.monotonic()
        self._standby_since = 0.0
        self._send_raw(self.hello())
        for data in list(self._replay):
            self._send_raw(data)

    def _send_raw(self, data: bytes) -> None:
        try:
            self.sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def send(self, data: bytes, replay: bool = False) -> None:
        if replay:
            self._replay.append(data)
        if self.sock is not None:
            self._send_raw(data)

    def maintain(self) -> None:
        now = time.monotonic()
        if self.sock is None:
            ep = self.cands.next(None)
            if ep:
                self._connect(ep)
            return
        why = None
        if not self.answered and now - self._t_connect > self.cands.answer_wait:
            why = "no answer"
        elif self.answered and not self.active and now - self._standby_since > self.cands.standby_wait:
            why = "standby without quorum"
        elif self.active and now - self._last_heard > self.lost_after:
            why = f"silent for {now - self._last_heard:.1f}s"
        if why:
            ep = self.cands.next(self.endpoint)
            if self.active and self.state not in ("done", "exit"):
                log.warning("%s lost controller %s (%s); trying %s", self.name, self.endpoint, why, ep)
            if ep:
                self._connect(ep)

    def receive(self, timeout_ms: int) -> list[dict]:
        if self.sock is None:
            time.sleep(timeout_ms / 1000)
            return []
        out = []
        if not self.sock.poll(timeout_ms):
            return out
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = P.decode(data)
            except P.ProtocolError as e:
                self.drops.drop("malformed", str(e))
                continue
            now = time.monotonic()
            t = msg["t"]
            if t == "ack":
                self._last_heard = now
                if not self.answered:
                    self.answered = True
                if msg.get("standby"):
                    if not self._standby_since:
                        self._standby_since = now
                    self.active = False
                else:
                    if not self.active:
                        log.info("%s connected to controller %s (epoch %d)", self.name, self.endpoint, msg["epoch"])
                    self.active = self.ever_active = True
                    self.epoch = msg["epoch"]
                    self.state = msg["state"]
                    self.cands.connected(self.endpoint, msg["epoch"])
                if msg.get("backups"):
                    self.cands.backups = list(msg["backups"])
            elif t == "refused":
                self._last_heard = now
                self._send_raw(self.hello())
            elif t == "do":
                self._last_heard = now
                out.append(msg)
            else:
                out.append(msg)
        return out

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=300)
            self.sock = None


class Processor:
    def __init__(self, rank: int, world_size: int, local_rank: int, node: str, options: HAOptions,
                 replica_groups: list[list[int]], events: EventLog | None = None):
        self.rank, self.world, self.local_rank, self.node = rank, world_size, local_rank, node or _socket.gethostname()
        self.options = options
        self.groups = [list(map(int, g)) for g in (replica_groups or []) if rank in g]
        self.log_dir = options.log_dir
        self.job_id = job_id_from_env()
        self.handlers: dict[str, callable] = {}
        self.controller = None         # the Controller hosted here (rank 0, or a standby)
        self.iteration = -1
        self.updating = False
        self.phase = "startup"
        self.health = "ok"
        self.loss = None
        self._progress = 0.0
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._main: queue.SimpleQueue = queue.SimpleQueue()   # orders for the training thread
        self._main_actions: set[str] = set()
        self._hb_on_step = self._hb_now = False
        self._done_ids: collections.deque = collections.deque(maxlen=256)
        self._stop = threading.Event()
        self._sent = threading.Event()
        self._thread = self._worker = None
        self.link: ControllerLink | None = None
        self.events: EventLog | None = events  # the rank's event log, when the caller has one open
        self.board: ProgressBoard | None = None

    # ---- life ---------------------------------------------------------------------------------
    def start(self) -> "Processor":
        setup_text_log(self.log_dir, self.rank)
        self.events = self.events or EventLog.for_rank(self.log_dir, self.rank)
        path = board_path(self.rank)
        if path:
            try:
                self.board = ProgressBoard(path)
            except OSError as e:
                log.warning("no progress board at %s: %s", path, e)
        mode = os.environ.get("MINDSPEED_HA_CONTROLLER", "rank0")
        self.keys = security.Keys.load(self.log_dir, self.options.key_dir, self.options.insecure,
                                       create=(self.rank == 0 and mode == "rank0"))
        # A restarted rank 0 (recover) finds the controller that took over from its predecessor.
        restarted = int(os.environ.get("MINDSPEED_HA_RESTART_COUNT", "0") or 0) > 0
        if self.rank == 0 and mode == "rank0" and not restarted:
            from .controller import Controller
            self.controller = Controller(self.log_dir, self.world, self.options, self.keys, rank=0,
                                         job_id=self.job_id, local_exit=self._exit_now).start()
        self.link = ControllerLink(self.keys, self.log_dir, self.job_id, self._hello, self.options.heartbeat_s,
                                   name=f"rank {self.rank}")
        self._thread = threading.Thread(target=self._run, name="mindspeed-ha-processor", daemon=True)
        self._worker = threading.Thread(target=self._work_loop, name="mindspeed-ha-handlers", daemon=True)
        self._thread.start()
        self._worker.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Leave cleanly: say bye (the controller then does not read our exit as a fault); the
        controller's host waits for the others to finish so no one loses its controller early."""
        if self._thread is None:
            return
        self._sent.clear()
        self._outbox.put(P.encode("bye", rank=self.rank))
        self._sent.wait(1.0)
        if self.controller is not None and not self.controller.standby:
            self.controller.done.wait(timeout)
        self._stop.set()
        self._work.put(None)
        self._thread.join(2.0)
        if self.controller is not None:
            self.controller.close()
        self._thread = None

    def register_handler(self, action: str, fn, main_thread: bool = False) -> None:
        """``fn(args: dict) -> (ok: bool, detail: str) | None``; a raised exception means not ok.

        ``main_thread``: the action needs the training thread (it runs collectives or touches the
        model): it waits in a queue until that thread, parked after a fault, runs ``serve_order``."""
        self.handlers[action] = fn
        if main_thread:
            self._main_actions.add(action)
        else:
            self._main_actions.discard(action)

    # ---- hooks for the training loop (main thread) -------------------------------------------
    def _mark(self, phase: str) -> None:
        self.phase, self._progress = phase, time.time()
        if self.board is not None:
            self.board.write(self.iteration, phase)

    def step_start(self, iteration: int) -> None:
        self.iteration = int(iteration)
        self._mark("forward")

    def report_next_step(self) -> None:
        """After an in-place recovery: heartbeat as soon as the next step ends (the controller's
        MTTR ends there), not at the next heartbeat tick."""
        self._hb_on_step = True

    def step_end(self, iteration: int, loss=None) -> None:
        self.iteration = int(iteration)
        self._mark("step")
        if self._hb_on_step:
            self._hb_on_step = False
            self._hb_now = True
        if loss is not None:
            self.loss = float(loss)
            if self.loss != self.loss:
                self.health = "nan-loss"

    def update_start(self, iteration: int) -> None:
        self.updating = True
        self._mark("optimizer")

    def update_end(self, iteration: int) -> None:
        self.updating, self._progress = False, time.time()

    def mark_phase(self, phase: str) -> None:
        """Optional finer progress marks (forward, backward, grad-sync, ...): they make hang
        attribution and the diagnosis precise."""
        self._mark(phase)

    def report_exception(self, exc: BaseException, iteration: int, phase: str) -> str:
        kind = classify(exc)
        if type(exc).__name__ == "CollectiveStopped":
            return "stopped"  # we stopped it ourselves: not a new fault
        self.health = "faulty"
        detail = f"{type(exc).__name__}: {exc}"[:1000]
        if self.events:
            self.events.emit("exception", kind=kind, iteration=int(iteration), phase=phase, detail=detail)
        self._sent.clear()
        self._outbox.put((P.encode("fault", rank=self.rank, kind=kind, iteration=int(iteration),
                                   phase=str(phase)[:64], detail=detail, at=time.time()), True))
        self._sent.wait(1.0)  # handed to ZeroMQ before the caller may let the process die
        return kind

    def serve_order(self, timeout: float) -> str | None:
        """The training thread, parked after a fault: run the next order meant for it (see
        ``register_handler``) and send the result. Returns the action's name, None on timeout."""
        try:
            action, aid, args = self._main.get(timeout=timeout)
        except queue.Empty:
            return None
        self._run_handler(action, aid, args)
        return action

    # ---- processor thread ---------------------------------------------------------------------
    def _hello(self) -> bytes:
        return P.encode("register", rank=self.rank, world=self.world, node=self.node, pid=os.getpid(),
                        local_rank=self.local_rank, groups=self.groups, host=_socket.gethostname(),
                        iteration=self.iteration)

    def _run(self) -> None:
        hb = self.options.heartbeat_s
        next_hb = 0.0
        was_active = False
        while not self._stop.is_set():
            try:
                self.link.maintain()
                while True:
                    try:
                        item = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    data, replay = item if isinstance(item, tuple) else (item, False)
                    self.link.send(data, replay=replay)
                    self._sent.set()
                now = time.monotonic()
                if now >= next_hb or self._hb_now:
                    next_hb, self._hb_now = now + hb, False
                    self.link.send(P.encode("hb", rank=self.rank, it=self.iteration, upd=self.updating,
                                            health=self.health, phase=self.phase, progress=self._progress))
                for msg in self.link.receive(20):
                    if msg["t"] == "do":
                        self._dispatch(msg)
                if self.link.active and not was_active:
                    self.events.emit("controller", endpoint=self.link.endpoint, epoch=self.link.epoch)
                was_active = self.link.active
            except Exception:
                log.exception("processor loop error (continuing)")
                time.sleep(0.1)
        self.link.close()

    def _dispatch(self, msg: dict) -> None:
        action, aid, args = msg["action"], msg["id"], msg.get("args", {})
        key = (msg["epoch"], aid)
        if aid and key in self._done_ids:
            return  # re-sent after a reconnection, already taken
        self._done_ids.append(key)
        self.events.emit("action", action=action, id=aid, args={k: v for k, v in args.items() if k != "diagnosis"})
        if action == "exit":
            self._result(action, aid, True, "exiting")
            self._exit_now(int(args.get("code", 1)), flush_link=True)
        elif action in INLINE_ACTIONS:
            self._run_handler(action, aid, args)
        elif action in self._main_actions:
            self._main.put((action, aid, args))
        else:
            self._work.put((action, aid, args))

    def _run_handler(self, action, aid, args) -> None:
        fn = self.handlers.get(action) or getattr(self, f"_builtin_{action}", None)
        if fn is None:
            self._result(action, aid, False, f"no handler for {action!r} on rank {self.rank}")
            return
        try:
            res = fn(args)
            ok, detail = res if isinstance(res, tuple) else (True, "" if res is None else str(res))
        except Exception as e:
            log.exception("handler %s failed", action)
            ok, detail = False, f"{type(e).__name__}: {e}"
        self._result(action, aid, bool(ok), str(detail)[:1000])

    def _result(self, action, aid, ok, detail="") -> None:
        data = P.encode("result", rank=self.rank, action=action, id=aid, ok=ok, detail=detail)
        if threading.current_thread() is self._thread:
            self.link.send(data)
        else:
            self._outbox.put(data)

    def _work_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            self._run_handler(*item)

    # ---- built-in handlers --------------------------------------------------------------------
    def _builtin_stop(self, args):
        try:
            from mindspeed_ha.comm.interruptible import request_stop
        except ImportError:
            return True, "no interruptible collectives in this build; nothing to stop"
        request_stop(str(args.get("reason", "controller")))
        return True, "stop requested"

    def _builtin_standby(self, args):
        from .controller import Controller
        if self.controller is None:
            self.controller = Controller(self.log_dir, self.world, self.options, self.keys, rank=self.rank,
                                         standby=True, epoch=int(args.get("epoch", 1)), job_id=self.job_id,
                                         local_exit=self._exit_now).start()
        return True, self.controller.endpoint

    def _exit_now(self, code: int, flush_link: bool = False) -> None:
        try:
            if self.events:
                self.events.emit("exit", code=code)
            for h in logging.getLogger("mindspeed_ha").handlers:
                h.flush()
            if flush_link and self.link is not None:
                self.link.close()  # linger: the result above leaves before we go
            import multiprocessing
            for child in multiprocessing.active_children():  # e.g. the checkpoint writer's manager
                child.terminate()
        finally:
            os._exit(code)
