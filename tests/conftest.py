import fcntl
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import References  # noqa: E402  (tests/ on the path first)


@pytest.fixture(autouse=True)
def every_drill_fired(request):
    """A fault drill that never fired tested nothing: the test fails on it (its rank's
    ``drill_unfired`` event), unless it is marked ``drill_may_not_fire``."""
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if tmp is None or request.node.get_closest_marker("drill_may_not_fire"):
        return
    never = sorted({line for path in Path(tmp).rglob("rank_*.jsonl") for line in path.read_text().splitlines()
                    if '"drill_unfired"' in line})
    if never:
        pytest.fail("fault drill(s) never fired:\n" + "\n".join(never), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """Each session's (each xdist worker's) fork server: most of a small job's start is its spare
    template importing torch and megatron-core, and the suite starts hundreds of jobs. The jobs do
    not wait for it (an agent starts its template as a process while the server is not up yet), and
    those whose interpreter options differ start theirs as processes. MINDSPEED_HA_TEST_FORK_SERVER=0
    turns it off."""
    if os.environ.get("MINDSPEED_HA_TEST_FORK_SERVER") == "0":
        yield None
        return
    import subprocess
    import helpers
    path = os.path.join(tempfile.gettempdir(), f"msha-fork-{os.getpid()}.sock")
    preload = ["torch", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
               "megatron.core.datasets.gpt_dataset", "megatron.core.dist_checkpointing"]
    server = subprocess.Popen([sys.executable, "-m", "mindspeed_ha.launcher.fork_server", path, *preload],
                              env=helpers.clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              start_new_session=True)
    helpers.FORK_SERVER = path
    yield path
    helpers.FORK_SERVER = None
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    if os.path.exists(path):
        os.unlink(path)


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """Fault-free runs shared by every test of the session (helpers.References)."""
    return References(tmp_path_factory)


# README's test command runs two pytest-xdist workers: a drill leaves a core idle much of its time
# (the agent's start, the controller's waits), so two fill this 2-core machine (test_ttp.py: 376 s
# with two workers against about 450 s with one, before the fork server). A test marked ``alone``
# asserts a latency (a detection or an abort within a second) that the other worker's jobs would
# skew: it runs with no other test beside it. Two locks, so that a test
# waiting to run alone is not starved by the other worker's stream of shared ones: each test passes
# the turnstile (exclusively, briefly) before it takes the machine (shared, or exclusive if alone).
@contextmanager
def _machine(alone: bool):
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:  # (one process: nothing runs beside it)
        yield
        return
    base = Path(tempfile.gettempdir()) / f"mindspeed-ha-tests-{uid}"
    fds = [os.open(f"{base}.{name}.lock", os.O_CREAT | os.O_RDWR, 0o600) for name in ("turnstile", "machine")]
    turnstile, machine = fds
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    finally:
        for fd in fds:
            os.close(fd)  # (closing releases the locks)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The whole of a test (its module's fixtures' set-up included) under the machine's lock."""
    with _machine(item.get_closest_marker("alone") is not None):
        yield

