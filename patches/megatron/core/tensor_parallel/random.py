"""megatron.core.tensor_parallel.random: the 'CUDA' RNG is the CPU generator on CPU."""
from mindspeed_ha.device import cpu

TARGET = "megatron.core.tensor_parallel.random"


def patches(ctx=None):
    return [
        (TARGET, "_get_cuda_rng_state", cpu.rng_state_get),
        (TARGET, "_set_cuda_rng_state", cpu.rng_state_set),
    ]
