"""The agents' meeting at the job store, before any worker starts.

Every agent writes its record (``discovery.agent_key``) and waits until either every node's agent
is there — a new job: start the workers, they rendezvous as torchrun's would — or the job's
controller is announced there, or another agent says it has seen the job train — a running job
that this agent joins as the replacement of a lost node (workers start only when the controller
orders their restart). Node 0's replacement is no exception: the store it serves is new and empty,
but the running job's controller and agents write their records into it again within a second.

Nodes that never come within ``--ha-register-timeout`` end the job with their names.
"""
from __future__ import annotations

import time

from ..control.wire.discovery import CONTROLLER_KEY, JobStore, agent_key
from ..events import get_logger

log = get_logger("launcher.rendezvous")


class NotRegistered(RuntimeError):
    """Nodes (or the store itself) missing at the deadline; the message names them."""


def ranks_of(node_rank: int, nproc: int) -> list[int]:
    return list(range(node_rank * nproc, (node_rank + 1) * nproc))


def meet(store: JobStore, node_rank: int, nnodes: int, nproc: int, job_id: str, record: dict,
         timeout_s: float, poll_s: float = 0.1) -> str:
    """Publish this agent's ``record``; return ``"new"`` (every agent met, nothing runs yet) or
    ``"running"`` (the job runs: this agent replaces a lost node). Raises ``NotRegistered``."""
    store.publish(agent_key(node_rank), {**record, "job_id": job_id, "running": False})
    store.watch(CONTROLLER_KEY, *(agent_key(n) for n in range(nnodes)))
    t0 = time.monotonic()
    said = 0.0
    while True:
        ctrl = store.seen(CONTROLLER_KEY)
        if ctrl and ctrl.get("job_id") in (None, job_id):
            return "running"
        agents = {n: store.seen(agent_key(n)) for n in range(nnodes)}
        here = {n for n, a in agents.items() if a and a.get("job_id") == job_id}
        if any(a.get("running") for n, a in agents.items() if a and n in here and n != node_rank):
            pass  # the job runs: its controller's record comes into this store within a second
        elif len(here) == nnodes:
            return "new"
        now = time.monotonic()
        if now - t0 > timeout_s:
            raise NotRegistered(_missing(store, here, nnodes, nproc, timeout_s))
        if now - said > 30.0 and here:
            said = now
            log.info("agent %d: %d of %d node(s) at the job store; waiting for node(s) %s", node_rank, len(here),
                     nnodes, sorted(set(range(nnodes)) - here))
        time.sleep(poll_s)


def _missing(store: JobStore, here: set, nnodes: int, nproc: int, timeout_s: float) -> str:
    host, port = store.address
    if not store.ever_reached:
        return (f"the job store at {host}:{port} (served by node 0's agent) was not reachable within {timeout_s:g} s: "
                "is node 0 up, and do --master-addr/--master-port (or MASTER_ADDR/MASTER_PORT) name it?")
    missing = sorted(set(range(nnodes)) - here)
    if not missing:
        return (f"the job's agents met but its controller was not announced within {timeout_s:g} s, although "
                "another agent saw the job train")
    ranks = [r for n in missing for r in ranks_of(n, nproc)]
    return (f"node(s) {', '.join(map(str, missing))} (rank(s) {', '.join(map(str, ranks))}) did not come up within "
            f"--ha-register-timeout {timeout_s:g} s; their agents never reached the job store at {host}:{port}")
