"""Entry of the Megatron-LM adaptor: the device, the CPU recipe and the patches, then Megatron-LM's
own ``pretrain`` with the providers of its ``pretrain_gpt.py`` (imported from ``MEGATRON_LM_PATH``,
never copied)."""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import NoReturn

from mindspeed_ha.events import get_logger

log = get_logger("megatron_lm")

# Megatron-LM flags whose defaults need CUDA, Transformer Engine, Apex or nvcc; forced on CPU (the
# same values as --transformer-impl local --no-gradient-accumulation-fusion --use-cpu-initialization
# --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion
# --no-persist-layer-norm --distributed-backend gloo).
CPU_ARGS = {
    "transformer_impl": "local",
    "gradient_accumulation_fusion": False,
    "use_cpu_initialization": True,
    "masked_softmax_fusion": False,
    "bias_gelu_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "no_persist_layer_norm": True,
    "distributed_backend": "gloo",
}

_device = None  # set by pretrain_gpt_main / prepare


def fail(msg: str, code: int = 2) -> NoReturn:
    """Bad input: say so on one line (naming this rank) and exit with ``code``, no traceback."""
    sys.stderr.write(f"mindspeed-ha: error (rank {os.environ.get('RANK', '0')}): {msg}\n")
    sys.stderr.flush()
    sys.exit(code)


# -- entry -----------------------------------------------------------------------------------------
def prepare():
    """Device, CPU recipe and patches; call before Megatron-LM is imported."""
    global _device
    from mindspeed_ha.device import DeviceError, detect
    try:
        _device = detect()
    except DeviceError as e:
        fail(str(e))
    if _device.needs_cpu_shim:
        # torch.compile (megatron.core.jit.jit_fuser) reads this when Megatron's modules are imported.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        # Megatron-LM asserts it with TP/CP > 1 on pre-Blackwell GPUs; a CPU has one "stream" anyway.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    path = os.environ.get("MEGATRON_LM_PATH")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    from mindspeed_ha.adaptor import apply_patches
    apply_patches(_device, megatron_lm=True)
    return _device


def _megatron_pretrain_gpt():
    """Megatron-LM's own pretrain_gpt.py as a module (its __main__ block does not run)."""
    root = os.environ.get("MEGATRON_LM_PATH") or next(
        (p for p in sys.path if p and os.path.isfile(os.path.join(p, "pretrain_gpt.py"))
         and os.path.isdir(os.path.join(p, "megatron", "training"))), None)
    if root is None:
        fail("Megatron-LM's pretrain_gpt.py not found: set MEGATRON_LM_PATH to a Megatron-LM checkout")
    name = "megatron_lm_pretrain_gpt"  # not "pretrain_gpt": examples/pretrain_gpt.py has that name
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, "pretrain_gpt.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def pretrain_gpt_main() -> int:
    """What Megatron-LM's ``pretrain_gpt.py`` does under ``__main__``, plus mindspeed-ha."""
    from mindspeed_ha import compat
    from mindspeed_ha.launcher import spare
    prepare()
    from megatron.core.enums import ModelType
    from mindspeed_ha.options import add_ha_args

    m = _megatron_pretrain_gpt()
    if spare.is_spare():  # recover: imports and patches are done ahead of a fault; now wait for a rank
        spare.wait_for_assignment()
    m.train_valid_test_datasets_provider.is_distributed = True
    pretrain, model_provider, kwargs = compat.pretrain_gpt_call(m)

    def extra_args(parser):
        if getattr(m, "has_nvidia_modelopt", False):
            parser = m.add_modelopt_args(parser)
        return add_ha_args(parser)

    try:
        pretrain(m.train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, m.forward_step,
                 args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, extra_args_provider=extra_args, **kwargs)
    finally:
        close_session()
    from mindspeed_ha.process import end_of_job
    return end_of_job()


def device_in_use():
    """The device this process trains on: the one ``prepare`` chose, else what is detected now."""
    if _device is not None:
        return _device
    from mindspeed_ha.device import detect
    return detect()


def close_session() -> None:
    from mindspeed_ha.rank import session
    s = session.current()
    if s is not None:
        s.close()
