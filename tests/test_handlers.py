"""Each recovery order a rank serves (rank/recovery/handlers.py), on fakes: a session with the fields the
orders read, a trainer that records what it is asked, and recovery tools that record each call in
place of the engine's (rank/recovery/engine.py: the groups, the shard transfers, the layouts and the
checkpoints). No process, no socket:
the orders' own logic — what each answers, in what order it acts, what it leaves behind when a
step of it fails — is what is tested here; the drills test the same orders for real."""
from __future__ import annotations

import contextlib
import datetime
import types
from typing import Any

import pytest

from mindspeed_ha.comm.stop import CollectiveStopped, Stop
from mindspeed_ha.options import HAOptions
from mindspeed_ha.plan import DumpPlan, ElasticPlan
from mindspeed_ha.rank.recovery.handlers import RankRecovery


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: str, **fields: Any) -> None:
        self.emitted.append((event, fields))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [f for e, f in self.emitted if e == event]


class Trainer:
    """What the orders ask of a trainer, recorded in ``calls``."""

    def __init__(self, iteration: int = 6, save_dir: str | None = "/ckpt", optimizer: Any = "opt") -> None:
        self.iteration, self.ended, self.save_dir, self.optimizer = iteration, iteration, save_dir, optimizer
        self.global_batch_size, self.micro_batch_size = 16, 2
        self.calls: list[tuple] = []
        self.unlogged: tuple[int, float] | None = None

    def __getattr__(self, name: str):  # setup, clean_partial_step, resync_weights, after_reload, restart_from, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: self.calls.append((name, *a, *k.values()))

    def load_checkpoint(self, path: str) -> int:
        self.calls.append(("load_checkpoint", path))
        return 4

    def unlogged_loss(self) -> tuple[int, float] | None:
        return self.unlogged


class Session:
    """The fields and hooks of ``recovery.handlers.Session``; each hook records itself in ``calls``."""

    def __init__(self, trainer: Trainer | None = None, strategies: tuple[str, ...] = ("retry",)) -> None:
        self.rank, self.world_size = 1, 4
        self.options = HAOptions(strategies=frozenset(strategies), log_dir="/tmp/x")
        self.device = types.SimpleNamespace(backend="gloo")
        self.events = Events()
        self.trainer = trainer if trainer is not None else Trainer()
        self.optimizer: Any = types.SimpleNamespace(ha_updating=False, ha_touched=False)
        self.topology: Any = types.SimpleNamespace(dp_ranks=[1, 3], replica_num=2)
        self.processor: Any = types.SimpleNamespace(groups=[[1, 3]])
        self.stop = Stop()
        self.joining = False
        self.shard_poisoned = False
        self.last_step: tuple[int | None, float | None] = (None, None)
        self.after_setup = None
        self.join_marks: list[tuple[str, float]] = []
        self.writes_loss = False
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):  # device_ready, fire, loaded, progressed, joined, resumed, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: self.calls.append((name, *a, *k.values()))

    def resized(self) -> None:
        self.calls.append(("resized",))
        self.writes_loss = True  # (this rank writes the loss in the new layout)


class Tools:
    """Records every call; answers what the engine's calls would, in shape."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail: dict[str, BaseException] = {}
        self.newest: tuple[int, str] | None = (4, "/ckpt/iter_0000004")

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        if name in self.fail:
            raise self.fail[name]

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    @contextlib.contextmanager
    def joining(self, world_size, rank, backend, timeout):
        self._call("joining", world_size, rank, backend, timeout)
        yield
        self.calls.append(("joined-groups",))

    @contextlib.contextmanager
    def alone(self):
        self._call("alone")
        yield

    def communicators(self, pending=()):
        return dict(COMM)

    def reconnect(self, store_host, store_port, generation, *, remake=None):
        self._call("reconnect", store_host, store_port, generation, remake)
        remade = sorted(remake or ["dp", "tp", "world"])
        return {"groups": len(remade), "seconds": 0.01, "kept": [[0, 2]] if remake else [],
                "remade": [[0, 1]] * len(remade), "why": [(remake or {}).get(k, "all") for k in remade]}

    def survivor_world(self, survivors, rank, store_host, store_port, generation, timeout, backend):
        self._call("survivor_world", list(survivors), rank, generation)
        return "world"

    def job_rank(self, rank):
        return rank + 10

    def parallel_sizes(self):
        return 2, 1

    def shard_status(self, trainer):
        self._call("shard_status")
        return {"iteration": 6, "updating": False}

    def transfer_shards(self, optimizer, pairs, rank, iteration, overwriting, chunk_bytes):
        self._call("transfer_shards", pairs, iteration, chunk_bytes)
        if any(dst == rank for _, dst in pairs):
            overwriting()
        return 1024 if pairs else 0

    def transfer_bookkeeping(self, trainer, joiners, rank):
        self._call("transfer_bookkeeping", joiners)
        return {"trainer": {"step_loss": 2.5}}

    def shard_bytes(self, optimizer):
        return 4096

    @contextlib.contextmanager
    def peak_memory(self):
        yield types.SimpleNamespace(bytes=77)

    def resume_at(self, trainer, iteration):
        self._call("resume_at", iteration)
        return "rolled back"

    def holdings(self, trainer):
        self._call("holdings")
        return {"old_ranges": {}, "newcomer": trainer.optimizer is None}

    def enter_layout(self, trainer, plan, rank, store_host, store_port, generation, backend, held, timeout,
                     remake=None):
        self._call("enter_layout", generation, held)
        return {"entered": generation}

    def move_state(self, trainer, plan, rank, entered, chunk_bytes):
        self._call("move_state", entered)
        return {"moved_bytes": 10}

    def newest_checkpoint(self, save_dir):
        return self.newest

    def prepare_dump(self, trainer, abandon_update):
        self._call("prepare_dump", abandon_update)
        return types.SimpleNamespace(bytes=123, status={"iteration": 6, "updating": False, "touched": False,
                                                         "replica_group": [1, 3], "trainer_iteration": 6})

    def write_dump(self, prepared, plan, world, save_dir, events, progress, chunk_bytes):
        self._call("write_dump", world, save_dir)
        progress()
        return types.SimpleNamespace(iteration=6, path="/ckpt/iter_0000006", seconds=0.5, bytes=123)


def _recovery(session: Session | None = None) -> tuple[RankRecovery, Session, Tools]:
    s = session or Session()
    tools = Tools()
    return RankRecovery(s, tools), s, tools  # type: ignore[arg-type]  (fakes of the protocols)


STORE = {"store_host": "h", "store_port": 29500, "generation": 3}


def _elastic_plan(direction: str = "in") -> dict:
    return ElasticPlan(True, iteration=6, dp=1, kept=((1,),), writers={(1,): 1}, microbatches=8,
                       direction=direction).to_wire()


COMM = {"keys": ["tp"], "ops": [4], "odd": {}, "members": {"tp": [0, 1]}}  # (a status's communicators: one idle group)


# ---- ha-status ---------------------------------------------------------------------------------------------
def test_status_reports_the_shard_the_newest_checkpoint_and_the_stops_abort():
    r, s, tools = _recovery()
    assert r.handlers()["ha-status"]({}) == {"replica": True, "iteration": 6, "updating": False, "ended": 6,
                                             "checkpoint": [4, "/ckpt/iter_0000004"], "poisoned": False,
                                             "comm": COMM}
    assert ("fire", "recovery", 7) in s.calls
    s.stop.abort_summary = lambda: {"seconds": 0.2}  # type: ignore[method-assign]  (an abort happened)
    assert r.ha_status({})["abort"] == {"seconds": 0.2}


def test_status_without_replicas_names_the_checkpoint_only_and_elastic_adds_the_layout():
    r, s, tools = _recovery()
    s.optimizer = None
    assert r.ha_status({}) == {"replica": False, "ended": 6, "checkpoint": [4, "/ckpt/iter_0000004"], "comm": COMM}
    r, s, tools = _recovery(Session(strategies=("elastic-training",)))
    assert r.ha_status({})["layout"] == {"dp_ranks": [11, 13], "global_batch": 16, "micro_batch": 2,
                                         "replica_num": 2, "stages": 2, "experts": 1}


def test_status_of_a_joiner_and_of_a_rank_between_two_layouts():
    r, s, tools = _recovery()
    s.joining = True
    assert r.ha_status({}) == {"replica": True, "joining": True}
    s.joining = False
    r.unfinished = {"held": {}, "status": {"replica": True, "unfinished": True}}
    assert r.ha_status({}) == {"replica": True, "unfinished": True}
    assert tools.calls == []


def test_a_fault_while_answering_the_status_is_reported_and_the_answer_still_stands():
    r, s, tools = _recovery()
    boom = RuntimeError("memory error while serving")

    def fire(phase, it):
        raise boom
    s.fire = fire  # type: ignore[method-assign]
    assert r.ha_status({})["replica"] is True
    assert ("report_fault_in_recovery", boom) in s.calls


# ---- rebuild -------------------------------------------------------------------------------------------------
def test_a_survivor_rebuild_clears_the_stop_cleans_the_partial_step_then_reconnects():
    r, s, tools = _recovery()
    s.stop.request("peer faulted")
    assert r.rebuild(STORE) == "rebuild: 3 communicator(s) remade (all), 0 kept, in 0.010s"
    assert not s.stop.requested()
    assert s.calls == [("device_ready", 7), ("fire", "rebuild", 7)]
    assert s.trainer.calls == [("clean_partial_step",)]
    assert tools.calls == [("reconnect", "h", 29500, 3, None)]
    assert s.events.named("rebuilt") == [{"kept": [], "remade": [[0, 1]] * 3, "why": ["all"] * 3, "seconds": 0.01}]


def test_a_rebuild_remakes_the_communicators_the_order_names_and_says_which_it_kept():
    r, s, tools = _recovery()
    s.stop.request("peer faulted")
    answer = r.rebuild({**STORE, "remake": {"tp": "open"}})
    assert answer == "rebuild: 1 communicator(s) remade (open), 1 kept, in 0.010s"
    assert tools.calls == [("reconnect", "h", 29500, 3, {"tp": "open"})]
    assert s.events.named("rebuilt") == [{"kept": [[0, 2]], "remade": [[0, 1]], "why": ["open"], "seconds": 0.01}]


def test_a_joiner_sets_up_alone_in_unconnected_groups_then_connects_them():
    trainer = Trainer(optimizer=None)
    r, s, tools = _recovery(Session(trainer))
    s.joining = True
    answer = r.rebuild(STORE)
    assert answer.startswith("joined and set up in ") and answer.endswith("(3 groups)")
    assert tools.names() == ["joining", "alone", "joined-groups", "reconnect"]
    assert trainer.calls == [("setup", True)]
    assert [c[0] for c in s.calls] == ["joined"] and [m[0] for m in s.join_marks] == ["rebuild"]


# ---- repair ---------------------------------------------------------------------------------------------------
def test_a_repaired_shard_is_whole_only_after_the_commit_point():
    r, s, tools = _recovery()
    out = r.repair({"pairs": [3, 1], "iteration": 6})
    assert out == {"received": 1024} and s.shard_poisoned is False
    assert s.trainer.calls == [("resync_weights",)]
    assert s.events.named("repaired") == [{"iteration": 6, "bytes": 1024, "sources": [3], "shard_bytes": 4096,
                                           "extra_mem_bytes": 77}]
    # the stop aborted communicators meanwhile: the commit point refuses and the shard stays poisoned
    s.stop.abort_now(why="test")
    with pytest.raises(CollectiveStopped):
        r.repair({"pairs": [3, 1], "iteration": 6})
    assert s.shard_poisoned is True


def test_a_repair_that_hands_a_joiner_its_counters_reports_the_step_it_never_logged():
    r, s, tools = _recovery()
    s.shard_poisoned = True  # (what this rank holds was poisoned before: sending does not make it whole)
    assert r.repair({"pairs": [1, 3], "joiners": [3, 1], "iteration": 6}) == {"received": 1024}
    assert ("transfer_bookkeeping", {3: 1}) in tools.calls
    assert ("report_unlogged_step", 6, 2.5) in s.calls
    assert s.shard_poisoned is True


# ---- reload, rollback, resume ------------------------------------------------------------------------------------
def test_reload_loads_the_newest_checkpoint_and_says_so():
    r, s, tools = _recovery()
    s.shard_poisoned = True
    assert r.reload({"ended": 5}) == {"iteration": 4}
    assert s.trainer.calls == [("load_checkpoint", "/ckpt"), ("after_reload", 5)]
    assert s.shard_poisoned is False and s.calls[0][:3] == ("loaded", 4, "/ckpt")


def test_rollback_and_a_fresh_data_position_in_a_new_layout():
    r, s, tools = _recovery()
    assert r.rollback({"iteration": 6}) == "rolled back" and s.trainer.calls == []
    r.rollback({"iteration": 6, "fresh_data": True})
    assert s.trainer.calls == [("restart_from", 6)]
    assert tools.calls == [("resume_at", 6), ("resume_at", 6)]


def test_rollback_tells_the_trainer_when_some_rank_had_ended_the_step():
    """A survivor had ended the step before the recovery (it may have passed the loop's code after it
    alone): the trainer is told, so that a rank yet to run that code answers it alone too."""
    r, s, tools = _recovery()
    r.rollback({"iteration": 6, "ended_elsewhere": False})
    assert s.trainer.calls == []
    r.rollback({"iteration": 6, "ended_elsewhere": True})
    assert s.trainer.calls == [("peers_ended", 6)]


def test_resume_counts_the_lost_steps():
    r, s, tools = _recovery()
    assert r.resume({"lost_steps": 2}) == "resumed" and s.calls == [("resumed", 2)]


# ---- scale-in, scale-out ---------------------------------------------------------------------------------------
def test_a_kept_rank_resizes_moves_its_state_and_logs_the_step_its_lost_writer_did_not():
    r, s, tools = _recovery(Session(strategies=("elastic-training",)))
    s.last_step = (6, 1.25)
    out = r.handlers()["scale-in"]({"plan": _elastic_plan(), **STORE})
    assert out == {"moved_bytes": 10, "replica_group": [1, 3]}
    assert tools.names() == ["shard_status", "holdings", "enter_layout", "move_state"]
    assert s.trainer.calls == [("clean_partial_step",)]
    assert s.events.named("resized") == [{"iteration": 6, "moved_bytes": 10}]
    assert ("report_unlogged_step", 6, 1.25) in s.calls and r.unfinished is None


def test_a_resize_cut_short_leaves_the_rank_between_two_layouts_and_the_next_starts_from_what_it_held():
    r, s, tools = _recovery(Session(strategies=("elastic-training",)))
    tools.fail["move_state"] = CollectiveStopped("a peer was lost")
    with pytest.raises(CollectiveStopped):
        r.resize({"plan": _elastic_plan(), **STORE})
    assert r.unfinished is not None and r.ha_status({})["unfinished"] is True
    assert r.dump_status({})["why"] == "between two layouts (its elastic resize did not complete)"
    held = r.unfinished["held"]
    del tools.fail["move_state"]
    tools.calls.clear()
    r.resize({"plan": _elastic_plan(), **{**STORE, "generation": 4}})
    assert tools.calls == [("enter_layout", 4, held), ("move_state", {"entered": 4})]  # (no new holdings)
    assert r.unfinished is None


def test_a_newcomer_whose_loop_builds_its_model_answers_the_scale_out_later():
    trainer = Trainer(optimizer=None)
    r, s, tools = _recovery(Session(trainer, strategies=("elastic-training",)))
    s.joining = True
    later = r.handlers()["scale-out"]({"plan": _elastic_plan("out"), **STORE})
    from mindspeed_ha.rank.processor.serving import Later
    assert isinstance(later, Later) and "move_state" not in tools.names()
    sent: list[tuple] = []
    later._send = lambda ok, data=None, error="": sent.append((ok, data, error))
    assert s.after_setup is not None
    built = Trainer()
    s.after_setup(built)  # (its loop has built the model: the rest runs, and the answer goes out)
    assert sent == [(True, {"moved_bytes": 10, "replica_group": [1, 3]}, "")]


# ---- dump-status, dump -----------------------------------------------------------------------------------------
def test_dump_status_of_a_rank_that_holds_nothing_says_why_and_where_the_job_would_resume():
    r, s, tools = _recovery()
    s.joining = True
    assert r.dump_status({}) == {"holds": False, "fallback": [4, "/ckpt/iter_0000004"],
                                 "why": "restarted, it holds no state yet"}
    s.joining, s.shard_poisoned = False, True
    assert r.dump_status({})["why"] == "a memory error corrupted its optimizer shard"


def test_dump_status_refuses_without_a_save_directory_or_replicas():
    r, s, tools = _recovery(Session(Trainer(save_dir=None)))
    with pytest.raises(RuntimeError, match="no --save directory"):
        r.dump_status({})
    r, s, tools = _recovery()
    s.optimizer = None
    with pytest.raises(RuntimeError, match="--distributed-optimizer-no-replica"):
        r.dump_status({})


def test_dump_status_prepares_the_part_and_abandons_an_update_that_touched_nothing():
    r, s, tools = _recovery()
    s.optimizer.ha_updating = True
    s.trainer.unlogged = (6, 1.5)
    st = r.dump_status({})
    assert tools.calls == [("prepare_dump", True)]
    assert st["abandoned"] is True and st["bytes"] == 123 and st["save"] == "/ckpt"
    assert st["unlogged"] == {"iteration": 6, "loss": 1.5, "writer": False}


def test_the_dump_writes_over_the_survivors_world_and_logs_the_step_it_settles_on():
    r, s, tools = _recovery()
    with pytest.raises(RuntimeError, match="dump before dump-status"):
        r.dump({})
    r.dump_status({})
    s.stop.request("the dump's stop")
    s.trainer.unlogged = (6, 1.5)
    plan = DumpPlan(True, iteration=6, writers={(1, 3): 1}, at_target=(1, 3)).to_wire()
    out = r.dump({"plan": plan, "survivors": [0, 1, 3], "log_loss": 1, **STORE})
    assert out == {"iteration": 6, "path": "/ckpt/iter_0000006", "seconds": 0.5, "bytes": 123, "save": "/ckpt"}
    assert not s.stop.requested()
    assert tools.calls[-2:] == [("survivor_world", [0, 1, 3], 1, 3), ("write_dump", "world", "/ckpt")]
    assert ("progressed",) in s.calls and ("log_step_at_dump", 6, 1.5) in s.calls


def test_the_engine_is_the_engines_own_calls_by_the_names_the_orders_use():
    """The orders reach each engine call directly: every call of ``RecoveryTools`` is the engine's
    function itself (mypy checks their signatures), none passes through a forwarder."""
    from mindspeed_ha.rank.recovery import engine, handlers, restore
    calls = sorted(n for n in vars(handlers.RecoveryTools) if not n.startswith("_"))
    assert sorted(engine.__all__) == calls
    assert engine.transfer_shards is restore.transfer_shards and engine.shard_status is restore.status
    assert all(getattr(engine, n).__module__.startswith("mindspeed_ha.") for n in calls)
    assert RankRecovery(Session()).tools is engine


def test_every_order_is_in_the_table():
    r, _, _ = _recovery()
    assert sorted(r.handlers()) == ["dump", "dump-status", "ha-status", "rebuild", "reload", "repair", "resume",
                                    "rollback", "scale-in", "scale-out"]
    assert r.collective_timeout == datetime.timedelta(seconds=r.s.options.collective_timeout_s)
