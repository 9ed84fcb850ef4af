"""Every recovery playbook, round by round, against a fake port: each order the controller would send,
every failure, timeout and lost-rank branch — in milliseconds, without processes."""
import pytest

from mindspeed_ha import plan as planner
from mindspeed_ha.control import strategies
from mindspeed_ha.control.strategies import Episode, FirstStep, dump, recover, retry
from mindspeed_ha.control.policy.rounds import DONE, NEXT, Answers, Fail, Goto, Round, Runner

GROUPS = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}  # DP=4, two optimizer instances


class FakePort:
    def __init__(self, live=(0, 1, 2, 3), lost=(), agents=True):
        self._live, self._lost = set(live), set(lost)
        self.orders: list[tuple[int, str, list, dict]] = []
        self.replies: dict[int, dict] = {}
        self.events: list[tuple[str, dict]] = []
        self.restarted: list = []
        self._restarting: set = set()
        self.agents = agents
        self.generation = 0
        self.note = ""
        self.hangs: list = []
        self.failures: list = []
        self.held_reports: dict[int, str] = {}

    # rounds.Port
    def order(self, action, ranks, args):
        oid = len(self.orders) + 1
        self.orders.append((oid, action, list(ranks), args))
        self.replies[oid] = {}
        return oid

    def answers(self, oid):
        return dict(self.replies[oid])

    def quiet(self, oid):
        return False  # (the runner always looks at every answer: what these tests check)

    def live(self):
        return set(self._live)

    def lost(self):
        return set(self._lost)

    def restart(self, ranks):
        if not self.agents:
            return [], [], list(ranks)
        self.restarted.append(list(ranks))
        self._restarting = set(ranks)
        return list(ranks), [], []

    def restarting(self):
        return set(self._restarting)

    def store(self):
        return "127.0.0.1", 4242

    def new_generation(self):
        self.generation += 1
        return self.generation

    def emit(self, event, **fields):
        self.events.append((event, fields))

    def set_note(self, text):
        self.note = text

    def hung(self, ranks, detail):
        self.hangs.append((list(ranks), detail))

    def failed(self, ranks, detail, order_id):
        self.failures.append((list(ranks), detail))

    def condemn(self, ranks):
        self._live -= set(ranks)
        self._lost |= set(ranks)

    def closed(self, faults, now, moved_bytes, phases):
        self.events.append(("closed", {"faults": faults, "moved_bytes": moved_bytes}))

    def scaled(self, dp, replica_groups):
        self.events.append(("scaled", {"dp": dp, "groups": dict(replica_groups)}))

    def leave(self, ranks, reason):
        self.left = (list(ranks), reason)
        self._live -= set(ranks)

    def host_rank(self):
        return 0

    def held(self, rank):
        return self.held_reports.get(rank, "")

    # test helpers
    def last(self):
        return self.orders[-1]

    def answer(self, replies: dict):
        """Every pending rank of the last order answers: rank -> data, or an Exception for a failure."""
        oid = self.last()[0]
        for r, d in replies.items():
            self.replies[oid][r] = (False, str(d)) if isinstance(d, Exception) else (True, d)

    def event(self, name):
        return [f for e, f in self.events if e == name]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def shard(it, upd=False, touched=True, rank=None):
    return {"iteration": it, "updating": upd, "touched": touched, "replica_group": GROUPS[rank], "ended": it,
            "replica": True}


def statuses(it=5, ranks=(0, 1, 2, 3), poisoned=()):
    """What the ranks answer: ``poisoned``, those whose shard a memory error corrupted."""
    return {r: {**shard(it, rank=r), **({"poisoned": True} if r in poisoned else {})} for r in ranks}


def episode(port, strategy="retry", faults=(), replica=True):
    return Episode(port, strategy, 4, list(faults), dict(GROUPS), replica=replica)


def play(strategy, stage, ep, clock=None):
    """``strategy``'s ``stage`` (its first: "first"; its last: "last"), played on ``ep``."""
    stage = {"first": strategy.stages[0], "last": strategy.stages[-1]}[stage]
    runner = Runner(list(stage.rounds), ep, clock=clock or Clock())
    return runner, runner.start()


UCE2 = {"ranks": [2], "kind": "memory-error", "iteration": 6, "phase": "backward", "detect_s": 0.01, "t_detect": 99.0}
KILL1 = {"ranks": [1], "kind": "process-exit", "iteration": 6, "phase": "optimizer", "detect_s": 0.0, "t_detect": 99.0}


# ---- elastic-training --------------------------------------------------------------------------------
LAYOUT = {"dp_ranks": [0, 1, 2, 3], "global_batch": 16, "micro_batch": 2, "replica_num": 2}


def elastic_statuses(ranks=(0, 2, 3), layout=LAYOUT):
    return {r: {**shard(5, rank=r), "layout": dict(layout)} for r in ranks}


def test_elastic_every_round_in_order():
    """Rank 1 lost: status from the live ranks, the plan keeps ranks 0 and 3 (a holder of each shard)
    at DP=2, they scale in; rank 2 and the lost rank 1 leave; the kept ranks roll back and resume."""
    port = FakePort(live=(0, 2, 3), lost=(1,))
    ep = episode(port, strategy="elastic-training", faults=[KILL1])
    runner, out = play(strategies.SCALE_IN, "first", ep)
    assert out is None and port.last()[1:3] == ("ha-status", [0, 2, 3])
    port.answer(elastic_statuses())
    assert runner.tick() is None
    oid, action, ranks, args = port.last()
    assert (action, ranks) == ("scale-in", [0, 3])
    assert args["plan"]["kept"] == [[0], [3]] and args["plan"]["dp"] == 2 and args["generation"] == 1
    assert port.event("resize_plan")[0]["dropped"] == [1, 2]
    port.answer({0: {"received": 12, "seconds": 0.3, "replica_group": [0, 3]},
                 3: {"received": 12, "seconds": 0.2, "replica_group": [0, 3]}})
    assert runner.tick() == "ok"
    assert port.left[0] == [1, 2] and port.event("scaled") == [{"dp": 2, "groups": {0: [0, 3], 3: [0, 3]}}]
    done = port.event("scaled_in")[0]
    assert (done["old_dp"], done["dp"], done["bytes"], done["seconds"]) == (4, 2, 24, 0.3)
    runner, out = play(strategies.SCALE_IN, "last", ep)
    resume = ["resume", {"strategy": "elastic-training", "lost_steps": 0}]
    assert out is None and port.last()[1:] == ("rollback", [0, 3], {"iteration": 5, "fresh_data": True, "then": resume})
    port.answer({0: ["rollback", "resumed"], 3: ["rollback", "resumed"]})
    assert runner.tick() == "ok" and "rollback+resume" in ep.phases


@pytest.mark.parametrize("live,lost,layout,why", [
    ((0, 1, 2, 3), (), LAYOUT, "no rank is lost"),
    ((0, 2, 3), (1,), {**LAYOUT, "global_batch": 6}, "changing the optimizer instance count in process is not built"),
    ((0, 2, 3), (1,), {**LAYOUT, "micro_batch": 16}, "scale-in refused: "),
], ids=["nothing lost", "odd size", "no size divides the batch"])
def test_resize_plan_refusals_fail_the_state(live, lost, layout, why):
    port = FakePort(live=live, lost=lost)
    runner, _ = play(strategies.SCALE_IN, "first", episode(port, strategy="elastic-training", faults=[KILL1]))
    port.answer(elastic_statuses(live, layout))
    out = runner.tick()
    assert out[0] == "failed" and why in out[1], out
    assert not [o for o in port.orders if o[1] == "scale-in"]


def test_elastic_after_an_interrupted_resize_enters_the_same_size_again():
    """Nobody of the layout is lost, but ranks answer that their resize did not complete (a newcomer
    was lost inside a scale-out): the plan keeps the same replicas and they enter the layout again."""
    port = FakePort(live=(0, 1, 2, 3))
    ep = episode(port, strategy="elastic-training", faults=[KILL1])
    runner, _ = play(strategies.SCALE_IN, "first", ep)
    layout = {**LAYOUT, "dp_ranks": [0, 1]}
    st = {r: {**shard(5, rank=r), "replica_group": [0, 1], "layout": layout, "unfinished": True} for r in (0, 1)}
    port.answer({**st, 2: {"replica": True, "joining": True}, 3: {"replica": True, "joining": True}})
    assert runner.tick() is None
    _, action, ranks, args = port.last()
    assert (action, ranks, args["plan"]["dp"]) == ("scale-in", [0, 1], 2) and ep.dropped == []
    port.answer({0: {"received": 8, "seconds": 0.2, "replica_group": [0, 1]},
                 1: {"received": 8, "seconds": 0.2, "replica_group": [0, 1]}})
    assert runner.tick() == "ok" and ep.how == "data-parallel size 2 again: the interrupted resize undone"


def test_elastic_refused_when_the_controllers_own_rank_would_leave():
    """Rank 0 (hosting the controller) stopped before its update, so its twin 2 serves the shard:
    the plan would keep replicas 2 and 3 and park rank 0 — refused (the dump follows)."""
    port = FakePort(live=(0, 2, 3), lost=(1,))
    runner, _ = play(strategies.SCALE_IN, "first", episode(port, strategy="elastic-training", faults=[KILL1]))
    st = elastic_statuses()
    st[0].update(iteration=4, updating=True, touched=False)
    port.answer(st)
    out = runner.tick()
    assert out[0] == "failed" and "the controller's own rank 0 would leave the job" in out[1], out


def test_elastic_a_failed_scale_in_fails_the_state_and_nobody_leaves():
    port = FakePort(live=(0, 2, 3), lost=(1,))
    runner, _ = play(strategies.SCALE_IN, "first", episode(port, strategy="elastic-training", faults=[KILL1]))
    port.answer(elastic_statuses())
    runner.tick()
    port.answer({0: {"received": 1, "seconds": 0.1, "replica_group": [0, 3]}, 3: RuntimeError("reshard: no holder")})
    out = runner.tick()
    assert out[0] == "failed" and "scale-in failed" in out[1] and not hasattr(port, "left")


SCALE = {"ranks": [2, 3], "kind": "scale-out", "iteration": 9, "phase": "boundary", "detect_s": 0.0,
         "t_detect": 99.0}
SCALED_IN = {**LAYOUT, "dp_ranks": [0, 1]}


def scaled_in_statuses():
    return {r: {**shard(9, rank=r), "replica_group": [0, 1], "layout": dict(SCALED_IN)} for r in (0, 1)}


def test_scale_out_every_round_in_order():
    """Ranks 0 and 1 train at DP=2; ranks 2 and 3 came back (registered, holding nothing): status
    (the newcomers answer "joining"), the plan grows to DP=4 in the original order, every rank of it
    scales out, then rolls back to the plan's iteration and resumes; the first step emits scaled_out."""
    port = FakePort(live=(0, 1, 2, 3))
    ep = Episode(port, "scale-out", 4, [SCALE], {0: [0, 1], 1: [0, 1]})
    runner, out = play(strategies.SCALE_OUT, "first", ep)
    assert out is None and port.last()[1:3] == ("ha-status", [0, 1, 2, 3])
    port.answer({**scaled_in_statuses(), 2: {"replica": True, "joining": True}, 3: {"replica": True, "joining": True}})
    assert runner.tick() is None
    oid, action, ranks, args = port.last()
    assert (action, ranks) == ("scale-out", [0, 1, 2, 3])
    assert args["plan"]["kept"] == [[0], [1], [2], [3]] and args["plan"]["sources"] == [2, 0, 3, 0]
    assert port.event("resize_plan")[0]["added"] == [2, 3]
    port.answer({r: {"received": 10, "seconds": 0.2, "replica_group": [r % 2, r % 2 + 2]} for r in range(4)})
    assert runner.tick() == "ok"
    assert port.event("scaled")[0]["dp"] == 4 and not hasattr(port, "left")
    runner, out = play(strategies.SCALE_OUT, "last", ep)
    resume = ["resume", {"strategy": "scale-out", "lost_steps": 0}]
    assert port.last()[1:] == ("rollback", [0, 1, 2, 3], {"iteration": 9, "fresh_data": True, "then": resume})
    port.answer({r: ["rollback", "resumed"] for r in range(4)})
    assert runner.tick() == "ok"
    assert FirstStep(ep, [SCALE], 100.0).check(101.0, True)
    done = port.event("scaled_out")[0]
    assert (done["old_dp"], done["dp"], done["added"], done["bytes"], done["seconds"]) == (2, 4, [2, 3], 40, 2.0)
    assert not port.event("recovered")


def test_scale_out_refused_leaves_the_newcomers_out_and_trains_on():
    """Only rank 2 came back (DP=3 would drop the twins): it is told to leave; the running ranks
    roll back to where they parked and resume at DP=2."""
    port = FakePort(live=(0, 1, 2))
    ep = Episode(port, "scale-out", 4, [SCALE], {0: [0, 1], 1: [0, 1]})
    runner, _ = play(strategies.SCALE_OUT, "first", ep)
    port.answer({**scaled_in_statuses(), 2: {"replica": True, "joining": True}})
    assert runner.tick() == "ok"
    assert port.left[0] == [2] and "scale-out refused" in port.left[1]
    assert port.event("scale_out_refused")[0]["newcomers"] == [2]
    assert not [o for o in port.orders if o[1] == "scale-out"]
    runner, _ = play(strategies.SCALE_OUT, "last", ep)
    assert port.last()[1:] == ("rollback", [0, 1], {"iteration": 9, "fresh_data": True,
                                                    "then": ["resume", {"strategy": "scale-out", "lost_steps": 0}]})


def test_a_refused_scale_out_enters_the_layout_again_when_a_rank_was_stopped_inside_a_step():
    """As above, but rank 1 had begun its next step when the pause came and was stopped inside it (rank
    0 parked): its communicators hold that step's collectives, so both enter DP=2 again on new ones
    (the resize order, the same layout) before they roll back. Nothing scaled out, nothing scaled in."""
    port = FakePort(live=(0, 1, 2))
    ep = Episode(port, "scale-out", 4, [SCALE], {0: [0, 1], 1: [0, 1]})
    runner, _ = play(strategies.SCALE_OUT, "first", ep)
    statuses = scaled_in_statuses()
    statuses[1]["stopped_in_step"] = True
    port.answer({**statuses, 2: {"replica": True, "joining": True}})
    assert runner.tick() is None and port.left[0] == [2]
    oid, action, ranks, args = port.last()
    assert (action, ranks) == ("scale-in", [0, 1])
    assert args["plan"]["kept"] == [[0], [1]] and args["plan"]["dp"] == 2 and args["generation"] == ep.generation
    port.answer({r: {"received": 0, "seconds": 0.1, "replica_group": [0, 1]} for r in (0, 1)})
    assert runner.tick() == "ok"
    assert port.event("scaled")[0]["dp"] == 2 and not port.event("scaled_in") and not port.event("scaled_out")
    runner, _ = play(strategies.SCALE_OUT, "last", ep)
    assert port.last()[1:] == ("rollback", [0, 1], {"iteration": 9, "fresh_data": True,
                                                    "then": ["resume", {"strategy": "scale-out", "lost_steps": 0}]})


# ---- retry -------------------------------------------------------------------------------------------
def test_retry_every_round_in_order():
    port = FakePort()
    ep = episode(port, faults=[UCE2])
    runner, out = play(strategies.RETRY, "first", ep)
    assert out is None and port.last()[1:3] == ("ha-status", [0, 1, 2, 3])
    port.answer(statuses(poisoned=[2]))
    assert runner.tick() is None  # plan (controller alone) then the rebuild order
    oid, action, ranks, args = port.last()
    assert action == "rebuild" and ranks == [0, 1, 2, 3]
    # (one order: each rank rebuilds, then repairs)
    assert args == {"store_host": "127.0.0.1", "store_port": 4242, "generation": 1,
                    "then": ["repair", {"pairs": [0, 2], "iteration": 5, "joiners": []}]}
    assert port.event("restore_plan") == [{"iteration": 5, "pairs": [0, 2], "joiners": [], "generation": 1}]
    port.answer({r: ["reconnected", {"received": 64 * (r == 2)}] for r in range(4)})
    assert runner.tick() == "ok" and ep.moved_bytes == 64  # REPAIR is over
    runner, out = play(strategies.RETRY, "last", ep)
    # (every rank had ended step 5 before the fault: one in the step's end could not have run the loop's
    # code after it, which a peer stopped there passed alone — that rank answers it alone too)
    resume = ["resume", {"strategy": "retry", "lost_steps": 0}]
    assert out is None and port.last()[1:] == ("rollback", [0, 1, 2, 3],
                                               {"iteration": 5, "ended_elsewhere": True, "then": resume})
    port.answer({r: ["rollback", "resumed"] for r in range(4)})
    assert runner.tick() == "ok" and ep.how == "rollback"
    assert [o[1] for o in port.orders] == ["ha-status", "rebuild", "rollback"]
    assert set(ep.phases) == {"status", "rebuild+repair", "rollback+resume"}


def test_the_rebuild_and_the_repair_are_two_rounds_where_a_rank_joins():
    """A restarted rank (recover) builds its model after the rebuild (Megatron-LM's loop): the repair
    is an order of its own then."""
    port = FakePort(live=(0, 2, 3), lost=(1,))
    ep = episode(port, "recover", faults=[KILL1])
    runner, _ = play(strategies.RETRY, "first", ep)
    ep.joiners = [1]
    port._live.add(1)
    port.answer({r: s for r, s in statuses(6).items() if r != 1})
    assert runner.tick() is None and port.last()[1] == "rebuild" and "then" not in port.last()[3]
    port.answer({r: "ok" for r in range(4)})
    assert runner.tick() is None and port.last()[1] == "repair"


def test_retry_lagging_twin_is_copied_too():
    """Rank 0 finished its update of step 6, its twin 2 was stopped before touching its shard: the
    plan is iteration 6 and 2 gets the shard from 0 (rank 2's memory error aside)."""
    port = FakePort()
    ep = episode(port)
    runner, _ = play(strategies.RETRY, "first", ep)
    st = statuses(6)
    st[2] = shard(5, upd=True, touched=False, rank=2)
    port.answer(st)
    runner.tick()
    assert ep.plan.iteration == 6 and list(ep.plan.copies) == [(0, 2)]


def test_retry_a_failed_status_fails_the_state():
    port = FakePort()
    runner, _ = play(strategies.RETRY, "first", episode(port, faults=[UCE2]))
    port.answer({**statuses(), 1: RuntimeError("boom")})
    assert runner.tick() == ("failed", "status failed (rank 1: boom)")


@pytest.mark.parametrize("stage,error", [("first", "rebuild: RuntimeError: store gone"),
                                         ("first", "repair: RuntimeError: bad shard"),
                                         ("last", "rollback: RuntimeError: no RNG snapshot")])
def test_a_failed_answer_to_a_merged_round_is_a_new_fault_at_once(stage, error):
    """The ranks that answered went on (into the repair's collectives, or training): the round does
    not wait for the others, which may wait on the failed rank, and it does not end the state. The
    failure is a new fault, so the controller stops every survivor (PAUSE) before it plans again."""
    port = FakePort()
    ep = episode(port, faults=[UCE2])
    runner, _ = play(strategies.RETRY, "first", ep)
    if stage == "last":
        port.answer(statuses())
        runner.tick()
        port.answer({r: ["ok", {"received": 0}] for r in range(4)})
        assert runner.tick() == "ok"
        runner, _ = play(strategies.RETRY, "last", ep)
    else:
        port.answer(statuses())
        assert runner.tick() is None
    merged = port.last()[1] + "+" + port.last()[3]["then"][0]
    port.answer({0: ["ok", "ok"], 1: RuntimeError(error)})  # (ranks 2 and 3 still at work)
    assert runner.tick() is None
    assert port.failures == [([1], f"{merged} failed (rank 1: {error})")]
    assert merged not in ep.phases


def test_a_merged_answer_without_both_parts_is_a_failure():
    port = FakePort()
    runner, _ = play(strategies.RETRY, "first", episode(port))
    port.answer(statuses())
    runner.tick()
    port.answer({0: ["ok", {"received": 0}], 1: "ok", 2: ["ok", {}], 3: ["ok", {}]})
    assert runner.tick() is None and port.failures == [([1], "rebuild+repair failed (rank 1: did not run both)")]


def test_retry_a_silent_rank_times_the_round_out():
    port, clock = FakePort(), Clock()
    runner, _ = play(strategies.RETRY, "first", episode(port), clock)
    port.answer({r: s for r, s in statuses().items() if r != 3})
    clock.t += retry.ROUND_WAIT_S - 1
    assert runner.tick() is None  # still waiting for rank 3
    clock.t += 2
    assert runner.tick() == ("failed", "status failed (rank 3: no answer)")


def test_a_silent_ranks_own_report_of_where_it_is_held_is_in_the_failure_whole():
    port, clock = FakePort(), Clock()
    runner, _ = play(strategies.RETRY, "first", episode(port), clock)
    where = "the training thread has not taken the controller's order for 29s; it is in synchronize " + "x" * 700
    port.held_reports = {3: where, 1: "a report of a rank that answered: not shown"}
    port.answer({r: s for r, s in statuses().items() if r != 3})
    clock.t += retry.ROUND_WAIT_S + 1
    assert runner.tick() == ("failed", f"status failed (rank 3: no answer ({where}))")


def test_retry_a_rank_lost_meanwhile_in_a_merged_round_is_a_fault():
    port = FakePort()
    runner, _ = play(strategies.RETRY, "first", episode(port))
    port.answer(statuses())
    runner.tick()
    port.answer({0: ["ok", {}], 1: ["ok", {}], 2: ["ok", {}]})
    port._live.discard(3)
    assert runner.tick() is None and port.failures == [([3], "rebuild+repair failed (rank 3: lost)")]


def test_a_rank_lost_in_a_round_of_its_own_fails_it():
    """Where a rank joins, the rebuild is a round of its own: nobody went on, and a rank lost in it
    fails the state as before."""
    port = FakePort()
    ep = episode(port, "recover")
    runner, _ = play(strategies.RETRY, "first", ep)
    ep.joiners = [1]
    port.answer(statuses())
    runner.tick()
    port.answer({0: "ok", 1: "ok", 2: "ok"})
    port._live.discard(3)
    assert runner.tick() == ("failed", "rebuild failed (rank 3: lost)") and not port.failures


def test_retry_refused_when_a_shard_has_no_healthy_holder_and_no_checkpoint():
    port = FakePort()
    both = [UCE2, {**UCE2, "ranks": [0]}]
    runner, _ = play(strategies.RETRY, "first", episode(port, faults=both))
    port.answer(statuses(poisoned=[0, 2]))
    out = runner.tick()
    assert out[0] == "failed" and "[0, 2]" in out[1] and "every replica lost" in out[1]
    assert "no periodic checkpoint every rank can reload" in out[1]
    assert [o[1] for o in port.orders] == ["ha-status"]  # nothing rebuilt


def test_a_memory_error_already_repaired_leaves_its_rank_a_holder():
    """Rank 2's memory error of an earlier episode is among the faults (a controller that took over
    was told of it again), but rank 2's shard was repaired since: its status is what counts, so
    when rank 0 is lost, rank 2 serves shard [0, 2]."""
    port = FakePort(live=(1, 2, 3), lost=(0,))
    ep = episode(port, strategy="recover", faults=[UCE2, {**KILL1, "ranks": [0]}])
    runner, _ = play(strategies.RETRY, "first", ep)
    port.answer(statuses(ranks=(1, 2, 3)))
    assert runner.tick() is None and port.last()[1] == "rebuild", port.orders
    (plan,) = port.event("restore_plan")
    assert plan["iteration"] == 5 and "reload" not in plan


def test_both_twins_lost_falls_back_to_the_periodic_checkpoint():
    """Both holders of shard [0, 2] poisoned, a periodic checkpoint of iteration 3: the job goes on
    from it (every rank reloads, the steps since are recomputed) instead of ending."""
    port = FakePort()
    ep = episode(port, faults=[UCE2, {**UCE2, "ranks": [0]}])
    runner, _ = play(strategies.RETRY, "first", ep)
    port.answer({r: {**st, "checkpoint": [3, "/ck/iter_0000003"]} for r, st in statuses(poisoned=[0, 2]).items()})
    assert runner.tick() is None and port.last()[1] == "rebuild"
    (plan,) = port.event("restore_plan")
    assert plan["iteration"] == 3 and plan["lost_steps"] == 2 and "every replica lost" in plan["reason"]
    port.answer({r: "ok" for r in range(4)})
    assert runner.tick() is None and port.last()[1:] == ("reload", [0, 1, 2, 3], {"ended": 5})
    port.answer({r: {"iteration": 3} for r in range(4)})
    assert runner.tick() == "ok" and ep.source == "checkpoint" and ep.how == "reload"


def test_a_resume_of_its_own_that_fails_fails_the_state():
    """After a reload there is no rollback (every rank is at the checkpoint): the resume is alone."""
    port = FakePort()
    ep = episode(port)
    ep.source = "checkpoint"
    runner, _ = play(strategies.RETRY, "last", ep)
    assert port.last()[1] == "resume" and "then" not in port.last()[3]
    port.answer({0: RuntimeError("no RNG snapshot"), 1: "x", 2: "x", 3: "x"})
    assert runner.tick() == ("failed", "resume failed (rank 0: no RNG snapshot)")


def test_failed_reports_and_notes():
    port = FakePort()
    ep = episode(port)
    note = strategies.failed("strategy_failed", ep, "status failed (rank 1: boom)")
    assert note == "retry failed (status failed (rank 1: boom))"
    assert port.event("strategy_failed") == [{"reason": "status failed (rank 1: boom)", "strategy": "retry"}]


# ---- recover -----------------------------------------------------------------------------------------
def test_recover_restarts_the_lost_rank_and_it_joins():
    port, clock = FakePort(live=(0, 2, 3), lost=(1,)), Clock()
    ep = episode(port, "recover", faults=[KILL1])
    runner, _ = play(strategies.RECOVER, "first", ep, clock)
    port.answer({r: s for r, s in statuses(6).items() if r != 1})
    assert runner.tick() is None
    assert port.restarted == [[1]] and port.event("restart") == [{"ranks": [1], "awaiting_node": []}]
    clock.t += 1.0
    assert runner.tick() is None  # not registered yet
    port._restarting.clear()
    port._live.add(1)
    assert runner.tick() is None and port.last()[1] == "rebuild" and port.last()[2] == [0, 1, 2, 3]
    assert list(ep.plan.joiners) == [(1, 3)] and list(ep.plan.copies) == [(3, 1)]
    assert ep.phases["restart"] == 1.0


def test_recover_waits_out_the_spare_wait_then_switches_to_elastic():
    """recover with elastic on: rank 1's node is lost, no replacement registers within --ha-spare-wait
    (0 s here): the episode switches to elastic-training, nothing was rebuilt or repaired."""
    port, clock = FakePort(live=(0, 2, 3), lost=(1,)), Clock()
    ep = episode(port, "recover", faults=[KILL1])
    ep.spare_wait = 0.0
    runner, _ = play(strategies.RECOVER, "first", ep, clock)
    port.answer({r: s for r, s in statuses(6).items() if r != 1})
    assert runner.tick() is None and port.restarted == [[1]]  # asked; nobody came
    out = runner.tick()
    assert out == ("switch", "elastic-training", "no replacement for rank(s) [1] within --ha-spare-wait 0 s: "
                   "the job scales in without them"), out
    assert [o[1] for o in port.orders] == ["ha-status"]
    ep2 = episode(FakePort(live=(0, 2, 3), lost=(1,)), "recover", faults=[KILL1])  # no wait: recover as ever
    runner, _ = play(strategies.RECOVER, "first", ep2, clock)
    ep2.port.answer({r: s for r, s in statuses(6).items() if r != 1})
    assert runner.tick() is None and runner.current.name == "restart"


def test_recover_a_rank_restarted_earlier_still_joining_holds_nothing():
    port = FakePort()
    ep = episode(port, "recover")
    runner, _ = play(strategies.RECOVER, "first", ep)
    st = statuses(6)
    st[1] = {"replica": True, "joining": True}
    port.answer(st)
    runner.tick()
    assert "restart" not in ep.phases  # nothing lost now: the round is skipped
    assert ep.joiners == [1] and list(ep.plan.joiners) == [(1, 3)]


@pytest.mark.parametrize("case,why", [
    ("no agent", "rank(s) [1] have no launcher agent to restart them"),
    ("unknown group", "the replica group of rank(s) [1] is unknown"),
    ("never back", "restart failed (rank 1: did not come back)"),
])
def test_recover_refusals(case, why):
    port, clock = FakePort(live=(0, 2, 3), lost=(1,), agents=case != "no agent"), Clock()
    ep = episode(port, "recover")
    if case == "unknown group":
        ep.groups = {}
    runner, _ = play(strategies.RECOVER, "first", ep, clock)
    st = {r: s for r, s in statuses(6).items() if r != 1}
    if case == "unknown group":
        for s in st.values():
            s["replica_group"] = [s["replica_group"][0]] if 1 not in s["replica_group"] else [3]
    port.answer(st)
    out = runner.tick()
    if case == "never back":
        assert out is None
        clock.t += recover.RESTART_WAIT_S + 1
        out = runner.tick()
    assert out[0] == "failed" and why in out[1], out


HANG3 = {"ranks": [3], "kind": "hang", "iteration": 6, "phase": "forward", "detect_s": 3.0, "t_detect": 99.0}


def test_recover_a_hung_rank_is_replaced_like_a_dead_one():
    """A hang fault on rank 3: status is not asked of it (its training thread will not answer); the
    restart round condemns it (its agent kills it) and restarts it; it joins like a dead one."""
    port = FakePort()
    ep = episode(port, "recover", faults=[HANG3])
    runner, _ = play(strategies.RECOVER, "first", ep)
    assert port.last()[1:3] == ("ha-status", [0, 1, 2])
    port.answer({r: s for r, s in statuses(6).items() if r != 3})
    assert runner.tick() is None and port.restarted == [[3]] and 3 not in port.live()
    port._restarting.clear()
    port._live.add(3)
    assert runner.tick() is None and port.last()[1] == "rebuild"
    assert list(ep.plan.joiners) == [(3, 1)] and list(ep.plan.copies) == [(1, 3)]


MIGRATE1 = {"ranks": [1], "kind": "migrate", "iteration": 6, "phase": "step", "detect_s": 0.0, "t_detect": 99.0}


def test_migrate_replaces_a_live_rank_from_its_twin_and_counts_the_bytes():
    """A migration is a planned recover: the moving rank answers its status too (it parks between two
    steps before it is ended) but what it holds is not counted, the restart round ends it and hands its
    rank to a spare, the twin's shard is copied, and the first step closes it."""
    port = FakePort()
    ep = episode(port, "recover", faults=[MIGRATE1])
    runner, _ = play(strategies.RECOVER, "first", ep)
    assert port.last()[1:3] == ("ha-status", [0, 1, 2, 3])
    port.answer(statuses(6))
    assert runner.tick() is None and port.restarted == [[1]] and 1 not in port.live()
    assert sorted(ep.statuses) == [0, 2, 3]
    port._restarting.clear()
    port._live.add(1)
    assert runner.tick() is None and port.last()[1] == "rebuild"
    assert list(ep.plan.joiners) == [(1, 3)] and list(ep.plan.copies) == [(3, 1)]
    port.answer({r: "ok" for r in range(4)})
    assert runner.tick() is None and port.last()[1] == "repair"
    port.answer({0: {"received": 0}, 1: {"received": 4096}, 2: {"received": 0}, 3: {"received": 0}})
    assert runner.tick() == "ok" and ep.moved_bytes == 4096
    FirstStep(ep, [MIGRATE1], resumed_at=100.0).check(100.1, completed=True)
    assert port.event("closed") == [{"faults": [MIGRATE1], "moved_bytes": 4096}]


def test_recover_a_rank_silent_in_a_round_is_hung_and_the_recovery_starts_over():
    port, clock = FakePort(), Clock()
    runner, _ = play(strategies.RECOVER, "first", episode(port, "recover"), clock)
    port.answer(statuses(6))
    runner.tick()  # rebuild (with the repair) sent
    port.answer({0: ["ok", {}], 1: ["ok", {}], 3: ["ok", {}]})
    port.held_reports = {2: "it is in synchronize (streams.py:90)"}
    clock.t += retry.ROUND_WAIT_S + 1
    assert runner.tick() is None
    assert port.hangs == [([2], f"no answer to rebuild+repair within {retry.ROUND_WAIT_S:g}s; "
                                "rank 2: it is in synchronize (streams.py:90)")]


def test_dump_does_not_ask_a_hung_rank():
    port = FakePort()
    runner, _ = play(strategies.DUMP, "first", episode(port, "dump", faults=[HANG3]))
    assert port.last()[1:3] == ("dump-status", [0, 1, 2])


# ---- reload (no replicas) ----------------------------------------------------------------------------
def test_reload_every_rank_reloads_the_periodic_checkpoint():
    port = FakePort()
    ep = episode(port, replica=False)
    runner, _ = play(strategies.RETRY, "first", ep)
    port.answer({r: {"replica": False, "ended": 5 if r else 4, "checkpoint": [3, "/ck/iter_0000003"]} for r in range(4)})
    runner.tick()
    assert port.event("restore_plan") == [{"iteration": 3, "reload": "/ck/iter_0000003", "lost_steps": 2,
                                          "generation": 1, "reason": "no replicas"}]
    port.answer({r: "ok" for r in range(4)})
    runner.tick()
    assert port.last()[1] == "reload" and port.last()[3] == {"ended": 5}
    port.answer({r: {"iteration": 3} for r in range(4)})
    assert runner.tick() == "ok" and ep.how == "reload" and ep.lost_steps == 2
    runner, out = play(strategies.RETRY, "last", ep)
    assert port.last()[1] == "resume"  # the reload put every rank at the checkpoint: no rollback


def test_reload_refused_without_a_common_checkpoint():
    port = FakePort()
    runner, _ = play(strategies.RETRY, "first", episode(port, replica=False))
    port.answer({r: {"replica": False, "ended": 5, "checkpoint": None if r == 2 else [3, "/ck"]} for r in range(4)})
    out = runner.tick()
    assert out[0] == "failed" and "no periodic checkpoint every rank can reload" in out[1]


# ---- dump --------------------------------------------------------------------------------------------
def dump_status(it=6, rank=0, fallback=None):
    return {"iteration": it, "updating": False, "touched": True, "replica_group": GROUPS[rank],
            "trainer_iteration": it, "save": "/ck", "fallback": fallback, "abandoned": False}


def written(it=6):
    return {"iteration": it, "path": f"/ck/iter_{it:07d}", "seconds": 0.3, "bytes": 100, "save": "/ck"}


def test_dump_status_plan_write():
    port = FakePort(live=(0, 2, 3), lost=(1,))
    ep = episode(port, "dump", faults=[KILL1])
    runner, _ = play(strategies.DUMP, "first", ep)
    assert port.last()[1:3] == ("dump-status", [0, 2, 3])
    port.answer({r: dump_status(rank=r) for r in (0, 2, 3)})
    assert runner.tick() is None
    oid, action, ranks, args = port.last()
    assert action == "dump" and ranks == [0, 2, 3] and args["survivors"] == [0, 2, 3] and args["generation"] == 1
    assert args["plan"]["iteration"] == 6 and args["plan"]["writers"] == {"0,2": 0, "1,3": 3}
    port.answer({r: written() for r in (0, 2, 3)})
    assert runner.tick() == "ok"
    (cp,) = port.event("checkpoint")
    assert cp["kind"] == "dying_gasp" and cp["iteration"] == 6 and cp["ranks"] == [0, 3]
    assert "dying-gasp checkpoint of iteration 6 written to /ck/iter_0000006" in port.note


def test_dump_poisoned_joining_and_refusing_ranks_are_left_out():
    """Rank 2's shard is corrupted and rank 1 is a restarted worker still joining: each says it holds
    nothing (neither raises), and 0 and 3, a holder of each shard, write the dump."""
    port, clock = FakePort(), Clock()
    ep = episode(port, "dump", faults=[UCE2])
    runner, _ = play(strategies.DUMP, "first", ep, clock)
    assert port.last()[2] == [0, 1, 2, 3]  # every live rank is asked: each says what it holds
    port.answer({0: dump_status(rank=0), 1: {"holds": False, "why": "restarted, it holds no state yet"},
                 2: {"holds": False, "why": "a memory error corrupted its optimizer shard"}, 3: dump_status(rank=3)})
    assert runner.tick() is None and port.last()[1:3] == ("dump", [0, 3])


def test_dump_a_refusing_rank_is_left_out():
    port, clock = FakePort(), Clock()
    runner, _ = play(strategies.DUMP, "first", episode(port, "dump"), clock)
    port.answer({0: dump_status(rank=0), 1: dump_status(rank=1), 2: RuntimeError("no --save directory"),
                 3: dump_status(rank=3)})
    assert runner.tick() is None and port.last()[1:3] == ("dump", [0, 1, 3])


def test_dump_a_silent_survivor_is_left_out_after_the_wait():
    port, clock = FakePort(), Clock()
    runner, _ = play(strategies.DUMP, "first", episode(port, "dump"), clock)
    port.answer({r: dump_status(rank=r) for r in (0, 1, 2)})
    assert runner.tick() is None
    clock.t += dump.DUMP_STATUS_WAIT_S + 1
    assert runner.tick() is None and port.last()[1] == "dump" and port.last()[2] == [0, 1, 2]


def test_dump_no_survivor_could_prepare():
    port = FakePort()
    runner, _ = play(strategies.DUMP, "first", episode(port, "dump"))
    port.answer({r: RuntimeError("no --save directory") for r in range(4)})
    assert runner.tick() == ("failed", "dying-gasp checkpoint refused, nothing written: no survivor could prepare "
                                       "its state (no --save directory); no periodic checkpoint exists to fall back on")


def test_dump_refused_when_no_survivor_holds_a_shard_names_the_checkpoint_to_resume_from():
    """The others are silent (held), the one that answers holds nothing (a memory error poisoned its
    shard): the refusal says why, and names the newest periodic checkpoint that rank knows of."""
    port, clock = FakePort(), Clock()
    runner, _ = play(strategies.DUMP, "first", episode(port, "dump"), clock)
    port.answer({1: {"holds": False, "why": "a memory error corrupted its optimizer shard",
                     "fallback": [4, "/ck/iter_0000004"]}})
    assert runner.tick() is None
    clock.t += dump.DUMP_STATUS_WAIT_S + 1
    assert runner.tick() == ("failed", "dying-gasp checkpoint refused, nothing written: no survivor could prepare "
                                       "its state (rank 1: a memory error corrupted its optimizer shard); fall back "
                                       "to the newest periodic checkpoint, iteration 4 in /ck/iter_0000004")


def test_dump_refused_when_both_replicas_are_lost():
    port = FakePort(live=(0, 2), lost=(1, 3))
    ep = episode(port, "dump")
    runner, _ = play(strategies.DUMP, "first", ep)
    port.answer({r: dump_status(rank=r, fallback=[4, "/ck/iter_0000004"]) for r in (0, 2)})
    out = runner.tick()
    assert out[0] == "failed" and "refused, nothing written" in out[1] and "iteration 4 in /ck/iter_0000004" in out[1]
    strategies.failed("dump_refused", ep, out[1])
    assert port.event("dump_refused")[0]["missing"] == [[1, 3]]


def test_dump_a_writer_lost_stops_the_others_and_the_rest_write_again():
    port = FakePort()
    ep = episode(port, "dump")
    runner, _ = play(strategies.DUMP, "first", ep)
    port.answer({r: dump_status(rank=r) for r in range(4)})
    runner.tick()
    first = port.last()
    port._live.discard(2)  # rank 2 dies while writing: the others may be blocked on it
    assert runner.tick() is None
    assert port.last()[1] == "stop" and port.last()[2] == [0, 1, 3]
    port.replies[first[0]].update({r: (False, "CollectiveStopped") for r in (0, 1, 3)})
    assert runner.tick() is None  # planned again without rank 2, and written again
    oid, action, ranks, args = port.last()
    assert action == "dump" and ranks == [0, 1, 3] and args["generation"] == 2
    assert args["plan"]["writers"] == {"0,2": 0, "1,3": 1}
    port.answer({r: written() for r in (0, 1, 3)})
    assert runner.tick() == "ok" and ep.result["survivors"] == [0, 1, 3]


def test_dump_a_write_that_fails_refuses():
    port = FakePort()
    runner, _ = play(strategies.DUMP, "first", episode(port, "dump"))
    port.answer({r: dump_status(rank=r) for r in range(4)})
    runner.tick()
    port.answer({0: RuntimeError("disk full"), 1: written(), 2: written(), 3: written()})
    assert runner.tick() == ("failed", "the survivors could not write the checkpoint (rank 0: disk full)")


# ---- after the recovery, and the runner itself ---------------------------------------------------------
def test_first_step_closes_the_recovery():
    port = FakePort()
    ep = episode(port)
    ep.plan = planner.plan_repair(planner.holders(4, statuses(), GROUPS))
    ep.phases.update(detect=0.01, stop=0.05)
    ep.how = "rollback"
    watch = FirstStep(ep, [UCE2], resumed_at=100.0)
    assert watch.target == 6
    assert watch.check(100.2, completed=False) is False and not port.event("recovered")
    assert watch.check(100.3, completed=True) is True
    (rec,) = port.event("recovered")
    assert rec["strategy"] == "retry" and rec["iteration"] == 5 and rec["how"] == "rollback"
    assert rec["mttr_s"] == pytest.approx(0.01 + 100.3 - 99.0) and rec["phases"]["first_step"] == pytest.approx(0.3)
    assert rec["faults"] == [{"ranks": [2], "kind": "memory-error", "iteration": 6, "phase": "backward"}]
    assert "first_step_interrupted" not in rec


def test_a_new_fault_in_the_first_step_still_reports_the_recovery():
    """The job was training again when the next fault came: that recovery is over and reported (its
    MTTR up to the new fault), not folded into the next one's episode."""
    port = FakePort()
    ep = episode(port)
    ep.plan = planner.plan_repair(planner.holders(4, statuses(), GROUPS))
    ep.how = "roll-forward"
    watch = FirstStep(ep, [UCE2], resumed_at=100.0)
    assert watch.check(100.05, completed=False, interrupted=True) is True
    (rec,) = port.event("recovered")
    assert rec["first_step_interrupted"] and rec["phases"]["first_step"] == pytest.approx(0.05)


def test_a_recovery_a_new_fault_closes_ends_where_that_fault_struck_not_where_it_was_found():
    """A hang found 3 s after it struck in the first step: those 3 s are the hang's MTTR (its
    detection), not also the recovery's before it."""
    port = FakePort()
    ep = episode(port)
    ep.plan = planner.plan_repair(planner.holders(4, statuses(), GROUPS))
    ep.how = "rollback"
    watch = FirstStep(ep, [UCE2], resumed_at=100.0)
    assert watch.close_by_fault(103.1, detect_s=3.0, done=False) is True
    (rec,) = port.event("recovered")
    assert rec["first_step_interrupted"] and rec["phases"]["first_step"] == pytest.approx(0.1)
    assert rec["mttr_s"] == pytest.approx(UCE2["detect_s"] + 100.1 - UCE2["t_detect"])
    # Found before it could have struck after the resume (a report delayed in flight): no earlier
    # than the resume.
    port2 = FakePort()
    ep2 = episode(port2)
    ep2.plan, ep2.how = ep.plan, "rollback"
    assert FirstStep(ep2, [UCE2], resumed_at=100.0).close_by_fault(100.5, detect_s=2.0, done=True) is True
    (rec2,) = port2.event("recovered")
    assert "first_step_interrupted" not in rec2 and rec2["phases"]["first_step"] == pytest.approx(0.0)


def test_runner_goto_next_done_and_skips():
    seen = []
    rounds = [Round("a", act=lambda ep: seen.append("a") or None, decide=lambda ep, a: NEXT),
              Round("b", act=lambda ep: seen.append("b") or None, when=lambda ep: False),
              Round("c", act=lambda ep: seen.append("c") or (Goto("e") if len(seen) < 4 else NEXT)),
              Round("d", act=lambda ep: seen.append("d") or DONE),
              Round("e", act=lambda ep: seen.append("e") or Goto("a"))]
    ep = episode(FakePort())
    assert Runner(rounds, ep, clock=Clock()).start() == "ok"
    assert seen == ["a", "c", "e", "a", "c", "d"]
    assert "b" not in ep.phases


def test_runner_rejects_an_unknown_decision():
    with pytest.raises(TypeError):
        Runner([Round("x", act=lambda ep: 42)], episode(FakePort()), clock=Clock()).start()
    assert Runner([Round("x", act=lambda ep: Fail("no"))], episode(FakePort())).start() == ("failed", "no")
    assert Answers({}, {1: "lost", 0: "x" * 600}, 0).why(50).startswith("rank 0: xxx")


@pytest.mark.parametrize("unlogged,logger", [
    ({0: (6, True), 2: (6, False), 3: (6, False)}, 0),   # the rank that logs losses survived: it prints
    ({2: (6, False), 3: (6, False)}, 2),                 # it was lost: the first survivor that holds the loss
    ({0: (7, True)}, None),                              # a later step's loss: not the dump's
    ({}, None),                                          # every step up to the dump's logged already
])
def test_dump_names_who_logs_the_loss_of_the_step_it_settles_on(unlogged, logger):
    port = FakePort(live=(0, 2, 3), lost=(1,))
    runner, _ = play(strategies.DUMP, "first", episode(port, "dump"))
    port.answer({r: {**dump_status(rank=r), **({"unlogged": {"iteration": unlogged[r][0], "loss": 5.25,
                                                              "writer": unlogged[r][1]}} if r in unlogged else {})}
                 for r in (0, 2, 3)})
    assert runner.tick() is None and port.last()[1] == "dump"
    assert port.last()[3]["log_loss"] == logger
