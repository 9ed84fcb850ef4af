"""The engine's calls a recovery's orders make (``handlers.RecoveryTools``), each by the name the
orders use: the functions themselves, no call passes through this module (mypy checks them against
the protocol). ``RankRecovery`` is handed it when the rank's processor starts, ahead of any fault; its
unit tests hand it a fake in its place (tests/test_handlers.py).
"""
from mindspeed_ha.comm.groups import communicators, job_rank, joining, reconnect, survivor_world
from mindspeed_ha.comm.interruptible import alone
from mindspeed_ha.device.memory import PeakExtra as peak_memory
from mindspeed_ha.rank.recovery.dump import prepare as prepare_dump
from mindspeed_ha.rank.recovery.dump import write as write_dump
from mindspeed_ha.rank.recovery.elastic import enter_layout, holdings, move_state, parallel_sizes
from mindspeed_ha.rank.recovery.restore import resume_at, shard_bytes, transfer_bookkeeping, transfer_shards
from mindspeed_ha.rank.recovery.restore import status as shard_status
from mindspeed_ha.trainer_state.checkpoint_dir import newest_checkpoint

__all__ = [
    # the groups
    "joining", "alone", "communicators", "reconnect", "survivor_world", "job_rank",
    # the optimizer shard
    "shard_status", "transfer_shards", "transfer_bookkeeping", "shard_bytes", "peak_memory", "resume_at",
    # the layout (elastic)
    "parallel_sizes", "holdings", "enter_layout", "move_state",
    # the checkpoints
    "newest_checkpoint", "prepare_dump", "write_dump",
]
