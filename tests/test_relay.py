"""Rounds through the node agents (``mindspeed-ha run --relay``): the controller sends each order for a
node's ranks to its agent once, the agent passes it on and sends their answers back in batches. The
recoveries are the same bit for bit; an agent that goes silent costs a resend, never the recovery."""
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import PRETRAIN, TINY, TINY_ITERS, all_rank_events, assert_ok, clean_env, events, losses, recomputed

MINDSPEED_HA = [sys.executable, "-m", "mindspeed_ha.cli"]
ROUNDS = ("ha-status", "rebuild", "repair", "rollback", "resume")


def command(log_dir, nproc=4, relay=True):
    return MINDSPEED_HA + ["run", "--standalone", "--relay" if relay else "--no-relay", "--nproc-per-node", str(nproc),
                           PRETRAIN, *TINY,
                           "--train-iters", str(TINY_ITERS), "--enable-hbmfault-repair", "--enable-worker-reboot",
                           "--ha-log-dir", str(log_dir), "--ha-verify-replicas-interval", "1"]


@pytest.fixture
def ref(references):
    return references.tiny_layouts()["dp4"]


def round_orders(log_dir) -> list[dict]:
    return [e for e in all_rank_events(log_dir) if e["event"] == "action" and e["action"] in ROUNDS]


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "no-relay"])
def test_retry_and_recover_with_the_rounds_through_the_agent(tmp_path, ref, relay):
    """A memory error (retry), then a killed worker (recover): every loss equals the fault-free run's;
    every round's order to a rank whose process was connected to the agent came through the agent (the
    default), or, with --no-relay, every order came directly."""
    env = clean_env({"MINDSPEED_HA_INJECT": "uce:rank=2:step=4:phase=backward,kill:rank=1:step=7:phase=optimizer"})
    proc = subprocess.run(command(tmp_path, relay=relay), env=env, capture_output=True, text=True, timeout=240,
                          cwd=str(tmp_path))
    assert_ok(proc)
    assert losses(tmp_path) == ref
    rec = [e for e in events(tmp_path, "controller") if e["event"] == "recovered"]
    assert [e["strategy"] for e in rec] == ["retry", "recover"] and all(e["lost_steps"] == 0 for e in rec)
    orders = round_orders(tmp_path)
    assert {e["action"] for e in orders} == set(ROUNDS)
    first_pid = {e["rank"]: e["pid"] for e in all_rank_events(tmp_path) if e["event"] == "start" and e["rank"] != 1}
    survivors = [e for e in orders if e["pid"] == first_pid.get(e["rank"])]
    direct = [(e["rank"], e["action"]) for e in survivors if not e.get("relayed")]
    assert survivors and (not direct if relay else len(direct) == len(survivors)), direct
    if not relay:
        assert not any(e.get("relayed") for e in all_rank_events(tmp_path) if e["event"] == "action")


def test_an_agent_stopped_during_a_retry_the_controller_sends_directly(tmp_path, ref):
    """The agent is stopped (SIGSTOP) before a memory error and continued only after the recovery:
    the orders it would have passed on reach the ranks directly (sent so after its silence, or sent
    again), and the job goes on bit-identical."""
    env = clean_env({"MINDSPEED_HA_INJECT": "uce:rank=2:step=8:phase=forward,slow:rank=0:step=2:factor=3,"
                                            "slow:rank=1:step=2:factor=3,slow:rank=2:step=2:factor=3,"
                                            "slow:rank=3:step=2:factor=3"})
    proc = subprocess.Popen(command(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(tmp_path))
    stopped_at = None
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120 and proc.poll() is None:
            steps = [e["iteration"] for e in events(tmp_path, "rank_0") if e["event"] == "step"]
            if steps and max(steps) >= 6:
                break
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)  # (the agent: mindspeed-ha run is node 0's agent)
        stopped_at = time.time()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 90:
            if any(e["event"] == "recovered" for e in events(tmp_path, "controller")):
                break
            time.sleep(0.1)
        continued_at = time.time()
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.communicate()
    assert_ok(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert losses(tmp_path) == ref and recomputed(tmp_path) in ([8], [])
    (rec,) = [e for e in events(tmp_path, "controller") if e["event"] == "recovered"]
    assert stopped_at < rec["time"] < continued_at, "the recovery did not happen while the agent was stopped"
    orders = [e for e in round_orders(tmp_path) if stopped_at < e["time"] < continued_at]
    assert {e["action"] for e in orders} == set(ROUNDS) and not any(e.get("relayed") for e in orders), orders
