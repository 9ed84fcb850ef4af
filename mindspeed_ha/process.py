"""Ending this process: at once, without interpreter shutdown (flush what was written, end the
checkpoint writer's helper process, and go: ``os._exit``), or at the end of a job."""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import sys
import threading
from typing import NoReturn


# The process that started this one, as it was when this module was first imported (a worker imports
# it before torch: its launcher may be gone by the time the worker is ready to say so).
_STARTED_BY = os.getppid()


def end_with_parent(sig: int | None = None, parent: int | None = None) -> bool:
    """Have the kernel send this process ``sig`` (default SIGKILL) when its parent ends (Linux's
    ``PR_SET_PDEATHSIG``); if the parent (``parent``: the one expected, default the current one)
    ended already, end now. False where the OS has no such thing. (The signal follows the thread
    that started the process: launchers start theirs from their main thread.)"""
    import ctypes
    import signal
    parent = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(sig or signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # (it ended before the kernel was told)
        os._exit(1)
    return True


AGENT_PID_ENV = "MINDSPEED_HA_AGENT_PID"  # (set by mindspeed-ha run's agent for its workers)
SPARE_AGENT_PID_ENV = "MINDSPEED_HA_SPARE_AGENT_PID"  # (its spare template and spares: launcher/spare.py)
AGENT_CHECK_S = 0.5
_watching: set[int] = set()  # the processes (pids: a fork inherits the set, not the thread) that watch their agent


def end_with_launcher(env=None) -> None:
    """A worker ends when its launcher does: one whose launcher was killed (the OOM killer, a scheduler
    that ends only the main process) would otherwise train on for good, holding its devices, as
    nobody is left to end it. A worker of a plain launcher (torchrun: ``TORCHELASTIC_RUN_ID``) by
    the kernel's parent-death signal; one of ``mindspeed-ha run``'s agents, its spare template and its
    spares, which need not be the agent's children (a fork server's), by watching the agent
    (``end_with_agent``)."""
    env = os.environ if env is None else env
    if env.get(AGENT_PID_ENV) or env.get(SPARE_AGENT_PID_ENV):
        end_with_agent(env)
    elif env.get("TORCHELASTIC_RUN_ID") and not env.get("MINDSPEED_HA_AGENT_NODE") \
            and env.get("MINDSPEED_HA_SPARE") != "1":
        end_with_parent(parent=_STARTED_BY)


def end_with_agent(env=None) -> None:
    """This process ends within ``AGENT_CHECK_S`` of its agent's (``mindspeed-ha run``) end: a thread
    checks that the agent's process is still the one that was there at the start (its pid, and its
    start time, which a pid reused by another process would not have). Once per process (a fork starts
    its own: threads do not survive a fork)."""
    env = os.environ if env is None else env
    pid = int(env.get(AGENT_PID_ENV) or env.get(SPARE_AGENT_PID_ENV) or 0)
    if not pid or os.getpid() in _watching:
        return
    started = _start_time(pid)
    if started is None:  # (gone already)
        _agent_gone(pid)
    _watching.add(os.getpid())

    def watch() -> None:
        import time
        while True:
            time.sleep(AGENT_CHECK_S)
            if _start_time(pid) != started:
                _agent_gone(pid)
    threading.Thread(target=watch, name="mindspeed-ha-agent-watch", daemon=True).start()


def _start_time(pid: int) -> float | None:
    """When process ``pid`` started (None: no such process, or it has exited and waits to be reaped)."""
    import psutil
    try:
        p = psutil.Process(pid)
        return None if p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else p.create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:
        return 0.0


def _agent_gone(pid: int) -> NoReturn:
    from mindspeed_ha import exitcodes
    sys.stderr.write(f"mindspeed-ha: process {os.getpid()} ends: its agent (mindspeed-ha run, pid {pid}) is gone, "
                     "and nothing else would end it\n")
    exit_now(exitcodes.FAULT)


def exit_now(code: int) -> NoReturn:
    for child in multiprocessing.active_children():  # e.g. the checkpoint writer's manager
        child.terminate()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(code)


def exit_done(code: int = 0) -> NoReturn:
    """End a process whose work is done: what the interpreter's exit does that anyone relies on —
    non-daemon threads joined, the ``atexit`` handlers run (logging, multiprocessing's children,
    libraries' own flushes), stdio flushed — without its finalisation. Tearing down torch's and
    megatron-core's modules and collecting their heap is 0.3–0.6 s of CPU per process for nothing:
    a 4-rank job on 2 cores took 2.7 s from its last step to its last worker's exit, 0.1 s without."""
    main = threading.main_thread()
    for t in threading.enumerate():
        if t is not main and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # (CPython's own; what Py_Finalize calls first)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def end_of_job() -> NoReturn:
    """A worker's end after its last step: the job's last barrier, then its groups torn down. A
    communicator replaced by a recovery may still be being released: a collective abandoned by a stop
    can wait for a peer that is gone until its timeout. Tearing the other groups down (or the
    interpreter's own shutdown) under it can abort the process, which has nothing left to do: it
    ends at once instead."""
    import torch.distributed as dist
    from mindspeed_ha.comm import groups
    if dist.is_initialized():
        dist.barrier()
        if groups.releasing():
            exit_now(0)
        dist.destroy_process_group()
    if not groups.released(timeout=10.0):
        exit_now(0)
    exit_done(0)
