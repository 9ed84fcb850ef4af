"""In-place restore of a live job (retry, recover): every process keeps running. "Repair" is one part
of it, a shard copied from its twin (``transfer_shards``).

The rank handlers (rank/recovery/handlers.py) call these on the training thread for the controller's
rounds, after every rank has left its collective and the groups have new communicators: the broken
or lagging shards come from their twins (``transfer_shards``), a restarted rank also gets its twin's
counters, scheduler and RNG (``transfer_bookkeeping``), and every rank goes back to the start of the
failed step or finishes it (``resume_at``). Training is driven only through the trainer interface.

Which iteration: the controller plans it like the dump (``mindspeed_ha.plan``): the newest
iteration every optimizer shard has a healthy holder for. Shards behind it (a rank stopped before
touching its shard while its twin finished the update) or poisoned (the memory error) are copied
from a holder at that iteration. If that is the iteration the trainer had completed, the failed
step is recomputed (RNG and data position back to its start); if it is one past it, the update of
the failed step had finished everywhere, so only its bookkeeping is finished.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from mindspeed_ha.device import current
from mindspeed_ha.events import get_logger
from mindspeed_ha.replica.reshard import CHUNK_BYTES
from mindspeed_ha.trainer_state import rng

if TYPE_CHECKING:
    from mindspeed_ha.replica.optimizer import ReplicaMixin
    from mindspeed_ha.trainer_state.interface import TrainerInterface

log = get_logger("repair")


class RestoreError(RuntimeError):
    pass


def local_status(trainer: TrainerInterface) -> dict[str, Any]:
    """This rank's shard for the plan (``mindspeed_ha.plan``): a few scalars and its replica group,
    whatever the job's size."""
    from mindspeed_ha.comm.groups import job_rank
    opt = trainer.optimizer
    topo = getattr(opt, "ha_topology", None)
    rank = dist.get_rank() if topo is None else topo.rank
    return {"rank": job_rank(rank), "iteration": int(getattr(opt, "ha_iteration", trainer.iteration)),
            "updating": bool(getattr(opt, "ha_updating", False)), "touched": bool(getattr(opt, "ha_touched", True)),
            "replica_group": [job_rank(r) for r in (topo.replica_group if topo else [rank])],
            "trainer_iteration": trainer.iteration}


def status(trainer: TrainerInterface) -> dict[str, Any]:
    """The shard's state for the plan (as the dump reports it) plus the last step that ended."""
    return {**local_status(trainer), "ended": trainer.ended}


# A repair's receiver writes each message into the shard it is replacing (it is being overwritten
# anyway), so a repair allocates one message (at most CHUNK_BYTES by default) beside the state on
# either side, whatever the shard's size.


def transfer_shards(optimizer: ReplicaMixin, pairs: list[tuple[int, int]], rank: int, iteration: int,
                    overwriting: Callable[[], None] = lambda: None, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Point to point over the rebuilt default group: for each (src, dst) (job ranks), src sends its
    shard state (fp32 main params and the optimizer's state for them, its step counts and loss
    scaler: ``ReplicaMixin.ha_export_shard``), dst overwrites its own in place. Every rank walks the
    pairs in the same order. The state travels as its bytes, in messages of at most ``chunk_bytes``
    on the rank's device (Adam's ``step`` is a CPU scalar, which an NCCL group cannot carry: it is
    staged through the message) and lands where the receiver keeps it. ``overwriting()`` is called
    before the receiver's shard is first written (from then on it is not whole until the caller's
    commit point). Returns the bytes this rank received."""
    from mindspeed_ha.comm.groups import dist_rank
    # A window stopped before its arithmetic is closed first: the shard (the loss scaler with it) is
    # then wholly at ha_iteration, what it sends or what a copy overwrites.
    optimizer.ha_abandon_update()
    got = 0
    for src, dst in pairs:
        if rank not in (src, dst):
            continue
        optimizer.ha_ensure_state()
        shard = optimizer.ha_export_shard()  # (live views: written in place on the receiver)
        if rank == dst:
            overwriting()
        got += move_bytes(list(shard.values()), sending=rank == src, peer=dist_rank(dst if rank == src else src),
                           chunk_bytes=chunk_bytes)
        if rank == dst:
            optimizer.ha_import_shard(shard)  # (what is not a live view: step counts, the loss scaler)
    if any(dst == rank for _, dst in pairs):
        optimizer.ha_iteration = iteration
    return got


def shard_bytes(optimizer: ReplicaMixin) -> int:
    """What a repair moves to each receiver: this rank's shard state, in bytes."""
    return sum(t.numel() * t.element_size() for t in optimizer.ha_export_shard().values() if torch.is_tensor(t))


def _byte_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's bytes, a view of it (every shard tensor is contiguous: a flat slice or its own)."""
    out = []
    for t in tensors:
        if not t.is_contiguous():
            raise RestoreError(f"a shard tensor of shape {tuple(t.shape)} is not contiguous: it cannot be written in place")
        out.append(t.reshape(-1).view(torch.uint8))
    return out


def move_bytes(tensors: list[torch.Tensor], sending: bool, peer: int, chunk_bytes: int) -> int:
    """Send ``tensors``' bytes to ``peer``, or receive the peer's into them, in messages of at most
    ``chunk_bytes`` (one buffer of that size on the rank's device; a tensor larger than a message
    spans several). Both ends walk the same sizes in the same order. Returns the bytes received."""
    views = _byte_views(tensors)
    total = sum(v.numel() for v in views)
    buf = torch.empty(min(chunk_bytes, total), dtype=torch.uint8, device=current())
    got, i, off = 0, 0, 0  # the next byte to move: tensor i, at offset off
    for start in range(0, total, chunk_bytes):
        n = min(chunk_bytes, total - start)
        pieces, fill = [], 0
        while fill < n:
            take = min(views[i].numel() - off, n - fill)
            pieces.append((views[i][off:off + take], fill))
            fill, off = fill + take, off + take
            if off == views[i].numel():
                i, off = i + 1, 0
        msg = buf[:n]
        if sending:
            for piece, at in pieces:
                msg[at:at + piece.numel()].copy_(piece)
            dist.send(msg, peer)
        else:
            dist.recv(msg, peer)
            for piece, at in pieces:
                piece.copy_(msg[at:at + piece.numel()])
            got += n
    return got


def transfer_bookkeeping(trainer: TrainerInterface, joiners: dict[int, int], rank: int) -> dict[str, Any] | None:
    """``joiners``: restarted rank (or one whose step ended past the repair's iteration) -> the twin
    that sends it what is not in the optimizer shard: the trainer's counters, scheduler and pending
    loss, the RNG now and as of recent iterations (so that ``resume_at`` rolls back or forward exactly
    as on the twin). Returns what this rank received."""
    from mindspeed_ha.comm.groups import dist_rank
    received: dict[str, Any] | None = None
    for dst, src in sorted(joiners.items()):
        if rank == src:
            box: list[Any] = [{"trainer": trainer.bookkeeping(), "rng_now": rng.snapshot(),
                               "rng": trainer.rng.export()}]
            dist.send_object_list(box, dist_rank(dst))
        elif rank == dst:
            box = [None]
            dist.recv_object_list(box, dist_rank(src))
            received = box[0]
            trainer.install_bookkeeping(received["trainer"])
            rng.restore(received["rng_now"])
            trainer.rng.install(received["rng"])
    return received


def resume_at(trainer: TrainerInterface, iteration: int) -> str:
    """Rollback (the failed step will be recomputed) or roll forward (its update is done: finish
    its bookkeeping and report its loss). Returns which."""
    if trainer.ended == iteration:
        state = trainer.rng.at(iteration)
        if state is None:
            raise RestoreError(f"no RNG snapshot of iteration {iteration}: cannot recompute step {iteration + 1}")
        rng.restore(state)
        trainer.restart_from(iteration)
        return "rollback"
    if trainer.ended + 1 == iteration:
        trainer.finish_step(iteration)
        if trainer.rng.at(iteration) is None:
            # Its own update did not finish here (the shard came from its twin), so its end was never
            # recorded. A roll-forward means every rank ran the step's forward and backward and nothing
            # has drawn since: the RNG now is the RNG as of its end — the next rollback starts there.
            trainer.rng.record(iteration)
        return "roll-forward"
    raise RestoreError(f"trainer at iteration {trainer.iteration} (last step ended {trainer.ended}) "
                      f"cannot resume at {iteration}")
