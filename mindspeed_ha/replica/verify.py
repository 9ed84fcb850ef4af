"""Silent-data-corruption check: replica peers compare shard fingerprints every N iterations.

Every rank takes part (the decision is world-wide, so no rank is left waiting in a collective):
digests are gathered inside each replica group, and a mismatch flag is reduced over the world.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from mindspeed_ha.comm.interruptible import commit_point
from mindspeed_ha.device import current

if TYPE_CHECKING:
    from mindspeed_ha.replica.optimizer import ReplicaMixin


class ReplicaMismatchError(RuntimeError):
    pass


# A digest of a tensor's bytes, on its own device: the bytes read as integers (the widest word that
# divides them), each multiplied by an odd weight drawn from its position and summed modulo 2**64.
# Flipping any bit changes one word by a power of two, which times an odd weight is not 0 modulo
# 2**64: a single flipped bit always changes the digest. Words are taken in chunks, so what the digest
# allocates beside the tensor stays bounded (a few int64 copies of one chunk).
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
DIGEST_CHUNK = 1 << 22  # words per chunk
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64: Weyl's sequence for the weights


def digest(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """An int64 scalar on ``device`` (the tensor's by default): see the comment above."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if device is not None and raw.device != device:
        raw = raw.to(device)  # (Adam's step counter, a CPU scalar beside a device shard: 4 bytes)
    size = next(n for n in (8, 4, 2, 1) if raw.numel() % n == 0 and raw.storage_offset() % n == 0)
    words = raw.view(_WORDS[size])
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    for at in range(0, words.numel(), DIGEST_CHUNK):
        chunk = words[at:at + DIGEST_CHUNK]
        weights = torch.arange(at, at + chunk.numel(), dtype=torch.int64, device=raw.device).mul_(_GOLDEN).bitwise_or_(1)
        total += weights.mul_(chunk).sum()  # (in the weights: the chunk may be the tensor's own memory)
    return total + words.numel()  # (the length too: a tensor of zeros is told from an empty one)


def check_replicas(optimizer: ReplicaMixin, iteration: int, replica_group_pg: dist.ProcessGroup | None,
                   job_rank: Callable[[int], int] = lambda r: r) -> dict[str, Any]:
    """Returns the ``replica_check`` event fields; raises ReplicaMismatchError on every rank on a mismatch.
    ``job_rank``: the job's name of a rank of the default group (they differ after an elastic resize).
    Only the digests travel (one int64 per shard tensor); the shards stay where they are."""
    topo = optimizer.ha_topology
    names, mine = optimizer.ha_fingerprint()
    gathered = [torch.empty_like(mine) for _ in topo.replica_group]
    dist.all_gather(gathered, mine, group=replica_group_pg)
    problem: dict[str, Any] | None = None
    for peer, theirs in zip(topo.replica_group, gathered):
        if peer == topo.rank:
            continue
        diff = (theirs != mine).nonzero()
        if diff.numel():
            problem = {"ranks": sorted([job_rank(topo.rank), job_rank(peer)]), "tensor": names[int(diff[0, 0])],
                       "differing_tensors": int(diff.numel())}
            break
    flag = torch.tensor([1 if problem else 0], dtype=torch.int64, device=current())
    dist.all_reduce(flag)  # every rank learns whether anyone found a mismatch
    # (a digest cut short by a stop's abort is no evidence of corruption: that stop is recovered)
    commit_point("the replica check")
    if int(flag.item()):
        reports: list[dict[str, Any] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, problem)
        first = next(r for r in reports if r)
        msg = (f"replica mismatch at iteration {iteration}: ranks {first['ranks'][0]} and {first['ranks'][1]} "
               f"hold different optimizer shards; first differing tensor {first['tensor']} "
               f"({first['differing_tensors']} tensors differ). Silent data corruption: training stopped.")
        raise ReplicaMismatchError(msg) from None
    return {"iteration": iteration, "ok": True, "replica_group": [job_rank(r) for r in topo.replica_group],
            "tensors": len(names)}
