"""Real 4-rank gloo jobs under ``mindspeed-ha run``: faults end the job cleanly with a diagnosis."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import free_port
from workers.jobs import alive, events, finish, launch, wait_for, worker_pids

pytestmark = pytest.mark.timeout(120)


def _fault_time(log_dir, rank):
    inj = [e for e in events(log_dir, f"rank_{rank}") if e["event"] == "inject"]
    assert inj, "the fault never fired"
    return inj[0]


def _no_process_left(log_dir, nodes=(0,)):
    pids = [p for n in nodes for p in worker_pids(log_dir, n)]
    assert pids
    assert wait_for(lambda: not any(alive(p) for p in pids), 5), "a worker outlived the job"


def _check_clean_end(log_dir, rc, err, t_end, rank, kind, phase=None, limit=10.0):
    inj = _fault_time(log_dir, rank)
    assert rc != 0
    ctl = events(log_dir, "controller")
    diag = [e for e in ctl if e["event"] == "diagnosis"]
    assert diag, err[-3000:]
    text = diag[-1]["text"]
    assert f"rank {rank} " in text and kind in text and f"iteration {inj['iteration']}" in text
    if phase:
        assert f"phase {phase}" in text
    assert text in err  # the launcher's stderr carries the diagnosis
    faults = [e for e in ctl if e["event"] == "fault"]
    assert any(rank in f["ranks"] for f in faults)
    assert diag[-1]["time"] - inj["time"] < limit
    assert t_end - inj["time"] < limit, f"ended {t_end - inj['time']:.1f}s after the fault"
    # This worker has no trainer state: the dying gasp (always on) finds nothing to save and the job ends.
    # (A controller of its own process — `mindspeed-ha controller` — may write its last state a moment
    # after the launcher's end on a loaded host: it is waited for.)
    def states():
        return [(e["from"], e["to"]) for e in events(log_dir, "controller") if e["event"] == "state"]
    wait_for(lambda: [s for _, s in states()][-1:] == ["done"], 10)
    got = states()
    assert ("normal", "pause") in got and ("dump", "exit") in got and got[-1][1] == "done", got
    return text


@pytest.mark.parametrize("phase", ["forward", "backward", "grad-sync", "optimizer"])
def test_kill_nonzero_rank_each_phase(tmp_path, phase):
    p = launch(tmp_path, "--steps", "400", "--fault", f"kill:rank=2:step=3:phase={phase}")
    rc, out, err, t_end = finish(p)
    text = _check_clean_end(tmp_path, rc, err, t_end, 2, "process-exit", phase)
    assert "signal 9" in text
    _no_process_left(tmp_path)


@pytest.mark.alone  # (asserts a latency)
def test_exception_reported_at_once(tmp_path):
    p = launch(tmp_path, "--steps", "400", "--fault", "exception:rank=1:step=2:phase=backward")
    rc, out, err, t_end = finish(p)
    _check_clean_end(tmp_path, rc, err, t_end, 1, "other", "backward")
    f = [e for e in events(tmp_path, "controller") if e["event"] == "fault"][0]
    assert f["ranks"] == [1] and f["kind"] == "other" and f["detect_s"] < 1.0
    _no_process_left(tmp_path)


def test_clean_run_exits_zero(tmp_path):
    rc, out, err, _ = finish(launch(tmp_path, "--steps", "10"))
    assert rc == 0, err[-3000:]
    ctl = events(tmp_path, "controller")
    assert [e["to"] for e in ctl if e["event"] == "state"] == ["normal", "done"]
    assert not [e for e in ctl if e["event"] == "fault"]


def test_rank0_killed_backup_takes_over(tmp_path):
    p = launch(tmp_path, "--steps", "400", "--fault", "kill:rank=0:step=25:phase=forward")
    rc, out, err, t_end = finish(p)
    ctl = events(tmp_path, "controller")
    take = [e for e in ctl if e["event"] == "takeover"]
    assert take, err[-3000:]
    assert take[0]["rank"] in (1, 2, 3) and take[0]["epoch"] == 2
    info = json.load(open(tmp_path / "controller.json"))
    assert info["rank"] == take[0]["rank"] and info["epoch"] == 2
    _check_clean_end(tmp_path, rc, err, t_end, 0, "process-exit")
    _no_process_left(tmp_path)


def test_hang_detected(tmp_path):
    p = launch(tmp_path, "--steps", "400", "--ha-hang-timeout", "3", "--fault", "hang:rank=1:step=6:phase=forward")
    rc, out, err, t_end = finish(p)
    inj = _fault_time(tmp_path, 1)
    faults = [e for e in events(tmp_path, "controller") if e["event"] == "fault"]
    assert faults and faults[0]["kind"] == "hang" and faults[0]["ranks"] == [1], faults
    assert faults[0]["time"] - inj["time"] < 3 + 2.0
    _check_clean_end(tmp_path, rc, err, t_end, 1, "hang", "forward", limit=3 + 10)
    _no_process_left(tmp_path)


def test_two_nodes_on_loopback(tmp_path):
    port = str(free_port())
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "mindspeed_ha.cli", "keygen", str(keys)], check=True, capture_output=True)
    env = {"MINDSPEED_HA_JOB_ID": "", "MINDSPEED_HA_KEY_DIR": str(keys)}
    p0 = launch(tmp_path, "--steps", "400", "--fault", "kill:rank=3:step=3:phase=grad-sync", nproc=2,
                agent_args=common + ["--node-rank", "0"], env=env)
    p1 = launch(tmp_path, "--steps", "400", "--fault", "kill:rank=3:step=3:phase=grad-sync", nproc=2,
                agent_args=common + ["--node-rank", "1"], env=env)
    rc1, _, err1, t1 = finish(p1)
    rc0, _, err0, t0 = finish(p0)
    text = _check_clean_end(tmp_path, rc0, err0, max(t0, t1), 3, "process-exit", "grad-sync")
    assert rc1 != 0 and text in err1
    ranks = [e for e in events(tmp_path, "rank_0") if e["event"] == "controller"]
    assert ranks
    standby = [e["rank"] for e in events(tmp_path, "controller") if e["event"] == "standby"]
    assert 2 in standby  # a backup on the other node (ranks 2, 3 live on node 1)
    _no_process_left(tmp_path, nodes=(0, 1))


def test_status_and_inject_on_live_job(tmp_path):
    p = launch(tmp_path, "--steps", "100000", "--step-time", "0.05")
    try:
        cli = [sys.executable, "-m", "mindspeed_ha.cli"]

        def status():
            r = subprocess.run(cli + ["status", "--log-dir", str(tmp_path), "--json"], capture_output=True,
                               text=True, timeout=30)
            if r.returncode:
                return None
            st = json.loads(r.stdout)
            return st if st["state"] == "normal" and all(x["iteration"] >= 1 for x in st["ranks"]) else None
        st = wait_for(status, 60, 0.5)
        assert st, "no live status"
        assert [r["rank"] for r in st["ranks"]] == [0, 1, 2, 3]
        assert st["controller"]["rank"] == 0 and len(st["backups"]) == 2
        assert st["ranks"][1]["replica_groups"] == [[1, 3]]
        human = subprocess.run(cli + ["status", "--log-dir", str(tmp_path)], capture_output=True, text=True,
                               timeout=30)
        assert "state normal" in human.stdout
        # a stranger (no keys) is refused
        stranger = subprocess.run(cli + ["status", "--log-dir", str(tmp_path), "--ha-insecure", "--timeout", "1"],
                                  capture_output=True, text=True, timeout=30)
        assert stranger.returncode != 0
        r = subprocess.run(cli + ["inject", "--log-dir", str(tmp_path), "--kind", "exit", "--rank", "2"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        rc, out, err, t_end = finish(p)
        _check_clean_end(tmp_path, rc, err, t_end, 2, "process-exit", "forward")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    _no_process_left(tmp_path)


def test_sigterm_forwarded(tmp_path):
    p = launch(tmp_path, "--steps", "100000")
    assert wait_for(lambda: len([e for e in events(tmp_path, "controller") if e["event"] == "standby"]) == 2, 60)
    os.kill(p.pid, signal.SIGTERM)
    rc, out, err, _ = finish(p, 20)
    assert rc == 128 + signal.SIGTERM
    _no_process_left(tmp_path)


# The controller on a head node: torch is not importable in its process (the control plane needs none).
NO_TORCH = ("import sys; sys.modules['torch'] = None\n"
            "from mindspeed_ha.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")


def test_standalone_controller(tmp_path):
    """`mindspeed-ha controller` on a head node without torch, where MindSpore's MS_TFT_IP/MS_TFT_PORT
    say it listens: the job finds it there (its controller.json is removed), no rank hosts one."""
    tft = {"MS_TFT_IP": "127.0.0.1", "MS_TFT_PORT": str(free_port())}
    ctl = subprocess.Popen([sys.executable, "-c", NO_TORCH, "controller", "--log-dir", str(tmp_path),
                            "--world-size", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **tft})
    try:
        assert wait_for(lambda: (tmp_path / "controller.json").exists(), 30)
        assert json.load(open(tmp_path / "controller.json"))["port"] == int(tft["MS_TFT_PORT"])
        os.unlink(tmp_path / "controller.json")
        p = launch(tmp_path, "--steps", "400", "--fault", "exit:rank=1:step=3:phase=optimizer", env=tft)
        rc, out, err, t_end = finish(p)
        text = _check_clean_end(tmp_path, rc, err, t_end, 1, "process-exit", "optimizer")
        assert "exit code 1" in text
        _, cerr = ctl.communicate(timeout=20)
        assert ctl.returncode == 1 and text in cerr
        assert not [e for e in events(tmp_path, "rank_0") if e["event"] == "takeover"]
    finally:
        if ctl.poll() is None:
            ctl.kill()
    _no_process_left(tmp_path)


def test_agent_reports_exits_and_obeys_restart(tmp_path):
    """The agent against a controller socket driven by the test: exit reports arrive at once with
    pid, code and signal; ``restart`` brings one worker back; ``exit`` ends the node."""
    import zmq
    from mindspeed_ha.control.wire import protocol, security
    from mindspeed_ha.control.wire.announcement import write_controller_json
    keys = security.Keys.load(str(tmp_path), create=True)
    ctx = zmq.Context()
    srv = ctx.socket(zmq.ROUTER)
    srv.linger = 0
    security.start_authenticator(ctx, keys)
    security.secure_server(srv, keys)
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    write_controller_json(str(tmp_path), {"endpoint": f"tcp://127.0.0.1:{port}", "host": "127.0.0.1",
                                          "port": port, "epoch": 1, "job_id": "job-x"})
    sleeper = os.path.join(os.path.dirname(__file__), "workers", "sleeper.py")
    env = dict(os.environ, MINDSPEED_HA_JOB_ID="job-x", MINDSPEED_HA_LOG_DIR=str(tmp_path),
               MINDSPEED_HA_CONTROLLER="external")
    agent = subprocess.Popen([sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone",
                              "--nproc-per-node", "2", sleeper, "60"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)

    # (orders go where the agent last spoke from, as the controller sends them: a starved agent
    # whose hello went unanswered for its answer wait reconnects, a new socket of a new identity)
    agent_at = {}

    def recv(t, timeout=20.0, when=lambda msg: True):
        end = time.time() + timeout
        while time.time() < end:
            if srv.poll(100):
                agent_at["ident"], data = srv.recv_multipart()
                msg = protocol.decode(data)
                if msg["t"] in ("agent", "agent_hb"):
                    srv.send_multipart([agent_at["ident"], protocol.encode("ack", epoch=1, state="normal")])
                if msg["t"] == t and when(msg):
                    return msg
        raise AssertionError(f"no {t}")

    def order(action, **args):
        srv.send_multipart([agent_at["ident"], protocol.encode("do", action=action, id=0, args=args, epoch=1)])
    try:
        hello = recv("agent")
        assert hello["ranks"] == [0, 1] and len(hello["pids"]) == 2
        os.kill(hello["pids"][1], signal.SIGKILL)
        t0 = time.time()
        ex = recv("exit")
        assert time.time() - t0 < 1.0
        assert (ex["rank"], ex["pid"], ex["signal"]) == (1, hello["pids"][1], signal.SIGKILL)
        order("restart", ranks=[1])
        # (not a reconnect's hello; a loaded host may take a while to start the worker again)
        hello2 = recv("agent", timeout=60.0, when=lambda msg: msg["pids"] != hello["pids"])
        assert hello2["pids"][0] == hello["pids"][0] and hello2["pids"][1] != hello["pids"][1]
        order("exit", code=3, diagnosis="bye")
        out, err = agent.communicate(timeout=20)
        assert agent.returncode == 3 and "bye" in err
        assert "restart 1" in out
        assert not any(alive(p) for p in hello["pids"] + hello2["pids"])
    finally:
        if agent.poll() is None:
            agent.kill()
        srv.close()
        security.stop_authenticator(ctx)
        ctx.term()


def test_per_rank_log_files_and_prefixed_console(tmp_path):
    """torchrun's --log-dir and --tee: each rank's stdout and stderr in its own file (torch's layout),
    and on the agent's console with the rank in front of every line."""
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('hello from', os.environ['RANK'])\n"
                      "print('warning from', os.environ['RANK'], file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", "2",
                        "--log-dir", str(tmp_path / "out"), "--tee", "3", str(script), "--ha-log-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for r in (0, 1):
        out = list((tmp_path / "out").glob(f"*/attempt_0/{r}/stdout.log"))
        err = list((tmp_path / "out").glob(f"*/attempt_0/{r}/stderr.log"))
        assert out and out[0].read_text() == f"hello from {r}\n"
        assert err and err[0].read_text() == f"warning from {r}\n"
        assert f"[default{r}]:hello from {r}" in p.stdout and f"[default{r}]:warning from {r}" in p.stderr
