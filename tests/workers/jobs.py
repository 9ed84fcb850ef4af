"""Launch small jobs under ``mindspeed-ha run`` for tests and read what they left behind."""
import os
import signal
import subprocess
import sys
import time

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ha_worker.py")


def launch(log_dir, *worker_args, nproc=4, agent_args=(), env=None):
    e = dict(os.environ)
    e.setdefault("MINDSPEED_HA_DEAD_AFTER", "3")  # a loaded 2-core box starves threads; tests that
    e.update(env or {})                            # measure heartbeat detection set their own
    e.pop("MINDSPEED_HA_JOB_ID", None)
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", *agent_args]
    if "--nnodes" not in agent_args:
        cmd.append("--standalone")
    cmd += ["--nproc-per-node", str(nproc), WORKER, "--ha-log-dir", str(log_dir), *worker_args]
    return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(p, timeout=60):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"job did not end in {timeout}s:\n{err[-4000:]}")
    return p.returncode, out, err, time.time()


def events(log_dir, name):
    from mindspeed_ha.events import read_events
    return read_events(os.path.join(str(log_dir), "events", f"{name}.jsonl"))


def worker_pids(log_dir, node_rank=0):
    return [e["worker_pid"] for e in events(log_dir, f"agent_{node_rank}") if e["event"] == "worker_start"]


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(pred, timeout, step=0.1):
    t = time.time()
    while time.time() - t < timeout:
        v = pred()
        if v:
            return v
        time.sleep(step)
    return None
