"""The user's health hook (``--ha-health-cmd``): evidence of a sub-healthy rank from outside training.

Each launcher agent runs the command every ``--ha-health-interval`` seconds, in the background (a slow
check never holds the agent up; one still running at the next interval is killed and counts as
failed). Its environment names the node's ranks: ``MINDSPEED_HA_LOCAL_RANKS`` (local ranks),
``MINDSPEED_HA_RANKS`` and ``MINDSPEED_HA_PIDS`` (global ranks and worker pids, in the same order).
A non-zero exit makes every rank of the node sub-healthy; exit 0 with lines
``sub-healthy LOCAL_RANK [why...]`` names some of them; anything else is ignored. The agent sends
what it found to the controller, which treats it like a straggler (an event; a migration with
``--ha-migrate-stragglers``).
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from typing import IO

from ..events import get_logger

log = get_logger("launcher.health")


class HealthHook:
    def __init__(self, cmd: str, interval_s: float):
        self.cmd, self.interval = cmd, float(interval_s)
        self.next_at = time.monotonic() + self.interval
        self.proc: subprocess.Popen | None = None
        self.out: IO[bytes] | None = None
        self.started = 0.0

    def poll(self, now: float, workers: dict) -> list[tuple[list[int], str]]:
        """``workers``: rank -> Worker. Returns [(global ranks, why)] the finished check named."""
        found = []
        if self.proc is not None and (self.proc.poll() is not None or now - self.started > self.interval):
            found = self._finish(workers)
        if self.proc is None and now >= self.next_at:
            self.next_at = now + self.interval
            self._start(workers)
        return found

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.out is not None:
            self.out.close()

    def _start(self, workers: dict) -> None:
        ws = sorted(workers.values(), key=lambda w: w.rank)
        env = dict(os.environ, MINDSPEED_HA_LOCAL_RANKS=",".join(str(w.local_rank) for w in ws),
                   MINDSPEED_HA_RANKS=",".join(str(w.rank) for w in ws),
                   MINDSPEED_HA_PIDS=",".join(str(w.popen.pid) for w in ws))
        self.out = tempfile.TemporaryFile()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, shell=True, env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def _finish(self, workers: dict) -> list[tuple[list[int], str]]:
        proc, out = self.proc, self.out
        assert proc is not None and out is not None  # (poll calls this only while a check runs)
        self.proc = self.out = None
        timed_out = proc.poll() is None
        if timed_out:
            proc.kill()
            proc.wait()
        out.seek(0)
        text = out.read().decode(errors="replace")
        out.close()
        by_local = {w.local_rank: w.rank for w in workers.values()}
        if timed_out or proc.returncode != 0:
            last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
            why = (f"health check ran past {self.interval:g}s" if timed_out
                   else f"health check exited {proc.returncode}{': ' + last[:200] if last else ''}")
            return [(sorted(by_local.values()), why)]
        found = []
        for line in text.splitlines():
            word, _, rest = line.strip().partition(" ")
            lr, _, why = rest.strip().partition(" ")
            if word == "sub-healthy" and lr.isdigit() and int(lr) in by_local:
                found.append(([by_local[int(lr)]], f"health check: {why.strip() or 'sub-healthy'}"[:240]))
        return found
