"""megatron.training (Megatron-LM's own loop) -> mindspeed_ha.megatron_lm.

Megatron-LM's modules import what they call by name, so each name is patched where it is looked up:
``initialize.parse_args`` (options, validation, replica count and the HA session, before any model
is built), ``initialize._initialize_distributed`` (kept for a recovery's group rebuild; a restarted
worker joins there), ``training.setup_model_and_optimizer`` (a restarted worker takes its state),
``training.get_megatron_optimizer`` (the replica optimizer; the call is kept for an elastic resize), ``training.train_step``
(step hooks), ``training.save_checkpoint`` / ``training.load_checkpoint`` (events, Adam ``step`` fix),
``training.build_train_valid_test_data_iterators`` (the provider; on CPU, the RNG kept out of the
DataLoader's seed draw), ``training.update_num_microbatches`` and ``training.get_num_microbatches`` (the loop's
rampup check after an elastic resize). On CPU also ``legacy.fused_kernels.load`` (CUDA kernels cannot be built),
``arguments.get_device_arch_version`` (there is no GPU to ask) and ``training.initialize_megatron``
(it asserts CUDA unless told ``allow_no_cuda``). And ``core.datasets.utils.compile_helpers`` when
``helpers_cpp`` is already importable (the make it runs asks the system's
``python3-config``/pybind11, which may not be the training Python); without Transformer Engine,
``checkpointing.fix_fp8_params_lose_precision_when_loading_dist_ckpt`` (core_v0.12.1 imports TE
there to ask its version; with no TE there is no fp8 parameter).
"""
import mindspeed_ha.patches as registry

INIT, TRAINING = "megatron.training.initialize", "megatron.training.training"


def _route(name: str, original):
    """A thin wrapper calling ``mindspeed_ha.megatron_lm.<name>(original, *args, **kwargs)``."""
    def patched(*args, **kwargs):
        from mindspeed_ha import megatron_lm
        return getattr(megatron_lm, name)(original, *args, **kwargs)
    patched.__wrapped__ = original
    patched.__name__ = getattr(original, "__name__", name)
    return patched


def patches(ctx=None):
    import megatron.core.optimizer as core_optimizer
    import megatron.training.initialize as init
    import megatron.training.training as training

    table = [
        (INIT, "parse_args", _route("on_parse_args", init.parse_args)),
        (INIT, "_initialize_distributed", _route("on_initialize_distributed", init._initialize_distributed)),
        (TRAINING, "train_step", _route("on_train_step", training.train_step)),
        (TRAINING, "setup_model_and_optimizer",
         _route("on_setup_model_and_optimizer", training.setup_model_and_optimizer)),
        (TRAINING, "save_checkpoint", _route("on_save_checkpoint", training.save_checkpoint)),
        (TRAINING, "load_checkpoint", _route("on_load_checkpoint", training.load_checkpoint)),
        (TRAINING, "build_train_valid_test_data_iterators",
         _route("on_build_data_iterators", training.build_train_valid_test_data_iterators)),
        (TRAINING, "update_num_microbatches",
         _route("on_update_num_microbatches", training.update_num_microbatches)),
        (TRAINING, "get_num_microbatches", _route("on_get_num_microbatches", training.get_num_microbatches)),
    ]
    # training.py bound get_megatron_optimizer at import: point it at the (possibly already) re-routed
    # megatron.core one, so the session sees every optimizer exactly once.
    build = core_optimizer.get_megatron_optimizer if "replica_optimizer" in registry.applied() \
        else training.get_megatron_optimizer
    table.append((TRAINING, "get_megatron_optimizer", _route("on_get_megatron_optimizer", build)))
    import megatron.training.checkpointing as checkpointing
    if not _te_installed() and hasattr(checkpointing, "fix_fp8_params_lose_precision_when_loading_dist_ckpt"):
        # core_v0.12.1 asks Transformer Engine's version there (ModuleNotFoundError in every torch_dist
        # load without it); without it there is no fp8 parameter to fix
        table.append(("megatron.training.checkpointing", "fix_fp8_params_lose_precision_when_loading_dist_ckpt",
                      _noop))
    if _helpers_prebuilt():
        table.append(("megatron.core.datasets.utils", "compile_helpers", _noop))
    if "torch_cpu" in registry.applied():
        table.append((TRAINING, "initialize_megatron", _without_cuda(training.initialize_megatron)))
        table.append(("megatron.legacy.fused_kernels", "load", _noop))
        # validate_args asks the GPU's architecture (CUDA_DEVICE_MAX_CONNECTIONS rules) with TP/CP > 1.
        table.append(("megatron.training.arguments", "get_device_arch_version", _no_gpu_arch))
    return table


def _noop(*args, **kwargs):
    return None


def _without_cuda(original):
    """Megatron-LM asserts CUDA unless asked not to; on the CPU it is asked not to."""
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)
    initialize_megatron.__wrapped__ = original
    return initialize_megatron


def _no_gpu_arch() -> int:
    return 0


def _te_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("transformer_engine") is not None


def _helpers_prebuilt() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None
    except ImportError:
        return False
