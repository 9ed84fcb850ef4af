"""How every benchmark starts a job, so that none is left behind.

A job (``torchrun`` or ``mindspeed-ha run``, and the workers they start) is a process tree that
outlives the script that started it unless told otherwise: ``subprocess.run``'s timeout kills only
the launcher, and workers under plain torchrun never notice their launcher is gone — a benchmark
that timed out once left four workers training for 35 minutes, slowing everything measured after
them. So:

- ``popen`` starts the job in a process session of its own, and the kernel ends its launcher when
  this script ends, however it ends (``process.end_with_parent``: a SIGKILL of this script too);
  a worker of plain torchrun ends with its launcher the same way (``process.end_with_launcher``,
  set by the engine at every worker's start);
- ``run`` is ``subprocess.run`` on it; on a timeout, an error or an interrupt it ends the whole job
  (``end``) before raising: the launcher's session, every process below it, and every worker session
  the job's agents name in their ``worker_start`` events (workers of ``mindspeed-ha run`` run in
  sessions of their own and outlive a lost agent by design: a SIGKILL of the benchmark itself can
  leave those, and only those, until their job's own end).
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _with_this_script() -> None:
    from mindspeed_ha.process import end_with_parent
    end_with_parent()


def popen(cmd, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` in a session of its own, ended by the kernel when this script ends."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_with_this_script, **kwargs)


def run(cmd, *, timeout: float | None = None, log_dir: str | None = None, input=None, check: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a job: the whole job ends on a timeout, an error or an interrupt
    (``log_dir``: its ``--ha-log-dir``, where its agents name their workers)."""
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(cmd, **kwargs) as p:
        try:
            out, err = p.communicate(input, timeout=timeout)
        except BaseException:
            end(p, log_dir)
            p.communicate()
            raise
    if check and p.returncode:
        raise subprocess.CalledProcessError(p.returncode, p.args, out, err)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def end(p: subprocess.Popen, log_dir: str | None = None) -> list[int]:
    """SIGKILL the job ``p`` started: its session, every process below it, every worker its agents
    named. Returns the pids signalled."""
    pids = set()
    try:
        import psutil
        pids |= {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
    except Exception:  # (gone already, or no psutil: the sessions below still go)
        pass
    for path in glob.glob(os.path.join(log_dir, "**", "events", "agent_*.jsonl"), recursive=True) if log_dir else ():
        for line in open(path, errors="replace"):
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "worker_start" and e.get("worker_pid"):
                pids.add(int(e["worker_pid"]))
    for target in (p.pid, *pids):
        for kill in (os.killpg, os.kill):  # (a worker's session is its own pid)
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return sorted(pids)
