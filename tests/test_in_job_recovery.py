"""In-job recovery end to end under `mindspeed-ha run`. Retry (UCE / communication fault): no
process restarts, the broken rank's shard comes back from its twin. Recover (a killed worker): only
that worker is restarted and joins the running job. Either way the failed step is recomputed (or
finished) and every iteration's loss equals the fault-free run's bit for bit."""
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import PRETRAIN, TINY, all_rank_events, assert_ok, clean_env, events, losses

MINDSPEED_HA = [sys.executable, "-m", "mindspeed_ha.cli"]
ITERS = 8
TP2 = ["--tensor-model-parallel-size", "2"]


def job(log_dir, nproc=4, inject=None, extra=(), timeout=240):
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = MINDSPEED_HA + ["run", "--standalone", "--nproc-per-node", str(nproc), PRETRAIN, *TINY,
                          "--train-iters", str(ITERS), "--enable-hbmfault-repair", "--ha-log-dir", str(log_dir), *extra]
    env = clean_env({"MINDSPEED_HA_INJECT": inject} if inject else {})
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(log_dir))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    with ThreadPoolExecutor(2) as pool:
        dp4, tp2 = pool.submit(job, d / "dp4", 4), pool.submit(job, d / "tp2", 8, None, TP2)
        assert_ok(dp4.result())
        assert_ok(tp2.result())
    return {"dp4": losses(d / "dp4"), "tp2": losses(d / "tp2")}


def check_recovered(proc, log_dir, want, nproc=4, n=1) -> list:
    """Exit 0, the same pid per rank all along, every loss bit-identical, `recovered` events."""
    assert_ok(proc)
    starts = [e for e in all_rank_events(log_dir) if e["event"] == "start"]
    assert sorted(e["rank"] for e in starts) == list(range(nproc))  # nobody restarted
    assert losses(log_dir) == want
    rec = [e for e in events(log_dir, "controller") if e["event"] == "recovered"]
    assert len(rec) == n, [e for e in events(log_dir, "controller") if e["event"] in ("fault", "strategy", "repair_failed")]
    for r in rec:
        assert r["strategy"] == "retry" and r["lost_steps"] == 0 and r["mttr_s"] > 0
        assert {"detect", "stop", "rebuild", "repair", "rollback", "first_step"} <= set(r["phases"])
    return rec


# Several faults per job (each fires once, each is its own recovery): every phase is covered in two
# jobs instead of five. (rank, step, phase); rank 2's twin is 0, rank 1's is 3.
PHASE_JOBS = {
    "forward+grad-sync+param-sync": [(2, 2, "forward"), (1, 4, "grad-sync"), (2, 6, "param-sync")],
    "backward+optimizer": [(2, 3, "backward"), (3, 5, "optimizer")],
}
TWIN = {0: 2, 2: 0, 1: 3, 3: 1}


@pytest.mark.parametrize("name", list(PHASE_JOBS))
def test_uce_each_phase_dp4(tmp_path, ref, name):
    faults = PHASE_JOBS[name]
    proc = job(tmp_path, inject=",".join(f"uce:rank={r}:step={s}:phase={p}" for r, s, p in faults))
    rec = check_recovered(proc, tmp_path, ref["dp4"], n=len(faults))
    assert [(e["faults"][0]["ranks"], e["faults"][0]["kind"]) for e in rec] == \
        [([r], "memory-error") for r, _, _ in faults]
    # Each broken shard came back from its twin (a window left untouched may be copied too).
    repaired = [(e["rank"], e["sources"]) for e in all_rank_events(tmp_path) if e["event"] == "repaired"]
    for r, _, _ in faults:
        assert (r, [TWIN[r]]) in repaired, repaired


def test_uce_tp2_dp4(tmp_path, ref):
    """8 ranks, TP=2 x DP=4: replica groups [0, 4], [2, 6] (TP rank 0) and [1, 5], [3, 7]."""
    proc = job(tmp_path, 8, inject="uce:rank=3:step=3:phase=backward,uce:rank=6:step=5:phase=optimizer", extra=TP2)
    check_recovered(proc, tmp_path, ref["tp2"], nproc=8, n=2)


def test_two_uces_in_different_replica_pairs_at_once(tmp_path, ref):
    proc = job(tmp_path, inject="uce:rank=1:step=3:phase=backward,uce:rank=2:step=3:phase=backward")
    check_recovered(proc, tmp_path, ref["dp4"])
    repaired = {e["rank"]: e["sources"] for e in all_rank_events(tmp_path) if e["event"] == "repaired"}
    assert repaired == {1: [3], 2: [0]}


def test_comm_fault_retry(tmp_path, ref):
    """Communicators of rank 1 torn down (gloo: its groups destroyed) with every rank alive: groups
    rebuilt, step recomputed, nothing copied."""
    proc = job(tmp_path, inject="comm:rank=1:step=4:phase=backward")
    rec = check_recovered(proc, tmp_path, ref["dp4"])
    assert {f["kind"] for f in rec[0]["faults"]} == {"comm-failure"}
    assert not [e for e in all_rank_events(tmp_path) if e["event"] == "repaired"]


def test_no_replica_fallback_reloads_in_process(tmp_path):
    """--distributed-optimizer-no-replica: nothing holds a second copy of a shard, so every rank
    reloads the newest periodic checkpoint in process (no restart); the event counts the lost steps,
    and the recomputed steps have the fault-free run's loss bits."""
    extra = ("--distributed-optimizer-no-replica", "--save", str(tmp_path / "ck"), "--save-interval", "3")
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(job, tmp_path / "ref", 4, None, ("--distributed-optimizer-no-replica",))
        proc = job(tmp_path / "run", inject="uce:rank=2:step=5:phase=backward", extra=extra)
        assert_ok(ref.result())
    assert_ok(proc)
    run = tmp_path / "run"
    assert sorted(e["rank"] for e in all_rank_events(run) if e["event"] == "start") == [0, 1, 2, 3]
    assert losses(run) == losses(tmp_path / "ref")
    rec = [e for e in events(run, "controller") if e["event"] == "recovered"]
    assert len(rec) == 1 and rec[0]["how"] == "reload" and rec[0]["iteration"] == 3 and rec[0]["lost_steps"] == 1
    assert [e["iteration"] for e in all_rank_events(run) if e["event"] == "load"] == [3] * 4


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
KILL_JOBS = {
    "forward+grad-sync+param-sync": [(1, 2, "forward"), (2, 4, "grad-sync"), (1, 6, "param-sync")],
    "backward+optimizer": [(2, 3, "backward"), (3, 5, "optimizer")],
}


def check_rejoined(proc, log_dir, want, killed: list[int], n: int, nproc=4) -> list:
    """Exit 0, exactly one new pid per kill (on the killed rank), every loss bit-identical, one
    `recovered` event per recovery, 0 lost steps."""
    assert_ok(proc)
    evs = all_rank_events(log_dir)
    pids = Counter(r for r, _ in {(e["rank"], e["pid"]) for e in evs if e["event"] == "start"})
    assert pids == Counter(range(nproc)) + Counter(killed), pids
    assert losses(log_dir) == want
    rec = [e for e in events(log_dir, "controller") if e["event"] == "recovered"]
    assert len(rec) == n, [e for e in events(log_dir, "controller") if e["event"] in ("fault", "strategy", "repair_failed")]
    for r in rec:
        assert r["lost_steps"] == 0 and r["mttr_s"] > 0
        if r["strategy"] == "recover":
            assert {"restart", "rebuild", "repair", "rollback", "first_step"} <= set(r["phases"])
    return rec


@pytest.mark.parametrize("name", list(KILL_JOBS))
def test_kill_each_phase_dp4_restarts_only_that_worker(tmp_path, ref, name):
    faults = KILL_JOBS[name]
    proc = job(tmp_path, inject=",".join(f"kill:rank={r}:step={s}:phase={p}" for r, s, p in faults), extra=ARF)
    rec = check_rejoined(proc, tmp_path, ref["dp4"], [r for r, _, _ in faults], n=len(faults))
    assert [e["strategy"] for e in rec] == ["recover"] * len(faults)
    # The newcomer's shard came from its twin.
    repaired = [(e["rank"], e["sources"]) for e in all_rank_events(tmp_path) if e["event"] == "repaired"]
    for r, _, _ in faults:
        assert (r, [TWIN[r]]) in repaired, repaired


def test_uce_then_kill_retry_and_recover_in_one_job(tmp_path, ref):
    """The issue's acceptance run: a memory error repaired in place, then a killed worker restarted."""
    proc = job(tmp_path, inject="uce:rank=2:step=4:phase=backward,kill:rank=1:step=7:phase=optimizer", extra=ARF)
    rec = check_rejoined(proc, tmp_path, ref["dp4"], [1], n=2)
    assert [e["strategy"] for e in rec] == ["retry", "recover"]


def test_kill_rank0_backup_controller_restarts_it(tmp_path, ref):
    """Rank 0 hosts the controller: the backup takes over, has rank 0 restarted, and the restarted
    rank 0 joins without starting a controller of its own."""
    proc = job(tmp_path, inject="kill:rank=0:step=6:phase=backward", extra=ARF)
    rec = check_rejoined(proc, tmp_path, ref["dp4"], [0], n=1)
    assert rec[0]["strategy"] == "recover"
    takeovers = [e for e in all_rank_events(tmp_path) if e["event"] == "takeover"] + \
        [e for e in events(tmp_path, "controller") if e["event"] == "takeover"]
    assert takeovers, "no backup controller took over"
