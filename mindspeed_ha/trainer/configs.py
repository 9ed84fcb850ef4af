"""megatron-core's configurations for the built-in trainer, from Megatron-LM's argument names: the
transformer's, the optimizer's and the learning-rate scheduler's; and the seed, as Megatron-LM sets it."""
from __future__ import annotations

import argparse
import random
from typing import Callable

import numpy as np
import torch
from megatron.core import parallel_state as ps, tensor_parallel
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def set_seed(seed: int) -> None:
    # Same seed on every rank, like Megatron-LM; PP stages offset it so their layers differ.
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def params_dtype(a: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32


def transformer_config(a: argparse.Namespace, finalize_model_grads_func: Callable | None = None) -> TransformerConfig:
    return TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        ffn_hidden_size=a.ffn_hidden_size, hidden_dropout=a.hidden_dropout,
        attention_dropout=a.attention_dropout, use_cpu_initialization=True,
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size,
        context_parallel_size=a.context_parallel_size, sequence_parallel=a.sequence_parallel,
        num_moe_experts=a.num_experts, moe_router_topk=a.moe_router_topk,
        expert_model_parallel_size=a.expert_model_parallel_size,
        bf16=a.bf16, fp16=a.fp16, params_dtype=params_dtype(a), pipeline_dtype=params_dtype(a),
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        moe_token_dispatcher_type="allgather",
        # Each point-to-point op on its own, in an order that pairs every send with its receive,
        # and waited for. Batched, an interleaved PP=2 stage posts a gradient and an activation
        # to the same peer in the order the peer posts their receives the other way round: gloo
        # matches them by order, and the two tensors swap (same shape, no error).
        batch_p2p_comm=False, overlap_p2p_comm=False,
        finalize_model_grads_func=finalize_model_grads_func)


def optimizer_config(a: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=a.optimizer, lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay,
        adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, sgd_momentum=a.sgd_momentum,
        clip_grad=a.clip_grad, bf16=a.bf16, fp16=a.fp16, params_dtype=params_dtype(a), loss_scale=a.loss_scale,
        initial_loss_scale=a.initial_loss_scale, min_loss_scale=a.min_loss_scale,
        loss_scale_window=a.loss_scale_window, hysteresis=a.hysteresis,
        optimizer_cpu_offload=a.optimizer_cpu_offload, use_distributed_optimizer=a.use_distributed_optimizer,
        use_precision_aware_optimizer=a.use_precision_aware_optimizer,
        main_params_dtype=_DTYPES[a.main_params_dtype], exp_avg_dtype=_DTYPES[a.exp_avg_dtype],
        exp_avg_sq_dtype=_DTYPES[a.exp_avg_sq_dtype])


def scheduler(optimizer, a: argparse.Namespace) -> OptimizerParamScheduler:
    gbs = a.global_batch_size
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=a.lr, min_lr=a.min_lr,
        lr_warmup_steps=a.lr_warmup_iters * gbs, lr_decay_steps=a.lr_decay_iters * gbs,
        lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay, end_wd=a.weight_decay,
        wd_incr_steps=a.train_iters * gbs, wd_incr_style="constant")
