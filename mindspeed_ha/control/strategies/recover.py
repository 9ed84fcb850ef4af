"""recover (``--enable-worker-reboot``; MindSpeed's ARF): the lost process (or node) is restarted by
its launcher agent, and it takes its shard and counters from its twins.

    restore  status -> restart -> plan -> rebuild -> repair | reload
    resume   rollback -> resume

retry's rounds, with ``restart`` after the status: the agents restart the lost ranks (and end and
restart the hung and the migrating ones first), and the round waits until they register; they join at
``rebuild`` and take their shard at ``repair``. A rank that stops answering in any round is hung, and
is replaced like a dead one. With elastic training on, a node whose replacement does not come within
``--ha-spare-wait`` gives the episode to the scale-in (``Switch``).
"""
from __future__ import annotations

import dataclasses
import time

from ..policy.rounds import NEXT, Answers, Fail, Round, Step, Switch
from .retry import PLAN, REBUILD, RELOAD, REPAIR, RESUME, ROLLBACK, STATUS_OR_HUNG, replaced
from .episode import Episode, log
from .strategy import Stage, Strategy

RESTART_WAIT_S = 120.0       # a restarted worker imports torch and megatron before it registers
RESTORE_S = 180.0
RESUME_S = 30.0


def _restart(ep: Episode) -> Step:
    """Have the agents restart every lost, hung or migrating worker (the agent ends a live one
    first); they join at the rebuild."""
    ep.port.condemn(sorted(replaced(ep) & ep.port.live()))
    lost = sorted(ep.port.lost())
    unknown = [r for r in lost if ep.replica and ep.group_of(r) is None]
    if unknown:
        return Fail(f"the replica group of rank(s) {unknown} is unknown")
    restarted, awaiting, orphans = ep.port.restart(lost)
    if orphans:
        return Fail(f"rank(s) {sorted(orphans)} have no launcher agent to restart them "
                    "(start the job with mindspeed-ha run)")
    ep.joiners = sorted(set(ep.joiners) | set(lost))
    ep.restart_at = time.monotonic()
    ep.port.emit("restart", ranks=restarted, awaiting_node=awaiting)
    log.info("recover: restarting rank(s) %s%s", restarted, f"; waiting for a replacement node for rank(s) "
             f"{awaiting} (mindspeed-ha run with its --node-rank)" if awaiting else "")
    return None


def _waited_out(ep: Episode) -> bool:
    """recover with elastic on: the lost node's replacement did not come within --ha-spare-wait."""
    return ep.spare_wait is not None and time.monotonic() - ep.restart_at > ep.spare_wait


def _restarted(ep: Episode, ans: Answers) -> Step:
    waiting = sorted(ep.port.restarting())
    if waiting and ep.spare_wait is not None and (ans.failed or _waited_out(ep)):
        return Switch("elastic-training", f"no replacement for rank(s) {waiting} within --ha-spare-wait "
                                          f"{ep.spare_wait:g} s: the job scales in without them")
    if ans.failed:
        return Fail(f"restart failed ({', '.join(f'rank {r}: did not come back' for r in sorted(ep.port.restarting()))})")
    return NEXT


RESTART = Round("restart", act=_restart, ready=lambda ep: not ep.port.restarting() or _waited_out(ep),
                decide=_restarted,
                wait_s=RESTART_WAIT_S, when=lambda ep: bool(ep.port.lost() or replaced(ep) & ep.port.live()))


def _hung_if_silent(*rounds: Round) -> tuple[Round, ...]:
    return tuple(dataclasses.replace(r, silent_is_hung=True) for r in rounds)


STRATEGY = Strategy(
    "recover", "--enable-worker-reboot",
    handles=frozenset({"memory-error", "comm-failure", "other", "process-exit", "hang", "heartbeat-lost",
                       "controller-lost", "node-lost", "migrate"}),
    stages=(Stage("restore", (STATUS_OR_HUNG, RESTART, *_hung_if_silent(PLAN, REBUILD, REPAIR, RELOAD)), RESTORE_S),
            Stage("resume", _hung_if_silent(ROLLBACK, RESUME), RESUME_S)))
