"""Who holds a copy of which optimizer shard.

megatron-core's partial distributed optimizer (``num_distributed_optimizer_instances = R``) splits a
DP group of size d into R consecutive instances of d/R ranks and shards ZeRO-1 state inside each.
Rank at position p of instance k therefore holds the same shard as position p of every other
instance: DP=4, R=2 -> instances [0,1] and [2,3], replica groups [0,2] and [1,3].
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ReplicaTopology:
    rank: int
    dp_ranks: tuple[int, ...]  # global ranks of this rank's DP x CP group, in DP order
    replica_num: int
    kind: str = "dense"  # dense | expert

    def __post_init__(self) -> None:
        if len(self.dp_ranks) % self.replica_num:
            raise ValueError(f"DP group {list(self.dp_ranks)} does not split into {self.replica_num} instances")

    @property
    def instance_size(self) -> int:
        return len(self.dp_ranks) // self.replica_num

    @property
    def dp_index(self) -> int:
        return self.dp_ranks.index(self.rank)

    @property
    def instance(self) -> int:
        return self.dp_index // self.instance_size

    @property
    def shard_index(self) -> int:
        """Which shard (position inside an instance) this rank holds."""
        return self.dp_index % self.instance_size

    @property
    def instance_ranks(self) -> list[int]:
        s = self.instance_size
        return list(self.dp_ranks[self.instance * s:(self.instance + 1) * s])

    @property
    def replica_group(self) -> list[int]:
        """Every rank holding this rank's shard, this rank included, in instance order."""
        s = self.instance_size
        return [self.dp_ranks[self.shard_index + k * s] for k in range(self.replica_num)]

    @property
    def peers(self) -> list[int]:
        return [r for r in self.replica_group if r != self.rank]

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "dp_ranks": list(self.dp_ranks), "instance": self.instance,
                "shard_index": self.shard_index, "replica_group": self.replica_group}


def from_parallel_state(replica_num: int, expert: bool = False) -> ReplicaTopology:
    """Read the topology megatron-core built, and check it against megatron's own instance group."""
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    if expert:
        full = ps.get_expert_data_parallel_group()
        partial = ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)
    else:
        full = ps.get_data_parallel_group(with_context_parallel=True)
        partial = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    topo = ReplicaTopology(rank, tuple(dist.get_process_group_ranks(full)), replica_num,
                           "expert" if expert else "dense")
    megatron_instance = dist.get_process_group_ranks(partial)
    if sorted(megatron_instance) != sorted(topo.instance_ranks):
        raise RuntimeError(f"rank {rank}: megatron-core's optimizer instance {megatron_instance} differs from "
                           f"the expected {topo.instance_ranks}; the replica layout would be wrong")
    return topo
