"""A recovery remakes only the communicators the fault reached (comm/ledger.py,
control/policy/communicators.py, comm/groups.reconnect): the controller's choice from the members'
counts, and whole jobs where a fault on one rank keeps every communicator it did not reach, with
every loss bit-identical."""
from collections import Counter

import pytest
from helpers import all_rank_events, events, on
from test_in_job_recovery import TP2, check_recovered, check_rejoined, job

from mindspeed_ha.control.policy.communicators import to_remake


def _entry(ops, state="ok", sent=None, received=None, members=(0, 1)):
    return [ops, state, sent or {}, received or {}, list(members)]


def _statuses(**by_rank):
    """rank_N={key: _entry(...)} -> the statuses a controller holds, each section as a rank says it
    (``comm.ledger``)."""
    out = {}
    for k, groups in by_rank.items():
        comm = {"keys": [], "ops": [], "odd": {}, "members": {}}
        for key, (ops, state, sent, received, members) in groups.items():
            comm["keys"].append(key)
            comm["ops"].append(ops)
            if state != "ok" or sent or received:
                comm["odd"][key] = [state, sent, received]
            if members is not None:
                comm["members"][key] = members
        out[int(k.split("_")[1])] = {"replica": True, "comm": comm}
    return out


# ---- the controller's choice ---------------------------------------------------------------------------
def test_idle_groups_with_equal_counts_are_kept_and_a_fresh_members_are_remade():
    st = _statuses(rank_0={"tp": _entry(5), "dp": _entry(3, members=(0, 2))},
                   rank_1={"tp": _entry(5)},
                   rank_2={"dp": _entry(3, members=(0, 2))})
    assert to_remake(st, fresh=[]) == {}
    assert to_remake(st, fresh=[1]) == {"tp": "rank(s) [1] restarted, replaced or lost"}


def test_a_group_is_remade_for_each_sign_that_the_fault_reached_it():
    def why(a, b):
        return to_remake(_statuses(rank_0={"g": a}, rank_1={"g": b}), fresh=[]).get("g", "")

    assert why(_entry(5, "open"), _entry(5)) == "open on rank 0"
    assert why(_entry(5), _entry(5, "pending")) == "pending on rank 1"
    assert why(_entry(5, "aborted"), _entry(5, "aborted")) == "aborted on rank 0; aborted on rank 1"
    assert why(_entry(5, "broken"), _entry(5)) == "broken on rank 0"
    assert why(_entry(6), _entry(5)).startswith("collective counts differ (rank 0: 6, rank 1: 5)")
    assert why(_entry(5, "unconnected"), _entry(5)) == "unconnected on rank 0"
    assert why(_entry(0, "unconnected"), _entry(0, "unconnected")) == ""  # (made on first use, not used since)
    # A message sent and never received would be taken by the peer's next receive.
    assert why(_entry(5, sent={"1": 3}), _entry(5, received={"0": 2})) == \
        "rank 0 sent rank 1 3 message(s), which received 2"
    assert why(_entry(5, sent={"1": 3}), _entry(5, received={"0": 3})) == ""
    assert why(_entry(5), _entry(5, received={"any": 1})).startswith("rank 1 received from any source")


def test_the_members_come_from_the_groups_first_member_and_without_it_the_group_is_remade():
    """Only a group's first member says its members (the world's, said by each rank, would be the
    square of the job's size): the others' entries carry None."""
    st = _statuses(rank_0={"g": _entry(5)}, rank_1={"g": _entry(5)[:4] + [None]})
    assert to_remake(st, fresh=[]) == {}
    st = _statuses(rank_1={"g": _entry(5)[:4] + [None]})  # (rank 0, its first member, lost)
    assert to_remake(st, fresh=[]) == {"g": "its first member said nothing of it"}


def test_a_member_that_said_nothing_of_a_group_has_it_remade_and_one_that_said_nothing_at_all_remakes_all():
    st = _statuses(rank_0={"g": _entry(5)}, rank_1={})
    assert to_remake(st, fresh=[]) == {"g": "rank(s) [1] said nothing of it"}
    st[1] = {"replica": True}  # (a rank of a release before this one)
    assert to_remake(st, fresh=[]) is None
    st[1] = {"replica": True, "joining": True}  # (a restarted rank: fresh, its groups new)
    assert to_remake(st, fresh=[1]) == {"g": "rank(s) [1] restarted, replaced or lost"}


# ---- whole jobs -----------------------------------------------------------------------------------------
def rebuilt(log_dir) -> dict[int, list[dict]]:
    """rank -> its `rebuilt` events, in order."""
    out: dict[int, list[dict]] = {}
    for e in all_rank_events(log_dir):
        if e["event"] == "rebuilt":
            out.setdefault(e["rank"], []).append(e)
    return out


def check_scope(log_dir, faulted: int, nproc: int = 8) -> dict[int, dict]:
    """Each rank's one rebuild: the members of every group agree on keeping or remaking it; every group
    remade without the faulted rank among its members has a reason other than "all"; returns each
    rank's event."""
    per_rank = rebuilt(log_dir)
    survivors = [r for r in range(nproc)]
    assert sorted(per_rank) == survivors, per_rank.keys()
    last = {r: evs[-1] for r, evs in per_rank.items()}
    for r, e in last.items():
        for members, why in zip(e["remade"], e["why"]):
            assert why != "all", (r, members)
            if faulted not in members:
                assert why, (r, members)
    # Agreement: a member keeps as many groups of the same members as every other member keeps.
    for r, e in last.items():
        kept = Counter(tuple(m) for m in e["kept"])
        for members, n in kept.items():
            for peer in members:
                assert Counter(tuple(m) for m in last[peer]["kept"])[members] == n, (r, peer, members)
    return last


@pytest.mark.parametrize("backend", [on("gloo"), on("emulated_nccl")])
def test_a_memory_error_on_rank_1_keeps_every_communicator_it_did_not_reach(tmp_path, references, backend):
    """8 ranks, TP=2 x DP=4 (TP pairs [0, 1] ... [6, 7], DP groups [0, 2, 4, 6] and [1, 3, 5, 7]): a memory
    error on rank 1 in its forward, retried. Rank 0 waits for it in a TP all-reduce: that pair's groups
    are remade. No collective of the even ranks' DP group was under way: it is kept on all four, and
    so is every group of the other TP pairs that held nothing open."""
    ref = references.tiny_layouts()
    proc = job(tmp_path, 8, inject="uce:rank=1:step=3:phase=forward", extra=TP2, backend=backend)
    check_recovered(proc, tmp_path, ref["tp2"], nproc=8)
    last = check_scope(tmp_path, faulted=1)
    for r in (0, 2, 4, 6):
        assert [0, 2, 4, 6] in last[r]["kept"], last[r]
    remade_without_1 = sum(1 for e in last.values() for m in e["remade"] if 1 not in m)
    kept = sum(len(e["kept"]) for e in last.values())
    assert kept > remade_without_1, (kept, remade_without_1)
    plan = [e for e in events(tmp_path, "controller") if e["event"] == "rebuild_plan"]
    assert len(plan) == 1 and 0 < plan[0]["remake"] < plan[0]["groups"], plan


def test_a_killed_rank_1_is_recovered_with_only_its_groups_and_those_it_reached_remade(tmp_path, references):
    """The same job, rank 1 killed in its forward and restarted (recover): the restarted rank's groups are
    new everywhere; the even ranks' DP group is kept."""
    ref = references.tiny_layouts()
    proc = job(tmp_path, 8, inject="kill:rank=1:step=3:phase=forward", extra=TP2 + ["--enable-worker-reboot"])
    check_rejoined(proc, tmp_path, ref["tp2"], [1], n=1, nproc=8)
    last = check_scope(tmp_path, faulted=1)
    assert all(1 in m for m in last[1]["remade"]) and last[1]["kept"] == []
    for r in (0, 2, 4, 6):
        assert [0, 2, 4, 6] in last[r]["kept"], last[r]


# ---- the connection's gate (comm/groups._await_members) -------------------------------------------------
class _Stopped(Exception):
    pass


def _member(store, rank, size, leave, timeout_s=5.0):
    """One member's wait for the others: "connect", or why it left (``leave``: raises its stop)."""
    import datetime

    from mindspeed_ha.comm.groups import _await_members
    try:
        _await_members(store, rank, size, datetime.timedelta(seconds=timeout_s), f"group of {size}", leave)
        return "connect"
    except (_Stopped, TimeoutError) as e:
        return f"{type(e).__name__}: {e}"


def _stopped_at(n, before=lambda: None):
    """A stop that comes at the member's ``n``-th look for it (``before`` runs first)."""
    looks = []

    def leave():
        looks.append(1)
        if len(looks) >= n:
            before()
            raise _Stopped("stopped")
    return leave


def test_a_member_that_leaves_on_a_stop_before_the_others_came_keeps_them_all_out_of_the_connect():
    """Rank 0 comes and is stopped before rank 1 comes: rank 1 finds both here, but the gate is closed,
    so it does not connect to a rank that has gone; it leaves at its own stop (or, never stopped, at
    the group's timeout, saying why)."""
    import torch.distributed as dist
    store = dist.HashStore()
    assert _member(store, 0, 2, _stopped_at(2)) == "_Stopped: stopped"
    assert store.get("gate") == b"closed" and store.check(["here/0"])
    assert _member(store, 1, 2, _stopped_at(2)) == "_Stopped: stopped"
    late = _member(store, 1, 2, lambda: None, timeout_s=0.2)
    assert late.startswith("TimeoutError") and "a member left its connection on a stop" in late, late


def test_once_every_member_is_here_each_connects_even_one_stopped_since():
    """Rank 1 comes while rank 0 waits, finds both here and opens the gate; rank 0's stop comes just
    after: it connects all the same (rank 1 is connecting to it), and leaves at its next wait. A member
    stopped before it came is never known here: it leaves without a word."""
    import torch.distributed as dist
    store = dist.HashStore()

    def rank1_comes():
        store.set("here/1", b"1")
        assert store.compare_set("gate", "", "open") == b"open"
    assert _member(store, 0, 2, _stopped_at(2, rank1_comes)) == "connect"
    assert _member(dist.HashStore(), 0, 2, _stopped_at(1)) == "_Stopped: stopped"
    alone = _member(dist.HashStore(), 0, 2, lambda: None, timeout_s=0.05)
    assert alone == "TimeoutError: 'group of 2': member(s) [1] did not come within 0 s", alone
