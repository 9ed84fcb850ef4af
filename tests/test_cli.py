"""The operator's commands (status, inject, migrate) answer every way they cannot reach a job with one
line on stderr that says what to pass, exit code 2, and no traceback: keys elsewhere, no controller
yet, another job's log dir or keys, a rank out of range, a controller that does not answer."""
import json
import os
import subprocess
import sys

import pytest
import zmq.auth

from helpers import clean_env, free_port
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.control.wire import security
from mindspeed_ha.control.wire.announcement import write_controller_json
from mindspeed_ha.options import HAOptions

MINDSPEED_HA = [sys.executable, "-m", "mindspeed_ha.cli"]


def cli(*args, env=None, cwd=None):
    return subprocess.run(MINDSPEED_HA + [str(a) for a in args], env=clean_env(env), capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def one_line(proc, *words):
    """Exit 2, no traceback, and stderr ends with one line that names each of ``words``."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("mindspeed-ha "), proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def keygen(path):
    subprocess.run(MINDSPEED_HA + ["keygen", str(path)], check=True, capture_output=True)
    return path


def announce(log_dir, keys, job="job-a", world=4, port=None, secure=True):
    """A controller.json as a job's controller writes it (nobody listens at its port)."""
    public = zmq.auth.load_certificate(os.path.join(keys, "server.key"))[0].decode() if keys else None
    port = port or free_port()
    write_controller_json(str(log_dir), {"host": "127.0.0.1", "port": port, "endpoint": f"tcp://127.0.0.1:{port}",
                                         "server_public_key": public, "secure": secure, "epoch": 1, "rank": 0,
                                         "pid": 1, "job_id": job, "world_size": world})


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["inject", "--kind", "uce", "--rank", "1"],
                                     ["migrate", "--rank", "1"]])
def test_no_controller_yet(tmp_path, command):
    proc = cli(command[0], "--log-dir", tmp_path / "nothing-here", *command[1:])
    one_line(proc, "no controller is announced", "--log-dir", "--job-store")


def test_a_job_started_with_keys_elsewhere(tmp_path):
    """The job runs with --ha-key-dir K; the operator asks without it (the keys are not in the log
    dir): one line naming --ha-key-dir. With it, the controller answers."""
    keys = keygen(tmp_path / "k")
    log_dir = str(tmp_path / "logs")
    opts = HAOptions(strategies=frozenset({"dump"}), log_dir=log_dir, key_dir=str(keys))
    c = Controller(log_dir, 4, opts, security.Keys.load(log_dir, str(keys)), host="127.0.0.1", job_id="job-a").start()
    try:
        for command in (["status"], ["inject", "--kind", "exit", "--rank", "2"], ["migrate", "--rank", "2"]):
            one_line(cli(command[0], "--log-dir", log_dir, *command[1:]), "no CurveZMQ keys", "--ha-key-dir")
        ok = cli("status", "--log-dir", log_dir, "--ha-key-dir", keys, "--json")
        assert ok.returncode == 0 and json.loads(ok.stdout)["state"] == "init", ok.stderr
        one_line(cli("inject", "--log-dir", log_dir, "--ha-key-dir", keys, "--kind", "exit", "--rank", "4"),
                 "no rank 4", "--rank 0..3")
        refused = cli("migrate", "--log-dir", log_dir, "--ha-key-dir", keys, "--rank", "2")  # reached: it refuses
        assert refused.returncode == 1 and "rank 2 is not a live registered rank" in refused.stderr, refused.stderr
    finally:
        c.close()


def test_a_log_dir_of_another_job(tmp_path):
    """controller.json of job A, asked with job B's keys, or from an environment naming job B."""
    log_dir, keys_a, keys_b = tmp_path / "logs", keygen(tmp_path / "a"), keygen(tmp_path / "b")
    announce(log_dir, keys_a, job="job-a")
    one_line(cli("status", "--log-dir", log_dir, "--ha-key-dir", keys_b), "are not job job-a's", "--ha-key-dir")
    one_line(cli("status", "--log-dir", log_dir, "--ha-key-dir", keys_a, env={"MINDSPEED_HA_JOB_ID": "job-b"}),
             "not job job-b's", "--log-dir")


def test_a_rank_out_of_range(tmp_path):
    log_dir, keys = tmp_path / "logs", keygen(tmp_path / "k")
    announce(log_dir, keys, world=4)
    for command in (["inject", "--kind", "uce"], ["migrate"]):
        for rank in ("4", "-1"):
            one_line(cli(command[0], "--log-dir", log_dir, "--ha-key-dir", keys, *command[1:], "--rank", rank),
                     f"no rank {rank}", "--rank 0..3")


def test_a_controller_that_does_not_answer_and_mismatched_security(tmp_path):
    """An announcement nobody answers (the job ended): the line keeps "no controller answered" and
    says what to pass; a secure job asked with --ha-insecure, an insecure one without it."""
    log_dir, keys = tmp_path / "logs", keygen(tmp_path / "k")
    announce(log_dir, keys)
    line = one_line(cli("migrate", "--log-dir", log_dir, "--ha-key-dir", keys, "--rank", "1", "--timeout", "0.3"),
                    "no controller answered", "--log-dir", "--timeout")
    assert "job-a" in line
    one_line(cli("status", "--log-dir", log_dir, "--ha-insecure"), "drop --ha-insecure")
    open_job = tmp_path / "insecure"
    announce(open_job, None, secure=False)
    one_line(cli("status", "--log-dir", open_job), "pass --ha-insecure")


def test_a_job_store_that_is_no_address(tmp_path):
    one_line(cli("status", "--log-dir", tmp_path, "--job-store", "node0"), "--job-store HOST:PORT")


def test_status_shows_the_event_logs_faults_before_its_line(tmp_path):
    """A job whose controller is gone: the faults its event log kept, then the line on stderr."""
    log_dir = tmp_path / "logs"
    os.makedirs(log_dir / "events")
    fault = {"event": "fault", "ranks": [1], "kind": "process-exit", "iteration": 3, "phase": "forward",
             "detect_s": 0.01}
    (log_dir / "events" / "controller.jsonl").write_text(json.dumps(fault) + "\n")
    proc = cli("status", "--log-dir", log_dir)
    one_line(proc, "no controller is announced")
    assert "fault: ranks [1] process-exit at iteration 3" in proc.stdout
    as_json = cli("status", "--log-dir", log_dir, "--json")
    one_line(as_json)
    assert json.loads(as_json.stdout)["state"] == "unreachable"


def test_the_report_reads_a_log_written_before_the_events_were_renamed(tmp_path):
    """A controller log of an older release (its events as it named them: ``repair_plan``,
    ``repair_failed``, ``elastic_plan``, states ``repair`` and ``rollback``) reads with today's names,
    and the report tells its episodes as it tells a new log's."""
    from mindspeed_ha import report
    from mindspeed_ha.events import read_events
    old = [
        {"event": "state", "from": "init", "to": "normal", "outcome": "registered", "time": 1.0},
        {"event": "fault", "ranks": [1], "kind": "memory-error", "iteration": 6, "phase": "backward", "time": 2.0},
        {"event": "strategy", "outcome": "retry", "reason": "strategy retry", "time": 2.1},
        {"event": "state", "from": "decide", "to": "repair", "outcome": "retry", "time": 2.1},
        {"event": "repair_plan", "iteration": 5, "pairs": [3, 1], "joiners": [], "generation": 1, "time": 2.2},
        {"event": "repair_failed", "reason": "rebuild failed (rank 2: boom)", "strategy": "retry", "time": 2.5},
        {"event": "checkpoint", "kind": "dying_gasp", "iteration": 5, "seconds": 0.4, "time": 3.0},
        {"event": "diagnosis", "text": "...", "exit_code": 1, "time": 3.1},
        {"event": "fault", "ranks": [2], "kind": "process-exit", "iteration": 9, "phase": "forward", "time": 4.0},
        {"event": "strategy", "outcome": "elastic", "reason": "strategy elastic-training", "time": 4.1},
        {"event": "elastic_plan", "iteration": 8, "dp": 2, "old_dp": 4, "time": 4.2},
        {"event": "repair_failed", "reason": "scale-in failed (rank 0: boom)", "strategy": "elastic-training",
         "time": 4.5},
    ]
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "controller.jsonl").write_text("".join(json.dumps(e) + "\n" for e in old))
    got = read_events(str(tmp_path / "events" / "controller.jsonl"))
    assert [(e["event"], e.get("renamed_from")) for e in got if "renamed_from" in e] == [
        ("restore_plan", "repair_plan"), ("strategy_failed", "repair_failed"), ("resize_plan", "elastic_plan"),
        ("strategy_failed", "repair_failed")]
    eps = report.episodes(str(tmp_path))
    assert [(ep["strategy"], ep["outcome"]) for ep in eps] == [
        ("retry", "dump of iteration 5 in 0.40s, exit 1"),
        ("elastic-training", "elastic-training failed: scale-in failed (rank 0: boom)")]
