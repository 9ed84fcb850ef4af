"""Every transition of the recovery state machine table, and the strategy choice."""
import pytest
from hypothesis import given, settings, strategies as st

from mindspeed_ha.control import strategies
from mindspeed_ha.control.policy.states import TABLE, TIMEOUTS, Machine, Outcome as O, State as S, TransitionError, next_state
from mindspeed_ha.options import _FLAG_TO_STRATEGY, PREFERENCE, STRATEGIES


@pytest.mark.parametrize("state,outcome", sorted(TABLE, key=str))
def test_every_transition(state, outcome):
    seen = []
    m = Machine(lambda *a: seen.append(a), state=state)
    new = m.feed(outcome)
    assert new == TABLE[(state, outcome)] == next_state(state, outcome)
    (old, out, to, seconds), = seen
    assert (old, out, to) == (state, outcome, new) and seconds >= 0
    assert m.history[-1][:3] == (state, outcome, new)


def test_undefined_transitions_raise():
    defined = set(TABLE)
    for s in S:
        for o in O:
            if (s, o) not in defined:
                with pytest.raises(TransitionError):
                    next_state(s, o)


def test_every_state_reachable_and_done_terminal():
    reach, todo = {S.INIT}, [S.INIT]
    while todo:
        s = todo.pop()
        for (a, _), b in TABLE.items():
            if a == s and b not in reach:
                reach.add(b)
                todo.append(b)
    assert reach == set(S)
    assert not [k for k in TABLE if k[0] == S.DONE]
    # a fault can be taken from every non-terminal state except the init wait's own timeout path
    assert all((s, O.FAULT) in TABLE for s in S if s not in (S.DONE,))


def test_every_busy_state_has_timeout_and_failure_exit():
    for s in (S.PAUSE, S.DECIDE, S.EXIT):
        assert s in TIMEOUTS and (s, O.TIMEOUT) in TABLE
    # RECOVERING and DUMP: each stage of every strategy has its own time limit
    for s in (S.RECOVERING, S.DUMP):
        assert (s, O.TIMEOUT) in TABLE and (s, O.FAILED) in TABLE
    assert all(stage.time_limit > 0 for st in strategies.REGISTRY.values() for stage in st.stages)


def test_fault_life_reads_as_one_sequence_for_every_strategy():
    """retry, recover, scale-in: the same road; each stage after the first is RECOVERING again."""
    m = Machine()
    for o in (O.REGISTERED, O.FAULT, O.STOPPED, O.CHOSEN, O.STAGE, O.OK):
        m.feed(o)
    assert [h[2] for h in m.history] == [S.NORMAL, S.PAUSE, S.DECIDE, S.RECOVERING, S.RECOVERING, S.NORMAL]


def test_elastic_in_and_out_read_as_sequences():
    """Scale-in is a recovery; scale-out takes the same road without a fault (a planned pause)."""
    m = Machine()
    for o in (O.REGISTERED, O.FAULT, O.STOPPED, O.CHOSEN, O.SWITCH, O.STAGE, O.OK, O.SCALE_OUT, O.STOPPED,
              O.CHOSEN, O.STAGE, O.OK):
        m.feed(o)
    assert [h[2] for h in m.history] == [S.NORMAL, S.PAUSE, S.DECIDE, S.RECOVERING, S.RECOVERING, S.RECOVERING,
                                         S.NORMAL, S.PAUSE, S.DECIDE, S.RECOVERING, S.RECOVERING, S.NORMAL]
    # a scale-out that fails once ranks have changed layout saves what they hold
    assert next_state(S.RECOVERING, O.FAILED) == S.DUMP


def test_strategy_order_and_fault_class():
    all_on = list(PREFERENCE)
    assert strategies.choose(all_on, {"memory-error"})[0] is strategies.RETRY
    assert strategies.choose(all_on, {"comm-failure"})[0] is strategies.RETRY
    assert strategies.choose(all_on, {"process-exit"})[0] is strategies.RECOVER
    assert strategies.choose(all_on, {"process-exit", "comm-failure"})[0] is strategies.RECOVER
    assert strategies.choose(["dump"], {"memory-error"})[0] is strategies.DUMP
    assert strategies.choose(["retry"], {"hang"}) == (None, "retry does not handle hang")
    assert strategies.choose(["elastic-training"], {"node-lost"})[0] is strategies.SCALE_IN


def test_no_file_of_the_control_plane_but_the_strategies_names_a_strategy_by_its_string():
    """The controller, the policy and the wire reach a strategy through the registry, never by the
    string that names it (the state machine's own names are its states': the DUMP state, the
    SCALE_OUT outcome; a fault kind of the same string is defined once, ``ledger.KIND_SCALE_OUT``)."""
    import ast
    import os
    control = os.path.dirname(strategies.__file__).rsplit(os.sep, 1)[0]
    names = set(strategies.REGISTRY)
    found = []
    for d, _, files in os.walk(control):
        if os.path.basename(d) == "strategies":
            continue
        for f in files:
            path = os.path.join(d, f)
            if not f.endswith(".py") or path.endswith(os.path.join("policy", "states.py")):
                continue
            tree = ast.parse(open(path).read())
            kinds = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                     and all(isinstance(t, ast.Name) and t.id.startswith("KIND_") for t in n.targets)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and node.value in names and id(node) not in kinds:
                    found.append(f"{os.path.relpath(path, control)}:{node.lineno} {node.value!r}")
    assert found == []


def test_no_strategy_ends_the_job():
    out, why = strategies.choose(["reload", "mystery"], {"process-exit"})
    assert out is None and why == "reload is not available in this build; mystery is not available in this build"
    assert next_state(S.DECIDE, O.NO_STRATEGY) == S.EXIT
    assert strategies.choose([], {"other"}) == (None, "no strategy enabled")
    assert {"process-exit", "hang", "memory-error", "other"} <= strategies.DUMP.handles


def test_every_strategy_is_one_file_of_the_registry_with_its_switch():
    """Each strategy the options enable is in the registry under the same name, and says the flag the
    options take for it; the ones played inside another name that one."""
    assert set(STRATEGIES) <= set(strategies.REGISTRY)
    for flag, name in _FLAG_TO_STRATEGY.items():
        assert "--" + flag.replace("_", "-") in strategies.REGISTRY[name].switch
    for s in strategies.REGISTRY.values():
        assert s.stages or s.part_of, s.name
        assert all(strategies.REGISTRY[p].stages for p in s.part_of)
    # one file each: the module whose STRATEGY it is
    files = {m.STRATEGY.name: m.__name__ for m in (getattr(strategies, n) for n in dir(strategies))
             if hasattr(m, "STRATEGY")}
    assert sorted(files) == sorted(strategies.REGISTRY) and len(set(files.values())) == len(files)


def test_overdue():
    m = Machine(state=S.PAUSE)
    assert not m.overdue()
    m.entered -= TIMEOUTS[S.PAUSE] + 0.1
    assert m.overdue()


# ---- election: who stands by, and no split brain ------------------------------------------------
import json as _json
import os as _os
import time as _time

import zmq as _zmq

from mindspeed_ha.control.wire import protocol as _protocol, security as _security
from mindspeed_ha.control.controller import Controller as _Controller
from mindspeed_ha.control.policy.quorum import has_quorum
from mindspeed_ha.control.policy.standbys import choose_backups
from mindspeed_ha.options import HAOptions as _HAOptions


def test_backups_prefer_other_nodes():
    nodes = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    assert choose_backups(nodes, 0) == [2, 4]
    assert choose_backups({0: "a", 1: "a", 2: "a", 3: "a"}, 0) == [3, 2]
    assert choose_backups({0: "a", 1: "b"}, 0) == [1]
    assert choose_backups({0: "a"}, 0) == []


def test_quorum_is_strict_majority():
    assert not has_quorum(2, 4) and has_quorum(3, 4)
    assert not has_quorum(1, 2) and has_quorum(2, 3) and not has_quorum(0, 0)


def test_exact_half_takes_over_only_without_the_controllers_rank():
    from mindspeed_ha.control.policy.quorum import may_take_over
    assert may_take_over(3, 4, True) and may_take_over(2, 4, False)   # two nodes, the controller's lost
    assert not may_take_over(2, 4, True) and not may_take_over(1, 4, False) and not may_take_over(2, 5, False)
    # exactly half, the controller's rank not among them, but the store still hears the controller (or
    # this standby cannot see the store): the other half of a partition, which must not go on
    assert not may_take_over(2, 4, False, store_lost_it=False) and may_take_over(3, 4, True, store_lost_it=False)


class _Links:
    """Ranks' links coming over to a standby controller: real sockets, registration and heartbeats."""

    def __init__(self, sb, keys):
        self.sb, self.keys, self.ctx, self.socks = sb, keys, _zmq.Context(), []

    def join(self, rank):
        s = self.ctx.socket(_zmq.DEALER)
        s.linger = 0
        _security.secure_client(s, self.keys)
        s.connect(self.sb.endpoint)
        s.send(_protocol.encode("register", rank=rank, world=4, node="n", pid=1000 + rank))
        self.socks.append((rank, s))

    def beat(self, seconds):
        t = _time.time()
        while _time.time() - t < seconds:
            for r, s in self.socks:
                s.send(_protocol.encode("hb", rank=r, it=3, upd=False, health="ok"))
                while s.poll(0):
                    s.recv()
            _time.sleep(0.1)

    def close(self):
        for _, s in self.socks:
            s.close()
        self.ctx.term()
        self.sb.close()


def _standby(tmp_path, monkeypatch, previous=None):
    monkeypatch.setenv("MINDSPEED_HA_DEAD_AFTER", "0.6")
    d = str(tmp_path)
    keys = _security.Keys.load(d, create=True)
    opts = _HAOptions(strategies=frozenset({"dump"}), log_dir=d, heartbeat_s=0.2)
    sb = _Controller(d, 4, opts, keys, rank=3, standby=True, epoch=1, previous=previous).start()
    return sb, _Links(sb, keys)


def test_standby_takes_over_only_with_a_majority(tmp_path, monkeypatch):
    d = str(tmp_path)
    sb, links = _standby(tmp_path, monkeypatch)
    try:
        links.join(3)  # the standby's own rank
        links.join(1)
        links.beat(1.5)
        assert sb.standby and not _os.path.exists(_os.path.join(d, "controller.json"))  # 2 of 4: no
        links.join(2)
        links.beat(1.0)
        assert not sb.standby and sb.epoch == 2
        info = _json.load(open(_os.path.join(d, "controller.json")))
        assert info["rank"] == 3 and info["epoch"] == 2
        ev = [_json.loads(l) for l in open(_os.path.join(d, "events", "controller.jsonl"))]
        assert any(e["event"] == "takeover" and e["rank"] == 3 for e in ev)
        links.beat(1.5)  # rank 0 never came over: its loss is a fault like any other
        assert any(0 in f["ranks"] and f["kind"] == "heartbeat-lost" for f in sb.ledger.all)
    finally:
        links.close()


def test_half_the_world_takes_over_only_once_the_standbys_own_rank_came_over(tmp_path, monkeypatch):
    """The controller's rank 0 is not among them, so half of four may take over: but only ranks whose
    links came over count. Rank 2 alone (a rank that gave up on a live, slow controller) is not half
    with the standby; once the standby's own rank 3 has lost the controller too, the two are."""
    sb, links = _standby(tmp_path, monkeypatch, previous=0)
    try:
        links.join(2)
        links.beat(1.5)
        assert sb.standby
        links.join(3)
        links.beat(1.0)
        assert not sb.standby and sb.epoch == 2
    finally:
        links.close()


def _store_and_standbys(tmp_path, monkeypatch, ranks=(2, 3)):
    """The job store (a TCPStore, as node 0's agent serves it) and a standby on each of ``ranks``,
    each with its own view of the store, their controller (rank 0) gone."""
    import torch.distributed as dist
    from helpers import free_port
    from mindspeed_ha.control.wire.discovery import JobStore
    monkeypatch.setenv("MINDSPEED_HA_DEAD_AFTER", "0.6")
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    out = []
    for r in ranks:
        d = tmp_path / f"standby{r}"
        d.mkdir()
        keys = _security.Keys.load(str(tmp_path), create=True)
        opts = _HAOptions(strategies=frozenset({"dump"}), log_dir=str(d), heartbeat_s=0.2)
        sb = _Controller(str(d), 4, opts, keys, rank=r, standby=True, epoch=1, previous=0,
                         job_store=JobStore(("127.0.0.1", port))).start()
        out.append(_Links(sb, keys))
    return server, port, out


def test_two_standbys_each_with_half_the_world_only_one_takes_over(tmp_path, monkeypatch):
    """The controller's rank 0 is gone. Rank 1's link tried the standby on rank 2, then the one on rank 3:
    each standby has heard from half of the world (its own rank and rank 1) within its window. Once the
    store shows the old controller's counter standing still, both may take over; the store's
    takeover claim lets exactly one."""
    server, _, (a, b) = _store_and_standbys(tmp_path, monkeypatch)
    try:
        a.join(2)
        a.join(1)
        b.join(3)
        b.join(1)
        deadline = _time.time() + 15
        while _time.time() < deadline and a.sb.standby and b.sb.standby:
            a.beat(0.2)
            b.beat(0.2)
        a.beat(1.0)
        b.beat(1.0)
        assert [a.sb.standby, b.sb.standby].count(False) == 1, "one standby, and only one, takes over"
        winner = a.sb if not a.sb.standby else b.sb
        assert winner.epoch == 2
    finally:
        a.close()
        b.close()
        for sb in (a.sb, b.sb):
            sb.job_store.close()
        del server


def test_half_the_world_does_not_take_over_while_the_store_hears_the_controller(tmp_path, monkeypatch):
    """The far side of a partition: the standby's half (ranks 2 and 3) lost the controller, but the job
    store still hears it (its counter moves): this half must not go on. Once the store is gone with its
    host still up (it refuses connections: not a cut link), the standby takes over."""
    from mindspeed_ha.control.wire.discovery import JobStore, beat_key
    server, port, (a,) = _store_and_standbys(tmp_path, monkeypatch, ranks=(3,))
    controller_side = JobStore(("127.0.0.1", port))
    controller_side.beat(beat_key(1))
    try:
        a.join(3)
        a.join(2)
        a.beat(6.0)  # (twice the time the store must show the counter still)
        assert a.sb.standby
        controller_side.close()
        del server  # (the store's host is up, the store is gone)
        a.beat(3.0)
        assert not a.sb.standby and a.sb.epoch == 2
    finally:
        a.close()
        a.sb.job_store.close()


def test_hang_clock_gives_the_first_steps_their_warm_up():
    """A process's first steps may take seconds (allocation, group connections, helpers starting, a
    loaded host): no hang before WARM_UP_S. Once it has ended WARM_UP_STEPS steps, the hang timeout
    holds, and the blame goes to the rank that stopped moving, not to the one still going."""
    from mindspeed_ha.control.policy.ranks import WARM_UP_S, Rank, RankTable
    from mindspeed_ha.options import WARM_UP_STEPS

    def table():
        t = RankTable(2, heartbeat_s=0.5, hang_timeout_s=3.0)
        for r in range(2):
            t.ranks[r] = Rank(rank=r, ident=bytes([r]), seen=0.0, progress_at=0.0)
        return t

    def hb(t, r, it, now):  # (in step ``it``, this process's ``it - 1``-th steps ended)
        t.heard(bytes([r]), {"rank": r, "it": it, "upd": False, "health": "ok", "phase": "forward",
                             "steps": it - 1}, now)

    first = table()
    for now in (0.0, 10.0):          # ten silent seconds in the first step: still warming up
        hb(first, 0, 1, now), hb(first, 1, 1, now)
    assert first.scan(10.0, training=True) == []
    late = 2 * WARM_UP_S + 1         # (the whole job stood still: twice the limit, as below)
    hb(first, 0, 1, late), hb(first, 1, 1, late)
    assert [d.kind for d in first.scan(late, training=True)] == ["hang"]

    k = 1 + WARM_UP_STEPS            # the first step past the warm-up
    early = table()
    for r, it, now in ((0, 1, 0.0), (1, 1, 0.0), (0, k - 1, 1.0), (1, k - 1, 1.0), (0, k, 3.0), (1, k - 1, 4.5)):
        hb(early, r, it, now)        # rank 1 still in its warm-up: not hung yet
    assert early.scan(4.5, training=True) == []

    later = table()
    for r, it, now in ((0, 1, 0.0), (1, 1, 0.0), (0, k, 1.0), (1, k, 1.0), (0, k + 1, 3.0), (1, k, 4.5)):
        hb(later, r, it, now)        # rank 1 stuck in step k for 3.5 s, rank 0 moved 1.5 s ago
    assert [(d.kind, d.ranks) for d in later.scan(4.5, training=True)] == [("hang", [1])]

    stale = table()
    for r, it, now in ((0, 1, 0.0), (1, 1, 0.0), (0, k, 1.0), (1, k, 1.0), (1, k, 2.0), (0, k, 4.5)):
        hb(stale, r, it, now)        # rank 1's heartbeats stopped coming (a starved thread): it may
    assert [(d.kind, d.ranks) for d in stale.scan(4.5, training=True)] == [("hang", [0])]  # have moved on

    late_hb = table()
    for r, it, now in ((0, 1, 0.0), (1, 1, 0.0), (0, k, 1.0), (1, k, 1.0), (0, k, 2.5), (1, k, 4.0)):
        hb(late_hb, r, it, now)      # rank 0 stuck in step k, its heartbeat late; rank 1 waits for it
    late_hb.ranks[1].waiting = True  # in a collective
    assert late_hb.scan(4.2, training=True) == []
    hb(late_hb, 0, k, 4.3)           # rank 0 is heard again, still in step k: it is the hung one
    assert [(d.kind, d.ranks) for d in late_hb.scan(4.3, training=True)] == [("hang", [0])]

    everyone = table()
    for r, it, now in ((0, 1, 0.0), (1, 1, 0.0), (0, k, 1.0), (1, k, 1.0), (0, k, 5.0), (1, k, 5.0)):
        hb(everyone, r, it, now)     # both still at step k for 4 s: the whole job stands still
    assert everyone.scan(5.0, training=True) == []
    hb(everyone, 0, k, 7.5), hb(everyone, 1, k, 7.5)
    assert [(d.kind, d.ranks) for d in everyone.scan(7.5, training=True)] == [("hang", [0, 1])]


def test_a_straggler_is_named_by_its_own_work_not_its_step_time():
    """Every rank's step takes as long as the slowest one's; only a rank's own work (step time less
    its waits for peers) tells the straggler. Slow for ``steps`` steps in a row: named, once per
    process; a step back at speed starts the count again."""
    from mindspeed_ha.control.policy.ranks import Rank
    from mindspeed_ha.control.policy.stragglers import StragglerWatch
    ranks = [Rank(rank=r, ident=bytes([r]), pid=100 + r, busy=0.05, busy_steps=1, steps=10) for r in range(4)]
    watch = StragglerWatch(ratio=1.3, steps=5)
    slow = ranks[2]
    got = []
    for busy, n in ((0.15, 2), (0.05, 1), (0.15, 2), (0.15, 2), (0.15, 1), (0.15, 3)):
        slow.busy, slow.busy_steps = busy, n
        got.append(watch.observe(slow, lambda: ranks))
    assert got[:4] == [None] * 4 and got[4] == pytest.approx(3.0) and got[5] is None
    assert watch.observe(ranks[0], lambda: ranks) is None  # at the others' median
    slow.pid, slow.steps = 999, 2  # its replacement: judged afresh, once past its warm-up
    slow.busy, slow.busy_steps = 0.15, 5
    assert watch.observe(slow, lambda: ranks) is None
    slow.steps = 7
    assert watch.observe(slow, lambda: ranks) == pytest.approx(3.0)
    calm = StragglerWatch(ratio=1.3, steps=1)
    slow.busy, slow.busy_steps = 0.05 + 0.019, 1  # 1.4x, but 19 ms: a time slice, not a straggler
    assert calm.observe(slow, lambda: ranks) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.01, 0.02, 0.05, 0.1, 0.3, 1.0]) | st.floats(0.001, 10.0), min_size=2,
                max_size=40))
def test_a_ranks_ratio_is_to_the_exact_median_of_the_others_work(busy):
    """The others' median the watch judges by is ``statistics.median`` of every other live rank's own
    work (none: not counted): each rank's own value left out, wherever it falls among theirs, ties too."""
    import statistics
    from mindspeed_ha.control.policy.ranks import Rank
    from mindspeed_ha.control.policy.stragglers import StragglerWatch
    ranks = [Rank(rank=r, ident=b"x", pid=100 + r, busy=b, busy_steps=1, steps=10) for r, b in enumerate(busy)]
    watch = StragglerWatch(ratio=1.5, steps=1)
    watch.observe(ranks[0], lambda: ranks)  # (the first judgement takes the values)
    for judged in ranks:
        others = [i.busy for i in ranks if i is not judged and i.busy > 0]
        assert watch._median_without(judged.rank) == (statistics.median(others) if others else None)
    slow = max(ranks, key=lambda i: i.busy)
    slow.busy += 1.0  # (past the noise floor: named at once, with its ratio to the others' median)
    others = [i.busy for i in ranks if i is not slow and i.busy > 0]
    ratio = StragglerWatch(ratio=0.0, steps=1).observe(slow, lambda: ranks)
    assert ratio == (pytest.approx(slow.busy / statistics.median(others)) if others else None)


def test_judging_every_ranks_work_costs_the_job_s_size_a_few_times_per_heartbeat_not_at_each():
    """At 16,384 ranks every heartbeat carries its rank's work (8,000 a second at a 2 s interval): the
    live ranks' values are taken once per 2,048 heard, not at every one, and a straggler among them is
    still named after its slow steps."""
    from mindspeed_ha.control.policy.ranks import Rank
    from mindspeed_ha.control.policy.stragglers import StragglerWatch
    ranks = [Rank(rank=r, ident=b"x", pid=100 + r, busy=0.05 + (r % 7) * 0.001, busy_steps=1, steps=10)
             for r in range(16384)]
    taken: list[int] = []

    def live():
        taken.append(len(ranks))
        return ranks

    watch = StragglerWatch(ratio=1.5, steps=3)
    ranks[4321].busy = 0.2
    named = [r for _ in range(3) for r in range(16384) if watch.observe(ranks[r], live) is not None]
    assert named == [4321] and len(taken) == 3 * 16384 // 2048
    # As a job starts its ranks are heard one after another, most of them with no value yet: the
    # values are still taken about once per 2,048 heard (the first time at once), not at every one.
    ranks = [Rank(rank=r, ident=b"x", pid=100 + r, busy=0.0, busy_steps=1, steps=10) for r in range(16384)]
    taken.clear()
    watch = StragglerWatch(ratio=1.5, steps=3)
    for info in ranks:
        info.busy = 0.05
        watch.observe(info, live)
    assert len(taken) <= 16384 // 2048 + 1, len(taken)


def test_restart_budget_counts_restarts_replacements_and_crash_loops():
    from mindspeed_ha.control.policy.budget import RestartBudget
    b = RestartBudget(2)
    assert b.refusal({1: 5}, set()) is None
    b.count({1: 5}, [])                               # died in step 5, restarted
    assert b.refusal({1: 6}, set()) is None           # got past step 5 before dying again: may go again
    assert "crash loop" in b.refusal({1: 5}, set())   # died again in (or before) the step its predecessor did
    assert b.refusal({1: 5}, set(), crashed=set()) is None  # fell silent with its node (a cut link): no loop
    b.count({1: 6}, [])
    assert "restarted 2 time(s) already (--ha-max-restarts 2)" in b.refusal({1: 9}, set())
    b.count({}, [1, 1])
    assert b.refusal({2: 3}, {1}) is None             # one replacement of node 1 so far
    b.count({}, [1])
    assert "node(s) [1] were replaced 2 time(s)" in b.refusal({2: 3}, {1})


def test_every_rank_learns_the_standbys_at_once_not_at_its_next_heartbeat(tmp_path):
    """A standby's answer reaches every rank as an ack naming it, unasked: a controller lost a moment
    after naming its standbys (before the next heartbeats) must not leave ranks that know no successor."""
    d = str(tmp_path)
    keys = _security.Keys.load(d, create=True)
    opts = _HAOptions(strategies=frozenset({"dump"}), log_dir=d, heartbeat_s=5.0)  # no heartbeat in this test
    c = _Controller(d, 4, opts, keys).start()
    ctx, socks = _zmq.Context(), {}
    try:
        for r in range(4):
            s = socks[r] = ctx.socket(_zmq.DEALER)
            s.linger = 0
            _security.secure_client(s, keys)
            s.connect(c.endpoint)
            s.send(_protocol.encode("register", rank=r, world=4, node=f"n{r // 2}", pid=1000 + r))
        orders, t = {}, _time.time()
        while len(orders) < 2 and _time.time() - t < 20:  # the controller names two standbys
            for r, s in socks.items():
                while s.poll(0):
                    msg = _protocol.decode(s.recv())
                    if msg["t"] == "do" and msg["action"] == "standby":
                        orders[r] = msg["id"]
            _time.sleep(0.02)
        assert len(orders) == 2, orders
        r, oid = next(iter(orders.items()))
        for s in socks.values():  # what each rank has heard so far
            while s.poll(0):
                s.recv()
        socks[r].send(_protocol.encode("result", rank=r, action="standby", id=oid, ok=True, pid=1000 + r,
                                       data="tcp://127.0.0.9:4242"))
        heard = set()
        t = _time.time()
        while len(heard) < 4 and _time.time() - t < 5:
            for q, s in socks.items():
                while s.poll(10):
                    msg = _protocol.decode(s.recv())
                    if msg["t"] == "ack" and "tcp://127.0.0.9:4242" in (msg.get("backups") or []):
                        heard.add(q)
        assert heard == {0, 1, 2, 3}  # (no rank sent anything in between)
    finally:
        for s in socks.values():
            s.close()
        ctx.term()
        c.close()


def test_a_moved_job_store_keeps_the_records_at_home_for_a_replacement_of_node_0():
    """The job store moved (node 0's agent, which served it, is gone): records go to the new store,
    and to the home address too, where a replacement of node 0 — which knows nothing but
    --master-addr — serves a new, empty store: it finds the running job's controller there. The
    controller's counter, the tie-break of a split job, counts only in the store in use."""
    from helpers import free_port
    from mindspeed_ha.comm.stores import serve
    from mindspeed_ha.control.wire.discovery import CONTROLLER_KEY, JobStore, beat_key
    home = ("127.0.0.1", free_port())
    first, moved = serve(*home), serve("127.0.0.1")
    record = {"endpoint": "tcp://127.0.0.1:1", "epoch": 1}
    controller = JobStore(home, period_s=0.1)
    readers: list = []
    try:
        controller.publish(CONTROLLER_KEY, record, epoch=1)
        controller.beat(beat_key(1))

        def seen_at(address):
            reader = JobStore(address, period_s=0.1)
            readers.append(reader)
            reader.watch(CONTROLLER_KEY)
            deadline = _time.time() + 10
            while _time.time() < deadline and reader.seen(CONTROLLER_KEY) is None:
                _time.sleep(0.05)
            return reader.seen(CONTROLLER_KEY)

        assert seen_at(home) == record
        del first  # (node 0's agent is gone)
        assert controller.move(("127.0.0.1", moved.port)) and not controller.move(("127.0.0.1", moved.port))
        assert seen_at(("127.0.0.1", moved.port)) == record
        replacement = serve(*home)  # (node 0 started again)
        assert seen_at(home) == record
        _time.sleep(0.5)
        assert replacement.add(beat_key(1), 0) == 0 and moved.add(beat_key(1), 0) > 0
    finally:
        for s in (controller, *readers):
            s.close()


def test_a_home_store_that_is_gone_is_retried_less_and_less_often():
    """The home store while the job's is elsewhere: when nothing serves it (node 0's agent lost),
    each attempt fails (and torch's client prints errors of its own), so the attempts back off —
    new records, published meanwhile, do not bring the next one forward."""
    from helpers import free_port
    from mindspeed_ha.control.wire.discovery import JobStore
    gone = JobStore(("127.0.0.1", free_port()), period_s=0.1, connect_timeout_s=0.2, publish_only=True)
    try:
        attempts, seen = [], 0
        deadline = _time.monotonic() + 8.0
        while _time.monotonic() < deadline:
            gone.publish("mindspeed_ha/agent/1", {"t": _time.monotonic()})
            if gone._rounds != seen:
                seen = gone._rounds
                attempts.append(_time.monotonic())
            _time.sleep(0.02)
        # (each attempt takes a TCPStore client's connect, 0.5-1.3 s here: 8 or 9 in 8 s without backing off)
        assert 2 <= len(attempts) <= 5, [round(b - a, 2) for a, b in zip(attempts, attempts[1:])]
    finally:
        gone.close()


def test_a_heartbeat_carries_a_ranks_report_of_where_its_training_thread_is_held_until_it_is_not():
    from mindspeed_ha.control.policy.ranks import Rank, RankTable
    t = RankTable(1, heartbeat_s=0.5, hang_timeout_s=3.0)
    t.ranks[0] = Rank(rank=0, ident=b"\0")
    beat = {"rank": 0, "it": 5, "upd": False, "health": "ok", "phase": "recovery"}
    t.heard(b"\0", {**beat, "held": "it is in synchronize (streams.py:90)"}, 1.0)
    assert t.ranks[0].held == "it is in synchronize (streams.py:90)"
    t.heard(b"\0", beat, 2.0)
    assert t.ranks[0].held == ""
