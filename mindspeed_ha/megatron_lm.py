"""The Megatron-LM adaptor: Megatron-LM's own ``pretrain`` under mindspeed-ha.

``pretrain_gpt_main()`` applies the patches, adds the HA flags to Megatron-LM's parser and runs
Megatron-LM's ``pretrain`` with the providers of its own ``pretrain_gpt.py`` (imported from
``MEGATRON_LM_PATH``, never copied). The ``on_*`` functions are what ``patches/megatron/training``
re-routes into; ``MegatronLMTrainer`` is the engine's narrow trainer interface over Megatron-LM's
objects. Only this module (and the patches) import ``megatron.training``, and only lazily.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import time

from mindspeed_ha.events import get_logger
from mindspeed_ha.trainer.interface import TrainerInterface

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


def _fail(msg: str, code: int = 2) -> "NoReturn":  # noqa: F821
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
        _fail(str(e))
    if _device.needs_cpu_shim:
        # torch.compile (megatron.core.jit.jit_fuser) reads this when Megatron's modules are imported.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
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
        _fail("Megatron-LM's pretrain_gpt.py not found: set MEGATRON_LM_PATH to a Megatron-LM checkout")
    name = "megatron_lm_pretrain_gpt"  # not "pretrain_gpt": examples/pretrain_gpt.py has that name
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, "pretrain_gpt.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def pretrain_gpt_main() -> int:
    """What Megatron-LM's ``pretrain_gpt.py`` does under ``__main__``, plus mindspeed-ha."""
    prepare()
    from megatron.core.enums import ModelType
    from mindspeed_ha import session
    from mindspeed_ha.options import add_ha_args

    m = _megatron_pretrain_gpt()
    m.set_startup_timestamps(program_start=m._PROGRAM_START_TIME, main_entry=time.time())
    m.train_valid_test_datasets_provider.is_distributed = True
    pretrain, store = m.inprocess_restart.maybe_wrap_for_inprocess_restart(m.pretrain)

    def extra_args(parser):
        if m.has_nvidia_modelopt:
            parser = m.add_modelopt_args(parser)
        return add_ha_args(parser)

    _PROVIDERS["train_valid_test"] = m.train_valid_test_datasets_provider
    try:
        pretrain(m.train_valid_test_datasets_provider, functools.partial(m.model_provider, m.gpt_builder),
                 ModelType.encoder_or_decoder, m.forward_step,
                 args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, extra_args_provider=extra_args,
                 store=store, get_embedding_ranks=m.get_embedding_ranks)
    finally:
        s = session.current()
        if s is not None:
            s.close()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


_PROVIDERS: dict = {}


# -- hooks (re-routed here by patches/megatron/training) ------------------------------------------
def on_parse_args(original, *args, **kwargs):
    """After Megatron-LM parses its flags and before anything is built: CPU recipe, HA options,
    layout validation (same message on every rank, exit 2), replica count, the rank's session."""
    from mindspeed_ha import layout, options as ha_options
    from mindspeed_ha.device import detect
    from mindspeed_ha.options import HAConfigError
    from mindspeed_ha.session import RankSession

    ns = original(*args, **kwargs)
    device = _device or detect()
    if device.needs_cpu_shim:
        for key, value in CPU_ARGS.items():
            setattr(ns, key, value)
    try:
        opts = ha_options.from_args(ns)
        layout.validate(ns.world_size, ns, opts)
        if opts.use_replica_optimizer:
            got = ns.num_distributed_optimizer_instances
            if got not in (1, opts.replica_num):
                raise HAConfigError(
                    f"--num-distributed-optimizer-instances {got} conflicts with --optimizer-replica-num "
                    f"{opts.replica_num}: the replica optimizer sets it; drop the former")
            # Megatron-LM passes it to initialize_model_parallel and to the DDP config.
            ns.num_distributed_optimizer_instances = opts.replica_num
    except HAConfigError as e:
        _fail(str(e))
    RankSession(opts, device, ns.rank, ns.world_size, ns.local_rank)
    return ns


def on_train_step(original, forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                  config, forward_backward_func, iteration=None):
    from mindspeed_ha import session
    s = session.current()
    if s is None:
        return original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                        config, forward_backward_func, iteration=iteration)
    trainer = s.trainer
    if not isinstance(trainer, MegatronLMTrainer):
        trainer = MegatronLMTrainer(model, optimizer, opt_param_scheduler, iteration or 0)
        s.attach_trainer(trainer)
    trainer.bind_step(original, forward_step_func, data_iterator, config, forward_backward_func)
    return trainer.run_step(iteration)


def on_save_checkpoint(original, iteration, *args, **kwargs):
    from megatron.training import get_args
    from mindspeed_ha import session
    s = session.current()
    if s is not None:
        s.fire("checkpoint", iteration)
    t0 = time.perf_counter()
    out = original(iteration, *args, **kwargs)
    if s is not None and not kwargs.get("non_persistent_ckpt"):
        s.saved(iteration, os.path.join(get_args().save, f"iter_{iteration:07d}"), time.perf_counter() - t0)
    return out


def on_load_checkpoint(original, ddp_model, optimizer, *args, **kwargs):
    import torch
    from megatron.core.optimizer import distrib_optimizer
    from megatron.training import get_args
    from megatron.training.checkpointing import checkpoint_exists
    from mindspeed_ha import session
    from mindspeed_ha.trainer.checkpoint import _fix_adam_steps
    a = get_args()
    inners = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    torch_adam = optimizer is not None and not distrib_optimizer.HAVE_APEX_OR_TE
    if torch_adam and not a.no_load_optim and checkpoint_exists(getattr(a, kwargs.get("load_arg", "load"))):
        # Trap 1 (DESIGN.md): on the torch-Adam path DistributedOptimizer.state_dict() needs the
        # per-parameter ``step``, which exists only after a first step: give it dummy state to load into.
        for inner in inners:
            if isinstance(inner, distrib_optimizer.DistributedOptimizer) and not inner.optimizer.state:
                inner._init_optimizer_states_with_dummy_values()
    t0 = time.perf_counter()
    with torch.no_grad():  # fp32 runs: the optimizer's main-param shards are views of leaf parameters
        iteration, flops = original(ddp_model, optimizer, *args, **kwargs)
    if torch_adam and iteration and not a.no_load_optim and not a.finetune:
        # Trap 3: Megatron-LM restores one shared ``step`` tensor for every parameter, which torch's
        # Adam would bump once per parameter per step: one tensor each.
        _fix_adam_steps(optimizer, None)
    if iteration and hasattr(optimizer, "ha_iteration"):
        optimizer.ha_iteration = iteration  # the replica shard's iteration follows the checkpoint
    s = session.current()
    if s is not None and iteration:
        s.loaded(iteration, os.path.join(a.load, f"iter_{iteration:07d}"), time.perf_counter() - t0)
    return iteration, flops


def on_build_data_iterators(original, *args, **kwargs):
    """CPU only. Under the CPU shim the "CUDA" RNG (dropout) *is* the CPU generator, from which each
    new DataLoader iterator draws its base seed: a resumed run builds its iterators after loading the
    RNG state, so without this its dropout stream would be one draw off the uninterrupted run's."""
    import torch
    state = torch.get_rng_state()
    try:
        return original(*args, **kwargs)
    finally:
        torch.set_rng_state(state)


# -- the engine's view of Megatron-LM ---------------------------------------------------------------
class MegatronLMTrainer(TrainerInterface):
    """The narrow trainer interface over Megatron-LM's objects and functions (the built-in trainer
    implements the same one)."""

    def __init__(self, model, optimizer, scheduler, iteration: int):
        self.model_chunks, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.iteration = iteration
        self._step = None

    @property
    def consumed_samples(self) -> int:
        from megatron.training import get_args
        return get_args().consumed_train_samples

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        from megatron.training import get_args
        get_args().consumed_train_samples = value

    def bind_step(self, original, forward_step_func, data_iterator, config, forward_backward_func):
        self._step = (original, forward_step_func, config, forward_backward_func)
        self._data_iter = data_iterator

    def data_iterator(self, consumed_samples: int):
        from megatron.training import get_args
        from megatron.training.training import build_train_valid_test_data_iterators
        a = get_args()
        saved = a.consumed_train_samples, a.iteration
        a.consumed_train_samples, a.iteration = consumed_samples, consumed_samples // a.global_batch_size
        try:
            return build_train_valid_test_data_iterators(_PROVIDERS["train_valid_test"])[0]
        finally:
            a.consumed_train_samples, a.iteration = saved

    def run_step(self, iteration: int | None = None):
        """Megatron-LM's train_step between the session's step hooks; returns its result tuple."""
        from megatron.core import parallel_state as ps
        from mindspeed_ha import session
        original, forward_step_func, config, forward_backward_func = self._step
        it = (self.iteration if iteration is None else iteration) + 1
        s = session.current()
        s.step_start(it)
        out = original(forward_step_func, self._data_iter, self.model_chunks, self.optimizer, self.scheduler,
                       config, forward_backward_func, iteration=it - 1)
        self.iteration = it
        loss = None
        if ps.is_pipeline_last_stage(ignore_virtual=True) and "lm loss" in out[0]:
            loss = float(out[0]["lm loss"])  # all-reduced over DP x CP and divided by its tokens
        grad_norm = out[5]
        s.step_end(it, loss, grad_norm=grad_norm, lr=self._lr())
        return out

    def _lr(self):
        for group in self.optimizer.param_groups:
            if group["params"]:
                return group["lr"]
        return None

    def train_step(self) -> float | None:
        from megatron.core import parallel_state as ps
        from megatron.training import get_args
        if self._step is None:
            raise RuntimeError("Megatron-LM's loop has not run a step yet: nothing to drive")
        out = self.run_step()
        a = get_args()
        a.consumed_train_samples += a.global_batch_size
        if ps.is_pipeline_last_stage(ignore_virtual=True) and "lm loss" in out[0]:
            return float(out[0]["lm loss"])
        return None

    def save_checkpoint(self, save_dir: str) -> str:
        import megatron.training.training as training
        from megatron.training import get_args
        a = get_args()
        saved, a.save = a.save, save_dir
        try:
            training.save_checkpoint(self.iteration, self.model_chunks, self.optimizer, self.scheduler,
                                     getattr(a, "num_floating_point_operations_so_far", 0))
        finally:
            a.save = saved
        return os.path.join(save_dir, f"iter_{self.iteration:07d}")

    def load_checkpoint(self, load_dir: str) -> int:
        import megatron.training.training as training
        from megatron.training import get_args
        a = get_args()
        saved, a.load = a.load, load_dir
        try:
            self.iteration, a.num_floating_point_operations_so_far = training.load_checkpoint(
                self.model_chunks, self.optimizer, self.scheduler)
        finally:
            a.load = saved
        self._data_iter = self.data_iterator(self.consumed_samples)
        return self.iteration
