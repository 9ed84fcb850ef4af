"""Replica optimizer on real megatron-core jobs: every shard has a bit-identical twin, training is
unchanged, checkpoints resume bit for bit."""
import math

import pytest

from helpers import TINY, all_rank_events, assert_ok, extended, losses, torchrun

HA = ["--enable-high-availability", "--ha-verify-replicas-interval", "1"]


def replica_checks(log_dir):
    return [e for e in all_rank_events(log_dir) if e["event"] == "replica_check"]


def groups(log_dir):
    return {e["rank"]: e["replica_group"] for e in all_rank_events(log_dir) if e["event"] == "replica_groups"}


@pytest.mark.parametrize("nproc,layout,expected", [
    (4, [], {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}),
    extended(8, ["--tensor-model-parallel-size", "2"],  # (TP=2 x DP=4's twins in CI: test_ttp's drills check them)
             {0: [0, 4], 2: [2, 6], 4: [0, 4], 6: [2, 6], 1: [1, 5], 3: [3, 7], 5: [1, 5], 7: [3, 7]}, id="TP2xDP4"),
    (4, ["--pipeline-model-parallel-size", "2"], {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}),
], ids=["DP4", "TP2xDP4", "PP2xDP2"])
def test_replica_shards_bit_identical(tmp_path, nproc, layout, expected):
    iters = 5
    proc = torchrun(nproc, TINY + HA + layout + ["--train-iters", str(iters), "--global-batch-size", "16"], tmp_path)
    assert_ok(proc)
    assert groups(tmp_path) == expected
    # The seeds' log line, per rank.
    log = (tmp_path / "ttp_log.log").read_text()
    for r, g in expected.items():
        assert f"rank:{r}, report group list: {g}" in log
    checks = replica_checks(tmp_path)
    # every rank compared its shard fingerprint (every byte of main params, exp_avg, exp_avg_sq, step)
    # with its replica peer after every one of the iterations
    assert len(checks) == nproc * iters and all(c["ok"] for c in checks)
    assert all(c["tensors"] > 0 for c in checks)
    assert sorted(losses(tmp_path)) == list(range(1, iters + 1))


def test_ha_on_vs_off_losses_close(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    on.mkdir(), off.mkdir()
    args = TINY + ["--train-iters", "6"]
    assert_ok(torchrun(4, args + ["--enable-high-availability"], on))
    assert_ok(torchrun(4, args, off))
    a, b = losses(on), losses(off)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    # Two optimizer instances reduce gradients in another order (reduce-scatter in the instance,
    # all-reduce across instances), so bits may differ; the training must not.
    for i in a:
        x, y = float.fromhex(a[i]), float.fromhex(b[i])
        assert math.isclose(x, y, rel_tol=1e-4), (i, x, y)


def test_bf16_replicas(tmp_path):
    proc = torchrun(4, TINY + HA + ["--bf16", "--train-iters", "4"], tmp_path)
    assert_ok(proc)
    checks = replica_checks(tmp_path)
    assert len(checks) == 16 and all(c["ok"] for c in checks)
    assert all(math.isfinite(float.fromhex(h)) for h in losses(tmp_path).values())


# (resumes in CI: test_ttp's, after every dump; bf16's twins: test_bf16_replicas)
@pytest.mark.parametrize("bf16", [extended(False, id="fp32"), extended(True, id="bf16")], ids=["fp32", "bf16"])
def test_save_resume_bit_identical(tmp_path, bf16):
    extra = ["--bf16"] if bf16 else []
    full, first, resumed, ck = (tmp_path / d for d in ("full", "first", "resumed", "ck"))
    for d in (full, first, resumed):
        d.mkdir()
    base = TINY + extra + ["--enable-high-availability", "--train-iters", "7"]
    assert_ok(torchrun(4, base, full))
    # Stop at 3 (a separate job), then resume to 7 from the checkpoint.
    assert_ok(torchrun(4, TINY + extra + ["--enable-high-availability", "--train-iters", "3", "--lr-decay-iters", "7",
                                          "--save", str(ck), "--save-interval", "3"], first))
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (ck / "iter_0000003").is_dir() and not (ck / "iter_0000003_tmp").exists()
    assert_ok(torchrun(4, base + ["--load", str(ck)], resumed))
    want, got = losses(full), losses(resumed)
    assert sorted(got) == [4, 5, 6, 7]
    assert {i: want[i] for i in got} == got
    loads = [e for e in all_rank_events(resumed) if e["event"] == "load"]
    assert len(loads) == 4 and all(e["iteration"] == 3 for e in loads)


def test_moe_expert_replicas(tmp_path):
    """MoE with expert parallelism: expert shards have twins too (checked with the dense ones)."""
    proc = torchrun(4, TINY + HA + ["--num-experts", "4", "--expert-model-parallel-size", "2", "--train-iters", "3"],
                    tmp_path)
    assert_ok(proc)
    ev = [e for e in all_rank_events(tmp_path) if e["event"] == "replica_groups"]
    assert {e["rank"]: e["expert_replica_group"] for e in ev} == {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    checks = replica_checks(tmp_path)
    assert len(checks) == 12 and all(c["ok"] for c in checks)


def test_one_bit_flip_is_caught(tmp_path):
    """A single flipped bit in rank 2's shard after step 3 stops training at the next check, naming
    the replica pair, the iteration and the first differing tensor."""
    proc = torchrun(4, TINY + ["--enable-high-availability", "--ha-verify-replicas-interval", "2",
                               "--train-iters", "8"], tmp_path,
                    env={"MINDSPEED_HA_INJECT": "bitflip:rank=2:step=3:phase=param-sync"})
    assert proc.returncode != 0
    err = proc.stderr
    assert "replica mismatch at iteration 4: ranks 0 and 2" in err and "o0.g0.p0.param" in err, err[-3000:]
    checks = replica_checks(tmp_path)
    assert {c["iteration"] for c in checks if c["ok"]} == {2}
    bad = [c for c in checks if not c["ok"]]
    assert len(bad) == 4 and all(c["iteration"] == 4 for c in bad)
    assert max(losses(tmp_path)) == 4  # nothing trained past the failed check


def test_the_replica_digest_catches_any_flipped_bit_and_stays_on_the_device():
    """replica.digest: every single flipped bit of a shard tensor changes it (all 32 bits of a
    word, words at any position, tensors of every dtype the state holds and at any storage offset),
    computed in chunks on the tensor's own device (here the CPU: no host copy to make)."""
    import torch
    from mindspeed_ha.replica.digest import DIGEST_CHUNK, digest

    g = torch.Generator().manual_seed(7)
    x = torch.randn(3 * DIGEST_CHUNK // 2 + 5, generator=g)  # (more than one chunk)
    d0 = digest(x)
    assert d0.dtype == torch.int64 and d0.device == x.device
    for i in (0, 1, DIGEST_CHUNK - 1, DIGEST_CHUNK, x.numel() - 1):
        for bit in range(32):
            y = x.clone()
            y.view(torch.int32)[i] ^= (1 << bit) if bit < 31 else -(1 << 31)
            assert digest(y) != d0, (i, bit)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int16):
        t = torch.arange(1, 12).to(dtype)
        assert digest(t) == digest(t.clone()) != digest(t.flip(0))
    buf = torch.randn(101, generator=g)
    assert digest(buf[3:50]) == digest(buf[3:50].clone())  # a shard view at an odd offset
