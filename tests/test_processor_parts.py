"""The processor's parts on their own (rank/processor/): a step's own work as the heartbeats carry it,
and the controller a rank hosts, made by the factory it is handed. No thread, no socket."""
from __future__ import annotations

import threading

import pytest

from mindspeed_ha.options import WARM_UP_STEPS
from mindspeed_ha.rank.processor.hosting import ControllerHost
from mindspeed_ha.rank.processor.own_work import OwnWork


class Clock:
    """The step's time and the process's waits in collectives, as the test says they went."""

    def __init__(self) -> None:
        self.now = self.waited = 100.0

    def step(self, work: OwnWork, own: float, waited: float) -> bool:
        work.step_start()
        self.now += own + waited
        self.waited += waited
        return work.step_end()


def _steps(work: OwnWork, clock: Clock, own: list[float], waited: list[float]) -> list[bool]:
    return [clock.step(work, o, w) for o, w in zip(own, waited)]


def test_own_work_skips_the_warm_up_sends_its_first_figure_at_once_and_a_slow_step_alone():
    clock = Clock()
    work = OwnWork(1.3, lambda: clock.waited, lambda: clock.now)
    now = _steps(work, clock, [1.0] * WARM_UP_STEPS, [5.0] * WARM_UP_STEPS)
    assert now == [False] * WARM_UP_STEPS and work.take() is None  # (a warm-up: nothing counted)
    assert _steps(work, clock, [1.0], [5.0]) == [True]        # the first figure goes out at once
    assert work.take() == pytest.approx(1.0)  # (the waits are not the rank's own work)
    assert _steps(work, clock, [1.0, 1.0], [0.0, 0.0]) == [False, False]
    assert _steps(work, clock, [3.0], [0.0]) == [True]        # slower than itself lately: at once, alone
    assert work.take() == pytest.approx(3.0) and work.take() is None
    work.warm_up_again()                                # (after a recovery)
    assert _steps(work, clock, [9.0] * WARM_UP_STEPS, [0.0] * WARM_UP_STEPS) == [False] * WARM_UP_STEPS
    assert work.take() is None and work.steps_done == 2 * WARM_UP_STEPS + 4


class Made:
    """What the factory made: its arguments, and a controller's surface."""

    def __init__(self, *given, **how) -> None:
        self.given, self.how = given, how
        self.standby = bool(how.get("standby"))
        self.endpoint = f"tcp://host:{how['rank']}"
        self.done = threading.Event()
        self.settled: list[str] = []
        self.epochs: list[int] = []
        self.takeovers: list[dict] = []

    def start(self) -> "Made":
        return self

    def close(self, timeout: float = 2.0) -> None:
        pass

    def saw_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def settle(self, rids) -> None:
        self.settled.extend(rids)

    def order_takeover(self, args: dict) -> None:
        self.takeovers.append(args)


def test_a_standby_is_made_once_with_what_every_controller_here_is_given_and_learns_what_was_settled():
    host = ControllerHost(Made, rank=2)
    host.configure("logs", 4, "options", "keys", job_id="j", job_store=None, local_exit=print)
    host.settle(["1.fault.1"])
    assert host.stand_by({"epoch": 3, "controller": 0}) == "tcp://host:2"
    made = host.controller
    assert isinstance(made, Made) and made.given == ("logs", 4, "options", "keys")
    assert made.how == {"job_id": "j", "job_store": None, "local_exit": print, "rank": 2, "standby": True,
                        "epoch": 3, "previous": 0, "settled": {"1.fault.1"}}
    assert host.stand_by({"epoch": 4}) == "tcp://host:2" and host.controller is made  # (once)
    host.settle(["3.fault.1"])
    host.saw_epoch(5)
    assert made.settled == ["3.fault.1"] and made.epochs == [5]
    assert host.take_over({"reason": "migrate"}) == "tcp://host:2" and made.takeovers == [{"reason": "migrate"}]


def test_a_rank_given_no_factory_refuses_to_stand_by_and_rank_0_starts_the_first_controller():
    with pytest.raises(RuntimeError, match="rank 2 was given no controller to host"):
        ControllerHost(None, rank=2).stand_by({})
    with pytest.raises(RuntimeError, match="rank 1 runs no standby controller"):
        ControllerHost(Made, rank=1).take_over({})
    host = ControllerHost(Made, rank=0)
    host.configure("logs", 4, "options", "keys", job_id="j")
    host.start_first()
    assert isinstance(host.controller, Made) and host.controller.how == {"job_id": "j", "rank": 0}


def test_a_processor_handed_no_stop_imports_no_torch_until_its_stop_is_used(tmp_path):
    """The control plane imports no torch: a processor made without a stop (a tool's, a test's) reaches
    the process's stop only when an order uses it. Made in a fresh interpreter."""
    import subprocess
    import sys
    code = (f"import sys\nfrom mindspeed_ha.rank.processor.processor import Processor\n"
            f"from mindspeed_ha.options import HAOptions\n"
            f"p = Processor(1, 4, 1, 'n0', HAOptions(log_dir={str(tmp_path)!r}), [[1, 3]])\n"
            f"assert not p.in_collective() and 'torch' not in sys.modules, 'torch imported'\n"
            f"assert p.stop.report() == 'no stop in force' and 'torch' in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_an_answer_goes_back_the_way_its_order_came_and_again_directly_when_the_order_does():
    """``relay.Routes``: an order that came through the agent's relay is answered there (the answer
    kept); the same order coming on the link later (its agent went silent) has that answer sent again
    on the link, and any answer after that goes there too. Orders that came directly are answered
    directly."""
    from mindspeed_ha.rank.processor.relay import Routes
    routes, resent = Routes(), []
    routes.came(7, True, resent.append)
    assert routes.relayed(7, b"answer-7") and not routes.relayed(8, b"answer-8")
    routes.came(7, False, resent.append)
    assert resent == [b"answer-7"] and not routes.relayed(7, b"again")
    routes.came(9, True, resent.append)
    routes.came(9, False, resent.append)  # (not answered yet: nothing to send again; it answers directly)
    assert resent == [b"answer-7"] and not routes.relayed(9, b"answer-9")


def test_an_order_a_stop_came_after_is_answered_not_run_and_the_next_one_runs():
    """The controller sent a rebuild, then (a new fault) a stop, and both came before the training
    thread took the rebuild: the rebuild is of a round the controller gave up, so it is answered as not
    run (run, it would clear the stop and wait on peers the stop let go); the status sent after the
    stop runs. An order queued after every stop runs as ever."""
    import contextlib

    from mindspeed_ha.control.wire import protocol
    from mindspeed_ha.rank.processor.held import HeldWatch
    from mindspeed_ha.rank.processor.serving import Orders
    ran, stops, sent = [], [], []
    orders = Orders(0, {"stop": lambda a: stops.append(a) or "stop requested"},
                    lambda frame, aid: sent.append(protocol.decode(frame)), HeldWatch(lambda: ""),
                    contextlib.nullcontext)
    orders.serve({"rebuild": lambda a: ran.append("rebuild") or "ok",
                  "ha-status": lambda a: ran.append("ha-status") or {}}, training_thread=True)
    orders.route("rebuild", 7, {})
    orders.route("stop", 8, {})
    orders.route("ha-status", 9, {})
    assert orders.serve_order(timeout=1.0) == "" and ran == [] and len(stops) == 1
    assert orders.serve_order(timeout=1.0) == "ha-status" and ran == ["ha-status"]
    assert [(m["action"], m["id"], m["ok"]) for m in sent] == [("stop", 8, True), ("rebuild", 7, False),
                                                             ("ha-status", 9, True)]
    assert "a stop came after this order" in sent[1]["error"]
    orders.route("rebuild", 10, {})
    assert orders.serve_order(timeout=1.0) == "rebuild" and ran == ["ha-status", "rebuild"]


def test_an_order_that_carries_the_next_runs_both_and_answers_once():
    """Two rounds in one order (``then``): the rank rolls back, then resumes, and answers both; the
    training thread's loop sees the resume. If the first fails, the second is not run and the answer
    says which failed; a ``then`` of another thread (or unknown here) is refused without running either."""
    import contextlib

    from mindspeed_ha.control.wire import protocol
    from mindspeed_ha.rank.processor.held import HeldWatch
    from mindspeed_ha.rank.processor.serving import Orders
    ran, sent = [], []
    orders = Orders(0, {}, lambda frame, aid: sent.append(protocol.decode(frame)), HeldWatch(lambda: ""),
                    contextlib.nullcontext)

    def rollback(args):
        ran.append(("rollback", args))
        if args.get("fail"):
            raise RuntimeError("no RNG snapshot")
        return "rollback"
    orders.serve({"rollback": rollback, "resume": lambda a: ran.append(("resume", a)) or "resumed"}, training_thread=True)
    orders.serve({"log": lambda a: "logged"}, training_thread=False)
    orders.route("rollback", 4, {"iteration": 5, "then": ["resume", {"lost_steps": 0}]})
    assert orders.serve_order(timeout=1.0) == "resume"
    assert ran == [("rollback", {"iteration": 5}), ("resume", {"lost_steps": 0})]
    assert (sent[-1]["id"], sent[-1]["ok"], sent[-1]["data"]) == (4, True, ["rollback", "resumed"])
    orders.route("rollback", 5, {"fail": True, "then": ["resume", {}]})
    assert orders.serve_order(timeout=1.0) == "rollback" and ran[-1][0] == "rollback"
    assert (sent[-1]["ok"], sent[-1]["error"]) == (False, "rollback: RuntimeError: no RNG snapshot")
    for then in ("log", "reshape"):
        ran.clear()
        orders.route("rollback", 6, {"then": [then, {}]})
        assert orders.serve_order(timeout=1.0) == "rollback" and ran == []
        assert not sent[-1]["ok"] and f"no handler for {then!r} after 'rollback'" in sent[-1]["error"]


def test_a_failed_answer_names_its_faults_kind_where_the_handler_raised_a_memory_or_communication_error():
    """A handler that raised a memory error (alone, or the first or second of a merged order) or a
    communication error: the failed answer says its kind, so the controller's new fault is one that
    retry takes. Any other error names none (the controller counts it as "other")."""
    import contextlib

    from mindspeed_ha.control.wire import protocol
    from mindspeed_ha.faults import CollectiveStopped, CommFault, MemoryFault
    from mindspeed_ha.rank.processor.held import HeldWatch
    from mindspeed_ha.rank.processor.serving import Orders
    sent = []
    orders = Orders(0, {}, lambda frame, aid: sent.append(protocol.decode(frame)), HeldWatch(lambda: ""),
                    contextlib.nullcontext)
    errors = {"uce": MemoryFault("UCE ERROR: page 7"), "link": CommFault("link down"), "bug": ValueError("bad")}

    def raising(args):
        if args.get("raise"):
            raise errors[args["raise"]]
        return "ok"
    orders.serve({"rebuild": raising, "repair": raising}, training_thread=True)
    cases = [({"raise": "uce"}, "memory-error"), ({"raise": "link"}, "comm-failure"), ({"raise": "bug"}, None),
             ({"then": ["repair", {"raise": "uce"}]}, "memory-error"),
             ({"raise": "uce", "then": ["repair", {}]}, "memory-error")]
    for aid, (args, kind) in enumerate(cases, 1):
        orders.route("rebuild", aid, args)
        orders.serve_order(timeout=1.0)
        assert (sent[-1]["id"], sent[-1]["ok"], sent[-1].get("kind")) == (aid, False, kind), (args, sent[-1])
    # The training thread serves orders while it handles its step's fault (a collective it left on the
    # stop, a memory error): Python chains that to whatever a handler raises, as its context; it is not
    # the handler's fault, and does not name its kind.
    for step_fault in (CollectiveStopped("stopped by request"), MemoryFault("UCE ERROR: the step's")):
        for n, (args, kind) in enumerate([({"raise": "bug"}, None), ({"raise": "uce"}, "memory-error"),
                                          ({"then": ["repair", {"raise": "bug"}]}, None)]):
            aid = 10 + n
            try:
                raise step_fault
            except type(step_fault):
                orders.route("rebuild", aid, args)
                orders.serve_order(timeout=1.0)
            assert (sent[-1]["id"], sent[-1]["ok"], sent[-1].get("kind")) == (aid, False, kind), (step_fault, args)
