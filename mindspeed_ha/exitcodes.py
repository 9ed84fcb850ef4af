"""How a mindspeed-ha job ends, as an exit code a scheduler can act on.

Every process of the job (agents and workers) ends with the same code. Codes of 128 and above ask
for a restart of the whole job (Kubernetes' ``restartPolicy: ExitCode`` treats 128-255 as
retryable, 1-127 as permanent); the others say a restart would not help or needs a person.
"""
from __future__ import annotations

OK = 0
FAULT = 1             # a fault ended the job (the diagnosis says which, and the checkpoint to --load)
BAD_INPUT = 2         # a flag, variable or layout was refused before anything was built
DO_NOT_RESTART = 3    # the restart budget is spent, a worker crash-loops, a fault recurs where it was recovered
                      # or a set-up error: a restart would do the same again
REPLICA_MISMATCH = 4  # (a worker) its optimizer shard differs from its twin's: silent data corruption
PROCESS_FATAL = 75    # (a worker only) its device context is poisoned: the process must be replaced
PREEMPTED = 200       # stopped by the scheduler (SIGTERM ...): the dying-gasp checkpoint is written
NOT_REGISTERED = 201  # nodes or ranks never came up within --ha-register-timeout

# What a worker's exit says of the whole job, not of its process: an agent left to act alone (no
# controller) ends with the same code, so that the scheduler reads the job's fate from any process.
JOB_WIDE = frozenset({BAD_INPUT, DO_NOT_RESTART, NOT_REGISTERED})

MEANING = {
    OK: "the job finished",
    FAULT: "a fault ended the job; the diagnosis names it and the checkpoint to resume from",
    BAD_INPUT: "a flag, environment variable or layout was refused; the message names it",
    DO_NOT_RESTART: ("the restart budget is spent, a worker crash-loops, a fault recurs where it was recovered or the "
                     "job failed in its set-up: do not restart this job as is"),
    REPLICA_MISMATCH: "(worker) its optimizer shard differs from its twin's bit for bit: silent data corruption",
    PROCESS_FATAL: "(worker) a process-fatal device error: the process was replaced",
    PREEMPTED: "preempted: the dying-gasp checkpoint was written; restart with --load",
    NOT_REGISTERED: "nodes or ranks never registered within --ha-register-timeout; restart when they can",
}
