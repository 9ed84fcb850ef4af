"""The processor: a thread on every rank that reports to the controller and runs its orders.

The training thread only touches plain attributes through the hooks (``step_start`` ...) and an
outbox; the processor thread owns the ZeroMQ socket (sockets are not thread-safe) and sends the
heartbeats. Its parts: the orders, each run where it must and answered (``serving``); the controller
the rank may host (``hosting``); a step's own work, for straggler detection (``own_work``); where the
training thread is held (``held``); how the process ends and the stop signals (``ending``). The
processor never imports the controller: it is handed a factory (``controller_factory``) and uses
what it makes through ``hosting.HostedController``.
"""
from __future__ import annotations

import os
import queue
import socket as _socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, SupportsFloat

from ... import exitcodes
from ...control.wire import protocol, security
from ...control.wire.board import ProgressBoard, board_path
from ...control.wire.discovery import JobStore, controller_is_external
from ...control.wire.hosts import this_host
from ...control.wire.link import ControllerLink, job_id_from_env
from ...events import EventLog, get_logger, setup_text_log
from ...options import HAOptions
from . import ending
from .held import HELD_REPORT_S, HeldWatch  # noqa: F401  (HELD_REPORT_S: read here by tests and tools)
from .hosting import ControllerFactory, ControllerHost
from .long_wait import LongWait, default_group_rank
from .own_work import OwnWork
from .relay import RELAYED, AgentRelay
from .serving import Orders

if TYPE_CHECKING:
    from mindspeed_ha.comm.stop import Stop

log = get_logger("control.processor")


class Outbox:
    """What other threads give the processor thread to send (a frame, or a report and its rid): it
    is woken for each (``ControllerLink.wake``) and sends it at once, not when its wait for the
    controller's next message runs out (the answers of a recovery's rounds, a fault report, the
    heartbeat that ends a recovery's MTTR: each waited up to 20 ms)."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[tuple[bytes, str | None, bool]] = queue.SimpleQueue()
        self.link: ControllerLink | None = None   # (the processor's, once it started)

    def put(self, data: bytes, rid: str | None = None, relay: bool = False) -> None:
        """``relay``: an answer to an order that came through the agent's relay, to go back there."""
        self._items.put((data, rid, relay))
        self.wake()

    def wake(self) -> None:
        if self.link is not None:
            self.link.wake()

    def drain(self) -> Iterator[tuple[bytes, str | None, bool]]:
        while True:
            try:
                yield self._items.get_nowait()
            except queue.Empty:
                return


def register_frame(rank: int, world: int, node: str, local_rank: int, groups: list[list[int]],
                   iteration: int, strategies: Iterable[str] = ()) -> bytes:
    """What a rank says to each controller it connects to: who it is, where, its replica groups,
    how far it trained, how often it was restarted, the node rank of the ``mindspeed-ha run`` agent
    that started it (none: another launcher, which cannot restart it) and the strategies it enables
    (a controller of its own process has them from the ranks only)."""
    agent = os.environ.get("MINDSPEED_HA_AGENT_NODE", "")
    return protocol.encode("register", rank=rank, world=world, node=node, pid=os.getpid(),
                           local_rank=local_rank, groups=groups, host=this_host(), iteration=iteration,
                           restarts=int(os.environ.get("MINDSPEED_HA_RESTART_COUNT", "0") or 0),
                           strategies=sorted(strategies), **({"agent_node": int(agent)} if agent.isdigit() else {}))


def heartbeat_frame(p: Processor, now: bool = False) -> bytes:
    """What a rank tells its controller at each heartbeat: how far it trained, where in its step it
    is and when it last moved, its health, whether it waits in a collective, its steps' own work (for
    straggler detection), where its training thread is held, its newest checkpoint. ``now``: one
    its agent is to pass on at once (it ends a recovery, says where the rank is held)."""
    busy, stalled = p.work.take(), p.long_wait.report()
    return protocol.encode("hb", rank=p.rank, it=p.iteration, upd=p.updating, health=p.health, phase=p.phase,
                           progress=p.progress, wait=p.in_collective(), pid=os.getpid(), steps=p.work.steps_done,
                           **({"now": True} if now else {}),
                           **({"busy": busy} if busy is not None else {}), **({"held": p.held} if p.held else {}),
                           **({"ckpt": p.checkpoint} if p.checkpoint >= 0 else {}),
                           **({"desync": stalled} if stalled is not None else {}))


def send_heartbeat(p: Processor, now: float) -> float:
    """Sends the rank's heartbeat: through its agent, directly, or both ways (``AgentRelay.beat``);
    returns when the next is due."""
    assert p.link is not None
    beat = heartbeat_frame(p, now=p._hb_now and p.relay is not None)
    p._hb_now = False
    if p.relay is None or p.relay.beat(beat, p.link, now):
        p.link.send(beat)
    return p.relay.next_beat(now) if p.relay is not None else now + p.options.heartbeat_s


def fault_frame(rank: int, kind: str, detail: str, iteration: int, phase: str, rid: str,
                entered: dict[str, Any] | None, fault_class: str, frame: str) -> bytes:
    """A fault report (``Processor.report_fault``); ``rid``: its id, which a successor controller
    uses to drop a replayed copy."""
    return protocol.encode("fault", rank=rank, kind=kind, iteration=int(iteration), phase=str(phase)[:64],
                           detail=detail, at=time.time(), pid=os.getpid(), rid=rid, frame=frame[:1000],
                           **({"entered": entered} if entered is not None else {}), **{"class": fault_class})


class Processor:
    def __init__(self, rank: int, world_size: int, local_rank: int, node: str, options: HAOptions,
                 replica_groups: list[list[int]], events: EventLog | None = None,
                 controller_factory: ControllerFactory | None = None, stop: Stop | None = None):
        """``controller_factory``: makes the controller this rank may host (``hosting``; None: it hosts
        none). ``stop``: the rank's stop, which the controller's stop orders request and whose evidence
        heartbeats carry (None: the process's, ``comm.interruptible.PROCESS_STOP``, reached when first
        used: the processor imports no torch)."""
        self._stop = stop
        self.rank, self.world, self.local_rank, self.node = rank, world_size, local_rank, node or _socket.gethostname()
        self.options = options
        self.groups = [list(map(int, g)) for g in (replica_groups or []) if rank in g]
        self.log_dir = options.log_dir
        self.job_id = job_id_from_env()
        self.host = ControllerHost(controller_factory, rank)  # the controller hosted here (rank 0, a standby)
        self.iteration, self.updating, self.phase, self.health = -1, False, "startup", "ok"
        self.loss: float | None = None
        self.checkpoint = -1   # the newest iteration this rank saved
        self.progress = 0.0    # when training last moved (a step's phase, an update's end)
        self._reports = 0      # fault reports made (each one's rid)
        self._outbox = Outbox()
        self._hb_on_step = self._hb_now = False
        self._closing, self._sent = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._worker: threading.Thread | None = None
        self.link: ControllerLink | None = None
        self.relay: AgentRelay | None = None   # its agent's relay, under mindspeed-ha run --relay
        self.job_store: JobStore | None = None
        self.events: EventLog | None = events  # the rank's event log, when the caller has one open
        self.board: ProgressBoard | None = None
        # Whether the training thread waits in a collective (for a peer, not stuck itself): the stop's evidence.
        # (none handed: a process of the control plane's tests and tools, with no collectives to wait in)
        self.in_collective: Callable[[], bool] = stop.in_flight.waiting if stop else (lambda: False)
        self.work = OwnWork(options.straggler_ratio, stop.in_flight.waited_s if stop else (lambda: 0.0))
        self.long_wait = LongWait(options.desync_after_s, self.in_collective, stop.issued.evidence if stop else dict,
                                  default_group_rank)
        self.watch = HeldWatch(lambda: self.stop.report())
        self.orders = Orders(rank, {"stop": self._stop_collectives, "standby": self.host.stand_by,
                                    "takeover": self.host.take_over, "reconnect": self._reconnect,
                                    "entered": lambda a: "taken" if self.stop.entered.take(a.get("entered"))
                                    else "not aligned"},
                             self._send_answer, self.watch, lambda: self.stop.awaiting_orders())
        # Taking orders (``Orders.serve``) and the training thread's running its next one, parked after a
        # fault (``Orders.serve_order``), are the orders' own: no call of the processor's in between.
        self.serve, self.serve_order = self.orders.serve, self.orders.serve_order

    @property
    def stop(self) -> Stop:
        if self._stop is None:
            from mindspeed_ha.comm.interruptible import PROCESS_STOP
            self._stop = PROCESS_STOP
        return self._stop

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
        self.host.configure(self.log_dir, self.world, self.options, self.keys, job_id=self.job_id,
                            local_exit=self._exit_now, job_store=self.job_store)
        if self.rank == 0 and in_rank0 and not restarted:
            self.host.start_first()
        self.link = ControllerLink(self.keys, self.log_dir, self.job_id, lambda: register_frame(
                                       self.rank, self.world, self.node, self.local_rank, self.groups, self.iteration,
                                       self.options.strategies),
                                   self.options.heartbeat_s, name=f"rank {self.rank}", store=self.job_store)
        self._outbox.link = self.link
        self.relay = AgentRelay.from_env(self.rank, self.link)
        self._thread = threading.Thread(target=self._run, name="mindspeed-ha-processor", daemon=True)
        self._worker = threading.Thread(target=self.orders.work_loop, name="mindspeed-ha-handlers", daemon=True)
        self._t_start = time.monotonic()
        self._thread.start()
        self._worker.start()
        ending.report_stop_signals(self.rank, self._outbox.put)
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Leave cleanly: say bye (the controller then does not read our exit as a fault); the
        controller's host waits for the others to finish so no one loses its controller early."""
        if self._thread is None:
            return
        self._sent.clear()
        self._outbox.put(protocol.encode("bye", rank=self.rank, pid=os.getpid()))
        self._sent.wait(1.0)
        self.host.wait_done(timeout)
        self._closing.set()
        self.orders.close()
        self._thread.join(2.0)
        self.host.close()
        if self.job_store is not None:
            self.job_store.close()
        self._thread = None

    # ---- hooks for the training loop (main thread) -------------------------------------------
    def _mark(self, phase: str) -> None:
        self.phase, self.progress = phase, time.time()
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
                ending.end(self.events, exitcodes.NOT_REGISTERED,
                           ending.never_reached(self.rank, self.options.register_timeout_s, self.link.endpoint))
            time.sleep(0.02)

    def step_start(self, iteration: int) -> None:
        self.watch.on_training_thread()
        self.iteration = int(iteration)
        self.work.step_start()
        self._mark("forward")

    def resumed(self) -> None:
        """After an in-place recovery: healthy again; a heartbeat as soon as the next step ends (the
        controller's MTTR ends there), not at the next tick; the next steps' own work is a warm-up again."""
        self.health = "ok"
        self._hb_on_step = True
        self.work.warm_up_again()

    def saved(self, iteration: int) -> None:
        """This rank saved ``iteration`` (heartbeats carry the newest)."""
        self.checkpoint = int(iteration)

    def replica_group(self, group: list[int]) -> None:
        """This rank's replica group (job ranks) is ``group`` now (a new optimizer, a new layout)."""
        self.groups = [list(group)]

    def step_end(self, iteration: int, loss: SupportsFloat | None = None) -> None:
        self.iteration = int(iteration)
        counted_now = self.work.step_end()  # (a first figure, or a slow step: sent at once)
        self._mark("step")
        if self._hb_on_step or counted_now:
            self._hb_on_step, self._hb_now = False, True
            self._outbox.wake()
        if loss is not None:
            self.loss = float(loss)
            if self.loss != self.loss:
                self.health = "nan-loss"

    def update_start(self, iteration: int) -> None:
        self.updating = True
        self._mark("optimizer")

    def update_end(self, iteration: int) -> None:
        self.updating, self.progress = False, time.time()

    def progressed(self) -> None:
        self.progress = time.time()

    def mark_phase(self, phase: str) -> None:
        """Optional finer progress marks (forward, backward, grad-sync, ...): they make hang
        attribution and the diagnosis precise."""
        self._mark(phase)

    def report_fault(self, kind: str, detail: str, iteration: int, phase: str,
                     entered: dict[str, Any] | None = None, fault_class: str = "fault", frame: str = "") -> None:
        """A fault of this rank (``kind``: memory-error, comm-failure, other; ``fault_class`` and ``frame``:
        ``faults.fault_class``, ``faults.user_frame``), sent at once and replayed to a successor if the
        controller dies meanwhile. ``entered``: the collectives it issued per group (``Stop.issued``)."""
        self.health = "faulty"
        if self.events:
            self.events.emit("exception", kind=kind, iteration=int(iteration), phase=phase, detail=detail,
                             fault_class=fault_class, **({"frame": frame} if frame else {}))
        self._sent.clear()
        self._reports += 1
        rid = f"{os.getpid()}.fault.{self._reports}"
        self._outbox.put(fault_frame(self.rank, kind, detail, iteration, phase, rid, entered, fault_class, frame), rid)
        self._sent.wait(1.0)  # handed to ZeroMQ before the caller may let the process die

    def report_left(self, entered: dict[str, Any]) -> None:
        """The training thread left the step's collectives for a stop: ``entered``, what it issued, as
        ``report_fault`` sends a faulted rank's (the controller hands it to the ranks still waiting)."""
        self._send_answer(protocol.encode("left", rank=self.rank, pid=os.getpid(), entered=entered))

    @property
    def held(self) -> str:
        """Where the training thread is held ("": it is not), sent with heartbeats."""
        return self.watch.held

    def report_held(self, why: str) -> None:
        """(any thread) The training thread will not reach the recovery (``why``: the stop's deadline
        passed after its abort): this rank is reported hung, with where that thread is, so that the
        controller replaces it (recover) or leaves it out (the dump)."""
        detail = self.watch.deadline(why)
        log.error("rank %d: %s", self.rank, detail)
        if self.events:
            self.events.emit("held", detail=detail, deadline=True)
        self.report_fault("hang", detail, self.iteration, self.phase)

    def _check_held(self, now: float) -> None:
        """(processor thread) An order for the training thread waits, or one has run on it (a
        restarted worker's set-up among them): past HELD_REPORT_S, say where that thread is."""
        if self.watch.check(now):
            log.warning("rank %d: %s", self.rank, self.held)
            if self.events:
                self.events.emit("held", detail=self.held)
            self._hb_now = True

    # ---- processor thread ---------------------------------------------------------------------
    def _run(self) -> None:
        assert self.link is not None and self.events is not None  # (start() made them before this thread)
        next_hb = 0.0
        was_active = False
        while not self._closing.is_set():
            try:
                self.link.maintain()
                for data, rid, relayed in self._outbox.drain():
                    self.relay.send(data) if relayed and self.relay else self.link.send(data, rid=rid)
                    self._sent.set()
                now = time.monotonic()
                self._check_held(now)
                if now >= next_hb or self._hb_now or (self.relay is not None and self.relay.fell_silent(now)):
                    next_hb = send_heartbeat(self, now)
                for msg in self.link.receive(20) + (self.relay.receive(self.link) if self.relay else []):
                    if msg["t"] == "do":
                        self._dispatch(msg)
                    elif msg["t"] == "settled":
                        self.host.settle(msg["rids"])
                self.host.saw_epoch(self.link.epoch)
                if self.link.active and not was_active:
                    self.events.emit("controller", endpoint=self.link.endpoint, epoch=self.link.epoch)
                was_active = self.link.active
                unheard = now - self.link.active_at
                if self.link.ever_active and not self.link.active and unheard > self.options.register_timeout_s:
                    ending.end(self.events, exitcodes.FAULT, ending.cut_off(
                        self.rank, unheard, self.options.register_timeout_s, self.link.endpoint))
            except Exception:
                log.exception("processor loop error (continuing)")
                time.sleep(0.1)
        self.link.close()
        if self.relay is not None:
            self.relay.close()

    def _dispatch(self, msg: dict[str, Any]) -> None:
        action, aid, args = msg["action"], msg["id"], msg.get("args", {})
        if self.relay is not None and self.link is not None and aid:  # (which way its answer goes)
            self.relay.routes.came(aid, msg.get(RELAYED, False), self.link.send)
        if not self.orders.first_time(msg["epoch"], aid):
            return  # re-sent after a reconnection (or by the controller itself, its agent silent): taken
        assert self.events is not None  # (start() opened it)
        self.events.emit("action", action=action, id=aid, args={k: v for k, v in args.items() if k != "diagnosis"},
                         **({RELAYED: True} if msg.get(RELAYED) else {}))
        if action == "exit":
            if not aid and args.get("diagnosis"):  # (aid 0: an order to this process alone, e.g. fenced)
                log.error("%s", args["diagnosis"])
            self.orders.answer(action, aid, True, data="exiting")
            self._exit_now(int(args.get("code", 1)), flush_link=True)
        else:
            self.orders.route(action, aid, args)

    def _send_answer(self, msg: bytes, aid: int = 0) -> None:
        if self.relay is not None and self.relay.routes.relayed(aid, msg):  # (back the way it came)
            self._outbox.put(msg, relay=True)
        elif threading.current_thread() is self._thread:
            assert self.link is not None  # (its thread runs only with it)
            self.link.send(msg)
        else:
            self._outbox.put(msg)

    # ---- the processor's own orders -----------------------------------------------------------
    def _stop_collectives(self, args: dict[str, Any]) -> str:
        reason = str(args.get("reason", "controller"))
        if args.get("boundary"):  # planned: between two steps; stopped mid-step only if held up there
            self.stop.park.request(reason, grace_s=max(1.0, 3 * self.work.step_s))
            return "park requested"
        self.stop.request(reason, entered=args.get("entered"))
        return "stop requested"

    def _reconnect(self, args: dict[str, Any]) -> str:
        """The controller moved (a handover): go there now."""
        assert self.link is not None  # (orders come through it)
        self.link.switch(str(args["endpoint"]))
        return "reconnecting"

    def _exit_now(self, code: int, flush_link: bool = False) -> None:
        if self.events:
            self.events.emit("exit", code=code)
        if flush_link and self.link is not None:
            self.link.close()  # linger: the result above leaves before we go
        ending.end(None, code)
