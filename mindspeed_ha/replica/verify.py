"""Silent-data-corruption check: replica peers compare shard fingerprints every N iterations.

Every rank takes part (the decision is world-wide, so no rank is left waiting in a collective):
digests are gathered inside each replica group, and a mismatch flag is reduced over the world.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from mindspeed_ha.comm.interruptible import PROCESS_STOP
from mindspeed_ha.device import current

if TYPE_CHECKING:
    from mindspeed_ha.replica.optimizer import ReplicaMixin


class ReplicaMismatchError(RuntimeError):
    pass


def check_replicas(optimizer: ReplicaMixin, iteration: int, replica_group_pg: dist.ProcessGroup | None,
                   job_rank: Callable[[int], int] = lambda r: r) -> dict[str, Any]:
    """Returns the ``replica_check`` event fields; raises ReplicaMismatchError on every rank on a mismatch.
    ``job_rank``: the job's name of a rank of the default group (they differ after an elastic resize).
    Only the digests travel (one int64 per shard tensor); the shards stay where they are."""
    topo = optimizer.ha_topology
    names, mine = optimizer.ha_fingerprint()
    gathered = [torch.empty_like(mine) for _ in topo.replica_group]
    dist.all_gather(gathered, mine, group=replica_group_pg)
    # Compared on the device: the one value the host reads is the world's verdict (8 bytes).
    flag = torch.zeros(1, dtype=torch.int64, device=current())
    for peer, theirs in zip(topo.replica_group, gathered):
        if peer != topo.rank:
            flag += (theirs != mine).any()
    dist.all_reduce(flag)  # every rank learns whether anyone found a mismatch
    # (a digest cut short by a stop's abort is no evidence of corruption: that stop is recovered)
    PROCESS_STOP.commit_point("the replica check")
    if int(flag.item()):
        problem: dict[str, Any] | None = None
        for peer, theirs in zip(topo.replica_group, gathered):
            diff = (theirs != mine).nonzero()
            if peer != topo.rank and diff.numel():
                problem = {"ranks": sorted([job_rank(topo.rank), job_rank(peer)]), "tensor": names[int(diff[0, 0])],
                           "differing_tensors": int(diff.numel())}
                break
        reports: list[dict[str, Any] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, problem)
        first = next(r for r in reports if r)
        msg = (f"replica mismatch at iteration {iteration}: ranks {first['ranks'][0]} and {first['ranks'][1]} "
               f"hold different optimizer shards; first differing tensor {first['tensor']} "
               f"({first['differing_tensors']} tensors differ). Silent data corruption: training stopped.")
        raise ReplicaMismatchError(msg) from None
    return {"iteration": iteration, "ok": True, "replica_group": [job_rank(r) for r in topo.replica_group],
            "tensors": len(names)}
