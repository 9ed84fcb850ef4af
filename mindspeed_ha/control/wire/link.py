"""A client's connection to whichever controller is active, with failover (processors and agents)."""
from __future__ import annotations

import os
import select
import socket
import time
from typing import TYPE_CHECKING, Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from ...events import get_logger
from . import protocol, security
from .announcement import Candidates

if TYPE_CHECKING:
    from .discovery import JobStore

log = get_logger("control.link")
# A controller whose connection closed and did not come back within this long is gone: its process
# ended (the kernel closes its sockets at once). Sooner when a reconnection is refused after the
# close: nothing listens on its endpoint any more (a live controller's socket accepts for as long as
# its process runs). A starved or partitioned one keeps its connections: that takes the silence
# rule (``lost_after``).
CLOSED_GRACE_S = 0.5
# ZeroMQ's wait before reconnecting (plus up to as much again at random): how soon a refusal is seen.
RECONNECT_IVL_MS = 50
REPLAY_MAX = 64  # reports kept for a successor


# The endpoint of the node agent's relay (``mindspeed-ha run --relay``), set for the workers it starts:
# the controller's orders to them and their answers pass there.
RELAY_ENV = "MINDSPEED_HA_RELAY"


def job_id_from_env() -> str | None:
    return os.environ.get("MINDSPEED_HA_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or None


class ControllerLink:
    """A DEALER connection to whichever controller is active, with failover.

    ``hello()`` returns the registration frame, resent on every new connection; reports sent with a
    ``rid`` (faults, exits, preemption) are resent after it too, so a report made while the
    controller was dying reaches its successor — until a controller says it ``settled`` them (a
    recovery dealt with their fault): a successor must not recover the same fault twice."""

    def __init__(self, keys: security.Keys, log_dir: str, job_id: str | None, hello: Callable[[], bytes],
                 heartbeat_s: float, name: str = "processor", ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 store: JobStore | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.keys, self.hello, self.name, self.heartbeat_s = keys, hello, name, heartbeat_s
        self.cands = Candidates(log_dir, job_id, answer_wait=max(1.0, 2 * heartbeat_s),
                                         standby_wait=max(4.0, 8 * heartbeat_s), store=store)
        if store is not None:
            from .discovery import CONTROLLER_KEY
            store.watch(CONTROLLER_KEY)
        # A starved controller is slow, not dead, and so is a starved processor thread that did not
        # read its acks (8 ranks on 2 cores: > 3 s seen); switching then loses orders in flight.
        self.lost_after = max(6 * heartbeat_s, 6.0)
        self.sock: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None   # the socket's connection events
        self._closed_at = 0.0                           # when the controller's connection closed (0: it is open)
        self._refused = False                           # a reconnection after that close was refused
        self.endpoint: str | None = None
        self.epoch = 0
        self.active = False          # answered by a controller that is not a standby
        self.answered = False
        self._t_connect = self._last_heard = self._standby_since = self._last_maintain = 0.0
        self._replay: dict[str, bytes] = {}   # rid -> report not settled yet, in the order sent
        self.drops = protocol.DropCounter(log)
        self.ever_active = False
        self.active_at = 0.0         # when an active controller last answered (monotonic)
        self.state = ""              # the controller's state in its last ack
        self.last_ack: dict[str, Any] | None = None   # (an agent passes it on to the ranks it relays for)
        self.acks = 0
        # Another thread wakes ``receive`` (``wake``) when it has something to send: the owner's loop
        # sends it then, not after its wait for the controller runs out (every answer of a recovery's
        # rounds, its fault report and the heartbeat that ends its MTTR waited up to that long).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller: zmq.Poller | None = None
        self._also: list[zmq.Socket[bytes]] = []   # the owner's other sockets that end ``receive``'s wait

    def also_poll(self, sock: zmq.Socket[bytes]) -> None:
        """``receive`` returns as soon as ``sock`` has a message too (the owner reads it itself): a
        rank's agent relay, whose orders must not wait for the link's timeout."""
        self._also.append(sock)
        if self._poller is not None:
            self._poller.register(sock, zmq.POLLIN)

    def _connect(self, ep: str) -> None:
        self._close_sockets(linger=0)
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 500
        s.maxmsgsize = protocol.MAX_BYTES + 1024
        s.handshake_ivl = 300_000  # a controller busy with a thousand handshakes is slow, not dead
        security.secure_client(s, self.keys)
        s.reconnect_ivl = RECONNECT_IVL_MS
        self.monitor = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                            | zmq.EVENT_CLOSED)
        self._closed_at = 0.0
        self._refused = False
        s.connect(ep)
        self.sock, self.endpoint = s, ep
        self._poller = zmq.Poller()
        self._poller.register(s, zmq.POLLIN)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        for other in self._also:
            self._poller.register(other, zmq.POLLIN)
        self.answered = self.active = False
        self._t_connect = time.monotonic()
        self._standby_since = 0.0
        self._send_raw(self.hello())
        for data in list(self._replay.values()):
            self._send_raw(data)

    def _send_raw(self, data: bytes) -> None:
        assert self.sock is not None  # (its callers send on a connected link only)
        try:
            self.sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def send(self, data: bytes, rid: str | None = None) -> None:
        """``rid``: a report to re-send to every new controller until one settles it."""
        if rid is not None:
            self._replay[rid] = data
            while len(self._replay) > REPLAY_MAX:  # (the oldest first: a job of many faults)
                del self._replay[next(iter(self._replay))]
        if self.sock is not None:
            self._send_raw(data)

    def maintain(self) -> None:
        now = time.monotonic()
        if self._last_maintain and now - self._last_maintain > self.lost_after / 2:
            # This process did not run meanwhile (stopped, or starved of the CPU): the silence is
            # its own, not the controller's; ask the same controller again before looking elsewhere.
            self._last_heard = max(self._last_heard, now)
            self._t_connect = max(self._t_connect, now)
        self._last_maintain = now
        if self.sock is None:
            ep = self.cands.next(None)
            if ep:
                self._connect(ep)
            return
        self._watch_connection(now)
        why = None
        if not self.answered and now - self._t_connect > self.cands.answer_wait:
            why = "no answer"
        elif self.active and self._closed_at and (self._refused or now - self._closed_at > CLOSED_GRACE_S):
            why = "its connection closed" + (" and a reconnection was refused" if self._refused else "")
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

    def _watch_connection(self, now: float) -> None:
        while self.monitor is not None and self.monitor.poll(0):
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.ZMQError:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._closed_at = self._closed_at or now
            elif event == zmq.EVENT_CLOSED and self._closed_at:  # (a reconnection attempt failed)
                self._refused = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._closed_at, self._refused = 0.0, False

    @property
    def recovering(self) -> bool:
        """The controller answers and is in a recovery (its last ack said so): its orders may be long
        in coming (a round can wait out a hung rank or a restart)."""
        return self.active and self.state not in ("", "init", "normal", "done")

    def switch(self, endpoint: str) -> None:
        """The controller handed over to ``endpoint``: connect there now."""
        if endpoint and endpoint != self.endpoint:
            log.info("%s: the controller moved to %s", self.name, endpoint)
            self._connect(endpoint)

    def wake(self) -> None:
        """(any thread) End the owner's ``receive`` now: it has something to send."""
        try:
            self._wake_w.send(b"w")
        except OSError:  # (full: a wake is pending already; closed: so is the link)
            pass

    def _woken(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:  # (drained)
            pass

    def receive(self, timeout_ms: int) -> list[dict[str, Any]]:
        """What the controller sent, waiting up to ``timeout_ms`` for it; sooner when ``wake`` is called."""
        if self.sock is None or self._poller is None:
            if select.select([self._wake_r], [], [], timeout_ms / 1000)[0]:
                self._woken()
            return []
        out: list[dict[str, Any]] = []
        ready = dict(self._poller.poll(timeout_ms))
        if self._wake_r.fileno() in ready:  # (a file is polled, and named, by its number)
            self._woken()
        if self.sock not in ready:
            return out
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self.drops.decoded(data)
            if msg is None:
                continue
            now = time.monotonic()
            t = msg["t"]
            if t == "ack":
                self._acked(msg, now)
            elif t == "refused":
                self._last_heard = now
                self.register_again()
            elif t == "do":
                self._last_heard = now
                out.append(msg)
            elif t == "settled":
                for rid in msg["rids"]:
                    self._replay.pop(rid, None)
                out.append(msg)
            else:
                out.append(msg)
        return out

    def _acked(self, msg: dict[str, Any], now: float) -> None:
        self._last_heard = now
        self.last_ack, self.acks = msg, self.acks + 1
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
            self.active_at = now
            self.epoch = msg["epoch"]
            self.state = msg["state"]
            self.cands.connected(self.endpoint, msg["epoch"])
            self._follow_store(msg.get("store"))
        if msg.get("backups"):
            self.cands.backups = list(msg["backups"])

    def register_again(self) -> None:
        """The controller does not know this process (it took over meanwhile): say who it is."""
        if self.sock is not None:
            self._send_raw(self.hello())

    def acked_through_agent(self, msg: dict[str, Any]) -> bool:
        """An ack the node agent passed on (this rank's heartbeats went through it): taken as this
        link's own when it came from the active controller this link is connected to."""
        if not self.active or msg.get("endpoint") != self.endpoint or msg.get("standby"):
            return False
        self._acked(msg, time.monotonic())
        return True

    def _follow_store(self, text: str | None) -> None:
        """The active controller names the job store in use: it moved there when the first was lost."""
        from .discovery import parse_address
        address = parse_address(text) if text else None
        if address is not None and self.cands.store is not None:
            self.cands.store.move(address)

    def _close_sockets(self, linger: int) -> None:
        self._poller = None
        if self.monitor is not None:
            if self.sock is not None:  # (None when the last connect raised: its socket never became ours)
                self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        if self.sock is not None:
            self.sock.close(linger=linger)
            self.sock = None

    def close(self) -> None:
        self._close_sockets(linger=300)
        self._wake_r.close()
        self._wake_w.close()
