"""Optimizer state to a new data-parallel layout, point to point (elastic scale-in and scale-out).

A DistributedOptimizer's shard is, for each parameter it touches, one contiguous range of that
parameter's flattened elements (its fp32 main values and Adam's exp_avg and exp_avg_sq there). Those
ranges depend on the data-parallel size and the buffer's padding, so the new layout's ranges are
mapped to the old ones in *parameter coordinates* — (parameter key, start, end) — never in buffer
offsets: that stays right whatever the padding or bucketing of either layout.

``schedule`` is pure: from what each serving rank holds and what each rank of the new layout needs,
the pieces to move, each from exactly one holder, checked to tile every needed range before anything
moves. ``exchange`` moves them pair by pair in one global order, in messages of bounded size written
into the new state as they arrive.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Hashable, Iterable, Mapping

import torch
import torch.distributed as dist

from mindspeed_ha.device import current

Range = tuple[Hashable, int, int]  # (parameter key, start, end) of its flattened elements
Rows = torch.Tensor | tuple[torch.Tensor, ...]  # a piece of state: one row per state tensor


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


# What one recovery message carries at most by default (--ha-recovery-message-mib: a reshard's, a
# repair's and the dump resync's): a move larger than that is cut into pieces, and a rank never
# holds more than one message beside the state it moves.
CHUNK_BYTES = 64 << 20


def _cut(moves: list[Move], elems: int) -> list[Move]:
    """``moves`` cut into pieces of at most ``elems`` elements each, in order (both ends cut alike)."""
    return [dataclasses.replace(m, start=a, end=min(m.end, a + elems)) for m in moves
            for a in range(m.start, m.end, elems)]


def exchange(moves: list[Move], rank: int, read: Callable[[Move], Rows],
             write: Callable[[Move, Rows], None], width: int = 3, dtype: torch.dtype = torch.float32,
             group: dist.ProcessGroup | None = None, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Carry out this rank's part of ``moves``. ``read(move)``: the piece's ``width`` rows of numel
    elements (the state tensors of the range: main values, exp_avg, exp_avg_sq), views where they
    can be: a [width, numel] tensor or a tuple of 1-D ones; ``write(move, piece)`` installs such
    rows. Ranks are ranks of ``group``. Returns the bytes this rank received.

    Each (source, destination) pair's pieces go in messages of at most ``chunk_bytes`` of ``dtype``,
    written into the new state as each arrives: one message's buffer at a time beside the state (a
    sender copies the rows straight into it, cast on the way: no stack, cast or concatenation of
    its own). Every rank walks the pairs in one global order with blocking sends and receives, so
    the first pair not yet done always has both its ends at it: pairs that swap pieces cannot
    deadlock."""
    pairs = collections.defaultdict(list)
    for m in moves:
        if rank in (m.src, m.dst):
            pairs[(m.src, m.dst)].append(m)
    for m in pairs.pop((rank, rank), ()):
        write(m, read(m))  # (the old state and the new are distinct tensors: straight across)
    elems = max(1, chunk_bytes // (width * dtype.itemsize))
    got = 0
    for (src, dst), ms in sorted(pairs.items()):
        pieces, message = _cut(ms, elems), []
        for i, piece in enumerate(pieces):
            message.append(piece)
            if i + 1 < len(pieces) and sum(m.numel for m in message) + pieces[i + 1].numel <= elems:
                continue  # (the next piece fits in this message too)
            buf = torch.empty(width * sum(m.numel for m in message), dtype=dtype, device=current())
            at = 0
            if src == rank:
                for m in message:
                    for row in read(m):
                        buf[at:at + m.numel].copy_(row.reshape(-1))
                        at += m.numel
                dist.send(buf, dst, group)
            else:
                dist.recv(buf, src, group)
                got += buf.numel() * buf.element_size()
                for m in message:
                    write(m, buf[at:at + width * m.numel].view(width, m.numel))
                    at += width * m.numel
            message = []
            del buf  # (freed before the next message's is allocated)
    return got


def state_io(ranges: Mapping[Range, tuple[torch.Tensor, ...]]
             ) -> tuple[Callable[[Move], Rows], Callable[[Move, Rows], None]]:
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

    def read(m: Move) -> tuple[torch.Tensor, ...]:
        a, tensors = find(m)
        return tuple(t.detach().reshape(-1)[m.start - a:m.end - a] for t in tensors)

    def write(m: Move, piece: Rows) -> None:
        a, tensors = find(m)
        with torch.no_grad():
            for t, row in zip(tensors, piece):
                t.reshape(-1)[m.start - a:m.end - a].copy_(row)

    return read, write


def described(ranges: Iterable[Range]) -> list[Range]:
    """What ``schedule`` needs of a rank's ``ha_state_ranges()``: [(key, start, end), ...]."""
    return sorted(ranges, key=lambda r: (str(r[0]), r[1]))
