"""Where the training thread is held. An order for it not taken (or still running) for
``HELD_REPORT_S``: the thread is held somewhere (on the device, in a call that never returns, a
restarted worker's set-up). Where it is — its Python stack's innermost frames, and where the stop
stands — goes to the log, the event log and the controller (heartbeats carry it), whose "no answer"
then says it.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

HELD_REPORT_S = 10.0


def thread_stack(ident: int | None, frames: int = 6) -> str:
    """A thread's innermost Python frames, innermost first ("func (file:line) <- ..."); what it
    runs below Python (a device sync, a collective's set-up) is inside the first one."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "an unknown place (the thread is gone, or never ran a step)"
    out: list[str] = []
    while frame is not None and len(out) < frames:
        code = frame.f_code
        out.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})")
        frame = frame.f_back
    return " <- ".join(out)


class HeldWatch:
    """The training thread's orders, as the processor thread sees them. ``where_stop()``: where the
    rank's stop stands (``Stop.report``)."""

    def __init__(self, where_stop: Callable[[], str]) -> None:
        self.where_stop = where_stop
        self.training_ident: int | None = None   # the training thread (its hooks are called there)
        self.queued_at: float | None = None      # an order for it waits since (monotonic)
        self.running: tuple[str, float] | None = None  # the order it runs now, since (monotonic)
        self.held = ""   # where it is held, while an order has waited (or run) HELD_REPORT_S
        self._seen = 0.0

    def on_training_thread(self) -> None:
        self.training_ident = threading.get_ident()

    def queued(self) -> None:
        """An order for the training thread was queued."""
        if self.queued_at is None:
            self.queued_at = time.monotonic()

    def taken(self, action: str, more_waiting: bool) -> str:
        """The training thread took ``action``: a report that it was held ends (said in the returned
        line; empty if there was none)."""
        queued, self.queued_at = self.queued_at, time.monotonic() if more_waiting else None
        self.running = (action, time.monotonic())
        if not self.held:
            return ""
        self.held = ""
        return f"the training thread took {action} at last, " \
               f"{time.monotonic() - queued if queued is not None else float('nan'):.0f}s after it came"

    def ended(self) -> str:
        """The order the training thread ran ended: as ``taken``."""
        action = self.running[0] if self.running else "order"
        self.running = None
        if not self.held:
            return ""
        self.held = ""
        return f"the training thread's {action} ended at last"

    def deadline(self, why: str) -> str:
        """The stop's deadline passed after its abort: where the thread is, held for good."""
        self.held = f"{why}; it is in {thread_stack(self.training_ident)}; {self.where_stop()}"[:1500]
        return self.held

    def check(self, now: float) -> bool:
        """(processor thread) True when the thread is newly found held (``held`` says where); past
        HELD_REPORT_S the text is renewed at most once a second."""
        queued, running = self.queued_at, self.running
        if queued is not None and now - queued >= HELD_REPORT_S:
            what = f"has not taken the controller's order for {now - queued:.0f}s"
        elif running is not None and now - running[1] >= HELD_REPORT_S:
            what = f"has run the controller's {running[0]} order for {now - running[1]:.0f}s"
        else:
            return False
        first = not self.held
        if not first and now - self._seen < 1.0:
            return False
        self._seen = now
        self.held = (f"the training thread {what}; it is in {thread_stack(self.training_ident)}; "
                     f"{self.where_stop()}")[:1500]
        return first
