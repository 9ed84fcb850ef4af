"""Faults that are not the machine's: one that comes back where it was recovered, and one before the
job's first step.

A fault is the same fault again when it comes back on the same ranks, of the same kind, with the
same error (its numbers aside: a pid, a count of seconds), at the same iteration, after a recovery
that dealt with it: the recovery changed nothing that caused it. A bug in the job's code or data
does that; hardware that fails does not, or not at the same step — one that recurs at a later
iteration is a new fault (a flaky node). So each recovery that has mended the job's state (in place,
a restart, a reload, an elastic resize: every one then rolls the ranks back or forward and resumes
them) counts its faults here, and the decision for
the next fault asks how often its like was recovered already: past ``limit`` times (one time for an
error of the job's own software class: a retry on the same data can only raise it again) the job
ends with the diagnosis instead of a recovery.

Before the job's first step has completed, an error of a rank's own (not a lost process, a memory or
communication error) is a set-up error — an import, a configuration, a data path — which no recovery
can mend: the job ends at once. The rank says so (``faults.fault_class``: its process ended no step
and is one of the job's first).
"""
from __future__ import annotations

import collections
import re

from .ledger import KIND_SCALE_OUT, Fault

# What a fault's detail says that changes from one occurrence to the next without saying anything of
# its cause: pids, seconds, addresses.
_NUMBERS = re.compile(r"\d+(\.\d+)?")
# The kinds a rank raises itself in its step (the others are found by the controller or an agent).
RAISED = frozenset({"other", "memory-error", "comm-failure"})


def signature(f: Fault) -> tuple[tuple[int, ...], str, str, int]:
    """What makes two faults the same one: ranks, kind, error (numbers aside), iteration."""
    return tuple(sorted(f["ranks"])), f["kind"], _NUMBERS.sub("#", f["detail"]), int(f["iteration"])


class Recurrences:
    """How often each fault (``signature``) was recovered in this job."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.recovered: collections.Counter[tuple[tuple[int, ...], str, str, int]] = collections.Counter()
        self.why = ""  # why a recovery was refused (set by ``refusal``; the diagnosis and the exit code read it)
        self.setup = False  # the last refusal was of a set-up error

    def count(self, faults: list[Fault]) -> None:
        """A recovery of ``faults`` has mended the state: the ranks go back to training (once per
        recovery: the same fault found twice in it counts once)."""
        self.recovered.update({signature(f) for f in faults if f["kind"] not in (KIND_SCALE_OUT, "migrate")})

    def limit_of(self, f: Fault) -> int:
        return min(self.limit, 1) if f.get("fault_class") == "software" else self.limit

    def refusal(self, faults: list[Fault]) -> str | None:
        """Why no recovery may be tried for ``faults`` (None: one may); ``setup`` says whether it is a
        set-up error (nothing to save: the job ends at once)."""
        self.setup = False
        setup = [f for f in faults if f["kind"] in RAISED and f.get("fault_class") == "setup"]
        if setup:
            self.setup = True
            f = setup[0]
            self.why = (f"rank {_ranks(f)} raised {f['detail'][:300]}{_where(f)} before the job's first step completed: "
                        "a set-up error (an import, a configuration, a data path), which no recovery can mend; "
                        "its traceback is in that rank's output")
            return self.why
        for f in faults:
            n = self.recovered[signature(f)]
            if n and n >= self.limit_of(f):
                what = "an error of the job's own code" if f.get("fault_class") == "software" else "the same fault"
                kind = "error" if f["kind"] == "other" else f["kind"]
                self.why = (f"rank {_ranks(f)}'s {kind} ({f['detail'][:300]}){_where(f)} at iteration "
                            f"{f['iteration']} came back after {n} recover{'y' if n == 1 else 'ies'} of it at the same "
                            f"iteration: {what}, which another recovery would only repeat (--ha-max-recurrences "
                            f"{self.limit}{'; once for a software error' if f.get('fault_class') == 'software' else ''})")
                return self.why
        return None


def _ranks(f: Fault) -> str:
    return ", ".join(map(str, f["ranks"]))


def _where(f: Fault) -> str:
    return f", raised at {f['frame']}" if f.get("frame") else ""
