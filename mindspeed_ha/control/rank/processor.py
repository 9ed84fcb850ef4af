"""The processor: a thread on every rank that reports to the controller and runs its orders.

The training thread only touches plain attributes through the hooks (``step_start`` ...) and an
outbox; the processor thread owns the ZeroMQ socket (sockets are not thread-safe). Orders run by
where they must: ``stop``, ``exit`` and ``standby`` on the processor thread at once (they must work
while the training thread is blocked in a collective); the recovery's orders on the training thread,
parked after a fault (``serve_order``); the rest on a handler thread, so heartbeats go on meanwhile.
A handler returns its answer (any msgpack tree) or raises: the exception is the failed answer.

The processor never imports the controller: it is handed a factory (``controller_factory``, the
``Controller`` class where the rank may host one) and uses what it makes through ``HostedController``.
"""
from __future__ import annotations

import collections
import os
import queue
import socket as _socket
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, SupportsFloat

from ... import exitcodes
from ...events import EventLog, get_logger, setup_text_log
from ...options import WARM_UP_STEPS, HAOptions
from ..wire import protocol, security
from ..wire.board import ProgressBoard, board_path
from ..wire.discovery import JobStore, controller_is_external
from ..wire.hosts import this_host
from ..wire.link import ControllerLink, job_id_from_env

if TYPE_CHECKING:
    from mindspeed_ha.comm.stop import Stop

log = get_logger("control.processor")
# An order for the training thread not taken (or still running) this long: the thread is held somewhere
# (on the device, in a call that never returns, a restarted worker's set-up). Where it is goes to the
# log, the event log and the controller, whose "no answer" then says it.
HELD_REPORT_S = 10.0
# An order's handler: its arguments -> its answer (a msgpack tree, or a Later).
Handler = Callable[[dict[str, Any]], object]


class HostedController(Protocol):
    """What a rank's processor uses of the controller it hosts: rank 0's, or a standby."""
    standby: bool
    endpoint: str
    done: threading.Event

    def start(self) -> HostedController: ...
    def close(self, timeout: float = 2.0) -> None: ...
    def saw_epoch(self, epoch: int) -> None: ...
    def settle(self, rids: Iterable[str]) -> None: ...
    def order_takeover(self, args: dict[str, Any]) -> None: ...


# Makes the controller this rank hosts: (log dir, world size, options, keys, **where and how).
ControllerFactory = Callable[..., HostedController]


def _agent_node() -> dict[str, int]:
    """The node rank of the ``mindspeed-ha run`` agent that started this process (none: another
    launcher, which cannot restart it)."""
    node = os.environ.get("MINDSPEED_HA_AGENT_NODE", "")
    return {"agent_node": int(node)} if node.isdigit() else {}


class Later:
    """A handler's answer that is sent after the handler returns: the training loop has to run on
    first (a newcomer of Megatron-LM's loop builds its model before it can finish a scale-out).
    ``finish(fn)`` runs the rest and answers with its result (or its exception)."""

    def __init__(self) -> None:
        self._send: Callable[..., None] | None = None

    def finish(self, fn: Callable[[], object]) -> bool:
        assert self._send is not None  # (set when the handler that made it returned)
        try:
            data = fn()
        except Exception as e:
            log.exception("the rest of a handler failed")
            self._send(False, error=f"{type(e).__name__}: {e}")
            return False
        self._send(True, data=data)
        return True


class Processor:
    def __init__(self, rank: int, world_size: int, local_rank: int, node: str, options: HAOptions,
                 replica_groups: list[list[int]], events: EventLog | None = None,
                 controller_factory: ControllerFactory | None = None, stop: Stop | None = None):
        """``controller_factory``: makes the controller this rank hosts (rank 0's, or a standby when
        the controller names this rank); None: this rank hosts none. ``stop``: the rank's stop, which
        the controller's stop orders request and whose evidence heartbeats carry (None: the process's,
        ``comm.interruptible.PROCESS_STOP``)."""
        if stop is None:
            from mindspeed_ha.comm.interruptible import PROCESS_STOP
            stop = PROCESS_STOP
        self.stop = stop
        self.rank, self.world, self.local_rank, self.node = rank, world_size, local_rank, node or _socket.gethostname()
        self.options = options
        self.groups = [list(map(int, g)) for g in (replica_groups or []) if rank in g]
        self.log_dir = options.log_dir
        self.job_id = job_id_from_env()
        self.handlers: dict[str, Handler] = {}
        self.controller_factory = controller_factory
        self.controller: HostedController | None = None  # the controller hosted here (rank 0, or a standby)
        self.iteration = -1
        self.steps_done = 0   # steps this process has ended (its warm-up is the first few)
        # A step's own work (its time less the time blocked in collectives, waiting for slower peers):
        # what tells a straggler from the ranks it holds up. Summed between heartbeats.
        self.step_s = 0.0
        self._step_t0 = self._waited_t0 = 0.0
        self._busy_sum, self._busy_n = 0.0, 0
        self._busy_avg = 0.0   # its running average: a step far above it is reported at once
        self._judge_from = WARM_UP_STEPS + 1   # the first step whose own work counts (past a warm-up)
        self.updating = False
        self.phase = "startup"
        self.health = "ok"
        self.loss: float | None = None
        self.checkpoint = -1   # the newest iteration this rank saved
        self._progress = 0.0
        self._reports = 0      # fault reports made (each one's rid)
        # Reports of any rank that a controller settled: a standby hosted here learns them, so that
        # one re-sent to it after a takeover is not recovered twice.
        self.settled: set[str] = set()
        self._outbox: queue.SimpleQueue[bytes | tuple[bytes, str]] = queue.SimpleQueue()   # a frame, or a report and its rid
        self._work: queue.SimpleQueue[tuple[str, int, dict[str, Any]] | None] = queue.SimpleQueue()
        self._main: queue.SimpleQueue[tuple[str, int, dict[str, Any]]] = queue.SimpleQueue()   # orders for the training thread
        self._main_actions: set[str] = set()
        self._hb_on_step = self._hb_now = False
        self._done_ids: collections.deque[tuple[int, int]] = collections.deque(maxlen=256)
        self._closing = threading.Event()
        self._sent = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker: threading.Thread | None = None
        self.link: ControllerLink | None = None
        self.job_store: JobStore | None = None
        self.events: EventLog | None = events  # the rank's event log, when the caller has one open
        self.board: ProgressBoard | None = None
        # Whether the training thread is blocked in a collective (waiting for a peer, not stuck itself):
        # the stop's evidence, kept by the collectives that obey it.
        self.in_collective: Callable[[], bool] = stop.in_flight.waiting
        self.waited_s: Callable[[], float] = stop.in_flight.waited_s  # seconds blocked in collectives so far
        self._training_ident: int | None = None   # the training thread (its hooks are called there)
        self._queued_at: float | None = None      # an order for it waits since (monotonic)
        self.held = ""   # where it is held, while an order has waited (or run) HELD_REPORT_S (sent with heartbeats)
        self._held_seen = 0.0
        self._running: tuple[str, float] | None = None  # the order the training thread runs now, since (monotonic)

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
        in_rank0 = not controller_is_external()
        self.keys = security.Keys.load(self.log_dir, self.options.key_dir, self.options.insecure,
                                       create=(self.rank == 0 and in_rank0), job=self.job_id if in_rank0 else None)
        # A restarted rank 0 (recover) finds the controller that took over from its predecessor.
        restarted = int(os.environ.get("MINDSPEED_HA_RESTART_COUNT", "0") or 0) > 0
        self.job_store = JobStore.from_env()  # where the controller is announced to every node
        if self.rank == 0 and in_rank0 and not restarted and self.controller_factory is not None:
            self.controller = self.controller_factory(self.log_dir, self.world, self.options, self.keys, rank=0,
                                                      job_id=self.job_id, local_exit=self._exit_now,
                                                      job_store=self.job_store).start()
        self.link = ControllerLink(self.keys, self.log_dir, self.job_id, self._hello, self.options.heartbeat_s,
                                   name=f"rank {self.rank}", store=self.job_store)
        self._thread = threading.Thread(target=self._run, name="mindspeed-ha-processor", daemon=True)
        self._worker = threading.Thread(target=self._work_loop, name="mindspeed-ha-handlers", daemon=True)
        self._t_start = time.monotonic()
        self._thread.start()
        self._worker.start()
        self._handle_preemption()
        return self

    def _handle_preemption(self) -> None:
        """The scheduler's stop signal (SIGTERM, and mindspeed-ha run's --signals-to-handle) becomes a
        preemption report: the controller stops the job and writes its dying gasp within
        --ha-term-grace, then every process exits. A handler installed before ours (Megatron-LM's
        --exit-signal-handler) still runs. Only under mindspeed-ha run, which names the signals:
        torchrun also ends the survivors of a failed worker with SIGTERM, and that is no preemption."""
        import signal
        names = os.environ.get("MINDSPEED_HA_TERM_SIGNALS")
        if not names or threading.current_thread() is not threading.main_thread():
            return
        for name in filter(None, (n.strip() for n in names.split(","))):
            sig = getattr(signal, name, None)
            if sig is None or sig in (signal.SIGINT,):  # Ctrl-C reaches the agent; a rank leaves it to it
                continue
            previous = signal.getsignal(sig)

            def on_signal(signum: int, frame: FrameType | None, previous: object = previous) -> None:
                rid = f"{os.getpid()}.preempt"
                report = protocol.encode("preempt", signal=int(signum), rank=self.rank, pid=os.getpid(), rid=rid)
                self._outbox.put((report, rid))
                if callable(previous):
                    previous(signum, frame)
            signal.signal(sig, on_signal)

    def close(self, timeout: float = 10.0) -> None:
        """Leave cleanly: say bye (the controller then does not read our exit as a fault); the
        controller's host waits for the others to finish so no one loses its controller early."""
        if self._thread is None:
            return
        self._sent.clear()
        self._outbox.put(protocol.encode("bye", rank=self.rank, pid=os.getpid()))
        self._sent.wait(1.0)
        if self.controller is not None and not self.controller.standby:
            self.controller.done.wait(timeout)
        self._closing.set()
        self._work.put(None)
        self._thread.join(2.0)
        if self.controller is not None:
            self.controller.close()
        if self.job_store is not None:
            self.job_store.close()
        self._thread = None

    def serve(self, handlers: Mapping[str, Handler], training_thread: bool) -> None:
        """Take orders: ``handlers`` maps an action to ``fn(args) -> answer``.
        ``training_thread``: they need the training thread (collectives, the model): they wait in a
        queue until that thread, parked after a fault, runs ``serve_order``."""
        for action, fn in handlers.items():
            self.handlers[action] = fn
            (self._main_actions.add if training_thread else self._main_actions.discard)(action)

    # ---- hooks for the training loop (main thread) -------------------------------------------
    def _mark(self, phase: str) -> None:
        self.phase, self._progress = phase, time.time()
        if self.board is not None:
            self.board.write(self.iteration, phase)

    def await_controller(self) -> None:
        """Training does not start without a controller: a rank that trained unheard would have HA
        off without anyone knowing (a controller listening where this node cannot reach it). Waits up
        to --ha-register-timeout from the processor's start (normally the first ack came long
        before), then ends the process with 201 and a diagnosis."""
        assert self.link is not None  # (start() made it)
        deadline = self._t_start + self.options.register_timeout_s
        while not self.link.ever_active:
            if time.monotonic() > deadline:
                store = os.environ.get("MINDSPEED_HA_JOB_STORE")
                self._end_unheard(
                    f"mindspeed-ha: rank {self.rank} could not reach a controller within --ha-register-timeout "
                    f"{self.options.register_timeout_s:g} s (last tried: {self.link.endpoint or 'none announced'}"
                    f"{f'; controllers announce themselves in the job store at {store}' if store else ''}). "
                    "HA would be off, so the rank ends here. A controller listens on its node's address "
                    "(mindspeed-ha run: the route to --master-addr, or --local-addr): check that this node "
                    "reaches it (firewall, keys in --ha-key-dir).", exitcodes.NOT_REGISTERED)
            time.sleep(0.02)

    def _end_unheard(self, text: str, code: int) -> None:
        from mindspeed_ha.process import exit_now
        log.error("%s", text)
        if self.events:
            self.events.emit("diagnosis", text=text, exit_code=code)
        print(text, file=sys.stderr, flush=True)
        exit_now(code)

    def step_start(self, iteration: int) -> None:
        self._training_ident = threading.get_ident()
        self.iteration = int(iteration)
        self._step_t0, self._waited_t0 = time.perf_counter(), self.waited_s()
        self._mark("forward")

    def resumed(self) -> None:
        """After an in-place recovery: the rank is healthy again, and heartbeats as soon as the next
        step ends (the controller's MTTR ends there), not at the next heartbeat tick. The steps right
        after are a warm-up again (new communicators, a recomputed step, peers catching up): their own
        work is not counted."""
        self.health = "ok"
        self._hb_on_step = True
        self._busy_sum, self._busy_n, self._busy_avg = 0.0, 0, 0.0
        self._judge_from = self.steps_done + WARM_UP_STEPS + 1

    def saved(self, iteration: int) -> None:
        """This rank saved ``iteration`` (heartbeats carry the newest)."""
        self.checkpoint = int(iteration)

    def replica_group(self, group: list[int]) -> None:
        """This rank's replica group (job ranks) is ``group`` now (a new optimizer, a new layout)."""
        self.groups = [list(group)]

    def step_end(self, iteration: int, loss: SupportsFloat | None = None) -> None:
        self.iteration = int(iteration)
        self.steps_done += 1
        if self._step_t0:
            self.step_s = time.perf_counter() - self._step_t0
            own = max(0.0, self.step_s - (self.waited_s() - self._waited_t0))
            self._step_t0 = 0.0
            self._count_own_work(own)
        self._mark("step")
        if self._hb_on_step:
            self._hb_on_step = False
            self._hb_now = True
        if loss is not None:
            self.loss = float(loss)
            if self.loss != self.loss:
                self.health = "nan-loss"

    def _count_own_work(self, own: float) -> None:
        if self.steps_done < self._judge_from:
            return  # (a warm-up step allocates and connects: no measure of the rank's speed)
        self._busy_sum, self._busy_n = self._busy_sum + own, self._busy_n + 1
        if self.steps_done == self._judge_from:
            # Its first figure goes out at once: a straggler's first slow steps are then weighed
            # against every peer's figure, not dropped while the peers' first heartbeats are due.
            self._hb_now = True
        elif self._busy_avg and own > self.options.straggler_ratio * self._busy_avg:
            # Slower than itself lately: reported at once, alone (not averaged with the steps
            # before it), so that the controller counts straggling steps one by one.
            self._busy_sum, self._busy_n, self._hb_now = own, 1, True
        self._busy_avg = 0.9 * self._busy_avg + 0.1 * own if self._busy_avg else own

    def update_start(self, iteration: int) -> None:
        self.updating = True
        self._mark("optimizer")

    def update_end(self, iteration: int) -> None:
        self.updating, self._progress = False, time.time()

    def progressed(self) -> None:
        self._progress = time.time()

    def mark_phase(self, phase: str) -> None:
        """Optional finer progress marks (forward, backward, grad-sync, ...): they make hang
        attribution and the diagnosis precise."""
        self._mark(phase)

    def report_fault(self, kind: str, detail: str, iteration: int, phase: str) -> None:
        """A fault of this rank (``kind``: memory-error, comm-failure, other), sent at once and
        replayed to a successor if the controller dies meanwhile."""
        self.health = "faulty"
        if self.events:
            self.events.emit("exception", kind=kind, iteration=int(iteration), phase=phase, detail=detail)
        self._sent.clear()
        self._reports += 1
        rid = f"{os.getpid()}.fault.{self._reports}"
        report = protocol.encode("fault", rank=self.rank, kind=kind, iteration=int(iteration), phase=str(phase)[:64],
                                 detail=detail, at=time.time(), pid=os.getpid(), rid=rid)
        self._outbox.put((report, rid))
        self._sent.wait(1.0)  # handed to ZeroMQ before the caller may let the process die

    def serve_order(self, timeout: float) -> str | None:
        """The training thread, parked after a fault: run the next order meant for it (see
        ``serve``) and send the result. Returns the action's name, None on timeout."""
        self._training_ident = threading.get_ident()
        try:
            with self.stop.awaiting_orders():
                action, aid, args = self._main.get(timeout=timeout)
        except queue.Empty:
            return None
        queued, self._queued_at = self._queued_at, None if self._main.empty() else time.monotonic()
        if self.held:
            self.held = ""
            log.warning("rank %d: the training thread took %s at last, %.0fs after it came", self.rank, action,
                        time.monotonic() - queued if queued is not None else float("nan"))
        self._running = (action, time.monotonic())
        try:
            self._run_handler(action, aid, args)
        finally:
            self._running = None
            if self.held:
                self.held = ""
                log.warning("rank %d: the training thread's %s ended at last", self.rank, action)
        return action

    def report_held(self, why: str) -> None:
        """(any thread) The training thread will not reach the recovery (``why``: the stop's deadline
        passed after its abort): this rank is reported hung, with where that thread is, so that the
        controller replaces it (recover) or leaves it out (the dump)."""
        detail = f"{why}; it is in {thread_stack(self._training_ident)}; {self.stop.report()}"[:1500]
        self.held = detail
        log.error("rank %d: %s", self.rank, detail)
        if self.events:
            self.events.emit("held", detail=detail, deadline=True)
        self.report_fault("hang", detail, self.iteration, self.phase)

    def _check_held(self, now: float) -> None:
        """(processor thread) An order for the training thread waits, or one has run on it (a
        restarted worker's set-up among them): past HELD_REPORT_S, say where that thread is (its
        Python stack's innermost frames) and where the stop stands."""
        queued, running = self._queued_at, self._running
        if queued is not None and now - queued >= HELD_REPORT_S:
            what = f"has not taken the controller's order for {now - queued:.0f}s"
        elif running is not None and now - running[1] >= HELD_REPORT_S:
            what = f"has run the controller's {running[0]} order for {now - running[1]:.0f}s"
        else:
            return
        first = not self.held
        if not first and now - self._held_seen < 1.0:
            return
        self._held_seen = now
        self.held = (f"the training thread {what}; it is in {thread_stack(self._training_ident)}; "
                     f"{self.stop.report()}")[:1500]
        if first:
            log.warning("rank %d: %s", self.rank, self.held)
            if self.events:
                self.events.emit("held", detail=self.held)
            self._hb_now = True

    # ---- processor thread ---------------------------------------------------------------------
    def _hello(self) -> bytes:
        return protocol.encode("register", rank=self.rank, world=self.world, node=self.node, pid=os.getpid(),
                               local_rank=self.local_rank, groups=self.groups, host=this_host(),
                               iteration=self.iteration,
                               restarts=int(os.environ.get("MINDSPEED_HA_RESTART_COUNT", "0") or 0),
                               **_agent_node())

    def _run(self) -> None:
        assert self.link is not None and self.events is not None  # (start() made them before this thread)
        hb = self.options.heartbeat_s
        next_hb = 0.0
        was_active = False
        while not self._closing.is_set():
            try:
                self.link.maintain()
                while True:
                    try:
                        item = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    data, rid = item if isinstance(item, tuple) else (item, None)
                    self.link.send(data, rid=rid)
                    self._sent.set()
                now = time.monotonic()
                self._check_held(now)
                if now >= next_hb or self._hb_now:
                    next_hb, self._hb_now = now + hb, False
                    busy, n = self._busy_sum, self._busy_n
                    self._busy_sum, self._busy_n = 0.0, 0
                    self.link.send(protocol.encode("hb", rank=self.rank, it=self.iteration, upd=self.updating,
                                                   health=self.health, phase=self.phase, progress=self._progress,
                                                   wait=self.in_collective(), pid=os.getpid(), steps=self.steps_done,
                                                   **({"busy": busy / n} if n else {}),
                                                   **({"held": self.held} if self.held else {}),
                                                   **({"ckpt": self.checkpoint} if self.checkpoint >= 0 else {})))
                for msg in self.link.receive(20):
                    if msg["t"] == "do":
                        self._dispatch(msg)
                    elif msg["t"] == "settled":
                        self._settled(msg["rids"])
                if self.controller is not None and self.controller.standby:
                    self.controller.saw_epoch(self.link.epoch)
                if self.link.active and not was_active:
                    self.events.emit("controller", endpoint=self.link.endpoint, epoch=self.link.epoch)
                was_active = self.link.active
                unheard = now - self.link.active_at
                if self.link.ever_active and not self.link.active and unheard > self.options.register_timeout_s:
                    self._end_unheard(
                        f"mindspeed-ha: rank {self.rank} has heard from no controller for {unheard:.0f} s "
                        f"(--ha-register-timeout {self.options.register_timeout_s:g} s; last: {self.link.endpoint}): "
                        "this node is cut off from the job (a partition, or the controller's side is gone). "
                        "The job goes on without it on the side that reaches the job store, or ended there; "
                        "this rank ends here.", exitcodes.FAULT)
            except Exception:
                log.exception("processor loop error (continuing)")
                time.sleep(0.1)
        self.link.close()

    def _dispatch(self, msg: dict[str, Any]) -> None:
        action, aid, args = msg["action"], msg["id"], msg.get("args", {})
        key = (msg["epoch"], aid)
        if aid and key in self._done_ids:
            return  # re-sent after a reconnection, already taken
        self._done_ids.append(key)
        assert self.events is not None  # (start() opened it)
        self.events.emit("action", action=action, id=aid, args={k: v for k, v in args.items() if k != "diagnosis"})
        if action == "exit":
            if not aid and args.get("diagnosis"):  # (aid 0: an order to this process alone, e.g. fenced)
                log.error("%s", args["diagnosis"])
            self._result(action, aid, True, data="exiting")
            self._exit_now(int(args.get("code", 1)), flush_link=True)
        elif action in ("stop", "standby", "takeover", "reconnect"):
            self._run_handler(action, aid, args)
        elif action in self._main_actions:
            if self._queued_at is None:
                self._queued_at = time.monotonic()
            self._main.put((action, aid, args))
        else:
            self._work.put((action, aid, args))

    def _run_handler(self, action: str, aid: int, args: dict[str, Any]) -> None:
        fn = self.handlers.get(action) or {"stop": self._stop_collectives, "standby": self._stand_by,
                                           "takeover": self._take_over, "reconnect": self._reconnect}.get(action)
        if fn is None:
            self._result(action, aid, False, error=f"no handler for {action!r} on rank {self.rank}")
            return
        try:
            answer = fn(args)
        except Exception as e:
            log.exception("handler %s failed", action)
            self._result(action, aid, False, error=f"{type(e).__name__}: {e}")
            return
        if isinstance(answer, Later):
            answer._send = lambda ok, data=None, error="": self._result(action, aid, ok, data=data, error=error)
            return
        self._result(action, aid, True, data=answer)

    def _result(self, action: str, aid: int, ok: bool, data: object = None, error: str = "") -> None:
        fields = {"data": data} if ok and data is not None else {"error": error} if not ok else {}
        try:
            msg = protocol.encode("result", rank=self.rank, action=action, id=aid, ok=ok, pid=os.getpid(), **fields)
        except protocol.ProtocolError as e:  # a handler's answer that is not a msgpack tree
            msg = protocol.encode("result", rank=self.rank, action=action, id=aid, ok=False,
                                  error=f"rank {self.rank} could not send its answer to {action}: {e}")
        if threading.current_thread() is self._thread:
            assert self.link is not None  # (its thread runs only with it)
            self.link.send(msg)
        else:
            self._outbox.put(msg)

    def _work_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            self._run_handler(*item)

    # ---- the processor's own orders -----------------------------------------------------------
    def _stop_collectives(self, args: dict[str, Any]) -> str:
        reason = str(args.get("reason", "controller"))
        if args.get("boundary"):  # planned: between two steps; stopped mid-step only if held up there
            self.stop.park.request(reason, grace_s=max(1.0, 3 * self.step_s))
            return "park requested"
        self.stop.request(reason)
        return "stop requested"

    def _stand_by(self, args: dict[str, Any]) -> str:
        if self.controller is None:
            if self.controller_factory is None:
                raise RuntimeError(f"rank {self.rank} was given no controller to host, so it cannot stand by")
            self.controller = self.controller_factory(
                self.log_dir, self.world, self.options, self.keys, rank=self.rank, standby=True,
                epoch=int(args.get("epoch", 1)), job_id=self.job_id, local_exit=self._exit_now,
                job_store=self.job_store, previous=int(args.get("controller", -1)), settled=self.settled).start()
        return self.controller.endpoint

    def _settled(self, rids: list[str]) -> None:
        self.settled.update(rids)
        if self.controller is not None and self.controller.standby:
            self.controller.settle(rids)

    def _take_over(self, args: dict[str, Any]) -> str:
        """The active controller hands itself over to this standby (its host is to be migrated)."""
        if self.controller is None or not self.controller.standby:
            raise RuntimeError(f"rank {self.rank} runs no standby controller")
        self.controller.order_takeover(dict(args))  # (its own thread promotes it)
        return self.controller.endpoint

    def _reconnect(self, args: dict[str, Any]) -> str:
        """The controller moved (a handover): go there now."""
        assert self.link is not None  # (orders come through it)
        self.link.switch(str(args["endpoint"]))
        return "reconnecting"

    def _exit_now(self, code: int, flush_link: bool = False) -> None:
        from mindspeed_ha.process import exit_now
        if self.events:
            self.events.emit("exit", code=code)
        if flush_link and self.link is not None:
            self.link.close()  # linger: the result above leaves before we go
        exit_now(code)


def thread_stack(ident: int | None, frames: int = 6) -> str:
    """A thread's innermost Python frames, innermost first ("func (file:line) <- ..."); what it
    runs below Python (a device sync, a collective's set-up) is inside the first one."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "an unknown place (the thread is gone, or never ran a step)"
    out: list[str] = []
    while frame is not None and len(out) < frames:
        code = frame.f_code
        out.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})")
        frame = frame.f_back
    return " <- ".join(out)
