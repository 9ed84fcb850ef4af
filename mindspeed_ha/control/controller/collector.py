"""Python's cyclic garbage collector, held off while a recovery runs.

A full collection walks every object the process tracks, and holds the GIL while it does. At 16,384
ranks the controller's tables and a status round's answers are millions of objects: a simulated
recovery there met three full collections, 0.6–0.9 s of its 2–3 s (``benchmarks/controller_scale.py``).
So the controller holds the collector from the fault until the recovery's first step has ended, and
then lets it run as before: what the recovery left, it collects then. Reference counting frees all the
rest meanwhile, as ever. A process whose collector was off already (Megatron-LM's ``--manual-gc``) is
left as it is.
"""
from __future__ import annotations

import gc


class CollectorHold:
    def __init__(self) -> None:
        self.held = False

    def entered(self, state: str) -> None:
        """The controller's state machine moved: a pause begins a recovery (a fault's, or a planned
        one's); the job's end ends it. Its first step's end is told by ``release``."""
        if state == "pause":
            self.hold()
        elif state in ("exit", "done"):
            self.release()

    def hold(self) -> None:
        if not self.held and gc.isenabled():
            gc.disable()
            self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            gc.enable()
