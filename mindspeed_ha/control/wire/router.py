"""The controller's one ROUTER socket: messages in (decoded, validated), frames out.

Processors, agents and the CLI are DEALER clients authenticated by CurveZMQ. A bad frame is dropped
and counted, never raised: a broken or hostile peer must not stall or kill the controller.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, cast

import zmq

from ...events import get_logger
from . import protocol, security

log = get_logger("control.router")
# pyzmq's Cython send, without the Python-level wrapper: half the cost per frame, which is most of
# a decision's time at 16k ranks (fan-out of one order) and of a heartbeat's ack.
_raw = getattr(getattr(zmq, "backend", None), "Socket", zmq.Socket)
_raw_send = _raw.send
# The same for receiving: the identity frame as bytes (a zero-copy Frame object costs more to make
# than the copy of a few bytes), the payload as a Frame, which carries its sender's key and whether
# more frames follow (asking the socket, ``get(RCVMORE)``, makes a SocketOption enum each time: 2.8 us
# a message against 7.6 us here). At 16k ranks receiving heartbeats and answers was a quarter of the
# controller thread's samples.
_raw_recv = _raw.recv
_MORE_NB = zmq.SNDMORE | zmq.NOBLOCK


class Router:
    def __init__(self, keys: security.Keys, host: str, port: int = 0):
        self.keys = keys
        self.ctx = zmq.Context()  # its own context: ZAP is per context, and keys are per job
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 500
        self.sock.rcvhwm = self.sock.sndhwm = 100000
        self.sock.maxmsgsize = protocol.MAX_BYTES + 1024  # libzmq drops oversized frames before Python sees them
        # Thousands of ranks connect at once and every handshake waits its turn at the ZAP handler:
        # the default 30 s handshake limit would drop them and start a reconnect storm.
        self.sock.handshake_ivl = 300_000
        self.sock.backlog = 65535  # (capped by net.core.somaxconn) a full accept queue drops SYNs: 1-7 s retries
        security.start_authenticator(self.ctx, keys)
        security.secure_server(self.sock, keys)
        try:  # the address it was given: a node's own (127.0.0.2 stands in for another host)
            self.sock.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError:
            if not (host.startswith("127.") or host == "localhost"):
                raise
            self.sock.bind(f"tcp://127.0.0.1:{port or '*'}")  # (a system with only 127.0.0.1 on its loopback)
            host = "127.0.0.1"
        self.port = int(cast(bytes, self.sock.last_endpoint).decode().rsplit(":", 1)[1])  # (LAST_ENDPOINT: bytes)
        self.endpoint = f"tcp://{host}:{self.port}"
        self.drops = protocol.DropCounter(log)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def receive(self, timeout_ms: int, limit: int = 5000) -> Iterator[tuple[bytes, dict[str, Any]]]:
        """(ident, message) pairs that arrived within ``timeout_ms``, from senders whose key may send
        that message (security.MAY_SEND); at most ``limit`` at a time, so that timers keep running
        under a flood."""
        if not self.poller.poll(timeout_ms):
            return
        secure, sock, nb = self.keys.secure, self.sock, zmq.NOBLOCK
        for _ in range(limit):
            try:
                ident = _raw_recv(sock, nb, True)  # (the peer's identity, as bytes)
            except zmq.Again:
                return
            try:  # (ROUTER: a peer's message is its identity and at least one frame, delivered whole)
                frame = _raw_recv(sock, nb, False)
            except zmq.Again:
                return
            if frame.more:  # (our peers send one frame a message)
                extra = 1
                while _raw_recv(sock, nb, False).more:
                    extra += 1
                self.drops.drop("frames", f"{2 + extra} frames")
                continue
            data = frame.bytes
            try:
                msg = protocol.decode(data)
            except protocol.ProtocolError as e:
                self.drops.drop("malformed", str(e))
                continue
            if secure:
                role = self.keys.role_of(cast(str, frame.get("User-Id")))  # (a text property)
                if role is None or msg["t"] not in security.MAY_SEND.get(role, ()):
                    self.drops.drop("role", f"a {role} key may not send {msg['t']!r}")
                    continue
            yield ident, msg

    def send(self, ident: bytes, data: bytes) -> None:
        try:
            _raw_send(self.sock, ident, _MORE_NB)
            _raw_send(self.sock, data, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a peer that vanished or is flooded must not stall us

    def fan_out(self, idents: Iterable[bytes], data: bytes) -> None:
        """The same frame to many peers: the hot loop of a decision at scale, kept flat."""
        sock, send, more, nb = self.sock, _raw_send, _MORE_NB, zmq.NOBLOCK
        for ident in idents:
            try:
                send(sock, ident, more)
                send(sock, data, nb)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        self.sock.close(linger=500)
        security.stop_authenticator(self.ctx)
        self.ctx.term()
