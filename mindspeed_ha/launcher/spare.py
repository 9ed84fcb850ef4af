"""A pre-started spare worker for recover (ARF).

Most of a restarted worker's time before it can join is Python start-up: importing torch and
megatron-core, patching, building the dataset — seconds, on the recovery's critical path. With
recover on, each agent keeps one spare process that has done all of that and waits on its stdin;
on a restart order the agent hands it the lost rank (one JSON line of environment variables) and
starts the next spare later. The spare then continues exactly like a restarted worker.
"""
from __future__ import annotations

import json
import os
import sys

ENV = "MINDSPEED_HA_SPARE"


def is_spare() -> bool:
    return os.environ.get(ENV) == "1"


def wait_for_assignment() -> None:
    """Block until the agent assigns a rank; its variables go into ``os.environ``. End quietly
    when stdin closes without one (the job is over, or the agent is gone)."""
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    os.environ.update({str(k): str(v) for k, v in json.loads(line).items()})
    os.environ.pop(ENV, None)


def assignment(rank: int, local_rank: int, restarts: int) -> bytes:
    return (json.dumps({"RANK": rank, "LOCAL_RANK": local_rank, "MINDSPEED_HA_RESTART_COUNT": restarts})
            + "\n").encode()


def recover_requested(script_args: list[str], env=os.environ) -> bool:
    """Whether the job's HA options (flags or environment) include recover."""
    from mindspeed_ha.options import HAConfigError, add_ha_args, from_args
    import argparse
    ns, _ = add_ha_args(argparse.ArgumentParser(add_help=False)).parse_known_args(script_args)
    try:
        return "recover" in from_args(ns, env).strategies
    except HAConfigError:
        return False  # the workers report it
