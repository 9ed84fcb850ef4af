"""What the controller's helpers see of it: a frozen identity and a narrow port.

The playbooks see the controller through ``rounds.Port``; the helpers — the inbox, scaling,
migrations, succession — through ``ControllerPort``: the state machine's state, the epoch, whether
it stands by, whether a recovery's first step is still awaited; feeding it an outcome, reporting a
fault, taking over and retiring; and the two requests one helper makes of another (a migration, a
hand-over), which the controller routes, so that no helper holds another it is not handed. Besides
the port each helper is handed the parts it works on (the rank table, orders, restarts, the fault
ledger, the standbys, the event log, the job store), each of which changes its own state through
its own methods only. A fake port and real parts drive every helper in unit tests, without a
socket (tests/test_controller_helpers.py), as a fake ``rounds.Port`` drives the playbooks.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Protocol

from ..policy.states import Outcome, State
from ..wire.security import Keys


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who a controller is, fixed for its life: where it listens, with which keys, for which job."""
    host: str                # the address it listens on (and serves the rebuild store at)
    endpoint: str            # tcp://host:port, as announced
    port: int
    keys: Keys
    job_id: str | None
    log_dir: str
    world: int               # the job's ranks
    rank: int | None         # the rank whose process runs it (None: a process of its own)


class ControllerPort(Protocol):
    """The controller as its helpers see it: exactly what they use, nothing else of its state."""

    # ---- where it stands
    @property
    def state(self) -> State:
        """The state machine's current state."""

    @property
    def epoch(self) -> int:
        """This controller's epoch (ranks obey the newest)."""

    @property
    def standby(self) -> bool:
        """A standby: it watches, and takes over when it holds a quorum."""

    def first_step_pending(self) -> bool:
        """The last recovery has not completed its first step yet (the job trains, not settled)."""

    def ack(self) -> bytes:
        """The answer to a heartbeat or a registration now (epoch, state, standbys)."""

    def status(self) -> dict[str, Any]:
        """The job's status, as ``mindspeed-ha status`` shows it."""

    # ---- what it is told
    def feed(self, outcome: Outcome) -> None:
        """The state machine's next outcome (the new state's work runs at once)."""

    def fault(self, ranks: list[int], kind: str, iteration: int, phase: str, detect_s: float = 0.0,
              detail: str = "", key: Hashable = None, rid: str | None = None, feed: bool = True,
              entered: dict[str, Any] | None = None, fault_class: str = "fault", frame: str = "") -> bool:
        """A fault, however it was found: recorded once and fed to the state machine. True: a new one.
        ``entered``: the faulted rank's counts of the collectives it issued, for the survivors' stop;
        ``fault_class``: software or fault (``faults.fault_class``); ``frame``: where it was raised in
        the job's own code."""

    # ---- who controls
    def become_active(self, epoch: int, now: float) -> None:
        """A standby takes over at ``epoch`` (or the next one)."""

    def retire(self) -> None:
        """Stop controlling: handed over, or superseded."""

    def push_backups(self) -> None:
        """Every live rank and agent learns the standbys now (and the job store in use)."""

    def serve_metrics(self) -> None:
        """Serve /metrics (--ha-metrics-port) from now on, if asked and not yet served."""

    # ---- one helper's request of another
    def request_migration(self, rank: int, reason: str) -> str | None:
        """Move ``rank`` to a spare at the next step boundary; the refusal's reason, or None."""

    def registered_strategies(self, rank: int, names: frozenset[str]) -> None:
        """The strategies ``rank`` enables, as it registered (adopted, or checked against the job's)."""

    def hand_over(self, rank: int, reason: str) -> str | None:
        """``rank`` hosts this controller and is to be migrated: a standby takes over first. The
        refusal's reason, or None."""
