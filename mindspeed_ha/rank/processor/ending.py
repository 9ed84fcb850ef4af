"""How a rank's processor ends its process, and why: an ``exit`` order, a controller never reached
or no longer heard (the rank would train with HA off, or cut off from its job), and the scheduler's
stop signal, which becomes a preemption report instead.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Callable

from ...control.wire import protocol
from ...events import EventLog, get_logger

log = get_logger("control.processor")


def end(events: EventLog | None, code: int, text: str = "") -> None:
    """End this process now with ``code`` (``text``: the diagnosis, to the log, the events, stderr)."""
    from mindspeed_ha.process import exit_now
    if text:
        log.error("%s", text)
        if events:
            events.emit("diagnosis", text=text, exit_code=code)
        print(text, file=sys.stderr, flush=True)
    exit_now(code)


def never_reached(rank: int, timeout_s: float, endpoint: str | None) -> str:
    store = os.environ.get("MINDSPEED_HA_JOB_STORE")
    return (f"mindspeed-ha: rank {rank} could not reach a controller within --ha-register-timeout {timeout_s:g} s "
            f"(last tried: {endpoint or 'none announced'}"
            f"{f'; controllers announce themselves in the job store at {store}' if store else ''}). "
            "HA would be off, so the rank ends here. A controller listens on its node's address "
            "(mindspeed-ha run: the route to --master-addr, or --local-addr): check that this node "
            "reaches it (firewall, keys in --ha-key-dir).")


def cut_off(rank: int, unheard_s: float, timeout_s: float, endpoint: str | None) -> str:
    return (f"mindspeed-ha: rank {rank} has heard from no controller for {unheard_s:.0f} s "
            f"(--ha-register-timeout {timeout_s:g} s; last: {endpoint}): "
            "this node is cut off from the job (a partition, or the controller's side is gone). "
            "The job goes on without it on the side that reaches the job store, or ended there; "
            "this rank ends here.")


def report_stop_signals(rank: int, send: Callable[[bytes, str], None]) -> None:
    """The scheduler's stop signal (SIGTERM, and mindspeed-ha run's --signals-to-handle) becomes a
    preemption report (``send(frame, rid)``): the controller stops the job and writes its dying gasp
    within --ha-term-grace, then every process exits. A handler installed before ours (Megatron-LM's
    --exit-signal-handler) still runs. Only under mindspeed-ha run, which names the signals:
    torchrun also ends the survivors of a failed worker with SIGTERM, and that is no preemption."""
    names = os.environ.get("MINDSPEED_HA_TERM_SIGNALS")
    if not names or threading.current_thread() is not threading.main_thread():
        return
    for name in filter(None, (n.strip() for n in names.split(","))):
        sig = getattr(signal, name, None)
        if sig is None or sig in (signal.SIGINT,):  # Ctrl-C reaches the agent; a rank leaves it to it
            continue
        previous = signal.getsignal(sig)

        def on_signal(signum: int, frame: FrameType | None, previous: object = previous) -> None:
            rid = f"{os.getpid()}.preempt"
            send(protocol.encode("preempt", signal=int(signum), rank=rank, pid=os.getpid(), rid=rid), rid)
            if callable(previous):
                previous(signum, frame)
        signal.signal(sig, on_signal)
