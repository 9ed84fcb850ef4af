"""The dump (dying-gasp checkpoint): the planner (table tests), and the in-place group rebuild on a real
4-rank job (one process per rank, ``tests/workers/dump_worker.py``). The dump itself, driven by
the controller in real jobs, is tested end to end in test_ttp.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY, assert_ok, clean_env, free_port, losses, torchrun
from mindspeed_ha.plan import plan_dump, plan_repair

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


def test_plan_repair_takes_a_holder_past_the_iteration_back_through_its_twin():
    """PP=2 x DP=2, one optimizer instance a DP rank (replica groups [0,1] stage 0, [2,3] stage 1): a
    memory error poisons rank 0 in step 6's parameter sync, rank 1 is cut short before its update (its
    grad-norm all-reduce, with rank 3, never completed), so the job resumes at 5; rank 2 had ended step 6
    (its own all-reduce, with rank 0, had). Rank 2 gets its twin's shard and, as a restarted rank would,
    its twin's counters, scheduler and RNG: it goes back to 5 with it. Nobody else takes counters."""
    groups = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    states = {0: H(5, True, alive=False), 1: H(5, True, touched=False), 2: H(6), 3: H(5, True, touched=False)}
    plan = plan_repair({r: {**h, "replica_group": groups[r]} for r, h in states.items()})
    assert plan.ok and plan.iteration == 5
    assert list(plan.copies) == [(1, 0), (3, 2)] and list(plan.joiners) == [(2, 3)]
    # The same with rank 2 restarted instead: it takes counters as before, rank 3 gives them.
    states[2] = H(-1, alive=False)
    plan = plan_repair({r: {**h, "replica_group": groups[r]} for r, h in states.items()}, joiners=[2])
    assert list(plan.copies) == [(1, 0), (3, 2)] and list(plan.joiners) == [(2, 3)]


def test_plan_dump_rejects_inconsistent_groups():
    with pytest.raises(ValueError):
        plan_dump({0: H(1, group=[1, 2]), 1: H(1, group=[1, 2]), 2: H(1, group=[1, 2])})


# ------------------------------------------------------------------------------------------------
# Real jobs
# ------------------------------------------------------------------------------------------------
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


def test_rebuild_in_place_continues_bit_identically(tmp_path):
    """All 4 ranks get fresh communicators over a new store after iteration 2 (every group keeps its
    object, its communicator is replaced), then train on: the same losses as the reference."""
    from concurrent.futures import ThreadPoolExecutor
    (tmp_path / "ref").mkdir()
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(torchrun, 4, job_args(tmp_path / "ref" / "ck"), tmp_path / "ref", None, 200)
        outs = launch_ranks(4, job_args(tmp_path / "ck", "--ha-log-dir", str(tmp_path / "log")), tmp_path,
                            {"DUMP_STEPS": "2", "DUMP_MODE": "rebuild"})
        assert_ok(ref.result())
    assert [c for c, _, _ in outs] == [0, 0, 0, 0], "\n".join(e[-3000:] for _, _, e in outs)
    assert result_of(outs)["reconnected"] > 0
    got = losses(tmp_path / "log")
    assert sorted(got) == list(range(1, LAST + 1))
    assert got == losses(tmp_path / "ref")


