"""What a rank does for the controller's recovery orders: one method per order, in one table.

The controller's strategies (control/strategies/) send these orders round by round; each runs here
on the rank's training thread, parked after the fault (``RankSession.report_fault`` serves them), and
answers with a msgpack tree — an exception is a failed answer.

    ha-status  where this rank's optimizer shard is (or, without replicas, its newest checkpoint)
    rebuild    new communicators for the groups the fault reached, the others kept (a restarted rank: its
               set-up, then every group of its own)
    repair     shards from their twins; a restarted rank's counters and RNG; weights re-gathered
    reload     without replicas: the newest periodic checkpoint, in process
    rollback   back to the start of the failed step, or finish it
    scale-in   elastic: this kept rank trains on at a smaller data-parallel size, in process
    scale-out  elastic: the same toward a larger size; a newcomer sets itself up in the new layout
               (one whose loop builds its model, Megatron-LM's, answers after that: ``Later``)
    resume     train on
    dump-status, dump   the dying-gasp checkpoint: prepare this rank's part, then write it
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Protocol, Sequence

from mindspeed_ha.events import EventLog, get_logger
from mindspeed_ha.faults import fault_kind

if TYPE_CHECKING:
    from mindspeed_ha.comm.groups import World
    from mindspeed_ha.comm.stop import Stop
    from mindspeed_ha.options import HAOptions
    from mindspeed_ha.plan import DumpPlan, ElasticPlan
    from mindspeed_ha.rank.processor.processor import Processor
    from mindspeed_ha.rank.processor.serving import Later
    from mindspeed_ha.rank.recovery.dump import DumpResult, Prepared
    from mindspeed_ha.replica.optimizer import ReplicaMixin
    from mindspeed_ha.replica.topology import ReplicaTopology
    from mindspeed_ha.trainer_state.interface import TrainerInterface

log = get_logger("recovery.handlers")


class Session(Protocol):
    """What the orders use of the rank (``session.RankState``, the recovery's part of the rank's
    session): who the rank is, its trainer and optimizer, and the hooks a recovery reports through."""
    rank: int
    world_size: int
    options: HAOptions
    device: Any
    events: EventLog
    trainer: TrainerInterface | None
    optimizer: Any
    topology: ReplicaTopology | None
    processor: Processor | None
    stop: Stop
    joining: bool
    shard_poisoned: bool
    last_step: tuple[int | None, float | None]
    after_setup: Callable[[TrainerInterface], object] | None
    join_marks: list[tuple[str, float]]

    @property
    def writes_loss(self) -> bool: ...
    def device_ready(self, iteration: int) -> None: ...
    def fire(self, phase: str, iteration: int) -> None: ...
    def loaded(self, iteration: int, path: str, seconds: float) -> None: ...
    def progressed(self) -> None: ...
    def resized(self) -> None: ...
    def report_fault_in_recovery(self, exc: BaseException) -> None: ...
    def report_unlogged_step(self, iteration: int, loss: Any) -> None: ...
    def log_step_at_dump(self, iteration: int, loss: float) -> None: ...
    def joined(self, setup_s: float, setup: dict[str, float], reconnect: dict[str, Any]) -> None: ...
    def resumed(self, lost_steps: int = 0) -> None: ...


class PeakMeasure(Protocol):
    """The peak memory a block reached above its start (None where nothing says)."""
    bytes: int | None


class RecoveryTools(Protocol):
    """All the orders use beneath the session: the engine's own calls (the ``engine`` module, which
    names each function so), or in the unit tests a fake that records each call
    (tests/test_handlers.py), so that every order is tested without a process or a socket."""

    # -- groups (comm.groups, comm.interruptible) ---------------------------------------------------
    def joining(self, world_size: int, rank: int, backend: str,
                timeout: datetime.timedelta) -> ContextManager[object]: ...
    def alone(self) -> ContextManager[None]: ...
    def communicators(self, pending: Iterable[object] = ()) -> dict[str, Any]: ...
    def reconnect(self, store_host: str, store_port: int, generation: int, *,
                  remake: dict[str, str] | None = None) -> dict[str, Any]: ...
    def survivor_world(self, survivors: Sequence[int], rank: int, store_host: str, store_port: int,
                       generation: int, timeout: datetime.timedelta, backend: str) -> World: ...
    def job_rank(self, rank: int) -> int: ...
    # -- the optimizer shard (recovery.restore, device.memory) -----------------------------------------
    def shard_status(self, trainer: TrainerInterface) -> dict[str, Any]: ...
    def transfer_shards(self, optimizer: ReplicaMixin, pairs: list[tuple[int, int]], rank: int, iteration: int,
                        overwriting: Callable[[], None], chunk_bytes: int) -> int: ...
    def transfer_bookkeeping(self, trainer: TrainerInterface, joiners: dict[int, int],
                             rank: int) -> dict[str, Any] | None: ...
    def shard_bytes(self, optimizer: ReplicaMixin) -> int: ...
    def peak_memory(self) -> ContextManager[PeakMeasure]: ...
    def resume_at(self, trainer: TrainerInterface, iteration: int) -> str: ...
    # -- the layout (recovery.elastic) ------------------------------------------------------------------
    def parallel_sizes(self) -> tuple[int, int]: ...
    def holdings(self, trainer: TrainerInterface) -> dict[str, Any]: ...
    def enter_layout(self, trainer: TrainerInterface, plan: ElasticPlan, rank: int, store_host: str,
                     store_port: int, generation: int, *, backend: str, held: dict[str, Any],
                     timeout: datetime.timedelta, remake: dict[str, str] | None = None) -> dict[str, Any]: ...
    def move_state(self, trainer: TrainerInterface, plan: ElasticPlan, rank: int, entered: dict[str, Any],
                   chunk_bytes: int) -> dict[str, Any]: ...
    # -- checkpoints (trainer_state.checkpoint_dir, recovery.dump) ---------------------------------------
    def newest_checkpoint(self, root: str | None) -> tuple[int, str] | None: ...
    def prepare_dump(self, trainer: TrainerInterface, abandon_update: bool) -> Prepared: ...
    def write_dump(self, prep: Prepared, plan: DumpPlan, world: World, save_dir: str, events: EventLog,
                   progress: Callable[[], None], chunk_bytes: int) -> DumpResult: ...


class RankRecovery:
    """The rank side of every recovery. ``session``: the rank's session (options, events, the
    trainer and its hooks); nothing here keeps state across orders except the dump's prepared part.
    ``tools``: what the orders call beneath the session (None: the engine's own, ``engine``)."""

    def __init__(self, session: Session, tools: RecoveryTools | None = None) -> None:
        if tools is None:
            # (the engine and the torch it imports come with the processor's start, ahead of any fault:
            # not with this module, whose unit tests run on fakes)
            from mindspeed_ha.rank.recovery import engine
            tools = engine
        self.s = session
        self.tools: RecoveryTools = tools
        self.prepared: Prepared | None = None
        # a resize that did not complete: what the rank held before it (its state)
        self.unfinished: dict[str, dict[str, Any]] | None = None

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], object]]:
        return {action: self._poisoning(fn) for action, fn in {
            "ha-status": self.ha_status, "rebuild": self.rebuild, "repair": self.repair,
            "reload": self.reload, "rollback": self.rollback, "resume": self.resume, "scale-in": self.resize,
            "scale-out": self.resize, "dump-status": self.dump_status, "dump": self.dump}.items()}

    def _poisoning(self, fn: Callable[[dict[str, Any]], object]) -> Callable[[dict[str, Any]], object]:
        """``fn``, whose memory error marks this rank's shard poisoned before it fails the order, as one
        in a step does (``RankState.report``): the answer names the fault's kind, the controller starts
        over with it, and its next status plans the shard's repair from its twin (a rebuild that met a
        memory error and said nothing of the shard left it corrupt under a retry: every later loss NaN)."""
        def run(args: dict[str, Any]) -> object:
            handling = sys.exc_info()[1]  # (its context, not its cause: the step's fault, being handled)
            try:
                return fn(args)
            except Exception as e:
                if fault_kind(e, handling) == "memory-error":
                    self.s.shard_poisoned = True
                raise
        return run

    @property
    def message_bytes(self) -> int:
        """The largest message a repair, a reshard or the dump's resync sends (--ha-recovery-message-mib)."""
        return self.s.options.recovery_message_mib << 20

    @property
    def collective_timeout(self) -> datetime.timedelta:
        """Every group's collective timeout, a rebuilt or resized one's too: the job's own."""
        return datetime.timedelta(seconds=self.s.options.collective_timeout_s)

    @property
    def trainer(self) -> TrainerInterface:
        assert self.s.trainer is not None  # (the processor that serves these starts with a trainer attached)
        return self.s.trainer

    # ---- retry / recover / reload ------------------------------------------------------------
    def ha_status(self, args: dict[str, Any]) -> dict[str, Any]:
        if self.s.joining:  # restarted, not resumed yet (a fault came during its recovery): holds nothing
            return {"replica": True, "joining": True}
        if self.unfinished is not None:  # between two layouts: its state is what it held before the resize
            return self.unfinished["status"]
        try:
            self.s.fire("recovery", self.trainer.iteration + 1)
        except Exception as e:  # a fault of this rank while it serves the recovery: the controller
            self.s.report_fault_in_recovery(e)  # starts over with it (this answer still stands)
        aborted = self.s.stop.abort_summary()  # (the stop's abort of this rank's communicators: the phases')
        # (stopped, not parked between two steps: a planned pause's grace passed with this rank inside one)
        stopped = {"stopped_in_step": True} if self.s.stop.requested() else {}
        # (after the abort above has returned: what the controller reads to keep or remake each group)
        comm = self.tools.communicators(self.s.stop.in_flight.pending_groups())
        return {**self._status(), **({"abort": aborted} if aborted else {}), **stopped, "comm": comm}

    def _status(self) -> dict[str, Any]:
        # The newest periodic checkpoint, for when no twin can serve (no replicas, or both lost).
        newest = self.tools.newest_checkpoint(self.trainer.save_dir)
        found = {"ended": self.trainer.ended, "checkpoint": list(newest) if newest else None}
        if self.s.optimizer is None:  # --distributed-optimizer-no-replica
            return {"replica": False, **found}
        elastic = {"layout": self.layout()} if "elastic-training" in self.s.options.strategies else {}
        return {"replica": True, **self.tools.shard_status(self.trainer), **found, **elastic,
                "poisoned": self.s.shard_poisoned}

    def layout(self) -> dict[str, Any]:
        """What an elastic plan needs of the job's layout: this rank's data-parallel
        group (job ranks, in order), the batch sizes, the optimizer instance count, the number of
        pipeline stages and the expert-parallel size (MoE: that many replicas share the experts)."""
        topo = self.s.topology
        assert topo is not None  # (made with the replica optimizer, which _status checked)
        stages, experts = self.tools.parallel_sizes()
        return {"dp_ranks": [self.tools.job_rank(r) for r in topo.dp_ranks],
                "global_batch": int(self.trainer.global_batch_size), "micro_batch": int(self.trainer.micro_batch_size),
                "replica_num": int(topo.replica_num), "stages": stages, "experts": experts}

    def rebuild(self, args: dict[str, Any]) -> str:
        t0 = time.perf_counter()
        store = (args["store_host"], int(args["store_port"]), int(args["generation"]))
        if self.s.joining and self.trainer.optimizer is None:
            # A restarted worker: its groups, model and optimizer are made without peers (the
            # survivors wait here), then its groups connect with the survivors' new generation.
            self.s.join_marks.append(("rebuild", time.time()))
            with self.tools.joining(self.s.world_size, self.s.rank, self.s.device.backend, self.collective_timeout), \
                    self.tools.alone():
                self.trainer.setup(joining=True)
            setup_s = time.perf_counter() - t0
            got = self.tools.reconnect(*store, remake=args.get("remake"))
            self.s.joined(setup_s, getattr(self.trainer, "setup_seconds", None) or {}, got)
            self._rebuilt(got)
            return f"joined and set up in {time.perf_counter() - t0:.3f}s ({got['groups']} groups)"
        from mindspeed_ha.comm import groups
        step = self.trainer.iteration + 1
        self.s.stop.clear()
        self.s.device_ready(step)
        self.s.fire("rebuild", step)
        self.trainer.clean_partial_step()
        with groups.at_open_gates(lambda: self.s.fire("connect", step)):
            got = self.tools.reconnect(*store, remake=args.get("remake"))
        return self._rebuilt(got)

    def _rebuilt(self, got: dict[str, Any]) -> str:
        """The ``rebuilt`` event and the log line: the communicators kept and remade (each as its
        members' default-group ranks), and why each was remade."""
        self.s.events.emit("rebuilt", kept=got.get("kept", []), remade=got.get("remade", []), why=got.get("why", []),
                           seconds=got["seconds"])
        reasons = sorted(set(got.get("why", [])))
        line = (f"rebuild: {len(got.get('remade', []))} communicator(s) remade ({', '.join(reasons) or '-'}), "
                f"{len(got.get('kept', []))} kept, in {got['seconds']:.3f}s")
        log.info("%s", line)
        return line

    def repair(self, args: dict[str, Any]) -> dict[str, Any]:
        flat = list(args.get("pairs", []))
        pairs = list(zip(flat[0::2], flat[1::2]))
        receives = any(dst == self.s.rank for _, dst in pairs)

        def overwriting() -> None:  # (the shard is whole again only once the commit point below passed)
            self.s.shard_poisoned = True
        with self.tools.peak_memory() as mem:
            got = self.tools.transfer_shards(self.s.optimizer, pairs, self.s.rank, int(args["iteration"]), overwriting,
                                             self.message_bytes)
        flat = list(args.get("joiners", []))  # restarted rank, its twin, ...
        joiners = dict(zip(flat[0::2], flat[1::2]))
        received = self.tools.transfer_bookkeeping(self.trainer, joiners, self.s.rank) if joiners else None
        self.trainer.resync_weights()
        self.s.stop.commit_point("the repair")  # (a shard, counters or weights cut short are not whole)
        if received is not None:
            self.s.report_unlogged_step(self.trainer.ended, received["trainer"].get("step_loss"))
        if receives:
            self.s.shard_poisoned = False  # overwritten by its twin's
        if got:
            self.s.events.emit("repaired", iteration=int(args["iteration"]), bytes=got,
                               sources=[s for s, d in pairs if d == self.s.rank],
                               shard_bytes=self.tools.shard_bytes(self.s.optimizer), extra_mem_bytes=mem.bytes)
        return {"received": got}

    def reload(self, args: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        assert self.trainer.save_dir is not None  # (a reload plan needs every rank's checkpoint, in --save)
        it = self.trainer.load_checkpoint(self.trainer.save_dir)
        self.s.stop.commit_point("the reload")  # (the load's own collectives: none cut short)
        self.s.shard_poisoned = False
        self.trainer.after_reload(int(args.get("ended", it)))
        self.s.loaded(it, self.trainer.save_dir, time.perf_counter() - t0)
        return {"iteration": it}

    def rollback(self, args: dict[str, Any]) -> str:
        how = self.tools.resume_at(self.trainer, int(args["iteration"]))
        if args.get("ended_elsewhere"):
            self.trainer.peers_ended(int(args["iteration"]))
        if args.get("fresh_data"):  # a new layout: the data position at the new data-parallel rank and size
            self.trainer.restart_from(self.trainer.iteration)
        return how

    def resize(self, args: dict[str, Any]) -> dict[str, Any] | Later:
        """Scale in or out. Until the state has moved the rank is between two layouts: a fault then
        (a peer lost, a stop) leaves ``unfinished`` set — the rank answers the next status with what it
        held before, the controller plans again with every loss known, and the next resize moves
        that state. Only a completed resize clears it."""
        from mindspeed_ha.plan import ElasticPlan
        from mindspeed_ha.rank.processor.serving import Later
        self.s.stop.clear()
        # (a newcomer of Megatron-LM's loop has its groups only, no trainer's counters yet)
        self.s.device_ready(getattr(self.s.trainer, "iteration", -1) + 1)
        if self.unfinished is None:
            if self.trainer.optimizer is not None:
                self.trainer.clean_partial_step()
            status = {"replica": True, "joining": True} if self.s.joining else self._status()
            self.unfinished = {"held": self.tools.holdings(self.trainer), "status": {**status, "unfinished": True}}
        plan = ElasticPlan.from_wire(args["plan"])
        entered = self.tools.enter_layout(self.trainer, plan, self.s.rank, args["store_host"], int(args["store_port"]),
                                          int(args["generation"]), backend=self.s.device.backend,
                                          held=self.unfinished["held"], timeout=self.collective_timeout,
                                          remake=args.get("remake"))
        if entered.get("communicators"):
            t = entered["t"]
            self._rebuilt({**entered["communicators"], "seconds": round(t["resize"] - t["start"], 4)})

        def rest(trainer: TrainerInterface | None = None) -> dict[str, Any]:
            assert plan.iteration is not None  # (an ok plan names its iteration)
            self.s.fire("resize", plan.iteration + 1)
            out = self.tools.move_state(trainer or self.trainer, plan, self.s.rank, entered, self.message_bytes)
            self.s.events.emit("resized", iteration=plan.iteration, **out)
            self.unfinished = None
            wrote = self.s.writes_loss
            self.s.resized()
            if self.s.writes_loss and not wrote:
                # The writer before may have been lost after its last step ended job-wide and
                # before it logged that step; this rank's DP-reduced loss of it has the same bits.
                it, loss = self.s.last_step
                if it == self.trainer.ended:
                    self.s.report_unlogged_step(it, loss)
            return {**out, "replica_group": self.s.processor.groups[0] if self.s.processor else None}
        if self.trainer.optimizer is not None:
            return rest()
        # A newcomer whose loop builds its model itself (Megatron-LM's): the answer comes once it has
        # (the kept ranks wait in the state exchange meanwhile).
        later = Later()
        self.s.after_setup = lambda trainer: later.finish(lambda: rest(trainer))
        return later

    def resume(self, args: dict[str, Any]) -> str:
        self.s.resumed(int(args.get("lost_steps", 0)))
        return "resumed"

    # ---- the dump ----------------------------------------------------------------------------
    def dump_status(self, args: dict[str, Any]) -> dict[str, Any]:
        """Prepare this rank's part of the checkpoint (locally, while the job's groups exist) and
        report the shard's state for the controller's plan. A rank with nothing to save says so (the
        others save the job without it): restarted and still joining (Megatron-LM's loop may not
        even have built its model), or its shard corrupted by a memory error."""
        save = getattr(self.s.trainer, "save_dir", None)
        # (said by a rank that holds nothing too: where the job resumes if no dump can be made)
        newest = self.tools.newest_checkpoint(save) if save else None
        empty = {"holds": False, "fallback": list(newest) if newest else None}
        if self.s.joining:
            return {**empty, "why": "restarted, it holds no state yet"}
        if self.s.shard_poisoned:
            return {**empty, "why": "a memory error corrupted its optimizer shard"}
        if self.unfinished is not None:
            return {**empty, "why": "between two layouts (its elastic resize did not complete)"}
        if not save:
            raise RuntimeError("no --save directory: the dying-gasp checkpoint has nowhere to go")
        opt = self.s.optimizer
        if opt is None:
            raise RuntimeError("the dying-gasp checkpoint needs the replica optimizer "
                               "(--distributed-optimizer-no-replica is set)")
        # Stopped in its update window before touching the shard (a collective ahead of the Adam
        # arithmetic was interrupted): the shard is still at ha_iteration.
        abandon = bool(opt.ha_updating and not opt.ha_touched)
        self.prepared = self.tools.prepare_dump(self.trainer, abandon)
        st = {k: self.prepared.status[k] for k in ("iteration", "updating", "touched", "replica_group",
                                                   "trainer_iteration")}
        st.update(save=os.path.abspath(save), fallback=list(newest) if newest else None, abandoned=abandon,
                  bytes=self.prepared.bytes)
        unlogged = self.trainer.unlogged_loss()
        if unlogged is not None:  # (a dump that settles on that step prints it: no one else will)
            st["unlogged"] = {"iteration": int(unlogged[0]), "loss": float(unlogged[1]), "writer": self.s.writes_loss}
        return st

    def dump(self, args: dict[str, Any]) -> dict[str, Any]:
        from mindspeed_ha.plan import DumpPlan
        if self.prepared is None:
            raise RuntimeError("dump before dump-status")
        self.s.stop.clear()  # the stop that parked us (or a retry's) must not fail the survivors' ones
        self.s.device_ready(self.trainer.iteration + 1)
        plan = DumpPlan.from_wire(args["plan"])
        world = self.tools.survivor_world(list(args["survivors"]), self.s.rank, args["store_host"],
                                          int(args["store_port"]), int(args["generation"]), self.collective_timeout,
                                          self.s.device.backend)
        save = self.trainer.save_dir
        assert save is not None  # (dump_status, which prepared the dump, refuses a rank without one)
        res = self.tools.write_dump(self.prepared, plan, world, save, self.s.events, self.s.progressed,
                                    self.message_bytes)
        if args.get("log_loss") == self.s.rank:
            unlogged = self.trainer.unlogged_loss()
            if unlogged is not None and unlogged[0] == res.iteration:
                self.s.log_step_at_dump(*unlogged)
        return {"iteration": res.iteration, "path": res.path, "seconds": round(res.seconds, 4),
                "bytes": res.bytes, "save": os.path.abspath(save)}
