"""What ``patches/megatron/training`` re-routes Megatron-LM into: its argument parsing (HA flags, the
CPU recipe, layout validation, the rank's session), its process groups, its set-up of model and
optimizer (where a restarted worker joins the running job), its train_step (where faults are caught
and recoveries served), its checkpoints and data loaders. Only this package imports
``megatron.training``, and only lazily.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import time

from mindspeed_ha.events import get_logger

from .entry import CPU_ARGS, close_session, device_in_use, fail
from .objects import SETUP
from .resize import LoopOptimizer, unwrap_optimizer
from .trainer import MegatronLMTrainer

log = get_logger("megatron_lm")
# A restarted worker's set-up (Megatron-LM's initialize, model, optimizer, data loaders) runs while the
# survivors wait in the recovery: its collectives are answered alone (comm.interruptible.alone) from
# the moment it joins until its loop's first train_step, except while it takes its state from its twin.
_alone = contextlib.ExitStack()


def _alone_on() -> None:
    from mindspeed_ha.comm.interruptible import alone
    _alone.enter_context(alone())


def _alone_off() -> None:
    _alone.close()


@contextlib.contextmanager
def _recovery_covers():
    """A hooked call a recovery covers; Megatron-LM's loop around it (timers, logging) is not, so
    a stop there lets a collective its peers passed finish (comm.interruptible.set_uncovered)."""
    from mindspeed_ha.comm.interruptible import PROCESS_STOP
    PROCESS_STOP.set_uncovered(False)
    try:
        yield
    finally:
        PROCESS_STOP.set_uncovered(True)


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
    from mindspeed_ha import compat, inject, layout, options as ha_options
    from mindspeed_ha.device import DeviceError, local_ranks
    from mindspeed_ha.options import HAConfigError
    from mindspeed_ha.rank.session import RankSession

    ns = original(_with_ha_args(extra_args_provider), ignore_unknown_args)
    device = device_in_use()
    if device.needs_cpu_shim:
        cpu_args = {**CPU_ARGS, "distributed_backend": device.backend}  # (gloo, or a drill's emulated NCCL)
        changed = {k: v for k, v in cpu_args.items() if getattr(ns, k, None) != v}
        for key, value in changed.items():
            setattr(ns, key, value)
        if changed and ns.rank == 0:
            log.info("CPU: set %s (CUDA-only defaults of Megatron-LM)",
                     ", ".join(f"{k}={v}" for k, v in changed.items()))
    try:
        compat.check()
        device.check_local_ranks(local_ranks())
        opts = ha_options.from_args(ns)
        layout.validate(ns.world_size, ns, opts)
        ha_options.check_dirs(opts, bool(ns.ha_log_dir), ns.save)
        faults = inject.parse(os.environ.get(inject.ENV, ""))
        inject.check_reachable(faults, ns.world_size, ns.train_iters)
        inject.check_device(faults, device.kind, device.backend)
        inject.check_layout(faults, ns)
        if opts.use_replica_optimizer:
            got = ns.num_distributed_optimizer_instances
            if got not in (1, opts.replica_num):
                raise HAConfigError(
                    f"--num-distributed-optimizer-instances {got} conflicts with --optimizer-replica-num "
                    f"{opts.replica_num}: the replica optimizer sets it; drop the former")
            # Megatron-LM passes it to initialize_model_parallel and to the DDP config.
            ns.num_distributed_optimizer_instances = opts.replica_num
    except (HAConfigError, DeviceError, compat.CompatError, inject.InjectSpecError) as e:
        fail(str(e))
    device.set_current(ns.local_rank)  # (Megatron-LM sets the same device again as it initialises)
    s = RankSession(opts, device, ns.rank, ns.world_size, ns.local_rank)
    if _joining(s):
        ns.load = None  # a restarted worker takes the job's state from its peers, not from --load
    atexit.register(close_session)  # an unmodified pretrain script has no place to close it
    return ns


def _joining(s) -> bool:
    """A worker restarted by its agent into a job that runs on (recover, or an elastic scale-out)."""
    return s is not None and bool({"recover", "elastic-training"} & s.options.strategies) and s.restarted_worker()


def on_initialize_distributed(original, get_embedding_ranks, get_position_embedding_ranks, store=None):
    """Remembers how Megatron-LM built its groups: a recovery's rebuild runs the same again (the
    default group exists then, so only megatron-core's groups are made)."""
    from mindspeed_ha import compat
    from mindspeed_ha.rank import session
    from mindspeed_ha.comm import groups
    SETUP["init_parallel"] = functools.partial(_groups_of, original, get_embedding_ranks, get_position_embedding_ranks)
    s = session.current()
    if not _joining(s):
        out = compat.initialize_distributed(original, get_embedding_ranks, get_position_embedding_ranks, store)
        groups.seal()  # Megatron-LM's groups: the ones a recovery reconnects first
        return out
    # No env:// rendezvous (that world is gone). Register and wait for the controller's rebuild
    # (recover: this worker's groups are made then and connect with the survivors' new generation)
    # or scale-out (its groups are the new layout's; the state comes once its model exists).
    s.device.set_current(s.local_rank)  # what Megatron-LM's skipped init would have done
    if s.joins_to_scale_out():  # (the built-in trainer's newcomers build themselves before they register)
        log.info("rank %d: a scale-out's newcomer in Megatron-LM's loop builds its model and optimizer inside the "
                 "scale-out, once its groups exist (Megatron-LM's set-up makes them after its groups)", s.rank)
    s.join_running_job(_GroupsOnly(), until=("rebuild", "scale-out"))
    _alone_on()  # Megatron-LM's set-up runs on while the survivors wait
    return None


def _groups_of(original, get_embedding_ranks, get_position_embedding_ranks) -> None:
    """Megatron-LM's process groups made again (its default group exists): a joiner's."""
    from mindspeed_ha import compat
    from mindspeed_ha.comm import groups
    compat.initialize_distributed(original, get_embedding_ranks, get_position_embedding_ranks)
    groups.seal()


def on_setup_model_and_optimizer(original, *args, **kwargs):
    """A joiner, once its model and optimizer exist (built alone, no --load): the shard and the
    twin's counters, scheduler and RNG come over the rebuilt groups; then Megatron-LM goes on with
    the job's iteration and data position (its loop reads them from ``args``)."""
    from megatron.training import get_args
    from mindspeed_ha.rank import session
    out = original(*args, **kwargs)
    s = session.current()
    if s is not None and "elastic-training" in s.options.strategies:
        out = (out[0], LoopOptimizer(out[1]), out[2])  # (a resize replaces the optimizer under the loop)
    if s is None or not s.joining:
        return out
    model, optimizer, scheduler = out
    trainer = MegatronLMTrainer(model, optimizer, scheduler, 0)
    trainer.enter_loop()  # (its recovery tracking starts now, not at its loop's first step)
    s.attach_trainer(trainer)
    s.trainer_ready()
    _alone_off()
    if s.after_setup is not None:  # a scale-out's newcomer: the state exchange with the kept ranks
        finish, s.after_setup = s.after_setup, None
        finish(trainer)
    s.join_running_job(trainer)  # repair, rollback, resume: with the survivors
    # The loop starts where the survivors' loops are. After a roll-forward, that is before the
    # failed step's own bookkeeping (its logging has collectives): the first train_step call here
    # returns the step's result, as the survivors' failing call did. The data loaders are built
    # at the position of the next step that draws data.
    a = get_args()
    a.iteration, a.consumed_train_samples = trainer.loop_position()
    _alone_on()  # data loaders and the loop's preamble, until the first step
    return out


class _GroupsOnly:
    """What a joiner has when the rebuild or scale-out comes: no model yet, so its set-up is only the
    groups (and, in a new layout, the data-parallel size Megatron-LM's set-up goes on with)."""
    optimizer = None

    def setup(self, joining: bool = True) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator
        from megatron.training import get_args
        SETUP["init_parallel"]()
        a, dp = get_args(), ps.get_data_parallel_world_size()
        if dp != a.data_parallel_size:
            a.data_parallel_size = dp
            reconfigure_num_microbatches_calculator(dist.get_rank(), None, a.global_batch_size, a.micro_batch_size,
                                                    dp, decrease_batch_size_if_needed=False)


def on_train_step(original, forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                  config, forward_backward_func=None, iteration=None):
    from mindspeed_ha import compat
    from mindspeed_ha.rank import session
    forward_backward_func, iteration = compat.loop_step_arguments(forward_backward_func, iteration)
    s = session.current()
    if s is None:
        return compat.call_train_step(original, forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                                      config, forward_backward_func, iteration)
    trainer = s.trainer
    if not isinstance(trainer, MegatronLMTrainer):
        trainer = MegatronLMTrainer(model, optimizer, opt_param_scheduler, iteration or 0)
        s.attach_trainer(trainer)
    trainer.bind_step(original, forward_step_func, data_iterator, config, forward_backward_func)
    _alone_off()  # a joiner's set-up is over: from here on it trains with the job
    out = trainer.hand_rolled_forward()
    if out is not None:  # a joiner: its recovery finished this step (see on_setup_model_and_optimizer)
        from mindspeed_ha.comm.interruptible import PROCESS_STOP
        PROCESS_STOP.set_uncovered(True)  # the loop's code after the step, as on every rank
        return out
    if trainer.enter_loop():
        s.trainer_ready()  # after Megatron-LM's --load: the state recovery starts from
    # A fault inside: reported, the recovery served here. Repaired in place, the loop gets the step's
    # result as if nothing had happened: the step's rest (its update had completed everywhere), or
    # the step again with the same microbatches and RNG (rolled back).
    with _recovery_covers():
        return s.survive(lambda: trainer.run_step(iteration), lambda: trainer.loop.running,
                         after_recovery=trainer.after_recovery)


def on_get_megatron_optimizer(original, config, model_chunks, *args, **kwargs):
    """Remembers how Megatron-LM built its optimizer: an elastic resize builds one the same way
    around the model in its new layout."""
    from mindspeed_ha.replica.state import UnknownOptimizer
    SETUP["optimizer"] = lambda chunks: original(config, chunks, *args, **kwargs)
    try:
        return original(config, model_chunks, *args, **kwargs)
    except UnknownOptimizer as e:  # refused as it is built, before any step
        fail(str(e))


def on_update_num_microbatches(original, consumed_samples, consistency_check=True, verbose=False):
    """Megatron-LM's loop calls this twice between its steps, with its micro-batch check between the
    two calls: a count that changed since its last step is taken for a batch-size rampup, which may
    only grow (a checkpoint is saved then). An elastic resize changes it either way at the same
    global batch: after one, the check is passed over once (``MegatronLMTrainer.loop_check``)."""
    from mindspeed_ha.rank import session
    original(consumed_samples, consistency_check=consistency_check, verbose=verbose)
    s = session.current()
    if s is not None and isinstance(s.trainer, MegatronLMTrainer):
        s.trainer.loop_check(opening=not consistency_check)


def on_get_num_microbatches(original):
    """The micro-batch count as Megatron-LM's training module reads it (where its loop has no switch
    to pass its micro-batch check over, the check's read after a resize: ``RampupCheck``)."""
    from mindspeed_ha.rank import session
    s = session.current()
    if s is not None and isinstance(s.trainer, MegatronLMTrainer):
        return s.trainer.loop_num_microbatches(original)
    return original()


def on_save_checkpoint(original, iteration, *args, **kwargs):
    from megatron.training import get_args
    from mindspeed_ha.rank import session
    from mindspeed_ha.comm.interruptible import PROCESS_STOP
    s = session.current()
    if len(args) > 1:  # Megatron-LM's save_checkpoint(iteration, model, optimizer, ...)
        args = (args[0], unwrap_optimizer(args[1]), *args[2:])
    from mindspeed_ha.trainer_state import checkpoint
    if s is None:
        return original(iteration, *args, **kwargs)

    def save():
        PROCESS_STOP.raise_deferred()  # a collective of the loop before the save failed: a fault as the save starts
        s.fire("checkpoint", iteration)
        if not get_args().async_save:
            checkpoint.writer_in_process()
        return original(iteration, *args, **kwargs)
    t0 = time.perf_counter()
    # A fault in the save is recovered like one in a step (every rank back at this iteration), then
    # the save runs again.
    with _recovery_covers():
        out = s.survive(save, lambda: iteration)
    if not kwargs.get("non_persistent_ckpt"):
        path = os.path.join(get_args().save, f"iter_{iteration:07d}")
        checkpoint.add_manifest(path, {"kind": "periodic", "iteration": iteration})  # (a collective, as the save)
        s.saved(iteration, path, time.perf_counter() - t0)
    return out


def on_load_checkpoint(original, ddp_model, optimizer, *args, **kwargs):
    import torch
    from megatron.core.optimizer import distrib_optimizer
    from megatron.training import get_args
    from megatron.training.checkpointing import checkpoint_exists
    from mindspeed_ha import compat
    from mindspeed_ha.rank import session
    from mindspeed_ha.trainer_state import checkpoint
    from mindspeed_ha.trainer_state.checkpoint import fix_adam_steps
    a = get_args()
    load_dir = getattr(a, kwargs.get("load_arg", "load"))
    if load_dir and not a.finetune:  # before any tensor is read: tracker, model settings, files
        try:
            checkpoint.before_load(load_dir, a, verify_files=not a.no_verify_checkpoint)
        except checkpoint.CheckpointError as e:
            fail(str(e))
    inners = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    torch_adam = optimizer is not None and not distrib_optimizer.HAVE_APEX_OR_TE
    if torch_adam and not a.no_load_optim and not a.finetune and checkpoint_exists(load_dir):
        # On the torch-Adam path DistributedOptimizer.state_dict() needs the per-parameter ``step``,
        # which exists only after a first step: give it dummy state to load into.
        for inner in inners:
            if isinstance(inner, distrib_optimizer.DistributedOptimizer) and not inner.optimizer.state:
                compat.init_optimizer_state(inner)
    t0 = time.perf_counter()
    with torch.no_grad():  # fp32 runs: the optimizer's main-param shards are views of leaf parameters
        iteration, flops = original(ddp_model, optimizer, *args, **kwargs)
    if torch_adam and iteration and not a.no_load_optim and not a.finetune:
        # Traps 2 and 3: Megatron-LM restores one shared ``step`` tensor for every parameter, which torch's
        # Adam would bump once per parameter per step: one tensor each.
        fix_adam_steps(optimizer)
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
    RNG state, so without this its dropout stream would be one draw off the uninterrupted run's.
    Its DataLoaders fork their workers: nothing of an old layout's communicators may go with them."""
    import torch
    from mindspeed_ha.comm.groups import before_fork
    SETUP["train_valid_test"] = provider
    before_fork()
    if not device_in_use().needs_cpu_shim:
        return original(provider, *args, **kwargs)
    state = torch.get_rng_state()
    try:
        return original(provider, *args, **kwargs)
    finally:
        torch.set_rng_state(state)
