"""--data-path reads Megatron indexed datasets through megatron.core.datasets; mock data is deterministic.

The indexed dataset is written by megatron-core's own IndexedDatasetBuilder. Its documents use only
even token ids, which mock data (uniform over the vocabulary) never does, so a sample made only of
even ids shows the trainer really read the file.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import TINY, assert_ok, events, losses, torchrun
from mindspeed_ha.trainer import data
from mindspeed_ha.trainer.args import build_parser, finalize

SEQ, MBS = 32, 2


def make_dataset(prefix: str, docs: int = 48, seed: int = 0) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(docs):
        n = int(rng.integers(8, 3 * SEQ))
        doc = 2 * rng.integers(0, 64, n).astype(np.int32)  # even ids < 128 only
        builder.add_document(torch.from_numpy(doc), [n])
    builder.finalize(prefix + ".idx")


def args_for(*argv: str, world: int = 1):
    return finalize(build_parser().parse_args(["--seq-length", str(SEQ), "--micro-batch-size", str(MBS), *argv]), world)


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("indexed") / "tiny_text_document")
    make_dataset(p)
    return p


def test_indexed_dataset_samples_come_from_the_file(prefix):
    from megatron.core.datasets.gpt_dataset import GPTDataset

    ds = data.build_train_dataset(args_for("--data-path", prefix), 32)
    assert isinstance(ds, GPTDataset)
    for i in range(8):
        s = ds[i]
        tokens, labels = np.asarray(s["tokens"]), np.asarray(s["labels"])
        assert tokens.shape == (SEQ,) and (tokens % 2 == 0).all(), tokens
        assert (tokens[1:] == labels[:-1]).all()  # labels are the next tokens


def test_weighted_blend_and_missing_files(prefix, tmp_path):
    other = str(tmp_path / "other")
    make_dataset(other, seed=1)
    # Megatron-LM's grammar: "w1 prefix1 w2 prefix2"
    ds = data.build_train_dataset(args_for("--data-path", "0.3", prefix, "0.7", other), 32)
    assert len(ds) >= 32 and all((np.asarray(ds[i]["tokens"]) % 2 == 0).all() for i in range(4))
    from mindspeed_ha.trainer.args import ArgError
    with pytest.raises((ArgError, FileNotFoundError), match=r"without \.bin/\.idx"):
        data.build_train_dataset(args_for("--data-path", prefix + ".bin"), 32)


def test_mock_data_is_deterministic():
    a, b = (data.build_train_dataset(args_for("--mock-data"), 64) for _ in range(2))
    for i in (0, 5, 63):
        assert torch.equal(torch.as_tensor(a[i]["tokens"]), torch.as_tensor(b[i]["tokens"]))
    assert not torch.equal(torch.as_tensor(a[0]["tokens"]), torch.as_tensor(a[1]["tokens"]))
    # The iterator is a pure function of consumed_samples: resuming at a position reads what an
    # uninterrupted iterator reads there (DP=2, rank 1).
    it = data.SampleIterator(a, 0, MBS, 1, 2)
    next(it), next(it)
    again = data.SampleIterator(b, 2 * MBS * 2, MBS, 1, 2)
    for _ in range(3):
        x, y = next(it), next(again)
        assert all(torch.equal(x[k], y[k]) for k in ("tokens", "labels", "loss_mask", "position_ids"))


ITERS = 4
TINY_NO_DATA = [a for a in TINY if a != "--mock-data"]


def _train(log_dir, *extra, nproc=2):
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = torchrun(nproc, [*TINY_NO_DATA, "--train-iters", str(ITERS), *extra], log_dir, timeout=120)
    assert_ok(proc)
    return losses(log_dir)


def test_trains_on_indexed_dataset(prefix, tmp_path):
    got = _train(tmp_path / "run", "--data-path", prefix, "--enable-high-availability")
    assert sorted(got) == list(range(1, ITERS + 1))
    values = [float.fromhex(h) for h in got.values()]
    assert all(math.isfinite(v) for v in values), values
    starts = [e for e in events(tmp_path / "run", "rank_0") if e["event"] == "replica_groups"]
    assert starts and starts[0]["replica_group"] == [0, 1]  # DP=2: each rank's shard is the other's twin


def test_mock_runs_are_bit_identical(tmp_path):
    first = _train(tmp_path / "a", "--mock-data")
    second = _train(tmp_path / "b", "--mock-data")
    assert len(first) == ITERS and first == second
