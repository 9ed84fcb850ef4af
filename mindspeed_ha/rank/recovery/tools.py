"""What a recovery's orders do below the rank's session: its groups, its optimizer shard, its layout
and its checkpoints. ``RankRecovery`` (rank/recovery/handlers.py) is handed a ``RecoveryTools``: the
engine's own modules (``LiveTools``), or in its unit tests a fake that records each call
(tests/test_handlers.py), so that every order is tested without a process or a socket.
"""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol, Sequence

if TYPE_CHECKING:
    from mindspeed_ha.comm.groups import World
    from mindspeed_ha.events import EventLog
    from mindspeed_ha.plan import DumpPlan, ElasticPlan
    from mindspeed_ha.rank.recovery.dump import DumpResult, Prepared
    from mindspeed_ha.replica.optimizer import ReplicaMixin
    from mindspeed_ha.trainer_state.interface import TrainerInterface


class PeakMeasure(Protocol):
    """The peak memory a block reached above its start (None where nothing says)."""
    bytes: int | None


class RecoveryTools(Protocol):
    """All the orders use beneath the session."""

    # -- groups ------------------------------------------------------------------------------------
    def joining(self, world_size: int, rank: int, backend: str,
                timeout: datetime.timedelta) -> ContextManager[object]: ...
    def alone(self) -> ContextManager[None]: ...
    def reconnect(self, store_host: str, store_port: int, generation: int) -> dict[str, Any]: ...
    def survivor_world(self, survivors: Sequence[int], rank: int, store_host: str, store_port: int,
                       generation: int, timeout: datetime.timedelta, backend: str) -> World: ...
    def job_rank(self, rank: int) -> int: ...
    def parallel_sizes(self) -> tuple[int, int]: ...
    # -- the optimizer shard -------------------------------------------------------------------------
    def shard_status(self, trainer: TrainerInterface) -> dict[str, Any]: ...
    def transfer_shards(self, optimizer: ReplicaMixin, pairs: list[tuple[int, int]], rank: int, iteration: int,
                        overwriting: Callable[[], None], chunk_bytes: int) -> int: ...
    def transfer_bookkeeping(self, trainer: TrainerInterface, joiners: dict[int, int],
                             rank: int) -> dict[str, Any] | None: ...
    def shard_bytes(self, optimizer: ReplicaMixin) -> int: ...
    def peak_memory(self) -> ContextManager[PeakMeasure]: ...
    def resume_at(self, trainer: TrainerInterface, iteration: int) -> str: ...
    # -- the layout (elastic) -------------------------------------------------------------------------
    def holdings(self, trainer: TrainerInterface) -> dict[str, Any]: ...
    def enter_layout(self, trainer: TrainerInterface, plan: ElasticPlan, rank: int, store_host: str,
                     store_port: int, generation: int, backend: str, held: dict[str, Any],
                     timeout: datetime.timedelta) -> dict[str, Any]: ...
    def move_state(self, trainer: TrainerInterface, plan: ElasticPlan, rank: int, entered: dict[str, Any],
                   chunk_bytes: int) -> dict[str, Any]: ...
    # -- checkpoints -----------------------------------------------------------------------------------
    def newest_checkpoint(self, save_dir: str | None) -> tuple[int, str] | None: ...
    def prepare_dump(self, trainer: TrainerInterface, abandon_update: bool) -> Prepared: ...
    def write_dump(self, prepared: Prepared, plan: DumpPlan, world: World, save_dir: str, events: EventLog,
                   progress: Callable[[], None], chunk_bytes: int) -> DumpResult: ...


class LiveTools:
    """The engine's own: comm.groups, recovery.repair / elastic / dump, the checkpoint directory,
    megatron-core's parallel state (each imported where it is first used: a restarted worker's
    recovery imports what it needs only)."""

    def joining(self, world_size: int, rank: int, backend: str,
                timeout: datetime.timedelta) -> ContextManager[object]:
        from mindspeed_ha.comm import groups
        return groups.joining(world_size, rank, backend, timeout)

    def alone(self) -> ContextManager[None]:
        from mindspeed_ha.comm.interruptible import alone
        return alone()

    def reconnect(self, store_host: str, store_port: int, generation: int) -> dict[str, Any]:
        from mindspeed_ha.comm import groups
        return groups.reconnect(store_host, store_port, generation)

    def survivor_world(self, survivors: Sequence[int], rank: int, store_host: str, store_port: int,
                       generation: int, timeout: datetime.timedelta, backend: str) -> World:
        from mindspeed_ha.comm import groups
        return groups.survivor_world(survivors, rank, store_host, store_port, generation, timeout=timeout,
                                     backend=backend)

    def job_rank(self, rank: int) -> int:
        from mindspeed_ha.comm import groups
        return groups.job_rank(rank)

    def parallel_sizes(self) -> tuple[int, int]:
        """(pipeline stages, expert-parallel size) of the job's layout."""
        from megatron.core import parallel_state as ps
        return int(ps.get_pipeline_model_parallel_world_size()), int(ps.get_expert_model_parallel_world_size())

    def shard_status(self, trainer: TrainerInterface) -> dict[str, Any]:
        from mindspeed_ha.rank.recovery import repair
        return repair.status(trainer)

    def transfer_shards(self, optimizer: ReplicaMixin, pairs: list[tuple[int, int]], rank: int, iteration: int,
                        overwriting: Callable[[], None], chunk_bytes: int) -> int:
        from mindspeed_ha.rank.recovery import repair
        return repair.transfer_shards(optimizer, pairs, rank, iteration, overwriting, chunk_bytes=chunk_bytes)

    def transfer_bookkeeping(self, trainer: TrainerInterface, joiners: dict[int, int],
                             rank: int) -> dict[str, Any] | None:
        from mindspeed_ha.rank.recovery import repair
        return repair.transfer_bookkeeping(trainer, joiners, rank)

    def shard_bytes(self, optimizer: ReplicaMixin) -> int:
        from mindspeed_ha.rank.recovery import repair
        return repair.shard_bytes(optimizer)

    def peak_memory(self) -> ContextManager[PeakMeasure]:
        from mindspeed_ha.device.memory import PeakExtra
        return PeakExtra()

    def resume_at(self, trainer: TrainerInterface, iteration: int) -> str:
        from mindspeed_ha.rank.recovery import repair
        return repair.resume_at(trainer, iteration)

    def holdings(self, trainer: TrainerInterface) -> dict[str, Any]:
        from mindspeed_ha.rank.recovery import elastic
        return elastic.holdings(trainer)

    def enter_layout(self, trainer: TrainerInterface, plan: ElasticPlan, rank: int, store_host: str,
                     store_port: int, generation: int, backend: str, held: dict[str, Any],
                     timeout: datetime.timedelta) -> dict[str, Any]:
        from mindspeed_ha.rank.recovery import elastic
        return elastic.enter_layout(trainer, plan, rank, store_host, store_port, generation, backend=backend,
                                    held=held, timeout=timeout)

    def move_state(self, trainer: TrainerInterface, plan: ElasticPlan, rank: int, entered: dict[str, Any],
                   chunk_bytes: int) -> dict[str, Any]:
        from mindspeed_ha.rank.recovery import elastic
        return elastic.move_state(trainer, plan, rank, entered, chunk_bytes=chunk_bytes)

    def newest_checkpoint(self, save_dir: str | None) -> tuple[int, str] | None:
        from mindspeed_ha.trainer_state import checkpoint_dir
        return checkpoint_dir.newest_checkpoint(save_dir)

    def prepare_dump(self, trainer: TrainerInterface, abandon_update: bool) -> Prepared:
        from mindspeed_ha.rank.recovery import dump
        return dump.prepare(trainer, abandon_update=abandon_update)

    def write_dump(self, prepared: Prepared, plan: DumpPlan, world: World, save_dir: str, events: EventLog,
                   progress: Callable[[], None], chunk_bytes: int) -> DumpResult:
        from mindspeed_ha.rank.recovery import dump
        return dump.write(prepared, plan, world, save_dir, events, progress=progress, chunk_bytes=chunk_bytes)
