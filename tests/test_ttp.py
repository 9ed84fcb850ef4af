"""TTP end to end: `mindspeed-ha run` with the real trainer, a fault, the controller-driven dying-gasp
checkpoint, then a plain `--load` whose losses must equal the fault-free run's bit for bit."""
import json
import math
import subprocess
import sys

import pytest

from helpers import (PRETRAIN, TINY, TINY_ITERS, TINY_LAYOUTS, assert_ok, backend_env, clean_env, events, extended, losses,
                     on, torchrun, twins_agree)

MINDSPEED_HA = [sys.executable, "-m", "mindspeed_ha.cli"]
ITERS = TINY_ITERS  # (the shared fault-free runs': references.tiny)
TP2 = ["--tensor-model-parallel-size", "2"]


def job(log_dir, nproc=4, inject=None, extra=(), ha=True, timeout=240, backend="gloo"):
    """A job under `mindspeed-ha run` (HA on) or torchrun (HA off: a plain Megatron-style run), on
    gloo or on the CPU backend with NCCL's semantics."""
    log_dir.mkdir(parents=True, exist_ok=True)
    args = [*TINY, "--train-iters", str(ITERS), *extra]
    if not ha:
        return torchrun(nproc, args, log_dir, timeout=timeout)
    cmd = MINDSPEED_HA + ["run", "--standalone", "--nproc-per-node", str(nproc), PRETRAIN, *args, "--enable-high-availability",
                          "--ha-log-dir", str(log_dir)]
    env = clean_env({**backend_env(backend), **({"MINDSPEED_HA_INJECT": inject} if inject else {})})
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(log_dir))


def dying_gasp(log_dir) -> dict:
    done = [e for e in events(log_dir, "controller") if e["event"] == "checkpoint" and e["kind"] == "dying_gasp"]
    assert len(done) == 1, "\n".join(json.dumps(e) for e in events(log_dir, "controller")
                                      if e["event"] in ("fault", "decision", "dump_refused", "diagnosis"))
    return done[0]


def check_saved(proc, log_dir, ck) -> dict:
    """The faulted job ended non-zero, naming the saved iteration and directory; the checkpoint is
    complete (manifest, tracker, no temporary directory)."""
    assert proc.returncode != 0
    saved = dying_gasp(log_dir)
    it = saved["iteration"]
    assert f"dying-gasp checkpoint of iteration {it} written to {ck}/iter_{it:07d}" in proc.stderr, proc.stderr[-3000:]
    assert f"Resume with --load {ck}" in proc.stderr
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(it)
    assert (ck / f"iter_{it:07d}" / "ha_manifest.json").exists()
    assert not [p for p in ck.iterdir() if p.name.endswith("_tmp")]
    return saved


def check_curve(log_dir, iteration: int, want: dict) -> None:
    """The faulted job's loss curve has no hole up to the dump's iteration: every step's loss is
    logged with the fault-free run's bits, the step the dump settled on too when it was still in
    flight (logged at the dump, ``written_at``)."""
    got = losses(log_dir)
    assert set(range(1, iteration + 1)) <= set(got), (iteration, sorted(got))
    assert got == {i: want[i] for i in got}


def check_resume(log_dir, ck, want: dict, nproc=4, extra=(), backend="gloo") -> dict:
    """--load the dying gasp: every later loss equals the fault-free run's, bit for bit (float.hex),
    and every shard equals its twin after each step.
    (Both with HA on: without replicas the optimizer shards and reduces differently, so the bits
    differ from the first step; a plain run's resume is checked in test_resume_with_half_the_dp_size.)"""
    it = int((ck / "latest_checkpointed_iteration.txt").read_text())
    proc = job(log_dir, nproc, extra=("--load", str(ck), "--ha-verify-replicas-interval", "1", *extra), backend=backend)
    assert_ok(proc)
    got = losses(log_dir)
    assert sorted(got) == list(range(it + 1, ITERS + 1)), got
    assert got == {i: want[i] for i in got}
    twins_agree(log_dir, [])  # each shard was written once; both of its holders loaded the same bits
    return got


@pytest.fixture
def ref(references):
    """The fault-free runs, DP=4 and TP=2 x DP=4 (shared with the other drills of the session)."""
    return references.tiny_layouts()


# Every phase on one backend in CI (gloo, or the one with NCCL's semantics), the other with
# MINDSPEED_HA_TEST_ALL=1.
@pytest.mark.parametrize("phase,backend", [
    on("forward", "gloo"), on("backward", "emulated_nccl"), on("grad-sync", "emulated_nccl"),
    pytest.param("optimizer", "gloo", marks=[pytest.mark.compat, pytest.mark.megatron_release]), on("param-sync", "emulated_nccl"),
    extended("forward", "emulated_nccl"), extended("backward", "gloo"), extended("grad-sync", "gloo"),
    extended("optimizer", "emulated_nccl"), extended("param-sync", "gloo")])
def test_kill_each_phase_dp4(tmp_path, ref, phase, backend):
    ck = tmp_path / "ck"
    proc = job(tmp_path / "run", inject=f"kill:rank=1:step=6:phase={phase}", extra=("--save", str(ck)), backend=backend)
    saved = check_saved(proc, tmp_path / "run", ck)
    # Nothing of a completed step is lost: 6 if every shard's update of step 6 finished somewhere, else 5.
    # (Or 4, when rank 1 took the last message of step 5's collective with it: its twin was still
    # inside step 5, so that shard exists at 4 only, and the survivors that finished step 5 step back.)
    plan = [e for e in events(tmp_path / "run", "controller") if e["event"] == "dump_plan"][-1]
    assert saved["iteration"] in (5, 6) or (saved["iteration"] == 4 and plan["ahead"])
    assert 1 not in saved["survivors"]
    if phase in ("forward", "backward", "grad-sync"):
        assert saved["iteration"] == 5 - bool(plan["ahead"])  # the fault came before any update of step 6
    if phase == "param-sync":
        assert saved["iteration"] == 6  # every update of step 6 had finished
    check_curve(tmp_path / "run", saved["iteration"], ref["dp4"])
    check_resume(tmp_path / "resume", ck, ref["dp4"], backend=backend)


# (every phase at DP=4 in CI; at TP=2 x DP=4 the update and the parameter all-gather, where a shard
# may be newer on some ranks than others)
@pytest.mark.parametrize("phase,rank", [extended("forward", 3), extended("grad-sync", 5), ("optimizer", 1),
                                        extended("backward", 6), ("param-sync", 2)])
def test_kill_each_phase_tp2_dp4(tmp_path, ref, phase, rank):
    """8 ranks, TP=2 x DP=4: replica groups are per TP rank; the lost rank's TP peer is a survivor
    that cannot write the lost shard, its DP replica does."""
    ck = tmp_path / "ck"
    proc = job(tmp_path / "run", 8, inject=f"kill:rank={rank}:step=5:phase={phase}",
               extra=("--save", str(ck), *TP2))
    saved = check_saved(proc, tmp_path / "run", ck)
    assert rank not in saved["ranks"] and len(saved["ranks"]) == 4
    check_curve(tmp_path / "run", saved["iteration"], ref["tp2"])
    check_resume(tmp_path / "resume", ck, ref["tp2"], 8, TP2)


@pytest.mark.parametrize("layout,phase,rank", [
    # (CI: the phases a pipeline adds, the update, and one of each other layout; the rest as at DP=4)
    extended("pp2", "forward", 3), ("pp2", "backward", 1), extended("pp2", "grad-sync", 1), ("pp2", "optimizer", 2),
    extended("pp2", "param-sync", 3), ("pp2", "pipeline-send", 1), ("pp2", "pipeline-recv", 2),
    extended("vpp2", "backward", 1), ("vpp2", "pipeline-recv", 3), ("moe", "optimizer", 2)])
def test_kill_in_a_model_parallel_job_its_dying_gasp_resumes_bit_identically(tmp_path, references, layout, phase,
                                                                             rank):
    """PP=2 x DP=2, plain or interleaved (two chunks a stage): a rank killed at each phase, the
    pipeline's own send and receive included, on one stage or the other (rank 0, which hosts the
    controller, aside: a standby's dump has a test of its own); MoE (4 experts, EP=2) x DP=4, a
    rank killed inside its chained dense and expert update (each data-parallel rank has an RNG
    state of its own there: its twin's stands in). The survivors' dying gasp (each stage's shards
    from their twins) loads into a fresh job of the same layout, every later loss bit-identical."""
    flags = TINY_LAYOUTS[layout][1]
    ck = tmp_path / "ck"
    proc = job(tmp_path / "run", inject=f"kill:rank={rank}:step=6:phase={phase}", extra=("--save", str(ck), *flags))
    saved = check_saved(proc, tmp_path / "run", ck)
    assert rank not in saved["survivors"]
    check_resume(tmp_path / "resume", ck, references.tiny(layout), 4, flags)


@pytest.mark.parametrize("phase,rank,backend", [
    extended("forward", 1, "gloo"), on("backward", 2, "emulated_nccl"), on("grad-sync", 3, "gloo"),
    on("optimizer", 1, "emulated_nccl"), on("param-sync", 2, "gloo"), extended("forward", 1, "emulated_nccl"),
    extended("backward", 2, "gloo"), extended("grad-sync", 3, "emulated_nccl"), extended("optimizer", 1, "gloo"),
    extended("param-sync", 2, "emulated_nccl")])
def test_hang_at_every_phase_under_retry_ends_in_the_dump(tmp_path, ref, phase, rank, backend):
    """A hung rank cannot be repaired in place: under retry the survivors write the dying-gasp
    checkpoint without it (it is not even asked), the diagnosis names the hang — that rank alone:
    the others, blocked in a collective, said they were waiting (on NCCL's semantics too, where the
    wait is a stream's) — and it resumes."""
    ck = tmp_path / "ck"
    proc = job(tmp_path / "run", inject=f"hang:rank={rank}:step=6:phase={phase}",
               extra=("--save", str(ck), "--enable-hbmfault-repair", "--ha-hang-timeout", "3"), backend=backend)
    saved = check_saved(proc, tmp_path / "run", ck)
    faults = [e for e in events(tmp_path / "run", "controller") if e["event"] == "fault"]
    assert rank not in saved["survivors"] and saved["iteration"] in (5, 6), faults
    assert [(f["kind"], f["ranks"]) for f in faults] == [("hang", [rank])], faults
    assert f"rank {rank} (node" in proc.stderr and "failed: hang" in proc.stderr
    if phase in ("forward", "optimizer"):
        check_resume(tmp_path / "resume", ck, ref["dp4"], backend=backend)


def test_resume_with_half_the_dp_size(tmp_path, ref):
    """The dying gasp is a standard dp-reshardable checkpoint: a plain run (HA off, no replicas)
    loads it with DP=2 instead of 4 (same global batch) and trains on where the fault-free run did
    (close, not bit-equal: the reductions run in another order)."""
    ck = tmp_path / "ck"
    proc = job(tmp_path / "run", inject="kill:rank=2:step=4:phase=backward", extra=("--save", str(ck)))
    it = check_saved(proc, tmp_path / "run", ck)["iteration"]
    proc = job(tmp_path / "half", 2, extra=("--load", str(ck), "--global-batch-size", "8"), ha=False)
    assert_ok(proc)
    got = losses(tmp_path / "half")
    assert sorted(got) == list(range(it + 1, ITERS + 1))
    for i, v in got.items():
        assert math.isclose(float.fromhex(v), float.fromhex(ref["dp4"][i]), rel_tol=1e-3), (i, v, ref["dp4"][i])


def test_replica_pair_lost_refuses_cleanly(tmp_path):
    """Ranks 1 and 3 hold the two replicas of one shard: nothing may be written; the message names
    the lost shard and the newest periodic checkpoint, which stays the one --load picks."""
    ck = tmp_path / "ck"
    proc = job(tmp_path / "run", inject="kill:rank=1:step=5:phase=forward,kill:rank=3:step=5:phase=forward",
               extra=("--save", str(ck), "--save-interval", "2"))
    assert proc.returncode != 0
    refused = [e for e in events(tmp_path / "run", "controller") if e["event"] == "dump_refused"]
    assert refused and refused[0]["missing"] == [[1, 3]], refused
    assert "dying-gasp checkpoint refused, nothing written" in proc.stderr
    assert "[1, 3]" in proc.stderr and f"iteration 4 in {ck}/iter_0000004" in proc.stderr
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def test_kill_during_periodic_save(tmp_path, ref):
    """A rank lost at the start of the periodic save of iteration 4: the previous checkpoint (2)
    is intact, and the survivors' dying gasp writes iteration 4 itself."""
    ck = tmp_path / "ck"
    proc = job(tmp_path / "run", inject="kill:rank=1:step=4:phase=checkpoint",
               extra=("--save", str(ck), "--save-interval", "2"))
    saved = check_saved(proc, tmp_path / "run", ck)
    assert saved["iteration"] == 4
    periodic = json.loads((ck / "iter_0000002" / "ha_manifest.json").read_text())
    assert (periodic["kind"], periodic["iteration"]) == ("periodic", 2)
    gasp = json.loads((ck / "iter_0000004" / "ha_manifest.json").read_text())
    assert (gasp["kind"], gasp["iteration"]) == ("dying_gasp", 4)
    check_resume(tmp_path / "resume", ck, ref["dp4"])


def test_kill_rank0_backup_controller_drives_the_dump(tmp_path, ref):
    ck = tmp_path / "ck"
    proc = job(tmp_path / "run", inject="kill:rank=0:step=6:phase=backward", extra=("--save", str(ck)))
    ctl = events(tmp_path / "run", "controller")
    takeover = [e for e in ctl if e["event"] == "takeover"]
    assert takeover and takeover[0]["rank"] != 0, proc.stderr[-3000:]
    saved = check_saved(proc, tmp_path / "run", ck)
    assert saved["iteration"] == 5 and saved["pid"] == takeover[0]["pid"]  # written under the backup
    assert 0 not in saved["survivors"] and 2 in saved["ranks"]  # rank 0's shard from its replica, rank 2
    check_resume(tmp_path / "resume", ck, ref["dp4"])


def test_cascading_fault_during_the_dump(tmp_path, ref):
    """Rank 1 lost in step 6's forward; during the dump of iteration 5 rank 2 dies too. Ranks 0 and 3
    still hold both shards: the controller stops the rest and retries over them (generation 2)."""
    ck = tmp_path / "ck"
    proc = job(tmp_path / "run", inject="kill:rank=1:step=6:phase=forward,kill:rank=2:step=5:phase=checkpoint",
               extra=("--save", str(ck)))
    saved = check_saved(proc, tmp_path / "run", ck)
    assert saved["iteration"] == 5 and saved["generation"] == 2 and saved["survivors"] == [0, 3]
    manifest = json.loads((ck / "iter_0000005" / "ha_manifest.json").read_text())
    assert manifest["survivors"] == [0, 3]
    check_resume(tmp_path / "resume", ck, ref["dp4"])
