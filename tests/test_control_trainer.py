"""The control plane around the real megatron-core trainer, launched by `mindspeed-ha run`."""
import subprocess
import sys
import time

import psutil
import pytest

from helpers import PRETRAIN, TINY, all_rank_events, clean_env, events, free_port, losses

MINDSPEED_HA = [sys.executable, "-m", "mindspeed_ha.cli"]


def run_job(tmp_path, inject=None, extra=(), timeout=180):
    env = clean_env({"MINDSPEED_HA_INJECT": inject} if inject else {})
    # (not --standalone: a one-node job as a scheduler starts it; its own port, as tests run side by side)
    cmd = MINDSPEED_HA + ["run", "--master-port", str(free_port()), "--nproc-per-node", "4", PRETRAIN, *TINY,
                          "--train-iters", "8", "--enable-high-availability", "--ha-log-dir", str(tmp_path), *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    return proc, time.time() - t0


def leftover_workers(log_dir) -> list:
    """The job's processes that still run: every one its agent started or was told of (workers,
    spares, the spare template), by pid (a fork server's forks show the server's command line)."""
    left = []
    for pid in {e["worker_pid"] for e in events(log_dir, "agent_0") if "worker_pid" in e}:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def test_fault_free_job_under_the_agent(tmp_path):
    proc, _ = run_job(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(losses(tmp_path)) == list(range(1, 9))
    states = [(e["from"], e["to"]) for e in events(tmp_path, "controller") if e["event"] == "state"]
    assert ("init", "normal") in states and ("normal", "done") in states


@pytest.mark.alone  # (asserts a latency)
@pytest.mark.parametrize("phase", ["forward", "backward", "grad-sync", "optimizer", "param-sync"])
def test_killed_rank_ends_job_cleanly_with_diagnosis(tmp_path, phase):
    proc, seconds = run_job(tmp_path, inject=f"kill:rank=1:step=4:phase={phase}")
    assert proc.returncode != 0
    inject = [e for e in all_rank_events(tmp_path) if e["event"] == "inject"]
    assert len(inject) == 1 and inject[0]["rank"] == 1 and inject[0]["phase"] == phase
    ctl = events(tmp_path, "controller")
    faults = [e for e in ctl if e["event"] == "fault"]
    killed = [f for f in faults if f["ranks"] == [1]]
    assert killed and killed[0]["iteration"] == 4 and killed[0]["detect_s"] < 1.0
    # The end: within 10 s of the fault, with the one-paragraph diagnosis on the launcher's stderr.
    end = max(e["time"] for e in ctl)
    assert end - inject[0]["time"] < 10.0
    assert "mindspeed-ha diagnosis: rank 1" in proc.stderr and "iteration 4" in proc.stderr
    assert "signal 9" in proc.stderr
    assert not leftover_workers(tmp_path)
    # Nothing trained past the fault.
    assert max(losses(tmp_path)) <= 4


def test_status_and_live_inject(tmp_path):
    """`mindspeed-ha status` reads a live job; `mindspeed-ha inject` (authenticated) faults it."""
    env = clean_env()
    cmd = MINDSPEED_HA + ["run", "--master-port", str(free_port()), "--nproc-per-node", "4", PRETRAIN, *TINY,
                          "--train-iters", "100000", "--enable-high-availability", "--ha-log-dir", str(tmp_path)]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not losses(tmp_path):
            time.sleep(1)
        assert losses(tmp_path), "the job never trained"
        st = subprocess.run(MINDSPEED_HA + ["status", "--log-dir", str(tmp_path), "--json"], env=env,
                            capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        import json
        status = json.loads(st.stdout)
        text = json.dumps(status)
        assert "normal" in text and all(f'"rank": {r}' in text for r in range(4)), text[:2000]
        inj = subprocess.run(MINDSPEED_HA + ["inject", "--log-dir", str(tmp_path), "--kind", "exception",
                                             "--rank", "2", "--phase", "backward"],
                             env=env, capture_output=True, text=True, timeout=60)
        assert inj.returncode == 0 and '"ok": true' in inj.stdout, inj.stdout + inj.stderr
        job.wait(timeout=60)
        assert job.returncode != 0
    finally:
        if job.poll() is None:
            job.kill()
    injected = [e for e in all_rank_events(tmp_path) if e["event"] == "inject"]
    assert len(injected) == 1 and injected[0]["rank"] == 2 and injected[0]["kind"] == "exception"
    faults = [e for e in events(tmp_path, "controller") if e["event"] == "fault"]
    assert any(f["ranks"] == [2] and f["kind"] == "other" for f in faults)
    assert not leftover_workers(tmp_path)


def test_megatrons_own_flags_reach_the_workers_and_their_refusal_reaches_the_user(tmp_path):
    """``mindspeed-ha run`` reads the script's HA flags (for its agent and spare templates) without
    taking a script's flag that starts like one of them for an abbreviation: every drill passes
    ``--optimizer adam`` (helpers.TINY); ``--optimizer sgd`` is refused by the workers, naming it, exit 2."""
    proc, _ = run_job(tmp_path, extra=("--optimizer", "sgd"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--optimizer sgd: the replica optimizer is megatron-core's distributed optimizer" in proc.stderr
    assert "--optimizer-replica-num" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.drill_may_not_fire
def test_a_drill_that_never_fires_is_an_error_in_the_log_the_events_and_the_report(tmp_path):
    """Rank 1's drill is for a recovery in step 4, and the job's one fault is in step 3 (a drill whose
    phase the layout does run, so that it is not refused at start): the job itself ends well (exit 0),
    but the drill tested nothing — an error line in the log, a ``drill_unfired`` event, and ``report``
    exits 1 naming it (the suite's own check fails every other test on such an event)."""
    proc, _ = run_job(tmp_path, inject="exception:rank=1:step=4:phase=recovery,kill:rank=2:step=3:phase=forward",
                      extra=("--enable-worker-reboot",))
    assert proc.returncode == 0, proc.stderr[-4000:]
    never = [e for e in all_rank_events(tmp_path) if e["event"] == "drill_unfired"]
    assert [(e["rank"], e["spec"]) for e in never] == [(1, "exception:rank=1:step=4:phase=recovery")], never
    log = (tmp_path / "ttp_log.log").read_text()
    assert "fault drill exception:rank=1:step=4:phase=recovery never fired" in log
    rep = subprocess.run(MINDSPEED_HA + ["report", str(tmp_path), "--no-picture"], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert rep.returncode == 1 and "ERROR: fault drill exception:rank=1:step=4:phase=recovery never fired" \
        in rep.stderr, rep.stdout + rep.stderr
    assert "rank 2 process-exit" in rep.stdout  # (the kill did fire, and was recovered)
