"""The step in flight in Megatron-LM's loop: what it has done so far, and what a recovery does with
it. A rollback undoes what its tail advanced (``StepRecord.undo_partial``); a roll-forward hands
Megatron-LM's train_step tail the step's recorded forward-backward output, or its DP loss totals
(``StepRecord.losses_for_tail``), with the update the twins completed (``UpdateDone``)."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class StepRecord:
    """What the step in flight has done so far: a roll-forward reuses its forward-backward output,
    a restarted twin takes its DP-reduced losses, and a rollback undoes what its tail advanced."""
    done: bool = False                        # it returned: the loop is between steps (e.g. saving)
    out: tuple | None = None                  # what it returned (for the loop's call, if a fault came after)
    fb_out: list | None = None                # its forward-backward output
    reduced: dict | None = None               # its [loss sum, tokens] reduced over DP (under recover)
    reduced_mark: tuple | None = (-1, 0)      # interruptible.commit_mark() as they were issued (None: a twin's, whole)
    samples_hash: Any = None                  # its global batch's samples (tokens_fingerprint), on the device
    samples_mark: tuple = (-1, 0)             # interruptible.commit_mark() when that sum was issued
    at_start: dict = dataclasses.field(default_factory=dict)  # scheduler, rerun state, timers at its start

    @classmethod
    def begin(cls, scheduler, replays: list) -> "StepRecord":
        """A step starts: its data reads are recorded from here, and what its tail may advance
        (scheduler, rerun state machine, timers) is noted, to be undone if it fails."""
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.training import get_timers
        for r in replays:
            r.begin_step()
        rsm = get_rerun_state_machine()
        return cls(at_start={"scheduler": scheduler.num_steps, "rerun": (rsm.state, rsm.current_iteration),
                             "timers": {n for n, t in _timers(get_timers()) if getattr(t, "_started", False)}})

    def undo_partial(self, scheduler) -> None:
        """Back to how the interrupted train_step found things: the scheduler (its tail may have
        stepped it here before a later collective failed; lr and wd set again for that count), the
        rerun state machine (else the next call skips its forward-backward) and the timers it
        started (Megatron's timers refuse a second start)."""
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.training import get_timers
        at = self.at_start
        if not at or self.done:  # a restarted rank (no step begun here), or the step returned
            return
        if scheduler.num_steps != at["scheduler"]:
            scheduler.num_steps = at["scheduler"]
            scheduler.step(increment=0)
        rsm = get_rerun_state_machine()
        rsm.state, rsm.current_iteration = at["rerun"]
        for name, t in _timers(get_timers()):
            if getattr(t, "_started", False) and name not in at["timers"]:
                t.stop()

    def recording(self, forward_backward_func, replays: list):
        """Megatron-LM's forward-backward, its output and the step's DP totals kept here."""
        def forward_backward(*args, **kwargs):
            from mindspeed_ha.comm.interruptible import PROCESS_STOP
            self.fb_out = forward_backward_func(*args, **kwargs)
            # The samples' sum stays on the device (read at the step's end, after its commit point):
            # a diagnostic, which nothing before the update needs.
            self.samples_hash, self.samples_mark = samples_hash(replays), PROCESS_STOP.commit_mark()
            # The DP totals a roll-forward hands a restarted rank (recover), and a dump that settles
            # on this step prints (unlogged_loss): whether a stop cut them short is known later, when
            # the update's commit point passes (or not), without a sync here (losses_for_tail).
            if totals_wanted():
                self.reduced = reduce_losses(self.fb_out)
                self.reduced_mark = PROCESS_STOP.commit_mark()
            return self.fb_out
        return forward_backward

    def reduced_whole(self) -> bool:
        """This rank holds the step's DP totals, and no stop cut them short: a commit point passed
        after they were issued (a twin hands only such totals: their mark is None then)."""
        from mindspeed_ha.comm.interruptible import PROCESS_STOP
        mark = self.reduced_mark
        return self.reduced is not None and (mark is None or PROCESS_STOP.committed_since(mark))

    def loss_of_totals(self) -> float | None:
        """The step's loss from whole DP totals (Megatron-LM's own arithmetic at train_step's end)."""
        if not self.reduced_whole():
            return None
        assert self.reduced is not None  # (whole: it holds them)
        totals = self.reduced.get("lm loss")
        return None if totals is None else float(totals[0] / totals[1])

    def losses_for_tail(self):
        """What the roll-forward's train_step tail gets as its forward-backward output. Where the loss
        function reduced each microbatch's (sum, tokens) over DP already (Megatron-LM 0.12) and the
        tail only adds them up, this rank's own whole totals (a restarted rank's came from its twin),
        with no collective: no collective of that tail spans DP, so a data-parallel peer may have
        ended the step already. Where the tail reduces them over DP: one rank's totals (the first
        data-parallel rank whose totals are whole: the ranks agree on it in one small all-reduce),
        zeros elsewhere, so that the tail's all-reduce gives the same bits (x + 0 == x) whatever
        each rank held. Else this rank's own recorded microbatch losses, which the tail reduces itself."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from mindspeed_ha.device import current
        last = ps.is_pipeline_last_stage(ignore_virtual=True)
        shapes = self.reduced or (self.fb_out or [None])[0]
        if last and shapes is not None and reduced_in_forward(shapes):
            if not self.reduced_whole():
                raise RuntimeError("the failed step's update completed on the twins, but this rank's loss totals "
                                   "may have been cut short by the stop: cannot roll forward")
            return [self.reduced]
        if last and joiners_possible():
            group = ps.get_data_parallel_group(with_context_parallel=True)
            whole = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=current())
            whole[dist.get_rank(group)] = int(self.reduced_whole())
            dist.all_reduce(whole, group=group)
            holders = whole.nonzero().view(-1).tolist()
            if holders and holders[0] == dist.get_rank(group):
                assert self.reduced is not None  # (whole: it holds them)
                return [self.reduced]
            if holders:
                if shapes is None:
                    raise RuntimeError("the failed step's update completed on the twins, but neither its "
                                       "forward-backward nor its loss totals are on this rank: cannot roll forward")
                return [{k: torch.zeros_like(v).view(-1) for k, v in shapes.items()}]
        if self.fb_out is None and last:
            raise RuntimeError("the failed step's update completed on the twins, but its forward-backward did "
                               "not finish on this rank: cannot roll forward")
        return self.fb_out or []


def reduced_in_forward(report: dict) -> bool:
    """A step's loss report whose values are (sum, tokens) pairs already reduced over DP by the loss
    function (Megatron-LM 0.12's pretrain_gpt), which its train_step only adds up; from 0.13 the
    values are [sum, tokens] tensors that train_step reduces over DP itself."""
    return any(isinstance(v, (tuple, list)) for v in report.values())


class UpdateDone:
    """The optimizer, except that ``step()`` reports the update a recovery already completed."""

    def __init__(self, optimizer, result):
        self._optimizer, self._result = optimizer, result

    def step(self):
        return self._result

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


def reduce_losses(losses) -> dict | None:
    """The step's [loss sum, tokens] reduced over DP, before the update — the same arithmetic as
    the end of Megatron-LM's train_step. Under recover a roll-forward may include a restarted
    rank, whose own share died with its predecessor; the twin hands it these totals instead. Where
    the loss function reduced each microbatch over DP already (``reduced_in_forward``), the totals
    are train_step's own sums, in its order, with no collective."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    if not losses or not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    out: dict = {}
    for key in losses[0]:
        if reduced_in_forward({key: losses[0][key]}):
            total, tokens = 0, 0
            for x in losses:
                total, tokens = total + x[key][0], tokens + x[key][1]
            out[key] = (total, tokens)
            continue
        parts = [x[key].view(-1) for x in losses]
        if parts[0].numel() != 2:
            return None  # Megatron's legacy per-microbatch mean: nothing reduced over DP
        val = torch.vstack(parts).sum(dim=0)
        dist.all_reduce(val, group=ps.get_data_parallel_group(with_context_parallel=True))
        out[key] = val
    return out


def samples_hash(replays: list):
    """The step's global batch, whatever its data-parallel split (the ``samples_hash`` of the step
    event): the ranks that read data add up their samples over DP. Megatron-LM's batches carry
    no sample index: a sample is known by its tokens. A tensor on the device (None where this
    rank reads no data): reading it here would stall the host mid-step."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from mindspeed_ha.device import current
    from mindspeed_ha.trainer.data import tokens_fingerprint
    if not replays:
        return None
    mine = sum(tokens_fingerprint(item["tokens"]) for r in replays for item in r.drawn()
               if isinstance(item, dict) and "tokens" in item)
    seen = torch.tensor([mine], dtype=torch.int64, device=current())
    dist.all_reduce(seen, group=ps.get_data_parallel_group())
    return seen


def joiners_possible() -> bool:
    from mindspeed_ha.rank import session
    s = session.current()
    return s is not None and "recover" in s.options.strategies


def totals_wanted() -> bool:
    """HA is on: a restarted rank (recover) or a dump (always on with HA) may need this step's
    DP totals. One small all-reduce a step, as the built-in trainer's loss before its update."""
    from mindspeed_ha.rank import session
    s = session.current()
    return s is not None and s.options.enabled


def _timers(timers) -> list:
    return list(getattr(timers, "_timers", {}).items())
