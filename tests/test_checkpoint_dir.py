"""The checkpoint directory: a crash at any step of putting a checkpoint in place leaves one that
--load takes; a broken tracker is an error naming the newest complete checkpoint, never a start from 0."""
import json
import os

import pytest

from mindspeed_ha.trainer_state import checkpoint_dir


def fake_checkpoint(path, payload=b"weights"):
    os.makedirs(path)
    for name, data in (("__0_0.distcp", payload), (".metadata", b"m"), ("metadata.json", b"{}")):
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    checkpoint_dir.write_manifest(path, {"files": checkpoint_dir.checksums(path, 0, 1)})


def test_absent_tracker_is_a_fresh_start(tmp_path):
    assert checkpoint_dir.tracker(str(tmp_path)) is None and checkpoint_dir.newest_checkpoint(str(tmp_path)) is None


@pytest.mark.parametrize("tracker,needle", [
    ("7", "the tracker names iteration 7, but {root}/iter_0000007 is missing"),
    ("abc", "holds 'abc', not an iteration"),
    ("4", "the tracker names iteration 4, but {root}/iter_0000004 is incomplete"),
])
def test_a_broken_tracker_is_an_error_naming_the_newest_complete_checkpoint(tmp_path, tracker, needle):
    root = str(tmp_path)
    fake_checkpoint(checkpoint_dir.iter_dir(root, 2))
    os.makedirs(checkpoint_dir.iter_dir(root, 4))  # a directory a crash left half written
    (tmp_path / checkpoint_dir.TRACKER).write_text(tracker)
    with pytest.raises(checkpoint_dir.CheckpointError) as e:
        checkpoint_dir.tracker(root)
    msg = str(e.value)
    assert needle.format(root=root) in msg
    assert f"the newest complete checkpoint there is iteration 2 ({root}/iter_0000002)" in msg
    assert checkpoint_dir.newest_checkpoint(root) is None  # (the dump's fallback: none it could name)


def test_a_file_missing_from_its_manifest_makes_it_incomplete(tmp_path):
    path = checkpoint_dir.iter_dir(str(tmp_path), 3)
    fake_checkpoint(path)
    assert checkpoint_dir.complete(path)
    os.unlink(os.path.join(path, "__0_0.distcp"))
    assert not checkpoint_dir.complete(path)


@pytest.mark.parametrize("crash_at", range(6))
def test_a_crash_at_any_step_of_publishing_leaves_a_checkpoint_to_load(tmp_path, monkeypatch, crash_at):
    """Rewriting iteration 5 (as a dump after a periodic save of 5 does), a crash after each file
    operation: --load still finds a complete iteration 5, the old copy or the new one."""
    root = str(tmp_path)
    fake_checkpoint(checkpoint_dir.iter_dir(root, 5), b"old")
    checkpoint_dir.write_tracker(root, 5)
    fake_checkpoint(checkpoint_dir.iter_dir(root, 5) + "_tmp", b"new")
    calls = {"n": 0}
    real_replace, real_rmtree = os.replace, checkpoint_dir.shutil.rmtree

    def step(real):
        def op(*a, **k):
            if calls["n"] == crash_at:
                raise KeyboardInterrupt("crash")
            calls["n"] += 1
            return real(*a, **k)
        return op
    monkeypatch.setattr(checkpoint_dir.os, "replace", step(real_replace))
    monkeypatch.setattr(checkpoint_dir.shutil, "rmtree", step(real_rmtree))
    try:
        checkpoint_dir.publish(root, checkpoint_dir.iter_dir(root, 5) + "_tmp", 5)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(checkpoint_dir.os, "replace", real_replace)
    monkeypatch.setattr(checkpoint_dir.shutil, "rmtree", real_rmtree)
    assert checkpoint_dir.tracker(root) == 5
    data = open(os.path.join(checkpoint_dir.iter_dir(root, 5), "__0_0.distcp"), "rb").read()
    assert data in (b"old", b"new")
    assert json.load(open(os.path.join(checkpoint_dir.iter_dir(root, 5), checkpoint_dir.MANIFEST)))["files"]


def _trainer_at(iteration: int, gbs: int = 16):
    """What ``checkpoint.at_iteration`` reads of a trainer: counters and megatron-core's own scheduler."""
    from types import SimpleNamespace

    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=3 * gbs,
                                    lr_decay_steps=20 * gbs, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=20 * gbs, wd_incr_style="constant")
    sched.step(iteration * gbs)
    return SimpleNamespace(iteration=iteration, consumed_samples=iteration * gbs, global_batch_size=gbs,
                           scheduler=sched)


def _described(trainer, iteration: int) -> dict:
    from types import SimpleNamespace

    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from mindspeed_ha.trainer_state import checkpoint
    sd = {"args": SimpleNamespace(), "rng_state": ShardedObject("rng_state", [None], (1, 1), (0, 0))}
    checkpoint.at_iteration(sd, trainer, iteration, {"rng": iteration})
    return {"iteration": sd["iteration"], "consumed": sd["consumed_samples"], "args": sd["args"].consumed_train_samples,
            "sched": sd["opt_param_scheduler"], "rng": sd["rng_state"].data}


@pytest.mark.parametrize("trainer_at", [4, 5, 6])
def test_a_survivor_describes_the_iteration_before_its_own_as_its_twins_do(trainer_at):
    """A dying gasp at iteration 5 written by survivors whose trainers are at 4 (update done, bookkeeping
    not yet), 5, or 6 (their instance finished a step the other instance did not): the checkpoint's
    counters and scheduler are the same in each case."""
    assert _described(_trainer_at(trainer_at), 5) == _described(_trainer_at(5), 5)


def test_a_survivor_two_steps_away_cannot_describe_the_iteration():
    from mindspeed_ha.trainer_state import checkpoint
    with pytest.raises(ValueError, match="trainer at iteration 7 cannot describe iteration 5"):
        checkpoint.at_iteration({}, _trainer_at(7), 5, None)
