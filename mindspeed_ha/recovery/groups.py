"""Rebuild torch.distributed's default group in process, over a fresh TCPStore.

Two uses:

* ``survivor_world`` — after a fault, the live ranks form a new, smaller default group so that
  dist_checkpointing (which only knows the default group) can save with them alone. Megatron-core's
  parallel_state is left as it was: its getters call ``group.rank()`` / ``group.size()`` on the old
  ProcessGroup objects, which still answer locally after the old world is torn down, so sharded
  state dicts keep describing the original layout (keys, DP offsets) — exactly what the checkpoint
  must contain. Nothing may run a collective on those old groups any more.
* ``rebuild_in_place`` — the same world (same ranks, same order) gets fresh communicators, e.g. after
  a rank was replaced; parallel_state is re-initialised and every ProcessGroup reachable from the
  model chunks and the optimizer is re-pointed to the new group with the same ranks and description.

Who hosts the store matters: a store served by a rank that dies takes the new world down with it, so
the host and port are parameters (a survivor, the launcher agent, or the controller's host).
A ``generation`` number prefixes every key so that a store can serve successive rebuilds.
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

# The TCPStore servers this process hosts: a server lives as long as its Python object.
_hosted: dict[tuple[str, int], "dist.TCPStore"] = {}


@dataclasses.dataclass(frozen=True)
class World:
    """A default group built here. ``ranks[i]`` is the *original* global rank of new rank ``i``."""
    ranks: tuple
    rank: int          # this process's original global rank
    generation: int
    store_host: str
    store_port: int

    @property
    def new_rank(self) -> int:
        return self.ranks.index(self.rank)

    def original(self, new_rank: int) -> int:
        return self.ranks[new_rank]


def _store(host: str, port: int, is_host: bool, size: int, timeout: timedelta) -> "dist.Store":
    key = (host, port)
    if is_host:
        if key not in _hosted:
            _hosted[key] = dist.TCPStore(host, port, size, is_master=True, timeout=timeout,
                                         wait_for_workers=False)
        return _hosted[key]
    return dist.TCPStore(host, port, size, is_master=False, timeout=timeout)


def _new_default_group(ranks: Sequence[int], rank: int, store_host: str, store_port: int, generation: int,
                       host_rank: int | None, timeout: timedelta, backend: str) -> World:
    ranks = tuple(int(r) for r in ranks)
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not among the ranks of the new group {list(ranks)}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"duplicate ranks in {list(ranks)}")
    store = _store(store_host, store_port, host_rank == rank, len(ranks), timeout)
    prefixed = dist.PrefixStore(f"mindspeed_ha/gen{generation}/", store)
    dist.init_process_group(backend, store=prefixed, rank=ranks.index(rank), world_size=len(ranks),
                            timeout=timeout)
    return World(ranks, rank, generation, store_host, store_port)


def _drop_default_group() -> None:
    # Local for gloo: no message to (possibly dead) peers. ProcessGroup objects still referenced
    # elsewhere (parallel_state, DDP, optimizer) stay valid Python objects for rank()/size().
    from torch.distributed import distributed_c10d as c10d
    for pg in list(c10d._world.pg_map.keys()):
        _retire(pg)
    if dist.is_initialized():
        dist.destroy_process_group()


def has_retired_groups() -> bool:
    return bool(_retired)


def exit_now(code: int = 0) -> None:
    """End the process without running the retired groups' destructors (see ``_retired``)."""
    import logging
    import multiprocessing
    import os
    import sys
    for child in multiprocessing.active_children():  # e.g. the checkpoint writer's manager
        child.terminate()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(code)


def survivor_world(survivors: Sequence[int], rank: int, store_host: str, store_port: int, generation: int,
                   host_rank: int | None = None, timeout: timedelta = timedelta(seconds=60),
                   backend: str = "gloo") -> World:
    """Replace the default group by one of ``survivors`` (original global ranks, in new-rank order).

    Every survivor calls it with the same arguments. ``host_rank``: the survivor that serves the
    TCPStore at store_host:store_port (None: served by someone else, e.g. the controller's host).
    """
    _drop_default_group()
    return _new_default_group(survivors, rank, store_host, store_port, generation, host_rank, timeout, backend)


# -- in-place rebuild: re-point every reference ---------------------------------------------------
def _is_pg(x) -> bool:
    return isinstance(x, dist.ProcessGroup)


def _walk(obj, fn, seen: set) -> None:
    """Visit every attribute / container slot below ``obj``; ``fn(value) -> replacement or None``."""
    if id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        slots = list(obj.items())
        setter = obj.__setitem__
    elif isinstance(obj, list):
        slots = list(enumerate(obj))
        setter = obj.__setitem__
    elif isinstance(obj, tuple):
        for v in obj:  # tuples cannot be patched; groups inside them are not expected in megatron
            _walk(v, fn, seen)
        return
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj) or isinstance(obj, torch.nn.Module):
        slots = list(vars(obj).items())
        setter = lambda k, v, o=obj: setattr(o, k, v)  # noqa: E731
    else:
        return
    for k, v in slots:
        if _is_pg(v):
            new = fn(v)
            if new is not None:
                setter(k, new)
        else:
            _walk(v, fn, seen)


_KEYS: dict[int, tuple] = {}  # id(group) -> key, remembered while the group was registered
# Replaced groups, kept alive on purpose: an operation interrupted by a stop stays pending inside
# its group, and gloo's ProcessGroup destructor waits for it — forever, when the peer that never
# joined keeps its own old group alive too. Seen: a rank hung when the exception that had parked it
# (whose frames held the last reference to the old group) was released. The process ends with
# ``exit_now`` instead of a finalizer that would run those destructors; and each one holds an extra
# reference that nothing releases, so that an exit we don't control (a user's script under
# ``import mindspeed_ha.megatron_adaptor``) does not run them either.
_retired: list = []


def _retire(pg) -> None:
    import ctypes
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
    _retired.append(pg)


def _pg_key(pg) -> tuple:
    """(ranks, description): how a group is matched with its new generation. Remembered, because a
    group destroyed by a communication fault no longer answers ``get_process_group_ranks``."""
    try:
        key = tuple(dist.get_process_group_ranks(pg)), getattr(pg, "group_desc", "")
    except Exception:
        if id(pg) in _KEYS:
            return _KEYS[id(pg)]
        raise
    _KEYS[id(pg)] = key
    return key


def remember(roots: Sequence[object]) -> int:
    """Record the key of every group reachable from ``roots`` (call once they exist)."""
    return len(_collect(roots))


def _walk_all(roots, fn) -> None:
    seen: set = set()
    for r in roots:
        _walk(r, lambda pg: fn(pg) and None, seen)


def _collect(roots, seen=None) -> dict[int, tuple]:
    found: dict[int, tuple] = {}

    def note(pg):
        found.setdefault(id(pg), _pg_key(pg))
        return None
    for r in roots:
        _walk(r, note, seen if seen is not None else set())
    return found


def rebuild_in_place(world_size: int, rank: int, store_host: str, store_port: int, generation: int,
                     roots: Sequence[object], init_parallel: Callable[[], None], host_rank: int | None = 0,
                     timeout: timedelta = timedelta(seconds=60), backend: str = "gloo") -> int:
    """Fresh communicators for the same world; returns how many references were re-pointed.

    ``roots``: the objects holding groups (DDP model chunks, the optimizer, the trainer's
    ProcessGroupCollection...). ``init_parallel``: re-runs ``parallel_state.initialize_model_parallel``
    with the original arguments (called after the new default group exists).
    """
    from megatron.core import parallel_state as ps

    old = _collect(roots)  # ranks and descriptions, read while the old groups are still registered
    _walk_all(roots, _retire)
    ps.destroy_model_parallel()
    _drop_default_group()
    _new_default_group(range(world_size), rank, store_host, store_port, generation, host_rank, timeout, backend)
    init_parallel()
    fresh = {}
    for name, value in vars(ps).items():  # every group parallel_state just created
        for pg in (value if isinstance(value, (list, tuple)) else [value]):
            if _is_pg(pg):
                fresh.setdefault(_pg_key(pg), pg)
    fresh.setdefault((tuple(range(world_size)), getattr(dist.group.WORLD, "group_desc", "")), dist.group.WORLD)
    count = 0
    missing = set()

    def swap(pg):
        nonlocal count
        key = old.get(id(pg))
        if key is None:
            return None  # a group created after _collect (a new one): leave it
        new = fresh.get(key) or next((g for k, g in fresh.items() if k[0] == key[0]), None)
        if new is None:
            missing.add(key)
            return None
        count += 1
        return new
    seen: set = set()
    for r in roots:
        _walk(r, swap, seen)
    if missing:
        raise RuntimeError(f"no new group with the ranks/description of {sorted(missing)}")
    stale = set(old) & set(_collect(roots))
    if stale:  # e.g. a group held inside a tuple, which cannot be patched in place
        raise RuntimeError(f"{len(stale)} old process group(s) still reachable after the rebuild")
    return count
