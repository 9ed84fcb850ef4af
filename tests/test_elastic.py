"""Elastic scale-in, the rank side (``mindspeed_ha.recovery.elastic``), on real processes of the
built-in trainer with the harness standing in for the controller (``workers/dump_worker.py``)."""
from concurrent.futures import ThreadPoolExecutor

from helpers import TINY, assert_ok, losses, torchrun
from test_dump import launch_ranks, result_of

K, LAST = 5, 10


def args(*extra):
    return [*TINY, "--global-batch-size", "16", "--lr-decay-iters", str(LAST), "--enable-high-availability", *extra]


def test_dp4_scales_in_to_dp2_in_process_bit_identical_to_a_dp2_job_from_the_checkpoint(tmp_path):
    """Rank 1 is lost after step 5 with no spare: ranks 0 and 3 (one holder of each shard) train on
    at DP=2 — new groups, DDP and optimizer in the same processes, the state moved point to point —
    rank 2 parks. Steps 6..10 equal, bit for bit, a fresh DP=2 job loaded from a DP=4 checkpoint of
    step 5 (same weights, optimizer state and data; 4 micro-batches per rank instead of 2)."""
    for d in ("ref4", "ref2", "run"):
        (tmp_path / d).mkdir()
    ck = tmp_path / "ck"
    assert_ok(torchrun(4, args("--train-iters", str(K), "--save", str(ck), "--save-interval", str(K)),
                       tmp_path / "ref4"))
    with ThreadPoolExecutor(1) as pool:
        ref2 = pool.submit(torchrun, 2, args("--train-iters", str(LAST), "--load", str(ck)), tmp_path / "ref2")
        outs = launch_ranks(4, args("--train-iters", str(LAST), "--ha-log-dir", str(tmp_path / "run")),
                            tmp_path / "run", {"DUMP_STEPS": str(K), "DUMP_MODE": "elastic", "DUMP_KILL": "1"})
        assert_ok(ref2.result())
    assert [c for c, _, _ in outs] == [0, 0, 0, 0], "\n".join(e[-3000:] for _, _, e in outs)
    res = result_of(outs)
    assert res["dp"] == 2 and res["received"] > 0, res
    got, before, after = losses(tmp_path / "run"), losses(tmp_path / "ref4"), losses(tmp_path / "ref2")
    assert sorted(got) == list(range(1, LAST + 1))
    assert {i: got[i] for i in range(1, K + 1)} == before
    assert {i: got[i] for i in range(K + 1, LAST + 1)} == after


def test_a_lost_rank_without_a_spare_scales_the_job_in_under_the_controller(tmp_path):
    """``--enable-elastic-training`` alone, rank 1 killed in step 6 (no recover, so no spare): the
    controller plans, the kept ranks 0 and 3 scale in, rank 2 is parked (it exits 0), and the job ends
    with exit 0. Steps 1..5 equal the DP=4 job's, 6..10 a DP=2 job's from the step-5 checkpoint."""
    import subprocess
    import sys
    from helpers import PRETRAIN, clean_env, events
    for d in ("ref4", "ref2", "run"):
        (tmp_path / d).mkdir()
    ck = tmp_path / "ck"
    with ThreadPoolExecutor(1) as pool:
        ref4 = pool.submit(torchrun, 4, args("--train-iters", str(K), "--save", str(ck), "--save-interval", str(K)),
                           tmp_path / "ref4")
        cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", "4", PRETRAIN,
               *args("--train-iters", str(LAST), "--ha-log-dir", str(tmp_path / "run"))]
        cmd.remove("--enable-high-availability")
        cmd.append("--enable-elastic-training")
        proc = subprocess.run(cmd, env=clean_env({"MINDSPEED_HA_INJECT": f"kill:rank=1:step={K + 1}:phase=forward"}),
                              capture_output=True, text=True, timeout=300, cwd=str(tmp_path / "run"))
        assert_ok(ref4.result())
    assert_ok(torchrun(2, args("--train-iters", str(LAST), "--load", str(ck)), tmp_path / "ref2"))
    assert_ok(proc)
    ctl = events(tmp_path / "run", "controller")
    scaled = [e for e in ctl if e["event"] == "scaled_in"]
    assert len(scaled) == 1, [e for e in ctl if e["event"] in ("fault", "strategy", "repair_failed", "diagnosis")]
    assert (scaled[0]["old_dp"], scaled[0]["dp"], scaled[0]["dropped"], scaled[0]["redundancy"]) == (4, 2, [1, 2], True)
    rec = [e for e in ctl if e["event"] == "recovered"]
    assert len(rec) == 1 and rec[0]["strategy"] == "elastic-training" and rec[0]["lost_steps"] == 0
    got, before, after = losses(tmp_path / "run"), losses(tmp_path / "ref4"), losses(tmp_path / "ref2")
    assert sorted(got) == list(range(1, LAST + 1))
    assert {i: got[i] for i in range(1, K + 1)} == before
    assert {i: got[i] for i in range(K + 1, LAST + 1)} == after
