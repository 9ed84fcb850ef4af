"""Pre-started spare workers for recover (ARF).

Most of a restarted worker's time before it can join is Python start-up: importing torch and
megatron-core, patching, building the dataset — seconds, on the recovery's critical path. With
recover on, each agent keeps ``--ha-spares`` processes (default 1) that have done all of that and
wait on their stdin; on a restart order the agent hands one the lost rank (one JSON line of
environment variables), preferring one that said it is ready, and starts a replacement at once.
The spare then continues exactly like a restarted worker.

A replacement starting while the job trains competes with it for the CPU. Where the agent may give
a thread its normal priority back (root, or CAP_SYS_NICE), replacements start under SCHED_IDLE —
they run only on otherwise idle CPU time — and are set back to SCHED_OTHER, every thread, on
assignment. Elsewhere they start at normal priority: an idle-class process that cannot leave that
class would train a rank at the lowest priority forever.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from ..events import get_logger

ENV = "MINDSPEED_HA_SPARE"
READY_FD = "MINDSPEED_HA_SPARE_READY_FD"  # the spare writes one byte there once it waits for a rank

log = get_logger("launcher.spare")


def is_spare() -> bool:
    return os.environ.get(ENV) == "1"


def wait_for_assignment() -> None:
    """Tell the agent this spare is ready, then block until it assigns a rank; its variables go
    into ``os.environ``. End quietly when stdin closes without one (the job is over, or the agent
    is gone)."""
    fd = os.environ.pop(READY_FD, None)
    if fd is not None:
        try:
            os.write(int(fd), b"1")
            os.close(int(fd))
        except (OSError, ValueError):
            pass
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    normal_priority(os.getpid())  # (the agent did it already; threads made meanwhile too)
    os.environ.update({str(k): str(v) for k, v in json.loads(line).items()})
    os.environ.pop(ENV, None)


def may_restore_priority() -> bool:
    """Whether this process may take a thread out of SCHED_IDLE (tried on a throwaway thread)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    ok = []

    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except OSError:
            pass
    t = threading.Thread(target=probe, name="mindspeed-ha-priority-probe")
    t.start()
    t.join()
    return bool(ok)


def idle_priority(pid: int) -> None:
    """Its main thread, whose policy every thread it starts inherits."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass


def normal_priority(pid: int) -> None:
    """Every thread of ``pid`` back to SCHED_OTHER (best effort: a thread may just have ended)."""
    if not hasattr(os, "SCHED_IDLE"):
        return
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass


def assignment(rank: int, local_rank: int, restarts: int) -> bytes:
    return (json.dumps({"RANK": rank, "LOCAL_RANK": local_rank, "MINDSPEED_HA_RESTART_COUNT": restarts})
            + "\n").encode()


def wanted(script_args: list[str], env=os.environ) -> int:
    """How many spares an agent keeps: ``--ha-spares`` when the job's HA options (flags or
    environment) include recover, else 0. MINDSPEED_HA_SPARE_WORKER=0 turns them off."""
    from mindspeed_ha.options import HAConfigError, add_ha_args, from_args
    import argparse
    if env.get("MINDSPEED_HA_SPARE_WORKER", "1") == "0":
        return 0
    ns, _ = add_ha_args(argparse.ArgumentParser(add_help=False)).parse_known_args(script_args)
    try:
        opts = from_args(ns, env)
    except HAConfigError:
        return 0  # the workers report it
    return opts.spares if "recover" in opts.strategies else 0


class Pool:
    """An agent's spares: ``wanted`` processes of ``cmd``, each started with ``env`` plus the spare
    markers, replaced the moment one is handed out or ends."""

    RETRY_S = 5.0  # after a spare died on its own: not a tight loop of failing starts

    def __init__(self, wanted_n: int, cmd: list[str], env: dict, events, who: str):
        self.wanted, self.cmd, self.env, self.events, self.who = wanted_n, cmd, env, events, who
        self.idle_class = wanted_n > 0 and may_restore_priority()
        self.spares: list[tuple[subprocess.Popen, int]] = []  # (process, read end of its ready pipe)
        self.ready: set[int] = set()                          # pids that said they wait for a rank
        self.retry_at = 0.0
        self.started = 0

    def maintain(self, now: float) -> None:
        for p, fd in list(self.spares):
            if p.poll() is None:
                continue
            self._forget(p, fd)
            log.warning("%s: spare worker (pid %d) ended with %s%s", self.who, p.pid, p.returncode,
                        "; restarts will start new workers" if p.returncode == 0 else "")
            if p.returncode == 0:  # the script cannot use a spare (it ended without a rank)
                self.wanted = 0
            self.retry_at = now + self.RETRY_S
        while len(self.spares) < self.wanted and now >= self.retry_at:
            self._start()

    def take(self) -> tuple[subprocess.Popen, bool] | None:
        """A spare for a lost rank, a ready one first; (process, whether it was ready)."""
        self._poll_ready()
        live = [(p, fd) for p, fd in self.spares if p.poll() is None]
        if not live:
            return None
        p, fd = max(live, key=lambda s: s[0].pid in self.ready)
        warm = p.pid in self.ready
        self._forget(p, fd)
        if self.idle_class:
            normal_priority(p.pid)  # (a no-op for one that never was idle-class)
        return p, warm

    def close(self) -> None:
        for p, fd in self.spares:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
            os.close(fd)
        self.spares = []

    def _start(self) -> None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        env = {**self.env, ENV: "1", READY_FD: str(w)}
        p = subprocess.Popen(self.cmd, env=env, stdin=subprocess.PIPE, start_new_session=True, pass_fds=(w,))
        os.close(w)
        # The first spares start with the job at normal priority (it is starting up anyway); a
        # replacement, started while the job trains, runs on idle CPU only.
        idle = self.idle_class and self.started >= self.wanted
        if idle:
            idle_priority(p.pid)
        self.started += 1
        self.spares.append((p, r))
        self.events.emit("spare_start", worker_pid=p.pid, idle_class=idle)

    def _poll_ready(self) -> None:
        for p, fd in self.spares:
            if p.pid in self.ready:
                continue
            try:
                if os.read(fd, 1):
                    self.ready.add(p.pid)
            except BlockingIOError:
                pass

    def _forget(self, p: subprocess.Popen, fd: int) -> None:
        self.spares.remove((p, fd))
        self.ready.discard(p.pid)
        os.close(fd)
