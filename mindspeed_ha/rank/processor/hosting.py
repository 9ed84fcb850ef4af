"""The controller a rank hosts: rank 0's at the job's start, or a standby the active controller names
(which takes over when that one is lost, or when it hands itself over). The rank never imports the
controller: it is handed a factory (``ControllerFactory``: the ``Controller`` class where the rank may
host one) and uses what it makes through ``HostedController``.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Protocol


class HostedController(Protocol):
    """What a rank's processor uses of the controller it hosts: rank 0's, or a standby."""
    standby: bool
    endpoint: str
    done: threading.Event

    def start(self) -> HostedController: ...
    def close(self, timeout: float = 2.0) -> None: ...
    def saw_epoch(self, epoch: int) -> None: ...
    def settle(self, rids: Iterable[str]) -> None: ...
    def order_takeover(self, args: dict[str, Any]) -> None: ...


# Makes the controller this rank hosts: (log dir, world size, options, keys, **where and how).
ControllerFactory = Callable[..., HostedController]


class ControllerHost:
    """The controller hosted on this rank, if any, and the reports any controller settled (a standby
    hosted here learns them, so that one re-sent to it after a takeover is not recovered twice)."""

    def __init__(self, factory: ControllerFactory | None, rank: int) -> None:
        self.factory, self.rank = factory, rank
        self.controller: HostedController | None = None
        self.settled: set[str] = set()
        self._given: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})

    def configure(self, *given: Any, **common: Any) -> None:
        """What every controller made here is given: (log dir, world size, options, keys) and the job's
        id, its job store and the rank's local exit."""
        self._given = (given, common)

    def start_first(self) -> None:
        """Rank 0, in the job's first process: the job's controller."""
        if self.factory is not None:
            self.controller = self._make(rank=0)

    def _make(self, **how: Any) -> HostedController:
        assert self.factory is not None
        given, common = self._given
        return self.factory(*given, **common, **how).start()

    def stand_by(self, args: dict[str, Any]) -> str:
        """The active controller names this rank a standby: start one here (once)."""
        if self.controller is None:
            if self.factory is None:
                raise RuntimeError(f"rank {self.rank} was given no controller to host, so it cannot stand by")
            self.controller = self._make(rank=self.rank, standby=True, epoch=int(args.get("epoch", 1)),
                                         previous=int(args.get("controller", -1)), settled=self.settled)
        return self.controller.endpoint

    def settle(self, rids: list[str]) -> None:
        self.settled.update(rids)
        if self.controller is not None and self.controller.standby:
            self.controller.settle(rids)

    def take_over(self, args: dict[str, Any]) -> str:
        """The active controller hands itself over to this standby (its host is to be migrated)."""
        if self.controller is None or not self.controller.standby:
            raise RuntimeError(f"rank {self.rank} runs no standby controller")
        self.controller.order_takeover(dict(args))  # (its own thread promotes it)
        return self.controller.endpoint

    def saw_epoch(self, epoch: int) -> None:
        """The rank's link knows the active controller's epoch: a standby hosted here learns it."""
        if self.controller is not None and self.controller.standby:
            self.controller.saw_epoch(epoch)

    def wait_done(self, timeout: float) -> None:
        """At the rank's end: the active controller hosted here finishes the job first (no rank loses its
        controller early)."""
        if self.controller is not None and not self.controller.standby:
            self.controller.done.wait(timeout)

    def close(self) -> None:
        if self.controller is not None:
            self.controller.close()
