"""A node agent's relay (``mindspeed-ha run --relay``): the controller sends an order for this node's
ranks once, naming them; the agent passes it to each of their processes and sends their answers back
in one ``results`` frame per turn of its loop (whatever came in that turn: it never waits for the rest).

The ranks connect to an ``ipc://`` socket in a fresh directory of mode 0700 (the job's user only), and
say who they are (``relay_hello``). Which of them are connected, with their pids, goes to the
controller with the agent's heartbeats: it relays only to the processes it knows are connected, and
sends directly whatever a silent agent still owes (``control.controller.orders``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import zmq

from ..control.wire import protocol
from ..events import get_logger

log = get_logger("launcher")


class RelayHub:
    def __init__(self, node_rank: int, ctx: zmq.Context[zmq.Socket[bytes]] | None = None):
        self.node_rank = node_rank
        self._dir = tempfile.mkdtemp(prefix="mindspeed-ha-relay-")  # (mode 0700: this user's processes only)
        self.endpoint = f"ipc://{os.path.join(self._dir, 'relay')}"
        self.sock: zmq.Socket[bytes] = (ctx or zmq.Context.instance()).socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.maxmsgsize = protocol.MAX_BYTES + 1024
        self.sock.router_handover = 1   # a restarted rank's process takes its place at once
        self.sock.bind(self.endpoint)
        self.drops = protocol.DropCounter(log)
        self._ident: dict[int, bytes] = {}   # rank -> its process's socket identity here
        self.pids: dict[int, int] = {}       # rank -> the pid connected (what the controller is told)
        self.changed = False                 # a rank connected since the last heartbeat
        self.passed = 0                      # orders passed on, answers passed back (the agent's log)
        self.answered = 0

    def relayed(self) -> dict[str, Any]:
        """The heartbeat's fields: the ranks connected here, and their pids."""
        ranks = sorted(self.pids)
        return {"relayed": ranks, "relayed_pids": [self.pids[r] for r in ranks]}

    def forget(self, rank: int) -> None:
        """Its process ended: nothing more goes to it here."""
        if self.pids.pop(rank, None) is not None:
            self._ident.pop(rank, None)
            self.changed = True

    def pass_on(self, msg: dict[str, Any]) -> list[int]:
        """An order for some of this node's ranks: to each of them; returns those it could not reach (the
        controller sends it to them directly once this agent's heartbeat says they are not here)."""
        data = protocol.encode("do", action=msg["action"], id=msg["id"], args=msg.get("args") or {},
                               epoch=msg["epoch"])
        missing = []
        for r in msg["ranks"]:
            ident = self._ident.get(r)
            if ident is None:  # (the next heartbeat, at once, lists it as not here: the controller sends directly)
                missing.append(r)
                self.changed = True
                continue
            try:
                self.sock.send_multipart([ident, data], zmq.NOBLOCK)
                self.passed += 1
            except zmq.ZMQError as e:
                self.drops.drop("relay send", f"rank {r}: {e}")
                missing.append(r)
                self.forget(r)
        return missing

    def collect(self) -> list[dict[str, Any]]:
        """The answers its ranks sent since the last call (and their hellos, taken here)."""
        items: list[dict[str, Any]] = []
        while True:
            try:
                ident, data = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return items
            except ValueError:  # (not two frames)
                self.drops.drop("malformed", "relay frame")
                continue
            msg = self.drops.decoded(data)
            if msg is None:
                continue
            if msg["t"] == "relay_hello":
                self._ident[msg["rank"]], self.pids[msg["rank"]] = ident, msg["pid"]
                self.changed = True
            elif msg["t"] == "result":
                items.append(msg)
                self.answered += 1

    def results_frame(self, items: list[dict[str, Any]]) -> bytes:
        return protocol.encode("results", node_rank=self.node_rank, items=items)

    def close(self) -> None:
        self.sock.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
