"""Entry of the built-in trainer: parse, validate (before any model is built), train."""
from __future__ import annotations

import os
import sys
from typing import NoReturn

from mindspeed_ha import exitcodes
from mindspeed_ha.options import HAConfigError
from mindspeed_ha.process import end_of_job


def _fail(msg: str, code: int = exitcodes.BAD_INPUT) -> NoReturn:
    rank = os.environ.get("RANK", "0")
    sys.stderr.write(f"mindspeed-ha: error (rank {rank}): {msg}\n")
    sys.stderr.flush()
    sys.exit(code)


def _quiet_known_warnings() -> None:
    """Benign, repeated-per-rank warnings of megatron-core/torch on CPU that would bury our logs."""
    import warnings
    for pattern in (r".*(Apex|Transformer Engine).*not installed.*", r".*is deprecated.*",
                    r".*\.grad attribute of a Tensor that is not a leaf.*", r".*cuda_graph_scope.*",
                    r".*Please use DTensor instead.*"):
        warnings.filterwarnings("ignore", message=pattern)


def run(argv: list[str] | None = None) -> int:
    _quiet_known_warnings()
    from mindspeed_ha import compat, inject, layout, options as ha_options
    from mindspeed_ha.device import DeviceError, detect, local_ranks
    from mindspeed_ha.trainer.args import ArgError, build_parser, finalize

    args = build_parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        device = detect()
        from mindspeed_ha.adaptor import before_megatron
        before_megatron(device)  # (compat.check below imports megatron-core)
        device.check_local_ranks(local_ranks())
        args = finalize(args, world)
        opts = ha_options.from_args(args)
        layout.validate(world, args, opts)
        ha_options.check_dirs(opts, bool(args.ha_log_dir), args.save)
        faults = inject.parse(os.environ.get(inject.ENV, ""))
        inject.check_reachable(faults, world, args.train_iters)
        inject.check_device(faults, device.kind, device.backend)
        inject.check_layout(faults, args)
        compat.check()  # last: it imports megatron-core (seconds), the checks above are instant
    except (HAConfigError, ArgError, DeviceError, compat.CompatError, inject.InjectSpecError) as e:
        _fail(str(e))

    from mindspeed_ha.adaptor import apply_patches
    apply_patches(device, megatron_lm=False, ha=opts.enabled)

    from mindspeed_ha.launcher import spare
    from mindspeed_ha.replica.state import UnknownOptimizer
    from mindspeed_ha.replica.verify import ReplicaMismatchError
    from mindspeed_ha.trainer_state.checkpoint_dir import CheckpointError
    from mindspeed_ha.rank.session import RankSession
    from mindspeed_ha.trainer import data
    from mindspeed_ha.trainer.builtin import BuiltinTrainer, init_distributed

    dataset = None
    if spare.is_spare():  # everything above is done ahead of a fault; now wait to be a rank
        dataset = data.build_train_dataset(args, args.train_iters * args.global_batch_size)
        spare.wait_for_assignment()
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device.set_current(local_rank)
    session = RankSession(opts, device, rank, world, local_rank)
    trainer = BuiltinTrainer(args, session)
    # recover restarts lost workers; elastic starts a returned node's workers to scale out
    joining = bool({"recover", "elastic-training"} & opts.strategies) and session.restarted_worker()
    if not joining:
        init_distributed(args.distributed_backend or device.backend, args.distributed_timeout_minutes)
    try:
        if joining:  # the job runs on; the controller brings this worker in
            trainer.prepare_join(dataset)
            if session.joins_to_scale_out():
                session.build_ahead(trainer)
            session.join_running_job(trainer)
        else:
            trainer.setup(dataset=dataset)
        # A fault inside: reported, the recovery served, and on (from where the recovery left it).
        session.survive(trainer.train, lambda: trainer.iteration + 1)
    except ReplicaMismatchError as e:
        _fail(str(e), code=exitcodes.REPLICA_MISMATCH)
    except CheckpointError as e:  # --load refused before any tensor was read
        _fail(str(e))
    except UnknownOptimizer as e:  # refused as the optimizer was built, before any step
        _fail(str(e))
    finally:
        session.close()
    return end_of_job()
