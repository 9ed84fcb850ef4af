"""How a job ends, the controller's side: the exit code a scheduler acts on, the diagnosis (every
fault, what was tried, where to resume), the exit order to every rank and agent, and the host rank's
own exit last; and a job that never started whole, named.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ... import exitcodes
from ...events import EventLog, get_logger
from ...options import HAOptions
from ..policy import ledger
from ..policy.diagnosis import diagnosis
from ..policy.ledger import FaultLedger
from ..policy.ranks import RankTable
from ..policy.recurrence import Recurrences
from ..wire.router import Router
from .orders import Orders
from .restarts import Restarts

if TYPE_CHECKING:
    from .recovery import Recovery

log = get_logger("control.controller")


class Ending:
    def __init__(self, options: HAOptions, log_dir: str, table: RankTable, ledger: FaultLedger, orders: Orders,
                 restarts: Restarts, recurrences: Recurrences, recovery: Recovery, router: Router, events: EventLog,
                 rank: int | None, local_exit: Callable[[int], None] | None):
        self.options, self.log_dir, self.table, self.ledger, self.orders = options, log_dir, table, ledger, orders
        self.restarts, self.recurrences, self.recovery = restarts, recurrences, recovery
        self.router, self.events, self.rank, self.local_exit = router, events, rank, local_exit
        self.exit_code = 0
        self.last_diagnosis = ""

    def tell(self) -> None:
        """EXIT: the exit code and the diagnosis, to every live rank and every agent."""
        faults = self.ledger.active or self.ledger.all
        kinds = {f["kind"] for f in faults}
        self.exit_code = (exitcodes.PREEMPTED if "preempted" in kinds else
                          exitcodes.NOT_REGISTERED if "not-registered" in kinds else
                          exitcodes.DO_NOT_RESTART if self.restarts.budget.spent or self.recurrences.why else
                          exitcodes.FAULT if self.ledger.all else exitcodes.OK)
        note = self.recovery.note
        for why in (self.restarts.budget.spent, self.recurrences.why and f"no recovery: {self.recurrences.why}"):
            if why and why not in note:
                note = f"{why}; {note}"
        text = self.last_diagnosis = diagnosis(faults, len(self.table.live()), note, self.recovery.dump_result(),
                                               self.log_dir, self.exit_code)
        self.events.emit("diagnosis", text=text, exit_code=self.exit_code)
        log.error(text)
        args = {"code": self.exit_code, "diagnosis": text}
        self.orders.send("exit", sorted(self.table.live()), args)
        self.orders.to_agents("exit", args)

    def exit_host(self) -> None:
        """EXIT -> DONE: the rank that hosts this controller exits last, what was sent flushed first."""
        if self.local_exit is not None and self.rank is not None and self.rank in self.table.live():
            try:
                self.router.sock.close(linger=1000)  # flush what we sent before the process goes
            finally:
                self.local_exit(self.exit_code)

    def not_registered(self) -> None:
        """INIT past --ha-register-timeout: the job cannot start whole; name who is missing."""
        ranks, agents = self.table.ranks, self.table.agents
        missing = [r for r in range(self.table.world) if r not in ranks]
        nodes = sorted({a.node for a in agents.values() if set(a.ranks) & set(missing)})
        orphans = [r for r in missing if self.table.agent_of(r) is None]
        where = (f"; node(s) {', '.join(nodes)} run their agents, so those workers hang or fail in their set-up"
                 if nodes else "") + (f"; no agent registered for rank(s) {orphans}" if orphans and agents else "")
        detail = (f"rank(s) {missing} did not register within --ha-register-timeout "
                  f"{self.options.register_timeout_s:g} s{where}")
        self.recovery.note = "none: the job never started whole"
        f = ledger.record(missing, "not-registered", -1, "startup", nodes or ["?"], detail=detail)
        self.ledger.add(f)
        self.events.emit("fault", **ledger.public(f))
        log.error("%s", detail)
