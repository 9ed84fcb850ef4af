"""Elastic scale-in end to end: real processes of the built-in trainer under ``mindspeed-ha run``, the
controller deciding, the kept ranks rebuilding their layout in process."""
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import PRETRAIN, TINY, assert_ok, backend_env, clean_env, events, extended, losses, on, torchrun

K, LAST = 5, 10


def elastic_job(log_dir, nproc, inject, timeout=300, extra=(), backend="gloo"):
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", str(nproc), PRETRAIN,
           *args("--train-iters", str(LAST), "--ha-log-dir", str(log_dir), *extra)]
    cmd[cmd.index("--enable-high-availability")] = "--enable-elastic-training"
    return subprocess.run(cmd, env=clean_env({**backend_env(backend), "MINDSPEED_HA_INJECT": inject}), capture_output=True,
                          text=True, timeout=timeout, cwd=str(log_dir))


def args(*extra):
    return [*TINY, "--global-batch-size", "16", "--lr-decay-iters", str(LAST), "--enable-high-availability", *extra]


@pytest.mark.parametrize("precision,backend", [
    on((), "emulated_nccl", id="fp32-emulated_nccl"), extended((), "gloo", id="fp32-gloo"),
    pytest.param(("--bf16",), "gloo", marks=[pytest.mark.compat, pytest.mark.megatron_release], id="bf16-gloo")])
def test_a_lost_rank_without_a_spare_scales_the_job_in_under_the_controller(tmp_path, precision, backend):
    """``--enable-elastic-training`` alone, rank 1 killed in step 6 (no recover, so no spare): the
    controller plans, the kept ranks 0 and 3 scale in, rank 2 is parked (it exits 0), and the job ends
    with exit 0. Steps 1..5 equal the DP=4 job's, 6..10 a DP=2 job's from the step-5 checkpoint — in
    bf16 too: the fp32 main params move, and the bf16 weights are gathered from them as a load does.
    On gloo and on the backend with NCCL's semantics (the references are gloo's: the same bits)."""
    for d in ("ref4", "ref2", "run"):
        (tmp_path / d).mkdir()
    ck = tmp_path / "ck"
    with ThreadPoolExecutor(1) as pool:
        ref4 = pool.submit(torchrun, 4, args("--train-iters", str(K), "--save", str(ck), "--save-interval", str(K),
                                             *precision), tmp_path / "ref4")
        proc = elastic_job(tmp_path / "run", 4, f"kill:rank=1:step={K + 1}:phase=forward", extra=precision,
                           backend=backend)
        assert_ok(ref4.result())
    assert_ok(torchrun(2, args("--train-iters", str(LAST), "--load", str(ck), *precision), tmp_path / "ref2"))
    assert_ok(proc)
    ctl = events(tmp_path / "run", "controller")
    scaled = [e for e in ctl if e["event"] == "scaled_in"]
    assert len(scaled) == 1, [e for e in ctl if e["event"] in ("fault", "strategy", "strategy_failed", "diagnosis")]
    assert (scaled[0]["old_dp"], scaled[0]["dp"], scaled[0]["dropped"], scaled[0]["redundancy"]) == (4, 2, [1, 2], True)
    rec = [e for e in ctl if e["event"] == "recovered"]
    assert len(rec) == 1 and rec[0]["strategy"] == "elastic-training" and rec[0]["lost_steps"] == 0
    got, before, after = losses(tmp_path / "run"), losses(tmp_path / "ref4"), losses(tmp_path / "ref2")
    assert sorted(got) == list(range(1, LAST + 1))
    assert {i: got[i] for i in range(1, K + 1)} == before
    assert {i: got[i] for i in range(K + 1, LAST + 1)} == after


def test_scale_in_twice_dp8_to_4_to_2(tmp_path):
    """Rank 1 lost in step 4 (8 -> 4: ranks 0, 2, 3, 5 train on), then rank 5, a kept one, in step 7
    (4 -> 2): every iteration logged once, bit-identical to the fault-free DP=8 run before the first
    fault, within the measured bound of another data-parallel size after it (fp32: the same samples
    per step, only the sums' grouping differs). The resized job checks its twins after every step
    and saves every 3 steps as any job does."""
    for d in ("ref", "run"):
        (tmp_path / d).mkdir()
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(torchrun, 8, args("--train-iters", str(LAST)), tmp_path / "ref", None, 400)
        proc = elastic_job(tmp_path / "run", 8, "kill:rank=1:step=4:phase=forward,kill:rank=5:step=7:phase=backward",
                           timeout=400, extra=("--ha-verify-replicas-interval", "1", "--save", str(tmp_path / "ck"),
                                               "--save-interval", "3"))
        assert_ok(ref.result())
    assert_ok(proc)
    ctl = events(tmp_path / "run", "controller")
    scaled = [(e["old_dp"], e["dp"], e["dropped"]) for e in ctl if e["event"] == "scaled_in"]
    assert scaled == [(8, 4, [1, 4, 6, 7]), (4, 2, [3, 5])], scaled
    checks = [e for e in events(tmp_path / "run", "rank_2") if e["event"] == "replica_check"]
    assert [e["iteration"] for e in checks] == list(range(1, LAST + 1)) and all(e["ok"] for e in checks)
    assert [e["replica_group"] for e in checks][-1] == [0, 2]   # job ranks, at DP=2
    assert {p.name for p in (tmp_path / "ck").iterdir()} >= {"iter_0000009", "iter_0000010"}
    got, want = losses(tmp_path / "run"), losses(tmp_path / "ref")
    assert sorted(got) == list(range(1, LAST + 1))
    assert {i: got[i] for i in range(1, 4)} == {i: want[i] for i in range(1, 4)}
    rel = max(abs(float.fromhex(got[i]) / float.fromhex(want[i]) - 1) for i in range(4, LAST + 1))
    assert rel < 1e-6, rel


@pytest.mark.parametrize("layout,killed,kept,dropped", [
    # (a pipeline's scale-in in CI: vpp2, a pipeline of two stages)
    (("--tensor-model-parallel-size", "2"), 3, [[0, 1], [6, 7]], [2, 3, 4, 5]),
    extended(("--pipeline-model-parallel-size", "2"), 5, [[0, 4], [3, 7]], [1, 2, 5, 6], id="pp2"),
    (("--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"),
     5, [[0, 4], [3, 7]], [1, 2, 5, 6]),
    (("--num-experts", "4", "--expert-model-parallel-size", "2"), 2, [[0], [1], [6], [7]], [2, 3, 4, 5])],
    ids=["tp2", "pp2", "vpp2", "moe"])
def test_a_model_parallel_job_scales_in_to_half_its_replicas(tmp_path, layout, killed, kept, dropped):
    """TP=2 x DP=4 with rank 3 (TP rank 1 of replica 1) lost, or PP=2 x DP=4 with rank 5 (stage 1
    of replica 1: megatron-core lays the stages outermost, so a replica is ranks d and d + 4): the
    whole replica goes, and with it the one its shards' twins would leave unpaired; the two kept
    replicas train on at DP=2, every rank at its TP position or pipeline stage (with a pipeline the
    new order puts each stage's ranks together; interleaved too, each stage's two chunks rewrapped). MoE (4 experts, EP=2) x DP=8 with rank 2 lost:
    replicas go in blocks of two (the pair that holds every expert), so ranks 0, 1, 6 and 7 train on
    at DP=4, each keeping its experts and expert-parallel group, with a twin for its expert shard. Before the fault
    bit-identical to the fault-free job, after it within the bound; the twins agree after every step."""
    for d in ("ref", "run"):
        (tmp_path / d).mkdir()
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(torchrun, 8, args("--train-iters", str(LAST), *layout), tmp_path / "ref", None, 400)
        proc = elastic_job(tmp_path / "run", 8, f"kill:rank={killed}:step=4:phase=forward", timeout=400,
                           extra=(*layout, "--ha-verify-replicas-interval", "1"))
        assert_ok(ref.result())
    assert_ok(proc)
    ctl = events(tmp_path / "run", "controller")
    scaled = [(e["old_dp"], e["dp"], e["kept"], e["dropped"]) for e in ctl if e["event"] == "scaled_in"]
    assert scaled == [(2 * len(kept), len(kept), kept, dropped)], scaled
    checks = [e for e in events(tmp_path / "run", f"rank_{kept[0][0]}") if e["event"] == "replica_check"]
    assert [e["iteration"] for e in checks] == list(range(1, LAST + 1)) and all(e["ok"] for e in checks)
    # A kept replica's own model-parallel groups keep their communicators through the resize.
    for replica in kept:
        for r in replica:
            rebuilt = [e for e in events(tmp_path / "run", f"rank_{r}") if e["event"] == "rebuilt"]
            assert len(rebuilt) == 1 and sorted(replica) in rebuilt[0]["kept"], (r, rebuilt)
    got, want = losses(tmp_path / "run"), losses(tmp_path / "ref")
    assert sorted(got) == list(range(1, LAST + 1))
    assert {i: got[i] for i in range(1, 4)} == {i: want[i] for i in range(1, 4)}
    rel = max(abs(float.fromhex(got[i]) / float.fromhex(want[i]) - 1) for i in range(4, LAST + 1))
    assert rel < 1e-6, rel


def test_a_loss_the_resized_job_cannot_absorb_ends_in_the_dying_gasp(tmp_path):
    """DP=4 loses rank 1 in step 4 (-> DP=2, ranks 0 and 3), then rank 3 in step 8: a DP=1 job would
    have one optimizer instance, which is refused, so the dump follows. Rank 0 alone holds every
    shard (at DP=2 its twin was rank 3) and writes the dying gasp of iteration 7 at the resized
    layout; a fresh DP=4 job loads it and trains to the end within the bound of the data-parallel
    sizes it went through (the fault-free run's losses)."""
    for d in ("ref", "run", "again"):
        (tmp_path / d).mkdir()
    ck = tmp_path / "ck"
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(torchrun, 4, args("--train-iters", str(LAST)), tmp_path / "ref")
        proc = elastic_job(tmp_path / "run", 4, "kill:rank=1:step=4:phase=forward,kill:rank=3:step=8:phase=forward",
                           extra=("--save", str(ck)))
        assert_ok(ref.result())
    assert proc.returncode == 1, proc.stderr[-3000:]
    ctl = events(tmp_path / "run", "controller")
    assert [(e["old_dp"], e["dp"]) for e in ctl if e["event"] == "scaled_in"] == [(4, 2)]
    failed = [e["reason"] for e in ctl if e["event"] == "strategy_failed"]
    assert failed and "changing the optimizer instance count in process is not built" in failed[0], failed
    dump = [e for e in ctl if e["event"] == "checkpoint" and e["kind"] == "dying_gasp"]
    assert len(dump) == 1 and dump[0]["iteration"] == 7 and dump[0]["ranks"] == [0], dump
    assert_ok(torchrun(4, args("--train-iters", str(LAST), "--load", str(ck)), tmp_path / "again"))
    got, want = {**losses(tmp_path / "run"), **losses(tmp_path / "again")}, losses(tmp_path / "ref")
    assert sorted(got) == list(range(1, LAST + 1))
    assert {i: got[i] for i in range(1, 4)} == {i: want[i] for i in range(1, 4)}
    rel = max(abs(float.fromhex(got[i]) / float.fromhex(want[i]) - 1) for i in range(4, LAST + 1))
    assert rel < 1e-6, rel


@pytest.mark.parametrize("phase", [extended("recovery"), "resize"])
def test_a_fault_during_the_scale_in_plans_again_with_every_loss(tmp_path, phase):
    """DP=8: rank 1 killed in step 4, and rank 2 killed while it serves the scale-in — answering its
    status round (``recovery``), or after it entered the new layout, before any state moved
    (``resize``: it was to be kept, and the kept ranks are between two layouts). The scale-in starts
    over with both losses known, from the state every rank held before it: DP 8 -> 4 without ranks 1
    and 2 (alone, rank 1's loss would have kept rank 2), in one recovery; every iteration logged
    once, within the bound of another data-parallel size of the fault-free DP=8 run."""
    for d in ("ref", "run"):
        (tmp_path / d).mkdir()
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(torchrun, 8, args("--train-iters", str(LAST)), tmp_path / "ref", None, 400)
        proc = elastic_job(tmp_path / "run", 8, f"kill:rank=1:step=4:phase=forward,kill:rank=2:step=4:phase={phase}",
                           timeout=400)
        assert_ok(ref.result())
    assert_ok(proc)
    ctl = events(tmp_path / "run", "controller")
    if phase == "resize":
        plans = [(e["old_dp"], e["dp"], e["kept"]) for e in ctl if e["event"] == "resize_plan"]
        assert plans == [(8, 4, [[0], [2], [3], [5]]), (8, 4, [[0], [3], [5], [6]])], plans
    scaled = [(e["old_dp"], e["dp"], e["dropped"]) for e in ctl if e["event"] == "scaled_in"]
    assert len(scaled) == 1 and scaled[0][:2] == (8, 4) and {1, 2} <= set(scaled[0][2]), scaled
    rec = [e for e in ctl if e["event"] == "recovered"]
    assert len(rec) == 1 and rec[0]["strategy"] == "elastic-training", rec
    lost = {r for f in rec[0]["faults"] if f["kind"] != "comm-failure" for r in f["ranks"]}
    assert lost == {1, 2}, rec[0]["faults"]   # (the others: their peers' failed collectives)
    assert [f["phase"] for f in rec[0]["faults"] if f["ranks"] == [2] and f["kind"] != "comm-failure"] \
        == [phase], rec[0]["faults"]
    got, want = losses(tmp_path / "run"), losses(tmp_path / "ref")
    assert sorted(got) == list(range(1, LAST + 1))
    assert {i: got[i] for i in range(1, 4)} == {i: want[i] for i in range(1, 4)}
    rel = max(abs(float.fromhex(got[i]) / float.fromhex(want[i]) - 1) for i in range(4, LAST + 1))
    assert rel < 1e-6, rel


def test_a_newcomer_built_for_the_jobs_layout_and_planned_elsewhere_drops_its_build():
    """A scale-out's newcomer built ahead for the job's own layout (four ranks in their order) that the
    plan lays out otherwise (a partial scale-out: three ranks, another order): its build is not kept —
    the DDP buffers freed, no optimizer or scheduler left — and the trainer is to be set up again in
    the plan's place (the real path, a full scale-out that keeps the build: test_hosts's elastic drill)."""
    import torch
    from types import SimpleNamespace
    from mindspeed_ha.trainer_state.interface import BuiltAhead, TrainerInterface

    trainer_cls = type("Built", (TrainerInterface,), dict.fromkeys(TrainerInterface.__abstractmethods__))
    trainer = trainer_cls()
    grads, params = torch.zeros(8), torch.ones(8)
    ddp = SimpleNamespace(buffers=[SimpleNamespace(grad_data=grads, param_data=params)], expert_parallel_buffers=[],
                          bucket_groups=[object()], param_to_bucket_group={1: 2}, params_with_grad=[params])
    trainer.model_chunks, trainer.optimizer, trainer.scheduler = [ddp], object(), object()
    trainer.built_ahead = BuiltAhead(4, (), False)
    assert trainer.enter_built_layout([0, 2, 3]) is False
    assert (trainer.built_ahead, trainer.optimizer, trainer.scheduler, trainer.model_chunks) == (None, None, None, [])
    assert grads.untyped_storage().size() == params.untyped_storage().size() == 0
    assert ddp.bucket_groups == [] and ddp.param_to_bucket_group == {}
