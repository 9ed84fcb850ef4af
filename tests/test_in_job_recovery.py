"""In-job recovery end to end under `mindspeed-ha run`. Retry (UCE / communication fault): no
process restarts, the broken rank's shard comes back from its twin. Recover (a killed worker): only
that worker is restarted and joins the running job. Either way the failed step is recomputed (or
finished) and every iteration's loss equals the fault-free run's bit for bit."""
import statistics
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import (PRETRAIN, TINY, TINY_ITERS, TINY_LAYOUTS, all_rank_events, assert_ok, backend_env, clean_env, events,
                     extended, extended_test, free_port, losses, on, recomputed, twins_agree)

MINDSPEED_HA = [sys.executable, "-m", "mindspeed_ha.cli"]
ITERS = TINY_ITERS  # (the shared fault-free runs': references.tiny)
TP2 = ["--tensor-model-parallel-size", "2"]


def job(log_dir, nproc=4, inject=None, extra=(), timeout=240, backend="gloo"):
    """Twins are compared after every step (when there are twins): a recovery that leaves a shard one
    bit off its twin fails the test even where the loss would not show it yet. ``backend``: gloo, or
    the CPU backend with NCCL's semantics (its results are gloo's bits: the same references)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    verify = [] if "--distributed-optimizer-no-replica" in extra else ["--ha-verify-replicas-interval", "1"]
    cmd = MINDSPEED_HA + ["run", "--standalone", "--nproc-per-node", str(nproc), PRETRAIN, *TINY,
                          "--train-iters", str(ITERS), "--enable-hbmfault-repair", "--ha-log-dir", str(log_dir),
                          *verify, *extra]
    env = clean_env({**backend_env(backend), **({"MINDSPEED_HA_INJECT": inject} if inject else {})})
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(log_dir))


@pytest.fixture
def ref(references):
    """The fault-free runs, DP=4 and TP=2 x DP=4 (shared with the other drills of the session)."""
    return references.tiny_layouts()


def check_recovered(proc, log_dir, want, nproc=4, n: int | tuple = 1) -> list:
    """Exit 0, the same pid per rank all along, every loss bit-identical, ``n`` (or one of the
    counts ``n`` lists) `recovered` events."""
    assert_ok(proc)
    starts = [e for e in all_rank_events(log_dir) if e["event"] == "start"]
    assert sorted(e["rank"] for e in starts) == list(range(nproc))  # nobody restarted
    assert losses(log_dir) == want
    rec = [e for e in events(log_dir, "controller") if e["event"] == "recovered"]
    assert len(rec) in (n if isinstance(n, tuple) else (n,)), [e for e in events(log_dir, "controller") if e["event"] in ("fault", "strategy", "strategy_failed")]
    for r in rec:
        assert r["strategy"] == "retry" and r["lost_steps"] == 0 and r["mttr_s"] > 0
        # (one order each: rebuild with repair, rollback with resume)
        assert {"detect", "stop", "rebuild+repair", "rollback+resume", "first_step"} <= set(r["phases"])
    twins_agree(log_dir, rec)
    return rec


# Several faults per job (each fires once, each is its own recovery): every phase is covered in two
# jobs instead of five. (rank, step, phase); rank 2's twin is 0, rank 1's is 3.
PHASE_JOBS = {
    "forward+grad-sync+param-sync": [(2, 2, "forward"), (1, 4, "grad-sync"), (2, 6, "param-sync")],
    "backward+optimizer": [(2, 3, "backward"), (3, 5, "optimizer")],
}
TWIN = {0: 2, 2: 0, 1: 3, 3: 1}


# Each phase job on one backend in CI, the other with MINDSPEED_HA_TEST_ALL=1.
@pytest.mark.parametrize("name,backend", [on("forward+grad-sync+param-sync", "gloo"),
                                          on("backward+optimizer", "emulated_nccl"),
                                          extended("forward+grad-sync+param-sync", "emulated_nccl"),
                                          extended("backward+optimizer", "gloo")])
def test_uce_each_phase_dp4(tmp_path, ref, name, backend):
    faults = PHASE_JOBS[name]
    proc = job(tmp_path, inject=",".join(f"uce:rank={r}:step={s}:phase={p}" for r, s, p in faults), backend=backend)
    rec = check_recovered(proc, tmp_path, ref["dp4"], n=len(faults))
    assert [(e["faults"][0]["ranks"], e["faults"][0]["kind"]) for e in rec] == \
        [([r], "memory-error") for r, _, _ in faults]
    # Each broken shard came back from its twin (a window left untouched may be copied too).
    repaired = [(e["rank"], e["sources"]) for e in all_rank_events(tmp_path) if e["event"] == "repaired"]
    for r, _, _ in faults:
        assert (r, [TWIN[r]]) in repaired, repaired
    # A survivor waiting in a collective the faulted rank never entered (its report's counts say so)
    # left it without waiting out the stop's grace; the losses above are the fault-free run's all the same.
    left = [e for e in all_rank_events(tmp_path) if e["event"] == "left_collective"]
    assert any(r in e.get("never_entered", []) for r, _, _ in faults for e in left), left


@extended_test  # (TP=2 x DP=4 in CI: test_ttp's dumps; retry and recover at DP=4 and in pipelines)
def test_uce_then_kill_tp2_dp4(tmp_path, ref):
    """8 ranks, TP=2 x DP=4: replica groups [0, 4], [2, 6] (TP rank 0) and [1, 5], [3, 7]. A memory
    error on rank 3 (retry), then rank 6 killed in its update (recover: it joins with its TP peer's
    groups rebuilt around it)."""
    proc = job(tmp_path, 8, inject="uce:rank=3:step=3:phase=backward,kill:rank=6:step=5:phase=optimizer",
               extra=TP2 + ["--enable-worker-reboot"])
    rec = check_rejoined(proc, tmp_path, ref["tp2"], [6], n=2, nproc=8)
    assert [e["strategy"] for e in rec] == ["retry", "recover"]


# Every drill phase on both stages of a pipeline (PP=2 x DP=2: ranks 0 and 1 are stage 0, which
# computes no loss; 2 and 3 stage 1), one fault a step from step 2: retry drills each phase on one
# stage, recover the same phase on the other. The pipeline's own sends and receives are phases too:
# the other stage is left blocked in the matching receive or send.
PIPELINE_PHASES = ("forward", "backward", "grad-sync", "optimizer", "param-sync", "pipeline-send", "pipeline-recv")


def pipeline_drills(first_stage: int) -> list[tuple[int, int, str]]:
    """(rank, step, phase): the stages alternate from ``first_stage``, and so do each stage's ranks."""
    return [(2 * ((first_stage + i) % 2) + (i // 2) % 2, i + 2, phase) for i, phase in enumerate(PIPELINE_PHASES)]


@pytest.mark.parametrize("layout,kind,backend", [
    on("pp2", "uce", "emulated_nccl"), extended("pp2", "kill", "emulated_nccl"), extended("vpp2", "uce", "gloo"),
    on("vpp2", "kill", "gloo"), extended("pp2", "uce", "gloo"), extended("pp2", "kill", "gloo"),
    extended("vpp2", "uce", "emulated_nccl"), extended("vpp2", "kill", "emulated_nccl")])
def test_every_phase_on_both_pipeline_stages(tmp_path, references, layout, kind, backend):
    """PP=2 x DP=2, 1F1B or interleaved (two one-layer chunks a stage): seven faults, one a step, each
    a recovery of its own (a memory error: retry; a kill: recover, only that worker restarts). Every
    drill fires where it is aimed, and every loss is bit-identical to the fault-free run's. The kills
    take the controller's host too (rank 0, then the standby that took over, ...): each time a
    standby takes over and restarts the lost rank in seconds (no hang). On gloo, and on the backend
    with NCCL's semantics (its collectives return at once; a stop aborts them)."""
    drills = pipeline_drills(0 if kind == "uce" else 1)
    proc = job(tmp_path, inject=",".join(f"{kind}:rank={r}:step={s}:phase={p}" for r, s, p in drills),
               extra=[*TINY_LAYOUTS[layout][1], "--enable-worker-reboot"], backend=backend)
    killed = [r for r, _, _ in drills] if kind == "kill" else []
    rec = check_rejoined(proc, tmp_path, references.tiny(layout), killed, n=None)
    assert {e["strategy"] for e in rec} == {"retry" if kind == "uce" else "recover"}
    ctl = events(tmp_path, "controller")
    drilled = "memory-error" if kind == "uce" else "process-exit"
    assert sorted((e["iteration"], e["ranks"]) for e in ctl if e["event"] == "fault" and e["kind"] == drilled) == \
        [(s, [r]) for r, s, _ in drills]
    if kind == "uce":  # (a fault in the first step after a recovery is recovered with it: one event for both)
        assert sorted((f["iteration"], f["ranks"]) for e in rec for f in e["faults"]) == [(s, [r]) for r, s, _ in drills]
    assert not [e for e in ctl if e["event"] == "fault" and e["kind"] == "hang"]
    assert kind == "uce" or len([e for e in ctl if e["event"] == "takeover"]) >= 2
    fired = sorted((e["iteration"], e["rank"], e["phase"]) for e in all_rank_events(tmp_path) if e["event"] == "inject")
    assert fired == [(s, r, p) for r, s, p in drills]


def test_a_stage_twin_that_ended_the_step_goes_back_with_the_job(tmp_path, references):
    """PP=2 x DP=2, an optimizer instance per DP rank: ranks 0 and 2 (one instance) get through step 6's
    grad-norm all-reduce and rank 1, held in its update window, never enters its own (nor does rank 3,
    its partner there); rank 0's memory error in the parameter sync comes after rank 2 ended step 6. The
    job can only resume at 5 (stage 0's good copy is rank 1's), so rank 2 goes back a step it ended: its
    twin's shard and its twin's counters, scheduler and RNG, as a restarted rank takes them. One retry,
    every loss bit-identical, twins equal after every step."""
    # (rank 0 waits 1.9 s before its memory error, so that rank 2 has ended the step when it comes;
    # rank 1 waits 3.9 s; from step 7 both take their steps at full speed again)
    inject = ("slow:rank=1:step=6:phase=optimizer:factor=40,slow:rank=0:step=6:phase=param-sync:factor=20,"
              "uce:rank=0:step=6:phase=param-sync,slow:rank=0:step=7:phase=forward:factor=1,"
              "slow:rank=1:step=7:phase=forward:factor=1")
    proc = job(tmp_path, inject=inject, extra=[*TINY_LAYOUTS["pp2"][1]])
    rec = check_rejoined(proc, tmp_path, references.tiny("pp2"), [], n=1)
    assert rec[0]["strategy"] == "retry" and rec[0]["iteration"] == 5
    (plan,) = [e for e in events(tmp_path, "controller") if e["event"] == "restore_plan"]
    # (rank 0's poisoned shard is past 5 too, its counters are not: its twin's are the same)
    assert plan["pairs"] == [1, 0, 3, 2] and plan["joiners"] == [0, 1, 2, 3], plan
    assert [e["iteration"] for e in events(tmp_path, "rank_2") if e["event"] == "step"].count(6) == 2


@pytest.mark.parametrize("layout", [extended("moe"), "overlap"])  # (MoE in CI: Megatron-LM's loop's drill)
def test_moe_and_overlapped_communication_under_retry_and_recover(tmp_path, references, layout):
    """MoE (4 experts, EP=2) x DP=4, whose optimizer is chained (dense, expert); or DP=4 with the
    grad reduction and the parameter all-gather overlapped with compute (both --overlap flags). A
    memory error on rank 1 in its backward (retry), then rank 2 killed inside its update (recover):
    every loss bit-identical to the fault-free run's of the same layout."""
    proc = job(tmp_path, inject="uce:rank=1:step=3:phase=backward,kill:rank=2:step=6:phase=optimizer",
               extra=[*TINY_LAYOUTS[layout][1], "--enable-worker-reboot"])
    rec = check_rejoined(proc, tmp_path, references.tiny(layout), [2], n=2)
    assert [e["strategy"] for e in rec] == ["retry", "recover"]


@pytest.mark.compat
@pytest.mark.megatron_release
def test_two_uces_in_different_replica_pairs_at_once(tmp_path, ref):
    """Both faults in one recovery, or, where the stop that rank 2's fault caused reached rank 1 before
    its own backward (a loaded machine), rank 1's in the recomputed step: a second recovery. Either
    way each shard comes from its twin and every loss is the fault-free run's."""
    proc = job(tmp_path, inject="uce:rank=1:step=3:phase=backward,uce:rank=2:step=3:phase=backward")
    rec = check_recovered(proc, tmp_path, ref["dp4"], n=(1, 2))
    assert sorted(r for e in rec for f in e["faults"] for r in f["ranks"]) == [1, 2]
    repaired = {e["rank"]: e["sources"] for e in all_rank_events(tmp_path) if e["event"] == "repaired"}
    assert repaired == {1: [3], 2: [0]}


def test_comm_fault_retry(tmp_path, ref):
    """Communicators of rank 1 torn down (gloo: its groups destroyed) with every rank alive: groups
    rebuilt, step recomputed, nothing copied."""
    proc = job(tmp_path, inject="comm:rank=1:step=4:phase=backward")
    rec = check_recovered(proc, tmp_path, ref["dp4"])
    assert {f["kind"] for f in rec[0]["faults"]} == {"comm-failure"}
    assert not [e for e in all_rank_events(tmp_path) if e["event"] == "repaired"]


@pytest.mark.megatron_release
def test_no_replica_fallback_reloads_in_process(tmp_path):
    """--distributed-optimizer-no-replica: nothing holds a second copy of a shard, so every rank
    reloads the newest periodic checkpoint in process (no restart); the event counts the lost steps,
    and the recomputed steps have the fault-free run's loss bits. Then, under recover, rank 1 is
    killed: only it restarts, and it reloads the checkpoint together with the survivors."""
    extra = ("--distributed-optimizer-no-replica", "--save", str(tmp_path / "ck"), "--save-interval", "3",
             *ARF)
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(job, tmp_path / "ref", 4, None, ("--distributed-optimizer-no-replica",))
        proc = job(tmp_path / "run", inject="uce:rank=2:step=5:phase=backward,kill:rank=1:step=8:phase=forward",
                   extra=extra)
        assert_ok(ref.result())
    assert_ok(proc)
    run = tmp_path / "run"
    assert sorted(e["rank"] for e in all_rank_events(run) if e["event"] == "start") == [0, 1, 1, 2, 3]
    assert losses(run) == losses(tmp_path / "ref")
    # Steps 4 and 7 run twice each, with the same loss bits; but where rank 0 (which logs the loss) was
    # still inside one when the stop came (a loaded host: it left a collective of that step that the
    # faulted rank had passed), that step's first run ended in the stop, not in a loss.
    cut = {e["iteration"] for e in events(run, "rank_0") if e["event"] == "left_collective"}
    assert recomputed(run) == [s for s in (4, 7) if s not in cut], cut
    rec = [e for e in events(run, "controller") if e["event"] == "recovered"]
    assert [(e["strategy"], e["how"], e["iteration"], e["lost_steps"]) for e in rec] == [
        ("retry", "reload", 3, 1), ("recover", "reload", 6, 1)]
    assert sorted(e["iteration"] for e in all_rank_events(run) if e["event"] == "load") == [3] * 4 + [6] * 4


def test_report_table_and_timeline(tmp_path):
    """`mindspeed-ha report DIR` on a job with two recoveries: one row each, and the picture."""
    proc = job(tmp_path, inject="uce:rank=2:step=2:phase=backward,comm:rank=3:step=5:phase=forward")
    assert_ok(proc)
    rep = subprocess.run(MINDSPEED_HA + ["report", str(tmp_path)], env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert rep.returncode == 0, rep.stderr
    rows = [ln for ln in rep.stdout.splitlines() if ln.strip()[:2].strip().isdigit()]
    assert len(rows) == 2, rep.stdout
    assert "rank 2 memory-error" in rows[0] and "recovered" in rows[0] and "retry" in rows[0]
    assert "comm-failure" in rows[1] and "recovered" in rows[1]
    png = tmp_path / "recovery_timeline.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- recover (ARF): kill a worker, only it restarts -------------------------------------------------
ARF = ("--enable-worker-reboot",)
KILL_JOBS = {  # (kind, rank, step, phase); ecc: CUDA's process-fatal error, the rank exits and is replaced
    "forward+grad-sync+param-sync": [("kill", 1, 2, "forward"), ("kill", 2, 4, "grad-sync"), ("kill", 1, 6, "param-sync")],
    "backward+optimizer+ecc": [("kill", 2, 3, "backward"), ("kill", 3, 5, "optimizer"), ("ecc", 1, 7, "backward")],
}


def check_rejoined(proc, log_dir, want, killed: list[int], n: int | None, nproc=4) -> list:
    """Exit 0, exactly one new pid per kill (on the killed rank), every loss bit-identical, one
    `recovered` event per recovery (``n``; None: a controller's host was killed right after a
    recovery, whose end that controller had not heard yet), 0 lost steps."""
    assert_ok(proc)
    evs = all_rank_events(log_dir)
    pids = Counter(r for r, _ in {(e["rank"], e["pid"]) for e in evs if e["event"] == "start"})
    assert pids == Counter(range(nproc)) + Counter(killed), pids
    assert losses(log_dir) == want
    rec = [e for e in events(log_dir, "controller") if e["event"] == "recovered"]
    assert n is None or len(rec) == n, \
        [e for e in events(log_dir, "controller") if e["event"] in ("fault", "strategy", "strategy_failed")]
    for r in rec:
        assert r["lost_steps"] == 0 and r["mttr_s"] > 0
        if r["strategy"] == "recover":
            # (a restarted rank joins: its rebuild and repair are two orders)
            assert {"restart", "rebuild", "repair", "rollback+resume", "first_step"} <= set(r["phases"])
    twins_agree(log_dir, rec)
    return rec


@pytest.mark.parametrize("name,backend", [on("forward+grad-sync+param-sync", "emulated_nccl"),
                                          on("backward+optimizer+ecc", "gloo"),
                                          extended("forward+grad-sync+param-sync", "gloo"),
                                          extended("backward+optimizer+ecc", "emulated_nccl")])
def test_kill_each_phase_dp4_restarts_only_that_worker(tmp_path, ref, name, backend):
    faults = KILL_JOBS[name]
    proc = job(tmp_path, inject=",".join(f"{k}:rank={r}:step={s}:phase={p}" for k, r, s, p in faults), extra=ARF,
               backend=backend)
    rec = check_rejoined(proc, tmp_path, ref["dp4"], [r for _, r, _, _ in faults], n=len(faults))
    assert [e["strategy"] for e in rec] == ["recover"] * len(faults)
    # The newcomer's shard came from its twin.
    repaired = [(e["rank"], e["sources"]) for e in all_rank_events(tmp_path) if e["event"] == "repaired"]
    for _, r, _, _ in faults:
        assert (r, [TWIN[r]]) in repaired, repaired
    fatal = [e for e in events(tmp_path, "controller") if e["event"] == "fault" and "process-fatal" in e["detail"]]
    assert [f["ranks"] for f in fatal] == [[r] for k, r, _, _ in faults if k == "ecc"]


@pytest.mark.compat
@pytest.mark.megatron_release
def test_uce_then_kill_retry_and_recover_in_one_job(tmp_path, ref):
    """The issue's acceptance run: a memory error repaired in place, then a killed worker restarted."""
    proc = job(tmp_path, inject="uce:rank=2:step=4:phase=backward,kill:rank=1:step=7:phase=optimizer", extra=ARF)
    rec = check_rejoined(proc, tmp_path, ref["dp4"], [1], n=2)
    assert [e["strategy"] for e in rec] == ["retry", "recover"]
    # Rank 1's new process was the agent's pre-started spare.
    starts = [e for e in events(tmp_path, "agent_0") if e["event"] == "worker_start" and e.get("restarts")]
    assert [(e["worker_rank"], e.get("spare")) for e in starts] == [(1, True)]


@pytest.mark.alone  # (asserts a latency)
def test_back_to_back_kills_on_one_node_each_take_a_warm_spare(tmp_path, ref):
    """Two workers of one node killed a step apart, with --ha-spares 2: each restart is a spare that
    had finished its start-up (a fork of the agent's spare template), each used one is replaced at
    once, and the controller decides without a fixed wait."""
    proc = job(tmp_path, inject="kill:rank=1:step=3:phase=backward,kill:rank=2:step=4:phase=forward",
               extra=(*ARF, "--ha-spares", "2"))
    rec = check_rejoined(proc, tmp_path, ref["dp4"], [1, 2], n=2)
    assert [e["strategy"] for e in rec] == ["recover", "recover"]
    agent = events(tmp_path, "agent_0")
    starts = [e for e in agent if e["event"] == "worker_start" and e.get("restarts")]
    assert [(e["worker_rank"], e.get("spare"), e.get("warm")) for e in starts] == [(1, True, True), (2, True, True)]
    spares = [e for e in agent if e["event"] == "spare_start"]
    assert len(spares) == 4 and all(e["forked"] for e in spares)  # two, and one replacement per use
    assert {e["worker_pid"] for e in starts} <= {e["worker_pid"] for e in spares}
    for r in rec:  # a killed rank's exit report is the cause: no dwell between the stop and the decision
        assert r["phases"]["stop"] < 1.0, r["phases"]


RANK0_KILLS = [(2, "forward"), (3, "backward"), (5, "grad-sync"), (6, "optimizer"), (7, "param-sync")]


def test_kill_rank0_each_phase_backup_controller_restarts_it(tmp_path, ref):
    """Rank 0 hosts the controller: killed in step 2, the backup takes over, has rank 0 restarted,
    and the restarted rank 0 joins without starting a controller of its own. Then rank 0 is killed
    again in each other phase: one new pid per kill, losses bit-identical, 0 lost steps."""
    proc = job(tmp_path, inject=",".join(f"kill:rank=0:step={s}:phase={p}" for s, p in RANK0_KILLS), extra=ARF)
    rec = check_rejoined(proc, tmp_path, ref["dp4"], [0] * len(RANK0_KILLS), n=len(RANK0_KILLS))
    assert [e["strategy"] for e in rec] == ["recover"] * len(RANK0_KILLS)
    takeovers = [e for e in all_rank_events(tmp_path) if e["event"] == "takeover"] + \
        [e for e in events(tmp_path, "controller") if e["event"] == "takeover"]
    assert takeovers, "no backup controller took over"


def test_controller_rank_lost_after_recovered_faults_only_its_loss_is_recovered(tmp_path, ref):
    """A memory error on rank 2 and a communication fault on rank 1 (retry), rank 3 killed (recover),
    each recovered; then rank 0, the controller's own process, is killed in its update. The standby
    that takes over is not told of the recovered faults again (a controller settles each report it
    recovered, and the links stop re-sending it), so it recovers rank 0's loss alone: rank 2, whose
    shard a memory error once corrupted and its twin's copy repaired, serves shard [0, 2]. Losses
    bit-identical."""
    inject = ("uce:rank=2:step=2:phase=backward,comm:rank=1:step=3:phase=grad-sync,"
              "kill:rank=3:step=4:phase=forward,kill:rank=0:step=6:phase=optimizer")
    proc = job(tmp_path, inject=inject, extra=ARF)
    rec = check_rejoined(proc, tmp_path, ref["dp4"], [3, 0], n=4)
    assert [e["strategy"] for e in rec] == ["retry", "retry", "recover", "recover"]
    ctl = events(tmp_path, "controller")
    (takeover,) = [e for e in ctl + all_rank_events(tmp_path) if e["event"] == "takeover"]
    # What the new controller is told: rank 0's exit and what it broke in the survivors' collectives
    # of step 6 or later; none of the faults of steps 2 to 4 again.
    told = [(e["ranks"], e["kind"], e["iteration"]) for e in ctl if e["event"] == "fault" and e["pid"] == takeover["pid"]]
    assert ([0], "process-exit", 6) in told and all(it >= 6 for _, _, it in told), told
    assert all(f["iteration"] >= 6 for f in rec[-1]["faults"]) and rec[-1]["strategy"] == "recover"


def test_node_lost_replacement_agent_joins(tmp_path, ref):
    """Two agents as two nodes (2 workers each). Node 1 is lost while its rank 3 hangs in step 4: its
    agent is stopped (SIGSTOP: alive, silent, as on the far side of a partition; a worker whose agent
    is gone ends itself), rank 2 killed, rank 3 stopped (alive, silent, out of anyone's reach).
    Nobody reports an exit, so the controller finds the ranks lost by their silence and waits for a
    replacement node. The old rank 3 is continued (SIGCONT) while the controller waits, as after a
    healed partition: its messages carry a retired incarnation, so the controller tells it to exit.
    Then `mindspeed-ha run` started again with --node-rank 1 sees the job running and starts its
    workers as joiners. Losses bit-identical. (The old process comes back before the job's end on
    purpose: a job of nine steps ends 0.2 s after its recovery, before a process continued then would
    have sent anything.)"""
    import os
    import signal
    import time
    port = free_port()
    keys = tmp_path / "keys"
    subprocess.run(MINDSPEED_HA + ["keygen", str(keys)], check=True, capture_output=True)
    env = clean_env({"MINDSPEED_HA_INJECT": "hang:rank=3:step=4:phase=forward", "MINDSPEED_HA_KEY_DIR": str(keys)})

    def agent(node_rank: int, tag: str) -> subprocess.Popen:
        out = open(tmp_path / f"agent{tag}.out", "w")
        cmd = MINDSPEED_HA + ["run", "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "2",
                              "--master-addr", "127.0.0.1", "--master-port", str(port), PRETRAIN, *TINY,
                              "--train-iters", str(ITERS), "--enable-hbmfault-repair", *ARF, "--ha-log-dir", str(tmp_path),
                              "--ha-verify-replicas-interval", "1"]
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(tmp_path))

    def wait_for(pred, what: str, timeout: float = 120.0):
        t = time.monotonic()
        while not pred():
            assert time.monotonic() - t < timeout, f"timed out waiting for {what}; see {tmp_path}/agent*.out"
            time.sleep(0.2)

    node0 = agent(0, "0")
    node1 = agent(1, "1")
    workers = {}
    try:
        wait_for(lambda: any(e["event"] == "inject" for e in events(tmp_path, "rank_3")), "rank 3 to hang")
        workers = {e["worker_rank"]: e["worker_pid"] for e in events(tmp_path, "agent_1") if e["event"] == "worker_start"}
        node1.send_signal(signal.SIGSTOP)
        os.kill(workers[2], signal.SIGKILL)
        os.kill(workers[3], signal.SIGSTOP)
        wait_for(lambda: any(e["event"] == "restart" for e in events(tmp_path, "controller")), "the recovery")
        restart = next(e for e in events(tmp_path, "controller") if e["event"] == "restart")
        assert restart["awaiting_node"] == [2, 3] and restart["ranks"] == []
        os.kill(workers[3], signal.SIGCONT)
        wait_for(lambda: not alive_pid(workers[3]), "the old rank 3 to exit", timeout=30)
        node1.kill()
        node1.wait(30)
        replacement = agent(1, "1b")
        assert replacement.wait(240) == 0, (tmp_path / "agent1b.out").read_text()[-3000:]
        assert node0.wait(60) == 0, (tmp_path / "agent0.out").read_text()[-3000:]
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
        if 3 in workers and alive_pid(workers[3]):
            os.kill(workers[3], signal.SIGKILL)
    rec = check_rejoined(subprocess.CompletedProcess([], 0, "", ""), tmp_path, ref["dp4"], [2, 3], n=1)
    assert rec[0]["strategy"] == "recover"
    assert {f["kind"] for f in rec[0]["faults"]} >= {"heartbeat-lost"}
    fenced = [e for e in events(tmp_path, "controller") if e["event"] == "fenced"]
    assert [(e["rank"], e["pid"]) for e in fenced] == [(3, workers[3])]


def test_fault_during_recovery_restarts_it_with_both_faults(tmp_path, ref):
    """A memory error on rank 1 in step 5; rank 2 dies as it starts serving that recovery. The
    recovery starts over with both faults: retry cannot bring back a process, so recover restarts
    rank 2, and both shards come from their twins."""
    proc = job(tmp_path, inject="uce:rank=1:step=5:phase=backward,kill:rank=2:step=5:phase=recovery", extra=ARF)
    rec = check_rejoined(proc, tmp_path, ref["dp4"], [2], n=1)
    assert rec[0]["strategy"] == "recover"
    assert {(tuple(f["ranks"]), f["kind"]) for f in rec[0]["faults"]} >= {((1,), "memory-error"), ((2,), "process-exit")}
    repaired = {e["rank"]: e["sources"] for e in all_rank_events(tmp_path) if e["event"] == "repaired"}
    assert repaired == {1: [3], 2: [0]}


@pytest.mark.alone  # (asserts a latency)
def test_a_rank_lost_while_the_others_rebuild_their_communicators(tmp_path, ref):
    """A memory error on rank 2 in step 5; rank 1 dies as it starts the rebuild of that recovery, so
    the others wait for it in their communicators' rendezvous. They leave it at the controller's stop
    (gloo's own connect would hold them for its whole timeout, deaf to the controller), and the
    recovery starts over with both faults: rank 1 restarted, rank 2 repaired, every loss the same."""
    proc = job(tmp_path, inject="uce:rank=2:step=5:phase=backward,kill:rank=1:step=5:phase=rebuild", extra=ARF)
    rec = check_rejoined(proc, tmp_path, ref["dp4"], [1], n=1)
    assert rec[0]["strategy"] == "recover"
    assert {(tuple(f["ranks"]), f["kind"]) for f in rec[0]["faults"]} >= {((2,), "memory-error"), ((1,), "process-exit")}
    assert rec[0]["mttr_s"] < 20, rec[0]  # not the rebuild's 60 s timeout


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="a rank lost past a connect's open gate holds its peers in the backend's connect "
                          "until its timeout (docs/control-plane.md): not fixed yet")
def test_a_rank_lost_as_its_peers_connect_to_it_in_the_rebuild(tmp_path, ref):
    """A memory error on rank 2 in step 5; rank 1 dies in that recovery's rebuild just as it passes a
    remade communicator's open gate: its peers have found every member there and go into the
    backend's connect, to a rank that is gone. What a recovery should do: start over with both faults,
    rank 1 restarted, rank 2 repaired, every loss the same. What it does today: rank 0 sits in gloo's
    connect until its timeout, the status round takes it for hung, recover replaces it, and with rank
    2's shard poisoned no holder is left for theirs: the job ends (strict: this test says so the day
    it is fixed)."""
    proc = job(tmp_path, inject="uce:rank=2:step=5:phase=backward,kill:rank=1:step=5:phase=connect", extra=ARF)
    fired = [e for e in all_rank_events(tmp_path) if e["event"] == "inject" and e.get("phase") == "connect"]
    if [e["rank"] for e in fired] != [1]:  # (the drill's point was not reached: not the known failure)
        raise RuntimeError(f"the connect point fired on {fired}")
    rec = check_rejoined(proc, tmp_path, ref["dp4"], [1], n=1)
    assert rec[0]["strategy"] == "recover"
    assert {(tuple(f["ranks"]), f["kind"]) for f in rec[0]["faults"]} >= {((2,), "memory-error"), ((1,), "process-exit")}
    assert rec[0]["mttr_s"] < 10, rec[0]  # not a connect's timeout


def test_a_rank_whose_rebuild_fails_in_the_merged_order_is_rebuilt_again_and_nobody_waits_for_it(tmp_path, ref):
    """A memory error on rank 2 in step 5; rank 1's rebuild raises (rebuild and repair are one order).
    Its failed answer is a new fault at once, and the others leave their rebuild at the stop. Rank 2
    comes to its rebuild 0.3 s late (``slow``), so ranks 0 and 3 are waiting for it in a connect when
    the stop comes, and leave; rank 2 then finds them named in that connect's rendezvous, but not
    coming: it must not connect (it sat in gloo's connect for 30 s, until the hang limit had it
    restarted). The recovery starts over with both faults; recover takes a fault of kind "other", and
    rank 1's process is alive, so it is rebuilt in place, not restarted. Every loss the same."""
    proc = job(tmp_path, inject="uce:rank=2:step=5:phase=backward,exception:rank=1:step=5:phase=rebuild,"
               "slow:rank=2:step=5:phase=rebuild:factor=4,slow:rank=2:step=6:phase=forward:factor=1", extra=ARF)
    assert_ok(proc)
    assert losses(tmp_path) == ref["dp4"]
    assert sorted(e["rank"] for e in all_rank_events(tmp_path) if e["event"] == "start") == [0, 1, 2, 3]
    faults = [e for e in events(tmp_path, "controller") if e["event"] == "fault"]
    assert [(e["ranks"], e["kind"], e["phase"]) for e in faults] == \
        [([2], "memory-error", "backward"), ([1], "other", "recovery")], faults
    assert faults[1]["detail"].startswith("rebuild+repair failed (rank 1: rebuild: InjectedError"), faults[1]
    rec = [e for e in events(tmp_path, "controller") if e["event"] == "recovered"]
    assert [(e["strategy"], e["lost_steps"]) for e in rec] == [("recover", 0)], rec
    assert rec[0]["time"] - faults[0]["time"] < 10, (rec, faults)  # (not a connect's 30 s timeout)
    twins_agree(tmp_path, rec)


def test_a_memory_error_in_a_ranks_rebuild_is_retried_with_the_first(tmp_path, ref):
    """A memory error on rank 2 in step 5, and another on rank 1 in its rebuild for that recovery (in
    the merged rebuild+repair order). Rank 1's failed answer names its fault's kind, so the new fault
    is a memory error, which retry takes: the recovery starts over with both, each shard comes back
    from its twin, nobody restarts, every loss the same (a failure of kind "other" would leave only
    the dump, under retry alone)."""
    proc = job(tmp_path, inject="uce:rank=2:step=5:phase=backward,uce:rank=1:step=5:phase=rebuild")
    rec = check_recovered(proc, tmp_path, ref["dp4"])
    faults = [e for e in events(tmp_path, "controller") if e["event"] == "fault"]
    assert [(e["ranks"], e["kind"], e["phase"]) for e in faults] == \
        [([2], "memory-error", "backward"), ([1], "memory-error", "recovery")], faults
    assert {(tuple(f["ranks"]), f["kind"]) for f in rec[0]["faults"]} == {((2,), "memory-error"), ((1,), "memory-error")}
    repaired = {e["rank"]: e["sources"] for e in all_rank_events(tmp_path) if e["event"] == "repaired"}
    assert repaired[1] == [TWIN[1]] and repaired[2] == [TWIN[2]], repaired


@extended_test
def test_twelve_repairs_leave_fds_and_threads_flat(tmp_path):
    """Twelve in-place repairs in one job (memory errors on every rank at every phase, and broken
    communicators): each replaces every communicator, and the replaced ones are released, so each
    rank ends with no more open files and threads than it typically had after a repair (the median of
    the twelve snapshots: each is taken while replaced communicators may still be going, so any one
    of them, the first too, can sit a few dozen low or high; a leak of one file per repair would put
    the end six above the median). A recovery whose releases were still going when the job ended is
    reported then, as unsettled: one report per recovery all the same. Losses stay the fault-free run's."""
    phases = ["forward", "backward", "grad-sync", "optimizer", "param-sync"]
    steps = range(2, 26, 2)  # each fault two steps after the last: twelve recoveries, not merged ones
    faults = [f"comm:rank={i % 4}:step={s}:phase=backward" if i % 4 == 3 else
              f"uce:rank={i % 4}:step={s}:phase={phases[i % 5]}" for i, s in enumerate(steps)]
    extra = ("--train-iters", "26")
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(job, tmp_path / "ref", 4, None, extra)
        proc = job(tmp_path / "run", inject=",".join(faults), extra=extra, timeout=400)
        assert_ok(ref.result())
    run = tmp_path / "run"
    rec = check_recovered(proc, run, losses(tmp_path / "ref"), n=12)
    assert sorted({f["kind"] for e in rec for f in e["faults"]}) == ["comm-failure", "memory-error"]
    for r in range(4):
        evs = events(run, f"rank_{r}")
        after = [e for e in evs if e["event"] == "resources"]
        end = [e for e in evs if e["event"] == "end"][-1]
        assert len(after) == 12, after
        fds, threads = (statistics.median(e[k] for e in after) for k in ("fds", "threads"))
        assert end["fds"] <= fds + 4, (r, [(e["fds"], e["threads"]) for e in after], end)
        assert end["threads"] <= threads + 2, (r, [(e["fds"], e["threads"]) for e in after], end)


def test_a_fault_in_a_periodic_save_is_recovered_and_the_save_redone(tmp_path, ref):
    """A memory error while every rank writes the periodic checkpoint of iteration 4: repaired in
    place like a fault in a step, the save runs again after the resume, nothing half written stays."""
    ck = tmp_path / "ck"
    proc = job(tmp_path, inject="uce:rank=1:step=4:phase=checkpoint", extra=("--save", str(ck), "--save-interval", "2"))
    rec = check_recovered(proc, tmp_path, ref["dp4"])
    assert rec[0]["faults"][0]["phase"] == "checkpoint" and rec[0]["how"] == "rollback"
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006", "iter_0000008",
                                                   "iter_0000009", "latest_checkpointed_iteration.txt"]
    saves = [e["iteration"] for e in events(tmp_path, "rank_0") if e["event"] == "checkpoint"]
    assert saves == [2, 4, 6, 8, 9]  # (and the end's)


def test_both_twins_poisoned_the_job_goes_on_from_the_periodic_checkpoint(tmp_path, ref):
    """Memory errors on ranks 3 and then 1 (while serving that recovery), the two holders of one
    shard: no twin can serve it, but a periodic checkpoint exists, so every rank reloads it in process
    and the job goes on (the step since it recomputed) instead of ending."""
    proc = job(tmp_path, inject="uce:rank=3:step=5:phase=backward,uce:rank=1:step=5:phase=recovery",
               extra=("--save", str(tmp_path / "ck"), "--save-interval", "3"))
    assert_ok(proc)
    assert losses(tmp_path) == ref["dp4"]
    rec = [e for e in events(tmp_path, "controller") if e["event"] == "recovered"]
    assert [(e["strategy"], e["how"], e["iteration"], e["lost_steps"]) for e in rec] == [("retry", "reload", 3, 1)]
    assert recomputed(tmp_path) == [4]
    twins_agree(tmp_path, rec)  # both holders came back from the checkpoint, equal again
    plan = [e for e in events(tmp_path, "controller") if e["event"] == "restore_plan"]
    assert "[1, 3]" in plan[0]["reason"] and "every replica lost" in plan[0]["reason"]


# (Past the first WARM_UP_STEPS steps of each process, whose hang limit is at least WARM_UP_S.)
HANGS = [(1, 4, "forward"), (2, 6, "backward"), (3, 8, "grad-sync"), (0, 10, "optimizer"), (1, 12, "param-sync")]


@extended_test  # (a hang under recover in CI: test_hosts' cut-off nodes; under retry: test_ttp)
def test_hang_at_every_phase_under_recover_the_hung_rank_is_replaced(tmp_path):
    """A rank whose training thread hangs (alive, heartbeating, no progress) at each phase: found by
    the hang timeout, killed by its agent and restarted like a dead one; its twin fills it in.
    Rank 0 (the controller's host) too. Losses bit-identical, one new process per hang."""
    extra = ("--train-iters", "14", "--ha-hang-timeout", "3")
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(job, tmp_path / "ref", 4, None, extra)
        proc = job(tmp_path / "run", inject=",".join(f"hang:rank={r}:step={s}:phase={p}" for r, s, p in HANGS),
                   extra=(*extra, *ARF), timeout=400)
        assert_ok(ref.result())
    rec = check_rejoined(proc, tmp_path / "run", losses(tmp_path / "ref"), [r for r, _, _ in HANGS], n=len(HANGS))
    # Rank 0 hosts the controller, which cannot replace its own host: it ends that process, and a
    # standby recovers the job from the exit.
    assert [(e["strategy"], e["faults"][0]["kind"], e["faults"][0]["ranks"]) for e in rec] == \
        [("recover", "process-exit" if r == 0 else "hang", [r]) for r, _, _ in HANGS]
    assert [e["rank"] for e in events(tmp_path / "run", "controller") if e["event"] == "host_ends"] == [0]


def alive_pid(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_restart_budget_spent_ends_the_job_with_do_not_restart(tmp_path, ref):
    """--ha-max-restarts 1: rank 1 killed in step 3 is restarted (its one restart) and the job goes on;
    killed again in step 6, it is not restarted: the dump applies (nowhere to write here) and every
    process exits with 3, the code that tells a scheduler not to restart the job as it is."""
    proc = job(tmp_path, inject="kill:rank=1:step=3:phase=backward,kill:rank=1:step=6:phase=forward",
               extra=ARF + ("--ha-max-restarts", "1"))
    assert proc.returncode == 3, proc.stderr[-3000:]
    rec = [e for e in events(tmp_path, "controller") if e["event"] == "recovered"]
    assert [e["strategy"] for e in rec] == ["recover"]
    strategy = [e for e in events(tmp_path, "controller") if e["event"] == "strategy"][-1]
    assert "recover not tried: rank(s) [1] were restarted 1 time(s) already (--ha-max-restarts 1)" in strategy["reason"]
    diag = [e for e in events(tmp_path, "controller") if e["event"] == "diagnosis"][-1]
    assert diag["exit_code"] == 3 and "--ha-max-restarts 1" in diag["text"] and diag["text"] in proc.stderr
    assert {i: h for i, h in losses(tmp_path).items() if i < 6} == {i: h for i, h in ref["dp4"].items() if i < 6}
