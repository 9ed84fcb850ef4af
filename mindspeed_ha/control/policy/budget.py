"""The restart budget of recover: how often one rank may be restarted and one node replaced
(``--ha-max-restarts``), and crash loops — a restarted worker that dies again before it got past the
step its predecessor died in would only die again. Past either, recover is not tried for that fault: the next strategy
applies (the dump), and the job ends with the exit code that tells a scheduler not to restart it.
"""
from __future__ import annotations

import collections


class RestartBudget:
    def __init__(self, max_restarts: int):
        self.max = int(max_restarts)
        self.restarts: collections.Counter[int] = collections.Counter()       # rank -> restarts so far
        self.died_in: dict[int, int] = {}                                  # rank -> iteration it last died in
        self.replacements: collections.Counter[int] = collections.Counter()   # node rank -> nodes replaced
        self.spent = ""      # why a fault of this job went unrecovered because of the budget

    def count(self, restarted: dict[int, int], awaiting_nodes: list[int]) -> None:
        """A recover round restarted ``restarted`` ranks (rank -> the iteration it died in) and waits
        for replacements of ``awaiting_nodes``."""
        self.restarts.update(restarted.keys())
        self.died_in.update(restarted)
        self.replacements.update(set(awaiting_nodes))

    def refusal(self, lost: dict[int, int], nodes_lost: set[int], crashed: set[int] | None = None) -> str | None:
        """Why recover may not restart these ranks (None: it may). ``lost``: rank -> the iteration
        it died in; ``nodes_lost``: nodes whose agent is gone with them; ``crashed``: those of the
        lost whose process died (not fell silent with its node), which alone can be a crash loop
        (default: all)."""
        over = sorted(r for r in lost if self.restarts[r] >= self.max)
        if over:
            return (f"rank(s) {over} were restarted {self.restarts[over[0]]} time(s) already "
                    f"(--ha-max-restarts {self.max})")
        looping = sorted(r for r, it in lost.items() if r in self.died_in and it <= self.died_in[r]
                         and (crashed is None or r in crashed))
        if looping:
            return (f"rank(s) {looping} died again, restarted, before getting past the step their last process died "
                    "in: a crash loop, which another restart would repeat")
        nodes = sorted(n for n in nodes_lost if self.replacements[n] >= self.max)
        if nodes:
            return f"node(s) {nodes} were replaced {self.replacements[nodes[0]]} time(s) already (--ha-max-restarts {self.max})"
        return None
