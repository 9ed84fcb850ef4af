"""Proactive migration end to end under `mindspeed-ha run`: a live rank's work moves to a spare worker
between two steps — on request (`mindspeed-ha migrate`) or because it straggles — with no step
interrupted or recomputed, one new process for that rank, and every loss equal to the fault-free run's
bit for bit."""
import subprocess
import sys
import time

import pytest

from helpers import (PRETRAIN, TINY, all_rank_events, assert_ok, clean_env, events, extended_test, losses, recomputed,
                     twins_agree)

MINDSPEED_HA = [sys.executable, "-m", "mindspeed_ha.cli"]
ITERS = 30


def command(log_dir, extra=(), nproc=4):
    return MINDSPEED_HA + ["run", "--standalone", "--nproc-per-node", str(nproc), PRETRAIN, *TINY, "--train-iters",
                           str(ITERS), "--enable-worker-reboot", "--ha-log-dir", str(log_dir),
                           "--ha-verify-replicas-interval", "1", *extra]


def run(log_dir, extra=(), inject=None, timeout=300, nproc=4):
    log_dir.mkdir(parents=True, exist_ok=True)
    env = clean_env({"MINDSPEED_HA_INJECT": inject} if inject else {})
    return subprocess.run(command(log_dir, extra, nproc), env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(log_dir))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    assert_ok(run(d))
    return losses(d)


def newest_step(log_dir) -> int:
    return max((e["iteration"] for e in events(log_dir, "rank_0") if e["event"] == "step"), default=0)


def paced(nproc=4):
    """Every rank's steps made slower (the same for all, so nobody straggles): a request lands mid-job."""
    return ",".join(f"slow:rank={r}:step=2:factor=4" for r in range(nproc))


def ask(log_dir, rank) -> tuple[int, str]:
    cli = subprocess.run(MINDSPEED_HA + ["migrate", "--log-dir", str(log_dir), "--rank", str(rank),
                                         "--reason", "test"], env=clean_env(), capture_output=True, text=True,
                         timeout=30)
    return cli.returncode, cli.stdout + cli.stderr


def migrate_live(log_dir, ranks, after_step=3, extra=(), deadline_s=180.0, arm=None, nproc=4):
    """Start a job, ask for the migration of each of ``ranks`` in turn once it has trained ``after_step``
    steps (asking again while the answer is that no spare is ready yet or the last migration is still
    going on, and only while the job has more than 5 steps to go), let it finish. Returns (process result, [(rank, exit code, answer)])."""
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(command(log_dir, extra, nproc), env=clean_env({"MINDSPEED_HA_INJECT": paced(nproc)}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(log_dir))
    answers = []
    try:
        t0 = time.monotonic()
        while newest_step(log_dir) < after_step and time.monotonic() - t0 < deadline_s and proc.poll() is None:
            time.sleep(0.05)
        if arm is not None:  # a live fault, armed before the migrations are asked for
            cli = subprocess.run(MINDSPEED_HA + ["inject", "--log-dir", str(log_dir), *arm], env=clean_env(),
                                 capture_output=True, text=True, timeout=30)
            answers.append((None, cli.returncode, cli.stdout + cli.stderr))
        for rank in ranks:
            while proc.poll() is None and newest_step(log_dir) < ITERS - 5:
                rc, text = ask(log_dir, rank)
                answers.append((rank, rc, text))
                # (transient: a spare still starting, a recovery under way, the controller handing over)
                busy = any(t in text for t in ("no spare worker is ready", "starts only while it trains",
                                                "no controller answered", "no standby stands by"))
                if rc == 0 or not busy or "--ha-spares 0" in " ".join(extra):
                    break
                time.sleep(0.3)
        out, err = proc.communicate(timeout=deadline_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), answers


def check_migrated(proc, log_dir, ref, ranks, reason_has="", recoveries=-1, nproc=4) -> list:
    """Exit 0; exactly one new process for each of ``ranks`` (none for the others); no step recomputed;
    every loss bit-identical; twins equal after every step; every rank parked between two steps."""
    assert_ok(proc)
    assert losses(log_dir) == ref
    assert recomputed(log_dir) == []
    starts = [e for e in all_rank_events(log_dir) if e["event"] == "start"]
    pids = {r: {e["pid"] for e in starts if e["rank"] == r} for r in range(nproc)}
    assert all(len(p) == (2 if r in ranks else 1) for r, p in pids.items()), pids
    ctl = events(log_dir, "controller")
    moved = [e for e in ctl if e["event"] == "migrated"]
    for m in moved:
        assert m["old_pid"] != m["new_pid"] and m["new_pid"] in pids[m["rank"]]
        assert reason_has in m["reason"] and m["bytes"] > 0 and 0 < m["pause_s"] < m["request_to_first_step_s"]
    rec = [e for e in ctl if e["event"] == "recovered"]
    assert len(rec) == len(ranks) and all(e["strategy"] == "recover" and e["lost_steps"] == 0 for e in rec), rec
    twins_agree(log_dir, rec)
    if recoveries is not None:  # (a real fault in a migration stops the ranks the usual way)
        stopped = [e for e in all_rank_events(log_dir) if e["event"] == "exception"]  # nobody left a collective
        assert not stopped, stopped
    return moved


def test_migrate_on_request(tmp_path, ref):
    """Rank 0, then ranks 1 and 2, in one job. Rank 0 hosts the controller: it hands itself over to a
    standby first, which then migrates rank 0 like any other rank."""
    proc, answers = migrate_live(tmp_path, [0, 1, 2])
    assert [r for r, rc, _ in answers if rc == 0] == [0, 1, 2], answers
    moved = check_migrated(proc, tmp_path, ref, ranks=(0, 1, 2), reason_has="test")
    assert [m["rank"] for m in moved] == [0, 1, 2]
    ctl = events(tmp_path, "controller")
    (handover,) = [e for e in ctl if e["event"] == "handover"]
    assert handover["rank"] == 0 and [e["to"] for e in ctl if e["event"] == "retired"] == [handover["to"]]
    takeover = [e for e in all_rank_events(tmp_path) + ctl if e["event"] == "takeover"]
    assert [(e["rank"], e["why"]) for e in takeover] == [(handover["to"], "handover")]


@pytest.fixture(scope="module")
def ref_tp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref_tp2")
    assert_ok(run(d, ("--tensor-model-parallel-size", "2"), nproc=8))
    return losses(d)


@extended_test  # (a migration in CI: on request and by the health hook at DP=4, a straggler in Megatron-LM's loop)
def test_migrate_a_rank_of_a_tp2_dp4_job(tmp_path, ref_tp2):
    """8 ranks, TP=2 x DP=4: rank 6 (TP rank 0 of the fourth DP replica; its twin is rank 2) moves."""
    proc, answers = migrate_live(tmp_path, [6], extra=("--tensor-model-parallel-size", "2"), nproc=8)
    assert [r for r, rc, _ in answers if rc == 0] == [6], answers
    (moved,) = check_migrated(proc, tmp_path, ref_tp2, ranks=(6,), reason_has="test", nproc=8)
    assert moved["rank"] == 6


def test_the_migrating_rank_dies_on_the_way(tmp_path, ref):
    """Rank 1 is killed the moment it parks for its migration: its state comes from its twin, as it
    would have anyway (its death is reported as a fault of the recovery when its agent sees it before
    the restart order; either way one new process takes the rank), and the job goes on, bit-identical."""
    proc, answers = migrate_live(tmp_path, [1], arm=["--kind", "kill", "--rank", "1", "--phase", "recovery"])
    assert [rc for _, rc, _ in answers][-1] == 0 and answers[0][1] == 0, answers
    check_migrated(proc, tmp_path, ref, ranks=(1,), reason_has="test", recoveries=None)
    kills = [e for e in all_rank_events(tmp_path) if e["event"] == "inject" and e["kind"] == "kill"]
    assert [(e["rank"], e["phase"]) for e in kills] == [(1, "recovery")]
    ctl = events(tmp_path, "controller")
    kinds = [f["kind"] for e in ctl if e["event"] == "recovered" for f in e["faults"]]
    assert kinds in (["migrate"], ["migrate", "process-exit"]), kinds


@pytest.mark.alone  # (weighs its ranks' speeds: the other worker's jobs make false stragglers)
def test_a_straggler_is_found_and_migrated(tmp_path, ref):
    """Rank 2 turns 4x slower from step 6: its own work per step (not its step time, which every rank
    shares) gives it away within a few steps, and it moves to a spare by itself."""
    # (ratio 3: the slowed rank shows 5-13x; on 2 shared cores a healthy rank's own work still swings
    # past 2x for 3 steps now and then, which moved a second rank in CI)
    proc = run(tmp_path, ("--ha-migrate-stragglers", "--ha-straggler-steps", "3", "--ha-straggler-ratio", "3"), inject="slow:rank=2:step=6:factor=4")
    (moved,) = check_migrated(proc, tmp_path, ref, ranks=(2,), reason_has="straggler")
    (found,) = [e for e in events(tmp_path, "controller") if e["event"] == "straggler"]
    assert found["rank"] == 2 and found["ratio"] > 3 and 6 <= found["iteration"] <= 6 + 3 + 3, found
    assert moved["pause_s"] < 30


@extended_test  # (a migration chosen by the engine in CI: the straggler drills)
def test_the_health_hook_names_a_rank_and_it_moves(tmp_path, ref):
    """The agent's --ha-health-cmd says local rank 3 is sub-healthy once (a marker file the test drops
    after step 3 stands for a climbing error count): a `sub_healthy` event, and with
    --ha-migrate-stragglers the rank moves like a straggler."""
    marker = tmp_path / "sick"
    check = f'if [ -f {marker} ]; then rm {marker}; echo "sub-healthy 3 correctable errors climbing"; fi'
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    proc = subprocess.Popen(command(log_dir, ("--ha-migrate-stragglers", "--ha-straggler-ratio", "3",
                                              "--ha-health-cmd", check, "--ha-health-interval", "0.5")),
                            env=clean_env({"MINDSPEED_HA_INJECT": paced()}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(log_dir))
    t0 = time.monotonic()
    while newest_step(log_dir) < 3 and time.monotonic() - t0 < 120 and proc.poll() is None:
        time.sleep(0.05)
    marker.touch()
    out, err = proc.communicate(timeout=180)
    (moved,) = check_migrated(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), log_dir, ref,
                              ranks=(3,), reason_has="correctable errors climbing")
    (sick,) = [e for e in events(log_dir, "controller") if e["event"] == "sub_healthy"]
    assert sick["rank"] == 3 and sick["rank_pid"] == moved["old_pid"]


@extended_test
def test_migration_refused_plainly_and_training_goes_on(tmp_path, ref):
    """With --ha-spares 0 no spare is ready for rank 2, and rank 7 is no rank of the job: each request
    is refused with the reason and what would work (rank 7 by the CLI itself, exit 2: there is no such
    rank to ask about), nothing is stopped, the job ends as if unasked."""
    proc, answers = migrate_live(tmp_path, [7, 2], extra=("--ha-spares", "0"))
    assert [(r, rc) for r, rc, _ in answers] == [(7, 2), (2, 1)], answers
    assert "no controller answered" not in answers[0][2] and "pass --rank 0..3" in answers[0][2]
    assert "no spare worker is ready" in answers[1][2] and "--ha-spares" in answers[1][2]
    assert_ok(proc)
    assert losses(tmp_path) == ref
    refused = [e["rank"] for e in events(tmp_path, "controller") if e["event"] == "migrate_refused"]
    assert refused == [2]
    assert not [e for e in events(tmp_path, "controller") if e["event"] in ("fault", "migrated")]
    cli = subprocess.run(MINDSPEED_HA + ["migrate", "--log-dir", str(tmp_path), "--rank", "1"], env=clean_env(),
                         capture_output=True, text=True, timeout=30)  # the job is over
    assert cli.returncode == 2 and "no controller answered" in cli.stderr and "Traceback" not in cli.stderr
