"""Where a node's workers write stdout and stderr: torchrun's ``--log-dir``, ``--redirects``,
``--tee`` and ``--local-ranks-filter``, laid out by torch's own ``DefaultLogsSpecs``
(``LOG_DIR/<job>_<random>/attempt_0/<local rank>/stdout.log``) and copied to this console by torch's
``TailLog`` with a rank prefix (``[default5]:``) where ``--tee`` asks for it.

A restarted worker (a spare taking the rank, or a new process) appends to its rank's files, after a
line that says so, so one file holds a rank's whole story and the tail keeps following it.
"""
from __future__ import annotations

import os
import sys


class WorkerLogs:
    def __init__(self, log_dir: str | None, redirects: str, tee: str, local_ranks_filter: str, job_id: str,
                 nproc: int, node_rank: int, role: str = "default"):
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
        self.files = False
        self.paths: dict[int, tuple[str, str]] = {}   # local rank -> (stdout, stderr); "" = the console
        self._tails = []
        if not log_dir and Std.from_str(redirects) == Std.NONE and Std.from_str(tee) == Std.NONE:
            return  # torchrun's default: workers write to this console
        filt = {int(x) for x in local_ranks_filter.split(",") if x.strip()} if local_ranks_filter else None
        spec = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.from_str(redirects), tee=Std.from_str(tee),
                                local_ranks_filter=filt)
        envs = {lr: {"TORCHELASTIC_RUN_ID": job_id, "TORCHELASTIC_RESTART_COUNT": "0"} for lr in range(nproc)}
        dest = spec.reify(envs)
        self.root = spec.root_log_dir
        self.files = True
        self.paths = {lr: (dest.stdouts[lr], dest.stderrs[lr]) for lr in range(nproc)}
        from torch.distributed.elastic.multiprocessing.tail_log import TailLog
        prefixes = {lr: f"[{role}{node_rank * nproc + lr}]:" for lr in range(nproc)}
        for name, files, stream in (("stdout", dest.tee_stdouts, sys.stdout), ("stderr", dest.tee_stderrs, sys.stderr)):
            files = {lr: f for lr, f in files.items() if f and f != os.devnull}
            if files:
                self._tails.append(TailLog(name, files, stream, prefixes).start())

    def env(self, local_rank: int) -> dict:
        """Variables a spare taking this rank redirects itself with (``redirect_from_env``)."""
        out, err = self.paths.get(local_rank, ("", ""))
        return {"MINDSPEED_HA_STDOUT": out, "MINDSPEED_HA_STDERR": err} if self.files else {}

    def open(self, local_rank: int, restarts: int):
        """(stdout, stderr) for a new worker's Popen: files appended to, or None (this console)."""
        out, err = self.paths.get(local_rank, ("", ""))
        return _open(out, restarts), _open(err, restarts)

    def close(self) -> None:
        for t in self._tails:
            t.stop()


def _open(path: str, restarts: int):
    if not path:
        return None
    f = open(path, "a", buffering=1)
    if restarts:
        f.write(f"---- mindspeed-ha: this rank's worker, restart {restarts} ----\n")
        f.flush()
    return f


def redirect_from_env() -> None:
    """In a spare that has just taken a rank: write where that rank's worker writes."""
    for var, fd in (("MINDSPEED_HA_STDOUT", 1), ("MINDSPEED_HA_STDERR", 2)):
        path = os.environ.pop(var, "")
        if not path:
            continue
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
