"""The engine's trainer interface over Megatron-LM's own loop, objects and functions.

Megatron-LM's loop keeps calling its ``train_step``; each call runs here (``run_step``) between the
session's step hooks. A recovery served inside a failing call either rolls back (the step runs again,
with the same microbatches: the loop's data iterator is wrapped so a step can be replayed) or rolls
forward (only the rest of Megatron-LM's own ``train_step`` runs, with the step's recorded
forward-backward output); ``LoopPosition`` (loop.py) says where the loop is relative to the trainer.
"""
from __future__ import annotations

import time

from mindspeed_ha import compat
from mindspeed_ha.events import get_logger

from .loop import LoopData, LoopFunctions, LoopPosition, keep_pipeline_outputs, own_train_step
from .objects import MegatronLMObjects
from .phases import add_grad_sync_point, forward_with_phases
from .resize import LoopOptimizer, RampupCheck
from .step import StepRecord, UpdateDone

log = get_logger("megatron_lm")


class MegatronLMTrainer(MegatronLMObjects):
    """The narrow trainer interface over Megatron-LM's loop (the built-in trainer implements the same
    one; its reads and writes of Megatron-LM's objects: ``MegatronLMObjects``). ``iteration`` and
    ``consumed_samples`` count completed steps; inside Megatron-LM's loop they run one step ahead of
    its ``args`` until the loop's own bookkeeping."""

    def __init__(self, model, optimizer, scheduler, iteration: int):
        super().__init__(model, optimizer, scheduler, iteration)
        self.ended = iteration  # the last step whose train_step returned
        self.fns: LoopFunctions | None = None   # the loop's train_step and its arguments, once it has called
        self.loop = LoopPosition(running=iteration)
        self.step = StepRecord()
        self.data = LoopData()  # the loop's data iterator, replayable
        self.loop_optimizer = optimizer  # what the loop holds (a LoopOptimizer under elastic)
        self.rampup = RampupCheck()  # Megatron-LM's micro-batch check, after an elastic resize

    def enter_loop(self) -> bool:
        """The loop's first train_step call here: True once (the caller starts recovery's tracking)."""
        first, self.loop.entered = not self.loop.entered, True
        return first

    def bind_step(self, original, forward_step_func, data_iterator, config, forward_backward_func):
        """Called by Megatron-LM's loop before each of its steps: its objects and position are the truth."""
        from megatron.training import get_args
        keep_pipeline_outputs(config)
        self.fns = LoopFunctions(original, forward_step_func, config, forward_backward_func)
        self.data.bind(data_iterator)
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
            self.step.undo_partial(self.scheduler)
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
        add_grad_sync_point(config, lambda: self.loop.running)
        self.step = StepRecord.begin(self.scheduler, self.data.replays)
        s.step_start(it)
        PROCESS_STOP.raise_deferred()  # a collective of the loop since the last step failed: a fault as it starts
        data = self.data.iterator if iteration is not None or self.loop.catch_up is None else self._reloaded_data()
        out = compat.call_train_step(original, forward_with_phases(forward_step_func, s, it), data,
                                     self.model_chunks, self.optimizer, self.scheduler, config,
                                     self.step.recording(forward_backward_func, self.data.replays), it - 1)
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
                self.step = StepRecord.begin(self.scheduler, self.data.replays)
                s.step_start(it)
                out = compat.call_train_step(original, forward_with_phases(forward_step_func, s, it), data,
                                             self.model_chunks, self.optimizer, self.scheduler, config,
                                             forward_backward_func, it - 1)
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

    def unlogged_loss(self) -> tuple[int, float] | None:
        it = self.loop.running
        if not it or it <= self.ended:
            return None
        loss = self.step.loss_of_totals()
        return None if loss is None else (it, loss)

    # -- recovery (the engine's rollback and roll-forward) ----------------------------------------
    def restart_from(self, iteration: int) -> None:
        """Rollback: the failed step runs again from its start (the caller restored the RNG). Between
        steps (a fault in the loop's periodic save) there is nothing to undo: the next step is next."""
        if self.iteration != iteration:
            raise RuntimeError(f"trainer at iteration {self.iteration}, asked to restart from {iteration}")
        if self.step.done:
            return
        self.step.undo_partial(self.scheduler)
        self.data.rewind()

    def finish_step(self, it: int) -> None:
        """Roll forward: the update of step ``it`` is complete on every shard (repaired from the
        twins). The rest of Megatron-LM's own train_step — scheduler, the loss's DP all-reduce, its
        result — runs by calling it with the step's recorded forward-backward output and update
        result in place of redoing them; the failing train_step call returns that result."""
        from mindspeed_ha.comm.interruptible import PROCESS_STOP
        if self.iteration >= it:
            return
        self.step.undo_partial(self.scheduler)
        original, config = own_train_step(self.fns, self.model_chunks)
        norm, zeros = getattr(self.optimizer, "ha_grad_stats", (None, None))
        losses = self.step.losses_for_tail()
        self.loop.finished_from = (self.iteration, self.consumed_samples)
        out = compat.call_train_step(original, None, None, self.model_chunks,
                                     UpdateDone(self.optimizer, (True, norm, zeros)), self.scheduler, config,
                                     lambda **kwargs: losses, it - 1)
        PROCESS_STOP.commit_point("the rolled-forward step's result")
        # The samples' sum is whole if a commit point (this rank's update's) passed after it was
        # issued, before the stop; else the stop may have cut it short, and it is not reported.
        whole = PROCESS_STOP.committed_since(self.step.samples_mark)
        self.loop.finished = self._step_done(it, out, samples_whole=whole)

    def peers_ended(self, iteration: int) -> None:
        """Where Megatron-LM's loop gives a data-parallel peer nothing to wait for after a step
        (core_v0.12.1: no collective of train_step's tail spans DP), some ranks can end step
        ``iteration`` while others are still inside it, and a stop reaches the first ones in the
        loop's code after the step (its timers' barriers, its logging), which they then pass alone
        (``comm.stop``), or in the step's end. This rank, if it has yet to run that code (its loop
        is at that step: it finished the step in the recovery, or ended it in its end hooks), answers
        it alone too, until its next step; a rank whose loop starts at the next step skips it."""
        from mindspeed_ha.comm.interruptible import PROCESS_STOP
        if self.loop.finished is not None or (self.fns is not None and self.loop.running == iteration):
            PROCESS_STOP.answer_loop_alone()

    def bookkeeping(self) -> dict:
        """What a restarted rank takes from its twin besides the optimizer shard."""
        self.step.undo_partial(self.scheduler)  # the scheduler as of the failed step's start (its tail may have run here)
        norm, zeros = getattr(self.optimizer, "ha_grad_stats", (None, None))
        # The loss of the step this rank ended last (DP-reduced: the same bits on every DP rank), for a
        # restarted writer of the losses whose predecessor died before logging it (a step its twin
        # ended while the rest of the job was still inside it).
        ended = self.step.out if self.step.done and self.iteration == self.ended else None
        loss = float(ended[0]["lm loss"]) if ended is not None and "lm loss" in ended[0] else None
        return {**super().bookkeeping(), "grad_stats": [norm, zeros], "step_loss": loss,
                "reduced": self.step.reduced if self.step.reduced_whole() else None}

    def install_bookkeeping(self, state: dict) -> None:
        """Into the trainer and into ``args``, where Megatron-LM's loop and data loaders read them."""
        if self.ended > state["ended"]:
            # (Megatron-LM's loop has counted the step in its own variables: nothing can take it back)
            raise RuntimeError(f"this rank ended step {self.ended} in Megatron-LM's loop, its twin {state['ended']}: "
                               "the loop cannot go back a step (the periodic checkpoint or a dump can)")
        super().install_bookkeeping(state)
        self.step.reduced, self.step.reduced_mark = state["reduced"], None  # (the twin's: whole)
        if hasattr(self.optimizer, "ha_grad_stats"):
            self.optimizer.ha_grad_stats = list(state["grad_stats"])

    # -- elastic resize (the interface's resize) ------------------------------------------------------
    def _resized(self, dp: int) -> None:
        """Megatron-LM's ``args`` (its scheduler increment reads the data-parallel size; its own groups
        set rank and world size), the loop's view of the optimizer and its loss scaling, and the
        loop's data iterator: its reads come from a new one at the new data-parallel rank."""
        from megatron.training import get_args
        from mindspeed_ha.comm.interruptible import alone
        a = get_args()
        self.rampup.count_before = a.global_batch_size // (a.micro_batch_size * a.data_parallel_size)
        a.data_parallel_size = dp
        self.rampup.resized = True
        if isinstance(self.loop_optimizer, LoopOptimizer):
            self.loop_optimizer.ha_target = self.optimizer
        if self.fns is not None and self.fns.config.grad_scale_func is not None:
            self.fns.config.grad_scale_func = self.optimizer.scale_loss
        with alone():
            fresh = self.data_iterator(self.consumed_samples) if self.data.replays else None
        self.data.restart(fresh)

    def loop_check(self, opening: bool) -> None:
        """Around Megatron-LM's micro-batch check between two steps (``opening``: before it)."""
        self.rampup.around(opening)

    def loop_num_microbatches(self, original) -> int:
        """The micro-batch count Megatron-LM's training module reads (``RampupCheck.count``)."""
        return self.rampup.count(original)

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

    def load_checkpoint(self, load_dir: str) -> int:
        from megatron.training import get_args
        in_loop = self.fns is not None  # an in-process reload (no replicas) inside Megatron-LM's loop
        if in_loop:
            self.step.undo_partial(self.scheduler)
        flops = self._load(load_dir)
        self.ended = self.iteration
        self.loop.catch_up = self.consumed_samples  # the steps up to the loop's position: _run_catch_up
        if in_loop:  # the loop's iterator back to the failed step's start
            self.data.rewind()
        else:  # a restarted rank's set-up: its loop starts from these (or from loop_position)
            a = get_args()
            a.consumed_train_samples, a.num_floating_point_operations_so_far = self.consumed_samples, flops
        return self.iteration
