"""The fork server (mindspeed_ha/launcher/fork_server.py) with real processes: what it forks is the
process Popen would have started (argv, environment, working directory, stdin, a passed descriptor,
its own session, its exit code), and what it cannot start as Popen would is started by Popen."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mindspeed_ha.launcher import fork_server

# The forked script: reports what its process looks like on the passed descriptor, reads one line
# from stdin, prints it (unbuffered: -u) and exits with the code that line names.
SCRIPT = """
import json, os, sys
os.write(int(os.environ["REPORT"]), json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "mine": os.environ.get("MINE"), "pid": os.getpid(),
    "sid": os.getsid(0), "path0": sys.path[0]}).encode() + b"\\n")
line = sys.stdin.readline()
print("got", line.strip())
sys.exit(int(line))
"""


@pytest.fixture
def server(tmp_path):
    path = str(tmp_path / "fs.sock")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(fork_server.ENV, None)
    proc = subprocess.Popen([sys.executable, "-m", "mindspeed_ha.launcher.fork_server", path, "json"], env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    t0 = time.monotonic()
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() - t0 < 60
        time.sleep(0.05)
    yield path, env, proc
    proc.terminate()
    proc.wait(10)


def _start(tmp_path, env, read_fd, write_fd, extra=None):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    (tmp_path / "work").mkdir(exist_ok=True)
    p = fork_server.popen([sys.executable, "-u", str(script), "a", "b"], {**env, "MINE": "yes", **(extra or {})},
                          {"REPORT": write_fd}, cwd=str(tmp_path / "work"))
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        seen = __import__("json").loads(f.readline())
    return p, seen, script


def test_a_forked_process_is_what_popen_would_start(tmp_path, server):
    path, env, _ = server
    r, w = os.pipe()
    p, seen, script = _start(tmp_path, {**env, fork_server.ENV: path}, r, w)
    assert isinstance(p, fork_server.FromServer)
    assert seen["argv"] == [str(script), "a", "b"] and seen["cwd"] == str(tmp_path / "work")
    assert seen["mine"] == "yes" and seen["pid"] == p.pid and seen["sid"] == p.pid  # its own session
    assert seen["path0"] == str(tmp_path)  # the script's directory, as for `python script.py`
    assert p.poll() is None
    p.stdin.write(b"7\n")
    p.stdin.flush()
    assert p.wait(30) == 7 and p.returncode == 7  # the server reaped it and sent its code


def test_what_the_server_cannot_start_as_popen_would_is_a_process(tmp_path, server):
    path, env, _ = server
    r, w = os.pipe()
    # (another PYTHONPATH changes how an interpreter starts: a fork of this one would not have it)
    p, seen, _ = _start(tmp_path, {**env, fork_server.ENV: path, "PYTHONPATH": str(tmp_path)}, r, w)
    assert isinstance(p, subprocess.Popen) and seen["pid"] == p.pid
    p.stdin.write(b"3\n")
    p.stdin.close()
    assert p.wait(30) == 3


def test_without_a_server_a_process(tmp_path):
    r, w = os.pipe()
    p, _, _ = _start(tmp_path, {**os.environ, fork_server.ENV: str(tmp_path / "none.sock")}, r, w)
    assert isinstance(p, subprocess.Popen)
    p.stdin.write(b"0\n")
    p.stdin.close()
    assert p.wait(30) == 0


def test_the_servers_death_leaves_the_process_and_ends_its_handle_once_it_ends(tmp_path, server):
    path, env, proc = server
    r, w = os.pipe()
    p, _, _ = _start(tmp_path, {**env, fork_server.ENV: path}, r, w)
    proc.kill()
    proc.wait()
    assert p.poll() is None  # the process runs on, its code unknown yet
    p.stdin.write(b"5\n")
    p.stdin.flush()
    assert p.wait(30) == 1  # (nobody can report its real code now: 1, as for a spare the template lost)
