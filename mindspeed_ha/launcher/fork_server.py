"""A pre-imported interpreter that starts the spare templates of many short jobs on one host.

Every job's spare template (``spare.py``) begins with a Python start-up: importing torch and
megatron-core is seconds of CPU (about 6 s on a CPU core), most of a small job's start and, on a
host that runs job after job (CI, sweeps, this project's own test suite), most of its CPU. A fork
server does those imports once: ``python -m mindspeed_ha.launcher.fork_server SOCKET [MODULE ...]``
imports the modules (default: torch and megatron.core) and then only forks; an agent started with
``MINDSPEED_HA_FORK_SERVER=SOCKET`` asks it for each template instead of starting a fresh
interpreter. The fork becomes the process ``subprocess.Popen`` would have started: its own session,
the agent's environment, working directory, argv and file descriptors (passed over the Unix
socket), the script run as ``__main__``; the server reaps it and sends its exit code back.

What it cannot reproduce: what a preloaded module read from the environment at import (the
server's, not the job's), interpreter start-up options, and the command line and environment the
kernel shows in /proc (``ps`` shows the server's for a fork and its own forks: find a job's processes
by the pids its agent logs). So the server refuses, and the agent
starts the template as a process, when the agent runs in other Linux namespaces (`ip netns exec`, a
container), when the command is not ``[this interpreter, -u, script, args...]`` (``-u`` optional)
or when the job's ``PYTHON*`` variables differ from the server's; also when it is not running (the
agent never waits for it). The server forks from one thread: nothing it imported may have started
a thread (torch and megatron-core do not).
"""
from __future__ import annotations

import gc
import importlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

ENV = "MINDSPEED_HA_FORK_SERVER"
PRELOAD = ("torch", "megatron.core")
_MSG = 1 << 20  # a request (argv and environment) fits one message of a SOCK_SEQPACKET socket


def _python_vars(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


def namespaces() -> dict:
    """This process's Linux namespaces (a process started under `ip netns exec`, in a container, ...
    must not become a fork of a server outside them)."""
    found = {}
    for name in ("net", "mnt", "pid", "uts", "ipc", "user", "cgroup"):
        try:
            found[name] = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            pass
    return found


def refusal(argv: list[str], env: dict, ns: dict | None) -> str | None:
    """Why this server cannot start ``argv`` with ``env``, for a client in namespaces ``ns``, as a
    fresh interpreter would (None: it can). A client that does not say its namespaces is refused."""
    if ns != namespaces():
        return "the agent runs in other namespaces"
    script = argv[2:3] if argv[1:2] == ["-u"] else argv[1:2]
    if os.path.realpath(argv[0]) != os.path.realpath(sys.executable) or not script or script[0].startswith("-"):
        return f"not `{sys.executable} [-u] SCRIPT ...`"
    if _python_vars(env) != _python_vars(os.environ):
        return "the job's PYTHON* variables are not the server's"
    return None


# ---- the server -----------------------------------------------------------------------------
def serve(path: str, preload=PRELOAD) -> None:
    """Import ``preload``, then fork for every request until SIGTERM. Returns only in a fork, once
    it is the requested process (the caller then runs its script)."""
    for name in preload:
        importlib.import_module(name)
    # (the collector would otherwise walk, and so copy, every page of this heap in each fork)
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.path.exists(path + ".tmp"):
        os.unlink(path + ".tmp")
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # (clients see the socket only once it accepts)
    waiting: dict[int, socket.socket] = {}  # forked pid -> the connection its exit code goes to
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        _reap(waiting)
        try:
            if not select.select([listener], [], [], 0.2)[0]:
                continue
        except InterruptedError:
            continue
        conn, _ = listener.accept()
        fds: list[int] = []
        try:
            data, fds, _, _ = socket.recv_fds(conn, _MSG, 16)
            request = json.loads(data)
            why = refusal(request["argv"], request["env"], request.get("ns"))
        except (OSError, ValueError, KeyError) as e:
            why = f"a bad request: {e}"
        if why is not None:
            _send(conn, {"refused": why})
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in waiting.values():
                other.close()
            conn.close()
            _become(request, fds)
            return
        for fd in fds:
            os.close(fd)
        waiting[pid] = conn
        _send(conn, {"pid": pid})
    listener.close()
    os.unlink(path)
    sys.exit(0)


def reaped_children():
    """(pid, exit code) of each child that has ended, reaped without waiting for the others."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _reap(waiting: dict) -> None:
    for pid, code in reaped_children():
        conn = waiting.pop(pid, None)
        if conn is not None:
            _send(conn, {"exit": code})
            conn.close()


def _send(conn: socket.socket, msg: dict) -> None:
    try:
        conn.send(json.dumps(msg).encode())
    except OSError:
        pass  # the client is gone


def _become(request: dict, fds: list[int]) -> None:
    """In the fork: the process Popen(argv, env=env, cwd=cwd, stdin=..., start_new_session=True,
    pass_fds=...) would have started, up to running its script. The passed descriptors after the
    first three are placed above any the server holds (its imports keep theirs: they are this
    process's too), and the variables that name them are set to their new numbers."""
    import fcntl
    import random
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    gc.unfreeze()
    random.seed()  # (a fresh interpreter's entropy, not the server's state shared by every fork)
    floor = max([2, *fds]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    stdio, passed = moved[:3], moved[3:]
    for src, dst in zip(stdio, (0, 1, 2)):
        os.dup2(src, dst)
        os.close(src)
    env = dict(request["env"])
    for name, fd in zip(request["fd_vars"], passed):
        os.set_inheritable(fd, True)
        env[name] = str(fd)
    os.chdir(request["cwd"])
    os.umask(request.get("umask", 0o022))
    os.environ.clear()
    os.environ.update(env)
    argv = list(request["argv"][1:])
    if argv[0] == "-u":  # unbuffered standard streams, as -u makes them
        argv.pop(0)
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                                errors=old.errors, write_through=True))
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))


# ---- the agent's side -----------------------------------------------------------------------
class FromServer:
    """Popen's interface (pid, stdin, poll, wait, returncode) for a process the server forked."""

    def __init__(self, pid: int, conn: socket.socket, stdin):
        self.pid, self._conn, self.stdin = pid, conn, stdin
        self.returncode: int | None = None
        conn.setblocking(False)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                data = self._conn.recv(_MSG)
            except BlockingIOError:
                return None
            except OSError:
                data = b""
            # (no message, the connection closed: the server died; the process may still run)
            self.returncode = json.loads(data)["exit"] if data else _gone_code(self.pid)
            if self.returncode is not None:
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout)
            try:
                select.select([self._conn], [], [], min(left, 0.1) if left is not None else 0.1)
            except (OSError, ValueError):
                time.sleep(0.05)
        return code


def _gone_code(pid: int) -> int | None:
    """With the server dead the exit code is lost: 1 once the process is gone, else not yet."""
    import psutil
    try:
        return 1 if psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else None
    except psutil.NoSuchProcess:
        return 1
    except psutil.AccessDenied:
        return None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def popen(cmd: list[str], env: dict, fd_vars: dict | None = None,
          cwd: str | None = None) -> "subprocess.Popen | FromServer":
    """``subprocess.Popen(cmd, env=env, stdin=PIPE, start_new_session=True, pass_fds=...)`` with the
    descriptors of ``fd_vars`` (variable name -> descriptor, each variable set to its number in the
    new process), forked by the server ``env[ENV]`` names when it runs and can (see ``refusal``),
    else that Popen."""
    fd_vars = fd_vars or {}
    path = env.get(ENV)
    if path and os.path.exists(path):
        r, w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(path)
            request = {"argv": list(cmd), "env": dict(env), "cwd": cwd or os.getcwd(), "fd_vars": list(fd_vars),
                       "ns": namespaces(), "umask": _umask()}
            socket.send_fds(conn, [json.dumps(request).encode()], [r, 1, 2, *fd_vars.values()])
            reply = json.loads(conn.recv(_MSG) or b'{"refused": "the server closed the connection"}')
        except (OSError, ValueError) as e:
            reply = {"refused": str(e)}
        os.close(r)
        if "pid" in reply:
            return FromServer(reply["pid"], conn, os.fdopen(w, "wb"))
        os.close(w)
        conn.close()
        from ..events import get_logger
        get_logger("launcher.fork_server").info("fork server %s: %s; starting a process", path, reply["refused"])
    return subprocess.Popen(cmd, env={**env, **{k: str(v) for k, v in fd_vars.items()}}, stdin=subprocess.PIPE,
                            start_new_session=True, pass_fds=tuple(fd_vars.values()), cwd=cwd)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m mindspeed_ha.launcher.fork_server SOCKET [MODULE ...]", file=sys.stderr)
        sys.exit(2)
    serve(sys.argv[1], tuple(sys.argv[2:]) or PRELOAD)
    import runpy  # (only a fork gets here: it is the requested process now)
    runpy.run_path(sys.argv[0], run_name="__main__")
