"""What several ranks' answers share, sent once: a node agent's batch of answers to one order (a
status) holds, once, every part of their ``data`` that is the same for all of them, and for each rank
only what is its own (``launcher.relay.results_frame``). The controller puts each rank's answer back
together (``merged``) before it reads it, so nothing past the inbox sees the difference.

Two parts are the same when they are the same map key with the same msgpack encoding (True is not 1,
1 is not 1.0); maps within maps are split the same way, so a status that differs only in one group's
members shares the rest of its communicators' section.

A node's heartbeats go the same way, as columns (``as_columns``): what every rank's says alike (its
iteration, phase, health) once, the rest (its pid, its step's own work) one value a rank. Each rank's
heartbeat is read again from them (``rows``) before it is taken as its own.
"""
from __future__ import annotations

import math
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
    if isinstance(head, (list, dict)):
        packed = msgpack.packb(head)
        return all(msgpack.packb(v) == packed for v in values[1:])
    # (scalars: equal and of one type is one encoding, but for the sign of a zero; judged in C, as a
    # node's heartbeats are folded field by field at every beat)
    if values.count(head) != len(values) or len(set(map(type, values))) != 1:
        return False
    return type(head) is not float or head != 0.0 or len({math.copysign(1.0, v) for v in values}) == 1


def as_columns(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Several ranks' messages of one type (a node's heartbeats) as one: their ranks (``ranks``), each
    field that all of them have alike once (``same``), and each other field as a column (``each``: a
    value a rank, in the order of ``ranks``, None where one lacks it). ``rows`` undoes it. None is no
    field's value in the messages folded this way (a heartbeat's fields are numbers, text, flags, maps)."""
    fields: dict[str, list[Any]] = {}
    n = len(messages)
    for i, msg in enumerate(messages):
        for key, value in msg.items():
            column = fields.get(key)
            if column is None:
                column = fields[key] = [None] * n
            column[i] = value
    for key in ("v", "t", "rank"):
        fields.pop(key, None)
    same, each = {}, {}
    for key, values in fields.items():
        if _alike(values):  # (a column with a None, where a rank's lacks the field, is never alike)
            same[key] = values[0]
        else:
            each[key] = values
    return {"ranks": [m["rank"] for m in messages], **({"same": same} if same else {}),
            **({"each": each} if each else {})}


def rows(columns: dict[str, Any]) -> list[dict[str, Any]]:
    """Each rank's message again (``rank`` and its fields; without ``v`` and ``t``) from ``as_columns``."""
    same, each = columns.get("same") or {}, columns.get("each") or {}
    out = []
    for i, rank in enumerate(columns["ranks"]):
        row = dict(same)
        row["rank"] = rank
        for key, values in each.items():
            value = values[i]
            if value is not None:
                row[key] = value
        out.append(row)
    return out
