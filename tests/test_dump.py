"""TTP dying-gasp checkpoint: the planner (table tests) and the rank-side writer on real 4-rank jobs.

The writer tests launch one process per rank (``tests/workers/dump_worker.py``; torchrun would kill
the survivors when a rank leaves), then resume with the ordinary ``--load`` of the built-in trainer.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY, assert_ok, clean_env, losses, torchrun
from mindspeed_ha.recovery.dump import plan_dump

WORKER = str(Path(__file__).resolve().parent / "workers" / "dump_worker.py")
K, LAST = 3, 5  # the fault lands after iteration K; the resumed runs go on to LAST


# ------------------------------------------------------------------------------------------------
# plan_dump
# ------------------------------------------------------------------------------------------------
def H(it, upd=False, alive=True, touched=None, group=None):
    h = {"iteration": it, "updating": upd, "alive": alive, "replica_group": group}
    if touched is not None:
        h["touched"] = touched
    return h


def dp4(states):
    """DP=4, two instances: replica groups [0,2] and [1,3]. states: rank -> H(...) without group."""
    groups = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    return {r: {**h, "replica_group": groups[r]} for r, h in states.items()}


DEAD = dict(alive=False)
CASES = [
    # (name, states, expected iteration or None, expected writers {shard: rank} or None)
    ("all at rest at N, rank 1 dead", {0: H(6), 1: H(6, **DEAD), 2: H(6), 3: H(6)}, 6, {(0, 2): 0, (1, 3): 3}),
    ("fault during forward of N+1: everyone at N", {0: H(6), 1: H(6, **DEAD), 2: H(6), 3: H(6)}, 6, None),
    ("rank 0 dead: its peer writes", {0: H(6, **DEAD), 1: H(6), 2: H(6), 3: H(6)}, 6, {(0, 2): 2, (1, 3): 1}),
    # Killed inside its update: peers that began theirs finish them -> N (= it + 1).
    ("dead mid-update, others mid-update", {0: H(5, True), 1: H(5, True, **DEAD), 2: H(5, True), 3: H(5, True)},
     6, {(0, 2): 0, (1, 3): 3}),
    # Some finished (param-sync reached), some still updating: all end at N.
    ("mixed finished and finishing", {0: H(6), 1: H(5, True, **DEAD), 2: H(5, True), 3: H(6)}, 6,
     {(0, 2): 0, (1, 3): 3}),
    # Stopped before touching the shard (grad-norm all-reduce never completed): everyone at N-1.
    ("untouched updates stay at N-1", {0: H(5, True, touched=False), 1: H(5, True, **DEAD),
                                        2: H(5, True, touched=False), 3: H(5, True, touched=False)}, 5,
     {(0, 2): 0, (1, 3): 3}),
    # One holder of a shard is at N, its peer untouched at N-1; the other shard only at N -> N.
    ("newest common wins", {0: H(6), 1: H(6), 2: H(5, True, touched=False), 3: H(6, **DEAD)}, 6,
     {(0, 2): 0, (1, 3): 1}),
    ("prefer a holder at rest over one finishing", {0: H(5, True), 1: H(6, **DEAD), 2: H(6), 3: H(6)}, 6,
     {(0, 2): 2, (1, 3): 3}),
    ("dead ranks' iterations do not matter", {0: H(6), 1: H(99, **DEAD), 2: H(6), 3: H(6)}, 6, None),
    ("iteration 0 (no step yet)", {0: H(0), 1: H(0, **DEAD), 2: H(0), 3: H(0)}, 0, None),
    ("no fault at all", {0: H(4), 1: H(4), 2: H(4), 3: H(4)}, 4, {(0, 2): 0, (1, 3): 1}),
]


@pytest.mark.parametrize("name,states,iteration,writers", CASES, ids=[c[0] for c in CASES])
def test_plan_dump_table(name, states, iteration, writers):
    plan = plan_dump(dp4(states))
    assert plan.ok, plan.message()
    assert plan.iteration == iteration
    if writers is not None:
        assert plan.writers == writers
    holders = dp4(states)
    for shard, w in plan.writers.items():  # one live writer per shard, holding that shard, at the target
        assert w in shard and holders[w]["alive"]
    assert set(plan.writers) == {(0, 2), (1, 3)}
    assert set(plan.writers.values()) <= set(plan.at_target)
    assert str(iteration) in plan.message()


REFUSALS = [
    ("replica pair 0,2 lost", {0: H(6, **DEAD), 1: H(6), 2: H(6, **DEAD), 3: H(6)}, [(0, 2)], "every replica lost"),
    ("everyone lost", {r: H(6, **DEAD) for r in range(4)}, [(0, 2), (1, 3)], "every replica lost"),
    # Shard (0,2) only at N-1 (its N holder died, the other never touched its shard), shard (1,3)
    # only at N (both finished): no common iteration.
    ("holders at different iterations", {0: H(6, **DEAD), 2: H(5, True, touched=False), 1: H(6), 3: H(6)}, [],
     "cannot be brought to one iteration"),
]


@pytest.mark.parametrize("name,states,missing,why", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_plan_dump_refusals(name, states, missing, why):
    plan = plan_dump(dp4(states), fallback=(4, "/ck/iter_0000004"))
    assert not plan.ok and plan.iteration is None and not plan.writers
    assert list(plan.missing) == missing
    msg = plan.message()
    assert why in msg and "nothing written" in msg and "iteration 4 in /ck/iter_0000004" in msg
    for shard in missing:
        assert str(list(shard)) in msg
    assert "no periodic checkpoint" in plan_dump(dp4(states)).message()


def test_plan_dump_exhaustive_dp4():
    """Every combination of (alive, at rest / finishing / untouched) for 4 ranks around N=6: a plan is
    either a refusal or names, for each shard, a live writer whose shard is (or will be) at the
    target, and the target is the newest such iteration."""
    import itertools
    kinds = {"rest6": H(6), "rest5": H(5), "fin": H(5, True), "untouched": H(5, True, touched=False),
             "dead": H(6, **DEAD)}
    serv = {"rest6": {6}, "rest5": {5}, "fin": {6}, "untouched": {5}, "dead": set()}
    shards = {(0, 2): (0, 2), (1, 3): (1, 3)}
    for combo in itertools.product(kinds, repeat=4):
        plan = plan_dump(dp4({r: kinds[k] for r, k in enumerate(combo)}))
        per = {s: set().union(*(serv[combo[r]] for r in ranks)) for s, ranks in shards.items()}
        common = set.intersection(*per.values())
        assert plan.ok == bool(common), (combo, plan)
        if plan.ok:
            assert plan.iteration == max(common)
            for s, w in plan.writers.items():
                assert w in s and plan.iteration in serv[combo[w]], (combo, plan)
        else:
            assert list(plan.missing) == [s for s, v in per.items() if not v]


def test_plan_dump_rejects_inconsistent_groups():
    with pytest.raises(ValueError):
        plan_dump({0: H(1, group=[1, 2]), 1: H(1, group=[1, 2]), 2: H(1, group=[1, 2])})


# ------------------------------------------------------------------------------------------------
# Real jobs
# ------------------------------------------------------------------------------------------------
def free_port() -> int:
    """A free port below the ephemeral range: the store is bound seconds after this check, and the
    kernel hands ephemeral ports to every gloo connection of the jobs running meanwhile."""
    import random
    lo, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(200):
        port = random.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def launch_ranks(nproc, args, cwd, env, timeout=150):
    """One process per rank on 127.0.0.1 (no torchrun: a rank leaving must not kill the others).
    Returns [(returncode, stdout, stderr)] per rank."""
    import time
    base = clean_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc),
                      "DUMP_STORE_PORT": str(free_port()), **env})
    procs, files = [], []
    for r in range(nproc):
        out, err = (open(Path(cwd) / f"rank{r}.{k}", "w+") for k in ("out", "err"))
        files.append((out, err))
        procs.append(subprocess.Popen([sys.executable, WORKER, *args], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                                      cwd=str(cwd), text=True, stdout=out, stderr=err, start_new_session=True))
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:  # each rank leads its own session: this reaches only its leftovers
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
    outs = []
    for p, (out, err) in zip(procs, files):
        out.seek(0), err.seek(0)
        outs.append((p.wait(), out.read(), err.read()))
        out.close(), err.close()
    if any(c == -9 for c, _, _ in outs):
        raise AssertionError("harness job timed out:\n" + "\n".join(e[-3000:] for _, _, e in outs))
    return outs


def result_of(outs) -> dict:
    for _, out, _ in outs:
        for line in out.splitlines():
            if line.startswith("DUMP_RESULT "):
                return json.loads(line[len("DUMP_RESULT "):])
    raise AssertionError("no DUMP_RESULT:\n" + "\n".join(f"rc={c}\n{e[-3000:]}" for c, _, e in outs))


def job_args(save_dir, *extra):
    return [*TINY, "--train-iters", str(LAST), "--enable-high-availability", "--save", str(save_dir), *extra]


FAULTS = {"rank1": "1", "rank0": "0"}  # rank 0 also served the job's store and was every main replica


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """4-rank jobs, run side by side to save wall time:
    * faults: rank 1 (or rank 0) leaves after iteration K, the survivors write the dying gasp;
    * the reference: the same job without a fault (with a periodic save at K, like a user's run)."""
    from concurrent.futures import ThreadPoolExecutor
    d = tmp_path_factory.mktemp("dump")
    (d / "ref").mkdir()
    with ThreadPoolExecutor(len(FAULTS) + 1) as pool:
        ref = pool.submit(torchrun, 4, job_args(d / "ref" / "ck", "--save-interval", str(K)), d / "ref", None, 200)
        faults = {}
        for name, kill in FAULTS.items():
            (d / name).mkdir()
            faults[name] = pool.submit(launch_ranks, 4, job_args(d / name / "ck", "--ha-log-dir", str(d / name / "log")),
                                       d / name, {"DUMP_STEPS": str(K), "DUMP_KILL": kill}, 200)
        proc = ref.result()
        out = {"dir": d, "ref_losses": losses(d / "ref")}
        for name, kill in FAULTS.items():
            outs = faults[name].result()
            want = [17 if str(r) == kill else 0 for r in range(4)]
            assert [c for c, _, _ in outs] == want, "\n".join(f"rc={c}\n{e[-4000:]}" for c, _, e in outs)
            out[name] = result_of(outs)
    assert_ok(proc)
    return out


@pytest.mark.parametrize("fault,writers", [("rank1", [0, 3]), ("rank0", [1, 2])])
def test_dying_gasp_resume_is_bit_identical(jobs, fault, writers):
    d, res = jobs["dir"] / fault, jobs[fault]
    assert res["iteration"] == K and res["writers"] == writers
    ck = d / "ck"
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(K)
    assert (ck / f"iter_{K:07d}" / "ha_manifest.json").exists() and not (ck / f"iter_{K:07d}_tmp").exists()
    log = d / "resume"
    log.mkdir()
    proc = torchrun(4, [*TINY, "--train-iters", str(LAST), "--enable-high-availability", "--load", str(ck)],
                    log, timeout=150)
    assert_ok(proc)
    got, want = losses(log), jobs["ref_losses"]
    assert sorted(got) == list(range(K + 1, LAST + 1)), got
    assert {i: want[i] for i in got} == got


def test_dying_gasp_loads_with_half_dp(jobs):
    import math
    d = jobs["dir"] / "rank1"
    log = d / "half"
    log.mkdir()
    proc = torchrun(2, [*TINY, "--train-iters", str(K + 2), "--enable-high-availability", "--load", str(d / "ck")],
                    log, timeout=150)
    assert_ok(proc)
    got = losses(log)
    assert sorted(got) == [K + 1, K + 2] and all(math.isfinite(float.fromhex(v)) for v in got.values())


def test_replica_pair_lost_refuses(tmp_path):
    outs = launch_ranks(4, job_args(tmp_path / "ck", "--ha-log-dir", str(tmp_path / "log"), "--save-interval", "2"),
                        tmp_path,
                        {"DUMP_STEPS": str(K), "DUMP_KILL": "0,2"})
    assert [c for c, _, _ in outs] == [17, 3, 17, 3], "\n".join(e[-3000:] for _, _, e in outs)
    res = result_of(outs)
    assert not res["plan_ok"]
    msg = res["message"]
    assert "[0, 2]" in msg and "nothing written" in msg and "iteration 2" in msg, msg
    assert "mindspeed-ha: dying-gasp checkpoint refused" in outs[1][2]
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_rebuild_in_place_continues_bit_identically(jobs, tmp_path):
    """All 4 ranks get fresh communicators over a new store after iteration 2 (every group the model
    and the optimizer hold is re-pointed), then train on: the same losses as the reference."""
    outs = launch_ranks(4, job_args(tmp_path / "ck", "--ha-log-dir", str(tmp_path / "log")), tmp_path,
                        {"DUMP_STEPS": "2", "DUMP_MODE": "rebuild"})
    assert [c for c, _, _ in outs] == [0, 0, 0, 0], "\n".join(e[-3000:] for _, _, e in outs)
    assert result_of(outs)["repointed"] > 0
    got = losses(tmp_path / "log")
    assert sorted(got) == list(range(1, LAST + 1))
    assert got == jobs["ref_losses"]


@pytest.mark.parametrize("victim,written", [("2", True), ("3", False)])
def test_cascading_fault_during_dump(tmp_path, victim, written):
    """Rank 1 is lost after iteration K; during the dump another survivor dies (the product's
    injector, phase ``checkpoint``). Rank 2 lost: ranks 0 and 3 still hold both shards -> the retry
    (store generation 2) writes the checkpoint. Rank 3 lost: shard [1, 3] is gone -> refusal, and the
    interrupted attempt left nothing behind."""
    ck = tmp_path / "ck"
    outs = launch_ranks(4, job_args(ck, "--ha-log-dir", str(tmp_path / "log")), tmp_path,
                        {"DUMP_STEPS": str(K), "DUMP_KILL": "1", "DUMP_CASCADE": victim,
                         "MINDSPEED_HA_INJECT": f"exit:rank={victim}:step={K}:phase=checkpoint"})
    codes = [c for c, _, _ in outs]
    res = result_of(outs)
    assert res["retry"] and res["plan_ok"] == written, res
    if written:
        assert codes == [0, 17, 1, 0], codes
        assert res["iteration"] == K and res["writers"] == [0, 3]
        manifest = json.loads((ck / f"iter_{K:07d}" / "ha_manifest.json").read_text())
        assert manifest["survivors"] == [0, 3] and manifest["iteration"] == K
        assert sorted(p.name for p in ck.iterdir()) == [f"iter_{K:07d}", "latest_checkpointed_iteration.txt"]
    else:
        assert codes == [3, 17, 3, 1], codes
        assert "[1, 3]" in res["message"] and "no periodic checkpoint" in res["message"]
        assert not ck.exists() or list(ck.iterdir()) == [], list(ck.iterdir())


@pytest.mark.skipif(not os.environ.get("MINDSPEED_HA_SLOW_TESTS"),
                    reason="about 3 minutes on 2 shared cores; set MINDSPEED_HA_SLOW_TESTS=1")
def test_dying_gasp_tp2_resume_is_bit_identical(tmp_path):
    """TP=2 x DP=2 (replica groups [0, 2] and [1, 3], one per TP rank): rank 1 lost; the TP-rank-1
    weights, shard and RNG come from rank 3 alone."""
    from concurrent.futures import ThreadPoolExecutor
    tp = ["--tensor-model-parallel-size", "2"]
    (tmp_path / "ref").mkdir()
    (tmp_path / "resume").mkdir()
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(torchrun, 4, job_args(tmp_path / "ref" / "ck", *tp), tmp_path / "ref", None, 250)
        outs = launch_ranks(4, job_args(tmp_path / "ck", "--ha-log-dir", str(tmp_path / "log"), *tp), tmp_path,
                            {"DUMP_STEPS": str(K), "DUMP_KILL": "1"}, 250)
        assert_ok(ref.result())
    assert [c for c, _, _ in outs] == [0, 17, 0, 0], "\n".join(e[-3000:] for _, _, e in outs)
    assert result_of(outs)["writers"] == [0, 3]
    proc = torchrun(4, [*TINY, "--train-iters", str(LAST), "--enable-high-availability", "--load",
                        str(tmp_path / "ck"), *tp], tmp_path / "resume", timeout=200)
    assert_ok(proc)
    got, want = losses(tmp_path / "resume"), losses(tmp_path / "ref")
    assert sorted(got) == list(range(K + 1, LAST + 1)) and {i: want[i] for i in got} == got
