"""The gloo communicators of a process share its gloo devices (``compat.gloo_options``): made once,
not once per communicator (10 ms each here, most of a recovery's reconnection of its groups)."""
from __future__ import annotations

import datetime
import multiprocessing
import threading

import torch
import torch.distributed as dist

from mindspeed_ha import compat

TIMEOUT = datetime.timedelta(seconds=30)


def _all_reduce_on_two_members(store) -> list[float]:
    """Two members of one communicator, each a thread of this process, both on its shared device."""
    out = [0.0, 0.0]

    def member(rank: int) -> None:
        pg = compat.make_communicator(store, rank, 2, "gloo", TIMEOUT)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=pg)
        out[rank] = float(t)
    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_communicators_share_the_process_devices_and_work():
    first = compat.gloo_options(TIMEOUT)._devices
    again = compat.gloo_options(TIMEOUT)._devices
    assert len(first) == 1 and first[0] is again[0], "each communicator made its own device"
    # Several communicators on the one device, connecting members that share it too, all work.
    for _ in range(3):
        assert _all_reduce_on_two_members(dist.HashStore()) == [3.0, 3.0]
    one = compat.make_communicator(dist.HashStore(), 0, 1, "gloo", TIMEOUT)
    t = torch.ones(2)
    dist.all_reduce(t, group=one)
    assert t.tolist() == [1.0, 1.0]


def _child(parents, q) -> None:
    try:
        mine = compat.gloo_options(TIMEOUT)._devices
        one = compat.make_communicator(dist.HashStore(), 0, 1, "gloo", TIMEOUT)
        t = torch.ones(1)
        dist.all_reduce(t, group=one)
        q.put((any(d is p for d in mine for p in parents), float(t)))
    except Exception as e:  # (the parent says what failed)
        q.put(repr(e))


def test_a_forked_child_makes_devices_of_its_own():
    """A device's event loop is a thread of the process that made it: a fork's child, which has not
    that thread, must not use its parent's."""
    parents = compat.gloo_options(TIMEOUT)._devices
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(parents, q))
    p.start()
    got = q.get(timeout=60)
    p.join(30)
    assert got == (False, 1.0), got
