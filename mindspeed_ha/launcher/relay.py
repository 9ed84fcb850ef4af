"""A node agent's relay (``mindspeed-ha run --relay``): the controller sends an order for this node's
ranks once, naming them; the agent passes it to each of their processes and sends their answers back
in one ``results`` frame per turn of its loop (whatever came in that turn: it never waits for the rest).

Their heartbeats come here too (once their link is answered) and go on in the agent's own heartbeat,
one frame for the node, as columns (what the ranks say alike once): a beat the rank wants passed on
at once (``now``) goes at once with whatever came with it; the others when every connected rank has
beaten, or ``BATCH_S`` after the first (the ranks of a node beat on one shared clock,
``rank.processor.relay``). The controller's ack to that frame is passed back to the ranks that beat,
naming the controller it came from: their links take it as their own ack (a rank whose acks stop
coming through here beats directly again).

The ranks connect to an ``ipc://`` socket in a fresh directory of mode 0700 (the job's user only), and
say who they are (``relay_hello``). Which of them are connected, with their pids, goes to the
controller with the agent's heartbeats: it relays only to the processes it knows are connected, and
sends directly whatever a silent agent still owes (``control.controller.orders``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import msgpack
import zmq

from ..control.wire import protocol
from ..control.wire.folding import as_columns, split_common
from ..events import get_logger

log = get_logger("launcher")

BATCH_S = 0.05   # the longest a heartbeat waits here for its node's others (none waits when it says ``now``)


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
        self._beats: dict[int, tuple[dict[str, Any], float]] = {}   # rank -> its newest heartbeat, when it came
        self._urgent = False                 # one of them is to go on at once
        self._ack_owed: set[int] = set()     # ranks whose heartbeats went on, waiting for the controller's ack
        self.beats = 0                       # heartbeats passed on (the agent's log)

    def relayed(self) -> dict[str, Any]:
        """The heartbeat's fields: the ranks connected here, and their pids."""
        ranks = sorted(self.pids)
        return {"relayed": ranks, "relayed_pids": [self.pids[r] for r in ranks]}

    def forget(self, rank: int) -> None:
        """Its process ended: nothing more goes to it here."""
        if self.pids.pop(rank, None) is not None:
            self._ident.pop(rank, None)
            self._beats.pop(rank, None)
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
            elif msg["t"] == "hb" and self._ident.get(msg["rank"]) == ident:
                self._beats[msg["rank"]] = (msg, time.monotonic())
                self._urgent = self._urgent or msg.get("now", False)

    def beats_due(self, now: float) -> bool:
        """Whether the heartbeats that came go on now (``take_beats``)."""
        if not self._beats:
            return False
        return (self._urgent or len(self._beats) >= len(self._ident)
                or now - min(at for _, at in self._beats.values()) >= BATCH_S)

    def take_beats(self, now: float) -> dict[str, Any]:
        """The heartbeats to pass on, each with how long it waited here, as the columns the agent's
        heartbeat carries (``folding.as_columns``); their ranks get the next ack."""
        out = []
        for r, (msg, at) in self._beats.items():
            msg.pop("now", None)
            msg["age"] = round(max(0.0, now - at), 4)
            out.append(msg)
            self._ack_owed.add(r)
        self._beats.clear()
        self._urgent = False
        self.beats += len(out)
        return as_columns(out)

    def pass_ack(self, ack: dict[str, Any], endpoint: str) -> None:
        """The controller's ack, from ``endpoint``, to the ranks whose heartbeats went on before it."""
        if not self._ack_owed:
            return
        fields = {k: v for k, v in ack.items() if k not in ("v", "t")}
        self._to(self._ack_owed, protocol.encode("ack", **fields, endpoint=endpoint))
        self._ack_owed.clear()

    def pass_unheard(self, ranks: list[int]) -> None:
        """The controller did not take these ranks' heartbeats: each registers on its own link."""
        self._to(ranks, protocol.encode("refused", reason="register first"))

    def _to(self, ranks: Any, data: bytes) -> None:
        for r in ranks:
            ident = self._ident.get(r)
            if ident is not None:
                try:
                    self.sock.send_multipart([ident, data], zmq.NOBLOCK)
                except zmq.ZMQError as e:
                    self.drops.drop("relay send", f"rank {r}: {e}")

    def results_frame(self, items: list[dict[str, Any]]) -> bytes:
        return results_frame(self.node_rank, items)

    def close(self) -> None:
        self.sock.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


ALIKE = ("action", "id", "ok", "data", "error", "kind")


def results_frame(node_rank: int, items: list[dict[str, Any]]) -> bytes:
    """The ``results`` frame of a node's answers. Those that several ranks gave to one order with one
    outcome go once, naming the ranks (``same``): alike (most rounds' "ok"), or, where each answered a
    map (a status), what all of them have alike once and each one's own part (``own``, folding.py).
    The others go one by one (``items``)."""
    by_order: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for item in items:
        # (a str, an int, a bool, and a str or None each, as decoded: equal values are alike)
        key = (item["action"], item["id"], item["ok"], item.get("error"), item.get("kind"))
        by_order.setdefault(key, []).append(item)
    single: list[dict[str, Any]] = []
    same: list[dict[str, Any]] = []
    for group in by_order.values():
        if len(group) > 1 and all(isinstance(i.get("data"), dict) for i in group):
            shared, own = split_common([i["data"] for i in group])
            same.append(_answers(group, data=shared, **({"own": own} if any(own) else {})))
            continue
        alike: dict[bytes, list[dict[str, Any]]] = {}
        for item in group:  # (data compared by its msgpack encoding, so that True is not 1)
            alike.setdefault(msgpack.packb(item.get("data")), []).append(item)
        for answers in alike.values():
            if len(answers) == 1:
                single.append(answers[0])
            else:
                same.append(_answers(answers))
    return protocol.encode("results", node_rank=node_rank, items=single, **({"same": same} if same else {}))


def _answers(group: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """One ``answers`` of ``group`` (answers to one order, with one outcome), ``fields`` over the first's."""
    return {"v": protocol.VERSION, "t": "answers", **{k: group[0][k] for k in ALIKE if k in group[0]},
            "ranks": [i["rank"] for i in group], "pids": [i.get("pid") or 0 for i in group], **fields}
