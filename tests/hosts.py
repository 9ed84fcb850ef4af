"""Nodes with network stacks of their own, for tests: each node is a network namespace with its own
address on a veth link to a bridge (the bridge in a namespace of its own, so that no traffic leaves
them), its own loopback and port space. Processes started with ``Hosts.popen`` live there. A node's
link can be cut and healed. Needs root (``ip netns``); ``Hosts.available()`` says why not."""
from __future__ import annotations

import os
import subprocess
import uuid


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    def __init__(self, n: int):
        tag = uuid.uuid4().hex[:6]
        self.switch = f"msha-{tag}-sw"
        self.names = [f"msha-{tag}-n{i}" for i in range(n)]
        self.net = f"10.{100 + int(tag, 16) % 150}.{int(tag[:2], 16) % 250}"  # (a /24 of this run's own)
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def available() -> str | None:
        """None where namespaces can be made here, else why not."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        probe = f"msha-probe-{uuid.uuid4().hex[:6]}"
        try:
            _ip("netns", "add", probe)
        except (OSError, subprocess.CalledProcessError) as e:
            return f"`ip netns add` failed: {getattr(e, 'stderr', '') or e}"
        _ip("netns", "del", probe)
        return None

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", self.switch, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def addr(self, node: int) -> str:
        return f"{self.net}.{node + 1}"

    def popen(self, node: int, cmd: list[str], **kw) -> subprocess.Popen:
        """``cmd`` on ``node`` (``ip netns exec`` execs it: the Popen's pid is the command's)."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[node], *cmd], **kw)

    def cut(self, node: int) -> None:
        """The node's link goes down (its switch port): the node runs on, unreachable."""
        _ip("-n", self.switch, "link", "set", f"port{node}", "down")

    def heal(self, node: int) -> None:
        _ip("-n", self.switch, "link", "set", f"port{node}", "up")

    def close(self) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()
