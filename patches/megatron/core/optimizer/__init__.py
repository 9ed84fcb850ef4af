"""megatron.core.optimizer.get_megatron_optimizer -> the built optimizer goes through the HA session,
which turns a DistributedOptimizer into a ReplicaOptimizer when replicas are on.

A restarted worker joining a running job (recover) builds its optimizer alone: megatron-core's
set-up all-gathers every rank's param-group keys over the world (to align the groups), a collective
the survivors are not in. Every rank of a layout where each rank holds the same kinds of parameters
has the same keys, so that gather is answered with the worker's own keys (the engine checks the
group count against its twin's when the state arrives)."""
import contextlib

from mindspeed_ha import session

TARGET = "megatron.core.optimizer"


@contextlib.contextmanager
def _gather_objects_locally():
    import torch.distributed as dist
    original = dist.all_gather_object

    def local(out, obj, group=None):
        out[:] = [obj] * len(out)
    dist.all_gather_object = local
    try:
        yield
    finally:
        dist.all_gather_object = original


def patches(ctx=None):
    import megatron.core.optimizer as target
    original = target.get_megatron_optimizer

    def get_megatron_optimizer(*args, **kwargs):
        s = session.current()
        with _gather_objects_locally() if s is not None and s.joining else contextlib.nullcontext():
            optimizer = original(*args, **kwargs)
        return s.on_optimizer_built(optimizer) if s is not None else optimizer

    get_megatron_optimizer.__wrapped__ = original
    return [(TARGET, "get_megatron_optimizer", get_megatron_optimizer)]
