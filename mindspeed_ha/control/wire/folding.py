"""What several ranks' answers share, sent once: a node agent's batch of answers to one order (a
status) holds, once, every part of their ``data`` that is the same for all of them, and for each rank
only what is its own (``launcher.relay.results_frame``). The controller puts each rank's answer back
together (``merged``) before it reads it, so nothing past the inbox sees the difference.

Two parts are the same when they are the same map key with the same msgpack encoding (True is not 1,
1 is not 1.0); maps within maps are split the same way, so a status that differs only in one group's
members shares the rest of its communicators' section.
"""
from __future__ import annotations

from typing import Any

import msgpack


def split_common(datas: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the parts every map of ``datas`` has alike, what each has of its own); ``merged`` undoes it."""
    common: dict[str, Any] = {}
    own: list[dict[str, Any]] = [{} for _ in datas]
    first = datas[0]
    for key, value in first.items():
        values = [d.get(key, _MISSING) for d in datas]
        if all(v is not _MISSING for v in values):
            if all(isinstance(v, dict) for v in values):
                shared, theirs = split_common(values)
                if shared or not any(theirs):  # (maps all empty are alike too)
                    common[key] = shared
                    for mine, part in zip(own, theirs):
                        if part:
                            mine[key] = part
                    continue
            elif _alike(values):
                common[key] = value
                continue
        for mine, v in zip(own, values):
            if v is not _MISSING:
                mine[key] = v
    for mine, d in zip(own, datas):  # (keys the first map lacks)
        for key, value in d.items():
            if key not in first:
                mine[key] = value
    return common, own


def merged(common: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """One answer's ``data`` again: ``common`` with ``own`` over it (maps within maps merged too)."""
    out = dict(common)
    for key, value in own.items():
        base = out.get(key)
        out[key] = merged(base, value) if isinstance(base, dict) and isinstance(value, dict) else value
    return out


class _Missing:
    pass


_MISSING = _Missing()


def _alike(values: list[Any]) -> bool:
    head = values[0]
    if isinstance(head, (list, dict)) or type(head) is float:
        packed = msgpack.packb(head)
        return all(msgpack.packb(v) == packed for v in values[1:])
    return all(type(v) is type(head) and v == head for v in values[1:])
