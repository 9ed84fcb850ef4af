"""Pre-started spare workers for recover (ARF), and workers forked from one pre-imported template.

Most of a restarted worker's time before it can join is Python start-up: importing torch and
megatron-core, patching, building the dataset — seconds, on the recovery's critical path. With
recover on, each agent keeps ``--ha-spares`` processes (default 1) that have done all of that; on a
restart order the agent hands one the lost rank (one JSON line of environment variables) and the
spare continues exactly like a restarted worker.

Where the OS can fork (Linux), those spares come from a *template*: one more process of the job's
script, started with the job, that does the start-up once and then only forks. Each fork is a
ready spare within milliseconds and shares the template's memory copy-on-write, so a used spare is
replaced at once and back-to-back deaths never wait for a Python start-up. A forked spare is the
template's child: the template reaps it and reports its end (pid and exit code, as Popen gives
them) to the agent, which sees it through ``Forked``, a handle with Popen's interface. Elsewhere,
or when the template has died, spares are plain processes started by the agent.

The same template starts a CPU node's first workers too (``Pool.start_workers``): the node imports
torch and megatron-core once instead of once per rank, and each worker is a fork that goes straight
to its rank. (Not on a GPU node: a fork must not inherit a driver that an import may have touched.)

The template and its forks report on one pipe the agent reads (``REPORT_FD``): ``spare PID`` once a
spare waits for a rank, ``worker PID RANK`` once a forked worker runs, ``exit PID CODE`` when the
template reaped one.
"""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from ..events import get_logger
from . import fork_server

if TYPE_CHECKING:
    from mindspeed_ha.device import Accelerator

ENV = "MINDSPEED_HA_SPARE"
REPORT_FD = "MINDSPEED_HA_SPARE_REPORT_FD"
FORK_DIR = "MINDSPEED_HA_SPARE_FORK_DIR"  # set for the template: forked spares wait on FIFOs there
AGENT_PID = "MINDSPEED_HA_SPARE_AGENT_PID"  # (a fork server's template is not the agent's child: process.py)
Process = subprocess.Popen | fork_server.FromServer  # the template, or a spare the agent started

log = get_logger("launcher.spare")


def is_spare() -> bool:
    return os.environ.get(ENV) == "1"


def warm_up() -> None:
    """Load now what a worker's set-up would load lazily on a restarted worker's critical path (its
    join: ``session.load_ahead``). In the template, its forks inherit it."""
    from mindspeed_ha.rank.session import load_ahead
    load_ahead()


def wait_for_assignment() -> None:
    """Block until the agent assigns a rank; its variables go into ``os.environ``. End quietly
    when the agent has no rank to give (the job is over, or the agent is gone). The template
    never returns here: only its forks do, each with its own assignment."""
    warm_up()
    report = int(os.environ.pop(REPORT_FD, "-1"))
    fork_dir = os.environ.pop(FORK_DIR, None)
    if fork_dir is not None:
        line = _serve_forks(fork_dir, report)
    else:
        _report(report, f"spare {os.getpid()}")
        line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    os.environ["MINDSPEED_HA_ASSIGNED_AT"] = repr(time.time())  # (a restarted worker's join is timed from here)
    os.environ.update({str(k): str(v) for k, v in json.loads(line).items()})
    os.environ.pop(ENV, None)
    from .logs import redirect_from_env
    redirect_from_env()  # (--redirects / --tee: where this rank's worker writes)
    from mindspeed_ha.process import end_with_agent
    end_with_agent()  # (a fork of the template: the template's watch did not come with it)


def _report(fd: int, text: str) -> None:
    try:
        os.write(fd, (text + "\n").encode())  # one short write: atomic on a pipe
    except OSError:
        pass


def _serve_forks(fork_dir: str, report: int) -> str:
    """The template: fork a spare for every ``spawn`` line on stdin; report each child's end. Returns
    only in a forked spare, with its assignment; the template itself exits once stdin closes and
    every child has ended (a worker's exit code can be reported only by its parent)."""
    def reap(*_):
        for pid, code in fork_server.reaped_children():
            _report(report, f"exit {pid} {code}")

    template, agent = os.getpid(), int(os.environ.get(AGENT_PID) or os.getppid())
    signal.signal(signal.SIGCHLD, reap)
    # Python's collector would walk, and so copy, every page of the template's heap in each fork:
    # what exists now is left out of collection for good (the forks still collect what they make).
    gc.collect()
    gc.freeze()
    for line in sys.stdin:
        order, _, assigned = line.strip().partition(" ")
        if order in ("spawn", "start") and os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            if order == "start":
                return _forked_worker(assigned, report)
            return _forked_spare(fork_dir, report, template, agent)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            sys.exit(0)
        _report(report, f"exit {pid} {os.waitstatus_to_exitcode(status)}")


def _own_session() -> None:
    """A fork's own session (the agent signals its process group) and no stdin of the template's."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def _forked_worker(assigned: str, report: int) -> str:
    """A fresh fork of the template that is one of the job's first workers: its assignment came
    with the order."""
    _own_session()
    _report(report, f"worker {os.getpid()} {json.loads(assigned)['RANK']}")
    os.close(report)
    return assigned + "\n"


def _forked_spare(fork_dir: str, report: int, template: int, agent: int) -> str:
    """In a fresh fork of the template: own session (the agent signals its process group), no
    stdin of the template's, then wait on its FIFO for the assignment — ending quietly, like a
    spare whose stdin closed, once the template or the agent is gone."""
    _own_session()
    fifo = os.path.join(fork_dir, str(os.getpid()))
    os.mkfifo(fifo, 0o600)
    fd = os.open(fifo, os.O_RDWR)  # a writer of its own: no end-of-file while it waits
    _report(report, f"spare {os.getpid()}")
    os.close(report)
    data = b""
    while not data.endswith(b"\n"):
        if select.select([fd], [], [], 1.0)[0]:
            data += os.read(fd, 65536)
        elif os.getppid() != template or not _exists(agent):
            os._exit(0)
    os.close(fd)
    os.unlink(fifo)
    return data.decode()


def assignment(rank: int, local_rank: int, restarts: int, extra: dict | None = None) -> bytes:
    return (json.dumps({"RANK": rank, "LOCAL_RANK": local_rank, "MINDSPEED_HA_RESTART_COUNT": restarts,
                        **(extra or {})}) + "\n").encode()


def wanted(script_args: list[str], env=os.environ) -> int:
    """How many spares an agent keeps: ``--ha-spares`` when the job's HA options (flags or
    environment) include recover, else 0. MINDSPEED_HA_SPARE_WORKER=0 turns them off."""
    from mindspeed_ha.options import from_script_args
    if env.get("MINDSPEED_HA_SPARE_WORKER", "1") == "0":
        return 0
    opts = from_script_args(script_args, env)
    return opts.spares if opts is not None and "recover" in opts.strategies else 0


def node_device(env=os.environ) -> Accelerator | None:
    """What this node's workers will train on (None: they will refuse, and say why)."""
    from mindspeed_ha.device import DeviceError, detect
    try:
        return detect(env)
    except DeviceError:
        return None


def forks_workers(script_args: list[str], env=os.environ) -> bool:
    """Whether a node's first workers are forks of a template: a script with HA on (it waits for an
    assignment in a template, as a spare does), on a node that trains on the CPU.
    MINDSPEED_HA_FORK_WORKERS=0 turns it off."""
    from mindspeed_ha.options import from_script_args
    if env.get("MINDSPEED_HA_FORK_WORKERS", "1") == "0" or not hasattr(os, "fork"):
        return False
    opts = from_script_args(script_args, env)
    if opts is None or not opts.enabled:
        return False
    acc = node_device(env)
    return acc is not None and acc.on_cpu


class Forked:
    """Popen's interface (pid, poll, wait, returncode) for a spare the template forked: its end comes
    from the template's report."""

    def __init__(self, pid: int, pool: "Pool"):
        self.pid, self.pool = pid, pool
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.pool.read_reports()
            self.returncode = self.pool.ended.pop(self.pid, None)
            if self.returncode is None and self.pool.template is None and not _exists(self.pid):
                self.returncode = 1  # the template died before reporting it: its code is lost
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        t0 = time.monotonic()
        while (code := self.poll()) is None:
            if timeout is not None and time.monotonic() > t0 + timeout:
                raise subprocess.TimeoutExpired(f"spare {self.pid}", timeout)
            time.sleep(0.01)
        return code


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exists(pid: int) -> bool:
    """A running process (an exited one its parent has not reaped yet is not: a spare waiting on a
    zombie agent would hold the agent's output pipes open, and whoever waits to reap the agent
    would wait on those pipes first)."""
    import psutil
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


class Pool:
    """An agent's spares: ``wanted`` of them, forked by the template (or started as processes of
    ``cmd`` with ``env``), replaced the moment one is handed out or ends."""

    RETRY_S = 5.0  # after a spare died on its own: not a tight loop of failing starts

    def __init__(self, wanted_n: int, cmd: list[str], env: dict, events, who: str, fork_dir: str,
                 fork_workers: bool = False):
        """``fork_workers``: the template also starts the node's first workers (``start_workers``)."""
        self.wanted, self.cmd, self.env, self.events, self.who = wanted_n, cmd, env, events, who
        self.spares: list[Forked | Process] = []  # in the order they were made
        self.ready: set[int] = set()    # pids that reported waiting for a rank
        self.ended: dict[int, int] = {}  # forked pid -> exit code, as the template reported it
        self.started: dict[int, Forked] = {}  # rank -> a first worker the template forked
        self.retry_at = 0.0
        self._buf = b""
        self._report_r, self._report_w = os.pipe()
        os.set_blocking(self._report_r, False)
        self.template: Process | None = None
        if (wanted_n > 0 or fork_workers) and hasattr(os, "fork") and hasattr(os, "mkfifo"):
            self.fork_dir = fork_dir
            os.makedirs(fork_dir, exist_ok=True)
            self.template = self._popen({FORK_DIR: fork_dir})
            self.events.emit("spare_template_start", worker_pid=self.template.pid)
            if wanted_n:
                self._request(wanted_n)

    def start_workers(self, assignments: dict[int, bytes], timeout: float) -> dict[int, "Forked"]:
        """Fork the first workers from the template: rank -> the handle of each that runs. The template
        imports first (seconds, more on a loaded host). If it dies meanwhile, the ranks it did not
        start are the caller's to start as processes; if it is not done within ``timeout``, it is
        ended with what it started (nothing may run twice) and the caller starts them all."""
        if self.template is None:
            return {}
        assert self.template.stdin is not None  # (_popen opens it as a pipe)
        try:
            self.template.stdin.write(b"".join(b"start " + line for line in assignments.values()))
            self.template.stdin.flush()
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        while len(self.started) < len(assignments) and self.template.poll() is None:
            if time.monotonic() > deadline:
                log.warning("%s: the spare template started %d of %d workers in %.0fs: they start as processes",
                            self.who, len(self.started), len(assignments), timeout)
                _kill_group(self.template.pid)
                self.template.wait()
                time.sleep(0.2)
                self.read_reports()  # (a fork's report may still have been on its way)
                for p in self.started.values():
                    _kill_group(p.pid)
                self.started.clear()
                break
            self.read_reports()
            time.sleep(0.01)
        self.read_reports()
        return dict(self.started)

    def maintain(self, now: float) -> None:
        p: Forked | Process  # a spare, in each loop below
        self.read_reports()
        if self.template is not None and self.template.poll() is not None:
            code = self.template.returncode
            log.warning("%s: spare template (pid %d) ended with %s; %s", self.who, self.template.pid, code,
                        "restarts will start new workers" if code == 0 else "spares are started as processes")
            self.template = None
            if code == 0:  # the script cannot use a spare (it ended without a rank)
                self.wanted = 0
            for p in [p for p in self.spares if isinstance(p, Forked)]:  # nobody could report their end
                _kill_group(p.pid)
                self._forget(p)
        for p in list(self.spares):
            if p.poll() is None:
                continue
            self._forget(p)
            log.warning("%s: spare worker (pid %d) ended with %s%s", self.who, p.pid, p.returncode,
                        "; restarts will start new workers" if p.returncode == 0 else "")
            if p.returncode == 0:
                self.wanted = 0
            self.retry_at = now + self.RETRY_S
            if self.template is not None:
                self._request(1)
        if self.template is None:
            while len(self.spares) < self.wanted and now >= self.retry_at:
                p = self._popen({})
                self.spares.append(p)
                self.events.emit("spare_start", worker_pid=p.pid, forked=False)

    def hand_over(self, line: bytes) -> tuple[Forked | Process, bool] | None:
        """Give a spare the assignment ``line``: (its process handle, whether it was ready), or None
        when there is none. A ready spare first; one still starting is better than none."""
        self.read_reports()
        for p in sorted(self.spares, key=lambda p: p.pid not in self.ready):
            warm = p.pid in self.ready
            if p.poll() is None and self._assign(p, line):
                self._forget(p)
                if isinstance(p, Forked):
                    self._request(1)
                return p, warm
        return None

    def warm(self) -> int:
        """Spares ready to take a rank now (what a migration needs)."""
        return sum(1 for p in self.spares if p.pid in self.ready and p.poll() is None)

    def read_reports(self) -> None:
        try:
            while chunk := os.read(self._report_r, 65536):
                self._buf += chunk
        except BlockingIOError:
            pass
        *lines, self._buf = self._buf.split(b"\n")
        for text in lines:
            what, word, *rest = text.decode().split()
            pid = int(word)
            if what == "exit":
                self.ended[pid] = int(rest[0])
            elif what == "worker":
                self.started[int(rest[0])] = Forked(pid, self)
            elif what == "spare":
                self.ready.add(pid)
                if self.template is not None and not any(p.pid == pid for p in self.spares):
                    self.spares.append(Forked(pid, self))
                    self.events.emit("spare_start", worker_pid=pid, forked=True)

    def close(self) -> None:
        for p in self.spares + ([self.template] if self.template is not None else []):
            _kill_group(p.pid)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.spares = []
        os.close(self._report_r)
        os.close(self._report_w)

    def _popen(self, extra: dict) -> Process:
        # torch.cuda.is_available() from NVML, not the driver: a template on a GPU node forks spares and
        # must not hold a CUDA context (megatron-core asks at import). (The CPU shim drops it again.)
        env = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", **self.env, ENV: "1", AGENT_PID: str(os.getpid()), **extra}
        return fork_server.popen(self.cmd, env, {REPORT_FD: self._report_w})

    def _request(self, n: int) -> None:
        assert self.template is not None and self.template.stdin is not None  # (only while the template runs)
        try:
            self.template.stdin.write(b"spawn\n" * n)
            self.template.stdin.flush()
        except OSError:
            pass  # it died: maintain() notices

    def _assign(self, p, line: bytes) -> bool:
        try:
            if isinstance(p, Forked):
                fd = os.open(os.path.join(self.fork_dir, str(p.pid)), os.O_WRONLY | os.O_NONBLOCK)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
            else:
                p.stdin.write(line)
                p.stdin.close()
            return True
        except OSError:  # gone, or not yet waiting on its FIFO
            return False

    def _forget(self, p) -> None:
        self.spares.remove(p)
        self.ready.discard(p.pid)
