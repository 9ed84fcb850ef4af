"""Scale-in planning (``plan_elastic``): which whole data-parallel replicas train on, at which size and
iteration, and who serves each shard, as table tests."""
import pytest

from mindspeed_ha.plan import plan_elastic

DEAD = dict(alive=False)


def H(it, upd=False, alive=True, touched=None):
    h = {"iteration": it, "updating": upd, "alive": alive}
    if touched is not None:
        h["touched"] = touched
    return h


def layout(tp, dp, states, instances=2):
    """TP x DP job ranks (TP fastest, as megatron orders them); replica group of (t, d): the same
    position in every instance. Returns (holders, replicas)."""
    size = dp // instances
    replicas = [[d * tp + t for t in range(tp)] for d in range(dp)]
    holders = {}
    for d, rep in enumerate(replicas):
        for t, r in enumerate(rep):
            group = [(d % size + k * size) * tp + t for k in range(instances)]
            holders[r] = {**states.get(r, H(6)), "replica_group": group}
    return holders, replicas


CASES = [
    # (name, tp, dp, states, global batch, micro batch) -> (iteration, dp, instances, kept, parked, writers)
    ("DP=4, rank 1 lost: the largest size the batch allows is 2; rank 2 waits parked",
     1, 4, {1: H(6, **DEAD)}, 16, 2, (6, 2, 2, ((0,), (3,)), (2,), {(0, 2): 0, (1, 3): 3})),
    ("three replicas fit a batch of 12: one instance, no twins",
     1, 4, {1: H(6, **DEAD)}, 12, 2, (6, 3, 1, ((0,), (2,), (3,)), (), {(0, 2): 0, (1, 3): 3})),
    ("rank 0 lost: its twin serves its shard",
     1, 4, {0: H(6, **DEAD)}, 16, 2, (6, 2, 2, ((1,), (2,)), (3,), {(0, 2): 2, (1, 3): 1})),
    ("TP=2 x DP=4, one rank of replica 1 lost: the whole replica goes",
     2, 4, {3: H(6, **DEAD)}, 16, 2,
     (6, 2, 2, ((0, 1), (6, 7)), (2, 4, 5), {(0, 4): 0, (1, 5): 1, (2, 6): 6, (3, 7): 7})),
    ("a holder stopped before its update cannot serve the newer iteration: its twin does",
     1, 4, {0: H(5, True, touched=False), 1: H(6, **DEAD)}, 16, 2,
     (6, 2, 2, ((2,), (3,)), (0,), {(0, 2): 2, (1, 3): 3})),
    ("survivors inside the update finish it: the plan is at the next iteration",
     1, 4, {0: H(5, True), 1: H(5, True, **DEAD), 2: H(5, True), 3: H(5, True)}, 16, 2,
     (6, 2, 2, ((0,), (3,)), (2,), {(0, 2): 0, (1, 3): 3})),
]


@pytest.mark.parametrize("name,tp,dp,states,gbs,mbs,want", CASES, ids=[c[0] for c in CASES])
def test_plan_elastic_table(name, tp, dp, states, gbs, mbs, want):
    holders, replicas = layout(tp, dp, states)
    plan = plan_elastic(holders, replicas, gbs, mbs)
    assert plan.ok, plan.reason
    assert (plan.iteration, plan.dp, plan.instances, plan.kept, plan.parked, plan.writers) == want
    assert plan.microbatches * plan.dp * mbs == gbs        # the global batch never changes
    assert plan.redundancy == (plan.instances == 2)
    assert f"data-parallel size {plan.dp}" in plan.message()


def test_scale_in_again_from_a_scaled_in_layout():
    """After 4 -> 2 the replicas are job ranks 0 and 3, twins of each other (instance size 1);
    losing 3 leaves one replica holding every shard: size 1, no twins."""
    holders = {0: {**H(9), "replica_group": [0, 3]}, 3: {**H(9, **DEAD), "replica_group": [0, 3]}}
    plan = plan_elastic(holders, [[0], [3]], 16, 2)
    assert (plan.ok, plan.dp, plan.instances, plan.kept, plan.parked, plan.microbatches) == \
           (True, 1, 1, ((0,),), (), 8)
    assert "no twins until the job scales out" in plan.message()


@pytest.mark.parametrize("tp,states,gbs,mbs,why", [
    # (each shard still has a holder, so the dying gasp can write it; no replica has both)
    (2, {3: H(6, **DEAD), 6: H(6, **DEAD)}, 16, 2, "no whole surviving replica holds shard(s) [[2, 6], [3, 7]]"),
    (1, {1: H(6, **DEAD), 3: H(6, **DEAD)}, 16, 2, "no live holder for shard(s) with replica group [1, 3]"),
    (1, {1: H(6, **DEAD)}, 16, 16, "no data-parallel size from 2 (one per shard) to 3 divides the global batch 16"),
    (1, {0: H(6, **DEAD), 1: H(9), 3: H(2)}, 16, 2, "cannot be brought to one iteration"),
], ids=["twins lost in different replicas", "both twins lost", "batch does not divide", "no common iteration"])
def test_plan_elastic_refusals(tp, states, gbs, mbs, why):
    holders, replicas = layout(tp, 4, states)
    plan = plan_elastic(holders, replicas, gbs, mbs)
    assert not plan.ok and why in plan.reason, plan.reason
    assert plan.message().startswith("scale-in refused: ")
