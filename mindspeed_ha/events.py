"""Event log and text log.

``DIR/events/rank_<R>.jsonl`` and ``DIR/events/controller.jsonl``: one JSON object per line, each
with ``event``, ``time``, ``pid`` (and ``rank`` for ranks). Every line is one ``write`` on an
unbuffered file, so a SIGKILLed process loses nothing it already emitted.
``DIR/ttp_log.log``: the human-readable log of every process of the node (ranks, agent, controller),
rotating 10 MB x 5, level ``MINDSPEED_HA_LOG_LEVEL``. Many processes write and rotate the one file, so
its handler takes a lock around both (concurrent-log-handler): no line is lost or torn at a rotation.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

from concurrent_log_handler import ConcurrentRotatingFileHandler

DEFAULT_LOG_DIR = "./logs"
LOGGER_NAME = "mindspeed_ha"


def log_dir_from_env(cli_value: str | None = None) -> str:
    return cli_value or os.environ.get("MINDSPEED_HA_LOG_DIR") or DEFAULT_LOG_DIR


class EventLog:
    def __init__(self, log_dir: str, name: str, rank: int | None = None):
        os.makedirs(os.path.join(log_dir, "events"), exist_ok=True)
        self.path = os.path.join(log_dir, "events", f"{name}.jsonl")
        self.rank = rank
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        self.listeners: list = []   # called with every record emitted (the controller's metrics)

    @classmethod
    def for_rank(cls, log_dir: str, rank: int) -> "EventLog":
        return cls(log_dir, f"rank_{rank}", rank)

    def emit(self, event: str, **fields) -> dict:
        record = {"event": event, "time": time.time(), "pid": os.getpid()}
        if self.rank is not None:
            record["rank"] = self.rank
        record.update(fields)
        line = (json.dumps(record, default=str) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)  # O_APPEND: one write, one whole line, even across processes
        for listener in self.listeners:
            listener(record)
        return record

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


# Events renamed since logs were first written (old name -> name now): a log of an older release reads
# with today's names, its old one kept as ``renamed_from``. "repair" is the copy of a shard from its
# twin only; a strategy fails, a restore plans, a resize changes the layout.
RENAMED = {"repair_failed": "strategy_failed", "repair_plan": "restore_plan", "elastic_plan": "resize_plan"}


def read_events(path: str) -> list[dict]:
    """Parse a .jsonl event file, skipping a torn last line; renamed events under their names now."""
    out: list[dict] = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") in RENAMED:
                e = {**e, "event": RENAMED[e["event"]], "renamed_from": e["event"]}
            out.append(e)
    return out


_configured: set[str] = set()


def setup_text_log(log_dir: str, rank: int | None = None) -> logging.Logger:
    """Configure the ``mindspeed_ha`` logger: DIR/ttp_log.log (10 MB x 5) plus stderr for warnings."""
    logger = logging.getLogger(LOGGER_NAME)
    level = os.environ.get("MINDSPEED_HA_LOG_LEVEL", "INFO").upper()
    logger.setLevel(getattr(logging, level, logging.INFO))
    path = os.path.abspath(os.path.join(log_dir, "ttp_log.log"))
    if path in _configured:
        return logger
    os.makedirs(log_dir, exist_ok=True)
    who = f"rank {rank}" if rank is not None else f"pid {os.getpid()}"
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s [{who}] %(name)s: %(message)s")
    max_bytes = int(os.environ.get("MINDSPEED_HA_LOG_MAX_BYTES", 10 * 1024 * 1024))
    fh = ConcurrentRotatingFileHandler(path, maxBytes=max_bytes, backupCount=5)
    fh.setFormatter(fmt)
    logger.addHandler(fh)
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in logger.handlers):
        sh = logging.StreamHandler()
        sh.setFormatter(fmt)
        sh.setLevel(logging.INFO)
        logger.addHandler(sh)
    logger.propagate = False
    _configured.add(path)
    return logger


def get_logger(sub: str = "") -> logging.Logger:
    return logging.getLogger(f"{LOGGER_NAME}.{sub}" if sub else LOGGER_NAME)
