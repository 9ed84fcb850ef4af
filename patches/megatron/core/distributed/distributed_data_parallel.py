"""DistributedDataParallel.start_param_sync -> tell the HA session first: the shard update of this
iteration is complete, the parameter all-gather is about to start (the "param-sync" phase)."""
from mindspeed_ha.rank import session

TARGET = "megatron.core.distributed.distributed_data_parallel"


def patches(ctx=None):
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel as DDP
    original = DDP.start_param_sync

    def start_param_sync(self, *args, **kwargs):
        s = session.current()
        if s is not None:
            s.before_param_sync()
        return original(self, *args, **kwargs)

    return [(DDP, "start_param_sync", start_param_sync)]
