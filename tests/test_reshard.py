"""Moving optimizer state to a new data-parallel layout: the schedule (pure) and the point-to-point
exchange on four real gloo ranks."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY, clean_env
from mindspeed_ha.replica.reshard import Move, ReshardError, schedule

WORKER = str(Path(__file__).resolve().parent / "workers" / "reshard_worker.py")


def test_dp4_to_dp2_takes_own_part_locally_and_the_rest_from_one_holder_each():
    held = {0: [("w", 0, 25)], 1: [("w", 25, 50)], 2: [("w", 50, 75)], 3: [("w", 75, 100)]}
    moves = schedule(held, {0: [("w", 0, 50)], 3: [("w", 50, 100)]})
    assert moves == [Move(0, 0, "w", 0, 25), Move(1, 0, "w", 25, 50), Move(2, 3, "w", 50, 75),
                     Move(3, 3, "w", 75, 100)]


def test_uneven_ranges_and_growth_split_at_every_boundary():
    held = {0: [("w", 0, 34)], 1: [("w", 34, 68)], 2: [("w", 68, 102)]}       # DP=3 padding
    moves = schedule(held, {r: [("w", 26 * r, min(102, 26 * (r + 1)))] for r in range(4)})  # to DP=4
    assert sum(m.numel for m in moves) == 102
    for r in range(4):
        mine = sorted((m.start, m.end) for m in moves if m.dst == r)
        assert mine[0][0] == 26 * r and mine[-1][1] == min(102, 26 * (r + 1))
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))            # contiguous, no gaps
    assert Move(1, 1, "w", 34, 52) in moves and Move(0, 1, "w", 26, 34) in moves


@pytest.mark.parametrize("held,wanted,why", [
    ({0: [("w", 0, 40)], 1: [("w", 50, 100)]}, {0: [("w", 0, 100)]}, "no holder serves elements [40, 50)"),
    ({0: [("w", 0, 60)], 1: [("w", 50, 100)]}, {0: [("w", 0, 100)]}, "ranks 0 and 1 both serve elements [50, 60)"),
    ({0: [("w", 0, 100)]}, {0: [("b", 0, 10)]}, "no holder serves elements [0, 10)"),
], ids=["gap", "overlap", "unknown parameter"])
def test_a_range_without_exactly_one_holder_is_refused_before_anything_moves(held, wanted, why):
    with pytest.raises(ReshardError, match=why.replace("[", r"\[").replace(")", r"\)")):
        schedule(held, wanted)


def test_exchange_on_four_gloo_ranks(tmp_path):
    """DP=4 -> DP=2 for two parameters (one uneven): ranks 0 and 3 end with exactly the values the
    four holders had, three state tensors each; the dropped ranks only send. Messages of at most 7
    elements: moves are cut and packed into them, and the same bytes arrive."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", WORKER, str(tmp_path)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    assert all(not res[r]["wrong"] for r in range(4)), {r: res[r]["wrong"][:5] for r in range(4)}
    # w: [0,26) [26,52) [52,78) [78,102) -> [0,51) [51,102); b: [0,3) [3,6) [6,9) [9,10) -> [0,5) [5,10)
    # (3 fp32 per element): rank 0 receives from 1 only, rank 3 from 1 and 2
    assert res[0]["received"] == 12 * ((51 - 26) + (5 - 3))
    assert res[3]["received"] == 12 * ((52 - 51) + (78 - 52) + (6 - 5) + (9 - 6))
    assert res[1]["received"] == res[2]["received"] == 0


def test_a_real_optimizers_shards_gather_into_whole_identical_twins(tmp_path):
    """A real DP=4 job (two optimizer instances) after two steps: each instance's shards, moved in
    parameter coordinates from ``ha_state_ranges``, add up to whole parameters on one rank — main
    values equal to the model's weights, Adam moments set — and the two instances' gathers are
    bit-identical (the twins hold the same state)."""
    args = [*TINY, "--train-iters", "5", "--global-batch-size", "16", "--enable-high-availability"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", WORKER,
           str(tmp_path), *args]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    for r in (0, 3):
        assert res[r]["entries"] == res[r]["params"] > 0
        assert res[r]["main_is_param"] and res[r]["moments_set"], res[r]
        assert res[r]["received"] > 0
    assert res[0]["twins_equal"]
