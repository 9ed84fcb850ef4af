"""The launcher agents' health hook (``--ha-health-cmd``), run for real: what it names, how a failure,
a timeout and a quiet check read."""
import time
from types import SimpleNamespace

from mindspeed_ha.launcher.health import HealthHook


def workers():
    return {r: SimpleNamespace(rank=r, local_rank=r - 4, popen=SimpleNamespace(pid=1000 + r)) for r in (4, 5, 6, 7)}


def run(cmd, interval=0.2, limit=10.0):
    """The hook's first check, to its end: what it found."""
    hook, ws = HealthHook(cmd, interval), workers()
    hook.next_at = time.monotonic()  # (the first check at once)
    started, t0 = False, time.monotonic()
    try:
        while time.monotonic() - t0 < limit:
            found = hook.poll(time.monotonic(), ws)
            if found or (started and hook.proc is None):
                return found
            started = started or hook.proc is not None
            time.sleep(0.02)
    finally:
        hook.close()
    raise AssertionError("the check never finished")


def test_named_local_ranks_become_global_ranks_with_the_reason():
    got = run("echo ok; echo sub-healthy 1 ECC count climbing; echo sub-healthy 9 not ours; echo sub-healthy x")
    assert got == [([5], "health check: ECC count climbing")]


def test_the_check_sees_the_nodes_ranks_and_pids():
    got = run('echo "sub-healthy 3 $MINDSPEED_HA_LOCAL_RANKS|$MINDSPEED_HA_RANKS|$MINDSPEED_HA_PIDS"')
    assert got == [([7], "health check: 0,1,2,3|4,5,6,7|1004,1005,1006,1007")]


def test_a_failed_check_names_every_rank_of_the_node():
    assert run("echo nvidia-smi: GPU 2 fell off the bus; exit 3") == [
        ([4, 5, 6, 7], "health check exited 3: nvidia-smi: GPU 2 fell off the bus")]


def test_a_check_past_its_interval_is_killed_and_counts_as_failed():
    assert run("sleep 30", interval=0.3) == [([4, 5, 6, 7], "health check ran past 0.3s")]


def test_a_quiet_check_names_nobody():
    assert run("echo all good", interval=0.2) == []
