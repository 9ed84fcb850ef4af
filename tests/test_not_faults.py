"""Faults that are not the hardware's: a fault that recurs where it was recovered ends the job with its
diagnosis, an error before the job's first step is not recovered at all, ranks in collectives that
cannot match are named as a desync in seconds, and no process of a node outlives its agent. The
policy on plain data first, then whole jobs under `mindspeed-ha run`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import (MLM_ENV, MLM_MISSING, MLM_READY, MLM_TINY, PRETRAIN, TINY, all_rank_events, backend_env,
                     clean_env, events, losses, on)
from mindspeed_ha import faults, inject
from mindspeed_ha.control.policy import desync
from mindspeed_ha.control.policy.ledger import record
from mindspeed_ha.control.policy.recurrence import Recurrences, signature
from mindspeed_ha.rank.processor.long_wait import LongWait

MINDSPEED_HA = [sys.executable, "-m", "mindspeed_ha.cli"]


# ---- the policy, on plain data -------------------------------------------------------------------------------
def fault(kind="other", rank=1, it=4, detail="InjectedBug: injected bug (rank 1, iteration 4, phase forward)",
          fault_class="software"):
    return record([rank], kind, it, "forward", ["n0"], detail=detail, fault_class=fault_class, frame="model.py:7 in f")


def test_the_same_fault_is_the_same_whatever_its_numbers_and_a_later_one_is_new():
    a = fault(detail="RuntimeError: pid 4242 died after 3.5s")
    assert signature(a) == signature(fault(detail="RuntimeError: pid 17 died after 0.2s"))
    assert signature(a) != signature(fault(it=5, detail="RuntimeError: pid 4242 died after 3.5s"))
    assert signature(a) != signature(fault(rank=2, detail="RuntimeError: pid 4242 died after 3.5s"))


@pytest.mark.parametrize("cls,limit", [("software", 1), ("fault", 2)])
def test_a_fault_recovered_its_limit_of_times_at_one_iteration_is_refused(cls, limit):
    r = Recurrences(limit=2)
    f = fault(fault_class=cls)
    for _ in range(limit):
        assert r.refusal([f]) is None
        r.count([f])
    why = r.refusal([f])
    assert why is not None and not r.setup
    assert "rank 1's error (InjectedBug" in why and "model.py:7 in f" in why and "iteration 4" in why
    assert f"after {limit} recover" in why and "--ha-max-recurrences 2" in why
    assert r.refusal([fault(it=5, fault_class=cls)]) is None  # a later iteration: a new fault (a flaky node)


def test_an_error_in_the_first_step_is_a_setup_error_and_a_lost_process_never_is():
    r = Recurrences(limit=2)
    why = r.refusal([fault(it=1, detail="ModuleNotFoundError: No module named 'x'", fault_class="setup")])
    assert why is not None and r.setup and "before the job's first step completed" in why and "No module named" in why
    assert r.refusal([record([1], "process-exit", 1, "forward", ["n0"], fault_class="setup")]) is None


def test_the_class_of_an_exception():
    assert faults.fault_class(ValueError("bad shape")) == "software"
    assert faults.fault_class(KeyError("x")) == "software"
    assert faults.fault_class(ModuleNotFoundError("x"), first_step=True) == "setup"
    assert faults.fault_class(RuntimeError("CUDA error: an illegal memory access was encountered")) == "fault"
    assert faults.fault_class(faults.MemoryFault("UCE ERROR"), first_step=True) == "fault"
    assert faults.fault_class(ValueError("gloo: connection reset by peer")) == "fault"  # (a comm error's text)
    assert faults.fault_class(inject.InjectedBug("x")) == "software"
    assert faults.fault_class(inject.InjectedError("x")) == "fault"


def test_the_frame_named_is_the_jobs_own_innermost_one():
    def model_forward():
        raise ValueError("bad")
    try:
        model_forward()
    except ValueError as e:
        where = faults.user_frame(e)
    assert where.startswith(os.path.abspath(__file__)) and where.endswith("in model_forward"), where


def test_recurring_bug_and_desync_drills_parse():
    f, g = inject.parse("bug:rank=1:step=4:every,desync:rank=2:step=3:phase=backward")
    assert (f.kind, f.every, g.kind, g.every) == ("bug", True, "desync", False)
    assert f.spec() == "bug:rank=1:step=4:phase=forward:every"
    with pytest.raises(inject.InjectSpecError, match="every needs a step"):
        inject.parse("bug:rank=1:step=any:every")


def _evidence(member, groups):
    return {"member": member, "waited_s": 6.0, "groups": groups}


def test_a_rank_with_one_collective_more_is_out_of_step():
    """Rank 1 waits in an all-reduce of the world group its peers never issue; rank 0 waits for it in
    their pair's next collective (one more than rank 1's count there): the world group says rank 1."""
    world = [0, 1, 2, 3]
    reports = {r: _evidence(r, {"w": [7 + (r == 1), "all_reduce", f"step.py:{r}", world],
                                "dp": [3 + (r == 0), "reduce_scatter", "ddp.py:9", [r - r % 2, r - r % 2 + 1]]})
               for r in world}
    found = desync.find(reports, set(world))
    assert found is not None and found.group == world and found.out_of_step == [1]
    assert found.collectives[1] == (8, "all_reduce", "step.py:1")
    assert "desync in the group of ranks [0, 1, 2, 3]" in found.text() and "out of step: rank(s) [1]" in found.text()


def test_different_kinds_at_one_count_are_a_desync_and_a_rank_still_computing_is_none():
    pair = [0, 1]
    reports = {0: _evidence(0, {"g": [5, "all_reduce", "a.py:1", pair]}),
               1: _evidence(1, {"g": [5, "all_gather_into_tensor", "b.py:2", pair]})}
    found = desync.find(reports, {0, 1})
    assert found is not None and found.out_of_step in ([0], [1])
    assert desync.find(reports, {0, 1, 2}) is None  # rank 2 sends no counts: it computes, it may yet come
    same = {r: _evidence(r, {"g": [5, "all_reduce", "a.py:1", pair]}) for r in pair}
    assert desync.find(same, {0, 1}) is None  # a hang, not a desync


def test_a_rank_says_its_counts_only_once_it_has_waited_past_the_threshold():
    waiting = [True]
    w = LongWait(5.0, lambda: waiting[0], lambda: {"g": [1, "barrier", "x.py:1", [0, 1]]}, lambda: 0)
    assert w.report(now=100.0) is None and w.report(now=104.9) is None
    assert w.report(now=105.1) == {"member": 0, "waited_s": 5.1, "groups": {"g": [1, "barrier", "x.py:1", [0, 1]]}}
    waiting[0] = False
    assert w.report(now=106.0) is None
    waiting[0] = True
    assert w.report(now=107.0) is None  # (waiting again: its clock starts again)


# ---- whole jobs ------------------------------------------------------------------------------------------------
def run(log_dir, inject_spec, *extra, backend="gloo", iters=9, timeout=240, mlm=False):
    log_dir.mkdir(parents=True, exist_ok=True)
    base = [*MLM_TINY, "--train-iters", str(iters)] if mlm else [*TINY, "--train-iters", str(iters)]
    cmd = MINDSPEED_HA + ["run", "--standalone", "--nproc-per-node", "4", PRETRAIN, *base,
                          "--ha-log-dir", str(log_dir), *extra]
    env = clean_env({**backend_env(backend), **(MLM_ENV if mlm else {}), "MINDSPEED_HA_INJECT": inject_spec})
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(log_dir))
    return proc, time.monotonic() - t0


def rollbacks(ctl: list[dict]) -> int:
    """The recoveries that mended the state and sent the ranks back to training."""
    return len([e for e in ctl if e["event"] == "stage" and e["stage"] == "resume"])


def pids_of(log_dir) -> set[int]:
    """Every process of the job the logs name: workers, spares, the agent."""
    out = {e["pid"] for e in all_rank_events(log_dir) if "pid" in e}
    for e in events(log_dir, "agent_0"):
        out |= {e.get(k) for k in ("pid", "worker_pid", "spare_pid") if isinstance(e.get(k), int)}
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("kind,cls,n,backend", [on("bug", "software", 1, "gloo"),
                                               on("exception", "fault", 2, "emulated_nccl")])
def test_a_fault_that_recurs_at_its_iteration_ends_the_job_with_its_diagnosis(tmp_path, kind, cls, n, backend):
    """Rank 1 raises the same error each time it reaches iteration 4 (a bug in a model or a data
    loader), with retry and recover on and --save: recovered once (an error of the job's own code) or
    twice (the limit), then the dying gasp and exit code 3, its last lines naming the error, that it
    recurs, where it was raised and the checkpoint; no process of the job left."""
    ck = tmp_path / "ck"
    proc, took = run(tmp_path, f"{kind}:rank=1:step=4:every", "--enable-hbmfault-repair", "--enable-worker-reboot",
                     "--save", str(ck), backend=backend)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert took < 60, took
    ctl = events(tmp_path, "controller")
    assert rollbacks(ctl) == n  # (a recovery's ranks fault again as they resume: its first step never ends)
    assert [(f["ranks"], f["iteration"], f["fault_class"]) for f in ctl if f["event"] == "fault"
            and f["kind"] == "other"] == [([1], 4, cls)] * (n + 1)
    (diag,) = [e for e in ctl if e["event"] == "diagnosis"]
    text = diag["text"]
    assert f"came back after {n} recover" in text and "at iteration 4" in text, text
    assert f"Resume with --load {ck}" in text and diag["exit_code"] == 3, text
    assert "raised at " in text, text
    last = "\n".join(proc.stderr.strip().splitlines()[-3:])
    assert "came back after" in last and f"--load {ck}" in last, last
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    rep = subprocess.run(MINDSPEED_HA + ["report", str(tmp_path), "--no-picture"], env=clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert f"class: {cls}" in rep.stdout, rep.stdout + rep.stderr
    time.sleep(1.0)
    assert not [p for p in pids_of(tmp_path) if alive(p)]


def test_an_error_before_the_first_step_ends_the_job_at_once(tmp_path):
    """Every rank raises in its first step (an import that fails, as a set-up error does): no
    recovery is tried, the job ends at once with exit code 3, each rank's traceback in its output."""
    spec = ",".join(f"bug:rank={r}:step=1" for r in range(4))
    proc, took = run(tmp_path, spec, "--enable-hbmfault-repair", "--enable-worker-reboot", "--save", str(tmp_path / "ck"))
    assert proc.returncode == 3, proc.stderr[-3000:]
    ctl = events(tmp_path, "controller")
    assert not [e for e in ctl if e["event"] == "recovered"]
    (strategy,) = [e for e in ctl if e["event"] == "strategy"]
    assert strategy["outcome"] == "no-strategy" and "before the job's first step completed" in strategy["reason"]
    assert "set-up error" in [e for e in ctl if e["event"] == "diagnosis"][0]["text"]
    assert "Traceback" in proc.stderr and "InjectedBug: injected bug" in proc.stderr
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").glob("iter_*"))
    assert took < 60, took


@pytest.mark.parametrize("backend", [on("gloo"), on("emulated_nccl")])
def test_a_rank_with_one_collective_more_is_named_a_desync_in_seconds(tmp_path, references, backend):
    """Rank 1 issues one collective more than its peers in iteration 4 (a desync drill), with the
    hang timeout at 60 s: every rank ends up waiting, their counts are compared after 5 s, and the
    controller names the group, each member's collective and rank 1 as out of step within 10 s;
    recover replaces rank 1, and every loss is the fault-free run's."""
    proc, _ = run(tmp_path, "desync:rank=1:step=4", "--enable-hbmfault-repair", "--enable-worker-reboot",
                  "--ha-hang-timeout", "60", backend=backend)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ctl = events(tmp_path, "controller")
    (found,) = [e for e in ctl if e["event"] == "desync"]
    assert found["out_of_step"] == [1] and found["iteration"] in (3, 4), found
    assert 1 in found["group"] and found["collectives"]["1"][1] == "all_reduce", found
    (hang,) = [e for e in ctl if e["event"] == "fault" and e["kind"] == "hang"]
    assert hang["ranks"] == [1] and "desync in the group of ranks" in hang["detail"]
    (inj,) = [e for e in events(tmp_path, "rank_1") if e["event"] == "inject"]
    assert hang["time"] - inj["time"] < 10.0, (hang["time"] - inj["time"])
    assert losses(tmp_path) == references.tiny("dp4")


def test_the_agents_processes_end_with_it(tmp_path):
    """`mindspeed-ha run` killed outright (SIGKILL) in the middle of training: its workers, its spare
    template and spares end within seconds, none left training on its own."""
    tmp_path.mkdir(exist_ok=True)
    cmd = MINDSPEED_HA + ["run", "--standalone", "--nproc-per-node", "4", PRETRAIN, *TINY, "--train-iters", "1000",
                          "--enable-worker-reboot", "--ha-log-dir", str(tmp_path)]
    agent = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             cwd=str(tmp_path), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not [e for e in all_rank_events(tmp_path) if e["event"] == "step" and e["iteration"] >= 3]:
            assert time.monotonic() < deadline and agent.poll() is None, "no step 3"
            time.sleep(0.2)
        job = pids_of(tmp_path) - {agent.pid}
        assert len(job) >= 4, job
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        deadline = time.monotonic() + 15
        while [p for p in job if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in job if alive(p)], "processes outlived their agent"
    finally:
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not MLM_READY, reason=MLM_MISSING)
def test_megatron_lms_loop_a_bug_that_recurs_ends_the_job(tmp_path):
    """The same through Megatron-LM's own loop: rank 2's data loader (a bug) raises at iteration 5 every
    time: recovered once, then the dump and exit code 3."""
    ck = tmp_path / "ck"
    proc, took = run(tmp_path, "bug:rank=2:step=5:every", "--enable-hbmfault-repair", "--enable-worker-reboot",
                     "--save", str(ck), "--save-interval", "100", mlm=True)
    assert proc.returncode == 3, proc.stderr[-3000:]
    ctl = events(tmp_path, "controller")
    assert rollbacks(ctl) == 1
    text = [e for e in ctl if e["event"] == "diagnosis"][0]["text"]
    assert "came back after 1 recovery" in text and f"--load {ck}" in text, text
    assert took < 90, took


@pytest.mark.skipif(not MLM_READY, reason=MLM_MISSING)
def test_megatron_lms_loop_a_desync_is_named_and_recovered(tmp_path):
    """The desync drill through Megatron-LM's own loop, on the backend with NCCL's semantics: rank 3
    issues one collective more in iteration 3; named a desync within 10 s of the 60 s hang timeout,
    rank 3 replaced, and every loss equal to the fault-free run's."""
    clean, _ = run(tmp_path / "clean", "", iters=6, mlm=True, backend="emulated_nccl")
    assert clean.returncode == 0, clean.stderr[-3000:]
    proc, _ = run(tmp_path / "desync", "desync:rank=3:step=3", "--enable-hbmfault-repair", "--enable-worker-reboot",
                  "--ha-hang-timeout", "60", iters=6, mlm=True, backend="emulated_nccl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ctl = events(tmp_path / "desync", "controller")
    (found,) = [e for e in ctl if e["event"] == "desync"]
    assert found["out_of_step"] == [3], found
    (hang,) = [e for e in ctl if e["event"] == "fault" and e["kind"] == "hang"]
    (inj,) = [e for e in events(tmp_path / "desync", "rank_3") if e["event"] == "inject"]
    assert hang["ranks"] == [3] and hang["time"] - inj["time"] < 10.0, (hang, inj["time"])
    want = losses(tmp_path / "clean")
    assert sorted(want) == [1, 2, 3, 4, 5, 6] and losses(tmp_path / "desync") == want
