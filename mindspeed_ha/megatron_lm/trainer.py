"""The engine's trainer interface over Megatron-LM's own loop, objects and functions.

Megatron-LM's loop keeps calling its ``train_step``; each call runs here (``run_step``) between the
session's step hooks. A recovery served inside a failing call either rolls back (the step runs again,
with the same microbatches: the loop's data iterator is wrapped so a step can be replayed) or rolls
forward (only the rest of Megatron-LM's own ``train_step`` runs, with the step's recorded
forward-backward output); ``LoopPosition`` (loop.py) says where the loop is relative to the trainer.
"""
from __future__ import annotations

import os
import time

from mindspeed_ha.device.backends import EMULATED_NCCL
from mindspeed_ha.events import get_logger
from mindspeed_ha.trainer_state.interface import TrainerInterface
from mindspeed_ha.trainer.replay import Replayable

from .loop import LoopFunctions, LoopPosition, StepRecord

log = get_logger("megatron_lm")
# What Megatron-LM's set-up used and the trainer needs again (recorded by the hooks): how it made its
# process groups ("init_parallel"), its dataset provider ("train_valid_test") and its optimizer
# ("optimizer": the call, for a model in a new layout).
SETUP: dict = {}


class MegatronLMTrainer(TrainerInterface):
    """The narrow trainer interface over Megatron-LM's objects and functions (the built-in trainer
    implements the same one). ``iteration`` and ``consumed_samples`` count completed steps; inside
    Megatron-LM's loop they run one step ahead of its ``args`` until the loop's own bookkeeping."""

    def __init__(self, model, optimizer, scheduler, iteration: int):
        from megatron.training import get_args
        super().__init__()
        self.model_chunks, self.optimizer, self.scheduler = model, unwrap_optimizer(optimizer), scheduler
        self.iteration = iteration
        self.ended = iteration  # the last step whose train_step returned
        self.consumed_samples = get_args().consumed_train_samples
        self.fns: LoopFunctions | None = None   # the loop's train_step and its arguments, once it has called
        self.loop = LoopPosition(running=iteration)
        self.step = StepRecord()
        self._loop_iter = self._data_iter = None
        self._replays: list[Replayable] = []
        self.loop_optimizer = optimizer  # what the loop holds (a LoopOptimizer under elastic)
        self.resized = False  # an elastic resize changed the micro-batch count since the loop's last check
        self._packing = None  # the loop's switch, set aside while its check is passed over

    def setup(self, joining: bool = False) -> None:
        raise RuntimeError("Megatron-LM sets itself up (initialize, setup_model_and_optimizer); the adaptor's "
                           "hooks build this trainer from what it made")

    def enter_loop(self) -> bool:
        """The loop's first train_step call here: True once (the caller starts recovery's tracking)."""
        first, self.loop.entered = not self.loop.entered, True
        return first

    def bind_step(self, original, forward_step_func, data_iterator, config, forward_backward_func):
        """Called by Megatron-LM's loop before each of its steps: its objects and position are the truth."""
        import torch.distributed as dist
        from megatron.training import get_args
        if config.deallocate_pipeline_outputs and dist.get_backend() in ("gloo", EMULATED_NCCL):
            # Megatron-LM frees a stage's output once its send is posted (the storage swapped out
            # under the tensor). A gloo send (the emulated NCCL's too) still running in the background
            # (an interleaved pipeline overlaps its transfers) then reads freed memory: NaN losses.
            config.deallocate_pipeline_outputs = False
        self.fns = LoopFunctions(original, forward_step_func, config, forward_backward_func)
        if data_iterator is not self._loop_iter:  # the loop hands the same object every step
            self._loop_iter = data_iterator
            self._data_iter = self._replayable(data_iterator)
        if self.loop.finished is None and self.loop.catch_up is None:  # (else the loop is elsewhere: loop_position)
            self.consumed_samples = get_args().consumed_train_samples

    def loop_position(self) -> tuple[int, int]:
        """Where a joiner's Megatron-LM loop starts (iteration, consumed samples): one step behind
        while a rolled-forward step's result waits for the loop's train_step call (that call gives
        the samples back, hand_rolled_forward); at the survivors' loops after a reload, the steps
        in between caught up in its first call (a constant global batch size assumed)."""
        if self.loop.enter_at is not None:
            return self.loop.enter_at, self.consumed_samples + (self.loop.enter_at - self.iteration) * self.global_batch_size
        return self.iteration - (self.loop.finished is not None), self.consumed_samples

    def after_reload(self, job_ended: int) -> None:
        """A joiner that reloaded with the job (no replicas) is not in the loop yet: it will enter
        where the survivors' loops are (``job_ended``) and catch up from the checkpoint first."""
        if self.fns is None and job_ended > self.iteration:
            self.loop.enter_at = job_ended

    def hand_rolled_forward(self):
        """The result a recovery finished, for the loop's pending train_step call (None if none);
        ``args`` back to that step's start, since the loop adds the step's samples itself."""
        from megatron.training import get_args
        out, self.loop.finished = self.loop.finished, None
        if out is not None:
            get_args().consumed_train_samples = self.loop.finished_from[1]
        return out

    def after_recovery(self):
        """What the loop's interrupted train_step call returns once a recovery has served it: a
        step the recovery finished (``hand_rolled_forward``), or the call's own step when the fault
        came after it had ended (in its end hooks: a replica check, a stop meant for the step
        boundary) — the loop goes on to the next step rather than running this one again. None:
        the step runs again."""
        out = self.hand_rolled_forward()
        if out is None and self.step.done and self.iteration == self.loop.running:
            out = self.step.out
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
    def save_dir(self) -> str | None:
        from megatron.training import get_args
        return get_args().save

    @property
    def async_saves(self) -> bool:
        from megatron.training import get_args
        return bool(getattr(get_args(), "async_save", False))

    @property
    def global_batch_size(self) -> int:
        from megatron.training import get_args
        return get_args().global_batch_size

    @property
    def micro_batch_size(self) -> int:
        from megatron.training import get_args
        return get_args().micro_batch_size

    def checkpoint_args(self):
        """Megatron-LM's own arguments, as its save_checkpoint stores them (the dump writes
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
            return build_train_valid_test_data_iterators(SETUP["train_valid_test"])[0]
        finally:
            for k, v in saved.items():
                setattr(a, k, v)

    def _reloaded_data(self):
        """The data iterator at the reloaded checkpoint's position, built on first use. Its set-up's
        collectives (barriers, the do-train flags' broadcast) are answered alone: a restarted rank
        builds it when its loop starts, the survivors when they catch up, not at the same moment."""
        from mindspeed_ha.comm.interruptible import alone
        if isinstance(self.loop.catch_up, int):
            with alone():
                self.loop.catch_up = self.data_iterator(self.loop.catch_up)
        return self.loop.catch_up

    def run_step(self, iteration: int | None = None):
        """Megatron-LM's train_step between the session's step hooks; returns its result tuple.
        ``iteration``: the loop's (its iterator); None: a step the engine drives (after a reload, from
        the reloaded position)."""
        try:
            return self._run_step(iteration)
        except Exception:
            # Its tail may have stepped the scheduler before a later collective (the loss's DP
            # all-reduce) failed: back to the step's start before the recovery reads it (a dump).
            self._undo_partial_step()
            raise

    def _run_step(self, iteration: int | None):
        from mindspeed_ha.rank import session
        from mindspeed_ha.comm.interruptible import PROCESS_STOP
        assert self.fns is not None  # (bind_step came first: the loop's, or train_step checked)
        original, forward_step_func, config, forward_backward_func = self.fns
        if iteration is not None and self.iteration < iteration:
            self._run_catch_up(iteration)
        elif iteration is not None:
            self.loop.catch_up = None  # (reloaded at the loop's own position: nothing to catch up)
        it = (self.iteration if iteration is None else iteration) + 1
        s = session.current()
        assert s is not None  # (the hooks made the session before the trainer)
        self.loop.running = it
        self._phase_points(config)
        self._mark_step_start()
        s.step_start(it)
        PROCESS_STOP.raise_deferred()  # a collective of the loop since the last step failed: a fault as it starts
        data = self._data_iter if iteration is not None or self.loop.catch_up is None else self._reloaded_data()
        out = original(self._forward_with_phases(forward_step_func, s, it), data,
                       self.model_chunks, self.optimizer, self.scheduler, config,
                       self._recording(forward_backward_func), iteration=it - 1)
        PROCESS_STOP.commit_point("the step's result")  # (its loss, reduced over DP after the update)
        return self._step_done(it, out)

    def _run_catch_up(self, loop_iteration: int) -> None:
        """After an in-loop reload (no replicas) the trainer is at the checkpoint, the loop at
        ``loop_iteration``: the steps in between run here first, with data read from the
        checkpoint's position. The loop does not see them: it counted them (samples, FLOPs, logs)
        the first time; their losses are reported again, with the same bits."""
        from megatron.core.num_microbatches_calculator import update_num_microbatches
        from megatron.training import get_args
        from mindspeed_ha.rank import session
        from mindspeed_ha.comm.interruptible import PROCESS_STOP
        assert self.fns is not None  # (called from run_step)
        original, forward_step_func, config, forward_backward_func = self.fns
        if self.loop.catch_up is None:
            raise RuntimeError(f"trainer at iteration {self.iteration}, Megatron-LM's loop at {loop_iteration}, "
                               "and no reloaded data position to catch up from")
        data, self.loop.catch_up = self._reloaded_data(), None  # (a fault in here reloads and sets it again)
        s, t0, first = session.current(), time.perf_counter(), self.iteration
        assert s is not None  # (the hooks made the session before the trainer)
        try:
            while self.iteration < loop_iteration:
                it = self.iteration + 1
                update_num_microbatches(self.consumed_samples, consistency_check=False)
                self.loop.running = it
                self._mark_step_start()
                s.step_start(it)
                out = original(self._forward_with_phases(forward_step_func, s, it), data, self.model_chunks,
                               self.optimizer, self.scheduler, config, forward_backward_func, iteration=it - 1)
                PROCESS_STOP.commit_point("the step's result")
                self._step_done(it, out)
        finally:
            update_num_microbatches(get_args().consumed_train_samples, consistency_check=False)
        log.info("rank %d: recomputed iterations %d-%d after the reload in %.2fs", s.rank, first + 1,
                 loop_iteration, time.perf_counter() - t0)

    def _step_done(self, it: int, out, samples_whole: bool = True):
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args
        from mindspeed_ha.rank import session
        self.step.done, self.step.out = True, out
        self.iteration = self.ended = it
        # What Megatron-LM's loop adds after train_step returns.
        self.consumed_samples += (ps.get_data_parallel_world_size() * get_args().micro_batch_size
                                  * get_num_microbatches())
        # Read on the host here, where Megatron-LM's loop syncs anyway: right after train_step
        # returns it reads the loss scale (``.item()``), with no device work queued in between.
        loss = samples = None
        if ps.is_pipeline_last_stage(ignore_virtual=True) and "lm loss" in out[0]:
            loss = float(out[0]["lm loss"])  # all-reduced over DP x CP and divided by its tokens
        if self.step.samples_hash is not None and samples_whole:
            samples = f"{int(self.step.samples_hash.item()):016x}"
        s = session.current()
        assert s is not None  # (the hooks made the session before the trainer)
        s.step_end(it, loss, grad_norm=out[5], lr=self._lr(), samples_hash=samples)
        return out

    def _recording(self, forward_backward_func):
        def forward_backward(*args, **kwargs):
            from mindspeed_ha.comm.interruptible import PROCESS_STOP
            self.step.fb_out = forward_backward_func(*args, **kwargs)
            # The samples' sum stays on the device (read at the step's end, after its commit point):
            # a diagnostic, which nothing before the update needs.
            self.step.samples_hash, self.step.samples_mark = self._samples_hash(), PROCESS_STOP.commit_mark()
            # The DP totals a roll-forward hands a restarted rank (recover), and a dump that settles
            # on this step prints (unlogged_loss): whether a stop cut them short is known later, when
            # the update's commit point passes (or not), without a sync here (_losses_for_tail).
            if self._totals_wanted():
                self.step.reduced = self._reduce_losses(self.step.fb_out)
                self.step.reduced_mark = PROCESS_STOP.commit_mark()
            return self.step.fb_out
        return forward_backward

    def _samples_hash(self):
        """The step's global batch, whatever its data-parallel split (the ``samples_hash`` of the step
        event): the ranks that read data add up their samples over DP. Megatron-LM's batches carry
        no sample index: a sample is known by its tokens. A tensor on the device (None where this
        rank reads no data): reading it here would stall the host mid-step."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from mindspeed_ha.device import current
        from mindspeed_ha.trainer.data import tokens_fingerprint
        if not self._replays:
            return None
        mine = sum(tokens_fingerprint(item["tokens"]) for r in self._replays for item in r.drawn()
                   if isinstance(item, dict) and "tokens" in item)
        seen = torch.tensor([mine], dtype=torch.int64, device=current())
        dist.all_reduce(seen, group=ps.get_data_parallel_group())
        return seen

    @staticmethod
    def _joiners_possible() -> bool:
        from mindspeed_ha.rank import session
        s = session.current()
        return s is not None and "recover" in s.options.strategies

    @staticmethod
    def _totals_wanted() -> bool:
        """HA is on: a restarted rank (recover) or a dump (always on with HA) may need this step's
        DP totals. One small all-reduce a step, as the built-in trainer's loss before its update."""
        from mindspeed_ha.rank import session
        s = session.current()
        return s is not None and s.options.enabled

    def unlogged_loss(self) -> tuple[int, float] | None:
        it = self.loop.running
        if not it or it <= self.ended or not self._reduced_whole():
            return None
        assert self.step.reduced is not None  # (whole: it holds them)
        totals = self.step.reduced.get("lm loss")
        if totals is None:
            return None
        return it, float(totals[0] / totals[1])  # (Megatron-LM's own arithmetic at train_step's end)

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
            parts = [x[key].view(-1) for x in losses]
            if parts[0].numel() != 2:
                return None  # Megatron's legacy per-microbatch mean: nothing reduced over DP
            val = torch.vstack(parts).sum(dim=0)
            dist.all_reduce(val, group=ps.get_data_parallel_group(with_context_parallel=True))
            out[key] = val
        return out

    def _reduced_whole(self) -> bool:
        """This rank holds the step's DP totals, and no stop cut them short: a commit point passed
        after they were issued (a twin hands only such totals: their mark is None then)."""
        from mindspeed_ha.comm.interruptible import PROCESS_STOP
        mark = self.step.reduced_mark
        return self.step.reduced is not None and (mark is None or PROCESS_STOP.committed_since(mark))

    def _losses_for_tail(self):
        """What the roll-forward's train_step tail gets as its forward-backward output. With DP
        totals: one rank's totals (the first data-parallel rank whose totals are whole: the ranks
        agree on it in one small all-reduce) and zeros elsewhere, so that the tail's all-reduce gives
        the same bits (x + 0 == x) whatever each rank held; else this rank's own recorded microbatch
        losses, which the tail reduces itself."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from mindspeed_ha.device import current
        if ps.is_pipeline_last_stage(ignore_virtual=True) and self._joiners_possible():
            group = ps.get_data_parallel_group(with_context_parallel=True)
            whole = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=current())
            whole[dist.get_rank(group)] = int(self._reduced_whole())
            dist.all_reduce(whole, group=group)
            holders = whole.nonzero().view(-1).tolist()
            if holders and holders[0] == dist.get_rank(group):
                assert self.step.reduced is not None  # (whole: it holds them)
                return [self.step.reduced]
            if holders:
                shapes = self.step.reduced or (self.step.fb_out or [None])[0]
                if shapes is None:
                    raise RuntimeError("the failed step's update completed on the twins, but neither its "
                                       "forward-backward nor its loss totals are on this rank: cannot roll forward")
                return [{k: torch.zeros_like(v).view(-1) for k, v in shapes.items()}]
        if self.step.fb_out is None and ps.is_pipeline_last_stage(ignore_virtual=True):
            raise RuntimeError("the failed step's update completed on the twins, but its forward-backward did "
                               "not finish on this rank: cannot roll forward")
        return self.step.fb_out or []

    # -- recovery (the engine's rollback and roll-forward) ----------------------------------------
    def _mark_step_start(self) -> None:
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.training import get_timers
        for r in self._replays:
            r.begin_step()
        rsm = get_rerun_state_machine()
        self.step = StepRecord()
        self.step.at_start = {"scheduler": self.scheduler.num_steps, "rerun": (rsm.state, rsm.current_iteration),
                          "timers": {n for n, t in _timers(get_timers()) if getattr(t, "_started", False)}}

    def _undo_partial_step(self) -> None:
        """Back to how the interrupted train_step found things: the scheduler (its tail may have
        stepped it here before a later collective failed; lr and wd set again for that count), the
        rerun state machine (else the next call skips its forward-backward) and the timers it
        started (Megatron's timers refuse a second start)."""
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.training import get_timers
        at = self.step.at_start
        if not at or self.step.done:  # a restarted rank (no step begun here), or the step returned
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
        """Rollback: the failed step runs again from its start (the caller restored the RNG). Between
        steps (a fault in the loop's periodic save) there is nothing to undo: the next step is next."""
        if self.iteration != iteration:
            raise RuntimeError(f"trainer at iteration {self.iteration}, asked to restart from {iteration}")
        if self.step.done:
            return
        self._undo_partial_step()
        for r in self._replays:
            r.rewind()

    def finish_step(self, it: int) -> None:
        """Roll forward: the update of step ``it`` is complete on every shard (repaired from the
        twins). The rest of Megatron-LM's own train_step — scheduler, the loss's DP all-reduce, its
        result — runs by calling it with the step's recorded forward-backward output and update
        result in place of redoing them; the failing train_step call returns that result."""
        from mindspeed_ha.comm.interruptible import PROCESS_STOP
        if self.iteration >= it:
            return
        self._undo_partial_step()
        original, config = self._train_step_and_config()
        norm, zeros = getattr(self.optimizer, "ha_grad_stats", (None, None))
        losses = self._losses_for_tail()
        self.loop.finished_from = (self.iteration, self.consumed_samples)
        out = original(None, None, self.model_chunks, _UpdateDone(self.optimizer, (True, norm, zeros)),
                       self.scheduler, config, lambda **kwargs: losses, iteration=it - 1)
        PROCESS_STOP.commit_point("the rolled-forward step's result")
        # The samples' sum is whole if a commit point (this rank's update's) passed after it was
        # issued, before the stop; else the stop may have cut it short, and it is not reported.
        whole = PROCESS_STOP.committed_since(self.step.samples_mark)
        self.loop.finished = self._step_done(it, out, samples_whole=whole)

    def _train_step_and_config(self):
        """Megatron-LM's own train_step and the model config (a restarted rank rolling forward has
        not been called by the loop yet: the unpatched function and its model's config)."""
        if self.fns is not None:
            return self.fns.train_step, self.fns.config
        import megatron.training.training as training
        from megatron.core.utils import get_model_config
        return getattr(training.train_step, "__wrapped__", training.train_step), get_model_config(self.model_chunks[0])

    def bookkeeping(self) -> dict:
        """What a restarted rank takes from its twin besides the optimizer shard."""
        from megatron.training import get_args
        a = get_args()
        self._undo_partial_step()  # the scheduler as of the failed step's start (its tail may have run here)
        norm, zeros = getattr(self.optimizer, "ha_grad_stats", (None, None))
        return {**super().bookkeeping(), "reduced": self.step.reduced if self._reduced_whole() else None,
                "grad_stats": [norm, zeros],
                "flops": getattr(a, "num_floating_point_operations_so_far", 0),
                "do": [bool(getattr(a, k, False)) for k in ("do_train", "do_valid", "do_test")]}

    def install_bookkeeping(self, state: dict) -> None:
        """Into the trainer and into ``args``, where Megatron-LM's loop and data loaders read them."""
        from megatron.training import get_args
        super().install_bookkeeping(state)
        self.step.reduced, self.step.reduced_mark = state["reduced"], None  # (the twin's: whole)
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
            s.backward_point(output, it)  # (every pipeline stage, the last included)

            def loss_with_hook(*largs, **lkwargs):
                result = loss_func(*largs, **lkwargs)
                s.backward_point(result[0] if isinstance(result, tuple) else result, it)
                return result
            return output, loss_with_hook
        return forward_step

    def _phase_points(self, config) -> None:
        """The "grad-sync" phase point: Megatron-LM's loop sets config.finalize_model_grads_func."""
        f = getattr(config, "finalize_model_grads_func", None)
        if f is None or getattr(f, "ha_phase_point", False):
            return
        from mindspeed_ha.rank import session

        def finalize_model_grads(*args, **kwargs):
            session.current().fire("grad-sync", self.loop.running)
            return f(*args, **kwargs)
        setattr(finalize_model_grads, "ha_phase_point", True)
        config.finalize_model_grads_func = finalize_model_grads

    def log_recovery(self, iteration: int, seconds: float, lost_steps: int) -> None:
        """Megatron-LM's TensorBoard and W&B writers (on the rank that has them) get the recovery."""
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
        tb, wandb = get_tensorboard_writer(), get_wandb_writer()
        scalars = {"ha/recovery_seconds": seconds, "ha/lost_steps": lost_steps}
        if tb is not None:
            for name, value in scalars.items():
                tb.add_scalar(name, value, iteration)
        if wandb is not None:
            wandb.log(scalars, iteration)

    def init_parallel(self) -> None:
        """megatron-core's groups as Megatron-LM made them (again after an in-place rebuild)."""
        SETUP["init_parallel"]()

    # -- elastic resize (the interface's relayout) --------------------------------------------------
    # A scale-out's newcomers build their model, optimizer and data loaders with Megatron-LM's set-up,
    # alone, while the kept ranks rebuild theirs here: no set-up collective of either side can meet
    # the other's, so both answer theirs alone (the only one that exchanges anything, the optimizer's
    # parameter-group keys, aligns models that are the same on every rank here).
    def _rewrap(self, ddp):
        from mindspeed_ha.comm.interruptible import alone
        with alone():
            return type(ddp)(config=ddp.config, ddp_config=ddp.ddp_config, module=ddp.module)

    def _build_optimizer(self):
        from mindspeed_ha.comm.interruptible import alone
        with alone():
            return SETUP["optimizer"](self.model_chunks)

    def _relaid_out(self, dp: int) -> None:
        """Megatron-LM's ``args`` (its scheduler increment reads the data-parallel size; its own groups
        set rank and world size), the loop's view of the optimizer and its loss scaling, and the
        loop's data iterator: its reads come from a new one at the new data-parallel rank."""
        from megatron.training import get_args
        from mindspeed_ha.comm.interruptible import alone
        get_args().data_parallel_size = dp
        self.resized = True
        if isinstance(self.loop_optimizer, LoopOptimizer):
            self.loop_optimizer.ha_target = self.optimizer
        if self.fns is not None and self.fns.config.grad_scale_func is not None:
            self.fns.config.grad_scale_func = self.optimizer.scale_loss
        with alone():
            fresh = self.data_iterator(self.consumed_samples) if self._replays else None
        for r in self._replays:
            r.restart(getattr(fresh, "iterable", fresh))  # (inside Megatron's RerunDataIterator)

    def loop_check(self, opening: bool) -> None:
        """Around Megatron-LM's micro-batch check between two steps (``opening``: before it): after a
        resize, through the switch by which its loop lets a count it reconfigures itself (sequence
        packing) change without a rampup's assertion and checkpoint, for this one check only."""
        from megatron.training import get_args
        a = get_args()
        if opening and self.resized:
            self._packing, a.rl_use_sequence_packing = a.rl_use_sequence_packing, True
            log.info("the micro-batch count changed with the data-parallel size (global batch %d): Megatron-LM's "
                     "rampup check is passed over once", a.global_batch_size)
        elif not opening and self._packing is not None:
            a.rl_use_sequence_packing, self._packing = self._packing, None
            self.resized = False

    def _lr(self):
        for group in self.optimizer.param_groups:
            if group["params"]:
                return group["lr"]
        return None

    def train_step(self) -> float | None:
        """One step driven by the engine (outside Megatron-LM's loop, e.g. after a rollback)."""
        from megatron.core import parallel_state as ps
        from megatron.training import get_args
        if self.fns is None:
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
        in_loop = self.fns is not None  # an in-process reload (no replicas) inside Megatron-LM's loop
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
        self.loop.catch_up = self.consumed_samples  # the steps up to the loop's position: _run_catch_up
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


class LoopOptimizer:
    """What Megatron-LM's loop holds as its optimizer when the job can change its layout (elastic):
    a resize builds a new optimizer, and the loop's reads (its learning rate and loss scale for the
    log, its checkpoint calls) follow it here."""

    def __init__(self, optimizer):
        self.ha_target = optimizer

    def __getattr__(self, name):
        return getattr(self.ha_target, name)


def unwrap_optimizer(optimizer):
    return optimizer.ha_target if isinstance(optimizer, LoopOptimizer) else optimizer


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
