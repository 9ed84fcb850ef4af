"""Process groups that keep their identity while their communicators are replaced.

Every group of the job — the default group and each one megatron-core creates — is a ``StableGroup``:
a torch ``ProcessGroup`` (torch's Python API and megatron-core use it like any other group) that
passes every call to an inner communicator. A recovery gives the groups new inner communicators
(``reconnect``) over the controller's store; whoever holds a group — megatron-core's parallel_state,
DDP and its buckets, the optimizer, model layers, the trainer — keeps the same object, so nothing has
to be found and re-pointed.

How a group meets its peers: over ``PrefixStore("mindspeed_ha/gen<G>/<key>/", store)``, where the
key names the group the same way in every member (its description, its ranks and how many such
groups came before) and the generation G is that of the store: 0 is the job's own rendezvous store,
each recovery brings a new one. Groups made during set-up (``seal`` ends it) are connected at once
on ``reconnect``, in the order they were made — the same in every process; groups made later connect
on their first use after a reconnect (their peers use them then too).

A restarted worker (``joining``) makes its groups without connecting anything: they connect in its
first ``reconnect``, together with the survivors'. The replaced communicators are released in the
background (``release``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import hashlib
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from mindspeed_ha import compat
from mindspeed_ha.comm import ledger as _ledger
from mindspeed_ha.comm.ledger import Ledger
from mindspeed_ha.device import backends

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # torch's own default for a group
# How long a rank waits to reach a recovery's store. Not a collective's timeout: every group keeps the
# job's (--distributed-timeout-minutes), rebuilt and resized ones too.
STORE_TIMEOUT = datetime.timedelta(seconds=60)


@dataclasses.dataclass
class _Generation:
    number: int
    store: "dist.Store | None"
    # Counts the stores this process has met in. A communicator belongs to one of them: a controller
    # that took over serves a store of its own and numbers its generations from 1 again, so the
    # number alone would pass an old communicator off as one of the new store's.
    serial: int = 0

    def enter(self, number: int, store: "dist.Store | None") -> None:
        self.number, self.store, self.serial = int(number), store, self.serial + 1


class GroupRegistry:
    """This process's groups, the store they meet over, and the communicators they replaced, on their
    way out. One per process (``_registry``): every recovery goes through it."""

    def __init__(self) -> None:
        self.gen = _Generation(0, None)
        self.groups: list[StableGroup] = []    # in creation order: the order every process connects them
        self.counts: dict[tuple, int] = {}     # (description, ranks) -> groups made so far
        self.sealed = 0                        # len(groups) when set-up ended
        self.joining = False
        self.job: tuple | None = None          # after an elastic resize: each default-group rank's job rank
        # (resize) old groups whose members all stay, by (description, job ranks, n); those the rebuild
        # keeps hold their communicator until the new layout makes them again (or its seal)
        self.reusable: dict[tuple, StableGroup] = {}
        self.lock = threading.RLock()
        # Communicators aborted already (a stop's abort, or ``end_all``): a retire does not abort them again.
        self.ended: weakref.WeakSet = weakref.WeakSet()
        self.retired: list = []                # replaced communicators, until a releasing thread drops each
        self.releasing: list[threading.Thread] = []  # the threads releasing them
        self.replaced = False                  # a communicator was replaced since the last before_fork
        self.hosted: dict = {}                 # TCPStore servers hosted here: one lives as long as its object

    # ---- the groups ---------------------------------------------------------------------------------
    def add(self, group: "StableGroup", first: bool = False) -> None:
        with self.lock:
            if first:
                self.groups.insert(0, group)
            else:
                self.groups.append(group)

    def number(self, desc: str, ranks: tuple) -> int:
        """How many groups of ``desc`` over ``ranks`` were made before this one."""
        with self.lock:
            n = self.counts.get((desc, ranks), 0)
            self.counts[(desc, ranks)] = n + 1
        return n

    def seal(self) -> None:
        with self.lock:
            self.sealed = len(self.groups)
            # (a resize: an old group the new layout did not make again gives up the communicator it kept)
            leftover = [g for g in self.reusable.values() if g._inner is not None]
            self.reusable.clear()
            self.end_all(leftover)
            for g in leftover:
                g._swap(None)

    def made_after_seal(self) -> list["StableGroup"]:
        with self.lock:
            return list(self.groups[self.sealed:]) if self.sealed else []

    def eager(self) -> list["StableGroup"]:
        """The groups a reconnect connects at once: those of the set-up (every one before a seal)."""
        return self.groups[:self.sealed] if self.sealed else list(self.groups)

    def job_rank(self, rank: int) -> int:
        return rank if self.job is None else self.job[rank]

    def dist_rank(self, job: int) -> int:
        return job if self.job is None else self.job.index(job)

    # ---- ending replaced communicators ----------------------------------------------------------------
    def retire(self, pg, backend: str) -> None:
        """End a replaced communicator before anything allocates its successor: NCCL's (and the emulated
        NCCL's) is aborted here, on this thread — ``ncclCommAbort`` frees its device buffers at once,
        where a destructor left to the releasing thread would free them while the new communicators
        allocate theirs. Gloo's holds sockets only, and its abort cannot wake a wait on a live peer:
        released as it is. HCCL: its "abort" stops the device (``device.restart_after_stop``), not
        one communicator: released as it is. One aborted already (``ended``) is released as it is."""
        if backends.abortable(backend) and pg not in self.ended:
            self.ended.add(pg)
            try:
                pg.abort()
            except Exception as e:  # (torn down already, e.g. a drill's broken link: nothing left to free)
                from mindspeed_ha.events import get_logger
                get_logger("comm.groups").debug("abort of a replaced %s communicator: %s", backend, e)

    def end_all(self, groups: Iterable["StableGroup"]) -> None:
        """Abort the communicators these groups are about to replace, all at once (``comm.abort``): one
        after another, an idle one's abort would wait for the device to drain a collective still held in
        another one that is not aborted yet. Bounded by the stop's deadline; one that does not return by
        then is left to its thread and its group replaced anyway."""
        from mindspeed_ha.comm import abort
        live = [g for g in groups
                if g._inner is not None and backends.abortable(g.backend) and g._inner not in self.ended]
        if not live:
            return
        named = []
        for g in live:
            self.ended.add(g._inner)
            named.append((g.group_desc, g._inner))
        report = abort.abort_all(named)
        if report.unfinished or report.failed:
            from mindspeed_ha.events import get_logger
            get_logger("comm.groups").warning("replacing communicators: %s", report.line())

    # ---- releasing them ---------------------------------------------------------------------------------
    def start_release(self) -> None:
        """A releasing thread for the communicator last put in ``retired`` (its only owner by now)."""
        self.replaced = True
        t = threading.Thread(target=self.release_one, name="mindspeed-ha-release", daemon=True)
        self.releasing[:] = [x for x in self.releasing if x.is_alive()] + [t]
        t.start()

    def release_one(self) -> None:
        """Drop one replaced communicator, on this thread. It may still hold a collective that a stop
        abandoned (a peer never joined it): its destructor then waits until that peer releases its copy
        too (the GIL is not held meanwhile). Every member releases at about the same time, so the wait
        is short; one thread per communicator, so no two waits depend on each other's order."""
        try:
            pg = self.retired.pop(0)
        except IndexError:
            return
        del pg  # the only reference: the destructor runs here

    def released(self, timeout: float, threads: list | None = None) -> bool:
        deadline = time.monotonic() + timeout
        for t in list(self.releasing if threads is None else threads):
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in (self.releasing if threads is None else threads))

    def before_fork(self) -> None:
        if self.replaced:
            self.replaced = False
            gc.collect()


class StableGroup(dist.ProcessGroup):
    """A process group whose communicator can be replaced (``_inner``); see the module's text."""

    def __init__(self, key: str, ranks: Sequence[int], group_rank: int, backend: str,
                 timeout: datetime.timedelta, desc: str, options=None):
        # torch's stub lists only the (store, rank, size) constructor; (rank, size) makes a group of no backend
        super().__init__(group_rank, len(ranks))  # type: ignore[call-arg]
        self.key, self.ranks, self.group_rank = key, tuple(ranks), group_rank
        self.backend, self.timeout, self._desc = backend, timeout, desc
        self.options = options  # the backend's options it was made with (Megatron's pg_options), every communicator's
        self._inner: dist.ProcessGroup | None = None
        self._inner_gen = -1
        self.ledger = Ledger()  # what the communicator in place carried (a recovery keeps it or remakes it)
        self._tracks_works = not backends.stream_ordered(backend)  # (a stream-ordered one's are the stop's)
        self.carried = ""  # kept through a resize: its communicator is the old layout's ("" : not, or why not)

    def rank(self) -> int:
        return self.group_rank

    def size(self) -> int:
        return len(self.ranks)

    # torch types the name as GroupName, its NewType over str (absent from older torch): the key is one
    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self.key

    @property
    def group_desc(self) -> str:
        return self._desc

    # Read-only here (torch's is settable): the group's communicators are replaced, none is bound to a device
    @property  # type: ignore[misc]
    def bound_device_id(self):
        return None

    # What the group is, answered without a communicator (a joiner's groups have none yet).
    @property
    def _device_types(self) -> list:
        return [torch.device(backends.device_type(self.backend))]

    def _get_backend_name(self) -> str:
        return self.backend

    def name(self) -> str:
        return self.backend

    def inner(self) -> dist.ProcessGroup:
        """The live communicator, connected now if this group has none for the current generation.
        (No local name may hold a replaced communicator: see ``_swap``.)"""
        if self._inner is None or self._inner_gen != _registry.gen.serial:
            with _registry.lock:
                if self._inner is None or self._inner_gen != _registry.gen.serial:
                    self._swap(None)  # (the old one ended before the new one allocates: see GroupRegistry.retire)
                    self._swap(_connect(self, _registry.gen))
        assert self._inner is not None  # (_swap put a communicator in place)
        return self._inner

    # Ending a communicator never connects one first.
    def abort(self) -> None:
        inner = self._inner
        if inner is not None:
            _registry.ended.add(inner)  # (first: a retire beside this abort does not abort it again)
            inner.abort()

    def shutdown(self) -> None:
        if self._inner is not None:
            self._inner.shutdown()

    def ended_with_device(self) -> None:
        """The device was stopped (HCCL's abort): the communicator ended with it, it cannot be kept."""
        if self._inner is not None:
            _registry.ended.add(self._inner)

    def _wait_for_pending_works(self) -> None:
        if self._inner is not None:
            self._inner._wait_for_pending_works()

    def set_timeout(self, timeout) -> None:
        self.timeout = timeout
        if self._inner is not None:
            self._inner.set_timeout(timeout)

    def _swap(self, new) -> None:
        """Put ``new`` in place; the replaced communicator is ended (``GroupRegistry.retire``) and goes to
        a releasing thread of its own, as its only owner: its destructor may wait for an abandoned
        collective (see ``GroupRegistry.release_one``) and must never run on the training thread."""
        if self._inner is not None:
            _registry.retire(self._inner, self.backend)
            _registry.retired.append(self._inner)
            self._inner = None
            _registry.start_release()
        self._inner, self._inner_gen = new, _registry.gen.serial
        self.ledger = Ledger()
        if self.carried == "kept":
            self.carried = "its members' order changed"

    def __repr__(self) -> str:
        return f"StableGroup({self._desc}, ranks={list(self.ranks)[:8]}{'...' if len(self.ranks) > 8 else ''})"


def _delegate(name: str):
    def call(self, *args, **kwargs):
        work = getattr(self.inner(), name)(*args, **kwargs)
        self.ledger.record(name, args, kwargs, work, track=self._tracks_works)
        return work
    call.__name__ = name
    return call


# Every method torch's ProcessGroup has goes to the inner communicator (its Python API calls group
# methods by name, so a Python-level override is what it uses), except the identity kept here.
for _name, _value in list(vars(dist.ProcessGroup).items()):
    if _name.startswith("__") or isinstance(_value, type) or _name.isupper() or _name in vars(StableGroup):
        continue
    if isinstance(_value, property):
        # (mypy infers no type for a lambda whose default argument binds the name)
        setattr(StableGroup, _name, property(lambda self, n=_name: getattr(self.inner(), n)))  # type: ignore[misc]
    elif callable(_value):
        setattr(StableGroup, _name, _delegate(_name))


def _key(desc: str, ranks: Sequence[int], n: int) -> str:
    text = f"{desc}|{','.join(map(str, ranks))}|{n}"
    return f"{desc[:40]}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def _connect(group: StableGroup, gen: _Generation) -> dist.ProcessGroup:
    """A communicator for ``group`` among its members over ``gen``'s store (blocks until every
    member has come), connected now, on this rank's device (NCCL's would otherwise connect in its
    first collective: after the recovery, outside its phases, where no stop can abort it)."""
    from mindspeed_ha.device import current
    if gen.store is None:
        raise RuntimeError(f"{group!r} has no store to connect over: the job has not joined yet")
    store = dist.PrefixStore(f"mindspeed_ha/gen{gen.number}/{group.key}/", gen.store)
    rank, size, timeout = group.group_rank, len(group.ranks), group.timeout
    _await_members(store, rank, size, timeout, group)
    return make_communicator(store, rank, size, group.backend, timeout, options=group.options,
                             device=current() if backends.stream_ordered(group.backend) else None)


def make_communicator(store, rank: int, size: int, backend: str, timeout: datetime.timedelta,
                      options: Any = None, device: torch.device | None = None) -> dist.ProcessGroup:
    """``compat.make_communicator``, and the emulated NCCL of drills over a gloo communicator."""
    acc = backends.accelerator(backend)
    if acc is not None and acc.wraps is not None:  # (the emulated NCCL: comm.emulated_nccl)
        from mindspeed_ha.comm.emulated_nccl import EmulatedNCCL
        emulated = EmulatedNCCL(compat.make_communicator(store, rank, size, acc.wraps, timeout), rank, size)
        if device is not None:
            emulated.eager_connect_single_device(device)
        return emulated
    return compat.make_communicator(store, rank, size, backend, timeout, options=options, device=device)


# How often a member looks for the others at a group's connection (``_await_members``).
_EAGER_S, _EAGER_PAUSE_S, _PATIENT_PAUSE_S = 0.05, 0.001, 0.005


def _await_members(store, rank: int, size: int, timeout: datetime.timedelta, group: StableGroup,
                   leave: Callable[[], None] | None = None) -> None:
    """Wait until every member has come to connect, leaving on a stop (``leave`` raises it) as a
    collective would: the backends' own connect blocks in C++ until its timeout when a member never
    comes (lost during the rebuild), and the controller, replanning with that loss, would wait in vain
    for this rank.

    A member that leaves must not leave another in that connect: one that came after it would find
    every member here and connect to a rank that has gone (a survivor of a rebuild whose peer failed
    its order sat there for the backend's whole timeout, deaf to the controller). So the connect has
    a gate in the store, opened by the first member to find all the others here, closed by the first
    that leaves before that; whichever comes first holds (``compare_set``): once it is open, every
    member connects (one stopped since connects too, its peers are connecting to it, and leaves at
    its next wait); once closed, none does, and each leaves at its own stop.

    Polled from 0.25 ms up to 1 ms between looks for the first 50 ms, then up to 5 ms: members
    arrive within a millisecond or two of one another, and every look past the last one's arrival
    is on the critical path of the whole layout, group after group (a rank that slept up to 5 ms
    there spent 10-13 ms more of a 4-rank resize's 0.1 s of groups, measured); a member that takes
    longer (a joiner still building) is looked for less often. (The store's own wait with a short
    timeout logs two warnings from C++ at every expiry.)"""
    from mindspeed_ha.comm.interruptible import PROCESS_STOP
    leave = leave or PROCESS_STOP.raise_if_stopped
    leave()  # (before it is known here: nobody may connect to a rank that never came)
    store.set(f"here/{rank}", b"1")
    keys = [f"here/{r}" for r in range(size)]
    now = time.monotonic()
    deadline, patient = now + timeout.total_seconds(), now + _EAGER_S
    pause = 0.00025
    gate = b""  # (as this rank last saw it: b"", b"open" or b"closed")
    while True:
        if not gate and store.check(keys):
            gate = store.compare_set("gate", "", "open")
            if gate == b"open":
                gate_opened()
                return
        try:
            leave()
        except BaseException:
            if gate or store.compare_set("gate", "", "closed") == b"closed":
                raise
            gate_opened()
            return  # (it opened meanwhile: connect, then leave)
        now = time.monotonic()
        if now > deadline:
            if gate:
                raise TimeoutError(f"{group!r}: a member left its connection on a stop, and none came here "
                                   f"within {timeout.total_seconds():.0f} s")
            missing = [r for r in range(size) if not store.check([f"here/{r}"])]
            raise TimeoutError(f"{group!r}: member(s) {missing} did not come within {timeout.total_seconds():.0f} s")
        time.sleep(pause)
        pause = min(2 * pause, _EAGER_PAUSE_S if now < patient else _PATIENT_PAUSE_S)


# Called as this rank passes a connection's open gate, before its backend connects: the fault drills'
# point ``phase=connect`` (a rank lost there leaves its peers in the backend's connect to it).
_at_gate: list[Callable[[], None]] = []


def gate_opened() -> None:
    for hook in _at_gate:
        hook()


@contextlib.contextmanager
def at_open_gates(hook: Callable[[], None]) -> Iterator[None]:
    """``hook`` runs each time this rank passes an open gate within the block (the drills' point)."""
    _at_gate.append(hook)
    try:
        yield
    finally:
        _at_gate.remove(hook)


def _register(group: StableGroup, backend: str, store) -> None:
    compat.register_group(group, backend, store, group.key, {g: i for i, g in enumerate(group.ranks)})


def _backend_name(backend) -> str:
    name = str(backend or "").lower()
    if not name or name == "undefined":
        default = compat.default_group()
        return default.backend if isinstance(default, StableGroup) else backends.canonical(dist.get_backend(default))
    return backends.canonical(name)


# ---- creation (re-routed here from torch.distributed by patches/torch/distributed.py) ---------------
def init_process_group(original, *args, **kwargs):
    """The job's default group as a StableGroup. Its first communicator is torch's own (the job's
    rendezvous); the store it met over is generation 0's. On a GPU it is bound to the rank's device
    (``device_id``, unless the caller named one: Megatron-LM does not): torch then connects it here,
    not inside its first collective, and sends its point-to-point messages on it, as the engine's
    own communicators do (``make_communicator``)."""
    from mindspeed_ha.device import current_accelerator
    backend = str(args[0] if args else kwargs.get("backend") or "")
    device_id = current_accelerator().group_device_id(backend)
    if device_id is not None and kwargs.get("device_id") is None:
        kwargs["device_id"] = device_id
    original(*args, **kwargs)
    real = compat.default_group()
    ranks = list(range(real.size()))
    backend = _backend_name(dist.get_backend(real))
    world = StableGroup("world", ranks, real.rank(), backend, kwargs.get("timeout") or DEFAULT_TIMEOUT, "default_pg",
                        kwargs.get("pg_options"))
    store = compat.group_store(real)
    compat.unregister_group(real)
    _registry.gen.enter(0, store)
    world._inner, world._inner_gen = real, _registry.gen.serial
    compat.set_default_group(world)
    _register(world, backend, store)
    _registry.add(world, first=True)


def new_group(original, ranks=None, timeout=None, backend=None, pg_options=None,
              use_local_synchronization=False, group_desc=None, device_id=None):
    """A StableGroup for every member (``NON_GROUP_MEMBER`` elsewhere), connected over the current
    generation's store at once (joining: at the first reconnect)."""
    world = compat.default_group()
    if not isinstance(world, StableGroup):  # the default group is torch's own: leave it all to torch
        return original(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                        use_local_synchronization=use_local_synchronization, group_desc=group_desc,
                        device_id=device_id)
    ranks = sorted(int(r) for r in ranks) if ranks else list(range(world.size()))
    desc = group_desc or "undefined"
    n = _registry.number(desc, tuple(ranks))
    me = world.rank()
    if me not in ranks:
        return c10d.GroupMember.NON_GROUP_MEMBER
    group = _registry.reusable.pop((desc, tuple(job_rank(r) for r in ranks), n), None)
    if group is not None:  # the same members as before a resize: the same object, renumbered
        if group._inner is not None and ranks.index(me) != group.group_rank:
            group._swap(None)  # (kept, but its members' order changed: the communicator's numbering would not follow)
        group.key, group.ranks, group.group_rank = _key(desc, ranks, n), tuple(ranks), ranks.index(me)
        group.options = pg_options
        if group._inner is not None:
            group._inner_gen = _registry.gen.serial  # (its communicator, kept through the resize)
    else:
        group = StableGroup(_key(desc, ranks, n), ranks, ranks.index(me), _backend_name(backend),
                            timeout or world.timeout, desc, pg_options)
    _register(group, group.backend, _registry.gen.store)
    _registry.add(group)
    if not _registry.joining:
        group.inner()
    return group


@contextlib.contextmanager
def joining(world_size: int, rank: int, backend: str, timeout: datetime.timedelta = DEFAULT_TIMEOUT):
    """A restarted worker's set-up: the default group and every group made inside exist, unconnected;
    ``reconnect`` connects them with the survivors'."""
    world = StableGroup("world", list(range(world_size)), rank, backend, timeout, "default_pg")
    compat.set_default_group(world)
    _register(world, backend, None)
    _registry.add(world, first=True)
    _registry.joining = True
    try:
        yield world
    finally:
        _registry.joining = False


def seal() -> None:
    """The job's set-up is over: the groups made so far are the ones every member reconnects at
    once on a recovery (in this order); later ones reconnect on first use."""
    _registry.seal()


def groups() -> list[StableGroup]:
    return list(_registry.groups)


def made_after_seal() -> list[StableGroup]:
    """The groups made since the job's set-up was sealed (made on first use: a model's, an optimizer's)."""
    return _registry.made_after_seal()


def communicators(pending: Iterable[object] = ()) -> dict[str, Any]:
    """Each group's communicator as this rank sees it, by the group's key (the same on every member):
    its count of collectives, its state where not idle, its messages to and from each peer, and its
    members (said by its first member only), peers and members as the job's ranks (``Ledger.said``).
    ``pending``: the groups with a stream-ordered collective in flight (``InFlight.pending_groups``)."""
    pending_ids = {id(g) for g in pending}
    out = _ledger.section()
    with _registry.lock:
        for g in _registry.groups:
            g.ledger.said(g.key, _state(g, pending_ids), [_registry.job_rank(r) for r in g.ranks],
                          g.group_rank == 0, out)
    return out


def _state(g: "StableGroup", pending_ids: set[int]) -> str:
    inner = g._inner
    if isinstance(inner, _Broken):
        return _ledger.BROKEN
    if inner is None or g._inner_gen != _registry.gen.serial:
        return _ledger.UNCONNECTED
    if inner in _registry.ended:
        return _ledger.ABORTED
    if id(g) in pending_ids:
        return _ledger.PENDING
    return _ledger.OPEN if g.ledger.open_works() else _ledger.OK


class KeptAborted(RuntimeError):
    """A group the rebuild keeps was aborted here after this rank said it was idle: its peers keep
    theirs, so the recovery cannot go on with it."""


def reconnect(store_host: str, store_port: int, generation: int,
              store_timeout: datetime.timedelta = STORE_TIMEOUT, *, remake: dict[str, str] | None = None) -> dict:
    """New communicators over the controller's store for the groups in ``remake`` (key -> why; None:
    every group), and for every group with none in place (a restarted worker's); every other group
    keeps its communicator. Every member calls it for the same generation with the same ``remake``;
    returns timings, and the groups kept and remade (each as its members' job ranks: the default
    group's until a resize renumbers it), for the recovery's log."""
    t0 = time.perf_counter()
    store = dist.TCPStore(store_host, store_port, None, False, timeout=store_timeout)
    reg = _registry
    with reg.lock:
        old = reg.gen.serial
        doomed = [g for g in reg.groups
                  if remake is None or g.key in remake or g._inner is None or g._inner_gen != old
                  or isinstance(g._inner, _Broken)]
        kept = [g for g in reg.groups if g not in doomed]
        aborted = [g for g in kept if g._inner in reg.ended]
        if aborted:
            raise KeptAborted(f"{len(aborted)} group(s) to keep were aborted here after the status: "
                              + ", ".join(repr(g) for g in aborted[:4]))
        reg.gen.enter(generation, store)
        for g in kept:
            g._inner_gen = reg.gen.serial
        eager = reg.eager()
        reg.end_all(doomed)  # (every doomed one at once, before any is replaced)
        for g in doomed:  # lazy ones drop theirs now: nothing may run on the old generation
            if g not in eager and g._inner is not None:
                g._swap(None)
        # One after another, in creation order (the same in every member). Gloo's groups connected from
        # a thread each (a store client each) took 15 s for 21 groups of 4 ranks here, against 0.07 s one
        # after another; NCCL's initialisation from several threads has not been run on a device.
        remade = [g for g in eager if g in doomed]
        for g in remade:
            g.inner()
    why = remake or {}
    return {"groups": len(remade), "lazy": len(reg.groups) - len(eager),
            "seconds": round(time.perf_counter() - t0, 4),
            "kept": [[reg.job_rank(r) for r in g.ranks] for g in kept],
            "remade": [[reg.job_rank(r) for r in g.ranks] for g in doomed],
            "why": [why.get(g.key, "all" if remake is None else "none in place") for g in doomed]}


class _Broken:
    """A torn-down communicator: every collective raises until the group is reconnected."""

    def __getattr__(self, name):
        from mindspeed_ha.faults import CommFault

        def fail(*args, **kwargs):
            raise CommFault("communicator torn down (gloo: connection closed)")
        return fail

    def abort(self) -> None:
        pass

    shutdown = _wait_for_pending_works = abort

    def set_timeout(self, timeout) -> None:
        pass


def break_communicators() -> int:
    """Fault drills (``comm``): tear down every communicator of this process — its peers see their
    connections close — and make this rank's next collective fail, as a broken link would.
    Returns how many groups were broken."""
    with _registry.lock:
        live = [g for g in _registry.groups if g._inner is not None]
        _registry.end_all(live)
        for g in live:
            g._swap(_Broken())
    return len(live)


def current_store():
    """(store, generation): where this process's groups meet now."""
    return _registry.gen.store, _registry.gen.number


@dataclasses.dataclass(frozen=True)
class World:
    """A default group of some of the job's ranks: ``ranks[i]`` is the job's rank of new rank ``i``."""
    ranks: tuple
    rank: int          # this process's rank in the job

    @property
    def new_rank(self) -> int:
        return self.ranks.index(self.rank)

    def original(self, new_rank: int) -> int:
        return self.ranks[new_rank]


def survivor_world(survivors: Sequence[int], rank: int, store_host: str, store_port: int, generation: int,
                   timeout: datetime.timedelta = DEFAULT_TIMEOUT, backend: str = "gloo",
                   host_rank: int | None = None, store_timeout: datetime.timedelta = STORE_TIMEOUT) -> World:
    """The default group becomes one of ``survivors`` only, numbered in that order: the dump's
    writers save with megatron-core's dist_checkpointing, which knows the default group only. The
    job's other groups stay (they still answer rank() and size(), so a sharded state dict built
    before describes the job's layout), but nothing may run a collective on them any more.
    ``timeout``: the group's (the job's collective timeout); ``host_rank``: the survivor that serves
    the store (None: served elsewhere, by the controller)."""
    survivors = [int(r) for r in survivors]
    if rank not in survivors:
        raise ValueError(f"rank {rank} is not among the survivors {survivors}")
    hosted = _registry.hosted
    if host_rank == rank and (store_host, store_port) not in hosted:
        from mindspeed_ha.comm.stores import serve
        hosted[(store_host, store_port)] = serve(store_host, store_port, len(survivors), store_timeout)
    store = hosted.get((store_host, store_port)) or dist.TCPStore(store_host, store_port, None, False,
                                                                   timeout=store_timeout)
    world = StableGroup(f"survivors-{generation}", list(range(len(survivors))), survivors.index(rank), backend,
                        timeout, "survivors")
    with _registry.lock:
        _registry.gen.enter(generation, store)
        compat.set_default_group(world)
        _register(world, backend, store)
    world.inner()
    return World(tuple(survivors), rank)


def new_epoch(kept: Sequence[int], rank: int, store_host: str, store_port: int, generation: int,
              timeout: datetime.timedelta = DEFAULT_TIMEOUT, backend: str = "gloo",
              host_rank: int | None = None, remake: dict[str, str] | None = None) -> World:
    """A new layout (elastic resize): the default group becomes ``kept`` (job ranks) in that order,
    and every group of the old layout is unregistered. The groups made next (megatron-core's,
    initialised again, with ``timeout``: the job's collective timeout, which they take from the default
    group) are the new layout's set-up; ``seal`` ends it. One of them with the same description and the
    same members as an old one (a TP group of a kept replica) *is* that old object, renumbered: the
    model's layers hold it and keep working, nothing has to find and re-point them; unless ``remake``
    (key -> why; None: every group) names it, it keeps its communicator too. Every other old group's
    communicator is released. Call before ``parallel_state.destroy_model_parallel`` (which then
    destroys nothing: the old groups are no longer registered, and destroying one would connect it)."""
    kept_set = set(int(r) for r in kept)
    reg = _registry
    with reg.lock:
        seen: dict[tuple, int] = {}
        reg.reusable.clear()
        holding = []
        for g in reg.groups:
            members = tuple(job_rank(r) for r in g.ranks)
            n = seen.get((g._desc, members), 0)
            seen[(g._desc, members)] = n + 1
            g.carried = ""
            if g._desc not in ("default_pg", "survivors") and set(members) <= kept_set:
                reg.reusable[(g._desc, members, n)] = g
                if remake is not None and g.key not in remake and g._inner is not None:
                    if not _keepable(g):
                        raise KeptAborted(f"{g!r}: the resize keeps its communicator, aborted here after the status")
                    holding.append(g)
                    g.carried = "kept"
                else:
                    g.carried = "all" if remake is None else remake.get(g.key, "none in place")
        doomed = [g for g in reg.groups if g not in holding]
        reg.end_all(doomed)  # (every old one at once, before any is replaced)
        for g in reg.groups:
            if g._inner is not None and g not in holding:
                g._swap(None)
            compat.unregister_group(g)
        reg.groups.clear()
        reg.counts.clear()
        reg.sealed = 0
    world = survivor_world(kept, rank, store_host, store_port, generation, timeout, backend, host_rank)
    with reg.lock:
        reg.add(compat.default_group(), first=True)
        reg.job = tuple(int(r) for r in kept)
    return world


def _keepable(g: StableGroup) -> bool:
    """``g`` has a communicator of the current generation, not aborted and not broken."""
    return (g._inner is not None and g._inner_gen == _registry.gen.serial and not isinstance(g._inner, _Broken)
            and g._inner not in _registry.ended)


def layout_communicators() -> dict:
    """After a resize's set-up: the new layout's groups whose communicator was kept through it and those
    made anew, each as its members' job ranks (``reconnect``'s answer, for the ``rebuilt`` event)."""
    with _registry.lock:
        kept = [g for g in _registry.groups if g.carried == "kept"]
        made = [g for g in _registry.groups if g.carried != "kept"]
        return {"kept": [[job_rank(r) for r in g.ranks] for g in kept],
                "remade": [[job_rank(r) for r in g.ranks] for g in made],
                "why": [g.carried or "a group of the new layout" for g in made]}


def job_rank(rank: int) -> int:
    """The job's rank (what the controller, the events and the launcher call a rank) of ``rank`` of
    the default group: the same number until an elastic resize renumbers the default group."""
    return _registry.job_rank(rank)


def dist_rank(job: int) -> int:
    """The default group's rank of the job's rank ``job``."""
    return _registry.dist_rank(job)


def before_fork() -> None:
    """After communicators were replaced (a recovery, a resize), destroy here and now whatever of
    the old ones nothing holds any more (a resized model's, an old optimizer's, waiting in a
    reference cycle for the collector), before this process forks (a DataLoader's workers). A fork
    shares this process's sockets and its gloo loop's epoll set; were its own collector to run such
    a destructor, it would shut those sockets down and unregister them under this process: its
    peers would see the connections close, and its own destructor, later, would abort on the
    missing registration (gloo: "epoll_ctl: No such file or directory")."""
    _registry.before_fork()


# ---- release of replaced communicators -----------------------------------------------------------
def releasing() -> list:
    """The threads releasing replaced communicators now (to wait for those of one recovery only)."""
    return [t for t in _registry.releasing if t.is_alive()]


def released(timeout: float, threads: list | None = None) -> bool:
    """Wait up to ``timeout`` seconds for every replaced communicator (or those ``threads`` release)
    to be gone; True if they are. (A process must not exit while one is half destroyed: its threads
    would be torn down under it.) One can stay for good: a collective abandoned by a stop in which
    two survivors wait for each other (neither's peer is the rank that never joined) holds its
    communicator until the process ends — a thread and a communicator's sockets, not more."""
    return _registry.released(timeout, threads)


_registry = GroupRegistry()
