"""The strategies: one file each (its name, the switch that enables it, the faults it handles, its
playbook read top to bottom) and this registry, the only place that maps one to another.

    retry       --enable-hbmfault-repair      a memory or communication fault mended in place
    recover     --enable-worker-reboot        the lost process or node restarted
    elastic-training  --enable-elastic-training   no spare: the job scales in
    scale-out   (elastic training)            a returned node: the job scales out again
    dump        --enable-high-availability    the survivors' dying-gasp checkpoint, the last resort
    reload      (inside retry and recover)    no twin can serve: the periodic checkpoint
    migration   (inside recover)              a live rank moved to a spare, planned

Adding a strategy is one file here (a ``Strategy``), its line below, and its orders' handlers on the
rank (``rank.recovery.handlers``).
"""
from __future__ import annotations

from typing import Iterable

from . import dump, migration, recover, reload, retry, scale_in, scale_out
from .episode import Episode, FirstStep, failed
from .strategy import Stage, Strategy

REGISTRY: dict[str, Strategy] = {s.name: s for s in (
    retry.STRATEGY, recover.STRATEGY, scale_in.STRATEGY, scale_out.STRATEGY, dump.STRATEGY,
    reload.STRATEGY, migration.STRATEGY)}
RETRY, RECOVER, DUMP = retry.STRATEGY, recover.STRATEGY, dump.STRATEGY
SCALE_IN, SCALE_OUT = scale_in.STRATEGY, scale_out.STRATEGY

__all__ = ["REGISTRY", "DUMP", "RECOVER", "RETRY", "SCALE_IN", "SCALE_OUT", "Episode", "FirstStep", "Stage", "Strategy", "choose",
           "failed"]


def choose(ordered: Iterable[str], fault_kinds: Iterable[str]) -> tuple[Strategy | None, str]:
    """The first of ``ordered`` (enabled, in preference order) that handles every fault, and a reason
    for the log (None: no strategy can)."""
    ordered, kinds = list(ordered), set(fault_kinds)
    skipped = []
    for name in ordered:
        s = REGISTRY.get(name)
        if s is None or s.part_of:
            skipped.append(f"{name} is not available in this build")
        elif not kinds <= s.handles:
            skipped.append(f"{name} does not handle {', '.join(sorted(kinds - s.handles))}")
        else:
            return s, f"strategy {name}"
    if not ordered:
        skipped.append("no strategy enabled")
    return None, "; ".join(skipped)
