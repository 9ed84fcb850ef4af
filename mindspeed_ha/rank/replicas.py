"""The replica optimizer, wired into a rank: every optimizer megatron builds becomes a replica one (its
twins found and checked against megatron-core's groups), its updates reported to the processor and
drill points, its RNG recorded at every update's end; and the replica check, which compares each
shard with its twin's, bit for bit.
"""
from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from mindspeed_ha.events import get_logger
from mindspeed_ha.rank.state import RankState

log = get_logger("session")


class ReplicaWiring:
    """What the session does with each optimizer megatron builds, on the rank's state."""

    def __init__(self, state: RankState) -> None:
        self.state = state
        self.replica_pg: Any = None   # megatron-core's inter-instance group (the twins')
        self.tracking = False         # the RNG is recorded at every update's end (``track``)

    def on_optimizer_built(self, optimizer: Any) -> Any:
        """Called (through the get_megatron_optimizer patch) for every optimizer megatron builds."""
        st = self.state
        if not st.options.use_replica_optimizer:
            return optimizer
        from mindspeed_ha import compat
        from mindspeed_ha.replica.optimizer import inner_optimizers, make_replica
        from mindspeed_ha.replica.topology import from_parallel_state

        R = st.options.replica_num
        for inner in inner_optimizers(optimizer):
            got = getattr(getattr(inner, "ddp_config", None), "num_distributed_optimizer_instances", None)
            if got != R:
                raise RuntimeError(
                    f"the replica optimizer needs megatron-core's partial distributed optimizer with "
                    f"num_distributed_optimizer_instances={R} (DDP config and initialize_model_parallel), "
                    f"got {got}; with Megatron-LM pass --use-distributed-optimizer")
        st.topology = topology = from_parallel_state(R)
        if getattr(self.trainer_config(optimizer), "num_moe_experts", None):
            # megatron-core reduces expert and dense gradients across instances over ONE group, so an
            # expert shard's twins must be its dense twins; check that instead of assuming it.
            st.expert_topology = expert = from_parallel_state(R, expert=True)
            if expert.replica_group != topology.replica_group:
                raise RuntimeError(
                    f"rank {st.rank}: expert replica group {expert.replica_group} differs from "
                    f"the dense one {topology.replica_group}; this MoE layout is not supported by the "
                    "replica optimizer (try another --expert-model-parallel-size)")
        make_replica(optimizer, topology)
        optimizer.ha_add_listener(self._on_update)
        if self.tracking:  # an optimizer rebuilt in a running job (elastic resize)
            self._track_rng(optimizer)
        st.injector.set_uce_corruptor(optimizer.ha_corrupt)
        st.optimizer = optimizer
        self.replica_pg = compat.inter_instance_group()
        pg_ranks = dist.get_process_group_ranks(self.replica_pg)
        if sorted(pg_ranks) != sorted(topology.replica_group):
            raise RuntimeError(f"rank {st.rank}: megatron-core's inter-instance group {pg_ranks} is not "
                               f"the replica group {topology.replica_group}")
        # The seeds' line (MindIO's wording), then the same as an event; in job ranks (an elastic
        # resize renumbers the default group, not the job).
        from mindspeed_ha.comm.groups import job_rank
        group = [job_rank(r) for r in topology.replica_group]
        if st.processor is not None:
            st.processor.replica_group(group)
        log.info("rank:%d, report group list: %s", st.rank, group)
        st.events.emit("replica_groups", replica_group=group,
                       instance=topology.instance, shard_index=topology.shard_index,
                       dp_ranks=[job_rank(r) for r in topology.dp_ranks], replica_num=R,
                       expert_replica_group=st.expert_topology.replica_group if st.expert_topology else None,
                       expert_dp_ranks=list(st.expert_topology.dp_ranks) if st.expert_topology else None,
                       shard_tensors=len(optimizer.ha_shard_description()))
        return optimizer

    @staticmethod
    def trainer_config(optimizer: Any) -> Any:
        from mindspeed_ha.replica.optimizer import inner_optimizers
        for inner in inner_optimizers(optimizer):
            for chunk in getattr(inner, "model_chunks", None) or []:
                return getattr(chunk, "config", None)
        return None

    def track(self) -> None:
        """From now on (after set-up and ``--load``, before the first step) the RNG is recorded as of
        every update's end, starting with the current one."""
        st = self.state
        assert st.trainer is not None  # (attach_trainer came first)
        self.tracking = True
        st.trainer.rng.record(st.trainer.iteration)  # after setup/--load, before any forward: the current RNG
        self._track_rng(st.optimizer)

    def _track_rng(self, optimizer: Any) -> None:
        assert self.state.trainer is not None  # (only once track ran)
        history = self.state.trainer.rng
        optimizer.ha_add_listener(lambda event, it: history.record(it) if event == "update_end" else None)

    def _on_update(self, event: str, iteration: int) -> None:
        if event == "update_start":
            self.state.fire("optimizer", iteration)  # inside the update window: the shard is mid-update
        processor = self.state.processor
        if processor is not None:
            (processor.update_start if event == "update_start" else processor.update_end)(iteration)

    def verify(self, iteration: int) -> dict[str, Any]:
        """The replica check: every shard equals its twin's, bit for bit (else ``ReplicaMismatchError``)."""
        from mindspeed_ha.comm.groups import job_rank
        from mindspeed_ha.replica.verify import ReplicaMismatchError, check_replicas
        st = self.state
        t0 = time.perf_counter()
        try:
            fields = check_replicas(st.optimizer, iteration, self.replica_pg, job_rank)
        except ReplicaMismatchError as e:
            st.events.emit("replica_check", iteration=iteration, ok=False, error=str(e))
            log.error("%s", e)
            raise
        fields["seconds"] = time.perf_counter() - t0
        st.events.emit("replica_check", **fields)
        if st.rank == 0:  # every rank checked; one line for the console
            log.info("replica check at iteration %d: every shard equals its twin, bit for bit (%d tensors "
                     "on rank 0, %.3f s)", iteration, fields["tensors"], fields["seconds"])
        return fields
