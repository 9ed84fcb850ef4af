"""Command-line arguments of the built-in trainer, with Megatron-LM's names and meanings."""
from __future__ import annotations

import argparse
import os

from mindspeed_ha.options import add_ha_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py", allow_abbrev=False,  # (Megatron-LM's own parser takes whole flags only)
        description="GPT pretraining on megatron-core with mindspeed-ha (Megatron-LM argument names)")
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=int, default=2)
    m.add_argument("--hidden-size", type=int, default=64)
    m.add_argument("--num-attention-heads", type=int, default=4)
    m.add_argument("--ffn-hidden-size", type=int, default=None)
    m.add_argument("--seq-length", type=int, default=32)
    m.add_argument("--max-position-embeddings", type=int, default=None)
    m.add_argument("--vocab-size", type=int, default=128)
    m.add_argument("--hidden-dropout", type=float, default=0.0)
    m.add_argument("--attention-dropout", type=float, default=0.0)
    m.add_argument("--num-experts", type=int, default=None)
    m.add_argument("--expert-model-parallel-size", type=int, default=1)
    m.add_argument("--moe-router-topk", type=int, default=2)
    m.add_argument("--bf16", action="store_true")
    m.add_argument("--fp16", action="store_true", help="fp16 weights, with a loss scaler (dynamic by default)")

    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, default=2)
    t.add_argument("--global-batch-size", type=int, default=None)
    t.add_argument("--train-iters", type=int, default=10)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    t.add_argument("--lr-warmup-iters", type=int, default=0)
    t.add_argument("--lr-decay-iters", type=int, default=None)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    t.add_argument("--sgd-momentum", type=float, default=0.9)
    t.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="megatron-core's HybridDeviceOptimizer (refused with the replica optimizer)")
    t.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Transformer Engine's FusedAdam keeps the main params (and may keep the moments in a lower "
                        "dtype, scaled); on the CPU: MINDSPEED_HA_DRILL_OPTIMIZER=fused-adam-master")
    t.add_argument("--main-params-dtype", default="fp32", choices=["fp32", "fp16"])
    t.add_argument("--exp-avg-dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    t.add_argument("--exp-avg-sq-dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    t.add_argument("--loss-scale", type=float, default=None, help="fp16: a constant loss scale (default: dynamic)")
    t.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    t.add_argument("--min-loss-scale", type=float, default=1.0)
    t.add_argument("--loss-scale-window", type=float, default=1000)
    t.add_argument("--hysteresis", type=int, default=2)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--use-distributed-optimizer", action="store_true")
    t.add_argument("--overlap-grad-reduce", action="store_true")
    t.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="keep and reduce gradients in bf16 (default, as Megatron-LM: fp32 with --bf16)")
    t.add_argument("--overlap-param-gather", action="store_true")

    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                     help="an interleaved pipeline: each stage holds num-layers / (pipeline size x this) "
                          "model chunks of this many layers")
    par.add_argument("--context-parallel-size", type=int, default=1)
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--distributed-backend", default=None, help="default: from the device (gloo on CPU)")
    par.add_argument("--distributed-timeout-minutes", type=int, default=10)

    d = p.add_argument_group("data")
    d.add_argument("--mock-data", action="store_true", help="deterministic synthetic tokens (the default)")
    d.add_argument("--data-path", nargs="*", default=None, help="Megatron indexed dataset prefix(es)")
    d.add_argument("--split", default="100,0,0")
    d.add_argument("--tokenizer-type", default="NullTokenizer", choices=["NullTokenizer"])
    d.add_argument("--data-cache-path", default=None)

    c = p.add_argument_group("checkpointing and logging")
    c.add_argument("--save", default=None)
    c.add_argument("--load", default=None)
    c.add_argument("--save-interval", type=int, default=None)
    c.add_argument("--log-interval", type=int, default=1)
    c.add_argument("--no-load-optim", action="store_true")
    c.add_argument("--no-load-rng", action="store_true")
    add_ha_args(p)
    return p


class ArgError(ValueError):
    pass


def _weighted(paths) -> bool:
    """Megatron-LM's weighted form: w1 prefix1 w2 prefix2 ..."""
    try:
        return bool(paths) and len(paths) % 2 == 0 and all(float(w) >= 0 for w in paths[0::2])
    except ValueError:
        return False


def _virtual_stages(args: argparse.Namespace) -> int | None:
    """Model chunks per pipeline stage of an interleaved pipeline (None: not interleaved)."""
    per_chunk, pp = args.num_layers_per_virtual_pipeline_stage, args.pipeline_model_parallel_size
    if per_chunk is None:
        return None
    flag = f"--num-layers-per-virtual-pipeline-stage {per_chunk}"
    if pp < 2:
        raise ArgError(f"{flag} interleaves the stages of a pipeline: add --pipeline-model-parallel-size 2 or "
                       "more, or drop it")
    per_stage = args.num_layers // pp
    if per_chunk <= 0 or per_stage % per_chunk or per_stage == per_chunk:
        raise ArgError(f"{flag}: each of the {pp} pipeline stages holds {per_stage} layers (--num-layers "
                       f"{args.num_layers}); interleaving needs a divisor of {per_stage} smaller than it")
    return per_stage // per_chunk


def finalize(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Fill derived values the way Megatron-LM does and reject impossible ones with a clear message."""
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    mp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    if world_size % mp:
        raise ArgError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size} x --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size} x --context-parallel-size {args.context_parallel_size}")
    args.data_parallel_size = world_size // mp
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % step:
        raise ArgError(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                       f"--micro-batch-size {args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    if args.num_layers % args.pipeline_model_parallel_size:
        raise ArgError(f"--num-layers {args.num_layers} must divide evenly over "
                       f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    args.virtual_pipeline_model_parallel_size = _virtual_stages(args)
    if args.fp16 and args.bf16:
        raise ArgError("--fp16 and --bf16 are exclusive; pick one")
    if args.num_attention_heads % args.tensor_model_parallel_size:
        raise ArgError(f"--num-attention-heads {args.num_attention_heads} must divide by "
                       f"--tensor-model-parallel-size {args.tensor_model_parallel_size}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.save_interval is not None and args.save_interval <= 0:
        raise ArgError(f"--save-interval {args.save_interval}: use a positive number of iterations")
    if args.data_path and args.mock_data:
        raise ArgError("--mock-data and --data-path are exclusive; pick one")
    for prefix in (args.data_path or [])[1::2] if _weighted(args.data_path) else (args.data_path or []):
        if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
            hint = " (pass the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
            raise ArgError(f"--data-path {prefix}: {prefix}.bin / {prefix}.idx not found{hint}")
    return args
