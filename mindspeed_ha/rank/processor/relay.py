"""The rank's end of its node agent's relay (``mindspeed-ha run --relay``): the controller sends an
order for the node's ranks to their agent once, the agent passes it on here, and the rank's answer
goes back the same way, in the agent's batch. Everything else (registration, heartbeats, faults) and
every order the controller sends directly stays on the rank's own link.

The relay is an ``ipc://`` socket in a directory only the job's user may open (``launcher.relay``); the
agent and its workers are one user's processes on one host, so frames here are not CurveZMQ-sealed.

An order can come both ways: the controller sends directly what an agent that went silent still owed.
``Routes`` says where each relayed order's answer goes, and hands back an answer that went to the relay
when the same order then comes directly, so that it is sent again on the link.
"""
from __future__ import annotations

import collections
import os
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

    def __init__(self, endpoint: str, rank: int, ctx: zmq.Context[zmq.Socket[bytes]] | None = None):
        self.endpoint, self.rank = endpoint, rank
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
        relay = AgentRelay(endpoint, rank)
        link.also_poll(relay.sock)
        return relay

    def send(self, data: bytes) -> None:
        try:
            self.sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # (the agent is gone: the controller resends directly what it owes)
            self.drops.drop("relay send", str(e))

    def receive(self) -> list[dict[str, Any]]:
        """The orders the agent passed on since the last call (never waits), each marked ``RELAYED``."""
        out: list[dict[str, Any]] = []
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = self.drops.decoded(data)
            if msg is not None and msg["t"] == "do":
                msg[RELAYED] = True
                out.append(msg)

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
