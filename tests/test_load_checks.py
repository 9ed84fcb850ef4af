"""--load reads nothing it should not: flipped bytes, other model settings, a broken tracker, an
optimizer it cannot hold are refused before any tensor is used, with the path and what would work."""
import shutil

import pytest

from helpers import TINY, assert_ok, losses, torchrun

SAVE = ["--train-iters", "3", "--save-interval", "2", "--enable-high-availability"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank run with checkpoints of iterations 2 and 3 (both carry their manifest)."""
    d = tmp_path_factory.mktemp("saved")
    assert_ok(torchrun(2, [*TINY, *SAVE, "--save", str(d / "ck")], d / "log", timeout=180))
    assert (d / "ck" / "iter_0000003" / "ha_manifest.json").exists()
    assert (d / "ck" / "iter_0000002" / "ha_manifest.json").exists()  # periodic saves carry it too
    return d / "ck"


def load(tmp_path, ck, *extra, iters="4"):
    return torchrun(2, [*TINY, "--train-iters", iters, "--enable-high-availability", "--load", str(ck), *extra],
                    tmp_path / "log", timeout=180)


def refused(proc, *needles):
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "mindspeed-ha: error (rank 0)" in ln]
    assert lines and all(n in lines[0] for n in needles), proc.stderr[-3000:]
    assert 'checkpoint.py", line' not in proc.stderr  # our refusal, not a crash
    return lines[0]


def test_a_flipped_byte_is_refused_naming_the_file(tmp_path, saved):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    shard = sorted((ck / "iter_0000003").glob("__*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    refused(load(tmp_path, ck), str(shard), "does not match its checksum", "--no-verify-checkpoint")
    assert not [e for e in (tmp_path / "log" / "events").glob("rank_*.jsonl") if '"load"' in e.read_text()]


def test_other_model_settings_are_refused_naming_both_values(tmp_path, saved):
    refused(load(tmp_path, saved, "--num-attention-heads", "8"),
            "was written with --num-attention-heads 4, this job has --num-attention-heads 8")


def test_a_tracker_naming_a_missing_checkpoint_is_refused_not_a_start_from_0(tmp_path, saved):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    shutil.rmtree(ck / "iter_0000003")  # the tracker still names 3
    refused(load(tmp_path, ck), "the tracker names iteration 3", "iter_0000003 is missing",
            "the newest complete checkpoint there is iteration 2")


def test_without_the_distributed_optimizer_refused_or_weights_only(tmp_path, saved):
    plain = [a for a in TINY if a != "--use-distributed-optimizer"]
    proc = torchrun(2, [*plain, "--train-iters", "4", "--load", str(saved)], tmp_path / "log", timeout=180)
    refused(proc, "its optimizer state is a distributed optimizer's", "--use-distributed-optimizer",
            "--no-load-optim")
    proc = torchrun(2, [*plain, "--train-iters", "4", "--load", str(saved), "--no-load-optim"],
                    tmp_path / "weights", timeout=180)
    assert_ok(proc)
    assert sorted(losses(tmp_path / "weights")) == [4]
