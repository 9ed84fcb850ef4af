"""Ending this process at once, without interpreter shutdown: flush what was written, end the
checkpoint writer's helper process, and go (``os._exit``)."""
from __future__ import annotations

import logging
import multiprocessing
import os
import sys


def exit_now(code: int) -> None:
    for child in multiprocessing.active_children():  # e.g. the checkpoint writer's manager
        child.terminate()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(code)
