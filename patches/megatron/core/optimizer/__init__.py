"""megatron.core.optimizer.get_megatron_optimizer -> the built optimizer goes through the HA session,
which turns a DistributedOptimizer into a ReplicaOptimizer when replicas are on."""
from mindspeed_ha.rank import session

TARGET = "megatron.core.optimizer"


def patches(ctx=None):
    import megatron.core.optimizer as target
    original = target.get_megatron_optimizer

    def get_megatron_optimizer(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        s = session.current()
        return s.on_optimizer_built(optimizer) if s is not None else optimizer

    get_megatron_optimizer.__wrapped__ = original
    return [(TARGET, "get_megatron_optimizer", get_megatron_optimizer)]
