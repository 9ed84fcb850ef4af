"""The Megatron-LM adaptor: Megatron-LM's own ``pretrain`` under mindspeed-ha.

``pretrain_gpt_main()`` applies the patches, adds the HA flags to Megatron-LM's parser and runs
Megatron-LM's ``pretrain`` with the providers of its own ``pretrain_gpt.py`` (imported from
``MEGATRON_LM_PATH``, never copied). The ``on_*`` functions are what ``patches/megatron/training``
re-routes into; ``MegatronLMTrainer`` is the engine's narrow trainer interface over Megatron-LM's
objects. Only this module (and the patches) import ``megatron.training``, and only lazily.
"""
from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import sys
import time
from typing import NoReturn

from mindspeed_ha.events import get_logger
from mindspeed_ha.trainer.interface import TrainerInterface
from mindspeed_ha.trainer.replay import Replayable

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


def _fail(msg: str, code: int = 2) -> NoReturn:
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
    from mindspeed_ha.launcher import spare
    prepare()
    from megatron.core.enums import ModelType
    from mindspeed_ha.options import add_ha_args

    m = _megatron_pretrain_gpt()
    if spare.is_spare():  # recover: imports and patches are done ahead of a fault; now wait for a rank
        spare.wait_for_assignment()
    m.set_startup_timestamps(program_start=m._PROGRAM_START_TIME, main_entry=time.time())
    m.train_valid_test_datasets_provider.is_distributed = True
    pretrain, store = m.inprocess_restart.maybe_wrap_for_inprocess_restart(m.pretrain)

    def extra_args(parser):
        if m.has_nvidia_modelopt:
            parser = m.add_modelopt_args(parser)
        return add_ha_args(parser)

    try:
        pretrain(m.train_valid_test_datasets_provider, functools.partial(m.model_provider, m.gpt_builder),
                 ModelType.encoder_or_decoder, m.forward_step,
                 args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, extra_args_provider=extra_args,
                 store=store, get_embedding_ranks=m.get_embedding_ranks)
    finally:
        close_session()
    import torch.distributed as dist
    from mindspeed_ha.recovery import groups
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if groups.has_retired_groups():  # repaired in place: old communicators must not be destructed
        groups.exit_now(0)
    return 0


_PROVIDERS: dict = {}  # what Megatron-LM's set-up used and the trainer needs again (data provider, groups, ...)


# -- hooks (re-routed here by patches/megatron/training) ------------------------------------------
def _with_ha_args(provider):
    """Megatron-LM's extra_args_provider plus the HA flags, unless it already adds them (so that an
    unmodified pretrain script under ``import mindspeed_ha.megatron_adaptor`` takes them too)."""
    from mindspeed_ha.options import add_ha_args

    def provide(parser):
        if provider is not None:
            parser = provider(parser) or parser
        if "--enable-high-availability" not in parser._option_string_actions:
            add_ha_args(parser)
        return parser
    return provide


def on_parse_args(original, extra_args_provider=None, ignore_unknown_args=False):
    """After Megatron-LM parses its flags and before anything is built: CPU recipe, HA options,
    layout validation (same message on every rank, exit 2), replica count, the rank's session."""
    from mindspeed_ha import layout, options as ha_options
    from mindspeed_ha.options import HAConfigError
    from mindspeed_ha.session import RankSession

    ns = original(_with_ha_args(extra_args_provider), ignore_unknown_args)
    device = _device or _detect()
    if device.needs_cpu_shim:
        changed = {k: v for k, v in CPU_ARGS.items() if getattr(ns, k, None) != v}
        for key, value in changed.items():
            setattr(ns, key, value)
        if changed and ns.rank == 0:
            log.info("CPU: set %s (CUDA-only defaults of Megatron-LM)",
                     ", ".join(f"{k}={v}" for k, v in changed.items()))
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
    s = RankSession(opts, device, ns.rank, ns.world_size, ns.local_rank)
    if _joining(s):
        ns.load = None  # a restarted worker takes the job's state from its peers, not from --load
    atexit.register(close_session)  # an unmodified pretrain script has no place to close it
    return ns


def _joining(s) -> bool:
    """A worker restarted by its agent into a job that runs on (recover)."""
    return s is not None and "recover" in s.options.strategies and s.restarted_worker()


def on_initialize_distributed(original, get_embedding_ranks, get_position_embedding_ranks, store):
    """Remembers how Megatron-LM built its groups: a recovery's rebuild runs the same again (the
    default group exists then, so only megatron-core's groups are made)."""
    from mindspeed_ha import session
    from mindspeed_ha.comm import interruptible
    _PROVIDERS["init_parallel"] = functools.partial(original, get_embedding_ranks, get_position_embedding_ranks, None)
    s = session.current()
    if not _joining(s):
        return original(get_embedding_ranks, get_position_embedding_ranks, store)
    # Recover: no env:// rendezvous (that world is gone). Register and wait for the controller's
    # rebuild: the default group of the survivors' new generation, then these groups made again.
    s.device.set_current(s.local_rank)  # what Megatron-LM's skipped init would have done
    s.join_running_job(_GroupsOnly(), until="rebuild")
    interruptible.set_alone(True)  # Megatron-LM's set-up runs on while the survivors wait
    return None


def on_setup_model_and_optimizer(original, *args, **kwargs):
    """A joiner, once its model and optimizer exist (built alone, no --load): the shard and the
    twin's counters, scheduler and RNG come over the rebuilt groups; then Megatron-LM goes on with
    the job's iteration and data position (its loop reads them from ``args``)."""
    from megatron.training import get_args
    from mindspeed_ha import session
    from mindspeed_ha.comm import interruptible
    out = original(*args, **kwargs)
    # Megatron-LM caches its checkpoint strategies (holding the DP group) in this dict: a rebuild
    # re-points them with the rest (MegatronLMTrainer.group_holders).
    _PROVIDERS["checkpointing_context"] = kwargs.get("checkpointing_context")
    s = session.current()
    if s is None or not s.joining:
        return out
    model, optimizer, scheduler = out
    trainer = MegatronLMTrainer(model, optimizer, scheduler, 0)
    trainer._ha_ready = True
    s.attach_trainer(trainer)
    s.trainer_ready()
    interruptible.set_alone(False)
    s.join_running_job(trainer, until="resume")  # repair, rollback, resume: with the survivors
    # The loop starts where the survivors' loops are. After a roll-forward, that is before the
    # failed step's own bookkeeping (its logging has collectives): the first train_step call here
    # returns the step's result, as the survivors' failing call did. The data loaders are built
    # at the position of the next step that draws data.
    a = get_args()
    a.iteration, a.consumed_train_samples = trainer.loop_position()
    interruptible.set_alone(True)  # data loaders and the loop's preamble, until the first step
    return out


class _GroupsOnly:
    """What a joiner has when the rebuild comes: no model yet, so its set-up is only the groups."""
    optimizer = None

    def setup(self, joining: bool = True) -> None:
        _PROVIDERS["init_parallel"]()


def close_session() -> None:
    from mindspeed_ha import session
    s = session.current()
    if s is not None:
        s.close()


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
    from mindspeed_ha.comm import interruptible
    interruptible.set_alone(False)  # a joiner's set-up is over: from here on it trains with the job
    out = trainer.hand_rolled_forward()
    if out is not None:  # a joiner: its recovery finished this step (see on_setup_model_and_optimizer)
        return out
    if not first_step_done(trainer):
        s.trainer_ready()  # after Megatron-LM's --load: the state recovery starts from
    while True:
        try:
            return trainer.run_step(iteration)
        except Exception as e:  # report at once and serve the controller (recovery runs here)
            from mindspeed_ha.comm.interruptible import CollectiveStopped
            if not isinstance(e, CollectiveStopped):
                import traceback
                traceback.print_exc()
            if not s.report_fault(e, trainer._running):
                raise
        # Repaired in place (retry): the loop gets the step's result as if nothing had happened.
        out = trainer.hand_rolled_forward()
        if out is not None:  # its update had completed: only the rest of train_step ran
            return out
        # rolled back: the step runs again, with the same microbatches and RNG


def first_step_done(trainer) -> bool:
    done = getattr(trainer, "_ha_ready", False)
    trainer._ha_ready = True
    return done


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
    load_dir = getattr(a, kwargs.get("load_arg", "load"))
    inners = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    torch_adam = optimizer is not None and not distrib_optimizer.HAVE_APEX_OR_TE
    if torch_adam and not a.no_load_optim and not a.finetune and checkpoint_exists(load_dir):
        # Trap 1 (DESIGN.md): on the torch-Adam path DistributedOptimizer.state_dict() needs the
        # per-parameter ``step``, which exists only after a first step: give it dummy state to load into.
        for inner in inners:
            if isinstance(inner, distrib_optimizer.DistributedOptimizer) and not inner.optimizer.state:
                inner._init_optimizer_states_with_dummy_values()
    t0 = time.perf_counter()
    with torch.no_grad():  # fp32 runs: the optimizer's main-param shards are views of leaf parameters
        iteration, flops = original(ddp_model, optimizer, *args, **kwargs)
    if torch_adam and iteration and not a.no_load_optim and not a.finetune:
        # Traps 2 and 3: Megatron-LM restores one shared ``step`` tensor for every parameter, which torch's
        # Adam would bump once per parameter per step: one tensor each.
        _fix_adam_steps(optimizer)
    if iteration and hasattr(optimizer, "ha_iteration"):
        optimizer.ha_iteration = iteration  # the replica shard's iteration follows the checkpoint
    s = session.current()
    if s is not None and iteration and s.trainer is None:  # (an in-process reload: the session reports it)
        s.loaded(iteration, os.path.join(load_dir, f"iter_{iteration:07d}"), time.perf_counter() - t0)
    return iteration, flops


def on_build_data_iterators(original, provider, *args, **kwargs):
    """Remembers the dataset provider (for MegatronLMTrainer.data_iterator). On CPU also keeps the
    RNG untouched: under the CPU shim the "CUDA" RNG (dropout) *is* the CPU generator, from which each
    new DataLoader iterator draws its base seed; a resumed run builds its iterators after loading the
    RNG state, so without this its dropout stream would be one draw off the uninterrupted run's."""
    import torch
    _PROVIDERS["train_valid_test"] = provider
    if not (_device or _detect()).needs_cpu_shim:
        return original(provider, *args, **kwargs)
    state = torch.get_rng_state()
    try:
        return original(provider, *args, **kwargs)
    finally:
        torch.set_rng_state(state)


def _detect():
    from mindspeed_ha.device import detect
    return detect()


# -- the engine's view of Megatron-LM ---------------------------------------------------------------
class MegatronLMTrainer(TrainerInterface):
    """The narrow trainer interface over Megatron-LM's objects and functions (the built-in trainer
    implements the same one). ``iteration`` and ``consumed_samples`` count completed steps; inside
    Megatron-LM's loop they run one step ahead of its ``args`` until the loop's own bookkeeping."""

    def __init__(self, model, optimizer, scheduler, iteration: int):
        from megatron.training import get_args
        self.model_chunks, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.iteration = iteration
        self.ended = iteration  # the last step whose train_step returned
        self.consumed_samples = get_args().consumed_train_samples
        self._step = None
        self._running = iteration  # the iteration in flight (phase points)
        self._loop_iter = self._data_iter = None
        self._replays: list[Replayable] = []
        self._fb_out = None         # the step's forward-backward result (a roll-forward reuses it)
        self._reduced = None        # its losses reduced over DP (under recover, see _reduce_losses)
        self._at_start: dict = {}   # what the step's partial tail may have advanced (undone on recovery)
        self.rolled_forward = None  # train_step's result, when a recovery finished the failed step
        self._catch_up = None       # after a reload: the checkpoint's data position (_reloaded_data)
        self._loop_at = None        # a joiner after a reload: where its loop enters (loop_position)

    def bind_step(self, original, forward_step_func, data_iterator, config, forward_backward_func):
        """Called by Megatron-LM's loop before each of its steps: its objects and position are the truth."""
        from megatron.training import get_args
        self._step = (original, forward_step_func, config, forward_backward_func)
        if data_iterator is not self._loop_iter:  # the loop hands the same object every step
            self._loop_iter = data_iterator
            self._data_iter = self._replayable(data_iterator)
        if self.rolled_forward is None and self._catch_up is None:  # (else the loop is elsewhere: loop_position)
            self.consumed_samples = get_args().consumed_train_samples

    def loop_position(self) -> tuple[int, int]:
        """Where a joiner's Megatron-LM loop starts (iteration, consumed samples): one step behind
        while a rolled-forward step's result waits for the loop's train_step call (that call gives
        the samples back, hand_rolled_forward); at the survivors' loops after a reload, the steps
        in between caught up in its first call (a constant global batch size assumed)."""
        if self._loop_at is not None:
            return self._loop_at, self.consumed_samples + (self._loop_at - self.iteration) * self.global_batch_size
        return self.iteration - (self.rolled_forward is not None), self.consumed_samples

    def after_reload(self, job_ended: int) -> None:
        """A joiner that reloaded with the job (no replicas) is not in the loop yet: it will enter
        where the survivors' loops are (``job_ended``) and catch up from the checkpoint first."""
        if self._step is None and job_ended > self.iteration:
            self._loop_at = job_ended

    def hand_rolled_forward(self):
        """The result a recovery finished, for the loop's pending train_step call (None if none);
        ``args`` back to that step's start, since the loop adds the step's samples itself."""
        from megatron.training import get_args
        out, self.rolled_forward = self.rolled_forward, None
        if out is not None:
            get_args().consumed_train_samples = self._rolled_from[1]
        return out

    def _replayable(self, data_iterator):
        """Reads go through Replayable, so that a rollback can hand the failed step its microbatches
        again (Megatron-LM's loop keeps its iterator object). Megatron's RerunDataIterator stays the
        outer object: its rerun state machine checks the type."""
        from megatron.core.rerun_state_machine import RerunDataIterator
        self._replays = []

        def wrap(d):
            if d is None:  # ranks that receive their batch from TP rank 0
                return None
            if isinstance(d, RerunDataIterator):
                if not isinstance(d.iterable, Replayable):
                    d.iterable = Replayable(d.iterable)
                self._replays.append(d.iterable)
                return d
            self._replays.append(Replayable(d))
            return self._replays[-1]
        return [wrap(d) for d in data_iterator] if isinstance(data_iterator, list) else wrap(data_iterator)

    @property
    def group_holders(self) -> list:
        ctx = _PROVIDERS.get("checkpointing_context")
        return [ctx] if ctx is not None else []

    @property
    def save_dir(self) -> str | None:
        from megatron.training import get_args
        return get_args().save

    @property
    def global_batch_size(self) -> int:
        from megatron.training import get_args
        return get_args().global_batch_size

    def checkpoint_args(self):
        """Megatron-LM's own arguments, as its save_checkpoint stores them (the dying gasp writes
        them into a checkpoint that Megatron-LM's load_checkpoint then checks and reads)."""
        import copy
        from megatron.training import get_args
        ns = copy.copy(get_args())
        ns.consumed_train_samples = self.consumed_samples
        return ns

    def data_iterator(self, consumed_samples: int):
        from megatron.training import get_args
        from megatron.training.training import build_train_valid_test_data_iterators
        a = get_args()
        keep = ("consumed_train_samples", "iteration", "do_train", "do_valid", "do_test")
        saved = {k: getattr(a, k, None) for k in keep}
        a.consumed_train_samples, a.iteration = consumed_samples, consumed_samples // a.global_batch_size
        try:
            return build_train_valid_test_data_iterators(_PROVIDERS["train_valid_test"])[0]
        finally:
            for k, v in saved.items():
                setattr(a, k, v)

    def _reloaded_data(self):
        """The data iterator at the reloaded checkpoint's position, built on first use. Its set-up's
        collectives (barriers, the do-train flags' broadcast) are answered alone: a restarted rank
        builds it when its loop starts, the survivors when they catch up, not at the same moment."""
        from mindspeed_ha.comm import interruptible
        if isinstance(self._catch_up, int):
            interruptible.set_alone(True)
            try:
                self._catch_up = self.data_iterator(self._catch_up)
            finally:
                interruptible.set_alone(False)
        return self._catch_up

    def run_step(self, iteration: int | None = None):
        """Megatron-LM's train_step between the session's step hooks; returns its result tuple.
        ``iteration``: the loop's (its iterator); None: a step the engine drives (after a reload, from
        the reloaded position)."""
        from mindspeed_ha import session
        original, forward_step_func, config, forward_backward_func = self._step
        if iteration is not None and self.iteration < iteration:
            self._run_catch_up(iteration)
        elif iteration is not None:
            self._catch_up = None  # (reloaded at the loop's own position: nothing to catch up)
        it = (self.iteration if iteration is None else iteration) + 1
        s = session.current()
        self._running = it
        self._phase_points(config)
        self._mark_step_start()
        s.step_start(it)
        data = self._data_iter if iteration is not None or self._catch_up is None else self._reloaded_data()
        out = original(self._forward_with_phases(forward_step_func, s, it), data,
                       self.model_chunks, self.optimizer, self.scheduler, config,
                       self._recording(forward_backward_func), iteration=it - 1)
        return self._step_done(it, out)

    def _run_catch_up(self, loop_iteration: int) -> None:
        """After an in-loop reload (no replicas) the trainer is at the checkpoint, the loop at
        ``loop_iteration``: the steps in between run here first, with data read from the
        checkpoint's position. The loop does not see them: it counted them (samples, FLOPs, logs)
        the first time; their losses are reported again, with the same bits."""
        from megatron.core.num_microbatches_calculator import update_num_microbatches
        from megatron.training import get_args
        from mindspeed_ha import session
        original, forward_step_func, config, forward_backward_func = self._step
        if self._catch_up is None:
            raise RuntimeError(f"trainer at iteration {self.iteration}, Megatron-LM's loop at {loop_iteration}, "
                               "and no reloaded data position to catch up from")
        data, self._catch_up = self._reloaded_data(), None  # (a fault in here reloads and sets it again)
        s, t0, first = session.current(), time.perf_counter(), self.iteration
        try:
            while self.iteration < loop_iteration:
                it = self.iteration + 1
                update_num_microbatches(self.consumed_samples, consistency_check=False)
                self._running = it
                self._mark_step_start()
                s.step_start(it)
                out = original(self._forward_with_phases(forward_step_func, s, it), data, self.model_chunks,
                               self.optimizer, self.scheduler, config, forward_backward_func, iteration=it - 1)
                self._step_done(it, out)
        finally:
            update_num_microbatches(get_args().consumed_train_samples, consistency_check=False)
        log.info("rank %d: recomputed iterations %d-%d after the reload in %.2fs", s.rank, first + 1,
                 loop_iteration, time.perf_counter() - t0)

    def _step_done(self, it: int, out):
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args
        from mindspeed_ha import session
        self.iteration = self.ended = it
        # What Megatron-LM's loop adds after train_step returns.
        self.consumed_samples += (ps.get_data_parallel_world_size() * get_args().micro_batch_size
                                  * get_num_microbatches())
        loss = None
        if ps.is_pipeline_last_stage(ignore_virtual=True) and "lm loss" in out[0]:
            loss = float(out[0]["lm loss"])  # all-reduced over DP x CP and divided by its tokens
        session.current().step_end(it, loss, grad_norm=out[5], lr=self._lr())
        return out

    def _recording(self, forward_backward_func):
        def forward_backward(*args, **kwargs):
            self._fb_out = forward_backward_func(*args, **kwargs)
            self._reduced = self._reduce_losses(self._fb_out) if self._joiners_possible() else None
            return self._fb_out
        return forward_backward

    @staticmethod
    def _joiners_possible() -> bool:
        from mindspeed_ha import session
        s = session.current()
        return s is not None and "recover" in s.options.strategies

    @staticmethod
    def _reduce_losses(losses) -> dict | None:
        """The step's [loss sum, tokens] reduced over DP, before the update — the same arithmetic as
        the end of Megatron-LM's train_step. Under recover a roll-forward may include a restarted
        rank, whose own share died with its predecessor; the twin hands it these totals instead."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        if not losses or not ps.is_pipeline_last_stage(ignore_virtual=True):
            return None
        out = {}
        for key in losses[0]:
            val = [x[key].view(-1) for x in losses]
            if val[0].numel() != 2:
                return None  # Megatron's legacy per-microbatch mean: nothing reduced over DP
            val = torch.vstack(val).sum(dim=0)
            dist.all_reduce(val, group=ps.get_data_parallel_group(with_context_parallel=True))
            out[key] = val
        return out

    def _losses_for_tail(self):
        """What the roll-forward's train_step tail gets as its forward-backward output. With DP
        totals: the totals on DP rank 0 and zeros elsewhere, so that its all-reduce gives the same
        bits (x + 0 == x) whatever each rank held; else this rank's own recorded microbatch losses."""
        import torch
        from megatron.core import parallel_state as ps
        if self._reduced is not None:
            first = ps.get_data_parallel_rank(with_context_parallel=True) == 0
            return [{k: (v if first else torch.zeros_like(v)) for k, v in self._reduced.items()}]
        if self._fb_out is None and ps.is_pipeline_last_stage(ignore_virtual=True):
            raise RuntimeError("the failed step's update completed on the twins, but its forward-backward did "
                               "not finish on this rank: cannot roll forward")
        return self._fb_out or []

    # -- recovery (the engine's rollback and roll-forward) ----------------------------------------
    def _mark_step_start(self) -> None:
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.training import get_timers
        for r in self._replays:
            r.begin_step()
        rsm = get_rerun_state_machine()
        self._fb_out = self._reduced = None
        self._at_start = {"scheduler": self.scheduler.num_steps, "rerun": (rsm.state, rsm.current_iteration),
                          "timers": {n for n, t in _timers(get_timers()) if getattr(t, "_started", False)}}

    def _undo_partial_step(self) -> None:
        """Back to how the interrupted train_step found things: the scheduler (its tail may have
        stepped it here before a later collective failed; lr and wd set again for that count), the
        rerun state machine (else the next call skips its forward-backward) and the timers it
        started (Megatron's timers refuse a second start)."""
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.training import get_timers
        at = self._at_start
        if not at:  # a restarted rank: no step begun here
            return
        if self.scheduler.num_steps != at["scheduler"]:
            self.scheduler.num_steps = at["scheduler"]
            self.scheduler.step(increment=0)
        rsm = get_rerun_state_machine()
        rsm.state, rsm.current_iteration = at["rerun"]
        for name, t in _timers(get_timers()):
            if getattr(t, "_started", False) and name not in at["timers"]:
                t.stop()

    def restart_from(self, iteration: int) -> None:
        """Rollback: the failed step runs again from its start (the caller restored the RNG)."""
        if self.iteration != iteration:
            raise RuntimeError(f"trainer at iteration {self.iteration}, asked to restart from {iteration}")
        self._undo_partial_step()
        for r in self._replays:
            r.rewind()

    def finish_step(self, it: int) -> None:
        """Roll forward: the update of step ``it`` is complete on every shard (repaired from the
        twins). The rest of Megatron-LM's own train_step — scheduler, the loss's DP all-reduce, its
        result — runs by calling it with the step's recorded forward-backward output and update
        result in place of redoing them; the failing train_step call returns that result."""
        if self.iteration >= it:
            return
        self._undo_partial_step()
        original, config = self._train_step_and_config()
        norm, zeros = getattr(self.optimizer, "ha_grad_stats", (None, None))
        losses = self._losses_for_tail()
        self._rolled_from = (self.iteration, self.consumed_samples)
        out = original(None, None, self.model_chunks, _UpdateDone(self.optimizer, (True, norm, zeros)),
                       self.scheduler, config, lambda **kwargs: losses, iteration=it - 1)
        self.rolled_forward = self._step_done(it, out)

    def _train_step_and_config(self):
        """Megatron-LM's own train_step and the model config (a restarted rank rolling forward has
        not been called by the loop yet: the unpatched function and its model's config)."""
        if self._step is not None:
            return self._step[0], self._step[2]
        import megatron.training.training as training
        from megatron.core.utils import get_model_config
        return getattr(training.train_step, "__wrapped__", training.train_step), get_model_config(self.model_chunks[0])

    def bookkeeping(self) -> dict:
        """What a restarted rank takes from its twin besides the optimizer shard."""
        from megatron.training import get_args
        a = get_args()
        self._undo_partial_step()  # the scheduler as of the failed step's start (its tail may have run here)
        norm, zeros = getattr(self.optimizer, "ha_grad_stats", (None, None))
        return {**super().bookkeeping(), "reduced": self._reduced, "grad_stats": [norm, zeros],
                "flops": getattr(a, "num_floating_point_operations_so_far", 0),
                "do": [bool(getattr(a, k, False)) for k in ("do_train", "do_valid", "do_test")]}

    def install_bookkeeping(self, state: dict) -> None:
        """Into the trainer and into ``args``, where Megatron-LM's loop and data loaders read them."""
        from megatron.training import get_args
        super().install_bookkeeping(state)
        self._reduced = state["reduced"]
        if hasattr(self.optimizer, "ha_grad_stats"):
            self.optimizer.ha_grad_stats = list(state["grad_stats"])
        a = get_args()  # (iteration and data position: on_setup_model_and_optimizer)
        a.num_floating_point_operations_so_far = state["flops"]
        # Megatron-LM broadcasts these from rank 0 when it builds the data loaders; alone, the
        # broadcast keeps the local value, and `args.do_train or flag` then keeps the twin's.
        a.do_train, a.do_valid, a.do_test = state["do"]

    @staticmethod
    def _forward_with_phases(forward_step_func, s, it):
        """Megatron-LM's forward_step with the "forward" and "backward" phase points (fault injection)."""
        def forward_step(data_iterator, model, *args, **kwargs):
            s.fire("forward", it)
            output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)

            def loss_with_hook(*largs, **lkwargs):
                result = loss_func(*largs, **lkwargs)
                loss = result[0] if isinstance(result, tuple) else result
                if getattr(loss, "requires_grad", False):
                    loss.register_hook(lambda g: (s.fire("backward", it), g)[1])
                return result
            return output, loss_with_hook
        return forward_step

    def _phase_points(self, config) -> None:
        """The "grad-sync" phase point: Megatron-LM's loop sets config.finalize_model_grads_func."""
        f = getattr(config, "finalize_model_grads_func", None)
        if f is None or getattr(f, "ha_phase_point", False):
            return
        from mindspeed_ha import session

        def finalize_model_grads(*args, **kwargs):
            session.current().fire("grad-sync", self._running)
            return f(*args, **kwargs)
        finalize_model_grads.ha_phase_point = True
        config.finalize_model_grads_func = finalize_model_grads

    def init_parallel(self) -> None:
        """megatron-core's groups as Megatron-LM made them (again after an in-place rebuild)."""
        _PROVIDERS["init_parallel"]()

    def _lr(self):
        for group in self.optimizer.param_groups:
            if group["params"]:
                return group["lr"]
        return None

    def train_step(self) -> float | None:
        """One step driven by the engine (outside Megatron-LM's loop, e.g. after a rollback)."""
        from megatron.core import parallel_state as ps
        from megatron.training import get_args
        if self._step is None:
            raise RuntimeError("Megatron-LM's loop has not run a step yet: nothing to drive")
        out = self.run_step()
        get_args().consumed_train_samples = self.consumed_samples
        if ps.is_pipeline_last_stage(ignore_virtual=True) and "lm loss" in out[0]:
            return float(out[0]["lm loss"])
        return None

    def save_checkpoint(self, save_dir: str) -> str:
        import megatron.training.training as training
        from megatron.training import get_args
        a = get_args()
        saved = a.save, a.consumed_train_samples
        a.save, a.consumed_train_samples = save_dir, self.consumed_samples  # saved with the args
        try:
            training.save_checkpoint(self.iteration, self.model_chunks, self.optimizer, self.scheduler,
                                     getattr(a, "num_floating_point_operations_so_far", 0))
        finally:
            a.save, a.consumed_train_samples = saved
        return os.path.join(save_dir, f"iter_{self.iteration:07d}")

    def load_checkpoint(self, load_dir: str) -> int:
        import megatron.training.training as training
        from megatron.training import get_args
        a = get_args()
        in_loop = self._step is not None  # an in-process reload (no replicas) inside Megatron-LM's loop
        if in_loop:
            self._undo_partial_step()
        loop_args = {k: getattr(a, k, None) for k in _LOOP_ARGS}
        a.load = load_dir
        # OptimizerParamScheduler.load_state_dict *adds* the checkpoint's step count (it expects a
        # fresh scheduler): start it from zero, as a new process would.
        self.scheduler.num_steps = 0
        try:
            self.iteration, flops = training.load_checkpoint(self.model_chunks, self.optimizer, self.scheduler)
            self.consumed_samples = a.consumed_train_samples  # restored from the checkpoint's args
        finally:
            for k, v in loop_args.items():
                setattr(a, k, v)
        self.ended = self.iteration
        self._catch_up = self.consumed_samples  # the steps up to the loop's position: _run_catch_up
        if in_loop:  # the loop's iterator back to the failed step's start
            for r in self._replays:
                r.rewind()
        else:  # a restarted rank's set-up: its loop starts from these (or from loop_position)
            a.consumed_train_samples, a.num_floating_point_operations_so_far = self.consumed_samples, flops
        return self.iteration


# What Megatron-LM's load_checkpoint writes into args but the running loop owns (an in-loop reload
# keeps the loop's values; the loop has counted the steps the catch-up recomputes).
_LOOP_ARGS = ("load", "iteration", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples",
              "num_floating_point_operations_so_far")


class _UpdateDone:
    """The optimizer, except that ``step()`` reports the update a recovery already completed."""

    def __init__(self, optimizer, result):
        self._optimizer, self._result = optimizer, result

    def step(self):
        return self._result

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


def _timers(timers) -> list:
    return list(getattr(timers, "_timers", {}).items())
