"""The controller's helpers — Scaling, Migrations, Succession and the Inbox — each on a fake port
(controller/ports.ControllerPort) with the real parts they are handed (rank table, orders, restarts,
ledger, standbys), orders going to a fake router: every decision and message they make, in
milliseconds, without a socket or a process (as tests/test_playbooks.py drives the playbooks)."""
import json
import logging
import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from mindspeed_ha.control.controller.inbox import Inbox
from mindspeed_ha.control.controller.migration import Migrations
from mindspeed_ha.control.controller.orders import Orders
from mindspeed_ha.control.controller.ports import Identity
from mindspeed_ha.control.controller.restarts import Restarts
from mindspeed_ha.control.controller.scaling import Scaling
from mindspeed_ha.control.controller.succession import HANDOVER_WAIT_S, Succession
from mindspeed_ha.control.policy import ledger
from mindspeed_ha.control.policy.ledger import FaultLedger
from mindspeed_ha.control.policy.ranks import Agent, Rank, RankTable
from mindspeed_ha.control.policy.standbys import Standbys
from mindspeed_ha.control.policy.states import Outcome, State
from mindspeed_ha.control.wire import protocol
from mindspeed_ha.control.wire.folding import as_columns
from mindspeed_ha.control.wire.hosts import this_host
from mindspeed_ha.control.wire.security import Keys
from mindspeed_ha.options import HAOptions
from test_control_protocol import _datas, _exact

GROUPS = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}  # DP=4, two optimizer instances


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch):
    """A helper that opened a ZeroMQ context here would fail the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a controller helper opened a ZeroMQ context in a socket-free test")
    monkeypatch.setattr(zmq, "Context", refuse)


class FakePort:
    """ControllerPort: what a helper may ask of the controller, recorded."""

    def __init__(self, state=State.NORMAL, epoch=1, standby=False):
        self.state, self.epoch, self.standby = state, epoch, standby
        self.pending_first_step = False
        self.fed: list[Outcome] = []
        self.faults: list[tuple] = []
        self.entered: list = []  # what each fault's report said of the collectives its rank issued
        self.calls: list[tuple] = []
        self.migration_answer: str | None = None
        self.hand_over_answer: str | None = None

    def first_step_pending(self):
        return self.pending_first_step

    def ack(self):
        return protocol.encode("ack", epoch=self.epoch, state=self.state.value, standby=self.standby, backups=[])

    def status(self):
        return {"state": self.state.value}

    def feed(self, outcome):
        self.fed.append(outcome)

    def fault(self, ranks, kind, iteration, phase, detect_s=0.0, detail="", key=None, rid=None, feed=True,
              entered=None, fault_class="fault", frame=""):
        self.faults.append((list(ranks), kind, iteration, phase, detail, key, rid))
        self.entered.append(entered)
        return True

    def become_active(self, epoch, now):
        self.calls.append(("become_active", epoch))
        self.standby, self.epoch = False, max(epoch, self.epoch + 1)

    def retire(self):
        self.calls.append(("retire",))

    def push_backups(self):
        self.calls.append(("push_backups",))

    def serve_metrics(self):
        self.calls.append(("serve_metrics",))

    def request_migration(self, rank, reason):
        self.calls.append(("request_migration", rank, reason))
        return self.migration_answer

    def hand_over(self, rank, reason):
        self.calls.append(("hand_over", rank, reason))
        return self.hand_over_answer


class FakeRouter:
    """The controller's socket, as the parts use it: every frame decoded and kept."""

    def __init__(self):
        self.sent: list[tuple[bytes, dict]] = []
        self.drops = protocol.DropCounter(logging.getLogger("test"))

    def send(self, ident, data):
        self.sent.append((ident, protocol.decode(data)))

    def fan_out(self, idents, data):
        msg = protocol.decode(data)
        self.sent.extend((ident, msg) for ident in idents)

    def orders(self, action=None):
        """(ident, args) of every order sent (of ``action``)."""
        return [(i, m["args"]) for i, m in self.sent if m["t"] == "do" and action in (None, m["action"])]


class FakeEvents:
    def __init__(self):
        self.records: list[tuple[str, dict]] = []
        self.listeners: list = []

    def emit(self, event, **fields):
        self.records.append((event, fields))
        return fields

    def named(self, event):
        return [f for e, f in self.records if e == event]


class FakeStore:
    """The job store, as succession reads it."""

    def __init__(self, seen=None, refused=False):
        self.address, self.moves, self.refused = ("10.0.0.1", 29500), 0, refused
        self.ever_reached, self.answered_at = True, time.monotonic()
        self._seen = seen or {}
        self.moved_to = None

    def seen(self, key):
        return self._seen.get(key)

    def still_for(self, key):
        return 0.0

    def claim(self, key, value):
        return True

    def move(self, address):
        self.moved_to = address
        return True

    def publish(self, key, info, epoch=None):
        self._seen[key] = info

    def beat(self, key):
        pass

    def watch(self, key):
        pass


class Job:
    """A job of ``world`` ranks as the controller's parts hold it, with a fake port and router."""

    def __init__(self, world=4, state=State.NORMAL, strategies=("retry", "recover", "dump"), **options):
        now = time.monotonic()
        self.port = FakePort(state)
        self.router = FakeRouter()
        self.events = FakeEvents()
        self.table = RankTable(world, heartbeat_s=0.5, hang_timeout_s=60.0)
        for r in range(world):
            self.table.ranks[r] = Rank(r, bytes([r]), node=f"n{r // 2}", pid=100 + r, host=this_host(),
                                       groups=[GROUPS[r]] if r in GROUPS else [], it=5, seen=now, progress_at=now)
            self.table.by_ident[bytes([r])] = r
        self.orders = Orders(self.router, self.table, lambda: self.port.epoch, host_rank=0)
        self.restarts = Restarts(self.table, self.orders, self.events, max_restarts=3, host_rank=0, end_host=None)
        self.ledger = FaultLedger()
        self.standbys = Standbys()
        self.options = HAOptions(strategies=frozenset(strategies), log_dir="/nonexistent", **options)

    def agent(self, node_rank, ranks, pids=None, pid=900, spares=0, store=""):
        a = Agent(node_rank, b"agent%d" % node_rank, f"n{node_rank}", list(ranks),
                  list(pids) if pids is not None else [100 + r for r in ranks], seen=time.monotonic(), pid=pid,
                  spares=spares, store=store)
        self.table.agents[node_rank] = a
        return a

    def scaling(self, spare_wait_s=0.0, job_store=None):
        return Scaling(self.port, self.table, self.orders, self.restarts, self.ledger, self.events, spare_wait_s,
                       job_store)

    def migrations(self):
        return Migrations(self.port, self.table, self.ledger, self.events, self.options, host_rank=0)

    def succession(self, log_dir="/nonexistent", job_store=None, write_json=False, previous=None, rank=0):
        me = Identity(host="127.0.0.1", endpoint="tcp://127.0.0.1:5555", port=5555, keys=Keys(None), job_id="job",
                      log_dir=str(log_dir), world=len(self.table.ranks), rank=rank)
        return Succession(self.port, me, self.table, self.orders, self.standbys, self.ledger, self.events, 0.5,
                          job_store, write_json=write_json, previous=previous)

    def inbox(self):
        self.scaling_, self.migrations_, self.succession_ = self.scaling(), self.migrations(), self.succession()
        return Inbox(self.port, self.router, self.table, self.orders, self.restarts, self.events, self.scaling_,
                     self.migrations_, self.succession_)


# ---- Scaling --------------------------------------------------------------------------------------
def test_scaling_orders_the_strategies_for_a_fault():
    """Scaled in: neither retry nor recover. A node lost with its agent and no spare wait: recover is
    not tried; with --ha-spare-wait, recover waits that long. A lost rank whose agent lives: as asked."""
    job = Job()
    job.agent(0, [0, 1])
    job.table.mark_dead([2, 3])
    scaling = job.scaling()
    ordered = ["retry", "recover", "elastic-training", "dump"]
    assert scaling.order(ordered) == (["retry", "elastic-training", "dump"],
                                      "no spare for rank(s) [2, 3] (their node is lost)")
    waiting = job.scaling(spare_wait_s=30.0)
    assert waiting.order(ordered) == (ordered, "") and waiting.spare_wait == 30.0
    assert "replacement is waited for up to 30 s" in waiting.waiting_note()
    job.agent(1, [2, 3], pids=[0, 0])
    assert scaling.order(ordered) == (ordered, "") and scaling.spare_wait is None
    scaling.dp = 2
    kept, why = scaling.order(ordered)
    assert kept == ["elastic-training", "dump"] and "runs scaled in (data-parallel size 2)" in why


def test_scaling_does_not_train_on_in_a_minority_cut_off_from_the_rest():
    """Ranks lost on other hosts, half the job left and no job store that says this side is the
    store's: elastic is not tried (this side may be the cut-off one of a partition)."""
    job = Job()
    for r in (2, 3):
        job.table.ranks[r].host = "another-host/net"
    job.table.mark_dead([2, 3])
    store = FakeStore()
    store.answered_at = time.monotonic() - 60  # silent for a minute
    kept, why = job.scaling(job_store=store).order(["elastic-training", "dump"])
    assert kept == ["dump"] and "2 of the job's 4 ranks live" in why
    store.answered_at = time.monotonic()       # the store answers this side: it goes on
    assert job.scaling(job_store=store).order(["elastic-training", "dump"]) == (["elastic-training", "dump"], "")


def test_scaling_offers_the_left_ranks_to_a_returned_node_and_asks_for_the_scale_out():
    """After a scale-in that left ranks 2 and 3 out, a new agent for their node is told to start them
    (awaited like restarts); once both registered, the scale-out is asked for (a planned change in
    the ledger, no fault), once, and not while the last recovery's first step is awaited."""
    job = Job()
    scaling = job.scaling()
    scaling.dp, scaling.left, scaling.agent_pid = 2, {2, 3}, {1: 900}
    scaling.offer(job.agent(1, [2, 3], pid=900))  # the same agent, not back from a silence: nothing
    assert not scaling.offered and not job.restarts.restarting
    scaling.offer(job.agent(1, [2, 3], pid=901))
    assert scaling.offered == {2, 3} and job.restarts.restarting == {2, 3}
    assert job.restarts.awaiting == {2: None, 3: None}
    assert job.events.named("scale_out_offer") == [{"node_rank": 1, "node": "n1", "ranks": [2, 3]}]
    job.port.pending_first_step = True
    scaling.registered(2)
    scaling.registered(3)
    assert job.port.fed == [] and not job.ledger.active
    job.port.pending_first_step = False
    scaling.registered(3)
    assert job.port.fed == [Outcome.SCALE_OUT]
    assert [f["kind"] for f in job.ledger.active] == ["scale-out"] and not job.ledger.all
    scaling.scale_out_when_ready()  # asked again while it is under way: once is enough
    assert job.port.fed == [Outcome.SCALE_OUT] and len(job.events.named("scale_out_requested")) == 1


def test_scaling_switches_a_recover_that_waited_out_its_spare_and_lets_ranks_leave():
    job = Job()
    scaling = job.scaling()
    job.agent(0, [0, 1])
    job.restarts.expect([2, 3])
    scaling.switched("no replacement")
    assert not job.restarts.restarting
    assert job.events.named("strategy") == [{"outcome": "elastic-training", "reason": "no replacement"}]
    scaling.scaled(2, {0: [0], 1: [1]})
    scaling.leave([2, 3], "the job scaled in")
    assert scaling.dp == 2 and scaling.left == {2, 3} and job.table.ranks[0].groups == [[0]]
    assert [a for _, a in job.router.orders("exit")] == [
        {"code": 0, "diagnosis": "mindspeed-ha: rank(s) [2, 3] leave the job: the job scaled in"}] * 2
    assert [a for _, a in job.router.orders("leave")] == [{"ranks": [2, 3]}] * 2  # (switched, then leave)
    assert scaling.status() == {"layout": {"data_parallel_size": 2, "ranks": [0, 1], "left": [2, 3],
                                           "joining": []}}
    scaling.scaled(4, {r: GROUPS[r] for r in range(4)})  # whole again
    assert scaling.dp == 0 and not scaling.left


# ---- Migrations -----------------------------------------------------------------------------------
def test_a_migration_is_refused_with_the_reason_until_it_can_be_done():
    job = Job()
    migrations = job.migrations()
    job.port.standby = True
    assert migrations.refusal(1) == "this controller is a standby"
    job.port.standby = False
    assert migrations.refusal(7) == "rank 7 is not a live registered rank"
    job.port.state = State.RECOVERING
    assert "in state recovering" in migrations.refusal(1)
    job.port.state, job.port.pending_first_step = State.NORMAL, True
    assert "has not completed its first step" in migrations.refusal(1)
    job.port.pending_first_step = False
    assert "has no launcher agent" in migrations.refusal(1)
    job.agent(0, [0, 1], spares=0)
    assert "no spare worker is ready on node n0" in migrations.refusal(1)
    job.table.agents[0].spares = 1
    assert migrations.refusal(1) is None
    job.table.mark_dead([3])
    assert "no live twin" in migrations.refusal(1)
    retry_only = Job(strategies=("retry", "dump"))
    assert "recover strategy provides" in retry_only.migrations().refusal(1)


def test_a_migration_is_a_planned_fault_and_the_hosts_a_hand_over():
    job = Job()
    job.agent(0, [0, 1], spares=1)
    migrations = job.migrations()
    assert migrations.request(1, "requested") is None
    assert job.port.faults == [([1], "migrate", 5, "startup", "requested (pid 101 on n0)", ("migrate", 1, 101), None)]
    assert migrations.moving == {1: {"old_pid": 101, "old_node": "n0", "reason": "requested"}}
    job.port.hand_over_answer = "no standby"
    assert migrations.request(0, "requested") == "no standby"  # rank 0 hosts this controller
    assert job.port.calls == [("hand_over", 0, "requested")]
    assert job.events.named("migrate_refused")[-1]["why"] == "no standby"
    job.port.state = State.DUMP
    assert "in state dump" in migrations.request(1, "again")


def test_a_straggler_is_named_and_moved_and_its_migration_closed():
    job = Job(migrate_stragglers=True, straggler_ratio=1.5, straggler_steps=3)
    job.agent(0, [0, 1], spares=1)
    migrations = job.migrations()
    for info in job.table.ranks.values():
        info.busy, info.busy_steps, info.steps, info.it = 0.05, 1, 10, 10
    slow = job.table.ranks[1]
    slow.busy = 0.5
    for _ in range(3):
        migrations.observe(slow)
    assert [e["rank"] for e in job.events.named("straggler")] == [1]
    assert [f[1] for f in job.port.faults] == ["migrate"]
    fault = ledger.record([1], "migrate", 10, "step", ["n0"])
    job.table.ranks[1].pid = 555  # the spare took the rank over
    migrations.closed([fault], time.monotonic(), 1024, {"status": 0.1, "rebuild": 0.2, "repair": 0.3})
    migrated = job.events.named("migrated")
    assert migrated[0]["old_pid"] == 101 and migrated[0]["new_pid"] == 555 and migrated[0]["pause_s"] == 0.5
    assert migrations.settle_until == 10 + 3 and not migrations.moving
    migrations.observe(slow)  # the first steps after a recovery are no evidence
    assert len(job.events.named("straggler")) == 1


def test_a_migration_the_job_outran_is_abandoned():
    job = Job()
    migrations = job.migrations()
    migrations.moving[1] = {"old_pid": 101, "reason": "requested"}
    f = ledger.record([1], "migrate", 5, "step", ["n0"])
    job.ledger.add(f)
    assert not migrations.outrun()
    job.table.ranks[0].done = True
    assert migrations.outrun()
    migrations.abandon()
    assert not job.ledger.active and job.ledger.all == [f] and not migrations.moving
    assert job.events.named("migrate_abandoned")[0]["rank"] == 1


# ---- Succession -----------------------------------------------------------------------------------
def test_succession_announces_the_controller_and_names_standbys(tmp_path):
    job = Job()
    succession = job.succession(log_dir=tmp_path, write_json=True)
    job.port.epoch = 3
    succession.announce()
    info = json.load(open(tmp_path / "controller.json"))
    assert (info["endpoint"], info["epoch"], info["job_id"], info["world_size"], info["rank"]) == \
        ("tcp://127.0.0.1:5555", 3, "job", 4, 0)
    assert job.standbys.due(job.table.ranks)
    succession.name_standbys()
    named = sorted(r for _, a in job.router.orders("standby") for r in [a["controller"]])
    assert named == [0, 0] and sorted(job.standbys.ranks) == [2, 3]
    assert not job.standbys.due(job.table.ranks)
    succession.standby_up(2, "tcp://n1:1")
    assert job.port.calls == [("push_backups",)] and json.load(open(tmp_path / "controller.json"))["backups"] == \
        ["tcp://n1:1"]
    job.table.ranks[2].pid = 777  # its process was replaced (a restarted rank runs no standby)
    assert job.standbys.due(job.table.ranks)
    succession.name_standbys()  # replaced: the new process stands by in its place
    assert job.port.calls[-1] == ("push_backups",) and job.standbys.pids[2] == 777
    assert job.router.orders("standby")[-1][0] == bytes([2]) and not job.standbys.due(job.table.ranks)


def test_a_standby_takes_over_with_a_quorum_and_handles_the_faults_it_was_told():
    job = Job(state=State.NORMAL)
    job.port.standby = True
    succession = job.succession(previous=0, rank=3)
    for r in (0, 1, 2):
        job.table.ranks[r].seen = 0.0  # only this standby's own rank came over: no quorum
    succession.maybe_promote(time.monotonic())
    assert job.port.calls == []
    job.table.ranks[1].seen = job.table.ranks[2].seen = time.monotonic()  # 3 of 4
    job.ledger.deferred.append(ledger.record([0], "process-exit", 5, "step", ["n0"], detail="pid 100 exit code 1"))
    succession.maybe_promote(time.monotonic())
    assert job.port.calls == [("become_active", 2), ("serve_metrics",)]
    assert job.events.named("takeover")[0]["epoch"] == 2
    assert [f[1] for f in job.port.faults] == ["process-exit"]


def test_a_hand_over_is_ordered_cancelled_or_completed():
    job = Job()
    succession = job.succession()
    assert "no standby stands by" in succession.hand_over(0, "requested")
    job.standbys.ranks, job.standbys.eps = [2], {2: "tcp://n1:1"}
    assert succession.hand_over(0, "requested") is None
    assert job.router.orders("takeover") == [(bytes([2]), {"epoch": 2, "migrate": 0, "reason": "requested"})]
    assert "already" in succession.hand_over(0, "again")
    succession.cancel_hand_over("RuntimeError: no standby")
    assert succession.handing_to is None
    assert job.events.named("migrate_refused") == [{"rank": 0, "why": "handover failed: RuntimeError: no standby"}]
    succession.hand_over(0, "requested")
    succession.taken_over("tcp://n1:1")
    assert len(job.router.orders("reconnect")) == 4 and job.port.calls == [("retire",)]


def test_the_new_controller_migrates_the_rank_whose_host_handed_it_over():
    job = Job()
    job.port.standby = True
    succession = job.succession(rank=2)
    succession.order_takeover({"epoch": 5, "migrate": 0, "reason": "requested"})
    now = time.monotonic()
    succession.maybe_promote(now)
    assert job.port.calls[0] == ("become_active", 5) and succession.after[:2] == (0, "requested")
    succession.migrate_when_ready(now)       # rank 0's agent has no spare yet: wait
    assert ("request_migration", 0, "requested") not in job.port.calls
    job.agent(0, [0, 1], spares=1)
    succession.migrate_when_ready(now)
    assert job.port.calls[-1] == ("request_migration", 0, "requested") and succession.after is None
    succession.after = (0, "requested", now - HANDOVER_WAIT_S - 1)
    succession.migrate_when_ready(now)
    assert succession.after is None and job.events.named("migrate_refused")[-1]["why"] == \
        "the job did not come over in time"


def test_a_superseded_controller_retires_and_a_lost_store_moves():
    job = Job()
    store = FakeStore(seen={"mindspeed_ha/controller": {"epoch": 2, "endpoint": "tcp://n1:2", "job_id": "job"}})
    succession = job.succession(job_store=store)
    assert succession.superseded()
    assert job.router.orders("reconnect")[0][1] == {"endpoint": "tcp://n1:2"} and job.port.calls == [("retire",)]
    job.port.epoch = 2
    assert not succession.superseded()  # (not newer than this controller)
    lost = FakeStore(refused=True)
    lost.answered_at = time.monotonic() - 5
    moving = job.succession(job_store=lost)
    job.agent(1, [2, 3], store="10.0.0.2:29501")
    moving.keep_store(time.monotonic())
    assert lost.moved_to == ("10.0.0.2", 29501) and job.events.named("store_moved")[0]["node_rank"] == 1
    assert job.port.calls[-1] == ("push_backups",)


# ---- Inbox ----------------------------------------------------------------------------------------
def _register(r, pid, **extra):
    return protocol.decode(protocol.encode("register", rank=r, world=4, node=f"n{r // 2}", pid=pid,
                                           groups=[GROUPS[r]], **extra))


def test_the_inbox_registers_the_job_and_feeds_registered_once_everyone_is_in():
    job = Job(state=State.INIT)
    job.table.ranks.clear()
    inbox = job.inbox()
    handlers = inbox.handlers()
    for r in range(4):
        handlers["register"](bytes([r]), _register(r, 100 + r))
    assert job.port.fed == [Outcome.REGISTERED]
    assert [m["t"] for _, m in job.router.sent] == ["ack"] * 4
    with pytest.raises(ValueError, match="says world 8"):
        inbox.register(b"x", {**_register(1, 101), "world": 8})


def test_the_inbox_revives_only_the_restarted_worker_and_fences_the_old_one():
    job = Job()
    inbox = job.inbox()
    handlers = inbox.handlers()
    job.table.mark_dead([1])
    handlers["register"](b"old", _register(1, 101))   # the lost process itself: stays dead, told to exit
    assert not job.table.ranks[1].alive
    job.restarts.expect([1])
    handlers["register"](b"new", _register(1, 555))
    assert job.table.ranks[1].alive and not job.restarts.restarting
    assert job.events.named("rejoined") == [{"rank": 1, "pid": 555, "old_pid": 101}]
    hb = protocol.decode(protocol.encode("hb", rank=1, it=5, upd=False, health="ok", pid=101))
    handlers["hb"](b"old", hb)                        # heard again: told to exit each time
    handlers["hb"](b"old", hb)
    exits = job.router.orders("exit")
    assert len(exits) == 3 and {i for i, _ in exits} == {b"old"} and "was declared lost" in exits[0][1]["diagnosis"]
    assert len(job.events.named("fenced")) == 1


def test_a_restarted_worker_that_registers_before_its_agent_lists_it_is_taken_when_the_agent_does():
    """A controller that took over never knew the lost rank's pid (a placeholder 0): only the pid its
    agent lists proves a registration to be the restarted worker's. A forked worker can register
    before its agent has said it started it: taken once the agent's list names it, not before, and
    never a process the list does not name."""
    job = Job()
    inbox = job.inbox()
    handlers = inbox.handlers()
    job.agent(1, [2, 3], pids=[102, 0])
    job.table.ranks[3].pid = 0
    job.table.mark_dead([3])
    job.restarts.restarting.add(3)
    handlers["register"](b"new3", _register(3, 707))
    assert not job.table.ranks[3].alive and 3 in job.restarts.restarting
    agent_hello = {"t": "agent", "node_rank": 1, "node": "n1", "ranks": [2, 3], "pid": 900}
    inbox.agents.agent(b"agent1", {**agent_hello, "pids": [102, 808]})   # another process: not this one
    assert not job.table.ranks[3].alive and not job.events.named("rejoined")
    inbox.agents.agent(b"agent1", {**agent_hello, "pids": [102, 707]})
    assert job.table.ranks[3].alive and 3 not in job.restarts.restarting
    assert job.events.named("rejoined") == [{"rank": 3, "pid": 707, "old_pid": 0}]


def test_a_survivors_counts_go_to_the_other_ranks_while_a_stop_is_in_force():
    """A survivor that left the step's collectives for the stop says what it issued: the other live
    ranks get it (a peer waiting in a collective it never entered leaves at once); not while the job
    trains (no stop in force: nothing to leave)."""
    job = Job()
    handlers = job.inbox().handlers()
    left = protocol.decode(protocol.encode("left", rank=1, pid=101, entered={"member": 1, "counts": {"k-dp": 4}}))
    handlers["left"](b"\x01", left)
    assert job.router.orders("entered") == []
    job.port.state = State.RECOVERING
    handlers["left"](b"\x01", left)
    sent = job.router.orders("entered")
    assert len(sent) == 3 and all(a == {"entered": {"1": {"member": 1, "counts": {"k-dp": 4}}}} for _, a in sent)
    assert b"\x01" not in [i for i, _ in sent]  # (not to itself)


def test_the_inbox_turns_reports_into_faults():
    job = Job()
    handlers = job.inbox().handlers()
    handlers["fault"](b"\x01", protocol.decode(protocol.encode(
        "fault", rank=1, kind="memory-error", iteration=6, phase="backward", detail="UCE", rid="101.fault.1",
        entered={"member": 1, "counts": {"k-dp": 7}})))
    assert job.port.faults[-1] == ([1], "memory-error", 6, "backward", "UCE", ("fault", 1, "memory-error", None),
                                   "101.fault.1")
    assert job.port.entered[-1] == {"member": 1, "counts": {"k-dp": 7}}
    assert job.table.ranks[1].health == "faulty" and job.table.ranks[1].it == 6
    handlers["exit"](b"a", {"t": "exit", "rank": 2, "pid": 999, "code": 1})  # an older incarnation
    handlers["exit"](b"a", {"t": "exit", "rank": 2, "pid": 102, "code": 0})  # ended its work
    assert job.table.ranks[2].done and len(job.port.faults) == 1
    handlers["exit"](b"a", {"t": "exit", "rank": 3, "pid": 103, "code": 0, "signal": 9, "rid": "x"})
    assert job.port.faults[-1][:2] == ([3], "process-exit") and job.port.faults[-1][4] == "pid 103 killed by signal 9"
    job.agent(0, [0, 1], pids=[0, 0], pid=950)         # node 0 came back as a new agent without workers
    handlers["agent"](b"agent0", {"t": "agent", "node_rank": 0, "node": "n0", "ranks": [0, 1], "pids": [0, 0],
                                  "pid": 951})
    assert job.port.faults[-1][:2] == ([0, 1], "node-lost")


def test_the_inbox_routes_answers_and_requests_to_the_helper_they_concern():
    job = Job()
    inbox = job.inbox()
    handlers = inbox.handlers()
    job.standbys.ranks = [2]
    oid = job.orders.send("standby", [2], {"world": 4, "epoch": 1, "controller": 0})
    handlers["result"](b"\x02", {"t": "result", "rank": 2, "action": "standby", "id": oid, "ok": True,
                                 "data": "tcp://n1:1"})
    assert job.standbys.endpoints() == ["tcp://n1:1"] and job.port.calls == [("push_backups",)]
    job.succession_.handing_to = 2
    oid = job.orders.send("takeover", [2], {"epoch": 2, "migrate": 0, "reason": "requested"})
    handlers["result"](b"\x02", {"t": "result", "rank": 2, "action": "takeover", "id": oid, "ok": False,
                                 "error": "no standby here"})
    assert job.succession_.handing_to is None and "handover failed" in job.events.named("migrate_refused")[0]["why"]
    handlers["migrate"](b"cli", {"t": "migrate", "rank": 9})
    assert job.router.sent[-1][1] == {"v": protocol.VERSION, "t": "refused",
                                      "reason": "there is no rank 9 in this job (ranks 0..3)"}
    handlers["inject"](b"cli", {"t": "inject", "rank": 1, "kind": "uce", "step": 7})
    assert job.router.orders("inject") == [(bytes([1]), {"kind": "uce", "step": 7})]
    assert job.router.sent[-1][1]["body"]["detail"] == "delivered"
    handlers["inject"](b"cli", {"t": "inject", "rank": 1, "kind": "meteor"})
    assert "unknown fault 'meteor'" in job.router.sent[-1][1]["reason"]


def test_orders_go_through_a_relaying_agent_once_and_directly_after_its_silence(monkeypatch):
    """Node 0's agent relays for ranks 0 and 1 (their current processes connected to it); node 1's does
    not relay. An order goes once to agent 0 naming ranks 0 and 1, and directly to ranks 2 and 3; an
    exit always directly. The agent's batch answers for both; one from a process declared lost is
    dropped. Silent past the relay limit, what agent 0 still owes goes directly (and a later order
    too); a rank whose new process has not said hello to the relay yet is sent to directly."""
    job = Job()
    handlers = job.inbox().handlers()
    a0 = job.agent(0, [0, 1])
    a0.relay, a0.relayed = True, {0: 100, 1: 101}
    job.agent(1, [2, 3])
    oid = job.orders.send("ha-status", [0, 1, 2, 3])
    sent = [(i, m.get("ranks")) for i, m in job.router.sent if m["t"] == "do"]
    assert sent == [(bytes([2]), None), (bytes([3]), None), (b"agent0", [0, 1])]
    item = {"v": protocol.VERSION, "t": "result", "action": "ha-status", "id": oid, "ok": True, "data": {}}
    job.table.retired[1] = {99}
    handlers["results"](b"agent0", {"t": "results", "node_rank": 0, "items": [
        {**item, "rank": 0, "pid": 100}, {**item, "rank": 1, "pid": 99}]})
    assert job.orders.waiting(oid) == {1, 2, 3} and job.router.drops.counts["stale"] == 1
    job.router.sent.clear()
    job.orders.reroute(time.monotonic())  # (agent 0 heard just now: nothing moves)
    assert job.router.sent == []
    a0.seen -= job.orders.relay_silence + 0.1
    job.orders.reroute(time.monotonic())
    assert [(i, m["action"], m["id"]) for i, m in job.router.sent] == [(bytes([1]), "ha-status", oid)]
    job.orders.reroute(time.monotonic())  # (sent once)
    assert len(job.router.sent) == 1
    a0.seen = time.monotonic()  # heard again; its relay now lists rank 0 only (rank 1's hello never came)
    a0.relayed = {0: 100}
    oid = job.orders.send("rebuild", [0, 1])
    job.orders.reroute(time.monotonic())  # (rank 1 went directly from the start: nothing moves)
    assert [(i, m.get("ranks")) for i, m in job.router.sent[1:]] == [(bytes([1]), None), (b"agent0", [0])]
    job.router.sent.clear()
    a0.relayed = {}  # (rank 0's process ended, or its hello was lost: the agent could not pass the order on)
    job.orders.reroute(time.monotonic())
    assert [(i, m["action"], m["id"]) for i, m in job.router.sent] == [(bytes([0]), "rebuild", oid)]
    a0.relayed = {0: 100, 1: 101}
    a0.seen -= job.orders.relay_silence + 0.1
    job.router.sent.clear()
    job.router.sent.clear()
    job.orders.send("rollback", [0, 1])
    assert [i for i, _ in job.router.sent] == [bytes([0]), bytes([1])]
    a0.seen = time.monotonic()
    job.table.ranks[1].pid = 201  # (restarted: its new process is not connected to the relay yet)
    job.router.sent.clear()
    job.orders.send("resume", [0, 1])
    job.orders.send("exit", [0, 1])
    assert [(i, m["action"], m.get("ranks")) for i, m in job.router.sent] == [
        (bytes([1]), "resume", None), (b"agent0", "resume", [0]), (bytes([1]), "exit", None)]


def test_heartbeats_through_an_agent_are_the_ranks_own_from_when_they_came_to_it():
    """Agent 0 passes on its ranks' heartbeats: each is taken as its rank's own, as heard when it came
    to the agent (``age`` before), without touching the rank's own link (orders sent directly still go
    there). One older than what was heard directly since changes nothing; one of a process declared
    lost, or of a rank not registered, is named back (``unheard``); one outside the world is dropped."""
    job = Job(world=5)
    del job.table.ranks[4]
    handlers = job.inbox().handlers()
    a0 = job.agent(0, [0, 1, 4])
    a0.relay = True
    beat = {"v": protocol.VERSION, "t": "hb", "upd": False, "health": "ok", "phase": "forward"}
    job.table.retired[1] = {99}
    for info in job.table.ranks.values():
        info.seen -= 1.0
    before = time.monotonic()
    handlers["agent_hb"](b"agent0", {"t": "agent_hb", "node_rank": 0, "beats": as_columns([
        {**beat, "rank": 0, "it": 7, "pid": 100, "age": 0.5}, {**beat, "rank": 1, "it": 7, "pid": 99},
        {**beat, "rank": 4, "it": 7, "pid": 104}, {**beat, "rank": 9, "it": 7}])})
    r0 = job.table.ranks[0]
    assert r0.it == 7 and r0.ident == bytes([0]) and before - 0.5 <= r0.seen <= time.monotonic() - 0.5
    assert job.table.ranks[1].it == 5 and job.router.drops.counts["invalid"] == 1
    assert [(i, m["t"], m.get("ranks")) for i, m in job.router.sent] == [(b"agent0", "ack", None),
                                                                         (b"agent0", "unheard", [1, 4])]
    handlers["hb"](bytes([0]), {**beat, "rank": 0, "it": 8})   # directly, meanwhile
    handlers["agent_hb"](b"agent0", {"t": "agent_hb", "node_rank": 0, "beats": as_columns([
        {**beat, "rank": 0, "it": 7, "pid": 100, "age": 0.3}])})  # (sent before that)
    assert job.table.ranks[0].it == 8


def test_answers_given_alike_go_once_naming_their_ranks_and_count_as_each_ranks_own():
    """An agent's batch: ranks 0–2 answered the rebuild alike ("ok"), rank 3 failed it. The frame holds
    the alike answer once with its three ranks, and rank 3's on its own; the controller takes each as
    its rank's own, and drops one of a process declared lost."""
    from mindspeed_ha.launcher.relay import results_frame
    job = Job()
    handlers = job.inbox().handlers()
    a0 = job.agent(0, [0, 1, 2, 3])
    a0.relay, a0.relayed = True, {r: 100 + r for r in range(4)}
    oid = job.orders.send("rebuild", [0, 1, 2, 3])
    item = {"v": protocol.VERSION, "t": "result", "action": "rebuild", "id": oid}
    items = [{**item, "rank": r, "pid": 100 + r, "ok": True, "data": "ok"} for r in range(3)]
    items.append({**item, "rank": 3, "pid": 103, "ok": False, "error": "boom"})
    msg = protocol.decode(results_frame(0, items))
    assert [i["rank"] for i in msg["items"]] == [3]
    assert [(s["ranks"], s["pids"], s["data"]) for s in msg["same"]] == [([0, 1, 2], [100, 101, 102], "ok")]
    job.table.retired[2] = {102}
    handlers["results"](b"agent0", msg)
    pend = job.orders.pending[oid]
    assert pend.results == {0: (True, "ok"), 1: (True, "ok"), 3: (False, "boom")} and pend.waiting == {2}
    assert job.router.drops.counts["stale"] == 1
    # A status: each rank's own; what they have alike (the iteration, the communicators' keys) goes once
    sid = job.orders.send("ha-status", [0, 1])
    statuses = {r: {"rank": r, "iteration": 10, "comm": {"keys": ["dp", "tp"], "ops": [3, 3],
                                                        **({"members": {"dp": [0, 2]}} if r == 0 else {})}}
                for r in (0, 1)}
    msg = protocol.decode(results_frame(0, [{"v": protocol.VERSION, "t": "result", "action": "ha-status", "id": sid,
                                             "rank": r, "pid": 100 + r, "ok": True, "data": st}
                                            for r, st in statuses.items()]))
    [status] = msg["same"]
    assert msg["items"] == [] and status["ranks"] == [0, 1] and status["pids"] == [100, 101]
    assert status["data"] == {"iteration": 10, "comm": {"keys": ["dp", "tp"], "ops": [3, 3]}}
    assert status["own"] == [{"rank": 0, "comm": {"members": {"dp": [0, 2]}}}, {"rank": 1}]
    handlers["results"](b"agent0", msg)
    assert job.orders.answered[sid] == {r: (True, st) for r, st in statuses.items()}
    # A frame whose own parts do not match its ranks is dropped whole (nobody's answer is guessed)
    bad = job.orders.send("ha-status", [0, 1])
    handlers["results"](b"agent0", {**msg, "same": [{**status, "id": bad, "own": status["own"][:1]}]})
    assert job.orders.pending[bad].waiting == {0, 1} and job.router.drops.counts["invalid"] == 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 1), st.booleans(), _datas, st.sampled_from(["", "memory-error"])),
                min_size=1, max_size=8))
def test_a_nodes_answers_folded_by_its_agent_are_each_ranks_own_again_at_the_controller(answers):
    """Whatever a node's ranks answer (to one order or two; ok or not; maps alike in part, alike in
    whole, or not maps), the agent's frame puts each rank's answer back exactly as the rank gave it:
    the controller files, for each rank, its outcome and data (types too: a shared True never stands for
    a 1) or its error and fault kind."""
    from mindspeed_ha.launcher.relay import results_frame
    job = Job(world=8)
    handlers = job.inbox().handlers()
    a0 = job.agent(0, range(8))
    a0.relay, a0.relayed = True, {r: 100 + r for r in range(8)}
    oids = [job.orders.send("ha-status", list(range(len(answers)))), job.orders.send("rebuild", list(range(len(answers))))]
    items = []
    for r, (which, ok, data, kind) in enumerate(answers):
        item = {"v": protocol.VERSION, "t": "result", "rank": r, "pid": 100 + r, "action": ("ha-status", "rebuild")[which],
                "id": oids[which], "ok": ok}
        items.append({**item, "data": data} if ok else {**item, "error": f"boom {data!r}", **({"kind": kind} if kind else {})})
    handlers["results"](b"agent0", protocol.decode(results_frame(0, items)))
    for r, (which, ok, data, kind) in enumerate(answers):
        got_ok, got = job.orders.answers(oids[which])[r]
        assert got_ok is ok and (_exact(got) == _exact(data) if ok else got == f"boom {data!r}")
        if not ok:
            assert job.orders.kind(oids[which], r) == (kind or "other")
    assert not job.router.drops.counts


def test_an_order_is_quiet_while_a_live_rank_owes_it_and_nothing_went_wrong():
    """``Orders.quiet``, what lets a round wait without looking at all its answers: true while a live
    rank still owes one and no answer failed, no rank that owed one died; false once any of that is so."""
    job = Job()
    oid = job.orders.send("rebuild", [0, 1, 2, 3])
    assert job.orders.quiet(oid)
    for r in (0, 1, 2):
        job.orders.answer(r, oid, True, "ok")
    assert job.orders.quiet(oid)  # (rank 3 owes it)
    job.table.ranks[3].done = True  # (it ended its job: it owes nothing a round can wait for)
    assert not job.orders.quiet(oid)
    job.table.ranks[3].done = False
    job.orders.answer(3, oid, True, "ok")
    assert not job.orders.quiet(oid)  # (answered by all)
    failed = job.orders.send("rollback", [0, 1, 2, 3])
    job.orders.answer(1, failed, False, "boom")
    assert not job.orders.quiet(failed)
    lost = job.orders.send("resume", [0, 1, 2, 3])
    job.orders.excuse([2])
    assert not job.orders.quiet(lost) and job.orders.waiting(lost) == {0, 1, 3}


def test_a_failed_answers_fault_kind_travels_through_the_agent_alike_or_alone():
    """Ranks 0 and 1 failed the rebuild alike with a memory error, rank 2 with a communication error,
    rank 3 with an error of no kind: the agent's frame keeps each kind (the alike ones once), and the
    controller files each rank's (``Orders.kind``; "other" where none was named, or one no strategy
    knows)."""
    from mindspeed_ha.launcher.relay import results_frame
    job = Job()
    handlers = job.inbox().handlers()
    a0 = job.agent(0, [0, 1, 2, 3])
    a0.relay, a0.relayed = True, {r: 100 + r for r in range(4)}
    oid = job.orders.send("rebuild", [0, 1, 2, 3])
    item = {"v": protocol.VERSION, "t": "result", "action": "rebuild", "id": oid, "ok": False}
    uce = {"error": "rebuild: MemoryFault: UCE", "kind": "memory-error"}
    items = [{**item, "rank": r, "pid": 100 + r, **uce} for r in (0, 1)]
    items += [{**item, "rank": 2, "pid": 102, "error": "rebuild: CommFault: down", "kind": "comm-failure"},
              {**item, "rank": 3, "pid": 103, "error": "rebuild: ValueError: bad"}]
    msg = protocol.decode(results_frame(0, items))
    assert [(s["ranks"], s["kind"]) for s in msg["same"]] == [([0, 1], "memory-error")]
    handlers["results"](b"agent0", msg)
    assert [job.orders.kind(oid, r) for r in range(4)] == ["memory-error", "memory-error", "comm-failure", "other"]
    other = job.orders.send("repair", [0])
    job.orders.answer(0, other, False, "boom", "process-exit")  # (not a kind a failed answer can name)
    assert job.orders.kind(other, 0) == "other"
