"""Optimizer state to a new data-parallel layout, point to point (elastic scale-in and scale-out).

A DistributedOptimizer's shard is, for each parameter it touches, one contiguous range of that
parameter's flattened elements (its fp32 main values and Adam's exp_avg and exp_avg_sq there). Those
ranges depend on the data-parallel size and the buffer's padding, so the new layout's ranges are
mapped to the old ones in *parameter coordinates* — (parameter key, start, end) — never in buffer
offsets: that stays right whatever the padding or bucketing of either layout.

``schedule`` is pure: from what each serving rank holds and what each rank of the new layout needs,
the pieces to move, each from exactly one holder, checked to tile every needed range before anything
moves. ``exchange`` moves them with one message per (source, destination) pair, every send and
receive posted at once (``batch_isend_irecv``), so pairs that swap pieces cannot deadlock.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Hashable, Iterable, Mapping

import torch
import torch.distributed as dist

from mindspeed_ha.device import current

Range = tuple[Hashable, int, int]  # (parameter key, start, end) of its flattened elements


class ReshardError(ValueError):
    pass


@dataclasses.dataclass(frozen=True, order=True)
class Move:
    src: int
    dst: int
    key: Hashable     # the parameter: (its TP/PP position, its name)
    start: int        # [start, end) of its flattened elements
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def schedule(held: Mapping[int, Iterable[Range]], wanted: Mapping[int, Iterable[Range]]) -> list[Move]:
    """``held``: serving rank -> [(key, start, end), ...], one holder per old shard (ranges of one key
    must not overlap). ``wanted``: rank of the new layout -> [(key, start, end), ...]. A rank that
    holds part of what it needs takes it from itself (a move with src == dst, copied locally).
    Sorted, so that both ends of a pair agree on the order of its pieces."""
    by_key = collections.defaultdict(list)
    for src, ranges in held.items():
        for key, a, b in ranges:
            by_key[key].append((int(a), int(b), src))
    for key, spans in by_key.items():
        spans.sort()
        for (a0, b0, s0), (a1, b1, s1) in zip(spans, spans[1:]):
            if a1 < b0:
                raise ReshardError(f"{key}: ranks {s0} and {s1} both serve elements [{a1}, {min(b0, b1)})")
    moves = []
    for dst, ranges in wanted.items():
        for key, a, b in ranges:
            at = int(a)
            for s, e, src in by_key.get(key, ()):
                if e <= at or s >= b:
                    continue
                if s > at:
                    raise ReshardError(f"{key}: no holder serves elements [{at}, {s}) that rank {dst} needs")
                moves.append(Move(src, dst, key, at, min(e, b)))
                at = min(e, b)
            if at < b:
                raise ReshardError(f"{key}: no holder serves elements [{at}, {b}) that rank {dst} needs")
    return sorted(moves, key=lambda m: (m.src, m.dst, str(m.key), m.start))


def exchange(moves: list[Move], rank: int, read: Callable[[Move], torch.Tensor],
             write: Callable[[Move, torch.Tensor], None], width: int = 3, dtype: torch.dtype = torch.float32,
             group: dist.ProcessGroup | None = None) -> int:
    """Carry out this rank's part of ``moves``. ``read(move)``: the piece as a [width, numel] tensor
    of ``dtype`` (the state tensors of the range: main values, exp_avg, exp_avg_sq); ``write(move,
    piece)`` installs one. Ranks are ranks of ``group``. Returns the bytes this rank received."""
    pairs = collections.defaultdict(list)
    for m in moves:
        if rank in (m.src, m.dst):
            pairs[(m.src, m.dst)].append(m)
    for m in pairs.pop((rank, rank), ()):
        write(m, read(m).clone())
    ops, inbox = [], []
    for (src, dst), ms in sorted(pairs.items()):
        if src == rank:
            flat = torch.cat([read(m).to(current(), dtype).reshape(-1) for m in ms])
            ops.append(dist.P2POp(dist.isend, flat, dst, group))
        else:
            buf = torch.empty(width * sum(m.numel for m in ms), dtype=dtype, device=current())
            ops.append(dist.P2POp(dist.irecv, buf, src, group))
            inbox.append((buf, ms))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    got = 0
    for buf, ms in inbox:
        got += buf.numel() * buf.element_size()
        at = 0
        for m in ms:
            write(m, buf[at:at + width * m.numel].view(width, m.numel))
            at += width * m.numel
    return got


def state_io(ranges: Mapping[Range, tuple[torch.Tensor, ...]]
             ) -> tuple[Callable[[Move], torch.Tensor], Callable[[Move, torch.Tensor], None]]:
    """``read`` and ``write`` for ``exchange`` over an optimizer's ``ha_state_ranges()``: read from
    the old optimizer's, write into the new one's."""
    by_key = collections.defaultdict(list)
    for (key, a, b), tensors in ranges.items():
        by_key[key].append((a, b, tensors))

    def find(m: Move) -> tuple[int, tuple[torch.Tensor, ...]]:
        for a, b, tensors in by_key.get(m.key, ()):
            if a <= m.start and m.end <= b:
                return a, tensors
        raise ReshardError(f"{m.key}: elements [{m.start}, {m.end}) are not in this rank's shard")

    def read(m: Move) -> torch.Tensor:
        a, tensors = find(m)
        return torch.stack([t.detach().reshape(-1)[m.start - a:m.end - a] for t in tensors])

    def write(m: Move, piece: torch.Tensor) -> None:
        a, tensors = find(m)
        with torch.no_grad():
            for t, row in zip(tensors, piece):
                t.reshape(-1)[m.start - a:m.end - a].copy_(row)

    return read, write


def described(ranges: Iterable[Range]) -> list[Range]:
    """What ``schedule`` needs of a rank's ``ha_state_ranges()``: [(key, start, end), ...]."""
    return sorted(ranges, key=lambda r: (str(r[0]), r[1]))
