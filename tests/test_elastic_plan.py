"""Elastic planning as table tests: scale-in (``plan_elastic``: which whole data-parallel replicas train
on, at which size and iteration, and who serves each shard) and scale-out (``plan_scale_out``: which
newcomers come in, where, and whom they copy)."""
import pytest

from mindspeed_ha.plan import plan_elastic, plan_scale_out
from mindspeed_ha.trainer.data import sample_fingerprint

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
    ("three replicas fit a batch of 12, two keep the twins: size 2 wins, rank 2 waits parked",
     1, 4, {1: H(6, **DEAD)}, 12, 2, (6, 2, 2, ((0,), (3,)), (2,), {(0, 2): 0, (1, 3): 3})),
    ("a batch of 6 fits three replicas or one, never two: one instance, no twins",
     1, 4, {1: H(6, **DEAD)}, 6, 2, (6, 3, 1, ((0,), (2,), (3,)), (), {(0, 2): 0, (1, 3): 3})),
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


def test_a_pipeline_layout_keeps_each_rank_at_its_stage():
    """PP=2 x DP=4 (megatron-core: stages outermost, so replica d is ranks d and d + 4; replica
    groups pair instance positions within a stage): rank 5 lost, replicas (0, 4) and (3, 7) go on,
    and the new order puts each stage's ranks together: 0 and 3 are stage 0 of the PP=2 x DP=2
    layout, 4 and 7 stage 1. Back out: newcomer replicas (1, 5) and (2, 6), each rank copying the
    kept rank at its stage; a replica that came half is not taken."""
    replicas = [[d, d + 4] for d in range(4)]
    holders = {r: {**(H(6, **DEAD) if r == 5 else H(6)), "replica_group": [r % 2 + (r // 4) * 4, r % 2 + 2 + (r // 4) * 4]}
               for r in range(8)}
    plan = plan_elastic(holders, replicas, 16, 2, stages=2)
    assert plan.ok, plan.reason
    assert (plan.dp, plan.kept, plan.parked) == (2, ((0, 4), (3, 7)), (1, 2, 6))
    assert plan.order == [0, 3, 4, 7]
    assert plan_elastic(holders, replicas, 16, 2).order == [0, 4, 3, 7]  # (what a TP slice would give)
    running = {r: {**H(9), "replica_group": [r, {0: 3, 3: 0, 4: 7, 7: 4}[r]]} for r in (0, 3, 4, 7)}
    out = plan_scale_out(running, [[0, 4], [3, 7]], [1, 5, 2, 6], 16, 2, stages=2, world=8)
    assert out.ok, out.reason
    assert (out.dp, out.kept, out.parked) == (4, ((0, 4), (1, 5), (2, 6), (3, 7)), ())
    assert out.sources == {1: 0, 5: 4, 2: 0, 6: 4} and out.order == list(range(8))
    half = plan_scale_out(running, [[0, 4], [3, 7]], [1, 5, 2], 16, 2, stages=2, world=8)
    assert not half.ok and "1 whole replica(s) of newcomers" in half.reason
    alone = plan_scale_out(running, [[0, 4], [3, 7]], [5, 6], 16, 2, stages=2, world=8)
    assert not alone.ok and "make no whole replica: a replica is 1 rank(s) on each of 2 pipeline stage(s); start the nodes" in alone.reason


def test_an_moe_layout_keeps_and_adds_whole_expert_blocks():
    """MoE with EP=2 x DP=8: replicas 2k and 2k + 1 hold the experts between them (expert-parallel
    positions 0 and 1). Rank 1 lost: its block (0, 1) goes, rank 0 with it, and the kept replicas
    2..5 sit at new positions 0..3, each at its old expert-parallel position (without blocks, 0, 2,
    3, 5 would put rank 2 at position 1). Back out: newcomer blocks (0, 1) and (6, 7), each rank
    copying the kept rank at its expert-parallel position; a block that came half is not taken."""
    replicas = [[d] for d in range(8)]
    holders = {r: {**(H(6, **DEAD) if r == 1 else H(6)), "replica_group": [r % 4, r % 4 + 4]} for r in range(8)}
    plan = plan_elastic(holders, replicas, 16, 2, experts=2)
    assert plan.ok, plan.reason
    assert (plan.dp, plan.instances, plan.kept, plan.parked) == (4, 2, ((2,), (3,), (4,), (5,)), (0, 6, 7))
    assert plan.writers == {(0, 4): 4, (1, 5): 5, (2, 6): 2, (3, 7): 3}
    assert plan_elastic(holders, replicas, 16, 2).kept == ((0,), (2,), (3,), (5,))
    assert not plan_elastic(holders, replicas, 16, 8, experts=2).ok  # (size 2: one expert replica, no twins)
    running = {r: {**H(9), "replica_group": [2 + r % 2, 4 + r % 2]} for r in (2, 3, 4, 5)}
    out = plan_scale_out(running, [[2], [3], [4], [5]], [0, 1, 6, 7], 16, 2, experts=2)
    assert out.ok, out.reason
    assert (out.dp, out.kept, out.parked, out.sources) == (8, tuple((r,) for r in range(8)), (), {0: 2, 1: 3, 6: 2, 7: 3})
    half = plan_scale_out(running, [[2], [3], [4], [5]], [0, 1, 6], 24, 2, experts=2)
    assert not half.ok and "same optimizer instance count" in half.reason


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


# ---- scale-out ---------------------------------------------------------------------------------------
def scaled_in(tp, kept, states=None):
    """The job after a scale-in to the replicas ``kept`` (old data-parallel indices) of TP x DP=4 with
    two instances: replica groups pair kept replica i with i + size/2. Returns (holders, replicas)."""
    replicas = [[d * tp + t for t in range(tp)] for d in kept]
    half = len(replicas) // 2
    holders = {}
    for i, rep in enumerate(replicas):
        for t, r in enumerate(rep):
            twin = replicas[(i + half) % len(replicas)][t]
            holders[r] = {**(states or {}).get(r, H(9)), "replica_group": sorted([r, twin])}
    return holders, replicas


SCALE_OUT = [
    # (name, tp, kept, joiners, global batch, micro batch) -> (dp, kept, parked, sources, writers)
    ("DP 2 -> 4: the original layout again", 1, (0, 1), (2, 3), 16, 2,
     (4, ((0,), (1,), (2,), (3,)), (), {2: 0, 3: 0}, {(0, 1): 0})),
    ("the kept replicas were 0 and 3: the newcomers fill 1 and 2 in order", 1, (0, 3), (1, 2), 16, 2,
     (4, ((0,), (1,), (2,), (3,)), (), {1: 0, 2: 0}, {(0, 3): 0})),
    ("TP=2: a newcomer copies the kept rank at its TP position", 2, (0, 1), (4, 5, 6, 7), 16, 2,
     (4, ((0, 1), (2, 3), (4, 5), (6, 7)), (), {4: 0, 5: 1, 6: 0, 7: 1}, {(0, 2): 0, (1, 3): 1})),
    ("TP=2, half a replica came: it waits parked", 2, (0, 1), (4, 5, 6, 7, 8), 24, 2,
     (4, ((0, 1), (2, 3), (4, 5), (6, 7)), (8,), {4: 0, 5: 1, 6: 0, 7: 1}, {(0, 2): 0, (1, 3): 1})),
    ("a fifth replica would make the size odd: it waits parked", 1, (0, 1), (2, 3, 4), 24, 2,
     (4, ((0,), (1,), (2,), (3,)), (4,), {2: 0, 3: 0}, {(0, 1): 0})),
    ("one whole replica only (3 would drop the twins): parked", 1, (0, 1), (2,), 16, 2, None),
    ("a batch that allows 4 but not 6: two of four newcomers", 1, (0, 1), (2, 3, 4, 5), 8, 2,
     (4, ((0,), (1,), (2,), (3,)), (4, 5), {2: 0, 3: 0}, {(0, 1): 0})),
]


@pytest.mark.parametrize("name,tp,kept,joiners,gbs,mbs,want", SCALE_OUT, ids=[c[0] for c in SCALE_OUT])
def test_plan_scale_out_table(name, tp, kept, joiners, gbs, mbs, want):
    holders, replicas = scaled_in(tp, kept)
    plan = plan_scale_out(holders, replicas, joiners, gbs, mbs)
    if want is None:
        assert not plan.ok and plan.message().startswith("scale-out refused: ") and plan.iteration == 9
        return
    assert plan.ok, plan.reason
    assert (plan.dp, plan.kept, plan.parked, plan.sources, plan.writers) == want
    assert plan.iteration == 9 and plan.direction == "out" and plan.redundancy
    assert plan.microbatches * plan.dp * mbs == gbs
    assert plan.order == [r for rep in want[1] for r in rep]
    assert type(plan).from_wire(plan.to_wire()) == plan


def test_plan_scale_out_at_the_iteration_every_shard_has():
    """A kept rank stopped inside its update finishes it: the newcomers join at the next iteration."""
    holders, replicas = scaled_in(1, (0, 1), {0: H(8, True), 1: H(8, True)})
    plan = plan_scale_out(holders, replicas, (2, 3), 16, 2)
    assert plan.ok and plan.iteration == 9


def test_a_global_batch_has_one_fingerprint_however_it_is_split():
    """samples_hash: the data-parallel ranks' parts add up to the same value at any size."""
    gbs, mbs, start = 16, 2, 48

    def split(dp):
        total = 0
        for rank in range(dp):
            for step in range(gbs // (mbs * dp)):
                first = start + step * mbs * dp + rank * mbs
                total += sample_fingerprint(range(first, first + mbs))
        return total
    assert split(1) == split(2) == split(4) == split(8) == sample_fingerprint(range(start, start + gbs))
    assert sample_fingerprint(range(start, start + gbs)) != sample_fingerprint(range(start + 1, start + gbs + 1))
