"""Validate the parallel layout against the replica optimizer before any model is built.

Every rank computes the same verdict from the same arguments, so every rank prints the same message.
Each message names the flags and values and proposes a layout that works for this world size.
"""
from __future__ import annotations

from mindspeed_ha.options import HAConfigError, HAOptions


def _proposals(world: int, tp: int, pp: int, cp: int, replicas: int, limit: int = 3) -> list[str]:
    """Layouts (TP, PP, CP) for this world whose DP x CP is a multiple of the replica count, closest first."""
    out = []
    for t in sorted({d for d in range(1, world + 1) if world % d == 0}, key=lambda d: (abs(d - tp), d)):
        for p in sorted({d for d in range(1, world // t + 1) if (world // t) % d == 0}, key=lambda d: (abs(d - pp), d)):
            dp = world // (t * p * cp)
            if world % (t * p * cp) == 0 and dp * cp >= replicas and (dp * cp) % replicas == 0:
                out.append(f"--tensor-model-parallel-size {t} --pipeline-model-parallel-size {p}"
                           + (f" --context-parallel-size {cp}" if cp > 1 else "") + f" (DP={dp})")
    return out[:limit]


def validate(world: int, args, options: HAOptions) -> None:
    if not options.enabled:
        return
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = getattr(args, "context_parallel_size", 1)
    if not options.use_replica_optimizer:
        return
    flags = ("--enable-high-availability" if options.source == "flags" else f"{options.source}=...")
    if not args.use_distributed_optimizer:
        raise HAConfigError(
            f"{flags} builds the replica optimizer on megatron-core's distributed optimizer: add "
            "--use-distributed-optimizer (or add --distributed-optimizer-no-replica to run without replicas)")
    optimizer = getattr(args, "optimizer", "adam")
    if optimizer != "adam":
        raise HAConfigError(
            f"--optimizer {optimizer}: the replica optimizer is megatron-core's distributed optimizer, which steps "
            "Adam only (megatron-core 0.16.1 asserts 'Only Adam and HybridDeviceOptimizer currently supported'); "
            "use --optimizer adam")
    if getattr(args, "use_precision_aware_optimizer", False) and not _fused_adam_available():
        raise HAConfigError(
            "--use-precision-aware-optimizer keeps the optimizer state in Transformer Engine's FusedAdam, which "
            "does not import here; install Transformer Engine (a GPU), drop the flag, or drill its state layout on "
            "the CPU with MINDSPEED_HA_DRILL_OPTIMIZER=fused-adam-master")
    if getattr(args, "optimizer_cpu_offload", False):
        raise HAConfigError(
            "--optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer splits the optimizer state over "
            "sub-optimizers on the host and on the device, which the replica optimizer does not copy to a twin; drop "
            "--optimizer-cpu-offload, or train without replicas (--distributed-optimizer-no-replica)")
    R = options.replica_num
    if world % (tp * pp * cp):
        raise HAConfigError(f"world size {world} is not divisible by TP {tp} x PP {pp} x CP {cp}")
    dp = world // (tp * pp * cp)
    if dp * cp < 2 or (dp * cp) % R:
        ideas = _proposals(world, tp, pp, cp, R)
        hint = ("; layouts that work with " + str(world) + " ranks: " + "; ".join(ideas)) if ideas else \
            (f"; no layout of {world} ranks gives a data-parallel size divisible by {R}: use a world size "
             f"that is a multiple of {R}, or --distributed-optimizer-no-replica")
        raise HAConfigError(
            f"the replica optimizer keeps {R} copies of every optimizer shard, so data-parallel x "
            f"context-parallel size must be at least 2 and divisible by --optimizer-replica-num {R}; with "
            f"{world} ranks, --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}"
            + (f" --context-parallel-size {cp}" if cp > 1 else "") + f" it is {dp * cp}" + hint)
    elastic = "elastic-training" in options.strategies
    if elastic and cp > 1:
        raise HAConfigError(
            "elastic scale-in keeps every TP/PP position and drops whole data-parallel replicas; it is built "
            "for TP x PP x DP layouts and MoE: with --context-parallel-size drop --enable-elastic-training "
            "(or HIGH_AVAILABILITY=elastic-training)")
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if elastic and getattr(args, "num_experts", None) and etp not in (None, tp):
        raise HAConfigError(
            f"elastic training with MoE keeps each replica's experts where they are, which needs the experts "
            f"split like the dense layers: drop --expert-tensor-parallel-size {etp} (it defaults to "
            f"--tensor-model-parallel-size {tp}) or --enable-elastic-training")
    experts = getattr(args, "num_experts", None)
    if experts:
        ep = getattr(args, "expert_model_parallel_size", 1)
        edp = world // (tp * pp * ep) if world % (tp * pp * ep) == 0 else 0
        if edp < 2 or edp % R:
            raise HAConfigError(
                f"with MoE (--num-experts {experts}) the expert data-parallel size is {edp} for "
                f"--expert-model-parallel-size {ep}; it must be at least 2 and divisible by "
                f"--optimizer-replica-num {R}. Try --expert-model-parallel-size "
                f"{max(1, (world // (tp * pp)) // R)}")
    if getattr(args, "overlap_param_gather", False) and not getattr(args, "overlap_grad_reduce", False):
        raise HAConfigError("--overlap-param-gather needs --overlap-grad-reduce (megatron-core requirement)")


def _fused_adam_available() -> bool:
    """Transformer Engine's FusedAdam imports, or the drill that stands in for it is asked for."""
    import importlib.util
    from mindspeed_ha.options import drill_optimizer
    if drill_optimizer() == "fused-adam-master":
        return True
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False
