"""Where the active controller is announced, and where a client that lost it looks next.

The active controller writes ``controller.json`` into the job's log dir (and publishes the same record
in the job store, discovery.py); ranks, agents and the operator's CLI read it. ``Candidates`` is a
client's list of where to try next after its controller stopped answering: the newest announcement,
the standbys it named, the old controller.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .discovery import JobStore


def read_controller_json(log_dir: str, job_id: str | None = None) -> dict[str, Any] | None:
    path = os.path.join(log_dir, "controller.json")
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or "endpoint" not in info:
        return None
    if job_id and info.get("job_id") and info.get("job_id") != job_id:
        return None  # a stale file from another job in the same log dir
    return info


def write_controller_json(log_dir: str, info: dict[str, Any]) -> None:
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, "controller.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, path)  # readers never see half a file


class Candidates:
    """Where a client that lost its controller looks next: the newest announcement (the job store's
    record or controller.json, whichever has the newer epoch; else MS_TFT_IP/MS_TFT_PORT), then the
    standbys in the order the controller announced them, then the old controller. A candidate that
    answers as standby is kept for ``standby_wait`` (it may be gathering a quorum), one that does not
    answer at all for ``answer_wait``."""

    def __init__(self, log_dir: str, job_id: str | None, answer_wait: float = 1.0, standby_wait: float = 4.0,
                 store: JobStore | None = None):
        self.log_dir, self.job_id, self.store = log_dir, job_id, store
        self.answer_wait, self.standby_wait = answer_wait, standby_wait
        self.backups: list[str] = []
        self.current: str | None = None
        self.epoch = 0
        self._tried: list[str] = []

    def announced(self) -> tuple[str, int, list[str]] | None:
        """(endpoint, epoch, standbys) of the newest announcement this process can see."""
        from .discovery import CONTROLLER_KEY, external_controller
        found = [read_controller_json(self.log_dir, self.job_id)]
        if self.store is not None:
            rec = self.store.seen(CONTROLLER_KEY)
            if rec and "endpoint" in rec and (not self.job_id or rec.get("job_id") in (None, self.job_id)):
                found.append(rec)
        records = [f for f in found if f]
        if not records:
            ext = external_controller()
            return (ext, 1, []) if ext else None
        info = max(records, key=lambda f: int(f.get("epoch", 1)))
        return info["endpoint"], int(info.get("epoch", 1)), list(info.get("backups") or [])

    def next(self, lost: str | None) -> str | None:
        """The next endpoint to try after ``lost`` stopped answering."""
        f = self.announced()
        if f and f[1] > self.epoch and f[0] != lost:
            return f[0]
        order = [e for e in (self.backups or (f[2] if f else [])) if e != lost]
        if f and f[0] not in order:
            order.append(f[0])
        if lost and lost not in order:
            order.append(lost)
        if not order:
            return f[0] if f else None
        untried = [e for e in order if e not in self._tried]
        if not untried:
            self._tried = []
            untried = order
        self._tried.append(untried[0])
        return untried[0]

    def connected(self, endpoint: str | None, epoch: int) -> None:
        self.current, self.epoch, self._tried = endpoint, max(self.epoch, epoch), []
