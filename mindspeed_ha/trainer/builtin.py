"""The built-in megatron-core GPT trainer (used when Megatron-LM's ``megatron.training`` is absent).

Real megatron-core end to end: GPTModel, DistributedDataParallel, (replica) DistributedOptimizer,
OptimizerParamScheduler, the forward_backward schedules (micro-batching and pipeline parallelism),
MockGPTDataset or indexed datasets, dist_checkpointing. Megatron-LM's argument names.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.num_microbatches_calculator import get_num_microbatches, init_num_microbatches_calculator
from megatron.core import optimizer as megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from mindspeed_ha import compat
from mindspeed_ha.comm.interruptible import PROCESS_STOP, alone
from mindspeed_ha.device import current
from mindspeed_ha.events import get_logger
from mindspeed_ha.trainer import configs, data
from mindspeed_ha.trainer_state import checkpoint
from mindspeed_ha.trainer_state.interface import TrainerInterface

log = get_logger("trainer")


class BuiltinTrainer(TrainerInterface):
    def __init__(self, args: argparse.Namespace, session):
        super().__init__()
        self.args = args
        self.session = session  # mindspeed_ha.rank.session.RankSession: HA hooks, events, device
        self._saved = -1        # the iteration whose periodic save last completed
        # When this process began the step in flight; None where it ran none since its bookkeeping
        # came from a peer (a restarted rank rolling forward a step its predecessor ran).
        self._t_step: float | None = None

    # -- set-up ----------------------------------------------------------------------------------
    def setup(self, joining: bool = False, dataset=None) -> None:
        """``joining``: a restarted worker entering a running job (recover) — the default group was
        just built with the survivors' rebuild, which runs ``init_parallel`` in step with this; no
        collective of its own here (the survivors are not in it) and no ``--load``: the state comes
        from the replica peers next. ``dataset``: built already (a worker forked from a template)."""
        a, s = self.args, self.session
        replicas = s.options.replica_num if s.options.use_replica_optimizer else 1
        took: dict[str, float] = {}
        self.setup_seconds = took  # (where a set-up's time goes: a restarted worker's join reports it)
        t = time.perf_counter()

        def timed(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            took[name], t = round(now - t, 4), now
        self.init_parallel()
        init_num_microbatches_calculator(dist.get_rank(), None, a.global_batch_size, a.micro_batch_size,
                                         ps.get_data_parallel_world_size())
        configs.set_seed(a.seed)
        timed("parallel_state")
        vpp = a.virtual_pipeline_model_parallel_size
        self.model_chunks = [self._build_model(replicas, not joining, vp) for vp in ([None] if vpp is None else
                                                                                  range(vpp))]
        timed("model")
        # (a joiner's alone, as a resize's kept ranks build theirs: see TrainerInterface.resize)
        with alone() if joining else contextlib.nullcontext():
            self.optimizer = self._build_optimizer()
        timed("optimizer")
        self.scheduler = configs.scheduler(self.optimizer, a)
        if not joining:
            self.dataset = dataset or data.build_train_dataset(a, a.train_iters * a.global_batch_size)
        s.attach_trainer(self)
        timed("attach")
        if joining:
            self.ended = self.iteration
            self._data_iter = None  # set with the bookkeeping received from a peer
            s.trainer_ready()
            timed("ready")
            return
        if a.load and checkpoint.tracker(a.load) is not None:  # (a broken tracker raises CheckpointError)
            t0 = time.perf_counter()
            checkpoint.load(self, a.load, load_optim=not a.no_load_optim, load_rng=not a.no_load_rng,
                            verify_files=not a.no_verify_checkpoint)
            s.loaded(self.iteration, a.load, time.perf_counter() - t0)
        elif a.load:  # no tracker at all: a fresh start, as in Megatron-LM
            log.warning("--load %s: no checkpoint there yet, starting from iteration 0", a.load)
        self._data_iter = self.data_iterator(self.consumed_samples)
        self.ended = self.iteration  # the last step whose bookkeeping and loss report finished
        self._saved = self.iteration  # (the state it starts from is on disk already, or nowhere to be)
        s.trainer_ready()

    @property
    def save_dir(self) -> str | None:
        return self.args.save

    @property
    def global_batch_size(self) -> int:
        return self.args.global_batch_size

    @property
    def micro_batch_size(self) -> int:
        return self.args.micro_batch_size

    def init_parallel(self) -> None:
        """megatron-core's groups for this layout: the ones a recovery reconnects first."""
        from mindspeed_ha.comm import groups
        a = self.args
        ps.initialize_model_parallel(
            tensor_model_parallel_size=a.tensor_model_parallel_size,
            pipeline_model_parallel_size=a.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size,
            context_parallel_size=a.context_parallel_size,
            expert_model_parallel_size=a.expert_model_parallel_size,
            num_distributed_optimizer_instances=self.session.options.replica_num
            if self.session.options.use_replica_optimizer else 1,
            distributed_timeout_minutes=a.distributed_timeout_minutes)
        groups.seal()

    def prepare_join(self, dataset=None) -> None:
        """Before a restarted worker has any group: build the dataset now (unless a spare built it
        already), because its builder ends with a barrier over the default group."""
        a = self.args
        self.dataset = dataset or data.build_train_dataset(a, a.train_iters * a.global_batch_size)

    def _build_model(self, replicas: int, broadcast: bool = True, vp_stage: int | None = None):
        """The model chunk of this pipeline stage (``vp_stage``: which of an interleaved one's)."""
        a = self.args
        if vp_stage is None or vp_stage == 0:
            self.config = configs.transformer_config(a, self._finalize_grads)
        config = self.config
        pre_process, post_process, chunk = compat.pipeline_chunk(vp_stage)
        model = GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=a.num_experts),
            vocab_size=data.padded_vocab_size(a.vocab_size, a.tensor_model_parallel_size),
            max_sequence_length=a.max_position_embeddings, pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute", **chunk)
        # Initialised on the CPU (the same weights whatever the device), trained on the rank's device.
        model = model.to(current())
        if a.bf16 or a.fp16:
            model = Float16Module(config, model)  # as Megatron-LM: 16-bit weights, casts at the edges
        model.vp_stage = vp_stage  # (as Megatron-LM marks each chunk)
        return self._wrap(model, replicas, broadcast)

    def _wrap(self, model, replicas: int, broadcast: bool = True):
        a, config = self.args, self.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=not a.grad_reduce_in_bf16, overlap_grad_reduce=a.overlap_grad_reduce,
            overlap_param_gather=a.overlap_param_gather,
            use_distributed_optimizer=a.use_distributed_optimizer,
            num_distributed_optimizer_instances=replicas, bucket_size=None)
        config.no_sync_func = None
        # an interleaved pipeline's later chunks: one bucket each, as Megatron-LM builds them
        later_chunk = bool(getattr(model, "vp_stage", None))
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                      disable_bucketing=later_chunk)
        if broadcast:
            ddp.broadcast_params()
        return ddp

    def checkpoint_args(self) -> argparse.Namespace:
        a = self.args
        keep = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                "max_position_embeddings", "vocab_size", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "micro_batch_size", "global_batch_size", "seed", "bf16")
        ns = argparse.Namespace(**{k: getattr(a, k) for k in keep})
        ns.consumed_train_samples = self.consumed_samples
        ns.padded_vocab_size = data.padded_vocab_size(a.vocab_size, a.tensor_model_parallel_size)
        ns.data_parallel_size = a.data_parallel_size
        return ns

    def _rewrap(self, ddp):
        replicas = self.session.options.replica_num if self.session.options.use_replica_optimizer else 1
        return self._wrap(ddp.module, replicas, broadcast=False)

    def _build_optimizer(self):
        optimizer = megatron_optimizer.get_megatron_optimizer(configs.optimizer_config(self.args), self.model_chunks)
        self.config.grad_scale_func = optimizer.scale_loss  # (as Megatron-LM: the loss scaler's scale, fp16)
        return optimizer

    def _resized(self, dp: int) -> None:
        self.args.data_parallel_size = dp
        self._data_iter = self.data_iterator(self.consumed_samples)

    # -- data ------------------------------------------------------------------------------------
    def data_iterator(self, consumed_samples: int) -> data.SampleIterator:
        return data.SampleIterator(self.dataset, consumed_samples, self.args.micro_batch_size,
                                   ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())

    def _chunk_data(self):
        """The step's data: an interleaved pipeline's chunks each read every micro-batch, so each
        gets an iterator from the step's first sample (the first one's counts the samples)."""
        if len(self.model_chunks) == 1:
            return self._data_iter
        return [self._data_iter, *(self.data_iterator(self.consumed_samples) for _ in self.model_chunks[1:])]

    # -- the step --------------------------------------------------------------------------------
    def _finalize_grads(self, *fargs, **fkwargs):
        self.session.fire("grad-sync", self.iteration + 1)
        return finalize_model_grads(*fargs, **fkwargs)

    def _loss(self, loss_mask, output_tensor):
        losses = output_tensor.float()
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * mask) / mask.sum()
        self.session.backward_point(loss, self.iteration + 1)
        return loss, {"lm loss": loss.detach().clone()}

    def _forward_step(self, data_iterator, model):
        self.session.fire("forward", self.iteration + 1)
        batch = next(data_iterator)
        tokens, labels = batch["tokens"], batch["labels"]
        out = model(tokens, batch["position_ids"], None, labels=labels)
        self.session.backward_point(out, self.iteration + 1)  # (every pipeline stage, the last included)
        return out, partial(self._loss, batch["loss_mask"])

    def train_step(self) -> float | None:
        a, s = self.args, self.session
        it = self.iteration + 1
        self._t_step = time.perf_counter()
        s.step_start(it)
        for m in self.model_chunks:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=self._forward_step, data_iterator=self._chunk_data(), model=self.model_chunks,
            num_microbatches=get_num_microbatches(), seq_length=a.seq_length,
            micro_batch_size=a.micro_batch_size, decoder_seq_length=a.seq_length, forward_only=False)
        assert self._data_iter is not None  # (the step read from it)
        # The DP-reduced loss, before the update: a roll-forward then needs no collective, and a
        # restarted worker can be handed it by its peer. (Same arithmetic as after the update.)
        # With it, the global batch's samples (whatever the data-parallel size): ``samples_hash``.
        self._step_loss = self._samples_hash = None
        self._step_iteration = it
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            mean = torch.stack([x["lm loss"] for x in losses]).mean().reshape(1)
            dist.all_reduce(mean, group=ps.get_data_parallel_group())
            seen = torch.tensor([self._data_iter.fingerprint], dtype=torch.int64, device=current())
            dist.all_reduce(seen, group=ps.get_data_parallel_group())
            loss, samples = float(mean.item() / ps.get_data_parallel_world_size()), f"{int(seen.item()):016x}"
            PROCESS_STOP.commit_point("the step's loss")  # (kept for a roll-forward: never a partial sum)
            self._step_loss, self._samples_hash = loss, samples
        self._data_iter.fingerprint = 0
        if s.optimizer is None:
            s.fire("optimizer", it)  # the replica optimizer fires it inside its update window
        ok, grad_norm, _ = self.optimizer.step()
        return self.finish_step(it, grad_norm)

    def finish_step(self, it: int, grad_norm=None) -> float | None:
        """What follows the optimizer step: scheduler, counters, the DP-reduced loss and its report.
        Also run by a roll-forward recovery when the fault came after the update of step ``it``."""
        a, s = self.args, self.session
        if self.iteration < it:
            self.scheduler.step(increment=a.global_batch_size)
            self.iteration = it
            self.consumed_samples += a.global_batch_size
            assert self._data_iter is not None  # (a joiner's comes with its bookkeeping, before any step)
            if self._data_iter.next_index != self.consumed_samples:
                # A restarted rank rolled forward: its predecessor read this step's samples, and its
                # own reads start where its twin's counters stood, at the step's beginning.
                self._data_iter = self.data_iterator(self.consumed_samples)
        loss = self._step_loss
        self.ended = it
        if loss is not None and it % a.log_interval == 0 and ps.get_tensor_model_parallel_rank() == 0 \
                and ps.get_data_parallel_rank() == 0:
            took = ("n/a (rolled forward: its predecessor ran it)" if self._t_step is None else
                    f"{(time.perf_counter() - self._t_step) * 1000:.1f} ms")
            print(f" iteration {it:8d}/{a.train_iters:8d} | lm loss: {loss:.6E} | step time: {took}", flush=True)
        s.step_end(it, loss, grad_norm=grad_norm, lr=self.scheduler.get_lr(self.optimizer.param_groups[0]),
                   samples_hash=getattr(self, "_samples_hash", None))
        return loss

    def unlogged_loss(self) -> tuple[int, float] | None:
        it, loss = getattr(self, "_step_iteration", None), getattr(self, "_step_loss", None)
        # (_step_loss is set only past its commit point: whole)
        return (it, loss) if it is not None and loss is not None and it > self.ended else None

    def restart_from(self, iteration: int) -> None:
        """Rollback: the next step is ``iteration + 1`` again (the RNG was restored by the caller)."""
        if self.iteration != iteration:
            raise RuntimeError(f"trainer at iteration {self.iteration}, asked to restart from {iteration}")
        self._data_iter = self.data_iterator(self.consumed_samples)

    def bookkeeping(self) -> dict:
        """Counters and scheduler (the interface's), the loss of a step whose update finished, and the
        last periodic save (one a fault interrupted is redone by every rank, the newcomer too)."""
        return {**super().bookkeeping(), "step_loss": getattr(self, "_step_loss", None), "saved": self._saved,
                "samples_hash": getattr(self, "_samples_hash", None)}

    def install_bookkeeping(self, state: dict) -> None:
        super().install_bookkeeping(state)
        self._step_loss = state["step_loss"]
        self._samples_hash = state.get("samples_hash")
        self._saved = state["saved"]
        self._t_step = None  # (the step in flight, if any, was its peer's)
        self._data_iter = self.data_iterator(self.consumed_samples)

    def save_checkpoint(self, save_dir: str) -> str:
        self.session.fire("checkpoint", self.iteration)
        path, seconds = checkpoint.save(self, save_dir)
        self._saved = self.iteration
        self.session.saved(self.iteration, path, seconds)
        return path

    def load_checkpoint(self, load_dir: str) -> int:
        """Also in a live trainer (the no-replica fallback reloads in process)."""
        it = checkpoint.load(self, load_dir, verify_files=not self.args.no_verify_checkpoint)
        self.ended = self._saved = it  # (what was loaded is on disk: no save of it is due)
        self._data_iter = self.data_iterator(self.consumed_samples)
        return it

    # -- the loop --------------------------------------------------------------------------------
    def train(self) -> None:
        """The loop. A periodic save due at this iteration that has not happened — a fault interrupted
        it, the recovery brought every rank back here — runs first."""
        a = self.args
        while True:
            if a.save and a.save_interval and self.iteration % a.save_interval == 0 and self._saved != self.iteration:
                self.save_checkpoint(a.save)
            if self.iteration >= a.train_iters:
                break
            self.train_step()
        if a.save and self._saved != self.iteration:
            self.save_checkpoint(a.save)


def init_distributed(backend: str, timeout_minutes: int) -> None:
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
