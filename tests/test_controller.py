"""The real controller against fake ranks on real CurveZMQ sockets: a bug in a state's work is that
state's FAILED outcome (never the end of the controller thread), and answers of any size travel whole."""
import gc
import time

import pytest
import zmq

from mindspeed_ha.control.wire import protocol, security
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.events import EventLog, read_events
from mindspeed_ha.options import HAOptions

GROUPS = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}


class FakeRanks:
    """Four ranks' sockets: register, heartbeat, answer each order with ``answer(rank, msg)``."""

    def __init__(self, c: Controller, keys, answer, world=4, strategies=()):
        self.ctx = zmq.Context()
        self.socks = {}
        self.answer, self.seen = answer, []
        self.settled: list = []   # (rank, rids) of each "settled" received
        for r in range(world):
            s = self.ctx.socket(zmq.DEALER)
            s.linger = 0
            s.maxmsgsize = protocol.MAX_BYTES + 1024
            security.secure_client(s, keys)
            s.connect(c.endpoint)
            s.send(protocol.encode("register", rank=r, world=world, node="n0", pid=1000 + r, groups=[GROUPS[r]],
                                   **({"strategies": sorted(strategies(r) if callable(strategies) else strategies)}
                                      if strategies else {})))
            self.socks[r] = s

    def pump(self, seconds: float, until=lambda: False, it: int = 5) -> None:
        deadline = time.time() + seconds
        while time.time() < deadline and not until():
            for r, s in self.socks.items():
                s.send(protocol.encode("hb", rank=r, it=it, upd=False, health="ok", phase="forward", progress=1.0))
                while s.poll(0):
                    msg = protocol.decode(s.recv())
                    if msg["t"] == "settled":
                        self.settled.append((r, msg["rids"]))
                    if msg["t"] != "do":
                        continue
                    self.seen.append((r, msg["action"]))
                    ok, data = self.answer(r, msg)
                    then = (msg.get("args") or {}).get("then")
                    if then and ok:  # (two rounds in one order: this one's answer, then the next's, as serving runs them)
                        self.seen.append((r, then[0]))
                        ok, second = self.answer(r, {**msg, "action": then[0], "args": then[1]})
                        data = [data, second] if ok else second
                    fields = {"data": data} if ok else {"error": str(data)}
                    s.send(protocol.encode("result", rank=r, action=msg["action"], id=msg["id"], ok=ok, **fields))
            time.sleep(0.02)

    def close(self):
        for s in self.socks.values():
            s.close()
        self.ctx.term()


@pytest.fixture
def controller(tmp_path):
    keys = security.Keys.load(str(tmp_path), create=True)
    opts = HAOptions(strategies=frozenset({"retry", "dump"}), log_dir=str(tmp_path), hang_timeout_s=600)
    c = Controller(str(tmp_path), 4, opts, keys, host="127.0.0.1").start()
    yield c, keys
    c.close()


def states(tmp_path):
    return [(e["from"], e["to"], e["outcome"]) for e in read_events(str(tmp_path / "events" / "controller.jsonl"))
            if e["event"] == "state"]


def test_a_bug_in_a_round_fails_the_state_not_the_controller(tmp_path, controller, caplog):
    c, keys = controller

    def answer(r, msg):
        if msg["action"] == "ha-status":  # an iteration that is no number: planning raises
            return True, {"replica": True, "ended": 5, "iteration": "five", "replica_group": GROUPS[r]}
        if msg["action"] == "dump-status":
            return False, "no --save directory"
        return True, "ok"
    ranks = FakeRanks(c, keys, answer)
    try:
        ranks.pump(5, until=lambda: c.machine.state.value == "normal")
        ranks.socks[1].send(protocol.encode("fault", rank=1, kind="memory-error", iteration=6, phase="backward",
                                            detail="UCE ERROR", at=time.time()))
        ranks.pump(10, until=lambda: c.machine.state.value in ("exit", "done"))
        ranks.pump(1)
        moves = states(tmp_path)
        assert ("recovering", "dump", "failed") in moves and ("dump", "exit", "failed") in moves, moves
        bug = [rec for rec in caplog.records if rec.exc_info and rec.exc_info[0] is ValueError]
        assert bug and "failed" in bug[0].getMessage()  # logged with its traceback
        diagnosis = [e for e in read_events(str(tmp_path / "events" / "controller.jsonl")) if e["event"] == "diagnosis"]
        assert diagnosis and "exit code 1" in diagnosis[0]["text"]
        # (the retry's failure, what ended the job, and the dump's that followed it)
        assert "retry failed (" in diagnosis[0]["text"] and "; then the dump: " in diagnosis[0]["text"], diagnosis
        assert {r for r, a in ranks.seen if a == "exit"} == {0, 1, 2, 3}  # told to end, with the diagnosis
    finally:
        ranks.close()


def test_answers_of_any_size_travel_whole(tmp_path, controller):
    """A 20,000-character --save path in every dump-status answer (the old 1,000-character cut made
    it unparsable and killed the controller), and the plan and the write's answer carried whole."""
    c, keys = controller
    save = "/ck/" + "d" * 20000

    def answer(r, msg):
        a = msg["action"]
        if a == "dump-status":
            return True, {"iteration": 5, "updating": False, "touched": True, "replica_group": GROUPS[r],
                          "trainer_iteration": 5, "save": save, "fallback": None, "abandoned": False}
        if a == "dump":
            assert msg["args"]["plan"]["iteration"] == 5
            return True, {"iteration": 5, "path": save + "/iter_0000005", "seconds": 0.1, "bytes": 1, "save": save}
        return True, "ok"
    ranks = FakeRanks(c, keys, answer)
    try:
        ranks.pump(5, until=lambda: c.machine.state.value == "normal")
        ranks.socks[3].send(protocol.encode("fault", rank=3, kind="other", iteration=6, phase="backward",
                                            detail="RuntimeError: boom", at=time.time()))
        # (EXIT's work, the diagnosis, runs just after the state is entered)
        ranks.pump(15, until=lambda: c.machine.state.value in ("exit", "done") and c.ending.last_diagnosis)
        assert ("dump", "exit", "ok") in states(tmp_path), states(tmp_path)
        cp = [e for e in read_events(str(tmp_path / "events" / "controller.jsonl")) if e["event"] == "checkpoint"]
        assert cp and cp[0]["path"] == save + "/iter_0000005"
        assert f"Resume with --load {save}" in c.ending.last_diagnosis
    finally:
        ranks.close()


def test_the_dump_time_limit_grows_with_the_state_and_with_progress(tmp_path):
    """120 s for a small state, more for a large one (50 MB/s), --ha-dump-timeout when given, and
    three times that while the writers show progress."""
    from mindspeed_ha.control import strategies
    from mindspeed_ha.control.policy.ranks import Rank
    from mindspeed_ha.control.strategies import Episode
    from mindspeed_ha.control.policy.states import State as S
    keys = security.Keys.load(str(tmp_path), create=True)
    c = Controller(str(tmp_path), 2, HAOptions(strategies=frozenset({"dump"}), log_dir=str(tmp_path)), keys)
    try:
        now = time.monotonic()
        c.table.ranks.update({r: Rank(r, b"", progress_at=now - 100) for r in (0, 1)})
        recovery = c.recovery
        recovery.episode = Episode(None, "dump", 2, [], {}, statuses={0: {}, 1: {}})
        limit = lambda st: recovery.limit(st, now, c.table.dead_after)  # noqa: E731
        recovery.strategy, recovery.stage = strategies.RETRY, strategies.RETRY.stages[0]
        assert limit(S.DUMP) == 120.0 and limit(S.RECOVERING) == 180.0
        recovery.stage = strategies.RETRY.stages[1]
        assert limit(S.RECOVERING) == 30.0
        recovery.episode.state_bytes = 50 * 10 ** 9  # 50 GB: 1,000 s at 50 MB/s
        assert limit(S.DUMP) == pytest.approx(1030.0)
        c.table.ranks[1].progress_at = now - 5  # a writer moved 5 s ago
        assert limit(S.DUMP) == pytest.approx(3090.0)
        recovery.options = HAOptions(strategies=frozenset({"dump"}), log_dir=str(tmp_path), dump_timeout_s=40.0)
        assert limit(S.DUMP) == 120.0  # 3 x 40 s: still moving
    finally:
        c.router.close()


def test_newcomers_still_waiting_when_the_job_ends_are_told_to_leave(tmp_path):
    """A scaled-in job (DP=2) with newcomers 2 and 3 registered but not yet in the layout: a
    recovery's first step is complete without them (they train nothing), and once ranks 0 and 1 have
    ended the job, the newcomers are told to leave (exit 0) — the job is over, not waiting on them."""
    from mindspeed_ha.control.policy.ranks import Rank
    keys = security.Keys.load(str(tmp_path), create=True)
    opts = HAOptions(strategies=frozenset({"dump", "elastic-training"}), log_dir=str(tmp_path))
    c = Controller(str(tmp_path), 4, opts, keys)
    try:
        now = time.monotonic()
        c.table.ranks.update({r: Rank(r, b"", seen=now, progress_at=now, it=10 if r < 2 else -1,
                                phase="step" if r < 2 else "startup") for r in range(4)})
        c.scaling.dp, c.scaling.left, c.scaling.offered = 2, {2, 3}, {2, 3}
        assert not c.table.completed(10) and c.table.completed(10, c.scaling.newcomers())
        assert not c.scaling.ended_without()  # ranks 0 and 1 still train
        sent = []
        c.orders.send = lambda action, ranks, args=None: sent.append((action, ranks, args["code"]))
        c.orders.to_agents = lambda action, args: sent.append((action, args["ranks"]))
        for r in (0, 1):
            c.table.ranks[r].done = True
        assert c.scaling.ended_without() and c.table.all_over()
        assert sent == [("exit", [2, 3], 0), ("leave", [2, 3])]
    finally:
        c.router.close()


def retry_answers(poisoned=()):
    def answer(r, msg):
        a = msg["action"]
        if a == "ha-status":
            return True, {"replica": True, "ended": 5, "iteration": 5, "updating": False, "touched": True,
                          "replica_group": GROUPS[r], "poisoned": r in poisoned}
        return True, {"repair": {"received": 0}, "rollback": "rollback", "resume": "resumed"}.get(a, "ok")
    return answer


def test_a_recovered_fault_is_settled_everywhere_and_never_recovered_again(tmp_path, controller):
    """Rank 1's memory error is recovered (retry): once training resumes, the controller names its
    report (rid) settled to every rank, whose links then stop re-sending it. A controller that took
    over later (here: a new one that learned the settled reports, as a standby does from its rank's
    link) is sent the same report again, by a link that never heard it settled: it is ignored, said
    in the log and the events, and the job trains on."""
    c, keys = controller
    ranks = FakeRanks(c, keys, retry_answers(poisoned={1}))
    report = protocol.encode("fault", rank=1, kind="memory-error", iteration=6, phase="backward", detail="UCE ERROR",
                             at=time.time(), pid=1001, rid="1001.fault.1")
    try:
        ranks.pump(5, until=lambda: c.machine.state.value == "normal")
        ranks.socks[1].send(report)
        ranks.pump(10, until=lambda: {r for r, _ in ranks.settled} == {0, 1, 2, 3})
        assert sorted(ranks.settled) == [(r, ["1001.fault.1"]) for r in range(4)], ranks.settled
        assert [a for r, a in ranks.seen if r == 1] == ["stop", "ha-status", "rebuild", "repair", "rollback", "resume"]
    finally:
        ranks.close()
    c.close()
    keys2 = security.Keys.load(str(tmp_path), create=False)
    log2 = tmp_path / "successor"
    opts = HAOptions(strategies=frozenset({"retry", "dump"}), log_dir=str(log2), hang_timeout_s=600)
    successor = Controller(str(log2), 4, opts, keys2, host="127.0.0.1", epoch=2, settled=c.ledger.settled).start()
    ranks = FakeRanks(successor, keys2, retry_answers())
    try:
        ranks.pump(5, until=lambda: successor.machine.state.value == "normal")
        ranks.socks[1].send(report)
        ranks.pump(2)
        evs = read_events(str(log2 / "events" / "controller.jsonl"))
        assert [e["rid"] for e in evs if e["event"] == "settled_fault"] == ["1001.fault.1"]
        assert not [e for e in evs if e["event"] == "fault"] and successor.machine.state.value == "normal"
        assert {a for _, a in ranks.seen} <= {"standby"}  # nobody stopped (standbys are named, as always)
    finally:
        ranks.close()
        successor.close()


def test_a_standby_named_by_an_earlier_controller_takes_over_with_a_newer_epoch(tmp_path):
    """A standby named by the controller of epoch 2 stands by while another standby takes over (epoch
    3). When that one is lost too, the first takes over with epoch 4, not 3 again: the ranks drop
    orders whose (epoch, id) they have taken, so a reused epoch left the third controller's orders
    unanswered (found by a chaos run with the controller's rank killed three times)."""
    keys = security.Keys.load(str(tmp_path), create=True)
    opts = HAOptions(strategies=frozenset({"retry", "dump"}), log_dir=str(tmp_path), hang_timeout_s=600)
    c = Controller(str(tmp_path), 4, opts, keys, host="127.0.0.1", standby=True, epoch=2, rank=3,
                   write_json=False).start()
    try:
        c.saw_epoch(3)  # what its rank's link follows now
        c.saw_epoch(1)  # (an older ack changes nothing)
        c.succession._promote(time.monotonic(), 2, c.epoch + 1, "quorum")
        assert c.epoch == 4 and not c.standby
    finally:
        c.close()


def test_ranks_whose_agent_has_not_registered_wait_for_their_node(tmp_path):
    """Node 1's ranks registered, saying which agent started them, but that agent had not registered
    yet when the node was lost: recover waits for the node (its agent, or a replacement, restarts
    them when it registers) instead of giving up on ranks 'without an agent'. The ranks of a job
    another launcher started are still refused: nothing could restart them."""
    from mindspeed_ha.control.policy.ranks import Agent, Rank
    keys = security.Keys.load(str(tmp_path), create=True)
    opts = HAOptions(strategies=frozenset({"recover", "dump"}), log_dir=str(tmp_path))
    c = Controller(str(tmp_path), 4, opts, keys)
    try:
        now = time.monotonic()
        c.table.ranks.update({r: Rank(r, b"", seen=now, agent_node=r // 2) for r in range(4)})
        c.table.agents[0] = Agent(0, b"a0", "vm:0", [0, 1], [100, 101], seen=now, pid=99)
        assert c.restarts.restart([2, 3]) == ([], [2, 3], [])
        assert c.restarts.restarting == {2, 3} and c.restarts.budget.replacements[1] == 1
        c.table.agents.clear()  # a job no agent launched (torchrun, say): nothing can restart its ranks
        for r in range(4):
            c.table.ranks[r].agent_node = None
        assert c.restarts.restart([2, 3]) == ([], [], [2, 3])
    finally:
        c.router.close()


def test_a_rank_whose_training_thread_does_not_take_an_order_says_where_that_thread_is(tmp_path):
    """An order for the training thread left untaken for HELD_REPORT_S: the processor reports where
    that thread is (its innermost frames) and where the stop stands, in what heartbeats carry; the
    report ends when the thread takes the order."""
    import threading
    from mindspeed_ha.rank.processor import processor as P

    gate = threading.Event()

    def held_in_a_device_sync():
        gate.wait()

    t = threading.Thread(target=held_in_a_device_sync, daemon=True)
    t.start()
    p = P.Processor(1, 4, 1, "n0", HAOptions(strategies=frozenset({"retry"}), log_dir=str(tmp_path)), [[1, 3]])
    p.events = EventLog.for_rank(str(tmp_path), 1)
    p.serve({"ha-status": lambda args: "here"}, training_thread=True)
    p.watch.training_ident = t.ident
    p._dispatch({"action": "ha-status", "id": 7, "epoch": 1, "args": {}})
    queued = p.watch.queued_at
    assert queued is not None
    p._check_held(queued + P.HELD_REPORT_S - 1)
    assert p.held == ""  # (not yet)
    p.stop.request("test: a peer faulted")
    try:
        p._check_held(queued + P.HELD_REPORT_S + 2)
        assert p.held.startswith(f"the training thread has not taken the controller's order for "
                                 f"{P.HELD_REPORT_S + 2:.0f}s; it is in wait (threading.py:"), p.held
        assert "<- held_in_a_device_sync (test_controller.py:" in p.held and "(test: a peer faulted)" in p.held
        held = [e for e in read_events(str(tmp_path / "events" / "rank_1.jsonl")) if e["event"] == "held"]
        assert [e["detail"] for e in held] == [p.held]
    finally:
        p.stop.clear()
        gate.set()
        t.join()
    # The thread takes the order (here: this one, in its place): the report ends, the answer goes out.
    assert p.serve_order(timeout=1.0) == "ha-status"
    assert p.held == "" and p.watch.queued_at is None


def test_a_rank_whose_training_thread_runs_an_order_for_long_says_where_it_is(tmp_path):
    """A restarted worker's set-up (its rebuild order) that takes past HELD_REPORT_S, or any order that
    runs that long on the training thread: the processor says where that thread is, as for an order
    not taken; the report ends with the order."""
    import threading
    from mindspeed_ha.rank.processor import processor as P

    p = P.Processor(1, 4, 1, "n0", HAOptions(strategies=frozenset({"recover"}), log_dir=str(tmp_path)), [[1, 3]])
    p.events = EventLog.for_rank(str(tmp_path), 1)
    reports: list[str] = []

    def slow_set_up(args):
        p._check_held(time.monotonic() + P.HELD_REPORT_S + 1)  # (the processor thread's look, later)
        reports.append(p.held)
        return "set up"
    p.serve({"rebuild": slow_set_up}, training_thread=True)
    p._dispatch({"action": "rebuild", "id": 3, "epoch": 1, "args": {}})
    assert p.serve_order(timeout=1.0) == "rebuild"
    assert reports[0].startswith(f"the training thread has run the controller's rebuild order for "
                                 f"{P.HELD_REPORT_S + 1:.0f}s; it is in "), reports
    assert "slow_set_up (test_controller.py:" in reports[0], reports
    assert p.held == ""  # (the order ended: no report)
    held = [e for e in read_events(str(tmp_path / "events" / "rank_1.jsonl")) if e["event"] == "held"]
    assert [e["detail"] for e in held] == reports


def test_a_controller_of_its_own_process_takes_the_ranks_strategies_and_names_a_rank_that_differs(tmp_path):
    """``mindspeed-ha controller`` is started without the job's switches: it takes the strategies the
    ranks register with (here retry), so a memory error is retried, not only dumped. A rank that
    enables others is named in the log and the events; the first rank's are kept."""
    keys = security.Keys.load(str(tmp_path), create=True)
    c = Controller(str(tmp_path), 4, None, keys, host="127.0.0.1").start()
    assert c.options.strategies == {"dump"} and c.options.source == "ranks"
    ranks = FakeRanks(c, keys, retry_answers(poisoned={1}),
                      strategies=lambda r: {"dump", "retry"} if r != 3 else {"dump", "recover"})
    try:
        ranks.pump(5, until=lambda: c.machine.state.value == "normal")
        assert c.options.strategies == {"dump", "retry"} and c.recovery.options is c.options
        ranks.socks[1].send(protocol.encode("fault", rank=1, kind="memory-error", iteration=6, phase="backward",
                                            detail="UCE ERROR", at=time.time()))
        ranks.pump(15, until=lambda: (1, "resume") in ranks.seen)
        evs = read_events(str(tmp_path / "events" / "controller.jsonl"))
        assert [(e["rank"], e["strategies"]) for e in evs if e["event"] == "strategies"][:1] in (
            [(0, ["dump", "retry"])], [(1, ["dump", "retry"])], [(2, ["dump", "retry"])])
        assert [(e["rank"], e["strategies"], e["job"]) for e in evs if e["event"] == "strategies_differ"] == [
            (3, ["dump", "recover"], ["dump", "retry"])]
        assert [e["outcome"] for e in evs if e["event"] == "strategy"] == ["retry"]
        assert [a for r, a in ranks.seen if r == 1] == ["stop", "ha-status", "rebuild", "repair", "rollback", "resume"]
    finally:
        ranks.close()
        c.close()


def test_the_cyclic_collector_is_held_through_a_recovery_and_runs_again_after_its_first_step(controller):
    """From the fault until the first step after the recovery, the controller's process collects no
    cycles (a full collection at 16,384 ranks took 0.3 s, under the GIL); then it does again."""
    c, keys = controller
    ranks = FakeRanks(c, keys, retry_answers(poisoned={1}))
    try:
        ranks.pump(5, until=lambda: c.machine.state.value == "normal")
        assert gc.isenabled() and not c.collector.held
        ranks.socks[1].send(protocol.encode("fault", rank=1, kind="memory-error", iteration=6, phase="backward",
                                            detail="UCE ERROR", at=time.time()))
        ranks.pump(10, until=lambda: (1, "resume") in ranks.seen)
        assert c.collector.held and not gc.isenabled()  # (training again: its first step not ended yet)
        ranks.pump(10, until=lambda: not c.collector.held, it=7)  # (every rank past the step it resumed)
        assert gc.isenabled() and not c.collector.held
    finally:
        ranks.close()
        gc.enable()


def test_the_collector_hold_leaves_a_collector_that_was_off_as_it_was():
    from mindspeed_ha.control.controller.collector import CollectorHold
    hold = CollectorHold()
    try:
        hold.entered("pause")
        assert hold.held and not gc.isenabled()
        hold.entered("recovering")
        assert not gc.isenabled()
        hold.entered("exit")
        assert not hold.held and gc.isenabled()
        gc.disable()  # (the job's own choice, e.g. Megatron-LM's --manual-gc)
        hold.entered("pause")
        hold.release()
        assert not hold.held and not gc.isenabled()
    finally:
        gc.enable()
