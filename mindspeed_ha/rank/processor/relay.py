"""The rank's end of its node agent's relay (``mindspeed-ha run --relay``): the controller sends an
order for the node's ranks to their agent once, the agent passes it on here, and the rank's answer
goes back the same way, in the agent's batch. Once its link is answered, the rank's heartbeats go
through the agent too, in one frame for the node (the ranks of a node beat on one clock: ``next_beat``),
and the controller's ack to that frame comes back here; the link takes it as its own. A heartbeat the
agent passed on and no ack came back for within ``ack_wait`` (a stopped or starved agent) has the
rank beat directly at once, and on both ways until an ack comes through the agent again: the
controller keeps hearing it before its loss limit. Everything else (registration, faults, reports)
and every order the controller sends directly stays on the rank's own link.

The relay is an ``ipc://`` socket in a directory only the job's user may open (``launcher.relay``); the
agent and its workers are one user's processes on one host, so frames here are not CurveZMQ-sealed.

An order can come both ways: the controller sends directly what an agent that went silent still owed.
``Routes`` says where each relayed order's answer goes, and hands back an answer that went to the relay
when the same order then comes directly, so that it is sent again on the link.
"""
from __future__ import annotations

import collections
import os
import zlib
from typing import Any, Callable

import zmq

from ...control.wire import protocol
from ...control.wire.link import RELAY_ENV, ControllerLink
from ...events import get_logger

log = get_logger("control.processor")

KEEP = 256                         # relayed orders remembered (a round's order, its resend)
RELAYED = "relayed"                # (the mark ``receive`` puts on each order: it came this way)


class AgentRelay:
    """The DEALER a rank connects to its agent's relay. Its thread: the processor's (it polls this
    socket with its link's, ``ControllerLink.also_poll``)."""

    def __init__(self, endpoint: str, rank: int, heartbeat_s: float = 0.5,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None):
        self.endpoint, self.rank, self.heartbeat_s = endpoint, rank, heartbeat_s
        # The controller declares a rank lost after this silence (its default, or the job's setting),
        # counted from the last beat it heard: one interval before the beat now unanswered, at worst.
        # Half of what is left then is how long that beat's ack may take before this rank beats directly.
        loss = float(os.environ.get("MINDSPEED_HA_DEAD_AFTER", 0) or 0) or max(1.8 * heartbeat_s, 3.0)
        self.ack_wait = max(0.5 * (loss - heartbeat_s), 0.2)
        # Where in each interval this node's ranks beat: one place for the node (its agent's relay).
        self.offset = heartbeat_s * (zlib.crc32(endpoint.encode()) % 1000) / 1000
        self.direct = True          # heartbeats go on the link too (until an ack comes back through here)
        self._unacked_since = 0.0   # when the oldest heartbeat sent here that no ack came back for went
        self.sock: zmq.Socket[bytes] = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
        self.sock.linger = 500
        self.sock.maxmsgsize = protocol.MAX_BYTES + 1024
        self.sock.connect(endpoint)
        self.drops = protocol.DropCounter(log)
        self.routes = Routes()
        self.send(protocol.encode("relay_hello", rank=rank, pid=os.getpid()))

    @staticmethod
    def from_env(rank: int, link: ControllerLink) -> "AgentRelay | None":
        """The relay of the agent that started this process, if it relays; ``link``'s waits end when
        an order comes here too."""
        endpoint = os.environ.get(RELAY_ENV)
        if not endpoint:
            return None
        relay = AgentRelay(endpoint, rank, link.heartbeat_s)
        link.also_poll(relay.sock)
        return relay

    def next_beat(self, now: float) -> float:
        """When this rank's next heartbeat is due: on the node's shared place in the interval (the
        host's monotonic clock is its ranks' one clock), so that the agent passes them on together."""
        hb = self.heartbeat_s
        return ((now - self.offset) // hb + 1) * hb + self.offset

    def beat(self, data: bytes, link: ControllerLink, now: float) -> bool:
        """Sends heartbeat ``data`` through the agent once the link is answered by an active controller
        (until then it registers and beats directly); returns whether it goes on the link too."""
        if not link.active:
            return True
        self.send(data)
        self._unacked_since = self._unacked_since or now
        return self.direct

    def fell_silent(self, now: float) -> bool:
        """True once when the agent has not passed on an ack for ``ack_wait``: beat directly now."""
        if self.direct or not self._unacked_since or now - self._unacked_since <= self.ack_wait:
            return False
        self.direct = True
        log.warning("rank %d: no ack through the agent for %.1fs: heartbeats go directly too", self.rank,
                    now - self._unacked_since)
        return True

    def send(self, data: bytes) -> None:
        try:
            self.sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # (the agent is gone: the controller resends directly what it owes)
            self.drops.drop("relay send", str(e))

    def receive(self, link: ControllerLink) -> list[dict[str, Any]]:
        """The orders the agent passed on since the last call (never waits), each marked ``RELAYED``;
        the acks to this rank's heartbeats go to ``link``."""
        out: list[dict[str, Any]] = []
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = self.drops.decoded(data)
            if msg is None:
                continue
            if msg["t"] == "do":
                msg[RELAYED] = True
                out.append(msg)
            elif msg["t"] == "ack" and link.acked_through_agent(msg):
                if self.direct:
                    log.info("rank %d: heartbeats go through the agent", self.rank)
                self.direct, self._unacked_since = False, 0.0
            elif msg["t"] == "refused":  # (the controller did not know this process: register again)
                self.direct, self._unacked_since = True, 0.0
                link.register_again()

    def close(self) -> None:
        self.sock.close(linger=0)


class Routes:
    """Which way each order's answer goes: back through the relay it came by, or on the link."""

    def __init__(self) -> None:
        self._relayed: collections.OrderedDict[int, bytes | None] = collections.OrderedDict()  # id -> answer sent

    def came(self, aid: int, relayed: bool, send_directly: Callable[[bytes], None]) -> None:
        """Order ``aid`` came through the relay, or on the link. On the link after the relay (its agent
        went silent), its answer goes on the link from now on, and one already sent to the relay is
        sent again there."""
        if relayed:
            self._relayed.setdefault(aid, None)
            while len(self._relayed) > KEEP:
                self._relayed.popitem(last=False)
            return
        answered = self._relayed.pop(aid, None)
        if answered is not None:
            send_directly(answered)

    def relayed(self, aid: int, answer: bytes) -> bool:
        """Whether ``answer`` to order ``aid`` goes to the relay (it is kept, should the order come again)."""
        if aid not in self._relayed:
            return False
        self._relayed[aid] = answer
        return True
