"""The agent's spare pool with real processes: forks of the template take ranks and report their real
exit codes; a used spare is replaced at once; without a template the pool starts plain processes."""
import os
import signal
import subprocess
import sys
import time

from helpers import REPO, clean_env
from mindspeed_ha.events import EventLog, read_events
from mindspeed_ha.launcher import spare

# A stand-in for the training script: the spare start-up, then what the assigned rank does.
SCRIPT = ("from mindspeed_ha.launcher import spare; spare.wait_for_assignment(); import os, sys; "
          "sys.exit(10 + int(os.environ['RANK']))")


def pool(tmp_path, n, fork_workers=False, script=SCRIPT) -> spare.Pool:
    env = clean_env({"PYTHONPATH": str(REPO)})
    return spare.Pool(n, [sys.executable, "-c", script], env, EventLog(str(tmp_path), "agent_0"), "test",
                      str(tmp_path / "fifos"), fork_workers)


def settle(p: spare.Pool, until, timeout=30.0):
    t = time.monotonic()
    while not until():
        assert time.monotonic() - t < timeout, (p.spares, p.ready)
        p.maintain(time.monotonic())
        time.sleep(0.01)


def test_forked_spares_take_ranks_report_exit_codes_and_are_replaced(tmp_path):
    p = pool(tmp_path, 2)
    try:
        settle(p, lambda: len(p.ready) == 2)
        assert all(isinstance(s, spare.Forked) for s in p.spares)
        got = [p.hand_over(spare.assignment(r, r, 1)) for r in (1, 2)]
        assert [warm for _, warm in got] == [True, True]
        assert [proc.wait(10) for proc, _ in got] == [11, 12]  # the template reaped them and said so
        settle(p, lambda: len(p.ready) == 2)                  # both replaced
        victim = p.spares[0]
        os.killpg(victim.pid, signal.SIGKILL)                   # a spare dies on its own
        settle(p, lambda: victim not in p.spares and len(p.ready) == 2)
        assert victim.returncode == -signal.SIGKILL
    finally:
        p.close()
    starts = [e for e in read_events(str(tmp_path / "events" / "agent_0.jsonl")) if e["event"] == "spare_start"]
    assert len(starts) == 5 and all(e["forked"] for e in starts)


def test_without_its_template_the_pool_starts_processes(tmp_path):
    p = pool(tmp_path, 1)
    try:
        settle(p, lambda: len(p.ready) == 1)
        os.killpg(p.template.pid, signal.SIGKILL)
        settle(p, lambda: p.template is None and any(isinstance(s, subprocess.Popen) for s in p.spares))
        assert not any(isinstance(s, spare.Forked) for s in p.spares)  # no one could report their end
        settle(p, lambda: len(p.ready) == 1)
        proc, warm = p.hand_over(spare.assignment(3, 3, 1))
        assert isinstance(proc, subprocess.Popen) and warm and proc.wait(10) == 13
    finally:
        p.close()


def test_the_template_forks_the_first_workers_and_reports_their_exit_codes(tmp_path):
    p = pool(tmp_path, 1, fork_workers=True)
    try:
        got = p.start_workers({r: spare.assignment(r, r, 0) for r in (0, 1, 2)}, timeout=60)
        assert sorted(got) == [0, 1, 2] and all(isinstance(w, spare.Forked) for w in got.values())
        assert [got[r].wait(10) for r in (0, 1, 2)] == [10, 11, 12]
        settle(p, lambda: len(p.ready) == 1)  # the spare is there too, and stays one
        assert len(p.spares) == 1
    finally:
        p.close()


def test_ranks_a_dead_template_did_not_start_are_left_to_the_caller(tmp_path):
    # A template that dies while importing: no worker of it runs, every rank is the agent's to start.
    p = pool(tmp_path, 0, fork_workers=True, script="import sys; sys.exit(3)")
    try:
        assert p.start_workers({r: spare.assignment(r, r, 0) for r in (0, 1)}, timeout=60) == {}
    finally:
        p.close()


def test_a_cpu_job_with_ha_forks_its_workers_and_nothing_else_does():
    ha = ["--enable-high-availability"]
    assert spare.forks_workers(ha, {})
    assert not spare.forks_workers([], {})                                          # HA off: any script
    assert not spare.forks_workers(ha, {"MINDSPEED_HA_FORK_WORKERS": "0"})
    assert not spare.forks_workers(ha, {"MINDSPEED_HA_DEVICE": "tpu"})              # refused by the workers


def test_an_exited_agent_not_yet_reaped_is_gone_for_its_spares():
    """A spare waits for its assignment only while its agent runs: an agent that has exited but
    whose parent has not reaped it yet (it waits on the output pipes the spare holds) counts as gone,
    or the two would wait for each other for good."""
    import psutil
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not spare._exists(p.pid)
    p.wait()
    assert not spare._exists(p.pid) and spare._exists(os.getpid())
